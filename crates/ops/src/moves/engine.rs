//! The move itself: each [`Step`] done, then journaled; resumable from any journaled
//! step, undoable until the flip.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use shardline_id::Layout;
use shardline_id::sql::ShardSql;
use shardline_repo::Catalog;
use shardline_repo::catalog::{LOCK_KEY, connect};
use shardline_router::{Config, HostName, LogicalShard, SchemaName};
use tokio_postgres::Client;

use super::journal::{self, Detail, MoveRecord, State, Step, TableCheck, catalog_err};
use super::preflight::{self, host_err, quote_literal};
use super::subscription;
use crate::converge::{self, HOST_LEDGER_SQL, Inputs, ShardWork};
use crate::grants;
use crate::migrations::load_dir;
use crate::{Error, Result};

/// How often a wait for the source's changes checks that the source still answers.
const SOURCE_CHECK: Duration = Duration::from_secs(1);

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
COMMENT ON TABLE shardline.move_marks IS 'shardline: one row per move in progress, replicated from source to target to measure lag and to know when the target has everything; on the source, the fence''s lease and its one decision (flip or undo)';";

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
    /// If it does not, the move is undone and writes resume on the source.
    pub sync_timeout: Duration,
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
    /// Progress reports.
    pub progress: Option<ProgressFn>,
}

impl Default for MoveOptions {
    fn default() -> Self {
        MoveOptions {
            max_lag: Duration::from_millis(250),
            copy_timeout: Duration::from_secs(6 * 3600),
            lock_timeout: Duration::from_secs(2),
            fence_attempts: 5,
            sync_timeout: Duration::from_secs(30),
            stop_after: None,
            lease: Duration::from_secs(10),
            lose_fence_reply: false,
            progress: None,
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

    /// These options, with a fence lease of `lease` (see [`MoveOptions::lease`]).
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
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
            .field("stop_after", &self.stop_after)
            .field("lease", &self.lease)
            .field("lose_fence_reply", &self.lose_fence_reply)
            .field("progress", &self.progress.is_some())
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
    pub shard: u16,
    /// Its schema.
    pub schema: String,
    /// Where it was.
    pub source: String,
    /// Where it is now.
    pub target: String,
    /// Rows moved (counted at verification).
    pub rows: i64,
    /// Bytes of its tables and indexes on the source.
    pub bytes: i64,
    /// The initial copy's duration, ms.
    pub copy_ms: u64,
    /// How long the shard's writes were stopped, ms (fence to flip).
    pub pause_ms: u64,
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
            "moved shard {} ({}) {} -> {} (move {})\n  rows: {}\n  bytes: {}\n  copy: {} ms ({:.0} rows/s, {:.1} MB/s)\n  write pause: {} ms",
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
            self.pause_ms
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
    pub shard: u16,
    /// The source host.
    pub source: String,
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

/// The secondary indexes of a schema: those no constraint owns.
const SECONDARY_INDEXES: &str = "SELECT c.relname::text FROM pg_index i
   JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace
  WHERE n.nspname = $1 AND NOT EXISTS (SELECT FROM pg_constraint k WHERE k.conindid = i.indexrelid)";

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

async fn host_client(config: &Config, name: &HostName) -> Result<Client> {
    let h = config
        .hosts
        .iter()
        .find(|h| h.name == *name)
        .ok_or_else(|| Error::HostMissing { host: name.to_string(), shards: 0 })?;
    Ok(connect(&h.url, &format!("host {name}")).await?)
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
        let row = catalog
            .client()
            .query_one(
                "SELECT pg_try_advisory_lock_shared($1), pg_try_advisory_lock(hashtextextended('shardline move ' || $2::bigint, 0))",
                &[&LOCK_KEY, &id],
            )
            .await
            .map_err(catalog_err("take the move's lock"))?;
        let (cluster, this): (bool, bool) = (row.get(0), row.get(1));
        if cluster && this {
            return Ok(());
        }
        // Give back what was taken, so a retry takes each lock once.
        catalog
            .client()
            .execute(
                "SELECT CASE WHEN $1 THEN pg_advisory_unlock_shared($2) END,
                        CASE WHEN $3 THEN pg_advisory_unlock(hashtextextended('shardline move ' || $4::bigint, 0)) END",
                &[&cluster, &LOCK_KEY, &this, &id],
            )
            .await
            .map_err(catalog_err("take the move's lock"))?;
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
    renewer: Option<Renewer>,
}

/// Renews the fence's lease on the source: `UPDATE` of the marker row, only while
/// nothing is decided. `$2` is the lease in ms.
const RENEW_SQL: &str =
    "UPDATE shardline.move_marks SET lease_until = clock_timestamp() + $2::bigint * interval '1 millisecond'
  WHERE move_id = $1 AND fenced AND decided IS NULL";

/// The task that renews the fence's lease every quarter of it, on a connection of its
/// own (the mover's session may be inside a transaction). Dropped, it stops: a mover
/// that dies or gives up stops renewing, and the lease runs out.
struct Renewer {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Renewer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Renewer {
    fn start(config: &Config, source: &HostName, id: i64, lease: Duration) -> Result<Renewer> {
        let url = config
            .hosts
            .iter()
            .find(|h| h.name == *source)
            .map(|h| h.url.clone())
            .ok_or_else(|| Error::HostMissing { host: source.to_string(), shards: 0 })?;
        let source = source.clone();
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        let every = (lease / 4).max(Duration::from_millis(50));
        let task = tokio::spawn(async move {
            let mut client: Option<Client> = None;
            loop {
                tokio::time::sleep(every).await;
                if client.as_ref().is_none_or(Client::is_closed) {
                    client = connect(&url, &format!("host {source}")).await.ok();
                }
                let Some(c) = client.as_ref() else {
                    tracing::warn!(id, host = %source, "cannot reach the source to renew the fence's lease");
                    continue;
                };
                match c.execute(RENEW_SQL, &[&id, &lease_ms]).await {
                    Ok(0) => {
                        tracing::warn!(id, host = %source, "the fence's lease is decided or gone; no longer renewing it");
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(id, host = %source, error = %e, "cannot renew the fence's lease");
                        client = None;
                    }
                }
            }
        });
        Ok(Renewer { task })
    }
}

impl<'a> Mover<'a> {
    async fn load(
        config: &'a Config,
        options: &'a MoveOptions,
        catalog: Catalog,
        layout: Layout,
        record: MoveRecord,
    ) -> Result<Mover<'a>> {
        let shard = LogicalShard::new(i64::from(record.shard), config.logical_shards)?;
        let schema = config.schema_prefix.schema(shard);
        Ok(Mover {
            config,
            options,
            catalog,
            id: record.id,
            shard,
            moved: moved_name(&schema, record.id),
            schema,
            source: HostName::new(&record.source)?,
            target: HostName::new(&record.target)?,
            step: record.step,
            detail: record.detail,
            layout,
            src: None,
            dst: None,
            fence_started: None,
            renewer: None,
        })
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
            self.src = Some(host_client(self.config, &self.source).await?);
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
                host: source.to_string(),
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
            self.dst = Some(host_client(self.config, &self.target).await?);
        }
        self.dst.as_ref().ok_or(Error::Busy)
    }

    /// The detail as the journal keeps it.
    fn detail_json(&self) -> Result<String> {
        serde_json::to_string(&self.detail)
            .map_err(|e| Error::Journal { id: self.id, message: e.to_string() })
    }

    /// What the source's marker says of the fence: `None` when it is not fenced
    /// (or has no marker), `Some(decided)` when it is.
    async fn fence_decision(&mut self) -> Result<Option<Option<String>>> {
        let (source, id) = (self.source.clone(), self.id);
        let src = self.src().await?;
        let has: bool = src
            .query_one("SELECT to_regclass('shardline.move_marks') IS NOT NULL", &[])
            .await
            .map_err(on(&source, "look for the marker table"))?
            .get(0);
        if !has {
            return Ok(None);
        }
        Ok(src
            .query_opt("SELECT decided FROM shardline.move_marks WHERE move_id = $1 AND fenced", &[&id])
            .await
            .map_err(on(&source, "read the fence's lease"))?
            .map(|r| r.get(0)))
    }

    /// Holds the fence's lease while the shard is fenced and nothing is decided:
    /// renews it once now, then every quarter of it in the background. Fails with
    /// [`Error::LeaseExpired`] when the fence was undone meanwhile.
    async fn hold_lease(&mut self) -> Result<()> {
        if self.renewer.is_some() {
            return Ok(());
        }
        let (source, id) = (self.source.clone(), self.id);
        let lost = Error::LeaseExpired { id, shard: self.shard.get() };
        match self.fence_decision().await? {
            None => Ok(()),
            Some(Some(d)) if d == "flip" => Ok(()),
            Some(Some(_)) => Err(lost),
            Some(None) => {
                let lease_ms = i64::try_from(self.options.lease.as_millis()).unwrap_or(i64::MAX);
                let n = self
                    .src()
                    .await?
                    .execute(RENEW_SQL, &[&id, &lease_ms])
                    .await
                    .map_err(on(&source, "renew the fence's lease"))?;
                if n == 0 {
                    return Err(lost);
                }
                self.renewer = Some(Renewer::start(self.config, &source, id, self.options.lease)?);
                Ok(())
            }
        }
    }

    /// Decides, on the source, that the move flips: a compare-and-set of the marker's
    /// `decided`, only while the lease runs. From then on nobody can unfence the
    /// source, and flipping the catalog is always right. The proof of it (a random
    /// token) is kept with the decision; its SHA-256 is journaled first, so that
    /// `shardline.complete_flip` can check it. Already decided (a resumed move): done.
    async fn decide_flip(&mut self) -> Result<()> {
        let (source, id) = (self.source.clone(), self.id);
        let lost = Error::LeaseExpired { id, shard: self.shard.get() };
        match self.fence_decision().await? {
            Some(Some(d)) if d == "flip" => {
                self.renewer = None;
                return Ok(());
            }
            Some(Some(_)) => return Err(lost),
            Some(None) => {}
            None => {
                return Err(Error::Journal {
                    id,
                    message: format!(
                        "{source} has no fenced marker for this move, so it cannot decide to flip"
                    ),
                });
            }
        }
        let row = self
            .src()
            .await?
            .query_one(
                "SELECT t, encode(sha256(convert_to(t, 'UTF8')), 'hex')
                   FROM (SELECT gen_random_uuid()::text || gen_random_uuid()::text AS t) AS s",
                &[],
            )
            .await
            .map_err(on(&source, "make the flip's proof"))?;
        let (token, check): (String, String) = (row.get(0), row.get(1));
        self.detail.flip_check = Some(check);
        let detail = self.detail_json()?;
        let j = self
            .catalog
            .client()
            .execute(
                "UPDATE shardline.moves SET detail = $2::text::jsonb, updated_at = now() WHERE id = $1 AND state = 'running'",
                &[&id, &detail],
            )
            .await
            .map_err(catalog_err("write the journal"))?;
        if j != 1 {
            return Err(Error::Journal {
                id,
                message: "it is no longer running (aborted by another shardline?)".into(),
            });
        }
        let n = self
            .src()
            .await?
            .execute(
                "UPDATE shardline.move_marks SET decided = 'flip', flip_token = $2
                  WHERE move_id = $1 AND fenced AND decided IS NULL AND lease_until > clock_timestamp()",
                &[&id, &token],
            )
            .await
            .map_err(on(&source, "decide to flip"))?;
        if n != 1 {
            tracing::warn!(id, "the fence's lease ran out before the flip; the move is undone");
            return Err(lost);
        }
        self.renewer = None;
        Ok(())
    }

    /// Writes the step done (and the detail) to the journal.
    async fn journal(&mut self, step: Step) -> Result<()> {
        let detail = self.detail_json()?;
        let n = self
            .catalog
            .client()
            .execute(
                "UPDATE shardline.moves SET step = $2, detail = $3::text::jsonb, error = NULL, updated_at = now()
                  WHERE id = $1 AND state = 'running'",
                &[&self.id, &step.as_str(), &detail],
            )
            .await
            .map_err(catalog_err("write the journal"))?;
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

    /// Runs the steps after the journaled one, through the end.
    async fn drive(&mut self) -> Result<MoveReport> {
        // A resumed move whose shard is (or may be) fenced: hold the lease again, or
        // learn that it ran out and the fence was undone.
        if self.step.pauses_writes() || self.step == Step::CaughtUp {
            self.hold_lease().await?;
        }
        while self.step < Step::Cleaned {
            if self.options.stop_after == Some(self.step) {
                return Err(Error::Interrupted { id: self.id, step: self.step });
            }
            match self.step {
                Step::Started => self.prepare().await?,
                Step::Prepared => self.subscribe().await?,
                Step::Copying => self.catch_up().await?,
                Step::CaughtUp => self.fence().await?,
                Step::Fenced => self.sync().await?,
                Step::Synced => self.carry_sequence().await?,
                Step::SequenceCarried => self.verify().await?,
                Step::Verified => {
                    // Grants made on the source during the move, before the map moves.
                    self.carry_privileges(self.moved.clone()).await?;
                    self.flip().await?
                }
                Step::Flipped | Step::Cleaned => self.clean().await?,
            }
        }
        Ok(MoveReport {
            id: self.id,
            shard: self.shard.get(),
            schema: self.schema.to_string(),
            source: self.source.to_string(),
            target: self.target.to_string(),
            rows: self.detail.rows,
            bytes: self.detail.bytes,
            copy_ms: self.detail.copy_ms.unwrap_or(0),
            pause_ms: self.detail.pause_ms.unwrap_or(0),
            tables: self.detail.tables.clone(),
            cleanup_pending: self.detail.cleanup_pending.clone(),
        })
    }

    /// Builds the schema on the target; publishes it on the source.
    async fn prepare(&mut self) -> Result<()> {
        let migrations = load_dir(&self.config.migrations)?;
        let map = self.catalog.map().await?;
        let (schema, target, id, name) = (self.schema.clone(), self.target.clone(), self.id, self.name());
        let layout = self.layout;
        let shard = self.shard;
        let prefix = self.config.schema_prefix.clone();
        let config = self.config;
        let lock_timeout = self.options.lock_timeout;
        let dst = self.dst().await?;
        dst.batch_execute(&format!("{HOST_LEDGER_SQL}\n{MARKS_SQL}"))
            .await
            .map_err(on(&target, "create the ledger"))?;
        install_resolve(dst, &target).await?;
        let exists: bool = dst
            .query_one("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", &[&schema.as_str()])
            .await
            .map_err(on(&target, "look for the schema"))?
            .get(0);
        if !exists {
            // One transaction: the schema, its minter, every migration, the ledger.
            let work = ShardWork {
                shard,
                schema: schema.clone(),
                create_schema: true,
                minter: Some(ShardSql::new(layout, schema.as_str(), u32::from(shard.get()))?.install()),
                migrations: (0..migrations.len()).collect(),
                grants: Some(grants::shard_grants(&schema, &config.app_roles)).filter(|g| !g.is_empty()),
            };
            let shard_timeout = crate::Options::default().shard_timeout;
            let inputs = Inputs {
                map: &map,
                prefix: &prefix,
                layout,
                migrations: &migrations,
                roles: &config.app_roles,
                lock_timeout,
                shard_timeout,
            };
            converge::apply_shard(dst, &target, &work, &inputs).await?;
            // The copy is faster into bare tables: secondary indexes (those no constraint
            // owns) are built once the copy is done (see `catch_up`).
            let drops: Vec<String> = dst
                .query(SECONDARY_INDEXES, &[&schema.as_str()])
                .await
                .map_err(on(&target, "list the indexes"))?
                .iter()
                .map(|r| format!("DROP INDEX {}.{};", schema.quoted(), quote_ident(r.get(0))))
                .collect();
            if !drops.is_empty() {
                dst.batch_execute(&drops.concat()).await.map_err(on(&target, "defer the indexes"))?;
            }
        }
        // The source's privileges, hand-made ones too, before anything is published
        // (and again right before the flip, for any granted meanwhile).
        self.carry_privileges(self.schema.as_str().to_owned()).await?;
        let source = self.source.clone();
        let src = self.src().await?;
        src.batch_execute(MARKS_SQL).await.map_err(on(&source, "create the marker table"))?;
        install_resolve(src, &source).await?;
        src.execute("INSERT INTO shardline.move_marks (move_id) VALUES ($1) ON CONFLICT DO NOTHING", &[&id])
            .await
            .map_err(on(&source, "write the move's marker"))?;
        let published: bool = src
            .query_one("SELECT EXISTS (SELECT FROM pg_publication WHERE pubname = $1)", &[&name])
            .await
            .map_err(on(&source, "look for the publication"))?
            .get(0);
        if !published {
            src.batch_execute(&format!(
                "CREATE PUBLICATION {name} FOR TABLES IN SCHEMA {}, TABLE shardline.move_marks WHERE (move_id = {id})",
                schema.quoted()
            ))
            .await
            .map_err(on(&source, "create the publication"))?;
        }
        self.journal(Step::Prepared).await
    }

    /// Makes the target's privileges on the shard's schema, tables, sequences, columns
    /// and routines those of the source, where the schema is called `source_schema`
    /// (its own name before the fence, the fence's after). Idempotent.
    async fn carry_privileges(&mut self, source_schema: String) -> Result<()> {
        let (source, target, schema) = (self.source.clone(), self.target.clone(), self.schema.clone());
        self.src().await?;
        self.dst().await?;
        let (Some(src), Some(dst)) = (self.src.as_ref(), self.dst.as_ref()) else {
            return Err(Error::Busy);
        };
        grants::carry(src, &source, &source_schema, dst, &target, &schema).await.map(drop)
    }

    /// Subscribes the target to the source, disabled; journals the subscription's OID
    /// (it names the table-sync slots) before enabling it in the next step.
    async fn subscribe(&mut self) -> Result<()> {
        let name = self.name();
        let target = self.target.clone();
        let peer = self
            .config
            .hosts
            .iter()
            .find(|h| h.name == self.source)
            .map(|h| h.peer_url.expose().to_owned())
            .ok_or_else(|| Error::HostMissing { host: self.source.to_string(), shards: 0 })?;
        // The slot first, made on the source by a session that holds no transaction
        // ID. Left to CREATE SUBSCRIPTION, it would be made while the target's DDL
        // transaction waits; two moves in opposite directions would then each wait for
        // the other's transaction to end (a slot waits for every running one).
        let source = self.source.clone();
        self.src()
            .await?
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')
                  WHERE NOT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1)",
                &[&name],
            )
            .await
            .map_err(on(&source, "create the replication slot"))?;
        let dst = self.dst().await?;
        let find = "SELECT oid::bigint FROM pg_subscription WHERE subname = $1";
        let mut oid =
            dst.query_opt(find, &[&name]).await.map_err(on(&target, "look for the subscription"))?;
        if oid.is_none() {
            let rest = format!(
                "PUBLICATION {name} WITH (enabled = false, create_slot = false, slot_name = '{name}')"
            );
            // The peer URL may hold a password: through the one helper that keeps
            // it out of the driver's logs and out of the error.
            if let Err((sqlstate, message)) =
                subscription::create_subscription(dst, &name, &peer, &rest).await
            {
                return Err(Error::Host {
                    host: target.to_string(),
                    what: "subscribe to the source".into(),
                    sqlstate,
                    message,
                });
            }
            oid = dst.query_opt(find, &[&name]).await.map_err(on(&target, "look for the subscription"))?;
        }
        let oid: i64 = oid.map(|r| r.get(0)).ok_or_else(|| Error::Journal {
            id: self.id,
            message: format!("the subscription {name} vanished on {target}"),
        })?;
        self.detail.subscription_oid = u32::try_from(oid).ok();
        self.journal(Step::Copying).await
    }

    /// Enables the subscription, waits for every table's copy, then for the lag to fall
    /// under `max_lag`.
    async fn catch_up(&mut self) -> Result<()> {
        let (name, target, source, id) = (self.name(), self.target.clone(), self.source.clone(), self.id);
        let oid = self.detail.subscription_oid.map(i64::from);
        let started = Instant::now();
        let deadline = started + self.options.copy_timeout;
        let schema = self.schema.clone();
        let total = self.detail.bytes;
        self.dst()
            .await?
            .batch_execute(&format!("ALTER SUBSCRIPTION {name} ENABLE"))
            .await
            .map_err(on(&target, "enable the subscription"))?;
        let mut checked = Instant::now();
        loop {
            if checked.elapsed() > SOURCE_CHECK {
                self.source_answers().await?;
                checked = Instant::now();
            }
            let dst = self.dst().await?;
            let row = dst
                .query_one(
                    "SELECT count(*) FILTER (WHERE r.srsubstate = 'r'), count(*),
                            (SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint
                               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                              WHERE n.nspname = $2 AND c.relkind = 'r')
                       FROM pg_subscription_rel r WHERE r.srsubid = $1::bigint::oid",
                    &[&oid, &schema.as_str()],
                )
                .await
                .map_err(on(&target, "read the copy's progress"))?;
            let (ready, tables, bytes): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
            self.report(MoveProgress::Copy { bytes, total, tables_done: ready, tables });
            if tables > 0 && ready == tables {
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    host: target.to_string(),
                    what: format!("the initial copy ({ready} of {tables} tables done)"),
                    after: self.options.copy_timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.build_indexes().await?;
        self.detail.copy_ms = Some(ms(started.elapsed()));
        loop {
            let round = Instant::now();
            let n: i64 = self
                .src()
                .await?
                .query_one("UPDATE shardline.move_marks SET n = n + 1 WHERE move_id = $1 RETURNING n", &[&id])
                .await
                .map_err(on(&source, "write the lag marker"))?
                .get(0);
            self.wait_mark(n, deadline, "catch up").await?;
            let lag = ms(round.elapsed());
            self.report(MoveProgress::Lag { ms: lag });
            if round.elapsed() <= self.options.max_lag {
                self.detail.lag_ms = Some(lag);
                break;
            }
        }
        self.journal(Step::CaughtUp).await
    }

    /// Builds on the target every secondary index the source's schema has and the
    /// target lacks (deferred during the copy), from the source's own definitions.
    async fn build_indexes(&mut self) -> Result<()> {
        let (source, target, schema) = (self.source.clone(), self.target.clone(), self.schema.clone());
        let wanted: Vec<(String, String)> = self
            .src()
            .await?
            .query(
                "SELECT c.relname::text, pg_get_indexdef(i.indexrelid) FROM pg_index i
                   JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 ORDER BY 1",
                &[&schema.as_str()],
            )
            .await
            .map_err(on(&source, "read the index definitions"))?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let dst = self.dst().await?;
        let have: Vec<String> = dst
            .query(
                "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND c.relkind = 'i'",
                &[&schema.as_str()],
            )
            .await
            .map_err(on(&target, "list the indexes"))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        for (name, def) in wanted.iter().filter(|(n, _)| !have.contains(n)) {
            tracing::debug!(index = %name, "building a deferred index");
            dst.batch_execute(def).await.map_err(on(&target, format!("build index {name}")))?;
        }
        Ok(())
    }

    /// Waits until the target's marker reaches `n`.
    async fn wait_mark(&mut self, n: i64, deadline: Instant, what: &str) -> Result<()> {
        let (target, id) = (self.target.clone(), self.id);
        let started = Instant::now();
        let mut pause = Duration::from_micros(500);
        let mut checked = Instant::now();
        loop {
            if checked.elapsed() > SOURCE_CHECK {
                self.source_answers().await?;
                checked = Instant::now();
            }
            let seen: Option<i64> = self
                .dst()
                .await?
                .query_opt("SELECT n FROM shardline.move_marks WHERE move_id = $1", &[&id])
                .await
                .map_err(on(&target, "read the marker"))?
                .map(|r| r.get(0));
            if seen.is_some_and(|s| s >= n) {
                return Ok(());
            }
            let now = Instant::now();
            if now > deadline {
                return Err(Error::Timeout {
                    host: target.to_string(),
                    what: format!("{what}: the source's change {n} to reach the target (it has {seen:?})"),
                    after: now - started,
                });
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(4));
        }
    }

    /// Stops writes on the source, in one transaction: lock the shard's tables
    /// (waiting for writes in flight), lock its ID sequence (waiting for every
    /// transaction that minted from it: `next_id()`, `reserve_ids()`) and cap it at its
    /// last value (a caller that looked the sequence up before the rename and waited
    /// behind the fence then fails with 2200H instead of minting), rename its schema
    /// (every later statement, also a prepared one from a router with an old map, fails
    /// with 42P01/3F000 and the router reloads the map), move the ledger rows along,
    /// bump the marker. A lock not had within `lock_timeout`, or a deadlock (a
    /// transaction that minted, then writes a table the fence holds), rolls it all back
    /// and tries again.
    async fn fence(&mut self) -> Result<()> {
        let (source, id) = (self.source.clone(), self.id);
        let (schema, moved) = (self.schema.clone(), self.moved.clone());
        let attempts = self.options.fence_attempts.max(1);
        let lock_ms = self.options.lock_timeout.as_millis();
        let lease_ms = i64::try_from(self.options.lease.as_millis()).unwrap_or(i64::MAX);
        self.fence_started = None;
        let (live, fenced) = self.source_schemas().await?;
        let src = self.src().await?;
        let mark = if !live && fenced {
            // Fenced before an interruption, and not journaled: read the fence's mark.
            let n = src
                .query_one("SELECT n FROM shardline.move_marks WHERE move_id = $1 AND fenced", &[&id])
                .await
                .map_err(on(&source, "read the fence marker"))?
                .get(0);
            self.hold_lease().await?;
            n
        } else if live {
            // A fence undone once (its lease ran out) is not tried again.
            if matches!(self.fence_decision().await?, Some(Some(_))) {
                return Err(Error::LeaseExpired { id, shard: self.shard.get() });
            }
            let src = self.src().await?;
            let tables: Vec<String> = src
                .query(
                    "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class c
                       JOIN pg_namespace n ON n.oid = c.relnamespace
                      WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') ORDER BY c.relname",
                    &[&schema.as_str()],
                )
                .await
                .map_err(on(&source, "list the shard's tables"))?
                .iter()
                .map(|r| r.get(0))
                .collect();
            let mut attempt = 1;
            loop {
                let started = Instant::now();
                self.detail.fenced_at_ms = Some(now_ms());
                let src = self.src().await?;
                match fence_once(src, &source, &tables, &schema, &moved, id, lock_ms, lease_ms).await {
                    Ok(fenced) => {
                        if self.options.lose_fence_reply {
                            tracing::warn!(
                                id,
                                "drill: the fence committed; stopping as if its reply was lost"
                            );
                            return Err(Error::Interrupted { id, step: self.step });
                        }
                        self.fence_started = Some(started);
                        self.detail.fence_sequence = Some(fenced.last_value);
                        self.detail.sequence_max = Some(fenced.old_max);
                        self.hold_lease().await?;
                        break fenced.mark;
                    }
                    Err(e) if is_lock_conflict(&e) && attempt < attempts => {
                        tracing::warn!(id, attempt, error = %e, "fence: the shard's tables or ID sequence are busy; trying again");
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        } else {
            return Err(Error::Journal {
                id,
                message: format!(
                    "neither {schema} nor {moved} is on {source}; the shard's data is not where the journal says"
                ),
            });
        };
        self.detail.fence_mark = Some(mark);
        self.journal(Step::Fenced).await
    }

    /// Waits for the fence's marker on the target.
    async fn sync(&mut self) -> Result<()> {
        let mark = match self.detail.fence_mark {
            Some(m) => m,
            None => {
                let (source, id) = (self.source.clone(), self.id);
                self.src()
                    .await?
                    .query_one("SELECT n FROM shardline.move_marks WHERE move_id = $1 AND fenced", &[&id])
                    .await
                    .map_err(on(&source, "read the fence marker"))?
                    .get(0)
            }
        };
        let deadline = Instant::now() + self.options.sync_timeout;
        self.wait_mark(mark, deadline, "after the fence").await?;
        self.journal(Step::Synced).await
    }

    /// Sets the target's sequence to at least the source's last value, so the target's
    /// next ID is above every one the source handed out. The fence capped the source's
    /// sequence at that value once no transaction could mint, so it cannot have moved
    /// since: it is read again (the fence's reading is lost if the mover died before
    /// journaling it). A sequence found uncapped (fenced by an older shardline) is
    /// frozen here first, the same way.
    async fn carry_sequence(&mut self) -> Result<()> {
        let (source, target) = (self.source.clone(), self.target.clone());
        let moved_seq = format!("{}.shardline_id_seq", quote_ident(&self.moved));
        let seq = format!("{}.shardline_id_seq", self.schema.quoted());
        let lock_ms = self.options.lock_timeout.as_millis();
        let src = self.src().await?;
        let (mut last, max) = read_sequence(src, &source, &moved_seq).await?;
        if max > last {
            let fail = on(&source, "freeze the ID sequence");
            let frozen = async {
                src.batch_execute(&format!("BEGIN; SET LOCAL lock_timeout = '{lock_ms}ms'"))
                    .await
                    .map_err(&fail)?;
                freeze_sequence(src, &source, &moved_seq).await
            }
            .await;
            let frozen = match frozen {
                Ok(f) => src.batch_execute("COMMIT").await.map_err(&fail).map(|()| f),
                Err(e) => {
                    let _ = src.batch_execute("ROLLBACK").await;
                    Err(e)
                }
            }?;
            last = frozen.0;
            self.detail.sequence_max.get_or_insert(frozen.1);
        }
        if let Some(fenced) = self.detail.fence_sequence {
            if fenced != last {
                tracing::warn!(
                    id = self.id,
                    fenced,
                    now = last,
                    "the source's ID sequence moved after the fence"
                );
            }
            last = last.max(fenced);
        }
        self.dst()
            .await?
            .query_one(
                &format!(
                    "SELECT setval('{seq}'::regclass, greatest($1, (SELECT last_value FROM {seq})), true)"
                ),
                &[&last],
            )
            .await
            .map_err(on(&target, "carry the ID sequence"))?;
        self.detail.sequence = Some(last);
        self.journal(Step::SequenceCarried).await
    }

    /// Row counts and checksums (see [`checksum`]: every row counts, duplicates too),
    /// table by table, both sides at once. A mismatch lists the differing keys (for a
    /// table without a primary key, the differing rows and how often each side has
    /// them) and stops the move (the caller undoes it).
    async fn verify(&mut self) -> Result<()> {
        let (source, target, id) = (self.source.clone(), self.target.clone(), self.id);
        let (schema, moved) = (self.schema.as_str().to_owned(), self.moved.clone());
        self.src().await?;
        self.dst().await?;
        let (Some(src), Some(dst)) = (self.src.as_ref(), self.dst.as_ref()) else {
            return Err(Error::Busy);
        };
        let (src_tables, dst_tables) =
            futures::try_join!(tables(src, &source, &moved), tables(dst, &target, &schema))?;
        if src_tables.iter().map(|t| &t.0).ne(dst_tables.iter().map(|t| &t.0)) {
            return Err(Error::Verify {
                id,
                shard: self.shard.get(),
                differences: vec![format!(
                    "the tables differ: [{}] on {source}, [{}] on {target}",
                    src_tables.iter().map(|t| t.0.as_str()).collect::<Vec<_>>().join(", "),
                    dst_tables.iter().map(|t| t.0.as_str()).collect::<Vec<_>>().join(", ")
                )],
            });
        }
        let (src_idx, dst_idx) =
            futures::try_join!(indexes(src, &source, &moved), indexes(dst, &target, &schema))?;
        if src_idx != dst_idx {
            return Err(Error::Verify {
                id,
                shard: self.shard.get(),
                differences: vec![format!(
                    "the indexes differ: [{}] on {source}, [{}] on {target}",
                    src_idx.join(", "),
                    dst_idx.join(", ")
                )],
            });
        }
        let mut checks = Vec::new();
        let mut differences = Vec::new();
        let mut rows = 0;
        for (table, key) in &src_tables {
            let (a, b) = futures::try_join!(
                checksum(src, &source, &moved, table),
                checksum(dst, &target, &schema, table)
            )?;
            let matches = a == b;
            rows += b.0;
            checks.push(TableCheck { table: table.clone(), source_rows: a.0, target_rows: b.0, matches });
            if !matches {
                let (a, b) = futures::try_join!(
                    keys(src, &source, &moved, table, key),
                    keys(dst, &target, &schema, table, key)
                )?;
                let diff = differing_keys(&a, &b);
                let n = diff.len();
                let shown: Vec<String> = diff
                    .into_iter()
                    .take(20)
                    .map(|(k, on_a, on_b)| {
                        // Without a primary key the "key" is the whole row: say how
                        // often each side holds it.
                        if key == "*" { format!("{k} ({on_a} on {source}, {on_b} on {target})") } else { k }
                    })
                    .collect();
                differences.push(format!("{table}: {n} differing key(s) ({key}): {}", shown.join(", ")));
            }
        }
        self.detail.tables = checks;
        if !differences.is_empty() {
            self.detail.differences.clone_from(&differences);
            return Err(Error::Verify { id, shard: self.shard.get(), differences });
        }
        self.detail.rows = rows;
        self.journal(Step::Verified).await
    }

    /// Decides the flip on the source ([`Mover::decide_flip`]), then points the
    /// catalog's map at the target, in the same transaction as the journal. Once
    /// decided, a catalog that does not answer is tried again for up to
    /// `sync_timeout` (the shard stays fenced meanwhile; a router that finds it fenced
    /// completes the flip with `shardline.complete_flip` once the catalog is back, and
    /// so does `--resume`).
    async fn flip(&mut self) -> Result<()> {
        self.decide_flip().await?;
        let deadline = Instant::now() + self.options.sync_timeout;
        loop {
            match self.flip_catalog().await {
                Ok(()) => return Ok(()),
                Err(e @ Error::Repo(_)) if Instant::now() < deadline => {
                    tracing::warn!(id = self.id, error = %e, "the flip is decided but the catalog failed; trying again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    if self.catalog.client().is_closed()
                        && let Ok((catalog, _)) = Catalog::open(self.config).await
                        && lock_move(&catalog, self.id).await.is_ok()
                    {
                        self.catalog = catalog;
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn flip_catalog(&mut self) -> Result<()> {
        let pause = match self.fence_started {
            Some(t) => ms(t.elapsed()),
            None => self.detail.fenced_at_ms.map_or(0, |t| now_ms().saturating_sub(t)),
        };
        self.detail.pause_ms = Some(pause);
        let detail = self.detail_json()?;
        let c = self.catalog.client();
        let shard = i32::from(self.shard.get());
        let result = async {
            c.batch_execute("BEGIN").await.map_err(catalog_err("begin the flip"))?;
            let n = c
                .execute(
                    "UPDATE shardline.shards SET host = $2, updated_at = now() WHERE shard = $1 AND host IN ($2, $3)",
                    &[&shard, &self.target.as_str(), &self.source.as_str()],
                )
                .await
                .map_err(catalog_err("flip the map"))?;
            let j = c
                .execute(
                    "UPDATE shardline.moves SET step = 'flipped', detail = $2::text::jsonb, error = NULL, updated_at = now()
                      WHERE id = $1 AND state = 'running'",
                    &[&self.id, &detail],
                )
                .await
                .map_err(catalog_err("write the journal"))?;
            if n != 1 || j != 1 {
                return Err(Error::Journal {
                    id: self.id,
                    message: "the map no longer places the shard on the source, or the move is no longer running".into(),
                });
            }
            c.batch_execute("COMMIT").await.map_err(catalog_err("commit the flip"))
        }
        .await;
        if let Err(e) = result {
            let _ = c.batch_execute("ROLLBACK").await;
            return Err(e);
        }
        self.step = Step::Flipped;
        tracing::info!(id = self.id, shard = shard, pause_ms = pause, "move flipped");
        self.report(MoveProgress::Step { id: self.id, step: Step::Flipped });
        Ok(())
    }

    /// Drops the subscription (and with it the slot), the publication and the markers.
    /// A host that is down leaves its part to `shardline gc`, named in the journal.
    async fn clean(&mut self) -> Result<()> {
        let mut pending = Vec::new();
        if let Err(e) = self.clean_target(false).await {
            pending.push(format!("{}: subscription {} ({e})", self.target, self.name()));
        }
        if let Err(e) = self.clean_source().await {
            pending.push(format!("{}: publication and slots of {} ({e})", self.source, self.name()));
        }
        self.detail.cleanup_pending = pending;
        let detail = self.detail_json()?;
        self.catalog
            .client()
            .execute(
                "UPDATE shardline.moves SET step = 'cleaned', state = 'done', detail = $2::text::jsonb, updated_at = now()
                  WHERE id = $1 AND state = 'running'",
                &[&self.id, &detail],
            )
            .await
            .map_err(catalog_err("write the journal"))?;
        self.step = Step::Cleaned;
        self.report(MoveProgress::Step { id: self.id, step: Step::Cleaned });
        Ok(())
    }

    /// On the target: the subscription (detached from its slot if the source is down),
    /// the marker; with `drop_schema`, the schema and its ledger rows too.
    async fn clean_target(&mut self, drop_schema: bool) -> Result<()> {
        let (name, target, id, schema) = (self.name(), self.target.clone(), self.id, self.schema.clone());
        let dst = self.dst().await?;
        drop_subscription(dst, &target, &name).await?;
        dst.execute("DELETE FROM shardline.move_marks WHERE move_id = $1", &[&id])
            .await
            .or_else(|e| {
                if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) {
                    Ok(0)
                } else {
                    Err(e)
                }
            })
            .map_err(on(&target, "delete the marker"))?;
        if drop_schema {
            dst.batch_execute(&format!(
                "BEGIN; DROP SCHEMA IF EXISTS {} CASCADE; DELETE FROM shardline.shard_migrations WHERE schema_name = {}; COMMIT",
                schema.quoted(),
                quote_literal(schema.as_str())
            ))
            .await
            .map_err(on(&target, "drop the copy"))?;
        }
        Ok(())
    }

    /// On the source: the publication, the slots, the marker.
    async fn clean_source(&mut self) -> Result<()> {
        let (name, source, id) = (self.name(), self.source.clone(), self.id);
        let oid = self.detail.subscription_oid;
        let src = self.src().await?;
        drop_source_side(src, &source, &name, oid, id).await
    }
}

/// What one fence transaction did.
struct Fenced {
    /// The marker's value.
    mark: i64,
    /// The source sequence's last value, now its MAXVALUE.
    last_value: i64,
    /// Its MAXVALUE before.
    old_max: i64,
}

/// Inside the caller's transaction: waits for every transaction that minted from
/// sequence `seq` (a qualified, quoted name) to end, reads its last value and caps it
/// there, so no transaction mints from it until the cap is lifted. Returns the last
/// value and the MAXVALUE it had.
///
/// `nextval` holds the sequence's ROW EXCLUSIVE lock to the end of its transaction, and
/// `LOCK TABLE` refuses sequences; a no-op `ALTER SEQUENCE ... OWNED BY NONE` takes
/// SHARE ROW EXCLUSIVE, which conflicts with it (the same trick as the minter's
/// catch-up). Once it is granted `last_value` cannot move; the cap then makes every
/// later `nextval`/`setval` past it fail (2200H/22003), also one from a caller that
/// resolved the sequence before the schema was renamed.
async fn freeze_sequence(src: &Client, source: &HostName, seq: &str) -> Result<(i64, i64)> {
    let fail = on(source, "freeze the ID sequence");
    src.batch_execute(&format!("ALTER SEQUENCE {seq} OWNED BY NONE")).await.map_err(&fail)?;
    let (last, max) = read_sequence(src, source, seq).await?;
    if max > last {
        src.batch_execute(&format!("ALTER SEQUENCE {seq} MAXVALUE {last}")).await.map_err(&fail)?;
    }
    Ok((last, max))
}

/// Sequence `seq`'s (a qualified, quoted name) last value and MAXVALUE.
async fn read_sequence(c: &Client, host: &HostName, seq: &str) -> Result<(i64, i64)> {
    let row = c
        .query_one(
            &format!(
                "SELECT s.last_value, p.seqmax FROM {seq} AS s, pg_sequence AS p WHERE p.seqrelid = $1::text::regclass"
            ),
            &[&seq],
        )
        .await
        .map_err(on(host, "read the ID sequence"))?;
    Ok((row.get(0), row.get(1)))
}

#[allow(clippy::too_many_arguments)]
async fn fence_once(
    src: &Client,
    source: &HostName,
    tables: &[String],
    schema: &SchemaName,
    moved: &str,
    id: i64,
    lock_ms: u128,
    lease_ms: i64,
) -> Result<Fenced> {
    let fail = on(source, "fence the shard");
    let result = async {
        src.batch_execute(&format!("BEGIN; SET LOCAL lock_timeout = '{lock_ms}ms'")).await.map_err(&fail)?;
        // The tables first: a transaction that writes them takes their lock before it
        // mints (DEFAULT next_id()), so this order only meets one that minted in an
        // earlier statement and writes now: a deadlock Postgres breaks by ending one of
        // the two (the fence then tries again).
        if !tables.is_empty() {
            src.batch_execute(&format!("LOCK TABLE {} IN EXCLUSIVE MODE", tables.join(", ")))
                .await
                .map_err(&fail)?;
        }
        let seq = format!("{}.shardline_id_seq", schema.quoted());
        let (last_value, old_max) = freeze_sequence(src, source, &seq).await?;
        src.batch_execute(&format!(
            "ALTER SCHEMA {} RENAME TO {};
             UPDATE shardline.shard_migrations SET schema_name = {} WHERE schema_name = {}",
            schema.quoted(),
            quote_ident(moved),
            quote_literal(moved),
            quote_literal(schema.as_str())
        ))
        .await
        .map_err(&fail)?;
        // The lease starts with the fence, with what undoing it needs.
        let n: i64 = src
            .query_opt(
                "UPDATE shardline.move_marks SET n = n + 1, fenced = true, decided = NULL,
                        lease_until = clock_timestamp() + $2::bigint * interval '1 millisecond',
                        schema_name = $3, moved_schema = $4, sequence_max = $5
                  WHERE move_id = $1 AND decided IS NULL RETURNING n",
                &[&id, &lease_ms, &schema.as_str(), &moved, &old_max],
            )
            .await
            .map_err(&fail)?
            .ok_or_else(|| Error::Journal {
                id,
                message: format!("{source} has no undecided marker for this move, so it cannot be fenced"),
            })?
            .get(0);
        src.batch_execute("COMMIT").await.map_err(&fail)?;
        Ok(Fenced { mark: n, last_value, old_max })
    };
    match result.await {
        Ok(f) => Ok(f),
        Err(e) => {
            let _ = src.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}

/// The shard's tables in `schema`, with their primary key (or all columns) as an SQL
/// row expression.
async fn tables(c: &Client, host: &HostName, schema: &str) -> Result<Vec<(String, String)>> {
    let rows = c
        .query(
            "SELECT c.relname::text,
                    coalesce((SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY k.ord)
                                FROM pg_index i
                                CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
                                JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                               WHERE i.indrelid = c.oid AND i.indisprimary), '*')
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') ORDER BY 1",
            &[&schema],
        )
        .await
        .map_err(on(host, "list the tables"))?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

async fn indexes(c: &Client, host: &HostName, schema: &str) -> Result<Vec<String>> {
    let rows = c
        .query(
            "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND c.relkind = 'i' ORDER BY 1",
            &[&schema],
        )
        .await
        .map_err(on(host, "list the indexes"))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// A table's row count and the exact sum (numeric: no overflow, no wrap) of its rows'
/// 64-bit hashes. Both are multiset functions: every row counts, a duplicate twice.
/// (An XOR of the hashes, used before, cancels any row present twice, so a side with
/// two copies of one row and a side with two copies of another compared equal.) Two
/// different contents agree only when the hashes of the rows in which they differ sum
/// alike, a 2^-64 chance for rows not built to collide.
async fn checksum(c: &Client, host: &HostName, schema: &str, table: &str) -> Result<(i64, String)> {
    let row = c
        .query_one(
            &format!(
                "SELECT count(*), coalesce(sum(hash_record_extended(t, 0)), 0)::text FROM {}.{} AS t",
                quote_ident(schema),
                quote_ident(table)
            ),
            &[],
        )
        .await
        .map_err(on(host, format!("checksum {schema}.{table}")))?;
    Ok((row.get(0), row.get(1)))
}

/// How many rows of each (key, row hash) a table holds: one per key where `key` is a
/// primary key; for a table without one (`*`, the whole row), how often each row is
/// there, so a duplicate too many or too few shows.
async fn keys(
    c: &Client,
    host: &HostName,
    schema: &str,
    table: &str,
    key: &str,
) -> Result<HashMap<(String, i64), i64>> {
    let key = if key == "*" { "t.*".to_owned() } else { key.to_owned() };
    let rows = c
        .query(
            &format!(
                "SELECT (ROW({key}))::text, hash_record_extended(t, 0), count(*) FROM {}.{} AS t GROUP BY 1, 2",
                quote_ident(schema),
                quote_ident(table)
            ),
            &[],
        )
        .await
        .map_err(on(host, format!("list the keys of {schema}.{table}")))?;
    Ok(rows.iter().map(|r| ((r.get(0), r.get(1)), r.get(2))).collect())
}

/// The keys whose rows differ between `a` (the source's, see [`keys`]) and `b`, sorted,
/// with how many rows each side holds under them.
fn differing_keys(
    a: &HashMap<(String, i64), i64>,
    b: &HashMap<(String, i64), i64>,
) -> Vec<(String, i64, i64)> {
    let mut differ = std::collections::BTreeSet::new();
    for (this, other) in [(a, b), (b, a)] {
        differ.extend(this.iter().filter(|(k, n)| other.get(*k) != Some(n)).map(|((k, _), _)| k.clone()));
    }
    let rows = |m: &HashMap<(String, i64), i64>, key: &str| {
        m.iter().filter(|((k, _), _)| k == key).map(|(_, n)| n).sum::<i64>()
    };
    differ
        .into_iter()
        .map(|k| {
            let (on_a, on_b) = (rows(a, &k), rows(b, &k));
            (k, on_a, on_b)
        })
        .collect()
}

/// Drops subscription `name` on `host`. If the source cannot be reached to drop its
/// slot, the subscription is detached from the slot first (the slot is then the
/// source's cleanup).
pub(crate) async fn drop_subscription(c: &Client, host: &HostName, name: &str) -> Result<()> {
    let exists: bool = c
        .query_one("SELECT EXISTS (SELECT FROM pg_subscription WHERE subname = $1)", &[&name])
        .await
        .map_err(on(host, "look for the subscription"))?
        .get(0);
    if !exists {
        return Ok(());
    }
    if c.batch_execute(&format!("DROP SUBSCRIPTION {name}")).await.is_ok() {
        return Ok(());
    }
    c.batch_execute(&format!(
        "ALTER SUBSCRIPTION {name} DISABLE; ALTER SUBSCRIPTION {name} SET (slot_name = NONE); DROP SUBSCRIPTION {name}"
    ))
    .await
    .map_err(on(host, "drop the subscription"))
}

/// Drops, on the source, publication and slot `name`, the table-sync slots of
/// subscription `oid`, and move `id`'s marker. A slot still in use is released first
/// (its WAL sender ended).
pub(crate) async fn drop_source_side(
    c: &Client,
    host: &HostName,
    name: &str,
    oid: Option<u32>,
    id: i64,
) -> Result<()> {
    c.batch_execute(&format!("DROP PUBLICATION IF EXISTS {name}"))
        .await
        .map_err(on(host, "drop the publication"))?;
    let sync = oid.map(|o| format!("pg\\_{o}\\_sync\\_%"));
    for attempt in 0..20 {
        let left: i64 = c
            .query_one(
                "WITH s AS (SELECT slot_name, active_pid FROM pg_replication_slots
                             WHERE slot_name = $1 OR ($2::text IS NOT NULL AND slot_name LIKE $2)),
                      t AS (SELECT pg_terminate_backend(active_pid) FROM s WHERE active_pid IS NOT NULL),
                      d AS (SELECT pg_drop_replication_slot(slot_name) FROM s WHERE active_pid IS NULL)
                 SELECT (SELECT count(*) FROM t) + (SELECT count(*) FROM d) - (SELECT count(*) FROM s WHERE active_pid IS NULL)",
                &[&name, &sync],
            )
            .await
            .map_err(on(host, "drop the replication slots"))?
            .get(0);
        if left == 0 {
            break;
        }
        if attempt == 19 {
            return Err(Error::Host {
                host: host.to_string(),
                what: "drop the replication slots".into(),
                sqlstate: None,
                message: format!("{left} slot(s) of {name} stay in use"),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.execute("DELETE FROM shardline.move_marks WHERE move_id = $1", &[&id])
        .await
        .or_else(|e| {
            if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) { Ok(0) } else { Err(e) }
        })
        .map_err(on(host, "delete the marker"))?;
    Ok(())
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
/// [`Error::Verify`] with the differing keys; [`Error::Interrupted`] when
/// `options.stop_after` asked for it.
pub async fn run(config: &Config, shard: u16, target: &str, options: &MoveOptions) -> Result<MoveReport> {
    let check = preflight::preflight(config, shard, target).await?;
    if !check.is_ok() {
        return Err(Error::Preflight(Box::new(check)));
    }
    let (catalog, info) = Catalog::open(config).await?;
    // The ID first, so the journal's first row already names everything the move
    // will make (a mover killed right after it leaves nothing unnamed).
    let id: i64 = catalog
        .client()
        .query_one("SELECT nextval(pg_get_serial_sequence('shardline.moves', 'id'))", &[])
        .await
        .map_err(catalog_err("number the move"))?
        .get(0);
    let detail = Detail {
        schema: check.schema.to_string(),
        moved_schema: moved_name(&check.schema, id),
        name: replication_name(id),
        rows: check.rows_estimate,
        bytes: check.bytes,
        ..Detail::default()
    };
    catalog
        .client()
        .execute(
            "INSERT INTO shardline.moves (id, shard, source, target, step, state, detail) OVERRIDING SYSTEM VALUE
             VALUES ($1, $2, $3, $4, 'started', 'running', $5::text::jsonb)",
            &[
                &id,
                &i32::from(check.shard.get()),
                &check.source.as_str(),
                &check.target.as_str(),
                &serde_json::to_string(&detail).map_err(|e| Error::Journal { id, message: e.to_string() })?,
            ],
        )
        .await
        .map_err(|e| {
            if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) {
                Error::MoveRunning { shard }
            } else {
                catalog_err("journal the move")(e)
            }
        })?;
    lock_move(&catalog, id).await?;
    let missing: bool = catalog
        .client()
        .query_one("SELECT to_regprocedure('shardline.complete_flip(bigint,text)') IS NULL", &[])
        .await
        .map_err(catalog_err("look for shardline.complete_flip"))?
        .get(0);
    if missing {
        catalog
            .client()
            .batch_execute(COMPLETE_FLIP_SQL)
            .await
            .map_err(catalog_err("install shardline.complete_flip"))?;
    }
    let record = journal::by_id(catalog.client(), id).await?;
    let mover = Mover::load(config, options, catalog, info.layout, record).await?;
    mover.report(MoveProgress::Step { id, step: Step::Started });
    drive(mover).await
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
                tracing::warn!(id = mover.id, error = %e, "the move failed while the shard was fenced; undoing it");
                if let Err(undo) = undo(&mut mover, &e.to_string()).await {
                    if matches!(undo, Error::FlipDecided { .. }) {
                        tracing::error!(
                            id = mover.id,
                            "the source decided to flip: routers or `shardline move --resume` complete the flip"
                        );
                        record_error(
                            &mover,
                            &format!("{e}; the flip is decided: `shardline move --resume` finishes it"),
                        )
                        .await;
                        return Err(e);
                    }
                    tracing::error!(id = mover.id, error = %undo, "could not undo the move; run `shardline move --abort`");
                    record_error(&mover, &format!("{e}; undoing it failed too: {undo}")).await;
                    return Err(e);
                }
            } else {
                record_error(&mover, &e.to_string()).await;
            }
            Err(e)
        }
    }
}

async fn record_error(mover: &Mover<'_>, error: &str) {
    let _ = mover
        .catalog
        .client()
        .execute(
            "UPDATE shardline.moves SET error = $2, updated_at = now() WHERE id = $1",
            &[&mover.id, &error],
        )
        .await;
}

/// Undoes a move that has not flipped: the source decides `undo` and is unfenced (one
/// transaction, refused once the source decided to flip), then the target's copy and
/// subscription are dropped (or left to `gc`, named, if the target is down), and the
/// source's publication and slots. The source must be reachable; the catalog need not
/// be for the unfencing (the source's decision is what rules out a flip), but the rest
/// waits for it (`--abort` or `gc` finish it).
async fn undo(mover: &mut Mover<'_>, reason: &str) -> Result<AbortReport> {
    if mover.step >= Step::Flipped {
        return Err(Error::Flipped { id: mover.id, shard: mover.shard.get() });
    }
    // The map, when it can be read, must still place the shard on the source: only then
    // is the target's copy nobody's.
    match mover.catalog.map().await {
        Ok(map) if *map.host_of(mover.shard) != mover.source => {
            return Err(Error::Journal {
                id: mover.id,
                message: format!(
                    "the map places shard {} on {}, not on the source",
                    mover.shard,
                    map.host_of(mover.shard)
                ),
            });
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(id = mover.id, error = %e, "cannot read the map; unfencing on the source's decision alone");
        }
    }
    // The source first: while it cannot be reached nothing is touched, and the move
    // stays as it was (resumable, or abortable once the source is back).
    let (source, schema, moved) = (mover.source.clone(), mover.schema.clone(), mover.moved.clone());
    let (live, fenced) = mover.source_schemas().await?;
    if !live && !fenced {
        return Err(Error::Journal {
            id: mover.id,
            message: format!("neither {schema} nor {moved} is on {source}"),
        });
    }
    let unfenced = unfence(mover, live, fenced).await?;
    mover.renewer = None;
    // From here on the move can only be undone: say so before the target's copy goes.
    if !mover.detail.undoing {
        mover.detail.undoing = true;
        let detail = mover.detail_json()?;
        mover
            .catalog
            .client()
            .execute(
                "UPDATE shardline.moves SET detail = $2::text::jsonb, updated_at = now() WHERE id = $1",
                &[&mover.id, &detail],
            )
            .await
            .map_err(catalog_err("write the journal"))?;
    }
    let mut pending = Vec::new();
    let mut target_left = false;
    if let Err(e) = mover.clean_target(true).await {
        pending.push(format!(
            "{}: subscription {} and schema {} ({e})",
            mover.target,
            mover.name(),
            mover.schema
        ));
        target_left = true;
    }
    mover.clean_source().await?;
    mover.detail.cleanup_pending = pending.clone();
    mover.detail.target_schema_left = target_left;
    let detail = mover.detail_json()?;
    mover
        .catalog
        .client()
        .execute(
            "UPDATE shardline.moves SET state = 'rolled_back', error = $2, detail = $3::text::jsonb, updated_at = now()
              WHERE id = $1 AND state = 'running'",
            &[&mover.id, &reason, &detail],
        )
        .await
        .map_err(catalog_err("write the journal"))?;
    Ok(AbortReport {
        id: mover.id,
        shard: mover.shard.get(),
        source: source.to_string(),
        unfenced,
        cleanup_pending: pending,
    })
}

/// On the source, in one transaction: the marker's `decided` set to `undo` (refused
/// with [`Error::FlipDecided`] when it says `flip`), and, when the shard is fenced, its
/// schema renamed back, its ledger rows moved back and its sequence's cap lifted.
/// Returns whether it unfenced the shard.
async fn unfence(mover: &mut Mover<'_>, live: bool, fenced: bool) -> Result<bool> {
    let (source, schema, moved, id) =
        (mover.source.clone(), mover.schema.clone(), mover.moved.clone(), mover.id);
    let shard = mover.shard.get();
    let layout_max = mover.layout.max_sequence_value();
    let journaled_max = mover.detail.sequence_max;
    let src = mover.src().await?;
    let fail = on(&source, "unfence the shard");
    let has_marks: bool = src
        .query_one("SELECT to_regclass('shardline.move_marks') IS NOT NULL", &[])
        .await
        .map_err(&fail)?
        .get(0);
    let result = async {
        src.batch_execute("BEGIN").await.map_err(&fail)?;
        let mut marked_max = None;
        if has_marks
            && let Some(row) = src
                .query_opt(
                    "SELECT decided, sequence_max FROM shardline.move_marks WHERE move_id = $1 FOR UPDATE",
                    &[&id],
                )
                .await
                .map_err(&fail)?
        {
            let decided: Option<String> = row.get(0);
            if decided.as_deref() == Some("flip") {
                return Err(Error::FlipDecided { id, shard });
            }
            marked_max = row.get::<_, Option<i64>>(1);
            src.execute("UPDATE shardline.move_marks SET decided = 'undo' WHERE move_id = $1", &[&id])
                .await
                .map_err(&fail)?;
        }
        let unfenced = !live && fenced;
        if unfenced {
            // The fence capped the sequence at its last value: the cap is lifted with
            // the rename.
            let max = journaled_max.or(marked_max).unwrap_or(layout_max);
            src.batch_execute(&format!(
                "ALTER SCHEMA {} RENAME TO {};
                 ALTER SEQUENCE {}.shardline_id_seq MAXVALUE {max};
                 UPDATE shardline.shard_migrations SET schema_name = {} WHERE schema_name = {}",
                quote_ident(&moved),
                schema.quoted(),
                schema.quoted(),
                quote_literal(schema.as_str()),
                quote_literal(&moved)
            ))
            .await
            .map_err(&fail)?;
        }
        src.batch_execute("COMMIT").await.map_err(&fail)?;
        Ok(unfenced)
    }
    .await;
    if result.is_err() {
        let _ = src.batch_execute("ROLLBACK").await;
    }
    result
}

/// For `gc`: finishes undoing running move `record` when its source decided `undo`
/// (its fence's lease ran out, its mover gone). Returns whether it did; a move that
/// another process holds, or whose source does not answer, is left alone.
pub(crate) async fn finish_undone(config: &Config, record: &MoveRecord) -> Result<bool> {
    let (catalog, info) = Catalog::open(config).await?;
    if lock_move(&catalog, record.id).await.is_err() {
        return Ok(false);
    }
    let record = journal::by_id(catalog.client(), record.id).await?;
    if record.state != State::Running {
        return Ok(false);
    }
    let options = MoveOptions::default();
    let mut mover = Mover::load(config, &options, catalog, info.layout, record).await?;
    match mover.fence_decision().await {
        Ok(Some(Some(d))) if d == "undo" => {}
        _ => return Ok(false),
    }
    undo(&mut mover, "the fence's lease ran out with its mover gone; the undo was finished by gc").await?;
    Ok(true)
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
/// on it; a step's failure, as [`run`].
pub async fn resume(config: &Config, shard: Option<u16>, options: &MoveOptions) -> Result<Vec<MoveReport>> {
    let (catalog, info) = Catalog::open(config).await?;
    let records = journal::running(catalog.client(), shard).await?;
    if records.is_empty() {
        return Err(Error::NoMove { shard });
    }
    let mut out = Vec::new();
    for record in records {
        let (catalog, _) = Catalog::open(config).await?;
        lock_move(&catalog, record.id).await?;
        // Read again under the lock: another process may have moved it on.
        let record = journal::by_id(catalog.client(), record.id).await?;
        if record.state != State::Running {
            continue;
        }
        if record.detail.undoing {
            return Err(Error::Undoing { id: record.id, shard: record.shard });
        }
        let mover = Mover::load(config, options, catalog, info.layout, record).await?;
        out.push(drive(mover).await?);
    }
    Ok(out)
}

/// `shardline move --abort SHARD`: undoes the shard's running move. Refused once the
/// map has flipped (then `--resume` finishes it).
///
/// # Errors
///
/// [`Error::NoMove`]; [`Error::Flipped`]; [`Error::MoveBusy`]; the source unreachable
/// (the move stays journaled; abort again when it is back).
pub async fn abort(config: &Config, shard: u16) -> Result<AbortReport> {
    let (catalog, info) = Catalog::open(config).await?;
    let record = journal::running(catalog.client(), Some(shard))
        .await?
        .into_iter()
        .next()
        .ok_or(Error::NoMove { shard: Some(shard) })?;
    lock_move(&catalog, record.id).await?;
    let record = journal::by_id(catalog.client(), record.id).await?;
    if record.state != State::Running {
        return Err(Error::NoMove { shard: Some(shard) });
    }
    let options = MoveOptions::default();
    let mut mover = Mover::load(config, &options, catalog, info.layout, record).await?;
    undo(&mut mover, "aborted by the operator").await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(list: &[(&str, i64, i64)]) -> HashMap<(String, i64), i64> {
        list.iter().map(|&(k, h, n)| ((k.to_owned(), h), n)).collect()
    }

    #[test]
    fn differing_keys_count_duplicates_and_changed_rows() {
        // A row twice on one side and three times on the other; a row only on one
        // side; a key whose row changed; an equal row.
        let a = rows(&[("(x)", 1, 2), ("(y)", 2, 1), ("(k)", 3, 1), ("(same)", 9, 1)]);
        let b = rows(&[("(x)", 1, 3), ("(k)", 4, 1), ("(same)", 9, 1)]);
        assert_eq!(
            differing_keys(&a, &b),
            vec![("(k)".to_owned(), 1, 1), ("(x)".to_owned(), 2, 3), ("(y)".to_owned(), 1, 0)]
        );
        assert!(differing_keys(&a, &a).is_empty());
    }
}
