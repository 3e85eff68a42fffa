//! The repository API against real hosts: every read and write lands on the shard the
//! map gives, a stale map is refreshed instead of reading the wrong host, and a fan-out
//! with a dead or hung host says which shards are missing instead of hanging.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use shardline_example_photos::{Comment, NewComment, NewPhoto, Photo};
use shardline_id::Id;
use shardline_repo::{Cluster, ClusterOptions, Error};
use shardline_testkit::harness::{TestContext, TestResult};

use crate::bootstrap::{Fixture, options, quiet};

fn photo(user_id: i64, n: i64) -> NewPhoto {
    NewPhoto { user_id, url: format!("https://cdn/{user_id}/{n}.jpg"), caption: String::new() }
}

async fn cluster(
    ctx: &TestContext,
    hosts: usize,
    shards: u16,
    o: ClusterOptions,
) -> Result<(Fixture, Cluster), crate::bootstrap::BoxError> {
    let f = Fixture::new(ctx, hosts, shards).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let c = Cluster::connect(&f.config()?, o).await?;
    Ok((f, c))
}

shardline_testkit::register!(shared: a_shard_the_cluster_does_not_have_is_refused_not_a_panic);
/// A `LogicalShard` is checked only against the most shards any cluster can have: one
/// past this cluster's 4 shards, given to `Cluster::route` or to a shard transaction, is
/// an error naming it (before, the map indexed past its end and panicked), and nothing
/// is sent.
pub(crate) async fn a_shard_the_cluster_does_not_have_is_refused_not_a_panic(ctx: TestContext) -> TestResult {
    let (_f, c) = cluster(&ctx, 2, 4, ClusterOptions::default()).await?;
    for n in [4_u16, 5000] {
        let shard = crate::shard(n);
        let err = c.route(shard).unwrap_err();
        assert!(matches!(err, Error::Router(_)), "{err}");
        let err = c
            .transaction(shard, |tx| Box::pin(async move { tx.execute("SELECT 1", &[]).await }))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Router(_)) && err.to_string().contains(&n.to_string()), "{err}");
    }
    assert_eq!(c.route(crate::shard(3))?.shard, crate::shard(3));
    Ok(())
}

shardline_testkit::register!(shared: options_a_handle_cannot_use_are_refused_by_name_not_a_panic);
/// A time that would overflow the clock once added to it (`Duration::MAX` for "no
/// limit"), or a pool no host could hold, is refused by `Cluster::connect`, naming the
/// option; before, `host_timeout: Duration::MAX` panicked in `connect`, and `move_wait`
/// at the first moved shard. Up to the bound, a handle is made.
pub(crate) async fn options_a_handle_cannot_use_are_refused_by_name_not_a_panic(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let config = f.config()?;
    let d = ClusterOptions::default;
    let cases: [(&str, ClusterOptions); 6] = [
        ("connect_timeout", ClusterOptions { connect_timeout: Duration::MAX, ..d() }),
        ("host_timeout", ClusterOptions { host_timeout: Duration::MAX, ..d() }),
        ("map_check", ClusterOptions { map_check: Duration::from_secs(u64::MAX), ..d() }),
        ("move_wait", ClusterOptions { move_wait: Duration::MAX, ..d() }),
        ("connection_max_lifetime", ClusterOptions { connection_max_lifetime: Some(Duration::MAX), ..d() }),
        ("pool_size", ClusterOptions { pool_size: usize::MAX, ..d() }),
    ];
    for (name, o) in cases {
        match Cluster::connect(&config, o).await {
            Err(Error::Invalid { what }) if what.contains(&format!("ClusterOptions::{name}")) => {}
            other => return Err(format!("{name}: {:?}", other.map(|_| "a handle")).into()),
        }
    }
    let longest = shardline_repo::LONGEST_OPTION;
    let c = Cluster::connect(&config, ClusterOptions { host_timeout: longest, move_wait: longest, ..d() })
        .await?;
    c.repo::<Photo>()?
        .insert(&NewPhoto { user_id: 1, url: "https://cdn/1.jpg".into(), caption: String::new() })
        .await?;
    Ok(())
}

/// Photo `id` is on the route's host, in the route's schema, and on no other of the
/// three hosts.
pub(crate) async fn only_where_routed(
    f: &Fixture,
    ctx: &TestContext,
    route: &shardline_router::Route,
    id: Id,
    what: &str,
) -> TestResult {
    for (h, host) in ["pg1", "pg2", "pg3"].iter().enumerate() {
        let n: i64 = f
            .client(ctx, h)
            .await?
            .query_one(
                &format!("SELECT count(*) FROM {}.photos WHERE id = $1", route.schema.quoted()),
                &[&id],
            )
            .await
            .map(|r| r.get(0))
            .unwrap_or(0);
        assert_eq!(n, i64::from(*host == route.host.as_str()), "{what} on {host}");
    }
    Ok(())
}

shardline_testkit::register!(shared: a_catalog_that_does_not_answer_fails_connect_in_time);
/// A catalog that answers its start-up but not the map's read (its table locked by
/// another session: as hung, or cut off after the handshake) fails `Cluster::connect`
/// within the connect and host timeouts, `CatalogTimeout`. Before: it waited as long as
/// the lock was held.
pub(crate) async fn a_catalog_that_does_not_answer_fails_connect_in_time(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let locker = f.client(&ctx, 0).await?;
    locker.batch_execute("BEGIN; LOCK TABLE shardline.shards IN ACCESS EXCLUSIVE MODE").await?;
    let options = ClusterOptions {
        connect_timeout: Duration::from_secs(1),
        host_timeout: Duration::from_secs(1),
        ..ClusterOptions::default()
    };
    let started = Instant::now();
    let connected =
        tokio::time::timeout(Duration::from_secs(20), Cluster::connect(&f.config()?, options)).await;
    let took = started.elapsed();
    locker.batch_execute("ROLLBACK").await?;
    let err = connected.map_err(|_| "connect waited 20 s on the locked catalog")?.err().ok_or("connected")?;
    assert!(matches!(err, Error::CatalogTimeout { .. }), "{err}");
    assert!(took < Duration::from_secs(4), "connect gave up after {took:?}");
    Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    Ok(())
}

shardline_testkit::register!(shared: a_catalog_that_changes_its_shard_count_is_refused_and_the_map_kept);
/// The number of logical shards is fixed for the life of a cluster, and checked against
/// the config when a handle is made. A catalog edited by hand to another count (and its
/// map cut to match) is refused on reload too: the handle keeps its map, so user 3 still
/// routes to shard 3, and its reads and writes go on. Before: the reload took the
/// 2-shard map, and user 3 routed to shard 1.
pub(crate) async fn a_catalog_that_changes_its_shard_count_is_refused_and_the_map_kept(
    ctx: TestContext,
) -> TestResult {
    let (f, cluster) = cluster(&ctx, 2, 4, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let before = photos.insert(&photo(3, 0)).await?;
    f.client(&ctx, 0)
        .await?
        .batch_execute(
            "BEGIN; UPDATE shardline.cluster SET logical_shards = 2;
             DELETE FROM shardline.shards WHERE shard >= 2; COMMIT",
        )
        .await?;
    let err = cluster.refresh().await.unwrap_err();
    assert!(
        matches!(&err, Error::Mismatch { key: "logical_shards", catalog, config } if catalog == "2" && config == "4"),
        "{err}"
    );
    assert_eq!(cluster.route_user(3).shard, crate::shard(3));
    assert_eq!(cluster.map().count().get(), 4);
    let after = photos.insert(&photo(3, 1)).await?;
    assert_eq!(cluster.layout().decode(after.id).shard, 3, "user 3's new photo is in shard 3");
    assert_eq!(photos.get(before.id).await?, Some(before));
    Ok(())
}

shardline_testkit::register!(shared: reads_and_writes_land_on_the_shard_the_map_gives);
pub(crate) async fn reads_and_writes_land_on_the_shard_the_map_gives(ctx: TestContext) -> TestResult {
    let (f, cluster) = cluster(&ctx, 3, 12, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let mut made = Vec::new();
    for user in [0i64, 1, 5, 11, 12, 23, -1, 1_000_003] {
        let p = photos.insert(&photo(user, 0)).await?;
        let route = cluster.route_user(user);
        assert_eq!(
            cluster.layout().decode(p.id).shard,
            u32::from(route.shard.get()),
            "the ID carries the user's shard"
        );
        only_where_routed(&f, &ctx, &route, p.id, &format!("user {user}")).await?;
        assert_eq!(photos.get(p.id).await?, Some(p.clone()));
        made.push(p);
    }
    let batch = photos.insert_many(&(0..30).map(|i| photo(i % 7, i)).collect::<Vec<_>>()).await?;
    assert_eq!(batch.len(), 30);
    for (i, p) in batch.iter().enumerate() {
        assert_eq!(p.url, format!("https://cdn/{}/{i}.jpg", i % 7), "insert_many kept the caller's order");
    }

    // Many IDs: the caller's order, the missing ones named.
    let absent = cluster.layout().compose(1_700_000_000_000, 3, 7)?;
    let ask = vec![made[3].id, absent, made[0].id, made[7].id];
    let many = photos.get_many(&ask).await?;
    assert_eq!(many.missing, vec![absent]);
    let got: Vec<Option<Id>> = many.rows.iter().map(|r| r.as_ref().map(|p| p.id)).collect();
    assert_eq!(got, vec![Some(made[3].id), None, Some(made[0].id), Some(made[7].id)]);

    // Update and delete by ID.
    let changed = photos.update(made[1].id, &[("caption", &"sunset")]).await?;
    assert_eq!(changed.map(|p| p.caption), Some("sunset".to_owned()));
    // The column that places a row (its user, its parent) cannot be updated: the row
    // would stay in its shard while its new key leads to another, and no page of either
    // user would show it. Nothing is sent.
    let err = photos.update(made[1].id, &[("caption", &"moved"), ("user_id", &2_i64)]).await.unwrap_err();
    assert!(matches!(&err, Error::Invalid { what } if what.contains("photos.user_id")), "{err}");
    assert!(!err.outcome_unknown());
    let comments = cluster.repo::<shardline_example_photos::Comment>()?;
    let c = comments
        .insert(&shardline_example_photos::NewComment { photo_id: made[1].id, user_id: 3, body: "hi".into() })
        .await?;
    let err = comments.update(c.id, &[("photo_id", &made[0].id)]).await.unwrap_err();
    assert!(matches!(&err, Error::Invalid { what } if what.contains("comments.photo_id")), "{err}");
    let one = made[1].id;
    let err = cluster
        .transaction(cluster.route_id(one)?.shard, |tx| {
            Box::pin(async move { tx.update::<Photo>(one, &[("user_id", &2_i64)]).await })
        })
        .await
        .unwrap_err();
    assert!(matches!(&err, Error::Invalid { what } if what.contains("photos.user_id")), "{err}");
    assert_eq!(
        photos.get(made[1].id).await?.map(|p| (p.user_id, p.caption)),
        Some((made[1].user_id, "sunset".to_owned()))
    );
    assert!(matches!(
        photos.update(made[1].id, &[("id", &5i64)]).await,
        Err(Error::InvalidIdentifier { .. })
    ));
    assert!(matches!(
        photos.update(made[1].id, &[("nope", &5i64)]).await,
        Err(Error::InvalidIdentifier { .. })
    ));
    assert!(photos.delete(made[1].id).await?);
    assert!(!photos.delete(made[1].id).await?);
    assert_eq!(photos.get(made[1].id).await?, None);

    // An ID whose shard this cluster does not have: refused before any query.
    let foreign = cluster.layout().compose(1_700_000_000_000, 4000, 0)?;
    let err = photos.get(foreign).await.unwrap_err();
    assert!(matches!(err, Error::Router(_)), "{err:?}");
    assert_eq!(err.to_string(), "logical shard 4000 is out of range 0..12");
    Ok(())
}

shardline_testkit::register!(shared: a_users_pages_come_newest_first_by_keyset);
pub(crate) async fn a_users_pages_come_newest_first_by_keyset(ctx: TestContext) -> TestResult {
    let (_f, cluster) = cluster(&ctx, 2, 4, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let mut ids = Vec::new();
    for n in 0..25 {
        ids.push(photos.insert(&photo(42, n)).await?.id);
        photos.insert(&photo(46, n)).await?; // same shard (46 % 4 == 42 % 4), another user
    }
    ids.reverse();
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = photos.page_of_user(42, cursor, 10).await?;
        assert!(page.rows.iter().all(|p| p.user_id == 42));
        seen.extend(page.rows.iter().map(|p| p.id));
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    assert_eq!(seen, ids, "pages are newest first, complete, without repeats");
    // A page that ends exactly at the user's last row has no cursor: no empty call after
    // it (before, `next` was set whenever the page was full).
    let whole = photos.page_of_user(42, None, 25).await?;
    assert_eq!((whole.rows.len(), whole.next), (25, None), "all 25 rows, nothing after them");
    let all_but_one = photos.page_of_user(42, None, 24).await?;
    assert_eq!(all_but_one.next, Some(ids[23]), "one row is left below the page");
    let last_five = photos.page_of_user(42, Some(ids[19]), 5).await?;
    let got: Vec<_> = last_five.rows.iter().map(|p| p.id).collect();
    assert_eq!((got.as_slice(), last_five.next), (&ids[20..], None));
    Ok(())
}

shardline_testkit::register!(shared: a_stale_map_is_refreshed_not_obeyed);
pub(crate) async fn a_stale_map_is_refreshed_not_obeyed(ctx: TestContext) -> TestResult {
    let (f, stale) =
        cluster(&ctx, 2, 4, ClusterOptions { listen: false, ..ClusterOptions::default() }).await?;
    let listening = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let stale_tx =
        Cluster::connect(&f.config()?, ClusterOptions { listen: false, ..ClusterOptions::default() }).await?;
    let photos = stale.repo::<Photo>()?;
    let before = photos.insert(&photo(0, 0)).await?;
    assert_eq!(stale.route_user(0).host.as_str(), "pg1");

    // Move shard 0 from pg1 to pg2 by hand: copy it, drop it at the source, flip the map.
    let (pg1, pg2) = (f.client(&ctx, 0).await?, f.client(&ctx, 1).await?);
    let install = shardline_id::sql::ShardSql::new(stale.layout(), "shard_0000", 0)?.install();
    // With the function every read names, true on a shard's own copy (what `init`,
    // `migrate` and moves install beside the minter).
    let live = format!(
        "CREATE FUNCTION shard_0000.{}() RETURNS boolean LANGUAGE sql STABLE RETURN true",
        shardline_repo::LIVE_CHECK
    );
    pg2.batch_execute(&format!(
        "CREATE SCHEMA shard_0000; {install}; {live}; SET search_path TO shard_0000;
         CREATE TABLE photos (id bigint PRIMARY KEY DEFAULT next_id(), user_id bigint NOT NULL, url text NOT NULL, caption text NOT NULL DEFAULT '');
         RESET search_path"
    ))
    .await?;
    pg2.execute(
        "INSERT INTO shard_0000.photos VALUES ($1, $2, $3, $4)",
        &[&before.id, &before.user_id, &before.url, &before.caption],
    )
    .await?;
    pg1.batch_execute("DROP SCHEMA shard_0000 CASCADE").await?;
    pg1.execute("UPDATE shardline.shards SET host = 'pg2' WHERE shard = 0", &[]).await?;

    // The stale handle still routes to pg1; its statements find the shard gone there,
    // reload the map and run on pg2.
    assert_eq!(stale.map().version(), 1);
    let many = photos.get_many(&[before.id]).await?;
    assert_eq!((many.rows, many.missing), (vec![Some(before.clone())], vec![]));
    assert_eq!(stale.map().version(), 2);
    assert_eq!(photos.get(before.id).await?, Some(before.clone()));
    assert_eq!(stale.route_user(0).host.as_str(), "pg2");
    let after = photos.insert(&photo(4, 1)).await?;
    let n: i64 =
        pg2.query_one("SELECT count(*) FROM shard_0000.photos WHERE id = $1", &[&after.id]).await?.get(0);
    assert_eq!(n, 1);

    // A transaction of another stale handle: the shard found gone from pg1 by its BEGIN
    // (which looks the schema up), so the work runs once, on pg2. (Before the BEGIN
    // looked, it ran on pg1 first, was rolled back there, and ran again: two runs.)
    let shard0 = stale_tx.route_user(0).shard;
    assert_eq!(stale_tx.route(shard0)?.host.as_str(), "pg1");
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let (id, host) = stale_tx
        .transaction(shard0, |tx| {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Box::pin(async move {
                let p = tx.insert(&photo(8, 2)).await?;
                Ok::<_, Error>((p.id, tx.host().to_string()))
            })
        })
        .await?;
    assert_eq!((runs.into_inner(), host.as_str()), (1, "pg2"));
    let n: i64 = pg2.query_one("SELECT count(*) FROM shard_0000.photos WHERE id = $1", &[&id]).await?.get(0);
    assert_eq!(n, 1);
    // The listening handle hears the NOTIFY and reloads without any statement.
    let deadline = Instant::now() + Duration::from_secs(10);
    while listening.map().version() < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(listening.map().version(), 2);
    assert_eq!(listening.route_user(0).host.as_str(), "pg2");
    // The schema leaving in the middle of a transaction (dropped here after its first
    // statement, as a fence renames it): its next statement names a function that is
    // not found (42883), taken for a moved shard as a missing table is; rolled back,
    // and run again where the map now places the shard.
    let stale_mid =
        Cluster::connect(&f.config()?, ClusterOptions { listen: false, ..ClusterOptions::default() }).await?;
    pg1.batch_execute(&format!(
        "CREATE SCHEMA shard_0000; CREATE FUNCTION shard_0000.{}() RETURNS boolean LANGUAGE sql STABLE RETURN true",
        shardline_repo::LIVE_CHECK
    ))
    .await?;
    pg1.execute("UPDATE shardline.shards SET host = 'pg1' WHERE shard = 0", &[]).await?;
    stale_mid.refresh().await?;
    assert_eq!(stale_mid.route(shard0)?.host.as_str(), "pg1");
    pg1.execute("UPDATE shardline.shards SET host = 'pg2' WHERE shard = 0", &[]).await?;
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let pg1 = &pg1;
    let (id, host) = stale_mid
        .transaction(shard0, |tx| {
            let run = runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Box::pin(async move {
                if run == 0 {
                    tx.query("SELECT 1", &[]).await?;
                    pg1.batch_execute("DROP SCHEMA shard_0000 CASCADE")
                        .await
                        .map_err(|e| Error::Invalid { what: e.to_string() })?;
                }
                let id: i64 = tx.query("SELECT next_id()", &[]).await?[0].get(0);
                Ok::<_, Error>((id, tx.host().to_string()))
            })
        })
        .await?;
    assert_eq!((runs.into_inner(), host.as_str()), (2, "pg2"), "minted {id}");
    Ok(())
}

async fn fan_out_fixture(
    ctx: &TestContext,
) -> Result<(Fixture, Cluster, SystemTime), crate::bootstrap::BoxError> {
    let o = ClusterOptions { host_timeout: Duration::from_secs(1), ..ClusterOptions::default() };
    let (f, cluster) = cluster(ctx, 3, 9, o).await?;
    let start = SystemTime::now() - Duration::from_secs(1);
    let photos = cluster.repo::<Photo>()?;
    photos.insert_many(&(0..90).map(|i| photo(i, i)).collect::<Vec<_>>()).await?;
    Ok((f, cluster, start))
}

shardline_testkit::register!(shared: a_fan_out_merges_every_host_newest_first);
pub(crate) async fn a_fan_out_merges_every_host_newest_first(ctx: TestContext) -> TestResult {
    let (_f, cluster, start) = fan_out_fixture(&ctx).await?;
    let photos = cluster.repo::<Photo>()?;
    let now = SystemTime::now() + Duration::from_secs(1);
    let all = photos.created_between(start, now, 1000).await?;
    assert!(all.is_complete());
    assert_eq!(all.rows.len(), 90);
    assert!(all.rows.windows(2).all(|w| w[0].id > w[1].id), "newest first");
    let top = photos.created_between(start, now, 25).await?;
    assert_eq!(top.rows, all.rows[..25].to_vec(), "the limit keeps the newest");
    let none = photos
        .created_between(start - Duration::from_secs(3600), start - Duration::from_secs(1800), 10)
        .await?;
    assert!(none.rows.is_empty() && none.is_complete());
    // A window that ends before it begins is a mistake, said as one (before: no rows,
    // a count of 0, as if the window were empty).
    for r in [
        photos.created_between(now, start, 10).await.map(|f| f.rows.len()),
        photos.count_between(now, start).await.map(|c| usize::try_from(c.count).unwrap_or(usize::MAX)),
    ] {
        assert!(
            matches!(&r, Err(Error::Invalid { what }) if what.contains("ends") && what.contains("before it begins")),
            "{r:?}"
        );
    }
    Ok(())
}

shardline_testkit::register!(exclusive: a_fan_out_names_the_shards_of_a_dead_or_hung_host);
pub(crate) async fn a_fan_out_names_the_shards_of_a_dead_or_hung_host(ctx: TestContext) -> TestResult {
    let (_f, cluster, start) = fan_out_fixture(&ctx).await?;
    let photos = cluster.repo::<Photo>()?;
    let now = SystemTime::now() + Duration::from_secs(1);
    let pg3 = &ctx.hosts()[2];

    pg3.pause().await?;
    let t = Instant::now();
    let part = photos.created_between(start, now, 1000).await?;
    let took = t.elapsed();
    assert!(took < Duration::from_secs(4), "a hung host held the fan-out for {took:?}");
    assert_eq!(part.missing.len(), 1, "{:?}", part.missing);
    assert_eq!(
        (part.missing[0].host.as_str(), part.missing[0].shards.iter().map(|s| s.get()).collect::<Vec<_>>()),
        ("pg3", vec![6, 7, 8])
    );
    assert_eq!(part.rows.len(), 60, "the other hosts' rows are all there");
    assert!(part.rows.iter().all(|p| cluster.layout().decode(p.id).shard < 6));
    let err = photos.get(part.rows[0].id).await; // pg1/pg2 still answer
    assert!(err.is_ok());
    pg3.resume().await?;

    pg3.kill().await?;
    let part = photos.created_between(start, now, 1000).await?;
    assert_eq!(part.missing.iter().map(|m| m.host.as_str()).collect::<Vec<_>>(), ["pg3"]);
    assert_eq!(part.rows.len(), 60);
    let on_pg3 = cluster.layout().compose(1_700_000_000_000, 7, 0)?;
    let err = photos.get(on_pg3).await.unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    pg3.start().await?;
    Ok(())
}

shardline_testkit::register!(shared: insert_many_is_one_statement_per_host);
pub(crate) async fn insert_many_is_one_statement_per_host(ctx: TestContext) -> TestResult {
    // The last batch sends each host statements of 21,845 rows. Beside the other tests'
    // moves on the same servers (the mover's copy is the default since 2026-11-25), one
    // such statement went past the default 5 s `host_timeout` in 3 of 6 full runs on a
    // 2-core machine: this test is about statements, not latency, so it waits longer.
    let o = ClusterOptions { host_timeout: Duration::from_secs(30), ..ClusterOptions::default() };
    let (_f, cluster) = cluster(&ctx, 3, 12, o).await?;
    let (photos, comments) = (cluster.repo::<Photo>()?, cluster.repo::<Comment>()?);
    // One photo per shard (user u lives in shard u).
    let posted = photos.insert_many(&(0..12).map(|u| photo(u, u)).collect::<Vec<_>>()).await?;
    let new = |p: &Photo, body: &str| NewComment { photo_id: p.id, user_id: 99, body: body.to_owned() };
    let ok = comments
        .insert_many(&posted.iter().map(|p| new(p, &format!("on {}", p.id))).collect::<Vec<_>>())
        .await?;
    for (p, c) in posted.iter().zip(&ok) {
        assert_eq!(
            (c.photo_id, c.body.clone()),
            (p.id, format!("on {}", p.id)),
            "rows come back in the caller's order"
        );
        assert_eq!(
            cluster.layout().decode(c.id).shard,
            cluster.layout().decode(p.id).shard,
            "a comment lives beside its photo"
        );
    }

    // A batch whose comment in shard 5 breaks a CHECK: pg2 (shards 4..8) got one
    // statement, so none of pg2's rows are in; pg1's and pg3's are.
    let batch: Vec<NewComment> =
        posted.iter().map(|p| new(p, if p.user_id == 5 { "" } else { "second" })).collect();
    let err = comments.insert_many(&batch).await.unwrap_err();
    assert_eq!(err.sqlstate(), Some("23514"), "{err}");
    match &err {
        Error::InsertMany { committed, source, .. } => {
            assert_eq!(committed, &["pg1", "pg3"]);
            assert!(source.to_string().starts_with("host pg2"), "{source}");
        }
        other => panic!("expected InsertMany, got {other:?}"),
    }
    for p in &posted {
        let page = comments.page_of_parent(p.id, None, 10).await?;
        let expected = if (4..8).contains(&p.user_id) { 1 } else { 2 };
        assert_eq!(page.rows.len(), expected, "comments of the photo in shard {}", p.user_id);
        assert!(page.rows.windows(2).all(|w| w[0].id > w[1].id), "newest first");
    }

    // Past Postgres's 65,535 bind parameters per statement: split, still all in, in order.
    let many: Vec<NewPhoto> = (0..70_000).map(|i| photo(i % 12, i)).collect();
    let got = photos.insert_many(&many).await?;
    assert_eq!(got.len(), many.len());
    assert!(got.iter().zip(&many).all(|(g, n)| g.url == n.url && g.user_id == n.user_id));
    let distinct: std::collections::HashSet<Id> = got.iter().map(|p| p.id).collect();
    assert_eq!(distinct.len(), 70_000, "every ID distinct");
    Ok(())
}

shardline_testkit::register!(shared: a_transaction_commits_or_rolls_back_whole_in_one_shard);
pub(crate) async fn a_transaction_commits_or_rolls_back_whole_in_one_shard(ctx: TestContext) -> TestResult {
    let (_f, cluster) = cluster(&ctx, 2, 4, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let shard = cluster.route_user(6).shard;

    // Committed: a photo, a comment beside it, and the caller's own SQL (unqualified
    // names resolve in the shard's schema).
    let (p, c) = cluster
        .transaction(shard, |tx| {
            Box::pin(async move {
                let p = tx.insert(&photo(6, 1)).await?;
                let c = tx.insert(&NewComment { photo_id: p.id, user_id: 7, body: "first".into() }).await?;
                let n = tx.execute("UPDATE photos SET caption = 'edited' WHERE id = $1", &[&p.id]).await?;
                assert_eq!(n, 1);
                let rows = tx.query("SELECT current_schema()", &[]).await?;
                assert_eq!(rows[0].get::<_, String>(0), tx.schema().as_str());
                Ok::<_, Error>((p, c))
            })
        })
        .await?;
    assert_eq!(photos.get(p.id).await?.map(|p| p.caption), Some("edited".to_owned()));
    assert_eq!(cluster.repo::<Comment>()?.get(c.id).await?.map(|c| c.body), Some("first".to_owned()));

    // Rolled back: the closure's error comes back and nothing it did stays.
    let inserted = std::sync::Mutex::new(None);
    let err = cluster
        .transaction(shard, |tx| {
            let inserted = &inserted;
            Box::pin(async move {
                let id = tx.insert(&photo(6, 2)).await?.id;
                *inserted.lock().unwrap() = Some(id);
                tx.delete::<Photo>(p.id).await?;
                Err::<(), _>(Error::Invalid { what: "changed my mind".into() })
            })
        })
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "changed my mind");
    let inserted = inserted.into_inner()?.ok_or("the closure ran")?;
    assert_eq!(photos.get(inserted).await?, None);
    assert!(photos.get(p.id).await?.is_some());

    // A closure that ends the transaction itself is told so, never `Ok` as if it were
    // whole: a raw ROLLBACK (nothing of it stays), a raw COMMIT (what it applied stays) ...
    for (end, n, stays) in [("ROLLBACK", 3, false), ("COMMIT", 4, true)] {
        let inserted = std::sync::Mutex::new(None);
        let err = cluster
            .transaction(shard, |tx| {
                let inserted = &inserted;
                Box::pin(async move {
                    let id = tx.insert(&photo(6, n)).await?.id;
                    *inserted.lock().unwrap() = Some(id);
                    tx.execute(end, &[]).await?;
                    Ok::<_, Error>(id)
                })
            })
            .await
            .unwrap_err();
        assert!(matches!(err, Error::TransactionEnded { shard: s, .. } if s == shard), "{end}: {err:?}");
        assert!(err.outcome_unknown() && !err.is_retryable(), "{err:?}");
        let id = inserted.into_inner()?.ok_or("the closure ran")?;
        assert_eq!(photos.get(id).await?.is_some(), stays, "{end}");
    }
    // ... and a raw COMMIT followed by a statement that fails as a moved shard's would
    // (its unqualified table is missing without the transaction's search_path): the
    // closure is not run again, so what it committed is there once.
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let err = cluster
        .transaction(shard, |tx| {
            let runs = &runs;
            Box::pin(async move {
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tx.execute(
                    "INSERT INTO photos (user_id, url, caption) VALUES (6, 'u', 'committed by the closure')",
                    &[],
                )
                .await?;
                tx.execute("COMMIT", &[]).await?;
                tx.query("SELECT id FROM photos", &[]).await
            })
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::TransactionEnded { .. }), "{err:?}");
    assert_eq!(runs.into_inner(), 1);
    let page = photos.page_of_user(6, None, 100).await?;
    assert_eq!(page.rows.iter().filter(|p| p.caption == "committed by the closure").count(), 1);

    // A statement whose future the closure dropped unfinished (its own timeout) may
    // still run on the server: the transaction is given up, not committed with it, and
    // the row it was inserting is not stored. Before, `COMMIT` committed it, though the
    // closure took the statement for not done and returned `Ok`.
    let err = cluster
        .transaction(shard, |tx| {
            Box::pin(async move {
                let slow = tx.execute(
                    "INSERT INTO photos (user_id, url, caption) SELECT 6, 'u', 'dropped unfinished' FROM pg_sleep(0.5)",
                    &[],
                );
                let timed_out = tokio::time::timeout(Duration::from_millis(100), slow).await.is_err();
                assert!(timed_out, "the insert took under 100 ms");
                Ok::<_, Error>(())
            })
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::RolledBack { shard: s, .. } if s == shard), "{err:?}");
    // Even once the statement would have ended.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let page = photos.page_of_user(6, None, 100).await?;
    assert_eq!(page.rows.iter().filter(|p| p.caption == "dropped unfinished").count(), 0);

    // Rows and IDs of another shard are refused before anything is sent.
    let other = photos.insert(&photo(7, 1)).await?;
    let err = cluster
        .transaction(shard, |tx| Box::pin(async move { tx.insert(&photo(7, 3)).await }))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::WrongShard { shard, transaction, .. } if shard == 3 && transaction == 2),
        "{err:?}"
    );
    let err = cluster
        .transaction(shard, |tx| Box::pin(async move { tx.get::<Photo>(other.id).await }))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::WrongShard { what: "get", .. }), "{err:?}");

    // A transaction runs inside a spawned task (its future is Send).
    let c2 = cluster.clone();
    let id = p.id;
    let got = tokio::spawn(async move {
        c2.transaction(shard, |tx| Box::pin(async move { tx.get::<Photo>(id).await })).await
    })
    .await??;
    assert_eq!(got.map(|p| p.id), Some(p.id));
    Ok(())
}

shardline_testkit::register!(shared: a_kept_statement_is_prepared_again_once_its_table_changed);
/// With statements kept prepared, a migration that changes a column's type makes the
/// kept statement fail (0A000, "cached plan must not change result type") once, not
/// until its connection is recycled: the next call prepares it again.
pub(crate) async fn a_kept_statement_is_prepared_again_once_its_table_changed(
    ctx: TestContext,
) -> TestResult {
    let options = ClusterOptions { pool_size: 1, statement_cache: 64, ..ClusterOptions::default() };
    let (f, cluster) = cluster(&ctx, 2, 4, options).await?;
    let photos = cluster.repo::<Photo>()?;
    let p = photos.insert(&photo(1, 1)).await?;
    assert_eq!(photos.get(p.id).await?, Some(p.clone()));
    let route = cluster.route_id(p.id)?;
    let h = if route.host.as_str() == "pg1" { 0 } else { 1 };
    f.client(&ctx, h)
        .await?
        .batch_execute(&format!(
            "ALTER TABLE {}.photos ALTER COLUMN caption TYPE varchar(2000)",
            route.schema.quoted()
        ))
        .await?;
    let first = photos.get(p.id).await;
    if let Err(e) = &first {
        assert_eq!(e.sqlstate(), Some("0A000"), "{e}");
        assert!(!e.outcome_unknown());
    }
    for _ in 0..3 {
        assert_eq!(photos.get(p.id).await?, Some(p.clone()), "after the first call ({first:?})");
    }
    // A fan-out's kept statements (kept by default) meet the same change: no call
    // misses a shard for it, the first included (the piece is read again unnamed).
    let made = p.id.parts(cluster.layout()).unix_ms;
    let (start, end) = (made - 1000, made + 1000);
    let window = |a: i64, b: i64| {
        let at = |ms: i64| std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.unsigned_abs());
        photos.created_between(at(a), at(b), 10)
    };
    let w = window(start, end).await?;
    assert!(w.is_complete() && w.rows.len() == 1, "{:?}", w.missing);
    // Every shard of the host at once (a migration): the statement's result type
    // changes with them (one shard's alone would leave the union's type as it was).
    f.client(&ctx, h)
        .await?
        .batch_execute(
            "DO $$ DECLARE s name; BEGIN
                 FOR s IN SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                           WHERE c.relname = 'photos' AND n.nspname LIKE 'shard\\_%' LOOP
                     EXECUTE format('ALTER TABLE %I.photos ALTER COLUMN caption TYPE varchar(3000)', s);
                 END LOOP;
             END $$",
        )
        .await?;
    for call in 0..3 {
        let w = window(start, end).await?;
        assert!(w.is_complete(), "call {call} after the change: missing {:?}", w.missing);
        assert_eq!(w.rows.len(), 1, "call {call}");
    }
    Ok(())
}

shardline_testkit::register!(shared: for_each_shard_reaches_every_shard_once);
pub(crate) async fn for_each_shard_reaches_every_shard_once(ctx: TestContext) -> TestResult {
    let (_f, cluster) = cluster(&ctx, 3, 9, ClusterOptions::default()).await?;
    let results = cluster
        .for_each_shard(|tx| {
            Box::pin(async move {
                let shard = i64::from(tx.shard().get());
                tx.execute("INSERT INTO photos (user_id, url) VALUES ($1, 'marker')", &[&shard]).await?;
                if shard == 4 {
                    return Err(Error::Invalid { what: "shard 4 says no".into() });
                }
                Ok(shard)
            })
        })
        .await;
    let shards: Vec<u16> = results.iter().map(|(s, _)| s.get()).collect();
    assert_eq!(shards, (0..9).collect::<Vec<_>>(), "every shard once, in order");
    for (s, r) in &results {
        match r {
            Ok(v) => assert_eq!(*v, i64::from(s.get())),
            Err(e) => assert_eq!((s.get(), e.to_string().as_str()), (4, "shard 4 says no")),
        }
    }
    // What committed is where it should be: one marker per shard, none in shard 4.
    let counts = cluster
        .for_each_shard(|tx| {
            Box::pin(async move {
                let user = i64::from(tx.shard().get());
                let n: i64 =
                    tx.query("SELECT count(*) FROM photos WHERE user_id = $1", &[&user]).await?[0].get(0);
                Ok::<_, Error>(n)
            })
        })
        .await;
    let counts: Vec<i64> = counts.into_iter().map(|(_, r)| r).collect::<Result<_, _>>()?;
    assert_eq!(counts, vec![1, 1, 1, 1, 0, 1, 1, 1, 1]);

    // A few per host at once (pool_size / 2), also once the other hosts are done: here
    // pg3's shards are slow, so the tail of the work is all pg3's.
    let (_g, small) =
        self::cluster(&ctx, 3, 12, ClusterOptions { pool_size: 4, ..ClusterOptions::default() }).await?;
    let running: std::sync::Mutex<HashMap<String, (usize, usize)>> = std::sync::Mutex::default();
    let results = small
        .for_each_shard(|tx| {
            let running = &running;
            Box::pin(async move {
                let host = tx.host().to_string();
                {
                    let mut r = running.lock().unwrap();
                    let (now, most) = r.entry(host.clone()).or_default();
                    *now += 1;
                    *most = (*most).max(*now);
                }
                let slow = if host == "pg3" { 0.2 } else { 0.0 };
                let done = tx.execute("SELECT pg_sleep($1)", &[&slow]).await;
                running.lock().unwrap().entry(host).or_default().0 -= 1;
                done
            })
        })
        .await;
    assert!(results.iter().all(|(_, r)| r.is_ok()), "{results:?}");
    let most: Vec<(String, usize)> =
        running.into_inner()?.into_iter().map(|(h, (_, most))| (h, most)).collect();
    assert!(most.iter().all(|(_, m)| *m <= 2), "at most pool_size / 2 = 2 per host at once: {most:?}");
    Ok(())
}
