//! A set of independent PostgreSQL servers for one test binary (or one demo).

use std::time::{Duration, Instant};

use futures::future::try_join_all;

use crate::backend::{Backend, BackendKind, DEFAULT_IMAGE, IMAGE_ENV, docker_unavailable};
use crate::docker::DockerBackend;
use crate::link::Link;
use crate::local::LocalBackend;
use crate::{Error, Host, Result};

/// N independent PostgreSQL 15 servers, each with `wal_level=logical`, room for
/// replication slots and WAL senders, and `fsync=off`.
///
/// Start one per test binary and share it; give each test its own databases
/// ([`Cluster::create_database`], or the harness's `TestContext::databases`). Call
/// [`Cluster::shutdown`] at the end: servers also die with the process, but only an
/// orderly shutdown removes containers at once.
#[derive(Debug)]
pub struct Cluster {
    backend: Box<dyn Backend>,
    hosts: Vec<Host>,
    startup: Duration,
}

impl Cluster {
    /// Starts `hosts` servers on the backend `SHARDLINE_TEST_BACKEND` names: `docker`,
    /// `local`, or unset for docker when an engine answers and local otherwise. The
    /// choice is printed on stderr.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownBackend`] for a bad variable; [`Error::NoBackend`] (saying what to
    /// install) when neither backend can run; the backend's error when a host does not
    /// start.
    pub async fn start(hosts: usize) -> Result<Cluster> {
        Cluster::start_on(BackendKind::from_env()?, hosts).await
    }

    /// Starts `hosts` servers on `backend`, or on the automatic choice when `None`.
    ///
    /// # Errors
    ///
    /// As [`Cluster::start`].
    pub async fn start_on(backend: Option<BackendKind>, hosts: usize) -> Result<Cluster> {
        Cluster::start_configured(backend, hosts, &[]).await
    }

    /// As [`Cluster::start`], with `overrides` of the kit's [`crate::server_settings`]
    /// (a key of both takes the override's value; a new key is added). For a host with
    /// Postgres's stock limits, pass [`crate::stock_limits`].
    ///
    /// # Errors
    ///
    /// As [`Cluster::start`].
    pub async fn start_with(hosts: usize, overrides: &[(&str, &str)]) -> Result<Cluster> {
        let overrides: Vec<(String, String)> =
            overrides.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        Cluster::start_configured(BackendKind::from_env()?, hosts, &overrides).await
    }

    async fn start_configured(
        backend: Option<BackendKind>,
        hosts: usize,
        overrides: &[(String, String)],
    ) -> Result<Cluster> {
        let began = Instant::now();
        let backend = choose(backend).await?;
        let settings = crate::settings_with(overrides);
        let settings = &settings;
        let started = try_join_all((0..hosts).map(|i| backend.start_host(i, settings))).await;
        let hosts = match started {
            Ok(hosts) => hosts,
            Err(e) => {
                // Hosts that did start were dropped (and so removed) by try_join_all.
                let _ = backend.shutdown().await;
                return Err(e);
            }
        };
        let startup = began.elapsed();
        tracing::info!(backend = %backend.kind(), hosts = hosts.len(), ?startup, "cluster started");
        Ok(Cluster { backend, hosts, startup })
    }

    /// Removes what test processes that no longer exist left behind: containers (and
    /// their networks) of the docker backend, data directories of the local one. Every
    /// start does this; it is public so tests can show it works.
    pub async fn remove_leftovers() {
        crate::docker::remove_leftovers().await;
        crate::local::remove_leftovers(&crate::local::scratch_parent());
    }

    /// Which backend runs the servers.
    pub fn backend(&self) -> BackendKind {
        self.backend.kind()
    }

    /// The servers, in order: `pg1`, `pg2`, ...
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// A [`Link`] from the test process to host number `index` (0-based): connect
    /// through [`Link::url`] instead of [`Host::url`] and [`Link::cut`] partitions the
    /// host from the test process alone; the other servers still reach it.
    ///
    /// # Errors
    ///
    /// [`Error::NoSuchHost`] for an index past the last host; [`Error::Io`] when no
    /// port can be had.
    pub async fn link(&self, index: usize) -> Result<Link> {
        let host = self.host_at(index)?;
        Link::start(&format!("test process to {}", host.name()), "127.0.0.1", host.endpoint().clone()).await
    }

    /// A [`Link`] the cluster's other servers reach host number `index` through: give
    /// [`Link::url`] as the host's peer URL (where a move's subscription connects) and
    /// [`Link::cut`] partitions the host from its peers alone; the test process still
    /// reaches it. On both backends: the relay listens where the servers can reach the
    /// test process (loopback, or the Docker network's gateway).
    ///
    /// # Errors
    ///
    /// As [`Cluster::link`]; the backend's error when its listening address cannot be
    /// read.
    pub async fn peer_link(&self, index: usize) -> Result<Link> {
        let host = self.host_at(index)?;
        let ip = self.backend.peer_listen_ip().await?;
        Link::start(&format!("peers to {}", host.name()), &ip, host.endpoint().clone()).await
    }

    fn host_at(&self, index: usize) -> Result<&Host> {
        self.hosts.get(index).ok_or(Error::NoSuchHost { index, hosts: self.hosts.len() })
    }

    /// How long [`Cluster::start`] took, backend choice included.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// Creates database `name` on every host.
    ///
    /// # Errors
    ///
    /// [`Error::BadName`] unless `name` is 1–63 bytes of `[a-z0-9_]` starting with a
    /// letter; [`Error::Postgres`] when a host refuses (for example, it exists already).
    pub async fn create_database(&self, name: &str) -> Result<()> {
        check_database_name(name)?;
        try_join_all(self.hosts.iter().map(|host| async move {
            let client = host.connect("postgres").await?;
            client.batch_execute(&format!("CREATE DATABASE \"{name}\"")).await.map_err(|source| {
                Error::Postgres {
                    host: host.name().to_owned(),
                    what: format!("creating database {name}"),
                    source,
                }
            })
        }))
        .await
        .map(drop)
    }

    /// Brings every host back to running (resumes paused ones, starts stopped or killed
    /// ones), for use after a test that faulted hosts.
    ///
    /// # Errors
    ///
    /// When a host does not come back.
    pub async fn heal(&self) -> Result<()> {
        try_join_all(self.hosts.iter().map(Host::heal)).await.map(drop)
    }

    /// Removes every server and what the backend made for them.
    ///
    /// # Errors
    ///
    /// The first failure; every host is still attempted.
    pub async fn shutdown(&self) -> Result<()> {
        let mut first = None;
        for host in &self.hosts {
            if let Err(e) = host.remove().await {
                first.get_or_insert(e);
            }
        }
        if let Err(e) = self.backend.shutdown().await {
            first.get_or_insert(e);
        }
        first.map_or(Ok(()), Err)
    }
}

/// Checks that `name` can be used unquoted-safe as a database name.
pub(crate) fn check_database_name(name: &str) -> Result<()> {
    let bad = |reason| Err(Error::BadName { name: name.to_owned(), reason });
    if name.is_empty() || name.len() > 63 {
        return bad("must be 1 to 63 bytes");
    }
    if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        return bad("must start with a lowercase ASCII letter");
    }
    if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
        return bad("may hold only lowercase ASCII letters, digits and underscores");
    }
    Ok(())
}

async fn choose(asked: Option<BackendKind>) -> Result<Box<dyn Backend>> {
    let image = std::env::var(IMAGE_ENV)
        .ok()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_IMAGE.to_owned());
    match asked {
        Some(BackendKind::Docker) => {
            if let Some(reason) = docker_unavailable().await {
                return Err(Error::BackendUnavailable { backend: "docker", reason });
            }
            eprintln!("shardline-testkit: docker backend (SHARDLINE_TEST_BACKEND=docker), image {image}");
            Ok(Box::new(DockerBackend::new(image).await?))
        }
        Some(BackendKind::Local) => {
            let backend = LocalBackend::new()?;
            eprintln!("shardline-testkit: local backend (SHARDLINE_TEST_BACKEND=local)");
            Ok(Box::new(backend))
        }
        None => {
            let docker = match docker_unavailable().await {
                None => match DockerBackend::new(image.clone()).await {
                    Ok(b) => {
                        eprintln!(
                            "shardline-testkit: docker backend (SHARDLINE_TEST_BACKEND unset; a Docker engine answers), image {image}"
                        );
                        return Ok(Box::new(b));
                    }
                    Err(e) => e.to_string(),
                },
                Some(reason) => reason,
            };
            match LocalBackend::new() {
                Ok(b) => {
                    eprintln!(
                        "shardline-testkit: local backend (SHARDLINE_TEST_BACKEND unset; docker cannot run: {docker})"
                    );
                    Ok(Box::new(b))
                }
                Err(e) => Err(Error::NoBackend { docker, local: e.to_string() }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::check_database_name;

    #[test]
    fn database_names_are_checked() {
        assert!(check_database_name("t1_cluster_tables").is_ok());
        assert!(check_database_name(&"a".repeat(63)).is_ok());
        for bad in ["", "1abc", "Abc", "a-b", "a\"; DROP DATABASE x; --", "ä", &"a".repeat(64)] {
            let err = check_database_name(bad).unwrap_err();
            assert!(err.to_string().contains("cannot name a test database"), "{bad:?}: {err}");
        }
    }
}
