//! `shardline id` as a user runs it: output, exit codes, and nothing on stdout on error.
#![expect(clippy::unwrap_used, reason = "tests")]

use std::process::{Command, Output};

/// The CLI with no config file: neither named nor in the directory it runs in, so the
/// layout is Instagram's.
fn shardline(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardline"))
        .args(args)
        .env_remove("SHARDLINE_CONFIG")
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn encode_then_decode_round_trips() {
    let o = shardline(&["id", "encode", "--unix-ms", "1700000000000", "--shard", "42", "--sequence", "7"]);
    assert!(o.status.success());
    let id = stdout(&o).trim().to_owned();
    assert_eq!(id, "3236157012031088647");
    let o = shardline(&["id", "decode", &id]);
    assert_eq!(stdout(&o), "3236157012031088647  2023-11-14T22:13:20.000Z  shard 42  sequence 7\n");
    let o = shardline(&["id", "decode", "--json", &id, "0"]);
    assert_eq!(
        stdout(&o),
        "{\"id\":\"3236157012031088647\",\"unix_ms\":1700000000000,\"shard\":42,\"sequence\":7}\n\
         {\"id\":\"0\",\"unix_ms\":1314220021721,\"shard\":0,\"sequence\":0}\n"
    );
}

#[test]
fn another_epoch_changes_the_time_only() {
    let o = shardline(&["id", "decode", "--epoch-ms", "1293840000000", "--json", "11637205501278089"]);
    assert_eq!(
        stdout(&o),
        "{\"id\":\"11637205501278089\",\"unix_ms\":1295227263000,\"shard\":1341,\"sequence\":905}\n"
    );
}

#[test]
fn layout_states_the_sign_bit_date() {
    let text = stdout(&shardline(&["id", "layout"]));
    assert!(text.contains("negative from           2413731649497 ms (2046-06-27T17:00:49.497Z)"), "{text}");
    assert!(text.contains("timestamp runs out      3513243277273 ms (2081-04-30T12:54:37.273Z)"), "{text}");
    assert!(text.contains("IDs per ms per shard    1024"), "{text}");
}

#[test]
fn bad_input_exits_2_names_the_field_and_prints_nothing() {
    let cases: &[(&[&str], &str)] = &[
        (&["id", "decode", "12x"], "invalid ID \"12x\""),
        (&["id", "decode", "5", "--", "-5"], "cannot be negative"),
        (&["id", "decode", "9223372036854775808"], "at most 9223372036854775807"),
        (&["id", "decode"], "required arguments"),
        (
            &["id", "encode", "--unix-ms", "5", "--shard", "1", "--sequence", "1"],
            "--unix-ms: allowed 1314220021721",
        ),
        (
            &["id", "encode", "--unix-ms", "2413731649497", "--shard", "1", "--sequence", "1"],
            "--unix-ms: allowed",
        ),
        (
            &["id", "encode", "--unix-ms", "1700000000000", "--shard", "8192", "--sequence", "1"],
            "--shard: allowed 0 to 8191",
        ),
        (
            &["id", "encode", "--unix-ms", "1700000000000", "--shard", "1", "--sequence", "1024"],
            "--sequence: allowed 0 to 1023",
        ),
        (&["id", "encode", "--unix-ms", "x", "--shard", "1", "--sequence", "1"], "--unix-ms"),
        (&["id", "layout", "--epoch-ms", "-5"], "--epoch-ms"),
        (&["id", "layout", "--epoch-ms", "9223372036854775000"], "--epoch-ms"),
        (&["id", "frobnicate"], "unrecognized subcommand"),
        // Another shard's schema: shard 5's IDs minted from shard 3's sequence.
        (&["id", "sql", "--schema", "shard_0003", "--shard", "5"], "it is not shard 5's schema"),
        (&["id", "sql", "--schema", "photos", "--shard", "5"], "it is not shard 5's schema"),
        (&["id", "sql", "--schema", "shard_5", "--shard", "5"], "it is not shard 5's schema"),
        (&["id", "sql", "--schema", "shard_0005", "--shard", "8192"], "--shard: allowed 0 to 8191"),
    ];
    for (args, message) in cases {
        let o = shardline(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(o.stdout.is_empty(), "{args:?} printed {:?}", stdout(&o));
        assert!(err.contains(message), "{args:?}: {err}");
    }
}

#[test]
fn sql_installs_the_minter_in_the_shards_own_schema() {
    for (schema, shard) in [("shard_0005", "5"), ("app_shard_1999", "1999"), ("s8191", "8191")] {
        let o = shardline(&["id", "sql", "--schema", schema, "--shard", shard]);
        assert_eq!(o.status.code(), Some(0), "{schema}: {}", String::from_utf8_lossy(&o.stderr));
        assert!(stdout(&o).contains(&format!("\"{schema}\".next_id()")), "{schema}");
    }
}

#[test]
fn sql_installs_the_configs_minter_and_the_flag_chooses_the_native_one() {
    let native = "LANGUAGE c VOLATILE AS ''shardline_minter'', ''shardline_next_id_v1''";
    let o = shardline(&["id", "sql", "--schema", "shard_0005", "--shard", "5"]);
    assert!(
        stdout(&o).contains("next_id() RETURNS bigint\nLANGUAGE plpgsql") && !stdout(&o).contains(native)
    );
    let o = shardline(&["id", "sql", "--schema", "shard_0005", "--shard", "5", "--native"]);
    assert!(stdout(&o).contains(native), "{}", stdout(&o));
    let dir = std::env::temp_dir().join(format!("shardline-cli-minter-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("shardline.toml");
    let with = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_shardline")).arg("--config").arg(&path).args(args).output().unwrap()
    };
    std::fs::write(&path, "[id]\nminter = \"native\"\n").unwrap();
    let o = with(&["id", "sql", "--schema", "shard_0005", "--shard", "5"]);
    assert!(stdout(&o).contains(native), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::write(&path, "[id]\nminter = \"c\"\n").unwrap();
    let o = with(&["id", "sql", "--schema", "shard_0005", "--shard", "5"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("id.minter: \"c\" is not a minter"), "{err}");
    assert!(o.stdout.is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_epoch_near_the_year_10000_prints_its_times_without_a_panic() {
    // Accepted by the layout; its times from the year 10000 on have no RFC 3339 form.
    for args in [
        &["id", "layout", "--epoch-ms", "253402300800000"][..],
        &["id", "decode", "--epoch-ms", "253402300800000", "0"][..],
        &["id", "layout", "--epoch-ms", "251203277544448"][..],
    ] {
        let o = shardline(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(stdout(&o).contains(" ms"), "{args:?}: {}", stdout(&o));
    }
}

#[test]
fn the_configs_epoch_is_the_default_and_the_flag_overrides_it() {
    let dir = std::env::temp_dir().join(format!("shardline-cli-id-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("migrations")).unwrap();
    let path = dir.join("shardline.toml");
    std::fs::write(
        &path,
        "logical_shards = 16\n[id]\nepoch_ms = 1293840000000\n[catalog]\nurl = \"postgres://app@127.0.0.1:9/c\"\n\
         [[hosts]]\nname = \"pg1\"\nurl = \"postgres://app@127.0.0.1:9/app\"\n",
    )
    .unwrap();
    let with = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_shardline")).arg("--config").arg(&path).args(args).output().unwrap()
    };
    // The config's epoch, as `another_epoch_changes_the_time_only` gives it by flag.
    let o = with(&["id", "decode", "--json", "11637205501278089"]);
    assert_eq!(
        stdout(&o),
        "{\"id\":\"11637205501278089\",\"unix_ms\":1295227263000,\"shard\":1341,\"sequence\":905}\n"
    );
    assert!(stdout(&with(&["id", "layout"])).contains("epoch                   1293840000000 ms"));
    let o = with(&["id", "decode", "--epoch-ms", "1314220021721", "--json", "0"]);
    assert_eq!(stdout(&o), "{\"id\":\"0\",\"unix_ms\":1314220021721,\"shard\":0,\"sequence\":0}\n");
    // An `[id]` table that is wrong is named, with the way around it; so is text that
    // is not TOML.
    for bad in ["[id]\nepoch_ms = -5\n", "logical_shards = = 4\n"] {
        std::fs::write(&path, bad).unwrap();
        let o = with(&["id", "decode", "0"]);
        assert_eq!(o.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("shardline.toml:") && err.contains("--epoch-ms gives it instead"), "{err}");
        assert!(o.stdout.is_empty());
    }
    // Only the `[id]` table is read: a URL naming a variable that is not set is no
    // matter for decoding.
    std::fs::write(
        &path,
        "[id]\nepoch_ms = 1293840000000\n[catalog]\nurl_env = \"SHARDLINE_TEST_UNSET_URL\"\n",
    )
    .unwrap();
    let o = with(&["id", "decode", "--json", "11637205501278089"]);
    assert!(stdout(&o).contains("\"unix_ms\":1295227263000"), "{o:?}");
    // A config file named and missing is an error, not Instagram's epoch in silence.
    let o = Command::new(env!("CARGO_BIN_EXE_shardline"))
        .arg("--config")
        .arg(dir.join("missing.toml"))
        .args(["id", "decode", "--json", "0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot read the config file"), "{o:?}");
    // The same through SHARDLINE_CONFIG; and a `shardline.toml` in the directory is read
    // when nothing names a file.
    let o = Command::new(env!("CARGO_BIN_EXE_shardline"))
        .env("SHARDLINE_CONFIG", dir.join("missing.toml"))
        .args(["id", "decode", "0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let o = Command::new(env!("CARGO_BIN_EXE_shardline"))
        .env_remove("SHARDLINE_CONFIG")
        .current_dir(&dir)
        .args(["id", "decode", "--json", "11637205501278089"])
        .output()
        .unwrap();
    assert!(stdout(&o).contains("\"unix_ms\":1295227263000"), "{o:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
