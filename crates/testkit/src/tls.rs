//! Certificates made on the spot, and hosts that accept TLS connections only.
//!
//! ```no_run
//! # async fn example(host: &shardline_testkit::Host) -> Result<(), shardline_testkit::Error> {
//! use shardline_testkit::tls::TestCa;
//! let ca = TestCa::new("shardline test CA")?;
//! let cert = ca.issue(&[host.endpoint().host.as_str(), "localhost"])?;
//! let tls_only = host.require_tls(&cert).await?;
//! // ... connect with `sslmode=verify-full&sslrootcert=<a file holding ca.pem()>` ...
//! tls_only.restore().await?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use tokio_postgres::Client;

use crate::host::{CONNECT_TIMEOUT, connect, error_chain};
use crate::{Error, Host, Result};

/// The names of the files the kit writes into a host's data directory.
const CERT_FILE: &str = "shardline-test-server.crt";
const KEY_FILE: &str = "shardline-test-server.key";

/// How long the server may take to apply a configuration reload.
pub(crate) const RELOAD_TIMEOUT: Duration = Duration::from_secs(20);

/// A certificate authority that lives as long as a test.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

impl fmt::Debug for TestCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

/// A server certificate and its private key, both PEM.
#[derive(Clone)]
pub struct ServerCert {
    /// The certificate.
    pub cert_pem: String,
    /// The private key.
    pub key_pem: String,
}

impl fmt::Debug for ServerCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerCert").field("cert_pem", &self.cert_pem).finish_non_exhaustive()
    }
}

fn cert_err(e: rcgen::Error) -> Error {
    Error::Certificate { message: e.to_string() }
}

impl TestCa {
    /// A new self-signed CA whose common name is `name`.
    ///
    /// # Errors
    ///
    /// [`Error::Certificate`] when the key or certificate cannot be made.
    pub fn new(name: &str) -> Result<TestCa> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(cert_err)?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().map_err(cert_err)?;
        let cert = params.self_signed(&key).map_err(cert_err)?;
        Ok(TestCa { issuer: Issuer::new(params, key), pem: cert.pem() })
    }

    /// The CA's certificate, PEM: what a client's `sslrootcert` file holds.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A server certificate for `names` (DNS names or IP addresses), signed by this CA.
    ///
    /// # Errors
    ///
    /// [`Error::Certificate`] for a name that cannot go in a certificate.
    pub fn issue(&self, names: &[&str]) -> Result<ServerCert> {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names).map_err(cert_err)?;
        params.distinguished_name.push(DnType::CommonName, "shardline test server");
        let key = KeyPair::generate().map_err(cert_err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(cert_err)?;
        Ok(ServerCert { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
    }
}

/// A host switched to TLS-only by [`Host::require_tls`]. [`TlsOnly::restore`] switches
/// it back; dropped without that, the host stays TLS-only (and the kit, which connects
/// without TLS, can no longer restart it).
#[derive(Debug)]
pub struct TlsOnly<'h> {
    host: &'h Host,
    admin: Client,
    hba_file: String,
    hba_before: String,
}

impl Host {
    /// Makes the server accept TCP connections over TLS only, presenting `cert`: the
    /// certificate and key are written into its data directory, `ssl` is turned on, and
    /// every `host` line of `pg_hba.conf` becomes `hostssl`. Returns once a connection
    /// without TLS is refused. Works alike on both backends (all through SQL, as the
    /// superuser).
    ///
    /// # Errors
    ///
    /// [`Error::Postgres`] when a statement fails; [`Error::Timeout`] when the server
    /// still accepts plain connections after the reload.
    pub async fn require_tls(&self, cert: &ServerCert) -> Result<TlsOnly<'_>> {
        let admin = self.connect("postgres").await?;
        let pg = |what: &str| {
            let host = self.name().to_owned();
            let what = what.to_owned();
            move |source| Error::Postgres { host, what, source }
        };
        let row = admin
            .query_one(
                "SELECT current_setting('data_directory'), current_setting('hba_file'), \
                        pg_read_file(current_setting('hba_file'))",
                &[],
            )
            .await
            .map_err(pg("reading pg_hba.conf"))?;
        let (data_dir, hba_file, hba_before): (String, String, String) = (row.get(0), row.get(1), row.get(2));
        write_file(&admin, &format!("{data_dir}/{CERT_FILE}"), &cert.cert_pem)
            .await
            .map_err(pg("writing the certificate"))?;
        write_file(&admin, &format!("{data_dir}/{KEY_FILE}"), &cert.key_pem)
            .await
            .map_err(pg("writing the key"))?;
        let hba_after: String = hba_before
            .lines()
            .map(|l| match l.strip_prefix("host") {
                Some(rest) if rest.starts_with([' ', '\t']) => format!("hostssl{rest}"),
                _ => l.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        write_file(&admin, &hba_file, &hba_after).await.map_err(pg("writing pg_hba.conf"))?;
        for statement in [
            format!("ALTER SYSTEM SET ssl_cert_file = '{CERT_FILE}'"),
            format!("ALTER SYSTEM SET ssl_key_file = '{KEY_FILE}'"),
            "ALTER SYSTEM SET ssl = on".to_owned(),
            "SELECT pg_reload_conf()".to_owned(),
        ] {
            admin.simple_query(&statement).await.map_err(pg("turning TLS on"))?;
        }
        self.wait_for_plain(false).await?;
        Ok(TlsOnly { host: self, admin, hba_file, hba_before })
    }

    /// Waits until a connection without TLS is accepted (`true`) or refused (`false`).
    async fn wait_for_plain(&self, accepted: bool) -> Result<()> {
        let started = Instant::now();
        loop {
            let plain = connect(self.name(), &self.config("postgres"), CONNECT_TIMEOUT).await;
            match plain {
                Ok(_) if accepted => return Ok(()),
                Err(ref e) if !accepted && error_chain(e).contains("no encryption") => return Ok(()),
                _ => {}
            }
            if started.elapsed() > RELOAD_TIMEOUT {
                return Err(Error::Timeout {
                    host: self.name().to_owned(),
                    what: if accepted { "turning TLS-only off" } else { "turning TLS-only on" },
                    after: started.elapsed(),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl TlsOnly<'_> {
    /// Puts the host back as it was: `pg_hba.conf` restored, `ssl` reset, and a plain
    /// connection accepted again.
    ///
    /// # Errors
    ///
    /// [`Error::Postgres`] when a statement fails; [`Error::Timeout`] when plain
    /// connections are still refused after the reload.
    pub async fn restore(self) -> Result<()> {
        let host = self.host.name().to_owned();
        let pg = |what: &'static str| {
            let host = host.clone();
            move |source| Error::Postgres { host, what: what.into(), source }
        };
        write_file(&self.admin, &self.hba_file, &self.hba_before)
            .await
            .map_err(pg("restoring pg_hba.conf"))?;
        for statement in [
            "ALTER SYSTEM RESET ssl",
            "ALTER SYSTEM RESET ssl_cert_file",
            "ALTER SYSTEM RESET ssl_key_file",
            "SELECT pg_reload_conf()",
        ] {
            self.admin.simple_query(statement).await.map_err(pg("turning TLS off"))?;
        }
        self.host.wait_for_plain(true).await
    }
}

/// Writes `text` to `path` on the server through `COPY ... TO PROGRAM`, as the server's
/// user, with `umask 077` (a private key must not be readable by others; a plain
/// `COPY ... TO` file is created 0644). The text must hold no tab, backslash or carriage
/// return (`COPY`'s text format would escape them); PEM and `pg_hba.conf` lines do not.
pub(crate) async fn write_file(
    admin: &Client,
    path: &str,
    text: &str,
) -> std::result::Result<(), tokio_postgres::Error> {
    // The data directory's path goes into a shell command: single-quoted, and refused by
    // the server (a missing file) if it held a quote, which no data directory does.
    let program = format!("umask 077 && cat > '{}'", path.replace('\'', ""));
    let lines: Vec<String> = text.lines().map(literal).collect();
    let sql = format!(
        "COPY (SELECT line FROM unnest(ARRAY[{}]::text[]) WITH ORDINALITY AS t(line, n) ORDER BY n) TO PROGRAM {}",
        lines.join(", "),
        literal(&program)
    );
    admin.simple_query(&sql).await.map(drop)
}

use shardline_id::ident::literal;
