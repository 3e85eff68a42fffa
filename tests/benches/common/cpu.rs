//! Where the CPU went over a span of work: every process's `utime + stime`
//! (`/proc/<pid>/stat`) and the machine's busy time (`/proc/stat`), sampled every 50 ms
//! on a thread of its own, then summed per kind of process between two instants. Linux
//! only; servers in containers are processes of this kernel too, so both backends are
//! seen. A process that lives less than one sample is missed, and one that ends within
//! a window loses what it used after its last sample.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// USER_HZ on Linux.
const TICK: f64 = 100.0;

/// One sample: when, the machine's busy and total CPU seconds, and each process's CPU
/// seconds with its kind.
struct Sample {
    at: Instant,
    busy: f64,
    total: f64,
    procs: HashMap<i32, (&'static str, f64)>,
}

/// A sampler running until [`Sampler::finish`].
pub(crate) struct Sampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Sample>>,
}

/// The samples [`Sampler::finish`] returns.
pub(crate) struct Samples(Vec<Sample>);

/// CPU seconds between two instants.
pub(crate) struct Window {
    /// Wall time.
    pub(crate) wall: Duration,
    /// The machine's busy CPU seconds (every core), and its share of all cores' time.
    pub(crate) busy: f64,
    pub(crate) share: f64,
    /// CPU seconds per kind of process, most first.
    pub(crate) kinds: Vec<(&'static str, f64)>,
}

impl Sampler {
    /// Starts sampling.
    pub(crate) fn start() -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut out = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                out.push(sample());
                std::thread::sleep(Duration::from_millis(50));
            }
            out.push(sample());
            out
        });
        Sampler { stop, thread }
    }

    /// Stops sampling.
    pub(crate) fn finish(self) -> Samples {
        self.stop.store(true, Ordering::Relaxed);
        Samples(self.thread.join().unwrap_or_default())
    }
}

impl Samples {
    /// The CPU used from `from` to `to` (each taken at the nearest sample before it).
    pub(crate) fn window(&self, from: Instant, to: Instant) -> Option<Window> {
        let before = |t: Instant| self.0.iter().rposition(|s| s.at <= t);
        let (a, b) = (before(from)?, before(to)?);
        let (first, last) = (&self.0[a], &self.0[b]);
        // Sample by sample, each process's CPU since the sample before (all of it for one
        // born since), counted to its kind at the later sample (a backend that copies,
        // then builds an index, counts to each in turn).
        let mut kinds: HashMap<&'static str, f64> = HashMap::new();
        for pair in self.0[a..=b].windows(2) {
            let (prev, cur) = (&pair[0], &pair[1]);
            for (pid, (kind, cpu)) in &cur.procs {
                let before = prev.procs.get(pid).map_or(0.0, |(_, c)| *c);
                *kinds.entry(kind).or_default() += cpu - before;
            }
        }
        let mut kinds: Vec<(&'static str, f64)> = kinds.into_iter().filter(|(_, c)| *c > 0.0).collect();
        kinds.sort_by(|x, y| y.1.total_cmp(&x.1));
        let total = last.total - first.total;
        Some(Window {
            wall: last.at.duration_since(first.at),
            busy: last.busy - first.busy,
            share: if total > 0.0 { (last.busy - first.busy) / total } else { 0.0 },
            kinds,
        })
    }
}

/// What kind of process `pid` is, from its command line (Postgres's process titles).
fn kind(cmdline: &str) -> &'static str {
    let own = std::process::id().to_string();
    // Postgres 15's titles: "logical replication worker for subscription N sync M" for
    // a table-sync worker, without "sync" for the apply worker.
    if cmdline.contains("logical replication worker") && cmdline.contains(" sync ") {
        "target: table-sync workers (the copy's writes)"
    } else if cmdline.contains("logical replication worker") {
        "target: apply worker"
    } else if cmdline.starts_with("postgres:") && cmdline.contains("walsender") {
        "source: walsenders (the copy's reads)"
    } else if cmdline.starts_with("pg_dump") {
        "pg_dump (client)"
    } else if cmdline.starts_with("psql") {
        "psql (client)"
    } else if cmdline.starts_with("postgres:") && cmdline.contains(" COPY") {
        "server backends running COPY"
    } else if cmdline.starts_with("postgres:") && cmdline.contains("CREATE INDEX") {
        "server backends building indexes"
    } else if cmdline.starts_with("postgres:") {
        "other Postgres processes (backends, WAL writer, checkpointer, ...)"
    } else if own == cmdline {
        "this benchmark"
    } else {
        "everything else on the machine"
    }
}

fn sample() -> Sample {
    let at = Instant::now();
    let own = std::process::id();
    let mut procs = HashMap::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
            // Fields after the command (which ends with ')'): utime is 14th, stime 15th.
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let f: Vec<&str> = rest.split_whitespace().collect();
            let (Some(u), Some(s)) = (f.get(11), f.get(12)) else { continue };
            let (Ok(u), Ok(s)) = (u.parse::<f64>(), s.parse::<f64>()) else { continue };
            let cmdline = if u32::try_from(pid).is_ok_and(|p| p == own) {
                own.to_string()
            } else {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .map(|b| String::from_utf8_lossy(&b).replace('\0', " ").trim().to_owned())
                    .unwrap_or_default()
            };
            procs.insert(pid, (kind(&cmdline), (u + s) / TICK));
        }
    }
    let (mut busy, mut total) = (0.0, 0.0);
    if let Ok(stat) = std::fs::read_to_string("/proc/stat")
        && let Some(line) = stat.lines().next()
    {
        // user nice system idle iowait irq softirq steal ...
        let v: Vec<f64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
        total = v.iter().take(8).sum::<f64>() / TICK;
        busy = total - (v.get(3).copied().unwrap_or(0.0) + v.get(4).copied().unwrap_or(0.0)) / TICK;
    }
    Sample { at, busy, total, procs }
}

/// Prints two windows side by side: wall time, the machine's busy time, then CPU seconds
/// per kind of process.
pub(crate) fn print_side_by_side(titles: [&str; 2], w: [&Window; 2]) {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    println!("where the CPU went (/proc, sampled every 50 ms; {cores} cores):");
    println!("  {:<66} {:>16} {:>16}", "", titles[0], titles[1]);
    println!("  {:<66} {:>14.2} s {:>14.2} s", "wall", w[0].wall.as_secs_f64(), w[1].wall.as_secs_f64());
    println!(
        "  {:<66} {:>9.2} s {:>3.0}% {:>9.2} s {:>3.0}%",
        "the machine busy (CPU-s, % of every core's time)",
        w[0].busy,
        w[0].share * 100.0,
        w[1].busy,
        w[1].share * 100.0
    );
    let mut names: Vec<&'static str> = w[0].kinds.iter().chain(&w[1].kinds).map(|(k, _)| *k).collect();
    names.dedup();
    let mut seen = Vec::new();
    for k in names {
        if seen.contains(&k) {
            continue;
        }
        seen.push(k);
        let of = |i: usize| w[i].kinds.iter().find(|(n, _)| *n == k).map_or(0.0, |(_, c)| *c);
        println!("  {:<66} {:>14.2} s {:>14.2} s", k, of(0), of(1));
    }
}
