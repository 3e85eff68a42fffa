//! `flipped` and `cleaned`: the decision on the source, the catalog's map, and what the
//! move leaves behind.

use super::fence::TOKEN_SQL;
use super::*;

/// Decides the flip on the source: a compare-and-set of the marker's `decided`, only
/// while the lease runs; `$2` is the proof.
const DECIDE_SQL: &str = "UPDATE shardline.move_marks SET decided = 'flip', flip_token = $2
  WHERE move_id = $1 AND fenced AND decided IS NULL AND lease_until > clock_timestamp()";

impl Mover<'_> {
    /// Decides, on the source, that the move flips: a compare-and-set of the marker's
    /// `decided`, only while the lease runs. From then on nobody can unfence the
    /// source, and flipping the catalog is always right. The proof of it (a random
    /// token) is kept with the decision; its SHA-256 is journaled first, so that
    /// `shardline.complete_flip` can check it. Already decided (a resumed move): done.
    pub(super) async fn decide_flip(&mut self) -> Result<()> {
        let (source, id) = (self.source.clone(), self.id);
        let lost = Error::LeaseExpired { id, shard: self.shard };
        // A proof made before the fence, its SHA-256 journaled with `fenced`: one
        // compare-and-set. Anything else (a resumed move, a lease run out) takes the
        // long way below.
        if let (Some(token), Some(_)) = (self.flip_token.clone(), &self.detail.flip_check) {
            let n = self
                .src()
                .await?
                .execute(DECIDE_SQL, &[&id, &token])
                .await
                .map_err(on(&source, "decide to flip"))?;
            if n == 1 {
                self.renewer = None;
                return Ok(());
            }
        }
        match self.fence_decision().await? {
            Some(Some(d)) if d == "flip" => {
                self.renewer = None;
                return Ok(());
            }
            Some(Some(_)) => return Err(lost),
            Some(None) => {}
            None => {
                return Err(Error::Journal {
                    id,
                    message: format!(
                        "{source} has no fenced marker for this move, so it cannot decide to flip"
                    ),
                });
            }
        }
        let row = self
            .src()
            .await?
            .query_one(TOKEN_SQL, &[])
            .await
            .map_err(on(&source, "make the flip's proof"))?;
        let (token, check): (String, String) = (row.get(0), row.get(1));
        self.detail.flip_check = Some(check);
        let detail = self.detail_json()?;
        let j = catalog_bounded(
            id,
            self.options.hung_after,
            "journal the flip's proof",
            journal::write_detail(&self.catalog, id, &detail, true),
        )
        .await?;
        if j != 1 {
            return Err(Error::Journal {
                id,
                message: "it is no longer running (aborted by another shardline?)".into(),
            });
        }
        let n = self
            .src()
            .await?
            .execute(DECIDE_SQL, &[&id, &token])
            .await
            .map_err(on(&source, "decide to flip"))?;
        if n != 1 {
            tracing::warn!(id, "the fence's lease ran out before the flip; the move is undone");
            return Err(lost);
        }
        self.renewer = None;
        Ok(())
    }

    /// Decides the flip on the source ([`Mover::decide_flip`]), then points the
    /// catalog's map at the target, in the same transaction as the journal. Once
    /// decided, a catalog that does not answer is tried again for up to
    /// `sync_timeout` (the shard stays fenced meanwhile; a router that finds it fenced
    /// completes the flip with `shardline.complete_flip` once the catalog is back, and
    /// so does `--resume`).
    pub(super) async fn flip(&mut self) -> Result<()> {
        // Bounded by the source's probes. Given up, the decision may or may not have
        // been made: the undo that follows asks the source, which refuses once `flip`
        // is decided (then routers or `--resume` complete it).
        let (config, hung_after, source) = (self.config, self.options.hung_after, [self.source.clone()]);
        let decided = unless_hung(config, &source, hung_after, self.decide_flip()).await;
        self.settle(decided).await?;
        self.lap("decide the flip");
        if self.options.stop_after_decision {
            tracing::warn!(id = self.id, "drill: the flip is decided; stopping as if the mover died");
            return Err(Error::Interrupted { id: self.id, step: self.step });
        }
        // The target's copy is the shard's from the decision on: its ID sequence's cap
        // is lifted and its guards go before the map points at it (the decision's
        // arrival on the copy lifts the cap as it lets the guards pass writes; the
        // clean-up and `gc` lift a cap and drop guards left). A cap not lifted here
        // keeps the guards here.
        {
            let target = [self.target.clone()];
            let lifted = unless_hung(config, &target, hung_after, self.lift_cap()).await.and_then(|r| r);
            let dropped = match lifted {
                Ok(()) => unless_hung(config, &target, hung_after, self.unguard()).await.and_then(|r| r),
                Err(e) => Err(e),
            };
            if let Err(e) = dropped {
                self.dst = None;
                tracing::warn!(id = self.id, error = %shardline_repo::error_chain(&e), "cannot drop the copy's guards yet");
            }
            self.lap("drop the copy's guards");
        }
        // Each try bounded by `hung_after` (2 s at least): a catalog cut off or hung in
        // the middle of the flip's transaction holds no one. Its session is dropped and
        // the catalog's server ends it (`journal::flip`), freeing the map's row for the
        // routers that complete the flip meanwhile.
        let bound = hung_after.max(Duration::from_secs(2));
        let deadline = Instant::now() + self.options.sync_timeout;
        loop {
            let (e, reopen) = match tokio::time::timeout(bound, self.flip_catalog()).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e @ Error::Repo(_))) => (e, false),
                // Refused (the map places the shard on a third host, or the move no
                // longer runs). A flip already made, by a router that found the shard
                // fenced or by a try whose commit's reply was lost, is made again.
                Ok(Err(e)) => return Err(e),
                Err(_) => (
                    Error::Journal {
                        id: self.id,
                        message: format!("the catalog answered nothing within {bound:?} (flip the map)"),
                    },
                    true,
                ),
            };
            if Instant::now() >= deadline {
                return Err(e);
            }
            tracing::warn!(id = self.id, error = %shardline_repo::error_chain(&e), "the flip is decided but the catalog failed; trying again");
            tokio::time::sleep(Duration::from_millis(500)).await;
            if reopen || self.catalog.is_closed() {
                // Bounded too: through a cut link a new connection gets no answer either.
                let opened = tokio::time::timeout(bound, async {
                    let (catalog, _) = Catalog::open(self.config).await.map_err(Error::from)?;
                    lock_move(&catalog, self.id).await.map(|()| catalog)
                })
                .await;
                match opened {
                    Ok(Ok(catalog)) => self.catalog = catalog,
                    Ok(Err(e)) => {
                        tracing::warn!(id = self.id, error = %shardline_repo::error_chain(&e), "cannot open the catalog again yet")
                    }
                    Err(_) => tracing::warn!(
                        id = self.id,
                        "cannot open the catalog again yet: no answer within {bound:?}"
                    ),
                }
            }
        }
    }

    pub(super) async fn flip_catalog(&mut self) -> Result<()> {
        let pause = match self.fence_started {
            Some(t) => ms(t.elapsed()),
            None => self.detail.fenced_at_ms.map_or(0, |t| now_ms().saturating_sub(t)),
        };
        self.detail.pause_ms = Some(pause);
        self.lap("flip");
        self.lap_at = None;
        let detail = self.detail_json()?;
        let idle = self.options.hung_after.max(Duration::from_secs(2));
        journal::flip(
            &self.catalog,
            self.id,
            self.shard,
            &self.source,
            &self.target,
            &detail,
            idle,
            self.options.on_flip.as_ref(),
        )
        .await?;
        let shard = self.shard.get();
        self.step = Step::Flipped;
        tracing::info!(id = self.id, shard = shard, pause_ms = pause, "move flipped");
        self.report(MoveProgress::Step { id: self.id, step: Step::Flipped });
        Ok(())
    }

    /// Drops the subscription (and with it the slot), the publication and the markers.
    /// A host that is down leaves its part to `shardline gc`, named in the journal.
    pub(super) async fn clean(&mut self) -> Result<()> {
        // Each part bounded by its host's probes: a hung host's part is left to gc.
        let (config, hung_after) = (self.config, self.options.hung_after);
        let (source, target) = ([self.source.clone()], [self.target.clone()]);
        if self.detail.precheck.is_some() && self.detail.rechecked_rows.is_some() {
            let counted = unless_hung(config, &source, hung_after, self.count_moved()).await;
            if let Err(e) = counted.and_then(|r| r) {
                self.src = None;
                tracing::warn!(id = self.id, error = %e, "cannot count the rows moved; the journal keeps the comparison's counts");
            }
        }
        let mut pending = Vec::new();
        // Guards left on the copy let writes through only while its marker says the
        // move decided to flip: then the marker stays too, and `gc` drops both, guards
        // first.
        let guarded = {
            let lifted = unless_hung(config, &target, hung_after, self.lift_cap()).await.and_then(|r| r);
            let dropped = match lifted {
                Ok(()) => unless_hung(config, &target, hung_after, self.unguard()).await.and_then(|r| r),
                Err(e) => Err(e),
            };
            if let Err(e) = &dropped {
                self.dst = None;
                pending.push(format!(
                    "{}: the copy's ID sequence's cap, its guards on {} and the move's marker ({})",
                    self.target,
                    self.schema,
                    shardline_repo::error_chain(e)
                ));
            }
            dropped.is_err()
        };
        let cleaned =
            unless_hung(config, &target, hung_after, self.clean_target(false, guarded)).await.and_then(|r| r);
        if cleaned.is_err() {
            self.dst = None;
        }
        if let Err(e) = cleaned {
            pending.push(format!(
                "{}: subscription {} ({})",
                self.target,
                self.name(),
                shardline_repo::error_chain(&e)
            ));
        }
        let cleaned = unless_hung(config, &source, hung_after, self.clean_source()).await.and_then(|r| r);
        if cleaned.is_err() {
            self.src = None;
        }
        if let Err(e) = cleaned {
            pending.push(format!(
                "{}: publication and slots of {} ({})",
                self.source,
                self.name(),
                shardline_repo::error_chain(&e)
            ));
        }
        self.detail.cleanup_pending = pending;
        if let Some(hook) = &self.options.on_cleaned {
            hook().await;
        }
        let detail = self.detail_json()?;
        let said = journal::done(&self.catalog, self.id, &detail);
        catalog_bounded(self.id, self.options.hung_after, "journal the move done", said).await?;
        self.step = Step::Cleaned;
        self.report(MoveProgress::Step { id: self.id, step: Step::Cleaned });
        Ok(())
    }

    /// The rows moved, counted on the source's copy, frozen since the fence (equal to
    /// the target's at the fence, as verified), for the journal and the report: a
    /// verification through the change logs does not count rows inside the fence.
    pub(super) async fn count_moved(&mut self) -> Result<()> {
        let (source, moved) = (self.source.clone(), self.moved.clone());
        self.src().await?;
        let Some(src) = self.src.as_ref() else { return Err(Error::Busy) };
        let mut rows = 0;
        for t in &mut self.detail.tables {
            let n: i64 = src
                .query_one(
                    &format!("SELECT count(*) FROM {}.{}", quote_ident(&moved), quote_ident(&t.table)),
                    &[],
                )
                .await
                .map_err(on(&source, format!("count {moved}.{}", t.table)))?
                .get(0);
            (t.source_rows, t.target_rows) = (n, n);
            rows += n;
        }
        self.detail.rows = rows;
        Ok(())
    }

    /// On the target: the subscription (detached from its slot if the source is down),
    /// the marker (unless `keep_marker`: the copy's guards are still there, and let
    /// writes through only while it says the move decided to flip), the change log;
    /// with `drop_schema`, the schema and its ledger rows too.
    pub(super) async fn clean_target(&mut self, drop_schema: bool, keep_marker: bool) -> Result<()> {
        let (name, target, id, schema) = (self.name(), self.target.clone(), self.id, self.schema.clone());
        let dst = self.dst().await?;
        drop_subscription(dst, &target, &name).await?;
        if keep_marker {
            // The guards read the decision from this row, which the subscription just
            // dropped may not have brought yet: written here (it is final, and journaled).
            dst.execute(
                "INSERT INTO shardline.move_marks (move_id, decided) VALUES ($1, 'flip')
                 ON CONFLICT (move_id) DO UPDATE SET decided = 'flip'",
                &[&id],
            )
            .await
            .map_err(on(&target, "keep the marker"))?;
        } else {
            dst.execute("DELETE FROM shardline.move_marks WHERE move_id = $1", &[&id])
                .await
                .or_else(|e| {
                    if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) {
                        Ok(0)
                    } else {
                        Err(e)
                    }
                })
                .map_err(on(&target, "delete the marker"))?;
        }
        // With the subscription gone nothing writes a copy being dropped, so its
        // triggers go at once.
        drop_changes(dst, &target, id, CLEANUP_LOCK_MS, CLEANUP_ATTEMPTS).await?;
        if drop_schema {
            // Undone: nothing is left to revert.
            if let Some(rev) = self.detail.revert.clone() {
                drop_revert_side(self.dst().await?, &target, &rev.name).await?;
            }
            let dst = self.dst().await?;
            drop_shard_schema(dst, schema.as_str()).await.map_err(on(&target, "drop the copy"))?;
        }
        Ok(())
    }

    /// On the source: the publication, the slots, the marker.
    pub(super) async fn clean_source(&mut self) -> Result<()> {
        let (name, source, id) = (self.name(), self.source.clone(), self.id);
        let detail = self.detail.clone();
        let src = self.src().await?;
        drop_source_side(src, &source, &name, &detail, id).await
    }
}

/// Drops subscription `name` on `host`. If the source cannot be reached to drop its
/// slot, the subscription is detached from the slot first (the slot is then the
/// source's cleanup).
pub(crate) async fn drop_subscription(c: &Client, host: &HostName, name: &str) -> Result<()> {
    let exists: bool = c
        .query_one("SELECT EXISTS (SELECT FROM pg_subscription WHERE subname = $1)", &[&name])
        .await
        .map_err(on(host, "look for the subscription"))?
        .get(0);
    if !exists {
        return Ok(());
    }
    // Dropping it drops its slot on the source, connecting there: bounded, since the
    // source may be hung or cut off (then the slot is the source's cleanup, below).
    let quoted = quote_ident(name);
    let drop = format!("DROP SUBSCRIPTION {quoted}");
    if crate::moves::subscription::peer_bounded(c, c.batch_execute(&drop)).await.is_ok() {
        return Ok(());
    }
    // Detached from its slot, and pointed at an address that fails at once: Postgres 15
    // still connects to drop the table-sync slots of a copy under way, and gives up
    // quietly only when that connection fails (a hung or cut-off source would hold it).
    c.batch_execute(&format!(
        "ALTER SUBSCRIPTION {quoted} DISABLE; ALTER SUBSCRIPTION {quoted} SET (slot_name = NONE);
         ALTER SUBSCRIPTION {quoted} CONNECTION 'host=/nonexistent/shardline-detached'"
    ))
    .await
    .map_err(on(host, "detach the subscription"))?;
    crate::moves::subscription::peer_bounded(c, c.batch_execute(&drop))
        .await
        .map_err(on(host, "drop the subscription"))
}

/// Drops, on the source, publication and slot `name`, the table-sync slots of
/// `detail`'s subscription, and move `id`'s marker and change log. A slot still in use is released first
/// (its WAL sender ended).
pub(crate) async fn drop_source_side(
    c: &Client,
    host: &HostName,
    name: &str,
    detail: &Detail,
    id: i64,
) -> Result<()> {
    c.batch_execute(&format!("DROP PUBLICATION IF EXISTS {}", quote_ident(name)))
        .await
        .map_err(on(host, "drop the publication"))?;
    drop_slots(c, host, name, detail).await?;
    c.execute("DELETE FROM shardline.move_marks WHERE move_id = $1", &[&id])
        .await
        .or_else(|e| {
            if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) { Ok(0) } else { Err(e) }
        })
        .map_err(on(host, "delete the marker"))?;
    drop_changes(c, host, id, CLEANUP_LOCK_MS, CLEANUP_ATTEMPTS).await
}

/// The `LIKE` pattern of the table-sync slots of `detail`'s subscription on the source
/// (of table `relid` only, when given): PostgreSQL names them
/// `pg_<subscription OID>_sync_<table OID>_<target's system identifier>`. Without the
/// system identifier (a journal written before it was kept), any target's. `None` before
/// the subscription exists.
pub(crate) fn sync_slots(detail: &Detail, relid: Option<i64>) -> Option<String> {
    let oid = detail.subscription_oid?;
    let relid = relid.map_or_else(|| "%".to_owned(), |r| r.to_string());
    let system = detail.target_system.map_or_else(|| "%".to_owned(), |s| s.to_string());
    Some(format!("pg\\_{oid}\\_sync\\_{relid}\\_{system}"))
}

/// Drops, on the source, slot `name` and the table-sync slots of `detail`'s subscription.
/// A slot still in use is released first (its WAL sender ended).
pub(crate) async fn drop_slots(c: &Client, host: &HostName, name: &str, detail: &Detail) -> Result<()> {
    let sync = sync_slots(detail, None);
    for attempt in 0..20 {
        let left: i64 = c
            .query_one(
                "WITH s AS (SELECT slot_name, active_pid FROM pg_replication_slots
                             WHERE slot_name = $1 OR ($2::text IS NOT NULL AND slot_name LIKE $2)),
                      t AS (SELECT pg_terminate_backend(active_pid) FROM s WHERE active_pid IS NOT NULL),
                      d AS (SELECT pg_drop_replication_slot(slot_name) FROM s WHERE active_pid IS NULL)
                 SELECT (SELECT count(*) FROM t) + (SELECT count(*) FROM d) - (SELECT count(*) FROM s WHERE active_pid IS NULL)",
                &[&name, &sync],
            )
            .await
            .map_err(on(host, "drop the replication slots"))?
            .get(0);
        if left == 0 {
            break;
        }
        if attempt == 19 {
            return Err(Error::Host {
                host: host.to_string(),
                what: "drop the replication slots".into(),
                sqlstate: None,
                message: format!("{left} slot(s) of {name} stay in use"),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// How long dropping a change log's trigger waits for its table's writes in flight,
/// per attempt (the shard may be live again there: a short wait, tried again).
const CLEANUP_LOCK_MS: u128 = 500;

/// Attempts at dropping a change log's trigger.
const CLEANUP_ATTEMPTS: u32 = 10;
