//! The commands that move shards: `move`, `moves`, `rebalance`, `gc`.

use std::io::{IsTerminal as _, Write};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use shardline_ops::moves::{MoveOptions, MoveProgress, Step};
use shardline_ops::rebalance::PlannedMove;
use shardline_router::{Config, HostName, LogicalShard};

use crate::UsageError;
use crate::cluster::{bytes, runtime};

/// Options of `move`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("mode").required(true).args(["to", "resume", "abort", "revert"])))]
pub struct MoveOpt {
    /// The logical shard (with `--resume`, optional: every running move).
    pub shard: Option<u16>,
    /// Move the shard to this host: pre-flight, copy, catch up, fence, carry the ID
    /// sequence, verify, flip the map, clean up.
    #[arg(long, value_name = "HOST")]
    pub to: Option<String>,
    /// With `--to`: run the pre-flight only, change nothing.
    #[arg(long, requires = "to")]
    pub dry_run: bool,
    /// Finish an interrupted move from its last journaled step.
    #[arg(long)]
    pub resume: bool,
    /// Undo the shard's interrupted move (before its flip): the shard stays, writable,
    /// on its source. Of the other options, only `--hung-after` and `--json` apply.
    #[arg(long, conflicts_with_all = ["max_rate", "subscription_copy", "max_pause", "max_lag", "lease", "stop_after"])]
    pub abort: bool,
    /// Keep the move revertible after its flip (`--revert`, until `gc` drops the old
    /// copy): a replication slot on the target keeps its WAL meanwhile.
    #[arg(long, conflicts_with_all = ["resume", "abort", "dry_run"])]
    pub revertible: bool,
    /// Bring the shard back to where its last move took it from, after that move's
    /// flip and before `gc` drops the old copy there (a move made `--revertible`): the
    /// old copy is brought up to date from the new owner's changes since the flip (no
    /// new copy), then fenced, verified and flipped as any move.
    #[arg(long, conflicts_with_all = ["max_rate", "subscription_copy"])]
    pub revert: bool,
    /// How the rows are copied.
    #[command(flatten)]
    pub copy: CopyArgs,
    /// Fence only once a change on the source reaches the target this fast.
    #[arg(long, default_value = "250ms", value_name = "DURATION", value_parser = parse_max_lag)]
    pub max_lag: Duration,
    /// The fence's lease: renewed by the mover while the shard is fenced; once it ran
    /// out with the mover gone, a router that finds the shard fenced unfences it on its
    /// source. Keep the routers' `move_wait` above it plus 5 s.
    #[arg(long, default_value = "10s", value_name = "DURATION", value_parser = parse_lease)]
    pub lease: Duration,
    /// Give up the step in progress once the source or the target has answered no probe
    /// for this long (a host hung or cut off); the move then fails, or is undone while
    /// fenced, as any failure there.
    #[arg(long, default_value = "15s", value_name = "DURATION", value_parser = crate::cluster::parse_time_limit)]
    pub hung_after: Duration,
    /// Stop after this step as if killed (a drill for `--resume` and `--abort`):
    /// started, prepared, copying, caught_up, fenced, synced, sequence_carried,
    /// verified, flipped.
    #[arg(long, value_name = "STEP", value_parser = parse_step)]
    pub stop_after: Option<Step>,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// How a move copies the shard's rows, and how long it may pause the shard's writes:
/// `--max-rate`, `--subscription-copy` and `--max-pause`, on `move`, `rebalance` and
/// `host drain`.
#[derive(Debug, Args)]
pub struct CopyArgs {
    /// Copy the shard's rows at most this fast, in MB/s (decimal megabytes), read by
    /// the mover from one snapshot of the source, so the source's other shards keep
    /// their share of it; 0: no cap. Default 10.
    #[arg(long, value_name = "MB/S", value_parser = parse_rate)]
    pub max_rate: Option<u64>,
    /// Let Postgres's table-sync workers copy the rows instead, as fast as the hosts
    /// go, unthrottled (for a source with cores and disk to spare).
    #[arg(long, conflicts_with = "max_rate")]
    pub subscription_copy: bool,
    /// The longest the shard's writes may wait on a move, from its fence until its copy
    /// is verified; past it the move is undone and writes resume on the source.
    #[arg(long, default_value = "30s", value_name = "DURATION", value_parser = parse_max_pause)]
    pub max_pause: Duration,
}

impl CopyArgs {
    /// Sets [`MoveOptions::max_rate`] from the flags (with neither, the library's
    /// default, [`shardline_ops::moves::DEFAULT_MAX_RATE`], stays) and
    /// [`MoveOptions::max_pause`].
    pub fn apply(&self, options: &mut MoveOptions) {
        options.max_pause = self.max_pause;
        if self.subscription_copy {
            options.max_rate = None;
        } else if let Some(rate) = self.max_rate {
            options.max_rate = Some(rate);
        }
    }
}

/// `--max-lag`: 1 ms to 1 min (0 is never reached: the move would wait out its
/// `copy_timeout`).
fn parse_max_lag(s: &str) -> Result<Duration, String> {
    crate::cluster::duration_within(
        s,
        Duration::from_millis(1)..=Duration::from_secs(60),
        "must be 1ms to 1min (a lag of 0 is never reached)",
    )
}

/// `--max-pause`: 1 s to 1 h (a pause of 0 would undo every move at its fence).
fn parse_max_pause(s: &str) -> Result<Duration, String> {
    crate::cluster::duration_within(
        s,
        Duration::from_secs(1)..=Duration::from_secs(3600),
        "must be 1s to 1h (a pause of 0 would undo every move at its fence)",
    )
}

/// `--lease`: 1 s to 10 min (0 runs out before any flip can be decided, so every move
/// would be undone; a long one keeps a dead mover's shard fenced that long, past the
/// routers' `move_wait`).
fn parse_lease(s: &str) -> Result<Duration, String> {
    crate::cluster::duration_within(
        s,
        Duration::from_secs(1)..=Duration::from_secs(600),
        "must be 1s to 10min (keep the routers' move_wait above it plus 5 s)",
    )
}

/// `--max-rate`: MB/s (decimal megabytes, a fraction allowed) to bytes a second.
pub(crate) fn parse_rate(s: &str) -> Result<u64, String> {
    match s.trim().parse::<f64>() {
        // A positive rate below a byte a second would round to 0, "no cap".
        Ok(mb) if mb == 0.0 || (1e-6..=1e6).contains(&mb) =>
        {
            #[expect(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                reason = "a non-negative rate of at most 10^12 bytes a second"
            )]
            Ok((mb * 1e6).round() as u64)
        }
        _ => Err(format!("{s:?} is not a rate in MB/s (0, or a number from 0.000001 to 1000000)")),
    }
}

fn parse_grace(s: &str) -> Result<Duration, String> {
    let grace = humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))?;
    if grace > shardline_ops::moves::MAX_GRACE {
        return Err(format!("{s:?} is longer than the longest grace period, 100 years"));
    }
    Ok(grace)
}

fn parse_step(s: &str) -> Result<Step, String> {
    // A move stops after `cleaned` by itself: not a step to stop after.
    let stops = || Step::ALL.iter().filter(|s| **s != Step::Cleaned);
    match Step::parse(s) {
        Some(step) if step != Step::Cleaned => Ok(step),
        _ => {
            let all: Vec<&str> = stops().map(|s| s.as_str()).collect();
            Err(format!("{s:?} is not a step a move can stop after; the steps are {}", all.join(", ")))
        }
    }
}

/// Options of `moves`.
#[derive(Debug, Args)]
pub struct MovesOpt {
    /// Print one JSON array.
    #[arg(long)]
    pub json: bool,
}

/// Options of `rebalance`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("mode").required(true).args(["plan", "apply"])))]
pub struct RebalanceOpt {
    /// Print the moves that would even out the hosts by bytes; change nothing.
    #[arg(long)]
    pub plan: bool,
    /// Plan, then run the moves.
    #[arg(long)]
    pub apply: bool,
    /// At most this many moves.
    #[arg(long, default_value_t = 8, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=2000))]
    pub max_moves: u16,
    /// Moves at a time, between disjoint host pairs: no host takes part in two at once
    /// (see `--per-host`).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=16))]
    pub parallel: u16,
    /// Running moves one host may take part in, as source or target: more than 1 lets
    /// moves onto one new host run at once, sharing its disks and cores.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=16))]
    pub per_host: u16,
    /// How each move copies its shard's rows (see `move`).
    #[command(flatten)]
    pub copy: CopyArgs,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Options of `gc`.
#[derive(Debug, Args)]
pub struct GcOpt {
    /// Keep a moved shard's old schema on its source this long after the move, so it
    /// can be inspected or copied back by hand.
    #[arg(long, default_value = "24h", value_name = "DURATION", value_parser = parse_grace)]
    pub grace: Duration,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// A bar on stderr, drawn only on a terminal: bytes copied, then the lag.
fn progress() -> (ProgressBar, shardline_ops::moves::ProgressFn) {
    let bar = if std::io::stderr().is_terminal() { ProgressBar::new(0) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let b = bar.clone();
    let f = Arc::new(move |p: &MoveProgress| match p {
        MoveProgress::Step { id, step } => b.set_message(format!("move {id}: {step}")),
        MoveProgress::Copy { bytes, total, tables_done, tables } => {
            b.set_length(u64::try_from(*total.max(bytes)).unwrap_or(0));
            b.set_position(u64::try_from(*bytes).unwrap_or(0));
            b.set_message(format!("copying ({tables_done}/{tables} tables)"));
        }
        MoveProgress::Lag { ms } => b.set_message(format!("catching up: lag {ms} ms")),
        _ => {}
    });
    (bar, f)
}

/// Runs `move`: `--to` (with `--dry-run`, the pre-flight alone), `--revert`, `--resume`,
/// `--abort`.
///
/// # Errors
///
/// [`UsageError`] for a missing shard; the move's failure otherwise.
pub fn move_shard(config: &Config, opt: &MoveOpt, out: &mut dyn Write) -> anyhow::Result<()> {
    if opt.hung_after < Duration::from_secs(2) {
        return Err(UsageError(format!(
            "--hung-after {:?} is too short: the hosts are probed once a second (use 2s or more)",
            opt.hung_after
        ))
        .into());
    }
    let rt = runtime()?;
    let (bar, f) = progress();
    let mut options = MoveOptions::default();
    options.max_lag = opt.max_lag;
    options.stop_after = opt.stop_after;
    options.lease = opt.lease;
    options.hung_after = opt.hung_after;
    options.revertible = opt.revertible;
    opt.copy.apply(&mut options);
    options.progress = Some(f);
    // Within the config's count, which `init` made the catalog's (the move checks the
    // catalog's again, in its pre-flight and journal).
    let shard = opt
        .shard
        .map(|s| LogicalShard::bounded(i64::from(s)).and_then(|s| s.within(config.logical_shards)))
        .transpose()
        .map_err(|e| UsageError(format!("shard: {e}")))?;
    let need_shard =
        || shard.ok_or_else(|| UsageError("which shard? e.g. `shardline move 5 --to pg2`".into()));
    if let Some(to) = &opt.to {
        let shard = need_shard()?;
        let to = &HostName::new(to).map_err(|e| UsageError(format!("--to: {e}")))?;
        if opt.dry_run {
            let mut pre =
                rt.block_on(shardline_ops::moves::preflight_with(config, shard, to, opt.hung_after))?;
            // What the move would refuse for its copy's rate, with the same flags.
            pre.check_copy_time(options.max_rate, options.copy_timeout);
            if opt.json {
                writeln!(
                    out,
                    "{}",
                    serde_json::json!({"ok": pre.is_ok(), "problems": pre.problems.iter().map(ToString::to_string).collect::<Vec<_>>(), "rows_estimate": pre.rows_estimate, "bytes": pre.bytes})
                )?;
            } else {
                writeln!(out, "{pre}")?;
            }
            out.flush()?;
            if !pre.is_ok() {
                anyhow::bail!("pre-flight found {} problem(s); nothing was changed", pre.problems.len());
            }
            return Ok(());
        }
        let result = rt.block_on(shardline_ops::moves::run(config, shard, to, &options));
        bar.finish_and_clear();
        print_report(out, opt.json, &result?)?;
    } else if opt.revert {
        let shard = need_shard()?;
        let result = rt.block_on(shardline_ops::moves::revert(config, shard, &options));
        bar.finish_and_clear();
        print_report(out, opt.json, &result?)?;
    } else if opt.resume {
        let result = rt.block_on(shardline_ops::moves::resume(config, shard, &options));
        bar.finish_and_clear();
        // What was finished is printed also when another move could not be.
        let (reports, failed) = match result {
            Ok(reports) => (reports, None),
            Err(shardline_ops::Error::ResumeIncomplete { failed, finished }) => (finished, Some(failed)),
            Err(e) => return Err(e.into()),
        };
        if opt.json {
            writeln!(out, "{}", serde_json::to_string(&reports)?)?;
        } else {
            for r in &reports {
                writeln!(out, "{r}")?;
            }
        }
        out.flush()?;
        if let Some(failed) = failed {
            return Err(shardline_ops::Error::ResumeIncomplete { failed, finished: reports }.into());
        }
    } else {
        let shard = need_shard()?;
        bar.finish_and_clear();
        print_report(out, opt.json, &rt.block_on(shardline_ops::moves::abort(config, shard, &options))?)?;
    }
    Ok(())
}

/// Prints one report: as JSON with `json`, else as text.
fn print_report<R: serde::Serialize + std::fmt::Display>(
    out: &mut dyn Write,
    json: bool,
    report: &R,
) -> anyhow::Result<()> {
    if json {
        writeln!(out, "{}", serde_json::to_string(report)?)?;
    } else {
        writeln!(out, "{report}")?;
    }
    Ok(())
}

/// Runs `moves`: the journal.
///
/// # Errors
///
/// The catalog unreachable.
pub fn moves(config: &Config, opt: &MovesOpt, out: &mut dyn Write) -> anyhow::Result<()> {
    let list = runtime()?.block_on(shardline_ops::moves::list(config))?;
    if opt.json {
        writeln!(out, "{}", serde_json::to_string(&list)?)?;
    } else if list.is_empty() {
        writeln!(out, "no moves yet")?;
    } else {
        for m in list {
            writeln!(out, "{m}")?;
        }
    }
    Ok(())
}

/// Runs `rebalance`.
///
/// # Errors
///
/// The plan cannot be made; with `--apply`, when a move failed (no move starts after
/// one failed; those running finish).
pub fn rebalance(config: &Config, opt: &RebalanceOpt, out: &mut dyn Write) -> anyhow::Result<()> {
    let rt = runtime()?;
    let plan = rt.block_on(shardline_ops::rebalance::plan(config, usize::from(opt.max_moves)))?;
    if opt.plan {
        if opt.json {
            writeln!(out, "{}", serde_json::to_string(&plan)?)?;
        } else {
            writeln!(out, "{plan}")?;
        }
        return Ok(());
    }
    let mut options = MoveOptions::default();
    opt.copy.apply(&mut options);
    let results = rt.block_on(shardline_ops::rebalance::apply(
        config,
        &plan,
        shardline_ops::rebalance::Parallel::new(usize::from(opt.parallel), usize::from(opt.per_host)),
        &options,
    ));
    if !print_moves(&results, opt.json, out)? && !opt.json {
        writeln!(out, "balanced: nothing to move")?;
    }
    moves_failed(&results)
}

/// Prints each move's outcome (one JSON array with `json`); returns whether there was
/// any.
pub(crate) fn print_moves(
    results: &[(PlannedMove, shardline_ops::Result<shardline_ops::moves::MoveReport>)],
    json: bool,
    out: &mut dyn Write,
) -> anyhow::Result<bool> {
    let all = report_moves(results, (!json).then_some(out))?;
    if json {
        writeln!(out, "{all}")?;
    }
    Ok(!results.is_empty())
}

/// Each move's outcome as JSON (an array, in order), written as text lines to `text`
/// as well when given.
pub(crate) fn report_moves(
    results: &[(PlannedMove, shardline_ops::Result<shardline_ops::moves::MoveReport>)],
    mut text: Option<&mut dyn Write>,
) -> anyhow::Result<serde_json::Value> {
    let mut all = Vec::new();
    for (m, r) in results {
        match r {
            Ok(report) => {
                if let Some(out) = text.as_mut() {
                    writeln!(
                        out,
                        "shard {:>4} {} -> {}: {} rows, {}, pause {} ms",
                        m.shard,
                        m.from,
                        m.to,
                        report.rows,
                        bytes(report.bytes),
                        report.pause_ms
                    )?;
                }
                all.push(serde_json::json!({"shard": m.shard, "from": m.from, "to": m.to, "report": report}));
            }
            Err(e) => {
                if let Some(out) = text.as_mut() {
                    writeln!(
                        out,
                        "shard {:>4} {} -> {}: FAILED: {}",
                        m.shard,
                        m.from,
                        m.to,
                        shardline_repo::error_chain(e)
                    )?;
                }
                all.push(
                    serde_json::json!({"shard": m.shard, "from": m.from, "to": m.to, "error": shardline_repo::error_chain(e)}),
                );
            }
        }
    }
    Ok(serde_json::Value::Array(all))
}

/// An error when any move failed.
pub(crate) fn moves_failed(
    results: &[(PlannedMove, shardline_ops::Result<shardline_ops::moves::MoveReport>)],
) -> anyhow::Result<()> {
    let not_started =
        results.iter().filter(|(_, r)| matches!(r, Err(shardline_ops::Error::NotStarted { .. }))).count();
    let failed = results.iter().filter(|(_, r)| r.is_err()).count() - not_started;
    match (failed, not_started) {
        (0, 0) => Ok(()),
        (_, 0) => anyhow::bail!("{failed} of {} move(s) failed", results.len()),
        _ => anyhow::bail!(
            "{failed} of {} move(s) failed, and {not_started} not started after a failure",
            results.len()
        ),
    }
}

/// Runs `gc`.
///
/// # Errors
///
/// The catalog unreachable, or a statement failing; after the report is printed, work
/// left for the next run (a host unreachable, or something that could not be done), so
/// a script can tell a run that cleaned up from one that did not.
pub fn gc(config: &Config, opt: &GcOpt, out: &mut dyn Write) -> anyhow::Result<()> {
    let report = runtime()?.block_on(shardline_ops::moves::gc(config, opt.grace))?;
    if opt.json {
        writeln!(out, "{}", serde_json::to_string(&report)?)?;
    } else {
        writeln!(out, "{report}")?;
    }
    out.flush()?;
    let (unreachable, left) = (report.unreachable.len(), report.left.len());
    if unreachable + left > 0 {
        anyhow::bail!(
            "gc left work for the next run: {unreachable} host(s) unreachable, {left} thing(s) not done"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use shardline_ops::moves::{DEFAULT_MAX_RATE, MoveOptions};

    use super::{CopyArgs, GcOpt, MoveOpt, parse_lease, parse_max_lag, parse_rate};

    #[derive(Debug, Parser)]
    struct Move {
        #[command(flatten)]
        opt: MoveOpt,
    }

    #[derive(Debug, Parser)]
    struct Gc {
        #[command(flatten)]
        opt: GcOpt,
    }

    #[test]
    fn options_an_abort_would_not_read_are_refused() {
        let parse = |args: &[&str]| Move::try_parse_from(std::iter::once("move").chain(args.iter().copied()));
        for extra in [
            ["--lease", "5s"],
            ["--max-lag", "1s"],
            ["--stop-after", "fenced"],
            ["--max-rate", "5"],
            ["--max-pause", "5s"],
        ] {
            let args = [&["0", "--abort"][..], &extra[..]].concat();
            let err = parse(&args).unwrap_err();
            assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict, "{args:?}: {err}");
        }
        let abort = parse(&["0", "--abort", "--hung-after", "60s", "--json"]).unwrap();
        assert_eq!(abort.opt.hung_after, std::time::Duration::from_secs(60));
        // `cleaned` is where a move ends: no step to stop after.
        let err = parse(&["0", "--to", "pg2", "--stop-after", "cleaned"]).unwrap_err();
        assert!(err.to_string().contains("not a step a move can stop after"), "{err}");
        assert!(parse(&["0", "--to", "pg2", "--stop-after", "flipped"]).is_ok());
    }

    #[test]
    fn a_grace_period_out_of_range_is_refused_when_parsed() {
        let parse = |args: &[&str]| Gc::try_parse_from(std::iter::once("gc").chain(args.iter().copied()));
        let err = parse(&["--grace", "7000y"]).unwrap_err();
        assert!(err.to_string().contains("longer than the longest grace period"), "{err}");
        assert_eq!(parse(&["--grace", "0s"]).unwrap().opt.grace, std::time::Duration::ZERO);
        assert_eq!(parse(&[]).unwrap().opt.grace, std::time::Duration::from_secs(86_400));
    }

    /// A time limit of 0 gave up at once (`init` had made the catalog by then), and
    /// one past the clock's range overflowed it: both refused when parsed.
    #[test]
    fn a_time_limit_of_zero_or_past_a_century_is_refused_when_parsed() {
        use crate::cluster::parse_time_limit;
        for bad in ["0s", "0ms", "101y", "500000000y"] {
            let err = parse_time_limit(bad).unwrap_err();
            assert!(err.contains("must be 1ms to 100 years"), "{bad}: {err}");
        }
        assert_eq!(parse_time_limit("30min"), Ok(std::time::Duration::from_secs(1800)));
        assert!(parse_time_limit("soon").is_err());
    }

    #[derive(Debug, Parser)]
    struct Copy {
        #[command(flatten)]
        copy: CopyArgs,
    }

    fn max_rate(args: &[&str]) -> Result<Option<u64>, clap::Error> {
        let parsed = Copy::try_parse_from(std::iter::once("copy").chain(args.iter().copied()))?;
        let mut options = MoveOptions::default();
        parsed.copy.apply(&mut options);
        Ok(options.max_rate)
    }

    #[test]
    fn max_pause_reaches_the_moves_options_and_a_pause_no_move_could_keep_is_refused() {
        let parse = |args: &[&str]| Copy::try_parse_from(std::iter::once("copy").chain(args.iter().copied()));
        let pause = |args: &[&str]| {
            let mut options = MoveOptions::default();
            parse(args).unwrap().copy.apply(&mut options);
            options.max_pause
        };
        assert_eq!(pause(&[]), std::time::Duration::from_secs(30));
        assert_eq!(pause(&["--max-pause", "2s"]), std::time::Duration::from_secs(2));
        for bad in ["0s", "500ms", "2h"] {
            let err = parse(&["--max-pause", bad]).unwrap_err();
            assert!(err.to_string().contains("must be 1s to 1h"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_lease_and_a_lag_that_no_move_could_meet_are_refused() {
        assert!(parse_lease("0s").is_err());
        assert!(parse_lease("1d").unwrap_err().contains("move_wait"));
        assert_eq!(parse_lease("10s").unwrap(), std::time::Duration::from_secs(10));
        assert!(parse_max_lag("0s").unwrap_err().contains("never reached"));
        assert_eq!(parse_max_lag("250ms").unwrap(), std::time::Duration::from_millis(250));
    }

    #[test]
    fn a_move_copies_at_the_default_rate_unless_told_otherwise() {
        assert_eq!(max_rate(&[]).unwrap(), Some(DEFAULT_MAX_RATE));
        assert_eq!(DEFAULT_MAX_RATE, 10_000_000);
        assert_eq!(max_rate(&["--max-rate", "40"]).unwrap(), Some(40_000_000));
        assert_eq!(max_rate(&["--max-rate", "0"]).unwrap(), Some(0));
        assert_eq!(max_rate(&["--subscription-copy"]).unwrap(), None);
        let both = max_rate(&["--subscription-copy", "--max-rate", "5"]).unwrap_err();
        assert_eq!(both.kind(), clap::error::ErrorKind::ArgumentConflict, "{both}");
    }

    #[test]
    fn a_rate_is_megabytes_a_second_and_a_bad_one_is_named() {
        assert_eq!(parse_rate("12.5"), Ok(12_500_000));
        assert_eq!(parse_rate("0"), Ok(0));
        for bad in ["", "fast", "-1", "NaN", "inf", "1000001", "0.0000004"] {
            let err = parse_rate(bad).unwrap_err();
            assert!(err.contains(&format!("{bad:?}")) && err.contains("MB/s"), "{err}");
        }
    }
}
