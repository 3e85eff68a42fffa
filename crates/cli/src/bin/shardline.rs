//! The `shardline` binary: parses options and hands them to [`shardline::run`].

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let opt = shardline::Opt::parse();
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
