//! shardline operations as a library: apply `migrations/` to every shard schema, move
//! logical shards between hosts online, plan rebalancing.
//!
//! This crate is still empty; it arrives with the `[catalog]` and `[moves]` issues.
#![forbid(unsafe_code)]
