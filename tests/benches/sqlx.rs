//! sqlx through shardline beside sqlx alone, in the same process, on the same 4 real
//! hosts and rows, through the same sqlx pools (so the same connections and the same
//! statement preparation):
//!
//! - a routed get by ID (`Sqlx::on_id`: a transaction in the ID's shard with its
//!   `search_path`, the statement unqualified) vs sqlx direct on the right host (the
//!   statement schema-qualified, no transaction). Goal of #19: ≤ 1.05× its latency;
//! - the same rival wrapped in the same transaction shape by hand (`BEGIN; SET LOCAL
//!   search_path`, the statement, `SAVEPOINT; COMMIT`): what the routing itself costs,
//!   apart from the transaction;
//! - a routed get as one statement (`Sqlx::statement_on_id`: no transaction, the table
//!   named qualified by `ShardConn::table`) vs the same rival, the same SQL text: the
//!   path for the ≤ 1.05× goal;
//! - each with every statement unnamed (the default) and with `statement_cache = 1024`.
//!
//! ```text
//! SHARDLINE_TEST_BACKEND=local cargo bench -p shardline-tests --bench sqlx [-- SHARDS ROWS]
//! ```
#![expect(clippy::unwrap_used, reason = "a benchmark")]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use shardline_example_photos::{NewPhoto, Photo};
use shardline_ops::Options;
use shardline_repo::{Cluster, ClusterOptions, Id};
use sqlx::AssertSqlSafe;

#[path = "common/mod.rs"]
mod common;
use common::{BoxError, config};

const COLUMNS: &str = "id, user_id, url, caption";

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

/// Per call, over `sample`: the routed get.
async fn routed(cluster: &Cluster, sample: &[Id]) -> Result<Duration, BoxError> {
    let db = cluster.sqlx();
    let t = Instant::now();
    for &id in sample {
        let got = db
            .on_id(id, |conn| {
                Box::pin(async move {
                    sqlx::query_as::<_, Photo>("SELECT id, user_id, url, caption FROM photos WHERE id = $1")
                        .bind(id)
                        .fetch_optional(&mut **conn)
                        .await
                })
            })
            .await?;
        assert!(got.is_some());
    }
    Ok(t.elapsed() / u32::try_from(sample.len())?)
}

/// Per call, over `sample`: the routed get as one statement.
async fn routed_statement(cluster: &Cluster, sample: &[Id]) -> Result<Duration, BoxError> {
    let db = cluster.sqlx();
    let t = Instant::now();
    for &id in sample {
        let got = db
            .statement_on_id(id, |conn| {
                let sql = format!("SELECT {COLUMNS} FROM {} WHERE id = $1", conn.table("photos"));
                Box::pin(async move {
                    sqlx::query_as::<_, Photo>(AssertSqlSafe(sql)).bind(id).fetch_optional(&mut **conn).await
                })
            })
            .await?;
        assert!(got.is_some());
    }
    Ok(t.elapsed() / u32::try_from(sample.len())?)
}

/// Per call, over `sample`: sqlx on the right host's pool, routed by hand; `wrapped`
/// in the routed path's transaction shape.
async fn direct(cluster: &Cluster, sample: &[Id], wrapped: bool) -> Result<Duration, BoxError> {
    let db = cluster.sqlx();
    let t = Instant::now();
    for &id in sample {
        let route = cluster.route_id(id)?; // arithmetic on the ID: the rival needs the host too
        let pool = db.pool(&route.host).await?;
        let got = if wrapped {
            let mut conn = pool.acquire().await?;
            let begin = format!("BEGIN; SET LOCAL search_path TO {}", route.schema.quoted());
            sqlx::raw_sql(AssertSqlSafe(begin)).execute(&mut *conn).await?;
            let got =
                sqlx::query_as::<_, Photo>("SELECT id, user_id, url, caption FROM photos WHERE id = $1")
                    .bind(id)
                    .fetch_optional(&mut *conn)
                    .await?;
            sqlx::raw_sql("SAVEPOINT check_it; COMMIT").execute(&mut *conn).await?;
            got
        } else {
            // The text `ShardConn::table` gives: the same prepared statement.
            let sql = format!("SELECT {COLUMNS} FROM {}.\"photos\" WHERE id = $1", route.schema.quoted());
            sqlx::query_as::<_, Photo>(AssertSqlSafe(sql)).bind(id).fetch_optional(&pool).await?
        };
        assert!(got.is_some());
    }
    Ok(t.elapsed() / u32::try_from(sample.len())?)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let shards: u16 = args.first().map_or(Ok(64), |a| a.parse())?;
    let rows: i64 = args.get(1).map_or(Ok(20_000), |a| a.parse())?;
    let hosts = 4;
    let kit = shardline_testkit::Cluster::start(hosts).await?;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    kit.create_database("bench_sqlx").await?;
    let config = config(&kit, "bench_sqlx", shards, &dir)?;
    shardline_ops::init(&config, &Options::default(), &|_| {}).await?;
    let unnamed = Cluster::connect(&config, ClusterOptions::default()).await?;
    let kept =
        Cluster::connect(&config, ClusterOptions { statement_cache: 1024, ..ClusterOptions::default() })
            .await?;
    let photos = unnamed.repo::<Photo>()?;
    let mut ids = Vec::new();
    for chunk in (0..rows).collect::<Vec<_>>().chunks(10_000) {
        let batch: Vec<NewPhoto> =
            chunk.iter().map(|&i| NewPhoto::numbered(i % 5000, u64::try_from(i).unwrap())).collect();
        ids.extend(photos.insert_many(&batch).await?.into_iter().map(|p| p.id));
    }
    let sample: Vec<Id> = ids.iter().step_by(ids.len() / 1000).copied().take(1000).collect();
    println!(
        "sqlx: {shards} shards, {rows} photos over {hosts} hosts, {} backend, {} cores\n",
        kit.backend(),
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
    );
    for (name, cluster) in
        [("statement_cache = 0 (the sqlx path keeps 100)", &unnamed), ("statement_cache = 1024", &kept)]
    {
        // Warm the pools and the statement caches.
        routed(cluster, &sample).await?;
        routed_statement(cluster, &sample).await?;
        direct(cluster, &sample, false).await?;
        direct(cluster, &sample, true).await?;
        let (mut ours, mut single, mut plain, mut wrapped) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        // Alternate rounds, the median round per call.
        for _ in 0..7 {
            ours.push(routed(cluster, &sample).await?);
            single.push(routed_statement(cluster, &sample).await?);
            plain.push(direct(cluster, &sample, false).await?);
            wrapped.push(direct(cluster, &sample, true).await?);
        }
        let (ours, single, plain, wrapped) = (median(ours), median(single), median(plain), median(wrapped));
        println!("get by ID, one at a time, {name} (median of 7 rounds of {}):", sample.len());
        println!(
            "  {:<64}{:>10}",
            "rival: sqlx direct on the right host, qualified, no transaction",
            us(plain)
        );
        println!(
            "  {:<64}{:>10}   {:.3}x its latency",
            "rival: the same in BEGIN/SET LOCAL ... SAVEPOINT;COMMIT, by hand",
            us(wrapped),
            wrapped.as_secs_f64() / plain.as_secs_f64()
        );
        println!(
            "  {:<64}{:>10}   {:.3}x the first, {:.3}x the second",
            "shardline Sqlx::on_id (route, transaction, search_path, retry)",
            us(ours),
            ours.as_secs_f64() / plain.as_secs_f64(),
            ours.as_secs_f64() / wrapped.as_secs_f64()
        );
        println!(
            "  {:<64}{:>10}   {:.3}x the first",
            "shardline Sqlx::statement_on_id (route, one statement, retry)",
            us(single),
            single.as_secs_f64() / plain.as_secs_f64()
        );
    }
    Ok(())
}
