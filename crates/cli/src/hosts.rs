//! `shardline host list|add|readdress|drain|remove`: hosts join and leave a running
//! cluster (see [`shardline_ops::fleet`]).

use std::io::Write;

use clap::{Args, Subcommand};
use shardline_ops::moves::MoveOptions;
use shardline_router::config::DbUrl;
use shardline_router::{Config, HostName};

use crate::UsageError;
use crate::cluster::runtime;
use crate::moves::{moves_failed, print_moves, report_moves};

/// Options of `host`.
#[derive(Debug, Args)]
pub struct HostOpt {
    /// What to do.
    #[command(subcommand)]
    pub command: HostCommand,
}

/// The `host` subcommands.
#[derive(Debug, Subcommand)]
pub enum HostCommand {
    /// Every host the catalog knows: its state, address (never a password) and shards.
    List {
        /// Print one JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Register a host, after connecting to it (it must run wal_level = logical and
    /// have the config's app_roles). It holds no shard until moves place some there
    /// (`shardline rebalance --apply`). Running applications open a pool for it.
    Add {
        /// The host's name.
        name: String,
        /// Where shardline reaches it (default: the config's [[hosts]] entry). Without a
        /// password: the catalog records none, and a command line is seen by others;
        /// passwords come from the config's [credentials].
        #[arg(long, value_name = "URL")]
        url: Option<String>,
        /// Where the other hosts reach it, for moves (default: the URL).
        #[arg(long, value_name = "URL")]
        peer_url: Option<String>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Record where a host lives now (after a failover, or new hardware). Refused
    /// unless every shard the map places on it is at the new address. Running
    /// applications reconnect there.
    Readdress {
        /// The host's name.
        name: String,
        /// Where shardline reaches it now (no password, as for `add`).
        #[arg(long, value_name = "URL")]
        url: String,
        /// Where the other hosts reach it now (default: the URL).
        #[arg(long, value_name = "URL")]
        peer_url: Option<String>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Move every shard of a host to the other active hosts, online; from the start no
    /// move targets it. Run it again to finish after a failed move.
    Drain {
        /// The host's name.
        name: String,
        /// Print the moves, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Moves at a time.
        #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=16))]
        parallel: u16,
        /// How each move copies its shard's rows (see `move`).
        #[command(flatten)]
        copy: crate::moves::CopyArgs,
        /// Print one JSON object: with `--dry-run` the plan; else the moves, what the
        /// host still holds, and whether it is drained.
        #[arg(long)]
        json: bool,
    },
    /// Retire a host that holds no shard (drain it first). Running applications close
    /// its pool.
    Remove {
        /// The host's name.
        name: String,
    },
}

/// A drain's exit status: failed when a move failed, when the host still holds a shard
/// (a move onto it that was under way when the drain began, say), or when what it holds
/// could not be read after the moves.
fn drained(report: &shardline_ops::fleet::DrainReport) -> anyhow::Result<()> {
    moves_failed(&report.moves)?;
    match report.remaining {
        _ if report.drained() => Ok(()),
        Some(n) => anyhow::bail!("host {} still holds {n} shard(s)", report.host),
        None => anyhow::bail!(
            "the catalog could not be read after the moves: what host {} holds is unknown",
            report.host
        ),
    }
}

fn host_name(name: &str) -> Result<HostName, UsageError> {
    HostName::new(name).map_err(|e| UsageError(format!("host name: {e}")))
}

/// A URL from the command line: refused when it holds a password.
fn cli_url(flag: &str, url: Option<&str>) -> Result<Option<DbUrl>, UsageError> {
    let Some(url) = url else { return Ok(None) };
    let url = DbUrl::new(url.to_owned());
    if url.split_password().1.is_some() {
        return Err(UsageError(format!(
            "{flag} holds a password; the catalog records none and a command line is seen by others: \
             give passwords through the config's [credentials] (password_env or passfile)"
        )));
    }
    url.tls().map_err(|m| UsageError(format!("{flag}: {m}")))?;
    Ok(Some(url))
}

/// Runs `host`.
///
/// # Errors
///
/// [`UsageError`] for a bad name or URL; the operation's error.
pub fn host(config: &Config, opt: &HostOpt, out: &mut dyn Write) -> anyhow::Result<()> {
    let rt = runtime()?;
    match &opt.command {
        HostCommand::List { json } => {
            let hosts = rt.block_on(shardline_ops::fleet::list(config))?;
            if *json {
                writeln!(out, "{}", serde_json::to_string(&hosts)?)?;
                return Ok(());
            }
            writeln!(out, "{:<16} {:<9} {:>6}  address", "host", "state", "shards")?;
            for h in &hosts {
                let address = h.address.as_deref().unwrap_or("(in the config only)");
                let peer = h.peer_address.as_deref().map(|p| format!("  (peers: {p})")).unwrap_or_default();
                writeln!(out, "{:<16} {:<9} {:>6}  {address}{peer}", h.name, h.state, h.shards)?;
            }
            Ok(())
        }
        HostCommand::Add { name, url, peer_url, json } => {
            let name = host_name(name)?;
            let url = cli_url("--url", url.as_deref())?;
            let peer_url = cli_url("--peer-url", peer_url.as_deref())?;
            let report =
                rt.block_on(shardline_ops::fleet::add(config, &name, url.as_ref(), peer_url.as_ref()))?;
            if *json {
                writeln!(out, "{}", serde_json::to_string(&report)?)?;
            } else {
                writeln!(out, "added {report}")?;
            }
            Ok(())
        }
        HostCommand::Readdress { name, url, peer_url, json } => {
            let name = host_name(name)?;
            let url = cli_url("--url", Some(url))?.ok_or_else(|| UsageError("--url is required".into()))?;
            let peer_url = cli_url("--peer-url", peer_url.as_deref())?;
            let report =
                rt.block_on(shardline_ops::fleet::readdress(config, &name, &url, peer_url.as_ref()))?;
            if *json {
                writeln!(out, "{}", serde_json::to_string(&report)?)?;
            } else {
                writeln!(out, "readdressed {report}")?;
            }
            Ok(())
        }
        HostCommand::Drain { name, dry_run, parallel, copy, json } => {
            let name = host_name(name)?;
            let mut options = MoveOptions::default();
            copy.apply(&mut options);
            let report = rt.block_on(shardline_ops::fleet::drain(
                config,
                &name,
                usize::from(*parallel),
                &options,
                *dry_run,
            ))?;
            if *dry_run {
                if *json {
                    writeln!(out, "{}", serde_json::to_string(&report.plan)?)?;
                } else {
                    writeln!(out, "{}", report.plan)?;
                }
                return Ok(());
            }
            if *json {
                // One object: the moves, and what the host still holds (`null` when the
                // catalog could not be read after them).
                let moves = report_moves(&report.moves, None)?;
                let summary = serde_json::json!({
                    "host": report.host,
                    "moves": moves,
                    "remaining": report.remaining,
                    "drained": report.drained(),
                });
                writeln!(out, "{summary}")?;
            } else {
                print_moves(&report.moves, false, out)?;
                writeln!(out, "{report}")?;
            }
            drained(&report)
        }
        HostCommand::Remove { name } => {
            let name = host_name(name)?;
            let version = rt.block_on(shardline_ops::fleet::remove(config, &name))?;
            writeln!(out, "removed host {name}; map version {version}")?;
            Ok(())
        }
    }
}
