//! [`Repo`]: routed reads and writes of one [`Entity`].
//!
//! Every statement is built in `Sql` (the one place SQL text is made: identifiers
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
use shardline_id::ident::quote;
use shardline_router::{HostName, LogicalShard, Route, SchemaName, ShardMap};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use crate::cluster::{Cluster, Failed, Run};
use crate::entity::{Entity, NewRow, ShardKey, check_entity, check_new_row, check_update, check_values};
use crate::shard::Pinned;
use crate::statement::{self, Param, check_rows};
use crate::{Error, Result, statement_error};

/// A host's rows of a batch: per shard, its route and the input indices.
type Groups = Vec<(Route, Vec<usize>)>;

/// A host's part of [`Repo::insert_many`] that failed: the hosts that committed their
/// rows all the same (after a move sent the part to several hosts), and the failure.
#[derive(Debug)]
struct PartFailed<E> {
    committed: Vec<HostName>,
    rows: Vec<(usize, E)>,
    error: Error,
}

impl<E> From<Error> for PartFailed<E> {
    fn from(error: Error) -> Self {
        PartFailed { committed: Vec::new(), rows: Vec::new(), error }
    }
}

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
            table: quote(E::TABLE),
            columns: E::COLUMNS.iter().map(|c| quote(c)).collect::<Vec<_>>().join(", "),
        })
    }

    pub(crate) fn qualified(&self, schema: &SchemaName) -> String {
        format!("{}.{}", schema.quoted(), self.table)
    }

    /// The condition that fails a read of a copy that is not the shard's
    /// ([`crate::LIVE_CHECK`]); `true` on the shard's own.
    fn live(schema: &SchemaName) -> String {
        format!("{}.{}()", schema.quoted(), crate::LIVE_CHECK)
    }

    pub(crate) fn insert(&self, schema: &SchemaName, columns: &[&str], rows: usize) -> String {
        format!("{} RETURNING {}", self.insert_values(schema, columns, rows, 0), self.columns)
    }

    /// `INSERT INTO schema.table (columns) VALUES ...` of `rows` rows, binds from `$(first+1)`.
    fn insert_values(&self, schema: &SchemaName, columns: &[&str], rows: usize, first: usize) -> String {
        let names = columns.iter().map(|c| quote(c)).collect::<Vec<_>>().join(", ");
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
    /// column [`statement::INSERT_PART`].
    /// `select` is the `RETURNING` list ([`Repo::across_select`]).
    fn insert_parts(&self, parts: &[(&SchemaName, usize)], columns: &[&str], select: &str) -> String {
        let mut first = 0;
        let mut ctes = Vec::with_capacity(parts.len());
        for (i, (schema, rows)) in parts.iter().enumerate() {
            let insert = self.insert_values(schema, columns, *rows, first);
            ctes.push(format!("p{i} AS ({insert} RETURNING {select})"));
            first += rows * columns.len();
        }
        let selects = (0..parts.len())
            .map(|i| format!("SELECT {i} AS {}, * FROM p{i}", statement::INSERT_PART))
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        format!("WITH {} {selects}", ctes.join(", "))
    }

    pub(crate) fn get(&self, schema: &SchemaName) -> String {
        format!(
            "SELECT {} FROM {} WHERE \"id\" = $1 AND {}",
            self.columns,
            self.qualified(schema),
            Sql::live(schema)
        )
    }

    /// One statement for many shards of one host: `$n` is shard n's array of IDs.
    /// `select` is the select list of statements that span schemas
    /// ([`Repo::across_select`]).
    fn get_many(&self, schemas: &[&SchemaName], select: &str) -> String {
        schemas
            .iter()
            .enumerate()
            .map(|(i, s)| {
                format!(
                    "SELECT {select} FROM {} WHERE \"id\" = ANY(${}) AND {}",
                    self.qualified(s),
                    i + 1,
                    Sql::live(s)
                )
            })
            .collect::<Vec<_>>()
            .join(" UNION ALL ")
    }

    pub(crate) fn update(&self, schema: &SchemaName, columns: &[&str]) -> String {
        let set = columns
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{} = ${}", quote(c), i + 2))
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
            "SELECT {} FROM {} WHERE {} = $1 AND \"id\" < $2 AND {} ORDER BY \"id\" DESC LIMIT $3",
            self.columns,
            self.qualified(schema),
            quote(column),
            Sql::live(schema)
        )
    }

    /// Rows with IDs in `[$1, $2]` across many shards of one host, newest first, at most
    /// `$3`: each shard's part reads its primary key backwards and stops at the limit.
    /// Each row carries the shard whose schema it came from
    /// ([`statement::BRANCH_SHARD`]), so each is checked against its own shard.
    fn window(&self, schemas: &[(LogicalShard, &SchemaName)], select: &str) -> String {
        let parts = schemas
            .iter()
            .map(|(shard, s)| {
                format!(
                    "(SELECT {select}, {}::int4 AS {} FROM {} WHERE \"id\" BETWEEN $1 AND $2 AND {} ORDER BY \"id\" DESC LIMIT $3)",
                    shard.get(),
                    statement::BRANCH_SHARD,
                    self.qualified(s),
                    Sql::live(s)
                )
            })
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        format!("SELECT * FROM ({parts}) AS w ORDER BY \"id\" DESC LIMIT $3")
    }

    /// How many rows have IDs in `[$1, $2]` in each of many shards of one host (`$3`,
    /// the limit of [`Sql::window`], is declared and unused: both take the same
    /// parameters). One row per shard: the shard ([`statement::BRANCH_SHARD`]), its
    /// count, and as `id` the lowest counted ID that another shard minted (`NULL` when
    /// there is none), so a row in the wrong schema is found as a read of its rows
    /// finds it ([`check_rows`]), at the price of one `&` per row counted.
    fn count(&self, schemas: &[(LogicalShard, &SchemaName)], layout: shardline_id::Layout) -> String {
        let mask = i64::from(layout.max_shard()) << layout.shard_shift();
        schemas
            .iter()
            .map(|(shard, s)| {
                let part = i64::from(shard.get()) << layout.shard_shift();
                format!(
                    "(SELECT {}::int4 AS {}, count(*) AS n, min(\"id\") FILTER (WHERE (\"id\" & {mask}::int8) <> {part}::int8) AS \"id\" FROM {} WHERE \"id\" BETWEEN $1 AND $2 AND {})",
                    shard.get(),
                    statement::BRANCH_SHARD,
                    self.qualified(s),
                    Sql::live(s)
                )
            })
            .collect::<Vec<_>>()
            .join(" UNION ALL ")
    }
}

/// Reads and writes of entity `E`, routed. Cheap to clone.
#[derive(Debug)]
pub struct Repo<E> {
    cluster: Cluster,
    sql: std::sync::Arc<Sql>,
    /// The parameter types of each insert's column list (see `insert_types`).
    types: std::sync::Arc<std::sync::Mutex<HashMap<String, Vec<Type>>>>,
    /// The select list of statements that span schemas (see `across_select`), learnt once.
    across: std::sync::Arc<std::sync::OnceLock<String>>,
    _entity: PhantomData<fn() -> E>,
}

impl<E> Clone for Repo<E> {
    fn clone(&self) -> Self {
        Repo {
            cluster: self.cluster.clone(),
            sql: self.sql.clone(),
            types: self.types.clone(),
            across: self.across.clone(),
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
    /// The cursor for the next page (the last row's ID), or `None` at the end: when no
    /// row is left below this page (a page that ends exactly at the last row has none).
    pub next: Option<Id>,
}

/// Shards a fan-out could not read, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Missing {
    /// The host that failed.
    pub host: HostName,
    /// The shards it holds, all missing from the result.
    pub shards: Vec<LogicalShard>,
    /// What went wrong.
    pub error: String,
}

/// The result of a fan-out: rows, and which shards are missing from them.
#[derive(Debug)]
pub struct FanOut<E> {
    /// The rows, newest first.
    pub rows: Vec<E>,
    /// When more rows follow the page, the last row's ID: pass it as `before` to
    /// [`Repo::newest`] for the next page. `None` when there are no more (a page that
    /// ends exactly at the last row has none). (Of [`Repo::created_between`]: the
    /// window holds more rows below it, and [`Repo::newest`] from it reads on past the
    /// window's start.)
    pub next: Option<Id>,
    /// Shards that could not be read. Empty when the result is complete.
    pub missing: Vec<Missing>,
}

impl<E> FanOut<E> {
    /// Whether every shard answered.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty()
    }
}

/// The result of a count over every shard: the rows counted, and which shards are
/// missing from the count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counted {
    /// Rows in the shards that answered.
    pub count: u64,
    /// Shards that could not be read (not counted). Empty when the count is complete.
    pub missing: Vec<Missing>,
}

impl Counted {
    /// Whether every shard answered.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty()
    }
}

/// What a fan-out asks every shard, over the IDs in `[lo, hi]`.
#[derive(Debug, Clone, Copy)]
enum Ask {
    /// The newest `limit` rows.
    Newest { lo: i64, hi: i64, limit: usize },
    /// How many rows.
    Count { lo: i64, hi: i64 },
}

/// What one statement of a fan-out read.
enum Part<E> {
    Rows(Vec<E>),
    Count(u64),
}

/// What one fan-out gathered: each statement's rows (newest first) or count, and the
/// shards that could not be read.
struct Gathered<E> {
    lists: Vec<std::vec::IntoIter<E>>,
    count: u64,
    missing: Vec<Missing>,
}

pub(crate) fn is_moved(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|c| is_moved_sqlstate(c.code()))
}

/// Whether `sqlstate` says a statement may have found its shard's schema missing:
/// 3F000; or, for a name looked up through a `search_path` whose schema is gone (a
/// shard transaction's raw SQL), 42P01 for a table, 42883 for a function, 42704 for a
/// type. Whether the shard really moved is then the catalog's to say
/// ([`Cluster::wait_for_move`]): a name that is missing with the schema there fails as
/// it is.
pub(crate) fn is_moved_sqlstate(sqlstate: &str) -> bool {
    [
        SqlState::INVALID_SCHEMA_NAME,
        SqlState::UNDEFINED_TABLE,
        SqlState::UNDEFINED_FUNCTION,
        SqlState::UNDEFINED_OBJECT,
    ]
    .iter()
    .any(|s| s.code() == sqlstate)
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
            sql: self.sql::<E>()?,
            types: std::sync::Arc::default(),
            across: std::sync::Arc::default(),
            _entity: PhantomData,
        })
    }
}

impl<E: Entity> Repo<E> {
    /// Runs the statement `sql(schema)` with `params` (of `kinds`) on the shard's host
    /// as one unnamed statement ([`crate::statement`]), within the host timeout, through
    /// the cluster's one retry path for a stale map ([`Cluster::with_move_retry`]). Every
    /// row that comes back is checked to be of `shard` ([`check_rows`]). `returned` are
    /// the columns the statement returns.
    async fn on_shard(
        &self,
        shard: LogicalShard,
        what: &'static str,
        sql: impl Fn(&SchemaName) -> String,
        params: &[&(dyn ToSql + Sync)],
        kinds: &[Param<'_>],
        returned: &[&str],
    ) -> Result<Vec<Row>> {
        let prefix = self.cluster.prefix();
        self.cluster
            .with_move_retry(|map, _| {
                let route = map.route(shard, prefix);
                let sql = sql(&route.schema);
                async move {
                    self.attempt(&route, what, &sql, params, kinds, returned)
                        .await
                        .map_err(|e| Failed::of(e, [shard]))
                }
            })
            .await
    }

    async fn attempt(
        &self,
        route: &Route,
        what: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        kinds: &[Param<'_>],
        returned: &[&str],
    ) -> Result<Vec<Row>> {
        self.cluster
            .on_host(&route.host, self.cluster.options().host_timeout, |client| async move {
                let rows = statement::run(
                    &self.cluster,
                    &client,
                    route,
                    E::TABLE,
                    returned,
                    what,
                    sql,
                    params,
                    kinds,
                )
                .await?;
                check_rows(self.cluster.layout(), &route.host, what, &[route.shard], &rows)?;
                Ok(rows)
            })
            .await
    }

    fn rows(rows: &[Row]) -> Result<Vec<E>> {
        rows.iter().map(Self::row).collect()
    }

    fn row(row: &Row) -> Result<E> {
        E::from_row(row).map_err(|source| Error::Decode { table: E::TABLE, source })
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
        check_values::<N>(new)?;
        let shard = self.cluster.route_key(new.shard_key())?.shard;
        let kinds: Vec<Param<'_>> = N::COLUMNS.iter().map(|c| Param::Column(c)).collect();
        let rows = self
            .on_shard(
                shard,
                "insert",
                |s| self.sql.insert(s, N::COLUMNS, 1),
                &new.values(),
                &kinds,
                E::COLUMNS,
            )
            .await?;
        Self::rows(&rows)?.pop().ok_or(Error::Empty { what: "insert" })
    }

    /// Inserts rows, grouped by host: each host's part is one transaction (each shard's
    /// rows one `INSERT` inside it, several statements past Postgres's 65,535 bind
    /// parameters), all hosts in parallel. Returns the rows in the order given.
    ///
    /// Atomic per host, whatever the batch's size, not across hosts. A host that finds
    /// one of its shards moved rolls its part back whole; that part is then inserted
    /// once more under the new map, so no row is ever inserted twice.
    ///
    /// # Errors
    ///
    /// When no host committed, the failure (nothing was applied, unless its
    /// [`Error::outcome_unknown`] says otherwise: a part whose outcome is unknown is the
    /// one reported). When some hosts committed and another failed, [`Error::InsertMany`]
    /// naming the hosts and the rows that committed, and the rows whose outcome is
    /// unknown (of every host whose part failed so, not only the one reported); its
    /// `outcome_unknown()` is true: part of the batch is in.
    pub async fn insert_many<N: NewRow<Entity = E>>(&self, new: &[N]) -> Result<Vec<E>> {
        check_new_row::<N>()?;
        if new.is_empty() {
            return Ok(Vec::new());
        }
        for n in new {
            check_values::<N>(n)?;
        }
        let all: Vec<usize> = (0..new.len()).collect();
        let by_host = self.group(new, &all, &self.cluster.map())?;
        let parts = by_host.into_iter().map(|(host, groups)| {
            let idx: Vec<usize> = groups.iter().flat_map(|(_, i)| i.iter().copied()).collect();
            async move { (idx, self.insert_part(host, groups, new).await) }
        });
        let mut out: Vec<Option<E>> = (0..new.len()).map(|_| None).collect();
        let mut committed: Vec<HostName> = Vec::new();
        let mut failures = Vec::new();
        let mut unknown_rows = Vec::new();
        for (idx, part) in futures::future::join_all(parts).await {
            let (hosts, rows) = match part {
                Ok(done) => done,
                Err(PartFailed { committed: hosts, rows, error }) => {
                    // Every row of a part whose failure leaves its outcome unknown, but
                    // those it committed elsewhere after a move: whichever host of the
                    // part failed so, its rows are among them.
                    if error.outcome_unknown() {
                        let done: std::collections::HashSet<usize> = rows.iter().map(|(i, _)| *i).collect();
                        unknown_rows.extend(idx.into_iter().filter(|i| !done.contains(i)));
                    }
                    failures.push(error);
                    (hosts, rows)
                }
            };
            committed.extend(hosts);
            for (i, row) in rows {
                out[i] = Some(row);
            }
        }
        if failures.is_empty() {
            return out.into_iter().map(|r| r.ok_or(Error::Empty { what: "insert many" })).collect();
        }
        // The failure a caller must see first: one whose outcome is unknown.
        let worst = failures.iter().position(Error::outcome_unknown).unwrap_or(0);
        let error = failures.swap_remove(worst);
        committed.sort();
        committed.dedup();
        unknown_rows.sort_unstable();
        Err(if committed.is_empty() {
            error
        } else {
            Error::InsertMany {
                committed,
                committed_rows: out.iter().enumerate().filter(|(_, r)| r.is_some()).map(|(i, _)| i).collect(),
                unknown_rows,
                failed: error.host_name().cloned(),
                source: Box::new(error),
            }
        })
    }

    /// The rows `idx` of `new`, grouped by host under `map`, each host's by shard in
    /// shard order.
    fn group<N: NewRow<Entity = E>>(
        &self,
        new: &[N],
        idx: &[usize],
        map: &ShardMap,
    ) -> Result<HashMap<HostName, Groups>> {
        let prefix = self.cluster.prefix();
        let mut by_host: HashMap<HostName, BTreeMap<u16, (Route, Vec<usize>)>> = HashMap::new();
        for &i in idx {
            let route = match new[i].shard_key() {
                ShardKey::User(u) => map.route_user(u, prefix),
                ShardKey::Parent(id) => map.route_id(id, self.cluster.layout(), prefix)?,
            };
            let entry = by_host.entry(route.host.clone()).or_default();
            entry.entry(route.shard.get()).or_insert_with(|| (route, Vec::new())).1.push(i);
        }
        Ok(by_host.into_iter().map(|(h, g)| (h, g.into_values().collect())).collect())
    }

    /// One host's part of [`Repo::insert_many`], in one transaction. If the host found
    /// one of the part's shards moved (the transaction rolled back whole), the part runs
    /// once more under the new map, over whichever hosts now hold its shards, each in one
    /// transaction. Returns the hosts that committed with the rows, by input index.
    async fn insert_part<N: NewRow<Entity = E>>(
        &self,
        host: HostName,
        groups: Vec<(Route, Vec<usize>)>,
        new: &[N],
    ) -> Result<(Vec<HostName>, Vec<(usize, E)>), PartFailed<E>> {
        let (host, groups) = (&host, &groups);
        self.cluster
            .with_move_retry(|map, run| async move {
                if run == Run::First {
                    return match self.insert_tx(host, groups, new).await {
                        Ok(rows) => Ok((vec![host.clone()], rows)),
                        Err(e) => {
                            let moved = e.is_moved();
                            Err(Failed::new(PartFailed::from(e), moved, groups.iter().map(|(r, _)| r.shard)))
                        }
                    };
                }
                let idx: Vec<usize> = groups.iter().flat_map(|(_, i)| i.iter().copied()).collect();
                let by_host = self.group(new, &idx, &map)?;
                let tries =
                    by_host.iter().map(|(h, g)| async move { (h.clone(), self.insert_tx(h, g, new).await) });
                let (mut hosts, mut rows, mut failures) = (Vec::new(), Vec::new(), Vec::new());
                for (h, result) in futures::future::join_all(tries).await {
                    match result {
                        Ok(r) => {
                            hosts.push(h);
                            rows.extend(r);
                        }
                        Err(e) => failures.push(e),
                    }
                }
                if failures.is_empty() {
                    return Ok((hosts, rows));
                }
                let worst = failures.iter().position(Error::outcome_unknown).unwrap_or(0);
                let error = failures.swap_remove(worst);
                Err(Failed::new(PartFailed { committed: hosts, rows, error }, false, []))
            })
            .await
    }

    /// The select list of a statement that spans schemas (`UNION ALL` over shards):
    /// every column, except that a column whose type lives in the shard's schema (an
    /// enum, say: each shard has its own copy, and `UNION` cannot match two of them) is
    /// read as `text`. A type of an extension (`hstore`, `vector`) is shared by the
    /// schemas and stays as it is. Learnt from the single-row read of `schema`, and kept
    /// once its table had every column of `E` (a shard a migration has not reached yet
    /// lacks one: its list is used once, not kept, or a column added there as an enum
    /// would be read as itself for as long as the handle lives, failing every statement
    /// over two shards).
    async fn across_select(
        &self,
        client: &deadpool_postgres::Object,
        host: &HostName,
        schema: &SchemaName,
    ) -> Result<String> {
        if let Some(select) = self.across.get() {
            return Ok(select.clone());
        }
        let types =
            self.cluster.types().covering(client, host, None, schema, E::TABLE, &[], E::COLUMNS).await?;
        let select = E::COLUMNS
            .iter()
            .map(|c| {
                if types.of_the_schema(c) { format!("{}::text AS {}", quote(c), quote(c)) } else { quote(c) }
            })
            .collect::<Vec<_>>()
            .join(", ");
        if !types.knows(&[], E::COLUMNS) {
            return Ok(select);
        }
        Ok(self.across.get_or_init(|| select).clone())
    }

    /// The parameter types of `N`'s insert into `route`'s schema, from the prepared
    /// single-row insert. Types built into Postgres are the same in every schema and on
    /// every host, so they are learnt once; a type that lives in the schema (an enum,
    /// say) differs per schema and host, so it is asked for each (the statement is
    /// cached per connection).
    async fn insert_types<N: NewRow<Entity = E>>(
        &self,
        client: &deadpool_postgres::Object,
        route: &Route,
    ) -> Result<Vec<Type>> {
        let key = N::COLUMNS.join(",");
        if let Some(t) = self.types.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(t);
        }
        let kinds: Vec<Param<'_>> = N::COLUMNS.iter().map(|c| Param::Column(c)).collect();
        let table = self
            .cluster
            .types()
            .covering(client, &route.host, Some(route.shard), &route.schema, E::TABLE, &kinds, &[])
            .await?;
        if let Some(types) = table.of(&kinds, &[]) {
            return Ok(types);
        }
        let kept = statement::Kept::on(&self.cluster, &route.host, client);
        if kept.may != crate::cluster::MayKeep::Yes {
            let column = table.first_foreign(N::COLUMNS.iter().copied()).unwrap_or("?");
            let refused = || statement::schema_type_refused(&route.host, E::TABLE, column);
            return Err(kept.may.refusal(&route.host, refused));
        }
        let sql = self.sql.insert(&route.schema, N::COLUMNS, 1);
        kept.make_room(client);
        let statement = client
            .prepare_cached(&sql)
            .await
            .map_err(|e| Error::host(&route.host, Some(route.shard), "insert many", e))?;
        let types = statement.params().to_vec();
        if types.iter().all(|t| t.oid() < statement::FIRST_NORMAL_OID)
            && let Ok(mut m) = self.types.lock()
        {
            m.insert(key, types.clone());
        }
        Ok(types)
    }

    /// Inserts the rows of `groups` on `host` in one transaction (one statement per
    /// 65,535 bind parameters, each shard's rows one `INSERT` inside it), within the host
    /// timeout. On any failure the connection is closed, never returned to the pool
    /// inside the transaction, so the server rolls everything back.
    async fn insert_tx<N: NewRow<Entity = E>>(
        &self,
        host: &HostName,
        groups: &[(Route, Vec<usize>)],
        new: &[N],
    ) -> Result<Vec<(usize, E)>> {
        const MAX_PARAMS: usize = 65_535;
        let width = N::COLUMNS.len().max(1);
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
        let chunks = &chunks;
        let work = |client: crate::cluster::Lent| async move {
            let (client, cancel) = client.keep();
            let tx = Pinned::new(client, Some(cancel));
            let client = tx.client()?;
            client.batch_execute("BEGIN").await.map_err(|e| Error::host(host, None, "insert many", e))?;
            let mut out = Vec::with_capacity(new.len().min(1 << 16));
            for chunk in chunks {
                let mut types = Vec::new();
                let mut values: Vec<&(dyn ToSql + Sync)> = Vec::new();
                for (route, idx) in chunk {
                    let t = self.insert_types::<N>(client, route).await?;
                    for &i in *idx {
                        types.extend(t.iter().cloned());
                        values.extend(new[i].values());
                    }
                }
                let parts: Vec<(&SchemaName, usize)> =
                    chunk.iter().map(|(r, idx)| (&r.schema, idx.len())).collect();
                let first = chunk.first().ok_or(Error::Empty { what: "insert many (an empty statement)" })?;
                let select = self.across_select(client, host, &first.0.schema).await?;
                let sql = self.sql.insert_parts(&parts, N::COLUMNS, &select);
                let params: Vec<(&(dyn ToSql + Sync), Type)> =
                    values.iter().zip(&types).map(|(v, t)| (*v, t.clone())).collect();
                let rows = client
                    .query_typed(&sql, &params)
                    .await
                    .map_err(|e| statement_error(host, None, "insert many", e, &types, &values))?;
                self.take_parts(&rows, chunk, new, &mut out)?;
            }
            client.batch_execute("COMMIT").await.map_err(|e| Error::host(host, None, "insert many", e))?;
            tx.release();
            Ok(out)
        };
        self.cluster.on_host(host, self.cluster.options().host_timeout, work).await
    }

    /// The rows of one `insert_parts` statement, checked against the inputs they were
    /// made from, appended to `out` with their input index.
    fn take_parts<N: NewRow<Entity = E>>(
        &self,
        rows: &[Row],
        chunk: &[(&Route, &[usize])],
        new: &[N],
        out: &mut Vec<(usize, E)>,
    ) -> Result<()> {
        let mut taken = vec![0_usize; chunk.len()];
        for row in rows {
            let part: i32 = row
                .try_get(statement::INSERT_PART)
                .map_err(|source| Error::Decode { table: E::TABLE, source })?;
            let p = usize::try_from(part).ok().filter(|p| *p < chunk.len());
            let (p, idx) =
                p.map(|p| (p, chunk[p].1)).ok_or(Error::Empty { what: "insert many (a row of no part)" })?;
            let route = chunk[p].0;
            check_rows(
                self.cluster.layout(),
                &route.host,
                "insert many",
                &[route.shard],
                std::slice::from_ref(row),
            )?;
            // RETURNING gives rows in VALUES order; check it rather than trust it.
            let i = idx.get(taken[p]).copied().ok_or(Error::Empty { what: "insert many (too many rows)" })?;
            taken[p] += 1;
            let key = new[i].shard_key();
            let stored = match key.column::<E>() {
                Some(column) => row
                    .try_get::<_, i64>(column)
                    .map_err(|source| Error::Decode { table: E::TABLE, source })?,
                None => key.value(),
            };
            if key.value() != stored {
                return Err(Error::Invalid {
                    what: format!("insert many: {} returned rows out of order", E::TABLE),
                });
            }
            out.push((i, Self::row(row)?));
        }
        // Every row came back (a trigger that skips a row would leave a hole): checked
        // before COMMIT, so a batch that does not add up is rolled back.
        if let Some(p) = (0..chunk.len()).find(|&p| taken[p] != chunk[p].1.len()) {
            return Err(Error::Invalid {
                what: format!(
                    "insert many: {} returned {} of {} rows in {}",
                    E::TABLE,
                    taken[p],
                    chunk[p].1.len(),
                    chunk[p].0.schema
                ),
            });
        }
        Ok(())
    }

    /// The row with `id`: its shard is decoded from the ID, one query on its host.
    ///
    /// # Errors
    ///
    /// [`Error::Router`] for an ID whose shard the cluster does not have (no query is
    /// sent); [`Error::Host`]; [`Error::Timeout`].
    pub async fn get(&self, id: Id) -> Result<Option<E>> {
        let shard = self.cluster.route_id(id)?.shard;
        let rows = self
            .on_shard(shard, "get", |s| self.sql.get(s), &[&id], &[Param::Column("id")], E::COLUMNS)
            .await?;
        Ok(Self::rows(&rows)?.pop())
    }

    /// The rows with `ids`, one round trip per host (not per ID, not per shard), in the
    /// caller's order: one entry per ID asked, also when an ID is asked more than once,
    /// with the IDs not found. A host's shards are read in statements of at most
    /// [`crate::ClusterOptions::fan_out_batch`] shards, pipelined on one connection.
    ///
    /// # Errors
    ///
    /// [`Error::Router`] for an ID whose shard the cluster does not have (nothing is
    /// sent); the first host's failure.
    pub async fn get_many(&self, ids: &[Id]) -> Result<Many<E>> {
        let (layout, prefix) = (self.cluster.layout(), self.cluster.prefix());
        let timeout = self.cluster.options().host_timeout;
        let found: HashMap<Id, Row> = self
            .cluster
            .with_move_retry(|map, _| async move {
                let mut by_host: HashMap<HostName, BTreeMap<SchemaName, (LogicalShard, Vec<i64>)>> =
                    HashMap::new();
                for &id in ids {
                    let route = map.route_id(id, layout, prefix).map_err(Error::from)?;
                    let shard = route.shard;
                    let schemas = by_host.entry(route.host).or_default();
                    schemas.entry(route.schema).or_insert_with(|| (shard, Vec::new())).1.push(i64::from(id));
                }
                let batch = self.cluster.options().fan_out_batch.max(1);
                let queries = by_host.into_iter().map(|(host, schemas)| async move {
                    let names: Vec<&SchemaName> = schemas.keys().collect();
                    let params: Vec<(&(dyn ToSql + Sync), Type)> =
                        schemas.values().map(|(_, a)| (a as &(dyn ToSql + Sync), Type::INT8_ARRAY)).collect();
                    let shards: Vec<LogicalShard> = schemas.values().map(|(s, _)| *s).collect();
                    let (names, params, host_ref, shards_ref) = (&names, &params, &host, &shards);
                    // A statement per `fan_out_batch` shards, all sent at once on one
                    // connection: each is its own implicit transaction, so the locks it
                    // takes are released as it ends (see `ClusterOptions::fan_out_batch`).
                    let work = |client: crate::cluster::Lent| async move {
                        let first =
                            names.first().copied().ok_or(Error::Empty { what: "get many (no schema)" })?;
                        let select = self.across_select(&client, host_ref, first).await?;
                        let (client, select) = (&client, &select);
                        let parts =
                            names.chunks(batch).zip(params.chunks(batch)).zip(shards_ref.chunks(batch));
                        let statements = parts.map(|((names, params), shards)| async move {
                            let sql = self.sql.get_many(names, select);
                            let rows = client
                                .query_typed(&sql, params)
                                .await
                                .map_err(|e| Error::host(host_ref, None, "get many", e))?;
                            check_rows(layout, host_ref, "get many", shards, &rows)?;
                            Ok::<_, Error>(rows)
                        });
                        Ok(futures::future::join_all(statements).await)
                    };
                    let results = self
                        .cluster
                        .on_host(&host, timeout, work)
                        .await
                        .map_err(|e| Failed::of(e, shards.iter().copied()))?;
                    let mut rows = Vec::new();
                    for (result, part) in results.into_iter().zip(shards.chunks(batch)) {
                        rows.extend(result.map_err(|e| Failed::of(e, part.iter().copied()))?);
                    }
                    Ok::<_, Failed<Error>>(rows)
                });
                let mut found = HashMap::new();
                for rows in futures::future::join_all(queries).await {
                    for row in rows? {
                        let id: Id =
                            row.try_get("id").map_err(|source| Error::Decode { table: E::TABLE, source })?;
                        found.insert(id, row);
                    }
                }
                Ok(found)
            })
            .await?;
        let mut missing = Vec::new();
        let mut rows = Vec::with_capacity(ids.len());
        for id in ids {
            match found.get(id) {
                Some(row) => rows.push(Some(Self::row(row)?)),
                None => {
                    missing.push(*id);
                    rows.push(None);
                }
            }
        }
        Ok(Many { rows, missing })
    }
    /// Sets `columns` of the row with `id`; returns the row as it now is, or `None` when
    /// there is no such row.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidIdentifier`] for a column `E` does not declare, [`Error::Invalid`]
    /// for the column that places the row in its shard (its user or parent column):
    /// nothing is sent; as [`Repo::get`].
    pub async fn update(&self, id: Id, set: &[(&str, &(dyn ToSql + Sync))]) -> Result<Option<E>> {
        let columns = check_update::<E>(set)?;
        let shard = self.cluster.route_id(id)?.shard;
        let mut values: Vec<&(dyn ToSql + Sync)> = vec![&id];
        values.extend(set.iter().map(|(_, v)| *v));
        let mut kinds = vec![Param::Column("id")];
        kinds.extend(columns.iter().map(|c| Param::Column(c)));
        let rows = self
            .on_shard(shard, "update", |s| self.sql.update(s, &columns), &values, &kinds, E::COLUMNS)
            .await?;
        Ok(Self::rows(&rows)?.pop())
    }

    /// Deletes the row with `id`; returns whether there was one.
    ///
    /// # Errors
    ///
    /// As [`Repo::get`].
    pub async fn delete(&self, id: Id) -> Result<bool> {
        let shard = self.cluster.route_id(id)?.shard;
        let rows = self
            .on_shard(shard, "delete", |s| self.sql.delete(s), &[&id], &[Param::Column("id")], &["id"])
            .await?;
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
        // One row more than the page, to tell whether another page follows: a page that
        // ends exactly at the last row has no cursor (no empty call after it).
        let n = i64::from(limit) + 1;
        let kinds = [Param::Column(column), Param::Column("id"), Param::Int8];
        let rows = self
            .on_shard(shard, "page", |s| self.sql.page(s, column), &[&key, &below, &n], &kinds, E::COLUMNS)
            .await?;
        let mut rows = Self::rows(&rows)?;
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        let next = if rows.len() > limit {
            rows.truncate(limit);
            rows.last().map(Entity::id)
        } else {
            None
        };
        Ok(Page { rows, next })
    }

    /// The newest rows created in `[from, to]` across every shard, at most `limit`: the
    /// window's ID range, one round trip per host in parallel (at most
    /// [`crate::ClusterOptions::fan_out`] hosts at once, each within the host timeout),
    /// merged by ID. Each statement is asked first for about its share of the page; one
    /// whose share came back full and may hold more of it is read again in a second
    /// round trip to its host (so a call without failures takes up to twice the host
    /// timeout; each statement that fails in a later round may cost one more round, at
    /// most one per host). A host's shards are read in statements of at most
    /// [`crate::ClusterOptions::fan_out_batch`] shards, pipelined on one connection, so
    /// a fan-out holds few locks at a time; a statement that fails lists its shards, and
    /// only those, in [`FanOut::missing`] (one entry per host). A host that fails or
    /// times out does not fail the call: its shards are listed in [`FanOut::missing`],
    /// never silently left out. A host that finds one of its shards fenced by a move is
    /// asked again once the move flips (or ends).
    ///
    /// Whether any row was created in a window is `created_between(from, to, 1)`: each
    /// shard's part stops at its first row.
    ///
    /// # Errors
    ///
    /// [`Error::Id`] when the window is outside the ID layout; [`Error::Invalid`] for a
    /// time before 1970 or past what milliseconds in an `i64` hold, and for `from` after
    /// `to`.
    pub async fn created_between(&self, from: SystemTime, to: SystemTime, limit: usize) -> Result<FanOut<E>> {
        let (lo, hi) = self.window_ids(from, to)?;
        let got = self.across(Ask::Newest { lo, hi, limit: Self::one_more(limit) }).await?;
        Ok(Self::page_across(got, limit))
    }

    /// The lowest and highest IDs a window of creation times `[from, to]` holds; a
    /// window that ends before it begins is refused, not read as an empty one.
    fn window_ids(&self, from: SystemTime, to: SystemTime) -> Result<(i64, i64)> {
        if from > to {
            return Err(Error::Invalid {
                what: format!("the time window ends ({to:?}) before it begins ({from:?})"),
            });
        }
        let layout = self.cluster.layout();
        let lo = i64::from(layout.min_id_at(unix_ms(from)?)?);
        let hi = i64::from(layout.max_id_at(unix_ms(to)?)?);
        Ok((lo, hi))
    }

    /// One page of every shard's rows, newest first, for a listing across the cluster:
    /// the rows with IDs below `before` (all rows when `None`), at most `limit`. Pass
    /// the page's [`FanOut::next`] as `before` for the next one: the cursor is an ID, so
    /// a listing resumes where it was, in this process or another, never shows a row
    /// twice and never skips one that was there when it began. A row written during the
    /// listing shows up in a later page when its ID falls below the cursor (IDs minted
    /// in Postgres may trail the clock a little, see docs/ids.md). Read as
    /// [`Repo::created_between`] reads, with the same report of missing shards: a page
    /// with shards missing holds the other shards' rows only, and the next page resumed
    /// from its cursor never goes back for theirs above it. A listing that must be
    /// whole starts again (or from an earlier cursor) when a page is incomplete.
    pub async fn newest(&self, before: Option<Id>, limit: usize) -> Result<FanOut<E>> {
        let hi = before.map_or(i64::MAX, |b| i64::from(b).saturating_sub(1));
        let got = self.across(Ask::Newest { lo: 0, hi, limit: Self::one_more(limit) }).await?;
        Ok(Self::page_across(got, limit))
    }

    /// How many rows were created in `[from, to]` across every shard: one count per
    /// shard over the window's ID range (its primary key), summed, read as
    /// [`Repo::created_between`] reads. Shards that could not be read are listed in
    /// [`Counted::missing`] and left out of the count. Each shard's count also looks at
    /// the IDs it counts (one `&` per row): a row in a shard's schema whose ID another
    /// shard minted fails its statement, as it fails a read of its rows, and that
    /// statement's shards are listed missing.
    ///
    /// # Errors
    ///
    /// [`Error::Id`] when the window is outside the ID layout; [`Error::Invalid`] for a
    /// time before 1970 or past what milliseconds in an `i64` hold, and for `from` after
    /// `to`.
    pub async fn count_between(&self, from: SystemTime, to: SystemTime) -> Result<Counted> {
        let (lo, hi) = self.window_ids(from, to)?;
        let got = self.across(Ask::Count { lo, hi }).await?;
        Ok(Counted { count: got.count, missing: got.missing })
    }

    /// How many rows every shard holds together (see [`Repo::count_between`]). Each
    /// shard's count reads its whole primary key: on large shards this is the cost of
    /// `count(*)`, once per shard.
    pub async fn count(&self) -> Result<Counted> {
        let got = self.across(Ask::Count { lo: 0, hi: i64::MAX }).await?;
        Ok(Counted { count: got.count, missing: got.missing })
    }

    /// How many rows a page of `limit` asks for: one more, to tell whether another page
    /// follows (none for a page of 0 rows).
    fn one_more(limit: usize) -> usize {
        if limit == 0 { 0 } else { limit.saturating_add(1) }
    }

    /// A page of the newest rows of the lists gathered (asked for
    /// [`Repo::one_more`] of `limit`), and its cursor: only when a row is left below it.
    fn page_across(got: Gathered<E>, limit: usize) -> FanOut<E> {
        let mut rows = merge_newest_first(got.lists, Self::one_more(limit));
        let next = if rows.len() > limit {
            rows.truncate(limit);
            rows.last().map(Entity::id)
        } else {
            None
        };
        FanOut { rows, next, missing: got.missing }
    }

    /// Asks every shard `ask` through the cluster's one retry path for a stale map.
    async fn across(&self, ask: Ask) -> Result<Gathered<E>> {
        match self.cluster.with_move_retry(|map, run| self.fan_out(map, run, ask)).await {
            // The move did not end within `move_wait` (or no move explains the missing
            // schema): those hosts' shards are reported missing, as a host that fails.
            Err(e) if e.is_moved() => {
                self.fan_out(self.cluster.map(), Run::Later, ask).await.map_err(|f| f.error)
            }
            other => other,
        }
    }

    /// One fan-out of `ask` over `map`. On the first run a host that found a shard
    /// fenced fails the whole attempt (to wait for the move and ask again); on the last
    /// it is reported missing.
    ///
    /// A read of the newest rows asks each statement first for a short prefix of its
    /// shards' newest rows ([`prefix_limit`]), not the whole limit: a statement over 64
    /// of 2000 shards holds about 3 of the 100 newest. A statement whose prefix came
    /// back full and may hold more of the page is then read again, further down, until
    /// none may ([`needs_more`]): one more round without failures.
    async fn fan_out(
        &self,
        map: std::sync::Arc<ShardMap>,
        run: Run,
        ask: Ask,
    ) -> Result<Gathered<E>, Failed<Error>> {
        let batch = self.cluster.options().fan_out_batch.max(1);
        let hosts: Vec<(HostName, Vec<LogicalShard>)> = map
            .hosts()
            .iter()
            .map(|h| (h.clone(), map.shards_of(h).collect::<Vec<_>>()))
            .filter(|(_, s)| !s.is_empty())
            .collect();
        let total: usize = hosts.iter().map(|(_, s)| s.len()).sum();
        let (lo, hi, limit, counting) = match ask {
            Ask::Newest { lo, hi, limit } => (lo, hi, i64::try_from(limit).unwrap_or(i64::MAX), false),
            Ask::Count { lo, hi } => (lo, hi, 0, true),
        };
        let mut slots = 0;
        let pieces: Vec<(HostName, Vec<Piece>)> = hosts
            .into_iter()
            .map(|(host, shards)| {
                let pieces = shards
                    .chunks(batch)
                    .map(|s| {
                        slots += 1;
                        let n = if counting { 0 } else { prefix_limit(limit, s.len(), total) };
                        Piece { slot: slots - 1, shards: s.to_vec(), lo, hi, n }
                    })
                    .collect();
                (host, pieces)
            })
            .collect();
        let mut tally = Tally::default();
        // Per statement (its slot): what it answered so far; `None` until it answered,
        // and once it failed.
        let mut read: Vec<Option<Answered<E>>> = std::iter::repeat_with(|| None).take(slots).collect();
        let mut round = self.read_pieces(pieces, counting).await;
        loop {
            for (host, piece, part) in tally.sort(round, run) {
                match part {
                    Part::Count(n) => tally.count = tally.count.saturating_add(n),
                    Part::Rows(rows) => {
                        let Some(at) = read.get_mut(piece.slot) else { continue };
                        let ids: Vec<i64> = rows.iter().map(|e| i64::from(e.id())).collect();
                        let last = ids.last().copied();
                        let full = i64::try_from(ids.len()).is_ok_and(|l| l == piece.n);
                        match at {
                            Some(a) => {
                                a.rows.extend(rows);
                                a.progress.ids.extend(ids);
                                a.progress.read(piece.lo, last, full);
                            }
                            None => {
                                // The first round: done unless it returned a whole
                                // prefix shorter than the limit (a whole limit's rows
                                // alone put the page's last at or above their own).
                                let mut progress = Progress { lo, ids, floor: None };
                                progress.read(piece.lo, last, full && piece.n < limit);
                                *at = Some(Answered { host, shards: piece.shards, rows, progress });
                            }
                        }
                    }
                }
            }
            // A statement that failed in a later round is missing as a whole: its
            // earlier rows go too (a page holds the shards that answered, in full).
            for slot in std::mem::take(&mut tally.failed_slots) {
                if let Some(at) = read.get_mut(slot) {
                    *at = None;
                }
            }
            if counting || tally.moved.is_some() {
                break;
            }
            let progress: Vec<Option<&Progress>> =
                read.iter().map(|r| r.as_ref().map(|a| &a.progress)).collect();
            let again = needs_more(&progress, limit);
            if again.is_empty() {
                break;
            }
            let mut by_host: Vec<(HostName, Vec<Piece>)> = Vec::new();
            for (slot, from, to) in again {
                let Some(Some(a)) = read.get(slot) else { continue };
                let piece = Piece { slot, shards: a.shards.clone(), lo: from, hi: to, n: limit };
                match by_host.iter_mut().find(|(h, _)| *h == a.host) {
                    Some((_, pieces)) => pieces.push(piece),
                    None => by_host.push((a.host.clone(), vec![piece])),
                }
            }
            round = self.read_pieces(by_host, false).await;
        }
        let Tally { count, failed, moved, .. } = tally;
        let missing: Vec<Missing> = failed
            .into_iter()
            .map(|(host, e, shards)| {
                tracing::warn!(%host, shards = shards.len(), error = %crate::error_chain(&e), "fan-out: shards missing from the result");
                Missing { host, shards, error: crate::error_chain(&e) }
            })
            .collect();
        if let Some((error, shards)) = moved {
            return Err(Failed::new(error, true, shards));
        }
        let lists = read.into_iter().flatten().map(|a| a.rows.into_iter()).collect();
        Ok(Gathered { lists, count, missing })
    }

    /// Runs each host's pieces, one statement each, all sent at once on one connection
    /// per host; hosts in parallel (at most `fan_out` at once). Each statement is its own
    /// implicit transaction, so the locks it takes are released as it ends (see
    /// `ClusterOptions::fan_out_batch`).
    async fn read_pieces(&self, hosts: Vec<(HostName, Vec<Piece>)>, counting: bool) -> Vec<HostResult<E>> {
        let prefix = self.cluster.prefix();
        let timeout = self.cluster.options().host_timeout;
        let layout = self.cluster.layout();
        futures::stream::iter(hosts)
            .map(|(host, pieces)| async move {
                let (host_ref, pieces_ref) = (&host, &pieces);
                let work = |client: crate::cluster::Lent| async move {
                    let first = pieces_ref
                        .first()
                        .and_then(|p| p.shards.first())
                        .ok_or(Error::Empty { what: "fan-out (no schema)" })?;
                    let select = self.across_select(&client, host_ref, &prefix.schema(*first)).await?;
                    // On a direct host each batch's statement is kept prepared on the
                    // connection (`fan_out_prepared`): after its first runs the server
                    // reuses a generic plan instead of planning every shard's branch
                    // again.
                    let kept = statement::Kept::on(&self.cluster, host_ref, &client);
                    if kept.fan_out {
                        kept.make_room(&client);
                    }
                    // Not when the cache could not hold this fan-out's statements (a
                    // `statement_cache` set below them): it would prepare them all again
                    // on every call.
                    let keep = kept.fan_out && pieces_ref.len() <= kept.bound;
                    let (client, select) = (&client, &select);
                    let statements = pieces_ref.iter().map(|piece| async move {
                        let schemas: Vec<SchemaName> =
                            piece.shards.iter().map(|s| prefix.schema(*s)).collect();
                        let schemas = schemas.iter().collect::<Vec<_>>();
                        let branches: Vec<_> =
                            piece.shards.iter().copied().zip(schemas.iter().copied()).collect();
                        let sql = if counting {
                            self.sql.count(&branches, layout)
                        } else {
                            self.sql.window(&branches, select)
                        };
                        let failed = |e| statement::pooler_hint(Error::host(host_ref, None, "fan-out", e));
                        let (lo, hi, n) = (piece.lo, piece.hi, piece.n);
                        let typed: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 3] =
                            [(&lo, Type::INT8), (&hi, Type::INT8), (&n, Type::INT8)];
                        let unnamed = || client.query_typed(&sql, &typed);
                        let rows = if keep {
                            let statement = client
                                .prepare_typed_cached(&sql, &[Type::INT8, Type::INT8, Type::INT8])
                                .await
                                .map_err(failed)?;
                            match client.query(&statement, &[&lo, &hi, &n]).await {
                                Ok(rows) => rows,
                                // A table changed since the statement was kept (0A000): it did
                                // not run; the cache is emptied and the piece read unnamed.
                                Err(e) if statement::forget_if_stale(client, &e) => {
                                    unnamed().await.map_err(failed)?
                                }
                                Err(e) => return Err(failed(e)),
                            }
                        } else {
                            unnamed().await.map_err(failed)?
                        };
                        if counting {
                            // A row counted in a shard whose ID another shard minted.
                            check_rows(layout, host_ref, "count", &piece.shards, &rows)?;
                            return count_rows(host_ref, &piece.shards, &rows).map(Part::Count);
                        }
                        check_rows(layout, host_ref, "fan-out", &piece.shards, &rows)?;
                        Self::rows(&rows).map(Part::Rows)
                    });
                    Ok(futures::future::join_all(statements).await)
                };
                let result = self.cluster.on_host(&host, timeout, work).await;
                (host, pieces, result)
            })
            .buffer_unordered(self.cluster.options().fan_out.max(1))
            .collect::<Vec<_>>()
            .await
    }
}

/// The sum of a count statement's rows ([`Sql::count`]), once they are one per shard
/// it was sent for, each shard once ([`count_of`]). Rows that do not decode as a
/// count's are another statement's answer.
///
/// # Errors
///
/// [`Error::Pooler`] when the rows are not the count's.
fn count_rows(host: &HostName, shards: &[LogicalShard], rows: &[Row]) -> Result<u64> {
    let mut answered = Vec::with_capacity(rows.len());
    for row in rows {
        let decoded = row.try_get::<_, i32>(0).and_then(|shard| Ok((shard, row.try_get::<_, i64>(1)?)));
        answered.push(decoded.map_err(|e| Error::Pooler {
            host: host.clone(),
            reason: format!(
                "a count's answer is not a count's ({e}): another statement ran in its place (a transaction \
                 pooler running another client's statement of the same name?); nothing was counted"
            ),
        })?);
    }
    count_of(host, shards, &answered)
}

/// The sum of a count's `(shard, count)` rows, once they are one per shard it was sent
/// for, each shard once: rows of other shards (or another number of them) are another
/// statement's answer, as a transaction pooler gives when it runs another client's
/// statement of the same name.
///
/// # Errors
///
/// [`Error::Pooler`] when the rows are not the shards'.
fn count_of(host: &HostName, shards: &[LogicalShard], answered: &[(i32, i64)]) -> Result<u64> {
    let mut seen: Vec<i32> = answered.iter().map(|(shard, _)| *shard).collect();
    let mut asked: Vec<i32> = shards.iter().map(|s| i32::from(s.get())).collect();
    asked.sort_unstable();
    seen.sort_unstable();
    if seen != asked {
        return Err(Error::Pooler {
            host: host.clone(),
            reason: format!(
                "a count sent for shards {asked:?} answered for shards {seen:?}: another statement ran in its place \
                 (a transaction pooler running another client's statement of the same name?); nothing was counted"
            ),
        });
    }
    Ok(answered.iter().fold(0u64, |sum, (_, n)| sum.saturating_add(u64::try_from(*n).unwrap_or(0))))
}

/// One statement of a fan-out: a run of one host's shards (at most `fan_out_batch`), the
/// ID range it reads, and how many rows at most (`$3`; unused by a count).
#[derive(Debug, Clone)]
struct Piece {
    /// Which statement of the fan-out this is: later rounds read it again.
    slot: usize,
    shards: Vec<LogicalShard>,
    lo: i64,
    hi: i64,
    n: i64,
}

/// What a fan-out read of one statement's shards: their rows, newest first, and how far
/// down.
struct Answered<E> {
    host: HostName,
    shards: Vec<LogicalShard>,
    rows: Vec<E>,
    progress: Progress,
}

/// One host's answer to its pieces: per piece, its part; or the host failed as a whole
/// (no connection, a timeout).
type HostResult<E> = (HostName, Vec<Piece>, Result<Vec<Result<Part<E>>>>);

/// What the rounds of one fan-out gathered besides rows: the count, the shards that
/// failed (per host, with the host's first error), and the first shards found fenced
/// by a move on the first run.
#[derive(Default)]
struct Tally {
    count: u64,
    failed: Vec<(HostName, Error, Vec<LogicalShard>)>,
    moved: Option<(Error, Vec<LogicalShard>)>,
    /// The statements that failed since this was last emptied.
    failed_slots: Vec<usize>,
}

impl Tally {
    /// Keeps the pieces that answered; records the failed ones.
    fn sort<E>(&mut self, results: Vec<HostResult<E>>, run: Run) -> Vec<(HostName, Piece, Part<E>)> {
        let mut answered = Vec::new();
        for (host, pieces, result) in results {
            match result {
                Ok(parts) => {
                    for (piece, part) in pieces.into_iter().zip(parts) {
                        match part {
                            Ok(part) => answered.push((host.clone(), piece, part)),
                            Err(e) => {
                                self.failed_slots.push(piece.slot);
                                self.fail(&host, e, piece.shards, run);
                            }
                        }
                    }
                }
                Err(e) => {
                    self.failed_slots.extend(pieces.iter().map(|p| p.slot));
                    self.fail(&host, e, pieces.into_iter().flat_map(|p| p.shards).collect(), run);
                }
            }
        }
        answered
    }

    /// Records a failure of `shards` of `host`.
    fn fail(&mut self, host: &HostName, e: Error, shards: Vec<LogicalShard>, run: Run) {
        if run == Run::First && e.is_moved() {
            // A shard fenced by a move: wait for the flip (as a single statement would),
            // then ask every host once more.
            match self.moved.as_mut() {
                Some((_, all)) => all.extend(shards),
                None => self.moved = Some((e, shards)),
            }
        } else {
            // A host's failed statements are reported together, with the first one's
            // error: every shard they named, and only those, is missing.
            match self.failed.iter_mut().find(|(h, _, _)| h == host) {
                Some((_, _, all)) => all.extend(shards),
                None => self.failed.push((host.clone(), e, shards)),
            }
        }
    }
}

/// How many rows the first round asks a statement over `shards` of `total` shards for,
/// when the page holds `limit`: twice its even share of the page, plus 16, at most the
/// limit. Rows spread evenly over shards (as users' rows do) seldom fill it; a skewed
/// statement that fills it is asked again ([`needs_more`]).
fn prefix_limit(limit: i64, shards: usize, total: usize) -> i64 {
    let (total, shards) = (total.max(1) as u128, shards as u128);
    let twice = u128::try_from(limit).unwrap_or(0) * 2 * shards;
    let share = i64::try_from(twice.div_ceil(total)).unwrap_or(i64::MAX);
    share.saturating_add(16).min(limit)
}

/// How far a fan-out has read one statement's shards: every row with an ID in `[floor,
/// hi]` is read (`floor` `None`: nothing more to read, every row in the range down to
/// `lo` is read, or the first round returned the whole limit, whose rows alone put the
/// page's last at or above their own); the rows read so far, their IDs newest first,
/// are `ids`.
#[derive(Debug, Clone)]
struct Progress {
    lo: i64,
    ids: Vec<i64>,
    floor: Option<i64>,
}

impl Progress {
    /// Records a read of the range from `from` down: `last` is the lowest ID it
    /// returned, and `full` whether it returned as many rows as it asked for (so rows
    /// below `last` may be unread).
    fn read(&mut self, from: i64, last: Option<i64>, full: bool) {
        self.floor = match (full, last) {
            (true, Some(last)) => Some(last),
            _ if from <= self.lo => None,
            _ => Some(from),
        };
    }
}

/// The statements to read again, and the ranges: `(slot, from, to)`. A statement's
/// unread rows are all below its `floor`; it is read again when rows between the page's
/// last ID (the `limit`-th newest of every statement's rows read so far, or none when
/// they hold fewer) and its floor may be unread: those, up to `limit` rows.
///
/// After such a round (and no failure) none is read again: a statement read again
/// either returned fewer than `limit` rows, so all its rows above the page's last ID
/// are read, or it returned `limit` rows, which alone put the page's last at or above
/// its new floor. Rows only add up, so the page's last only rises. A statement that
/// fails drops out with all its rows, and the page's last may fall: then the others
/// are read again, below it. Statements' IDs never overlap (IDs are unique across
/// shards, and each read stops below the floor), so no row is read twice.
fn needs_more(read: &[Option<&Progress>], limit: i64) -> Vec<(usize, i64, i64)> {
    if !read.iter().flatten().any(|p| p.floor.is_some()) {
        return Vec::new();
    }
    let mut all: Vec<i64> = read.iter().flatten().flat_map(|p| p.ids.iter().copied()).collect();
    let page_last = usize::try_from(limit).ok().filter(|l| *l >= 1 && *l <= all.len()).map(|l| {
        let (_, nth, _) = all.select_nth_unstable_by(l - 1, |a, b| b.cmp(a));
        *nth
    });
    read.iter()
        .enumerate()
        .filter_map(|(slot, p)| {
            let p = (*p)?;
            let to = p.floor?.checked_sub(1)?;
            let from = match page_last {
                Some(page_last) => p.lo.max(page_last.saturating_add(1)),
                None => p.lo,
            };
            (from <= to).then_some((slot, from, to))
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_summed_only_when_every_shard_it_was_sent_for_answered_once() {
        let host = HostName::new("pg1").unwrap();
        let shards: Vec<LogicalShard> =
            [3i64, 1, 2].iter().map(|s| LogicalShard::bounded(*s).unwrap()).collect();
        assert_eq!(super::count_of(&host, &shards, &[(1, 10), (2, 0), (3, 5)]).unwrap(), 15);
        for wrong in [
            vec![(1, 10), (2, 0)],                 // a shard missing
            vec![(1, 10), (2, 0), (3, 5), (3, 5)], // one twice
            vec![(1, 10), (2, 0), (4, 5)],         // another shard's
            vec![],                                // nothing
        ] {
            let e = super::count_of(&host, &shards, &wrong).map(|n| format!("counted {n}")).unwrap_err();
            assert!(matches!(e, Error::Pooler { .. }), "{wrong:?}: {e}");
        }
    }

    #[test]
    fn the_first_round_asks_each_statement_for_about_its_share() {
        // 100 rows over 2000 shards, 64 per statement: 2 × 3.2, rounded up, plus 16.
        assert_eq!(prefix_limit(100, 64, 2000), 23);
        assert_eq!(prefix_limit(100, 16, 2000), 18);
        // Never more than the limit: few shards, or a small page.
        assert_eq!(prefix_limit(100, 6, 12), 100);
        assert_eq!(prefix_limit(10, 64, 2000), 10);
        assert_eq!(prefix_limit(0, 64, 2000), 0);
        assert_eq!(prefix_limit(i64::MAX, 2000, 2000), i64::MAX);
    }

    fn at(ids: &[i64], floor: Option<i64>) -> Progress {
        Progress { lo: 10, ids: ids.to_vec(), floor }
    }

    fn asked(read: &[Option<Progress>], limit: i64) -> Vec<(usize, i64, i64)> {
        needs_more(&read.iter().map(Option::as_ref).collect::<Vec<_>>(), limit)
    }

    fn full(ids: &[i64]) -> Option<Progress> {
        Some(at(ids, ids.last().copied()))
    }

    fn whole(ids: &[i64]) -> Option<Progress> {
        Some(at(ids, None))
    }

    #[test]
    fn only_a_statement_that_may_hold_more_of_the_page_is_read_again() {
        // The page of 4: 900, 800, 700, 600. The full prefix ends at 500, below the
        // page's last: its unread rows are lower still.
        assert!(asked(&[full(&[900, 700, 500]), whole(&[800, 600])], 4).is_empty());
        // It ends at the page's last (700): its unread rows are below it.
        assert!(asked(&[full(&[900, 800, 700]), whole(&[750, 650])], 4).is_empty());
        // It ends at 800, inside the page (900, 850, 800, 700): rows between the page's
        // last and its own may be unread, and are read.
        assert_eq!(asked(&[whole(&[700, 600]), full(&[900, 850, 800])], 4), vec![(1, 701, 799)]);
        // No ID lies between the two: nothing to read.
        assert!(asked(&[whole(&[700, 600]), full(&[900, 850, 701])], 4).is_empty());
        // Fewer rows than the page holds: read on down to the range's start.
        assert_eq!(asked(&[full(&[900, 850, 800]), whole(&[])], 10), vec![(0, 10, 799)]);
        // Nothing may be unread: nothing to do.
        assert!(asked(&[whole(&[900, 850, 800, 750]), whole(&[1])], 4).is_empty());
    }

    #[test]
    fn a_statement_that_fails_leaves_the_others_read_further_down() {
        // With the first statement, the page of 4 ends at 700 and the second's unread
        // rows (below 600) cannot reach it.
        let (second, third) = (full(&[700, 650, 600]), whole(&[500]));
        assert_eq!(asked(&[full(&[900, 850, 800]), second.clone(), third.clone()], 4), vec![(0, 701, 799)]);
        // The first fails: the page is now 700, 650, 600, 500, and the second may hold
        // rows between 500 and 600.
        assert_eq!(asked(&[None, second, third], 4), vec![(1, 501, 599)]);
    }

    #[test]
    fn a_read_again_records_how_far_it_got() {
        // Read from 701 down, fewer rows than asked: every row above 700 is read.
        let mut p = at(&[900, 850, 800], Some(800));
        p.ids.extend([790, 720]);
        p.read(701, Some(720), false);
        assert_eq!(p.floor, Some(701));
        // The page's last at or above its floor: nothing more. At 500: from there on.
        assert!(asked(&[Some(p.clone()), whole(&[700])], 4).is_empty());
        assert_eq!(asked(&[Some(p.clone()), whole(&[700, 650, 600, 500])], 9), vec![(0, 501, 700)]);
        // As many rows as asked: below the last one, rows may be unread.
        p.read(501, Some(600), true);
        assert_eq!(p.floor, Some(600));
        // Down to the range's start and short: all read.
        p.read(10, Some(20), false);
        assert_eq!(p.floor, None);
    }
}
