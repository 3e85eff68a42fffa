//! `shardline gc`: what finished moves leave behind, dropped once it is safe.
//!
//! - The source's old schema (`<schema>_moved_<id>`) of a done move, once its grace
//!   period has passed (it is what an operator would copy back from by hand).
//! - Publications, subscriptions and replication slots named `shardline_move_<id>`
//!   (and the table-sync slots of their subscriptions) that no running move owns.
//! - The target's copy of a rolled-back move that could not be dropped then (the
//!   target was down), if the map does not place the shard there.
//! - Marker rows of moves no longer running.
//! - Change logs (triggers, their functions, the logged keys) of moves no longer
//!   running.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde::Serialize;
use shardline_repo::Catalog;
use shardline_router::{Config, HostName};
use tokio_postgres::Client;

use super::engine::{drop_revert_side, drop_shard_schema, drop_source_side, drop_subscription, sync_slots};
use super::journal::{self, MoveRecord, State};
use super::preflight::host_err;
use crate::Result;
use shardline_id::ident::quote as quote_ident;

/// What `gc` dropped, and what it could not reach.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct GcReport {
    /// Each thing dropped, as `host: what`.
    pub dropped: Vec<String>,
    /// Old schemas kept because their grace period has not passed.
    pub kept: Vec<String>,
    /// Hosts that could not be reached (their leftovers stay for the next run).
    pub unreachable: Vec<String>,
    /// What could not be done on a host that answered, and why, as `host: what`
    /// (tried again by the next run).
    pub left: Vec<String>,
    /// The moves whose source's old schema this run dropped, and those whose
    /// rolled-back copy on the target it dropped: what the journal records.
    #[serde(skip)]
    dropped_moves: std::collections::BTreeSet<(i64, Side)>,
}

/// Which of a move's copies `gc` dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Side {
    /// The source's old schema, after a done move's grace period.
    Source,
    /// The target's copy of a rolled-back move.
    Target,
}

impl std::fmt::Display for GcReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut lines: Vec<String> = self.dropped.iter().map(|d| format!("dropped {d}")).collect();
        lines.extend(self.kept.iter().map(|k| format!("kept {k} (grace period)")));
        lines.extend(
            self.unreachable.iter().map(|u| format!("unreachable {u}: its leftovers stay for the next run")),
        );
        lines.extend(self.left.iter().map(|l| format!("left {l}: tried again by the next run")));
        if self.dropped.is_empty() {
            lines.insert(0, if lines.is_empty() { "nothing to drop" } else { "nothing dropped" }.to_owned());
        }
        f.write_str(&lines.join("\n"))
    }
}

/// The longest grace period, 100 years: far beyond any use, and refused before the run
/// starts rather than met as a catalog error after it has done part of its work.
pub const MAX_GRACE: Duration = Duration::from_secs(100 * 365 * 86_400);

/// How long a host may go without answering `gc`'s probes before its part of the run is
/// given up (as for a move's steps: [`super::MoveOptions::hung_after`]'s default).
const GC_HUNG_AFTER: Duration = Duration::from_secs(15);

/// Drops what moves left behind (see the module docs); old source schemas only after
/// `grace` since their move finished.
///
/// One run at a time: it waits for another to end, and a move's start waits for it
/// (`shardline_repo::catalog::GC_LOCK_KEY`).
///
/// # Errors
///
/// [`crate::Error::InvalidOption`] for a grace period over [`MAX_GRACE`], before
/// anything; the catalog unreachable, or answering no probe for 15 s
/// ([`crate::Error::CatalogHung`]); a statement failing on a reachable host. An unreachable
/// host, or one that stops answering (hung, cut off) for 15 s, is reported,
/// not an error.
pub async fn gc(config: &Config, grace: Duration) -> Result<GcReport> {
    if grace > MAX_GRACE {
        return Err(crate::Error::InvalidOption {
            option: "grace",
            message: format!("{grace:?} is longer than the longest grace period, 100 years"),
        });
    }
    super::engine::unless_catalog_hung(config, GC_HUNG_AFTER, gc_within(config, grace)).await
}

/// [`gc`], its grace period checked, while the catalog answers.
async fn gc_within(config: &Config, grace: Duration) -> Result<GcReport> {
    let config = &crate::fleet::resolved_within(config, GC_HUNG_AFTER).await?;
    let (catalog, info) = Catalog::open(config).await?;
    // Held to the end of the run: every move not in the journal read below starts
    // after it, so a move missing from it has made nothing yet.
    catalog.lock_for_gc().await?;
    let mut report = GcReport::default();
    // Moves whose fence's lease ran out and was undone on the source (by a router),
    // their mover gone: finish undoing them, so the journal agrees.
    for m in journal::running(&catalog, None).await? {
        let hosts = [m.source.clone()];
        let finished = super::engine::unless_hung(
            config,
            &hosts,
            GC_HUNG_AFTER,
            super::engine::finish_undone(config, &m),
        )
        .await
        .and_then(|r| r);
        match finished {
            Ok(Some(said)) => report.dropped.push(format!("{}: fence of move {} ({said})", m.source, m.id)),
            Ok(None) => {}
            Err(e) => {
                let why = shardline_repo::error_chain(&e);
                tracing::warn!(id = m.id, error = %why, "cannot finish undoing a move its source decided to undo");
                if matches!(e, crate::Error::Timeout { .. }) {
                    report.unreachable.push(format!("{} ({why})", m.source));
                } else {
                    report.left.push(format!("{}: undoing move {} ({why})", m.source, m.id));
                }
            }
        }
    }
    // A revert may not start while this run drops what it needs (the old copy, the
    // reverse slot): each revertible move's revert lock, held to the end of the run; a
    // revert holding it already is left alone. The journal is read again under them.
    let revertible = |m: &MoveRecord, all: &[MoveRecord]| {
        m.state == State::Done
            && !m.detail.source_dropped
            && m.detail.revert.as_ref().is_some_and(|r| r.made && !all.iter().any(|o| o.id == r.id))
    };
    let first = journal::all(&catalog).await?;
    let mut locked = HashSet::new();
    for m in first.iter().filter(|m| revertible(m, &first)) {
        let Some(r) = &m.detail.revert else { continue };
        if catalog.try_lock_move(r.id).await? == (true, true) {
            locked.insert(m.id);
        }
    }
    let moves = journal::all(&catalog).await?;
    // Revertible moves whose revert's lock this run does not hold (a revert holds it, or
    // the move became revertible between the two reads): their old copy and reverse
    // side are left for the next run.
    let reverting: HashSet<i64> =
        moves.iter().filter(|m| revertible(m, &moves) && !locked.contains(&m.id)).map(|m| m.id).collect();
    let map = catalog.map().await?;
    let grace_s = i64::try_from(grace.as_secs()).unwrap_or(i64::MAX);
    let old = journal::done_before(&catalog, grace_s).await?;
    let by_id: HashMap<i64, &MoveRecord> = moves.iter().map(|m| (m.id, m)).collect();
    for host in &config.hosts {
        let session = async {
            let c = shardline_repo::catalog::connect(&host.url, &format!("host {}", host.name)).await?;
            super::engine::maintenance_session(&c, &host.name, "shardline gc").await?;
            Ok::<_, crate::Error>(c)
        };
        let c = match session.await {
            Ok(c) => c,
            Err(e) => {
                report.unreachable.push(format!("{} ({})", host.name, shardline_repo::error_chain(&e)));
                continue;
            }
        };
        // A host that stops answering (hung, or cut off) mid-way is left for the next run,
        // as an unreachable one is: its statements are not waited for.
        let name = std::slice::from_ref(&host.name);
        let work = gc_host(
            &c,
            &host.name,
            &moves,
            &by_id,
            &old,
            &reverting,
            &map,
            config,
            &info.layout,
            &mut report,
        );
        match super::engine::unless_hung(config, name, GC_HUNG_AFTER, work).await {
            Ok(done) => done?,
            Err(hung) => {
                report.unreachable.push(format!("{} ({})", host.name, shardline_repo::error_chain(&hung)))
            }
        }
    }
    // Journal what is gone, so `moves` shows it: by the move each drop was for (its
    // name is not enough: `shard_0000_moved_1` begins `shard_0000_moved_12`).
    for m in &moves {
        let dropped_source = report.dropped_moves.contains(&(m.id, Side::Source));
        let dropped_target = report.dropped_moves.contains(&(m.id, Side::Target));
        if dropped_source || dropped_target {
            journal::record_dropped(&catalog, m.id, dropped_source, dropped_target).await?;
        }
    }
    Ok(report)
}

#[expect(
    clippy::too_many_arguments,
    reason = "one host's gc needs the journal's view of it and the grace period"
)]
async fn gc_host(
    c: &Client,
    host: &HostName,
    moves: &[MoveRecord],
    by_id: &HashMap<i64, &MoveRecord>,
    old: &[i64],
    reverting: &HashSet<i64>,
    map: &shardline_router::ShardMap,
    config: &Config,
    layout: &shardline_id::Layout,
    report: &mut GcReport,
) -> Result<()> {
    let fail = |what: &'static str| move |e: tokio_postgres::Error| host_err(host, what, &e);
    let live = |id: i64| by_id.get(&id).is_some_and(|m| m.state == State::Running);
    // Names of this cluster's moves that are over; names the journal does not hold
    // belong to another cluster sharing the server, and are left alone.
    let over: HashMap<&str, &MoveRecord> = moves
        .iter()
        .filter(|m| m.state != State::Running && !m.detail.name.is_empty())
        .map(|m| (m.detail.name.as_str(), m))
        .collect();

    // Subscriptions first: dropping one drops its slot on the source.
    let subs: Vec<String> = c
        .query("SELECT subname::text FROM pg_subscription WHERE subname LIKE 'shardline\\_move\\_%'", &[])
        .await
        .map_err(fail("list subscriptions"))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    for s in subs {
        if over.contains_key(s.as_str()) {
            drop_subscription(c, host, &s).await?;
            report.dropped.push(format!("{host}: subscription {s}"));
        }
    }
    // Pre-flight probes (`shardline_probe_*`: disabled, with no slot, so dropping one
    // reaches nothing) whose pre-flight was killed or cut off between making and
    // dropping it. A probe lives for one round trip: one still in use is dropped under a
    // pre-flight that then finds it gone and goes on.
    let probes: Vec<String> = c
        .query(
            "SELECT subname::text FROM pg_subscription
              WHERE subname LIKE 'shardline\\_probe\\_%' AND subslotname IS NULL AND NOT subenabled
                AND subdbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[],
        )
        .await
        .map_err(fail("list pre-flight probes"))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    for p in probes {
        match c.batch_execute(&format!("DROP SUBSCRIPTION IF EXISTS {}", quote_ident(&p))).await {
            Ok(()) => report.dropped.push(format!("{host}: subscription {p} (a pre-flight's probe)")),
            // Not ours to drop (another owner, say): the rest of the host's gc goes on.
            Err(e) => {
                tracing::warn!(%host, probe = %p, error = %fail("drop a pre-flight probe")(e), "a probe was left")
            }
        }
    }
    // Publications, slots and markers of moves whose source is this host.
    let pubs: Vec<String> = c
        .query(
            "SELECT pubname::text FROM pg_publication WHERE pubname LIKE 'shardline\\_move\\_%'
             UNION SELECT slot_name::text FROM pg_replication_slots WHERE slot_name LIKE 'shardline\\_move\\_%'",
            &[],
        )
        .await
        .map_err(fail("list publications and slots"))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    for m in moves.iter().filter(|m| m.state != State::Running && m.source == *host) {
        let name = m.detail.name.clone();
        if name.is_empty() {
            continue;
        }
        let sync: i64 = match sync_slots(&m.detail, None) {
            Some(pattern) => c
                .query_one("SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE $1", &[&pattern])
                .await
                .map_err(fail("list slots"))?
                .get(0),
            None => 0,
        };
        if pubs.contains(&name) || sync > 0 {
            drop_source_side(c, host, &name, &m.detail, m.id).await?;
            report.dropped.push(format!("{host}: publication/slots {name}"));
        }
    }
    // Reverse publications and slots (kept for `move --revert`) of moves that can no
    // longer be reverted: undone, or past their grace period (their old copy goes
    // below). A revert, once journaled, owns them under its own name (above).
    for m in moves.iter().filter(|m| m.target == *host && m.state != State::Running) {
        let Some(rev) = m.detail.revert.as_ref().filter(|r| !r.name.is_empty()) else { continue };
        // A later move of the shard (not undone) leaves nothing for this one to revert.
        let later = moves.iter().any(|o| o.shard == m.shard && o.id > m.id && o.state != State::RolledBack);
        let over = m.state != State::Done || old.contains(&m.id) || m.detail.source_dropped || later;
        if by_id.contains_key(&rev.id) || reverting.contains(&m.id) || !over || !pubs.contains(&rev.name) {
            continue;
        }
        drop_revert_side(c, host, &rev.name).await?;
        report.dropped.push(format!("{host}: reverse publication/slot {} (move {})", rev.name, m.id));
    }
    // The guards of a move's copy where the map places the shard (the move flipped),
    // left when its mover died or the host did not answer right after the decision:
    // before the markers below go (the guard lets writes through by its marker). The
    // copy's ID sequence's cap, left with them when the decision never reached the copy,
    // is lifted first (only ever raised; nothing for a schema fenced away).
    let mut capped = HashSet::new();
    for m in moves.iter().filter(|m| m.target == *host) {
        let Ok(shard) = m.shard.within(map.count()) else { continue };
        if map.host_of(shard) == host && !m.detail.schema.is_empty() {
            let ceiling = super::engine::copy_ceiling(&m.detail, layout);
            let lift = super::engine::lift_cap_sql(&m.detail.schema, ceiling, 2000);
            if let Err(e) = c.batch_execute(&lift).await {
                // The guards stay with the cap (inserts fail either way); the next run
                // tries again, and the rest of this one goes on.
                let _ = c.batch_execute("ROLLBACK").await;
                let e = host_err(host, "lift a copy's ID sequence's cap", &e);
                tracing::warn!(id = m.id, host = %host, error = %shardline_repo::error_chain(&e), "cannot lift the cap on a flipped copy's ID sequence");
                report.left.push(format!(
                    "{host}: the cap on {}'s ID sequence (move {}): {e}",
                    m.detail.schema, m.id
                ));
                // Its marker too: the guards let writes through by it.
                capped.insert(m.id);
                continue;
            }
            super::engine::drop_guards(c, host, &m.detail.schema).await?;
        }
    }
    // Markers.
    let marks = c
        .query("SELECT move_id FROM shardline.move_marks", &[])
        .await
        .or_else(|e| {
            if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) {
                Ok(Vec::new())
            } else {
                Err(e)
            }
        })
        .map_err(fail("read the markers"))?;
    for r in marks {
        let id: i64 = r.get(0);
        if !live(id) && !capped.contains(&id) {
            c.execute("DELETE FROM shardline.move_marks WHERE move_id = $1", &[&id])
                .await
                .map_err(fail("delete a marker"))?;
        }
    }
    // Change logs (trigger functions with their triggers, rows) of moves no longer
    // running.
    let mut logged = super::engine::logged_moves(c, host).await?;
    logged.sort_unstable();
    logged.dedup();
    for id in logged.into_iter().filter(|&id| !live(id)) {
        super::engine::drop_changes(c, host, id, 500, 10).await?;
        report.dropped.push(format!("{host}: change log of move {id}"));
    }
    // Old source schemas of done moves, after their grace period.
    for m in moves.iter().filter(|m| m.state == State::Done && m.source == *host) {
        let moved = &m.detail.moved_schema;
        // Not while a revert brings it back into use.
        let in_use = reverting.contains(&m.id)
            || m.detail
                .revert
                .as_ref()
                .is_some_and(|r| by_id.get(&r.id).is_some_and(|x| x.state == State::Running));
        if moved.is_empty() || in_use {
            continue;
        }
        let exists: bool = c
            .query_one("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", &[moved])
            .await
            .map_err(fail("look for a schema"))?
            .get(0);
        if !exists {
            continue;
        }
        if !old.contains(&m.id) {
            report.kept.push(format!("{host}: schema {moved}"));
            continue;
        }
        // IF EXISTS: a run given up on a hung host may still drop it meanwhile.
        if let Err(e) = drop_shard_schema(c, moved).await {
            left_locked(host, &format!("schema {moved} (move {})", m.id), e, report)?;
            continue;
        }
        report.dropped.push(format!("{host}: schema {moved} (move {})", m.id));
        report.dropped_moves.insert((m.id, Side::Source));
    }
    // The target's copy of a rolled-back move, left because the target was down.
    for m in moves
        .iter()
        .filter(|m| m.state == State::RolledBack && m.target == *host && m.detail.target_schema_left)
    {
        let Ok(shard) = m.shard.within(map.count()) else { continue };
        let someone_else =
            moves.iter().any(|o| o.state == State::Running && o.shard == m.shard && o.target == m.target);
        if map.host_of(shard) == host || someone_else {
            continue;
        }
        let schema = config.schema_prefix.schema(shard);
        if let Err(e) = drop_shard_schema(c, schema.as_str()).await {
            left_locked(host, &format!("schema {schema} (copy of rolled-back move {})", m.id), e, report)?;
            continue;
        }
        report.dropped.push(format!("{host}: schema {schema} (copy of rolled-back move {})", m.id));
        report.dropped_moves.insert((m.id, Side::Target));
    }
    Ok(())
}

/// A drop of `what` on `host` that failed: one that waited out its lock timeout (someone
/// holds a lock on one of its tables) is left for the next run, in `report.left`, and
/// the run goes on; any other failure ends the host's part of the run.
fn left_locked(host: &HostName, what: &str, e: tokio_postgres::Error, report: &mut GcReport) -> Result<()> {
    let e = host_err(host, &format!("drop {what}"), &e);
    if e.sqlstate() != Some("55P03") {
        return Err(e);
    }
    tracing::warn!(host = %host, error = %shardline_repo::error_chain(&e), "a schema to drop is locked; left for the next gc");
    report.left.push(format!("{host}: {what}: {e}"));
    Ok(())
}
