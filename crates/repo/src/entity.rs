//! What an application declares: an [`Entity`] (a table of every shard schema and its
//! row mapping) and a [`NewRow`] (what an insert supplies, and which shard it goes to).
//!
//! Most applications derive both (`#[derive(Entity, NewRow)]`, re-exported from the
//! crate root); by hand they look like this:
//!
//! ```
//! use shardline_id::Id;
//! use shardline_repo::entity::{Entity, NewRow, ShardKey};
//! use shardline_repo::tokio_postgres::{Row, types::ToSql};
//!
//! struct Photo { id: Id, user_id: i64, url: String }
//!
//! impl Entity for Photo {
//!     const TABLE: &'static str = "photos";
//!     const COLUMNS: &'static [&'static str] = &["id", "user_id", "url"];
//!     const USER_COLUMN: Option<&'static str> = Some("user_id");
//!     fn from_row(row: &Row) -> Result<Self, shardline_repo::tokio_postgres::Error> {
//!         Ok(Photo { id: row.try_get("id")?, user_id: row.try_get("user_id")?, url: row.try_get("url")? })
//!     }
//!     fn id(&self) -> Id { self.id }
//! }
//!
//! struct NewPhoto { user_id: i64, url: String }
//!
//! impl NewRow for NewPhoto {
//!     type Entity = Photo;
//!     const COLUMNS: &'static [&'static str] = &["user_id", "url"];
//!     fn shard_key(&self) -> ShardKey { ShardKey::User(self.user_id) }
//!     fn values(&self) -> Vec<&(dyn ToSql + Sync)> { vec![&self.user_id, &self.url] }
//! }
//! ```

use shardline_id::Id;
use shardline_id::sql::{RESERVED_COLUMN_PREFIX, plain_identifier_problem};
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use crate::{Error, Result};

/// A table present in every shard schema, keyed by a shardline ID in column `id`.
///
/// A row lives in the shard of its owning user ([`Entity::USER_COLUMN`], photos), or
/// beside the row it belongs to ([`Entity::PARENT_COLUMN`], a photo's comments live in
/// the photo's shard), so the rows one request needs share one shard.
pub trait Entity: Sized + Send + Sync + 'static {
    /// The table, unqualified (`photos`).
    const TABLE: &'static str;
    /// Every column read back, `id` among them.
    const COLUMNS: &'static [&'static str];
    /// The column holding the owning user's ID, when rows are placed by user:
    /// [`crate::Repo::page_of_user`] filters by it.
    const USER_COLUMN: Option<&'static str> = None;
    /// The column holding the ID of the row this one lives beside, when rows are placed
    /// by parent: [`crate::Repo::page_of_parent`] filters by it.
    const PARENT_COLUMN: Option<&'static str> = None;
    /// Builds the value from a row holding [`Entity::COLUMNS`].
    ///
    /// # Errors
    ///
    /// The driver's, when a column is missing or of another type.
    fn from_row(row: &Row) -> Result<Self, tokio_postgres::Error>;
    /// The row's ID.
    fn id(&self) -> Id;
}

/// What places a new row in a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardKey {
    /// The shard of this user (`user_id mod logical_shards`); the value is stored in
    /// the entity's [`Entity::USER_COLUMN`].
    User(i64),
    /// The shard of this ID (decoded from it), for a row that lives beside another; the
    /// value is stored in the entity's [`Entity::PARENT_COLUMN`].
    Parent(Id),
}

impl ShardKey {
    /// The stored value.
    pub fn value(self) -> i64 {
        match self {
            ShardKey::User(u) => u,
            ShardKey::Parent(id) => i64::from(id),
        }
    }

    /// The column of `E` that stores it.
    pub(crate) fn column<E: Entity>(self) -> Option<&'static str> {
        match self {
            ShardKey::User(_) => E::USER_COLUMN,
            ShardKey::Parent(_) => E::PARENT_COLUMN,
        }
    }
}

/// The values an insert supplies; the database fills the rest (`id` from the shard's
/// `next_id()`).
///
/// `#[derive(NewRow)]` places its rows by the column its entity reads its pages by.
/// A row placed by another column does not compile: every comment below would land
/// where `page_of_parent` never looks.
///
/// ```compile_fail,E0080
/// use shardline_repo::{Entity, Id, NewRow};
///
/// #[derive(Entity)]
/// #[shardline(table = "comments")]
/// struct Comment {
///     id: Id,
///     #[shardline(parent)]
///     photo_id: Id,
///     user_id: i64,
///     body: String,
/// }
///
/// // "NewComment places its rows by its user `user_id`, but Comment has no
/// // #[shardline(user)] field stored in `user_id`: mark the same column in both"
/// #[derive(NewRow)]
/// #[shardline(entity = Comment)]
/// struct NewComment {
///     photo_id: Id,
///     #[shardline(user)]
///     user_id: i64,
///     body: String,
/// }
/// ```
pub trait NewRow: Send + Sync {
    /// The entity the insert returns.
    type Entity: Entity;
    /// The columns given, in the order of [`NewRow::values`]: plain SQL identifiers, or
    /// every insert is refused with [`Error::InvalidIdentifier`] before any SQL is built.
    const COLUMNS: &'static [&'static str];
    /// What places the row: its user, or the row it lives beside. Its value must also
    /// be one of [`NewRow::values`], in the entity's user or parent column: every
    /// insert refuses a row whose column holds another value with [`Error::Invalid`]
    /// before anything is sent.
    fn shard_key(&self) -> ShardKey;
    /// The values, one per column.
    fn values(&self) -> Vec<&(dyn ToSql + Sync)>;
}

/// Whether a new row placed by `column` (a user or a parent column) fits its entity,
/// whose column of that kind is `entity` and of the other kind `other`: the same column,
/// or an entity that names neither (written by hand, its pages not used). What
/// `#[derive(NewRow)]` asserts at compile time. Not for other use.
#[doc(hidden)]
#[must_use]
pub const fn same_column(entity: Option<&str>, other: Option<&str>, column: &str) -> bool {
    let Some(entity) = entity else { return other.is_none() };
    let (a, b) = (entity.as_bytes(), column.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// A plain SQL identifier ([`plain_identifier_problem`], the rule `#[derive]` applies at
/// compile time): lowercase ASCII letter or `_`, then letters, digits, `_`; at most 63
/// bytes. Everything the SQL builder quotes is checked with it first.
pub(crate) fn check_ident(what: &'static str, name: &str) -> Result<()> {
    match plain_identifier_problem(name) {
        None => Ok(()),
        Some(_) => Err(Error::InvalidIdentifier { what, name: name.to_owned() }),
    }
}

/// A column of `table` that an entity or a new row may name: a plain identifier
/// ([`check_ident`]) outside [`RESERVED_COLUMN_PREFIX`], the prefix of the columns
/// shardline's statements add to their rows (a table column of such a name would be
/// read in place of one of them, or they in place of it).
pub(crate) fn check_column(what: &'static str, table: &str, name: &str) -> Result<()> {
    check_ident(what, name)?;
    if name.starts_with(RESERVED_COLUMN_PREFIX) {
        return Err(Error::Invalid {
            what: format!(
                "{what} {name:?} of table {table:?}: names starting with `{RESERVED_COLUMN_PREFIX}` are \
                 reserved for the columns shardline's statements add; rename the column"
            ),
        });
    }
    Ok(())
}

/// Checks an entity's declaration once, before any SQL is built from it.
pub(crate) fn check_entity<E: Entity>() -> Result<()> {
    check_ident("table", E::TABLE)?;
    for c in E::COLUMNS {
        check_column("column", E::TABLE, c)?;
    }
    for c in E::USER_COLUMN.iter().chain(E::PARENT_COLUMN.iter()) {
        check_ident("column", c)?;
        if !E::COLUMNS.contains(c) {
            return Err(Error::InvalidIdentifier {
                what: "user or parent column (not among the columns)",
                name: (*c).to_owned(),
            });
        }
    }
    if !E::COLUMNS.contains(&"id") {
        return Err(Error::InvalidIdentifier {
            what: "columns (no `id` among them)",
            name: E::TABLE.to_owned(),
        });
    }
    Ok(())
}

/// Checks the columns an insert of `N` gives, before any SQL is built from them: a
/// hand-written `impl NewRow` is not checked by `#[derive(NewRow)]`.
/// Nor may it give the row's `id`, which `#[derive(NewRow)]` refuses too: the shard
/// mints it (`DEFAULT next_id()`), and an ID the row chose could name another shard
/// than the one the row is written in, where every read by that ID would look.
pub(crate) fn check_new_row<N: NewRow>() -> Result<()> {
    for c in N::COLUMNS {
        check_column("column to insert", <N::Entity as Entity>::TABLE, c)?;
    }
    if N::COLUMNS.contains(&"id") {
        return Err(Error::Invalid {
            what: format!(
                "{}: gives {}.id, which the shard mints (a new row has no ID): an ID the row chose could \
                 name another shard than the one it is written in",
                std::any::type_name::<N>(),
                <N::Entity as Entity>::TABLE
            ),
        });
    }
    Ok(())
}

/// A row whose `values()` do not match its `COLUMNS` one to one is refused before
/// anything is sent (in a batch, the values would shift into other rows' columns).
pub(crate) fn check_values<N: NewRow>(row: &N) -> Result<()> {
    let values = row.values();
    let n = values.len();
    if n != N::COLUMNS.len() {
        return Err(Error::Invalid {
            what: format!(
                "{}: values() gives {n} values for {} columns",
                std::any::type_name::<N>(),
                N::COLUMNS.len()
            ),
        });
    }
    // The key the row is routed by is the one it stores: a row whose `shard_key()` says
    // one user (or parent) while its column holds another would land in the first's
    // shard, where reads by the stored value never look. The derive cannot write such a
    // row; a hand-written `NewRow` can. Checked on the value as it would be sent.
    let key = row.shard_key();
    let Some(column) = key.column::<N::Entity>() else {
        // The entity stores the other kind of key (a user where the row gives a parent,
        // say): the row would be in the parent's shard, where pages by its user never
        // look. The derive refuses this at compile time.
        let other = N::Entity::USER_COLUMN.or(N::Entity::PARENT_COLUMN);
        return match other {
            None => Ok(()),
            Some(other) => Err(Error::Invalid {
                what: format!(
                    "{}: shard_key() is a {} but {} places its rows by {other}",
                    std::any::type_name::<N>(),
                    match key {
                        ShardKey::User(_) => "user",
                        ShardKey::Parent(_) => "parent",
                    },
                    N::Entity::TABLE
                ),
            }),
        };
    };
    let Some(i) = N::COLUMNS.iter().position(|c| *c == column) else {
        return Err(Error::Invalid {
            what: format!(
                "{}: the row is routed by its shard_key() but does not give {}.{column}, the column that \
                 stores it; reads by that column would never find it",
                std::any::type_name::<N>(),
                N::Entity::TABLE
            ),
        });
    };
    let Some(value) = values.get(i) else { return Ok(()) };
    let stored = stored_key(*value);
    if stored == Some(key.value()) {
        return Ok(());
    }
    Err(Error::Invalid {
        what: format!(
            "{}: shard_key() is {} but the row stores {} in {}.{column}; it would be written in the shard \
             of the one and read by the other",
            std::any::type_name::<N>(),
            key.value(),
            stored
                .map_or_else(|| "a value that is not a 64- or 32-bit integer".to_owned(), |v| v.to_string()),
            N::Entity::TABLE
        ),
    })
}

/// A key column's value as the driver would send it: a `bigint` (or an `integer`).
/// `None` for a NULL or a value of another type.
fn stored_key(value: &(dyn ToSql + Sync)) -> Option<i64> {
    use tokio_postgres::types::{IsNull, Type};
    let mut buf = bytes::BytesMut::new();
    if let Ok(IsNull::No) = value.to_sql_checked(&Type::INT8, &mut buf)
        && let Ok(b) = <[u8; 8]>::try_from(&buf[..])
    {
        return Some(i64::from_be_bytes(b));
    }
    buf.clear();
    if let Ok(IsNull::No) = value.to_sql_checked(&Type::INT4, &mut buf)
        && let Ok(b) = <[u8; 4]>::try_from(&buf[..])
    {
        return Some(i64::from(i32::from_be_bytes(b)));
    }
    None
}

/// Checks the columns an update sets: declared by `E`, not `id`, not the column that
/// places the row in its shard ([`Entity::USER_COLUMN`], [`Entity::PARENT_COLUMN`]),
/// plain identifiers.
pub(crate) fn check_update<'a, E: Entity>(set: &[(&'a str, &(dyn ToSql + Sync))]) -> Result<Vec<&'a str>> {
    for (c, _) in set {
        if *c == "id" || !E::COLUMNS.contains(c) {
            return Err(Error::InvalidIdentifier { what: "column to update", name: (*c).to_owned() });
        }
        if E::USER_COLUMN == Some(*c) || E::PARENT_COLUMN == Some(*c) {
            // The row would stay in its shard while its key named another: no read by
            // that key would find it.
            return Err(Error::Invalid {
                what: format!(
                    "an update of {}.{c} is refused: the column places the row in its shard, so the row \
                     would stay where its new value does not lead; delete the row and insert it anew",
                    E::TABLE
                ),
            });
        }
        check_ident("column", c)?;
    }
    if set.is_empty() {
        return Err(Error::Invalid { what: format!("an update of {} sets no column", E::TABLE) });
    }
    Ok(set.iter().map(|(c, _)| *c).collect())
}

#[cfg(test)]
mod tests {
    use super::{check_column, same_column};
    use crate::statement::{BRANCH_SHARD, INSERT_PART};

    #[test]
    fn the_columns_statements_add_are_reserved_and_refused_as_an_entitys() {
        for tag in [BRANCH_SHARD, INSERT_PART] {
            assert!(tag.starts_with(shardline_id::sql::RESERVED_COLUMN_PREFIX), "{tag}");
            let refused = check_column("column", "photos", tag).map(|()| "accepted").unwrap_err().to_string();
            assert!(refused.contains(tag) && refused.contains("reserved"), "{refused}");
        }
        assert!(check_column("column", "photos", "shardline_anything").is_err());
        assert!(check_column("column", "photos", "shard").is_ok());
        assert!(check_column("column", "photos", "my_shardline_shard").is_ok());
    }

    #[test]
    fn a_new_row_fits_its_entity_by_the_same_column_or_an_entity_that_names_none() {
        // The entity's column of the new row's kind.
        assert!(same_column(Some("user_id"), None, "user_id"));
        assert!(!same_column(Some("author"), None, "user_id"));
        // Placed by a kind of key the entity does not read by, while it reads by the other.
        assert!(!same_column(None, Some("photo_id"), "user_id"));
        // An entity written by hand that names neither: not checked.
        assert!(same_column(None, None, "user_id"));
    }
}
