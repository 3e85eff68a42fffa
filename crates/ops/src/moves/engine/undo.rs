//! Undoing a move: unfencing the source first (it decides), then the target's copy.

use super::*;

/// Undoes a move that has not flipped: the source decides `undo` and is unfenced (one
/// transaction, refused once the source decided to flip), then the target's copy and
/// subscription are dropped (or left to `gc`, named, if the target is down), and the
/// source's publication and slots. The source must be reachable; the catalog need not
/// be for the unfencing (the source's decision is what rules out a flip), but the rest
/// waits for it (`--abort` or `gc` finish it).
pub(super) async fn undo(mover: &mut Mover<'_>, reason: &str) -> Result<AbortReport> {
    if mover.step >= Step::Flipped {
        return Err(Error::Flipped { id: mover.id, shard: mover.shard });
    }
    // The map, when it can be read, must still place the shard on the source: only then
    // is the target's copy nobody's.
    let (id, hung_after) = (mover.id, mover.options.hung_after);
    let map = catalog_bounded(id, hung_after, "read the map", async { Ok(mover.catalog.map().await?) });
    match map.await {
        Ok(map) if *map.host_of(mover.shard) != mover.source => {
            return Err(Error::Journal {
                id: mover.id,
                message: format!(
                    "the map places shard {} on {}, not on the source",
                    mover.shard,
                    map.host_of(mover.shard)
                ),
            });
        }
        Ok(_) => {}
        Err(e) => {
            tracing::warn!(id = mover.id, error = %shardline_repo::error_chain(&e), "cannot read the map; unfencing on the source's decision alone");
        }
    }
    // The source first: while it cannot be reached nothing is touched, and the move
    // stays as it was (resumable, or abortable once the source is back).
    let (source, schema, moved) = (mover.source.clone(), mover.schema.clone(), mover.moved.clone());
    let (live, fenced) = mover.source_schemas().await?;
    if !live && !fenced {
        return Err(Error::Journal {
            id: mover.id,
            message: format!("neither {schema} nor {moved} is on {source}"),
        });
    }
    let unfenced = unfence(mover, live, fenced).await?;
    mover.renewer = None;
    // From here on the move can only be undone: say so before the target's copy goes.
    if !mover.detail.undoing {
        mover.detail.undoing = true;
        let detail = mover.detail_json()?;
        let said = journal::write_detail(&mover.catalog, mover.id, &detail, false);
        catalog_bounded(id, hung_after, "journal the undo", said).await?;
    }
    let mut pending = Vec::new();
    let mut target_left = false;
    // A hung target is left to `gc` too, rather than holding the undo.
    let (config, target, hung_after) = (mover.config, [mover.target.clone()], mover.options.hung_after);
    let cleaned = match unless_hung(config, &target, hung_after, mover.clean_target(true, false)).await {
        Ok(r) => r,
        Err(hung) => {
            // Its statements may still run on the target: a new connection next time.
            mover.dst = None;
            Err(hung)
        }
    };
    if let Err(e) = cleaned {
        pending.push(format!(
            "{}: subscription {} and schema {} ({})",
            mover.target,
            mover.name(),
            mover.schema,
            shardline_repo::error_chain(&e)
        ));
        target_left = true;
    }
    mover.clean_source().await?;
    mover.detail.cleanup_pending = pending.clone();
    mover.detail.target_schema_left = target_left;
    let detail = mover.detail_json()?;
    let said = journal::rolled_back(&mover.catalog, mover.id, reason, &detail);
    catalog_bounded(id, hung_after, "journal the undo", said).await?;
    Ok(AbortReport {
        id: mover.id,
        shard: mover.shard,
        source: source.clone(),
        unfenced,
        cleanup_pending: pending,
    })
}

/// On the source, in one transaction: the marker's `decided` set to `undo` (refused
/// with [`Error::FlipDecided`] when it says `flip`), and, when the shard is fenced, its
/// schema renamed back, its ledger rows moved back and its sequence's cap lifted.
/// Returns whether it unfenced the shard.
pub(super) async fn unfence(mover: &mut Mover<'_>, live: bool, fenced: bool) -> Result<bool> {
    let (source, schema, moved, id) =
        (mover.source.clone(), mover.schema.clone(), mover.moved.clone(), mover.id);
    let shard = mover.shard;
    let layout_max = mover.layout.max_sequence_value();
    let journaled_max = mover.detail.sequence_max;
    let src = mover.src().await?;
    let fail = on(&source, "unfence the shard");
    let has_marks: bool = src
        .query_one("SELECT to_regclass('shardline.move_marks') IS NOT NULL", &[])
        .await
        .map_err(&fail)?
        .get(0);
    let result = async {
        src.batch_execute("BEGIN").await.map_err(&fail)?;
        let mut marked_max = None;
        let mut marked = false;
        if has_marks
            && let Some(row) = src
                .query_opt(
                    "SELECT decided, sequence_max FROM shardline.move_marks WHERE move_id = $1 FOR UPDATE",
                    &[&id],
                )
                .await
                .map_err(&fail)?
        {
            let decided: Option<String> = row.get(0);
            if decided.as_deref() == Some("flip") {
                return Err(Error::FlipDecided { id, shard });
            }
            marked = true;
            marked_max = row.get::<_, Option<i64>>(1);
            src.execute("UPDATE shardline.move_marks SET decided = 'undo' WHERE move_id = $1", &[&id])
                .await
                .map_err(&fail)?;
        }
        let unfenced = !live && fenced;
        // The marker is written before the fence and goes only with a flip's clean-up:
        // a source fenced away without it is one whose move flipped and was cleaned up,
        // though the journal read here says the move runs (a catalog restored from a
        // backup). Reopening that old copy, then dropping the target's, would lose
        // every write since the flip.
        if unfenced && !marked {
            return Err(Error::Fleet {
                host: source.clone(),
                message: format!(
                    "move {id} of shard {shard}: {moved} is fenced away and carries no marker of the move, so \
                     it flipped and was cleaned up, though the journal says it runs (a catalog restored from \
                     a backup?); nothing was undone: put the map right first (`shardline map --check`)"
                ),
            });
        }
        if unfenced {
            // The fence capped the sequence at its last value: the cap is lifted with
            // the rename.
            let max = journaled_max.or(marked_max).unwrap_or(layout_max);
            src.batch_execute(&format!(
                "ALTER SCHEMA {} RENAME TO {};
                 ALTER SEQUENCE {}.shardline_id_seq MAXVALUE {max};
                 UPDATE shardline.shard_migrations SET schema_name = {} WHERE schema_name = {}",
                quote_ident(&moved),
                schema.quoted(),
                schema.quoted(),
                quote_literal(schema.as_str()),
                quote_literal(&moved)
            ))
            .await
            .map_err(&fail)?;
        }
        src.batch_execute("COMMIT").await.map_err(&fail)?;
        Ok(unfenced)
    }
    .await;
    if result.is_err() {
        let _ = src.batch_execute("ROLLBACK").await;
    }
    result
}

/// For `gc`: finishes undoing running move `record` when its source decided `undo`
/// (its fence's lease ran out, its mover gone; or an undo stopped before it was
/// journaled). Returns what it finished (`gc`'s words for it), if it did; a move that
/// another process holds, or whose source does not answer, is left alone.
pub(crate) async fn finish_undone(config: &Config, record: &MoveRecord) -> Result<Option<&'static str>> {
    let (catalog, info) = Catalog::open(config).await?;
    if lock_move(&catalog, record.id).await.is_err() {
        return Ok(None);
    }
    let record = journal::by_id(&catalog, record.id).await?;
    if record.state != State::Running {
        return Ok(None);
    }
    let options = MoveOptions::default();
    let mut mover = Mover::load(config, &options, catalog, info.layout, record).await?;
    let (reason, said) = match mover.source_marker().await {
        Ok(Some((true, Some(d)))) if d == "undo" => (
            "the fence's lease ran out with its mover gone; the undo was finished by gc",
            "its fence's lease ran out; the move is undone",
        ),
        // Decided before the journal said so (an undo stopped between the two).
        Ok(Some((false, Some(d)))) if d == "undo" => (
            "the source decided to undo the move, which stopped before it was journaled; the undo was finished by gc",
            "its source had decided to undo it; the move is undone",
        ),
        _ => return Ok(None),
    };
    undo(&mut mover, reason).await?;
    Ok(Some(said))
}
