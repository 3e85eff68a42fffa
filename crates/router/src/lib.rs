//! Pure routing for shardline: `user_id` → logical shard → schema → host.
//!
//! No I/O and no async: the shard map and its validation live here so that every other
//! crate routes the same way. This crate is still empty; it arrives with the `[catalog]`
//! issue.
#![forbid(unsafe_code)]
