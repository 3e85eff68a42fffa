//! Connection URLs and key/value strings: the TLS keys are read out or refused, never a
//! panic; what is left for the driver parses again to itself, without TLS keys; the
//! redacted form never holds the password.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shardline_router::config::redact;
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
    }
});
