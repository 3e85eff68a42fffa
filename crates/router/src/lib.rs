//! Pure routing for shardline: `user_id` → logical shard → schema → host.
//!
//! No I/O and no async, so that every other crate routes exactly the same way:
//!
//! - [`ShardCount::shard_of_user`]: `user_id mod logical_shards` (Euclidean, so negative
//!   IDs land in range too), [`ShardCount::shard_of_key`] for string keys
//!   ([`hash::key_hash`], FNV-1a 64, documented and stable);
//! - [`SchemaPrefix::schema`]: the one function that makes schema names
//!   (`shard_0005`);
//! - [`ShardMap`]: which host holds each logical shard, with a version; validated so
//!   that every shard is mapped exactly once to a known host;
//! - [`config`]: the TOML file operators write, validated on load.
//!
//! # Layout
//!
//! - [`shard`]: the domain newtypes.
//! - [`map`]: the shard map, even placement, routes.
//! - [`hash`]: the string-key hash.
//! - [`config`]: the configuration file.
//!
//! # Example
//!
//! ```
//! use shardline_router::{SchemaPrefix, ShardCount};
//!
//! let shards = ShardCount::new(2000)?;
//! let shard = shards.shard_of_user(1_000_003);
//! assert_eq!(shard.get(), 3);
//! assert_eq!(SchemaPrefix::new("shard_")?.schema(shard).as_str(), "shard_0003");
//! // Negative user IDs land in range too.
//! assert_eq!(shards.shard_of_user(-1).get(), 1999);
//! # Ok::<(), shardline_router::Error>(())
//! ```
#![forbid(unsafe_code)]

pub mod config;
pub mod hash;
pub mod map;
pub mod shard;

pub mod tls;

pub use config::Config;
pub use map::{Route, ShardMap};
pub use shard::{HostName, LogicalShard, RoleName, SchemaName, SchemaPrefix, ShardCount};

/// What routing refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A number of logical shards outside what a 13-bit shard field holds.
    #[error("logical_shards = {count} is out of range 1..=8192")]
    ShardCountOutOfRange {
        /// The count given.
        count: i64,
    },
    /// A logical shard at or past the shard count.
    #[error("logical shard {shard} is out of range 0..{count}")]
    ShardOutOfRange {
        /// The shard.
        shard: i64,
        /// How many shards there are.
        count: u16,
    },
    /// A name that cannot be used.
    #[error("{what} {name:?} is not allowed: {reason}")]
    InvalidName {
        /// What the name is for.
        what: &'static str,
        /// The name.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// A shard map that does not map every shard exactly once to a known host.
    #[error("invalid shard map: {reason}")]
    InvalidMap {
        /// What is wrong, naming the shard or host.
        reason: String,
    },
    /// A problem in the configuration file.
    #[error("{file}:{line}: {key}: {message}")]
    Config {
        /// The file (or source) name.
        file: String,
        /// 1-based line of the offending key.
        line: usize,
        /// The key, dotted (`hosts[1].name`).
        key: String,
        /// What is wrong.
        message: String,
    },
}

/// The router's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

const _: () = {
    const fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<Error>();
};
