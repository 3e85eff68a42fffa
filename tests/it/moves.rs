//! Moving a shard: the pre-flight lists every problem and changes nothing; a move
//! copies, fences, verifies and flips while writes go on; a move stopped after any step
//! is resumed or undone; hosts dying mid-move leave nothing two-headed or orphaned.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use shardline_example_photos::{Comment, Like, NewComment, NewLike, NewPhoto, Photo};
use shardline_id::Id;
use shardline_ops::Error as OpsError;
use shardline_ops::moves::{self, MoveOptions, State, Step, preflight};
use shardline_repo::{Catalog, Cluster, ClusterOptions};
use shardline_router::config::DbUrl;
use shardline_testkit::harness::{TestContext, TestResult};

use crate::bootstrap::{BoxError, Fixture, Hosts, cli, cli_at, cli_full, options, quiet};

/// Subscriptions, slots and publications of this test's database, and what moves'
/// change logs left (trigger functions, triggers, logged rows), per host.
pub(crate) async fn leftovers(f: &Fixture, ctx: &impl Hosts) -> Result<Vec<i64>, BoxError> {
    let mut out = Vec::new();
    for h in 0..3 {
        let c = f.client(ctx, h).await?;
        let row = c
            .query_one(
                "SELECT (SELECT count(*) FROM pg_subscription s JOIN pg_database d ON d.oid = s.subdbid
                          WHERE d.datname = current_database())
                      + (SELECT count(*) FROM pg_replication_slots WHERE database = current_database())
                      + (SELECT count(*) FROM pg_publication)
                      + (SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                          WHERE n.nspname = 'shardline' AND p.proname LIKE 'move\\_%')
                      + (SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'shardline\\_move\\_%')",
                &[],
            )
            .await?;
        let logged: i64 = c
            .query_one(
                "SELECT CASE WHEN to_regclass('shardline.move_changes') IS NULL THEN 0
                        ELSE (xpath('/row/n/text()', query_to_xml('SELECT count(*) AS n FROM shardline.move_changes', false, true, '')))[1]::text::bigint END",
                &[],
            )
            .await?
            .get(0);
        out.push(row.get::<_, i64>(0) + logged);
    }
    Ok(out)
}

shardline_testkit::register!(shared: a_journal_row_naming_no_possible_shard_is_an_error_naming_the_move);
pub(crate) async fn a_journal_row_naming_no_possible_shard_is_an_error_naming_the_move(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    // The journal's one decoding turns its integer into a shard: a value no cluster can
    // have is an error naming the move, not a panic and not a wrong shard.
    let id: i64 = f
        .client(&ctx, 0)
        .await?
        .query_one(
            "INSERT INTO shardline.moves (shard, source, target, step, state)
             VALUES (9000, 'pg1', 'pg2', 'started', 'failed') RETURNING id",
            &[],
        )
        .await?
        .get(0);
    let err = moves::list(&config).await.unwrap_err();
    assert!(matches!(&err, OpsError::Journal { id: i, .. } if *i == id), "{err:?}");
    assert_eq!(err.to_string(), format!("move {id}: logical shard 9000 is out of range 0..8192"));
    let said = cli(&f, &["moves"]).await.unwrap_err();
    assert!(said.contains(&format!("move {id}: logical shard 9000 is out of range 0..8192")), "{said}");
    // A name the mover would put into SQL (its publication's, say) that is not one it
    // makes: refused where the journal is read, before `gc` or a resume runs anything.
    let catalog = f.client(&ctx, 0).await?;
    catalog.execute("DELETE FROM shardline.moves WHERE id = $1", &[&id]).await?;
    let id: i64 = catalog
        .query_one(
            r#"INSERT INTO shardline.moves (shard, source, target, step, state, detail)
               VALUES (1, 'pg1', 'pg2', 'started', 'failed',
                       '{"name": "x; DROP SCHEMA shardline CASCADE; --"}') RETURNING id"#,
            &[],
        )
        .await?
        .get(0);
    let err = moves::list(&config).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "move {id}: its detail's name \"x; DROP SCHEMA shardline CASCADE; --\" is not a name shardline makes: it may hold only lowercase ASCII letters, digits and underscores"
        )
    );
    let said = cli(&f, &["gc", "--grace", "0s"]).await.unwrap_err();
    assert!(said.contains(&format!("move {id}: its detail's name")), "{said}");
    let left: i64 = catalog.query_one("SELECT count(*) FROM shardline.moves", &[]).await?.get(0);
    assert_eq!(left, 1);
    Ok(())
}

shardline_testkit::register!(shared: a_moves_preflight_lists_every_problem_and_changes_nothing);
pub(crate) async fn a_moves_preflight_lists_every_problem_and_changes_nothing(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;

    // A healthy cluster: the move can go ahead; the target reached the source.
    let ok = preflight(&config, crate::shard(0), &crate::host("pg2")).await?;
    assert!(ok.is_ok(), "{ok}");
    assert_eq!((ok.source.as_str(), ok.target.as_str(), ok.schema.as_str()), ("pg1", "pg2", "shard_0000"));
    assert!(ok.bytes > 0);
    let said = cli(&f, &["move", "0", "--to", "pg2", "--dry-run"]).await?;
    assert!(said.ends_with("pre-flight: ok\n"), "{said}");
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0], "the reachability probe left nothing behind");

    // Break seven things at once.
    let (pg1, pg2) = (f.client(&ctx, 0).await?, f.client(&ctx, 1).await?);
    pg1.batch_execute("CREATE TABLE shard_0000.audit (at timestamptz, what text)").await?;
    // A replica identity whose index was dropped (as none), and an unlogged table
    // (left out of a publication without a word: its writes during a move lost).
    pg1.batch_execute(
        "CREATE TABLE shard_0000.keyed (k text NOT NULL);
         CREATE UNIQUE INDEX keyed_k ON shard_0000.keyed (k);
         ALTER TABLE shard_0000.keyed REPLICA IDENTITY USING INDEX keyed_k;
         DROP INDEX shard_0000.keyed_k;
         CREATE UNLOGGED TABLE shard_0000.scratch (id bigint PRIMARY KEY);",
    )
    .await?;
    pg2.batch_execute("CREATE SCHEMA shard_0000").await?;
    pg1.execute(
        "INSERT INTO shardline.moves (shard, source, target, step, state) VALUES (0, 'pg1', 'pg3', 'copy', 'running')",
        &[],
    )
    .await?;
    f.migration("0005_tags.sql", "CREATE TABLE tags (id bigint PRIMARY KEY DEFAULT next_id(), tag text);")?;
    let bad = preflight(&f.config()?, crate::shard(0), &crate::host("pg2")).await?;
    let found: Vec<(Option<&str>, &str)> =
        bad.problems.iter().map(|p| (p.host.as_ref().map(|h| h.as_str()), p.check)).collect();
    assert_eq!(
        found,
        vec![
            (None, "journal"),
            (Some("pg1"), "replica identity"),
            (Some("pg1"), "replica identity"),
            (Some("pg1"), "unlogged table"),
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
    assert!(text.contains("pg1: replica identity: shard_0000.keyed has no primary key"), "{text}");
    assert!(text.contains("pg1: unlogged table: shard_0000.scratch is unlogged"), "{text}");
    assert!(text.contains("missing or changed: [0005_tags.sql]"), "{text}");
    assert!(text.contains("pg2: schema: shard_0000 is already there"), "{text}");
    let (out, err) = cli_full(&f, &["move", "0", "--to", "pg2", "--dry-run"]).await;
    assert_eq!(err.unwrap_err(), "pre-flight found 6 problem(s); nothing was changed");
    assert!(out.contains("pre-flight: 6 problem(s):"), "{out}");

    // The target itself: unknown, or where the shard already is.
    let unknown = preflight(&f.config()?, crate::shard(0), &crate::host("pg9")).await?;
    assert_eq!(
        unknown.problems[0].to_string(),
        "target: pg9 is not a host of this cluster: neither the config nor the catalog has it (hosts: pg1, pg2, pg3)"
    );
    let same = preflight(&f.config()?, crate::shard(0), &crate::host("pg1")).await?;
    assert!(same.problems.iter().any(|p| p.to_string() == "target: shard 0 is already on pg1"), "{same}");
    // An out-of-range shard is an error, not a problem list.
    let err = preflight(&f.config()?, crate::shard(6), &crate::host("pg2")).await.unwrap_err().to_string();
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
    let cut = preflight(&f.config()?, crate::shard(2), &crate::host("pg1")).await?;
    assert!(cut.is_ok(), "pg1's peer URL only matters when pg1 is the source: {cut}");
    let cut = preflight(&f.config()?, crate::shard(1), &crate::host("pg3")).await?;
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

/// Runs a move of `shard` to `to` that stops after `step`: it stays running there.
async fn stopped_after(
    config: &shardline_router::Config,
    shard: u16,
    to: &str,
    step: Step,
) -> Result<(), BoxError> {
    stopped_with(config, shard, to, MoveOptions::default().stopping_after(step)).await
}

/// [`stopped_after`] with these options (their `stop_after` set).
async fn stopped_with(
    config: &shardline_router::Config,
    shard: u16,
    to: &str,
    options: MoveOptions,
) -> Result<(), BoxError> {
    let step = options.stop_after.ok_or("options that stop after a step")?;
    match moves::run(config, crate::shard(shard), &crate::host(to), &options).await {
        Err(OpsError::Interrupted { step: s, .. }) if s == step => Ok(()),
        Err(e) => Err(e.into()),
        Ok(report) => Err(format!("the move did not stop after {step:?}: {report}").into()),
    }
}

/// What a session that edits a move's copy by hand before its flip runs first: the
/// copy's guard (`shardline_repo::REVERT_GUARD`) does not fire in `replica` mode (the
/// change log's triggers, enabled `ALWAYS`, still do).
const REPLICA: &str = "SET session_replication_role = replica";

pub(crate) fn photo(user_id: i64, n: usize) -> NewPhoto {
    NewPhoto { user_id, url: format!("https://cdn/{user_id}/{n}.jpg"), caption: String::new() }
}

/// Fills shard `shard` (of `count`): `per_user` photos for each of 20 users, a like and
/// a comment on each. Returns the photos.
pub(crate) async fn seed(
    cluster: &Cluster,
    shard: i64,
    count: i64,
    per_user: usize,
) -> Result<Vec<Photo>, BoxError> {
    let new: Vec<NewPhoto> =
        (0..20).flat_map(|u| (0..per_user).map(move |i| photo(shard + u * count, i))).collect();
    let made = cluster.repo::<Photo>()?.insert_many(&new).await?;
    let likes: Vec<NewLike> =
        made.iter().map(|p| NewLike { photo_id: p.id, user_id: p.user_id + 1 }).collect();
    cluster.repo::<Like>()?.insert_many(&likes).await?;
    let comments: Vec<NewComment> = made
        .iter()
        .map(|p| NewComment { photo_id: p.id, user_id: 7, body: format!("nice {}", p.id) })
        .collect();
    cluster.repo::<Comment>()?.insert_many(&comments).await?;
    Ok(made)
}

/// Rows of photos, likes and comments in `schema` on host `h`; `None` without the schema.
pub(crate) async fn counts(
    f: &Fixture,
    ctx: &impl Hosts,
    h: usize,
    schema: &str,
) -> Result<Option<[i64; 3]>, BoxError> {
    let c = f.client(ctx, h).await?;
    let exists: bool =
        c.query_one("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", &[&schema]).await?.get(0);
    if !exists {
        return Ok(None);
    }
    let row = c
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM \"{schema}\".photos), (SELECT count(*) FROM \"{schema}\".likes),
                        (SELECT count(*) FROM \"{schema}\".comments)"
            ),
            &[],
        )
        .await?;
    Ok(Some([row.get(0), row.get(1), row.get(2)]))
}

/// On host `h`'s `shard_0000.photos`: how many of `acked` are there, how many rows in
/// all, how many distinct IDs.
pub(crate) async fn acked_on(
    f: &Fixture,
    ctx: &TestContext,
    h: usize,
    acked: &[Id],
) -> Result<(i64, i64, i64), BoxError> {
    let ids: Vec<i64> = acked.iter().map(|&i| i64::from(i)).collect();
    let row = f
        .client(ctx, h)
        .await?
        .query_one(
            "SELECT count(*) FILTER (WHERE id = ANY($1)), count(*), count(DISTINCT id) FROM shard_0000.photos",
            &[&ids],
        )
        .await?;
    Ok((row.get(0), row.get(1), row.get(2)))
}

pub(crate) fn host_index(name: &str) -> usize {
    match name {
        "pg1" => 0,
        "pg2" => 1,
        _ => 2,
    }
}

shardline_testkit::register!(shared: a_shard_moves_online_verified_with_its_ids_growing);
pub(crate) async fn a_shard_moves_online_verified_with_its_ids_growing(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    // The stale handle keeps its statements prepared: its get, cached on the source
    // before the move, meets the renamed schema there after it.
    let stale = Cluster::connect(
        &config,
        ClusterOptions { listen: false, statement_cache: 1024, ..ClusterOptions::default() },
    )
    .await?;
    // Two more stale handles, for shard transactions whose first statement that needs the
    // shard's schema names a function (42883 there once the schema is gone) or a type
    // (42704), not a table.
    let deaf = || Cluster::connect(&config, ClusterOptions { listen: false, ..ClusterOptions::default() });
    let (stale_fn, stale_type) = (deaf().await?, deaf().await?);
    let made = seed(&cluster, 0, 6, 5).await?;
    seed(&cluster, 1, 6, 2).await?;
    for _ in 0..6 {
        assert_eq!(stale.repo::<Photo>()?.get(made[0].id).await?, Some(made[0].clone()));
    }
    let before_max = made.iter().map(|p| p.id).max().ok_or("photos")?;
    let shard1_before = counts(&f, &ctx, 0, "shard_0001").await?;

    let report = moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default()).await?;
    assert_eq!(
        (report.source.as_str(), report.target.as_str(), report.rows),
        ("pg1", "pg2", 300),
        "{report}"
    );
    assert_eq!(report.tables.len(), 3);
    assert!(report.tables.iter().all(|t| t.matches && t.source_rows == 100), "{report}");
    let moved = format!("shard_0000_moved_{}", report.id);

    // The data: on the target; the source's copy renamed (fenced), the other shard
    // on the source untouched.
    assert_eq!(counts(&f, &ctx, 1, "shard_0000").await?, Some([100, 100, 100]));
    assert_eq!(counts(&f, &ctx, 0, "shard_0000").await?, None);
    assert_eq!(counts(&f, &ctx, 0, &moved).await?, Some([100, 100, 100]));
    assert_eq!(counts(&f, &ctx, 0, "shard_0001").await?, shard1_before);

    // A stale handle's shard transaction that names a function or a type finds the
    // schema gone on the source (its BEGIN looks it up) and runs on the target. (The
    // schema leaving in the middle of one, where such a name is what finds it gone:
    // `repo::a_stale_map_is_refreshed_not_obeyed`.)
    let shard0 = crate::shard(0);
    let minted = stale_fn
        .transaction(shard0, |tx| {
            Box::pin(async move {
                let id: i64 = tx.query("SELECT next_id()", &[]).await?[0].get(0);
                Ok::<_, shardline_repo::Error>((id, tx.host().to_string()))
            })
        })
        .await?;
    assert_eq!(minted.1, "pg2", "the transaction ran again on the target");
    let typed = stale_type
        .transaction(shard0, |tx| {
            Box::pin(async move {
                let n: i64 =
                    tx.query("SELECT count(*) FROM (SELECT NULL::photos) AS t", &[]).await?[0].get(0);
                Ok::<_, shardline_repo::Error>((n, tx.host().to_string()))
            })
        })
        .await?;
    assert_eq!(typed, (1, "pg2".to_owned()), "the transaction ran again on the target");

    // The listening handle hears the flip; the stale one finds out by trying.
    let deadline = Instant::now() + Duration::from_secs(10);
    while cluster.route_user(0).host.as_str() != "pg2" && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cluster.route_user(0).host.as_str(), "pg2");
    assert_eq!(stale.route_user(0).host.as_str(), "pg1");
    assert_eq!(stale.repo::<Photo>()?.get(made[0].id).await?, Some(made[0].clone()));
    // Not read from the source's renamed copy: the kept statement failed there, and the
    // handle learnt the new map.
    assert_eq!(stale.route_user(0).host.as_str(), "pg2", "the cached get followed the move");
    let after = stale.repo::<Photo>()?.insert(&photo(0, 99)).await?;
    assert_eq!(stale.route_user(0).host.as_str(), "pg2");
    assert!(
        after.id > before_max,
        "an ID minted after the move ({}) is above those before ({before_max})",
        after.id
    );
    assert_eq!(counts(&f, &ctx, 1, "shard_0000").await?, Some([101, 100, 100]));
    // The target's sequence starts above every ID the source minted, whatever the table.
    let pg1 = f.client(&ctx, 0).await?;
    let source_max: i64 = pg1
        .query_one(
            &format!(
                "SELECT greatest((SELECT max(id) FROM {moved}.photos), (SELECT max(id) FROM {moved}.likes),
                                 (SELECT max(id) FROM {moved}.comments))"
            ),
            &[],
        )
        .await?
        .get(0);
    let next: i64 = f.client(&ctx, 1).await?.query_one("SELECT shard_0000.next_id()", &[]).await?.get(0);
    assert!(next > source_max && next > i64::from(after.id));

    // The journal, the CLI's view of it, and nothing left replicating.
    let list = moves::list(&config).await?;
    assert_eq!(list.len(), 1);
    assert_eq!((list[0].state, list[0].step), (State::Done, Step::Cleaned));
    assert!(list[0].detail.pause_ms.is_some() && list[0].detail.copy_ms.is_some());
    assert_eq!(list[0].detail.copy_restarts, 0, "a copy nothing broke is never started over");
    let json: serde_json::Value = serde_json::from_str(&cli(&f, &["moves", "--json"]).await?)?;
    assert_eq!(json[0]["state"], "done");
    assert_eq!(json[0]["detail"]["rows"], 300);
    // A shard is a number and a host a string in the JSON, as when they were plain values.
    assert_eq!(json[0]["shard"], 0);
    assert_eq!((json[0]["source"].as_str(), json[0]["target"].as_str()), (Some("pg1"), Some("pg2")));
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);

    // gc keeps the old schema through its grace period, then drops it with its ledger.
    let kept = moves::gc(&config, Duration::from_secs(3600)).await?;
    assert_eq!(kept.kept, vec![format!("pg1: schema {moved}")], "{kept}");
    let said = cli(&f, &["gc", "--grace", "0s"]).await?;
    assert!(said.contains(&format!("dropped pg1: schema {moved}")), "{said}");
    assert_eq!(counts(&f, &ctx, 0, &moved).await?, None);
    let ledger: i64 = pg1
        .query_one("SELECT count(*) FROM shardline.shard_migrations WHERE schema_name = $1", &[&moved])
        .await?
        .get(0);
    assert_eq!(ledger, 0);
    // The cluster stays consistent for migrate, and the shard can move back.
    assert!(!shardline_ops::migrate(&config, &options(1), &quiet).await?.changed());
    let back = cli(&f, &["move", "0", "--to", "pg1"]).await?;
    assert!(back.contains("moved shard 0 (shard_0000) pg2 -> pg1") && back.contains("rows: 301"), "{back}");
    assert_eq!(counts(&f, &ctx, 0, "shard_0000").await?, Some([101, 100, 100]));
    assert_eq!(cluster.repo::<Photo>()?.get(after.id).await?, Some(after));
    Ok(())
}

shardline_testkit::register!(shared: writes_go_on_during_a_move_and_none_is_lost);
pub(crate) async fn writes_go_on_during_a_move_and_none_is_lost(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let seeded = seed(&cluster, 0, 6, 50).await?.len();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..4i64)
        .map(|w| {
            let (cluster, stop) = (cluster.clone(), stop.clone());
            tokio::spawn(async move {
                let photos = cluster.repo::<Photo>()?;
                let (mut acked, mut slowest, mut n) = (Vec::new(), Duration::ZERO, 0usize);
                while !stop.load(Ordering::Relaxed) {
                    let user = 6 * (w * 1000 + i64::try_from(n % 20).unwrap_or(0));
                    let t = Instant::now();
                    let p = photos.insert(&photo(user, n)).await?;
                    if n % 10 == 0 {
                        // A read by ID never goes to the wrong host, mid-move or not.
                        assert_eq!(photos.get(p.id).await?.map(|g| g.id), Some(p.id));
                    }
                    slowest = slowest.max(t.elapsed());
                    acked.push(p.id);
                    n += 1;
                }
                Ok::<_, shardline_repo::Error>((acked, slowest))
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default()).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut acked, mut slowest) = (Vec::new(), Duration::ZERO);
    for w in writers {
        let (ids, slow) = w.await??;
        acked.extend(ids);
        slowest = slowest.max(slow);
    }
    let unique: HashSet<Id> = acked.iter().copied().collect();
    assert_eq!(unique.len(), acked.len(), "no ID twice");
    let ids: Vec<i64> = acked.iter().map(|&i| i64::from(i)).collect();
    let (found, total, distinct) = acked_on(&f, &ctx, 1, &acked).await?;
    let acked_n = i64::try_from(acked.len())?;
    assert_eq!(found, acked_n, "every acknowledged write is on the target");
    assert_eq!((total, distinct), (acked_n + i64::try_from(seeded)?, total), "and nothing else, once");
    let moved = format!("shard_0000_moved_{}", report.id);
    let on_source: i64 = f
        .client(&ctx, 0)
        .await?
        .query_one(&format!("SELECT count(*) FROM {moved}.photos WHERE id = ANY($1)"), &[&ids])
        .await?
        .get(0);
    assert!(
        on_source > 0 && on_source < acked_n,
        "writes went on before the fence ({on_source}) and after the flip"
    );
    eprintln!(
        "      {} writes during the move; pause {} ms; slowest write {} ms",
        acked.len(),
        report.pause_ms,
        slowest.as_millis()
    );
    Ok(())
}

shardline_testkit::register!(shared: a_move_stopped_after_any_step_is_resumed_or_undone);
pub(crate) async fn a_move_stopped_after_any_step_is_resumed_or_undone(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 2).await?;
    let mut expected = [40, 40, 40];
    let mut on = "pg1";
    for (i, step) in Step::ALL[..9].iter().copied().enumerate() {
        let other = if on == "pg1" { "pg2" } else { "pg1" };
        let stopping = MoveOptions::default().stopping_after(step);
        let err = moves::run(&config, crate::shard(0), &crate::host(other), &stopping).await.unwrap_err();
        assert!(matches!(err, OpsError::Interrupted { step: s, .. } if s == step), "{step}: {err}");
        let running = moves::list(&config).await?.into_iter().filter(|m| m.state == State::Running).count();
        assert_eq!(running, 1, "{step}");
        if step < Step::Flipped {
            // Undo it: the shard stays on its source, whole and writable; nothing left.
            if i % 2 == 0 {
                let said = cli(&f, &["move", "--abort", "0"]).await?;
                assert!(said.starts_with("move ") && said.contains(&format!("stays on {on}")), "{said}");
            } else {
                let undone = moves::abort(&config, crate::shard(0), &MoveOptions::default()).await?;
                assert_eq!(undone.unfenced, step.pauses_writes(), "{step}");
            }
            assert_eq!(counts(&f, &ctx, host_index(on), "shard_0000").await?, Some(expected), "{step}");
            assert_eq!(counts(&f, &ctx, host_index(other), "shard_0000").await?, None, "{step}");
            assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0], "after undoing at {step}");
            let p = cluster.repo::<Photo>()?.insert(&photo(0, 1000 + i)).await?;
            assert_eq!(cluster.route_user(0).host.as_str(), on);
            assert_eq!(cluster.repo::<Photo>()?.get(p.id).await?, Some(p));
            expected[0] += 1;
            let err = moves::run(&config, crate::shard(0), &crate::host(other), &stopping).await.unwrap_err();
            assert!(matches!(err, OpsError::Interrupted { .. }), "{err}");
        } else {
            let err = moves::abort(&config, crate::shard(0), &MoveOptions::default()).await.unwrap_err();
            assert!(matches!(err, OpsError::Flipped { .. }), "{err}");
        }
        // Finish it.
        let done = if i % 2 == 0 {
            moves::resume(&config, Some(crate::shard(0)), &MoveOptions::default()).await?
        } else {
            let said = cli(&f, &["move", "--resume", "--json"]).await?;
            serde_json::from_str::<serde_json::Value>(&said)?
                .as_array()
                .map(|a| a.len())
                .filter(|&n| n == 1)
                .ok_or(format!("one report: {said}"))?;
            Vec::new()
        };
        assert!(done.iter().all(|r| r.target == other && r.rows == expected.iter().sum::<i64>()));
        assert_eq!(counts(&f, &ctx, host_index(other), "shard_0000").await?, Some(expected), "{step}");
        assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0], "after resuming at {step}");
        let p = cluster.repo::<Photo>()?.insert(&photo(6, 2000 + i)).await?;
        assert_eq!(cluster.repo::<Photo>()?.get(p.id).await?.map(|g| g.id), Some(p.id));
        expected[0] += 1;
        on = other;
    }
    let journal = moves::list(&config).await?;
    assert_eq!(journal.iter().filter(|m| m.state == State::Done).count(), 9);
    assert_eq!(journal.iter().filter(|m| m.state == State::RolledBack).count(), 8);
    Ok(())
}

shardline_testkit::register!(shared: a_failed_verification_names_the_keys_and_does_not_flip);
pub(crate) async fn a_failed_verification_names_the_keys_and_does_not_flip(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let made = seed(&cluster, 0, 6, 2).await?;
    let stopping = MoveOptions::default().stopping_after(Step::SequenceCarried);
    moves::run(&config, crate::shard(0), &crate::host("pg2"), &stopping).await.unwrap_err();
    // Corrupt the copy: one photo changed, one comment gone.
    let pg2 = f.client(&ctx, 1).await?;
    pg2.batch_execute(REPLICA).await?; // past the copy's guard, as an operator would be
    pg2.execute("UPDATE shard_0000.photos SET caption = 'tampered' WHERE id = $1", &[&made[3].id]).await?;
    let gone: i64 = pg2
        .query_one("DELETE FROM shard_0000.comments WHERE photo_id = $1 RETURNING id", &[&made[5].id])
        .await?
        .get(0);
    let err = moves::resume(&config, Some(crate::shard(0)), &MoveOptions::default()).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, OpsError::Verify { .. }), "{text}");
    assert!(text.contains(&format!("photos: 1 differing key(s) (id): ({})", made[3].id)), "{text}");
    assert!(text.contains(&format!("comments: 1 differing key(s) (id): ({gone})")), "{text}");
    // Not flipped, undone: the shard is whole and writable on its source.
    let journal = moves::list(&config).await?;
    assert_eq!(journal[0].state, State::RolledBack);
    assert_eq!(journal[0].detail.differences.len(), 2);
    assert_eq!(cluster.route_user(0).host.as_str(), "pg1");
    assert_eq!(counts(&f, &ctx, 0, "shard_0000").await?, Some([40, 40, 40]));
    assert_eq!(counts(&f, &ctx, 1, "shard_0000").await?, None);
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    cluster.repo::<Photo>()?.insert(&photo(0, 7)).await?;
    assert_eq!(counts(&f, &ctx, 0, "shard_0000").await?, Some([41, 40, 40]));
    Ok(())
}

shardline_testkit::register!(exclusive: hosts_dying_mid_move_leave_one_writable_copy_and_nothing_orphaned);
pub(crate) async fn hosts_dying_mid_move_leave_one_writable_copy_and_nothing_orphaned(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    // Shard 2 lives on pg2; the catalog on pg1 stays up throughout.
    seed(&cluster, 2, 6, 2).await?;
    let (pg2, pg3) = (&ctx.hosts()[1], &ctx.hosts()[2]);
    let stop_after = |s: Step| MoveOptions::default().stopping_after(s);

    // 1. The target dies during the copy, while rows stream: the shard gets BULK more
    //    photos, so the initial copy takes a while; the target is killed the moment its
    //    table-sync worker is seen copying photos (state 'd' in pg_subscription_rel, the
    //    table's file growing). The move fails naming it and stays resumable; resume fails
    //    while it is down, and finishes once it is back, with every row.
    const BULK: i64 = 200_000;
    f.client(&ctx, 1)
        .await?
        .execute(
            "INSERT INTO shard_0002.photos (user_id, url)
             SELECT 2 + 6 * (g % 20), 'https://cdn/bulk/' || g FROM generate_series(1, $1::bigint) g",
            &[&BULK],
        )
        .await?;
    let c = Arc::new(config.clone());
    let mover = tokio::spawn(async move {
        moves::run(&c, crate::shard(2), &crate::host("pg3"), &MoveOptions::default().subscription_copy())
            .await
    });
    let watch = f.client(&ctx, 2).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let seen: (i64, i64) = loop {
        assert!(!mover.is_finished(), "the move ended before its copy was seen in progress");
        assert!(Instant::now() < deadline, "no copy seen in progress within 120 s");
        let row = watch
            .query_opt(
                "SELECT pg_relation_size(r.srrelid), coalesce(p.tuples_processed, 0)
                   FROM pg_subscription_rel r JOIN pg_class c ON c.oid = r.srrelid
                   JOIN pg_namespace n ON n.oid = c.relnamespace
                   LEFT JOIN pg_stat_progress_copy p ON p.relid = r.srrelid
                  WHERE n.nspname = 'shard_0002' AND c.relname = 'photos' AND r.srsubstate = 'd'",
                &[],
            )
            .await?;
        if let Some((bytes, tuples)) = row.map(|r| (r.get(0), r.get(1)))
            && (bytes > 0 || tuples > 0)
        {
            break (bytes, tuples);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    pg3.kill().await?;
    drop(watch);
    let err = mover.await?.unwrap_err();
    assert!(err.to_string().contains("pg3"), "the move fails naming the dead target: {err}");
    assert_eq!(moves::list(&config).await?[0].state, State::Running);
    assert_eq!(moves::list(&config).await?[0].step, Step::Copying);
    eprintln!(
        "      target killed mid-copy: photos' file {} bytes, {} rows copied (uncommitted)",
        seen.0, seen.1
    );
    let err = moves::resume(&config, Some(crate::shard(2)), &MoveOptions::default()).await.unwrap_err();
    assert!(err.to_string().contains("pg3"), "{err}");
    assert_eq!(moves::list(&config).await?[0].state, State::Running);
    pg3.start().await?;
    // A copy that does not finish again fails here, saying which tables it waits for,
    // rather than at the harness's time limit.
    let mut bounded = MoveOptions::default();
    bounded.copy_timeout = Duration::from_secs(120);
    moves::resume(&config, Some(crate::shard(2)), &bounded).await?;
    assert_eq!(counts(&f, &ctx, 2, "shard_0002").await?, Some([40 + BULK, 40, 40]));
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    assert_eq!(counts(&f, &ctx, 1, "shard_0002").await?, None);
    let fresh = Cluster::connect(&config, ClusterOptions::default()).await?;
    let written = fresh.repo::<Photo>()?.insert(&photo(2, 49)).await?;
    // The bulk goes (and the write above with it) so the cases below move small copies.
    f.client(&ctx, 2)
        .await?
        .execute(
            "DELETE FROM shard_0002.photos WHERE url LIKE '%/bulk/%' OR id = $1",
            &[&i64::from(written.id)],
        )
        .await?;
    assert_eq!(counts(&f, &ctx, 2, "shard_0002").await?, Some([40, 40, 40]));

    // 2. The source dies while the shard is fenced: abort needs it, and says so; once it
    //    is back, abort unfences it.
    moves::run(&config, crate::shard(2), &crate::host("pg2"), &stop_after(Step::Fenced)).await.unwrap_err();
    pg3.kill().await?;
    let err = moves::abort(&config, crate::shard(2), &MoveOptions::default()).await.unwrap_err();
    assert!(err.to_string().contains("pg3"), "{err}");
    pg3.start().await?;
    let undone = moves::abort(&config, crate::shard(2), &MoveOptions::default()).await?;
    assert!(undone.unfenced && undone.cleanup_pending.is_empty(), "{undone}");
    assert_eq!(counts(&f, &ctx, 2, "shard_0002").await?, Some([40, 40, 40]));
    assert_eq!(counts(&f, &ctx, 1, "shard_0002").await?, None);
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    let fresh = Cluster::connect(&config, ClusterOptions::default()).await?;
    fresh.repo::<Photo>()?.insert(&photo(2, 50)).await?;

    // 3. The target dies while the shard is fenced: abort unfences the source at once and
    //    leaves the target's part, named, to gc.
    moves::run(&config, crate::shard(2), &crate::host("pg2"), &stop_after(Step::Synced)).await.unwrap_err();
    pg2.kill().await?;
    let undone = moves::abort(&config, crate::shard(2), &MoveOptions::default()).await?;
    assert!(undone.unfenced && !undone.cleanup_pending.is_empty(), "{undone}");
    fresh.repo::<Photo>()?.insert(&photo(2, 51)).await?;
    assert_eq!(counts(&f, &ctx, 2, "shard_0002").await?, Some([42, 40, 40]));
    pg2.start().await?;
    let said = cli(&f, &["gc"]).await?;
    assert!(
        said.contains("pg2: subscription")
            && said.contains("pg2: schema shard_0002 (copy of rolled-back move"),
        "{said}"
    );
    assert_eq!(counts(&f, &ctx, 1, "shard_0002").await?, None);
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);

    // 4. The source dies after the flip: resume finishes on the target and leaves the
    //    source's publication and slot to gc.
    moves::run(&config, crate::shard(2), &crate::host("pg2"), &stop_after(Step::Flipped)).await.unwrap_err();
    pg3.kill().await?;
    let done = moves::resume(&config, Some(crate::shard(2)), &MoveOptions::default()).await?;
    assert!(!done[0].cleanup_pending.is_empty(), "{}", done[0]);
    assert_eq!(counts(&f, &ctx, 1, "shard_0002").await?, Some([42, 40, 40]));
    fresh.repo::<Photo>()?.insert(&photo(2, 52)).await?;
    pg3.start().await?;
    let said = cli(&f, &["gc", "--grace", "0s"]).await?;
    assert!(
        said.contains("pg3: publication/slots") && said.contains("pg3: schema shard_0002_moved_"),
        "{said}"
    );
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    assert_eq!(counts(&f, &ctx, 1, "shard_0002").await?, Some([43, 40, 40]));
    Ok(())
}

shardline_testkit::register!(shared: a_table_stranded_after_its_copy_starts_the_copy_over);
/// A table-sync worker drops its slot on the source and records `syncdone` in one
/// transaction of the target: killed between the two, it leaves its table at
/// `finishedcopy` with no slot, and Postgres retries it for ever. (The kill in
/// `hosts_dying_mid_move_leave_one_writable_copy_and_nothing_orphaned` lands there now
/// and then.) Made here without luck: the move stops once subscribed, and its `likes`
/// is marked copied on the target, with its replication origin made as the worker would
/// have, and no slot behind it. Its workers then fail asking the source to stream from
/// the missing slot, an error `sync_error_count` does not count (a first fix watched that
/// count, and missed the real case). The resumed move sees the table stranded, starts
/// the copy over, and finishes with every row.
pub(crate) async fn a_table_stranded_after_its_copy_starts_the_copy_over(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 2, 6, 2).await?;
    stopped_with(&config, 2, "pg3", MoveOptions::default().subscription_copy().stopping_after(Step::Copying))
        .await?;
    // A name really missing in the shard fails at once while its move copies: the
    // source is not fenced before `caught_up` (before, the router took the 42P01 for the
    // move's fence and waited out `move_wait`, 20 s, then ran the statement again).
    let started = Instant::now();
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let err = cluster
        .transaction(crate::shard(2), |tx| {
            runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Box::pin(async move { tx.execute("SELECT FROM no_such_table", &[]).await.map(drop) })
        })
        .await
        .expect_err("a statement naming no table");
    assert_eq!(err.sqlstate(), Some("42P01"), "{err}");
    let (runs, took) = (runs.load(std::sync::atomic::Ordering::Relaxed), started.elapsed());
    assert!(runs == 1 && took < Duration::from_secs(3), "{runs} runs in {took:?} beside a copying move");
    let stranded = f
        .client(&ctx, 2)
        .await?
        .execute(
            "UPDATE pg_subscription_rel SET srsubstate = 'f' WHERE srrelid = 'shard_0002.likes'::regclass",
            &[],
        )
        .await?;
    assert_eq!(stranded, 1);
    f.client(&ctx, 2)
        .await?
        .batch_execute(
            // The name is reserved to Postgres: written into its catalog directly.
            "SET allow_system_table_mods = on;
             INSERT INTO pg_replication_origin
             SELECT (SELECT coalesce(max(roident::bigint), 0) + 1 FROM pg_replication_origin)::oid,
                    'pg_' || srsubid || '_' || srrelid
               FROM pg_subscription_rel WHERE srrelid = 'shard_0002.likes'::regclass",
        )
        .await?;
    let mut bounded = MoveOptions::default().subscription_copy();
    bounded.copy_timeout = Duration::from_secs(60);
    let done = moves::resume(&config, Some(crate::shard(2)), &bounded).await?;
    assert_eq!(done.len(), 1);
    let journal = moves::list(&config).await?;
    let last = journal.last().ok_or("a move")?;
    assert_eq!((last.state, last.detail.copy_restarts), (State::Done, 1), "{:?}", last.detail);
    assert_eq!(counts(&f, &ctx, 2, "shard_0002").await?, Some([40, 40, 40]));
    assert_eq!(counts(&f, &ctx, 1, "shard_0002").await?, None);
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    let fresh = Cluster::connect(&config, ClusterOptions::default()).await?;
    fresh.repo::<Photo>()?.insert(&photo(2, 77)).await?;
    assert_eq!(counts(&f, &ctx, 2, "shard_0002").await?, Some([41, 40, 40]));

    // A restart cut short (the mover died after dropping the subscription, with rows of
    // the old copy left on the target): the resumed move finds the subscription gone and
    // starts over from empty tables.
    stopped_with(&config, 2, "pg2", MoveOptions::default().subscription_copy().stopping_after(Step::Copying))
        .await?;
    let pg2 = f.client(&ctx, 1).await?;
    pg2.batch_execute(REPLICA).await?; // past the copy's guard, as an operator would be
    let name = moves::list(&config).await?.last().ok_or("a move")?.detail.name.clone();
    pg2.batch_execute(&format!(
        "ALTER SUBSCRIPTION {name} ENABLE; SELECT pg_sleep(0.5); ALTER SUBSCRIPTION {name} DISABLE;
         ALTER SUBSCRIPTION {name} SET (slot_name = NONE); DROP SUBSCRIPTION {name};
         INSERT INTO shard_0002.photos (id, user_id, url) VALUES (1, 2, 'left over')
             ON CONFLICT DO NOTHING"
    ))
    .await?;
    moves::resume(&config, Some(crate::shard(2)), &bounded).await?;
    let last = moves::list(&config).await?.last().cloned().ok_or("a move")?;
    assert_eq!((last.state, last.detail.copy_restarts), (State::Done, 1), "{:?}", last.detail);
    assert_eq!(counts(&f, &ctx, 1, "shard_0002").await?, Some([41, 40, 40]));
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    Ok(())
}

shardline_testkit::register!(shared: rebalance_spreads_shards_onto_a_new_host);
pub(crate) async fn rebalance_spreads_shards_onto_a_new_host(ctx: TestContext) -> TestResult {
    let mut f = Fixture::new(&ctx, 2, 8).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    for shard in 0..8 {
        seed(&cluster, shard, 8, 1).await?;
    }
    // A third, empty host joins; the plan fills it from both others, changing nothing.
    f.hosts = 3;
    f.write_config(&ctx, |_, u| u, 8)?;
    let config = f.config()?;
    shardline_ops::init(&config, &options(1), &quiet).await?;
    let plan = shardline_ops::rebalance::plan(&config, 8).await?;
    assert!((2..=3).contains(&plan.moves.len()), "{plan}");
    assert!(plan.moves.iter().all(|m| m.to == "pg3"), "{plan}");
    assert!(
        plan.moves.iter().any(|m| m.from == "pg1") && plan.moves.iter().any(|m| m.from == "pg2"),
        "{plan}"
    );
    let said = cli(&f, &["rebalance", "--plan"]).await?;
    assert!(said.contains(&format!("{} move(s):", plan.moves.len())), "{said}");
    assert!(moves::list(&config).await?.is_empty(), "a plan changes nothing");
    // A bound is a bound.
    let one: serde_json::Value =
        serde_json::from_str(&cli(&f, &["rebalance", "--plan", "--max-moves", "1", "--json"]).await?)?;
    assert_eq!(one["moves"].as_array().map(Vec::len), Some(1));
    assert!(one["moves"][0]["shard"].is_u64() && one["moves"][0]["to"] == "pg3", "{one}");

    // Every move targets pg3: two at a time only with `--per-host 2`.
    let said = cli(&f, &["rebalance", "--apply", "--parallel", "2", "--per-host", "2"]).await?;
    assert_eq!(said.lines().filter(|l| l.contains("-> pg3: 60 rows")).count(), plan.moves.len(), "{said}");
    let journal = moves::list(&config).await?;
    assert!(
        journal.iter().enumerate().any(|(i, a)| journal[i + 1..]
            .iter()
            .any(|b| a.started_at < b.updated_at && b.started_at < a.updated_at)),
        "no two moves onto pg3 ran at once: {journal:?}"
    );
    let map: serde_json::Value = serde_json::from_str(&cli(&f, &["map", "--json"]).await?)?;
    let shards: Vec<i64> = (0..3).filter_map(|h| map["hosts"][h]["shards"].as_i64()).collect();
    assert_eq!(shards.iter().sum::<i64>(), 8);
    assert!(shards.iter().all(|&n| (2..=3).contains(&n)), "{map}");
    // Every row is still where the (new) map says. A handle made before pg3 was in its
    // config follows: the catalog gives pg3's address.
    cluster.refresh().await?;
    assert!(cluster.hosts().iter().any(|(h, _)| h == "pg3"), "{:?}", cluster.hosts());
    for shard in 0..8u16 {
        let route =
            cluster.route(shardline_router::LogicalShard::new(i64::from(shard), config.logical_shards)?)?;
        let h = host_index(route.host.as_str());
        assert_eq!(counts(&f, &ctx, h, route.schema.as_str()).await?, Some([20, 20, 20]), "shard {shard}");
    }
    // Balanced now: nothing more to do.
    let again = shardline_ops::rebalance::plan(&config, 8).await?;
    assert!(again.moves.len() <= 1, "{again}");
    Ok(())
}

shardline_testkit::register!(shared: a_mover_killed_anywhere_leaves_a_move_to_resume_or_undo);
pub(crate) async fn a_mover_killed_anywhere_leaves_a_move_to_resume_or_undo(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = Arc::new(f.config()?);
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 5).await?;
    let mut expected = [100, 100, 100];
    let mut on = "pg1";
    let mut steps_hit = HashSet::new();
    let catalog = f.client(&ctx, 0).await?;
    for (i, after) in Step::ALL[..9].iter().copied().enumerate() {
        let other = if on == "pg1" { "pg2" } else { "pg1" };
        // The mover dies (its task dropped mid-await: every connection closes, as when
        // the process is killed) just after it journals `after`, inside the next step.
        let c = config.clone();
        let mover = tokio::spawn(async move {
            moves::run(&c, crate::shard(0), &crate::host(other), &MoveOptions::default()).await
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        while !mover.is_finished() && Instant::now() < deadline {
            let step: Option<String> = catalog
                .query_opt(
                    "SELECT step FROM shardline.moves WHERE state = 'running' ORDER BY id DESC LIMIT 1",
                    &[],
                )
                .await?
                .map(|r| r.get(0));
            if step.and_then(|s| Step::parse(&s)).is_some_and(|s| s >= after) {
                break;
            }
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        tokio::time::sleep(Duration::from_micros(u64::try_from(i)? * 300)).await;
        mover.abort();
        let finished = matches!(mover.await, Ok(Ok(_)));
        let journal = moves::list(&config).await?;
        let last = journal.last().ok_or("a move")?;
        if !finished && last.state == State::Running {
            steps_hit.insert(last.step);
            // Odd kills are undone (when still possible), even ones resumed. A mover
            // killed after the source decided to flip, before it journaled the flip,
            // leaves a move that can only be finished: abort refuses, naming the resume.
            let undo = i % 2 == 1 && last.step < Step::Flipped;
            let undone = if undo {
                match moves::abort(&config, crate::shard(0), &MoveOptions::default()).await {
                    Ok(_) => true,
                    Err(OpsError::FlipDecided { shard, .. }) => {
                        assert_eq!(shard, crate::shard(0), "kill {i}");
                        eprintln!(
                            "      kill {i}: killed after the flip was decided; abort refused, resumed"
                        );
                        false
                    }
                    Err(e) => return Err(format!("kill {i}: abort: {e}").into()),
                }
            } else {
                false
            };
            if undone {
                assert_eq!(counts(&f, &ctx, host_index(other), "shard_0000").await?, None, "kill {i}");
            } else {
                moves::resume(&config, Some(crate::shard(0)), &MoveOptions::default()).await?;
                on = other;
            }
        } else if last.state == State::Done {
            on = other;
        }
        // One writable copy, where the map says, with every row; nothing left over.
        let fresh = Cluster::connect(&config, ClusterOptions::default()).await?;
        assert_eq!(fresh.route_user(0).host.as_str(), on, "kill {i} after {after}");
        assert_eq!(counts(&f, &ctx, host_index(on), "shard_0000").await?, Some(expected), "kill {i}");
        assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0], "kill {i}");
        fresh.repo::<Photo>()?.insert(&photo(0, 5000 + i)).await?;
        expected[0] += 1;
    }
    eprintln!("      killed at steps {:?}", {
        let mut v: Vec<_> = steps_hit.into_iter().collect();
        v.sort();
        v
    });
    Ok(())
}

shardline_testkit::register!(shared: the_demo_runs_to_its_summary);
pub(crate) async fn the_demo_runs_to_its_summary(_ctx: TestContext) -> TestResult {
    // Its own cluster, on the backend the tests use; small sizes.
    let argv = [
        "shardline",
        "demo",
        "--hosts",
        "2",
        "--shards",
        "32",
        "--users",
        "40",
        "--seconds",
        "2",
        "--rebalance",
        "1",
        // The workload through sqlx (CI's demo stage runs the README's command, through
        // the repository API).
        "--via",
        "sqlx",
    ];
    let (out, result) = tokio::task::spawn_blocking(move || {
        let opt = <shardline::Opt as clap::Parser>::try_parse_from(argv).map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        let r = shardline::run(opt, &mut out).map_err(|e| format!("{e:#}"));
        Ok::<_, String>((String::from_utf8_lossy(&out).into_owned(), r))
    })
    .await??;
    result?;
    for part in [
        "init: 32 logical shards over 2 hosts",
        "8 workers through sqlx",
        "== operations",
        "== moves ==",
        "== hosts ==",
        "== an ID ==",
    ] {
        assert!(out.contains(part), "{part:?} in:\n{out}");
    }
    // Every operation ran, none failed; two moves (the hot shard, one onto pg3).
    let ops: Vec<&str> =
        out.lines().skip_while(|l| !l.starts_with("== operations")).skip(2).take(6).collect();
    assert_eq!(ops.len(), 6, "{out}");
    for line in ops {
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cols.last(), Some(&"0"), "no errors: {line}");
    }
    let moves: Vec<&str> =
        out.lines().filter(|l| l.starts_with("shard ") && l.contains("write pause")).collect();
    assert_eq!(moves.len(), 2, "{out}");
    assert!(out.lines().any(|l| l.starts_with("pg3 ") && !l.contains(" 0 ")), "pg3 holds a shard:\n{out}");
    assert!(out.trim_end().ends_with("s") && out.contains("removing the cluster"), "{out}");
    Ok(())
}

shardline_testkit::register!(own: every_step_survives_the_source_or_the_target_dying);
/// Every (step × host) point of a move: stopped after each of the 9 steps, the source or
/// the target is killed. Recovery is tried while it is down (abort before the flip on
/// some steps, resume at the others and after the flip); it either succeeds or fails
/// naming the dead host, leaving the move running (or undone at once, when it failed
/// while the shard was fenced and the source could take its writes back). Once the host
/// is back, the same action finishes a running move. Then, every time: the map and the data agree on one writable copy
/// holding every row, and `gc` leaves nothing behind.
pub(crate) async fn every_step_survives_the_source_or_the_target_dying(_ctx: TestContext) -> TestResult {
    on_own_kit(3, &[], |kit| Box::pin(every_step_on(kit))).await
}

async fn every_step_on(ctx: &shardline_testkit::Cluster) -> Result<(), BoxError> {
    let f = Fixture::on_kit(ctx, "every_step", 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    // Shard 2 bounces between pg2 and pg3; the catalog on pg1 stays up.
    seed(&cluster, 2, 6, 2).await?;
    let mut expected = [40, 40, 40];
    let mut on = "pg2";
    let mut failed_while_down = 0;
    let mut undone_count = 0;
    let mut undo_failed = 0;
    let mut n = 0;
    for (i, step) in Step::ALL[..9].iter().copied().enumerate() {
        for victim_is_source in [true, false] {
            n += 1;
            let other = if on == "pg2" { "pg3" } else { "pg2" };
            let victim = if victim_is_source { on } else { other };
            let case = format!(
                "stopped after {}, {victim} ({}) killed",
                step.as_str(),
                if victim_is_source { "source" } else { "target" }
            );
            moves::run(
                &config,
                crate::shard(2),
                &crate::host(other),
                &MoveOptions::default().stopping_after(step),
            )
            .await
            .unwrap_err();
            let host = &ctx.hosts()[host_index(victim)];
            host.kill().await?;
            // Each host dies before an abort at some steps and before a resume at others.
            let abort = step < Step::Flipped && (i + usize::from(victim_is_source)) % 2 == 0;
            let recover = || async {
                if abort {
                    moves::abort(&config, crate::shard(2), &MoveOptions::default()).await.map(|_| ())
                } else {
                    moves::resume(&config, Some(crate::shard(2)), &MoveOptions::default()).await.map(|_| ())
                }
            };
            let latest = || async {
                let all = moves::list(&config).await?;
                all.into_iter().max_by_key(|m| m.id).map(|m| m.state).ok_or_else(|| BoxError::from("no move"))
            };
            if let Err(e) = recover().await {
                failed_while_down += 1;
                assert!(e.to_string().contains(victim), "{case}: the error names {victim}: {e}");
                // Still running, or undone at once because it failed while the shard
                // was fenced (the source answered, so its writes could resume).
                let state = latest().await?;
                assert!(matches!(state, State::Running | State::RolledBack), "{case}: {state:?}");
                // A failure whose undo failed too says so, and what finishes it: not the
                // move's own error, which may say it was undone.
                if matches!(e, OpsError::UndoFailed { .. }) {
                    undo_failed += 1;
                    assert_eq!(state, State::Running, "{case}: {e}");
                    assert!(e.to_string().contains("shardline move --abort 2"), "{case}: {e}");
                }
            }
            host.start().await?;
            if latest().await? == State::Running {
                recover().await.map_err(|e| format!("{case}: once {victim} is back: {e}"))?;
            }
            let undone = match latest().await? {
                State::Done => false,
                State::RolledBack => true,
                other => return Err(format!("{case}: the move ended {other:?}").into()),
            };
            assert!(undone || !abort, "{case}: an abort that did not undo");
            undone_count += usize::from(undone);
            let now_on = if undone { on } else { other };
            let said = ends_whole_on(&f, ctx, &cluster, 2, now_on, expected, &case).await?;
            for h in 1..3 {
                let old: i64 = f
                    .client(ctx, h)
                    .await?
                    .query_one("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'shard\\_0002\\_%'", &[])
                    .await?
                    .get(0);
                assert_eq!(old, 0, "{case}: an old copy is left on pg{}: {said}", h + 1);
            }
            let fresh = Cluster::connect(&config, ClusterOptions::default()).await?;
            fresh.repo::<Photo>()?.insert(&photo(2, 1000 + n)).await.map_err(|e| format!("{case}: {e}"))?;
            expected[0] += 1;
            on = now_on;
        }
    }
    // The matrix is scripted, so its outcomes are too. A recovery fails while the host
    // is down when it needs that host (steps counted from 0): every abort with the source down (steps 1, 3, 5,
    // 7), and every resume whose next step touches the dead host before the flip (the
    // source at steps 0, 2, 4, 6; the target at 1, 3, 5, and at 7, where the source's
    // privileges are carried to it once more before the flip): 12. Ended undone: the 8
    // aborts (4 with the source down, finished once it is back; 4 with the target down,
    // at once) and the 2 resumes that failed while fenced with the source up (the target
    // dead after synced and verified): 10; the other 8 completed. (With the target dead
    // after caught_up, the resume fails in the comparison before the fence, which needs
    // the target: nothing is fenced, so the move stays running and completes once the
    // target is back.)
    assert_eq!(failed_while_down, 12, "recoveries that failed while the host was down");
    assert_eq!(undone_count, 10, "moves that ended undone");
    // A mover that dies halfway through an undo (journaled as begun, the target's copy
    // perhaps gone) leaves a move that must not be resumed: resume refuses and says to
    // abort, and abort finishes the undo.
    let other = if on == "pg2" { "pg3" } else { "pg2" };
    moves::run(
        &config,
        crate::shard(2),
        &crate::host(other),
        &MoveOptions::default().stopping_after(Step::Fenced),
    )
    .await
    .unwrap_err();
    f.client(ctx, 0)
        .await?
        .execute(
            "UPDATE shardline.moves SET detail = jsonb_set(detail, '{undoing}', 'true') WHERE state = 'running'",
            &[],
        )
        .await?;
    let err = moves::resume(&config, Some(crate::shard(2)), &MoveOptions::default()).await.unwrap_err();
    assert!(matches!(err, OpsError::Undoing { shard, .. } if shard == 2), "{err}");
    assert!(err.to_string().contains("shardline move --abort 2"), "{err}");
    assert!(moves::abort(&config, crate::shard(2), &MoveOptions::default()).await?.unfenced);
    assert_eq!(counts(&f, ctx, host_index(on), "shard_0002").await?, Some(expected));
    eprintln!(
        "    18 (step x host) kills: {failed_while_down} recoveries failed while the host was down \
         ({undo_failed} of them resumes inside the fence whose undo failed too), \
         {undone_count} moves ended undone, {} completed",
        18 - undone_count
    );
    // A resume inside the fence with its source dead cannot undo either.
    assert!(undo_failed > 0, "no recovery reported a failed undo");
    Ok(())
}

shardline_testkit::register!(own: a_host_paused_inside_each_step_leaves_the_move_done_or_undone);
/// A hung host, not a dead one: the source or the target is frozen (SIGSTOP, `docker
/// pause`) inside each step of a move, as soon as the step before it is journaled, for
/// 2 s (the source 6 s while the shard is fenced: past the fence's lease, 4 s here), then
/// thawed.
/// Whatever the step, the move then completes, or fails and is resumed or undone; the
/// shard ends on one host, whole, writable, with nothing orphaned.
pub(crate) async fn a_host_paused_inside_each_step_leaves_the_move_done_or_undone(
    _ctx: TestContext,
) -> TestResult {
    let cases: Vec<(Step, bool, Option<Duration>)> = Step::ALL[..9]
        .iter()
        .flat_map(|after| {
            let fenced = (Step::CaughtUp..=Step::SequenceCarried).contains(after);
            [true, false].map(|source| {
                (*after, source, Some(Duration::from_secs(if source && fenced { 6 } else { 2 })))
            })
        })
        .collect();
    let seen = pause_cases("paused_hosts", &cases, MoveOptions::default().with_lease(Duration::from_secs(4)))
        .await?;
    eprintln!(
        "    18 (step x host) pauses: {} moves completed, {} ended undone; \
         {} returned while the host was still paused, {} completed before the freeze landed",
        seen.completed,
        18 - seen.completed,
        seen.returned_while_paused,
        seen.completed_before_freeze
    );
    Ok(())
}

shardline_testkit::register!(own: a_host_hung_for_good_inside_a_step_fails_the_move_in_time);
/// A host frozen inside a step and not thawed until the move returns: the move gives the
/// step up once the host has answered no probe for `hung_after` (4 s here), instead of
/// waiting for as long as the host is hung; thawed, the move is resumed or undone and the
/// shard ends whole on one host. The source inside the copy, the fence, the flip's
/// decision; the target inside the sync and the verification. Either inside the
/// clean-up after the flip: the move completes while the host is still hung (a move that
/// flipped is never reported failed), its part left to `gc`.
pub(crate) async fn a_host_hung_for_good_inside_a_step_fails_the_move_in_time(
    _ctx: TestContext,
) -> TestResult {
    let cases = [
        (Step::Prepared, true, None),
        (Step::CaughtUp, true, None),
        (Step::Fenced, false, None),
        (Step::SequenceCarried, false, None),
        (Step::Verified, true, None),
        // After the flip: the clean-up meets the hung host, leaves its part to gc, and
        // the move completes.
        (Step::Flipped, true, None),
        (Step::Flipped, false, None),
    ];
    let mut hung = MoveOptions::default();
    hung.hung_after = Duration::from_secs(4);
    let seen = pause_cases("hung_hosts", &cases, hung).await?;
    eprintln!(
        "    {} hung hosts: {} moves completed, {} ended undone; {} completed before the freeze landed",
        cases.len(),
        seen.completed,
        cases.len() - seen.completed,
        seen.completed_before_freeze
    );
    // None waited for the thaw: each returned while its host was hung, or completed
    // before the freeze landed (nothing to wait on).
    assert_eq!(
        seen.returned_while_paused + seen.completed_before_freeze,
        cases.len(),
        "every move returned while its host was still hung"
    );
    // And the freeze did land inside most of them: the test is about hung hosts.
    assert!(
        seen.returned_while_paused * 2 > cases.len(),
        "the freeze landed inside only {} of {} moves",
        seen.returned_while_paused,
        cases.len()
    );
    Ok(())
}

/// Runs each case on 3 hosts of its own (it pauses them; other tests run meanwhile), on
/// shard 3 (bouncing between pg2 and pg3; the catalog on pg1 stays up):
/// a move whose source (`true`) or target is paused as soon as the move journals the
/// step, for the given time or (`None`) until the move returns. A move that fails is
/// resumed or undone once the host is thawed; then the shard must be on one host, whole,
/// writable, with nothing orphaned.
async fn pause_cases(
    db: &str,
    cases: &[(Step, bool, Option<Duration>)],
    base: MoveOptions,
) -> Result<PauseOutcome, BoxError> {
    let kit = shardline_testkit::Cluster::start(3).await?;
    let ctx = &kit;
    let f = Fixture::on_kit(&kit, db, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 3, 6, 2).await?;
    let mut expected = [40, 40, 40];
    let mut on = "pg2";
    let (mut completed, mut returned_while_paused, mut completed_before_freeze) = (0, 0, 0);
    for (i, &(after, victim_is_source, hold)) in cases.iter().enumerate() {
        let other = if on == "pg2" { "pg3" } else { "pg2" };
        let victim = if victim_is_source { on } else { other };
        let case = format!(
            "{} ({}) paused inside the step after {}{}",
            victim,
            if victim_is_source { "source" } else { "target" },
            after.as_str(),
            hold.map_or(" until the move returned".to_owned(), |h| format!(" for {h:?}"))
        );
        let host = &ctx.hosts()[host_index(victim)];
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut opts = base.clone();
        let hung_after = opts.hung_after;
        opts.progress = Some(Arc::new(move |p: &moves::MoveProgress| {
            if matches!(p, moves::MoveProgress::Step { step, .. } if *step == after) {
                let _ = tx.send(Instant::now());
            }
        }));
        let pausing = std::sync::OnceLock::<Instant>::new();
        let paused = AtomicBool::new(false);
        let thawed = AtomicBool::new(false);
        let returned = tokio::sync::Notify::new();
        let (cfg, pausing_ref, paused_ref, thawed_ref, returned_ref) =
            (&config, &pausing, &paused, &thawed, &returned);
        // The options (and the sender in them) go with the move: a move that ends
        // before the step ends the freezer's wait too.
        let mover = async move {
            let r = moves::run(cfg, crate::shard(3), &crate::host(other), &opts).await;
            let frozen = paused_ref.load(Ordering::SeqCst);
            let early = frozen && !thawed_ref.load(Ordering::SeqCst);
            // The freeze lands before `pause` returns: the cgroup freezer may take
            // seconds on a loaded machine (and is tried again when it gives up), and the
            // answer is seen only once this task polls the freezer. A move that gave the
            // victim up (its liveness probes or a statement's own bound), no sooner after
            // the freeze was asked for than the watchdog can (its bound less one probe's
            // interval), met a hung host.
            let landing = !frozen
                && pausing_ref.get().is_some_and(|at| at.elapsed() + Duration::from_secs(1) >= hung_after)
                && r.as_ref().is_err_and(|e| e.to_string().contains(victim));
            if landing {
                eprintln!(
                    "      gave {victim} up as hung while its freeze was landing (pause not yet returned)"
                );
            }
            let early = early || landing;
            // A move may complete before the freeze lands (`docker pause` takes a while
            // on a loaded machine: a move that flipped and completed 185 ms after
            // `verified` was seen, and CI saw one that went on from an earlier step): no
            // host was hung for it to wait on. Counted apart, and said below.
            let before_freeze = !frozen && !landing && r.is_ok();
            returned_ref.notify_one();
            (r, early, before_freeze, frozen || landing, Instant::now())
        };
        let freezer = async {
            let Some(at) = rx.recv().await else { return Ok::<_, BoxError>(None) };
            let _ = pausing.set(Instant::now());
            host.pause().await?;
            paused.store(true, Ordering::SeqCst);
            match hold {
                Some(h) => tokio::time::sleep(h).await,
                None => returned.notified().await,
            }
            host.resume().await?;
            thawed.store(true, Ordering::SeqCst);
            Ok(Some(at))
        };
        let ((result, early, before_freeze, was_frozen, ended), frozen) =
            tokio::time::timeout(Duration::from_secs(120), async { futures::join!(mover, freezer) })
                .await
                .map_err(|_| format!("{case}: the move did not end within 120 s"))?;
        let frozen_at =
            frozen?.ok_or_else(|| format!("{case}: the move never reached the step: {result:?}"))?;
        if host.state() == shardline_testkit::HostState::Paused {
            host.resume().await?;
        }
        returned_while_paused += usize::from(early);
        completed_before_freeze += usize::from(before_freeze);
        let took = ended.duration_since(frozen_at);
        if hold.is_none() {
            // The watchdog's bound, one probe's limit (5 s), a second bounded wait in the
            // undo, and slack for a busy machine. A move may also complete with its host
            // hung: one whose flip was decided before the freeze landed leaves the hung
            // host's clean-up to gc. A move that flips with the source hung (its flip
            // decided before the freeze landed, or the freeze after the flip) also waits
            // out, in its clean-up, the target's DROP SUBSCRIPTION, which connects to the
            // source (15 s, `subscription::PEER_TIMEOUT`), between two bounded parts.
            let bound = hung_after + Duration::from_secs(if after >= Step::Verified { 40 } else { 25 });
            assert!(took < bound, "{case}: the move returned {took:?} after the freeze");
            if result.is_ok() && !was_frozen {
                eprintln!("      {case}: completed {took:?} after the step, before the freeze landed");
            } else if result.is_ok() {
                eprintln!("      {case}: completed {took:?} after the freeze");
            }
        }
        let latest = || async {
            let all = moves::list(&config).await?;
            all.into_iter().max_by_key(|m| m.id).ok_or_else(|| BoxError::from("no move"))
        };
        if after >= Step::Flipped {
            assert!(result.is_ok(), "{case}: a move that flipped is never reported failed: {result:?}");
        }
        if let Err(e) = &result {
            let m = latest().await?;
            eprintln!("      {case}: failed {took:?} after the freeze, at {}: {e}", m.step.as_str());
            if hold.is_none() {
                assert!(e.to_string().contains(victim), "{case}: the error names {victim}: {e}");
            }
            if m.state == State::Running {
                // Odd cases are undone when still possible, the others resumed; an undo
                // begun (and cut short by the hung host) is finished.
                if m.detail.undoing || (i % 2 == 1 && m.step < Step::Flipped) {
                    moves::abort(&config, crate::shard(3), &MoveOptions::default())
                        .await
                        .map_err(|e| format!("{case}: abort: {e}"))?;
                } else {
                    moves::resume(&config, Some(crate::shard(3)), &MoveOptions::default())
                        .await
                        .map_err(|e| format!("{case}: resume: {e}"))?;
                }
            }
        }
        let undone = match latest().await?.state {
            State::Done => false,
            State::RolledBack => true,
            other => return Err(format!("{case}: the move ended {other:?}").into()),
        };
        completed += usize::from(!undone);
        let now_on = if undone { on } else { other };
        ends_whole_on(&f, ctx, &cluster, 3, now_on, expected, &case).await?;
        cluster.repo::<Photo>()?.insert(&photo(3, 2000 + i)).await.map_err(|e| format!("{case}: {e}"))?;
        expected[0] += 1;
        on = now_on;
    }
    kit.shutdown().await?;
    Ok(PauseOutcome { completed, returned_while_paused, completed_before_freeze })
}

/// What [`pause_cases`] saw.
struct PauseOutcome {
    /// Moves that ended done (the others ended undone).
    completed: usize,
    /// Moves that returned while their host was still frozen (or while its freeze was
    /// landing, having given it up as hung).
    returned_while_paused: usize,
    /// Moves that completed before the freeze landed: no host was hung for them.
    completed_before_freeze: usize,
}

shardline_testkit::register!(shared: a_probe_left_by_a_killed_pre_flight_is_dropped_by_gc);
/// The pre-flight probes whether the target reaches the source with a subscription it
/// makes and drops; a pre-flight killed (or cut off) between the two left it on the
/// target for good (the soak found two, seed 632483792). `gc` drops such probes, and a
/// pre-flight whose probe was dropped under it goes on.
pub(crate) async fn a_probe_left_by_a_killed_pre_flight_is_dropped_by_gc(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    // What a pre-flight leaves when it dies between making its probe and dropping it.
    let target = f.client(&ctx, 2).await?;
    target
        .batch_execute(
            "CREATE SUBSCRIPTION shardline_probe_1_0 CONNECTION 'host=/nonexistent' PUBLICATION shardline_probe
               WITH (connect = false, enabled = false, create_slot = false, slot_name = NONE)",
        )
        .await?;
    let said = cli(&f, &["gc", "--grace", "0s"]).await?;
    assert!(said.contains("shardline_probe_1_0"), "gc did not say it dropped the probe: {said}");
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0], "{said}");
    // The pre-flight itself still probes and leaves nothing.
    let config = f.config()?;
    let check = preflight(&config, crate::shard(0), &crate::host("pg3")).await?;
    assert!(check.is_ok(), "{check:?}");
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    Ok(())
}

/// After a move of shard `n` (of 6, bouncing between pg2 and pg3) ended with the shard on
/// `now_on`: `gc` runs; the map places the shard on `now_on`, which holds `expected` rows
/// (photos, likes, comments); the other host holds no copy; no slot, publication,
/// subscription or change log is left. Returns what `gc` printed.
async fn ends_whole_on(
    f: &Fixture,
    ctx: &impl Hosts,
    cluster: &Cluster,
    n: u16,
    now_on: &str,
    expected: [i64; 3],
    case: &str,
) -> Result<String, BoxError> {
    let said = cli(f, &["gc", "--grace", "0s"]).await?;
    let schema = format!("shard_{n:04}");
    let gone = if now_on == "pg2" { "pg3" } else { "pg2" };
    cluster.refresh().await?;
    assert_eq!(cluster.route(crate::shard(n))?.host.as_str(), now_on, "{case}");
    assert_eq!(counts(f, ctx, host_index(now_on), &schema).await?, Some(expected), "{case}");
    assert_eq!(counts(f, ctx, host_index(gone), &schema).await?, None, "{case}: {said}");
    assert_eq!(leftovers(f, ctx).await?, vec![0, 0, 0], "{case}: {said}");
    Ok(said)
}

/// Sequence values (time and counter fields, which with the shard fix an ID) as
/// inclusive ranges, sorted and merged.
fn merged(mut ranges: Vec<(i64, i64)>) -> Vec<(i64, i64)> {
    ranges.sort_unstable();
    let mut out: Vec<(i64, i64)> = Vec::with_capacity(ranges.len());
    for (a, b) in ranges {
        match out.last_mut() {
            Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// The sequence value an ID was minted from (its time and counter fields).
fn sequence_value(layout: shardline_id::Layout, id: i64) -> i64 {
    Id::from_i64(id).map_or(-1, |id| layout.sequence_value_of(id))
}

/// How many values of `ranges` fall into `sorted` (merged, see [`merged`]).
fn overlap(sorted: &[(i64, i64)], ranges: &[(i64, i64)]) -> i64 {
    let mut n = 0;
    for &(a, b) in ranges {
        let from = sorted.partition_point(|r| r.1 < a);
        for r in sorted[from..].iter().take_while(|r| r.0 <= b) {
            n += r.1.min(b) - r.0.max(a) + 1;
        }
    }
    n
}

shardline_testkit::register!(shared: no_id_the_source_handed_out_is_minted_again_on_the_target);
/// Bare `next_id()` loops and `reserve_ids(100000)` calls on the source, started before
/// the move and going on past the flip (failing once the shard is fenced), and IDs
/// minted on the target after the flip: the target hands out none the source did, and
/// starts above all of them. The source's sequence stays capped where the fence read
/// it; undoing a fenced move lifts the cap.
pub(crate) async fn no_id_the_source_handed_out_is_minted_again_on_the_target(
    ctx: TestContext,
) -> TestResult {
    use std::sync::atomic::AtomicU64;

    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 2).await?;
    let layout = cluster.layout();
    // The sequence a minute ahead of the clock, where a burst of more than 1,024 IDs a
    // ms leaves it (an import, blocks reserved by applications; it never goes back).
    // The target then mints straight on from the value carried, with no catch-up to
    // the clock in between: any value the source hands out after the carry, the target
    // hands out again.
    let pg1 = f.client(&ctx, 0).await?;
    pg1.execute(
        "SELECT setval('shard_0000.shardline_id_seq', $1)",
        &[&layout.sequence_value_at({
            use shardline_id::generator::Clock as _;
            shardline_id::generator::SystemClock.now_ms() + 60_000
        })?],
    )
    .await?;
    let stop = Arc::new(AtomicBool::new(false));
    let (calls, stopped) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut minters = Vec::new();
    for t in 0..5 {
        let (client, stop, calls, stopped) =
            (f.client(&ctx, 0).await?, stop.clone(), calls.clone(), stopped.clone());
        minters.push(tokio::spawn(async move {
            // Sequence-value ranges handed out, and the SQLSTATEs of the calls refused.
            let (mut got, mut refused) = (Vec::<(i64, i64)>::new(), Vec::<String>::new());
            while !stop.load(Ordering::Relaxed) {
                let result = if t < 3 {
                    client
                        .query("SELECT first_value, last_value FROM shard_0000.reserve_ids(100000)", &[])
                        .await
                        .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect::<Vec<_>>())
                } else {
                    // An ID as its sequence value: with the shard fixed, one determines the other.
                    client.query_one("SELECT shard_0000.next_id()", &[]).await.map(|r| {
                        let v = sequence_value(layout, r.get(0));
                        vec![(v, v)]
                    })
                };
                match result {
                    Ok(ranges) => {
                        got.extend(ranges);
                        calls.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        if refused.is_empty() {
                            stopped.fetch_add(1, Ordering::Relaxed);
                        }
                        refused.push(e.code().map_or_else(|| e.to_string(), |c| c.code().to_owned()));
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            }
            (got, refused)
        }));
    }
    // The move starts once every minter is under way.
    let deadline = Instant::now() + Duration::from_secs(60);
    while calls.load(Ordering::Relaxed) < 20 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let report = moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default()).await?;

    // At once after the flip, the target mints, while a reservation the fence did not
    // wait for would still be minting on the source: rows through the repository, bare
    // next_id() and reservations, until every source minter has been refused.
    let mut target_minters = Vec::new();
    for t in 0..3 {
        let (client, cluster, stopped) = (f.client(&ctx, 1).await?, cluster.clone(), stopped.clone());
        target_minters.push(tokio::spawn(async move {
            let mut got = Vec::<(i64, i64)>::new();
            let mut i = 0;
            while i < 3 || stopped.load(Ordering::Relaxed) < 5 {
                i += 1;
                let ranges: Vec<(i64, i64)> = match t {
                    0 => client
                        .query("SELECT first_value, last_value FROM shard_0000.reserve_ids(100000)", &[])
                        .await?
                        .iter()
                        .map(|r| (r.get(0), r.get(1)))
                        .collect(),
                    1 => {
                        let mut v = Vec::new();
                        for _ in 0..100 {
                            let s = sequence_value(
                                layout,
                                client.query_one("SELECT shard_0000.next_id()", &[]).await?.get(0),
                            );
                            v.push((s, s));
                        }
                        v
                    }
                    _ => {
                        let p = cluster.repo::<Photo>()?.insert(&photo(0, 500 + i)).await?;
                        let s = layout.sequence_value_of(p.id);
                        vec![(s, s)]
                    }
                };
                got.extend(ranges);
            }
            Ok::<_, BoxError>(got)
        }));
    }
    let mut target: Vec<(i64, i64)> = Vec::new();
    for m in target_minters {
        target.extend(m.await??);
    }
    stop.store(true, Ordering::Relaxed);
    let (mut source, mut refused) = (Vec::new(), Vec::new());
    for m in minters {
        let (got, r) = m.await?;
        assert!(!got.is_empty() && !r.is_empty(), "every minter ran until the fence stopped it");
        source.extend(got);
        refused.extend(r);
    }
    let source = merged(source);
    let handed: i64 = source.iter().map(|r| r.1 - r.0 + 1).sum();
    let source_max = source.last().ok_or("the source handed out IDs")?.1;
    let dups = overlap(&source, &target);
    let target_min = target.iter().map(|r| r.0).min().ok_or("the target minted")?;
    eprintln!(
        "      {handed} values handed out on the source; {} calls refused once fenced ({:?}); pause {} ms",
        refused.len(),
        refused.iter().collect::<std::collections::BTreeSet<_>>(),
        report.pause_ms
    );
    assert_eq!(
        dups, 0,
        "the target minted {dups} value(s) the source had handed out (source max {source_max})"
    );
    assert!(
        target_min > source_max,
        "the target's first value {target_min} is above the source's {source_max}"
    );
    // Refused only because the shard had gone: the capped sequence (2200H), the
    // renamed schema (3F000, 42P01) or its functions (42883).
    assert!(
        refused.iter().all(|c| ["2200H", "3F000", "42P01", "42883"].contains(&c.as_str())),
        "{refused:?}"
    );

    // The journal holds what the fence read; the source's sequence is capped there.
    let journal = moves::list(&config).await?;
    let detail = &journal[0].detail;
    assert_eq!(detail.fence_sequence, detail.sequence, "carried what the fence read");
    assert_eq!(detail.sequence_max, Some(layout.max_sequence_value()));
    let moved = format!("shard_0000_moved_{}", report.id);
    let pg2 = f.client(&ctx, 1).await?;
    let row = pg1
        .query_one(
            "SELECT last_value, max_value FROM pg_sequences WHERE schemaname = $1 AND sequencename = 'shardline_id_seq'",
            &[&moved],
        )
        .await?;
    assert_eq!((Some(row.get::<_, i64>(0)), Some(row.get::<_, i64>(1))), (detail.sequence, detail.sequence));
    assert!(source_max <= row.get::<_, i64>(0));

    // Fenced, then undone: the cap is lifted with the rename, and the shard mints again.
    moves::run(
        &config,
        crate::shard(0),
        &crate::host("pg1"),
        &MoveOptions::default().stopping_after(Step::Fenced),
    )
    .await
    .unwrap_err();
    let max: i64 = pg2
        .query_one("SELECT max_value FROM pg_sequences WHERE schemaname LIKE 'shard\\_0000\\_moved\\_%' AND sequencename = 'shardline_id_seq'", &[])
        .await?
        .get(0);
    let last: i64 = pg2
        .query_one(
            "SELECT last_value FROM pg_sequences WHERE schemaname LIKE 'shard\\_0000\\_moved\\_%' AND sequencename = 'shardline_id_seq'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(max, last, "fenced: capped at its last value");
    assert!(moves::abort(&config, crate::shard(0), &MoveOptions::default()).await?.unfenced);
    let max: i64 = pg2
        .query_one("SELECT max_value FROM pg_sequences WHERE schemaname = 'shard_0000' AND sequencename = 'shardline_id_seq'", &[])
        .await?
        .get(0);
    assert_eq!(max, layout.max_sequence_value());
    let after: i64 = pg2.query_one("SELECT shard_0000.next_id()", &[]).await?.get(0);
    assert!(layout.sequence_value_of(Id::from_i64(after)?) > last);
    Ok(())
}

/// Three hosts, six shards with the example's tables and `events`, a table without a
/// primary key (replica identity full), initialised; shard 0 seeded.
async fn with_a_keyless_table(
    ctx: &TestContext,
) -> Result<(Fixture, shardline_router::Config, Cluster), BoxError> {
    let f = Fixture::new(ctx, 3, 6).await?;
    f.migration(
        "0005_events.sql",
        "CREATE TABLE events (user_id bigint NOT NULL, what text NOT NULL);
         ALTER TABLE events REPLICA IDENTITY FULL;",
    )?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 2).await?;
    Ok((f, config, cluster))
}

shardline_testkit::register!(shared: verification_counts_duplicate_rows_of_a_table_without_a_key);
/// A table without a primary key (replica identity full) is verified as a multiset:
/// two copies of one row on the source against two of another on the target (which an
/// XOR of row hashes cancels out), or one duplicate too many, stop the move before the
/// flip, naming the table and the rows with how often each side holds them. Untouched,
/// the table moves, duplicates and all.
pub(crate) async fn verification_counts_duplicate_rows_of_a_table_without_a_key(
    ctx: TestContext,
) -> TestResult {
    let (f, config, cluster) = with_a_keyless_table(&ctx).await?;
    let (pg1, pg2) = (f.client(&ctx, 0).await?, f.client(&ctx, 1).await?);
    pg2.batch_execute(REPLICA).await?; // past the copy's guard, as an operator would be
    pg1.batch_execute(
        "INSERT INTO shard_0000.events VALUES (0, 'a'), (0, 'b'), (0, 'c'), (0, 'x'), (0, 'x')",
    )
    .await?;
    let stopping = MoveOptions::default().stopping_after(Step::SequenceCarried);
    let cases = [
        // Both copies of x become y on the target: same count, and the XOR of the row
        // hashes is the same on both sides.
        (
            "UPDATE shard_0000.events SET what = 'y' WHERE what = 'x'",
            "events: 2 differing key(s) (*): (0,x) (2 on pg1, 0 on pg2), (0,y) (0 on pg1, 2 on pg2)",
        ),
        // One copy of x too many on the target.
        (
            "INSERT INTO shard_0000.events VALUES (0, 'x')",
            "events: 1 differing key(s) (*): (0,x) (2 on pg1, 3 on pg2)",
        ),
    ];
    for (n, (corrupt, said)) in cases.into_iter().enumerate() {
        moves::run(&config, crate::shard(0), &crate::host("pg2"), &stopping).await.unwrap_err();
        pg2.batch_execute(corrupt).await?;
        let err = match moves::resume(&config, Some(crate::shard(0)), &MoveOptions::default()).await {
            Ok(done) => return Err(format!("{corrupt}: the move flipped: {}", done[0]).into()),
            Err(e) => e,
        };
        let text = err.to_string();
        assert!(matches!(err, OpsError::Verify { .. }), "{text}");
        assert!(text.contains(said), "{corrupt}: {text}");
        // Only that table differs; not flipped, undone: whole and writable on pg1.
        let journal = moves::list(&config).await?;
        assert_eq!(journal[n].state, State::RolledBack);
        let failed: Vec<&str> =
            journal[n].detail.tables.iter().filter(|t| !t.matches).map(|t| t.table.as_str()).collect();
        assert_eq!(failed, ["events"], "{corrupt}");
        assert_eq!(cluster.route_user(0).host.as_str(), "pg1");
        assert_eq!(counts(&f, &ctx, 1, "shard_0000").await?, None);
        assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    }
    // Untouched, it moves, every copy of every row with it.
    let report = moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default()).await?;
    let check = report.tables.iter().find(|t| t.table == "events").ok_or("events verified")?;
    assert!(check.matches && check.source_rows == 5 && check.target_rows == 5, "{report}");
    let rows: Vec<String> = pg2
        .query("SELECT what FROM shard_0000.events ORDER BY what", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(rows, ["a", "b", "c", "x", "x"]);
    Ok(())
}

shardline_testkit::register!(shared: a_fenced_step_that_outlasts_max_pause_is_given_up_and_writes_resume);
/// A step inside the fence that does not end while both hosts answer every probe: once
/// the comparison before the fence passed, a session on the target takes the copy of a
/// table without a key (compared in full inside the fence) for itself and keeps it. The
/// move is given up at `max_pause` after its fence and undone: the write that waited
/// behind the fence (sent when the fence was journaled) lands on the source, and the
/// session lets the table go only once that write is acknowledged. Before, the pause
/// lasted as long as the lock: the write failed after `move_wait`, and the move flipped
/// once the lock was let go.
pub(crate) async fn a_fenced_step_that_outlasts_max_pause_is_given_up_and_writes_resume(
    ctx: TestContext,
) -> TestResult {
    let (f, config, cluster) = with_a_keyless_table(&ctx).await?;
    let pg1 = f.client(&ctx, 0).await?;
    pg1.batch_execute("INSERT INTO shard_0000.events VALUES (0, 'a'), (0, 'b')").await?;
    let holder = Arc::new(f.client(&ctx, 1).await?);
    let hold: moves::HookFn = {
        let holder = holder.clone();
        Arc::new(move || {
            let holder = holder.clone();
            Box::pin(async move {
                if let Err(e) =
                    holder.batch_execute("BEGIN; LOCK TABLE shard_0000.events IN ACCESS EXCLUSIVE MODE").await
                {
                    eprintln!("      the drill could not lock the copy: {e}");
                }
            })
        })
    };
    // At the fence's journal entry: a write to the shard, which waits behind the fence;
    // once it is acknowledged (or has failed), the holder lets the table go.
    type Waited = Option<(Instant, Result<Duration, String>)>;
    let waited: Arc<std::sync::Mutex<Waited>> = Arc::default();
    let mut opts = MoveOptions::default().with_max_pause(Duration::from_secs(4)).on_compared(hold);
    opts.progress = Some({
        let (cluster, holder, waited) = (cluster.clone(), holder.clone(), waited.clone());
        Arc::new(move |p: &moves::MoveProgress| {
            if !matches!(p, moves::MoveProgress::Step { step: Step::Fenced, .. }) {
                return;
            }
            let (cluster, holder, waited) = (cluster.clone(), holder.clone(), waited.clone());
            tokio::spawn(async move {
                let fenced = Instant::now();
                let wrote = match cluster.repo::<Photo>() {
                    Ok(photos) => photos.insert(&photo(0, 9000)).await.map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                let wrote = wrote.map(|_| fenced.elapsed());
                if let Ok(mut w) = waited.lock() {
                    *w = Some((fenced, wrote));
                }
                if let Err(e) = holder.batch_execute("ROLLBACK").await {
                    eprintln!("      the drill could not let the copy go: {e}");
                }
            });
        })
    });
    let pg2 = crate::host("pg2");
    let moving = moves::run(&config, crate::shard(0), &pg2, &opts);
    let result = tokio::time::timeout(Duration::from_secs(90), moving)
        .await
        .map_err(|_| "the move held on for 90 s: nothing bounded the step inside its fence")?;
    let returned = Instant::now();
    let (fenced, wrote) =
        waited.lock().map_err(|e| e.to_string())?.clone().ok_or("no write was sent at the fence")?;
    let err = match result {
        Ok(report) => return Err(format!("the move flipped ({report}); the write: {wrote:?}").into()),
        Err(e) => e,
    };
    let text = err.to_string();
    // Given up inside the fence (in the verification, unless a loaded machine took the
    // whole pause before it).
    assert!(
        matches!(err, OpsError::PauseTooLong { step, .. } if step.pauses_writes() && step < Step::Verified),
        "{text}"
    );
    assert!(text.contains("max_pause") && text.contains("resume on the source"), "{text}");
    let wrote = wrote.map_err(|e| format!("the write behind the fence failed: {e}"))?;
    eprintln!(
        "      the write behind the fence landed {wrote:?} after the fence (max_pause 4 s); the move returned {:?} after it",
        returned.duration_since(fenced)
    );
    // The pause: max_pause, then the undo's unfencing (a transaction on the source).
    assert!(wrote < Duration::from_secs(12), "the write waited {wrote:?} behind the fence");
    // Undone: the shard whole and writable on its source, its write there; nothing left.
    let journal = moves::list(&config).await?;
    assert_eq!(journal[0].state, State::RolledBack);
    assert!(journal[0].error.as_deref().is_some_and(|e| e.contains("max_pause")), "{:?}", journal[0].error);
    assert_eq!(cluster.route_user(0).host.as_str(), "pg1");
    assert_eq!(counts(&f, &ctx, 1, "shard_0000").await?, None);
    let landed: i64 = pg1
        .query_one("SELECT count(*) FROM shard_0000.photos WHERE url = 'https://cdn/0/9000.jpg'", &[])
        .await?
        .get(0);
    assert_eq!(landed, 1);
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    // The whole shard compared inside the fence (`Verification::Full`: no change log,
    // whose triggers' drops wait a bounded time already): the undo's drop of the copy
    // waits on the same lock. It gives up at its own lock timeout and leaves the copy to
    // `gc`, named, and the move returns with the lock still held. Stopped before the
    // fence, the lock taken, then resumed. Before, the drop waited for the lock.
    let full = MoveOptions::default().verifying(moves::Verification::Full);
    let stopped =
        moves::run(&config, crate::shard(0), &pg2, &full.clone().stopping_after(Step::CaughtUp)).await;
    assert!(matches!(stopped, Err(OpsError::Interrupted { step: Step::CaughtUp, .. })), "{stopped:?}");
    let keeper = f.client(&ctx, 1).await?;
    keeper.batch_execute("BEGIN; LOCK TABLE shard_0000.events IN ACCESS EXCLUSIVE MODE").await?;
    let bounded = full.with_max_pause(Duration::from_secs(4));
    let resuming = moves::resume(&config, Some(crate::shard(0)), &bounded);
    let began = Instant::now();
    let resumed = tokio::time::timeout(Duration::from_secs(90), resuming)
        .await
        .map_err(|_| "the undo held on for 90 s behind the lock on the copy")?;
    let err = match resumed {
        Ok(done) => return Err(format!("the move flipped: {}", done[0]).into()),
        Err(e) => e,
    };
    eprintln!("      the resumed move returned {:?} after it began, the lock still held", began.elapsed());
    assert!(matches!(err, OpsError::PauseTooLong { .. }), "{err}");
    let journal = moves::list(&config).await?;
    let last = journal.last().ok_or("the resumed move in the journal")?;
    assert_eq!(last.state, State::RolledBack);
    assert!(
        last.detail.target_schema_left
            && last
                .detail
                .cleanup_pending
                .iter()
                .any(|p| { p.starts_with("pg2") && p.contains("shard_0000") && p.contains("55P03") }),
        "{:?}",
        last.detail.cleanup_pending
    );
    assert_eq!(cluster.route_user(0).host.as_str(), "pg1");
    // A gc run meanwhile leaves the locked copy to its next run, says so, and goes on
    // (before, its drop waited for the lock too).
    let held = moves::gc(&config, Duration::ZERO).await?;
    assert!(held.left.iter().any(|l| l.starts_with("pg2") && l.contains("55P03")), "{held:?}");
    keeper.batch_execute("ROLLBACK").await?;
    moves::gc(&config, Duration::ZERO).await?;
    assert_eq!(counts(&f, &ctx, 1, "shard_0000").await?, None);
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    // Nothing holds the copy now: the same move runs through.
    moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default()).await?;
    assert_eq!(counts(&f, &ctx, 0, "shard_0000").await?, None);
    Ok(())
}

shardline_testkit::register!(shared: a_tables_replica_identity_index_moves_with_it);
/// A table whose replica identity is a unique index (`REPLICA IDENTITY USING INDEX`):
/// the move keeps that index on the target through the copy (a secondary index
/// dropped for the copy and rebuilt would no longer be the identity, and the table
/// would have none), so an update on the source during the move is applied on the
/// target, and the moved table takes updates under a publication (a revertible
/// move's). Before: the target's apply failed on the update until the catch-up timed
/// out.
pub(crate) async fn a_tables_replica_identity_index_moves_with_it(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    f.migration(
        "0005_tags.sql",
        "CREATE TABLE tags (name text NOT NULL, n int);
         CREATE UNIQUE INDEX tags_name ON tags (name);
         ALTER TABLE tags REPLICA IDENTITY USING INDEX tags_name;
         -- A partition's identity, its index attached to its parent's (which the copy
         -- would drop, and the partition's with it).
         CREATE TABLE events (id bigint NOT NULL, k text NOT NULL, part int NOT NULL, n int,
                              PRIMARY KEY (id, part)) PARTITION BY LIST (part);
         CREATE TABLE events_1 PARTITION OF events FOR VALUES IN (1);
         CREATE UNIQUE INDEX events_k ON ONLY events (k, part);
         CREATE UNIQUE INDEX events_1_k ON events_1 (k, part);
         ALTER INDEX events_k ATTACH PARTITION events_1_k;
         ALTER TABLE events_1 REPLICA IDENTITY USING INDEX events_1_k;
         -- One whose identity is set by hand on the source, below.
         CREATE TABLE notes (k text NOT NULL, n int);
         CREATE UNIQUE INDEX notes_k ON notes (k);",
    )?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 2).await?;
    let (pg1, pg2) = (f.client(&ctx, 0).await?, f.client(&ctx, 1).await?);
    pg1.batch_execute(
        "INSERT INTO shard_0000.tags VALUES ('a', 1), ('b', 1);
         INSERT INTO shard_0000.events VALUES (1, 'a', 1, 1);
         INSERT INTO shard_0000.notes VALUES ('a', 1);
         ALTER TABLE shard_0000.notes REPLICA IDENTITY USING INDEX notes_k;",
    )
    .await?;
    // Through the copy (secondary indexes deferred), the identities stay on the target.
    let stopped = moves::run(
        &config,
        crate::shard(0),
        &crate::host("pg2"),
        &MoveOptions::default().revertible().stopping_after(Step::Prepared),
    )
    .await
    .map(|r| format!("the move ran to its end: {r}"))
    .expect_err("stopped after preparing");
    assert!(matches!(stopped, OpsError::Interrupted { .. }), "{stopped}");
    for index in ["tags_name", "events_1_k"] {
        let identity: Option<bool> = pg2
            .query_opt(
                "SELECT i.indisreplident FROM pg_index i
                   JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = 'shard_0000' AND c.relname = $1",
                &[&index],
            )
            .await?
            .map(|r| r.get(0));
        assert_eq!(
            identity,
            Some(true),
            "{index} is kept, still the identity, on the target through the copy"
        );
    }
    let mut to_caught_up = MoveOptions::default().revertible().stopping_after(Step::CaughtUp);
    to_caught_up.copy_timeout = Duration::from_secs(20);
    let stopped = moves::resume(&config, Some(crate::shard(0)), &to_caught_up)
        .await
        .map(|r| format!("the move ran to its end: {r:?}"))
        .expect_err("stopped after catching up");
    assert!(matches!(stopped, OpsError::Interrupted { .. }), "{stopped}");
    // Written on the source while the move streams its changes to the target.
    pg1.batch_execute(
        "UPDATE shard_0000.tags SET n = 2 WHERE name = 'a'; DELETE FROM shard_0000.tags WHERE name = 'b';
         UPDATE shard_0000.events SET n = 2; UPDATE shard_0000.notes SET n = 2;",
    )
    .await?;
    let mut resume = MoveOptions::default().revertible();
    resume.copy_timeout = Duration::from_secs(20);
    let done = moves::resume(&config, Some(crate::shard(0)), &resume).await?;
    assert_eq!(done.len(), 1);
    assert_eq!(cluster.route_user(0).host.as_str(), "pg2");
    let rows: Vec<(String, Option<i32>)> = pg2
        .query("SELECT name, n FROM shard_0000.tags ORDER BY name", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows, [("a".to_owned(), Some(2))]);
    for index in ["tags_name", "events_1_k", "notes_k"] {
        let identity: bool = pg2
            .query_one(
                "SELECT i.indisreplident FROM pg_index i WHERE i.indexrelid = ('shard_0000.' || $1)::regclass",
                &[&index],
            )
            .await?
            .get(0);
        assert!(identity, "{index} is its moved table's replica identity");
    }
    let updated: i64 = pg2
        .query_one(
            "SELECT (SELECT sum(n) FROM shard_0000.events) + (SELECT sum(n) FROM shard_0000.notes)",
            &[],
        )
        .await?
        .get::<_, Option<i64>>(0)
        .unwrap_or_default();
    assert_eq!(updated, 4, "the updates of the partition and of notes reached the target");
    // Published for the revert, the moved table still takes updates and deletes.
    pg2.batch_execute(
        "UPDATE shard_0000.tags SET n = 3 WHERE name = 'a'; DELETE FROM shard_0000.tags WHERE name = 'a'",
    )
    .await?;
    Ok(())
}

shardline_testkit::register!(shared: a_move_its_source_decided_to_undo_before_the_journal_said_so_is_finished_undone);
/// An undo commits `decided = 'undo'` on the source, then journals `undoing`: a mover
/// (an `--abort`, or the undo after a failed comparison) stopped between the two left a
/// move the journal calls resumable. Resuming it is refused (`Undoing`, as when the
/// journal says so) instead of failing at the fence ever after, and `gc` finishes the
/// undo: the shard whole on its source, nothing left behind, and a new move of it runs.
pub(crate) async fn a_move_its_source_decided_to_undo_before_the_journal_said_so_is_finished_undone(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 2).await?;
    let before = counts(&f, &ctx, 0, "shard_0000").await?;
    moves::run(
        &config,
        crate::shard(0),
        &crate::host("pg2"),
        &MoveOptions::default().stopping_after(Step::CaughtUp),
    )
    .await
    .unwrap_err();
    // What the undo's first transaction commits on the source, its journal write lost.
    let pg1 = f.client(&ctx, 0).await?;
    let marked =
        pg1.execute("UPDATE shardline.move_marks SET decided = 'undo' WHERE NOT fenced", &[]).await?;
    assert_eq!(marked, 1);
    let err = moves::resume(&config, Some(crate::shard(0)), &MoveOptions::default()).await.unwrap_err();
    assert!(matches!(err, OpsError::Undoing { shard, .. } if shard == 0), "{err}");
    assert_eq!(moves::list(&config).await?[0].state, State::Running, "the refusal changed nothing");
    let said = cli(&f, &["gc"]).await?;
    assert!(said.contains("its source had decided to undo it; the move is undone"), "{said}");
    let journal = moves::list(&config).await?;
    assert_eq!(journal[0].state, State::RolledBack, "{journal:?}");
    assert_eq!(counts(&f, &ctx, 1, "shard_0000").await?, None, "the target's copy is dropped");
    assert_eq!(counts(&f, &ctx, 0, "shard_0000").await?, before, "the shard whole on its source");
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default()).await?;
    assert_eq!(counts(&f, &ctx, 1, "shard_0000").await?, before);
    Ok(())
}

shardline_testkit::register!(shared: a_transaction_minting_then_writing_through_the_fence_does_not_stop_the_move);
/// A transaction that minted in one statement and writes the shard in a later one holds
/// the ID sequence while the fence, holding the tables, waits for it: a deadlock.
/// Postgres ends one of the two; either way the move finishes, and the transaction
/// either committed (its row moved with the shard) or got 40P01.
pub(crate) async fn a_transaction_minting_then_writing_through_the_fence_does_not_stop_the_move(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 2).await?;
    // Everything up to the fence first: creating the replication slot waits for every
    // transaction with an XID to end, and `nextval` takes one whenever it writes WAL
    // (one call in 32), so a transaction open across the slot's creation would hold the
    // move up before its fence, by chance.
    moves::run(
        &config,
        crate::shard(0),
        &crate::host("pg2"),
        &MoveOptions::default().stopping_after(Step::CaughtUp),
    )
    .await
    .unwrap_err();
    let (app, watch) = (f.client(&ctx, 0).await?, f.client(&ctx, 0).await?);
    app.batch_execute("BEGIN").await?;
    let id: i64 = app.query_one("SELECT shard_0000.next_id()", &[]).await?.get(0);
    let c = config.clone();
    let mover = tokio::spawn(async move {
        let mut done = moves::resume(&c, Some(crate::shard(0)), &MoveOptions::default()).await?;
        done.pop().ok_or(shardline_ops::Error::NoMove { shard: Some(crate::shard(0)) })
    });
    // Once the fence waits for the sequence (it holds the tables), the transaction writes.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let waiting: bool = watch
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_locks WHERE NOT granted
                                   AND relation = 'shard_0000.shardline_id_seq'::regclass)",
                &[],
            )
            .await?
            .get(0);
        if waiting {
            break;
        }
        assert!(Instant::now() < deadline && !mover.is_finished(), "the fence never waited for the sequence");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let wrote = app
        .execute("INSERT INTO shard_0000.photos (id, user_id, url) VALUES ($1, 0, 'mid-fence')", &[&id])
        .await;
    let committed = match wrote {
        Ok(_) => {
            app.batch_execute("COMMIT").await?;
            true
        }
        Err(e) => {
            assert_eq!(e.code().map(|c| c.code()), Some("40P01"), "{e}");
            app.batch_execute("ROLLBACK").await?;
            false
        }
    };
    let report = mover.await??;
    eprintln!(
        "      the transaction {}",
        if committed { "committed; the fence tried again" } else { "got 40P01" }
    );
    let on_target: i64 = f
        .client(&ctx, 1)
        .await?
        .query_one("SELECT count(*) FROM shard_0000.photos WHERE id = $1", &[&id])
        .await?
        .get(0);
    assert_eq!(on_target, i64::from(committed), "{report}");
    assert_eq!(counts(&f, &ctx, 1, "shard_0000").await?, Some([40 + i64::from(committed), 40, 40]));
    Ok(())
}

/// The newest move's state.
async fn latest_state(config: &shardline_router::Config) -> Result<State, BoxError> {
    let all = moves::list(config).await?;
    all.into_iter().max_by_key(|m| m.id).map(|m| m.state).ok_or_else(|| BoxError::from("no move"))
}

/// Polls `query` (one `bigint`) on `watch` until it is above zero, failing if `task`
/// ends first: the test's way to catch a step in progress.
async fn until_seen<T>(
    watch: &tokio_postgres::Client,
    query: &str,
    task: &tokio::task::JoinHandle<T>,
    what: &str,
) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if task.is_finished() {
            return Err(format!("the move ended before {what} was seen").into());
        }
        if Instant::now() > deadline {
            return Err(format!("{what} not seen within 120 s").into());
        }
        let n: i64 = watch.query_one(query, &[]).await?.get(0);
        if n > 0 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// After a case: `gc`, then the map and the data agree on one writable copy of shard 2
/// on `on` with `expected` rows, no slot, publication, subscription or old copy is left
/// anywhere, and a new write lands (counted into `expected`).
async fn one_writable_copy(
    f: &Fixture,
    ctx: &TestContext,
    case: &str,
    on: &str,
    expected: &mut [i64; 3],
) -> Result<(), BoxError> {
    let config = f.config()?;
    let said = cli(f, &["gc", "--grace", "0s"]).await?;
    let gone = if on == "pg2" { "pg3" } else { "pg2" };
    let fresh = Cluster::connect(&config, ClusterOptions::default()).await?;
    assert_eq!(fresh.route_user(2).host.as_str(), on, "{case}");
    assert_eq!(counts(f, ctx, host_index(on), "shard_0002").await?, Some(*expected), "{case}");
    assert_eq!(counts(f, ctx, host_index(gone), "shard_0002").await?, None, "{case}: {said}");
    assert_eq!(leftovers(f, ctx).await?, vec![0, 0, 0], "{case}: {said}");
    for h in 1..3 {
        let old: i64 = f
            .client(ctx, h)
            .await?
            .query_one("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'shard\\_0002\\_%'", &[])
            .await?
            .get(0);
        assert_eq!(old, 0, "{case}: an old copy is left on pg{}: {said}", h + 1);
    }
    let p = fresh.repo::<Photo>()?.insert(&photo(2, 3000 + usize::try_from(expected[0])?)).await?;
    assert_eq!(fresh.repo::<Photo>()?.get(p.id).await?.map(|g| g.id), Some(p.id), "{case}");
    expected[0] += 1;
    Ok(())
}

shardline_testkit::register!(exclusive: a_host_killed_inside_a_step_leaves_one_writable_copy);
/// A host killed while a step is in progress (not between steps), each point found by
/// polling the host, never by a sleep:
/// 1. the fence waiting for the shard's tables (a test transaction holds a lock; the
///    mover's ungranted lock seen in `pg_locks`): the source killed;
/// 2. the verification's checksum running on the source (seen in `pg_stat_activity`,
///    held there by a lock a test transaction has on the fenced copy): the source killed;
/// 3. the same on the target: the target killed.
///
/// The move fails naming the dead host; then one writable copy with every row, nothing
/// left after `gc`, and a new write lands.
pub(crate) async fn a_host_killed_inside_a_step_leaves_one_writable_copy(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = Arc::new(f.config()?);
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    // Shard 2 lives on pg2; the catalog on pg1 stays up throughout.
    seed(&cluster, 2, 6, 2).await?;
    let mut expected = [40, 40, 40];
    let (pg2, pg3) = (&ctx.hosts()[1], &ctx.hosts()[2]);
    let stop_after = |s: Step| MoveOptions::default().stopping_after(s);
    let waiting_checksum = "SELECT count(*) FROM pg_stat_activity
        WHERE query LIKE '%hash_record_extended%' AND query NOT LIKE '%pg_stat_activity%'
          AND wait_event_type = 'Lock'";

    // 1. Inside the fence: its LOCK TABLE waits behind a test transaction on the source.
    let case = "source pg2 killed while the fence waits for the shard's lock";
    moves::run(&config, crate::shard(2), &crate::host("pg3"), &stop_after(Step::CaughtUp)).await.unwrap_err();
    let holder = f.client(&ctx, 1).await?;
    holder.batch_execute("BEGIN; LOCK TABLE shard_0002.photos IN ROW EXCLUSIVE MODE").await?;
    let mut patient = MoveOptions::default();
    patient.lock_timeout = Duration::from_secs(120);
    let c = config.clone();
    let mover = tokio::spawn(async move { moves::resume(&c, Some(crate::shard(2)), &patient).await });
    let watch = f.client(&ctx, 1).await?;
    until_seen(
        &watch,
        "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
           JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = 'shard_0002' AND l.mode = 'ExclusiveLock' AND NOT l.granted",
        &mover,
        "the fence waiting",
    )
    .await?;
    pg2.kill().await?;
    drop((holder, watch));
    let err = mover.await?.unwrap_err();
    assert!(err.to_string().contains("pg2"), "{case}: the move fails naming the source: {err}");
    assert_eq!(latest_state(&config).await?, State::Running, "{case}");
    let err = moves::abort(&config, crate::shard(2), &MoveOptions::default()).await.unwrap_err();
    assert!(err.to_string().contains("pg2"), "{case}: abort needs the source: {err}");
    assert_eq!(latest_state(&config).await?, State::Running, "{case}");
    pg2.start().await?;
    moves::resume(&config, Some(crate::shard(2)), &MoveOptions::default()).await?;
    assert_eq!(latest_state(&config).await?, State::Done, "{case}");
    one_writable_copy(&f, &ctx, case, "pg3", &mut expected).await?;

    // 2. Inside the verification: its checksum on the source waits behind a test
    //    transaction's lock on the fenced copy; the source dies.
    let case = "source pg3 killed while the verification's checksum runs on it";
    moves::run(&config, crate::shard(2), &crate::host("pg2"), &stop_after(Step::SequenceCarried))
        .await
        .unwrap_err();
    let id = moves::list(&config).await?.into_iter().map(|m| m.id).max().ok_or("a move")?;
    let holder = f.client(&ctx, 2).await?;
    holder
        .batch_execute(&format!("BEGIN; LOCK TABLE shard_0002_moved_{id}.comments IN ACCESS EXCLUSIVE MODE"))
        .await?;
    let c = config.clone();
    let mover =
        tokio::spawn(async move { moves::resume(&c, Some(crate::shard(2)), &MoveOptions::default()).await });
    let watch = f.client(&ctx, 2).await?;
    until_seen(&watch, waiting_checksum, &mover, "the source's checksum").await?;
    pg3.kill().await?;
    drop((holder, watch));
    let err = mover.await?.unwrap_err();
    assert!(err.to_string().contains("pg3"), "{case}: the move fails naming the source: {err}");
    // It could not be undone at once (that needs the source): it stays, for abort.
    assert_eq!(latest_state(&config).await?, State::Running, "{case}");
    let err = moves::resume(&config, Some(crate::shard(2)), &MoveOptions::default()).await.unwrap_err();
    assert!(err.to_string().contains("pg3"), "{case}: resume needs the source: {err}");
    pg3.start().await?;
    let undone = moves::abort(&config, crate::shard(2), &MoveOptions::default()).await?;
    assert!(undone.unfenced && undone.cleanup_pending.is_empty(), "{case}: {undone}");
    one_writable_copy(&f, &ctx, case, "pg3", &mut expected).await?;

    // 3. Inside the verification, on the target: its checksum waits behind a test
    //    transaction's lock on the copy; the target dies. The move is undone at once
    //    (the source answers): writes resume on the source while the target is down.
    let case = "target pg2 killed while the verification's checksum runs on it";
    moves::run(&config, crate::shard(2), &crate::host("pg2"), &stop_after(Step::SequenceCarried))
        .await
        .unwrap_err();
    let holder = f.client(&ctx, 1).await?;
    holder.batch_execute("BEGIN; LOCK TABLE shard_0002.comments IN ACCESS EXCLUSIVE MODE").await?;
    let c = config.clone();
    let mover =
        tokio::spawn(async move { moves::resume(&c, Some(crate::shard(2)), &MoveOptions::default()).await });
    let watch = f.client(&ctx, 1).await?;
    until_seen(&watch, waiting_checksum, &mover, "the target's checksum").await?;
    pg2.kill().await?;
    drop((holder, watch));
    let err = mover.await?.unwrap_err();
    assert!(err.to_string().contains("pg2"), "{case}: the move fails naming the target: {err}");
    assert_eq!(latest_state(&config).await?, State::RolledBack, "{case}");
    let p = cluster.repo::<Photo>()?.insert(&photo(2, 2999)).await.map_err(|e| format!("{case}: {e}"))?;
    assert_eq!(cluster.route_user(2).host.as_str(), "pg3", "{case}");
    assert_eq!(cluster.repo::<Photo>()?.get(p.id).await?.map(|g| g.id), Some(p.id), "{case}");
    expected[0] += 1;
    pg2.start().await?;
    one_writable_copy(&f, &ctx, case, "pg3", &mut expected).await?;
    Ok(())
}

/// The fence's lease in the lease tests, and how long past it a write may take to get
/// through (the router asks the source every second; round trips on a busy machine).
const LEASE: Duration = Duration::from_secs(2);
const LEASE_SLACK: Duration = Duration::from_secs(5);

/// Whether `schema` (the shard's own name, not the fence's) is on host `h`: where it
/// is, a router whose map places the shard there writes.
async fn live(f: &Fixture, ctx: &TestContext, h: usize, schema: &str) -> Result<bool, BoxError> {
    let c = f.client(ctx, h).await?;
    Ok(c.query_one("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", &[&schema]).await?.get(0))
}

/// The hosts a write to shard 2 (moving pg2 -> pg3) can land on: the map's host (a
/// fresh router), and the source while its schema is live (a router with the old map).
/// The target's copy counts only once the map places the shard there.
async fn homes_of_shard_2(f: &Fixture, ctx: &TestContext, map_host: &str) -> Result<Vec<usize>, BoxError> {
    let mut homes = vec![host_index(map_host)];
    if live(f, ctx, 1, "shard_0002").await? && !homes.contains(&1) {
        homes.push(1);
    }
    Ok(homes)
}

/// Inserts a photo of user 2 (shard 2 of 6) through `cluster`; how long it took.
async fn timed_insert(cluster: &Cluster, n: usize) -> Result<(Photo, Duration), BoxError> {
    let started = Instant::now();
    let p = cluster.repo::<Photo>()?.insert(&photo(2, n)).await?;
    Ok((p, started.elapsed()))
}

/// After the fence was undone by a router: the mover cannot go on (resume finds the
/// lease gone and finishes the undo), the shard stays on pg2 with every acknowledged
/// row, the target's copy and the replication are gone.
async fn assert_undone_on_source(
    f: &Fixture,
    ctx: &TestContext,
    acknowledged: &[Photo],
) -> Result<(), BoxError> {
    let config = f.config()?;
    let err = moves::resume(&config, Some(crate::shard(2)), &MoveOptions::default()).await.unwrap_err();
    assert!(matches!(err, OpsError::LeaseExpired { shard, .. } if shard == 2), "{err}");
    let journal = moves::list(&config).await?;
    assert_eq!(journal.last().map(|m| m.state), Some(State::RolledBack), "{journal:?}");
    let fresh = Cluster::connect(&config, ClusterOptions::default()).await?;
    assert_eq!(fresh.route_user(2).host.as_str(), "pg2");
    assert_eq!(counts(f, ctx, 2, "shard_0002").await?, None, "the target's copy is dropped");
    let photos = fresh.repo::<Photo>()?;
    for p in acknowledged {
        assert_eq!(photos.get(p.id).await?.as_ref().map(|g| g.id), Some(p.id), "acknowledged {}", p.id);
    }
    let n = i64::try_from(acknowledged.len())?;
    assert_eq!(counts(f, ctx, 1, "shard_0002").await?, Some([40 + n, 40, 40]), "one copy, every row");
    assert_eq!(leftovers(f, ctx).await?, vec![0, 0, 0]);
    Ok(())
}

shardline_testkit::register!(shared: a_fence_whose_mover_died_is_undone_by_a_router_when_its_lease_runs_out);
/// The mover dies while the shard is fenced (stopped right after journaling the
/// fence): nobody renews the lease, and once it runs out the first write that finds the
/// shard fenced unfences it on its source, within the lease plus a few seconds, with
/// no operator. A router with the old map and one with the new both write there; the
/// mover, resumed, cannot flip any more.
pub(crate) async fn a_fence_whose_mover_died_is_undone_by_a_router_when_its_lease_runs_out(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let stale =
        Cluster::connect(&config, ClusterOptions { listen: false, ..ClusterOptions::default() }).await?;
    seed(&cluster, 2, 6, 2).await?;

    let died = moves::run(
        &config,
        crate::shard(2),
        &crate::host("pg3"),
        &MoveOptions::default().with_lease(LEASE).stopping_after(Step::Fenced),
    )
    .await
    .unwrap_err();
    let since = Instant::now();
    assert!(matches!(died, OpsError::Interrupted { step: Step::Fenced, .. }), "{died}");
    assert!(!live(&f, &ctx, 1, "shard_0002").await?, "the source is fenced");

    let (first, took) = timed_insert(&cluster, 100).await?;
    let total = since.elapsed();
    assert!(total <= LEASE + LEASE_SLACK, "the write got through {total:?} after the mover died");
    assert!(took >= LEASE / 2, "the write waited for the lease ({took:?})");
    let (second, _) = timed_insert(&stale, 101).await?;
    assert_eq!(homes_of_shard_2(&f, &ctx, cluster.route_user(2).host.as_str()).await?, vec![1]);
    eprintln!("      write through {total:?} after the mover died (lease {LEASE:?})");

    assert_undone_on_source(&f, &ctx, &[first, second]).await
}

shardline_testkit::register!(shared: a_fence_whose_commit_reply_was_lost_is_undone_when_its_lease_runs_out);
/// The fence's COMMIT applied but its reply lost (the drill: the mover stops right
/// after the commit, before journaling the fence or renewing its lease): the journal
/// says the move only caught up, the source is fenced; the lease runs out and a write
/// unfences it, within the lease plus a few seconds.
pub(crate) async fn a_fence_whose_commit_reply_was_lost_is_undone_when_its_lease_runs_out(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 2, 6, 2).await?;

    let lost = moves::run(
        &config,
        crate::shard(2),
        &crate::host("pg3"),
        &MoveOptions::default().with_lease(LEASE).losing_fence_reply(),
    )
    .await
    .unwrap_err();
    let since = Instant::now();
    assert!(matches!(lost, OpsError::Interrupted { step: Step::CaughtUp, .. }), "{lost}");
    assert_eq!(moves::list(&config).await?[0].step, Step::CaughtUp, "the fence is not journaled");
    assert!(!live(&f, &ctx, 1, "shard_0002").await?, "the source is fenced");

    let (first, _) = timed_insert(&cluster, 100).await?;
    let total = since.elapsed();
    assert!(total <= LEASE + LEASE_SLACK, "the write got through {total:?} after the fence");
    assert_eq!(homes_of_shard_2(&f, &ctx, cluster.route_user(2).host.as_str()).await?, vec![1]);
    eprintln!("      write through {total:?} after the fence's lost reply (lease {LEASE:?})");

    assert_undone_on_source(&f, &ctx, &[first]).await
}

shardline_testkit::register!(exclusive: a_catalog_frozen_after_the_flip_fails_the_move_in_time_and_resume_finishes_it);
/// The catalog (host 0) frozen inside a flipped move, once its clean-up is done (a
/// drill's hook): its last write to the journal gets no answer. The move returns within its `hung_after`
/// (before: it waited for as long as the catalog stayed frozen, holding the move's
/// lock), the shard already routed to its target; thawed, `--resume` finishes it.
pub(crate) async fn a_catalog_frozen_after_the_flip_fails_the_move_in_time_and_resume_finishes_it(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 2, 6, 2).await?;
    let catalog = &ctx.hosts()[0];
    let mut opts = MoveOptions::default();
    opts.hung_after = Duration::from_secs(3);
    // Frozen inside the move, once its clean-up is done: its next call is the last
    // journal write.
    let frozen_at = Arc::new(std::sync::OnceLock::new());
    let (hook_ctx, hook_at) = (ctx.clone(), Arc::clone(&frozen_at));
    opts.on_cleaned = Some(Arc::new(move || {
        let (ctx, at) = (hook_ctx.clone(), Arc::clone(&hook_at));
        Box::pin(async move {
            let paused = ctx.hosts()[0].pause().await.map_err(|e| e.to_string());
            let _ = at.set((paused, Instant::now()));
        })
    }));
    let pg3 = crate::host("pg3");
    let run = moves::run(&config, crate::shard(2), &pg3, &opts);
    let result = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .map_err(|_| "the move did not return within 60 s of its start");
    let ended = Instant::now();
    catalog.resume().await?;
    let result = result?;
    let (paused, frozen) = frozen_at.get().cloned().ok_or("the move never finished its clean-up")?;
    paused?;
    let took = ended.saturating_duration_since(frozen);
    let err = result.expect_err("the move's last journal write got no answer");
    assert!(err.to_string().contains("the catalog answered nothing"), "{err}");
    assert!(took < Duration::from_secs(15), "the move returned {took:?} after the catalog froze");
    eprintln!("      the move returned {took:?} after the catalog froze: {err}");
    let done = moves::resume(&config, Some(crate::shard(2)), &MoveOptions::default()).await?;
    assert_eq!(done.len(), 1);
    assert_eq!(moves::list(&config).await?.iter().filter(|m| m.state == State::Running).count(), 0);
    let fresh = Cluster::connect(&config, ClusterOptions::default()).await?;
    assert_eq!(fresh.route_user(2).host.as_str(), "pg3");
    Ok(())
}

shardline_testkit::register!(exclusive: a_fence_outliving_the_catalog_is_undone_on_its_source_when_its_lease_runs_out);
/// The catalog (host 0) dies while shard 2 is fenced between pg2 and pg3: the router
/// cannot read the map or the journal, asks the source at once, and once the lease ran
/// out writes there, within the lease plus a few seconds. The catalog back, `gc`
/// finishes the undo: map, data and journal agree, one copy with every row.
pub(crate) async fn a_fence_outliving_the_catalog_is_undone_on_its_source_when_its_lease_runs_out(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 2, 6, 2).await?;
    let pg1 = &ctx.hosts()[0];

    moves::run(
        &config,
        crate::shard(2),
        &crate::host("pg3"),
        &MoveOptions::default().with_lease(LEASE).stopping_after(Step::SequenceCarried),
    )
    .await
    .unwrap_err();
    let since = Instant::now();
    pg1.kill().await?;
    let killed = since.elapsed();
    assert!(!live(&f, &ctx, 1, "shard_0002").await?, "the source is fenced");

    let written = timed_insert(&cluster, 100).await;
    let total = since.elapsed();
    let (first, _) = written?;
    assert!(
        total <= LEASE + LEASE_SLACK + killed,
        "the write got through {total:?} after the mover died ({killed:?} to kill the catalog)"
    );
    // The map (as the router holds it) and the source agree; the target is no home.
    assert_eq!(homes_of_shard_2(&f, &ctx, cluster.route_user(2).host.as_str()).await?, vec![1]);
    let (second, _) = timed_insert(&cluster, 101).await?;
    eprintln!("      write through {total:?} after the mover died, the catalog down (lease {LEASE:?})");

    pg1.start().await?;
    let journal = moves::list(&config).await?;
    assert_eq!(journal[0].state, State::Running, "nobody told the journal yet");
    let said = cli(&f, &["gc"]).await?;
    assert!(said.contains("lease ran out"), "{said}");
    let journal = moves::list(&config).await?;
    assert_eq!(journal[0].state, State::RolledBack, "{journal:?}");
    let fresh = Cluster::connect(&config, ClusterOptions::default()).await?;
    assert_eq!(fresh.route_user(2).host.as_str(), "pg2");
    assert_eq!(counts(&f, &ctx, 2, "shard_0002").await?, None, "the target's copy is dropped");
    assert_eq!(counts(&f, &ctx, 1, "shard_0002").await?, Some([42, 40, 40]), "one copy, every row");
    for p in [first, second] {
        assert_eq!(fresh.repo::<Photo>()?.get(p.id).await?.map(|g| g.id), Some(p.id));
    }
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    Ok(())
}

shardline_testkit::register!(shared: a_flip_decided_on_the_source_is_completed_by_a_router_never_undone);
/// The mover dies right after the source decided to flip (the test decides as the
/// mover does: the proof's SHA-256 journaled, then `decided = 'flip'` with the token on
/// the source): the fence is never undone; a write that finds the shard fenced
/// completes the flip in the catalog and lands on the target; the flip cannot be had
/// without the token; `--abort` is refused and `--resume` finishes.
pub(crate) async fn a_flip_decided_on_the_source_is_completed_by_a_router_never_undone(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 2, 6, 2).await?;
    moves::run(
        &config,
        crate::shard(2),
        &crate::host("pg3"),
        &MoveOptions::default().with_lease(LEASE).stopping_after(Step::Verified),
    )
    .await
    .unwrap_err();
    let (catalog, source) = (f.client(&ctx, 0).await?, f.client(&ctx, 1).await?);
    let id: i64 =
        catalog.query_one("SELECT id FROM shardline.moves WHERE state = 'running'", &[]).await?.get(0);
    let token = "a-token-only-the-source-holds";
    catalog
        .execute(
            "UPDATE shardline.moves SET detail = detail || jsonb_build_object('flip_check',
                    encode(sha256(convert_to($2::text, 'UTF8')), 'hex')) WHERE id = $1",
            &[&id, &token],
        )
        .await?;
    let decided = source
        .execute(
            "UPDATE shardline.move_marks SET decided = 'flip', flip_token = $2
              WHERE move_id = $1 AND fenced AND decided IS NULL AND lease_until > clock_timestamp()",
            &[&id, &token],
        )
        .await?;
    assert_eq!(decided, 1, "decided while the lease ran");
    let wrong: bool =
        catalog.query_one("SELECT shardline.complete_flip($1, 'guessed')", &[&id]).await?.get(0);
    assert!(!wrong, "no flip without the token");
    tokio::time::sleep(LEASE).await;
    // The lease has run out, but the flip is decided: resolving never undoes it.
    let outcome: String =
        source.query_one("SELECT outcome FROM shardline.resolve_fence('shard_0002')", &[]).await?.get(0);
    assert_eq!(outcome, "flip");
    assert!(!live(&f, &ctx, 1, "shard_0002").await?, "the source stays fenced");
    let err = moves::abort(&config, crate::shard(2), &MoveOptions::default()).await.unwrap_err();
    assert!(matches!(err, OpsError::FlipDecided { id: i, shard } if i == id && shard == 2), "{err}");

    let (first, took) = timed_insert(&cluster, 100).await?;
    assert!(took <= LEASE_SLACK, "the write got through after {took:?}");
    assert_eq!(cluster.route_user(2).host.as_str(), "pg3");
    assert_eq!(homes_of_shard_2(&f, &ctx, "pg3").await?, vec![2]);
    assert_eq!(moves::list(&config).await?[0].step, Step::Flipped);
    let done = moves::resume(&config, Some(crate::shard(2)), &MoveOptions::default()).await?;
    assert_eq!(done.len(), 1);
    assert_eq!(moves::list(&config).await?[0].state, State::Done);
    assert_eq!(counts(&f, &ctx, 2, "shard_0002").await?, Some([41, 40, 40]), "one copy, every row");
    assert_eq!(cluster.repo::<Photo>()?.get(first.id).await?.map(|p| p.id), Some(first.id));
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    Ok(())
}

shardline_testkit::register!(shared: a_target_corrupted_after_the_comparison_before_the_fence_does_not_flip);
/// The whole shard is compared before the fence; from then on only the keys the change
/// logs hold are read again inside it. A copy changed behind the move's back at that
/// point (acted on through the `on_compared` drill, right after the comparison passed)
/// is caught by the change log on the target: an updated photo, a deleted comment and an
/// inserted like stop the move before the flip, named, and it is undone, leaving
/// nothing behind. A change made with the target's trigger disabled (so not logged) is
/// caught by the comparison itself, before anything is fenced.
pub(crate) async fn a_target_corrupted_after_the_comparison_before_the_fence_does_not_flip(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let made = seed(&cluster, 0, 6, 2).await?;
    let pg2 = f.client(&ctx, 1).await?;
    pg2.batch_execute(REPLICA).await?; // past the copy's guard, as an operator would be
    let pg2 = Arc::new(pg2);
    let done: Arc<std::sync::Mutex<Option<Result<i64, String>>>> = Arc::default();
    let (photo_id, comment_of, liked) = (i64::from(made[3].id), i64::from(made[5].id), i64::from(made[7].id));
    let hook: moves::HookFn = {
        let (pg2, done) = (pg2.clone(), done.clone());
        Arc::new(move || {
            let (pg2, done) = (pg2.clone(), done.clone());
            Box::pin(async move {
                let corrupt = async {
                    pg2.execute(
                        "UPDATE shard_0000.photos SET caption = 'tampered' WHERE id = $1",
                        &[&photo_id],
                    )
                    .await?;
                    let gone: i64 = pg2
                        .query_one(
                            "DELETE FROM shard_0000.comments WHERE photo_id = $1 RETURNING id",
                            &[&comment_of],
                        )
                        .await?
                        .get(0);
                    pg2.execute(
                        "INSERT INTO shard_0000.likes (photo_id, user_id, id) VALUES ($1, 999, $1)",
                        &[&liked],
                    )
                    .await?;
                    Ok::<_, tokio_postgres::Error>(gone)
                };
                let r = corrupt.await.map_err(|e| e.to_string());
                if let Ok(mut d) = done.lock() {
                    *d = Some(r);
                }
            })
        })
    };
    let err =
        moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default().on_compared(hook))
            .await
            .unwrap_err();
    let gone = done.lock().map_err(|e| e.to_string())?.clone().ok_or("the drill ran")??;
    let text = err.to_string();
    assert!(matches!(err, OpsError::Verify { .. }), "{text}");
    assert!(text.contains(&format!("photos: 1 differing key(s) (id): ({photo_id})")), "{text}");
    assert!(text.contains(&format!("comments: 1 differing key(s) (id): ({gone})")), "{text}");
    assert!(
        text.contains(&format!("likes: 1 differing key(s) (photo_id, user_id): ({liked},999)")),
        "{text}"
    );
    // Caught inside the fence (the source was fenced, then unfenced), from the logs.
    let journal = moves::list(&config).await?;
    assert_eq!(journal[0].state, State::RolledBack);
    assert_eq!(journal[0].step, Step::SequenceCarried);
    assert_eq!(journal[0].detail.rechecked_rows, Some(3), "only the three keys written were read again");
    assert_eq!(cluster.route_user(0).host.as_str(), "pg1");
    assert_eq!(counts(&f, &ctx, 0, "shard_0000").await?, Some([40, 40, 40]));
    assert_eq!(counts(&f, &ctx, 1, "shard_0000").await?, None);
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);

    // Not logged: the target's trigger disabled while the copy is changed. The
    // comparison finds a key in no change log and stops the move before the fence.
    moves::run(
        &config,
        crate::shard(0),
        &crate::host("pg2"),
        &MoveOptions::default().stopping_after(Step::CaughtUp),
    )
    .await
    .unwrap_err();
    let id = moves::list(&config).await?.into_iter().map(|m| m.id).max().ok_or("a move")?;
    pg2.batch_execute(&format!(
        "ALTER TABLE shard_0000.photos DISABLE TRIGGER shardline_move_{id};
         UPDATE shard_0000.photos SET caption = 'unlogged' WHERE id = {photo_id};
         ALTER TABLE shard_0000.photos ENABLE ALWAYS TRIGGER shardline_move_{id};"
    ))
    .await?;
    let err = moves::resume(&config, Some(crate::shard(0)), &MoveOptions::default()).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, OpsError::Verify { .. }), "{text}");
    assert!(text.contains(&format!("photos: 1 differing key(s) (id): ({photo_id})")), "{text}");
    let journal = moves::list(&config).await?;
    let last = journal.iter().max_by_key(|m| m.id).ok_or("a move")?;
    assert_eq!((last.state, last.step), (State::RolledBack, Step::CaughtUp), "never fenced");
    assert_eq!(last.detail.fence_mark, None);
    assert_eq!(counts(&f, &ctx, 0, "shard_0000").await?, Some([40, 40, 40]));
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    // Untouched, it moves.
    let report = moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default()).await?;
    assert_eq!((report.rows, report.rechecked_rows), (120, 0), "{report}");
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    Ok(())
}

shardline_testkit::register!(shared: a_move_whose_copy_keeps_its_guards_leaves_the_shard_writable);
/// The copy's guards let writes through only while the move's marker on the target says
/// it decided to flip. A session that holds a lock on the target's table from the
/// comparison before the fence (taken by the `on_compared` drill) until the move
/// returns keeps both of the move's attempts to drop the guards from getting theirs;
/// the move still ends, and names the guards and the marker as left to `gc`. The shard
/// then takes writes on its new host, through the repository, at once; `gc` drops the
/// guards and the marker. (Before, the clean-up deleted the marker anyway, and every
/// write to the moved shard failed as fenced (3F000) until `gc` ran: the insert below
/// waited out `move_wait` and failed.)
pub(crate) async fn a_move_whose_copy_keeps_its_guards_leaves_the_shard_writable(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let options = ClusterOptions { move_wait: Duration::from_secs(3), ..ClusterOptions::default() };
    let cluster = Cluster::connect(&config, options).await?;
    seed(&cluster, 0, 6, 1).await?;
    let (locked_tx, locked_rx) = tokio::sync::oneshot::channel::<Result<(), String>>();
    let locked_tx = Arc::new(std::sync::Mutex::new(Some(locked_tx)));
    // Holds ACCESS SHARE on the copy's photos (as a long read would) from the drill on.
    let pg2 = Arc::new(f.client(&ctx, 1).await?);
    let hook: moves::HookFn = {
        let (locked_tx, pg2) = (locked_tx.clone(), pg2.clone());
        Arc::new(move || {
            let (locked_tx, pg2) = (locked_tx.clone(), pg2.clone());
            Box::pin(async move {
                let r = pg2
                    .batch_execute("BEGIN; LOCK TABLE shard_0000.photos IN ACCESS SHARE MODE")
                    .await
                    .map_err(|e| e.to_string());
                let sender = locked_tx.lock().ok().and_then(|mut s| s.take());
                if let Some(sender) = sender {
                    let _ = sender.send(r);
                }
            })
        })
    };
    let report =
        moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default().on_compared(hook))
            .await?;
    locked_rx.await.map_err(|_| "the drill ran")??;
    cluster.refresh().await?;
    assert_eq!(cluster.route_user(0).host.as_str(), "pg2");
    // Written while the guards are still on the copy (the lock is still held).
    let started = Instant::now();
    let written = cluster.repo::<Photo>()?.insert(&photo(0, 99)).await;
    let written = written.map_err(|e| format!("a write to the moved shard, its guards still there: {e}"))?;
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    let pending = report.cleanup_pending.join("; ");
    assert!(pending.contains("guards") && pending.contains("marker"), "{pending}");
    pg2.batch_execute("ROLLBACK").await?;
    let left = "SELECT (SELECT count(*) FROM pg_trigger WHERE tgname = 'shardline_revert_guard'),
                       (SELECT count(*) FROM shardline.move_marks WHERE decided = 'flip')";
    let pg2 = f.client(&ctx, 1).await?;
    let row = pg2.query_one(left, &[]).await?;
    let (guards, marks): (i64, i64) = (row.get(0), row.get(1));
    assert!(guards > 0 && marks == 1, "the guards ({guards}) and the marker ({marks}) were left for gc");
    // The sqlx path does not take those guards (they pass writes) for a sign that the
    // shard moved: a unit of work's own mistake comes back at once, from one run.
    // (Before, it waited out `move_wait` and ran the work again, three runs in all.)
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let started = Instant::now();
    let err = cluster
        .sqlx()
        .transaction(crate::shard(0), |conn| {
            runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Box::pin(async move {
                ::sqlx::query("SELECT FROM no_such_table").execute(&mut **conn).await.map(drop)
            })
        })
        .await
        .expect_err("a statement naming no table");
    assert_eq!(err.sqlstate(), Some("42P01"), "{err}");
    let runs = runs.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        runs == 1 && started.elapsed() < Duration::from_secs(2),
        "{runs} runs in {:?}",
        started.elapsed()
    );
    // The shard's next move drops the stale guards from its source, where the shard is
    // live (a fence would hide them from gc, and an undo bring them back unmarked).
    let err = moves::run(
        &config,
        crate::shard(0),
        &crate::host("pg3"),
        &MoveOptions::default().stopping_after(Step::Prepared),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, OpsError::Interrupted { step: Step::Prepared, .. }), "{err}");
    let row = pg2.query_one(left, &[]).await?;
    assert_eq!(row.get::<_, i64>(0), 0, "the next move dropped its source's stale guards");
    moves::abort(&config, crate::shard(0), &MoveOptions::default()).await?;
    // The copy's ID sequence capped as the carry leaves it, as when the decision never
    // reached the copy (its host down from the decision through the clean-up): `gc`
    // lifts it where the map places the shard. (Before, nothing did: every insert
    // failed, the shard writable for updates only.)
    pg2.batch_execute(
        "DO $c$ DECLARE v bigint; BEGIN
           SELECT greatest(last_value, 1) INTO v FROM shard_0000.shardline_id_seq;
           EXECUTE format('ALTER SEQUENCE shard_0000.shardline_id_seq MAXVALUE %s', v);
           PERFORM setval('shard_0000.shardline_id_seq', v, true);
         END $c$",
    )
    .await?;
    let capped = cluster.repo::<Photo>()?.insert(&photo(0, 99)).await;
    assert!(capped.is_err(), "an insert with the sequence capped: {capped:?}");
    // A cap `gc` cannot lift (its sequence's lock held, as a long minting transaction
    // would): reported, and the marker the guards pass writes by is kept; the next run
    // lifts it. (Before, the run failed there, or dropped the marker.)
    let holder = f.client(&ctx, 1).await?;
    holder.batch_execute("BEGIN; ALTER SEQUENCE shard_0000.shardline_id_seq OWNED BY NONE").await?;
    let report = moves::gc(&config, Duration::ZERO).await?;
    assert!(report.left.iter().any(|l| l.contains("shard_0000")), "{report}");
    let row = pg2.query_one(left, &[]).await?;
    assert_eq!(row.get::<_, i64>(1), 1, "the marker stays with the cap: {report}");
    holder.batch_execute("ROLLBACK").await?;
    moves::gc(&config, Duration::ZERO).await?;
    let row = pg2.query_one(left, &[]).await?;
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (0, 0), "gc dropped the guards and the marker");
    let again = cluster.repo::<Photo>()?.insert(&photo(0, 100)).await?;
    for id in [written.id, again.id] {
        assert_eq!(cluster.repo::<Photo>()?.get(id).await?.map(|p| p.id), Some(id));
    }
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    Ok(())
}

shardline_testkit::register!(shared: the_fence_reads_only_the_rows_written_during_the_move);
/// The pause does not grow with the shard, shown by what it reads (not by a clock):
/// two shards, one ten times the other, each given the same writes through the
/// repository after its change log started (3 photos inserted, 2 captions changed, a
/// like added); each move's round before the fence reads exactly those 6 rows, and the
/// fence none (nothing was written since), while the comparison before the fence
/// covered every row. The rival (the full
/// verification inside the fence) reads every row.
pub(crate) async fn the_fence_reads_only_the_rows_written_during_the_move(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let small = seed(&cluster, 0, 6, 2).await?;
    let large = seed(&cluster, 1, 6, 20).await?;
    for (shard, made, rows) in [(0u16, &small, 120), (1, &large, 1200)] {
        moves::run(
            &config,
            crate::shard(shard),
            &crate::host("pg3"),
            &MoveOptions::default().stopping_after(Step::CaughtUp),
        )
        .await
        .unwrap_err();
        let photos = cluster.repo::<Photo>()?;
        let user = i64::from(shard);
        for n in 0..3 {
            photos.insert(&photo(user, 500 + n)).await?;
        }
        for p in &made[..2] {
            photos.update(p.id, &[("caption", &"changed during the move")]).await?;
        }
        cluster.repo::<Like>()?.insert(&NewLike { photo_id: made[2].id, user_id: 4242 }).await?;
        let report = moves::resume(&config, Some(crate::shard(shard)), &MoveOptions::default()).await?;
        let r = report.first().ok_or("a report")?;
        assert_eq!(r.rows, rows + 4, "{r}");
        let pre = moves::list(&config)
            .await?
            .into_iter()
            .find(|m| m.id == r.id)
            .and_then(|m| m.detail.precheck)
            .ok_or("the comparison journaled")?;
        let rounds: Vec<(i64, i64)> = pre.rounds.iter().map(|x| (x.keys, x.pending)).collect();
        assert_eq!(rounds, [(6, 0)], "one round before the fence read the 6 rows written during the move");
        assert_eq!(r.rechecked_rows, 0, "nothing was written since, so the fence read nothing again: {r}");
        let compared: i64 = pre.tables.values().map(|t| t.0).sum();
        assert_eq!(compared, rows + 4, "the comparison before the fence covered every row");
    }
    // The rival reads every row inside the fence.
    let full = moves::run(
        &config,
        crate::shard(0),
        &crate::host("pg1"),
        &MoveOptions::default().verifying(moves::Verification::Full),
    )
    .await?;
    assert_eq!((full.rechecked_rows, full.compare_ms), (124, 0), "{full}");
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    Ok(())
}

shardline_testkit::register!(shared: rounds_before_the_fence_leave_it_only_the_keys_written_since_the_last);
/// Rounds before the fence, shown by what they read (not by a clock): a writer inserts
/// two photos through the repository in every round, right after the round took its
/// keys (the `on_round` drill). Asked to go on until no key is left, at most three
/// rounds, the move runs three: the first reads the five photos written once the change
/// log started, each later one the two its predecessor's writer left, and the fence
/// rechecks exactly the two written during the last round.
pub(crate) async fn rounds_before_the_fence_leave_it_only_the_keys_written_since_the_last(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 2).await?;
    moves::run(
        &config,
        crate::shard(0),
        &crate::host("pg2"),
        &MoveOptions::default().stopping_after(Step::CaughtUp),
    )
    .await
    .unwrap_err();
    let photos = cluster.repo::<Photo>()?;
    for n in 0..5 {
        photos.insert(&photo(0, 600 + n)).await?;
    }
    let written: Arc<std::sync::Mutex<Vec<Result<i64, String>>>> = Arc::default();
    let hook: moves::HookFn = {
        let (cluster, written) = (cluster.clone(), written.clone());
        Arc::new(move || {
            let (cluster, written) = (cluster.clone(), written.clone());
            Box::pin(async move {
                let write = async {
                    let photos = cluster.repo::<Photo>()?;
                    let mut ids = 0;
                    for n in 0..2 {
                        ids += i64::from(photos.insert(&photo(0, 700 + n)).await?.id);
                    }
                    Ok::<_, BoxError>(ids)
                };
                let r = write.await.map_err(|e| e.to_string());
                if let Ok(mut w) = written.lock() {
                    w.push(r);
                }
            })
        })
    };
    let options = MoveOptions::default().with_rounds(0, 3).on_round(hook);
    let report = moves::resume(&config, Some(crate::shard(0)), &options).await?;
    let r = report.first().ok_or("a report")?;
    let writes = written.lock().map_err(|e| e.to_string())?.clone();
    assert_eq!(writes.len(), 3, "the writer ran once per round");
    for w in writes {
        w?;
    }
    let pre = moves::list(&config)
        .await?
        .into_iter()
        .find(|m| m.id == r.id)
        .and_then(|m| m.detail.precheck)
        .ok_or("the comparison journaled")?;
    let read: Vec<(i64, i64)> = pre.rounds.iter().map(|x| (x.keys, x.pending)).collect();
    assert_eq!(read, [(5, 2), (2, 2), (2, 2)], "each round read what was written since the last: {pre:?}");
    assert_eq!(pre.verified_round, 3);
    assert_eq!(r.rechecked_rows, 2, "the fence rechecked only the two photos of the last round: {r}");
    assert_eq!(r.rows, 120 + 5 + 6, "{r}");
    assert_eq!(cluster.route_user(0).host.as_str(), "pg2");
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    Ok(())
}

shardline_testkit::register!(shared: a_migration_and_a_move_never_overlap_under_writes);
/// DDL is not replicated, so a migration and a move must never run over each other.
/// Both orders, with a writer on the moving shard throughout:
/// 1. a move running (stopped once caught up): `migrate` refuses naming its shard and
///    changes nothing; the move finishes; `migrate` then reaches the shard on its new
///    host;
/// 2. a migration seen in progress (inside its slow file on a host): a move refuses
///    (its pre-flight, or the lock) and changes nothing; once the migration is done, the move carries the
///    migrated tables.
///
/// Every acknowledged write is on the shard's last host once.
pub(crate) async fn a_migration_and_a_move_never_overlap_under_writes(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 1).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (cluster, stop) = (cluster.clone(), stop.clone());
        tokio::spawn(async move {
            let photos = cluster.repo::<Photo>()?;
            let mut acked = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let n = acked.len();
                let user = 6 * i64::try_from(n % 20).unwrap_or(0);
                acked.push(photos.insert(&photo(user, 1000 + n)).await?.id);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Ok::<_, shardline_repo::Error>(acked)
        })
    };
    // Which hosts' shard_0000.photos have `column`.
    let with_column = |column: &'static str| {
        let (f, ctx) = (&f, &ctx);
        async move {
            let mut hosts = Vec::new();
            for h in 0..3 {
                let has: bool = f
                    .client(ctx, h)
                    .await?
                    .query_one(
                        "SELECT EXISTS (SELECT FROM pg_attribute
                                         WHERE attrelid = to_regclass('shard_0000.photos') AND attname = $1)",
                        &[&column],
                    )
                    .await?
                    .get(0);
                if has {
                    hosts.push(h);
                }
            }
            Ok::<_, BoxError>(hosts)
        }
    };

    // 1. A move running, then a migration.
    stopped_after(&config, 0, "pg2", Step::CaughtUp).await?;
    f.migration("0005_tags.sql", "ALTER TABLE photos ADD COLUMN tags text;\n")?;
    let err = shardline_ops::migrate(&config, &options(1), &quiet).await.unwrap_err();
    assert!(matches!(&err, OpsError::MoveRunning { shard } if shard.get() == 0), "{err}");
    assert!(with_column("tags").await?.is_empty(), "a refused migration changed nothing");
    moves::resume(&config, Some(crate::shard(0)), &MoveOptions::default()).await?;
    shardline_ops::migrate(&config, &options(1), &quiet).await?;
    assert_eq!(with_column("tags").await?, vec![1], "the shard migrated on its new host");

    // 2. A migration in progress, then a move.
    // Each shard's transaction sleeps 1.5 s, so the migration (3 shards on pg2, one at a
    // time) outlasts the move's pre-flight on a loaded machine.
    f.migration("0006_mood.sql", "SELECT pg_sleep(1.5);\nALTER TABLE photos ADD COLUMN mood text;\n")?;
    let migrating = {
        let config = config.clone();
        tokio::spawn(async move { shardline_ops::migrate(&config, &options(1), &quiet).await })
    };
    let watch = f.client(&ctx, 1).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(!migrating.is_finished(), "the migration ended before it was seen in progress");
        assert!(Instant::now() < deadline, "no migration seen in progress within 30 s");
        let sleeping: bool = watch
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE query LIKE '%pg_sleep(1.5)%'
                                   AND state = 'active' AND pid <> pg_backend_pid())",
                &[],
            )
            .await?
            .get(0);
        if sleeping {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let err =
        moves::run(&config, crate::shard(0), &crate::host("pg3"), &MoveOptions::default()).await.unwrap_err();
    // Refused either way: by the pre-flight while the shard's ledger lacks the new file,
    // by the lock once it has it and the migration still runs elsewhere.
    assert!(
        matches!(err, OpsError::Busy)
            || (matches!(err, OpsError::Preflight { .. }) && err.to_string().contains("0006_mood.sql")),
        "{err}"
    );
    assert_eq!(moves::list(&config).await?.len(), 1, "a refused move journals nothing");
    migrating.await??;
    moves::run(&config, crate::shard(0), &crate::host("pg3"), &MoveOptions::default()).await?;
    assert_eq!(with_column("mood").await?, vec![2], "the move carried the migrated table");

    stop.store(true, Ordering::Relaxed);
    let acked = writer.await??;
    let (found, total, distinct) = acked_on(&f, &ctx, 2, &acked).await?;
    let acked_n = i64::try_from(acked.len())?;
    assert_eq!(found, acked_n, "every acknowledged write is on the shard's last host");
    assert_eq!(total, distinct, "once");
    eprintln!("      {acked_n} writes through a move and two migrations, none lost or twice");
    Ok(())
}

shardline_testkit::register!(shared: a_move_is_reverted_after_its_flip_onto_its_old_copy_under_writes);
/// `move --revert` after the flip, with a writer inserting, updating and deleting on the
/// shard throughout (through the repository):
/// 1. shard 0 moves pg1 -> pg2; one row of the old copy left on pg1 is then changed by
///    hand: the revert's comparison finds it, nothing flips, the revert is undone (the
///    shard stays writable on pg2), and a second revert is refused, naming why;
/// 2. the shard moves pg2 -> pg3, then `shardline move 0 --revert` brings it back to pg2
///    onto the old copy (the same tables, not a new copy), with every write made on pg3
///    since the flip;
/// 3. every acknowledged write is on pg2 once (deleted rows gone, updated rows at their
///    last value); IDs minted after the revert are above every earlier one; `gc` then
///    leaves no slot, publication or subscription.
pub(crate) async fn a_move_is_reverted_after_its_flip_onto_its_old_copy_under_writes(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let seeded = seed(&cluster, 0, 6, 2).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let progress = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let failed: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let writer = {
        let (cluster, stop, progress, seeded, failed) =
            (cluster.clone(), stop.clone(), progress.clone(), seeded.clone(), failed.clone());
        tokio::spawn(async move {
            let photos = cluster.repo::<Photo>()?;
            let failed = |e: shardline_repo::Error| {
                if let Ok(mut f) = failed.lock() {
                    *f = Some(format!("{e} (after {} writes)", progress.load(Ordering::Relaxed)));
                }
                e
            };
            let (mut acked, mut deleted, mut captions) = (Vec::new(), Vec::new(), Vec::new());
            let mut n = 0_usize;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                progress.store(n, Ordering::Relaxed);
                let user = 6 * i64::try_from(n % 20).unwrap_or(0);
                acked.push(photos.insert(&photo(user, 1000 + n)).await.map_err(failed)?.id);
                if n.is_multiple_of(5) && acked.len() > 3 {
                    let gone = acked[acked.len() - 3];
                    if photos.delete(gone).await.map_err(failed)? {
                        deleted.push(gone);
                    }
                }
                if n.is_multiple_of(3) {
                    let p = &seeded[n % seeded.len()];
                    let caption = format!("w{n}");
                    if photos.update(p.id, &[("caption", &caption)]).await.map_err(failed)?.is_some() {
                        captions.push((p.id, caption));
                    }
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
            Ok::<_, shardline_repo::Error>((acked, deleted, captions))
        })
    };
    let pg1 = f.client(&ctx, 0).await?;
    let pg2 = f.client(&ctx, 1).await?;
    // `n` more writes acknowledged (on the shard's host of the moment).
    let written = |n: usize| {
        let (progress, failed) = (progress.clone(), failed.clone());
        async move {
            let start = progress.load(Ordering::Relaxed);
            let deadline = Instant::now() + Duration::from_secs(30);
            while progress.load(Ordering::Relaxed) < start + n {
                if let Some(e) = failed.lock().ok().and_then(|f| f.clone()) {
                    panic!("the writer failed: {e}");
                }
                assert!(Instant::now() < deadline, "the writer made no progress");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };

    let never = moves::revert(&config, crate::shard(0), &MoveOptions::default()).await.unwrap_err();
    assert_eq!(never.to_string(), "shard 0 cannot be reverted: it has no finished move");

    // 1. A revert onto an old copy that differs is not flipped.
    let first =
        moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default().revertible())
            .await?;
    written(30).await;
    let old1 = format!("shard_0000_moved_{}", first.id);
    // A like: the writer never touches the likes, so no later write overwrites it.
    let corrupt: i64 = pg1
        .query_one(
            &format!(
                "UPDATE {old1}.likes SET user_id = user_id + 1000000
                  WHERE id = (SELECT min(id) FROM {old1}.likes) RETURNING user_id"
            ),
            &[],
        )
        .await?
        .get(0);
    let err = moves::revert(&config, crate::shard(0), &MoveOptions::default()).await.unwrap_err();
    assert!(matches!(err, OpsError::Verify { .. }), "{err}");
    assert!(err.to_string().contains("likes: 2 differing key(s)"), "{err}");
    assert!(err.to_string().contains(&format!(",{corrupt})")), "names the row: {err}");
    cluster.refresh().await?;
    assert_eq!(cluster.route_user(0).host.as_str(), "pg2", "nothing flipped");
    assert_eq!(latest_state(&config).await?, State::RolledBack);
    written(10).await;
    let again = cli(&f, &["move", "0", "--revert"]).await.unwrap_err();
    assert!(
        again.contains("shard 0 cannot be reverted: its revert (move")
            && again.contains("was undone; move it with `--to pg1`"),
        "{again}"
    );

    // 2. A move, writes on its new host, and a revert through the CLI.
    let second = cli(&f, &["move", "0", "--to", "pg3", "--revertible", "--json"]).await?;
    let second: serde_json::Value = serde_json::from_str(second.trim())?;
    let old2 = format!("shard_0000_moved_{}", second["id"]);
    let table_of = |schema: String| {
        let pg2 = &pg2;
        async move {
            let oid: Option<i64> = pg2
                .query_one(&format!("SELECT to_regclass('{schema}.photos')::oid::bigint"), &[])
                .await?
                .get(0);
            Ok::<_, BoxError>(oid)
        }
    };
    let old_table = table_of(old2.clone()).await?.ok_or("the old copy on pg2")?;
    written(60).await;
    let said = cli(&f, &["move", "0", "--revert", "--revertible", "--json"]).await?;
    let report: serde_json::Value = serde_json::from_str(said.trim())?;
    assert_eq!((report["source"].as_str(), report["target"].as_str()), (Some("pg3"), Some("pg2")), "{said}");
    assert_eq!(table_of("shard_0000".into()).await?, Some(old_table), "the old copy itself came back");
    assert_eq!(table_of(old2.clone()).await?, None);
    cluster.refresh().await?;
    assert_eq!(cluster.route_user(0).host.as_str(), "pg2");
    written(30).await;
    stop.store(true, Ordering::Relaxed);
    let (acked, deleted, captions) = writer.await??;

    // 3. Every acknowledged write, once, on pg2.
    let live: Vec<Id> = acked.iter().copied().filter(|i| !deleted.contains(i)).collect();
    let (found, total, distinct) = acked_on(&f, &ctx, 1, &live).await?;
    assert_eq!(found, i64::try_from(live.len())?, "every acknowledged insert is on pg2");
    assert_eq!(total, distinct, "once");
    assert_eq!(total, found + i64::try_from(seeded.len())?, "and no deleted row");
    let mut last = std::collections::HashMap::new();
    for (id, caption) in &captions {
        last.insert(*id, caption.clone());
    }
    for (id, caption) in &last {
        let now: String = pg2
            .query_one("SELECT caption FROM shard_0000.photos WHERE id = $1", &[&i64::from(*id)])
            .await?
            .get(0);
        assert_eq!(&now, caption, "photo {id} holds its last acknowledged update");
    }
    let newest = acked.iter().max().copied().ok_or("writes")?;
    let after = cluster.repo::<Photo>()?.insert(&photo(0, 9999)).await?;
    assert!(after.id > newest, "an ID minted after the revert is above every earlier one");
    eprintln!(
        "      {} inserts, {} deletes, {} updates through two moves and two reverts; revert: {}",
        acked.len(),
        deleted.len(),
        captions.len(),
        said.trim()
    );

    // A migration since the move leaves the old copy behind: refused, nothing changed.
    f.migration("0005_tags.sql", "ALTER TABLE photos ADD COLUMN tags text;\n")?;
    shardline_ops::migrate(&config, &options(1), &quiet).await?;
    let behind = cli(&f, &["move", "0", "--revert"]).await.unwrap_err();
    assert!(
        behind.contains("shard 0 cannot be reverted: a migration ran on it since its last move"),
        "{behind}"
    );
    assert_eq!(moves::list(&config).await?.iter().filter(|m| m.state == State::Running).count(), 0);

    // The revert is revertible in turn, until `gc` is past the grace period: then
    // nothing is kept, and a revert is refused.
    cli(&f, &["gc", "--grace", "0s"]).await?;
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    let late = cli(&f, &["move", "0", "--revert"]).await.unwrap_err();
    assert!(late.contains("shard 0 cannot be reverted: `gc` dropped its old copy on pg3"), "{late}");
    assert_eq!(cluster.route_user(0).host.as_str(), "pg2", "a refused revert changes nothing");
    // A move not made revertible keeps nothing on its target, and is not reverted.
    moves::run(&config, crate::shard(1), &crate::host("pg3"), &MoveOptions::default()).await?;
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    let plain = cli(&f, &["move", "1", "--revert"]).await.unwrap_err();
    assert!(
        plain.contains("shard 1 cannot be reverted: its last move (")
            && plain.contains("it was not made revertible"),
        "{plain}"
    );
    Ok(())
}

shardline_testkit::register!(shared: a_router_a_move_behind_never_writes_into_the_next_moves_copy);
/// A handle that heard of no move (its map places shard 0 where it was two moves ago)
/// writes while the shard moves back there, after the new copy is made and before its
/// flip: the copy turns the write away as a moved shard's, and it lands where the shard
/// is; the move then carries it over. Unguarded, the write was acknowledged into the copy
/// and then emptied by the copy, or failed the move. Nor does the copy mint an ID
/// (`next_id()`, `reserve_ids()`) before the flip's decision: before, such an ID was one
/// the source could hand out too (before the carry), or again once the move was undone
/// (after it).
pub(crate) async fn a_router_a_move_behind_never_writes_into_the_next_moves_copy(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let deaf = ClusterOptions { listen: false, map_check: Duration::ZERO, ..ClusterOptions::default() };
    let mut stales = Vec::new();
    for _ in 0..5 {
        stales.push(Cluster::connect(&config, deaf.clone()).await?);
    }
    // Handles that only read, one per step and kind of read (a read that finds the shard
    // moved refreshes its handle's map).
    let mut readers = Vec::new();
    for _ in 0..5 * READS {
        readers.push(Cluster::connect(&config, deaf.clone()).await?);
    }
    let from = stales[0].route_user(0).host;
    let other = if from.as_str() == "pg1" { "pg2" } else { "pg1" };
    let kept = stales[0].repo::<Photo>()?.insert(&photo(0, 6000)).await?;
    moves::run(&config, crate::shard(0), &crate::host(other), &MoveOptions::default()).await?;
    // Written after the first move: only where the shard is now, and in the next move's
    // copy once its rows are copied.
    let later = Cluster::connect(&config, ClusterOptions::default())
        .await?
        .repo::<Photo>()?
        .insert(&photo(0, 6001))
        .await?;
    let steps = [Step::Prepared, Step::Copying, Step::CaughtUp, Step::SequenceCarried, Step::Verified];
    for ((stale, step), readers) in stales.iter().zip(steps).zip(readers.chunks(READS)) {
        assert_eq!(stale.route_user(0).host, from, "{step}: a handle a move behind");
        let err = moves::run(&config, crate::shard(0), &from, &MoveOptions::default().stopping_after(step))
            .await
            .unwrap_err();
        assert!(matches!(err, OpsError::Interrupted { step: s, .. } if s == step), "{step}: {err}");
        // Every kind of read through a handle a move behind is sent to the copy, which
        // fails it as a moved shard's: it reads where the shard is, every row there.
        stale_reads_find_the_shard(readers, step, other, &[kept.id, later.id]).await?;
        // Nothing mints from the copy either (as a router a move behind would, calling
        // the shard's minter there): its ID sequence is capped until the flip's
        // decision, the carry's pause included (undone, the source mints on from where
        // it was).
        let copy = f.client(&ctx, host_index(from.as_str())).await?;
        for sql in ["SELECT shard_0000.next_id()", "SELECT first_value FROM shard_0000.reserve_ids(10)"] {
            let minted = copy.query(sql, &[]).await;
            let code = minted.as_ref().err().and_then(|e| e.code()).map(|c| c.code().to_owned());
            assert!(
                matches!(code.as_deref(), Some("22003" | "2200H")),
                "{step}: {sql} on the copy: {minted:?}"
            );
        }
        // The stale handle sends the write to the new copy, which turns it away (once
        // the shard is fenced, after the move is undone: the write would wait out the
        // fence's lease).
        let fenced = step >= Step::Fenced;
        if fenced {
            moves::abort(&config, crate::shard(0), &MoveOptions::default()).await?;
        }
        let written = stale.repo::<Photo>()?.insert(&photo(0, 7000)).await?;
        assert_eq!(stale.route_user(0).host.as_str(), other, "{step}: the write went where the shard is");
        if !fenced {
            moves::abort(&config, crate::shard(0), &MoveOptions::default()).await?;
        }
        let again = Cluster::connect(&config, ClusterOptions::default()).await?;
        assert_eq!(again.repo::<Photo>()?.get(written.id).await?.map(|p| p.id), Some(written.id), "{step}");
    }
    // Moved back for good, by a mover that dies right after its source decided the
    // flip: a router that meets the fence completes the flip, and its write lands on the
    // new copy (its guards let it through once the decision reaches it); `--resume`
    // drops the guards. The rows written through the stale handles came along (and the
    // two written before, read above through the handles a move behind).
    let mut dying = MoveOptions::default();
    dying.stop_after_decision = true;
    let err = moves::run(&config, crate::shard(0), &from, &dying).await.unwrap_err();
    assert!(matches!(err, OpsError::Interrupted { .. }), "{err}");
    let now = Cluster::connect(&config, ClusterOptions::default()).await?;
    now.repo::<Photo>()?.insert(&photo(0, 7100)).await?;
    assert_eq!(now.route_user(0).host, from, "a router completed the flip");
    moves::resume(&config, Some(crate::shard(0)), &MoveOptions::default()).await?;
    let guards = "SELECT count(*) FROM pg_trigger WHERE tgname = 'shardline_revert_guard'";
    let there = f.client(&ctx, host_index(from.as_str())).await?;
    assert_eq!(there.query_one(guards, &[]).await?.get::<_, i64>(0), 0, "the clean-up dropped the guards");
    let page = now.repo::<Photo>()?.page_of_user(0, None, 100).await?;
    assert_eq!(page.rows.len(), 8, "{:?}", page.rows);
    Ok(())
}

shardline_testkit::register!(shared: an_abort_of_a_move_a_restored_journal_says_runs_undoes_nothing);
/// A catalog restored from a backup taken while a move was at `verified` says the move
/// runs and the map places the shard on its source; in truth it flipped, its target took
/// writes since, and the source holds only the fenced-away old copy (its marker gone
/// with the flip's clean-up). `--abort` then refuses, naming the missing marker, and
/// changes nothing. Before, it renamed the old copy back (writable again) and dropped
/// the target's live schema: every write since the flip was lost.
pub(crate) async fn an_abort_of_a_move_a_restored_journal_says_runs_undoes_nothing(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let route = cluster.route_user(0);
    let (from, to) =
        (route.host.as_str().to_owned(), if route.host.as_str() == "pg1" { "pg2" } else { "pg1" });
    let photos = cluster.repo::<Photo>()?;
    photos.insert(&photo(0, 1)).await?;
    let report = moves::run(&config, route.shard, &crate::host(to), &MoveOptions::default()).await?;
    cluster.refresh().await?;
    let after = photos.insert(&photo(0, 2)).await?;
    // The restore, as far as this move goes: running at `verified`, the map on the source.
    let catalog = f.client(&ctx, 0).await?;
    catalog
        .batch_execute(&format!(
            "UPDATE shardline.moves SET state = 'running', step = 'verified' WHERE id = {id};
             UPDATE shardline.shards SET host = '{from}' WHERE shard = {shard}",
            id = report.id,
            shard = route.shard.get()
        ))
        .await?;
    let refused = moves::abort(&config, route.shard, &MoveOptions::default()).await;
    let said = refused.as_ref().err().map(ToString::to_string).unwrap_or_default();
    assert!(said.contains("carries no marker of the move"), "{refused:?}");
    // Nothing undone: the old copy still fenced away on the source, the target's schema
    // there with the write made after the flip.
    let schema = route.schema.as_str();
    let source = f.client(&ctx, host_index(&from)).await?;
    let live: bool = source.query_one("SELECT to_regnamespace($1) IS NOT NULL", &[&schema]).await?.get(0);
    assert!(!live, "the old copy was reopened on {from}");
    let target = f.client(&ctx, host_index(to)).await?;
    let kept: i64 = target
        .query_one(
            &format!("SELECT count(*) FROM {}.photos WHERE id = $1", route.schema.quoted()),
            &[&after.id],
        )
        .await?
        .get(0);
    assert_eq!(kept, 1, "the write since the flip is on {to}");
    Ok(())
}

shardline_testkit::register!(shared: a_shard_from_before_the_live_check_moves_once_migrate_gave_it_one);
/// A cluster made by a shardline from before the live check (each shard's minter
/// installed without `shardline_live()`, its ledger saying so): a move of such a shard is
/// refused before anything is built, naming `migrate` (carrying its privileges to a copy
/// that has the function would revoke the copy's `EXECUTE` on it for good). `migrate`
/// installs it, as a changed minter; then the shard moves and is read where it went.
pub(crate) async fn a_shard_from_before_the_live_check_moves_once_migrate_gave_it_one(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let route = cluster.route_user(0);
    let to = if route.host.as_str() == "pg1" { "pg2" } else { "pg1" };
    let kept = cluster.repo::<Photo>()?.insert(&photo(0, 1)).await?;
    for h in 0..2 {
        f.client(&ctx, h)
            .await?
            .batch_execute(&format!(
                "DO $$ DECLARE s text; BEGIN
                   FOR s IN SELECT nspname FROM pg_namespace WHERE nspname LIKE 'shard\\_%' LOOP
                     EXECUTE format('DROP FUNCTION %I.{live}()', s);
                   END LOOP;
                 END $$;
                 UPDATE shardline.shard_migrations SET checksum = 'an older minter' WHERE name = 'shardline minter'",
                live = shardline_repo::LIVE_CHECK
            ))
            .await?;
    }
    let refused = moves::run(&config, route.shard, &crate::host(to), &MoveOptions::default()).await;
    let said = refused.as_ref().err().map(ToString::to_string).unwrap_or_default();
    assert!(said.contains("has no shardline_live()") && said.contains("shardline migrate"), "{refused:?}");
    let copies: i64 = f
        .client(&ctx, host_index(to))
        .await?
        .query_one("SELECT count(*) FROM pg_namespace WHERE nspname = $1", &[&route.schema.as_str()])
        .await?
        .get(0);
    assert_eq!(copies, 0, "nothing built on {to}");
    moves::abort(&config, route.shard, &MoveOptions::default()).await.ok();
    let said = cli(&f, &["migrate"]).await?;
    assert!(said.contains("up to date"), "{said}");
    moves::run(&config, route.shard, &crate::host(to), &MoveOptions::default()).await?;
    let now = Cluster::connect(&config, ClusterOptions::default()).await?;
    assert_eq!(now.route_user(0).host.as_str(), to);
    assert_eq!(now.repo::<Photo>()?.get(kept.id).await?.map(|p| p.id), Some(kept.id));
    Ok(())
}

/// How many kinds of read [`stale_reads_find_the_shard`] tries, each through a handle
/// of its own.
const READS: usize = 7;

/// Reads shard 0 through each of `readers` (handles whose maps place it where a move is
/// bringing a copy of it, one per kind of read): each must find the shard where it is,
/// `on`, with the photos `ids` (user 0's) in it, and leave its handle's map placing it
/// there.
async fn stale_reads_find_the_shard(readers: &[Cluster], step: Step, on: &str, ids: &[Id]) -> TestResult {
    assert_eq!(readers.len(), READS);
    let want: HashSet<Id> = ids.iter().copied().collect();
    let window =
        (SystemTime::now() - Duration::from_secs(3600), SystemTime::now() + Duration::from_secs(3600));
    for (kind, reader) in readers.iter().enumerate() {
        let photos = reader.repo::<Photo>()?;
        let (what, found): (&str, HashSet<Id>) = match kind {
            0 => ("get", {
                let mut found = HashSet::new();
                for id in ids {
                    found.extend(photos.get(*id).await?.map(|p| p.id));
                }
                found
            }),
            1 => ("get_many", photos.get_many(ids).await?.rows.into_iter().flatten().map(|p| p.id).collect()),
            2 => (
                "page_of_user",
                photos
                    .page_of_user(0, None, 100)
                    .await?
                    .rows
                    .into_iter()
                    .map(|p| p.id)
                    .filter(|id| want.contains(id))
                    .collect(),
            ),
            3 => ("created_between", {
                let f = photos.created_between(window.0, window.1, 1000).await?;
                assert!(f.is_complete(), "{step}: created_between: {:?}", f.missing);
                f.rows.into_iter().map(|p| p.id).filter(|id| want.contains(id)).collect()
            }),
            4 => ("newest", {
                let f = photos.newest(None, 1000).await?;
                assert!(f.is_complete(), "{step}: newest: {:?}", f.missing);
                f.rows.into_iter().map(|p| p.id).filter(|id| want.contains(id)).collect()
            }),
            5 => ("count", {
                let c = photos.count().await?;
                assert!(c.is_complete(), "{step}: count: {:?}", c.missing);
                assert!(c.count >= ids.len() as u64, "{step}: count {} of at least {}", c.count, ids.len());
                want.clone()
            }),
            _ => ("a shard transaction", {
                let n = reader
                    .transaction(crate::shard(0), |tx| {
                        Box::pin(async move {
                            let rows = tx.query("SELECT count(*) FROM photos WHERE user_id = 0", &[]).await?;
                            Ok::<i64, shardline_repo::Error>(rows.first().map_or(-1, |r| r.get(0)))
                        })
                    })
                    .await?;
                assert!(
                    usize::try_from(n).is_ok_and(|n| n >= ids.len()),
                    "{step}: a shard transaction counted {n} of at least {}",
                    ids.len()
                );
                want.clone()
            }),
        };
        assert_eq!(found, want, "{step}: {what} through a handle a move behind");
        assert_eq!(reader.route_user(0).host.as_str(), on, "{step}: {what} went where the shard is");
    }
    Ok(())
}

shardline_testkit::register!(shared: a_revert_stopped_after_any_step_is_resumed_or_undone);
/// A revert stopped after each of its steps (as if its mover died there), then resumed
/// (through the CLI) or, before its flip, undone: resumed, the shard ends back on the
/// first move's source; undone, it stays writable on the new owner and the old copy is
/// dropped. Either way it is whole (a write made on the new owner before the revert
/// included), and `gc` leaves nothing replicating.
pub(crate) async fn a_revert_stopped_after_any_step_is_resumed_or_undone(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 1).await?;
    let mut expected = [20, 20, 20];
    let mut on = "pg1";
    let seeded = cluster.repo::<Photo>()?.page_of_user(0, None, 1).await?.rows;
    let seeded = seeded.first().ok_or("a photo of user 0")?.id;
    for (i, step) in Step::ALL[..9].iter().copied().enumerate() {
        let other = if on == "pg1" { "pg2" } else { "pg1" };
        // A handle that hears of no move: its map keeps the shard on `on`.
        let stale =
            Cluster::connect(&config, ClusterOptions { listen: false, ..ClusterOptions::default() }).await?;
        moves::run(&config, crate::shard(0), &crate::host(other), &MoveOptions::default().revertible())
            .await?;
        cluster.refresh().await?;
        cluster.repo::<Photo>()?.insert(&photo(0, 1000 + i)).await?;
        expected[0] += 1;
        let stopping = MoveOptions::default().stopping_after(step);
        let err = moves::revert(&config, crate::shard(0), &stopping).await.unwrap_err();
        assert!(matches!(err, OpsError::Interrupted { step: s, .. } if s == step), "{step}: {err}");
        let caption = format!("stale {i}");
        // From `prepared` the old copy is back under the shard's name on `on`, and it is
        // not the shard's until the flip: the stale handle's update is turned away there
        // (and, once the shard is fenced, waits for the revert to be finished or undone),
        // and lands on the shard's host of the moment.
        let stale_write = (Step::Prepared..=Step::Verified).contains(&step).then(|| {
            assert_eq!(stale.route_user(0).host.as_str(), on);
            let (stale, caption) = (stale.clone(), caption.clone());
            tokio::spawn(async move {
                let photos = stale.repo::<Photo>()?;
                photos.update(seeded, &[("caption", &caption)]).await
            })
        });
        if step < Step::Fenced
            && let Some(w) = stale_write.as_ref()
        {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !w.is_finished() {
                assert!(Instant::now() < deadline, "{step}: the stale update did not land on {other}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        let undo = step < Step::Flipped && i % 2 == 1;
        if undo {
            let said = cli(&f, &["move", "--abort", "0"]).await?;
            assert!(said.contains(&format!("stays on {other}")), "{step}: {said}");
            assert_eq!(
                counts(&f, &ctx, host_index(on), "shard_0000").await?,
                None,
                "{step}: the old copy is dropped"
            );
            on = other;
        } else {
            let said = cli(&f, &["move", "--resume", "0", "--json"]).await?;
            let done: serde_json::Value = serde_json::from_str(said.trim())?;
            assert_eq!(done[0]["target"].as_str(), Some(on), "{step}: {said}");
        }
        cli(&f, &["gc", "--grace", "0s"]).await?;
        cluster.refresh().await?;
        assert_eq!(cluster.route_user(0).host.as_str(), on, "{step}");
        let gone = if on == "pg1" { "pg2" } else { "pg1" };
        assert_eq!(counts(&f, &ctx, host_index(on), "shard_0000").await?, Some(expected), "{step}");
        assert_eq!(counts(&f, &ctx, host_index(gone), "shard_0000").await?, None, "{step}");
        assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0], "{step}");
        let p = cluster.repo::<Photo>()?.insert(&photo(0, 2000 + i)).await?;
        assert_eq!(cluster.repo::<Photo>()?.get(p.id).await?, Some(p), "{step}: writable");
        expected[0] += 1;
        if let Some(w) = stale_write {
            let updated = w.await?.map_err(|e| format!("{step}: the stale update: {e}"))?;
            assert!(updated.is_some(), "{step}: the stale update found its row");
            let now = cluster.repo::<Photo>()?.get(seeded).await?.map(|p| p.caption);
            assert_eq!(now, Some(caption), "{step}: the stale handle's update is kept");
        }
    }
    Ok(())
}

shardline_testkit::register!(shared: a_revert_whose_mover_dies_after_deciding_leaves_the_shard_writable);
/// A revert's mover that dies right after its source decided the flip, before it drops
/// the old copy's guards or moves the map: a router that meets the fence completes the
/// flip (`shardline.complete_flip`), and its write lands on the reverted copy, whose
/// guards let it through once the decision has reached the copy by replication. `--resume`
/// then finishes the revert and drops the guards.
pub(crate) async fn a_revert_whose_mover_dies_after_deciding_leaves_the_shard_writable(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 1).await?;
    moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default().revertible()).await?;
    let mut dying = MoveOptions::default();
    dying.stop_after_decision = true;
    let err = moves::revert(&config, crate::shard(0), &dying).await.unwrap_err();
    assert!(matches!(err, OpsError::Interrupted { step: Step::Verified, .. }), "{err}");
    let guards = "SELECT count(*) FROM pg_trigger WHERE tgname = 'shardline_revert_guard'";
    let pg1 = f.client(&ctx, 0).await?;
    assert!(pg1.query_one(guards, &[]).await?.get::<_, i64>(0) > 0, "the guards are still there");
    let t = Instant::now();
    let p = cluster.repo::<Photo>()?.insert(&photo(0, 3000)).await?;
    assert_eq!(cluster.route_user(0).host.as_str(), "pg1", "a router completed the flip");
    let on_pg1: i64 = pg1
        .query_one("SELECT count(*) FROM shard_0000.photos WHERE id = $1", &[&i64::from(p.id)])
        .await?
        .get(0);
    assert_eq!(on_pg1, 1, "the write is on the reverted copy");
    eprintln!("      the write waited {} ms for a router to complete the flip", t.elapsed().as_millis());
    let said = cli(&f, &["move", "--resume", "0"]).await?;
    assert!(said.contains("pg2 -> pg1"), "{said}");
    assert_eq!(pg1.query_one(guards, &[]).await?.get::<_, i64>(0), 0, "the clean-up dropped the guards");
    cli(&f, &["gc", "--grace", "0s"]).await?;
    assert_eq!(counts(&f, &ctx, 0, "shard_0000").await?, Some([21, 20, 20]));
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    Ok(())
}

shardline_testkit::register!(own: rebalance_runs_moves_between_disjoint_host_pairs_at_once);
/// `rebalance --apply --parallel 2` on four hosts of the test's own, two of them new and
/// empty. The shards are sized so that the plan's first two moves share a host (both
/// leave pg1) and a later one shares none with the first: the later one starts beside
/// the first, the second waits, and no host ever takes part in two running moves (read
/// from the journal's start and end times). Every row is where the new map says, once.
pub(crate) async fn rebalance_runs_moves_between_disjoint_host_pairs_at_once(
    _ctx: TestContext,
) -> TestResult {
    on_own_kit(4, &[], |kit| Box::pin(disjoint_pairs_on(kit))).await?;
    Ok(())
}

async fn disjoint_pairs_on(kit: &shardline_testkit::Cluster) -> Result<(), BoxError> {
    let f = Fixture::on_kit(kit, "parallel_moves", 8).await?;
    let four = f.config_text()?;
    // pg1 and pg2 first; pg3 and pg4 join empty.
    let two = four.split("\n[[hosts]]").take(3).collect::<Vec<_>>().join("\n[[hosts]]");
    std::fs::write(f.path(), &two)?;
    let config = f.config()?;
    shardline_ops::init(&config, &options(1), &quiet).await?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    // pg1's shards hold 2 rows for every 1 of pg2's (about 1.6 times the bytes): the plan
    // takes two from pg1 (to pg3, then pg4), then one from pg2 to pg3, perhaps one more.
    let mut photos = Vec::new();
    for shard in 0..8 {
        let on = cluster.route(shardline_router::LogicalShard::new(shard, config.logical_shards)?)?.host;
        photos.extend(seed(&cluster, shard, 8, if on == "pg1" { 40 } else { 20 }).await?);
    }
    std::fs::write(f.path(), &four)?;
    let config = f.config()?;
    shardline_ops::init(&config, &options(1), &quiet).await?;
    let plan = shardline_ops::rebalance::plan(&config, 8).await?;
    let shares = |a: &shardline_ops::rebalance::PlannedMove, b: &shardline_ops::rebalance::PlannedMove| {
        [&a.from, &a.to].iter().any(|h| **h == b.from || **h == b.to)
    };
    assert!(plan.moves.len() >= 3, "{plan}");
    assert!(shares(&plan.moves[0], &plan.moves[1]), "the first two moves share a host: {plan}");

    let said = cli(&f, &["rebalance", "--apply", "--parallel", "2"]).await?;
    assert_eq!(said.lines().filter(|l| l.contains(" rows")).count(), plan.moves.len(), "{said}");
    let journal = moves::list(&config).await?;
    assert_eq!(journal.len(), plan.moves.len(), "{journal:?}");
    assert!(journal.iter().all(|m| m.state == State::Done), "{journal:?}");
    // ISO 8601 UTC with ms, one width: ordered as text.
    let overlap = |a: &moves::MoveRecord, b: &moves::MoveRecord| {
        a.started_at < b.updated_at && b.started_at < a.updated_at
    };
    let mut together = 0;
    for (i, a) in journal.iter().enumerate() {
        for b in &journal[i + 1..] {
            let shared = [&a.source, &a.target].iter().any(|h| **h == b.source || **h == b.target);
            if overlap(a, b) {
                assert!(!shared, "moves sharing a host ran at once: {a} and {b}");
                together += 1;
            }
        }
    }
    assert!(together >= 1, "no two moves ran at once: {journal:?}");
    // Each row once, as written, where the new map says.
    cluster.refresh().await?;
    let repo = cluster.repo::<Photo>()?;
    for p in &photos {
        assert_eq!(repo.get(p.id).await?.as_ref(), Some(p), "photo {}", p.id);
    }
    let map: serde_json::Value = serde_json::from_str(&cli(&f, &["map", "--json"]).await?)?;
    let shards: Vec<i64> = (0..4).filter_map(|h| map["hosts"][h]["shards"].as_i64()).collect();
    assert_eq!(shards.iter().sum::<i64>(), 8, "{map}");
    assert!(shards.iter().all(|&n| n >= 1), "every host holds a shard: {map}");
    Ok(())
}

shardline_testkit::register!(own: an_autovacuum_under_way_does_not_hold_the_move_or_its_fence);
/// An autovacuum of the moving shard's table, under way while the move locks the table
/// (its change log's triggers, its fence), holds a lock the move needs, and the shard's
/// writers queue behind the move's wait. Postgres cancels an autovacuum that blocks a
/// lock request only once the request has waited `deadlock_timeout` (1 s by default).
/// The mover's sessions set theirs to 20 ms. Here the hosts' own is 60 s, the
/// autovacuum crawls (cost limit 1), the move makes one attempt at each lock (2 s lock
/// timeout), and the fence starts only once an autovacuum of `photos` is seen under way:
/// without the mover's setting the move fails on the first lock it waits for.
pub(crate) async fn an_autovacuum_under_way_does_not_hold_the_move_or_its_fence(
    _ctx: TestContext,
) -> TestResult {
    let settings = [("autovacuum_naptime", "1s"), ("deadlock_timeout", "60s")];
    on_own_kit(2, &settings, |kit| Box::pin(autovacuum_under_the_fence(kit))).await
}

async fn autovacuum_under_the_fence(kit: &shardline_testkit::Cluster) -> Result<(), BoxError> {
    let f = Fixture::on_kit(kit, "autovacuum_fence", 2).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let schema = config.schema_prefix.schema(crate::shard(1));
    let mut on = None;
    for h in 0..2 {
        if counts(&f, kit, h, schema.as_str()).await?.is_some() {
            on = Some(h);
        }
    }
    let source = on.ok_or("shard 1 is on no host")?;
    let (source_name, target_name) = if source == 0 { ("pg1", "pg2") } else { ("pg2", "pg1") };
    let src = Arc::new(f.client(kit, source).await?);
    // Every autovacuum of photos crawls: it sleeps 100-400 ms after each page.
    let photos = format!("{}.photos", schema.quoted());
    src.batch_execute(&format!(
        "ALTER TABLE {photos} SET (autovacuum_vacuum_cost_limit = 1, autovacuum_vacuum_cost_delay = 100)"
    ))
    .await?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    // 10,000 inserted rows start an autovacuum (over the insert threshold) within the
    // naptime; one cancelled starts again within it.
    seed(&cluster, 1, 2, 500).await?;
    let vacuuming = |src: Arc<tokio_postgres::Client>, photos: String| async move {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let n: i64 = src
                .query_one(
                    "SELECT count(*) FROM pg_stat_progress_vacuum
                      WHERE datname = current_database() AND relid = to_regclass($1)",
                    &[&photos],
                )
                .await
                .map_or(0, |r| r.get(0));
            if n > 0 {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    assert!(
        vacuuming(Arc::clone(&src), photos.clone()).await,
        "no autovacuum of {photos} started within 60 s"
    );
    let before_fence = Arc::new(AtomicBool::new(false));
    let mut opts = MoveOptions::default();
    opts.fence_attempts = 1;
    let (seen, hook_src, hook_photos) = (Arc::clone(&before_fence), Arc::clone(&src), photos.clone());
    opts.on_compared = Some(Arc::new(move || {
        let (seen, src, photos) = (Arc::clone(&seen), Arc::clone(&hook_src), hook_photos.clone());
        Box::pin(async move {
            seen.store(vacuuming(src, photos).await, Ordering::SeqCst);
        })
    }));
    let started = Instant::now();
    let report = moves::run(&config, crate::shard(1), &crate::host(target_name), &opts)
        .await
        .map_err(|e| format!("the move from {source_name}, with an autovacuum of photos under way: {e}"))?;
    eprintln!("      moved beside an autovacuum in {:?}; pause {} ms", started.elapsed(), report.pause_ms);
    assert!(
        before_fence.load(Ordering::SeqCst),
        "an autovacuum of {photos} was under way as the fence began"
    );
    let target = if source == 0 { 1 } else { 0 };
    assert_eq!(counts(&f, kit, target, schema.as_str()).await?, Some([10_000, 10_000, 10_000]));
    assert_eq!(counts(&f, kit, source, schema.as_str()).await?, None);
    Ok(())
}

shardline_testkit::register!(shared: a_subscription_left_detached_by_an_undo_is_made_again_on_resume);
/// An undo that cannot drop the move's subscription (the target cut off from the source)
/// detaches it: disabled, no slot, pointed at an address that fails at once. Cut short
/// there (the mover killed), the move stays running at `copying`. Resumed instead of
/// undone, it must not try to enable the detached subscription (Postgres refuses one
/// without a slot, so every resume failed: "cannot enable subscription that does not
/// have a slot name"): the copy starts over, and the move completes with every row and
/// nothing left behind.
pub(crate) async fn a_subscription_left_detached_by_an_undo_is_made_again_on_resume(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    // Shard 2 lives on pg2.
    seed(&cluster, 2, 6, 2).await?;
    let stopped = moves::run(
        &config,
        crate::shard(2),
        &crate::host("pg3"),
        &MoveOptions::default().stopping_after(Step::Copying),
    )
    .await;
    assert!(stopped.is_err(), "the drill stops the move after copying: {stopped:?}");
    let target = f.client(&ctx, 2).await?;
    let name: String = target
        .query_one(
            "SELECT s.subname::text FROM pg_subscription s JOIN pg_database d ON d.oid = s.subdbid
              WHERE d.datname = current_database() AND s.subname LIKE 'shardline\\_move\\_%'",
            &[],
        )
        .await?
        .get(0);
    // What the undo's fallback leaves (`drop_subscription`, when DROP SUBSCRIPTION fails).
    target
        .batch_execute(&format!(
            "ALTER SUBSCRIPTION {name} DISABLE; ALTER SUBSCRIPTION {name} SET (slot_name = NONE);
             ALTER SUBSCRIPTION {name} CONNECTION 'host=/nonexistent/shardline-detached'"
        ))
        .await?;
    let mut opts = MoveOptions::default();
    opts.copy_timeout = Duration::from_secs(60);
    let reports = moves::resume(&config, Some(crate::shard(2)), &opts)
        .await
        .map_err(|e| format!("resume with the subscription detached: {e}"))?;
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].target.as_str(), "pg3");
    let m = moves::list(&config).await?.into_iter().max_by_key(|m| m.id).ok_or("no move")?;
    assert_eq!(m.state, State::Done);
    let said = ends_whole_on(&f, &ctx, &cluster, 2, "pg3", [40, 40, 40], "detached subscription").await?;
    eprintln!("      resumed past a detached subscription; gc: {}", said.trim());
    Ok(())
}

shardline_testkit::register!(own: gc_gives_up_a_host_that_hangs_under_it_and_goes_on);
/// `gc` on a host that hangs while gc waits on it (frozen while its `DROP SCHEMA` of an
/// old copy waits for a reader's lock) gives that host up once it has answered no probe
/// for 15 s, reports it unreachable, and returns while the host is still frozen; the next
/// run, the host thawed, drops what was left.
pub(crate) async fn gc_gives_up_a_host_that_hangs_under_it_and_goes_on(_ctx: TestContext) -> TestResult {
    on_own_kit(3, &[], |kit| Box::pin(gc_under_a_hung_host(kit))).await
}

async fn gc_under_a_hung_host(kit: &shardline_testkit::Cluster) -> Result<(), BoxError> {
    let f = Fixture::on_kit(kit, "gc_hung", 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    // Shard 2 lives on pg2; moved to pg3, its old copy stays on pg2 for gc.
    seed(&cluster, 2, 6, 2).await?;
    let report = moves::run(&config, crate::shard(2), &crate::host("pg3"), &MoveOptions::default()).await?;
    let moved = format!("shard_0002_moved_{}", report.id);
    // A reader of the old copy holds gc's DROP SCHEMA back.
    let reader = f.client(kit, 1).await?;
    reader.batch_execute(&format!("BEGIN; LOCK TABLE {moved}.photos IN ACCESS SHARE MODE")).await?;
    let watch = f.client(kit, 1).await?;
    let gc_config = config.clone();
    let work = async move { shardline_ops::moves::gc(&gc_config, Duration::ZERO).await };
    let (result, took) = freeze_while_it_waits(&f, kit, 1, ("shardline gc", 1), work).await?;
    let gc_report = result?;
    eprintln!("      gc returned {took:?} after pg2 froze: {gc_report}");
    assert!(
        gc_report.unreachable.iter().any(|u| u.starts_with("pg2")),
        "gc reports pg2 unreachable: {gc_report}"
    );
    reader.batch_execute("ROLLBACK").await?;
    // Thawed and free: the old copy goes, by the given-up run's own statement (pg2 had
    // received it whole, and runs it once the reader lets go) or by the next run.
    let again = shardline_ops::moves::gc(&config, Duration::ZERO).await?;
    assert!(again.unreachable.is_empty(), "{again}");
    let left: bool = watch
        .query_one("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", &[&moved])
        .await?
        .get(0);
    assert!(!left, "the old copy {moved} is gone: {again}");
    assert_eq!(leftovers(&f, kit).await?, vec![0, 0, 0], "{again}");
    Ok(())
}

shardline_testkit::register!(own: a_move_started_while_gc_runs_keeps_its_change_log);
/// `gc` drops the change logs and markers of moves that are over, by the journal it read
/// when it began. A move started after that read is missing from it, and must not be
/// taken for one that is over. `gc` is held on pg2 (a reader of a done move's old copy
/// holds its `DROP SCHEMA` back) while a move of the same shard, pg3 to pg1, starts and
/// runs until it has caught up, its change log on pg3; `gc` then goes on to pg3. The
/// move's change log must still be there, and the move, resumed under writes, ends done
/// with every row on pg1. (Before `gc` took its lock the new move's log was dropped.)
pub(crate) async fn a_move_started_while_gc_runs_keeps_its_change_log(_ctx: TestContext) -> TestResult {
    on_own_kit(3, &[], |kit| Box::pin(move_started_under_gc(kit))).await
}

async fn move_started_under_gc(kit: &shardline_testkit::Cluster) -> Result<(), BoxError> {
    let f = Fixture::on_kit(kit, "gc_race", 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    // Shard 2 lives on pg2; moved to pg3, its old copy stays on pg2 for gc.
    seed(&cluster, 2, 6, 2).await?;
    let first = moves::run(&config, crate::shard(2), &crate::host("pg3"), &MoveOptions::default()).await?;
    let moved = format!("shard_0002_moved_{}", first.id);
    let reader = f.client(kit, 1).await?;
    reader.batch_execute(&format!("BEGIN; LOCK TABLE {moved}.photos IN ACCESS SHARE MODE")).await?;
    let gc_config = config.clone();
    let gc = tokio::spawn(async move { moves::gc(&gc_config, Duration::ZERO).await });
    let watch = futures::future::try_join_all((0..3).map(|h| f.client(kit, h))).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    // gc has read the journal and waits on pg2.
    loop {
        let waiting: i64 = watch[1]
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'shardline gc' AND wait_event_type = 'Lock'",
                &[],
            )
            .await?
            .get(0);
        if waiting > 0 {
            break;
        }
        if gc.is_finished() || Instant::now() >= deadline {
            return Err("gc never waited on pg2's reader".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The new move runs until it has caught up, or until it waits for gc to end.
    let move_config = config.clone();
    let second = tokio::spawn(async move { stopped_after(&move_config, 2, "pg1", Step::CaughtUp).await });
    loop {
        let mut waits = false;
        for c in &watch {
            let n: i64 = c
                .query_one("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted", &[])
                .await?
                .get(0);
            waits |= n > 0;
        }
        if waits || second.is_finished() {
            break;
        }
        if Instant::now() >= deadline {
            return Err("the second move neither ran nor waited".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    reader.batch_execute("ROLLBACK").await?;
    let report = gc.await??;
    second.await??;
    let id = moves::list(&config).await?.into_iter().map(|m| m.id).max().ok_or("no move")?;
    assert_ne!(id, first.id, "the second move is journaled");
    assert!(!report.to_string().contains(&format!("move {id}")), "gc left move {id} alone: {report}");
    let logs: i64 = watch[2]
        .query_one("SELECT count(*) FROM pg_trigger WHERE tgname = $1", &[&format!("shardline_move_{id}")])
        .await?
        .get(0);
    assert!(logs > 0, "move {id}'s change log (its triggers) is still on pg3: {report}");
    // Writes on pg3 while it runs, then resumed: every row on pg1.
    let more = seed(&cluster, 2, 6, 1).await?;
    let done = moves::resume(&config, Some(crate::shard(2)), &MoveOptions::default()).await?;
    assert_eq!(done.len(), 1, "{done:?}");
    let photos = i64::try_from(40 + more.len())?;
    assert_eq!(counts(&f, kit, 0, "shard_0002").await?, Some([photos, photos, photos]));
    let last = moves::gc(&config, Duration::ZERO).await?;
    assert_eq!(leftovers(&f, kit).await?, vec![0, 0, 0], "{last}");
    Ok(())
}

shardline_testkit::register!(own: an_abort_with_a_hung_host_returns_while_it_is_hung);
/// `shardline move --abort` of a fenced move whose host hangs while the abort waits on it
/// (frozen while the abort's statement waits for a lock a test session holds there).
/// The target hung: the source is unfenced and the move undone while the target is still
/// frozen, its copy left to `gc`. The source hung: the abort fails naming it once it has
/// answered no probe for 15 s (the default), instead of waiting for as long as it is
/// hung; the move stays running, and the source thawed, aborting again undoes it. Either
/// way `gc` then leaves nothing. First, a move whose pre-flight meets the source hung
/// fails naming it, in time.
pub(crate) async fn an_abort_with_a_hung_host_returns_while_it_is_hung(_ctx: TestContext) -> TestResult {
    on_own_kit(3, &[], |kit| Box::pin(aborts_beside_hung_hosts(kit))).await
}

async fn aborts_beside_hung_hosts(kit: &shardline_testkit::Cluster) -> Result<(), BoxError> {
    let f = Fixture::on_kit(kit, "abort_hung", 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    // Shard 2 lives on pg2.
    seed(&cluster, 2, 6, 2).await?;
    // A move's pre-flight whose source hangs while it reads the source's ledger (a
    // test session holds its lock, then the host is frozen): the move fails naming the
    // source once it has answered no probe for the move's `hung_after` (3 s here), with
    // nothing journaled (before: it waited for as long as the host was hung).
    let blocker = f.client(kit, 1).await?;
    blocker.batch_execute("BEGIN; LOCK TABLE shardline.shard_migrations IN ACCESS EXCLUSIVE MODE").await?;
    let (move_config, mut hung_soon) = (config.clone(), MoveOptions::default());
    hung_soon.hung_after = Duration::from_secs(3);
    let work =
        async move { moves::run(&move_config, crate::shard(2), &crate::host("pg3"), &hung_soon).await };
    let (ran, took) = freeze_while_it_waits(&f, kit, 1, ("shardline", 1), work).await?;
    blocker.batch_execute("ROLLBACK").await?;
    let e = ran.map(|r| format!("the move ran: {r}")).unwrap_err();
    assert!(matches!(&e, OpsError::Timeout { host, .. } if host.as_str() == "pg2"), "{e}");
    assert!(took < Duration::from_secs(12), "the pre-flight kept its hung_after (3 s): {took:?}");
    assert!(moves::list(&config).await?.is_empty(), "nothing journaled");
    for (victim, h) in [("target", 2usize), ("source", 1)] {
        let stopped = moves::run(
            &config,
            crate::shard(2),
            &crate::host("pg3"),
            &MoveOptions::default().stopping_after(Step::Fenced),
        )
        .await;
        assert!(stopped.is_err(), "the drill stops the move, fenced: {stopped:?}");
        let id = moves::list(&config).await?.into_iter().map(|m| m.id).max().ok_or("no move")?;
        // What the abort will wait on: on the source, the fence's marker (its unfence
        // locks it first); on the target, the copy's table (its schema is dropped).
        let blocker = f.client(kit, h).await?;
        blocker
            .batch_execute(if victim == "source" {
                "BEGIN; SELECT FROM shardline.move_marks FOR UPDATE"
            } else {
                "BEGIN; LOCK TABLE shard_0002.photos IN ACCESS SHARE MODE"
            })
            .await?;
        let abort_config = config.clone();
        // A hung source is given up on after the abort's own `hung_after` (5 s here, 15 s
        // by default).
        let mut abort_options = MoveOptions::default();
        abort_options.hung_after = Duration::from_secs(5);
        let work = async move { moves::abort(&abort_config, crate::shard(2), &abort_options).await };
        let app = format!("shardline move {id}");
        let (aborted, took) = freeze_while_it_waits(&f, kit, h, (&app, 1), work).await?;
        blocker.batch_execute("ROLLBACK").await?;
        eprintln!("      abort with the {victim} hung returned {took:?} after the freeze: {aborted:?}");
        if victim == "target" {
            let report = aborted.map_err(|e| format!("abort with the target hung: {e}"))?;
            assert!(report.unfenced, "the source was unfenced");
            assert!(
                report.cleanup_pending.iter().any(|p| p.starts_with("pg3")),
                "the target's part is left to gc: {report:?}"
            );
        } else {
            let e = aborted.err().ok_or("the abort with the source hung succeeded")?;
            assert!(e.to_string().contains("pg2"), "the error names the source: {e}");
            assert!(
                took < Duration::from_secs(14),
                "the abort kept its hung_after (5 s; 15 s by default): {took:?}"
            );
            let m = moves::list(&config).await?.into_iter().max_by_key(|m| m.id).ok_or("no move")?;
            assert_eq!(m.state, State::Running, "the move stays as it was");
            moves::abort(&config, crate::shard(2), &MoveOptions::default())
                .await
                .map_err(|e| format!("abort once thawed: {e}"))?;
        }
        let m = moves::list(&config).await?.into_iter().max_by_key(|m| m.id).ok_or("no move")?;
        assert_eq!(m.state, State::RolledBack);
        ends_whole_on(&f, kit, &cluster, 2, "pg2", [40, 40, 40], victim).await?;
    }
    Ok(())
}

/// Runs `body` on `hosts` servers of the test's own (started with the kit's settings and
/// `settings`), then shuts them down, whatever `body` returned.
pub(crate) async fn on_own_kit(
    hosts: usize,
    settings: &[(&str, &str)],
    body: impl for<'k> FnOnce(
        &'k shardline_testkit::Cluster,
    ) -> futures::future::BoxFuture<'k, Result<(), BoxError>>,
) -> TestResult {
    let kit = shardline_testkit::Cluster::start_with(hosts, settings).await?;
    let result = body(&kit).await;
    let down = kit.shutdown().await;
    result?;
    down?;
    Ok(())
}

/// Runs `work` until `n` sessions named `app` wait on a lock on host `h` (a test
/// session holds it), then freezes the host until `work` ends (at most 60 s), and thaws
/// it. Returns what `work` returned and how long after the freeze it ended.
async fn freeze_while_it_waits<T: Send + 'static>(
    f: &Fixture,
    kit: &shardline_testkit::Cluster,
    h: usize,
    (app, n): (&str, i64),
    work: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<(T, Duration), BoxError> {
    let work = tokio::spawn(async move {
        let r = work.await;
        (r, Instant::now())
    });
    // A session of its own: inside a transaction pg_stat_activity stays as first read.
    let watch = f.client(kit, h).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let waiting: i64 = watch
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
                &[&app],
            )
            .await?
            .get(0);
        if waiting >= n {
            break;
        }
        if work.is_finished() {
            return Err(format!("{app} ended before {n} session(s) waited on pg{}'s lock", h + 1).into());
        }
        if Instant::now() >= deadline {
            return Err(format!("{waiting} of {n} {app} session(s) waited on pg{}'s lock", h + 1).into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let host = &kit.hosts()[h];
    host.pause().await?;
    let frozen = Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(60), work).await;
    host.resume().await?;
    let (out, at) =
        ended.map_err(|_| format!("{app} did not return within 60 s of pg{}'s freeze", h + 1))??;
    Ok((out, at.duration_since(frozen)))
}

shardline_testkit::register!(shared: a_logged_key_that_really_differs_is_found_by_the_fence_and_not_flipped);
/// A key in the change log whose copy really differs (a like deleted on the target once
/// its triggers exist, before the comparison) is a row in flight to the comparison. Each
/// round before the fence finds it differing with no new write, and logs it anew rather
/// than failing the move (the same sight as a write the target applied before the
/// source's own sessions could see it); the fence reads it, finds it missing on the
/// target, and the move is not flipped but undone, the shard whole on its source.
pub(crate) async fn a_logged_key_that_really_differs_is_found_by_the_fence_and_not_flipped(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let made = seed(&cluster, 0, 6, 2).await?;
    let stopping = MoveOptions::default().stopping_after(Step::CaughtUp);
    moves::run(&config, crate::shard(0), &crate::host("pg2"), &stopping).await.unwrap_err();
    let pg2 = f.client(&ctx, 1).await?;
    pg2.batch_execute(REPLICA).await?; // past the copy's guard, as an operator would be
    let gone = pg2.execute("DELETE FROM shard_0000.likes WHERE photo_id = $1", &[&made[4].id]).await?;
    assert_eq!(gone, 1);
    let options = MoveOptions::default().with_rounds(0, 3);
    let err = moves::resume(&config, Some(crate::shard(0)), &options).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, OpsError::Verify { .. }), "{text}");
    assert!(text.contains("likes: 1 differing key(s)"), "{text}");
    let journal = moves::list(&config).await?;
    let m = journal.iter().max_by_key(|m| m.id).ok_or("no move")?;
    assert_eq!(m.state, State::RolledBack);
    let pre = m.detail.precheck.clone().ok_or("the comparison journaled")?;
    let in_flight: Vec<i64> = pre.rounds.iter().map(|r| r.in_flight).collect();
    assert_eq!(in_flight, [1, 1, 1], "each round found the key differing and logged it anew: {pre:?}");
    assert_eq!(cluster.route_user(0).host.as_str(), "pg1");
    assert_eq!(counts(&f, &ctx, 0, "shard_0000").await?, Some([40, 40, 40]));
    assert_eq!(counts(&f, &ctx, 1, "shard_0000").await?, None);
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    Ok(())
}

/// `n` bulk photos in `schema` on host `h`, each with a padded URL (about 150 bytes a
/// row), so that the copy of their table takes a while and comes in several ranges.
async fn bulk(
    f: &Fixture,
    ctx: &TestContext,
    h: usize,
    schema: &str,
    user: i64,
    n: i64,
) -> Result<(), BoxError> {
    f.client(ctx, h)
        .await?
        .execute(
            &format!(
                "INSERT INTO {schema}.photos (user_id, url)
                 SELECT $1 + 6 * (g % 20), 'https://cdn/bulk/' || g || '/' || repeat('x', 100)
                   FROM generate_series(1, $2::bigint) g"
            ),
            &[&user, &n],
        )
        .await?;
    Ok(())
}

shardline_testkit::register!(own: a_capped_copy_that_cannot_fit_its_timeout_is_refused_up_front);
/// A copy at `max_rate` that would need longer than `copy_timeout` for the shard's tables
/// is refused by the pre-flight, naming the source and the way out, before anything is
/// made or journaled; the same move with the subscription's copy goes ahead. (Hosts of
/// its own: with them shared, `repo::insert_many_is_one_statement_per_host` timed out in
/// two full runs of three, its cause not found; see the session note of 2026-11-25.)
pub(crate) async fn a_capped_copy_that_cannot_fit_its_timeout_is_refused_up_front(
    _ctx: TestContext,
) -> TestResult {
    let kit = shardline_testkit::Cluster::start(3).await?;
    let f = Fixture::on_kit(&kit, "capped_copy", 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 2, 6, 2).await?;
    let mut slow = MoveOptions::default();
    slow.max_rate = Some(1_000);
    slow.copy_timeout = Duration::from_secs(10);
    let err = moves::run(&config, crate::shard(2), &crate::host("pg3"), &slow).await.unwrap_err();
    let said = err.to_string();
    assert!(matches!(err, OpsError::Preflight(_)), "{said}");
    for part in ["pg2", "copy rate", "at 0.001 MB/s", "10 s", "--subscription-copy"] {
        assert!(said.contains(part), "{part:?} in {said}");
    }
    assert!(moves::list(&config).await?.is_empty(), "a refused move is not journaled");
    assert_eq!(counts(&f, &kit, 2, "shard_0002").await?, None, "nothing made on the target");
    // A move begun with the subscription's copy, stopped before it copied, then resumed
    // with that cap: the resumed copy is refused the same way before it starts, and the
    // move stays to resume another way.
    let mut table_sync = MoveOptions::default().subscription_copy();
    table_sync.copy_timeout = slow.copy_timeout;
    stopped_with(&config, 2, "pg3", table_sync.clone().stopping_after(Step::Prepared)).await?;
    let err = moves::resume(&config, Some(crate::shard(2)), &slow).await.unwrap_err();
    let said = err.to_string();
    for part in ["pg2", "at 0.001 MB/s", "10 s", "--subscription-copy"] {
        assert!(said.contains(part), "{part:?} in {said}");
    }
    assert_eq!(moves::list(&config).await?[0].state, State::Running);
    let slots: i64 =
        f.client(&kit, 1).await?.query_one("SELECT count(*) FROM pg_replication_slots", &[]).await?.get(0);
    assert_eq!(slots, 0, "the refused copy made no slot on the source");
    moves::resume(&config, Some(crate::shard(2)), &table_sync).await?;
    assert_eq!(counts(&f, &kit, 2, "shard_0002").await?, Some([40, 40, 40]));
    kit.shutdown().await?;
    Ok(())
}

shardline_testkit::register!(shared: a_throttled_copy_from_one_snapshot_under_writes_loses_nothing_and_keeps_its_rate);
/// `max_rate`: the mover copies the rows itself, from one snapshot of the source, in
/// ranges of pages, two streams at once, no faster than the rate; the subscription
/// starts where that snapshot ends. Inserts through the repository, and updates and
/// deletes of the rows being copied, go on throughout: a snapshot and a slot that did
/// not agree would lose or double a change, and the move's comparison of the whole
/// shard would refuse to flip.
pub(crate) async fn a_throttled_copy_from_one_snapshot_under_writes_loses_nothing_and_keeps_its_rate(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let seeded = i64::try_from(seed(&cluster, 0, 6, 50).await?.len())?;
    const BULK: i64 = 100_000;
    bulk(&f, &ctx, 0, "shard_0000", 0, BULK).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..3i64)
        .map(|w| {
            let (cluster, stop) = (cluster.clone(), stop.clone());
            tokio::spawn(async move {
                let photos = cluster.repo::<Photo>()?;
                let (mut acked, mut n) = (Vec::new(), 0usize);
                while !stop.load(Ordering::Relaxed) {
                    let user = 6 * (w * 1000 + i64::try_from(n % 20).unwrap_or(0));
                    acked.push(photos.insert(&photo(user, n)).await?.id);
                    n += 1;
                }
                Ok::<_, shardline_repo::Error>(acked)
            })
        })
        .collect();
    // Updates and deletes of bulk rows, straight on the source, until the fence stops
    // them (the schema is renamed then): each committed one must reach the target.
    let churn = {
        let (c, stop) = (f.client(&ctx, 0).await?, stop.clone());
        tokio::spawn(async move {
            let (mut updated, mut deleted) = (0u64, 0u64);
            let mut g = 0i64;
            while !stop.load(Ordering::Relaxed) {
                g += 7;
                let (changed, gone) =
                    (format!("https://cdn/bulk/{g}/%"), format!("https://cdn/bulk/{}/%", g + 3));
                let u = c
                    .execute(
                        "UPDATE shard_0000.photos SET caption = 'changed' WHERE url LIKE $1",
                        &[&changed],
                    )
                    .await;
                let d = c.execute("DELETE FROM shard_0000.photos WHERE url LIKE $1", &[&gone]).await;
                match (u, d) {
                    (Ok(a), Ok(b)) => (updated, deleted) = (updated + a, deleted + b),
                    // The fence renamed the schema: the churn is over.
                    _ => break,
                }
            }
            (updated, deleted)
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rate = 8_000_000;
    let mut o = MoveOptions::default();
    o.max_rate = Some(rate);
    // A hand-over that applied a change twice would stall the catch-up: fail in time.
    o.copy_timeout = Duration::from_secs(120);
    let report = moves::run(&config, crate::shard(0), &crate::host("pg2"), &o).await?;
    stop.store(true, Ordering::Relaxed);
    let (updated, deleted) = churn.await?;
    let mut acked = Vec::new();
    for w in writers {
        acked.extend(w.await??);
    }
    assert!(updated > 0 && deleted > 0, "the churn ran ({updated} updated, {deleted} deleted)");
    let record =
        moves::list(&config).await?.into_iter().find(|m| m.id == report.id).ok_or("no journal row")?;
    let copied = record.detail.rows_copied.clone().ok_or("the mover did not copy the rows")?;
    // The rate is a ceiling the copy keeps: it cannot have read more than that.
    assert!(copied.bytes > 10_000_000, "{copied:?}");
    let floor = u64::try_from(copied.bytes)? * 1000 / rate;
    assert!(copied.ms >= floor, "{copied:?}: faster than {rate} bytes a second");
    assert_eq!((copied.streams, copied.max_rate), (2, rate));
    assert_eq!(record.detail.copy_restarts, 0);
    // The move's own comparison passed; and, counted here: every acknowledged insert
    // once, the bulk less what was deleted, nothing else.
    let (found, total, distinct) = acked_on(&f, &ctx, 1, &acked).await?;
    let acked_n = i64::try_from(acked.len())?;
    assert_eq!(found, acked_n, "every acknowledged write is on the target");
    assert_eq!(total, distinct);
    assert_eq!(total, seeded + BULK - i64::try_from(deleted)? + acked_n);
    let changed: i64 = f
        .client(&ctx, 1)
        .await?
        .query_one("SELECT count(*) FROM shard_0000.photos WHERE caption = 'changed'", &[])
        .await?
        .get(0);
    let source_changed: i64 = f
        .client(&ctx, 0)
        .await?
        .query_one(
            &format!("SELECT count(*) FROM shard_0000_moved_{}.photos WHERE caption = 'changed'", report.id),
            &[],
        )
        .await?
        .get(0);
    assert_eq!(changed, source_changed, "every update reached the target");
    assert!(changed > 0);
    eprintln!(
        "      {} bytes copied in {} ms at most {rate} B/s ({} streams); {acked_n} inserts, {updated} updates, \
         {deleted} deletes during the move; pause {} ms",
        copied.bytes, copied.ms, copied.streams, report.pause_ms
    );
    Ok(())
}

shardline_testkit::register!(exclusive: a_host_killed_inside_the_movers_copy_is_resumed_to_every_row);
/// The target, then the source, killed while the mover's own copy streams rows (seen
/// in the target's `pg_stat_progress_copy`): the move fails naming the host, stays at
/// `prepared`, and a resume once the host is back starts the copy over from empty
/// tables and ends with every row, whichever copy the resume uses.
pub(crate) async fn a_host_killed_inside_the_movers_copy_is_resumed_to_every_row(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 2, 6, 2).await?;
    const BULK: i64 = 60_000;
    bulk(&f, &ctx, 1, "shard_0002", 2, BULK).await?;
    let mut slow = MoveOptions::default();
    slow.max_rate = Some(2_000_000);
    // (the host killed, its index, where the shard goes, the resume's rate)
    for (victim, to, resume_rate) in [(2usize, "pg3", Some(0)), (1, "pg3", None)] {
        let c = Arc::new(config.clone());
        let o = slow.clone();
        let mover = tokio::spawn(async move { moves::run(&c, crate::shard(2), &crate::host(to), &o).await });
        let watch = f.client(&ctx, 2).await?;
        let deadline = Instant::now() + Duration::from_secs(120);
        let rows: i64 = loop {
            assert!(!mover.is_finished(), "the move ended before its copy was seen in progress");
            assert!(Instant::now() < deadline, "no copy seen in progress within 120 s");
            let row = watch
                .query_opt(
                    "SELECT p.tuples_processed FROM pg_stat_progress_copy p
                       JOIN pg_class c ON c.oid = p.relid JOIN pg_namespace n ON n.oid = c.relnamespace
                      WHERE n.nspname = 'shard_0002' AND c.relname = 'photos' AND p.command = 'COPY FROM'
                        AND p.tuples_processed > 0
                      LIMIT 1",
                    &[],
                )
                .await?;
            if let Some(r) = row {
                break r.get(0);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        drop(watch);
        let host = &ctx.hosts()[victim];
        host.kill().await?;
        let err = mover.await?.unwrap_err();
        let name = ["pg1", "pg2", "pg3"][victim];
        assert!(err.to_string().contains(name), "the move fails naming {name}: {err}");
        let m = moves::list(&config).await?.into_iter().last().ok_or("no move")?;
        assert_eq!((m.state, m.step), (State::Running, Step::Prepared));
        eprintln!("      {name} killed inside the mover's copy, {rows} rows into photos");
        host.start().await?;
        let mut again = MoveOptions::default();
        again.max_rate = resume_rate;
        again.copy_timeout = Duration::from_secs(120);
        let done = moves::resume(&config, Some(crate::shard(2)), &again).await?;
        assert_eq!(done.len(), 1);
        // The resume copied as it was asked: the mover uncapped, or the subscription.
        let m = moves::list(&config).await?.into_iter().last().ok_or("no move")?;
        assert_eq!(m.detail.rows_copied.as_ref().map(|r| r.max_rate), resume_rate, "{:?}", m.detail);
        assert_eq!(counts(&f, &ctx, 2, "shard_0002").await?, Some([40 + BULK, 40, 40]));
        assert_eq!(counts(&f, &ctx, 1, "shard_0002").await?, None);
        let fresh = Cluster::connect(&config, ClusterOptions::default()).await?;
        fresh.repo::<Photo>()?.insert(&photo(2, 49)).await?;
        cli(&f, &["gc", "--grace", "0s"]).await?;
        assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
        // Back to pg2 for the next round (the plain way).
        f.client(&ctx, 2)
            .await?
            .execute("DELETE FROM shard_0002.photos WHERE url = 'https://cdn/2/49.jpg'", &[])
            .await?;
        moves::run(&config, crate::shard(2), &crate::host("pg2"), &MoveOptions::default()).await?;
        cli(&f, &["gc", "--grace", "0s"]).await?;
    }
    Ok(())
}

shardline_testkit::register!(shared: a_slot_gone_before_the_subscription_starts_starts_the_copy_over);
/// The mover's copy done and the subscription made, then the source's slot dropped
/// before the subscription is enabled (an operator, or `max_slot_wal_keep_size`): the
/// subscription could never stream. The resume sees the slot gone, starts the copy over
/// (a new slot, a new snapshot) and finishes with every row.
pub(crate) async fn a_slot_gone_before_the_subscription_starts_starts_the_copy_over(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 10).await?;
    let mut o = MoveOptions::default().stopping_after(Step::Copying);
    o.max_rate = Some(0);
    moves::run(&config, crate::shard(0), &crate::host("pg2"), &o).await.unwrap_err();
    let m = moves::list(&config).await?.into_iter().last().ok_or("no move")?;
    assert_eq!((m.state, m.step), (State::Running, Step::Copying));
    let lsn = m.detail.rows_copied.as_ref().and_then(|r| r.lsn.clone()).ok_or("no snapshot position")?;
    // The subscription's origin already starts where the copy's snapshot ends.
    let origin: String = f
        .client(&ctx, 1)
        .await?
        .query_one(
            "SELECT pg_replication_origin_progress('pg_' || oid, false)::text FROM pg_subscription WHERE subname = $1",
            &[&m.detail.name],
        )
        .await?
        .get(0);
    assert_eq!(origin, lsn);
    f.client(&ctx, 0).await?.execute("SELECT pg_drop_replication_slot($1)", &[&m.detail.name]).await?;
    let mut again = MoveOptions::default();
    again.max_rate = Some(0);
    again.copy_timeout = Duration::from_secs(60);
    moves::resume(&config, Some(crate::shard(0)), &again).await?;
    let m = moves::list(&config).await?.into_iter().last().ok_or("no move")?;
    assert_eq!((m.state, m.detail.copy_restarts), (State::Done, 1), "{:?}", m.detail);
    assert_eq!(counts(&f, &ctx, 1, "shard_0000").await?, Some([200, 200, 200]));
    assert_eq!(counts(&f, &ctx, 0, "shard_0000").await?, None);
    Ok(())
}

shardline_testkit::register!(shared: the_copys_snapshot_waits_out_a_long_writer_in_short_tries);
/// A transaction writing the moving shard stays open as the mover's copy asks for its
/// snapshot's locks: each try waits a short while (the shard's other writers queue
/// behind a waiting lock), gives up, and tries again; once the writer commits, the copy
/// takes its snapshot, and the writer's row is on the target.
pub(crate) async fn the_copys_snapshot_waits_out_a_long_writer_in_short_tries(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 5).await?;
    // The writer's lock without a transaction ID yet: a slot being made waits for every
    // transaction that has one, so a writer that had written would hold the move up at
    // the slot instead, before the copy.
    let writer = f.client(&ctx, 0).await?;
    writer.batch_execute("BEGIN; LOCK TABLE shard_0000.photos IN ROW EXCLUSIVE MODE").await?;
    let c = Arc::new(config.clone());
    let mover = tokio::spawn(async move {
        let mut o = MoveOptions::default();
        o.max_rate = Some(0);
        moves::run(&c, crate::shard(0), &crate::host("pg2"), &o).await
    });
    let watch = f.client(&ctx, 0).await?;
    let waiting = "SELECT l.pid FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                    WHERE NOT l.granted AND l.mode = 'ShareLock' AND c.relname = 'photos'
                      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())";
    let deadline = Instant::now() + Duration::from_secs(60);
    // The session seen waiting, then not (its try ran out), then waiting again: a new
    // try. One long wait would never show the gap.
    let (mut first, mut gap): (Option<(i32, Instant)>, bool) = (None, false);
    let tries = loop {
        assert!(!mover.is_finished(), "the move ended while the writer held the shard");
        assert!(
            Instant::now() < deadline,
            "the copy's locks were never seen waiting, giving up, and waiting again"
        );
        let now: Option<i32> = watch.query_opt(waiting, &[]).await?.map(|r| r.get(0));
        match (first, now) {
            (None, Some(pid)) => first = Some((pid, Instant::now())),
            (Some(_), None) => gap = true,
            (Some((pid, at)), Some(again)) if gap && again == pid => break at.elapsed(),
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    writer
        .batch_execute("INSERT INTO shard_0000.photos (user_id, url) VALUES (0, 'long-writer'); COMMIT")
        .await?;
    mover.await??;
    let on_target: i64 = f
        .client(&ctx, 1)
        .await?
        .query_one("SELECT count(*) FROM shard_0000.photos WHERE url = 'long-writer'", &[])
        .await?
        .get(0);
    assert_eq!(on_target, 1, "the long writer's row is on the target, once");
    // Short tries: the first gave up well before the move's 2 s lock_timeout would have.
    assert!(tries < Duration::from_millis(1500), "the first try waited {tries:?}");
    eprintln!("      the copy's locks waited {} ms across tries for a long writer", tries.as_millis());
    Ok(())
}

shardline_testkit::register!(shared: gc_journals_a_dropped_copy_on_its_own_move_only);
/// `gc` records in the journal which move's old copy it dropped, by the move: with a
/// schema prefix long enough that old copies are named `shardline_moved_<id>`, dropping
/// move 11's copy once marked move 1's as dropped too (its name begins with move 1's),
/// and move 1, still in its grace period, could no longer be reverted.
pub(crate) async fn gc_journals_a_dropped_copy_on_its_own_move_only(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    let prefix = format!("s{}_", "x".repeat(51));
    let text = f.config_text()?.replacen(
        "logical_shards = 4",
        &format!("logical_shards = 4\nschema_prefix = \"{prefix}\""),
        1,
    );
    std::fs::write(f.path(), text)?;
    let config = f.config()?;
    shardline_ops::init(&config, &options(1), &quiet).await?;
    let catalog = f.client(&ctx, 0).await?;
    let ids = "pg_get_serial_sequence('shardline.moves', 'id')";
    // Move 11 ends first, move 1 four seconds later: as when move 1 started first and
    // took longer (ids are taken when a move starts).
    catalog.query_one(&format!("SELECT setval({ids}, 10)"), &[]).await?;
    let eleven = cli(&f, &["move", "1", "--to", "pg2", "--json"]).await?;
    assert!(eleven.contains("\"id\": 11") || eleven.contains("\"id\":11"), "{eleven}");
    tokio::time::sleep(Duration::from_secs(4)).await;
    catalog.query_one(&format!("SELECT setval({ids}, 1, false)"), &[]).await?;
    let one = cli(&f, &["move", "0", "--to", "pg2", "--revertible", "--json"]).await?;
    assert!(one.contains("\"id\": 1,") || one.contains("\"id\":1,"), "{one}");
    let said = cli(&f, &["gc", "--grace", "3s"]).await?;
    assert!(said.contains("dropped pg1: schema shardline_moved_11 (move 11)"), "{said}");
    assert!(said.contains("kept pg1: schema shardline_moved_1 (grace period)"), "{said}");
    let journal = moves::list(&config).await?;
    let record = |id: i64| journal.iter().find(|m| m.id == id).ok_or(format!("move {id} in the journal"));
    assert!(record(11)?.detail.source_dropped);
    assert!(!record(1)?.detail.source_dropped, "move 1's old copy is still there");
    // Move 1 can be reverted: its old copy is there, in its grace period.
    let reverted = cli(&f, &["move", "0", "--revert"]).await?;
    assert!(reverted.contains("pg2 -> pg1"), "{reverted}");
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    assert_eq!(cluster.route_user(0).host.as_str(), "pg1");
    // A run that leaves work for the next (a host unreachable) prints its report and
    // fails, so a script can tell it from a run that cleaned up.
    let text = f.config_text()?;
    f.write_config(
        &ctx,
        |i, u| if i == 1 { "postgres://postgres@127.0.0.1:9/nowhere".into() } else { u },
        4,
    )?;
    let with_prefix = f.config_text()?.replacen(
        "logical_shards = 4",
        &format!("logical_shards = 4\nschema_prefix = \"{prefix}\""),
        1,
    );
    std::fs::write(f.path(), with_prefix)?;
    let (said, result) = cli_full(&f, &["gc", "--grace", "0s"]).await;
    assert!(said.contains("unreachable pg2"), "{said}");
    let err = result.unwrap_err();
    assert!(
        err.contains("gc left work for the next run: 1 host(s) unreachable, 0 thing(s) not done"),
        "{err}"
    );
    std::fs::write(f.path(), text)?;
    cli(&f, &["gc", "--grace", "0s"]).await?;
    Ok(())
}

shardline_testkit::register!(shared: resuming_every_move_tries_each_whatever_became_of_the_one_before);
/// `move --resume` with no shard tries every running move: one that cannot be finished
/// (here, one an interrupted abort left undoing, which only `--abort` finishes) is named
/// with why, and the moves after it are finished all the same.
pub(crate) async fn resuming_every_move_tries_each_whatever_became_of_the_one_before(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    let config = f.config()?;
    shardline_ops::init(&config, &options(1), &quiet).await?;
    let stop = MoveOptions::default().stopping_after(Step::Prepared);
    for (shard, to) in [(0, "pg2"), (1, "pg3")] {
        let stopped = moves::run(&config, crate::shard(shard), &crate::host(to), &stop).await;
        assert!(matches!(stopped, Err(OpsError::Interrupted { .. })), "{stopped:?}");
    }
    let running = moves::list(&config).await?;
    let (first, second) = (running[0].id, running[1].id);
    assert!(first < second);
    f.client(&ctx, 0)
        .await?
        .execute(
            "UPDATE shardline.moves SET detail = jsonb_set(detail, '{undoing}', 'true') WHERE id = $1",
            &[&first],
        )
        .await?;
    let err = cli(&f, &["move", "--resume"]).await.unwrap_err();
    assert!(err.contains("1 of 2 running move(s) could not be resumed"), "{err}");
    assert!(
        err.contains(&format!("move {first} (shard 0): move {first} of shard 0 was being undone")),
        "{err}"
    );
    assert!(err.contains(&format!("finished: move {second}")), "{err}");
    let after = moves::list(&config).await?;
    let state = |id: i64| after.iter().find(|m| m.id == id).map(|m| m.state);
    assert_eq!((state(first), state(second)), (Some(State::Running), Some(State::Done)));
    // The first is finished the way its error says.
    cli(&f, &["move", "0", "--abort"]).await?;
    assert_eq!(moves::list(&config).await?.iter().filter(|m| m.state == State::Running).count(), 0);
    Ok(())
}

shardline_testkit::register!(own: gc_gives_up_a_catalog_that_hangs_under_it);
/// `gc` whose catalog hangs (frozen while `gc`'s session waits there for another run's
/// lock, which a test session holds) fails once the catalog has answered no probe for
/// 15 s, naming it, instead of waiting for as long as it is hung; thawed, `gc` runs.
pub(crate) async fn gc_gives_up_a_catalog_that_hangs_under_it(_ctx: TestContext) -> TestResult {
    on_own_kit(2, &[], |kit| Box::pin(gc_beside_a_hung_catalog(kit))).await
}

async fn gc_beside_a_hung_catalog(kit: &shardline_testkit::Cluster) -> Result<(), BoxError> {
    let f = Fixture::on_kit(kit, "catalog_hung", 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let blocker = f.client(kit, 0).await?;
    let key = shardline_repo::catalog::GC_LOCK_KEY;
    blocker.execute("SELECT pg_advisory_lock($1)", &[&key]).await?;
    let gc_config = config.clone();
    let work = async move { moves::gc(&gc_config, Duration::ZERO).await };
    // The catalog is pg1's server: its sessions are named `shardline`.
    let (ended, took) = freeze_while_it_waits(&f, kit, 0, ("shardline", 1), work).await?;
    eprintln!("      gc with the catalog hung returned {took:?} after the freeze: {ended:?}");
    let err = ended.err().ok_or("gc returned a report while the catalog was frozen")?;
    assert!(matches!(err, OpsError::CatalogHung { .. }), "{err}");
    assert!(err.to_string().contains("the catalog answered no probe"), "{err}");
    assert!(took < Duration::from_secs(30), "{took:?}");
    blocker.execute("SELECT pg_advisory_unlock($1)", &[&key]).await?;
    moves::gc(&config, Duration::ZERO).await?;
    Ok(())
}

shardline_testkit::register!(own: every_catalog_command_gives_up_a_catalog_that_hangs_under_it);
/// Each CLI command whose work before anything is journaled is the catalog's (`map`,
/// `locate`, `moves`, the `host` commands, `rebalance --plan`, the start of a move, a
/// revert, a resume and an abort, a drain's plan) fails naming the catalog once it has
/// answered no probe for 15 s, when the catalog freezes while the command's statement
/// waits there (on the lock a test session holds on the catalog's tables), and changes
/// nothing; thawed, they run. Through the CLI, in two rounds: fourteen commands at once
/// held at their first statement (the `cluster` and `hosts` tables locked), then the
/// eight that read the journal held there (the `moves` table locked), past the hosts'
/// read every operation starts with: in a move's pre-flight, a revert's checks, a
/// resume's and an abort's reads, a `host` command's check for running moves. Before,
/// each one connected within a bound and then waited for as long as the catalog was
/// frozen.
pub(crate) async fn every_catalog_command_gives_up_a_catalog_that_hangs_under_it(
    _ctx: TestContext,
) -> TestResult {
    on_own_kit(2, &[], |kit| Box::pin(commands_beside_a_hung_catalog(kit))).await
}

async fn commands_beside_a_hung_catalog(kit: &shardline_testkit::Cluster) -> Result<(), BoxError> {
    let f = Fixture::on_kit(kit, "catalog_hung_cli", 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let map_before = cli(&f, &["map", "--json"]).await?;
    let hosts_before = cli(&f, &["host", "list", "--json"]).await?;
    let pg2 = kit.hosts()[1].url(f.db());
    let readdress = ["host", "readdress", "pg2", "--url", pg2.as_str()];
    // Those that read the journal (held there in the second round).
    let journal: Vec<&[&str]> = vec![
        &["moves"],
        &["move", "0", "--to", "pg2"],
        &["move", "0", "--to", "pg2", "--dry-run"],
        &["move", "1", "--revert"],
        &["move", "--resume"],
        &["move", "0", "--abort"],
        &["host", "remove", "pg2"],
        &readdress,
    ];
    let mut every = journal.clone();
    every.extend::<[&[&str]; 6]>([
        &["map"],
        &["locate", "--user", "7"],
        &["host", "list"],
        &["host", "add", "pg2"],
        &["host", "drain", "pg2", "--dry-run"],
        &["rebalance", "--plan"],
    ]);
    for (tables, commands) in [("shardline.cluster, shardline.hosts", &every), ("shardline.moves", &journal)]
    {
        let blocker = f.client(kit, 0).await?;
        blocker.batch_execute(&format!("BEGIN; LOCK TABLE {tables} IN ACCESS EXCLUSIVE MODE")).await?;
        let runs: Vec<_> = commands.iter().map(|c| cli_at(&f.path(), c)).collect();
        let n = i64::try_from(runs.len())?;
        // The catalog is pg1's server: every command's session there is named `shardline`.
        let (ended, took) =
            freeze_while_it_waits(&f, kit, 0, ("shardline", n), futures::future::join_all(runs)).await?;
        eprintln!(
            "      {n} commands held on {tables}, the catalog hung, returned {took:?} after the freeze"
        );
        blocker.batch_execute("ROLLBACK").await?;
        for (command, (said, result)) in commands.iter().zip(&ended) {
            let command = command.join(" ");
            let err = result
                .as_ref()
                .err()
                .ok_or_else(|| format!("`{command}` succeeded with the catalog frozen: {said}"))?;
            assert!(err.contains("the catalog answered no probe"), "`{command}`: {err}");
        }
        assert!(took < Duration::from_secs(30), "{took:?}");
        // Nothing changed, and the catalog answers again.
        assert_eq!(cli(&f, &["map", "--json"]).await?, map_before);
        assert_eq!(cli(&f, &["host", "list", "--json"]).await?, hosts_before);
        assert!(moves::list(&f.config()?).await?.is_empty());
    }
    Ok(())
}

shardline_testkit::register!(shared: a_move_started_while_gc_holds_its_lock_waits_for_it_past_hung_after);
/// A move whose journaling waits for `gc` (its lock, held here by a test session as a
/// running `gc` holds it) waits for as long as `gc` runs, while the catalog answers: it
/// is journaled once the lock is let go, 3 s past its `hung_after` of 4 s, and runs to
/// its end. Before, the wait was timed by `hung_after` and the move failed "the catalog
/// answered nothing" while the catalog answered.
pub(crate) async fn a_move_started_while_gc_holds_its_lock_waits_for_it_past_hung_after(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    let config = f.config()?;
    shardline_ops::init(&config, &options(1), &quiet).await?;
    let gc = f.client(&ctx, 0).await?;
    let key = shardline_repo::catalog::GC_LOCK_KEY;
    gc.execute("SELECT pg_advisory_lock($1)", &[&key]).await?;
    let hung_after = Duration::from_secs(4);
    let mut opts = MoveOptions::default();
    opts.hung_after = hung_after;
    let run_config = config.clone();
    let moving =
        tokio::spawn(
            async move { moves::run(&run_config, crate::shard(0), &crate::host("pg2"), &opts).await },
        );
    // The move waits for the lock: from then, it is let go 3 s past `hung_after`.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let waiting: i64 = gc
            .query_one("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())", &[])
            .await?
            .get(0);
        if waiting > 0 {
            break;
        }
        if moving.is_finished() || Instant::now() >= deadline {
            return Err(format!("the move never waited for gc's lock: {:?}", moving.await).into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(hung_after + Duration::from_secs(3)).await;
    assert!(!moving.is_finished(), "the move gave up while gc held its lock: {:?}", moving.await);
    gc.execute("SELECT pg_advisory_unlock($1)", &[&key]).await?;
    let report = moving.await??;
    assert_eq!(report.target.as_str(), "pg2");
    assert_eq!(
        Cluster::connect(&config, ClusterOptions::default()).await?.route_user(0).host.as_str(),
        "pg2"
    );
    Ok(())
}

shardline_testkit::register!(shared: a_move_whose_shard_was_moved_during_its_preflight_is_refused_whole);
/// Another move of the shard runs to its end while a move's pre-flight has passed and
/// before it is journaled (the `on_preflight` drill): the later move is refused with
/// nothing journaled, naming the source that no longer holds the shard. (Before, it was
/// journaled from that source, failed when its publication found no schema there, and
/// could neither be resumed nor aborted: its undo refused a map that placed the shard
/// elsewhere, so the shard's running move blocked every later one.)
pub(crate) async fn a_move_whose_shard_was_moved_during_its_preflight_is_refused_whole(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 2).await?;
    let other: Arc<std::sync::Mutex<Option<Result<String, String>>>> = Arc::default();
    let hook: moves::HookFn = {
        let (config, other) = (config.clone(), other.clone());
        Arc::new(move || {
            let (config, other) = (config.clone(), other.clone());
            Box::pin(async move {
                let moved =
                    moves::run(&config, crate::shard(0), &crate::host("pg3"), &MoveOptions::default())
                        .await
                        .map(|r| r.target.to_string())
                        .map_err(|e| e.to_string());
                if let Ok(mut o) = other.lock() {
                    *o = Some(moved);
                }
            })
        })
    };
    let err =
        moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default().on_preflight(hook))
            .await
            .map(|r| format!("the move ran: {r}"))
            .unwrap_err();
    let other = other.lock().map_err(|e| e.to_string())?.clone().ok_or("the drill ran")?;
    assert_eq!(other?, "pg3", "the other move");
    let text = err.to_string();
    assert!(
        matches!(&err, OpsError::Fleet { host, .. } if host.as_str() == "pg1")
            && text.contains("no longer holds shard 0"),
        "{text}"
    );
    let journal = moves::list(&config).await?;
    assert_eq!(journal.len(), 1, "only the other move is journaled: {journal:?}");
    assert_eq!((journal[0].target.as_str(), journal[0].state), ("pg3", State::Done), "{journal:?}");
    // The shard moves on from where it is.
    let report = moves::run(&config, crate::shard(0), &crate::host("pg2"), &MoveOptions::default()).await?;
    assert_eq!((report.source.as_str(), report.target.as_str()), ("pg3", "pg2"), "{report}");
    Ok(())
}

shardline_testkit::register!(shared: a_host_readdressed_during_a_moves_preflight_ends_the_move_before_anything_is_made);
/// pg3, known from the catalog only, is readdressed (here to the same server under
/// another `application_name`, as to a promoted replica) while a move onto it runs its
/// pre-flight (the `on_preflight` drill). The move was resolved at the old address:
/// the journal refuses it, naming pg3, with nothing journaled or made, and it runs
/// again at the new address. (Before, it copied the shard to the old address and
/// flipped the map to the new one.) Once a move is journaled, the readdress is refused
/// instead: the journal's row share-locks both hosts' rows, and the readdress counts
/// the running moves under the row's lock.
pub(crate) async fn a_host_readdressed_during_a_moves_preflight_ends_the_move_before_anything_is_made(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    // The operator's config without pg3: its address is the catalog's.
    let text = f.config_text()?;
    let cut = text.find("\n[[hosts]]\nname = \"pg3\"").ok_or("pg3's entry")?;
    let config = f.config_from(&text[..cut])?;
    assert!(config.host(&crate::host("pg3")).is_none());
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 6, 2).await?;
    let pg3 = &ctx.hosts()[2];
    let (moved_url, peer) =
        (format!("{}?application_name=readdressed", pg3.url(f.db())), pg3.peer_url(f.db()));
    let readdressed: Arc<std::sync::Mutex<Option<Result<(), String>>>> = Arc::default();
    let hook: moves::HookFn = {
        let (config, readdressed, url, peer) =
            (config.clone(), readdressed.clone(), moved_url.clone(), peer.clone());
        Arc::new(move || {
            let (config, readdressed) = (config.clone(), readdressed.clone());
            let (url, peer) = (DbUrl::new(url.clone()), DbUrl::new(peer.clone()));
            Box::pin(async move {
                let done = shardline_ops::fleet::readdress(&config, &crate::host("pg3"), &url, Some(&peer))
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string());
                if let Ok(mut r) = readdressed.lock() {
                    *r = Some(done);
                }
            })
        })
    };
    let err =
        moves::run(&config, crate::shard(0), &crate::host("pg3"), &MoveOptions::default().on_preflight(hook))
            .await
            .map(|r| format!("the move ran: {r}"))
            .unwrap_err();
    readdressed.lock().map_err(|e| e.to_string())?.clone().ok_or("the drill ran")??;
    let text = err.to_string();
    assert!(
        matches!(&err, OpsError::Fleet { host, .. } if host.as_str() == "pg3")
            && text.contains("was readdressed"),
        "{text}"
    );
    let journal = moves::list(&config).await?;
    assert!(journal.is_empty(), "nothing journaled: {journal:?}");
    assert_eq!(counts(&f, &ctx, 2, "shard_0000").await?, None, "nothing made on pg3");
    assert_eq!(leftovers(&f, &ctx).await?, vec![0, 0, 0]);
    // Run again, it moves the shard to pg3 at its new address.
    let report = moves::run(&config, crate::shard(0), &crate::host("pg3"), &MoveOptions::default()).await?;
    assert_eq!(report.target.as_str(), "pg3");
    assert_eq!(counts(&f, &ctx, 2, "shard_0000").await?, Some([40, 40, 40]));

    // A readdress while a move onto the host is journaled is refused, and changes nothing.
    let stopped = moves::run(
        &config,
        crate::shard(1),
        &crate::host("pg3"),
        &MoveOptions::default().stopping_after(Step::Prepared),
    )
    .await;
    assert!(stopped.is_err(), "{stopped:?}");
    let refused = shardline_ops::fleet::readdress(
        &config,
        &crate::host("pg3"),
        &DbUrl::new(pg3.url(f.db())),
        Some(&DbUrl::new(peer.clone())),
    )
    .await
    .map(|r| format!("readdressed: {r:?}"))
    .unwrap_err()
    .to_string();
    assert!(refused.contains("is running"), "{refused}");
    // The catalog's own check, under the host row's lock (the readdress above was
    // refused by its look at the journal before it): a readdress that looked before the
    // move was journaled, and records after, is refused there.
    let catalog = Catalog::open(&config).await?.0;
    let (url, peer_url) = (DbUrl::new(pg3.url(f.db())), DbUrl::new(peer.clone()));
    let err =
        catalog.set_address(&crate::host("pg3"), &url, &peer_url).await.map(|k| format!("recorded: {k}"));
    let err = err.unwrap_err();
    assert!(
        matches!(&err, shardline_repo::Error::InvalidCatalog { reason } if reason.contains("readdress it once the move ends")),
        "{err}"
    );
    let hosts = catalog.hosts().await?;
    let recorded = hosts.iter().find(|h| h.name.as_str() == "pg3").and_then(|h| h.address.clone());
    assert!(recorded.is_some_and(|a| a.expose().contains("readdressed")), "the address stays");
    moves::abort(&config, crate::shard(1), &MoveOptions::default()).await?;
    Ok(())
}

shardline_testkit::register!(shared: a_resumed_move_refuses_migration_files_changed_since_it_started);
/// A move stopped after it was journaled, then a migration file added (`migrate`
/// refuses while the move runs, but the directory is the operator's): `--resume` runs
/// no pre-flight, and built the copy from the new files, which the source never had (a
/// function or a grant is not in the comparison, so such a move flipped with the shard
/// holding DDL no other shard has). It refuses now, naming the file, and builds nothing;
/// with the directory put back it resumes to the end.
pub(crate) async fn a_resumed_move_refuses_migration_files_changed_since_it_started(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    seed(&cluster, 0, 4, 2).await?;
    stopped_after(&config, 0, "pg2", Step::Started).await?;
    f.migration("0005_f.sql", "CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'SELECT 1';")?;
    let err = moves::resume(&f.config()?, Some(crate::shard(0)), &MoveOptions::default())
        .await
        .map(|r| format!("resumed: {r:?}"))
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("not at the config's migration level") && text.contains("0005_f.sql"), "{text}");
    let pg2 = f.client(&ctx, 1).await?;
    let built: bool = pg2
        .query_one("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = 'shard_0000')", &[])
        .await?
        .get(0);
    assert!(!built, "the copy was built from the changed files");
    let journal = moves::list(&config).await?;
    assert_eq!((journal.len(), journal[0].state), (1, State::Running), "{journal:?}");
    f.remove_migration("0005_f.sql")?;
    let reports = moves::resume(&f.config()?, Some(crate::shard(0)), &MoveOptions::default()).await?;
    assert_eq!(reports.len(), 1);
    assert_eq!((reports[0].source.as_str(), reports[0].target.as_str()), ("pg1", "pg2"));
    Ok(())
}
