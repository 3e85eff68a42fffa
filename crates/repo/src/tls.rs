//! TLS for every connection shardline opens (host pools, the catalog, the map listener,
//! the operations' sessions): rustls with the `ring` provider, doing what the URL's
//! `sslmode` says, as libpq does (see [`shardline_router::tls`]).

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use shardline_router::config::DbUrl;
use shardline_router::tls::{RootCert, SslMode, TlsParams};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::{Error, Result};

/// The driver's configuration for `url` and the TLS connector its `sslmode` calls for.
///
/// # Errors
///
/// [`Error::BadUrl`] when the URL does not parse; [`Error::Tls`] when the trusted
/// certificates cannot be read. Both name `target`, never the URL.
pub(crate) fn prepare(url: &DbUrl, target: &str) -> Result<(tokio_postgres::Config, MakeRustlsConnect)> {
    let params = url.tls().map_err(|message| Error::BadUrl { target: target.to_owned(), message })?;
    let mut config = tokio_postgres::Config::from_str(&params.driver_url)
        .map_err(|e| Error::BadUrl { target: target.to_owned(), message: crate::error_chain(&e) })?;
    // Every connection shardline makes may write: of a list of hosts (a primary and its
    // standbys), the one that takes writes, unless the URL chooses (as libpq's
    // `target_session_attrs`; the driver's default is the first that answers).
    if !params.sets_target_session_attrs && listed_hosts(&config) > 1 {
        config.target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
    }
    config.ssl_mode(match params.mode {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });
    let connector = MakeRustlsConnect::new(client_config(&params, target)?);
    Ok((config, connector))
}

/// How many servers `config` lists (as `host`, or as `hostaddr` alone), at least one:
/// the driver tries them in turn.
pub(crate) fn listed_hosts(config: &tokio_postgres::Config) -> usize {
    config.get_hosts().len().max(config.get_hostaddrs().len()).max(1)
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn client_config(params: &TlsParams, target: &str) -> Result<ClientConfig> {
    let provider = provider();
    let tls_err = |message: String| Error::Tls { target: target.to_owned(), message };
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| tls_err(e.to_string()))?;
    let chain = match (&params.root_cert, params.verifies_chain()) {
        (Some(root), true) => Some(
            WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots(root).map_err(tls_err)?),
                provider.clone(),
            )
            .build()
            .map_err(|e| tls_err(e.to_string()))?,
        ),
        _ => None,
    };
    let verifier = Arc::new(Verifier {
        chain,
        check_name: params.mode == SslMode::VerifyFull,
        algorithms: provider.signature_verification_algorithms,
    });
    Ok(builder.dangerous().with_custom_certificate_verifier(verifier).with_no_client_auth())
}

fn roots(root: &RootCert) -> std::result::Result<RootCertStore, String> {
    let mut store = RootCertStore::empty();
    match root {
        RootCert::File(path) => {
            let certs = read_pem(path)?;
            let (_, refused) = store.add_parsable_certificates(certs);
            if store.is_empty() {
                return Err(format!(
                    "sslrootcert {}: no usable certificate ({refused} refused)",
                    path.display()
                ));
            }
        }
        RootCert::System => {
            let found = rustls_native_certs::load_native_certs();
            store.add_parsable_certificates(found.certs);
            if store.is_empty() {
                let why = found.errors.first().map(|e| format!(": {e}")).unwrap_or_default();
                return Err(format!("sslrootcert=system: the system has no trusted certificate{why}"));
            }
        }
        _ => return Err("this kind of sslrootcert is not supported".into()),
    }
    Ok(store)
}

fn read_pem(path: &Path) -> std::result::Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("sslrootcert {}: no PEM certificate in the file", path.display()));
    }
    Ok(certs)
}

/// What `sslmode` checks of the server's certificate. The handshake's signatures are
/// always checked.
struct Verifier {
    /// `verify-ca`, `verify-full`, `require` with `sslrootcert`: the chain must lead to
    /// a trusted root. `None` (`prefer`, `require`): trusted as libpq trusts it, blindly.
    chain: Option<Arc<WebPkiServerVerifier>>,
    /// `verify-full`: the certificate must also name the host.
    check_name: bool,
    algorithms: WebPkiSupportedAlgorithms,
}

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verifier")
            .field("chain", &self.chain.is_some())
            .field("check_name", &self.check_name)
            .finish()
    }
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else { return Ok(ServerCertVerified::assertion()) };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prepared(url: &str) -> Result<tokio_postgres::Config> {
        prepare(&DbUrl::new(url.to_owned()), "host pg9").map(|(c, _)| c)
    }

    #[test]
    fn modes_reach_the_driver() {
        use tokio_postgres::config::SslMode as Driver;
        for (url, mode) in [
            ("postgres://u:pw@h/db", Driver::Prefer),
            ("postgres://u:pw@h/db?sslmode=disable", Driver::Disable),
            ("postgres://u:pw@h/db?sslmode=require", Driver::Require),
            ("host=h user=u sslmode=prefer", Driver::Prefer),
        ] {
            assert_eq!(prepared(url).unwrap().get_ssl_mode(), mode, "{url}");
        }
    }

    #[test]
    fn a_list_of_hosts_asks_for_the_one_that_takes_writes_unless_the_url_chooses() {
        use tokio_postgres::config::TargetSessionAttrs as Attrs;
        for (url, attrs) in [
            ("postgres://u:pw@a:5432,b:5433/db", Attrs::ReadWrite),
            ("postgres://u:pw@a,b/db?sslmode=disable", Attrs::ReadWrite),
            ("host=a,b port=5432,5433 user=u", Attrs::ReadWrite),
            ("hostaddr=10.0.0.1,10.0.0.2 user=u", Attrs::ReadWrite),
            ("postgres://u:pw@a,b/db?target%5Fsession_attrs=read-only", Attrs::ReadOnly),
            ("postgres://u:pw@a:5432,b:5433/db?target_session_attrs=any", Attrs::Any),
            ("host=a,b user=u target_session_attrs=any", Attrs::Any),
            ("postgres://u:pw@a:5432/db", Attrs::Any),
            ("host=a user=u", Attrs::Any),
        ] {
            assert_eq!(prepared(url).unwrap().get_target_session_attrs(), attrs, "{url}");
        }
    }

    #[test]
    fn unreadable_roots_are_named_and_the_url_is_not() {
        let dir = std::env::temp_dir().join(format!("shardline-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let garbage = dir.join("garbage.pem");
        std::fs::write(&garbage, "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").unwrap();
        for (root, wanted) in [
            (dir.join("missing.pem"), "missing.pem: "),
            (empty.clone(), "no PEM certificate in the file"),
            (garbage.clone(), "no usable certificate (1 refused)"),
        ] {
            let url = format!("postgres://u:hunter2@h/db?sslmode=verify-full&sslrootcert={}", root.display());
            let err = prepared(&url).unwrap_err();
            let text = err.to_string();
            assert!(matches!(err, Error::Tls { .. }), "{text}");
            assert!(text.starts_with("host pg9: TLS: "), "{text}");
            assert!(text.contains(wanted), "{text}");
            assert!(!text.contains("hunter2"), "{text}");
        }
        let err = prepared("postgres://u:hunter2@h/db?sslcert=/c.pem").unwrap_err().to_string();
        assert!(err.contains("unknown option `sslcert`") && !err.contains("hunter2"), "{err}");
        let err = prepared("postgres://u:hunter2@h/db?sslmode=verify-ca").unwrap_err().to_string();
        assert!(err.contains("needs sslrootcert") && !err.contains("hunter2"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
