//! What applications call: the cluster handle (the catalog's shard map, one connection
//! pool per physical host), and repositories of entities with routed inserts, reads by
//! ID, pages, fan-out and transactions inside one shard.
//!
//! ```no_run
//! use shardline_repo::{Cluster, ClusterOptions, Entity, Id, NewRow};
//!
//! #[derive(Debug, Entity)]
//! #[shardline(table = "photos")]
//! struct Photo {
//!     id: Id,
//!     #[shardline(user)]
//!     user_id: i64,
//!     caption: String,
//! }
//!
//! #[derive(NewRow)]
//! #[shardline(entity = Photo)]
//! struct NewPhoto {
//!     #[shardline(user)]
//!     user_id: i64,
//!     caption: String,
//! }
//!
//! # async fn run(config: shardline_router::Config) -> Result<(), shardline_repo::Error> {
//! let cluster = Cluster::connect(&config, ClusterOptions::default()).await?;
//! let photos = cluster.repo::<Photo>()?;
//! let photo = photos.insert(&NewPhoto { user_id: 42, caption: "sunset".into() }).await?;
//! // The ID carries its shard: this read goes straight to the right host.
//! assert_eq!(photos.get(photo.id).await?.map(|p| p.caption), Some("sunset".into()));
//! let page = photos.page_of_user(42, None, 20).await?;
//! # let _ = page; Ok(()) }
//! ```
//!
//! # Layout
//!
//! - [`cluster`]: [`Cluster`], the handle: map, pools, refresh on change.
//! - [`entity`]: [`Entity`] and [`NewRow`], by hand or derived.
//! - [`repository`]: [`Repo`], an entity's routed operations.
//! - [`shard`]: transactions inside one shard, and work on every shard.
//! - [`catalog`]: the catalog schema, connecting, reading the map, `LISTEN`ing for changes.
//! - [`ids`]: application-side minting from reserved blocks.
//! - `sqlx` (feature `sqlx`): sqlx queries on routed shards, through the same map,
//!   retry path, timeouts and errors.
//! - [`Error`]: the crate's error type.
#![forbid(unsafe_code)]

pub mod catalog;
pub mod cluster;
pub mod credentials;
pub mod entity;
pub mod ids;
mod pooler;
pub mod repository;
pub mod shard;
#[cfg(feature = "sqlx")]
pub mod sqlx;
mod statement;
mod tls;

/// The name of the trigger that guards a move's copy of a shard (a move's new copy on
/// its target, or a revert's old copy, `shardline move --revert`) on a host that is not
/// the shard's yet: statement-level on each of the copy's tables, fired in normal
/// sessions only (not in the replication worker that brings the copy up to date, nor in
/// the move's own sessions), it fails a write there with 3F000, as on a host the shard
/// has left, so a router with a map from before an earlier move retries where the shard
/// is. It lets writes through once the move's marker row, replicated from the shard's
/// host, says its flip is decided; the mover drops it right after the decision, and its
/// clean-up and `shardline gc` drop any left. (The name is from when only reverts had
/// it.)
pub const REVERT_GUARD: &str = "shardline_revert_guard";

/// The function each shard schema holds that says whether the schema is the shard's on
/// its host: on the shard's own copy it returns `true` (a SQL function the planner
/// inlines and folds away: about 10 µs of server time when a statement is planned, so
/// on each unnamed statement, and nothing on a kept one; docs/benchmarks.md, *The live
/// check*); on a move's copy that is not the shard's
/// until its flip (the copies [`REVERT_GUARD`] guards) it fails with 3F000, until the
/// move's marker there says the flip is decided. Every read the repository sends names
/// it beside its shard's tables (`WHERE ... AND "shard_0007".shardline_live()`), as does
/// a shard transaction's `BEGIN`: a router whose map is a move or more behind, sent to a
/// copy still being filled, finds the shard moved and reads where it is, instead of
/// reading a part of its rows. Installed with each shard's minter (`init`, `migrate`,
/// a move's copy); an application of this version needs `shardline migrate` of this
/// version run first.
pub const LIVE_CHECK: &str = "shardline_live";

pub use catalog::{Catalog, ClusterInfo, Prepared};
pub use cluster::{Cluster, ClusterOptions, LONGEST_OPTION, MOST_CONNECTIONS};
pub use entity::{Entity, NewRow, ShardKey};
pub use repository::{Counted, FanOut, Many, Missing, Page, Repo};
pub use shard::{ShardResult, ShardTx};
pub use shardline_derive::{Entity, NewRow};
pub use shardline_id::Id;
use shardline_router::{HostName, LogicalShard};
#[cfg(feature = "sqlx")]
pub use sqlx::Sqlx;

/// The driver this crate runs on, re-exported so versions cannot drift.
pub use tokio_postgres;

/// The user a connection string that names none connects as, as tokio-postgres decides
/// it: the process's (not `PGUSER`, which only libpq and sqlx read). The one place that
/// decides it for the sqlx path and the passfile's lookup. `None` when the operating
/// system does not say.
pub(crate) fn driver_user() -> Option<String> {
    whoami::username().ok()
}

/// Runs this test binary's test `test` again, alone, in a process whose environment
/// also holds `env`; panics unless it passed. For tests of what the environment must
/// not change (a test cannot set a variable in its own process: others read it).
#[cfg(test)]
pub(crate) fn rerun_with_env(test: &str, env: &[(&str, &str)]) {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("{e}"));
    let out = std::process::Command::new(exe)
        .args(["--exact", test])
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.contains("1 passed"),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What can go wrong talking to a shard.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A statement on a shard failed.
    #[error("shard {shard}: {what} failed (SQLSTATE {})", msg::sqlstate(sqlstate))]
    Db {
        /// The logical shard.
        shard: LogicalShard,
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
        shard: LogicalShard,
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
    /// TLS could not be set up: the trusted certificates named by `sslrootcert` cannot be
    /// read, or the server's certificate was refused. Not retryable: the configuration
    /// or the server's certificate must change.
    #[error("{target}: TLS: {message}")]
    Tls {
        /// What was being reached: `catalog` or `host pg1`.
        target: String,
        /// What is wrong, naming the file or the certificate problem.
        message: String,
    },
    /// A server that cannot be reached or refuses the connection.
    #[error("{target} is unreachable")]
    Connect {
        /// What was being reached: `catalog` or `host pg1`.
        target: String,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// A server took the connection but did not finish its start-up within the connect
    /// timeout: it is hung (paused, out of processes) or cut off behind something that
    /// accepted for it. The driver's own timeout covers only the TCP connect.
    #[error("{target} is unreachable: no answer to the connection's start-up within {after:?}")]
    ConnectTimeout {
        /// What was being reached: `catalog` or `host pg1`.
        target: String,
        /// The connect timeout.
        after: std::time::Duration,
    },
    /// The catalog did not answer a read of the map (or of a move) within
    /// [`ClusterOptions::host_timeout`]: it is hung, or the link to it is cut. The
    /// handle's connection to it is dropped; the next read connects anew.
    #[error("the catalog did not answer within {after:?}")]
    CatalogTimeout {
        /// The time allowed ([`ClusterOptions::host_timeout`]).
        after: std::time::Duration,
    },
    /// The cancel of a statement that ran out of time could not be sent (the statement
    /// may run on).
    #[error("{target}: the cancel request could not be sent: {message}")]
    Cancel {
        /// Where it was sent: `host pg1`.
        target: String,
        /// Why, as the socket, TLS or driver said it.
        message: String,
    },
    /// A statement on the catalog failed.
    #[error("catalog: {what} failed (SQLSTATE {})", msg::sqlstate(sqlstate))]
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
    /// A statement on a host failed.
    #[error("host {host}{}: {what} failed (SQLSTATE {})", msg::of_shard(shard), msg::sqlstate(sqlstate))]
    Host {
        /// The host.
        host: HostName,
        /// The logical shard, when the statement was for one.
        shard: Option<LogicalShard>,
        /// What was being done.
        what: &'static str,
        /// The SQLSTATE, when the server sent one.
        sqlstate: Option<String>,
        /// The driver's error.
        #[source]
        source: Option<tokio_postgres::Error>,
    },
    /// A sqlx statement on a host failed ([`crate::sqlx`]).
    #[cfg(feature = "sqlx")]
    #[error("host {host}{}: {what} failed (SQLSTATE {})", msg::of_shard(shard), msg::sqlstate(sqlstate))]
    Sqlx {
        /// The host.
        host: HostName,
        /// The logical shard, when the work was for one.
        shard: Option<LogicalShard>,
        /// What was being done: `begin` (a connection, `BEGIN` and the `search_path`),
        /// `work` (the caller's statements), `work (connection lost)` (the caller's
        /// statements failed and the connection was lost before shardline could tell
        /// whether the closure had committed by itself), `commit` (a check that the transaction is
        /// not aborted, and `COMMIT`, in one round trip); `statement` (the caller's
        /// statements outside a transaction, [`crate::Sqlx::statement`]), `connect`
        /// (a connection for one; nothing sent).
        what: &'static str,
        /// The SQLSTATE, when the server sent one.
        sqlstate: Option<String>,
        /// sqlx's error.
        #[source]
        source: ::sqlx::Error,
    },
    /// A host did not answer within the host timeout.
    #[error("host {host} did not answer within {after:?} (a write may or may not have been applied)")]
    Timeout {
        /// The host.
        host: HostName,
        /// The timeout.
        after: std::time::Duration,
    },
    /// No connection to a host could be had from its pool in time.
    #[error("host {host}: no connection: {message}")]
    Pool {
        /// The host.
        host: HostName,
        /// The pool's reason (a connect failure or a wait timeout).
        message: String,
        /// Whether the pool gave up waiting (rather than failing to connect).
        timed_out: bool,
    },
    /// A value could not be sent as a statement's parameter (a Rust type the column's
    /// type does not accept, or too few or too many values): the statement never reached
    /// the server, so nothing was applied, and running it again fails the same way.
    #[error("host {host}: {what}: parameter {parameter} could not be sent as {expected}")]
    Unsent {
        /// The host.
        host: HostName,
        /// The logical shard, when the statement was for one.
        shard: Option<LogicalShard>,
        /// What was being done.
        what: &'static str,
        /// The parameter, counted from 1 (0 when the number of values was wrong).
        parameter: usize,
        /// The Postgres type the server expects there.
        expected: String,
        /// Why the value could not be encoded.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A transaction in one shard ended in `ROLLBACK` although its work returned `Ok`:
    /// a statement inside it failed and the closure handled that error, which leaves a
    /// Postgres transaction aborted. Nothing of it was applied.
    #[error("host {host}, shard {shard}: the transaction was rolled back: a statement inside it failed")]
    RolledBack {
        /// The host.
        host: HostName,
        /// The logical shard.
        shard: LogicalShard,
    },
    /// The closure of a shard transaction ([`Cluster::transaction`], or `Sqlx::transaction` with the `sqlx` feature)
    /// ended shardline's transaction itself: a raw `COMMIT` or `ROLLBACK` in its SQL, or
    /// sqlx's `begin()` and its end. What it applied is what those statements said, and
    /// the statements it sent after them ran on their own, each its own transaction: so
    /// the outcome is unknown ([`Error::outcome_unknown`]), and the work is not run
    /// again.
    #[error(
        "host {host}, shard {shard}: the closure ended the transaction itself (a COMMIT or ROLLBACK in \
         its SQL, or sqlx's begin() and its end); what it applied is what those said, and it is not \
         run again"
    )]
    TransactionEnded {
        /// The host.
        host: HostName,
        /// The logical shard.
        shard: LogicalShard,
    },
    /// Part of an [`Repo::insert_many`] was committed and part was not: `committed`
    /// names the hosts whose rows are in (each host's part is one transaction, so whole);
    /// `source` is why another host's part failed.
    #[error(
        "insert many: the rows of {} committed, the part of {} failed{}",
        msg::list(committed),
        msg::host_or_any(failed),
        match unknown_rows.len() {
            0 => String::new(),
            n => format!("; {n} rows' outcome is unknown"),
        }
    )]
    #[non_exhaustive]
    InsertMany {
        /// The hosts whose part of the batch committed.
        committed: Vec<HostName>,
        /// The rows that committed, as indices into the batch given, in order.
        committed_rows: Vec<usize>,
        /// The rows whose outcome is unknown, as indices into the batch given, in order:
        /// each may or may not be stored (read them back before inserting them again).
        /// They are every row of each host's part that failed with an unknown outcome
        /// (a timeout, a lost connection), not only the part of the host `failed` names.
        /// The rows in neither list were not applied.
        unknown_rows: Vec<usize>,
        /// The host whose part failed (`source` says how; when another failed part's
        /// outcome is unknown, that one is reported); `None` when the failure names no
        /// host. Other hosts' parts may have failed too: `unknown_rows` counts them.
        failed: Option<HostName>,
        /// The failure of the first host that did not commit.
        #[source]
        source: Box<Error>,
    },
    /// The map places shards on a host that neither the config nor the catalog gives an
    /// address for (or that the handle has no pool for).
    #[error(
        "the shard map places shards on host {host}, which neither the config nor the catalog gives an address for"
    )]
    UnknownHost {
        /// The host.
        host: HostName,
    },
    /// A host's password could not be had from the application's credentials
    /// (see [`credentials`]).
    #[error("no password for host {host}: {message}")]
    Credentials {
        /// The host.
        host: HostName,
        /// Why (never the secret).
        message: String,
    },
    /// A table or column name that is not a plain SQL identifier.
    #[error("{what} {name:?} is not a plain SQL identifier (lowercase ASCII letters, digits, _)")]
    InvalidIdentifier {
        /// What the name is for.
        what: &'static str,
        /// The name.
        name: String,
    },
    /// A row that does not map onto its entity.
    #[error("a row of {table} does not match its entity")]
    Decode {
        /// The table.
        table: &'static str,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// A statement that should return a row returned none.
    #[error("{what} returned no row")]
    Empty {
        /// The statement.
        what: &'static str,
    },
    /// An argument that cannot be used.
    #[error("{what}")]
    Invalid {
        /// What is wrong.
        what: String,
    },
    /// Routing refused (an ID whose shard the cluster does not have, ...).
    #[error(transparent)]
    Router(#[from] shardline_router::Error),
    /// A row or ID of another shard given to a transaction in one shard.
    #[error("{what}: the row belongs to shard {shard}, but the transaction is in shard {transaction}")]
    WrongShard {
        /// The operation.
        what: &'static str,
        /// The shard of the row or ID.
        shard: LogicalShard,
        /// The transaction's shard.
        transaction: LogicalShard,
    },
    /// A row came back from a statement with an ID minted by another shard than the one
    /// the statement was sent to: the statement ran somewhere else than shardline sent
    /// it (a misrouted connection, a schema renamed under it, or, behind a
    /// transaction-mode pooler without [`ClusterOptions::transaction_pooler`], another
    /// client's prepared statement of the same name). Never silent: a write that
    /// returns such a row **was applied**, in the shard `found` (see
    /// [`Error::outcome_unknown`]); read it back from there and repair.
    #[error(
        "host {host}: {what} was sent to shard {expected} but returned a row of shard {found} (id {id}): \
         the statement ran in another shard than it was sent to; a write was applied there"
    )]
    Misrouted {
        /// The host the statement was sent to.
        host: HostName,
        /// The operation.
        what: &'static str,
        /// The shard the statement named.
        expected: LogicalShard,
        /// The shard field of the row's ID, as the ID layout reads it: it may name no
        /// shard of this cluster, so it stays the raw field.
        found: u32,
        /// The row's ID.
        id: i64,
    },
    /// Something the request path cannot do behind a transaction-mode pooler
    /// ([`ClusterOptions::transaction_pooler`]), or a sign that a host is behind one
    /// although the option is off. Nothing was applied.
    #[error("host {host}: {reason}")]
    Pooler {
        /// The host.
        host: HostName,
        /// What cannot be done, and what to change.
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
    pub(crate) fn db(shard: LogicalShard, what: &'static str, source: tokio_postgres::Error) -> Self {
        let sqlstate = source.code().map(|c| c.code().to_owned());
        Error::Db { shard, what, sqlstate, source }
    }

    /// The error for a statement on the catalog that failed while doing `what`, its
    /// SQLSTATE read from `source`. For the owners of catalog tables outside this crate
    /// (`shardline_ops::moves::journal`), so every catalog failure has one shape.
    pub fn catalog(what: &'static str, source: tokio_postgres::Error) -> Self {
        let sqlstate = source.code().map(|c| c.code().to_owned());
        Error::Catalog { what, sqlstate, source }
    }

    pub(crate) fn host(
        host: &HostName,
        shard: Option<LogicalShard>,
        what: &'static str,
        source: tokio_postgres::Error,
    ) -> Self {
        let sqlstate = source.code().map(|c| c.code().to_owned());
        Error::Host { host: host.clone(), shard, what, sqlstate, source: Some(source) }
    }

    #[cfg(feature = "sqlx")]
    pub(crate) fn sqlx(
        host: &HostName,
        shard: Option<LogicalShard>,
        what: &'static str,
        source: ::sqlx::Error,
    ) -> Self {
        let sqlstate = source.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned());
        Error::Sqlx { host: host.clone(), shard, what, sqlstate, source }
    }

    /// The SQLSTATE of a database error, if any.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Db { sqlstate, .. } | Error::Catalog { sqlstate, .. } | Error::Host { sqlstate, .. } => {
                sqlstate.as_deref()
            }
            Error::Connect { source, .. } => source.code().map(tokio_postgres::error::SqlState::code),
            Error::InsertMany { source, .. } => source.sqlstate(),
            #[cfg(feature = "sqlx")]
            Error::Sqlx { sqlstate, .. } => sqlstate.as_deref(),
            _ => None,
        }
    }

    /// A unique constraint refused the row (SQLSTATE 23505).
    pub fn is_unique_violation(&self) -> bool {
        self.sqlstate() == Some("23505")
    }

    /// A host did not answer in time, or no connection could be had in time.
    pub fn is_timeout(&self) -> bool {
        match self {
            Error::Timeout { .. }
            | Error::Pool { timed_out: true, .. }
            | Error::ConnectTimeout { .. }
            | Error::CatalogTimeout { .. } => true,
            Error::InsertMany { source, .. } => source.is_timeout(),
            _ => false,
        }
    }

    /// The host the error is about, when it is about one.
    pub(crate) fn host_name(&self) -> Option<&HostName> {
        match self {
            Error::Host { host, .. }
            | Error::Timeout { host, .. }
            | Error::Pool { host, .. }
            | Error::Unsent { host, .. }
            | Error::RolledBack { host, .. }
            | Error::TransactionEnded { host, .. }
            | Error::Misrouted { host, .. }
            | Error::Pooler { host, .. } => Some(host),
            #[cfg(feature = "sqlx")]
            Error::Sqlx { host, .. } => Some(host),
            _ => None,
        }
    }

    /// The statement found its shard's schema missing where the map placed it
    /// (SQLSTATE 3F000; 42P01, 42883 or 42704 for a name looked up through the
    /// `search_path`): the shard moved, or is fenced for a move.
    pub(crate) fn is_moved(&self) -> bool {
        match self {
            Error::Host { source: Some(e), .. } => repository::is_moved(e),
            // The map (an older one, maybe) places the shard on a host the handle has no
            // pool for (removed since, say): nothing was sent; a newer map may place it
            // elsewhere.
            Error::UnknownHost { .. } => true,
            #[cfg(feature = "sqlx")]
            Error::Sqlx { sqlstate: Some(s), .. } => repository::is_moved_sqlstate(s),
            _ => false,
        }
    }

    /// Whether a write that failed with this error may nonetheless have been applied:
    /// its statement reached, or may have reached, the server, and no verdict came back
    /// (a timeout, a connection lost mid-statement, a server shutting down, a row that
    /// was written but could not be decoded). Read back before retrying a write that is
    /// not idempotent.
    ///
    /// When this is `false` the write was not applied: nothing was sent (no connection,
    /// a bad URL or argument, a routing error), or the server refused the statement with
    /// an error that rolled it back.
    ///
    /// An [`Error::InsertMany`] is always `true`: some of its rows were applied. An
    /// [`Error::Misrouted`] is `true` too, and worse than unknown: its write was applied,
    /// in the shard the error names, not the one it was meant for.
    pub fn outcome_unknown(&self) -> bool {
        match self {
            Error::Timeout { .. }
            | Error::Decode { .. }
            | Error::Empty { .. }
            | Error::InsertMany { .. }
            | Error::TransactionEnded { .. }
            | Error::Misrouted { .. } => true,
            // No connection, so no statement: a refusal at start-up (57P03, the server
            // starting up; 08xxx) is not a verdict on a write.
            Error::Unsent { .. }
            | Error::RolledBack { .. }
            | Error::Pool { .. }
            | Error::Pooler { .. }
            | Error::Connect { .. }
            | Error::ConnectTimeout { .. } => false,
            Error::Host { sqlstate: None, .. }
            | Error::Db { sqlstate: None, .. }
            | Error::Catalog { sqlstate: None, .. } => true,
            // A unit of work that failed before its COMMIT was sent was rolled back,
            // unless its closure committed by itself and the connection was then lost
            // (nothing can tell); a COMMIT, or a statement committing on its own, that
            // got no verdict (or a connection-class one) may have applied.
            #[cfg(feature = "sqlx")]
            Error::Sqlx { what, sqlstate, .. } => {
                *what == crate::sqlx::WORK_CONNECTION_LOST
                    || ((*what == "commit" || *what == "statement")
                        && sqlstate.as_deref().is_none_or(|s| s.starts_with("57P") || s.starts_with("08")))
            }
            _ => matches!(self.sqlstate(), Some(s) if s.starts_with("57P") || s.starts_with("08")),
        }
    }

    /// Whether running the same work again may succeed: a lost or refused connection,
    /// a timeout, a serialization failure or deadlock, a server shutting down. Only
    /// retry work that did not commit (or is idempotent): see
    /// [`Error::outcome_unknown`].
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Timeout { .. }
            | Error::Pool { .. }
            | Error::ConnectTimeout { .. }
            | Error::CatalogTimeout { .. } => true,
            // Refused by the server: retry only what passes (too many connections, a server
            // starting or shutting down), never a password or a missing database.
            Error::Connect { source, .. } => source.as_db_error().is_none_or(|d| {
                matches!(d.code().code(), "53300" | "57P01" | "57P02" | "57P03")
                    || d.code().code().starts_with("08")
            }),
            // Running the whole batch again would insert the committed part twice.
            // A misrouted statement runs in the wrong shard again; a pooler's limits stay.
            Error::InsertMany { .. }
            | Error::Unsent { .. }
            | Error::RolledBack { .. }
            | Error::TransactionEnded { .. }
            | Error::Misrouted { .. }
            | Error::Pooler { .. } => false,
            Error::Host { sqlstate: None, source: Some(e), .. }
            | Error::Db { sqlstate: None, source: e, .. }
            | Error::Catalog { sqlstate: None, source: e, .. } => e.is_closed() || e.as_db_error().is_none(),
            // A lost or refused connection; not a decode or a caller's mistake.
            #[cfg(feature = "sqlx")]
            Error::Sqlx { sqlstate: None, source, .. } => matches!(
                source,
                ::sqlx::Error::Io(_) | ::sqlx::Error::PoolTimedOut | ::sqlx::Error::WorkerCrashed
            ),
            // A server refusing a session for now (too many connections, starting up).
            #[cfg(feature = "sqlx")]
            Error::Sqlx { what: "begin" | "connect", sqlstate: Some(s), .. }
                if s == "53300" || s.starts_with("57P") =>
            {
                true
            }
            _ => matches!(
                self.sqlstate(),
                Some("40001" | "40P01" | "57P01" | "57P02" | "57P03" | "55P03")
                    | Some("08000" | "08003" | "08006")
            ),
        }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Runs `work` on `host` within `after`; past it, [`Error::Timeout`] naming the host. The
/// one place a host's statements are timed.
pub(crate) async fn within<T>(
    host: &HostName,
    after: std::time::Duration,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(after, work).await.map_err(|_| Error::Timeout { host: host.clone(), after })?
}

/// The error of a statement that failed on `host`: [`Error::Unsent`] when a parameter
/// could not be encoded for the type the server expects (found by encoding the values
/// again, so by what failed, not by the driver's message), else [`Error::Host`].
pub(crate) fn statement_error(
    host: &HostName,
    shard: Option<LogicalShard>,
    what: &'static str,
    source: tokio_postgres::Error,
    types: &[tokio_postgres::types::Type],
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Error {
    if source.as_db_error().is_none() && !source.is_closed() {
        let unsent =
            |parameter: usize, expected: String, source: Box<dyn std::error::Error + Send + Sync>| {
                Error::Unsent { host: host.clone(), shard, what, parameter, expected, source }
            };
        if types.len() != params.len() {
            let why = format!("the statement takes {} parameters, {} were given", types.len(), params.len());
            return unsent(0, "a parameter list".to_owned(), why.into());
        }
        let mut buf = bytes::BytesMut::new();
        for (i, (ty, value)) in types.iter().zip(params).enumerate() {
            buf.clear();
            if let Err(e) = value.to_sql_checked(ty, &mut buf) {
                return unsent(i + 1, ty.name().to_owned(), e);
            }
        }
    }
    Error::host(host, shard, what, source)
}

/// An error and its causes on one line, `: `-separated. The driver's errors say only
/// their kind ("db error", "error performing TLS handshake"); the reason is in the
/// causes.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<Error>();
};

/// The pieces of [`Error`]'s messages, so no `#[error]` holds logic of its own.
mod msg {
    use shardline_router::{HostName, LogicalShard};

    pub(super) fn sqlstate(s: &Option<String>) -> &str {
        s.as_deref().unwrap_or("none")
    }

    pub(super) fn list<T: std::fmt::Display>(items: &[T]) -> String {
        items.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    }

    pub(super) fn host_or_any(host: &Option<HostName>) -> String {
        host.as_ref().map_or_else(|| "a host".to_owned(), ToString::to_string)
    }

    pub(super) fn of_shard(shard: &Option<LogicalShard>) -> String {
        shard.map(|s| format!(", shard {s}")).unwrap_or_default()
    }
}
