//! The local-process backend: one `postgres` process per host from the installed
//! binaries, on a free loopback port, its data directory on tmpfs where there is one.
//!
//! As root the servers run as the `postgres` user (initdb refuses root). Every server is
//! started under `setpriv --pdeathsig KILL`, so it dies with the test process even when
//! that process is SIGKILLed; data directories a dead run left behind are removed by the
//! next run.

use std::fs::{self, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::sync::{Mutex, OnceCell};

use crate::backend::{Backend, BackendKind, PG_BIN_ENV};
use crate::host::{Endpoint, Host, HostControl};
use crate::{Error, Result};

/// Where the binaries are when `SHARDLINE_PG_BIN` is unset (Debian's PostgreSQL 15).
const DEFAULT_BIN: &str = "/usr/lib/postgresql/15/bin";

/// Prefix of the directories the backend makes; the test process's pid follows.
const DIR_PREFIX: &str = "shardline-tk-";

static RUNS: AtomicUsize = AtomicUsize::new(0);

/// Runs each host as a local `postgres` process.
#[derive(Debug)]
pub(crate) struct LocalBackend {
    bin: PathBuf,
    /// This run's directory: the template cluster, each host's data directory and log.
    base: PathBuf,
    /// uid and gid to run the servers as, when the test process is root.
    user: Option<(u32, u32)>,
    /// A cluster made by initdb once, copied for every host (a copy is ~5x faster).
    template: OnceCell<PathBuf>,
}

impl LocalBackend {
    /// Checks that the binaries and (as root) the `postgres` user exist.
    pub(crate) fn new() -> Result<Self> {
        let bin = std::env::var_os(PG_BIN_ENV).map_or_else(|| PathBuf::from(DEFAULT_BIN), PathBuf::from);
        for program in ["postgres", "initdb"] {
            if !bin.join(program).is_file() {
                return Err(unavailable(format!(
                    "{} not found (install PostgreSQL 15's server, e.g. apt-get install postgresql-15, or set {PG_BIN_ENV})",
                    bin.join(program).display()
                )));
            }
        }
        if Command::new("setpriv")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_err()
        {
            return Err(unavailable("setpriv not found (install util-linux)".into()));
        }
        let user = if nix::unistd::geteuid().is_root() {
            match nix::unistd::User::from_name("postgres") {
                Ok(Some(u)) => Some((u.uid.as_raw(), u.gid.as_raw())),
                _ => return Err(unavailable(
                    "running as root, and there is no `postgres` user to run the servers as (initdb refuses root)".into(),
                )),
            }
        } else {
            None
        };
        let parent = scratch_parent();
        remove_leftovers(&parent);
        let base = parent.join(format!(
            "{DIR_PREFIX}{}-{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&base).map_err(io_err("creating the cluster directory", &base))?;
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(&base, Some(uid), Some(gid))
                .map_err(io_err("handing the cluster directory to postgres", &base))?;
        }
        Ok(LocalBackend { bin, base, user, template: OnceCell::new() })
    }

    async fn template(&self) -> Result<&Path> {
        self.template
            .get_or_try_init(|| async {
                let dir = self.base.join("template");
                let mut initdb = Command::new(self.bin.join("initdb"));
                initdb.arg("-D").arg(&dir).args([
                    "-U",
                    "postgres",
                    "-A",
                    "trust",
                    "-E",
                    "UTF8",
                    "--locale=C.UTF-8",
                    "--no-instructions",
                    "-N",
                ]);
                run_as(initdb, self.user).await?;
                Ok::<_, Error>(dir)
            })
            .await
            .map(PathBuf::as_path)
    }
}

fn unavailable(reason: String) -> Error {
    Error::BackendUnavailable { backend: "local", reason }
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::Io { what, path: path.to_owned(), source }
}

/// tmpfs when the machine has one (a server starts ~5x faster there), else the temp dir.
pub(crate) fn scratch_parent() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() { shm.to_owned() } else { std::env::temp_dir() }
}

/// Removes the directories of runs whose process is gone. Their postmasters died with
/// them, and so did every backend that was running; a backend of a host the dead run had
/// paused (stopped by `SIGSTOP`) cannot notice and stays, frozen, for good. So the
/// processes still working in such a directory (a backend's working directory is its
/// server's data directory) are killed first.
pub(crate) fn remove_leftovers(parent: &Path) {
    let Ok(entries) = fs::read_dir(parent) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(DIR_PREFIX)) else { continue };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|pid| !crate::pid_alive(pid)) {
            let dir = entry.path();
            let killed = kill_processes_under(&dir);
            tracing::info!(dir = %dir.display(), killed, "removing a cluster directory left by a dead test process");
            let _ = fs::remove_dir_all(&dir);
        }
    }
}

/// Sends `SIGKILL` (which a stopped process receives too) to every process whose working
/// directory is `dir` or below it; returns how many. Processes it may not read or signal
/// are left alone.
fn kill_processes_under(dir: &Path) -> usize {
    let Ok(procs) = fs::read_dir("/proc") else { return 0 };
    let mut killed = 0;
    for proc_entry in procs.flatten() {
        let Some(pid) = proc_entry.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else { continue };
        let Ok(cwd) = fs::read_link(proc_entry.path().join("cwd")) else { continue };
        if cwd.starts_with(dir)
            && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)
                .is_ok()
        {
            killed += 1;
        }
    }
    killed
}

/// Runs a short-lived program (initdb, cp) to completion, as `user` when given.
async fn run_as(mut cmd: Command, user: Option<(u32, u32)>) -> Result<()> {
    use std::os::unix::process::CommandExt;
    if let Some((uid, gid)) = user {
        cmd.uid(uid).gid(gid);
    }
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = tokio::task::spawn_blocking(move || cmd.stdin(Stdio::null()).output())
        .await
        .map_err(|e| Error::Io {
            what: "waiting for a helper",
            path: program.clone().into(),
            source: io::Error::other(e),
        })?
        .map_err(io_err("running a helper", Path::new(&program)))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Command {
            program,
            status: out.status.to_string(),
            stderr: tail(&String::from_utf8_lossy(&out.stderr), 20),
        })
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[async_trait]
impl Backend for LocalBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Local
    }

    async fn start_host(&self, index: usize, settings: &[(String, String)]) -> Result<Host> {
        let name = format!("pg{}", index + 1);
        let template = self.template().await?;
        let dir = self.base.join(&name);
        let mut copy = Command::new("cp");
        copy.arg("-a").arg(template).arg(&dir);
        run_as(copy, None).await?;
        let port = crate::free_port()?;
        let control = LocalHost {
            name: name.clone(),
            postgres: self.bin.join("postgres"),
            log: self.base.join(format!("{name}.log")),
            dir,
            port,
            user: self.user,
            settings: settings.to_vec(),
            child: Mutex::new(None),
        };
        control.spawn().await?;
        let endpoint = Endpoint { host: "127.0.0.1".into(), port };
        let host = Host::new(name, endpoint.clone(), endpoint, Box::new(control));
        host.wait_ready().await?;
        Ok(host)
    }

    async fn peer_listen_ip(&self) -> Result<String> {
        Ok("127.0.0.1".into())
    }

    async fn shutdown(&self) -> Result<()> {
        let base = self.base.clone();
        tokio::task::spawn_blocking(move || {
            fs::remove_dir_all(&base).map_err(io_err("removing the cluster directory", &base))
        })
        .await
        .map_err(|e| Error::Io {
            what: "removing the cluster directory",
            path: self.base.clone(),
            source: io::Error::other(e),
        })?
    }
}

#[derive(Debug)]
struct LocalHost {
    name: String,
    postgres: PathBuf,
    dir: PathBuf,
    log: PathBuf,
    port: u16,
    user: Option<(u32, u32)>,
    /// Every `-c key=value` the server runs with.
    settings: Vec<(String, String)>,
    /// The postmaster, while it runs.
    child: Mutex<Option<Child>>,
}

impl LocalHost {
    async fn spawn(&self) -> Result<()> {
        use std::os::unix::process::CommandExt;
        let mut child = self.child.lock().await;
        if child.is_some() {
            return Err(Error::InvalidState { host: self.name.clone(), op: "start", state: "running" });
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(io_err("opening the server log", &self.log))?;
        let log2 = log.try_clone().map_err(io_err("opening the server log", &self.log))?;
        let mut cmd = Command::new("setpriv");
        cmd.args(["--pdeathsig", "KILL", "--"])
            .arg(&self.postgres)
            .arg("-D")
            .arg(&self.dir)
            .arg("-c")
            .arg(format!("port={}", self.port))
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", self.dir.display()))
            // Dynamic shared memory in the data directory rather than /dev/shm, so a
            // killed server leaves nothing outside the directory the kit removes.
            .args(["-c", "dynamic_shared_memory_type=mmap"]);
        for (key, value) in &self.settings {
            cmd.arg("-c").arg(format!("{key}={value}"));
        }
        // The server's own libpq (subscriptions) looks for client certificates under
        // $HOME/.postgresql; as root, HOME would be /root, which the server's user cannot
        // read, and a TLS subscription would fail on it.
        cmd.env("HOME", &self.dir);
        cmd.stdin(Stdio::null()).stdout(log).stderr(log2);
        if let Some((uid, gid)) = self.user {
            cmd.uid(uid).gid(gid);
        }
        *child =
            Some(spawn_from_long_lived_thread(cmd).map_err(io_err("starting postgres", &self.postgres))?);
        Ok(())
    }

    fn pid(child: &Child) -> Result<Pid> {
        i32::try_from(child.id()).map(Pid::from_raw).map_err(|_| Error::Io {
            what: "reading the postmaster's pid",
            path: PathBuf::new(),
            source: io::Error::other("pid out of range"),
        })
    }

    fn signal(&self, pid: Pid, signal: Signal) -> Result<()> {
        match kill(pid, signal) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
            Err(source) => Err(Error::Signal {
                host: self.name.clone(),
                signal: signal.as_str(),
                pid: pid.as_raw(),
                source,
            }),
        }
    }

    /// Sends `signal` to every process of the server: the postmaster and its children
    /// (each backend is its own process group, so a group signal would miss them).
    ///
    /// The postmaster is frozen first, so it forks no child that the listing misses and
    /// its children are still its own (not orphans of init) when they are listed; a
    /// SIGKILL reaches the children before the postmaster, so none of them lives to
    /// see the postmaster die and say goodbye to its client.
    fn signal_all(&self, postmaster: Pid, signal: Signal) -> Result<Vec<Pid>> {
        signal_tree(postmaster, signal, |pid, s| self.signal(pid, s))
    }

    /// Waits for the postmaster to exit, up to `limit`; then SIGKILLs what is left.
    async fn reap(&self, mut child: Child, limit: Duration) -> Result<()> {
        let started = Instant::now();
        loop {
            match child.try_wait() {
                Ok(Some(_)) => return Ok(()),
                Ok(None) if started.elapsed() < limit => tokio::time::sleep(Duration::from_millis(20)).await,
                Ok(None) => {
                    let pid = Self::pid(&child)?;
                    self.signal_all(pid, Signal::SIGKILL)?;
                    tokio::task::spawn_blocking(move || child.wait())
                        .await
                        .map_err(io::Error::other)
                        .and_then(|r| r)
                        .map_err(io_err("waiting for postgres", &self.postgres))?;
                    return Ok(());
                }
                Err(e) => return Err(io_err("waiting for postgres", &self.postgres)(e)),
            }
        }
    }

    async fn take_child(&self, op: &'static str) -> Result<Child> {
        self.child.lock().await.take().ok_or_else(|| Error::InvalidState {
            host: self.name.clone(),
            op,
            state: "not running",
        })
    }

    async fn postmaster(&self, op: &'static str) -> Result<Pid> {
        let guard = self.child.lock().await;
        let child = guard.as_ref().ok_or_else(|| Error::InvalidState {
            host: self.name.clone(),
            op,
            state: "not running",
        })?;
        Self::pid(child)
    }
}

#[async_trait]
impl HostControl for LocalHost {
    async fn start(&self) -> Result<()> {
        self.spawn().await
    }

    async fn stop(&self) -> Result<()> {
        let child = self.take_child("stop").await?;
        // SIGINT is PostgreSQL's fast shutdown.
        self.signal(Self::pid(&child)?, Signal::SIGINT)?;
        self.reap(child, Duration::from_secs(30)).await
    }

    async fn kill(&self) -> Result<()> {
        let child = self.take_child("kill").await?;
        let children = self.signal_all(Self::pid(&child)?, Signal::SIGKILL)?;
        self.reap(child, Duration::from_secs(10)).await?;
        // Orphaned backends still attached to the shared memory would stop the next start.
        let deadline = Instant::now() + Duration::from_secs(10);
        while children.iter().any(|&c| running(c)) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    async fn pause(&self) -> Result<()> {
        // Stop the postmaster first, so it forks no child we would miss.
        self.signal_all(self.postmaster("pause").await?, Signal::SIGSTOP).map(drop)
    }

    async fn resume(&self) -> Result<()> {
        let pid = self.postmaster("resume").await?;
        for c in children_of(pid) {
            self.signal(c, Signal::SIGCONT)?;
        }
        self.signal(pid, Signal::SIGCONT)
    }

    async fn remove(&self) -> Result<()> {
        match self.child.lock().await.take() {
            None => Ok(()),
            Some(child) => {
                self.signal_all(Self::pid(&child)?, Signal::SIGKILL)?;
                self.reap(child, Duration::from_secs(10)).await
            }
        }
    }

    async fn log_tail(&self) -> String {
        fs::read_to_string(&self.log).map(|t| tail(&t, 30)).unwrap_or_default()
    }
}

impl Drop for LocalHost {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.get_mut().take() {
            if let Ok(pid) = Self::pid(&child) {
                let _ = self.signal_all(pid, Signal::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

/// [`LocalHost::signal_all`], with `send` sending each signal: stops `parent`, waits
/// until it is stopped (a SIGSTOP lands when the process next returns to user space, so
/// a `fork` under way when it was sent ends first, and its child must be listed too),
/// then signals its children, then `parent`. Returns the children.
fn signal_tree(parent: Pid, signal: Signal, send: impl Fn(Pid, Signal) -> Result<()>) -> Result<Vec<Pid>> {
    send(parent, Signal::SIGSTOP)?;
    // Stopped, gone, or (ptraced) traced: no fork left under way. Bounded, so a process
    // in uninterruptible sleep holds the caller 2 s at most.
    let deadline = Instant::now() + Duration::from_secs(2);
    while proc_stat(parent.as_raw()).is_some_and(|(state, _)| !matches!(state, 'T' | 't' | 'Z' | 'X'))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let children = children_of(parent);
    for &c in &children {
        send(c, signal)?;
    }
    send(parent, signal)?;
    Ok(children)
}

/// The processes whose parent is `parent`, from /proc.
fn children_of(parent: Pid) -> Vec<Pid> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|&pid| proc_stat(pid).is_some_and(|(_, ppid)| ppid == parent.as_raw()))
        .map(Pid::from_raw)
        .collect()
}

/// A process's state letter and parent pid, from `/proc/PID/stat`.
fn proc_stat(pid: i32) -> Option<(char, i32)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
}

/// Whether `pid` exists and is not a zombie.
fn running(pid: Pid) -> bool {
    proc_stat(pid.as_raw()).is_some_and(|(state, _)| state != 'Z' && state != 'X')
}

/// Spawns `cmd` from one thread that lives as long as the process.
///
/// `PR_SET_PDEATHSIG` (what `setpriv --pdeathsig` sets) fires when the *thread* that
/// forked the child exits, not the process. Test threads and runtime workers come and
/// go, so servers are forked from this thread, which only ends with the process.
pub(crate) fn spawn_from_long_lived_thread(cmd: Command) -> io::Result<Child> {
    type Request = (Command, mpsc::Sender<io::Result<Child>>);
    static SPAWNER: OnceLock<io::Result<mpsc::Sender<Request>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new().name("testkit-spawner".into()).spawn(move || {
            for (mut cmd, reply) in rx {
                let _ = reply.send(cmd.spawn());
            }
        })?;
        Ok(tx)
    });
    let tx = spawner.as_ref().map_err(|e| io::Error::new(e.kind(), e.to_string()))?;
    let (reply_tx, reply_rx) = mpsc::channel();
    tx.send((cmd, reply_tx)).map_err(|_| io::Error::other("the spawner thread is gone"))?;
    reply_rx.recv().map_err(|_| io::Error::other("the spawner thread is gone"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_reads_this_process() {
        let me = i32::try_from(std::process::id()).unwrap();
        let (state, ppid) = proc_stat(me).unwrap();
        assert!(state == 'R' || state == 'S', "state {state}");
        assert_eq!(ppid, nix::unistd::getppid().as_raw());
    }

    #[test]
    fn children_are_found_and_leave() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let me = nix::unistd::getpid();
        let pid = Pid::from_raw(i32::try_from(child.id()).unwrap());
        assert!(children_of(me).contains(&pid));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!running(pid));
    }

    #[test]
    fn a_process_forking_when_it_is_stopped_leaves_no_child_unlisted() {
        let send = |pid: Pid, s: Signal| match kill(pid, s) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
            Err(e) => panic!("signal {s} to {pid}: {e}"),
        };
        for round in 0..10 {
            // Forks as fast as it can: the stop lands in the middle of the burst.
            let mut forker = Command::new("sh")
                .args(["-c", "for i in $(seq 300); do sleep 30 & done; wait"])
                .spawn()
                .unwrap();
            let pid = Pid::from_raw(i32::try_from(forker.id()).unwrap());
            std::thread::sleep(Duration::from_millis(2 * round));
            let listed = signal_tree(pid, Signal::SIGSTOP, send).unwrap();
            // The forker is stopped now: whatever it forked is its child, listed or not.
            let after = children_of(pid);
            let missed: Vec<Pid> = after.iter().filter(|c| !listed.contains(c)).copied().collect();
            signal_tree(pid, Signal::SIGKILL, send).unwrap();
            forker.wait().unwrap();
            for c in after {
                let _ = kill(c, Signal::SIGKILL);
            }
            assert!(missed.is_empty(), "round {round}: {} children forked past the listing", missed.len());
        }
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        assert_eq!(tail("a\nb\nc\n", 2), "b\nc");
        assert_eq!(tail("a", 5), "a");
    }
}
