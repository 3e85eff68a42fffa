//! The journal of moves, `shardline.moves` in the catalog: one row per move, its step
//! written after each step is done, so an interrupted move is resumed or undone from
//! exactly where it stopped.
//!
//! This module owns the table: its DDL ([`SCHEMA_SQL`]), the catalog function that
//! completes a decided flip ([`COMPLETE_FLIP_SQL`]), and every statement on it. The
//! flip's transaction is here too: it writes the map through
//! [`Catalog::flip_shard`] (the map is `shardline_repo::catalog`'s) and the journal, on
//! the catalog's one connection. Outside this module only the router reads the journal,
//! through one narrow query of its own (`shardline_repo::Catalog::moves_of`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use shardline_repo::catalog::{CatalogHost, GC_LOCK_KEY, HostState};
use shardline_repo::{Catalog, credentials};
use shardline_router::config::{DbUrl, HostConfig};
use shardline_router::{Config, HostName, LogicalShard};
use tokio_postgres::Client;

use crate::{Error, Result};

/// The journal's table, created if missing (`init`, every run). Idempotent: a catalog
/// made before this module owned it has the same table, and keeps it.
pub const SCHEMA_SQL: &str = r#"
CREATE TABLE IF NOT EXISTS shardline.moves (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    shard      integer NOT NULL,
    source     text NOT NULL REFERENCES shardline.hosts (name),
    target     text NOT NULL REFERENCES shardline.hosts (name),
    step       text NOT NULL,
    state      text NOT NULL CHECK (state IN ('running', 'done', 'failed', 'rolled_back')),
    detail     jsonb NOT NULL DEFAULT '{}',
    error      text,
    started_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX IF NOT EXISTS moves_one_running_per_shard ON shardline.moves (shard) WHERE state = 'running';
COMMENT ON TABLE shardline.moves IS 'shardline: the journal of shard moves, one row per move, its step updated as it goes';
"#;

/// `shardline.complete_flip(move, token)` in the catalog: flips the map for a move
/// whose source decided `flip` (its data verified, its ID sequence carried), when the
/// mover did not get to it. `token` is the proof: the source's `flip_token`, which
/// exists only once the source decided, and whose SHA-256 the mover journaled before
/// deciding (`detail.flip_check`). It flips only a running move journaled `verified`,
/// from its source to its target, with the journal, in one transaction; returns
/// whether it did.
///
/// SECURITY DEFINER, EXECUTE for PUBLIC: without the token it does nothing.
pub const COMPLETE_FLIP_SQL: &str = r#"
CREATE OR REPLACE FUNCTION shardline.complete_flip(move bigint, token text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    m record;
BEGIN
    SELECT id, shard, source, target, detail INTO m FROM shardline.moves
     WHERE id = move AND state = 'running' AND step = 'verified' FOR UPDATE;
    IF NOT FOUND OR token IS NULL OR m.detail->>'flip_check' IS NULL
       OR encode(sha256(convert_to(token, 'UTF8')), 'hex') <> m.detail->>'flip_check' THEN
        RETURN false;
    END IF;
    UPDATE shardline.shards SET host = m.target, updated_at = now() WHERE shard = m.shard AND host = m.source;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE shardline.moves SET step = 'flipped', error = NULL, updated_at = now() WHERE id = move;
    RETURN true;
END
$fn$;
REVOKE ALL ON FUNCTION shardline.complete_flip(bigint, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION shardline.complete_flip(bigint, text) TO PUBLIC;
"#;

/// The catalog's connection, lent to this module alone in ops for the journal's
/// statements ([`Catalog::lend`]).
#[expect(clippy::disallowed_methods, reason = "the journal of moves is this module's table in the catalog")]
fn client(catalog: &Catalog) -> &Client {
    catalog.lend()
}

/// Whether the catalog's session answers a `SELECT 1` within `within` (nothing of a
/// given-up step still running on it ahead of the probe).
pub(crate) async fn answers(catalog: &Catalog, within: std::time::Duration) -> bool {
    matches!(tokio::time::timeout(within, client(catalog).simple_query("SELECT 1")).await, Ok(Ok(_)))
}

/// The steps of a move, in order. The journal holds the last step **done**.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Step {
    /// Journaled, after the pre-flight passed.
    Started,
    /// The schema and tables built on the target (same migrations, same minter); the
    /// publication made on the source.
    Prepared,
    /// The target subscribed to the source: the initial copy, then streaming.
    Copying,
    /// Every table copied, and a change on the source reaches the target within the
    /// allowed lag.
    CaughtUp,
    /// Writes to the shard stopped on the source, in one transaction: its tables locked,
    /// its ID sequence locked (once every transaction that minted from it has ended) and
    /// capped at its last value, and its schema renamed. From here until
    /// [`Step::Flipped`] the shard's writes wait, and the source mints no more IDs.
    Fenced,
    /// Everything the source committed is on the target.
    Synced,
    /// The target's ID sequence set to at least the source's last value (read while no
    /// transaction could mint on the source), so the target mints above every ID the
    /// source handed out.
    SequenceCarried,
    /// Row counts and checksums equal, table by table.
    Verified,
    /// The catalog's map places the shard on the target (routers notified).
    Flipped,
    /// Subscription, publication and slots dropped.
    Cleaned,
}

impl Step {
    /// Every step, in order.
    pub const ALL: [Step; 10] = [
        Step::Started,
        Step::Prepared,
        Step::Copying,
        Step::CaughtUp,
        Step::Fenced,
        Step::Synced,
        Step::SequenceCarried,
        Step::Verified,
        Step::Flipped,
        Step::Cleaned,
    ];

    /// The name kept in the journal.
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Started => "started",
            Step::Prepared => "prepared",
            Step::Copying => "copying",
            Step::CaughtUp => "caught_up",
            Step::Fenced => "fenced",
            Step::Synced => "synced",
            Step::SequenceCarried => "sequence_carried",
            Step::Verified => "verified",
            Step::Flipped => "flipped",
            Step::Cleaned => "cleaned",
        }
    }

    /// The step a journal name stands for.
    pub fn parse(name: &str) -> Option<Step> {
        Step::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// Whether, with this step done, the shard's writes are stopped (fenced, not yet
    /// flipped).
    pub fn pauses_writes(self) -> bool {
        self >= Step::Fenced && self < Step::Flipped
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a move stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum State {
    /// Under way, or interrupted: `--resume` finishes it, `--abort` undoes it.
    Running,
    /// Finished: the shard is on the target.
    Done,
    /// Undone: the shard is on the source, as before.
    RolledBack,
    /// Given up without a rollback (not written by this version; kept for the
    /// catalog's constraint).
    Failed,
}

impl State {
    fn parse(name: &str) -> Option<State> {
        match name {
            "running" => Some(State::Running),
            "done" => Some(State::Done),
            "rolled_back" => Some(State::RolledBack),
            "failed" => Some(State::Failed),
            _ => None,
        }
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            State::Running => "running",
            State::Done => "done",
            State::RolledBack => "rolled_back",
            State::Failed => "failed",
        })
    }
}

/// One table's verification: rows and checksum on each side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TableCheck {
    /// The table.
    pub table: String,
    /// Rows on the source.
    pub source_rows: i64,
    /// Rows on the target.
    pub target_rows: i64,
    /// Whether counts and checksums (sums of row hashes, so duplicates count) are equal.
    pub matches: bool,
}

/// A move's numbers and the names it needs to resume, kept as JSON in the journal.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct Detail {
    /// The shard's schema.
    pub schema: String,
    /// The name of the move's publication, subscription and slot:
    /// `shardline_move_<id>_<token>`, the token keeping it unique on hosts that serve
    /// more than one cluster (slot names are per server).
    pub name: String,
    /// The name the source's schema gets at the fence (kept until `gc`).
    pub moved_schema: String,
    /// The target's subscription OID (names its table-sync slots on the source).
    pub subscription_oid: Option<u32>,
    /// The target server's system identifier, the last part of its table-sync slots'
    /// names (`pg_<subscription>_sync_<table>_<system>`): two targets may give their
    /// subscriptions the same OID, never the same system identifier.
    pub target_system: Option<i64>,
    /// Rows in the shard (pre-flight estimate until verified, then counted).
    pub rows: i64,
    /// Bytes of the shard's tables and indexes on the source.
    pub bytes: i64,
    /// How long the initial copy took, in ms.
    pub copy_ms: Option<u64>,
    /// The mover's own copy of the rows ([`crate::moves::MoveOptions::max_rate`]), when
    /// it copied: the bytes read from the source, how long that took (ms) and the rate
    /// it was held to (bytes a second; 0: none).
    pub rows_copied: Option<RowsCopied>,
    /// How many times the initial copy started over because a table's copy could not
    /// finish (its table-sync worker died between dropping its slot and recording that
    /// it was done; see `docs/moves.md`).
    pub copy_restarts: u32,
    /// The last measured replication lag before the fence, in ms.
    pub lag_ms: Option<u64>,
    /// When the fence began (ms since the Unix epoch, the mover's clock).
    pub fenced_at_ms: Option<u64>,
    /// The source's marker value written by the fence.
    pub fence_mark: Option<i64>,
    /// The source's last ID sequence value, read inside the fence once every minting
    /// transaction had ended; the fence capped the source's sequence at it.
    pub fence_sequence: Option<i64>,
    /// The source's sequence's MAXVALUE before the fence capped it; undoing the move
    /// restores it (the layout's maximum when this is unknown).
    pub sequence_max: Option<i64>,
    /// The SHA-256 (hex) of the proof the source keeps with its decision to flip;
    /// `shardline.complete_flip` flips only for the token that hashes to it.
    pub flip_check: Option<String>,
    /// The ID sequence value carried to the target.
    pub sequence: Option<i64>,
    /// How long the shard's writes were stopped, in ms.
    pub pause_ms: Option<u64>,
    /// Per-table verification.
    pub tables: Vec<TableCheck>,
    /// On a failed verification: the differing primary keys, or whole rows (with how
    /// often each side holds them) for a table without one (at most 20 per table).
    pub differences: Vec<String>,
    /// What could not be cleaned up (a host was down), for `shardline gc`.
    pub cleanup_pending: Vec<String>,
    /// A rollback could not drop the target's copy of the schema; `gc` does.
    pub target_schema_left: bool,
    /// `gc` dropped the source's old schema.
    pub source_dropped: bool,
    /// An undo began (the source answered, and the target's copy may already be
    /// gone): the move can only be finished by `--abort`, never resumed.
    pub undoing: bool,
    /// The comparison of the whole shard made before the fence, with the move's change
    /// log running (see `docs/moves.md`); the fence then rechecks only the logged keys.
    /// `None`: the verification inside the fence reads every row.
    pub precheck: Option<Precheck>,
    /// Rows (distinct keys) the verification inside the fence read through the change
    /// logs, plus the rows of tables it had to read in full.
    pub rechecked_rows: Option<i64>,
    /// Where the write pause went, fence to flip, in order: each sub-step's name and
    /// its duration in µs (measured by this mover; empty for a pause a resumed mover
    /// only finished).
    pub pause_steps: Vec<(String, u64)>,
    /// What keeps this move revertible after its flip (`shardline move --revert`):
    /// `None` when it is not (a move journaled by an older shardline, or a target that
    /// cannot keep a replication slot; see [`Detail::revert_unavailable`]).
    pub revert: Option<Revertible>,
    /// Why this move cannot be reverted after its flip, when it cannot.
    pub revert_unavailable: Option<String>,
    /// This move reverts an earlier one: it carries the shard back to that move's source,
    /// onto its old copy, from the new owner's reverse replication.
    pub reverts: Option<Reverting>,
}

/// The mover's own copy of a shard's rows (see [`Detail::rows_copied`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct RowsCopied {
    /// Bytes read from the source (`COPY ... (FORMAT binary)`).
    pub bytes: i64,
    /// How long the copy took, from the snapshot to the last row written, in ms.
    pub ms: u64,
    /// The rate it was held to, bytes a second (0: none).
    pub max_rate: u64,
    /// How many streams copied at once.
    pub streams: usize,
    /// The source's WAL position where the copy's snapshot ends: the subscription
    /// starts there.
    pub lsn: Option<String>,
}

/// How a move stays revertible after its flip: on its target (the new owner), a
/// publication of the shard's schema and a logical replication slot, both made before the
/// fence. The slot keeps every change from the flip on, so a revert brings the old copy on
/// the source up to date from there instead of copying the shard again. `gc` drops both
/// with the old copy, after the grace period.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct Revertible {
    /// The journal ID reserved for the revert: its marker row is the one the
    /// publication carries (`shardline.move_marks WHERE move_id = id`).
    pub id: i64,
    /// The name of the publication and slot on the target (`shardline_move_<id>_<token>`,
    /// the revert's own name).
    pub name: String,
    /// Whether the publication and slot were made.
    pub made: bool,
    /// The target's WAL insert position read inside the fence, once the target had
    /// everything the source committed and before any write of the new owner: the
    /// revert's replication starts there (the slot is advanced to it).
    pub lsn: Option<String>,
}

/// What a revert needs to know of the move it reverts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct Reverting {
    /// The move reverted.
    pub of: i64,
    /// Its old copy's schema on this revert's target (its source).
    pub old_schema: String,
    /// Where the new owner's changes begin (see [`Revertible::lsn`]).
    pub lsn: String,
    /// The old copy's sequence's MAXVALUE before that move's fence capped it.
    pub sequence_max: Option<i64>,
}

/// The comparison before the fence: what it saw, and the change log it relied on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct Precheck {
    /// Per keyed table: rows on the source and on the target in the compared snapshots.
    pub tables: BTreeMap<String, (i64, i64)>,
    /// Per keyed table: the OIDs of the change log's triggers on the source, as they
    /// were when the snapshots were taken. The fence trusts a table's log only while
    /// the same triggers are there, enabled always.
    pub source_triggers: BTreeMap<String, Vec<u32>>,
    /// The same on the target.
    pub target_triggers: BTreeMap<String, Vec<u32>>,
    /// Keys that differed between the snapshots and were in a change log (rows in
    /// flight); the fence rechecks them with every other logged key.
    pub in_flight: i64,
    /// How long the comparison took, in ms (its rounds included).
    pub ms: u64,
    /// The rounds after the comparison, outside the fence, in order (see
    /// `docs/moves.md`, "Rounds before the fence").
    pub rounds: Vec<Round>,
    /// The last round that completed: every key it and the rounds before it took was
    /// verified equal, or logged anew (a row in flight); the fence rechecks only the keys
    /// logged that no round up to this one took (`0`: every logged key).
    pub verified_round: i32,
}

/// One round before the fence: the keys logged since the previous one, read on both
/// sides once the target had caught up to a marker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct Round {
    /// Distinct keys the round read on both sides.
    pub keys: i64,
    /// Of those, keys that differed: rows in flight, logged again since the round began
    /// or logged anew by the round, and read again by a later round or inside the fence.
    pub in_flight: i64,
    /// Distinct keys logged since the round began, counted at its end, plus those the
    /// round logged anew.
    pub pending: i64,
    /// How long it took, in ms.
    pub ms: u64,
}

/// One move, as the journal holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct MoveRecord {
    /// The move's ID.
    pub id: i64,
    /// The logical shard.
    pub shard: LogicalShard,
    /// Where it was.
    pub source: HostName,
    /// Where it goes.
    pub target: HostName,
    /// The last step done.
    pub step: Step,
    /// Running, done or rolled back.
    pub state: State,
    /// Names and numbers.
    pub detail: Detail,
    /// Why it stopped or was undone, if it did.
    pub error: Option<String>,
    /// When it began (UTC, ISO 8601).
    pub started_at: String,
    /// When the journal was last written (UTC, ISO 8601).
    pub updated_at: String,
}

impl std::fmt::Display for MoveRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "move {:>4}  shard {:>4}  {} -> {}  {:<11} {:<16}",
            self.id, self.shard, self.source, self.target, self.state, self.step
        )?;
        let d = &self.detail;
        if d.rows > 0 || d.bytes > 0 {
            write!(f, "  {} rows, {} bytes", d.rows, d.bytes)?;
        }
        if let Some(ms) = d.copy_ms {
            write!(f, ", copy {ms} ms")?;
        }
        if let Some(ms) = d.pause_ms {
            write!(f, ", pause {ms} ms")?;
        }
        write!(f, "  (started {})", self.started_at)?;
        if let Some(e) = &self.error {
            write!(f, "\n      {e}")?;
        }
        for p in &d.cleanup_pending {
            write!(f, "\n      left for gc: {p}")?;
        }
        Ok(())
    }
}

pub(crate) fn catalog_err(what: &'static str) -> impl Fn(tokio_postgres::Error) -> Error {
    move |e| Error::Repo(shardline_repo::Error::catalog(what, e))
}

const SELECT: &str = "SELECT id, shard, source, target, step, state, detail::text, error,
        to_char(started_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),
        to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')
   FROM shardline.moves";

impl Detail {
    /// Every name of the detail the mover puts into SQL (schemas, the publication's,
    /// subscription's and slots' names) is a plain identifier, or empty where not made
    /// yet: a journal row written by other hands is refused before any of it reaches a
    /// statement (each is quoted there as well).
    fn check_names(&self) -> std::result::Result<(), String> {
        let names = [
            ("schema", &self.schema),
            ("name", &self.name),
            ("moved_schema", &self.moved_schema),
            ("revert.name", self.revert.as_ref().map_or(&self.name, |r| &r.name)),
            ("reverts.old_schema", self.reverts.as_ref().map_or(&self.schema, |r| &r.old_schema)),
        ];
        for (field, name) in names {
            if name.is_empty() {
                continue;
            }
            if let Some(problem) = shardline_id::sql::plain_identifier_problem(name) {
                return Err(format!(
                    "its detail's {field} {name:?} is not a name shardline makes: it {problem}"
                ));
            }
        }
        Ok(())
    }
}

/// The one decoding of a row of `shardline.moves`: its integers and names become a
/// [`LogicalShard`] and [`HostName`]s here, or [`Error::Journal`] says which is bad.
fn record(row: &tokio_postgres::Row) -> Result<MoveRecord> {
    let id: i64 = row.get(0);
    let bad = |what: String| Error::Journal { id, message: what };
    let shard: i32 = row.get(1);
    let host = |i: usize| {
        let name: String = row.get(i);
        HostName::new(&name).map_err(|e| bad(e.to_string()))
    };
    let step: String = row.get(4);
    let state: String = row.get(5);
    let detail: String = row.get(6);
    let detail: Detail = serde_json::from_str(&detail).map_err(|e| bad(format!("unreadable detail: {e}")))?;
    detail.check_names().map_err(bad)?;
    Ok(MoveRecord {
        id,
        shard: LogicalShard::bounded(i64::from(shard)).map_err(|e| bad(e.to_string()))?,
        source: host(2)?,
        target: host(3)?,
        step: Step::parse(&step).ok_or_else(|| bad(format!("unknown step {step:?}")))?,
        state: State::parse(&state).ok_or_else(|| bad(format!("unknown state {state:?}")))?,
        detail,
        error: row.get(7),
        started_at: row.get(8),
        updated_at: row.get(9),
    })
}

/// Creates the journal ([`SCHEMA_SQL`]) when it is missing, and installs (replaces)
/// [`COMPLETE_FLIP_SQL`], as one implicit transaction (one simple query). `init` runs
/// it every time, after the catalog's own tables; a catalog whose journal exists keeps
/// it untouched.
pub(crate) async fn install(catalog: &Catalog) -> Result<()> {
    let c = client(catalog);
    let missing: bool = c
        .query_one("SELECT to_regclass('shardline.moves') IS NULL", &[])
        .await
        .map_err(catalog_err("look for the journal of moves"))?
        .get(0);
    let sql =
        if missing { format!("{SCHEMA_SQL}\n{COMPLETE_FLIP_SQL}") } else { COMPLETE_FLIP_SQL.to_owned() };
    c.batch_execute(&sql).await.map_err(catalog_err("create the journal of moves"))
}

/// Installs [`COMPLETE_FLIP_SQL`] where it is missing (a catalog made by an older
/// `init`).
pub(crate) async fn ensure_complete_flip(catalog: &Catalog) -> Result<()> {
    let c = client(catalog);
    let missing: bool = c
        .query_one("SELECT to_regprocedure('shardline.complete_flip(bigint,text)') IS NULL", &[])
        .await
        .map_err(catalog_err("look for shardline.complete_flip"))?
        .get(0);
    if missing {
        c.batch_execute(COMPLETE_FLIP_SQL).await.map_err(catalog_err("install shardline.complete_flip"))?;
    }
    Ok(())
}

/// Every move in the journal, oldest first.
pub(crate) async fn all(catalog: &Catalog) -> Result<Vec<MoveRecord>> {
    let rows = client(catalog)
        .query(&format!("{SELECT} ORDER BY id"), &[])
        .await
        .map_err(catalog_err("read the moves"))?;
    rows.iter().map(record).collect()
}

/// The running moves, of one shard or of all.
pub(crate) async fn running(catalog: &Catalog, shard: Option<LogicalShard>) -> Result<Vec<MoveRecord>> {
    let rows = client(catalog)
        .query(
            &format!("{SELECT} WHERE state = 'running' AND ($1::int IS NULL OR shard = $1) ORDER BY id"),
            &[&shard.map(|s| i32::from(s.get()))],
        )
        .await
        .map_err(catalog_err("read the moves"))?;
    rows.iter().map(record).collect()
}

/// Whether a move of `shard` is running.
pub(crate) async fn is_running(catalog: &Catalog, shard: LogicalShard) -> Result<bool> {
    let running: i64 = client(catalog)
        .query_one(
            "SELECT count(*) FROM shardline.moves WHERE shard = $1 AND state = 'running'",
            &[&i32::from(shard.get())],
        )
        .await
        .map_err(catalog_err("read the moves"))?
        .get(0);
    Ok(running > 0)
}

/// One move by ID.
pub(crate) async fn by_id(catalog: &Catalog, id: i64) -> Result<MoveRecord> {
    let row = client(catalog)
        .query_opt(&format!("{SELECT} WHERE id = $1"), &[&id])
        .await
        .map_err(catalog_err("read the move"))?
        .ok_or(Error::Journal { id, message: "not in the journal".into() })?;
    record(&row)
}

/// A new move's ID, taken before its row is written (so the row already names
/// everything the move will make).
pub(crate) async fn next_id(catalog: &Catalog) -> Result<i64> {
    Ok(client(catalog)
        .query_one("SELECT nextval(pg_get_serial_sequence('shardline.moves', 'id'))", &[])
        .await
        .map_err(catalog_err("number the move"))?
        .get(0))
}

/// Journals move `id` as started and running. [`Error::MoveRunning`] when the shard
/// has a running move already (the journal's unique index). `resolved` are the source's
/// and target's entries the move made from the catalog's records (the hosts the
/// operator's config does not list): when either record changed since (a `host
/// readdress` while the pre-flight ran), nothing is journaled and [`Error::Fleet`] names
/// the host. Both hosts' rows are share-locked until the journal's row commits: a
/// readdress (which locks the row, then counts the running moves naming it) either
/// commits before, and is seen here, or waits for this and refuses.
pub(crate) async fn start(
    catalog: &Catalog,
    id: i64,
    shard: LogicalShard,
    source: &HostName,
    target: &HostName,
    detail: &Detail,
    resolved: &[HostConfig],
) -> Result<()> {
    let c = client(catalog);
    let fail = catalog_err("journal the move");
    // A client gone between the statements (a cut link) would leave the session idle
    // in the transaction, holding both hosts' rows and the `gc` lock until TCP noticed:
    // the server ends it instead.
    c.batch_execute(&format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL idle_in_transaction_session_timeout = '{}ms'",
        IDLE_IN_TRANSACTION.as_millis()
    ))
    .await
    .map_err(&fail)?;
    let journaled = async {
        // The `gc` lock first, as the insert below takes it (shared to the commit).
        let rows = c
            .query(
                "WITH gc AS MATERIALIZED (SELECT pg_advisory_xact_lock_shared($2))
                 SELECT h.name::text, to_jsonb(h) ->> 'address', to_jsonb(h) ->> 'peer_address'
                   FROM gc, shardline.hosts h WHERE h.name = ANY($1) ORDER BY h.name FOR SHARE OF h",
                &[&[source.as_str(), target.as_str()].as_slice(), &GC_LOCK_KEY],
            )
            .await
            .map_err(&fail)?;
        for entry in resolved {
            let record = rows.iter().find(|r| r.get::<_, &str>(0) == entry.name.as_str()).map(|r| {
                let url = |i: usize| r.get::<_, Option<String>>(i).map(DbUrl::new);
                CatalogHost::new(entry.name.clone(), url(1), url(2), HostState::Active)
            });
            if !record.is_some_and(|h| credentials::resolves_to(entry, &h)) {
                return Err(Error::Fleet {
                    host: entry.name.clone(),
                    message: "was readdressed while this move's pre-flight ran: nothing was journaled; run the move again".into(),
                });
            }
        }
        insert(c, id, shard, source, target, detail).await
    }
    .await;
    match journaled {
        Ok(()) => c.batch_execute("COMMIT").await.map_err(&fail),
        Err(e) => {
            let _ = c.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}

/// How long the catalog's server lets [`start`]'s transaction sit idle before it ends
/// the session (its statements follow one another at once).
const IDLE_IN_TRANSACTION: std::time::Duration = std::time::Duration::from_secs(15);

/// [`start`]'s insert, inside its transaction.
async fn insert(
    c: &Client,
    id: i64,
    shard: LogicalShard,
    source: &HostName,
    target: &HostName,
    detail: &Detail,
) -> Result<()> {
    let detail = serde_json::to_string(detail).map_err(|e| Error::Journal { id, message: e.to_string() })?;
    // Only onto a host that is not removed, its row share-locked: a `host remove`
    // (which locks the row, then counts the running moves naming it) either waits for
    // this row and refuses, or commits first and this inserts nothing. And not while
    // `gc` runs (its lock, shared to the commit): `gc` would take a move missing from
    // the journal it read for one that is over, and drop its change log and markers.
    // And only while the map still places the shard on the source (its row
    // share-locked): another move of the shard that ran to its end while this one's
    // pre-flight ran left the source without the shard, and a move journaled from there
    // could neither go on nor be undone (its undo refuses a map that places the shard
    // elsewhere).
    let checked = c
        .query_one(
            // The lock in a CTE read FROM: in an EXISTS its target list is never run.
            "WITH gc AS MATERIALIZED (SELECT pg_advisory_xact_lock_shared($6)),
                  ok AS MATERIALIZED (
                    SELECT EXISTS (SELECT FROM shardline.hosts h
                                    WHERE h.name = $4 AND coalesce(to_jsonb(h) ->> 'state', 'active') <> 'removed'
                                      FOR SHARE) AS target,
                           EXISTS (SELECT FROM shardline.shards s WHERE s.shard = $2 AND s.host = $3
                                      FOR SHARE)
                           AND EXISTS (SELECT FROM shardline.hosts h WHERE h.name = $3 FOR SHARE) AS source
                      FROM gc),
                  written AS (
                    INSERT INTO shardline.moves (id, shard, source, target, step, state, detail) OVERRIDING SYSTEM VALUE
                    SELECT $1, $2, $3, $4, 'started', 'running', $5::text::jsonb FROM ok WHERE ok.target AND ok.source
                    RETURNING 1)
             SELECT ok.target, ok.source FROM ok",
            &[&id, &i32::from(shard.get()), &source.as_str(), &target.as_str(), &detail, &GC_LOCK_KEY],
        )
        .await
        .map_err(|e| {
            if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) {
                Error::MoveRunning { shard }
            } else {
                catalog_err("journal the move")(e)
            }
        })?;
    let (target_ok, source_ok): (bool, bool) = (checked.get(0), checked.get(1));
    if !target_ok {
        return Err(Error::Fleet {
            host: target.clone(),
            message: "was removed: no move may target it".into(),
        });
    }
    if !source_ok {
        return Err(Error::Fleet {
            host: source.clone(),
            message: format!(
                "no longer holds shard {shard} (another move took it while this one's pre-flight ran): \
                 nothing was changed; run the move again"
            ),
        });
    }
    Ok(())
}

/// Journals `step` done, with `detail`, for running move `id`; returns the rows written
/// (0 when the move is no longer running).
pub(crate) async fn step_done(catalog: &Catalog, id: i64, step: Step, detail: &str) -> Result<u64> {
    client(catalog)
        .execute(
            "UPDATE shardline.moves SET step = $2, detail = $3::text::jsonb, error = NULL, updated_at = now()
              WHERE id = $1 AND state = 'running'",
            &[&id, &step.as_str(), &detail],
        )
        .await
        .map_err(catalog_err("write the journal"))
}

/// Writes move `id`'s detail; with `running`, only while it runs. Returns the rows
/// written.
pub(crate) async fn write_detail(catalog: &Catalog, id: i64, detail: &str, running: bool) -> Result<u64> {
    let sql = if running {
        "UPDATE shardline.moves SET detail = $2::text::jsonb, updated_at = now() WHERE id = $1 AND state = 'running'"
    } else {
        "UPDATE shardline.moves SET detail = $2::text::jsonb, updated_at = now() WHERE id = $1"
    };
    client(catalog).execute(sql, &[&id, &detail]).await.map_err(catalog_err("write the journal"))
}

/// Writes why move `id` stopped. Best effort: the move's own error is what matters.
pub(crate) async fn record_error(catalog: &Catalog, id: i64, error: &str) {
    let _ = client(catalog)
        .execute("UPDATE shardline.moves SET error = $2, updated_at = now() WHERE id = $1", &[&id, &error])
        .await;
}

/// The flip: in one transaction on the catalog's connection, the map places `shard`
/// on `target` ([`Catalog::flip_shard`], only from `source`) and running move `id` is
/// journaled [`Step::Flipped`] with `detail`. Refused (nothing changes) when the map no
/// longer places the shard on the source, or the move no longer runs.
///
/// The transaction holds the map's row (and the journal's), which routers completing
/// the flip wait for: a session cut off inside it is ended by the catalog's server once
/// it has been idle in the transaction for `idle` (its work rolled back). `drill` runs
/// before the commit ([`super::MoveOptions::on_flip`]).
#[expect(clippy::too_many_arguments, reason = "the flip's parts, each named")]
pub(crate) async fn flip(
    catalog: &Catalog,
    id: i64,
    shard: LogicalShard,
    source: &HostName,
    target: &HostName,
    detail: &str,
    idle: std::time::Duration,
    drill: Option<&super::HookFn>,
) -> Result<()> {
    let c = client(catalog);
    let result = async {
        let idle_ms = idle.as_millis().clamp(1, i32::MAX as u128);
        c.batch_execute(&format!("BEGIN; SET LOCAL idle_in_transaction_session_timeout = '{idle_ms}ms'"))
            .await
            .map_err(catalog_err("begin the flip"))?;
        let n = catalog.flip_shard(shard, source, target).await?;
        let j = c
            .execute(
                "UPDATE shardline.moves SET step = 'flipped', detail = $2::text::jsonb, error = NULL, updated_at = now()
                  WHERE id = $1 AND state = 'running'",
                &[&id, &detail],
            )
            .await
            .map_err(catalog_err("write the journal"))?;
        if n != 1 || j != 1 {
            return Err(Error::Journal {
                id,
                message: "the map no longer places the shard on the source, or the move is no longer running".into(),
            });
        }
        if let Some(hook) = drill {
            hook().await;
        }
        c.batch_execute("COMMIT").await.map_err(catalog_err("commit the flip"))
    }
    .await;
    if result.is_err() {
        let _ = c.batch_execute("ROLLBACK").await;
    }
    result
}

/// Journals running move `id` done ([`Step::Cleaned`]), with `detail`.
pub(crate) async fn done(catalog: &Catalog, id: i64, detail: &str) -> Result<()> {
    client(catalog)
        .execute(
            "UPDATE shardline.moves SET step = 'cleaned', state = 'done', detail = $2::text::jsonb, updated_at = now()
              WHERE id = $1 AND state = 'running'",
            &[&id, &detail],
        )
        .await
        .map_err(catalog_err("write the journal"))?;
    Ok(())
}

/// Journals running move `id` rolled back, for `reason`, with `detail`.
pub(crate) async fn rolled_back(catalog: &Catalog, id: i64, reason: &str, detail: &str) -> Result<()> {
    client(catalog)
        .execute(
            "UPDATE shardline.moves SET state = 'rolled_back', error = $2, detail = $3::text::jsonb, updated_at = now()
              WHERE id = $1 AND state = 'running'",
            &[&id, &reason, &detail],
        )
        .await
        .map_err(catalog_err("write the journal"))?;
    Ok(())
}

/// The moves done at least `grace_s` seconds ago (their old schemas may go).
pub(crate) async fn done_before(catalog: &Catalog, grace_s: i64) -> Result<Vec<i64>> {
    Ok(client(catalog)
        .query(
            "SELECT id FROM shardline.moves WHERE state = 'done' AND updated_at <= now() - make_interval(secs => $1::bigint)",
            &[&grace_s],
        )
        .await
        .map_err(catalog_err("read the moves"))?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Journals what `gc` dropped for move `id`: the source's old schema, and/or the
/// target's copy a rollback left (then nothing is pending any more).
pub(crate) async fn record_dropped(
    catalog: &Catalog,
    id: i64,
    dropped_source: bool,
    dropped_target: bool,
) -> Result<()> {
    client(catalog)
        .execute(
            "UPDATE shardline.moves SET detail = detail || jsonb_build_object(
                 'source_dropped', (detail->>'source_dropped')::boolean IS TRUE OR $2,
                 'target_schema_left', (detail->>'target_schema_left')::boolean IS TRUE AND NOT $3,
                 'cleanup_pending', CASE WHEN $3 THEN '[]'::jsonb ELSE detail->'cleanup_pending' END)
              WHERE id = $1",
            &[&id, &dropped_source, &dropped_target],
        )
        .await
        .map_err(catalog_err("write the journal"))?;
    Ok(())
}

/// `shardline moves`: every move in the journal, oldest first.
///
/// # Errors
///
/// The catalog unreachable or not initialised; a journal row this version cannot read;
/// [`crate::Error::CatalogHung`].
pub async fn list(config: &Config) -> Result<Vec<MoveRecord>> {
    super::catalog_watched(config, async {
        let (catalog, _) = Catalog::open(config).await?;
        all(&catalog).await
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_round_trip_and_order() {
        for (i, s) in Step::ALL.iter().enumerate() {
            assert_eq!(Step::parse(s.as_str()), Some(*s));
            if i > 0 {
                assert!(Step::ALL[i - 1] < *s);
            }
        }
        assert_eq!(Step::parse("nonsense"), None);
        let paused: Vec<Step> = Step::ALL.into_iter().filter(|s| s.pauses_writes()).collect();
        assert_eq!(paused, [Step::Fenced, Step::Synced, Step::SequenceCarried, Step::Verified]);
    }

    #[test]
    fn detail_reads_older_and_partial_json() {
        let d: Detail =
            serde_json::from_str(r#"{"schema": "shard_0005", "unknown_key": 1}"#).unwrap_or_default();
        assert_eq!(d.schema, "shard_0005");
        assert_eq!(d.pause_ms, None);
    }
}
