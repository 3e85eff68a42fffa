//! Every way an ID comes in from outside: decimal and compact text, JSON, the database's
//! binary `BIGINT`, a raw `i64`; and every ID layout with any times, shards and
//! sequences. Nothing may panic; whatever parses must print back to itself, and
//! whatever composes must decode to its parts.
#![no_main]

use std::str::FromStr;

use libfuzzer_sys::fuzz_target;
use postgres_types::{FromSql, Type};
use shardline_id::{Id, Layout};

type Input<'a> = (&'a str, &'a [u8], (u8, u8, u8, i64), (i64, u32, u32), i64);

fuzz_target!(|input: Input<'_>| {
    let (text, raw, (tb, sb, qb, epoch), (ms, shard, seq), value) = input;

    if let Ok(id) = Id::from_str(text) {
        assert_eq!(Id::from_str(&id.to_string()).ok(), Some(id));
    }
    if let Ok(id) = Id::from_compact(text) {
        assert_eq!(Id::from_compact(&id.to_compact()).ok(), Some(id));
    }
    let _ = serde_json::from_str::<Id>(text);
    if let Ok(quoted) = serde_json::to_string(text)
        && let Ok(id) = serde_json::from_str::<Id>(&quoted)
    {
        assert_eq!(
            serde_json::from_str::<Id>(&serde_json::to_string(&id).unwrap_or_default()).ok(),
            Some(id)
        );
    }
    let _ = <Id as FromSql>::from_sql(&Type::INT8, raw);
    let _ = <Id as FromSql>::from_sql(&Type::TEXT, raw);

    if let Ok(id) = Id::from_i64(value) {
        let _ = (id.unix_ms(), id.shard(), id.sequence(), id.created_at(), id.to_compact());
    }
    if let Ok(layout) = Layout::new(tb, sb, qb, epoch) {
        if let Ok(id) = layout.compose(ms, shard, seq) {
            let parts = layout.decode(id);
            assert_eq!((parts.unix_ms, parts.shard, parts.sequence), (ms, shard, seq), "{layout:?}");
            assert_eq!(layout.shard_of(id), shard);
        }
        let _ = (layout.ticks(ms), layout.min_id_at(ms), layout.max_id_at(ms), layout.sequence_value_at(ms));
        let _ = layout.id_from_sequence_value(value, shard);
        if let Ok(id) = Id::from_i64(value) {
            let _ = (layout.decode(id), layout.sequence_value_of(id));
        }
        let _ = (layout.negative_from_unix_ms(), layout.exhausted_from_unix_ms(), layout.last_unix_ms());
    }
});
