//! The catalog: a `shardline` schema in a small database of its own (or any database
//! the config names), holding the cluster's fixed parameters, the hosts, the shard map
//! with its version, and a per-shard record of migrations. The journal of moves
//! (`shardline.moves`) lives in the same schema but is not this module's: its DDL and
//! every write on it belong to `shardline_ops::moves::journal`; repo only reads it
//! through `Catalog::moves_of` (see docs/architecture.md, "Who owns what").
//!
//! Every change to the map (a shard placed, moved or removed; a host added, readdressed,
//! drained or removed) bumps
//! `shardline.cluster.map_version` and sends `NOTIFY shardline_map, '<version>'`, by
//! trigger, so even a change made by hand in `psql` reaches the routers.

use std::time::Duration;

use shardline_id::Layout;
use shardline_router::config::DbUrl;
use shardline_router::{Config, HostName, LogicalShard, SchemaPrefix, ShardCount, ShardMap};
use tokio_postgres::Client;

use crate::{Error, Result};

/// The channel map changes are announced on; the payload is the new version.
pub const MAP_CHANNEL: &str = "shardline_map";

/// How long a connection attempt waits when the URL sets no `connect_timeout`.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The catalog's own format; a catalog of another format is refused.
pub const FORMAT: i32 = 1;

/// The key of the session advisory lock that `init`, `migrate` and moves hold on the
/// catalog, so that two of them never work on one cluster at once ("shardlin").
pub const LOCK_KEY: i64 = 0x7368_6172_646c_696e;

/// The key of the advisory lock `gc` holds for its whole run ([`Catalog::lock_for_gc`]),
/// and that journaling a move's start takes shared for that one statement ("shardlgc"):
/// a move is journaled either before `gc` reads the journal or after `gc` has ended,
/// so `gc` never takes a move that began under it for one that is over.
pub const GC_LOCK_KEY: i64 = 0x7368_6172_646c_6763;

/// The tables this module owns (parameters, hosts, map, migrations) and the map's
/// trigger, created if missing. Idempotent. The journal of moves is created by its
/// owner, `shardline_ops::moves::journal`, right after (`init`).
pub const SCHEMA_SQL: &str = r#"
CREATE SCHEMA IF NOT EXISTS shardline;

CREATE TABLE IF NOT EXISTS shardline.cluster (
    singleton      boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    format         integer NOT NULL,
    logical_shards integer NOT NULL CHECK (logical_shards BETWEEN 1 AND 8192),
    schema_prefix  text    NOT NULL,
    epoch_ms       bigint  NOT NULL,
    map_version    bigint  NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE shardline.cluster IS 'shardline: the parameters fixed for the life of the cluster, and the shard map version';

CREATE TABLE IF NOT EXISTS shardline.hosts (
    name     text PRIMARY KEY,
    position integer NOT NULL UNIQUE,
    added_at timestamptz NOT NULL DEFAULT now()
);
-- Where each host lives, never with a password (credentials come by reference: see
-- shardline_repo::credentials). NULL: only the config knows (a catalog made before).
ALTER TABLE shardline.hosts ADD COLUMN IF NOT EXISTS address text;
ALTER TABLE shardline.hosts ADD COLUMN IF NOT EXISTS peer_address text;
ALTER TABLE shardline.hosts ADD COLUMN IF NOT EXISTS state text NOT NULL DEFAULT 'active'
    CHECK (state IN ('active', 'draining', 'removed'));
COMMENT ON TABLE shardline.hosts IS 'shardline: the physical hosts and their addresses (no password: credentials come by reference)';

CREATE TABLE IF NOT EXISTS shardline.shards (
    shard      integer PRIMARY KEY CHECK (shard >= 0),
    host       text NOT NULL REFERENCES shardline.hosts (name),
    ready      boolean NOT NULL DEFAULT false,
    migration  text,
    updated_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE shardline.shards IS 'shardline: the shard map, and each shard''s state as last seen on its host (its ledger there is the truth)';

CREATE TABLE IF NOT EXISTS shardline.migrations (
    name       text PRIMARY KEY,
    checksum   text NOT NULL,
    first_seen timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE shardline.migrations IS 'shardline: every migration file ever applied, with its checksum';

CREATE OR REPLACE FUNCTION shardline.map_changed() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    v bigint;
BEGIN
    IF TG_LEVEL = 'STATEMENT' AND TG_OP = 'INSERT' THEN
        PERFORM FROM new_rows LIMIT 1;
        IF NOT FOUND THEN RETURN NULL; END IF;
    ELSIF TG_LEVEL = 'STATEMENT' AND TG_OP = 'DELETE' THEN
        PERFORM FROM old_rows LIMIT 1;
        IF NOT FOUND THEN RETURN NULL; END IF;
    END IF;
    -- One version per transaction, however many changes it makes (init adds hosts and
    -- places shards: one new map). The mark is the transaction's own setting.
    IF current_setting('shardline.map_bumped', true) IS NOT DISTINCT FROM 'yes' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('shardline.map_bumped', 'yes', true);
    UPDATE shardline.cluster SET map_version = map_version + 1 RETURNING map_version INTO v;
    PERFORM pg_notify('shardline_map', v::text);
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE TRIGGER map_changed_insert AFTER INSERT ON shardline.shards
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION shardline.map_changed();
CREATE OR REPLACE TRIGGER map_changed_delete AFTER DELETE ON shardline.shards
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION shardline.map_changed();
CREATE OR REPLACE TRIGGER map_changed_update AFTER UPDATE OF host ON shardline.shards
    FOR EACH ROW WHEN (OLD.host IS DISTINCT FROM NEW.host) EXECUTE FUNCTION shardline.map_changed();
-- No shard is placed on a removed host. FOR SHARE waits for a removal in flight (which
-- locks the host's row first, then counts its shards): one of the two fails.
CREATE OR REPLACE FUNCTION shardline.shard_host_live() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    s text;
BEGIN
    SELECT h.state INTO s FROM shardline.hosts h WHERE h.name = NEW.host FOR SHARE;
    IF s = 'removed' THEN
        RAISE EXCEPTION 'host % was removed: no shard may be placed on it', NEW.host
            USING ERRCODE = '23514';
    END IF;
    RETURN NEW;
END
$fn$;
CREATE OR REPLACE TRIGGER shard_host_live BEFORE INSERT OR UPDATE OF host ON shardline.shards
    FOR EACH ROW EXECUTE FUNCTION shardline.shard_host_live();
-- A host added, readdressed, drained or removed changes where the routers connect.
CREATE OR REPLACE TRIGGER hosts_changed_insert AFTER INSERT ON shardline.hosts
    FOR EACH ROW EXECUTE FUNCTION shardline.map_changed();
CREATE OR REPLACE TRIGGER hosts_changed_update AFTER UPDATE ON shardline.hosts
    FOR EACH ROW WHEN (OLD.address IS DISTINCT FROM NEW.address
                       OR OLD.peer_address IS DISTINCT FROM NEW.peer_address
                       OR OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION shardline.map_changed();
"#;

/// The parameters a cluster fixes at `init` for its whole life, and the map version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterInfo {
    /// How many logical shards.
    pub logical_shards: ShardCount,
    /// The prefix of the shard schemas.
    pub schema_prefix: SchemaPrefix,
    /// The ID layout (its epoch).
    pub layout: Layout,
    /// The shard map's version.
    pub map_version: i64,
}

impl ClusterInfo {
    /// Checks that `config` agrees with the catalog on what cannot change.
    ///
    /// # Errors
    ///
    /// [`Error::Mismatch`] naming the first key that differs, with both values.
    pub fn check(&self, config: &Config) -> Result<()> {
        let mismatch = |key: &'static str, catalog: String, config: String| {
            Err(Error::Mismatch { key, catalog, config })
        };
        if self.logical_shards != config.logical_shards {
            return mismatch(
                "logical_shards",
                self.logical_shards.get().to_string(),
                config.logical_shards.get().to_string(),
            );
        }
        if self.schema_prefix != config.schema_prefix {
            return mismatch(
                "schema_prefix",
                self.schema_prefix.as_str().to_owned(),
                config.schema_prefix.as_str().to_owned(),
            );
        }
        if self.layout.epoch_ms() != config.layout.epoch_ms() {
            return mismatch(
                "id.epoch_ms",
                self.layout.epoch_ms().to_string(),
                config.layout.epoch_ms().to_string(),
            );
        }
        Ok(())
    }
}

/// Connects to `url` (`target` names it in errors and logs: never the URL itself, which
/// may hold a password). Waits at most [`DEFAULT_CONNECT_TIMEOUT`] unless the URL says.
///
/// # Errors
///
/// [`Error::BadUrl`] when the URL does not parse; [`Error::Connect`] when the server
/// cannot be reached or refuses; [`Error::ConnectTimeout`] when it took the connection
/// but did not finish the start-up in time.
pub async fn connect(url: &DbUrl, target: &str) -> Result<Client> {
    let (config, tls) = crate::tls::prepare(url, target)?;
    let config = with_defaults(config);
    let after = startup_budget(&config);
    let (client, connection) = tokio::time::timeout(after, config.connect(tls))
        .await
        .map_err(|_| Error::ConnectTimeout { target: target.to_owned(), after })?
        .map_err(|source| connect_error(target, source))?;
    let target = target.to_owned();
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(%target, error = %e, "connection ended");
        }
    });
    Ok(client)
}

/// Asks the server `url` points at to cancel the statement in flight on the connection
/// `token` came from (`Client::cancel_token`), on a connection of its own. Dropping a
/// query's future does not: the server runs the statement to its end and keeps its
/// locks until then. Use it when giving up on a statement; the cancel reaches whatever
/// the session runs when it arrives, so only on a connection no one else uses.
///
/// It waits for the server to close the cancel's connection, as libpq does: PgBouncer
/// (1.18 and later) passes a cancel on only while the connection that sent it is open,
/// and tokio-postgres's own `cancel_query` closes it as soon as the request is written
/// (through PgBouncer 1.18 it cancelled nothing). The request goes to every host the URL
/// names at once (its `hostaddr` when given), each within the connect timeout: a server
/// the connection is not on ignores it.
///
/// # Errors
///
/// [`Error::Cancel`] when no host took the request.
pub async fn cancel(token: &tokio_postgres::CancelToken, url: &DbUrl, target: &str) -> Result<()> {
    let each = pg_config(url, target)?.get_connect_timeout().copied().unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    match cancel_within(token, url, target, each).await? {
        Cancelled { done: true, .. } => Ok(()),
        Cancelled { why, .. } => Err(Error::Cancel { target: target.to_owned(), message: why.join("; ") }),
    }
}

/// What [`cancel_within`] did.
#[derive(Debug)]
pub(crate) struct Cancelled {
    /// A server took the request and closed the cancel's connection: it has acted on it.
    pub(crate) done: bool,
    /// A request may have reached a server without that server having closed the
    /// connection in time: it may still act on it, later, on whatever the session runs
    /// then.
    pub(crate) maybe_later: bool,
    /// Why each host that did not take it did not, naming the host.
    pub(crate) why: Vec<String>,
}

/// [`cancel`], each host within `each`; says which requests may still be acted on.
pub(crate) async fn cancel_within(
    token: &tokio_postgres::CancelToken,
    url: &DbUrl,
    target: &str,
    each: Duration,
) -> Result<Cancelled> {
    use tokio_postgres::config::Host;
    let (config, tls) = crate::tls::prepare(url, target)?;
    let (hosts, addrs, ports) = (config.get_hosts(), config.get_hostaddrs(), config.get_ports());
    let sends = (0..hosts.len().max(addrs.len())).map(|i| {
        let port = ports.get(i).or_else(|| ports.first()).copied().unwrap_or(5432);
        let (host, addr) = (hosts.get(i).cloned(), addrs.get(i).copied());
        let name = match (&host, addr) {
            (Some(Host::Tcp(name)), _) => name.clone(),
            (Some(Host::Unix(dir)), _) => dir.display().to_string(),
            (None, Some(ip)) => ip.to_string(),
            (None, None) => String::new(),
        };
        let host = host.unwrap_or_else(|| Host::Tcp(name.clone()));
        let tls = tls.clone();
        async move { (name, send_cancel(token, &host, addr, port, tls, each).await) }
    });
    let mut out = Cancelled { done: false, maybe_later: false, why: Vec::new() };
    for (name, sent) in futures::future::join_all(sends).await {
        match sent {
            Sent::Done => out.done = true,
            Sent::No(why) => out.why.push(format!("{name}: {why}")),
            Sent::Maybe(why) => {
                out.maybe_later = true;
                out.why.push(format!("{name}: {why}"));
            }
        }
    }
    if out.why.is_empty() && !out.done {
        out.why.push("the URL names no host".into());
    }
    Ok(out)
}

/// How one cancel request went.
enum Sent {
    /// The server closed the connection: it has acted on the request.
    Done,
    /// Not sent (no connection).
    No(String),
    /// Perhaps sent, and not known to be acted on.
    Maybe(String),
}

/// One cancel request to one host (see [`cancel`]): the connection within `each`, then
/// the request and the server's close within `each` again.
async fn send_cancel(
    token: &tokio_postgres::CancelToken,
    host: &tokio_postgres::config::Host,
    addr: Option<std::net::IpAddr>,
    port: u16,
    mut tls: tokio_postgres_rustls::MakeRustlsConnect,
    each: Duration,
) -> Sent {
    use tokio_postgres::config::Host;
    use tokio_postgres::tls::MakeTlsConnect;
    let late = |_| format!("no answer within {each:?}");
    let sent = match host {
        Host::Tcp(name) => {
            let connect = match addr {
                Some(ip) => tokio::time::timeout(each, tokio::net::TcpStream::connect((ip, port))).await,
                None => {
                    tokio::time::timeout(each, tokio::net::TcpStream::connect((name.as_str(), port))).await
                }
            };
            let socket = match connect.map_err(late) {
                Ok(Ok(socket)) => socket,
                Ok(Err(e)) => return Sent::No(e.to_string()),
                Err(why) => return Sent::No(why),
            };
            let connector = match MakeTlsConnect::<UntilClosed<tokio::net::TcpStream>>::make_tls_connect(
                &mut tls, name,
            ) {
                Ok(connector) => connector,
                Err(e) => return Sent::No(format!("TLS: {e}")),
            };
            tokio::time::timeout(each, token.cancel_query_raw(UntilClosed(socket), connector)).await
        }
        // No TLS over a Unix socket (Postgres refuses it there).
        Host::Unix(dir) => {
            let path = dir.join(format!(".s.PGSQL.{port}"));
            let socket =
                match tokio::time::timeout(each, tokio::net::UnixStream::connect(path)).await.map_err(late) {
                    Ok(Ok(socket)) => socket,
                    Ok(Err(e)) => return Sent::No(e.to_string()),
                    Err(why) => return Sent::No(why),
                };
            tokio::time::timeout(each, token.cancel_query_raw(UntilClosed(socket), tokio_postgres::NoTls))
                .await
        }
    };
    match sent {
        Ok(Ok(())) => Sent::Done,
        // Connected: whatever failed after, the request may have gone out.
        Ok(Err(e)) => Sent::Maybe(crate::error_chain(&e)),
        Err(_) => Sent::Maybe(format!("the server did not close the cancel's connection within {each:?}")),
    }
}

/// A socket whose shutdown waits for the other side to close it (reading and dropping
/// what comes) instead of closing it: what [`cancel`] gives tokio-postgres, which shuts
/// the socket down right after writing the cancel request.
struct UntilClosed<S>(S);

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for UntilClosed<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for UntilClosed<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let mut scratch = [0_u8; 256];
        loop {
            let mut buf = tokio::io::ReadBuf::new(&mut scratch);
            match std::pin::Pin::new(&mut self.0).poll_read(cx, &mut buf) {
                // Closed by the server: it has acted on the request.
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => {}
                // Reset: closed as well.
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// The driver's configuration for `url`, with shardline's defaults: a connect timeout
/// of [`DEFAULT_CONNECT_TIMEOUT`] and `application_name = shardline`, unless the URL
/// sets them.
///
/// # Errors
///
/// [`Error::BadUrl`] naming `target` (never the URL) when the URL does not parse.
pub fn pg_config(url: &DbUrl, target: &str) -> Result<tokio_postgres::Config> {
    crate::tls::prepare(url, target).map(|(config, _)| with_defaults(config))
}

/// The TLS connector `url`'s `sslmode` and `sslrootcert` call for (rustls), with the
/// driver's configuration as [`pg_config`] gives it.
///
/// # Errors
///
/// As [`pg_config`]; [`Error::Tls`] when the trusted certificates cannot be read.
pub fn pg_config_tls(
    url: &DbUrl,
    target: &str,
) -> Result<(tokio_postgres::Config, tokio_postgres_rustls::MakeRustlsConnect)> {
    crate::tls::prepare(url, target).map(|(config, tls)| (with_defaults(config), tls))
}

/// The error for a failed connection: [`Error::Tls`] when the server's certificate was
/// refused, [`Error::Connect`] otherwise.
pub(crate) fn connect_error(target: &str, source: tokio_postgres::Error) -> Error {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(&source);
    while let Some(e) = cause {
        let tls = e.downcast_ref::<rustls::Error>().or_else(|| {
            e.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if let Some(tls) = tls {
            return Error::Tls {
                target: target.to_owned(),
                message: format!("the server's certificate was refused: {tls}"),
            };
        }
        cause = e.source();
    }
    Error::Connect { target: target.to_owned(), source }
}

/// How long a whole connection may take, start-up included. The driver's
/// `connect_timeout` covers each TCP connect only, so a server that accepts and then says
/// nothing (paused, or cut off behind something that accepted for it) would hang the
/// start-up forever. One connect timeout per host the URL lists (the driver tries them in
/// turn), and one more for the start-up (TLS, authentication).
pub(crate) fn startup_budget(config: &tokio_postgres::Config) -> Duration {
    let per = config.get_connect_timeout().copied().unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    let attempts = u32::try_from(crate::tls::listed_hosts(config)).unwrap_or(u32::MAX);
    per.saturating_mul(attempts.saturating_add(1))
}

fn with_defaults(mut config: tokio_postgres::Config) -> tokio_postgres::Config {
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(DEFAULT_CONNECT_TIMEOUT);
    }
    if config.get_application_name().is_none() {
        config.application_name("shardline");
    }
    config
}

/// What [`Catalog::prepare`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Prepared {
    /// The catalog's parameters were recorded (its first `init`).
    pub catalog_created: bool,
    /// Shards placed (first run only).
    pub shards_placed: usize,
    /// Hosts new to the catalog, added with no shards (not on the first run).
    pub hosts_added: Vec<HostName>,
}

/// A connection to the catalog.
#[derive(Debug)]
pub struct Catalog {
    client: Client,
}

impl Catalog {
    /// Connects to the catalog the config names. Reads nothing yet.
    ///
    /// # Errors
    ///
    /// As [`connect`].
    pub async fn connect(config: &Config) -> Result<Catalog> {
        Ok(Catalog { client: connect(&config.catalog, "catalog").await? })
    }

    /// Connects to the catalog and checks that it is initialised and agrees with
    /// `config`.
    ///
    /// # Errors
    ///
    /// As [`connect`]; [`Error::NotInitialised`]; [`Error::Mismatch`].
    pub async fn open(config: &Config) -> Result<(Catalog, ClusterInfo)> {
        let catalog = Catalog::connect(config).await?;
        let info = catalog.cluster().await?.ok_or(Error::NotInitialised)?;
        info.check(config)?;
        Ok((catalog, info))
    }

    /// Wraps an open connection to the catalog.
    pub fn from_client(client: Client) -> Catalog {
        Catalog { client }
    }

    /// The connection, lent to the owners of what lives in the catalog but is not
    /// this crate's: `shardline_ops::moves::journal` (the journal of moves: its DDL,
    /// every statement on it, and the flip's transaction, which writes the map through
    /// [`Catalog::flip_shard`] on this same connection) and `shardline_ops::grants`
    /// (the application roles' privileges on the catalog). Nothing else calls it:
    /// clippy's `disallowed_methods` (clippy.toml) refuses any other caller, and each
    /// owner says why with an `#[expect]`.
    pub fn lend(&self) -> &Client {
        &self.client
    }

    /// Whether the connection has ended (a new [`Catalog`] is needed).
    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    /// Takes the cluster's advisory lock ([`LOCK_KEY`]) exclusively for this session,
    /// as `init` and `migrate` do: whether it was free. Held until the connection
    /// closes.
    ///
    /// # Errors
    ///
    /// [`Error::Catalog`] when the statement fails.
    pub async fn try_lock(&self) -> Result<bool> {
        Ok(self
            .client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&LOCK_KEY])
            .await
            .map_err(|e| Error::catalog("take the catalog lock", e))?
            .get(0))
    }

    /// Waits for `gc`'s advisory lock ([`GC_LOCK_KEY`]) and takes it exclusively for
    /// this session, held until the connection closes: no move starts meanwhile, and no
    /// other `gc` runs.
    ///
    /// # Errors
    ///
    /// [`Error::Catalog`] when the statement fails.
    pub async fn lock_for_gc(&self) -> Result<()> {
        self.client
            .execute("SELECT pg_advisory_lock($1)", &[&GC_LOCK_KEY])
            .await
            .map_err(|e| Error::catalog("take gc's lock", e))?;
        Ok(())
    }

    /// Takes, for this session, the cluster's lock shared (so `init` and `migrate` wait
    /// for moves, and moves for them) and move `id`'s own lock (one process per move).
    /// Returns whether each was had, `(cluster, move)`; when not both, gives back the
    /// one it took, so that trying again takes each once.
    ///
    /// # Errors
    ///
    /// [`Error::Catalog`] when a statement fails.
    pub async fn try_lock_move(&self, id: i64) -> Result<(bool, bool)> {
        let row = self
            .client
            .query_one(
                "SELECT pg_try_advisory_lock_shared($1), pg_try_advisory_lock(hashtextextended('shardline move ' || $2::bigint, 0))",
                &[&LOCK_KEY, &id],
            )
            .await
            .map_err(|e| Error::catalog("take the move's lock", e))?;
        let (cluster, this): (bool, bool) = (row.get(0), row.get(1));
        if !(cluster && this) {
            self.client
                .execute(
                    "SELECT CASE WHEN $1 THEN pg_advisory_unlock_shared($2) END,
                            CASE WHEN $3 THEN pg_advisory_unlock(hashtextextended('shardline move ' || $4::bigint, 0)) END",
                    &[&cluster, &LOCK_KEY, &this, &id],
                )
                .await
                .map_err(|e| Error::catalog("take the move's lock", e))?;
        }
        Ok((cluster, this))
    }

    /// `init`'s part in the catalog, in one transaction: creates this module's tables
    /// ([`SCHEMA_SQL`]) when there is no catalog yet (or brings an earlier version's up
    /// to date), checks the stored parameters
    /// against `config` (or records them), adds the config's hosts the catalog does not
    /// know, and on the first run places every shard over the config's hosts
    /// ([`Config::even_map`]). `check` sees the resulting map before the commit; on any
    /// refusal (its own or `check`'s) nothing changes.
    ///
    /// # Errors
    ///
    /// [`Error::Mismatch`]; [`Error::InvalidCatalog`]; [`Error::Catalog`] when a
    /// statement fails; [`Error::Invalid`] for a config host whose name clashes with
    /// another's ([`name_clash`]); `check`'s error.
    pub async fn prepare<E: From<Error>>(
        &self,
        config: &Config,
        check: impl FnOnce(&ShardMap) -> std::result::Result<(), E>,
    ) -> std::result::Result<Prepared, E> {
        let c = &self.client;
        // Up to date: the newest objects of SCHEMA_SQL are there (its DDL takes strong
        // locks that every router's map read would queue behind, so it runs only when
        // something is missing: a new catalog, or one an earlier version made).
        let current: bool = c
            .query_one(
                "SELECT to_regclass('shardline.cluster') IS NOT NULL
                    AND EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass('shardline.hosts')
                                                          AND attname = 'state' AND NOT attisdropped)
                    AND EXISTS (SELECT FROM pg_trigger WHERE tgrelid = to_regclass('shardline.shards')
                                                        AND tgname = 'shard_host_live')",
                &[],
            )
            .await
            .map_err(|e| Error::catalog("look for the catalog", e))?
            .get(0);
        c.batch_execute("BEGIN").await.map_err(|e| Error::catalog("begin", e))?;
        let result = async {
            let mut prepared = Prepared::default();
            if !current {
                // Idempotent: also brings a catalog made by an earlier version up to
                // date (the hosts' addresses). Waits for the catalog's tables at most
                // 10 s rather than queue the routers' map reads behind it for long.
                c.batch_execute("SET LOCAL lock_timeout = '10s'")
                    .await
                    .map_err(|e| Error::catalog("set a lock timeout", e))?;
                c.batch_execute(SCHEMA_SQL).await.map_err(|e| Error::catalog("create the catalog schema", e))?;
            }
            match self.cluster().await? {
                Some(info) => info.check(config)?,
                None => {
                    c.execute(
                        "INSERT INTO shardline.cluster (format, logical_shards, schema_prefix, epoch_ms) VALUES ($1, $2, $3, $4)",
                        &[
                            &FORMAT,
                            &i32::from(config.logical_shards.get()),
                            &config.schema_prefix.as_str(),
                            &config.layout.epoch_ms(),
                        ],
                    )
                    .await
                    .map_err(|e| Error::catalog("record the cluster's parameters", e))?;
                    prepared.catalog_created = true;
                }
            }
            let known: std::collections::HashSet<String> = c
                .query("SELECT name FROM shardline.hosts", &[])
                .await
                .map_err(|e| Error::catalog("read the hosts", e))?
                .iter()
                .map(|r| r.get(0))
                .collect();
            let new: Vec<HostName> =
                config.hosts.iter().map(|h| h.name.clone()).filter(|h| !known.contains(h.as_str())).collect();
            for name in &new {
                if let Some(h) = config.host(name) {
                    self.add_host(name, &h.url, &h.peer_url).await?;
                }
            }
            // A host the catalog knew before it kept addresses: recorded from the config.
            for h in &config.hosts {
                let (address, peer) = (recordable(&h.name, &h.url)?, recordable(&h.name, &h.peer_url)?);
                c.execute(
                    "UPDATE shardline.hosts SET address = $2, peer_address = $3 WHERE name = $1 AND address IS NULL",
                    &[&h.name.as_str(), &address.expose(), &peer.expose()],
                )
                .await
                .map_err(|e| Error::catalog("record a host's address", e))?;
            }
            let placed: i64 = c
                .query_one("SELECT count(*) FROM shardline.shards", &[])
                .await
                .map_err(|e| Error::catalog("count the shards", e))?
                .get(0);
            if placed == 0 {
                let map = config.even_map().map_err(Error::from)?;
                let (shards, hosts): (Vec<i32>, Vec<String>) = config
                    .logical_shards
                    .shards()
                    .map(|s| (i32::from(s.get()), map.host_of(s).to_string()))
                    .unzip();
                c.execute(
                    "INSERT INTO shardline.shards (shard, host) SELECT * FROM unnest($1::integer[], $2::text[])",
                    &[&shards, &hosts],
                )
                .await
                .map_err(|e| Error::catalog("place the shards", e))?;
                prepared.shards_placed = shards.len();
            } else if !prepared.catalog_created {
                // Hosts added to the config after the first run get no shards: only moves
                // change the map.
                prepared.hosts_added = new;
            }
            check(&self.map().await?)?;
            Ok::<_, E>(prepared)
        }
        .await;
        match result {
            Ok(prepared) => {
                c.batch_execute("COMMIT").await.map_err(|e| Error::catalog("commit", e))?;
                Ok(prepared)
            }
            Err(e) => {
                let _ = c.batch_execute("ROLLBACK").await;
                Err(e)
            }
        }
    }

    /// Records, after `init` or `migrate`, that the shards `ready` are up to date with
    /// migration `last`, and every migration file's checksum (`(name, checksum)`; a name
    /// already known keeps its first checksum). Writes only rows that differ.
    ///
    /// # Errors
    ///
    /// [`Error::Catalog`] when a statement fails.
    pub async fn record_states(
        &self,
        ready: &[LogicalShard],
        last: Option<&str>,
        migrations: &[(&str, &str)],
    ) -> Result<()> {
        let ready: Vec<i32> = ready.iter().map(|s| i32::from(s.get())).collect();
        self.client
            .execute(
                "UPDATE shardline.shards SET ready = true, migration = $2, updated_at = now()
                 WHERE shard = ANY($1) AND (NOT ready OR migration IS DISTINCT FROM $2)",
                &[&ready, &last],
            )
            .await
            .map_err(|e| Error::catalog("record the shards' state", e))?;
        let (names, sums): (Vec<&str>, Vec<&str>) = migrations.iter().copied().unzip();
        self.client
            .execute(
                "INSERT INTO shardline.migrations (name, checksum) SELECT * FROM unnest($1::text[], $2::text[])
                 ON CONFLICT (name) DO NOTHING",
                &[&names, &sums],
            )
            .await
            .map_err(|e| Error::catalog("record the migrations", e))?;
        Ok(())
    }

    /// The map's one write for a move: places `shard` on `to` when the map has it on
    /// `from` (or already on `to`); returns the rows changed (0 when the map has it
    /// elsewhere). The trigger bumps the version and notifies the routers at commit.
    /// A move's flip runs it inside the journal's transaction on this connection
    /// (`shardline_ops::moves::journal`), so the map and the journal change together.
    ///
    /// # Errors
    ///
    /// [`Error::Catalog`] when the statement fails.
    pub async fn flip_shard(&self, shard: LogicalShard, from: &HostName, to: &HostName) -> Result<u64> {
        self.client
            .execute(
                "UPDATE shardline.shards SET host = $2, updated_at = now() WHERE shard = $1 AND host IN ($2, $3)",
                &[&i32::from(shard.get()), &to.as_str(), &from.as_str()],
            )
            .await
            .map_err(|e| Error::catalog("flip the map", e))
    }

    /// The one read of the journal of moves outside its owner
    /// (`shardline_ops::moves::journal`, which creates and writes `shardline.moves`):
    /// whether a move of any of `shards` is running at a step that can hide the shard's
    /// schema on its source, and whether one ended in the last five seconds. A router
    /// waiting on a fenced shard asks it; the application roles may `SELECT` the
    /// journal for it (`shardline_ops::grants`). Unnamed (one round trip, no statement
    /// kept): the catalog may be behind a transaction-mode pooler.
    ///
    /// A move journaled `started`, `prepared` or `copying` has not fenced its source (the
    /// fence renames the schema; it is committed before the journal says `fenced`, so
    /// `caught_up` counts): a name missing there is really missing, and the statement
    /// fails at once instead of waiting out `move_wait` behind a long copy.
    pub(crate) async fn moves_of(&self, shards: &[LogicalShard]) -> Result<(bool, bool)> {
        let shards: Vec<i32> = shards.iter().map(|s| i32::from(s.get())).collect();
        let row = self
            .client
            .query_typed_one(
                "SELECT coalesce(bool_or(state = 'running'
                                         AND step NOT IN ('started', 'prepared', 'copying')), false),
                        coalesce(bool_or(state <> 'running' AND updated_at > now() - interval '5 seconds'), false)
                   FROM shardline.moves WHERE shard = ANY($1)",
                &[(&shards, tokio_postgres::types::Type::INT4_ARRAY)],
            )
            .await
            .map_err(|e| Error::catalog("read the moves", e))?;
        Ok((row.get(0), row.get(1)))
    }

    /// `shardline.complete_flip(id, token)`, the function the journal's owner installs
    /// in the catalog (`shardline_ops::moves::journal::COMPLETE_FLIP_SQL`): whether it
    /// flipped.
    pub(crate) async fn complete_flip(&self, id: i64, token: &str) -> Result<bool> {
        let row = self
            .client
            .query_typed_one(
                "SELECT shardline.complete_flip($1, $2)",
                &[(&id, tokio_postgres::types::Type::INT8), (&token, tokio_postgres::types::Type::TEXT)],
            )
            .await
            .map_err(|e| Error::catalog("complete a move's flip", e))?;
        Ok(row.get(0))
    }

    /// The cluster's parameters, or `None` before the first `init`.
    ///
    /// # Errors
    ///
    /// [`Error::Catalog`] when a query fails; [`Error::InvalidCatalog`] when the stored
    /// values are not valid.
    pub async fn cluster(&self) -> Result<Option<ClusterInfo>> {
        let exists: bool = self
            .client
            .query_typed_one("SELECT to_regclass('shardline.cluster') IS NOT NULL", &[])
            .await
            .map_err(|e| Error::catalog("look for the catalog", e))?
            .get(0);
        if !exists {
            return Ok(None);
        }
        let row = self
            .client
            .query_typed_opt(
                "SELECT format, logical_shards, schema_prefix, epoch_ms, map_version FROM shardline.cluster",
                &[],
            )
            .await
            .map_err(|e| Error::catalog("read shardline.cluster", e))?;
        let Some(row) = row else { return Ok(None) };
        let format: i32 = row.get(0);
        if format != FORMAT {
            return Err(Error::InvalidCatalog {
                reason: format!("its format is {format}; this shardline reads format {FORMAT}"),
            });
        }
        let invalid = |e: &dyn std::fmt::Display| Error::InvalidCatalog { reason: e.to_string() };
        Ok(Some(ClusterInfo {
            logical_shards: ShardCount::new(i64::from(row.get::<_, i32>(1))).map_err(|e| invalid(&e))?,
            schema_prefix: SchemaPrefix::new(row.get(2)).map_err(|e| invalid(&e))?,
            layout: Layout::INSTAGRAM.with_epoch(row.get(3)).map_err(|e| invalid(&e))?,
            map_version: row.get(4),
        }))
    }

    /// The map version the catalog holds: one small unnamed statement, the periodic
    /// check of [`crate::ClusterOptions::map_check`].
    ///
    /// # Errors
    ///
    /// [`Error::Catalog`] when the query fails; [`Error::NotInitialised`] before `init`.
    pub async fn map_version(&self) -> Result<i64> {
        self.client
            .query_typed_opt("SELECT map_version FROM shardline.cluster", &[])
            .await
            .map_err(|e| Error::catalog("read the map version", e))?
            .map(|r| r.get(0))
            .ok_or(Error::NotInitialised)
    }

    /// The shard map, read in one statement (one snapshot), validated.
    ///
    /// # Errors
    ///
    /// [`Error::NotInitialised`] before `init`; [`Error::InvalidCatalog`] when the stored
    /// map does not map every shard exactly once to a known host.
    pub async fn map(&self) -> Result<ShardMap> {
        // Unnamed statements (one round trip, none kept): the catalog may be reached
        // through a transaction-mode pooler.
        let row = self
            .client
            .query_typed_opt(
                "SELECT c.logical_shards, c.map_version,
                        (SELECT coalesce(array_agg(name ORDER BY position), '{}') FROM shardline.hosts h
                          WHERE coalesce(to_jsonb(h) ->> 'state', 'active') <> 'removed'
                             OR EXISTS (SELECT FROM shardline.shards s WHERE s.host = h.name)),
                        (SELECT coalesce(array_agg(shard ORDER BY shard), '{}') FROM shardline.shards),
                        (SELECT coalesce(array_agg(host ORDER BY shard), '{}') FROM shardline.shards)
                 FROM shardline.cluster c",
                &[],
            )
            .await
            .map_err(|e| Error::catalog("read the shard map", e))?
            .ok_or(Error::NotInitialised)?;
        let invalid = |e: shardline_router::Error| Error::InvalidCatalog { reason: e.to_string() };
        let count = ShardCount::new(i64::from(row.get::<_, i32>(0))).map_err(invalid)?;
        let hosts = row
            .get::<_, Vec<String>>(2)
            .iter()
            .map(|h| HostName::new(h))
            .collect::<Result<Vec<_>, _>>()
            .map_err(invalid)?;
        let shards: Vec<i32> = row.get(3);
        let owners: Vec<String> = row.get(4);
        let assignments = shards
            .into_iter()
            .zip(owners)
            .map(|(s, h)| Ok((i64::from(s), HostName::new(&h)?)))
            .collect::<Result<Vec<_>, shardline_router::Error>>()
            .map_err(invalid)?;
        ShardMap::new(row.get(1), count, hosts, assignments).map_err(invalid)
    }
}

/// Where a host is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HostState {
    /// Holds shards and takes new ones.
    Active,
    /// Its shards are being moved off (`shardline host drain`); no move targets it.
    Draining,
    /// Removed (`shardline host remove`): holds no shard, no router connects to it. Its
    /// row stays for the journal of moves that name it.
    Removed,
}

impl HostState {
    /// Its name in the catalog.
    pub fn as_str(self) -> &'static str {
        match self {
            HostState::Active => "active",
            HostState::Draining => "draining",
            HostState::Removed => "removed",
        }
    }

    fn parse(s: &str) -> Result<HostState> {
        match s {
            "active" => Ok(HostState::Active),
            "draining" => Ok(HostState::Draining),
            "removed" => Ok(HostState::Removed),
            other => Err(Error::InvalidCatalog { reason: format!("a host's state is {other:?}") }),
        }
    }
}

impl std::fmt::Display for HostState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A host as the catalog records it: its address, never a password.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CatalogHost {
    /// Its name.
    pub name: HostName,
    /// How shardline reaches it, without a password (`None`: a catalog made before
    /// addresses were recorded, where only the config knows).
    pub address: Option<DbUrl>,
    /// How the other hosts reach it (moves), without a password (`None`: `address`).
    pub peer_address: Option<DbUrl>,
    /// Where it is in its life.
    pub state: HostState,
}

/// `url` without its password, as the catalog records it for host `name`; refused when
/// the driver would still read a password from what is left (a password holding `?` or
/// `/` unencoded, say), so that no password is ever recorded.
fn recordable(name: &HostName, url: &DbUrl) -> Result<DbUrl> {
    let (bare, _) = url.split_password();
    let target = format!("host {name}");
    let bad = |message: String| Error::BadUrl { target: target.clone(), message };
    // Read as the driver reads it (without TLS keys or libpq's passfile, and without
    // touching any file): anything it cannot read is refused rather than recorded.
    let tls = bare.tls().map_err(bad)?;
    let driver = DbUrl::new(tls.driver_url).without_keys(&["passfile"]);
    let parsed = driver
        .expose()
        .parse::<tokio_postgres::Config>()
        .map_err(|e| bad(format!("cannot be read to check that it holds no password: {e}")))?;
    if parsed.get_password().is_some() {
        return Err(bad("its password could not be taken off it to record its address; percent-encode it \
                        (or leave it out and give it by reference)"
            .into()));
    }
    Ok(bare)
}

/// [`Error::Invalid`] when a host of `hosts` other than `name` differs from it only in
/// case or punctuation ([`HostName::env_form`]): under `[credentials] password_env`
/// both would read one variable, and one would be sent the other's password. Removed
/// hosts count: `shardline host add` brings them back.
pub fn name_clash(name: &HostName, hosts: &[CatalogHost]) -> Option<Error> {
    let other = hosts.iter().find(|h| h.name != *name && h.name.env_form() == name.env_form())?;
    Some(Error::Invalid {
        what: format!(
            "host {name}: it and host {} differ only in case or punctuation: both would be {} in an environment variable's name (`[credentials] password_env`), so one could be sent the other's password",
            other.name,
            name.env_form()
        ),
    })
}

impl CatalogHost {
    /// A host record, as the catalog would hold it.
    pub fn new(
        name: HostName,
        address: Option<DbUrl>,
        peer_address: Option<DbUrl>,
        state: HostState,
    ) -> Self {
        CatalogHost { name, address, peer_address, state }
    }
}

impl Catalog {
    /// Every host the catalog knows, removed ones included, in placement order.
    ///
    /// # Errors
    ///
    /// [`Error::Catalog`]; [`Error::InvalidCatalog`] for a name or state it cannot hold.
    pub async fn hosts(&self) -> Result<Vec<CatalogHost>> {
        // Read through to_jsonb so that a catalog made before the addresses were
        // recorded (no such columns until `init` runs again) reads as "no address".
        let rows = self
            .client
            .query_typed(
                "SELECT name, to_jsonb(h) ->> 'address', to_jsonb(h) ->> 'peer_address',
                        coalesce(to_jsonb(h) ->> 'state', 'active')
                   FROM shardline.hosts h ORDER BY position",
                &[],
            )
            .await
            .map_err(|e| Error::catalog("read the hosts", e))?;
        rows.iter()
            .map(|r| {
                let name = HostName::new(r.get::<_, &str>(0))
                    .map_err(|e| Error::InvalidCatalog { reason: e.to_string() })?;
                let url = |i: usize| r.get::<_, Option<String>>(i).map(DbUrl::new);
                Ok(CatalogHost {
                    name,
                    address: url(1),
                    peer_address: url(2),
                    state: HostState::parse(r.get(3))?,
                })
            })
            .collect()
    }

    /// Adds host `name` (active, last in placement order) at `url`, reached by the other
    /// hosts at `peer_url`; the passwords of both are not recorded.
    ///
    /// # Errors
    ///
    /// [`Error::Catalog`] (a name already known among them: SQLSTATE 23505);
    /// [`Error::Invalid`] when another host's name differs from `name` only in case or
    /// punctuation ([`HostName::env_form`]).
    pub async fn add_host(&self, name: &HostName, url: &DbUrl, peer_url: &DbUrl) -> Result<()> {
        let (address, peer) = (recordable(name, url)?, recordable(name, peer_url)?);
        if let Some(clash) = name_clash(name, &self.hosts().await?) {
            return Err(clash);
        }
        self.client
            .execute(
                "INSERT INTO shardline.hosts (name, position, address, peer_address)
                 SELECT $1, (SELECT coalesce(max(position), 0) + 1 FROM shardline.hosts), $2, $3",
                &[&name.as_str(), &address.expose(), &peer.expose()],
            )
            .await
            .map_err(|e| Error::catalog("add a host", e))?;
        Ok(())
    }

    /// Records that host `name` now lives at `url` (reached by the others at
    /// `peer_url`), passwords not recorded; returns whether the host was known. Refused
    /// while a move to or from the host runs: the move reaches it at the address it
    /// was journaled with (a move's journal row share-locks both hosts' rows, so a move
    /// journaled while this waited for the row is seen; one journaled after it reads
    /// the new address, see `shardline_ops::moves`).
    ///
    /// # Errors
    ///
    /// [`Error::Catalog`]; [`Error::InvalidCatalog`] while a move to or from the host
    /// runs (nothing changes).
    pub async fn set_address(&self, name: &HostName, url: &DbUrl, peer_url: &DbUrl) -> Result<bool> {
        let (address, peer) = (recordable(name, url)?, recordable(name, peer_url)?);
        self.change_host(name, HostChange::Address { address: address.expose(), peer: peer.expose() }).await
    }

    /// Sets host `name`'s state; returns whether the host was known. Removing a host
    /// that still holds a shard is refused by the catalog (nothing changes).
    ///
    /// # Errors
    ///
    /// [`Error::Catalog`]; [`Error::InvalidCatalog`] when `Removed` is asked of a host
    /// that holds shards, or while a move to or from it runs.
    pub async fn set_host_state(&self, name: &HostName, state: HostState) -> Result<bool> {
        self.change_host(name, HostChange::State(state)).await
    }

    /// Makes `change` to host `name`'s row, locked `FOR UPDATE` in a transaction of its
    /// own; returns whether the host was known (nothing changes when it is not). READ
    /// COMMITTED whatever the server's default: the counts below must see what
    /// committed while this waited for the row's lock (a flip onto the host, see
    /// `shard_host_live`; a move's journal row, which share-locks both hosts' rows).
    async fn change_host(&self, name: &HostName, change: HostChange<'_>) -> Result<bool> {
        let c = &self.client;
        let what = match change {
            HostChange::Address { .. } => "record a host's address",
            HostChange::State(_) => "set a host's state",
        };
        let err = |e| Error::catalog(what, e);
        // A client gone between the statements (a cut link) would leave the session idle
        // in the transaction, the row locked (a flip onto the host waits for it) until
        // TCP noticed: the server ends it instead.
        c.batch_execute(
            "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL idle_in_transaction_session_timeout = '15s'",
        )
        .await
        .map_err(err)?;
        let result = async {
            let known = c
                .query_opt("SELECT FROM shardline.hosts WHERE name = $1 FOR UPDATE", &[&name.as_str()])
                .await
                .map_err(err)?
                .is_some();
            if !known {
                return Ok(false);
            }
            if change == HostChange::State(HostState::Removed) {
                let held: i64 = c
                    .query_one("SELECT count(*) FROM shardline.shards WHERE host = $1", &[&name.as_str()])
                    .await
                    .map_err(err)?
                    .get(0);
                if held > 0 {
                    return Err(Error::InvalidCatalog {
                        reason: format!("host {name} still holds {held} shard(s)"),
                    });
                }
            }
            if matches!(change, HostChange::Address { .. } | HostChange::State(HostState::Removed)) {
                let moving: i64 = c
                    .query_one(
                        "SELECT count(*) FROM shardline.moves WHERE state = 'running' AND (source = $1 OR target = $1)",
                        &[&name.as_str()],
                    )
                    .await
                    .map_err(err)?
                    .get(0);
                if moving > 0 {
                    let then = if matches!(change, HostChange::Address { .. }) { "readdress" } else { "remove" };
                    return Err(Error::InvalidCatalog {
                        reason: format!("a move to or from host {name} is running; {then} it once the move ends"),
                    });
                }
            }
            let name = name.as_str();
            match change {
                HostChange::Address { address, peer } => {
                    c.execute(
                        "UPDATE shardline.hosts SET address = $2, peer_address = $3 WHERE name = $1",
                        &[&name, &address, &peer],
                    )
                    .await
                }
                HostChange::State(state) => {
                    c.execute("UPDATE shardline.hosts SET state = $2 WHERE name = $1", &[&name, &state.as_str()])
                        .await
                }
            }
            .map_err(err)?;
            Ok(true)
        }
        .await;
        match result {
            Ok(known) => {
                c.batch_execute("COMMIT").await.map_err(err)?;
                Ok(known)
            }
            Err(e) => {
                let _ = c.batch_execute("ROLLBACK").await;
                Err(e)
            }
        }
    }
}

/// A change to a host's row ([`Catalog::change_host`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HostChange<'a> {
    /// Where it lives (passwords already taken off).
    Address { address: &'a str, peer: &'a str },
    /// Its state.
    State(HostState),
}

/// A dedicated connection `LISTEN`ing on [`MAP_CHANNEL`].
#[derive(Debug)]
pub struct MapListener {
    _client: Client,
    versions: tokio::sync::mpsc::UnboundedReceiver<i64>,
}

impl MapListener {
    /// Opens a connection of its own to the catalog at `url` and `LISTEN`s on it, the
    /// whole within the URL's connect timeout (per address, plus one). Versions
    /// announced from then on can be read with [`MapListener::next`].
    ///
    /// # Errors
    ///
    /// As [`connect`]; [`Error::Catalog`] when `LISTEN` fails, [`Error::CatalogTimeout`]
    /// when it gets no answer (a pooler that holds it waiting for a server).
    pub async fn start(url: &DbUrl) -> Result<MapListener> {
        use futures::StreamExt as _;
        let (config, tls) = pg_config_tls(url, "catalog")?;
        let after = startup_budget(&config);
        let (client, mut connection) = tokio::time::timeout(after, config.connect(tls))
            .await
            .map_err(|_| Error::ConnectTimeout { target: "catalog".to_owned(), after })?
            .map_err(|source| connect_error("catalog", source))?;
        let (tx, versions) = tokio::sync::mpsc::unbounded_channel();
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        let task = tokio::spawn(async move {
            while let Some(message) = messages.next().await {
                match message {
                    Ok(tokio_postgres::AsyncMessage::Notification(n)) if n.channel() == MAP_CHANNEL => {
                        if let Ok(v) = n.payload().parse::<i64>()
                            && tx.send(v).is_err()
                        {
                            break;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "catalog listener ended");
                        break;
                    }
                }
            }
        });
        let listened = tokio::time::timeout(after, client.batch_execute(&format!("LISTEN {MAP_CHANNEL}")))
            .await
            .map_err(|_| Error::CatalogTimeout { after })
            .and_then(|r| r.map_err(|e| Error::catalog("LISTEN for map changes", e)));
        if let Err(e) = listened {
            // The connection's task holds the socket while a reply is pending: ended here.
            task.abort();
            return Err(e);
        }
        Ok(MapListener { _client: client, versions })
    }

    /// Whether the connection has ended (then [`MapListener::next`] returns `None` at
    /// once; start a new listener).
    pub fn is_closed(&self) -> bool {
        self.versions.is_closed() && self.versions.is_empty()
    }

    /// The next announced map version, or `None` after `timeout` or when the
    /// connection has ended.
    pub async fn next(&mut self, timeout: Duration) -> Option<i64> {
        tokio::time::timeout(timeout, self.versions.recv()).await.ok().flatten()
    }
}
