//! The `shardline` command line, as a library: option structs (whose doc comments are the
//! help text) and [`run`], which the thin binary in `src/bin/shardline.rs` calls.
//!
//! # Layout
//!
//! - [`id`]: `shardline id decode|encode|layout`, which need no database.
//!
//! More subcommands arrive with the issues that build them (`init`, `migrate`, `map`,
//! `move`, `demo`).
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

pub mod id;

/// A sharding-aware data-access layer for PostgreSQL.
#[derive(Debug, Parser)]
#[command(name = "shardline", version, about, long_about = None)]
pub struct Opt {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Decode, encode and explain 64-bit shard IDs (no database needed).
    Id(id::IdOpt),
}

/// A mistake in what the user typed, found after clap parsed it: the binary prints it
/// and exits with status 2, like clap's own usage errors, with nothing on stdout.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Runs the command line described by `opt`, writing results to `out`.
///
/// # Errors
///
/// [`UsageError`] for bad input; anything else for failures.
pub fn run(opt: Opt, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
    match opt.command {
        Command::Id(opt) => id::run(opt, out),
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
    fn unknown_arguments_are_refused() {
        let err = Opt::try_parse_from(["shardline", "--no-such-flag"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::UnknownArgument);
        assert_eq!(err.exit_code(), 2);
    }
}
