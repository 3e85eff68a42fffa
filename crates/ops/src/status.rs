//! `shardline status`: per host, reachable or not, its shards, and rows and bytes per
//! table summed over its shard schemas.
//!
//! Row counts are Postgres's live-tuple estimates (`pg_stat_user_tables.n_live_tup`),
//! which cost nothing to read; counting 2000 shards' rows exactly would scan every
//! table. Bytes are exact (`pg_total_relation_size`: table, indexes and TOAST).

use std::time::Duration;

use serde::Serialize;
use shardline_repo::Catalog;
use shardline_repo::catalog;
use shardline_router::{Config, HostName};
use tokio_postgres::Client;

use crate::converge::MINTER;
use crate::grants::GRANTS;
use crate::migrations;
use crate::{Error, Result, describe};

/// The cluster as seen now.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Status {
    /// The shard map's version.
    pub map_version: i64,
    /// How many logical shards.
    pub logical_shards: u16,
    /// How many migration files the config's directory holds.
    pub migrations: usize,
    /// Each host of the map, in order.
    pub hosts: Vec<HostStatus>,
}

/// One host.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct HostStatus {
    /// Its name.
    pub name: HostName,
    /// Whether it answered.
    pub reachable: bool,
    /// Why not, when it did not.
    pub error: Option<String>,
    /// Shards the map gives it.
    pub shards: usize,
    /// Of those, shards whose schema exists on it.
    pub schemas_present: usize,
    /// Of those, shards missing their schema or one or more of the migration files, or
    /// whose ledger records a file as it was before it changed (`migrate` refuses such
    /// a file and names it); shards being moved are not counted.
    pub shards_behind: usize,
    /// Of those, shards a move that has not ended is moving (`shardline moves`): while
    /// it is fenced, its schema here is renamed, and `migrate` waits for it to end.
    pub shards_moving: usize,
    /// Its `wal_level` (moves need `logical`).
    pub wal_level: Option<String>,
    /// Tables, summed over its shard schemas, by name.
    pub tables: Vec<TableStatus>,
}

/// One table name, summed over a host's shard schemas.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct TableStatus {
    /// The table's name (unqualified).
    pub name: String,
    /// Live rows (Postgres's estimate).
    pub rows: i64,
    /// Bytes on disk: table, indexes and TOAST.
    pub bytes: i64,
}

/// Reads the catalog, then every host in parallel. A host that does not answer within
/// `timeout` is reported as unreachable, not as an error.
///
/// # Errors
///
/// When the catalog cannot be read, or the config contradicts it; [`Error::CatalogHung`]
/// once it has answered no probe for `timeout` (2 s at least), as a host that does not
/// answer within it is unreachable.
pub async fn status(config: &Config, timeout: Duration) -> Result<Status> {
    crate::moves::unless_catalog_hung(config, timeout, status_within(config, timeout)).await
}

async fn status_within(config: &Config, timeout: Duration) -> Result<Status> {
    let config = &crate::fleet::resolved_within(config, timeout).await?;
    let (catalog, info) = Catalog::open(config).await?;
    let map = catalog.map().await?;
    let files = migrations::load_dir(&config.migrations)?;
    // A journal this version cannot read (a step a newer shardline wrote) leaves the
    // moving shards unknown, counted as the others; the rest of the status stands.
    let moving: std::collections::HashSet<shardline_router::LogicalShard> =
        match crate::moves::journal::running(&catalog, None).await {
            Ok(running) => running.iter().map(|m| m.shard).collect(),
            Err(e) => {
                tracing::warn!(error = %shardline_repo::error_chain(&e), "cannot read the running moves; none counted as moving");
                std::collections::HashSet::new()
            }
        };
    let names: Vec<(String, String)> = files.iter().map(|m| (m.name.clone(), m.checksum.clone())).collect();
    let hosts = futures::future::join_all(map.hosts().iter().map(|host| {
        let map = &map;
        let names = &names;
        let moving = &moving;
        let prefix = &info.schema_prefix;
        async move {
            let schemas: Vec<String> =
                map.shards_of(host).map(|s| prefix.schema(s).as_str().to_owned()).collect();
            // Judged for migrations: the shards no move is moving.
            let steady: Vec<String> = map
                .shards_of(host)
                .filter(|s| !moving.contains(s))
                .map(|s| prefix.schema(s).as_str().to_owned())
                .collect();
            let mut status = HostStatus {
                name: host.clone(),
                reachable: false,
                error: None,
                shards: schemas.len(),
                schemas_present: 0,
                shards_behind: 0,
                shards_moving: schemas.len() - steady.len(),
                wal_level: None,
                tables: Vec::new(),
            };
            let Some(h) = config.host(host) else {
                status.error = Some("not in the config".into());
                return status;
            };
            let read = async {
                let client = catalog::connect(&h.url, &format!("host {host}"))
                    .await
                    .map_err(|e| shardline_repo::error_chain(&e))?;
                read_host(&client, &schemas, &steady, names)
                    .await
                    .map_err(|e| shardline_repo::error_chain(&e))
            };
            match tokio::time::timeout(timeout, read).await {
                Ok(Ok((present, behind, wal, tables))) => {
                    status.reachable = true;
                    status.schemas_present = present;
                    status.shards_behind = behind;
                    status.wal_level = Some(wal);
                    status.tables = tables;
                }
                Ok(Err(e)) => status.error = Some(e),
                Err(_) => status.error = Some(format!("no answer within {timeout:?}")),
            }
            status
        }
    }))
    .await;
    Ok(Status {
        map_version: map.version(),
        logical_shards: map.count().get(),
        migrations: names.len(),
        hosts,
    })
}

/// `schemas`: the host's shards' schemas; `steady`: those of them no move is moving,
/// the only ones judged behind or not.
async fn read_host(
    client: &Client,
    schemas: &[String],
    steady: &[String],
    files: &[(String, String)],
) -> Result<(usize, usize, String, Vec<TableStatus>)> {
    let (names, sums): (Vec<&str>, Vec<&str>) = files.iter().map(|(n, c)| (n.as_str(), c.as_str())).unzip();
    let q = |what: &'static str| {
        move |e: tokio_postgres::Error| {
            let (sqlstate, message) = describe(&e);
            Error::Host { host: String::new(), what: what.into(), sqlstate, message }
        }
    };
    let row = client
        .query_one(
            "SELECT current_setting('wal_level'),
                    (SELECT count(*) FROM pg_namespace WHERE nspname = ANY($1)),
                    to_regclass('shardline.shard_migrations') IS NOT NULL",
            &[&schemas],
        )
        .await
        .map_err(q("read the host"))?;
    let wal: String = row.get(0);
    let present = usize::try_from(row.get::<_, i64>(1)).unwrap_or(0);
    let has_ledger: bool = row.get(2);
    let up_to_date = if names.is_empty() {
        client
            .query_one("SELECT count(*) FROM pg_namespace WHERE nspname = ANY($1)", &[&steady])
            .await
            .map_err(q("read the host"))?
            .get::<_, i64>(0)
    } else if has_ledger {
        client
            .query_one(
                // Up to date: the ledger holds exactly the files, names and checksums
                // (as the pre-flight's `off_level` compares, the minter's and the grants'
                // rows aside). Not a schema dropped while its ledger rows stayed, nor one
                // whose ledger holds another version of a file (changed after it was
                // applied) or a file no longer in the directory: `migrate` refuses both.
                "SELECT count(*) FROM (
                     SELECT m.schema_name FROM shardline.shard_migrations AS m
                     JOIN pg_namespace AS n ON n.nspname = m.schema_name
                     LEFT JOIN unnest($2::text[], $3::text[]) AS f (name, checksum)
                       ON f.name = m.name AND f.checksum = m.checksum
                     WHERE m.schema_name = ANY($1) AND m.name <> ALL($4)
                     GROUP BY m.schema_name
                     HAVING count(f.name) = cardinality($2) AND count(*) = cardinality($2)) t",
                &[&steady, &names, &sums, &[MINTER, GRANTS].as_slice()],
            )
            .await
            .map_err(q("read the ledger"))?
            .get::<_, i64>(0)
    } else {
        0
    };
    let behind = steady.len().saturating_sub(usize::try_from(up_to_date).unwrap_or(0));
    let tables = client
        .query(
            // A table dropped since the statistics' snapshot has no size (NULL): 0.
            "SELECT s.relname::text, coalesce(sum(s.n_live_tup), 0)::bigint,
                    coalesce(sum(pg_total_relation_size(s.relid)), 0)::bigint
             FROM pg_stat_user_tables s WHERE s.schemaname = ANY($1)
             GROUP BY 1 ORDER BY 1",
            &[&schemas],
        )
        .await
        .map_err(q("read table sizes"))?
        .iter()
        .map(|r| TableStatus { name: r.get(0), rows: r.get(1), bytes: r.get(2) })
        .collect();
    Ok((present, behind, wal, tables))
}
