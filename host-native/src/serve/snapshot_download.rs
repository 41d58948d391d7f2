//! Downloading another Highwater's replica snapshot (`GET /replica/snapshot`): what a relay
//! restores from, and what `highwater zero-replica` converts into a Zero replica; and the
//! byte stream to such a peer, plain or TLS, that the relay's change stream uses too.
//!
//! A download is bounded: the connection (TCP and TLS handshake) within [`CONNECT_TIMEOUT`],
//! no byte for [`IDLE_TIMEOUT`] ends it, and the whole of it within the overall timeout; it
//! is refused before the first byte is written when its `Content-Length` is over the size cap
//! or the disk lacks room for it, and stopped as soon as the bytes received pass the cap. On
//! any failure the partial file is removed: nothing half-stored is left behind.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::header::{AUTHORIZATION, CONTENT_LENGTH, HOST};
use hyper::{Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use crate::serve::security::ReplicationToken;
use crate::serve::snapshot::{REPLICA_VERSION_HEADER, WATERMARK_HEADER};

/// How long the TCP connection and TLS handshake to a peer may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a download may go without receiving a byte.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// The default size cap of a downloaded snapshot: 64 GiB.
pub(crate) const DEFAULT_MAX_SNAPSHOT_BYTES: u64 = 64 << 30;
/// The default limit on a whole download: 6 hours.
pub(crate) const DEFAULT_SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(6 * 3600);

/// Why a snapshot could not be downloaded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DownloadError {
    #[error("cannot download the snapshot {url}: {reason}")]
    Failed { url: String, reason: String },
    #[error(
        "cannot download the snapshot {url}: expected at most {limit} bytes \
         (--max-snapshot-bytes), {found}"
    )]
    TooLarge {
        url: String,
        limit: u64,
        found: String,
    },
    #[error(
        "cannot download the snapshot {url}: expected {needed} bytes free in {dir}, found \
         {available}"
    )]
    NoRoom {
        url: String,
        dir: String,
        needed: u64,
        available: u64,
    },
    #[error(
        "cannot download the snapshot {url}: expected {what} within {} ms, it did not come",
        .limit.as_millis()
    )]
    TimedOut {
        url: String,
        what: &'static str,
        limit: Duration,
    },
    #[error("cannot write the downloaded snapshot: {0}")]
    Io(#[from] std::io::Error),
}

impl DownloadError {
    /// The message without its "cannot download the snapshot URL: " lead.
    pub(crate) fn reason(&self) -> String {
        let text = self.to_string();
        match self {
            DownloadError::TooLarge { url, .. }
            | DownloadError::NoRoom { url, .. }
            | DownloadError::TimedOut { url, .. }
            | DownloadError::Failed { url, .. } => text
                .strip_prefix(&format!("cannot download the snapshot {url}: "))
                .map(str::to_owned)
                .unwrap_or(text),
            DownloadError::Io(_) => text,
        }
    }
}

/// What the snapshot response said about its content.
#[derive(Debug, Clone, Default)]
pub(crate) struct SnapshotHeaders {
    pub watermark: Option<String>,
    pub replica_version: Option<String>,
}

/// How this node reaches a peer Highwater: the TLS trust for `https`/`wss` and the bounds of
/// a snapshot download.
#[derive(Clone)]
pub(crate) struct PeerClient {
    /// Trust for TLS peers, or why there is none (what an `https`/`wss` URL is refused with).
    tls: Result<Arc<rustls::ClientConfig>, String>,
    pub(crate) max_snapshot_bytes: u64,
    pub(crate) snapshot_timeout: Duration,
    /// How long a download may go without a byte ([`IDLE_TIMEOUT`]).
    pub(crate) idle_timeout: Duration,
}

impl std::fmt::Debug for PeerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerClient")
            .field("tls", &self.tls.is_ok())
            .field("max_snapshot_bytes", &self.max_snapshot_bytes)
            .field("snapshot_timeout", &self.snapshot_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

impl PeerClient {
    /// `tls` is the trust for TLS peers, or why there is none (the error a TLS URL gets).
    pub(crate) fn new(
        tls: Result<Arc<rustls::ClientConfig>, String>,
        max_snapshot_bytes: u64,
        snapshot_timeout: Duration,
    ) -> Self {
        PeerClient {
            tls,
            max_snapshot_bytes,
            snapshot_timeout,
            idle_timeout: IDLE_TIMEOUT,
        }
    }

    /// Trusting the system bundle (if there is one), with the default bounds.
    pub(crate) fn system() -> Self {
        PeerClient::new(
            super::tls::client_config(None).map_err(|e| e.to_string()),
            DEFAULT_MAX_SNAPSHOT_BYTES,
            DEFAULT_SNAPSHOT_TIMEOUT,
        )
    }

    /// The byte stream to `host:port`, through TLS when `tls` (checking the certificate
    /// names `host`), within [`CONNECT_TIMEOUT`].
    pub(crate) async fn connect(
        &self,
        host: &str,
        port: u16,
        tls: bool,
    ) -> Result<PeerStream, String> {
        let connecting = async {
            // `[::1]` in a URL is `::1` to the resolver.
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let tcp = tokio::net::TcpStream::connect((host, port))
                .await
                .map_err(|e| format!("cannot connect: {e}"))?;
            let _ = tcp.set_nodelay(true);
            if !tls {
                return Ok(Box::new(tcp) as PeerStream);
            }
            let config = self.tls.clone()?;
            let name = rustls::pki_types::ServerName::try_from(host.to_owned())
                .map_err(|e| format!("expected a host name or address, got {host:?}: {e}"))?;
            let stream = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await
                .map_err(|e| format!("the TLS handshake failed: {e}"))?;
            Ok(Box::new(stream) as PeerStream)
        };
        tokio::time::timeout(CONNECT_TIMEOUT, connecting)
            .await
            .map_err(|_| {
                format!(
                    "no connection within {} s (TCP and TLS handshake)",
                    CONNECT_TIMEOUT.as_secs()
                )
            })?
    }
}

/// A byte stream to a peer.
pub(crate) trait PeerIo: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> PeerIo for T {}
pub(crate) type PeerStream = Box<dyn PeerIo>;

/// `GET url` (`http://` or `https://`) into `path` (created anew, synced), with the token as
/// `Authorization: Bearer`. On failure, or when dropped before it ends, `path` is removed.
pub(crate) async fn download(
    url: &str,
    path: &Path,
    token: Option<&ReplicationToken>,
    client: &PeerClient,
) -> Result<SnapshotHeaders, DownloadError> {
    // Also when this future is dropped half-way (the caller gave up on it).
    let mut partial = RemoveOnDrop(Some(path.to_owned()));
    let overall = client.snapshot_timeout;
    let result = match tokio::time::timeout(overall, fetch(url, path, token, client)).await {
        Ok(result) => result,
        Err(_) => Err(DownloadError::TimedOut {
            url: url.to_owned(),
            what: "the whole snapshot (--snapshot-timeout)",
            limit: overall,
        }),
    };
    if result.is_ok() {
        partial.0 = None;
    }
    result
}

/// Removes the file at its path when dropped, unless taken out.
struct RemoveOnDrop(Option<std::path::PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

async fn fetch(
    url: &str,
    path: &Path,
    token: Option<&ReplicationToken>,
    client: &PeerClient,
) -> Result<SnapshotHeaders, DownloadError> {
    let failed = |reason: String| DownloadError::Failed {
        url: url.to_owned(),
        reason,
    };
    let uri: Uri = url
        .parse()
        .map_err(|e| failed(format!("expected an http:// or https:// URL: {e}")))?;
    let tls = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        other => {
            return Err(failed(format!(
                "expected an http:// or https:// URL, found scheme {:?}",
                other.unwrap_or("")
            )))
        }
    };
    let authority = uri
        .authority()
        .ok_or_else(|| failed("expected a host in the URL".to_owned()))?
        .clone();
    let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let stream = client
        .connect(authority.host(), port, tls)
        .await
        .map_err(failed)?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| failed(e.to_string()))?;
    let connection = AbortOnDrop(tokio::spawn(connection));
    let path_and_query = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut request = Request::get(path_and_query)
        .header(HOST, authority.as_str())
        .body(Empty::<Bytes>::new())
        .map_err(|e| failed(e.to_string()))?;
    if let Some(token) = token {
        request
            .headers_mut()
            .insert(AUTHORIZATION, token.authorization());
    }
    let idle_limit = client.idle_timeout;
    let idle = |what| DownloadError::TimedOut {
        url: url.to_owned(),
        what,
        limit: idle_limit,
    };
    let mut response = tokio::time::timeout(idle_limit, sender.send_request(request))
        .await
        .map_err(|_| idle("the response"))?
        .map_err(|e| failed(e.to_string()))?;
    if response.status() != StatusCode::OK {
        let status = response.status();
        // At most a few KiB of an error body, read within the idle timeout.
        let mut body = Vec::new();
        let reading = async {
            while let Some(Ok(frame)) = response.body_mut().frame().await {
                if let Ok(data) = frame.into_data() {
                    body.extend_from_slice(&data);
                }
                if body.len() > 4096 {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(idle_limit, reading).await;
        return Err(failed(format!(
            "expected 200 OK, found {status}: {}",
            String::from_utf8_lossy(&body)
                .chars()
                .take(200)
                .collect::<String>()
        )));
    }
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let headers = SnapshotHeaders {
        watermark: header(WATERMARK_HEADER),
        replica_version: header(REPLICA_VERSION_HEADER),
    };
    let length = header(CONTENT_LENGTH.as_str()).and_then(|v| v.parse::<u64>().ok());
    let limit = client.max_snapshot_bytes;
    let too_large = |found: String| DownloadError::TooLarge {
        url: url.to_owned(),
        limit,
        found,
    };
    if let Some(length) = length {
        if length > limit {
            return Err(too_large(format!("the peer announces {length}")));
        }
    }
    check_room(url, path, length.unwrap_or(0))?;
    let mut file = tokio::fs::File::create(path).await?;
    let mut received = 0u64;
    let mut progress = crate::runtime::Progress::new();
    let body = response.body_mut();
    loop {
        let frame = tokio::time::timeout(idle_limit, body.frame())
            .await
            .map_err(|_| idle("more bytes"))?;
        let Some(frame) = frame else { break };
        let frame = frame.map_err(|e| failed(e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            received += data.len() as u64;
            if received > limit {
                return Err(too_large("received more than that".to_owned()));
            }
            file.write_all(&data).await?;
            if progress.due() {
                tracing::info!(
                    received_bytes = received,
                    total_bytes = length,
                    elapsed_s = progress.elapsed_s(),
                    "snapshot download in progress"
                );
            }
        }
    }
    file.sync_all().await?;
    drop(file);
    drop(connection);
    if let Some(length) = length.filter(|&l| l != received) {
        return Err(failed(format!(
            "expected {length} bytes, received {received}"
        )));
    }
    Ok(headers)
}

/// Refuses a download of `length` bytes (and a tenth more, kept free for everything else)
/// into `path`'s directory when its file system has less room.
fn check_room(url: &str, path: &Path, length: u64) -> Result<(), DownloadError> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let needed = length.saturating_add(length / 10);
    let stats = rustix::fs::statvfs(dir).map_err(std::io::Error::from)?;
    let available = stats.f_bavail.saturating_mul(stats.f_frsize);
    if available < needed {
        return Err(DownloadError::NoRoom {
            url: url.to_owned(),
            dir: dir.display().to_string(),
            needed,
            available,
        });
    }
    Ok(())
}

/// Ends the HTTP connection task with the download, however it ends.
struct AbortOnDrop(tokio::task::JoinHandle<Result<(), hyper::Error>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A CA's PEM, and a TLS server config for `localhost` signed by it.
    fn ca_and_server(dir: &Path) -> (std::path::PathBuf, Arc<rustls::ServerConfig>) {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca =
            CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("ca");
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec!["localhost".to_owned()])
            .expect("params")
            .signed_by(&key, &ca)
            .expect("cert");
        std::fs::create_dir_all(dir).expect("dir");
        let ca_path = dir.join("ca.pem");
        std::fs::write(&ca_path, ca.pem()).expect("ca");
        std::fs::write(dir.join("server.crt"), cert.pem()).expect("cert");
        std::fs::write(dir.join("server.key"), key.serialize_pem()).expect("key");
        let config =
            super::super::tls::server_config(&dir.join("server.crt"), &dir.join("server.key"))
                .expect("server config");
        (ca_path, config)
    }

    /// How the test server answers.
    #[derive(Clone, Copy)]
    enum Answer {
        /// `Content-Length` and that many bytes.
        Whole(usize),
        /// That many bytes, ended by closing the connection (no length).
        Unannounced(usize),
        /// `Content-Length: 1000`, ten bytes, then nothing.
        Stall,
    }

    /// An https server on a free port answering every request as `answer` says.
    async fn server(config: Arc<rustls::ServerConfig>, answer: Answer) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut request = [0u8; 4096];
                    let _ = tls.read(&mut request).await;
                    let (head, body) = match answer {
                        Answer::Whole(n) => (format!("Content-Length: {n}\r\n"), n),
                        Answer::Unannounced(n) => ("Connection: close\r\n".to_owned(), n),
                        Answer::Stall => ("Content-Length: 1000\r\n".to_owned(), 10),
                    };
                    let response = format!("HTTP/1.1 200 OK\r\n{head}\r\n");
                    let _ = tls.write_all(response.as_bytes()).await;
                    let _ = tls.write_all(&vec![7u8; body]).await;
                    let _ = tls.flush().await;
                    if matches!(answer, Answer::Stall) {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                    }
                    let _ = tls.shutdown().await;
                });
            }
        });
        port
    }

    fn client(ca: &Path, max: u64) -> PeerClient {
        let tls = super::super::tls::client_config(Some(ca)).expect("client config");
        let mut client = PeerClient::new(Ok(tls), max, Duration::from_secs(20));
        client.idle_timeout = Duration::from_millis(300);
        client
    }

    #[tokio::test]
    async fn https_downloads_are_checked_against_the_ca_capped_and_timed_with_nothing_left_behind()
    {
        let dir = std::env::temp_dir().join(format!("highwater-download-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (ca, config) = ca_and_server(&dir.join("tls"));
        let (other_ca, _) = ca_and_server(&dir.join("other"));
        let file = dir.join("snapshot.db");
        let url = |port: u16| format!("https://localhost:{port}/replica/snapshot");

        // The right CA: the whole body, stored.
        let port = server(config.clone(), Answer::Whole(1000)).await;
        download(&url(port), &file, None, &client(&ca, 1000))
            .await
            .expect("download over https");
        assert_eq!(std::fs::read(&file).expect("stored"), vec![7u8; 1000]);
        std::fs::remove_file(&file).expect("remove");

        // Another CA: the handshake fails, nothing is stored.
        let error = download(&url(port), &file, None, &client(&other_ca, 1000))
            .await
            .expect_err("unknown issuer");
        let text = error.to_string();
        assert!(matches!(error, DownloadError::Failed { .. }), "{text}");
        assert!(text.contains("TLS handshake failed"), "{text}");
        assert!(!file.exists());

        // Over the cap: refused on the announced length, or as the bytes pass it.
        for answer in [Answer::Whole(1000), Answer::Unannounced(1000)] {
            let port = server(config.clone(), answer).await;
            let error = download(&url(port), &file, None, &client(&ca, 999))
                .await
                .expect_err("too large");
            let text = error.to_string();
            assert!(
                matches!(error, DownloadError::TooLarge { limit: 999, .. }),
                "{text}"
            );
            assert!(text.contains("expected at most 999 bytes"), "{text}");
            assert!(!file.exists(), "{text}");
        }

        // A peer that stops sending: the idle timeout ends it, nothing is stored.
        let port = server(config.clone(), Answer::Stall).await;
        let error = download(&url(port), &file, None, &client(&ca, 1000))
            .await
            .expect_err("stalled");
        let text = error.to_string();
        assert!(matches!(error, DownloadError::TimedOut { .. }), "{text}");
        assert!(text.contains("expected more bytes within 300 ms"), "{text}");
        assert!(!file.exists());

        // Given up on half-way (a caller's select dropped it): nothing is left either.
        let port = server(config.clone(), Answer::Stall).await;
        let mut slow = client(&ca, 1000);
        slow.idle_timeout = Duration::from_secs(20);
        let dropped = tokio::time::timeout(
            Duration::from_millis(500),
            download(&url(port), &file, None, &slow),
        )
        .await;
        assert!(dropped.is_err(), "still downloading when dropped");
        assert!(!file.exists());

        // Without trust for TLS peers, an https URL is refused with the reason.
        let untrusted = PeerClient::new(Err("no CA".to_owned()), 1000, Duration::from_secs(5));
        let error = download(&url(port), &file, None, &untrusted)
            .await
            .expect_err("no trust");
        assert!(error.to_string().contains("no CA"), "{error}");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_download_larger_than_the_free_disk_is_refused_up_front() {
        let path = std::env::temp_dir().join("highwater-no-room.db");
        assert!(check_room("u", &path, 1).is_ok());
        let error = check_room("u", &path, u64::MAX / 2).expect_err("no room");
        assert!(matches!(error, DownloadError::NoRoom { .. }), "{error}");
        assert!(error.to_string().contains("bytes free in"), "{error}");
    }
}
