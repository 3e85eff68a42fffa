//! [`Id`]'s methods and text forms (the type itself is defined at the crate root, so
//! that its path, in sqlx's and others' messages, is `shardline_id::Id`).

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::ParseKind;
use crate::{Error, Id, IdParts, Layout, ParseIdError, Result};

impl Id {
    /// Wraps a value known to be non-negative (crate-internal).
    pub(crate) const fn from_raw(value: i64) -> Id {
        debug_assert!(value >= 0);
        Id(value)
    }

    /// The ID stored as `value`.
    ///
    /// # Errors
    ///
    /// [`Error::Negative`]: no ID is negative.
    pub fn from_i64(value: i64) -> Result<Id> {
        if value < 0 { Err(Error::Negative { value }) } else { Ok(Id(value)) }
    }

    /// The value stored in Postgres.
    pub const fn as_i64(self) -> i64 {
        self.0
    }

    /// Composes an ID with [`Layout::INSTAGRAM`].
    ///
    /// # Errors
    ///
    /// When the time is outside the layout's range or the shard or sequence do not fit.
    pub fn from_parts(unix_ms: i64, shard: u32, sequence: u32) -> Result<Id> {
        Layout::INSTAGRAM.compose(unix_ms, shard, sequence)
    }

    /// Splits the ID with `layout`.
    pub const fn parts(self, layout: Layout) -> IdParts {
        layout.decode(self)
    }

    /// Creation time in ms since the Unix epoch ([`Layout::INSTAGRAM`]).
    pub const fn unix_ms(self) -> i64 {
        Layout::INSTAGRAM.decode(self).unix_ms
    }

    /// The logical shard that minted the ID ([`Layout::INSTAGRAM`]).
    pub const fn shard(self) -> u32 {
        Layout::INSTAGRAM.shard_of(self)
    }

    /// The sequence number ([`Layout::INSTAGRAM`]).
    pub const fn sequence(self) -> u32 {
        Layout::INSTAGRAM.decode(self).sequence
    }

    /// Creation time ([`Layout::INSTAGRAM`]).
    pub fn created_at(self) -> SystemTime {
        created_at(self.unix_ms())
    }

    /// The smallest ID of instant `t` ([`Layout::INSTAGRAM`]); see [`Layout::min_id_at`].
    ///
    /// # Errors
    ///
    /// When `t` is outside the layout's range.
    pub fn min_at(t: SystemTime) -> Result<Id> {
        Layout::INSTAGRAM.min_id_at(unix_ms_of(t))
    }

    /// The largest ID of instant `t` ([`Layout::INSTAGRAM`]); see [`Layout::max_id_at`].
    ///
    /// # Errors
    ///
    /// When `t` is outside the layout's range.
    pub fn max_at(t: SystemTime) -> Result<Id> {
        Layout::INSTAGRAM.max_id_at(unix_ms_of(t))
    }

    /// The 13-character Crockford base32 form: URL-safe, and sorting the strings sorts
    /// the IDs.
    pub fn to_compact(self) -> String {
        let mut out = [0u8; COMPACT_LEN];
        let mut v = self.0.unsigned_abs();
        for slot in out.iter_mut().rev() {
            *slot = CROCKFORD[usize::from(low5(v))];
            v >>= 5;
        }
        out.iter().map(|&b| char::from(b)).collect()
    }

    /// Parses the form [`Id::to_compact`] makes (case-insensitive).
    ///
    /// # Errors
    ///
    /// When `s` is not 13 base32 characters or is past the largest ID.
    pub fn from_compact(s: &str) -> std::result::Result<Id, ParseIdError> {
        if s.is_empty() {
            return Err(ParseIdError(ParseKind::Empty));
        }
        let len = s.chars().count();
        if len != COMPACT_LEN {
            return Err(ParseIdError(ParseKind::WrongLength { len, expected: COMPACT_LEN }));
        }
        let mut v: u64 = 0;
        for (at, c) in s.chars().enumerate() {
            let digit = crockford_value(c).ok_or(ParseIdError(ParseKind::InvalidDigit {
                at,
                found: c,
                form: "compact",
            }))?;
            v = (v << 5) | u64::from(digit);
            // 13 digits hold 65 bits: the first may carry at most 3.
            if at == 0 && digit > 7 {
                return Err(ParseIdError(ParseKind::TooLarge));
            }
        }
        i64::try_from(v).map(Id).map_err(|_| ParseIdError(ParseKind::TooLarge))
    }
}

/// Length of the compact form: 13 × 5 bits ≥ 63.
const COMPACT_LEN: usize = 13;
const CROCKFORD: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";

fn low5(v: u64) -> u8 {
    // The mask keeps 5 bits; the conversion cannot fail.
    u8::try_from(v & 0x1f).unwrap_or(0)
}

fn crockford_value(c: char) -> Option<u8> {
    let upper = c.to_ascii_uppercase();
    CROCKFORD.iter().position(|&b| char::from(b) == upper).and_then(|p| u8::try_from(p).ok())
}

pub(crate) fn created_at(unix_ms: i64) -> SystemTime {
    match u64::try_from(unix_ms) {
        Ok(ms) => UNIX_EPOCH + Duration::from_millis(ms),
        Err(_) => UNIX_EPOCH - Duration::from_millis(unix_ms.unsigned_abs()),
    }
}

/// `t` in ms since the Unix epoch, saturating far outside any layout's range.
pub(crate) fn unix_ms_of(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(e) => i64::try_from(e.duration().as_millis()).map_or(i64::MIN, |ms| -ms),
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Id({})", self.0)
    }
}

impl FromStr for Id {
    type Err = ParseIdError;

    /// Parses the decimal form: ASCII digits only (no sign, no spaces).
    fn from_str(s: &str) -> std::result::Result<Id, ParseIdError> {
        if s.is_empty() {
            return Err(ParseIdError(ParseKind::Empty));
        }
        if s.starts_with('-') && s.len() > 1 && s[1..].bytes().all(|b| b.is_ascii_digit()) {
            return Err(ParseIdError(ParseKind::Negative));
        }
        let mut v: i64 = 0;
        for (at, c) in s.chars().enumerate() {
            let digit = c
                .to_digit(10)
                .filter(|_| c.is_ascii_digit())
                .ok_or(ParseIdError(ParseKind::InvalidDigit { at, found: c, form: "decimal" }))?;
            v = v
                .checked_mul(10)
                .and_then(|v| v.checked_add(i64::from(digit)))
                .ok_or(ParseIdError(ParseKind::TooLarge))?;
        }
        Ok(Id(v))
    }
}

impl TryFrom<i64> for Id {
    type Error = Error;

    fn try_from(value: i64) -> Result<Id> {
        Id::from_i64(value)
    }
}

impl From<Id> for i64 {
    fn from(id: Id) -> i64 {
        id.0
    }
}
