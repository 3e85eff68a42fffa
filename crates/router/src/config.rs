//! The configuration file operators write (TOML), validated when it is loaded.
//!
//! ```toml
//! logical_shards = 2000            # default 2000; 1..=8192 (13 bits)
//! schema_prefix  = "shard_"        # schemas shard_0000 .. shard_1999
//! migrations     = "migrations"    # .sql files applied to every shard schema, in file-name order
//! app_roles      = ["app"]         # default []; roles granted the request path's privileges
//! transaction_pooler = true        # when hosts' URLs go through a transaction-mode pooler
//!                                  # (PgBouncer pool_mode = transaction); false: direct or a
//!                                  # session pool; left out: found out on each connection
//!
//! [id]
//! epoch_ms = 1314220021721         # default: Instagram's
//! minter = "plpgsql"               # each shard's next_id(): "plpgsql" (default, any
//!                                  # Postgres) or "native" (C; the library on every host)
//!
//! [catalog]
//! url = "postgres://shardline@catalog:5432/shardline"
//! # listen_url = "..."             # the LISTEN connection; default: url. Direct, or a
//! #                                # session-mode pool: never a transaction-mode pooler
//!
//! [[hosts]]
//! name = "pg1"
//! url_env = "PG1_URL"              # or url = "postgres://app:${PG1_PASSWORD}@pg1:5432/app"
//! # peer_url = "..."               # how other hosts reach this one (moves); default: url
//! ```
//!
//! TLS is asked for in the URL, as with libpq: `?sslmode=verify-full&sslrootcert=ca.pem`
//! (see [`crate::tls`]). A `peer_url` is handed to PostgreSQL as it is, so its
//! `sslrootcert` is a path on the host that connects, and so is libpq's `passfile`
//! (`?passfile=/path`, or `passfile=/path` in key/value form): with it, the password is
//! in neither this file nor the target's `pg_subscription`.
//!
//! Unknown keys are refused. Every error names the file, the line and the key. Secrets
//! need not sit in the file: `*_env` keys take a whole URL from the environment, and
//! `${VAR}` inside a URL is replaced from it. URLs print with their password redacted.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use shardline_id::Layout;
use shardline_id::sql::Minter;
use toml::Spanned;

use crate::{Error, HostName, Result, RoleName, SchemaPrefix, ShardCount};

/// The default number of logical shards, as Instagram had.
pub const DEFAULT_LOGICAL_SHARDS: i64 = 2000;

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// How many logical shards (default 2000). Fixed for the life of the cluster.
    pub logical_shards: ShardCount,
    /// The prefix of shard schema names (default `shard_`).
    pub schema_prefix: SchemaPrefix,
    /// The directory of `.sql` migrations applied to every shard schema (default
    /// `migrations`, relative to the config file's directory).
    pub migrations: PathBuf,
    /// The ID layout: Instagram's widths with the configured epoch.
    pub layout: Layout,
    /// Which `next_id()` `init`, `migrate` and moves install in each shard schema
    /// (`id.minter`; default PL/pgSQL). See `docs/ids.md`, "The native minter".
    pub minter: Minter,
    /// The roles the application connects as (default none). `init`, `migrate` and
    /// `move` grant each of them exactly the request path's privileges on every shard
    /// schema they build or change, and read access to the catalog (see
    /// `docs/operations.md`, "Grants"). Each must exist on every host and on the
    /// catalog's server (roles are per server). Distinct, each a [`RoleName`].
    pub app_roles: Vec<RoleName>,
    /// The catalog database.
    pub catalog: DbUrl,
    /// Where the catalog's `LISTEN` for map changes connects (`catalog.listen_url`;
    /// default `None`: the catalog's URL). It must reach Postgres directly or through a
    /// session-mode pool: through a transaction-mode pooler `LISTEN` succeeds but no
    /// notification ever arrives.
    pub listen_url: Option<DbUrl>,
    /// Whether the hosts' URLs reach Postgres through a transaction-mode pooler
    /// (PgBouncer's `pool_mode = transaction`): `Some(true)` they do, `Some(false)` they
    /// reach it directly or through a session-mode pool, `None` (the key left out) each
    /// host is found out when connected to. See `docs/operations.md`, "Behind
    /// PgBouncer".
    pub transaction_pooler: Option<bool>,
    /// The physical hosts this config names, in the order `init` first places shards
    /// on them (default none). An application may list none and learn every host's
    /// address from the catalog (see [`Credentials`]); a host it lists is reached at
    /// the URL given here, whatever the catalog says (a local pooler, another network
    /// path).
    pub hosts: Vec<HostConfig>,
    /// Where the passwords of hosts known only by their catalog address come from
    /// (`[credentials]`; default: none, the servers need none).
    pub credentials: Credentials,
}

/// Where passwords come from for hosts whose address is read from the catalog (which
/// holds no secret). At most one of the two; an application that fetches passwords
/// elsewhere (a secrets manager) implements the repository's `Credentials` trait
/// instead.
///
/// ```toml
/// [credentials]
/// password_env = "SHARDLINE_{host}_PASSWORD"   # {host}: the host's name, upper-cased,
///                                              # anything not A-Z 0-9 as _
/// # passfile = "/etc/shardline/pgpass"         # libpq's format: host:port:db:user:password
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Credentials {
    /// No password is sent (trust, certificates, or a passfile the driver does not
    /// read: none).
    #[default]
    None,
    /// Each host's password is the environment variable this template names, read when
    /// the host's pool is made: `{host}` stands for the host's name, upper-cased, with
    /// every character other than `A`-`Z` and `0`-`9` as `_`.
    PasswordEnv(String),
    /// A file in libpq's passfile format (`host:port:database:user:password` lines,
    /// `*` for any, `#` comments), read when a host's pool is made.
    Passfile(PathBuf),
}

impl Credentials {
    /// The environment variable `template` names for host `name`.
    pub fn env_var(template: &str, name: &HostName) -> String {
        template.replace("{host}", &name.env_form())
    }
}

/// One physical host.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Its name in the catalog.
    pub name: HostName,
    /// How shardline reaches it.
    pub url: DbUrl,
    /// How the other hosts reach it (logical replication during moves); default `url`.
    pub peer_url: DbUrl,
}

/// A connection URL. It prints (and debugs) with its password replaced by `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct DbUrl(String);

impl DbUrl {
    /// Wraps a URL.
    pub fn new(url: String) -> Self {
        DbUrl(url)
    }

    /// The URL without its password (what the catalog may record), and the password
    /// when it had one: the `user:password@` of the URL form (percent-decoded), or a
    /// `password` key of the URL's query or of the key/value form.
    pub fn split_password(&self) -> (DbUrl, Option<String>) {
        let (bare, mut all) = self.split_passwords();
        (bare, if all.is_empty() { None } else { Some(all.swap_remove(0)) })
    }

    /// As [`DbUrl::split_password`], with every password found (a URL may hold one in
    /// its user part and another as a parameter), in order.
    fn split_passwords(&self) -> (DbUrl, Vec<String>) {
        let url = &self.0;
        if let Some((scheme, rest)) = url_form(url) {
            let (authority, tail) = match rest.find(['/', '?']) {
                Some(i) => rest.split_at(i),
                None => (rest, ""),
            };
            let mut password = Vec::new();
            let authority = match authority.rfind('@') {
                Some(at) => {
                    let (userinfo, host) = authority.split_at(at);
                    match userinfo.split_once(':') {
                        Some((user, pw)) => {
                            password.push(percent_decode(pw));
                            if user.is_empty() {
                                host.trim_start_matches('@').to_owned()
                            } else {
                                format!("{user}{host}")
                            }
                        }
                        // An empty user is no user.
                        None if userinfo.is_empty() => host.trim_start_matches('@').to_owned(),
                        None => authority.to_owned(),
                    }
                }
                None => authority.to_owned(),
            };
            let tail = match tail.split_once('?') {
                Some((path, query)) => {
                    let mut kept = Vec::new();
                    for kv in query.split('&') {
                        match kv.split_once('=') {
                            Some((k, v)) if is_password_key(k) => {
                                password.push(percent_decode(v));
                            }
                            _ if kv.is_empty() => {}
                            _ => kept.push(kv),
                        }
                    }
                    if kept.is_empty() { path.to_owned() } else { format!("{path}?{}", kept.join("&")) }
                }
                None => tail.to_owned(),
            };
            return (DbUrl(format!("{scheme}://{authority}{tail}")), password);
        }
        // Parsed as libpq parses it; a string it cannot parse is left whole (and the
        // catalog refuses to record what still holds a password: see the repository's
        // `Catalog::add_host`).
        let Ok(pairs) = crate::tls::key_values(url) else { return (self.clone(), Vec::new()) };
        let mut password = Vec::new();
        let mut kept = Vec::new();
        for (k, v) in pairs {
            if is_password_key(&k) {
                password.push(v);
            } else {
                kept.push(format!("{k}={}", quote_value(&v)));
            }
        }
        (DbUrl(kept.join(" ")), password)
    }

    /// This URL without the parameters named `keys` (case-insensitive): a URL's query
    /// parameters, a key/value string's pairs (one it cannot parse is left whole).
    pub fn without_keys(&self, keys: &[&str]) -> DbUrl {
        let drop = |k: &str| keys.iter().any(|d| d.eq_ignore_ascii_case(k));
        if url_form(&self.0).is_some() {
            let Some((base, query)) = self.0.split_once('?') else { return self.clone() };
            let kept: Vec<&str> =
                query.split('&').filter(|kv| !drop(kv.split_once('=').map_or(*kv, |(k, _)| k))).collect();
            return DbUrl(if kept.is_empty() {
                base.to_owned()
            } else {
                format!("{base}?{}", kept.join("&"))
            });
        }
        let Ok(pairs) = crate::tls::key_values(&self.0) else { return self.clone() };
        DbUrl(
            pairs
                .into_iter()
                .filter(|(k, _)| !drop(k))
                .map(|(k, v)| format!("{k}={}", quote_value(&v)))
                .collect::<Vec<_>>()
                .join(" "),
        )
    }

    /// The password this URL holds, as it may appear in a message: decoded, and
    /// percent-encoded (empty when it holds none).
    pub fn password_spellings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for p in self.split_passwords().1.into_iter().filter(|p| !p.is_empty()) {
            let encoded = percent_encode(&p);
            if encoded != p {
                out.push(encoded);
            }
            out.push(p);
        }
        out
    }

    /// This URL with `password` (which must have none: see [`DbUrl::split_password`]).
    pub fn with_password(&self, password: &str) -> DbUrl {
        let url = &self.0;
        if let Some((scheme, rest)) = url_form(url) {
            let end = rest.find(['/', '?']).unwrap_or(rest.len());
            let (authority, tail) = rest.split_at(end);
            let encoded = percent_encode(password);
            return match authority.rfind('@') {
                Some(at) if at > 0 => {
                    DbUrl(format!("{scheme}://{}:{encoded}{}{tail}", &authority[..at], &authority[at..]))
                }
                // No user: the driver's default user, and the password as a parameter
                // (an empty user before `:` would be sent as the user name "").
                _ => {
                    let authority = authority.trim_start_matches('@');
                    let sep = if tail.contains('?') { '&' } else { '?' };
                    DbUrl(format!("{scheme}://{authority}{tail}{sep}password={encoded}"))
                }
            };
        }
        DbUrl(format!("{url} password={}", quote_value(password)))
    }

    /// The URL with its secret, for the driver only. Never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with any password replaced by `***`.
    pub fn redacted(&self) -> String {
        redact(&self.0)
    }

    /// What the URL asks of TLS (`sslmode`, `sslrootcert`), and the URL without those
    /// keys for the driver. See [`crate::tls`].
    ///
    /// # Errors
    ///
    /// A message naming the key that is wrong (never the URL).
    pub fn tls(&self) -> std::result::Result<crate::tls::TlsParams, String> {
        crate::tls::parse(&self.0)
    }
}

impl fmt::Debug for DbUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DbUrl({:?})", self.redacted())
    }
}

impl fmt::Display for DbUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// Replaces the password of a `scheme://user:password@host` URL, and the value of any
/// `password=` key of a key/value connection string, by `***`.
pub fn redact(url: &str) -> String {
    if url_form(url).is_some() {
        return redact_url(url);
    }
    // Parsed as libpq does, so that a quoted password with spaces is hidden whole; a
    // URL inside (a mistyped scheme, a value) loses its password too. What cannot be
    // parsed is not shown at all.
    let Ok(pairs) = crate::tls::key_values(url) else { return "***".to_owned() };
    pairs
        .into_iter()
        .map(|(k, v)| {
            if is_secret_key(&k) {
                format!("{}=***", mask_userinfo(&k))
            } else {
                format!("{}={}", mask_userinfo(&k), quote_value(&mask_userinfo(&v)))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A connection string in URL form (`postgres://` or `postgresql://`, as libpq
/// decides), split after its scheme; `None` for the key/value form. The one place the
/// two forms are told apart.
pub(crate) fn url_form(s: &str) -> Option<(&str, &str)> {
    ["postgres://", "postgresql://"]
        .iter()
        .find_map(|scheme| s.strip_prefix(scheme).map(|rest| (&scheme[..scheme.len() - 3], rest)))
}

/// Refuses a URL whose parts the drivers would tell apart differently: the repository's
/// driver ends the user and password at the URL's first `@` wherever it is, libpq at an
/// `@` before the first `/`, sqlx at the last `@` before the first `/`, `?` or `#`. So a
/// `/`, `?` or `#` before the first `@` (an unencoded one in a password, or an `@` in a
/// query with no user part), or a second `@` before the path, makes one URL name
/// different hosts, users, passwords or TLS settings to each: `?sslmode=require` after
/// a `?` in a password was read by shardline as a query the driver never saw. The
/// message names the characters, never the URL (it may hold a password).
pub(crate) fn check_url_parts(url: &str) -> std::result::Result<(), String> {
    let Some((_, rest)) = url_form(url) else { return Ok(()) };
    let Some(at) = rest.find('@') else { return Ok(()) };
    let (user_part, after) = rest.split_at(at);
    let host_part = &after[1..after.find(['/', '?']).unwrap_or(after.len())];
    if user_part.contains(['/', '?', '#']) || host_part.contains('@') {
        return Err("the URL's user or password holds '/', '?', '#' or '@', or its path or query holds \
                    an '@' with no user part before it: the drivers read such a URL differently \
                    (percent-encode them: %2F, %3F, %23, %40)"
            .into());
    }
    Ok(())
}

/// A key/value connection string's value, quoted when it must be.
fn quote_value(v: &str) -> String {
    if !v.is_empty() && !v.chars().any(|c| c.is_whitespace() || c == '\'' || c == '\\') {
        return v.to_owned();
    }
    format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// `value`, put at byte `offset` of the template `text` (where its `${` was), as
/// [`Source::expand`] puts it: as it is, unless it would not read back as that one
/// value there.
fn fitted(text: &str, offset: usize, value: &str) -> String {
    let before = &text[..offset];
    if let Some((_, rest)) = url_form(text) {
        let from = text.len() - rest.len();
        let authority_end = from + rest.find(['/', '?']).unwrap_or(rest.len());
        // Where the template's own (literal) characters put the variable.
        let user_part = offset < authority_end && text[offset..authority_end].contains('@');
        let query_value = before.rfind('?').is_some_and(|q| {
            let param = &before[q + 1..];
            let param = param.rsplit('&').next().unwrap_or(param);
            param.contains('=')
        });
        if user_part {
            // The user's name is what comes before the first `:`: one put with the
            // password (`${CREDS}`) keeps it.
            let in_password = text[from..offset].contains(':');
            return percent_encode_but(value, if in_password { b"" } else { b":" });
        }
        if query_value {
            return percent_encode(value);
        }
        return value.to_owned();
    }
    // Key/value: where the template's quotes and `=` put the variable.
    let (mut quoted, mut escaped) = (false, false);
    for c in before.chars() {
        if escaped {
            escaped = false;
            continue;
        }
        match c {
            '\\' if quoted => escaped = true,
            '\'' => quoted = !quoted,
            _ => {}
        }
    }
    if quoted {
        return value.replace('\\', "\\\\").replace('\'', "\\'");
    }
    if before.trim_end().ends_with('=') {
        return quote_value(value);
    }
    value.to_owned()
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn percent_encode(s: &str) -> String {
    percent_encode_but(s, b"")
}

/// Percent-encodes everything but RFC 3986's unreserved characters and `keep`.
fn percent_encode_but(s: &str, keep: &[u8]) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') || keep.contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decodes `%XX` escapes (a malformed one is kept as written).
fn percent_decode(s: &str) -> String {
    crate::tls::percent_decode(s).unwrap_or_else(|_| s.to_owned())
}

/// `scheme://user:password@host...` (any scheme) with the password as `***`; the last
/// `@` counts, so a password holding `@`, `/` or `?` is hidden whole (and then some).
fn mask_userinfo(s: &str) -> String {
    let Some((scheme, rest)) = s.split_once("://") else { return s.to_owned() };
    let Some(at) = rest.rfind('@') else { return s.to_owned() };
    let (userinfo, host) = rest.split_at(at);
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***{host}"),
        None => s.to_owned(),
    }
}

/// Whether a connection string's key names the password: as the driver reads it, a
/// URL's key percent-decoded (`pass%77ord` is `password`), in any case. The one test of
/// it, for splitting a password off and for redacting one.
fn is_password_key(k: &str) -> bool {
    percent_decode(k).eq_ignore_ascii_case("password")
}

/// Whether a connection string's key names a secret to hide when it is shown: the
/// password, or libpq's passphrase of the client key (`sslpassword`), decoded as
/// [`is_password_key`] decodes.
fn is_secret_key(k: &str) -> bool {
    // As a URL parser that drops tabs and line breaks reads it (sqlx's does).
    let k: String = percent_decode(k).chars().filter(|c| !matches!(c, '\t' | '\r' | '\n')).collect();
    is_password_key(&k) || k.eq_ignore_ascii_case("sslpassword")
}

/// A URL with its secrets as `***`: the user's password (as [`mask_userinfo`] finds it,
/// up to the last `@`), and the value of every parameter whose key names a secret, up
/// to the next `&` (as the drivers read a value: a `?` or an `@` in it is part of it).
/// Every `?` and `&` in the text is taken to start a parameter, not only those after
/// the query's first `?`: a parser may read the query from another `?` than this does.
/// The spans are found in the URL as given and hidden together, so that one cannot
/// hide where another begins.
fn redact_url(url: &str) -> String {
    let mut spans: Vec<(usize, usize)> = Vec::new();
    if let Some(scheme_end) = url.find("://").map(|i| i + 3)
        && let Some(at) = url[scheme_end..].rfind('@').map(|i| i + scheme_end)
        && let Some(colon) = url[scheme_end..at].find(':').map(|i| i + scheme_end)
    {
        spans.push((colon + 1, at));
    }
    for (i, c) in url.char_indices() {
        if c != '?' && c != '&' {
            continue;
        }
        let rest = &url[i + 1..];
        let Some(eq) = rest.find(['=', '&']).filter(|&e| rest[e..].starts_with('=')) else { continue };
        if !is_secret_key(&rest[..eq]) {
            continue;
        }
        let start = i + 1 + eq + 1;
        let end = url[start..].find('&').map_or(url.len(), |e| start + e);
        spans.push((start, end));
    }
    spans.sort_unstable();
    let mut out = String::with_capacity(url.len());
    let mut at = 0;
    for (start, end) in spans {
        if end <= at {
            continue;
        }
        // A span that begins inside (or right at the end of) the one before extends
        // it: its `***` is written.
        if start > at || at == 0 {
            out.push_str(&url[at..start.max(at)]);
            out.push_str("***");
        }
        at = end;
    }
    out.push_str(&url[at..]);
    out
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
struct RawConfig {
    logical_shards: Option<Spanned<i64>>,
    schema_prefix: Option<Spanned<String>>,
    migrations: Option<Spanned<String>>,
    app_roles: Option<Vec<Spanned<String>>>,
    transaction_pooler: Option<bool>,
    id: Option<RawId>,
    catalog: Option<Spanned<RawUrl>>,
    credentials: Option<Spanned<RawCredentials>>,
    hosts: Option<Spanned<Vec<Spanned<RawHost>>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
struct RawCredentials {
    password_env: Option<Spanned<String>>,
    passfile: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
struct RawId {
    epoch_ms: Option<Spanned<i64>>,
    minter: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
struct RawUrl {
    url: Option<Spanned<String>>,
    url_env: Option<Spanned<String>>,
    listen_url: Option<Spanned<String>>,
    listen_url_env: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
struct RawHost {
    name: Option<Spanned<String>>,
    url: Option<Spanned<String>>,
    url_env: Option<Spanned<String>>,
    peer_url: Option<Spanned<String>>,
    peer_url_env: Option<Spanned<String>>,
}

struct Source<'a> {
    file: &'a str,
    text: &'a str,
    env: &'a dyn Fn(&str) -> Option<String>,
}

impl Source<'_> {
    fn line(&self, offset: usize) -> usize {
        self.text.get(..offset).map_or(1, |t| t.bytes().filter(|&b| b == b'\n').count() + 1)
    }

    fn err(&self, offset: usize, key: &str, message: impl Into<String>) -> Error {
        Error::Config {
            file: self.file.to_owned(),
            line: self.line(offset),
            key: key.to_owned(),
            message: message.into(),
        }
    }

    /// The ID layout of the `[id]` table: Instagram's widths with its epoch, which
    /// may not be after now.
    fn layout(&self, id: Option<RawId>) -> Result<Layout> {
        let src = self;
        let epoch = id.and_then(|id| id.epoch_ms);
        Ok(match epoch {
            None => Layout::INSTAGRAM,
            Some(e) => {
                let at = e.span().start;
                let layout = Layout::INSTAGRAM
                    .with_epoch(*e.get_ref())
                    .map_err(|err| src.err(at, "id.epoch_ms", err.to_string()))?;
                // Minting refuses a clock before the epoch in Rust, but the database's
                // minter would hand out IDs dated at the epoch: refuse it here.
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
                if layout.epoch_ms() > now {
                    return Err(src.err(
                        at,
                        "id.epoch_ms",
                        format!(
                            "{} is after now ({now} ms since 1970): every ID would carry a time from \
                             the future (the epoch is in milliseconds, not microseconds)",
                            layout.epoch_ms()
                        ),
                    ));
                }
                layout
            }
        })
    }

    /// The minter of the `[id]` table (`minter`; default PL/pgSQL).
    fn minter(&self, id: Option<&RawId>) -> Result<Minter> {
        match id.and_then(|id| id.minter.as_ref()) {
            None => Ok(Minter::default()),
            Some(m) => Minter::from_name(m.get_ref()).ok_or_else(|| {
                self.err(
                    m.span().start,
                    "id.minter",
                    format!("{:?} is not a minter: expected \"plpgsql\" or \"native\"", m.get_ref()),
                )
            }),
        }
    }

    /// `url` or `url_env` (exactly one), with `${VAR}` expanded (see [`Self::expand`]).
    fn url(
        &self,
        at: usize,
        key: &str,
        url: Option<Spanned<String>>,
        url_env: Option<Spanned<String>>,
    ) -> Result<Option<DbUrl>> {
        match (url, url_env) {
            (Some(_), Some(e)) => Err(self.err(
                e.span().start,
                &format!("{key}_env"),
                format!("give {key} or {key}_env, not both"),
            )),
            (None, None) => Ok(None),
            (None, Some(e)) => {
                let var = e.get_ref();
                (self.env)(var).filter(|v| !v.is_empty()).map(|v| Some(DbUrl(v))).ok_or_else(|| {
                    // Never named: a URL put here by mistake carries its password, and
                    // a password of letters and digits would read as a name. The line
                    // and the key say where it is.
                    let said = if is_env_name(var) {
                        "names an environment variable that is not set".to_owned()
                    } else {
                        "must name an environment variable (ASCII letters, digits and _), not hold a value"
                            .to_owned()
                    };
                    self.err(e.span().start, &format!("{key}_env"), said)
                })
            }
            (Some(u), None) => self.expand(u.span().start, key, u.get_ref()).map(|u| Some(DbUrl(u))),
        }
        .map_err(|e| if let Error::Config { .. } = e { e } else { self.err(at, key, e.to_string()) })
    }

    /// `text` with each `${VAR}` replaced by the variable's value. A value is what it
    /// holds, not encoded: put in a URL's user part or a parameter's value it is
    /// percent-encoded (before, a password holding `@` moved the host, and one holding
    /// `%41` read as another); after a key/value string's `=` it is quoted when it
    /// must be, and escaped inside quotes the string has. A variable put anywhere else
    /// (the whole string, the host, the path, a run of parameters) is URL or key/value
    /// syntax of its own, and goes in as it is.
    fn expand(&self, at: usize, key: &str, text: &str) -> Result<String> {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        let mut nth = 0;
        while let Some(start) = rest.find("${") {
            nth += 1;
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let end = after.find('}').ok_or_else(|| self.err(at, key, "an unclosed ${ in the URL"))?;
            let var = &after[..end];
            let value = (self.env)(var).ok_or_else(|| {
                // Never named (`${PW:-secret}` holds a value, and so may what reads
                // as a name): counted.
                let said = if is_env_name(var) {
                    format!("${{...}} number {nth} names an environment variable that is not set")
                } else {
                    "a ${...} in the URL must name an environment variable (ASCII letters, digits and _)"
                        .to_owned()
                };
                self.err(at, key, said)
            })?;
            let offset = text.len() - rest.len() + start;
            out.push_str(&fitted(text, offset, &value));
            rest = &after[end + 1..];
        }
        out.push_str(rest);
        if out.trim().is_empty() {
            return Err(self.err(at, key, "is empty"));
        }
        Ok(out)
    }
}

impl Config {
    /// The ID layout a config's TOML `text` gives (its `[id]` table), read without the
    /// rest of the file (its URLs and the variables they name): what decoding an ID
    /// needs, and nothing more. `file` names it in errors.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the file, line and key: text that is not TOML, an
    /// `[id]` table with an unknown key, an epoch out of range or after now.
    pub fn layout_from_toml(text: &str, file: &str) -> Result<Layout> {
        Ok(Self::id_from_toml(text, file)?.0)
    }

    /// The ID layout and the minter a config's TOML `text` gives (its `[id]` table), read
    /// as [`Config::layout_from_toml`] reads it.
    ///
    /// # Errors
    ///
    /// As [`Config::layout_from_toml`], and a minter other than `plpgsql` or `native`.
    pub fn id_from_toml(text: &str, file: &str) -> Result<(Layout, Minter)> {
        #[derive(Deserialize)]
        struct OnlyId {
            id: Option<RawId>,
        }
        let src = Source { file, text, env: &|_| None };
        let raw: OnlyId = toml::from_str(text).map_err(|e| {
            let offset = e.span().map_or(0, |s| s.start);
            src.err(offset, "toml", without_values(e.message().trim()))
        })?;
        let minter = src.minter(raw.id.as_ref())?;
        Ok((src.layout(raw.id)?, minter))
    }

    /// Reads a configuration from TOML `text`. `file` names it in errors; relative
    /// paths in it are relative to `base_dir`; `env` looks up environment variables.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the file, line and key: unknown keys, wrong types,
    /// missing keys, values out of range, duplicate host names, unset variables.
    pub fn from_toml(
        text: &str,
        file: &str,
        base_dir: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config> {
        let src = Source { file, text, env };
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            let offset = e.span().map_or(0, |s| s.start);
            src.err(offset, "toml", without_values(e.message().trim()))
        })?;

        let logical_shards = match raw.logical_shards {
            None => ShardCount::new(DEFAULT_LOGICAL_SHARDS)?,
            Some(n) => ShardCount::new(*n.get_ref()).map_err(|_| {
                src.err(n.span().start, "logical_shards", format!("{} is out of range 1..=8192", n.get_ref()))
            })?,
        };
        let schema_prefix = match raw.schema_prefix {
            None => SchemaPrefix::default(),
            Some(p) => SchemaPrefix::new(p.get_ref())
                .map_err(|e| src.err(p.span().start, "schema_prefix", strip_name(&e)))?,
        };
        let migrations = match raw.migrations {
            None => base_dir.join("migrations"),
            Some(m) if m.get_ref().trim().is_empty() => {
                return Err(src.err(m.span().start, "migrations", "is empty"));
            }
            Some(m) => base_dir.join(m.get_ref()),
        };
        let mut app_roles: Vec<RoleName> = Vec::new();
        for (i, r) in raw.app_roles.unwrap_or_default().into_iter().enumerate() {
            let key = format!("app_roles[{i}]");
            let role =
                RoleName::new(r.get_ref()).map_err(|e| src.err(r.span().start, &key, strip_name(&e)))?;
            if let Some(first) = app_roles.iter().position(|o| *o == role) {
                return Err(src.err(r.span().start, &key, format!("{role} is already app_roles[{first}]")));
            }
            app_roles.push(role);
        }
        let minter = src.minter(raw.id.as_ref())?;
        let layout = src.layout(raw.id)?;
        let listen_url;
        let catalog = match raw.catalog {
            None => {
                return Err(src.err(
                    text.len(),
                    "catalog",
                    "missing: add a [catalog] table with url or url_env",
                ));
            }
            Some(c) => {
                let at = c.span().start;
                let c = c.into_inner();
                let url = src
                    .url(at, "catalog.url", c.url, c.url_env)?
                    .ok_or_else(|| src.err(at, "catalog", "needs url or url_env"))?;
                url.tls().map_err(|m| src.err(at, "catalog.url", m))?;
                listen_url = src.url(at, "catalog.listen_url", c.listen_url, c.listen_url_env)?;
                if let Some(l) = &listen_url {
                    l.tls().map_err(|m| src.err(at, "catalog.listen_url", m))?;
                }
                url
            }
        };
        let credentials = match raw.credentials {
            None => Credentials::None,
            Some(c) => {
                let at = c.span().start;
                let c = c.into_inner();
                match (c.password_env, c.passfile) {
                    (Some(_), Some(p)) => {
                        return Err(src.err(
                            p.span().start,
                            "credentials.passfile",
                            "give password_env or passfile, not both",
                        ));
                    }
                    (Some(t), None) => {
                        let template = t.get_ref();
                        let ok = template.contains("{host}")
                            && template
                                .replace("{host}", "")
                                .chars()
                                .all(|c| c.is_ascii_alphanumeric() || c == '_');
                        if !ok {
                            return Err(src.err(
                                t.span().start,
                                "credentials.password_env",
                                // Not echoed: a password put here by mistake.
                                "must name an environment variable with {host} in it \
                                 (letters, digits and _ around it), as SHARDLINE_{host}_PASSWORD"
                                    .to_owned(),
                            ));
                        }
                        Credentials::PasswordEnv(template.clone())
                    }
                    (None, Some(p)) if p.get_ref().trim().is_empty() => {
                        return Err(src.err(p.span().start, "credentials.passfile", "is empty"));
                    }
                    (None, Some(p)) => Credentials::Passfile(base_dir.join(p.get_ref())),
                    (None, None) => {
                        return Err(src.err(at, "credentials", "needs password_env or passfile"));
                    }
                }
            }
        };
        let raw_hosts = raw.hosts.map(Spanned::into_inner).unwrap_or_default();
        let mut hosts: Vec<HostConfig> = Vec::new();
        for (i, h) in raw_hosts.into_iter().enumerate() {
            let at = h.span().start;
            let h = h.into_inner();
            let key = |k: &str| format!("hosts[{i}].{k}");
            let name = h.name.ok_or_else(|| src.err(at, &key("name"), "missing"))?;
            let host_name = HostName::new(name.get_ref())
                .map_err(|e| src.err(name.span().start, &key("name"), strip_name(&e)))?;
            if let Some(first) = hosts.iter().position(|o| o.name == host_name) {
                return Err(src.err(
                    name.span().start,
                    &key("name"),
                    format!("{host_name} is already the name of hosts[{first}]"),
                ));
            }
            let url = src
                .url(at, &key("url"), h.url, h.url_env)?
                .ok_or_else(|| src.err(at, &key("url"), "missing: give url or url_env"))?;
            url.tls().map_err(|m| src.err(at, &key("url"), m))?;
            let peer_url = match src.url(at, &key("peer_url"), h.peer_url, h.peer_url_env)? {
                Some(p) => {
                    check_url_parts(p.expose()).map_err(|m| src.err(at, &key("peer_url"), m))?;
                    p
                }
                None => url.clone(),
            };
            hosts.push(HostConfig { name: host_name, url, peer_url });
        }
        Ok(Config {
            logical_shards,
            schema_prefix,
            migrations,
            layout,
            minter,
            app_roles,
            catalog,
            listen_url,
            transaction_pooler: raw.transaction_pooler,
            hosts,
            credentials,
        })
    }

    /// The first placement of the shards: contiguous, even ranges over the hosts in
    /// config order.
    ///
    /// # Errors
    ///
    /// When the config names no host (the map needs at least one).
    pub fn even_map(&self) -> Result<crate::ShardMap> {
        crate::ShardMap::even(self.logical_shards, self.hosts.iter().map(|h| h.name.clone()).collect())
    }

    /// The config entry of host `name`.
    pub fn host(&self, name: &HostName) -> Option<&HostConfig> {
        self.hosts.iter().find(|h| &h.name == name)
    }
}

/// The reason part of an [`Error::InvalidName`] (the key already names the field).
fn strip_name(e: &Error) -> String {
    match e {
        Error::InvalidName { name, reason, .. } => format!("{name:?} is not allowed: {reason}"),
        other => other.to_string(),
    }
}

/// Whether `s` can name an environment variable: ASCII letters, digits and `_`.
fn is_env_name(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A TOML parser's message with every double-quoted value taken out (`invalid type:
/// string "postgres://u:pw@h/db"` quotes what it refused, which may be a URL with its
/// password); names are quoted with backticks and stay.
fn without_values(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(start) = rest.find("string \"") {
        out.push_str(&rest[..start]);
        let after = &rest[start + "string \"".len()..];
        // Up to the closing quote, past escaped ones.
        let mut end = None;
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = Some(i);
                    break;
                }
                _ => escaped = false,
            }
        }
        out.push_str("a string");
        match end {
            Some(i) => rest = &after[i + 1..],
            None => {
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_errors_never_echo_a_value() {
        let secret = "hunter2";
        let cases = [
            // A URL where the variable's name goes.
            GOOD.replace("url_env = \"PG1_URL\"", "url_env = \"postgres://app:hunter2@pg1/app\""),
            // A URL where a table goes (toml quotes the string it refuses).
            GOOD.replace(
                "[catalog]\nurl = \"postgres://shardline:${CATALOG_PASSWORD}@catalog:5432/shardline\"",
                "catalog = \"postgres://u:hunter2@h/db\"\n[x]\nurl = \"postgres://c/db\"",
            ),
            // A password where the template goes.
            format!("{GOOD}\n[credentials]\npassword_env = \"hunter2\"\n"),
            // A shell-style default inside `${...}`.
            GOOD.replace("${CATALOG_PASSWORD}", "${NOT_SET:-hunter2}"),
            // A password of letters and digits where the variable's name goes, and in
            // `${...}`: either reads as a name.
            GOOD.replace("url_env = \"PG1_URL\"", "url_env = \"hunter2\""),
            GOOD.replace("${CATALOG_PASSWORD}", "${hunter2}"),
        ];
        for text in cases {
            assert_ne!(text, GOOD, "the case changed the config");
            let err = load(&text).map(|_| ()).unwrap_err().to_string();
            assert!(!err.contains(secret), "the error shows the secret: {err}");
        }
        // A password given under a percent-encoded key (the driver decodes the key).
        let url = DbUrl::new("postgres://app@pg1/app?sslmode=disable&pass%77ord=hunter2".into());
        assert!(!url.redacted().contains(secret), "{}", url.redacted());
        assert!(!format!("{url:?}").contains(secret));
        let (bare, password) = url.split_password();
        assert_eq!(password.as_deref(), Some(secret));
        assert!(!bare.expose().contains(secret), "{}", bare.expose());
        let said = without_values("invalid type: string \"a:hunter2@c\", expected a table");
        assert_eq!(said, "invalid type: a string, expected a table");
    }

    const GOOD: &str = r#"
logical_shards = 2000
schema_prefix  = "shard_"
migrations     = "migrations"

[id]
epoch_ms = 1314220021721

[catalog]
url = "postgres://shardline:${CATALOG_PASSWORD}@catalog:5432/shardline"

[[hosts]]
name = "pg1"
url_env = "PG1_URL"

[[hosts]]
name = "pg2"
url = "postgres://app@pg2:5432/app"
peer_url = "postgres://app@10.0.0.2:5432/app"
"#;

    fn env(var: &str) -> Option<String> {
        match var {
            "CATALOG_PASSWORD" => Some("s3cret".into()),
            "PG1_URL" => Some("postgres://app:hunter2@pg1:5432/app".into()),
            _ => None,
        }
    }

    fn load(text: &str) -> Result<Config> {
        Config::from_toml(text, "shardline.toml", Path::new("/etc/shardline"), &env)
    }

    #[test]
    fn a_good_config_loads_and_hides_its_secrets() {
        let c = load(GOOD).unwrap();
        assert_eq!(c.logical_shards.get(), 2000);
        assert_eq!(c.migrations, Path::new("/etc/shardline/migrations"));
        assert_eq!(c.catalog.expose(), "postgres://shardline:s3cret@catalog:5432/shardline");
        assert_eq!(c.catalog.to_string(), "postgres://shardline:***@catalog:5432/shardline");
        assert_eq!(c.hosts[0].url.expose(), "postgres://app:hunter2@pg1:5432/app");
        assert_eq!(c.hosts[0].peer_url, c.hosts[0].url);
        assert_eq!(c.hosts[1].peer_url.expose(), "postgres://app@10.0.0.2:5432/app");
        let debug = format!("{c:?}");
        assert!(!debug.contains("s3cret") && !debug.contains("hunter2"), "{debug}");
    }

    #[test]
    fn a_variables_value_stays_the_part_it_was_put_in() {
        // A password holding what a URL or a key/value string gives meaning to: before,
        // put in as it was, its `@` made `evil.com` the host.
        let pw = "p@evil.com:5432/x?a=b&password=z #%'\\";
        let env = |var: &str| {
            Some(
                match var {
                    "PW" => pw,
                    "HOST" => "[::1]:5433",
                    "ENCODED" => "p%40ss",
                    "CREDS" => "app:s3cret",
                    "DSN" => "host=pg5 port=5433 dbname=app",
                    "EXTRA" => "sslmode=disable application_name=x",
                    "PARAMS" => "sslmode=disable&application_name=x",
                    "HOSTDB" => "pg8:5432/app",
                    _ => return None,
                }
                .to_owned(),
            )
        };
        let urls = [
            // A value that would change the URL: encoded, in the user part and in a
            // parameter's value; the host as given.
            (
                "a",
                "postgres://app:${PW}@pg1:5432/app?sslmode=disable",
                "postgres://app@pg1:5432/app?sslmode=disable",
                Some(pw),
            ),
            ("b", "postgres://app@${HOST}/db?password=${PW}", "postgres://app@[::1]:5433/db", Some(pw)),
            // Key/value: quoted after `=`, escaped inside quotes the text has.
            ("c", "host=pg2 user=app password=${PW}", "host=pg2 user=app", Some(pw)),
            ("d", "host=pg3 user=app password='${PW}'", "host=pg3 user=app", Some(pw)),
            // A value is what it holds: `%40` is three characters of a password. A user
            // and password together, a whole string, a run of pairs or parameters, a
            // host and path together go in as written.
            ("e", "postgres://app:${ENCODED}@pg4/app", "postgres://app@pg4/app", Some("p%40ss")),
            ("f", "postgres://${CREDS}@pg4/app", "postgres://app@pg4/app", Some("s3cret")),
            ("g", "${DSN}", "host=pg5 port=5433 dbname=app", None),
            ("h", "host=pg6 ${EXTRA}", "host=pg6 sslmode=disable application_name=x", None),
            (
                "i",
                "postgres://app@pg7/app?${PARAMS}",
                "postgres://app@pg7/app?sslmode=disable&application_name=x",
                None,
            ),
            ("j", "postgres://app@${HOSTDB}", "postgres://app@pg8:5432/app", None),
        ];
        let mut text = "[catalog]\nurl = \"postgres://c/db\"\n".to_owned();
        for (name, url, _, _) in &urls {
            text.push_str(&format!("[[hosts]]\nname = \"{name}\"\nurl = \"{url}\"\n"));
        }
        let c = Config::from_toml(&text, "shardline.toml", Path::new("/etc/shardline"), &env).unwrap();
        for (host, (name, _, bare, password)) in c.hosts.iter().zip(&urls) {
            let (got, got_password) = host.url.split_password();
            assert_eq!((got.expose(), got_password.as_deref()), (*bare, *password), "{name}");
            assert!(!host.url.to_string().contains("evil"), "{name}: {}", host.url);
        }
        // Inside quotes after other text: escaped, not quoted again.
        let text = "[catalog]\nurl = \"host=c user=app password='x${PW}'\"\n[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\n";
        let c = Config::from_toml(text, "shardline.toml", Path::new("/etc/shardline"), &env).unwrap();
        assert_eq!(c.catalog.split_password().1, Some(format!("x{pw}")));
    }

    #[test]
    fn a_passfile_in_peer_url_is_handed_on_as_written() {
        // libpq's passfile (read by the target's server, for the subscription) is a key
        // shardline neither reads nor refuses, in either form of connection string.
        let url_form = "postgresql://repl@10.0.0.1:5432/app?passfile=/var/lib/postgresql/shardline.pgpass&sslmode=require";
        let key_value = "host=10.0.0.2 port=5432 dbname=app user=repl passfile='/etc/pg pass'";
        let text = format!(
            "[catalog]\nurl = \"postgres://c/db\"\n\
             [[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\npeer_url = \"{url_form}\"\n\
             [[hosts]]\nname = \"b\"\nurl = \"postgres://b/db\"\npeer_url = \"{key_value}\"\n"
        );
        let c = load(&text).unwrap();
        assert_eq!(c.hosts[0].peer_url.expose(), url_form);
        assert_eq!(c.hosts[1].peer_url.expose(), key_value);
        assert_eq!(c.hosts[0].peer_url.to_string(), url_form, "no password, nothing redacted");
    }

    #[test]
    fn a_url_the_drivers_would_split_differently_is_refused_where_it_is() {
        // A `/` in a password: the repository's driver reads the password `ab/cd`, libpq
        // (the subscription's `peer_url`) a host `app` and a port `ab`, and shardline
        // found no password to hide in what it printed. Refused for every URL key,
        // naming the key and no part of the URL.
        for key in ["url", "peer_url"] {
            let text = format!(
                "[catalog]\nurl = \"postgres://c/db\"\n\
                 [[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\n{key} = \"postgres://app:ab/cd@pg1/app\"\n"
            );
            let text = text.replacen("url = \"postgres://a/db\"\nurl", "url", 1);
            let err = load(&text).unwrap_err().to_string();
            assert!(err.contains(&format!("hosts[0].{key}")) && err.contains("percent-encode"), "{err}");
            assert!(!err.contains("ab/cd") && !err.contains("cd@"), "{err}");
        }
        let text = "[catalog]\nurl = \"postgres://u:p?w@c/db\"\n[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\n";
        let err = load(text).unwrap_err().to_string();
        assert!(
            err.contains("catalog.url") && err.contains("percent-encode") && !err.contains("p?w"),
            "{err}"
        );
    }

    #[test]
    fn defaults_apply() {
        let c = load(
            "[catalog]\nurl = \"postgres://c/db\"\n[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\n",
        )
        .unwrap();
        assert_eq!(c.logical_shards.get(), 2000);
        assert_eq!(c.schema_prefix.as_str(), "shard_");
        assert_eq!(c.layout, Layout::INSTAGRAM);
        assert!(c.app_roles.is_empty());
        assert_eq!(c.transaction_pooler, None);
        assert_eq!(c.listen_url, None);
    }

    #[test]
    fn a_pooled_deployment_loads_and_its_mistakes_name_their_line() {
        let c = load(
            "transaction_pooler = true\n[catalog]\nurl = \"postgres://u:pw@bouncer/db\"\n\
             listen_url = \"postgres://u:pw@catalog/db\"\n[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\n",
        )
        .unwrap();
        assert_eq!(c.transaction_pooler, Some(true));
        assert_eq!(c.listen_url.as_ref().map(DbUrl::expose), Some("postgres://u:pw@catalog/db"));
        assert_eq!(c.listen_url.map(|u| u.to_string()).as_deref(), Some("postgres://u:***@catalog/db"));
        for (text, message) in [
            (
                "transaction_pooler = \"yes\"\n[catalog]\nurl = \"postgres://c/db\"\n[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\n",
                "shardline.toml:1: toml: invalid type: a string, expected a boolean",
            ),
            (
                "[catalog]\nurl = \"postgres://c/db\"\nlisten_url = \"postgres://c/db\"\nlisten_url_env = \"PG1_URL\"\n[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\n",
                "catalog.listen_url_env: give catalog.listen_url or catalog.listen_url_env, not both",
            ),
            (
                "[catalog]\nurl = \"postgres://c/db\"\nlisten_url = \"postgres://c/db?sslmode=on\"\n[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\n",
                "shardline.toml:1: catalog.listen_url: sslmode=\"on\" is not one of",
            ),
        ] {
            let err = load(text).unwrap_err().to_string();
            assert!(err.contains(message), "{text:?}: {err}");
        }
    }

    #[test]
    fn app_roles_load_in_order() {
        let c = load(&format!("app_roles = [\"app\", \"_reader2\"]\n{GOOD}")).unwrap();
        let names: Vec<&str> = c.app_roles.iter().map(RoleName::as_str).collect();
        assert_eq!(names, ["app", "_reader2"]);
        assert_eq!(c.app_roles[0].quoted(), "\"app\"");
    }

    #[test]
    fn app_role_mistakes_name_their_line_and_key() {
        let cases: &[(&str, &str)] = &[
            ("app_roles = \"app\"", "shardline.toml:2: toml: invalid type: a string, expected a sequence"),
            (
                "app_roles = [\"App\"]",
                "shardline.toml:2: app_roles[0]: \"App\" is not allowed: must start with a lowercase",
            ),
            (
                "app_roles = [\"a\", \"b-c\"]",
                "shardline.toml:2: app_roles[1]: \"b-c\" is not allowed: may hold only",
            ),
            (
                "app_roles = [\"a\\\"; DROP ROLE x; --\"]",
                "app_roles[0]: \"a\\\"; DROP ROLE x; --\" is not allowed",
            ),
            ("app_roles = [\"\"]", "app_roles[0]: \"\" is not allowed: must be 1 to 63 bytes"),
            (
                "app_roles = [\"pg_monitor\"]",
                "app_roles[0]: \"pg_monitor\" is not allowed: Postgres reserves",
            ),
            (
                "app_roles = [\"public\"]",
                "app_roles[0]: \"public\" is not allowed: Postgres reads it as a keyword",
            ),
            ("app_roles = [\"app\", \"app\"]", "shardline.toml:2: app_roles[1]: app is already app_roles[0]"),
            ("app_roles = [1]", "shardline.toml:2: toml: invalid type: integer `1`, expected a string"),
            ("app_role = [\"app\"]", "shardline.toml:2: toml: unknown field `app_role`"),
        ];
        for (extra, message) in cases {
            let err = load(&format!("\n{extra}\n{GOOD}")).unwrap_err().to_string();
            assert!(err.contains(message), "{extra:?}: {err}");
        }
        let long = "a".repeat(64);
        let err = load(&format!("app_roles = [\"{long}\"]\n{GOOD}")).unwrap_err().to_string();
        assert!(err.contains("must be 1 to 63 bytes"), "{err}");
        assert!(load(&format!("app_roles = [\"{}\"]\n{GOOD}", &long[..63])).is_ok());
    }

    #[test]
    fn every_mistake_names_its_line_and_key() {
        let cases: &[(&str, &str)] = &[
            ("logical_shards = 0", "shardline.toml:2: logical_shards: 0 is out of range 1..=8192"),
            ("logical_shards = 9000", "shardline.toml:2: logical_shards: 9000 is out of range"),
            ("logical_shards = \"many\"", "shardline.toml:2: toml: invalid type: a string, expected i64"),
            ("shards = 3", "shardline.toml:2: toml: unknown field `shards`"),
            ("schema_prefix = \"Shard-\"", "shardline.toml:2: schema_prefix: \"Shard-\" is not allowed"),
            ("schema_prefix = \"a;drop schema x;\"", "schema_prefix: \"a;drop schema x;\" is not allowed"),
        ];
        for (extra, message) in cases {
            let text = format!(
                "\n{extra}\n{}",
                GOOD.lines()
                    .filter(|l| !l.starts_with("logical_shards")
                        && !l.starts_with("schema_prefix")
                        && !l.starts_with("[id]")
                        && !l.starts_with("epoch_ms"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            let err = load(&text).unwrap_err().to_string();
            assert!(err.contains(message), "{extra:?}: {err}");
        }
    }

    #[test]
    fn tls_mistakes_name_their_line_and_key() {
        for (text, message) in [
            (
                "[catalog]\nurl = \"postgres://c/db?sslmode=verify-full\"\n[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\n",
                "shardline.toml:1: catalog.url: sslmode=verify-full needs sslrootcert",
            ),
            (
                "[catalog]\nurl = \"postgres://c/db\"\n[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db?sslmode=on\"\n",
                "shardline.toml:3: hosts[0].url: sslmode=\"on\" is not one of",
            ),
        ] {
            let err = load(text).unwrap_err().to_string();
            assert!(err.contains(message), "{text:?}: {err}");
            assert!(!err.contains("postgres://"), "the URL stays out of the error: {err}");
        }
        let ok = load(
            "[catalog]\nurl = \"postgres://c/db?sslmode=verify-full&sslrootcert=/ca.pem\"\n[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db?sslmode=require\"\n",
        )
        .unwrap();
        assert_eq!(ok.catalog.tls().unwrap().mode, crate::tls::SslMode::VerifyFull);
    }

    #[test]
    fn id_mistakes_name_their_line() {
        let tail =
            "[catalog]\nurl = \"postgres://c/db\"\n[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\n";
        for (id, message) in [
            (
                "[id]\nepoch_ms = -5\n",
                "shardline.toml:2: id.epoch_ms: invalid ID layout: the epoch cannot be before 1970",
            ),
            ("[id]\nepoch = 5\n", "shardline.toml:2: toml: unknown field `epoch`"),
            (
                "[id]\nminter = \"c\"\n",
                "shardline.toml:2: id.minter: \"c\" is not a minter: expected \"plpgsql\" or \"native\"",
            ),
            (
                "[id]\nepoch_ms = 1700000000000000\n",
                "shardline.toml:2: id.epoch_ms: 1700000000000000 is after now",
            ),
        ] {
            let err = load(&format!("{id}{tail}")).unwrap_err().to_string();
            assert!(err.contains(message), "{id:?}: {err}");
        }
        assert_eq!(load(tail).unwrap().minter, Minter::PlPgSql);
        assert_eq!(load(&format!("[id]\nminter = \"native\"\n{tail}")).unwrap().minter, Minter::Native);
        assert_eq!(load(&format!("[id]\nminter = \"plpgsql\"\n{tail}")).unwrap().minter, Minter::PlPgSql);
    }

    #[test]
    fn host_mistakes_name_the_host() {
        let base = "[catalog]\nurl = \"postgres://c/db\"\n";
        let cases: &[(&str, &str)] = &[
            (
                "[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\n[[hosts]]\nname = \"a\"\nurl = \"postgres://b/db\"\n",
                "shardline.toml:7: hosts[1].name: a is already the name of hosts[0]",
            ),
            (
                "[[hosts]]\nname = \"a b\"\nurl = \"postgres://a/db\"\n",
                "shardline.toml:4: hosts[0].name: \"a b\" is not allowed",
            ),
            ("[[hosts]]\nurl = \"postgres://a/db\"\n", "hosts[0].name: missing"),
            ("[[hosts]]\nname = \"a\"\n", "hosts[0].url: missing: give url or url_env"),
            (
                "[[hosts]]\nname = \"a\"\nurl_env = \"NOPE\"\n",
                "shardline.toml:5: hosts[0].url_env: names an environment variable that is not set",
            ),
            (
                "[[hosts]]\nname = \"a\"\nurl = \"postgres://u:${NOPE}@a/db\"\n",
                "hosts[0].url: ${...} number 1 names an environment variable that is not set",
            ),
            (
                "[[hosts]]\nname = \"a\"\nurl = \"x\"\nurl_env = \"PG1_URL\"\n",
                "hosts[0].url_env: give hosts[0].url or hosts[0].url_env, not both",
            ),
            ("[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\nport = 5\n", "toml: unknown field `port`"),
        ];
        for (hosts, message) in cases {
            let err = load(&format!("{base}{hosts}")).unwrap_err().to_string();
            assert!(err.contains(message), "{hosts:?}: {err}");
        }
        // No host at all: an application that learns them from the catalog.
        let none = load(base).unwrap();
        assert!(none.hosts.is_empty() && none.credentials == Credentials::None);
        assert!(none.even_map().is_err(), "no host to place shards on");
        let err = load("[[hosts]]\nname = \"a\"\nurl = \"postgres://a/db\"\n").unwrap_err().to_string();
        assert!(err.contains("catalog: missing"), "{err}");
    }

    #[test]
    fn credentials_are_one_reference_checked_when_loaded() {
        let base = "[catalog]\nurl = \"postgres://c/db\"\n";
        let c =
            load(&format!("{base}[credentials]\npassword_env = \"SHARDLINE_{{host}}_PASSWORD\"\n")).unwrap();
        assert_eq!(c.credentials, Credentials::PasswordEnv("SHARDLINE_{host}_PASSWORD".into()));
        let name = HostName::new("pg-east.1").unwrap();
        assert_eq!(Credentials::env_var("SHARDLINE_{host}_PASSWORD", &name), "SHARDLINE_PG_EAST_1_PASSWORD");
        let c = load(&format!("{base}[credentials]\npassfile = \"pgpass\"\n")).unwrap();
        assert_eq!(c.credentials, Credentials::Passfile(PathBuf::from("/etc/shardline/pgpass")));
        let cases = [
            ("password_env = \"PW\"", "credentials.password_env: must name"),
            ("password_env = \"A-{host}\"", "credentials.password_env"),
            (
                "password_env = \"A_{host}\"\npassfile = \"x\"",
                "credentials.passfile: give password_env or passfile",
            ),
            ("passfile = \" \"", "credentials.passfile: is empty"),
            ("", "credentials: needs password_env or passfile"),
            ("password = \"x\"", "unknown field `password`"),
        ];
        for (body, message) in cases {
            let err = load(&format!("{base}[credentials]\n{body}\n")).unwrap_err().to_string();
            assert!(err.contains(message), "{body:?}: {err}");
        }
    }

    #[test]
    fn a_password_splits_off_a_url_and_goes_back_in() {
        let cases = [
            (
                "postgres://app:p%40ss@pg1:5432/app?sslmode=require",
                "postgres://app@pg1:5432/app?sslmode=require",
                Some("p@ss"),
            ),
            (
                "postgres://app@pg1/app?password=x&sslmode=require",
                "postgres://app@pg1/app?sslmode=require",
                Some("x"),
            ),
            ("postgres://app@pg1/app?password=x", "postgres://app@pg1/app", Some("x")),
            ("postgres://app@pg1/app", "postgres://app@pg1/app", None),
            ("postgres://pg1", "postgres://pg1", None),
            (
                "host=pg1 user=app password='a b\\'c' dbname=app",
                "host=pg1 user=app dbname=app",
                Some("a b'c"),
            ),
            ("host=pg1 password=pw", "host=pg1", Some("pw")),
        ];
        for (url, bare, password) in cases {
            let (got, pw) = DbUrl::new(url.into()).split_password();
            assert_eq!(got.expose(), bare, "{url}");
            assert_eq!(pw.as_deref(), password, "{url}");
            if let Some(p) = pw {
                let back = got.with_password(&p);
                assert_eq!(back.split_password(), (got.clone(), Some(p.clone())), "{url}");
            }
        }
        // No user: the password goes as a parameter (an empty user would be sent).
        assert_eq!(
            DbUrl::new("postgres://pg1/db".into()).with_password("p w").expose(),
            "postgres://pg1/db?password=p%20w"
        );
        let odd = "p:@/ ?&=%'\\é";
        for base in ["postgres://app@pg1:5/db?x=1", "postgres://pg1/db", "host=pg1 user=app"] {
            let with = DbUrl::new(base.into()).with_password(odd);
            assert!(!with.redacted().contains("é"), "{}", with.redacted());
            assert_eq!(with.split_password(), (DbUrl::new(base.into()), Some(odd.to_owned())), "{base}");
        }
    }

    #[test]
    fn redaction_covers_url_and_key_value_forms() {
        assert_eq!(redact("postgres://u:p@h:5/db"), "postgres://u:***@h:5/db");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redact("postgres://h/db?user=u&password=p"), "postgres://h/db?user=u&password=***");
        assert_eq!(redact("host=h user=u password=p dbname=d"), "host=h user=u password=*** dbname=d");
        assert_eq!(redact("postgres://u:p@ss@h/db"), "postgres://u:***@h/db");
        // A quoted password with a space is hidden whole.
        assert_eq!(redact("host=h password='a b' user=u"), "host=h password=*** user=u");
        // Both a user's password and a query's; a key/value string holding "://" (read
        // as key/value, as libpq does); a mistyped scheme.
        assert_eq!(redact("postgres://u:p@h/db?password=q"), "postgres://u:***@h/db?password=***");
        assert_eq!(
            redact("host=h password=x application_name=postgres://"),
            "host=h password=*** application_name=postgres://"
        );
        assert_eq!(redact("mysql://u:p@h/db"), "***");
        assert_eq!(redact("host=h password=a\\ b user=u"), "host=h password=*** user=u");
        // An `@` in the query (an Azure-style user name, an application name): the
        // masking of the user's part reaches into the query, and a password key after
        // it is still hidden; so is one in a masked part, and libpq's key passphrase.
        for url in [
            "postgres://app@pg1:5432/app?application_name=api@web1&password=hunter2",
            "postgres://pg1/app?user=app@server:x&password=hunter2",
            "postgres://u:x?password=hunter2@h/db",
            "postgres://u:hunter2@h/db?options=a@b",
            "postgres://u@h/db?sslpassword=hunter2&sslmode=require",
            "host=h sslpassword=hunter2",
            // A `?` or an `@` inside a query's password is part of it, as the drivers
            // read it; and a `:` before such an `@`.
            "postgres://h/db?password=hun?ter2",
            "postgres://h:5432/db?password=hun@ter2",
            "postgres://u:pw@h/db?password=hun@ter2&sslmode=require",
            "postgres://h/db?sslpassword=hunter2?x&password=hunter2@y",
            "postgres://h/db?pass\tword=hunter2",
        ] {
            let shown = redact(url);
            assert!(!shown.contains("hunter2"), "{url} shown as {shown}");
            let db = DbUrl::new(url.to_owned());
            assert!(!format!("{db:?}").contains("hunter2") && !db.to_string().contains("hunter2"), "{url}");
        }
    }
}
