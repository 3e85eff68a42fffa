//! `shardline demo`: the whole product in one command, on a cluster of its own.
//!
//! It starts real Postgres hosts with the test kit (containers where Docker works, local
//! processes otherwise), runs `init` with the example application's migrations, drives a
//! workload through the repository API (photos, likes, comments, reads by ID, pages, a
//! time-window fan-out), moves the busiest shard to another host while the workload
//! runs, adds a host and rebalances onto it, and prints a summary. Everything is removed
//! at the end, also on Ctrl-C; `--keep` keeps it running until Ctrl-C instead, with a
//! config file for every other command.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use clap::Args;
use shardline_example_photos::{Comment, Like, NewComment, NewLike, NewPhoto, Photo, with_sqlx};
use shardline_ops::moves::{MoveOptions, MoveReport};
use shardline_repo::{Cluster, ClusterOptions, Id};
use shardline_router::config::DbUrl;
use shardline_router::{Config, HostName};
use shardline_testkit::BackendKind;

use crate::UsageError;
use crate::cluster::runtime;
use crate::id::utc;

/// Options of `demo`.
#[derive(Debug, Args)]
pub struct DemoOpt {
    /// Hosts to start with (one more joins for the rebalance).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(2..=8))]
    pub hosts: u16,
    /// Logical shards.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u16).range(8..=8192))]
    pub shards: u16,
    /// Users posting, liking and commenting.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(10..=10_000_000))]
    pub users: u32,
    /// How long the workload runs.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(2..=3600))]
    pub seconds: u64,
    /// Shards to move onto the new host in the rebalance.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub rebalance: u16,
    /// The test-kit backend: docker or local (default: docker where an engine answers).
    #[arg(long, value_parser = ["docker", "local"])]
    pub backend: Option<String>,
    /// Keep the cluster running after the summary, with a config file for every other
    /// command, until Ctrl-C.
    #[arg(long)]
    pub keep: bool,
    /// How the workload talks to the cluster: the repository API, or sqlx queries
    /// routed by `Cluster::sqlx` (posts, likes, comments, reads by ID and user pages;
    /// the time window is the repository's fan-out either way).
    #[arg(long, default_value = "repo", value_parser = ["repo", "sqlx"])]
    pub via: String,
}

/// The example application's migrations, built into the binary so the demo runs from
/// anywhere.
const MIGRATIONS: [(&str, &str); 4] = [
    ("0001_photos.sql", include_str!("../../../migrations/0001_photos.sql")),
    ("0002_likes.sql", include_str!("../../../migrations/0002_likes.sql")),
    ("0003_comments.sql", include_str!("../../../migrations/0003_comments.sql")),
    ("0004_likes_by_id.sql", include_str!("../../../migrations/0004_likes_by_id.sql")),
];

const DB: &str = "shardline_demo";

/// The kinds of operation the workload runs.
const OPS: [&str; 6] = ["post photo", "like", "comment", "get by ID", "user's page", "time window"];

/// What the workload measured, per operation kind.
#[derive(Debug, Default)]
struct Stats {
    latencies: [Vec<Duration>; 6],
    errors: [u64; 6],
    /// Acknowledged photos a read by ID did not find (a lost write, or a read sent to
    /// the wrong shard): each is also an error of `get`, and any fails the demo.
    missing: u64,
    /// The first few errors, each with when it happened (since the workload began).
    first_errors: Vec<(Duration, String)>,
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort_unstable();
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "a percentile's index: a non-negative fraction of a length, rounded"
    )]
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// A small xorshift generator: the workload needs spread, not cryptography.
struct Rng(u64);

impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

fn config_text(kit: &shardline_testkit::Cluster, hosts: usize, shards: u16) -> String {
    // The migrations beside the config file (a path relative to its directory): the
    // temporary directory's own path, which may hold anything, is never written.
    let mut text = format!(
        "# written by `shardline demo`\nlogical_shards = {shards}\nmigrations = \"migrations\"\n\n[catalog]\nurl = \"{}\"\n",
        kit.hosts()[0].url(DB)
    );
    for (i, h) in kit.hosts().iter().take(hosts).enumerate() {
        text.push_str(&format!(
            "\n[[hosts]]\nname = \"pg{}\"\nurl = \"{}\"\npeer_url = \"{}\"\n",
            i + 1,
            h.url(DB),
            h.peer_url(DB)
        ));
    }
    text
}

fn load(path: &Path, text: &str) -> anyhow::Result<Config> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(crate::cluster::load_config(path)?)
}

/// Runs `demo`.
///
/// # Errors
///
/// When the cluster cannot start (no Docker and no local Postgres: the message says what
/// to install) or a step fails.
pub fn demo(opt: &DemoOpt, out: &mut dyn Write) -> anyhow::Result<()> {
    let backend = match opt.backend.as_deref() {
        Some("docker") => Some(BackendKind::Docker),
        Some("local") => Some(BackendKind::Local),
        Some(other) => return Err(UsageError(format!("unknown backend {other:?}")).into()),
        None => BackendKind::from_env()?,
    };
    let rt = runtime()?;
    rt.block_on(async {
        let started = Instant::now();
        let hosts = usize::from(opt.hosts);
        writeln!(out, "starting {} Postgres 15 hosts and a catalog...", hosts + 1)?;
        out.flush()?;
        let kit = shardline_testkit::Cluster::start_on(backend, hosts + 1).await?;
        writeln!(
            out,
            "  {} hosts up in {:.1} s ({} backend)",
            hosts + 1,
            kit.startup_time().as_secs_f64(),
            kit.backend()
        )?;
        let dir = std::env::temp_dir().join(format!("shardline-demo-{}", std::process::id()));
        let result = tokio::select! {
            r = run(opt, &kit, &dir, out) => r,
            _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted (Ctrl-C)")),
        };
        if result.is_ok() && opt.keep {
            writeln!(out, "\nthe cluster keeps running until Ctrl-C. Try, in another terminal:")?;
            let path = dir.join("shardline.toml");
            // The last shard starts on the last of the first hosts, never pg1, and the
            // demo's own moves take shards to pg2 and the new host only.
            let last = format!("move {} --to pg1 --dry-run", opt.shards.saturating_sub(1));
            for cmd in ["map", "host list", "status", "moves", "locate --user 42", "rebalance --plan", &last]
            {
                writeln!(out, "  shardline --config {} {cmd}", path.display())?;
            }
            writeln!(out, "hosts (the demo's throwaway credentials):")?;
            for (i, h) in kit.hosts().iter().enumerate() {
                writeln!(out, "  pg{}  {}", i + 1, h.url(DB))?;
            }
            out.flush()?;
            let _ = tokio::signal::ctrl_c().await;
        }
        writeln!(out, "removing the cluster...")?;
        kit.shutdown().await?;
        let _ = std::fs::remove_dir_all(&dir);
        writeln!(out, "done in {:.1} s", started.elapsed().as_secs_f64())?;
        result
    })
}

async fn run(
    opt: &DemoOpt,
    kit: &shardline_testkit::Cluster,
    dir: &Path,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let hosts = usize::from(opt.hosts);
    kit.create_database(DB).await?;
    std::fs::create_dir_all(dir.join("migrations"))?;
    for (name, sql) in MIGRATIONS {
        std::fs::write(dir.join("migrations").join(name), sql)?;
    }
    let path: PathBuf = dir.join("shardline.toml");
    let config = load(&path, &config_text(kit, hosts, opt.shards))?;

    let t = Instant::now();
    let report = shardline_ops::init(&config, &shardline_ops::Options::default(), &|_| {}).await?;
    writeln!(
        out,
        "init: {} logical shards over {hosts} hosts, {} migrations each, in {:.1} s",
        opt.shards,
        report.migrations,
        t.elapsed().as_secs_f64()
    )?;

    // The application's handle knows the hosts there are now; the one still to join
    // it learns from the catalog. It reaches the hosts directly (no pooler), so
    // statements are kept prepared per connection and planned once each (generic
    // plans), and fan-outs read 64 shards per statement (docs/repository.md). Four
    // connections per host, not the default 16: each connection pays again for every
    // shard it touches, and the hosts share this machine's cores (docs/operations.md,
    // "Connections per host").
    let options = ClusterOptions {
        statement_cache: 1024,
        generic_plans: true,
        fan_out_batch: 64,
        pool_size: 4,
        ..ClusterOptions::default()
    };
    let cluster = Cluster::connect(&config, options).await?;
    let users = i64::from(opt.users);
    let hot_user = 42 * 7919i64;
    let hot = cluster.route_user(hot_user);
    writeln!(
        out,
        "workload: {} users, 8 workers through {} (pool_size 4, statement_cache 1024, generic_plans, fan_out_batch 64), {} s (longer if the moves take longer); user {hot_user} (shard {}, on {}) posts 10x more than anyone",
        opt.users,
        if opt.via == "sqlx" { "sqlx" } else { "the repository API" },
        opt.seconds,
        hot.shard,
        hot.host
    )?;
    out.flush()?;
    let stats = Arc::new(Mutex::new(Stats::default()));
    let moves_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let recent: Arc<Mutex<Vec<Photo>>> = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(opt.seconds);
    let began = SystemTime::now();
    let workers: Vec<_> = (0..8u64)
        .map(|w| {
            let (cluster, stats, recent, done) =
                (cluster.clone(), stats.clone(), recent.clone(), moves_done.clone());
            let sqlx = opt.via == "sqlx";
            tokio::spawn(async move {
                worker(w, &cluster, sqlx, users, hot_user, (started, deadline, &done), &stats, &recent).await
            })
        })
        .collect();

    // Meanwhile: move the hot shard; then a new host joins and takes a few shards.
    let mut moves: Vec<MoveReport> = Vec::new();
    tokio::time::sleep(Duration::from_secs(opt.seconds) / 4).await;
    let to = HostName::new(&format!(
        "pg{}",
        (hosts.min(hot.host.as_str().trim_start_matches("pg").parse::<usize>().unwrap_or(1))) % hosts + 1
    ))?;
    let moved = shardline_ops::moves::run(&config, hot.shard, &to, &MoveOptions::default()).await?;
    writeln!(
        out,
        "  moved the hot shard {} {} -> {}: {} rows in {} ms of copy, write pause {} ms (done at {:.1} s)",
        moved.shard,
        moved.source,
        moved.target,
        moved.rows,
        moved.copy_ms,
        moved.pause_ms,
        started.elapsed().as_secs_f64()
    )?;
    out.flush()?;
    moves.push(moved);
    // A host joins as `shardline host add` adds it: no config changes, the running
    // handle opens a pool for it from the catalog's address.
    let joining = kit.hosts().get(hosts).context("the kit has no host to add")?;
    let name = HostName::new(&format!("pg{}", hosts + 1))?;
    let (url, peer) = (DbUrl::new(joining.url(DB)), DbUrl::new(joining.peer_url(DB)));
    let added = shardline_ops::fleet::add(&config, &name, Some(&url), Some(&peer)).await?;
    let plan = shardline_ops::rebalance::plan(&config, usize::from(opt.rebalance)).await?;
    writeln!(
        out,
        "  {name} joined (`shardline host add`, map version {}); rebalancing {} shard(s) onto it",
        added.map_version,
        plan.moves.len()
    )?;
    out.flush()?;
    for (m, r) in shardline_ops::rebalance::apply(
        &config,
        &plan,
        shardline_ops::rebalance::Parallel::disjoint(1),
        &MoveOptions::default(),
    )
    .await
    {
        let r = r.with_context(|| format!("moving shard {} to {}", m.shard, m.to))?;
        writeln!(
            out,
            "  moved shard {} {} -> {}: {} rows, write pause {} ms (done at {:.1} s)",
            r.shard,
            r.source,
            r.target,
            r.rows,
            r.pause_ms,
            started.elapsed().as_secs_f64()
        )?;
        moves.push(r);
    }
    moves_done.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in workers {
        w.await.context("a worker panicked")?;
    }
    let elapsed = SystemTime::now().duration_since(began).unwrap_or_default();

    let grown = shardline_ops::fleet::resolved(&config).await?;
    summary(out, &grown, &cluster, &stats, &moves, elapsed).await
}

#[expect(clippy::too_many_arguments, reason = "the worker's inputs, each used")]
async fn worker(
    w: u64,
    cluster: &Cluster,
    sqlx: bool,
    users: i64,
    hot_user: i64,
    (started, deadline, moves_done): (Instant, Instant, &std::sync::atomic::AtomicBool),
    stats: &Mutex<Stats>,
    recent: &Mutex<Vec<Photo>>,
) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (w + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let (Ok(photos), Ok(likes), Ok(comments)) =
        (cluster.repo::<Photo>(), cluster.repo::<Like>(), cluster.repo::<Comment>())
    else {
        return;
    };
    let mut local = Stats::default();
    let mut n = 0u64;
    // Until the time is up and the moves are done: they all happen under load.
    while Instant::now() < deadline || !moves_done.load(std::sync::atomic::Ordering::Relaxed) {
        // User k is 7919·k: a prime stride, so users spread over every shard.
        let user = if rng.next(10) == 0 {
            hot_user
        } else {
            i64::try_from(rng.next(users.unsigned_abs())).unwrap_or(0).saturating_mul(7919)
        };
        let pick = |rng: &mut Rng| -> Option<Photo> {
            let r = recent.lock().ok()?;
            if r.is_empty() {
                None
            } else {
                r.get(usize::try_from(rng.next(r.len() as u64)).unwrap_or(0)).cloned()
            }
        };
        let op = match rng.next(100) {
            0..40 => 0,
            40..60 => 1,
            60..70 => 2,
            70..90 => 3,
            90..98 => 4,
            _ => 5,
        };
        let t = Instant::now();
        let db = cluster.sqlx();
        let result: Result<(), shardline_repo::Error> = match op {
            0 if sqlx => {
                with_sqlx::post_photo(&db, &NewPhoto::numbered(user, n)).await.map(|p| remember(recent, p, n))
            }
            1 if sqlx => match pick(&mut rng) {
                Some(p) => with_sqlx::like(&db, &NewLike { photo_id: p.id, user_id: user })
                    .await
                    .map(drop)
                    .or_else(|e| if e.is_unique_violation() { Ok(()) } else { Err(e) }),
                None => Ok(()),
            },
            2 if sqlx => match pick(&mut rng) {
                Some(p) => with_sqlx::comment(
                    &db,
                    &NewComment { photo_id: p.id, user_id: user, body: format!("nice one #{n}") },
                )
                .await
                .map(drop),
                None => Ok(()),
            },
            3 if sqlx => match pick(&mut rng) {
                Some(p) => {
                    with_sqlx::photo(&db, p.id).await.and_then(|got| found(got.as_ref(), &p, &mut local))
                }
                None => Ok(()),
            },
            4 if sqlx => with_sqlx::photos_of_user(&db, user, 20).await.map(drop),
            0 => photos.insert(&NewPhoto::numbered(user, n)).await.map(|p| remember(recent, p, n)),
            1 => match pick(&mut rng) {
                Some(p) => likes
                    .insert(&NewLike { photo_id: p.id, user_id: user })
                    .await
                    .map(drop)
                    .or_else(|e| if e.is_unique_violation() { Ok(()) } else { Err(e) }),
                None => Ok(()),
            },
            2 => match pick(&mut rng) {
                Some(p) => comments
                    .insert(&NewComment { photo_id: p.id, user_id: user, body: format!("nice one #{n}") })
                    .await
                    .map(drop),
                None => Ok(()),
            },
            3 => match pick(&mut rng) {
                Some(p) => photos.get(p.id).await.and_then(|got| found(got.as_ref(), &p, &mut local)),
                None => Ok(()),
            },
            4 => photos.page_of_user(user, None, 20).await.map(drop),
            _ => {
                let now = SystemTime::now();
                photos.created_between(now - Duration::from_secs(1), now, 100).await.map(drop)
            }
        };
        match result {
            Ok(()) => local.latencies[op].push(t.elapsed()),
            Err(e) => {
                local.errors[op] += 1;
                if local.first_errors.len() < 3 {
                    let at = started.elapsed();
                    local
                        .first_errors
                        .push((at, format!("{}: {}", OPS[op], shardline_repo::error_chain(&e))));
                }
            }
        }
        n += 1;
    }
    if let Ok(mut s) = stats.lock() {
        for i in 0..OPS.len() {
            s.latencies[i].append(&mut local.latencies[i]);
            s.errors[i] += local.errors[i];
        }
        s.missing += local.missing;
        s.first_errors.append(&mut local.first_errors);
    }
}

/// Keeps `p` among the recent photos the workload likes, comments and reads.
fn remember(recent: &Mutex<Vec<Photo>>, p: Photo, n: u64) {
    if let Ok(mut r) = recent.lock() {
        if r.len() >= 2000 {
            r.swap_remove(usize::try_from(n % 2000).unwrap_or(0));
        }
        r.push(p);
    }
}

/// A read by ID found the photo it asked for.
/// Whether the read of `p` by ID found it; one that did not is counted in
/// `stats.missing`.
fn found(got: Option<&Photo>, p: &Photo, stats: &mut Stats) -> Result<(), shardline_repo::Error> {
    if got.map(|g| g.id) == Some(p.id) {
        Ok(())
    } else {
        stats.missing += 1;
        Err(shardline_repo::Error::Invalid { what: format!("photo {} not found where its ID says", p.id) })
    }
}

/// The demo's verdict on what its workers saw: an acknowledged photo that a read by ID
/// did not find fails it (other errors are shown in the summary, not judged).
fn verdict(stats: &Stats) -> anyhow::Result<()> {
    if stats.missing > 0 {
        anyhow::bail!(
            "{} acknowledged photo(s) were not found where their IDs say (a lost write, or a read sent \
             to the wrong shard)",
            stats.missing
        );
    }
    Ok(())
}

async fn summary(
    out: &mut dyn Write,
    config: &Config,
    cluster: &Cluster,
    stats: &Mutex<Stats>,
    moves: &[MoveReport],
    elapsed: Duration,
) -> anyhow::Result<()> {
    let mut stats = std::mem::take(&mut *stats.lock().map_err(|_| anyhow::anyhow!("a worker panicked"))?);
    writeln!(out, "\n== operations ({:.1} s) ==", elapsed.as_secs_f64())?;
    writeln!(out, "{:<13} {:>8} {:>9} {:>10} {:>10} {:>7}", "", "count", "per s", "p50", "p99", "errors")?;
    let mut total = 0usize;
    for (i, name) in OPS.iter().enumerate() {
        let v = &mut stats.latencies[i];
        total += v.len();
        #[expect(clippy::cast_precision_loss, reason = "a rate shown without decimals")]
        let rate = v.len() as f64 / elapsed.as_secs_f64().max(0.001);
        writeln!(
            out,
            "{name:<13} {:>8} {rate:>9.0} {:>10} {:>10} {:>7}",
            v.len(),
            ms(pct(v, 0.5)),
            ms(pct(v, 0.99)),
            stats.errors[i]
        )?;
    }
    #[expect(clippy::cast_precision_loss, reason = "a rate shown without decimals")]
    let all = total as f64 / elapsed.as_secs_f64().max(0.001);
    writeln!(out, "{:<13} {total:>8} {all:>9.0}", "all")?;
    stats.first_errors.sort_by_key(|(at, _)| *at);
    for (at, e) in stats.first_errors.iter().take(5) {
        writeln!(out, "error at {:.1} s: {e}", at.as_secs_f64())?;
    }

    writeln!(out, "\n== moves ==")?;
    for m in moves {
        writeln!(
            out,
            "shard {:>4} {} -> {}: {} rows, {:.1} MB, copy {} ms ({:.0} rows/s), write pause {} ms",
            m.shard,
            m.source,
            m.target,
            m.rows,
            m.bytes as f64 / 1e6,
            m.copy_ms,
            m.rows_per_second(),
            m.pause_ms
        )?;
    }

    writeln!(out, "\n== hosts ==")?;
    cluster.refresh().await?;
    let map = cluster.map();
    let mut rows: BTreeMap<String, (usize, i64)> = BTreeMap::new();
    for host in map.hosts() {
        let shards: Vec<_> = map.shards_of(host).collect();
        let mut n = 0i64;
        if let Some(h) = config.host(host) {
            let c = shardline_repo::catalog::connect(&h.url, &format!("host {host}")).await?;
            for chunk in shards.chunks(200) {
                let parts: Vec<String> = chunk
                    .iter()
                    .flat_map(|s| {
                        let q = config.schema_prefix.schema(*s).quoted();
                        ["photos", "likes", "comments"].map(|t| format!("SELECT count(*) AS n FROM {q}.{t}"))
                    })
                    .collect();
                let sql =
                    format!("SELECT coalesce(sum(n), 0)::bigint FROM ({}) AS c", parts.join(" UNION ALL "));
                n += c
                    .query_one(&sql, &[])
                    .await
                    .and_then(|r| r.try_get::<_, i64>(0))
                    .with_context(|| format!("counting the rows on host {host}"))?;
            }
        }
        rows.insert(host.to_string(), (shards.len(), n));
    }
    writeln!(out, "{:<6} {:>7} {:>10}", "host", "shards", "rows")?;
    for (h, (s, n)) in &rows {
        writeln!(out, "{h:<6} {s:>7} {n:>10}")?;
    }

    writeln!(out, "\n== an ID ==")?;
    let photos = cluster.repo::<Photo>()?;
    let now = SystemTime::now();
    let sample = photos.created_between(now - Duration::from_secs(60), now, 1).await?;
    if let Some(p) = sample.rows.first() {
        let id: Id = p.id;
        let parts = cluster.layout().decode(id);
        let route = cluster.route_id(id)?;
        writeln!(
            out,
            "{id} = | {} | shard {} | sequence {} |",
            utc(parts.unix_ms),
            parts.shard,
            parts.sequence
        )?;
        writeln!(
            out,
            "  so a read of it goes straight to {} on {}, with no lookup (user {}: \"{}\")",
            route.schema, route.host, p.user_id, p.caption
        )?;
    }
    verdict(&stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acknowledged_photo_not_found_fails_the_demo() {
        let mut stats = Stats::default();
        stats.errors[1] = 3;
        assert!(verdict(&stats).is_ok(), "other errors are shown, not judged");
        let p =
            Photo { id: Id::from_i64(7).unwrap(), user_id: 1, url: String::new(), caption: String::new() };
        assert!(found(Some(&p), &p, &mut stats).is_ok());
        assert!(found(None, &p, &mut stats).is_err());
        let err = verdict(&stats).unwrap_err().to_string();
        assert!(err.starts_with("1 acknowledged photo(s) were not found where their IDs say"), "{err}");
    }

    #[test]
    fn the_built_in_migrations_are_the_directory() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations");
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        names.sort();
        let built: Vec<&str> = MIGRATIONS.iter().map(|m| m.0).collect();
        assert_eq!(names, built, "add the new file to MIGRATIONS in demo.rs");
        for (name, sql) in MIGRATIONS {
            assert_eq!(std::fs::read_to_string(dir.join(name)).ok().as_deref(), Some(sql));
        }
    }
}
