//! Connection URLs and key/value strings: the TLS keys are read out or refused, never a
//! panic; what is left for the driver parses again to itself, without TLS keys; the
//! redacted form never holds the password (in the user's part or the query), and
//! neither does what `split_password`
//! leaves for the catalog; a password put back comes off again as it went in.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardline_router::config::{DbUrl, redact};
use shardline_router::tls::{SslMode, parse};

fuzz_target!(|text: &str| {
    let _ = redact(text);
    if let Ok(p) = parse(text) {
        let again = parse(&p.driver_url).expect("the driver's URL parses again");
        assert_eq!(again.driver_url, p.driver_url);
        assert_eq!((again.mode, again.root_cert), (SslMode::Prefer, None));
    }
    // A password in a URL never survives redaction.
    let secret = "Zq8sEcReT";
    let url = format!("postgres://user:{secret}@{text}");
    if !text.contains(secret) {
        assert!(!redact(&url).contains(secret), "{url}");
        // What the catalog records of a URL holds no password, in either form.
        let (bare, taken) = DbUrl::new(url.clone()).split_password();
        assert!(!bare.expose().contains(secret) && taken.is_some(), "{url}");
        // A key/value string libpq's rules can read (one they cannot is left whole, and
        // the catalog refuses to record it).
        let kv = format!("host=h password={secret} {text}");
        // (Another value that unescapes to the same text is not the password.)
        if parse(&kv).is_ok() && !text.replace('\\', "").contains(secret) {
            let (bare, _) = DbUrl::new(kv.clone()).split_password();
            assert!(!bare.expose().contains(secret), "{kv}");
        }
    }
    // Nor does one in a URL's query, holding a `?` or an `@` as a value may (the drivers
    // end a value at `&` only), whatever comes before it.
    for secret in ["Zq8sEcReT", "Zq8?s@EcR:eT"] {
        let in_query = format!("postgres://{text}&password={secret}");
        if !text.contains("Zq8") && !text.contains("EcR") {
            assert!(!redact(&in_query).contains("Zq8"), "{in_query}");
            assert!(!redact(&in_query).contains("EcR"), "{in_query}");
        }
    }
    // Any password put on a connection string the config accepts comes off again, whole.
    let (bare, _) = DbUrl::new(text.to_owned()).split_password();
    if parse(text).is_ok() && !bare.expose().is_empty() {
        let with = bare.with_password(text);
        let (again, back) = with.split_password();
        assert_eq!(back.as_deref(), Some(text), "{with:?}");
        assert_eq!(again, bare, "{with:?}");
    }
});
