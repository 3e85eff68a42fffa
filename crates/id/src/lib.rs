//! Mint and decode shardline's 64-bit shard IDs.
//!
//! ```text
//! | 41 bits: ms since 2011-08-24T21:07:01.721Z | 13 bits: logical shard | 10 bits: sequence |
//! ```
//!
//! An ID is a non-negative Postgres `bigint` that carries its creation time and the
//! logical shard that minted it, so a read by ID goes straight to the right host. The
//! widths and the epoch are a value ([`Layout`], Instagram's by default) that feeds
//! both the Rust code here and the SQL that mints IDs inside every shard schema
//! ([`sql::ShardSql`]), so the two cannot disagree.
//!
//! Unique by construction: a shard's IDs come from one number that only grows,
//! `(ms since epoch << 10) | counter` — in Postgres, the shard's own sequence. More than
//! 1024 IDs in a millisecond borrow the next millisecond; a clock that steps back
//! changes nothing. `docs/ids.md` has the argument and the measurements.
//!
//! # Layout
//!
//! - [`Layout`]: widths, epoch, composing and decoding, the sign-bit and exhaustion dates.
//! - [`Id`]: the newtype, its decimal and compact text forms.
//! - [`generator`]: an in-process generator, and blocks reserved from a shard's sequence.
//! - [`sql`]: the SQL that installs the minter in a shard schema.
//! - [`ident`]: quoting names and literals into SQL text, the one place that does.
//!
//! # Features
//!
//! - `serde`: `Serialize`/`Deserialize` for [`Id`] (a decimal string in human-readable
//!   formats, `i64` in binary ones), and [`serde::as_i64`] for `#[serde(with)]`.
//! - `sqlx`: [`Id`] as a Postgres `BIGINT` in sqlx, validated on decode.
//! - `postgres-types`: `FromSql`/`ToSql` for tokio-postgres, validated on decode.
//! - `test-util`: [`generator::ManualClock`].
//!
//! # Example
//!
//! ```
//! use shardline_id::{Id, Layout};
//!
//! let id: Id = "1436985812374127403".parse().unwrap();
//! let parts = Layout::INSTAGRAM.decode(id);
//! assert_eq!(parts.shard, id.shard());
//! // IDs minted in an hour form one range, found with the primary key alone.
//! let (from, to) = (Id::min_at(id.created_at())?, Id::max_at(id.created_at())?);
//! assert!(from <= id && id <= to);
//! # Ok::<(), shardline_id::Error>(())
//! ```
#![forbid(unsafe_code)]
#![doc(test(attr(deny(warnings))))]

mod error;
mod external;
pub mod generator;
mod id;
pub mod ident;
mod layout;
pub mod sql;

pub use error::{Error, ParseIdError, Result};
#[cfg(feature = "serde")]
pub use external::serde_support as serde;
pub use layout::{INSTAGRAM_EPOCH_MS, IdParts, Layout};

// Defined here, not in `id`, so that `std::any::type_name::<Id>()` (which sqlx's
// "mismatched types" error prints) is the path users know: `shardline_id::Id`.
/// A 64-bit shard ID: `| ms since epoch | logical shard | sequence |`, stored as a
/// non-negative Postgres `bigint`.
///
/// The field widths and epoch live in a [`Layout`]; the methods without a layout
/// argument use [`Layout::INSTAGRAM`]. IDs order by the time they are dated with across
/// shards (to the millisecond), and in the order they were minted within one shard; that
/// date is the creation time within the bounds `docs/ids.md` gives.
///
/// Text forms: decimal ([`std::fmt::Display`], [`std::str::FromStr`]) and a 13-character, URL-safe,
/// order-preserving Crockford base32 form ([`Id::to_compact`], [`Id::from_compact`]).
/// With the `serde` feature, human-readable formats (JSON) get the decimal *string*,
/// because JavaScript numbers lose integers above 2^53; binary formats get the `i64`.
///
/// ```
/// use shardline_id::Id;
///
/// let id = Id::from_parts(1_700_000_000_000, 42, 7)?;
/// assert_eq!((id.unix_ms(), id.shard(), id.sequence()), (1_700_000_000_000, 42, 7));
/// assert_eq!(id.to_string().parse::<Id>().unwrap(), id);
/// assert_eq!(Id::from_compact(&id.to_compact()).unwrap(), id);
/// # Ok::<(), shardline_id::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct Id(i64);

#[cfg(test)]
mod tests;
