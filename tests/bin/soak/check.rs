//! The soak's checker: the history of writes against what the hosts hold at the end.
//! Pure: the soak gathers [`Observed`] from the hosts; [`check`] says what is wrong.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::time::Duration;

/// Which table a write went to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Table {
    /// `photos`: minted in the owner's shard.
    Photos,
    /// `comments`: minted in the photo's shard.
    Comments,
}

impl Table {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Table::Photos => "photos",
            Table::Comments => "comments",
        }
    }
}

/// How a write ended, as the application saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Acknowledged, with the row's ID.
    Acked(i64),
    /// Applied, its row's ID not returned: a row of an `insert_many` whose host's part
    /// committed while another host's failed (`Error::InsertMany`'s `committed_rows`).
    Committed,
    /// Failed; `unknown` is the error's `outcome_unknown()`.
    Failed { unknown: bool, error: String },
}

/// One write of the history.
#[derive(Debug, Clone)]
pub(crate) struct Write {
    /// Which worker made it.
    pub(crate) worker: u32,
    pub(crate) table: Table,
    /// Unique in the run: the photo's caption or the comment's body.
    pub(crate) token: String,
    /// The row's content as [`Row::content`] spells it.
    pub(crate) content: String,
    /// Since the soak started: when the call was made and when it returned.
    pub(crate) start: Duration,
    pub(crate) end: Duration,
    pub(crate) outcome: Outcome,
    /// How it was made: `repo` (`Repo::insert`), `sqlx` (the example's sqlx path),
    /// `many` (`Repo::insert_many`), `tx` (a shard transaction of the repository),
    /// `sqlx-tx` (a shard transaction of the sqlx path, `Sqlx::transaction`).
    pub(crate) via: &'static str,
    /// The writes of one transaction share a group: all of them are applied, or none.
    pub(crate) group: Option<u64>,
}

/// An update or a delete of a photo by the worker that wrote it (no other worker touches
/// it), in the order that worker made them.
#[derive(Debug, Clone)]
pub(crate) struct Mutation {
    /// The photo's token: its caption, which no mutation changes.
    pub(crate) token: String,
    /// The content the photo holds once the mutation is applied ([`Row::content`]'s
    /// spelling); `None` for a delete.
    pub(crate) content: Option<String>,
    /// Since the soak started: when the call was made and when it returned.
    pub(crate) start: Duration,
    pub(crate) end: Duration,
    /// `Acked` with the photo's ID when the call returned (whether or not it found the
    /// row), `Failed` as for a write.
    pub(crate) outcome: Outcome,
}

/// What a photo may hold (`None`: absent) after its insert, `content`, and its
/// mutations so far, in order. An acknowledged mutation decides; one whose outcome is
/// unknown may or may not have been applied; one that failed was not. A mutation
/// applied late, after a later one was acknowledged, leaves a state not in the list.
pub(crate) fn possible(content: &str, mutations: &[&Mutation]) -> Vec<Option<String>> {
    mutations.iter().fold(vec![Some(content.to_owned())], |states, m| after(&states, m))
}

/// What a photo that may hold any of `states` may hold after `m`.
pub(crate) fn after(states: &[Option<String>], m: &Mutation) -> Vec<Option<String>> {
    let applied = |s: &Option<String>| match (&m.content, s) {
        // An update of an absent row changes nothing.
        (Some(_), None) => None,
        (new, _) => new.clone(),
    };
    let next: Vec<Option<String>> = match m.outcome {
        Outcome::Acked(_) | Outcome::Committed => states.iter().map(applied).collect(),
        Outcome::Failed { unknown: true, .. } => {
            states.iter().map(applied).chain(states.iter().cloned()).collect()
        }
        Outcome::Failed { unknown: false, .. } => states.to_vec(),
    };
    let mut out: Vec<Option<String>> = Vec::with_capacity(next.len());
    for s in next {
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// A row found on a host.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) host: String,
    pub(crate) schema: String,
    pub(crate) table: Table,
    pub(crate) id: i64,
    /// The shard the ID says minted it.
    pub(crate) id_shard: u32,
    /// The shard whose schema holds it.
    pub(crate) schema_shard: u32,
    /// The shard its routing key (the photo's owner, the comment's photo) routes to.
    pub(crate) key_shard: u32,
    pub(crate) token: String,
    /// `user|url|caption` for a photo, `user|photo_id|body` for a comment.
    pub(crate) content: String,
}

/// What the hosts hold once everything is healed, the moves finished and `gc` run.
#[derive(Debug, Default)]
pub(crate) struct Observed {
    /// Rows of the schemas the map places on their host (the live copies).
    pub(crate) live: Vec<Row>,
    /// Rows of any other shard schema (a copy the map does not name).
    pub(crate) stray: Vec<Row>,
    /// Rows of the old copies moves left for `gc` (`*_moved_*` schemas), read before
    /// `gc` drops them: each must be in its shard's live copy too (a row only there was
    /// written through a fence that leaked).
    pub(crate) old_copies: Vec<Row>,
    /// Shard schemas found on a host the map does not place them on: `host.schema`.
    pub(crate) stray_schemas: Vec<String>,
    /// Shards whose schema is missing from the host the map places them on.
    pub(crate) missing_schemas: Vec<String>,
    /// Replication slots, publications and subscriptions left on a host.
    pub(crate) replication_left: Vec<String>,
    /// Shards a write failed in at the end, with the error.
    pub(crate) unwritable: Vec<String>,
    /// Moves still running in the journal after recovery.
    pub(crate) moves_left: Vec<String>,
    /// Reads of acknowledged rows that answered wrong during the run.
    pub(crate) bad_reads: Vec<String>,
    /// Acknowledged photos the load's own handle could not read back after recovery.
    pub(crate) unreadable: Vec<String>,
}

/// Every violation of the soak's promises; empty when none.
pub(crate) fn check(history: &[Write], mutations: &[Mutation], seen: &Observed) -> Vec<String> {
    let mut out = Vec::new();
    let mut mutated: HashMap<&str, Vec<&Mutation>> = HashMap::new();
    for m in mutations {
        mutated.entry(m.token.as_str()).or_default().push(m);
    }
    let mut by_token: HashMap<&str, Vec<&Row>> = HashMap::new();
    for r in &seen.live {
        by_token.entry(r.token.as_str()).or_default().push(r);
        if r.schema_shard != r.key_shard {
            out.push(format!(
                "{} row {} ({}) is in shard {}'s schema but its key routes to shard {}",
                r.table.name(),
                r.id,
                r.token,
                r.schema_shard,
                r.key_shard
            ));
        }
        if r.id_shard != r.schema_shard {
            out.push(format!(
                "{} row {} ({}) carries shard {} in its ID but is in shard {}",
                r.table.name(),
                r.id,
                r.token,
                r.id_shard,
                r.schema_shard
            ));
        }
    }
    let mut written: HashMap<&str, &Write> = HashMap::new();
    for w in history {
        if written.insert(w.token.as_str(), w).is_some() {
            out.push(format!("the history has token {} twice (a bug of the soak)", w.token));
        }
        let rows = by_token.get(w.token.as_str()).map_or(&[][..], Vec::as_slice);
        let states = possible(&w.content, mutated.get(w.token.as_str()).map_or(&[][..], Vec::as_slice));
        match &w.outcome {
            Outcome::Acked(_) if rows.is_empty() && states.contains(&None) => {}
            Outcome::Acked(id) => match rows {
                [] => out.push(format!(
                    "lost: {} {} acknowledged with ID {id} is absent",
                    w.table.name(),
                    w.token
                )),
                [r] if r.id != *id => out.push(format!(
                    "{} {} was acknowledged with ID {id} but is stored with ID {}",
                    w.table.name(),
                    w.token,
                    r.id
                )),
                [r] if r.table != w.table => out.push(format!(
                    "{} {} (ID {id}) is stored in {}",
                    w.table.name(),
                    w.token,
                    r.table.name()
                )),
                [r] if !states.contains(&Some(r.content.clone())) => out.push(format!(
                    "{} {} (ID {id}) holds {:?}, written {:?}, then possibly {:?}",
                    w.table.name(),
                    w.token,
                    r.content,
                    w.content,
                    states
                )),
                [_] => {}
                many => out.push(format!(
                    "applied {} times: {} {} acknowledged with ID {id} (IDs {})",
                    many.len(),
                    w.table.name(),
                    w.token,
                    ids(many)
                )),
            },
            Outcome::Committed => match rows {
                [] => out.push(format!(
                    "lost: {} {} reported committed (its host's part of a batch) is absent",
                    w.table.name(),
                    w.token
                )),
                [r] if r.table != w.table || r.content != w.content => out.push(format!(
                    "{} {} (committed) is stored as {:?} in {}, written {:?}",
                    w.table.name(),
                    w.token,
                    r.content,
                    r.table.name(),
                    w.content
                )),
                [_] => {}
                many => out.push(format!(
                    "applied {} times: {} {} reported committed (IDs {})",
                    many.len(),
                    w.table.name(),
                    w.token,
                    ids(many)
                )),
            },
            Outcome::Failed { unknown: false, error } if !rows.is_empty() => out.push(format!(
                "a write reported as not applied is present: {} {} (IDs {}); it failed with {error}",
                w.table.name(),
                w.token,
                ids(rows)
            )),
            Outcome::Failed { unknown: true, .. } if rows.len() > 1 => out.push(format!(
                "applied {} times: {} {} (outcome unknown; IDs {})",
                rows.len(),
                w.table.name(),
                w.token,
                ids(rows)
            )),
            // Applied after all: as written, where it was written.
            Outcome::Failed { unknown: true, .. }
                if rows.iter().any(|r| r.table != w.table || r.content != w.content) =>
            {
                out.push(format!(
                    "{} {} (outcome unknown) is stored as {:?} in {}, written {:?}",
                    w.table.name(),
                    w.token,
                    rows[0].content,
                    rows[0].table.name(),
                    w.content
                ));
            }
            Outcome::Failed { .. } => {}
        }
    }
    // A transaction's writes are applied together or not at all (whatever its outcome
    // as its caller saw it).
    let mut groups: BTreeMap<u64, Vec<(&Write, bool)>> = BTreeMap::new();
    for w in history {
        if let Some(g) = w.group {
            groups.entry(g).or_default().push((w, by_token.contains_key(w.token.as_str())));
        }
    }
    for writes in groups.values() {
        if writes.iter().any(|(_, there)| *there) && writes.iter().any(|(_, there)| !*there) {
            let parts: Vec<String> = writes
                .iter()
                .map(|(w, there)| {
                    format!("{} {} {}", w.table.name(), w.token, if *there { "present" } else { "absent" })
                })
                .collect();
            let outcome = match &writes[0].0.outcome {
                Outcome::Acked(_) | Outcome::Committed => "acknowledged",
                Outcome::Failed { unknown: true, .. } => "outcome unknown",
                Outcome::Failed { unknown: false, .. } => "failed",
            };
            out.push(format!("half a transaction applied ({outcome}): {}", parts.join(", ")));
        }
    }
    for (token, rows) in &by_token {
        if !written.contains_key(token) {
            out.push(format!("rows no write made: {token} (IDs {})", ids(rows)));
        }
    }
    for token in mutated.keys() {
        if !matches!(written.get(token), Some(w) if matches!(w.outcome, Outcome::Acked(_))) {
            out.push(format!("mutations of a photo no acknowledged write made: {token} (a bug of the soak)"));
        }
    }
    // No ID anywhere twice: live copies, and strays beside them.
    let mut by_id: HashMap<i64, Vec<&Row>> = HashMap::new();
    for r in seen.live.iter().chain(&seen.stray) {
        by_id.entry(r.id).or_default().push(r);
    }
    let mut repeated: Vec<_> = by_id.into_iter().filter(|(_, rows)| rows.len() > 1).collect();
    repeated.sort_by_key(|(id, _)| *id);
    for (id, rows) in repeated {
        let mut at = String::new();
        for r in rows {
            let _ = write!(at, " {}.{}.{} ({})", r.host, r.schema, r.table.name(), r.token);
        }
        out.push(format!("ID {id} appears more than once:{at}"));
    }
    // An old copy holds only rows its shard had when it moved: every one is live too.
    // (A photo that may have been deleted since is not.)
    let live_ids: std::collections::HashSet<i64> = seen.live.iter().map(|r| r.id).collect();
    let deleted = |token: &str| {
        mutated.get(token).is_some_and(|ms| {
            ms.iter()
                .any(|m| m.content.is_none() && !matches!(m.outcome, Outcome::Failed { unknown: false, .. }))
        })
    };
    for r in seen.old_copies.iter().filter(|r| !live_ids.contains(&r.id) && !deleted(&r.token)) {
        out.push(format!(
            "{} row {} ({}) of the old copy {}.{} is not in its shard's live copy: written there after the fence",
            r.table.name(),
            r.id,
            r.token,
            r.host,
            r.schema
        ));
    }
    // IDs of the default layout, which the soak uses.
    out.extend(time_order(history, |id| shardline_id::Id::from_i64(id).ok().map(shardline_id::Id::shard)));
    for s in &seen.stray_schemas {
        out.push(format!(
            "the map and the data disagree: schema {s} is on a host the map does not place it on"
        ));
    }
    for s in &seen.missing_schemas {
        out.push(format!("the map and the data disagree: {s}"));
    }
    for s in &seen.replication_left {
        out.push(format!("left behind: {s}"));
    }
    for s in &seen.unwritable {
        out.push(format!("not writable at the end: {s}"));
    }
    for s in &seen.moves_left {
        out.push(format!("a move still running after recovery: {s}"));
    }
    out.extend(seen.bad_reads.iter().cloned());
    for s in &seen.unreadable {
        out.push(format!("not readable at the end: {s}"));
    }
    out
}

/// A row as a fan-out returned it, or a shared photo as the load wrote it.
#[derive(Debug, Clone)]
pub(crate) struct FanOutRow {
    pub(crate) id: i64,
    /// The creation time its ID carries, ms since the Unix epoch.
    pub(crate) ms: u128,
    /// The shard its ID names.
    pub(crate) shard: u16,
    /// As [`Row::content`] spells it.
    pub(crate) content: String,
}

/// One `Repo::created_between` of the load, and what it can be judged against.
#[derive(Debug)]
pub(crate) struct FanOutRead {
    /// Since the soak started: when it returned.
    pub(crate) at: Duration,
    /// The window, ms since the Unix epoch, as asked (both ends included).
    pub(crate) from_ms: u128,
    pub(crate) to_ms: u128,
    /// A page of `Repo::newest` resumed from a cursor: only IDs below it belong.
    pub(crate) below: Option<i64>,
    pub(crate) limit: usize,
    /// What it returned, in its order.
    pub(crate) rows: Vec<FanOutRow>,
    /// Whether it said the window holds more rows below its last (`FanOut::next`).
    pub(crate) full: bool,
    /// The shards it reported missing, and each missing host's error.
    pub(crate) missing: std::collections::HashSet<u16>,
    pub(crate) missing_errors: Vec<String>,
    /// Photos no worker updates or deletes, acknowledged before the read began.
    pub(crate) known: Vec<FanOutRow>,
    /// The reading worker's own photos (their content unused), with what each may hold
    /// (`None`: absent), its own deleted ones among them.
    pub(crate) own: Vec<(FanOutRow, Vec<Option<String>>)>,
}

/// What is wrong with a fan-out read: a shard left out without being reported missing
/// (a photo in the window, acknowledged before the read began, not returned; of a full
/// page, only those at or above its last row count), a row returned twice, out of
/// order, outside the window, past the limit, as other than written, or of a shard
/// reported missing; a shard reported missing for a row from another shard.
pub(crate) fn fan_out(r: &FanOutRead) -> Vec<String> {
    let at = r.at;
    let mut out = Vec::new();
    for e in &r.missing_errors {
        if e.contains("returned a row of shard") {
            out.push(format!("fan-out at {at:?}: a shard reported missing for a misrouted row: {e}"));
        }
    }
    if r.rows.len() > r.limit {
        out.push(format!("fan-out at {at:?}: {} rows for a limit of {}", r.rows.len(), r.limit));
    }
    let mut returned: HashMap<i64, &str> = HashMap::new();
    let mut last: Option<i64> = None;
    for row in &r.rows {
        if last.is_some_and(|l| row.id >= l) {
            out.push(format!(
                "fan-out at {at:?}: row {} after row {last:?}: not newest first, or twice",
                row.id
            ));
        }
        last = Some(row.id);
        if row.ms < r.from_ms || row.ms > r.to_ms || r.below.is_some_and(|b| row.id >= b) {
            out.push(format!(
                "fan-out at {at:?}: row {} of {} ms, outside the window {}..={} (below {:?})",
                row.id, row.ms, r.from_ms, r.to_ms, r.below
            ));
        }
        if r.missing.contains(&row.shard) {
            out.push(format!(
                "fan-out at {at:?}: row {} of shard {}, which it reported missing",
                row.id, row.shard
            ));
        }
        returned.insert(row.id, &row.content);
    }
    let floor = if r.full { last.unwrap_or(i64::MIN) } else { i64::MIN };
    for k in &r.known {
        // Both ends are in the window: the product reads the times given as the soak does
        // (whole ms, rounded down).
        if k.ms < r.from_ms
            || k.ms > r.to_ms
            || k.id < floor
            || r.below.is_some_and(|b| k.id >= b)
            || r.missing.contains(&k.shard)
        {
            continue;
        }
        match returned.get(&k.id) {
            None => out.push(format!(
                "fan-out at {at:?} ({}..={} ms, limit {}, {} rows, shards missing {:?}) left out photo {} of shard {} ({} ms)",
                r.from_ms,
                r.to_ms,
                r.limit,
                r.rows.len(),
                r.missing,
                k.id,
                k.shard,
                k.ms
            )),
            Some(c) if *c != k.content => out.push(format!(
                "fan-out at {at:?} returned photo {} as {c:?}, written {:?}",
                k.id, k.content
            )),
            Some(_) => {}
        }
    }
    for (k, states) in &r.own {
        if let Some(c) = returned.get(&k.id) {
            if !states.iter().any(|s| s.as_deref() == Some(*c)) {
                out.push(format!(
                    "fan-out at {at:?} returned its worker's own photo {} as {c:?}; it may hold {states:?}",
                    k.id
                ));
            }
        } else if !(k.ms < r.from_ms
            || k.ms > r.to_ms
            || k.id < floor
            || r.below.is_some_and(|b| k.id >= b)
            || r.missing.contains(&k.shard)
            || states.contains(&None))
        {
            out.push(format!(
                "fan-out at {at:?} ({}..={} ms, limit {}, {} rows, shards missing {:?}) left out its worker's own photo {} of shard {} ({} ms), which holds {states:?}",
                r.from_ms,
                r.to_ms,
                r.limit,
                r.rows.len(),
                r.missing,
                k.id,
                k.shard,
                k.ms
            ));
        }
    }
    out
}

/// A count across every shard of the rows created in a window (`Repo::count_between`).
#[derive(Debug, Clone)]
pub(crate) struct CountRead {
    /// Since the soak started: when the call was made and when it returned.
    pub(crate) start: Duration,
    pub(crate) end: Duration,
    /// The window, ms since the Unix epoch, as asked (both ends included).
    pub(crate) from_ms: u128,
    pub(crate) to_ms: u128,
    /// What it counted, and the shards it reported missing (left out of the count).
    pub(crate) count: u64,
    pub(crate) missing: std::collections::HashSet<u16>,
}

/// What is wrong with each count, judged once everything is healed against the whole
/// history of photo writes, their deletes and what the hosts hold at the end: it must
/// count at least the photos acknowledged before it began whose IDs fall in its window,
/// of the shards it did not report missing, unless a delete of one had begun before it
/// ended; and at most those whose write began before it ended and no acknowledged delete
/// had removed before it began, with each write of unknown outcome (or committed
/// without its ID returned) found applied at the end, by its token, with an ID in the
/// window (one not found was never applied: only acknowledged photos are deleted).
/// `place`: an ID's time (ms since the Unix epoch) and shard.
pub(crate) fn counts(
    reads: &[CountRead],
    history: &[Write],
    mutations: &[Mutation],
    observed: &Observed,
    place: impl Fn(i64) -> (u128, u16),
) -> Vec<String> {
    let applied: HashMap<&str, i64> =
        observed.live.iter().filter(|r| r.table == Table::Photos).map(|r| (r.token.as_str(), r.id)).collect();
    // Each photo write that is or may be somewhere, with its ID's time and shard, and
    // whether it was acknowledged.
    let photos: Vec<(&Write, (u128, u16), bool)> = history
        .iter()
        .filter(|w| w.table == Table::Photos)
        .filter_map(|w| match w.outcome {
            Outcome::Acked(id) => Some((w, place(id), true)),
            Outcome::Committed | Outcome::Failed { unknown: true, .. } => {
                applied.get(w.token.as_str()).map(|id| (w, place(*id), false))
            }
            Outcome::Failed { unknown: false, .. } => None,
        })
        .collect();
    let mut deletes: HashMap<&str, Vec<&Mutation>> = HashMap::new();
    for m in mutations.iter().filter(|m| m.content.is_none()) {
        deletes.entry(m.token.as_str()).or_default().push(m);
    }
    let mut out = Vec::new();
    for r in reads {
        let in_window = |ms: u128| (r.from_ms..=r.to_ms).contains(&ms);
        let (mut least, mut most) = (0_u64, 0_u64);
        for &(w, (ms, shard), acked) in &photos {
            if w.start >= r.end || !in_window(ms) {
                continue;
            }
            let dels = deletes.get(w.token.as_str()).map_or(&[][..], Vec::as_slice);
            let gone_before = dels.iter().any(|d| matches!(d.outcome, Outcome::Acked(_)) && d.end < r.start);
            if !gone_before {
                most += 1;
            }
            let deleting = dels.iter().any(|d| d.start < r.end);
            if acked && w.end < r.start && !deleting && !r.missing.contains(&shard) {
                least += 1;
            }
        }
        let at = r.end;
        if r.count < least {
            out.push(format!(
                "count at {at:?} ({}..={} ms, shards missing {:?}) counted {} rows, {least} photos known to be there",
                r.from_ms, r.to_ms, r.missing, r.count
            ));
        }
        if r.count > most {
            out.push(format!(
                "count at {at:?} ({}..={} ms) counted {} rows, more than the {most} that could be there",
                r.from_ms, r.to_ms, r.count
            ));
        }
    }
    out
}

fn ids(rows: &[&Row]) -> String {
    rows.iter().map(|r| r.id.to_string()).collect::<Vec<_>>().join(", ")
}

/// IDs minted on one shard never go back in time: a write that started after another
/// write to the same shard was acknowledged has the greater ID, across moves too.
fn time_order(history: &[Write], shard_of: impl Fn(i64) -> Option<u32>) -> Vec<String> {
    let mut per_shard: BTreeMap<u32, Vec<(&Write, i64)>> = BTreeMap::new();
    for w in history {
        if let Outcome::Acked(id) = w.outcome
            && let Some(s) = shard_of(id)
        {
            per_shard.entry(s).or_default().push((w, id));
        }
    }
    let mut out = Vec::new();
    for (shard, mut writes) in per_shard {
        let mut by_end: Vec<(Duration, i64, &str)> =
            writes.iter().map(|(w, id)| (w.end, *id, w.token.as_str())).collect();
        by_end.sort_unstable();
        writes.sort_by_key(|(w, _)| w.start);
        let (mut next, mut max): (usize, Option<(i64, &str, Duration)>) = (0, None);
        for (w, id) in writes {
            while next < by_end.len() && by_end[next].0 < w.start {
                let (end, done, token) = by_end[next];
                if max.is_none_or(|(m, _, _)| done > m) {
                    max = Some((done, token, end));
                }
                next += 1;
            }
            if let Some((m, token, end)) = max
                && id <= m
            {
                out.push(format!(
                    "shard {shard}: {} started at {:?} got ID {id}, not above ID {m} of {token} acknowledged at {end:?}",
                    w.token, w.start
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(token: &str, start: u64, end: u64, outcome: Outcome) -> Write {
        Write {
            worker: 0,
            table: Table::Photos,
            token: token.into(),
            content: format!("1|u|{token}"),
            start: Duration::from_millis(start),
            end: Duration::from_millis(end),
            outcome,
            via: "repo",
            group: None,
        }
    }

    fn id(ms: i64, shard: u32, seq: u32) -> i64 {
        shardline_id::Id::from_parts(1_800_000_000_000 + ms, shard, seq).unwrap().as_i64()
    }

    fn row(token: &str, id: i64) -> Row {
        let shard = shardline_id::Id::from_i64(id).unwrap().shard();
        Row {
            host: "pg1".into(),
            schema: format!("shard_{shard:04}"),
            table: Table::Photos,
            id,
            id_shard: shard,
            schema_shard: shard,
            key_shard: shard,
            token: token.into(),
            content: format!("1|u|{token}"),
        }
    }

    fn seen(live: Vec<Row>) -> Observed {
        Observed { live, ..Observed::default() }
    }

    fn fan_row(id: i64, ms: u128, shard: u16) -> FanOutRow {
        FanOutRow { id, ms, shard, content: format!("photo {id}") }
    }

    #[test]
    fn a_fan_out_is_judged_against_the_photos_acknowledged_before_it() {
        // Photos 10..=50 of shards 1 and 2, at 1010..=1050 ms; the window 1000..=1100.
        let known: Vec<FanOutRow> =
            (1_u16..=5).map(|i| fan_row(i64::from(i) * 10, 1000 + u128::from(i) * 10, i % 2 + 1)).collect();
        let newest_first = |rows: &[FanOutRow]| {
            let mut rows = rows.to_vec();
            rows.sort_by_key(|r| std::cmp::Reverse(r.id));
            rows
        };
        let read = |rows: Vec<FanOutRow>, full: bool, missing: &[u16]| FanOutRead {
            at: Duration::ZERO,
            from_ms: 1000,
            to_ms: 1100,
            limit: 3,
            rows,
            full,
            missing: missing.iter().copied().collect(),
            missing_errors: Vec::new(),
            below: None,
            known: known.clone(),
            own: Vec::new(),
        };
        // Whole; a full page with the newest 3; shard 1 reported missing, its rows left out.
        let all = newest_first(&known);
        assert_eq!(fan_out(&FanOutRead { limit: 5, ..read(all.clone(), false, &[]) }), Vec::<String>::new());
        assert_eq!(fan_out(&read(all[..3].to_vec(), true, &[])), Vec::<String>::new());
        let of_2: Vec<FanOutRow> = all.iter().filter(|r| r.shard == 2).cloned().collect();
        assert_eq!(fan_out(&read(of_2.clone(), false, &[1])), Vec::<String>::new());
        let judged = |r: FanOutRead, needle: &str| {
            let found = fan_out(&r);
            assert!(found.iter().any(|v| v.contains(needle)), "expected {needle:?} in {found:?}");
        };
        // A shard left out without a word; a full page missing one of its newest.
        judged(read(of_2.clone(), false, &[]), "left out photo 20 of shard 1");
        judged(read(vec![all[0].clone(), all[2].clone(), all[3].clone()], true, &[]), "left out photo 40");
        // Twice, out of order, outside the window, past the limit, of a missing shard.
        judged(read(vec![all[0].clone(), all[0].clone()], true, &[]), "not newest first, or twice");
        judged(read(vec![all[1].clone(), all[0].clone()], true, &[]), "not newest first, or twice");
        judged(read(vec![fan_row(60, 1101, 1)], true, &[]), "outside the window");
        judged(read(all.clone(), false, &[]), "5 rows for a limit of 3");
        judged(read(all[..1].to_vec(), true, &[2]), "which it reported missing");
        // Not as written; a host reported missing for a misrouted row.
        let mut changed = all.clone();
        changed[4].content = "x".into();
        judged(FanOutRead { limit: 5, ..read(changed, false, &[]) }, "returned photo 10 as \"x\"");
        judged(
            FanOutRead {
                missing_errors: vec!["pg2: get was sent to shard 3 but returned a row of shard 4".into()],
                ..read(of_2.clone(), false, &[1])
            },
            "misrouted row",
        );
        // A page resumed from a cursor (`newest`): the rows below it, all of them; one at
        // or above it is outside, one below it left out is missed.
        let below = |rows: Vec<FanOutRow>| FanOutRead { below: Some(40), ..read(rows, true, &[]) };
        assert_eq!(fan_out(&below(all[2..].to_vec())), Vec::<String>::new());
        judged(below(all[1..4].to_vec()), "outside the window");
        judged(below(all[3..].to_vec()), "left out photo 30");
        // The worker's own photos: photo 60 (1060 ms, shard 1) holds "v2", may hold "v1"
        // or "v2", may be absent, or was deleted.
        let mine = fan_row(60, 1060, 1);
        let own = |rows: Vec<FanOutRow>, states: Vec<Option<&str>>| FanOutRead {
            limit: 10,
            own: vec![(mine.clone(), states.into_iter().map(|s| s.map(str::to_owned)).collect())],
            ..read(rows, false, &[])
        };
        let with = |content: &str| {
            let mut rows = vec![FanOutRow { content: content.into(), ..mine.clone() }];
            rows.extend(all.iter().cloned());
            rows
        };
        for ok in [
            own(with("v2"), vec![Some("v2")]),
            own(with("v1"), vec![Some("v1"), Some("v2")]),
            own(all.clone(), vec![Some("v2"), None]),
            own(all.clone(), vec![None]),
            FanOutRead { missing: [1].into_iter().collect(), ..own(of_2.clone(), vec![Some("v2")]) },
        ] {
            assert_eq!(fan_out(&ok), Vec::<String>::new(), "{ok:?}");
        }
        judged(own(with("v1"), vec![Some("v2")]), "own photo 60 as \"v1\"");
        judged(own(with("v1"), vec![None]), "own photo 60 as \"v1\"");
        judged(own(all.clone(), vec![Some("v2")]), "left out its worker's own photo 60");
    }

    #[test]
    fn a_count_is_judged_between_the_photos_known_and_the_writes_that_could_be() {
        // IDs 1..=9 at 1000 + 10 × ID ms, of shard ID % 2; the window 1010..=1050 holds 1..=5.
        let place =
            |id: i64| (1000 + u128::try_from(id).unwrap_or(0) * 10, u16::try_from(id % 2).unwrap_or(0));
        let read = |count: u64, missing: &[u16]| CountRead {
            start: Duration::from_millis(100),
            end: Duration::from_millis(110),
            from_ms: 1010,
            to_ms: 1050,
            count,
            missing: missing.iter().copied().collect(),
        };
        let ms = Duration::from_millis;
        let photo = write;
        let history = vec![
            photo("a", 0, 5, Outcome::Acked(1)),
            photo("b", 0, 5, Outcome::Acked(2)),
            photo("c", 0, 5, Outcome::Acked(3)),
            // Acknowledged while the count ran: may be counted.
            photo("d", 90, 105, Outcome::Acked(4)),
            // Deleted before the count began: not there; deleted while it ran: either.
            photo("e", 0, 5, Outcome::Acked(5)),
            photo("f", 0, 5, Outcome::Acked(1)),
            // Outside the window; refused; begun after the count: none of them.
            photo("g", 0, 5, Outcome::Acked(9)),
            photo("h", 0, 5, Outcome::Failed { unknown: false, error: "refused".into() }),
            photo("i", 120, 130, Outcome::Acked(3)),
            // Of unknown outcome: found applied at the end, in the window, may be there;
            // found outside it, or not at all, is not.
            photo("j", 50, 60, Outcome::Failed { unknown: true, error: "timeout".into() }),
            photo("k", 50, 60, Outcome::Committed),
            photo("l", 50, 60, Outcome::Failed { unknown: true, error: "timeout".into() }),
        ];
        let observed = seen(vec![row("j", 2), row("k", 8)]);
        let delete = |token: &str, start: u64, end: u64| Mutation {
            token: token.into(),
            content: None,
            start: ms(start),
            end: ms(end),
            outcome: Outcome::Acked(0),
        };
        let mutations = vec![delete("e", 10, 20), delete("f", 105, 108)];
        // At least a, b, c; at most a, b, c, d, f, j.
        let judged = |reads: &[CountRead]| counts(reads, &history, &mutations, &observed, place);
        for ok in [read(3, &[]), read(6, &[]), read(1, &[1])] {
            assert_eq!(judged(std::slice::from_ref(&ok)), Vec::<String>::new(), "{ok:?}");
        }
        let found = |r: CountRead, needle: &str| {
            let found = judged(&[r]);
            assert!(found.iter().any(|v| v.contains(needle)), "expected {needle:?} in {found:?}");
        };
        found(read(2, &[]), "3 photos known to be there");
        found(read(0, &[1]), "1 photos known to be there");
        found(read(7, &[]), "more than the 6 that could be there");
    }

    #[test]
    fn a_clean_history_has_no_violation() {
        let (a, b) = (id(1, 3, 0), id(2, 3, 0));
        let history = [
            write("a", 0, 5, Outcome::Acked(a)),
            write("b", 6, 9, Outcome::Acked(b)),
            write("c", 6, 9, Outcome::Failed { unknown: false, error: "refused".into() }),
            write("d", 6, 9, Outcome::Failed { unknown: true, error: "timeout".into() }),
        ];
        assert_eq!(
            check(&history, &[], &seen(vec![row("a", a), row("b", b), row("d", id(3, 3, 0))])),
            Vec::<String>::new()
        );
        // A transaction of unknown outcome applied whole, and one not applied at all.
        let unknown = || Outcome::Failed { unknown: true, error: "lost".into() };
        let txs = [
            Write { group: Some(1), ..write("e", 0, 5, unknown()) },
            Write { group: Some(1), ..write("f", 0, 5, unknown()) },
            Write { group: Some(2), ..write("g", 0, 5, unknown()) },
            Write { group: Some(2), ..write("h", 0, 5, unknown()) },
        ];
        assert_eq!(check(&txs, &[], &seen(vec![row("e", a), row("f", b)])), Vec::<String>::new());
        // An old copy holding rows its shard still has live is no violation.
        let old = Observed {
            live: vec![row("a", a), row("b", b)],
            old_copies: vec![Row { schema: "shard_0003_moved_7".into(), ..row("a", a) }],
            ..Observed::default()
        };
        assert_eq!(check(&history[..2], &[], &old), Vec::<String>::new());
    }

    #[test]
    fn each_broken_promise_is_named() {
        let (a, b) = (id(1, 3, 0), id(2, 3, 0));
        let cases: Vec<(&str, Vec<Write>, Observed)> = vec![
            ("lost", vec![write("a", 0, 5, Outcome::Acked(a))], seen(vec![])),
            (
                "applied 2 times",
                vec![write("a", 0, 5, Outcome::Acked(a))],
                seen(vec![row("a", a), row("a", b)]),
            ),
            (
                "reported as not applied is present",
                vec![write("a", 0, 5, Outcome::Failed { unknown: false, error: "refused".into() })],
                seen(vec![row("a", a)]),
            ),
            (
                "applied 2 times",
                vec![write("a", 0, 5, Outcome::Failed { unknown: true, error: "timeout".into() })],
                seen(vec![row("a", a), row("a", b)]),
            ),
            (
                "holds",
                vec![write("a", 0, 5, Outcome::Acked(a))],
                seen(vec![Row { content: "x".into(), ..row("a", a) }]),
            ),
            ("stored with ID", vec![write("a", 0, 5, Outcome::Acked(a))], seen(vec![row("a", b)])),
            (
                "is stored in comments",
                vec![write("a", 0, 5, Outcome::Acked(a))],
                seen(vec![Row { table: Table::Comments, ..row("a", a) }]),
            ),
            (
                "appears more than once",
                vec![write("a", 0, 5, Outcome::Acked(a)), write("b", 0, 5, Outcome::Acked(b))],
                seen(vec![row("a", a), row("b", b), Row { token: "a".into(), ..row("a", a) }]),
            ),
            (
                "not above ID",
                // b started after a was acknowledged, in the same shard, with a lower ID.
                vec![write("a", 0, 5, Outcome::Acked(b)), write("b", 6, 9, Outcome::Acked(a))],
                seen(vec![row("a", b), row("b", a)]),
            ),
            ("rows no write made", vec![], seen(vec![row("z", a)])),
            (
                "reported committed (its host's part of a batch) is absent",
                vec![write("a", 0, 5, Outcome::Committed)],
                seen(vec![]),
            ),
            (
                "applied 2 times: photos a reported committed",
                vec![write("a", 0, 5, Outcome::Committed)],
                seen(vec![row("a", a), row("a", b)]),
            ),
            (
                // A transaction of two writes whose outcome is unknown: one of them there.
                "half a transaction applied (outcome unknown)",
                vec![
                    Write {
                        group: Some(1),
                        ..write("a", 0, 5, Outcome::Failed { unknown: true, error: "lost".into() })
                    },
                    Write {
                        group: Some(1),
                        ..write("b", 0, 5, Outcome::Failed { unknown: true, error: "lost".into() })
                    },
                ],
                seen(vec![row("a", a)]),
            ),
            (
                "its key routes to shard",
                vec![write("a", 0, 5, Outcome::Acked(a))],
                seen(vec![Row { key_shard: 4, ..row("a", a) }]),
            ),
            (
                "carries shard",
                vec![write("a", 0, 5, Outcome::Acked(a))],
                seen(vec![Row { id_shard: 4, ..row("a", a) }]),
            ),
            (
                "disagree",
                vec![],
                Observed { stray_schemas: vec!["pg2.shard_0003".into()], ..Observed::default() },
            ),
            (
                "left behind",
                vec![],
                Observed { replication_left: vec!["pg1: slot s".into()], ..Observed::default() },
            ),
            ("not writable", vec![], Observed { unwritable: vec!["shard 3".into()], ..Observed::default() }),
            ("still running", vec![], Observed { moves_left: vec!["move 4".into()], ..Observed::default() }),
            (
                "(outcome unknown) is stored as",
                vec![write("a", 0, 5, Outcome::Failed { unknown: true, error: "timeout".into() })],
                seen(vec![Row { content: "x".into(), ..row("a", a) }]),
            ),
            (
                "written there after the fence",
                vec![
                    write("a", 0, 5, Outcome::Acked(a)),
                    write("b", 6, 9, Outcome::Failed { unknown: true, error: "timeout".into() }),
                ],
                Observed {
                    live: vec![row("a", a)],
                    old_copies: vec![row("a", a), Row { schema: "shard_0003_moved_7".into(), ..row("b", b) }],
                    ..Observed::default()
                },
            ),
            (
                "not readable at the end",
                vec![],
                Observed { unreadable: vec!["photo 5".into()], ..Observed::default() },
            ),
            (
                "read of photo",
                vec![],
                Observed { bad_reads: vec!["read of photo 5 failed".into()], ..Observed::default() },
            ),
        ];
        for (what, history, observed) in cases {
            let found = check(&history, &[], &observed);
            assert!(found.iter().any(|v| v.contains(what)), "{what}: found {found:?}");
        }
    }

    fn mutation(token: &str, content: Option<&str>, outcome: Outcome) -> Mutation {
        Mutation {
            token: token.into(),
            content: content.map(|c| format!("1|{c}|{token}")),
            start: Duration::from_millis(10),
            end: Duration::from_millis(11),
            outcome,
        }
    }

    #[test]
    fn updates_and_deletes_decide_what_a_photo_may_hold() {
        let a = id(1, 3, 0);
        let history = [write("a", 0, 5, Outcome::Acked(a))];
        let unknown = || Outcome::Failed { unknown: true, error: "timeout".into() };
        let refused = || Outcome::Failed { unknown: false, error: "refused".into() };
        let holding = |c: &str| seen(vec![Row { content: format!("1|{c}|a"), ..row("a", a) }]);
        let v2 = mutation("a", Some("v2"), Outcome::Acked(a));
        let v3_unknown = mutation("a", Some("v3"), unknown());
        let v4_refused = mutation("a", Some("v4"), refused());
        let gone = mutation("a", None, Outcome::Acked(a));
        let gone_unknown = mutation("a", None, unknown());
        // Clean: what each history allows.
        let clean: Vec<(Vec<Mutation>, Observed)> = vec![
            (vec![v2.clone()], holding("v2")),
            (vec![v2.clone(), v3_unknown.clone()], holding("v2")),
            (vec![v2.clone(), v3_unknown.clone()], holding("v3")),
            (vec![v2.clone(), v4_refused.clone()], holding("v2")),
            (vec![gone.clone()], seen(vec![])),
            (vec![gone_unknown.clone()], seen(vec![])),
            (vec![gone_unknown.clone()], holding("u")),
            // A deleted photo's old copy is no leak through a fence.
            (
                vec![gone.clone()],
                Observed {
                    old_copies: vec![Row { schema: "shard_0003_moved_7".into(), ..row("a", a) }],
                    ..seen(vec![])
                },
            ),
        ];
        for (mutations, observed) in clean {
            assert_eq!(check(&history, &mutations, &observed), Vec::<String>::new(), "{mutations:?}");
        }
        // Broken: an acknowledged update lost, a refused one applied, a deleted photo
        // back, an unknown update applied after a later acknowledged one.
        let broken: Vec<(Vec<Mutation>, Observed, &str)> = vec![
            (vec![v2.clone()], holding("u"), "holds"),
            (vec![v2.clone(), v4_refused.clone()], holding("v4"), "holds"),
            (vec![gone.clone()], holding("u"), "holds"),
            (vec![v3_unknown.clone(), v2.clone()], holding("v3"), "holds"),
            (vec![v2.clone()], seen(vec![]), "lost"),
            (vec![mutation("b", Some("v2"), Outcome::Acked(a))], holding("u"), "no acknowledged write"),
        ];
        for (mutations, observed, what) in broken {
            let found = check(&history, &mutations, &observed);
            assert!(found.iter().any(|v| v.contains(what)), "{what}: {mutations:?} found {found:?}");
        }
        assert_eq!(
            possible("x", &[&gone_unknown, &v2]),
            vec![None, Some("1|v2|a".to_owned())],
            "an update after a delete that may have happened finds the row or not"
        );
    }

    #[test]
    fn concurrent_writes_may_mint_in_either_order() {
        let (a, b) = (id(1, 3, 0), id(2, 3, 0));
        // b started before a was acknowledged: no order between them.
        let history = [write("a", 0, 5, Outcome::Acked(b)), write("b", 4, 9, Outcome::Acked(a))];
        assert_eq!(check(&history, &[], &seen(vec![row("a", b), row("b", a)])), Vec::<String>::new());
    }
}
