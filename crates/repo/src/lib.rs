//! What applications call: the catalog client, one connection pool per physical host,
//! routed inserts, reads by ID, pages and fan-out.
//!
//! So far it holds [`ids::ShardIdGenerator`], which mints IDs in the application from
//! blocks reserved from a shard's own sequence. The rest arrives with the `[repo]` issue.
//!
//! # Layout
//!
//! - [`ids`]: application-side minting from reserved blocks.
//! - [`Error`]: the crate's error type.
#![forbid(unsafe_code)]

pub mod ids;

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
}

impl Error {
    pub(crate) fn db(shard: u32, what: &'static str, source: tokio_postgres::Error) -> Self {
        let sqlstate = source.code().map(|c| c.code().to_owned());
        Error::Db { shard, what, sqlstate, source }
    }

    /// The SQLSTATE of a database error, if any.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Db { sqlstate, .. } => sqlstate.as_deref(),
            Error::EmptyReservation { .. } | Error::Id(_) => None,
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

const _: () = {
    const fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<Error>();
};
