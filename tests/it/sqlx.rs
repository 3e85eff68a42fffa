//! sqlx on the routed cluster ([`shardline_repo::Sqlx`]) against real hosts: every
//! operation lands in the shard the map gives, the same struct reads through either
//! path, a stale map and a move under sqlx writers lose and double nothing, and a
//! killed or hung host fails sqlx work in time, classified.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use shardline_example_photos::Photo;
use shardline_id::Id;
use shardline_ops::moves::{self, MoveOptions};
use shardline_repo::sqlx::ShardConn;
use shardline_repo::{Cluster, ClusterOptions, Error};
use shardline_testkit::harness::{TestContext, TestResult};

use crate::bootstrap::{BoxError, Fixture, options, quiet};
use crate::moves::{acked_on, host_index};
use crate::repo::only_where_routed;

const INSERT: &str =
    "INSERT INTO photos (user_id, url, caption) VALUES ($1, $2, $3) RETURNING id, user_id, url, caption";

/// Gives a closure the signature `Sqlx`'s calls take (so one closure serves either).
fn unit<'env, T, F>(f: F) -> F
where
    F: for<'t> FnMut(&'t mut ShardConn<'env>) -> BoxFuture<'t, Result<T, ::sqlx::Error>>,
{
    f
}

/// Inserts a photo of `user` through sqlx on `cluster`: in a transaction, or as one
/// `statement` (`Sqlx::statement`, the table named qualified).
async fn insert_as(cluster: &Cluster, user: i64, caption: String, statement: bool) -> Result<Photo, Error> {
    let db = cluster.sqlx();
    let work = unit(|conn| {
        let sql =
            if statement { INSERT.replacen("photos", &conn.table("photos"), 1) } else { INSERT.to_owned() };
        let caption = &caption;
        Box::pin(async move {
            ::sqlx::query_as::<_, Photo>(::sqlx::AssertSqlSafe(sql))
                .bind(user)
                .bind(format!("https://cdn/{user}.jpg"))
                .bind(caption)
                .fetch_one(&mut **conn)
                .await
        })
    });
    if statement { db.statement_on_user(user, work).await } else { db.on_user(user, work).await }
}

/// Reads a photo by ID through sqlx, in a transaction or as one `statement`.
async fn get_as(cluster: &Cluster, id: Id, statement: bool) -> Result<Option<Photo>, Error> {
    let db = cluster.sqlx();
    let work = unit(|conn| {
        let table = if statement { conn.table("photos") } else { "photos".to_owned() };
        let sql = format!("SELECT id, user_id, url, caption FROM {table} WHERE id = $1");
        Box::pin(async move {
            ::sqlx::query_as::<_, Photo>(::sqlx::AssertSqlSafe(sql))
                .bind(id)
                .fetch_optional(&mut **conn)
                .await
        })
    });
    if statement { db.statement_on_id(id, work).await } else { db.on_id(id, work).await }
}

async fn insert(cluster: &Cluster, user: i64, caption: String) -> Result<Photo, Error> {
    insert_as(cluster, user, caption, false).await
}

async fn get(cluster: &Cluster, id: Id) -> Result<Option<Photo>, Error> {
    get_as(cluster, id, false).await
}

async fn insert_statement(cluster: &Cluster, user: i64, caption: String) -> Result<Photo, Error> {
    insert_as(cluster, user, caption, true).await
}

async fn get_statement(cluster: &Cluster, id: Id) -> Result<Option<Photo>, Error> {
    get_as(cluster, id, true).await
}

shardline_testkit::register!(shared: a_temporary_table_left_on_a_pooled_connection_never_takes_the_shards_place);
/// A temporary table named as a shard's table (`photos`), left on a pooled connection by
/// earlier work, is not what a later unit of work on that connection writes, through the
/// sqlx path or a repository transaction: Postgres searches `pg_temp` first unless the
/// `search_path` names it, and the routed transaction's names it last. (Before, both
/// inserts were acknowledged into the temporary table, and lost with the session.)
pub(crate) async fn a_temporary_table_left_on_a_pooled_connection_never_takes_the_shards_place(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    // One connection per host and pool: the next unit of work gets the same one.
    let cluster =
        Cluster::connect(&f.config()?, ClusterOptions { pool_size: 1, ..ClusterOptions::default() }).await?;
    let route = cluster.route_user(3);
    let temp =
        "CREATE TEMP TABLE IF NOT EXISTS photos (id bigserial, user_id bigint, url text, caption text)";
    let db = cluster.sqlx();
    db.on_user(3, |conn| Box::pin(async move { ::sqlx::raw_sql(temp).execute(&mut **conn).await.map(drop) }))
        .await?;
    let through_sqlx = insert(&cluster, 3, "after a temporary table (sqlx)".into()).await?;
    cluster
        .transaction(route.shard, |tx| Box::pin(async move { tx.execute(temp, &[]).await.map(drop) }))
        .await?;
    let caption = "after a temporary table (repository)";
    cluster
        .transaction(route.shard, |tx| {
            Box::pin(async move {
                tx.execute("INSERT INTO photos (user_id, url, caption) VALUES (3, 'u', $1)", &[&caption])
                    .await
            })
        })
        .await?;
    let admin = f.client(&ctx, host_index(route.host.as_str())).await?;
    let stored: i64 = admin
        .query_one(
            &format!("SELECT count(*) FROM {}.photos WHERE id = $1 OR caption = $2", route.schema.quoted()),
            &[&through_sqlx.id.as_i64(), &caption],
        )
        .await?
        .get(0);
    assert_eq!(stored, 2, "both inserts are in the shard's table, not in the temporary one");
    // With the shard's schema gone (renamed aside here, as a move's fence does), `pg_temp`
    // would be the path's first schema: an unqualified `CREATE TABLE` there made a
    // temporary table, and the unit of work committed into it. It fails instead, as a
    // moved shard's whose move is not found (3F000), through either path.
    admin.batch_execute(&format!("ALTER SCHEMA {} RENAME TO aside", route.schema.quoted())).await?;
    let create = "CREATE TABLE IF NOT EXISTS made_here (x int); INSERT INTO made_here VALUES (1)";
    let through_repo = cluster
        .transaction(route.shard, |tx| {
            Box::pin(async move {
                tx.execute("CREATE TABLE IF NOT EXISTS made_here (x int)", &[]).await?;
                tx.execute("INSERT INTO made_here VALUES (1)", &[]).await.map(drop)
            })
        })
        .await;
    let through_sqlx = db
        .on_user(3, |conn| {
            Box::pin(async move { ::sqlx::raw_sql(create).execute(&mut **conn).await.map(drop) })
        })
        .await;
    admin.batch_execute(&format!("ALTER SCHEMA aside RENAME TO {}", route.schema.quoted())).await?;
    for (path, r) in [("repository", through_repo), ("sqlx", through_sqlx)] {
        let err = r.err().ok_or(format!("{path}: a unit of work committed with its shard's schema gone"))?;
        assert_eq!(err.sqlstate(), Some("3F000"), "{path}: {err}");
    }
    Ok(())
}

shardline_testkit::register!(shared: what_work_on_pool_leaves_on_a_session_never_reaches_routed_work);
/// `Sqlx::pool` hands out a pool of its own: a `search_path` set there (another shard's
/// schema) does not reach a routed statement, whose unqualified name still fails with
/// 42P01 rather than reading that other shard. (Before, it was the routed work's pool,
/// and the statement read the other shard's table.) Behind a declared transaction
/// pooler it refuses, as routed work does.
pub(crate) async fn what_work_on_pool_leaves_on_a_session_never_reaches_routed_work(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let cluster =
        Cluster::connect(&f.config()?, ClusterOptions { pool_size: 1, ..ClusterOptions::default() }).await?;
    let db = cluster.sqlx();
    // Two shards on one host (user `n` is in shard `n`).
    let routes = (0..4).map(|s| cluster.route(crate::shard(s))).collect::<Result<Vec<_>, _>>()?;
    let (a, b) = (0..4)
        .flat_map(|i| (i + 1..4).map(move |j| (i, j)))
        .find(|&(i, j)| routes[i].host == routes[j].host)
        .ok_or("two shards on one host")?;
    insert(&cluster, i64::try_from(b)?, "in the other shard".into()).await?;
    let id = insert(&cluster, i64::try_from(a)?, "in the shard read".into()).await?.id;
    let (a, b) = (routes[a].clone(), routes[b].clone());
    {
        let pool = db.pool(&a.host).await?;
        let mut conn = pool.acquire().await?;
        ::sqlx::raw_sql(::sqlx::AssertSqlSafe(format!("SET search_path TO {}", b.schema.quoted())))
            .execute(&mut *conn)
            .await?;
    }
    // Routed, one statement, an unqualified name: no schema of the session's own.
    let err = db
        .statement_on_id(id, |conn| {
            Box::pin(async move {
                ::sqlx::query_scalar::<_, i64>("SELECT count(*) FROM photos").fetch_one(&mut **conn).await
            })
        })
        .await
        .expect_err("an unqualified name in a statement read a schema left by work on pool()");
    assert_eq!(err.sqlstate(), Some("42P01"), "{err}");
    let pooled = Cluster::connect(
        &f.config()?,
        ClusterOptions { transaction_pooler: Some(true), ..ClusterOptions::default() },
    )
    .await?;
    let err = pooled.sqlx().pool(&a.host).await.expect_err("pool() behind a transaction pooler");
    assert!(matches!(err, Error::Pooler { .. }), "{err}");
    Ok(())
}

shardline_testkit::register!(shared: a_unit_of_work_given_up_holds_no_lock_past_its_deadline);
/// A unit of work that waited for its connection, then for a row lock, and was given up
/// at `host_timeout` stops waiting on the server then too: its transaction's
/// `statement_timeout` is what was left of the unit's time, not the whole of it again.
/// (Before, its statement waited on the lock for as long again as the unit had waited
/// for a connection: about 3 s here.)
pub(crate) async fn a_unit_of_work_given_up_holds_no_lock_past_its_deadline(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let timeout = Duration::from_secs(4);
    let cluster = Cluster::connect(
        &f.config()?,
        ClusterOptions { pool_size: 1, host_timeout: timeout, ..ClusterOptions::default() },
    )
    .await?;
    let photo = insert(&cluster, 0, "locked".into()).await?;
    let route = cluster.route_user(0);
    // One session holds the row's lock; another watches (outside a transaction: a
    // transaction reads `pg_stat_activity` once, at its first look).
    let admin = f.client(&ctx, host_index(route.host.as_str())).await?;
    let locker = f.client(&ctx, host_index(route.host.as_str())).await?;
    locker
        .batch_execute(&format!(
            "BEGIN; SELECT FROM {}.photos WHERE id = {} FOR UPDATE",
            route.schema.quoted(),
            photo.id.as_i64()
        ))
        .await?;
    let db = cluster.sqlx();
    // The host's one connection, held 3 s by another unit of work.
    let holder = db.on_user(0, |conn| {
        Box::pin(async move { ::sqlx::raw_sql("SELECT pg_sleep(3)").execute(&mut **conn).await.map(drop) })
    });
    let waiter = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let id = photo.id;
        let r = db
            .on_id(id, |conn| {
                Box::pin(async move {
                    ::sqlx::query("UPDATE photos SET caption = 'waited' WHERE id = $1")
                        .bind(id)
                        .execute(&mut **conn)
                        .await
                        .map(drop)
                })
            })
            .await;
        (r, Instant::now())
    };
    let (held, (waited, gave_up)) = tokio::join!(holder, waiter);
    held?;
    let err = waited.expect_err("an update waiting on a row lock held to the end");
    // The server's statement timeout or the unit's own, whichever came first: told
    // alike.
    assert!(err.is_timeout(), "{err}");
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()";
    while admin.query_one(waiting, &[]).await?.get::<_, i64>(0) > 0 {
        assert!(
            gave_up.elapsed() < Duration::from_millis(1500),
            "the given-up unit's statement still waits on the lock {:?} after its deadline",
            gave_up.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "observed: the given-up statement stopped waiting {:?} after its unit's deadline",
        gave_up.elapsed()
    );
    // A later statement of the unit, begun 2.5 s into it: its statement timeout (what
    // was left at the start, 4 s) would keep it waiting 2.5 s past the deadline; the
    // unit given up cancels it. (Before, nothing did.)
    let t = Instant::now();
    let late = db
        .on_id(photo.id, |conn| {
            let id = photo.id;
            Box::pin(async move {
                ::sqlx::raw_sql("SELECT pg_sleep(2.5)").execute(&mut **conn).await?;
                ::sqlx::query("UPDATE photos SET caption = 'late' WHERE id = $1")
                    .bind(id)
                    .execute(&mut **conn)
                    .await
                    .map(drop)
            })
        })
        .await;
    let gave_up = Instant::now();
    let err = late.expect_err("a later statement waiting on a row lock held to the end");
    assert!(err.is_timeout(), "{err}");
    assert!(gave_up - t >= timeout, "given up after {:?}", gave_up - t);
    while admin.query_one(waiting, &[]).await?.get::<_, i64>(0) > 0 {
        assert!(
            gave_up.elapsed() < Duration::from_millis(1500),
            "the given-up unit's later statement still waits on the lock {:?} after its deadline",
            gave_up.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("observed: its later statement stopped waiting {:?} after its deadline", gave_up.elapsed());
    // A single statement that waited 2 s for the host's one connection, then for the
    // lock: given up at its deadline, it stops waiting then too (its connection closed,
    // which the server checks for while it waits). Before, it waited out the session's
    // statement timeout, counted from when it was sent: 2 s past its deadline.
    let holder = db.on_user(0, |conn| {
        Box::pin(async move { ::sqlx::raw_sql("SELECT pg_sleep(2)").execute(&mut **conn).await.map(drop) })
    });
    let single = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let id = photo.id;
        // No search_path outside a transaction: the table named in its schema.
        let update = format!("UPDATE {}.photos SET caption = 'single' WHERE id = $1", route.schema.quoted());
        let update = update.as_str();
        let r = db
            .statement_on_id(id, |conn| {
                Box::pin(async move {
                    ::sqlx::query(::sqlx::AssertSqlSafe(update)).bind(id).execute(&mut **conn).await.map(drop)
                })
            })
            .await;
        (r, Instant::now())
    };
    let (held, (single, gave_up)) = tokio::join!(holder, single);
    held?;
    let err = single.expect_err("a single statement waiting on a row lock held to the end");
    assert!(err.is_timeout(), "{err}");
    while admin.query_one(waiting, &[]).await?.get::<_, i64>(0) > 0 {
        assert!(
            gave_up.elapsed() < Duration::from_millis(1500),
            "the given-up single statement still waits on the lock {:?} after its deadline",
            gave_up.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("observed: the single statement stopped waiting {:?} after its deadline", gave_up.elapsed());
    locker.batch_execute("ROLLBACK").await?;
    Ok(())
}

shardline_testkit::register!(shared: every_operation_runs_in_the_shard_the_map_gives);
pub(crate) async fn every_operation_runs_in_the_shard_the_map_gives(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 12).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let db = cluster.sqlx();
    let photos = cluster.repo::<Photo>()?;
    let mut made = Vec::new();
    for user in [0i64, 1, 5, 11, 12, 23, -1, 1_000_003] {
        let p = insert(&cluster, user, format!("sqlx {user}")).await?;
        let route = cluster.route_user(user);
        assert_eq!(cluster.layout().decode(p.id).shard, u32::from(route.shard.get()), "minted by its shard");
        only_where_routed(&f, &ctx, &route, p.id, &format!("user {user}")).await?;
        // One struct, both paths.
        assert_eq!(get(&cluster, p.id).await?.as_ref(), Some(&p));
        assert_eq!(photos.get(p.id).await?.as_ref(), Some(&p));
        made.push(p);
    }
    // One statement, no transaction: the same shards, the same rows.
    for user in [2i64, 7, 13, -5] {
        let p = insert_statement(&cluster, user, format!("statement {user}")).await?;
        let route = cluster.route_user(user);
        assert_eq!(cluster.layout().decode(p.id).shard, u32::from(route.shard.get()), "minted by its shard");
        only_where_routed(&f, &ctx, &route, p.id, &format!("user {user} (statement)")).await?;
        assert_eq!(get_statement(&cluster, p.id).await?.as_ref(), Some(&p));
        assert_eq!(get(&cluster, p.id).await?.as_ref(), Some(&p));
    }
    assert_eq!(get_statement(&cluster, made[1].id).await?.as_ref(), Some(&made[1]));
    // An unqualified name reads no schema at all (the sessions' search_path is empty),
    // not even a `public.photos` there, fails naming host and shard, and is not taken
    // for a moved shard: run once.
    let host = host_index(cluster.route_user(5).host.as_str());
    f.client(&ctx, host)
        .await?
        .batch_execute("CREATE TABLE public.photos (id bigint); INSERT INTO public.photos VALUES (1)")
        .await?;
    let runs = AtomicUsize::new(0);
    let err = db
        .statement_on_user(5, |conn| {
            runs.fetch_add(1, Ordering::Relaxed);
            Box::pin(async move { ::sqlx::query("SELECT count(*) FROM photos").execute(&mut **conn).await })
        })
        .await
        .unwrap_err();
    assert_eq!(runs.load(Ordering::Relaxed), 1, "{err}");
    assert!(matches!(&err, Error::Sqlx { what: "statement", shard: Some(_), .. }), "{err}");
    assert_eq!(err.sqlstate(), Some("42P01"));
    assert!(!err.outcome_unknown(), "{err}");
    f.client(&ctx, host).await?.batch_execute("DROP TABLE public.photos").await?;
    // A `begin()` left open in a statement's work is rolled back, not pooled.
    let err = db
        .statement_on_user(5, |conn| {
            Box::pin(async move {
                let mut tx = ::sqlx::Connection::begin(&mut **conn).await?;
                ::sqlx::query("SELECT 1").execute(&mut *tx).await?;
                std::mem::forget(tx);
                Ok(())
            })
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Invalid { .. }), "{err}");

    // Update and delete by ID.
    let first = made[0].clone();
    let updated = db
        .on_id(first.id, |conn| {
            Box::pin(async move {
                ::sqlx::query("UPDATE photos SET caption = 'edited' WHERE id = $1")
                    .bind(first.id)
                    .execute(&mut **conn)
                    .await
                    .map(|r| r.rows_affected())
            })
        })
        .await?;
    assert_eq!(updated, 1);
    assert_eq!(photos.get(first.id).await?.map(|p| p.caption), Some("edited".to_owned()));
    let last = made.pop().ok_or("a photo")?;
    let deleted = db
        .on_id(last.id, |conn| {
            Box::pin(async move {
                ::sqlx::query("DELETE FROM photos WHERE id = $1").bind(last.id).execute(&mut **conn).await
            })
        })
        .await?;
    assert_eq!(deleted.rows_affected(), 1);
    assert_eq!(get(&cluster, last.id).await?, None);

    // A unit of work that returns Err is rolled back, and the error names host and shard.
    let route = cluster.route_user(5);
    let err = db
        .on_user(5, |conn| {
            Box::pin(async move {
                ::sqlx::query(INSERT).bind(5i64).bind("u").bind("rolled back").execute(&mut **conn).await?;
                ::sqlx::query("SELECT 1/0").execute(&mut **conn).await.map(drop)
            })
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Sqlx { host, shard: Some(s), what: "work", .. } if *host == route.host && *s == route.shard),
        "{err}"
    );
    assert_eq!(err.sqlstate(), Some("22012"));
    assert!(!err.outcome_unknown() && !err.is_retryable(), "{err}");
    // A failure handled inside, then Ok: Postgres rolled it back, and the caller hears so.
    let err = db
        .on_user(5, |conn| {
            Box::pin(async move {
                ::sqlx::query(INSERT).bind(5i64).bind("u").bind("rolled back").execute(&mut **conn).await?;
                let _ = ::sqlx::query("SELECT 1/0").execute(&mut **conn).await;
                Ok(())
            })
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::RolledBack { .. }), "{err}");
    let leaked: i64 = photos
        .page_of_user(5, None, 100)
        .await?
        .rows
        .iter()
        .filter(|p| p.caption == "rolled back")
        .count()
        .try_into()?;
    assert_eq!(leaked, 0, "nothing of a rolled-back unit of work is applied");

    // Every shard once, in shard order; the rows add up.
    let per_shard = db
        .for_each_shard(|conn| {
            Box::pin(async move {
                let n: i64 =
                    ::sqlx::query_scalar("SELECT count(*) FROM photos").fetch_one(&mut **conn).await?;
                Ok((conn.shard(), n))
            })
        })
        .await;
    assert_eq!(per_shard.len(), 12);
    let mut total = 0;
    for (i, (shard, r)) in per_shard.into_iter().enumerate() {
        let (inner, n) = r?;
        assert_eq!((usize::from(shard.get()), inner), (i, shard));
        total += n;
    }
    assert_eq!(total, i64::try_from(made.len())? + 4, "with the 4 single statements' rows");

    // A closure that ends the transaction itself is told so, never Ok as if it were whole.
    let err = db
        .on_user(5, |conn| {
            Box::pin(async move { ::sqlx::raw_sql("COMMIT").execute(&mut **conn).await.map(drop) })
        })
        .await
        .unwrap_err();
    assert!(matches!(&err, Error::TransactionEnded { .. }) && err.outcome_unknown(), "{err}");
    // The same when its next statement then fails (no search_path any more): the
    // committed write is not run again, and the error says what happened.
    let runs = AtomicUsize::new(0);
    let err = db
        .on_user(5, |conn| {
            runs.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                ::sqlx::query(INSERT)
                    .bind(5i64)
                    .bind("u")
                    .bind("committed by the closure")
                    .execute(&mut **conn)
                    .await?;
                ::sqlx::raw_sql("COMMIT").execute(&mut **conn).await?;
                ::sqlx::query("SELECT * FROM photos").execute(&mut **conn).await.map(drop)
            })
        })
        .await
        .unwrap_err();
    assert!(matches!(&err, Error::TransactionEnded { .. }) && err.outcome_unknown(), "{err}");
    assert_eq!(runs.into_inner(), 1);
    // The same when the connection is then lost (here its session is ended by the
    // server): nothing can tell that the closure committed, so the outcome is unknown,
    // and the work is not run again. (Before, "work" failed and said it was not applied.)
    let runs = AtomicUsize::new(0);
    let err = db
        .on_user(5, |conn| {
            runs.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                ::sqlx::query(INSERT)
                    .bind(5i64)
                    .bind("u")
                    .bind("committed, then the connection lost")
                    .execute(&mut **conn)
                    .await?;
                ::sqlx::raw_sql("COMMIT").execute(&mut **conn).await?;
                ::sqlx::raw_sql("SELECT pg_terminate_backend(pg_backend_pid())")
                    .execute(&mut **conn)
                    .await
                    .map(drop)
            })
        })
        .await
        .unwrap_err();
    assert!(err.outcome_unknown(), "a unit whose closure committed, then lost its connection: {err}");
    assert_eq!(runs.into_inner(), 1, "{err}");
    let route = cluster.route_user(5);
    let kept: i64 = f
        .client(&ctx, host_index(route.host.as_str()))
        .await?
        .query_one(
            &format!("SELECT count(*) FROM {}.photos WHERE caption = $1", route.schema.quoted()),
            &[&"committed, then the connection lost"],
        )
        .await?
        .get(0);
    assert_eq!(kept, 1, "the closure's own commit applied");
    // Behind a transaction-mode pooler the sqlx path refuses, naming why.
    let pooled = Cluster::connect(
        &f.config()?,
        ClusterOptions { transaction_pooler: Some(true), ..ClusterOptions::default() },
    )
    .await?;
    let err = pooled
        .sqlx()
        .on_user(5, |conn| {
            Box::pin(async move { ::sqlx::raw_sql("SELECT 1").execute(&mut **conn).await.map(drop) })
        })
        .await
        .unwrap_err();
    assert!(matches!(&err, Error::Pooler { reason, .. } if reason.contains("named")), "{err}");

    // The shard leaves, under a stale map, in the middle of a unit of work there (its
    // schema renamed away after the work began, as a move's fence does): the work's
    // failure is handled, yet the unit is rolled back, the schema looked for, and the
    // work run again on the shard's new host. (A schema already gone at the BEGIN is
    // found there, and the work runs once: the second part below.)
    let stale =
        Cluster::connect(&f.config()?, ClusterOptions { listen: false, ..ClusterOptions::default() }).await?;
    let route = stale.route_user(3);
    let other = ["pg1", "pg2", "pg3"].into_iter().find(|h| *h != route.host.as_str()).ok_or("a host")?;
    let (from, to) = (host_index(route.host.as_str()), host_index(other));
    let schema = route.schema.quoted();
    let dump: Vec<Photo> = photos.page_of_user(3, None, 100).await?.rows;
    let (src, dst) = (f.client(&ctx, from).await?, f.client(&ctx, to).await?);
    let install = shardline_id::sql::ShardSql::new(
        stale.layout(),
        route.schema.as_str(),
        u32::from(route.shard.get()),
    )?
    .install();
    // With the function every read names, true on a shard's own copy (what `init`,
    // `migrate` and moves install beside the minter).
    let live = format!(
        "CREATE FUNCTION {schema}.{}() RETURNS boolean LANGUAGE sql STABLE RETURN true",
        shardline_repo::LIVE_CHECK
    );
    dst.batch_execute(&format!(
        "CREATE SCHEMA {schema}; {install}; {live}; SET search_path TO {schema};
         CREATE TABLE photos (id bigint PRIMARY KEY DEFAULT next_id(), user_id bigint NOT NULL, url text NOT NULL, caption text NOT NULL DEFAULT '');
         RESET search_path"
    ))
    .await?;
    for p in &dump {
        dst.execute(
            &format!("INSERT INTO {schema}.photos VALUES ($1, $2, $3, $4)"),
            &[&p.id, &p.user_id, &p.url, &p.caption],
        )
        .await?;
    }
    f.client(&ctx, 0)
        .await?
        .execute(
            "UPDATE shardline.shards SET host = $1 WHERE shard = $2",
            &[&other, &i32::from(route.shard.get())],
        )
        .await?;
    let runs = AtomicUsize::new(0);
    let aside = format!("ALTER SCHEMA {schema} RENAME TO gone_aside");
    let (src, aside) = (&src, &aside);
    let on = stale
        .sqlx()
        .on_user(3, |conn| {
            let run = runs.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                if run == 0 {
                    ::sqlx::raw_sql("SELECT 1").execute(&mut **conn).await?;
                    src.batch_execute(aside).await.map_err(|e| ::sqlx::Error::Protocol(e.to_string()))?;
                }
                // Its error handled: the unit returns Ok either way.
                let wrote =
                    ::sqlx::query(INSERT).bind(3i64).bind("u").bind("rerun").execute(&mut **conn).await;
                Ok((wrote.is_ok(), conn.host().to_string()))
            })
        })
        .await?;
    assert_eq!((runs.into_inner(), on), (2, (true, other.to_owned())));
    let n: i64 = dst
        .query_one(&format!("SELECT count(*) FROM {schema}.photos WHERE caption = 'rerun'"), &[])
        .await?
        .get(0);
    assert_eq!(n, 1, "written once, on the shard's new host");
    // Gone at the BEGIN: the work runs once, where the shard is.
    let runs = AtomicUsize::new(0);
    let stale =
        Cluster::connect(&f.config()?, ClusterOptions { listen: false, ..ClusterOptions::default() }).await?;
    f.client(&ctx, 0)
        .await?
        .execute(
            "UPDATE shardline.shards SET host = $1 WHERE shard = $2",
            &[&route.host.as_str(), &i32::from(route.shard.get())],
        )
        .await?;
    let stale_back = stale.route_user(3).host;
    assert_eq!(stale_back.as_str(), other, "a handle whose map places the shard on {other}");
    let (dst_host, src_host) = (other, route.host.as_str());
    f.client(&ctx, to).await?.batch_execute(&format!("ALTER SCHEMA {schema} RENAME TO left_aside")).await?;
    src.batch_execute(&format!("ALTER SCHEMA gone_aside RENAME TO {schema}")).await?;
    let on = stale
        .sqlx()
        .on_user(3, |conn| {
            runs.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                ::sqlx::query(INSERT).bind(3i64).bind("u").bind("once").execute(&mut **conn).await?;
                Ok(conn.host().to_string())
            })
        })
        .await?;
    assert_eq!((runs.into_inner(), on.as_str()), (1, src_host), "moved back from {dst_host}");

    // Decoding: the type is named as users write it; a negative value is refused.
    let err = db
        .on_user(1, |conn| {
            Box::pin(
                async move { ::sqlx::query_scalar::<_, Id>("SELECT 7::int4").fetch_one(&mut **conn).await },
            )
        })
        .await
        .unwrap_err();
    let text = shardline_repo::error_chain(&err);
    assert!(text.contains("shardline_id::Id") && !text.contains("shardline_id::id::Id"), "{text}");
    let err = db
        .on_user(1, |conn| {
            Box::pin(
                async move { ::sqlx::query_scalar::<_, Id>("SELECT -1::int8").fetch_one(&mut **conn).await },
            )
        })
        .await
        .unwrap_err();
    assert!(shardline_repo::error_chain(&err).contains("negative"), "{}", shardline_repo::error_chain(&err));
    // A table that is not there (and no move running): the error at once, not a wait.
    let t = Instant::now();
    let err = db
        .on_user(1, |conn| {
            Box::pin(async move { ::sqlx::query("SELECT * FROM nope").execute(&mut **conn).await })
        })
        .await
        .unwrap_err();
    assert_eq!(err.sqlstate(), Some("42P01"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    Ok(())
}

shardline_testkit::register!(shared: a_moves_copy_with_no_tables_yet_is_not_taken_for_the_shard);
/// Shards with no tables (a cluster before its first table's migration): a handle a move
/// behind runs a statement on the host where a move is bringing a copy of the shard.
/// The copy has the shard's schema name and no table, so nothing guards it but its
/// `shardline_live()`: the statement's 42P01 is taken for a shard not there (the copy's
/// function refuses), and the statement runs again where the shard is, leaving the
/// handle's map there. (Before, a copy was told by its tables' write guards: with no
/// table it was taken for the shard, and the error came back from the copy.)
pub(crate) async fn a_moves_copy_with_no_tables_yet_is_not_taken_for_the_shard(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    for m in ["0001_photos.sql", "0002_likes.sql", "0003_comments.sql", "0004_likes_by_id.sql"] {
        f.remove_migration(m)?;
    }
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let stale =
        Cluster::connect(&config, ClusterOptions { listen: false, ..ClusterOptions::default() }).await?;
    let route = stale.route_user(0);
    let (from, to) =
        (route.host.as_str().to_owned(), if route.host.as_str() == "pg1" { "pg2" } else { "pg1" });
    moves::run(&config, route.shard, &shardline_router::HostName::new(to)?, &MoveOptions::default()).await?;
    let back = MoveOptions::default().stopping_after(moves::Step::Prepared);
    let stopped = moves::run(&config, route.shard, &shardline_router::HostName::new(&from)?, &back).await;
    assert!(stopped.is_err(), "the drill stops the move back after prepared: {stopped:?}");
    assert_eq!(stale.route_user(0).host.as_str(), from, "the handle still places the shard on {from}");
    let ran_on = std::sync::Mutex::new(Vec::new());
    let err = stale
        .sqlx()
        .statement_on_user(0, |conn| {
            if let Ok(mut r) = ran_on.lock() {
                r.push(conn.host().to_string());
            }
            Box::pin(async move { ::sqlx::query("SELECT FROM no_table_yet").execute(&mut **conn).await })
        })
        .await
        .unwrap_err();
    assert_eq!(err.sqlstate(), Some("42P01"), "{err}");
    let ran_on = ran_on.into_inner().map_err(|e| e.to_string())?;
    assert_eq!(ran_on, [from.clone(), to.to_owned()], "run on the copy, then where the shard is");
    assert_eq!(stale.route_user(0).host.as_str(), to, "the handle's map follows the shard");
    moves::abort(&config, route.shard, &MoveOptions::default()).await?;
    Ok(())
}

shardline_testkit::register!(shared: a_database_url_naming_one_shard_describes_queries_as_the_macros_need);
/// `query!` and `query_as!` check a query at compile time by asking `DATABASE_URL`'s
/// server to describe it (sqlx's `Executor::describe`, what the macros call). Queries
/// name tables unqualified, so `DATABASE_URL` names one shard's schema through the
/// session's `search_path` (`?options=-c%20search_path%3Dshard_0000`, as
/// `docs/repository.md` says); without it the tables are not found.
pub(crate) async fn a_database_url_naming_one_shard_describes_queries_as_the_macros_need(
    ctx: TestContext,
) -> TestResult {
    use ::sqlx::{Connection as _, Executor as _, SqlSafeStr as _};
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let url = config.hosts[0].url.expose();
    let sep = if url.contains('?') { '&' } else { '?' };
    let sql = "SELECT id, user_id, url, caption FROM photos WHERE id = $1";
    let shard: ::sqlx::postgres::PgConnectOptions =
        format!("{url}{sep}options=-c%20search_path%3Dshard_0000").parse()?;
    let mut conn = ::sqlx::PgConnection::connect_with(&shard).await?;
    let described = (&mut conn).describe(sql.into_sql_str()).await?;
    let columns: Vec<String> = described
        .columns()
        .iter()
        .map(|c| format!("{} {}", ::sqlx::Column::name(c), ::sqlx::Column::type_info(c)))
        .collect();
    assert_eq!(columns, ["id INT8", "user_id INT8", "url TEXT", "caption TEXT"]);
    let params = format!("{:?}", described.parameters());
    assert!(params.contains("Int8"), "the ID parameter is a bigint: {params}");
    // The example's `query_as!` calls are compiled in CI from the offline data committed
    // in examples/photos/.sqlx: each file must say what a live shard says of its query
    // (the same columns, types, nullability and parameters), or the build checks
    // nothing real.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/photos/.sqlx");
    let mut files = 0;
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let data: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
        let query = data["query"].as_str().ok_or("a query")?.to_owned();
        let live = (&mut conn).describe(::sqlx::AssertSqlSafe(query.clone()).into_sql_str()).await?;
        let said = &data["describe"];
        let kept: Vec<(String, String, bool)> = said["columns"]
            .as_array()
            .ok_or("columns")?
            .iter()
            .zip(said["nullable"].as_array().ok_or("nullable")?)
            .map(|(c, n)| {
                (
                    c["name"].as_str().unwrap_or_default().to_owned(),
                    c["type_info"].as_str().unwrap_or_default().to_lowercase(),
                    n.as_bool().unwrap_or(true),
                )
            })
            .collect();
        let now: Vec<(String, String, bool)> = live
            .columns()
            .iter()
            .enumerate()
            .map(|(i, c)| {
                (
                    ::sqlx::Column::name(c).to_owned(),
                    ::sqlx::TypeInfo::name(::sqlx::Column::type_info(c)).to_lowercase(),
                    live.nullable(i).unwrap_or(true),
                )
            })
            .collect();
        assert_eq!(kept, now, "{}: {query}", path.display());
        let kept_params: Vec<String> = said["parameters"]["Left"]
            .as_array()
            .ok_or("parameters")?
            .iter()
            .map(|p| p.as_str().unwrap_or_default().to_lowercase())
            .collect();
        let now_params: Vec<String> = match live.parameters() {
            Some(::sqlx::Either::Left(types)) => {
                types.iter().map(|t| ::sqlx::TypeInfo::name(t).to_lowercase()).collect()
            }
            other => return Err(format!("parameters described as {other:?}").into()),
        };
        assert_eq!(kept_params, now_params, "{}: {query}", path.display());
        files += 1;
    }
    assert_eq!(files, 5, "the example's five checked queries");
    conn.close().await?;
    // The same URL without the shard's schema: no such table, as the macros would say.
    let plain: ::sqlx::postgres::PgConnectOptions = url.parse()?;
    let mut conn = ::sqlx::PgConnection::connect_with(&plain).await?;
    let err = (&mut conn).describe(sql.into_sql_str()).await.unwrap_err();
    assert_eq!(err.as_database_error().and_then(|d| d.code()).as_deref(), Some("42P01"), "{err}");
    Ok(())
}

shardline_testkit::register!(shared: a_stale_map_and_a_move_under_sqlx_writers_lose_and_double_nothing);
/// sqlx writers on two handles, one listening for map changes and one not (its map
/// goes stale at the flip), in transactions and as single statements, write into a
/// shard while it moves. Every acknowledged
/// write is on the target once; nothing else is; no ID twice; every tenth is read back
/// by ID mid-move.
pub(crate) async fn a_stale_map_and_a_move_under_sqlx_writers_lose_and_double_nothing(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let listening = Cluster::connect(&config, ClusterOptions::default()).await?;
    let deaf = || Cluster::connect(&config, ClusterOptions { listen: false, ..ClusterOptions::default() });
    // One stale handle per kind of writer: the first to learn the new map would teach it
    // to the other.
    let (stale, stale_statement) = (deaf().await?, deaf().await?);
    assert_eq!(stale.route_user(0).host.as_str(), "pg1");
    let stop = Arc::new(AtomicBool::new(false));
    let reruns = Arc::new(AtomicUsize::new(0));
    let statement_reruns = Arc::new(AtomicUsize::new(0));
    let writers: Vec<_> = (0..4i64)
        .map(|w| {
            let cluster = match w {
                1 => stale.clone(),
                3 => stale_statement.clone(),
                _ => listening.clone(),
            };
            let (stop, reruns, statement_reruns) = (stop.clone(), reruns.clone(), statement_reruns.clone());
            tokio::spawn(async move {
                let mut acked = Vec::new();
                let mut n = 0i64;
                while !stop.load(Ordering::Relaxed) {
                    let user = 6 * (w * 1000 + n % 20);
                    let runs = AtomicUsize::new(0);
                    // Writers 0 and 1 in transactions, 2 and 3 as single statements.
                    let statement = w >= 2;
                    let work = unit(|conn| {
                        runs.fetch_add(1, Ordering::Relaxed);
                        let sql = if statement {
                            INSERT.replacen("photos", &conn.table("photos"), 1)
                        } else {
                            INSERT.into()
                        };
                        Box::pin(async move {
                            ::sqlx::query_as::<_, Photo>(::sqlx::AssertSqlSafe(sql))
                                .bind(user)
                                .bind("u")
                                .bind(format!("w{w}-{n}"))
                                .fetch_one(&mut **conn)
                                .await
                        })
                    });
                    let db = cluster.sqlx();
                    let p = if statement {
                        db.statement_on_user(user, work).await?
                    } else {
                        db.on_user(user, work).await?
                    };
                    let again = runs.into_inner() - 1;
                    reruns.fetch_add(again, Ordering::Relaxed);
                    if statement {
                        statement_reruns.fetch_add(again, Ordering::Relaxed);
                    }
                    if n % 10 == 0 {
                        let back = get_as(&cluster, p.id, statement).await?;
                        assert_eq!(back.map(|g| g.id), Some(p.id), "read back mid-move");
                    }
                    acked.push(p.id);
                    n += 1;
                }
                Ok::<_, Error>(acked)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default()).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let mut acked = Vec::new();
    for w in writers {
        acked.extend(w.await??);
    }
    let unique: HashSet<Id> = acked.iter().copied().collect();
    assert_eq!(unique.len(), acked.len(), "no ID twice");
    let (found, total, distinct) = acked_on(&f, &ctx, 1, &acked).await?;
    let acked_n = i64::try_from(acked.len())?;
    assert_eq!(found, acked_n, "every acknowledged write is on the target");
    assert_eq!((total, distinct), (acked_n, acked_n), "and nothing else, once");
    let on_source: i64 = f
        .client(&ctx, 0)
        .await?
        .query_one(&format!("SELECT count(*) FROM shard_0000_moved_{}.photos", report.id), &[])
        .await?
        .get(0);
    assert!(on_source > 0 && on_source < acked_n, "writes before the fence ({on_source}) and after the flip");
    assert_eq!(stale.route_user(0).host.as_str(), "pg2", "the stale handle learnt the new map");
    assert_eq!(stale_statement.route_user(0).host.as_str(), "pg2");
    assert!(
        statement_reruns.load(Ordering::Relaxed) >= 1,
        "the stale statement writer's first write after the fence ran again"
    );
    eprintln!(
        "      {acked_n} sqlx writes during the move, {} run again after the shard moved ({} statements); pause {} ms",
        reruns.load(Ordering::Relaxed),
        statement_reruns.load(Ordering::Relaxed),
        report.pause_ms
    );
    Ok(())
}

shardline_testkit::register!(quiet: a_killed_or_hung_host_fails_sqlx_work_in_time_classified);
/// A host killed, then hung: sqlx work on it fails within the host timeout (plus the
/// pool's wait and slack), naming the host, classified as the repository's errors are;
/// work on the other host goes on; once the host is back the same handle works there.
pub(crate) async fn a_killed_or_hung_host_fails_sqlx_work_in_time_classified(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
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
    let on = |host: &str| (0..100).find(|u| cluster.route_user(*u).host.as_str() == host).ok_or("a user");
    let (u1, u2) = (on("pg1")?, on("pg2")?);
    let limit = timeout * 2 + Duration::from_millis(1500);
    let pg2 = &ctx.hosts()[1];
    // Warm: pooled connections to both hosts.
    insert(&cluster, u1, "warm".into()).await?;
    insert(&cluster, u2, "warm".into()).await?;

    pg2.kill().await?;
    let t = Instant::now();
    let err = insert(&cluster, u2, "killed".into()).await.unwrap_err();
    let took = t.elapsed();
    assert!(took < limit, "waited {took:?}: {err}");
    assert!(err.to_string().contains("pg2") && err.is_retryable(), "{}", shardline_repo::error_chain(&err));
    let killed = format!("{} in {took:?}", shardline_repo::error_chain(&err));
    // A single statement too: in time, naming the host, retryable; sent on a connection
    // that broke, so it may have been applied.
    let t = Instant::now();
    let err = insert_statement(&cluster, u2, "killed".into()).await.unwrap_err();
    let took_statement = t.elapsed();
    assert!(took_statement < limit, "waited {took_statement:?}: {err}");
    assert!(err.to_string().contains("pg2") && err.is_retryable(), "{}", shardline_repo::error_chain(&err));
    insert(&cluster, u1, "pg1 goes on".into()).await?;
    pg2.start().await?;
    let back = again(|| insert(&cluster, u2, "back".into())).await?;
    assert_eq!(back.caption, "back");
    // sqlx gives a connection back to its pool on a task of its own: the hang below is
    // meant to meet a pooled connection (a statement sent, never answered), not a new
    // one that cannot be had.
    let (db, host) = (cluster.sqlx(), cluster.route_user(u2).host);
    let deadline = Instant::now() + Duration::from_secs(5);
    while db.idle_connections(&host) == 0 {
        assert!(Instant::now() < deadline, "no idle connection to pg2");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    pg2.pause().await?;
    let t = Instant::now();
    let err = insert(&cluster, u2, "hung".into()).await.unwrap_err();
    let took = t.elapsed();
    let t = Instant::now();
    let hung_statement = insert_statement(&cluster, u2, "hung".into()).await.unwrap_err();
    let took_statement = t.elapsed();
    let t1 = Instant::now();
    insert(&cluster, u1, "pg1 goes on".into()).await?;
    let pg1_took = t1.elapsed();
    pg2.resume().await?;
    assert!(took < limit, "waited {took:?}: {err}");
    assert!(
        err.is_timeout() && err.is_retryable() && err.outcome_unknown() && err.to_string().contains("pg2"),
        "{}",
        shardline_repo::error_chain(&err)
    );
    assert!(took_statement < limit, "waited {took_statement:?}: {hung_statement}");
    // Sent and not answered (may have applied), or no connection could be had (the
    // hung unit of work's is still closing; nothing sent): either in time, retryable.
    assert!(
        hung_statement.is_timeout()
            && hung_statement.is_retryable()
            && hung_statement.to_string().contains("pg2")
            && hung_statement.outcome_unknown() == matches!(hung_statement, Error::Timeout { .. }),
        "{}",
        shardline_repo::error_chain(&hung_statement)
    );
    assert!(pg1_took < timeout, "pg1 waited {pg1_took:?} on pg2's hang");
    let back = again(|| insert(&cluster, u2, "back again".into())).await?;
    assert_eq!(back.caption, "back again");
    // The hung unit of work was dropped at its timeout: once the host answers, no
    // session of it is left inside a transaction (sqlx rolls back before reuse).
    let pg2_client = f.client(&ctx, 1).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let open: i64 = pg2_client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                   AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()",
                &[],
            )
            .await?
            .get(0);
        if open == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{open} sessions left inside a transaction on pg2");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("      killed: {killed}; hung: {} in {took:?}", shardline_repo::error_chain(&err));
    Ok(())
}

/// Runs `f` until it succeeds, for at most 10 s: a host just back may fail the first
/// tries (its old pooled connections are gone), each failing in time.
async fn again<T, Fut>(f: impl Fn() -> Fut) -> Result<T, BoxError>
where
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() < deadline && e.is_retryable() => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}
