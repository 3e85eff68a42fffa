//! Choosing a backend, and what a backend must do.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;

use crate::{Error, Host, Result};

/// The environment variable that picks the backend: `docker`, `local`, or unset.
pub const BACKEND_ENV: &str = "SHARDLINE_TEST_BACKEND";

/// The environment variable naming the Docker image (default [`DEFAULT_IMAGE`]).
pub const IMAGE_ENV: &str = "SHARDLINE_PG_IMAGE";

/// The image users elsewhere expect: the official PostgreSQL 15 image. Where no registry
/// can be reached, `scripts/pg-image.sh` builds an equivalent under this name.
pub const DEFAULT_IMAGE: &str = "postgres:15";

/// The environment variable naming the directory of the local PostgreSQL binaries
/// (default `/usr/lib/postgresql/15/bin`).
pub const PG_BIN_ENV: &str = "SHARDLINE_PG_BIN";

/// Where a cluster's servers run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// One container per host via testcontainers, all on one Docker network.
    Docker,
    /// One `postgres` process per host from the installed binaries, on loopback ports.
    Local,
}

impl BackendKind {
    /// The name used in `SHARDLINE_TEST_BACKEND`.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Docker => "docker",
            BackendKind::Local => "local",
        }
    }

    /// Reads [`BACKEND_ENV`]: `Ok(None)` when unset or empty (choose automatically).
    ///
    /// # Errors
    ///
    /// [`Error::UnknownBackend`] for any other value than `docker` or `local`.
    pub fn from_env() -> Result<Option<BackendKind>> {
        match std::env::var(BACKEND_ENV) {
            Ok(v) if v.trim().is_empty() => Ok(None),
            Ok(v) => v.parse().map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => {
                Err(Error::UnknownBackend { value: v.to_string_lossy().into_owned() })
            }
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for BackendKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "docker" => Ok(BackendKind::Docker),
            "local" => Ok(BackendKind::Local),
            other => Err(Error::UnknownBackend { value: other.to_owned() }),
        }
    }
}

/// A way to run PostgreSQL servers. The kit holds the chosen one as a trait object.
#[async_trait]
pub trait Backend: Send + Sync + fmt::Debug {
    /// Which backend this is.
    fn kind(&self) -> BackendKind;

    /// Starts the server of host number `index` (0-based; named `pg{index+1}`) with
    /// `settings` (every `-c key=value` it runs with), waits until it accepts
    /// connections and returns it.
    async fn start_host(&self, index: usize, settings: &[(String, String)]) -> Result<Host>;

    /// An address of the test process that the servers can reach, for a
    /// [`crate::link::Link`] they connect through: loopback for local processes, the
    /// Docker network's gateway for containers. Call it after a host started.
    async fn peer_listen_ip(&self) -> Result<String>;

    /// Releases what the backend holds beside its hosts (network, directories). Called
    /// after every host was removed.
    async fn shutdown(&self) -> Result<()>;
}

/// Why the docker backend cannot run here, or `None` when an engine answers.
pub(crate) async fn docker_unavailable() -> Option<String> {
    let probe = tokio::process::Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(15), probe).await {
        Err(_) => Some("`docker version` did not answer within 15 s".into()),
        Ok(Err(e)) => Some(format!("cannot run the docker command ({e})")),
        Ok(Ok(out)) if out.status.success() => None,
        Ok(Ok(out)) => {
            Some(format!("no Docker engine answers ({})", String::from_utf8_lossy(&out.stderr).trim()))
        }
    }
}
