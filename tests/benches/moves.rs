//! Moving a shard, beside its rivals, in the same process on 3 real hosts:
//!
//! - copy throughput: the move's initial copy vs `pg_dump -n <schema> | psql` of the
//!   same shard into an empty database (goal ≥ 1×);
//! - the write pause under a steady write load on the moving shard: the fence-to-flip
//!   time the move reports, and the slowest write the writers saw, beside the same
//!   writers' latency with no move (goal < 100 ms).
//!
//! ```text
//! SHARDLINE_TEST_BACKEND=local cargo bench -p shardline-tests --bench moves [-- PHOTOS]
//! ```
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

    // 1. Copy throughput: the move vs pg_dump | psql of the same schema.
    let t = Instant::now();
    let report =
        moves::run(&config, LogicalShard::bounded(0)?, &HostName::new("pg2")?, &MoveOptions::default())
            .await?;
    let whole = t.elapsed();
    let copy = Duration::from_millis(report.copy_ms);
    let moved = format!("shard_0000_moved_{}", report.id);
    kit.create_database("bench_dump").await?;
    let dump = format!(
        "pg_dump --no-owner --no-privileges -n {moved} '{}' | psql -q -v ON_ERROR_STOP=1 '{}' >/dev/null",
        kit.hosts()[0].url("bench_moves"),
        kit.hosts()[2].url("bench_dump")
    );
    let t = Instant::now();
    let status = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(&dump)
        .env("PATH", format!("/usr/lib/postgresql/15/bin:{}", std::env::var("PATH").unwrap_or_default()))
        .status()
        .await?;
    let rival = t.elapsed();
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

    // 2. The write pause under a steady load on the moving shard, at two sizes.
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let small = photos / 10;
    fill(&pg1, 1, i64::from(count), small).await?;
    let rate = 250;
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
            &MoveOptions::default(),
        )
        .await?;
        let move_end = Instant::now();
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for w in load {
            all.extend(w.await?);
        }
        let mut before: Vec<Duration> = all.iter().filter(|(t, _)| *t < move_start).map(|x| x.1).collect();
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
    Ok(())
}
