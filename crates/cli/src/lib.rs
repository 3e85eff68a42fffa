//! The `shardline` command line, as a library: option structs (whose doc comments are the
//! help text) and [`run`], which the thin binary in `src/bin/shardline.rs` calls.
//!
//! # Layout
//!
//! - [`id`]: `shardline id decode|encode|layout|sql`, which need no database.
//! - [`cluster`]: `init`, `migrate`, `map`, `locate`, `status`, which work on the
//!   cluster a config file describes.
//! - [`moves`]: `move`, `moves`, `rebalance`, `gc`.
//! - [`hosts`]: `host list|add|readdress|drain|remove`.
//! - `demo`: `demo`, the whole product on a cluster of its own (with the `demo` feature,
//!   which brings the test kit; a production build leaves both out).
//!
//! # Example
//!
//! ```
//! use clap::Parser as _;
//!
//! let opt = shardline::Opt::parse_from(["shardline", "id", "decode", "3236157012031088647"]);
//! let mut out = Vec::new();
//! shardline::run(opt, &mut out)?;
//! assert!(String::from_utf8_lossy(&out).contains("shard 42"));
//! # Ok::<(), anyhow::Error>(())
//! ```
#![forbid(unsafe_code)]

use std::path::PathBuf;

use clap::{Parser, Subcommand};

pub mod cluster;
#[cfg(feature = "demo")]
pub mod demo;
pub mod hosts;
pub mod id;
pub mod moves;

/// A sharding-aware data-access layer for PostgreSQL.
#[derive(Debug, Parser)]
#[command(name = "shardline", version, about, long_about = None)]
pub struct Opt {
    /// The cluster's config file (TOML) [default: shardline.toml].
    #[arg(long, global = true, env = "SHARDLINE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start a cluster of real Postgres hosts, run a workload through shardline, move a
    /// busy shard and rebalance onto a new host while it runs, print a summary, remove it.
    #[cfg(feature = "demo")]
    Demo(demo::DemoOpt),
    /// The demo, in a build without it: says how to get it.
    #[cfg(not(feature = "demo"))]
    #[command(hide = true)]
    Demo {
        /// Whatever was given; ignored.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Decode, encode and explain 64-bit shard IDs (no database needed).
    Id(id::IdOpt),
    /// Create the catalog, place the shards, create every shard schema with its ID
    /// minter, apply the migrations. Idempotent; resumes an interrupted run.
    Init(cluster::ApplyOpt),
    /// Apply pending migrations to every shard schema, one transaction per shard.
    Migrate(cluster::ApplyOpt),
    /// Show the shard map: hosts, their shard ranges, the map version.
    Map(cluster::MapOpt),
    /// Show where a user's or an ID's rows live: shard, schema, host.
    Locate(cluster::LocateOpt),
    /// Show each host: reachable or not, its shards, rows and bytes per table.
    Status(cluster::StatusOpt),
    /// Move a logical shard to another host, online (`--to`); finish (`--resume`) or
    /// undo (`--abort`) an interrupted move; `--dry-run` checks and changes nothing.
    Move(moves::MoveOpt),
    /// Show the journal of moves: each move, its step, its numbers.
    Moves(moves::MovesOpt),
    /// Even out the hosts by bytes: `--plan` prints the moves, `--apply` runs them.
    Rebalance(moves::RebalanceOpt),
    /// Drop what moves left behind: old source schemas after a grace period, and any
    /// publication, subscription or slot no running move owns.
    Gc(moves::GcOpt),
    /// Hosts join and leave the running cluster: `list`, `add`, `readdress`, `drain`,
    /// `remove`. Running applications follow through the catalog.
    Host(hosts::HostOpt),
}

/// A mistake in what the user typed, found after clap parsed it: the binary prints it
/// and exits with status 2, like clap's own usage errors, with nothing on stdout.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The config file read when `--config` and `SHARDLINE_CONFIG` name none.
pub const DEFAULT_CONFIG: &str = "shardline.toml";

/// Runs the command line described by `opt`, writing results to `out`.
///
/// # Errors
///
/// [`UsageError`] for bad input; anything else for failures.
pub fn run(opt: Opt, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
    let Opt { config: given, command } = opt;
    let config_path = given.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG));
    let config = || cluster::load_config(&config_path);
    match command {
        Command::Id(o) => id::run(o, given.as_deref(), out),
        #[cfg(feature = "demo")]
        Command::Demo(o) => demo::demo(&o, out),
        #[cfg(not(feature = "demo"))]
        Command::Demo { .. } => Err(UsageError(
            "this shardline was built without the demo: run `cargo run -p shardline --features demo -- demo`"
                .into(),
        )
        .into()),
        Command::Init(o) => cluster::apply(&config()?, &o, true, out),
        Command::Migrate(o) => cluster::apply(&config()?, &o, false, out),
        Command::Map(o) => cluster::map(&config()?, &o, out),
        Command::Locate(o) => cluster::locate(&config()?, &o, out),
        Command::Status(o) => cluster::status(&config()?, &o, out),
        Command::Move(o) => moves::move_shard(&config()?, &o, out),
        Command::Moves(o) => moves::moves(&config()?, &o, out),
        Command::Rebalance(o) => moves::rebalance(&config()?, &o, out),
        Command::Gc(o) => moves::gc(&config()?, &o, out),
        Command::Host(o) => hosts::host(&config()?, &o, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Opt::command().debug_assert();
    }

    #[test]
    fn every_subcommand_refuses_malformed_arguments_with_usage_and_status_2() {
        let bad: &[&[&str]] = &[
            &["init", "--jobs", "0"],
            &["init", "--lock-timeout", "soon"],
            &["migrate", "--shard-timeout", "-1s"],
            &["migrate", "--jobs", "x"],
            &["map", "--bogus"],
            &["locate"],
            &["locate", "--user", "1", "--id", "2"],
            &["locate", "--user", "one"],
            &["status", "--timeout", "-1s"],
            &["move"],
            &["move", "5"],
            &["move", "5", "--to", "pg2", "--resume"],
            &["move", "--dry-run"],
            &["move", "x", "--to", "pg2"],
            &["move", "70000", "--to", "pg2"],
            &["move", "5", "--to", "pg2", "--stop-after", "lunch"],
            &["move", "5", "--to", "pg2", "--max-lag", "fast"],
            &["move", "5", "--to", "pg2", "--max-rate", "5", "--subscription-copy"],
            &["move", "5", "--abort", "--max-rate", "5"],
            &["move", "5", "--revert", "--subscription-copy"],
            &["move", "5", "--to", "pg2", "--max-rate", "fast"],
            &["rebalance", "--apply", "--max-rate", "1", "--subscription-copy"],
            &["host", "drain", "pg1", "--max-rate", "2", "--subscription-copy"],
            &["moves", "extra"],
            &["rebalance"],
            &["rebalance", "--plan", "--apply"],
            &["rebalance", "--plan", "--max-moves", "0"],
            &["rebalance", "--apply", "--parallel", "99"],
            &["gc", "--grace", "a while"],
            #[cfg(feature = "demo")]
            &["demo", "--hosts", "1"],
            #[cfg(feature = "demo")]
            &["demo", "--backend", "cloud"],
            #[cfg(feature = "demo")]
            &["demo", "--seconds", "0"],
            &["id"],
            &["id", "decode", "--epoch-ms", "soon", "1"],
        ];
        for args in bad {
            let argv = std::iter::once("shardline").chain(args.iter().copied());
            match Opt::try_parse_from(argv) {
                Ok(opt) => panic!("{args:?} was accepted: {opt:?}"),
                Err(e) => {
                    assert_eq!(e.exit_code(), 2, "{args:?}: {e}");
                    let text = e.render().to_string();
                    assert!(text.contains("Usage:") || text.contains("try '--help'"), "{args:?}: {text}");
                }
            }
        }
    }

    #[test]
    fn mistakes_clap_cannot_see_are_usage_errors_before_any_io() {
        let dir = std::env::temp_dir().join(format!("shardline-cli-usage-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        // A missing config file is named; nothing is contacted.
        let missing = dir.join("nope.toml");
        for args in [&["map"][..], &["move", "--abort"], &["status"], &["gc"]] {
            let mut argv = vec!["shardline", "--config"];
            let path = missing.display().to_string();
            argv.push(&path);
            argv.extend(args.iter().copied());
            let opt = Opt::try_parse_from(&argv).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            let err = run(opt, &mut Vec::new()).unwrap_err();
            assert!(err.downcast_ref::<UsageError>().is_some(), "{args:?}: {err}");
            assert!(err.to_string().contains("nope.toml"), "{err}");
        }
        // A valid config, but no shard where one is needed: refused before connecting.
        let config = dir.join("shardline.toml");
        let _ = std::fs::write(
            &config,
            "[catalog]\nurl = \"postgres://u@127.0.0.1:1/db\"\n[[hosts]]\nname = \"pg1\"\nurl = \"postgres://u@127.0.0.1:1/db\"\n",
        );
        for args in [&["move", "--abort"][..], &["move", "--to", "pg1"]] {
            let path = config.display().to_string();
            let argv = [&["shardline", "--config", path.as_str()][..], args].concat();
            let opt = Opt::try_parse_from(&argv).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            let err = run(opt, &mut Vec::new()).unwrap_err();
            assert!(err.downcast_ref::<UsageError>().is_some(), "{args:?}: {err}");
            assert!(err.to_string().contains("which shard?"), "{err}");
        }
        // A shard past the largest, or past the config's count (2000 here, which `init`
        // made the catalog's), a host name that cannot be one: usage (exit 2).
        for (args, says) in [
            (&["move", "8192", "--to", "pg1"][..], "shard: "),
            (&["move", "2000", "--to", "pg1"], "shard: "),
            (&["move", "3000", "--revert"], "shard: "),
            (&["move", "5", "--to", "pg 2"], "--to: "),
        ] {
            let path = config.display().to_string();
            let argv = [&["shardline", "--config", path.as_str()][..], args].concat();
            let opt = Opt::try_parse_from(&argv).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            let err = run(opt, &mut Vec::new()).unwrap_err();
            assert!(err.downcast_ref::<UsageError>().is_some(), "{args:?}: {err}");
            assert!(err.to_string().starts_with(says), "{err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn unknown_arguments_are_refused() {
        let err = Opt::try_parse_from(["shardline", "--no-such-flag"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::UnknownArgument);
        assert_eq!(err.exit_code(), 2);
    }
}
