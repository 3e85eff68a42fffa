//! The test kit's error type.

use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong while starting, faulting or tearing down test hosts.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `SHARDLINE_TEST_BACKEND` holds a value other than the allowed ones.
    #[error(
        "SHARDLINE_TEST_BACKEND={value:?} is not a backend; allowed: docker, local (or unset to choose automatically)"
    )]
    UnknownBackend {
        /// The value found in the environment.
        value: String,
    },

    /// Neither backend can run on this machine.
    #[error(
        "no PostgreSQL test backend can start here. docker: {docker}. local: {local}. \
         Install Docker and run scripts/pg-image.sh, or install PostgreSQL 15's server \
         (Debian: apt-get install postgresql-15)"
    )]
    NoBackend {
        /// Why the docker backend cannot run.
        docker: String,
        /// Why the local-process backend cannot run.
        local: String,
    },

    /// The chosen backend cannot run on this machine.
    #[error("the {backend} backend cannot start: {reason}")]
    BackendUnavailable {
        /// The backend that was asked for.
        backend: &'static str,
        /// What is missing.
        reason: String,
    },

    /// A host was asked for by an index past the cluster's last.
    #[error("host number {index} asked for, but the cluster has {hosts} hosts")]
    NoSuchHost {
        /// The 0-based index asked for.
        index: usize,
        /// How many hosts there are.
        hosts: usize,
    },

    /// A Docker operation failed.
    #[error("docker: {op} on host {host}")]
    Docker {
        /// The host (container) concerned.
        host: String,
        /// What was being done.
        op: &'static str,
        /// The error from testcontainers.
        #[source]
        source: Box<testcontainers::TestcontainersError>,
    },

    /// A helper program exited with failure.
    #[error("`{program}` failed ({status}): {stderr}")]
    Command {
        /// The program and its first arguments.
        program: String,
        /// How it ended.
        status: String,
        /// The end of what it printed on stderr.
        stderr: String,
    },

    /// A file-system or process operation failed.
    #[error("{what} ({path})")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path or program concerned.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// Sending a signal to a local server failed.
    #[error("sending {signal} to host {host} (pid {pid})")]
    Signal {
        /// The host concerned.
        host: String,
        /// The signal's name.
        signal: &'static str,
        /// The process it was sent to.
        pid: i32,
        /// The error from the kernel.
        #[source]
        source: nix::Error,
    },

    /// A host did not accept connections in time after (re)starting.
    #[error("host {host} did not accept connections within {waited:?}: {last_error}{log}")]
    NotReady {
        /// The host concerned.
        host: String,
        /// How long the kit waited.
        waited: Duration,
        /// The last connection error seen.
        last_error: String,
        /// The end of the server's log, where the kit has one (may be empty).
        log: String,
    },

    /// A fault handle was used on a host in a state where it makes no sense.
    #[error("host {host}: cannot {op} while it is {state}")]
    InvalidState {
        /// The host concerned.
        host: String,
        /// The operation asked for.
        op: &'static str,
        /// The host's current state.
        state: &'static str,
    },

    /// A query the kit itself sends (database creation, readiness) failed.
    #[error("postgres on host {host}: {what}")]
    Postgres {
        /// The host concerned.
        host: String,
        /// What was being done.
        what: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// Connecting to a host took longer than the kit's timeout.
    #[error("host {host}: {what} timed out after {after:?}")]
    Timeout {
        /// The host concerned.
        host: String,
        /// What was being done.
        what: &'static str,
        /// The timeout that ran out.
        after: Duration,
    },

    /// A test certificate could not be made.
    #[error("making a test certificate: {message}")]
    Certificate {
        /// What rcgen said.
        message: String,
    },
    /// A name given to the kit cannot be used as a database name.
    #[error("{name:?} cannot name a test database: {reason}")]
    BadName {
        /// The name given.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A name given to the kit cannot name a role, or a file on a host.
    #[error("{name:?} cannot name a {what}: {reason}")]
    BadIdentifier {
        /// The name given.
        name: String,
        /// What it was to name.
        what: &'static str,
        /// Why it was refused.
        reason: &'static str,
    },
}

/// The test kit's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

const _: () = {
    const fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<Error>();
};
