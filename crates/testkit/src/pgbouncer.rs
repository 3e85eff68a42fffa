//! A PgBouncer in front of one test host: [`Pgbouncer::start`].
//!
//! The binary is `SHARDLINE_PGBOUNCER` when set (a PgBouncer built from source, say),
//! else `pgbouncer` on the `PATH` (Debian: `apt-get install pgbouncer`, 1.18 on
//! bookworm). When it is missing, starting fails with what to install: a test that
//! needs PgBouncer fails loudly, it never skips.
//!
//! The pooler listens on a free loopback port, trusts every client (`auth_type = trust`
//! with the `postgres` user in its `auth_file`) and points every database at the host's
//! loopback address (for the docker backend, the port mapped to the container). As root
//! it runs as the `postgres` user (PgBouncer refuses root), under
//! `setpriv --pdeathsig KILL`, so it dies with the test process.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::host::Host;
use crate::{Error, Result};

/// The environment variable naming the PgBouncer binary to use.
pub const PGBOUNCER_ENV: &str = "SHARDLINE_PGBOUNCER";

static RUNS: AtomicUsize = AtomicUsize::new(0);

/// PgBouncer's `pool_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// A server connection per client connection, for the client's whole session.
    Session,
    /// A server connection per transaction: the mode large fleets run.
    Transaction,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        }
    }
}

/// A running PgBouncer. Killed when dropped.
#[derive(Debug)]
pub struct Pgbouncer {
    dir: PathBuf,
    port: u16,
    version: String,
    child: Option<Child>,
}

impl Pgbouncer {
    /// Starts a PgBouncer in `mode` in front of `host`, with a pool of at most
    /// `pool_size` server connections per database and user.
    ///
    /// # Errors
    ///
    /// [`Error::BackendUnavailable`] when there is no PgBouncer binary (what to install
    /// is in the message); [`Error::Io`] / [`Error::Command`] when it cannot start.
    pub async fn start(host: &Host, mode: PoolMode, pool_size: usize) -> Result<Pgbouncer> {
        Pgbouncer::start_with(host, mode, pool_size, &[]).await
    }

    /// As [`Pgbouncer::start`], with more `[pgbouncer]` settings (`max_prepared_statements`
    /// of PgBouncer 1.21 and later, say).
    ///
    /// # Errors
    ///
    /// As [`Pgbouncer::start`].
    pub async fn start_with(
        host: &Host,
        mode: PoolMode,
        pool_size: usize,
        settings: &[(&str, &str)],
    ) -> Result<Pgbouncer> {
        use std::os::unix::process::CommandExt;
        let binary = binary()?;
        let version = version(&binary)?;
        let user = if nix::unistd::geteuid().is_root() {
            match nix::unistd::User::from_name("postgres") {
                Ok(Some(u)) => Some((u.uid.as_raw(), u.gid.as_raw())),
                _ => {
                    return Err(unavailable(
                        "running as root, and there is no `postgres` user to run it as".into(),
                    ));
                }
            }
        } else {
            None
        };
        let dir = crate::local::scratch_parent().join(format!(
            "shardline-pgbouncer-{}-{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&dir).map_err(io_err("creating the pgbouncer directory", &dir))?;
        let port = crate::free_port()?;
        let endpoint = host.endpoint();
        let mut ini = format!(
            "[databases]\n* = host={} port={}\n\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
             unix_socket_dir =\nauth_type = trust\nauth_file = {}\npool_mode = {}\n\
             default_pool_size = {pool_size}\nmax_client_conn = 1000\nlogfile = {}\n\
             ignore_startup_parameters = extra_float_digits,options\nserver_check_delay = 0\n",
            endpoint.host,
            endpoint.port,
            dir.join("userlist.txt").display(),
            mode.as_str(),
            dir.join("pgbouncer.log").display(),
        );
        for (key, value) in settings {
            ini.push_str(&format!("{key} = {value}\n"));
        }
        let ini_path = dir.join("pgbouncer.ini");
        fs::write(&ini_path, ini).map_err(io_err("writing pgbouncer.ini", &ini_path))?;
        let users = dir.join("userlist.txt");
        fs::write(&users, "\"postgres\" \"\"\n").map_err(io_err("writing userlist.txt", &users))?;
        if let Some((uid, gid)) = user {
            for p in [&dir, &ini_path, &users] {
                std::os::unix::fs::chown(p, Some(uid), Some(gid))
                    .map_err(io_err("handing the pgbouncer directory to postgres", p))?;
            }
        }
        let mut cmd = Command::new("setpriv");
        cmd.args(["--pdeathsig", "KILL", "--"]).arg(&binary).arg(&ini_path);
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        if let Some((uid, gid)) = user {
            cmd.uid(uid).gid(gid);
        }
        let child =
            crate::local::spawn_from_long_lived_thread(cmd).map_err(io_err("starting pgbouncer", &binary))?;
        let mut bouncer = Pgbouncer { dir, port, version, child: Some(child) };
        bouncer.wait_ready().await?;
        Ok(bouncer)
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await.is_ok() {
                return Ok(());
            }
            let exited = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || tokio::time::Instant::now() > deadline {
                return Err(Error::Command {
                    program: "pgbouncer".into(),
                    status: exited.map_or_else(|| "not listening after 10 s".into(), |s| s.to_string()),
                    stderr: self.log_tail(),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The URL of database `db` through the pooler, as the `postgres` user.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// The first line of `pgbouncer --version` (`PgBouncer 1.18.0`).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The end of the pooler's log.
    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Pgbouncer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // setpriv execs pgbouncer, so this is pgbouncer's own process.
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(PGBOUNCER_ENV) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(unavailable(format!("{PGBOUNCER_ENV}={} is not a file", p.display())))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
        .map(|d| d.join("pgbouncer"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            unavailable(format!(
                "pgbouncer not found (Debian: apt-get install pgbouncer; or set {PGBOUNCER_ENV} to a binary)"
            ))
        })
}

fn version(binary: &Path) -> Result<String> {
    let out = Command::new(binary)
        .arg("--version")
        .output()
        .map_err(io_err("running pgbouncer --version", binary))?;
    Ok(String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("PgBouncer ?").trim().to_owned())
}

fn unavailable(reason: String) -> Error {
    Error::BackendUnavailable { backend: "pgbouncer", reason }
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::Io { what, path: path.to_owned(), source }
}
