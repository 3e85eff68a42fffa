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
mod ids;
mod lifecycle;
mod moves;
mod pooler;
mod promises;
mod reliability;
mod replication;
mod repo;

use shardline_testkit::harness::Harness;

fn main() {
    Harness::new(3).registered().run()
}
