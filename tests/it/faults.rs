//! Fault handles: what a tokio-postgres client sees when a host stops, crashes or hangs,
//! and that the host comes back with its data. These tests run alone (exclusive), and the
//! harness heals every host after each.

use std::time::Duration;

use shardline_testkit::harness::{TestContext, TestResult};
use shardline_testkit::{Error, Host, HostState};
use tokio::task::JoinHandle;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls};

/// Connects and keeps the connection task's handle, to see how the connection ended.
async fn watched(
    host: &Host,
    db: &str,
) -> Result<(Client, JoinHandle<Result<(), tokio_postgres::Error>>), tokio_postgres::Error> {
    let (client, connection) = host.config(db).connect(NoTls).await?;
    Ok((client, tokio::spawn(connection)))
}

async fn ended(
    task: JoinHandle<Result<(), tokio_postgres::Error>>,
) -> Result<Result<(), tokio_postgres::Error>, Box<dyn std::error::Error + Send + Sync>> {
    Ok(tokio::time::timeout(Duration::from_secs(30), task).await??)
}

async fn count(client: &Client) -> Result<i64, tokio_postgres::Error> {
    Ok(client.query_one("SELECT count(*) FROM events", &[]).await?.get(0))
}

shardline_testkit::register!(exclusive: stop_ends_sessions_and_start_brings_data_back);
pub(crate) async fn stop_ends_sessions_and_start_brings_data_back(ctx: TestContext) -> TestResult {
    let db = ctx.databases().await?;
    let host = &ctx.hosts()[2];
    let (client, connection) = watched(host, &db).await?;
    client
        .batch_execute(
            "CREATE TABLE events (id int PRIMARY KEY); INSERT INTO events SELECT generate_series(1, 500)",
        )
        .await?;

    host.stop().await?;
    assert_eq!(host.state(), HostState::Stopped);
    // A clean shutdown tells each session why it ends: FATAL 57P01 admin_shutdown.
    let why = ended(connection).await?.expect_err("the connection should end with an error");
    assert_eq!(why.code(), Some(&SqlState::ADMIN_SHUTDOWN), "stop ended the session with {why}");
    assert!(client.simple_query("SELECT 1").await.is_err(), "a query on a stopped host succeeded");
    assert!(client.is_closed());
    match host.connect(&db).await {
        Err(Error::Postgres { .. }) => {}
        other => panic!("connecting to a stopped host should be refused at once, got {other:?}"),
    }

    host.start().await?;
    assert_eq!(host.state(), HostState::Running);
    assert_eq!(count(&host.connect(&db).await?).await?, 500);
    Ok(())
}

shardline_testkit::register!(exclusive: kill_crashes_and_start_recovers_committed_rows);
pub(crate) async fn kill_crashes_and_start_recovers_committed_rows(ctx: TestContext) -> TestResult {
    let db = ctx.databases().await?;
    let host = &ctx.hosts()[0];
    let (client, connection) = watched(host, &db).await?;
    client
        .batch_execute(
            "CREATE TABLE events (id int PRIMARY KEY); INSERT INTO events SELECT generate_series(1, 1000)",
        )
        .await?;
    // A transaction in flight at the crash must vanish.
    let (open, _open_connection) = watched(host, &db).await?;
    open.batch_execute("BEGIN; INSERT INTO events SELECT generate_series(1001, 2000)").await?;
    let started_before: String =
        client.query_one("SELECT pg_postmaster_start_time()::text", &[]).await?.get(0);

    host.kill().await?;
    assert_eq!(host.state(), HostState::Killed);
    // A crash sends no goodbye: however the connection ends, it carries no SQLSTATE.
    if let Err(why) = ended(connection).await? {
        assert_eq!(why.code(), None, "a SIGKILLed server cannot send an error, got {why}");
    }
    assert!(client.simple_query("SELECT 1").await.is_err(), "a query on a killed host succeeded");
    assert!(open.batch_execute("COMMIT").await.is_err(), "a commit on a killed host succeeded");
    assert!(host.connect(&db).await.is_err(), "connected to a killed host");

    host.start().await?;
    let client = host.connect(&db).await?;
    assert_eq!(count(&client).await?, 1000, "crash recovery lost committed rows or kept uncommitted ones");
    let started_after: String =
        client.query_one("SELECT pg_postmaster_start_time()::text", &[]).await?.get(0);
    assert_ne!(started_before, started_after, "the server was not restarted");
    Ok(())
}

shardline_testkit::register!(own: pause_makes_queries_time_out_and_resume_answers_them);
pub(crate) async fn pause_makes_queries_time_out_and_resume_answers_them(_ctx: TestContext) -> TestResult {
    crate::moves::on_own_kit(2, &[], |kit| Box::pin(pause_on(kit))).await
}

async fn pause_on(kit: &shardline_testkit::Cluster) -> Result<(), crate::bootstrap::BoxError> {
    let db = "paused";
    kit.create_database(db).await?;
    let host = &kit.hosts()[1];
    let client = host.connect(db).await?;
    client.batch_execute("CREATE TABLE events (id int PRIMARY KEY); INSERT INTO events VALUES (1)").await?;

    host.pause().await?;
    assert_eq!(host.state(), HostState::Paused);
    // A hung host neither answers nor refuses: only the caller's timeout ends the wait.
    let query =
        tokio::time::timeout(Duration::from_secs(2), client.query_one("SELECT count(*) FROM events", &[]))
            .await;
    assert!(query.is_err(), "a paused host answered a query: {query:?}");
    let connecting = tokio::time::timeout(Duration::from_secs(2), host.config(db).connect(NoTls)).await;
    assert!(connecting.is_err(), "a paused host completed a connection");
    // The kit's own connect gives up with a timeout error rather than hanging.
    match host.connect(db).await {
        Err(Error::Timeout { .. }) => {}
        other => panic!("connecting to a paused host should time out, got {other:?}"),
    }

    host.resume().await?;
    assert_eq!(host.state(), HostState::Running);
    // The connection that waited is still usable, and new ones are accepted.
    let answer = tokio::time::timeout(Duration::from_secs(10), count(&client)).await??;
    assert_eq!(answer, 1);
    assert_eq!(count(&host.connect(db).await?).await?, 1);
    Ok(())
}

shardline_testkit::register!(exclusive: restart_keeps_the_url_and_the_data);
pub(crate) async fn restart_keeps_the_url_and_the_data(ctx: TestContext) -> TestResult {
    let db = ctx.databases().await?;
    let host = &ctx.hosts()[1];
    let url = host.url(&db);
    let client = host.connect(&db).await?;
    client
        .batch_execute(
            "CREATE TABLE events (id int PRIMARY KEY); INSERT INTO events SELECT generate_series(1, 42)",
        )
        .await?;
    let before: String = client.query_one("SELECT pg_postmaster_start_time()::text", &[]).await?.get(0);

    host.restart().await?;
    assert_eq!(host.url(&db), url, "the host's URL changed across a restart");
    let (client, connection) = tokio_postgres::connect(&url, NoTls).await?;
    tokio::spawn(connection);
    assert_eq!(count(&client).await?, 42);
    let after: String = client.query_one("SELECT pg_postmaster_start_time()::text", &[]).await?.get(0);
    assert_ne!(before, after, "restart did not restart the server");
    Ok(())
}

shardline_testkit::register!(exclusive: handles_refuse_what_makes_no_sense);
pub(crate) async fn handles_refuse_what_makes_no_sense(ctx: TestContext) -> TestResult {
    let host = &ctx.hosts()[0];
    for (op, result) in [("resume", host.resume().await), ("start", host.start().await)] {
        match result {
            Err(Error::InvalidState { op: refused, state: "running", .. }) => assert_eq!(refused, op),
            other => panic!("{op} on a running host should be refused, got {other:?}"),
        }
    }
    host.stop().await?;
    match host.pause().await {
        Err(Error::InvalidState { op: "pause", state: "stopped", .. }) => {}
        other => panic!("pause on a stopped host should be refused, got {other:?}"),
    }
    assert_eq!(host.state(), HostState::Stopped, "a refused operation changed the state");
    host.start().await?;
    host.connect("postgres").await?.simple_query("SELECT 1").await?;
    Ok(())
}
