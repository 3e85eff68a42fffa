//! Starts a cluster of PostgreSQL hosts with the test kit, prints each host's address and
//! version, and removes the cluster again.
//!
//! ```text
//! cargo run -p shardline-testkit --example cluster [HOSTS]
//! ```
//!
//! `SHARDLINE_TEST_BACKEND=docker|local` picks the backend (unset: docker when an
//! engine answers, else local processes).

use std::process::ExitCode;

use shardline_testkit::Cluster;

#[tokio::main]
async fn main() -> ExitCode {
    let hosts = match std::env::args().nth(1).map(|a| a.parse::<usize>()) {
        None => 3,
        Some(Ok(n)) if (1..=16).contains(&n) => n,
        Some(_) => {
            eprintln!("usage: cluster [HOSTS]   (HOSTS: 1 to 16, default 3)");
            return ExitCode::from(2);
        }
    };
    match run(hosts).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            let mut source = std::error::Error::source(e.as_ref());
            while let Some(s) = source {
                eprintln!("  caused by: {s}");
                source = s.source();
            }
            ExitCode::FAILURE
        }
    }
}

async fn run(hosts: usize) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let cluster = Cluster::start(hosts).await?;
    println!(
        "{} PostgreSQL hosts on the {} backend, started in {:.2} s:",
        cluster.hosts().len(),
        cluster.backend(),
        cluster.startup_time().as_secs_f64()
    );
    let mut outcome = Ok(());
    for host in cluster.hosts() {
        let answer = async {
            let client = host.connect("postgres").await?;
            let row = client.query_one("SELECT version(), current_setting('wal_level')", &[]).await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((
                row.get::<_, String>(0),
                row.get::<_, String>(1),
            ))
        }
        .await;
        match answer {
            Ok((version, wal_level)) => println!(
                "  {:<4} {:<32} peers use {}\n       {version} (wal_level={wal_level})",
                host.name(),
                host.admin_url(),
                host.peer_url("postgres"),
            ),
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
    }
    cluster.shutdown().await?;
    println!("cluster removed");
    outcome
}
