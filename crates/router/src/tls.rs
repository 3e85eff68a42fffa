//! How a connection URL asks for TLS: libpq's `sslmode` and `sslrootcert`, read out of
//! the URL so the driver (which knows only `disable`, `prefer` and `require`) never sees
//! what it would refuse. Pure: no file is read here.
//!
//! | `sslmode` | encrypted | certificate checked |
//! |---|---|---|
//! | `disable` | no | — |
//! | `prefer` (the default, as in libpq) | when the server offers it | no |
//! | `require` | yes | no; with `sslrootcert`, the chain (as libpq) |
//! | `verify-ca` | yes | the chain, against `sslrootcert` |
//! | `verify-full` | yes | the chain and the host name, against `sslrootcert` |
//!
//! `sslrootcert` is a PEM file of trusted certificates, or `system` for the operating
//! system's store.

use std::fmt;
use std::path::PathBuf;

/// libpq's `sslmode`, less `allow` (which the driver cannot do).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SslMode {
    /// Never encrypt.
    Disable,
    /// Encrypt when the server offers TLS; check no certificate.
    #[default]
    Prefer,
    /// Always encrypt; check the chain only when `sslrootcert` is given.
    Require,
    /// Always encrypt; the certificate must chain to `sslrootcert`.
    VerifyCa,
    /// Always encrypt; the certificate must chain to `sslrootcert` and name the host.
    VerifyFull,
}

impl SslMode {
    /// The name libpq gives the mode.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    fn parse(value: &str) -> Result<SslMode, String> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            "allow" => return Err("sslmode=allow is not supported: use prefer or require".into()),
            other => {
                return Err(format!(
                    "sslmode={other:?} is not one of disable, prefer, require, verify-ca, verify-full"
                ));
            }
        })
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where trusted certificates come from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RootCert {
    /// A PEM file of one or more certificates.
    File(PathBuf),
    /// The operating system's trust store (`sslrootcert=system`).
    System,
}

/// What a URL asks of TLS, and the URL without the keys the driver does not take.
/// Its `Debug` shows the URL without its password.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsParams {
    /// The mode (default [`SslMode::Prefer`]).
    pub mode: SslMode,
    /// The trusted certificates, when given.
    pub root_cert: Option<RootCert>,
    /// The URL with `sslmode` and `sslrootcert` removed, for the driver. Holds the
    /// password if the URL did: never log it.
    pub driver_url: String,
    /// Whether the URL sets `target_session_attrs` (left in `driver_url`). Where it does
    /// not and lists several hosts, shardline asks for `read-write`: every connection it
    /// makes may write, and a standby listed first must not be the one it keeps.
    pub sets_target_session_attrs: bool,
}

impl std::fmt::Debug for TlsParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsParams")
            .field("mode", &self.mode)
            .field("root_cert", &self.root_cert)
            .field("driver_url", &crate::config::redact(&self.driver_url))
            .field("sets_target_session_attrs", &self.sets_target_session_attrs)
            .finish()
    }
}

impl TlsParams {
    /// Whether the server's certificate chain is checked.
    pub fn verifies_chain(&self) -> bool {
        matches!(self.mode, SslMode::VerifyCa | SslMode::VerifyFull)
            || (self.mode == SslMode::Require && self.root_cert.is_some())
    }
}

/// Reads `sslmode` and `sslrootcert` out of a `postgres://` URL or a `key=value`
/// connection string.
///
/// # Errors
///
/// A message naming the key: an unknown `sslmode`, `verify-ca`/`verify-full` without
/// `sslrootcert`, an empty `sslrootcert`, a key given twice, or a quoted value left open.
pub fn parse(url: &str) -> Result<TlsParams, String> {
    // The driver's own rule: a URL starts with its scheme; anything else is key=value
    // pairs (whose values may hold "://", as in `application_name=http://x`).
    let is_url = crate::config::url_form(url).is_some();
    // Then the first `?` starts the query the driver reads.
    crate::config::check_url_parts(url)?;
    let (base, pairs) = if is_url {
        match url.split_once('?') {
            Some((base, query)) => (
                Some(base),
                query
                    .split('&')
                    .filter(|kv| !kv.is_empty())
                    .map(|kv| {
                        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                        (k.to_owned(), v.to_owned())
                    })
                    .collect(),
            ),
            None => (Some(url), Vec::new()),
        }
    } else {
        (None, key_values(url)?)
    };
    let mut mode = None;
    let mut root = None;
    let mut sets_target_session_attrs = false;
    let mut kept = Vec::with_capacity(pairs.len());
    for (k, v) in pairs {
        let value = if is_url { percent_decode(&v)? } else { v.clone() };
        // Compared decoded, as the driver decodes a URL's keys: `ssl%6Dode=require` is
        // its `sslmode`, and left to it would be overridden by the mode found here.
        let key = if is_url { percent_decode(&k)? } else { k.clone() };
        match key.as_str() {
            "sslmode" => {
                if mode.replace(SslMode::parse(&value)?).is_some() {
                    return Err("sslmode is given twice".into());
                }
            }
            "sslrootcert" => {
                if value.is_empty() {
                    return Err("sslrootcert is empty".into());
                }
                let r = if value == "system" { RootCert::System } else { RootCert::File(value.into()) };
                if root.replace(r).is_some() {
                    return Err("sslrootcert is given twice".into());
                }
            }
            "target_session_attrs" => {
                sets_target_session_attrs = true;
                kept.push((k, v));
            }
            _ => kept.push((k, v)),
        }
    }
    // As libpq (16): the system's store trusts any certificate a public CA signed, for
    // any name, so it goes with checking the name, and is verify-full by default.
    if root == Some(RootCert::System) {
        match mode {
            None | Some(SslMode::VerifyFull) => mode = Some(SslMode::VerifyFull),
            Some(other) => {
                return Err(format!(
                    "sslrootcert=system needs sslmode=verify-full, not {other} (as libpq: the system's \
                     store trusts a certificate any public CA signed, for any name)"
                ));
            }
        }
    }
    let mode = mode.unwrap_or_default();
    if matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull) && root.is_none() {
        return Err(format!(
            "sslmode={mode} needs sslrootcert=<PEM file of the trusted CA> (or sslrootcert=system)"
        ));
    }
    if mode == SslMode::Disable && root.is_some() {
        return Err("sslrootcert is given but sslmode=disable turns TLS off".into());
    }
    let driver_url = match base {
        Some(base) if kept.is_empty() => base.to_owned(),
        Some(base) => {
            let query: Vec<String> = kept.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("{base}?{}", query.join("&"))
        }
        None => kept
            .iter()
            .map(|(k, v)| format!("{k}='{}'", v.replace('\\', "\\\\").replace('\'', "\\'")))
            .collect::<Vec<_>>()
            .join(" "),
    };
    Ok(TlsParams { mode, root_cert: root, driver_url, sets_target_session_attrs })
}

/// `key=value` pairs of a libpq connection string; values may be single-quoted with `\`
/// escapes, and spaces may surround `=`.
pub(crate) fn key_values(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return Ok(out);
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            // Never the key whole: a mistyped URL (`mysql://u:pw@h`) would show its
            // password; its scheme only, and nothing of any other word (a word of an
            // unquoted passphrase).
            if !key.contains("://") {
                return Err(
                    "a word of the connection string is not a key=value (quote a value that holds spaces: \
                     password='a b'; a URL starts with postgres:// or postgresql://)"
                        .to_owned(),
                );
            }
            let shown: String = key.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            return Err(format!(
                "{shown:?}{} is not a connection string key (a URL starts with postgres:// or postgresql://)",
                if shown.len() < key.len() { "..." } else { "" }
            ));
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') {
            // Not echoed: an unquoted value with spaces (a passphrase) splits into words.
            return Err(
                "a word of the connection string has no value (quote a value that holds spaces: password='a b')"
                    .to_owned(),
            );
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            loop {
                match chars.next() {
                    None => return Err(format!("the quoted value of {key} is not closed")),
                    Some('\'') => break,
                    Some('\\') => match chars.next() {
                        Some(c) => value.push(c),
                        None => return Err(format!("the quoted value of {key} is not closed")),
                    },
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                value.push(if c == '\\' {
                    chars.next();
                    chars.peek().copied().unwrap_or('\\')
                } else {
                    c
                });
                chars.next();
            }
        }
        out.push((key, value));
    }
}

pub(crate) fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .ok_or_else(|| "a bad %-escape (the value is not shown: it may be a password)".to_owned())?;
            let b = u8::from_str_radix(hex, 16)
                .map_err(|_| "a bad %-escape (the value is not shown: it may be a password)".to_owned())?;
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| "a value is not UTF-8 once decoded (not shown: it may be a password)".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_default_to_prefer_and_keep_other_keys() {
        let p = parse("postgres://app:pw@h:5432/db?application_name=x&connect_timeout=3").unwrap();
        assert_eq!(p.mode, SslMode::Prefer);
        assert_eq!(p.root_cert, None);
        assert_eq!(p.driver_url, "postgres://app:pw@h:5432/db?application_name=x&connect_timeout=3");
        assert!(!p.verifies_chain());
    }

    #[test]
    fn the_driver_url_is_shown_without_its_password() {
        let p = parse("postgres://app:hunter2@h/db?sslmode=require&password=hunter3").unwrap();
        let shown = format!("{p:?}");
        assert!(!shown.contains("hunter2") && !shown.contains("hunter3"), "{shown}");
    }

    #[test]
    fn tls_keys_are_taken_out_of_urls() {
        let p = parse("postgres://app@h/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&x=1").unwrap();
        assert_eq!(p.mode, SslMode::VerifyFull);
        assert_eq!(p.root_cert, Some(RootCert::File("/etc/ca.pem".into())));
        assert_eq!(p.driver_url, "postgres://app@h/db?x=1");
        let p = parse("postgres://app@h/db?sslmode=require").unwrap();
        assert_eq!((p.mode, p.driver_url.as_str()), (SslMode::Require, "postgres://app@h/db"));
        assert!(!p.verifies_chain());
        // The system's store goes with verify-full, as in libpq: by default, and any
        // weaker mode refused (any public certificate, for any name, would pass).
        let p = parse("postgres://h/db?sslrootcert=system").unwrap();
        assert_eq!((p.mode, p.root_cert.clone()), (SslMode::VerifyFull, Some(RootCert::System)));
        assert!(p.verifies_chain());
        for weak in ["require", "verify-ca", "prefer", "disable"] {
            let err = parse(&format!("postgres://h/db?sslmode={weak}&sslrootcert=system")).unwrap_err();
            assert!(err.contains("sslrootcert=system needs sslmode=verify-full"), "{weak}: {err}");
        }
        // Keys are read decoded, as the driver reads them: an encoded `sslmode` is the
        // mode asked for, not left to the driver and overridden by the default `prefer`.
        let p = parse("postgres://app@h/db?ssl%6Dode=require&%73slrootcert=%2Fca.pem&x=1").unwrap();
        assert_eq!(p.mode, SslMode::Require);
        assert_eq!(p.root_cert, Some(RootCert::File("/ca.pem".into())));
        assert_eq!(p.driver_url, "postgres://app@h/db?x=1");
        assert!(p.verifies_chain(), "require with a root certificate checks the chain, as libpq");
        let err = parse("postgres://h/db?sslmode=require&ssl%6dode=disable").unwrap_err();
        assert!(err.contains("sslmode is given twice"), "{err}");
        // A `?` in a password: the driver's query starts after the `@`, so the `sslmode`
        // there was read by shardline as part of a key, and the default `prefer` put
        // over the driver's `require`. URLs the drivers split differently are refused,
        // naming no part of them; encoded, the same password is taken.
        for ambiguous in [
            "postgres://app:9x?Lq@pg1/app?sslmode=require&sslrootcert=/ca.pem",
            "postgres://app:9x/Lq@pg1/app?sslmode=require",
            "postgres://app:9x#Lq@pg1/app?sslmode=require",
            "postgres://app:9x@Lq@pg1/app?sslmode=require",
            "postgres://pg1/app?sslmode=require&application_name=api@web1",
        ] {
            let err = parse(ambiguous).unwrap_err();
            assert!(err.contains("percent-encode"), "{ambiguous}: {err}");
            assert!(!err.contains("9x") && !err.contains("Lq") && !err.contains("web1"), "{err}");
        }
        let p = parse("postgres://app:9x%3FLq@pg1/app?sslmode=require&application_name=api@web1").unwrap();
        assert_eq!(p.mode, SslMode::Require);
        assert_eq!(p.driver_url, "postgres://app:9x%3FLq@pg1/app?application_name=api@web1");
    }

    #[test]
    fn tls_keys_are_taken_out_of_key_value_strings() {
        let p = parse("host=h user=app password='it''s' sslmode = verify-ca sslrootcert='/a b/ca.pem'");
        assert!(p.is_err(), "'' is not an escape in libpq: the string is malformed");
        let p = parse("host=h user=app password='it\\'s x' sslmode = verify-ca sslrootcert='/a b/ca.pem'")
            .unwrap();
        assert_eq!(p.mode, SslMode::VerifyCa);
        assert_eq!(p.root_cert, Some(RootCert::File("/a b/ca.pem".into())));
        assert_eq!(p.driver_url, "host='h' user='app' password='it\\'s x'");
    }

    #[test]
    fn a_key_value_string_may_hold_a_url_in_a_value() {
        let p = parse("host=h application_name=http://x sslmode=require").unwrap();
        assert_eq!(
            (p.mode, p.driver_url.as_str()),
            (SslMode::Require, "host='h' application_name='http://x'")
        );
        assert_eq!(parse(&p.driver_url).unwrap().driver_url, p.driver_url);
    }

    #[test]
    fn mistakes_name_the_key() {
        for (url, wanted) in [
            ("postgres://h/db?sslmode=verify_full", "sslmode=\"verify_full\" is not one of"),
            ("postgres://h/db?sslmode=allow", "sslmode=allow is not supported"),
            ("postgres://h/db?sslmode=verify-full", "needs sslrootcert"),
            ("postgres://h/db?sslmode=verify-ca", "needs sslrootcert"),
            ("postgres://h/db?sslmode=require&sslmode=disable", "sslmode is given twice"),
            ("postgres://h/db?sslrootcert=", "sslrootcert is empty"),
            ("postgres://h/db?sslmode=disable&sslrootcert=/ca.pem", "sslmode=disable turns TLS off"),
            ("postgres://h/db?sslrootcert=%zz", "bad %-escape"),
            ("host=h sslrootcert='/ca.pem", "not closed"),
            ("host=h sslmode", "has no value"),
            ("host=h =x", "a word of the connection string is not a key=value"),
            ("\npostgresql://=/", "\"postgresql\"... is not a connection string key"),
            (
                "mysql://u:pw@h/db",
                "\"mysql\"... is not a connection string key (a URL starts with postgres://",
            ),
        ] {
            let err = parse(url).unwrap_err();
            assert!(err.contains(wanted), "{url}: {err}");
        }
        // An unquoted passphrase splits into words: none of them is shown.
        for url in ["host=h password=correct horse staple", "host=h password=correct horse! staple"] {
            let err = parse(url).unwrap_err();
            assert!(!err.contains("horse") && !err.contains("staple"), "{err}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_text_parses_or_is_refused_without_a_panic(s in "\\PC{0,80}") {
            let _ = parse(&s);
        }

        #[test]
        fn kept_keys_survive_a_round_trip(v in "[a-z0-9 '\\\\]{0,12}") {
            let escaped = v.replace('\\', "\\\\").replace('\'', "\\'");
            let p = parse(&format!("host=h application_name='{escaped}' sslmode=require")).unwrap();
            let again = parse(&p.driver_url).unwrap();
            proptest::prop_assert_eq!(again.driver_url, p.driver_url);
            proptest::prop_assert!(again.mode == SslMode::Prefer);
        }
    }
}
