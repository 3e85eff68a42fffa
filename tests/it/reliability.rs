//! The product as a whole under faults and hostile input: a pool exhausted by a
//! connection storm, the catalog host down, passwords kept out of every error, log line
//! and JSON output.

use std::io::Write as _;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use shardline_example_photos::{NewPhoto, Photo};
use shardline_ops::moves::{self, MoveOptions, Step};
use shardline_repo::{Cluster, ClusterOptions, Id};
use shardline_testkit::harness::{TestContext, TestResult};

use crate::bootstrap::{Fixture, cli_full, options, quiet};

shardline_testkit::register!(shared: an_exhausted_pool_times_out_clearly_and_recovers);
pub(crate) async fn an_exhausted_pool_times_out_clearly_and_recovers(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let o = ClusterOptions {
        pool_size: 2,
        // The hogs' 0.3 s statements stay well within it on a loaded machine (500 ms
        // was once too little in the full suite).
        host_timeout: Duration::from_millis(800),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::connect(&f.config()?, o).await?;
    let photos = cluster.repo::<Photo>()?;
    let p = photos.insert(&NewPhoto::numbered(0, 1)).await?;
    // A storm: both of pg1's connections held by slow transactions.
    let shard = cluster.route_user(0).shard;
    let hogs: Vec<_> = (0..2)
        .map(|_| {
            let c = cluster.clone();
            tokio::spawn(async move {
                c.transaction(shard, |tx| {
                    // 2.4 s in all, each statement within the host timeout.
                    Box::pin(async move {
                        for _ in 0..8 {
                            tx.execute("SELECT pg_sleep(0.3)", &[]).await?;
                        }
                        Ok::<_, shardline_repo::Error>(())
                    })
                })
                .await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    let err = photos.get(p.id).await.unwrap_err();
    let waited = t.elapsed();
    assert!(err.is_timeout() && err.is_retryable(), "{err}");
    assert!(err.to_string().starts_with("host pg1: no connection:"), "{err}");
    // The storm has 2.2 s left when the caller starts; the pool's wait is 0.8 s.
    assert!(waited < Duration::from_millis(1600), "the caller waited {waited:?}, not the storm's 2.2 s");
    // Other hosts are untouched by pg1's storm.
    let other = photos.insert(&NewPhoto::numbered(2, 1)).await?;
    assert_eq!(cluster.route_id(other.id)?.host.as_str(), "pg2");
    for h in hogs {
        h.await??;
    }
    // The storm over, the pool serves again.
    assert_eq!(photos.get(p.id).await?, Some(p));
    Ok(())
}

/// Sessions of `client`'s database (other than its own) waiting on a lock, once there
/// are none or 5 s have passed.
async fn lock_waits_after_5_s(client: &tokio_postgres::Client) -> Result<i64, crate::bootstrap::BoxError> {
    let waiting = "SELECT count(*) FROM pg_stat_activity
                   WHERE datname = current_database() AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'";
    let mut left = -1;
    for _ in 0..50 {
        left = client.query_one(waiting, &[]).await?.get(0);
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(left)
}

shardline_testkit::register!(shared: a_write_that_timed_out_is_cancelled_and_holds_up_no_one);
/// An insert waits on a lock another session holds on its shard's table past
/// `host_timeout`: it fails with a timeout, and then
/// - the next statement on that host, on another shard, answers within the timeout,
///   although the pool holds one connection (the timed-out one is handed out again only
///   once its insert was cancelled: before, the next statement waited behind it and
///   timed out too);
/// - the insert is cancelled on the server: it leaves the lock's queue, and when the lock
///   goes it does not commit after the caller was told it timed out (before, it did);
/// - the same for a batch (`insert_many`), and for an insert whose caller stops waiting
///   (drops the future) before any timeout;
/// - in a shard transaction, such a statement ends the transaction (rolled back, and
///   cancelled on the server too), even when the closure carries on.
pub(crate) async fn a_write_that_timed_out_is_cancelled_and_holds_up_no_one(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    timed_out_statements_are_cancelled(&f, &ctx, &f.config_text()?).await
}

/// The body of [`a_write_that_timed_out_is_cancelled_and_holds_up_no_one`], with the
/// cluster's config `text` (pg1 direct, or through a pooler): on pg1.
pub(crate) async fn timed_out_statements_are_cancelled(
    f: &Fixture,
    ctx: &TestContext,
    text: &str,
) -> TestResult {
    let timeout = Duration::from_millis(800);
    let o = ClusterOptions { pool_size: 1, host_timeout: timeout, ..ClusterOptions::default() };
    let cluster = Cluster::connect(&f.config_from(text)?, o).await?;
    let photos = cluster.repo::<Photo>()?;
    let on_pg1 = |skip: Option<shardline_router::LogicalShard>| {
        (0..1000).find(|u| {
            let r = cluster.route_user(*u);
            r.host.as_str() == "pg1" && Some(r.shard) != skip
        })
    };
    let user = on_pg1(None).ok_or("no shard on pg1")?;
    let route = cluster.route_user(user);
    let other = on_pg1(Some(route.shard)).ok_or("no other shard on pg1")?;
    photos.insert(&NewPhoto::numbered(user, 1)).await?;
    let side = f.client(ctx, 0).await?;
    side.batch_execute(&format!(
        "BEGIN; LOCK TABLE {}.photos IN ACCESS EXCLUSIVE MODE",
        route.schema.quoted()
    ))
    .await?;

    let t = Instant::now();
    let err = photos.insert(&NewPhoto::numbered(user, 2)).await.unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(t.elapsed() < timeout * 2, "the insert failed after {:?}", t.elapsed());
    let t = Instant::now();
    photos.insert(&NewPhoto::numbered(other, 1)).await?;
    assert!(t.elapsed() < timeout, "the next statement on the host took {:?}", t.elapsed());
    // A batch the same way.
    let err = photos.insert_many(&[NewPhoto::numbered(user, 3)]).await.unwrap_err();
    assert!(err.is_timeout(), "{err}");
    // An insert whose caller stops waiting (drops the future) before any timeout.
    let dropped =
        tokio::time::timeout(Duration::from_millis(200), photos.insert(&NewPhoto::numbered(user, 4))).await;
    assert!(dropped.is_err(), "the insert should still wait on the lock");
    let t = Instant::now();
    photos.insert(&NewPhoto::numbered(other, 2)).await?;
    assert!(t.elapsed() < timeout, "after a dropped caller, the next statement took {:?}", t.elapsed());

    // In a shard transaction, a statement that times out ends the transaction: the
    // closure swallows the error, and the transaction answers that it rolled back.
    let outcome = cluster
        .transaction(route.shard, |tx| {
            Box::pin(async move {
                let err = tx.execute("SELECT count(*) FROM photos", &[]).await.unwrap_err();
                assert!(err.is_timeout(), "{err}");
                Ok::<_, shardline_repo::Error>(())
            })
        })
        .await;
    assert!(matches!(outcome, Err(shardline_repo::Error::RolledBack { .. })), "{outcome:?}");

    // The inserts, the batch and the transaction's statement all leave the lock's queue
    // (cancelled), before the lock goes.
    assert_eq!(
        lock_waits_after_5_s(&side).await?,
        0,
        "a session still waits on the lock 5 s after the timeout"
    );
    side.batch_execute("COMMIT").await?;
    let rows: i64 = side
        .query_one(
            &format!("SELECT count(*) FROM {}.photos WHERE user_id = $1", route.schema.quoted()),
            &[&user],
        )
        .await?
        .get(0);
    assert_eq!(rows, 1, "an insert given up on committed after all");
    Ok(())
}

shardline_testkit::register!(shared: a_commit_that_timed_out_is_cancelled_and_never_lands);
/// A shard transaction whose `COMMIT` waits: its deferred foreign key checks the parent
/// row, which another session holds `FOR UPDATE`. The `COMMIT` times out, the
/// transaction's connection is given up on, and the waiting `COMMIT` is cancelled: it
/// leaves the lock's queue within 5 s, and once the row is free the child row is not
/// there (before, the `COMMIT` went on waiting and committed then).
pub(crate) async fn a_commit_that_timed_out_is_cancelled_and_never_lands(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 1, 2).await?;
    f.migration(
        "0005_kids.sql",
        "CREATE TABLE parents (id bigint PRIMARY KEY);
         CREATE TABLE kids (id bigint PRIMARY KEY DEFAULT next_id(),
                            parent bigint NOT NULL REFERENCES parents DEFERRABLE INITIALLY DEFERRED);",
    )?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let o = ClusterOptions { host_timeout: Duration::from_millis(800), ..ClusterOptions::default() };
    let cluster = Cluster::connect(&f.config()?, o).await?;
    let route = cluster.route_user(0);
    let side = f.client(&ctx, 0).await?;
    let schema = route.schema.quoted();
    side.batch_execute(&format!("INSERT INTO {schema}.parents VALUES (1)")).await?;
    side.batch_execute(&format!("BEGIN; SELECT * FROM {schema}.parents WHERE id = 1 FOR UPDATE")).await?;
    let outcome = cluster
        .transaction(route.shard, |tx| {
            Box::pin(async move { tx.execute("INSERT INTO kids (parent) VALUES (1)", &[]).await.map(drop) })
        })
        .await;
    let err = outcome.expect_err("the COMMIT waits on the parent row past the timeout");
    assert!(err.is_timeout(), "{err}");
    assert_eq!(
        lock_waits_after_5_s(&side).await?,
        0,
        "the COMMIT still waits on the parent row 5 s after it timed out"
    );
    side.batch_execute("COMMIT").await?;
    let kids: i64 = side.query_one(&format!("SELECT count(*) FROM {schema}.kids"), &[]).await?.get(0);
    assert_eq!(kids, 0, "the transaction whose COMMIT timed out committed after all");
    Ok(())
}

shardline_testkit::register!(shared: a_fan_out_that_timed_out_cancels_every_statement_it_queued);
/// A fan-out over one host's four shards, one statement per shard pipelined on the one
/// pooled connection, while another session holds two of the shards' tables: the host
/// times out (its shards are named missing), and every statement it had queued is
/// cancelled in turn (cancelling once ends only the one running: the next then waits on
/// the other lock), within 5 s. Cleanly ended, the connection goes back to the pool:
/// the next statement runs on the same server session.
pub(crate) async fn a_fan_out_that_timed_out_cancels_every_statement_it_queued(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 1, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let timeout = Duration::from_millis(800);
    let o =
        ClusterOptions { pool_size: 1, host_timeout: timeout, fan_out_batch: 1, ..ClusterOptions::default() };
    let cluster = Cluster::connect(&f.config()?, o).await?;
    let photos = cluster.repo::<Photo>()?;
    let start = std::time::SystemTime::now() - Duration::from_secs(1);
    for user in 0..4 {
        photos.insert(&NewPhoto::numbered(user, 1)).await?;
    }
    let host = cluster.route_user(0).host;
    let pid = "SELECT pg_backend_pid()";
    let first: i32 = cluster.client(&host).await?.query_one(pid, &[]).await?.get(0);
    let side = f.client(&ctx, 0).await?;
    side.batch_execute("BEGIN; LOCK TABLE shard_0001.photos, shard_0002.photos IN ACCESS EXCLUSIVE MODE")
        .await?;
    let now = std::time::SystemTime::now() + Duration::from_secs(1);
    let part = photos.created_between(start, now, 100).await?;
    assert!(!part.is_complete(), "the locked shards cannot answer in time");
    assert_eq!(
        lock_waits_after_5_s(&side).await?,
        0,
        "a queued statement still waits on a lock 5 s after the timeout"
    );
    let mut next = None;
    for _ in 0..50 {
        if let Ok(c) = cluster.client(&host).await {
            next = Some(c.query_one(pid, &[]).await?.get::<_, i32>(0));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(next, Some(first), "the connection, cleanly ended, is handed out again");
    side.batch_execute("COMMIT").await?;
    let all = photos.created_between(start, now, 100).await?;
    assert!(all.is_complete() && all.rows.len() == 4, "{:?}", all.missing);
    Ok(())
}

shardline_testkit::register!(exclusive: with_the_catalog_down_known_routes_work_and_map_changes_are_refused);
pub(crate) async fn with_the_catalog_down_known_routes_work_and_map_changes_are_refused(
    ctx: TestContext,
) -> TestResult {
    // Shards on pg1 and pg2; the catalog alone on pg3.
    let f = Fixture::new(&ctx, 2, 4).await?;
    let db = f.config()?.hosts[0].url.expose().rsplit('/').next().unwrap_or_default().to_owned();
    let text = std::fs::read_to_string(f.path())?;
    let old = text.lines().find(|l| l.starts_with("url = ")).ok_or("the catalog url")?.to_owned();
    std::fs::write(f.path(), text.replacen(&old, &format!("url = \"{}\"", ctx.hosts()[2].url(&db)), 1))?;
    let config = f.config()?;
    shardline_ops::init(&config, &options(1), &quiet).await?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let before = photos.insert(&NewPhoto::numbered(0, 1)).await?;

    ctx.hosts()[2].kill().await?;
    // Reads and writes on the known map go on.
    assert_eq!(photos.get(before.id).await?, Some(before.clone()));
    let during = photos.insert(&NewPhoto::numbered(3, 1)).await?;
    let many = photos.get_many(&[before.id, during.id]).await?;
    assert!(many.missing.is_empty());
    // Map changes and operations that need the catalog are refused, saying why.
    for args in [&["move", "0", "--to", "pg2"][..], &["migrate"], &["map"], &["moves"]] {
        let (out, result) = cli_full(&f, args).await;
        let err = result.unwrap_err();
        assert!(err.contains("catalog"), "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?} printed {out}");
    }
    ctx.hosts()[2].start().await?;
    // Back: the same handle reloads the map when asked.
    cluster.refresh().await?;
    assert_eq!(photos.get(during.id).await?, Some(during));
    Ok(())
}

/// Everything `tracing` prints in this process, once installed.
fn log_capture() -> Arc<Mutex<Vec<u8>>> {
    static BUF: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    BUF.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = Capture(buf.clone());
        let subscriber = tracing_subscriber::fmt()
            // Ours at debug, everyone else's warnings: every line shardline writes.
            .with_env_filter(
                "shardline=debug,shardline_repo=debug,shardline_ops=debug,shardline_testkit=debug,warn",
            )
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
        buf
    })
    .clone()
}

#[derive(Clone)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut v) = self.0.lock() {
            v.extend_from_slice(b);
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

shardline_testkit::register!(shared: passwords_never_reach_errors_logs_or_json);
pub(crate) async fn passwords_never_reach_errors_logs_or_json(ctx: TestContext) -> TestResult {
    let logs = log_capture();
    let secret = "Pa55-w0rd-never-printed";
    let f = Fixture::new(&ctx, 3, 6).await?;
    // Every URL (catalog, hosts, peers) carries the password.
    let text = std::fs::read_to_string(f.path())?;
    let with_password = text
        .replace("postgres://postgres@", &format!("postgres://postgres:{secret}@"))
        .replace("postgresql://postgres@", &format!("postgresql://postgres:{secret}@"));
    assert!(with_password.matches(secret).count() >= 7, "{with_password}");
    std::fs::write(f.path(), &with_password)?;
    let mut said = Vec::new();
    let (out, r) = cli_full(&f, &["init", "--json"]).await;
    r.map_err(|e| format!("init: {e}"))?;
    said.push(out);
    for args in [
        &["status", "--json"][..],
        &["map", "--json"],
        &["move", "0", "--to", "pg2", "--dry-run", "--json"],
        &["moves", "--json"],
        &["move", "0", "--to", "pg2", "--json"],
        &["gc", "--json", "--grace", "0s"],
    ] {
        let (out, r) = cli_full(&f, args).await;
        said.push(out);
        if let Err(e) = r {
            said.push(e);
        }
    }
    // Now make things fail: a host on a dead port, a peer URL that goes nowhere.
    let broken = with_password
        .replacen(&format!("{secret}@{}", host_port(&ctx, 2)), &format!("{secret}@127.0.0.1:1"), 1)
        .replacen("peer_url = \"postgresql://postgres:", "peer_url = \"postgresql://nobody:", 1)
        .replacen("peer_url = \"postgres://postgres:", "peer_url = \"postgres://nobody:", 1);
    std::fs::write(f.path(), broken)?;
    for args in [
        &["status", "--json"][..],
        &["init"],
        &["migrate"],
        &["move", "2", "--to", "pg1", "--dry-run"],
        &["move", "3", "--to", "pg3"],
        &["rebalance", "--plan"],
    ] {
        let (out, r) = cli_full(&f, args).await;
        said.push(out);
        said.push(r.err().unwrap_or_default());
    }
    // Through the library too: errors' Display and Debug.
    let config = f.config()?;
    if let Err(e) = Cluster::connect(&config, ClusterOptions::default()).await {
        said.push(format!("{e} {e:?}"));
    }
    if let Err(e) = shardline_ops::status(&config, Duration::from_secs(2)).await {
        said.push(format!("{e} {e:?}"));
    }
    said.push(format!("{config:?}"));
    let log = String::from_utf8_lossy(&logs.lock().map_err(|_| "log lock")?).into_owned();
    let all = said.join("\n");
    assert!(all.contains("127.0.0.1:1") || all.contains("pg3"), "the failures were reported: {all}");
    assert!(!all.contains(secret), "a password in output or errors:\n{all}");
    assert!(!log.contains(secret), "a password in the logs");
    let _ = std::io::stderr().flush();
    Ok(())
}

fn host_port(ctx: &TestContext, h: usize) -> String {
    let url = ctx.hosts()[h].url("x");
    url.trim_start_matches("postgres://postgres@").split('/').next().unwrap_or_default().to_owned()
}

shardline_testkit::register!(shared: the_request_path_needs_no_superuser);
pub(crate) async fn the_request_path_needs_no_superuser(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    // A role of this test's own (roles are per server), named in app_roles: it gets
    // what `init` grants (`shardline_ops::grants`), nothing more.
    let role = format!("app_{}", std::process::id());
    create_role(&f, &ctx, 2, &role).await?;
    let text = f.config_text()?;
    std::fs::write(f.path(), format!("app_roles = [\"{role}\"]\n{text}"))?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let operator = f.config()?;
    std::fs::write(
        f.path(),
        f.config_text()?.replace("postgres://postgres@", &format!("postgres://{role}@")),
    )?;
    let config = f.config()?;
    assert!(config.hosts[0].url.expose().contains(&role));
    // A handle that hears of no move (for the revert below).
    let stale = Cluster::connect(
        &config,
        ClusterOptions { listen: false, map_check: Duration::ZERO, ..ClusterOptions::default() },
    )
    .await?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let comments = cluster.repo::<shardline_example_photos::Comment>()?;
    let mut made = Vec::new();
    for round in 0..3u64 {
        // Idle long enough for the next insert to take the minter's catch-up path.
        tokio::time::sleep(Duration::from_millis(60)).await;
        made.extend(
            photos.insert_many(&(0..8).map(|u| NewPhoto::numbered(u, round)).collect::<Vec<_>>()).await?,
        );
    }
    let c = comments
        .insert(&shardline_example_photos::NewComment { photo_id: made[0].id, user_id: 9, body: "ok".into() })
        .await?;
    assert_eq!(photos.get(made[0].id).await?, Some(made[0].clone()));
    let ids: Vec<_> = made.iter().map(|p| p.id).collect();
    assert!(photos.get_many(&ids).await?.missing.is_empty());
    assert_eq!(photos.page_of_user(0, None, 10).await?.rows.len(), 3);
    let now = std::time::SystemTime::now();
    let window = photos.created_between(now - Duration::from_secs(60), now, 100).await?;
    assert_eq!((window.rows.len(), window.missing.len()), (24, 0));
    comments.delete(c.id).await?;
    let shard = cluster.route_user(0).shard;
    cluster
        .transaction(shard, |tx| {
            Box::pin(async move {
                tx.execute("UPDATE photos SET caption = 'edited' WHERE user_id = 0", &[]).await
            })
        })
        .await?;
    // And it cannot do what it was not granted: no DDL on a shard.
    let pg = shardline_repo::catalog::connect(&config.hosts[0].url, "host pg1").await?;
    let err = pg.batch_execute("DROP TABLE shard_0000.comments").await.unwrap_err();
    assert_eq!(err.code().map(|c| c.code()), Some("42501"), "{err}");
    // Nor borrow the function that lifts a copy's ID sequence's cap (SECURITY DEFINER,
    // the admin's): attached to a table of its own, it would raise any shard's cap, the
    // fence's included. (Before, EXECUTE was PUBLIC's and the trigger was made.)
    let err = pg
        .batch_execute(
            "CREATE TEMP TABLE marks (move_id bigint, decided text, schema_name text, sequence_max bigint);
             CREATE TRIGGER lift AFTER INSERT ON pg_temp.marks FOR EACH ROW
                 EXECUTE FUNCTION shardline.lift_copy_cap()",
        )
        .await
        .unwrap_err();
    assert_eq!(err.code().map(|c| c.code()), Some("42501"), "{err}");

    // A revert's old copy turns away a stale router's write as a moved shard's (3F000,
    // so the router finds the shard where it is), also for this role, which may not
    // read shardline's own tables (its guard checked them with the caller's rights and
    // failed with 42501).
    let from = stale.route_user(0).host;
    let to = if from.as_str() == "pg1" { "pg2" } else { "pg1" };
    moves::run(&operator, shard, &crate::host(to), &MoveOptions::default().revertible()).await?;
    let err = moves::revert(&operator, shard, &MoveOptions::default().stopping_after(Step::Prepared))
        .await
        .unwrap_err();
    assert!(matches!(err, shardline_ops::Error::Interrupted { step: Step::Prepared, .. }), "{err}");
    assert_eq!(stale.route_user(0).host, from, "the stale handle still sends the shard to its old copy");
    let p = stale.repo::<Photo>()?.insert(&NewPhoto::numbered(0, 77)).await?;
    assert_eq!(stale.route_user(0).host.as_str(), to);
    assert_eq!(photos.get(p.id).await?, Some(p));
    Ok(())
}

shardline_testkit::register!(shared: sql_injection_finds_no_way_in);
pub(crate) async fn sql_injection_finds_no_way_in(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    let text = std::fs::read_to_string(f.path())?;
    // Through the config: a schema prefix, a host name, a table-like migrations path.
    for (what, bad) in [
        (
            "schema_prefix",
            text.replacen(
                "logical_shards = 4",
                "logical_shards = 4\nschema_prefix = \"s\\\"; DROP SCHEMA shardline CASCADE; --\"",
                1,
            ),
        ),
        (
            "schema_prefix",
            text.replacen("logical_shards = 4", "logical_shards = 4\nschema_prefix = \"shard_ö_\"", 1),
        ),
        (
            "schema_prefix",
            text.replacen(
                "logical_shards = 4",
                &format!("logical_shards = 4\nschema_prefix = \"{}\"", "a".repeat(60)),
                1,
            ),
        ),
        ("name", text.replacen("name = \"pg1\"", "name = \"pg1'; DROP TABLE x; --\"", 1)),
        ("name", text.replacen("name = \"pg1\"", "name = \"pg 1\"", 1)),
    ] {
        std::fs::write(f.path(), &bad)?;
        let (out, r) = cli_full(&f, &["init"]).await;
        let err = r.unwrap_err();
        assert!(err.contains(what) && out.is_empty(), "{what}: {err}");
    }
    std::fs::write(f.path(), &text)?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    // Through values: stored as given, never run.
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let evil = "'); DROP TABLE photos; --\"; SELECT pg_sleep(10); $$ \\ \u{0}x";
    let evil = evil.replace('\u{0}', ""); // Postgres text cannot hold NUL; the driver refuses it
    let p = photos.insert(&NewPhoto { user_id: 1, url: evil.clone(), caption: evil.clone() }).await?;
    assert_eq!(photos.get(p.id).await?.map(|g| (g.url, g.caption)), Some((evil.clone(), evil)));
    // A NUL byte is refused with an error, not truncated or run.
    let nul = photos.insert(&NewPhoto { user_id: 1, url: "a\u{0}b".into(), caption: String::new() }).await;
    assert!(nul.is_err());
    // Through the CLI's arguments: a user or ID that is not a number never reaches SQL.
    for args in [&["locate", "--user", "1; DROP TABLE photos"][..], &["locate", "--id", "1 OR 1=1"]] {
        let (_, r) = cli_full(&f, args).await;
        assert!(r.is_err(), "{args:?}");
    }
    let n: i64 =
        f.client(&ctx, 0).await?.query_one("SELECT count(*) FROM shard_0001.photos", &[]).await?.get(0);
    assert_eq!(n, 1, "the table is there, with the one row");
    Ok(())
}

/// A hand-written `impl NewRow` (no derive checks it) for the photos table.
macro_rules! hand_written_new_photo {
    ($name:ident, $columns:expr) => {
        struct $name {
            user_id: i64,
            url: String,
        }
        impl shardline_repo::NewRow for $name {
            type Entity = Photo;
            const COLUMNS: &'static [&'static str] = $columns;
            fn shard_key(&self) -> shardline_repo::ShardKey {
                shardline_repo::ShardKey::User(self.user_id)
            }
            fn values(&self) -> Vec<&(dyn shardline_repo::tokio_postgres::types::ToSql + Sync)> {
                vec![&self.user_id, &self.url]
            }
        }
    };
}

shardline_testkit::register!(shared: a_hand_written_new_row_with_bad_columns_is_refused_before_any_sql);
/// A column of a hand-written `NewRow` that would close its quotes and write SQL of its
/// own (here: set the caption), or that Postgres would read otherwise (`URL`), or the
/// row's `id` (the shard mints it), is refused by `insert`, `insert_many` and a
/// transaction's `insert` before any SQL is built: nothing stored. The same row with
/// plain names goes in.
pub(crate) async fn a_hand_written_new_row_with_bad_columns_is_refused_before_any_sql(
    ctx: TestContext,
) -> TestResult {
    use shardline_repo::Error;

    const SNEAKY: &str = "url\", \"caption\") VALUES ($1, $2, 'injected') RETURNING *; --";
    hand_written_new_photo!(Plain, &["user_id", "url"]);
    hand_written_new_photo!(Sneaky, &["user_id", SNEAKY]);
    hand_written_new_photo!(Shouting, &["user_id", "URL"]);
    /// Gives the row's ID (another shard's), which the shard mints.
    struct WithId {
        id: Id,
        user_id: i64,
        url: String,
    }
    impl shardline_repo::NewRow for WithId {
        type Entity = Photo;
        const COLUMNS: &'static [&'static str] = &["id", "user_id", "url"];
        fn shard_key(&self) -> shardline_repo::ShardKey {
            shardline_repo::ShardKey::User(self.user_id)
        }
        fn values(&self) -> Vec<&(dyn shardline_repo::tokio_postgres::types::ToSql + Sync)> {
            vec![&self.id, &self.user_id, &self.url]
        }
    }

    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let url = || "https://cdn/1.jpg".to_owned();
    let plain = photos.insert(&Plain { user_id: 1, url: url() }).await?;
    assert_eq!((plain.url.as_str(), plain.caption.as_str()), ("https://cdn/1.jpg", ""));

    let refused = |r: Result<Vec<Photo>, Error>, name: &str, how: &str| match r {
        Err(Error::InvalidIdentifier { what: "column to insert", name: n }) if n == name => Ok(()),
        other => Err(format!("{how} with column {name:?}: {other:?}")),
    };
    refused(photos.insert(&Sneaky { user_id: 1, url: url() }).await.map(|p| vec![p]), SNEAKY, "insert")?;
    refused(photos.insert(&Shouting { user_id: 1, url: url() }).await.map(|p| vec![p]), "URL", "insert")?;
    let many: Vec<Sneaky> = (0..4).map(|user_id| Sneaky { user_id, url: url() }).collect();
    refused(photos.insert_many(&many).await, SNEAKY, "insert_many")?;
    let shard = cluster.route_user(1).shard;
    let in_tx = cluster
        .transaction(shard, |tx| {
            Box::pin(async move { tx.insert(&Sneaky { user_id: 1, url: url() }).await.map(|p| vec![p]) })
        })
        .await;
    refused(in_tx, SNEAKY, "a transaction's insert")?;
    // A row that gives its own ID (here another shard's): refused before anything is
    // sent. Before, it was written in user 1's shard, then reported misrouted, and every
    // read by its ID looked in the other shard.
    let elsewhere = Id::from_parts(1_800_000_000_000, u32::from(cluster.route_user(2).shard.get()), 0)?;
    assert_ne!(cluster.route_user(1).shard, cluster.route_user(2).shard);
    let with_id = || WithId { id: elsewhere, user_id: 1, url: url() };
    let gives_id = |r: Result<Vec<Photo>, Error>, how: &str| match r {
        Err(Error::Invalid { what }) if what.contains("gives photos.id, which the shard mints") => Ok(()),
        other => Err(format!("{how} with an ID: {other:?}")),
    };
    gives_id(photos.insert(&with_id()).await.map(|p| vec![p]), "insert")?;
    gives_id(photos.insert_many(&[with_id(), with_id()]).await, "insert_many")?;
    let in_tx = cluster
        .transaction(shard, |tx| Box::pin(async move { tx.insert(&with_id()).await.map(|p| vec![p]) }))
        .await;
    gives_id(in_tx, "a transaction's insert")?;

    // Only the plain row is stored, in any shard.
    let mut stored = Vec::new();
    for (_, rows) in cluster
        .for_each_shard(|tx| Box::pin(async move { tx.query("SELECT id, caption FROM photos", &[]).await }))
        .await
    {
        for row in rows? {
            stored.push((row.get::<_, Id>(0), row.get::<_, String>(1)));
        }
    }
    assert_eq!(stored, vec![(plain.id, String::new())]);
    Ok(())
}

shardline_testkit::register!(shared: a_hand_written_new_row_whose_key_is_not_what_it_stores_is_refused);
/// A hand-written `NewRow` whose `shard_key()` names another user than the one its
/// `user_id` stores would be written in that other user's shard, where a read by the
/// stored user never looks. `insert`, a transaction's `insert` and `insert_many` refuse
/// it before anything is sent: nothing stored. (Before: `insert` put it in the wrong
/// shard; `insert_many` rolled it back after sending it.)
pub(crate) async fn a_hand_written_new_row_whose_key_is_not_what_it_stores_is_refused(
    ctx: TestContext,
) -> TestResult {
    use shardline_repo::Error;
    struct Lying {
        user_id: i64,
        url: String,
    }
    impl shardline_repo::NewRow for Lying {
        type Entity = Photo;
        const COLUMNS: &'static [&'static str] = &["user_id", "url"];
        fn shard_key(&self) -> shardline_repo::ShardKey {
            shardline_repo::ShardKey::User(self.user_id + 1)
        }
        fn values(&self) -> Vec<&(dyn shardline_repo::tokio_postgres::types::ToSql + Sync)> {
            vec![&self.user_id, &self.url]
        }
    }

    /// Routed by its user, without giving the column that stores it.
    struct Keyless {
        user_id: i64,
        url: String,
    }
    impl shardline_repo::NewRow for Keyless {
        type Entity = Photo;
        const COLUMNS: &'static [&'static str] = &["url"];
        fn shard_key(&self) -> shardline_repo::ShardKey {
            shardline_repo::ShardKey::User(self.user_id)
        }
        fn values(&self) -> Vec<&(dyn shardline_repo::tokio_postgres::types::ToSql + Sync)> {
            vec![&self.url]
        }
    }

    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    assert_ne!(cluster.route_user(1).shard, cluster.route_user(2).shard);
    match photos.insert(&Keyless { user_id: 1, url: "https://cdn/1.jpg".to_owned() }).await {
        Err(Error::Invalid { what }) if what.contains("does not give photos.user_id") => {}
        other => return Err(format!("a row without its key column: {other:?}").into()),
    }
    /// Routed by a parent, for an entity placed by its user.
    struct Parented {
        user_id: i64,
        url: String,
        parent: Id,
    }
    impl shardline_repo::NewRow for Parented {
        type Entity = Photo;
        const COLUMNS: &'static [&'static str] = &["user_id", "url"];
        fn shard_key(&self) -> shardline_repo::ShardKey {
            shardline_repo::ShardKey::Parent(self.parent)
        }
        fn values(&self) -> Vec<&(dyn shardline_repo::tokio_postgres::types::ToSql + Sync)> {
            vec![&self.user_id, &self.url]
        }
    }
    let parent = Id::from_parts(1_800_000_000_000, u32::from(cluster.route_user(2).shard.get()), 0)?;
    match photos.insert(&Parented { user_id: 1, url: "https://cdn/1.jpg".to_owned(), parent }).await {
        Err(Error::Invalid { what })
            if what.contains("shard_key() is a parent but photos places its rows by user_id") => {}
        other => return Err(format!("a row routed by a parent: {other:?}").into()),
    }
    let lying = || Lying { user_id: 1, url: "https://cdn/1.jpg".to_owned() };
    let refused = |r: Result<Vec<Photo>, Error>, how: &str| match r {
        Err(Error::Invalid { what })
            if what.contains("shard_key() is 2 but the row stores 1 in photos.user_id") =>
        {
            Ok(())
        }
        other => Err(format!("{how}: {other:?}")),
    };
    refused(photos.insert(&lying()).await.map(|p| vec![p]), "insert")?;
    refused(photos.insert_many(&[lying(), lying()]).await, "insert_many")?;
    let in_tx = cluster
        .transaction(cluster.route_user(2).shard, |tx| {
            Box::pin(async move { tx.insert(&lying()).await.map(|p| vec![p]) })
        })
        .await;
    refused(in_tx, "a transaction's insert")?;
    let mut stored = 0;
    for (_, rows) in cluster
        .for_each_shard(|tx| Box::pin(async move { tx.query("SELECT id FROM photos", &[]).await }))
        .await
    {
        stored += rows?.len();
    }
    assert_eq!(stored, 0, "a refused row was stored");
    Ok(())
}

shardline_testkit::register!(exclusive: tls_only_hosts_work_verified_and_bad_certificates_are_refused);
/// pg3 accepts TLS only, with a certificate from a CA the test makes; the catalog and
/// pg3's shards live there. Everything works over verified TLS, moves included, and each
/// way of getting TLS wrong is refused with an error that says so.
pub(crate) async fn tls_only_hosts_work_verified_and_bad_certificates_are_refused(
    ctx: TestContext,
) -> TestResult {
    use shardline_repo::catalog::connect;
    use shardline_router::config::DbUrl;
    use shardline_testkit::tls::TestCa;

    let f = Fixture::new(&ctx, 3, 6).await?;
    let pg3 = &ctx.hosts()[2];
    let admin_host = pg3.endpoint().host.clone();
    // Another name for the same address, absent from the certificate.
    let other_name = match admin_host.as_str() {
        "127.0.0.1" => "localhost",
        "localhost" => "127.0.0.1",
        other => return Err(format!("the test needs pg3 on loopback, not {other}").into()),
    };
    let ca = TestCa::new("shardline test CA")?;
    let cert = ca.issue(&[admin_host.as_str(), pg3.peer_endpoint().host.as_str()])?;
    let dir = f.path().with_file_name("tls");
    std::fs::create_dir_all(&dir)?;
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca.pem())?;
    let stranger = dir.join("stranger.pem");
    std::fs::write(&stranger, TestCa::new("somebody else's CA")?.pem())?;

    let verify_full = |root: &std::path::Path| format!("sslmode=verify-full&sslrootcert={}", root.display());
    let db = f.config()?.hosts[0].url.expose().rsplit('/').next().unwrap_or_default().to_owned();
    let pg3_url = |params: &str| format!("{}?{params}", pg3.url(&db));
    // The catalog and pg3 over verified TLS; pg3's peers reach it with libpq's `require`.
    let write = |root: &std::path::Path| -> TestResult {
        f.write_config(&ctx, |i, url| if i == 2 { format!("{url}?{}", verify_full(root)) } else { url }, 6)?;
        let text = std::fs::read_to_string(f.path())?;
        let catalog = text.lines().find(|l| l.starts_with("url = ")).ok_or("the catalog url")?.to_owned();
        let peer = pg3.peer_url(&db);
        let text = text
            .replacen(&catalog, &format!("url = \"{}\"", pg3_url(&verify_full(root))), 1)
            .replace(&format!("peer_url = \"{peer}\""), &format!("peer_url = \"{peer}?sslmode=require\""));
        std::fs::write(f.path(), text)?;
        Ok(())
    };
    write(&ca_file)?;

    let tls_only = pg3.require_tls(&cert).await?;
    // Whatever happens (a failed assertion included), pg3 is put back for the next test.
    let outcome = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(async {
        let config = f.config()?;
        shardline_ops::init(&config, &options(1), &quiet).await?;
        let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
        let photos = cluster.repo::<Photo>()?;
        let mut saved = Vec::new();
        for user in 0..6 {
            saved.push(photos.insert(&NewPhoto::numbered(user, 1)).await?);
        }
        assert!(saved.iter().any(|p| cluster.route_id(p.id).is_ok_and(|r| r.host.as_str() == "pg3")));
        // The pool's sessions on pg3, and the catalog's, are encrypted.
        let encrypted = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()";
        let pool = cluster.client(&shardline_router::HostName::new("pg3")?).await?;
        assert!(pool.query_one(encrypted, &[]).await?.get::<_, bool>(0), "pg3's pool is encrypted");
        let catalog = connect(&config.catalog, "catalog").await?;
        assert!(catalog.query_one(encrypted, &[]).await?.get::<_, bool>(0), "the catalog is encrypted");
        // The cancel of a statement that ran out of time crosses verified TLS too.
        let pg3_config = &config.hosts[2].url;
        let sleeper = connect(pg3_config, "host pg3").await?;
        let token = sleeper.cancel_token();
        let sleeping = tokio::spawn(async move { sleeper.simple_query("SELECT pg_sleep(30)").await.map(|_| ()) });
        let mut started = false;
        for _ in 0..100 {
            let active = "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)' AND state = 'active'";
            started = pool.query_one(active, &[]).await?.get::<_, i64>(0) == 1;
            if started {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(started, "the statement to cancel never started");
        shardline_repo::catalog::cancel(&token, pg3_config, "host pg3").await?;
        let ended = tokio::time::timeout(Duration::from_secs(5), sleeping).await??;
        let code = ended.err().and_then(|e| e.code().cloned());
        assert_eq!(code, Some(tokio_postgres::error::SqlState::QUERY_CANCELED), "cancelled over TLS");
        // Moves off and onto the TLS-only host: replication crosses TLS too.
        let off =
            shardline_ops::moves::run(&config, crate::shard(4), &crate::host("pg2"), &MoveOptions::default())
                .await?;
        let onto =
            shardline_ops::moves::run(&config, crate::shard(0), &crate::host("pg3"), &MoveOptions::default())
                .await?;
        assert_eq!((off.rows > 0, onto.rows > 0), (true, true), "{off:?} {onto:?}");
        cluster.refresh().await?;
        for p in &saved {
            assert_eq!(photos.get(p.id).await?.as_ref(), Some(p));
        }
        assert_eq!(cluster.route_user(0).host.as_str(), "pg3");
        // The sqlx path over the same verified TLS (verify-full: the only mode with a
        // root certificate it takes, see docs/sqlx.md): its session on pg3 is encrypted.
        let ssl: bool = cluster
            .sqlx()
            .on_user(0, |conn| {
                Box::pin(async move { ::sqlx::query_scalar(encrypted).fetch_one(&mut **conn).await })
            })
            .await?;
        assert!(ssl, "the sqlx path's session on pg3 is encrypted");

        // Without TLS: refused by the server, saying so.
        let plain = connect(&DbUrl::new(pg3_url("sslmode=disable")), "host pg3").await.unwrap_err();
        // The server's reason is the error's source: read the chain.
        let said = shardline_repo::error_chain(&plain);
        assert!(said.contains("no encryption"), "{said}");
        // `require` without a CA encrypts without checking, as libpq does.
        let unchecked = connect(&DbUrl::new(pg3_url("sslmode=require")), "host pg3").await?;
        assert!(unchecked.query_one(encrypted, &[]).await?.get::<_, bool>(0));
        // A certificate from a CA we do not trust.
        let untrusted = connect(&DbUrl::new(pg3_url(&verify_full(&stranger))), "host pg3").await.unwrap_err();
        let text = untrusted.to_string();
        assert!(matches!(untrusted, shardline_repo::Error::Tls { .. }), "{text}");
        assert!(text.starts_with("host pg3: TLS: the server's certificate was refused:"), "{text}");
        assert!(text.contains("UnknownIssuer"), "{text}");
        assert!(!untrusted.is_retryable(), "a refused certificate is not worth retrying: {text}");
        // The right CA but a name the certificate does not hold: `verify-full` refuses,
        // `verify-ca` (the chain only) accepts.
        let by_other_name = |params: String| {
            DbUrl::new(pg3_url(&params).replacen(&format!("@{admin_host}:"), &format!("@{other_name}:"), 1))
        };
        let wrong_name = connect(&by_other_name(verify_full(&ca_file)), "host pg3").await.unwrap_err();
        assert!(
            wrong_name.to_string().contains(&format!("not valid for name {other_name:?}")),
            "{wrong_name}"
        );
        let chain_only = by_other_name(format!("sslmode=verify-ca&sslrootcert={}", ca_file.display()));
        connect(&chain_only, "host pg3").await?;
        // TLS demanded of a host that does not offer it.
        let pg2 = &ctx.hosts()[1];
        let no_tls =
            connect(&DbUrl::new(format!("{}?sslmode=require", pg2.url(&db))), "host pg2").await.unwrap_err();
        let said = shardline_repo::error_chain(&no_tls);
        assert!(said.contains("server does not support TLS"), "{said}");

        // A whole cluster configured with the wrong CA: the request path says why.
        write(&stranger)?;
        let err = Cluster::connect(&f.config()?, ClusterOptions::default()).await.unwrap_err();
        assert!(err.to_string().starts_with("catalog: TLS: the server's certificate was refused"), "{err}");
        let (out, result) = cli_full(&f, &["map"]).await;
        let said = result.unwrap_err();
        assert!(said.contains("catalog: TLS: the server's certificate was refused"), "{said}");
        assert!(out.is_empty(), "{out}");
        write(&ca_file)?;
        TestResult::Ok(())
    }))
    .await;
    tls_only.restore().await?;
    outcome.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// How one write of the load ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// Acknowledged with this ID.
    Written(shardline_id::Id),
    /// Failed with an error that says the write may have been applied.
    Unknown(String),
    /// Failed, every time, with errors that say it was not applied.
    NotWritten(String),
}

/// One write of the load: its caption, how long its (last) call took, when it started,
/// how it ended.
type Attempt = (String, Duration, Instant, Outcome);

/// One writer per user, inserting photos captioned `{tag}-{user}-{n}` until `stop`.
/// A failure that says the write was not applied is retried with the same caption (a
/// false "not applied" would show as a caption written twice); one whose outcome is
/// unknown is not.
fn write_load(
    photos: &shardline_repo::Repo<Photo>,
    users: &[i64],
    tag: &'static str,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<Attempt>>> {
    users
        .iter()
        .map(|&user| {
            let photos = photos.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut log = Vec::new();
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    n += 1;
                    let caption = format!("{tag}-{user}-{n}");
                    let new = NewPhoto { user_id: user, url: "https://cdn.example/x.jpg".into(), caption };
                    let started = Instant::now();
                    let mut tries = 0;
                    // Each call is bounded, not the test's own retries of it: the last
                    // try's time is the write's.
                    let (took, outcome) = loop {
                        tries += 1;
                        let t = Instant::now();
                        match photos.insert(&new).await {
                            Ok(p) => break (t.elapsed(), Outcome::Written(p.id)),
                            Err(e) if e.outcome_unknown() => {
                                break (t.elapsed(), Outcome::Unknown(e.to_string()));
                            }
                            Err(e) if tries < 40 && e.is_retryable() => {
                                log.push((
                                    format!("{} (try {tries})", new.caption),
                                    t.elapsed(),
                                    t,
                                    Outcome::NotWritten(e.to_string()),
                                ));
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            Err(e) => break (t.elapsed(), Outcome::NotWritten(e.to_string())),
                        }
                    };
                    log.push((new.caption.clone(), took, started, outcome));
                }
                log
            })
        })
        .collect()
}

/// Stops the load and returns its log, once every failure in it is checked: a write to
/// pg2, answered within `limit`, with an error naming pg2.
async fn stop_load(
    writers: Vec<tokio::task::JoinHandle<Vec<Attempt>>>,
    stop: &std::sync::atomic::AtomicBool,
    on_pg2: &(dyn Fn(&str) -> bool + Sync),
    limit: Duration,
) -> Result<Vec<Attempt>, crate::bootstrap::BoxError> {
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut log = Vec::new();
    for w in writers {
        log.extend(w.await?);
    }
    for (caption, took, _, outcome) in &log {
        if let Outcome::Unknown(e) | Outcome::NotWritten(e) = outcome {
            assert!(on_pg2(caption), "{caption} is not on pg2 yet failed: {e}");
            assert!(*took < limit, "{caption} waited {took:?}");
            assert!(e.contains("pg2"), "the error names the host: {e}");
        }
    }
    Ok(log)
}

/// Every row of `users`, by caption.
async fn rows_by_caption(
    photos: &shardline_repo::Repo<Photo>,
    users: &[i64],
) -> Result<std::collections::HashMap<String, Vec<Photo>>, crate::bootstrap::BoxError> {
    let mut out: std::collections::HashMap<String, Vec<Photo>> = std::collections::HashMap::new();
    for &user in users {
        let mut before = None;
        loop {
            let page = photos.page_of_user(user, before, 500).await?;
            for p in page.rows {
                out.entry(p.caption.clone()).or_default().push(p);
            }
            match page.next {
                Some(next) => before = Some(next),
                None => break,
            }
        }
    }
    Ok(out)
}

/// What the load's log and the rows must agree on: every acknowledged write is there
/// once with its ID, nothing said "not applied" is there, nothing is there twice.
/// Returns (written, unknown and found, unknown and absent, not written).
fn check_writes(
    log: &[Attempt],
    rows: &std::collections::HashMap<String, Vec<Photo>>,
) -> (usize, usize, usize, usize) {
    let mut counts = (0, 0, 0, 0);
    for (caption, _, _, outcome) in log.iter().filter(|(c, ..)| !c.contains(" (try ")) {
        let found = rows.get(caption).map_or(&[][..], Vec::as_slice);
        assert!(found.len() <= 1, "{caption} was written {} times", found.len());
        match outcome {
            Outcome::Written(id) => {
                assert_eq!(found.first().map(|p| p.id), Some(*id), "acknowledged {caption} is lost");
                counts.0 += 1;
            }
            Outcome::Unknown(_) if found.is_empty() => counts.2 += 1,
            Outcome::Unknown(_) => counts.1 += 1,
            Outcome::NotWritten(e) => {
                assert!(
                    found.is_empty(),
                    "{caption} failed with \"{e}\", said to be not applied, yet it is there"
                );
                counts.3 += 1;
            }
        }
    }
    counts
}

shardline_testkit::register!(quiet: a_host_killed_or_hung_under_requests_fails_them_in_time_and_loses_no_write);
pub(crate) async fn a_host_killed_or_hung_under_requests_fails_them_in_time_and_loses_no_write(
    ctx: TestContext,
) -> TestResult {
    use std::sync::atomic::AtomicBool;
    let f = Fixture::new(&ctx, 3, 6).await?;
    let config = f.config()?;
    shardline_ops::init(&config, &options(1), &quiet).await?;
    let timeout = Duration::from_secs(1);
    let o = ClusterOptions {
        pool_size: 4,
        host_timeout: timeout,
        connect_timeout: timeout,
        ..ClusterOptions::default()
    };
    let cluster = Cluster::connect(&config, o).await?;
    let photos = cluster.repo::<Photo>()?;
    let mut users: Vec<i64> = Vec::new();
    for host in ["pg1", "pg2", "pg3"] {
        users.extend((0..600).filter(|u| cluster.route_user(*u).host.as_str() == host).take(2));
    }
    let on_pg2 = |caption: &str| {
        users.iter().skip(2).take(2).any(|u| caption.split('-').nth(1) == Some(&u.to_string()))
    };
    // Whoever waits, waits at most the host timeout (plus the pool's own wait, and slack
    // for two busy cores).
    let limit = timeout * 2 + Duration::from_millis(1500);
    let pg2 = &ctx.hosts()[1];

    // Killed: a crash under a write load, then a restart.
    let stop = Arc::new(AtomicBool::new(false));
    let writers = write_load(&photos, &users, "kill", stop.clone());
    tokio::time::sleep(Duration::from_millis(400)).await;
    pg2.kill().await?;
    tokio::time::sleep(Duration::from_millis(800)).await;
    pg2.start().await?;
    let back = Instant::now();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let log = stop_load(writers, &stop, &on_pg2, limit).await?;
    assert!(
        log.iter().any(|(c, .., o)| on_pg2(c) && !matches!(o, Outcome::Written(_))),
        "the kill hit no write"
    );
    assert!(
        log.iter().any(|(c, _, at, o)| on_pg2(c) && *at > back && matches!(o, Outcome::Written(_))),
        "the same handle writes to pg2 again after its restart"
    );
    assert!(
        log.iter().any(|(c, ..)| c.contains(" (try ")),
        "no write failed as not applied and was retried with the same caption"
    );
    let rows = rows_by_caption(&photos, &users).await?;
    let killed = check_writes(&log, &rows);
    assert!(killed.0 > 0);

    // Hung: pg2 paused for longer than the timeout, under the same load, while single
    // reads, a get-many, a batch insert and a page are asked of it.
    let on1 = photos.insert(&NewPhoto::numbered(users[0], 1)).await?;
    let on2 = photos.insert(&NewPhoto::numbered(users[2], 1)).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let writers = write_load(&photos, &users, "pause", stop.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    pg2.pause().await?;
    let timed = |what: &'static str| {
        move |(took, result): (Duration, Result<String, shardline_repo::Error>)| -> Result<(), String> {
            let e = match result {
                Ok(v) => return Err(format!("{what} succeeded on a hung host: {v}")),
                Err(e) => e,
            };
            // A batch whose pg1 part committed is not retryable as a whole (that would
            // insert pg1's rows twice), and says so.
            let partial =
                matches!(&e, shardline_repo::Error::InsertMany { committed, .. } if committed == &["pg1"]);
            if !(e.is_timeout() && (e.is_retryable() || partial) && e.to_string().contains("pg2")) {
                return Err(format!("{what}: {e}"));
            }
            if took >= limit {
                return Err(format!("{what} waited {took:?}"));
            }
            Ok(())
        }
    };
    async fn time<T: std::fmt::Debug>(
        f: impl std::future::Future<Output = Result<T, shardline_repo::Error>>,
    ) -> (Duration, Result<String, shardline_repo::Error>) {
        let t = Instant::now();
        let r = f.await.map(|v| format!("{v:?}"));
        (t.elapsed(), r)
    }
    timed("get")(time(photos.get(on2.id)).await)?;
    timed("get_many")(time(photos.get_many(&[on1.id, on2.id])).await)?;
    timed("page")(time(photos.page_of_user(users[2], None, 10)).await)?;
    let batch = [
        NewPhoto { user_id: users[0], url: "u".into(), caption: "batch-pg1".into() },
        NewPhoto { user_id: users[2], url: "u".into(), caption: "batch-pg2".into() },
    ];
    timed("insert_many")(time(photos.insert_many(&batch)).await)?;
    // pg1 answers all along.
    let t = Instant::now();
    assert_eq!(photos.get(on1.id).await?.as_ref(), Some(&on1));
    assert!(t.elapsed() < timeout, "pg1 waited {:?} on pg2's hang", t.elapsed());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    pg2.resume().await?;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let log = stop_load(writers, &stop, &on_pg2, limit).await?;
    assert!(
        log.iter().any(|(c, .., o)| on_pg2(c) && matches!(o, Outcome::Unknown(_))),
        "the pause hit no write"
    );
    // Once it answers again, the same handle reads everything back.
    assert_eq!(photos.get(on2.id).await?.as_ref(), Some(&on2));
    let many = photos.get_many(&[on1.id, on2.id]).await?;
    assert!(many.missing.is_empty());
    let rows = rows_by_caption(&photos, &users).await?;
    let paused = check_writes(&log, &rows);
    assert!(paused.0 > 0);
    // The batch: pg1's part is its own transaction and committed; pg2's is unknown.
    assert_eq!(rows.get("batch-pg1").map(Vec::len), Some(1));
    assert!(rows.get("batch-pg2").map_or(0, Vec::len) <= 1);
    eprintln!(
        "    writes (acknowledged, unknown and there, unknown and absent, not applied): \
         pg2 killed {killed:?}, pg2 hung {paused:?}"
    );

    // A shard transaction on the hung host, on a pooled connection made before the
    // hang, with no load beside it: given up once, within the timeout. Before, a `BEGIN`
    // that timed out was followed by a `ROLLBACK` on the same connection, which waited
    // out the timeout again; so were the probe after a closure's own error (here the
    // closure hangs the host, then fails) and the rollback after it.
    let shard = cluster.route_user(users[2]).shard;
    for hung_in_closure in [false, true] {
        assert_eq!(photos.get(on2.id).await?.as_ref(), Some(&on2), "pg2 answers before the pause");
        if !hung_in_closure {
            pg2.pause().await?;
        }
        let t = Instant::now();
        let result: Result<(), shardline_repo::Error> = cluster
            .transaction(shard, |_tx| {
                Box::pin(async move {
                    let what = match pg2.pause().await {
                        Ok(()) => "the closure's own error after pg2 hung".to_owned(),
                        Err(e) => format!("pausing pg2: {e}"),
                    };
                    Err(shardline_repo::Error::Invalid { what })
                })
            })
            .await;
        let took = t.elapsed();
        if pg2.state() == shardline_testkit::HostState::Paused {
            pg2.resume().await?;
        }
        let e = result.err().ok_or("a transaction on a hung host succeeded")?;
        let expected =
            if hung_in_closure { e.to_string().contains("after pg2 hung") } else { e.is_timeout() };
        assert!(expected && e.to_string().contains("pg2"), "{e}");
        eprintln!(
            "      a transaction on hung pg2 (hung in the closure: {hung_in_closure}) returned in {took:?}: {e}"
        );
        assert!(
            took < timeout + Duration::from_millis(700),
            "the transaction waited {took:?} (hung in the closure: {hung_in_closure})"
        );
    }
    Ok(())
}

/// Creates `role` (if missing) on the servers of hosts `0..hosts`: roles are per server.
pub(crate) async fn create_role(f: &Fixture, ctx: &TestContext, hosts: usize, role: &str) -> TestResult {
    for h in 0..hosts {
        let c = f.client(ctx, h).await?;
        let exists: bool =
            c.query_one("SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)", &[&role]).await?.get(0);
        if !exists {
            c.batch_execute(&format!("CREATE ROLE \"{role}\" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE"))
                .await?;
        }
    }
    Ok(())
}

/// Every privilege on `schema`'s objects on `client`'s host, one line per object
/// (its ACL entries sorted), the defaults spelled out: to compare two hosts.
async fn acls(
    client: &tokio_postgres::Client,
    schema: &str,
) -> Result<Vec<String>, crate::bootstrap::BoxError> {
    Ok(client
        .query(
            "WITH n AS (SELECT oid, nspowner, nspacl FROM pg_namespace WHERE nspname = $1),
             o AS (
                SELECT 'schema' AS what, coalesce(nspacl, acldefault('n', nspowner)) AS acl FROM n
                UNION ALL
                SELECT c.relname::text, coalesce(c.relacl, acldefault(CASE WHEN c.relkind = 'S' THEN 's' ELSE 'r' END::\"char\", c.relowner))
                  FROM pg_class c JOIN n ON c.relnamespace = n.oid WHERE c.relkind IN ('r', 'S')
                UNION ALL
                SELECT c.relname || '.' || a.attname, a.attacl
                  FROM pg_class c JOIN n ON c.relnamespace = n.oid JOIN pg_attribute a ON a.attrelid = c.oid
                 WHERE a.attacl IS NOT NULL
                UNION ALL
                SELECT p.proname || '()', coalesce(p.proacl, acldefault('f', p.proowner))
                  FROM pg_proc p JOIN n ON p.pronamespace = n.oid)
             SELECT what || ' ' || array_to_string(ARRAY(SELECT x::text FROM unnest(acl) x ORDER BY 1), ',')
               FROM o ORDER BY 1",
            &[&schema],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// A migration that adds a table and a function only granted roles may run.
const TAGS: &str = "CREATE TABLE tags (
    id       bigint PRIMARY KEY DEFAULT next_id(),
    photo_id bigint NOT NULL,
    tag      text   NOT NULL
);
CREATE FUNCTION normal_tag(t text) RETURNS text LANGUAGE sql IMMUTABLE AS $$ SELECT lower(trim(t)) $$;
REVOKE EXECUTE ON FUNCTION normal_tag(text) FROM PUBLIC;
";

shardline_testkit::register!(shared: grants_follow_init_migrate_and_a_move);
pub(crate) async fn grants_follow_init_migrate_and_a_move(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    let pid = std::process::id();
    let (app, reader, lonely) =
        (format!("grants_app_{pid}"), format!("grants_reader_{pid}"), format!("grants_lonely_{pid}"));
    let operator = f.config_text()?;

    // A role of app_roles missing somewhere: refused before anything changes, naming
    // every server that lacks it.
    std::fs::write(f.path(), format!("app_roles = [\"{app}\"]\n{operator}"))?;
    let err = shardline_ops::init(&f.config()?, &options(1), &quiet).await.unwrap_err().to_string();
    assert!(
        err.starts_with(&format!("app_roles: roles are missing, so nothing was changed: pg1 lacks {app}; pg2 lacks {app}; catalog lacks {app}")),
        "{err}"
    );
    let pg1 = f.client(&ctx, 0).await?;
    let catalog: bool = pg1.query_one("SELECT to_regclass('shardline.cluster') IS NULL", &[]).await?.get(0);
    assert!(catalog, "the refused init created the catalog");

    // The roles exist on every host; init grants; the app connects as its role.
    create_role(&f, &ctx, 2, &app).await?;
    create_role(&f, &ctx, 2, &reader).await?;
    let report = shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    assert_eq!(report.shards_granted, 4, "{report:?}");
    let app_text = f.config_text()?.replace("postgres://postgres@", &format!("postgres://{app}@"));
    let app_config = f.config_from(&app_text)?;
    assert!(
        app_config.hosts.iter().all(|h| h.url.expose().contains(&app))
            && app_config.catalog.expose().contains(&app)
    );
    let cluster = Cluster::connect(&app_config, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let mut made = Vec::new();
    for user in 0..8 {
        made.push(photos.insert(&NewPhoto::numbered(user, 1)).await?);
    }
    assert_eq!(photos.get(made[0].id).await?, Some(made[0].clone()));
    assert_eq!(photos.page_of_user(4, None, 10).await?.rows.len(), 1);

    // A migration adds a table and a function: migrate grants them in the same
    // transaction, and the app uses both.
    f.migration("0005_tags.sql", TAGS)?;
    let report = shardline_ops::migrate(&f.config()?, &options(1), &quiet).await?;
    let tag = |user: i64, photo: shardline_id::Id, text: &'static str| {
        let cluster = &cluster;
        async move {
            let shard = cluster.route_user(user).shard;
            cluster
                .transaction(shard, |tx| {
                    Box::pin(async move {
                        tx.execute(
                            "INSERT INTO tags (photo_id, tag) VALUES ($1, normal_tag($2))",
                            &[&photo.as_i64(), &text],
                        )
                        .await?;
                        let rows =
                            tx.query("SELECT tag FROM tags WHERE photo_id = $1", &[&photo.as_i64()]).await?;
                        Ok::<_, shardline_repo::Error>(rows.iter().map(|r| r.get(0)).collect::<Vec<String>>())
                    })
                })
                .await
        }
    };
    assert_eq!(tag(0, made[0].id, " Sunset ").await?, ["sunset"]);
    assert_eq!((report.migrations_applied, report.shards_granted), (4, 4), "{report:?}");

    // A hand-made privilege on the source: a second role reads one table.
    pg1.batch_execute(&format!("GRANT SELECT ON shard_0000.photos TO \"{reader}\"")).await?;

    // A role that holds a privilege on the source but does not exist on the target: a
    // pre-flight problem, named by the target host; nothing changes.
    create_role(&f, &ctx, 1, &lonely).await?;
    pg1.batch_execute(&format!("GRANT SELECT ON shard_0001.photos TO \"{lonely}\"")).await?;
    let check = moves::preflight(&f.config()?, crate::shard(1), &crate::host("pg2")).await?;
    assert_eq!(check.problems.len(), 1, "{check}");
    assert!(
        check.problems[0]
            .to_string()
            .starts_with(&format!("pg2: roles: {lonely} hold privileges on shard_0001")),
        "{check}"
    );
    let err = moves::run(&f.config()?, crate::shard(1), &crate::host("pg2"), &MoveOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, shardline_ops::Error::Preflight(_)), "{err}");

    // The move, with more changes on the source once the target is built: the reader
    // gets a column of another table, and the app may no longer delete tags.
    let stopped = moves::run(
        &f.config()?,
        crate::shard(0),
        &crate::host("pg2"),
        &MoveOptions::default().stopping_after(Step::Prepared),
    )
    .await
    .unwrap_err();
    assert!(matches!(stopped, shardline_ops::Error::Interrupted { .. }), "{stopped}");
    pg1.batch_execute(&format!(
        "GRANT SELECT (body) ON shard_0000.comments TO \"{reader}\";
         REVOKE DELETE ON shard_0000.tags FROM \"{app}\""
    ))
    .await?;
    let before = acls(&pg1, "shard_0000").await?;
    assert!(
        before.iter().any(|l| l.starts_with("photos ") && l.contains(&format!("{reader}=r/"))),
        "{before:#?}"
    );
    assert!(before.iter().any(|l| l.starts_with("comments.body ")), "{before:#?}");
    // The app goes on reading and writing the shard on its new host.
    let mut resumed = moves::resume(&f.config()?, Some(crate::shard(0)), &MoveOptions::default()).await?;
    let report = resumed.pop().ok_or("no move resumed")?;
    assert_eq!((report.source.as_str(), report.target.as_str()), ("pg1", "pg2"));
    let moved = format!("shard_0000_moved_{}", report.id);
    let got = photos.get(made[0].id).await?;
    assert_eq!(cluster.route_user(0).host.as_str(), "pg2");
    assert_eq!(got, Some(made[0].clone()));
    let after = photos.insert(&NewPhoto::numbered(0, 2)).await?;
    assert_eq!(photos.page_of_user(0, None, 10).await?.rows.len(), 2);
    assert_eq!(tag(0, after.id, "Night").await?, ["night"]);
    assert_eq!(tag(0, made[0].id, "Sky").await?.len(), 2);

    // Every privilege arrived as it was on the source: the reader's table and column,
    // the app's revoked DELETE, the function's revoked PUBLIC.
    let pg2 = f.client(&ctx, 1).await?;
    assert_eq!(acls(&pg2, "shard_0000").await?, acls(&pg1, &moved).await?);
    assert_eq!(acls(&pg1, &moved).await?, before);
    let row = pg2
        .query_one(
            "SELECT has_table_privilege($1, 'shard_0000.photos', 'SELECT'),
                    has_table_privilege($1, 'shard_0000.photos', 'INSERT'),
                    has_column_privilege($1, 'shard_0000.comments', 'body', 'SELECT'),
                    has_column_privilege($1, 'shard_0000.comments', 'user_id', 'SELECT'),
                    has_table_privilege($2, 'shard_0000.tags', 'DELETE'),
                    has_function_privilege($1, 'shard_0000.normal_tag(text)', 'EXECUTE')",
            &[&reader, &app],
        )
        .await?;
    let got: [bool; 6] = std::array::from_fn(|i| row.get(i));
    assert_eq!(got, [true, false, true, false, false, false]);
    // And the app still may not change the schema on its new host.
    let as_app = shardline_repo::catalog::connect(&app_config.hosts[1].url, "host pg2").await?;
    let err = as_app.batch_execute("DROP TABLE shard_0000.tags").await.unwrap_err();
    assert_eq!(err.code().map(|c| c.code()), Some("42501"), "{err}");
    Ok(())
}

shardline_testkit::register!(shared: a_catalog_restored_to_an_older_map_is_logged_and_the_newer_map_kept);
/// A catalog restored from a backup holds an older map than the running handles: a
/// handle keeps the newer map it holds (a reload, asked for or the map check's, ignores
/// the older one), goes on routing, and logs an error once, naming both versions.
pub(crate) async fn a_catalog_restored_to_an_older_map_is_logged_and_the_newer_map_kept(
    ctx: TestContext,
) -> TestResult {
    let logs = log_capture();
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let o = ClusterOptions { map_check: Duration::from_millis(100), ..ClusterOptions::default() };
    let cluster = Cluster::connect(&f.config()?, o).await?;
    let catalog = f.client(&ctx, 0).await?;
    // The map moves on (versions far from any other test's), the handle with it ...
    let held: i64 = catalog
        .query_one("UPDATE shardline.cluster SET map_version = map_version + 7000 RETURNING map_version", &[])
        .await?
        .get(0);
    assert_eq!(cluster.refresh().await?, held);
    // ... then the catalog is put back to an older one: the map check finds it.
    let older = held - 3000;
    catalog.execute("UPDATE shardline.cluster SET map_version = $1", &[&older]).await?;
    let (held_field, catalog_field) = (format!("held={held}"), format!("catalog={older}"));
    let logged = || -> Result<Vec<String>, crate::bootstrap::BoxError> {
        let said = String::from_utf8_lossy(&logs.lock().map_err(|e| e.to_string())?).into_owned();
        Ok(said
            .lines()
            .filter(|l| {
                let words: Vec<&str> = l.split_whitespace().collect();
                words.contains(&held_field.as_str()) && words.contains(&catalog_field.as_str())
            })
            .map(str::to_owned)
            .collect())
    };
    let until = Instant::now() + Duration::from_secs(10);
    while logged()?.is_empty() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(logged()?.len(), 1, "the map check (every 100 ms) did not log it within 10 s");
    // A reload asked for reads it too, and keeps the newer map; neither logs it again.
    assert_eq!(cluster.refresh().await?, older, "the catalog's version, as read");
    assert_eq!(cluster.map().version(), held, "the newer map is kept");
    let photos = cluster.repo::<Photo>()?;
    let p = photos.insert(&NewPhoto::numbered(3, 1)).await?;
    assert_eq!(photos.get(p.id).await?, Some(p));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lines = logged()?;
    assert_eq!(lines.len(), 1, "logged once: {lines:#?}");
    assert!(
        lines[0].contains("ERROR") && lines[0].contains("older than the one this handle holds"),
        "{}",
        lines[0]
    );
    Ok(())
}

shardline_testkit::register!(shared: a_url_listing_a_standby_before_its_primary_reaches_the_primary);
/// A URL may list a primary and its standbys, as libpq's do. The catalog's and a host's
/// here list a database that refuses writes, as a standby does (pg3's copy of the
/// fixture's, `default_transaction_read_only`), before the primary: `init`, moves and the
/// repository reach the primary. Before, the driver kept the first that answered, and
/// `init` failed on the standby ("cannot execute ... in a read-only transaction").
pub(crate) async fn a_url_listing_a_standby_before_its_primary_reaches_the_primary(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    let standby = &ctx.hosts()[2];
    standby
        .connect("postgres")
        .await?
        .batch_execute(&format!("ALTER DATABASE \"{}\" SET default_transaction_read_only = on", f.db()))
        .await?;
    let listing = |primary: &shardline_testkit::Host| {
        let (s, p) = (standby.endpoint(), primary.endpoint());
        format!("postgres://postgres@{}:{},{}:{}/{}", s.host, s.port, p.host, p.port, f.db())
    };
    let (pg1, pg2) = (&ctx.hosts()[0], &ctx.hosts()[1]);
    f.write_config_at(
        &listing(pg1),
        &[(pg1.url(f.db()), pg1.peer_url(f.db())), (listing(pg2), pg2.peer_url(f.db()))],
        4,
    )?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let mut on_pg2 = None;
    for user in 0..16 {
        let p = photos.insert(&NewPhoto::numbered(user, 1)).await?;
        assert_eq!(photos.get(p.id).await?.as_ref(), Some(&p));
        if cluster.route_user(user).host.as_str() == "pg2" {
            on_pg2 = Some(p);
        }
    }
    let on_pg2 = on_pg2.ok_or("no user of 16 on pg2")?;
    // A move out of pg2 goes through both lists: its journal into the catalog, its
    // steps on pg2.
    let shard = cluster.route_user(on_pg2.user_id).shard;
    let report = moves::run(&f.config()?, shard, &crate::host("pg1"), &MoveOptions::default())
        .await
        .map_err(|e| format!("moving {shard} to pg1: {e}"))?;
    assert_eq!(report.shard, shard);
    cluster.refresh().await?;
    assert_eq!(photos.get(on_pg2.id).await?.as_ref(), Some(&on_pg2), "read after the move");
    // The standby holds nothing: no catalog, no shard.
    let held: i64 = standby
        .connect(f.db())
        .await?
        .query_one(
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'shardline' OR nspname LIKE 'shard\\_%'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(held, 0, "schemas of shardline's on the standby");
    Ok(())
}

shardline_testkit::register!(shared: a_catalog_restored_from_before_a_move_is_checked_and_repaired_from_the_hosts);
/// A catalog restored from a backup taken before a move places the shard where only
/// the move's old copy is (renamed `<schema>_moved_<id>`): `map --check` lists it and
/// exits 1, changing nothing, while a new handle reads the restored map. `map --repair`
/// places it where its schema is, and a new handle then reads the rows written before
/// and after the move. A shard whose schema two hosts hold is listed and left as it is.
pub(crate) async fn a_catalog_restored_from_before_a_move_is_checked_and_repaired_from_the_hosts(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let (out, checked) = cli_full(&f, &["map", "--check", "--timeout", "30s"]).await;
    assert!(
        checked.is_ok() && out.contains("2 host(s) read, 0 not; 0 shard(s) misplaced"),
        "{out} {checked:?}"
    );
    let catalog = f.client(&ctx, 0).await?;
    let backup: i64 = catalog.query_one("SELECT map_version FROM shardline.cluster", &[]).await?.get(0);
    let (user, shard) = (3, crate::shard(3));
    let before;
    let after;
    {
        let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
        assert_eq!(cluster.route_user(user).host.as_str(), "pg2");
        let photos = cluster.repo::<Photo>()?;
        before = photos.insert(&NewPhoto::numbered(user, 1)).await?;
        moves::run(&f.config()?, shard, &crate::host("pg1"), &MoveOptions::default()).await?;
        cluster.refresh().await?;
        after = photos.insert(&NewPhoto::numbered(user, 2)).await?;
    }
    // The restore: the map and its version as the backup had them.
    catalog
        .batch_execute(&format!(
            "UPDATE shardline.shards SET host = 'pg2' WHERE shard = 3; UPDATE shardline.cluster SET map_version = {backup}"
        ))
        .await?;
    // Shard 0's schema on pg2 as well (the map has it on pg1): two copies, no move.
    // Shard 1's only on pg2, as a move's copy that never flipped: guarded, while pg1's
    // is renamed as a fence renames it.
    let pg2 = f.client(&ctx, 1).await?;
    let restored = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    assert_eq!(restored.route_user(user).host.as_str(), "pg2", "a new handle reads the restored map");
    let (twice, fenced, moved) =
        (restored.route_user(0).schema, restored.route_user(1).schema, restored.route_user(user).schema);
    drop(restored);
    pg2.batch_execute(&format!(
        "CREATE SCHEMA {twice};
         CREATE SCHEMA {fenced}; CREATE TABLE {fenced}.photos (id bigint);
         CREATE FUNCTION {fenced}.refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
         CREATE TRIGGER {guard} BEFORE INSERT ON {fenced}.photos FOR EACH STATEMENT EXECUTE FUNCTION {fenced}.refuse();",
        guard = shardline_repo::REVERT_GUARD
    ))
    .await?;
    catalog.batch_execute(&format!("ALTER SCHEMA {fenced} RENAME TO {fenced}_moved_999")).await?;
    // Shard 3's copy on pg1 keeps a guard of a move that decided to flip (a flip whose
    // guards were left for `gc`): it lets writes through, so the copy is the shard's.
    catalog
        .batch_execute(&format!(
            "CREATE FUNCTION public.let_through() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
             CREATE TRIGGER {guard} BEFORE INSERT ON {moved}.photos FOR EACH STATEMENT EXECUTE FUNCTION public.let_through('777');
             INSERT INTO shardline.move_marks (move_id, decided) VALUES (777, 'flip');",
            guard = shardline_repo::REVERT_GUARD
        ))
        .await?;
    let (out, checked) = cli_full(&f, &["map", "--check", "--timeout", "30s"]).await;
    assert!(checked.is_err(), "{out}");
    assert!(out.contains("the map places it on pg2, its schema is on pg1"), "{out}");
    assert!(
        out.contains(&format!("shard 0 ({twice}): the map places it on pg1, its schema is on pg1, pg2")),
        "{out}"
    );
    assert!(
        out.contains(&format!("shard 1 ({fenced}): the map places it on pg1, its schema is on pg2")),
        "{out}"
    );
    let (json, _) = cli_full(&f, &["map", "--check", "--json", "--timeout", "30s"]).await;
    let v: serde_json::Value = serde_json::from_str(json.trim())?;
    let misplaced = v["misplaced"].as_array().ok_or("no misplaced array")?;
    assert_eq!(misplaced.len(), 3, "{json}");
    assert_eq!(misplaced[2]["shard"], 3, "{json}");
    assert_eq!(misplaced[2]["found_on"], serde_json::json!(["pg1"]), "{json}");
    let now: i64 = catalog.query_one("SELECT map_version FROM shardline.cluster", &[]).await?.get(0);
    assert_eq!(now, backup, "a check changes nothing");
    // The repair places shard 3 on pg1 and leaves shard 0 (two copies) and shard 1 (a
    // guarded copy) as they are.
    let (out, repaired) = cli_full(&f, &["map", "--repair", "--timeout", "30s"]).await;
    assert!(repaired.is_err(), "shards 0 and 1 are left: {out}");
    assert!(out.contains("shard 3: the map had it on pg2, its schema is on pg1: placed there"), "{out}");
    assert!(out.contains("left: several hosts hold its schema"), "{out}");
    assert!(out.contains("left: the copy on pg2 is still guarded by a move that never flipped"), "{out}");
    let placed: Vec<(i32, String)> = catalog
        .query("SELECT shard, host FROM shardline.shards WHERE shard IN (0, 1, 3) ORDER BY shard", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(placed, [(0, "pg1".to_owned()), (1, "pg1".to_owned()), (3, "pg1".to_owned())]);
    pg2.batch_execute(&format!("DROP SCHEMA {twice}; DROP SCHEMA {fenced} CASCADE")).await?;
    catalog
        .batch_execute(&format!(
            "DROP TRIGGER {guard} ON {moved}.photos; DELETE FROM shardline.move_marks WHERE move_id = 777",
            guard = shardline_repo::REVERT_GUARD
        ))
        .await?;
    catalog.batch_execute(&format!("ALTER SCHEMA {fenced}_moved_999 RENAME TO {fenced}")).await?;
    let (out, checked) = cli_full(&f, &["map", "--check", "--timeout", "30s"]).await;
    assert!(checked.is_ok() && out.contains("0 shard(s) misplaced"), "{out} {checked:?}");
    let fresh = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    assert!(fresh.map().version() > backup, "the repair bumped the map's version");
    let photos = fresh.repo::<Photo>()?;
    assert_eq!(photos.get(before.id).await?.as_ref(), Some(&before));
    assert_eq!(photos.get(after.id).await?.as_ref(), Some(&after));
    Ok(())
}
