//! Who may call the server-to-server endpoints, and where the server may listen.
//!
//! `/replication/…` (the change stream) and `/replica/snapshot` (a copy of the whole replica)
//! need the replication token when one is configured: `Authorization: Bearer <token>`, or HTTP
//! Basic with the token as the password (any user name), which is what a Zero view-syncer
//! sends for `ws://any:<token>@host:port`. A request without it gets 401 before any WebSocket
//! upgrade or snapshot work. Health checks stay open. The token comes from
//! `--replication-token-file` or `HIGHWATER_REPLICATION_TOKEN`, never from an argument value,
//! and is compared in constant time; no `Debug` output or log line holds it.
//!
//! Without a token the server only listens on loopback addresses, unless the operator says
//! `--insecure-no-auth` (then it warns at start and on `/health`).

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use subtle::ConstantTimeEq;

/// The environment variable holding the replication token when no file is given.
pub const REPLICATION_TOKEN_ENV: &str = "HIGHWATER_REPLICATION_TOKEN";
/// The environment variable holding the token a relay sends to its upstream.
pub const UPSTREAM_TOKEN_ENV: &str = "HIGHWATER_UPSTREAM_TOKEN";
/// Shorter tokens are refused.
pub(super) const MIN_TOKEN_BYTES: usize = 16;

/// The security options of `highwater serve`; flattened into its arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct SecurityArgs {
    /// File holding the replication token that `/replication/…` and `/replica/snapshot`
    /// require (Bearer, or Basic with the token as password). Without it the token is read
    /// from the environment variable HIGHWATER_REPLICATION_TOKEN; with neither, those
    /// endpoints are open and the server only listens on loopback addresses.
    #[arg(long, value_name = "FILE", env = "HIGHWATER_REPLICATION_TOKEN_FILE")]
    pub(crate) replication_token_file: Option<PathBuf>,
    /// Relay: file holding the token sent to the upstream (`--from`). Without it:
    /// HIGHWATER_UPSTREAM_TOKEN, else this node's own replication token.
    #[arg(long, value_name = "FILE", env = "HIGHWATER_UPSTREAM_TOKEN_FILE")]
    pub(crate) upstream_token_file: Option<PathBuf>,
    /// Listen on a non-loopback address without a replication token: anyone who can reach
    /// the port can download the replica and stream every change.
    #[arg(long, env = "HIGHWATER_INSECURE_NO_AUTH")]
    pub(crate) insecure_no_auth: bool,
    /// PEM certificate chain to serve https and wss with (needs --tls-key).
    #[arg(
        long,
        value_name = "FILE",
        requires = "tls_key",
        env = "HIGHWATER_TLS_CERT"
    )]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(
        long,
        value_name = "FILE",
        requires = "tls_cert",
        env = "HIGHWATER_TLS_KEY"
    )]
    pub tls_key: Option<PathBuf>,
    /// Relay: PEM file of the CA certificates an `https`/`wss` primary's certificate must
    /// chain to (a private CA). Without it: the system's certificate bundle.
    #[arg(long, value_name = "FILE", env = "HIGHWATER_FROM_CA_FILE")]
    pub from_ca_file: Option<PathBuf>,
    /// Relay: the largest snapshot it downloads from its primary, in bytes; a larger one is
    /// refused before it is stored.
    #[arg(long, value_name = "BYTES", default_value_t = super::snapshot_download::DEFAULT_MAX_SNAPSHOT_BYTES, env = "HIGHWATER_MAX_SNAPSHOT_BYTES")]
    pub(crate) max_snapshot_bytes: u64,
    /// Relay: how long the whole snapshot download may take, in seconds (no byte for 60 s
    /// ends it sooner).
    #[arg(long, value_name = "SECONDS", default_value_t = super::snapshot_download::DEFAULT_SNAPSHOT_TIMEOUT.as_secs(), env = "HIGHWATER_SNAPSHOT_TIMEOUT")]
    pub(crate) snapshot_timeout: u64,
    /// A replication token given in code (tests, embedding); wins over file and environment.
    #[arg(skip)]
    pub replication_token: Option<ReplicationToken>,
    /// An upstream token given in code; wins over file and environment.
    #[arg(skip)]
    pub upstream_token: Option<ReplicationToken>,
}

impl Default for SecurityArgs {
    /// What the command line gives without any of these options.
    fn default() -> Self {
        SecurityArgs {
            replication_token_file: None,
            upstream_token_file: None,
            insecure_no_auth: false,
            tls_cert: None,
            tls_key: None,
            from_ca_file: None,
            max_snapshot_bytes: super::snapshot_download::DEFAULT_MAX_SNAPSHOT_BYTES,
            snapshot_timeout: super::snapshot_download::DEFAULT_SNAPSHOT_TIMEOUT.as_secs(),
            replication_token: None,
            upstream_token: None,
        }
    }
}

impl SecurityArgs {
    /// The token this node requires: the one given in code, else the file, else the
    /// environment variable, else none.
    pub(crate) fn required_token(&self) -> Result<Option<ReplicationToken>, TokenError> {
        resolve(
            self.replication_token.as_ref(),
            self.replication_token_file.as_deref(),
            REPLICATION_TOKEN_ENV,
        )
    }

    /// The TLS settings of `--tls-cert` and `--tls-key`, if given.
    pub(crate) fn tls_config(
        &self,
    ) -> Result<Option<Arc<rustls::ServerConfig>>, super::tls::TlsFileError> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => super::tls::server_config(cert, key).map(Some),
            _ => Ok(None),
        }
    }

    /// How a relay reaches its primary `from`: TLS trust and download bounds. A CA file that
    /// cannot be used is an error, and so is a TLS primary with no trust at all.
    pub(crate) fn peer_client(
        &self,
        from: &str,
    ) -> Result<super::snapshot_download::PeerClient, super::tls::TlsFileError> {
        let tls = match &self.from_ca_file {
            Some(file) => Ok(super::tls::client_config(Some(file))?),
            None if from.starts_with("https://") || from.starts_with("wss://") => {
                Ok(super::tls::client_config(None)?)
            }
            None => super::tls::client_config(None).map_err(|e| e.to_string()),
        };
        Ok(super::snapshot_download::PeerClient::new(
            tls,
            self.max_snapshot_bytes,
            std::time::Duration::from_secs(self.snapshot_timeout),
        ))
    }

    /// The token a relay sends upstream: its own setting, else the token it requires.
    pub fn upstream_token(&self) -> Result<Option<ReplicationToken>, TokenError> {
        match resolve(
            self.upstream_token.as_ref(),
            self.upstream_token_file.as_deref(),
            UPSTREAM_TOKEN_ENV,
        )? {
            Some(token) => Ok(Some(token)),
            None => self.required_token(),
        }
    }
}

/// The replication token from `file`, else [`REPLICATION_TOKEN_ENV`], else none: what a
/// client of the peer endpoints (such as `highwater watch`) sends.
pub(crate) fn load_token(file: Option<&Path>) -> Result<Option<ReplicationToken>, TokenError> {
    resolve(None, file, REPLICATION_TOKEN_ENV)
}

fn resolve(
    given: Option<&ReplicationToken>,
    file: Option<&Path>,
    env: &str,
) -> Result<Option<ReplicationToken>, TokenError> {
    if let Some(token) = given {
        return Ok(Some(token.clone()));
    }
    let (origin, text) = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
                path: path.to_owned(),
                source,
            })?;
            (path.display().to_string(), text)
        }
        None => match std::env::var(env) {
            Ok(text) => (env.to_owned(), text),
            Err(std::env::VarError::NotPresent) => return Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(TokenError::Invalid {
                    origin: env.to_owned(),
                    expected: "valid UTF-8",
                })
            }
        },
    };
    ReplicationToken::new(text.trim_end_matches(['\n', '\r']))
        .map(Some)
        .map_err(|expected| TokenError::Invalid { origin, expected })
}

/// Why a replication token could not be loaded; never holds the token.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read the token file {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("expected the token in {origin} to be {expected}")]
    Invalid {
        origin: String,
        expected: &'static str,
    },
}

/// A shared secret between servers. Its `Debug` is redacted.
#[derive(Clone)]
pub struct ReplicationToken(Arc<str>);

impl ReplicationToken {
    /// A token of at least [`MIN_TOKEN_BYTES`] visible ASCII characters (it travels in an
    /// HTTP header and in a URL's user info).
    pub fn new(text: &str) -> Result<Self, &'static str> {
        if text.len() < MIN_TOKEN_BYTES {
            return Err("at least 16 characters long");
        }
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("visible ASCII characters without spaces");
        }
        Ok(Self(text.into()))
    }

    /// Constant-time comparison (only the length can be told apart).
    fn matches(&self, presented: &[u8]) -> bool {
        bool::from(self.0.as_bytes().ct_eq(presented))
    }

    /// `Authorization: Bearer <token>`, marked sensitive so HTTP stacks keep it out of logs.
    pub fn authorization(&self) -> HeaderValue {
        let mut value = HeaderValue::from_str(&format!("Bearer {}", self.0))
            .unwrap_or_else(|_| HeaderValue::from_static(""));
        value.set_sensitive(true);
        value
    }
}

impl fmt::Debug for ReplicationToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReplicationToken(<redacted>)")
    }
}

/// The credentials a request presents: the Bearer token or the Basic password.
fn presented(headers: &HeaderMap) -> Option<Vec<u8>> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, rest) = value.split_once(' ')?;
    let rest = rest.trim();
    if scheme.eq_ignore_ascii_case("bearer") {
        Some(rest.as_bytes().to_vec())
    } else if scheme.eq_ignore_ascii_case("basic") {
        let decoded = STANDARD.decode(rest).ok()?;
        let colon = decoded.iter().position(|&b| b == b':')?;
        Some(decoded[colon + 1..].to_vec())
    } else {
        None
    }
}

/// The replication token the peer endpoints require, if any.
#[derive(Debug, Clone, Default)]
pub(crate) struct PeerAuth {
    pub token: Option<ReplicationToken>,
    /// Requests refused, for `/metrics`.
    pub(crate) refusals: Arc<PeerRefusals>,
}

/// Peer requests refused for their token.
#[derive(Debug, Default)]
pub(crate) struct PeerRefusals {
    bad_token: AtomicU64,
    missing_token: AtomicU64,
}

impl PeerRefusals {
    pub(crate) fn bad_token(&self) -> u64 {
        self.bad_token.load(Ordering::Relaxed)
    }

    pub(crate) fn missing_token(&self) -> u64 {
        self.missing_token.load(Ordering::Relaxed)
    }
}

/// Middleware of the peer endpoints: 401 unless the request carries the token.
pub(crate) async fn require_token(
    State(auth): State<PeerAuth>,
    request: Request,
    next: Next,
) -> Response {
    let Some(token) = &auth.token else {
        return next.run(request).await;
    };
    let verdict = match presented(request.headers()) {
        Some(credential) if token.matches(&credential) => return next.run(request).await,
        Some(_) => {
            auth.refusals.bad_token.fetch_add(1, Ordering::Relaxed);
            "the replication token does not match"
        }
        None => {
            auth.refusals.missing_token.fetch_add(1, Ordering::Relaxed);
            "expected Authorization: Bearer <replication token>, or Basic with the token as password"
        }
    };
    tracing::info!(path = %request.uri().path(), reason = verdict, "peer request refused");
    let mut response = (StatusCode::UNAUTHORIZED, verdict).into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Basic realm=\"highwater\""),
    );
    response
}

/// Refuses to serve an address other hosts can reach without a token, unless the operator
/// opted out; warns when they did.
pub(crate) fn check_listener(
    addr: SocketAddr,
    token: Option<&ReplicationToken>,
    insecure_no_auth: bool,
) -> Result<(), InsecureListen> {
    if token.is_some() || addr.ip().is_loopback() {
        return Ok(());
    }
    if insecure_no_auth {
        tracing::warn!(
            %addr,
            "--insecure-no-auth: anyone who can reach this address can download the replica \
             and stream every change"
        );
        return Ok(());
    }
    Err(InsecureListen { addr })
}

/// A non-loopback listen address without a replication token.
#[derive(Debug, thiserror::Error)]
#[error(
    "refusing to listen on {addr} without a replication token: anyone who could reach it could \
     download the replica; set --replication-token-file FILE or HIGHWATER_REPLICATION_TOKEN, \
     listen on 127.0.0.1, or pass --insecure-no-auth"
)]
pub struct InsecureListen {
    pub addr: SocketAddr,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(value).expect("header"),
        );
        headers
    }

    #[test]
    fn bearer_and_basic_credentials_are_read() {
        assert_eq!(presented(&headers("Bearer abc")), Some(b"abc".to_vec()));
        assert_eq!(presented(&headers("bearer  abc ")), Some(b"abc".to_vec()));
        let basic = format!("Basic {}", STANDARD.encode("any:s3cret:with:colons"));
        assert_eq!(
            presented(&headers(&basic)),
            Some(b"s3cret:with:colons".to_vec())
        );
        let no_user = format!("Basic {}", STANDARD.encode(":tok"));
        assert_eq!(presented(&headers(&no_user)), Some(b"tok".to_vec()));
        for bad in ["Basic !!!", "Basic", "Digest x", "abc", ""] {
            let map = if bad.is_empty() {
                HeaderMap::new()
            } else {
                headers(bad)
            };
            assert_eq!(presented(&map), None, "{bad:?}");
        }
        let no_colon = format!("Basic {}", STANDARD.encode("tok"));
        assert_eq!(presented(&headers(&no_colon)), None);
    }

    #[test]
    fn tokens_are_checked_and_redacted() {
        assert!(ReplicationToken::new("short").is_err());
        assert!(ReplicationToken::new("sixteen chars ok").is_err(), "spaces");
        let token = ReplicationToken::new("0123456789abcdef").expect("valid");
        assert!(token.matches(b"0123456789abcdef"));
        assert!(!token.matches(b"0123456789abcdeF"));
        assert!(!token.matches(b"0123456789abcde"));
        assert!(!format!("{token:?}").contains("0123"));
        assert!(token.authorization().is_sensitive());
    }

    #[test]
    fn a_token_file_wins_over_the_environment_and_loses_to_code() {
        let dir = std::env::temp_dir().join(format!("highwater-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("token");
        std::fs::write(&file, "from-the-file-0123456789\n").expect("write");
        let args = SecurityArgs {
            replication_token_file: Some(file.clone()),
            ..SecurityArgs::default()
        };
        let token = args.required_token().expect("loads").expect("some");
        assert!(token.matches(b"from-the-file-0123456789"));
        // A relay without an upstream token sends its own.
        let upstream = args.upstream_token().expect("loads").expect("some");
        assert!(upstream.matches(b"from-the-file-0123456789"));
        let given = SecurityArgs {
            replication_token: Some(ReplicationToken::new("given-in-code-0123456").expect("ok")),
            ..args.clone()
        };
        assert!(given
            .required_token()
            .expect("ok")
            .expect("some")
            .matches(b"given-in-code-0123456"));
        std::fs::write(&file, "short").expect("write");
        let error = args.required_token().expect_err("too short").to_string();
        assert!(error.contains("at least 16 characters"), "{error}");
        assert!(!error.contains("short"), "the token is not echoed: {error}");
        let missing = SecurityArgs {
            replication_token_file: Some(dir.join("absent")),
            ..SecurityArgs::default()
        };
        assert!(missing.required_token().is_err());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn only_loopback_is_served_without_a_token_unless_opted_out() {
        let token = ReplicationToken::new("0123456789abcdef").expect("valid");
        let any: SocketAddr = "0.0.0.0:4848".parse().expect("addr");
        let lan: SocketAddr = "192.168.1.5:4848".parse().expect("addr");
        let local: SocketAddr = "127.0.0.1:4848".parse().expect("addr");
        let local6: SocketAddr = "[::1]:4848".parse().expect("addr");
        assert!(check_listener(local, None, false).is_ok());
        assert!(check_listener(local6, None, false).is_ok());
        let refused = check_listener(any, None, false).expect_err("refused");
        assert!(
            refused.to_string().contains("--insecure-no-auth"),
            "{refused}"
        );
        assert!(check_listener(lan, None, false).is_err());
        assert!(check_listener(any, Some(&token), false).is_ok());
        assert!(check_listener(any, None, true).is_ok());
    }
}
