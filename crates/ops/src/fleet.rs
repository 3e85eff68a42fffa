//! `shardline host`: hosts join and leave a running cluster, and change address.
//!
//! The catalog records each host's address (never its password: see
//! [`shardline_repo::credentials`]); every change here bumps the map version, so running
//! [`shardline_repo::Cluster`] handles open a pool for a host that joined, reconnect to
//! a host that was readdressed, and close the pool of a host that was removed, with no
//! restart and no config change.
//!
//! - [`add`]: registers a host, after connecting to it.
//! - [`drain`]: moves every shard of a host to the other active hosts, lightest first.
//! - [`remove`]: retires a host that holds no shard.
//! - [`readdress`]: records where a host lives now (a failover, new hardware), after
//!   checking that every shard the map places there is there.
//! - [`check_map`], [`repair_map`]: the map against where each shard's schema is on the
//!   hosts (after a catalog was restored from a backup), and the map put right.
//!
//! Every operation also reads hosts from the catalog ([`resolved`]): a host added here
//! needs no entry in the operator's config.

use std::fmt;

use serde::Serialize;
use shardline_repo::Catalog;
use shardline_repo::catalog::{CatalogHost, ClusterInfo, HostState};
use shardline_repo::credentials;
use shardline_router::config::DbUrl;
use shardline_router::{Config, HostName, LogicalShard, ShardMap};

use crate::moves::preflight::host_err;
use crate::moves::{MoveOptions, MoveReport, catalog_watched as bounded, journal};
use crate::rebalance::{Plan, PlannedMove};
use crate::{Error, Result};

/// `config` with every host the catalog knows (and has not removed), each reached at
/// the config's URL when the config lists it, else at its catalog address with a
/// password from the config's `[credentials]`. Each operation starts with it.
///
/// # Errors
///
/// The catalog unreachable; a host's password not to be had; [`Error::CatalogHung`]
/// once the catalog has answered no probe for 15 s.
pub async fn resolved(config: &Config) -> Result<Config> {
    resolved_within(config, crate::moves::CATALOG_HUNG_AFTER).await
}

/// [`resolved`], given up once the catalog has answered no probe for `hung_after` (the
/// caller's own bound: `status`'s `--timeout`, a move's `--hung-after`).
pub(crate) async fn resolved_within(config: &Config, hung_after: std::time::Duration) -> Result<Config> {
    crate::moves::unless_catalog_hung(config, hung_after, async {
        Ok(credentials::with_catalog_hosts(config, &config.credentials).await?)
    })
    .await
}

/// The catalog's shard map and the cluster's fixed parameters, as `shardline map` and
/// `shardline locate` read them.
///
/// # Errors
///
/// The catalog unreachable or not initialised, or contradicting the config;
/// [`Error::CatalogHung`].
pub async fn map(config: &Config) -> Result<(ShardMap, ClusterInfo)> {
    bounded(config, async {
        let (catalog, info) = Catalog::open(config).await?;
        Ok((catalog.map().await?, info))
    })
    .await
}

/// A host as `shardline host list` shows it.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct HostInfo {
    /// Its name.
    pub name: HostName,
    /// `active`, `draining` or `removed`.
    pub state: String,
    /// Its address (no password), or `None` when only the config knows it.
    pub address: Option<String>,
    /// How the other hosts reach it, when not at `address`.
    pub peer_address: Option<String>,
    /// The shards the map places on it.
    pub shards: usize,
}

/// Every host the catalog knows, removed ones included.
///
/// # Errors
///
/// The catalog unreachable or not initialised; [`Error::CatalogHung`].
pub async fn list(config: &Config) -> Result<Vec<HostInfo>> {
    bounded(config, list_within(config)).await
}

async fn list_within(config: &Config) -> Result<Vec<HostInfo>> {
    let (catalog, _) = Catalog::open(config).await?;
    let map = catalog.map().await?;
    Ok(catalog
        .hosts()
        .await?
        .into_iter()
        .map(|h| HostInfo {
            shards: map.shards_of(&h.name).count(),
            state: h.state.to_string(),
            address: h.address.as_ref().map(|a| a.redacted()),
            peer_address: h.peer_address.filter(|p| Some(p) != h.address.as_ref()).map(|a| a.redacted()),
            name: h.name,
        })
        .collect())
}

/// What [`add`] or [`readdress`] did.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct AddressReport {
    /// The host.
    pub host: HostName,
    /// The address recorded (no password).
    pub address: String,
    /// The server's version, as it reported it.
    pub server_version: String,
    /// The map version after the change.
    pub map_version: i64,
}

impl fmt::Display for AddressReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "host {} at {} (PostgreSQL {}); map version {}",
            self.host, self.address, self.server_version, self.map_version
        )
    }
}

/// The URL to reach `name` at `url`: as given when it carries a password, else with
/// one from the config's credentials.
async fn reachable_url(config: &Config, name: &HostName, url: &DbUrl, peer_url: &DbUrl) -> Result<DbUrl> {
    if url.split_password().1.is_some() {
        return Ok(url.clone());
    }
    let host = CatalogHost::new(name.clone(), Some(url.clone()), Some(peer_url.clone()), HostState::Active);
    let mut bare = config.clone();
    bare.hosts.retain(|h| &h.name != name);
    Ok(credentials::host_config(&bare, &config.credentials, &host).await?.url)
}

/// How long a host's few quick checks here may take before it is given up on as hung
/// ([`Error::Timeout`]): the address may be one no config names yet, so no watchdog
/// probes it.
const CHECK_WITHIN: std::time::Duration = crate::moves::CATALOG_HUNG_AFTER;

/// `work` on host `name`, given up as [`Error::Timeout`] after [`CHECK_WITHIN`].
async fn within<T>(
    name: &HostName,
    what: &str,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(CHECK_WITHIN, work).await.map_err(|_| Error::Timeout {
        host: name.clone(),
        what: format!("{what} (the host took the connection and answered nothing: hung?)"),
        after: CHECK_WITHIN,
    })?
}

/// Connects to `url` and checks what every host needs: logical replication (moves
/// copy shards off it) and the config's `app_roles`. Returns the server's version.
/// A host that hangs after it took the connection is given up on after
/// [`CHECK_WITHIN`] (the connection has its own bound).
async fn check_server(
    config: &Config,
    name: &HostName,
    url: &DbUrl,
) -> Result<(tokio_postgres::Client, String)> {
    let c = shardline_repo::catalog::connect(url, &format!("host {name}")).await?;
    let version = within(name, "the server's checks", check_server_on(config, name, &c)).await?;
    Ok((c, version))
}

async fn check_server_on(config: &Config, name: &HostName, c: &tokio_postgres::Client) -> Result<String> {
    let row = c
        .query_one(
            "SELECT current_setting('server_version'), current_setting('wal_level'), pg_is_in_recovery()",
            &[],
        )
        .await
        .map_err(|e| host_err(name, "read the server's settings", &e))?;
    let (version, wal_level, standby): (String, String, bool) = (row.get(0), row.get(1), row.get(2));
    if standby {
        return Err(refused(
            name,
            "the server is a standby (in recovery): a host must take writes; promote it first",
        ));
    }
    if wal_level != "logical" {
        return Err(refused(
            name,
            format!("wal_level is {wal_level}: moves need wal_level = logical on every host"),
        ));
    }
    let roles: Vec<String> = config.app_roles.iter().map(|r| r.as_str().to_owned()).collect();
    let missing = crate::grants::missing_roles(c, &roles)
        .await
        .map_err(|e| host_err(name, "look for the app roles", &e))?;
    if !missing.is_empty() {
        return Err(refused(
            name,
            format!(
                "the app roles {} do not exist on it; create them first (roles are per server)",
                missing.join(", ")
            ),
        ));
    }
    Ok(version)
}

fn refused(host: &HostName, message: impl Into<String>) -> Error {
    Error::Fleet { host: host.clone(), message: message.into() }
}

/// The catalog's record of `name`, refused when it has none.
async fn known(catalog: &Catalog, name: &HostName) -> Result<CatalogHost> {
    let hosts = catalog.hosts().await?;
    hosts
        .into_iter()
        .find(|h| &h.name == name)
        .ok_or_else(|| refused(name, "is not a host of this cluster (`shardline host list` shows them)"))
}

/// Refuses while a move to or from `name` is running: it holds connections made from
/// the host's address.
async fn no_move_on(catalog: &Catalog, name: &HostName, what: &str) -> Result<()> {
    let running = journal::running(catalog, None).await?;
    if let Some(m) = running.iter().find(|m| &m.source == name || &m.target == name) {
        return Err(refused(
            name,
            format!(
                "move {} of shard {} ({} -> {}) is running; {what} once it ends (`shardline move --resume {}` or `--abort {}`)",
                m.id, m.shard, m.source, m.target, m.shard, m.shard
            ),
        ));
    }
    Ok(())
}

/// Registers host `name` at `url` (the config's entry for it when `None`), reached by
/// the other hosts at `peer_url` (default: the config's, else `url`). Connects first:
/// the server must answer, run `wal_level = logical` and have the `app_roles`. A
/// password in the URL is used to connect and never recorded. A removed host comes
/// back this way, and a draining host becomes active again (its drain ends; its
/// recorded address stays). The new host holds no shard until moves place some there
/// (`shardline rebalance`).
///
/// # Errors
///
/// [`Error::Fleet`] when the host is already active, or the server fails a check
/// (unreachable, a standby, `wal_level` below logical, an app role missing); the
/// catalog's [`shardline_repo::catalog::name_clash`] refusal, before any connection to
/// the server; the catalog unreachable; [`Error::CatalogHung`] (whether the host was
/// added then is not known: run it again).
pub async fn add(
    config: &Config,
    name: &HostName,
    url: Option<&DbUrl>,
    peer_url: Option<&DbUrl>,
) -> Result<AddressReport> {
    bounded(config, add_within(config, name, url, peer_url)).await
}

async fn add_within(
    config: &Config,
    name: &HostName,
    url: Option<&DbUrl>,
    peer_url: Option<&DbUrl>,
) -> Result<AddressReport> {
    let (catalog, _) = Catalog::open(config).await?;
    let before = catalog.hosts().await?;
    // Before anything connects: the credentials would hand this name the other host's
    // password.
    if let Some(clash) = shardline_repo::catalog::name_clash(name, &before) {
        return Err(clash.into());
    }
    let existing = before.iter().find(|h| &h.name == name);
    match existing.map(|h| h.state) {
        Some(HostState::Active) => return Err(refused(name, "is already a host of this cluster")),
        // Adding a draining host again ends its drain: moves may target it again. Its
        // address stays as recorded (no URL is needed, the catalog has it): one given
        // here that differs from it is refused, not ignored.
        Some(HostState::Draining) => {
            let recorded = existing.and_then(|h| h.address.as_ref());
            let recorded_peer = existing.and_then(|h| h.peer_address.as_ref()).or(recorded);
            let differs = |given: Option<&DbUrl>, was: Option<&DbUrl>| {
                given.is_some_and(|g| Some(&g.split_password().0) != was)
            };
            if differs(url, recorded) || differs(peer_url, recorded_peer) {
                return Err(refused(
                    name,
                    "is draining at another address: `host add` ends its drain and keeps its recorded address; run it without `--url`/`--peer-url`, or change the address with `host readdress`",
                ));
            }
            catalog.set_host_state(name, HostState::Active).await?;
            tracing::info!(host = %name, "the host's drain ended; it is active again");
            return Ok(AddressReport {
                host: name.clone(),
                address: recorded.map_or_else(String::new, DbUrl::redacted),
                server_version: "(not checked: already a host)".into(),
                map_version: catalog.map_version().await?,
            });
        }
        _ => {}
    }
    let (url, peer_url) = match (url, config.host(name)) {
        (Some(url), _) => (url, peer_url.unwrap_or(url)),
        (None, Some(h)) => (&h.url, peer_url.unwrap_or(&h.peer_url)),
        (None, None) => {
            return Err(refused(name, "give its URL (`--url`), or list it in the config's [[hosts]]"));
        }
    };
    let connect_url = reachable_url(config, name, url, peer_url).await?;
    let (_, server_version) = check_server(config, name, &connect_url).await?;
    if existing.is_some() {
        catalog.set_address(name, url, peer_url).await?;
        catalog.set_host_state(name, HostState::Active).await?;
    } else {
        catalog.add_host(name, url, peer_url).await?;
    }
    tracing::info!(host = %name, address = %url.split_password().0, "host added");
    Ok(AddressReport {
        host: name.clone(),
        address: url.split_password().0.redacted(),
        server_version,
        map_version: catalog.map_version().await?,
    })
}

/// Records that host `name` now lives at `url` (reached by the other hosts at
/// `peer_url`, default `url`). Connects first, and refuses unless every shard the map
/// places on the host has its schema there: pointing a host at a server without its
/// shards would send their reads and writes nowhere. Running handles reconnect there on
/// the map change.
///
/// # Errors
///
/// [`Error::Fleet`] for an unknown or removed host, a running move to or from it, or a
/// server missing the host's shards; the catalog or the server unreachable;
/// [`Error::CatalogHung`] (whether the address was recorded then is not known).
pub async fn readdress(
    config: &Config,
    name: &HostName,
    url: &DbUrl,
    peer_url: Option<&DbUrl>,
) -> Result<AddressReport> {
    bounded(config, readdress_within(config, name, url, peer_url)).await
}

async fn readdress_within(
    config: &Config,
    name: &HostName,
    url: &DbUrl,
    peer_url: Option<&DbUrl>,
) -> Result<AddressReport> {
    let peer_url = peer_url.unwrap_or(url);
    let (catalog, _) = Catalog::open(config).await?;
    let host = known(&catalog, name).await?;
    if host.state == HostState::Removed {
        return Err(refused(name, "was removed; `shardline host add` brings it back"));
    }
    no_move_on(&catalog, name, "readdress it").await?;
    let connect_url = reachable_url(config, name, url, peer_url).await?;
    let (client, server_version) = check_server(config, name, &connect_url).await?;
    let map = catalog.map().await?;
    let schemas: Vec<String> =
        map.shards_of(name).map(|s| config.schema_prefix.schema(s).as_str().to_owned()).collect();
    let look = async {
        client
            .query(
                "SELECT s FROM unnest($1::text[]) AS s WHERE NOT EXISTS (SELECT FROM pg_namespace WHERE nspname = s) ORDER BY s",
                &[&schemas],
            )
            .await
            .map_err(|e| host_err(name, "look for the host's shards", &e))
    };
    let missing: Vec<String> =
        within(name, "a look for the host's shards", look).await?.iter().map(|r| r.get(0)).collect();
    if !missing.is_empty() {
        let shown: Vec<&str> = missing.iter().take(5).map(String::as_str).collect();
        return Err(refused(
            name,
            format!(
                "the server at {} lacks {} of the {} shard schema(s) the map places on this host ({}{}); nothing was changed",
                url.split_password().0,
                missing.len(),
                schemas.len(),
                shown.join(", "),
                if missing.len() > shown.len() { ", ..." } else { "" }
            ),
        ));
    }
    match catalog.set_address(name, url, peer_url).await {
        Ok(_) => {}
        // A move was journaled onto or off it after the check above.
        Err(shardline_repo::Error::InvalidCatalog { reason }) => return Err(refused(name, reason)),
        Err(e) => return Err(e.into()),
    }
    if let Some(entry) = config.host(name)
        && !credentials::same_address(&entry.url, url)
    {
        tracing::warn!(host = %name, "the config lists this host at another URL: handles made from it keep using the config's URL; update the config");
    }
    tracing::info!(host = %name, address = %url.split_password().0, "host readdressed");
    Ok(AddressReport {
        host: name.clone(),
        address: url.split_password().0.redacted(),
        server_version,
        map_version: catalog.map_version().await?,
    })
}

/// What [`drain`] did.
#[derive(Debug)]
#[non_exhaustive]
pub struct DrainReport {
    /// The host.
    pub host: HostName,
    /// The moves planned.
    pub plan: Plan,
    /// Each move's outcome, in plan order.
    pub moves: Vec<(PlannedMove, Result<MoveReport>)>,
    /// Shards the host still holds (0: it can be removed); `None` when the catalog
    /// could not be read once the moves ended (the moves' outcomes stand).
    pub remaining: Option<usize>,
}

impl DrainReport {
    /// Whether the host is empty: every move done and none of its shards left. False
    /// also when a shard is left though no move failed (a move onto the host that was
    /// under way when the drain began), or when the catalog could not be read after the
    /// moves.
    pub fn drained(&self) -> bool {
        self.remaining == Some(0) && self.moves.iter().all(|(_, r)| r.is_ok())
    }
}

impl fmt::Display for DrainReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ok = self.moves.iter().filter(|(_, r)| r.is_ok()).count();
        match self.remaining {
            Some(0) => write!(
                f,
                "host {} drained: {ok} move(s) done; `shardline host remove {}` retires it",
                self.host, self.host
            ),
            Some(n) => write!(
                f,
                "host {} still holds {n} shard(s) ({ok} of {} move(s) done); run `shardline host drain {}` again",
                self.host,
                self.moves.len(),
                self.host
            ),
            None => write!(
                f,
                "host {}: {ok} of {} move(s) done, and the catalog could not be read after them; run `shardline host drain {}` again to see what it still holds",
                self.host,
                self.moves.len(),
                self.host
            ),
        }
    }
}

/// The moves that empty `host`: its shards, heaviest first, each to the active host
/// lightest at that point (by bytes, then shards). Pure.
pub fn plan_drain(
    host: &HostName,
    sizes: &std::collections::BTreeMap<HostName, Vec<(LogicalShard, i64)>>,
) -> Plan {
    let mut leaving: Vec<(LogicalShard, i64)> = sizes.get(host).cloned().unwrap_or_default();
    leaving.sort_by_key(|(s, b)| (std::cmp::Reverse(*b), s.get()));
    let mut load: std::collections::BTreeMap<&HostName, (usize, i64)> = sizes
        .iter()
        .filter(|(h, _)| *h != host)
        .map(|(h, s)| (h, (s.len(), s.iter().map(|x| x.1).sum())))
        .collect();
    let mut moves = Vec::new();
    for (shard, bytes) in leaving {
        let Some(to) = load.iter().min_by_key(|(h, (n, b))| (*b, *n, **h)).map(|(h, _)| *h) else { break };
        if let Some(l) = load.get_mut(to) {
            l.0 += 1;
            l.1 += bytes;
        }
        moves.push(PlannedMove { shard, from: host.clone(), to: to.clone(), bytes });
    }
    let moved = moves.len();
    let hosts = sizes
        .iter()
        .map(|(h, s)| {
            let (after_n, after_b) = if h == host {
                (
                    s.len() - moved,
                    s.iter().map(|x| x.1).sum::<i64>() - moves.iter().map(|m| m.bytes).sum::<i64>(),
                )
            } else {
                load.get(h).copied().unwrap_or((s.len(), 0))
            };
            crate::rebalance::HostLoad {
                host: h.clone(),
                shards_before: s.len(),
                bytes_before: s.iter().map(|x| x.1).sum(),
                shards_after: after_n,
                bytes_after: after_b,
            }
        })
        .collect();
    Plan { moves, hosts }
}

/// Marks `name` draining (no move targets it from then on, and `rebalance` leaves it
/// out), then moves each of its shards to the other active hosts, `parallel` at a
/// time, each an online move as `shardline move` runs it. Run it again after a failed
/// move: it plans what is left. With `dry_run`, plans and changes nothing.
///
/// # Errors
///
/// [`Error::Fleet`] for an unknown or removed host, or no active host to take its
/// shards; the catalog or a host unreachable (sizes are read from each). A failed
/// move is reported in [`DrainReport::moves`], not as an error.
pub async fn drain(
    config: &Config,
    name: &HostName,
    parallel: usize,
    options: &MoveOptions,
    dry_run: bool,
) -> Result<DrainReport> {
    let given = config;
    let config = &resolved_within(config, options.hung_after).await?;
    // The catalog's part before the moves, bounded as theirs is.
    let (plan, held) =
        crate::moves::unless_catalog_hung(config, options.hung_after, drain_plan(config, name, !dry_run))
            .await?;
    if dry_run {
        return Ok(DrainReport { host: name.clone(), plan, moves: Vec::new(), remaining: Some(held) });
    }
    // The config as given: each move reads the hosts' addresses from the catalog when it
    // starts (a drain may take hours, and a host be readdressed meanwhile).
    let moves =
        crate::rebalance::apply(given, &plan, crate::rebalance::Parallel::shared(parallel), options).await;
    // The moves may have taken hours: a connection of their start's may be long gone
    // (the catalog restarted, an idle link dropped). A new one, bounded as the moves'
    // catalog reads are; when it fails, the moves' outcomes are reported all the same.
    let left = crate::moves::unless_catalog_hung(config, options.hung_after, async {
        let (catalog, _) = Catalog::open(config).await?;
        Ok(catalog.map().await?.shards_of(name).count())
    })
    .await;
    let remaining = left
        .inspect_err(|e| {
            tracing::warn!(host = %name, error = %shardline_repo::error_chain(e), "cannot read what the host still holds after its moves");
        })
        .ok();
    Ok(DrainReport { host: name.clone(), plan, moves, remaining })
}

/// [`drain`]'s plan and how many shards the host holds, from the catalog and the hosts'
/// sizes; with `mark`, the host marked draining (so no move targets it from then on).
async fn drain_plan(config: &Config, name: &HostName, mark: bool) -> Result<(Plan, usize)> {
    let (catalog, _) = Catalog::open(config).await?;
    let host = known(&catalog, name).await?;
    if host.state == HostState::Removed {
        return Err(refused(name, "was removed: it holds no shard"));
    }
    let sizes = crate::rebalance::sizes_of(config, &catalog, |s| s != HostState::Removed).await?;
    let states = catalog.hosts().await?;
    let mut targets = sizes.clone();
    targets.retain(|h, _| h == name || states.iter().any(|s| &s.name == h && s.state == HostState::Active));
    let plan = plan_drain(name, &targets);
    let holds = sizes.get(name).is_some_and(|s| !s.is_empty());
    if holds && !targets.keys().any(|h| h != name) {
        return Err(refused(
            name,
            "no other active host can take its shards; `shardline host add` one first",
        ));
    }
    if mark && host.state != HostState::Draining {
        catalog.set_host_state(name, HostState::Draining).await?;
        tracing::info!(host = %name, shards = plan.moves.len(), "host draining");
    }
    Ok((plan, sizes.get(name).map_or(0, Vec::len)))
}

/// Retires `name`: refused while it holds a shard or a move to or from it runs. Running
/// handles close its pool on the map change. Its row stays in the catalog (the journal
/// of moves names it), marked removed; `shardline host add` brings it back.
///
/// # Errors
///
/// [`Error::Fleet`] naming why it cannot go; the catalog unreachable;
/// [`Error::CatalogHung`] (whether it was removed then is not known).
pub async fn remove(config: &Config, name: &HostName) -> Result<i64> {
    bounded(config, remove_within(config, name)).await
}

async fn remove_within(config: &Config, name: &HostName) -> Result<i64> {
    let (catalog, _) = Catalog::open(config).await?;
    let host = known(&catalog, name).await?;
    if host.state == HostState::Removed {
        return Err(refused(name, "was already removed"));
    }
    no_move_on(&catalog, name, "remove it").await?;
    let held = catalog.map().await?.shards_of(name).count();
    if held > 0 {
        return Err(refused(
            name,
            format!("still holds {held} shard(s); `shardline host drain {name}` moves them off first"),
        ));
    }
    match catalog.set_host_state(name, HostState::Removed).await {
        Ok(_) => {}
        // A move flipped a shard onto it between the two reads.
        Err(shardline_repo::Error::InvalidCatalog { reason }) => return Err(refused(name, reason)),
        Err(e) => return Err(e.into()),
    }
    tracing::info!(host = %name, "host removed");
    Ok(catalog.map_version().await?)
}

/// A shard whose map entry and the hosts' servers disagree, as [`check_map`] found it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[non_exhaustive]
pub struct Misplaced {
    /// The shard.
    pub shard: LogicalShard,
    /// Its schema.
    pub schema: String,
    /// Where the map places it.
    pub map_host: HostName,
    /// The hosts whose servers hold its schema under its own name (an old copy a move
    /// left, `<schema>_moved_<id>`, does not count), in the config's order; empty when
    /// no server read holds it.
    pub found_on: Vec<HostName>,
    /// A move of it is running in the catalog's journal (its target holds the schema
    /// too until the move ends: `shardline move --resume` or `--abort` ends it).
    pub moving: bool,
    /// Why [`repair_map`] left it as it is (`None` from [`check_map`]).
    pub left: Option<String>,
}

/// A host [`check_map`] could not read.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[non_exhaustive]
pub struct Unread {
    /// The host.
    pub host: HostName,
    /// Why.
    pub error: String,
}

/// A shard [`repair_map`] placed where its schema is.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[non_exhaustive]
pub struct Replaced {
    /// The shard.
    pub shard: LogicalShard,
    /// Where the map had it.
    pub from: HostName,
    /// Where its schema is, and the map now has it.
    pub to: HostName,
}

/// The catalog's shard map against where each shard's schema is on the hosts'
/// servers: what `shardline map --check` and `--repair` print.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[non_exhaustive]
pub struct MapCheck {
    /// The map's version when read, and after a repair.
    pub map_version: i64,
    /// The hosts read: every host the catalog has not removed (a config's host the
    /// catalog removed is not read).
    pub hosts_read: Vec<HostName>,
    /// The hosts that could not be read: the shards the map places there are not
    /// judged (unless found elsewhere), and nothing is repaired.
    pub unread: Vec<Unread>,
    /// The shards whose schema is not where the map places them (after a repair: the
    /// ones it left).
    pub misplaced: Vec<Misplaced>,
    /// What a repair changed.
    pub replaced: Vec<Replaced>,
}

impl MapCheck {
    /// Whether every host was read and every shard's schema is where the map places it.
    pub fn agrees(&self) -> bool {
        self.unread.is_empty() && self.misplaced.is_empty()
    }
}

impl fmt::Display for MapCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for r in &self.replaced {
            writeln!(
                f,
                "shard {}: the map had it on {}, its schema is on {}: placed there",
                r.shard, r.from, r.to
            )?;
        }
        for u in &self.unread {
            writeln!(f, "host {}: not read: {}", u.host, u.error)?;
        }
        for m in &self.misplaced {
            let found: Vec<&str> = m.found_on.iter().map(HostName::as_str).collect();
            let found = if found.is_empty() { "no host read".to_owned() } else { found.join(", ") };
            write!(
                f,
                "shard {} ({}): the map places it on {}, its schema is on {found}",
                m.shard, m.schema, m.map_host
            )?;
            if m.moving {
                f.write_str(" (a move of it is running)")?;
            }
            if let Some(why) = &m.left {
                write!(f, "; left: {why}")?;
            }
            writeln!(f)?;
        }
        write!(
            f,
            "map version {}: {} host(s) read, {} not; {} shard(s) misplaced, {} placed where their schema is",
            self.map_version,
            self.hosts_read.len(),
            self.unread.len(),
            self.misplaced.len(),
            self.replaced.len()
        )
    }
}

/// Reads the catalog's shard map and every host's server (each within `timeout`), and
/// lists the shards whose schema is not where the map places it: what a catalog
/// restored from a backup taken before a move shows (docs/operations.md, "The
/// catalog"). Changes nothing.
///
/// # Errors
///
/// The catalog unreachable or not initialised; [`Error::CatalogHung`] once it has
/// answered no probe for `timeout` (2 s at least). An unreachable host is
/// [`MapCheck::unread`], not an error.
pub async fn check_map(config: &Config, timeout: std::time::Duration) -> Result<MapCheck> {
    crate::moves::unless_catalog_hung(config, timeout, map_against_hosts(config, timeout, false)).await
}

/// [`check_map`], then places each misplaced shard on the one host whose server holds
/// its schema, when exactly one does, no move of it is running, and the catalog knows
/// that host and has not removed it; the others are left, each saying why. Each shard
/// placed bumps the map version and notifies running handles (a handle that holds a
/// newer version than the catalog's ignores it: restart those, as after any restore).
///
/// # Errors
///
/// As [`check_map`]; [`Error::Fleet`] naming a host that could not be read (the map
/// is repaired only when every host was read: nothing is changed).
pub async fn repair_map(config: &Config, timeout: std::time::Duration) -> Result<MapCheck> {
    crate::moves::unless_catalog_hung(config, timeout, map_against_hosts(config, timeout, true)).await
}

async fn map_against_hosts(config: &Config, timeout: std::time::Duration, repair: bool) -> Result<MapCheck> {
    use std::collections::{HashMap, HashSet};
    let config = &resolved_within(config, timeout).await?;
    let (catalog, info) = Catalog::open(config).await?;
    if repair {
        // `gc`'s lock, held to the end: no `gc` drops a copy, and no move is journaled,
        // between what is read below and the map's changes.
        catalog.lock_for_gc().await?;
    }
    let map = catalog.map().await?;
    let moving: HashSet<LogicalShard> =
        journal::running(&catalog, None).await?.iter().map(|m| m.shard).collect();
    let live: Vec<HostName> = catalog
        .hosts()
        .await?
        .into_iter()
        .filter(|h| h.state != HostState::Removed)
        .map(|h| h.name)
        .collect();
    let shards: Vec<LogicalShard> = map.count().shards().collect();
    let schemas: Vec<String> =
        shards.iter().map(|&s| info.schema_prefix.schema(s).as_str().to_owned()).collect();
    // Each host's shard schemas, by name, and whether a move's guards still refuse
    // writes to the copy's tables (a copy no flip has made the shard's yet: see
    // `REVERT_GUARD`). A guard the flip left for `gc` lets writes through once its move's
    // marker on that host says `flip`: it does not count.
    let reads = futures::future::join_all(config.hosts.iter().map(|h| {
        let schemas = &schemas;
        async move {
            let read = async {
                let client = shardline_repo::catalog::connect(&h.url, &format!("host {}", h.name))
                    .await
                    .map_err(|e| shardline_repo::error_chain(&e))?;
                let err = |e: tokio_postgres::Error| {
                    shardline_repo::error_chain(&host_err(&h.name, "list the shard schemas", &e))
                };
                // The guard's one argument is its move's ID (`tgargs`: each argument
                // followed by a NUL byte, which `escape` spells `\000`).
                let rows = client
                    .query(
                        r"SELECT n.nspname::text,
                                 coalesce((SELECT array_agg(DISTINCT split_part(encode(t.tgargs, 'escape'), '\000', 1))
                                             FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
                                            WHERE c.relnamespace = n.oid AND t.tgname = $2), '{}')
                            FROM pg_namespace n WHERE n.nspname = ANY($1)",
                        &[schemas, &shardline_repo::REVERT_GUARD],
                    )
                    .await
                    .map_err(err)?;
                let mut found: HashMap<String, Vec<String>> =
                    rows.iter().map(|r| (r.get::<_, String>(0), r.get::<_, Vec<String>>(1))).collect();
                let moves: Vec<String> = found.values().flatten().cloned().collect();
                let marks = !moves.is_empty()
                    && client
                        .query_one("SELECT to_regclass('shardline.move_marks') IS NOT NULL", &[])
                        .await
                        .map_err(err)?
                        .get::<_, bool>(0);
                if marks {
                    let flipped: Vec<String> = client
                        .query(
                            "SELECT m.move_id::text FROM shardline.move_marks m
                              WHERE m.decided = 'flip' AND m.move_id::text = ANY($1)",
                            &[&moves],
                        )
                        .await
                        .map_err(err)?
                        .iter()
                        .map(|r| r.get(0))
                        .collect();
                    for guards in found.values_mut() {
                        guards.retain(|m| !flipped.contains(m));
                    }
                }
                Ok::<_, String>(
                    found.into_iter().map(|(schema, refusing)| (schema, !refusing.is_empty())).collect::<HashMap<_, _>>(),
                )
            };
            let found = match tokio::time::timeout(timeout, read).await {
                Ok(found) => found,
                Err(_) => Err(format!("no answer within {timeout:?}")),
            };
            (h.name.clone(), found)
        }
    }))
    .await;
    let (mut read, mut unread) = (Vec::new(), Vec::new());
    for (host, found) in reads {
        match found {
            Ok(found) => read.push((host, found)),
            Err(error) => unread.push(Unread { host, error }),
        }
    }
    // A host the catalog lists that could not be put in the config (no address recorded
    // and none in the config, or no password for it) was not read either.
    for host in &live {
        if config.host(host).is_none() {
            unread.push(Unread {
                host: host.clone(),
                error: "no address to reach it (none recorded in the catalog, none in the config) or no \
                        password for it"
                    .into(),
            });
        }
    }
    let mut misplaced = Vec::new();
    for (&shard, schema) in shards.iter().zip(&schemas) {
        let map_host = map.host_of(shard);
        let found_on: Vec<HostName> =
            read.iter().filter(|(_, found)| found.contains_key(schema)).map(|(h, _)| h.clone()).collect();
        let map_host_read = read.iter().any(|(h, _)| h == map_host);
        // Where the map's host was not read, only a copy found elsewhere says anything.
        if found_on.as_slice() == std::slice::from_ref(map_host) || (!map_host_read && found_on.is_empty()) {
            continue;
        }
        misplaced.push(Misplaced {
            shard,
            schema: schema.clone(),
            map_host: map_host.clone(),
            found_on,
            moving: moving.contains(&shard),
            left: None,
        });
    }
    let mut replaced = Vec::new();
    if repair && !misplaced.is_empty() {
        if let Some(u) = unread.first() {
            return Err(refused(
                &u.host,
                format!(
                    "could not be read ({}): the map is repaired only when every host is read; nothing was changed",
                    u.error
                ),
            ));
        }
        let guarded = |host: &HostName, schema: &str| {
            read.iter().any(|(h, found)| h == host && found.get(schema) == Some(&true))
        };
        let mut left = Vec::new();
        for mut m in misplaced {
            let why = match m.found_on.as_slice() {
                _ if m.moving => Some(
                    "a move of it is running in the journal; after a restore the journal may be older than the \
                     hosts: see which copy is the shard's before `shardline move --resume` or `--abort`"
                        .to_owned(),
                ),
                [] => Some("no host holds its schema".to_owned()),
                [to] if !live.contains(to) => Some(format!(
                    "host {to} is not an active or draining host of the catalog (`shardline host add {to}` first)"
                )),
                [to] if guarded(to, &m.schema) => Some(format!(
                    "the copy on {to} is still guarded by a move that never flipped (its tables refuse writes): \
                     not the shard's (see `shardline moves`)"
                )),
                [to] => match catalog.flip_shard(m.shard, &m.map_host, to).await {
                    Ok(1) => {
                        tracing::warn!(shard = %m.shard, from = %m.map_host, to = %to, "the map placed the shard where its schema is");
                        replaced.push(Replaced { shard: m.shard, from: m.map_host.clone(), to: to.clone() });
                        None
                    }
                    Ok(_) => Some("the map changed meanwhile".to_owned()),
                    Err(e) => Some(format!("the catalog refused: {}", shardline_repo::error_chain(&e))),
                },
                _ => Some("several hosts hold its schema: keep the shard's copy, drop or rename the others".to_owned()),
            };
            if why.is_some() {
                m.left = why;
                left.push(m);
            }
        }
        misplaced = left;
    }
    Ok(MapCheck {
        map_version: catalog.map_version().await?,
        hosts_read: read.into_iter().map(|(h, _)| h).collect(),
        unread,
        misplaced,
        replaced,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use shardline_router::ShardCount;

    use super::*;

    #[test]
    fn a_drain_is_done_only_when_the_host_is_known_to_be_empty() {
        let h = HostName::new("pg1").unwrap_or_else(|_| unreachable!());
        let report = |remaining| DrainReport {
            host: h.clone(),
            plan: Plan { moves: Vec::new(), hosts: Vec::new() },
            moves: Vec::new(),
            remaining,
        };
        assert!(report(Some(0)).drained());
        // No move failed, but a shard is left (a move onto the host finished meanwhile),
        // or what is left could not be read.
        assert!(!report(Some(1)).drained());
        assert!(!report(None).drained());
        assert!(report(None).to_string().contains("the catalog could not be read after them"));
    }

    #[test]
    fn a_drain_sends_the_heaviest_shards_to_the_lightest_hosts() {
        let count = ShardCount::new(12).unwrap_or_else(|_| unreachable!());
        let h = |n: &str| HostName::new(n).unwrap_or_else(|_| unreachable!());
        let s = |i: i64| LogicalShard::new(i, count).unwrap_or_else(|_| unreachable!());
        let mut sizes = BTreeMap::new();
        sizes.insert(h("a"), vec![(s(0), 500), (s(1), 100), (s(2), 300), (s(3), 100)]);
        sizes.insert(h("b"), vec![(s(4), 400)]);
        sizes.insert(h("c"), vec![(s(5), 100)]);
        let plan = plan_drain(&h("a"), &sizes);
        let got: Vec<(i64, &str)> =
            plan.moves.iter().map(|m| (i64::from(m.shard.get()), m.to.as_str())).collect();
        // Heaviest first, each to the host lightest then (bytes, then shard count):
        // 500 -> c (100), 300 -> b (400), 100 -> c (600), 100 -> b (700, 2 shards).
        assert_eq!(got, [(0, "c"), (2, "b"), (1, "c"), (3, "b")], "{plan}");
        let a = plan.hosts.iter().find(|l| l.host == "a").map(|l| (l.shards_after, l.bytes_after));
        assert_eq!(a, Some((0, 0)), "{plan}");
        let total: i64 = plan.hosts.iter().map(|l| l.bytes_after).sum();
        assert_eq!(total, 1500, "{plan}");
        // Nobody else to take them: nothing planned.
        let mut alone = BTreeMap::new();
        alone.insert(h("a"), vec![(s(0), 1)]);
        assert!(plan_drain(&h("a"), &alone).moves.is_empty());
    }
}
