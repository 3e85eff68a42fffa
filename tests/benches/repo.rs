//! The repository API beside what it replaces, run in the same process on 4 real hosts:
//!
//! - a routed `get` by ID vs a direct tokio-postgres prepared query on the right host
//!   (the routing, pool and statement-cache overhead; goal ≤ 1.05× the latency);
//! - `get_many` of 100 IDs spread over every host vs a loop of 100 single gets (goal
//!   ≥ 10× faster);
//! - the time-window fan-out over every host vs the same reads one shard at a time, with
//!   rows per second;
//! - gets by ID through PgBouncer in `pool_mode = transaction` (one per host, the
//!   installed `pgbouncer` or `SHARDLINE_PGBOUNCER`) vs direct connections: latency one
//!   at a time, and throughput with 8 concurrent callers.
//!
//! ```text
//! SHARDLINE_TEST_BACKEND=local cargo bench -p shardline-tests --bench repo [-- SHARDS ROWS]
//! ```
#![expect(clippy::unwrap_used, reason = "a benchmark")]

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use shardline_example_photos::{NewPhoto, Photo};
use shardline_ops::Options;
use shardline_repo::{Cluster, ClusterOptions, Entity as _, Id};
use shardline_router::HostName;
use shardline_testkit::pgbouncer::{Pgbouncer, PoolMode};
use tokio_postgres::{Client, Statement};

#[path = "common/mod.rs"]
mod common;
use common::{BoxError, config};

/// The median of some timings.
fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let shards: u16 = args.first().map_or(Ok(256), |a| a.parse())?;
    let rows: i64 = args.get(1).map_or(Ok(40_000), |a| a.parse())?;
    let hosts = 4;
    let kit = shardline_testkit::Cluster::start(hosts).await?;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    kit.create_database("bench_repo").await?;
    let config = config(&kit, "bench_repo", shards, &dir)?;
    shardline_ops::init(&config, &Options::default(), &|_| {}).await?;
    let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
    let photos = cluster.repo::<Photo>()?;
    let start = SystemTime::now() - Duration::from_secs(1);
    let mut ids = Vec::new();
    for chunk in (0..rows).collect::<Vec<_>>().chunks(10_000) {
        let batch: Vec<NewPhoto> =
            chunk.iter().map(|&i| NewPhoto::numbered(i % 5000, u64::try_from(i).unwrap())).collect();
        ids.extend(photos.insert_many(&batch).await?.into_iter().map(|p| p.id));
    }
    let end = SystemTime::now() + Duration::from_secs(1);
    println!(
        "repo: {shards} shards, {rows} photos over {hosts} hosts, {} backend, {} cores\n",
        kit.backend(),
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
    );

    // The rival's connections: one per host, statements prepared per schema ahead.
    let mut direct: HashMap<HostName, Client> = HashMap::new();
    for (i, h) in config.hosts.iter().enumerate() {
        direct.insert(h.name.clone(), kit.hosts()[i].connect("bench_repo").await?);
    }
    let columns = Photo::COLUMNS.join(", ");
    let mut prepared: HashMap<u16, Statement> = HashMap::new();
    for &id in &ids[..2000] {
        let route = cluster.route_id(id)?;
        if let std::collections::hash_map::Entry::Vacant(e) = prepared.entry(route.shard.get()) {
            let sql = format!("SELECT {columns} FROM {}.photos WHERE id = $1", route.schema.quoted());
            e.insert(direct[&route.host].prepare(&sql).await?);
        }
    }
    let sample: Vec<Id> = ids.iter().step_by(ids.len() / 2000).copied().take(2000).collect();
    let kept =
        Cluster::connect(&config, ClusterOptions { statement_cache: 1024, ..ClusterOptions::default() })
            .await?
            .repo::<Photo>()?;
    for &id in &sample {
        photos.get(id).await?; // warm the pool and the statement caches
        kept.get(id).await?;
    }

    // 1. One get by ID: alternate rounds of the two, the median round per call.
    let (mut ours, mut theirs, mut cached) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..7 {
        let t = Instant::now();
        for &id in &sample {
            assert!(photos.get(id).await?.is_some());
        }
        ours.push(t.elapsed() / u32::try_from(sample.len())?);
        let t = Instant::now();
        for &id in &sample {
            assert!(kept.get(id).await?.is_some());
        }
        cached.push(t.elapsed() / u32::try_from(sample.len())?);
        let t = Instant::now();
        for &id in &sample {
            let route = cluster.route_id(id)?; // arithmetic on the ID: the rival needs the host too
            let row = direct[&route.host].query_opt(&prepared[&route.shard.get()], &[&id]).await?;
            assert!(row.is_some());
        }
        theirs.push(t.elapsed() / u32::try_from(sample.len())?);
    }
    let (ours, theirs, cached) = (median(ours), median(theirs), median(cached));
    println!("get by ID, one at a time (median of 7 rounds of {}):", sample.len());
    println!("  {:<56}{:>10}", "rival: tokio-postgres, prepared, on the right host", us(theirs));
    println!(
        "  {:<56}{:>10}   {:.3}x its latency",
        "shardline Repo::get (decode, route, pool, unnamed)",
        us(ours),
        ours.as_secs_f64() / theirs.as_secs_f64()
    );
    println!(
        "  {:<56}{:>10}   {:.3}x its latency",
        "shardline Repo::get, statement_cache = 1024",
        us(cached),
        cached.as_secs_f64() / theirs.as_secs_f64()
    );

    // 2. 100 IDs spread over every host: one get_many vs a loop of gets.
    let batches: Vec<Vec<Id>> = sample.chunks(100).map(<[Id]>::to_vec).collect();
    let (mut many, mut looped) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let t = Instant::now();
        for b in &batches {
            let got = photos.get_many(b).await?;
            assert!(got.missing.is_empty());
        }
        many.push(t.elapsed() / u32::try_from(batches.len())?);
        let t = Instant::now();
        for b in &batches {
            for &id in b {
                assert!(photos.get(id).await?.is_some());
            }
        }
        looped.push(t.elapsed() / u32::try_from(batches.len())?);
    }
    let (many, looped) = (median(many), median(looped));
    println!("\n100 IDs over {hosts} hosts (median of 3 rounds of {} batches):", batches.len());
    println!("  {:<56}{:>10}", "rival: a loop of 100 Repo::get", us(looped));
    println!(
        "  {:<56}{:>10}   {:.1}x faster",
        "shardline Repo::get_many (one statement per host)",
        us(many),
        looped.as_secs_f64() / many.as_secs_f64()
    );

    // 3. The time window across every shard: the fan-out vs one shard at a time.
    let limit = usize::try_from(rows)?;
    let t = Instant::now();
    let all = photos.created_between(start, end, limit).await?;
    let fan = t.elapsed();
    assert!(all.is_complete());
    assert_eq!(all.rows.len(), limit);
    let t = Instant::now();
    let mut n = 0;
    let layout = cluster.layout();
    let (lo, hi) = (
        i64::from(
            layout.min_id_at(i64::try_from(start.duration_since(SystemTime::UNIX_EPOCH)?.as_millis())?)?,
        ),
        i64::from(layout.max_id_at(i64::try_from(end.duration_since(SystemTime::UNIX_EPOCH)?.as_millis())?)?),
    );
    let map = cluster.map();
    for shard in map.hosts().iter().flat_map(|h| map.shards_of(h)) {
        let route = cluster.route(shard)?;
        let sql = format!(
            "SELECT {columns} FROM {}.photos WHERE id BETWEEN $1 AND $2 ORDER BY id DESC",
            route.schema.quoted()
        );
        n += direct[&route.host].query(&sql, &[&lo, &hi]).await?.len();
    }
    let serial = t.elapsed();
    assert_eq!(n, limit);
    let rate = |d: Duration| format!("{:.0} rows/s", f64::from(u32::try_from(n).unwrap()) / d.as_secs_f64());
    println!("\ntime window, all {n} rows, merged newest first:");
    println!(
        "  {:<56}{:>10.1} ms   {}",
        "rival: one query per shard, one after another",
        serial.as_secs_f64() * 1e3,
        rate(serial)
    );
    println!(
        "  {:<56}{:>10.1} ms   {}   {:.1}x faster",
        "shardline Repo::created_between (a query per host)",
        fan.as_secs_f64() * 1e3,
        rate(fan),
        serial.as_secs_f64() / fan.as_secs_f64()
    );

    // 4. Behind PgBouncer in transaction mode, one per host, vs direct connections.
    let mut bouncers = Vec::new();
    for h in kit.hosts() {
        bouncers.push(Pgbouncer::start(h, PoolMode::Transaction, 16).await?);
    }
    let mut text = format!(
        "logical_shards = {shards}\ntransaction_pooler = true\n[catalog]\nurl = \"{}\"\n",
        kit.hosts()[0].url("bench_repo")
    );
    for (i, (h, b)) in kit.hosts().iter().zip(&bouncers).enumerate() {
        text.push_str(&format!(
            "[[hosts]]\nname = \"pg{}\"\nurl = \"{}\"\npeer_url = \"{}\"\n",
            i + 1,
            b.url("bench_repo"),
            h.peer_url("bench_repo")
        ));
    }
    let pooled_config = shardline_router::Config::from_toml(&text, "bench-pgbouncer.toml", &dir, &|_| None)?;
    let pooled = Cluster::connect(&pooled_config, ClusterOptions::default()).await?.repo::<Photo>()?;
    for &id in &sample {
        pooled.get(id).await?; // warm the pools
    }
    let (mut via, mut straight) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        for &id in &sample {
            assert!(pooled.get(id).await?.is_some());
        }
        via.push(t.elapsed() / u32::try_from(sample.len())?);
        let t = Instant::now();
        for &id in &sample {
            assert!(photos.get(id).await?.is_some());
        }
        straight.push(t.elapsed() / u32::try_from(sample.len())?);
    }
    let (via, straight) = (median(via), median(straight));
    let (via_rate, straight_rate) =
        (rate_of(&pooled, &sample, 8).await?, rate_of(&photos, &sample, 8).await?);
    println!("\nget by ID through {} (pool_mode = transaction, one per host):", bouncers[0].version());
    println!(
        "  {:<56}{:>10}   {:>8.0} gets/s (8 callers)",
        "shardline Repo::get, direct",
        us(straight),
        straight_rate
    );
    println!(
        "  {:<56}{:>10}   {:>8.0} gets/s (8 callers)   {:.2}x the throughput",
        "shardline Repo::get, through PgBouncer",
        us(via),
        via_rate,
        via_rate / straight_rate
    );
    kit.shutdown().await?;
    Ok(())
}

/// Gets per second of `callers` concurrent loops over `sample`.
async fn rate_of(
    photos: &shardline_repo::Repo<Photo>,
    sample: &[Id],
    callers: usize,
) -> Result<f64, BoxError> {
    let t = Instant::now();
    let runs = (0..callers).map(|_| async move {
        for &id in sample {
            photos.get(id).await?;
        }
        Ok::<_, shardline_repo::Error>(())
    });
    for r in futures::future::join_all(runs).await {
        r?;
    }
    let n = f64::from(u32::try_from(sample.len() * callers)?);
    Ok(n / t.elapsed().as_secs_f64())
}
