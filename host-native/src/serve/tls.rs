//! `serve --tls-cert FILE --tls-key FILE`: https and wss on the serving port, with rustls; and
//! the client side a relay (or `zero-replica`) uses towards an `https`/`wss` peer.
//!
//! Handshakes run in their own tasks, at most [`MAX_HANDSHAKES`] at once and each within
//! [`HANDSHAKE_TIMEOUT`], so a peer that opens a socket and says nothing holds up no one else;
//! connections beyond the bound are closed at once.
//!
//! Towards a peer, the certificate must chain to `--from-ca-file` (a private CA) when given,
//! else to the system's certificate bundle (`SSL_CERT_FILE`, else the usual Linux paths), and
//! name the host of the URL.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// TLS handshakes in progress at once; more connections are closed unanswered.
pub(crate) const MAX_HANDSHAKES: usize = 256;
/// How long a client may take to finish its handshake.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the certificate or key cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("cannot use the TLS {what} {path}: {reason}")]
pub struct TlsFileError {
    what: &'static str,
    path: String,
    reason: String,
}

/// The server's TLS settings from a PEM certificate chain and a PEM private key.
pub(crate) fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsFileError> {
    let failed = |what, path: &Path, reason: String| TlsFileError {
        what,
        path: path.display().to_string(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| failed("certificate", cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(failed(
            "certificate",
            cert,
            "expected PEM certificates, found none".to_owned(),
        ));
    }
    let private_key =
        PrivateKeyDer::from_pem_file(key).map_err(|e| failed("key", key, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|builder| {
            builder
                .with_no_client_auth()
                .with_single_cert(certs, private_key)
        })
        .map_err(|e| failed("key", key, e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Where Linux distributions keep the system's trusted certificates, in order of preference.
const SYSTEM_BUNDLES: [&str; 4] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// The client settings for `https`/`wss` peers: trust `ca_file`'s certificates, else the
/// system bundle.
pub(crate) fn client_config(ca_file: Option<&Path>) -> Result<Arc<ClientConfig>, TlsFileError> {
    let system = || {
        std::env::var_os("SSL_CERT_FILE")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                SYSTEM_BUNDLES
                    .iter()
                    .map(std::path::PathBuf::from)
                    .find(|path| path.exists())
            })
    };
    let path = match ca_file {
        Some(path) => path.to_owned(),
        None => system().ok_or_else(|| TlsFileError {
            what: "CA certificates",
            path: SYSTEM_BUNDLES.join(", "),
            reason: "expected --from-ca-file FILE or a system certificate bundle, found neither"
                .to_owned(),
        })?,
    };
    let failed = |reason: String| TlsFileError {
        what: "CA certificates",
        path: path.display().to_string(),
        reason,
    };
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&path).map_err(|e| failed(e.to_string()))? {
        let cert = cert.map_err(|e| failed(e.to_string()))?;
        // A bundle may hold certificates webpki cannot use; the others still count.
        if roots.add(cert).is_err() && ca_file.is_some() {
            return Err(failed("expected CA certificates webpki accepts".to_owned()));
        }
    }
    if roots.is_empty() {
        return Err(failed("expected PEM certificates, found none".to_owned()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| failed(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A listener that hands axum only connections whose TLS handshake completed.
pub(crate) struct TlsListener {
    incoming: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    acceptor: JoinHandle<()>,
}

impl TlsListener {
    pub(crate) fn new(listener: TcpListener, config: Arc<ServerConfig>) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, incoming) = mpsc::channel(64);
        let acceptor = TlsAcceptor::from(config);
        let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        let acceptor = tokio::spawn(async move {
            loop {
                let (tcp, addr) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors and the like: wait instead of spinning.
                        tracing::warn!(%error, "cannot accept a connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                super::accepted(&tcp);
                let Ok(permit) = handshakes.clone().try_acquire_owned() else {
                    tracing::debug!(%addr, "too many TLS handshakes in progress; closed");
                    continue;
                };
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send((stream, addr)).await;
                        }
                        Ok(Err(error)) => tracing::debug!(%addr, %error, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%addr, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self {
            incoming,
            local,
            acceptor,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.incoming.recv().await {
            Some(accepted) => accepted,
            // The accept task only ends when aborted, which happens with this listener.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
