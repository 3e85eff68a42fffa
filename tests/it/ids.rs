//! IDs minted inside Postgres by the SQL `shardline-id` renders: unique by construction,
//! monotonic per shard, deaf to clock steps, and decoded identically by Rust and SQL.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::TestRunner;
use shardline_id::generator::ReservedBlocks;
use shardline_id::sql::{Minter, ShardSql};
use shardline_id::{Id, IdParts, Layout};
use shardline_testkit::Host;
use shardline_testkit::harness::{TestContext, TestResult};
use tokio_postgres::Client;

use crate::bootstrap::BoxError;

const L: Layout = Layout::INSTAGRAM;
const SHARD: u32 = 5;
const SCHEMA: &str = "shard_0005";

/// A fresh database on host `host` with shard 5's minter and a `photos` table using it.
async fn shard_db(
    ctx: &TestContext,
    host: usize,
    sql: &ShardSql,
) -> Result<(String, Client), Box<dyn std::error::Error + Send + Sync>> {
    let db = ctx.databases().await?;
    let client = ctx.hosts()[host].connect(&db).await?;
    client.batch_execute(&format!("CREATE SCHEMA {SCHEMA}")).await?;
    client.batch_execute(&sql.install()).await?;
    client
        .batch_execute(&format!(
            "CREATE TABLE {SCHEMA}.photos (id bigint PRIMARY KEY DEFAULT {SCHEMA}.next_id(), n bigint NOT NULL, session int NOT NULL DEFAULT 0)"
        ))
        .await?;
    Ok((db, client))
}

fn minter() -> ShardSql {
    ShardSql::new(L, SCHEMA, SHARD).expect("a valid schema and shard")
}

/// Shard 5's minter with the native (C) `next_id()`: the test kit's hosts have its
/// library (`scripts/native-minter.sh`).
fn native() -> ShardSql {
    minter().minter(Minter::Native)
}

async fn ids(client: &Client, sql: &str) -> Result<Vec<Id>, tokio_postgres::Error> {
    Ok(client.query(sql, &[]).await?.iter().map(|r| r.get::<_, Id>(0)).collect())
}

fn strictly_increasing(ids: &[Id]) -> bool {
    ids.windows(2).all(|w| w[0] < w[1])
}

shardline_testkit::register!(shared: a_million_rows_from_one_statement_are_distinct);
pub(crate) async fn a_million_rows_from_one_statement_are_distinct(ctx: TestContext) -> TestResult {
    let (_db, client) = shard_db(&ctx, 0, &minter()).await?;
    client
        .execute(&format!("INSERT INTO {SCHEMA}.photos (n) SELECT g FROM generate_series(1, 1000000) g"), &[])
        .await?;
    let row = client
        .query_one(
            &format!(
                "SELECT count(*), count(DISTINCT id), count(*) FILTER (WHERE id <= prev), min(id), max(id)
                 FROM (SELECT id, lag(id) OVER (ORDER BY n) AS prev FROM {SCHEMA}.photos) t"
            ),
            &[],
        )
        .await?;
    let (rows, distinct, decreasing): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    assert_eq!((rows, distinct), (1_000_000, 1_000_000), "duplicate IDs");
    assert_eq!(decreasing, 0, "IDs must increase in the order rows were minted");
    let (first, last): (Id, Id) = (row.get(3), row.get(4));
    for id in [first, last] {
        assert_eq!(id.shard(), SHARD);
    }
    let now = shardline_id::generator::Clock::now_ms(&shardline_id::generator::SystemClock);
    assert!(
        (first.unix_ms() - now).abs() < 120_000,
        "first ID's time {} is far from now {now}",
        first.unix_ms()
    );
    Ok(())
}

shardline_testkit::register!(shared: more_than_1024_ids_in_one_clock_millisecond_stay_unique);
pub(crate) async fn more_than_1024_ids_in_one_clock_millisecond_stay_unique(ctx: TestContext) -> TestResult {
    ids_in_one_millisecond(ctx, &minter()).await
}

shardline_testkit::register!(shared: the_native_minter_mints_more_than_1024_ids_in_one_clock_millisecond_uniquely);
pub(crate) async fn the_native_minter_mints_more_than_1024_ids_in_one_clock_millisecond_uniquely(
    ctx: TestContext,
) -> TestResult {
    ids_in_one_millisecond(ctx, &native()).await
}

async fn ids_in_one_millisecond(ctx: TestContext, sql: &ShardSql) -> TestResult {
    let (_db, client) = shard_db(&ctx, 1, sql).await?;
    // Inside one transaction the clock the minter reads (now()) does not move: every ID
    // below is minted "in the same millisecond". 5000 of them borrow the next ones.
    let minted = ids(&client, &format!("SELECT {SCHEMA}.next_id() FROM generate_series(1, 5000)")).await?;
    assert_eq!(minted.iter().collect::<HashSet<_>>().len(), 5000);
    assert!(strictly_increasing(&minted));
    let mut per_ms = std::collections::BTreeMap::<i64, u32>::new();
    for id in &minted {
        *per_ms.entry(id.unix_ms()).or_default() += 1;
    }
    assert!(per_ms.values().all(|&n| n <= 1024));
    assert!(
        per_ms.values().filter(|&&n| n == 1024).count() >= 3,
        "the burst should fill whole milliseconds: {per_ms:?}"
    );

    // Instagram's scheme, `nextval() % 1024` beside the same clock, repeats IDs in the
    // same burst: this test would catch a minter that is unique only by luck.
    client
        .batch_execute(&format!(
            "CREATE SEQUENCE {SCHEMA}.insta_seq;
             CREATE FUNCTION {SCHEMA}.insta_next_id() RETURNS bigint LANGUAGE sql VOLATILE AS $$
             SELECT ((floor(extract(epoch FROM now()) * 1000)::bigint - {epoch}) << 23) | ({SHARD} << 10) | (nextval('{SCHEMA}.insta_seq') % 1024) $$",
            epoch = L.epoch_ms()
        ))
        .await?;
    let theirs =
        ids(&client, &format!("SELECT {SCHEMA}.insta_next_id() FROM generate_series(1, 5000)")).await?;
    let distinct = theirs.iter().collect::<HashSet<_>>().len();
    assert_eq!(distinct, 1024, "Instagram's scheme should repeat after 1024 IDs in one clock millisecond");
    Ok(())
}

async fn concurrent_sessions(ctx: TestContext, sessions: i32, rows: i64, sql: ShardSql) -> TestResult {
    // The clock reads 10 s ahead of the sequence, so every session starts by catching up,
    // all at once: the catch-up must be safe against the others' nextval.
    let (db, client) = shard_db(&ctx, 2, &sql).await?;
    client.batch_execute(&sql.clone().clock_offset_ms(10_000).install()).await?;
    let host: &Host = &ctx.hosts()[2];
    let mut tasks = Vec::new();
    for s in 0..sessions {
        let c = host.connect(&db).await?;
        tasks.push(tokio::spawn(async move {
            c.execute(
                &format!("INSERT INTO {SCHEMA}.photos (n, session) SELECT g, $1 FROM generate_series(1, $2::bigint) g"),
                &[&s, &rows],
            )
            .await
        }));
    }
    for t in tasks {
        t.await??;
    }
    let row = client
        .query_one(
            &format!(
                "SELECT count(*), count(DISTINCT id),
                        (SELECT count(*) FROM (SELECT id, lag(id) OVER (PARTITION BY session ORDER BY n) AS prev FROM {SCHEMA}.photos) t WHERE id <= prev)
                 FROM {SCHEMA}.photos"
            ),
            &[],
        )
        .await?;
    let (total, distinct, decreasing): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(total, i64::from(sessions) * rows);
    assert_eq!(distinct, total, "{sessions} concurrent sessions minted duplicate IDs");
    assert_eq!(decreasing, 0, "a session's IDs went down");
    Ok(())
}

shardline_testkit::register!(shared: two_concurrent_sessions_never_collide);
pub(crate) async fn two_concurrent_sessions_never_collide(ctx: TestContext) -> TestResult {
    concurrent_sessions(ctx, 2, 250_000, minter()).await
}

shardline_testkit::register!(shared: four_concurrent_sessions_never_collide);
pub(crate) async fn four_concurrent_sessions_never_collide(ctx: TestContext) -> TestResult {
    concurrent_sessions(ctx, 4, 250_000, minter()).await
}

shardline_testkit::register!(shared: four_concurrent_sessions_never_collide_through_the_native_minter);
pub(crate) async fn four_concurrent_sessions_never_collide_through_the_native_minter(
    ctx: TestContext,
) -> TestResult {
    concurrent_sessions(ctx, 4, 250_000, native()).await
}

shardline_testkit::register!(shared: a_clock_stepping_back_changes_nothing);
pub(crate) async fn a_clock_stepping_back_changes_nothing(ctx: TestContext) -> TestResult {
    clock_steps(ctx, minter()).await
}

shardline_testkit::register!(shared: a_clock_stepping_back_changes_nothing_for_the_native_minter);
/// As above, through the native minter (each install here also replaces its `next_id()`
/// under the running session; whether the session reloads the constants is proved by
/// `the_native_minter_replaces_the_plpgsql_one_in_place_and_running_sessions_follow`).
pub(crate) async fn a_clock_stepping_back_changes_nothing_for_the_native_minter(
    ctx: TestContext,
) -> TestResult {
    clock_steps(ctx, native()).await
}

async fn clock_steps(ctx: TestContext, sql: ShardSql) -> TestResult {
    let (_db, client) = shard_db(&ctx, 0, &sql).await?;
    let mut all = Vec::new();
    for offset in [0, -3_600_000, -86_400_000, 5_000, -10_000] {
        client.batch_execute(&sql.clone().clock_offset_ms(offset).install()).await?;
        for _ in 0..3 {
            all.extend(
                ids(&client, &format!("SELECT {SCHEMA}.next_id() FROM generate_series(1, 700)")).await?,
            );
        }
    }
    assert_eq!(all.iter().collect::<HashSet<_>>().len(), all.len(), "a clock step made a duplicate");
    assert!(strictly_increasing(&all), "a clock step made IDs go down");
    Ok(())
}

shardline_testkit::register!(shared: a_lagging_sequence_catches_up_and_waits_for_no_one);
pub(crate) async fn a_lagging_sequence_catches_up_and_waits_for_no_one(ctx: TestContext) -> TestResult {
    let sql = minter();
    let (db, client) = shard_db(&ctx, 1, &sql).await?;
    let before = ids(&client, &format!("SELECT {SCHEMA}.next_id()")).await?[0];
    // The clock jumps 60 s ahead: the next ID catches up to it.
    client.batch_execute(&sql.clone().clock_offset_ms(60_000).install()).await?;
    let jumped = ids(&client, &format!("SELECT {SCHEMA}.next_id()")).await?[0];
    assert!(jumped.unix_ms() - before.unix_ms() >= 59_000, "no catch-up: {before:?} -> {jumped:?}");

    // Another transaction mints and stays open. Then the clock jumps another minute: the
    // catch-up cannot get its lock while that transaction is open, so the ID comes at
    // once from the lagging sequence (still unique, just older) instead of waiting.
    let holder = ctx.hosts()[1].connect(&db).await?;
    holder.batch_execute(&format!("BEGIN; SELECT {SCHEMA}.next_id()")).await?;
    let started = Instant::now();
    client.batch_execute(&sql.clone().clock_offset_ms(120_000).install()).await?;
    let lagging = ids(&client, &format!("SELECT {SCHEMA}.next_id()")).await?[0];
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(2), "minting waited {waited:?} for an open transaction");
    assert!(lagging > jumped, "IDs went down");
    assert!(
        lagging.unix_ms() - jumped.unix_ms() < 1000,
        "caught up while another minting transaction was open"
    );
    holder.batch_execute("COMMIT").await?;
    // The session tries its catch-up again once its backoff (100 ms) has passed.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let caught = ids(&client, &format!("SELECT {SCHEMA}.next_id()")).await?[0];
    assert!(
        caught.unix_ms() - jumped.unix_ms() >= 59_000,
        "no catch-up after the holder committed: {caught:?}"
    );
    Ok(())
}

shardline_testkit::register!(quiet: sessions_that_keep_minting_after_a_failed_catch_up_try_again_on_a_shared_beat);
/// Another minting transaction stays open for 3 s, so every catch-up gives way; three
/// sessions keep minting, every 20, 90 and 300 ms, as applications do. Within 2.5 s of
/// that transaction's end their IDs are fresh again: before, each ID minted from the
/// lagging sequence pushed the next attempt a second further, so a session that never
/// paused for a second never tried again (32 sessions in CI minted 1,888 of 5,760 IDs up
/// to 1.2 s behind). Meanwhile the attempts back off on the shard's beat: the calls of
/// over 150 ms, all sessions' together, make at most 8 separate stalls in those 3 s
/// (attempting on every call would make ~13; the beat, 5 or 6; each session on a beat
/// of its own, more). Alone on the hosts: it times calls.
pub(crate) async fn sessions_that_keep_minting_after_a_failed_catch_up_try_again_on_a_shared_beat(
    ctx: TestContext,
) -> TestResult {
    const SESSIONS: usize = 3;
    let sql = minter();
    let (db, client) = shard_db(&ctx, 1, &sql).await?;
    let next = format!("SELECT {SCHEMA}.next_id()");
    let before = ids(&client, &next).await?[0];
    let holder = ctx.hosts()[1].connect(&db).await?;
    holder.batch_execute(&format!("BEGIN; SELECT {SCHEMA}.next_id()")).await?;
    // The clock jumps a minute ahead while the holder's transaction is open: every
    // catch-up gives way, and the IDs come from the lagging sequence.
    client.batch_execute(&sql.clone().clock_offset_ms(60_000).install()).await?;
    let fresh = move |id: Id| id.unix_ms() - before.unix_ms() >= 59_000;
    let committed = std::sync::Arc::new(tokio::sync::OnceCell::<Instant>::new());
    let mut clients = Vec::new();
    for _ in 0..SESSIONS {
        clients.push(ctx.hosts()[1].connect(&db).await?);
    }
    // Every session connected first, then all start together.
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(SESSIONS));
    let slow = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(Instant, Instant)>::new()));
    let mut sessions = Vec::new();
    for (c, every) in clients.into_iter().zip([20, 90, 300]) {
        let (next, committed, start, slow) = (
            next.clone(),
            std::sync::Arc::clone(&committed),
            std::sync::Arc::clone(&start),
            std::sync::Arc::clone(&slow),
        );
        sessions.push(tokio::spawn(async move {
            start.wait().await;
            let (mut stalls, mut lagging) = (0, 0);
            loop {
                let t = Instant::now();
                let id = ids(&c, &next).await?[0];
                assert!(id > before, "IDs went down");
                match committed.get() {
                    None if t.elapsed() > Duration::from_millis(150) => {
                        stalls += 1;
                        slow.lock().map_err(|e| e.to_string())?.push((t, Instant::now()));
                    }
                    None => {}
                    Some(at) if fresh(id) => return Ok::<_, BoxError>((stalls, lagging, at.elapsed())),
                    Some(at) => assert!(
                        at.elapsed() < Duration::from_secs(4),
                        "still lagging 4 s after the holder committed, minting every 20 ms"
                    ),
                }
                if committed.get().is_none() && !fresh(id) {
                    lagging += 1;
                }
                tokio::time::sleep(Duration::from_millis(every)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    holder.batch_execute("COMMIT").await?;
    committed.set(Instant::now())?;
    for s in sessions {
        let (stalls, lagging, after) = s.await??;
        eprintln!(
            "      a session: {lagging} IDs lagging and {stalls} calls over 150 ms while the holder was open; fresh {after:?} after it committed"
        );
        assert!(lagging > 0, "caught up while another minting transaction was open");
        assert!(after < Duration::from_millis(2500), "fresh only {after:?} after the holder committed");
    }
    // The slow calls' spans, merged where they overlap: the shard's separate stalls.
    let mut spans = slow.lock().map_err(|e| e.to_string())?.clone();
    spans.sort();
    let mut stalls: Vec<(Instant, Instant)> = Vec::new();
    for (from, to) in spans {
        match stalls.last_mut() {
            Some(last) if from <= last.1 => last.1 = last.1.max(to),
            _ => stalls.push((from, to)),
        }
    }
    eprintln!("      {} separate stalls of the shard while the holder was open", stalls.len());
    assert!(
        stalls.len() <= 8,
        "{} separate stalls in 3 s: the attempts did not back off together",
        stalls.len()
    );
    Ok(())
}

shardline_testkit::register!(shared: rust_and_sql_decode_alike);
pub(crate) async fn rust_and_sql_decode_alike(ctx: TestContext) -> TestResult {
    let (_db, client) = shard_db(&ctx, 2, &minter()).await?;
    // SQL-minted IDs: Rust's decoding equals SQL's id_parts.
    let rows = client
        .query(&format!("SELECT id, (p).unix_ms, (p).shard, (p).sequence FROM (SELECT id, {SCHEMA}.id_parts(id) AS p FROM (SELECT {SCHEMA}.next_id() AS id FROM generate_series(1, 3000)) m) d"), &[])
        .await?;
    for r in &rows {
        let id: Id = r.get(0);
        let sql = IdParts {
            unix_ms: r.get(1),
            shard: u32::try_from(r.get::<_, i32>(2))?,
            sequence: u32::try_from(r.get::<_, i32>(3))?,
        };
        assert_eq!(L.decode(id), sql);
    }
    // Rust-composed IDs over the whole range, from a property strategy: SQL's id_parts
    // gives back the parts Rust composed them from.
    let strategy =
        proptest::collection::vec((L.epoch_ms()..=L.last_unix_ms(), 0u32..=8191, 0u32..=1023), 2000);
    let cases = strategy.new_tree(&mut TestRunner::deterministic()).map_err(|r| r.to_string())?.current();
    let composed: Vec<i64> =
        cases.iter().map(|&(ms, s, q)| L.compose(ms, s, q).map(Id::as_i64)).collect::<Result<_, _>>()?;
    let decoded = client
        .query(&format!("SELECT (p).unix_ms, (p).shard, (p).sequence FROM (SELECT {SCHEMA}.id_parts(x) AS p, o FROM unnest($1::bigint[]) WITH ORDINALITY AS u(x, o)) d ORDER BY o"), &[&composed])
        .await?;
    assert_eq!(decoded.len(), cases.len());
    for (r, &(ms, s, q)) in decoded.iter().zip(&cases) {
        assert_eq!(
            (r.get::<_, i64>(0), r.get::<_, i32>(1), r.get::<_, i32>(2)),
            (ms, i32::try_from(s)?, i32::try_from(q)?)
        );
    }
    Ok(())
}

shardline_testkit::register!(shared: reserved_blocks_and_database_minting_share_one_source);
pub(crate) async fn reserved_blocks_and_database_minting_share_one_source(ctx: TestContext) -> TestResult {
    let (db, client) = shard_db(&ctx, 0, &minter()).await?;
    let other = ctx.hosts()[0].connect(&db).await?;
    // The database mints while the application reserves blocks of the same sequence.
    let inserting = tokio::spawn(async move {
        other
            .execute(
                &format!("INSERT INTO {SCHEMA}.photos (n) SELECT g FROM generate_series(1, 100000) g"),
                &[],
            )
            .await
    });
    let mut blocks = ReservedBlocks::new(L, SHARD)?;
    for _ in 0..20 {
        for r in client.query(&format!("SELECT * FROM {SCHEMA}.reserve_ids(2500)"), &[]).await? {
            blocks.push(r.get(0), r.get(1))?;
        }
    }
    inserting.await??;
    assert_eq!(blocks.remaining(), 50_000);
    let app: Vec<Id> = std::iter::from_fn(|| blocks.next_id().transpose()).collect::<Result<_, _>>()?;
    let db_ids = ids(&client, &format!("SELECT id FROM {SCHEMA}.photos")).await?;
    let mut all: HashSet<Id> = db_ids.iter().copied().collect();
    assert_eq!(all.len(), 100_000);
    for id in &app {
        assert_eq!(id.shard(), SHARD);
        assert!(all.insert(*id), "the application and the database both minted {id}");
    }
    let err = client.query(&format!("SELECT * FROM {SCHEMA}.reserve_ids(0)"), &[]).await.unwrap_err();
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::INVALID_PARAMETER_VALUE));
    Ok(())
}

shardline_testkit::register!(shared: the_application_generator_shares_the_sequence_and_keeps_near_the_clock);
pub(crate) async fn the_application_generator_shares_the_sequence_and_keeps_near_the_clock(
    ctx: TestContext,
) -> TestResult {
    use shardline_id::generator::{Clock, SystemClock};
    use shardline_repo::ids::ShardIdGenerator;
    use std::sync::Arc;

    let (db, client) = shard_db(&ctx, 1, &minter()).await?;
    // Blocks of 20,000 values hold about 20 ms of IDs; at most 5 ms ahead of the clock
    // may be handed out, so the generator must wait (asynchronously) inside each block.
    let generator = Arc::new(
        ShardIdGenerator::new(
            L,
            &shardline_router::SchemaPrefix::new("shard_")?,
            crate::shard(u16::try_from(SHARD)?),
        )?
        .block(20_000)
        .max_ahead_ms(5),
    );
    let other = ctx.hosts()[1].connect(&db).await?;
    let inserting = tokio::spawn(async move {
        other
            .execute(
                &format!("INSERT INTO {SCHEMA}.photos (n) SELECT g FROM generate_series(1, 50000) g"),
                &[],
            )
            .await
    });
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let generator = Arc::clone(&generator);
        let c = ctx.hosts()[1].connect(&db).await?;
        tasks.push(tokio::spawn(async move {
            let mut minted = Vec::new();
            for _ in 0..10_000 {
                let id = generator.next_id(&c).await?;
                let now = SystemClock.now_ms();
                if id.unix_ms() > now + 5 {
                    return Err(format!("{id} is {} ms ahead of the clock", id.unix_ms() - now).into());
                }
                minted.push(id);
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(minted)
        }));
    }
    let mut app = Vec::new();
    for t in tasks {
        let minted = t.await??;
        assert!(strictly_increasing(&minted), "one caller's IDs went down");
        app.extend(minted);
    }
    inserting.await??;
    let mut all: HashSet<Id> =
        ids(&client, &format!("SELECT id FROM {SCHEMA}.photos")).await?.into_iter().collect();
    assert_eq!(all.len(), 50_000);
    for id in app {
        assert!(all.insert(id), "{id} minted twice");
    }
    assert_eq!(all.len(), 90_000);
    Ok(())
}

shardline_testkit::register!(shared: two_transactions_catching_up_together_both_mint);
pub(crate) async fn two_transactions_catching_up_together_both_mint(ctx: TestContext) -> TestResult {
    // Two open transactions have each minted (each holds nextval's lock). The clock
    // jumps, so both reach the slow path at once. Were they to catch up, each would wait
    // for the other's lock (a deadlock); a transaction that minted never catches up nor
    // waits for one (`shardline.minted_<schema>`). Both must still get their IDs.
    let sql = minter();
    let (db, client) = shard_db(&ctx, 2, &sql).await?;
    let host = &ctx.hosts()[2];
    let (a, b) = (host.connect(&db).await?, host.connect(&db).await?);
    let mut all = Vec::new();
    for round in 1..=5i64 {
        a.batch_execute(&format!("BEGIN; SELECT {SCHEMA}.next_id()")).await?;
        b.batch_execute(&format!("BEGIN; SELECT {SCHEMA}.next_id()")).await?;
        client.batch_execute(&sql.clone().clock_offset_ms(round * 60_000).install()).await?;
        let q = format!("SELECT {SCHEMA}.next_id() FROM generate_series(1, 50)");
        let (x, y) = tokio::join!(a.query(&q, &[]), b.query(&q, &[]));
        for rows in [x?, y?] {
            all.extend(rows.iter().map(|r| r.get::<_, Id>(0)));
        }
        a.batch_execute("COMMIT").await?;
        b.batch_execute("COMMIT").await?;
    }
    assert_eq!(all.iter().collect::<HashSet<_>>().len(), 500);
    Ok(())
}

shardline_testkit::register!(quiet: after_an_idle_gap_32_one_row_sessions_get_fresh_ids);
/// Rounds of: every session idle (the sequence falls behind the clock), then all of them
/// insert one row per transaction at once, as pgbench clients do. Asserted on every row
/// (the row's `at DEFAULT now()`, read as the minter reads it): no ID more than 500 ms
/// behind its transaction's start on local processes (2.7 s on containers: see below),
/// none twice, none going down in a session. How many
/// are more than `max_lag_ms` (100) behind, the design's bound with its exception (a
/// catch-up that cannot get the lock in 200 ms), is printed: on two shared cores it
/// varies from run to run (0 to 2.7% of a burst, see docs/ids.md).
pub(crate) async fn after_an_idle_gap_32_one_row_sessions_get_fresh_ids(ctx: TestContext) -> TestResult {
    idle_gaps_then_bursts(ctx, 32, minter()).await
}

shardline_testkit::register!(quiet: after_an_idle_gap_32_one_row_sessions_get_fresh_ids_from_the_native_minter);
/// The same through the native minter, which has the same lease and catch-up.
pub(crate) async fn after_an_idle_gap_32_one_row_sessions_get_fresh_ids_from_the_native_minter(
    ctx: TestContext,
) -> TestResult {
    idle_gaps_then_bursts(ctx, 32, native()).await
}

shardline_testkit::register!(quiet: after_an_idle_gap_64_one_row_sessions_get_fresh_ids);
/// The same at 64 sessions, the most clients issue 21 asks the bound to hold for.
pub(crate) async fn after_an_idle_gap_64_one_row_sessions_get_fresh_ids(ctx: TestContext) -> TestResult {
    idle_gaps_then_bursts(ctx, 64, minter()).await
}

async fn idle_gaps_then_bursts(ctx: TestContext, clients: i32, sql: ShardSql) -> TestResult {
    const ROUNDS: i64 = 3;
    const ROWS: i64 = 60;
    let (db, client) = shard_db(&ctx, 0, &sql).await?;
    client
        .batch_execute(&format!(
            "ALTER TABLE {SCHEMA}.photos ADD COLUMN at timestamptz NOT NULL DEFAULT now()"
        ))
        .await?;
    let mut sessions = Vec::new();
    for _ in 0..clients {
        sessions.push(std::sync::Arc::new(ctx.hosts()[0].connect(&db).await?));
    }
    for _ in 0..ROUNDS {
        // Longer than the bound: every session's lease ends and the sequence lags.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let mut tasks = Vec::new();
        for (s, c) in (0..clients).zip(&sessions) {
            let c = std::sync::Arc::clone(c);
            tasks.push(tokio::spawn(async move {
                let insert = format!("INSERT INTO {SCHEMA}.photos (n, session) VALUES ($1, $2)");
                for n in 0..ROWS {
                    c.execute(&insert, &[&n, &s]).await?;
                }
                Ok::<_, tokio_postgres::Error>(())
            }));
        }
        for t in tasks {
            t.await??;
        }
    }
    let row = client
        .query_one(
            &format!(
                "SELECT count(*), count(DISTINCT id),
                        count(*) FILTER (WHERE (id >> 23) + {epoch} < (date_part('epoch', at) * 1000)::bigint - 100),
                        max((date_part('epoch', at) * 1000)::bigint - ((id >> 23) + {epoch})),
                        (SELECT count(*) FROM (SELECT id, lag(id) OVER (PARTITION BY session ORDER BY at, n) AS prev FROM {SCHEMA}.photos) t WHERE id <= prev)
                 FROM {SCHEMA}.photos",
                epoch = L.epoch_ms()
            ),
            &[],
        )
        .await?;
    let (total, distinct, stale, worst, decreasing): (i64, i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    assert_eq!(total, i64::from(clients) * ROWS * ROUNDS);
    assert_eq!(distinct, total, "duplicate IDs");
    assert_eq!(decreasing, 0, "a session's IDs went down");
    // The 100 ms bound holds unless a catch-up cannot get the sequence's lock within
    // 200 ms (see docs/ids.md): then some IDs come from the lagging sequence until the
    // shard's next try, at most the longest backoff (1.6 s) later. On local processes
    // that has stayed under 500 ms in every run (worst 244 ms); on containers, where a
    // minting transaction stays open longer on two shared cores, the worst seen at 64
    // sessions was 654 ms (a CI run), so there the bound asserted is that of one failed
    // catch-up: the longest wait for it (a session waiting on another's, 1 s), then the
    // longest backoff (1.6 s), on a sequence at most the lag (100 ms) behind. Two
    // failures in a row would go past it.
    let said = format!(
        "{clients} sessions: {stale} of {total} IDs more than 100 ms behind their transaction's start (worst {worst} ms)"
    );
    let bound = match ctx.cluster().backend() {
        shardline_testkit::BackendKind::Local => 500,
        _ => {
            use shardline_id::sql::{CATCH_UP_RETRY_MAX_MS, CATCH_UP_WAIT_TIMEOUT_MS, DEFAULT_MAX_LAG_MS};
            CATCH_UP_WAIT_TIMEOUT_MS + CATCH_UP_RETRY_MAX_MS + DEFAULT_MAX_LAG_MS
        }
    };
    assert!(worst <= bound, "{said}; the bound here is {bound} ms");
    eprintln!("      {said}");
    Ok(())
}

shardline_testkit::register!(shared: schemas_installed_at_once_share_one_catch_up_and_a_session_stays_small);
/// Eight sessions install eight shard schemas at once into a fresh database, each in a
/// transaction held open a while: every install succeeds, and the catch-up they share
/// (`shardline_minter.catch_up_v3`) exists once. Then one session mints in 200 lagging
/// schemas: every ID is fresh, and the session's memory grows by less than 160 KB per
/// schema (each schema carried its whole PL/pgSQL catch-up before, compiled and planned
/// per schema and session: about 330 KB per schema, observed).
pub(crate) async fn schemas_installed_at_once_share_one_catch_up_and_a_session_stays_small(
    ctx: TestContext,
) -> TestResult {
    const AT_ONCE: u32 = 8;
    const SCHEMAS: u32 = 200;
    let db = ctx.databases().await?;
    let gate = std::sync::Arc::new(tokio::sync::Barrier::new(AT_ONCE as usize));
    let mut installs = Vec::new();
    for shard in 0..AT_ONCE {
        let client = ctx.hosts()[0].connect(&db).await?;
        let gate = gate.clone();
        installs.push(tokio::spawn(async move {
            let sql = ShardSql::new(L, &format!("shard_{shard:04}"), shard).expect("a valid schema");
            gate.wait().await;
            client
                .batch_execute(&format!(
                    "BEGIN; CREATE SCHEMA {}; {} SELECT pg_sleep(0.1); COMMIT",
                    sql.quoted_schema(),
                    sql.install()
                ))
                .await
        }));
    }
    for i in installs {
        i.await??;
    }
    let client = ctx.hosts()[0].connect(&db).await?;
    let shared: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = 'shardline_minter' AND p.proname = 'catch_up_v3'",
            &[],
        )
        .await?
        .get(0);
    let mut install = String::new();
    for shard in AT_ONCE..SCHEMAS {
        let sql = ShardSql::new(L, &format!("shard_{shard:04}"), shard)?;
        install.push_str(&format!("CREATE SCHEMA {};\n{}\n", sql.quoted_schema(), sql.install()));
    }
    client.batch_execute(&install).await?;

    let minting = ctx.hosts()[0].connect(&db).await?;
    let memory = "SELECT sum(total_bytes)::bigint FROM pg_backend_memory_contexts";
    let before: i64 = minting.query_one(memory, &[]).await?.get(0);
    let mut stale = 0;
    for shard in 0..SCHEMAS {
        let row = minting
            .query_one(
                &format!(
                    "SELECT (shard_{shard:04}.next_id() >> 23) + {} - (date_part('epoch', now()) * 1000)::bigint",
                    L.epoch_ms()
                ),
                &[],
            )
            .await?;
        let behind: i64 = -row.get::<_, i64>(0);
        if !(0..=100).contains(&behind) {
            stale += 1;
        }
    }
    let after: i64 = minting.query_one(memory, &[]).await?.get(0);
    let per_schema = (after - before) / i64::from(SCHEMAS);
    eprintln!("      backend memory {before} -> {after} bytes: {per_schema} per schema minted in");
    assert_eq!(stale, 0, "IDs more than 100 ms behind their statement's clock");
    assert!(per_schema < 160 * 1024, "{per_schema} bytes per schema");
    assert_eq!(shared, 1, "one shared catch-up");
    Ok(())
}

shardline_testkit::register!(shared: a_non_superuser_with_a_mixed_case_name_installs_beside_a_temporary_decoy);
/// The minter's install as a role that is not a superuser, whose name needs quoting
/// (mixed case, a dot and an `@`, as cloud IAM users are named), on a database it owns:
/// twice over (idempotent), two schemas, and IDs minted through them. Meanwhile another
/// role, with no right but to connect, keeps a session open with a temporary sequence
/// and a `SECURITY DEFINER` `pg_temp.shardline_catch_up()` beside it: that decoy is no
/// shard's minter, so it does not stop the install from making the shared catch-up.
pub(crate) async fn a_non_superuser_with_a_mixed_case_name_installs_beside_a_temporary_decoy(
    ctx: TestContext,
) -> TestResult {
    let db = ctx.databases().await?;
    let admin = ctx.hosts()[0].connect(&db).await?;
    let (deployer, plain) = ("Shardline.Deploy@test", "shardline_test_plain");
    admin
        .batch_execute(&format!(
            "CREATE ROLE \"{deployer}\" LOGIN; CREATE ROLE {plain} LOGIN;
             ALTER DATABASE \"{db}\" OWNER TO \"{deployer}\";"
        ))
        .await?;
    let decoy = ctx.hosts()[0].connect(&db).await?;
    decoy
        .batch_execute(&format!(
            "SET ROLE {plain};
             CREATE TEMPORARY SEQUENCE shardline_id_seq;
             CREATE FUNCTION pg_temp.shardline_catch_up() RETURNS bigint LANGUAGE sql SECURITY DEFINER
                 AS 'SELECT 1::bigint';"
        ))
        .await?;
    let installer = ctx.hosts()[0].connect(&db).await?;
    installer.batch_execute(&format!("SET ROLE \"{deployer}\"")).await?;
    for _ in 0..2 {
        for shard in [1u32, 2] {
            let sql = ShardSql::new(L, &format!("shard_{shard:04}"), shard)?;
            installer
                .batch_execute(&format!(
                    "CREATE SCHEMA IF NOT EXISTS {}; {}",
                    sql.quoted_schema(),
                    sql.install()
                ))
                .await?;
        }
    }
    let made: Vec<Id> =
        ids(&installer, "SELECT shard_0001.next_id() UNION ALL SELECT shard_0002.next_id()").await?;
    let now = i64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis())?;
    for (id, shard) in made.iter().zip([1u32, 2]) {
        let parts = L.decode(*id);
        assert_eq!(parts.shard, shard, "{id:?}");
        assert!((now - parts.unix_ms).abs() < 60_000, "{id:?} at {now}");
    }
    let owner: String = admin
        .query_one("SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'shardline_minter'", &[])
        .await?
        .get(0);
    assert_eq!(owner, format!("\"{deployer}\""));
    decoy
        .batch_execute("DROP FUNCTION pg_temp.shardline_catch_up(); DROP SEQUENCE pg_temp.shardline_id_seq")
        .await?;
    drop((decoy, installer));
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{db}\" OWNER TO postgres; DROP SCHEMA shardline_minter, shard_0001, shard_0002 CASCADE;
             DROP ROLE {plain}; DROP ROLE \"{deployer}\""
        ))
        .await?;
    Ok(())
}

/// Functions and operators a role may make in `public` (every role could, before
/// PostgreSQL 15), each raising an error when called: the minter's calls must reach
/// `pg_catalog`'s. Every binary operator the minter could use, for each pair of the
/// number and text types (an overload matching better than `pg_catalog`'s would win
/// on a path where `pg_catalog` comes first; one matching as well wins on a path that
/// names `public` before it), and the functions it calls, with the argument types a
/// quoted name would resolve to.
const TRAPS: &str = r#"
DO $traps$
DECLARE
    o text;
    l text;
    r text;
    n integer := 0;
BEGIN
    FOREACH o IN ARRAY ARRAY['+', '-', '*', '/', '<<', '>>', '|', '&', '||', '<', '<=', '>', '>=', '=', '<>'] LOOP
        FOREACH l IN ARRAY ARRAY['smallint', 'integer', 'bigint', 'double precision', 'numeric', 'text'] LOOP
            FOREACH r IN ARRAY ARRAY['smallint', 'integer', 'bigint', 'double precision', 'numeric', 'text'] LOOP
                n := n + 1;
                EXECUTE format('CREATE FUNCTION public.trap_%s(%s, %s) RETURNS %s LANGUAGE plpgsql AS $f$BEGIN RAISE EXCEPTION ''trap: public.%s(%s, %s) was called''; END$f$',
                    n, l, r, CASE WHEN o IN ('<', '<=', '>', '>=', '=', '<>') THEN 'boolean' ELSE l END, o, l, r);
                EXECUTE format('CREATE OPERATOR public.%s (FUNCTION = public.trap_%s, LEFTARG = %s, RIGHTARG = %s)', o, n, l, r);
            END LOOP;
        END LOOP;
    END LOOP;
END
$traps$;
CREATE FUNCTION public.trap_fn(what text) RETURNS bigint LANGUAGE plpgsql AS $f$BEGIN RAISE EXCEPTION 'trap: public.% was called', what; END$f$;
CREATE FUNCTION public.nextval(text) RETURNS bigint LANGUAGE sql AS $f$SELECT public.trap_fn('nextval(text)')$f$;
CREATE FUNCTION public.nextval(regclass) RETURNS bigint LANGUAGE sql AS $f$SELECT public.trap_fn('nextval(regclass)')$f$;
CREATE FUNCTION public.currval(text) RETURNS bigint LANGUAGE sql AS $f$SELECT public.trap_fn('currval(text)')$f$;
CREATE FUNCTION public.currval(regclass) RETURNS bigint LANGUAGE sql AS $f$SELECT public.trap_fn('currval(regclass)')$f$;
CREATE FUNCTION public.date_part(text, timestamptz) RETURNS double precision LANGUAGE sql AS $f$SELECT public.trap_fn('date_part')::double precision$f$;
CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql AS $f$SELECT to_timestamp(public.trap_fn('now'))$f$;
CREATE FUNCTION public.current_setting(text, boolean) RETURNS text LANGUAGE sql AS $f$SELECT public.trap_fn('current_setting')::text$f$;
CREATE FUNCTION public.generate_series(integer, integer) RETURNS SETOF integer LANGUAGE sql AS $f$SELECT public.trap_fn('generate_series')::integer$f$;
CREATE FUNCTION public.trap_agg(bigint, bigint) RETURNS bigint LANGUAGE sql AS $f$SELECT public.trap_fn('min or max')$f$;
CREATE AGGREGATE public.min(bigint) (SFUNC = public.trap_agg, STYPE = bigint);
CREATE AGGREGATE public.max(bigint) (SFUNC = public.trap_agg, STYPE = bigint);
"#;

shardline_testkit::register!(shared: a_function_or_operator_made_in_public_never_takes_the_minters_calls);
pub(crate) async fn a_function_or_operator_made_in_public_never_takes_the_minters_calls(
    ctx: TestContext,
) -> TestResult {
    // A lease of a day: the inserts after a session's first take the fast path however
    // slow the machine.
    let (db, client) = shard_db(&ctx, 1, &minter().max_lag_ms(86_400_000)).await?;
    client.batch_execute(TRAPS).await?;
    // The traps work: a plain call on the default path takes `public.nextval(text)`.
    let err = client.query_one(&format!("SELECT nextval('{}')", minter().sequence()), &[]).await.unwrap_err();
    assert!(format!("{err:?}").contains("trap: public.nextval(text)"), "{err:?}");
    for path in ["\"$user\", public", "public, pg_catalog"] {
        let c = ctx.hosts()[1].connect(&db).await?;
        c.batch_execute(&format!("SET search_path = {path}")).await?;
        // The first insert of a session takes the slow path (no lease yet), the next ones
        // the fast path (the lease is the session's); then a block, and a decoding.
        for n in 0..3i64 {
            c.execute(&format!("INSERT INTO {SCHEMA}.photos (n) VALUES ($1)"), &[&n])
                .await
                .map_err(|e| format!("insert on search_path {path}: {e:?}"))?;
        }
        let lease: Option<String> = c
            .query_one(&format!("SELECT pg_catalog.current_setting('shardline.lease_{SCHEMA}', true)"), &[])
            .await?
            .get(0);
        assert!(lease.is_some_and(|l| !l.is_empty()), "the session holds a lease: the fast path ran");
        // And `next_id()` itself, on the hostile path, inside a block of its own.
        c.query_one(&format!("SELECT {SCHEMA}.next_id()"), &[])
            .await
            .map_err(|e| format!("next_id() on search_path {path}: {e:?}"))?;
        let block = c
            .query_one(&format!("SELECT first_value, last_value FROM {SCHEMA}.reserve_ids(10)"), &[])
            .await
            .map_err(|e| format!("reserve_ids on search_path {path}: {e:?}"))?;
        assert_eq!(block.get::<_, i64>(1) - block.get::<_, i64>(0), 9);
        let shards = c
            .query(&format!("SELECT ({SCHEMA}.id_parts(id)).shard FROM {SCHEMA}.photos"), &[])
            .await
            .map_err(|e| format!("id_parts on search_path {path}: {e:?}"))?;
        assert!(shards.iter().all(|r| r.get::<_, i32>(0) == 5));
    }
    let check = ctx.hosts()[1].connect(&db).await?;
    check.batch_execute("SET search_path = pg_catalog").await?;
    let made = ids(&check, &format!("SELECT id FROM {SCHEMA}.photos ORDER BY n, id")).await?;
    assert_eq!(made.len(), 6);
    let distinct: HashSet<Id> = made.iter().copied().collect();
    assert_eq!(distinct.len(), 6);
    let now = i64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis())?;
    for id in &made {
        let parts = L.decode(*id);
        assert_eq!(parts.shard, SHARD, "{id:?}");
        assert!((now - parts.unix_ms).abs() < 60_000, "{id:?} at {now}");
    }
    Ok(())
}

/// The language of shard 5's `next_id()`: `plpgsql` or `c`.
async fn next_id_language(client: &Client) -> Result<String, tokio_postgres::Error> {
    let row = client
        .query_one(
            &format!(
                "SELECT l.lanname::text FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang
                 WHERE p.oid = '{SCHEMA}.next_id()'::regprocedure"
            ),
            &[],
        )
        .await?;
    Ok(row.get(0))
}

/// Milliseconds from now to the time an ID carries.
fn ahead_of_now(id: Id) -> Result<i64, BoxError> {
    let now = i64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis())?;
    Ok(L.decode(id).unix_ms - now)
}

shardline_testkit::register!(shared: the_native_minter_replaces_the_plpgsql_one_in_place_and_running_sessions_follow);
/// A table whose `DEFAULT next_id()` was made with the PL/pgSQL minter keeps inserting
/// while another session installs the native minter over it, installs it again with
/// other constants, and goes back to PL/pgSQL: the same function (the column's default
/// names it by OID) changes language each time, and the running session takes each
/// install at its next statement. The second native install moves the clock the minter
/// reads 2 h ahead, past the session's lease (1 h): only a `next_id()` that reloaded its
/// constants sees it (with the ones it loaded first, the lease is still valid and the
/// fast path mints at today's time). IDs stay unique and increasing throughout.
pub(crate) async fn the_native_minter_replaces_the_plpgsql_one_in_place_and_running_sessions_follow(
    ctx: TestContext,
) -> TestResult {
    let slow_lease = minter().max_lag_ms(3_600_000);
    let (db, installer) = shard_db(&ctx, 0, &slow_lease).await?;
    let session = ctx.hosts()[0].connect(&db).await?;
    let insert = format!("INSERT INTO {SCHEMA}.photos (n) VALUES (1) RETURNING id");
    let mut all = Vec::new();
    for _ in 0..3 {
        all.extend(ids(&session, &insert).await?);
    }
    assert_eq!(next_id_language(&installer).await?, "plpgsql");

    installer.batch_execute(&slow_lease.clone().minter(Minter::Native).install()).await?;
    assert_eq!(next_id_language(&installer).await?, "c");
    for _ in 0..3 {
        all.extend(ids(&session, &insert).await?);
    }
    let today = *all.last().ok_or("no ID")?;
    assert!(ahead_of_now(today)?.abs() < 30_000, "{today:?}: {} ms from now", ahead_of_now(today)?);
    // The C fast path composes what the SQL decodes: the sequence's value it took, this
    // shard, and the time and counter that value carries.
    let row = session
        .query_one(
            &format!("SELECT {SCHEMA}.next_id(), pg_catalog.currval('{}')", slow_lease.sequence()),
            &[],
        )
        .await?;
    let (id, value): (Id, i64) = (row.get(0), row.get(1));
    assert_eq!(id, L.id_from_sequence_value(value, SHARD)?, "value {value}");
    let parts = session.query_one(&format!("SELECT * FROM {SCHEMA}.id_parts($1)"), &[&id]).await?;
    let (unix_ms, shard, sequence): (i64, i32, i32) = (parts.get(0), parts.get(1), parts.get(2));
    assert_eq!(
        IdParts { unix_ms, shard: u32::try_from(shard)?, sequence: u32::try_from(sequence)? },
        L.decode(id)
    );
    assert_eq!(L.decode(id).shard, SHARD);
    all.push(id);

    installer
        .batch_execute(&slow_lease.clone().minter(Minter::Native).clock_offset_ms(7_200_000).install())
        .await?;
    let ahead = ids(&session, &insert).await?;
    let first = *ahead.first().ok_or("no ID")?;
    assert!(
        ahead_of_now(first)? > 5_400_000,
        "the running session's native next_id() kept the constants it loaded before the install: {first:?} is {} ms from now, not 2 h ahead",
        ahead_of_now(first)?
    );
    all.extend(ahead);

    installer.batch_execute(&slow_lease.install()).await?;
    assert_eq!(next_id_language(&installer).await?, "plpgsql");
    for _ in 0..3 {
        all.extend(ids(&session, &insert).await?);
    }
    assert_eq!(all.iter().collect::<HashSet<_>>().len(), all.len(), "a duplicate ID");
    assert!(strictly_increasing(&all), "IDs went down: {all:?}");
    Ok(())
}

shardline_testkit::register!(shared: the_native_minter_is_refused_without_a_superuser_or_its_library_and_nothing_changes);
/// Installing the native minter over a schema's PL/pgSQL one as a role that is not a
/// superuser, or where the server cannot find the library, fails with an error that
/// names what is missing, and leaves the PL/pgSQL `next_id()` minting.
pub(crate) async fn the_native_minter_is_refused_without_a_superuser_or_its_library_and_nothing_changes(
    ctx: TestContext,
) -> TestResult {
    let db = ctx.databases().await?;
    let admin = ctx.hosts()[0].connect(&db).await?;
    let owner = "shardline_test_native_owner";
    admin
        .batch_execute(&format!("CREATE ROLE {owner} LOGIN; ALTER DATABASE \"{db}\" OWNER TO {owner}"))
        .await?;
    // The schema, its PL/pgSQL minter and a table, all the role's own.
    let plain = ctx.hosts()[0].connect(&db).await?;
    plain
        .batch_execute(&format!(
            "SET ROLE {owner}; CREATE SCHEMA {SCHEMA}; {}
             CREATE TABLE {SCHEMA}.photos (id bigint PRIMARY KEY DEFAULT {SCHEMA}.next_id(), n bigint NOT NULL)",
            minter().install()
        ))
        .await?;
    let refused =
        plain.batch_execute(&native().install()).await.err().ok_or("a non-superuser installed C")?;
    let db_err = refused.as_db_error().ok_or_else(|| format!("not a server error: {refused:?}"))?;
    assert_eq!(db_err.code().code(), "42501", "{db_err:?}");
    assert!(db_err.message().contains("only a superuser") && db_err.message().contains(owner), "{db_err:?}");

    assert_eq!(next_id_language(&admin).await?, "plpgsql");
    let made = ids(&admin, &format!("INSERT INTO {SCHEMA}.photos (n) VALUES (1) RETURNING id")).await?;
    assert_eq!(made.len(), 1);

    // A superuser's schema (a superuser runs no function another role could have
    // replaced: the install checks who owns the shared catch-up), on a server that cannot
    // find the library.
    let (_other, lost) = shard_db(&ctx, 0, &minter()).await?;
    lost.batch_execute("SET dynamic_library_path = '/nonexistent'").await?;
    let refused =
        lost.batch_execute(&native().install()).await.err().ok_or("installed without the library")?;
    let db_err = refused.as_db_error().ok_or_else(|| format!("not a server error: {refused:?}"))?;
    assert_eq!(db_err.code().code(), "58P01", "{db_err:?}");
    assert!(
        db_err.message().contains("library shardline_minter is not on this server")
            && db_err.message().contains("scripts/native-minter.sh"),
        "{db_err:?}"
    );

    assert_eq!(next_id_language(&lost).await?, "plpgsql");
    let made = ids(&lost, &format!("INSERT INTO {SCHEMA}.photos (n) VALUES (1) RETURNING id")).await?;
    assert_eq!(made.len(), 1);
    drop(plain);
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{db}\" OWNER TO postgres; REASSIGN OWNED BY {owner} TO postgres; DROP ROLE {owner}"
        ))
        .await?;
    Ok(())
}

shardline_testkit::register!(shared: the_native_minter_takes_the_fast_path_while_its_lease_holds);
/// 1000 `next_id()` calls in one transaction (one `now()`, so one lease covers them all)
/// call the catch-up once, through either minter: counted by Postgres
/// (`track_functions`; the catch-up is PL/pgSQL, so `pl` counts it). A native minter whose
/// lease check never passed would still mint fresh, unique IDs, through the catch-up on
/// every call, and only this test would see it.
pub(crate) async fn the_native_minter_takes_the_fast_path_while_its_lease_holds(
    ctx: TestContext,
) -> TestResult {
    for sql in [minter(), native()] {
        let (_db, client) = shard_db(&ctx, 1, &sql).await?;
        client.batch_execute("BEGIN; SET LOCAL track_functions = 'pl'").await?;
        let minted =
            ids(&client, &format!("SELECT {SCHEMA}.next_id() FROM generate_series(1, 1000)")).await?;
        assert_eq!(minted.iter().collect::<HashSet<_>>().len(), 1000);
        let calls: i64 = client
            .query_one(
                "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_xact_user_functions
                 WHERE schemaname = $1 AND funcname = 'shardline_catch_up'",
                &[&SCHEMA],
            )
            .await?
            .get(0);
        client.batch_execute("COMMIT").await?;
        assert_eq!(calls, 1, "{}: 1000 IDs took {calls} catch-ups", next_id_language(&client).await?);
    }
    Ok(())
}
