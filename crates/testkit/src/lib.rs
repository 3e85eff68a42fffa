//! Real, killable PostgreSQL 15 hosts for shardline's tests and demo.
//!
//! [`Cluster::start`] gives N independent servers, each with `wal_level=logical`, room
//! for replication slots and WAL senders, and `fsync=off`. Two backends sit behind one
//! trait object ([`Backend`]):
//!
//! - **docker**: one container per host via testcontainers, all on one Docker network,
//!   so hosts reach each other by name ([`Host::peer_url`]) and logical replication
//!   works between them. The image is `SHARDLINE_PG_IMAGE` (default `postgres:15`);
//!   `scripts/pg-image.sh` builds it from Debian's packages where no registry answers.
//! - **local**: one `postgres` process per host from the installed binaries
//!   (`SHARDLINE_PG_BIN`, default `/usr/lib/postgresql/15/bin`), on free loopback
//!   ports, data on tmpfs; as root the servers run as the `postgres` user. They die with
//!   the test process, even on SIGKILL.
//!
//! `SHARDLINE_TEST_BACKEND=docker|local` chooses; unset means docker when an engine
//! answers, else local. The kit prints its choice. When neither can run, starting fails
//! with a message saying what to install: the kit never skips silently.
//!
//! Every [`Host`] has fault handles: [`Host::stop`] (clean shutdown), [`Host::kill`]
//! (SIGKILL: a crash), [`Host::pause`] / [`Host::resume`] (a hung host: `docker pause`
//! or SIGSTOP), [`Host::start`] and [`Host::restart`]. Addresses survive all of them.
//!
//! # Layout
//!
//! - [`auth`]: [`Host::require_password`] makes a host ask one role for its password;
//!   [`Host::write_private_file`] puts a file (a passfile) on a host.
//! - [`cluster`]: [`Cluster`], starting, healing and removing a set of hosts.
//! - [`host`]: [`Host`], its URLs and fault handles; the [`HostControl`] trait.
//! - [`backend`]: choosing a backend; the [`Backend`] trait.
//! - [`link`]: [`Link`], a link to one host that a test can cut (a partition) and heal:
//!   [`Cluster::link`] from the test process, [`Cluster::peer_link`] from the other
//!   servers.
//! - [`pgbouncer`]: [`pgbouncer::Pgbouncer`], a PgBouncer (session or transaction
//!   mode) in front of one host.
//! - [`tls`]: certificates made on the spot; [`Host::require_tls`] makes a host
//!   TLS-only.
//! - [`harness`]: a test `main` with one runtime and one cluster per test binary,
//!   a database per test, and exclusive tests for the ones that fault hosts.
//!
//! # Example
//!
//! ```no_run
//! # async fn example() -> Result<(), shardline_testkit::Error> {
//! let cluster = shardline_testkit::Cluster::start(3).await?;
//! for host in cluster.hosts() {
//!     let client = host.connect("postgres").await?;
//!     let row = client.query_one("SELECT version()", &[]).await.expect("version");
//!     println!("{}: {}", host.name(), row.get::<_, String>(0));
//! }
//! cluster.hosts()[0].kill().await?; // a crash
//! cluster.hosts()[0].start().await?; // crash recovery
//! cluster.shutdown().await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![doc(test(attr(deny(warnings), allow(dead_code))))]

pub mod auth;
pub mod backend;
pub mod cluster;
mod docker;
mod error;
pub mod harness;
pub mod host;
pub mod link;
mod local;
pub mod pgbouncer;
pub mod tls;

pub use backend::{Backend, BackendKind};
pub use cluster::Cluster;
pub use error::{Error, Result};
pub use host::{Endpoint, Host, HostControl, HostState};
#[doc(hidden)]
pub use inventory;
pub use link::Link;

/// The README's code samples, compiled as doctests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

/// Server settings every host runs with, whatever the backend.
///
/// `synchronous_commit` stays `on`: with `fsync=off` a killed server still keeps every
/// acknowledged commit (the WAL is in the OS page cache), so crash tests stay honest.
pub fn server_settings() -> &'static [(&'static str, &'static str)] {
    &[
        ("fsync", "off"),
        ("full_page_writes", "off"),
        ("wal_level", "logical"),
        ("max_wal_senders", "32"),
        ("max_replication_slots", "32"),
        ("max_logical_replication_workers", "16"),
        ("max_worker_processes", "32"),
        ("max_connections", "300"),
        // The logical-replication launcher starts at most one apply worker per this
        // interval (default 5 s), which throttles moves onto one host back to back.
        ("wal_retrieve_retry_interval", "200ms"),
        ("log_min_messages", "warning"),
    ]
}

/// Overrides of [`server_settings`] that give a host Postgres's stock limits on
/// connections, background processes and locks: `max_connections=100`,
/// `max_locks_per_transaction=64`, and the defaults of the settings that also size the
/// shared lock table (`max_worker_processes`, `max_wal_senders`). The shared lock
/// table then holds `64 × (100 + 3 + 1 + 8 + 10)` = 7,808 locks, as on a server
/// installed with its defaults. For [`Cluster::start_with`].
pub fn stock_limits() -> &'static [(&'static str, &'static str)] {
    &[
        ("max_connections", "100"),
        ("max_locks_per_transaction", "64"),
        ("max_worker_processes", "8"),
        ("max_wal_senders", "10"),
        ("max_replication_slots", "10"),
        ("max_logical_replication_workers", "4"),
    ]
}

/// [`server_settings`] with `overrides` applied: a key of both takes the override's
/// value, a key only in `overrides` is added.
pub(crate) fn settings_with(overrides: &[(String, String)]) -> Vec<(String, String)> {
    let mut all: Vec<(String, String)> =
        server_settings().iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    for (key, value) in overrides {
        match all.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1.clone_from(value),
            None => all.push((key.clone(), value.clone())),
        }
    }
    all
}

/// A TCP port that nothing listens on right now, on any address, and that this process
/// has not handed out before.
///
/// The kernel's "nothing listens" is not enough: a host stopped by a test keeps its port
/// for when it starts again (a container's mapping, a local server's `port`), and
/// nothing listens on it meanwhile, so a second host started in between could be given
/// it, and one of the two would then fail to start ("port is already allocated"). The
/// probe is on every address (`0.0.0.0`) because Docker publishes a container's port on
/// every address. Limits: the set is per process (a second test process has its own),
/// and the probe's listener is closed before the host binds the port.
pub(crate) fn free_port() -> Result<u16> {
    let listener = bind_unused("0.0.0.0")?;
    listener.local_addr().map(|a| a.port()).map_err(|source| Error::Io {
        what: "finding a free port",
        path: "0.0.0.0:0".into(),
        source,
    })
}

/// A listener on `ip`, on a port this process has not handed out before: the one owner
/// of choosing ports, for hosts ([`free_port`]) and for links, which keep the listener.
pub(crate) fn bind_unused(ip: &str) -> Result<std::net::TcpListener> {
    static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let err = |source| Error::Io { what: "finding a free port", path: format!("{ip}:0").into(), source };
    // Held until a new port turns up, so the kernel cannot offer the same one again.
    let mut held = Vec::new();
    loop {
        let listener = std::net::TcpListener::bind((ip, 0)).map_err(err)?;
        let port = listener.local_addr().map_err(err)?.port();
        let mut handed_out = HANDED_OUT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if handed_out.insert(port) {
            return Ok(listener);
        }
        drop(handed_out);
        held.push(listener);
    }
}

/// Whether process `pid` exists on this machine.
pub(crate) fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else { return false };
    !matches!(nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None), Err(nix::errno::Errno::ESRCH))
}

#[cfg(test)]
mod tests {
    use super::free_port;

    /// The kernel offers a port again once its listener is gone; a host stopped by a test
    /// keeps its port meanwhile, so the kit must not hand that port to another host.
    #[test]
    fn free_ports_are_never_handed_out_twice() {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..3000 {
            let port = free_port().expect("a free port");
            assert!(seen.insert(port), "port {port} was handed out twice");
        }
    }
}
