//! The `shardline` binary: parses options and hands them to [`shardline::run`].

use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let opt = shardline::Opt::parse();
    // Logs go to stderr, filtered by SHARDLINE_LOG (e.g. `shardline_ops=debug`); warnings
    // and errors only by default. They never hold a password: at debug they include the
    // driver's own lines (tokio-postgres logs through `log`, bridged here), which quote
    // the statements it runs; the one statement holding a peer_url goes by a path it
    // does not log (shardline_ops's `moves::subscription`). Not capped here on purpose:
    // the fix must hold for library users' subscribers too, and `tests/secrets.rs` runs
    // this binary at trace to check it.
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_env("SHARDLINE_LOG").unwrap_or_else(|_| EnvFilter::new("warn")))
        .with_writer(std::io::stderr)
        .init();
    let mut stdout = std::io::stdout().lock();
    match shardline::run(opt, &mut stdout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<shardline::UsageError>().is_some() => {
            eprintln!("error: {e}\n\nFor more information, try '--help'.");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
