//! The ID crate's errors.

use std::fmt;

/// What can go wrong building a layout or minting, composing or converting an ID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The bit widths or the epoch do not make a usable layout.
    #[error("invalid ID layout: {reason}")]
    InvalidLayout {
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The time is before the layout's epoch.
    #[error("time {unix_ms} ms is before the layout's epoch ({epoch_ms} ms)")]
    BeforeEpoch {
        /// The time asked for, in ms since the Unix epoch.
        unix_ms: i64,
        /// The layout's epoch, in ms since the Unix epoch.
        epoch_ms: i64,
    },

    /// The time is past the last millisecond the layout can mint: the IDs would be
    /// negative as a `bigint`, or the timestamp field would overflow.
    #[error("time {unix_ms} ms is past the layout's last usable millisecond ({last_unix_ms} ms)")]
    AfterEnd {
        /// The time asked for, in ms since the Unix epoch.
        unix_ms: i64,
        /// The last time the layout can mint, in ms since the Unix epoch.
        last_unix_ms: i64,
    },

    /// The logical shard does not fit the layout's shard field.
    #[error("shard {shard} is out of range 0..={max}")]
    ShardOutOfRange {
        /// The shard asked for.
        shard: u32,
        /// The largest shard the layout can hold.
        max: u32,
    },

    /// The sequence number does not fit the layout's sequence field.
    #[error("sequence {sequence} is out of range 0..={max}")]
    SequenceOutOfRange {
        /// The sequence asked for.
        sequence: u32,
        /// The largest sequence the layout can hold.
        max: u32,
    },

    /// IDs are non-negative `bigint`s; this value is negative.
    #[error("{value} is negative, and no ID is")]
    Negative {
        /// The value found.
        value: i64,
    },

    /// A sequence value (time and counter, as the shard's sequence hands them out) is
    /// outside what the layout can turn into an ID.
    #[error("sequence value {value} is out of the layout's range 0..={max}")]
    SequenceValueOutOfRange {
        /// The value found.
        value: i64,
        /// The largest sequence value the layout can turn into an ID.
        max: i64,
    },

    /// A range given to [`crate::generator::ReservedBlocks::push`] whose first value is
    /// past its last.
    #[error("reserved range {first}..={last} is empty: its first value is past its last")]
    ReservedEmpty {
        /// The first value of the range given.
        first: i64,
        /// The last value of the range given.
        last: i64,
    },

    /// Sequence values given to [`crate::generator::ReservedBlocks::push`] that are not
    /// all above those given before: a range given twice, or out of order, would hand
    /// out its values again.
    #[error("reserved values {first}..={last} are not above those reserved before (up to {held})")]
    ReservedOutOfOrder {
        /// The first value of the range given.
        first: i64,
        /// The last value of the range given.
        last: i64,
        /// The largest value reserved before.
        held: i64,
    },

    /// A generator would hand out an ID further ahead of its clock than it may (more
    /// IDs were asked for than the layout holds per millisecond, for too long).
    #[error("minting now would run {ahead_ms} ms ahead of the clock (at most {max_ahead_ms} ms allowed)")]
    TooFarAhead {
        /// How far ahead of the clock the next ID would be.
        ahead_ms: i64,
        /// The generator's bound.
        max_ahead_ms: i64,
    },

    /// A name given to the SQL renderer cannot be a Postgres identifier.
    #[error("{name:?} cannot name a schema: {reason}")]
    InvalidSchemaName {
        /// The name given.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A name that is not a plain SQL identifier ([`crate::ident::Ident::new`]).
    #[error("{name:?} is not a plain SQL identifier: it {reason}")]
    InvalidIdentifier {
        /// The name given.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },
}

/// The ID crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The text given is not an ID.
///
/// Opaque, like `uuid::Error`: its message names what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseIdError(pub(crate) ParseKind);

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ParseKind {
    Empty,
    InvalidDigit { at: usize, found: char, form: &'static str },
    Negative,
    TooLarge,
    WrongLength { len: usize, expected: usize },
}

impl fmt::Display for ParseIdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            ParseKind::Empty => f.write_str("an ID cannot be empty"),
            ParseKind::InvalidDigit { at, found, form } => {
                write!(f, "invalid character {found:?} at position {at} of a {form} ID")
            }
            ParseKind::Negative => f.write_str("an ID cannot be negative"),
            ParseKind::TooLarge => write!(f, "an ID is at most {}", i64::MAX),
            ParseKind::WrongLength { len, expected } => {
                write!(f, "a compact ID has {expected} characters, not {len}")
            }
        }
    }
}

impl std::error::Error for ParseIdError {}

const _: () = {
    const fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<Error>();
    assert_send_sync::<ParseIdError>();
};
