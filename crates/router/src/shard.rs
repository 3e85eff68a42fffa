//! The domain newtypes: logical shards, their count, schema, host and role names.

use std::fmt;

use crate::{Error, Result};

/// The most logical shards a 13-bit shard field holds.
pub const MAX_LOGICAL_SHARDS: u16 = 8192;

/// A logical shard: one Postgres schema, `0..logical_shards`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogicalShard(u16);

impl LogicalShard {
    /// Shard `n` of `count`.
    ///
    /// # Errors
    ///
    /// [`Error::ShardOutOfRange`] when `n >= count`.
    pub fn new(n: i64, count: ShardCount) -> Result<Self> {
        u16::try_from(n)
            .ok()
            .filter(|&n| n < count.get())
            .map(LogicalShard)
            .ok_or(Error::ShardOutOfRange { shard: n, count: count.get() })
    }

    /// A shard number checked only against [`MAX_LOGICAL_SHARDS`], for where the
    /// cluster's count is not at hand: a number read back from a table (the journal of
    /// moves) or given on a command line. Check it against the cluster's count with
    /// [`LogicalShard::within`] before routing to it.
    ///
    /// # Errors
    ///
    /// [`Error::ShardOutOfRange`] when `n` is negative or not below
    /// [`MAX_LOGICAL_SHARDS`].
    pub fn bounded(n: i64) -> Result<Self> {
        u16::try_from(n)
            .ok()
            .filter(|&n| n < MAX_LOGICAL_SHARDS)
            .map(LogicalShard)
            .ok_or(Error::ShardOutOfRange { shard: n, count: MAX_LOGICAL_SHARDS })
    }

    /// This shard, checked to be one of `count`.
    ///
    /// # Errors
    ///
    /// [`Error::ShardOutOfRange`] when it is not below `count`.
    pub fn within(self, count: ShardCount) -> Result<Self> {
        LogicalShard::new(i64::from(self.0), count)
    }

    /// The shard number.
    pub const fn get(self) -> u16 {
        self.0
    }
}

impl PartialEq<u16> for LogicalShard {
    fn eq(&self, other: &u16) -> bool {
        self.0 == *other
    }
}

/// A shard serializes as its number (`5`), so JSON output keeps the shape it had when
/// shards were plain integers.
impl serde::Serialize for LogicalShard {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_u16(self.0)
    }
}

impl fmt::Display for LogicalShard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// How many logical shards there are: 1 to 8192. It never changes for a cluster:
/// `user_id mod N` must stay the same, so growing moves shards, never re-buckets rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShardCount(u16);

impl ShardCount {
    /// `n` logical shards.
    ///
    /// # Errors
    ///
    /// [`Error::ShardCountOutOfRange`] unless `1 <= n <= 8192`.
    pub fn new(n: i64) -> Result<Self> {
        u16::try_from(n)
            .ok()
            .filter(|&n| (1..=MAX_LOGICAL_SHARDS).contains(&n))
            .map(ShardCount)
            .ok_or(Error::ShardCountOutOfRange { count: n })
    }

    /// The count.
    pub const fn get(self) -> u16 {
        self.0
    }

    /// The shard of a user: `user_id mod count`, Euclidean, so a negative user ID maps to
    /// `count - (|user_id| mod count)` (or 0) rather than to a negative shard. This is
    /// Instagram's rule (`user_id % 2000`) for the non-negative IDs it had.
    pub fn shard_of_user(self, user_id: i64) -> LogicalShard {
        let n = user_id.rem_euclid(i64::from(self.0));
        // rem_euclid of a positive modulus is in 0..count, which fits u16.
        LogicalShard(u16::try_from(n).unwrap_or(0))
    }

    /// The shard of a string key: [`crate::hash::key_hash`] mod count.
    pub fn shard_of_key(self, key: &str) -> LogicalShard {
        let n = crate::hash::key_hash(key.as_bytes()) % u64::from(self.0);
        LogicalShard(u16::try_from(n).unwrap_or(0))
    }

    /// Every shard, in order.
    pub fn shards(self) -> impl Iterator<Item = LogicalShard> {
        (0..self.0).map(LogicalShard)
    }
}

/// The prefix of the schema names: `shard_` makes `shard_0000` ... `shard_1999`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SchemaPrefix(String);

impl SchemaPrefix {
    /// A prefix of lowercase ASCII letters, digits and underscores, starting with a
    /// letter or underscore, at most 59 bytes (the 4 digits make 63, Postgres's limit).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] otherwise; also for `pg_`, which Postgres reserves.
    pub fn new(prefix: &str) -> Result<Self> {
        let bad = |reason| Err(Error::InvalidName { what: "schema_prefix", name: prefix.to_owned(), reason });
        if prefix.is_empty() || prefix.len() > 59 {
            return bad("must be 1 to 59 bytes");
        }
        if !prefix.starts_with(|c: char| c.is_ascii_lowercase() || c == '_') {
            return bad("must start with a lowercase ASCII letter or an underscore");
        }
        if !prefix.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
            return bad("may hold only lowercase ASCII letters, digits and underscores");
        }
        if prefix.starts_with("pg_") {
            return bad("Postgres reserves names starting with pg_");
        }
        Ok(SchemaPrefix(prefix.to_owned()))
    }

    /// The prefix.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The schema of `shard`: the prefix and the shard number in 4 zero-padded digits.
    /// The only place a schema name is made.
    pub fn schema(&self, shard: LogicalShard) -> SchemaName {
        SchemaName(format!("{}{:04}", self.0, shard.0))
    }
}

impl Default for SchemaPrefix {
    fn default() -> Self {
        SchemaPrefix("shard_".to_owned())
    }
}

/// A shard's schema name. Only [`SchemaPrefix::schema`] makes one, so it is always a
/// plain identifier that is safe to quote.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SchemaName(String);

impl SchemaName {
    /// The bare name (`shard_0005`).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name quoted for SQL (`"shard_0005"`).
    pub fn quoted(&self) -> String {
        shardline_id::ident::quote(&self.0)
    }
}

impl fmt::Display for SchemaName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A physical host's name in the config and catalog: 1–63 ASCII letters, digits, `-`,
/// `_` or `.`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostName(String);

impl HostName {
    /// Checks and wraps a host name.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for anything else.
    pub fn new(name: &str) -> Result<Self> {
        let bad = |reason| Err(Error::InvalidName { what: "host name", name: name.to_owned(), reason });
        if name.is_empty() || name.len() > 63 {
            return bad("must be 1 to 63 bytes");
        }
        if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.') {
            return bad("may hold only ASCII letters, digits, '-', '_' and '.'");
        }
        Ok(HostName(name.to_owned()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name as it goes into an environment variable's name (`{host}` in
    /// `[credentials] password_env`): letters upper-cased, `-`, `_` and `.` as `_`. Two
    /// names of one form (`pg-1`, `pg_1`, `PG.1`) cannot be told apart there, so the
    /// catalog refuses the second (one would be sent the other's password).
    pub fn env_form(&self) -> String {
        self.0.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' }).collect()
    }
}

/// A host name serializes as its string (`"pg1"`).
impl serde::Serialize for HostName {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl PartialEq<str> for HostName {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for HostName {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl fmt::Display for HostName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.0)
    }
}

/// A database role the application connects as, named in the config's `app_roles`:
/// shardline grants it the request path's privileges on every shard (see
/// `docs/operations.md`, "Grants").
///
/// 1–63 bytes of lowercase ASCII letters, digits and underscores, starting with a letter
/// or underscore: a name Postgres keeps as written, unquoted or quoted alike. Names
/// starting with `pg_` (Postgres's own roles) and the words a `GRANT ... TO` reads as
/// something else (`public`, `current_user`, ...) are refused.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RoleName(String);

impl RoleName {
    /// Checks and wraps a role name.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidName`] for anything else.
    pub fn new(name: &str) -> Result<Self> {
        let bad = |reason| Err(Error::InvalidName { what: "role name", name: name.to_owned(), reason });
        if name.is_empty() || name.len() > 63 {
            return bad("must be 1 to 63 bytes");
        }
        if !name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_') {
            return bad("must start with a lowercase ASCII letter or an underscore");
        }
        if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
            return bad("may hold only lowercase ASCII letters, digits and underscores");
        }
        if name.starts_with("pg_") {
            return bad("Postgres reserves role names starting with pg_");
        }
        if matches!(name, "public" | "none" | "current_user" | "current_role" | "session_user") {
            return bad("Postgres reads it as a keyword, not a role");
        }
        Ok(RoleName(name.to_owned()))
    }

    /// The bare name (`app`).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name quoted for SQL (`"app"`).
    pub fn quoted(&self) -> String {
        shardline_id::ident::quote(&self.0)
    }
}

impl fmt::Display for RoleName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bounded_shard_is_checked_against_the_widest_count_then_the_cluster_s() {
        assert_eq!(LogicalShard::bounded(8191).map(LogicalShard::get), Ok(8191));
        for bad in [-1, 8192, i64::from(u16::MAX) + 1] {
            assert_eq!(
                LogicalShard::bounded(bad),
                Err(Error::ShardOutOfRange { shard: bad, count: MAX_LOGICAL_SHARDS })
            );
        }
        let count = ShardCount::new(16).unwrap();
        assert_eq!(LogicalShard::bounded(15).and_then(|s| s.within(count)).map(LogicalShard::get), Ok(15));
        assert_eq!(
            LogicalShard::bounded(16).and_then(|s| s.within(count)),
            Err(Error::ShardOutOfRange { shard: 16, count: 16 })
        );
    }
}
