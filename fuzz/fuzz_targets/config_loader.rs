//! The config file: any text is loaded or refused with an error naming the file, a line
//! and a key, never a panic; a config that loads has URLs whose TLS keys parse and a map
//! that can be laid out.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use shardline_router::{Config, Error};

fuzz_target!(|text: &str| {
    let env = |var: &str| (var.len() < 6).then(|| format!("postgres://app:pw{var}@h/db"));
    match Config::from_toml(text, "fuzz.toml", Path::new("/etc/shardline"), &env) {
        Ok(config) => {
            assert!(config.catalog.tls().is_ok());
            for h in &config.hosts {
                assert!(h.url.tls().is_ok());
                let _ = (h.url.redacted(), h.peer_url.redacted());
            }
            let _ = config.even_map();
        }
        Err(Error::Config { file, line, .. }) => {
            assert_eq!(file, "fuzz.toml");
            assert!(line >= 1 && line <= text.lines().count().max(1) + 1, "line {line}");
        }
        Err(other) => panic!("a config error that names no line: {other}"),
    }
});
