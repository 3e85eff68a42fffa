//! Moving a shard, so far its pre-flight: every problem that stops a move is listed at
//! once, by host, and nothing changes.

use shardline_ops::moves::preflight;
use shardline_testkit::harness::{TestContext, TestResult};

use crate::bootstrap::{Fixture, cli, cli_full, options, quiet};

async fn leftovers(f: &Fixture, ctx: &TestContext) -> Result<Vec<i64>, crate::bootstrap::BoxError> {
    let mut out = Vec::new();
    for h in 0..3 {
        let c = f.client(ctx, h).await?;
        let row = c
            .query_one(
                "SELECT (SELECT count(*) FROM pg_subscription WHERE subname LIKE 'shardline%')
                      + (SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'shardline%')
                      + (SELECT count(*) FROM pg_publication)",
                &[],
            )
            .await?;
        out.push(row.get(0));
    }
    Ok(out)
}

pub(crate) async fn a_moves_preflight_lists_every_problem_and_changes_nothing(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;

    // A healthy cluster: the move can go ahead; the target reached the source.
    let ok = preflight(&config, 0, "pg2").await?;
    assert!(ok.is_ok(), "{ok}");
    assert_eq!((ok.source.as_str(), ok.target.as_str(), ok.schema.as_str()), ("pg1", "pg2", "shard_0000"));
    assert!(ok.bytes > 0);
    let said = cli(&f, &["move", "0", "--to", "pg2", "--dry-run"]).await?;
    assert!(said.ends_with("pre-flight: ok\n"), "{said}");
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0], "the reachability probe left nothing behind");

    // Break five things at once.
    let (pg1, pg2) = (f.client(&ctx, 0).await?, f.client(&ctx, 1).await?);
    pg1.batch_execute("CREATE TABLE shard_0000.audit (at timestamptz, what text)").await?;
    pg2.batch_execute("CREATE SCHEMA shard_0000").await?;
    pg1.execute(
        "INSERT INTO shardline.moves (shard, source, target, step, state) VALUES (0, 'pg1', 'pg3', 'copy', 'running')",
        &[],
    )
    .await?;
    f.migration("0005_tags.sql", "CREATE TABLE tags (id bigint PRIMARY KEY DEFAULT next_id(), tag text);")?;
    let bad = preflight(&f.config()?, 0, "pg2").await?;
    let found: Vec<(Option<&str>, &str)> =
        bad.problems.iter().map(|p| (p.host.as_deref(), p.check)).collect();
    assert_eq!(
        found,
        vec![
            (None, "journal"),
            (Some("pg1"), "replica identity"),
            (Some("pg1"), "migrations"),
            (Some("pg2"), "schema"),
        ],
        "{bad}"
    );
    let text = bad.to_string();
    assert!(
        text.contains("pg1: replica identity: shard_0000.audit has no primary key or replica identity"),
        "{text}"
    );
    assert!(text.contains("missing or changed: [0005_tags.sql]"), "{text}");
    assert!(text.contains("pg2: schema: shard_0000 is already there"), "{text}");
    let (out, err) = cli_full(&f, &["move", "0", "--to", "pg2", "--dry-run"]).await;
    assert_eq!(err.unwrap_err(), "pre-flight found 4 problem(s); nothing was changed");
    assert!(out.contains("pre-flight: 4 problem(s):"), "{out}");

    // The target itself: unknown, or where the shard already is.
    let unknown = preflight(&f.config()?, 0, "pg9").await?;
    assert_eq!(
        unknown.problems[0].to_string(),
        "target: pg9 is not a host of the config (hosts: pg1, pg2, pg3)"
    );
    let same = preflight(&f.config()?, 0, "pg1").await?;
    assert!(same.problems.iter().any(|p| p.to_string() == "target: shard 0 is already on pg1"), "{same}");
    // An out-of-range shard is an error, not a problem list.
    let err = preflight(&f.config()?, 6, "pg2").await.unwrap_err().to_string();
    assert_eq!(err, "logical shard 6 is out of range 0..6");

    // The target cannot reach the source at its peer URL: said, without the password.
    std::fs::remove_file(f.path().with_file_name("migrations").join("0005_tags.sql"))?;
    let text = std::fs::read_to_string(f.path())?;
    let first_peer = text.lines().find(|l| l.starts_with("peer_url")).ok_or("a peer_url")?.to_owned();
    std::fs::write(
        f.path(),
        text.replacen(&first_peer, "peer_url = \"postgresql://postgres:sekret@127.0.0.1:1/nowhere\"", 1),
    )?;
    // Shard 2 is on pg2: pg1's peer URL does not matter to its move.
    let cut = preflight(&f.config()?, 2, "pg1").await?;
    assert!(cut.is_ok(), "pg1's peer URL only matters when pg1 is the source: {cut}");
    let cut = preflight(&f.config()?, 1, "pg3").await?;
    let reach: Vec<String> =
        cut.problems.iter().filter(|p| p.check == "reaches the source").map(ToString::to_string).collect();
    assert_eq!(reach.len(), 1, "{cut}");
    assert!(
        reach[0].starts_with("pg3: reaches the source: cannot connect to the source at its peer_url"),
        "{}",
        reach[0]
    );
    assert!(!cut.to_string().contains("sekret"), "{cut}");

    assert_eq!(
        leftovers(&f, &ctx).await?,
        vec![0, 0, 0],
        "no check left a slot, publication or subscription"
    );
    Ok(())
}
