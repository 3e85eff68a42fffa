//! `shardline init` of 2000 shards with the example migrations over 4 real hosts, beside
//! rivals run in the same process: the same work with one connection per host, and a
//! plain loop that sends one statement per round trip (what running the files per
//! schema with a generic migrator amounts to). Also a second, no-op `init`.
//!
//! ```text
//! SHARDLINE_TEST_BACKEND=docker cargo bench -p shardline-tests --bench init [-- SHARDS HOSTS]
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use shardline_id::sql::ShardSql;
use shardline_ops::Options;
use shardline_ops::migrations::load_dir;
use shardline_router::Config;
use shardline_testkit::Cluster;

#[path = "common/mod.rs"]
mod common;
use common::{BoxError, config};

/// The rival: per host one connection, per shard one transaction, each statement
/// awaited before the next is sent.
async fn plain_loop(config: &Config) -> Result<(), BoxError> {
    let migrations = load_dir(&config.migrations)?;
    let map = config.even_map()?;
    let hosts = config.hosts.iter().map(|h| {
        let map = &map;
        let migrations = &migrations;
        async move {
            let client = shardline_repo::catalog::connect(&h.url, h.name.as_str()).await?;
            client
                .batch_execute(
                    "CREATE SCHEMA IF NOT EXISTS ledger; CREATE TABLE IF NOT EXISTS ledger.applied (schema_name text, name text, PRIMARY KEY (schema_name, name))",
                )
                .await?;
            for shard in map.shards_of(&h.name) {
                let schema = config.schema_prefix.schema(shard);
                let q = schema.quoted();
                client.batch_execute("BEGIN").await?;
                client.batch_execute(&format!("CREATE SCHEMA {q}")).await?;
                client.batch_execute(&format!("SET LOCAL search_path TO {q}")).await?;
                let install = ShardSql::new(config.layout, schema.as_str(), u32::from(shard.get()))?.install();
                client.batch_execute(&install).await?;
                // The function every read of the repository names, as `init` makes it.
                client
                    .batch_execute(&format!(
                        "CREATE FUNCTION {q}.{}() RETURNS boolean LANGUAGE sql STABLE PARALLEL SAFE RETURN true",
                        shardline_repo::LIVE_CHECK
                    ))
                    .await?;
                for m in migrations {
                    for s in &m.statements {
                        client.batch_execute(&s.sql).await?;
                    }
                    client
                        .execute("INSERT INTO ledger.applied VALUES ($1, $2)", &[&schema.as_str(), &m.name])
                        .await?;
                }
                client.batch_execute("COMMIT").await?;
            }
            Ok::<_, BoxError>(())
        }
    });
    for r in futures::future::join_all(hosts).await {
        r?;
    }
    Ok(())
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let shards: u16 = args.first().map_or(Ok(2000), |a| a.parse())?;
    let hosts: usize = args.get(1).map_or(Ok(4), |a| a.parse())?;
    let cluster = Cluster::start(hosts).await?;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let files = load_dir(&dir.join("../migrations"))?;
    println!(
        "init: {shards} shards, {} migrations ({} statements) over {hosts} hosts, {} backend, {} cores\n",
        files.len(),
        files.iter().map(|m| m.statements.len()).sum::<usize>(),
        cluster.backend(),
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
    );

    let mut results: Vec<(String, Duration)> = Vec::new();
    for (name, jobs) in [
        ("shardline init, 4 connections per host, pipelined", 4usize),
        ("shardline init, 1 connection per host, pipelined", 1),
    ] {
        let db = format!("bench_init_{jobs}");
        cluster.create_database(&db).await?;
        let config = config(&cluster, &db, shards, &dir)?;
        let options = Options { jobs_per_host: jobs, ..Options::default() };
        let t = Instant::now();
        let report = shardline_ops::init(&config, &options, &|_| {}).await?;
        results.push((name.to_owned(), t.elapsed()));
        assert_eq!(report.schemas_created, usize::from(shards));
        if jobs == 4 {
            let t = Instant::now();
            let again = shardline_ops::init(&config, &options, &|_| {}).await?;
            assert!(!again.changed());
            println!("{:<58}{:>10}", "second init (nothing to do)", secs(t.elapsed()));
        }
    }
    cluster.create_database("bench_plain").await?;
    let config = config(&cluster, "bench_plain", shards, &dir)?;
    let t = Instant::now();
    plain_loop(&config).await?;
    results.push(("rival: a plain loop, one statement per round trip".to_owned(), t.elapsed()));

    let base = results[0].1.as_secs_f64();
    for (name, d) in &results {
        println!("{name:<58}{:>10}   {:>5.2}x the time of the first", secs(*d), d.as_secs_f64() / base);
    }
    cluster.shutdown().await?;
    Ok(())
}
