//! How the request path sends its statements, and the check of every row it gets back.
//!
//! By default every statement of [`crate::Repo`] and of [`crate::ShardTx`]'s typed
//! operations is sent as an *unnamed* statement with its parameter types given
//! ([`tokio_postgres::Client::query_typed`]): Parse, Bind, Describe, Execute and Sync in
//! one message batch, one round trip, and no name that outlives it. So:
//!
//! - no prepared statement is kept on the server per shard: a connection holds none of
//!   shardline's, whatever the number of shards (see `docs/operations.md`, "Behind
//!   PgBouncer");
//! - the statement is safe behind a transaction-mode pooler (PgBouncer's
//!   `pool_mode = transaction`): it is one implicit transaction, and no other client can
//!   run it, or find it missing, on the server connection it lands on.
//!
//! The price is that the server parses and plans each call. On direct connections,
//! [`crate::ClusterOptions::statement_cache`] keeps up to that many statements
//! prepared per connection instead (bounded: emptied when full), and a fan-out's
//! statements, which plan a branch per shard, are kept by default
//! ([`crate::ClusterOptions::fan_out_prepared`]). [`Kept`] says which, per host.
//!
//! The parameter types come from the table's column types, read once per table with
//! one catalog query ([`TableTypes`]); types built into Postgres are the same in every
//! shard schema and on every host. A column whose type lives in the schema (an enum,
//! an extension's type) has another OID in every schema, and the driver would look it
//! up with a named statement it keeps: such a table's statements are prepared on the
//! connection on direct connections, and refused behind a transaction pooler
//! ([`crate::Error::Pooler`]).
//!
//! Every row that comes back is checked against the shard its statement was sent to:
//! the row's `id` carries the shard that minted it ([`check_rows`]).

use std::collections::HashMap;
use std::sync::Arc;

use shardline_id::{Id, Layout};
use shardline_router::{HostName, LogicalShard, SchemaName};
use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};

use crate::{Error, Result};

/// Postgres's first OID for objects made after `initdb` (FirstNormalObjectId): types
/// below it are built in, the same on every host and in every schema.
pub(crate) const FIRST_NORMAL_OID: u32 = 16_384;

/// The types of one table's columns, by name: `Some` for a type built into Postgres,
/// `None` for a type of the schema (an enum) or one the driver does not know; and which
/// columns have a type of the table's own schema (each shard has its own copy of it).
#[derive(Debug, Default)]
pub(crate) struct TableTypes(HashMap<String, Option<Type>>, std::collections::HashSet<String>);

impl TableTypes {
    /// Reads the column types of `schema.table` with one unnamed statement. A missing
    /// schema or table fails as the statement itself would (3F000 / 42P01), so a moved
    /// shard is seen as moved.
    pub(crate) async fn load(
        client: &tokio_postgres::Client,
        host: &HostName,
        shard: Option<LogicalShard>,
        schema: &SchemaName,
        table: &str,
    ) -> Result<TableTypes> {
        let name = format!("{}.{}", schema.quoted(), shardline_id::ident::quote(table));
        let rows = client
            .query_typed(
                "SELECT a.attname::text, a.atttypid::int8, t.typnamespace = c.relnamespace
                   FROM pg_catalog.pg_attribute a
                   JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
                   JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
                  WHERE a.attrelid = $1::text::regclass AND a.attnum > 0 AND NOT a.attisdropped",
                &[(&name, Type::TEXT)],
            )
            .await
            .map_err(|e| Error::host(host, shard, "read the column types", e))?;
        let mut types = HashMap::with_capacity(rows.len());
        let mut local = std::collections::HashSet::new();
        for row in rows {
            let column: String =
                row.try_get(0).map_err(|e| Error::host(host, shard, "read the column types", e))?;
            let oid = row
                .try_get::<_, i64>(1)
                .map_err(|e| Error::host(host, shard, "read the column types", e))
                .map(|o| u32::try_from(o).ok())?;
            if row.try_get::<_, Option<bool>>(2).ok().flatten().unwrap_or(false) {
                local.insert(column.clone());
            }
            let ty = oid.filter(|o| *o < FIRST_NORMAL_OID).and_then(Type::from_oid);
            types.insert(column, ty);
        }
        Ok(TableTypes(types, local))
    }

    /// The types of `params`, or `None` when one of them, or one of `returned` (the
    /// columns the statement returns), is not built in.
    pub(crate) fn of(&self, params: &[Param<'_>], returned: &[&str]) -> Option<Vec<Type>> {
        if returned.iter().any(|c| !matches!(self.0.get(*c), Some(Some(_)))) {
            return None;
        }
        params
            .iter()
            .map(|p| match p {
                Param::Column(c) => self.0.get(*c).cloned().flatten(),
                Param::Int8 => Some(Type::INT8),
            })
            .collect()
    }

    /// Whether every column `params` and `returned` name is known (a column added by a
    /// migration after the types were read is not).
    pub(crate) fn knows(&self, params: &[Param<'_>], returned: &[&str]) -> bool {
        let named = params.iter().filter_map(|p| match p {
            Param::Column(c) => Some(*c),
            Param::Int8 => None,
        });
        named.chain(returned.iter().copied()).all(|c| self.0.contains_key(c))
    }

    /// Whether `column`'s type lives in the table's own schema (an enum or a domain a
    /// migration made there: each shard schema has its own, under another OID), where
    /// one of an extension's or of `public` (`hstore`, `vector`) is shared by every
    /// schema of the database.
    pub(crate) fn of_the_schema(&self, column: &str) -> bool {
        self.1.contains(column)
    }

    /// The first of `columns` whose type is not built in, for the error that names it.
    pub(crate) fn first_foreign<'c>(&self, columns: impl IntoIterator<Item = &'c str>) -> Option<&'c str> {
        columns.into_iter().find(|c| !matches!(self.0.get(*c), Some(Some(_))))
    }
}

/// What a statement's parameter is: a value of a column (typed as the column), or a
/// `bigint` (a limit).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Param<'a> {
    /// A value compared with, or stored in, this column.
    Column(&'a str),
    /// A `bigint` that is no column's (`LIMIT $n`).
    Int8,
}

/// The column types of each table, learnt once per cluster handle (the same in every
/// shard schema: see the module docs), and read again when a statement names a column
/// they lack (one added by a migration since). A column whose type a migration changes
/// keeps its old type here until the handle is made again: its values are sent as the
/// old type, which the server converts where an assignment cast exists and refuses
/// otherwise.
#[derive(Debug, Default)]
pub(crate) struct TypeCache(std::sync::Mutex<HashMap<String, Arc<TableTypes>>>);

impl TypeCache {
    /// `table`'s column types, read through `client` from `schema` the first time.
    pub(crate) async fn get(
        &self,
        client: &tokio_postgres::Client,
        host: &HostName,
        shard: Option<LogicalShard>,
        schema: &SchemaName,
        table: &str,
    ) -> Result<Arc<TableTypes>> {
        if let Some(t) = self.0.lock().ok().and_then(|m| m.get(table).cloned()) {
            return Ok(t);
        }
        self.load(client, host, shard, schema, table).await
    }

    /// As [`TypeCache::get`], read again when they lack a column of `params` or
    /// `returned`.
    #[allow(clippy::too_many_arguments, reason = "get's arguments and the columns")]
    pub(crate) async fn covering(
        &self,
        client: &tokio_postgres::Client,
        host: &HostName,
        shard: Option<LogicalShard>,
        schema: &SchemaName,
        table: &str,
        params: &[Param<'_>],
        returned: &[&str],
    ) -> Result<Arc<TableTypes>> {
        let types = self.get(client, host, shard, schema, table).await?;
        if types.knows(params, returned) {
            return Ok(types);
        }
        self.load(client, host, shard, schema, table).await
    }

    /// Reads `table`'s column types again, through `client` from `schema`.
    pub(crate) async fn load(
        &self,
        client: &tokio_postgres::Client,
        host: &HostName,
        shard: Option<LogicalShard>,
        schema: &SchemaName,
        table: &str,
    ) -> Result<Arc<TableTypes>> {
        let types = Arc::new(TableTypes::load(client, host, shard, schema, table).await?);
        if let Ok(mut m) = self.0.lock() {
            m.insert(table.to_owned(), Arc::clone(&types));
        }
        Ok(types)
    }
}

/// `params` paired with their types, as [`tokio_postgres::Client::query_typed`] takes
/// them.
pub(crate) fn typed<'p>(
    params: &[&'p (dyn ToSql + Sync)],
    types: &[Type],
) -> Vec<(&'p (dyn ToSql + Sync), Type)> {
    params.iter().zip(types).map(|(v, t)| (*v, t.clone())).collect()
}

/// The column a statement over several shards may add to each row: the shard whose
/// schema the row came from (a plain identifier under
/// [`shardline_id::sql::RESERVED_COLUMN_PREFIX`]: no entity column may take its name).
pub(crate) const BRANCH_SHARD: &str = "shardline_shard";

/// The column a batch insert over several shards adds to each row it returns: which part
/// of the statement (which shard's rows) the row belongs to. Reserved as
/// [`BRANCH_SHARD`] is.
pub(crate) const INSERT_PART: &str = "shardline_part";

/// Checks that every row's `id` was minted by one of `shards` (the shards whose
/// schemas the statement named), or, for a row tagged with its branch's shard
/// ([`BRANCH_SHARD`]), by that shard. A row of another shard means the statement ran
/// somewhere else than it was sent: a misrouted connection, or another client's
/// statement of the same name run by a transaction pooler.
///
/// # Errors
///
/// [`Error::Misrouted`] naming the host, the shard expected and the shard found.
pub(crate) fn check_rows(
    layout: Layout,
    host: &HostName,
    what: &'static str,
    shards: &[LogicalShard],
    rows: &[Row],
) -> Result<()> {
    // Every caller names the shards its statement was sent to: at least one.
    let Some(&expected) = shards.first() else { return Ok(()) };
    for row in rows {
        // A row without a bigint `id` is not checked here; decoding it fails elsewhere.
        let Some(Ok(raw)) =
            row.columns().iter().position(|c| c.name() == "id").map(|i| row.try_get::<_, i64>(i))
        else {
            continue;
        };
        let Ok(id) = Id::from_i64(raw) else { continue };
        let found = layout.shard_of(id);
        // Tagged with its schema's shard: checked against that one, not any of the
        // statement's.
        let branch = row
            .columns()
            .iter()
            .position(|c| c.name() == BRANCH_SHARD)
            .and_then(|i| row.try_get::<_, i32>(i).ok())
            .and_then(|b| shards.iter().copied().find(|s| i32::from(s.get()) == b));
        let fits = match branch {
            Some(b) => u32::from(b.get()) == found,
            None => shards.iter().any(|s| u32::from(s.get()) == found),
        };
        if !fits {
            return Err(Error::Misrouted {
                host: host.clone(),
                what,
                expected: branch.unwrap_or(expected),
                found,
                id: raw,
            });
        }
    }
    Ok(())
}

/// The fewest statements a connection keeps before its cache is emptied, when it keeps
/// fan-outs' statements and no statement cache is asked for (more with many shards:
/// four per batch of all the shards).
const FAN_OUT_KEPT_AT_LEAST: usize = 256;

/// What a connection to one host keeps prepared: nothing behind a transaction pooler.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kept {
    /// Whether the connection may keep statements (not behind a transaction pooler, as
    /// far as its pool knows): a type of the schema's can be looked up when it may.
    pub(crate) may: crate::cluster::MayKeep,
    /// Statements of one shard.
    pub(crate) point: bool,
    /// A fan-out's statements.
    pub(crate) fan_out: bool,
    /// Past this many kept on a connection, its cache is emptied.
    pub(crate) bound: usize,
}

impl Kept {
    /// What `client`, a connection of `host`'s pool, keeps, as the options and the
    /// pool's pooler say ([`crate::Cluster::may_keep`]).
    pub(crate) fn on(cluster: &crate::Cluster, host: &HostName, client: &deadpool_postgres::Object) -> Kept {
        let o = cluster.options();
        let may = cluster.may_keep(host, client);
        if may != crate::cluster::MayKeep::Yes {
            return Kept { may, point: false, fan_out: false, bound: 0 };
        }
        // The statement cache asked for bounds everything kept. Without one, fan-outs
        // get room for a few shapes (a window, a count, a listing) over the batches of
        // a host that held every shard, so that they do not empty each other's.
        let bound = if o.statement_cache > 0 || !o.fan_out_prepared {
            o.statement_cache
        } else {
            let batches = usize::from(cluster.map().count().get()).div_ceil(o.fan_out_batch.max(1));
            FAN_OUT_KEPT_AT_LEAST.max(batches.saturating_mul(4))
        };
        Kept { may, point: o.statement_cache > 0, fan_out: o.fan_out_prepared, bound }
    }

    /// Empties `client`'s cache when it is full (the bound, one at least), before more
    /// statements are prepared on it: at most the bound plus those.
    pub(crate) fn make_room(&self, client: &deadpool_postgres::Object) {
        if client.statement_cache.size() >= self.bound.max(1) {
            client.statement_cache.clear();
        }
    }
}

/// Runs `sql` (made for `route`'s schema) with `params` on `client`: unnamed, with the
/// types of `kinds`, when the table's types allow it and no statement cache is asked
/// for ([`crate::ClusterOptions::statement_cache`]); otherwise prepared and kept on the
/// connection (at most `statement_cache` of them) on a direct connection, and refused
/// behind a transaction pooler.
/// `returned` are the columns the statement returns. The caller checks the rows.
#[allow(clippy::too_many_arguments, reason = "one call shape for every typed statement")]
pub(crate) async fn run(
    cluster: &crate::Cluster,
    client: &deadpool_postgres::Object,
    route: &shardline_router::Route,
    table: &str,
    returned: &[&str],
    what: &'static str,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
    kinds: &[Param<'_>],
) -> Result<Vec<Row>> {
    let (host, shard) = (&route.host, Some(route.shard));
    let types = cluster.types().covering(client, host, shard, &route.schema, table, kinds, returned).await?;
    let kept = Kept::on(cluster, host, client);
    match types.of(kinds, returned) {
        Some(t) if !kept.point => client
            .query_typed(sql, &typed(params, &t))
            .await
            .map_err(|e| crate::statement_error(host, shard, what, e, &t, params)),
        None if kept.may != crate::cluster::MayKeep::Yes => {
            let names = kinds.iter().filter_map(|k| match k {
                Param::Column(c) => Some(*c),
                Param::Int8 => None,
            });
            let column = types.first_foreign(names.chain(returned.iter().copied())).unwrap_or("?");
            Err(kept.may.refusal(host, || schema_type_refused(host, table, column)))
        }
        _ => {
            // Kept per connection (a type of the schema needs it, or the cache is on),
            // within the bound (one at least): past it, start again.
            kept.make_room(client);
            let statement = client
                .prepare_cached(sql)
                .await
                .map_err(|e| pooler_hint(crate::Error::host(host, shard, what, e)))?;
            client.query(&statement, params).await.map_err(|e| {
                forget_if_stale(client, &e);
                pooler_hint(crate::statement_error(host, shard, what, e, statement.params(), params))
            })
        }
    }
}

/// After a kept statement failed: when it failed because its table changed since it
/// was prepared (a migration altered a column's type: 0A000, "cached plan must not
/// change result type"), empties the connection's statement cache, so the next call
/// prepares it again instead of failing the same way until the connection is recycled.
/// The failed statement did not run. Returns whether it failed that way.
pub(crate) fn forget_if_stale(client: &deadpool_postgres::Object, e: &tokio_postgres::Error) -> bool {
    let stale = e.code() == Some(&tokio_postgres::error::SqlState::FEATURE_NOT_SUPPORTED);
    if stale {
        tracing::debug!(error = %e, "a kept statement's table changed; preparing it again next time");
        client.statement_cache.clear();
    }
    stale
}

/// The error for a table whose column has a type of the shard's schema, behind a
/// transaction pooler.
pub(crate) fn schema_type_refused(host: &HostName, table: &str, column: &str) -> Error {
    Error::Pooler {
        host: host.clone(),
        reason: format!(
            "column {table}.{column} has a type of the shard's schema (an enum, say): behind a \
             transaction-mode pooler shardline sends only unnamed statements with built-in types \
             (the driver looks such types up with a statement it keeps); use a built-in type \
             (text with a CHECK constraint), or connect directly or through a session-mode pool (say transaction_pooler = false for a \
             session pool)"
        ),
    }
}

/// A prepared statement that was missing (26000) or already there (42P05): the sign of
/// a transaction-mode pooler in front of a host that the cluster was not told of.
pub(crate) fn pooler_hint(e: Error) -> Error {
    match (&e, e.sqlstate()) {
        (Error::Host { host, .. }, Some(code @ ("26000" | "42P05"))) => Error::Pooler {
            host: host.clone(),
            reason: format!(
                "a prepared statement was {} on the server (SQLSTATE {code}): the host is behind a \
                 transaction-mode pooler; set transaction_pooler = true in the config \
                 (ClusterOptions::transaction_pooler)",
                if code == "26000" { "missing" } else { "already there" }
            ),
        },
        _ => e,
    }
}
