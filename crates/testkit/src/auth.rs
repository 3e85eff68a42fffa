//! Hosts that ask one role for its password, and private files on a host (a libpq
//! passfile, for instance). The kit's hosts otherwise trust every connection.
//!
//! ```no_run
//! # async fn example(host: &shardline_testkit::Host) -> Result<(), shardline_testkit::Error> {
//! let client = host.connect("postgres").await?;
//! client.batch_execute("CREATE ROLE repl LOGIN REPLICATION PASSWORD 'pw'").await.expect("role");
//! let required = host.require_password("repl").await?;
//! let passfile = host.write_private_file("repl.pgpass", "*:*:*:repl:pw").await?;
//! let peer_url = format!("host=pg1 user=repl passfile={passfile}"); // read by the host's libpq
//! # drop(peer_url);
//! required.restore().await?;
//! # Ok(()) }
//! ```

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::host::{CONNECT_TIMEOUT, connect, error_chain};
use crate::tls::{RELOAD_TIMEOUT, write_file};
use crate::{Error, Host, Result};

/// A host that asks one role for its password; [`PasswordRequired::restore`] puts it
/// back to trust.
#[derive(Debug)]
pub struct PasswordRequired<'h> {
    host: &'h Host,
    admin: Client,
    hba_file: String,
    role: String,
    line: String,
}

fn check_name(name: &str, what: &'static str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() < 64
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.');
    if ok && !name.starts_with('.') {
        Ok(())
    } else {
        Err(Error::BadIdentifier {
            name: name.to_owned(),
            what,
            reason: "use 1 to 63 of a-z, 0-9, _ and . (not first)",
        })
    }
}

impl Host {
    /// Makes the server ask `role` for its password (`scram-sha-256`) on every TCP
    /// connection, logical replication included: a `host all <role> all scram-sha-256`
    /// line is put first in `pg_hba.conf` and the configuration reloaded, through SQL
    /// as the superuser (as [`Host::require_tls`], so alike on both backends). Other
    /// roles keep the kit's trust. Returns once a connection as `role` without a
    /// password is refused.
    ///
    /// # Errors
    ///
    /// [`Error::BadIdentifier`] for a role name other than `[a-z0-9_.]`;
    /// [`Error::Postgres`] when a statement fails; [`Error::Timeout`] when the server
    /// still lets `role` in without a password after the reload.
    pub async fn require_password(&self, role: &str) -> Result<PasswordRequired<'_>> {
        check_name(role, "role")?;
        let admin = self.connect("postgres").await?;
        let row = admin
            .query_one("SELECT current_setting('hba_file'), pg_read_file(current_setting('hba_file'))", &[])
            .await
            .map_err(self.pg("reading pg_hba.conf"))?;
        let (hba_file, before): (String, String) = (row.get(0), row.get(1));
        let line = format!("host all {role} all scram-sha-256");
        let after = format!("{line}\n{before}");
        write_file(&admin, &hba_file, &after).await.map_err(self.pg("writing pg_hba.conf"))?;
        admin.simple_query("SELECT pg_reload_conf()").await.map_err(self.pg("reloading"))?;
        self.wait_for_password(role, true).await?;
        Ok(PasswordRequired { host: self, admin, hba_file, role: role.to_owned(), line })
    }

    /// Writes `text` to the file `name` in the server's data directory, readable and
    /// writable by the server's operating-system user only (mode 0600, as libpq wants of
    /// a passfile), and returns its path as the server sees it. Through SQL
    /// (`COPY ... TO PROGRAM`), so alike on both backends. The text must hold no tab,
    /// backslash or carriage return.
    ///
    /// # Errors
    ///
    /// [`Error::BadIdentifier`] for a name other than `[a-z0-9_.]`; [`Error::Postgres`]
    /// when a statement fails.
    pub async fn write_private_file(&self, name: &str, text: &str) -> Result<String> {
        check_name(name, "file")?;
        let admin = self.connect("postgres").await?;
        let dir: String = admin
            .query_one("SELECT current_setting('data_directory')", &[])
            .await
            .map_err(self.pg("reading data_directory"))?
            .get(0);
        let path = format!("{dir}/{name}");
        write_file(&admin, &path, text).await.map_err(self.pg("writing a private file"))?;
        Ok(path)
    }

    fn pg(&self, what: &str) -> impl FnOnce(tokio_postgres::Error) -> Error {
        let (host, what) = (self.name().to_owned(), what.to_owned());
        move |source| Error::Postgres { host, what, source }
    }

    /// Waits until a connection as `role` without a password is refused (`true`) or
    /// accepted (`false`).
    async fn wait_for_password(&self, role: &str, required: bool) -> Result<()> {
        let started = Instant::now();
        let mut config = self.config("postgres");
        config.user(role);
        loop {
            match connect(self.name(), &config, CONNECT_TIMEOUT).await {
                Err(ref e) if required && error_chain(e).contains("password") => return Ok(()),
                Ok(_) if !required => return Ok(()),
                _ => {}
            }
            if started.elapsed() > RELOAD_TIMEOUT {
                return Err(Error::Timeout {
                    host: self.name().to_owned(),
                    what: if required { "requiring a password" } else { "trusting the role again" },
                    after: started.elapsed(),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl PasswordRequired<'_> {
    /// Takes the kit's line out of `pg_hba.conf` again (leaving any other change to the
    /// file alone) and reloads; returns once the role is let in without a password.
    ///
    /// # Errors
    ///
    /// [`Error::Postgres`] when a statement fails; [`Error::Timeout`] when the role is
    /// still asked for its password after the reload.
    pub async fn restore(self) -> Result<()> {
        let host = self.host;
        let now: String = self
            .admin
            .query_one("SELECT pg_read_file($1)", &[&self.hba_file])
            .await
            .map_err(host.pg("reading pg_hba.conf"))?
            .get(0);
        let kept: Vec<&str> = now.lines().filter(|l| *l != self.line).collect();
        write_file(&self.admin, &self.hba_file, &kept.join("\n"))
            .await
            .map_err(host.pg("restoring pg_hba.conf"))?;
        self.admin.simple_query("SELECT pg_reload_conf()").await.map_err(host.pg("reloading"))?;
        host.wait_for_password(&self.role, false).await
    }
}
