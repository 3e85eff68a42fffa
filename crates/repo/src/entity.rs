//! What an application declares: an [`Entity`] (a table of every shard schema and its
//! row mapping) and a [`NewRow`] (what an insert supplies).
//!
//! ```
//! use shardline_id::Id;
//! use shardline_repo::entity::{Entity, NewRow};
//! use shardline_repo::tokio_postgres::{Row, types::ToSql};
//!
//! struct Photo { id: Id, user_id: i64, url: String }
//!
//! impl Entity for Photo {
//!     const TABLE: &'static str = "photos";
//!     const COLUMNS: &'static [&'static str] = &["id", "user_id", "url"];
//!     const USER_COLUMN: &'static str = "user_id";
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
//!     fn user_id(&self) -> i64 { self.user_id }
//!     fn values(&self) -> Vec<&(dyn ToSql + Sync)> { vec![&self.user_id, &self.url] }
//! }
//! ```

use shardline_id::Id;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use crate::{Error, Result};

/// A table present in every shard schema, keyed by a shardline ID in column `id`, and
/// owned by a user (the column that routes it).
pub trait Entity: Sized + Send + Sync + 'static {
    /// The table, unqualified (`photos`).
    const TABLE: &'static str;
    /// Every column read back, `id` among them.
    const COLUMNS: &'static [&'static str];
    /// The column holding the owning user's ID: inserts route by it, pages filter by it.
    const USER_COLUMN: &'static str;
    /// Builds the value from a row holding [`Entity::COLUMNS`].
    ///
    /// # Errors
    ///
    /// The driver's, when a column is missing or of another type.
    fn from_row(row: &Row) -> Result<Self, tokio_postgres::Error>;
    /// The row's ID.
    fn id(&self) -> Id;
}

/// The values an insert supplies; the database fills the rest (`id` from the shard's
/// `next_id()`).
pub trait NewRow: Send + Sync {
    /// The entity the insert returns.
    type Entity: Entity;
    /// The columns given, in the order of [`NewRow::values`].
    const COLUMNS: &'static [&'static str];
    /// The user whose shard the row goes to.
    fn user_id(&self) -> i64;
    /// The values, one per column.
    fn values(&self) -> Vec<&(dyn ToSql + Sync)>;
}

/// A plain SQL identifier: lowercase ASCII letter or `_`, then letters, digits, `_`; at
/// most 63 bytes. Everything the SQL builder quotes is checked with it first.
pub(crate) fn check_ident(what: &'static str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok { Ok(()) } else { Err(Error::InvalidIdentifier { what, name: name.to_owned() }) }
}

/// Checks an entity's declaration once, before any SQL is built from it.
pub(crate) fn check_entity<E: Entity>() -> Result<()> {
    check_ident("table", E::TABLE)?;
    for c in E::COLUMNS {
        check_ident("column", c)?;
    }
    check_ident("column", E::USER_COLUMN)?;
    if !E::COLUMNS.contains(&"id") {
        return Err(Error::InvalidIdentifier {
            what: "columns (no `id` among them)",
            name: E::TABLE.to_owned(),
        });
    }
    Ok(())
}
