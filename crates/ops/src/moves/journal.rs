//! The journal of moves, `shardline.moves` in the catalog: one row per move, its step
//! written after each step is done, so an interrupted move is resumed or undone from
//! exactly where it stopped.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use shardline_repo::Catalog;
use shardline_router::Config;
use tokio_postgres::Client;

use crate::{Error, Result};

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
    /// Rows in the shard (pre-flight estimate until verified, then counted).
    pub rows: i64,
    /// Bytes of the shard's tables and indexes on the source.
    pub bytes: i64,
    /// How long the initial copy took, in ms.
    pub copy_ms: Option<u64>,
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
    /// How long the comparison took, in ms.
    pub ms: u64,
}

/// One move, as the journal holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct MoveRecord {
    /// The move's ID.
    pub id: i64,
    /// The logical shard.
    pub shard: u16,
    /// Where it was.
    pub source: String,
    /// Where it goes.
    pub target: String,
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
    move |e| {
        Error::Repo(shardline_repo::Error::Catalog {
            what,
            sqlstate: e.code().map(|c| c.code().to_owned()),
            source: e,
        })
    }
}

const SELECT: &str = "SELECT id, shard, source, target, step, state, detail::text, error,
        to_char(started_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),
        to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')
   FROM shardline.moves";

fn record(row: &tokio_postgres::Row) -> Result<MoveRecord> {
    let id: i64 = row.get(0);
    let bad = |what: String| Error::Journal { id, message: what };
    let shard: i32 = row.get(1);
    let step: String = row.get(4);
    let state: String = row.get(5);
    let detail: String = row.get(6);
    Ok(MoveRecord {
        id,
        shard: u16::try_from(shard).map_err(|_| bad(format!("shard {shard} is out of range")))?,
        source: row.get(2),
        target: row.get(3),
        step: Step::parse(&step).ok_or_else(|| bad(format!("unknown step {step:?}")))?,
        state: State::parse(&state).ok_or_else(|| bad(format!("unknown state {state:?}")))?,
        detail: serde_json::from_str(&detail).map_err(|e| bad(format!("unreadable detail: {e}")))?,
        error: row.get(7),
        started_at: row.get(8),
        updated_at: row.get(9),
    })
}

/// Every move in the journal, oldest first.
pub(crate) async fn all(client: &Client) -> Result<Vec<MoveRecord>> {
    let rows =
        client.query(&format!("{SELECT} ORDER BY id"), &[]).await.map_err(catalog_err("read the moves"))?;
    rows.iter().map(record).collect()
}

/// The running moves, of one shard or of all.
pub(crate) async fn running(client: &Client, shard: Option<u16>) -> Result<Vec<MoveRecord>> {
    let rows = client
        .query(
            &format!("{SELECT} WHERE state = 'running' AND ($1::int IS NULL OR shard = $1) ORDER BY id"),
            &[&shard.map(i32::from)],
        )
        .await
        .map_err(catalog_err("read the moves"))?;
    rows.iter().map(record).collect()
}

/// One move by ID.
pub(crate) async fn by_id(client: &Client, id: i64) -> Result<MoveRecord> {
    let row = client
        .query_opt(&format!("{SELECT} WHERE id = $1"), &[&id])
        .await
        .map_err(catalog_err("read the move"))?
        .ok_or(Error::Journal { id, message: "not in the journal".into() })?;
    record(&row)
}

/// `shardline moves`: every move in the journal, oldest first.
///
/// # Errors
///
/// The catalog unreachable or not initialised; a journal row this version cannot read.
pub async fn list(config: &Config) -> Result<Vec<MoveRecord>> {
    let (catalog, _) = Catalog::open(config).await?;
    all(catalog.client()).await
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
