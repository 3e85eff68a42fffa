//! One application process of `pooler::` tests: inserts photos through a config's
//! cluster and prints what happened, so that two of these share a pooler's server
//! connections as two real processes do (the driver's statement names are unique per
//! process only: two handles in one process cannot collide on a name).
//!
//! `pooler-load CONFIG SHARDS FIRST ROUNDS`: inserts `ROUNDS` photos, the n-th for a
//! user of shard `(FIRST + n) % SHARDS`, and prints `ok failed misrouted` and then one
//! line per distinct error.
#![allow(clippy::print_stdout, reason = "the parent test reads stdout")]

use std::collections::BTreeSet;
use std::path::Path;

use shardline_example_photos::{NewPhoto, Photo};
use shardline_repo::{Cluster, ClusterOptions, Error};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    let [_, config, shards, first, rounds] = args.as_slice() else {
        return Err("usage: pooler-load CONFIG SHARDS FIRST ROUNDS".into());
    };
    let (shards, first, rounds): (i64, i64, i64) = (shards.parse()?, first.parse()?, rounds.parse()?);
    let path = Path::new(config);
    let text = std::fs::read_to_string(path)?;
    let base = path.parent().unwrap_or(Path::new("."));
    let config = shardline_router::Config::from_toml(&text, config, base, &|v| std::env::var(v).ok())?;
    let cluster = Cluster::connect(
        &config,
        ClusterOptions { pool_size: 4, statement_cache: 1024, ..ClusterOptions::default() },
    )
    .await?;
    let photos = cluster.repo::<Photo>()?;
    let (mut ok, mut failed, mut misrouted) = (0, 0, 0);
    let mut errors = BTreeSet::new();
    for n in 0..rounds {
        let user = (first + n) % shards + shards * (n + 1);
        let new =
            NewPhoto { user_id: user, url: format!("https://cdn/{user}/{n}.jpg"), caption: String::new() };
        match photos.insert(&new).await {
            Ok(_) => ok += 1,
            Err(e) => {
                failed += 1;
                if matches!(e, Error::Misrouted { .. }) {
                    misrouted += 1;
                }
                errors.insert(e.to_string().chars().take(200).collect::<String>());
            }
        }
    }
    println!("{ok} {failed} {misrouted}");
    for e in errors {
        println!("{e}");
    }
    Ok(())
}
