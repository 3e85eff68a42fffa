//! Hosts reach each other: logical replication from one host to another works.

use std::time::{Duration, Instant};

use shardline_testkit::harness::{TestContext, TestResult};

shardline_testkit::register!(shared: logical_replication_delivers_a_row);
pub(crate) async fn logical_replication_delivers_a_row(ctx: TestContext) -> TestResult {
    let db = ctx.databases().await?;
    let (source, target) = (&ctx.hosts()[0], &ctx.hosts()[1]);
    let src = source.connect(&db).await?;
    let dst = target.connect(&db).await?;
    let ddl = "CREATE TABLE photos (id bigint PRIMARY KEY, caption text NOT NULL)";
    src.batch_execute(ddl).await?;
    dst.batch_execute(ddl).await?;
    src.batch_execute(
        "INSERT INTO photos VALUES (1, 'before the subscription'); CREATE PUBLICATION pub FOR TABLE photos",
    )
    .await?;
    // The target dials the source at the address peers use (a container name on the
    // docker network; loopback for local processes).
    let conninfo = source.peer_url(&db);
    dst.batch_execute(&format!("CREATE SUBSCRIPTION sub CONNECTION '{conninfo}' PUBLICATION pub")).await?;
    src.execute("INSERT INTO photos VALUES (2, 'streamed')", &[]).await?;

    let deadline = Instant::now() + Duration::from_secs(60);
    let rows = loop {
        let rows: Vec<(i64, String)> = dst
            .query("SELECT id, caption FROM photos ORDER BY id", &[])
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        if rows.len() == 2 || Instant::now() > deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Drop the subscription (and with it the slot on the source) before judging.
    dst.batch_execute("DROP SUBSCRIPTION sub").await?;
    assert_eq!(
        rows,
        [(1, "before the subscription".to_owned()), (2, "streamed".to_owned())],
        "the target did not receive the source's rows within 60 s"
    );
    let slots: i64 = src
        .query_one("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()", &[])
        .await?
        .get(0);
    assert_eq!(slots, 0, "DROP SUBSCRIPTION left a slot on the source");
    Ok(())
}
