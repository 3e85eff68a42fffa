//! The commands that work on a cluster through its config file: `init`, `migrate`,
//! `map`, `locate`, `status`.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use shardline_id::Id;
use shardline_ops::{Options, Progress, Report};
use shardline_router::{Config, Route};

use crate::UsageError;

/// Options of `init` and `migrate`.
#[derive(Debug, Args)]
pub struct ApplyOpt {
    /// Connections per host, each working on one shard at a time.
    #[arg(long, default_value_t = 4, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: u16,
    /// How long a statement may wait for a lock before its shard fails (so a migration
    /// never stalls a busy table's queries behind it), e.g. `5s`, `500ms`.
    #[arg(long, default_value = "5s", value_name = "DURATION", value_parser = parse_lock_timeout)]
    pub lock_timeout: Duration,
    /// How long one shard's transaction may take before the run fails naming the host
    /// and shard (a hung host ends the run instead of holding it), e.g. `30min`, `2h`.
    #[arg(long, default_value = "30min", value_name = "DURATION", value_parser = parse_time_limit)]
    pub shard_timeout: Duration,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Options of `map`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("against").args(["check", "repair"])))]
pub struct MapOpt {
    /// Read every host's server too, and list the shards whose schema is not where the
    /// map places them (after a catalog was restored from a backup, say); exits 1 when
    /// there is one, or a host could not be read. Changes nothing.
    #[arg(long)]
    pub check: bool,
    /// As --check, then place each misplaced shard on the one host that holds its
    /// schema (not while a move of it runs, nor while a host cannot be read); exits 1
    /// when a shard is left misplaced.
    #[arg(long)]
    pub repair: bool,
    /// With --check or --repair: how long to wait for each host.
    #[arg(long, default_value = "5s", value_name = "DURATION", value_parser = parse_time_limit, requires = "against")]
    pub timeout: Duration,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Options of `locate`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["user", "id"])))]
pub struct LocateOpt {
    /// A user ID: its shard is `user_id mod logical_shards` (Euclidean: never negative).
    #[arg(long, value_name = "USER_ID", allow_negative_numbers = true)]
    pub user: Option<i64>,
    /// An ID minted by shardline, decimal or compact (base32): its shard is inside it.
    #[arg(long, value_name = "ID")]
    pub id: Option<String>,
    /// Print one JSON object: {"shard":S,"schema":"...","host":"..."}.
    #[arg(long)]
    pub json: bool,
}

/// Options of `status`.
#[derive(Debug, Args)]
pub struct StatusOpt {
    /// How long to wait for each host.
    #[arg(long, default_value = "5s", value_name = "DURATION", value_parser = parse_time_limit)]
    pub timeout: Duration,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Reads and validates the config file. Every problem is a [`UsageError`] naming the
/// file (and the line and key, for its content).
///
/// # Errors
///
/// When the file cannot be read or is not valid.
pub fn load_config(path: &Path) -> Result<Config, UsageError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| UsageError(format!("cannot read the config file {}: {e}", path.display())))?;
    let base = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    Config::from_toml(&text, &path.display().to_string(), base, &|var| std::env::var(var).ok())
        .map_err(|e| UsageError(e.to_string()))
}

pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")
}

/// A progress bar on stderr, drawn only when stderr is a terminal.
fn bar() -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} shards, {per_sec}, eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message("migrating");
    bar
}

/// Runs `init` (`init = true`) or `migrate`.
///
/// # Errors
///
/// As [`shardline_ops::init`] and [`shardline_ops::migrate`].
pub fn apply(config: &Config, opt: &ApplyOpt, init: bool, out: &mut dyn Write) -> anyhow::Result<()> {
    let options = Options {
        jobs_per_host: usize::from(opt.jobs),
        lock_timeout: opt.lock_timeout,
        shard_timeout: opt.shard_timeout,
    };
    let bar = bar();
    let progress = |p: Progress| match p {
        Progress::Planned { shards } => bar.set_length(u64::try_from(shards).unwrap_or(u64::MAX)),
        Progress::ShardDone { .. } => bar.inc(1),
        Progress::Warning(w) => bar.suspend(|| eprintln!("warning: {w}")),
        _ => {}
    };
    let rt = runtime()?;
    let result = rt.block_on(async {
        if init {
            shardline_ops::init(config, &options, &progress).await
        } else {
            shardline_ops::migrate(config, &options, &progress).await
        }
    });
    bar.finish_and_clear();
    let report: Report = result?;
    if opt.json {
        writeln!(out, "{}", serde_json::to_string(&report)?)?;
    } else {
        writeln!(out, "{report}")?;
    }
    Ok(())
}

#[derive(Serialize)]
struct MapJson {
    version: i64,
    logical_shards: u16,
    schema_prefix: String,
    hosts: Vec<MapHost>,
}

#[derive(Serialize)]
struct MapHost {
    name: String,
    shards: usize,
    ranges: Vec<[u16; 2]>,
}

/// Runs `map`: the hosts, their shard ranges, the map version, from the catalog.
///
/// # Errors
///
/// When the catalog cannot be read or contradicts the config.
pub fn map(config: &Config, opt: &MapOpt, out: &mut dyn Write) -> anyhow::Result<()> {
    if opt.check || opt.repair {
        let rt = runtime()?;
        let checked = if opt.repair {
            rt.block_on(shardline_ops::fleet::repair_map(config, opt.timeout))?
        } else {
            rt.block_on(shardline_ops::fleet::check_map(config, opt.timeout))?
        };
        if opt.json {
            writeln!(out, "{}", serde_json::to_string(&checked)?)?;
        } else {
            writeln!(out, "{checked}")?;
        }
        out.flush()?;
        if !checked.agrees() {
            anyhow::bail!(
                "{} shard(s) not where the map places them, {} host(s) not read",
                checked.misplaced.len(),
                checked.unread.len()
            );
        }
        return Ok(());
    }
    let (map, _) = runtime()?.block_on(shardline_ops::fleet::map(config))?;
    let hosts: Vec<MapHost> = map
        .ranges()
        .into_iter()
        .map(|(name, ranges)| MapHost {
            name: name.to_string(),
            shards: ranges.iter().map(|r| usize::from(r.end() - r.start()) + 1).sum(),
            ranges: ranges.iter().map(|r| [*r.start(), *r.end()]).collect(),
        })
        .collect();
    if opt.json {
        let json = MapJson {
            version: map.version(),
            logical_shards: map.count().get(),
            schema_prefix: config.schema_prefix.as_str().to_owned(),
            hosts,
        };
        writeln!(out, "{}", serde_json::to_string(&json)?)?;
        return Ok(());
    }
    writeln!(
        out,
        "map version {}: {} logical shards on {} hosts",
        map.version(),
        map.count().get(),
        map.hosts().len()
    )?;
    let width = hosts.iter().map(|h| h.name.len()).max().unwrap_or(0);
    for h in hosts {
        let ranges: Vec<String> =
            h.ranges.iter().map(|[a, b]| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect();
        let shown = if ranges.is_empty() { "-".to_owned() } else { ranges.join(", ") };
        writeln!(out, "{:<width$}  {:>5} shards  {shown}", h.name, h.shards)?;
    }
    Ok(())
}

#[derive(Serialize)]
struct Located<'a> {
    shard: u16,
    schema: &'a str,
    host: &'a str,
}

/// Parses an ID in decimal or compact form; refuses a text that is both, naming two
/// different IDs (13 digits: a compact form made of digits only), and the spelling of
/// each that is not: a decimal ID of 13 digits is given with a leading 0 (14
/// characters, never a compact form).
fn parse_id(s: &str) -> Result<Id, UsageError> {
    let decimal_text = |id: Id| {
        let d = id.as_i64().to_string();
        if d.len() == 13 { format!("0{d}") } else { d }
    };
    match (s.parse::<Id>(), Id::from_compact(s)) {
        (Ok(decimal), Ok(compact)) if decimal != compact => Err(UsageError(format!(
            "invalid value {s:?} for --id: it is both the decimal ID {decimal} and the compact form of \
             {compact}; for the first give {}, for the second {}",
            decimal_text(decimal),
            decimal_text(compact)
        ))),
        (Ok(id), _) | (Err(_), Ok(id)) => Ok(id),
        (Err(decimal), Err(compact)) => Err(UsageError(format!(
            "invalid value {s:?} for --id: not a decimal ID ({decimal}) nor a compact one ({compact})"
        ))),
    }
}

/// A lock wait for `--lock-timeout`: 1 ms to 2,147,483,647 ms (Postgres's
/// `lock_timeout` range; 0 there means no timeout at all).
pub(crate) fn parse_lock_timeout(s: &str) -> Result<Duration, String> {
    duration_within(
        s,
        Duration::from_millis(1)..=Duration::from_millis(i32::MAX.unsigned_abs().into()),
        &format!("must be 1ms to {}ms (0 would turn the lock timeout off)", i32::MAX),
    )
}

/// A time limit (`--shard-timeout`, `--timeout`, `--hung-after`): 1ms to 100 years. 0
/// would give up at once (after `init` had made the catalog), and a limit past a
/// century would overflow the clock's arithmetic.
pub(crate) fn parse_time_limit(s: &str) -> Result<Duration, String> {
    duration_within(
        s,
        Duration::from_millis(1)..=Duration::from_secs(100 * 365 * 24 * 3600),
        "must be 1ms to 100 years (0 would give up at once)",
    )
}

/// A duration flag (`5s`, `500ms`, `2h`) within `range`; `why` says the range and why.
pub(crate) fn duration_within(
    s: &str,
    range: std::ops::RangeInclusive<Duration>,
    why: &str,
) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if range.contains(&d) { Ok(d) } else { Err(why.to_owned()) }
}

/// Runs `locate`: where a user's or an ID's row lives, by the catalog's map.
///
/// # Errors
///
/// [`UsageError`] for an ID that is not valid or names a shard the cluster does not
/// have; catalog errors.
pub fn locate(config: &Config, opt: &LocateOpt, out: &mut dyn Write) -> anyhow::Result<()> {
    let id = opt.id.as_deref().map(parse_id).transpose()?;
    let (map, info) = runtime()?.block_on(shardline_ops::fleet::map(config))?;
    let route: Route = match (opt.user, id) {
        (Some(user), _) => map.route_user(user, &info.schema_prefix),
        (None, Some(id)) => map
            .route_id(id, info.layout, &info.schema_prefix)
            .map_err(|e| UsageError(format!("invalid value {id} for --id: {e}")))?,
        (None, None) => return Err(UsageError("give --user or --id".into()).into()),
    };
    let located =
        Located { shard: route.shard.get(), schema: route.schema.as_str(), host: route.host.as_str() };
    if opt.json {
        writeln!(out, "{}", serde_json::to_string(&located)?)?;
    } else {
        writeln!(out, "shard {}  schema {}  host {}", located.shard, located.schema, located.host)?;
    }
    Ok(())
}

/// Bytes in binary units, one decimal.
#[expect(clippy::cast_precision_loss, reason = "one decimal is shown")]
pub(crate) fn bytes(n: i64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n.max(0) as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{n} B") } else { format!("{v:.1} {}", UNITS[unit]) }
}

/// Runs `status`. Exits non-zero (after printing) when a host is unreachable or behind.
///
/// # Errors
///
/// Catalog errors; a summary error when a host is unreachable or behind.
pub fn status(config: &Config, opt: &StatusOpt, out: &mut dyn Write) -> anyhow::Result<()> {
    let status = runtime()?.block_on(shardline_ops::status(config, opt.timeout))?;
    if opt.json {
        writeln!(out, "{}", serde_json::to_string(&status)?)?;
    } else {
        writeln!(
            out,
            "map version {}: {} logical shards on {} hosts, {} migration(s)",
            status.map_version,
            status.logical_shards,
            status.hosts.len(),
            status.migrations
        )?;
        for h in &status.hosts {
            if h.reachable {
                writeln!(
                    out,
                    "{}  up    {} shards, {} schemas, {} behind, {} moving, wal_level {}",
                    h.name,
                    h.shards,
                    h.schemas_present,
                    h.shards_behind,
                    h.shards_moving,
                    h.wal_level.as_deref().unwrap_or("?")
                )?;
                for t in &h.tables {
                    writeln!(out, "    {:<24} {:>12} rows  {:>10}", t.name, t.rows, bytes(t.bytes))?;
                }
            } else {
                writeln!(
                    out,
                    "{}  DOWN  {} shards: {}",
                    h.name,
                    h.shards,
                    h.error.as_deref().unwrap_or("unreachable")
                )?;
            }
        }
    }
    out.flush()?;
    let down: Vec<&str> = status.hosts.iter().filter(|h| !h.reachable).map(|h| h.name.as_str()).collect();
    let behind: Vec<&str> =
        status.hosts.iter().filter(|h| h.reachable && h.shards_behind > 0).map(|h| h.name.as_str()).collect();
    if !down.is_empty() {
        anyhow::bail!("unreachable: {}", down.join(", "));
    }
    if !behind.is_empty() {
        anyhow::bail!("shards behind on {}: run `shardline migrate`", behind.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_read_like_people_write_them() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(5 * 1024 * 1024 * 1024), "5.0 GiB");
    }

    #[test]
    fn ids_parse_in_both_forms() {
        let id = Id::from_i64(3236157012031088647).unwrap();
        assert_eq!(parse_id("3236157012031088647").unwrap(), id);
        assert_eq!(parse_id(&id.to_compact()).unwrap(), id);
        let err = parse_id("-5").unwrap_err().to_string();
        assert!(err.starts_with("invalid value \"-5\" for --id: not a decimal ID"), "{err}");
        // 13 digits: a decimal ID and the compact form of another; which is meant is
        // asked, not guessed.
        let both = Id::from_compact("0000000000010").unwrap();
        assert_ne!(both.as_i64(), 10);
        let err = parse_id("0000000000010").unwrap_err().to_string();
        assert!(err.contains("both the decimal ID 10 and the compact form of"), "{err}");
        assert_eq!(parse_id(&both.as_i64().to_string()).unwrap(), both);
        // An ID whose decimal and compact texts are both 13 digits (2^40: shard 0,
        // sequence 0, 1 ms into a recent epoch's 2^-23 part): each spelling is ambiguous,
        // and the one suggested, a leading 0 before the decimal, is taken.
        let short = Id::from_i64(1 << 40).unwrap();
        for text in [short.as_i64().to_string(), short.to_compact()] {
            let err = parse_id(&text).unwrap_err().to_string();
            // The two spellings after "give".
            let tail = err.rsplit("; for the first give ").next().unwrap_or_default();
            let suggested: Vec<&str> = tail.split(", for the second ").collect();
            assert_eq!(suggested.len(), 2, "{text}: {err}");
            assert!(suggested.contains(&"01099511627776"), "{text}: {err}");
            for s in suggested {
                parse_id(s).unwrap_or_else(|e| panic!("{text}: suggested {s}: {e}"));
            }
        }
        assert_eq!(parse_id("01099511627776").unwrap(), short);
    }

    #[test]
    fn a_lock_timeout_of_zero_is_refused() {
        assert!(parse_lock_timeout("0s").unwrap_err().contains("turn the lock timeout off"));
        assert!(parse_lock_timeout("500us").is_err());
        assert!(parse_lock_timeout("30d").is_err());
        assert_eq!(parse_lock_timeout("5s").unwrap(), Duration::from_secs(5));
    }

    #[test]
    fn a_missing_config_file_is_named() {
        let err = load_config(Path::new("/no/such/shardline.toml")).unwrap_err().to_string();
        assert!(err.starts_with("cannot read the config file /no/such/shardline.toml: "), "{err}");
    }
}
