//! Moving a shard, beside its rivals, in the same process on 3 real hosts:
//!
//! - copy throughput: the move's initial copy vs `pg_dump -n <schema> | psql` of the
//!   same shard into an empty database (goal ≥ 1×);
//! - the write pause under a steady write load on the moving shard: the fence-to-flip
//!   time the move reports, and the slowest write the writers saw, beside the same
//!   writers' latency with no move (goal < 100 ms);
//! - the mover's own copy (`--max-rate 0`) beside the same rival;
//! - gentle on the source: writers to another shard of the source, with no move and
//!   during the copy, for the table-sync copy and the mover's at several caps (goal:
//!   p99 within 2×).
//!
//! ```text
//! SHARDLINE_TEST_BACKEND=local cargo bench -p shardline-tests --bench moves [-- PHOTOS]
//! SHARDLINE_BENCH_ONLY=gentle ...   # the last section alone
//! SHARDLINE_BENCH_ONLY=copy ...     # the first section alone (copy throughput and its CPU)
//! SHARDLINE_BENCH_PIN=1 ...          # the last section with the hosts on cores of their own
//! ```
//!
//! `SHARDLINE_BENCH_PIN=1` (local backend, 2 cores or more) stands in for hosts with
//! cores of their own in the last section: the source's server and this process (the
//! writers) on core 0, the target's server and the mover's thread on core 1, with
//! `taskset`. The target's work (parsing the copy, building indexes, applying changes)
//! then no longer shares a core with the writers, as it would not across machines.
#![expect(clippy::unwrap_used, reason = "a benchmark")]

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use shardline_ops::Options;
use shardline_ops::moves::{self, MoveOptions};
use shardline_repo::{Cluster, ClusterOptions};
use shardline_router::{HostName, LogicalShard};

#[path = "common/mod.rs"]
mod common;
#[path = "common/cpu.rs"]
mod cpu;
#[path = "common/fill.rs"]
mod fill;
#[path = "common/writers.rs"]
mod writers;
use common::{BoxError, config};
use fill::fill;
use writers::writers;

fn pct(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort();
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "a percentile's index: a non-negative fraction of a length, rounded"
    )]
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let photos: i64 = args.first().map_or(Ok(200_000), |a| a.parse())?;
    let kit = shardline_testkit::Cluster::start(3).await?;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    kit.create_database("bench_moves").await?;
    let count = 8;
    let config = config(&kit, "bench_moves", count, &dir)?;
    shardline_ops::init(&config, &Options::default(), &|_| {}).await?;
    let pg1 = kit.hosts()[0].connect("bench_moves").await?;
    fill(&pg1, 0, i64::from(count), photos).await?;
    println!(
        "shard 0: {photos} photos, {photos} likes, {photos} comments; 3 hosts; {:?} backend",
        kit.backend()
    );

    // `SHARDLINE_BENCH_ONLY=gentle`: the last section alone; `=copy`: the first alone.
    let only = std::env::var("SHARDLINE_BENCH_ONLY").ok();
    let (gentle_only, copy_only) = match only.as_deref() {
        None | Some("") => (false, false),
        Some("gentle") => (true, false),
        Some("copy") => (false, true),
        Some(other) => {
            return Err(format!("SHARDLINE_BENCH_ONLY={other:?}: expected `gentle` or `copy`").into());
        }
    };
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let rate = 250;
    if !gentle_only {
        // 1. Copy throughput: the move vs pg_dump | psql of the same schema.
        let t = Instant::now();
        let sampler = cpu::Sampler::start();
        // The copy's span for the CPU figures: from `prepared` journaled to `caught_up`.
        let steps: Arc<std::sync::Mutex<Vec<(moves::Step, Instant)>>> = Arc::default();
        // The table-sync copy, as fast as the hosts go (the mover's is timed below).
        let mut opts = MoveOptions::default().subscription_copy();
        let seen = Arc::clone(&steps);
        opts.progress = Some(Arc::new(move |p: &moves::MoveProgress| {
            if let moves::MoveProgress::Step { step, .. } = p {
                seen.lock().unwrap().push((*step, Instant::now()));
            }
        }));
        let report = moves::run(&config, LogicalShard::bounded(0)?, &HostName::new("pg2")?, &opts).await?;
        let whole = t.elapsed();
        let at = |s: moves::Step| steps.lock().unwrap().iter().find(|(x, _)| *x == s).map(|(_, t)| *t);
        let copy_span = (at(moves::Step::Prepared), at(moves::Step::CaughtUp));
        let copy = Duration::from_millis(report.copy_ms);
        let moved = format!("shard_0000_moved_{}", report.id);
        kit.create_database("bench_dump").await?;
        let dump = format!(
            "pg_dump --no-owner --no-privileges -n {moved} '{}' | psql -q -v ON_ERROR_STOP=1 '{}' >/dev/null",
            kit.hosts()[0].url("bench_moves"),
            kit.hosts()[2].url("bench_dump")
        );
        let rival_start = Instant::now();
        let t = Instant::now();
        let status = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&dump)
            .env("PATH", format!("/usr/lib/postgresql/15/bin:{}", std::env::var("PATH").unwrap_or_default()))
            .status()
            .await?;
        let rival = t.elapsed();
        let rival_end = Instant::now();
        let samples = sampler.finish();
        assert!(status.success(), "pg_dump | psql failed");
        let restored: i64 = kit.hosts()[2]
        .connect("bench_dump")
        .await?
        .query_one(
            &format!("SELECT (SELECT count(*) FROM {moved}.photos) + (SELECT count(*) FROM {moved}.likes) + (SELECT count(*) FROM {moved}.comments)"),
            &[],
        )
        .await?
        .get(0);
        assert_eq!(restored, report.rows);
        let mb = |d: Duration| report.bytes as f64 / 1e6 / d.as_secs_f64();
        println!("copy: {} rows, {:.1} MB (tables and indexes)", report.rows, report.bytes as f64 / 1e6);
        println!(
            "  move's initial copy      {:>10}  {:>7.1} MB/s  {:>9.0} rows/s",
            ms(copy),
            mb(copy),
            report.rows as f64 / copy.as_secs_f64()
        );
        println!("  pg_dump -n | psql        {:>10}  {:>7.1} MB/s", ms(rival), mb(rival));
        println!(
            "  ratio (rival time / copy time): {:.2}x (goal >= 1x)",
            rival.as_secs_f64() / copy.as_secs_f64()
        );
        println!("  whole move, pre-flight to clean-up: {}, write pause {} ms", ms(whole), report.pause_ms);
        // The mover's own copy (`--max-rate 0`: one snapshot, two streams, no cap), the same
        // shard moved on from pg2 to pg1 (the rival's source host, the same data).
        let mut streamed = MoveOptions::default();
        streamed.max_rate = Some(0);
        let back = moves::run(&config, LogicalShard::bounded(0)?, &HostName::new("pg1")?, &streamed).await?;
        let copy2 = Duration::from_millis(back.copy_ms);
        println!(
            "  move's copy, the mover's streams (--max-rate 0, pg2 -> pg1) {:>10}  {:>7.1} MB/s; rival / it: {:.2}x",
            ms(copy2),
            mb(copy2),
            rival.as_secs_f64() / copy2.as_secs_f64()
        );
        if let (Some(from), Some(to)) = copy_span
            && let (Some(c), Some(r)) = (samples.window(from, to), samples.window(rival_start, rival_end))
        {
            println!(
                "  (the move's span below: from `prepared` to `caught_up`, so subscribing and catching up too)"
            );
            cpu::print_side_by_side(["move's copy", "pg_dump | psql"], [&c, &r]);
        }
        if copy_only {
            return Ok(());
        }

        // 2. The write pause under a steady load on the moving shard, at two sizes.
        let small = photos / 10;
        fill(&pg1, 1, i64::from(count), small).await?;
        println!("write pause under load: 4 writers x {rate}/s on the moving shard");
        println!(
            "  {:>8} {:>9}  {:>9} {:>9} {:>9}   {:>9} {:>9} {:>9}  {:>12}",
            "rows", "MB", "p50", "p99", "max", "p50", "p99", "max", "fence->flip"
        );
        println!("  {:>8} {:>9}  {:^29}   {:^29}", "", "", "no move", "during the move");
        for (shard, to) in [(1u16, "pg2"), (0, "pg3")] {
            let stop = Arc::new(AtomicBool::new(false));
            let load = writers(&cluster, i64::from(count), i64::from(shard), rate, &stop);
            tokio::time::sleep(Duration::from_secs(2)).await;
            let move_start = Instant::now();
            let r = moves::run(
                &config,
                LogicalShard::bounded(i64::from(shard))?,
                &HostName::new(to)?,
                &MoveOptions::default().subscription_copy(),
            )
            .await?;
            let move_end = Instant::now();
            tokio::time::sleep(Duration::from_millis(500)).await;
            stop.store(true, Ordering::Relaxed);
            let mut all = Vec::new();
            for w in load {
                all.extend(w.await?);
            }
            let mut before: Vec<Duration> =
                all.iter().filter(|(t, _)| *t < move_start).map(|x| x.1).collect();
            let mut during: Vec<Duration> =
                all.iter().filter(|(t, _)| *t >= move_start && *t <= move_end).map(|x| x.1).collect();
            println!(
                "  {:>8} {:>9.1}  {:>9} {:>9} {:>9}   {:>9} {:>9} {:>9}  {:>9} ms{}",
                r.rows,
                r.bytes as f64 / 1e6,
                ms(pct(&mut before, 0.5)),
                ms(pct(&mut before, 0.99)),
                ms(pct(&mut before, 1.0)),
                ms(pct(&mut during, 0.5)),
                ms(pct(&mut during, 0.99)),
                ms(pct(&mut during, 1.0)),
                r.pause_ms,
                if r.pause_ms < 100 { "  (goal < 100 ms: met)" } else { "  (goal < 100 ms: missed)" }
            );
        }

        // 2b. A revert after the flip against moving the shard back with a new copy: shard 0
        // (on pg3 now) moves to pg1 revertible, takes writes there, is reverted to pg3, then
        // moved back to pg1 by a plain move (the rival: same shard, same writers, same hosts).
        {
            let stop = Arc::new(AtomicBool::new(false));
            let load = writers(&cluster, i64::from(count), 0, rate, &stop);
            let shard = LogicalShard::bounded(0)?;
            let timed = |to: &'static str, opts: MoveOptions, revert: bool| {
                let config = config.clone();
                async move {
                    let t = Instant::now();
                    let r = if revert {
                        moves::revert(&config, shard, &opts).await?
                    } else {
                        moves::run(&config, shard, &HostName::new(to)?, &opts).await?
                    };
                    Ok::<_, BoxError>((t.elapsed(), r))
                }
            };
            // Both copies by the table-sync workers, uncapped, as when this was first measured.
            let fast = || MoveOptions::default().subscription_copy();
            let (fwd, f) = timed("pg1", fast().revertible(), false).await?;
            tokio::time::sleep(Duration::from_secs(2)).await;
            let (back, b) = timed("pg3", fast(), true).await?;
            tokio::time::sleep(Duration::from_secs(2)).await;
            let (plain, p) = timed("pg1", fast(), false).await?;
            stop.store(true, Ordering::Relaxed);
            for w in load {
                w.await?;
            }
            println!(
                "revert after the flip: shard 0 ({} rows, {:.1} MB), 4 writers x {rate}/s on it throughout",
                b.rows,
                b.bytes as f64 / 1e6
            );
            println!("  {:>40} {:>10} {:>12}", "", "whole", "write pause");
            for (name, d, r) in [
                ("move pg3 -> pg1, --revertible", fwd, &f),
                ("revert pg1 -> pg3 (old copy, no copy)", back, &b),
                ("rival: move pg3 -> pg1 (a new copy)", plain, &p),
            ] {
                println!("  {name:>40} {:>10} {:>9} ms", ms(d), r.pause_ms);
            }
            println!(
                "  revert / rival: {:.2}x faster; the revertible move / the plain one: {:.2}x the time",
                plain.as_secs_f64() / back.as_secs_f64(),
                fwd.as_secs_f64() / plain.as_secs_f64()
            );
        }
    }

    // 3. Gentle on the source: writers to another shard of the source, with no move, then
    // during a move's copy (a shard as big as the first).
    let mut by_host: std::collections::BTreeMap<String, Vec<i64>> = std::collections::BTreeMap::new();
    // Shards 0 and 1 hold the sections above's data.
    for s in 2..i64::from(count) {
        by_host
            .entry(cluster.route(LogicalShard::bounded(s)?)?.host.as_str().to_owned())
            .or_default()
            .push(s);
    }
    let Some((source, shards)) = by_host.iter().find(|(_, v)| v.len() >= 2) else {
        println!("gentle on the source: no host holds two shards; skipped");
        return Ok(());
    };
    let (moving, staying) = (shards[0], shards[1]);
    let target = ["pg1", "pg2", "pg3"].into_iter().find(|h| h != source).unwrap_or("pg2");
    let src =
        kit.hosts()[source.trim_start_matches("pg").parse::<usize>()? - 1].connect("bench_moves").await?;
    let pinned = std::env::var("SHARDLINE_BENCH_PIN").is_ok_and(|v| v == "1");
    if pinned {
        if kit.backend() != shardline_testkit::BackendKind::Local {
            return Err("SHARDLINE_BENCH_PIN=1 needs SHARDLINE_TEST_BACKEND=local".into());
        }
        let dst =
            kit.hosts()[target.trim_start_matches("pg").parse::<usize>()? - 1].connect("bench_moves").await?;
        pin_server(&src, 0).await?;
        pin_server(&dst, 1).await?;
        pin(i32::try_from(std::process::id())?, 0, true)?;
        println!(
            "gentle on the source: pinned: {source} and the writers on core 0, {target} and the mover on core 1"
        );
    }
    fill(&src, moving, i64::from(count), photos).await?;
    // Neither the fill's autovacuum nor its checkpoint inside the baseline or the copy.
    let s = format!("shard_{moving:04}");
    src.batch_execute(&format!("VACUUM {s}.photos, {s}.likes, {s}.comments")).await?;
    src.batch_execute("CHECKPOINT").await?;
    // Each variant: 5 s of writers with no move, then the move; the shard then goes back
    // to the source (a plain move, not measured) and is vacuumed and checkpointed again.
    println!(
        "gentle on the source: 4 writers x {rate}/s on shard {staying} (stays on {source}) while shard {moving} is copied from {source} to {target}"
    );
    println!(
        "  {:>34} {:>7} {:>10} {:>10} {:>10}  {:>10} {:>9}",
        "", "writes", "p50", "p99", "max", "copy", "p99 ratio"
    );
    let variants: [(&str, Option<u64>); 7] = [
        ("subscription's copy", None),
        ("mover, --max-rate 0 (no cap)", Some(0)),
        ("mover, --max-rate 40", Some(40_000_000)),
        ("mover, --max-rate 20", Some(20_000_000)),
        ("mover, --max-rate 10", Some(10_000_000)),
        ("mover, --max-rate 5", Some(5_000_000)),
        ("mover, --max-rate 2", Some(2_000_000)),
    ];
    for (name, max_rate) in variants {
        let stop = Arc::new(AtomicBool::new(false));
        let load = writers(&cluster, i64::from(count), staying, rate, &stop);
        tokio::time::sleep(Duration::from_secs(5)).await;
        let steps: Arc<std::sync::Mutex<Vec<(moves::Step, Instant)>>> = Arc::default();
        let seen = Arc::clone(&steps);
        let mut opts = MoveOptions::default();
        opts.max_rate = max_rate;
        opts.progress = Some(Arc::new(move |p: &moves::MoveProgress| {
            if let moves::MoveProgress::Step { step, .. } = p {
                seen.lock().unwrap().push((*step, Instant::now()));
            }
        }));
        let move_start = Instant::now();
        // The mover on a thread and a runtime of its own, as `shardline move` in its own
        // process: the mover's copy passes every row through it, and that work must not
        // be counted as the writers' latency.
        let r = {
            let (config, target) = (config.clone(), HostName::new(target)?);
            std::thread::spawn(move || {
                if pinned {
                    pin_this_thread(1).unwrap();
                }
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(moves::run(&config, LogicalShard::bounded(moving).unwrap(), &target, &opts))
            })
            .join()
            .unwrap()?
        };
        stop.store(true, Ordering::Relaxed);
        let at = |s: moves::Step| steps.lock().unwrap().iter().find(|(x, _)| *x == s).map(|(_, t)| *t);
        let (from, to) = (
            at(moves::Step::Prepared).unwrap_or(move_start),
            at(moves::Step::CaughtUp).unwrap_or(move_start),
        );
        let mut all = Vec::new();
        for w in load {
            all.extend(w.await?);
        }
        let mut before: Vec<Duration> = all.iter().filter(|(t, _)| *t < move_start).map(|x| x.1).collect();
        let mut during: Vec<Duration> =
            all.iter().filter(|(t, _)| *t >= from && *t <= to).map(|x| x.1).collect();
        let ratio = pct(&mut during, 0.99).as_secs_f64() / pct(&mut before, 0.99).as_secs_f64().max(1e-9);
        for (label, v) in [("no move (5 s)", &mut before), (name, &mut during)] {
            let n = v.len();
            print!(
                "  {label:>34} {n:>7} {:>10} {:>10} {:>10}",
                ms(pct(v, 0.5)),
                ms(pct(v, 0.99)),
                ms(pct(v, 1.0))
            );
            if label == name {
                println!(
                    "  {:>10} {ratio:>8.2}x{}",
                    ms(Duration::from_millis(r.copy_ms)),
                    if ratio <= 2.0 { " (goal <= 2x: met)" } else { " (goal <= 2x: missed)" }
                );
            } else {
                println!();
            }
        }
        // The mover's copy of the rows is the step to `copying`; the index builds and the
        // catch-up follow, to `caught_up`.
        if max_rate.is_some()
            && let Some(rows_done) = at(moves::Step::Copying)
        {
            let base = pct(&mut before, 0.99).as_secs_f64().max(1e-9);
            for (label, a, b) in
                [("  the rows' copy alone", from, rows_done), ("  indexes and catch-up", rows_done, to)]
            {
                let mut v: Vec<Duration> =
                    all.iter().filter(|(t, _)| *t >= a && *t <= b).map(|x| x.1).collect();
                let n = v.len();
                println!(
                    "  {label:>34} {n:>7} {:>10} {:>10} {:>10}  {:>10} {:>8.2}x",
                    ms(pct(&mut v, 0.5)),
                    ms(pct(&mut v, 0.99)),
                    ms(pct(&mut v, 1.0)),
                    ms(b.saturating_duration_since(a)),
                    pct(&mut v, 0.99).as_secs_f64() / base
                );
            }
        }
        println!("  {:>34} ({} rows, {:.1} MB)", "", r.rows, r.bytes as f64 / 1e6);
        moves::run(
            &config,
            LogicalShard::bounded(moving)?,
            &HostName::new(source)?,
            &MoveOptions::default().subscription_copy(),
        )
        .await?;
        src.batch_execute(&format!("VACUUM {s}.photos, {s}.likes, {s}.comments")).await?;
        src.batch_execute("CHECKPOINT").await?;
    }
    Ok(())
}

/// Pins process `pid` (with `all`, each of its threads) to core `cpu` with `taskset`.
fn pin(pid: i32, cpu: usize, all: bool) -> Result<(), BoxError> {
    let (cpu, pid) = (cpu.to_string(), pid.to_string());
    let mut args = vec!["-p", "-c", &cpu, &pid];
    if all {
        args.insert(0, "-a");
    }
    let out = std::process::Command::new("taskset").args(&args).output()?;
    if !out.status.success() {
        return Err(format!("taskset {args:?}: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(())
}

/// Pins the calling thread to core `cpu`.
fn pin_this_thread(cpu: usize) -> Result<(), BoxError> {
    // `/proc/thread-self` links to `<pid>/task/<tid>`.
    let link = std::fs::read_link("/proc/thread-self")?;
    let tid = link.file_name().and_then(|t| t.to_str()).ok_or("no thread id")?.parse()?;
    pin(tid, cpu, false)
}

/// The parent of process `pid`, from `/proc/<pid>/stat`.
fn parent(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: the fields after it.
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

/// Pins a local server (its postmaster, so the backends it starts from now on, and every
/// process it runs now) to core `cpu`: the server `client` is connected to.
async fn pin_server(client: &tokio_postgres::Client, cpu: usize) -> Result<(), BoxError> {
    let backend: i32 = client.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
    let postmaster = parent(backend).ok_or("no postmaster")?;
    pin(postmaster, cpu, false)?;
    for entry in std::fs::read_dir("/proc")? {
        let Some(pid) = entry?.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else { continue };
        if parent(pid) == Some(postmaster) {
            // A process may end between the listing and the pin.
            let _ = pin(pid, cpu, false);
        }
    }
    Ok(())
}
