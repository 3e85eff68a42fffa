//! A `main` for integration-test binaries: one tokio runtime and one [`Cluster`] per
//! binary, shared by its tests, torn down when the binary ends (also after failing or
//! panicking tests).
//!
//! Test binaries set `harness = false` and hand their tests to [`Harness`]; output and
//! command-line options are libtest's (`cargo test -- NAME`, `--list`, `--test-threads`),
//! through `libtest-mimic`.
//!
//! - Tests run in parallel and share the hosts; each takes its own databases with
//!   [`TestContext::databases`], so tests do not see each other's tables.
//! - Tests that fault hosts (stop, kill, pause) are registered with
//!   [`Harness::exclusive`]: they run alone among the tests of the shared cluster (one
//!   after another, beside the tests with clusters of their own), and every host is
//!   healed afterwards; `register!(quiet: ...)` ones run alone on the machine, last.
//! - The cluster starts on first use, so `--list` or a filter that matches nothing starts
//!   no server. When it cannot start, every test fails with the reason.
//!
//! ```no_run
//! use shardline_testkit::harness::{Harness, TestContext, TestResult};
//!
//! async fn tables_are_per_database(ctx: TestContext) -> TestResult {
//!     let db = ctx.databases().await?;
//!     ctx.hosts()[0].connect(&db).await?.batch_execute("CREATE TABLE t (id int)").await?;
//!     Ok(())
//! }
//!
//! fn main() {
//!     Harness::new(3).test("tables_are_per_database", tables_are_per_database).run()
//! }
//! ```

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use libtest_mimic::{Arguments, Failed, Trial};
use tokio::sync::{OnceCell, RwLock};

use crate::host::error_chain;
use crate::{Cluster, Host, Result};

/// What a test returns: `Err` (or a panic) fails it.
pub type TestResult = std::result::Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// The environment variable that overrides the per-test time limit, in seconds.
pub const TIMEOUT_ENV: &str = "SHARDLINE_TEST_TIMEOUT_SECS";

/// The environment variable that sets from how many seconds a test's time is printed
/// (`shardline-testkit: NAME took N s (ended M s into the run)`); default
/// [`DEFAULT_SLOW`], `0` prints every test's.
pub const SLOW_ENV: &str = "SHARDLINE_TEST_SLOW_SECS";

/// From how long a test's time is printed when [`SLOW_ENV`] is unset.
pub const DEFAULT_SLOW: Duration = Duration::from_secs(10);

/// The environment variable that narrows a run to the tests whose subject is the hosts
/// themselves: `SHARDLINE_TEST_SCOPE=hosts` runs the tests that stop, kill, pause or
/// start hosts of their own (registered `exclusive`, `quiet` or `own`) and those of the
/// [`HOST_MODULES`] (the kit's backends, faults, cut links and leftovers), and leaves
/// out the rest, saying so and how many; a scope that selects no test fails the run. CI runs every test on one backend and this scope on
/// the other: the tests left out run the same SQL against the same Postgres either way.
/// Unset (or `all`) runs everything.
pub const SCOPE_ENV: &str = "SHARDLINE_TEST_SCOPE";

/// The modules whose every test [`SCOPE_ENV`]`=hosts` keeps: the kit's own backends and
/// hosts (`cluster::`), faults, cut links, and servers left by a killed test process.
pub const HOST_MODULES: [&str; 4] = ["cluster::", "faults::", "lifecycle::", "partitions::"];

/// A test's time limit when [`TIMEOUT_ENV`] is unset: a hung test fails instead of
/// holding CI until its own limit.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

type TestFn = Arc<dyn Fn(TestContext) -> BoxFuture<'static, TestResult> + Send + Sync>;

struct Case {
    name: String,
    sharing: Sharing,
    run: TestFn,
}

impl Case {
    /// Whether [`SCOPE_ENV`]`=hosts` selects it.
    fn is_about_hosts(&self) -> bool {
        !matches!(self.sharing, Sharing::Shared | Sharing::Apart)
            || HOST_MODULES.iter().any(|m| self.name.starts_with(m))
    }
}

/// How a test shares the binary's cluster with the others.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// It runs beside the other shared tests (and the own-cluster ones).
    Shared,
    /// It runs alone among the tests of the shared cluster (it faults hosts); every host
    /// is healed afterwards. It may run beside the tests with clusters of their own.
    Exclusive,
    /// As [`Sharing::Exclusive`], and alone on the machine: no other test runs beside it
    /// (it asserts latencies a loaded machine would break).
    Quiet,
    /// It starts a cluster of its own and never touches the shared one: it runs beside
    /// the exclusive and the shared tests (these are the longest); quiet tests wait for
    /// it.
    Own,
    /// As [`Sharing::Own`], for a test that needs a cluster of its own only for room (a
    /// long one, or one that fills a host) and uses it through SQL alone: it starts with
    /// the first tests, and the hosts' scope ([`SCOPE_ENV`]) leaves it out as it leaves
    /// out the shared ones. Ranked before the `own:` tests, beside the first exclusive one.
    Apart,
}

/// What a test gets: the shared cluster, and fresh databases on demand.
#[derive(Debug, Clone)]
pub struct TestContext {
    cluster: Arc<Cluster>,
    name: Arc<str>,
    databases: Arc<AtomicUsize>,
}

impl TestContext {
    /// The cluster shared by every test of the binary.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// The cluster's hosts.
    pub fn hosts(&self) -> &[Host] {
        self.cluster.hosts()
    }

    /// The test's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Creates a database, new and empty, on every host, and returns its name (the same
    /// on each host). Named after the test, so a failing test's data can be found.
    ///
    /// # Errors
    ///
    /// When a host refuses.
    pub async fn databases(&self) -> Result<String> {
        let n = self.databases.fetch_add(1, Ordering::Relaxed);
        let name = database_name(n, &self.name);
        self.cluster.create_database(&name).await?;
        Ok(name)
    }
}

/// `t{n}_{test name}`, lowercased, with every other character made `_`, at most 63 bytes.
fn database_name(n: usize, test: &str) -> String {
    let mut name = format!("t{n}_");
    for c in test.chars() {
        if name.len() >= 63 {
            break;
        }
        name.push(if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' });
    }
    name
}

/// The tests of one binary, and how many hosts they share.
pub struct Harness {
    hosts: usize,
    cases: Vec<Case>,
}

impl std::fmt::Debug for Harness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harness")
            .field("hosts", &self.hosts)
            .field("tests", &self.cases.iter().map(|c| c.name.as_str()).collect::<Vec<_>>())
            .finish()
    }
}

impl Harness {
    /// A harness whose tests share a cluster of `hosts` servers.
    pub fn new(hosts: usize) -> Self {
        Harness { hosts, cases: Vec::new() }
    }

    /// Adds every test the binary registered with [`register!`](crate::register): the
    /// exclusive ones first (one after another, while the tests with a cluster of their
    /// own, next, `apart:` before `own:`, run beside them), then the shared ones, then the
    /// quiet ones, each group in name order.
    pub fn registered(mut self) -> Self {
        let mut all: Vec<&Registered> = inventory::iter::<Registered>.into_iter().collect();
        let rank = |s: Sharing| match s {
            Sharing::Exclusive => 0,
            // The long tests with clusters of their own for room, then the others.
            Sharing::Apart => 1,
            Sharing::Own => 2,
            Sharing::Shared => 3,
            Sharing::Quiet => 4,
        };
        all.sort_by_key(|r| (rank(r.sharing), r.path()));
        for r in all {
            self = self.add(&r.path(), r.sharing, r.run);
        }
        self
    }

    /// Adds a test that runs in parallel with the others.
    pub fn test<F, Fut>(self, name: &str, test: F) -> Self
    where
        F: Fn(TestContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = TestResult> + Send + 'static,
    {
        self.add(name, Sharing::Shared, test)
    }

    /// Adds a test that runs alone among the shared cluster's tests (it may stop, kill or
    /// pause hosts); every host is brought back to running after it, whether it passed
    /// or not.
    pub fn exclusive<F, Fut>(self, name: &str, test: F) -> Self
    where
        F: Fn(TestContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = TestResult> + Send + 'static,
    {
        self.add(name, Sharing::Exclusive, test)
    }

    /// Adds a test that starts a cluster of its own and never touches the shared one: it
    /// runs beside the exclusive and the shared tests; quiet tests wait for it.
    pub fn own<F, Fut>(self, name: &str, test: F) -> Self
    where
        F: Fn(TestContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = TestResult> + Send + 'static,
    {
        self.add(name, Sharing::Own, test)
    }

    /// Adds a test that runs alone on the machine (it asserts latencies a loaded machine
    /// would break), after every other; as an exclusive one, every host is healed after
    /// it.
    pub fn quiet<F, Fut>(self, name: &str, test: F) -> Self
    where
        F: Fn(TestContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = TestResult> + Send + 'static,
    {
        self.add(name, Sharing::Quiet, test)
    }

    fn add<F, Fut>(mut self, name: &str, sharing: Sharing, test: F) -> Self
    where
        F: Fn(TestContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = TestResult> + Send + 'static,
    {
        let run: TestFn = Arc::new(move |ctx| Box::pin(test(ctx)));
        self.cases.push(Case { name: name.to_owned(), sharing, run });
        self
    }

    /// Runs the tests the command line selects, tears the cluster down, and exits with
    /// libtest's status.
    ///
    /// With [`HOLD_ENV`]` = N` in the environment it runs no test: it starts a cluster of
    /// N hosts, prints `shardline-testkit-hold PORT...` on stdout and waits to be killed.
    /// Tests use this to show that a killed test process leaves no server behind.
    pub fn run(self) -> ! {
        if let Some(hosts) = std::env::var(HOLD_ENV).ok().and_then(|n| n.parse::<usize>().ok()) {
            hold(hosts)
        }
        let scope = match std::env::var(SCOPE_ENV).ok().as_deref() {
            None | Some("" | "all") => false,
            Some("hosts") => true,
            Some(other) => {
                eprintln!("shardline-testkit: {SCOPE_ENV}={other:?}: expected `all` or `hosts`");
                std::process::exit(101);
            }
        };
        let mut cases = self.cases;
        if scope {
            let all = cases.len();
            cases.retain(Case::is_about_hosts);
            if cases.is_empty() && all > 0 {
                eprintln!("shardline-testkit: {SCOPE_ENV}=hosts selected none of the {all} tests");
                std::process::exit(101);
            }
            eprintln!(
                "shardline-testkit: {SCOPE_ENV}=hosts: {} of {all} tests selected (those that fault, cut or \
                 start hosts); the other {} are left out of this run",
                cases.len(),
                all - cases.len()
            );
        }
        let mut args = Arguments::from_args();
        // The tests wait on servers, not on the CPU: more tests at once than cores pay
        // off, up to a point (6 overloaded two cores: latencies tripled), so 4 run at once
        // (`--test-threads` sets how many). The harness, not libtest, holds them to that
        // (`Shared::slots`): libtest gets a thread for every test it could start, so a test
        // waiting for its turn (an exclusive test behind another) holds no slot, and the
        // exclusive tests run one after another beside the tests with clusters of their
        // own, instead of alone with every other thread idle.
        let width = args.test_threads.unwrap_or(4).max(1);
        args.test_threads = Some(cases.len().clamp(1, 64));
        let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("shardline-testkit: cannot build a tokio runtime: {e}");
                std::process::exit(101);
            }
        };
        let timeout = std::env::var(TIMEOUT_ENV)
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or(DEFAULT_TIMEOUT, Duration::from_secs);
        let slow = std::env::var(SLOW_ENV)
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or(DEFAULT_SLOW, Duration::from_secs);
        let shared = Arc::new(Shared {
            hosts: self.hosts,
            cluster: OnceCell::new(),
            exclusive: RwLock::new(()),
            own: RwLock::new(()),
            slots: tokio::sync::Semaphore::new(width),
            width: u32::try_from(width).unwrap_or(u32::MAX),
            databases: Arc::new(AtomicUsize::new(0)),
            timeout,
            slow,
            began: std::time::Instant::now(),
            serial: std::sync::Mutex::new(Duration::ZERO),
            turn: tokio::sync::watch::Sender::new(0),
        });
        // Each test the command line selects gets its turn to queue for its locks, in the
        // order above (libtest hands tests out in that order, but up to 64 threads then
        // race: without turns, shared tests could queue ahead of exclusive ones).
        let mut next_ticket = 0;
        let trials = cases
            .into_iter()
            .map(|case| {
                let shared = Arc::clone(&shared);
                let handle = runtime.handle().clone();
                let name = case.name.clone();
                let ticket = if args.is_filtered_out(&Trial::test(case.name.clone(), || Ok(()))) {
                    usize::MAX
                } else {
                    next_ticket += 1;
                    next_ticket - 1
                };
                Trial::test(case.name, move || {
                    handle.block_on(shared.run_case(&name, case.sharing, &case.run, ticket))
                })
            })
            .collect();
        let conclusion = libtest_mimic::run(&args, trials);
        let serial = *shared.serial.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !serial.is_zero() {
            eprintln!(
                "shardline-testkit: {:.1} s in all; the exclusive and quiet tests, one after another, took {:.1} s",
                shared.began.elapsed().as_secs_f64(),
                serial.as_secs_f64()
            );
        }
        if let Some(Ok(cluster)) = shared.cluster.get()
            && let Err(e) = runtime.block_on(cluster.shutdown())
        {
            eprintln!("shardline-testkit: tearing the cluster down: {}", error_chain(&e));
        }
        drop(runtime);
        conclusion.exit()
    }
}

/// The environment variable that turns a test binary into a cluster holder (see
/// [`Harness::run`]).
pub const HOLD_ENV: &str = "SHARDLINE_TESTKIT_HOLD_CLUSTER";

/// What a holder prints, followed by its hosts' ports, once its cluster is up.
pub const HOLD_READY: &str = "shardline-testkit-hold";

/// With this set beside [`HOLD_ENV`], the holder opens a session on its last host and
/// pauses that host before it says it is ready; it prints `paused PID` after the ports,
/// PID being the session's backend process (as the host sees it: on the docker backend,
/// a process of the container). A paused host's backends cannot notice that their
/// postmaster died with the holder.
pub const HOLD_PAUSE_LAST_ENV: &str = "SHARDLINE_TESTKIT_HOLD_PAUSE_LAST";

fn hold(hosts: usize) -> ! {
    use std::io::Write;
    let code = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Err(e) => {
            eprintln!("shardline-testkit: cannot build a tokio runtime: {e}");
            101
        }
        Ok(runtime) => runtime.block_on(async {
            match Cluster::start(hosts).await {
                Err(e) => {
                    eprintln!("shardline-testkit: the held cluster did not start: {}", error_chain(&e));
                    1
                }
                Ok(cluster) => {
                    let ports: Vec<String> =
                        cluster.hosts().iter().map(|h| h.endpoint().port.to_string()).collect();
                    let mut ready = format!("{HOLD_READY} {}", ports.join(" "));
                    // Kept open (never dropped) while the holder waits to be killed.
                    let mut session = None;
                    if std::env::var_os(HOLD_PAUSE_LAST_ENV).is_some() {
                        match pause_last(&cluster).await {
                            Ok((client, pid)) => {
                                session = Some(client);
                                ready.push_str(&format!(" paused {pid}"));
                            }
                            Err(e) => {
                                eprintln!(
                                    "shardline-testkit: the held cluster's last host: {}",
                                    error_chain(&e)
                                );
                                return 1;
                            }
                        }
                    }
                    println!("{ready}");
                    let _ = std::io::stdout().flush();
                    // Until killed; the cluster is deliberately never shut down.
                    std::future::pending::<()>().await;
                    drop(session);
                    0
                }
            }
        }),
    };
    std::process::exit(code)
}

/// Opens a session on the cluster's last host, then pauses the host; returns the session
/// and its backend's process ID.
async fn pause_last(cluster: &Cluster) -> Result<(tokio_postgres::Client, i32)> {
    let host = cluster.hosts().last().ok_or(crate::Error::NoSuchHost { index: 0, hosts: 0 })?;
    let client = host.connect("postgres").await?;
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .map_err(|source| crate::Error::Postgres {
            host: host.name().to_owned(),
            what: "reading the held session's backend".into(),
            source,
        })?
        .get(0);
    host.pause().await?;
    Ok((client, pid))
}

struct Shared {
    hosts: usize,
    cluster: OnceCell<std::result::Result<Arc<Cluster>, String>>,
    /// Read-held by ordinary tests, write-held by exclusive ones.
    exclusive: RwLock<()>,
    /// Read-held by tests with a cluster of their own, write-held by quiet ones: a quiet
    /// test runs on a machine no other test loads (it asserts latencies).
    own: RwLock<()>,
    /// How many tests run at once: a running test holds one (a quiet one, all), taken
    /// after its locks, so a test waiting for a lock holds none.
    slots: tokio::sync::Semaphore,
    width: u32,
    databases: Arc<AtomicUsize>,
    timeout: Duration,
    /// From how long a test's time is printed ([`SLOW_ENV`]).
    slow: Duration,
    /// When the run began, and how long the exclusive and quiet tests took (their sum,
    /// not counting the heals after them).
    began: std::time::Instant,
    serial: std::sync::Mutex<Duration>,
    /// The ticket of the test whose turn it is to queue for its locks.
    turn: tokio::sync::watch::Sender<usize>,
}

impl Shared {
    async fn cluster(&self) -> std::result::Result<Arc<Cluster>, Failed> {
        let cluster = self
            .cluster
            .get_or_init(|| async {
                match Cluster::start(self.hosts).await {
                    Ok(c) => {
                        eprintln!(
                            "shardline-testkit: {} hosts started in {:.2} s ({} backend)",
                            c.hosts().len(),
                            c.startup_time().as_secs_f64(),
                            c.backend()
                        );
                        Ok(Arc::new(c))
                    }
                    Err(e) => Err(format!("the test cluster did not start: {}", error_chain(&e))),
                }
            })
            .await;
        cluster.clone().map_err(Failed::from)
    }

    async fn run_case(
        &self,
        name: &str,
        sharing: Sharing,
        run: &TestFn,
        ticket: usize,
    ) -> std::result::Result<(), Failed> {
        let exclusive = matches!(sharing, Sharing::Exclusive | Sharing::Quiet);
        // A quiet test first waits for the tests with clusters of their own, then (as an
        // exclusive one does) for the shared ones, then for every slot. The locks are
        // fair, and each test queues for its first one in its turn: a shared test listed
        // after an exclusive one waits for it.
        let acquire = async {
            let (own_read, own_write) = match sharing {
                Sharing::Quiet => (None, Some(self.own.write().await)),
                Sharing::Own | Sharing::Apart => (Some(self.own.read().await), None),
                Sharing::Shared | Sharing::Exclusive => (None, None),
            };
            let (read, write) = match sharing {
                Sharing::Exclusive | Sharing::Quiet => (None, Some(self.exclusive.write().await)),
                Sharing::Shared => (Some(self.exclusive.read().await), None),
                Sharing::Own | Sharing::Apart => (None, None),
            };
            let slots = self
                .slots
                .acquire_many(if sharing == Sharing::Quiet { self.width } else { 1 })
                .await
                .map_err(|_| Failed::from("the harness's slots were closed"))?;
            Ok::<_, Failed>((slots, read, write, own_read, own_write))
        };
        let mut acquire = std::pin::pin!(acquire);
        // The sender lives as long as `self`: `wait_for` cannot fail here.
        let _ = self.turn.subscribe().wait_for(|t| *t >= ticket).await;
        // Queued (or through) once polled.
        let first = futures::poll!(acquire.as_mut());
        self.turn.send_modify(|t| *t = (*t).max(ticket.saturating_add(1)));
        let held = match first {
            std::task::Poll::Ready(held) => held,
            std::task::Poll::Pending => acquire.await,
        };
        let (slots, read, write, own_read, own_write) = held?;
        let cluster = self.cluster().await?;
        let ctx = TestContext {
            cluster: Arc::clone(&cluster),
            name: name.into(),
            databases: Arc::clone(&self.databases),
        };
        let began = std::time::Instant::now();
        let outcome = AssertUnwindSafe(tokio::time::timeout(self.timeout, run(ctx))).catch_unwind().await;
        // Where a suite's time goes, in CI's log: every test that took 10 s or more (or
        // SHARDLINE_TEST_SLOW_SECS), and when it ended.
        let took = began.elapsed();
        if took >= self.slow {
            eprintln!(
                "shardline-testkit: {name} took {:.1} s (ended {:.1} s into the run)",
                took.as_secs_f64(),
                self.began.elapsed().as_secs_f64()
            );
        }
        if exclusive {
            *self.serial.lock().unwrap_or_else(std::sync::PoisonError::into_inner) += took;
        }
        let result = match outcome {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(e))) => Err(Failed::from(error_chain(e.as_ref()))),
            Ok(Err(_)) => {
                Err(Failed::from(format!("timed out after {:?} (set {TIMEOUT_ENV} to change)", self.timeout)))
            }
            Err(panic) => Err(Failed::from(panic_message(panic.as_ref()))),
        };
        if exclusive && let Err(e) = cluster.heal().await {
            let healed = format!("healing the hosts after the test failed: {}", error_chain(&e));
            return Err(match result {
                Ok(()) => Failed::from(healed),
                Err(f) => Failed::from(format!("{}\n{healed}", f.message().unwrap_or_default())),
            });
        }
        drop((slots, read, write, own_read, own_write));
        result
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = panic.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_owned()
    }
}

/// A test of a binary, registered beside its function with [`register!`](crate::register):
/// collected by [`Harness::registered`].
#[derive(Debug)]
pub struct Registered {
    module: &'static str,
    name: &'static str,
    sharing: Sharing,
    run: fn(TestContext) -> std::pin::Pin<Box<dyn Future<Output = TestResult> + Send>>,
}

impl Registered {
    /// What [`register!`](crate::register) makes; not for direct use.
    #[doc(hidden)]
    pub const fn new(
        module: &'static str,
        name: &'static str,
        sharing: Sharing,
        run: fn(TestContext) -> std::pin::Pin<Box<dyn Future<Output = TestResult> + Send>>,
    ) -> Self {
        Registered { module, name, sharing, run }
    }

    /// `module::function`, the crate's own name left out (`moves::a_shard_moves`).
    fn path(&self) -> String {
        let module = self.module.split_once("::").map_or("", |(_, m)| m);
        if module.is_empty() { self.name.to_owned() } else { format!("{module}::{}", self.name) }
    }
}

inventory::collect!(Registered);

/// Registers a test where it is written, the one place it is named:
/// `shardline_testkit::register!(shared: name);` runs in parallel with the others,
/// `shardline_testkit::register!(exclusive: name);` alone among the shared cluster's
/// tests (it faults hosts), first, one after another, beside the own-cluster ones;
/// `shardline_testkit::register!(own: name);` beside the exclusive and the shared ones (it
/// starts a cluster of its own and never touches the shared one);
/// `shardline_testkit::register!(apart: name);` as `own:`, for a test whose cluster is only
/// room (the hosts' scope leaves it out);
/// `shardline_testkit::register!(quiet: name);` last, alone on the machine (it asserts
/// latencies), and as an exclusive one. Put it above the test's doc comment; [`Harness::registered`] collects every one the binary
/// holds, named `module::function`.
#[macro_export]
macro_rules! register {
    (shared: $test:ident) => {
        $crate::register!(@ Shared, $test);
    };
    (exclusive: $test:ident) => {
        $crate::register!(@ Exclusive, $test);
    };
    (own: $test:ident) => {
        $crate::register!(@ Own, $test);
    };
    (apart: $test:ident) => {
        $crate::register!(@ Apart, $test);
    };
    (quiet: $test:ident) => {
        $crate::register!(@ Quiet, $test);
    };
    (@ $sharing:ident, $test:ident) => {
        $crate::inventory::submit! {
            $crate::harness::Registered::new(module_path!(), stringify!($test), $crate::harness::Sharing::$sharing, |ctx| {
                ::std::boxed::Box::pin($test(ctx))
            })
        }
    };
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{Case, Sharing, TestContext, TestResult, database_name};

    #[test]
    fn database_names_follow_the_test() {
        assert_eq!(database_name(3, "faults::kill_then_start"), "t3_faults__kill_then_start");
        let long = database_name(12, &"X".repeat(100));
        assert_eq!(long.len(), 63);
        crate::cluster::check_database_name(&long).unwrap();
    }

    #[test]
    fn the_hosts_scope_keeps_the_tests_that_fault_cut_or_start_hosts() {
        let case = |name: &str, sharing| Case {
            name: name.to_owned(),
            sharing,
            run: Arc::new(|_: TestContext| Box::pin(async { TestResult::Ok(()) })),
        };
        let selected = |c: Case| c.is_about_hosts();
        assert!(selected(case("moves::a_host_killed_inside_a_step", Sharing::Exclusive)));
        assert!(selected(case("moves::a_host_paused_inside_each_step", Sharing::Own)));
        assert!(!selected(case("pooler::at_2000_shards", Sharing::Apart)));
        assert!(selected(case("ids::after_an_idle_gap", Sharing::Quiet)));
        assert!(selected(case("partitions::a_cut_link_to_one_host", Sharing::Shared)));
        assert!(selected(case("faults::anything", Sharing::Shared)));
        assert!(selected(case("lifecycle::a_killed_test_process_leaves_no_server", Sharing::Shared)));
        assert!(selected(case("cluster::backend_is_the_one_asked_for", Sharing::Shared)));
        assert!(!selected(case("repo::get_many_reads_each_shard_once", Sharing::Shared)));
        assert!(!selected(case("pooler::behind_pgbouncer", Sharing::Shared)));
    }
}
