//! tokio-postgres (`postgres-types`) for [`Id`]: a `BIGINT`, validated when read.

use std::error::Error as StdError;

use bytes::BytesMut;
use postgres_types::{FromSql, IsNull, ToSql, Type, accepts, to_sql_checked};

use crate::Id;

impl<'a> FromSql<'a> for Id {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> Result<Id, Box<dyn StdError + Sync + Send>> {
        let v = i64::from_sql(ty, raw)?;
        Ok(Id::from_i64(v)?)
    }

    accepts!(INT8);
}

impl ToSql for Id {
    fn to_sql(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, Box<dyn StdError + Sync + Send>> {
        self.as_i64().to_sql(ty, out)
    }

    accepts!(INT8);
    to_sql_checked!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_negatives() {
        let id = Id::from_i64(1_436_985_812_374_127_403).unwrap();
        let mut buf = BytesMut::new();
        id.to_sql(&Type::INT8, &mut buf).unwrap();
        assert_eq!(Id::from_sql(&Type::INT8, &buf).unwrap(), id);
        let mut neg = BytesMut::new();
        (-3i64).to_sql(&Type::INT8, &mut neg).unwrap();
        let err = Id::from_sql(&Type::INT8, &neg).unwrap_err();
        assert_eq!(err.to_string(), "-3 is negative, and no ID is");
        assert!(Id::from_sql(&Type::INT8, &[1, 2, 3]).is_err(), "a short buffer must be refused");
        assert!(<Id as FromSql>::accepts(&Type::INT8));
        assert!(!<Id as FromSql>::accepts(&Type::INT4));
    }
}
