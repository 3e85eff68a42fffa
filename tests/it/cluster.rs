//! The cluster itself: hosts start, are independent, and are configured for moves.

use shardline_testkit::BackendKind;
use shardline_testkit::harness::{TestContext, TestResult};

shardline_testkit::register!(shared: three_independent_hosts_start);
pub(crate) async fn three_independent_hosts_start(ctx: TestContext) -> TestResult {
    let hosts = ctx.hosts();
    assert_eq!(hosts.len(), 3);
    let mut ids = Vec::new();
    for host in hosts {
        let client = host.connect("postgres").await?;
        let row = client
            .query_one("SELECT current_setting('server_version_num')::int, system_identifier::text FROM pg_control_system()", &[])
            .await?;
        let version: i32 = row.get(0);
        assert!((150_000..160_000).contains(&version), "{} runs {version}, not PostgreSQL 15", host.name());
        ids.push(row.get::<_, String>(1));
    }
    // Three separate initdb's... or three copies of one template: then the control data
    // is shared, so check the servers are distinct processes on distinct ports instead.
    let mut ports: Vec<u16> = hosts.iter().map(|h| h.endpoint().port).collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), 3, "hosts share a port: {ports:?}");
    let mut names: Vec<&str> = hosts.iter().map(|h| h.name()).collect();
    names.dedup();
    assert_eq!(names, ["pg1", "pg2", "pg3"]);
    assert_eq!(ids.len(), 3);
    Ok(())
}

shardline_testkit::register!(shared: backend_is_the_one_asked_for);
pub(crate) async fn backend_is_the_one_asked_for(ctx: TestContext) -> TestResult {
    match BackendKind::from_env()? {
        Some(asked) => assert_eq!(ctx.cluster().backend(), asked),
        None => eprintln!("SHARDLINE_TEST_BACKEND unset; the kit chose {}", ctx.cluster().backend()),
    }
    Ok(())
}

shardline_testkit::register!(shared: a_table_made_on_one_host_is_absent_on_the_others);
pub(crate) async fn a_table_made_on_one_host_is_absent_on_the_others(ctx: TestContext) -> TestResult {
    let db = ctx.databases().await?;
    let hosts = ctx.hosts();
    let first = hosts[0].connect(&db).await?;
    first
        .batch_execute("CREATE TABLE only_here (id bigint PRIMARY KEY); INSERT INTO only_here VALUES (1)")
        .await?;
    let found: Option<String> = first.query_one("SELECT to_regclass('only_here')::text", &[]).await?.get(0);
    assert_eq!(found.as_deref(), Some("only_here"));
    for host in &hosts[1..] {
        let client = host.connect(&db).await?;
        let found: Option<String> =
            client.query_one("SELECT to_regclass('only_here')::text", &[]).await?.get(0);
        assert_eq!(found, None, "table made on pg1 is visible on {}", host.name());
    }
    Ok(())
}

shardline_testkit::register!(shared: tests_get_separate_databases);
pub(crate) async fn tests_get_separate_databases(ctx: TestContext) -> TestResult {
    let a = ctx.databases().await?;
    let b = ctx.databases().await?;
    assert_ne!(a, b);
    let host = &ctx.hosts()[1];
    host.connect(&a).await?.batch_execute("CREATE TABLE mine (x int)").await?;
    let other = host.connect(&b).await?;
    let found: Option<String> = other.query_one("SELECT to_regclass('mine')::text", &[]).await?.get(0);
    assert_eq!(found, None, "a table of database {a} is visible in {b}");
    Ok(())
}

shardline_testkit::register!(shared: hosts_run_with_the_settings_moves_need);
pub(crate) async fn hosts_run_with_the_settings_moves_need(ctx: TestContext) -> TestResult {
    for host in ctx.hosts() {
        let client = host.connect("postgres").await?;
        for (setting, wanted) in [("wal_level", "logical"), ("fsync", "off")] {
            let value: String = client.query_one("SELECT current_setting($1)", &[&setting]).await?.get(0);
            assert_eq!(value, wanted, "{setting} on {}", host.name());
        }
        for setting in ["max_replication_slots", "max_wal_senders"] {
            let value: String = client.query_one("SELECT current_setting($1)", &[&setting]).await?.get(0);
            assert!(value.parse::<u32>()? >= 16, "{setting} = {value} on {}", host.name());
        }
    }
    Ok(())
}
