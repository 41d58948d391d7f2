//! An in-process TCP proxy in front of a server (Postgres, `serve`, the relay) that can cut
//! every connection through it at once, or stall them: for a while nothing passes either way
//! while the TCP connections stay up, as on a link that silently stopped carrying packets
//! (what reaches the proxy meanwhile waits in its socket buffers). It keeps listening while
//! the server behind it is down: a client that connects then is closed at once, as by a
//! refused connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; dropping it stops accepting (open connections end at the next cut or EOF).
pub struct Proxy {
    pub name: &'static str,
    pub addr: SocketAddr,
    cut: watch::Sender<u64>,
    stall: watch::Sender<bool>,
    open: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards each connection to `target`.
    pub async fn start(name: &'static str, target: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (cut, cut_rx) = watch::channel(0_u64);
        let (stall, stall_rx) = watch::channel(false);
        let open = Arc::new(AtomicU64::new(0));
        let counter = open.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let mut cut_rx = cut_rx.clone();
                let stall_rx = stall_rx.clone();
                let open = counter.clone();
                tokio::spawn(async move {
                    // A cut before this connection was accepted does not end it.
                    cut_rx.borrow_and_update();
                    let Ok(mut server) = TcpStream::connect(target).await else {
                        return;
                    };
                    let mut client = client;
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    open.fetch_add(1, Ordering::Relaxed);
                    let (mut client_read, mut client_write) = client.split();
                    let (mut server_read, mut server_write) = server.split();
                    let up = pump(&mut client_read, &mut server_write, stall_rx.clone());
                    let down = pump(&mut server_read, &mut client_write, stall_rx);
                    tokio::select! {
                        _ = async { tokio::join!(up, down) } => {}
                        _ = cut_rx.changed() => {
                            // An abortive close (RST) on both sides, as a dropped link looks.
                            let _ = client.set_zero_linger();
                            let _ = server.set_zero_linger();
                        }
                    }
                    open.fetch_sub(1, Ordering::Relaxed);
                });
            }
        });
        Ok(Proxy {
            name,
            addr,
            cut,
            stall,
            open,
            task,
        })
    }

    /// Stops (`true`) or resumes (`false`) forwarding on every connection, open now or
    /// accepted meanwhile; returns how many are open.
    pub fn stall(&self, stalled: bool) -> u64 {
        self.stall.send_replace(stalled);
        self.open.load(Ordering::Relaxed)
    }

    /// Cuts every connection open now; returns how many there were.
    pub fn cut_all(&self) -> u64 {
        let open = self.open.load(Ordering::Relaxed);
        self.cut.send_modify(|generation| *generation += 1);
        open
    }
}

/// Copies `from` to `to` until EOF (then shuts `to` down) or an error, reading nothing while
/// the proxy is stalled.
async fn pump<R, W>(from: &mut R, to: &mut W, mut stalled: watch::Receiver<bool>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0_u8; 16 * 1024];
    loop {
        while *stalled.borrow_and_update() {
            if stalled.changed().await.is_err() {
                return;
            }
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
            _ = stalled.changed() => continue,
        };
        // Read before the stall began: it still goes through.
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
    let _ = to.shutdown().await;
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.cut.send_modify(|generation| *generation += 1);
    }
}
