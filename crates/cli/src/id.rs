//! `shardline id`: decode, encode and explain IDs without a database (the layout is the
//! config's when its file exists).

use std::io::Write;
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::Context;
use clap::{Args, Subcommand};
use shardline_id::sql::Minter;
use shardline_id::{Id, Layout};

use crate::UsageError;

/// Options of `shardline id`.
#[derive(Debug, Args)]
pub struct IdOpt {
    /// What to do with IDs.
    #[command(subcommand)]
    pub command: IdCommand,
}

/// `shardline id` subcommands.
#[derive(Debug, Subcommand)]
pub enum IdCommand {
    /// Split IDs into creation time, logical shard and sequence.
    Decode {
        /// The layout's epoch, in ms since the Unix epoch (default: the config's `id.epoch_ms`
        /// when the config file exists, else Instagram's, 2011-08-24T21:07:01.721Z).
        #[arg(long, value_name = "MS", allow_negative_numbers = true)]
        epoch_ms: Option<i64>,
        /// One JSON object per line: {"id":"<decimal>","unix_ms":..,"shard":..,"sequence":..}.
        #[arg(long)]
        json: bool,
        /// Decimal IDs (non-negative 64-bit integers).
        #[arg(required = true, value_name = "ID")]
        ids: Vec<String>,
    },
    /// Compose an ID from its parts and print it in decimal.
    Encode {
        /// Creation time, in ms since the Unix epoch.
        #[arg(long, value_name = "MS", allow_negative_numbers = true)]
        unix_ms: i64,
        /// Logical shard, 0 to 8191.
        #[arg(long, value_name = "SHARD")]
        shard: u32,
        /// Sequence number within the millisecond, 0 to 1023.
        #[arg(long, value_name = "N")]
        sequence: u32,
        /// The layout's epoch, in ms since the Unix epoch (default: the config's
        /// `id.epoch_ms` when the config file exists, else Instagram's).
        #[arg(long, value_name = "MS", allow_negative_numbers = true)]
        epoch_ms: Option<i64>,
    },
    /// Print the SQL that installs the ID minter (sequence, next_id(), id_parts(),
    /// reserve_ids()) in one shard schema, and the catch-up every schema of the database
    /// shares (schema shardline_minter) when it is missing.
    Sql {
        /// The shard's schema (it must exist before the SQL runs).
        #[arg(long, value_name = "SCHEMA")]
        schema: String,
        /// The logical shard the schema holds, 0 to 8191.
        #[arg(long, value_name = "SHARD")]
        shard: u32,
        /// The layout's epoch, in ms since the Unix epoch (default: the config's
        /// `id.epoch_ms` when the config file exists, else Instagram's).
        #[arg(long, value_name = "MS", allow_negative_numbers = true)]
        epoch_ms: Option<i64>,
        /// Make next_id() the native minter (a C function; run the SQL as a superuser
        /// on a server with the library: scripts/native-minter.sh) instead of PL/pgSQL
        /// (default: the config's `id.minter` when the config file exists, else PL/pgSQL).
        #[arg(long)]
        native: bool,
    },
    /// Show the layout: field widths, capacity, and when IDs turn negative or run out.
    Layout {
        /// The layout's epoch, in ms since the Unix epoch (default: the config's
        /// `id.epoch_ms` when the config file exists, else Instagram's).
        #[arg(long, value_name = "MS", allow_negative_numbers = true)]
        epoch_ms: Option<i64>,
    },
}

/// What `decode --json` prints for each ID.
#[derive(Debug, serde::Serialize)]
struct Decoded {
    id: Id,
    unix_ms: i64,
    shard: u32,
    sequence: u32,
}

/// The layout: `--epoch-ms` when given; else the config's `[id]` table (the rest of the
/// file is not read: no variable it names need be set) from the file `--config` or
/// `SHARDLINE_CONFIG` names, which must exist, or from `shardline.toml` when it exists;
/// else Instagram's.
fn layout(epoch_ms: Option<i64>, config: Option<&Path>) -> Result<Layout, UsageError> {
    if let Some(ms) = epoch_ms {
        return Layout::INSTAGRAM
            .with_epoch(ms)
            .map_err(|e| UsageError(format!("invalid value {ms} for --epoch-ms: {e}")));
    }
    Ok(id_table(config, "the ID layout is read from it; --epoch-ms gives it instead")?.0)
}

/// The `[id]` table's layout and minter, read as [`layout`] reads it (Instagram's and the
/// PL/pgSQL minter without a config file). `why` says, in errors, what was being read.
fn id_table(config: Option<&Path>, why: &str) -> Result<(Layout, Minter), UsageError> {
    let default = Path::new(crate::DEFAULT_CONFIG);
    let path = match config {
        Some(path) => path,
        None if default.exists() => default,
        None => return Ok((Layout::INSTAGRAM, Minter::default())),
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| UsageError(format!("cannot read the config file {}: {e} ({why})", path.display())))?;
    shardline_router::Config::id_from_toml(&text, &path.display().to_string())
        .map_err(|e| UsageError(format!("{e} ({why})")))
}

/// Refuses a `--schema` that is not `shard`'s schema under some prefix (the prefix, then
/// the shard in 4 digits, as [`shardline_router::SchemaPrefix::schema`] makes it).
fn check_schema_names_shard(schema: &str, shard: u32) -> Result<(), UsageError> {
    let named = shardline_router::LogicalShard::bounded(i64::from(shard)).ok().and_then(|s| {
        let digits = format!("{:04}", s.get());
        let prefix = schema.strip_suffix(digits.as_str())?;
        let prefix = shardline_router::SchemaPrefix::new(prefix).ok()?;
        Some(prefix.schema(s).as_str() == schema)
    });
    if named == Some(true) {
        return Ok(());
    }
    Err(UsageError(format!(
        "invalid value {schema:?} for --schema: it is not shard {shard}'s schema (a shard's schema is the \
         cluster's schema_prefix followed by the shard's number in 4 digits: shard_{shard:04} by default)"
    )))
}

/// `unix_ms` as an RFC 3339 time in UTC, or as `N ms` where there is none (before 1970,
/// from the year 10000 on).
pub(crate) fn utc(unix_ms: i64) -> String {
    use std::fmt::Write as _;
    let at = u64::try_from(unix_ms).ok().and_then(|ms| UNIX_EPOCH.checked_add(Duration::from_millis(ms)));
    let mut text = String::new();
    match at {
        Some(at) if write!(text, "{}", humantime::format_rfc3339_millis(at)).is_ok() => text,
        _ => format!("{unix_ms} ms"),
    }
}

/// Runs `shardline id`. Every input is checked before anything is printed.
///
/// # Errors
///
/// [`UsageError`] naming the field and its allowed range; I/O errors writing `out`.
pub fn run(opt: IdOpt, config: Option<&Path>, out: &mut dyn Write) -> anyhow::Result<()> {
    match opt.command {
        IdCommand::Decode { epoch_ms, json, ids } => {
            let layout = layout(epoch_ms, config)?;
            let parsed = ids
                .iter()
                .map(|s| {
                    s.parse::<Id>()
                        .map_err(|e| UsageError(format!("invalid ID {s:?}: {e} (IDs are 0 to {})", i64::MAX)))
                })
                .collect::<Result<Vec<_>, _>>()?;
            for id in parsed {
                let p = layout.decode(id);
                if json {
                    let line = serde_json::to_string(&Decoded {
                        id,
                        unix_ms: p.unix_ms,
                        shard: p.shard,
                        sequence: p.sequence,
                    })?;
                    writeln!(out, "{line}")?;
                } else {
                    writeln!(out, "{id}  {}  shard {}  sequence {}", utc(p.unix_ms), p.shard, p.sequence)?;
                }
            }
        }
        IdCommand::Encode { unix_ms, shard, sequence, epoch_ms } => {
            let layout = layout(epoch_ms, config)?;
            if shard > layout.max_shard() {
                return Err(UsageError(format!(
                    "invalid value {shard} for --shard: allowed 0 to {}",
                    layout.max_shard()
                ))
                .into());
            }
            if sequence > layout.max_sequence() {
                return Err(UsageError(format!(
                    "invalid value {sequence} for --sequence: allowed 0 to {}",
                    layout.max_sequence()
                ))
                .into());
            }
            let id = layout.compose(unix_ms, shard, sequence).map_err(|_| {
                UsageError(format!(
                    "invalid value {unix_ms} for --unix-ms: allowed {} ({}) to {} ({})",
                    layout.epoch_ms(),
                    utc(layout.epoch_ms()),
                    layout.last_unix_ms(),
                    utc(layout.last_unix_ms())
                ))
            })?;
            writeln!(out, "{id}")?;
        }
        IdCommand::Sql { schema, shard, epoch_ms, native } => {
            let layout = layout(epoch_ms, config)?;
            let sql = shardline_id::sql::ShardSql::new(layout, &schema, shard).map_err(|e| match e {
                shardline_id::Error::ShardOutOfRange { max, .. } => {
                    UsageError(format!("invalid value {shard} for --shard: allowed 0 to {max}"))
                }
                other => UsageError(format!("invalid value {schema:?} for --schema: {other}")),
            })?;
            // The schema names the shard the SQL stamps into its IDs: another shard's
            // schema would mint this shard's IDs from its sequence (duplicates of that
            // shard's own, reads sent to the wrong one).
            check_schema_names_shard(&schema, shard)?;
            let minter = if native {
                Minter::Native
            } else {
                id_table(config, "the minter is read from it; --native chooses the native one")?.1
            };
            write!(out, "{}", sql.minter(minter).install())?;
        }
        IdCommand::Layout { epoch_ms } => {
            let l = layout(epoch_ms, config)?;
            let w = |out: &mut dyn Write, k: &str, v: String| writeln!(out, "{k:<24}{v}");
            w(
                out,
                "fields",
                format!(
                    "{} bits ms | {} bits shard | {} bits sequence",
                    l.timestamp_bits(),
                    l.shard_bits(),
                    l.sequence_bits()
                ),
            )?;
            w(out, "epoch", format!("{} ms ({})", l.epoch_ms(), utc(l.epoch_ms())))?;
            w(out, "logical shards", format!("0 to {}", l.max_shard()))?;
            w(out, "IDs per ms per shard", l.ids_per_ms().to_string())?;
            if let Some(neg) = l.negative_from_unix_ms() {
                w(out, "negative from", format!("{neg} ms ({}): minting stops before", utc(neg)))?;
            }
            if let Some(end) = l.exhausted_from_unix_ms() {
                w(out, "timestamp runs out", format!("{end} ms ({})", utc(end)))?;
            }
            w(out, "last mintable ms", format!("{} ms ({})", l.last_unix_ms(), utc(l.last_unix_ms())))?;
        }
    }
    out.flush().context("writing the output")?;
    Ok(())
}
