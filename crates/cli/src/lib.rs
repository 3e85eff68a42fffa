//! The `shardline` command line, as a library: option structs (whose doc comments are the
//! help text) and [`run`], which the thin binary in `src/bin/shardline.rs` calls.
//!
//! Subcommands arrive with the issues that build them (`init`, `migrate`, `map`, `move`,
//! `demo`, ...); until then the command only answers `--help` and `--version`.
#![forbid(unsafe_code)]

use clap::Parser;

/// A sharding-aware data-access layer for PostgreSQL.
#[derive(Debug, Parser)]
#[command(name = "shardline", version, about, long_about = None)]
pub struct Opt {}

/// Runs the command line described by `opt`.
///
/// # Errors
///
/// None yet: there are no subcommands.
pub fn run(opt: Opt) -> anyhow::Result<()> {
    let Opt {} = opt;
    Ok(())
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
    }
}
