//! `soak`: random faults under sustained load, and a checker that proves nothing is
//! lost (docs/reliability.md, "The soak").
//!
//! `soak [SECONDS] [SEED]` (or `scripts/soak.sh MINUTES [SEED]`) starts 4 hosts on the
//! backend `SHARDLINE_TEST_BACKEND` names, every link between the parties cuttable
//! ([`shardline_testkit::Link`]), and for `SECONDS` runs at once:
//!
//! - **the load**: the example application's workload through the repository API and
//!   its sqlx path, on two handles (photos posted one by one, several in one
//!   `insert_many`, or with a comment in one shard transaction; comments on them; photos
//!   read back by ID and in recent time windows across every shard; and photos each
//!   worker keeps to itself, updated, deleted and read back), every write, update and
//!   delete recorded with its start, end, outcome, path and transaction;
//! - **the mover**: single moves of random shards to random hosts, and now and then a
//!   rebalance; a migration a third of the way in;
//! - **two nemeses**, drawn from `SEED`, each striking one fault at a time (so up to two
//!   at once, never two on one host but for the catalog's link beside its host), either
//!   at a random moment or when the running move
//!   reaches a random step: a host killed, paused or restarted, the link from the
//!   application to a host, to the catalog, or from a host's peers to it cut, every
//!   connection of a link reset, or the mover killed (then resumed or undone).
//!
//! Then every fault is healed, unfinished moves are resumed, `gc` runs, and the checker
//! ([`check::check`]) compares the history with what the hosts hold. Exit status 0 when
//! there is no violation, 1 when there is one (the seed and the history's file are
//! printed), 2 when the soak could not run.
#![allow(clippy::print_stderr, reason = "a command-line tool reports on stderr")]

mod check;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use check::{CountRead, FanOutRead, FanOutRow, Mutation, Observed, Outcome, Row, Table, Write};
use shardline_example_photos::{Comment, NewComment, NewPhoto, Photo, with_sqlx};
use shardline_id::ident::quote;
use shardline_ops::moves::{self, MoveOptions, MoveProgress, State, Step};
use shardline_ops::rebalance::{self, Parallel};
use shardline_repo::{Cluster, ClusterOptions, Id};
use shardline_router::{Config, HostName, LogicalShard};
use shardline_testkit::{Link, backend::BackendKind};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const DB: &str = "soak";
const HOSTS: usize = 4;
const SHARDS: u16 = 32;
const WORKERS: u32 = 4;
const USERS: u64 = 5000;

/// A small, seeded generator (xorshift): the same seed draws the same schedule.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
    fn index(&mut self, n: usize) -> usize {
        usize::try_from(self.below(n as u64)).unwrap_or(0)
    }
    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to.saturating_sub(from).max(1)))
    }
}

/// What the run shares between its tasks.
struct Run {
    seed: u64,
    began: Instant,
    deadline: Instant,
    kit: shardline_testkit::Cluster,
    /// The application's links to each host, and to the catalog (on pg1).
    links: Vec<Link>,
    catalog_link: Link,
    /// The links through which each host's peers reach it.
    peer_links: Vec<Link>,
    config: Config,
    dir: PathBuf,
    cluster: Cluster,
    /// A second handle, used by one worker in four: its map is told of each move on its
    /// own (or finds it out on its own), not in step with the first's.
    second: Cluster,
    /// A third handle, used by one worker in four, that misses every notification for
    /// good (`listen = false`: no `LISTEN`, no map check): it learns of a move only when
    /// a statement of its own finds the shard gone from where its map placed it.
    deaf: Cluster,
    history: Mutex<Vec<Write>>,
    /// Updates and deletes of the photos each worker keeps to itself.
    mutations: Mutex<Vec<Mutation>>,
    bad_reads: Mutex<Vec<String>>,
    /// Acknowledged photos no worker updates or deletes: ID, content and when the write
    /// was acknowledged (ms since the Unix epoch), in the order they were; for comments,
    /// reads and the fan-outs' completeness.
    photos: Mutex<Vec<(Id, String, u128)>>,
    reads: AtomicU64,
    /// Of the reads, `get_many` calls.
    get_manys: AtomicU64,
    /// Fan-out reads (`created_between`, each page of `newest`, `count_between`) made,
    /// and those with shards reported missing.
    fan_outs: AtomicU64,
    fan_outs_partial: AtomicU64,
    /// Counts across every shard, judged at the end against the whole history and what
    /// the hosts hold (`check::counts`).
    counts: Mutex<Vec<CountRead>>,
    /// The last transaction's group number ([`Write::group`]).
    groups: AtomicU64,
    read_errors: AtomicU64,
    /// The move under way and its step, for faults that wait for a step.
    current: Mutex<Option<(usize, usize, Step)>>,
    kill_mover: tokio::sync::Notify,
    /// Faults that could not be made or healed.
    strike_failures: Mutex<Vec<String>>,
    /// Whether the mover is inside a move or a rebalance now.
    moving: AtomicBool,
    /// What the nemeses are striking now.
    struck: Mutex<Vec<Target>>,
    stopping: AtomicBool,
    faults: Mutex<BTreeMap<&'static str, u64>>,
    moves: Mutex<BTreeMap<&'static str, u64>>,
    log: Mutex<Vec<String>>,
}

impl Run {
    fn now(&self) -> Duration {
        self.began.elapsed()
    }
    fn note(&self, line: String) {
        let line = format!("{:>8.3} s  {line}", self.now().as_secs_f64());
        eprintln!("  {line}");
        lock(&self.log).push(line);
    }
    fn count(map: &Mutex<BTreeMap<&'static str, u64>>, what: &'static str) {
        *lock(map).entry(what).or_default() += 1;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = (|| -> Result<(u64, u64), BoxError> {
        let secs = args.first().map(|s| s.parse()).transpose()?.unwrap_or(120);
        let seed = match args.get(1) {
            Some(s) => s.parse()?,
            None => {
                u64::from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.subsec_nanos())
            }
        };
        if args.len() > 2 {
            return Err("too many arguments".into());
        }
        Ok((secs, seed))
    })();
    let (secs, seed) = match parsed {
        Ok(p) => p,
        Err(e) => {
            eprintln!("usage: soak [SECONDS] [SEED]: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let dir = std::env::temp_dir().join(format!("shardline-soak-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(dir.join("migrations")) {
        eprintln!("soak: cannot make {}: {e}", dir.display());
        return std::process::ExitCode::from(2);
    }
    // The product's own logging, as the CLI sets it up, into a file beside the history.
    let log = match std::fs::File::create(dir.join("soak.log")) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("soak: cannot write its log: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(Mutex::new(log))
        .with_ansi(false)
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("soak: no runtime: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    eprintln!(
        "soak: {secs} s, seed {seed} (replay: scripts/soak.sh with the same seed); files in {}",
        dir.display()
    );
    match rt.block_on(soak(secs, seed, &dir)) {
        Ok(violations) if violations.is_empty() => {
            eprintln!("soak: seed {seed}: no violation");
            let _ = std::fs::remove_dir_all(&dir);
            std::process::ExitCode::SUCCESS
        }
        Ok(violations) => {
            eprintln!("soak: seed {seed}: {} violation(s):", violations.len());
            for v in violations.iter().take(50) {
                eprintln!("  - {v}");
            }
            eprintln!(
                "soak: the history (every write, fault and move) is in {}; replay with `scripts/soak.sh {} {seed}`",
                dir.display(),
                secs.div_ceil(60)
            );
            std::process::ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("soak: seed {seed}: could not run: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

async fn soak(secs: u64, seed: u64, dir: &Path) -> Result<Vec<String>, BoxError> {
    let kit = shardline_testkit::Cluster::start_on(BackendKind::from_env()?, HOSTS).await?;
    soak_on(kit, secs, seed, dir).await
}

async fn soak_on(
    kit: shardline_testkit::Cluster,
    secs: u64,
    seed: u64,
    dir: &Path,
) -> Result<Vec<String>, BoxError> {
    eprintln!("soak: {} hosts on the {} backend", HOSTS, kit.backend());
    kit.create_database(DB).await?;
    let mut links = Vec::new();
    let mut peer_links = Vec::new();
    for i in 0..HOSTS {
        links.push(kit.link(i).await?);
        peer_links.push(kit.peer_link(i).await?);
    }
    let catalog_link = kit.link(0).await?;
    let repo_migrations = Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
    for entry in std::fs::read_dir(&repo_migrations)? {
        let entry = entry?;
        std::fs::copy(entry.path(), dir.join("migrations").join(entry.file_name()))?;
    }
    let mut text = format!(
        "logical_shards = {SHARDS}\nmigrations = \"{}\"\n[catalog]\nurl = \"{}\"\n",
        dir.join("migrations").display(),
        catalog_link.url(DB)
    );
    for i in 0..HOSTS {
        text.push_str(&format!(
            "[[hosts]]\nname = \"pg{}\"\nurl = \"{}\"\npeer_url = \"{}\"\n",
            i + 1,
            links[i].url(DB),
            peer_links[i].url(DB)
        ));
    }
    std::fs::write(dir.join("shardline.toml"), &text)?;
    let config = Config::from_toml(&text, "shardline.toml", dir, &|_| None)?;
    shardline_ops::init(&config, &shardline_ops::Options::default(), &|_| {}).await?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let second = Cluster::connect(&config, ClusterOptions::default()).await?;
    let deaf =
        Cluster::connect(&config, ClusterOptions { listen: false, ..ClusterOptions::default() }).await?;
    let began = Instant::now();
    let run = Arc::new(Run {
        seed,
        began,
        deadline: began + Duration::from_secs(secs),
        kit,
        links,
        catalog_link,
        peer_links,
        config,
        dir: dir.to_owned(),
        cluster,
        second,
        deaf,
        history: Mutex::new(Vec::new()),
        mutations: Mutex::new(Vec::new()),
        bad_reads: Mutex::new(Vec::new()),
        photos: Mutex::new(Vec::new()),
        reads: AtomicU64::new(0),
        get_manys: AtomicU64::new(0),
        fan_outs: AtomicU64::new(0),
        fan_outs_partial: AtomicU64::new(0),
        counts: Mutex::new(Vec::new()),
        groups: AtomicU64::new(0),
        read_errors: AtomicU64::new(0),
        current: Mutex::new(None),
        kill_mover: tokio::sync::Notify::new(),
        strike_failures: Mutex::new(Vec::new()),
        moving: AtomicBool::new(false),
        struck: Mutex::new(Vec::new()),
        stopping: AtomicBool::new(false),
        faults: Mutex::new(BTreeMap::new()),
        moves: Mutex::new(BTreeMap::new()),
        log: Mutex::new(Vec::new()),
    });
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let run = run.clone();
            tokio::spawn(async move { worker(&run, w).await })
        })
        .collect();
    let mover = {
        let run = run.clone();
        tokio::spawn(async move { mover(&run).await })
    };
    let nemeses: Vec<_> = (0..NEMESES)
        .map(|n| {
            let run = run.clone();
            tokio::spawn(async move { nemesis(&run, n).await })
        })
        .collect();
    // The load ends at its deadline; a worker still not done 2 minutes later is stuck
    // on a call that should have timed out: the run fails rather than hang CI.
    let stuck_at = tokio::time::Instant::from_std(run.deadline) + Duration::from_secs(120);
    for w in workers {
        tokio::time::timeout_at(stuck_at, w)
            .await
            .map_err(|_| "a load worker did not end within 2 minutes of the load's end")??;
    }
    run.stopping.store(true, Ordering::Relaxed);
    for n in nemeses {
        n.await?;
    }
    heal_all(&run).await;
    // The mover finishes the move it is in (it starts no other), or is killed after 2
    // minutes, its move then resumed below.
    let abort = mover.abort_handle();
    // A panic fails the run (after recovery, the check and the report): it is not a kill
    // to recover from.
    let mut mover_failed = None;
    match tokio::time::timeout(Duration::from_secs(120), mover).await {
        Err(_) => {
            abort.abort();
            run.note("the mover did not finish its move in 120 s; killed".into());
        }
        Ok(Err(e)) => {
            run.note(format!("the mover ended abnormally: {e}"));
            mover_failed = Some(format!("the mover ended abnormally: {e}"));
        }
        Ok(Ok(())) => {}
    }
    let (ops, acked) = {
        let h = lock(&run.history);
        (h.len(), h.iter().filter(|w| matches!(w.outcome, Outcome::Acked(_) | Outcome::Committed)).count())
    };
    run.note(format!(
        "load done: {ops} writes ({acked} acknowledged), {} reads ({} of them get_many; {} failed)",
        run.reads.load(Ordering::Relaxed),
        run.get_manys.load(Ordering::Relaxed),
        run.read_errors.load(Ordering::Relaxed)
    ));
    run.note(format!(
        "the deaf handle's map: version {} (the first handle's: {}), each reload its own statements' doing",
        run.deaf.map().version(),
        run.cluster.map().version()
    ));
    let observed = recover_and_observe(&run).await?;
    let history = lock(&run.history).clone();
    let mutations = lock(&run.mutations).clone();
    let mut violations = check::check(&history, &mutations, &observed);
    violations.extend(judge_counts(&run, &history, &mutations, &observed));
    report(&run, &history, &violations)?;
    run.kit.shutdown().await?;
    // A run that could not do what it set out to fails whatever it found, and says
    // what it found too.
    let listed = || violations.iter().take(50).map(|v| format!("\n  - {v}")).collect::<String>();
    if let Some(why) = mover_failed {
        return Err(format!("{why}; {} violation(s){}", violations.len(), listed()).into());
    }
    let failed = lock(&run.strike_failures).clone();
    if !failed.is_empty() {
        return Err(format!(
            "{} fault(s) could not be made or healed: {}; {} violation(s){}",
            failed.len(),
            failed.join("; "),
            violations.len(),
            listed()
        )
        .into());
    }
    Ok(violations)
}

/// An outcome as the history's file spells it: what, and the ID or the error.
fn cells(outcome: &Outcome) -> (&'static str, String) {
    match outcome {
        Outcome::Acked(id) => ("ok", id.to_string()),
        Outcome::Committed => ("committed", String::new()),
        Outcome::Failed { unknown: true, error } => ("unknown", error.clone()),
        Outcome::Failed { unknown: false, error } => ("failed", error.clone()),
    }
}

/// Writes the history and the fault log to the run's directory, and prints the summary.
fn report(run: &Run, history: &[Write], violations: &[String]) -> Result<(), BoxError> {
    use std::io::Write as _;
    let mut f = std::io::BufWriter::new(std::fs::File::create(run.dir.join("history.tsv"))?);
    writeln!(f, "worker\ttable\ttoken\tstart_ms\tend_ms\toutcome\tid_or_error")?;
    for w in history {
        let (outcome, detail) = cells(&w.outcome);
        writeln!(
            f,
            "{}\t{}\t{}\t{}\t{}\t{outcome}\t{}",
            w.worker,
            w.table.name(),
            w.token,
            w.start.as_millis(),
            w.end.as_millis(),
            detail.replace(['\t', '\n'], " ")
        )?;
    }
    for m in lock(&run.mutations).iter() {
        let (outcome, detail) = cells(&m.outcome);
        writeln!(
            f,
            "-\t{}\t{}\t{}\t{}\t{outcome}\t{}",
            if m.content.is_some() { "update" } else { "delete" },
            m.token,
            m.start.as_millis(),
            m.end.as_millis(),
            detail.replace(['\t', '\n'], " ")
        )?;
    }
    std::fs::write(run.dir.join("events.log"), lock(&run.log).join("\n"))?;
    let acked =
        history.iter().filter(|w| matches!(w.outcome, Outcome::Acked(_) | Outcome::Committed)).count();
    let unknown =
        history.iter().filter(|w| matches!(w.outcome, Outcome::Failed { unknown: true, .. })).count();
    let secs = run.deadline.duration_since(run.began).as_secs_f64();
    eprintln!("soak summary (seed {}):", run.seed);
    eprintln!(
        "  writes: {} ({acked} acknowledged, {unknown} outcome unknown, {} failed), {:.0} writes/s; reads: {}",
        history.len(),
        history.len() - acked - unknown,
        history.len() as f64 / secs,
        run.reads.load(Ordering::Relaxed)
    );
    let mutations = lock(&run.mutations);
    let (updates, deletes) =
        mutations.iter().fold((0, 0), |(u, d), m| if m.content.is_some() { (u + 1, d) } else { (u, d + 1) });
    let mutations_acked = mutations.iter().filter(|m| matches!(m.outcome, Outcome::Acked(_))).count();
    eprintln!("  updates: {updates}, deletes: {deletes} ({mutations_acked} acknowledged)");
    let mut via: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for w in history {
        let e = via.entry(w.via).or_default();
        e.0 += 1;
        e.1 += usize::from(matches!(w.outcome, Outcome::Acked(_) | Outcome::Committed));
    }
    eprintln!("  writes by path (made, acknowledged): {via:?}");
    eprintln!(
        "  fan-outs: {} ({} with shards reported missing)",
        run.fan_outs.load(Ordering::Relaxed),
        run.fan_outs_partial.load(Ordering::Relaxed)
    );
    eprintln!("  faults: {:?}", lock(&run.faults));
    // A kill asked for just after a move ended found nothing to kill.
    let asked = lock(&run.faults).get("mover kill asked").copied().unwrap_or(0);
    let killed = lock(&run.moves).get("mover killed").copied().unwrap_or(0);
    eprintln!("  mover kills: {killed} of {asked} asked (the rest came after the move had ended)");
    eprintln!("  moves: {:?}", lock(&run.moves));
    eprintln!("  violations: {}", violations.len());
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The load.

/// A photo a worker keeps to itself: it alone updates, deletes and reads it, so what it
/// may hold is known at every step ([`check::after`]).
struct Mine {
    id: Id,
    user: i64,
    token: String,
    /// What it may hold now (`None`: absent).
    states: Vec<Option<String>>,
    versions: u32,
}

fn content_of(p: &Photo) -> String {
    format!("{}|{}|{}", p.user_id, p.url, p.caption)
}

async fn worker(run: &Run, w: u32) {
    let mut rng = Rng::new(run.seed ^ (u64::from(w) + 1) << 32);
    // Half the workers go through the first handle, a quarter through the second, a
    // quarter through the deaf one.
    let cluster = match w % 4 {
        1 => &run.second,
        3 => &run.deaf,
        _ => &run.cluster,
    };
    let (Ok(photos), Ok(comments)) = (cluster.repo::<Photo>(), cluster.repo::<Comment>()) else {
        lock(&run.bad_reads).push(format!("worker {w}: no repository"));
        return;
    };
    let sqlx = cluster.sqlx();
    let mut mine: Vec<Mine> = Vec::new();
    // The worker's own photos whose delete was acknowledged: `get_many` asks for some,
    // which must stay absent (and be called missing).
    let mut gone: Vec<Id> = Vec::new();
    let mut n = 0_u64;
    while Instant::now() < run.deadline {
        n += 1;
        let token = format!("s{}w{w}n{n}", run.seed);
        let pick = rng.below(28);
        let known = {
            let p = lock(&run.photos);
            if p.is_empty() { None } else { Some(p[rng.index(p.len())].clone()) }
        };
        let own = if mine.is_empty() { None } else { Some(rng.index(mine.len())) };
        match (pick, known, own) {
            // A comment through the repository, or (21) the example's sqlx path.
            (12..=13 | 21, Some((photo, _, _)), _) => {
                let user = i64::try_from(1 + rng.below(USERS)).unwrap_or(1);
                let new = NewComment { photo_id: photo, user_id: user, body: token.clone() };
                let content = format!("{user}|{}|{token}", photo.as_i64());
                let via = if pick == 21 { "sqlx" } else { "repo" };
                let start = run.now();
                let result = if pick == 21 {
                    with_sqlx::comment(&sqlx, &new).await
                } else {
                    comments.insert(&new).await
                };
                let end = run.now();
                let outcome = outcome_of(&result, |c| c.id);
                lock(&run.history).push(Write {
                    worker: w,
                    table: Table::Comments,
                    token,
                    content,
                    start,
                    end,
                    outcome,
                    via,
                    group: None,
                });
            }
            (14..=16, Some((id, content, _)), _) => read_back(run, &photos, id, &[Some(content)]).await,
            (22, Some((id, content, _)), _) => {
                run.reads.fetch_add(1, Ordering::Relaxed);
                let result = with_sqlx::photo(&sqlx, id).await;
                judge_read(run, id, &[Some(content)], result, "sqlx read");
            }
            (23, Some((photo, _, _)), _) => tx_pair(run, w, cluster, &mut rng, photo, token, false).await,
            (27, Some((photo, _, _)), _) => tx_pair(run, w, cluster, &mut rng, photo, token, true).await,
            (24, _, _) => insert_many(run, w, &photos, &mut rng, n, &token).await,
            (25, _, _) => {
                // The worker's own photos, judged too: it alone changes them.
                let own: Vec<(FanOutRow, Vec<Option<String>>)> = mine
                    .iter()
                    .map(|m| (m.id, m.states.clone()))
                    .chain(gone.iter().map(|id| (*id, vec![None])))
                    .map(|(id, states)| (fan_row(run, id, String::new()), states))
                    .collect();
                fan_out(run, &photos, &mut rng, &own).await;
            }
            (26, _, _) => get_many(run, &photos, &mut rng, &mine, &gone).await,
            (17, _, Some(i)) => {
                let m = &mut mine[i];
                m.versions += 1;
                let url = format!("soak://{}/{}/v{}", m.user, m.id.as_i64(), m.versions);
                let content = format!("{}|{url}|{}", m.user, m.token);
                let start = run.now();
                let result = photos.update(m.id, &[("url", &url)]).await;
                let end = run.now();
                let outcome = match &result {
                    Ok(found) => {
                        let got = found.as_ref().map(content_of);
                        let fits = match &got {
                            Some(g) => *g == content && m.states.iter().any(Option::is_some),
                            None => m.states.contains(&None),
                        };
                        if !fits {
                            lock(&run.bad_reads).push(format!(
                                "update of photo {} at {:?} returned {got:?}, setting {content:?} on what may hold {:?}",
                                m.id.as_i64(),
                                run.now(),
                                m.states
                            ));
                        }
                        Outcome::Acked(m.id.as_i64())
                    }
                    Err(e) => Outcome::Failed { unknown: e.outcome_unknown(), error: e.to_string() },
                };
                let mutation =
                    Mutation { token: m.token.clone(), content: Some(content), start, end, outcome };
                m.states = check::after(&m.states, &mutation);
                let unknown = matches!(mutation.outcome, Outcome::Failed { unknown: true, .. });
                lock(&run.mutations).push(mutation);
                if unknown {
                    // Applied or not, and maybe later still (its cancel is sent in the
                    // background): the photo is left as it is, no later call ordered
                    // after it.
                    mine.swap_remove(i);
                }
            }
            (18, _, Some(i)) => read_back(run, &photos, mine[i].id, &mine[i].states).await,
            (19, _, Some(i)) => {
                let m = &mut mine[i];
                let start = run.now();
                let result = photos.delete(m.id).await;
                let end = run.now();
                let outcome = match &result {
                    Ok(found) => {
                        let fits = if *found {
                            m.states.iter().any(Option::is_some)
                        } else {
                            m.states.contains(&None)
                        };
                        if !fits {
                            lock(&run.bad_reads).push(format!(
                                "delete of photo {} at {:?} {} a row; it may hold {:?}",
                                m.id.as_i64(),
                                run.now(),
                                if *found { "found" } else { "found no" },
                                m.states
                            ));
                        }
                        Outcome::Acked(m.id.as_i64())
                    }
                    Err(e) => Outcome::Failed { unknown: e.outcome_unknown(), error: e.to_string() },
                };
                let mutation = Mutation { token: m.token.clone(), content: None, start, end, outcome };
                m.states = check::after(&m.states, &mutation);
                let unknown = matches!(mutation.outcome, Outcome::Failed { unknown: true, .. });
                lock(&run.mutations).push(mutation);
                // Gone, or left as it is after an outcome unknown (as for an update).
                if !unknown && m.states == [None] {
                    gone.push(m.id);
                }
                if unknown || m.states == [None] {
                    mine.swap_remove(i);
                }
            }
            // A photo through the repository, or (20) the example's sqlx path.
            _ => {
                let user = i64::try_from(1 + rng.below(USERS)).unwrap_or(1);
                // One photo in four is the worker's own, to update and delete.
                let private = rng.below(4) == 0;
                let new =
                    NewPhoto { user_id: user, url: format!("soak://{user}/{n}"), caption: token.clone() };
                let content = format!("{user}|{}|{token}", new.url);
                let via = if pick == 20 { "sqlx" } else { "repo" };
                let start = run.now();
                let result = if pick == 20 {
                    with_sqlx::post_photo(&sqlx, &new).await
                } else {
                    photos.insert(&new).await
                };
                let end = run.now();
                let outcome = match &result {
                    Ok(p) if private => {
                        mine.push(Mine {
                            id: p.id,
                            user,
                            token: token.clone(),
                            states: vec![Some(content.clone())],
                            versions: 0,
                        });
                        Outcome::Acked(p.id.as_i64())
                    }
                    Ok(p) => {
                        share(run, p.id, &content);
                        Outcome::Acked(p.id.as_i64())
                    }
                    Err(e) => Outcome::Failed { unknown: e.outcome_unknown(), error: e.to_string() },
                };
                lock(&run.history).push(Write {
                    worker: w,
                    table: Table::Photos,
                    token,
                    content,
                    start,
                    end,
                    outcome,
                    via,
                    group: None,
                });
            }
        }
    }
}

/// Reads photo `id` and checks it holds one of `states` (`None`: absent).
async fn read_back(run: &Run, photos: &shardline_repo::Repo<Photo>, id: Id, states: &[Option<String>]) {
    run.reads.fetch_add(1, Ordering::Relaxed);
    judge_read(run, id, states, photos.get(id).await, "read");
}

/// Judges a read of photo `id` (`how`: by which path) that may hold any of `states`.
fn judge_read(
    run: &Run,
    id: Id,
    states: &[Option<String>],
    result: Result<Option<Photo>, shardline_repo::Error>,
    how: &str,
) {
    match result {
        Ok(found) => {
            let got = found.as_ref().map(content_of);
            if !states.contains(&got) {
                lock(&run.bad_reads).push(format!(
                    "{how} of photo {} at {:?} answered {got:?}, written {states:?}",
                    id.as_i64(),
                    run.now()
                ));
            }
        }
        Err(e) => judge_read_error(run, &format!("{how} of photo {}", id.as_i64()), &e),
    }
}

/// Judges a read's failure (`what`: which read): the product's own alarm for a row from
/// another shard, or one it cannot read, is a violation; a host down or slow is not.
fn judge_read_error(run: &Run, what: &str, e: &shardline_repo::Error) {
    match e {
        shardline_repo::Error::Misrouted { .. }
        | shardline_repo::Error::Decode { .. }
        | shardline_repo::Error::Router(_) => {
            lock(&run.bad_reads).push(format!(
                "{what} at {:?} failed: {}",
                run.now(),
                shardline_repo::error_chain(e)
            ));
        }
        _ => {
            run.read_errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// `get_many` under the faults: 1 to 5 shared photos (each as written), up to 3 of the
/// worker's own (any state its calls leave them in) and up to 2 it deleted (absent), an
/// ID asked twice now and then. Every entry is judged as a read of its photo, in the
/// order asked, and the IDs it says are missing must be those it answered `None` for,
/// once for each time asked.
async fn get_many(
    run: &Run,
    photos: &shardline_repo::Repo<Photo>,
    rng: &mut Rng,
    mine: &[Mine],
    gone: &[Id],
) {
    let mut asked: Vec<(Id, Vec<Option<String>>)> = Vec::new();
    {
        let shared = lock(&run.photos);
        for _ in 0..=rng.below(5) {
            if !shared.is_empty() {
                let (id, content, _) = &shared[rng.index(shared.len())];
                asked.push((*id, vec![Some(content.clone())]));
            }
        }
    }
    for _ in 0..rng.below(4) {
        if !mine.is_empty() {
            let m = &mine[rng.index(mine.len())];
            asked.push((m.id, m.states.clone()));
        }
    }
    for _ in 0..rng.below(3) {
        if !gone.is_empty() {
            asked.push((gone[rng.index(gone.len())], vec![None]));
        }
    }
    if asked.is_empty() {
        return;
    }
    run.reads.fetch_add(1, Ordering::Relaxed);
    run.get_manys.fetch_add(1, Ordering::Relaxed);
    let ids: Vec<Id> = asked.iter().map(|(id, _)| *id).collect();
    let what = format!("get_many of {} photo(s)", ids.len());
    match photos.get_many(&ids).await {
        Ok(many) => {
            if many.rows.len() != ids.len() {
                lock(&run.bad_reads).push(format!(
                    "{what} at {:?} answered {} entries",
                    run.now(),
                    many.rows.len()
                ));
                return;
            }
            let mut none: Vec<i64> =
                ids.iter().zip(&many.rows).filter(|(_, r)| r.is_none()).map(|(id, _)| id.as_i64()).collect();
            let mut missing: Vec<i64> = many.missing.iter().map(|id| id.as_i64()).collect();
            none.sort_unstable();
            missing.sort_unstable();
            if none != missing {
                lock(&run.bad_reads).push(format!(
                    "{what} at {:?} said {missing:?} missing, answered none for {none:?}",
                    run.now()
                ));
            }
            for ((id, states), found) in asked.iter().zip(many.rows) {
                judge_read(run, *id, states, Ok(found), "get_many");
            }
        }
        Err(e) => judge_read_error(run, &what, &e),
    }
}

/// Ms since the Unix epoch, now.
fn wall_ms() -> u128 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

/// An acknowledged photo no worker will update or delete: one to comment on, read back
/// and find in fan-outs.
fn share(run: &Run, id: Id, content: &str) {
    lock(&run.photos).push((id, content.to_owned(), wall_ms()));
}

/// A write's outcome from its call's result.
fn outcome_of<T>(result: &Result<T, shardline_repo::Error>, id: impl Fn(&T) -> Id) -> Outcome {
    match result {
        Ok(row) => Outcome::Acked(id(row).as_i64()),
        Err(e) => Outcome::Failed { unknown: e.outcome_unknown(), error: e.to_string() },
    }
}

/// A photo and a comment on an acknowledged photo of the same shard, in one shard
/// transaction of the repository (`Cluster::transaction`) or (`via_sqlx`) of the sqlx
/// path (`Sqlx::transaction`, the statements sqlx's own): both applied or neither.
async fn tx_pair(
    run: &Run,
    w: u32,
    cluster: &Cluster,
    rng: &mut Rng,
    photo: Id,
    token: String,
    via_sqlx: bool,
) {
    let Ok(route) = cluster.route_id(photo) else {
        lock(&run.bad_reads).push(format!("photo {} routes nowhere", photo.as_i64()));
        return;
    };
    // A user of the photo's shard (one in 32 draws; the bound only stops a bad map).
    let Some(user) = (0..10_000)
        .map(|_| i64::try_from(1 + rng.below(USERS)).unwrap_or(1))
        .find(|u| cluster.route_user(*u).shard == route.shard)
    else {
        return;
    };
    let new_photo = NewPhoto { user_id: user, url: format!("soak://{user}/tx"), caption: token.clone() };
    let comment_token = format!("{token}c");
    let new_comment = NewComment { photo_id: photo, user_id: user, body: comment_token.clone() };
    let (p, c) = (&new_photo, &new_comment);
    let start = run.now();
    let result = if via_sqlx {
        cluster
            .sqlx()
            .transaction(route.shard, |conn| {
                Box::pin(async move {
                    let photo: Photo = sqlx::query_as(
                        "INSERT INTO photos (user_id, url, caption) VALUES ($1, $2, $3)
                         RETURNING id, user_id, url, caption",
                    )
                    .bind(p.user_id)
                    .bind(&p.url)
                    .bind(&p.caption)
                    .fetch_one(&mut **conn)
                    .await?;
                    let comment: Comment = sqlx::query_as(
                        "INSERT INTO comments (photo_id, user_id, body) VALUES ($1, $2, $3)
                         RETURNING id, photo_id, user_id, body",
                    )
                    .bind(c.photo_id.as_i64())
                    .bind(c.user_id)
                    .bind(&c.body)
                    .fetch_one(&mut **conn)
                    .await?;
                    Ok((photo, comment))
                })
            })
            .await
    } else {
        cluster
            .transaction(route.shard, |tx| {
                Box::pin(async move {
                    let photo: Photo = tx.insert(p).await?;
                    let comment: Comment = tx.insert(c).await?;
                    Ok::<_, shardline_repo::Error>((photo, comment))
                })
            })
            .await
    };
    let via = if via_sqlx { "sqlx-tx" } else { "tx" };
    let end = run.now();
    let photo_content = format!("{user}|{}|{token}", new_photo.url);
    if let Ok((p, _)) = &result {
        share(run, p.id, &photo_content);
    }
    let group = Some(run.groups.fetch_add(1, Ordering::Relaxed) + 1);
    let mut history = lock(&run.history);
    history.push(Write {
        worker: w,
        table: Table::Photos,
        token,
        content: photo_content,
        start,
        end,
        outcome: outcome_of(&result, |(p, _)| p.id),
        via,
        group,
    });
    history.push(Write {
        worker: w,
        table: Table::Comments,
        token: comment_token,
        content: format!("{user}|{}|{}", photo.as_i64(), new_comment.body),
        start,
        end,
        outcome: outcome_of(&result, |(_, c)| c.id),
        via,
        group,
    });
}

/// 2 to 6 photos of random users in one `Repo::insert_many` (atomic per host, not
/// across hosts: a failure that committed some hosts' parts, `Error::InsertMany`, says
/// which rows committed, which may have, and that the rest did not).
async fn insert_many(
    run: &Run,
    w: u32,
    photos: &shardline_repo::Repo<Photo>,
    rng: &mut Rng,
    n: u64,
    token: &str,
) {
    let news: Vec<NewPhoto> = (0..2 + rng.below(5))
        .map(|i| {
            let user = i64::try_from(1 + rng.below(USERS)).unwrap_or(1);
            NewPhoto { user_id: user, url: format!("soak://{user}/{n}/{i}"), caption: format!("{token}m{i}") }
        })
        .collect();
    let start = run.now();
    let result = photos.insert_many(&news).await;
    let end = run.now();
    let mut writes = Vec::new();
    for (i, new) in news.iter().enumerate() {
        let content = format!("{}|{}|{}", new.user_id, new.url, new.caption);
        let outcome = match &result {
            Ok(rows) => match rows.get(i) {
                Some(p) => {
                    share(run, p.id, &content);
                    Outcome::Acked(p.id.as_i64())
                }
                None => {
                    lock(&run.bad_reads).push(format!(
                        "insert_many of {} rows returned {}",
                        news.len(),
                        rows.len()
                    ));
                    Outcome::Failed { unknown: true, error: "not returned".into() }
                }
            },
            Err(e @ shardline_repo::Error::InsertMany { committed_rows, unknown_rows, .. }) => {
                if committed_rows.contains(&i) {
                    Outcome::Committed
                } else {
                    Outcome::Failed { unknown: unknown_rows.contains(&i), error: e.to_string() }
                }
            }
            Err(e) => Outcome::Failed { unknown: e.outcome_unknown(), error: e.to_string() },
        };
        writes.push(Write {
            worker: w,
            table: Table::Photos,
            token: new.caption.clone(),
            content,
            start,
            end,
            outcome,
            via: "many",
            group: None,
        });
    }
    lock(&run.history).extend(writes);
}

/// A read across every shard: a time window (half of them), pages of the newest rows,
/// or a count.
async fn fan_out(
    run: &Run,
    photos: &shardline_repo::Repo<Photo>,
    rng: &mut Rng,
    own: &[(FanOutRow, Vec<Option<String>>)],
) {
    match rng.below(4) {
        0 => newest(run, photos, rng, own).await,
        1 => count_window(run, photos, rng).await,
        _ => window(run, photos, rng, own).await,
    }
}

/// The fan-out's report of missing shards, as the checker takes it.
fn missing_shards(missing: &[shardline_repo::Missing]) -> std::collections::HashSet<u16> {
    missing.iter().flat_map(|m| m.shards.iter().map(|s| s.get())).collect()
}

/// A fan-out's row, or a known photo, as the checker takes it.
fn fan_row(run: &Run, id: Id, content: String) -> FanOutRow {
    FanOutRow {
        id: id.as_i64(),
        ms: u128::try_from(run.cluster.layout().decode(id).unix_ms).unwrap_or(0),
        shard: run.cluster.route_id(id).map_or(u16::MAX, |r| r.shard.get()),
        content,
    }
}

/// The shared photos among the first `known` acknowledged whose IDs may be at `from_ms`
/// or later: those acknowledged 2 s before it or later (an ID is minted before its write
/// is acknowledged).
fn known_since(run: &Run, known: usize, from_ms: u128) -> Vec<FanOutRow> {
    let shared = lock(&run.photos);
    shared[..known.min(shared.len())]
        .iter()
        .rev()
        .take_while(|(_, _, acked)| acked + 2000 >= from_ms)
        .map(|(id, content, _)| fan_row(run, *id, content.clone()))
        .collect()
}

/// One to three pages of `Repo::newest`, each from the cursor the one before gave:
/// each judged as a fan-out over every ID below its cursor (the last row of the page
/// before: a cursor the product gives is checked to be that row, and no row comes back
/// on two pages).
async fn newest(
    run: &Run,
    photos: &shardline_repo::Repo<Photo>,
    rng: &mut Rng,
    own: &[(FanOutRow, Vec<Option<String>>)],
) {
    let limit = [5, 50, 500][rng.index(3)];
    let mut before: Option<Id> = None;
    let mut listed = std::collections::HashSet::new();
    for _ in 0..1 + rng.below(3) {
        let known = lock(&run.photos).len();
        run.fan_outs.fetch_add(1, Ordering::Relaxed);
        let Some(page) = whole_or_judged(run, "newest", photos.newest(before, limit).await) else { return };
        // Every ID's time is at or before now (they are minted on this machine's clock).
        let to_ms = wall_ms();
        if !page.missing.is_empty() {
            run.fan_outs_partial.fetch_add(1, Ordering::Relaxed);
        }
        let rows: Vec<FanOutRow> = page.rows.iter().map(|p| fan_row(run, p.id, content_of(p))).collect();
        let full = page.next.is_some();
        // Of a full page only the known photos at or above its last row count.
        let from_known = if full { rows.last().map_or(0, |r| r.ms) } else { 0 };
        let read = FanOutRead {
            at: run.now(),
            from_ms: 0,
            to_ms,
            below: before.map(Id::as_i64),
            limit,
            rows,
            full,
            missing: missing_shards(&page.missing),
            missing_errors: page.missing.iter().map(|m| format!("{}: {}", m.host, m.error)).collect(),
            known: known_since(run, known, from_known),
            own: own.to_vec(),
        };
        let mut wrong = check::fan_out(&read);
        let last = page.rows.last().map(|p| p.id);
        // A cursor only after a full page, and then its last row's; a full page that
        // ends at the listing's last row has none.
        let cursor_is_last = page.next.is_none() || (page.rows.len() == limit && page.next == last);
        if !cursor_is_last {
            wrong.push(format!(
                "newest at {:?}: {} rows of a limit of {limit}, its cursor {:?}, its last row {:?}",
                read.at,
                page.rows.len(),
                page.next.map(Id::as_i64),
                last.map(Id::as_i64)
            ));
        }
        for p in &page.rows {
            if !listed.insert(p.id) {
                wrong.push(format!("newest at {:?}: photo {} on two pages", read.at, p.id.as_i64()));
            }
        }
        lock(&run.bad_reads).extend(wrong);
        match (page.next, last) {
            (Some(_), Some(last)) => before = Some(last),
            _ => return,
        }
    }
}

/// A fan-out's result, or `None` with its failure recorded as a violation: a host down,
/// slow or fenced is reported in the result (its shards missing); a call fails whole
/// only on a window outside the layout, which the soak's are not.
fn whole_or_judged<T>(run: &Run, what: &str, result: Result<T, shardline_repo::Error>) -> Option<T> {
    result
        .map_err(|e| {
            lock(&run.bad_reads).push(format!(
                "{what} at {:?} failed whole: {}",
                run.now(),
                shardline_repo::error_chain(&e)
            ));
        })
        .ok()
}

/// `Repo::count_between` over a recent window, judged at the end.
async fn count_window(run: &Run, photos: &shardline_repo::Repo<Photo>, rng: &mut Rng) {
    let to = SystemTime::now() - rng.millis(0, 500);
    let from = to - rng.millis(100, 3000);
    run.fan_outs.fetch_add(1, Ordering::Relaxed);
    let start = run.now();
    let Some(counted) = whole_or_judged(run, "count", photos.count_between(from, to).await) else { return };
    let end = run.now();
    if !counted.missing.is_empty() {
        run.fan_outs_partial.fetch_add(1, Ordering::Relaxed);
    }
    let ms = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let read = CountRead {
        start,
        end,
        from_ms: ms(from),
        to_ms: ms(to),
        count: counted.count,
        missing: missing_shards(&counted.missing),
    };
    lock(&run.counts).push(read);
}

/// Judges the counts at the end (`check::counts`).
fn judge_counts(run: &Run, history: &[Write], mutations: &[Mutation], observed: &Observed) -> Vec<String> {
    let counts = std::mem::take(&mut *lock(&run.counts));
    let place = |id: i64| {
        Id::from_i64(id).map_or((0, u16::MAX), |id| {
            let row = fan_row(run, id, String::new());
            (row.ms, row.shard)
        })
    };
    let found = check::counts(&counts, history, mutations, observed, place);
    run.note(format!("counts judged: {}, {} wrong", counts.len(), found.len()));
    found
}

/// A fan-out read of a recent time window (`Repo::created_between`), judged against the
/// shared photos acknowledged before it began: every one in the window (and at or above
/// the page's last ID when the page is full) is returned as written, unless its shard is
/// reported missing; no row is returned twice, out of order or outside the window; no
/// shard is reported missing for a row of another shard.
async fn window(
    run: &Run,
    photos: &shardline_repo::Repo<Photo>,
    rng: &mut Rng,
    own: &[(FanOutRow, Vec<Option<String>>)],
) {
    let to = SystemTime::now() - rng.millis(0, 500);
    let from = to - rng.millis(100, 3000);
    let limit = [5, 50, 500, 5000][rng.index(4)];
    let known = lock(&run.photos).len();
    run.fan_outs.fetch_add(1, Ordering::Relaxed);
    let Some(page) = whole_or_judged(run, "fan-out", photos.created_between(from, to, limit).await) else {
        return;
    };
    if !page.missing.is_empty() {
        run.fan_outs_partial.fetch_add(1, Ordering::Relaxed);
    }
    let ms = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let (from_ms, to_ms) = (ms(from), ms(to));
    let rows = page.rows.iter().map(|p| fan_row(run, p.id, content_of(p))).collect();
    let read = FanOutRead {
        at: run.now(),
        from_ms,
        to_ms,
        below: None,
        limit,
        rows,
        full: page.next.is_some(),
        missing: missing_shards(&page.missing),
        missing_errors: page.missing.iter().map(|m| format!("{}: {}", m.host, m.error)).collect(),
        known: known_since(run, known, from_ms),
        own: own.to_vec(),
    };
    lock(&run.bad_reads).extend(check::fan_out(&read));
}

// ---------------------------------------------------------------------------------------
// The mover: moves, rebalances, one migration.

fn host_name(i: usize) -> Result<HostName, BoxError> {
    Ok(HostName::new(&format!("pg{}", i + 1))?)
}

fn host_index(h: &HostName) -> usize {
    h.as_str().trim_start_matches("pg").parse::<usize>().unwrap_or(1).saturating_sub(1)
}

async fn mover(run: &Arc<Run>) {
    let mut rng = Rng::new(run.seed ^ 0x6d6f_7665);
    let mut round = 0_u64;
    let mut migrated = false;
    while Instant::now() < run.deadline {
        tokio::time::sleep(rng.millis(300, 1500)).await;
        if Instant::now() >= run.deadline {
            break;
        }
        round += 1;
        if !migrated && run.now() > run.deadline.duration_since(run.began) / 3 {
            migrated = true;
            migrate(run).await;
            continue;
        }
        if round.is_multiple_of(5) {
            rebalance_once(run, &mut rng).await;
            continue;
        }
        let shard = match LogicalShard::new(
            i64::try_from(rng.below(u64::from(SHARDS))).unwrap_or(0),
            run.cluster.map().count(),
        ) {
            Ok(s) => s,
            Err(_) => continue,
        };
        let _ = run.cluster.refresh().await;
        let Ok(route) = run.cluster.route(shard) else { continue };
        let source = host_index(&route.host);
        let target = (source + 1 + rng.index(HOSTS - 1)) % HOSTS;
        // Every other move revertible, and half of those reverted a moment later (its
        // writes since the flip carried back), under the same faults.
        let revertible = rng.below(2) == 0;
        // Every way of copying: the mover's at the default cap (half the moves), uncapped
        // or at 20 MB/s, and Postgres's table-sync copy (`--subscription-copy`).
        let max_rate = match rng.below(6) {
            0 => Some(0),
            1 => Some(20_000_000),
            2 => None,
            _ => Some(shardline_ops::moves::DEFAULT_MAX_RATE),
        };
        let moved = move_once(run, &mut rng, shard, source, target, false, (revertible, max_rate)).await;
        if moved && revertible && rng.below(2) == 0 {
            tokio::time::sleep(rng.millis(100, 800)).await;
            move_once(run, &mut rng, shard, target, source, true, (false, None)).await;
        }
    }
}

/// Moves `shard` from host `source` to `target` (a revert of its last move when
/// `revert`), made revertible or copying the mover's way (`max_rate`) as asked, unless
/// the fault injector kills the mover; a failed or killed move is finished or undone.
/// Returns whether the move completed.
async fn move_once(
    run: &Arc<Run>,
    rng: &mut Rng,
    shard: LogicalShard,
    source: usize,
    target: usize,
    revert: bool,
    (revertible, max_rate): (bool, Option<u64>),
) -> bool {
    let Ok(to) = host_name(target) else { return false };
    *lock(&run.current) = Some((source, target, Step::Started));
    let progress_run = run.clone();
    let mut options = MoveOptions::default();
    options.revertible = revertible;
    options.max_rate = max_rate;
    options.progress = Some(Arc::new(move |p: &MoveProgress| {
        if let MoveProgress::Step { step, .. } = p
            && let Some(c) = lock(&progress_run.current).as_mut()
        {
            c.2 = *step;
        }
    }));
    // Made before the nemesis can see the mover moving: a `Notified` receives
    // `notify_waiters` from when it is made, polled or not.
    let killed = run.kill_mover.notified();
    run.moving.store(true, Ordering::SeqCst);
    let result = tokio::select! {
        r = async {
            if revert { moves::revert(&run.config, shard, &options).await } else { moves::run(&run.config, shard, &to, &options).await }
        } => Some(r),
        () = killed => None,
    };
    run.moving.store(false, Ordering::SeqCst);
    *lock(&run.current) = None;
    let what = if revert { "revert" } else { "move" };
    match result {
        Some(Ok(r)) => {
            Run::count(&run.moves, if revert { "reverted" } else { "done" });
            if r.rows > 0 && max_rate.is_some() {
                Run::count(&run.moves, "done, the mover's copy");
            }
            run.note(format!(
                "{what} of shard {shard} pg{} -> {to}: {} rows, write pause {} ms",
                source + 1,
                r.rows,
                r.pause_ms
            ));
            true
        }
        // Refused (a migration since, the move's own failure to keep its way back):
        // nothing changed, unless it was found under the revert's lock (then it is
        // journaled, and finished below).
        Some(Err(e @ shardline_ops::Error::NotRevertible { .. })) => {
            Run::count(&run.moves, "revert refused");
            run.note(format!("{e}"));
            finish_moves(run, rng, "after a refused revert").await;
            false
        }
        Some(Err(e)) => {
            Run::count(&run.moves, "failed");
            run.note(format!(
                "{what} of shard {shard} pg{} -> {to} failed: {}",
                source + 1,
                shardline_repo::error_chain(&e)
            ));
            finish_moves(run, rng, "after a failed move").await;
            false
        }
        None => {
            Run::count(&run.moves, "mover killed");
            run.note(format!("mover killed in the {what} of shard {shard} pg{} -> {to}", source + 1));
            finish_moves(run, rng, "after the mover was killed").await;
            false
        }
    }
}

async fn rebalance_once(run: &Run, rng: &mut Rng) {
    let plan = match rebalance::plan(&run.config, 3).await {
        Ok(p) => p,
        Err(e) => {
            run.note(format!("rebalance plan failed: {}", shardline_repo::error_chain(&e)));
            return;
        }
    };
    if plan.moves.is_empty() {
        return;
    }
    let options = MoveOptions::default();
    let killed = run.kill_mover.notified();
    run.moving.store(true, Ordering::SeqCst);
    let applied = tokio::select! {
        r = rebalance::apply(&run.config, &plan, Parallel::disjoint(2), &options) => Some(r),
        () = killed => None,
    };
    run.moving.store(false, Ordering::SeqCst);
    match applied {
        Some(results) => {
            let ok = results.iter().filter(|(_, r)| r.is_ok()).count();
            let not_started = results
                .iter()
                .filter(|(_, r)| matches!(r, Err(shardline_ops::Error::NotStarted { .. })))
                .count();
            Run::count(&run.moves, "rebalances");
            for _ in 0..ok {
                Run::count(&run.moves, "done");
            }
            for _ in ok + not_started..results.len() {
                Run::count(&run.moves, "failed");
            }
            for _ in 0..not_started {
                Run::count(&run.moves, "not started after a failed one");
            }
            run.note(format!("rebalance: {ok} of {} moves done", results.len()));
        }
        None => {
            Run::count(&run.moves, "mover killed");
            run.note(format!("mover killed during a rebalance of {} moves", plan.moves.len()));
        }
    }
    finish_moves(run, rng, "after a rebalance").await;
}

async fn migrate(run: &Run) {
    let file = run.dir.join("migrations").join("0100_soak_index.sql");
    if let Err(e) = std::fs::write(&file, "CREATE INDEX IF NOT EXISTS comments_by_body ON comments (body);\n")
    {
        run.note(format!("cannot write the migration: {e}"));
        return;
    }
    for attempt in 1..=20 {
        match shardline_ops::migrate(&run.config, &shardline_ops::Options::default(), &|_| {}).await {
            Ok(r) => {
                Run::count(&run.moves, "migrations");
                run.note(format!("migrated ({} migrations), attempt {attempt}", r.migrations));
                return;
            }
            Err(e) => {
                run.note(format!("migrate attempt {attempt} failed: {}", shardline_repo::error_chain(&e)));
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    }
    Run::count(&run.moves, "migration never applied");
}

/// Resumes or undoes (drawn) every move the journal still has running, until none is,
/// trying again while faults get in the way (up to 3 minutes).
async fn finish_moves(run: &Run, rng: &mut Rng, when: &str) {
    let until = Instant::now() + Duration::from_secs(180);
    loop {
        let running: Vec<_> = match moves::list(&run.config).await {
            Ok(j) => j.into_iter().filter(|m| m.state == State::Running).collect(),
            Err(e) => {
                if Instant::now() > until {
                    run.note(format!("{when}: cannot read the journal: {}", shardline_repo::error_chain(&e)));
                    return;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let Some(m) = running.first() else { return };
        let undo = rng.below(2) == 0 && m.step < Step::Flipped;
        let result = if undo {
            moves::abort(&run.config, m.shard, &MoveOptions::default()).await.map(|_| "undone")
        } else {
            moves::resume(&run.config, Some(m.shard), &MoveOptions::default()).await.map(|_| "resumed")
        };
        match result {
            Ok(what) => {
                Run::count(&run.moves, if undo { "undone" } else { "resumed" });
                run.note(format!("{when}: move {} of shard {} at {} {what}", m.id, m.shard, m.step.as_str()));
            }
            Err(e) => {
                if Instant::now() > until {
                    run.note(format!(
                        "{when}: move {} left running: {}",
                        m.id,
                        shardline_repo::error_chain(&e)
                    ));
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The nemesis.

#[derive(Debug, Clone, Copy)]
enum Fault {
    Kill,
    Pause,
    Restart,
    CutApp,
    CutCatalog,
    CutPeer,
    Sever,
    KillMover,
}

impl Fault {
    const ALL: [Fault; 8] = [
        Fault::Kill,
        Fault::Pause,
        Fault::Restart,
        Fault::CutApp,
        Fault::CutCatalog,
        Fault::CutPeer,
        Fault::Sever,
        Fault::KillMover,
    ];
    fn name(self) -> &'static str {
        match self {
            Fault::Kill => "host killed",
            Fault::Pause => "host paused",
            Fault::Restart => "host restarted",
            Fault::CutApp => "app-host link cut",
            Fault::CutCatalog => "app-catalog link cut",
            Fault::CutPeer => "peer link cut",
            Fault::Sever => "app-host connections reset",
            Fault::KillMover => "mover kill asked",
        }
    }
}

/// What a fault strikes: two nemeses never strike the same one at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Host(usize),
    Catalog,
    Mover,
}

/// How many nemeses strike at once.
const NEMESES: u64 = 2;

/// One nemesis (`n`: which, for its own draws): a fault every 1–4 s, on a target no
/// other nemesis holds.
async fn nemesis(run: &Run, n: u64) {
    let mut rng = Rng::new(run.seed ^ 0x6e65_6d65 ^ (n << 40));
    while Instant::now() < run.deadline {
        tokio::time::sleep(rng.millis(1000, 4000)).await;
        if Instant::now() >= run.deadline {
            break;
        }
        let fault = Fault::ALL[rng.index(Fault::ALL.len())];
        // Half the faults wait (up to 10 s) for the running move to reach a drawn step,
        // and then strike its source or its target.
        let mut host = rng.index(HOSTS);
        let (mut at, mut side) = (String::new(), String::new());
        if rng.below(2) == 0 {
            let step = Step::ALL[rng.index(Step::ALL.len() - 1)];
            let source_side = rng.below(2) == 0;
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until && Instant::now() < run.deadline {
                let current = *lock(&run.current);
                if let Some((source, target, s)) = current
                    && s >= step
                {
                    host = if source_side { source } else { target };
                    at = format!(" while a move was at {}", s.as_str());
                    side = format!(", its {}", if source_side { "source" } else { "target" });
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let held = match fault {
            Fault::Pause => rng.millis(500, 8000),
            Fault::Kill => rng.millis(500, 5000),
            _ => rng.millis(500, 6000),
        };
        if matches!(fault, Fault::KillMover) && !wait_for_a_move(run).await {
            continue;
        }
        let what = match fault {
            Fault::CutCatalog | Fault::KillMover => format!("{}{at}", fault.name()),
            _ => format!("{} ({}){at}{side}", fault.name(), run.kit.hosts()[host].name()),
        };
        let target = match fault {
            Fault::CutCatalog => Target::Catalog,
            Fault::KillMover => Target::Mover,
            _ => Target::Host(host),
        };
        let alongside = {
            let mut struck = lock(&run.struck);
            if struck.contains(&target) {
                // The other nemesis holds it: this one waits for its next turn.
                continue;
            }
            struck.push(target);
            struck.len() > 1
        };
        let beside = if alongside { " (beside another fault)" } else { "" };
        run.note(format!("fault: {what}, for {} ms{beside}", held.as_millis()));
        // Counted once made and healed; one that could not be fails the run (after its
        // report): a soak that struck nothing proves nothing.
        match strike(run, fault, host, held).await {
            Ok(()) => {
                lock(&run.struck).retain(|t| *t != target);
                Run::count(&run.faults, fault.name());
                if alongside {
                    Run::count(&run.faults, "beside another fault");
                }
            }
            // The target stays claimed: the fault may still hold (the run fails anyway).
            Err(e) => {
                run.note(format!("fault: {what} could not be made or healed: {e}"));
                lock(&run.strike_failures).push(format!("{what}: {e}"));
            }
        }
    }
}

/// Strikes `fault` and heals it.
async fn strike(run: &Run, fault: Fault, i: usize, held: Duration) -> Result<(), BoxError> {
    let host = &run.kit.hosts()[i];
    match fault {
        Fault::Kill => {
            host.kill().await?;
            tokio::time::sleep(held).await;
            host.start().await?;
        }
        Fault::Pause => {
            host.pause().await?;
            tokio::time::sleep(held).await;
            host.resume().await?;
        }
        Fault::Restart => host.restart().await?,
        Fault::CutApp => hold_cut(&run.links[i], held).await,
        Fault::CutCatalog => hold_cut(&run.catalog_link, held).await,
        Fault::CutPeer => hold_cut(&run.peer_links[i], held).await,
        Fault::Sever => run.links[i].sever(),
        // A move that ended just before leaves nothing to kill: the report counts the
        // kills the mover honoured (`moves`), and the rest as too late.
        Fault::KillMover => run.kill_mover.notify_waiters(),
    }
    Ok(())
}

/// Waits (up to 10 s) until the mover is inside a move or a rebalance; false if it never
/// was.
async fn wait_for_a_move(run: &Run) -> bool {
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until && Instant::now() < run.deadline {
        if run.moving.load(Ordering::SeqCst) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

async fn hold_cut(link: &Link, held: Duration) {
    link.cut();
    tokio::time::sleep(held).await;
    link.heal();
}

async fn heal_all(run: &Run) {
    for l in run.links.iter().chain(&run.peer_links).chain(std::iter::once(&run.catalog_link)) {
        l.heal();
    }
    if let Err(e) = run.kit.heal().await {
        run.note(format!("healing the hosts failed: {e}"));
    }
}

// ---------------------------------------------------------------------------------------
// Recovery, and what the hosts hold.

async fn recover_and_observe(run: &Run) -> Result<Observed, BoxError> {
    heal_all(run).await;
    let mut seen = Observed::default();
    let mut rng = Rng::new(run.seed ^ 0x7265_636f);
    // Every move the journal still has running is resumed (drawn: or undone).
    finish_moves(run, &mut rng, "at the end").await;
    for m in moves::list(&run.config).await? {
        if m.state == State::Running {
            seen.moves_left.push(format!("move {} of shard {} at {}", m.id, m.shard, m.step.as_str()));
        }
    }
    // The old copies first: `gc` drops them, and with them the evidence of a write
    // that got through a fence.
    for (i, host) in run.kit.hosts().iter().enumerate() {
        let name = host_name(i)?;
        let client = host.connect(DB).await?;
        for schema in &schemas_like(&client, "shard\\_%\\_moved\\_%").await? {
            let rows = rows_of(&client, &run.cluster, &name, schema, schema_shard(schema)).await?;
            seen.old_copies.extend(rows);
        }
    }
    run.note(format!("old copies read before gc: {} rows", seen.old_copies.len()));
    let mut gc_done = false;
    for attempt in 1..=10 {
        match moves::gc(&run.config, Duration::ZERO).await {
            Ok(r) if r.unreachable.is_empty() => {
                run.note(format!("gc: {} dropped", r.dropped.len()));
                gc_done = true;
                break;
            }
            Ok(r) => {
                run.note(format!("gc attempt {attempt}: unreachable: {}", r.unreachable.join("; ")));
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Err(e) => {
                run.note(format!("gc attempt {attempt}: {}", shardline_repo::error_chain(&e)));
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    }
    if !gc_done {
        return Err("gc never succeeded".into());
    }
    // A fresh handle: the map as the catalog has it now.
    let cluster = Cluster::connect(&run.config, ClusterOptions::default()).await?;
    let map = cluster.map();
    for (i, host) in run.kit.hosts().iter().enumerate() {
        let name = host_name(i)?;
        let client = host.connect(DB).await?;
        let schemas = schemas_like(&client, "shard\\_%").await?;
        let mine: Vec<String> =
            map.shards_of(&name).map(|s| map.route(s, cluster.prefix()).schema.to_string()).collect();
        for s in &mine {
            if !schemas.contains(s) {
                seen.missing_schemas.push(format!("{s} is missing on {name}, where the map places it"));
            }
        }
        for schema in &schemas {
            let live = mine.contains(schema);
            if !live {
                seen.stray_schemas.push(format!("{name}.{schema}"));
            }
            let rows = rows_of(&client, &cluster, &name, schema, schema_shard(schema)).await?;
            if live { seen.live.extend(rows) } else { seen.stray.extend(rows) }
        }
        for (what, sql) in [
            ("replication slot", "SELECT slot_name::text FROM pg_replication_slots"),
            ("publication", "SELECT pubname::text FROM pg_publication"),
            ("subscription", "SELECT subname::text FROM pg_subscription"),
        ] {
            for r in client.query(sql, &[]).await? {
                seen.replication_left.push(format!("{name}: {what} {}", r.get::<_, String>(0)));
            }
        }
    }
    // Every shard takes a write, through the handle the load used all along (its map
    // kept up to date across every move, by notification or by the retry path).
    let photos = run.cluster.repo::<Photo>()?;
    let mut user = 1_i64;
    for shard in map.count().shards() {
        while cluster.route_user(user).shard != shard {
            user += 1;
        }
        // A write that failed without being applied (a pooled connection to a host
        // killed just before, say) is tried again, up to 3 times, each try a write of
        // its own in the history; one whose outcome is unknown is not.
        for attempt in 1..=3 {
            let token = format!("final {shard} try {attempt}");
            let new = NewPhoto { user_id: user, url: format!("soak://{user}/final"), caption: token.clone() };
            let start = run.now();
            let r = photos.insert(&new).await;
            let (outcome, again) = match r {
                Ok(p) => (Outcome::Acked(p.id.as_i64()), false),
                Err(e) => {
                    let unknown = e.outcome_unknown();
                    if unknown || attempt == 3 {
                        seen.unwritable.push(format!("shard {shard}: {}", shardline_repo::error_chain(&e)));
                    }
                    (Outcome::Failed { unknown, error: e.to_string() }, !unknown)
                }
            };
            let content = format!("{user}|{}|{token}", new.url);
            lock(&run.history).push(Write {
                worker: u32::MAX,
                table: Table::Photos,
                token,
                content,
                start,
                end: run.now(),
                outcome,
                via: "repo",
                group: None,
            });
            if !again {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    // The final rows are read back with the rest.
    for (i, host) in run.kit.hosts().iter().enumerate() {
        let name = host_name(i)?;
        let client = host.connect(DB).await?;
        for s in map.shards_of(&name) {
            let schema = cluster.route(s)?.schema.to_string();
            let rows = client
                .query(
                    &format!(
                        "SELECT id, user_id, url, caption FROM {}.photos WHERE caption LIKE 'final %'",
                        quote(&schema)
                    ),
                    &[],
                )
                .await?;
            for r in rows {
                seen.live.push(photo_row(&cluster, &name, &schema, u32::from(s.get()), &r));
            }
        }
    }
    // And that handle reads every acknowledged photo back, each as written (or updated,
    // or deleted): a read that fails now, with every host healed, is a violation too.
    let mutations = lock(&run.mutations).clone();
    let mut mutated: std::collections::HashMap<&str, Vec<&Mutation>> = std::collections::HashMap::new();
    for m in &mutations {
        mutated.entry(m.token.as_str()).or_default().push(m);
    }
    let acked: Vec<(Id, Vec<Option<String>>)> = lock(&run.history)
        .iter()
        .filter(|w| w.table == Table::Photos)
        .filter_map(|w| match w.outcome {
            Outcome::Acked(id) => Some((
                Id::from_i64(id).ok()?,
                check::possible(&w.content, mutated.get(w.token.as_str()).map_or(&[][..], Vec::as_slice)),
            )),
            Outcome::Committed | Outcome::Failed { .. } => None,
        })
        .collect();
    for chunk in acked.chunks(500) {
        let ids: Vec<Id> = chunk.iter().map(|(id, _)| *id).collect();
        // A failure the retry path cannot take is tried again a few times (the handle's
        // map check or LISTEN may still be catching up after a cut): one that stays is
        // the violation.
        let mut read = photos.get_many(&ids).await;
        for _ in 0..3 {
            if read.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            read = photos.get_many(&ids).await;
        }
        match read {
            Ok(many) => {
                for ((id, states), found) in chunk.iter().zip(&many.rows) {
                    let got = found.as_ref().map(content_of);
                    if !states.contains(&got) {
                        seen.unreadable.push(format!(
                            "photo {}: the load's handle read {got:?}, written {states:?}",
                            id.as_i64()
                        ));
                    }
                }
            }
            Err(e) => seen.unreadable.push(format!(
                "{} acknowledged photos: the load's handle failed to read them: {}",
                chunk.len(),
                shardline_repo::error_chain(&e)
            )),
        }
    }
    seen.bad_reads = lock(&run.bad_reads).clone();
    Ok(seen)
}

/// The shard schemas of `client`'s database whose names are `LIKE pattern`, in order.
async fn schemas_like(client: &tokio_postgres::Client, pattern: &str) -> Result<Vec<String>, BoxError> {
    let rows = client
        .query("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE $1 ORDER BY 1", &[&pattern])
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// The shard a schema of the default prefix holds (`shard_0003`, `shard_0003_moved_12`:
/// 3); `u32::MAX` for a name that says none.
fn schema_shard(schema: &str) -> u32 {
    schema
        .strip_prefix("shard_")
        .and_then(|s| s.split('_').next())
        .and_then(|s| s.parse::<u32>().ok())
        .unwrap_or(u32::MAX)
}

async fn rows_of(
    client: &tokio_postgres::Client,
    cluster: &Cluster,
    host: &HostName,
    schema: &str,
    schema_shard: u32,
) -> Result<Vec<Row>, BoxError> {
    let mut out = Vec::new();
    for r in
        client.query(&format!("SELECT id, user_id, url, caption FROM {}.photos", quote(schema)), &[]).await?
    {
        out.push(photo_row(cluster, host, schema, schema_shard, &r));
    }
    let comments = client
        .query(&format!("SELECT id, user_id, photo_id, body FROM {}.comments", quote(schema)), &[])
        .await?;
    for r in comments {
        let (id, user, photo, body): (i64, i64, i64, String) = (r.get(0), r.get(1), r.get(2), r.get(3));
        out.push(Row {
            host: host.to_string(),
            schema: schema.to_owned(),
            table: Table::Comments,
            id,
            id_shard: id_shard(id),
            schema_shard,
            key_shard: id_shard(photo),
            content: format!("{user}|{photo}|{body}"),
            token: body,
        });
    }
    Ok(out)
}

fn photo_row(
    cluster: &Cluster,
    host: &HostName,
    schema: &str,
    schema_shard: u32,
    r: &tokio_postgres::Row,
) -> Row {
    let (id, user, url, caption): (i64, i64, String, String) = (r.get(0), r.get(1), r.get(2), r.get(3));
    Row {
        host: host.to_string(),
        schema: schema.to_owned(),
        table: Table::Photos,
        id,
        id_shard: id_shard(id),
        schema_shard,
        key_shard: u32::from(cluster.route_user(user).shard.get()),
        content: format!("{user}|{url}|{caption}"),
        token: caption,
    }
}

fn id_shard(id: i64) -> u32 {
    Id::from_i64(id).map_or(u32::MAX, Id::shard)
}
