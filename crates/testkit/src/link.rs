//! Links that a test can cut: a network partition between two parties, one link at a
//! time.
//!
//! A [`Link`] is a TCP relay in the test process between a listening address and one
//! server. Whoever connects through it (shardline in the test process, or another
//! server's subscription) talks to the server as if directly, until [`Link::cut`]:
//! from then on no byte crosses in either direction and new connections are accepted
//! but get no answer, as in a partition where packets are lost and TCP keeps
//! retrying. What was sent during the cut stays in the socket buffers and is delivered
//! after [`Link::heal`], as TCP's retransmission would deliver it once the network is
//! back. Neither side sees a reset: each finds out only through its own timeouts
//! (`connect_timeout`, `statement_timeout`, `wal_receiver_timeout`), which is what a
//! partition tests.
//!
//! Where it differs from a partition: TCP keepalives cannot detect the cut (the relay's
//! kernel answers them on both sides); up to one buffer (64 KiB) already being written
//! when the cut comes still crosses; a new connection is held for as long as the cut
//! lasts, where a real one would give up after the kernel's SYN retries (about 2
//! minutes).
//!
//! [`Link::sever`] is the other kind of failure: every connection through the link is
//! closed at once (a crashed middlebox, a server-side kill), while new ones still go
//! through.
//!
//! Links are made by [`crate::Cluster::link`] (the test process to one host) and
//! [`crate::Cluster::peer_link`] (the cluster's other servers to one host), on both
//! backends alike.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::host::Endpoint;
use crate::{Error, Result};

/// A cuttable TCP relay to one server. Dropping it closes every connection through it.
#[derive(Debug)]
pub struct Link {
    name: String,
    listen: Endpoint,
    cut: watch::Sender<bool>,
    sever: watch::Sender<u64>,
    connections: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Link {
    /// Listens on `listen_ip` (a free port) and relays every connection to `to`. `name`
    /// says which link this is in errors and logs (`pg2 via 127.0.0.1:40123`).
    ///
    /// # Errors
    ///
    /// [`Error::Io`] when nothing can listen on `listen_ip`.
    pub async fn start(name: &str, listen_ip: &str, to: Endpoint) -> Result<Link> {
        // Not a port a stopped host keeps for its restart (see `free_port`).
        let listener = crate::bind_unused(listen_ip)?;
        let listener = listener
            .set_nonblocking(true)
            .and_then(|()| TcpListener::from_std(listener))
            .map_err(|source| Error::Io { what: "listening for a link", path: listen_ip.into(), source })?;
        let port = listener
            .local_addr()
            .map_err(|source| Error::Io { what: "reading a link's address", path: listen_ip.into(), source })?
            .port();
        let (cut, cut_rx) = watch::channel(false);
        let (sever, sever_rx) = watch::channel(0_u64);
        let connections = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(accept(listener, to, cut_rx, sever_rx, connections.clone()));
        let listen = Endpoint { host: listen_ip.to_owned(), port };
        tracing::debug!(link = name, %listen.host, listen.port, "link up");
        Ok(Link { name: name.to_owned(), listen, cut, sever, connections, task })
    }

    /// Which link this is.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where to connect to go through the link.
    pub fn endpoint(&self) -> &Endpoint {
        &self.listen
    }

    /// URL of database `db` through the link, as the superuser (a libpq connection
    /// string, so a subscription's `CONNECTION` can use it too).
    pub fn url(&self, db: &str) -> String {
        format!("postgresql://postgres@{}:{}/{db}", self.listen.host, self.listen.port)
    }

    /// Partitions the link: nothing crosses until [`Link::heal`]; connections stay open
    /// and new ones are accepted but not answered.
    pub fn cut(&self) {
        tracing::info!(link = %self.name, "link cut");
        self.cut.send_replace(true);
    }

    /// Ends the partition: what was held is delivered and new connections go through.
    pub fn heal(&self) {
        tracing::info!(link = %self.name, "link healed");
        self.cut.send_replace(false);
    }

    /// Whether the link is cut now.
    pub fn is_cut(&self) -> bool {
        *self.cut.borrow()
    }

    /// Closes every connection through the link now (each side finds it closed at once);
    /// later connections go through, unless the link is cut.
    pub fn sever(&self) {
        tracing::info!(link = %self.name, "link severed");
        self.sever.send_modify(|n| *n += 1);
    }

    /// How many connections the link has accepted so far.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Aborting the accept loop drops its JoinSet, which aborts every relay.
        self.task.abort();
    }
}

async fn accept(
    listener: TcpListener,
    to: Endpoint,
    cut: watch::Receiver<bool>,
    sever: watch::Receiver<u64>,
    connections: Arc<AtomicU64>,
) {
    let mut relays = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else {
                    // Out of descriptors, say: try again shortly rather than spin.
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                connections.fetch_add(1, Ordering::Relaxed);
                // Seen as of now: a sever from here on ends this connection.
                let mut sever = sever.clone();
                sever.mark_unchanged();
                relays.spawn(relay(client, to.clone(), cut.clone(), sever));
            }
            Some(_) = relays.join_next(), if !relays.is_empty() => {}
        }
    }
}

/// One connection: waits out a cut before connecting on, then copies both ways until
/// either side closes, the link is severed, or the relay is dropped.
async fn relay(
    client: TcpStream,
    to: Endpoint,
    mut cut: watch::Receiver<bool>,
    mut sever: watch::Receiver<u64>,
) {
    let connect = async {
        if cut.wait_for(|c| !*c).await.is_err() {
            return None;
        }
        TcpStream::connect((to.host.as_str(), to.port)).await.ok()
    };
    let server = tokio::select! {
        s = connect => s,
        _ = sever.changed() => None,
    };
    let Some(server) = server else { return };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(client_read, server_write, cut.clone());
    let down = pump(server_read, client_write, cut);
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = sever.changed() => {}
    }
    // Dropping both halves closes both sockets.
}

/// Copies `from` to `to`, holding what it read while the link is cut.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut cut: watch::Receiver<bool>,
) {
    let mut buf = vec![0_u8; 64 * 1024];
    loop {
        if cut.wait_for(|c| !*c).await.is_err() {
            return;
        }
        let n = tokio::select! {
            n = from.read(&mut buf) => n,
            // Cut while waiting to read: stop reading, so the sender's data stays queued.
            _ = cut.wait_for(|c| *c) => continue,
        };
        let n = match n {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Cut after reading: hold the bytes until healed.
        if cut.wait_for(|c| !*c).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// An echo server on loopback, and a link to it.
    async fn echo_link() -> Link {
        let server = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let port = server.local_addr().unwrap().port();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = server.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = [0_u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Link::start("echo", "127.0.0.1", Endpoint { host: "127.0.0.1".into(), port }).await.unwrap()
    }

    async fn echo(s: &mut TcpStream, text: &[u8], within: Duration) -> Option<Vec<u8>> {
        s.write_all(text).await.unwrap();
        let mut got = vec![0_u8; text.len()];
        tokio::time::timeout(within, s.read_exact(&mut got)).await.ok()?.ok()?;
        Some(got)
    }

    #[tokio::test]
    async fn a_cut_link_carries_nothing_until_healed_and_then_delivers_what_was_held() {
        let link = echo_link().await;
        let mut s = TcpStream::connect(("127.0.0.1", link.endpoint().port)).await.unwrap();
        assert_eq!(echo(&mut s, b"before", Duration::from_secs(5)).await.as_deref(), Some(&b"before"[..]));
        link.cut();
        assert!(link.is_cut());
        assert_eq!(echo(&mut s, b"during", Duration::from_millis(300)).await, None, "crossed a cut link");
        // A new connection is accepted but not answered either.
        let mut fresh = TcpStream::connect(("127.0.0.1", link.endpoint().port)).await.unwrap();
        assert_eq!(echo(&mut fresh, b"new", Duration::from_millis(300)).await, None);
        link.heal();
        // The held bytes arrive after the heal: what was sent during the cut is echoed.
        let mut got = vec![0_u8; 6];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got)).await.unwrap().unwrap();
        assert_eq!(got, b"during");
        let mut got = vec![0_u8; 3];
        tokio::time::timeout(Duration::from_secs(5), fresh.read_exact(&mut got)).await.unwrap().unwrap();
        assert_eq!(got, b"new");
        assert_eq!(link.connections(), 2);
    }

    #[tokio::test]
    async fn a_severed_link_closes_its_connections_and_takes_new_ones() {
        let link = echo_link().await;
        let mut s = TcpStream::connect(("127.0.0.1", link.endpoint().port)).await.unwrap();
        assert!(echo(&mut s, b"x", Duration::from_secs(5)).await.is_some());
        link.sever();
        let mut buf = [0_u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.unwrap();
        assert!(matches!(read, Ok(0) | Err(_)), "the connection outlived the sever: {read:?}");
        let mut again = TcpStream::connect(("127.0.0.1", link.endpoint().port)).await.unwrap();
        assert_eq!(echo(&mut again, b"y", Duration::from_secs(5)).await.as_deref(), Some(&b"y"[..]));
    }

    #[tokio::test]
    async fn dropping_a_link_closes_its_connections() {
        let link = echo_link().await;
        let mut s = TcpStream::connect(("127.0.0.1", link.endpoint().port)).await.unwrap();
        assert!(echo(&mut s, b"x", Duration::from_secs(5)).await.is_some());
        drop(link);
        let mut buf = [0_u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.unwrap();
        assert!(matches!(read, Ok(0) | Err(_)), "the connection outlived its link: {read:?}");
    }
}
