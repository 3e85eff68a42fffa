//! The bit layout of an ID: field widths and epoch, as one validated value.

use std::fmt;

use crate::{Error, Id, Result};

/// How an ID's 64 bits are shared out, and from when its clock counts.
///
/// ```text
/// | timestamp_bits: ms since epoch | shard_bits: logical shard | sequence_bits: sequence |
/// ```
///
/// One `Layout` feeds both the Rust minter and decoder and the SQL that
/// [`crate::sql::ShardSql`] installs in every shard schema, so the two cannot disagree.
///
/// # The sign bit
///
/// IDs are Postgres `bigint`s. When the widths add up to 64 (as in
/// [`Layout::INSTAGRAM`]), the timestamp's top bit is the sign bit: IDs would turn
/// negative `2^(timestamp_bits-1)` ms after the epoch and stop sorting by time. Such a
/// layout stops minting there ([`Layout::last_unix_ms`]): with Instagram's widths and
/// epoch that is 2046-06-27, 34.8 years after the epoch, not 2081, when the 41 bits
/// run out. A 63-bit layout (for example 40/13/10) keeps the sign bit clear throughout.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    timestamp_bits: u8,
    shard_bits: u8,
    sequence_bits: u8,
    epoch_ms: i64,
}

/// Instagram's epoch: 2011-08-24T21:07:01.721Z, in ms since the Unix epoch.
pub const INSTAGRAM_EPOCH_MS: i64 = 1_314_220_021_721;

impl Layout {
    /// Instagram's layout: 41 bits of ms since 2011-08-24T21:07:01.721Z, 13 bits of
    /// logical shard (8192 shards), 10 bits of sequence (1024 IDs per ms per shard).
    pub const INSTAGRAM: Layout =
        Layout { timestamp_bits: 41, shard_bits: 13, sequence_bits: 10, epoch_ms: INSTAGRAM_EPOCH_MS };

    /// A layout with these field widths and epoch (ms since the Unix epoch).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidLayout`] unless: the widths add up to at most 64; the timestamp has
    /// 1 to 62 bits; the sequence has 1 to 22 bits; the shard at most 16; the epoch is
    /// not negative, and the layout's last millisecond fits an `i64`.
    pub fn new(timestamp_bits: u8, shard_bits: u8, sequence_bits: u8, epoch_ms: i64) -> Result<Layout> {
        let invalid = |reason| Err(Error::InvalidLayout { reason });
        if timestamp_bits as u32 + shard_bits as u32 + sequence_bits as u32 > 64 {
            return invalid("the field widths add up to more than 64 bits");
        }
        if timestamp_bits == 0 || timestamp_bits > 62 {
            return invalid("the timestamp needs 1 to 62 bits");
        }
        if sequence_bits == 0 || sequence_bits > 22 {
            return invalid("the sequence needs 1 to 22 bits");
        }
        if shard_bits > 16 {
            return invalid("the shard has at most 16 bits");
        }
        if epoch_ms < 0 {
            return invalid("the epoch cannot be before 1970");
        }
        let layout = Layout { timestamp_bits, shard_bits, sequence_bits, epoch_ms };
        if epoch_ms.checked_add(layout.usable_ticks()).is_none() {
            return invalid("the epoch is so late that the layout's end overflows");
        }
        Ok(layout)
    }

    /// The same widths with another epoch.
    ///
    /// # Errors
    ///
    /// As [`Layout::new`].
    pub fn with_epoch(self, epoch_ms: i64) -> Result<Layout> {
        Layout::new(self.timestamp_bits, self.shard_bits, self.sequence_bits, epoch_ms)
    }

    /// Width of the timestamp field.
    pub const fn timestamp_bits(self) -> u8 {
        self.timestamp_bits
    }

    /// Width of the logical-shard field.
    pub const fn shard_bits(self) -> u8 {
        self.shard_bits
    }

    /// Width of the sequence field.
    pub const fn sequence_bits(self) -> u8 {
        self.sequence_bits
    }

    /// The epoch, in ms since the Unix epoch.
    pub const fn epoch_ms(self) -> i64 {
        self.epoch_ms
    }

    /// Where the shard field starts.
    pub const fn shard_shift(self) -> u8 {
        self.sequence_bits
    }

    /// Where the timestamp field starts.
    pub const fn timestamp_shift(self) -> u8 {
        self.sequence_bits + self.shard_bits
    }

    /// The largest logical shard the layout can hold (8191 for Instagram's).
    pub const fn max_shard(self) -> u32 {
        (1u32 << self.shard_bits) - 1
    }

    /// The largest sequence number (1023 for Instagram's).
    pub const fn max_sequence(self) -> u32 {
        (1u32 << self.sequence_bits) - 1
    }

    /// IDs one shard can mint per millisecond without borrowing the next one.
    pub const fn ids_per_ms(self) -> u32 {
        1u32 << self.sequence_bits
    }

    /// Whether the timestamp's top bit is the `bigint` sign bit (the widths add to 64).
    pub const fn uses_sign_bit(self) -> bool {
        self.timestamp_bits as u32 + self.shard_bits as u32 + self.sequence_bits as u32 == 64
    }

    /// Milliseconds after the epoch that can be minted: fewer than the timestamp field
    /// holds when its top bit is the sign bit.
    const fn usable_ticks(self) -> i64 {
        if self.uses_sign_bit() { 1i64 << (self.timestamp_bits - 1) } else { 1i64 << self.timestamp_bits }
    }

    /// The first instant (ms since the Unix epoch) whose IDs would be negative as a
    /// `bigint`, when the layout uses the sign bit.
    pub const fn negative_from_unix_ms(self) -> Option<i64> {
        if self.uses_sign_bit() { Some(self.epoch_ms + (1i64 << (self.timestamp_bits - 1))) } else { None }
    }

    /// The first instant (ms since the Unix epoch) the timestamp field cannot hold.
    /// `None` when that is past `i64::MAX` ms (the layout stops earlier anyway).
    pub const fn exhausted_from_unix_ms(self) -> Option<i64> {
        self.epoch_ms.checked_add(1i64 << self.timestamp_bits)
    }

    /// The last instant (ms since the Unix epoch) the layout mints IDs for: before the
    /// IDs turn negative and before the timestamp runs out.
    pub const fn last_unix_ms(self) -> i64 {
        self.epoch_ms + self.usable_ticks() - 1
    }

    /// The largest value a shard's sequence may hold: `(last ms since epoch << sequence_bits) | max sequence`.
    pub const fn max_sequence_value(self) -> i64 {
        // Not `(ticks << sequence_bits) - 1`: with no shard bits and the sign bit in use
        // that shift reaches 2^63 (found by the fuzzer).
        ((self.usable_ticks() - 1) << self.sequence_bits) | self.max_sequence() as i64
    }

    /// Milliseconds since the epoch for `unix_ms`, checked against the layout's range.
    ///
    /// # Errors
    ///
    /// [`Error::BeforeEpoch`] or [`Error::AfterEnd`].
    pub fn ticks(self, unix_ms: i64) -> Result<i64> {
        if unix_ms < self.epoch_ms {
            return Err(Error::BeforeEpoch { unix_ms, epoch_ms: self.epoch_ms });
        }
        if unix_ms > self.last_unix_ms() {
            return Err(Error::AfterEnd { unix_ms, last_unix_ms: self.last_unix_ms() });
        }
        Ok(unix_ms - self.epoch_ms)
    }

    /// Composes an ID from its parts.
    ///
    /// # Errors
    ///
    /// When the time is outside the layout's range, or the shard or sequence do not fit.
    pub fn compose(self, unix_ms: i64, shard: u32, sequence: u32) -> Result<Id> {
        let ticks = self.ticks(unix_ms)?;
        if shard > self.max_shard() {
            return Err(Error::ShardOutOfRange { shard, max: self.max_shard() });
        }
        if sequence > self.max_sequence() {
            return Err(Error::SequenceOutOfRange { sequence, max: self.max_sequence() });
        }
        // ticks < 2^(timestamp_bits or timestamp_bits-1), so the shifted value stays
        // below 2^63: no overflow, no sign.
        Ok(Id::from_raw(
            (ticks << self.timestamp_shift()) | ((shard as i64) << self.shard_shift()) | sequence as i64,
        ))
    }

    /// Splits an ID into its parts. Pure arithmetic: it cannot fail. (An ID that this
    /// layout did not mint, read from outside, may decode to a time past the layout's
    /// range; with an epoch near `i64::MAX` that time saturates rather than overflows, as
    /// the fuzzer found it could.)
    pub const fn decode(self, id: Id) -> IdParts {
        let raw = id.as_i64();
        IdParts {
            unix_ms: self.epoch_ms.saturating_add(raw >> self.timestamp_shift()),
            shard: field(raw, self.shard_shift(), self.max_shard()),
            sequence: field(raw, 0, self.max_sequence()),
        }
    }

    /// The logical shard inside an ID: what a read by ID routes on.
    pub const fn shard_of(self, id: Id) -> u32 {
        field(id.as_i64(), self.shard_shift(), self.max_shard())
    }

    /// The smallest ID any shard can mint at `unix_ms`: with [`Layout::max_id_at`],
    /// `min_id_at(t0) ..= max_id_at(t1)` is the ID range of rows whose IDs are dated in
    /// `[t0, t1]`, answerable from the primary-key index alone (an ID's date is its
    /// creation time within the bounds `docs/ids.md` gives, not to the millisecond).
    ///
    /// # Errors
    ///
    /// When the time is outside the layout's range.
    pub fn min_id_at(self, unix_ms: i64) -> Result<Id> {
        self.compose(unix_ms, 0, 0)
    }

    /// The largest ID any shard can mint at `unix_ms`.
    ///
    /// # Errors
    ///
    /// When the time is outside the layout's range.
    pub fn max_id_at(self, unix_ms: i64) -> Result<Id> {
        self.compose(unix_ms, self.max_shard(), self.max_sequence())
    }

    /// The ID a shard's sequence value stands for. A shard's sequence counts
    /// `(ms since epoch << sequence_bits) | counter`, so one `nextval` carries both the
    /// time and the sequence fields (see `docs/ids.md`).
    ///
    /// # Errors
    ///
    /// When the value is negative or past [`Layout::max_sequence_value`], or the shard
    /// does not fit.
    pub fn id_from_sequence_value(self, value: i64, shard: u32) -> Result<Id> {
        if value < 0 || value > self.max_sequence_value() {
            return Err(Error::SequenceValueOutOfRange { value, max: self.max_sequence_value() });
        }
        if shard > self.max_shard() {
            return Err(Error::ShardOutOfRange { shard, max: self.max_shard() });
        }
        let ticks = value >> self.sequence_bits;
        let sequence = value & (self.max_sequence() as i64);
        Ok(Id::from_raw(
            (ticks << self.timestamp_shift()) | ((shard as i64) << self.shard_shift()) | sequence,
        ))
    }

    /// The sequence value an ID was minted from (its time and sequence fields).
    pub const fn sequence_value_of(self, id: Id) -> i64 {
        ((id.as_i64() >> self.timestamp_shift()) << self.sequence_bits)
            | (id.as_i64() & self.max_sequence() as i64)
    }

    /// The sequence value for the first ID of `unix_ms`.
    ///
    /// # Errors
    ///
    /// When the time is outside the layout's range.
    pub fn sequence_value_at(self, unix_ms: i64) -> Result<i64> {
        Ok(self.ticks(unix_ms)? << self.sequence_bits)
    }
}

/// The field of `raw` at `shift`, `mask` wide (at most 22 bits).
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "masked to at most 22 bits of a non-negative value first; `TryFrom` is not const"
)]
const fn field(raw: i64, shift: u8, mask: u32) -> u32 {
    ((raw >> shift) & mask as i64) as u32
}

impl Default for Layout {
    fn default() -> Self {
        Layout::INSTAGRAM
    }
}

impl fmt::Debug for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Layout({}/{}/{}, epoch {} ms)",
            self.timestamp_bits, self.shard_bits, self.sequence_bits, self.epoch_ms
        )
    }
}

/// An ID split into its fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IdParts {
    /// Creation time, in ms since the Unix epoch.
    pub unix_ms: i64,
    /// The logical shard that minted it.
    pub shard: u32,
    /// Its sequence number within that millisecond and shard.
    pub sequence: u32,
}

const _: () = {
    let l = Layout::INSTAGRAM;
    assert!(l.timestamp_shift() == 23 && l.shard_shift() == 10);
    assert!(l.max_shard() == 8191 && l.ids_per_ms() == 1024);
    assert!(l.uses_sign_bit());
};
