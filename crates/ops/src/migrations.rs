//! Migration files: read from a directory, checked, and split into statements.
//!
//! A migration is a `.sql` file, applied to every shard schema in file-name order. Files
//! are written unqualified; shardline runs them with the shard's schema first on
//! `search_path`, inside one transaction per shard. So a file must not manage
//! transactions itself (`BEGIN`, `COMMIT`, ...): that is refused here, naming the line.
//!
//! Statements are split the way `psql` splits them: on `;` outside quotes, comments,
//! dollar quotes and `BEGIN ATOMIC ... END` bodies, so a failure can name the exact
//! statement that failed.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// One statement of a migration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    /// The 1-based line it starts on.
    pub line: usize,
    /// Its text, without the terminating `;`.
    pub sql: String,
}

/// One migration file, read and split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Migration {
    /// The file name (`0001_photos.sql`): its identity in the ledger.
    pub name: String,
    /// The SHA-256 of the file's bytes, in hex: a file changed after it was applied is
    /// refused.
    pub checksum: String,
    /// Its statements, in order.
    pub statements: Vec<Statement>,
}

impl Migration {
    /// Reads and checks migration `name` from `text`.
    ///
    /// # Errors
    ///
    /// [`Error::MigrationSyntax`] naming the file and line of an unterminated quote or
    /// comment, or of a statement that manages transactions.
    pub fn parse(name: &str, text: &str) -> Result<Migration> {
        let statements = split(text).map_err(|(line, message)| Error::MigrationSyntax {
            file: name.to_owned(),
            line,
            message,
        })?;
        for s in &statements {
            let refused =
                |message: String| Error::MigrationSyntax { file: name.to_owned(), line: s.line, message };
            if let Some(word) = transaction_control(&s.sql) {
                return Err(refused(format!(
                    "{word} is not allowed: shardline runs each shard's pending migrations in one \
                     transaction of its own"
                )));
            }
            if let Some(words) = session_control(&s.sql) {
                return Err(refused(format!(
                    "{words} is not allowed: shardline runs each shard's migrations with that shard's \
                     schema first on search_path, as the role it connects as"
                )));
            }
        }
        Ok(Migration { name: name.to_owned(), checksum: checksum(text.as_bytes()), statements })
    }
}

/// The hex SHA-256 of `bytes`.
pub fn checksum(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut out = String::with_capacity(64);
    for b in digest {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// Reads every `*.sql` file of `dir`, in order. Other files and hidden files are
/// skipped.
///
/// The order is sqlx's, so a sqlx application's `migrations/` directory works as it is
/// (`<VERSION>_<DESCRIPTION>.sql`): files whose name starts with a number and `_` come
/// first, by that number (`2_b.sql` before `10_c.sql`); then the others, by name. With
/// zero-padded numbers (`0001_photos.sql`) that is also byte order. A reversible
/// migration's `.up.sql` is applied; its `.down.sql` is skipped (shardline does not run
/// migrations backwards). Two files of one version (`0004_a.sql`, `0004_b.sql`) go by
/// name, as they always did here (sqlx refuses them; shardline does not).
///
/// # Errors
///
/// [`Error::MigrationDir`] when the directory or a file cannot be read or a name is not
/// UTF-8;
/// [`Error::MigrationSyntax`] for a file that cannot be split, or that starts with
/// sqlx's `-- no-transaction` (shardline runs each shard's migrations in one
/// transaction).
pub fn load_dir(dir: &Path) -> Result<Vec<Migration>> {
    let io = |path: &Path, e: std::io::Error| Error::MigrationDir {
        path: path.to_owned(),
        message: e.to_string(),
    };
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let entry = entry.map_err(|e| io(dir, e))?;
        let path = entry.path();
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            return Err(Error::MigrationDir { path, message: "the file name is not UTF-8".into() });
        };
        if name.starts_with('.') || !name.ends_with(".sql") || name.ends_with(".down.sql") {
            continue;
        }
        if !entry.file_type().map_err(|e| io(&path, e))?.is_file() {
            continue;
        }
        files.push((name, path));
    }
    files.sort_by(|(a, _), (b, _)| {
        (version(a).is_none(), version(a), a).cmp(&(version(b).is_none(), version(b), b))
    });
    files
        .into_iter()
        .map(|(name, path)| {
            let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
            let text = String::from_utf8(bytes).map_err(|_| Error::MigrationDir {
                path: path.clone(),
                message: "the file is not UTF-8".into(),
            })?;
            if text.starts_with("-- no-transaction") {
                return Err(Error::MigrationSyntax {
                    file: name,
                    line: 1,
                    message: "sqlx's `-- no-transaction` is not supported: shardline runs each shard's \
                              pending migrations in one transaction of its own"
                        .into(),
                });
            }
            Migration::parse(&name, &text)
        })
        .collect()
}

/// Where migration `name` sorts ([`load_dir`]'s order, the one order of migrations):
/// numbered ones first, by number, then the others, by name.
pub fn order(name: &str) -> (bool, Option<u64>, &str) {
    let v = version(name);
    (v.is_none(), v, name)
}

/// The version of a migration named `<VERSION>_<DESCRIPTION>.sql`, as sqlx reads it.
fn version(name: &str) -> Option<u64> {
    let (digits, _) = name.split_once('_')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The transaction-control keyword a statement starts with, if any.
fn transaction_control(sql: &str) -> Option<String> {
    let words: Vec<String> = code_words(sql).take(2).collect();
    let first = words.first()?.as_str();
    let second = words.get(1).map_or("", String::as_str);
    let hit = match first {
        "begin" | "commit" | "rollback" | "abort" | "savepoint" | "release" => true,
        "start" => second == "transaction",
        // `END` starts no other statement: `END AND NO CHAIN` commits too.
        "end" => true,
        "prepare" => second == "transaction",
        _ => false,
    };
    hit.then(|| words.join(" ").to_uppercase())
}

/// The words of a statement that changes the shard's `search_path` or the role the
/// migration runs as (a file's objects would be made elsewhere, or owned by another
/// role), if it is one: `SET [LOCAL | SESSION] search_path | ROLE | SESSION
/// AUTHORIZATION`, `RESET search_path | ROLE | SESSION AUTHORIZATION | ALL`.
fn session_control(sql: &str) -> Option<String> {
    // A quoted name is the same setting: `SET "search_path"`.
    let unquoted = sql.replace('"', " ");
    let words: Vec<String> = code_words(&unquoted).take(3).collect();
    let w = |i: usize| words.get(i).map_or("", String::as_str);
    // pg_dump's preamble sets the path this way: `SELECT pg_catalog.set_config(
    // 'search_path', '', false)`.
    if w(0) == "select" {
        let lower = sql.to_ascii_lowercase();
        return (lower.contains("set_config") && lower.contains("search_path"))
            .then(|| "SELECT set_config('search_path', ...)".to_owned());
    }
    let setting = match (w(0), w(1), w(2)) {
        ("set", "session", "authorization") => "authorization",
        ("set", "session", "characteristics") => return None,
        ("set", "local" | "session", third) => third,
        ("set" | "reset", second, _) => second,
        _ => return None,
    };
    // `SET SCHEMA 'x'` is Postgres's other name for `SET search_path`.
    let hit = matches!(setting, "search_path" | "schema" | "role" | "authorization")
        || (w(0) == "reset" && matches!(setting, "all" | "session"));
    hit.then(|| words.join(" ").to_uppercase())
}

/// The lowercased words of `sql` outside comments, in order.
fn code_words(sql: &str) -> impl Iterator<Item = String> + '_ {
    let mut rest = sql;
    std::iter::from_fn(move || {
        loop {
            rest = rest.trim_start();
            if let Some(r) = rest.strip_prefix("--") {
                rest = r.find('\n').map_or("", |i| &r[i..]);
            } else if rest.starts_with("/*") {
                rest = rest.find("*/").map_or("", |i| &rest[i + 2..]);
            } else {
                break;
            }
        }
        let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
        if end == 0 {
            return None;
        }
        let word = rest[..end].to_ascii_lowercase();
        rest = &rest[end..];
        Some(word)
    })
}

/// Splits `text` into statements on top-level `;`. Errors carry the 1-based line.
fn split(text: &str) -> std::result::Result<Vec<Statement>, (usize, String)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let mut start = 0;
    let mut start_line: Option<usize> = None;
    // Words of the current statement (the first four), and BEGIN ... END depth inside a
    // CREATE FUNCTION/PROCEDURE's BEGIN ATOMIC body.
    let mut words: Vec<String> = Vec::new();
    let mut depth = 0usize;
    let mut prev_ident = false;
    while i < bytes.len() {
        let c = bytes[i];
        let next = bytes.get(i + 1).copied();
        let is_code = !(c.is_ascii_whitespace()
            || (c == b'-' && next == Some(b'-'))
            || (c == b'/' && next == Some(b'*')));
        if is_code && start_line.is_none() && c != b';' {
            start_line = Some(line);
            start = i;
        }
        match c {
            b'\n' => {
                line += 1;
                i += 1;
            }
            b'-' if next == Some(b'-') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if next == Some(b'*') => {
                let opened = line;
                let mut nest = 1;
                i += 2;
                while nest > 0 {
                    match (bytes.get(i), bytes.get(i + 1)) {
                        (None, _) => return Err((opened, "a /* comment is never closed".into())),
                        (Some(b'*'), Some(b'/')) => {
                            nest -= 1;
                            i += 2;
                        }
                        (Some(b'/'), Some(b'*')) => {
                            nest += 1;
                            i += 2;
                        }
                        (Some(b), _) => {
                            line += usize::from(*b == b'\n');
                            i += 1;
                        }
                    }
                }
            }
            b'\'' | b'"' => {
                let opened = line;
                // E'...' strings take backslash escapes.
                let escapes = c == b'\''
                    && i > 0
                    && matches!(bytes[i - 1], b'e' | b'E')
                    && (i < 2 || !is_ident(bytes[i - 2]));
                i += 1;
                loop {
                    match bytes.get(i) {
                        None => {
                            let what = if c == b'"' { "a quoted identifier" } else { "a string" };
                            return Err((opened, format!("{what} is never closed")));
                        }
                        Some(b'\\') if escapes => {
                            line += usize::from(bytes.get(i + 1) == Some(&b'\n'));
                            i += 2;
                        }
                        Some(&b) if b == c => {
                            i += 1;
                            if bytes.get(i) == Some(&c) {
                                i += 1;
                            } else {
                                break;
                            }
                        }
                        Some(&b) => {
                            line += usize::from(b == b'\n');
                            i += 1;
                        }
                    }
                }
            }
            b'$' if !prev_ident => {
                // $tag$ ... $tag$, where tag is empty or an identifier not starting with a
                // digit ($1 is a parameter, not a quote).
                let tag_end = bytes[i + 1..]
                    .iter()
                    .position(|&b| !(b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80))
                    .map_or(bytes.len(), |p| i + 1 + p);
                let is_quote =
                    bytes.get(tag_end) == Some(&b'$') && !bytes.get(i + 1).is_some_and(u8::is_ascii_digit);
                if is_quote {
                    let tag = &text[i..=tag_end];
                    let opened = line;
                    let body_start = tag_end + 1;
                    let Some(close) = text[body_start..].find(tag) else {
                        return Err((opened, format!("the dollar quote {tag} is never closed")));
                    };
                    line += text[body_start..body_start + close].bytes().filter(|&b| b == b'\n').count();
                    i = body_start + close + tag.len();
                } else {
                    i += 1;
                }
            }
            b';' if depth == 0 => {
                if let Some(l) = start_line.take() {
                    out.push(Statement { line: l, sql: text[start..i].trim().to_owned() });
                }
                words.clear();
                i += 1;
            }
            _ if is_ident(c) && !prev_ident => {
                let end = bytes[i..].iter().position(|&b| !is_ident(b)).map_or(bytes.len(), |p| i + p);
                let word = text[i..end].to_ascii_lowercase();
                let routine = words.first().is_some_and(|w| w == "create")
                    && words.iter().skip(1).take(3).any(|w| w == "function" || w == "procedure");
                match word.as_str() {
                    // Only `BEGIN ATOMIC` opens a body: `begin` may also name a parameter.
                    "begin" if routine && code_words(&text[end..]).next().as_deref() == Some("atomic") => {
                        depth += 1;
                    }
                    "case" if depth > 0 => depth += 1,
                    "end" if depth > 0 => depth -= 1,
                    _ => {}
                }
                if words.len() < 4 {
                    words.push(word);
                }
                i = end;
                prev_ident = true;
                continue;
            }
            _ => i += 1,
        }
        prev_ident = i > 0 && is_ident(bytes[i - 1]) && c != b'\'' && c != b'"';
    }
    if let Some(l) = start_line {
        out.push(Statement { line: l, sql: text[start..].trim().to_owned() });
    }
    Ok(out)
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sqls(text: &str) -> Vec<(usize, String)> {
        split(text).unwrap().into_iter().map(|s| (s.line, s.sql)).collect()
    }

    #[test]
    fn statements_split_on_top_level_semicolons_only() {
        let text = "-- header; not a statement\nCREATE TABLE a (x text DEFAULT ';');\n\n\
                    /* block; /* nested; */ still */ CREATE TABLE \"b;c\" (y int);\n\
                    CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $body$\nBEGIN\n  RETURN 1; -- ;\nEND\n$body$;\n\
                    SELECT E'it\\'s; fine', $$;$$, 'a''b;'\n";
        let got = sqls(text);
        assert_eq!(got.len(), 4, "{got:#?}");
        assert_eq!(got[0], (2, "CREATE TABLE a (x text DEFAULT ';')".to_owned()));
        assert_eq!(got[1].0, 4);
        assert!(got[1].1.ends_with("CREATE TABLE \"b;c\" (y int)"), "{}", got[1].1);
        assert_eq!(got[2].0, 5);
        assert!(got[2].1.ends_with("$body$"), "{}", got[2].1);
        assert_eq!(got[3], (10, "SELECT E'it\\'s; fine', $$;$$, 'a''b;'".to_owned()));
    }

    #[test]
    fn begin_atomic_bodies_keep_their_semicolons() {
        let text = "CREATE OR REPLACE FUNCTION g(x int) RETURNS int LANGUAGE sql\nBEGIN ATOMIC\n  \
                    SELECT CASE WHEN x > 0 THEN 1 ELSE 0 END;\n  SELECT 2;\nEND;\nSELECT 3;";
        let got = sqls(text);
        assert_eq!(got.len(), 2, "{got:#?}");
        assert!(got[0].1.ends_with("END"), "{}", got[0].1);
        assert_eq!(got[1], (6, "SELECT 3".to_owned()));
    }

    #[test]
    fn parameters_and_dollar_identifiers_are_not_quotes() {
        let got = sqls("PREPARE p AS SELECT $1 + a$b FROM t; SELECT 1;");
        assert_eq!(got.len(), 2, "{got:#?}");
    }

    #[test]
    fn comment_only_text_has_no_statements() {
        assert!(sqls("-- nothing\n/* at all */\n;\n").is_empty());
    }

    #[test]
    fn unterminated_things_name_the_line_they_open_on() {
        for (text, line, message) in [
            ("SELECT 1;\nSELECT 'abc;\n", 2, "a string is never closed"),
            ("SELECT 1;\n\n/* open\n", 3, "a /* comment is never closed"),
            ("CREATE FUNCTION f() AS $x$ body;\n", 1, "the dollar quote $x$ is never closed"),
            ("SELECT \"a;\n", 1, "a quoted identifier is never closed"),
        ] {
            assert_eq!(split(text), Err((line, message.to_owned())), "{text:?}");
        }
    }

    #[test]
    fn transaction_control_is_refused_with_its_line() {
        for (text, word) in [
            ("CREATE TABLE a (x int);\nBEGIN;\nCREATE TABLE b (y int);\n", "BEGIN"),
            ("CREATE TABLE a (x int);\n  commit;", "COMMIT"),
            ("CREATE TABLE a (x int);\n/* x */ START TRANSACTION;", "START TRANSACTION"),
            ("CREATE TABLE a (x int);\nEND;", "END"),
            ("CREATE TABLE a (x int);\nEND AND NO CHAIN;\nCREATE TABLE b (y int);", "END AND"),
            ("CREATE TABLE a (x int);\ncommit and chain;", "COMMIT AND"),
            // A parameter named `begin` opens no body: the COMMIT after it is seen.
            ("CREATE FUNCTION f(begin int) RETURNS int LANGUAGE sql AS $$ SELECT 1 $$;\nCOMMIT;", "COMMIT"),
        ] {
            let err = Migration::parse("0002_x.sql", text).unwrap_err().to_string();
            assert!(err.starts_with(&format!("0002_x.sql:2: {word} is not allowed")), "{err}");
        }
        for (text, words) in [
            ("SET search_path TO public;", "SET SEARCH_PATH TO"),
            ("set local search_path = x;", "SET LOCAL SEARCH_PATH"),
            ("RESET ALL;", "RESET ALL"),
            ("reset search_path;", "RESET SEARCH_PATH"),
            ("SET ROLE app;", "SET ROLE APP"),
            ("SET SESSION AUTHORIZATION app;", "SET SESSION AUTHORIZATION"),
            ("SET LOCAL SCHEMA 'x';", "SET LOCAL SCHEMA"),
            ("SET \"search_path\" TO x;", "SET SEARCH_PATH TO"),
            (
                "SELECT pg_catalog.set_config('search_path', '', false);",
                "SELECT set_config('search_path', ...)",
            ),
        ] {
            let err =
                Migration::parse("0003_x.sql", &format!("CREATE TABLE a (x int);\n{text}")).unwrap_err();
            assert!(err.to_string().starts_with(&format!("0003_x.sql:2: {words} is not allowed")), "{err}");
        }
        // Other settings are the file's own business.
        Migration::parse(
            "ok.sql",
            "SET LOCAL lock_timeout = '1s'; SET statement_timeout = 0; RESET work_mem;\n\
             SET CONSTRAINTS ALL DEFERRED; SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE;\n\
             SELECT set_config('application_name', 'm', true); CREATE TABLE role (session int);",
        )
        .unwrap();
        // A DO block's BEGIN is inside its dollar quote, and fine.
        Migration::parse("ok.sql", "DO $$ BEGIN PERFORM 1; END $$;").unwrap();
    }

    #[test]
    fn checksums_are_sha256() {
        assert_eq!(checksum(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn the_example_migrations_load_in_order() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations");
        let got = load_dir(&dir).unwrap();
        let names: Vec<&str> = got.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["0001_photos.sql", "0002_likes.sql", "0003_comments.sql", "0004_likes_by_id.sql"]);
        assert_eq!(got[0].statements.len(), 2);
        assert!(got[0].statements[0].sql.contains("CREATE TABLE photos"));
    }

    #[test]
    fn a_sqlx_migrations_directory_loads_as_sqlx_orders_it() {
        let dir = std::env::temp_dir().join(format!("shardline-sqlx-migrations-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, sql) in [
            ("10_c.sql", "CREATE TABLE c (id bigint);"),
            ("2_b.up.sql", "CREATE TABLE b (id bigint);"),
            ("2_b.down.sql", "DROP TABLE b;"),
            ("1_a.sql", "CREATE TABLE a (id bigint);"),
            ("20240101120000_d.sql", "CREATE TABLE d (id bigint);"),
            ("README.md", "not a migration"),
        ] {
            std::fs::write(dir.join(name), sql).unwrap();
        }
        let names: Vec<String> = load_dir(&dir).unwrap().into_iter().map(|m| m.name).collect();
        assert_eq!(names, ["1_a.sql", "2_b.up.sql", "10_c.sql", "20240101120000_d.sql"]);
        // Two files of one version go by name (sqlx would refuse them; shardline's own
        // directories have had `0004_a.sql` beside `0004_b.sql`).
        std::fs::write(dir.join("01_again.sql"), "SELECT 1;").unwrap();
        let names: Vec<String> = load_dir(&dir).unwrap().into_iter().map(|m| m.name).collect();
        assert_eq!(names[..2], ["01_again.sql", "1_a.sql"]);
        std::fs::remove_file(dir.join("01_again.sql")).unwrap();
        // sqlx's no-transaction directive cannot be honoured, and says so.
        std::fs::write(
            dir.join("11_concurrently.sql"),
            "-- no-transaction\nCREATE INDEX CONCURRENTLY i ON c (id);",
        )
        .unwrap();
        let err = load_dir(&dir).unwrap_err().to_string();
        assert!(err.starts_with("11_concurrently.sql:1: sqlx's `-- no-transaction`"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_directory_is_named() {
        let err = load_dir(Path::new("/no/such/dir")).unwrap_err().to_string();
        assert!(err.starts_with("cannot read the migrations at /no/such/dir: "), "{err}");
    }
}
