//! Parallel moves: the same 8-move rebalance, run one move at a time and then two at a
//! time between disjoint host pairs (`rebalance --apply --parallel 2`), each on its own
//! copy of the same data, on 4 real hosts. 16 shards start on pg1 and pg2; pg3 and pg4
//! join empty; the plan moves 8 shards. Prints the wall time of each beside the other
//! as a ratio, and the sum of the moves' copy and pause times.
//!
//! ```text
//! SHARDLINE_TEST_BACKEND=local cargo bench -p shardline-tests --bench rebalance [-- PHOTOS ROUNDS]
//! ```
use std::path::PathBuf;
use std::time::{Duration, Instant};

use shardline_ops::Options;
use shardline_ops::moves::MoveOptions;
use shardline_ops::rebalance::{self, Parallel};

#[path = "common/mod.rs"]
mod common;
#[path = "common/fill.rs"]
mod fill;
use common::{BoxError, config, config_of};
use fill::fill;

const SHARDS: u16 = 16;

/// One rebalance of a fresh copy of the data in database `db`: (wall time, sum of the
/// moves' copy and pause times, bytes moved).
async fn one(
    kit: &shardline_testkit::Cluster,
    db: &str,
    photos: i64,
    parallel: usize,
) -> Result<(Duration, Duration, i64), BoxError> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    kit.create_database(db).await?;
    let two = config_of(kit, 2, db, SHARDS, &dir)?;
    shardline_ops::init(&two, &Options::default(), &|_| {}).await?;
    for h in &kit.hosts()[..2] {
        let c = h.connect(db).await?;
        for shard in 0..i64::from(SHARDS) {
            let here: bool = c
                .query_one(&format!("SELECT to_regnamespace('shard_{shard:04}') IS NOT NULL"), &[])
                .await?
                .get(0);
            if here {
                fill(&c, shard, i64::from(SHARDS), photos).await?;
            }
        }
    }
    let four = config(kit, db, SHARDS, &dir)?;
    shardline_ops::init(&four, &Options::default(), &|_| {}).await?;
    // The same start for every run: nothing left for autovacuum, nothing dirty.
    for h in kit.hosts() {
        let c = h.connect(db).await?;
        c.batch_execute("VACUUM ANALYZE").await?;
        c.batch_execute("CHECKPOINT").await?;
    }
    let plan = rebalance::plan(&four, 8).await?;
    assert_eq!(plan.moves.len(), 8, "{plan}");
    let t = Instant::now();
    let results = rebalance::apply(
        &four,
        &plan,
        Parallel::disjoint(parallel),
        &MoveOptions::default().subscription_copy(),
    )
    .await;
    let wall = t.elapsed();
    let mut own = Duration::ZERO;
    let mut bytes = 0;
    for (m, r) in results {
        let r = r.map_err(|e| format!("move of shard {} to {}: {e}", m.shard, m.to))?;
        own += Duration::from_millis(r.copy_ms) + Duration::from_millis(r.pause_ms);
        bytes += r.bytes;
    }
    // Each run's database goes, so the next one shares the hosts with nothing.
    for h in kit.hosts() {
        h.connect("postgres").await?.batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)")).await?;
    }
    Ok((wall, own, bytes))
}

/// The median; of an even count, the mean of the middle two.
fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    let n = v.len();
    if n.is_multiple_of(2) { (v[n / 2 - 1] + v[n / 2]) / 2 } else { v[n / 2] }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let photos: i64 = args.first().map_or(Ok(50_000), |a| a.parse())?;
    let rounds: usize = args.get(1).map_or(Ok(2), |a| a.parse())?;
    if rounds == 0 {
        return Err("ROUNDS must be at least 1".into());
    }
    let kit = shardline_testkit::Cluster::start(4).await?;
    println!(
        "rebalance of 8 moves, 16 shards of {photos} photos, {photos} likes and {photos} comments each; 4 hosts; {:?} backend",
        kit.backend()
    );
    println!(
        "{:>6} {:>22} {:>12} {:>16} {:>10}",
        "round", "moves at a time", "wall", "copy+pause, summed", "MB moved"
    );
    let mut serial = Vec::new();
    let mut parallel = Vec::new();
    for round in 0..rounds {
        // Alternate which runs first.
        let order: [usize; 2] = if round.is_multiple_of(2) { [1, 2] } else { [2, 1] };
        for p in order {
            let (wall, own, bytes) = one(&kit, &format!("bench_rebalance_{round}_{p}"), photos, p).await?;
            println!(
                "{round:>6} {:>22} {:>9.2} s {:>13.2} s {:>10.1}",
                if p == 1 { "1".to_owned() } else { format!("{p}, disjoint pairs") },
                wall.as_secs_f64(),
                own.as_secs_f64(),
                bytes as f64 / 1e6
            );
            if p == 1 { serial.push(wall) } else { parallel.push(wall) }
        }
    }
    let (s, p) = (median(serial), median(parallel));
    println!(
        "median wall: serial {:.2} s, parallel {:.2} s: parallel takes {:.2}x the serial time",
        s.as_secs_f64(),
        p.as_secs_f64(),
        p.as_secs_f64() / s.as_secs_f64()
    );
    kit.shutdown().await?;
    Ok(())
}
