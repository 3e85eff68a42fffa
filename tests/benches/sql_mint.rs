//! The 1M-row bulk insert, with each way of making a primary key (the native minter's
//! among them: `scripts/native-minter.sh` installs its library), on one real Postgres 15
//! host from the test kit. Prints rows/s and PK index size beside bigserial's, as ratios.
//!
//! ```text
//! SHARDLINE_TEST_BACKEND=local cargo bench -p shardline-tests --bench sql_mint [-- ROWS ROUNDS]
//! ```

use std::time::Instant;

use shardline_id::Layout;
use shardline_id::sql::{Minter, ShardSql};
use shardline_testkit::Cluster;

const SCHEMA: &str = "shard_0005";

struct Variant {
    name: &'static str,
    column: &'static str,
}

const VARIANTS: &[Variant] = &[
    Variant { name: "bigserial", column: "id bigserial PRIMARY KEY" },
    Variant { name: "shardline next_id()", column: "id bigint PRIMARY KEY DEFAULT shard_0005.next_id()" },
    Variant {
        name: "shardline native next_id() (C)",
        column: "id bigint PRIMARY KEY DEFAULT shard_0006.next_id()",
    },
    Variant {
        name: "Instagram's next_id() (PL/pgSQL)",
        column: "id bigint PRIMARY KEY DEFAULT shard_0005.instagram_next_id()",
    },
    Variant { name: "UUID v4 (gen_random_uuid)", column: "id uuid PRIMARY KEY DEFAULT gen_random_uuid()" },
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let rows: i64 = args.first().map_or(Ok(1_000_000), |a| a.parse())?;
    let rounds: usize = args.get(1).map_or(Ok(5), |a| a.parse())?;
    let cluster = Cluster::start(1).await?;
    let host = &cluster.hosts()[0];
    cluster.create_database("bench").await?;
    let client = host.connect("bench").await?;
    let sql = ShardSql::new(Layout::INSTAGRAM, SCHEMA, 5)?;
    client.batch_execute(&format!("CREATE SCHEMA {SCHEMA}")).await?;
    client.batch_execute(&sql.install()).await?;
    client.batch_execute(&sql.instagram_original()).await?;
    // The native minter (`scripts/native-minter.sh` installs its library), in shard 6.
    let native = ShardSql::new(Layout::INSTAGRAM, "shard_0006", 6)?.minter(Minter::Native);
    client.batch_execute(&format!("CREATE SCHEMA {}; {}", native.quoted_schema(), native.install())).await?;
    let version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    println!(
        "{rows} rows per INSERT ... SELECT generate_series, {rounds} rounds, PostgreSQL {version} on the {} backend (fsync=off)\n",
        cluster.backend()
    );

    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
    let mut sizes = vec![0i64; VARIANTS.len()];
    let mut failures: Vec<Option<String>> = vec![None; VARIANTS.len()];
    for round in 0..rounds {
        // Rotate the order each round, so no variant always runs first or after another.
        for k in 0..VARIANTS.len() {
            let i = (k + round) % VARIANTS.len();
            let v = &VARIANTS[i];
            client
                .batch_execute(&format!(
                    "DROP TABLE IF EXISTS {SCHEMA}.t; CREATE TABLE {SCHEMA}.t ({}, n bigint) WITH (autovacuum_enabled = off)",
                    v.column
                ))
                .await?;
            client.batch_execute("CHECKPOINT").await?;
            let started = Instant::now();
            let result = client
                .execute(
                    &format!("INSERT INTO {SCHEMA}.t (n) SELECT g FROM generate_series(1, $1::bigint) g"),
                    &[&rows],
                )
                .await;
            let secs = started.elapsed().as_secs_f64();
            match result {
                Ok(_) => {
                    #[expect(clippy::cast_precision_loss, reason = "row counts far below 2^52")]
                    rates[i].push(rows as f64 / secs);
                    sizes[i] = client
                        .query_one(&format!("SELECT pg_relation_size('{SCHEMA}.t_pkey')"), &[])
                        .await?
                        .get(0);
                }
                Err(e) => {
                    failures[i] =
                        Some(e.as_db_error().map_or_else(|| e.to_string(), |d| d.message().to_owned()))
                }
            }
        }
    }
    let base_rate = median(rates[0].clone());
    #[expect(clippy::cast_precision_loss, reason = "sizes far below 2^52")]
    let base_size = sizes[0] as f64;
    println!("{:<34} {:>12} {:>9} {:>10} {:>9}", "primary key", "rows/s", "vs bigs.", "PK index", "vs bigs.");
    for (i, v) in VARIANTS.iter().enumerate() {
        if let Some(why) = &failures[i] {
            println!("{:<34} failed: {why}", v.name);
            continue;
        }
        let rate = median(rates[i].clone());
        #[expect(clippy::cast_precision_loss, reason = "sizes far below 2^52")]
        let size = sizes[i] as f64;
        println!(
            "{:<34} {:>12.0} {:>8.2}x {:>8.1}MB {:>8.2}x",
            v.name,
            rate,
            rate / base_rate,
            size / 1_048_576.0,
            size / base_size
        );
    }
    cluster.shutdown().await?;
    Ok(())
}
