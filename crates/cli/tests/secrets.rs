//! Secrets through the real `shardline` executable, spawned as a child process with
//! `SHARDLINE_LOG=trace`: its own log set-up, every crate's logs (tokio-postgres logs
//! through the `log` crate, bridged into tracing), stdout and stderr. And a move whose
//! source asks the replication role for a password the target reads from a passfile, so
//! no password is ever stored in the config or in `pg_subscription`.
#![allow(clippy::unwrap_used, reason = "tests")]

use std::path::{Path, PathBuf};
use std::process::Command;

use shardline_testkit::Host;
use shardline_testkit::harness::{Harness, TestContext, TestResult};

fn main() {
    shardline_testkit::tests!(Harness::new(2),
        shared: [
            the_real_binary_at_trace_prints_no_password,
            a_move_authenticates_with_a_passfile_on_the_target,
            the_unlogged_path_runs_what_must_not_run_in_a_transaction_block,
        ],
        exclusive: [],
    )
    .run()
}

const SECRET: &str = "Pa55-w0rd-never-printed";

/// A config file and its migrations, in a directory of the test's own.
struct Dir(PathBuf);

impl Dir {
    fn new(db: &str) -> Result<Dir, Box<dyn std::error::Error + Send + Sync>> {
        let dir = std::env::temp_dir().join(format!("shardline-cli-secrets-{}-{db}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("migrations"))?;
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations");
        for entry in std::fs::read_dir(examples)? {
            let entry = entry?;
            std::fs::copy(entry.path(), dir.join("migrations").join(entry.file_name()))?;
        }
        Ok(Dir(dir))
    }

    fn config(&self) -> PathBuf {
        self.0.join("shardline.toml")
    }

    /// Writes a config of `hosts`' database `db`, each host's `url` and `peer_url` as
    /// `url` and `peer` make them from the kit's.
    fn write(
        &self,
        hosts: &[Host],
        db: &str,
        url: impl Fn(usize, String) -> String,
        peer: impl Fn(usize, String) -> String,
    ) -> std::io::Result<String> {
        let mut text = format!("logical_shards = 4\n\n[catalog]\nurl = \"{}\"\n", url(0, hosts[0].url(db)));
        for (i, h) in hosts.iter().enumerate() {
            text.push_str(&format!(
                "\n[[hosts]]\nname = \"pg{}\"\nurl = \"{}\"\npeer_url = \"{}\"\n",
                i + 1,
                url(i, h.url(db)),
                peer(i, h.peer_url(db))
            ));
        }
        std::fs::write(self.config(), &text)?;
        Ok(text)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What one run of the binary printed (stdout then stderr, escape codes removed), and
/// whether it exited 0.
struct Ran {
    ok: bool,
    text: String,
}

/// Runs the built `shardline` executable at `SHARDLINE_LOG=trace`.
async fn shardline(dir: &Dir, args: &[&str]) -> Result<Ran, Box<dyn std::error::Error + Send + Sync>> {
    let mut command = Command::new(env!("CARGO_BIN_EXE_shardline"));
    command.arg("--config").arg(dir.config()).args(args).env("SHARDLINE_LOG", "trace");
    let out = tokio::task::spawn_blocking(move || command.output()).await??;
    let text = format!(
        "$ shardline {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(Ran { ok: out.status.success(), text: strip_escapes(&text) })
}

/// `text` without terminal escape sequences (`ESC [ ... letter`), which could split a
/// word the test looks for.
fn strip_escapes(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn with_password(url: String) -> String {
    url.replacen("postgres@", &format!("postgres:{SECRET}@"), 1)
}

/// Every URL carries the password; `init`, the moves' dry run and real run, a rebalance,
/// `gc`, then a pre-flight whose probe cannot reach the source: the password appears in
/// nothing the binary prints, though the driver's debug lines (the statements it runs)
/// do.
async fn the_real_binary_at_trace_prints_no_password(ctx: TestContext) -> TestResult {
    let db = ctx.databases().await?;
    let dir = Dir::new(&db)?;
    let text = dir.write(ctx.hosts(), &db, |_, u| with_password(u), |_, u| with_password(u))?;
    assert_eq!(text.matches(SECRET).count(), 5, "{text}");
    let mut all = String::new();
    for args in [
        &["init"][..],
        &["move", "0", "--to", "pg2", "--dry-run"],
        &["move", "0", "--to", "pg2"],
        &["move", "1", "--to", "pg2", "--json"],
        &["moves", "--json"],
        &["status"],
        &["rebalance", "--apply"],
        &["gc", "--grace", "0s"],
    ] {
        let ran = shardline(&dir, args).await?;
        assert!(ran.ok, "failed:\n{}", ran.text);
        all.push_str(&ran.text);
    }
    // The probe fails: the source's peer_url names a port nothing listens on.
    dir.write(
        ctx.hosts(),
        &db,
        |_, u| with_password(u),
        |i, u| {
            let u = with_password(u);
            if i == 1 { format!("postgresql://postgres:{SECRET}@127.0.0.1:1/{db}") } else { u }
        },
    )?;
    let ran = shardline(&dir, &["move", "2", "--to", "pg1", "--dry-run"]).await?;
    assert!(!ran.ok && ran.text.contains("reaches the source"), "{}", ran.text);
    all.push_str(&ran.text);

    // The logs are the driver's too, at debug and below: the test would see a leak.
    for line in ["executing statement batch: CREATE PUBLICATION", "preparing query", "poll_read"] {
        assert!(all.contains(line), "no {line:?} in what the binary printed:\n{all}");
    }
    assert!(all.contains("move step done"), "shardline's own info lines are there");
    if let Some(at) = all.find(SECRET) {
        let line_start = all[..at].rfind('\n').map_or(0, |n| n + 1);
        let line_end = all[at..].find('\n').map_or(all.len(), |n| at + n);
        panic!("the password was printed:\n{}", &all[line_start..line_end]);
    }
    Ok(())
}

/// The source asks the replication role for its password (scram-sha-256); the source's
/// `peer_url` names the role and a passfile on the target, and holds no password. The
/// pre-flight without the passfile is refused by the source; with it (URL form, then
/// key/value form) shards move, rows and all.
async fn a_move_authenticates_with_a_passfile_on_the_target(ctx: TestContext) -> TestResult {
    let db = ctx.databases().await?;
    let dir = Dir::new(&db)?;
    let (pg1, pg2) = (&ctx.hosts()[0], &ctx.hosts()[1]);
    let role = format!("shardline_repl_{}", std::process::id());
    let password = "pf-only-0n-the-target";
    let plain = |_: usize, u: String| u;
    dir.write(ctx.hosts(), &db, plain, plain)?;

    // The role, with what docs/operations.md says a peer_url role needs: REPLICATION,
    // and SELECT on the shard's tables and the move's marker table, given here (as the
    // docs advise) by default privileges set before `init` made them.
    // It exists on every host: a move carries the source's privileges, this role's
    // SELECT included, and the pre-flight refuses a target that lacks a role holding some.
    for host in [pg1, pg2] {
        let admin = host.connect("postgres").await?;
        let exists: bool = admin
            .query_one("SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)", &[&role])
            .await?
            .get(0);
        if !exists {
            admin
                .batch_execute(&format!("CREATE ROLE {role} LOGIN REPLICATION PASSWORD '{password}'"))
                .await?;
        }
    }
    let source = pg1.connect(&db).await?;
    source
        .batch_execute(&format!(
            "ALTER DEFAULT PRIVILEGES GRANT USAGE ON SCHEMAS TO {role};
             ALTER DEFAULT PRIVILEGES GRANT SELECT ON TABLES TO {role};"
        ))
        .await?;
    let init = shardline(&dir, &["init"]).await?;
    assert!(init.ok, "{}", init.text);
    source
        .batch_execute(
            "INSERT INTO shard_0000.photos (user_id, url) SELECT 4 * g, 'u' || g FROM generate_series(1, 50) g;
             INSERT INTO shard_0001.photos (user_id, url) SELECT 4 * g + 1, 'u' || g FROM generate_series(1, 70) g;",
        )
        .await?;

    let required = pg1.require_password(&role).await?;
    // From the test process: no password, refused (require_password waited for that);
    // the password, let in.
    let mut config = pg1.config(&db);
    config.user(&role).password(password);
    let (_client, connection) = config.connect(shardline_repo::tokio_postgres::NoTls).await?;
    drop(connection);

    let peer = pg1.peer_endpoint().clone();
    let url_form = |extra: &str| format!("postgresql://{role}@{}:{}/{db}{extra}", peer.host, peer.port);
    // Without a passfile, the target cannot get in.
    dir.write(ctx.hosts(), &db, plain, |i, u| if i == 0 { url_form("") } else { u })?;
    let ran = shardline(&dir, &["move", "0", "--to", "pg2", "--dry-run"]).await?;
    assert!(!ran.ok && ran.text.contains("reaches the source"), "{}", ran.text);
    assert!(ran.text.contains("password"), "the source asked for a password: {}", ran.text);

    let passfile =
        pg2.write_private_file(&format!("{role}.pgpass"), &format!("*:*:*:{role}:{password}")).await?;
    let mut printed = ran.text;
    let forms = [
        (0, url_form(&format!("?passfile={passfile}"))),
        (1, format!("host={} port={} dbname={db} user={role} passfile={passfile}", peer.host, peer.port)),
    ];
    for (shard, peer_url) in forms {
        let text = dir.write(ctx.hosts(), &db, plain, |i, u| if i == 0 { peer_url.clone() } else { u })?;
        assert!(!text.contains(password));
        for args in [
            &["move", &shard.to_string(), "--to", "pg2", "--dry-run"][..],
            &["move", &shard.to_string(), "--to", "pg2"],
        ] {
            let ran = shardline(&dir, args).await?;
            assert!(ran.ok, "with peer_url {peer_url}:\n{}", ran.text);
            printed.push_str(&ran.text);
        }
    }
    let target = pg2.connect(&db).await?;
    let rows: i64 = target
        .query_one("SELECT (SELECT count(*) FROM shard_0000.photos) * 1000 + (SELECT count(*) FROM shard_0001.photos)", &[])
        .await?
        .get(0);
    assert_eq!(rows, 50_070, "every row reached the target through the passfile role");
    let map = shardline(&dir, &["map"]).await?;
    assert!(map.ok, "{}", map.text);
    assert!(!printed.contains(password) && !map.text.contains(password), "the password was printed");
    required.restore().await?;
    Ok(())
}

/// shardline sends `CREATE SUBSCRIPTION` by `Client::query_typed` (one unnamed statement,
/// then Sync), which the driver does not log. That path also runs the variant that must
/// not run in a transaction block (`create_slot = true`), so no statement holding a
/// connection string ever needs a logged path.
async fn the_unlogged_path_runs_what_must_not_run_in_a_transaction_block(ctx: TestContext) -> TestResult {
    let db = ctx.databases().await?;
    let (pg1, pg2) = (&ctx.hosts()[0], &ctx.hosts()[1]);
    let name = format!("shardline_unlogged_{}", std::process::id());
    pg1.connect(&db).await?.batch_execute(&format!("CREATE PUBLICATION {name} FOR ALL TABLES")).await?;
    let target = pg2.connect(&db).await?;
    let create = format!(
        "CREATE SUBSCRIPTION {name} CONNECTION '{}' PUBLICATION {name} WITH (create_slot = true, enabled = false)",
        pg1.peer_url(&db)
    );
    // The same statement in a transaction block is refused: the variant is the right one.
    target.batch_execute("BEGIN").await?;
    let refused = target.query_typed(&create, &[]).await.unwrap_err();
    target.batch_execute("ROLLBACK").await?;
    assert!(format!("{refused:?}").contains("cannot run inside a transaction block"), "{refused:?}");
    target.query_typed(&create, &[]).await?;
    let slots: i64 = pg1
        .connect(&db)
        .await?
        .query_one("SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", &[&name])
        .await?
        .get(0);
    assert_eq!(slots, 1, "the subscription made its slot on the source");
    target.batch_execute(&format!("DROP SUBSCRIPTION {name}")).await?;
    Ok(())
}
