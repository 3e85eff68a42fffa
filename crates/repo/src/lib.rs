//! What applications call: the catalog client, one connection pool per physical host,
//! routed inserts, reads by ID, pages and fan-out.
//!
//! So far it holds the [`catalog`] client (the cluster's parameters, the shard map and
//! its change notifications) and [`ids::ShardIdGenerator`], which mints IDs in the
//! application from blocks reserved from a shard's own sequence. Routed queries arrive
//! with the `[repo]` issue.
//!
//! # Layout
//!
//! - [`catalog`]: the catalog schema, connecting, reading the map, `LISTEN`ing for changes.
//! - [`ids`]: application-side minting from reserved blocks.
//! - [`Error`]: the crate's error type.
#![forbid(unsafe_code)]

pub mod catalog;
pub mod ids;

pub use catalog::{Catalog, ClusterInfo};

/// The driver this crate runs on, re-exported so versions cannot drift.
pub use tokio_postgres;

/// What can go wrong talking to a shard.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A statement on a shard failed.
    #[error("shard {shard}: {what} failed (SQLSTATE {})", sqlstate.as_deref().unwrap_or("none"))]
    Db {
        /// The logical shard.
        shard: u32,
        /// What was being done.
        what: &'static str,
        /// The SQLSTATE, when the server sent one.
        sqlstate: Option<String>,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The shard's `reserve_ids` returned no values (its minter is not the one this
    /// crate installs).
    #[error("shard {shard}: reserve_ids returned no values")]
    EmptyReservation {
        /// The logical shard.
        shard: u32,
    },
    /// An ID could not be made or checked.
    #[error(transparent)]
    Id(#[from] shardline_id::Error),
    /// A connection URL that does not parse. The URL itself is never part of the
    /// message: it may hold a password.
    #[error("{target}: the connection URL is not valid: {message}")]
    BadUrl {
        /// What the URL is for: `catalog` or `host pg1`.
        target: String,
        /// The driver's complaint.
        message: String,
    },
    /// A server that cannot be reached or refuses the connection.
    #[error("{target} is unreachable: {source}")]
    Connect {
        /// What was being reached: `catalog` or `host pg1`.
        target: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// A statement on the catalog failed.
    #[error("catalog: {what} failed (SQLSTATE {}): {source}", sqlstate.as_deref().unwrap_or("none"))]
    Catalog {
        /// What was being done.
        what: &'static str,
        /// The SQLSTATE, when the server sent one.
        sqlstate: Option<String>,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The catalog has not been created: run `shardline init` first.
    #[error("the catalog is not initialised: run `shardline init` first")]
    NotInitialised,
    /// The catalog holds something this version cannot use.
    #[error("the catalog is not valid: {reason}")]
    InvalidCatalog {
        /// What is wrong.
        reason: String,
    },
    /// The config contradicts the catalog on a value fixed at `init`.
    #[error(
        "the config says {key} = {config}, but the cluster was initialised with {key} = {catalog}; \
         it cannot change (fix the config)"
    )]
    Mismatch {
        /// The config key.
        key: &'static str,
        /// The catalog's value.
        catalog: String,
        /// The config's value.
        config: String,
    },
}

impl Error {
    pub(crate) fn db(shard: u32, what: &'static str, source: tokio_postgres::Error) -> Self {
        let sqlstate = source.code().map(|c| c.code().to_owned());
        Error::Db { shard, what, sqlstate, source }
    }

    pub(crate) fn catalog(what: &'static str, source: tokio_postgres::Error) -> Self {
        let sqlstate = source.code().map(|c| c.code().to_owned());
        Error::Catalog { what, sqlstate, source }
    }

    /// The SQLSTATE of a database error, if any.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Db { sqlstate, .. } | Error::Catalog { sqlstate, .. } => sqlstate.as_deref(),
            Error::Connect { source, .. } => source.code().map(tokio_postgres::error::SqlState::code),
            _ => None,
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

const _: () = {
    const fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<Error>();
};
