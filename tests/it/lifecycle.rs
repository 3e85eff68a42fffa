//! The kit cleans up after itself, even after a test process is SIGKILLed.

use std::process::Stdio;
use std::time::{Duration, Instant};

use shardline_testkit::backend::BACKEND_ENV;
use shardline_testkit::harness::{HOLD_ENV, HOLD_PAUSE_LAST_ENV, HOLD_READY, TestContext, TestResult};
use shardline_testkit::{BackendKind, Cluster};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio_postgres::NoTls;

async fn accepts(port: u16) -> bool {
    let mut config = tokio_postgres::Config::new();
    config.host("127.0.0.1").port(port).user("postgres").dbname("postgres");
    matches!(tokio::time::timeout(Duration::from_secs(5), config.connect(NoTls)).await, Ok(Ok(_)))
}

shardline_testkit::register!(shared: a_killed_test_process_leaves_no_server);
pub(crate) async fn a_killed_test_process_leaves_no_server(ctx: TestContext) -> TestResult {
    let backend = ctx.cluster().backend();
    // This very binary, told to hold a cluster of two hosts and wait.
    // Its last host paused with a session open: that backend cannot notice its
    // postmaster's death (a test killed while it had a host paused).
    let mut holder = tokio::process::Command::new(std::env::current_exe()?)
        .env(HOLD_ENV, "3")
        .env(HOLD_PAUSE_LAST_ENV, "1")
        .env(BACKEND_ENV, backend.as_str())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = holder.stdout.take().ok_or("the holder has no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(line) = lines.next_line().await? {
            if let Some(ports) = line.strip_prefix(HOLD_READY) {
                return Ok(Some(ports.to_owned()));
            }
        }
        Ok::<_, std::io::Error>(None)
    })
    .await??
    .ok_or("the holder ended before its cluster was up")?;
    let (ports, paused) = ready.split_once(" paused ").ok_or(format!("no paused backend in {ready:?}"))?;
    let frozen: i32 = paused.trim().parse()?;
    let ports: Vec<u16> = ports.split_whitespace().map(str::parse).collect::<Result<_, _>>()?;
    assert_eq!(ports.len(), 3);
    let (running, paused_port) = ports.split_at(2);
    for &port in running {
        assert!(accepts(port).await, "the held host on port {port} does not answer");
    }

    holder.start_kill()?; // SIGKILL: no destructor, no teardown runs in the holder
    holder.wait().await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    if backend == BackendKind::Docker {
        // Containers outlive a SIGKILLed client; the next run of the kit removes them.
        Cluster::remove_leftovers().await;
    } else {
        // Local servers die with the process that started them, by themselves.
        for &port in running {
            while accepts(port).await {
                assert!(
                    Instant::now() < deadline,
                    "a server of the killed process still answers on port {port}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        // But not a paused host's backend, stopped: the next run of the kit kills it
        // when it removes the dead run's directory.
        assert!(alive(frozen), "the paused host's backend {frozen} ended by itself");
        Cluster::remove_leftovers().await;
        while alive(frozen) {
            assert!(
                Instant::now() < deadline,
                "the paused host's backend {frozen} outlived the kit's clean-up"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for &port in running.iter().chain(paused_port) {
        while accepts(port).await {
            assert!(Instant::now() < deadline, "a server of the killed process still answers on port {port}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// Whether a local process is there and not a zombie (a killed backend whose parent,
/// the dead postmaster, left it to init is reaped at once).
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}
