//! The cluster handle applications hold: the shard map from the catalog, one connection
//! pool per physical host, and the routes between them.
//!
//! Where each host lives comes from the config when it lists the host, else from the
//! catalog (with a password from the application's [`Credentials`]): pools follow hosts
//! that join, are readdressed and leave, with the map.
//!
//! The map is read once at [`Cluster::connect`] and then kept fresh two ways: a task
//! `LISTEN`s for the catalog's `NOTIFY shardline_map` and reloads it, and a statement
//! that reaches a shard that is not where the map said (its schema is missing there)
//! reloads it and, if the shard now lives elsewhere, runs once more there.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock, Weak};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use shardline_id::{Id, Layout};
use shardline_router::{Config, HostName, LogicalShard, Route, SchemaPrefix, ShardMap};
use tokio::sync::Mutex;

use crate::catalog::{self, Catalog, CatalogHost, HostState, MapListener};
use crate::credentials::{self, Credentials};
use crate::{Error, Result};

/// How often a statement waiting on a fenced shard asks the source to resolve the
/// fence (see [`Cluster::wait_for_move`]).
const RESOLVE_EVERY: Duration = Duration::from_secs(1);

/// How long a host whose pool could not be made is left alone before it is tried again.
const RETRY_POOL_AFTER: Duration = Duration::from_secs(5);

/// How a [`Cluster`] connects and waits.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Connections per host, at most (default 16). One pool per host, never per shard.
    /// Each connection pays again for every shard it touches (catalog entries, plans):
    /// with many shards per host, size it for the host's cores rather than for the
    /// application's concurrency (`docs/operations.md`, "Connections per host").
    /// A connection given up on (its statement ran out of time) stays counted until its
    /// statement was cancelled; one whose server does not answer within about a minute
    /// leaves the pool, and its socket stays open until the server answers or the link
    /// breaks.
    pub pool_size: usize,
    /// How long to wait for a new connection (default 5 s): for each server of a URL
    /// that lists several (a primary and its standbys, tried in turn), and once more for
    /// the start-up.
    pub connect_timeout: Duration,
    /// How long a statement may take on one host before the caller gets
    /// [`Error::Timeout`] (default 5 s). A hung host costs this, never more, per round
    /// trip to it: a fan-out of the newest rows reads a host a second time when one of
    /// its statements may hold more of the page ([`crate::Repo::created_between`]).
    pub host_timeout: Duration,
    /// How many hosts a fan-out queries at once (default 16).
    pub fan_out: usize,
    /// Shards per statement of a fan-out ([`crate::Repo::created_between`],
    /// [`crate::Repo::get_many`]) (default 16). A host's shards are read in statements
    /// of at most this many shards, each its own implicit transaction, pipelined on one
    /// connection: a statement locks every table it names and the table's indexes until
    /// it ends, and Postgres's shared lock table holds only
    /// `max_locks_per_transaction` (64 by default) × `max_connections` (and background
    /// processes) locks for the whole server. One statement over a host's ~700 shards
    /// (table, primary key and one index each: ~2,100 locks) would let a few concurrent
    /// fan-outs fill it, and then every query on the host fails with "out of shared
    /// memory" (SQLSTATE 53200). With 16 shards of 3 relations a statement holds 48
    /// locks at most. See `docs/operations.md`, "Lock table".
    pub fan_out_batch: usize,
    /// Reload the map on the catalog's `NOTIFY` (default true), and check the catalog's
    /// map version every [`ClusterOptions::map_check`] in case a notification was lost.
    /// When false, the handle reloads the map only when a statement finds its shard
    /// moved, or on [`Cluster::refresh`].
    pub listen: bool,
    /// With `listen`: how often the catalog's map version is read (one small query),
    /// to catch a change whose notification never arrived (default 5 s). A `LISTEN`
    /// through a transaction-mode pooler succeeds but receives nothing, and nothing
    /// reports it: this check bounds how long a handle can hold an old map to about
    /// `map_check` plus one catalog round trip, and logs a warning when it finds one.
    /// Zero turns the check off.
    pub map_check: Duration,
    /// Whether the hosts' URLs reach Postgres through a transaction-mode pooler
    /// (PgBouncer's `pool_mode = transaction`). `Some(true)`: they do; `Some(false)`:
    /// they reach it directly or through a session-mode pool; `None` (the default, and
    /// what the config's `transaction_pooler` key left out gives): each host is found
    /// out on each new connection, before anything runs on it: a connection whose
    /// server process is not the one its start-up named (`pg_backend_pid()` against
    /// the cancel key) is behind a pooler, and the host is then treated as behind a
    /// transaction-mode one for the life of its pool (a readdressed host gets a new
    /// pool, found out anew) ([`Cluster::behind_pooler`]; a warning says so once). The config's key, when given, wins over `None`, and
    /// `true` over `false`.
    ///
    /// Behind a transaction pooler shardline keeps no prepared statement across
    /// transactions ([`ClusterOptions::statement_cache`] is ignored): a table with a
    /// column whose type lives in the shard's schema (an enum) is refused with
    /// [`Error::Pooler`], as is the sqlx path, and a statement that finds a prepared
    /// statement missing or taken is reported as a pooler's doing. Say `Some(false)`
    /// for a session-mode pool, which cannot be told apart from a transaction-mode
    /// one. See `docs/operations.md`, "Behind PgBouncer".
    pub transaction_pooler: Option<bool>,
    /// Statements of one shard (a get, an insert, a page...) kept prepared per
    /// connection, at most (default 0: each is unnamed, and none outlives it). Only for
    /// hosts reached directly or through a session-mode pool: a kept statement behind a
    /// transaction-mode pooler can be run by another client (another shard's statement
    /// of the same name) or be missing, so none is kept on a host
    /// [`Cluster::behind_pooler`]. A kept statement saves the server parsing and
    /// planning each call (a get by ID: 1.58–1.80× the latency of a prepared statement
    /// without it, 1.10× with it, observed in `docs/benchmarks.md`), and costs a round
    /// trip more the first time a connection sends it; it is one per statement shape
    /// and shard, about 12 KB each on the server, so past this many, fan-outs' statements
    /// included, the connection's cache is emptied and starts again: at most
    /// `pool_size × statement_cache` per host and process. Set it to four per batch of
    /// the shards at least (500 at 2000 shards in batches of 16), or fan-outs of a few
    /// shapes empty each other's.
    pub statement_cache: usize,
    /// Each fan-out's statements (one per batch of a host's shards,
    /// [`ClusterOptions::fan_out_batch`], one `UNION ALL` branch per shard) kept
    /// prepared on their connection (default true), on hosts reached directly: the
    /// server then reuses a generic plan instead of parsing and planning every shard's
    /// branch on each call. At 2000 shards over 4 hosts a time window took 15.7 ms
    /// (p50) kept against 61.0 ms unnamed, and 5.1 against 28.2 ms of server CPU per
    /// host (observed, `docs/benchmarks.md`, "Fan-outs kept by default"). They count
    /// toward [`ClusterOptions::statement_cache`]'s bound; without one, a connection
    /// keeps at most 256 or four per batch of all the cluster's shards (500 at 2000
    /// shards in batches of 16), whichever is more: room for a few shapes of fan-out
    /// on a host that held every shard. Never behind a transaction pooler
    /// ([`Cluster::behind_pooler`]).
    pub fan_out_prepared: bool,
    /// With [`ClusterOptions::statement_cache`] or [`ClusterOptions::fan_out_prepared`]:
    /// each connection of the repository's
    /// pools runs with `plan_cache_mode = force_generic_plan` (default false), so a kept
    /// statement is planned once per connection instead of on each of its first five
    /// runs. A fan-out's statement of a batch of shards costs a plan of every branch on
    /// each of those runs, paid again by every new pooled connection: with batches of 64
    /// this brings the demo's time window from 134–164 ms to 52–76 ms (p50, observed in
    /// `docs/benchmarks.md`, "The demo's mix"). The setting is the session's: it also
    /// applies to SQL run on these connections by [`crate::ShardTx`] or
    /// [`Cluster::client`], and to the PL/pgSQL functions and triggers they call. A plan
    /// made once for every value gives up what a plan made for the value can do: an index
    /// for one very common value of a skewed column (a page of one user with most rows),
    /// a prefix `LIKE $1`, partitions pruned at planning. Not set on `Cluster::sqlx`'s
    /// pools; ignored when nothing is kept, or behind a transaction pooler. A
    /// `RESET ALL` or `DISCARD ALL` run on a connection takes it away for that
    /// connection's life.
    pub generic_plans: bool,
    /// How long a pooled connection is kept, at most (default 30 min; `None`: for
    /// ever). A server backend keeps the catalog entries of every table and index it
    /// has opened until it ends, and a pooled connection that serves fan-outs opens every
    /// shard of its host: its memory grows with the shards (see `docs/operations.md`,
    /// "Lock table"). A connection past this age is closed when it is next handed out,
    /// or, while it sits idle, at the next of the handle's looks, made every quarter of
    /// this age (at least 250 ms apart, at most a minute), and a new one is made on
    /// demand.
    pub connection_max_lifetime: Option<Duration>,
    /// How many times a pooled connection is handed out, at most (default `None`: no
    /// bound); past it, it is closed when it comes back to the pool. As
    /// [`ClusterOptions::connection_max_lifetime`], by use rather than by age.
    pub connection_max_uses: Option<usize>,
    /// How long a statement that finds its shard fenced (a move is flipping it to
    /// another host) waits for the new map before it gives up (default 20 s). The
    /// fence normally lasts well under a second; a fence whose mover died is
    /// resolved once its lease runs out (`MoveOptions::lease`, 10 s by default), so
    /// keep this above the lease plus 5 s.
    pub move_wait: Duration,
}

/// The longest time any option of [`ClusterOptions`] may give (30 days): added to the
/// clock, a longer one (`Duration::MAX` for "no limit", say) would overflow it.
pub const LONGEST_OPTION: Duration = Duration::from_secs(30 * 86_400);

/// The most connections per host [`ClusterOptions::pool_size`] may ask for.
pub const MOST_CONNECTIONS: usize = 10_000;

impl ClusterOptions {
    /// Refuses options that cannot be used, naming the first: a time over
    /// [`LONGEST_OPTION`], a pool over [`MOST_CONNECTIONS`].
    fn check(&self) -> Result<()> {
        let times = [
            ("connect_timeout", Some(self.connect_timeout)),
            ("host_timeout", Some(self.host_timeout)),
            ("map_check", Some(self.map_check)),
            ("move_wait", Some(self.move_wait)),
            ("connection_max_lifetime", self.connection_max_lifetime),
        ];
        for (name, value) in times {
            if let Some(v) = value.filter(|v| *v > LONGEST_OPTION) {
                return Err(Error::Invalid {
                    what: format!("ClusterOptions::{name} is {v:?}: at most {LONGEST_OPTION:?} (30 days)"),
                });
            }
        }
        if self.pool_size > MOST_CONNECTIONS {
            return Err(Error::Invalid {
                what: format!(
                    "ClusterOptions::pool_size is {}: at most {MOST_CONNECTIONS} connections per host",
                    self.pool_size
                ),
            });
        }
        Ok(())
    }
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            pool_size: 16,
            connect_timeout: Duration::from_secs(5),
            host_timeout: Duration::from_secs(5),
            fan_out: 16,
            fan_out_batch: 16,
            listen: true,
            map_check: Duration::from_secs(5),
            transaction_pooler: None,
            statement_cache: 0,
            fan_out_prepared: true,
            generic_plans: false,
            move_wait: Duration::from_secs(20),
            connection_max_lifetime: Some(Duration::from_secs(30 * 60)),
            connection_max_uses: None,
        }
    }
}

/// A handle on a sharded cluster. Cheap to clone; clones share the pools and the map.
#[derive(Debug, Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    layout: Layout,
    prefix: SchemaPrefix,
    map: RwLock<Arc<ShardMap>>,
    /// The last catalog map version refused for another shard count (logged once).
    refused_version: std::sync::atomic::AtomicI64,
    /// The last catalog map version found older than the map held (logged once).
    went_back_to: std::sync::atomic::AtomicI64,
    /// One pool per host, as the config and the catalog say where hosts live; changed
    /// as the catalog adds, readdresses and removes hosts ([`sync_pools`]).
    pools: RwLock<HashMap<HostName, HostPool>>,
    /// The config the handle was made with: its hosts keep their URLs.
    config: Config,
    /// Passwords for hosts known by their catalog address.
    credentials: Arc<dyn Credentials>,
    /// Hosts whose pool could not be made lately: the address, when, and why. Not asked
    /// again for [`RETRY_POOL_AFTER`], so that statements reaching such a host do not
    /// each wait for the credentials.
    failed: std::sync::Mutex<HashMap<HostName, PoolFailure>>,
    /// When a statement for a host without a pool last started a reload to make one
    /// ([`Cluster::host_pool`]): at most one per [`RETRY_POOL_AFTER`].
    pool_retry: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// Odd while [`sync_pools`] runs, bumped at its start and its end: a retry of a
    /// failed pool ([`retry_failed_pools`]) takes its pool only when no sync ran or
    /// began while it asked (a sync's end replaces the pools it read at its start).
    pool_epoch: std::sync::atomic::AtomicU64,
    catalog_url: shardline_router::config::DbUrl,
    /// Where the map listener connects: the config's `catalog.listen_url`, or the
    /// catalog's URL.
    listen_url: shardline_router::config::DbUrl,
    catalog: Mutex<Option<Catalog>>,
    /// The column types of each table (see [`crate::statement`]).
    types: crate::statement::TypeCache,
    /// Each entity's SQL, made once ([`Cluster::sql`]).
    sqls: std::sync::Mutex<HashMap<std::any::TypeId, Arc<crate::repository::Sql>>>,
    options: ClusterOptions,
    listener: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The task that closes idle connections past their lifetime ([`reap`]).
    reaper: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Why a host has no pool, lately.
#[derive(Debug, Clone)]
struct PoolFailure {
    /// The host as the catalog recorded it when it was tried.
    host: CatalogHost,
    /// The catalog's address it was tried at.
    address: shardline_router::config::DbUrl,
    /// When.
    at: tokio::time::Instant,
    /// The error, written out.
    why: String,
    /// Whether the password could not be had (else the URL or the pool failed).
    credentials: bool,
}

impl PoolFailure {
    /// The error a statement for `host` gets while it lasts.
    fn error(&self, host: &HostName) -> Error {
        if self.credentials {
            Error::Credentials { host: host.clone(), message: self.why.clone() }
        } else {
            Error::Pool { host: host.clone(), message: self.why.clone(), timed_out: false }
        }
    }
}

/// A host's pool, and what it was made from.
#[derive(Debug, Clone)]
struct HostPool {
    /// The catalog's address it was made from (`None`: the config's URL).
    address: Option<shardline_router::config::DbUrl>,
    /// For a host the config lists: the catalog's address when last looked at.
    seen: Option<shardline_router::config::DbUrl>,
    /// The URL it connects with (a password in it, maybe).
    url: shardline_router::config::DbUrl,
    pool: Pool,
    /// What its connections showed: through a pooler or not ([`crate::pooler`]).
    pooler: Arc<crate::pooler::Seen>,
    /// The host's sqlx pool ([`crate::sqlx`]), made on first use.
    #[cfg(feature = "sqlx")]
    sqlx: Arc<std::sync::OnceLock<::sqlx::PgPool>>,
    /// The host's sqlx pool for work that is not routed ([`crate::Sqlx::pool`]), made on
    /// first use: apart, so that what such work leaves on a session (a `SET`, a
    /// temporary table) never reaches routed work.
    #[cfg(feature = "sqlx")]
    sqlx_unrouted: Arc<std::sync::OnceLock<::sqlx::PgPool>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for task in [&self.listener, &self.reaper] {
            if let Ok(mut l) = task.lock()
                && let Some(task) = l.take()
            {
                task.abort();
            }
        }
    }
}

impl Cluster {
    /// Opens the catalog, checks it against `config`, loads the shard map, and makes one
    /// pool per host (connections are opened on first use).
    ///
    /// # Errors
    ///
    /// Catalog errors ([`Error::NotInitialised`], [`Error::Mismatch`], ...);
    /// [`Error::UnknownHost`] when the map places shards on a host neither the config
    /// nor the catalog gives an address for; [`Error::Credentials`] when such a host's
    /// password cannot be had;
    /// [`Error::BadUrl`].
    pub async fn connect(config: &Config, options: ClusterOptions) -> Result<Cluster> {
        Cluster::connect_with(config, options, Arc::new(config.credentials.clone())).await
    }

    /// As [`Cluster::connect`], with the application's own [`Credentials`] for hosts the
    /// config does not list (instead of the config's `[credentials]`).
    ///
    /// # Errors
    ///
    /// As [`Cluster::connect`]; [`Error::Credentials`] when a host that holds shards
    /// has no password to be had.
    pub async fn connect_with(
        config: &Config,
        mut options: ClusterOptions,
        credentials: Arc<dyn Credentials>,
    ) -> Result<Cluster> {
        options.check()?;
        // None < Some(false) < Some(true): a pooler said anywhere wins.
        options.transaction_pooler = options.transaction_pooler.max(config.transaction_pooler);
        // The catalog's reads bounded as every later one is (a catalog locked, hung or
        // cut off after its start-up would hold the application's start for ever).
        let after = options.connect_timeout + options.host_timeout;
        let read = async {
            let (catalog, info) = Catalog::open(config).await?;
            let map = catalog.map().await?;
            let hosts = catalog.hosts().await?;
            Ok::<_, Error>((catalog, info, map, hosts))
        };
        let (catalog, info, map, hosts) =
            tokio::time::timeout(after, read).await.map_err(|_| Error::CatalogTimeout { after })??;
        same_count(&map, config.logical_shards)?;
        let inner = Arc::new(Inner {
            layout: info.layout,
            prefix: info.schema_prefix,
            map: RwLock::new(Arc::new(map.clone())),
            refused_version: std::sync::atomic::AtomicI64::new(-1),
            went_back_to: std::sync::atomic::AtomicI64::new(-1),
            pools: RwLock::new(HashMap::new()),
            config: config.clone(),
            credentials,
            failed: std::sync::Mutex::default(),
            pool_retry: std::sync::Mutex::default(),
            pool_epoch: std::sync::atomic::AtomicU64::new(0),
            catalog_url: config.catalog.clone(),
            listen_url: config.listen_url.clone().unwrap_or_else(|| config.catalog.clone()),
            catalog: Mutex::new(Some(catalog)),
            types: crate::statement::TypeCache::default(),
            sqls: std::sync::Mutex::default(),
            options,
            listener: std::sync::Mutex::new(None),
            reaper: std::sync::Mutex::new(None),
        });
        if let Some((host, e)) = sync_pools(&inner, &map, &hosts).await.into_iter().next() {
            return Err(match e {
                e @ (Error::Credentials { .. } | Error::BadUrl { .. } | Error::Tls { .. }) => e,
                _ => Error::UnknownHost { host },
            });
        }
        {
            let pools = inner.pools.read().map_or_else(|p| p.into_inner().clone(), |p| p.clone());
            check_hosts(&map, &pools)?;
        }
        let cluster = Cluster { inner };
        if let Some(lifetime) = cluster.inner.options.connection_max_lifetime {
            let task = tokio::spawn(reap(Arc::downgrade(&cluster.inner), lifetime));
            if let Ok(mut r) = cluster.inner.reaper.lock() {
                *r = Some(task);
            }
        }
        if cluster.inner.options.listen {
            let listener = MapListener::start(&cluster.inner.listen_url).await?;
            let task = tokio::spawn(listen(Arc::downgrade(&cluster.inner), listener));
            if let Ok(mut l) = cluster.inner.listener.lock() {
                *l = Some(task);
            }
        }
        Ok(cluster)
    }

    /// The hosts this handle has a pool for, and the URL each connects with (printed
    /// without its password).
    pub fn hosts(&self) -> Vec<(HostName, shardline_router::config::DbUrl)> {
        let pools = self.inner.pools.read().map_or_else(|p| p.into_inner().clone(), |p| p.clone());
        let mut out: Vec<_> = pools.into_iter().map(|(h, p)| (h, p.url)).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// The pool of `host`, when the handle has one.
    /// The pool of `host`. Without one: [`Error::Credentials`] when its password could
    /// not be had lately (say why), else [`Error::UnknownHost`].
    ///
    /// A failure older than [`RETRY_POOL_AFTER`] starts a new try in the background
    /// ([`retry_failed_pools`]: the password asked for again), so a host whose
    /// credentials failed once is not left without a pool until the map next changes.
    fn host_pool(&self, host: &HostName) -> Result<HostPool> {
        let unknown = || Error::UnknownHost { host: host.clone() };
        let found = self.inner.pools.read().map_err(|_| unknown())?.get(host).cloned();
        found.ok_or_else(|| {
            let failure = self.inner.failed.lock().ok().and_then(|f| f.get(host).cloned());
            if failure.as_ref().is_some_and(|f| f.at.elapsed() >= RETRY_POOL_AFTER) {
                self.retry_pools();
            }
            failure.map_or_else(unknown, |f| f.error(host))
        })
    }

    /// Tries again, in the background, to make the pools that failed, at most once per
    /// [`RETRY_POOL_AFTER`]; nothing outside a runtime.
    fn retry_pools(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let now = tokio::time::Instant::now();
        match self.inner.pool_retry.lock() {
            Ok(mut last) if last.is_none_or(|t| now.duration_since(t) >= RETRY_POOL_AFTER) => {
                *last = Some(now)
            }
            _ => return,
        }
        let inner = Arc::downgrade(&self.inner);
        runtime.spawn(async move {
            if let Some(inner) = inner.upgrade() {
                retry_failed_pools(&inner).await;
            }
        });
    }

    /// The SQL of entity `E`, made once per handle and shared by its repositories and
    /// shard transactions.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidIdentifier`] when `E`'s names are not plain identifiers.
    pub(crate) fn sql<E: crate::entity::Entity>(&self) -> Result<Arc<crate::repository::Sql>> {
        let key = std::any::TypeId::of::<E>();
        if let Some(sql) = self.inner.sqls.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(sql);
        }
        let sql = Arc::new(crate::repository::Sql::new::<E>()?);
        if let Ok(mut m) = self.inner.sqls.lock() {
            m.insert(key, Arc::clone(&sql));
        }
        Ok(sql)
    }

    /// The sqlx pool of `host`, made on first use: the routed work's, or (`routed`
    /// false) the one [`crate::Sqlx::pool`] hands out. Refused ([`Error::Pooler`]) behind
    /// a transaction pooler, declared or found out: when the config says nothing and
    /// no connection of the host's pool has been made yet, one is made first (and
    /// closed), from the same pool whose sqlx pool is handed out.
    #[cfg(feature = "sqlx")]
    pub(crate) async fn sqlx_pool(&self, host: &HostName, routed: bool) -> Result<::sqlx::PgPool> {
        let p = self.host_pool(host)?;
        let behind = match self.inner.options.transaction_pooler {
            Some(pooler) => pooler,
            None => match p.pooler.get() {
                Some(seen) => seen,
                None => {
                    // Taken out of the pool and closed: an application that uses only
                    // the sqlx path keeps no idle connection of the repository's.
                    drop(Object::take(get_from(&p.pool, host).await?));
                    p.pooler.get().unwrap_or(true)
                }
            },
        };
        if behind {
            return Err(crate::sqlx::refused(host));
        }
        self.sqlx_pool_of(&p, host, routed)
    }

    /// `p`'s sqlx pool, made when first asked for.
    #[cfg(feature = "sqlx")]
    fn sqlx_pool_of(&self, p: &HostPool, host: &HostName, routed: bool) -> Result<::sqlx::PgPool> {
        let slot = if routed { &p.sqlx } else { &p.sqlx_unrouted };
        if let Some(pool) = slot.get() {
            return Ok(pool.clone());
        }
        let pool = crate::sqlx::host_pool(host, &p.url, &self.inner.options)?;
        Ok(slot.get_or_init(|| pool).clone())
    }

    /// The routed sqlx pool of `host`, if it has been made.
    #[cfg(feature = "sqlx")]
    pub(crate) fn sqlx_pool_made(&self, host: &HostName) -> Option<::sqlx::PgPool> {
        self.inner.pools.read().ok().and_then(|p| p.get(host).and_then(|p| p.sqlx.get().cloned()))
    }

    /// The map as this handle knows it now.
    pub fn map(&self) -> Arc<ShardMap> {
        self.inner.map.read().map_or_else(|p| Arc::clone(&p.into_inner()), |m| Arc::clone(&m))
    }

    /// The ID layout of the cluster.
    pub fn layout(&self) -> Layout {
        self.inner.layout
    }

    /// The prefix of the shard schemas.
    pub fn prefix(&self) -> &SchemaPrefix {
        &self.inner.prefix
    }

    /// A generator that mints IDs of `shard` in the application, from blocks reserved
    /// from the shard's own sequence ([`crate::ids::ShardIdGenerator`]): the cluster's
    /// layout, and the shard's schema by the cluster's prefix.
    ///
    /// # Errors
    ///
    /// [`Error::Router`] when the cluster has no such shard.
    pub fn id_generator(&self, shard: LogicalShard) -> Result<crate::ids::ShardIdGenerator> {
        self.route(shard)?;
        crate::ids::ShardIdGenerator::new(self.layout(), self.prefix(), shard)
    }

    /// Whether `host` is treated as behind a transaction-mode pooler: as
    /// [`ClusterOptions::transaction_pooler`] says, or, when it says nothing, once a
    /// connection of the host's pool came through a pooler (a host readdressed gets a
    /// new pool, found out anew). False for a host the handle has no pool for, or none
    /// of whose connections has been made yet.
    pub fn behind_pooler(&self, host: &HostName) -> bool {
        self.inner.options.transaction_pooler.unwrap_or_else(|| {
            self.inner
                .pools
                .read()
                .ok()
                .and_then(|p| p.get(host).and_then(|p| p.pooler.get()))
                .unwrap_or(false)
        })
    }

    /// Whether `client`, a connection of `host`'s pool, may keep statements across
    /// transactions: the options say the hosts are reached directly (or through a
    /// session pool), or they say nothing and the connection's own pool, still the
    /// host's, has found its connections direct. A connection of a pool the host no
    /// longer has (readdressed while the work ran) is [`MayKeep::Retired`].
    pub(crate) fn may_keep(&self, host: &HostName, client: &Object) -> MayKeep {
        let yes = |direct: bool| if direct { MayKeep::Yes } else { MayKeep::No };
        match self.inner.options.transaction_pooler {
            Some(pooler) => yes(!pooler),
            None => {
                let Ok(pools) = self.inner.pools.read() else { return MayKeep::Retired };
                let own = Object::pool(client);
                match pools.get(host) {
                    Some(p) if own.is_some_and(|own| std::ptr::eq(p.pool.manager(), own.manager())) => {
                        yes(p.pooler.get() == Some(false))
                    }
                    _ => MayKeep::Retired,
                }
            }
        }
    }

    /// The options the handle was made with (`transaction_pooler` set when the config
    /// sets it).
    pub fn options(&self) -> &ClusterOptions {
        &self.inner.options
    }

    /// The column types of each table, learnt once.
    pub(crate) fn types(&self) -> &crate::statement::TypeCache {
        &self.inner.types
    }

    /// Where a user's rows live.
    pub fn route_user(&self, user_id: i64) -> Route {
        self.map().route_user(user_id, &self.inner.prefix)
    }

    /// Where an ID's row lives: its shard is decoded from the ID, no query.
    ///
    /// # Errors
    ///
    /// [`Error::Router`] when the ID's shard is not one of the cluster's.
    pub fn route_id(&self, id: Id) -> Result<Route> {
        Ok(self.map().route_id(id, self.inner.layout, &self.inner.prefix)?)
    }

    /// Where a new row with this key goes.
    ///
    /// # Errors
    ///
    /// [`Error::Router`] for a parent ID whose shard the cluster does not have.
    pub fn route_key(&self, key: crate::entity::ShardKey) -> Result<Route> {
        match key {
            crate::entity::ShardKey::User(u) => Ok(self.route_user(u)),
            crate::entity::ShardKey::Parent(id) => self.route_id(id),
        }
    }

    /// Where a shard lives.
    ///
    /// # Errors
    ///
    /// [`Error::Router`] when the cluster has no such shard (a [`LogicalShard`] is
    /// checked only against the most shards a cluster can have).
    pub fn route(&self, shard: LogicalShard) -> Result<Route> {
        let map = self.map();
        let shard = shard.within(map.count())?;
        Ok(map.route(shard, &self.inner.prefix))
    }

    /// Reloads the map from the catalog; returns its version. A map older than the one
    /// held is ignored.
    ///
    /// # Errors
    ///
    /// Catalog errors, [`Error::CatalogTimeout`] when the catalog does not answer within
    /// [`ClusterOptions::host_timeout`]. A host of the new map the handle cannot reach
    /// (no pool can be made for it) does not fail the reload: the new map is held, the
    /// host is logged, and its shards' statements fail until it can be reached.
    pub async fn refresh(&self) -> Result<i64> {
        refresh(&self.inner).await
    }

    /// A connection to `host` from its pool.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownHost`]; [`Error::Pool`] when none can be had in time.
    pub async fn client(&self, host: &HostName) -> Result<Object> {
        self.client_and_cancel(host).await.map(|(client, _)| client)
    }

    /// A connection to `host` from the pool the host has once the connection is had,
    /// and where to cancel its statements (that pool's address). A connection waited
    /// for in a pool the host no longer has (readdressed meanwhile, to a promoted
    /// replica say) is put back and another taken from the new pool: a statement never
    /// goes to the old address once the handle took the new one, and a cancel goes
    /// where its statement runs.
    pub(crate) async fn client_and_cancel(&self, host: &HostName) -> Result<(Object, CancelTo)> {
        loop {
            let pool = self.host_pool(host)?;
            let got = get_from(&pool.pool, host).await;
            let current =
                self.inner.pools.read().ok().and_then(|p| {
                    p.get(host).map(|now| std::ptr::eq(now.pool.manager(), pool.pool.manager()))
                });
            // A failure of a pool replaced meanwhile (its old address gone) is the old
            // address's: the new pool is tried.
            let client = match got {
                Err(_) if current == Some(false) => continue,
                got => got?,
            };
            if current == Some(true) {
                let cancel = CancelTo {
                    host: host.clone(),
                    url: pool.url,
                    connect_timeout: self.inner.options.connect_timeout,
                };
                return Ok((client, cancel));
            }
            tracing::debug!(%host, "the host's pool changed while a connection was waited for; taking one from the new pool");
        }
    }
}

/// Whether a connection may keep statements across transactions ([`Cluster::may_keep`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MayKeep {
    /// Its host is reached directly, as the options say or its pool found.
    Yes,
    /// Its host is behind a transaction pooler, declared or found out.
    No,
    /// Its pool is no longer its host's (the host was readdressed while the work ran):
    /// nothing is kept, and what needs a kept statement is tried again on a new
    /// connection.
    Retired,
}

impl MayKeep {
    /// The error for what needs a kept statement on such a connection: retryable for a
    /// retired pool (nothing was sent), else the pooler's refusal `refused`.
    pub(crate) fn refusal(self, host: &HostName, refused: impl FnOnce() -> Error) -> Error {
        match self {
            MayKeep::Retired => Error::Pool {
                host: host.clone(),
                message: "the host was readdressed while the statement waited; the statement was not sent"
                    .into(),
                timed_out: false,
            },
            MayKeep::Yes | MayKeep::No => refused(),
        }
    }
}

/// A connection from `pool`, `host`'s, with its failure said as [`Cluster::client`]
/// says it.
async fn get_from(pool: &Pool, host: &HostName) -> Result<Object> {
    pool.get().await.map_err(|e| {
        let message = e.to_string();
        let pool_error = |timed_out| Error::Pool { host: host.clone(), message, timed_out };
        match e {
            deadpool_postgres::PoolError::Backend(source) => {
                match catalog::connect_error(&format!("host {host}"), source) {
                    tls @ Error::Tls { .. } => tls,
                    // The server refused the session (a password, a database that
                    // does not exist): say so, and let `is_retryable` tell.
                    connect @ Error::Connect { .. } if connect.sqlstate().is_some() => connect,
                    _ => pool_error(false),
                }
            }
            deadpool_postgres::PoolError::Timeout(_) => pool_error(true),
            _ => pool_error(false),
        }
    })
}

/// A failed attempt of [`Cluster::with_move_retry`]: the error, and the shards to wait
/// for when it failed because they moved (empty otherwise).
#[derive(Debug)]
pub(crate) struct Failed<Er> {
    pub(crate) error: Er,
    pub(crate) moved: Vec<LogicalShard>,
}

impl<Er> Failed<Er> {
    /// `error`, marked as moved (waiting for `shards`) when `moved` says so.
    pub(crate) fn new(error: Er, moved: bool, shards: impl IntoIterator<Item = LogicalShard>) -> Self {
        Failed { error, moved: if moved { shards.into_iter().collect() } else { Vec::new() } }
    }
}

impl Failed<Error> {
    /// `error`; moved when it says its shard's schema was missing.
    pub(crate) fn of(error: Error, shards: impl IntoIterator<Item = LogicalShard>) -> Self {
        let moved = error.is_moved();
        Failed::new(error, moved, shards)
    }
}

impl<Er: From<Error>> From<Error> for Failed<Er> {
    fn from(error: Error) -> Self {
        Failed { error: error.into(), moved: Vec::new() }
    }
}

/// Which run of [`Cluster::with_move_retry`] an attempt is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Run {
    /// The first, with the map as the handle knew it.
    First,
    /// A later one, after the shards' move was waited out and the map reloaded.
    Later,
}

/// How many runs [`Cluster::with_move_retry`] makes at most.
const MOVE_RUNS: u32 = 3;

impl Cluster {
    /// Takes a connection to `host` from its pool, then runs `work` on it, the whole
    /// within `after`. Running out of time before a connection was had is
    /// [`Error::Pool`] with `timed_out` (nothing was sent); after, [`Error::Timeout`] (a
    /// statement may have been sent). The one place a routed statement is timed.
    ///
    /// Past the deadline, or when the caller drops this future, the work is dropped and
    /// its connection given up on ([`Lent`], [`give_up`]): the statement in flight on it
    /// is cancelled on the server, in the background (the caller does not wait), and the
    /// connection is handed out again only once that statement has ended. Otherwise the
    /// server would run the statement to its end (a write waiting on a lock would still
    /// commit once it got it, after the caller was told it timed out), and whoever took
    /// the connection next would wait behind it.
    pub(crate) async fn on_host<T, Fut>(
        &self,
        host: &HostName,
        after: Duration,
        work: impl FnOnce(Lent) -> Fut,
    ) -> Result<T>
    where
        Fut: std::future::Future<Output = Result<T>>,
    {
        let deadline = tokio::time::Instant::now() + after;
        let (client, cancel) = match tokio::time::timeout_at(deadline, self.client_and_cancel(host)).await {
            Ok(client) => client?,
            Err(_) => {
                return Err(Error::Pool {
                    host: host.clone(),
                    message: format!("no connection could be had within {after:?}"),
                    timed_out: true,
                });
            }
        };
        let abandoned = Arc::new(OnceLock::new());
        let lent = Lent { object: Some(client), abandoned: Arc::clone(&abandoned), cancel: cancel.clone() };
        let mut work = std::pin::pin!(tokio::time::timeout_at(deadline, work(lent)));
        // Dropped before `work` (declared after it): unless the work finished, it marks
        // the connection given up on before the `Lent` inside the work is dropped, when
        // the time ran out and when the caller dropped this future as well.
        let mut guard = GiveUpOnDrop { cancel: Some(cancel), abandoned: &abandoned, armed: true };
        let outcome = work.as_mut().await;
        match outcome {
            Ok(result) => {
                guard.armed = false;
                result
            }
            Err(_) => Err(Error::Timeout { host: host.clone(), after }),
        }
    }

    /// The one retry path for a stale map. Runs `attempt` with the map as this handle
    /// knows it; when it fails because shards were not where the map said (they moved, or
    /// are fenced for a move), waits for those moves ([`Cluster::wait_for_move`]) and runs
    /// it again with the new map, at most [`MOVE_RUNS`] runs in all: a map can be two
    /// moves behind (the shard's old host, then its new one fenced for the next move or
    /// a revert). An attempt must be safe to run again after it failed that way: a
    /// statement (or a transaction) that failed did not commit.
    pub(crate) async fn with_move_retry<T, Er, Fut>(
        &self,
        mut attempt: impl FnMut(Arc<ShardMap>, Run) -> Fut,
    ) -> Result<T, Er>
    where
        Fut: std::future::Future<Output = Result<T, Failed<Er>>>,
        Er: From<Error>,
    {
        let (mut run, mut runs) = (Run::First, 1);
        loop {
            let map = self.map();
            match attempt(Arc::clone(&map), run).await {
                Ok(value) => return Ok(value),
                Err(Failed { error, moved }) if !moved.is_empty() && runs < MOVE_RUNS => {
                    let from: Vec<(LogicalShard, HostName)> =
                        moved.iter().map(|s| (*s, map.host_of(*s).clone())).collect();
                    if !self.wait_for_move(&from).await? {
                        return Err(error);
                    }
                    tracing::debug!(shards = ?moved.iter().map(|s| s.get()).collect::<Vec<_>>(), "shards moved; running once more");
                    (run, runs) = (Run::Later, runs + 1);
                }
                Err(f) => return Err(f.error),
            }
        }
    }

    /// After a statement found a shard's schema missing on `from` (the shard is fenced
    /// for a move, or has moved): reloads the map until the shard is elsewhere, or its
    /// move has ended (an undone move unfences it in place), for at most
    /// [`ClusterOptions::move_wait`]. Returns whether running the statement again makes
    /// sense; `false` when no move of these shards is running or recently ended (the
    /// schema is really missing) or the wait ran out.
    ///
    /// A fence outlives its mover only until its lease runs out: from one second into
    /// the wait (at once when the catalog cannot be read), and every second after,
    /// the source is asked to resolve the fence (`shardline.resolve_fence`). Once the
    /// lease has run out with nothing decided, that unfences the shard on the source
    /// (the statement runs again there); when the source had decided to flip, the flip
    /// is completed in the catalog (`shardline.complete_flip`) and the map reloaded.
    pub(crate) async fn wait_for_move(&self, shards: &[(LogicalShard, HostName)]) -> Result<bool> {
        let started = tokio::time::Instant::now();
        let deadline = started + self.inner.options.move_wait;
        let mut resolve_at = started + RESOLVE_EVERY;
        let mut catalog_failed = false;
        let mut pause = Duration::from_millis(2);
        let ids: Vec<i32> = shards.iter().map(|(s, _)| i32::from(s.get())).collect();
        let logical: Vec<LogicalShard> = shards.iter().map(|(s, _)| *s).collect();
        loop {
            let catalog = match self.refresh().await {
                Ok(_) => {
                    let map = self.map();
                    if shards.iter().any(|(s, from)| map.host_of(*s) != from) {
                        return Ok(true);
                    }
                    self.moves_of(&logical).await
                }
                Err(e) => Err(e),
            };
            let mut most = Duration::from_millis(25);
            match catalog {
                Ok((false, recent)) => return Ok(recent),
                Ok((true, _)) => {}
                Err(e) => {
                    // The catalog cannot tell: the source can, once the lease is out.
                    tracing::debug!(shards = ?ids, error = %crate::error_chain(&e), "cannot read the catalog while a shard is fenced");
                    if !catalog_failed {
                        catalog_failed = true;
                        resolve_at = resolve_at.min(tokio::time::Instant::now());
                    }
                    most = Duration::from_millis(250);
                }
            }
            if tokio::time::Instant::now() >= resolve_at {
                if self.resolve_fences(shards).await {
                    return Ok(true);
                }
                resolve_at = tokio::time::Instant::now() + RESOLVE_EVERY;
            }
            if tokio::time::Instant::now() + pause > deadline {
                tracing::warn!(shards = ?ids, "a move kept the shard fenced longer than move_wait");
                return Ok(false);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(most);
        }
    }

    /// Asks each shard's source to resolve its fence, a quarter of a pool's connections'
    /// worth at a time (each within the host timeout: the list may hold every shard of a
    /// statement, most of them not fenced, and the rest of the application shares the
    /// pool); returns whether one was resolved (unfenced on the source, or flipped in the
    /// catalog), so that running the statement again makes sense. Failures are logged
    /// and waited out.
    async fn resolve_fences(&self, shards: &[(LogicalShard, HostName)]) -> bool {
        use futures::StreamExt as _;
        let at_once = (self.inner.options.pool_size / 4).max(1);
        // The futures made first: a closure inside the stream would make the caller's
        // future not `Send` for every lifetime (a spawned task holds it).
        let asked: Vec<_> = shards.iter().map(|(shard, from)| self.resolve_fence(*shard, from)).collect();
        futures::stream::iter(asked)
            .buffer_unordered(at_once)
            .collect::<Vec<bool>>()
            .await
            .into_iter()
            .any(|resolved| resolved)
    }

    /// [`Cluster::resolve_fences`] for one shard.
    async fn resolve_fence(&self, shard: LogicalShard, from: &HostName) -> bool {
        let schema = self.inner.prefix.schema(shard);
        let asked = self.on_host(from, self.inner.options.host_timeout, |c| async move {
            // Unnamed, in one round trip: a transaction pooler may hand each round
            // trip of a named statement to another server connection.
            c.query_typed_one(
                "SELECT outcome, move, token FROM shardline.resolve_fence($1)",
                &[(&schema.as_str(), tokio_postgres::types::Type::TEXT)],
            )
            .await
            .map_err(|e| Error::host(from, Some(shard), "resolve a move's fence", e))
        });
        let row = match asked.await {
            Ok(row) => row,
            Err(e) => {
                tracing::warn!(shard = shard.get(), host = %from, error = %crate::error_chain(&e), "cannot resolve the shard's fence");
                return false;
            }
        };
        let decoded: std::result::Result<(String, Option<i64>, Option<String>), _> =
            (|| Ok::<_, tokio_postgres::Error>((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?)))();
        let Ok((outcome, id, token)) = decoded.inspect_err(|e| {
            tracing::warn!(shard = shard.get(), host = %from, error = %e, "the host's resolve_fence answered what this version cannot read");
        }) else {
            return false;
        };
        match outcome.as_str() {
            "undone" => {
                tracing::warn!(shard = shard.get(), host = %from, move_id = ?id, "the move's fence outlived its lease; the shard is writable on its source again");
                true
            }
            "flip" => {
                let (Some(id), Some(token)) = (id, token) else { return false };
                match self.complete_flip(id, &token).await {
                    Ok(flipped) => {
                        tracing::warn!(
                            shard = shard.get(),
                            move_id = id,
                            flipped,
                            "the move decided to flip; completed its flip in the catalog"
                        );
                        self.refresh().await.is_ok() && self.map().host_of(shard) != from
                    }
                    Err(e) => {
                        tracing::warn!(shard = shard.get(), move_id = id, error = %crate::error_chain(&e), "cannot complete the move's flip");
                        false
                    }
                }
            }
            _ => false,
        }
    }

    /// `shardline.complete_flip(id, token)` in the catalog: whether it flipped.
    async fn complete_flip(&self, id: i64, token: &str) -> Result<bool> {
        let mut slot = lock_catalog(&self.inner).await?;
        catalog_slot(&self.inner, &mut slot).await?;
        on_catalog(&self.inner, &mut slot, async |c: &Catalog| c.complete_flip(id, token).await).await
    }

    /// Whether a move of any of `shards` is running, and whether one ended in the last
    /// few seconds ([`Catalog::moves_of`]).
    async fn moves_of(&self, shards: &[LogicalShard]) -> Result<(bool, bool)> {
        let mut slot = lock_catalog(&self.inner).await?;
        catalog_slot(&self.inner, &mut slot).await?;
        on_catalog(&self.inner, &mut slot, async |c: &Catalog| c.moves_of(shards).await).await
    }
}

fn check_hosts(map: &ShardMap, pools: &HashMap<HostName, HostPool>) -> Result<()> {
    for host in map.hosts() {
        if !pools.contains_key(host) && map.shards_of(host).next().is_some() {
            return Err(Error::UnknownHost { host: host.clone() });
        }
    }
    Ok(())
}

/// A pooled connection lent to one piece of routed work by [`Cluster::on_host`]. Dropped
/// after the work ran out of time or was dropped by its caller, it is given up on
/// ([`give_up`]) rather than handed out again at once: a statement still in flight on it
/// would hold up whoever took it next (a connection answers its statements in order),
/// and would run to its end on the server.
#[derive(Debug)]
pub(crate) struct Lent {
    object: Option<Object>,
    /// Set when the work ran out of time: where to send the cancel.
    abandoned: Arc<OnceLock<Option<CancelTo>>>,
    /// Where its statements are cancelled: its pool's address.
    cancel: CancelTo,
}

impl Lent {
    /// The connection itself, for work that keeps it to the end of a transaction and
    /// gives it up when dropped unfinished ([`crate::shard::Pinned`]).
    pub(crate) fn keep(mut self) -> (Object, CancelTo) {
        match self.object.take() {
            Some(object) => (object, self.cancel.clone()),
            // Taken out only here (which consumes the `Lent`) and in `drop`.
            None => unreachable!("a lent connection is kept twice"),
        }
    }
}

impl std::ops::Deref for Lent {
    type Target = Object;

    fn deref(&self) -> &Object {
        match self.object.as_ref() {
            Some(object) => object,
            // Only `keep` (which consumes the `Lent`) and `drop` take it out.
            None => unreachable!("a lent connection is used after it was kept"),
        }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(object) = self.object.take() {
            match self.abandoned.get() {
                Some(to) => give_up(to.clone(), object),
                None => drop(object),
            }
        }
    }
}

/// Marks, when dropped armed, the connection lent by [`Cluster::on_host`] as given up on,
/// its cancel sent where its pool connects.
struct GiveUpOnDrop<'a> {
    cancel: Option<CancelTo>,
    abandoned: &'a OnceLock<Option<CancelTo>>,
    armed: bool,
}

impl Drop for GiveUpOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.abandoned.set(self.cancel.take());
        }
    }
}

/// Where [`give_up`] sends its cancels: the host, the URL its pool connects to, and the
/// pool's connect timeout.
#[derive(Debug, Clone)]
pub(crate) struct CancelTo {
    host: HostName,
    url: shardline_router::config::DbUrl,
    connect_timeout: Duration,
}

/// How long a connection given up on ([`give_up`]) may take to end its statement before
/// it is closed instead of going back to its pool.
const GIVEN_UP_WAIT: Duration = Duration::from_secs(60);

/// A pooled connection that goes back to its pool only when marked clean: dropped any
/// other way (its task dropped by a runtime shutting down, say), it is closed.
struct UntilClean(Option<Object>);

impl Drop for UntilClean {
    fn drop(&mut self) {
        if let Some(object) = self.0.take() {
            drop(Object::take(object));
        }
    }
}

/// Ends, in the background, what a pooled connection given up on may still be running
/// (its work ran out of time, its caller dropped it, its transaction was left
/// unfinished): cancels the statement in flight on the server (again every second while
/// the connection has not answered: statements queued behind it run next), then sends
/// `ROLLBACK`. Once that is answered, and every cancel sent is known to have been acted
/// on (the server closed the cancel's connection), the connection is clean and goes back
/// to its pool. Otherwise it is closed: one that does not answer within about
/// [`GIVEN_UP_WAIT`], and one a cancel may still reach later (a server that took the
/// request but did not answer it in time could act on it during the next borrower's
/// statement). Meanwhile it stays counted in its pool, so `pool_size` still bounds the
/// host's connections, and the connection that sent the statement stays open: a
/// transaction-mode pooler passes a cancel on only for a client still connected. The
/// cancels reach only this connection's session, which no one else uses meanwhile.
/// The cancel goes to the address of the pool the connection came from, even after its
/// host was readdressed or removed. Without a destination, or outside a runtime, the
/// connection is closed at once.
pub(crate) fn give_up(to: Option<CancelTo>, object: Object) {
    let (Some(to), Ok(runtime)) = (to, tokio::runtime::Handle::try_current()) else {
        return drop(Object::take(object));
    };
    let mut held = UntilClean(Some(object));
    runtime.spawn(async move {
        let Some(object) = held.0.as_ref() else { return };
        let token = object.cancel_token();
        let target = format!("host {}", to.host);
        let deadline = tokio::time::Instant::now() + GIVEN_UP_WAIT;
        let mut maybe_later = false;
        let ended = {
            let mut ending = std::pin::pin!(object.batch_execute("ROLLBACK"));
            loop {
                match catalog::cancel_within(&token, &to.url, &target, to.connect_timeout).await {
                    Ok(c) => {
                        maybe_later |= c.maybe_later;
                        if !c.done {
                            tracing::debug!(host = %to.host, why = ?c.why, "a cancel of a statement given up on was not taken");
                        }
                    }
                    Err(e) => tracing::debug!(host = %to.host, error = %e, "could not cancel a statement given up on"),
                }
                if object.is_closed() {
                    break false;
                }
                match tokio::time::timeout(Duration::from_secs(1), ending.as_mut()).await {
                    Ok(answered) => break answered.is_ok(),
                    Err(_) if tokio::time::Instant::now() >= deadline => break false,
                    Err(_) => {}
                }
            }
        };
        if ended && !maybe_later {
            // Clean: back to the pool.
            drop(held.0.take());
        } else {
            tracing::debug!(host = %to.host, ended, maybe_later, "a connection given up on is closed");
        }
    });
}

/// A pool for `name` at `url`, sized and timed as `options` say (connections open on
/// first use). Unless `options` say whether the host is behind a transaction pooler,
/// each new connection is checked for one before it is handed out, into `pooler`.
fn make_pool(
    name: &HostName,
    url: &shardline_router::config::DbUrl,
    options: &ClusterOptions,
    pooler: Arc<crate::pooler::Seen>,
) -> Result<Pool> {
    let target = format!("host {name}");
    let (mut pg, tls) = catalog::pg_config_tls(url, &target)?;
    pg.connect_timeout(options.connect_timeout);
    // A URL listing a primary and its standbys: one connect timeout per server tried,
    // and one for the start-up, as the catalog's connections have.
    let create_timeout = catalog::startup_budget(&pg);
    let manager = Manager::from_config(pg, tls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
    let (lifetime, uses) = (options.connection_max_lifetime, options.connection_max_uses);
    let generic = options.generic_plans && (options.statement_cache > 0 || options.fan_out_prepared);
    let declared = options.transaction_pooler;
    let connect_timeout = options.connect_timeout;
    let host = name.clone();
    Pool::builder(manager)
        // A `SET` on each new connection rather than a start-up option: a session-mode
        // pooler refuses start-up options it does not know.
        .post_create(deadpool_postgres::Hook::async_fn(move |client, _| {
            let (pooler, host) = (Arc::clone(&pooler), host.clone());
            Box::pin(async move {
                // Within the connect timeout: a host that took the connection and then
                // stalls must not hold the caller past it (the pool's create timeout
                // does not cover this hook).
                let behind = match declared {
                    Some(declared) => declared,
                    None => {
                        let found = crate::pooler::behind_pooler(client);
                        let found = hook_step("check for a pooler", connect_timeout, found).await?;
                        if pooler.record(found) {
                            tracing::warn!(
                                host = %host,
                                "the host's connections come through a pooler (the server process is not \
                                 the one the session's start named): treated as a transaction-mode pooler, \
                                 no statement is kept across transactions, a column of a type of the shard's \
                                 schema and the sqlx path are refused; set transaction_pooler = true to say \
                                 so, or false for a session-mode pool"
                            );
                        }
                        found
                    }
                };
                if generic && !behind {
                    let set = client.batch_execute("SET plan_cache_mode = force_generic_plan");
                    hook_step("set plan_cache_mode", connect_timeout, set).await?;
                }
                Ok(())
            })
        }))
        .max_size(options.pool_size.max(1))
        // Checked as a connection is handed out again: one past its lifetime or
        // its uses is closed (the pool makes a new one).
        .pre_recycle(deadpool_postgres::Hook::sync_fn(move |_, metrics| {
            if lifetime.is_some_and(|l| metrics.age() >= l)
                || uses.is_some_and(|u| metrics.recycle_count + 1 >= u)
            {
                Err(deadpool_postgres::HookError::message("past its lifetime or uses"))
            } else {
                Ok(())
            }
        }))
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(options.host_timeout))
        .create_timeout(Some(create_timeout))
        .build()
        .map_err(|e| Error::Pool { host: name.clone(), message: e.to_string(), timed_out: false })
}

/// One step of a new connection's set-up, within `timeout`; its failure, or its
/// silence, fails the connection, saying `what`.
async fn hook_step<T, E: std::fmt::Display>(
    what: &str,
    timeout: Duration,
    step: impl std::future::Future<Output = std::result::Result<T, E>>,
) -> std::result::Result<T, deadpool_postgres::HookError> {
    match tokio::time::timeout(timeout, step).await {
        Ok(Ok(done)) => Ok(done),
        Ok(Err(e)) => Err(deadpool_postgres::HookError::message(format!("{what}: {e}"))),
        Err(_) => Err(deadpool_postgres::HookError::message(format!("{what}: no answer within {timeout:?}"))),
    }
}

/// Brings the pools in line with the catalog's `hosts` and `map`: a pool for each host
/// the config lists (unless the catalog removed it and it holds no shard), and for each
/// other host the catalog has an address for and has not removed; a host readdressed
/// gets a new pool (the old one closes as its connections come back); a pool for a host
/// that is gone goes. A host whose pool cannot be made (its password cannot be had in
/// `connect_timeout`, say) gets none: its statements fail with
/// [`Error::UnknownHost`] rather than reach an old address, and the other hosts and the
/// map move on. Returns the hosts that hold shards in `map` but have no pool, with why.
async fn sync_pools(inner: &Inner, map: &ShardMap, hosts: &[CatalogHost]) -> Vec<(HostName, Error)> {
    /// Bumps the epoch again when the sync ends, however it ends (dropped included).
    struct Syncing<'a>(&'a std::sync::atomic::AtomicU64);
    impl Drop for Syncing<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    inner.pool_epoch.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let _syncing = Syncing(&inner.pool_epoch);
    let held = inner.pools.read().map_or_else(|p| p.into_inner().clone(), |p| p.clone());
    let mut next: HashMap<HostName, HostPool> = HashMap::new();
    let mut failed: Vec<(HostName, Error)> = Vec::new();
    let known = |name: &HostName| hosts.iter().find(|h| &h.name == name);
    for h in &inner.config.hosts {
        let record = known(&h.name);
        if record.is_some_and(|r| r.state == HostState::Removed) && map.shards_of(&h.name).next().is_none() {
            continue;
        }
        let pool = match held.get(&h.name) {
            Some(p) if p.address.is_none() => p.clone(),
            _ => match new_host_pool(inner, &h.name, None, h.url.clone()) {
                Ok(p) => p,
                Err(e) => {
                    failed.push((h.name.clone(), e));
                    continue;
                }
            },
        };
        // Said once per change of the catalog's address.
        if let Some(r) = record
            && pool.seen != r.address
        {
            credentials::warn_if_elsewhere(h, r);
        }
        next.insert(h.name.clone(), HostPool { seen: record.and_then(|r| r.address.clone()), ..pool });
    }
    for h in hosts {
        if next.contains_key(&h.name) || inner.config.host(&h.name).is_some() || h.state == HostState::Removed
        {
            continue;
        }
        let Some(address) = &h.address else { continue };
        if let Some(p) = held.get(&h.name).filter(|p| p.address.as_ref() == Some(address)) {
            next.insert(h.name.clone(), p.clone());
            continue;
        }
        let recent = inner.failed.lock().ok().and_then(|f| {
            f.get(&h.name).filter(|f| &f.address == address && f.at.elapsed() < RETRY_POOL_AFTER).cloned()
        });
        if let Some(f) = recent {
            failed.push((h.name.clone(), f.error(&h.name)));
            continue;
        }
        let asked = tokio::time::timeout(
            inner.options.connect_timeout,
            credentials::host_config(&inner.config, inner.credentials.as_ref(), h),
        )
        .await
        .unwrap_or_else(|_| {
            Err(Error::Credentials {
                host: h.name.clone(),
                message: format!("no answer within {:?}", inner.options.connect_timeout),
            })
        })
        .and_then(|c| new_host_pool(inner, &h.name, Some(address.clone()), c.url));
        match asked {
            Ok(pool) => {
                // Its failure, if any, is dropped with the commit below (a sync dropped
                // before it leaves the failure, and its retry, as they were).
                let what = if held.contains_key(&h.name) {
                    "the host was readdressed; connecting there"
                } else {
                    "a host joined"
                };
                tracing::info!(host = %h.name, address = %address, "{what}");
                next.insert(h.name.clone(), pool);
            }
            Err(e) => {
                tracing::warn!(host = %h.name, address = %address, error = %crate::error_chain(&e), "cannot make a pool for the host; its statements fail until it can");
                if let Ok(mut f) = inner.failed.lock() {
                    let (credentials, why) = match &e {
                        Error::Credentials { message, .. } => (true, message.clone()),
                        other => (false, crate::error_chain(other)),
                    };
                    let at = tokio::time::Instant::now();
                    f.insert(
                        h.name.clone(),
                        PoolFailure { host: h.clone(), address: address.clone(), at, why, credentials },
                    );
                }
                failed.push((h.name.clone(), e));
            }
        }
    }
    for name in held.keys().filter(|n| !next.contains_key(*n)) {
        let why = known(name).map_or("it is no longer in the catalog", |h| match h.state {
            HostState::Removed => "it was removed",
            _ => "it has no usable address",
        });
        tracing::info!(host = %name, why, "closing the host's pool");
    }
    // What failed for a host that is gone, or that has a pool now, is history.
    if let Ok(mut f) = inner.failed.lock() {
        f.retain(|h, _| {
            !next.contains_key(h) && hosts.iter().any(|c| &c.name == h && c.state != HostState::Removed)
        });
    }
    if let Ok(mut pools) = inner.pools.write() {
        *pools = next;
    }
    failed.retain(|(h, _)| map.shards_of(h).next().is_some());
    failed
}

/// Makes again the pools whose failure is [`RETRY_POOL_AFTER`] old, from the catalog's
/// record of each host as it was then, asking for each password again; without the
/// catalog's lock (a credentials service that hangs holds nobody else). A pool made is
/// taken only while its host still has none and the same failure, at the same
/// address, stands: a reload that has changed the host since wins.
async fn retry_failed_pools(inner: &Inner) {
    let epoch = inner.pool_epoch.load(std::sync::atomic::Ordering::SeqCst);
    if epoch % 2 == 1 {
        // A sync is under way: it decides, and a later statement tries again.
        return;
    }
    let due: Vec<(HostName, PoolFailure)> = inner.failed.lock().map_or_else(
        |_| Vec::new(),
        |f| {
            f.iter()
                .filter(|(_, f)| f.at.elapsed() >= RETRY_POOL_AFTER)
                .map(|(h, f)| (h.clone(), f.clone()))
                .collect()
        },
    );
    for (name, failure) in due {
        let asked = tokio::time::timeout(
            inner.options.connect_timeout,
            credentials::host_config(&inner.config, inner.credentials.as_ref(), &failure.host),
        )
        .await
        .unwrap_or_else(|_| {
            Err(Error::Credentials {
                host: name.clone(),
                message: format!("no answer within {:?}", inner.options.connect_timeout),
            })
        })
        .and_then(|c| new_host_pool(inner, &name, Some(failure.address.clone()), c.url));
        let (Ok(mut pools), Ok(mut failed)) = (inner.pools.write(), inner.failed.lock()) else { return };
        if inner.pool_epoch.load(std::sync::atomic::Ordering::SeqCst) != epoch {
            // A sync ran or runs meanwhile: what it read or decides wins.
            return;
        }
        let same = failed.get(&name).is_some_and(|f| f.address == failure.address && f.at == failure.at);
        if !same || pools.contains_key(&name) {
            continue;
        }
        match asked {
            Ok(pool) => {
                tracing::info!(host = %name, address = %failure.address, "the host's pool could be made this time");
                failed.remove(&name);
                pools.insert(name, pool);
            }
            Err(e) => {
                let (credentials, why) = match &e {
                    Error::Credentials { message, .. } => (true, message.clone()),
                    other => (false, crate::error_chain(other)),
                };
                tracing::warn!(host = %name, address = %failure.address, error = %crate::error_chain(&e), "still cannot make a pool for the host");
                failed.insert(
                    name,
                    PoolFailure { at: tokio::time::Instant::now(), why, credentials, ..failure },
                );
            }
        }
    }
}

fn new_host_pool(
    inner: &Inner,
    name: &HostName,
    address: Option<shardline_router::config::DbUrl>,
    url: shardline_router::config::DbUrl,
) -> Result<HostPool> {
    let pooler = Arc::default();
    Ok(HostPool {
        pool: make_pool(name, &url, &inner.options, Arc::clone(&pooler))?,
        pooler,
        seen: None,
        address,
        url,
        #[cfg(feature = "sqlx")]
        sqlx: Arc::default(),
        #[cfg(feature = "sqlx")]
        sqlx_unrouted: Arc::default(),
    })
}

/// `work` on the catalog connection held in `slot` (the handle's one, under its lock),
/// within [`ClusterOptions::host_timeout`]: [`Error::NotInitialised`] when there is none
/// or it is closed. A catalog that does not answer in time (hung, or its link cut:
/// the connection stays open and nothing comes back) fails the call with
/// [`Error::CatalogTimeout`] instead of holding every reload, move wait and map check
/// behind the lock; the connection is dropped, and the next call connects anew.
async fn on_catalog<T>(
    inner: &Inner,
    slot: &mut Option<Catalog>,
    work: impl AsyncFnOnce(&Catalog) -> Result<T>,
) -> Result<T> {
    let after = inner.options.host_timeout;
    let answer = match slot.as_ref() {
        Some(c) if !c.is_closed() => tokio::time::timeout(after, work(c)).await,
        _ => return Err(Error::NotInitialised),
    };
    answer.unwrap_or_else(|_| {
        tracing::warn!(?after, "the catalog did not answer in time; its connection is dropped");
        *slot = None;
        Err(Error::CatalogTimeout { after })
    })
}

/// The handle's catalog connection, locked, within [`ClusterOptions::host_timeout`]
/// ([`Error::CatalogTimeout`]): the lock is held across a catalog round trip, so while
/// the catalog does not answer, every caller after the first gives up in time instead of
/// queueing behind one timeout after another.
async fn lock_catalog(inner: &Inner) -> Result<tokio::sync::MutexGuard<'_, Option<Catalog>>> {
    let after = inner.options.host_timeout;
    tokio::time::timeout(after, inner.catalog.lock()).await.map_err(|_| Error::CatalogTimeout { after })
}

/// A new connection to the catalog for `slot`, unless it holds an open one; within
/// [`ClusterOptions::host_timeout`] too ([`Error::CatalogTimeout`]), as it is made on a
/// request's way.
async fn catalog_slot(inner: &Inner, slot: &mut Option<Catalog>) -> Result<()> {
    if slot.as_ref().is_none_or(Catalog::is_closed) {
        let after = inner.options.host_timeout;
        let client = tokio::time::timeout(after, catalog::connect(&inner.catalog_url, "catalog"))
            .await
            .map_err(|_| Error::CatalogTimeout { after })??;
        *slot = Some(Catalog::from_client(client));
    }
    Ok(())
}

async fn refresh(inner: &Inner) -> Result<i64> {
    let mut slot = lock_catalog(inner).await?;
    let read = async |c: &Catalog| Ok::<_, Error>((c.map().await?, c.hosts().await?));
    let (map, hosts) = match on_catalog(inner, &mut slot, read).await {
        Ok(m) => m,
        Err(e) if e.is_timeout() => return Err(e),
        Err(_) => {
            // The catalog connection is gone or failed: one new connection, one retry.
            *slot = None;
            catalog_slot(inner, &mut slot).await?;
            on_catalog(inner, &mut slot, read).await?
        }
    };
    // Fixed for the life of the cluster: a map of another count would route users by
    // another modulus (and index past its end for a shard of the old one). Kept out.
    if let Err(e) = same_count(&map, inner.config.logical_shards) {
        // Once per catalog version: a fence's wait reloads every few milliseconds.
        if inner.refused_version.swap(map.version(), std::sync::atomic::Ordering::Relaxed) != map.version() {
            tracing::error!(version = map.version(), error = %e, "the catalog's map changed its number of logical shards; keeping the map held");
        }
        return Err(e);
    }
    // The catalog stays locked until the map is swapped: two reloads at once never
    // leave the pools of an older read beside a newer map.
    let version = map.version();
    let held = inner.map.read().map(|m| m.version()).unwrap_or(0);
    if held > version {
        // Reloads are one at a time (the catalog's lock): the catalog itself went back.
        catalog_went_back(inner, held, version);
        return Ok(version);
    }
    for (host, e) in sync_pools(inner, &map, &hosts).await {
        tracing::error!(host = %host, shards = map.shards_of(&host).count(), error = %crate::error_chain(&e), "the map places shards on a host this handle cannot reach; their statements fail until it can");
    }
    if let Ok(mut held) = inner.map.write()
        && held.version() <= version
    {
        *held = Arc::new(map);
        // A catalog that goes back again later is logged again.
        inner.went_back_to.store(-1, std::sync::atomic::Ordering::Relaxed);
    }
    drop(slot);
    tracing::debug!(version, "shard map loaded");
    Ok(version)
}

/// [`Error::Mismatch`] unless `map` has `count` shards, the number the config gives and
/// the catalog was checked against when the handle was made.
fn same_count(map: &ShardMap, count: shardline_router::ShardCount) -> Result<()> {
    if map.count() == count {
        return Ok(());
    }
    Err(Error::Mismatch {
        key: "logical_shards",
        catalog: map.count().get().to_string(),
        config: count.get().to_string(),
    })
}

/// The map version the catalog holds, read on the shared catalog connection (a new
/// one when it is gone).
async fn catalog_version(inner: &Inner) -> Result<i64> {
    let mut slot = lock_catalog(inner).await?;
    catalog_slot(inner, &mut slot).await?;
    on_catalog(inner, &mut slot, async |c: &Catalog| c.map_version().await).await
}

/// Logs (once per catalog version) that the catalog holds an older map than the one
/// held: restored from a backup, say. The map held stays: it places the shards where the
/// moves since then left them, which the older one does not know of.
fn catalog_went_back(inner: &Inner, held: i64, catalog: i64) {
    if inner.went_back_to.swap(catalog, std::sync::atomic::Ordering::Relaxed) != catalog {
        tracing::error!(
            held,
            catalog,
            "the catalog's shard map is older than the one this handle holds (was the catalog restored \
             from a backup? the moves since are not in it); keeping the newer map (docs/operations.md, \
             \"The catalog\")"
        );
    }
}

/// The map check: whether the catalog's map version is past `held`, the handle's (a
/// change whose notification never arrived, logged). A catalog behind the handle is
/// logged as [`catalog_went_back`] says.
async fn catalog_is_ahead(inner: &Inner, held: i64) -> bool {
    match catalog_version(inner).await {
        Ok(v) if v < held => {
            catalog_went_back(inner, held, v);
            false
        }
        Ok(v) if v > held => {
            tracing::warn!(
                held,
                catalog = v,
                "the shard map changed but no notification arrived (is the LISTEN connection \
                 behind a transaction-mode pooler, or down? give catalog.listen_url a direct URL); reloading"
            );
            true
        }
        Ok(_) => false,
        Err(e) => {
            tracing::warn!(error = %crate::error_chain(&e), "cannot read the catalog's map version");
            false
        }
    }
}

/// Closes the idle pooled connections older than `lifetime`, every quarter of it (from
/// 250 ms to a minute): the pool checks a connection's age only as it hands it out, so
/// one left idle after a burst would otherwise keep its server backend, and the catalog
/// entries of every shard it touched, as long as the handle lives.
async fn reap(inner: Weak<Inner>, lifetime: Duration) {
    let every = (lifetime / 4).clamp(Duration::from_millis(250), Duration::from_secs(60));
    loop {
        tokio::time::sleep(every).await;
        let Some(inner) = inner.upgrade() else { return };
        let pools: Vec<Pool> = match inner.pools.read() {
            Ok(p) => p.values().map(|h| h.pool.clone()).collect(),
            Err(p) => p.into_inner().values().map(|h| h.pool.clone()).collect(),
        };
        drop(inner);
        for pool in pools {
            let closed = pool.retain(|_, metrics| metrics.age() < lifetime).removed.len();
            if closed > 0 {
                tracing::debug!(closed, "closed idle connections past their lifetime");
            }
        }
    }
}

/// Reloads the map on each notification, and every `map_check` (when no notification
/// came) compares the held version with the catalog's: a change whose notification was
/// lost (a `LISTEN` through a transaction pooler receives nothing) is found within
/// `map_check` and logged.
async fn listen(inner: Weak<Inner>, mut listener: MapListener) {
    let check = inner.upgrade().map_or(Duration::ZERO, |i| i.options.map_check);
    let wait = if check.is_zero() { Duration::from_secs(3600) } else { check };
    let mut checked = tokio::time::Instant::now();
    loop {
        let next = listener.next(wait).await;
        let Some(inner) = inner.upgrade() else { return };
        let held = inner.map.read().map(|m| m.version()).unwrap_or(0);
        match next {
            Some(v) if v <= held => continue,
            Some(_) => {}
            None if listener.is_closed() => {
                // The catalog connection ended: listen again, and reload in case a change
                // was missed meanwhile. The map check goes on while a new connection is
                // made (which may take its whole connect timeout, a cut link): it is what
                // bounds the map's age while no notification can come.
                tokio::time::sleep(Duration::from_secs(1)).await;
                let start = MapListener::start(&inner.listen_url);
                tokio::pin!(start);
                let started = loop {
                    // `map_check` may be very large: no overflow.
                    let due = checked
                        .checked_add(wait)
                        .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(86_400));
                    tokio::select! {
                        started = &mut start => break started,
                        () = tokio::time::sleep_until(due), if !check.is_zero() => {
                            checked = tokio::time::Instant::now();
                            let held = inner.map.read().map(|m| m.version()).unwrap_or(0);
                            if catalog_is_ahead(&inner, held).await
                                && let Err(e) = refresh(&inner).await
                            {
                                tracing::warn!(error = %crate::error_chain(&e), "cannot reload the shard map");
                            }
                        }
                    }
                };
                match started {
                    Ok(l) => listener = l,
                    Err(e) => {
                        tracing::warn!(error = %crate::error_chain(&e), "cannot listen for map changes; retrying");
                        continue;
                    }
                }
            }
            None if check.is_zero() => continue,
            None => {
                checked = tokio::time::Instant::now();
                if !catalog_is_ahead(&inner, held).await {
                    continue;
                }
            }
        }
        if let Err(e) = refresh(&inner).await {
            tracing::warn!(error = %crate::error_chain(&e), "cannot reload the shard map");
        }
    }
}
