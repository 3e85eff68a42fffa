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
//! out, and the work run again on the shard's new host), the host timeout, and the
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
//!                 .fetch_one(&mut **conn)
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
//!                 .fetch_optional(&mut **conn)
//!                 .await
//!         })
//!     })
//!     .await?;
//! # let _ = again; Ok(()) }
//! ```
//!
//! For one statement on the hot path, [`Sqlx::statement`] (and `statement_on_id`,
//! `statement_on_user`) runs `work` with no transaction around it: one round trip for a
//! get by ID, as sqlx by hand, with the same routing, retry path and timeout. It sets no
//! `search_path`, so its SQL names the shard's tables qualified ([`ShardConn::table`]).
//!
//! What differs from the repository's typed operations: shardline cannot see inside a
//! sqlx query, so a row returned by it is not checked against its shard (the
//! repository's [`Error::Misrouted`]); the `SET LOCAL search_path` is what routes it.
//! The host timeout bounds each unit of work as a whole (begin to commit), not each
//! statement. A `COMMIT` that cannot be confirmed leaves the outcome unknown, as
//! anywhere.

use ::sqlx::pool::PoolConnection;
use ::sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, PgSslMode, Postgres};
use futures::future::BoxFuture;
use shardline_id::Id;
use shardline_router::config::DbUrl;
use shardline_router::tls::{RootCert, SslMode};
use shardline_router::{HostName, LogicalShard, Route, SchemaName};

use crate::cluster::{Cluster, ClusterOptions, Failed};
use crate::shard::ShardResult;
use crate::{Error, Result};

/// Statements sqlx keeps prepared per connection, at least. sqlx 0.9.0 cannot run a
/// bound query unnamed: with its statement cache off, every such query is prepared
/// under a new name that is never closed, and a pooled connection's server process
/// fills up (sqlx issue 4328). A cache closes what it evicts, so the statements stay
/// bounded.
const MIN_STATEMENT_CACHE: usize = 100;

/// A lazy sqlx pool for `name` at `url` (made on first use of [`Cluster::sqlx`]'s work
/// on the host; a connection opens when one is needed), sized and timed as the
/// repository's pools, TLS as the URL says it (the rules of
/// [`shardline_router::tls`], not sqlx's own).
pub(crate) fn host_pool(name: &HostName, url: &DbUrl, options: &ClusterOptions) -> Result<PgPool> {
    let cache = options.statement_cache.max(MIN_STATEMENT_CACHE);
    let timeout = timeout_ms(options.host_timeout);
    let connect = connect_options(name, url)?.statement_cache_capacity(cache);
    Ok(PgPoolOptions::new()
        .max_connections(u32::try_from(options.pool_size.max(1)).unwrap_or(u32::MAX))
        // A little under the unit of work's own bound, so that a pool with no
        // free connection says so (`Error::Pool`, nothing sent) rather than
        // timing out as work that may have been applied.
        .acquire_timeout(options.host_timeout.mul_f64(0.9))
        .max_lifetime(options.connection_max_lifetime)
        // As the repository's pools: no round trip to test a connection handed
        // out; a broken one fails its statement, classified.
        .test_before_acquire(false)
        // No schema of the session's own: a name a statement leaves unqualified
        // fails rather than reading `public` (see `Sqlx::statement`); a unit of
        // work sets its shard's for its transaction.
        // And the server stops a statement at the host timeout: a statement given
        // up on holds no lock past it, nor applies long after its caller heard it
        // timed out (a transaction sets its own, `SET LOCAL`). Sooner when its
        // connection closes (work given up at its deadline, or dropped by its
        // caller): the server looks for a closed client every
        // `CLIENT_CHECK_MS` while a statement runs or waits on a lock.
        .after_connect(move |conn, _| {
            let setup = format!("SET search_path = ''; SET statement_timeout = {timeout}");
            Box::pin(async move {
                ::sqlx::raw_sql(::sqlx::AssertSqlSafe(setup)).execute(&mut *conn).await?;
                // A server that has no such setting (before PostgreSQL 14), or cannot
                // look for a closed client on its platform, keeps the statement
                // timeout alone.
                let check = format!("SET client_connection_check_interval = {CLIENT_CHECK_MS}");
                match ::sqlx::raw_sql(::sqlx::AssertSqlSafe(check)).execute(&mut *conn).await {
                    Err(::sqlx::Error::Database(e))
                        if matches!(e.code().as_deref(), Some("42704" | "22023")) =>
                    {
                        tracing::debug!(code = ?e.code(), "the server cannot check for a closed client");
                        Ok(())
                    }
                    other => other.map(drop),
                }
            })
        })
        .connect_lazy_with(connect))
}

/// sqlx's options for `host`'s URL. The URL is never part of an error: it may hold a
/// password.
fn connect_options(host: &HostName, url: &DbUrl) -> Result<PgConnectOptions> {
    let bad = |message: String| Error::BadUrl { target: format!("host {host}"), message };
    let tls = url.tls().map_err(bad)?;
    if !(tls.driver_url.starts_with("postgres://") || tls.driver_url.starts_with("postgresql://")) {
        return Err(bad("the sqlx path takes a postgres:// URL, not key=value pairs".into()));
    }
    let connect: PgConnectOptions = tls.driver_url.parse().map_err(|e: ::sqlx::Error| {
        bad(match e {
            ::sqlx::Error::Configuration(source) => source.to_string(),
            _ => "sqlx cannot read it".into(),
        })
    })?;
    // Where and who as the repository's connections: sqlx fills what a URL leaves out
    // from PGHOST, PGPORT, PGUSER, PGDATABASE and PGAPPNAME, the repository's driver
    // from its own defaults (port 5432, the user's name as the database), so the same
    // URL could reach another server or database on the sqlx path.
    let same: tokio_postgres::Config = tls
        .driver_url
        .parse()
        .map_err(|_: tokio_postgres::Error| bad("the repository's driver cannot read it".into()))?;
    // One host: sqlx reads neither a list of hosts nor `target_session_attrs`, so it
    // could not follow the repository's driver to the right one.
    if crate::tls::listed_hosts(&same) > 1 {
        return Err(bad("the sqlx path takes a URL naming one host, not a list".into()));
    }
    // Nor `hostaddr`: sqlx connects to it and checks the certificate against it, where
    // the repository's driver checks it against the host's name.
    if !same.get_hostaddrs().is_empty() {
        return Err(bad("the sqlx path takes no hostaddr: give the address as the host".into()));
    }
    // The host as the repository's driver reads it (an IPv6 literal without its
    // brackets, which sqlx keeps and cannot connect to).
    let connect = match same.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => connect.host(h),
        #[cfg(unix)]
        Some(tokio_postgres::config::Host::Unix(path)) => connect.socket(path),
        None => connect,
    };
    // The user as tokio-postgres decides it: the URL's, else the process's.
    let user = match same.get_user() {
        Some(user) => user.to_owned(),
        None => crate::driver_user()
            .ok_or_else(|| bad("it names no user, and the process's user is unknown".into()))?,
    };
    let connect = connect
        .port(same.get_ports().first().copied().unwrap_or(5432))
        .username(&user)
        .database(same.get_dbname().unwrap_or(&user))
        .application_name(same.get_application_name().unwrap_or("shardline"));
    // The password as the repository's driver reads the URL (the config's, or the
    // credentials'), or none: sqlx would take `PGPASSWORD`, or a `~/.pgpass`
    // (`PGPASSFILE`) entry it looked up with the environment's host, port, user and
    // database, for a URL without one or with an empty one (`u:@h`), so a password
    // meant for another user or server could be sent to this one; and it reads a `+` in
    // `?password=` as a space. An empty one is what sqlx sends when it has none.
    let password = match same.get_password() {
        Some(p) => std::str::from_utf8(p).map_err(|_| bad("its password is not UTF-8".into()))?,
        None => "",
    };
    let connect = connect.password(password);
    // libpq's (and the repository's) meaning of each mode: `require` with a root
    // certificate checks the chain.
    let mode = match tls.mode {
        SslMode::Disable => PgSslMode::Disable,
        SslMode::Prefer => PgSslMode::Prefer,
        SslMode::Require if tls.root_cert.is_some() => PgSslMode::VerifyCa,
        SslMode::Require => PgSslMode::Require,
        SslMode::VerifyCa => PgSslMode::VerifyCa,
        SslMode::VerifyFull => PgSslMode::VerifyFull,
        // A mode added later: the strictest until it is mapped here.
        _ => PgSslMode::VerifyFull,
    };
    // sqlx 0.9.0 adds a `sslrootcert` file to the system's trust store rather than
    // trusting the file alone, as libpq and the repository path do. So a certificate
    // from any public authority would pass a chain check; only the host name check of
    // `verify-full` still refuses one made for another name. The sqlx path takes a
    // root certificate only with `verify-full`.
    if tls.root_cert.is_some() && !matches!(mode, PgSslMode::VerifyFull) {
        return Err(Error::Tls {
            target: format!("host {host}"),
            message: format!(
                "sslmode={} with sslrootcert: the sqlx path (sqlx 0.9.0) trusts the system's certificate \
                 authorities beside the file, so only sslmode=verify-full (which also checks the host name) \
                 is safe there",
                tls.mode
            ),
        });
    }
    Ok(match tls.root_cert {
        Some(RootCert::File(path)) => connect.ssl_mode(mode).ssl_root_cert(path),
        // No file: sqlx checks against the operating system's trust store.
        Some(RootCert::System) | None => connect.ssl_mode(mode),
        Some(_) => return Err(bad("a source of root certificates the sqlx path does not know".into())),
    })
}

/// [`Error::Sqlx`]'s `what` for work whose connection was lost before shardline could
/// tell whether its transaction was still there: the outcome is unknown.
pub(crate) const WORK_CONNECTION_LOST: &str = "work (connection lost)";

/// Whether `e` leaves no server to answer on its connection: no verdict (I/O, a closed
/// connection, a protocol error), or a connection-class or shutdown one.
fn lost(e: &::sqlx::Error) -> bool {
    match e.as_database_error().and_then(|d| d.code()) {
        None => !matches!(e, ::sqlx::Error::Database(_)),
        Some(code) => code.starts_with("08") || code.starts_with("57P"),
    }
}

/// How often (ms) a server looks for its sqlx session's client gone while a statement
/// runs (`client_connection_check_interval`): a statement whose work was given up on,
/// and its connection closed, stops within about this long of the close.
const CLIENT_CHECK_MS: u32 = 100;

/// How near its unit of work's deadline a statement stopped by the server's statement
/// timeout (57014) is taken for the unit timing out.
const DEADLINE_SLACK: std::time::Duration = std::time::Duration::from_millis(50);

/// A server session: its process's ID and when it started (the pair names it; the ID
/// alone may name the next session of that process, as a pooler's is handed on).
#[derive(Debug)]
struct Session {
    pid: i32,
    start: String,
    /// The pool its connection came from (whose address the cancel goes to).
    pool: PgPool,
}

/// Asks `pool`'s host, on a connection of its own and within `within`, to cancel what
/// `session` runs, if it is still that session: a unit of work given up on closes its
/// connection, which a session waiting on a lock does not notice, so its statement
/// would go on holding what it holds until its own statement timeout. In the
/// background; a cancel that cannot be made is logged at debug (no URL, no message).
fn cancel(session: Session, within: std::time::Duration) {
    use ::sqlx::ConnectOptions as _;
    let options = session.pool.connect_options();
    tokio::spawn(async move {
        let sent = tokio::time::timeout(within, async move {
            let mut c = options.connect().await?;
            ::sqlx::query(
                "SELECT pg_cancel_backend(a.pid) FROM pg_stat_get_activity($1) AS a WHERE a.backend_start::text = $2",
            )
            .bind(session.pid)
            .bind(&session.start)
            .execute(&mut c)
            .await?;
            ::sqlx::Connection::close(c).await
        })
        .await;
        if !matches!(sent, Ok(Ok(()))) {
            tracing::debug!(pid = session.pid, "could not cancel a given-up unit of work's statement");
        }
    });
}

/// The error of a unit of work whose closure ended shardline's transaction itself.
fn ended_by_closure(host: &HostName, shard: LogicalShard) -> Error {
    Error::TransactionEnded { host: host.clone(), shard }
}

/// `after` in whole milliseconds, at least 1, for `statement_timeout`; at most the
/// largest it takes (2^31 - 1 ms, about 24.8 days), which a longer `host_timeout` is
/// sent as (Postgres refuses more, and every connection with it).
fn timeout_ms(after: std::time::Duration) -> u128 {
    after.as_millis().clamp(1, i32::MAX as u128)
}

/// How [`Sqlx`] runs a unit of work.
#[derive(Debug, Clone, Copy)]
enum Mode {
    /// In a transaction with the shard's `search_path` ([`Sqlx::transaction`]).
    Transaction,
    /// As it is ([`Sqlx::statement`]).
    Statement,
}

/// A connection of `pool` for work on `route`; `what` names the step a failure is of.
async fn acquire<'env>(pool: &PgPool, route: Route, what: &'static str) -> Result<ShardConn<'env>> {
    let conn = pool.acquire().await.map_err(|e| match e {
        ::sqlx::Error::PoolTimedOut => Error::Pool {
            host: route.host.clone(),
            message: format!("no connection could be had within {:?}", pool.options().get_acquire_timeout()),
            timed_out: true,
        },
        e => Error::sqlx(&route.host, Some(route.shard), what, e),
    })?;
    Ok(ShardConn { conn: Some(conn), route, _env: std::marker::PhantomData })
}

/// Whether `schema` is gone from the host `conn` is on (the shard moved, or is fenced
/// for a move), or is a move's copy there that is not the shard's yet; `false` when that
/// cannot be told. Asked of the schema's [`crate::LIVE_CHECK`] function, which every read
/// of the repository names: on a copy it fails with 3F000 until the copy's move decided
/// to flip (so a copy whose guards a move left for `gc` counts as the shard's, as its
/// guards let writes through), whether or not the copy has tables yet. A shard from
/// before the function (42883, until `shardline migrate`) cannot be told. Each is a
/// statement of its own, outside any transaction: the connection stays as it was.
async fn schema_gone(conn: &mut PgConnection, schema: &SchemaName) -> bool {
    let present: std::result::Result<(bool,), _> = ::sqlx::query_as("SELECT to_regnamespace($1) IS NOT NULL")
        .bind(schema.as_str())
        .fetch_one(&mut *conn)
        .await;
    match present {
        Ok((false,)) => true,
        Err(_) => false,
        Ok((true,)) => {
            let probe = ::sqlx::AssertSqlSafe(format!("SELECT {}.{}()", schema.quoted(), crate::LIVE_CHECK));
            match ::sqlx::raw_sql(probe).execute(&mut *conn).await {
                Ok(_) => false,
                Err(e) => {
                    let code = e.as_database_error().and_then(|d| d.code().map(|c| c.into_owned()));
                    crate::shard::begin_finds_schema_gone(code.as_deref())
                }
            }
        }
    }
}

/// The sqlx path's refusal behind a transaction-mode pooler (declared, or found out:
/// [`Cluster::behind_pooler`]).
pub(crate) fn refused(host: &HostName) -> Error {
    Error::Pooler {
        host: host.clone(),
        reason: "the sqlx path cannot run behind a transaction-mode pooler: sqlx 0.9.0 keeps named \
                 prepared statements on each connection, which such a pooler hands to other clients; \
                 use the repository API, or reach the hosts directly or through a session pool (say \
                 transaction_pooler = false for a session pool)"
            .into(),
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

/// The connection a unit of work of [`Sqlx`] runs on: inside its transaction in one
/// shard, with the shard's schema as `search_path` ([`Sqlx::transaction`]), or on the
/// shard's host with neither ([`Sqlx::statement`]: name tables with
/// [`ShardConn::table`]). Hand it to sqlx as `&mut **conn`
/// (it dereferences to a `PgConnection`), as with sqlx's own
/// `Connection::transaction`.
///
/// `'env` is the life of the call: the closure's future may borrow anything that
/// outlives it. Dropped unfinished (a timeout, a cancelled caller, a failed
/// `ROLLBACK`), its connection is closed rather than returned to the pool, so the
/// server rolls the transaction back and no pooled connection is left inside one.
///
/// The transaction is shardline's, not one sqlx counts: a `begin()` inside the closure
/// starts no savepoint, and its `commit()` or `rollback()` would end shardline's
/// transaction. That is caught before `COMMIT`, whether the closure then returns `Ok` or
/// `Err` (the call fails with [`Error::TransactionEnded`], outcome unknown); use
/// `SAVEPOINT` in SQL for a part that may fail.
pub struct ShardConn<'env> {
    conn: Option<PoolConnection<Postgres>>,
    route: Route,
    _env: std::marker::PhantomData<&'env ()>,
}

impl std::fmt::Debug for ShardConn<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardConn").field("route", &self.route).finish_non_exhaustive()
    }
}

impl Drop for ShardConn<'_> {
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            conn.close_on_drop();
        }
    }
}

impl ShardConn<'_> {
    /// The transaction ended cleanly: the connection goes back to the pool.
    fn release(mut self) {
        drop(self.conn.take());
    }

    fn conn(&mut self) -> &mut PgConnection {
        // Only `release` (which consumes the value) takes the connection out.
        self.conn
            .as_deref_mut()
            .unwrap_or_else(|| unreachable!("a ShardConn holds its connection until released"))
    }
}

impl ShardConn<'_> {
    /// The shard the transaction is in.
    pub fn shard(&self) -> LogicalShard {
        self.route.shard
    }

    /// The shard's schema (a transaction's `search_path`; a statement names it).
    pub fn schema(&self) -> &SchemaName {
        &self.route.schema
    }

    /// The host the transaction runs on.
    pub fn host(&self) -> &HostName {
        &self.route.host
    }

    /// `table` of the shard's schema, quoted for SQL (`"shard_0005"."photos"`): the name
    /// to write in a [`Sqlx::statement`], which sets no `search_path`.
    pub fn table(&self, table: &str) -> String {
        format!("{}.{}", self.route.schema.quoted(), shardline_id::ident::quote(table))
    }

    /// The shard schema's live check, for a read in a [`Sqlx::statement`]
    /// (`"shard_0005".shardline_live()`): add `AND` it to the read's `WHERE`. A
    /// statement runs no `BEGIN` of shardline's, so nothing else checks that the schema
    /// it reaches is the shard's: through a handle a move behind, a read without it may
    /// reach a move's copy still being filled and answer from part of its rows; with it,
    /// such a read fails as a moved shard's and runs again where the shard is (see
    /// [`crate::LIVE_CHECK`]). [`Sqlx::transaction`] checks in its `BEGIN`.
    pub fn live(&self) -> String {
        format!("{}.{}()", self.route.schema.quoted(), crate::LIVE_CHECK)
    }
}

impl std::ops::Deref for ShardConn<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.conn
            .as_deref()
            .unwrap_or_else(|| unreachable!("a ShardConn holds its connection until released"))
    }
}

impl std::ops::DerefMut for ShardConn<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn()
    }
}

impl AsMut<PgConnection> for ShardConn<'_> {
    fn as_mut(&mut self) -> &mut PgConnection {
        self.conn()
    }
}

impl Sqlx {
    /// The cluster this runs on.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// A sqlx pool of `host` (made on first use), for work that is not routed: it
    /// bypasses routing, timeouts and the move retry. Its sessions start with an empty
    /// `search_path` (qualify table names) and `statement_timeout` at
    /// [`ClusterOptions::host_timeout`] (`SET` it for longer work). It is not the pool
    /// routed work runs on (as large, made only when asked for): what work leaves on
    /// its sessions never reaches a routed unit of work.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownHost`]; [`Error::BadUrl`] when a host's URL cannot be used by
    /// sqlx (a `key=value` connection string: the sqlx path takes `postgres://` URLs);
    /// [`Error::Pooler`] behind a transaction-mode pooler (`transaction_pooler`), as
    /// for routed work.
    pub async fn pool(&self, host: &HostName) -> Result<PgPool> {
        self.cluster.sqlx_pool(host, false).await
    }

    /// How many connections to `host` sit idle in the pool routed work runs on (0 before
    /// its first use, or for a host the handle does not know): for diagnostics and
    /// metrics.
    pub fn idle_connections(&self, host: &HostName) -> usize {
        self.cluster.sqlx_pool_made(host).map_or(0, |p| p.num_idle())
    }

    /// Runs `work` in one transaction in `shard`, on the shard's host, with the
    /// shard's schema as the transaction's `search_path`: committed when it returns
    /// `Ok`, rolled back when it returns `Err`.
    ///
    /// When a statement finds the shard's schema gone (the shard moved, or is fenced
    /// for a move), the transaction is rolled back, the move waited out, and `work` run
    /// again from the start on the shard's new host (at most three runs in all): keep
    /// its effects inside the transaction.
    ///
    /// # Errors
    ///
    /// [`Error::Sqlx`] naming the host, the shard, the step and the SQLSTATE (only a
    /// `commit` step's, or `work (connection lost)`, may leave the outcome unknown:
    /// every other failure rolled the work back); [`Error::Timeout`] when the whole unit of work took longer than
    /// [`ClusterOptions::host_timeout`]; [`Error::Pool`] when no connection could be had
    /// in time; [`Error::RolledBack`] when `work` returned `Ok` but a statement in it had
    /// failed (its error handled), so Postgres rolled the transaction back;
    /// [`Error::Pooler`] behind a transaction-mode pooler (sqlx 0.9.0 keeps named
    /// prepared statements, which such a pooler mixes up between clients).
    pub async fn transaction<'env, T, F>(&'env self, shard: LogicalShard, work: F) -> Result<T>
    where
        F: for<'t> FnMut(&'t mut ShardConn<'env>) -> BoxFuture<'t, std::result::Result<T, ::sqlx::Error>>,
    {
        self.routed(shard, work, Mode::Transaction).await
    }

    /// Runs `work` on `shard`'s host as it is, with no transaction around it and no
    /// `search_path` set: the fast path for one statement (a get by ID costs one round
    /// trip, as sqlx on the host by hand). Name the shard's tables qualified, with
    /// [`ShardConn::table`]: the pools' sessions start with an empty `search_path`, so
    /// an unqualified name fails (SQLSTATE 42P01) rather than reading another schema.
    ///
    /// Each statement commits on its own. When one finds the shard's schema gone (the
    /// shard moved, or is fenced for a move), the move is waited out and `work` run
    /// again on the shard's new host (at most three runs in all): a statement that found
    /// its schema gone did nothing, but any statement before it in `work` stays done, so
    /// put one statement in it, or statements that may run more than once. For several statements that must
    /// apply together, use [`Sqlx::transaction`]. Do not start a transaction in `work`
    /// with a `BEGIN` of your own: a connection sqlx does not know to be in one goes
    /// back to the pool as it is (sqlx's `begin()` is rolled back when dropped).
    ///
    /// # Errors
    ///
    /// As [`Sqlx::transaction`]; the step is `statement`, and one that got no verdict
    /// from the server (a lost connection) may have been applied
    /// ([`Error::outcome_unknown`]).
    pub async fn statement<'env, T, F>(&'env self, shard: LogicalShard, work: F) -> Result<T>
    where
        F: for<'t> FnMut(&'t mut ShardConn<'env>) -> BoxFuture<'t, std::result::Result<T, ::sqlx::Error>>,
    {
        self.routed(shard, work, Mode::Statement).await
    }

    /// [`Sqlx::statement`] in the shard that minted `id` (decoded from the ID, no
    /// query).
    ///
    /// # Errors
    ///
    /// [`Error::Router`] for an ID of a shard the cluster does not have; then as
    /// [`Sqlx::statement`].
    pub async fn statement_on_id<'env, T, F>(&'env self, id: Id, work: F) -> Result<T>
    where
        F: for<'t> FnMut(&'t mut ShardConn<'env>) -> BoxFuture<'t, std::result::Result<T, ::sqlx::Error>>,
    {
        self.statement(self.cluster.route_id(id)?.shard, work).await
    }

    /// [`Sqlx::statement`] in the shard of user `user_id`.
    ///
    /// # Errors
    ///
    /// As [`Sqlx::statement`].
    pub async fn statement_on_user<'env, T, F>(&'env self, user_id: i64, work: F) -> Result<T>
    where
        F: for<'t> FnMut(&'t mut ShardConn<'env>) -> BoxFuture<'t, std::result::Result<T, ::sqlx::Error>>,
    {
        self.statement(self.cluster.route_user(user_id).shard, work).await
    }

    /// [`Sqlx::transaction`] or [`Sqlx::statement`]: routed, through the one retry path,
    /// within the host timeout.
    async fn routed<'env, T, F>(&'env self, shard: LogicalShard, work: F, mode: Mode) -> Result<T>
    where
        F: for<'t> FnMut(&'t mut ShardConn<'env>) -> BoxFuture<'t, std::result::Result<T, ::sqlx::Error>>,
    {
        let options = self.cluster.options();
        self.cluster.route(shard)?;
        let timeout = options.host_timeout;
        // Each run borrows `work` in turn; the lock is never contended.
        let work = &tokio::sync::Mutex::new(work);
        self.cluster
            .with_move_retry(|map, _| async move {
                let route = map.route(shard, self.cluster.prefix());
                let host = route.host.clone();
                // Refused behind a transaction pooler (found out once per host pool,
                // within the unit's time).
                // The unit's time counts from here, the pooler's check included.
                let deadline = tokio::time::Instant::now() + timeout;
                let pool = match tokio::time::timeout_at(deadline, self.cluster.sqlx_pool(&host, true)).await
                {
                    Ok(pool) => pool.map_err(|e| Failed::of(e, [shard]))?,
                    Err(_) => {
                        return Err(Failed::of(
                            Error::Pool {
                                host: host.clone(),
                                message: format!("no connection could be had within {timeout:?}"),
                                timed_out: true,
                            },
                            [shard],
                        ));
                    }
                };
                let mut work = work.lock().await;
                let mut moved = false;
                let session = std::sync::Mutex::new(None);
                let run = async {
                    let done = match mode {
                        Mode::Transaction => {
                            self.attempt(&pool, route, &mut *work, &mut moved, deadline, &session).await
                        }
                        Mode::Statement => self.once(&pool, route, &mut *work, &mut moved).await,
                    };
                    // Ended, not given up: its connection is back in the pool, or closed.
                    if let Ok(mut s) = session.lock() {
                        *s = None;
                    }
                    done
                };
                let done = tokio::time::timeout_at(deadline, run)
                    .await
                    .unwrap_or_else(|_| Err(Error::Timeout { host: host.clone(), after: timeout }));
                // Given up at its deadline (the run dropped, its connection closed): its
                // session may still be waiting on a lock.
                if let Some(s) = session.lock().ok().and_then(|mut s| s.take()) {
                    cancel(s, timeout);
                }
                done.map_err(|e| Failed::new(e, moved, [shard]))
            })
            .await
    }

    /// One run of [`Sqlx::transaction`] on `route`, given up at `deadline`; sets `moved`
    /// when the shard's schema is gone from its host, and `session` to its session (the
    /// server process's ID and start) once it has begun, for a cancel when it is given
    /// up.
    async fn attempt<'env, T, F>(
        &'env self,
        pool: &PgPool,
        route: Route,
        work: &mut F,
        moved: &mut bool,
        deadline: tokio::time::Instant,
        session: &std::sync::Mutex<Option<Session>>,
    ) -> Result<T>
    where
        F: for<'t> FnMut(&'t mut ShardConn<'env>) -> BoxFuture<'t, std::result::Result<T, ::sqlx::Error>>,
    {
        let (host, shard, schema) = (route.host.clone(), route.shard, route.schema.clone());
        let fail = |what: &'static str| {
            let host = host.clone();
            move |e: ::sqlx::Error| Error::sqlx(&host, Some(shard), what, e)
        };
        let (mut conn, pool) = self.acquire_current(pool, route, "begin").await?;
        // One round trip: the transaction and its search_path (the schema quoted by the
        // one quoting function, `SchemaName::quoted`).
        // The server stops a statement at the unit of work's deadline too (what is left
        // of the host timeout once a connection was had): a unit given up on here holds
        // no lock past it (the close reaches a server only between statements).
        let begin = format!(
            "BEGIN; {}; SET LOCAL statement_timeout = {}",
            crate::shard::enter_schema(&schema, true),
            timeout_ms(deadline.saturating_duration_since(tokio::time::Instant::now()))
        );
        match ::sqlx::raw_sql(::sqlx::AssertSqlSafe(begin)).fetch_one(conn.conn()).await {
            Ok(row) => {
                use ::sqlx::Row as _;
                if let (Ok(pid), Ok(start), Ok(mut s)) =
                    (row.try_get::<i32, _>(1), row.try_get::<String, _>(2), session.lock())
                {
                    *s = Some(Session { pid, start, pool });
                }
            }
            Err(e) => {
                let e = fail("begin")(e);
                // The shard's schema is gone from here: it moved, or is fenced for a move.
                *moved = crate::shard::begin_finds_schema_gone(e.sqlstate());
                // Rolled back on the same connection, which then goes back to the pool.
                if ::sqlx::raw_sql("ROLLBACK").execute(conn.conn()).await.is_ok() {
                    conn.release();
                }
                return Err(e);
            }
        }
        let error = match work(&mut conn).await {
            // A statement that failed inside the transaction aborted it, even when `work`
            // handled its error: Postgres would answer COMMIT with a rollback. So a
            // SAVEPOINT goes first, in the same round trip: it fails in an aborted
            // transaction (25P02), and outside any (25P01, the closure ended the
            // transaction itself), and then COMMIT is not run.
            Ok(value) => {
                match ::sqlx::raw_sql(::sqlx::AssertSqlSafe(format!(
                    "SAVEPOINT {}; COMMIT",
                    crate::shard::PROBE
                )))
                .execute(conn.conn())
                .await
                {
                    Ok(_) => {
                        conn.release();
                        return Ok(value);
                    }
                    Err(e) => {
                        let e = Error::sqlx(&host, Some(shard), "commit", e);
                        match e.sqlstate() {
                            Some("25P02") => Error::RolledBack { host: host.clone(), shard },
                            Some("25P01") => {
                                conn.release();
                                return Err(ended_by_closure(&host, shard));
                            }
                            _ => return Err(e),
                        }
                    }
                }
            }
            Err(e) => {
                // Is shardline's transaction still there? A closure that ended it (sqlx's
                // begin() and commit(), a raw COMMIT) may have committed writes, and its
                // next unqualified statement failed for want of the search_path: that is
                // never a move, and never run again.
                match ::sqlx::raw_sql(::sqlx::AssertSqlSafe(format!("SAVEPOINT {}", crate::shard::PROBE)))
                    .execute(conn.conn())
                    .await
                {
                    Err(check)
                        if check.as_database_error().and_then(|d| d.code()).as_deref() == Some("25P01") =>
                    {
                        conn.release();
                        return Err(ended_by_closure(&host, shard));
                    }
                    // No verdict: the connection is gone (or going), and with it any way
                    // to tell whether the closure had committed by itself before it
                    // failed. Its outcome is unknown.
                    Err(check) if lost(&check) => {
                        return Err(Error::sqlx(&host, Some(shard), WORK_CONNECTION_LOST, e));
                    }
                    // The server's statement timeout, set to the unit's deadline, met it
                    // a moment before the unit's own timer: the same failure, told alike.
                    _ if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("57014")
                        && tokio::time::Instant::now() + DEADLINE_SLACK >= deadline =>
                    {
                        Error::Timeout { host: host.clone(), after: self.cluster.options().host_timeout }
                    }
                    _ => Error::sqlx(&host, Some(shard), "work", e),
                }
            }
        };
        // Rolled back here; when that fails, the connection is closed (the drop), which
        // rolls back as well.
        let rolled_back = ::sqlx::raw_sql("ROLLBACK").execute(conn.conn()).await.is_ok();
        // A handled failure, or one that says a table is missing: is it because the
        // shard's schema is gone from here (fenced or moved)? Then it runs again where
        // the shard is. A table missing from a schema that is there is the caller's.
        // Asked on the same connection (a full pool cannot delay the answer).
        if rolled_back && (matches!(error, Error::RolledBack { .. }) || error.is_moved()) {
            *moved = schema_gone(conn.conn(), &schema).await;
        }
        if rolled_back {
            conn.release();
        }
        Err(error)
    }

    /// A connection of `route`'s host from `pool`, and the pool it came from: when the
    /// host was readdressed while it was waited for (the host's pool is another now),
    /// it is put back and one taken from the host's new pool, so the work never runs at
    /// the old address once the handle took the new one.
    async fn acquire_current<'env>(
        &'env self,
        pool: &PgPool,
        route: Route,
        what: &'static str,
    ) -> Result<(ShardConn<'env>, PgPool)> {
        let mut pool = pool.clone();
        loop {
            let got = acquire(&pool, route.clone(), what).await;
            // The host's pool now is another (or not made yet for its new address).
            let replaced = self
                .cluster
                .sqlx_pool_made(&route.host)
                .is_none_or(|now| !std::sync::Arc::ptr_eq(&now.connect_options(), &pool.connect_options()));
            // A failure of a pool replaced meanwhile (its old address gone) is the old
            // address's: the new pool is tried. Not after the pool's own wait ran out:
            // little of the unit's time is left, and "nothing was sent" is the answer.
            let conn = match got {
                Err(Error::Pool { timed_out: true, .. }) => return got.map(|c| (c, pool)),
                Err(_) if replaced => {
                    pool = self.cluster.sqlx_pool(&route.host, true).await?;
                    continue;
                }
                got => got?,
            };
            match self.cluster.sqlx_pool_made(&route.host) {
                Some(now) if std::sync::Arc::ptr_eq(&now.connect_options(), &pool.connect_options()) => {
                    return Ok((conn, pool));
                }
                _ => {
                    conn.release();
                    tracing::debug!(host = %route.host, "the host's pool changed while a connection was waited for; taking one from the new pool");
                    pool = self.cluster.sqlx_pool(&route.host, true).await?;
                }
            }
        }
    }

    /// One run of [`Sqlx::statement`] on `route`; sets `moved` when the shard's schema
    /// is gone from its host.
    async fn once<'env, T, F>(
        &'env self,
        pool: &PgPool,
        route: Route,
        work: &mut F,
        moved: &mut bool,
    ) -> Result<T>
    where
        F: for<'t> FnMut(&'t mut ShardConn<'env>) -> BoxFuture<'t, std::result::Result<T, ::sqlx::Error>>,
    {
        let (host, shard, schema) = (route.host.clone(), route.shard, route.schema.clone());
        let (mut conn, _) = self.acquire_current(pool, route, "connect").await?;
        let done = work(&mut conn).await;
        // A transaction sqlx knows of still open (a `begin()` not ended): the connection
        // is closed, which rolls it back, rather than pooled inside it.
        let open = ::sqlx::Connection::is_in_transaction(conn.conn());
        match done {
            Ok(value) if !open => {
                conn.release();
                Ok(value)
            }
            // Only a transaction the closure kept from ending (`mem::forget`): one it
            // dropped has queued its own ROLLBACK.
            Ok(_) => Err(Error::Invalid {
                what: format!(
                    "host {host}, shard {shard}: a statement's work left a transaction open; it was rolled back"
                ),
            }),
            Err(e) => {
                // The connection is sound when the server answered, or when the error is
                // the client's reading of a whole answer (no row, a column it could not
                // decode): sqlx reads what is left of the answer on next use. Not when
                // the statement ran in a transaction left aborted (a `BEGIN` of the
                // closure's own: 25P02), nor when the connection broke.
                let sound = match &e {
                    ::sqlx::Error::Database(d) => d.code().as_deref() != Some("25P02"),
                    ::sqlx::Error::RowNotFound
                    | ::sqlx::Error::ColumnNotFound(_)
                    | ::sqlx::Error::ColumnIndexOutOfBounds { .. }
                    | ::sqlx::Error::ColumnDecode { .. }
                    | ::sqlx::Error::TypeNotFound { .. } => true,
                    _ => false,
                };
                let error = Error::sqlx(&host, Some(shard), "statement", e);
                // A statement that says a table or its schema is missing is asked about
                // on the same connection: gone from here, the shard moved (or is
                // fenced), and the work runs again where it is.
                let clean = sound && !open;
                if clean && error.is_moved() {
                    *moved = schema_gone(conn.conn(), &schema).await;
                }
                if clean {
                    conn.release();
                }
                Err(error)
            }
        }
    }

    /// [`Sqlx::transaction`] in the shard of user `user_id`.
    ///
    /// # Errors
    ///
    /// As [`Sqlx::transaction`].
    pub async fn on_user<'env, T, F>(&'env self, user_id: i64, work: F) -> Result<T>
    where
        F: for<'t> FnMut(&'t mut ShardConn<'env>) -> BoxFuture<'t, std::result::Result<T, ::sqlx::Error>>,
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
    pub async fn on_id<'env, T, F>(&'env self, id: Id, work: F) -> Result<T>
    where
        F: for<'t> FnMut(&'t mut ShardConn<'env>) -> BoxFuture<'t, std::result::Result<T, ::sqlx::Error>>,
    {
        self.transaction(self.cluster.route_id(id)?.shard, work).await
    }

    /// Runs `work` on every shard, each in its own [`Sqlx::transaction`], several at a
    /// time (interleaved over the hosts, as [`Cluster::for_each_shard`]). Returns one
    /// result per shard, in shard order: a shard that fails does not stop the others,
    /// and none is left out. [`ShardConn::shard`] says which shard a run is in.
    pub async fn for_each_shard<'env, T, F>(&'env self, work: F) -> Vec<ShardResult<T, Error>>
    where
        F: for<'t> Fn(&'t mut ShardConn<'env>) -> BoxFuture<'t, std::result::Result<T, ::sqlx::Error>>,
    {
        let work = &work;
        self.cluster.on_every_shard(|shard| self.transaction(shard, work)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_alone_says_where_and_who() -> Result<()> {
        let o = options("postgres://app@db")?;
        assert_eq!((o.get_host(), o.get_port(), o.get_username()), ("db", 5432, "app"));
        assert_eq!((o.get_database(), o.get_application_name()), (Some("app"), Some("shardline")));
        let o = options("postgres://db")?;
        let me = whoami::username().unwrap_or_default();
        assert_eq!((o.get_username(), o.get_database()), (me.as_str(), Some(me.as_str())));
        let err = options("postgres://app@pg1a,pg1b/app").map(drop).unwrap_err().to_string();
        assert!(err.contains("one host"), "{err}");
        let err = options("postgres://app@db/app?hostaddr=10.0.0.5").map(drop).unwrap_err().to_string();
        assert!(err.contains("hostaddr"), "{err}");
        assert_eq!(options("postgres://app@[::1]:5433/app")?.get_host(), "::1");
        let o = options("postgres://app@db:6543/other?application_name=mine")?;
        assert_eq!(
            (o.get_port(), o.get_database(), o.get_application_name()),
            (6543, Some("other"), Some("mine"))
        );
        Ok(())
    }

    /// The test above, run again in a process whose environment names another port,
    /// database, user and application, as sqlx reads them: the URL still decides (before,
    /// the environment's port and database were taken).
    #[test]
    fn the_environment_does_not_say_where_or_who() {
        crate::rerun_with_env(
            "sqlx::tests::the_url_alone_says_where_and_who",
            &[
                ("PGPORT", "1"),
                ("PGDATABASE", "elsewhere"),
                ("PGAPPNAME", "someone"),
                ("PGHOST", "elsewhere"),
                ("PGUSER", "someone"),
            ],
        );
    }

    /// Whether sqlx's options hold `password` (they show it in their `Debug` only).
    fn holds_password(o: &PgConnectOptions, password: &str) -> bool {
        format!("{o:?}").contains(&format!("password: Some({password:?})"))
    }

    #[test]
    fn the_url_alone_gives_the_password() -> Result<()> {
        for (url, password) in [
            ("postgres://app:secret@db/app", "secret"),
            ("postgres://app:s%40cret@db/app", "s@cret"),
            ("postgres://app@db/app?password=a+b", "a+b"),
            ("postgres://app@db/app", ""),
            ("postgres://app:@db/app", ""),
        ] {
            // Not the options themselves: they would show a password the environment gave.
            assert!(holds_password(&options(url)?, password), "{url}: not {password:?}");
        }
        Ok(())
    }

    /// The test above, run again in a process whose environment gives a password, and a
    /// password file with one for every server, user and database, as sqlx reads them:
    /// neither is taken (before, both were, for a URL without a password).
    #[test]
    fn the_environment_gives_no_password() {
        /// Removes the directory however the test ends.
        struct Gone(std::path::PathBuf);
        impl Drop for Gone {
            fn drop(&mut self) {
                std::fs::remove_dir_all(&self.0).ok();
            }
        }
        let dir = std::env::temp_dir().join(format!("shardline-pgpass-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let dir = Gone(dir);
        let file = dir.0.join("pgpass");
        std::fs::write(&file, "*:*:*:*:from-the-file\n").unwrap_or_else(|e| panic!("{e}"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))
                .unwrap_or_else(|e| panic!("{e}"));
        }
        let path = file.to_string_lossy().into_owned();
        crate::rerun_with_env("sqlx::tests::the_url_alone_gives_the_password", &[("PGPASSFILE", &path)]);
        crate::rerun_with_env(
            "sqlx::tests::the_url_alone_gives_the_password",
            &[("PGPASSWORD", "from-the-environment"), ("PGPASSFILE", &path)],
        );
    }

    #[test]
    fn a_statement_timeout_is_one_postgres_takes() {
        use std::time::Duration;
        assert_eq!(timeout_ms(Duration::ZERO), 1);
        assert_eq!(timeout_ms(Duration::from_micros(10)), 1);
        assert_eq!(timeout_ms(Duration::from_secs(5)), 5000);
        assert_eq!(timeout_ms(Duration::from_secs(30 * 24 * 3600)), 2_147_483_647);
        assert_eq!(timeout_ms(Duration::MAX), 2_147_483_647);
    }

    fn options(url: &str) -> Result<PgConnectOptions> {
        let host = HostName::new("pg1").map_err(Error::Router)?;
        connect_options(&host, &DbUrl::new(url.to_owned()))
    }

    #[test]
    fn a_root_certificate_is_taken_only_with_verify_full() {
        for url in [
            "postgres://app:secret@db/app?sslmode=require&sslrootcert=/ca.pem",
            "postgres://app:secret@db/app?sslmode=verify-ca&sslrootcert=/ca.pem",
        ] {
            let err = options(url).map(drop).unwrap_err();
            let text = err.to_string();
            assert!(matches!(err, Error::Tls { .. }) && text.contains("verify-full"), "{url}: {text}");
            assert!(!text.contains("secret"), "{text}");
        }
        assert!(options("postgres://app:secret@db/app?sslmode=verify-full&sslrootcert=/ca.pem").is_ok());
        assert!(options("postgres://app:secret@db/app?sslmode=require").is_ok());
    }

    #[test]
    fn a_key_value_string_is_refused_without_its_text() {
        let err = options("host=db user=app password=secret").map(drop).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::BadUrl { .. }) && text.contains("postgres://"), "{text}");
        assert!(!text.contains("secret"), "{text}");
    }

    #[test]
    fn a_statement_or_commit_without_a_verdict_may_have_applied_work_may_not() {
        let host = HostName::new("pg1").unwrap_or_else(|e| panic!("{e}"));
        let lost = || ::sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        for (what, unknown) in [
            ("statement", true),
            ("commit", true),
            (WORK_CONNECTION_LOST, true),
            ("work", false),
            ("begin", false),
            ("connect", false),
        ] {
            let e = Error::sqlx(&host, None, what, lost());
            assert_eq!(e.outcome_unknown(), unknown, "{what}");
        }
    }

    #[test]
    fn a_table_is_named_in_its_shard_quoted() {
        let prefix = shardline_router::SchemaPrefix::default();
        let count = shardline_router::ShardCount::new(16).unwrap_or_else(|e| panic!("{e}"));
        let shard = LogicalShard::new(5, count).unwrap_or_else(|e| panic!("{e}"));
        let host = HostName::new("pg1").unwrap_or_else(|e| panic!("{e}"));
        let route = Route { shard, host, schema: prefix.schema(shard) };
        let conn: ShardConn<'_> = ShardConn { conn: None, route, _env: std::marker::PhantomData };
        assert_eq!(conn.table("photos"), "\"shard_0005\".\"photos\"");
        assert_eq!(conn.table("a\"b"), "\"shard_0005\".\"a\"\"b\"");
    }
}
