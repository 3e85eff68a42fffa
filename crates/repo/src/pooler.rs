//! Whether a host's connections reach Postgres through a connection pooler, found out
//! on each new connection when the config does not say
//! ([`crate::ClusterOptions::transaction_pooler`] unset).
//!
//! At start-up a Postgres server sends the client its process ID (in `BackendKeyData`,
//! the key a cancel request names), and `pg_backend_pid()` returns the same number. A
//! pooler hands its clients a key of its own (PgBouncer, Odyssey, PgCat and PgDog make
//! one up: the client's cancel must reach the pooler, which forwards it to whichever
//! server connection the client holds then), so the two differ. A connection whose
//! numbers differ is taken to be behind a transaction-mode pooler, and so is every
//! connection of its host's pool: nothing is kept across transactions, a table with a
//! column of a type of the shard's schema is refused, and so is the sqlx path. A
//! session-mode pool is taken for one too (it cannot be told apart): say
//! `transaction_pooler = false` for it, or lose those.
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, TlsConnect, TlsStream};

/// What the connections of one host's pool have shown so far.
#[derive(Debug, Default)]
pub(crate) struct Seen(AtomicU8);

const UNKNOWN: u8 = 0;
const DIRECT: u8 = 1;
const POOLER: u8 = 2;

impl Seen {
    /// Records what a new connection showed. A pooler, once seen, stays seen. Returns
    /// true the first time a pooler is seen.
    pub(crate) fn record(&self, pooler: bool) -> bool {
        let before = self.0.fetch_max(if pooler { POOLER } else { DIRECT }, Ordering::AcqRel);
        pooler && before != POOLER
    }

    /// `Some(true)` once a connection came through a pooler, `Some(false)` when every
    /// connection so far reached the server directly, `None` before the first.
    pub(crate) fn get(&self) -> Option<bool> {
        match self.0.load(Ordering::Acquire) {
            UNKNOWN => None,
            v => Some(v == POOLER),
        }
    }
}

/// Whether `client` reaches its server through a pooler: the process ID its start-up
/// named is not the server process's (`pg_backend_pid()`, one simple query). `Err`
/// names what could not be read.
pub(crate) async fn behind_pooler(client: &tokio_postgres::Client) -> Result<bool, String> {
    let named = startup_pid(client).await?;
    let rows = client.simple_query("SELECT pg_backend_pid()").await.map_err(|e| e.to_string())?;
    let actual = rows
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).and_then(|v| v.parse::<i32>().ok()),
            _ => None,
        })
        .ok_or("pg_backend_pid() returned no number")?;
    Ok(named != actual)
}

/// The process ID the server named in `client`'s start-up. The driver keeps it in the
/// connection's cancel token and shows it nowhere else, so the token writes its cancel
/// request into a pipe here (never to the network) and the ID is read back from it.
async fn startup_pid(client: &tokio_postgres::Client) -> Result<i32, String> {
    let token = client.cancel_token();
    let (ours, mut theirs) = tokio::io::duplex(64);
    let write = token.cancel_query_raw(ours, Plain);
    let read = async move {
        // An SSLRequest first when the connection asked for TLS (8 bytes: length 8,
        // code 80877103): answered yes, and `Plain` "encrypts" with nothing.
        let mut head = [0u8; 8];
        theirs.read_exact(&mut head).await?;
        if head == [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f] {
            theirs.write_all(b"S").await?;
            theirs.read_exact(&mut head).await?;
        }
        // CancelRequest: length 16, code 80877102, process ID, secret key.
        let mut rest = [0u8; 8];
        theirs.read_exact(&mut rest).await?;
        if head[..] != [0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e] {
            return Err(std::io::Error::other("not a cancel request"));
        }
        Ok(i32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]))
    };
    let (written, pid) = tokio::join!(write, read);
    written.map_err(|e| format!("the connection's cancel key: {e}"))?;
    pid.map_err(|e| format!("the connection's cancel key: {e}"))
}

/// A "TLS" that wraps nothing, for [`startup_pid`]'s pipe only.
struct Plain;

/// The pipe, as `Plain` hands it back.
struct PlainStream<S>(S);

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> TlsConnect<S> for Plain {
    type Stream = PlainStream<S>;
    type Error = std::io::Error;
    type Future = std::future::Ready<Result<PlainStream<S>, std::io::Error>>;

    fn connect(self, stream: S) -> Self::Future {
        std::future::ready(Ok(PlainStream(stream)))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for PlainStream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for PlainStream<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for PlainStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::Seen;

    #[test]
    fn a_pooler_once_seen_stays_seen_and_is_reported_once() {
        let s = Seen::default();
        assert_eq!(s.get(), None);
        assert!(!s.record(false));
        assert_eq!(s.get(), Some(false));
        assert!(s.record(true), "the first pooler seen is reported");
        assert!(!s.record(true), "and only the first");
        assert!(!s.record(false));
        assert_eq!(s.get(), Some(true), "a direct connection later does not unsee it");
    }
}
