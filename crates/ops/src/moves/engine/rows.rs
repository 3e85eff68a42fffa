//! The mover's own initial copy ([`MoveOptions::max_rate`]): the shard's rows read
//! from one snapshot of the source, at a bounded rate, into the target's bare tables,
//! several streams at once; the subscription then starts, without a copy of its own,
//! exactly where that snapshot ends.
//!
//! # Why the snapshot and the slot agree
//!
//! The slot is made first (`subscribe`). Then one session of the source takes, in a
//! `REPEATABLE READ` transaction, `SHARE` locks on the shard's tables: that waits for
//! every transaction writing them to end, and holds new writers. Under those locks it
//! exports its snapshot and reads the WAL insert position `L`. Every change to the
//! shard committed before the locks is in the snapshot and its commit record is below
//! `L`; every change after is committed after the locks are released, so above `L`.
//! The copy streams read that snapshot; once they are done, the slot is moved on to
//! `L` (`pg_replication_slot_advance`), so the subscription sends exactly the
//! transactions that committed after it. The locks are held only until each stream has
//! taken the snapshot: milliseconds, for this shard's writers only.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::{SinkExt, TryStreamExt};

use super::*;

/// A table bigger than this many pages (8 MiB) is copied in ranges of pages of this
/// size (`ctid` ranges, a TID range scan each), several at once.
const RANGE_PAGES: i64 = 1024;

/// How long one attempt at the snapshot's locks waits (at most the move's
/// `lock_timeout`), and how many attempts: the shard's writers queue behind a waiting
/// lock, so the waits are short and many, 100 ms apart.
const SNAPSHOT_LOCK_WAIT: Duration = Duration::from_millis(250);
const SNAPSHOT_LOCK_ATTEMPTS: u32 = 40;

/// How long the session holding the snapshot's locks may sit idle (the mover gone or cut
/// off) before the source ends it and its locks.
const SNAPSHOT_IDLE: Duration = Duration::from_secs(5);

/// The copy's streams pass the rows on in batches of this many bytes.
const BATCH: usize = 64 * 1024;

/// Caps the bytes the copy's streams read from the source at a rate, together: each
/// batch waits for its slot in one schedule, and a stream that stalled (a slow target,
/// a checkpoint) earns no credit to burst with afterwards.
struct Throttle {
    rate: Option<u64>,
    /// When the next batch may go.
    next: Mutex<tokio::time::Instant>,
    sent: AtomicU64,
}

impl Throttle {
    fn new(rate: u64) -> Self {
        Throttle {
            rate: Some(rate).filter(|r| *r > 0),
            next: Mutex::new(tokio::time::Instant::now()),
            sent: AtomicU64::new(0),
        }
    }

    /// Counts `n` more bytes; waits until the rate allows them.
    async fn pass(&self, n: usize) {
        let n = u64::try_from(n).unwrap_or(u64::MAX);
        self.sent.fetch_add(n, Ordering::Relaxed);
        let Some(rate) = self.rate else { return };
        #[expect(clippy::cast_precision_loss, reason = "a duration from byte counts")]
        let takes = Duration::from_secs_f64(n as f64 / rate as f64);
        let at = {
            let mut next = self.next.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let at = (*next).max(tokio::time::Instant::now());
            *next = at + takes;
            at
        };
        tokio::time::sleep_until(at).await;
    }

    fn sent(&self) -> i64 {
        i64::try_from(self.sent.load(Ordering::Relaxed)).unwrap_or(i64::MAX)
    }
}

/// One part of the copy: a table, or a range of its pages.
#[derive(Debug, Clone)]
struct Piece {
    /// The table, schema-qualified and quoted.
    table: String,
    /// Its columns (quoted, generated ones left out), in the source's order.
    columns: String,
    /// Pages `[from, to)` (`to` none: to the end), or the whole table.
    pages: Option<(i64, Option<i64>)>,
    /// `binary` when every column's type is built in; `text` otherwise (a binary array
    /// or composite carries its element type's OID, which differs between servers for
    /// types the migrations made).
    format: &'static str,
}

impl Piece {
    fn read(&self) -> String {
        let range = match self.pages {
            None => String::new(),
            Some((from, None)) => format!(" WHERE ctid >= '({from},0)'::tid"),
            Some((from, Some(to))) => format!(" WHERE ctid >= '({from},0)'::tid AND ctid < '({to},0)'::tid"),
        };
        format!(
            "COPY (SELECT {} FROM ONLY {}{range}) TO STDOUT (FORMAT {})",
            self.columns, self.table, self.format
        )
    }

    fn write(&self) -> String {
        format!("COPY {} ({}) FROM STDIN (FORMAT {})", self.table, self.columns, self.format)
    }
}

/// A connection to `host` for the copy's streams: named as the mover's sessions are
/// (a later mover of the same move ends it), without ending the mover's own.
async fn stream_client(config: &Config, host: &HostName, id: i64) -> Result<Client> {
    let c = host_client(config, host).await?;
    mover_session(&c, host, id).await?;
    // Text `COPY` writes and reads values as these settings say: the same on both sides,
    // and exact (as the subscription's own connections and pg_dump set them).
    c.batch_execute(TEXT_SETTINGS).await.map_err(on(host, "set up the copy's session"))?;
    Ok(c)
}

impl Mover<'_> {
    /// Empties the target's copy of the shard and its marker (nothing reads or writes
    /// them before the flip): before any copy, so a copy cut short and started again
    /// starts from empty tables.
    pub(super) async fn empty_copy(&mut self) -> Result<()> {
        let (target, schema, id) = (self.target.clone(), self.schema.clone(), self.id);
        let dst = self.dst().await?;
        // A partitioned table's TRUNCATE empties every partition: a foreign one's rows
        // are on another server, which both copies share (the pre-flight refuses such a
        // shard; again here, on the copy).
        let foreign: Vec<String> = dst
            .query(FOREIGN_CHILDREN, &[&schema.as_str()])
            .await
            .map_err(on(&target, "look for foreign partitions"))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if !foreign.is_empty() {
            return Err(Error::Host {
                host: target.to_string(),
                what: "empty the copy".into(),
                sqlstate: None,
                message: format!(
                    "{schema} has foreign partitions or children ({}), whose rows live on another server: shardline does not move such a shard",
                    foreign.join(", ")
                ),
            });
        }
        // A plain table alone (`ONLY`: not an inheritance child of it), a partitioned
        // table with its partitions (a foreign key from one names it, and TRUNCATE
        // refuses to empty the referenced table without it; `ONLY` is refused there).
        let tables: Vec<String> = dst
            .query(
                "SELECT CASE c.relkind WHEN 'r' THEN 'ONLY ' ELSE '' END || format('%s.%I', $2::text, c.relname)
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') ORDER BY c.relname",
                &[&schema.as_str(), &schema.quoted()],
            )
            .await
            .map_err(on(&target, format!("list the tables of {schema}")))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let truncate =
            if tables.is_empty() { String::new() } else { format!("TRUNCATE {};", tables.join(", ")) };
        dst.batch_execute(&format!(
            "BEGIN; {truncate} DELETE FROM shardline.move_marks WHERE move_id = {id}; COMMIT"
        ))
        .await
        .map_err(on(&target, "empty the copy"))
    }

    /// Copies the shard's rows and its marker from one snapshot of the source (see the
    /// module's docs), at most `max_rate` bytes a second, then moves the slot on to
    /// where that snapshot ends. The target's tables are empty (see
    /// [`Mover::empty_copy`]) and the slot made.
    pub(super) async fn copy_rows(&mut self, max_rate: u64) -> Result<()> {
        let (source, target, schema, id, name) =
            (self.source.clone(), self.target.clone(), self.schema.clone(), self.id, self.name());
        let pieces = self.pieces().await?;
        let total = self.detail.bytes;
        let tables = i64::try_from(pieces.iter().filter(|p| p.pages.is_none_or(|(f, _)| f == 0)).count())
            .unwrap_or(i64::MAX);
        let workers = pieces.len().clamp(1, self.options.copy_streams.max(1));
        // The streams' connections first, so the locks below are held only while they
        // take the snapshot.
        let mut streams = Vec::with_capacity(workers);
        for _ in 0..workers {
            let dst = stream_client(self.config, &target, id).await?;
            // As the subscription's own copy and its apply: no trigger, no foreign key
            // check (the tables are copied one by one, in any order).
            dst.batch_execute("SET session_replication_role = replica")
                .await
                .map_err(on(&target, "set up the copy's session"))?;
            streams.push((stream_client(self.config, &source, id).await?, dst));
        }
        let lock_sql = {
            let locked = tables_of(self.src().await?, &source, schema.as_str(), &schema.quoted()).await?;
            // A mover cut off between the locks and their release must not hold the
            // shard's writers for longer than that: the source ends the session.
            let lock = if locked.is_empty() {
                String::new()
            } else {
                format!("; LOCK TABLE {} IN SHARE MODE", locked.join(", "))
            };
            format!(
                "BEGIN ISOLATION LEVEL REPEATABLE READ; SET LOCAL lock_timeout = '{}ms';
                 SET LOCAL idle_in_transaction_session_timeout = '{}ms'{lock}",
                self.options.lock_timeout.min(SNAPSHOT_LOCK_WAIT).as_millis(),
                SNAPSHOT_IDLE.as_millis()
            )
        };
        let snap = stream_client(self.config, &source, id).await?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match snap.batch_execute(&lock_sql).await {
                Ok(()) => break,
                Err(e) => {
                    let err = host_err(&source, "lock the shard's tables for the copy's snapshot", &e);
                    // A session that cannot roll back is lost: the lock's error says why.
                    if snap.batch_execute("ROLLBACK").await.is_err()
                        || !is_lock_conflict(&err)
                        || attempt >= SNAPSHOT_LOCK_ATTEMPTS
                    {
                        return Err(err);
                    }
                    tracing::debug!(
                        move_id = id,
                        attempt,
                        "the shard's tables were busy; taking the copy's snapshot again"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        let row = snap
            .query_one(
                "SELECT pg_export_snapshot(), pg_current_wal_insert_lsn()::text,
                        (SELECT n FROM shardline.move_marks WHERE move_id = $1)",
                &[&id],
            )
            .await
            .map_err(on(&source, "export the copy's snapshot"))?;
        let (snapshot, lsn, mark): (String, String, Option<i64>) = (row.get(0), row.get(1), row.get(2));
        let take = format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SET TRANSACTION SNAPSHOT {}",
            quote_literal(&snapshot)
        );
        for (src, _) in &streams {
            src.batch_execute(&take).await.map_err(on(&source, "take the copy's snapshot"))?;
        }
        snap.batch_execute("COMMIT").await.map_err(on(&source, "release the shard's tables"))?;
        drop(snap);
        tracing::debug!(move_id = id, %lsn, pieces = pieces.len(), workers, max_rate, "copying the shard's rows from one snapshot");

        let started = Instant::now();
        let throttle = Throttle::new(max_rate);
        let queue = Mutex::new(pieces.into_iter().rev().collect::<Vec<_>>());
        let done = AtomicU64::new(0);
        let progress = self.options.progress.clone();
        let report = |tables_done: u64| {
            if let Some(p) = &progress {
                p(&MoveProgress::Copy {
                    bytes: throttle.sent(),
                    total,
                    tables_done: i64::try_from(tables_done).unwrap_or(i64::MAX).min(tables),
                    tables,
                });
            }
        };
        let runs = streams.iter().map(|(src, dst)| {
            let (queue, throttle, done, report) = (&queue, &throttle, &done, &report);
            let (source, target) = (source.clone(), target.clone());
            async move {
                let mut reported = 0;
                loop {
                    let next = queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
                    let Some(piece) = next else { break };
                    let out =
                        src.copy_out(&piece.read()).await.map_err(on(&source, "read the shard's rows"))?;
                    let sink =
                        dst.copy_in(&piece.write()).await.map_err(on(&target, "write the shard's rows"))?;
                    let (mut out, mut sink) = (std::pin::pin!(out), std::pin::pin!(sink));
                    // The source sends a message per row: they go on in batches (one
                    // write, one pass of the throttle, each).
                    let mut batch = bytes::BytesMut::with_capacity(BATCH);
                    loop {
                        let chunk = out.try_next().await.map_err(on(&source, "read the shard's rows"))?;
                        if let Some(c) = &chunk {
                            batch.extend_from_slice(c);
                        }
                        if batch.len() >= BATCH || (chunk.is_none() && !batch.is_empty()) {
                            throttle.pass(batch.len()).await;
                            sink.feed(batch.split().freeze())
                                .await
                                .map_err(on(&target, "write the shard's rows"))?;
                            if throttle.sent() - reported >= 1 << 20 {
                                reported = throttle.sent();
                                report(done.load(Ordering::Relaxed));
                            }
                        }
                        if chunk.is_none() {
                            break;
                        }
                    }
                    sink.as_mut().finish().await.map_err(on(&target, "write the shard's rows"))?;
                    if piece.pages.is_none_or(|(_, to)| to.is_none()) {
                        report(done.fetch_add(1, Ordering::Relaxed) + 1);
                    }
                }
                src.batch_execute("COMMIT").await.map_err(on(&source, "end the copy's snapshot"))?;
                Ok::<(), Error>(())
            }
        });
        futures::future::try_join_all(runs).await?;
        drop(streams);
        self.detail.rows_copied = Some(RowsCopied {
            bytes: throttle.sent(),
            ms: ms(started.elapsed()),
            max_rate,
            streams: workers,
            lsn: None,
        });

        let dst = self.dst().await?;
        if let Some(n) = mark {
            dst.execute(
                "INSERT INTO shardline.move_marks (move_id, n) VALUES ($1, $2)
                 ON CONFLICT (move_id) DO UPDATE SET n = EXCLUDED.n",
                &[&id, &n],
            )
            .await
            .map_err(on(&target, "copy the move's marker"))?;
        }
        // The slot on to where the snapshot ends, so the source can let go of the WAL
        // before it (the subscription's origin, set to `L` once it is made, is what
        // makes it start there). The advance stops at the flush position, which may
        // stand below `L` (another session's records inserted, not yet written out):
        // wait for it, bounded; short of `L` after that is only logged.
        let src = self.src().await?;
        let flushed_by = Instant::now() + Duration::from_secs(10);
        loop {
            let flushed: bool = src
                .query_one("SELECT pg_current_wal_flush_lsn() >= $1::text::pg_lsn", &[&lsn])
                .await
                .map_err(on(&source, "read the flush position"))?
                .get(0);
            if flushed || Instant::now() >= flushed_by {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let behind: bool = src
            .query_opt(
                "SELECT (confirmed_flush_lsn < $2::text::pg_lsn) IS TRUE FROM pg_replication_slots WHERE slot_name = $1",
                &[&name, &lsn],
            )
            .await
            .map_err(on(&source, "look for the replication slot"))?
            .map(|r| r.get(0))
            .ok_or_else(|| Error::Host {
                host: source.to_string(),
                what: "move the slot on to the copy's snapshot".into(),
                sqlstate: None,
                message: format!("replication slot {name} is gone (dropped during the copy?)"),
            })?;
        if behind {
            let at: String = src
                .query_one(
                    "SELECT end_lsn::text FROM pg_replication_slot_advance($1, $2::text::pg_lsn)",
                    &[&name, &lsn],
                )
                .await
                .map_err(on(&source, "move the slot on to the copy's snapshot"))?
                .get(0);
            tracing::debug!(move_id = id, %at, %lsn, "the slot moved on to the copy's snapshot");
        }
        if let Some(r) = self.detail.rows_copied.as_mut() {
            r.lsn = Some(lsn);
        }
        report(u64::try_from(tables).unwrap_or(0));
        Ok(())
    }

    /// The copy's pieces, biggest tables first: each table of the shard's schema on the
    /// source, a big one in ranges of [`RANGE_PAGES`] pages.
    /// Fails, naming the source, when the mover's copy at `max_rate` would need longer
    /// than `copy_timeout` for the shard's tables: every new copy, a resumed or restarted
    /// one too, is checked as [`run`](crate::moves::run)'s pre-flight checks it, before the
    /// copy makes anything.
    pub(super) async fn check_copy_time(&mut self) -> Result<()> {
        let (source, schema) = (self.source.clone(), self.schema.clone());
        let table_bytes: i64 = self
            .src()
            .await?
            .query_one(
                "SELECT coalesce(sum(pg_table_size(c.oid)), 0)::bigint
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND c.relkind = 'r'",
                &[&schema.as_str()],
            )
            .await
            .map_err(on(&source, "read the size of the shard's tables"))?
            .get(0);
        match crate::moves::preflight::copy_time_problem(
            table_bytes,
            self.options.max_rate,
            self.options.copy_timeout,
        ) {
            None => Ok(()),
            Some(message) => Err(Error::Host {
                host: source.to_string(),
                what: "copy the shard's rows".into(),
                sqlstate: None,
                message,
            }),
        }
    }

    async fn pieces(&mut self) -> Result<Vec<Piece>> {
        let (source, schema) = (self.source.clone(), self.schema.clone());
        let rows = self
            .src()
            .await?
            .query(
                "SELECT c.relname::text,
                        -- NULL for a table dropped since the scan's snapshot.
                        coalesce(pg_relation_size(c.oid), 0) / current_setting('block_size')::bigint,
                        array(SELECT a.attname::text FROM pg_attribute a
                               WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                                 AND a.attgenerated = '' ORDER BY a.attnum),
                        coalesce((SELECT bool_and(a.atttypid < 16384) FROM pg_attribute a
                                   WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), true)
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND c.relkind = 'r'
                  ORDER BY 2 DESC, 1",
                &[&schema.as_str()],
            )
            .await
            .map_err(on(&source, "list the shard's tables"))?;
        let mut pieces = Vec::new();
        for r in rows {
            let (name, pages, columns, built_in): (String, i64, Vec<String>, bool) =
                (r.get(0), r.get(1), r.get(2), r.get(3));
            let table = format!("{}.{}", schema.quoted(), quote_ident(&name));
            if columns.is_empty() {
                return Err(Error::Host {
                    host: source.to_string(),
                    what: "copy the shard's rows".into(),
                    sqlstate: None,
                    message: format!(
                        "table {table} has no column to copy; move the shard with --subscription-copy"
                    ),
                });
            }
            let columns = columns.iter().map(|c| quote_ident(c)).collect::<Vec<_>>().join(", ");
            let format = if built_in { "binary" } else { "text" };
            if pages <= RANGE_PAGES {
                pieces.push(Piece { table, columns, pages: None, format });
                continue;
            }
            let mut from = 0;
            while from < pages {
                let to = from + RANGE_PAGES;
                let pages = Some((from, (to < pages).then_some(to)));
                pieces.push(Piece { table: table.clone(), columns: columns.clone(), pages, format });
                from = to;
            }
        }
        Ok(pieces)
    }
}
