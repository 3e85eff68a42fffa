//! shardline's operations, as a library the CLI (and your own tooling) calls.
//!
//! - [`init()`]: create the catalog, place the shards, create every shard schema with its
//!   ID minter, apply the migrations. Idempotent and resumable.
//! - [`migrate()`]: apply pending migrations to every shard schema, one transaction per
//!   shard, recorded in a ledger beside the shard on its host.
//! - [`status()`]: per host, reachable or not, its shards, rows and bytes per table.
//!
//! # Layout
//!
//! - [`migrations`]: reading, checking and splitting migration files.
//! - [`converge`]: bringing every shard up to date (shared by `init` and `migrate`).
//! - [`bootstrap`]: the `init` and `migrate` commands.
//! - [`grants`]: the privileges the config's `app_roles` get, and carrying a shard's
//!   privileges when it moves.
//! - [`mod@status`]: the `status` report.
//! - [`moves`]: moving a logical shard between hosts online: pre-flight, copy, fence,
//!   verify, flip; resume, abort, gc.
//! - [`rebalance`]: planning and running moves that even out the hosts.
//! - [`Error`]: the crate's error type.
//!
//! # Example
//!
//! ```no_run
//! # async fn ops(config: &shardline_router::Config) -> Result<(), shardline_ops::Error> {
//! use shardline_ops::moves::{self, MoveOptions};
//! use shardline_router::{HostName, LogicalShard};
//!
//! // Create the catalog and every shard schema (idempotent).
//! shardline_ops::init(config, &shardline_ops::Options::default(), &|_| {}).await?;
//! // Move shard 5 to pg2, online; the report has the rows, copy time and write pause.
//! let (shard, to) = (LogicalShard::bounded(5)?, HostName::new("pg2")?);
//! let report = moves::run(config, shard, &to, &MoveOptions::default()).await?;
//! println!("{report}");
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

use std::path::PathBuf;

use shardline_router::{HostName, LogicalShard};

pub mod bootstrap;
pub mod converge;
pub mod fleet;
pub mod grants;
pub mod migrations;
pub mod moves;
pub mod rebalance;
pub mod status;

pub use bootstrap::{Options, Progress, Report, init, migrate};
pub use status::{HostStatus, Status, TableStatus, status};

/// What can go wrong in an operation. Each names the host, shard, file or key involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The migrations directory or one of its files cannot be read.
    #[error("cannot read the migrations at {}: {message}", path.display())]
    MigrationDir {
        /// The directory or file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A migration file that cannot be used as written.
    #[error("{file}:{line}: {message}")]
    MigrationSyntax {
        /// The file name.
        file: String,
        /// 1-based line.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A migration file that no longer matches what a shard's ledger recorded, or that
    /// was removed or would apply out of order.
    #[error("migration {file}: {message}")]
    Ledger {
        /// The file name.
        file: String,
        /// What disagrees, naming a shard.
        message: String,
    },
    /// One or more hosts cannot be reached; nothing was changed.
    #[error("{} unreachable, so nothing was changed: {}", msg::hosts_are(hosts), msg::each_with_why(hosts))]
    Unreachable {
        /// Each unreachable host, with why.
        hosts: Vec<(HostName, String)>,
    },
    /// A role the config's `app_roles` names is missing on a server (roles are per
    /// server); nothing was changed.
    #[error(
        "app_roles: {} missing, so nothing was changed: {}; create them there (CREATE ROLE ... LOGIN) or change app_roles",
        msg::roles_are(missing),
        msg::each_lacks(missing)
    )]
    RolesMissing {
        /// Each server (a host's name, or `catalog`) with the roles it lacks.
        missing: Vec<(String, Vec<String>)>,
    },
    /// A statement on a host (not inside a migration) failed.
    #[error("host {host}: {what} failed (SQLSTATE {}): {message}", msg::sqlstate(sqlstate))]
    Host {
        /// The host's name, or `catalog` for a statement on the catalog: not a
        /// [`HostName`], since it names the catalog too.
        host: String,
        /// What was being done, naming the shard when there is one.
        what: String,
        /// The SQLSTATE, when the server sent one.
        sqlstate: Option<String>,
        /// The server's (or driver's) message.
        message: String,
    },
    /// A migration statement failed in one shard; that shard was rolled back, whole.
    #[error("{0}")]
    Migration(Box<FailedStatement>),
    /// A host in the catalog that holds shards has no address: not in the config, and
    /// the catalog (made before it recorded addresses) has none.
    #[error(
        "host {host} holds {shards} shard(s) in the catalog but has no address: add it to the config (then `shardline init` records it)"
    )]
    HostMissing {
        /// The host.
        host: HostName,
        /// How many shards it holds.
        shards: usize,
    },
    /// A host cannot be added, readdressed, drained or removed as asked; nothing was
    /// changed.
    #[error("host {host}: {message}")]
    Fleet {
        /// The host.
        host: HostName,
        /// Why.
        message: String,
    },
    /// Another `init`, `migrate` or move holds the catalog's lock.
    #[error(
        "another shardline operation (init, migrate or a move) is running on this cluster; try again when it ends"
    )]
    Busy,
    /// A move's pre-flight found problems; nothing was changed.
    #[error("pre-flight found {} problem(s); nothing was changed:\n{}", .0.problems.len(), msg::bullets(&.0.problems))]
    Preflight(Box<moves::Preflight>),
    /// A move of the shard is already running.
    #[error(
        "a move of shard {shard} is already running; finish it with `shardline move --resume {shard}` or undo it with `--abort {shard}`"
    )]
    MoveRunning {
        /// The shard.
        shard: LogicalShard,
    },
    /// A planned move that [`rebalance::apply`] did not start: a move before it failed,
    /// and the plan counted on it (each move of a rebalance plan assumes the ones before
    /// it happened), or it was a later move of that same shard.
    #[error(
        "not started: the move of shard {failed} failed, and the plan's later moves counted on it; \
         run `shardline rebalance` again to plan from where the shards are"
    )]
    NotStarted {
        /// The shard whose move failed.
        failed: LogicalShard,
    },
    /// Another process is working on this move.
    #[error("another shardline process is working on move {id}; wait for it, or stop it first")]
    MoveBusy {
        /// The move.
        id: i64,
    },
    /// `move --revert` cannot bring the shard back.
    #[error("shard {shard} cannot be reverted: {reason}")]
    NotRevertible {
        /// The shard.
        shard: LogicalShard,
        /// Why not, and what to do instead.
        reason: String,
    },
    /// No running move to resume or abort.
    #[error("no move{} is running", msg::of_shard(shard))]
    NoMove {
        /// The shard asked for, if any.
        shard: Option<LogicalShard>,
    },
    /// The move has flipped: it can only be finished.
    #[error(
        "move {id} of shard {shard} has already flipped the map: the shard lives on the target now; finish it with `shardline move --resume {shard}`"
    )]
    Flipped {
        /// The move.
        id: i64,
        /// The shard.
        shard: LogicalShard,
    },
    /// The fence's lease ran out with nothing decided (the mover died or lost the
    /// source), and the shard was unfenced on the source: the move is undone.
    #[error(
        "move {id} of shard {shard} was undone: its fence's lease ran out before it could flip, and writes resumed on the source; start the move again"
    )]
    LeaseExpired {
        /// The move.
        id: i64,
        /// The shard.
        shard: LogicalShard,
    },
    /// The shard's writes waited on the move for [`moves::MoveOptions::max_pause`]
    /// without its copy verified: the step in progress was given up, and the move is
    /// undone (unless [`Error::UndoFailed`] says otherwise) so that writes resume on the
    /// source.
    #[error(
        "move {id} of shard {shard} held the shard's writes for max_pause ({max_pause:?}) without its copy verified (in the step after {step}), so it was given up to be undone and let them resume on the source; move the shard again, with a longer --max-pause if the pause may be longer"
    )]
    PauseTooLong {
        /// The move.
        id: i64,
        /// The shard.
        shard: LogicalShard,
        /// The last step done when the step after it was given up.
        step: moves::Step,
        /// The pause allowed.
        max_pause: std::time::Duration,
    },
    /// The source decided to flip (the copy verified, the fence kept for good): the
    /// move can only be finished.
    #[error(
        "move {id} of shard {shard} has decided to flip (its copy is verified and the source stays fenced): finish it with `shardline move --resume {shard}`"
    )]
    FlipDecided {
        /// The move.
        id: i64,
        /// The shard.
        shard: LogicalShard,
    },
    /// An undo of the move began and did not finish (a host died under it): the
    /// target's copy may be gone, so the move cannot go on; `--abort` finishes the undo.
    #[error(
        "move {id} of shard {shard} was being undone when it stopped, so it cannot be resumed; finish undoing it with `shardline move --abort {shard}`"
    )]
    Undoing {
        /// The move.
        id: i64,
        /// The shard.
        shard: LogicalShard,
    },
    /// A move failed while its shard was (or may have been) fenced, or failed its
    /// verification, and undoing it failed too: the shard may still be fenced, its
    /// writes waiting, until `shardline move --abort` finishes the undo (the journal
    /// records both errors).
    #[error(
        "move {id} of shard {shard} failed ({failure}), and undoing it failed too ({undo}): the shard may stay fenced, its writes waiting, until `shardline move --abort {shard}` finishes the undo"
    )]
    UndoFailed {
        /// The move.
        id: i64,
        /// The shard.
        shard: LogicalShard,
        /// Why the move failed.
        failure: String,
        /// Why its undo failed.
        undo: String,
    },
    /// Verification found differences; the move was undone (the shard stays on the
    /// source).
    #[error(
        "move {id} of shard {shard}: the copy differs from the source, so the map was not flipped:\n{}",
        msg::bullets(differences)
    )]
    Verify {
        /// The move.
        id: i64,
        /// The shard.
        shard: LogicalShard,
        /// Per table: the differing primary keys.
        differences: Vec<String>,
    },
    /// Stopped after a step, as asked (`MoveOptions::stop_after`).
    #[error(
        "move {id} stopped after step {step}, as asked; `shardline move --resume` finishes it, `--abort` undoes it"
    )]
    Interrupted {
        /// The move.
        id: i64,
        /// The last step done.
        step: moves::Step,
    },
    /// Something did not happen in time.
    #[error("host {host}: timed out after {after:?} waiting for {what}")]
    Timeout {
        /// The host waited on.
        host: HostName,
        /// What was awaited.
        what: String,
        /// How long it waited.
        after: std::time::Duration,
    },
    /// `move --resume` of every running move: some could not be finished (each was
    /// tried).
    #[error(
        "{} of {} running move(s) could not be resumed:\n{}{}",
        failed.len(),
        failed.len() + finished.len(),
        msg::bullets(failed),
        msg::finished(finished)
    )]
    ResumeIncomplete {
        /// Each move not finished, and why.
        failed: Vec<String>,
        /// The reports of the moves this run finished.
        finished: Vec<moves::MoveReport>,
    },
    /// The catalog answered no liveness probe for this long (hung, or cut off): the
    /// operation was given up where it was, and is run again once the catalog is back.
    #[error(
        "the catalog answered no probe for {after:?} (it is hung or cut off); run this again once it answers"
    )]
    CatalogHung {
        /// How long it went unanswered.
        after: std::time::Duration,
    },
    /// An option's value is out of its range; nothing was done.
    #[error("{option}: {message}")]
    InvalidOption {
        /// The option.
        option: &'static str,
        /// What is wrong with its value.
        message: String,
    },
    /// The journal disagrees with what is on the hosts, or cannot be read.
    #[error("move {id}: {message}")]
    Journal {
        /// The move.
        id: i64,
        /// What is wrong.
        message: String,
    },
    /// The catalog or a connection failed.
    #[error(transparent)]
    Repo(#[from] shardline_repo::Error),
    /// A routing value was invalid.
    #[error(transparent)]
    Router(#[from] shardline_router::Error),
    /// The ID minter's SQL could not be rendered.
    #[error(transparent)]
    Id(#[from] shardline_id::Error),
}

impl Error {
    /// The SQLSTATE behind the error, if any.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Host { sqlstate, .. } => sqlstate.as_deref(),
            Error::Migration(f) => f.sqlstate.as_deref(),
            Error::Repo(e) => e.sqlstate(),
            _ => None,
        }
    }
}

/// Where a migration failed, and why: the shard, its host, the file, the statement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "shard {shard} ({schema}) on host {host}: {file}, statement {index} (line {line}) failed (SQLSTATE {}): {message}\n    {statement}",
    sqlstate.as_deref().unwrap_or("none")
)]
#[non_exhaustive]
pub struct FailedStatement {
    /// The logical shard.
    pub shard: LogicalShard,
    /// Its schema.
    pub schema: String,
    /// Its host.
    pub host: HostName,
    /// The migration file.
    pub file: String,
    /// 1-based index of the statement in the file.
    pub index: usize,
    /// The line it starts on.
    pub line: usize,
    /// The statement.
    pub statement: String,
    /// The SQLSTATE, when the server sent one.
    pub sqlstate: Option<String>,
    /// The server's message (and detail).
    pub message: String,
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The server's message with its detail and hint, or the driver's message.
pub(crate) fn describe(e: &tokio_postgres::Error) -> (Option<String>, String) {
    match e.as_db_error() {
        Some(db) => {
            let mut m = db.message().to_owned();
            if let Some(d) = db.detail() {
                m.push_str(&format!(" ({d})"));
            }
            if let Some(h) = db.hint() {
                m.push_str(&format!(" hint: {h}"));
            }
            (Some(db.code().code().to_owned()), m)
        }
        None => (e.code().map(|c| c.code().to_owned()), shardline_repo::error_chain(e)),
    }
}

const _: () = {
    const fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<Error>();
};

/// The pieces of [`Error`]'s messages, so no `#[error]` holds logic of its own.
mod msg {
    use std::fmt::Display;

    use shardline_router::{HostName, LogicalShard};

    pub(super) fn sqlstate(s: &Option<String>) -> &str {
        s.as_deref().unwrap_or("none")
    }

    pub(super) fn hosts_are(hosts: &[(HostName, String)]) -> &'static str {
        if hosts.len() == 1 { "a host is" } else { "hosts are" }
    }

    pub(super) fn each_with_why(hosts: &[(HostName, String)]) -> String {
        hosts.iter().map(|(h, e)| format!("{h}: {e}")).collect::<Vec<_>>().join("; ")
    }

    pub(super) fn roles_are(missing: &[(String, Vec<String>)]) -> &'static str {
        if missing.len() == 1 && missing[0].1.len() == 1 { "a role is" } else { "roles are" }
    }

    pub(super) fn each_lacks(missing: &[(String, Vec<String>)]) -> String {
        missing
            .iter()
            .map(|(at, roles)| format!("{at} lacks {}", roles.join(", ")))
            .collect::<Vec<_>>()
            .join("; ")
    }

    pub(super) fn bullets<T: Display>(items: &[T]) -> String {
        items.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n")
    }

    pub(super) fn finished(reports: &[crate::moves::MoveReport]) -> String {
        if reports.is_empty() {
            String::new()
        } else {
            let ids: Vec<String> = reports.iter().map(|r| format!("move {}", r.id)).collect();
            format!("\nfinished: {}", ids.join(", "))
        }
    }

    pub(super) fn of_shard(shard: &Option<LogicalShard>) -> String {
        shard.map(|s| format!(" of shard {s}")).unwrap_or_default()
    }
}
