//! The pre-flight of a move: everything a move needs, checked before anything changes,
//! every problem reported at once.
//!
//! The checks, on the current map:
//! - the target is a host of the cluster and not the shard's host; no move of the shard is
//!   running (the catalog's journal);
//! - the source: `wal_level = logical`, two free replication slots and two free WAL
//!   senders (the subscription's and one table-sync worker's), the shard's schema is there,
//!   every table in it has a primary key or a replica identity, and its migration ledger
//!   holds exactly the config's migration files (same names, same checksums) and the
//!   config's `app_roles` grants;
//! - the target: the shard's schema is not there yet, a free logical-replication worker,
//!   every role that holds a privilege on the shard on the source (and every app role)
//!   exists, and the source is reachable **from the target** at the source's `peer_url` (probed
//!   with a subscription that connects and is dropped at once, without a slot).

use std::collections::BTreeSet;

use shardline_repo::Catalog;
use shardline_repo::catalog::HostState;
use shardline_repo::catalog::connect;
use shardline_router::{Config, HostName, LogicalShard, SchemaName};
use tokio_postgres::Client;

use super::journal;
use crate::converge::MINTER;
use crate::grants::{self, GRANTS, shard_grants};
use crate::migrations::checksum;
use crate::migrations::load_dir;
use crate::{Error, Result, describe};

/// One thing that stops a move.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// The host it is on, if it is on one.
    pub host: Option<HostName>,
    /// What was checked (`wal_level`, `replica identity`, ...).
    pub check: &'static str,
    /// What is wrong, and what to do.
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.host {
            Some(h) => write!(f, "{h}: {}: {}", self.check, self.message),
            None => write!(f, "{}: {}", self.check, self.message),
        }
    }
}

/// The outcome of a pre-flight: where the shard is, where it would go, and what stops it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Preflight {
    /// The shard.
    pub shard: LogicalShard,
    /// Its schema.
    pub schema: SchemaName,
    /// Its host now.
    pub source: HostName,
    /// Where it would go.
    pub target: HostName,
    /// Rows in the shard (the planner's estimate, for the progress bar).
    pub rows_estimate: i64,
    /// Bytes of the shard's tables and indexes.
    pub bytes: i64,
    /// Bytes of the shard's tables alone (TOAST included, indexes not): about what a
    /// copy reads.
    pub table_bytes: i64,
    /// Every problem found; empty when the move can go ahead.
    pub problems: Vec<Problem>,
}

impl Preflight {
    /// Adds a problem when a copy capped at `max_rate` bytes a second (none: uncapped,
    /// or the subscription's copy) would need longer than `copy_timeout` for the shard's
    /// tables (see [`copy_time_problem`]). [`run`](super::run) checks this; a dry run
    /// may, with the options it would move with.
    pub fn check_copy_time(&mut self, max_rate: Option<u64>, copy_timeout: std::time::Duration) {
        if let Some(message) = copy_time_problem(self.table_bytes, max_rate, copy_timeout) {
            self.problems.push(Problem { host: Some(self.source.clone()), check: "copy rate", message });
        }
    }

    /// Whether nothing stops the move.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }
}

impl std::fmt::Display for Preflight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "shard {} ({}) {} -> {}: {} rows (estimate), {} bytes",
            self.shard, self.schema, self.source, self.target, self.rows_estimate, self.bytes
        )?;
        if self.problems.is_empty() {
            write!(f, "\npre-flight: ok")
        } else {
            write!(f, "\npre-flight: {} problem(s):", self.problems.len())?;
            for p in &self.problems {
                write!(f, "\n  - {p}")?;
            }
            Ok(())
        }
    }
}

struct Checks {
    problems: Vec<Problem>,
    /// What the move takes on its source.
    need: Need,
}

impl Checks {
    fn add(&mut self, host: Option<&HostName>, check: &'static str, message: impl Into<String>) {
        self.problems.push(Problem { host: host.cloned(), check, message: message.into() });
    }
}

/// What is wrong when copying `table_bytes` at `max_rate` bytes a second (none or 0: no
/// cap) needs longer than `copy_timeout`: such a copy would run for the whole timeout and
/// then fail. The tables' size on disk is an estimate of what the copy reads (TOAST values
/// are read decompressed; tuple headers and free space are not read).
pub(crate) fn copy_time_problem(
    table_bytes: i64,
    max_rate: Option<u64>,
    copy_timeout: std::time::Duration,
) -> Option<String> {
    let rate = max_rate.filter(|r| *r > 0)?;
    #[expect(clippy::cast_precision_loss, reason = "an estimate of seconds and megabytes from byte counts")]
    let (needs, mb, rate_mb) =
        (table_bytes.max(0) as f64 / rate as f64, table_bytes.max(0) as f64 / 1e6, rate as f64 / 1e6);
    (needs > copy_timeout.as_secs_f64()).then(|| {
        format!(
            "the shard's tables take {mb:.0} MB on disk: copying that much at {rate_mb} MB/s (the copy's cap, `--max-rate`) takes about {needs:.0} s, more than the copy timeout ({} s); raise --max-rate (0: no cap) or use --subscription-copy",
            copy_timeout.as_secs()
        )
    })
}

pub(crate) fn host_err(host: &HostName, what: &str, e: &tokio_postgres::Error) -> Error {
    let (sqlstate, message) = describe(e);
    Error::Host { host: host.to_string(), what: what.to_owned(), sqlstate, message }
}

/// Checks that `shard` can move to `target`, changing nothing. Every problem is listed,
/// not only the first.
///
/// # Errors
///
/// Only what stops the checks themselves: the catalog unreachable or not initialised, a
/// shard out of range, a statement failing. An unreachable source or target is a
/// [`Problem`], not an error; one that took the connection and then answers no probe
/// for 15 s (hung: paused, out of memory, cut off) is [`crate::Error::Timeout`] naming
/// it, rather than a wait for as long as it lasts.
pub async fn preflight(config: &Config, shard: LogicalShard, target: &HostName) -> Result<Preflight> {
    preflight_with(config, shard, target, super::engine::CATALOG_HUNG_AFTER).await
}

/// [`preflight`], giving a host up once it has answered no probe for `hung_after` (2 s
/// at least; a move's [`super::MoveOptions::hung_after`], `shardline move --dry-run
/// --hung-after`).
///
/// # Errors
///
/// As [`preflight`].
pub async fn preflight_with(
    config: &Config,
    shard: LogicalShard,
    target: &HostName,
    hung_after: std::time::Duration,
) -> Result<Preflight> {
    preflight_for(config, shard, target, Need::MOVE, hung_after.max(std::time::Duration::from_secs(2))).await
}

/// What a move takes on its source, beyond what is there: replication slots and WAL
/// senders.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Need {
    slots: i32,
    senders: i32,
}

impl Need {
    /// A move: its slot and a table-sync worker's; their senders.
    pub(crate) const MOVE: Need = Need { slots: 2, senders: 2 };
    /// A revert: the reverse slot is there already, and nothing is copied.
    pub(crate) const REVERT: Need = Need { slots: 0, senders: 1 };
}

/// [`preflight`], for a move that takes `need` on its source, given up once the source
/// or the target has answered no probe for `hung_after`.
pub(crate) async fn preflight_for(
    config: &Config,
    shard: LogicalShard,
    target: &HostName,
    need: Need,
    hung_after: std::time::Duration,
) -> Result<Preflight> {
    let config = &crate::fleet::resolved_within(config, hung_after).await?;
    // The catalog's facts first, bounded as the hosts' checks are.
    let (map, shard, target_state, running) = super::unless_catalog_hung(config, hung_after, async {
        let (catalog, _) = Catalog::open(config).await?;
        let map = catalog.map().await?;
        let shard = shard.within(map.count())?;
        let target_state = catalog.hosts().await?.into_iter().find(|h| &h.name == target).map(|h| h.state);
        let running = journal::is_running(&catalog, shard).await?;
        Ok((map, shard, target_state, running))
    })
    .await?;
    let schema = config.schema_prefix.schema(shard);
    let source = map.host_of(shard).clone();
    let target_name = target.clone();
    let mut checks = Checks { problems: Vec::new(), need };

    let target_config = config.hosts.iter().find(|h| h.name == target_name);
    if target_state == Some(HostState::Removed) {
        checks.add(
            None,
            "target",
            format!("{target_name} was removed (`shardline host add {target_name}` brings it back)"),
        );
    } else if target_config.is_none() {
        let known = config.hosts.iter().map(|h| h.name.to_string()).collect::<Vec<_>>().join(", ");
        checks.add(
            None,
            "target",
            format!("{target_name} is not a host of this cluster: neither the config nor the catalog has it (hosts: {known})"),
        );
    } else if !map.hosts().contains(&target_name) {
        checks.add(
            None,
            "target",
            format!("{target_name} is not in the catalog yet; `shardline host add {target_name}` adds it"),
        );
    } else if target_state == Some(HostState::Draining) {
        checks.add(
            None,
            "target",
            format!("{target_name} is draining (`shardline host drain`): no shard may move onto it"),
        );
    }
    if target_name == source {
        checks.add(None, "target", format!("shard {shard} is already on {source}"));
    }
    if running {
        checks.add(None, "journal", format!("a move of shard {shard} is running; finish it with `shardline move --resume {shard}` or undo it with `--abort {shard}`"));
    }

    let mut out = Preflight {
        shard,
        schema: schema.clone(),
        source: source.clone(),
        target: target_name.clone(),
        rows_estimate: 0,
        bytes: 0,
        table_bytes: 0,
        problems: Vec::new(),
    };

    let source_config = config.hosts.iter().find(|h| h.name == source);
    // Each host's statements run under the watchdog once the pre-flight's own connection
    // to it is made (a host that cannot be reached is a problem, listed): a host that
    // took the connection and then hung would hold the pre-flight for as long as it
    // lasts.
    let source_client = match source_config {
        None => {
            checks.add(Some(&source), "source", "the shard's host is not in the config");
            None
        }
        Some(h) => match connect(&h.url, &format!("host {}", h.name)).await {
            Ok(c) => Some(c),
            Err(e) => {
                checks.add(Some(&source), "reachable", shardline_repo::error_chain(&e));
                None
            }
        },
    };
    let mut roles: BTreeSet<String> = config.app_roles.iter().map(|r| r.as_str().to_owned()).collect();
    if let Some(c) = &source_client {
        let mut held = BTreeSet::new();
        let checked = check_source(config, c, &source, &schema, &mut checks, &mut out, &mut held);
        super::engine::unless_hung(config, std::slice::from_ref(&source), hung_after, checked).await??;
        roles.extend(held);
    }

    if let Some(t) = target_config.filter(|_| target_name != source) {
        match connect(&t.url, &format!("host {}", t.name)).await {
            Err(e) => checks.add(Some(&target_name), "reachable", shardline_repo::error_chain(&e)),
            Ok(c) => {
                let peer = source_config.map(|s| s.peer_url.expose().to_owned());
                let checked = async {
                    check_target(&c, &target_name, &schema, peer.as_deref(), &mut checks).await?;
                    let roles: Vec<String> = roles.into_iter().collect();
                    let missing = grants::missing_roles(&c, &roles)
                        .await
                        .map_err(|e| host_err(&target_name, "pre-flight", &e))?;
                    if !missing.is_empty() {
                        checks.add(
                            Some(&target_name),
                            "roles",
                            format!(
                                "{} hold privileges on {schema} (on {source}, or as app_roles) but do not exist here; create them first (roles are per server)",
                                missing.join(", ")
                            ),
                        );
                    }
                    Ok::<_, crate::Error>(())
                };
                super::engine::unless_hung(config, std::slice::from_ref(&target_name), hung_after, checked)
                    .await??;
            }
        }
    }
    out.problems = checks.problems;
    Ok(out)
}

/// Checks the source; fills `roles` with the roles holding privileges on the shard.
async fn check_source(
    config: &Config,
    c: &Client,
    host: &HostName,
    schema: &SchemaName,
    checks: &mut Checks,
    out: &mut Preflight,
    roles: &mut BTreeSet<String>,
) -> Result<()> {
    let fail = |e: tokio_postgres::Error| host_err(host, "pre-flight", &e);
    let row = c
        .query_one(
            "SELECT current_setting('wal_level'),
                    current_setting('max_replication_slots')::int - (SELECT count(*)::int FROM pg_replication_slots),
                    current_setting('max_wal_senders')::int - (SELECT count(*)::int FROM pg_stat_replication)",
            &[],
        )
        .await
        .map_err(fail)?;
    let (level, slots, senders): (String, i32, i32) = (row.get(0), row.get(1), row.get(2));
    let need = checks.need;
    if level != "logical" {
        checks.add(
            Some(host),
            "wal_level",
            format!("is {level}; a move needs logical (set wal_level = logical and restart the server)"),
        );
    }
    if slots < need.slots {
        checks.add(
            Some(host),
            "replication slots",
            format!(
                "{slots} free; a move needs {} (raise max_replication_slots, or drop unused slots)",
                need.slots
            ),
        );
    }
    if senders < need.senders {
        checks.add(
            Some(host),
            "WAL senders",
            format!("{senders} free; a move needs {} (raise max_wal_senders)", need.senders),
        );
    }
    let exists: bool = c
        .query_one("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", &[&schema.as_str()])
        .await
        .map_err(fail)?
        .get(0);
    if !exists {
        checks.add(
            Some(host),
            "schema",
            format!("{schema} is not there, though the map places the shard here"),
        );
        return Ok(());
    }
    // Tables without a primary key or a usable replica identity cannot replicate
    // updates and deletes.
    let bad = c
        .query(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND c.relkind IN ('r', 'p')
                AND (c.relreplident = 'n'
                     OR (c.relreplident = 'd' AND NOT EXISTS (
                         SELECT FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary))
                     -- Its index dropped: as none at all.
                     OR (c.relreplident = 'i' AND NOT EXISTS (
                         SELECT FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident)))
              ORDER BY 1",
            &[&schema.as_str()],
        )
        .await
        .map_err(fail)?;
    for r in bad {
        let table: String = r.get(0);
        checks.add(Some(host), "replica identity", format!("{schema}.{table} has no primary key or replica identity; add a primary key (or REPLICA IDENTITY FULL)"));
    }
    // An unlogged table writes no WAL: a publication leaves it out without a word, so
    // the rows written to it during the move never reach the target (the comparison
    // then fails the move, every time).
    let unlogged = c
        .query(
            "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND c.relpersistence = 'u' ORDER BY 1",
            &[&schema.as_str()],
        )
        .await
        .map_err(fail)?;
    for r in unlogged {
        let table: String = r.get(0);
        checks.add(
            Some(host),
            "unlogged table",
            format!("{schema}.{table} is unlogged: logical replication cannot carry its writes; make it logged (ALTER TABLE ... SET LOGGED)"),
        );
    }
    let foreign = c.query(super::engine::FOREIGN_CHILDREN, &[&schema.as_str()]).await.map_err(fail)?;
    for r in foreign {
        let table: String = r.get(0);
        checks.add(
            Some(host),
            "foreign table",
            format!("{table}, a foreign partition or child of a table of {schema}, has its rows on another server, which both copies would share; shardline does not move such a shard"),
        );
    }
    let elsewhere = c.query(super::engine::CHILDREN_ELSEWHERE, &[&schema.as_str()]).await.map_err(fail)?;
    for r in elsewhere {
        let table: String = r.get(0);
        checks.add(
            Some(host),
            "table outside the shard",
            format!("{table}, a partition or child of a table of {schema}, lives in another schema: a move copies {schema} only, so its rows would stay behind; move it into {schema} (ALTER TABLE ... SET SCHEMA {schema})"),
        );
    }
    let size = c
        .query_one(
            "SELECT coalesce(sum(c.reltuples) FILTER (WHERE c.relkind = 'r' AND c.reltuples > 0), 0)::bigint,
                    coalesce(sum(pg_total_relation_size(c.oid)) FILTER (WHERE c.relkind = 'r'), 0)::bigint,
                    coalesce(sum(pg_table_size(c.oid)) FILTER (WHERE c.relkind = 'r'), 0)::bigint
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1",
            &[&schema.as_str()],
        )
        .await
        .map_err(fail)?;
    out.rows_estimate = size.get(0);
    out.bytes = size.get(1);
    out.table_bytes = size.get(2);

    // The same migration level on both sides: the target is built from the config's
    // files, so the source's ledger must hold exactly those.
    let files = load_dir(&config.migrations)?;
    if let Some(problem) = off_level(c, host, schema, &files).await? {
        checks.add(Some(host), "migrations", format!("{problem}; run `shardline migrate` first"));
    }
    // The app_roles' grants at the config's level too: the target is granted from the
    // config, then given the source's privileges exactly.
    let wanted = shard_grants(schema, &config.app_roles);
    if !wanted.is_empty() {
        let granted: Option<String> = c
            .query_opt(
                "SELECT checksum FROM shardline.shard_migrations WHERE schema_name = $1 AND name = $2",
                &[&schema.as_str(), &GRANTS],
            )
            .await
            .map_err(fail)?
            .map(|r| r.get(0));
        if granted.as_deref() != Some(checksum(wanted.as_bytes()).as_str()) {
            let roles = config.app_roles.iter().map(|r| r.as_str()).collect::<Vec<_>>().join(", ");
            checks.add(
                Some(host),
                "grants",
                format!("{schema} has not been granted to app_roles [{roles}] as the config asks; run `shardline migrate` first"),
            );
        }
    }
    // Every role that holds a privilege there must exist on the target.
    *roles = grants::read_acl(c, host, schema.as_str()).await?.grantees();
    Ok(())
}

/// Why `schema` on `host` (`c`) is not at the level of `files`, or `None` when its
/// ledger holds exactly those files (same names, same checksums): the target of a move
/// is built from the files, so the source's shard must be at their level. Checked by
/// the pre-flight, and again when a move builds its target (a resumed move runs no
/// pre-flight, and the files may have changed since it started).
pub(crate) async fn off_level(
    c: &Client,
    host: &HostName,
    schema: &SchemaName,
    files: &[crate::migrations::Migration],
) -> Result<Option<String>> {
    let applied = c
        .query(
            "SELECT name, checksum FROM shardline.shard_migrations WHERE schema_name = $1 AND name <> ALL($2)",
            &[&schema.as_str(), &[MINTER, GRANTS].as_slice()],
        )
        .await
        .map_err(|e| host_err(host, "read the migration ledger", &e))?;
    let applied: BTreeSet<(String, String)> = applied.iter().map(|r| (r.get(0), r.get(1))).collect();
    let wanted: BTreeSet<(String, String)> =
        files.iter().map(|m| (m.name.clone(), m.checksum.clone())).collect();
    Ok(level_problem(schema, &applied, &wanted))
}

/// Why a ledger holding `applied` (name, checksum) is not at the level of the files
/// `wanted`, or `None`: compared as sets, whatever order the ledger or the files list
/// them in (sqlx-style names `5_x.sql` and `10_y.sql` sort one way as text, the other by
/// version).
fn level_problem(
    schema: &SchemaName,
    applied: &BTreeSet<(String, String)>,
    wanted: &BTreeSet<(String, String)>,
) -> Option<String> {
    if applied == wanted {
        return None;
    }
    let behind: Vec<&str> = wanted.difference(applied).map(|(n, _)| n.as_str()).collect();
    let extra: Vec<&str> = applied.difference(wanted).map(|(n, _)| n.as_str()).collect();
    Some(format!(
        "{schema} is not at the config's migration level (missing or changed: [{}]; not in the config: [{}])",
        behind.join(", "),
        extra.join(", ")
    ))
}

async fn check_target(
    c: &Client,
    host: &HostName,
    schema: &SchemaName,
    source_peer_url: Option<&str>,
    checks: &mut Checks,
) -> Result<()> {
    let fail = |e: tokio_postgres::Error| host_err(host, "pre-flight", &e);
    let row = c
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1),
                    current_setting('max_logical_replication_workers')::int
                      - (SELECT count(*)::int FROM pg_stat_subscription WHERE pid IS NOT NULL)",
            &[&schema.as_str()],
        )
        .await
        .map_err(fail)?;
    let (exists, workers): (bool, i32) = (row.get(0), row.get(1));
    if exists {
        checks.add(
            Some(host),
            "schema",
            format!(
                "{schema} is already there (a leftover of an earlier move?); drop it, or run `shardline gc`"
            ),
        );
    }
    if workers < 2 {
        checks.add(
            Some(host),
            "replication workers",
            format!("{workers} free; a move needs 2 (raise max_logical_replication_workers)"),
        );
    }
    let Some(peer) = source_peer_url else { return Ok(()) };
    // Can the target reach the source? A subscription that connects, then is dropped;
    // with no slot, nothing is left on the source.
    static PROBES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = format!("shardline_probe_{}_{n}", std::process::id());
    let rest = "PUBLICATION shardline_probe
           WITH (connect = true, enabled = false, create_slot = false, slot_name = NONE)";
    // The peer URL may hold a password: through the one helper that keeps it out of the
    // driver's logs and out of the message.
    match super::subscription::create_subscription(c, &probe, peer, rest).await {
        Ok(()) => {
            // IF EXISTS: `gc` drops probes left by pre-flights that died, maybe this one.
            c.batch_execute(&format!("DROP SUBSCRIPTION IF EXISTS {probe}")).await.map_err(fail)?;
        }
        Err((_, message)) => {
            checks.add(
                Some(host),
                "reaches the source",
                format!("cannot connect to the source at its peer_url: {message}"),
            );
        }
    }
    Ok(())
}

pub(crate) use shardline_id::ident::literal as quote_literal;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use shardline_router::{HostName, LogicalShard, SchemaPrefix};

    use std::collections::BTreeSet;

    use super::{Preflight, level_problem};

    fn shard_of(table_bytes: i64) -> Preflight {
        let shard = LogicalShard::bounded(5).unwrap();
        Preflight {
            shard,
            schema: SchemaPrefix::new("shard_").unwrap().schema(shard),
            source: HostName::new("pg1").unwrap(),
            target: HostName::new("pg2").unwrap(),
            rows_estimate: 0,
            bytes: table_bytes * 2,
            table_bytes,
            problems: Vec::new(),
        }
    }

    #[test]
    fn the_migration_level_is_compared_as_sets_whatever_the_order() {
        let schema = SchemaPrefix::new("shard_").unwrap().schema(LogicalShard::bounded(0).unwrap());
        let set = |items: &[(&str, &str)]| -> BTreeSet<(String, String)> {
            items.iter().map(|(n, c)| ((*n).to_owned(), (*c).to_owned())).collect()
        };
        // sqlx-style names: text order puts 10 before 5, the files' version order after.
        let files = set(&[("0001_a.sql", "x"), ("5_tags.up.sql", "y"), ("10_tag_photos.sql", "z")]);
        assert_eq!(level_problem(&schema, &files.clone(), &files), None);
        let changed = set(&[("0001_a.sql", "x"), ("5_tags.up.sql", "OLD"), ("10_tag_photos.sql", "z")]);
        let said = level_problem(&schema, &changed, &files).unwrap_or_default();
        assert!(said.contains("missing or changed: [5_tags.up.sql]"), "{said}");
        let extra = set(&[
            ("0001_a.sql", "x"),
            ("5_tags.up.sql", "y"),
            ("10_tag_photos.sql", "z"),
            ("11_b.sql", "w"),
        ]);
        let said = level_problem(&schema, &extra, &files).unwrap_or_default();
        assert!(said.contains("not in the config: [11_b.sql]"), "{said}");
    }

    #[test]
    fn a_capped_copy_longer_than_the_copy_timeout_is_refused_up_front() {
        let hour = Duration::from_secs(3600);
        // 50 GB at 10 MB/s: 5,000 s, more than an hour; fine within 6 hours.
        let mut slow = shard_of(50_000_000_000);
        slow.check_copy_time(Some(10_000_000), hour);
        assert!(!slow.is_ok());
        let said = slow.problems[0].to_string();
        for part in ["pg1", "copy rate", "50000 MB", "at 10 MB/s", "5000 s", "3600 s", "--subscription-copy"]
        {
            assert!(said.contains(part), "{part:?} in {said}");
        }
        let mut fits = shard_of(50_000_000_000);
        fits.check_copy_time(Some(10_000_000), 6 * hour);
        assert!(fits.is_ok(), "{:?}", fits.problems);
        // No cap, or the subscription's copy: nothing to refuse.
        for rate in [Some(0), None] {
            let mut any = shard_of(50_000_000_000);
            any.check_copy_time(rate, Duration::from_secs(1));
            assert!(any.is_ok(), "{rate:?}: {:?}", any.problems);
        }
    }
}
