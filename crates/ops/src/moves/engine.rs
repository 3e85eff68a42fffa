//! The move itself: each [`Step`] done, then journaled; resumable from any journaled
//! step, undoable until the flip.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use shardline_id::Layout;
use shardline_id::ident::quote as quote_ident;
use shardline_id::sql::ShardSql;
use shardline_repo::Catalog;
use shardline_repo::catalog::connect;
use shardline_router::{Config, HostName, LogicalShard, SchemaName};
use tokio_postgres::Client;

use super::journal::{self, Detail, MoveRecord, Revertible, Reverting, RowsCopied, State, Step, TableCheck};
use super::preflight::{self, host_err, quote_literal};
use super::subscription;
use crate::converge::{self, HOST_LEDGER_SQL, Inputs, ShardWork};
use crate::grants;
use crate::migrations::load_dir;
use crate::{Error, Result};

mod changes;
mod copy;
mod fence;
mod flip;
mod rows;
mod undo;
mod verify;

pub use changes::CHANGES_SQL;
pub(crate) use changes::{drop_changes, logged_moves};
pub(crate) use copy::drop_guards;
use fence::Renewer;
pub(crate) use fence::{copy_ceiling, lift_cap_sql};
pub(crate) use flip::{drop_slots, drop_source_side, drop_subscription, sync_slots};
pub(crate) use undo::finish_undone;
use undo::undo;

/// How often a wait for the source's changes checks that the source still answers.
const SOURCE_CHECK: Duration = Duration::from_secs(1);

/// How many times a move's initial copy starts over (a table's copy stranded by a
/// table-sync worker that died at the wrong moment) before the move fails.
const MAX_COPY_RESTARTS: u32 = 3;

/// The marker table on every host a move touches. The source's publication carries
/// only its own move's row (a row filter); the mover bumps `n` on the source and waits
/// for it on the target. The apply worker commits in the source's commit order, so once
/// the target shows a value, it holds everything the source committed before it.
///
/// On the source the row is also the fence's **lease**: the fence sets `fenced`,
/// `lease_until` (renewed by the mover while it works) and what undoing the fence needs
/// (`schema_name`, `moved_schema`, `sequence_max`); `decided` is set once, to `flip`
/// by the mover right before it flips the map, or to `undo` by whoever unfences the
/// shard (the mover, `--abort`, or [`RESOLVE_SQL`]'s function once the lease ran out).
/// Both are compare-and-set on this one row, so exactly one of them happens.
///
/// On the target, a new copy's ID sequence stays capped from the carry until the flip's
/// decision (nothing mints there that the source could hand out again if the move is
/// undone): the decision's arrival with the source's row lifts it to `sequence_max`,
/// in the same transaction (a trigger that fires in the replication's apply worker
/// too), as it lets the copy's guards pass writes. The mover lifts it as well.
pub const MARKS_SQL: &str = "CREATE SCHEMA IF NOT EXISTS shardline;
CREATE TABLE IF NOT EXISTS shardline.move_marks (
    move_id bigint PRIMARY KEY,
    n       bigint NOT NULL DEFAULT 0,
    fenced  boolean NOT NULL DEFAULT false
);
ALTER TABLE shardline.move_marks
    ADD COLUMN IF NOT EXISTS lease_until  timestamptz,
    ADD COLUMN IF NOT EXISTS decided      text CHECK (decided IN ('flip', 'undo')),
    ADD COLUMN IF NOT EXISTS schema_name  text,
    ADD COLUMN IF NOT EXISTS moved_schema text,
    ADD COLUMN IF NOT EXISTS sequence_max bigint,
    ADD COLUMN IF NOT EXISTS flip_token   text;
COMMENT ON TABLE shardline.move_marks IS 'shardline: one row per move in progress, replicated from source to target to measure lag and to know when the target has everything; on the source, the fence''s lease and its one decision (flip or undo)';
CREATE OR REPLACE FUNCTION shardline.lift_copy_cap() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    seq regclass;
BEGIN
    -- Only for the marker table (a trigger of the function's on another table, as its
    -- creator could attach it, does nothing), and only where the shard's schema is: the
    -- target (the source renamed it at the fence).
    IF TG_RELID <> 'shardline.move_marks'::regclass OR NEW.schema_name IS NULL OR NEW.sequence_max IS NULL
       OR NOT EXISTS (SELECT FROM pg_namespace WHERE nspname = NEW.schema_name) THEN
        RETURN NULL;
    END IF;
    seq := to_regclass(format('%I.shardline_id_seq', NEW.schema_name));
    IF seq IS NOT NULL AND (SELECT seqmax FROM pg_sequence WHERE seqrelid = seq) < NEW.sequence_max THEN
        EXECUTE format('ALTER SEQUENCE %s MAXVALUE %s', seq, NEW.sequence_max);
    END IF;
    RETURN NULL;
EXCEPTION WHEN OTHERS THEN
    -- Never in the way of the replication that brought the decision: the mover lifts
    -- the cap too.
    RAISE WARNING 'shardline: move %: cannot lift the ID sequence''s cap of %: %', NEW.move_id, NEW.schema_name, SQLERRM;
    RETURN NULL;
END
$fn$;
REVOKE ALL ON FUNCTION shardline.lift_copy_cap() FROM PUBLIC;
CREATE OR REPLACE TRIGGER shardline_lift_copy_cap AFTER INSERT OR UPDATE ON shardline.move_marks
    FOR EACH ROW WHEN (NEW.decided = 'flip') EXECUTE FUNCTION shardline.lift_copy_cap();
ALTER TABLE shardline.move_marks ENABLE ALWAYS TRIGGER shardline_lift_copy_cap;";

/// `shardline.resolve_fence(schema)` on every host: what anyone (a router that found
/// the shard's schema missing) may do about a fence whose mover is gone. It finds the
/// latest fenced move of that schema on this host and, under the marker row's lock:
///
/// - `decided = 'flip'`: returns `flip`, the move's ID and the proof (`flip_token`)
///   that `shardline.complete_flip` in the catalog asks for;
/// - `decided = 'undo'`: returns `undone` (already unfenced);
/// - undecided, the fenced schema here and the lease still running: `fenced`;
/// - undecided and the lease run out: decides `undo`, renames the schema back, moves
///   its ledger rows back and lifts the sequence's cap, all in this one transaction,
///   and returns `undone`; from then on the mover cannot flip (its decision is the
///   same compare-and-set on the same row);
/// - anything else (no such move, or this host is not its source): `none`.
///
/// SECURITY DEFINER, owned by the admin that ran `init` or the move; EXECUTE for
/// PUBLIC: the only thing it can ever do is what an expired lease calls for.
pub const RESOLVE_SQL: &str = r#"
CREATE OR REPLACE FUNCTION shardline.resolve_fence(shard_schema text, OUT outcome text, OUT move bigint, OUT token text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    m record;
BEGIN
    SELECT mm.move_id, mm.decided, mm.lease_until, mm.schema_name, mm.moved_schema, mm.sequence_max, mm.flip_token
      INTO m FROM shardline.move_marks mm
     WHERE mm.schema_name = shard_schema AND mm.fenced
     ORDER BY mm.move_id DESC LIMIT 1 FOR UPDATE;
    IF NOT FOUND THEN
        outcome := 'none';
        RETURN;
    END IF;
    move := m.move_id;
    IF m.decided = 'flip' THEN
        outcome := 'flip';
        token := m.flip_token;
        RETURN;
    ELSIF m.decided = 'undo' THEN
        outcome := 'undone';
        RETURN;
    END IF;
    -- Only the source holds the fenced schema (the target has a replica of the row).
    IF NOT EXISTS (SELECT FROM pg_namespace WHERE nspname = m.moved_schema)
       OR EXISTS (SELECT FROM pg_namespace WHERE nspname = m.schema_name) THEN
        outcome := 'none';
        RETURN;
    END IF;
    IF m.lease_until IS NULL OR m.lease_until > clock_timestamp() THEN
        outcome := 'fenced';
        RETURN;
    END IF;
    UPDATE shardline.move_marks SET decided = 'undo' WHERE shardline.move_marks.move_id = m.move_id;
    EXECUTE format('ALTER SCHEMA %I RENAME TO %I', m.moved_schema, m.schema_name);
    IF m.sequence_max IS NOT NULL THEN
        EXECUTE format('ALTER SEQUENCE %I.shardline_id_seq MAXVALUE %s', m.schema_name, m.sequence_max);
    END IF;
    UPDATE shardline.shard_migrations SET schema_name = m.schema_name WHERE schema_name = m.moved_schema;
    RAISE LOG 'shardline: move % of schema %: the fence''s lease ran out; unfenced on the source', m.move_id, m.schema_name;
    outcome := 'undone';
END
$fn$;
REVOKE ALL ON FUNCTION shardline.resolve_fence(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION shardline.resolve_fence(text) TO PUBLIC;
"#;

pub use super::journal::COMPLETE_FLIP_SQL;

/// What a move reports as it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MoveProgress {
    /// A step is done.
    Step {
        /// The move.
        id: i64,
        /// The step.
        step: Step,
    },
    /// The initial copy: bytes on the target against the source's.
    Copy {
        /// Bytes of the shard's tables and indexes on the target so far.
        bytes: i64,
        /// Bytes on the source.
        total: i64,
        /// Tables whose copy is done.
        tables_done: i64,
        /// Tables.
        tables: i64,
    },
    /// A change on the source took this long to reach the target.
    Lag {
        /// The round trip, in ms.
        ms: u64,
    },
}

/// Receives [`MoveProgress`].
pub type ProgressFn = Arc<dyn Fn(&MoveProgress) + Send + Sync>;

/// A drill's action at a point of a move; the move waits for it.
pub type HookFn = Arc<dyn Fn() -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// How a move verifies the target's copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Verification {
    /// A change log (triggers on both sides) from the end of the copy; the whole shard
    /// compared before the fence; inside the fence only the keys written since, and
    /// tables without a primary key in full. The write pause grows with the rows
    /// written during the move, not with the shard.
    #[default]
    ChangeLog,
    /// Every row of every table, inside the fence (no change log): the pause grows
    /// with the shard. Kept as the rival in the benchmark.
    Full,
}

/// How a move waits, and for how long.
#[derive(Clone)]
#[non_exhaustive]
pub struct MoveOptions {
    /// The fence waits until a change on the source reaches the target within this
    /// (default 250 ms), so the write pause is short.
    pub max_lag: Duration,
    /// How long the copy and catch-up may take (default 6 h).
    pub copy_timeout: Duration,
    /// How long the fence waits for the shard's tables' locks, per attempt (default 2 s).
    pub lock_timeout: Duration,
    /// Fence attempts before giving up (default 5); writes go on between attempts.
    pub fence_attempts: u32,
    /// How long, once fenced, to wait for the target to have everything (default 30 s).
    /// If it does not, the move is undone and writes resume on the source. The wait
    /// also ends at [`MoveOptions::max_pause`], counted from the fence, whichever comes
    /// first.
    pub sync_timeout: Duration,
    /// The longest the shard's writes may wait on the move (default 30 s): from the
    /// fence (its wait for the shard's locks included) until the copy is verified (the steps `fenced`, `synced` and
    /// `sequence_carried`: waiting for the target, carrying the ID sequence, the
    /// verification inside the fence). Past it, the step in progress is given up and
    /// the move undone, so writes resume on the source: [`Error::PauseTooLong`]. It
    /// bounds what the host probes ([`MoveOptions::hung_after`]) do not, a host that
    /// answers but whose step does not end (a lock someone holds on the target's copy,
    /// a table without a key too big to compare in time). The flip that follows is not
    /// cut short: once the source decided it, it only completes. A move resumed while
    /// fenced counts it from its resume (the bound is not journaled: `--resume` takes
    /// its own). At least 1 s is used.
    pub max_pause: Duration,
    /// Stop, as if the process had died, once this step is journaled: for drills and
    /// tests of `--resume` and `--abort`.
    pub stop_after: Option<Step>,
    /// The fence's lease (default 10 s): while the shard is fenced, the mover renews it
    /// on the source every quarter of it. Once it has run out with nothing decided (the
    /// mover died, or lost the source), any router that finds the shard fenced unfences
    /// it on the source (`shardline.resolve_fence`), and the mover can no longer flip.
    /// Keep `ClusterOptions::move_wait` above it plus 5 s, so a waiting write sees it.
    pub lease: Duration,
    /// Drill: stop right after the fence's transaction committed, before it is
    /// journaled or its lease renewed, as if the COMMIT's reply was lost and the mover
    /// died. For tests of the lease.
    pub lose_fence_reply: bool,
    /// Drill: stop right after the source decided to flip, before anything else (a
    /// revert's guards dropped, the map moved), as if the mover died there. For tests
    /// of what routers do without the mover.
    pub stop_after_decision: bool,
    /// Progress reports.
    pub progress: Option<ProgressFn>,
    /// How the copy is verified (default [`Verification::ChangeLog`]).
    pub verification: Verification,
    /// Drill: run and awaited right after the comparison before the fence passed (and
    /// was journaled), before the fence. For tests that change a copy at that point.
    pub on_compared: Option<HookFn>,
    /// Drill: run and awaited right after a new move's pre-flight passed, before the
    /// move is journaled. For tests that move the shard elsewhere at that point.
    pub on_preflight: Option<HookFn>,
    /// Drill: run and awaited inside the flip's catalog transaction, once the map's row
    /// and the journal's are written, before the commit. For tests that cut the catalog
    /// off there.
    pub on_flip: Option<HookFn>,
    /// Drill: run and awaited once a flipped move's clean-up is done, before the move
    /// is journaled done. For tests that freeze the catalog there.
    pub on_cleaned: Option<HookFn>,
    /// The rounds before the fence stop once at most this many keys were logged since
    /// the last one began (default 256; see `docs/moves.md`).
    pub round_keys: i64,
    /// At most this many rounds before the fence (default 6).
    pub max_rounds: i32,
    /// Drill: run and awaited in every round before the fence, right after it took its
    /// keys. For tests that write at that point.
    pub on_round: Option<HookFn>,
    /// How long the source or the target may go without answering a probe (`SELECT 1`
    /// on a connection of its own, every second) before the step in progress is given
    /// up (default 15 s): a host that is hung (paused, out of memory) or cut off would
    /// otherwise hold a statement, and the move, for as long as it lasts. A step given
    /// up while the shard is fenced is undone as any failure there is, if the source
    /// answers; otherwise the move stays journaled for `--resume` or `--abort`, and the
    /// fence's lease frees the shard once the source is back. At least 2 s is used.
    pub hung_after: Duration,
    /// Keep the move revertible after its flip (default `false`): a publication and a
    /// logical replication slot on the target, made before the fence, from which
    /// [`revert`] brings the old copy up to date instead of copying the shard again.
    /// The slot keeps the target's WAL from then until `gc` drops it with the old copy
    /// (the grace period) or a revert uses it, and takes one of the target's
    /// `max_replication_slots`: see `docs/operations.md`, "Reverting a move".
    pub revertible: bool,
    /// Copy the shard's rows at most this many bytes a second, read by the mover from
    /// one snapshot of the source, [`MoveOptions::copy_streams`] streams at once (`0`:
    /// no cap); `None`: Postgres's table-sync workers copy, as fast as the hosts go, and
    /// nothing throttles them. Default [`DEFAULT_MAX_RATE`] (10 MB/s): the copy leaves
    /// the source's other shards their share of its disk and cores. See `docs/moves.md`,
    /// "The mover's own copy".
    pub max_rate: Option<u64>,
    /// How many streams copy at once when the mover copies ([`MoveOptions::max_rate`]),
    /// a big table in ranges of its pages (default 2).
    pub copy_streams: usize,
}

/// The default [`MoveOptions::max_rate`], in bytes a second: 10 MB/s. The fastest cap
/// that kept the p99 of writers to another shard of the source within 2× of its level
/// with no move, with margin, in every run of `cargo bench -p shardline-tests --bench
/// moves` with the hosts on cores of their own (`docs/benchmarks.md`, "Gentle on the
/// source": 1.33–1.41× in three runs; 20 MB/s missed once in three, 40 MB/s twice, the
/// table-sync copy every time; uncapped met it three times, at 1.3–1.75×, but there the
/// mover's one thread shared the target's core, which held its pace down).
pub const DEFAULT_MAX_RATE: u64 = 10_000_000;

impl Default for MoveOptions {
    fn default() -> Self {
        MoveOptions {
            max_lag: Duration::from_millis(250),
            copy_timeout: Duration::from_secs(6 * 3600),
            lock_timeout: Duration::from_secs(2),
            fence_attempts: 5,
            sync_timeout: Duration::from_secs(30),
            max_pause: Duration::from_secs(30),
            stop_after: None,
            lease: Duration::from_secs(10),
            lose_fence_reply: false,
            stop_after_decision: false,
            progress: None,
            verification: Verification::default(),
            on_compared: None,
            on_preflight: None,
            on_flip: None,
            on_cleaned: None,
            round_keys: changes::SMALL_ROUND,
            max_rounds: changes::MAX_ROUNDS,
            on_round: None,
            hung_after: Duration::from_secs(15),
            revertible: false,
            max_rate: Some(DEFAULT_MAX_RATE),
            copy_streams: 2,
        }
    }
}

impl MoveOptions {
    /// These options, stopping once `step` is journaled (see
    /// [`MoveOptions::stop_after`]).
    #[must_use]
    pub fn stopping_after(mut self, step: Step) -> Self {
        self.stop_after = Some(step);
        self
    }

    /// These options, with the rows copied by Postgres's table-sync workers, as fast as
    /// the hosts go (`max_rate: None`; `--subscription-copy`), not by the mover.
    #[must_use]
    pub fn subscription_copy(mut self) -> Self {
        self.max_rate = None;
        self
    }

    /// These options, with a fence lease of `lease` (see [`MoveOptions::lease`]).
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// These options, with the shard's writes waiting at most `max_pause` on the move
    /// (see [`MoveOptions::max_pause`]).
    #[must_use]
    pub fn with_max_pause(mut self, max_pause: Duration) -> Self {
        self.max_pause = max_pause;
        self
    }

    /// These options, verifying as `verification` says.
    #[must_use]
    pub fn verifying(mut self, verification: Verification) -> Self {
        self.verification = verification;
        self
    }

    /// These options, running `hook` right after the comparison before the fence (see
    /// [`MoveOptions::on_compared`]).
    #[must_use]
    pub fn on_compared(mut self, hook: HookFn) -> Self {
        self.on_compared = Some(hook);
        self
    }

    /// These options, running `hook` right after a new move's pre-flight passed (see
    /// [`MoveOptions::on_preflight`]).
    #[must_use]
    pub fn on_preflight(mut self, hook: HookFn) -> Self {
        self.on_preflight = Some(hook);
        self
    }

    /// These options, with rounds before the fence until at most `keys` keys are left,
    /// `max` rounds at most (see [`MoveOptions::round_keys`]).
    #[must_use]
    pub fn with_rounds(mut self, keys: i64, max: i32) -> Self {
        self.round_keys = keys;
        self.max_rounds = max;
        self
    }

    /// These options, running `hook` in every round before the fence (see
    /// [`MoveOptions::on_round`]).
    #[must_use]
    pub fn on_round(mut self, hook: HookFn) -> Self {
        self.on_round = Some(hook);
        self
    }

    /// These options, running `hook` inside the flip's catalog transaction, before its
    /// commit (see [`MoveOptions::on_flip`]).
    #[must_use]
    pub fn on_flip(mut self, hook: HookFn) -> Self {
        self.on_flip = Some(hook);
        self
    }

    /// These options, keeping the move revertible after its flip (see
    /// [`MoveOptions::revertible`]).
    #[must_use]
    pub fn revertible(mut self) -> Self {
        self.revertible = true;
        self
    }

    /// These options, stopping right after the fence commits (see
    /// [`MoveOptions::lose_fence_reply`]).
    #[must_use]
    pub fn losing_fence_reply(mut self) -> Self {
        self.lose_fence_reply = true;
        self
    }
}

impl std::fmt::Debug for MoveOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoveOptions")
            .field("max_lag", &self.max_lag)
            .field("copy_timeout", &self.copy_timeout)
            .field("lock_timeout", &self.lock_timeout)
            .field("fence_attempts", &self.fence_attempts)
            .field("sync_timeout", &self.sync_timeout)
            .field("max_pause", &self.max_pause)
            .field("stop_after", &self.stop_after)
            .field("lease", &self.lease)
            .field("lose_fence_reply", &self.lose_fence_reply)
            .field("stop_after_decision", &self.stop_after_decision)
            .field("progress", &self.progress.is_some())
            .field("verification", &self.verification)
            .field("on_compared", &self.on_compared.is_some())
            .field("on_preflight", &self.on_preflight.is_some())
            .field("on_flip", &self.on_flip.is_some())
            .field("on_cleaned", &self.on_cleaned.is_some())
            .field("round_keys", &self.round_keys)
            .field("max_rounds", &self.max_rounds)
            .field("on_round", &self.on_round.is_some())
            .field("revertible", &self.revertible)
            .finish()
    }
}

/// What a finished move did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct MoveReport {
    /// The move's ID in the journal.
    pub id: i64,
    /// The shard.
    pub shard: LogicalShard,
    /// Its schema.
    pub schema: String,
    /// Where it was.
    pub source: HostName,
    /// Where it is now.
    pub target: HostName,
    /// Rows moved (counted at verification).
    pub rows: i64,
    /// Bytes of its tables and indexes on the source.
    pub bytes: i64,
    /// The initial copy's duration, ms.
    pub copy_ms: u64,
    /// How long the shard's writes were stopped, ms (fence to flip).
    pub pause_ms: u64,
    /// How long the comparison of the whole shard before the fence took, ms (0 when
    /// the whole verification ran inside the fence).
    pub compare_ms: u64,
    /// Rows the verification read inside the fence: distinct keys written during the
    /// move (from the change logs), plus every row of a table verified in full there.
    pub rechecked_rows: i64,
    /// Per-table verification.
    pub tables: Vec<TableCheck>,
    /// What is left for `shardline gc` (a host was down at cleanup).
    pub cleanup_pending: Vec<String>,
}

impl MoveReport {
    /// Copy throughput, bytes per second.
    pub fn bytes_per_second(&self) -> f64 {
        per_second(self.bytes, self.copy_ms)
    }

    /// Copy throughput, rows per second.
    pub fn rows_per_second(&self) -> f64 {
        per_second(self.rows, self.copy_ms)
    }
}

#[allow(clippy::cast_precision_loss)]
fn per_second(n: i64, ms: u64) -> f64 {
    n as f64 * 1000.0 / ms.max(1) as f64
}

impl std::fmt::Display for MoveReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "moved shard {} ({}) {} -> {} (move {})\n  rows: {}\n  bytes: {}\n  copy: {} ms ({:.0} rows/s, {:.1} MB/s of tables and indexes)\n  write pause: {} ms ({} row(s) rechecked inside it; {} ms comparing before it)",
            self.shard,
            self.schema,
            self.source,
            self.target,
            self.id,
            self.rows,
            self.bytes,
            self.copy_ms,
            self.rows_per_second(),
            self.bytes_per_second() / 1e6,
            self.pause_ms,
            self.rechecked_rows,
            self.compare_ms
        )?;
        for t in &self.tables {
            write!(f, "\n  verified {}: {} rows", t.table, t.target_rows)?;
        }
        for p in &self.cleanup_pending {
            write!(f, "\n  left for `shardline gc`: {p}")?;
        }
        Ok(())
    }
}

/// What `--abort` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct AbortReport {
    /// The move.
    pub id: i64,
    /// The shard, back on its source (it never left the map).
    pub shard: LogicalShard,
    /// The source host.
    pub source: HostName,
    /// Whether the source's schema had to be unfenced (renamed back).
    pub unfenced: bool,
    /// What is left for `shardline gc`.
    pub cleanup_pending: Vec<String>,
}

impl std::fmt::Display for AbortReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "move {} undone: shard {} stays on {}", self.id, self.shard, self.source)?;
        if self.unfenced {
            write!(f, " (writes resumed)")?;
        }
        for p in &self.cleanup_pending {
            write!(f, "\n  left for `shardline gc`: {p}")?;
        }
        Ok(())
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A new name for move `id`'s publication, subscription and slot.
fn replication_name(id: i64) -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(now_ms());
    h.write_u32(std::process::id());
    format!("shardline_move_{id}_{:08x}", h.finish() & 0xffff_ffff)
}

/// The name the source's schema gets at the fence: `<schema>_moved_<id>`, or
/// `shardline_moved_<id>` where that would pass Postgres's 63 bytes.
pub(crate) fn moved_name(schema: &SchemaName, id: i64) -> String {
    let name = format!("{}_moved_{id}", schema.as_str());
    if name.len() <= 63 { name } else { format!("shardline_moved_{id}") }
}

/// The secondary indexes of a schema: those no constraint owns, and that are not a
/// table's replica identity, nor a partitioned index one of whose partitions' is
/// (dropped, the table would have none, which a rebuilt index does not give back: the
/// target's apply of an update or delete would fail until the copy timed out).
const SECONDARY_INDEXES: &str = "SELECT c.relname::text FROM pg_index i
   JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace
  WHERE n.nspname = $1 AND NOT i.indisreplident
    -- (No rows for an index that is neither partitioned nor a partition's.)
    AND NOT EXISTS (SELECT FROM pg_partition_tree(i.indexrelid) t
                      JOIN pg_index x ON x.indexrelid = t.relid WHERE x.indisreplident)
    AND NOT EXISTS (SELECT FROM pg_constraint k WHERE k.conindid = i.indexrelid)
    AND NOT EXISTS (SELECT FROM pg_inherits h WHERE h.inhrelid = i.indexrelid)";

async fn host_client(config: &Config, name: &HostName) -> Result<Client> {
    let h = config
        .hosts
        .iter()
        .find(|h| h.name == *name)
        .ok_or_else(|| Error::HostMissing { host: name.clone(), shards: 0 })?;
    Ok(connect(&h.url, &format!("host {name}")).await?)
}

/// A connection to `name` for move `id`, named `shardline move <id>` on the server.
/// First, any session of an earlier mover of the same move still at work there is
/// ended and waited out: a mover killed while the server ran its statement (a slot
/// being made waits for every running transaction on the server) would otherwise
/// finish that statement after a resume or an abort had cleaned up, and leave a slot
/// or a publication behind.
async fn mover_client(config: &Config, name: &HostName, id: i64) -> Result<Client> {
    let c = host_client(config, name).await?;
    let app = format!("shardline move {id}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: i64 = c
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                  WHERE application_name = $1 AND datname = current_database() AND pid <> pg_backend_pid()",
                &[&app],
            )
            .await
            .map_err(on(name, "end an earlier mover's sessions"))?
            .get(0);
        if left == 0 {
            break;
        }
        if Instant::now() >= deadline {
            tracing::warn!(host = %name, move_id = id, left, "an earlier mover's sessions did not end in 10 s");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    mover_session(&c, name, id).await?;
    Ok(c)
}

/// Sets up a session of move `id`'s ([`maintenance_session`], named `shardline move
/// <id>`), and marks it as the move's own: the guards of the move's copy let it write
/// (`copy::guard_sql`).
pub(super) async fn mover_session(c: &Client, host: &HostName, id: i64) -> Result<()> {
    maintenance_session(c, host, &format!("shardline move {id}")).await?;
    c.execute("SELECT set_config('shardline.move', $1, false)", &[&id.to_string()])
        .await
        .map_err(on(host, "set up the session"))?;
    Ok(())
}

/// The settings a value's text depends on, pinned on both sides of a move: the copy's
/// text `COPY` writes and reads values by them (exact, as the subscription's own
/// connections and pg_dump set them), and the comparisons read keys and hash some
/// values as their text (`verify::HASHED_COLUMNS`). Set on a mover's session only from
/// the comparisons on: the target's schema and indexes are built before, under the
/// server's settings, as `init` and `migrate` build them (a literal in a migration is
/// read by `datestyle` and `timezone`).
const TEXT_SETTINGS: &str = "SET datestyle = 'ISO, YMD'; SET intervalstyle = 'postgres';
    SET extra_float_digits = 3; SET lc_monetary = 'C'; SET bytea_output = 'hex'; SET timezone = 'UTC'";

/// Names `c`'s session `app` on the server and, where its role may set it (a superuser,
/// or `GRANT SET ON PARAMETER deadlock_timeout`), sets its `deadlock_timeout` to
/// [`MAINTENANCE_DEADLOCK_TIMEOUT`]. For the sessions of moves and `gc`, which lock the
/// shard's tables (the fence, the change log's triggers, their clean-up) while the
/// shard's writers queue behind their wait: Postgres cancels an autovacuum that holds
/// such a lock only once the waiter has waited `deadlock_timeout` (1 s by default).
pub(crate) async fn maintenance_session(c: &Client, host: &HostName, app: &str) -> Result<()> {
    c.execute(
        "SELECT set_config('application_name', $1, false),
                CASE WHEN has_parameter_privilege('deadlock_timeout', 'SET')
                     THEN set_config('deadlock_timeout', $2, false) END",
        &[&app, &format!("{}ms", MAINTENANCE_DEADLOCK_TIMEOUT.as_millis())],
    )
    .await
    .map_err(on(host, "set up the session"))?;
    Ok(())
}

/// The `deadlock_timeout` of the sessions of moves and `gc` (see [`maintenance_session`]):
/// how long their lock waits let an autovacuum worker holding the lock run before
/// Postgres cancels the worker.
const MAINTENANCE_DEADLOCK_TIMEOUT: Duration = Duration::from_millis(20);

/// `work` on the catalog for move `id`, given up (as [`Error::Journal`]) once `after`
/// (the move's `hung_after`, 2 s at least) has passed without its answer. The mover
/// renews the fence's lease for as long as it lives: a catalog that answers nothing
/// (hung, or cut off) must not hold it, and so the fenced shard, for as long as that
/// lasts. A step given up inside the fence is undone on the source.
pub(super) async fn catalog_bounded<T>(
    id: i64,
    after: Duration,
    what: &str,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let after = after.max(Duration::from_secs(2));
    match tokio::time::timeout(after, work).await {
        Ok(r) => r,
        Err(_) => Err(Error::Journal {
            id,
            message: format!("the catalog answered nothing within {after:?} ({what})"),
        }),
    }
}

/// `work`, unless one of `hosts` answers no probe for `hung_after` first: then `Err`
/// with the watchdog's error (and `work` is dropped where it was). `work` wins a tie.
pub(crate) async fn unless_hung<T>(
    config: &Config,
    hosts: &[HostName],
    hung_after: Duration,
    work: impl std::future::Future<Output = T>,
) -> std::result::Result<T, Error> {
    // On the heap: a step's future is big, and a debug build's stack is not.
    let work = Box::pin(work);
    let dog = Box::pin(watchdog(config, hosts, hung_after));
    tokio::select! {
        biased;
        r = work => Ok(r),
        hung = dog => Err(hung),
    }
}

/// How often the watchdog probes each host, and how long one probe may take.
const PROBE_EVERY: Duration = Duration::from_secs(1);
const PROBE_LIMIT: Duration = Duration::from_secs(5);

/// Resolves, with the error to fail the move with, once one of `hosts` has answered no
/// probe for `hung_after`: a `SELECT 1` on a connection of the watchdog's own (so a
/// long statement of the move's does not count), every [`PROBE_EVERY`].
pub(super) async fn watchdog(config: &Config, hosts: &[HostName], hung_after: Duration) -> Error {
    let i = unanswered(hosts.len(), |i| host_client(config, &hosts[i]), hung_after).await;
    let host = &hosts[i];
    tracing::warn!(host = %host, ?hung_after, "a host answers no probe; giving up the work on it");
    Error::Timeout {
        host: host.clone(),
        what: "an answer to a liveness probe (the host is hung or cut off)".into(),
        after: hung_after.max(PROBE_EVERY * 2),
    }
}

/// How long the catalog may answer no probe before `init`, `migrate` and `gc` give up
/// (as a host's [`MoveOptions::hung_after`] by default).
pub(crate) const CATALOG_HUNG_AFTER: Duration = Duration::from_secs(15);

/// `work`, unless the catalog answers no probe for `hung_after` first (as [`watchdog`]
/// probes hosts): then [`Error::CatalogHung`], and `work` is dropped where it was. For
/// the operations whose catalog session would otherwise wait on a hung catalog for as
/// long as it lasts (`gc`, `init`, `migrate`, `status`); the catalog's own waits that
/// are meant to last (another `gc`'s lock) go on while it answers.
pub(crate) async fn unless_catalog_hung<T>(
    config: &Config,
    hung_after: Duration,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let work = Box::pin(work);
    let dog = Box::pin(async {
        unanswered(1, |_| async { Ok(connect(&config.catalog, "catalog").await?) }, hung_after).await;
        tracing::warn!(?hung_after, "the catalog answers no probe; giving up");
        Error::CatalogHung { after: hung_after.max(PROBE_EVERY * 2) }
    });
    tokio::select! {
        biased;
        r = work => r,
        hung = dog => Err(hung),
    }
}

/// `work`, unless the catalog answers no probe for [`CATALOG_HUNG_AFTER`] first (then
/// [`Error::CatalogHung`]): the bound of the operations that read or write only the
/// catalog before anything is journaled (`map`, `locate`, `moves`, the `host` commands,
/// `rebalance`'s plan, a move's start), whose session would otherwise wait on a hung
/// catalog for as long as it lasts (a frozen server or a cut link looks, from the
/// client's socket, like a slow answer).
pub(crate) async fn catalog_watched<T>(
    config: &Config,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    unless_catalog_hung(config, CATALOG_HUNG_AFTER, work).await
}

/// Probes `n` servers (`connect(i)` opens a connection to the i-th) every
/// [`PROBE_EVERY`] with a `SELECT 1` on a connection of its own, and resolves with the
/// first one that has answered none for `hung_after` (two probes at least).
async fn unanswered<F, Fut>(n: usize, connect: F, hung_after: Duration) -> usize
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<Client>>,
{
    // Two probes at least: one missed probe is not a hang.
    let hung_after = hung_after.max(PROBE_EVERY * 2);
    let mut answered = vec![Instant::now(); n];
    let mut clients: Vec<Option<Client>> = (0..n).map(|_| None).collect();
    loop {
        tokio::time::sleep(PROBE_EVERY).await;
        for (i, slot) in clients.iter_mut().enumerate() {
            // A new connection within what is left of `hung_after` since the last answer
            // (so a hang is told within it, whatever the URL's hosts' timeouts add up
            // to), then the probe within PROBE_LIMIT.
            if slot.as_ref().is_none_or(Client::is_closed) {
                let left = hung_after.saturating_sub(answered[i].elapsed()).max(PROBE_EVERY);
                *slot = match tokio::time::timeout(left, connect(i)).await {
                    Err(_) => None,
                    Ok(Ok(c)) => Some(c),
                    // A server that refused the connection with an error answered.
                    Ok(Err(Error::Repo(shardline_repo::Error::Connect { source, .. })))
                        if source.as_db_error().is_some() =>
                    {
                        answered[i] = Instant::now();
                        None
                    }
                    Ok(Err(_)) => None,
                };
            }
            if let Some(c) = slot.as_ref() {
                match tokio::time::timeout(PROBE_LIMIT, c.simple_query("SELECT 1")).await {
                    Ok(Ok(_)) => answered[i] = Instant::now(),
                    // The server answered, with an error: it is not hung.
                    Ok(Err(e)) if e.as_db_error().is_some() => answered[i] = Instant::now(),
                    // A new connection next time: this one may be the stuck one.
                    _ => *slot = None,
                }
            }
            if answered[i].elapsed() >= hung_after {
                return i;
            }
        }
    }
}

fn on(host: &HostName, what: impl Into<String>) -> impl Fn(tokio_postgres::Error) -> Error {
    let (host, what) = (host.clone(), what.into());
    move |e| host_err(&host, &what, &e)
}

/// Whether a failure is a lock that could not be had in time, or a deadlock.
fn is_lock_conflict(e: &Error) -> bool {
    matches!(e.sqlstate(), Some("55P03" | "40P01"))
}

/// Takes, for the catalog session, the cluster lock shared (so `init` and `migrate`
/// wait for moves, and moves for them) and the move's own lock (one process per move).
async fn lock_move(catalog: &Catalog, id: i64) -> Result<()> {
    // A mover that just ended (an error, `--stop-after`) holds the move's lock until its
    // server notices the session is gone, a few milliseconds after: wait that out, so a
    // resume right after a failure is not refused, but never wait on a live mover long.
    const WAIT: Duration = Duration::from_secs(3);
    let deadline = Instant::now() + WAIT;
    loop {
        let (cluster, this) = catalog.try_lock_move(id).await?;
        if cluster && this {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(if cluster { Error::MoveBusy { id } } else { Error::Busy });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Mover<'a> {
    config: &'a Config,
    options: &'a MoveOptions,
    catalog: Catalog,
    id: i64,
    shard: LogicalShard,
    schema: SchemaName,
    moved: String,
    source: HostName,
    target: HostName,
    step: Step,
    detail: Detail,
    layout: Layout,
    src: Option<Client>,
    dst: Option<Client>,
    fence_started: Option<Instant>,
    /// Where [`MoveOptions::max_pause`] is counted from: this process's fence (its
    /// wait for the shard's locks included), or, for a move found fenced, this
    /// process's resume (the machines' clocks are not compared).
    pause_from: Option<Instant>,
    /// The end of the last sub-step of the pause timed (see [`Mover::lap`]).
    lap_at: Option<Instant>,
    /// The flip's proof, made before the fence (its SHA-256 journaled with `fenced`),
    /// so deciding the flip inside the pause is one statement.
    flip_token: Option<String>,
    renewer: Option<Renewer>,
}

impl<'a> Mover<'a> {
    async fn load(
        config: &'a Config,
        options: &'a MoveOptions,
        catalog: Catalog,
        layout: Layout,
        record: MoveRecord,
    ) -> Result<Mover<'a>> {
        let shard = record.shard.within(config.logical_shards)?;
        let schema = config.schema_prefix.schema(shard);
        Ok(Mover {
            config,
            options,
            catalog,
            id: record.id,
            shard,
            moved: moved_name(&schema, record.id),
            schema,
            source: record.source,
            target: record.target,
            step: record.step,
            detail: record.detail,
            layout,
            src: None,
            dst: None,
            fence_started: None,
            pause_from: None,
            lap_at: None,
            flip_token: None,
            renewer: None,
        })
    }

    /// Records, while the shard is fenced by this mover, the time since the last
    /// sub-step of the pause as sub-step `what` (`detail.pause_steps`).
    fn lap(&mut self, what: &str) {
        if let Some(at) = self.lap_at {
            let now = Instant::now();
            let us = u64::try_from(now.duration_since(at).as_micros()).unwrap_or(u64::MAX);
            self.detail.pause_steps.push((what.to_owned(), us));
            self.lap_at = Some(now);
        }
    }

    fn name(&self) -> String {
        self.detail.name.clone()
    }

    fn report(&self, progress: MoveProgress) {
        if let Some(p) = &self.options.progress {
            p(&progress);
        }
    }

    async fn src(&mut self) -> Result<&Client> {
        if self.src.as_ref().is_none_or(Client::is_closed) {
            self.src = Some(mover_client(self.config, &self.source, self.id).await?);
        }
        self.src.as_ref().ok_or(Error::Busy)
    }

    /// Fails, naming the source, when it does not answer: waits for changes it should
    /// send (the copy, a marker) call this now and then, so a dead source ends the wait
    /// with an error instead of running out the copy timeout.
    async fn source_answers(&mut self) -> Result<()> {
        let source = self.source.clone();
        let limit = Duration::from_secs(10);
        let check = async {
            self.src()
                .await?
                .simple_query("SELECT 1")
                .await
                .map_err(on(&source, "check that the source answers"))
        };
        match tokio::time::timeout(limit, check).await {
            Ok(r) => r.map(drop),
            Err(_) => Err(Error::Timeout {
                host: source.clone(),
                what: "check that the source answers".into(),
                after: limit,
            }),
        }
    }

    /// Whether the source has the shard's schema under its own name (`live`), and under
    /// the fence's name (`fenced`).
    async fn source_schemas(&mut self) -> Result<(bool, bool)> {
        let (source, schema, moved) = (self.source.clone(), self.schema.clone(), self.moved.clone());
        let row = self
            .src()
            .await?
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1),
                        EXISTS (SELECT FROM pg_namespace WHERE nspname = $2)",
                &[&schema.as_str(), &moved],
            )
            .await
            .map_err(on(&source, "look for the schema"))?;
        Ok((row.get(0), row.get(1)))
    }

    async fn dst(&mut self) -> Result<&Client> {
        if self.dst.as_ref().is_none_or(Client::is_closed) {
            self.dst = Some(mover_client(self.config, &self.target, self.id).await?);
        }
        self.dst.as_ref().ok_or(Error::Busy)
    }

    /// The detail as the journal keeps it.
    fn detail_json(&self) -> Result<String> {
        serde_json::to_string(&self.detail)
            .map_err(|e| Error::Journal { id: self.id, message: e.to_string() })
    }

    /// Writes the step done (and the detail) to the journal.
    async fn journal(&mut self, step: Step) -> Result<()> {
        self.lap(&step.to_string());
        let detail = self.detail_json()?;
        let n = catalog_bounded(
            self.id,
            self.options.hung_after,
            "journal a step",
            journal::step_done(&self.catalog, self.id, step, &detail),
        )
        .await?;
        self.lap(&format!("journal {step}"));
        if n != 1 {
            return Err(Error::Journal {
                id: self.id,
                message: "it is no longer running (aborted by another shardline?)".into(),
            });
        }
        self.step = step;
        tracing::info!(id = self.id, shard = self.shard.get(), %step, "move step done");
        self.report(MoveProgress::Step { id: self.id, step });
        Ok(())
    }

    /// Runs the step after the journaled one.
    async fn run_step(&mut self) -> Result<()> {
        match self.step {
            Step::Started => self.prepare().await,
            Step::Prepared => self.subscribe().await,
            Step::Copying => self.catch_up().await,
            Step::CaughtUp => self.fence().await,
            Step::Fenced => self.sync().await,
            Step::Synced => self.carry_sequence().await,
            Step::SequenceCarried => self.verify().await,
            Step::Verified => {
                // Grants made on the source during the move, before the map moves.
                let (config, hung_after) = (self.config, self.options.hung_after);
                let both = [self.source.clone(), self.target.clone()];
                let moved = self.moved.clone();
                let carried = unless_hung(config, &both, hung_after, self.carry_privileges(moved)).await;
                self.settle(carried).await?;
                self.lap("grants");
                self.flip().await
            }
            Step::Flipped | Step::Cleaned => self.clean().await,
        }
    }

    /// After the watchdog gave up a step: the step's statements may still be running,
    /// or have left a transaction open, on the move's connections. They are dropped
    /// (the next use reconnects, and `mover_client` ends the old sessions on the host,
    /// rolling their work back), and the catalog's connection is opened anew unless it
    /// answers.
    /// The result of work run [`unless_hung`]: its own, or the watchdog's error once
    /// the move's connections were forgotten ([`Mover::forget_connections`]).
    pub(super) async fn settle<T>(&mut self, r: std::result::Result<Result<T>, Error>) -> Result<T> {
        match r {
            Ok(r) => r,
            Err(hung) => {
                self.forget_connections().await;
                Err(hung)
            }
        }
    }

    /// [`MoveOptions::max_pause`], at least 1 s.
    fn max_pause(&self) -> Duration {
        self.options.max_pause.max(Duration::from_secs(1))
    }

    /// How much of [`MoveOptions::max_pause`] is left, when the shard is fenced and its
    /// copy not yet verified (counted from [`Mover::pause_from`]).
    fn pause_left(&self) -> Option<Duration> {
        if !self.step.pauses_writes() || self.step >= Step::Verified {
            return None;
        }
        let from = self.pause_from?;
        Some(self.max_pause().saturating_sub(from.elapsed()))
    }

    async fn forget_connections(&mut self) {
        self.src = None;
        self.dst = None;
        // The catalog's session holds the move's lock, so a new one could not take it
        // while it lives: it is kept while it answers (a step given up on a hung host
        // left nothing running on it), and replaced only when it does not.
        if journal::answers(&self.catalog, Duration::from_secs(2)).await {
            return;
        }
        match Catalog::open(self.config).await {
            Ok((catalog, _)) if lock_move(&catalog, self.id).await.is_ok() => self.catalog = catalog,
            _ => tracing::warn!(id = self.id, "could not reopen the catalog after a hung step"),
        }
    }

    /// Runs the steps after the journaled one, through the end; gives up the step in
    /// progress when the source or the target stops answering (see
    /// [`MoveOptions::hung_after`]).
    async fn drive(&mut self) -> Result<MoveReport> {
        // A resumed move whose shard is (or may be) fenced: hold the lease again, or
        // learn that it ran out and the fence was undone.
        if self.step.pauses_writes() || self.step == Step::CaughtUp {
            let (config, hung_after, source) = (self.config, self.options.hung_after, [self.source.clone()]);
            let held = unless_hung(config, &source, hung_after, self.hold_lease()).await;
            self.settle(held).await?;
        }
        if self.step.pauses_writes() && self.pause_from.is_none() {
            self.pause_from = Some(Instant::now());
        }
        let (config, hung_after) = (self.config, self.options.hung_after);
        let hosts = [self.source.clone(), self.target.clone()];
        while self.step < Step::Cleaned {
            if self.options.stop_after == Some(self.step) {
                return Err(Error::Interrupted { id: self.id, step: self.step });
            }
            // The flip's decision and what follows bound their own parts (the
            // decision by the source's probes; the clean-up leaves a hung host's part
            // to gc): once decided, nothing may be given up as a failure.
            if self.step >= Step::Verified {
                self.run_step().await?;
                continue;
            }
            // Inside the fence, the step also ends where the pause would pass
            // `max_pause`: it is given up as a hung one is, and the move undone.
            let (left, step) = (self.pause_left(), self.step);
            let r = unless_hung(config, &hosts, hung_after, self.run_step());
            let r = match left {
                None => r.await,
                Some(left) => tokio::time::timeout(left, r).await.unwrap_or_else(|_| {
                    tracing::warn!(id = self.id, after = %step, "the shard's writes waited max_pause; giving the step up");
                    Err(Error::PauseTooLong {
                        id: self.id,
                        shard: self.shard,
                        step,
                        max_pause: self.max_pause(),
                    })
                }),
            };
            // A step given up at `max_pause` may have had its own journal entry on its
            // way to the catalog (its work done by then): the journal may then be a step
            // ahead, which the undo that follows does not mind (nothing is decided
            // before the flip).
            self.settle(r).await?;
        }
        Ok(MoveReport {
            id: self.id,
            shard: self.shard,
            schema: self.schema.to_string(),
            source: self.source.clone(),
            target: self.target.clone(),
            rows: self.detail.rows,
            bytes: self.detail.bytes,
            copy_ms: self.detail.copy_ms.unwrap_or(0),
            pause_ms: self.detail.pause_ms.unwrap_or(0),
            compare_ms: self.detail.precheck.as_ref().map_or(0, |p| p.ms),
            rechecked_rows: self.detail.rechecked_rows.unwrap_or(self.detail.rows),
            tables: self.detail.tables.clone(),
            cleanup_pending: self.detail.cleanup_pending.clone(),
        })
    }
}

/// `shardline move SHARD --to HOST`: pre-flight, then every step to the end.
///
/// A failure before the fence leaves the move journaled where it stopped (writes go on
/// on the source); `--resume` or `--abort` then. A failure while the shard is fenced
/// (including a failed verification) undoes the move at once, so writes resume on the
/// source; if even that fails, the move stays journaled for `--abort`.
///
/// # Errors
///
/// [`Error::Preflight`] with every problem (nothing changed); [`Error::Busy`] while an
/// `init` or `migrate` runs; a step's failure, naming the host and SQLSTATE;
/// [`Error::Verify`] with the differing keys; [`Error::PauseTooLong`] when the copy
/// was not verified within `options.max_pause` of the fence (undone);
/// [`Error::Interrupted`] when `options.stop_after` asked for it;
/// [`Error::UndoFailed`] when a failure inside the
/// fence could not be undone either (`--abort` finishes the undo); [`Error::Fleet`]
/// when the source or the target was readdressed while the pre-flight ran (nothing
/// journaled). Give `config` as loaded, not already resolved with the catalog's hosts
/// ([`crate::fleet::resolved`]): a move checks the addresses it read from the catalog,
/// and takes the URLs a config lists as the caller's own.
pub async fn run(
    config: &Config,
    shard: LogicalShard,
    target: &HostName,
    options: &MoveOptions,
) -> Result<MoveReport> {
    let given = config;
    let config = &crate::fleet::resolved_within(config, options.hung_after).await?;
    let mut check = preflight::preflight_for(
        config,
        shard,
        target,
        preflight::Need::MOVE,
        options.hung_after.max(Duration::from_secs(2)),
    )
    .await?;
    check.check_copy_time(options.max_rate, options.copy_timeout);
    if !check.is_ok() {
        return Err(Error::Preflight(Box::new(check)));
    }
    if let Some(hook) = &options.on_preflight {
        hook().await;
    }
    // Nothing is journaled yet: a catalog that hangs now fails the move, changing nothing.
    let (catalog, layout, id, detail) = unless_catalog_hung(config, options.hung_after, async {
        let (catalog, info) = Catalog::open(config).await?;
        // The ID first, so the journal's first row already names everything the move
        // will make (a mover killed right after it leaves nothing unnamed).
        let id = journal::next_id(&catalog).await?;
        let detail = Detail {
            schema: check.schema.to_string(),
            moved_schema: moved_name(&check.schema, id),
            name: replication_name(id),
            rows: check.rows_estimate,
            bytes: check.bytes,
            ..Detail::default()
        };
        let detail = revertible(&catalog, options, detail).await?;
        Ok((catalog, info.layout, id, detail))
    })
    .await?;
    start(given, config, options, catalog, layout, id, &check, &detail).await
}

/// `detail` with a new [`Revertible`] when `options` ask for one (the revert's journal
/// ID reserved now, so the reverse publication made before the fence can carry the
/// revert's marker row), else with the reason there is none.
async fn revertible(catalog: &Catalog, options: &MoveOptions, mut detail: Detail) -> Result<Detail> {
    if options.revertible {
        let id = journal::next_id(catalog).await?;
        detail.revert = Some(Revertible { id, name: replication_name(id), made: false, lsn: None });
    } else {
        detail.revert_unavailable = Some("it was not made revertible (`--revertible`)".into());
    }
    Ok(detail)
}

/// Journals move `id` as started and runs it to the end. `given` is the config as the
/// caller gave it, `config` the same resolved with the catalog's hosts before the
/// pre-flight (a host readdressed since is refused by the journal).
#[expect(
    clippy::too_many_arguments,
    reason = "each is one of the move's parts, passed on from run and revert"
)]
async fn start(
    given: &Config,
    config: &Config,
    options: &MoveOptions,
    catalog: Catalog,
    layout: Layout,
    id: i64,
    check: &preflight::Preflight,
    detail: &Detail,
) -> Result<MoveReport> {
    // The lock first: `gc` takes a revert's lock before it drops what the revert needs.
    unless_catalog_hung(config, options.hung_after, lock_move(&catalog, id)).await?;
    // Watched, not timed: journaling waits for a running `gc` to end (its lock), for as
    // long as it runs, while the catalog answers; nothing is fenced yet.
    // The source's and target's entries made from the catalog's records (not from the
    // operator's config): the journal refuses the move if either was readdressed since.
    let resolved: Vec<_> = [&check.source, &check.target]
        .into_iter()
        .filter(|h| given.host(h).is_none())
        .filter_map(|h| config.host(h).cloned())
        .collect();
    let record = unless_catalog_hung(config, options.hung_after, async {
        journal::start(&catalog, id, check.shard, &check.source, &check.target, detail, &resolved).await?;
        journal::ensure_complete_flip(&catalog).await?;
        journal::by_id(&catalog, id).await
    })
    .await?;
    let mover = Mover::load(config, options, catalog, layout, record).await?;
    mover.report(MoveProgress::Step { id, step: Step::Started });
    drive(mover).await
}

/// `shardline move SHARD --revert`: brings the shard back to where its last move took
/// it from, onto the old copy kept there until `gc`, brought up to date from the new
/// owner's reverse replication (kept since that move's flip) instead of a new copy. It
/// is a move like any other from there on (the change log, the comparison before the
/// fence, the fence, the sequence carried, verified, flipped) and is itself revertible.
///
/// # Errors
///
/// [`Error::NotRevertible`] naming why (no done move of the shard, the map moved on,
/// the old copy or the reverse slot gone, a migration since, already reverted), with
/// nothing changed; [`Error::Preflight`]; then as [`run`]. A revert undone before its
/// flip drops the old copy (the shard stays where it is; a later move back copies it
/// again).
pub async fn revert(config: &Config, shard: LogicalShard, options: &MoveOptions) -> Result<MoveReport> {
    let given = config;
    let config = &crate::fleet::resolved_within(config, options.hung_after).await?;
    // Nothing is journaled until `start`: a catalog that hangs before fails the revert,
    // changing nothing.
    let (catalog, layout, id, check, detail) =
        unless_catalog_hung(config, options.hung_after, revert_checked(config, shard, options)).await?;
    start(given, config, options, catalog, layout, id, &check, &detail).await
}

/// [`revert`]'s checks, and the journal's ID and detail of the revert they allow.
async fn revert_checked(
    config: &Config,
    shard: LogicalShard,
    options: &MoveOptions,
) -> Result<(Catalog, Layout, i64, preflight::Preflight, Detail)> {
    let (catalog, info) = Catalog::open(config).await?;
    let shard = shard.within(config.logical_shards)?;
    let not = |reason: String| Error::NotRevertible { shard, reason };
    let moves = journal::all(&catalog).await?;
    let last = moves
        .iter()
        .filter(|m| m.shard == shard && m.state != State::RolledBack)
        .max_by_key(|m| m.id)
        .ok_or_else(|| not("it has no finished move".into()))?;
    if last.state != State::Done {
        return Err(not(format!("its move {} is still running (finish it first)", last.id)));
    }
    let map = catalog.map().await?;
    if *map.host_of(shard) != last.target {
        return Err(not(format!(
            "the map places it on {}, not on {} where its last move ({}) took it",
            map.host_of(shard),
            last.target,
            last.id
        )));
    }
    let why = last.detail.revert_unavailable.clone().unwrap_or_else(|| "made by an older shardline".into());
    let rev = last
        .detail
        .revert
        .clone()
        .filter(|r| r.made)
        .ok_or_else(|| not(format!("its last move ({}) kept no reverse replication: {why}", last.id)))?;
    let lsn = rev
        .lsn
        .clone()
        .ok_or_else(|| not(format!("move {} did not record where the new owner's writes begin", last.id)))?;
    if let Some(used) = moves.iter().find(|m| m.id == rev.id) {
        return Err(not(if used.state == State::RolledBack {
            format!("its revert (move {}) was undone; move it with `--to {}`", used.id, last.source)
        } else {
            format!("move {} was already reverted by move {}", last.id, used.id)
        }));
    }
    if last.detail.source_dropped {
        return Err(not(format!("`gc` dropped its old copy on {}", last.source)));
    }
    if !last.detail.cleanup_pending.is_empty() {
        return Err(not(format!("move {} left work for `shardline gc`; run it first", last.id)));
    }
    check_revertible(config, last, &rev, &lsn, options.hung_after.max(Duration::from_secs(2)))
        .await?
        .map_err(not)?;
    let check = preflight::preflight_for(
        config,
        shard,
        &last.source,
        preflight::Need::REVERT,
        options.hung_after.max(Duration::from_secs(2)),
    )
    .await?;
    if !check.is_ok() {
        return Err(Error::Preflight(Box::new(check)));
    }
    if check.source != last.target {
        return Err(not(format!("the map moved it on to {} meanwhile", check.source)));
    }
    let detail = Detail {
        schema: check.schema.to_string(),
        moved_schema: moved_name(&check.schema, rev.id),
        name: rev.name.clone(),
        rows: check.rows_estimate,
        bytes: check.bytes,
        reverts: Some(Reverting {
            of: last.id,
            old_schema: last.detail.moved_schema.clone(),
            lsn,
            sequence_max: last.detail.sequence_max,
        }),
        ..Detail::default()
    };
    let detail = revertible(&catalog, options, detail).await?;
    Ok((catalog, info.layout, rev.id, check, detail))
}

/// What a revert of move `m` needs on its hosts (see [`check_reverse`]), asked on new
/// connections before the revert is journaled. `Err` says what is missing. Given up,
/// naming the host, once one of them has answered no probe for `hung_after`.
async fn check_revertible(
    config: &Config,
    m: &MoveRecord,
    rev: &Revertible,
    lsn: &str,
    hung_after: Duration,
) -> Result<Refusal> {
    let old = host_client(config, &m.source).await?;
    let new = host_client(config, &m.target).await?;
    let sides = Sides { old: &old, old_host: &m.source, new: &new, new_host: &m.target };
    let checked = check_reverse(&sides, &m.detail.moved_schema, &m.detail.schema, &rev.name, lsn);
    unless_hung(config, &[m.source.clone(), m.target.clone()], hung_after, checked).await?
}

/// The two hosts of a revert: the old copy's (the revert's target) and the new owner's.
pub(super) struct Sides<'c> {
    pub(super) old: &'c Client,
    pub(super) old_host: &'c HostName,
    pub(super) new: &'c Client,
    pub(super) new_host: &'c HostName,
}

/// Whether a revert can bring the shard (`schema` on the new owner) back onto the old
/// copy `old_schema`: the old copy is there, at the same migrations (the minter's and
/// the grants' rows aside, as the pre-flight compares), and the new owner still has the
/// reverse publication and an idle slot `name` that has not gone past `lsn` (or lost its
/// WAL). Asked before a revert is journaled, and again by its `prepare`, under the
/// move's lock (a migration cannot run meanwhile), before the old copy is touched.
/// `Ok(Err(_))` says what is missing; `Err` is a host that failed to answer.
pub(super) async fn check_reverse(
    sides: &Sides<'_>,
    old_schema: &str,
    schema: &str,
    name: &str,
    lsn: &str,
) -> Result<Refusal> {
    let ledger = "SELECT coalesce(array_agg(name || ':' || checksum ORDER BY name), '{}')::text[]
                    FROM shardline.shard_migrations WHERE schema_name = $1 AND name <> ALL($2)";
    let skip = [crate::converge::MINTER, crate::grants::GRANTS];
    let there: bool = sides
        .old
        .query_one("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", &[&old_schema])
        .await
        .map_err(|e| host_err(sides.old_host, "look for the old copy", &e))?
        .get(0);
    if !there {
        return Ok(Err(format!("its old copy {old_schema} is gone from {}", sides.old_host)));
    }
    let was: Vec<String> = sides
        .old
        .query_one(ledger, &[&old_schema, &skip.as_slice()])
        .await
        .map_err(|e| host_err(sides.old_host, "read the old copy's migrations", &e))?
        .get(0);
    let is: Vec<String> = sides
        .new
        .query_one(ledger, &[&schema, &skip.as_slice()])
        .await
        .map_err(|e| host_err(sides.new_host, "read the shard's migrations", &e))?
        .get(0);
    if was != is {
        return Ok(Err(format!(
            "a migration ran on it since its last move (the old copy on {} is behind); move it with `--to {}`",
            sides.old_host, sides.old_host
        )));
    }
    let row = sides
        .new
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_publication WHERE pubname = $1),
                    EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1 AND NOT active
                              AND wal_status <> 'lost' AND confirmed_flush_lsn <= $2::text::pg_lsn)",
            &[&name, &lsn],
        )
        .await
        .map_err(|e| host_err(sides.new_host, "look for the reverse replication", &e))?;
    let (published, slot): (bool, bool) = (row.get(0), row.get(1));
    if !published || !slot {
        return Ok(Err(format!(
            "its reverse replication {name} on {} is gone, in use, past the flip or without its WAL",
            sides.new_host
        )));
    }
    Ok(Ok(()))
}

/// Why a revert cannot go on (`Err`), or `Ok`.
pub(super) type Refusal = std::result::Result<(), String>;

/// The tables under the tables of schema `$1` (partitions and inheritance children, at
/// any depth, in any schema) that `$filter` (over `c`, the child's `pg_class` row, and
/// `n`, its schema) selects, qualified and quoted, in name order.
macro_rules! children_of_schema {
    ($filter:literal) => {
        concat!(
            "WITH RECURSIVE tree(oid, root) AS (
    SELECT c.oid, true FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE n.nspname = $1 AND c.relkind IN ('r', 'p')
    UNION SELECT h.inhrelid, false FROM pg_inherits h JOIN tree t ON h.inhparent = t.oid)
  SELECT DISTINCT format('%I.%I', n.nspname, c.relname) FROM tree t
    JOIN pg_class c ON c.oid = t.oid JOIN pg_namespace n ON n.oid = c.relnamespace
   WHERE NOT t.root AND ",
            $filter,
            " ORDER BY 1"
        )
    };
}

/// The foreign tables under the tables of schema `$1` (a partition, or an inheritance
/// child, at any depth, in any schema), qualified: their rows live on another server,
/// which both copies of a shard would share, and emptying a copy (a partitioned table's
/// `TRUNCATE`) would empty them there. A shard with one is not moved.
pub(crate) const FOREIGN_CHILDREN: &str = children_of_schema!("c.relkind = 'f'");

/// The partitions and inheritance children, at any depth, of `$1`'s tables that live in
/// another schema, qualified and quoted: a move copies the shard's schema, so their rows
/// would stay behind (and be missing from the shard once it flipped). A shard with one
/// is not moved.
pub(crate) const CHILDREN_ELSEWHERE: &str =
    children_of_schema!("c.relkind IN ('r', 'p') AND n.nspname <> $1");

/// The tables of `schema` on `host`, qualified and quoted as `schema_sql` (the
/// schema's name in the statement that uses them, which may differ from `schema`'s:
/// a copy being renamed), in name order: partitioned tables and the others.
pub(super) async fn tables_of(
    c: &Client,
    host: &HostName,
    schema: &str,
    schema_sql: &str,
) -> Result<Vec<String>> {
    Ok(c.query(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') ORDER BY 1",
        &[&schema],
    )
    .await
    .map_err(on(host, format!("list the tables of {schema}")))?
    .iter()
    .map(|r| format!("{schema_sql}.{}", quote_ident(r.get(0))))
    .collect())
}

/// How long a drop of a shard's schema waits for a lock someone holds on one of its
/// tables before it fails (55P03), leaving the schema for the next `gc`.
const DROP_LOCK_TIMEOUT_MS: u32 = 5000;

/// Drops the shard schema `name` (a moved shard's old copy, a move's undone copy) with
/// its ledger rows, in one transaction on `c`. A lock held on one of its tables past
/// [`DROP_LOCK_TIMEOUT_MS`] fails it (55P03) rather than holding the caller (the undo of
/// a move whose writes already resumed, which leaves the copy to `gc` in the journal; a
/// `gc` run, which leaves it to the next one and goes on): the transaction is rolled
/// back and the schema stays.
pub(crate) async fn drop_shard_schema(
    c: &Client,
    name: &str,
) -> std::result::Result<(), tokio_postgres::Error> {
    let sql = format!(
        "BEGIN; SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT_MS}ms'; DROP SCHEMA IF EXISTS {} CASCADE;
         DELETE FROM shardline.shard_migrations WHERE schema_name = {}; COMMIT",
        quote_ident(name),
        quote_literal(name)
    );
    let dropped = c.batch_execute(&sql).await;
    if dropped.is_err() {
        // A failed statement of the batch leaves its transaction open, aborted.
        let _ = c.batch_execute("ROLLBACK").await;
    }
    dropped
}

/// Drops a move's reverse publication and slot `name` on `host` (its target), if there.
pub(crate) async fn drop_revert_side(c: &Client, host: &HostName, name: &str) -> Result<()> {
    c.batch_execute(&format!("DROP PUBLICATION IF EXISTS {}", quote_ident(name)))
        .await
        .map_err(on(host, "drop the reverse publication"))?;
    drop_slots(c, host, name, &Detail::default()).await
}

async fn drive(mut mover: Mover<'_>) -> Result<MoveReport> {
    match mover.drive().await {
        Ok(r) => Ok(r),
        Err(e @ Error::Interrupted { .. }) => Err(e),
        Err(e) => {
            let fenced =
                mover.step.pauses_writes() || (mover.step == Step::CaughtUp && mover.fence_started.is_some());
            let verify = matches!(e, Error::Verify { .. } | Error::LeaseExpired { .. });
            if fenced || verify {
                let said = shardline_repo::error_chain(&e);
                tracing::warn!(id = mover.id, error = %said, "the move failed while the shard was fenced; undoing it");
                // The undo needs the source: bounded as the steps are, in case it is the
                // host that hung (a hung target's part is left to `gc` by the undo).
                let (config, hosts) = (mover.config, [mover.source.clone()]);
                let hung_after = mover.options.hung_after;
                let undone = unless_hung(config, &hosts, hung_after, undo(&mut mover, &said)).await;
                let undone = mover.settle(undone).await.map(drop);
                if let Err(undo) = undone {
                    if matches!(undo, Error::FlipDecided { .. }) {
                        tracing::error!(
                            id = mover.id,
                            "the source decided to flip: routers or `shardline move --resume` complete the flip"
                        );
                        record_error(
                            &mover,
                            &format!("{said}; the flip is decided: `shardline move --resume` finishes it"),
                        )
                        .await;
                        return Err(e);
                    }
                    let undo = shardline_repo::error_chain(&undo);
                    tracing::error!(id = mover.id, error = %undo, "could not undo the move; run `shardline move --abort`");
                    record_error(&mover, &format!("{said}; undoing it failed too: {undo}")).await;
                    // Not the move's own error: that one may say the move was undone.
                    return Err(Error::UndoFailed { id: mover.id, shard: mover.shard, failure: said, undo });
                }
            } else {
                record_error(&mover, &shardline_repo::error_chain(&e)).await;
            }
            Err(e)
        }
    }
}

async fn record_error(mover: &Mover<'_>, error: &str) {
    let bound = mover.options.hung_after.max(Duration::from_secs(2));
    let _ = tokio::time::timeout(bound, journal::record_error(&mover.catalog, mover.id, error)).await;
}

/// Installs [`RESOLVE_SQL`] on a host where it is missing (`init` replaces it
/// always, to upgrade it).
async fn install_resolve(c: &Client, host: &HostName) -> Result<()> {
    let missing: bool = c
        .query_one("SELECT to_regprocedure('shardline.resolve_fence(text)') IS NULL", &[])
        .await
        .map_err(on(host, "look for shardline.resolve_fence"))?
        .get(0);
    if missing {
        c.batch_execute(RESOLVE_SQL).await.map_err(on(host, "install shardline.resolve_fence"))?;
    }
    Ok(())
}

/// `shardline move --resume [SHARD]`: finishes the running moves (of one shard, or all),
/// each from its last journaled step.
///
/// # Errors
///
/// [`Error::NoMove`] when there is none; [`Error::MoveBusy`] when another process works
/// on it; a step's failure, as [`run`]. Of every running move (no shard given), each is
/// tried, whatever became of the ones before it: [`Error::ResumeIncomplete`] names those
/// not finished and why (one another process works on among them, so a loop that
/// resumes until it succeeds waits for it), and holds the reports of those finished.
pub async fn resume(
    config: &Config,
    shard: Option<LogicalShard>,
    options: &MoveOptions,
) -> Result<Vec<MoveReport>> {
    let config = &crate::fleet::resolved_within(config, options.hung_after).await?;
    let (info, records) = unless_catalog_hung(config, options.hung_after, async {
        let (catalog, info) = Catalog::open(config).await?;
        Ok((info, journal::running(&catalog, shard).await?))
    })
    .await?;
    if records.is_empty() {
        return Err(Error::NoMove { shard });
    }
    let several = records.len() > 1;
    let (mut out, mut failed) = (Vec::new(), Vec::new());
    for record in records {
        let (id, shard) = (record.id, record.shard);
        let one = async {
            let (catalog, record) = unless_catalog_hung(config, options.hung_after, async {
                let (catalog, _) = Catalog::open(config).await?;
                lock_move(&catalog, id).await?;
                // Read again under the lock: another process may have moved it on.
                let record = journal::by_id(&catalog, id).await?;
                Ok((catalog, record))
            })
            .await?;
            if record.state != State::Running {
                return Ok(None);
            }
            if record.detail.undoing {
                return Err(Error::Undoing { id, shard: record.shard });
            }
            let before_fence = record.step < Step::Fenced;
            let mut mover = Mover::load(config, options, catalog, info.layout, record).await?;
            // The source decided `undo` before the journal said so (an abort, or an
            // undo after a failure, stopped between the two): it can only be undone.
            // Only before the fence (an undo of a fenced shard leaves its marker
            // fenced), and bounded as the steps are: a move past its flip finishes
            // without its source.
            if before_fence {
                let (source, hung_after) = ([mover.source.clone()], options.hung_after);
                if unless_hung(config, &source, hung_after, mover.undo_decided_unfenced()).await?? {
                    return Err(Error::Undoing { id, shard });
                }
            }
            drive(mover).await.map(Some)
        };
        match one.await {
            Ok(Some(report)) => out.push(report),
            Ok(None) => {}
            Err(e) if !several => return Err(e),
            Err(e) => {
                let why = shardline_repo::error_chain(&e);
                tracing::warn!(id, %shard, error = %why, "a running move could not be resumed; trying the next");
                failed.push(format!("move {id} (shard {shard}): {why}"));
            }
        }
    }
    if failed.is_empty() { Ok(out) } else { Err(Error::ResumeIncomplete { failed, finished: out }) }
}

/// `shardline move --abort SHARD`: undoes the shard's running move. Refused once the
/// map has flipped (then `--resume` finishes it).
///
/// # Errors
///
/// [`Error::NoMove`]; [`Error::Flipped`]; [`Error::MoveBusy`]; the source unreachable,
/// or answering no probe for `options`' [`MoveOptions::hung_after`] (the only option an
/// abort reads; the move stays
/// journaled; abort again when it is back). A target that is down or hung is left to
/// `gc` (named in [`AbortReport::cleanup_pending`]).
pub async fn abort(config: &Config, shard: LogicalShard, options: &MoveOptions) -> Result<AbortReport> {
    let config = &crate::fleet::resolved_within(config, options.hung_after).await?;
    let (catalog, info, record) = unless_catalog_hung(config, options.hung_after, async {
        let (catalog, info) = Catalog::open(config).await?;
        let record = journal::running(&catalog, Some(shard))
            .await?
            .into_iter()
            .next()
            .ok_or(Error::NoMove { shard: Some(shard) })?;
        lock_move(&catalog, record.id).await?;
        let record = journal::by_id(&catalog, record.id).await?;
        Ok((catalog, info, record))
    })
    .await?;
    if record.state != State::Running {
        return Err(Error::NoMove { shard: Some(shard) });
    }
    let options = MoveOptions { hung_after: options.hung_after, ..MoveOptions::default() };
    let mut mover = Mover::load(config, &options, catalog, info.layout, record).await?;
    // Bounded as a move's undo is: a source that stops answering fails the abort, naming
    // it, and the move stays as it was (a hung target's part is left to `gc` by the undo).
    let hosts = [mover.source.clone()];
    let undone =
        unless_hung(config, &hosts, options.hung_after, undo(&mut mover, "aborted by the operator")).await;
    mover.settle(undone).await
}
