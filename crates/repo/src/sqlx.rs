//! sqlx on the routed cluster (feature `sqlx`): bring sqlx queries, keep the guarantees.
//!
//! [`Cluster::sqlx`] gives a [`Sqlx`] handle on the same cluster: the same config, the
//! same shard map (reloaded on change), and one sqlx [`PgPool`] per host beside the
//! repository's pools. Its work runs in a transaction in one shard, on the shard's host,
//! with `search_path` set to the shard's schema for that transaction only (`SET LOCAL`,
//! so it stays right behind PgBouncer in transaction mode): unqualified table names are
//! the shard's.
//!
//! It goes through the repository's own mechanisms, not copies of them: the one retry
//! path for a stale map ([`Cluster::with_move_retry`]: a statement that finds its shard
//! gone, because it moved or is fenced for a move, is rolled back, the move waited
//! out, and the work run once more on the shard's new host), the host timeout, and the
//! one error type, classified the same way ([`Error::outcome_unknown`],
//! [`Error::is_retryable`], [`Error::is_timeout`]).
//!
//! ```no_run
//! use shardline_repo::{Cluster, Id};
//!
//! #[derive(sqlx::FromRow)]
//! struct Photo {
//!     id: Id,
//!     user_id: i64,
//!     url: String,
//! }
//!
//! # async fn f(cluster: Cluster) -> Result<(), shardline_repo::Error> {
//! let db = cluster.sqlx();
//! let user = 42;
//! let photo: Photo = db
//!     .on_user(user, |conn| {
//!         Box::pin(async move {
//!             sqlx::query_as("INSERT INTO photos (user_id, url) VALUES ($1, $2) RETURNING id, user_id, url")
//!                 .bind(user)
//!                 .bind("https://cdn/1.jpg")
//!                 .fetch_one(&mut *conn)
//!                 .await
//!         })
//!     })
//!     .await?;
//! // The ID carries its shard: this goes straight to the right host.
//! let again: Option<Photo> = db
//!     .on_id(photo.id, |conn| {
//!         Box::pin(async move {
//!             sqlx::query_as("SELECT id, user_id, url FROM photos WHERE id = $1")
//!                 .bind(photo.id)
//!                 .fetch_optional(&mut *conn)
//!                 .await
//!         })
//!     })
//!     .await?;
//! # let _ = again; Ok(()) }
//! ```
//!
//! What differs from the repository's typed operations: shardline cannot see inside a
//! sqlx query, so a row returned by it is not checked against its shard (the
//! repository's [`Error::Misrouted`]); the `SET LOCAL search_path` is what routes it.
//! The host timeout bounds each unit of work as a whole (begin to commit), not each
//! statement. A `COMMIT` that cannot be confirmed leaves the outcome unknown, as
//! anywhere.

use std::collections::HashMap;

use ::sqlx::pool::PoolConnection;
use ::sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, Postgres};
use futures::future::BoxFuture;
use shardline_id::Id;
use shardline_router::{Config, HostName, LogicalShard, Route};

use crate::cluster::{Cluster, ClusterOptions, Failed};
use crate::shard::ShardResult;
use crate::{Error, Result, within};

/// One sqlx pool per host, made with the cluster (connections open on first use).
#[derive(Debug)]
pub(crate) struct Pools(HashMap<HostName, PgPool>);

impl Pools {
    /// A lazy pool per host of `config`, sized and timed as the repository's pools.
    /// Must run inside a Tokio runtime (a pool keeps a maintenance task).
    pub(crate) fn new(config: &Config, options: &ClusterOptions) -> Result<Pools> {
        let cache = if options.transaction_pooler { 0 } else { options.statement_cache };
        let mut pools = HashMap::new();
        for h in &config.hosts {
            // The URL is never part of the message: it may hold a password.
            let connect: PgConnectOptions =
                h.url.expose().parse().map_err(|e: ::sqlx::Error| Error::BadUrl {
                    target: format!("host {}", h.name),
                    message: match e {
                        ::sqlx::Error::Configuration(source) => source.to_string(),
                        _ => "sqlx cannot read it".into(),
                    },
                })?;
            // 0: every statement unnamed, as the repository's default (a statement
            // prepared under one shard's search_path is not another shard's).
            let connect = connect.statement_cache_capacity(cache);
            let pool = PgPoolOptions::new()
                .max_connections(u32::try_from(options.pool_size.max(1)).unwrap_or(u32::MAX))
                .acquire_timeout(options.host_timeout)
                .max_lifetime(options.connection_max_lifetime)
                // As the repository's pools: no round trip to test a connection
                // handed out; a broken one fails its statement, classified.
                .test_before_acquire(false)
                .connect_lazy_with(connect);
            pools.insert(h.name.clone(), pool);
        }
        Ok(Pools(pools))
    }
}

/// sqlx on a [`Cluster`]: routed units of work on one shard, and the same work on
/// every shard. Cheap to clone; made by [`Cluster::sqlx`].
#[derive(Debug, Clone)]
pub struct Sqlx {
    cluster: Cluster,
}

impl Cluster {
    /// sqlx on this cluster: its map, its retry path, its timeouts, and one sqlx pool
    /// per host (see [`crate::sqlx`]).
    pub fn sqlx(&self) -> Sqlx {
        Sqlx { cluster: self.clone() }
    }
}

/// A connection taken for one unit of work. Dropped before [`Lease::release`] (a
/// failure, a timeout, a cancelled caller), it is closed rather than returned to the
/// pool, so no pooled connection is left inside a transaction or mid-statement.
struct Lease(Option<PoolConnection<Postgres>>);

impl Lease {
    fn conn(&mut self) -> Result<&mut PgConnection> {
        self.0
            .as_deref_mut()
            .ok_or_else(|| Error::Invalid { what: "the connection has already been returned".into() })
    }

    fn release(mut self) {
        drop(self.0.take());
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(mut conn) = self.0.take() {
            conn.close_on_drop();
        }
    }
}

impl Sqlx {
    /// The cluster this runs on.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// The sqlx pool of `host`, for work that is not routed (it bypasses routing,
    /// timeouts and the move retry).
    pub fn pool(&self, host: &HostName) -> Option<&PgPool> {
        self.cluster.sqlx_pools().0.get(host)
    }

    /// Runs `work` in one transaction in `shard`, on the shard's host, with the
    /// shard's schema as the transaction's `search_path`: committed when it returns
    /// `Ok`, rolled back when it returns `Err`.
    ///
    /// When a statement finds the shard's schema gone (the shard moved, or is fenced
    /// for a move), the transaction is rolled back, the move waited out, and `work` run
    /// once more from the start on the shard's new host: keep its effects inside the
    /// transaction.
    ///
    /// # Errors
    ///
    /// [`Error::Sqlx`] naming the host, the shard and the SQLSTATE; [`Error::Timeout`]
    /// when the whole unit of work took longer than
    /// [`ClusterOptions::host_timeout`]; [`Error::Pool`] when no connection could be
    /// had in time; [`Error::RolledBack`] when `work` returned `Ok` but a statement in it
    /// had failed (its error handled), so Postgres rolled the transaction back.
    pub async fn transaction<T, F>(&self, shard: LogicalShard, work: F) -> Result<T>
    where
        F: for<'c> FnMut(&'c mut PgConnection) -> BoxFuture<'c, std::result::Result<T, ::sqlx::Error>>,
    {
        let timeout = self.cluster.options().host_timeout;
        // Each run borrows `work` in turn; the lock is never contended.
        let work = &tokio::sync::Mutex::new(work);
        self.cluster
            .with_move_retry(|map, _| async move {
                let route = map.route(shard, self.cluster.prefix());
                let host = route.host.clone();
                let mut work = work.lock().await;
                let mut moved = false;
                let done = within(&host, timeout, self.attempt(&route, &mut *work, &mut moved)).await;
                done.map_err(|e| {
                    let moved = moved || e.is_moved();
                    Failed::new(e, moved, [shard])
                })
            })
            .await
    }

    /// One run of [`Sqlx::transaction`] on `route`; sets `moved` when it learnt that the
    /// shard's schema is gone from its host.
    async fn attempt<T, F>(&self, route: &Route, work: &mut F, moved: &mut bool) -> Result<T>
    where
        F: for<'c> FnMut(&'c mut PgConnection) -> BoxFuture<'c, std::result::Result<T, ::sqlx::Error>>,
    {
        let (host, shard) = (&route.host, route.shard);
        let fail = |what: &'static str| move |e: ::sqlx::Error| Error::sqlx(host, Some(shard), what, e);
        let pool = self.pool(host).ok_or_else(|| Error::UnknownHost { host: host.clone() })?;
        let mut lease = Lease(Some(pool.acquire().await.map_err(|e| match e {
            ::sqlx::Error::PoolTimedOut => Error::Pool {
                host: host.clone(),
                message: format!(
                    "no connection could be had within {:?}",
                    self.cluster.options().host_timeout
                ),
                timed_out: true,
            },
            e => Error::sqlx(host, Some(shard), "connect", e),
        })?));
        // One round trip: the transaction and its search_path (the schema quoted by the
        // one quoting function, `SchemaName::quoted`).
        let begin = format!("BEGIN; SET LOCAL search_path TO {}", route.schema.quoted());
        let mut tx = ::sqlx::Connection::begin_with(lease.conn()?, ::sqlx::AssertSqlSafe(begin))
            .await
            .map_err(fail("begin"))?;
        let value = match work(&mut tx).await {
            Ok(value) => value,
            Err(e) => {
                // Rolled back by the drop of `tx`, or by the connection's close.
                return Err(Error::sqlx(host, Some(shard), "work", e));
            }
        };
        // A statement that failed inside the transaction aborted it, even when `work`
        // handled its error: Postgres would answer COMMIT with a rollback. The probe
        // fails then (25P02), and the caller hears so.
        if let Err(e) = ::sqlx::raw_sql("SELECT 1").execute(&mut *tx).await {
            let e = Error::sqlx(host, Some(shard), "commit", e);
            if e.sqlstate() != Some("25P02") {
                return Err(e);
            }
            tx.rollback().await.map_err(fail("rollback"))?;
            // Was it because the shard is gone from here? Then run it again where it is.
            let gone: bool = ::sqlx::query_scalar("SELECT to_regnamespace($1) IS NULL")
                .bind(route.schema.as_str())
                .fetch_one(lease.conn()?)
                .await
                .map_err(fail("look for the shard's schema"))?;
            *moved = gone;
            lease.release();
            return Err(Error::RolledBack { host: host.clone(), shard });
        }
        tx.commit().await.map_err(fail("commit"))?;
        lease.release();
        Ok(value)
    }

    /// [`Sqlx::transaction`] in the shard of user `user_id`.
    ///
    /// # Errors
    ///
    /// As [`Sqlx::transaction`].
    pub async fn on_user<T, F>(&self, user_id: i64, work: F) -> Result<T>
    where
        F: for<'c> FnMut(&'c mut PgConnection) -> BoxFuture<'c, std::result::Result<T, ::sqlx::Error>>,
    {
        self.transaction(self.cluster.route_user(user_id).shard, work).await
    }

    /// [`Sqlx::transaction`] in the shard that minted `id` (decoded from the ID, no
    /// query).
    ///
    /// # Errors
    ///
    /// [`Error::Router`] for an ID of a shard the cluster does not have; then as
    /// [`Sqlx::transaction`].
    pub async fn on_id<T, F>(&self, id: Id, work: F) -> Result<T>
    where
        F: for<'c> FnMut(&'c mut PgConnection) -> BoxFuture<'c, std::result::Result<T, ::sqlx::Error>>,
    {
        self.transaction(self.cluster.route_id(id)?.shard, work).await
    }

    /// Runs `work` on every shard, each in its own [`Sqlx::transaction`], several at a
    /// time (interleaved over the hosts, as [`Cluster::for_each_shard`]). `work` gets
    /// the shard and the connection. Returns one result per shard, in shard order: a
    /// shard that fails does not stop the others, and none is left out.
    pub async fn for_each_shard<T, F>(&self, work: F) -> Vec<ShardResult<T, Error>>
    where
        F: for<'c> Fn(
            LogicalShard,
            &'c mut PgConnection,
        ) -> BoxFuture<'c, std::result::Result<T, ::sqlx::Error>>,
    {
        let work = &work;
        self.cluster.on_every_shard(|shard| self.transaction(shard, move |conn| work(shard, conn))).await
    }
}
