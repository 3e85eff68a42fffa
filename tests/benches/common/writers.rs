//! The benchmarks' writers through the repository (moves and pause).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use shardline_example_photos::{NewPhoto, Photo};
use shardline_repo::Cluster;

/// Writers inserting photos for the users of `shard` (of `count`), `rate` a second each,
/// until `stop`; every write's start and latency.
pub(crate) fn writers(
    cluster: &Cluster,
    count: i64,
    shard: i64,
    rate: u32,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Vec<(Instant, Duration)>>> {
    (0..4i64)
        .map(|w| {
            let (cluster, stop) = (cluster.clone(), stop.clone());
            tokio::spawn(async move {
                let photos = cluster.repo::<Photo>().unwrap();
                let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut out = Vec::new();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    let t = Instant::now();
                    photos
                        .insert(&NewPhoto::numbered(
                            shard + count * (w * 100 + i64::try_from(n % 100).unwrap()),
                            n,
                        ))
                        .await
                        .unwrap();
                    out.push((t, t.elapsed()));
                    n += 1;
                }
                out
            })
        })
        .collect()
}
