//! [`Repo`]: routed reads and writes of one [`Entity`].
//!
//! Every statement is built in [`Sql`] (the one place SQL text is made: identifiers
//! checked and quoted, values always bind parameters) and runs on the host the map gives
//! for the shard: from the user for inserts and pages, from the ID itself for reads by
//! ID. A statement that finds its shard's schema missing (the shard moved) reloads the
//! map and, if the shard now lives on another host, runs once more there; a statement
//! that failed did not commit, so running it again is safe.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::marker::PhantomData;
use std::time::SystemTime;

use futures::StreamExt as _;
use shardline_id::Id;
use shardline_router::{HostName, LogicalShard, Route, SchemaName};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use crate::cluster::Cluster;
use crate::entity::{Entity, NewRow, ShardKey, check_entity, check_new_row, check_update};
use crate::{Error, Result};

/// The SQL of one entity, made once.
#[derive(Debug)]
pub(crate) struct Sql {
    table: String,
    columns: String,
}

impl Sql {
    pub(crate) fn new<E: Entity>() -> Result<Sql> {
        check_entity::<E>()?;
        Ok(Sql {
            table: format!("\"{}\"", E::TABLE),
            columns: E::COLUMNS.iter().map(|c| format!("\"{c}\"")).collect::<Vec<_>>().join(", "),
        })
    }

    pub(crate) fn qualified(&self, schema: &SchemaName) -> String {
        format!("{}.{}", schema.quoted(), self.table)
    }

    pub(crate) fn insert(&self, schema: &SchemaName, columns: &[&str], rows: usize) -> String {
        format!("{} RETURNING {}", self.insert_values(schema, columns, rows, 0), self.columns)
    }

    /// `INSERT INTO schema.table (columns) VALUES ...` of `rows` rows, binds from `$(first+1)`.
    fn insert_values(&self, schema: &SchemaName, columns: &[&str], rows: usize, first: usize) -> String {
        let names = columns.iter().map(|c| format!("\"{c}\"")).collect::<Vec<_>>().join(", ");
        let values = (0..rows)
            .map(|r| {
                let row = (1..=columns.len()).map(|i| format!("${}", first + r * columns.len() + i));
                format!("({})", row.collect::<Vec<_>>().join(", "))
            })
            .collect::<Vec<_>>()
            .join(", ");
        format!("INSERT INTO {} ({names}) VALUES {values}", self.qualified(schema))
    }

    /// Inserts into several shards of one host in one statement: part `i` inserts
    /// `parts[i].1` rows into `parts[i].0`; the rows come back tagged with `i` in
    /// column `shardline_part`.
    fn insert_parts(&self, parts: &[(&SchemaName, usize)], columns: &[&str]) -> String {
        let mut first = 0;
        let mut ctes = Vec::with_capacity(parts.len());
        for (i, (schema, rows)) in parts.iter().enumerate() {
            let insert = self.insert_values(schema, columns, *rows, first);
            ctes.push(format!("p{i} AS ({insert} RETURNING {})", self.columns));
            first += rows * columns.len();
        }
        let selects = (0..parts.len())
            .map(|i| format!("SELECT {i} AS \"shardline_part\", * FROM p{i}"))
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        format!("WITH {} {selects}", ctes.join(", "))
    }

    pub(crate) fn get(&self, schema: &SchemaName) -> String {
        format!("SELECT {} FROM {} WHERE \"id\" = $1", self.columns, self.qualified(schema))
    }

    /// One statement for many shards of one host: `$n` is shard n's array of IDs.
    fn get_many(&self, schemas: &[&SchemaName]) -> String {
        schemas
            .iter()
            .enumerate()
            .map(|(i, s)| {
                format!("SELECT {} FROM {} WHERE \"id\" = ANY(${})", self.columns, self.qualified(s), i + 1)
            })
            .collect::<Vec<_>>()
            .join(" UNION ALL ")
    }

    pub(crate) fn update(&self, schema: &SchemaName, columns: &[&str]) -> String {
        let set = columns
            .iter()
            .enumerate()
            .map(|(i, c)| format!("\"{c}\" = ${}", i + 2))
            .collect::<Vec<_>>()
            .join(", ");
        format!("UPDATE {} SET {set} WHERE \"id\" = $1 RETURNING {}", self.qualified(schema), self.columns)
    }

    pub(crate) fn delete(&self, schema: &SchemaName) -> String {
        format!("DELETE FROM {} WHERE \"id\" = $1 RETURNING \"id\"", self.qualified(schema))
    }

    /// The rows whose `column` is `$1`, newest first, IDs below `$2`, at most `$3`.
    fn page(&self, schema: &SchemaName, column: &str) -> String {
        format!(
            "SELECT {} FROM {} WHERE \"{column}\" = $1 AND \"id\" < $2 ORDER BY \"id\" DESC LIMIT $3",
            self.columns,
            self.qualified(schema),
        )
    }

    /// Rows with IDs in `[$1, $2]` across many shards of one host, newest first, at most
    /// `$3`: each shard's part reads its primary key backwards and stops at the limit.
    fn window(&self, schemas: &[&SchemaName]) -> String {
        let parts = schemas
            .iter()
            .map(|s| {
                format!(
                    "(SELECT {} FROM {} WHERE \"id\" BETWEEN $1 AND $2 ORDER BY \"id\" DESC LIMIT $3)",
                    self.columns,
                    self.qualified(s)
                )
            })
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        format!("SELECT * FROM ({parts}) AS w ORDER BY \"id\" DESC LIMIT $3")
    }
}

/// Reads and writes of entity `E`, routed. Cheap to clone.
#[derive(Debug)]
pub struct Repo<E> {
    cluster: Cluster,
    sql: std::sync::Arc<Sql>,
    /// The parameter types of each insert's column list (see `insert_types`).
    types: std::sync::Arc<std::sync::Mutex<HashMap<String, Vec<Type>>>>,
    _entity: PhantomData<fn() -> E>,
}

impl<E> Clone for Repo<E> {
    fn clone(&self) -> Self {
        Repo {
            cluster: self.cluster.clone(),
            sql: self.sql.clone(),
            types: self.types.clone(),
            _entity: PhantomData,
        }
    }
}

/// The result of [`Repo::get_many`]: rows in the caller's order, and the IDs not found.
#[derive(Debug)]
pub struct Many<E> {
    /// One entry per ID asked, in the same order: the row, or `None`.
    pub rows: Vec<Option<E>>,
    /// The IDs that were not found.
    pub missing: Vec<Id>,
}

/// One page of a user's rows, newest first.
#[derive(Debug)]
pub struct Page<E> {
    /// The rows.
    pub rows: Vec<E>,
    /// The cursor for the next page (the last row's ID), or `None` at the end.
    pub next: Option<Id>,
}

/// Shards a fan-out could not read, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Missing {
    /// The host that failed.
    pub host: String,
    /// The shards it holds, all missing from the result.
    pub shards: Vec<u16>,
    /// What went wrong.
    pub error: String,
}

/// The result of a fan-out: rows, and which shards are missing from them.
#[derive(Debug)]
pub struct FanOut<E> {
    /// The rows, newest first.
    pub rows: Vec<E>,
    /// Shards that could not be read. Empty when the result is complete.
    pub missing: Vec<Missing>,
}

impl<E> FanOut<E> {
    /// Whether every shard answered.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty()
    }
}

pub(crate) fn is_moved(e: &tokio_postgres::Error) -> bool {
    matches!(e.code(), Some(c) if *c == SqlState::INVALID_SCHEMA_NAME || *c == SqlState::UNDEFINED_TABLE)
}

impl Cluster {
    /// A repository of `E` on this cluster.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidIdentifier`] when `E`'s table or columns are not plain SQL
    /// identifiers (checked once, here).
    pub fn repo<E: Entity>(&self) -> Result<Repo<E>> {
        Ok(Repo {
            cluster: self.clone(),
            sql: std::sync::Arc::new(Sql::new::<E>()?),
            types: std::sync::Arc::default(),
            _entity: PhantomData,
        })
    }
}

impl<E: Entity> Repo<E> {
    /// Runs the statement `sql(schema)` with `params` on the shard's host (prepared
    /// once per connection), within the host timeout. When the shard's schema is not
    /// there, reloads the map and runs once more if the shard moved.
    async fn on_shard(
        &self,
        shard: LogicalShard,
        what: &'static str,
        sql: impl Fn(&SchemaName) -> String,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>> {
        let mut route = self.cluster.route(shard);
        let mut retried = false;
        loop {
            let result = self.attempt(&route, what, &sql(&route.schema), params).await;
            match result {
                Err(Error::Host { source: Some(ref e), .. }) if is_moved(e) && !retried => {
                    retried = true;
                    if !self.cluster.wait_for_move(&[(shard, route.host.clone())]).await? {
                        return result;
                    }
                    let now = self.cluster.route(shard);
                    tracing::debug!(shard = shard.get(), from = %route.host, to = %now.host, "shard moved; retrying");
                    route = now;
                }
                other => return other,
            }
        }
    }

    async fn attempt(
        &self,
        route: &Route,
        what: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>> {
        let timeout = self.cluster.options().host_timeout;
        let work = async {
            let client = self.cluster.client(&route.host).await?;
            let fail = |e| Error::host(&route.host, Some(route.shard), what, e);
            let statement = client.prepare_cached(sql).await.map_err(fail)?;
            client.query(&statement, params).await.map_err(fail)
        };
        tokio::time::timeout(timeout, work)
            .await
            .map_err(|_| Error::Timeout { host: route.host.to_string(), after: timeout })?
    }

    fn rows(rows: &[Row]) -> Result<Vec<E>> {
        rows.iter()
            .map(|r| E::from_row(r).map_err(|source| Error::Decode { table: E::TABLE, source }))
            .collect()
    }

    /// Inserts a row in its user's shard (the ID minted there) and returns it.
    ///
    /// # Errors
    ///
    /// [`Error::Host`] (see [`Error::is_unique_violation`]), [`Error::Timeout`], ...;
    /// [`Error::InvalidIdentifier`] for a column of `N` that is not a plain SQL
    /// identifier (nothing is sent).
    pub async fn insert<N: NewRow<Entity = E>>(&self, new: &N) -> Result<E> {
        check_new_row::<N>()?;
        let shard = self.cluster.route_key(new.shard_key())?.shard;
        let rows =
            self.on_shard(shard, "insert", |s| self.sql.insert(s, N::COLUMNS, 1), &new.values()).await?;
        Self::rows(&rows)?.pop().ok_or(Error::Empty { what: "insert" })
    }

    /// Inserts rows, grouped by host: one statement per host (each shard's rows one
    /// `INSERT` inside it), all hosts in parallel, so one round trip per host. Returns
    /// the rows in the order given. Atomic per host, not across hosts. A host's batch is
    /// split into several pipelined statements only past Postgres's 65,535 bind
    /// parameters.
    ///
    /// # Errors
    ///
    /// The first failure; rows of other hosts may have been inserted.
    pub async fn insert_many<N: NewRow<Entity = E>>(&self, new: &[N]) -> Result<Vec<E>> {
        check_new_row::<N>()?;
        if new.is_empty() {
            return Ok(Vec::new());
        }
        let map = self.cluster.map();
        let prefix = self.cluster.prefix();
        let mut by_host: HashMap<HostName, BTreeMap<u16, (Route, Vec<usize>)>> = HashMap::new();
        for (i, n) in new.iter().enumerate() {
            let route = match n.shard_key() {
                ShardKey::User(u) => map.route_user(u, prefix),
                ShardKey::Parent(id) => map.route_id(id, self.cluster.layout(), prefix)?,
            };
            let entry = by_host.entry(route.host.clone()).or_default();
            entry.entry(route.shard.get()).or_insert_with(|| (route, Vec::new())).1.push(i);
        }
        let hosts = by_host.into_iter().map(|(host, groups)| async move {
            let groups: Vec<(Route, Vec<usize>)> = groups.into_values().collect();
            match self.insert_on_host::<N>(&host, &groups, new).await {
                Err(Error::Host { source: Some(ref e), .. }) if is_moved(e) => {
                    // A stale map: shard by shard, through the path that reloads it.
                    let mut out = Vec::new();
                    for (route, idx) in &groups {
                        let values: Vec<&(dyn ToSql + Sync)> =
                            idx.iter().flat_map(|&i| new[i].values()).collect();
                        let sql = |s: &SchemaName| self.sql.insert(s, N::COLUMNS, idx.len());
                        let rows = self.on_shard(route.shard, "insert many", sql, &values).await?;
                        out.push((idx.clone(), Self::rows(&rows)?));
                    }
                    Ok(out)
                }
                other => other,
            }
        });
        let mut out: Vec<Option<E>> = (0..new.len()).map(|_| None).collect();
        for host in futures::future::join_all(hosts).await {
            for (idx, rows) in host? {
                for (&i, row) in idx.iter().zip(rows) {
                    out[i] = Some(row);
                }
            }
        }
        out.into_iter().map(|r| r.ok_or(Error::Empty { what: "insert many" })).collect()
    }

    /// The parameter types of `N`'s insert, learnt once from the prepared single-row
    /// insert (every shard has the same tables), so batches go in one round trip.
    async fn insert_types<N: NewRow<Entity = E>>(
        &self,
        client: &deadpool_postgres::Object,
        host: &HostName,
        route: &Route,
    ) -> Result<Vec<Type>> {
        let key = N::COLUMNS.join(",");
        if let Some(t) = self.types.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(t);
        }
        let sql = self.sql.insert(&route.schema, N::COLUMNS, 1);
        let statement = client
            .prepare_cached(&sql)
            .await
            .map_err(|e| Error::host(host, Some(route.shard), "insert many", e))?;
        let types = statement.params().to_vec();
        if let Ok(mut m) = self.types.lock() {
            m.insert(key, types.clone());
        }
        Ok(types)
    }

    /// One host's part of [`Repo::insert_many`]: each returned entry pairs input
    /// indices with their rows.
    async fn insert_on_host<N: NewRow<Entity = E>>(
        &self,
        host: &HostName,
        groups: &[(Route, Vec<usize>)],
        new: &[N],
    ) -> Result<Vec<(Vec<usize>, Vec<E>)>> {
        const MAX_PARAMS: usize = 65_535;
        let width = N::COLUMNS.len().max(1);
        let timeout = self.cluster.options().host_timeout;
        let work = async {
            let client = self.cluster.client(host).await?;
            let types = self.insert_types::<N>(&client, host, &groups[0].0).await?;
            // Chunks of (route, input indices) under the parameter limit.
            let mut chunks: Vec<Vec<(&Route, &[usize])>> = vec![Vec::new()];
            let mut used = 0;
            for (route, idx) in groups {
                for part in idx.chunks(MAX_PARAMS / width) {
                    if used + part.len() * width > MAX_PARAMS {
                        chunks.push(Vec::new());
                        used = 0;
                    }
                    used += part.len() * width;
                    if let Some(last) = chunks.last_mut() {
                        last.push((route, part));
                    }
                }
            }
            let statements = chunks.iter().map(|chunk| {
                let parts: Vec<(&SchemaName, usize)> =
                    chunk.iter().map(|(r, idx)| (&r.schema, idx.len())).collect();
                let sql = self.sql.insert_parts(&parts, N::COLUMNS);
                let values: Vec<Vec<&(dyn ToSql + Sync)>> =
                    chunk.iter().flat_map(|(_, idx)| idx.iter().map(|&i| new[i].values())).collect();
                let client = &client;
                let types = &types;
                async move {
                    let params: Vec<(&(dyn ToSql + Sync), Type)> = values
                        .iter()
                        .flat_map(|row| row.iter().zip(types.iter()).map(|(v, t)| (*v, t.clone())))
                        .collect();
                    let rows = client
                        .query_typed(&sql, &params)
                        .await
                        .map_err(|e| Error::host(host, None, "insert many", e))?;
                    let mut parts: Vec<(Vec<usize>, Vec<E>)> =
                        chunk.iter().map(|(_, idx)| (idx.to_vec(), Vec::with_capacity(idx.len()))).collect();
                    for row in &rows {
                        let part: i32 = row
                            .try_get("shardline_part")
                            .map_err(|source| Error::Decode { table: E::TABLE, source })?;
                        let e =
                            E::from_row(row).map_err(|source| Error::Decode { table: E::TABLE, source })?;
                        let slot = usize::try_from(part).ok().and_then(|p| parts.get_mut(p));
                        let (idx, got) =
                            slot.ok_or(Error::Empty { what: "insert many (a row of no part)" })?;
                        // RETURNING gives rows in VALUES order; check it rather than trust it.
                        let key = idx.get(got.len()).map(|&i| new[i].shard_key());
                        let stored = match key.and_then(ShardKey::column::<E>) {
                            Some(column) => Some(
                                row.try_get::<_, i64>(column)
                                    .map_err(|source| Error::Decode { table: E::TABLE, source })?,
                            ),
                            None => key.map(ShardKey::value),
                        };
                        if key.map(ShardKey::value) != stored {
                            return Err(Error::Invalid {
                                what: format!("insert many: {} returned rows out of order", E::TABLE),
                            });
                        }
                        got.push(e);
                    }
                    Ok::<_, Error>(parts)
                }
            });
            let mut out = Vec::new();
            for chunk in futures::future::join_all(statements).await {
                out.extend(chunk?);
            }
            Ok(out)
        };
        tokio::time::timeout(timeout, work)
            .await
            .map_err(|_| Error::Timeout { host: host.to_string(), after: timeout })?
    }

    /// The row with `id`: its shard is decoded from the ID, one query on its host.
    ///
    /// # Errors
    ///
    /// [`Error::Router`] for an ID whose shard the cluster does not have (no query is
    /// sent); [`Error::Host`]; [`Error::Timeout`].
    pub async fn get(&self, id: Id) -> Result<Option<E>> {
        let shard = self.cluster.route_id(id)?.shard;
        let rows = self.on_shard(shard, "get", |s| self.sql.get(s), &[&id]).await?;
        Ok(Self::rows(&rows)?.pop())
    }

    /// The rows with `ids`, one round trip per host (not per ID, not per shard), in the
    /// caller's order, with the IDs not found.
    ///
    /// # Errors
    ///
    /// [`Error::Router`] for an ID whose shard the cluster does not have (nothing is
    /// sent); the first host's failure.
    pub async fn get_many(&self, ids: &[Id]) -> Result<Many<E>> {
        let result = self.get_many_once(ids).await;
        match result {
            Err(Error::Host { source: Some(ref e), .. }) if is_moved(e) => {
                // A shard moved (or is moving) under a stale map: wait for the new map and
                // ask again, once.
                let map = self.cluster.map();
                let mut shards: Vec<(LogicalShard, HostName)> = ids
                    .iter()
                    .filter_map(|&id| map.route_id(id, self.cluster.layout(), self.cluster.prefix()).ok())
                    .map(|r| (r.shard, r.host))
                    .collect();
                shards.sort_by_key(|(s, _)| s.get());
                shards.dedup_by_key(|(s, _)| s.get());
                if !self.cluster.wait_for_move(&shards).await? {
                    return result;
                }
                self.get_many_once(ids).await
            }
            other => other,
        }
    }

    async fn get_many_once(&self, ids: &[Id]) -> Result<Many<E>> {
        let map = self.cluster.map();
        let prefix = self.cluster.prefix();
        let mut by_host: HashMap<HostName, BTreeMap<SchemaName, Vec<i64>>> = HashMap::new();
        for &id in ids {
            let route = map.route_id(id, self.cluster.layout(), prefix)?;
            by_host.entry(route.host).or_default().entry(route.schema).or_default().push(i64::from(id));
        }
        let timeout = self.cluster.options().host_timeout;
        let queries = by_host.into_iter().map(|(host, schemas)| async move {
            let names: Vec<&SchemaName> = schemas.keys().collect();
            let sql = self.sql.get_many(&names);
            let arrays: Vec<&Vec<i64>> = schemas.values().collect();
            let params: Vec<(&(dyn ToSql + Sync), Type)> =
                arrays.iter().map(|a| (*a as &(dyn ToSql + Sync), Type::INT8_ARRAY)).collect();
            let work = async {
                let client = self.cluster.client(&host).await?;
                client.query_typed(&sql, &params).await.map_err(|e| Error::host(&host, None, "get many", e))
            };
            tokio::time::timeout(timeout, work)
                .await
                .map_err(|_| Error::Timeout { host: host.to_string(), after: timeout })?
        });
        let mut found: HashMap<Id, E> = HashMap::new();
        for rows in futures::future::join_all(queries).await {
            for e in Self::rows(&rows?)? {
                found.insert(e.id(), e);
            }
        }
        let mut missing = Vec::new();
        let rows = ids
            .iter()
            .map(|id| {
                let row = found.remove(id);
                if row.is_none() {
                    missing.push(*id);
                }
                row
            })
            .collect();
        Ok(Many { rows, missing })
    }

    /// Sets `columns` of the row with `id`; returns the row as it now is, or `None` when
    /// there is no such row.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidIdentifier`] for a column `E` does not declare (nothing is sent);
    /// as [`Repo::get`].
    pub async fn update(&self, id: Id, set: &[(&str, &(dyn ToSql + Sync))]) -> Result<Option<E>> {
        let columns = check_update::<E>(set)?;
        let shard = self.cluster.route_id(id)?.shard;
        let mut values: Vec<&(dyn ToSql + Sync)> = vec![&id];
        values.extend(set.iter().map(|(_, v)| *v));
        let rows = self.on_shard(shard, "update", |s| self.sql.update(s, &columns), &values).await?;
        Ok(Self::rows(&rows)?.pop())
    }

    /// Deletes the row with `id`; returns whether there was one.
    ///
    /// # Errors
    ///
    /// As [`Repo::get`].
    pub async fn delete(&self, id: Id) -> Result<bool> {
        let shard = self.cluster.route_id(id)?.shard;
        let rows = self.on_shard(shard, "delete", |s| self.sql.delete(s), &[&id]).await?;
        Ok(!rows.is_empty())
    }

    /// A page of `user_id`'s rows, newest first: at most `limit`, with IDs below `before`
    /// (the previous page's [`Page::next`]; `None` for the first page). Keyset paging on
    /// the primary key: page 1000 costs what page 1 costs.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when `E` has no [`Entity::USER_COLUMN`]; as [`Repo::get`].
    pub async fn page_of_user(&self, user_id: i64, before: Option<Id>, limit: u32) -> Result<Page<E>> {
        let column = E::USER_COLUMN
            .ok_or_else(|| Error::Invalid { what: format!("{} has no user column to page by", E::TABLE) })?;
        self.page(self.cluster.route_user(user_id).shard, column, user_id, before, limit).await
    }

    /// A page of the rows that live beside `parent` (a photo's comments), newest first,
    /// paged as [`Repo::page_of_user`]; one query on the parent's shard.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] when `E` has no [`Entity::PARENT_COLUMN`]; as [`Repo::get`].
    pub async fn page_of_parent(&self, parent: Id, before: Option<Id>, limit: u32) -> Result<Page<E>> {
        let column = E::PARENT_COLUMN.ok_or_else(|| Error::Invalid {
            what: format!("{} has no parent column to page by", E::TABLE),
        })?;
        self.page(self.cluster.route_id(parent)?.shard, column, i64::from(parent), before, limit).await
    }

    async fn page(
        &self,
        shard: LogicalShard,
        column: &str,
        key: i64,
        before: Option<Id>,
        limit: u32,
    ) -> Result<Page<E>> {
        let below = before.map_or(i64::MAX, i64::from);
        let n = i64::from(limit);
        let rows = self.on_shard(shard, "page", |s| self.sql.page(s, column), &[&key, &below, &n]).await?;
        let rows = Self::rows(&rows)?;
        let next = if rows.len() == usize::try_from(limit).unwrap_or(usize::MAX) {
            rows.last().map(Entity::id)
        } else {
            None
        };
        Ok(Page { rows, next })
    }

    /// The newest rows created in `[from, to]` across every shard, at most `limit`: the
    /// window's ID range, one query per host in parallel (at most
    /// [`crate::ClusterOptions::fan_out`] at once, each within the host timeout), merged
    /// by ID. A host that fails or times out does not fail the call: its shards are
    /// listed in [`FanOut::missing`], never silently left out. A host that finds one of
    /// its shards fenced by a move is asked again once the move flips (or ends).
    ///
    /// # Errors
    ///
    /// [`Error::Id`] when the window is outside the ID layout.
    pub async fn created_between(&self, from: SystemTime, to: SystemTime, limit: usize) -> Result<FanOut<E>> {
        let (out, moved) = self.created_between_once(from, to, limit).await?;
        // A host that found one of its shards fenced by a move: wait for the flip (as a
        // single statement would), then ask every host once more.
        if !moved.is_empty() && self.cluster.wait_for_move(&moved).await? {
            return Ok(self.created_between_once(from, to, limit).await?.0);
        }
        Ok(out)
    }

    /// One fan-out, with the shards of the hosts that failed because a shard's schema
    /// was gone (moved or fenced).
    async fn created_between_once(
        &self,
        from: SystemTime,
        to: SystemTime,
        limit: usize,
    ) -> Result<(FanOut<E>, Vec<(LogicalShard, HostName)>)> {
        let layout = self.cluster.layout();
        let lo = i64::from(layout.min_id_at(unix_ms(from)?)?);
        let hi = i64::from(layout.max_id_at(unix_ms(to)?)?);
        let n = i64::try_from(limit).unwrap_or(i64::MAX);
        let map = self.cluster.map();
        let prefix = self.cluster.prefix();
        let timeout = self.cluster.options().host_timeout;
        let hosts: Vec<(HostName, Vec<LogicalShard>)> = map
            .hosts()
            .iter()
            .map(|h| (h.clone(), map.shards_of(h).collect::<Vec<_>>()))
            .filter(|(_, s)| !s.is_empty())
            .collect();
        let results = futures::stream::iter(hosts)
            .map(|(host, shards)| async move {
                let schemas: Vec<SchemaName> = shards.iter().map(|s| prefix.schema(*s)).collect();
                let sql = self.sql.window(&schemas.iter().collect::<Vec<_>>());
                let work = async {
                    let client = self.cluster.client(&host).await?;
                    client
                        .query_typed(&sql, &[(&lo, Type::INT8), (&hi, Type::INT8), (&n, Type::INT8)])
                        .await
                        .map_err(|e| Error::host(&host, None, "fan-out", e))
                };
                let result = match tokio::time::timeout(timeout, work).await {
                    Ok(r) => r.and_then(|rows| Self::rows(&rows)),
                    Err(_) => Err(Error::Timeout { host: host.to_string(), after: timeout }),
                };
                (host, shards, result)
            })
            .buffer_unordered(self.cluster.options().fan_out.max(1))
            .collect::<Vec<_>>()
            .await;
        let mut missing = Vec::new();
        let mut moved = Vec::new();
        let mut lists: Vec<std::vec::IntoIter<E>> = Vec::new();
        for (host, shards, result) in results {
            match result {
                Ok(rows) => lists.push(rows.into_iter()),
                Err(e) => {
                    if let Error::Host { source: Some(ref pg), .. } = e
                        && is_moved(pg)
                    {
                        moved.extend(shards.iter().map(|s| (*s, host.clone())));
                    } else {
                        tracing::warn!(%host, error = %e, "fan-out: host missing from the result");
                    }
                    missing.push(Missing {
                        host: host.to_string(),
                        shards: shards.iter().map(|s| s.get()).collect(),
                        error: e.to_string(),
                    });
                }
            }
        }
        Ok((FanOut { rows: merge_newest_first(lists, limit), missing }, moved))
    }
}

fn unix_ms(t: SystemTime) -> Result<i64> {
    t.duration_since(std::time::UNIX_EPOCH)
        .ok()
        .and_then(|d| i64::try_from(d.as_millis()).ok())
        .ok_or_else(|| Error::Invalid { what: format!("the time {t:?} is before 1970 or too far ahead") })
}

/// A k-way merge of lists each sorted newest first, stopping at `limit`.
fn merge_newest_first<E: Entity>(mut lists: Vec<std::vec::IntoIter<E>>, limit: usize) -> Vec<E> {
    let mut heads: Vec<Option<E>> = lists.iter_mut().map(Iterator::next).collect();
    let mut heap: BinaryHeap<(Id, Reverse<usize>)> =
        heads.iter().enumerate().filter_map(|(i, h)| h.as_ref().map(|e| (e.id(), Reverse(i)))).collect();
    let mut out = Vec::with_capacity(limit.min(1024));
    while out.len() < limit {
        let Some((_, Reverse(i))) = heap.pop() else { break };
        if let Some(e) = heads[i].take() {
            out.push(e);
        }
        if let Some(next) = lists[i].next() {
            heap.push((next.id(), Reverse(i)));
            heads[i] = Some(next);
        }
    }
    out
}
