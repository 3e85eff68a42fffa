//! Work inside one shard: a transaction ([`Cluster::transaction`]) and the same work on
//! every shard ([`Cluster::for_each_shard`]).
//!
//! A transaction lives in one shard, so it lives on one host and is an ordinary
//! Postgres transaction there. The closure gets a [`ShardTx`]: routed, typed operations
//! that refuse a row or ID of another shard, and raw SQL that runs with `search_path`
//! set to the shard's schema. The closure returns `Ok` to commit, `Err` to roll back.
//!
//! The closure returns a boxed future (`|tx| Box::pin(async move { ... })`), as sqlx's
//! `Connection::transaction` does: that keeps the caller's future `Send`, so it can run
//! in a spawned task.
//!
//! ```no_run
//! # use shardline_repo::{Cluster, Entity, NewRow, Id};
//! # #[derive(Entity)] #[shardline(table = "photos")]
//! # struct Photo { id: Id, #[shardline(user)] user_id: i64, caption: String }
//! # #[derive(NewRow)] #[shardline(entity = Photo)]
//! # struct NewPhoto { #[shardline(user)] user_id: i64, caption: String }
//! # async fn f(cluster: Cluster) -> Result<(), shardline_repo::Error> {
//! let user = 42;
//! let shard = cluster.route_user(user).shard;
//! let photo = cluster
//!     .transaction(shard, |tx| {
//!         Box::pin(async move {
//!             let photo = tx.insert(&NewPhoto { user_id: user, caption: "hi".into() }).await?;
//!             tx.execute("UPDATE photos SET caption = caption || '!' WHERE id = $1", &[&photo.id]).await?;
//!             tx.get::<Photo>(photo.id).await
//!         })
//!     })
//!     .await?;
//! # Ok(()) }
//! ```

use std::time::Duration;

use futures::StreamExt as _;
use futures::future::BoxFuture;
use shardline_id::Id;
use shardline_router::{HostName, LogicalShard, Route, SchemaName};
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use crate::cluster::Cluster;
use crate::entity::{Entity, NewRow, check_new_row, check_update};
use crate::repository::{Sql, is_moved};
use crate::{Error, Result};

/// A transaction in one shard, handed to the closure of [`Cluster::transaction`].
///
/// `'env` is the life of the call: the closure's future may borrow anything that
/// outlives it. If the transaction is dropped unfinished (its caller cancelled or timed
/// out), its connection is closed rather than returned to the pool, so the server rolls
/// it back and no pooled connection is left inside a transaction.
#[derive(Debug)]
pub struct ShardTx<'env> {
    client: Option<deadpool_postgres::Object>,
    cluster: &'env Cluster,
    route: Route,
    timeout: Duration,
    moved: bool,
}

impl Drop for ShardTx<'_> {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

impl ShardTx<'_> {
    /// Ends the transaction with `COMMIT` or `ROLLBACK`; the connection goes back to the
    /// pool only when that succeeds.
    async fn finish(&mut self, sql: &'static str) -> Result<()> {
        let Some(client) = self.client.as_ref() else {
            return Err(Error::Invalid { what: "the transaction has already ended".into() });
        };
        let done = tokio::time::timeout(self.timeout, client.batch_execute(sql))
            .await
            .map_err(|_| Error::Timeout { host: self.route.host.to_string(), after: self.timeout })?;
        done.map_err(|e| Error::host(&self.route.host, Some(self.route.shard), "commit", e))?;
        // Finished cleanly: the connection can serve others.
        drop(self.client.take());
        Ok(())
    }

    fn client(&self) -> Result<&deadpool_postgres::Object> {
        self.client
            .as_ref()
            .ok_or_else(|| Error::Invalid { what: "the transaction has already ended".into() })
    }
}

impl ShardTx<'_> {
    /// The shard the transaction is in.
    pub fn shard(&self) -> LogicalShard {
        self.route.shard
    }

    /// The shard's schema (also the transaction's `search_path`).
    pub fn schema(&self) -> &SchemaName {
        &self.route.schema
    }

    /// The host the transaction runs on.
    pub fn host(&self) -> &HostName {
        &self.route.host
    }

    async fn run(
        &mut self,
        what: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        count_only: bool,
    ) -> Result<(Vec<Row>, u64)> {
        let route = &self.route;
        let client = self.client()?;
        let work = async {
            let fail = |e| Error::host(&route.host, Some(route.shard), what, e);
            let statement = client.prepare_cached(sql).await.map_err(fail)?;
            if count_only {
                Ok((Vec::new(), client.execute(&statement, params).await.map_err(fail)?))
            } else {
                let rows = client.query(&statement, params).await.map_err(fail)?;
                let n = u64::try_from(rows.len()).unwrap_or(u64::MAX);
                Ok((rows, n))
            }
        };
        let result = tokio::time::timeout(self.timeout, work)
            .await
            .map_err(|_| Error::Timeout { host: route.host.to_string(), after: self.timeout })?;
        if let Err(Error::Host { source: Some(e), .. }) = &result
            && is_moved(e)
        {
            self.moved = true;
        }
        result
    }

    async fn rows_of(
        &mut self,
        what: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>> {
        Ok(self.run(what, sql, params, false).await?.0)
    }

    fn check_shard(&self, what: &'static str, shard: LogicalShard) -> Result<()> {
        if shard == self.route.shard {
            Ok(())
        } else {
            Err(Error::WrongShard { what, shard: shard.get(), transaction: self.route.shard.get() })
        }
    }

    fn rows<E: Entity>(rows: &[Row]) -> Result<Vec<E>> {
        rows.iter()
            .map(|r| E::from_row(r).map_err(|source| Error::Decode { table: E::TABLE, source }))
            .collect()
    }

    /// Inserts a row (the ID minted by this shard) and returns it.
    ///
    /// # Errors
    ///
    /// [`Error::WrongShard`] when the row's user lives in another shard (nothing is
    /// sent); [`Error::InvalidIdentifier`] for a column of `N` that is not a plain SQL
    /// identifier (nothing is sent); [`Error::Host`]; [`Error::Timeout`].
    pub async fn insert<N: NewRow>(&mut self, new: &N) -> Result<N::Entity> {
        check_new_row::<N>()?;
        self.check_shard("insert", self.cluster.route_key(new.shard_key())?.shard)?;
        let sql = Sql::new::<N::Entity>()?.insert(&self.route.schema, N::COLUMNS, 1);
        let rows = self.rows_of("insert", &sql, &new.values()).await?;
        Self::rows(&rows)?.pop().ok_or(Error::Empty { what: "insert" })
    }

    /// The row with `id`.
    ///
    /// # Errors
    ///
    /// [`Error::WrongShard`] for an ID of another shard (nothing is sent); as
    /// [`ShardTx::insert`].
    pub async fn get<E: Entity>(&mut self, id: Id) -> Result<Option<E>> {
        self.check_shard("get", self.cluster.route_id(id)?.shard)?;
        let sql = Sql::new::<E>()?.get(&self.route.schema);
        Ok(Self::rows(&self.rows_of("get", &sql, &[&id]).await?)?.pop())
    }

    /// Sets `columns` of the row with `id`; returns it as it now is.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidIdentifier`] for a column `E` does not declare; as
    /// [`ShardTx::get`].
    pub async fn update<E: Entity>(
        &mut self,
        id: Id,
        set: &[(&str, &(dyn ToSql + Sync))],
    ) -> Result<Option<E>> {
        let columns = check_update::<E>(set)?;
        self.check_shard("update", self.cluster.route_id(id)?.shard)?;
        let sql = Sql::new::<E>()?.update(&self.route.schema, &columns);
        let mut values: Vec<&(dyn ToSql + Sync)> = vec![&id];
        values.extend(set.iter().map(|(_, v)| *v));
        Ok(Self::rows(&self.rows_of("update", &sql, &values).await?)?.pop())
    }

    /// Deletes the row with `id`; returns whether there was one.
    ///
    /// # Errors
    ///
    /// As [`ShardTx::get`].
    pub async fn delete<E: Entity>(&mut self, id: Id) -> Result<bool> {
        self.check_shard("delete", self.cluster.route_id(id)?.shard)?;
        let sql = Sql::new::<E>()?.delete(&self.route.schema);
        Ok(!self.rows_of("delete", &sql, &[&id]).await?.is_empty())
    }

    /// Runs SQL of the caller's in this shard: unqualified names resolve in the shard's
    /// schema (`search_path`), values are bind parameters. Returns the rows.
    ///
    /// # Errors
    ///
    /// [`Error::Host`] (with the SQLSTATE); [`Error::Timeout`].
    pub async fn query(&mut self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>> {
        self.rows_of("query", sql, params).await
    }

    /// As [`ShardTx::query`], returning how many rows the statement touched.
    ///
    /// # Errors
    ///
    /// As [`ShardTx::query`].
    pub async fn execute(&mut self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64> {
        Ok(self.run("execute", sql, params, true).await?.1)
    }
}

/// The outcome of [`Cluster::for_each_shard`] on one shard.
pub type ShardResult<T, Er> = (LogicalShard, Result<T, Er>);

impl Cluster {
    /// Runs `work` in one transaction in `shard`, on the shard's host: committed when it
    /// returns `Ok`, rolled back when it returns `Err`.
    ///
    /// When a statement finds the shard's schema gone (the shard moved and this handle's
    /// map was stale), the transaction is rolled back, the map reloaded, and `work` run
    /// once more from the start on the shard's new host. So `work` should have no effect
    /// outside the transaction, or effects that tolerate running twice.
    ///
    /// # Errors
    ///
    /// `work`'s error; [`Error::Host`] / [`Error::Pool`] / [`Error::Timeout`] for
    /// `BEGIN` and `COMMIT`. A `COMMIT` that fails with a lost connection leaves the
    /// outcome unknown, as in any database.
    pub async fn transaction<'env, T, Er, F>(&'env self, shard: LogicalShard, mut work: F) -> Result<T, Er>
    where
        F: for<'t> FnMut(&'t mut ShardTx<'env>) -> BoxFuture<'t, Result<T, Er>>,
        Er: From<Error>,
    {
        let timeout = self.options().host_timeout;
        let mut retried = false;
        loop {
            let route = self.route(shard);
            let client = self.client(&route.host).await?;
            let begin = format!("BEGIN; SET LOCAL search_path TO {}", route.schema.quoted());
            let mut tx =
                ShardTx { client: Some(client), cluster: self, route: route.clone(), timeout, moved: false };
            let started = tokio::time::timeout(timeout, tx.client()?.batch_execute(&begin))
                .await
                .map_err(|_| Error::Timeout { host: route.host.to_string(), after: timeout })?;
            started.map_err(|e| Error::host(&route.host, Some(shard), "begin", e))?;
            match work(&mut tx).await {
                Ok(value) => {
                    tx.finish("COMMIT").await?;
                    return Ok(value);
                }
                Err(e) => {
                    let moved = tx.moved;
                    // A rollback that fails leaves the connection to be closed (Drop),
                    // which rolls back as well.
                    let _ = tx.finish("ROLLBACK").await;
                    drop(tx);
                    if !moved || retried {
                        return Err(e);
                    }
                    retried = true;
                    if !self.wait_for_move(&[(shard, route.host.clone())]).await? {
                        return Err(e);
                    }
                    tracing::debug!(shard = shard.get(), from = %route.host, "shard moved; running the transaction again");
                }
            }
        }
    }

    /// Runs `work` on every shard, each in its own [`Cluster::transaction`], several at
    /// a time (interleaved over the hosts, a few per host). Returns one result per shard,
    /// in shard order: a shard that fails does not stop the others, and none is left
    /// out.
    pub async fn for_each_shard<'env, T, Er, F>(&'env self, work: F) -> Vec<ShardResult<T, Er>>
    where
        F: for<'t> Fn(&'t mut ShardTx<'env>) -> BoxFuture<'t, Result<T, Er>>,
        Er: From<Error>,
    {
        let map = self.map();
        let per_host: Vec<Vec<LogicalShard>> = map
            .hosts()
            .iter()
            .map(|h| map.shards_of(h).collect())
            .filter(|s: &Vec<_>| !s.is_empty())
            .collect();
        let hosts = per_host.len().max(1);
        // Round-robin over the hosts, so every host works from the start.
        let longest = per_host.iter().map(Vec::len).max().unwrap_or(0);
        let order: Vec<LogicalShard> =
            (0..longest).flat_map(|i| per_host.iter().filter_map(move |s| s.get(i).copied())).collect();
        let per_host_jobs = (self.options().pool_size / 2).clamp(1, 8);
        let work = &work;
        let mut results: Vec<ShardResult<T, Er>> = futures::stream::iter(order)
            .map(|shard| async move { (shard, self.transaction(shard, work).await) })
            .buffer_unordered(hosts * per_host_jobs)
            .collect()
            .await;
        results.sort_by_key(|(s, _)| *s);
        results
    }
}
