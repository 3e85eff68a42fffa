//! Behind PgBouncer, and with a connection that lands in the wrong shard: no row is ever
//! read or written in another shard than the statement was sent to without an error
//! naming it; in transaction pooling mode nothing depends on a named statement
//! surviving a transaction; a `LISTEN` that receives nothing is caught by the map check.
//!
//! These tests need PgBouncer (`apt-get install pgbouncer`, or `SHARDLINE_PGBOUNCER`
//! naming a binary): without it they fail, they never skip.
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use shardline_example_photos::{NewPhoto, Photo};
use shardline_repo::{Cluster, ClusterOptions, Error};
use shardline_testkit::harness::{TestContext, TestResult};
use shardline_testkit::pgbouncer::{Pgbouncer, PoolMode};

use crate::bootstrap::{BoxError, Fixture, options, quiet};

fn photo(user_id: i64, n: i64) -> NewPhoto {
    NewPhoto { user_id, url: format!("https://cdn/{user_id}/{n}.jpg"), caption: String::new() }
}

/// Rows of `shards` shards on `client`'s host that are in another shard than their
/// user's, or whose ID was minted by another shard than the schema they are in.
async fn foreign_rows(client: &tokio_postgres::Client, shards: u16) -> Result<i64, BoxError> {
    let mut n = 0;
    for s in 0..shards {
        n += client
            .query_one(
                &format!(
                    "SELECT count(*) FROM shard_{s:04}.photos
                      WHERE ((id >> 10) & 8191) <> {s} OR ((user_id % {shards}) + {shards}) % {shards} <> {s}"
                ),
                &[],
            )
            .await?
            .get::<_, i64>(0);
    }
    Ok(n)
}

/// The fixture's config text with host pg1's URL through `bouncer` (the catalog stays
/// direct).
fn through(f: &Fixture, ctx: &TestContext, bouncer: &Pgbouncer) -> Result<String, BoxError> {
    let direct = f.config_text()?;
    let host_url = ctx.hosts()[0].url(f.db());
    let text = direct.replacen(
        &format!("[[hosts]]\nname = \"pg1\"\nurl = \"{host_url}\""),
        &format!("[[hosts]]\nname = \"pg1\"\nurl = \"{}\"", bouncer.url(f.db())),
        1,
    );
    assert_ne!(text, direct, "the host's URL goes through the pooler");
    Ok(text)
}

shardline_testkit::register!(shared: a_row_of_another_shard_is_an_error_naming_both_shards);
/// A connection that lands in another shard than the statement names (shard 0's and
/// shard 1's schemas swapped on their host): every write that returns the row and
/// every read that finds one is an [`Error::Misrouted`] naming the host and both
/// shards; a write in a transaction is rolled back with it.
pub(crate) async fn a_row_of_another_shard_is_an_error_naming_both_shards(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 1, 4).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let user = (0..).find(|u| cluster.route_user(*u).shard.get() == 0).unwrap_or(0);
    let fine = photos.insert(&photo(user, 0)).await?;
    let c = f.client(&ctx, 0).await?;
    c.batch_execute(
        "ALTER SCHEMA shard_0000 RENAME TO swap; ALTER SCHEMA shard_0001 RENAME TO shard_0000;
         ALTER SCHEMA swap RENAME TO shard_0001",
    )
    .await?;
    // Each schema's minter names its own schema in its body (the catch-up, the
    // sequence): made again under the new names, each keeps minting its own shard's IDs,
    // so the connection now lies about where a statement runs and nothing else does.
    for (schema, shard) in [("shard_0000", 1), ("shard_0001", 0)] {
        c.batch_execute(&shardline_id::sql::ShardSql::new(cluster.layout(), schema, shard)?.install())
            .await?;
    }
    // A single insert: applied (autocommit), in shard 1, and said so.
    let err = photos.insert(&photo(user, 1)).await.unwrap_err();
    let Error::Misrouted { ref host, expected, found, .. } = err else { panic!("{err:?}") };
    assert_eq!((host.as_str(), expected.get(), found), ("pg1", 0, 1));
    assert!(err.outcome_unknown() && !err.is_retryable(), "a misrouted write was applied: {err}");
    assert!(err.to_string().contains("was sent to shard 0 but returned a row of shard 1"), "{err}");
    let in_shard_1: i64 =
        c.query_one("SELECT count(*) FROM shard_0000.photos WHERE user_id = $1", &[&user]).await?.get(0);
    assert_eq!(in_shard_1, 1, "the misrouted insert is in shard 1's table, as the error says");
    // A read that finds that row: refused, naming it.
    let err = photos.page_of_user(user, None, 10).await.unwrap_err();
    assert!(matches!(err, Error::Misrouted { expected, found: 1, .. } if expected == 0), "{err:?}");
    // A batch and a transaction: rolled back whole, nothing more applied.
    let err = photos.insert_many(&[photo(user, 2), photo(user, 3)]).await.unwrap_err();
    assert!(matches!(err, Error::Misrouted { expected, found: 1, .. } if expected == 0), "{err:?}");
    let shard = cluster.route_user(user).shard;
    let err = cluster
        .transaction(shard, |tx| Box::pin(async move { tx.insert(&photo(user, 4)).await }))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Misrouted { expected, found: 1, .. } if expected == 0), "{err:?}");
    let in_shard_1: i64 =
        c.query_one("SELECT count(*) FROM shard_0000.photos WHERE user_id = $1", &[&user]).await?.get(0);
    assert_eq!(in_shard_1, 1, "the batch and the transaction were rolled back");
    // Swapped back, everything is as before.
    c.batch_execute(
        "ALTER SCHEMA shard_0000 RENAME TO swap; ALTER SCHEMA shard_0001 RENAME TO shard_0000;
         ALTER SCHEMA swap RENAME TO shard_0001",
    )
    .await?;
    assert_eq!(photos.get(fine.id).await?, Some(fine));
    Ok(())
}

/// What one handle's load did.
#[derive(Debug, Default)]
struct Tally {
    ok: AtomicUsize,
    failed: AtomicUsize,
}

/// Two handles with their own pools (as two application processes) write, read and
/// page concurrently through one PgBouncer in `pool_mode = transaction`, sharing its
/// server connections. Returns the inserts that succeeded per handle, and the errors.
async fn load(
    config: &shardline_router::Config,
    o: &ClusterOptions,
    shards: u16,
    rounds: i64,
) -> Result<(usize, usize, Vec<String>), BoxError> {
    let a = Cluster::connect(config, o.clone()).await?;
    let b = Cluster::connect(config, o.clone()).await?;
    let tally = Arc::new(Tally::default());
    let errors = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (h, cluster) in [a, b].into_iter().enumerate() {
        for t in 0..4_i64 {
            let (cluster, tally, errors) = (cluster.clone(), tally.clone(), errors.clone());
            let offset = i64::try_from(h)? * 1000 + t * 100;
            tasks.push(tokio::spawn(async move {
                let photos = cluster.repo::<Photo>().expect("repo");
                for n in 0..rounds {
                    // Handle a and handle b write different shards in the same order, so
                    // their statements have the same shapes and names at the same time.
                    let user = (offset + n) % i64::from(shards) + i64::from(shards) * (offset + 7);
                    let result = async {
                        let p = photos.insert(&photo(user, n)).await?;
                        let got = photos.get(p.id).await?;
                        assert_eq!(got.as_ref().map(|g| g.id), Some(p.id), "read back by id");
                        photos.page_of_user(user, None, 5).await?;
                        photos.update(p.id, &[("caption", &"x")]).await?;
                        let shard = cluster.route_user(user).shard;
                        cluster
                            .transaction(shard, |tx| {
                                Box::pin(async move {
                                    let q = tx.insert(&photo(user, -n)).await?;
                                    tx.execute("UPDATE photos SET caption = 'tx' WHERE id = $1", &[&q.id])
                                        .await?;
                                    Ok::<_, Error>(())
                                })
                            })
                            .await?;
                        Ok::<_, Error>(())
                    }
                    .await;
                    match result {
                        Ok(()) => tally.ok.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            errors.lock().expect("lock").push(e.to_string());
                            tally.failed.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                }
            }));
        }
    }
    for t in tasks {
        t.await?;
    }
    let errors = errors.lock().map(|e| e.clone()).unwrap_or_default();
    Ok((tally.ok.load(Ordering::Relaxed), tally.failed.load(Ordering::Relaxed), errors))
}

shardline_testkit::register!(shared: behind_pgbouncer_in_transaction_mode_every_row_lands_in_its_shard);
/// The deployment: PgBouncer 1.18 (Debian's) in transaction mode in front of the
/// host, two application processes, each with a statement cache asked for. With
/// `transaction_pooler = true`, and with the key left out (the pooler is found out on the
/// first connection: its cancel key is not the server process's), every operation
/// succeeds, every row is in its own shard, and no statement is kept. (Before pools
/// found poolers out, the key left out meant "direct": the statements were kept under
/// names every process uses, and met another process's.)
pub(crate) async fn behind_pgbouncer_in_transaction_mode_every_row_lands_in_its_shard(
    ctx: TestContext,
) -> TestResult {
    let shards = 16;
    let f = Fixture::new(&ctx, 1, shards).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let bouncer = Pgbouncer::start(&ctx.hosts()[0], PoolMode::Transaction, 4).await?;
    eprintln!("pooler: {}", bouncer.version());
    let through = through(&f, &ctx, &bouncer)?;
    let c = f.client(&ctx, 0).await?;
    for pooler in [true, false] {
        // Declared, or left for each connection to show.
        let text = if pooler { format!("transaction_pooler = true\n{through}") } else { through.clone() };
        // Two processes, as in the issue: the driver names statements s0, s1, ... per
        // process, so only two processes can meet the same name on one server connection.
        let file = f.path().with_file_name(format!("through-{pooler}.toml"));
        std::fs::write(&file, &text)?;
        let run = |first: &str| {
            tokio::process::Command::new(env!("CARGO_BIN_EXE_pooler-load"))
                .args([file.to_str().unwrap_or_default(), &shards.to_string(), first, "300"])
                .output()
        };
        let (a, b) = tokio::join!(run("0"), run("1"));
        let (a, b) = (a?, b?);
        let said = |o: &std::process::Output| {
            format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
        };
        let foreign = foreign_rows(&c, shards).await?;
        assert_eq!(
            foreign,
            0,
            "declared {pooler}, two processes: rows in another shard:\n{}\n{}",
            said(&a),
            said(&b)
        );
        for out in [&a, &b] {
            assert!(out.status.success() && out.stdout.starts_with(b"300 0 0\n"), "{pooler}: {}", said(out));
        }
        // Two handles in this process, with transactions and the caller's own SQL.
        let config = f.config_from(&text)?;
        let o = ClusterOptions { pool_size: 8, statement_cache: 1024, ..ClusterOptions::default() };
        let (ok, failed, errors) = load(&config, &o, shards, 40).await?;
        let seen = Cluster::connect(&config, o.clone()).await?;
        let pg1 = seen.route_user(0).host;
        drop(seen.client(&pg1).await?);
        assert!(seen.behind_pooler(&pg1), "transaction_pooler = {pooler}: the pooler is known");
        assert_eq!(foreign_rows(&c, shards).await?, 0, "declared {pooler}: a row in another shard");
        assert_eq!((ok, failed), (320, 0), "declared {pooler}: {errors:?}");
    }
    // The server connections the pooler holds keep no statement of shardline's: asked
    // on each (a simple query, itself unnamed, lands on one of them).
    let (pooled, task) = tokio_postgres::connect(&bouncer.url(f.db()), tokio_postgres::NoTls).await?;
    tokio::spawn(task);
    for _ in 0..8 {
        let rows = pooled.simple_query("SELECT count(*) FROM pg_prepared_statements").await?;
        let held = rows.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        });
        assert_eq!(held.as_deref(), Some("0"), "a pooled server connection holds a prepared statement");
    }
    Ok(())
}

shardline_testkit::register!(shared: behind_pgbouncer_the_application_minter_reserves_from_its_own_shard);
/// `ShardIdGenerator` (IDs minted in the application from blocks reserved from the
/// shard's sequence) behind PgBouncer in transaction mode: 8 clients over 2 server
/// connections, half for shard 3 and half for shard 5, each reserving one value per
/// round trip. Every reservation succeeds, and every ID is unique and carries its own
/// shard. (Before, the reservation was a named statement: its Parse and its Bind were
/// two round trips, which the pooler handed to different server connections, and the
/// Bind failed (26000) or could run another client's statement of that name.)
pub(crate) async fn behind_pgbouncer_the_application_minter_reserves_from_its_own_shard(
    ctx: TestContext,
) -> TestResult {
    use shardline_repo::ids::ShardIdGenerator;

    let shards = 8;
    let f = Fixture::new(&ctx, 1, shards).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let bouncer = Pgbouncer::start(&ctx.hosts()[0], PoolMode::Transaction, 2).await?;
    let layout = f.config()?.layout;
    let prefix = shardline_router::SchemaPrefix::new("shard_")?;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let shard: u16 = if i % 2 == 0 { 3 } else { 5 };
        let (c, task) = tokio_postgres::connect(&bouncer.url(f.db()), tokio_postgres::NoTls).await?;
        tokio::spawn(task);
        let generator =
            ShardIdGenerator::new(layout, &prefix, crate::shard(shard))?.block(1).max_ahead_ms(1000);
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for _ in 0..150 {
                ids.push(generator.next_id(&c).await.map_err(|e| e.to_string())?);
            }
            Ok::<_, String>((shard, ids))
        }));
    }
    let mut seen = std::collections::HashSet::new();
    for task in tasks {
        let (shard, ids) = task.await??;
        for id in ids {
            assert_eq!(id.shard(), u32::from(shard), "{id} reserved for shard {shard}");
            assert!(seen.insert(id), "{id} minted twice");
        }
    }
    assert_eq!(seen.len(), 8 * 150);
    Ok(())
}

shardline_testkit::register!(shared: behind_a_transaction_pooler_a_schema_type_is_refused_clearly);
/// A table with a column whose type lives in the shard's schema (an enum) cannot be
/// used with unnamed statements only: behind a transaction pooler it is refused before
/// the statement is sent, with a message that names the column and says what to do.
pub(crate) async fn behind_a_transaction_pooler_a_schema_type_is_refused_clearly(
    ctx: TestContext,
) -> TestResult {
    use crate::promises::{Feeling, Mood, NewFeeling};
    let f = Fixture::new(&ctx, 1, 2).await?;
    f.migration(
        "0005_moods.sql",
        "CREATE TYPE mood AS ENUM ('happy', 'sad');
         CREATE TABLE moods (id bigint PRIMARY KEY DEFAULT next_id(), user_id bigint NOT NULL, mood mood NOT NULL);",
    )?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let bouncer = Pgbouncer::start(&ctx.hosts()[0], PoolMode::Transaction, 2).await?;
    let text = format!("transaction_pooler = true\n{}", through(&f, &ctx, &bouncer)?);
    let cluster = Cluster::connect(&f.config_from(&text)?, ClusterOptions::default()).await?;
    assert_eq!(cluster.options().transaction_pooler, Some(true), "the config's key sets the option");
    let feelings = cluster.repo::<Feeling>()?;
    let new = NewFeeling { user_id: 3, mood: Mood("happy".into()) };
    for err in [
        feelings.insert(&new).await.unwrap_err(),
        feelings.insert_many(std::slice::from_ref(&new)).await.unwrap_err(),
    ] {
        assert!(matches!(err, Error::Pooler { .. }), "{err:?}");
        assert!(!err.outcome_unknown(), "nothing was sent");
        let text = err.to_string();
        assert!(text.contains("column moods.mood has a type of the shard's schema"), "{text}");
        assert!(text.contains("session-mode pool"), "{text}");
    }
    let c = f.client(&ctx, 0).await?;
    let n: i64 = c
        .query_one(
            "SELECT (SELECT count(*) FROM shard_0000.moods) + (SELECT count(*) FROM shard_0001.moods)",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(n, 0);
    // Photos (built-in types only) work through the same pooler.
    let photos = cluster.repo::<Photo>()?;
    let p = photos.insert(&photo(3, 0)).await?;
    assert_eq!(photos.get(p.id).await?.map(|g| g.id), Some(p.id));
    Ok(())
}

shardline_testkit::register!(shared: behind_pgbouncer_a_statement_that_timed_out_is_cancelled);
/// `reliability::a_write_that_timed_out_is_cancelled_and_holds_up_no_one` with pg1
/// behind PgBouncer in transaction mode: the cancel of a statement that ran out of time
/// goes through the pooler, which passes it on only while the client that sent the
/// statement is still connected (so shardline closes that connection after the cancel,
/// not before). The insert that timed out leaves the lock's queue and never commits.
pub(crate) async fn behind_pgbouncer_a_statement_that_timed_out_is_cancelled(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let bouncer = Pgbouncer::start(&ctx.hosts()[0], PoolMode::Transaction, 4).await?;
    let text = format!("transaction_pooler = true\n{}", through(&f, &ctx, &bouncer)?);
    crate::reliability::timed_out_statements_are_cancelled(&f, &ctx, &text).await
}

shardline_testkit::register!(shared: a_notification_lost_in_a_pooler_is_caught_by_the_map_check);
/// The catalog's `LISTEN` through a transaction-mode pooler succeeds and receives
/// nothing; the map check finds the change within `map_check` and reloads.
pub(crate) async fn a_notification_lost_in_a_pooler_is_caught_by_the_map_check(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let bouncer = Pgbouncer::start(&ctx.hosts()[0], PoolMode::Transaction, 2).await?;
    let text = f.config_text()?.replacen(
        "[catalog]\n",
        &format!("[catalog]\nlisten_url = \"{}\"\n", bouncer.url(f.db())),
        1,
    );
    let config = f.config_from(&text)?;
    assert!(config.listen_url.is_some());
    let deaf =
        Cluster::connect(&config, ClusterOptions { map_check: Duration::ZERO, ..ClusterOptions::default() })
            .await?;
    let check = Duration::from_millis(500);
    let checked =
        Cluster::connect(&config, ClusterOptions { map_check: check, ..ClusterOptions::default() }).await?;
    let c = f.client(&ctx, 0).await?;
    c.execute("UPDATE shardline.shards SET host = 'pg2' WHERE shard = 0", &[]).await?;
    let changed = Instant::now();
    while checked.map().version() < 2 {
        assert!(changed.elapsed() < check * 4, "the map check did not find the change");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let caught = changed.elapsed();
    eprintln!("observed: a lost notification caught after {caught:?} (map_check {check:?})");
    tokio::time::sleep(check * 2).await;
    assert_eq!(deaf.map().version(), 1, "no notification arrives through a transaction pooler");
    Ok(())
}

/// One number from a simple query (no prepared statement of its own).
async fn simple_number(client: &tokio_postgres::Client, sql: &str) -> Result<i64, BoxError> {
    let rows = client.simple_query(sql).await?;
    let value = rows.iter().find_map(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
        _ => None,
    });
    Ok(value.ok_or("no row")?.parse()?)
}

shardline_testkit::register!(apart: at_2000_shards_a_connection_holds_no_statement_of_shardline);
/// At 2000 shards, a pooled connection that served inserts, reads by ID and pages in
/// every shard holds no prepared statement of shardline's, and at most
/// `statement_cache` with one asked for. For comparison, the same statements prepared and kept per
/// connection (what the request path did before, one per statement shape and shard)
/// are counted and weighed on another connection (observed figures printed). On a host
/// of its own: the suite's longest test (mostly `init` of 2000 shards) starts with the
/// first, beside the exclusive ones, rather than last among the shared ones.
pub(crate) async fn at_2000_shards_a_connection_holds_no_statement_of_shardline(
    _ctx: TestContext,
) -> TestResult {
    crate::moves::on_own_kit(1, &[], |kit| Box::pin(at_2000_shards(kit))).await
}

async fn at_2000_shards(ctx: &shardline_testkit::Cluster) -> Result<(), BoxError> {
    let shards: u16 = 2000;
    let f = Fixture::on_kit(ctx, "at_2000_shards", shards).await?;
    let started = Instant::now();
    shardline_ops::init(&f.config()?, &options(4), &quiet).await?;
    eprintln!("init of {shards} shards: {:?}", started.elapsed());
    let cluster =
        Cluster::connect(&f.config()?, ClusterOptions { pool_size: 1, ..ClusterOptions::default() }).await?;
    let photos = cluster.repo::<Photo>()?;
    let memory = "SELECT sum(total_bytes) FROM pg_backend_memory_contexts";
    let host = cluster.route_user(0).host;
    let before = {
        let conn = cluster.client(&host).await?;
        simple_number(&conn, memory).await?
    };
    let started = Instant::now();
    for user in 0..i64::from(shards) {
        let p = photos.insert(&photo(user, 0)).await?;
        assert_eq!(photos.get(p.id).await?.map(|g| g.id), Some(p.id));
        assert_eq!(photos.page_of_user(user, None, 10).await?.rows.len(), 1);
    }
    let took = started.elapsed();
    // With a statement cache of 256 (direct connections only): bounded by it, over the
    // statements of 400 shards (1,200, well past the bound).
    let cached_shards: u16 = 400;
    let cached = Cluster::connect(
        &f.config()?,
        ClusterOptions { pool_size: 1, statement_cache: 256, ..ClusterOptions::default() },
    )
    .await?;
    let cached_photos = cached.repo::<Photo>()?;
    for user in 0..i64::from(cached_shards) {
        let p = cached_photos.insert(&photo(user, 1)).await?;
        assert_eq!(cached_photos.get(p.id).await?.map(|g| g.id), Some(p.id));
        assert_eq!(cached_photos.page_of_user(user, None, 10).await?.rows.len(), 2);
    }
    {
        let conn = cached.client(&host).await?;
        let kept = simple_number(&conn, "SELECT count(*) FROM pg_prepared_statements").await?;
        assert!((1..=256).contains(&kept), "statement_cache = 256 kept {kept} statements");
        eprintln!(
            "observed: statement_cache = 256, {} statements in {cached_shards} shards: {kept} kept",
            3 * cached_shards
        );
    }
    let conn = cluster.client(&host).await?;
    let held = simple_number(&conn, "SELECT count(*) FROM pg_prepared_statements").await?;
    let after = simple_number(&conn, memory).await?;
    let top = conn
        .simple_query(
            "SELECT name || ' ' || sum(total_bytes) FROM pg_backend_memory_contexts GROUP BY name ORDER BY sum(total_bytes) DESC LIMIT 4",
        )
        .await?;
    let top: Vec<String> = top
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .collect();
    eprintln!("observed: the largest memory contexts of that connection: {top:?}");
    drop(conn);
    assert_eq!(held, 0, "the pooled connection holds prepared statements");
    eprintln!(
        "observed: unnamed, {} statements in {shards} shards on one connection in {took:?}: \
         {held} prepared statements, backend memory {before} -> {after} bytes",
        3 * shards
    );
    // The former way: the same three statements prepared and kept, per shard.
    let c = f.client(ctx, 0).await?;
    let base = simple_number(&c, memory).await?;
    let prefix = cluster.prefix();
    let mut kept = Vec::new();
    for s in 0..shards {
        let schema = prefix.schema(shardline_router::LogicalShard::new(i64::from(s), cluster.map().count())?);
        let q = schema.quoted();
        kept.push(c.prepare(&format!("INSERT INTO {q}.photos (user_id, url, caption) VALUES ($1, $2, $3) RETURNING id, user_id, url, caption")).await?);
        kept.push(
            c.prepare(&format!("SELECT id, user_id, url, caption FROM {q}.photos WHERE id = $1")).await?,
        );
        kept.push(c.prepare(&format!("SELECT id, user_id, url, caption FROM {q}.photos WHERE user_id = $1 AND id < $2 ORDER BY id DESC LIMIT $3")).await?);
    }
    let named = simple_number(&c, "SELECT count(*) FROM pg_prepared_statements").await?;
    let weight = simple_number(&c, memory).await?;
    assert_eq!(named, 3 * i64::from(shards));
    eprintln!(
        "observed: prepared and kept, {named} statements on one connection: backend memory {base} -> {weight} bytes \
         ({} bytes per statement)",
        (weight - base) / named.max(1)
    );
    drop(kept);
    Ok(())
}

shardline_testkit::register!(shared: behind_an_undeclared_pooler_the_sqlx_path_refuses);
/// The sqlx path keeps named statements, which a transaction-mode pooler hands to other
/// clients. With the config saying nothing, a host behind PgBouncer is found out before
/// sqlx connects to it: a unit of work and `pool()` refuse with `Error::Pooler`, and the
/// unit's insert is not applied. A session-mode pool looks the same (its cancel keys
/// are its own too); declared with `transaction_pooler = false`, the unit runs there.
pub(crate) async fn behind_an_undeclared_pooler_the_sqlx_path_refuses(ctx: TestContext) -> TestResult {
    let shards = 4;
    let f = Fixture::new(&ctx, 1, shards).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let c = f.client(&ctx, 0).await?;
    let count = || async {
        let n: i64 = c.query_one("SELECT count(*) FROM shard_0001.photos", &[]).await?.get(0);
        Ok::<_, BoxError>(n)
    };
    let insert = |cluster: &Cluster| {
        let db = cluster.sqlx();
        async move {
            db.transaction(crate::shard(1), |conn| {
                Box::pin(async move {
                    ::sqlx::query("INSERT INTO photos (user_id, url, caption) VALUES (1, 'u', '')")
                        .execute(&mut **conn)
                        .await
                })
            })
            .await
            .map(drop)
        }
    };
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        let bouncer = Pgbouncer::start(&ctx.hosts()[0], mode, 2).await?;
        let through = through(&f, &ctx, &bouncer)?;
        let cluster = Cluster::connect(&f.config_from(&through)?, ClusterOptions::default()).await?;
        let pg1 = cluster.route(crate::shard(1))?.host;
        let err = insert(&cluster).await.expect_err("a unit of work behind an undeclared pooler");
        assert!(matches!(err, Error::Pooler { .. }), "{mode:?}: {err}");
        assert!(err.to_string().contains("transaction_pooler = false"), "{mode:?}: says what to set: {err}");
        assert!(cluster.behind_pooler(&pg1), "{mode:?}: found out");
        let err = cluster.sqlx().pool(&pg1).await.expect_err("pool() behind an undeclared pooler");
        assert!(matches!(err, Error::Pooler { .. }), "{mode:?}: {err}");
        assert_eq!(count().await?, 0, "{mode:?}: the refused unit applied nothing");
        if mode == PoolMode::Session {
            // Declared a session pool: the sqlx path runs through it.
            let declared = format!("transaction_pooler = false\n{through}");
            let cluster = Cluster::connect(&f.config_from(&declared)?, ClusterOptions::default()).await?;
            insert(&cluster).await?;
            assert!(!cluster.behind_pooler(&pg1), "declared false");
            assert_eq!(count().await?, 1, "the unit ran through the session pool");
        }
    }
    Ok(())
}
