//! `init`, `migrate`, `map`, `locate` and `status` against real hosts: idempotent,
//! resumable after a host dies, refusing bad input with nothing changed, and agreeing
//! with where rows really are.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::Parser as _;
use shardline_ops::{Error as OpsError, Options, Progress, Report};
use shardline_repo::catalog::{LOCK_KEY, MapListener};
use shardline_router::Config;
use shardline_testkit::Link;
use shardline_testkit::harness::{TestContext, TestResult};
use tokio_postgres::Client;

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The example migrations shipped in `migrations/`.
fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations")
}

/// A cluster under test: a config file (in a directory of its own, with its own
/// migrations) over the first `hosts` hosts, on a fresh database, with the catalog in
/// host 0's database.
pub(crate) struct Fixture {
    db: String,
    dir: PathBuf,
    pub(crate) hosts: usize,
}

impl Fixture {
    pub(crate) async fn new(ctx: &TestContext, hosts: usize, shards: u16) -> Result<Fixture, BoxError> {
        let db = ctx.databases().await?;
        let dir = std::env::temp_dir().join(format!("shardline-it-{}-{db}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("migrations"))?;
        let f = Fixture { db, dir, hosts };
        for entry in std::fs::read_dir(examples())? {
            let entry = entry?;
            std::fs::copy(entry.path(), f.dir.join("migrations").join(entry.file_name()))?;
        }
        f.write_config(ctx, |_, url| url, shards)?;
        Ok(f)
    }

    /// A fixture over every host of `kit` (a cluster of the test's own, started with
    /// settings of its own), on a new database `db`, with the catalog in its first
    /// host's database.
    pub(crate) async fn on_kit(
        kit: &shardline_testkit::Cluster,
        db: &str,
        shards: u16,
    ) -> Result<Fixture, BoxError> {
        kit.create_database(db).await?;
        let dir = std::env::temp_dir().join(format!("shardline-it-{}-{db}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("migrations"))?;
        let f = Fixture { db: db.to_owned(), dir, hosts: kit.hosts().len() };
        for entry in std::fs::read_dir(examples())? {
            let entry = entry?;
            std::fs::copy(entry.path(), f.dir.join("migrations").join(entry.file_name()))?;
        }
        let first = kit.hosts().first().ok_or("the kit has no host")?;
        let urls: Vec<(String, String)> = kit.hosts().iter().map(|h| (h.url(db), h.peer_url(db))).collect();
        f.write_config_at(&first.url(db), &urls, shards)?;
        Ok(f)
    }

    /// The fixture's database (the same name on every host).
    pub(crate) fn db(&self) -> &str {
        &self.db
    }

    pub(crate) fn path(&self) -> PathBuf {
        self.dir.join("shardline.toml")
    }

    /// Writes the config, letting `url` change host `i`'s URL.
    pub(crate) fn write_config(
        &self,
        ctx: &TestContext,
        url: impl Fn(usize, String) -> String,
        shards: u16,
    ) -> Result<(), BoxError> {
        let hosts = &ctx.hosts()[..self.hosts];
        let urls: Vec<(String, String)> =
            hosts.iter().enumerate().map(|(i, h)| (url(i, h.url(&self.db)), h.peer_url(&self.db))).collect();
        self.write_config_at(&ctx.hosts()[0].url(&self.db), &urls, shards)
    }

    /// Writes the config with every party reached through a link a test can cut: the
    /// application's to the catalog and to each host, and each host's peers' to it.
    pub(crate) fn write_config_through(
        &self,
        catalog: &Link,
        app: &[Link],
        peers: &[&Link],
        shards: u16,
    ) -> Result<(), BoxError> {
        let urls: Vec<(String, String)> =
            app.iter().zip(peers).map(|(a, p)| (a.url(&self.db), p.url(&self.db))).collect();
        self.write_config_at(&catalog.url(&self.db), &urls, shards)
    }

    /// Writes the config: the catalog's URL, and each host's URL and peer URL.
    pub(crate) fn write_config_at(
        &self,
        catalog: &str,
        hosts: &[(String, String)],
        shards: u16,
    ) -> Result<(), BoxError> {
        let mut text = format!("logical_shards = {shards}\n\n[catalog]\nurl = \"{catalog}\"\n");
        for (i, (url, peer)) in hosts.iter().enumerate() {
            text.push_str(&format!(
                "\n[[hosts]]\nname = \"pg{}\"\nurl = \"{url}\"\npeer_url = \"{peer}\"\n",
                i + 1
            ));
        }
        std::fs::write(self.path(), text)?;
        Ok(())
    }

    pub(crate) fn migration(&self, name: &str, sql: &str) -> Result<(), BoxError> {
        std::fs::write(self.dir.join("migrations").join(name), sql)?;
        Ok(())
    }

    pub(crate) fn remove_migration(&self, name: &str) -> Result<(), BoxError> {
        std::fs::remove_file(self.dir.join("migrations").join(name))?;
        Ok(())
    }

    pub(crate) fn config(&self) -> Result<Config, BoxError> {
        Ok(shardline::cluster::load_config(&self.path())?)
    }

    /// The config file's text.
    pub(crate) fn config_text(&self) -> Result<String, BoxError> {
        Ok(std::fs::read_to_string(self.path())?)
    }

    /// A config from `text`, read as if it were this fixture's file (another role's
    /// view of the same cluster, say).
    pub(crate) fn config_from(&self, text: &str) -> Result<Config, BoxError> {
        Ok(Config::from_toml(text, "shardline.toml", &self.dir, &|v| std::env::var(v).ok())?)
    }

    pub(crate) async fn client(&self, ctx: &impl Hosts, host: usize) -> Result<Client, BoxError> {
        Ok(Hosts::hosts(ctx)[host].connect(&self.db).await?)
    }
}

/// Where a fixture's hosts are: the harness's shared cluster (a [`TestContext`]) or a
/// cluster a test started for itself.
pub(crate) trait Hosts {
    /// The hosts, `pg1` first.
    fn hosts(&self) -> &[shardline_testkit::Host];
}

impl Hosts for TestContext {
    fn hosts(&self) -> &[shardline_testkit::Host] {
        TestContext::hosts(self)
    }
}

impl Hosts for shardline_testkit::Cluster {
    fn hosts(&self) -> &[shardline_testkit::Host] {
        shardline_testkit::Cluster::hosts(self)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn quiet(_: Progress) {}

pub(crate) fn options(jobs: usize) -> Options {
    Options { jobs_per_host: jobs, ..Options::default() }
}

/// Runs the `shardline` command line (on a thread of its own: it makes its own
/// runtime) and returns what it printed, and its error if it failed.
pub(crate) async fn cli_full(f: &Fixture, args: &[&str]) -> (String, Result<(), String>) {
    cli_at(&f.path(), args).await
}

/// As [`cli_full`], with the config at `config` (for a command run where the fixture
/// cannot be lent).
pub(crate) fn cli_at(
    config: &Path,
    args: &[&str],
) -> impl std::future::Future<Output = (String, Result<(), String>)> + Send + 'static + use<> {
    let mut argv = vec!["shardline".to_owned(), "--config".to_owned(), config.display().to_string()];
    argv.extend(args.iter().map(|a| (*a).to_owned()));
    async move {
        let ran = tokio::task::spawn_blocking(move || {
            let opt = match shardline::Opt::try_parse_from(argv) {
                Ok(opt) => opt,
                Err(e) => return (String::new(), Err(e.to_string())),
            };
            let mut out = Vec::new();
            let result = shardline::run(opt, &mut out).map_err(|e| format!("{e:#}"));
            (String::from_utf8_lossy(&out).into_owned(), result)
        })
        .await;
        ran.unwrap_or_else(|e| (String::new(), Err(e.to_string())))
    }
}

/// As [`cli_full`], for commands expected to succeed: what they printed, or the error.
pub(crate) async fn cli(f: &Fixture, args: &[&str]) -> Result<String, String> {
    let (out, result) = cli_full(f, args).await;
    result.map(|()| out)
}

/// The shard schemas on `client`'s host, by name.
async fn schemas(client: &Client) -> Result<Vec<String>, BoxError> {
    Ok(client
        .query("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'shard\\_%' ORDER BY 1", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// The ledger on `client`'s host: schema → names applied.
async fn ledger(client: &Client) -> Result<BTreeMap<String, Vec<String>>, BoxError> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    if client.query_one("SELECT to_regclass('shardline.shard_migrations') IS NULL", &[]).await?.get(0) {
        return Ok(out);
    }
    for r in
        client.query("SELECT schema_name, name FROM shardline.shard_migrations ORDER BY 1, 2", &[]).await?
    {
        out.entry(r.get(0)).or_default().push(r.get(1));
    }
    Ok(out)
}

fn all_migrations() -> Vec<String> {
    ["0001_photos.sql", "0002_likes.sql", "0003_comments.sql", "0004_likes_by_id.sql", "shardline minter"]
        .map(String::from)
        .to_vec()
}

shardline_testkit::register!(shared: init_twice_changes_nothing_the_second_time);
pub(crate) async fn init_twice_changes_nothing_the_second_time(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 30).await?;
    let config = f.config()?;
    let first = shardline_ops::init(&config, &options(2), &quiet).await?;
    assert!(first.catalog_created && first.changed(), "{first:?}");
    assert_eq!((first.shards_placed, first.schemas_created, first.minters_installed), (30, 30, 30));
    assert_eq!((first.migrations_applied, first.shards_migrated, first.map_version), (120, 30, 1));

    // Contiguous, even ranges in config order; each schema whole, with its own minter.
    for (h, range) in [(0usize, 0..10u16), (1, 10..20), (2, 20..30)] {
        let c = f.client(&ctx, h).await?;
        let want: Vec<String> = range.clone().map(|s| format!("shard_{s:04}")).collect();
        assert_eq!(schemas(&c).await?, want, "host pg{}", h + 1);
        let l = ledger(&c).await?;
        assert_eq!(l.len(), 10);
        assert!(l.values().all(|names| *names == all_migrations()), "{l:?}");
        for s in range {
            let id: i64 = c
                .query_one(
                    &format!("INSERT INTO shard_{s:04}.photos (user_id, url) VALUES (1, 'u') RETURNING id"),
                    &[],
                )
                .await?
                .get(0);
            assert_eq!(
                shardline_id::Layout::INSTAGRAM.decode(shardline_id::Id::from_i64(id)?).shard,
                u32::from(s)
            );
        }
    }
    let before = f
        .client(&ctx, 1)
        .await?
        .query_one("SELECT max(applied_at)::text FROM shardline.shard_migrations", &[])
        .await?;

    let second = shardline_ops::init(&config, &options(2), &quiet).await?;
    assert!(!second.changed(), "a second init changed something: {second:?}");
    assert_eq!(second.map_version, 1);
    let after = f
        .client(&ctx, 1)
        .await?
        .query_one("SELECT max(applied_at)::text FROM shardline.shard_migrations", &[])
        .await?;
    assert_eq!(before.get::<_, String>(0), after.get::<_, String>(0));
    let said = cli(&f, &["init"]).await?;
    assert!(
        said.starts_with(
            "nothing to do: 30 shards on 3 hosts are up to date with 4 migration(s) (map version 1)"
        ),
        "{said}"
    );
    let said = cli(&f, &["migrate", "--json"]).await?;
    let json: serde_json::Value = serde_json::from_str(&said)?;
    assert_eq!(json["migrations_applied"], 0, "{said}");
    Ok(())
}

shardline_testkit::register!(shared: the_configs_minter_is_what_init_migrate_and_moves_install);
/// `id.minter = "native"`: `init` (through the CLI) gives every shard the C `next_id()`;
/// `migrate` with the key taken out puts the PL/pgSQL one back in every shard (and with
/// it put back, the C one again), in place, under the tables' defaults; a move builds its
/// copy with the config's minter. Inserts through the repository mint in their own shard
/// all along.
pub(crate) async fn the_configs_minter_is_what_init_migrate_and_moves_install(
    ctx: TestContext,
) -> TestResult {
    const SHARDS: u16 = 8;
    let f = Fixture::new(&ctx, 2, SHARDS).await?;
    let plpgsql = f.config_text()?;
    let native = format!("{plpgsql}\n[id]\nminter = \"native\"\n");
    std::fs::write(f.path(), &native)?;
    cli(&f, &["init"]).await?;
    // The language of every shard's next_id() on each host, by schema.
    let languages = |host: usize| {
        let f = &f;
        let ctx = &ctx;
        async move {
            let c = f.client(ctx, host).await?;
            let rows = c
                .query(
                    "SELECT n.nspname::text, l.lanname::text FROM pg_proc AS p
                       JOIN pg_namespace AS n ON n.oid = p.pronamespace
                       JOIN pg_language AS l ON l.oid = p.prolang
                      WHERE p.proname = 'next_id' AND n.nspname LIKE 'shard\\_%' ORDER BY 1",
                    &[],
                )
                .await?;
            Ok::<_, BoxError>(
                rows.iter().map(|r| (r.get::<_, String>(0), r.get::<_, String>(1))).collect::<Vec<_>>(),
            )
        }
    };
    let all_in = |want: &'static str| {
        let languages = &languages;
        async move {
            let mut seen = Vec::new();
            for h in 0..2 {
                seen.extend(languages(h).await?);
            }
            assert_eq!(seen.len(), usize::from(SHARDS), "{seen:?}");
            assert!(seen.iter().all(|(_, l)| l == want), "not every shard's next_id() is {want}: {seen:?}");
            Ok::<_, BoxError>(())
        }
    };
    all_in("c").await?;
    let config = f.config()?;
    let cluster =
        shardline_repo::Cluster::connect(&config, shardline_repo::ClusterOptions::default()).await?;
    let photos = cluster.repo::<shardline_example_photos::Photo>()?;
    let mut made = Vec::new();
    let insert_all = async |made: &mut Vec<shardline_id::Id>| -> Result<(), BoxError> {
        for user in 0..i64::from(SHARDS) {
            let p = photos.insert(&crate::moves::photo(user, made.len())).await?;
            let minted_in = config.layout.decode(p.id).shard;
            assert_eq!(minted_in, u32::from(cluster.route_user(user).shard.get()), "{p:?}");
            made.push(p.id);
        }
        Ok(())
    };
    insert_all(&mut made).await?;

    std::fs::write(f.path(), &plpgsql)?;
    let said = cli(&f, &["migrate", "--json"]).await?;
    let json: serde_json::Value = serde_json::from_str(&said)?;
    assert_eq!(json["minters_installed"], u64::from(SHARDS), "{said}");
    all_in("plpgsql").await?;
    insert_all(&mut made).await?;

    std::fs::write(f.path(), &native)?;
    cli(&f, &["migrate"]).await?;
    all_in("c").await?;
    // Shard 0 lives on pg1; moved with the PL/pgSQL config, its copy gets PL/pgSQL, and
    // moved back with the native one, C.
    std::fs::write(f.path(), &plpgsql)?;
    cli(&f, &["move", "0", "--to", "pg2"]).await?;
    let on_pg2 = languages(1).await?;
    assert!(on_pg2.contains(&("shard_0000".to_owned(), "plpgsql".to_owned())), "{on_pg2:?}");
    std::fs::write(f.path(), &native)?;
    cli(&f, &["move", "0", "--to", "pg1"]).await?;
    let on_pg1 = languages(0).await?;
    assert!(on_pg1.contains(&("shard_0000".to_owned(), "c".to_owned())), "{on_pg1:?}");
    insert_all(&mut made).await?;
    let distinct: std::collections::HashSet<_> = made.iter().collect();
    assert_eq!(distinct.len(), made.len(), "a duplicate ID: {made:?}");
    Ok(())
}

shardline_testkit::register!(shared: a_host_new_to_the_config_joins_with_no_shards);
pub(crate) async fn a_host_new_to_the_config_joins_with_no_shards(ctx: TestContext) -> TestResult {
    let mut f = Fixture::new(&ctx, 2, 8).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    f.hosts = 3;
    f.write_config(&ctx, |_, u| u, 8)?;
    let report = shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    assert_eq!(report.hosts_added, ["pg3"]);
    // No shard moves, but the map's version moves on: routers learn the new host's
    // address from the catalog.
    assert_eq!((report.shards_placed, report.schemas_created, report.map_version), (0, 0, 2), "{report:?}");
    assert!(schemas(&f.client(&ctx, 2).await?).await?.is_empty());
    let map: serde_json::Value = serde_json::from_str(&cli(&f, &["map", "--json"]).await?)?;
    assert_eq!(map["version"], 2);
    assert_eq!(map["hosts"][0]["ranges"], serde_json::json!([[0, 3]]));
    assert_eq!(map["hosts"][1]["ranges"], serde_json::json!([[4, 7]]));
    assert_eq!(map["hosts"][2], serde_json::json!({"name": "pg3", "shards": 0, "ranges": []}));
    let text = cli(&f, &["map"]).await?;
    assert!(
        text.starts_with("map version 2: 8 logical shards on 3 hosts\npg1      4 shards  0-3\n"),
        "{text}"
    );
    Ok(())
}

/// What every host and the catalog hold, to show that a refusal changed nothing.
async fn snapshot(f: &Fixture, ctx: &TestContext) -> Result<Vec<String>, BoxError> {
    let mut out = Vec::new();
    for h in 0..f.hosts {
        let c = f.client(ctx, h).await?;
        out.push(format!("{:?} {:?}", schemas(&c).await?, ledger(&c).await?));
    }
    let c = f.client(ctx, 0).await?;
    let exists: bool = c.query_one("SELECT to_regclass('shardline.cluster') IS NOT NULL", &[]).await?.get(0);
    let catalog: Option<String> = if exists {
        c.query_one(
            "SELECT format('%s/%s', (SELECT row_to_json(c)::text FROM shardline.cluster c),
                           (SELECT string_agg(shard || host, ',' ORDER BY shard) FROM shardline.shards))",
            &[],
        )
        .await?
        .get(0)
    } else {
        None
    };
    out.push(format!("{catalog:?}"));
    Ok(out)
}

shardline_testkit::register!(shared: refusals_change_nothing);
pub(crate) async fn refusals_change_nothing(ctx: TestContext) -> TestResult {
    let mut f = Fixture::new(&ctx, 2, 16).await?;
    let empty = snapshot(&f, &ctx).await?;

    // An unreachable host: refused before the catalog exists.
    f.write_config(
        &ctx,
        |i, u| if i == 1 { "postgres://postgres@127.0.0.1:9/nowhere".into() } else { u },
        16,
    )?;
    let err = shardline_ops::init(&f.config()?, &options(1), &quiet).await.unwrap_err();
    assert!(matches!(err, OpsError::Unreachable { .. }), "{err:?}");
    let said = err.to_string();
    assert!(said.starts_with("a host is unreachable, so nothing was changed: pg2: "), "{said}");
    assert!(!said.contains("127.0.0.1:9"), "the error leaked the URL: {said}");
    assert_eq!(snapshot(&f, &ctx).await?, empty);

    // A time limit of 0 (the library's options; the CLI refuses it when parsed):
    // refused before the catalog exists (before: the catalog made, the shards placed,
    // then a timeout at 0 ns).
    f.write_config(&ctx, |_, u| u, 16)?;
    for zero in [
        Options { shard_timeout: Duration::ZERO, ..options(1) },
        Options { lock_timeout: Duration::ZERO, ..options(1) },
        options(0),
    ] {
        let err = shardline_ops::init(&f.config()?, &zero, &quiet).await.unwrap_err();
        assert!(matches!(err, OpsError::InvalidOption { .. }), "{err:?}");
    }
    assert_eq!(snapshot(&f, &ctx).await?, empty);

    // A bad migration file: refused before anything changes.
    f.migration("0004_bad.sql", "CREATE TABLE x (a int);\nCOMMIT;\n")?;
    let err = shardline_ops::init(&f.config()?, &options(1), &quiet).await.unwrap_err().to_string();
    assert_eq!(
        err,
        "0004_bad.sql:2: COMMIT is not allowed: shardline runs each shard's pending migrations in one transaction of its own"
    );
    assert_eq!(snapshot(&f, &ctx).await?, empty);
    std::fs::remove_file(f.dir.join("migrations/0004_bad.sql"))?;

    // Another operation holding the catalog lock.
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let done = snapshot(&f, &ctx).await?;
    let holder = f.client(&ctx, 0).await?;
    holder.execute("SELECT pg_advisory_lock($1)", &[&LOCK_KEY]).await?;
    f.migration("0004_more.sql", "CREATE TABLE more (a int);")?;
    let err = shardline_ops::migrate(&f.config()?, &options(1), &quiet).await.unwrap_err();
    assert!(matches!(err, OpsError::Busy), "{err:?}");
    holder.execute("SELECT pg_advisory_unlock($1)", &[&LOCK_KEY]).await?;
    assert_eq!(snapshot(&f, &ctx).await?, done);
    std::fs::remove_file(f.dir.join("migrations/0004_more.sql"))?;
    // A lock let go a moment later (an operation that just ended, its server session
    // still on its way out: `init` right after another was refused so, now and then) is
    // waited for.
    holder.execute("SELECT pg_advisory_lock($1)", &[&LOCK_KEY]).await?;
    let (config, opts) = (f.config()?, options(1));
    let (released, waited) = futures::join!(
        async {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            holder.execute("SELECT pg_advisory_unlock($1)", &[&LOCK_KEY]).await
        },
        shardline_ops::init(&config, &opts, &quiet)
    );
    released?;
    assert!(!waited?.changed(), "init after a lock let go 300 ms later runs, and changes nothing");

    // A config that contradicts the catalog.
    for (config, message) in [
        (
            "logical_shards = 32\n",
            "the config says logical_shards = 32, but the cluster was initialised with logical_shards = 16",
        ),
        (
            "logical_shards = 16\nschema_prefix = \"s_\"\n",
            "the config says schema_prefix = s_, but the cluster was initialised with schema_prefix = shard_",
        ),
        (
            "logical_shards = 16\n[id]\nepoch_ms = 1600000000000\n",
            "the config says id.epoch_ms = 1600000000000, but the cluster was initialised with id.epoch_ms = 1314220021721",
        ),
    ] {
        f.write_config(&ctx, |_, u| u, 16)?;
        let text = std::fs::read_to_string(f.path())?;
        let rest = text.split_once('\n').map(|(_, r)| r).unwrap_or_default();
        let (head, tail) = match config.split_once("[id]") {
            Some((h, t)) => (h.to_owned(), format!("[id]{t}")),
            None => (config.to_owned(), String::new()),
        };
        std::fs::write(f.path(), format!("{head}{rest}\n{tail}"))?;
        for run in ["init", "migrate", "map", "status"] {
            let err = cli(&f, &[run]).await.unwrap_err();
            assert!(err.contains(message), "{run}: {err}");
        }
        assert_eq!(snapshot(&f, &ctx).await?, done);
    }
    // A host that holds shards, dropped from the config: the catalog still knows
    // where it lives, and nothing changes.
    f.hosts = 1;
    f.write_config(&ctx, |_, u| u, 16)?;
    let said = cli(&f, &["init"]).await?;
    assert!(said.contains("nothing to do: 16 shards on 2 hosts"), "{said}");
    f.hosts = 2;
    assert_eq!(snapshot(&f, &ctx).await?, done);
    Ok(())
}

shardline_testkit::register!(shared: a_migration_failing_in_one_shard_stops_and_a_rerun_continues);
pub(crate) async fn a_migration_failing_in_one_shard_stops_and_a_rerun_continues(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 8).await?;
    for m in ["0002_likes.sql", "0003_comments.sql", "0004_likes_by_id.sql"] {
        std::fs::remove_file(f.dir.join("migrations").join(m))?;
    }
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    // Shard 5 (on pg2) holds a row the next migration's constraint rejects.
    let pg2 = f.client(&ctx, 1).await?;
    pg2.execute("INSERT INTO shard_0005.photos (user_id, url, caption) VALUES (5, 'u', '')", &[]).await?;
    f.migration("0002_tags.sql", "CREATE TABLE tags (photo_id bigint NOT NULL, tag text NOT NULL);\n")?;
    f.migration(
        "0003_captions.sql",
        "-- Every photo needs a caption.\nCREATE INDEX photos_caption ON photos (caption);\n\nALTER TABLE photos\n    ADD CONSTRAINT caption_required CHECK (caption <> '');\n",
    )?;

    let err = shardline_ops::migrate(&f.config()?, &options(1), &quiet).await.unwrap_err();
    let OpsError::Migration(failed) = &err else { panic!("expected a migration failure, got {err:?}") };
    assert_eq!((failed.shard.get(), failed.schema.as_str(), failed.host.as_str()), (5, "shard_0005", "pg2"));
    assert_eq!((failed.file.as_str(), failed.index, failed.line), ("0003_captions.sql", 2, 4));
    assert_eq!(failed.sqlstate.as_deref(), Some("23514"));
    assert!(failed.statement.starts_with("ALTER TABLE photos"), "{}", failed.statement);
    let said = err.to_string();
    assert!(
        said.starts_with("shard 5 (shard_0005) on host pg2: 0003_captions.sql, statement 2 (line 4) failed (SQLSTATE 23514): check constraint \"caption_required\""),
        "{said}"
    );

    // Every shard is whole: both new files (tables, index, constraint, ledger) or none.
    let mut migrated = 0;
    for h in 0..2 {
        let c = f.client(&ctx, h).await?;
        for (schema, names) in ledger(&c).await? {
            let has_tags: bool =
                c.query_one(&format!("SELECT to_regclass('{schema}.tags') IS NOT NULL"), &[]).await?.get(0);
            let has_index: bool = c
                .query_one(&format!("SELECT to_regclass('{schema}.photos_caption') IS NOT NULL"), &[])
                .await?
                .get(0);
            let recorded = names.contains(&"0003_captions.sql".to_owned());
            assert_eq!(recorded, names.contains(&"0002_tags.sql".to_owned()), "{schema}: {names:?}");
            assert_eq!((has_tags, has_index), (recorded, recorded), "{schema} is half migrated");
            migrated += usize::from(recorded);
            if schema == "shard_0005" {
                assert!(!recorded, "the failing shard kept part of its work");
            }
        }
    }
    assert!(migrated < 8);
    let status = shardline_ops::status(&f.config()?, Duration::from_secs(5)).await?;
    assert_eq!(status.hosts.iter().map(|h| h.shards_behind).sum::<usize>(), 8 - migrated);

    // Fix the data; the re-run finishes the rest.
    pg2.execute("UPDATE shard_0005.photos SET caption = 'fixed'", &[]).await?;
    let report = shardline_ops::migrate(&f.config()?, &options(1), &quiet).await?;
    assert_eq!(report.shards_migrated, 8 - migrated);
    assert_eq!(report.migrations_applied, 2 * (8 - migrated));
    for h in 0..2 {
        let l = ledger(&f.client(&ctx, h).await?).await?;
        assert!(l.values().all(|n| n.len() == 4), "{l:?}");
    }
    Ok(())
}

shardline_testkit::register!(shared: a_statement_the_splitter_miscounts_fails_instead_of_committing);
/// A `BEGIN ATOMIC` body naming a column `case` (any keyword may follow `AS`) makes the
/// splitter count a `CASE` that never ends, so the rest of the file is taken for one
/// statement, with a `COMMIT` in it the check never sees. Sent as one statement of the
/// extended protocol, it is refused whole (42601): nothing is applied, nothing is made
/// in `public`, the ledger does not list the file. Before: the `COMMIT` ran, the table
/// after it was made in `public`, and the file was recorded as applied.
pub(crate) async fn a_statement_the_splitter_miscounts_fails_instead_of_committing(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    f.migration(
        "0005_escape.sql",
        "CREATE FUNCTION labelled() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1 AS case; END;\n\
         CREATE TABLE escaped (a int);\n\
         COMMIT;\n\
         CREATE TABLE after_commit (a int);\n",
    )?;
    let err = shardline_ops::migrate(&f.config()?, &options(1), &quiet).await.unwrap_err();
    let OpsError::Migration(failed) = &err else { panic!("expected a migration failure, got {err:?}") };
    assert_eq!(failed.sqlstate.as_deref(), Some("42601"), "{err}");
    for h in 0..2 {
        let c = f.client(&ctx, h).await?;
        let made: i64 = c
            .query_one("SELECT count(*) FROM pg_class WHERE relname IN ('escaped', 'after_commit')", &[])
            .await?
            .get(0);
        assert_eq!(made, 0, "nothing of the file was made on pg{}", h + 1);
        for (schema, names) in ledger(&c).await? {
            assert!(!names.contains(&"0005_escape.sql".to_owned()), "{schema}: {names:?}");
        }
    }

    // A statement the driver refuses before sending it (a NUL in its text): the server's
    // transaction is not aborted by it, so the `COMMIT` waits for every answer and is
    // not sent. Before, it went with the rest: the statements around the refused one
    // committed, and the ledger listed the file as applied.
    std::fs::remove_file(f.dir.join("migrations/0005_escape.sql"))?;
    f.migration(
        "0005_nul.sql",
        "CREATE TABLE nul_before (a int);\nSELECT 1 /* \u{0} */;\nCREATE TABLE nul_after (a int);\n",
    )?;
    let err = shardline_ops::migrate(&f.config()?, &options(1), &quiet).await.unwrap_err();
    assert!(matches!(&err, OpsError::Migration(failed) if failed.index == 2), "{err:?}");
    for h in 0..2 {
        let c = f.client(&ctx, h).await?;
        let made: i64 = c
            .query_one("SELECT count(*) FROM pg_class WHERE relname IN ('nul_before', 'nul_after')", &[])
            .await?
            .get(0);
        assert_eq!(made, 0, "nothing of the file was committed on pg{}", h + 1);
        for (schema, names) in ledger(&c).await? {
            assert!(!names.contains(&"0005_nul.sql".to_owned()), "{schema}: {names:?}");
        }
    }
    Ok(())
}

shardline_testkit::register!(shared: changed_or_misordered_files_are_refused_before_anything_changes);
pub(crate) async fn changed_or_misordered_files_are_refused_before_anything_changes(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    f.migration("0009_new.sql", "CREATE TABLE new_one (a int);")?;
    let done = snapshot(&f, &ctx).await?;

    let photos = f.dir.join("migrations/0001_photos.sql");
    let original = std::fs::read_to_string(&photos)?;
    std::fs::write(&photos, original.replace("caption text", "caption varchar(80)"))?;
    // A role newly listed in app_roles in the same run: the refusal grants it nothing,
    // on the catalog or on any host.
    let role = format!("refused_{}", std::process::id());
    crate::reliability::create_role(&f, &ctx, 2, &role).await?;
    let text = f.config_text()?;
    std::fs::write(f.path(), format!("app_roles = [\"{role}\"]\n{text}"))?;
    let err = shardline_ops::migrate(&f.config()?, &options(1), &quiet).await.unwrap_err().to_string();
    assert!(err.starts_with("migration 0001_photos.sql: the file changed after it was applied to shard_0000 (shard 0) on pg1 (checksum "), "{err}");
    assert_eq!(snapshot(&f, &ctx).await?, done);
    for h in 0..2 {
        let c = f.client(&ctx, h).await?;
        let granted: bool = c
            .query_one(
                "SELECT has_schema_privilege($1, 'shardline', 'USAGE')
                     OR coalesce(has_table_privilege($1, to_regclass('shardline.shards'), 'SELECT'), false)",
                &[&role],
            )
            .await?
            .get(0);
        assert!(!granted, "pg{}: the refused run granted {role}", h + 1);
    }
    std::fs::write(f.path(), text)?;
    std::fs::write(&photos, original)?;

    f.migration("0000_early.sql", "CREATE TABLE early (a int);")?;
    let err = shardline_ops::migrate(&f.config()?, &options(1), &quiet).await.unwrap_err().to_string();
    assert!(err.starts_with("migration 0000_early.sql: it sorts before 0004_likes_by_id.sql, which shard_0000 (shard 0) on pg1 already has"), "{err}");
    std::fs::remove_file(f.dir.join("migrations/0000_early.sql"))?;

    std::fs::remove_file(f.dir.join("migrations/0002_likes.sql"))?;
    let err = shardline_ops::migrate(&f.config()?, &options(1), &quiet).await.unwrap_err().to_string();
    assert!(err.starts_with("migration 0002_likes.sql: shard_0000 (shard 0) on pg1 has it applied, but it is not in the migrations directory"), "{err}");
    assert_eq!(snapshot(&f, &ctx).await?, done);
    Ok(())
}

shardline_testkit::register!(shared: a_sqlx_migrations_directory_migrates_in_sqlx_order);
/// A sqlx application's migrations, named as sqlx names them, work as they are: by
/// version number (`10_` after `5_`, where byte order would refuse `10_` as sorting
/// before an applied file), a reversible migration's `.up.sql` applied and its
/// `.down.sql` never.
pub(crate) async fn a_sqlx_migrations_directory_migrates_in_sqlx_order(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    f.migration("5_tags.up.sql", "CREATE TABLE tags (id bigint PRIMARY KEY DEFAULT next_id(), name text);")?;
    f.migration("5_tags.down.sql", "DROP TABLE tags;")?;
    shardline_ops::migrate(&f.config()?, &options(1), &quiet).await?;
    f.migration("10_tag_photos.sql", "ALTER TABLE tags ADD COLUMN photo_id bigint;")?;
    shardline_ops::migrate(&f.config()?, &options(1), &quiet).await?;
    for h in 0..2 {
        let c = f.client(&ctx, h).await?;
        let columns: i64 = c
            .query_one(
                "SELECT count(*) FROM information_schema.columns WHERE table_name = 'tags' AND column_name = 'photo_id'",
                &[],
            )
            .await?
            .get(0);
        assert_eq!(columns, 2, "both shards of pg{} have tags with photo_id", h + 1);
        let applied: Vec<String> = c
            .query(
                "SELECT name FROM shardline.shard_migrations
                  WHERE schema_name = (SELECT min(schema_name) FROM shardline.shard_migrations)
                  ORDER BY applied_at, name",
                &[],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert!(
            applied.ends_with(&["5_tags.up.sql".to_owned(), "10_tag_photos.sql".to_owned()]),
            "{applied:?}"
        );
    }
    Ok(())
}

shardline_testkit::register!(shared: a_migrations_trigger_writes_into_its_own_shard_whoever_fires_it);
/// A migration's trigger function that names its table unqualified, as migrations are
/// written, writes into its own shard's table: fired by the repository (qualified
/// statements on the pool's default `search_path`, `"$user", public`, where `public`
/// has a table of that name) and by a session whose `search_path` names another shard.
/// A function that sets its own path keeps it, and `next_id()` runs on its caller's.
/// Before: the repository's inserts wrote their audit rows into `public.audit`.
pub(crate) async fn a_migrations_trigger_writes_into_its_own_shard_whoever_fires_it(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    f.migration(
        "0005_audit.sql",
        "CREATE TABLE audit (photo_id bigint NOT NULL);
         CREATE FUNCTION audit_photo() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO audit (photo_id) VALUES (NEW.id);
             RETURN NEW;
         END $$;
         CREATE TRIGGER photos_audit AFTER INSERT ON photos FOR EACH ROW EXECUTE FUNCTION audit_photo();
         CREATE FUNCTION own_path() RETURNS text LANGUAGE plpgsql SET search_path = pg_catalog AS $$
         BEGIN RETURN current_setting('search_path'); END $$;
         CREATE PROCEDURE backfill() LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO audit (photo_id) VALUES (-1);
             COMMIT;
             INSERT INTO audit (photo_id) VALUES (-2);
         END $$;",
    )?;
    for h in 0..2 {
        // A hardened default path (`''`, stored as `""`, which no list takes) on the
        // hosts: the functions get the shard's path all the same (before, the ALTER
        // failed on it and every shard's migration rolled back).
        f.client(&ctx, h)
            .await?
            .batch_execute(&format!(
                "CREATE TABLE public.audit (photo_id bigint NOT NULL); ALTER DATABASE {} SET search_path = ''",
                f.db()
            ))
            .await?;
    }
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let cluster =
        shardline_repo::Cluster::connect(&f.config()?, shardline_repo::ClusterOptions::default()).await?;
    let photos = cluster.repo::<shardline_example_photos::Photo>()?;
    let mut made = Vec::new();
    for user in 0..8_i64 {
        let new = shardline_example_photos::NewPhoto {
            user_id: user,
            url: format!("u{user}"),
            caption: String::new(),
        };
        made.push((cluster.route_user(user), i64::from(photos.insert(&new).await?.id)));
    }
    // A session on another shard's path inserts into shard 0's table by its full name.
    let zero = cluster.route(crate::shard(0))?;
    let other = cluster.route(crate::shard(2))?;
    let host = usize::from(zero.host.as_str() != "pg1");
    let c = f.client(&ctx, host).await?;
    c.batch_execute(&format!("SET search_path = {}, public", other.schema.quoted())).await?;
    let id: i64 = c
        .query_one(
            &format!(
                "INSERT INTO {}.photos (user_id, url) VALUES (0, 'by hand') RETURNING id",
                zero.schema.quoted()
            ),
            &[],
        )
        .await?
        .get(0);
    made.push((zero.clone(), id));
    for (route, id) in &made {
        let h = usize::from(route.host.as_str() != "pg1");
        let c = f.client(&ctx, h).await?;
        let n: i64 = c
            .query_one(
                &format!("SELECT count(*) FROM {}.audit WHERE photo_id = $1", route.schema.quoted()),
                &[id],
            )
            .await?
            .get(0);
        assert_eq!(n, 1, "photo {id}'s audit row is in its shard's table, {}", route.schema);
    }
    for h in 0..2 {
        let c = f.client(&ctx, h).await?;
        let strays: i64 = c.query_one("SELECT count(*) FROM public.audit", &[]).await?.get(0);
        assert_eq!(strays, 0, "no audit row went into public's table on pg{}", h + 1);
        let settings: Vec<(String, Option<Vec<String>>)> = c
            .query(
                "SELECT p.proname::text, p.proconfig FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                  WHERE n.nspname LIKE 'shard\\_%' AND p.proname IN ('audit_photo', 'own_path', 'next_id', 'backfill')",
                &[],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        assert_eq!(settings.len(), 8, "two shards on pg{}, four routines each: {settings:?}", h + 1);
        for (name, config) in settings {
            match name.as_str() {
                "audit_photo" => {
                    let config = config.unwrap_or_default();
                    assert!(
                        config.iter().any(|s| {
                            let s = s.replace('"', "");
                            s.starts_with("search_path=shard_")
                                && s.contains(", public, ")
                                && s.ends_with(", pg_temp")
                        }),
                        "{config:?}"
                    );
                }
                "own_path" => assert_eq!(config, Some(vec!["search_path=pg_catalog".to_owned()])),
                _ => assert_eq!(config, None, "{name} runs on its caller's search_path"),
            }
        }
        // A procedure is left as it is: with a setting of its own it could not COMMIT.
        let schema: String = c
            .query_one("SELECT min(nspname)::text FROM pg_namespace WHERE nspname LIKE 'shard\\_%'", &[])
            .await?
            .get(0);
        // Each on its own: a CALL in a multi-statement query is inside a transaction block.
        c.batch_execute(&format!("SET search_path = {schema}")).await?;
        c.batch_execute("CALL backfill()").await?;
        c.batch_execute("RESET search_path").await?;
        let filled: i64 = c
            .query_one(&format!("SELECT count(*) FROM {schema}.audit WHERE photo_id < 0"), &[])
            .await?
            .get(0);
        assert_eq!(filled, 2, "the procedure committed between its inserts, in {schema} on pg{}", h + 1);
    }
    Ok(())
}

shardline_testkit::register!(shared: locate_agrees_with_where_rows_are);
pub(crate) async fn locate_agrees_with_where_rows_are(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 30).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let clients = [f.client(&ctx, 0).await?, f.client(&ctx, 1).await?, f.client(&ctx, 2).await?];
    let mut ids = Vec::new();
    for user in [0i64, 1, 9, 10, 29, 30, 31, 12345, -1, -31, i64::MAX, i64::MIN] {
        let at: serde_json::Value =
            serde_json::from_str(&cli(&f, &["locate", "--user", &user.to_string(), "--json"]).await?)?;
        assert_eq!(at["shard"].as_i64(), Some(user.rem_euclid(30)), "{at}");
        let host = at["host"].as_str().unwrap_or_default();
        let h = host.trim_start_matches("pg").parse::<usize>()? - 1;
        let schema = at["schema"].as_str().unwrap_or_default().to_owned();
        let id: i64 = clients[h]
            .query_one(
                &format!("INSERT INTO {schema}.photos (user_id, url) VALUES ($1, 'u') RETURNING id"),
                &[&user],
            )
            .await?
            .get(0);
        ids.push((id, user));
    }
    // Where each row really is: every host, every shard schema on it.
    let mut found: HashMap<i64, Vec<(String, String)>> = HashMap::new();
    for (h, c) in clients.iter().enumerate() {
        for schema in schemas(c).await? {
            for r in c.query(&format!("SELECT id FROM {schema}.photos"), &[]).await? {
                found.entry(r.get(0)).or_default().push((format!("pg{}", h + 1), schema.clone()));
            }
        }
    }
    for (id, user) in ids {
        let at: serde_json::Value =
            serde_json::from_str(&cli(&f, &["locate", "--id", &id.to_string(), "--json"]).await?)?;
        let place = (
            at["host"].as_str().unwrap_or_default().to_owned(),
            at["schema"].as_str().unwrap_or_default().to_owned(),
        );
        assert_eq!(found.get(&id), Some(&vec![place]), "user {user}, id {id}: locate said {at}");
        let compact = shardline_id::Id::from_i64(id)?.to_compact();
        let again: serde_json::Value =
            serde_json::from_str(&cli(&f, &["locate", "--id", &compact, "--json"]).await?)?;
        assert_eq!(again, at);
    }
    let text = cli(&f, &["locate", "--user", "31"]).await?;
    assert_eq!(text, "shard 1  schema shard_0001  host pg1\n");
    // An ID from a shard this cluster does not have.
    let foreign = shardline_id::Id::from_parts(1_700_000_000_000, 4000, 0)?;
    let err = cli(&f, &["locate", "--id", &foreign.to_string()]).await.unwrap_err();
    assert!(
        err.contains(&format!("invalid value {foreign} for --id: logical shard 4000 is out of range 0..30")),
        "{err}"
    );
    Ok(())
}

shardline_testkit::register!(shared: map_changes_bump_the_version_and_notify);
pub(crate) async fn map_changes_bump_the_version_and_notify(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    let config = f.config()?;
    shardline_ops::init(&config, &options(1), &quiet).await?;
    let mut listener = MapListener::start(&config.catalog).await?;
    let c = f.client(&ctx, 0).await?;
    // Not a change: the same host, or another column.
    c.execute("UPDATE shardline.shards SET host = host, ready = ready", &[]).await?;
    assert_eq!(listener.next(Duration::from_millis(300)).await, None);
    c.execute("UPDATE shardline.shards SET host = 'pg2' WHERE shard = 0", &[]).await?;
    assert_eq!(listener.next(Duration::from_secs(5)).await, Some(2));
    let (catalog, _) = shardline_repo::Catalog::open(&config).await?;
    let map = catalog.map().await?;
    assert_eq!(map.version(), 2);
    assert_eq!(map.route_user(0, &config.schema_prefix).host.as_str(), "pg2");
    // A map that is no longer valid is refused, naming the shard.
    c.execute("DELETE FROM shardline.shards WHERE shard = 3", &[]).await?;
    assert_eq!(listener.next(Duration::from_secs(5)).await, Some(3));
    let err = catalog.map().await.unwrap_err().to_string();
    assert_eq!(err, "the catalog is not valid: invalid shard map: shard 3 is not mapped to any host");
    Ok(())
}

shardline_testkit::register!(shared: status_reports_rows_bytes_and_unreachable_hosts);
pub(crate) async fn status_reports_rows_bytes_and_unreachable_hosts(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 6).await?;
    shardline_ops::init(&f.config()?, &options(1), &quiet).await?;
    let c = f.client(&ctx, 0).await?;
    c.execute(
        "INSERT INTO shard_0000.photos (user_id, url) SELECT g * 6, 'u' FROM generate_series(1, 500) g",
        &[],
    )
    .await?;
    c.execute("ANALYZE shard_0000.photos", &[]).await?;
    let json: serde_json::Value = serde_json::from_str(&cli(&f, &["status", "--json"]).await?)?;
    assert_eq!(json["map_version"], 1);
    let pg1 = &json["hosts"][0];
    assert_eq!(
        (pg1["reachable"].as_bool(), pg1["shards"].as_u64(), pg1["shards_behind"].as_u64()),
        (Some(true), Some(2), Some(0))
    );
    let tables: Vec<&str> =
        pg1["tables"].as_array().into_iter().flatten().filter_map(|t| t["name"].as_str()).collect();
    assert_eq!(tables, ["comments", "likes", "photos"]);
    let photos = &pg1["tables"][2];
    assert!(photos["bytes"].as_i64().unwrap_or(0) > 8192, "{photos}");
    // Statistics reach pg_stat_user_tables within a second or so of the commit.
    let mut rows = photos["rows"].as_i64();
    for _ in 0..50 {
        if rows == Some(500) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let again: serde_json::Value = serde_json::from_str(&cli(&f, &["status", "--json"]).await?)?;
        rows = again["hosts"][0]["tables"][2]["rows"].as_i64();
    }
    assert_eq!(rows, Some(500));

    // A move stopped while its fence is up: shard 0's schema on pg1 is renamed and
    // `migrate` waits for the move, so status counts it moving, not behind, and passes
    // (before: "shards behind on pg1: run `shardline migrate`", which `migrate` refused).
    let (said, stopped) = cli_full(&f, &["move", "0", "--to", "pg2", "--stop-after", "fenced"]).await;
    assert!(stopped.as_ref().is_err_and(|e| e.contains("stopped after step fenced")), "{said} {stopped:?}");
    let json: serde_json::Value = serde_json::from_str(&cli(&f, &["status", "--json"]).await?)?;
    let pg1 = &json["hosts"][0];
    assert_eq!(
        (pg1["schemas_present"].as_u64(), pg1["shards_behind"].as_u64(), pg1["shards_moving"].as_u64()),
        (Some(1), Some(0), Some(1)),
        "{json}"
    );
    cli(&f, &["move", "0", "--abort"]).await?;
    let json: serde_json::Value = serde_json::from_str(&cli(&f, &["status", "--json"]).await?)?;
    assert_eq!(json["hosts"][0]["shards_moving"].as_u64(), Some(0), "{json}");

    // A shard's schema dropped by hand, its ledger rows left: that shard is behind, and
    // status fails naming the host (before: counted as up to date, exit 0).
    let pg2 = f.client(&ctx, 1).await?;
    let schema: String = pg2
        .query_one("SELECT min(nspname)::text FROM pg_namespace WHERE nspname LIKE 'shard\\_%'", &[])
        .await?
        .get(0);
    pg2.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await?;
    let (json, failed) = cli_full(&f, &["status", "--json"]).await;
    assert_eq!(failed, Err("shards behind on pg2: run `shardline migrate`".to_owned()), "{json}");
    let json: serde_json::Value = serde_json::from_str(&json)?;
    assert_eq!(json["hosts"][1]["shards_behind"].as_u64(), Some(1), "{json}");

    // A file changed after it was applied to one shard of pg3 (its ledger row holds
    // another checksum, which `migrate` refuses: `changed_or_misordered_files_are_refused_before_anything_changes`
    // above): that shard is behind too
    // (before: counted as up to date).
    let pg3 = f.client(&ctx, 2).await?;
    let changed = pg3
        .execute(
            "UPDATE shardline.shard_migrations SET checksum = 'changed'
              WHERE name = '0002_likes.sql'
                AND schema_name = (SELECT min(schema_name) FROM shardline.shard_migrations)",
            &[],
        )
        .await?;
    assert_eq!(changed, 1);
    let (json, failed) = cli_full(&f, &["status", "--json"]).await;
    assert_eq!(failed, Err("shards behind on pg2, pg3: run `shardline migrate`".to_owned()), "{json}");
    let json: serde_json::Value = serde_json::from_str(&json)?;
    assert_eq!(json["hosts"][2]["shards_behind"].as_u64(), Some(1), "{json}");
    // A file applied everywhere, then taken out of the directory (`migrate` refuses
    // that too): every shard is behind, pg1's two as well (before: 0 behind there).
    let last = "0004_likes_by_id.sql";
    let sql = std::fs::read_to_string(examples().join(last))?;
    f.remove_migration(last)?;
    let (json, failed) = cli_full(&f, &["status", "--json"]).await;
    assert!(failed.is_err(), "{json}");
    let json: serde_json::Value = serde_json::from_str(&json)?;
    assert_eq!(json["hosts"][0]["shards_behind"].as_u64(), Some(2), "{json}");
    f.migration(last, &sql)?;

    // pg3 becomes unreachable: status still reports, names it, and fails.
    f.write_config(
        &ctx,
        |i, u| if i == 2 { "postgres://postgres@127.0.0.1:9/nowhere".into() } else { u },
        6,
    )?;
    let err = cli(&f, &["status"]).await.unwrap_err();
    assert_eq!(err, "unreachable: pg3");
    let (json, failed) = cli_full(&f, &["status", "--json"]).await;
    assert_eq!(failed, Err("unreachable: pg3".to_owned()));
    let json: serde_json::Value = serde_json::from_str(&json)?;
    assert_eq!(json["hosts"][2]["reachable"], false);
    assert!(
        json["hosts"][2]["error"].as_str().unwrap_or_default().starts_with("host pg3 is unreachable"),
        "{json}"
    );
    assert_eq!(json["hosts"][1]["reachable"], true);
    Ok(())
}

/// Runs `work` (whose progress goes to `switch.see`) and kills pg2 once `after` of its
/// shards are done; returns `work`'s result and how many of pg2's shards were done.
async fn kill_pg2_during<T>(
    ctx: &TestContext,
    switch: &KillSwitch,
    after: usize,
    work: impl std::future::Future<Output = T>,
) -> Result<(T, usize), BoxError> {
    fault_pg2_during(ctx, switch, after, false, work).await
}

/// As [`kill_pg2_during`], pausing pg2 (a hung host) when `pause`.
async fn fault_pg2_during<T>(
    ctx: &TestContext,
    switch: &KillSwitch,
    after: usize,
    pause: bool,
    work: impl std::future::Future<Output = T>,
) -> Result<(T, usize), BoxError> {
    let rx = switch.arm(after)?;
    let pg2 = &ctx.hosts()[1];
    let killer = async {
        if rx.await.is_ok() {
            if pause {
                pg2.pause().await?;
            } else {
                pg2.kill().await?;
            }
        }
        Ok::<_, BoxError>(())
    };
    let (result, killed) = tokio::join!(work, killer);
    killed?;
    Ok((result, switch.done()))
}

/// A progress callback that fires once pg2 has finished `after` shards.
#[derive(Default)]
struct KillSwitch {
    done_on_pg2: Mutex<usize>,
    after: Mutex<usize>,
    tx: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl KillSwitch {
    fn arm(&self, after: usize) -> Result<tokio::sync::oneshot::Receiver<()>, BoxError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        *self.tx.lock().map_err(|_| "poisoned")? = Some(tx);
        *self.after.lock().map_err(|_| "poisoned")? = after;
        *self.done_on_pg2.lock().map_err(|_| "poisoned")? = 0;
        Ok(rx)
    }

    fn done(&self) -> usize {
        self.done_on_pg2.lock().map(|n| *n).unwrap_or_default()
    }

    fn see(&self, p: Progress) {
        if let Progress::ShardDone { host, .. } = p
            && host.as_str() == "pg2"
            && let Ok(mut n) = self.done_on_pg2.lock()
        {
            *n += 1;
            if Some(*n) == self.after.lock().ok().map(|a| *a)
                && let Some(tx) = self.tx.lock().ok().and_then(|mut t| t.take())
            {
                let _ = tx.send(());
            }
        }
    }
}

/// Every shard schema on every host has exactly one of the ledgers in `whole`; returns
/// how many shard schemas there are in all.
async fn each_shard_whole(f: &Fixture, ctx: &TestContext, whole: &[Vec<String>]) -> Result<usize, BoxError> {
    let mut present_in_all = 0;
    for h in 0..3 {
        let c = f.client(ctx, h).await?;
        let present = schemas(&c).await?;
        let l = ledger(&c).await?;
        for s in &present {
            let applied = l.get(s).cloned().unwrap_or_default();
            assert!(whole.contains(&applied), "{s} on pg{} is half done: {applied:?}", h + 1);
        }
        assert_eq!(l.len(), present.len());
        present_in_all += present.len();
    }
    Ok(present_in_all)
}

shardline_testkit::register!(exclusive: init_interrupted_by_a_killed_host_completes_later);
pub(crate) async fn init_interrupted_by_a_killed_host_completes_later(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 300).await?;
    let config = f.config()?;
    let switch = KillSwitch::default();
    let see = |p| switch.see(p);
    let (result, interrupted_at) =
        kill_pg2_during(&ctx, &switch, 5, shardline_ops::init(&config, &options(1), &see)).await?;
    let err = result.expect_err("init should fail when a host dies under it");
    assert!(err.to_string().contains("pg2"), "the error should name pg2: {err}");
    assert!(interrupted_at < 100, "pg2 finished before it was killed ({interrupted_at} shards)");

    // While pg2 is down, a re-run refuses and changes nothing.
    let err = shardline_ops::init(&config, &options(1), &quiet).await.unwrap_err();
    assert!(
        matches!(&err, OpsError::Unreachable { hosts } if hosts.len() == 1 && hosts[0].0 == "pg2"),
        "{err:?}"
    );

    // After the crash, each shard is whole or absent, on every host.
    ctx.hosts()[1].start().await?;
    let survived = each_shard_whole(&f, &ctx, &[all_migrations()]).await?;
    assert!(survived < 300, "every shard was done before the kill");
    let report: Report = shardline_ops::init(&config, &options(2), &quiet).await?;
    assert!(!report.catalog_created && report.shards_placed == 0, "{report:?}");
    assert_eq!(report.schemas_created, 300 - survived, "{report:?}");
    for h in 0..3 {
        let l = ledger(&f.client(&ctx, h).await?).await?;
        assert_eq!(l.len(), 100, "pg{}", h + 1);
        assert!(l.values().all(|n| *n == all_migrations()));
    }
    let ready: i64 = f
        .client(&ctx, 0)
        .await?
        .query_one(
            "SELECT count(*) FROM shardline.shards WHERE ready AND migration = '0004_likes_by_id.sql'",
            &[],
        )
        .await?
        .get(0);
    assert_eq!(ready, 300);
    assert!(!shardline_ops::init(&config, &options(2), &quiet).await?.changed());
    Ok(())
}

shardline_testkit::register!(exclusive: migrate_interrupted_by_a_killed_host_completes_later);
pub(crate) async fn migrate_interrupted_by_a_killed_host_completes_later(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 150).await?;
    let config = f.config()?;
    shardline_ops::init(&config, &options(2), &quiet).await?;
    f.migration(
        "0005_photo_tags.sql",
        "ALTER TABLE photos ADD COLUMN tags text[] NOT NULL DEFAULT '{}';\nSELECT pg_sleep(0.01);\n",
    )?;
    let before = all_migrations();
    let mut after = before.clone();
    after.insert(4, "0005_photo_tags.sql".to_owned());

    let switch = KillSwitch::default();
    let see = |p| switch.see(p);
    let (result, interrupted_at) =
        kill_pg2_during(&ctx, &switch, 5, shardline_ops::migrate(&config, &options(1), &see)).await?;
    let err = result.expect_err("migrate should fail when a host dies under it");
    assert!(err.to_string().contains("pg2"), "the error should name pg2: {err}");
    assert!(interrupted_at < 50, "pg2 finished before it was killed ({interrupted_at} shards)");
    // While pg2 is down, a re-run refuses before changing anything.
    let err = shardline_ops::migrate(&config, &options(1), &quiet).await.unwrap_err();
    assert!(matches!(&err, OpsError::Unreachable { hosts } if hosts[0].0 == "pg2"), "{err:?}");

    // After the crash every shard has the new migration whole (column and ledger row) or
    // not at all; none is lost.
    ctx.hosts()[1].start().await?;
    assert_eq!(each_shard_whole(&f, &ctx, &[before.clone(), after.clone()]).await?, 150);
    let c = f.client(&ctx, 1).await?;
    let with_column: i64 = c
        .query_one(
            "SELECT count(*) FROM information_schema.columns WHERE table_name = 'photos' AND column_name = 'tags'",
            &[],
        )
        .await?
        .get(0);
    let with_ledger = ledger(&c).await?.values().filter(|l| **l == after).count();
    assert_eq!(usize::try_from(with_column)?, with_ledger, "a column without its ledger row, or the reverse");
    assert!((5..50).contains(&with_ledger), "{with_ledger} of pg2's shards migrated before the kill");

    let mut pending = 0;
    for h in 0..3 {
        pending += ledger(&f.client(&ctx, h).await?).await?.values().filter(|l| **l != after).count();
    }
    assert!(pending >= 50 - with_ledger, "pg2's unmigrated shards are pending");
    let report = shardline_ops::migrate(&config, &options(2), &quiet).await?;
    assert_eq!(report.migrations_applied, pending, "{report:?}");
    assert_eq!(each_shard_whole(&f, &ctx, &[after.clone()]).await?, 150);
    assert!(!shardline_ops::migrate(&config, &options(2), &quiet).await?.changed());
    Ok(())
}

shardline_testkit::register!(exclusive: migrate_on_a_hung_host_fails_in_time_and_completes_later);
pub(crate) async fn migrate_on_a_hung_host_fails_in_time_and_completes_later(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 3, 60).await?;
    let config = f.config()?;
    shardline_ops::init(&config, &options(2), &quiet).await?;
    f.migration(
        "0005_photo_tags.sql",
        "ALTER TABLE photos ADD COLUMN tags text[] NOT NULL DEFAULT '{}';\nSELECT pg_sleep(0.02);\n",
    )?;
    let mut after = all_migrations();
    after.insert(4, "0005_photo_tags.sql".to_owned());
    let shard_timeout = Duration::from_secs(2);
    let hung = Options { jobs_per_host: 1, shard_timeout, ..Options::default() };

    let switch = KillSwitch::default();
    let see = |p| switch.see(p);
    let t = Instant::now();
    let (result, _) =
        fault_pg2_during(&ctx, &switch, 3, true, shardline_ops::migrate(&config, &hung, &see)).await?;
    let took = t.elapsed();
    let err = result.expect_err("migrate should fail when a host hangs under it");
    assert!(matches!(&err, OpsError::Timeout { host, .. } if host == "pg2"), "{err:?}");
    assert!(err.to_string().contains("whole or not at all"), "{err}");
    assert!(took < shard_timeout + Duration::from_secs(5), "migrate took {took:?} with a 2 s shard timeout");

    // Awake again: every shard is whole, and a re-run finishes the rest.
    ctx.hosts()[1].resume().await?;
    assert_eq!(each_shard_whole(&f, &ctx, &[all_migrations(), after.clone()]).await?, 60);
    shardline_ops::migrate(&config, &options(2), &quiet).await?;
    assert_eq!(each_shard_whole(&f, &ctx, &[after]).await?, 60);
    Ok(())
}

shardline_testkit::register!(shared: a_statement_past_the_shard_timeout_is_cancelled_on_the_server);
/// A migration whose statement outlives `shard_timeout` (an `ALTER TABLE`, then a 60 s
/// statement) fails in time, and the server stops running it: within 5 s of `migrate`
/// failing, no session of the database still runs it or holds a lock on a table. Before
/// the fix the future was only dropped: the server ran the statement on for its 60 s,
/// holding the `ALTER TABLE`'s lock, which blocks every read of the table.
pub(crate) async fn a_statement_past_the_shard_timeout_is_cancelled_on_the_server(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 4).await?;
    let config = f.config()?;
    shardline_ops::init(&config, &options(1), &quiet).await?;
    f.migration("0005_slow.sql", "ALTER TABLE photos ADD COLUMN tags text;\nSELECT pg_sleep(60);\n")?;
    let o = Options { jobs_per_host: 1, shard_timeout: Duration::from_secs(2), ..Options::default() };
    let t = Instant::now();
    let err =
        shardline_ops::migrate(&config, &o, &quiet).await.expect_err("the statement outlives the timeout");
    assert!(matches!(&err, OpsError::Timeout { what, .. } if what.contains("transaction")), "{err:?}");
    assert!(t.elapsed() < Duration::from_secs(10), "migrate took {:?} with a 2 s shard timeout", t.elapsed());
    for host in 0..2 {
        let c = f.client(&ctx, host).await?;
        let mut left = (0_i64, 0_i64);
        for _ in 0..50 {
            let row = c
                .query_one(
                    "SELECT (SELECT count(*) FROM pg_stat_activity
                             WHERE datname = current_database() AND pid <> pg_backend_pid()
                               AND query LIKE '%pg_sleep(60)%'),
                            (SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)
                             WHERE a.datname = current_database() AND l.pid <> pg_backend_pid()
                               AND l.locktype = 'relation')",
                    &[],
                )
                .await?;
            left = (row.get(0), row.get(1));
            if left == (0, 0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            left,
            (0, 0),
            "pg{}: (sessions still running the statement, relation locks held) 5 s after",
            host + 1
        );
    }
    // Nothing of the migration stayed: a re-run without the sleep applies it whole.
    f.migration("0005_slow.sql", "ALTER TABLE photos ADD COLUMN tags text;\n")?;
    let report = shardline_ops::migrate(&config, &options(1), &quiet).await?;
    assert_eq!(report.migrations_applied, 4, "{report:?}");
    Ok(())
}

shardline_testkit::register!(shared: shards_installed_beside_each_other_do_not_wait_for_the_first);
/// `init` on fresh hosts installs shards four at a time, each in one transaction with a
/// slow migration (300 ms) under a 100 ms `lock_timeout`. The catch-up every schema of a
/// database shares is made in a short transaction of its own first: made inside the first
/// shard's transaction, it held the other three installs until that one committed, and
/// they failed with "canceling statement due to lock timeout" (observed before the fix).
pub(crate) async fn shards_installed_beside_each_other_do_not_wait_for_the_first(
    ctx: TestContext,
) -> TestResult {
    let f = Fixture::new(&ctx, 2, 8).await?;
    f.migration("0005_slow.sql", "SELECT pg_sleep(0.3);")?;
    let o = Options { jobs_per_host: 4, lock_timeout: Duration::from_millis(100), ..Options::default() };
    let report = shardline_ops::init(&f.config()?, &o, &quiet).await?;
    assert_eq!(report.shards_migrated, 8, "{report:?}");
    for host in 0..2 {
        let c = f.client(&ctx, host).await?;
        let made: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_proc WHERE oid = to_regprocedure(
                   'shardline_minter.catch_up_v3(regclass, regclass, bigint, bigint, text, integer, integer, bigint, bigint, bigint, bigint)')",
                &[],
            )
            .await?
            .get(0);
        assert_eq!(made, 1, "pg{} has the shared catch-up", host + 1);
    }
    Ok(())
}

shardline_testkit::register!(shared: a_shared_catch_up_planted_by_another_role_is_refused);
/// A role that may create schemas in the database (its owner, say) makes schema
/// `shardline_minter` and a `catch_up_v3` of its own before `init`. Each shard's
/// `SECURITY DEFINER` wrapper would run that function with its owner's rights, so the
/// install refuses it (SQLSTATE 42501), naming the schema, and makes no shard there.
pub(crate) async fn a_shared_catch_up_planted_by_another_role_is_refused(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 1, 2).await?;
    let admin = f.client(&ctx, 0).await?;
    let role = "shardline_test_planter".to_owned();
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} NOLOGIN; GRANT CREATE ON DATABASE {db} TO {role};
             SET ROLE {role};
             CREATE SCHEMA shardline_minter;
             CREATE FUNCTION shardline_minter.catch_up_v3(seq regclass, due_seq regclass, read bigint, due bigint,
                 tag text, shard integer, seq_bits integer, epoch bigint, clock_offset bigint, lag bigint,
                 last_ticks bigint)
                 RETURNS bigint LANGUAGE sql AS 'SELECT 1::bigint';
             RESET ROLE",
            db = f.db()
        ))
        .await?;
    let e = shardline_ops::init(&f.config()?, &options(2), &quiet)
        .await
        .expect_err("a planted catch-up is refused");
    let text = format!("{e}");
    assert_eq!(e.sqlstate(), Some("42501"), "{text}");
    assert!(text.contains("shardline_minter") && text.contains(&role), "{text}");
    let shards: i64 = admin
        .query_one("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'shard\\_%'", &[])
        .await?
        .get(0);
    assert_eq!(shards, 0, "no shard made");

    // Made by the installer this time; then a DBA lets the role create in it, and it adds
    // an overload that an untyped call could resolve to.
    admin.batch_execute("DROP SCHEMA shardline_minter CASCADE").await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    admin
        .batch_execute(&format!(
            "GRANT CREATE ON SCHEMA shardline_minter TO {role};
             SET ROLE {role};
             CREATE FUNCTION shardline_minter.catch_up_v3(seq regclass, due_seq regclass, read bigint, due bigint,
                 tag text, shard integer, seq_bits integer, epoch bigint, clock_offset integer, lag integer,
                 last_ticks bigint)
                 RETURNS bigint LANGUAGE sql AS 'SELECT 1::bigint';
             RESET ROLE"
        ))
        .await?;
    // The minters call exactly their function: IDs still carry the time.
    let id: i64 = admin
        .query_one(
            "INSERT INTO shard_0000.photos (user_id, url) VALUES (0, 'https://cdn/a.jpg') RETURNING id",
            &[],
        )
        .await?
        .get(0);
    let ms = (id >> 23) + 1_314_220_021_721;
    let now = i64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis())?;
    assert!((now - ms).abs() < 60_000, "an ID of {ms} ms at {now}");
    let e =
        shardline_ops::migrate(&f.config()?, &options(2), &quiet).await.expect_err("an overload is refused");
    let text = format!("{e}");
    assert_eq!(e.sqlstate(), Some("42501"), "{text}");
    assert!(text.contains("shardline_minter") && text.contains(&role), "{text}");
    admin
        .batch_execute(&format!(
            "DROP SCHEMA shardline_minter CASCADE; REVOKE CREATE ON DATABASE {db} FROM {role}; DROP ROLE {role}",
            db = f.db()
        ))
        .await?;
    Ok(())
}

shardline_testkit::register!(shared: migrate_makes_a_dropped_shared_catch_up_again);
/// Nothing ties a shard's minter to the catch-up every schema of the database shares:
/// dropped by hand, every insert that needs a catch-up fails (3F000, no such schema). `migrate`, with
/// no migration pending, makes it again, and inserts work.
pub(crate) async fn migrate_makes_a_dropped_shared_catch_up_again(ctx: TestContext) -> TestResult {
    let f = Fixture::new(&ctx, 1, 2).await?;
    shardline_ops::init(&f.config()?, &options(2), &quiet).await?;
    let c = f.client(&ctx, 0).await?;
    c.batch_execute("DROP SCHEMA shardline_minter CASCADE").await?;
    let insert = "INSERT INTO shard_0000.photos (user_id, url) VALUES (0, 'https://cdn/a.jpg') RETURNING id";
    let e = c.query_one(insert, &[]).await.expect_err("no catch-up to call");
    assert_eq!(e.code().map(tokio_postgres::error::SqlState::code), Some("3F000"), "{e}");
    shardline_ops::migrate(&f.config()?, &options(2), &quiet).await?;
    let id: i64 = c.query_one(insert, &[]).await?.get(0);
    assert!(id > 0);
    Ok(())
}
