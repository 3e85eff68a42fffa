//! `shardline rebalance`: even out the shards over the hosts by bytes, new empty hosts
//! included, a bounded number of moves at a time.
//!
//! The plan is greedy: while a move makes the gap between the heaviest and the lightest
//! host smaller, move from the heaviest to the lightest the shard that leaves the two
//! closest. Shards of equal size (a young cluster) spread by count.

use std::collections::{BTreeMap, BTreeSet};

use futures::StreamExt as _;
use serde::Serialize;
use shardline_repo::Catalog;
use shardline_repo::catalog::HostState;
use shardline_router::{Config, HostName, LogicalShard};

use crate::moves::preflight::host_err;
use crate::moves::{MoveOptions, MoveReport};
use crate::{Error, Result};

/// One planned move.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PlannedMove {
    /// The shard.
    pub shard: LogicalShard,
    /// From.
    pub from: HostName,
    /// To.
    pub to: HostName,
    /// Its bytes.
    pub bytes: i64,
}

/// One host before and after the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct HostLoad {
    /// The host.
    pub host: HostName,
    /// Shards now.
    pub shards_before: usize,
    /// Bytes now.
    pub bytes_before: i64,
    /// Shards after the plan.
    pub shards_after: usize,
    /// Bytes after the plan.
    pub bytes_after: i64,
}

/// A rebalancing plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Plan {
    /// The moves, in the order they would run.
    pub moves: Vec<PlannedMove>,
    /// Every host, before and after.
    pub hosts: Vec<HostLoad>,
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{:<16} {:>7} {:>14}   {:>7} {:>14}", "host", "shards", "bytes", "after", "bytes after")?;
        for h in &self.hosts {
            writeln!(
                f,
                "{:<16} {:>7} {:>14}   {:>7} {:>14}",
                h.host, h.shards_before, h.bytes_before, h.shards_after, h.bytes_after
            )?;
        }
        if self.moves.is_empty() {
            write!(f, "balanced: no move would make it more even")
        } else {
            write!(f, "{} move(s):", self.moves.len())?;
            for m in &self.moves {
                write!(f, "\n  shard {:>4}  {} -> {}  ({} bytes)", m.shard, m.from, m.to, m.bytes)?;
            }
            Ok(())
        }
    }
}

/// Plans at most `max_moves` moves from the hosts' current sizes. Changes nothing.
///
/// # Errors
///
/// The catalog or a host unreachable (sizes are needed from every host);
/// [`crate::Error::CatalogHung`].
pub async fn plan(config: &Config, max_moves: usize) -> Result<Plan> {
    let config = &crate::fleet::resolved(config).await?;
    crate::moves::catalog_watched(config, async {
        let (catalog, _) = Catalog::open(config).await?;
        let sizes = sizes(config, &catalog).await?;
        Ok(plan_from(&sizes, max_moves))
    })
    .await
}

/// Each active host's shards with their bytes (a draining host is left out: its
/// shards are leaving, and nothing may move onto it).
pub(crate) async fn sizes(
    config: &Config,
    catalog: &Catalog,
) -> Result<BTreeMap<HostName, Vec<(LogicalShard, i64)>>> {
    sizes_of(config, catalog, |state| state == HostState::Active).await
}

/// The shards and bytes of each host whose state `wanted` accepts.
pub(crate) async fn sizes_of(
    config: &Config,
    catalog: &Catalog,
    wanted: impl Fn(HostState) -> bool,
) -> Result<BTreeMap<HostName, Vec<(LogicalShard, i64)>>> {
    let map = catalog.map().await?;
    let states = catalog.hosts().await?;
    let mut sizes: BTreeMap<HostName, Vec<(LogicalShard, i64)>> = BTreeMap::new();
    for host in map.hosts() {
        if !states.iter().any(|h| &h.name == host && wanted(h.state)) {
            continue;
        }
        let shards: Vec<LogicalShard> = map.shards_of(host).collect();
        let mut these = Vec::new();
        if !shards.is_empty() {
            let h = config
                .host(host)
                .ok_or_else(|| Error::HostMissing { host: host.clone(), shards: shards.len() })?;
            let schemas: Vec<String> =
                shards.iter().map(|s| config.schema_prefix.schema(*s).as_str().to_owned()).collect();
            // A host that took the connection and then hung is given up on (and named)
            // once it has answered no probe for 15 s, not waited for as long as it lasts.
            let measure = async {
                let c = shardline_repo::catalog::connect(&h.url, &format!("host {host}")).await?;
                c.query(
                    "SELECT s.name, coalesce(sum(pg_total_relation_size(c.oid)) FILTER (WHERE c.relkind = 'r'), 0)::bigint
                       FROM unnest($1::text[]) AS s(name)
                       LEFT JOIN pg_namespace n ON n.nspname = s.name
                       LEFT JOIN pg_class c ON c.relnamespace = n.oid
                      GROUP BY s.name",
                    &[&schemas],
                )
                .await
                .map_err(|e| host_err(host, "measure the shards", &e))
            };
            let rows = crate::moves::unless_hung(
                config,
                std::slice::from_ref(host),
                crate::moves::CATALOG_HUNG_AFTER,
                measure,
            )
            .await??;
            let bytes: BTreeMap<String, i64> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
            for (s, name) in shards.iter().zip(&schemas) {
                these.push((*s, bytes.get(name).copied().unwrap_or(0)));
            }
        }
        sizes.insert(host.clone(), these);
    }
    Ok(sizes)
}

/// Each host's shards with their bytes, and the host's total.
type Loads<'a> = BTreeMap<&'a HostName, (Vec<(LogicalShard, i64)>, i64)>;

/// The greedy plan over given sizes (pure; see the module docs).
pub fn plan_from(sizes: &BTreeMap<HostName, Vec<(LogicalShard, i64)>>, max_moves: usize) -> Plan {
    let mut load: Loads<'_> =
        sizes.iter().map(|(h, s)| (h, (s.clone(), s.iter().map(|x| x.1).sum()))).collect();
    let mut moves = Vec::new();
    while moves.len() < max_moves && load.len() > 1 {
        let heavy =
            load.iter().max_by_key(|(h, (s, b))| (*b, s.len(), std::cmp::Reverse(**h))).map(|(h, _)| *h);
        let light = load.iter().min_by_key(|(h, (s, b))| (*b, s.len(), **h)).map(|(h, _)| *h);
        let (Some(heavy), Some(light)) = (heavy, light) else { break };
        if heavy == light {
            break;
        }
        let (hb, lb) = (load[heavy].1, load[light].1);
        let (hn, ln) = (load[heavy].0.len(), load[light].0.len());
        let gap = hb - lb;
        // The shard that leaves the pair closest; only if the gap shrinks (or, all
        // sizes equal, the count gap does).
        let best = load[heavy].0.iter().enumerate().min_by_key(|(_, (s, b))| ((gap - 2 * b).abs(), s.get()));
        let Some((i, &(shard, bytes))) = best else { break };
        let better_bytes = (gap - 2 * bytes).abs() < gap;
        let better_count = bytes == 0 && gap == 0 && hn > ln + 1;
        if !(better_bytes || better_count) {
            break;
        }
        if let Some(entry) = load.get_mut(heavy) {
            entry.0.remove(i);
            entry.1 -= bytes;
        }
        if let Some(entry) = load.get_mut(light) {
            entry.0.push((shard, bytes));
            entry.1 += bytes;
        }
        moves.push(PlannedMove { shard, from: heavy.clone(), to: light.clone(), bytes });
    }
    let hosts = sizes
        .iter()
        .map(|(h, s)| HostLoad {
            host: h.clone(),
            shards_before: s.len(),
            bytes_before: s.iter().map(|x| x.1).sum(),
            shards_after: load.get(h).map_or(0, |l| l.0.len()),
            bytes_after: load.get(h).map_or(0, |l| l.1),
        })
        .collect();
    Plan { moves, hosts }
}

/// How many of a plan's moves [`apply`] runs at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Parallel {
    /// Moves at a time (at least 1).
    pub moves: usize,
    /// Running moves that one host may take part in, as source or target (at least 1).
    pub per_host: usize,
    /// Whether moves still start after one failed. A rebalance plan's moves each assume
    /// the ones before them happened (a move that failed leaves its shard where the
    /// next moves did not count on it: they could leave the hosts more uneven than they
    /// were), so a rebalance stops starting moves (`false`); a drain's moves each only
    /// take a shard off the drained host, so a drain goes on (`true`). A later move of
    /// a shard whose move failed never starts.
    pub keep_going: bool,
}

impl Parallel {
    /// `n` moves at a time between disjoint host pairs: no host takes part in two running
    /// moves, so each copy has its source's and its target's disks and cores to itself
    /// (`rebalance --apply --parallel N`). Stops starting moves after one fails.
    pub fn disjoint(n: usize) -> Self {
        Parallel { moves: n.max(1), per_host: 1, keep_going: false }
    }

    /// `n` moves at a time however they share hosts: a drain, whose every move leaves
    /// the same host. Goes on after a move fails.
    pub fn shared(n: usize) -> Self {
        Parallel { moves: n.max(1), per_host: n.max(1), keep_going: true }
    }

    /// `moves` at a time, `per_host` of them at most on any one host (each at least 1).
    /// Stops starting moves after one fails.
    pub fn new(moves: usize, per_host: usize) -> Self {
        Parallel { moves: moves.max(1), per_host: per_host.max(1), keep_going: false }
    }
}

/// The first pending move (in plan order) whose two hosts each take part in fewer than
/// `per_host` running moves, and whose shard neither is moving nor has an earlier move
/// pending: a plan may move one shard twice, and the second move must start from where
/// the first one put it.
fn startable(
    pending: &[(usize, PlannedMove)],
    busy: &BTreeMap<HostName, usize>,
    moving: &BTreeSet<LogicalShard>,
    per_host: usize,
) -> Option<usize> {
    let free = |h: &HostName| busy.get(h).copied().unwrap_or(0) < per_host.max(1);
    pending.iter().enumerate().position(|(i, (_, m))| {
        free(&m.from)
            && free(&m.to)
            && !moving.contains(&m.shard)
            && !pending[..i].iter().any(|(_, earlier)| earlier.shard == m.shard)
    })
}

/// Runs a plan's moves, at most `parallel.moves` at a time and at most
/// `parallel.per_host` of them on any one host; a move waits for its hosts, and a later
/// move whose hosts are free starts before it (never before an earlier move of the same
/// shard). After a move fails, the moves not yet started are not started (unless
/// `parallel.keep_going`; never a later move of the failed move's shard), and are
/// returned as [`Error::NotStarted`]; the moves running finish. Each result is returned
/// in plan order.
///
/// # Cancel safety
///
/// Dropping the future drops the moves in flight, as killing the mover would: each is
/// left in the journal, to resume or undo (`shardline move --resume|--abort`).
pub async fn apply(
    config: &Config,
    plan: &Plan,
    parallel: Parallel,
    options: &MoveOptions,
) -> Vec<(PlannedMove, Result<MoveReport>)> {
    run_plan(plan, parallel, |m: PlannedMove| async move {
        crate::moves::run(config, m.shard, &m.to, options).await
    })
    .await
}

/// [`apply`]'s scheduling, with `run` making each move.
async fn run_plan<T, F, Fut>(plan: &Plan, parallel: Parallel, run: F) -> Vec<(PlannedMove, Result<T>)>
where
    F: Fn(PlannedMove) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut pending: Vec<(usize, PlannedMove)> = plan.moves.iter().cloned().enumerate().collect();
    let mut busy: BTreeMap<HostName, usize> = BTreeMap::new();
    let mut moving: BTreeSet<LogicalShard> = BTreeSet::new();
    let mut running = futures::stream::FuturesUnordered::new();
    let mut done: Vec<Option<(PlannedMove, Result<T>)>> = plan.moves.iter().map(|_| None).collect();
    loop {
        while running.len() < parallel.moves.max(1) {
            let Some(i) = startable(&pending, &busy, &moving, parallel.per_host) else { break };
            let (index, m) = pending.remove(i);
            moving.insert(m.shard);
            for h in [&m.from, &m.to] {
                *busy.entry(h.clone()).or_default() += 1;
            }
            tracing::debug!(shard = %m.shard, from = %m.from, to = %m.to, running = running.len() + 1, "move starts");
            let moved = run(m.clone());
            running.push(async move { (index, m, moved.await) });
        }
        let Some((index, m, r)) = running.next().await else { break };
        if r.is_err() {
            // The moves that counted on this one are not started.
            let failed = m.shard;
            let (skipped, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut pending)
                .into_iter()
                .partition(|(_, p): &(usize, PlannedMove)| !parallel.keep_going || p.shard == failed);
            pending = kept;
            for (i, p) in skipped {
                tracing::warn!(shard = %p.shard, failed = %failed, "move not started: a move the plan counted on failed");
                if let Some(slot) = done.get_mut(i) {
                    *slot = Some((p, Err(Error::NotStarted { failed })));
                }
            }
        }
        moving.remove(&m.shard);
        for h in [&m.from, &m.to] {
            if let Some(n) = busy.get_mut(h) {
                *n = n.saturating_sub(1);
            }
        }
        if let Some(slot) = done.get_mut(index) {
            *slot = Some((m, r));
        }
    }
    done.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_router::ShardCount;

    fn shards(count: &ShardCount, list: &[(i64, i64)]) -> Vec<(LogicalShard, i64)> {
        list.iter().filter_map(|&(s, b)| LogicalShard::new(s, *count).ok().map(|s| (s, b))).collect()
    }

    fn h(name: &str) -> HostName {
        HostName::new(name).unwrap_or_else(|_| unreachable!())
    }

    /// A planned move of shard `s` (of 8), 1 byte.
    fn mv(s: i64, from: &str, to: &str) -> PlannedMove {
        let count = ShardCount::new(8).unwrap_or_else(|_| unreachable!());
        PlannedMove {
            shard: LogicalShard::new(s, count).unwrap_or_else(|_| unreachable!()),
            from: h(from),
            to: h(to),
            bytes: 1,
        }
    }

    /// Runs a plan with moves that fail for the shards in `failing`; returns each
    /// move's outcome as `ok`, `failed` or `not started`, in plan order.
    fn outcomes(moves: Vec<PlannedMove>, parallel: Parallel, failing: &[i64]) -> Vec<(i64, &'static str)> {
        let plan = Plan { moves, hosts: Vec::new() };
        let run = |m: PlannedMove| {
            let fails = failing.contains(&i64::from(m.shard.get()));
            async move { if fails { Err(Error::Busy) } else { Ok(()) } }
        };
        futures::executor::block_on(run_plan(&plan, parallel, run))
            .into_iter()
            .map(|(m, r)| {
                let said = match r {
                    Ok(()) => "ok",
                    Err(Error::NotStarted { .. }) => "not started",
                    Err(_) => "failed",
                };
                (i64::from(m.shard.get()), said)
            })
            .collect()
    }

    /// A rebalance plan's moves each assume the ones before them happened: once one
    /// fails, none starts after it (before: all ran, and could leave the hosts more
    /// uneven than they were, or start a shard's second move from where it never got).
    /// A drain goes on, but never with a later move of the failed move's shard.
    #[test]
    fn after_a_failed_move_the_moves_that_counted_on_it_do_not_start() {
        let plan = || vec![mv(0, "h0", "h1"), mv(2, "h1", "h0"), mv(0, "h1", "h2"), mv(3, "h2", "h0")];
        assert_eq!(
            outcomes(plan(), Parallel::disjoint(1), &[0]),
            [(0, "failed"), (2, "not started"), (0, "not started"), (3, "not started")]
        );
        assert_eq!(
            outcomes(plan(), Parallel::shared(1), &[0]),
            [(0, "failed"), (2, "ok"), (0, "not started"), (3, "ok")]
        );
        assert_eq!(
            outcomes(plan(), Parallel::disjoint(1), &[]),
            [(0, "ok"), (2, "ok"), (0, "ok"), (3, "ok")]
        );
    }

    #[test]
    fn running_moves_share_no_host_unless_allowed() {
        let pending: Vec<(usize, PlannedMove)> =
            [mv(0, "a", "c"), mv(1, "a", "d"), mv(2, "b", "c"), mv(3, "b", "d")]
                .into_iter()
                .enumerate()
                .collect();
        let mut busy = BTreeMap::new();
        let none = BTreeSet::new();
        assert_eq!(startable(&pending, &busy, &none, 1), Some(0));
        // a -> c runs: a -> d and b -> c wait, b -> d starts.
        busy.insert(h("a"), 1);
        busy.insert(h("c"), 1);
        assert_eq!(startable(&pending, &busy, &none, 1), Some(3));
        busy.insert(h("b"), 1);
        busy.insert(h("d"), 1);
        assert_eq!(startable(&pending, &busy, &none, 1), None, "every host busy");
        // Shared: a second move may use a busy host.
        assert_eq!(startable(&pending, &busy, &none, 2), Some(0));
        assert_eq!(startable(&[], &BTreeMap::new(), &none, 1), None);
    }

    #[test]
    fn a_shard_moved_twice_moves_in_plan_order() {
        // Shard 4 goes c -> d, then d -> a; the second must not start first, though its
        // hosts are free while c -> b runs.
        let pending: Vec<(usize, PlannedMove)> =
            [mv(3, "c", "b"), mv(4, "c", "d"), mv(4, "d", "a")].into_iter().enumerate().collect();
        let busy = BTreeMap::from([(h("c"), 1), (h("b"), 1)]);
        let none = BTreeSet::new();
        assert_eq!(startable(&pending, &busy, &none, 1), None);
        // Once the first move of shard 4 has started (and left the pending list), the
        // second waits for it to end.
        let later = &pending[2..];
        let moving = BTreeSet::from([later[0].1.shard]);
        assert_eq!(startable(later, &BTreeMap::new(), &moving, 1), None);
        assert_eq!(startable(later, &BTreeMap::new(), &none, 1), Some(0));
    }

    #[test]
    fn a_new_empty_host_receives_shards_until_even() {
        let count = ShardCount::new(12).unwrap_or_else(|_| unreachable!());
        let mut sizes = BTreeMap::new();
        let h = |n: &str| HostName::new(n).unwrap_or_else(|_| unreachable!());
        sizes.insert(h("a"), shards(&count, &[(0, 100), (1, 100), (2, 100), (3, 100), (4, 100), (5, 100)]));
        sizes.insert(h("b"), shards(&count, &[(6, 100), (7, 100), (8, 100), (9, 100), (10, 100), (11, 100)]));
        sizes.insert(h("c"), Vec::new());
        let plan = plan_from(&sizes, 10);
        assert_eq!(plan.moves.len(), 4, "{plan}");
        assert!(plan.hosts.iter().all(|l| l.bytes_after == 400), "{plan}");
        assert!(plan.moves.iter().all(|m| m.to == "c"));
        // A bound is a bound.
        assert_eq!(plan_from(&sizes, 1).moves.len(), 1);
    }

    #[test]
    fn a_heavy_shard_is_not_bounced_between_hosts() {
        let count = ShardCount::new(4).unwrap_or_else(|_| unreachable!());
        let h = |n: &str| HostName::new(n).unwrap_or_else(|_| unreachable!());
        let mut sizes = BTreeMap::new();
        sizes.insert(h("a"), shards(&count, &[(0, 1000)]));
        sizes.insert(h("b"), shards(&count, &[(1, 10), (2, 10), (3, 10)]));
        let plan = plan_from(&sizes, 10);
        assert!(plan.moves.is_empty(), "{plan}");
    }

    #[test]
    fn uneven_bytes_move_the_shard_that_fits_the_gap() {
        let count = ShardCount::new(6).unwrap_or_else(|_| unreachable!());
        let h = |n: &str| HostName::new(n).unwrap_or_else(|_| unreachable!());
        let mut sizes = BTreeMap::new();
        sizes.insert(h("a"), shards(&count, &[(0, 500), (1, 300), (2, 50)]));
        sizes.insert(h("b"), shards(&count, &[(3, 100), (4, 100), (5, 50)]));
        let plan = plan_from(&sizes, 10);
        // Gap 600: moving shard 1 (300) leaves 550 against 550.
        assert_eq!(plan.moves.first().map(|m| m.shard.get()), Some(1), "{plan}");
        assert!(plan.hosts.iter().all(|l| l.bytes_after == 550), "{plan}");
    }
}
