//! The one place a connection string (a host's `peer_url`, which may hold a password)
//! enters SQL text: `CREATE SUBSCRIPTION ... CONNECTION '...'`.
//!
//! # Why not `batch_execute`
//!
//! `CONNECTION` takes no bind parameter (utility statements have none), so the
//! connection string is in the statement's text. tokio-postgres logs statement text at
//! `debug` through the `log` crate: `simple_query` and `batch_execute` as `executing
//! simple query / statement batch: {text}`, `prepare` (and so `query`, `execute`) as
//! `preparing query {name}: {text}`. Any subscriber bridging `log` (tracing-subscriber's
//! default `tracing-log` feature, `env_logger`, ...) prints those lines, so a library
//! user running at debug would see the password, whatever shardline's own logging does.
//! `Client::query_typed` with no parameters sends one unnamed statement by the extended
//! protocol (Parse, Bind, Describe, Execute, Sync) and logs nothing; its text reaches
//! the server only. It is one statement followed by Sync, so a statement that must not
//! run in a transaction block (`CREATE SUBSCRIPTION` with `create_slot = true`) runs
//! too (`the_unlogged_path_runs_what_must_not_run_in_a_transaction_block`). The test
//! `the_real_binary_at_trace_prints_no_password` (`crates/cli/tests/secrets.rs`) runs the
//! binary at `trace` and fails if a later driver starts logging this path.
//!
//! Errors are redacted here too: a libpq message may quote the connection string.

use std::time::Duration;

use tokio_postgres::Client;

use super::preflight::quote_literal;
use crate::describe;

/// Creates subscription `name` (an identifier the caller made, not input) on `c`,
/// connecting to `conninfo`, with `rest` (its `PUBLICATION ... WITH (...)` clauses,
/// holding no secret) after the connection string.
///
/// # Errors
///
/// The SQLSTATE and the server's message, with the connection string and any password
/// in it replaced by `***`.
pub(crate) async fn create_subscription(
    c: &Client,
    name: &str,
    conninfo: &str,
    rest: &str,
) -> Result<(), (Option<String>, String)> {
    let sql = format!(
        "CREATE SUBSCRIPTION {} CONNECTION {} {rest}",
        shardline_id::ident::quote(name),
        quote_literal(conninfo)
    );
    // Not batch_execute, simple_query, query or execute: see the module's docs.
    match peer_bounded(c, c.query_typed(&sql, &[])).await {
        Ok(_) => Ok(()),
        Err(e) => {
            let (sqlstate, message) = describe(&e);
            Err((sqlstate, redact(&message, conninfo)))
        }
    }
}

/// How long a statement that makes the target connect to the source (`CREATE` or
/// `DROP SUBSCRIPTION`) may run. Postgres 15's walreceiver waits for the source's answer
/// with no timeout of its own (libpq's `connect_timeout` is not applied there), so a
/// source that is hung or cut off would hold the statement, and the move, forever.
pub(crate) const PEER_TIMEOUT: Duration = Duration::from_secs(15);

/// Runs `work` (one statement on `c` that connects to a peer) under a
/// `statement_timeout` of [`PEER_TIMEOUT`], set for the session around it (not in a
/// transaction: such statements refuse one).
///
/// # Errors
///
/// Setting the timeout failed, or `work`'s own error (SQLSTATE 57014 when it ran out of
/// time).
pub(crate) async fn peer_bounded<T>(
    c: &Client,
    work: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, tokio_postgres::Error> {
    c.batch_execute(&format!("SET statement_timeout = {}", PEER_TIMEOUT.as_millis())).await?;
    let result = work.await;
    // The statement's own result wins; a connection that cannot reset is lost anyway
    // (the next statement on it fails and a new one is opened).
    if let Err(e) = c.batch_execute("RESET statement_timeout").await {
        tracing::warn!(error = %e, "could not reset statement_timeout after a statement that connects to a peer");
    }
    result
}

/// `message` with `conninfo`, and any password it holds, replaced by `***`.
pub(crate) fn redact(message: &str, conninfo: &str) -> String {
    let mut out = message.replace(conninfo, "***");
    for secret in passwords(conninfo) {
        if !secret.is_empty() {
            out = out.replace(&secret, "***");
        }
    }
    out
}

/// The passwords a libpq connection string holds (a URL's `user:password@` or
/// `password` parameter, a key/value `password`), decoded and percent-encoded: one
/// parser for all, `DbUrl::split_password`.
fn passwords(conninfo: &str) -> Vec<String> {
    shardline_router::config::DbUrl::new(conninfo.to_owned()).password_spellings()
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn the_connection_string_and_its_password_are_redacted() {
        let url = "postgresql://repl:p%40ss@pg1:5432/app?passfile=/x&password=other";
        let message = format!("could not connect with {url}: bad p@ss, p%40ss or other");
        let out = redact(&message, url);
        assert_eq!(out, "could not connect with ***: bad ***, *** or ***");
        let kv = "host=pg1 user=repl password='s3cret' passfile=/x";
        assert_eq!(redact("s3cret at host=pg1", kv), "*** at host=pg1");
        assert_eq!(redact("nothing here", "host=pg1 passfile=/x"), "nothing here");
    }
}
