//! An in-process TCP proxy in front of a server (Postgres, `serve`, the relay) that can cut
//! every connection through it at once. It keeps listening while the server behind it is
//! down: a client that connects then is closed at once, as by a refused connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; dropping it stops accepting (open connections end at the next cut or EOF).
pub struct Proxy {
    pub name: &'static str,
    pub addr: SocketAddr,
    cut: watch::Sender<u64>,
    open: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards each connection to `target`.
    pub async fn start(name: &'static str, target: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (cut, cut_rx) = watch::channel(0_u64);
        let open = Arc::new(AtomicU64::new(0));
        let counter = open.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let mut cut_rx = cut_rx.clone();
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
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
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
            open,
            task,
        })
    }

    /// Cuts every connection open now; returns how many there were.
    pub fn cut_all(&self) -> u64 {
        let open = self.open.load(Ordering::Relaxed);
        self.cut.send_modify(|generation| *generation += 1);
        open
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.cut.send_modify(|generation| *generation += 1);
    }
}
