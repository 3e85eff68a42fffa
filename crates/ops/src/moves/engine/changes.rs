//! The move's change log and the comparison before the fence (see `docs/moves.md`,
//! "A pause that does not grow with the shard").
//!
//! Once the copy has caught up, every table of the shard with a primary key gets a row
//! trigger (and a TRUNCATE trigger) on the source and on the target, enabled `ALWAYS`
//! (so it fires for the apply worker too, and for a session in `replica` role), that
//! writes the old and new key of every row written into `shardline.move_changes`, an
//! unlogged table of the host. Then, outside the fence, the whole shard is compared
//! between consistent snapshots of both sides (per table, per key-hash bucket: count
//! and exact sum of row hashes; rows read only in differing buckets); a key that
//! differs must be in a change log (a row in flight), else the move fails before it
//! fences. Inside the fence only the logged keys are read again.

use std::collections::{BTreeMap, HashMap, HashSet};

use shardline_id::ident::literal;

use super::*;
use crate::moves::journal::{Precheck, Round};

/// The change log's table, on every host a move touches. A row per key written
/// (`key` the key's columns as JSON); `key IS NULL` with `tbl = ''` is the log's
/// sentinel, written when the log starts (an unlogged table is emptied by crash
/// recovery: without the sentinel the log is not trusted), and with a table's name a
/// TRUNCATE of that table. `round` is NULL until a round before the fence takes the
/// row (see [`Mover::rounds`]): the round's number, once it read the key on both sides.
pub const CHANGES_SQL: &str = "CREATE SCHEMA IF NOT EXISTS shardline;
CREATE UNLOGGED TABLE IF NOT EXISTS shardline.move_changes (
    move_id bigint NOT NULL,
    tbl     text NOT NULL,
    key     jsonb,
    round   int
);
DO $$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_attribute WHERE attrelid = 'shardline.move_changes'::regclass
                      AND attname = 'round' AND NOT attisdropped) THEN
        ALTER TABLE shardline.move_changes ADD COLUMN round int;
    END IF;
END $$;
COMMENT ON TABLE shardline.move_changes IS 'shardline: the keys written to a moving shard''s tables since its move''s change log started, for the verification inside the fence';";

/// A table of the shard with a primary key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Keyed {
    /// The table's name.
    pub(super) table: String,
    /// The key's columns: name and type.
    pub(super) cols: Vec<(String, KeyType)>,
    /// Every column, in order, and whether its row hash takes it as it is or as its
    /// text (see [`verify::HASHED_COLUMNS`]).
    pub(super) hashed: Vec<(String, bool)>,
}

impl Keyed {
    /// `jsonb_build_object('a', t."a", ...)`: the key as JSON, of row alias `t`.
    fn json(&self, t: &str) -> String {
        let parts: Vec<String> =
            self.cols.iter().map(|(c, _)| format!("{}, {t}.{}", literal(c), quote_ident(c))).collect();
        format!("jsonb_build_object({})", parts.join(", "))
    }

    /// `t."a", ...`.
    fn list(&self, t: &str) -> String {
        let parts: Vec<String> = self.cols.iter().map(|(c, _)| format!("{t}.{}", quote_ident(c))).collect();
        parts.join(", ")
    }

    /// `(t."a", ...)`.
    fn tuple(&self, t: &str) -> String {
        format!("({})", self.list(t))
    }

    /// `ROW(t."a", ...)`: for the key's hash and its display.
    fn row(&self, t: &str) -> String {
        format!("ROW{}", self.tuple(t))
    }

    /// The hash of a row of alias `t`, the same on every server ([`verify::row_hash`]).
    fn row_hash(&self, t: &str) -> String {
        verify::row_hash(t, &self.hashed)
    }

    /// The hash of the key of a row of alias `t`, the same on every server.
    fn key_hash(&self, t: &str) -> String {
        let cols: Vec<(String, bool)> = self
            .cols
            .iter()
            .map(|(c, _)| (c.clone(), self.hashed.iter().any(|(h, as_is)| h == c && *as_is)))
            .collect();
        verify::row_hash(t, &cols)
    }

    /// `k("a" bigint, ...)`: the key's columns as a record definition, on a host where
    /// the table lives in `schema` (a type of the shard's own is named there).
    fn record(&self, schema: &str) -> String {
        let parts: Vec<String> =
            self.cols.iter().map(|(c, ty)| format!("{} {}", quote_ident(c), ty.in_schema(schema))).collect();
        format!("k({})", parts.join(", "))
    }

    /// The name of this table's trigger function for move `id` (the `n`-th keyed table).
    fn function(id: i64, n: usize) -> String {
        format!("shardline.{}", quote_ident(&format!("move_{id}_{n}")))
    }
}

/// The type of a key column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum KeyType {
    /// A type of another schema than the table's (`pg_catalog`'s, an extension's), as
    /// `format_type` names it.
    Global(String),
    /// A type of the table's own schema (an enum or a domain the shard's migrations
    /// made), or an array of one: its name, quoted (with `[]`), to be qualified with the
    /// schema the table lives in where it is read (the source's shard is renamed by the
    /// fence, and the target's copy has the shard's name).
    Local(String),
}

impl KeyType {
    /// The type's name on a host where the table lives in `schema`.
    fn in_schema(&self, schema: &str) -> String {
        match self {
            KeyType::Global(name) => name.clone(),
            KeyType::Local(name) => format!("{}.{name}", quote_ident(schema)),
        }
    }
}

/// The name of move `id`'s row trigger on every keyed table.
fn trigger(id: i64) -> String {
    format!("shardline_move_{id}")
}

/// The name of move `id`'s TRUNCATE trigger.
fn truncate_trigger(id: i64) -> String {
    format!("shardline_move_{id}_truncate")
}

/// The tables of `schema` with a primary key, by name, with the key's columns in order.
/// A partitioned table is not one of them: its rows are its partitions' (a trigger on it
/// would be cloned onto them, and could not be dropped from them one by one).
pub(super) async fn keyed_tables(c: &Client, host: &HostName, schema: &str) -> Result<Vec<Keyed>> {
    let rows = c
        .query(
            &format!(
                "SELECT c.relname::text, a.attname::text,
                        CASE WHEN e.typnamespace = n.oid
                             THEN quote_ident(e.typname) || CASE WHEN e.oid <> ty.oid THEN '[]' ELSE '' END
                             ELSE format_type(a.atttypid, a.atttypmod) END,
                        e.typnamespace = n.oid, {}
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                   JOIN pg_index i ON i.indrelid = c.oid AND i.indisprimary
                  CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
                   JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum
                   JOIN pg_type ty ON ty.oid = a.atttypid
                   JOIN pg_type e ON e.oid = CASE WHEN ty.typelem <> 0 AND ty.typlen = -1 THEN ty.typelem ELSE ty.oid END
                  WHERE n.nspname = $1 AND c.relkind = 'r'
                  ORDER BY c.relname, k.ord",
                verify::HASHED_COLUMNS
            ),
            &[&schema],
        )
        .await
        .map_err(on(host, "list the tables' keys"))?;
    let mut out: Vec<Keyed> = Vec::new();
    for r in rows {
        let (table, col, name, local): (String, String, String, bool) =
            (r.get(0), r.get(1), r.get(2), r.get(3));
        let ty = if local { KeyType::Local(name) } else { KeyType::Global(name) };
        match out.last_mut() {
            Some(k) if k.table == table => k.cols.push((col, ty)),
            _ => out.push(Keyed { table, cols: vec![(col, ty)], hashed: verify::hashed_columns(&r, 4) }),
        }
    }
    Ok(out)
}

/// The trigger function of keyed table `k` for move `id`: the old key of an UPDATE or
/// DELETE, the new key of an INSERT or of an UPDATE that changed the key, a NULL key for
/// a TRUNCATE. SECURITY DEFINER (owned by the mover's role): the application's roles
/// need no privilege on the log.
fn function_sql(id: i64, n: usize, k: &Keyed) -> String {
    let table = literal(&k.table);
    let body = format!(
        "BEGIN
    IF TG_LEVEL = 'STATEMENT' THEN
        INSERT INTO shardline.move_changes (move_id, tbl, key) VALUES ({id}, {table}, NULL);
        RETURN NULL;
    END IF;
    IF TG_OP <> 'INSERT' THEN
        INSERT INTO shardline.move_changes (move_id, tbl, key) VALUES ({id}, {table}, {old});
    END IF;
    IF TG_OP = 'INSERT' OR (TG_OP = 'UPDATE' AND {new_t} IS DISTINCT FROM {old_t}) THEN
        INSERT INTO shardline.move_changes (move_id, tbl, key) VALUES ({id}, {table}, {new});
    END IF;
    RETURN NULL;
END",
        old = k.json("OLD"),
        new = k.json("NEW"),
        old_t = k.row("OLD"),
        new_t = k.row("NEW"),
    );
    format!(
        "CREATE OR REPLACE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
         SET search_path = pg_catalog, pg_temp AS {}",
        Keyed::function(id, n),
        literal(&body)
    )
}

/// Per keyed table of `schema`: the OIDs of move `id`'s two triggers there that are
/// enabled always, sorted.
async fn triggers(c: &Client, host: &HostName, schema: &str, id: i64) -> Result<BTreeMap<String, Vec<u32>>> {
    let rows = c
        .query(
            "SELECT c.relname::text, t.oid FROM pg_trigger t
               JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND t.tgname IN ($2, $3) AND t.tgenabled = 'A'
              ORDER BY 1, 2",
            &[&schema, &trigger(id), &truncate_trigger(id)],
        )
        .await
        .map_err(on(host, "list the change log's triggers"))?;
    let mut out: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for r in rows {
        out.entry(r.get(0)).or_default().push(r.get(1));
    }
    Ok(out)
}

/// Starts move `id`'s change log on one host, where it is not running yet: the log's
/// table, its sentinel, and for each keyed table of `schema` its function and triggers
/// (one transaction per table: `CREATE TRIGGER` waits for the table's writes in flight,
/// and every write after it is logged). A lock not had within `lock_ms`, or a
/// deadlock, is tried again, `attempts` times in all. Returns whether it created a
/// trigger.
async fn install(
    c: &Client,
    host: &HostName,
    schema: &str,
    id: i64,
    keyed: &[Keyed],
    lock_ms: u128,
    attempts: u32,
) -> Result<bool> {
    let fail = on(host, "start the move's change log");
    c.batch_execute(CHANGES_SQL).await.map_err(&fail)?;
    let have = triggers(c, host, schema, id).await?;
    if keyed.iter().all(|k| have.get(&k.table).is_some_and(|t| t.len() == 2)) {
        return Ok(false);
    }
    // A log that starts again (its triggers were lost) starts with its sentinel: the
    // comparison that follows trusts only what is logged from here on.
    c.execute(
        "INSERT INTO shardline.move_changes (move_id, tbl, key)
         SELECT $1, '', NULL WHERE NOT EXISTS
           (SELECT FROM shardline.move_changes WHERE move_id = $1 AND tbl = '' AND key IS NULL)",
        &[&id],
    )
    .await
    .map_err(&fail)?;
    for (n, k) in keyed.iter().enumerate() {
        if have.get(&k.table).is_some_and(|t| t.len() == 2) {
            continue;
        }
        let table = format!("{}.{}", quote_ident(schema), quote_ident(&k.table));
        let f = Keyed::function(id, n);
        let (row, trunc) = (quote_ident(&trigger(id)), quote_ident(&truncate_trigger(id)));
        let sql = format!(
            "BEGIN; SET LOCAL lock_timeout = '{lock_ms}ms';
             {function};
             DROP TRIGGER IF EXISTS {row} ON {table};
             DROP TRIGGER IF EXISTS {trunc} ON {table};
             CREATE TRIGGER {row} AFTER INSERT OR UPDATE OR DELETE ON {table} FOR EACH ROW EXECUTE FUNCTION {f}();
             CREATE TRIGGER {trunc} AFTER TRUNCATE ON {table} FOR EACH STATEMENT EXECUTE FUNCTION {f}();
             ALTER TABLE {table} ENABLE ALWAYS TRIGGER {row}, ENABLE ALWAYS TRIGGER {trunc};
             COMMIT",
            function = function_sql(id, n, k),
        );
        let mut attempt = 1;
        loop {
            match c.batch_execute(&sql).await.map_err(&fail) {
                Ok(()) => break,
                Err(e) => {
                    let _ = c.batch_execute("ROLLBACK").await;
                    if is_lock_conflict(&e) && attempt < attempts {
                        tracing::warn!(id, %host, table = %k.table, attempt, error = %e, "the change log's trigger waits for writes; trying again");
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                    return Err(e);
                }
            }
        }
    }
    Ok(true)
}

/// Ends move `id`'s change log on one host: its trigger functions dropped with their
/// triggers (each waits for its table's writes in flight, within `lock_ms`, tried
/// `attempts` times), its rows deleted. Nothing there: nothing done.
pub(crate) async fn drop_changes(
    c: &Client,
    host: &HostName,
    id: i64,
    lock_ms: u128,
    attempts: u32,
) -> Result<()> {
    let fail = on(host, "drop the move's change log");
    let functions: Vec<String> = c
        .query(
            "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
              WHERE n.nspname = 'shardline' AND p.proname LIKE $1",
            &[&format!("move\\_{id}\\_%")],
        )
        .await
        .map_err(&fail)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    for f in functions {
        let mut attempt = 1;
        loop {
            let sql = format!(
                "BEGIN; SET LOCAL lock_timeout = '{lock_ms}ms'; DROP FUNCTION IF EXISTS {f} CASCADE; COMMIT"
            );
            match c.batch_execute(&sql).await.map_err(&fail) {
                Ok(()) => break,
                Err(e) => {
                    let _ = c.batch_execute("ROLLBACK").await;
                    if is_lock_conflict(&e) && attempt < attempts {
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                    return Err(e);
                }
            }
        }
    }
    c.execute("DELETE FROM shardline.move_changes WHERE move_id = $1", &[&id])
        .await
        .or_else(|e| {
            if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) { Ok(0) } else { Err(e) }
        })
        .map_err(&fail)?;
    Ok(())
}

/// The moves that left a change log (functions or rows) on a host.
pub(crate) async fn logged_moves(c: &Client, host: &HostName) -> Result<Vec<i64>> {
    let has: bool = c
        .query_one("SELECT to_regclass('shardline.move_changes') IS NOT NULL", &[])
        .await
        .map_err(on(host, "look for the change log"))?
        .get(0);
    let from_rows = if has { "UNION SELECT DISTINCT move_id FROM shardline.move_changes" } else { "" };
    let rows = c
        .query(
            &format!(
                "SELECT substring(p.proname FROM '^move_([0-9]+)_[0-9]+$')::bigint AS id
                   FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                  WHERE n.nspname = 'shardline' AND p.proname ~ '^move_[0-9]+_[0-9]+$'
                 {from_rows}"
            ),
            &[],
        )
        .await
        .map_err(on(host, "list the change logs"))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// What a host's change log holds for move `id`, keys as the mover's session renders
/// them (in UTC): per keyed table the distinct keys; the tables TRUNCATEd; whether
/// the sentinel is there.
#[derive(Debug, Default)]
pub(super) struct Logged {
    pub(super) keys: HashMap<String, HashSet<String>>,
    pub(super) truncated: HashSet<String>,
    pub(super) sentinel: bool,
}

/// Which keys of a change log to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Which {
    /// The keys no round up to and including this one verified: taken by no round, or
    /// by a later one (`0`: every key).
    After(i32),
    /// The keys round `n` took.
    Round(i32),
}

impl Which {
    /// The condition on the log's row `c`.
    fn sql(self) -> String {
        match self {
            Which::After(n) => format!("(c.round IS NULL OR c.round > {n})"),
            Which::Round(n) => format!("c.round = {n}"),
        }
    }
}

/// Reads host's change log for move `id` (see [`Logged`]): the keys `which` says, the
/// TRUNCATEs and the sentinel.
pub(super) async fn read_log(
    c: &Client,
    host: &HostName,
    schema: &str,
    id: i64,
    keyed: &[Keyed],
    which: Which,
) -> Result<Logged> {
    let mut parts = vec![
        "SELECT c.tbl, NULL::text FROM shardline.move_changes c WHERE c.move_id = $1 AND c.key IS NULL"
            .to_owned(),
    ];
    for k in keyed {
        parts.push(format!(
            "SELECT c.tbl, {}::text FROM shardline.move_changes c CROSS JOIN LATERAL jsonb_to_record(c.key) AS {}
              WHERE c.move_id = $1 AND c.tbl = {} AND c.key IS NOT NULL AND {}",
            k.json("k"),
            k.record(schema),
            literal(&k.table),
            which.sql()
        ));
    }
    let rows =
        c.query(&parts.join("\nUNION\n"), &[&id]).await.map_err(on(host, "read the move's change log"))?;
    let mut out = Logged::default();
    for r in rows {
        let (tbl, key): (String, Option<String>) = (r.get(0), r.get(1));
        match key {
            Some(key) => {
                out.keys.entry(tbl).or_default().insert(key);
            }
            None if tbl.is_empty() => out.sentinel = true,
            None => {
                out.truncated.insert(tbl);
            }
        }
    }
    Ok(out)
}

/// Keyed table `k` of `schema`: per key-hash bucket (`mask` + 1 of them), its rows and
/// the exact sum of their hashes.
async fn buckets(
    c: &Client,
    host: &HostName,
    schema: &str,
    k: &Keyed,
    mask: i64,
) -> Result<HashMap<i64, (i64, String)>> {
    let rows = c
        .query(
            &format!(
                "SELECT {} & $1, count(*), sum({})::text
                   FROM {}.{} AS t GROUP BY 1",
                k.key_hash("t"),
                k.row_hash("t"),
                quote_ident(schema),
                quote_ident(&k.table)
            ),
            &[&mask],
        )
        .await
        .map_err(on(host, format!("compare {schema}.{}", k.table)))?;
    Ok(rows.iter().map(|r| (r.get(0), (r.get(1), r.get(2)))).collect())
}

/// The rows of keyed table `k` of `schema` in the given buckets: key (JSON) to (the
/// key as a row, for messages; the row's hash).
async fn bucket_rows(
    c: &Client,
    host: &HostName,
    schema: &str,
    k: &Keyed,
    mask: i64,
    which: &[i64],
) -> Result<HashMap<String, (String, i64)>> {
    let rows = c
        .query(
            &format!(
                "SELECT {}::text, ({})::text, {} FROM {}.{} AS t
                  WHERE {} & $1 = ANY($2)",
                k.json("t"),
                k.row("t"),
                k.row_hash("t"),
                quote_ident(schema),
                quote_ident(&k.table),
                k.key_hash("t"),
            ),
            &[&mask, &which],
        )
        .await
        .map_err(on(host, format!("compare {schema}.{}", k.table)))?;
    Ok(rows.iter().map(|r| (r.get(0), (r.get(1), r.get(2)))).collect())
}

/// The rows of keyed table `k` of `schema` under the given keys (a JSON array of key
/// objects): key (JSON) to (the key as a row; the row's hash). Reads by the primary key.
pub(super) async fn rows_by_key(
    c: &Client,
    host: &HostName,
    schema: &str,
    k: &Keyed,
    keys: &str,
) -> Result<HashMap<String, (String, i64)>> {
    let rows = c
        .query(
            &format!(
                "SELECT {}::text, ({})::text, {} FROM {}.{} AS t
                  WHERE {} IN (SELECT {} FROM jsonb_to_recordset($1::text::jsonb) AS {})",
                k.json("t"),
                k.row("t"),
                k.row_hash("t"),
                quote_ident(schema),
                quote_ident(&k.table),
                k.tuple("t"),
                k.list("k"),
                k.record(schema),
            ),
            &[&keys],
        )
        .await
        .map_err(on(host, format!("recheck {schema}.{}", k.table)))?;
    Ok(rows.iter().map(|r| (r.get(0), (r.get(1), r.get(2)))).collect())
}

/// The keys whose rows differ between `a` and `b` (one side only, or another hash),
/// with the key as a row for messages.
pub(super) fn differing(
    a: &HashMap<String, (String, i64)>,
    b: &HashMap<String, (String, i64)>,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (this, other) in [(a, b), (b, a)] {
        for (key, (shown, hash)) in this {
            if other.get(key).map(|o| o.1) != Some(*hash) {
                out.insert(key.clone(), shown.clone());
            }
        }
    }
    out
}

/// A JSON array of the given key objects (each already JSON).
pub(super) fn json_array<'a>(keys: impl Iterator<Item = &'a String>) -> String {
    let keys: Vec<&str> = keys.map(String::as_str).collect();
    format!("[{}]", keys.join(","))
}

/// Whether a simple query's one row says `t`.
fn says_true(messages: &[tokio_postgres::SimpleQueryMessage]) -> bool {
    messages.iter().any(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("t")))
}

/// How many key-hash buckets to compare a table of about `rows` rows in: a power of
/// two, about a thousand rows each, from 256 to 16384 (few enough to aggregate in
/// memory, small enough that the rows of a few differing buckets are quick to read).
fn bucket_mask(rows: f64) -> i64 {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a positive estimate, clamped"
    )]
    let want = (rows.max(0.0) / 1024.0).clamp(256.0, 16384.0) as u64;
    i64::try_from(want.next_power_of_two()).unwrap_or(16384) - 1
}

/// The rounds before the fence stop, by default, once the keys logged since the last
/// one began are at most this many (what the fence then rechecks, plus what is written
/// until it).
pub(super) const SMALL_ROUND: i64 = 256;

/// By default, at most this many rounds before the fence (writes faster than a round
/// reads them never converge; the fence then rechecks what the last round left).
pub(super) const MAX_ROUNDS: i32 = 6;

impl Mover<'_> {
    /// Starts the change log on the target, then on the source (so every write the
    /// source logs is applied where the target logs it too).
    pub(super) async fn start_change_log(&mut self) -> Result<bool> {
        let (source, target, id) = (self.source.clone(), self.target.clone(), self.id);
        let schema = self.schema.as_str().to_owned();
        let lock_ms = self.options.lock_timeout.as_millis().max(1);
        let attempts = self.options.fence_attempts.max(1);
        let dst = self.dst().await?;
        let keyed = keyed_tables(dst, &target, &schema).await?;
        let on_target = install(dst, &target, &schema, id, &keyed, lock_ms, attempts).await?;
        let src = self.src().await?;
        let keyed = keyed_tables(src, &source, &schema).await?;
        let on_source = install(src, &source, &schema, id, &keyed, lock_ms, attempts).await?;
        Ok(on_target || on_source)
    }

    /// Compares the whole shard, outside the fence, with the change log running (see
    /// the module's docs); journals what it relied on in `detail.precheck`. A key that
    /// differs and is in neither change log fails the move with [`Error::Verify`]
    /// before anything is fenced.
    pub(super) async fn compare(&mut self) -> Result<()> {
        let started = Instant::now();
        let (source, target, id) = (self.source.clone(), self.target.clone(), self.id);
        let schema = self.schema.as_str().to_owned();
        let shard = self.shard;
        self.start_change_log().await?;
        // A comparison started again (a resumed move) trusts no earlier round: every
        // logged key is taken again by this one's rounds, or read inside the fence.
        let untake =
            "UPDATE shardline.move_changes SET round = NULL WHERE move_id = $1 AND round IS NOT NULL";
        self.dst()
            .await?
            .execute(untake, &[&id])
            .await
            .map_err(on(&target, "reset the change log's rounds"))?;
        self.src()
            .await?
            .execute(untake, &[&id])
            .await
            .map_err(on(&source, "reset the change log's rounds"))?;
        // Everything the source committed before its triggers (unlogged there) reaches
        // the target before the snapshots are taken.
        self.new_mark(Instant::now() + self.options.sync_timeout, "before the comparison").await?;
        self.src().await?;
        self.dst().await?;
        let (Some(src), Some(dst)) = (self.src.as_ref(), self.dst.as_ref()) else {
            return Err(Error::Busy);
        };
        let (src_keyed, dst_keyed) =
            futures::try_join!(keyed_tables(src, &source, &schema), keyed_tables(dst, &target, &schema))?;
        if src_keyed != dst_keyed {
            let names = |k: &[Keyed]| k.iter().map(|k| k.table.as_str()).collect::<Vec<_>>().join(", ");
            return Err(Error::Verify {
                id,
                shard,
                differences: vec![format!(
                    "the tables or their keys differ: [{}] on {source}, [{}] on {target}",
                    names(&src_keyed),
                    names(&dst_keyed)
                )],
            });
        }
        let (src_triggers, dst_triggers) =
            futures::try_join!(triggers(src, &source, &schema, id), triggers(dst, &target, &schema, id))?;
        let estimates: HashMap<String, f32> = src
            .query(
                "SELECT c.relname::text, c.reltuples FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND c.relkind IN ('r', 'p')",
                &[&schema],
            )
            .await
            .map_err(on(&source, "estimate the tables' rows"))?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        // Both snapshots at once, read only; keys rendered in UTC on both sides.
        let begin = &format!("{TEXT_SETTINGS}; BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY");
        futures::try_join!(
            async { src.batch_execute(begin).await.map_err(on(&source, "take a snapshot")) },
            async { dst.batch_execute(begin).await.map_err(on(&target, "take a snapshot")) }
        )?;
        let compared = async {
            let mut tables = BTreeMap::new();
            let mut differ: Vec<(Keyed, BTreeMap<String, String>)> = Vec::new();
            for k in &src_keyed {
                let mask = bucket_mask(f64::from(estimates.get(&k.table).copied().unwrap_or(0.0)));
                let (a, b) = futures::try_join!(
                    buckets(src, &source, &schema, k, mask),
                    buckets(dst, &target, &schema, k, mask)
                )?;
                let rows = |m: &HashMap<i64, (i64, String)>| m.values().map(|v| v.0).sum::<i64>();
                tables.insert(k.table.clone(), (rows(&a), rows(&b)));
                let mut which: Vec<i64> =
                    a.iter().filter(|(b_, v)| b.get(*b_) != Some(*v)).map(|(b_, _)| *b_).collect();
                which.extend(b.keys().filter(|b_| !a.contains_key(*b_)));
                if which.is_empty() {
                    continue;
                }
                let (ra, rb) = futures::try_join!(
                    bucket_rows(src, &source, &schema, k, mask, &which),
                    bucket_rows(dst, &target, &schema, k, mask, &which)
                )?;
                differ.push((k.clone(), differing(&ra, &rb)));
            }
            Ok::<_, Error>((tables, differ))
        }
        .await;
        let _ = futures::join!(src.batch_execute("COMMIT"), dst.batch_execute("COMMIT"));
        let (tables, differ) = compared?;
        // A differing key must be in flight: in a change log, read after the snapshots.
        let mut in_flight = 0;
        let mut differences = Vec::new();
        if differ.iter().any(|(_, d)| !d.is_empty()) {
            futures::try_join!(
                async { src.batch_execute(TEXT_SETTINGS).await.map_err(on(&source, "set the time zone")) },
                async { dst.batch_execute(TEXT_SETTINGS).await.map_err(on(&target, "set the time zone")) }
            )?;
            let (la, lb) = futures::try_join!(
                read_log(src, &source, &schema, id, &src_keyed, Which::After(0)),
                read_log(dst, &target, &schema, id, &src_keyed, Which::After(0))
            )?;
            for (k, d) in &differ {
                let truncated = la.truncated.contains(&k.table) || lb.truncated.contains(&k.table);
                let logged = |key: &String| {
                    truncated
                        || la.keys.get(&k.table).is_some_and(|s| s.contains(key))
                        || lb.keys.get(&k.table).is_some_and(|s| s.contains(key))
                };
                let unexplained: Vec<String> = d.keys().filter(|key| !logged(key)).cloned().collect();
                in_flight += i64::try_from(d.len() - unexplained.len()).unwrap_or(i64::MAX);
                if !unexplained.is_empty() {
                    differences.push((k.clone(), unexplained));
                }
            }
        }
        if !differences.is_empty() {
            let differences = self.look_again(&differences, Which::After(0), "before a second look").await?;
            if !differences.is_empty() {
                self.detail.differences.clone_from(&differences);
                return Err(Error::Verify { id, shard, differences });
            }
        }
        let compared_ms = ms(started.elapsed());
        let rounds = self.rounds(&src_keyed).await?;
        let verified_round = i32::try_from(rounds.len()).unwrap_or(i32::MAX);
        self.detail.precheck = Some(Precheck {
            tables,
            source_triggers: src_triggers,
            target_triggers: dst_triggers,
            in_flight,
            ms: ms(started.elapsed()),
            rounds,
            verified_round,
        });
        // Journaled before the fence: a verification inside the fence relies only on a
        // comparison the journal holds.
        let detail = self.detail_json()?;
        let j = catalog_bounded(
            self.id,
            self.options.hung_after,
            "journal the comparison",
            journal::write_detail(&self.catalog, self.id, &detail, true),
        )
        .await?;
        if j != 1 {
            return Err(Error::Journal {
                id,
                message: "it is no longer running (aborted by another shardline?)".into(),
            });
        }
        tracing::info!(
            id,
            compared_ms,
            ms = ms(started.elapsed()),
            in_flight,
            verified_round,
            "compared the shard before the fence"
        );
        if let Some(hook) = &self.options.on_compared {
            hook().await;
        }
        Ok(())
    }

    /// A second look at keys that differed and are in no change log, before failing the
    /// move for them: once the target has everything the source committed before a new
    /// marker, they are read again on both sides, in snapshots taken at once. A row still
    /// on its way when they were first read (the apply behind, on a loaded machine) is
    /// equal now, or differs and is logged since (`which`); a key that still differs and
    /// is in no log is a copy that differs. Returns a line per table for those.
    async fn look_again(
        &mut self,
        unexplained: &[(Keyed, Vec<String>)],
        which: Which,
        why: &str,
    ) -> Result<Vec<String>> {
        let (source, target, id) = (self.source.clone(), self.target.clone(), self.id);
        let schema = self.schema.as_str().to_owned();
        self.new_mark(Instant::now() + self.options.sync_timeout, why).await?;
        self.src().await?;
        self.dst().await?;
        let (Some(src), Some(dst)) = (self.src.as_ref(), self.dst.as_ref()) else {
            return Err(Error::Busy);
        };
        let begin = &format!("{TEXT_SETTINGS}; BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY");
        futures::try_join!(
            async { src.batch_execute(begin).await.map_err(on(&source, "take a snapshot")) },
            async { dst.batch_execute(begin).await.map_err(on(&target, "take a snapshot")) }
        )?;
        let read = async {
            let mut differ = Vec::new();
            for (k, keys) in unexplained {
                let list = json_array(keys.iter());
                let (a, b) = futures::try_join!(
                    rows_by_key(src, &source, &schema, k, &list),
                    rows_by_key(dst, &target, &schema, k, &list)
                )?;
                let d = differing(&a, &b);
                if !d.is_empty() {
                    differ.push((k, d));
                }
            }
            Ok::<_, Error>(differ)
        }
        .await;
        let _ = futures::join!(src.batch_execute("COMMIT"), dst.batch_execute("COMMIT"));
        let differ = read?;
        let first: usize = unexplained.iter().map(|(_, keys)| keys.len()).sum();
        if differ.is_empty() {
            tracing::warn!(
                id,
                keys = first,
                "keys that differed, in no change log, are equal at a second look"
            );
            return Ok(Vec::new());
        }
        let keyed: Vec<Keyed> = differ.iter().map(|(k, _)| (*k).clone()).collect();
        let (la, lb) = futures::try_join!(
            read_log(src, &source, &schema, id, &keyed, which),
            read_log(dst, &target, &schema, id, &keyed, which)
        )?;
        let mut lines = Vec::new();
        for (k, d) in &differ {
            let truncated = la.truncated.contains(&k.table) || lb.truncated.contains(&k.table);
            let logged = |key: &String| {
                truncated
                    || la.keys.get(&k.table).is_some_and(|s| s.contains(key))
                    || lb.keys.get(&k.table).is_some_and(|s| s.contains(key))
            };
            let still: Vec<&str> =
                d.iter().filter(|(key, _)| !logged(key)).map(|(_, shown)| shown.as_str()).collect();
            if !still.is_empty() {
                let cols: Vec<&str> = k.cols.iter().map(|c| c.0.as_str()).collect();
                let shown: Vec<&str> = still.iter().take(20).copied().collect();
                lines.push(format!(
                    "{}: {} differing key(s) ({}): {}",
                    k.table,
                    still.len(),
                    cols.join(", "),
                    shown.join(", ")
                ));
            }
        }
        Ok(lines)
    }

    /// The rounds after the comparison, outside the fence, like a live migration's
    /// pre-copy rounds: round `n` takes the keys logged so far (marks them `round =
    /// n`, on both sides), waits for the target to catch up to a marker, and reads them
    /// on both sides in snapshots taken at once. A key whose rows are equal there is
    /// verified as of its last write taken; one that differs is a row in flight: logged
    /// again since the round began, or else put back into the log (taken on one side
    /// only, its write not yet visible on the other), it is taken by the next round or
    /// read inside the fence. Every key a round reads is logged, so a round never fails
    /// the move: a copy that differs where nothing was written is the comparison's to
    /// find, and a logged key the fence's. The
    /// rounds go on until the keys logged since the last one began are at most
    /// `round_keys`, or `max_rounds` ran (see [`MoveOptions`]). Returns them, in order.
    pub(super) async fn rounds(&mut self, keyed: &[Keyed]) -> Result<Vec<Round>> {
        let (source, target, id) = (self.source.clone(), self.target.clone(), self.id);
        let schema = self.schema.as_str().to_owned();
        let mut out = Vec::new();
        for n in 1..=self.options.max_rounds.max(1) {
            let started = Instant::now();
            let take = "UPDATE shardline.move_changes SET round = $2
                         WHERE move_id = $1 AND key IS NOT NULL AND round IS NULL";
            self.dst().await?.execute(take, &[&id, &n]).await.map_err(on(&target, "take a round's keys"))?;
            self.src().await?.execute(take, &[&id, &n]).await.map_err(on(&source, "take a round's keys"))?;
            if let Some(hook) = &self.options.on_round {
                hook().await;
            }
            // Everything the source committed before it took its keys is on the target.
            self.new_mark(Instant::now() + self.options.sync_timeout, "before a round").await?;
            self.src().await?;
            self.dst().await?;
            let (Some(src), Some(dst)) = (self.src.as_ref(), self.dst.as_ref()) else {
                return Err(Error::Busy);
            };
            let utc = TEXT_SETTINGS;
            futures::try_join!(
                async { src.batch_execute(utc).await.map_err(on(&source, "set the time zone")) },
                async { dst.batch_execute(utc).await.map_err(on(&target, "set the time zone")) }
            )?;
            let (ta, tb) = futures::try_join!(
                read_log(src, &source, &schema, id, keyed, Which::Round(n)),
                read_log(dst, &target, &schema, id, keyed, Which::Round(n))
            )?;
            let begin = &format!("{TEXT_SETTINGS}; BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY");
            futures::try_join!(
                async { src.batch_execute(begin).await.map_err(on(&source, "take a snapshot")) },
                async { dst.batch_execute(begin).await.map_err(on(&target, "take a snapshot")) }
            )?;
            let read = async {
                let mut differ = Vec::new();
                let mut keys = 0;
                for k in keyed {
                    let mut set: HashSet<&String> = ta.keys.get(&k.table).into_iter().flatten().collect();
                    set.extend(tb.keys.get(&k.table).into_iter().flatten());
                    if set.is_empty() {
                        continue;
                    }
                    keys += i64::try_from(set.len()).unwrap_or(i64::MAX);
                    let list = json_array(set.into_iter());
                    let (a, b) = futures::try_join!(
                        rows_by_key(src, &source, &schema, k, &list),
                        rows_by_key(dst, &target, &schema, k, &list)
                    )?;
                    let d = differing(&a, &b);
                    if !d.is_empty() {
                        differ.push((k, d));
                    }
                }
                Ok::<_, Error>((keys, differ))
            }
            .await;
            let _ = futures::join!(src.batch_execute("COMMIT"), dst.batch_execute("COMMIT"));
            let (keys, differ) = read?;
            // Logged since the round took its keys (read after the snapshots): a
            // differing key must be there; their number decides whether to go on.
            let (la, lb) = futures::try_join!(
                read_log(src, &source, &schema, id, keyed, Which::After(n)),
                read_log(dst, &target, &schema, id, keyed, Which::After(n))
            )?;
            let mut in_flight = 0;
            let mut requeued = 0;
            for (k, d) in &differ {
                let truncated = la.truncated.contains(&k.table) || lb.truncated.contains(&k.table);
                let logged = |key: &String| {
                    truncated
                        || la.keys.get(&k.table).is_some_and(|s| s.contains(key))
                        || lb.keys.get(&k.table).is_some_and(|s| s.contains(key))
                };
                let unexplained: Vec<&String> = d.keys().filter(|key| !logged(key)).collect();
                in_flight += i64::try_from(d.len()).unwrap_or(i64::MAX);
                if !unexplained.is_empty() {
                    // Taken by this round on one side only while the other had not yet
                    // made its write visible (a commit is sent to the target before the
                    // source's own sessions see it): a row in flight all the same. Every
                    // key a round reads is logged, so nothing here is the comparison's
                    // business: each key is logged anew (a row with `round` NULL, on
                    // both hosts, rendered as `read_log` reads it back), for a later
                    // round or the fence, which reads it on both sides once synced.
                    // Inserted, not matched: a stored key rendered in another session's
                    // TimeZone (a timestamptz key) would not match, and the key would
                    // be skipped by the fence.
                    let list = json_array(unexplained.iter().copied());
                    let again = "INSERT INTO shardline.move_changes (move_id, tbl, key)
                                 SELECT $1, $2, value FROM jsonb_array_elements($3::text::jsonb)";
                    let (a, b) = futures::try_join!(
                        async {
                            src.execute(again, &[&id, &k.table, &list])
                                .await
                                .map_err(on(&source, "log a round's keys again"))
                        },
                        async {
                            dst.execute(again, &[&id, &k.table, &list])
                                .await
                                .map_err(on(&target, "log a round's keys again"))
                        }
                    )?;
                    let want = u64::try_from(unexplained.len()).unwrap_or(u64::MAX);
                    if a != want || b != want {
                        return Err(Error::Journal {
                            id,
                            message: format!(
                                "logging {want} key(s) of {} again wrote {a} row(s) on {source} and {b} on {target}",
                                k.table
                            ),
                        });
                    }
                    requeued += unexplained.len();
                }
            }
            if requeued > 0 {
                tracing::info!(
                    id,
                    round = n,
                    keys = requeued,
                    "keys a round took on one side only go back to the log"
                );
            }
            let pending: usize = keyed
                .iter()
                .map(|k| {
                    let mut set: HashSet<&String> = la.keys.get(&k.table).into_iter().flatten().collect();
                    set.extend(lb.keys.get(&k.table).into_iter().flatten());
                    set.len()
                })
                .sum();
            let pending = i64::try_from(pending + requeued).unwrap_or(i64::MAX);
            out.push(Round { keys, in_flight, pending, ms: ms(started.elapsed()) });
            tracing::debug!(id, round = n, keys, in_flight, pending, "a round before the fence");
            if pending <= self.options.round_keys {
                break;
            }
        }
        Ok(out)
    }

    /// Inside the fence: which keyed tables the change logs let the verification
    /// recheck by key, and the keys (distinct, as JSON objects) to recheck in each. A
    /// table is rechecked by key only when the comparison before the fence is journaled,
    /// both logs still hold their sentinel (no crash emptied them), the same triggers
    /// are in place on both sides as when the snapshots were taken, and it was not
    /// TRUNCATEd; any other table is verified in full.
    pub(super) async fn logged_keys(&mut self) -> Result<HashMap<String, (Keyed, HashSet<String>)>> {
        let mut out = HashMap::new();
        if self.options.verification != Verification::ChangeLog {
            return Ok(out);
        }
        let Some(pre) = self.detail.precheck.clone() else {
            return Ok(out);
        };
        let (source, target, id) = (self.source.clone(), self.target.clone(), self.id);
        let (schema, moved) = (self.schema.as_str().to_owned(), self.moved.clone());
        self.src().await?;
        self.dst().await?;
        let (Some(src), Some(dst)) = (self.src.as_ref(), self.dst.as_ref()) else {
            return Err(Error::Busy);
        };
        let has =
            &format!("{TEXT_SETTINGS}; SELECT to_regclass('shardline.move_changes') IS NOT NULL AS has");
        let keyed = keyed_tables(src, &source, &moved).await?;
        let (a, b) = futures::try_join!(
            async { src.simple_query(has).await.map_err(on(&source, "look for the change log")) },
            async { dst.simple_query(has).await.map_err(on(&target, "look for the change log")) }
        )?;
        if !says_true(&a) || !says_true(&b) {
            tracing::warn!(id, "a change log is gone; verifying every row inside the fence");
            return Ok(out);
        }
        let (la, lb, ta, tb) = futures::try_join!(
            read_log(src, &source, &moved, id, &keyed, Which::After(pre.verified_round)),
            read_log(dst, &target, &schema, id, &keyed, Which::After(pre.verified_round)),
            triggers(src, &source, &moved, id),
            triggers(dst, &target, &schema, id)
        )?;
        if !la.sentinel || !lb.sentinel {
            tracing::warn!(
                id,
                "a change log lost its rows (crash recovery?); verifying every row inside the fence"
            );
            return Ok(out);
        }
        for k in keyed {
            let t = &k.table;
            let same = |now: &BTreeMap<String, Vec<u32>>, then: &BTreeMap<String, Vec<u32>>| {
                now.get(t).is_some_and(|v| v.len() == 2) && now.get(t) == then.get(t)
            };
            if !same(&ta, &pre.source_triggers) || !same(&tb, &pre.target_triggers) {
                tracing::warn!(id, table = %t, "the change log's triggers changed since the comparison; verifying the table in full");
                continue;
            }
            if la.truncated.contains(t) || lb.truncated.contains(t) || !pre.tables.contains_key(t) {
                continue;
            }
            let mut keys: HashSet<String> = la.keys.get(t).cloned().unwrap_or_default();
            keys.extend(lb.keys.get(t).cloned().unwrap_or_default());
            out.insert(t.clone(), (k, keys));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(list: &[(&str, i64)]) -> HashMap<String, (String, i64)> {
        list.iter().map(|&(k, h)| (k.to_owned(), (format!("({k})"), h))).collect()
    }

    #[test]
    fn differing_finds_missing_extra_and_changed_rows() {
        let a = rows(&[("1", 10), ("2", 20), ("3", 30)]);
        let b = rows(&[("1", 10), ("2", 21), ("4", 40)]);
        let d: Vec<String> = differing(&a, &b).into_keys().collect();
        assert_eq!(d, ["2", "3", "4"]);
        assert!(differing(&a, &a).is_empty());
    }

    #[test]
    fn buckets_are_powers_of_two_within_bounds() {
        assert_eq!(bucket_mask(0.0), 255);
        assert_eq!(bucket_mask(-1.0), 255);
        assert_eq!(bucket_mask(1_000_000.0), 1023);
        assert_eq!(bucket_mask(3_000_000.0), 4095);
        assert_eq!(bucket_mask(1e12), 16383);
    }

    #[test]
    fn keys_render_quoted() {
        let k = Keyed {
            table: "t".into(),
            cols: vec![
                ("id".into(), KeyType::Global("bigint".into())),
                ("Odd\"".into(), KeyType::Global("text".into())),
                ("m".into(), KeyType::Local("\"Mood\"[]".into())),
            ],
            hashed: vec![("id".into(), true), ("Odd\"".into(), false), ("m".into(), false)],
        };
        assert_eq!(
            k.key_hash("t"),
            "hash_record_extended(ROW(t.\"id\", t.\"Odd\"\"\"::text, t.\"m\"::text), 0)"
        );
        assert_eq!(
            k.row_hash("t"),
            "hash_record_extended(ROW(t.\"id\", t.\"Odd\"\"\"::text, t.\"m\"::text), 0)"
        );
        assert_eq!(k.json("t"), "jsonb_build_object('id', t.\"id\", 'Odd\"', t.\"Odd\"\"\", 'm', t.\"m\")");
        // A type of the shard's own is named in the schema the table lives in there.
        assert_eq!(
            k.record("shard_0001"),
            "k(\"id\" bigint, \"Odd\"\"\" text, \"m\" \"shard_0001\".\"Mood\"[])"
        );
        assert_eq!(
            k.record("shard_0001_moved_7"),
            "k(\"id\" bigint, \"Odd\"\"\" text, \"m\" \"shard_0001_moved_7\".\"Mood\"[])"
        );
        assert_eq!(json_array([r#"{"id": 1}"#.to_owned()].iter()), r#"[{"id": 1}]"#);
    }
}
