//! Network partitions: one link cut at a time ([`shardline_testkit::Link`]), the
//! application to a host, the application to the catalog, or a host's peers to it,
//! on both backends.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use shardline_example_photos::Photo;
use shardline_ops::moves::{self, MoveOptions, MoveProgress, State, Step};
use shardline_repo::{Cluster, ClusterOptions};
use shardline_router::Config;
use shardline_testkit::Link;
use shardline_testkit::harness::{TestContext, TestResult};

use crate::bootstrap::{BoxError, Fixture, options, quiet};
use crate::moves::{counts, host_index, leftovers, photo, seed};

/// A fixture of 3 hosts and 6 shards whose every link can be cut: the catalog's, the
/// application's to each host, and each host's peers' to it.
struct Linked {
    f: Fixture,
    catalog: Link,
    app: Vec<Link>,
    peers: Vec<Arc<Link>>,
}

async fn linked(ctx: &TestContext) -> Result<Linked, BoxError> {
    linked_on(ctx.cluster(), Fixture::new(ctx, 3, 6).await?).await
}

/// As [`linked`], on `kit`'s hosts, for fixture `f` there.
async fn linked_on(kit: &shardline_testkit::Cluster, f: Fixture) -> Result<Linked, BoxError> {
    let (mut app, mut peers) = (Vec::new(), Vec::new());
    for i in 0..3 {
        app.push(kit.link(i).await?);
        peers.push(Arc::new(kit.peer_link(i).await?));
    }
    let catalog = kit.link(0).await?;
    let peer_links: Vec<&Link> = peers.iter().map(|p| &**p).collect();
    f.write_config_through(&catalog, &app, &peer_links, 6)?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    Ok(Linked { f, catalog, app, peers })
}

/// Photos stored for `url` in `schema` on host `h`, read past every link.
async fn stored(l: &Linked, ctx: &TestContext, h: usize, schema: &str, url: &str) -> Result<i64, BoxError> {
    let c = l.f.client(ctx, h).await?;
    Ok(c.query_one(&format!("SELECT count(*) FROM {schema}.photos WHERE url = $1"), &[&url]).await?.get(0))
}

shardline_testkit::register!(shared: a_cut_link_to_one_host_fails_its_requests_in_time_and_the_rest_goes_on);
pub(crate) async fn a_cut_link_to_one_host_fails_its_requests_in_time_and_the_rest_goes_on(
    ctx: TestContext,
) -> TestResult {
    let l = linked(&ctx).await?;
    let timeout = Duration::from_secs(2);
    let cluster = Cluster::connect(
        &l.f.config()?,
        ClusterOptions { host_timeout: timeout, connect_timeout: timeout, ..ClusterOptions::default() },
    )
    .await?;
    let photos = cluster.repo::<Photo>()?;
    for user in 0..6 {
        photos.insert(&photo(user, 0)).await?;
    }
    let cut = cluster.route_user(1);
    let link = &l.app[host_index(cut.host.as_str())];
    link.cut();
    // A write to the cut host fails within the host timeout (and the pool's wait).
    let t = Instant::now();
    let lost = photo(1, 1);
    let err = photos.insert(&lost).await.expect_err("a write through a cut link succeeded");
    let took = t.elapsed();
    assert!(took < timeout * 2 + Duration::from_secs(2), "the write took {took:?} to fail: {err}");
    assert!(err.to_string().contains(cut.host.as_str()), "the error names {}: {err}", cut.host);
    let unknown = err.outcome_unknown();
    // A read too.
    let t = Instant::now();
    photos.page_of_user(1, None, 10).await.expect_err("a read through a cut link succeeded");
    assert!(t.elapsed() < timeout * 2 + Duration::from_secs(2), "the read took {:?}", t.elapsed());
    // The other hosts' users are served meanwhile, each at once.
    for user in (0..6).filter(|u| cluster.route_user(*u).host != cut.host) {
        let t = Instant::now();
        photos.insert(&photo(user, 1)).await.map_err(|e| format!("user {user} during the cut: {e}"))?;
        assert!(t.elapsed() < Duration::from_secs(3), "user {user}'s write took {:?}", t.elapsed());
    }
    assert!(link.is_cut());
    link.heal();
    // Once healed, the host is served again without restarting anything.
    let t = Instant::now();
    loop {
        match photos.insert(&photo(1, 2)).await {
            Ok(_) => break,
            Err(e) if t.elapsed() < Duration::from_secs(15) => {
                eprintln!("      after the heal: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(format!("still failing 15 s after the heal: {e}").into()),
        }
    }
    // The failed write: what it said is true. Not applied when it said so; at most once
    // when its outcome was unknown (its bytes, held by the cut, may arrive after the heal).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let h = host_index(cut.host.as_str());
    let n = stored(&l, &ctx, h, &cut.schema.quoted(), &lost.url).await?;
    assert!(
        n <= i64::from(unknown),
        "the failed write (outcome_unknown {unknown}) is stored {n} times: {err}"
    );
    eprintln!("      the cut write: outcome_unknown {unknown}, stored {n} time(s); {err}");
    Ok(())
}

shardline_testkit::register!(shared: a_cancel_held_by_a_cut_link_closes_the_connection_it_was_for);
/// An insert waits on a lock (another session, past every link, holds the shard's
/// table); once it waits, the application's link to its host is cut. The insert times
/// out, and its connection is given up on: its cancel is taken by the cut link and held,
/// so shardline cannot know whether, or when, the server will act on it. Once a second
/// cancel came (the first ran out of time), the link heals: the held cancel reaches the
/// server and the insert is cancelled, never applied. The connection is then closed, not
/// handed out again: the pool's next connection is another server session (before, the
/// same one came back, which a late cancel could reach in its next borrower's statement).
pub(crate) async fn a_cancel_held_by_a_cut_link_closes_the_connection_it_was_for(
    ctx: TestContext,
) -> TestResult {
    let l = linked(&ctx).await?;
    let o = ClusterOptions {
        pool_size: 1,
        host_timeout: Duration::from_millis(800),
        connect_timeout: Duration::from_secs(1),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::connect(&l.f.config()?, o).await?;
    let photos = cluster.repo::<Photo>()?;
    let route = cluster.route_user(1);
    let (h, link) = (host_index(route.host.as_str()), &l.app[host_index(route.host.as_str())]);
    photos.insert(&photo(1, 0)).await?;
    let pid = "SELECT pg_backend_pid()";
    let first: i32 = cluster.client(&route.host).await?.query_one(pid, &[]).await?.get(0);
    let side = l.f.client(&ctx, h).await?;
    side.batch_execute(&format!(
        "BEGIN; LOCK TABLE {}.photos IN ACCESS EXCLUSIVE MODE",
        route.schema.quoted()
    ))
    .await?;
    let watcher = l.f.client(&ctx, h).await?;
    let cut_once_waiting = async {
        let waiting = "SELECT count(*) FROM pg_stat_activity
                       WHERE datname = current_database() AND wait_event_type = 'Lock'";
        for _ in 0..200 {
            if watcher.query_one(waiting, &[]).await?.get::<_, i64>(0) > 0 {
                link.cut();
                return Ok::<_, BoxError>(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err("the insert never waited on the lock".into())
    };
    let lost = photo(1, 1);
    let (inserted, cut) = tokio::join!(photos.insert(&lost), cut_once_waiting);
    cut?;
    let err = inserted.expect_err("the insert waits on the lock past the timeout");
    assert!(err.is_timeout(), "{err}");
    // Heal once the link has taken a second cancel: the first ran out of time.
    let before = link.connections();
    let mut second = false;
    for _ in 0..200 {
        if link.connections() >= before + 2 {
            second = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    link.heal();
    assert!(second, "no second cancel came within 5 s (link connections: {})", link.connections() - before);
    // The pool's next connection: another session.
    let mut next = None;
    for _ in 0..100 {
        if let Ok(c) = cluster.client(&route.host).await {
            next = Some(c.query_one(pid, &[]).await?.get::<_, i32>(0));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let next = next.ok_or("no pooled connection to the host within 10 s of the heal")?;
    assert_ne!(next, first, "the connection a cancel may still reach was handed out again");
    side.batch_execute("COMMIT").await?;
    assert_eq!(
        stored(&l, &ctx, h, route.schema.as_str(), &lost.url).await?,
        0,
        "the insert given up on was applied"
    );
    Ok(())
}

shardline_testkit::register!(shared: a_catalog_cut_off_inside_the_fence_holds_the_shard_no_longer_than_hung_after);
/// The catalog's link is cut the moment the move journals `fenced` (from its progress
/// report, inside the step's own call): the mover's next write to the journal gets no
/// answer. It gives the step up after `hung_after` (2 s) and undoes the move on the
/// source, so a write to the shard sent right after the cut waits out the fence and
/// lands on the source within seconds, while the catalog is still cut off. (Before,
/// the mover waited on the catalog for as long as the cut lasted, renewing the fence's
/// lease all along: the write failed after `move_wait`, 15 s here.)
pub(crate) async fn a_catalog_cut_off_inside_the_fence_holds_the_shard_no_longer_than_hung_after(
    ctx: TestContext,
) -> TestResult {
    let Linked { f, catalog, app: _app, peers: _peers } = linked(&ctx).await?;
    let catalog = Arc::new(catalog);
    let config = f.config()?;
    let cluster = Cluster::connect(
        &config,
        ClusterOptions { move_wait: Duration::from_secs(15), ..ClusterOptions::default() },
    )
    .await?;
    let photos = cluster.repo::<Photo>()?;
    let first = photos.insert(&photo(0, 0)).await?;
    let from = cluster.route_user(0).host;
    let to = crate::host(if from.as_str() == "pg2" { "pg3" } else { "pg2" });
    let (mut opts, cut_at) = cut_at(Step::Fenced, &catalog);
    opts.hung_after = Duration::from_secs(2);
    let mover = async {
        let r = moves::run(&config, crate::shard(0), &to, &opts).await;
        (r, Instant::now())
    };
    let writer = write_once_cut(&cut_at, &catalog, &photos, "the move never journaled fenced");
    let ((moved, ended), written) =
        tokio::time::timeout(Duration::from_secs(120), async { tokio::join!(mover, writer) })
            .await
            .map_err(|_| "the move and the write did not end within 120 s")?;
    let (written, took) = written?;
    let written = written
        .map_err(|e| format!("a write to the shard while its mover could not reach the catalog: {e}"))?;
    assert!(took < Duration::from_secs(10), "the write waited {took:?} for the fence");
    let cut = *cut_at.get().ok_or("cut")?;
    let err = moved.expect_err("a move whose catalog was cut off inside the fence flipped");
    eprintln!("the mover gave up {:?} after the cut: {err}", ended.duration_since(cut));
    cluster.refresh().await?;
    assert_eq!(cluster.route_user(0).host, from, "the map still places the shard on its source");
    for id in [first.id, written.id] {
        assert_eq!(photos.get(id).await?.map(|p| p.id), Some(id));
    }
    // What the undo could not journal with the catalog cut off, `--abort` finishes.
    let journal = moves::list(&config).await?;
    if journal.iter().any(|m| m.state == State::Running) {
        moves::abort(&config, crate::shard(0), &MoveOptions::default()).await?;
    }
    let journal = moves::list(&config).await?;
    assert!(journal.iter().all(|m| m.state == State::RolledBack), "{journal:?}");
    moves::gc(&config, Duration::ZERO).await?;
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    Ok(())
}

shardline_testkit::register!(shared: a_catalog_cut_off_inside_the_flip_holds_the_map_no_longer_than_hung_after);
/// The mover's link to the catalog is cut inside the flip's transaction (from the
/// `on_flip` drill: the map's row and the journal's written, the commit not sent yet),
/// and stays cut. The source has decided to flip, so the shard is the target's: a write
/// through a handle whose own link to the catalog is whole finds the shard fenced and
/// completes the flip (`shardline.complete_flip`), which waits for the rows the cut
/// session holds. The catalog's server ends that session once it has been idle in its
/// transaction for `hung_after` (2 s), so the write lands on the target within seconds,
/// the cut still on. Once healed, the mover's next try makes the same flip again (it is
/// idempotent) and cleans up. (Before,
/// the cut session held the rows for as long as the cut lasted, and the mover waited on
/// its commit as long: the write failed with 42P01 after `move_wait`, 20 s here.)
pub(crate) async fn a_catalog_cut_off_inside_the_flip_holds_the_map_no_longer_than_hung_after(
    ctx: TestContext,
) -> TestResult {
    let Linked { f, catalog, app: _app, peers: _peers } = linked(&ctx).await?;
    let catalog = Arc::new(catalog);
    let config = f.config()?;
    // The application's way to the catalog: a link of its own, never cut.
    let own = ctx.cluster().link(0).await?;
    let text = f.config_text()?.replace(&catalog.url(f.db()), &own.url(f.db()));
    let app_config = f.config_from(&text)?;
    let cluster = Cluster::connect(
        &app_config,
        ClusterOptions { move_wait: Duration::from_secs(20), ..ClusterOptions::default() },
    )
    .await?;
    let photos = cluster.repo::<Photo>()?;
    let first = photos.insert(&photo(0, 0)).await?;
    let from = cluster.route_user(0).host;
    let to = crate::host(if from.as_str() == "pg2" { "pg3" } else { "pg2" });
    let cut_at = Arc::new(OnceLock::new());
    let mut opts = MoveOptions::default();
    opts.hung_after = Duration::from_secs(2);
    opts.sync_timeout = Duration::from_secs(60);
    let (link, at) = (catalog.clone(), cut_at.clone());
    opts.on_flip = Some(Arc::new(move || {
        let (link, at) = (link.clone(), at.clone());
        Box::pin(async move {
            // Once: a try of the flip after the heal goes through.
            if at.set(Instant::now()).is_ok() {
                link.cut();
            }
        })
    }));
    let mover = async { moves::run(&config, crate::shard(0), &to, &opts).await };
    let writer = write_once_cut(&cut_at, &catalog, &photos, "the move never reached the flip's transaction");
    let (moved, written) =
        tokio::time::timeout(Duration::from_secs(120), async { tokio::join!(mover, writer) })
            .await
            .map_err(|_| "the move and the write did not end within 120 s")?;
    let (written, took) = written?;
    let written =
        written.map_err(|e| format!("a write to the shard while its mover was cut off in the flip: {e}"))?;
    eprintln!("the write landed {took:?} after the cut");
    assert!(took < Duration::from_secs(10), "the write waited {took:?} for the cut-off flip");
    let report = moved.map_err(|e| format!("the mover, healed after a router completed its flip: {e}"))?;
    assert_eq!(report.target, to);
    cluster.refresh().await?;
    assert_eq!(cluster.route_user(0).host, to, "the map places the shard on its target");
    for id in [first.id, written.id] {
        assert_eq!(photos.get(id).await?.map(|p| p.id), Some(id));
    }
    let journal = moves::list(&config).await?;
    assert!(journal.iter().all(|m| m.state == State::Done), "{journal:?}");
    moves::gc(&config, Duration::ZERO).await?;
    Ok(())
}

shardline_testkit::register!(shared: with_the_catalog_link_cut_requests_go_on_and_a_move_fails_changing_nothing);
pub(crate) async fn with_the_catalog_link_cut_requests_go_on_and_a_move_fails_changing_nothing(
    ctx: TestContext,
) -> TestResult {
    let l = linked(&ctx).await?;
    let config = l.f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let before = cluster.map().version();
    let quick = Cluster::connect(
        &config,
        ClusterOptions {
            listen: false,
            host_timeout: Duration::from_secs(2),
            move_wait: Duration::from_secs(3),
            ..ClusterOptions::default()
        },
    )
    .await?;
    l.catalog.cut();
    let mut made = Vec::new();
    for user in 0..6 {
        let t = Instant::now();
        made.push(
            photos
                .insert(&photo(user, 0))
                .await
                .map_err(|e| format!("user {user} with the catalog cut off: {e}"))?,
        );
        assert!(t.elapsed() < Duration::from_secs(3), "user {user}'s write took {:?}", t.elapsed());
    }
    // A read that finds its shard's schema missing (renamed aside here, as a fence does)
    // asks the catalog whether the shard moved. The catalog does not answer: the read
    // fails within the handle's timeouts (a catalog read, a connect, move_wait), never
    // hangs on it.
    let route = cluster.route_user(0);
    let h = host_index(route.host.as_str());
    let admin = l.f.client(&ctx, h).await?;
    admin.batch_execute(&format!("ALTER SCHEMA {} RENAME TO aside", route.schema.quoted())).await?;
    let t = Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(40), quick.repo::<Photo>()?.get(made[0].id)).await;
    let took = t.elapsed();
    admin.batch_execute(&format!("ALTER SCHEMA aside RENAME TO {}", route.schema.quoted())).await?;
    let got =
        got.map_err(|_| "a read of a shard whose schema is missing hung on the cut catalog for 40 s")?;
    assert!(got.is_err(), "{got:?}");
    assert!(took < Duration::from_secs(12), "the read took {took:?} to fail: {got:?}");
    let from = cluster.route_user(0).host;
    let to = crate::host(if from.as_str() == "pg2" { "pg3" } else { "pg2" });
    let t = Instant::now();
    let err = moves::run(&config, crate::shard(0), &to, &MoveOptions::default())
        .await
        .expect_err("a move without its catalog succeeded");
    assert!(t.elapsed() < Duration::from_secs(30), "the move took {:?} to fail: {err}", t.elapsed());
    l.catalog.heal();
    let journal = moves::list(&config).await?;
    assert!(journal.is_empty(), "a move that never reached its catalog is journaled: {journal:?}");
    assert_eq!(cluster.refresh().await?, before, "the map changed");
    assert_eq!(cluster.route_user(0).host, from);
    // Healed, the same move goes through.
    moves::run(&config, crate::shard(0), &to, &MoveOptions::default()).await?;
    cluster.refresh().await?;
    assert_eq!(cluster.route_user(0).host, to);
    photos.insert(&photo(0, 1)).await?;
    Ok(())
}

shardline_testkit::register!(shared: while_no_listen_connection_can_be_made_the_map_check_goes_on);
/// The catalog's `LISTEN` connection (through a link of its own) ends, and no new one
/// can be made: the link is gone (connections are refused), or cut (connections are
/// accepted and never answered, so each attempt takes its whole connect timeout). A
/// map change then reaches the handle through the map check, within about `map_check`
/// (500 ms) and a second: the check goes on while an attempt hangs. (Before, a hanging
/// attempt held the check for its connect timeout and more: the cut case failed.)
pub(crate) async fn while_no_listen_connection_can_be_made_the_map_check_goes_on(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    for (shard, hang) in [(0, false), (1, true)] {
        let link = ctx.cluster().link(0).await?;
        let text = f.config_text()?.replacen(
            "[catalog]\n",
            &format!("[catalog]\nlisten_url = \"{}\"\n", link.url(f.db())),
            1,
        );
        let config = f.config_from(&text)?;
        let check = Duration::from_millis(500);
        let cluster =
            Cluster::connect(&config, ClusterOptions { map_check: check, ..ClusterOptions::default() })
                .await?;
        let version = cluster.map().version();
        let link = if hang {
            link.cut();
            link.sever();
            Some(link)
        } else {
            link.sever();
            drop(link);
            None
        };
        f.client(&ctx, 0)
            .await?
            .execute("UPDATE shardline.shards SET host = 'pg2' WHERE shard = $1", &[&shard])
            .await?;
        let changed = Instant::now();
        while cluster.map().version() <= version {
            assert!(
                changed.elapsed() < Duration::from_secs(4),
                "the map check stopped with the listener (its new connections {})",
                if hang { "hang" } else { "are refused" }
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        eprintln!(
            "observed: a change caught {:?} after it was made, the listener down ({})",
            changed.elapsed(),
            if hang { "its link cut" } else { "its link gone" }
        );
        drop(link);
    }
    Ok(())
}

/// A cluster of its own (3 hosts), linked as [`linked`] links the shared one, a handle
/// on it, and shard 0 holding 2,000 photos with a like and a comment each.
async fn seeded_on_own(db: &str) -> Result<(shardline_testkit::Cluster, Linked, Config, Cluster), BoxError> {
    let kit = shardline_testkit::Cluster::start(3).await?;
    let f = Fixture::on_kit(&kit, db, 6).await?;
    let l = linked_on(&kit, f).await?;
    let config = l.f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 100).await?;
    Ok((kit, l, config, cluster))
}

/// Once `cut_at` is set (the link cut, `never` said if that takes a minute), inserts a
/// photo of user 0 within 40 s, then heals `link`: the write's outcome is the one
/// reached with the link cut. Returns it and how long it took.
async fn write_once_cut(
    cut_at: &OnceLock<Instant>,
    link: &Link,
    photos: &shardline_repo::Repo<Photo>,
    never: &str,
) -> Result<(Result<Photo, shardline_repo::Error>, Duration), BoxError> {
    let waited = Instant::now();
    while cut_at.get().is_none() {
        if waited.elapsed() > Duration::from_secs(60) {
            return Err(never.into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let t = Instant::now();
    let written = tokio::time::timeout(Duration::from_secs(40), photos.insert(&photo(0, 1))).await;
    let took = t.elapsed();
    link.heal();
    let written = written.map_err(|_| "the write hung for 40 s")?;
    Ok((written, took))
}

/// Cuts `link` when a move reports `step` done, so the cut lands inside the next step;
/// the cell gets the moment of the cut.
fn cut_at(step: Step, link: &Arc<Link>) -> (MoveOptions, Arc<OnceLock<Instant>>) {
    let (link, at) = (link.clone(), Arc::new(OnceLock::new()));
    let cut = at.clone();
    let mut o = MoveOptions::default();
    o.progress = Some(Arc::new(move |p: &MoveProgress| {
        if matches!(p, MoveProgress::Step { step: s, .. } if *s == step) {
            link.cut();
            let _ = cut.set(Instant::now());
        }
    }));
    (o, at)
}

// Hosts of its own: a subscription statement waiting on the cut link holds
// `pg_subscription`, a table every database of the server shares, and other tests' moves
// on the same server would wait behind it (see docs/moves.md).
shardline_testkit::register!(own: a_peer_link_cut_during_the_copy_holds_the_move_and_the_heal_lets_it_finish);
pub(crate) async fn a_peer_link_cut_during_the_copy_holds_the_move_and_the_heal_lets_it_finish(
    _ctx: TestContext,
) -> TestResult {
    let (kit, l, config, cluster) = seeded_on_own("peer_cut_during").await?;
    let ctx = &kit;
    let (f, peers) = (&l.f, &l.peers);
    let from = cluster.route_user(0).host;
    let to = crate::host(if from.as_str() == "pg2" { "pg3" } else { "pg2" });
    // The source's peers lose it as the copy starts; the heal comes 3 s later.
    let link = peers[host_index(from.as_str())].clone();
    let (opts, cut) = cut_at(Step::Prepared, &link);
    // The table-sync copy: the one that reads the rows over the peer link.
    let opts = opts.subscription_copy();
    let healer = {
        let link = link.clone();
        tokio::spawn(async move {
            while !link.is_cut() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_secs(3)).await;
            link.heal();
        })
    };
    let t = Instant::now();
    let report = moves::run(&config, crate::shard(0), &to, &opts).await;
    healer.abort();
    let report = report?;
    assert!(cut.get().is_some(), "the cut never happened");
    assert!(link.connections() > 0, "the target never reached the source through its peer link");
    eprintln!("      moved {} rows in {:?}, the peer link cut for 3 s of it", report.rows, t.elapsed());
    assert_eq!(counts(f, ctx, host_index(to.as_str()), "shard_0000").await?, Some([2000, 2000, 2000]));
    crate::bootstrap::cli(f, &["gc", "--grace", "0s"]).await?;
    assert_eq!(counts(f, ctx, host_index(from.as_str()), "shard_0000").await?, None);
    assert_eq!(leftovers(f, ctx).await?, vec![0, 0, 0]);
    kit.shutdown().await?;
    Ok(())
}

// Hosts of its own: a subscription statement waiting on the cut link holds
// `pg_subscription`, a table every database of the server shares, and other tests' moves
// on the same server would wait behind it (see docs/moves.md).
shardline_testkit::register!(own: a_peer_link_cut_past_the_moves_timeouts_fails_it_in_time_and_it_is_undone_whole);
pub(crate) async fn a_peer_link_cut_past_the_moves_timeouts_fails_it_in_time_and_it_is_undone_whole(
    _ctx: TestContext,
) -> TestResult {
    let (kit, l, config, cluster) = seeded_on_own("peer_cut_past").await?;
    let ctx = &kit;
    let (f, peers) = (&l.f, &l.peers);
    let mut expected = [2000, 2000, 2000];
    // Cut as the subscription is about to be made (the target's connection to the
    // source never starts), and once it streams (the copy under way).
    for step in [Step::Prepared, Step::Copying] {
        cluster.refresh().await?;
        let from = cluster.route_user(0).host;
        let to = crate::host(if from.as_str() == "pg2" { "pg3" } else { "pg2" });
        let link = peers[host_index(from.as_str())].clone();
        let (mut opts, cut) = cut_at(step, &link);
        opts.copy_timeout = Duration::from_secs(5);
        let err = moves::run(&config, crate::shard(0), &to, &opts)
            .await
            .expect_err("a move copied through a cut link");
        let took = cut
            .get()
            .ok_or_else(|| format!("cut after {}: the cut never happened", step.as_str()))?
            .elapsed();
        // From the cut: the copy's timeout, or the bound on a statement that connects to
        // the source (subscription::PEER_TIMEOUT, 15 s), with room for a busy machine.
        assert!(
            took < Duration::from_secs(30),
            "cut after {}: the move failed {took:?} after the cut: {err}",
            step.as_str()
        );
        eprintln!("      cut after {}: failed {took:?} after the cut: {err}", step.as_str());
        // Undone while the link is still cut, then healed.
        let last = moves::list(&config).await?.into_iter().max_by_key(|m| m.id).ok_or("no move journaled")?;
        if last.state == State::Running {
            let t = Instant::now();
            moves::abort(&config, crate::shard(0), &MoveOptions::default()).await?;
            assert!(t.elapsed() < Duration::from_secs(30), "the abort took {:?}", t.elapsed());
        }
        link.heal();
        let last = moves::list(&config).await?.into_iter().max_by_key(|m| m.id).ok_or("no move journaled")?;
        assert_eq!(last.state, State::RolledBack, "cut after {}", step.as_str());
        crate::bootstrap::cli(f, &["gc", "--grace", "0s"]).await?;
        cluster.refresh().await?;
        assert_eq!(cluster.route_user(0).host, from, "the shard left its source");
        assert_eq!(counts(f, ctx, host_index(from.as_str()), "shard_0000").await?, Some(expected));
        assert_eq!(counts(f, ctx, host_index(to.as_str()), "shard_0000").await?, None);
        assert_eq!(leftovers(f, ctx).await?, vec![0, 0, 0], "cut after {}", step.as_str());
        cluster.repo::<Photo>()?.insert(&photo(0, 5000)).await?;
        expected[0] += 1;
    }
    // Healed, the move goes through.
    let from = cluster.route_user(0).host;
    let to = crate::host(if from.as_str() == "pg2" { "pg3" } else { "pg2" });
    moves::run(&config, crate::shard(0), &to, &MoveOptions::default()).await?;
    assert_eq!(counts(f, ctx, host_index(to.as_str()), "shard_0000").await?, Some(expected));
    kit.shutdown().await?;
    Ok(())
}
