//! The `shardline` binary: parses options and hands them to [`shardline::run`].

use clap::Parser;

fn main() -> anyhow::Result<()> {
    shardline::run(shardline::Opt::parse())
}
