//! What applications call: the catalog client, one connection pool per physical host,
//! routed inserts, reads by ID, pages and fan-out.
//!
//! This crate is still empty; it arrives with the `[repo]` issue.
#![forbid(unsafe_code)]
