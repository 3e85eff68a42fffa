//! sqlx for [`Id`]: a Postgres `BIGINT`, validated when decoded.

use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgHasArrayType, PgTypeInfo, PgValueRef, Postgres};
use sqlx::{Decode, Encode, Type};

use crate::Id;

impl Type<Postgres> for Id {
    fn type_info() -> PgTypeInfo {
        <i64 as Type<Postgres>>::type_info()
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        <i64 as Type<Postgres>>::compatible(ty)
    }
}

impl PgHasArrayType for Id {
    fn array_type_info() -> PgTypeInfo {
        <i64 as PgHasArrayType>::array_type_info()
    }
}

impl Encode<'_, Postgres> for Id {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        <i64 as Encode<'_, Postgres>>::encode_by_ref(&self.as_i64(), buf)
    }
}

impl<'r> Decode<'r, Postgres> for Id {
    fn decode(value: PgValueRef<'r>) -> Result<Id, BoxDynError> {
        let v = <i64 as Decode<'r, Postgres>>::decode(value)?;
        Ok(Id::from_i64(v)?)
    }
}
