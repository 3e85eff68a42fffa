//! The fence and what happens under it before verification: `fenced`, `synced`,
//! `sequence_carried`, and the fence's lease on the source.

use super::*;

impl Mover<'_> {
    /// What the source's marker says of the fence: `None` when it is not fenced
    /// (or has no marker), `Some(decided)` when it is.
    pub(super) async fn fence_decision(&mut self) -> Result<Option<Option<String>>> {
        Ok(self.source_marker().await?.and_then(|(fenced, decided)| fenced.then_some(decided)))
    }

    /// Whether the source decided `undo` for this move while not fenced: an undo
    /// stopped after it unfenced (or found nothing fenced), before the journal said
    /// `undoing`. Such a move can never be fenced again.
    pub(super) async fn undo_decided_unfenced(&mut self) -> Result<bool> {
        Ok(matches!(self.source_marker().await?, Some((false, Some(d))) if d == "undo"))
    }

    /// The source's marker of this move: whether it is fenced, and what it decided;
    /// `None` when there is none.
    pub(super) async fn source_marker(&mut self) -> Result<Option<(bool, Option<String>)>> {
        let (source, id) = (self.source.clone(), self.id);
        let src = self.src().await?;
        let has: bool = src
            .query_one("SELECT to_regclass('shardline.move_marks') IS NOT NULL", &[])
            .await
            .map_err(on(&source, "look for the marker table"))?
            .get(0);
        if !has {
            return Ok(None);
        }
        let row = src
            .query_opt("SELECT fenced, decided FROM shardline.move_marks WHERE move_id = $1", &[&id])
            .await
            .map_err(on(&source, "read the fence's lease"))?;
        let Some(row) = row else { return Ok(None) };
        let read = (|| Ok::<_, tokio_postgres::Error>((row.try_get(0)?, row.try_get(1)?)))();
        Ok(Some(read.map_err(on(&source, "read the fence's lease"))?))
    }

    /// Holds the fence's lease while the shard is fenced and nothing is decided:
    /// renews it once now, then every quarter of it in the background. Fails with
    /// [`Error::LeaseExpired`] when the fence was undone meanwhile.
    pub(super) async fn hold_lease(&mut self) -> Result<()> {
        if self.renewer.is_some() {
            return Ok(());
        }
        let (source, id) = (self.source.clone(), self.id);
        let lost = Error::LeaseExpired { id, shard: self.shard };
        match self.fence_decision().await? {
            None => Ok(()),
            Some(Some(d)) if d == "flip" => Ok(()),
            Some(Some(_)) => Err(lost),
            Some(None) => {
                let lease_ms = i64::try_from(self.options.lease.as_millis()).unwrap_or(i64::MAX);
                let n = self
                    .src()
                    .await?
                    .execute(RENEW_SQL, &[&id, &lease_ms])
                    .await
                    .map_err(on(&source, "renew the fence's lease"))?;
                if n == 0 {
                    return Err(lost);
                }
                self.renewer = Some(Renewer::start(self.config, &source, id, self.options.lease)?);
                Ok(())
            }
        }
    }

    /// Stops writes on the source, in one transaction: lock the shard's tables
    /// (waiting for writes in flight), lock its ID sequence (waiting for every
    /// transaction that minted from it: `next_id()`, `reserve_ids()`) and cap it at its
    /// last value (a caller that looked the sequence up before the rename and waited
    /// behind the fence then fails with 2200H instead of minting), rename its schema
    /// (every later statement, also a prepared one from a router with an old map, fails
    /// with 42P01/3F000 and the router reloads the map), move the ledger rows along,
    /// bump the marker. A lock not had within `lock_timeout`, or a deadlock (a
    /// transaction that minted, then writes a table the fence holds), rolls it all back
    /// and tries again.
    pub(super) async fn fence(&mut self) -> Result<()> {
        let (source, id) = (self.source.clone(), self.id);
        let (schema, moved) = (self.schema.clone(), self.moved.clone());
        let attempts = self.options.fence_attempts.max(1);
        let lock_ms = self.options.lock_timeout.as_millis().max(1);
        let lease_ms = i64::try_from(self.options.lease.as_millis()).unwrap_or(i64::MAX);
        self.fence_started = None;
        self.pause_from = None;
        self.lap_at = None;
        self.detail.pause_steps.clear();
        let (live, fenced) = self.source_schemas().await?;
        let src = self.src().await?;
        let mark = if !live && fenced {
            // Fenced before an interruption, and not journaled: read the fence's mark.
            let n = src
                .query_one("SELECT n FROM shardline.move_marks WHERE move_id = $1 AND fenced", &[&id])
                .await
                .map_err(on(&source, "read the fence marker"))?
                .get(0);
            self.hold_lease().await?;
            // Fenced since before this process: its pause is counted from here.
            self.pause_from = Some(Instant::now());
            n
        } else if live {
            // A fence undone once (its lease ran out) is not tried again.
            if matches!(self.fence_decision().await?, Some(Some(_))) {
                return Err(Error::LeaseExpired { id, shard: self.shard });
            }
            // The whole shard compared while writes go on; the fence then rechecks only
            // what the change logs hold.
            if self.options.verification == Verification::ChangeLog {
                self.compare().await?;
            }
            // The flip's proof, made before the pause: its SHA-256 is journaled with
            // `fenced` (see `decide_flip`).
            let row = self
                .src()
                .await?
                .query_one(TOKEN_SQL, &[])
                .await
                .map_err(on(&source, "make the flip's proof"))?;
            self.flip_token = Some(row.get(0));
            self.detail.flip_check = Some(row.get(1));
            let src = self.src().await?;
            let tables = tables_of(src, &source, schema.as_str(), &schema.quoted()).await?;
            let mut attempt = 1;
            loop {
                let started = Instant::now();
                self.detail.fenced_at_ms = Some(now_ms());
                let src = self.src().await?;
                match fence_once(src, &source, &tables, &schema, &moved, id, lock_ms, lease_ms).await {
                    Ok(fenced) => {
                        if self.options.lose_fence_reply {
                            tracing::warn!(
                                id,
                                "drill: the fence committed; stopping as if its reply was lost"
                            );
                            return Err(Error::Interrupted { id, step: self.step });
                        }
                        self.fence_started = Some(started);
                        self.pause_from = Some(started);
                        self.lap_at = Some(started);
                        self.lap("fence transaction");
                        self.detail.fence_sequence = Some(fenced.last_value);
                        self.detail.sequence_max = Some(fenced.old_max);
                        // The fence's own transaction started the lease, with nothing
                        // decided: renew it from now on, without asking the source.
                        if self.renewer.is_none() {
                            self.renewer =
                                Some(Renewer::start(self.config, &source, id, self.options.lease)?);
                        }
                        self.lap("lease");
                        break fenced.mark;
                    }
                    Err(e) if is_lock_conflict(&e) && attempt < attempts => {
                        tracing::warn!(id, attempt, error = %shardline_repo::error_chain(&e), "fence: the shard's tables or ID sequence are busy; trying again");
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        } else {
            return Err(Error::Journal {
                id,
                message: format!(
                    "neither {schema} nor {moved} is on {source}; the shard's data is not where the journal says"
                ),
            });
        };
        self.detail.fence_mark = Some(mark);
        self.journal(Step::Fenced).await
    }

    /// Waits for the fence's marker on the target.
    pub(super) async fn sync(&mut self) -> Result<()> {
        let mark = match self.detail.fence_mark {
            Some(m) => m,
            None => {
                let (source, id) = (self.source.clone(), self.id);
                self.src()
                    .await?
                    .query_one("SELECT n FROM shardline.move_marks WHERE move_id = $1 AND fenced", &[&id])
                    .await
                    .map_err(on(&source, "read the fence marker"))?
                    .get(0)
            }
        };
        let deadline = Instant::now() + self.options.sync_timeout;
        self.wait_mark(mark, deadline, "after the fence").await?;
        if self.detail.revert.as_ref().is_some_and(|r| r.made) {
            // Where the revert's replication starts: the target now holds everything the
            // source committed (its apply worker wrote it before this position), and no
            // one writes the shard there before the flip. The insert position, not the
            // write position: the apply worker commits asynchronously.
            let target = self.target.clone();
            let lsn: String = self
                .dst()
                .await?
                .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
                .await
                .map_err(on(&target, "read the WAL position"))?
                .get(0);
            if let Some(r) = self.detail.revert.as_mut() {
                r.lsn = Some(lsn);
            }
            self.lap("reverse position");
        }
        self.journal(Step::Synced).await
    }

    /// Sets the target's sequence to at least the source's last value, so the target's
    /// next ID is above every one the source handed out. The fence capped the source's
    /// sequence at that value once no transaction could mint, so it cannot have moved
    /// since: it is read again (the fence's reading is lost if the mover died before
    /// journaling it). A sequence found uncapped (fenced by an older shardline) is
    /// frozen here first, the same way.
    pub(super) async fn carry_sequence(&mut self) -> Result<()> {
        let (source, target) = (self.source.clone(), self.target.clone());
        let moved_seq = format!("{}.shardline_id_seq", quote_ident(&self.moved));
        let seq = format!("{}.shardline_id_seq", self.schema.quoted());
        let lock_ms = self.options.lock_timeout.as_millis().max(1);
        let src = self.src().await?;
        let (mut last, max) = read_sequence(src, &source, &moved_seq).await?;
        if max > last {
            let fail = on(&source, "freeze the ID sequence");
            let frozen = async {
                src.batch_execute(&format!("BEGIN; SET LOCAL lock_timeout = '{lock_ms}ms'"))
                    .await
                    .map_err(&fail)?;
                freeze_sequence(src, &source, &moved_seq).await
            }
            .await;
            let frozen = match frozen {
                Ok(f) => src.batch_execute("COMMIT").await.map_err(&fail).map(|()| f),
                Err(e) => {
                    let _ = src.batch_execute("ROLLBACK").await;
                    Err(e)
                }
            }?;
            last = frozen.0;
            self.detail.sequence_max.get_or_insert(frozen.1);
        }
        if let Some(fenced) = self.detail.fence_sequence {
            if fenced != last {
                tracing::warn!(
                    id = self.id,
                    fenced,
                    now = last,
                    "the source's ID sequence moved after the fence"
                );
            }
            last = last.max(fenced);
        }
        let (moved, schema) = (self.moved.clone(), self.schema.clone());
        let others = other_sequences(self.src().await?, &source, &moved, &schema).await?;
        // The copy's sequence is set above every ID the source handed out and stays
        // capped there (a new copy's was capped where it was made, see `prepare`; a
        // revert's old copy's by the reverted move's fence) until the flip's decision
        // lifts it ([`Mover::lift_cap`], and `MARKS_SQL`'s trigger as the decision
        // reaches the copy): an ID minted from it in the pause (a router a move behind)
        // is one the source could hand out again if the move is undone.
        // A target whose marker table has no such trigger (a move prepared by an older
        // shardline, resumed by this one) has its cap lifted here, as then.
        let seq_literal = quote_literal(&seq);
        let ceiling = copy_ceiling(&self.detail, &self.layout);
        let carry = format!(
            "BEGIN; SET LOCAL lock_timeout = '{lock_ms}ms';
             DO $carry$ DECLARE v bigint; BEGIN
               SELECT greatest({last}, last_value, 1) INTO v FROM {seq};
               IF EXISTS (SELECT FROM pg_trigger WHERE tgname = 'shardline_lift_copy_cap'
                           AND tgrelid = to_regclass('shardline.move_marks')) THEN
                 EXECUTE format('ALTER SEQUENCE %s MAXVALUE %s', {seq_literal}, v);
               ELSE
                 EXECUTE format('ALTER SEQUENCE %s MAXVALUE %s', {seq_literal}, greatest(v, {ceiling}));
               END IF;
               PERFORM setval({seq_literal}::regclass, v, true);
             END $carry$;{others} COMMIT;"
        );
        let dst = self.dst().await?;
        if let Err(e) = dst.batch_execute(&carry).await {
            let _ = dst.batch_execute("ROLLBACK").await;
            return Err(on(&target, "carry the shard's sequences")(e));
        }
        self.detail.sequence = Some(last);
        self.journal(Step::SequenceCarried).await
    }

    /// Lifts the cap the carry left on the copy's ID sequence: the copy is the shard's
    /// from the flip's decision on ([`lift_cap_sql`], to [`copy_ceiling`]).
    pub(super) async fn lift_cap(&mut self) -> Result<()> {
        let target = self.target.clone();
        let lock_ms = self.options.lock_timeout.as_millis().max(1);
        let lift = lift_cap_sql(self.schema.as_str(), copy_ceiling(&self.detail, &self.layout), lock_ms);
        let dst = self.dst().await?;
        if let Err(e) = dst.batch_execute(&lift).await {
            let _ = dst.batch_execute("ROLLBACK").await;
            return Err(on(&target, "lift the ID sequence's cap")(e));
        }
        Ok(())
    }
}

/// The ceiling a flipped copy's ID sequence is lifted to: the layout's, or for a
/// revert's old copy the one its sequence had before the reverted move's fence.
pub(crate) fn copy_ceiling(detail: &Detail, layout: &Layout) -> i64 {
    match &detail.reverts {
        None => layout.max_sequence_value(),
        Some(r) => r.sequence_max.unwrap_or_else(|| layout.max_sequence_value()),
    }
}

/// The SQL, one transaction, that raises the `MAXVALUE` of schema `schema`'s ID sequence
/// to `max`, never lowers it, and does nothing when the schema has none (it was fenced
/// away). Only a sequence capped below `max` is locked (waiting at most `lock_ms`), with
/// the lock a fence takes on it (a no-op `OWNED BY NONE`, as the fence's), and looked at
/// again: a fence that renamed the schema meanwhile capped the sequence under its new
/// name, and that cap is not lifted (the name then no longer found: an error).
pub(crate) fn lift_cap_sql(schema: &str, max: i64, lock_ms: u128) -> String {
    let seq = quote_literal(&format!("{}.shardline_id_seq", quote_ident(schema)));
    let schema = quote_literal(schema);
    format!(
        "BEGIN; SET LOCAL lock_timeout = '{lock_ms}ms';
         DO $lift$ DECLARE s regclass := to_regclass({seq}); BEGIN
           IF s IS NULL OR (SELECT seqmax FROM pg_sequence WHERE seqrelid = s) >= {max} THEN
             RETURN;
           END IF;
           EXECUTE format('ALTER SEQUENCE %s OWNED BY NONE', s);
           IF (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                WHERE c.oid = s) = {schema}
              AND (SELECT seqmax FROM pg_sequence WHERE seqrelid = s) < {max} THEN
             EXECUTE format('ALTER SEQUENCE %s MAXVALUE %s', s, {max});
           END IF;
         END $lift$; COMMIT;"
    )
}

/// The SQL that carries the shard's other sequences (a `serial`, `bigserial` or
/// identity column's, one a migration made) from the source's fenced copy `moved` to
/// `schema` on the target: each where the source's next value is further on (in the
/// sequence's direction) than the target's, to the source's state (`last_value`,
/// `is_called`), so the target never hands out a value the source did. Read after the
/// fence: the shard's tables are locked and then renamed away, so nothing takes their
/// values any more. A sequence the mover may not read fails the move here, before the
/// flip. The ID sequence and the minter's catch-up state are carried apart (or not at
/// all).
async fn other_sequences(
    src: &Client,
    source: &HostName,
    moved: &str,
    schema: &SchemaName,
) -> Result<String> {
    let fail = on(source, "read the shard's sequences");
    let listed = src
        .query(
            "SELECT c.relname::text, p.seqincrement FROM pg_class c
               JOIN pg_namespace n ON n.oid = c.relnamespace JOIN pg_sequence p ON p.seqrelid = c.oid
              WHERE n.nspname = $1 AND c.relkind = 'S'
                AND c.relname NOT IN ('shardline_id_seq', 'shardline_catch_up_due')
              ORDER BY 1",
            &[&moved],
        )
        .await
        .map_err(&fail)?;
    let mut sql = String::new();
    for r in listed {
        let (name, increment): (String, i64) = (r.get(0), r.get(1));
        let state = src
            .query_one(
                &format!("SELECT last_value, is_called FROM {}.{}", quote_ident(moved), quote_ident(&name)),
                &[],
            )
            .await
            .map_err(&fail)?;
        let (last, called): (i64, bool) = (state.get(0), state.get(1));
        // The next value each side would hand out, as numeric (no overflow at the ends).
        let next = i128::from(last) + if called { i128::from(increment) } else { 0 };
        let further = if increment > 0 { "<" } else { ">" };
        let seq = format!("{}.{}", schema.quoted(), quote_ident(&name));
        sql.push_str(&format!(
            "\nSELECT setval({}::regclass, {last}, {called}) FROM {seq} AS t
              WHERE t.last_value::numeric + CASE WHEN t.is_called THEN {increment} ELSE 0 END {further} {next};",
            quote_literal(&seq),
        ));
    }
    Ok(sql)
}

/// The flip's proof (a random token) and its SHA-256, made on the source.
pub(super) const TOKEN_SQL: &str = "SELECT t, encode(sha256(convert_to(t, 'UTF8')), 'hex')
   FROM (SELECT gen_random_uuid()::text || gen_random_uuid()::text AS t) AS s";

/// Renews the fence's lease on the source: `UPDATE` of the marker row, only while
/// nothing is decided. `$2` is the lease in ms.
pub(super) const RENEW_SQL: &str =
    "UPDATE shardline.move_marks SET lease_until = clock_timestamp() + $2::bigint * interval '1 millisecond'
  WHERE move_id = $1 AND fenced AND decided IS NULL";

/// The task that renews the fence's lease every quarter of it, on a connection of its
/// own (the mover's session may be inside a transaction). Dropped, it stops: a mover
/// that dies or gives up stops renewing, and the lease runs out.
pub(super) struct Renewer {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Renewer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Renewer {
    pub(super) fn start(config: &Config, source: &HostName, id: i64, lease: Duration) -> Result<Renewer> {
        let url = config
            .hosts
            .iter()
            .find(|h| h.name == *source)
            .map(|h| h.url.clone())
            .ok_or_else(|| Error::HostMissing { host: source.clone(), shards: 0 })?;
        let source = source.clone();
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        let every = (lease / 4).max(Duration::from_millis(50));
        let task = tokio::spawn(async move {
            let mut client: Option<Client> = None;
            loop {
                tokio::time::sleep(every).await;
                if client.as_ref().is_none_or(Client::is_closed) {
                    client = connect(&url, &format!("host {source}")).await.ok();
                }
                let Some(c) = client.as_ref() else {
                    tracing::warn!(id, host = %source, "cannot reach the source to renew the fence's lease");
                    continue;
                };
                match c.execute(RENEW_SQL, &[&id, &lease_ms]).await {
                    Ok(0) => {
                        tracing::warn!(id, host = %source, "the fence's lease is decided or gone; no longer renewing it");
                        return;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(id, host = %source, error = %shardline_repo::error_chain(&e), "cannot renew the fence's lease");
                        client = None;
                    }
                }
            }
        });
        Ok(Renewer { task })
    }
}

/// What one fence transaction did.
pub(super) struct Fenced {
    /// The marker's value.
    mark: i64,
    /// The source sequence's last value, now its MAXVALUE.
    last_value: i64,
    /// Its MAXVALUE before.
    old_max: i64,
}

/// Inside the caller's transaction: waits for every transaction that minted from
/// sequence `seq` (a qualified, quoted name) to end, reads its last value and caps it
/// there, so no transaction mints from it until the cap is lifted. Returns the last
/// value and the MAXVALUE it had.
///
/// `nextval` holds the sequence's ROW EXCLUSIVE lock to the end of its transaction, and
/// `LOCK TABLE` refuses sequences; a no-op `ALTER SEQUENCE ... OWNED BY NONE` takes
/// SHARE ROW EXCLUSIVE, which conflicts with it (the same trick as the minter's
/// catch-up). Once it is granted `last_value` cannot move; the cap then makes every
/// later `nextval`/`setval` past it fail (2200H/22003), also one from a caller that
/// resolved the sequence before the schema was renamed.
pub(super) async fn freeze_sequence(src: &Client, source: &HostName, seq: &str) -> Result<(i64, i64)> {
    let fail = on(source, "freeze the ID sequence");
    src.batch_execute(&format!("ALTER SEQUENCE {seq} OWNED BY NONE")).await.map_err(&fail)?;
    let (mut last, max) = read_sequence(src, source, seq).await?;
    if max > last {
        if last < 1 {
            // A shard that never minted (the minter's install runs no catch-up): its
            // sequence is at MINVALUE (0), and a MAXVALUE must exceed it. Nobody can
            // take a value while this transaction holds the sequence's lock, so moving
            // it to 1 first hands nothing out twice.
            src.query_one("SELECT setval($1::text::regclass, 1)", &[&seq]).await.map_err(&fail)?;
            last = 1;
        }
        src.batch_execute(&format!("ALTER SEQUENCE {seq} MAXVALUE {last}")).await.map_err(&fail)?;
    }
    Ok((last, max))
}

/// Sequence `seq`'s (a qualified, quoted name) last value and MAXVALUE.
pub(super) async fn read_sequence(c: &Client, host: &HostName, seq: &str) -> Result<(i64, i64)> {
    let row = c
        .query_one(
            &format!(
                "SELECT s.last_value, p.seqmax FROM {seq} AS s, pg_sequence AS p WHERE p.seqrelid = $1::text::regclass"
            ),
            &[&seq],
        )
        .await
        .map_err(on(host, "read the ID sequence"))?;
    Ok((row.get(0), row.get(1)))
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn fence_once(
    src: &Client,
    source: &HostName,
    tables: &[String],
    schema: &SchemaName,
    moved: &str,
    id: i64,
    lock_ms: u128,
    lease_ms: i64,
) -> Result<Fenced> {
    let fail = on(source, "fence the shard");
    let result = async {
        src.batch_execute(&format!("BEGIN; SET LOCAL lock_timeout = '{lock_ms}ms'")).await.map_err(&fail)?;
        // The tables first: a transaction that writes them takes their lock before it
        // mints (DEFAULT next_id()), so this order only meets one that minted in an
        // earlier statement and writes now: a deadlock Postgres breaks by ending one of
        // the two (the fence then tries again).
        if !tables.is_empty() {
            src.batch_execute(&format!("LOCK TABLE {} IN EXCLUSIVE MODE", tables.join(", ")))
                .await
                .map_err(&fail)?;
        }
        let seq = format!("{}.shardline_id_seq", schema.quoted());
        let (last_value, old_max) = freeze_sequence(src, source, &seq).await?;
        src.batch_execute(&format!(
            "ALTER SCHEMA {} RENAME TO {};
             UPDATE shardline.shard_migrations SET schema_name = {} WHERE schema_name = {}",
            schema.quoted(),
            quote_ident(moved),
            quote_literal(moved),
            quote_literal(schema.as_str())
        ))
        .await
        .map_err(&fail)?;
        // The lease starts with the fence, with what undoing it needs.
        let n: i64 = src
            .query_opt(
                "UPDATE shardline.move_marks SET n = n + 1, fenced = true, decided = NULL,
                        lease_until = clock_timestamp() + $2::bigint * interval '1 millisecond',
                        schema_name = $3, moved_schema = $4, sequence_max = $5
                  WHERE move_id = $1 AND decided IS NULL RETURNING n",
                &[&id, &lease_ms, &schema.as_str(), &moved, &old_max],
            )
            .await
            .map_err(&fail)?
            .ok_or_else(|| Error::Journal {
                id,
                message: format!("{source} has no undecided marker for this move, so it cannot be fenced"),
            })?
            .get(0);
        src.batch_execute("COMMIT").await.map_err(&fail)?;
        Ok(Fenced { mark: n, last_value, old_max })
    };
    match result.await {
        Ok(f) => Ok(f),
        Err(e) => {
            let _ = src.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}
