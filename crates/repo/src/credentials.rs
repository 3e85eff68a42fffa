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
    let host = match pg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        #[cfg(unix)]
        Some(tokio_postgres::config::Host::Unix(_)) | None => "localhost".to_owned(),
        #[cfg(not(unix))]
        None => "localhost".to_owned(),
    };
    let port = pg.get_ports().first().copied().unwrap_or(5432).to_string();
    let user = pg.get_user().unwrap_or_default().to_owned();
    let db = pg.get_dbname().map_or_else(|| user.clone(), str::to_owned);
    Ok(passfile_lookup(&text, [&host, &port, &db, &user]))
}

/// The password of the first passfile line matching `wanted` (host, port, database,
/// user).
fn passfile_lookup(text: &str, wanted: [&str; 4]) -> Option<String> {
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let fields = split_passfile_line(line);
        if fields.len() != 5 {
            continue;
        }
        if fields.iter().zip(wanted).all(|(f, w)| f == "*" || f == w) {
            return fields.into_iter().nth(4);
        }
    }
    None
}

/// A passfile line's fields: `:` separates, `\` escapes.
fn split_passfile_line(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let (Some(next), Some(f)) = (chars.next(), fields.last_mut()) {
                    f.push(next);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => {
                if let Some(f) = fields.last_mut() {
                    f.push(c);
                }
            }
        }
    }
    fields
}

/// Whether `a` and `b` name the same place: equal once their passwords are taken off.
pub fn same_address(a: &DbUrl, b: &DbUrl) -> bool {
    a.split_password().0 == b.split_password().0
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
        if let Some(address) = &host.address
            && !same_address(address, &h.url)
        {
            tracing::warn!(host = %host.name, config = %h.url, catalog = %address, "the config gives this host another URL than the catalog's address; using the config's");
        }
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
    let peer_url = match &host.peer_address {
        Some(peer) if peer != address => ask(peer.clone()).await?,
        _ => url.clone(),
    };
    Ok(HostConfig { name: host.name.clone(), url, peer_url })
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
    let mut out = config.clone();
    for h in &hosts {
        if h.state == HostState::Removed || config.host(&h.name).is_some() {
            continue;
        }
        out.hosts.push(host_config(config, credentials, h).await?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(split_passfile_line("a:b:c:d:e:f"), ["a", "b", "c", "d", "e:f"]);
    }
}
