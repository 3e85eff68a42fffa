//! One-row transactions from pgbench, a real client: the same table with `bigserial`,
//! with `DEFAULT next_id()` (the PL/pgSQL minter) and with the native minter's
//! `next_id()` (`scripts/native-minter.sh` installs its library), 8, 32 and 64 clients, simple and prepared protocol, on one
//! real Postgres 15 host from the test kit. Prints tps beside bigserial's as ratios, and
//! after every run checks the minted IDs: duplicates, and rows whose ID's time is more
//! than 100 ms behind their transaction's start.
//!
//! ```text
//! SHARDLINE_TEST_BACKEND=local cargo bench -p shardline-tests --bench pgbench [-- SECONDS ROUNDS [CLIENTS,...]]
//! ```
#![allow(clippy::unwrap_used, reason = "a benchmark")]

use std::process::Command;

use shardline_id::Layout;
use shardline_id::sql::{Minter, ShardSql};
use shardline_testkit::Cluster;

const SCHEMA: &str = "shard_0005";
/// The native minter's shard.
const NATIVE_SCHEMA: &str = "shard_0006";

const VARIANTS: &[(&str, &str)] = &[
    ("bigserial", "id bigserial PRIMARY KEY"),
    ("next_id()", "id bigint PRIMARY KEY DEFAULT shard_0005.next_id()"),
    // The floor of any PL/pgSQL default: a function that only returns `nextval` of its
    // own sequence. Not a minter: it shows what the call itself costs a one-row
    // transaction, whatever the function does.
    ("plpgsql nextval", "id bigint PRIMARY KEY DEFAULT shard_0005.plpgsql_nextval()"),
    ("native next_id()", "id bigint PRIMARY KEY DEFAULT shard_0006.next_id()"),
];

/// The floor variant's function (see `VARIANTS`).
const FLOOR_FUNCTION: &str = "CREATE SEQUENCE shard_0005.floor_seq;
CREATE FUNCTION shard_0005.plpgsql_nextval() RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN nextval('shard_0005.floor_seq');
END
$$;";

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs pgbench and returns its tps (without initial connection time).
fn pgbench(url: &str, script: &str, clients: u32, protocol: &str, seconds: u32) -> Result<f64, String> {
    let out = Command::new("pgbench")
        .args(["-n", "-j", "2", "-c", &clients.to_string(), "-T", &seconds.to_string(), "-M", protocol])
        .args(["-f", script, url])
        .output()
        .map_err(|e| format!("pgbench: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("tps = ").and_then(|r| r.split_whitespace().next()))
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| format!("pgbench printed no tps: {text}{}", String::from_utf8_lossy(&out.stderr)))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let seconds: u32 = args.first().map_or(Ok(10), |a| a.parse())?;
    let rounds: usize = args.get(1).map_or(Ok(1), |a| a.parse())?;
    let client_counts: Vec<u32> =
        args.get(2).map_or(Ok(vec![8, 32, 64]), |a| a.split(',').map(str::parse).collect())?;
    let cluster = Cluster::start(1).await?;
    let host = &cluster.hosts()[0];
    cluster.create_database("bench").await?;
    let client = host.connect("bench").await?;
    let sql = ShardSql::new(Layout::INSTAGRAM, SCHEMA, 5)?;
    client.batch_execute(&format!("CREATE SCHEMA {SCHEMA}")).await?;
    client.batch_execute(&sql.install()).await?;
    let native = ShardSql::new(Layout::INSTAGRAM, NATIVE_SCHEMA, 6)?.minter(Minter::Native);
    client.batch_execute(&format!("CREATE SCHEMA {NATIVE_SCHEMA}")).await?;
    client.batch_execute(&native.install()).await?;
    client.batch_execute(FLOOR_FUNCTION).await?;
    let dir = std::env::temp_dir().join(format!("shardline-pgbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut scripts = Vec::new();
    for (i, (_, column)) in VARIANTS.iter().enumerate() {
        client
            .batch_execute(&format!(
                "CREATE TABLE {SCHEMA}.t{i} ({column}, n int NOT NULL, at timestamptz NOT NULL DEFAULT now())"
            ))
            .await?;
        let script = dir.join(format!("t{i}.sql"));
        std::fs::write(&script, format!("INSERT INTO {SCHEMA}.t{i} (n) VALUES (1);\n"))?;
        scripts.push(script.to_string_lossy().into_owned());
    }
    let version: String = client.query_one("SHOW server_version", &[]).await?.get(0);
    println!(
        "pgbench, one INSERT per transaction, {seconds} s per run, {rounds} round(s), PostgreSQL {version} on the {} backend (fsync=off)\n",
        cluster.backend()
    );
    println!(
        "{:>7} {:>9} {:>10} {:>10} {:>6} {:>16} {:>6} {:>17} {:>6} {:>10} {:>10}",
        "clients",
        "protocol",
        "bigserial",
        "next_id()",
        "ratio",
        "plpgsql nextval",
        "ratio",
        "native next_id()",
        "ratio",
        "duplicates",
        "stale"
    );
    println!(
        "(tps: the median of the rounds; ratio: the median of each round's ratio to that round's bigserial;\n duplicates and stale: the PL/pgSQL minter's table / the native minter's)"
    );
    let url = host.url("bench");
    for &clients in &client_counts {
        for protocol in ["simple", "prepared"] {
            let mut tps = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
            // Each minter's table (PL/pgSQL t1, native t3) after every run of it (the next
            // run empties it): duplicates, and rows more than 100 ms behind.
            let mut checked = [(0i64, 0i64), (0, 0)];
            for round in 0..rounds {
                // Alternate which variant runs first.
                for k in 0..VARIANTS.len() {
                    let i = (k + round) % VARIANTS.len();
                    client.batch_execute(&format!("TRUNCATE {SCHEMA}.t{i}; CHECKPOINT")).await?;
                    tps[i].push(pgbench(&url, &scripts[i], clients, protocol, seconds)?);
                    let Some(slot) = [1, 3].iter().position(|&m| m == i) else { continue };
                    let row = client
                        .query_one(
                            &format!(
                                "SELECT count(*) - count(DISTINCT id),
                                        count(*) FILTER (WHERE (id >> 23) + {epoch} < (date_part('epoch', at) * 1000)::bigint - 100)
                                 FROM {SCHEMA}.t{i}",
                                epoch = Layout::INSTAGRAM.epoch_ms()
                            ),
                            &[],
                        )
                        .await?;
                    checked[slot].0 += row.get::<_, i64>(0);
                    checked[slot].1 += row.get::<_, i64>(1);
                }
            }
            let dups = format!("{}/{}", checked[0].0, checked[1].0);
            let stale = format!("{}/{}", checked[0].1, checked[1].1);
            // Paired: each round's ratio to the bigserial run of the same round, so the
            // machine's drift between rounds cancels out.
            let paired = |i: usize| median(tps[i].iter().zip(&tps[0]).map(|(v, b)| v / b).collect());
            let (ours_r, floor_r, c_r) = (paired(1), paired(2), paired(3));
            let [base, ours, floor, c] = tps.map(median);
            println!(
                "{clients:>7} {protocol:>9} {base:>10.0} {ours:>10.0} {ours_r:>5.2}x {floor:>16.0} {floor_r:>5.2}x {c:>17.0} {c_r:>5.2}x {dups:>10} {stale:>10}"
            );
        }
    }
    std::fs::remove_dir_all(&dir)?;
    cluster.shutdown().await?;
    Ok(())
}
