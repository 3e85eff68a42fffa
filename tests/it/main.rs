//! Integration tests against real PostgreSQL hosts: one cluster of three, shared by every
//! test of this binary (see `shardline_testkit::harness`).
#![expect(
    clippy::unwrap_used,
    reason = "a test fails by panicking; harness = false hides it from clippy's test detection"
)]

mod bootstrap;
mod cluster;
mod fanout;
mod faults;
mod fleet;
mod ids;
mod lifecycle;
mod moves;
mod partitions;
mod pooler;
mod promises;
mod reliability;
mod replication;
mod repo;
mod sqlx;

use shardline_router::{HostName, LogicalShard};
use shardline_testkit::harness::Harness;

/// Shard `n`, a test's literal: checked against the most shards a cluster can have
/// here, against the cluster's count by the call it is given to.
fn shard(n: u16) -> LogicalShard {
    LogicalShard::bounded(i64::from(n)).unwrap()
}

/// Host `name`, a test's literal.
fn host(name: &str) -> HostName {
    HostName::new(name).unwrap()
}

fn main() {
    Harness::new(3).registered().run()
}
