//! Fan-outs over hundreds of shards of one host, on a host with Postgres's stock limits
//! (`max_connections = 100`, `max_locks_per_transaction = 64`): concurrent fan-outs
//! neither fail nor make the host's other queries fail.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use shardline_example_photos::{Comment, NewComment, NewPhoto, Photo};
use shardline_id::Id;
use shardline_repo::{Cluster, ClusterOptions};
use shardline_testkit::harness::{TestContext, TestResult};

use crate::bootstrap::{BoxError, Fixture, options, quiet};

/// Shards on the one host: more than the 667 a host of the README's demo holds.
const SHARDS: u16 = 720;
/// Concurrent `created_between` fan-outs.
const WINDOWS: usize = 16;
/// Concurrent `get_many` calls, each over an ID of every shard.
const MANYS: usize = 4;

shardline_testkit::register!(own: concurrent_fan_outs_leave_the_lock_table_to_other_queries);
/// The shared lock table of a stock host holds 64 × 122 = 7,808 locks. A statement
/// over every shard of the host would lock 3 × 720 relations (table, primary key, user
/// index) until it ends: a few at once would fill the table, and then every query on
/// the host fails with "out of shared memory" (53200). Sixteen `created_between` and
/// four `get_many` over every shard run at once, while another handle reads and writes
/// single shards: every one of them succeeds, complete.
pub(crate) async fn concurrent_fan_outs_leave_the_lock_table_to_other_queries(
    _ctx: TestContext,
) -> TestResult {
    crate::moves::on_own_kit(1, shardline_testkit::stock_limits(), |kit| {
        Box::pin(fan_outs_on_a_stock_host(kit))
    })
    .await
}

async fn fan_outs_on_a_stock_host(kit: &shardline_testkit::Cluster) -> Result<(), BoxError> {
    let admin = kit.hosts()[0].connect("postgres").await?;
    for (setting, stock) in [("max_connections", "100"), ("max_locks_per_transaction", "64")] {
        let value: String = admin.query_one(&format!("SHOW {setting}"), &[]).await?.get(0);
        assert_eq!(value, stock, "the host runs with the stock {setting}");
    }
    let f = Fixture::on_kit(kit, "fanout_locks", SHARDS).await?;
    shardline_ops::init(&f.config()?, &options(4), &quiet).await?;
    // Speed is not what this test is about: a slow fan-out must not pass for a failed one.
    let o = ClusterOptions {
        pool_size: WINDOWS + MANYS,
        host_timeout: Duration::from_secs(60),
        ..ClusterOptions::default()
    };
    let fanning = Cluster::connect(&f.config()?, o.clone()).await?;
    let single = Cluster::connect(&f.config()?, ClusterOptions { pool_size: 4, ..o }).await?;
    let photos = fanning.repo::<Photo>()?;

    // Two rows in every shard.
    let start = SystemTime::now() - Duration::from_secs(1);
    let new: Vec<NewPhoto> = (0..i64::from(SHARDS) * 2)
        .map(|u| NewPhoto { user_id: u, url: format!("https://cdn/{u}.jpg"), caption: String::new() })
        .collect();
    let made = photos.insert_many(&new).await?;
    let mut ids: Vec<Id> = made.iter().map(|p| p.id).collect();
    ids.sort_unstable_by(|a, b| b.cmp(a));
    let newest: Vec<Id> = ids[..100].to_vec();
    let one_per_shard: Vec<Id> = made[..usize::from(SHARDS)].iter().map(|p| p.id).collect();
    let shards_asked: std::collections::HashSet<u32> =
        one_per_shard.iter().map(|id| fanning.layout().decode(*id).shard).collect();
    assert_eq!(shards_asked.len(), usize::from(SHARDS), "get_many spans every shard");
    let end = SystemTime::now() + Duration::from_secs(1);

    let failures = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Barrier::new(WINDOWS + MANYS + 1));
    let mut fan_outs = Vec::new();
    for i in 0..WINDOWS + MANYS {
        let (photos, failures, in_flight, gate) =
            (photos.clone(), failures.clone(), in_flight.clone(), gate.clone());
        let (newest, asked) = (newest.clone(), one_per_shard.clone());
        in_flight.fetch_add(1, Ordering::SeqCst);
        fan_outs.push(tokio::spawn(async move {
            gate.wait().await;
            for _ in 0..2 {
                let failed = if i < WINDOWS {
                    match photos.created_between(start, end, 100).await {
                        Ok(w)
                            if w.is_complete() && w.rows.iter().map(|p| p.id).eq(newest.iter().copied()) =>
                        {
                            None
                        }
                        Ok(w) => Some(format!(
                            "created_between: {} rows, missing {:?}",
                            w.rows.len(),
                            w.missing.first().map(|m| &m.error)
                        )),
                        Err(e) => Some(format!("created_between: {}", shardline_repo::error_chain(&e))),
                    }
                } else {
                    match photos.get_many(&asked).await {
                        Ok(m) if m.missing.is_empty() && m.rows.iter().all(Option::is_some) => None,
                        Ok(m) => Some(format!("get_many: {} IDs missing", m.missing.len())),
                        Err(e) => Some(format!("get_many: {}", shardline_repo::error_chain(&e))),
                    }
                };
                if let Some(f) = failed {
                    failures.lock().unwrap().push(f);
                }
            }
            in_flight.fetch_sub(1, Ordering::SeqCst);
        }));
    }

    // Single-shard reads and writes from another handle while the fan-outs run (the
    // writes are comments, so the window's newest photos stay the same).
    let others = single.repo::<Photo>()?;
    let comments = single.repo::<Comment>()?;
    let (mut ran, mut during, mut other_failed) = (0_usize, 0_usize, 0_usize);
    gate.wait().await;
    while in_flight.load(Ordering::SeqCst) > 0 {
        let user = i64::try_from(ran).unwrap_or(0) % i64::from(SHARDS);
        let done = match ran % 3 {
            0 => others.get(made[usize::try_from(user).unwrap_or(0)].id).await.map(|p| p.is_some()),
            1 => others.page_of_user(user, None, 10).await.map(|p| !p.rows.is_empty()),
            _ => comments
                .insert(&NewComment {
                    photo_id: made[usize::try_from(user).unwrap_or(0)].id,
                    user_id: user,
                    body: "nice".into(),
                })
                .await
                .map(|_| true),
        };
        match done {
            Ok(true) => {}
            Ok(false) => {
                other_failed += 1;
                failures.lock().unwrap().push(format!("single-shard query {ran}: no row"));
            }
            Err(e) => {
                other_failed += 1;
                failures
                    .lock()
                    .unwrap()
                    .push(format!("single-shard query {ran}: {}", shardline_repo::error_chain(&e)));
            }
        }
        ran += 1;
        if in_flight.load(Ordering::SeqCst) > 0 {
            during += 1;
        }
    }
    for t in fan_outs {
        t.await?;
    }
    let failures = failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} of {} fan-outs and {other_failed} of {ran} single-shard queries failed, first: {:?}",
        failures.len() - other_failed,
        2 * (WINDOWS + MANYS),
        failures.iter().take(3).collect::<Vec<_>>()
    );
    assert!(during > 0, "single-shard queries ran while the fan-outs did");
    Ok(())
}

shardline_testkit::register!(shared: a_failed_statement_of_a_fan_out_names_its_shards_only);
/// A fan-out reads a host's shards in statements of `fan_out_batch` shards: when one of
/// them fails (here a shard whose table is gone), exactly its shards are listed as
/// missing, and the rows of every other shard, on that host too, are returned.
pub(crate) async fn a_failed_statement_of_a_fan_out_names_its_shards_only(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 12).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let o = ClusterOptions { fan_out_batch: 2, listen: false, ..ClusterOptions::default() };
    let cluster = Cluster::connect(&f.config()?, o).await?;
    let photos = cluster.repo::<Photo>()?;
    let start = SystemTime::now() - Duration::from_secs(1);
    let new: Vec<NewPhoto> = (0..48)
        .map(|u| NewPhoto { user_id: u, url: format!("https://cdn/{u}.jpg"), caption: String::new() })
        .collect();
    let made = photos.insert_many(&new).await?;
    let end = SystemTime::now() + Duration::from_secs(1);
    let whole = photos.created_between(start, end, 1000).await?;
    assert!(whole.is_complete());
    assert_eq!(whole.rows.len(), 48);

    let broken = cluster.route_user(5);
    let host = usize::from(broken.host.as_str() == "pg2");
    let map = cluster.map();
    let on_host: Vec<_> = map.shards_of(&broken.host).collect();
    let batch: Vec<u16> = on_host
        .chunks(2)
        .find(|c| c.contains(&broken.shard))
        .map(|c| c.iter().map(|s| s.get()).collect())
        .unwrap();
    assert_eq!(batch.len(), 2, "the broken shard shares its statement with another");
    f.client(&ctx, host)
        .await?
        .batch_execute(&format!("ALTER TABLE {}.photos RENAME TO photos_gone", broken.schema.quoted()))
        .await?;

    let part = photos.created_between(start, end, 1000).await?;
    assert_eq!(part.missing.len(), 1, "{:?}", part.missing);
    assert_eq!(part.missing[0].host, broken.host.as_str());
    assert_eq!(part.missing[0].shards, batch);
    let expected: Vec<Id> = {
        let mut ids: Vec<Id> = made
            .iter()
            .filter(|p| !batch.contains(&u16::try_from(cluster.layout().decode(p.id).shard).unwrap()))
            .map(|p| p.id)
            .collect();
        ids.sort_unstable_by(|a, b| b.cmp(a));
        ids
    };
    assert_eq!(part.rows.iter().map(|p| p.id).collect::<Vec<_>>(), expected);
    assert_eq!(expected.len(), 48 - 8, "4 rows in each of the 2 shards are missing, no other");
    Ok(())
}

shardline_testkit::register!(shared: a_page_whose_newest_rows_crowd_into_one_statement_is_whole);
/// A fan-out first asks each statement for a short prefix of its newest rows (its share
/// of the page, doubled, plus 16), then asks again only the statements whose prefix
/// may hold more of the page. Here one user's shard holds the 300 newest rows: its
/// statement's prefix (33 of a page of 50, 100 of a page of 250, 30 of a page of 40)
/// cannot hold them, and the page must still be exactly the newest rows, in order, with
/// nothing twice, in windows and in a listing walked to its end; with and without kept
/// statements.
pub(crate) async fn a_page_whose_newest_rows_crowd_into_one_statement_is_whole(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 12).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let start = SystemTime::now() - Duration::from_secs(1);
    let photo = |u: i64, i: i64| NewPhoto {
        user_id: u,
        url: format!("https://cdn/{u}/{i}.jpg"),
        caption: String::new(),
    };
    let mut all: Vec<Id> = Vec::new();
    {
        let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
        let photos = cluster.repo::<Photo>()?;
        let others: Vec<NewPhoto> = (100..140).flat_map(|u| [photo(u, 0), photo(u, 1)]).collect();
        all.extend(photos.insert_many(&others).await?.iter().map(|p| p.id));
        // Later than every other row by more than an ID's lag (docs/ids.md).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let hot: Vec<NewPhoto> = (0..300).map(|i| photo(7, i)).collect();
        let made = photos.insert_many(&hot).await?;
        let oldest_hot = made.iter().map(|p| p.id).min();
        assert!(all.iter().all(|id| Some(*id) < oldest_hot), "the hot user's rows are the newest");
        all.extend(made.iter().map(|p| p.id));
    }
    let end = SystemTime::now() + Duration::from_secs(1);
    all.sort_unstable_by(|a, b| b.cmp(a));
    for cache in [0, 64] {
        let o = ClusterOptions {
            fan_out_batch: 2,
            statement_cache: cache,
            listen: false,
            ..ClusterOptions::default()
        };
        let cluster = Cluster::connect(&f.config()?, o).await?;
        let photos = cluster.repo::<Photo>()?;
        // A page of 250 asks each statement for 100 first: a second read of 100 would not
        // be enough either (the second reads ask for the whole limit).
        for limit in [1, 20, 50, 90, 250, 299, 300, 301, 379, 380, 1000] {
            let page = photos.created_between(start, end, limit).await?;
            assert!(page.is_complete(), "{:?}", page.missing);
            let got: Vec<Id> = page.rows.iter().map(|p| p.id).collect();
            assert_eq!(got, all[..limit.min(all.len())], "statement_cache {cache}, limit {limit}");
        }
        // Pages of 40 down the whole listing, each from the last one's cursor.
        let (mut seen, mut before) = (Vec::new(), None);
        loop {
            let page = photos.newest(before, 40).await?;
            assert!(page.is_complete(), "{:?}", page.missing);
            seen.extend(page.rows.iter().map(|p| p.id));
            match page.next {
                Some(next) => before = Some(next),
                None => break,
            }
            assert!(seen.len() <= all.len(), "the listing ends");
        }
        assert_eq!(seen, all, "statement_cache {cache}: every row once, newest first");
    }
    Ok(())
}

shardline_testkit::register!(shared: a_statement_that_fails_when_read_again_is_missing_whole_and_the_page_stays_exact);
/// A statement that answered its first round and fails when read again (here on a row
/// whose ID names a shard outside the statement: refused as misrouted) is missing as a
/// whole: its shards are listed and none of its rows is in the page. The page is still
/// exactly the newest rows of every other statement, and one of those must then be
/// read further down: user W's 40 rows, whose first 33 were enough while the failed
/// statement's rows filled the top of the page.
pub(crate) async fn a_statement_that_fails_when_read_again_is_missing_whole_and_the_page_stays_exact(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 12).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let o = ClusterOptions { fan_out_batch: 2, listen: false, ..ClusterOptions::default() };
    let cluster = Cluster::connect(&f.config()?, o).await?;
    let photos = cluster.repo::<Photo>()?;
    let layout = cluster.layout();
    let map = cluster.map();
    let (hot_user, hot) = (7, cluster.route_user(7));
    let hot_batch: Vec<u16> = map
        .shards_of(&hot.host)
        .collect::<Vec<_>>()
        .chunks(2)
        .find(|c| c.contains(&hot.shard))
        .map(|c| c.iter().map(|s| s.get()).collect())
        .unwrap();
    let in_hot_batch = |id: Id| hot_batch.contains(&u16::try_from(layout.decode(id).shard).unwrap());
    let warm_user = (100..).find(|u| !hot_batch.contains(&cluster.route_user(*u).shard.get())).unwrap();
    let photo = |u: i64, i: i64| NewPhoto {
        user_id: u,
        url: format!("https://cdn/{u}/{i}.jpg"),
        caption: String::new(),
    };
    let start = SystemTime::now() - Duration::from_secs(1);
    // Oldest: two rows of each of 40 users; then user W's 40; then the hot user's 300,
    // in two batches (240, then the newest 60).
    let mut all: Vec<Id> = Vec::new();
    let others: Vec<NewPhoto> = (200..240).flat_map(|u| [photo(u, 0), photo(u, 1)]).collect();
    all.extend(photos.insert_many(&others).await?.iter().map(|p| p.id));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let warm: Vec<NewPhoto> = (0..40).map(|i| photo(warm_user, i)).collect();
    let warm: Vec<Id> = photos.insert_many(&warm).await?.iter().map(|p| p.id).collect();
    all.extend(&warm);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let older: Vec<NewPhoto> = (0..240).map(|i| photo(hot_user, i)).collect();
    let older: Vec<Id> = photos.insert_many(&older).await?.iter().map(|p| p.id).collect();
    // Longer than an ID's lag: the newer rows' IDs carry a later millisecond.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let newer: Vec<NewPhoto> = (240..300).map(|i| photo(hot_user, i)).collect();
    let newer: Vec<Id> = photos.insert_many(&newer).await?.iter().map(|p| p.id).collect();
    let end = SystemTime::now() + Duration::from_secs(1);

    // A row in the hot shard's table whose ID names another shard, between the hot
    // user's older and newer rows: below the hot statement's first 33 rows (the 60
    // newer ones are above it) and within its second read (of 50 more).
    let elsewhere = (0..12u32).find(|s| !hot_batch.contains(&u16::try_from(*s).unwrap())).unwrap();
    let (older_last, newer_first) = (older.iter().max().unwrap(), newer.iter().min().unwrap());
    let bad = layout.compose(layout.decode(*newer_first).unix_ms - 1, elsewhere, 0)?;
    assert!(*older_last < bad && bad < *newer_first, "the newer rows carry a later millisecond");
    f.client(&ctx, usize::from(hot.host.as_str() == "pg2"))
        .await?
        .execute(
            &format!("INSERT INTO {}.photos (id, user_id, url) VALUES ($1, $2, 'x')", hot.schema.quoted()),
            &[&i64::from(bad), &hot_user],
        )
        .await?;

    let page = photos.created_between(start, end, 50).await?;
    assert_eq!(page.missing.len(), 1, "{:?}", page.missing);
    assert_eq!(page.missing[0].host, hot.host.as_str());
    assert_eq!(page.missing[0].shards, hot_batch);
    all.sort_unstable_by(|a, b| b.cmp(a));
    let expected: Vec<Id> = all.iter().copied().filter(|id| !in_hot_batch(*id)).take(50).collect();
    assert!(warm.iter().all(|w| expected.contains(w)), "all of user W's rows are in the page");
    let got: Vec<Id> = page.rows.iter().map(|p| p.id).collect();
    assert_eq!(got, expected);
    Ok(())
}

shardline_testkit::register!(shared: generic_plans_plan_a_kept_fan_out_once_from_its_first_run);
/// A fan-out's statements are kept on a direct host by default (`fan_out_prepared`), with
/// or without a statement cache for single-shard statements, and never behind a
/// transaction pooler. With `generic_plans` they run a generic plan from their first run
/// on a new connection (Postgres's own counters in `pg_prepared_statements`), where by
/// default each of their first five runs is planned for its values. When nothing is
/// kept the option changes nothing on the connection.
pub(crate) async fn generic_plans_plan_a_kept_fan_out_once_from_its_first_run(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 1, 24).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let start = SystemTime::now() - Duration::from_secs(1);
    {
        let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
        let new: Vec<NewPhoto> = (0..48)
            .map(|u| NewPhoto { user_id: u, url: format!("https://cdn/{u}.jpg"), caption: String::new() })
            .collect();
        cluster.repo::<Photo>()?.insert_many(&new).await?;
    }
    let end = SystemTime::now() + Duration::from_secs(1);
    let cases = [
        // (statement_cache, fan_out_prepared, generic_plans, transaction_pooler, plan_cache_mode,
        //  kept plans: (generic, custom))
        (64, true, true, false, "force_generic_plan", Some((3, 0))),
        (64, true, false, false, "auto", Some((0, 3))),
        (0, true, true, false, "force_generic_plan", Some((3, 0))),
        (0, true, false, false, "auto", Some((0, 3))),
        (64, false, false, false, "auto", None),
        (0, false, true, false, "auto", None),
        (64, true, true, true, "auto", None),
    ];
    for (cache, fan_out, generic, pooler, mode, plans) in cases {
        let o = ClusterOptions {
            pool_size: 1,
            fan_out_batch: 8,
            statement_cache: cache,
            fan_out_prepared: fan_out,
            generic_plans: generic,
            transaction_pooler: pooler.then_some(true),
            listen: false,
            ..ClusterOptions::default()
        };
        let cluster = Cluster::connect(&f.config()?, o).await?;
        let photos = cluster.repo::<Photo>()?;
        for _ in 0..3 {
            let w = photos.created_between(start, end, 100).await?;
            assert!(w.is_complete());
            assert_eq!(w.rows.len(), 48);
        }
        let conn = cluster.client(&cluster.route_user(0).host).await?;
        let shown: String = conn.query_one("SHOW plan_cache_mode", &[]).await?.get(0);
        let what = format!(
            "statement_cache {cache}, fan_out_prepared {fan_out}, generic_plans {generic}, transaction_pooler {pooler}"
        );
        assert_eq!(shown, mode, "{what}");
        let kept = conn
            .query(
                // The fan-out's statements (this one is prepared too, and is not one).
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements \
                 WHERE left(statement, 15) = 'SELECT * FROM ('",
                &[],
            )
            .await?;
        let counts: Vec<(i64, i64)> = kept.iter().map(|r| (r.get(0), r.get(1))).collect();
        match plans {
            // Three statements of 8 shards, each run 3 times.
            Some(each) => assert_eq!(counts, vec![each; 3], "{what}"),
            None => assert!(counts.is_empty(), "{what}: {counts:?}"),
        }
    }
    Ok(())
}

/// The client backends of `client`'s database on its host, but its own: a pool's
/// connections there (the tests put the catalog, and so the map's listener, elsewhere).
async fn client_backends(client: &tokio_postgres::Client) -> Result<Vec<i32>, BoxError> {
    let rows = client
        .query(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
             AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get::<_, i32>(0)).collect())
}

shardline_testkit::register!(shared: a_row_in_another_shards_schema_of_the_same_statement_is_not_returned);
/// A row stored in shard 0's schema with an ID shard 1 minted (data put there by hand,
/// or a bug), both shards read by one statement of the time window: the row is not
/// returned as shard 0's, and the statement's shards are reported missing. (Before, a
/// row was checked against any shard of its statement, so it passed.)
pub(crate) async fn a_row_in_another_shards_schema_of_the_same_statement_is_not_returned(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 1, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    for user in 0..4 {
        photos
            .insert(&NewPhoto { user_id: user, url: "https://cdn/a.jpg".into(), caption: String::new() })
            .await?;
    }
    let now = i64::try_from(SystemTime::now().duration_since(SystemTime::UNIX_EPOCH)?.as_millis())?;
    let stray = Id::from_parts(now, 1, 7)?;
    let schema = cluster.route(crate::shard(0))?.schema;
    f.client(&ctx, 0)
        .await?
        .execute(
            &format!(
                "INSERT INTO {}.photos (id, user_id, url, caption) VALUES ($1, 0, 'x', 'stray')",
                schema.quoted()
            ),
            &[&stray.as_i64()],
        )
        .await?;
    for page in [
        photos.newest(None, 100).await?,
        photos
            .created_between(
                SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(now)? - 60_000),
                SystemTime::now() + Duration::from_secs(1),
                100,
            )
            .await?,
    ] {
        assert!(page.rows.iter().all(|p| p.id != stray), "the stray row was returned");
        assert!(!page.is_complete(), "the statement holding the stray row was not reported");
    }
    // Nor counted: the count of the statement holding it fails, its shards reported.
    let from = SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(now)? - 60_000);
    for counted in [photos.count().await?, photos.count_between(from, SystemTime::now()).await?] {
        let missing: Vec<_> = counted.missing.iter().flat_map(|m| m.shards.iter().copied()).collect();
        assert!(missing.contains(&crate::shard(0)), "the stray row's shard counted: {counted:?}");
        assert!(counted.missing[0].error.contains("shard 1"), "{counted:?}");
        assert!(counted.count <= 4 - u64::try_from(missing.len())?, "{counted:?}");
    }
    Ok(())
}

shardline_testkit::register!(shared: a_connection_past_its_uses_is_replaced);
/// `connection_max_uses`: a pooled connection handed out that many times is closed
/// when it comes back, and the next request gets a new backend; by default the same
/// backend serves request after request.
pub(crate) async fn a_connection_past_its_uses_is_replaced(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 2).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let pg2 = f.client(&ctx, 1).await?;
    let backends = || client_backends(&pg2);
    for (uses, renewed) in [(None, false), (Some(2), true)] {
        let o = ClusterOptions { pool_size: 1, connection_max_uses: uses, ..ClusterOptions::default() };
        let cluster = Cluster::connect(&f.config()?, o).await?;
        let photos = cluster.repo::<Photo>()?;
        let user = (0..).find(|u| cluster.route_user(*u).host.as_str() == "pg2").unwrap();
        let made = photos
            .insert(&NewPhoto { user_id: user, url: "https://cdn/a.jpg".into(), caption: String::new() })
            .await?;
        let first = backends().await?;
        assert_eq!(first.len(), 1, "one pooled connection on pg2");
        photos.get(made.id).await?; // the connection's second use
        photos.get(made.id).await?; // a third: a new connection when the bound is 2
        let mut now = backends().await?;
        // The old backend ends once the server has seen its connection close.
        while renewed && now.contains(&first[0]) {
            tokio::task::yield_now().await;
            now = backends().await?;
        }
        assert_eq!(now.len(), 1, "uses {uses:?}: {now:?}");
        assert_eq!(now[0] != first[0], renewed, "uses {uses:?}: a new backend");
        drop(photos);
        drop(cluster);
        while !backends().await?.is_empty() {
            tokio::task::yield_now().await;
        }
    }
    Ok(())
}

shardline_testkit::register!(shared: an_idle_connection_past_its_lifetime_is_closed);
/// `connection_max_lifetime`: pooled connections left idle past it are closed by the
/// handle within a quarter of it (they hold a server backend, and the catalog entries of
/// every shard they touched), not kept until they are next handed out; the next request
/// gets a new one.
pub(crate) async fn an_idle_connection_past_its_lifetime_is_closed(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 2).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let pg2 = f.client(&ctx, 1).await?;
    let backends = || client_backends(&pg2);
    let lifetime = Duration::from_secs(3);
    let o =
        ClusterOptions { pool_size: 4, connection_max_lifetime: Some(lifetime), ..ClusterOptions::default() };
    let cluster = Cluster::connect(&f.config()?, o).await?;
    let photos = cluster.repo::<Photo>()?;
    let user = (0..).find(|u| cluster.route_user(*u).host.as_str() == "pg2").unwrap();
    let made = photos
        .insert(&NewPhoto { user_id: user, url: "https://cdn/a.jpg".into(), caption: String::new() })
        .await?;
    // Four at once: four connections.
    let reads = (0..4).map(|_| {
        cluster.transaction(cluster.route_user(user).shard, move |tx| {
            Box::pin(async move { tx.query("SELECT pg_sleep(0.2)", &[]).await.map(|_| ()) })
        })
    });
    for r in futures::future::join_all(reads).await {
        r?;
    }
    let busy = backends().await?;
    assert_eq!(busy.len(), 4, "four pooled connections on pg2: {busy:?}");
    // Idle from here: each is past its lifetime 3 s after it was made, and the handle
    // looks every 750 ms.
    let began = Instant::now();
    let mut now = busy.clone();
    while !now.is_empty() && began.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        now = backends().await?;
    }
    assert!(
        now.is_empty(),
        "idle connections past their lifetime still open after {:?}: {now:?}",
        began.elapsed()
    );
    eprintln!("      the idle connections were closed {:?} after the last use", began.elapsed());
    assert!(began.elapsed() < lifetime + Duration::from_secs(2), "closed only after {:?}", began.elapsed());
    // The handle goes on with a new connection.
    assert_eq!(photos.get(made.id).await?.map(|p| p.id), Some(made.id));
    let renewed = backends().await?;
    assert_eq!(renewed.len(), 1);
    assert!(!busy.contains(&renewed[0]));
    Ok(())
}

shardline_testkit::register!(shared: a_listing_pages_every_shard_newest_first_and_counts_agree);
/// The admin listing across every shard: pages newest first, each resumed from the last
/// one's cursor (by another handle too), with a row written before each page: no row
/// twice, none of those there at the start skipped. Counts over every shard agree with
/// what was written. A shard that cannot be read is named, in the listing and the count
/// alike, never silently left out.
pub(crate) async fn a_listing_pages_every_shard_newest_first_and_counts_agree(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 12).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let o = || ClusterOptions { fan_out_batch: 2, listen: false, ..ClusterOptions::default() };
    let cluster = Cluster::connect(&f.config()?, o()).await?;
    let photos = cluster.repo::<Photo>()?;
    let start = SystemTime::now() - Duration::from_secs(1);
    let new = |from: i64, n: i64| -> Vec<NewPhoto> {
        (from..from + n)
            .map(|u| NewPhoto { user_id: u, url: format!("https://cdn/{u}.jpg"), caption: String::new() })
            .collect()
    };
    let made = photos.insert_many(&new(0, 48)).await?;
    let end = SystemTime::now() + Duration::from_secs(1);
    let mut all: Vec<Id> = made.iter().map(|p| p.id).collect();
    all.sort_unstable_by(|a, b| b.cmp(a));

    // Pages of 10 over 49 rows and more: full pages, then a short one with no cursor; a
    // row written before each page; page 4 read by another handle.
    let other = Cluster::connect(&f.config()?, o()).await?.repo::<Photo>()?;
    let (mut seen, mut before, mut pages) = (Vec::new(), None, 0);
    loop {
        photos.insert(&new(100 + pages, 1)[0]).await?;
        let page =
            if pages == 3 { other.newest(before, 10).await? } else { photos.newest(before, 10).await? };
        assert!(page.is_complete(), "{:?}", page.missing);
        assert!(page.rows.len() <= 10);
        seen.extend(page.rows.iter().map(|p| p.id));
        pages += 1;
        match page.next {
            Some(next) => {
                assert_eq!(page.rows.len(), 10, "a cursor only after a full page");
                assert_eq!(Some(next), page.rows.last().map(|p| p.id));
                before = Some(next);
            }
            None => break,
        }
        assert!(pages < 20, "the listing ends");
    }
    // Every row that was there when the walk began, once, in ID order; rows written
    // during it only where their IDs fall below the cursor (an ID minted in Postgres may
    // trail the clock: see docs/ids.md), and never twice.
    assert!(seen.windows(2).all(|w| w[0] > w[1]), "strictly newest first, nothing twice");
    let before_walk: Vec<Id> = seen.iter().copied().filter(|id| all.contains(id)).collect();
    assert_eq!(before_walk, all, "every row written before the walk, once, newest first");
    let listed = photos.newest(None, 1000).await?;
    assert!(seen.iter().all(|id| listed.rows.iter().any(|p| p.id == *id)));
    let first = photos.newest(None, 3).await?;
    let top: Vec<Id> = listed.rows.iter().take(3).map(|p| p.id).collect();
    assert_eq!(first.rows.iter().map(|p| p.id).collect::<Vec<_>>(), top, "the first page is the top");
    assert!(photos.newest(before, 0).await?.rows.is_empty());
    // A page that ends exactly at the last row has no cursor (no empty call after it);
    // one row short of it has.
    let n = listed.rows.len();
    assert_eq!(photos.newest(None, n).await?.next, None, "the whole listing in one page");
    let short = photos.newest(None, n - 1).await?;
    assert_eq!(short.next, listed.rows.get(n - 2).map(|p| p.id), "one row left below the page");

    // Counts: the window, everything, and "is there any" as a window of one.
    assert_eq!(listed.rows.len(), 48 + usize::try_from(pages)?);
    let written = u64::try_from(listed.rows.len())?;
    assert_eq!(photos.count().await?, shardline_repo::Counted { count: written, missing: vec![] });
    let ms = |t: SystemTime| -> Result<i64, BoxError> {
        Ok(i64::try_from(t.duration_since(SystemTime::UNIX_EPOCH)?.as_millis())?)
    };
    let layout = cluster.layout();
    let (lo, hi) = (layout.min_id_at(ms(start)?)?, layout.max_id_at(ms(end)?)?);
    let in_window = listed.rows.iter().filter(|p| (lo..=hi).contains(&p.id)).count();
    assert!(in_window >= 48);
    assert_eq!(photos.count_between(start, end).await?.count, u64::try_from(in_window)?);
    let before_all = start - Duration::from_secs(3600);
    assert_eq!(photos.count_between(before_all, start - Duration::from_secs(1800)).await?.count, 0);
    let long_ago = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let none = photos.created_between(long_ago, long_ago + Duration::from_secs(1), 1).await?;
    assert!(none.rows.is_empty() && none.next.is_none());
    assert_eq!(photos.created_between(start, end, 1).await?.rows.len(), 1);

    // A shard whose table is gone: its statement's two shards are missing from both.
    let broken = cluster.route_user(5);
    let host = usize::from(broken.host.as_str() == "pg2");
    let batch: Vec<u16> = cluster
        .map()
        .shards_of(&broken.host)
        .collect::<Vec<_>>()
        .chunks(2)
        .find(|c| c.contains(&broken.shard))
        .map(|c| c.iter().map(|s| s.get()).collect())
        .ok_or("the broken shard's statement")?;
    f.client(&ctx, host)
        .await?
        .batch_execute(&format!("ALTER TABLE {}.photos RENAME TO photos_gone", broken.schema.quoted()))
        .await?;
    let in_batch =
        |id: &Id| batch.contains(&u16::try_from(cluster.layout().decode(*id).shard).unwrap_or(u16::MAX));
    let counted = photos.count().await?;
    assert_eq!(counted.missing.len(), 1, "{counted:?}");
    assert_eq!(counted.missing[0].host, broken.host.as_str());
    assert_eq!(counted.missing[0].shards, batch);
    let everything = photos.newest(None, 1000).await?;
    assert_eq!(everything.missing, counted.missing);
    assert_eq!(u64::try_from(everything.rows.len())?, counted.count);
    assert!(everything.rows.iter().all(|p| !in_batch(&p.id)));
    let kept = listed.rows.iter().filter(|p| !in_batch(&p.id)).count();
    assert!(all.iter().filter(|id| in_batch(id)).count() >= 8, "the two shards held rows");
    assert_eq!(counted.count, u64::try_from(kept)?);
    Ok(())
}
