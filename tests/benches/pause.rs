//! The write pause of a move (fence → flip) against the shard's size, under a steady
//! write load through the repository, with the change log's verification (the default:
//! the whole shard compared before the fence, only the keys written since read inside
//! it) beside the full verification inside the fence (`Verification::Full`), the rival,
//! on the same shard in the same run, printed as a ratio. Also: what the change log's
//! triggers cost a writer (a batch insert with and without them).
//!
//! ```text
//! SHARDLINE_TEST_BACKEND=local cargo bench -p shardline-tests --bench pause [-- 100000,1000000]
//! ```
//! The argument lists shard sizes in photos (each with a like and a comment: rows = 3×).
#![expect(clippy::unwrap_used, reason = "a benchmark")]
#![expect(clippy::cast_precision_loss, reason = "ratios of durations and sizes")]

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use shardline_example_photos::{NewPhoto, Photo};
use shardline_ops::Options;
use shardline_ops::moves::{self, MoveOptions, Step, Verification};
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

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One move of `shard` to `to` under the write load; the report and the slowest write
/// that started during the move.
async fn one_move(
    config: &shardline_router::Config,
    cluster: &Cluster,
    shard: u16,
    to: &str,
    options: &MoveOptions,
) -> Result<(moves::MoveReport, Duration, usize), BoxError> {
    let stop = Arc::new(AtomicBool::new(false));
    let load = writers(cluster, 8, i64::from(shard), 250, &stop);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = Instant::now();
    let r =
        moves::run(config, LogicalShard::bounded(i64::from(shard))?, &HostName::new(to)?, options).await?;
    let end = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let mut during = Vec::new();
    for w in load {
        during.extend(w.await?.into_iter().filter(|(t, _)| *t >= start && *t <= end).map(|x| x.1));
    }
    Ok((r, during.iter().copied().max().unwrap_or_default(), during.len()))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let sizes: Vec<i64> = args
        .first()
        .map_or("100000,1000000", String::as_str)
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let kit = shardline_testkit::Cluster::start(3).await?;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    kit.create_database("bench_pause").await?;
    let config = config(&kit, "bench_pause", 8, &dir)?;
    shardline_ops::init(&config, &Options::default(), &|_| {}).await?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    println!("write pause (fence -> flip) against the shard's size; 3 hosts, {:?} backend", kit.backend());
    println!("4 writers x 250/s through the repository on the moving shard; each shard moved twice:");
    println!(
        "pg1 -> pg2 with the change log (default), then pg2 -> pg3 with the full verification in the fence"
    );
    println!(
        "  {:>9} {:>9}  {:>10} {:>10} {:>9} {:>11}  {:>10} {:>11}  {:>7}",
        "photos", "rows", "pause", "compare", "recheck", "slowest wr", "full pause", "slowest wr", "ratio"
    );
    for (i, &n) in sizes.iter().enumerate() {
        let shard = u16::try_from(i).unwrap();
        let on = cluster.route_user(i64::from(shard)).host.to_string();
        let idx = match on.as_str() {
            "pg1" => 0,
            "pg2" => 1,
            _ => 2,
        };
        let c = kit.hosts()[idx].connect("bench_pause").await?;
        let (a, b) = (format!("pg{}", (idx + 1) % 3 + 1), format!("pg{}", (idx + 2) % 3 + 1));
        let (a, b) = (a.as_str(), b.as_str());
        let c = &c;
        fill(c, i64::from(shard), 8, n).await?;
        let (log, log_slow, log_writes) =
            one_move(&config, &cluster, shard, a, &MoveOptions::default().subscription_copy()).await?;
        let full_opts = MoveOptions::default().subscription_copy().verifying(Verification::Full);
        let (full, full_slow, _) = one_move(&config, &cluster, shard, b, &full_opts).await?;
        println!(
            "  {:>9} {:>9}  {:>7} ms {:>7} ms {:>9} {:>8.1} ms  {:>7} ms {:>8.1} ms  {:>6.1}x   ({log_writes} writes during the move)",
            n,
            log.rows,
            log.pause_ms,
            log.compare_ms,
            log.rechecked_rows,
            ms(log_slow),
            full.pause_ms,
            ms(full_slow),
            full.pause_ms as f64 / log.pause_ms.max(1) as f64,
        );
        // What the journal says of the change log's move: its rounds before the fence
        // and where the pause went.
        let detail = moves::list(&config).await?.into_iter().find(|m| m.id == log.id).map(|m| m.detail);
        if let Some(d) = detail {
            if let Some(pre) = &d.precheck {
                let rounds: Vec<String> =
                    pre.rounds.iter().map(|r| format!("{} keys/{} ms", r.keys, r.ms)).collect();
                println!(
                    "      rounds before the fence: {} ({}); {} keys left for the fence",
                    pre.rounds.len(),
                    rounds.join(", "),
                    pre.rounds.last().map_or(0, |r| r.pending)
                );
            }
            let steps: Vec<String> =
                d.pause_steps.iter().map(|(what, us)| format!("{what} {:.1}", *us as f64 / 1e3)).collect();
            println!("      pause (ms): {}", steps.join(", "));
        }
    }

    // What the triggers cost a writer: the same batch inserts with the change log
    // running (a move stopped once caught up) and without (the move undone).
    let shard = 7u16;
    let photos = cluster.repo::<Photo>()?;
    let batch: Vec<NewPhoto> = (0..1000u64)
        .map(|k| NewPhoto::numbered(i64::from(shard) + 8 * i64::try_from(k % 100).unwrap(), k))
        .collect();
    let time_batches = || async {
        let t = Instant::now();
        for _ in 0..20 {
            photos.insert_many(&batch).await.unwrap();
        }
        let many = t.elapsed();
        let t = Instant::now();
        for k in 0..1000 {
            photos.insert(&NewPhoto::numbered(i64::from(shard), k)).await.unwrap();
        }
        (many, t.elapsed())
    };
    let (base_many, base_one) = time_batches().await;
    let to = if cluster.route_user(i64::from(shard)).host.as_str() == "pg1" { "pg2" } else { "pg1" };
    let moving = LogicalShard::bounded(i64::from(shard))?;
    let _ = moves::run(
        &config,
        moving,
        &HostName::new(to)?,
        &MoveOptions::default().subscription_copy().stopping_after(Step::CaughtUp),
    )
    .await;
    let (log_many, log_one) = time_batches().await;
    moves::abort(&config, moving, &MoveOptions::default()).await?;
    println!("the change log's cost to writers (shard {shard}, same process, same connections):");
    println!(
        "  20 x insert_many(1000): {:.0} ms without, {:.0} ms with the triggers: {:.2}x",
        ms(base_many),
        ms(log_many),
        log_many.as_secs_f64() / base_many.as_secs_f64()
    );
    println!(
        "  1000 x insert:          {:.0} ms without, {:.0} ms with the triggers: {:.2}x",
        ms(base_one),
        ms(log_one),
        log_one.as_secs_f64() / base_one.as_secs_f64()
    );
    Ok(())
}
