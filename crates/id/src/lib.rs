//! Mint and decode shardline's 64-bit IDs.
//!
//! An ID is `| 41 bits: ms since the epoch | 13 bits: logical shard | 10 bits: sequence |`,
//! stored as a Postgres `bigint`, so a read by ID can be routed by the shard inside it.
//!
//! This crate is still empty: the layout, the `Id` newtype and the SQL that mints IDs
//! inside each shard schema arrive with the `[ids]` issue. See `docs/` for the design.
#![forbid(unsafe_code)]
