//! Passwords by reference, for hosts whose address comes from the catalog.
//!
//! The catalog records where each host lives, never a password. An application picks
//! one way to get passwords, once: the config's `[credentials]` (an environment
//! variable per host, or a libpq passfile), or its own [`Credentials`] (a secrets
//! manager, say) given to [`crate::Cluster::connect_with`]. A host the config lists
//! keeps the URL (and password) the config gives it.
//!
//! ```no_run
//! use shardline_repo::credentials::{BoxError, Credentials};
//! use shardline_router::{HostName, config::DbUrl};
//!
//! #[derive(Debug)]
//! struct Vault;
//!
//! #[async_trait::async_trait]
//! impl Credentials for Vault {
//!     async fn password(&self, host: &HostName, _address: &DbUrl) -> Result<Option<String>, BoxError> {
//!         Ok(Some(format!("from the vault for {host}")))
//!     }
//! }
//! ```

use std::path::Path;

use shardline_router::config::{self, DbUrl, HostConfig};
use shardline_router::{Config, HostName};

use crate::catalog::{CatalogHost, HostState};
use crate::{Error, Result};

/// The error a [`Credentials`] returns; it is shown to operators, so it must not hold
/// the secret.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Where an application's passwords come from.
#[async_trait::async_trait]
pub trait Credentials: std::fmt::Debug + Send + Sync {
    /// The password for `host` at `address` (a URL without one), or `None` to send
    /// none. Asked when a pool for the host is made: when the handle connects, and when
    /// the catalog adds or readdresses the host.
    ///
    /// # Errors
    ///
    /// Whatever keeps the password from being had; the host then gets no pool and
    /// [`Error::Credentials`] names it.
    async fn password(
        &self,
        host: &HostName,
        address: &DbUrl,
    ) -> std::result::Result<Option<String>, BoxError>;
}

#[async_trait::async_trait]
impl Credentials for config::Credentials {
    async fn password(
        &self,
        host: &HostName,
        address: &DbUrl,
    ) -> std::result::Result<Option<String>, BoxError> {
        match self {
            config::Credentials::PasswordEnv(template) => {
                let var = config::Credentials::env_var(template, host);
                match std::env::var(&var) {
                    Ok(v) if !v.is_empty() => Ok(Some(v)),
                    _ => Err(format!("environment variable {var} is not set").into()),
                }
            }
            config::Credentials::Passfile(path) => passfile_password(path, address).await,
            _ => Ok(None),
        }
    }
}

/// The password libpq would take from the passfile at `path` for `address`: the first
/// line whose host, port, database and user match (`*` matches anything). As libpq, a
/// file others may read is refused.
async fn passfile_password(path: &Path, address: &DbUrl) -> std::result::Result<Option<String>, BoxError> {
    let shown = path.display();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let meta =
            tokio::fs::metadata(path).await.map_err(|e| format!("cannot read the passfile {shown}: {e}"))?;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(format!("the passfile {shown} may be read by others: chmod 0600 it").into());
        }
    }
    let text = tokio::fs::read_to_string(path)
        .await
        .map_err(|e| format!("cannot read the passfile {shown}: {e}"))?;
    let pg = crate::catalog::pg_config(address, "a host").map_err(|e| e.to_string())?;
    // The user the driver connects as: the URL's, else the process's (tokio-postgres
    // does not read PGUSER); no database is the user's name.
    let user = match pg.get_user() {
        Some(user) => user.to_owned(),
        None => crate::driver_user()
            .ok_or("the URL names no user, and the process's user is unknown: name the user in the URL")?,
    };
    let db = pg.get_dbname().map_or_else(|| user.clone(), str::to_owned);
    // As libpq: each host is looked up by its `host`, else its `hostaddr`, else as
    // `localhost` (a Unix socket too); a port given once is every host's.
    let (hosts, addrs, ports) = (pg.get_hosts(), pg.get_hostaddrs(), pg.get_ports());
    let mut passwords: Vec<Option<String>> = Vec::new();
    for i in 0..hosts.len().max(addrs.len()).max(1) {
        let host = match (hosts.get(i), addrs.get(i)) {
            (Some(tokio_postgres::config::Host::Tcp(h)), _) => h.clone(),
            (_, Some(addr)) => addr.to_string(),
            _ => "localhost".to_owned(),
        };
        let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432).to_string();
        passwords.push(passfile_lookup(&text, [&host, &port, &db, &user]));
    }
    passwords.dedup();
    match passwords.as_slice() {
        [one] => Ok(one.clone()),
        _ => Err(format!(
            "the URL names several hosts, and the passfile {shown} gives them different passwords (or some \
             none): the driver sends one password to whichever it reaches; give each host its own URL"
        )
        .into()),
    }
}

/// The password of the first passfile line matching `wanted` (host, port, database,
/// user).
fn passfile_lookup(text: &str, wanted: [&str; 4]) -> Option<String> {
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let fields = split_passfile_line(line);
        if fields.len() < 5 {
            continue;
        }
        // An unescaped `*` matches anything; `\*` is a star.
        if fields.iter().zip(wanted).all(|((f, star), w)| *star || f == w) {
            return fields.into_iter().nth(4).map(|(f, _)| f);
        }
    }
    None
}

/// A passfile line's fields, each with whether it is an unescaped `*`: `:` separates,
/// `\` escapes the next character. Fields past the fifth are ignored, as libpq does.
fn split_passfile_line(line: &str) -> Vec<(String, bool)> {
    let mut fields = Vec::new();
    let (mut field, mut escaped_any) = (String::new(), false);
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(next) = chars.next() {
                    field.push(next);
                    escaped_any = true;
                }
            }
            ':' => {
                let star = field == "*" && !escaped_any;
                fields.push((std::mem::take(&mut field), star));
                escaped_any = false;
            }
            c => field.push(c),
        }
    }
    let star = field == "*" && !escaped_any;
    fields.push((field, star));
    fields
}

/// Whether `a` and `b` name the same place: equal once their passwords are taken off.
pub fn same_address(a: &DbUrl, b: &DbUrl) -> bool {
    a.split_password().0 == b.split_password().0
}

/// Warns when the catalog records `host` at another address than `entry`, the config's
/// URL, which is used (so a `shardline host readdress` is not followed).
pub(crate) fn warn_if_elsewhere(entry: &HostConfig, host: &CatalogHost) {
    if let Some(address) = &host.address
        && !same_address(address, &entry.url)
    {
        tracing::warn!(host = %host.name, config = %entry.url, catalog = %address, "the config lists this host at another URL than the catalog's address; using the config's (a readdress is not followed)");
    }
}

/// How to reach `host`: the config's URLs when the config lists it, else the catalog's
/// address with a password from `credentials`. The one place a host's URL is made.
///
/// # Errors
///
/// [`Error::UnknownHost`] when neither the config nor the catalog has an address;
/// [`Error::Credentials`] when the password cannot be had.
pub async fn host_config(
    config: &Config,
    credentials: &dyn Credentials,
    host: &CatalogHost,
) -> Result<HostConfig> {
    if let Some(h) = config.host(&host.name) {
        return Ok(h.clone());
    }
    let Some(address) = &host.address else { return Err(Error::UnknownHost { host: host.name.clone() }) };
    let ask = |address: DbUrl| async move {
        let password = credentials.password(&host.name, &address).await.map_err(|e| Error::Credentials {
            host: host.name.clone(),
            message: crate::error_chain(e.as_ref() as &(dyn std::error::Error + 'static)),
        })?;
        Ok::<_, Error>(match password {
            Some(p) => address.with_password(&p),
            None => address,
        })
    };
    let url = ask(address.clone()).await?;
    // A peer address of its own is handed to the target's server as recorded: no
    // password is put in it (it would sit in `pg_subscription`); give it a `passfile`
    // on the target (docs/operations.md). Without one, the peers use `url`, as a config
    // entry's `peer_url` defaults to its `url`.
    let peer_url = match &host.peer_address {
        Some(peer) if peer != address => peer.clone(),
        _ => url.clone(),
    };
    Ok(HostConfig { name: host.name.clone(), url, peer_url })
}

/// Whether [`host_config`] resolves `host` (a host the config does not list) to `entry`'s
/// URLs, passwords aside: `false` once the host was readdressed since `entry` was made
/// from its record.
pub fn resolves_to(entry: &HostConfig, host: &CatalogHost) -> bool {
    let Some(address) = &host.address else { return false };
    let peer = match &host.peer_address {
        Some(peer) if peer != address => peer,
        _ => address,
    };
    same_address(&entry.url, address) && same_address(&entry.peer_url, peer)
}

/// `config` with every host the catalog knows and has not removed (after the config's
/// own), each reachable as [`host_config`] says: what the operations run with, so that
/// a host added with `shardline host add` needs no config change.
///
/// # Errors
///
/// As [`crate::Catalog::connect`] and [`host_config`]; a catalog that does not exist yet
/// leaves `config` as it is.
pub async fn with_catalog_hosts(config: &Config, credentials: &dyn Credentials) -> Result<Config> {
    let catalog = match crate::Catalog::connect(config).await {
        Ok(c) => c,
        Err(e) => return Err(e),
    };
    let hosts = match catalog.hosts().await {
        Ok(h) => h,
        // No catalog yet (`init` makes it): the config's hosts are all there is.
        Err(e) if e.sqlstate() == Some("42P01") || e.sqlstate() == Some("3F000") => return Ok(config.clone()),
        Err(e) => return Err(e),
    };
    let map = catalog.map().await?;
    let mut out = config.clone();
    // A host the config lists but the catalog removed is gone.
    out.hosts.retain(|c| {
        let removed = hosts.iter().any(|h| h.name == c.name && h.state == HostState::Removed);
        if removed && map.shards_of(&c.name).next().is_none() {
            tracing::warn!(host = %c.name, "the config lists a host that was removed (`shardline host remove`); leaving it out");
            return false;
        }
        true
    });
    for h in &hosts {
        if let Some(entry) = config.host(&h.name) {
            warn_if_elsewhere(entry, h);
            continue;
        }
        if h.state == HostState::Removed {
            continue;
        }
        match host_config(config, credentials, h).await {
            Ok(c) => out.hosts.push(c),
            // A host that holds no shard is not needed to act on the others: said.
            Err(e) if map.shards_of(&h.name).next().is_none() => {
                tracing::warn!(host = %h.name, error = %crate::error_chain(&e), "leaving out a host that holds no shard and cannot be reached");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_env_reads_the_variable_the_template_names_and_names_it_when_unset() {
        let host = HostName::new("path").unwrap_or_else(|_| unreachable!());
        let address = DbUrl::new("postgres://app@pg1/app".into());
        // PATH is set wherever tests run: "{host}" upper-cased names it.
        let got = futures::executor::block_on(
            config::Credentials::PasswordEnv("{host}".into()).password(&host, &address),
        );
        assert_eq!(got.ok().flatten(), std::env::var("PATH").ok());
        let unset = futures::executor::block_on(
            config::Credentials::PasswordEnv("SHARDLINE_UNSET_{host}_PW".into()).password(&host, &address),
        );
        let message = unset.err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(message, "environment variable SHARDLINE_UNSET_PATH_PW is not set");
        let none = futures::executor::block_on(config::Credentials::None.password(&host, &address));
        assert!(matches!(none, Ok(None)));
    }

    #[test]
    fn a_passfile_line_matches_as_libpq_matches() {
        let text = "# comment\n\
                    pg9:*:*:*:nine\n\
                    *:5433:app:app:a\\:b\\\\c\n\
                    *:*:*:app:fallback\n\
                    short:line\n";
        assert_eq!(passfile_lookup(text, ["pg1", "5433", "app", "app"]).as_deref(), Some("a:b\\c"));
        assert_eq!(passfile_lookup(text, ["pg1", "5432", "app", "app"]).as_deref(), Some("fallback"));
        assert_eq!(passfile_lookup(text, ["pg9", "1", "x", "y"]).as_deref(), Some("nine"));
        assert_eq!(passfile_lookup(text, ["pg1", "5432", "app", "other"]), None);
        // The password ends at an unescaped colon, as libpq reads it; `\*` is a star,
        // not any.
        assert_eq!(passfile_lookup("h:1:d:u:pw:extra\n", ["h", "1", "d", "u"]).as_deref(), Some("pw"));
        assert_eq!(passfile_lookup("\\*:1:d:u:star\n", ["h", "1", "d", "u"]), None);
        assert_eq!(passfile_lookup("\\*:1:d:u:star\n", ["*", "1", "d", "u"]).as_deref(), Some("star"));
    }

    /// The passfile is read for the user, host and hosts the driver connects to: the
    /// process's user when the URL names none (never `PGUSER`, which the driver does not
    /// read), a `hostaddr` when no host is named, and one password for a URL naming
    /// several hosts only when the file gives each the same. Before: `PGUSER`'s line
    /// (another role's password, sent in a login as the process's user), `localhost`'s
    /// line for a `hostaddr`, and the first host's password sent to every host.
    #[test]
    fn a_passfile_is_read_for_whom_and_where_the_driver_connects() {
        let Some(me) = crate::driver_user() else { return };
        let dir = std::env::temp_dir().join(format!("shardline-passfile-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join("pgpass");
        let text = format!(
            "*:*:*:not_{me}_but_pguser:SUPER\n\
             10.0.0.7:*:*:*:by-addr\n\
             localhost:*:*:*:by-localhost\n\
             pga:*:*:*:a\n\
             pgb:*:*:*:b\n\
             *:*:*:{me}:mine\n"
        );
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .unwrap_or_else(|e| panic!("{e}"));
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        let read = |url: &str| {
            rt.block_on(passfile_password(&path, &DbUrl::new(url.into()))).map_err(|e| e.to_string())
        };
        assert_eq!(read("postgres://pg1/app"), Ok(Some("mine".to_owned())));
        assert_eq!(read("postgres://u@/app?hostaddr=10.0.0.7"), Ok(Some("by-addr".to_owned())));
        assert_eq!(read("postgres://u@pga,pga/app"), Ok(Some("a".to_owned())));
        let err = read("postgres://u@pga,pgb/app").unwrap_err();
        assert!(err.contains("several hosts") && !err.contains("SUPER"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The test above, run again in a process whose `PGUSER` names the user of the
    /// passfile's first line: the process's user's line is still the one read.
    #[test]
    fn pguser_does_not_choose_the_passfiles_line() {
        let Some(me) = crate::driver_user() else { return };
        let pguser = format!("not_{me}_but_pguser");
        crate::rerun_with_env(
            "credentials::tests::a_passfile_is_read_for_whom_and_where_the_driver_connects",
            &[("PGUSER", &pguser)],
        );
    }
}
