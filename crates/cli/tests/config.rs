//! The config file as a user gets it wrong: every mistake exits 2 naming the file, line
//! and key, prints nothing on stdout, and never prints a secret.
#![expect(clippy::unwrap_used, reason = "tests")]

use std::path::PathBuf;
use std::process::{Command, Output};

/// A config file in a directory of its own, removed with it when dropped.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = PathBuf;
    fn deref(&self) -> &PathBuf {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn config(name: &str, text: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("shardline-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(dir.join("migrations")).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    Scratch(path)
}

fn shardline(config: &PathBuf, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardline"))
        .arg("--config")
        .arg(config)
        .args(args)
        .env_remove("PG1_URL")
        .output()
        .unwrap()
}

const GOOD_TAIL: &str = "[catalog]\nurl = \"postgres://app:hunter2@127.0.0.1:9/catalog\"\n\n\
                         [[hosts]]\nname = \"pg1\"\nurl = \"postgres://app:hunter2@127.0.0.1:9/app\"\n";

#[test]
fn every_config_mistake_names_file_line_and_key() {
    let cases: &[(&str, String, &str)] = &[
        (
            "unknown-key.toml",
            format!("logical_shard = 16\n{GOOD_TAIL}"),
            ":1: toml: unknown field `logical_shard`",
        ),
        (
            "zero-shards.toml",
            format!("logical_shards = 0\n{GOOD_TAIL}"),
            ":1: logical_shards: 0 is out of range 1..=8192",
        ),
        (
            "too-many.toml",
            format!("\nlogical_shards = 8193\n{GOOD_TAIL}"),
            ":2: logical_shards: 8193 is out of range 1..=8192",
        ),
        (
            "prefix.toml",
            format!("schema_prefix = \"Shard\"\n{GOOD_TAIL}"),
            ":1: schema_prefix: \"Shard\" is not allowed: must start with a lowercase ASCII letter or an underscore",
        ),
        (
            "env.toml",
            "[catalog]\nurl = \"postgres://c/db\"\n[[hosts]]\nname = \"pg1\"\nurl_env = \"PG1_URL\"\n"
                .to_owned(),
            ":5: hosts[0].url_env: names an environment variable that is not set",
        ),
        (
            "credentials.toml",
            "[catalog]\nurl = \"postgres://c/db\"\n[credentials]\npassword_env = \"PW\"\n".to_owned(),
            ":4: credentials.password_env: must name an environment variable with {host} in it",
        ),
        (
            "twice.toml",
            format!("{GOOD_TAIL}\n[[hosts]]\nname = \"pg1\"\nurl = \"postgres://x/y\"\n"),
            ":9: hosts[1].name: pg1 is already the name of hosts[0]",
        ),
        (
            "epoch.toml",
            format!("{GOOD_TAIL}[id]\nepoch_ms = -5\n"),
            ":8: id.epoch_ms: invalid ID layout: the epoch cannot be before 1970",
        ),
    ];
    for (name, text, message) in cases {
        let path = config(name, text);
        for command in [&["init"][..], &["migrate"], &["map"], &["status"], &["locate", "--user", "1"]] {
            let o = shardline(&path, command);
            let stderr = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{name} {command:?}: {stderr}");
            assert!(o.stdout.is_empty(), "{name}: printed on stdout");
            let want = format!("error: {}{message}", path.display());
            assert!(stderr.starts_with(&want), "{name} {command:?}:\n{stderr}\nwanted: {want}");
            assert!(!stderr.contains("hunter2"), "{name}: a password was printed: {stderr}");
        }
    }
}

#[test]
fn a_missing_config_file_is_named() {
    let path = PathBuf::from("/no/such/dir/shardline.toml");
    let o = shardline(&path, &["map"]);
    assert_eq!(o.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.starts_with("error: cannot read the config file /no/such/dir/shardline.toml: "),
        "{stderr}"
    );
}

#[test]
fn an_unreachable_catalog_fails_without_printing_its_password() {
    let path = config("unreachable.toml", GOOD_TAIL);
    let o = shardline(&path, &["map"]);
    assert_eq!(o.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.starts_with("error: catalog is unreachable: "), "{stderr}");
    assert!(!stderr.contains("hunter2") && !stderr.contains("127.0.0.1"), "{stderr}");
    let o = shardline(&path, &["init"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr.starts_with("error: a host is unreachable, so nothing was changed: pg1: "), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

#[test]
fn locate_needs_a_user_or_an_id() {
    let path = config("locate.toml", GOOD_TAIL);
    let o = shardline(&path, &["locate"]);
    assert_eq!(o.status.code(), Some(2));
    let o = shardline(&path, &["locate", "--id", "not-an-id"]);
    assert_eq!(o.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.starts_with("error: invalid value \"not-an-id\" for --id"), "{stderr}");
}
