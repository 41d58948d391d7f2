//! TLS to Postgres, as libpq's `sslmode` and `sslrootcert` describe it, with rustls (ring).
//!
//! | `sslmode` | encrypted | certificate checked | host name checked |
//! |---|---|---|---|
//! | `disable` | never | – | – |
//! | `prefer` (default) | if the server offers it | no | no |
//! | `require` | always | only with `sslrootcert` (then as `verify-ca`) | no |
//! | `verify-ca` | always | against `sslrootcert` | no |
//! | `verify-full` | always | against `sslrootcert` | yes |
//!
//! `sslcert` and `sslkey` (PEM, the key unencrypted) give a client certificate, presented when
//! the server asks for one (`clientcert=verify-ca`/`verify-full` or `cert` authentication in
//! `pg_hba.conf`). Unlike libpq, `~/.postgresql/postgresql.crt` is not read without them.
//!
//! Without `sslrootcert`, `verify-ca` and `verify-full` read `~/.postgresql/root.crt` as libpq
//! does. Both the hand-written replication connection and every `tokio-postgres` connection
//! use the same settings and the same negotiation ([`PgTls::negotiate`]): tokio-postgres is
//! handed the stream once TLS is on (or declined), so a cleartext-password request over plain
//! TCP can be refused on its connections too. tokio-postgres does not know `verify-ca`,
//! `verify-full` or `sslrootcert`, so they are taken out of the URL here before it parses the
//! rest.
//!
//! Not supported: encrypted client keys (`sslpassword`, refused) and certificate revocation
//! lists (`sslcrl`). Every connection uses the URL's first host only, and none uses SCRAM
//! channel binding (`SCRAM-SHA-256-PLUS`). Since Highwater opens the stream itself (ordinary
//! connections hand it to tokio-postgres; the replication connection speaks the protocol
//! directly), the URL's `connect_timeout` is applied in `connection.rs` as one limit on the whole
//! connect (TCP, TLS and authentication) of both kinds, not per host and attempt as libpq does.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    Disable,
    #[default]
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(text: &str) -> Result<Self, TlsConfigError> {
        Ok(match text {
            "disable" => Self::Disable,
            "prefer" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            other => {
                return Err(TlsConfigError(format!(
                    "expected sslmode to be disable, prefer, require, verify-ca or verify-full, got {other:?}"
                )))
            }
        })
    }

    /// Whether a connection without TLS is refused.
    pub(crate) fn requires_tls(self) -> bool {
        matches!(self, Self::Require | Self::VerifyCa | Self::VerifyFull)
    }
}

/// A TLS setting that cannot be used: a bad `sslmode`, an unreadable `sslrootcert`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct TlsConfigError(pub(crate) String);

/// The TLS half of a connection URL.
#[derive(Clone)]
pub struct PgTls {
    mode: SslMode,
    config: Arc<ClientConfig>,
}

impl std::fmt::Debug for PgTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTls").field("mode", &self.mode).finish()
    }
}

impl PgTls {
    /// From the `sslmode`, `sslrootcert` and the `sslcert`/`sslkey` pair of a URL: with a
    /// client certificate, the TLS handshake presents it to a server that asks for one.
    pub(crate) fn with_client_cert(
        sslmode: Option<&str>,
        sslrootcert: Option<&str>,
        client_cert: Option<(&str, &str)>,
    ) -> Result<Self, TlsConfigError> {
        let mode = sslmode.map(SslMode::parse).transpose()?.unwrap_or_default();
        let root_file = match (sslrootcert, mode) {
            (Some(path), _) => Some(PathBuf::from(path)),
            (None, SslMode::VerifyCa | SslMode::VerifyFull) => {
                let default = std::env::var_os("HOME")
                    .map(|home| PathBuf::from(home).join(".postgresql/root.crt"))
                    .filter(|path| path.exists());
                Some(default.ok_or_else(|| {
                    TlsConfigError(format!(
                        "expected sslrootcert=FILE with sslmode={}, or ~/.postgresql/root.crt; found neither",
                        if mode == SslMode::VerifyCa { "verify-ca" } else { "verify-full" }
                    ))
                })?)
            }
            (None, _) => None,
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsConfigError(format!("cannot set up TLS: {e}")))?;
        let verifier: Arc<dyn ServerCertVerifier> = match root_file {
            Some(path) => {
                let roots = read_roots(&path)?;
                let webpki =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .map_err(|e| {
                            TlsConfigError(format!(
                                "cannot use sslrootcert {}: {e}",
                                path.display()
                            ))
                        })?;
                if mode == SslMode::VerifyFull {
                    webpki
                } else {
                    Arc::new(IgnoreHostName(webpki))
                }
            }
            None => Arc::new(AnyCertificate(provider)),
        };
        let builder = builder
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let config = match client_cert {
            None => builder.with_no_client_auth(),
            Some((cert_file, key_file)) => {
                let (chain, key) = read_client_cert(Path::new(cert_file), Path::new(key_file))?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    TlsConfigError(format!(
                        "cannot use sslcert {cert_file} with sslkey {key_file}: {e}"
                    ))
                })?
            }
        };
        Ok(Self {
            mode,
            config: Arc::new(config),
        })
    }

    pub fn mode(&self) -> SslMode {
        self.mode
    }

    /// Postgres's TLS negotiation on a fresh TCP stream: `SSLRequest`, then the handshake when
    /// the server answers `S`. Returns the encrypted stream, or the plain one when TLS is off
    /// or (`prefer`) the server declines.
    pub(crate) async fn negotiate(
        &self,
        mut stream: TcpStream,
        host: &str,
    ) -> Result<Negotiated, NegotiateError> {
        if self.mode == SslMode::Disable {
            return Ok(Negotiated::Plain(stream));
        }
        let mut request = bytes::BytesMut::new();
        postgres_protocol::message::frontend::ssl_request(&mut request);
        stream.write_all(&request).await?;
        let answer = stream.read_u8().await?;
        match answer {
            b'S' => {
                let name = ServerName::try_from(host.to_owned()).map_err(|e| {
                    NegotiateError::Tls(format!(
                        "expected a host name or address, got {host:?}: {e}"
                    ))
                })?;
                let connector = tokio_rustls::TlsConnector::from(self.config.clone());
                let tls = connector
                    .connect(name, stream)
                    .await
                    .map_err(|e| NegotiateError::Tls(format!("the TLS handshake failed: {e}")))?;
                Ok(Negotiated::Tls(Box::new(tls)))
            }
            b'N' if !self.mode.requires_tls() => Ok(Negotiated::Plain(stream)),
            b'N' => Err(NegotiateError::Tls(
                "the server does not accept TLS connections, and sslmode requires TLS".to_owned(),
            )),
            other => Err(NegotiateError::Tls(format!(
                "expected S or N in answer to the SSL request, got byte {other}"
            ))),
        }
    }
}

/// A negotiated replication transport.
pub(crate) enum Negotiated {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum NegotiateError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Tls(String),
}

fn read_roots(path: &Path) -> Result<RootCertStore, TlsConfigError> {
    let unreadable = |e: &dyn std::fmt::Display| {
        TlsConfigError(format!("cannot read sslrootcert {}: {e}", path.display()))
    };
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path).map_err(|e| unreadable(&e))? {
        let cert = cert.map_err(|e| unreadable(&e))?;
        roots.add(cert).map_err(|e| unreadable(&e))?;
    }
    if roots.is_empty() {
        return Err(unreadable(&"expected PEM certificates, found none"));
    }
    Ok(roots)
}

/// The PEM certificate chain and private key of `sslcert` and `sslkey`.
fn read_client_cert(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsConfigError> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsConfigError(format!("cannot read sslcert {}: {e}", cert.display())))?;
    if chain.is_empty() {
        return Err(TlsConfigError(format!(
            "cannot read sslcert {}: expected PEM certificates, found none",
            cert.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        TlsConfigError(format!(
            "cannot read sslkey {}: expected an unencrypted PEM private key: {e}",
            key.display()
        ))
    })?;
    Ok((chain, key))
}

/// Splits `sslmode`, `sslrootcert`, `sslcert` and `sslkey` out of a `postgres://` URL or a
/// `key=value` string, returning the rest for tokio-postgres. `sslcert` needs `sslkey` and the
/// other way round; `sslpassword` (encrypted keys) is refused rather than ignored.
pub(crate) fn split_tls_params(url: &str) -> Result<(String, PgTls), TlsConfigError> {
    let mut sslmode = None;
    let mut sslrootcert = None;
    let mut sslcert = None;
    let mut sslkey = None;
    let mut take =
        |key: &str, value: String| -> Result<bool, TlsConfigError> {
            match key {
                "sslmode" => sslmode = Some(value),
                "sslrootcert" => sslrootcert = Some(value),
                "sslcert" => sslcert = Some(value),
                "sslkey" => sslkey = Some(value),
                "sslpassword" => return Err(TlsConfigError(
                    "sslpassword (an encrypted sslkey) is not supported; expected an unencrypted \
                     key file readable only by this user"
                        .to_owned(),
                )),
                _ => return Ok(false),
            }
            Ok(true)
        };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            None => url.to_owned(),
            Some((base, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                    if !take(key, percent_decode(value))? {
                        kept.push(pair);
                    }
                }
                if kept.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
        }
    } else {
        let mut kept = Vec::new();
        for (key, value, text) in key_values(url)? {
            if !take(&key, value)? {
                kept.push(text);
            }
        }
        kept.join(" ")
    };
    let client_cert = match (&sslcert, &sslkey) {
        (Some(cert), Some(key)) => Some((cert.as_str(), key.as_str())),
        (None, None) => None,
        (Some(_), None) => {
            return Err(TlsConfigError(
                "expected sslkey=FILE with sslcert, found sslcert alone".to_owned(),
            ))
        }
        (None, Some(_)) => {
            return Err(TlsConfigError(
                "expected sslcert=FILE with sslkey, found sslkey alone".to_owned(),
            ))
        }
    };
    Ok((
        rest,
        PgTls::with_client_cert(sslmode.as_deref(), sslrootcert.as_deref(), client_cert)?,
    ))
}

/// `key=value` pairs of a libpq keyword string (values may be single-quoted), each with its
/// original text.
fn key_values(text: &str) -> Result<Vec<(String, String, String)>, TlsConfigError> {
    let mut out = Vec::new();
    let mut chars = text.char_indices().peekable();
    while let Some(&(start, c)) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        let mut key = String::new();
        while let Some(&(_, c)) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|&(_, c)| c.is_whitespace()) {
            chars.next();
        }
        if chars.next().map(|(_, c)| c) != Some('=') {
            return Err(TlsConfigError(format!(
                "expected key=value in the connection string, got {key:?} without a value"
            )));
        }
        while chars.peek().is_some_and(|&(_, c)| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek().is_some_and(|&(_, c)| c == '\'') {
            chars.next();
            loop {
                match chars.next() {
                    Some((_, '\\')) => {
                        if let Some((_, c)) = chars.next() {
                            value.push(c);
                        }
                    }
                    Some((_, '\'')) => break,
                    Some((_, c)) => value.push(c),
                    None => {
                        return Err(TlsConfigError(
                            "expected a closing quote in the connection string".to_owned(),
                        ))
                    }
                }
            }
        } else {
            while let Some(&(_, c)) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        let end = chars.peek().map_or(text.len(), |&(at, _)| at);
        out.push((key, value, text[start..end].to_owned()));
    }
    Ok(out)
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `verify-ca`: the chain must lead to a trusted root; the name may differ.
#[derive(Debug)]
struct IgnoreHostName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for IgnoreHostName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require` without a root certificate: encrypted, not authenticated (as libpq).
/// The handshake signatures are still checked.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_params_are_taken_out_of_urls_and_keyword_strings() {
        let (rest, tls) =
            split_tls_params("postgres://u:p@h:5/db?sslmode=require&application_name=x")
                .expect("ok");
        assert_eq!(rest, "postgres://u:p@h:5/db?application_name=x");
        assert_eq!(tls.mode(), SslMode::Require);
        let (rest, tls) = split_tls_params("postgres://u@h/db?sslmode=disable").expect("ok");
        assert_eq!(
            (rest.as_str(), tls.mode()),
            ("postgres://u@h/db", SslMode::Disable)
        );
        let (rest, tls) = split_tls_params("postgres://u@h/db").expect("ok");
        assert_eq!(
            (rest.as_str(), tls.mode()),
            ("postgres://u@h/db", SslMode::Prefer)
        );
        let (rest, tls) =
            split_tls_params("host=h user='a b' sslmode=require dbname=d").expect("ok");
        assert_eq!(rest, "host=h user='a b' dbname=d");
        assert_eq!(tls.mode(), SslMode::Require);
        for bad in [
            "postgres://u@h/db?sslmode=allow",
            "postgres://u@h/db?sslmode=verify-full&sslrootcert=/nonexistent/root.crt",
            "postgres://u@h/db?sslcert=/x",
            "postgres://u@h/db?sslkey=/x",
            "postgres://u@h/db?sslcert=/nonexistent/c.pem&sslkey=/nonexistent/k.pem",
            "postgres://u@h/db?sslpassword=x",
            "host=h sslmode",
        ] {
            assert!(split_tls_params(bad).is_err(), "{bad}");
        }
        assert_eq!(percent_decode("%2Ftmp%2Fca.pem"), "/tmp/ca.pem");
        assert_eq!(percent_decode("100%"), "100%");
    }
}
