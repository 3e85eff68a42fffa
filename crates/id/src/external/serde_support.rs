//! serde for [`Id`]: a decimal string in human-readable formats (JSON numbers above 2^53
//! are not safe in JavaScript), an `i64` in binary ones.
//!
//! Deserializing a human-readable format also accepts a non-negative integer, so
//! clients that sent numbers keep working.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::Id;

impl Serialize for Id {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if serializer.is_human_readable() {
            serializer.collect_str(self)
        } else {
            serializer.serialize_i64(self.as_i64())
        }
    }
}

struct IdVisitor;

impl Visitor<'_> for IdVisitor {
    type Value = Id;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a non-negative 64-bit ID, as a decimal string or an integer")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Id, E> {
        v.parse().map_err(E::custom)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Id, E> {
        Id::from_i64(v).map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Id, E> {
        i64::try_from(v)
            .map_err(|_| E::custom(format_args!("{v} is past the largest ID")))
            .and_then(|v| self.visit_i64(v))
    }
}

impl<'de> Deserialize<'de> for Id {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Id, D::Error> {
        if deserializer.is_human_readable() {
            deserializer.deserialize_any(IdVisitor)
        } else {
            deserializer.deserialize_i64(IdVisitor)
        }
    }
}

/// `#[serde(with = "shardline_id::serde::as_i64")]`: the ID as an integer in every
/// format, for consumers that hold 64-bit integers safely.
pub mod as_i64 {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::Id;

    /// Serializes the ID as an `i64`.
    ///
    /// # Errors
    ///
    /// The serializer's.
    pub fn serialize<S: Serializer>(id: &Id, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_i64(id.as_i64())
    }

    /// Deserializes an `i64` into an ID, refusing negative values.
    ///
    /// # Errors
    ///
    /// The deserializer's, or a negative value.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Id, D::Error> {
        let v = i64::deserialize(deserializer)?;
        Id::from_i64(v).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use serde_test::{Configure, Token, assert_de_tokens, assert_de_tokens_error, assert_tokens};

    use crate::Id;

    #[test]
    fn human_readable_is_a_decimal_string() {
        let id = Id::from_i64(1_436_985_812_374_127_403).unwrap();
        assert_tokens(&id.readable(), &[Token::Str("1436985812374127403")]);
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"1436985812374127403\"");
        assert_eq!(serde_json::from_str::<Id>("\"1436985812374127403\"").unwrap(), id);
        assert_eq!(serde_json::from_str::<Id>("1436985812374127403").unwrap(), id);
    }

    #[test]
    fn binary_is_an_i64() {
        let id = Id::from_i64(42).unwrap();
        assert_tokens(&id.compact(), &[Token::I64(42)]);
    }

    #[test]
    fn bad_input_is_refused_with_a_reason() {
        assert_de_tokens_error::<serde_test::Readable<Id>>(&[Token::I64(-1)], "-1 is negative, and no ID is");
        assert_de_tokens_error::<serde_test::Compact<Id>>(&[Token::I64(-1)], "-1 is negative, and no ID is");
        let err = serde_json::from_str::<Id>("\"12a\"").unwrap_err().to_string();
        assert!(err.contains("invalid character 'a' at position 2"), "{err}");
        let err = serde_json::from_str::<Id>("18446744073709551615").unwrap_err().to_string();
        assert!(err.contains("past the largest ID"), "{err}");
        let err = serde_json::from_str::<Id>("\"-5\"").unwrap_err().to_string();
        assert!(err.contains("cannot be negative"), "{err}");
        let err = serde_json::from_str::<Id>("1.5").unwrap_err().to_string();
        assert!(err.contains("a non-negative 64-bit ID"), "{err}");
    }

    #[test]
    fn as_i64_writes_numbers_everywhere() {
        #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
        struct Row {
            #[serde(with = "crate::serde::as_i64")]
            id: Id,
        }
        let row = Row { id: Id::from_i64(7).unwrap() };
        assert_eq!(serde_json::to_string(&row).unwrap(), r#"{"id":7}"#);
        assert_eq!(serde_json::from_str::<Row>(r#"{"id":7}"#).unwrap(), row);
        assert!(serde_json::from_str::<Row>(r#"{"id":-7}"#).is_err());
        assert_de_tokens(&Id::from_i64(3).unwrap().readable(), &[Token::U64(3)]);
    }
}
