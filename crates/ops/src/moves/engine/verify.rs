//! `verified`: both copies compared table by table as multisets of rows, inside the
//! fence: a keyed table whose change logs hold (see `changes`) by the keys written
//! since the comparison before the fence, any other table in full.

use super::*;

impl Mover<'_> {
    /// Per keyed table with a trusted change log: the rows under every logged key, on
    /// both sides, must be equal (missing, extra and changed rows show; a key is unique).
    /// Per other table: row counts and checksums (see [`checksum`]: every row counts,
    /// duplicates too), both sides at once. A mismatch lists the differing keys (for a
    /// table without a primary key, the differing rows and how often each side has
    /// them) and stops the move (the caller undoes it).
    pub(super) async fn verify(&mut self) -> Result<()> {
        let (source, target, id) = (self.source.clone(), self.target.clone(), self.id);
        let (schema, moved) = (self.schema.as_str().to_owned(), self.moved.clone());
        self.src().await?;
        self.dst().await?;
        let (Some(src), Some(dst)) = (self.src.as_ref(), self.dst.as_ref()) else {
            return Err(Error::Busy);
        };
        // Values hashed as their text are rendered alike on both sides.
        futures::try_join!(
            async { src.batch_execute(TEXT_SETTINGS).await.map_err(on(&source, "set up the session")) },
            async { dst.batch_execute(TEXT_SETTINGS).await.map_err(on(&target, "set up the session")) }
        )?;
        let (src_tables, dst_tables) =
            futures::try_join!(tables(src, &source, &moved), tables(dst, &target, &schema))?;
        if src_tables.iter().map(|t| &t.0).ne(dst_tables.iter().map(|t| &t.0)) {
            return Err(Error::Verify {
                id,
                shard: self.shard,
                differences: vec![format!(
                    "the tables differ: [{}] on {source}, [{}] on {target}",
                    src_tables.iter().map(|t| t.0.as_str()).collect::<Vec<_>>().join(", "),
                    dst_tables.iter().map(|t| t.0.as_str()).collect::<Vec<_>>().join(", ")
                )],
            });
        }
        let (src_idx, dst_idx) =
            futures::try_join!(indexes(src, &source, &moved), indexes(dst, &target, &schema))?;
        if src_idx != dst_idx {
            return Err(Error::Verify {
                id,
                shard: self.shard,
                differences: vec![format!(
                    "the indexes differ: [{}] on {source}, [{}] on {target}",
                    src_idx.join(", "),
                    dst_idx.join(", ")
                )],
            });
        }
        self.lap("verify: tables and indexes");
        // The keyed tables whose change logs can be trusted: only their logged keys are
        // read (see `changes`); every other table is read in full.
        let logged = self.logged_keys().await?;
        self.lap("verify: read the change logs");
        let (Some(src), Some(dst)) = (self.src.as_ref(), self.dst.as_ref()) else {
            return Err(Error::Busy);
        };
        let pre = self.detail.precheck.clone().unwrap_or_default();
        let mut checks = Vec::new();
        let mut differences = Vec::new();
        let mut rows = 0;
        let mut rechecked = 0;
        // Rows are hashed as the source's columns say, on both sides alike.
        for (table, key, hash) in &src_tables {
            if let Some((k, keys)) = logged.get(table) {
                let list = changes::json_array(keys.iter());
                let (a, b) = futures::try_join!(
                    changes::rows_by_key(src, &source, &moved, k, &list),
                    changes::rows_by_key(dst, &target, &schema, k, &list)
                )?;
                rechecked += i64::try_from(keys.len()).unwrap_or(i64::MAX);
                let diff = changes::differing(&a, &b);
                // Counted in the snapshots compared before the fence (the exact counts
                // are taken on the source's frozen copy once the map flipped).
                let (on_a, on_b) = pre.tables.get(table).copied().unwrap_or_default();
                rows += on_b;
                checks.push(TableCheck {
                    table: table.clone(),
                    source_rows: on_a,
                    target_rows: on_b,
                    matches: diff.is_empty(),
                });
                if !diff.is_empty() {
                    let shown: Vec<&str> = diff.values().take(20).map(String::as_str).collect();
                    differences.push(format!(
                        "{table}: {} differing key(s) ({key}): {}",
                        diff.len(),
                        shown.join(", ")
                    ));
                }
                continue;
            }
            let (a, b) = futures::try_join!(
                checksum(src, &source, &moved, table, hash),
                checksum(dst, &target, &schema, table, hash)
            )?;
            let matches = a == b;
            rows += b.0;
            rechecked += a.0.max(b.0);
            checks.push(TableCheck { table: table.clone(), source_rows: a.0, target_rows: b.0, matches });
            if !matches {
                let (a, b) = futures::try_join!(
                    keys(src, &source, &moved, table, key, hash),
                    keys(dst, &target, &schema, table, key, hash)
                )?;
                let diff = differing_keys(&a, &b);
                let n = diff.len();
                let shown: Vec<String> = diff
                    .into_iter()
                    .take(20)
                    .map(|(k, on_a, on_b)| {
                        // Without a primary key the "key" is the whole row: say how
                        // often each side holds it.
                        if key == "*" { format!("{k} ({on_a} on {source}, {on_b} on {target})") } else { k }
                    })
                    .collect();
                differences.push(format!("{table}: {n} differing key(s) ({key}): {}", shown.join(", ")));
            }
        }
        self.detail.rechecked_rows = Some(rechecked);
        self.detail.tables = checks;
        self.lap("verify: recheck");
        if !differences.is_empty() {
            self.detail.differences.clone_from(&differences);
            return Err(Error::Verify { id, shard: self.shard, differences });
        }
        self.detail.rows = rows;
        self.journal(Step::Verified).await
    }
}

/// The shard's tables in `schema` that hold rows themselves (a partitioned table's rows
/// are its partitions', each compared on its own), with their primary key (or all
/// columns) as an SQL row expression.
pub(super) async fn tables(
    c: &Client,
    host: &HostName,
    schema: &str,
) -> Result<Vec<(String, String, String)>> {
    let rows = c
        .query(
            &format!(
                "SELECT c.relname::text,
                        coalesce((SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY k.ord)
                                    FROM pg_index i
                                    CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
                                    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                                   WHERE i.indrelid = c.oid AND i.indisprimary), '*'),
                        {HASHED_COLUMNS}
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE n.nspname = $1 AND c.relkind = 'r' ORDER BY 1"
            ),
            &[&schema],
        )
        .await
        .map_err(on(host, "list the tables"))?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1), row_hash("t", &hashed_columns(r, 2)))).collect())
}

/// For the table `c` of a catalog query: its columns in order (`attname[]`), and
/// whether each is hashed as it is (`bool[]`) or as its text. Postgres's row hash
/// (`hash_record_extended`) hashes an enum by its label's OID, which every server (and
/// every schema) numbers on its own, and has no hash at all for some types (`json`,
/// `money`, `point`, `tsvector`, ...): so a column is hashed as it is only when its
/// type, or the base type of its domain, or the element type of its array, is built
/// into Postgres and has a default hash operator class with an extended hash (the
/// lookup Postgres itself makes) and is not an OID alias (`regclass`, ...); any other is
/// hashed as its text, which the mover's sessions render alike on both sides
/// (`TEXT_SETTINGS`).
pub(super) const HASHED_COLUMNS: &str = "
    (SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_attribute a
      WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped),
    (SELECT array_agg(b.base < 16384 AND s.scalar < 16384 AND EXISTS (
                SELECT FROM pg_opclass oc JOIN pg_am am ON am.oid = oc.opcmethod AND am.amname = 'hash'
                  JOIN pg_amproc p ON p.amprocfamily = oc.opcfamily AND p.amprocnum = 2
                 WHERE oc.opcdefault
                   AND (oc.opcintype = s.scalar OR EXISTS (SELECT FROM pg_cast k WHERE k.castsource = s.scalar
                          AND k.casttarget = oc.opcintype AND k.castmethod = 'b' AND k.castcontext = 'i')))
          -- An OID alias (regclass, regtype, ...) names an object by its OID, which each
          -- server numbers on its own: hashed as its text (the name).
          AND NOT EXISTS (SELECT FROM pg_type r WHERE r.oid = s.scalar AND r.typname LIKE 'reg%')
              ORDER BY a.attnum)
       FROM pg_attribute a
      CROSS JOIN LATERAL (SELECT coalesce(nullif(ty.typbasetype, 0), ty.oid) AS base
                            FROM pg_type ty WHERE ty.oid = a.atttypid) b
      CROSS JOIN LATERAL (SELECT CASE WHEN bt.typcategory = 'A' AND bt.typelem <> 0 THEN bt.typelem
                                      ELSE bt.oid END AS scalar
                            FROM pg_type bt WHERE bt.oid = b.base) s
      WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped)";

/// The columns and flags [`HASHED_COLUMNS`] selected at `at` and `at + 1` of `r`.
pub(super) fn hashed_columns(r: &tokio_postgres::Row, at: usize) -> Vec<(String, bool)> {
    let names: Vec<String> = r.get::<_, Option<Vec<String>>>(at).unwrap_or_default();
    let as_is: Vec<bool> = r.get::<_, Option<Vec<bool>>>(at + 1).unwrap_or_default();
    names.into_iter().zip(as_is).collect()
}

/// The 64-bit hash of a row of alias `t` with `columns` (from [`hashed_columns`]): the
/// same on every server for the same values. The one place the move compares rows by.
pub(super) fn row_hash(t: &str, columns: &[(String, bool)]) -> String {
    let parts: Vec<String> =
        columns
            .iter()
            .map(|(c, as_is)| {
                if *as_is {
                    format!("{t}.{}", quote_ident(c))
                } else {
                    format!("{t}.{}::text", quote_ident(c))
                }
            })
            .collect();
    format!("hash_record_extended(ROW({}), 0)", parts.join(", "))
}

/// The indexes of `schema` by name, each with the partitioned index it is attached to
/// (`name < parent`): a partition's index built but not attached differs; so does one
/// that is its table's replica identity on one side only.
pub(super) async fn indexes(c: &Client, host: &HostName, schema: &str) -> Result<Vec<String>> {
    let rows = c
        .query(
            "SELECT c.relname::text || coalesce(' < ' || p.relname::text, '')
                    || CASE WHEN x.indisreplident THEN ' (replica identity)' ELSE '' END
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
               LEFT JOIN pg_index x ON x.indexrelid = c.oid
               LEFT JOIN pg_inherits h ON h.inhrelid = c.oid LEFT JOIN pg_class p ON p.oid = h.inhparent
              WHERE n.nspname = $1 AND c.relkind IN ('i', 'I') ORDER BY 1",
            &[&schema],
        )
        .await
        .map_err(on(host, "list the indexes"))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// A table's row count and the exact sum (numeric: no overflow, no wrap) of its rows'
/// 64-bit hashes. Both are multiset functions: every row counts, a duplicate twice.
/// (An XOR of the hashes, used before, cancels any row present twice, so a side with
/// two copies of one row and a side with two copies of another compared equal.) Two
/// different contents agree only when the hashes of the rows in which they differ sum
/// alike, a 2^-64 chance for rows not built to collide.
pub(super) async fn checksum(
    c: &Client,
    host: &HostName,
    schema: &str,
    table: &str,
    hash: &str,
) -> Result<(i64, String)> {
    let row = c
        .query_one(
            &format!(
                "SELECT count(*), coalesce(sum({hash}), 0)::text FROM {}.{} AS t",
                quote_ident(schema),
                quote_ident(table)
            ),
            &[],
        )
        .await
        .map_err(on(host, format!("checksum {schema}.{table}")))?;
    Ok((row.get(0), row.get(1)))
}

/// How many rows of each (key, row hash) a table holds: one per key where `key` is a
/// primary key; for a table without one (`*`, the whole row), how often each row is
/// there, so a duplicate too many or too few shows.
pub(super) async fn keys(
    c: &Client,
    host: &HostName,
    schema: &str,
    table: &str,
    key: &str,
    hash: &str,
) -> Result<HashMap<(String, i64), i64>> {
    let key = if key == "*" { "t.*".to_owned() } else { key.to_owned() };
    let rows = c
        .query(
            &format!(
                "SELECT (ROW({key}))::text, {hash}, count(*) FROM {}.{} AS t GROUP BY 1, 2",
                quote_ident(schema),
                quote_ident(table)
            ),
            &[],
        )
        .await
        .map_err(on(host, format!("list the keys of {schema}.{table}")))?;
    Ok(rows.iter().map(|r| ((r.get(0), r.get(1)), r.get(2))).collect())
}

/// The keys whose rows differ between `a` (the source's, see [`keys`]) and `b`, sorted,
/// with how many rows each side holds under them.
pub(super) fn differing_keys(
    a: &HashMap<(String, i64), i64>,
    b: &HashMap<(String, i64), i64>,
) -> Vec<(String, i64, i64)> {
    let mut differ = std::collections::BTreeSet::new();
    for (this, other) in [(a, b), (b, a)] {
        differ.extend(this.iter().filter(|(k, n)| other.get(*k) != Some(n)).map(|((k, _), _)| k.clone()));
    }
    let rows = |m: &HashMap<(String, i64), i64>, key: &str| {
        m.iter().filter(|((k, _), _)| k == key).map(|(_, n)| n).sum::<i64>()
    };
    differ
        .into_iter()
        .map(|k| {
            let (on_a, on_b) = (rows(a, &k), rows(b, &k));
            (k, on_a, on_b)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(list: &[(&str, i64, i64)]) -> HashMap<(String, i64), i64> {
        list.iter().map(|&(k, h, n)| ((k.to_owned(), h), n)).collect()
    }

    #[test]
    fn differing_keys_count_duplicates_and_changed_rows() {
        // A row twice on one side and three times on the other; a row only on one
        // side; a key whose row changed; an equal row.
        let a = rows(&[("(x)", 1, 2), ("(y)", 2, 1), ("(k)", 3, 1), ("(same)", 9, 1)]);
        let b = rows(&[("(x)", 1, 3), ("(k)", 4, 1), ("(same)", 9, 1)]);
        assert_eq!(
            differing_keys(&a, &b),
            vec![("(k)".to_owned(), 1, 1), ("(x)".to_owned(), 2, 3), ("(y)".to_owned(), 1, 0)]
        );
        assert!(differing_keys(&a, &a).is_empty());
    }
}
