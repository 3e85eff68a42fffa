//! Promises of the repository API that a careful read found broken (issue 15), each
//! tried the way an application meets it: a batch over the parameter limit while one of
//! its shards moves, a transaction whose closure handles a failed statement, an ID asked
//! twice, and errors classified by where they happened.

use std::collections::HashMap;
use std::time::Duration;

use shardline_example_photos::{NewPhoto, Photo};
use shardline_id::Id;
use shardline_ops::moves::{self, MoveOptions, Step};
use shardline_repo::{Cluster, ClusterOptions, Error};
use shardline_testkit::harness::{TestContext, TestResult};

use crate::bootstrap::{BoxError, Fixture, options, quiet};

fn photo(user_id: i64, n: usize) -> NewPhoto {
    NewPhoto { user_id, url: format!("https://cdn/{user_id}/{n}.jpg"), caption: format!("batch {n}") }
}

/// How many times each caption is stored in the live shard schemas of `shards`, over
/// every host (a moved shard's old copy, renamed on its source, is not live).
async fn captions(f: &Fixture, ctx: &TestContext, shards: u16) -> Result<HashMap<String, i64>, BoxError> {
    let mut seen = HashMap::new();
    for h in 0..f.hosts {
        let c = f.client(ctx, h).await?;
        for s in 0..shards {
            let schema = format!("shard_{s:04}");
            let exists: bool = c
                .query_one("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", &[&schema])
                .await?
                .get(0);
            if !exists {
                continue;
            }
            for row in
                c.query(&format!("SELECT caption, count(*) FROM {schema}.photos GROUP BY 1"), &[]).await?
            {
                *seen.entry(row.get::<_, String>(0)).or_insert(0) += row.get::<_, i64>(1);
            }
        }
    }
    Ok(seen)
}

shardline_testkit::register!(shared: insert_many_is_whole_per_host_and_never_twice_across_a_move);
/// A batch of 100,000 photos over 2 hosts (three statements on each, past the bind
/// parameter limit) while one of its shards moves: the move fences the shard after the
/// batch's first statement on that host ran and before its last one reaches the shard.
/// Each host's part is one transaction, so the host that met the fence rolls back whole
/// and its rows go in once under the new map: every row exactly once, none lost.
pub(crate) async fn insert_many_is_whole_per_host_and_never_twice_across_a_move(
    ctx: TestContext,
) -> TestResult {
    const ROWS: usize = 100_000;
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let config = f.config()?;
    let o =
        ClusterOptions { listen: false, host_timeout: Duration::from_secs(120), ..ClusterOptions::default() };
    let cluster = Cluster::connect(&config, o).await?;
    let on_pg2: Vec<i64> = (0..4).filter(|u| cluster.route_user(*u).host.as_str() == "pg2").collect();
    assert_eq!(on_pg2, vec![2, 3], "init places shards in ranges (user u lives in shard u)");
    // Shard 3 moves from pg2 to pg1; everything but the fence is done first.
    let stopping = MoveOptions::default().stopping_after(Step::CaughtUp);
    moves::run(&config, crate::shard(3), &crate::host("pg1"), &stopping).await.unwrap_err();

    // Shard 2's table is held, so pg2's first statement (shard 2's rows) waits on it;
    // shard 3's rows come in a later statement of the same host.
    let pg2 = f.client(&ctx, 1).await?;
    pg2.batch_execute("BEGIN; LOCK TABLE shard_0002.photos IN SHARE MODE").await?;
    let photos = cluster.repo::<Photo>()?;
    let users = [0_i64, 1, 2, 3];
    let batch: Vec<NewPhoto> = (0..ROWS).map(|i| photo(users[i % 4], i)).collect();
    let batch = std::sync::Arc::new(batch);
    let task = {
        let (photos, batch) = (photos.clone(), batch.clone());
        tokio::spawn(async move { photos.insert_many(&batch).await })
    };
    let watch = f.client(&ctx, 1).await?;
    let waiting = "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                    WHERE NOT l.granted AND c.relname = 'photos' AND c.relnamespace = 'shard_0002'::regnamespace";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while watch.query_one(waiting, &[]).await?.get::<_, i64>(0) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the batch never reached shard 2");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // While pg2's first statement waits: fence, verify and flip shard 3 onto pg1.
    let report = moves::resume(&config, Some(crate::shard(3)), &MoveOptions::default()).await?;
    assert_eq!(report.len(), 1);
    pg2.batch_execute("COMMIT").await?;
    let inserted = task.await??;

    assert_eq!(inserted.len(), ROWS);
    for (i, p) in inserted.iter().enumerate() {
        assert_eq!(p.caption, format!("batch {i}"), "rows come back in the caller's order");
    }
    let stored = captions(&f, &ctx, 4).await?;
    let twice: Vec<(&String, &i64)> = stored.iter().filter(|(_, n)| **n != 1).take(5).collect();
    assert!(twice.is_empty(), "captions stored other than once: {twice:?}");
    assert_eq!(stored.len(), ROWS, "every row of the batch is stored");
    for p in &inserted {
        let shard = cluster.layout().decode(p.id).shard;
        assert_eq!(i64::from(shard), p.user_id, "minted in the user's shard");
        let home = cluster.route_user(p.user_id).host;
        assert_eq!(home.as_str(), if p.user_id == 2 { "pg2" } else { "pg1" }, "shard 3 now lives on pg1");
    }
    Ok(())
}

shardline_testkit::register!(shared: a_partly_applied_batch_names_the_hosts_that_committed);
/// A host's part of a batch fails (a CHECK in one comment) while the other hosts' parts
/// commit: the error names the hosts that committed and says the outcome is not clean.
pub(crate) async fn a_partly_applied_batch_names_the_hosts_that_committed(ctx: TestContext) -> TestResult {
    use shardline_example_photos::{Comment, NewComment};
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let (photos, comments) = (cluster.repo::<Photo>()?, cluster.repo::<Comment>()?);
    let posted = photos.insert_many(&(0..6).map(|u| photo(u, 0)).collect::<Vec<_>>()).await?;
    let batch: Vec<NewComment> = posted
        .iter()
        .map(|p| NewComment {
            photo_id: p.id,
            user_id: 7,
            body: if p.user_id == 3 { String::new() } else { "x".into() },
        })
        .collect();
    let err = comments.insert_many(&batch).await.unwrap_err();
    match &err {
        Error::InsertMany { committed, failed, source, .. } => {
            assert_eq!(committed, &["pg1", "pg3"], "{err}");
            assert_eq!(failed.as_ref().map(|h| h.as_str()), Some("pg2"));
            assert_eq!(source.sqlstate(), Some("23514"), "{source}");
        }
        other => panic!("expected InsertMany, got {other:?}"),
    }
    assert!(err.outcome_unknown(), "part of the batch is in");
    assert!(!err.is_retryable(), "running the whole batch again would insert pg1's and pg3's part twice");
    assert_eq!(err.sqlstate(), Some("23514"));
    for p in &posted {
        let n = comments.page_of_parent(p.id, None, 10).await?.rows.len();
        assert_eq!(
            n,
            usize::from(!(2..4).contains(&p.user_id)),
            "comments of the photo in shard {}",
            p.user_id
        );
    }
    // Every host's part failing: nothing committed, the plain error, outcome known.
    let all_bad: Vec<NewComment> =
        posted.iter().map(|p| NewComment { photo_id: p.id, user_id: 7, body: String::new() }).collect();
    let err = comments.insert_many(&all_bad).await.unwrap_err();
    assert!(matches!(err, Error::Host { .. }), "{err:?}");
    assert!(!err.outcome_unknown(), "{err}");
    Ok(())
}

shardline_testkit::register!(shared: a_batch_failing_on_two_hosts_names_every_row_whose_outcome_is_unknown);
/// A batch over three hosts: pg1's part commits while pg2's and pg3's wait on locks the
/// test holds until the host timeout gives them up (outcome unknown). The error names
/// pg1's rows as committed and every row of pg2 and pg3 as unknown, so a caller who
/// inserts again only the rows in neither list inserts nothing twice. Before: only the
/// reported host's part was said to be unknown; the other's read as not applied.
pub(crate) async fn a_batch_failing_on_two_hosts_names_every_row_whose_outcome_is_unknown(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let o = ClusterOptions { host_timeout: Duration::from_secs(1), ..ClusterOptions::default() };
    let cluster = Cluster::connect(&f.config()?, o).await?;
    let photos = cluster.repo::<Photo>()?;
    let batch: Vec<NewPhoto> = (0..12_i64).zip(0_usize..).map(|(i, n)| photo(i % 6, n)).collect();
    let host_of = |i: usize| cluster.route_user(batch[i].user_id).host;
    // Lock every shard table of pg2 and pg3 that the batch writes into.
    let mut holders = Vec::new();
    for h in 1..3 {
        let c = f.client(&ctx, h).await?;
        let mut schemas: Vec<String> = (0..batch.len())
            .filter(|&i| host_of(i).as_str() == format!("pg{}", h + 1))
            .map(|i| cluster.route_user(batch[i].user_id).schema.quoted())
            .collect();
        schemas.sort();
        schemas.dedup();
        assert!(!schemas.is_empty(), "the batch writes into pg{}", h + 1);
        let tables: Vec<String> = schemas.iter().map(|s| format!("{s}.photos")).collect();
        c.batch_execute(&format!("BEGIN; LOCK TABLE {} IN EXCLUSIVE MODE", tables.join(", "))).await?;
        holders.push(c);
    }
    let err = photos.insert_many(&batch).await.unwrap_err();
    for c in &holders {
        c.batch_execute("ROLLBACK").await?;
    }
    let (on_pg1, elsewhere): (Vec<usize>, Vec<usize>) =
        (0..batch.len()).partition(|&i| host_of(i).as_str() == "pg1");
    match &err {
        Error::InsertMany { committed, committed_rows, unknown_rows, source, .. } => {
            assert_eq!(committed, &["pg1"], "{err}");
            assert_eq!(committed_rows, &on_pg1, "{err}");
            assert_eq!(unknown_rows, &elsewhere, "every row of pg2 and pg3: {err}");
            assert!(source.outcome_unknown(), "{source}");
        }
        other => panic!("expected InsertMany, got {other:?}"),
    }
    assert!(err.to_string().contains(&format!("{} rows' outcome is unknown", elsewhere.len())), "{err}");
    Ok(())
}

shardline_testkit::register!(shared: a_transaction_with_a_handled_failure_reports_its_rollback);
/// The closure of a transaction handles a failed statement (a unique violation) and
/// returns `Ok`: Postgres aborted the transaction, so the call must say it rolled back.
pub(crate) async fn a_transaction_with_a_handled_failure_reports_its_rollback(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let existing = photos.insert(&photo(1, 0)).await?;
    let shard = cluster.route_user(1).shard;
    let result = cluster
        .transaction(shard, |tx| {
            Box::pin(async move {
                let kept = tx.insert(&photo(1, 1)).await?;
                let dup = tx
                    .execute("INSERT INTO photos (id, user_id, url) VALUES ($1, 1, 'dup')", &[&existing.id])
                    .await;
                match dup {
                    Err(e) if e.is_unique_violation() => {}
                    other => panic!("expected a unique violation, got {other:?}"),
                }
                Ok::<_, Error>(kept.id)
            })
        })
        .await;
    let err = result.unwrap_err();
    assert!(matches!(err, Error::RolledBack { shard: s, .. } if s == shard), "{err:?}");
    assert!(!err.outcome_unknown(), "nothing was applied: {err}");
    assert!(err.to_string().contains("rolled back"), "{err}");
    let page = photos.page_of_user(1, None, 10).await?;
    assert_eq!(
        page.rows.iter().map(|p| p.id).collect::<Vec<_>>(),
        vec![existing.id],
        "the insert was rolled back"
    );
    // The pooled connection is clean afterwards: a transaction on it commits.
    let id = cluster
        .transaction(shard, |tx| Box::pin(async move { Ok::<_, Error>(tx.insert(&photo(1, 2)).await?.id) }))
        .await?;
    assert!(photos.get(id).await?.is_some());
    Ok(())
}

shardline_testkit::register!(shared: get_many_answers_every_id_asked_also_twice);
/// `get_many` answers one entry per ID asked, in order, also for an ID asked twice.
pub(crate) async fn get_many_answers_every_id_asked_also_twice(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let (a, b) = (photos.insert(&photo(0, 0)).await?, photos.insert(&photo(3, 0)).await?);
    let absent = cluster.layout().compose(1_700_000_000_000, 1, 1)?;
    let many = photos.get_many(&[a.id, b.id, a.id, absent, a.id, absent]).await?;
    let got: Vec<Option<Id>> = many.rows.iter().map(|r| r.as_ref().map(|p| p.id)).collect();
    assert_eq!(got, vec![Some(a.id), Some(b.id), Some(a.id), None, Some(a.id), None]);
    assert_eq!(many.missing, vec![absent, absent], "missing lists only what is absent, once per ask");
    Ok(())
}

shardline_testkit::register!(shared: errors_are_classified_by_where_they_happened);
/// Errors say whether a write may have been applied and whether a retry may help, by
/// where the failure happened: before anything was sent, refused by the server, or lost
/// on the way.
pub(crate) async fn errors_are_classified_by_where_they_happened(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let p = photos.insert(&photo(2, 0)).await?;

    // Not sent: an i64 for a text column cannot be encoded; the server never sees it.
    let err = photos.update(p.id, &[("caption", &7_i64)]).await.unwrap_err();
    assert!(matches!(&err, Error::Unsent { parameter: 2, expected, .. } if expected == "text"), "{err:?}");
    assert!(!err.outcome_unknown() && !err.is_retryable(), "{err}");
    assert!(err.to_string().contains("parameter 2"), "{err}");
    let shard = cluster.route_user(2).shard;
    let err = cluster
        .transaction(shard, |tx| {
            Box::pin(async move {
                tx.execute("UPDATE photos SET caption = $1 WHERE id = $2", &[&1_i32, &p.id]).await
            })
        })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Unsent { parameter: 1, .. }), "{err:?}");
    assert!(!err.outcome_unknown() && !err.is_retryable(), "{err}");
    assert_eq!(photos.get(p.id).await?.map(|p| p.caption), Some("batch 0".to_owned()), "nothing changed");

    // Refused by the server: known not applied, not worth retrying.
    let err = cluster
        .transaction(shard, |tx| {
            Box::pin(async move {
                tx.execute("INSERT INTO photos (id, user_id, url) VALUES ($1, 2, 'x')", &[&p.id]).await
            })
        })
        .await
        .unwrap_err();
    assert!(err.is_unique_violation() && !err.outcome_unknown() && !err.is_retryable(), "{err}");

    // Lost on the way: the session ends while the statement runs; it may have been
    // applied, and running it again may work.
    let host = cluster.route(shard)?.host;
    let h = if host.as_str() == "pg1" { 0 } else { 1 };
    let killer = f.client(&ctx, h).await?;
    let running = tokio::spawn({
        let cluster = cluster.clone();
        async move {
            cluster
                .transaction(shard, |tx| {
                    Box::pin(async move {
                        tx.execute(
                            "UPDATE photos SET caption = 'late' WHERE id = $1 AND pg_sleep(30) IS NOT NULL",
                            &[&p.id],
                        )
                        .await
                    })
                })
                .await
        }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let n = killer
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                  WHERE datname = current_database() AND query LIKE 'UPDATE photos SET caption = ''late''%' AND state = 'active'",
                &[],
            )
            .await?;
        if n > 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the statement never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let err = running.await?.unwrap_err();
    assert!(err.outcome_unknown() && err.is_retryable(), "{err:?}");

    Ok(())
}

/// A Postgres enum of the shard schema, as an application maps it: every shard has its
/// own copy of the type (`shard_0007.mood`), so its OID differs from shard to shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mood(pub(crate) String);

impl shardline_repo::tokio_postgres::types::ToSql for Mood {
    fn to_sql(
        &self,
        _: &shardline_repo::tokio_postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<shardline_repo::tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        out.extend_from_slice(self.0.as_bytes());
        Ok(shardline_repo::tokio_postgres::types::IsNull::No)
    }

    fn accepts(ty: &shardline_repo::tokio_postgres::types::Type) -> bool {
        ty.name() == "mood"
    }

    shardline_repo::tokio_postgres::types::to_sql_checked!();
}

impl<'a> shardline_repo::tokio_postgres::types::FromSql<'a> for Mood {
    fn from_sql(
        _: &shardline_repo::tokio_postgres::types::Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(Mood(std::str::from_utf8(raw)?.to_owned()))
    }

    /// The enum itself, or `text` (statements over several shards read it as text).
    fn accepts(ty: &shardline_repo::tokio_postgres::types::Type) -> bool {
        ty.name() == "mood" || *ty == shardline_repo::tokio_postgres::types::Type::TEXT
    }
}

#[derive(Debug, Clone, PartialEq, shardline_repo::Entity)]
#[shardline(table = "moods")]
pub(crate) struct Feeling {
    id: Id,
    #[shardline(user)]
    user_id: i64,
    mood: Mood,
}

#[derive(Debug, shardline_repo::NewRow)]
#[shardline(entity = Feeling)]
pub(crate) struct NewFeeling {
    #[shardline(user)]
    pub(crate) user_id: i64,
    pub(crate) mood: Mood,
}

shardline_testkit::register!(shared: an_enum_column_works_in_every_operation_across_64_shards);
/// An entity with an enum column (a type each shard schema has its own copy of) goes
/// through every repository operation and a `for_each_shard` over 64 shards.
pub(crate) async fn an_enum_column_works_in_every_operation_across_64_shards(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 64).await?;
    f.migration(
        "0005_moods.sql",
        "CREATE TYPE mood AS ENUM ('happy', 'sad');
         CREATE TABLE moods (id bigint PRIMARY KEY DEFAULT next_id(), user_id bigint NOT NULL, mood mood NOT NULL);
         CREATE TABLE notes (id bigint PRIMARY KEY DEFAULT next_id(), moods mood[], body json, price money, at point);
         CREATE TABLE tags (mood mood, body json, doc xml);
         ALTER TABLE tags REPLICA IDENTITY FULL;
         CREATE DOMAIN handle AS text CHECK (VALUE <> '');
         CREATE TABLE by_mood (mood mood PRIMARY KEY, n int NOT NULL);
         CREATE TABLE handles (h handle PRIMARY KEY, n int NOT NULL);
         CREATE TABLE mood_sets (moods mood[] PRIMARY KEY);",
    )?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let feelings = cluster.repo::<Feeling>()?;
    let happy = || Mood("happy".into());
    let started = std::time::SystemTime::now() - Duration::from_secs(1);

    let one = feelings.insert(&NewFeeling { user_id: 5, mood: happy() }).await?;
    assert_eq!(one.mood, happy());
    let many = feelings
        .insert_many(&(0..128).map(|u| NewFeeling { user_id: u, mood: happy() }).collect::<Vec<_>>())
        .await?;
    assert_eq!(many.len(), 128);
    assert_eq!(feelings.get(one.id).await?, Some(one.clone()));
    let ids: Vec<Id> = many.iter().map(|m| m.id).collect();
    let got = feelings.get_many(&ids).await?;
    assert!(got.missing.is_empty());
    assert_eq!(got.rows.iter().flatten().count(), 128);
    let sad = feelings.update(many[37].id, &[("mood", &Mood("sad".into()))]).await?;
    assert_eq!(sad.map(|m| m.mood), Some(Mood("sad".into())));
    assert_eq!(feelings.page_of_user(5, None, 10).await?.rows.len(), 2);
    let window = feelings.created_between(started, std::time::SystemTime::now(), 1000).await?;
    assert!(window.is_complete(), "{:?}", window.missing);
    assert_eq!(window.rows.len(), 129);
    assert!(feelings.delete(one.id).await?);

    // Inside shard transactions, the caller's own SQL over the shard's enum, on pooled
    // connections that go from shard to shard.
    let results = cluster
        .for_each_shard(|tx| {
            Box::pin(async move {
                let rows =
                    tx.query("SELECT mood, count(*) FROM moods GROUP BY mood ORDER BY mood", &[]).await?;
                let moods: Vec<(Mood, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
                let n = tx
                    .execute("UPDATE moods SET mood = $1 WHERE mood = 'sad'", &[&Mood("happy".into())])
                    .await?;
                Ok::<_, Error>((moods, n))
            })
        })
        .await;
    assert_eq!(results.len(), 64);
    let failed: Vec<String> =
        results.iter().filter_map(|(s, r)| r.as_ref().err().map(|e| format!("shard {s}: {e}"))).collect();
    assert!(failed.is_empty(), "{} of 64 shards failed: {:?}", failed.len(), &failed[..failed.len().min(3)]);
    let changed: u64 = results.iter().filter_map(|(_, r)| r.as_ref().ok().map(|(_, n)| *n)).sum();
    assert_eq!(changed, 1, "the one sad row");

    // Moves: the verification compares rows across servers, where the enum's labels have
    // other OIDs and `json`, `money` and `point` have no hash of their own. Shard 5's rows
    // move with the change log, and shard 6's with every row verified.
    for (user, verification) in [(5, moves::Verification::ChangeLog), (6, moves::Verification::Full)] {
        let route = cluster.route_user(user);
        cluster
            .transaction(route.shard, |tx| {
                Box::pin(async move {
                    tx.execute(
                        "INSERT INTO notes (moods, body, price, at) VALUES ('{happy,sad}', '{\"a\": [1, 2]}', 12.5, '(1,2)')",
                        &[],
                    )
                    .await?;
                    tx.execute("INSERT INTO tags VALUES ('sad', '{}', '<a/>'), ('sad', '{}', '<a/>'), (NULL, NULL, NULL)", &[]).await?;
                    // Keys whose types are the shard's own (an enum, a domain, an
                    // enum's array): the change log reads them back as those types.
                    tx.execute("INSERT INTO by_mood VALUES ('sad', 1), ('happy', 2)", &[]).await?;
                    tx.execute("INSERT INTO handles VALUES ('h1', 1)", &[]).await?;
                    tx.execute("INSERT INTO mood_sets VALUES ('{happy,sad}'), ('{sad}')", &[]).await?;
                    Ok::<_, Error>(())
                })
            })
            .await?;
        let to = if route.host.as_str() == "pg1" { "pg2" } else { "pg1" };
        let options = MoveOptions::default().verifying(verification);
        let report = moves::run(&f.config()?, route.shard, &crate::host(to), &options).await;
        let report = report.map_err(|e| format!("moving shard {} ({verification:?}): {e}", route.shard))?;
        assert!(report.rows > 0, "{report:?}");
    }
    cluster.refresh().await?;
    let moved = feelings.page_of_user(5, None, 10).await?;
    assert_eq!(moved.rows.len(), 1);
    assert_eq!(moved.rows[0].mood, happy());
    for user in [5, 6] {
        let counted = cluster
            .transaction(cluster.route_user(user).shard, |tx| {
                Box::pin(async move {
                    let r = tx
                        .query(
                            "SELECT (SELECT count(*) FROM notes WHERE body::text = '{\"a\": [1, 2]}' AND moods = '{happy,sad}'),
                                    (SELECT count(*) FROM tags),
                                    (SELECT count(*) FROM by_mood) + (SELECT count(*) FROM handles)
                                      + (SELECT count(*) FROM mood_sets)",
                            &[],
                        )
                        .await?;
                    Ok::<_, Error>((r[0].get::<_, i64>(0), r[0].get::<_, i64>(1), r[0].get::<_, i64>(2)))
                })
            })
            .await?;
        assert_eq!(counted, (1, 3, 5), "user {user}'s shard after its move");
    }
    Ok(())
}

shardline_testkit::register!(shared: an_enum_column_added_by_a_later_migration_is_read_across_shards);
/// A handle that read across shards before a migration added an enum column to the
/// entity's table reads across them after it. The select list of statements over several
/// shards reads a column whose type lives in the shard's schema as `text` (`UNION ALL`
/// cannot match two shards' copies of an enum). Before, the list was learnt and kept from
/// the first shard read, even while its table lacked the column, so the column was read
/// as itself for the life of the handle, and every statement over two shards failed
/// (42846).
pub(crate) async fn an_enum_column_added_by_a_later_migration_is_read_across_shards(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    f.migration(
        "0005_moods.sql",
        "CREATE TABLE moods (id bigint PRIMARY KEY DEFAULT next_id(), user_id bigint NOT NULL);",
    )?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    for user in 0..4 {
        cluster
            .transaction(cluster.route_user(user).shard, |tx| {
                Box::pin(async move { tx.execute("INSERT INTO moods (user_id) VALUES ($1)", &[&user]).await })
            })
            .await?;
    }
    let feelings = cluster.repo::<Feeling>()?;
    // Every host holds two shards: each host's statement spans two schemas.
    let before = feelings.newest(None, 10).await?;
    assert_eq!(
        before.missing.iter().map(|m| m.shards.len()).sum::<usize>(),
        4,
        "no shard has the column yet"
    );
    f.migration(
        "0006_mood.sql",
        "CREATE TYPE mood AS ENUM ('happy', 'sad');
         ALTER TABLE moods ADD COLUMN mood mood NOT NULL DEFAULT 'happy';",
    )?;
    shardline_ops::migrate(&f.config()?, &options(1), &quiet).await?;
    let after = feelings.newest(None, 10).await?;
    assert!(after.is_complete(), "the same handle after the migration: {:?}", after.missing);
    assert_eq!(after.rows.len(), 4);
    assert!(after.rows.iter().all(|r| r.mood == Mood("happy".into())));
    let ids: Vec<Id> = after.rows.iter().map(|r| r.id).collect();
    let got = feelings.get_many(&ids).await?;
    assert_eq!((got.rows.iter().flatten().count(), got.missing.len()), (4, 0));
    Ok(())
}

#[derive(Debug, Clone, PartialEq, shardline_repo::Entity)]
#[shardline(table = "attrs")]
pub(crate) struct Attrs {
    id: Id,
    #[shardline(user)]
    user_id: i64,
    attrs: HashMap<String, Option<String>>,
}

#[derive(Debug, shardline_repo::NewRow)]
#[shardline(entity = Attrs)]
pub(crate) struct NewAttrs {
    #[shardline(user)]
    pub(crate) user_id: i64,
    pub(crate) attrs: HashMap<String, Option<String>>,
}

shardline_testkit::register!(shared: an_extension_type_shared_by_the_schemas_is_read_as_itself_across_shards);
/// A column of an extension's type (`hstore`, made once per database in `public`, so
/// every shard schema shares it) reads as itself in the statements that span shards
/// (`get_many`, `insert_many`'s rows, the time window, the newest-first pages), as it
/// does in a single-shard read. (Before, every type with an OID past the built-in ones
/// was read as `text` there: `get_many` and `insert_many` failed to decode it, and the
/// pages came back empty with every shard reported missing.)
pub(crate) async fn an_extension_type_shared_by_the_schemas_is_read_as_itself_across_shards(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 8).await?;
    for h in 0..2 {
        f.client(&ctx, h).await?.batch_execute("CREATE EXTENSION IF NOT EXISTS hstore SCHEMA public").await?;
    }
    f.migration(
        "0005_attrs.sql",
        "CREATE TABLE attrs (id bigint PRIMARY KEY DEFAULT next_id(), user_id bigint NOT NULL, attrs public.hstore NOT NULL);",
    )?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let cluster = Cluster::connect(&f.config()?, ClusterOptions::default()).await?;
    let repo = cluster.repo::<Attrs>()?;
    let attrs = |u: i64| HashMap::from([("user".to_owned(), Some(u.to_string())), ("none".to_owned(), None)]);
    let started = std::time::SystemTime::now() - Duration::from_secs(1);
    let one = repo.insert(&NewAttrs { user_id: 3, attrs: attrs(3) }).await?;
    assert_eq!(repo.get(one.id).await?, Some(one.clone()));
    let many = repo
        .insert_many(&(0..16).map(|u| NewAttrs { user_id: u, attrs: attrs(u) }).collect::<Vec<_>>())
        .await?;
    assert_eq!(
        many.iter().map(|a| a.attrs.clone()).collect::<Vec<_>>(),
        (0..16).map(attrs).collect::<Vec<_>>()
    );
    let ids: Vec<Id> = many.iter().map(|a| a.id).collect();
    let got = repo.get_many(&ids).await?;
    assert!(got.missing.is_empty(), "{:?}", got.missing);
    assert_eq!(got.rows.into_iter().flatten().collect::<Vec<_>>(), many);
    let window = repo.created_between(started, std::time::SystemTime::now(), 100).await?;
    assert!(window.is_complete(), "missing {:?}", window.missing);
    assert_eq!(window.rows.len(), 17);
    assert!(window.rows.iter().all(|a| a.attrs == attrs(a.user_id)));
    let newest = repo.newest(None, 5).await?;
    assert!(newest.is_complete(), "missing {:?}", newest.missing);
    assert_eq!(newest.rows.len(), 5);
    Ok(())
}

shardline_testkit::register!(shared: a_partitioned_table_moves_whole_with_its_shard);
/// A shard with a partitioned table (a partition, a partitioned one with two of its own,
/// a default one; an index of the table's built whole, one built partition by partition
/// under names of their own and attached, one of a partition's alone; a foreign key to
/// the shard's photos, so a copy is emptied with the partitioned table named) moves with every
/// row: copied by the mover or by Postgres, verified by the change log or in full, with
/// writes between the steps. Afterwards the target has the source's indexes, under the
/// same names, attached and valid, and its materialized view filled from the copy (made
/// by the migrations while its tables were empty, it stayed empty); the table takes
/// writes there; a move verified by the
/// change log read none of its rows again in full; and `gc` leaves no trigger. (Before,
/// the move failed at `caught_up`: the partitioned index was built again, 42P07, and the
/// change log's trigger could not be dropped from a partition, 2BP01; then the indexes
/// attached by hand were built again under other names, and the partitioned table was
/// read whole inside the fence.)
pub(crate) async fn a_partitioned_table_moves_whole_with_its_shard(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    f.migration(
        "0005_events.sql",
        "CREATE TABLE events (id bigint NOT NULL DEFAULT next_id(), user_id bigint NOT NULL, day date NOT NULL,
                              body text, photo_id bigint REFERENCES photos (id),
                              PRIMARY KEY (id, day)) PARTITION BY RANGE (day);
         CREATE TABLE events_2026 PARTITION OF events FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
         CREATE TABLE events_2027 PARTITION OF events FOR VALUES FROM ('2027-01-01') TO ('2028-01-01')
             PARTITION BY RANGE (day);
         CREATE TABLE events_2027_h1 PARTITION OF events_2027 FOR VALUES FROM ('2027-01-01') TO ('2027-07-01');
         CREATE TABLE events_2027_h2 PARTITION OF events_2027 FOR VALUES FROM ('2027-07-01') TO ('2028-01-01');
         CREATE TABLE events_other PARTITION OF events DEFAULT;
         CREATE INDEX events_by_user ON events (user_id, day);
         CREATE INDEX events_h2_day ON events_2027_h2 (day);
         -- Postgres's own way to index partitions one by one: ON ONLY, then each
         -- partition's under a name of its own, attached.
         CREATE INDEX events_by_body ON ONLY events (body);
         CREATE INDEX e26_body ON events_2026 (body);
         CREATE INDEX e27_body ON ONLY events_2027 (body);
         CREATE INDEX e27h1_body ON events_2027_h1 (body);
         CREATE INDEX e27h2_body ON events_2027_h2 (body);
         CREATE INDEX other_body ON events_other (body);
         ALTER INDEX e27_body ATTACH PARTITION e27h1_body;
         ALTER INDEX e27_body ATTACH PARTITION e27h2_body;
         ALTER INDEX events_by_body ATTACH PARTITION e26_body;
         ALTER INDEX events_by_body ATTACH PARTITION e27_body;
         ALTER INDEX events_by_body ATTACH PARTITION other_body;
         CREATE MATERIALIZED VIEW events_per_user AS SELECT user_id, count(*) AS n FROM events GROUP BY user_id;",
    )?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let write = |user: i64, n: i64| {
        let cluster = &cluster;
        async move {
            cluster
                .transaction(cluster.route_user(user).shard, |tx| {
                    Box::pin(async move {
                        tx.execute(
                            "INSERT INTO events (user_id, day, body)
                             SELECT $1, date '2026-06-01' + (i * 170)::int, 'e' || i FROM generate_series(1, $2::bigint) AS i",
                            &[&user, &n],
                        )
                        .await
                    })
                })
                .await
        }
    };
    let count = |user: i64| {
        let cluster = &cluster;
        async move {
            cluster
                .transaction(cluster.route_user(user).shard, |tx| {
                    Box::pin(async move {
                        let r = tx
                            .query(
                                "SELECT count(*), count(DISTINCT tableoid), (SELECT count(*) FROM ONLY events)
                                   FROM events",
                                &[],
                            )
                            .await?;
                        Ok::<_, Error>((r[0].get::<_, i64>(0), r[0].get::<_, i64>(1), r[0].get::<_, i64>(2)))
                    })
                })
                .await
        }
    };
    let (log, full) = (moves::Verification::ChangeLog, moves::Verification::Full);
    for (user, verification, by_postgres) in [(1, log, false), (2, full, false), (3, log, true)] {
        assert_eq!(write(user, 30).await?, 30);
        // The view as the application keeps it: refreshed on the source now and then.
        cluster
            .transaction(cluster.route_user(user).shard, |tx| {
                Box::pin(async move { tx.execute("REFRESH MATERIALIZED VIEW events_per_user", &[]).await })
            })
            .await?;
        let route = cluster.route_user(user);
        let to = if route.host.as_str() == "pg1" { "pg2" } else { "pg1" };
        let mut options = MoveOptions::default().verifying(verification);
        if by_postgres {
            options = options.subscription_copy();
        }
        let mut step = Step::Prepared;
        // Stopped after each step before the fence, with writes in between, then resumed.
        for stop in [Step::Prepared, Step::Copying, Step::CaughtUp] {
            let run = if stop == Step::Prepared {
                moves::run(&config, route.shard, &crate::host(to), &options.clone().stopping_after(stop))
                    .await
            } else {
                moves::resume(&config, Some(route.shard), &options.clone().stopping_after(stop))
                    .await
                    .map(|mut r| r.remove(0))
            };
            match run {
                Err(shardline_ops::Error::Interrupted { step: s, .. }) if s == stop => step = s,
                other => return Err(format!("shard {} after {step:?}: {other:?}", route.shard).into()),
            }
            assert_eq!(write(user, 7).await?, 7);
        }
        let done = moves::resume(&config, Some(route.shard), &options).await;
        let done = done.map_err(|e| format!("moving shard {} ({verification:?}): {e}", route.shard))?;
        assert_eq!(done.len(), 1);
        if verification == log {
            assert!(
                done[0].rechecked_rows <= 7,
                "only rows written since the comparison are read in the fence: {}",
                done[0]
            );
        }
        cluster.refresh().await?;
        assert_eq!(cluster.route_user(user).host.as_str(), to);
        assert_eq!(
            count(user).await?,
            (51, 4, 0),
            "user {user}'s events after the move: all rows, 4 partitions"
        );
        let target = f.client(&ctx, if to == "pg1" { 0 } else { 1 }).await?;
        let indexes: Vec<(String, Option<String>, bool)> = target
            .query(
                "SELECT c.relname::text, p.relname::text, i.indisvalid FROM pg_index i
                   JOIN pg_class c ON c.oid = i.indexrelid
                   LEFT JOIN pg_inherits h ON h.inhrelid = c.oid LEFT JOIN pg_class p ON p.oid = h.inhparent
                  WHERE c.relnamespace = to_regnamespace($1) AND c.relname ~ 'body|by_user|user_id_day|h2_day'
                  ORDER BY 1",
                &[&route.schema.as_str()],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let by_user_children =
            indexes.iter().filter(|(_, p, _)| p.as_deref() == Some("events_by_user")).count();
        assert_eq!(by_user_children, 3, "{indexes:?}");
        let named: Vec<_> = indexes.iter().filter(|(n, _, _)| !n.ends_with("_idx")).cloned().collect();
        let attached = |parent: &str| Some(parent.to_owned());
        assert_eq!(
            named,
            vec![
                ("e26_body".to_owned(), attached("events_by_body"), true),
                ("e27_body".to_owned(), attached("events_by_body"), true),
                ("e27h1_body".to_owned(), attached("e27_body"), true),
                ("e27h2_body".to_owned(), attached("e27_body"), true),
                ("events_by_body".to_owned(), None, true),
                ("events_by_user".to_owned(), None, true),
                ("events_h2_day".to_owned(), None, true),
                ("other_body".to_owned(), attached("events_by_body"), true),
            ],
            "the target's indexes, as the source's"
        );
        assert_eq!(write(user, 2).await?, 2, "the moved table takes writes");
        let viewed: Vec<i64> = target
            .query(
                &format!("SELECT n FROM {}.events_per_user WHERE user_id = $1", route.schema.quoted()),
                &[&user],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert!(
            matches!(viewed.as_slice(), [n] if *n >= 30),
            "user {user}'s row of the materialized view on the target, refreshed from the copy: {viewed:?}"
        );
    }
    // A foreign table under one of the shard's (here an inheritance child of photos; a
    // partitioned table with a primary key takes no foreign partition): its rows are on
    // another server, which both copies would share and emptying a copy would empty.
    // Refused before anything is done.
    let route = cluster.route_user(4);
    let host = if route.host.as_str() == "pg1" { 0 } else { 1 };
    let admin = f.client(&ctx, host).await?;
    admin
        .batch_execute(&format!(
            "CREATE FOREIGN DATA WRAPPER far_fdw; CREATE SERVER far FOREIGN DATA WRAPPER far_fdw;
             CREATE FOREIGN TABLE {s}.photos_far () INHERITS ({s}.photos) SERVER far;",
            s = route.schema.quoted()
        ))
        .await?;
    let to = if route.host.as_str() == "pg1" { "pg2" } else { "pg1" };
    let refused = moves::run(&config, route.shard, &crate::host(to), &MoveOptions::default()).await;
    admin
        .batch_execute(&format!(
            "DROP FOREIGN TABLE {}.photos_far; DROP SERVER far; DROP FOREIGN DATA WRAPPER far_fdw;",
            route.schema.quoted()
        ))
        .await?;
    match refused {
        Err(shardline_ops::Error::Preflight(p)) => {
            let text = p.to_string();
            assert!(text.contains("photos_far") && text.contains("another server"), "{text}");
        }
        other => return Err(format!("a shard with a foreign partition: {other:?}").into()),
    }
    // A partition of one of the shard's tables in another schema: a move copies the
    // shard's schema only, so its rows would stay behind. Refused before anything is
    // done, naming it (before, the move failed once it had built the copy, at the
    // subscription: 3F000, schema "archive" does not exist on the target).
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA archive;
             CREATE TABLE archive.events_2030 PARTITION OF {s}.events FOR VALUES FROM ('2030-01-01') TO ('2031-01-01');
             INSERT INTO {s}.events (user_id, day, body) VALUES (4, '2030-06-01', 'kept elsewhere')",
            s = route.schema.quoted()
        ))
        .await?;
    let refused = moves::run(&config, route.shard, &crate::host(to), &MoveOptions::default()).await;
    admin.batch_execute("DROP SCHEMA archive CASCADE").await?;
    match refused {
        Err(shardline_ops::Error::Preflight(p)) => {
            let text = p.to_string();
            assert!(text.contains("archive.events_2030") && text.contains("another schema"), "{text}");
        }
        other => return Err(format!("a shard with a partition in another schema: {other:?}").into()),
    }
    let gc = moves::gc(&config, Duration::ZERO).await?;
    let triggers: i64 = f
        .client(&ctx, 0)
        .await?
        .query_one("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'shardline\\_move\\_%'", &[])
        .await?
        .get(0);
    let triggers_2: i64 = f
        .client(&ctx, 1)
        .await?
        .query_one("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'shardline\\_move\\_%'", &[])
        .await?
        .get(0);
    assert_eq!((triggers, triggers_2), (0, 0), "no change-log trigger left: {gc}");
    Ok(())
}

shardline_testkit::register!(shared: a_moved_shard_hands_out_no_serial_value_twice);
/// A `bigserial` column, an identity column and a descending sequence of a migration's
/// (not shardline's ID sequence) go on from where the source left them after a move and
/// after its revert: a value the source handed out is never handed out again, which a
/// unique key would refuse (23505) and a plain column would hold twice.
pub(crate) async fn a_moved_shard_hands_out_no_serial_value_twice(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    f.migration(
        "0005_serials.sql",
        "CREATE TABLE tickets (n bigserial PRIMARY KEY, k int GENERATED ALWAYS AS IDENTITY UNIQUE, body text);
         CREATE SEQUENCE countdown INCREMENT -1 MINVALUE -1000 MAXVALUE 0 START 0;
         CREATE TABLE \"Odd Seq\" (n serial PRIMARY KEY, down int DEFAULT nextval('countdown') UNIQUE);",
    )?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let shard = cluster.route_user(1).shard;
    let from = cluster.route_user(1).host;
    let to = if from.as_str() == "pg1" { "pg2" } else { "pg1" };
    // Each round inserts 5 rows and returns every value handed out so far.
    let round = || {
        cluster.transaction(shard, |tx| {
            Box::pin(async move {
                for _ in 0..5 {
                    tx.execute("INSERT INTO tickets (body) VALUES ('x')", &[]).await?;
                    tx.execute("INSERT INTO \"Odd Seq\" DEFAULT VALUES", &[]).await?;
                }
                let rows = tx
                    .query(
                        "SELECT array_agg(n ORDER BY n), array_agg(k ORDER BY k),
                                (SELECT array_agg(n ORDER BY n) FROM \"Odd Seq\"),
                                (SELECT array_agg(down ORDER BY down) FROM \"Odd Seq\")
                           FROM tickets",
                        &[],
                    )
                    .await?;
                let r = &rows[0];
                Ok::<_, Error>((
                    r.get::<_, Vec<i64>>(0),
                    r.get::<_, Vec<i32>>(1),
                    r.get::<_, Vec<i32>>(2),
                    r.get::<_, Vec<i32>>(3),
                ))
            })
        })
    };
    round().await?;
    // A sequence set back to "next is 100" (`is_called` false: no last value shown in
    // pg_sequences) goes on from 100 on the target too.
    cluster
        .transaction(shard, |tx| {
            Box::pin(async move { tx.query("SELECT setval('tickets_n_seq', 100, false)", &[]).await })
        })
        .await?;
    moves::run(&config, shard, &crate::host(to), &MoveOptions::default().revertible()).await?;
    cluster.refresh().await?;
    let after_move = round().await?;
    moves::revert(&config, shard, &MoveOptions::default()).await?;
    cluster.refresh().await?;
    assert_eq!(cluster.route_user(1).host, from);
    let (n, k, serial, down) = round().await?;
    // 15 rows each, every value once, in the order handed out.
    assert_eq!(n, (1..=5).chain(100..110).collect::<Vec<i64>>());
    assert_eq!(k, (1..=15).collect::<Vec<i32>>());
    assert_eq!(serial, (1..=15).collect::<Vec<i32>>());
    assert_eq!(down, (-14..=0).collect::<Vec<i32>>());
    assert_eq!(after_move.0.len(), 10);
    Ok(())
}

shardline_testkit::register!(shared: what_a_review_found_in_the_request_path_holds);
/// Three more promises, after an independent read of the request path: a fan-out whose
/// shard is really gone (no move explains it) reports that host missing instead of
/// failing; a hand-written row whose values do not match its columns is refused before
/// anything is sent (in a batch they would shift into other rows' columns); a server that
/// refuses the session (no such role) is not worth retrying.
pub(crate) async fn what_a_review_found_in_the_request_path_holds(ctx: TestContext) -> TestResult {
    use shardline_repo::entity::{NewRow, ShardKey};
    use shardline_repo::tokio_postgres::types::ToSql;

    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let config = f.config()?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let started = std::time::SystemTime::now() - Duration::from_secs(1);
    photos.insert_many(&(0..4).map(|u| photo(u, 0)).collect::<Vec<_>>()).await?;

    // A shard schema dropped by hand on pg2: the fan-out still answers, naming pg2.
    f.client(&ctx, 1).await?.batch_execute("DROP SCHEMA shard_0003 CASCADE").await?;
    let window = photos.created_between(started, std::time::SystemTime::now(), 100).await?;
    assert_eq!(window.missing.len(), 1, "{:?}", window.missing);
    assert_eq!(window.missing[0].host, "pg2");
    assert_eq!(window.rows.len(), 2, "pg1's shards 0 and 1 answered");

    // One value too many for the columns: refused, nothing stored.
    struct Lopsided(i64);
    impl NewRow for Lopsided {
        type Entity = Photo;
        const COLUMNS: &'static [&'static str] = &["user_id", "url"];
        fn shard_key(&self) -> ShardKey {
            ShardKey::User(self.0)
        }
        fn values(&self) -> Vec<&(dyn ToSql + Sync)> {
            vec![&self.0, &"https://cdn/lopsided", &"extra"]
        }
    }
    // Also in a shard transaction (before, the extra value was dropped there and the
    // row stored).
    let in_tx = cluster
        .transaction(cluster.route_user(0).shard, |tx| Box::pin(async move { tx.insert(&Lopsided(0)).await }))
        .await
        .unwrap_err();
    for err in [
        photos.insert(&Lopsided(0)).await.unwrap_err(),
        photos.insert_many(&[Lopsided(0), Lopsided(1)]).await.unwrap_err(),
        in_tx,
    ] {
        assert!(matches!(err, Error::Invalid { .. }), "{err:?}");
        assert!(err.to_string().contains("3 values for 2 columns"), "{err}");
        assert!(!err.outcome_unknown(), "{err}");
    }
    assert_eq!(photos.page_of_user(0, None, 10).await?.rows.len(), 1, "nothing of the lopsided rows stored");

    // A host URL naming a role the server does not have: refused by the server, with its
    // SQLSTATE, and not retryable (a retry loop would spin).
    let text = f.config_text()?.replace("postgres://postgres@", "postgres://no_such_role@");
    let catalog_ok = text.replacen("postgres://no_such_role@", "postgres://postgres@", 1);
    let bad = Cluster::connect(&f.config_from(&catalog_ok)?, ClusterOptions::default()).await?;
    let err = bad.repo::<Photo>()?.get(cluster.layout().compose(1_700_000_000_000, 0, 1)?).await.unwrap_err();
    assert_eq!(err.sqlstate(), Some("28000"), "{err:?}");
    assert!(!err.is_retryable() && !err.outcome_unknown(), "{err}");
    Ok(())
}
