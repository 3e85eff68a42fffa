//! Bringing every shard up to date: its schema, its ID minter, its migrations, and the
//! application roles' grants on them ([`crate::grants::shard_grants`]).
//!
//! The truth about a shard lives beside it, on its host: a ledger table,
//! `shardline.shard_migrations`, written in the same transaction as the work it records.
//! So a shard is always either fully migrated or untouched, whatever dies when, and a
//! later run reads the ledger and carries on. (The catalog keeps a copy of each shard's
//! state for `status` and `map`; it is refreshed from the ledgers on every run.)
//!
//! Work is planned for every host first (reading ledgers, checking checksums and order),
//! so a problem in any file is found before anything changes. Then each host works
//! through its shards with a few connections; each shard is one transaction whose
//! statements are pipelined (sent together, answered in order), so a shard costs about
//! one round trip plus the server's work.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use shardline_id::Layout;
use shardline_id::sql::ShardSql;
use shardline_repo::catalog;
use shardline_router::config::DbUrl;
use shardline_router::{HostName, LogicalShard, SchemaName, SchemaPrefix, ShardMap};
use tokio_postgres::Client;

use crate::grants::{GRANTS, shard_grants};
use crate::migrations::{Migration, checksum};
use crate::{Error, Result, describe};

/// The ledger's name for the ID minter (sequence and functions), installed before any
/// migration. Its checksum is that of the SQL installed, so a newer shardline that
/// renders different SQL reinstalls it (installing is idempotent and never moves a
/// sequence backwards).
pub const MINTER: &str = "shardline minter";

/// What the ledger's [`MINTER`] entry installs in shard `schema`: the ID minter
/// (`shardline_id::sql::ShardSql::install`) and the schema's
/// [`shardline_repo::LIVE_CHECK`] function as the shard's own copy has it
/// ([`live_sql`]): a move's copy is made, and its copy's version set, in the same
/// transaction ([`ShardWork::hold`]).
pub(crate) fn minter_sql(
    layout: Layout,
    schema: &SchemaName,
    shard: LogicalShard,
    minter: shardline_id::sql::Minter,
) -> Result<String> {
    let install = ShardSql::new(layout, schema.as_str(), u32::from(shard.get()))?.minter(minter).install();
    Ok(format!("{install}\n{}", live_sql(schema.as_str(), None)))
}

/// The [`shardline_repo::LIVE_CHECK`] function of shard schema `schema`. On the
/// shard's own copy (`copy_of` `None`) a SQL function returning `true`, which the
/// planner inlines and folds away (every read of the repository names it; the cheapest
/// form measured, `scripts/live-check-cost.sh`). On move
/// `copy_of`'s copy, not the shard's until that move's flip: it fails with 3F000, as a
/// schema the shard has left does, unless the move's marker there says the flip is
/// decided (replicated from the source) or the session is the move's own; as the copy's
/// write guards do ([`crate::moves`]' `guard_sql`). `SECURITY DEFINER`, with a pinned
/// `search_path`: an application role need not read shardline's tables.
pub(crate) fn live_sql(schema: &str, copy_of: Option<i64>) -> String {
    let f = format!("{}.{}()", shardline_id::ident::quote(schema), shardline_repo::LIVE_CHECK);
    match copy_of {
        None => format!("CREATE OR REPLACE FUNCTION {f} RETURNS boolean LANGUAGE sql STABLE PARALLEL SAFE RETURN true;"),
        Some(id) => format!(
            "CREATE OR REPLACE FUNCTION {f} RETURNS boolean LANGUAGE plpgsql STABLE
                 SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $live$
             BEGIN
                 IF current_setting('shardline.move', true) = '{id}'
                    OR EXISTS (SELECT FROM shardline.move_marks WHERE move_id = {id} AND decided = 'flip') THEN
                     RETURN true;
                 END IF;
                 RAISE EXCEPTION 'schema \"%\" on this host is a copy that a move brings here; the shard lives elsewhere until its flip', {name}
                     USING ERRCODE = 'invalid_schema_name';
             END $live$;",
            name = literal(schema)
        ),
    }
}

/// The ledger on each host, created if missing.
pub const HOST_LEDGER_SQL: &str = "CREATE SCHEMA IF NOT EXISTS shardline;
CREATE TABLE IF NOT EXISTS shardline.shard_migrations (
    schema_name text NOT NULL,
    shard       integer NOT NULL,
    name        text NOT NULL,
    checksum    text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (schema_name, name)
);
COMMENT ON TABLE shardline.shard_migrations IS 'shardline: what has been applied to each shard schema on this host, written in the same transaction as the work';";

/// What one shard needs.
#[derive(Debug, Clone)]
pub(crate) struct ShardWork {
    pub(crate) shard: LogicalShard,
    pub(crate) schema: SchemaName,
    pub(crate) create_schema: bool,
    pub(crate) minter: Option<String>,
    pub(crate) migrations: Vec<usize>,
    /// The application roles' grants ([`shard_grants`]), run after the migrations in
    /// the same transaction; `None` when the config names no role.
    pub(crate) grants: Option<String>,
    /// Run last in the same transaction, and not recorded in the ledger: a move's copy
    /// is guarded as it is made (its writes refused and its reads failed until the
    /// move's flip), so no router a move behind reads or writes it while it is empty.
    pub(crate) hold: Option<String>,
}

/// What one host needs.
#[derive(Debug)]
pub(crate) struct HostPlan {
    pub(crate) host: HostName,
    pub(crate) work: Vec<ShardWork>,
    /// Every shard of the host with the last migration it will have once the work is
    /// done.
    pub(crate) shards: Vec<LogicalShard>,
}

/// What converging did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Done {
    pub(crate) schemas_created: usize,
    pub(crate) minters_installed: usize,
    pub(crate) shards_migrated: usize,
    pub(crate) migrations_applied: usize,
    pub(crate) shards_granted: usize,
}

/// The shared, read-only inputs.
pub(crate) struct Inputs<'a> {
    pub(crate) map: &'a ShardMap,
    pub(crate) prefix: &'a SchemaPrefix,
    pub(crate) layout: Layout,
    /// The config's `id.minter`: which `next_id()` each shard gets.
    pub(crate) minter: shardline_id::sql::Minter,
    pub(crate) migrations: &'a [Migration],
    /// The config's `app_roles`.
    pub(crate) roles: &'a [shardline_router::RoleName],
    pub(crate) lock_timeout: Duration,
    pub(crate) shard_timeout: Duration,
}

fn host_err(host: &HostName, what: impl Into<String>, e: &tokio_postgres::Error) -> Error {
    let (sqlstate, message) = describe(e);
    Error::Host { host: host.to_string(), what: what.into(), sqlstate, message }
}

/// Reads `host`'s ledger and plans its shards' work. Creates the ledger table if it is
/// missing, and changes nothing else.
pub(crate) async fn plan_host(client: &Client, host: &HostName, inputs: &Inputs<'_>) -> Result<HostPlan> {
    let shards: Vec<LogicalShard> = inputs.map.shards_of(host).collect();
    let schemas: Vec<String> = shards.iter().map(|s| inputs.prefix.schema(*s).as_str().to_owned()).collect();
    client.batch_execute(HOST_LEDGER_SQL).await.map_err(|e| host_err(host, "create the ledger", &e))?;
    // What lets anyone finish or undo a move's fence whose lease ran out.
    client
        .batch_execute(&format!("{}\n{}", crate::moves::MARKS_SQL, crate::moves::engine::RESOLVE_SQL))
        .await
        .map_err(|e| host_err(host, "install shardline.resolve_fence", &e))?;
    let existing: HashSet<String> = client
        .query("SELECT nspname::text FROM pg_namespace WHERE nspname = ANY($1)", &[&schemas])
        .await
        .map_err(|e| host_err(host, "list the shard schemas", &e))?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut ledger: HashMap<String, Vec<(String, String)>> = HashMap::new();
    for row in client
        .query(
            "SELECT schema_name, name, checksum FROM shardline.shard_migrations WHERE schema_name = ANY($1)",
            &[&schemas],
        )
        .await
        .map_err(|e| host_err(host, "read the ledger", &e))?
    {
        ledger.entry(row.get(0)).or_default().push((row.get(1), row.get(2)));
    }

    let by_name: HashMap<&str, (usize, &Migration)> =
        inputs.migrations.iter().enumerate().map(|(i, m)| (m.name.as_str(), (i, m))).collect();
    let mut work = Vec::new();
    for (shard, schema_name) in shards.iter().zip(&schemas) {
        let schema = inputs.prefix.schema(*shard);
        let applied = ledger.remove(schema_name).unwrap_or_default();
        let where_ = format!("{schema} (shard {}) on {host}", shard.get());
        if !existing.contains(schema_name) && !applied.is_empty() {
            return Err(Error::Ledger {
                file: applied[0].0.clone(),
                message: format!(
                    "the ledger of {where_} lists it, but the schema is missing; \
                     delete that shard's rows from shardline.shard_migrations on {host} to rebuild it"
                ),
            });
        }
        let mut minter_sum = None;
        let mut grants_sum = None;
        let mut last_applied: Option<(bool, Option<u64>, &str)> = None;
        let mut done: HashSet<&str> = HashSet::new();
        for (name, sum) in &applied {
            if name == MINTER {
                minter_sum = Some(sum.as_str());
                continue;
            }
            if name == GRANTS {
                grants_sum = Some(sum.as_str());
                continue;
            }
            match by_name.get(name.as_str()) {
                None => {
                    return Err(Error::Ledger {
                        file: name.clone(),
                        message: format!(
                            "{where_} has it applied, but it is not in the migrations directory; \
                             restore the file"
                        ),
                    });
                }
                Some((_, m)) if m.checksum != *sum => {
                    return Err(Error::Ledger {
                        file: name.clone(),
                        message: format!(
                            "the file changed after it was applied to {where_} (checksum {sum} then, {} now); \
                             an applied migration must not change: restore it and add a new file",
                            m.checksum
                        ),
                    });
                }
                Some(_) => {}
            }
            done.insert(name.as_str());
            last_applied = last_applied.max(Some(crate::migrations::order(name)));
        }
        let pending: Vec<usize> = inputs
            .migrations
            .iter()
            .enumerate()
            .filter(|(_, m)| !done.contains(m.name.as_str()))
            .map(|(i, _)| i)
            .collect();
        if let (Some(first), Some(last)) = (pending.first(), last_applied) {
            let name = &inputs.migrations[*first].name;
            if crate::migrations::order(name) < last {
                let last = last.2;
                return Err(Error::Ledger {
                    file: name.clone(),
                    message: format!(
                        "it sorts before {last}, which {where_} already has; \
                         rename it so that it sorts after every applied migration"
                    ),
                });
            }
        }
        let install = minter_sql(inputs.layout, &schema, *shard, inputs.minter)?;
        let minter = (minter_sum != Some(checksum(install.as_bytes()).as_str())).then_some(install);
        // Granted with any other work (a migration may add tables), and on its own when
        // the roles (or what they get) changed. Nothing is revoked from a role taken
        // out of app_roles.
        let grants = Some(shard_grants(&schema, inputs.roles)).filter(|g| !g.is_empty());
        let regrant = grants.as_ref().is_some_and(|g| grants_sum != Some(checksum(g.as_bytes()).as_str()));
        if !existing.contains(schema_name) || minter.is_some() || !pending.is_empty() || regrant {
            work.push(ShardWork {
                shard: *shard,
                schema,
                create_schema: !existing.contains(schema_name),
                minter,
                migrations: pending,
                grants,
                hold: None,
            });
        }
    }
    Ok(HostPlan { host: host.clone(), work, shards })
}

/// Where a pipelined statement came from, to name it when it fails.
enum Origin {
    Ours(&'static str),
    File { migration: usize, statement: usize },
}

use shardline_id::ident::literal;

/// Makes the catch-up every shard schema of the database shares, when it is missing
/// (`shardline_id::sql::host_install`), in a transaction of its own. `what` names the
/// work it is for in an error.
pub(crate) async fn shared_minter(client: &Client, host: &HostName, what: &str) -> Result<()> {
    client.batch_execute(&shardline_id::sql::host_install()).await.map_err(|e| {
        let (sqlstate, message) = describe(&e);
        Error::Host {
            host: host.to_string(),
            what: format!("{what}: make the minter's shared catch-up"),
            sqlstate,
            message,
        }
    })
}

/// Gives every PL/pgSQL function in the shard's schema that sets no `search_path` of
/// its own, and that the migrating role may alter, the path its migration ran with: the
/// shard's schema and `public`, then the session's default path (the role's and the
/// database's `search_path`, so a schema of extensions it names is kept), then
/// `pg_temp`. Postgres resolves the names in such a body when it runs, under the
/// caller's path: a trigger that names a table unqualified would otherwise write into
/// `public`'s table of that name when the repository (whose statements are qualified,
/// on the pool's default path) fires it, or into another shard's when a session's path
/// names that one. `pg_temp` last: a temporary table does not take a shard table's
/// place. A function that sets its own path keeps it; the minter's `next_id()` runs on
/// its caller's ([`shardline_id::sql::ON_CALLERS_PATH`]). Procedures are left as they
/// are: one with a setting of its own cannot `COMMIT`.
fn pin_functions(schema: &SchemaName) -> String {
    let callers: Vec<String> = shardline_id::sql::ON_CALLERS_PATH.iter().map(|n| literal(n)).collect();
    format!(
        r#"DO $pin$
DECLARE
    f record;
    head text := {head};
    default_path text := (SELECT s.reset_val FROM pg_catalog.pg_settings AS s WHERE s.name = 'search_path');
BEGIN
    -- The path the functions get, set as the session's for `FROM CURRENT`: Postgres
    -- checks it as it checks any search_path, and a default it cannot take in a list
    -- (an empty name: `search_path = ''` stored as "") is left out.
    BEGIN
        PERFORM pg_catalog.set_config('search_path',
            head OPERATOR(pg_catalog.||) ', ' OPERATOR(pg_catalog.||) default_path
                 OPERATOR(pg_catalog.||) ', pg_temp', true);
    EXCEPTION WHEN OTHERS THEN
        PERFORM pg_catalog.set_config('search_path', head OPERATOR(pg_catalog.||) ', pg_temp', true);
    END;
    FOR f IN
        SELECT n.nspname, p.proname, pg_catalog.pg_get_function_identity_arguments(p.oid) AS args
          FROM pg_catalog.pg_proc AS p
          JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
          JOIN pg_catalog.pg_language AS l ON l.oid = p.prolang
         WHERE n.nspname = {name} AND l.lanname = 'plpgsql' AND p.prokind = 'f'
           AND pg_catalog.pg_has_role(p.proowner, 'USAGE')
           AND p.proname <> ALL (ARRAY[{callers}]::pg_catalog.name[])
           AND NOT EXISTS (SELECT FROM pg_catalog.unnest(p.proconfig) AS c(setting)
                            WHERE c.setting LIKE 'search\_path=%')
    LOOP
        EXECUTE pg_catalog.format('ALTER FUNCTION %I.%I(%s) SET search_path FROM CURRENT',
                                  f.nspname, f.proname, f.args);
    END LOOP;
    PERFORM pg_catalog.set_config('search_path', head, true);
END
$pin$"#,
        name = literal(schema.as_str()),
        callers = callers.join(", "),
        head = literal(&format!("{}, public", schema.quoted())),
    )
}

/// Applies one shard's work in one transaction, pipelined. A shard whose work installs
/// the minter needs the shared catch-up made first, outside this transaction
/// ([`shared_minter`]; made inside it, it would hold up every other shard installed
/// beside it until the whole transaction ends): a host's run makes it once before its
/// shards, a move before its copy.
pub(crate) async fn apply_shard(
    client: &Client,
    host: &HostName,
    w: &ShardWork,
    inputs: &Inputs<'_>,
) -> Result<()> {
    let q = w.schema.quoted();
    let shard = w.shard;
    let mut batch: Vec<(Origin, String)> = vec![(
        Origin::Ours("begin the shard's transaction"),
        format!(
            "BEGIN; SET LOCAL search_path TO {q}, public; SET LOCAL lock_timeout = '{}ms'; CREATE SCHEMA IF NOT EXISTS {q}",
            // 0 would be no timeout at all.
            inputs.lock_timeout.as_millis().max(1)
        ),
    )];
    let mut ledger: Vec<(String, String)> = Vec::new();
    if let Some(install) = &w.minter {
        batch.push((Origin::Ours("install the ID minter"), install.clone()));
        ledger.push((MINTER.to_owned(), checksum(install.as_bytes())));
    }
    for &m in &w.migrations {
        let migration = &inputs.migrations[m];
        for (i, s) in migration.statements.iter().enumerate() {
            batch.push((Origin::File { migration: m, statement: i }, s.sql.clone()));
        }
        ledger.push((migration.name.clone(), migration.checksum.clone()));
    }
    if !w.migrations.is_empty() {
        batch.push((
            Origin::Ours("pin the search_path of the shard's PL/pgSQL functions"),
            pin_functions(&w.schema),
        ));
    }
    if let Some(grants) = &w.grants {
        batch.push((Origin::Ours("grant the app_roles their privileges"), grants.clone()));
        ledger.push((GRANTS.to_owned(), checksum(grants.as_bytes())));
    }
    if let Some(hold) = &w.hold {
        batch.push((Origin::Ours("guard the move's copy"), hold.clone()));
    }
    let values: Vec<String> = ledger
        .iter()
        .map(|(name, sum)| {
            format!("({}, {shard}, {}, {})", literal(w.schema.as_str()), literal(name), literal(sum))
        })
        .collect();
    batch.push((
        Origin::Ours("record the work in the ledger"),
        format!(
            "INSERT INTO shardline.shard_migrations (schema_name, shard, name, checksum) VALUES {} \
             ON CONFLICT (schema_name, name) DO UPDATE SET checksum = excluded.checksum, applied_at = now()",
            values.join(", ")
        ),
    ));
    // A file's statement goes as one statement of the extended protocol, which refuses
    // a string holding several (42601): should the splitter ever miscount, the
    // statement fails loudly rather than run a `COMMIT` the check could not see. Its
    // rows (if any) are not read: no type is looked up, nothing waits on them.
    let results = futures::future::join_all(batch.iter().map(|(origin, sql)| async move {
        match origin {
            Origin::File { .. } => client.execute_typed(sql, &[]).await.map(drop),
            Origin::Ours(_) => client.batch_execute(sql).await,
        }
    }))
    .await;
    // `COMMIT` only once every piece answered: a piece the driver refused before it was
    // sent (a NUL in a statement, say) leaves the server's transaction whole, and a
    // `COMMIT` sent with the rest would have committed everything around it.
    let Some((at, e)) = results.iter().enumerate().find_map(|(i, r)| r.as_ref().err().map(|e| (i, e))) else {
        return client.batch_execute("COMMIT").await.map_err(|e| {
            let (sqlstate, message) = describe(&e);
            Error::Host {
                host: host.to_string(),
                what: format!("shard {shard} ({}): commit", w.schema),
                sqlstate,
                message,
            }
        });
    };
    // Best effort: a connection the failure broke rolls back as it closes.
    let _ = client.batch_execute("ROLLBACK").await;
    let (sqlstate, message) = describe(e);
    Err(match &batch[at].0 {
        Origin::Ours(what) => Error::Host {
            host: host.to_string(),
            what: format!("shard {shard} ({}): {what}", w.schema),
            sqlstate,
            message,
        },
        Origin::File { migration, statement } => {
            let m = &inputs.migrations[*migration];
            let s = &m.statements[*statement];
            Error::Migration(Box::new(crate::FailedStatement {
                shard,
                schema: w.schema.to_string(),
                host: host.clone(),
                file: m.name.clone(),
                index: statement + 1,
                line: s.line,
                statement: s.sql.clone(),
                sqlstate,
                message,
            }))
        }
    })
}

/// How long [`bounded`] waits for a host to take the cancel of a statement that ran out
/// of time: a host that answers takes it in milliseconds; one that does not (hung, cut
/// off) would not run the statement on either.
const CANCEL_WAIT: Duration = Duration::from_secs(1);

/// How long a host may take to answer what it is asked, at most, as `what`, on `client`
/// (connected to `url`): past `after`, the statement in flight is cancelled on the
/// server, and the answer is [`Error::Timeout`]. Dropping the future alone would leave
/// the server running the statement to its end, and holding its locks (a migration's
/// `ALTER TABLE` blocks the application's reads of the table) after the operator was
/// told it had given up.
pub(crate) async fn bounded<T>(
    client: &Client,
    url: &DbUrl,
    host: &HostName,
    what: impl FnOnce() -> String,
    after: Duration,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(after, work).await {
        Ok(result) => result,
        Err(_) => {
            let what = what();
            let (token, target) = (client.cancel_token(), format!("host {host}"));
            let cancel = catalog::cancel(&token, url, &target);
            match tokio::time::timeout(CANCEL_WAIT, cancel).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(%host, %what, error = %e, "timed out, and could not cancel the statement in flight")
                }
                Err(_) => {
                    tracing::warn!(%host, %what, "timed out, and the host took no cancel within {CANCEL_WAIT:?}")
                }
            }
            Err(Error::Timeout { host: host.clone(), what, after })
        }
    }
}

/// Works through one host's plan with `clients` (one worker each, connected to `url`), stopping early
/// when `stop` is set (by this or another host's failure). Calls `done` after each
/// shard commits. Returns the shards that committed, and the first error.
pub(crate) async fn run_host(
    plan: &HostPlan,
    url: &DbUrl,
    clients: &[Client],
    inputs: &Inputs<'_>,
    stop: &AtomicBool,
    done: &(dyn Fn(&HostName, LogicalShard) + Sync),
) -> (Done, Option<Error>) {
    // Every run makes the shared catch-up when it is missing (dropped by hand, say), even
    // with no shard to install: each schema's minter calls it.
    let shared = |client| async move {
        bounded(
            client,
            url,
            &plan.host,
            || "making the minter's shared catch-up".into(),
            inputs.shard_timeout,
            shared_minter(client, &plan.host, "the host's shards"),
        )
        .await
    };
    // The roles' privileges on the host's `shardline` schema, once every host's plan
    // passed (a changed file refused on any host grants nothing).
    let host_grants = crate::grants::host_grants(inputs.roles);
    if let Some(client) = clients.first().filter(|_| !host_grants.is_empty()) {
        let granted = bounded(
            client,
            url,
            &plan.host,
            || "granting app_roles the host's shardline schema".into(),
            inputs.shard_timeout,
            async {
                client
                    .batch_execute(&host_grants)
                    .await
                    .map_err(|e| host_err(&plan.host, "grant app_roles the host's shardline schema", &e))
            },
        )
        .await;
        if let Err(e) = granted {
            stop.store(true, Ordering::Relaxed);
            return (Done::default(), Some(e));
        }
    }
    if let Some(client) = clients.first().filter(|_| !plan.shards.is_empty())
        && let Err(e) = shared(client).await
    {
        stop.store(true, Ordering::Relaxed);
        return (Done::default(), Some(e));
    }
    let queue: Mutex<VecDeque<&ShardWork>> = Mutex::new(plan.work.iter().collect());
    let totals = Mutex::new(Done::default());
    let next = || queue.lock().ok().and_then(|mut q| q.pop_front());
    let workers = clients.iter().map(|client| async {
        while !stop.load(Ordering::Relaxed) {
            let Some(w) = next() else { break };
            let applied = bounded(
                client,
                url,
                &plan.host,
                || format!("shard {}'s transaction (whole or not at all)", w.shard),
                inputs.shard_timeout,
                apply_shard(client, &plan.host, w, inputs),
            )
            .await;
            if let Err(e) = applied {
                stop.store(true, Ordering::Relaxed);
                return Some(e);
            }
            if let Ok(mut t) = totals.lock() {
                t.schemas_created += usize::from(w.create_schema);
                t.minters_installed += usize::from(w.minter.is_some());
                t.shards_migrated += usize::from(!w.migrations.is_empty());
                t.migrations_applied += w.migrations.len();
                t.shards_granted += usize::from(w.grants.is_some());
            }
            done(&plan.host, w.shard);
        }
        None
    });
    let errors: Vec<Error> = futures::future::join_all(workers).await.into_iter().flatten().collect();
    let totals = totals.into_inner().unwrap_or_default();
    let mut errors = errors.into_iter();
    let first = errors.next();
    for other in errors {
        tracing::warn!(host = %plan.host, error = %other, "another shard failed too");
    }
    (totals, first)
}
