//! `init` and `migrate`.
//!
//! Both check everything they can before changing anything: the migration files parse,
//! every host answers, the config agrees with the catalog, every shard's ledger agrees
//! with the files. Then they bring every shard up to date ([`crate::converge`]), in
//! parallel across hosts, and record each shard's state in the catalog.

use std::collections::HashSet;
use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use serde::Serialize;
use shardline_repo::catalog::{self, Catalog};
use shardline_router::{Config, HostName, LogicalShard, ShardMap};
use tokio_postgres::Client;

use crate::converge::{self, Done, HostPlan, Inputs};
use crate::grants;
use crate::migrations::{self, Migration};
use crate::moves::journal;
use crate::{Error, Result, describe};

/// How `init` and `migrate` work.
#[derive(Debug, Clone)]
pub struct Options {
    /// Connections per host, each working on one shard at a time (default 4).
    pub jobs_per_host: usize,
    /// How long a migration statement waits for a lock before its shard fails (default
    /// 5 s), so a migration never queues every query of a busy table behind it.
    pub lock_timeout: Duration,
    /// How long one shard's transaction (and each host's planning) may take before the
    /// run fails naming the host and shard (default 30 min). A hung host ends the run
    /// with that error instead of holding it forever; raise it for migrations that
    /// rewrite big tables.
    pub shard_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            jobs_per_host: 4,
            lock_timeout: Duration::from_secs(5),
            shard_timeout: Duration::from_secs(30 * 60),
        }
    }
}

/// What `init` and `migrate` report as they go.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Progress {
    /// The plan is made: this many shards need work.
    Planned {
        /// Shards to work on.
        shards: usize,
    },
    /// One shard's transaction committed.
    ShardDone {
        /// Its host.
        host: HostName,
        /// The shard.
        shard: LogicalShard,
    },
    /// Something the operator should know, that does not stop the work.
    Warning(String),
}

/// What `init` or `migrate` did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Report {
    /// The catalog was created by this run.
    pub catalog_created: bool,
    /// Shards placed on hosts by this run (all of them on the first `init`, else 0).
    pub shards_placed: usize,
    /// Hosts new to the catalog, added with no shards.
    pub hosts_added: Vec<HostName>,
    /// Shard schemas created.
    pub schemas_created: usize,
    /// ID minters installed or updated.
    pub minters_installed: usize,
    /// Shards that had migrations applied.
    pub shards_migrated: usize,
    /// Migrations applied, summed over shards.
    pub migrations_applied: usize,
    /// Shards on which the config's `app_roles` were granted their privileges (with
    /// other work, or because the roles changed).
    pub shards_granted: usize,
    /// Shards in the cluster.
    pub shards: usize,
    /// Hosts in the cluster.
    pub hosts: usize,
    /// Migration files.
    pub migrations: usize,
    /// The shard map's version.
    pub map_version: i64,
    /// Warnings, such as a host whose `wal_level` is not `logical`.
    pub warnings: Vec<String>,
    /// Wall-clock time taken, in ms.
    pub elapsed_ms: u64,
}

impl Report {
    /// Whether the run changed anything.
    pub fn changed(&self) -> bool {
        self.catalog_created
            || self.shards_placed > 0
            || !self.hosts_added.is_empty()
            || self.schemas_created > 0
            || self.minters_installed > 0
            || self.migrations_applied > 0
            || self.shards_granted > 0
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = Duration::from_millis(self.elapsed_ms).as_secs_f64();
        if !self.changed() {
            return write!(
                f,
                "nothing to do: {} shards on {} hosts are up to date with {} migration(s) (map version {})",
                self.shards, self.hosts, self.migrations, self.map_version
            );
        }
        if self.catalog_created {
            writeln!(f, "created the catalog")?;
        }
        if self.shards_placed > 0 {
            writeln!(
                f,
                "placed {} shards on {} hosts (map version {})",
                self.shards_placed, self.hosts, self.map_version
            )?;
        }
        if !self.hosts_added.is_empty() {
            writeln!(
                f,
                "added host(s) {} with no shards; move shards onto them",
                self.hosts_added.iter().map(HostName::as_str).collect::<Vec<_>>().join(", ")
            )?;
        }
        if self.schemas_created > 0 || self.minters_installed > 0 {
            writeln!(
                f,
                "created {} shard schema(s), installed {} ID minter(s)",
                self.schemas_created, self.minters_installed
            )?;
        }
        if self.migrations_applied > 0 {
            writeln!(
                f,
                "applied {} migration(s) over {} shard(s)",
                self.migrations_applied, self.shards_migrated
            )?;
        }
        if self.shards_granted > 0 {
            writeln!(f, "granted app_roles their privileges on {} shard(s)", self.shards_granted)?;
        }
        write!(
            f,
            "{} shards on {} hosts are up to date with {} migration(s), in {secs:.1} s",
            self.shards, self.hosts, self.migrations
        )
    }
}

/// The catalog's transaction-spanning lock, released when the connection closes. An
/// operation that just ended holds it until its server notices the session is gone, a
/// few milliseconds after (an `init` right after another was refused so): that is
/// waited out, as for a move's own lock, for at most 3 s.
async fn lock(catalog: &Catalog) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(3);
    while !catalog.try_lock().await? {
        if Instant::now() >= deadline {
            return Err(Error::Busy);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

fn catalog_err(what: &str, e: &tokio_postgres::Error) -> Error {
    let (sqlstate, message) = describe(e);
    Error::Host { host: "catalog".into(), what: what.into(), sqlstate, message }
}

/// Connects to every host of the config, in parallel; the answer is in the config's order.
///
/// # Errors
///
/// [`Error::Unreachable`] naming every host that did not answer.
async fn connect_all(config: &Config, per_host: usize) -> Result<Vec<(HostName, Vec<Client>)>> {
    let attempts = config.hosts.iter().map(|h| async move {
        let target = format!("host {}", h.name);
        let conns =
            futures::future::join_all((0..per_host.max(1)).map(|_| catalog::connect(&h.url, &target))).await;
        (h.name.clone(), conns.into_iter().collect::<shardline_repo::Result<Vec<_>>>())
    });
    let mut ok = Vec::new();
    let mut down = Vec::new();
    for (name, r) in futures::future::join_all(attempts).await {
        match r {
            Ok(clients) => ok.push((name, clients)),
            Err(shardline_repo::Error::Connect { source, .. }) => {
                down.push((name.clone(), shardline_repo::error_chain(&source)))
            }
            Err(shardline_repo::Error::ConnectTimeout { after, .. }) => {
                down.push((name.clone(), format!("no answer to the connection's start-up within {after:?}")))
            }
            Err(e) => down.push((name.clone(), shardline_repo::error_chain(&e))),
        }
    }
    if down.is_empty() { Ok(ok) } else { Err(Error::Unreachable { hosts: down }) }
}

/// The warning for a host whose `wal_level` is `level`, if it is not `logical`.
fn wal_warning(host: &HostName, level: &str) -> Option<String> {
    (level != "logical").then(|| {
        format!(
            "host {host} has wal_level = {level}: moving shards to or from it needs wal_level = logical (and a restart)"
        )
    })
}

/// Refuses, changing nothing, when a role of `app_roles` is missing on a host or on the
/// catalog's server.
async fn check_roles(
    config: &Config,
    hosts: &[(HostName, Vec<Client>)],
    catalog: &Catalog,
    within: Duration,
) -> Result<()> {
    let roles: Vec<String> = config.app_roles.iter().map(|r| r.as_str().to_owned()).collect();
    if roles.is_empty() {
        return Ok(());
    }
    let servers = hosts
        .iter()
        .filter_map(|(name, clients)| clients.first().map(|c| (name.to_string(), c)))
        .map(|(at, c)| (at, Some(c)))
        .chain(std::iter::once(("catalog".to_owned(), None)));
    let checks = servers.map(|(at, c)| {
        let roles = &roles;
        async move {
            let what = "look for the app_roles";
            let missing = match c {
                // A host that froze after it was connected fails the run in time.
                Some(c) => match tokio::time::timeout(within, grants::missing_roles(c, roles)).await {
                    Ok(missing) => missing,
                    Err(_) => {
                        let message = format!("no answer within {within:?}");
                        return Err(Error::Host { host: at, what: what.into(), sqlstate: None, message });
                    }
                },
                None => grants::catalog_missing_roles(catalog, roles).await,
            };
            let missing = missing.map_err(|e| {
                let (sqlstate, message) = describe(&e);
                Error::Host { host: at.clone(), what: what.into(), sqlstate, message }
            })?;
            Ok::<_, Error>((at, missing))
        }
    });
    let missing: Vec<(String, Vec<String>)> = futures::future::join_all(checks)
        .await
        .into_iter()
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .filter(|(_, m)| !m.is_empty())
        .collect();
    if missing.is_empty() { Ok(()) } else { Err(Error::RolesMissing { missing }) }
}

/// Lets the config's `app_roles` read what routing needs from the catalog.
async fn grant_catalog(catalog: &Catalog, config: &Config) -> Result<()> {
    grants::grant_catalog(catalog, &config.app_roles)
        .await
        .map_err(|e| catalog_err("grant app_roles the catalog", &e))
}

/// `wal_level` of each host that is not `logical`, as warnings.
async fn wal_warnings(hosts: &[(HostName, Vec<Client>)], within: Duration) -> Result<Vec<String>> {
    let checks = hosts.iter().filter_map(|(name, clients)| clients.first().map(|c| (name, c))).map(
        |(name, c)| async move {
            // A host that froze after it was connected ends the run in time.
            match tokio::time::timeout(within, c.query_one("SHOW wal_level", &[])).await {
                Ok(Ok(row)) => Ok(match row.try_get::<_, String>(0) {
                    Ok(level) => wal_warning(name, &level),
                    Err(e) => Some(format!("host {name}: could not read wal_level: {e}")),
                }),
                Ok(Err(e)) => Ok(Some(format!("host {name}: could not read wal_level: {e}"))),
                Err(_) => Err(Error::Host {
                    host: name.to_string(),
                    what: "read wal_level".into(),
                    sqlstate: None,
                    message: format!("no answer within {within:?}"),
                }),
            }
        },
    );
    let said = futures::future::join_all(checks).await.into_iter().collect::<Result<Vec<_>>>()?;
    Ok(said.into_iter().flatten().collect())
}

/// Refuses when a host that holds shards is missing from the config.
fn check_hosts(map: &ShardMap, config: &Config) -> Result<()> {
    for host in map.hosts() {
        let shards = map.shards_of(host).count();
        if shards > 0 && config.host(host).is_none() {
            return Err(Error::HostMissing { host: host.clone(), shards });
        }
    }
    Ok(())
}

/// Creates the catalog if needed, checks it against the config, adds new hosts, and
/// places the shards on the first run ([`Catalog::prepare`]: one transaction, on any
/// refusal nothing changes); then the journal of moves and its flip function, by their
/// owner ([`journal::install`], idempotent).
async fn prepare_catalog(catalog: &Catalog, config: &Config, report: &mut Report) -> Result<()> {
    let prepared = catalog.prepare(config, |map| check_hosts(map, config)).await?;
    report.catalog_created = prepared.catalog_created;
    report.shards_placed = prepared.shards_placed;
    report.hosts_added = prepared.hosts_added;
    journal::install(catalog).await
}

/// `shardline init`: creates the catalog, places the shards over the config's hosts
/// in contiguous even ranges (config order), creates every shard schema with its ID
/// minter, applies the migrations, and grants the config's `app_roles` their
/// privileges on every shard and on the catalog ([`crate::grants`]). Idempotent: a
/// second run changes nothing and the report says so. Interrupted (killed, a host
/// died), a later run completes the work. Hosts new to the config are added to the
/// catalog with no shards.
///
/// # Errors
///
/// Refusals that change nothing: [`Error::MigrationDir`] / [`Error::MigrationSyntax`]
/// (bad files), [`Error::Unreachable`] (any host), [`Error::Repo`] with a mismatch
/// (the config contradicts the catalog), [`Error::HostMissing`], [`Error::Busy`],
/// [`Error::Ledger`], [`Error::RolesMissing`] (a role of `app_roles` missing on a host
/// or the catalog's server). Failures part-way ([`Error::Migration`], [`Error::Host`])
/// leave every shard whole, migrated or untouched; run again once fixed.
pub async fn init(
    config: &Config,
    options: &Options,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<Report> {
    crate::moves::unless_catalog_hung(
        config,
        crate::moves::CATALOG_HUNG_AFTER,
        run(config, options, progress, true),
    )
    .await
}

/// `shardline migrate`: applies pending migrations to every shard schema (and installs
/// any missing minter), one transaction per shard, recorded in the shard's ledger; the
/// config's `app_roles` are granted on every shard it changes, in the same transaction
/// (so on the tables a migration creates), and on every shard when the roles changed. A
/// failure in one shard stops the run, names the shard, file and statement, and leaves
/// every shard fully migrated or untouched; a re-run continues.
///
/// # Errors
///
/// As [`init`], and [`shardline_repo::Error::NotInitialised`] before the first `init`;
/// both give up with [`Error::CatalogHung`] once the catalog has answered no probe for
/// 15 s (hung or cut off).
pub async fn migrate(
    config: &Config,
    options: &Options,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<Report> {
    crate::moves::unless_catalog_hung(
        config,
        crate::moves::CATALOG_HUNG_AFTER,
        run(config, options, progress, false),
    )
    .await
}

async fn run(
    config: &Config,
    options: &Options,
    progress: &(dyn Fn(Progress) + Sync),
    init: bool,
) -> Result<Report> {
    // Refused before anything: 0 would give up at once, after `init` made the catalog.
    for (option, value) in [("shard_timeout", options.shard_timeout), ("lock_timeout", options.lock_timeout)]
    {
        if value.is_zero() {
            return Err(Error::InvalidOption { option, message: "must be more than 0".into() });
        }
    }
    if options.jobs_per_host == 0 {
        return Err(Error::InvalidOption { option: "jobs_per_host", message: "must be at least 1".into() });
    }
    let config = &match crate::fleet::resolved(config).await {
        Ok(c) => c,
        // The hosts are checked first, then the catalog (below), which says it.
        Err(Error::Repo(
            shardline_repo::Error::Connect { .. } | shardline_repo::Error::ConnectTimeout { .. },
        )) => config.clone(),
        Err(e) => return Err(e),
    };
    let started = Instant::now();
    let migrations = migrations::load_dir(&config.migrations)?;
    let hosts = connect_all(config, options.jobs_per_host).await?;
    let catalog = if init {
        Catalog::connect(config).await?
    } else {
        let (catalog, _) = Catalog::open(config).await?;
        catalog
    };
    lock(&catalog).await?;
    check_roles(config, &hosts, &catalog, options.shard_timeout).await?;
    let mut report = Report { migrations: migrations.len(), ..Report::default() };
    for w in wal_warnings(&hosts, options.shard_timeout).await? {
        tracing::info!("{w}");
        progress(Progress::Warning(w.clone()));
        report.warnings.push(w);
    }
    if init {
        prepare_catalog(&catalog, config, &mut report).await?;
    }
    let map = catalog.map().await?;
    check_hosts(&map, config)?;
    // A fenced shard's schema is renamed on its host: converging now would build an
    // empty one in its place. Moves finish (or are undone) first.
    if let Some(m) = journal::running(&catalog, None).await?.into_iter().next() {
        return Err(Error::MoveRunning { shard: m.shard });
    }
    let info = catalog.cluster().await?.ok_or(shardline_repo::Error::NotInitialised)?;
    let inputs = Inputs {
        map: &map,
        prefix: &info.schema_prefix,
        layout: info.layout,
        minter: config.minter,
        migrations: &migrations,
        roles: &config.app_roles,
        lock_timeout: options.lock_timeout,
        shard_timeout: options.shard_timeout,
    };

    // `hosts` is in the config's order.
    let plans =
        futures::future::join_all(hosts.iter().zip(&config.hosts).map(|((name, clients), h)| async {
            match clients.first() {
                Some(c) => {
                    converge::bounded(
                        c,
                        &h.url,
                        name,
                        || "reading what its shards need".into(),
                        options.shard_timeout,
                        converge::plan_host(c, name, &inputs),
                    )
                    .await
                }
                None => Ok(HostPlan { host: name.clone(), work: Vec::new(), shards: Vec::new() }),
            }
        }))
        .await
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    // Granted once every host's plan passed: a changed file refused grants nothing.
    grant_catalog(&catalog, config).await?;
    progress(Progress::Planned { shards: plans.iter().map(|p| p.work.len()).sum() });

    let stop = AtomicBool::new(false);
    let finished: Mutex<HashSet<u16>> = Mutex::new(HashSet::new());
    let on_done = |host: &HostName, shard: LogicalShard| {
        if let Ok(mut f) = finished.lock() {
            f.insert(shard.get());
        }
        progress(Progress::ShardDone { host: host.clone(), shard });
    };
    let outcomes = futures::future::join_all(plans.iter().zip(&hosts).zip(&config.hosts).map(
        |((plan, (_, clients)), h)| converge::run_host(plan, &h.url, clients, &inputs, &stop, &on_done),
    ))
    .await;

    let finished = finished.into_inner().unwrap_or_default();
    let pending: HashSet<u16> = plans
        .iter()
        .flat_map(|p| p.work.iter().map(|w| w.shard.get()))
        .filter(|s| !finished.contains(s))
        .collect();
    let recorded = record_states(&catalog, &plans, &pending, &migrations).await;

    let mut first_error = None;
    for (done, error) in outcomes {
        let Done { schemas_created, minters_installed, shards_migrated, migrations_applied, shards_granted } =
            done;
        report.schemas_created += schemas_created;
        report.minters_installed += minters_installed;
        report.shards_migrated += shards_migrated;
        report.migrations_applied += migrations_applied;
        report.shards_granted += shards_granted;
        if first_error.is_none() {
            first_error = error;
        }
    }
    // A shard's failure is the news; a failure to copy states into the catalog comes
    // second (the next run copies them again from the ledgers).
    match (first_error, recorded) {
        (Some(e), Err(r)) => {
            tracing::warn!(error = %r, "could not record the shards' state in the catalog");
            return Err(e);
        }
        (Some(e), Ok(())) | (None, Err(e)) => return Err(e),
        (None, Ok(())) => {}
    }
    report.shards = usize::from(map.count().get());
    report.hosts = map.hosts().len();
    report.map_version = catalog.map().await?.version();
    report.elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    Ok(report)
}

/// Copies each up-to-date shard's state into the catalog (ready, last migration), and
/// records the migration files' checksums. Writes only rows that differ.
async fn record_states(
    catalog: &Catalog,
    plans: &[HostPlan],
    pending: &HashSet<u16>,
    migrations: &[Migration],
) -> Result<()> {
    let ready: Vec<LogicalShard> =
        plans.iter().flat_map(|p| &p.shards).copied().filter(|s| !pending.contains(&s.get())).collect();
    let last: Option<&str> = migrations.last().map(|m| m.name.as_str());
    let files: Vec<(&str, &str)> =
        migrations.iter().map(|m| (m.name.as_str(), m.checksum.as_str())).collect();
    Ok(catalog.record_states(&ready, last, &files).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_logical_wal_level_passes_without_a_warning() {
        let pg1 = HostName::new("pg1").unwrap();
        assert_eq!(wal_warning(&pg1, "logical"), None);
        for level in ["replica", "minimal"] {
            let w = wal_warning(&pg1, level).unwrap();
            assert!(w.starts_with(&format!("host pg1 has wal_level = {level}: moving shards")), "{w}");
        }
    }

    #[test]
    fn a_report_that_changed_nothing_says_so() {
        let r = Report { shards: 8, hosts: 2, migrations: 3, map_version: 4, ..Report::default() };
        assert!(!r.changed());
        assert_eq!(
            r.to_string(),
            "nothing to do: 8 shards on 2 hosts are up to date with 3 migration(s) (map version 4)"
        );
        let r = Report { migrations_applied: 1, shards_migrated: 1, ..r };
        assert!(r.changed());
        assert!(r.to_string().starts_with("applied 1 migration(s) over 1 shard(s)\n"), "{r}");
    }
}
