//! One PostgreSQL server of a test cluster and its fault handles.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio_postgres::{Client, NoTls};

use crate::{Error, Result};

/// How long a host may take to accept connections after a start or restart.
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// How long [`Host::connect`] waits for a connection before giving up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What a backend does to one of its servers. Implemented once per backend
/// (containers, local processes); the kit holds it as a trait object.
///
/// Implementations only act; [`Host`] tracks the state, refuses operations that make no
/// sense in it, and waits for readiness after a start.
#[async_trait]
pub trait HostControl: Send + Sync + fmt::Debug {
    /// Starts the server of a stopped or killed host (it must not be running).
    async fn start(&self) -> Result<()>;
    /// Shuts the server down cleanly (a fast shutdown: sessions are ended, data flushed).
    async fn stop(&self) -> Result<()>;
    /// Crashes the server: SIGKILL, no shutdown; the next start runs crash recovery.
    async fn kill(&self) -> Result<()>;
    /// Freezes every process of the server: it keeps its sockets but answers nothing.
    async fn pause(&self) -> Result<()>;
    /// Thaws a paused server.
    async fn resume(&self) -> Result<()>;
    /// Removes the server for good (teardown). Must work in every state.
    async fn remove(&self) -> Result<()>;
    /// The end of the server's log, for error messages; empty when not available.
    async fn log_tail(&self) -> String {
        String::new()
    }
}

/// Where a host's server is, as seen from some place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Host name or IP address.
    pub host: String,
    /// TCP port.
    pub port: u16,
}

/// The state of a host, as its fault handles left it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostState {
    /// Accepting connections.
    Running,
    /// Shut down cleanly by [`Host::stop`].
    Stopped,
    /// Crashed by [`Host::kill`].
    Killed,
    /// Frozen by [`Host::pause`].
    Paused,
    /// Removed at teardown.
    Removed,
}

impl HostState {
    fn as_str(self) -> &'static str {
        match self {
            HostState::Running => "running",
            HostState::Stopped => "stopped",
            HostState::Killed => "killed",
            HostState::Paused => "paused",
            HostState::Removed => "removed",
        }
    }
}

/// One PostgreSQL 15 server: its addresses and its fault handles.
///
/// The superuser is `postgres` with trust authentication; there is no password to leak.
/// Addresses stay the same across `stop`/`kill`/`restart`, so URLs a test (or a catalog)
/// recorded keep working once the host is back.
#[derive(Debug)]
pub struct Host {
    name: String,
    admin: Endpoint,
    peer: Endpoint,
    state: Mutex<HostState>,
    control: Box<dyn HostControl>,
}

impl Host {
    /// Wraps a backend's control of a freshly started (running) server.
    pub fn new(name: String, admin: Endpoint, peer: Endpoint, control: Box<dyn HostControl>) -> Self {
        Host { name, admin, peer, state: Mutex::new(HostState::Running), control }
    }

    /// The host's name within its cluster: `pg1`, `pg2`, ...
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the test process reaches the server.
    pub fn endpoint(&self) -> &Endpoint {
        &self.admin
    }

    /// Where the cluster's other servers reach this one (for logical replication).
    pub fn peer_endpoint(&self) -> &Endpoint {
        &self.peer
    }

    /// URL of database `db` as the test process reaches it, as the superuser.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@{}:{}/{db}", self.admin.host, self.admin.port)
    }

    /// URL of the `postgres` database, for administration.
    pub fn admin_url(&self) -> String {
        self.url("postgres")
    }

    /// URL of database `db` as the other servers of the cluster reach it (a libpq
    /// connection string usable in `CREATE SUBSCRIPTION ... CONNECTION`).
    pub fn peer_url(&self, db: &str) -> String {
        format!("postgresql://postgres@{}:{}/{db}", self.peer.host, self.peer.port)
    }

    /// A tokio-postgres configuration for database `db`, with a connect timeout.
    pub fn config(&self, db: &str) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config
            .host(&self.admin.host)
            .port(self.admin.port)
            .user("postgres")
            .dbname(db)
            .application_name("shardline-testkit")
            .connect_timeout(CONNECT_TIMEOUT);
        config
    }

    /// Connects to database `db`; the connection's task runs on the current runtime.
    ///
    /// # Errors
    ///
    /// [`Error::Timeout`] when no connection is made within [`CONNECT_TIMEOUT`] (a
    /// paused host), [`Error::Postgres`] when the server refuses or is down.
    pub async fn connect(&self, db: &str) -> Result<Client> {
        connect(&self.name, &self.config(db), CONNECT_TIMEOUT).await
    }

    /// The state the fault handles left the host in.
    pub fn state(&self) -> HostState {
        *self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_state(&self, state: HostState) {
        *self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = state;
    }

    fn require(&self, op: &'static str, allowed: &[HostState]) -> Result<()> {
        let state = self.state();
        if allowed.contains(&state) {
            Ok(())
        } else {
            Err(Error::InvalidState { host: self.name.clone(), op, state: state.as_str() })
        }
    }

    /// Shuts the server down cleanly. Open sessions are terminated; new connections are
    /// refused until [`Host::start`].
    ///
    /// # Errors
    ///
    /// When the host is not running, or the backend fails.
    pub async fn stop(&self) -> Result<()> {
        self.require("stop", &[HostState::Running])?;
        tracing::info!(host = %self.name, "stopping host");
        self.control.stop().await?;
        self.set_state(HostState::Stopped);
        Ok(())
    }

    /// Crashes the server with SIGKILL: clients see their connections reset, nothing is
    /// shut down cleanly, and the next start performs crash recovery.
    ///
    /// # Errors
    ///
    /// When the host is removed, or the backend fails.
    pub async fn kill(&self) -> Result<()> {
        self.require("kill", &[HostState::Running, HostState::Paused])?;
        tracing::info!(host = %self.name, "killing host");
        self.control.kill().await?;
        self.set_state(HostState::Killed);
        Ok(())
    }

    /// Freezes the server (a hung host): connections stay open, queries get no answer.
    ///
    /// # Errors
    ///
    /// When the host is not running, or the backend fails.
    pub async fn pause(&self) -> Result<()> {
        self.require("pause", &[HostState::Running])?;
        tracing::info!(host = %self.name, "pausing host");
        self.control.pause().await?;
        self.set_state(HostState::Paused);
        Ok(())
    }

    /// Thaws a paused server; queries that were waiting get their answers.
    ///
    /// # Errors
    ///
    /// When the host is not paused, or the backend fails.
    pub async fn resume(&self) -> Result<()> {
        self.require("resume", &[HostState::Paused])?;
        tracing::info!(host = %self.name, "resuming host");
        self.control.resume().await?;
        self.set_state(HostState::Running);
        Ok(())
    }

    /// Starts a stopped or killed server and waits until it accepts connections.
    ///
    /// # Errors
    ///
    /// When the host is running, paused or removed; when it does not become ready.
    pub async fn start(&self) -> Result<()> {
        self.require("start", &[HostState::Stopped, HostState::Killed])?;
        tracing::info!(host = %self.name, "starting host");
        self.control.start().await?;
        self.set_state(HostState::Running);
        self.wait_ready().await
    }

    /// Stops the server cleanly and starts it again.
    ///
    /// # Errors
    ///
    /// As [`Host::stop`] and [`Host::start`].
    pub async fn restart(&self) -> Result<()> {
        self.stop().await?;
        self.start().await
    }

    /// Brings the host back to running, whatever its fault handles did to it.
    ///
    /// # Errors
    ///
    /// When the host is removed or does not come back.
    pub async fn heal(&self) -> Result<()> {
        match self.state() {
            HostState::Running => self.wait_ready().await,
            HostState::Paused => self.resume().await,
            HostState::Stopped | HostState::Killed => self.start().await,
            HostState::Removed => Err(Error::InvalidState {
                host: self.name.clone(),
                op: "heal",
                state: HostState::Removed.as_str(),
            }),
        }
    }

    /// Removes the server for good (teardown).
    ///
    /// # Errors
    ///
    /// When the backend fails to remove it.
    pub async fn remove(&self) -> Result<()> {
        if self.state() == HostState::Removed {
            return Ok(());
        }
        self.control.remove().await?;
        self.set_state(HostState::Removed);
        Ok(())
    }

    /// Waits until the server answers `SELECT 1`.
    ///
    /// # Errors
    ///
    /// [`Error::NotReady`] with the last connection error and the end of the server log.
    pub async fn wait_ready(&self) -> Result<()> {
        let started = Instant::now();
        let config = self.config("postgres");
        let mut last_error;
        loop {
            match connect(&self.name, &config, Duration::from_secs(5)).await {
                Ok(client) => match client.simple_query("SELECT 1").await {
                    Ok(_) => return Ok(()),
                    Err(e) => last_error = e.to_string(),
                },
                Err(e) => last_error = error_chain(&e),
            }
            if started.elapsed() > READY_TIMEOUT {
                let tail = self.control.log_tail().await;
                let log = if tail.is_empty() { tail } else { format!("\n--- server log ---\n{tail}") };
                return Err(Error::NotReady {
                    host: self.name.clone(),
                    waited: started.elapsed(),
                    last_error,
                    log,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Connects with `config`, spawning the connection task, within `timeout`.
pub(crate) async fn connect(
    host: &str,
    config: &tokio_postgres::Config,
    timeout: Duration,
) -> Result<Client> {
    let connecting = config.connect(NoTls);
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok((client, connection))) => {
            let host = host.to_owned();
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(%host, error = %e, "test connection ended");
                }
            });
            Ok(client)
        }
        Ok(Err(source)) => Err(Error::Postgres { host: host.to_owned(), what: "connecting".into(), source }),
        Err(_) => Err(Error::Timeout { host: host.to_owned(), what: "connecting", after: timeout }),
    }
}

/// An error and its sources on one line.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
