//! Downloading another Highwater's replica snapshot (`GET /replica/snapshot`): what a relay
//! restores from, and what `highwater zero-replica` converts into a Zero replica.

use std::path::Path;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::header::{AUTHORIZATION, CONTENT_LENGTH, HOST};
use hyper::{Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;

use crate::serve::security::ReplicationToken;
use crate::serve::snapshot::{REPLICA_VERSION_HEADER, WATERMARK_HEADER};

/// Why a snapshot could not be downloaded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DownloadError {
    #[error("cannot download the snapshot {url}: {reason}")]
    Failed { url: String, reason: String },
    #[error("cannot write the downloaded snapshot: {0}")]
    Io(#[from] std::io::Error),
}

/// What the snapshot response said about its content.
#[derive(Debug, Clone, Default)]
pub(crate) struct SnapshotHeaders {
    pub watermark: Option<String>,
    pub replica_version: Option<String>,
}

/// `GET url` into `path` (created anew, synced), with the token as `Authorization: Bearer`.
/// Plain HTTP/1.1: the serving node answers it.
pub(crate) async fn download(
    url: &str,
    path: &Path,
    token: Option<&ReplicationToken>,
) -> Result<SnapshotHeaders, DownloadError> {
    let failed = |reason: String| DownloadError::Failed {
        url: url.to_owned(),
        reason,
    };
    let uri: Uri = url
        .parse()
        .map_err(|e| failed(format!("expected an http:// URL: {e}")))?;
    if uri.scheme_str() != Some("http") {
        return Err(failed(format!(
            "expected an http:// URL, found scheme {:?}",
            uri.scheme_str().unwrap_or("")
        )));
    }
    let authority = uri
        .authority()
        .ok_or_else(|| failed("expected a host in the URL".to_owned()))?
        .clone();
    let port = authority.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((authority.host(), port))
        .await
        .map_err(|e| failed(format!("cannot connect: {e}")))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| failed(e.to_string()))?;
    let connection = tokio::spawn(connection);
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
    let mut response = sender
        .send_request(request)
        .await
        .map_err(|e| failed(e.to_string()))?;
    if response.status() != StatusCode::OK {
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        return Err(failed(format!(
            "expected 200 OK, found {status}: {}",
            body.chars().take(200).collect::<String>()
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
    let mut file = tokio::fs::File::create(path).await?;
    let mut received = 0u64;
    let body = response.body_mut();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| failed(e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            file.write_all(&data).await?;
            received += data.len() as u64;
        }
    }
    file.sync_all().await?;
    drop(file);
    connection.abort();
    if let Some(length) = length.filter(|&l| l != received) {
        return Err(failed(format!(
            "expected {length} bytes, received {received}"
        )));
    }
    Ok(headers)
}
