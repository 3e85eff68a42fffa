//! Fan-outs over every shard, in the same process, on the same data and hosts, beside
//! their rivals (issue 18):
//!
//! - `created_between` with a 100-row result over 2000 shards on 4 hosts: p50/p99 and
//!   the servers' CPU per fan-out per host, for statements of `fan_out_batch` shards
//!   (the default 16; 1, 64, and one statement per host, as before issue 18);
//! - `get_many` of 100 IDs vs a loop of 100 gets, and vs the fair rival: the same IDs
//!   grouped per shard, one `= ANY` statement per shard, all sent at once (pipelined on
//!   one direct connection per host).
//!
//! Variants run in alternation, round after round, so load from other work on the
//! machine falls on all of them alike. Server CPU is the `utime + stime` of the hosts'
//! client backends (`/proc/<pid>/stat`, local backend only), over a run of one variant.
//!
//! ```text
//! SHARDLINE_TEST_BACKEND=local cargo bench -p shardline-tests --bench fanout [-- SHARDS ROUNDS]
//! ```
#![expect(clippy::unwrap_used, reason = "a benchmark")]

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use shardline_example_photos::{NewPhoto, Photo};
use shardline_ops::Options;
use shardline_repo::{Cluster, ClusterOptions, Entity as _, Id, Repo};
use shardline_router::HostName;
use tokio_postgres::Client;
use tokio_postgres::types::Type;

#[path = "common/mod.rs"]
mod common;
use common::{BoxError, config};

fn quantile(v: &[Duration], q: f64) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    let last = v.len().saturating_sub(1);
    // `q` in hundredths: p50 is the middle, p99 the 99th of 100.
    let hundredths = (1..=100_u32).find(|h| f64::from(*h) >= q * 100.0).unwrap_or(100);
    v[(last * usize::try_from(hundredths).unwrap()).div_ceil(100).min(last)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// CPU seconds the client backends of database `db` on every host have used so far.
async fn server_cpu(admins: &[Client], db: &str) -> Result<Option<f64>, BoxError> {
    let tick = 100.0; // USER_HZ on Linux
    let mut total = 0.0;
    for c in admins {
        let pids: Vec<i32> = c
            .query(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend'",
                &[&db],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        for pid in pids {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return Ok(None) };
            // Fields after the command (which ends with ')'): utime is 14th, stime 15th.
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let f: Vec<&str> = rest.split_whitespace().collect();
            let (u, s): (f64, f64) = (f[11].parse()?, f[12].parse()?);
            total += (u + s) / tick;
        }
    }
    Ok(Some(total))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let shards: u16 = args.first().map_or(Ok(2000), |a| a.parse())?;
    let rounds: usize = args.get(1).map_or(Ok(100), |a| a.parse())?;
    let hosts = 4;
    let kit = shardline_testkit::Cluster::start(hosts).await?;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let db = "bench_fanout";
    kit.create_database(db).await?;
    let config = config(&kit, db, shards, &dir)?;
    shardline_ops::init(&config, &Options::default(), &|_| {}).await?;
    let setup = ClusterOptions { host_timeout: Duration::from_secs(120), ..ClusterOptions::default() };
    let base = Cluster::connect(&config, setup.clone()).await?;
    let photos = base.repo::<Photo>()?;
    let start = SystemTime::now() - Duration::from_secs(1);
    let rows = i64::from(shards) * 10;
    let mut ids = Vec::new();
    for chunk in (0..rows).collect::<Vec<_>>().chunks(2000) {
        let batch: Vec<NewPhoto> =
            chunk.iter().map(|&i| NewPhoto::numbered(i, u64::try_from(i).unwrap())).collect();
        ids.extend(photos.insert_many(&batch).await?.into_iter().map(|p| p.id));
    }
    let end = SystemTime::now() + Duration::from_secs(1);
    let mut newest = ids.clone();
    newest.sort_unstable_by(|a, b| b.cmp(a));
    newest.truncate(100);
    println!(
        "fanout: {shards} shards, {rows} photos over {hosts} hosts, {} backend, {} cores, {rounds} rounds\n",
        kit.backend(),
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
    );
    let mut admins = Vec::new();
    for h in kit.hosts() {
        admins.push(h.connect("postgres").await?);
    }

    // 1. created_between, 100 newest rows of the window, per variant.
    // (name, fan_out_batch, statement_cache, fan_out_prepared, generic_plans)
    let variants: Vec<(String, usize, usize, bool, bool)> = vec![
        ("one statement per host, unnamed (before issue 18)".into(), usize::from(shards), 0, false, false),
        ("fan_out_batch = 64, unnamed".into(), 64, 0, false, false),
        ("fan_out_batch = 16, unnamed (fan_out_prepared = false)".into(), 16, 0, false, false),
        ("fan_out_batch = 1 (a statement per shard, pipelined), unnamed".into(), 1, 0, false, false),
        ("fan_out_batch = 16, fan-outs kept (the default)".into(), 16, 0, true, false),
        ("fan_out_batch = 64, fan-outs kept".into(), 64, 0, true, false),
        ("fan_out_batch = 64, fan-outs kept, generic_plans".into(), 64, 0, true, true),
        ("fan_out_batch = 16, statement_cache = 1024, fan-outs kept".into(), 16, 1024, true, false),
    ];
    let mut repos: Vec<Repo<Photo>> = Vec::new();
    for (_, batch, cache, fan_out, generic) in &variants {
        let o = ClusterOptions {
            fan_out_batch: *batch,
            statement_cache: *cache,
            fan_out_prepared: *fan_out,
            generic_plans: *generic,
            pool_size: 2,
            ..ClusterOptions::default()
        };
        repos.push(Cluster::connect(&config, o).await?.repo::<Photo>()?);
    }
    let window = |r: Repo<Photo>| {
        let newest = newest.clone();
        async move {
            let t = Instant::now();
            let w = r.created_between(start, end, 100).await?;
            let took = t.elapsed();
            assert!(w.is_complete());
            assert!(w.rows.iter().map(|p| p.id).eq(newest.iter().copied()));
            Ok::<_, BoxError>(took)
        }
    };
    // The first calls of each variant, on new connections: connections made, catalog
    // entries loaded, plans kept (what every new pooled connection pays again).
    let mut warm_up = Vec::new();
    for r in &repos {
        let t = Instant::now();
        for _ in 0..8 {
            window(r.clone()).await?;
        }
        warm_up.push(t.elapsed());
    }
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); variants.len()];
    for _ in 0..rounds {
        for (i, r) in repos.iter().enumerate() {
            times[i].push(window(r.clone()).await?);
        }
    }
    let mut cpu = Vec::new();
    let n_cpu = rounds.clamp(10, 50);
    for r in &repos {
        let before = server_cpu(&admins, db).await?;
        for _ in 0..n_cpu {
            window(r.clone()).await?;
        }
        let after = server_cpu(&admins, db).await?;
        cpu.push(before.zip(after).map(|(b, a)| (a - b) / n_cpu as f64 / hosts as f64 * 1e3));
    }
    let p50_rival = quantile(&times[0], 0.5);
    println!("created_between, 100 newest of {rows} rows in the window ({rounds} rounds, alternating):");
    println!(
        "  {:<60}{:>9}{:>9}{:>12}{:>16}{:>20}",
        "", "p50 ms", "p99 ms", "p50 ratio", "server CPU ms", "first 8 calls ms"
    );
    for (i, (name, ..)) in variants.iter().enumerate() {
        println!(
            "  {:<60}{:>9.1}{:>9.1}{:>11.2}x{:>16}{:>20.0}",
            name,
            ms(quantile(&times[i], 0.5)),
            ms(quantile(&times[i], 0.99)),
            ms(quantile(&times[i], 0.5)) / ms(p50_rival),
            cpu[i].map_or_else(|| "n/a".to_owned(), |c| format!("{c:.1} /host")),
            ms(warm_up[i]),
        );
    }

    // 2. get_many of 100 IDs over every host: vs a loop of gets, vs one `= ANY`
    // statement per shard, all at once on direct connections.
    let mut direct: HashMap<HostName, Client> = HashMap::new();
    for (i, h) in config.hosts.iter().enumerate() {
        direct.insert(h.name.clone(), kit.hosts()[i].connect(db).await?);
    }
    let columns = Photo::COLUMNS.join(", ");
    let sample: Vec<Id> = ids.iter().step_by(ids.len() / 2000).copied().take(2000).collect();
    let batches: Vec<Vec<Id>> = sample.chunks(100).map(<[Id]>::to_vec).collect();
    let kept = Cluster::connect(&config, ClusterOptions { statement_cache: 1024, ..setup.clone() }).await?;
    println!("\nget_many of 100 IDs over {hosts} hosts (median of 5 rounds of {} batches):", batches.len());
    for (name, handle, prepared) in [
        ("unnamed statements (the default), fan_out_batch = 16", &base, false),
        ("statement_cache = 1024 (gets kept prepared; get_many's statements stay unnamed)", &kept, true),
    ] {
        let (many, looped, fair) = get_many_rounds(handle, &direct, &batches, &columns, prepared).await?;
        println!("  {name}:");
        println!("    {:<62}{:>8.2} ms", "rival: a loop of 100 Repo::get", ms(looped));
        println!(
            "    {:<62}{:>8.2} ms",
            if prepared {
                "rival: one `= ANY` statement per shard, prepared, all at once, direct"
            } else {
                "rival: one `= ANY` statement per shard, all at once, direct"
            },
            ms(fair)
        );
        println!(
            "    {:<62}{:>8.2} ms   {:.1}x the loop, {:.2}x the per-shard rival",
            "shardline Repo::get_many",
            ms(many),
            ms(looped) / ms(many),
            ms(fair) / ms(many)
        );
    }

    // 3. One backend's memory after it has read every shard of its host (as a pooled
    // connection does, over time, with fan-outs): its catalog caches keep an entry per
    // table and index it opened, for as long as the connection lives.
    let c = kit.hosts()[0].connect(db).await?;
    let pid: i32 = c.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
    let before = backend_memory(&c, pid).await?;
    let map = base.map();
    let schemas: Vec<String> =
        map.shards_of(&config.hosts[0].name).map(|s| base.prefix().schema(s).quoted()).collect();
    for chunk in schemas.chunks(64) {
        let sql = chunk
            .iter()
            .map(|s| format!("(SELECT id FROM {s}.photos ORDER BY id DESC LIMIT 1)"))
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        c.query(&sql, &[]).await?;
    }
    let after = backend_memory(&c, pid).await?;
    println!(
        "\none backend after reading photos in each of the {} shards of its host (64 per statement):",
        schemas.len()
    );
    println!(
        "  memory contexts {:.1} MB -> {:.1} MB ({:.1} KB per shard); RssAnon {} -> {}",
        before.0 / 1e6,
        after.0 / 1e6,
        (after.0 - before.0) / 1e3 / f64::from(u32::try_from(schemas.len())?),
        before.1.map_or_else(|| "n/a".to_owned(), |k| format!("{:.1} MB", k / 1e3)),
        after.1.map_or_else(|| "n/a".to_owned(), |k| format!("{:.1} MB", k / 1e3)),
    );
    kit.shutdown().await?;
    Ok(())
}

/// A backend's memory: the bytes of its memory contexts, and its private resident
/// memory in KB (`RssAnon` of `/proc/<pid>/status`, local backend only).
async fn backend_memory(c: &Client, pid: i32) -> Result<(f64, Option<f64>), BoxError> {
    let contexts: i64 =
        c.query_one("SELECT sum(total_bytes)::int8 FROM pg_backend_memory_contexts", &[]).await?.get(0);
    let rss = std::fs::read_to_string(format!("/proc/{pid}/status")).ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("RssAnon:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|k| k.parse::<f64>().ok())
    });
    Ok((contexts as f64, rss))
}

/// `get_many` of each batch through `cluster`, against a loop of gets through the same
/// handle and against one `= ANY` statement per shard sent at once on `direct`
/// connections (prepared ahead when `prepared`, as the handle's statement cache keeps
/// them): the medians of 5 rounds, per batch.
async fn get_many_rounds(
    cluster: &Cluster,
    direct: &HashMap<HostName, Client>,
    batches: &[Vec<Id>],
    columns: &str,
    prepared: bool,
) -> Result<(Duration, Duration, Duration), BoxError> {
    let photos: Repo<Photo> = cluster.repo::<Photo>()?;
    let per_shard = |b: &[Id]| {
        let mut groups: HashMap<(HostName, String), Vec<i64>> = HashMap::new();
        for &id in b {
            let route = cluster.route_id(id).unwrap();
            groups
                .entry((
                    route.host,
                    format!("SELECT {columns} FROM {}.photos WHERE id = ANY($1)", route.schema.quoted()),
                ))
                .or_default()
                .push(i64::from(id));
        }
        groups
    };
    let mut statements: HashMap<(HostName, String), tokio_postgres::Statement> = HashMap::new();
    for b in batches {
        photos.get_many(b).await?; // warm
        for id in b {
            photos.get(*id).await?;
        }
        if prepared {
            for (key, _) in per_shard(b) {
                if let std::collections::hash_map::Entry::Vacant(e) = statements.entry(key) {
                    let (host, sql) = e.key();
                    let s = direct[host].prepare_typed(sql, &[Type::INT8_ARRAY]).await?;
                    e.insert(s);
                }
            }
        }
    }
    let (mut many, mut looped, mut fair) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        for b in batches {
            assert!(photos.get_many(b).await?.missing.is_empty());
        }
        many.push(t.elapsed() / u32::try_from(batches.len())?);
        let t = Instant::now();
        for b in batches {
            let groups = per_shard(b);
            let statements = &statements;
            let runs = groups.iter().map(|(key, a)| async move {
                let a = a as &(dyn tokio_postgres::types::ToSql + Sync);
                match statements.get(key) {
                    Some(s) => direct[&key.0].query(s, &[a]).await,
                    None => direct[&key.0].query_typed(&key.1, &[(a, Type::INT8_ARRAY)]).await,
                }
            });
            let n: usize = futures::future::try_join_all(runs).await?.iter().map(Vec::len).sum();
            assert_eq!(n, b.len());
        }
        fair.push(t.elapsed() / u32::try_from(batches.len())?);
        let t = Instant::now();
        for b in batches {
            for &id in b {
                assert!(photos.get(id).await?.is_some());
            }
        }
        looped.push(t.elapsed() / u32::try_from(batches.len())?);
    }
    Ok((quantile(&many, 0.5), quantile(&looped, 0.5), quantile(&fair, 0.5)))
}
