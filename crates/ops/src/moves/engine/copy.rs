//! Building the target and copying: `prepared`, `copying`, `caught_up` (the schema from
//! the migrations, the privileges, the subscription, the deferred indexes, the markers).

use super::*;
use shardline_repo::REVERT_GUARD;

impl Mover<'_> {
    /// Builds the schema on the target; publishes it on the source.
    pub(super) async fn prepare(&mut self) -> Result<()> {
        let migrations = load_dir(&self.config.migrations)?;
        // Every catalog call of a step is bounded: a frozen catalog fails the step (the
        // move stays journaled where it was) instead of holding the move's lock.
        let map = catalog_bounded(self.id, self.options.hung_after, "read the map", async {
            Ok(self.catalog.map().await?)
        })
        .await?;
        let (schema, target, id, name) = (self.schema.clone(), self.target.clone(), self.id, self.name());
        let layout = self.layout;
        let shard = self.shard;
        let prefix = self.config.schema_prefix.clone();
        let config = self.config;
        let lock_timeout = self.options.lock_timeout;
        let reverts = self.detail.reverts.clone();
        // The source's shard must have this version's live check (`migrate` installs
        // it): the copy gets it, and carrying privileges from a source without it would
        // revoke the copy's `EXECUTE` on it for good.
        let source = self.source.clone();
        let live = format!("{}.{}()", schema.quoted(), shardline_repo::LIVE_CHECK);
        let has_live: bool = self
            .src()
            .await?
            .query_one("SELECT to_regprocedure($1) IS NOT NULL", &[&live])
            .await
            .map_err(on(&source, "look for the shard's live check"))?
            .get(0);
        if !has_live {
            return Err(Error::Fleet {
                host: source,
                message: format!(
                    "shard {shard} ({schema}) has no {}(): run `shardline migrate` of this version before moving shards",
                    shardline_repo::LIVE_CHECK
                ),
            });
        }
        let dst = self.dst().await?;
        dst.batch_execute(&format!("{HOST_LEDGER_SQL}\n{MARKS_SQL}"))
            .await
            .map_err(on(&target, "create the ledger"))?;
        install_resolve(dst, &target).await?;
        let exists: bool = dst
            .query_one("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", &[&schema.as_str()])
            .await
            .map_err(on(&target, "look for the schema"))?
            .get(0);
        if let Some(r) = &reverts {
            if !exists {
                let there: bool = dst
                    .query_one(
                        "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)",
                        &[&r.old_schema],
                    )
                    .await
                    .map_err(on(&target, "look for the old copy"))?
                    .get(0);
                if !there {
                    return Err(Error::Host {
                        host: target.to_string(),
                        what: "reopen the old copy".into(),
                        sqlstate: None,
                        message: format!("neither {} nor {schema} is there (dropped by `gc`?)", r.old_schema),
                    });
                }
                // Again under the move's lock, before the old copy is touched: a migration
                // may have run, or `gc` dropped the reverse side, since `revert` asked.
                self.src().await?;
                self.dst().await?;
                let (Some(src), Some(dst)) = (self.src.as_ref(), self.dst.as_ref()) else {
                    return Err(Error::Busy);
                };
                let sides = Sides { old: dst, old_host: &target, new: src, new_host: &self.source };
                check_reverse(&sides, &r.old_schema, schema.as_str(), &name, &r.lsn)
                    .await?
                    .map_err(|reason| Error::NotRevertible { shard, reason })?;
                reopen_old_copy(dst, &target, &r.old_schema, &schema, id).await?;
            }
        } else if !exists {
            // The copy is built from the config's files: the source's shard must still
            // be at their level (a resumed move ran no pre-flight, and the files may
            // have changed since the move started; `migrate` waits for moves).
            let source = self.source.clone();
            let src = self.src().await?;
            if let Some(problem) = preflight::off_level(src, &source, &schema, &migrations).await? {
                return Err(Error::Fleet {
                    host: source,
                    message: format!(
                        "{problem}: the move cannot build its copy; put the migrations directory back as it \
                         was when the move started and resume it, or abort it (`shardline move {shard} --abort`)"
                    ),
                });
            }
            let dst = self.dst().await?;
            // One transaction: the schema, its minter, every migration, the ledger.
            let work = ShardWork {
                shard,
                schema: schema.clone(),
                create_schema: true,
                minter: Some(converge::minter_sql(layout, &schema, shard, config.minter)?),
                migrations: (0..migrations.len()).collect(),
                grants: Some(grants::shard_grants(&schema, &config.app_roles)).filter(|g| !g.is_empty()),
                // Guarded in the same transaction (again below, for a resumed move):
                // committed unguarded, the empty copy took a router's write (lost with
                // the copy) or answered its read, for as long as the indexes' drops and
                // the sequence's cap took.
                hold: if reverts.is_none() { Some(guard_sql(schema.as_str(), id)) } else { None },
            };
            let shard_timeout = crate::Options::default().shard_timeout;
            let inputs = Inputs {
                map: &map,
                prefix: &prefix,
                layout,
                minter: config.minter,
                migrations: &migrations,
                roles: &config.app_roles,
                lock_timeout,
                shard_timeout,
            };
            converge::shared_minter(dst, &target, &format!("shard {shard} ({schema})")).await?;
            converge::apply_shard(dst, &target, &work, &inputs).await?;
            // The copy is faster into bare tables: secondary indexes (those no constraint
            // owns) are built once the copy is done (see `catch_up`).
            let drops: Vec<String> = dst
                .query(SECONDARY_INDEXES, &[&schema.as_str()])
                .await
                .map_err(on(&target, "list the indexes"))?
                .iter()
                .map(|r| format!("DROP INDEX {}.{};", schema.quoted(), quote_ident(r.get(0))))
                .collect();
            if !drops.is_empty() {
                dst.batch_execute(&drops.concat()).await.map_err(on(&target, "defer the indexes"))?;
            }
        }
        if reverts.is_none() {
            // No ID is minted from the copy before its sequence is carried: capped where
            // it stands (again on a resumed move). `reserve_ids()` or `next_id()` called
            // through a router a move behind would hand out values the source hands out
            // too (its writes are guarded, below). `carry_sequence` sets it above the
            // source's and keeps it capped; the flip's decision lifts the cap.
            let seq = ShardSql::new(layout, schema.as_str(), u32::from(shard.get()))?.sequence();
            self.dst()
                .await?
                .batch_execute(&format!(
                    "DO $cap$ DECLARE last bigint; BEGIN
                       -- Called, at 1 at least (MAXVALUE must exceed MINVALUE, 0): the next
                       -- nextval fails.
                       SELECT greatest(last_value, 1) INTO last FROM {seq};
                       PERFORM setval({seq_literal}, last, true);
                       EXECUTE format('ALTER SEQUENCE %s MAXVALUE %s', {seq_literal}, last);
                     END $cap$",
                    seq_literal = quote_literal(&seq)
                ))
                .await
                .map_err(on(&target, "cap the copy's ID sequence"))?;
            // Not the shard's until the flip: a router whose map is a move or more behind
            // (it heard of no move) must not write here, where the copy would empty or
            // undo what it wrote. Again on a resumed move (a guard made then is kept).
            guard_copy(self.dst().await?, &target, &schema, id).await?;
        }
        // The source's privileges, hand-made ones too, before anything is published
        // (and again right before the flip, for any granted meanwhile).
        self.carry_privileges(self.schema.as_str().to_owned()).await?;
        let source = self.source.clone();
        let src = self.src().await?;
        // Guards on the source's live schema are an earlier move's, left to `gc` (see
        // `clean`): the shard is the source's, and a fence renaming the schema would hide
        // them from `gc` while an undo could bring them back without their marker.
        drop_guards(src, &source, schema.as_str()).await?;
        src.batch_execute(MARKS_SQL).await.map_err(on(&source, "create the marker table"))?;
        install_resolve(src, &source).await?;
        src.execute("INSERT INTO shardline.move_marks (move_id) VALUES ($1) ON CONFLICT DO NOTHING", &[&id])
            .await
            .map_err(on(&source, "write the move's marker"))?;
        let published: bool = src
            .query_one("SELECT EXISTS (SELECT FROM pg_publication WHERE pubname = $1)", &[&name])
            .await
            .map_err(on(&source, "look for the publication"))?
            .get(0);
        // A revert's publication is the reverse one, made before the reverted move's
        // fence: one made now would not be there for the changes since the flip.
        if !published && reverts.is_some() {
            return Err(reverse_gone(&source, &name));
        }
        if !published {
            src.batch_execute(&format!(
                "CREATE PUBLICATION {} FOR TABLES IN SCHEMA {}, TABLE shardline.move_marks WHERE (move_id = {id})",
                quote_ident(&name),
                schema.quoted()
            ))
            .await
            .map_err(on(&source, "create the publication"))?;
        }
        self.journal(Step::Prepared).await
    }

    /// Makes the target's privileges on the shard's schema, tables, sequences, columns
    /// and routines those of the source, where the schema is called `source_schema`
    /// (its own name before the fence, the fence's after). Idempotent.
    pub(super) async fn carry_privileges(&mut self, source_schema: String) -> Result<()> {
        let (source, target, schema) = (self.source.clone(), self.target.clone(), self.schema.clone());
        self.src().await?;
        self.dst().await?;
        let (Some(src), Some(dst)) = (self.src.as_ref(), self.dst.as_ref()) else {
            return Err(Error::Busy);
        };
        grants::carry(src, &source, &source_schema, dst, &target, &schema).await.map(drop)
    }

    /// Subscribes the target to the source, disabled; journals the subscription's OID
    /// (it names the table-sync slots) before enabling it in the next step.
    pub(super) async fn subscribe(&mut self) -> Result<()> {
        let name = self.name();
        let target = self.target.clone();
        let peer = self
            .config
            .hosts
            .iter()
            .find(|h| h.name == self.source)
            .map(|h| h.peer_url.expose().to_owned())
            .ok_or_else(|| Error::HostMissing { host: self.source.clone(), shards: 0 })?;
        // The slot first, made on the source by a session that holds no transaction
        // ID. Left to CREATE SUBSCRIPTION, it would be made while the target's DDL
        // transaction waits; two moves in opposite directions would then each wait for
        // the other's transaction to end (a slot waits for every running one).
        let source = self.source.clone();
        let find = "SELECT oid::bigint FROM pg_subscription WHERE subname = $1";
        let mut oid = self
            .dst()
            .await?
            .query_opt(find, &[&name])
            .await
            .map_err(on(&target, "look for the subscription"))?;
        // Where the subscription starts, when not at the slot's own start: a revert's
        // reverse slot, where the new owner's writes begin; the mover's copy, where its
        // snapshot ends.
        let mut start_at: Option<String> = None;
        let copy = if let Some(r) = self.detail.reverts.clone() {
            // The reverse slot, kept since the reverted move's fence: moved on to where
            // the new owner's own writes begin (what came before is the old copy's).
            let src = self.src().await?;
            let behind: bool = src
                .query_opt(
                    "SELECT (confirmed_flush_lsn < $2::text::pg_lsn) IS TRUE FROM pg_replication_slots WHERE slot_name = $1",
                    &[&name, &r.lsn],
                )
                .await
                .map_err(on(&source, "look for the reverse slot"))?
                .ok_or_else(|| reverse_gone(&source, &name))?
                .get(0);
            if behind {
                src.execute("SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)", &[&name, &r.lsn])
                    .await
                    .map_err(on(&source, "advance the reverse slot"))?;
            }
            start_at = Some(r.lsn.clone());
            false
        } else if oid.is_some() {
            // Made already (the copy it needs, if the mover's, was done before it).
            start_at = self.detail.rows_copied.as_ref().and_then(|r| r.lsn.clone());
            false
        } else {
            if self.options.max_rate.is_some() {
                self.check_copy_time().await?;
            }
            let src = self.src().await?;
            // A slot the source gave up (`max_slot_wal_keep_size`, during a long copy
            // cut short) cannot serve a new copy: made again.
            src.execute(
                "SELECT pg_drop_replication_slot($1) FROM pg_replication_slots
                  WHERE slot_name = $1 AND wal_status = 'lost' AND NOT active",
                &[&name],
            )
            .await
            .map_err(on(&source, "drop a lost replication slot"))?;
            src.execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')
                  WHERE NOT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1)",
                &[&name],
            )
            .await
            .map_err(on(&source, "create the replication slot"))?;
            // A new copy starts from empty tables (one cut short may have left rows);
            // with `max_rate` the mover copies, and the subscription copies nothing.
            self.empty_copy().await?;
            self.detail.rows_copied = None;
            if let Some(rate) = self.options.max_rate {
                let timeout = self.options.copy_timeout;
                tokio::time::timeout(timeout, self.copy_rows(rate)).await.map_err(|_| Error::Timeout {
                    host: source.clone(),
                    what: "the mover's copy of the rows".into(),
                    after: timeout,
                })??;
                start_at = self.detail.rows_copied.as_ref().and_then(|r| r.lsn.clone());
            }
            // Journaled before the subscription, which a resume then finds made: where
            // the mover's copy ended, or that there was none.
            let detail = self.detail_json()?;
            let said = journal::write_detail(&self.catalog, self.id, &detail, true);
            if catalog_bounded(self.id, self.options.hung_after, "journal the copy", said).await? != 1 {
                return Err(Error::Journal {
                    id: self.id,
                    message: "it is no longer running (aborted by another shardline?)".into(),
                });
            }
            self.detail.rows_copied.is_none()
        };
        let dst = self.dst().await?;
        if oid.is_none() {
            let rest = format!(
                "PUBLICATION {} WITH (enabled = false, create_slot = false, slot_name = {}, copy_data = {copy})",
                quote_ident(&name),
                quote_literal(&name)
            );
            // The peer URL may hold a password: through the one helper that keeps
            // it out of the driver's logs and out of the error.
            if let Err((sqlstate, message)) =
                subscription::create_subscription(dst, &name, &peer, &rest).await
            {
                return Err(Error::Host {
                    host: target.to_string(),
                    what: "subscribe to the source".into(),
                    sqlstate,
                    message,
                });
            }
            oid = dst.query_opt(find, &[&name]).await.map_err(on(&target, "look for the subscription"))?;
        }
        let oid: i64 = oid.map(|r| r.get(0)).ok_or_else(|| Error::Journal {
            id: self.id,
            message: format!("the subscription {name} vanished on {target}"),
        })?;
        // The subscription's origin starts there too: the slot's advance is kept on the
        // source's disk only at its next checkpoint, and a source that crashed before
        // it would send again what the copy (or the old copy) already holds. The
        // origin is the target's, and the walsender starts at the later of the two.
        // Not yet enabled, nothing has moved it; never moved back.
        if let Some(lsn) = &start_at {
            self.start_origin(oid, lsn).await?;
        }
        self.detail.subscription_oid = u32::try_from(oid).ok();
        self.detail.target_system = Some(self.target_system().await?);
        self.journal(Step::Copying).await
    }

    /// Moves the origin of subscription `oid` on to `lsn` while the subscription is
    /// disabled (an enabled one's worker holds the origin, and starts from it anyway);
    /// never back. Idempotent.
    async fn start_origin(&mut self, oid: i64, lsn: &str) -> Result<()> {
        let target = self.target.clone();
        let origin = format!("pg_{oid}");
        self.dst()
            .await?
            .execute(
                "SELECT pg_replication_origin_advance($1, $2::text::pg_lsn)
                   FROM pg_subscription s
                  WHERE s.oid = $3::bigint::oid AND NOT s.subenabled
                    AND coalesce(pg_replication_origin_progress($1, false), '0/0') < $2::text::pg_lsn",
                &[&origin, &lsn, &oid],
            )
            .await
            .map_err(on(&target, "start the subscription's origin where the copy ends"))?;
        Ok(())
    }

    /// The target server's system identifier (the last part of its table-sync slots'
    /// names on the source).
    async fn target_system(&mut self) -> Result<i64> {
        let target = self.target.clone();
        Ok(self
            .dst()
            .await?
            .query_one("SELECT system_identifier FROM pg_control_system()", &[])
            .await
            .map_err(on(&target, "read the system identifier"))?
            .get(0))
    }

    /// Enables the subscription, waits for every table's copy, then for the lag to fall
    /// under `max_lag`.
    pub(super) async fn catch_up(&mut self) -> Result<()> {
        let (name, target) = (self.name(), self.target.clone());
        let mut started = Instant::now();
        let mut deadline = started + self.options.copy_timeout;
        let schema = self.schema.clone();
        let total = self.detail.bytes;
        // The subscription the journal names must be the one on the target: a restart
        // of the copy (below) that was cut short may have dropped it, or made a new one
        // without journaling it. Missing, or detached from its slot by an undo that could
        // not finish dropping it (it cannot be enabled again): the copy starts over, from
        // empty tables.
        let live: Option<i64> = self
            .dst()
            .await?
            .query_opt(
                "SELECT oid::bigint FROM pg_subscription WHERE subname = $1 AND subslotname IS NOT NULL",
                &[&name],
            )
            .await
            .map_err(on(&target, "look for the subscription"))?
            .map(|r| r.get(0));
        // A slot gone from the source, or given up by it (`max_slot_wal_keep_size`):
        // the subscription can never stream; the copy starts over (a revert cannot).
        let slot_ok = {
            let source = self.source.clone();
            self.src()
                .await?
                .query_opt(
                    "SELECT wal_status IS DISTINCT FROM 'lost' FROM pg_replication_slots WHERE slot_name = $1",
                    &[&name],
                )
                .await
                .map_err(on(&source, "look for the replication slot"))?
                .is_some_and(|r| r.get(0))
        };
        let live = if slot_ok || live.is_none() {
            live
        } else if self.detail.reverts.is_some() {
            return Err(reverse_gone(&self.source, &name));
        } else {
            self.restart_copy("(its replication slot is gone from the source)".into()).await?;
            (started, deadline) = (Instant::now(), Instant::now() + self.options.copy_timeout);
            self.detail.subscription_oid.map(i64::from)
        };
        match live {
            None => {
                self.restart_copy("(the subscription is missing)".into()).await?;
                (started, deadline) = (Instant::now(), Instant::now() + self.options.copy_timeout);
            }
            Some(o) if Some(o) != self.detail.subscription_oid.map(i64::from) => {
                self.detail.subscription_oid = u32::try_from(o).ok();
                self.detail.target_system = Some(self.target_system().await?);
                self.journal(Step::Copying).await?;
            }
            Some(_) => {}
        }
        // A journal written before the system identifier was kept.
        if self.detail.target_system.is_none() {
            self.detail.target_system = Some(self.target_system().await?);
            self.journal(Step::Copying).await?;
        }
        let mut oid = self.detail.subscription_oid.map(i64::from);
        // Again before it is enabled: a mover that died between making the
        // subscription and moving its origin, or a target that lost that advance (it
        // is written out asynchronously), would otherwise start at the slot.
        let start_at = match &self.detail.reverts {
            Some(r) => Some(r.lsn.clone()),
            None => self.detail.rows_copied.as_ref().and_then(|r| r.lsn.clone()),
        };
        if let (Some(o), Some(lsn)) = (oid, start_at) {
            self.start_origin(o, &lsn).await?;
        }
        let enable = format!("ALTER SUBSCRIPTION {} ENABLE", quote_ident(&name));
        self.dst().await?.batch_execute(&enable).await.map_err(on(&target, "enable the subscription"))?;
        let mut checked = Instant::now();
        // A table first seen stranded, and its table-sync worker's pid then.
        let mut stranded: Option<((i64, String), Option<i32>)> = None;
        loop {
            if checked.elapsed() > SOURCE_CHECK {
                self.source_answers().await?;
                checked = Instant::now();
                // Seen again a second later, its table-sync worker gone or another one:
                // not a worker between dropping its slot and committing `syncdone`
                // (that one lives on, the same pid, however long its commit waits).
                let now = self.stranded_table(oid).await?;
                let first = stranded
                    .take()
                    .filter(|((relid, _), _)| now.as_ref().map(|((r, _), _)| r) == Some(relid));
                match (now, first) {
                    (Some(table), Some((_, pid_then))) if table.1.is_none() || table.1 != pid_then => {
                        let table = table.0.1;
                        self.restart_copy(format!(
                            "(table {table} cannot finish: its table-sync slot is gone from the source)"
                        ))
                        .await?;
                        // The new copy gets the whole time a copy gets.
                        (started, deadline) = (Instant::now(), Instant::now() + self.options.copy_timeout);
                        oid = self.detail.subscription_oid.map(i64::from);
                        self.dst()
                            .await?
                            .batch_execute(&enable)
                            .await
                            .map_err(on(&target, "enable the subscription"))?;
                        continue;
                    }
                    (Some(table), _) => stranded = Some(table),
                    (None, _) => {}
                }
            }
            let dst = self.dst().await?;
            let row = dst
                .query_one(
                    "SELECT count(*) FILTER (WHERE r.srsubstate = 'r'), count(*),
                            (SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint
                               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                              WHERE n.nspname = $2 AND c.relkind = 'r')
                       FROM pg_subscription_rel r WHERE r.srsubid = $1::bigint::oid",
                    &[&oid, &schema.as_str()],
                )
                .await
                .map_err(on(&target, "read the copy's progress"))?;
            let (ready, tables, bytes): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
            self.report(MoveProgress::Copy { bytes, total, tables_done: ready, tables });
            if tables > 0 && ready == tables {
                break;
            }
            if Instant::now() > deadline {
                // What it waits for, when that can be read: the timeout is the error.
                let waiting = self.tables_waiting(oid).await.unwrap_or_else(|_| "tables unknown".into());
                return Err(Error::Timeout {
                    host: target.clone(),
                    what: format!(
                        "the initial copy ({ready} of {tables} tables done; waiting for {waiting})"
                    ),
                    after: self.options.copy_timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.build_indexes().await?;
        self.refresh_views().await?;
        // With the mover's own copy of the rows (made in the step before) counted in.
        let rows_ms = self.detail.rows_copied.as_ref().map_or(0, |r| r.ms);
        self.detail.copy_ms = Some(rows_ms + ms(started.elapsed()));
        // The change log starts before the catch-up, so the marker below also brings
        // over everything the source committed before its triggers.
        if self.options.verification == Verification::ChangeLog {
            self.start_change_log().await?;
        }
        loop {
            let round = Instant::now();
            self.new_mark(deadline, "catch up").await?;
            let lag = ms(round.elapsed());
            self.report(MoveProgress::Lag { ms: lag });
            if round.elapsed() <= self.options.max_lag {
                self.detail.lag_ms = Some(lag);
                break;
            }
        }
        self.keep_revertible().await?;
        self.journal(Step::CaughtUp).await
    }

    /// Makes, on the target, the reverse publication and slot that keep the move
    /// revertible after its flip ([`Detail::revert`]), where the target can keep a
    /// slot; where it cannot, says why in the journal and the move goes on without.
    /// The slot starts here, before the fence; what it sees before the fence's end is
    /// skipped by the revert (see [`Mover::sync`]).
    async fn keep_revertible(&mut self) -> Result<()> {
        let Some(rev) = self.detail.revert.clone() else { return Ok(()) };
        let id = self.id;
        let (target, schema) = (self.target.clone(), self.schema.clone());
        let dst = self.dst().await?;
        let row = dst
            .query_one(
                "SELECT current_setting('wal_level'),
                        current_setting('max_replication_slots')::int - (SELECT count(*) FROM pg_replication_slots),
                        EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1),
                        EXISTS (SELECT FROM pg_publication WHERE pubname = $1)",
                &[&rev.name],
            )
            .await
            .map_err(on(&target, "look for the reverse replication"))?;
        let (wal_level, free, slot, published): (String, i64, bool, bool) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let unavailable = if slot {
            None
        } else if wal_level != "logical" {
            Some(format!("{target} has wal_level = {wal_level}, not logical"))
        } else if free < 1 {
            Some(format!("{target} has no free replication slot (max_replication_slots)"))
        } else {
            None
        };
        if let Some(why) = unavailable {
            tracing::warn!(id, %target, reason = %why, "the move will not be revertible after its flip");
            // A publication made by an earlier try whose slot then could not be: nothing
            // would find it again.
            drop_revert_side(dst, &target, &rev.name).await?;
            self.detail.revert = None;
            self.detail.revert_unavailable = Some(why);
            return Ok(());
        }
        if !published {
            // The shard's tables by name, not its schema: a table a migration adds during
            // the grace period is not published (its updates and deletes need no replica
            // identity), and a migration makes the move unrevertible anyway.
            let tables = tables_of(dst, &target, schema.as_str(), &schema.quoted()).await?;
            let tables: String = tables.iter().map(|t| format!("{t}, ")).collect();
            dst.batch_execute(&format!(
                "CREATE PUBLICATION {} FOR TABLE {tables}shardline.move_marks WHERE (move_id = {})",
                quote_ident(&rev.name),
                rev.id
            ))
            .await
            .map_err(on(&target, "create the reverse publication"))?;
        }
        if !slot {
            dst.execute("SELECT pg_create_logical_replication_slot($1, 'pgoutput')", &[&rev.name])
                .await
                .map_err(on(&target, "create the reverse slot"))?;
        }
        if let Some(r) = self.detail.revert.as_mut() {
            r.made = true;
        }
        Ok(())
    }

    /// The tables of subscription `oid` not yet ready, each with its state, and the
    /// subscription's table-sync errors so far: what a copy that does not end waits for.
    async fn tables_waiting(&mut self, oid: Option<i64>) -> Result<String> {
        let target = self.target.clone();
        let row = self
            .dst()
            .await?
            .query_one(
                "SELECT coalesce(string_agg(r.srrelid::regclass::text || ' (state ' || r.srsubstate || ')',
                                            ', ' ORDER BY r.srrelid), 'none'),
                        coalesce((SELECT sync_error_count FROM pg_stat_subscription_stats
                                   WHERE subid = $1::bigint::oid), 0)
                   FROM pg_subscription_rel r WHERE r.srsubid = $1::bigint::oid AND r.srsubstate <> 'r'",
                &[&oid],
            )
            .await
            .map_err(on(&target, "read the copy's progress"))?;
        let (tables, errors): (String, i64) = (row.get(0), row.get(1));
        Ok(format!("{tables}; {errors} table-sync errors"))
    }

    /// A table of subscription `oid` whose copy is done (`f`, finishedcopy) while its
    /// table-sync slot is gone from the source: its table-sync worker was killed after
    /// dropping the slot and before committing `syncdone` (both happen in one
    /// transaction of the target, the slot's drop on the source cannot be undone). Each
    /// worker started for it since fails at once, asking the source to stream from a
    /// slot that is not there (an error `pg_stat_subscription_stats` does not count),
    /// and the copy never ends. Returns the table's OID and name, and the pid of its
    /// table-sync worker, if one runs (read first: a worker seen gone before the table
    /// is seen at `f` was not about to commit `syncdone`).
    async fn stranded_table(&mut self, oid: Option<i64>) -> Result<Option<((i64, String), Option<i32>)>> {
        let (Some(oid), target, source) = (oid, self.target.clone(), self.source.clone()) else {
            return Ok(None);
        };
        let dst = self.dst().await?;
        let workers: Vec<(i64, i32)> = dst
            .query(
                "SELECT relid::bigint, pid FROM pg_stat_subscription
                  WHERE subid = $1::bigint::oid AND relid IS NOT NULL AND pid IS NOT NULL",
                &[&oid],
            )
            .await
            .map_err(on(&target, "read the copy's workers"))?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let done: Vec<(i64, String)> = dst
            .query(
                "SELECT r.srrelid::bigint, r.srrelid::regclass::text FROM pg_subscription_rel r
                  WHERE r.srsubid = $1::bigint::oid AND r.srsubstate = 'f' ORDER BY 1",
                &[&oid],
            )
            .await
            .map_err(on(&target, "read the copy's progress"))?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        for (relid, table) in done {
            let Some(slot) = sync_slots(&self.detail, Some(relid)) else { continue };
            let there: bool = self
                .src()
                .await?
                .query_one(
                    "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name LIKE $1)",
                    &[&slot],
                )
                .await
                .map_err(on(&source, "look for a table-sync slot"))?
                .get(0);
            if !there {
                let pid = workers.iter().find(|(r, _)| *r == relid).map(|(_, pid)| *pid);
                return Ok(Some(((relid, table), pid)));
            }
        }
        Ok(None)
    }

    /// Starts the copy over, `why` (a table stranded, see [`Mover::stranded_table`]; the
    /// subscription or its slot gone): drops the subscription and its slots, and
    /// subscribes again (which empties the target's copy of the shard and its marker;
    /// nothing reads or writes them before the flip), at most [`MAX_COPY_RESTARTS`]
    /// times.
    async fn restart_copy(&mut self, why: String) -> Result<()> {
        let (name, target, source, id) = (self.name(), self.target.clone(), self.source.clone(), self.id);
        if self.detail.reverts.is_some() {
            // A revert has no copy to start over: the changes since the flip are
            // streamed once, from the reverse slot, which a new subscription cannot reuse.
            return Err(Error::Journal {
                id,
                message: format!(
                    "the revert's subscription {name} on {target} is gone {why}; undo it with `shardline move --abort {}`",
                    self.shard
                ),
            });
        }
        if self.detail.copy_restarts >= MAX_COPY_RESTARTS {
            return Err(Error::Host {
                host: target.to_string(),
                what: "copy the shard".into(),
                sqlstate: None,
                message: format!(
                    "the copy could not finish after {} new starts; the last {why}",
                    self.detail.copy_restarts
                ),
            });
        }
        tracing::warn!(move_id = id, reason = %why, "starting the copy over");
        drop_subscription(self.dst().await?, &target, &name).await?;
        let detail = self.detail.clone();
        drop_slots(self.src().await?, &source, &name, &detail).await?;
        self.detail.copy_restarts += 1;
        self.subscribe().await
    }

    /// Fills the target's materialized views, which its migrations made while its tables
    /// were empty: each one populated on the source is refreshed once the rows are
    /// copied (as fresh as the copy, where the source's is as fresh as its last
    /// refresh); one not populated there is left so (`WITH NO DATA`). In the order they
    /// were made. Each waits for its lock (a reader of the copy's view holds it off) at
    /// most the move's `lock_timeout` a try, 10 tries.
    pub(super) async fn refresh_views(&mut self) -> Result<()> {
        let (source, target, schema) = (self.source.clone(), self.target.clone(), self.schema.clone());
        let lock_ms = self.options.lock_timeout.as_millis().max(1);
        let views: Vec<(String, bool)> = self
            .src()
            .await?
            .query(
                "SELECT c.relname::text, c.relispopulated FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND c.relkind = 'm' ORDER BY c.oid",
                &[&schema.as_str()],
            )
            .await
            .map_err(on(&source, "list the materialized views"))?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let dst = self.dst().await?;
        for (view, populated) in &views {
            tracing::debug!(view = %view, populated, "refreshing a materialized view");
            let data = if *populated { "" } else { " WITH NO DATA" };
            let refresh = format!(
                "BEGIN; SET LOCAL lock_timeout = '{lock_ms}ms';
                 REFRESH MATERIALIZED VIEW {}.{}{data}; COMMIT",
                schema.quoted(),
                quote_ident(view)
            );
            for attempt in 1..=10 {
                match dst.batch_execute(&refresh).await {
                    Ok(()) => break,
                    Err(e) => {
                        let _ = dst.batch_execute("ROLLBACK").await;
                        let e = on(&target, format!("refresh the materialized view {view}"))(e);
                        if !is_lock_conflict(&e) || attempt == 10 {
                            return Err(e);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Builds on the target every secondary index the source's schema has and the
    /// target lacks (deferred during the copy), from the source's own definitions and
    /// under their names, then attaches each partition's index to its partitioned
    /// table's as on the source (as pg_dump restores them: a partitioned table's index
    /// `ON ONLY` the table, each partition's on its own). Built whole instead, a
    /// partitioned index would make its partitions' indexes under names of its own,
    /// beside those the source names.
    pub(super) async fn build_indexes(&mut self) -> Result<()> {
        let (source, target, schema) = (self.source.clone(), self.target.clone(), self.schema.clone());
        let gentle = self.options.max_rate.is_some_and(|r| r > 0);
        let src = self.src().await?;
        let wanted: Vec<(String, String)> = src
            .query(
                "SELECT c.relname::text, pg_get_indexdef(i.indexrelid) FROM pg_index i
                   JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND pg_get_indexdef(i.indexrelid) IS NOT NULL ORDER BY 1",
                &[&schema.as_str()],
            )
            .await
            .map_err(on(&source, "read the index definitions"))?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let attached: Vec<(String, String)> = src
            .query(
                "SELECT p.relname::text, c.relname::text FROM pg_inherits h
                   JOIN pg_class c ON c.oid = h.inhrelid JOIN pg_class p ON p.oid = h.inhparent
                   JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND c.relkind IN ('i', 'I') ORDER BY 1, 2",
                &[&schema.as_str()],
            )
            .await
            .map_err(on(&source, "read the partitions' indexes"))?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let dst = self.dst().await?;
        let have: Vec<String> = dst
            .query(
                "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND c.relkind IN ('i', 'I')",
                &[&schema.as_str()],
            )
            .await
            .map_err(on(&target, "list the indexes"))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        // A capped copy is gentle on the target too: its index builds take one core, not
        // the server's parallel maintenance workers as well.
        if gentle {
            dst.batch_execute("SET max_parallel_maintenance_workers = 0")
                .await
                .map_err(on(&target, "set up the index builds"))?;
        }
        let mut built = Ok(());
        for (name, def) in wanted.iter().filter(|(n, _)| !have.contains(n)) {
            tracing::debug!(index = %name, "building a deferred index");
            built = dst.batch_execute(def).await.map_err(on(&target, format!("build index {name}")));
            if built.is_err() {
                break;
            }
        }
        // Attaching an index already attached to that parent changes nothing.
        let q = |n: &str| format!("{}.{}", schema.quoted(), quote_ident(n));
        for (parent, child) in &attached {
            if built.is_err() {
                break;
            }
            built = dst
                .batch_execute(&format!("ALTER INDEX {} ATTACH PARTITION {}", q(parent), q(child)))
                .await
                .map_err(on(&target, format!("attach index {child} to {parent}")));
        }
        if built.is_ok() {
            built = self.carry_replica_identity().await;
        }
        if gentle {
            // The build's own error first; then the reset's (tried either way).
            let reset = match self.dst().await {
                Ok(dst) => dst.batch_execute("RESET max_parallel_maintenance_workers").await,
                Err(e) => {
                    built?;
                    return Err(e);
                }
            };
            built?;
            reset.map_err(on(&target, "set up the index builds"))?;
            return Ok(());
        }
        built
    }

    /// Gives each table on the target the replica identity it has on the source, where
    /// they differ: one set by hand on the source (not by a migration, which ran on
    /// both) would otherwise be missing on the target, and the comparison before the
    /// flip find the shard's indexes different.
    async fn carry_replica_identity(&mut self) -> Result<()> {
        const IDENTITIES: &str = "SELECT c.relname::text, c.relreplident::text,
                    (SELECT x.relname::text FROM pg_index i JOIN pg_class x ON x.oid = i.indexrelid
                      WHERE i.indrelid = c.oid AND i.indisreplident)
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') ORDER BY 1";
        let (source, target, schema) = (self.source.clone(), self.target.clone(), self.schema.clone());
        let read = |rows: Vec<tokio_postgres::Row>| -> std::result::Result<Vec<(String, String, Option<String>)>, tokio_postgres::Error> {
            rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?))).collect()
        };
        let src = self.src().await?;
        let wanted = src.query(IDENTITIES, &[&schema.as_str()]).await.and_then(read);
        let wanted = wanted.map_err(on(&source, "read the tables' replica identities"))?;
        let dst = self.dst().await?;
        let have = dst.query(IDENTITIES, &[&schema.as_str()]).await.and_then(read);
        let have = have.map_err(on(&target, "read the tables' replica identities"))?;
        for (table, kind, index) in wanted.iter().filter(|w| !have.contains(w)) {
            let identity = match (kind.as_str(), index) {
                ("i", Some(index)) => format!("USING INDEX {}", quote_ident(index)),
                ("f", _) => "FULL".to_owned(),
                ("n", _) => "NOTHING".to_owned(),
                _ => "DEFAULT".to_owned(),
            };
            dst.batch_execute(&format!(
                "ALTER TABLE {}.{} REPLICA IDENTITY {identity}",
                schema.quoted(),
                quote_ident(table)
            ))
            .await
            .map_err(on(&target, format!("give {table} its replica identity")))?;
        }
        Ok(())
    }

    /// Bumps the move's marker on the source, then waits (until `deadline`) for the
    /// target to apply it: everything the source committed before is then on the
    /// target. `what` names the wait in its timeout.
    pub(super) async fn new_mark(&mut self, deadline: Instant, what: &str) -> Result<i64> {
        let (source, id) = (self.source.clone(), self.id);
        let n: i64 = self
            .src()
            .await?
            .query_one("UPDATE shardline.move_marks SET n = n + 1 WHERE move_id = $1 RETURNING n", &[&id])
            .await
            .map_err(on(&source, "write the marker"))?
            .get(0);
        self.wait_mark(n, deadline, what).await?;
        Ok(n)
    }

    /// Waits until the target's marker reaches `n`.
    pub(super) async fn wait_mark(&mut self, n: i64, deadline: Instant, what: &str) -> Result<()> {
        let (target, id) = (self.target.clone(), self.id);
        let started = Instant::now();
        let mut pause = Duration::from_micros(500);
        let mut checked = Instant::now();
        loop {
            if checked.elapsed() > SOURCE_CHECK {
                self.source_answers().await?;
                checked = Instant::now();
            }
            let seen: Option<i64> = self
                .dst()
                .await?
                .query_opt("SELECT n FROM shardline.move_marks WHERE move_id = $1", &[&id])
                .await
                .map_err(on(&target, "read the marker"))?
                .map(|r| r.get(0));
            if seen.is_some_and(|s| s >= n) {
                return Ok(());
            }
            let now = Instant::now();
            if now > deadline {
                return Err(Error::Timeout {
                    host: target.clone(),
                    what: format!("{what}: the source's change {n} to reach the target (it has {seen:?})"),
                    after: now - started,
                });
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(4));
        }
    }
}

/// A revert's reverse publication or slot missing on the new owner.
fn reverse_gone(host: &HostName, name: &str) -> Error {
    Error::Host {
        host: host.to_string(),
        what: "find the reverse replication".into(),
        sqlstate: None,
        message: format!("{name} is gone (dropped by `gc`?) or lost its WAL; the revert cannot go on"),
    }
}

/// Drops the [`REVERT_GUARD`] triggers of `schema`'s tables on `host`, each waiting at
/// most 500 ms for its table's lock (a long read holds it), tried again for up to 10 s.
pub(crate) async fn drop_guards(c: &Client, host: &HostName, schema: &str) -> Result<()> {
    for attempt in 1..=20 {
        let tables: Vec<String> = c
            .query(
                "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_trigger t
                   JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND t.tgname = $2",
                &[&schema, &REVERT_GUARD],
            )
            .await
            .map_err(on(host, "list the revert's guards"))?
            .iter()
            .map(|r| r.get(0))
            .collect();
        // The schema's reads are let through too ([`converge::live_sql`]), in the same
        // transaction (also when no guard is left: a run cut short between the two).
        // Made the shard's own version only where it is a copy's (`SECURITY DEFINER`):
        // no DDL, and no ownership needed, where there is nothing to do.
        let guarded_reads: bool = c
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                                 WHERE n.nspname = $1 AND p.proname = $2 AND p.prosecdef)",
                &[&schema, &shardline_repo::LIVE_CHECK],
            )
            .await
            .map_err(on(host, "look at the copy's live check"))?
            .get(0);
        if tables.is_empty() && !guarded_reads {
            return Ok(());
        }
        let drops: String = tables
            .iter()
            .map(|t| format!("DROP TRIGGER IF EXISTS {REVERT_GUARD} ON {t};"))
            .chain(guarded_reads.then(|| converge::live_sql(schema, None)))
            .collect();
        match c.batch_execute(&format!("BEGIN; SET LOCAL lock_timeout = '500ms'; {drops} COMMIT")).await {
            Ok(()) => return Ok(()),
            Err(e) => {
                let _ = c.batch_execute("ROLLBACK").await;
                let e = on(host, "drop the revert's guards")(e);
                if !is_lock_conflict(&e) || attempt == 20 {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

impl Mover<'_> {
    /// Drops the guards of a revert's copy (see [`REVERT_GUARD`]); nothing for a move.
    pub(super) async fn unguard(&mut self) -> Result<()> {
        let (target, schema) = (self.target.clone(), self.schema.clone());
        drop_guards(self.dst().await?, &target, schema.as_str()).await
    }
}

/// On a revert's target, in one transaction: the old copy `old` renamed back to `schema`,
/// its tables guarded ([`REVERT_GUARD`]), and its ledger rows moved along. Its ID
/// sequence stays capped (as the reverted move's fence left it, then where the carry
/// sets it) until the flip's decision. The reverse replication then brings it up to date.
/// The SQL that guards the tables of a copy that is not the shard's until its move's
/// flip (a move's new target copy, a revert's old copy): the tables `tables` (listed
/// under `schema`, qualified and quoted) get a [`REVERT_GUARD`] statement trigger that
/// refuses a write as a moved shard's (3F000: a router with an old map finds the shard
/// where it is) until the move `id` has decided to flip (its marker, replicated from
/// the source, says so), except from the move's own sessions (`shardline.move`, set by
/// the mover on its sessions: the copy's `COPY` and the emptying `TRUNCATE`). Logical
/// replication's workers run in `replica` mode, where the trigger does not fire.
/// `SECURITY DEFINER`: an application role need not read shardline's tables.
fn guard_sql(schema: &str, id: i64) -> String {
    // Every table of the schema as it is at that point of the transaction (the copy's
    // are made in it, a revert's old copy renamed in it).
    let triggers = format!(
        "DO $guard$ DECLARE t record; BEGIN
           FOR t IN SELECT c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                     WHERE n.nspname = {name} AND c.relkind IN ('r', 'p') ORDER BY 1 LOOP
             EXECUTE pg_catalog.format(
               'CREATE OR REPLACE TRIGGER {REVERT_GUARD} BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON %I.%I
                  FOR EACH STATEMENT EXECUTE FUNCTION shardline.revert_guard(%L)', {name}, t.relname, '{id}');
           END LOOP;
         END $guard$;
         {live}",
        name = quote_literal(schema),
        live = converge::live_sql(schema, Some(id)),
    );
    // Moves onto one host at once (`rebalance --parallel`) each replace the guard's
    // function: one at a time, or the second fails ("tuple concurrently updated").
    format!(
        "SELECT pg_catalog.pg_advisory_xact_lock({GUARD_FUNCTION_LOCK});
         CREATE OR REPLACE FUNCTION shardline.revert_guard() RETURNS trigger LANGUAGE plpgsql
             SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $g$
         BEGIN
             IF current_setting('shardline.move', true) = TG_ARGV[0]
                OR EXISTS (SELECT FROM shardline.move_marks WHERE move_id = TG_ARGV[0]::bigint AND decided = 'flip') THEN
                 RETURN NULL;
             END IF;
             RAISE EXCEPTION 'schema \"%\" on this host is a copy that a move brings here; the shard lives elsewhere until its flip', TG_TABLE_SCHEMA
                 USING ERRCODE = 'invalid_schema_name';
         END $g$;
         {triggers}"
    )
}

/// The advisory lock (of the transaction) under which [`guard_sql`] replaces the guard's
/// function: "shardline" in ASCII, then 2 (the guard).
const GUARD_FUNCTION_LOCK: i64 = 0x7368_6172_646c_0002;

/// Guards the tables of move `id`'s new copy `schema` on `host` ([`guard_sql`]).
async fn guard_copy(c: &Client, host: &HostName, schema: &SchemaName, id: i64) -> Result<()> {
    c.batch_execute(&format!("BEGIN; {} COMMIT", guard_sql(schema.as_str(), id)))
        .await
        .map_err(on(host, "guard the copy"))
}

async fn reopen_old_copy(c: &Client, host: &HostName, old: &str, schema: &SchemaName, id: i64) -> Result<()> {
    // Guarded under the new name (the rename comes first, in the same transaction).
    let guards = guard_sql(schema.as_str(), id);
    c.batch_execute(&format!(
        "BEGIN;
         ALTER SCHEMA {old_q} RENAME TO {new_q};
         {guards}
         UPDATE shardline.shard_migrations SET schema_name = {new_l} WHERE schema_name = {old_l};
         COMMIT",
        old_q = quote_ident(old),
        new_q = schema.quoted(),
        old_l = quote_literal(old),
        new_l = quote_literal(schema.as_str()),
    ))
    .await
    .map_err(on(host, "reopen the old copy"))
}
