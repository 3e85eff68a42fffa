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

use std::collections::HashMap;
use std::time::Duration;

use futures::StreamExt as _;
use futures::future::BoxFuture;
use shardline_id::Id;
use shardline_router::{HostName, LogicalShard, Route, SchemaName};
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use crate::cluster::{self, Cluster, Failed};

/// The savepoint that probes whether shardline's transaction is still open and whole
/// before `COMMIT` (and after a closure failed): shared by the sqlx path.
pub(crate) const PROBE: &str = "shardline_check";

/// What a routed transaction runs after its `BEGIN`, in the same round trip: the
/// `search_path` set to `schema` (quoted by the one quoting function,
/// `SchemaName::quoted`), and a check that the schema is there and is the shard's, not a
/// move's copy still being filled ([`crate::LIVE_CHECK`]) (with `session`, it also
/// answers with the session's process ID and start, which the sqlx path cancels by).
/// Shared by the sqlx path.
///
/// `pg_temp` is named last, because a path that does not name it searches it first: a
/// temporary table left on a pooled connection (`photos`, say) would take the place of
/// the shard's table of that name, and the writes sent there vanish with the session.
/// With the shard's schema gone (moved, or renamed by a move's fence), `pg_temp` would
/// be the first schema of the path, where an unqualified `CREATE TABLE` makes a
/// temporary table: so the schema is looked up first, and its absence fails the `BEGIN`
/// with 3F000 ([`begin_finds_schema_gone`]), which is taken for a moved shard. A schema
/// renamed later in the transaction is not caught this way (a temporary table of a
/// shard table's name still takes that table's writes then; see `docs/sqlx.md`).
pub(crate) fn enter_schema(schema: &shardline_router::SchemaName, session: bool) -> String {
    let quoted = schema.quoted();
    // 3F000 when the schema is not there, and when it is a move's copy that is not the
    // shard's yet ([`crate::LIVE_CHECK`]); 42883 for a schema without the function (a
    // shard `migrate` has not reached since an upgrade, or one made by hand).
    let check = format!("{}::regnamespace", shardline_id::ident::literal(&quoted.to_string()));
    let live = format!("{quoted}.{}()", crate::LIVE_CHECK);
    if session {
        format!(
            "SET LOCAL search_path TO {quoted}, pg_temp;
             SELECT {check}, a.pid, a.backend_start::text, {live} FROM pg_stat_get_activity(pg_backend_pid()) AS a"
        )
    } else {
        format!("SET LOCAL search_path TO {quoted}, pg_temp; SELECT {check}, {live}")
    }
}

/// Whether a routed transaction's `BEGIN` round trip ([`enter_schema`]) failed because
/// the shard's schema is not on the host (SQLSTATE 3F000).
pub(crate) fn begin_finds_schema_gone(sqlstate: Option<&str>) -> bool {
    sqlstate == Some("3F000")
}
use crate::entity::{Entity, NewRow, check_new_row, check_update, check_values};
use crate::statement::{self, Param, check_rows};
use crate::{Error, Result, statement_error, within};

/// A pooled connection inside a transaction. Dropped before [`Pinned::release`] (a
/// failure, a timeout, a cancelled caller), it is given up on ([`cluster::give_up`]):
/// the statement in flight, if any, is cancelled on the server and the transaction
/// rolled back before the connection is handed out again (or it is closed), so no pooled
/// connection is left inside a transaction and no statement of it runs on.
#[derive(Debug)]
pub(crate) struct Pinned {
    object: Option<deadpool_postgres::Object>,
    cancel_to: Option<cluster::CancelTo>,
}

impl Pinned {
    /// `object`, whose statements are cancelled through `cancel_to` when given up on
    /// (closed at once without it).
    pub(crate) fn new(object: deadpool_postgres::Object, cancel_to: Option<cluster::CancelTo>) -> Self {
        Pinned { object: Some(object), cancel_to }
    }

    pub(crate) fn client(&self) -> Result<&deadpool_postgres::Object> {
        self.object
            .as_ref()
            .ok_or_else(|| Error::Invalid { what: "the transaction has already ended".into() })
    }

    /// The transaction ended cleanly: the connection goes back to the pool.
    pub(crate) fn release(mut self) {
        drop(self.object.take());
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Some(object) = self.object.take() {
            cluster::give_up(self.cancel_to.take(), object);
        }
    }
}

/// A transaction in one shard, handed to the closure of [`Cluster::transaction`].
///
/// `'env` is the life of the call: the closure's future may borrow anything that
/// outlives it. If the transaction is dropped unfinished (its caller cancelled or timed
/// out), its connection is given up on: the statement in flight is cancelled and the
/// transaction rolled back before the connection is handed out again (or it is closed),
/// so no pooled connection is left inside a transaction.
#[derive(Debug)]
pub struct ShardTx<'env> {
    client: Option<Pinned>,
    cluster: &'env Cluster,
    route: Route,
    timeout: Duration,
    moved: bool,
    /// A statement ran out of time: the transaction is over (see `after`).
    abandoned: bool,
    /// A statement was sent and its answer not read yet. Still set when the next call
    /// comes, its future was dropped unfinished (the closure's own timeout, a
    /// `select!`): the server may still run it, so the transaction is given up
    /// ([`ShardTx::given_up_if_dropped`]) rather than committed with it.
    in_flight: std::sync::atomic::AtomicBool,
}

impl ShardTx<'_> {
    /// Ends the transaction with `ROLLBACK`; the connection goes back to the pool only
    /// when that succeeds.
    async fn rollback(&mut self) -> Result<()> {
        if self.given_up_if_dropped() {
            // Cancelled and rolled back in the background: not queued behind a
            // statement the closure dropped (which may wait on a lock).
            return Ok(());
        }
        let (host, shard) = (&self.route.host, self.route.shard);
        let client = self.client()?;
        within(host, self.timeout, async {
            client.batch_execute("ROLLBACK").await.map_err(|e| Error::host(host, Some(shard), "rollback", e))
        })
        .await?;
        self.release();
        Ok(())
    }

    /// Ends the transaction with `COMMIT`. A statement that failed inside the
    /// transaction aborted it, even when the closure handled its error: then Postgres
    /// would answer `COMMIT` with a rollback, so the probe `SAVEPOINT` sent before it
    /// fails (25P02), `COMMIT` is not run, and the caller gets [`Error::RolledBack`]. A
    /// closure that ended the transaction itself (a raw `COMMIT` or `ROLLBACK`) makes the
    /// probe fail with 25P01 (a `SAVEPOINT` outside a transaction block):
    /// [`Error::TransactionEnded`], never `Ok`. (A bare `COMMIT` there would only warn.)
    async fn commit(&mut self) -> Result<()> {
        let _ = self.given_up_if_dropped();
        let (host, shard) = (self.route.host.clone(), self.route.shard);
        match self.probe("; COMMIT").await {
            Ok(()) => {
                self.release();
                Ok(())
            }
            Err(e) if e.sqlstate() == Some("25P02") => {
                let _ = self.rollback().await;
                Err(Error::RolledBack { host, shard })
            }
            Err(e) if e.sqlstate() == Some("25P01") => {
                // Not in a transaction: nothing to end; the connection is clean.
                self.release();
                Err(Error::TransactionEnded { host, shard })
            }
            Err(e) => Err(e),
        }
    }

    /// The probe `SAVEPOINT` on the transaction's connection, then `then` in the same
    /// round trip (not run when the probe fails).
    async fn probe(&self, then: &str) -> Result<()> {
        let (host, shard) = (&self.route.host, self.route.shard);
        let client = self.client()?;
        within(host, self.timeout, async {
            client
                .batch_execute(&format!("SAVEPOINT {PROBE}{then}"))
                .await
                .map_err(|e| Error::host(host, Some(shard), "commit", e))
        })
        .await
    }

    /// Gives the connection back to the pool (the transaction is over).
    fn release(&mut self) {
        if let Some(c) = self.client.take() {
            c.release();
        }
    }

    /// After the closure failed: whether it had ended shardline's transaction itself (a
    /// raw `COMMIT` or `ROLLBACK`, then a statement that failed, as an unqualified name
    /// does once the transaction's `search_path` is gone). Then what it applied stays,
    /// and the work must not run again, even when that failure looked like a moved
    /// shard. The probe is a `SAVEPOINT`: 25P01 outside a transaction block; inside one
    /// (or in an aborted one, 25P02) the `ROLLBACK` that follows undoes it.
    /// A probe that ran out of time gives the connection up ([`ShardTx::after`]), so
    /// the rollback after it does not wait out the timeout a second time.
    async fn ended_by_closure(&mut self) -> bool {
        if self.given_up_if_dropped() {
            return false;
        }
        let probed = self.probe("").await;
        self.after(&probed);
        matches!(probed, Err(e) if e.sqlstate() == Some("25P01"))
    }

    /// A statement whose future was dropped before its answer came (see `in_flight`)
    /// ran, or runs, on the server, though the closure never saw it end: the
    /// transaction is given up as after a timeout (cancelled and rolled back in the
    /// background), so later statements and `COMMIT` get [`Error::RolledBack`]. Before,
    /// `COMMIT` committed it.
    /// Returns whether it gave the transaction up.
    fn given_up_if_dropped(&mut self) -> bool {
        let dropped = self.in_flight.swap(false, std::sync::atomic::Ordering::Relaxed);
        if dropped {
            self.abandoned = true;
            drop(self.client.take());
        }
        dropped
    }

    fn client(&self) -> Result<&deadpool_postgres::Object> {
        if self.abandoned {
            return Err(Error::RolledBack { host: self.route.host.clone(), shard: self.route.shard });
        }
        self.client
            .as_ref()
            .ok_or_else(|| Error::Invalid { what: "the transaction has already ended".into() })?
            .client()
    }

    /// Notes what a statement's outcome means for the transaction. One that ran out of
    /// time ends it: its connection is given up on (the statement cancelled on the
    /// server, the transaction rolled back), so the statement neither runs on holding its
    /// locks nor holds up the statements sent after it. Later statements, and `COMMIT`,
    /// get [`Error::RolledBack`].
    fn after<T>(&mut self, result: &Result<T>) {
        match result {
            Err(e) if e.is_moved() => self.moved = true,
            Err(Error::Timeout { .. }) => {
                self.abandoned = true;
                // Given up on: cancelled and rolled back in the background.
                drop(self.client.take());
            }
            _ => {}
        }
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

    /// Runs one statement of the caller's SQL, prepared for this call only: it
    /// resolves names through the transaction's `search_path`, which differs from shard
    /// to shard on one pooled connection, so a statement prepared in one shard is not
    /// valid in another (its types, an enum of the schema say, are another shard's).
    /// The statement is closed when dropped here, before anything else is sent on the
    /// connection (the driver queues the `Close` at once), so before `COMMIT`: behind a
    /// transaction-mode pooler its name never outlives the transaction.
    async fn run(
        &mut self,
        what: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        count_only: bool,
    ) -> Result<(Vec<Row>, u64)> {
        let _ = self.given_up_if_dropped();
        let route = &self.route;
        let client = self.client()?;
        let work = async {
            let fail = |e| statement::pooler_hint(Error::host(&route.host, Some(route.shard), what, e));
            let statement = client.prepare(sql).await.map_err(fail)?;
            let sent =
                |e| statement_error(&route.host, Some(route.shard), what, e, statement.params(), params);
            if count_only {
                Ok((Vec::new(), client.execute(&statement, params).await.map_err(sent)?))
            } else {
                let rows = client.query(&statement, params).await.map_err(sent)?;
                let n = u64::try_from(rows.len()).unwrap_or(u64::MAX);
                Ok((rows, n))
            }
        };
        self.in_flight.store(true, std::sync::atomic::Ordering::Relaxed);
        let result = within(&route.host, self.timeout, work).await;
        self.in_flight.store(false, std::sync::atomic::Ordering::Relaxed);
        self.after(&result);
        result
    }

    /// Runs one of the typed operations' statements on table `E` as an unnamed
    /// statement ([`crate::statement`]), and checks that every row it returns is of the
    /// transaction's shard.
    async fn rows_of<E: Entity>(
        &mut self,
        what: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        kinds: &[Param<'_>],
        returned: &[&str],
    ) -> Result<Vec<Row>> {
        let _ = self.given_up_if_dropped();
        let (route, cluster) = (&self.route, self.cluster);
        let client = self.client()?;
        let work = async {
            let rows =
                statement::run(cluster, client, route, E::TABLE, returned, what, sql, params, kinds).await?;
            check_rows(cluster.layout(), &route.host, what, &[route.shard], &rows)?;
            Ok(rows)
        };
        self.in_flight.store(true, std::sync::atomic::Ordering::Relaxed);
        let result = within(&route.host, self.timeout, work).await;
        self.in_flight.store(false, std::sync::atomic::Ordering::Relaxed);
        self.after(&result);
        result
    }

    fn check_shard(&self, what: &'static str, shard: LogicalShard) -> Result<()> {
        if shard == self.route.shard {
            Ok(())
        } else {
            Err(Error::WrongShard { what, shard, transaction: self.route.shard })
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
    /// identifier, [`Error::Invalid`] when `values()` does not give one value per
    /// column (nothing is sent either way); [`Error::Host`]; [`Error::Timeout`].
    pub async fn insert<N: NewRow>(&mut self, new: &N) -> Result<N::Entity> {
        check_new_row::<N>()?;
        check_values::<N>(new)?;
        self.check_shard("insert", self.cluster.route_key(new.shard_key())?.shard)?;
        let sql = self.cluster.sql::<N::Entity>()?.insert(&self.route.schema, N::COLUMNS, 1);
        let kinds: Vec<Param<'_>> = N::COLUMNS.iter().map(|c| Param::Column(c)).collect();
        let rows =
            self.rows_of::<N::Entity>("insert", &sql, &new.values(), &kinds, N::Entity::COLUMNS).await?;
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
        let sql = self.cluster.sql::<E>()?.get(&self.route.schema);
        Ok(Self::rows(&self.rows_of::<E>("get", &sql, &[&id], &[Param::Column("id")], E::COLUMNS).await?)?
            .pop())
    }

    /// Sets `columns` of the row with `id`; returns it as it now is.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidIdentifier`] for a column `E` does not declare, [`Error::Invalid`]
    /// for the column that places the row in its shard (its user or parent column); as
    /// [`ShardTx::get`].
    pub async fn update<E: Entity>(
        &mut self,
        id: Id,
        set: &[(&str, &(dyn ToSql + Sync))],
    ) -> Result<Option<E>> {
        let columns = check_update::<E>(set)?;
        self.check_shard("update", self.cluster.route_id(id)?.shard)?;
        let sql = self.cluster.sql::<E>()?.update(&self.route.schema, &columns);
        let mut values: Vec<&(dyn ToSql + Sync)> = vec![&id];
        values.extend(set.iter().map(|(_, v)| *v));
        let mut kinds = vec![Param::Column("id")];
        kinds.extend(columns.iter().map(|c| Param::Column(c)));
        Ok(Self::rows(&self.rows_of::<E>("update", &sql, &values, &kinds, E::COLUMNS).await?)?.pop())
    }

    /// Deletes the row with `id`; returns whether there was one.
    ///
    /// # Errors
    ///
    /// As [`ShardTx::get`].
    pub async fn delete<E: Entity>(&mut self, id: Id) -> Result<bool> {
        self.check_shard("delete", self.cluster.route_id(id)?.shard)?;
        let sql = self.cluster.sql::<E>()?.delete(&self.route.schema);
        Ok(!self.rows_of::<E>("delete", &sql, &[&id], &[Param::Column("id")], &["id"]).await?.is_empty())
    }

    /// Runs SQL of the caller's in this shard: unqualified names resolve in the shard's
    /// schema (`search_path`), values are bind parameters. Returns the rows.
    ///
    /// # Errors
    ///
    /// [`Error::Host`] (with the SQLSTATE); [`Error::Timeout`].
    pub async fn query(&mut self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>> {
        Ok(self.run("query", sql, params, false).await?.0)
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
    /// again from the start on the shard's new host (at most three runs in all, for a
    /// map two moves behind). So `work` should have no effect outside the transaction,
    /// or effects that tolerate running more than once.
    ///
    /// # Errors
    ///
    /// `work`'s error; [`Error::Host`] / [`Error::Pool`] / [`Error::Timeout`] for
    /// `BEGIN` and `COMMIT`. A `COMMIT` that fails with a lost connection leaves the
    /// outcome unknown, as in any database. [`Error::RolledBack`] when `work` returned
    /// `Ok` but a statement inside it had failed (its error handled by `work`): Postgres
    /// aborted the transaction, so nothing of it was applied.
    pub async fn transaction<'env, T, Er, F>(&'env self, shard: LogicalShard, work: F) -> Result<T, Er>
    where
        F: for<'t> FnMut(&'t mut ShardTx<'env>) -> BoxFuture<'t, Result<T, Er>>,
        Er: From<Error>,
    {
        let timeout = self.options().host_timeout;
        // A shard the cluster has (a map change never changes the count).
        let shard = shard.within(self.map().count()).map_err(|e| Er::from(Error::from(e)))?;
        // Each run borrows `work` in turn; the lock is never contended.
        let work = &tokio::sync::Mutex::new(work);
        self.with_move_retry(|map, _| async move {
            let route = map.route(shard, self.prefix());
            let (object, cancel) = self.client_and_cancel(&route.host).await.map_err(|e| {
                let moved = e.is_moved();
                Failed::new(Er::from(e), moved, [shard])
            })?;
            let client = Pinned::new(object, Some(cancel));
            let begin = format!("BEGIN; {}", enter_schema(&route.schema, false));
            let mut tx = ShardTx {
                client: Some(client),
                cluster: self,
                route,
                timeout,
                moved: false,
                abandoned: false,
                in_flight: std::sync::atomic::AtomicBool::new(false),
            };
            let (host, c) = (&tx.route.host, tx.client()?);
            let begun = within(host, timeout, async {
                c.batch_execute(&begin).await.map_err(|e| Error::host(host, Some(shard), "begin", e))
            })
            .await;
            // A `BEGIN` that ran out of time gives the connection up at once (the
            // rollback below is then not sent to a host that does not answer).
            tx.after(&begun);
            if let Err(e) = begun {
                // The shard's schema is gone from here: it moved, or is fenced for a move.
                let moved = begin_finds_schema_gone(e.sqlstate());
                // Rolled back on the same connection, which then goes back to the pool
                // (a rollback that fails leaves it to be given up on, as below).
                let _ = tx.rollback().await;
                return Err(Failed::new(Er::from(e), moved, [shard]));
            }
            let mut work = work.lock().await;
            match (*work)(&mut tx).await {
                Ok(value) => match tx.commit().await {
                    Ok(()) => Ok(value),
                    // Rolled back because the shard moved (the closure handled the error):
                    // run it again on the shard's new host, as for an `Err`.
                    Err(e @ Error::RolledBack { .. }) => Err(Failed::new(e.into(), tx.moved, [shard])),
                    Err(e) => Err(e.into()),
                },
                Err(e) => {
                    if tx.ended_by_closure().await {
                        // Not in a transaction: nothing to end; the connection is clean.
                        tx.release();
                        let ended = Error::TransactionEnded { host: tx.route.host.clone(), shard };
                        return Err(Failed::new(ended.into(), false, [shard]));
                    }
                    // A rollback that fails leaves the connection to be given up on
                    // (Drop), which rolls back as well.
                    let _ = tx.rollback().await;
                    Err(Failed::new(e, tx.moved, [shard]))
                }
            }
        })
        .await
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
        let work = &work;
        self.on_every_shard(|shard| self.transaction(shard, work)).await
    }

    /// Runs `run` for every shard, several at a time (interleaved over the hosts, a few
    /// per host); returns each shard's outcome, in shard order. The one scheduler of
    /// work on every shard ([`Cluster::for_each_shard`], and sqlx's).
    pub(crate) async fn on_every_shard<'a, T, Fut>(
        &'a self,
        run: impl Fn(LogicalShard) -> Fut,
    ) -> Vec<(LogicalShard, T)>
    where
        Fut: std::future::Future<Output = T> + 'a,
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
        // At most `per_host_jobs` on any host at once, also once the other hosts are
        // done (the tail of the order is one host's): the rest of its pool stays free
        // for the application's own requests.
        let limits: HashMap<&HostName, tokio::sync::Semaphore> =
            map.hosts().iter().map(|h| (h, tokio::sync::Semaphore::new(per_host_jobs))).collect();
        let (run, limits, map) = (&run, &limits, &map);
        let mut results: Vec<(LogicalShard, T)> = futures::stream::iter(order)
            .map(|shard| async move {
                // A closed semaphore never happens (none is closed); then no limit.
                let _turn = match limits.get(map.host_of(shard)) {
                    Some(limit) => limit.acquire().await.ok(),
                    None => None,
                };
                (shard, run(shard).await)
            })
            .buffer_unordered(hosts * per_host_jobs)
            .collect()
            .await;
        results.sort_by_key(|(s, _)| *s);
        results
    }
}
