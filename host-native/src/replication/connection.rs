//! A replication-mode connection (`replication=database`): startup, trust/cleartext/MD5/SCRAM
//! authentication, the simple-query replication commands, and the CopyBoth stream of
//! `START_REPLICATION`.
//!
//! Frontend messages are encoded with `postgres-protocol`; backend messages are framed here,
//! because `postgres-protocol` does not know CopyBothResponse (`W`).

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use highwater_engine::watermark::Lsn;
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256, SCRAM_SHA_256};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio_postgres::config::Host;

use super::error::{ReplicationError, ServerError};
use super::tls::{split_tls_params, NegotiateError, Negotiated, PgTls, SslMode};

/// Postgres caps a message at 1 GiB; a longer length means a corrupt stream.
const MAX_MESSAGE_LEN: usize = 1 << 30;
const READ_CHUNK: usize = 64 * 1024;

/// A byte stream to Postgres: TCP, TLS over TCP, or a Unix socket.
pub trait Transport: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Transport for T {}

/// Where and as whom to connect, taken from a `postgres://` URL or a `key=value` string.
#[derive(Clone)]
pub struct ConnectParams {
    config: tokio_postgres::Config,
    tls: PgTls,
}

/// An ordinary (non-replication) connection's settings: tokio-postgres's config and the TLS
/// it must use.
#[derive(Debug, Clone)]
pub struct PgConfig {
    pub config: tokio_postgres::Config,
    pub tls: PgTls,
}

/// A tokio-postgres connection over the transport Highwater negotiated, to be spawned.
pub(crate) type PgConnection =
    tokio_postgres::Connection<Box<dyn Transport>, tokio_postgres::tls::NoTlsStream>;

impl PgConfig {
    /// Connects with the configured `sslmode`. The TLS negotiation is Highwater's own, as on
    /// the replication connection (tokio-postgres then speaks over the stream it is handed),
    /// so a server that asks for a cleartext password over plain TCP is refused before the
    /// password is sent, unless `sslmode=disable`. Only the first host of the URL is used.
    pub async fn connect(
        &self,
    ) -> Result<(tokio_postgres::Client, PgConnection), ReplicationError> {
        let params = ConnectParams {
            config: self.config.clone(),
            tls: self.tls.clone(),
        };
        let connecting = async {
            let (transport, secure) = params.transport().await?;
            let refused = Arc::new(AtomicBool::new(false));
            let transport: Box<dyn Transport> = if secure || params.ssl_mode() == SslMode::Disable {
                transport
            } else {
                Box::new(CleartextGuard::new(transport, refused.clone()))
            };
            let mut config = self.config.clone();
            // TLS, if any, is already on: tokio-postgres must not ask for it again.
            config.ssl_mode(tokio_postgres::config::SslMode::Disable);
            match config.connect_raw(transport, tokio_postgres::NoTls).await {
                Ok(connected) => Ok(connected),
                Err(_) if refused.load(Ordering::SeqCst) => Err(ReplicationError::Auth {
                    user: params.user().to_owned(),
                    reason: CLEARTEXT_REFUSED.to_owned(),
                }),
                // 28xxx: invalid authorization (a wrong password, a missing certificate).
                Err(error) => match error
                    .as_db_error()
                    .filter(|e| e.code().code().starts_with("28"))
                {
                    Some(db) => Err(ReplicationError::Auth {
                        user: params.user().to_owned(),
                        reason: format!("{} {}: {}", db.severity(), db.code().code(), db.message()),
                    }),
                    None => Err(ReplicationError::Query(error)),
                },
            }
        };
        within_connect_timeout(&params, connecting).await
    }
}

/// Runs a whole connect (TCP, TLS, authentication) under the URL's `connect_timeout`, if any.
async fn within_connect_timeout<T>(
    params: &ConnectParams,
    connecting: impl std::future::Future<Output = Result<T, ReplicationError>>,
) -> Result<T, ReplicationError> {
    match params.config.get_connect_timeout() {
        None => connecting.await,
        Some(&limit) => tokio::time::timeout(limit, connecting).await.map_err(|_| {
            ReplicationError::Connect {
                target: params.target(),
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no connection within {} s (connect_timeout)",
                        limit.as_secs()
                    ),
                ),
            }
        })?,
    }
}

/// Why a cleartext password is not sent.
const CLEARTEXT_REFUSED: &str = "the server asks for a cleartext password over an unencrypted \
     connection; refusing to send it (use TLS with sslmode=require, or say sslmode=disable to \
     allow it)";

/// Watches the backend's messages until authentication succeeds, and fails the read that
/// carries a cleartext-password request (`AuthenticationCleartextPassword`, code 3) so the
/// password is never written. Later bytes pass untouched.
struct CleartextGuard {
    inner: Box<dyn Transport>,
    /// The current message's tag, length and (for `R`) authentication code, as far as read.
    head: [u8; 9],
    head_len: usize,
    /// Bytes of the current message still to pass before the next header.
    rest: usize,
    /// Authentication is over (`AuthenticationOk` passed).
    done: bool,
    refused: Arc<AtomicBool>,
}

impl CleartextGuard {
    fn new(inner: Box<dyn Transport>, refused: Arc<AtomicBool>) -> Self {
        CleartextGuard {
            inner,
            head: [0; 9],
            head_len: 0,
            rest: 0,
            done: false,
            refused,
        }
    }

    /// Follows the message framing through `data`; `false` at a cleartext-password request.
    fn inspect(&mut self, mut data: &[u8]) -> bool {
        while !data.is_empty() && !self.done {
            if self.rest > 0 {
                let skipped = self.rest.min(data.len());
                self.rest -= skipped;
                data = &data[skipped..];
                continue;
            }
            self.head[self.head_len] = data[0];
            self.head_len += 1;
            data = &data[1..];
            let len = || {
                let [_, a, b, c, d, ..] = self.head;
                u32::from_be_bytes([a, b, c, d]) as usize
            };
            if self.head_len == 5 && (self.head[0] != b'R' || len() < 8) {
                // Not an authentication request: its body passes (tokio-postgres checks it).
                self.rest = len().saturating_sub(4);
                self.head_len = 0;
            } else if self.head_len == 9 {
                let [.., a, b, c, d] = self.head;
                match i32::from_be_bytes([a, b, c, d]) {
                    3 => return false,
                    0 => self.done = true,
                    _ => {}
                }
                self.rest = len() - 8;
                self.head_len = 0;
            }
        }
        true
    }
}

impl AsyncRead for CleartextGuard {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if let std::task::Poll::Ready(Ok(())) = &polled {
            let this = &mut *self;
            if !this.done && !this.inspect(&buf.filled()[before..]) {
                buf.set_filled(before);
                this.refused.store(true, Ordering::SeqCst);
                return std::task::Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    CLEARTEXT_REFUSED,
                )));
            }
        }
        polled
    }
}

impl AsyncWrite for CleartextGuard {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl std::fmt::Debug for ConnectParams {
    /// Leaves the password out.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectParams")
            .field("target", &self.target())
            .field("tls", &self.tls)
            .field("user", &self.user())
            .field("dbname", &self.dbname())
            .finish()
    }
}

impl FromStr for ConnectParams {
    type Err = ReplicationError;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        let (rest, tls) =
            split_tls_params(url).map_err(|e| ReplicationError::Config(e.to_string()))?;
        let config = tokio_postgres::Config::from_str(&rest).map_err(|e| {
            ReplicationError::Config(format!("cannot parse the connection URL: {e}"))
        })?;
        ConnectParams::with_tls(config, tls)
    }
}

impl ConnectParams {
    fn with_tls(config: tokio_postgres::Config, tls: PgTls) -> Result<Self, ReplicationError> {
        if config.get_user().is_none() {
            return Err(ReplicationError::Config(
                "expected a user in the connection URL, found none".to_owned(),
            ));
        }
        Ok(ConnectParams { config, tls })
    }

    /// The same settings for an ordinary (non-replication) `tokio-postgres` connection,
    /// without TLS; connect through [`Self::upstream`] instead.
    pub fn query_config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// The same settings, with TLS, for an ordinary (non-replication) connection.
    pub fn upstream(&self) -> PgConfig {
        PgConfig {
            config: self.config.clone(),
            tls: self.tls.clone(),
        }
    }

    /// The `sslmode` in force.
    pub(crate) fn ssl_mode(&self) -> SslMode {
        self.tls.mode()
    }

    pub fn user(&self) -> &str {
        self.config.get_user().unwrap_or_default()
    }

    fn dbname(&self) -> &str {
        self.config.get_dbname().unwrap_or_else(|| self.user())
    }

    fn port(&self) -> u16 {
        self.config.get_ports().first().copied().unwrap_or(5432)
    }

    fn host(&self) -> Host {
        self.config
            .get_hosts()
            .first()
            .cloned()
            .unwrap_or_else(|| Host::Tcp("localhost".to_owned()))
    }

    /// The byte stream to the server, TLS negotiated as `sslmode` says, and whether it is
    /// secure enough for a cleartext password (TLS, or a Unix socket).
    async fn transport(&self) -> Result<(Box<dyn Transport>, bool), ReplicationError> {
        let params = self;
        Ok(match params.host() {
            Host::Tcp(host) => {
                let stream = TcpStream::connect((host.as_str(), params.port()))
                    .await
                    .map_err(|source| ReplicationError::Connect {
                        target: params.target(),
                        source,
                    })?;
                stream.set_nodelay(true)?;
                match params.tls.negotiate(stream, &host).await {
                    Ok(Negotiated::Tls(tls)) => (Box::new(tls), true),
                    Ok(Negotiated::Plain(stream)) => (Box::new(stream), false),
                    Err(NegotiateError::Io(source)) => {
                        return Err(ReplicationError::Connect {
                            target: params.target(),
                            source,
                        })
                    }
                    Err(NegotiateError::Tls(reason)) => {
                        return Err(ReplicationError::Tls {
                            target: params.target(),
                            reason,
                        })
                    }
                }
            }
            Host::Unix(dir) => {
                // A Unix socket never leaves the machine; Postgres offers no TLS on it.
                let path = socket_path(&dir, params.port());
                let stream = UnixStream::connect(&path).await.map_err(|source| {
                    ReplicationError::Connect {
                        target: params.target(),
                        source,
                    }
                })?;
                (Box::new(stream), true)
            }
        })
    }

    /// `host:port` or the socket path, for messages.
    pub fn target(&self) -> String {
        match self.host() {
            Host::Tcp(host) => format!("{host}:{}", self.port()),
            Host::Unix(dir) => socket_path(&dir, self.port()).display().to_string(),
        }
    }
}

fn socket_path(dir: &std::path::Path, port: u16) -> PathBuf {
    dir.join(format!(".s.PGSQL.{port}"))
}

/// What `IDENTIFY_SYSTEM` reports.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg(any(test, feature = "test-support"))]
pub struct SystemIdentity {
    pub system_id: String,
    pub timeline: u32,
    /// Current WAL flush position.
    pub xlog_pos: Lsn,
    pub dbname: Option<String>,
}

/// A slot made by `CREATE_REPLICATION_SLOT … (SNAPSHOT 'export')`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreatedSlot {
    pub slot_name: String,
    /// The first position the slot will stream; the exported snapshot shows the data up to it.
    pub consistent_point: Lsn,
    /// Usable with `SET TRANSACTION SNAPSHOT` while the creating connection stays idle.
    pub snapshot_name: String,
}

/// Rows of a simple query, all values in text form (reachable from outside only through
/// `simple_query`, a `test-support` method).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(not(feature = "test-support"), allow(unreachable_pub))]
pub struct TextRows {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Option<String>>>,
}

impl TextRows {
    fn single_row(self, command: &str) -> Result<Vec<Option<String>>, ReplicationError> {
        let count = self.rows.len();
        let mut rows = self.rows.into_iter();
        match (rows.next(), rows.next()) {
            (Some(row), None) => Ok(row),
            _ => Err(ReplicationError::protocol(
                format!("one row from {command}"),
                format!("{count} rows"),
            )),
        }
    }
}

/// One backend message: tag and body (the length header stripped).
struct Frame {
    tag: u8,
    body: Bytes,
}

impl Frame {
    /// Splits the next complete message off `buf`, or returns `None` if it has not all arrived.
    fn take(buf: &mut BytesMut) -> Result<Option<Frame>, ReplicationError> {
        if buf.len() < 5 {
            return Ok(None);
        }
        let tag = buf[0];
        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
        if !(4..=MAX_MESSAGE_LEN).contains(&len) {
            return Err(ReplicationError::protocol(
                "a message length between 4 and 1 GiB",
                format!("{len} for message '{}'", char::from(tag)),
            ));
        }
        if buf.len() < len + 1 {
            // No room is reserved on the strength of the header: the buffer grows as the
            // bytes arrive (a chunk at a time), so a lying length costs nothing up front.
            return Ok(None);
        }
        let mut frame = buf.split_to(len + 1);
        frame.advance(5);
        Ok(Some(Frame {
            tag,
            body: frame.freeze(),
        }))
    }

    fn describe(&self) -> String {
        format!("message '{}'", char::from(self.tag).escape_default())
    }
}

/// A connection in replication mode, outside COPY: ready for a replication command.
pub struct ReplicationConnection {
    transport: Box<dyn Transport>,
    /// Whether a cleartext password may be sent: over TLS, a Unix socket, or `sslmode=disable`.
    cleartext_allowed: bool,
    read_buf: BytesMut,
    write_buf: BytesMut,
    user: String,
    server_major: u32,
    backend_pid: i32,
}

impl std::fmt::Debug for ReplicationConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationConnection")
            .field("user", &self.user)
            .field("server_major", &self.server_major)
            .field("backend_pid", &self.backend_pid)
            .finish()
    }
}

impl ReplicationConnection {
    /// Connects in `replication=database` mode and authenticates, within the URL's
    /// `connect_timeout` as ordinary connections do.
    pub async fn connect(params: &ConnectParams) -> Result<Self, ReplicationError> {
        within_connect_timeout(params, async {
            let (transport, secure) = params.transport().await?;
            let mut conn = ReplicationConnection {
                transport,
                cleartext_allowed: secure || params.ssl_mode() == SslMode::Disable,
                read_buf: BytesMut::with_capacity(READ_CHUNK),
                write_buf: BytesMut::new(),
                user: params.user().to_owned(),
                server_major: 0,
                backend_pid: 0,
            };
            conn.startup(params).await?;
            Ok(conn)
        })
        .await
    }

    /// Process id of the walsender serving this connection.
    #[cfg(any(test, feature = "test-support"))]
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    async fn startup(&mut self, params: &ConnectParams) -> Result<(), ReplicationError> {
        let application_name = params
            .config
            .get_application_name()
            .unwrap_or("highwater")
            .to_owned();
        let startup = [
            ("user", params.user()),
            ("database", params.dbname()),
            ("replication", "database"),
            ("application_name", application_name.as_str()),
            ("client_encoding", "UTF8"),
            // pgoutput sends values as text in the walsender's formats; the mapper reads ISO dates
            // and exact floats, whatever the server's defaults are.
            ("DateStyle", "ISO, MDY"),
            ("IntervalStyle", "postgres"),
            ("TimeZone", "UTC"),
            ("extra_float_digits", "3"),
        ];
        frontend::startup_message(startup.iter().copied(), &mut self.write_buf)?;
        self.flush().await?;

        let password = params.config.get_password().map(<[u8]>::to_vec);
        let mut scram: Option<ScramSha256> = None;
        loop {
            let frame = self.read_frame().await?;
            match frame.tag {
                b'R' => {
                    self.authenticate(frame.body, password.as_deref(), &mut scram)
                        .await?
                }
                b'S' => {
                    let (name, value) = parameter_status(&frame.body)?;
                    if name == "server_version" {
                        self.server_major = leading_number(&value);
                    }
                }
                b'K' => {
                    let mut body = frame.body;
                    if body.len() >= 4 {
                        self.backend_pid = body.get_i32();
                    }
                }
                b'N' => log_notice(&frame.body),
                b'E' => {
                    let error = parse_error(&frame.body);
                    return Err(ReplicationError::from_server(error, None, &self.user));
                }
                b'Z' => return Ok(()),
                _ => {
                    return Err(ReplicationError::protocol(
                        "authentication or ReadyForQuery",
                        frame.describe(),
                    ))
                }
            }
        }
    }

    async fn authenticate(
        &mut self,
        mut body: Bytes,
        password: Option<&[u8]>,
        scram: &mut Option<ScramSha256>,
    ) -> Result<(), ReplicationError> {
        if body.len() < 4 {
            return Err(ReplicationError::protocol(
                "an authentication request code",
                format!("{} bytes", body.len()),
            ));
        }
        let code = body.get_i32();
        let need_password = || ReplicationError::Auth {
            user: self.user.clone(),
            reason: "the server asks for a password, but the connection URL has none".to_owned(),
        };
        match code {
            0 => return Ok(()),
            3 => {
                if !self.cleartext_allowed {
                    return Err(ReplicationError::Auth {
                        user: self.user.clone(),
                        reason: CLEARTEXT_REFUSED.to_owned(),
                    });
                }
                let password = password.ok_or_else(need_password)?;
                // password_message adds the terminating NUL itself.
                frontend::password_message(password, &mut self.write_buf)?;
            }
            5 => {
                let password = password.ok_or_else(need_password)?;
                if body.len() < 4 {
                    return Err(ReplicationError::protocol("a 4-byte MD5 salt", "less"));
                }
                let salt = [body[0], body[1], body[2], body[3]];
                let hash = md5_hash(self.user.as_bytes(), password, salt);
                frontend::password_message(hash.as_bytes(), &mut self.write_buf)?;
            }
            10 => {
                let password = password.ok_or_else(need_password)?;
                let offered = cstrings(&body);
                if !offered.iter().any(|m| m == SCRAM_SHA_256) {
                    return Err(ReplicationError::Auth {
                        user: self.user.clone(),
                        reason: format!(
                            "expected the server to offer {SCRAM_SHA_256}, it offered {offered:?}"
                        ),
                    });
                }
                // No TLS here, so no channel binding.
                let client = ScramSha256::new(password, ChannelBinding::unsupported());
                frontend::sasl_initial_response(
                    SCRAM_SHA_256,
                    client.message(),
                    &mut self.write_buf,
                )?;
                *scram = Some(client);
            }
            11 => {
                let client = scram
                    .as_mut()
                    .ok_or_else(|| ReplicationError::protocol("SASL start", "SASL continue"))?;
                client.update(&body).map_err(|e| self.scram_failed(e))?;
                frontend::sasl_response(client.message(), &mut self.write_buf)?;
            }
            12 => {
                let mut client = scram
                    .take()
                    .ok_or_else(|| ReplicationError::protocol("SASL start", "SASL final"))?;
                client.finish(&body).map_err(|e| self.scram_failed(e))?;
                return Ok(());
            }
            other => {
                return Err(ReplicationError::Auth {
                    user: self.user.clone(),
                    reason: format!(
                        "the server asks for authentication method {other}; supported are trust, \
                         password, md5 and scram-sha-256"
                    ),
                })
            }
        }
        self.flush().await
    }

    fn scram_failed(&self, error: std::io::Error) -> ReplicationError {
        ReplicationError::Auth {
            user: self.user.clone(),
            reason: format!("SCRAM exchange failed: {error}"),
        }
    }

    /// Runs one simple-query command and collects its rows as text. A server error is returned
    /// only after ReadyForQuery, so the connection stays usable.
    #[cfg(any(test, feature = "test-support"))]
    pub async fn simple_query(&mut self, sql: &str) -> Result<TextRows, ReplicationError> {
        self.simple_query_for(sql, None).await
    }

    async fn simple_query_for(
        &mut self,
        sql: &str,
        slot: Option<&str>,
    ) -> Result<TextRows, ReplicationError> {
        frontend::query(sql, &mut self.write_buf)?;
        self.flush().await?;
        let mut rows = TextRows::default();
        let mut failure: Option<ServerError> = None;
        loop {
            let frame = self.read_frame().await?;
            match frame.tag {
                b'T' => rows.columns = row_description(&frame.body)?,
                b'D' => rows.rows.push(data_row(&frame.body)?),
                b'C' | b'I' | b'S' => {}
                b'N' => log_notice(&frame.body),
                b'E' => failure = Some(parse_error(&frame.body)),
                b'Z' => {
                    return match failure {
                        Some(error) => Err(ReplicationError::from_server(error, slot, &self.user)),
                        None => Ok(rows),
                    }
                }
                _ => {
                    return Err(ReplicationError::protocol(
                        format!("a reply to {sql}"),
                        frame.describe(),
                    ))
                }
            }
        }
    }

    /// `IDENTIFY_SYSTEM`.
    #[cfg(any(test, feature = "test-support"))]
    pub async fn identify_system(&mut self) -> Result<SystemIdentity, ReplicationError> {
        let row = self
            .simple_query("IDENTIFY_SYSTEM")
            .await?
            .single_row("IDENTIFY_SYSTEM")?;
        let field = |i: usize| row.get(i).cloned().flatten();
        let missing =
            |what: &str| ReplicationError::protocol(format!("{what} in IDENTIFY_SYSTEM"), "none");
        let timeline_text = field(1).ok_or_else(|| missing("timeline"))?;
        let xlog_text = field(2).ok_or_else(|| missing("xlogpos"))?;
        Ok(SystemIdentity {
            system_id: field(0).ok_or_else(|| missing("systemid"))?,
            timeline: timeline_text.parse().map_err(|_| {
                ReplicationError::protocol("a numeric timeline", timeline_text.clone())
            })?,
            xlog_pos: parse_lsn(&xlog_text)?,
            dbname: field(3),
        })
    }

    /// `CREATE_REPLICATION_SLOT <slot> LOGICAL pgoutput` exporting a snapshot. Keep this
    /// connection open and idle while other sessions read with the snapshot: the next command
    /// sent here (or closing it) releases the snapshot.
    pub async fn create_slot_with_snapshot(
        &mut self,
        slot: &str,
    ) -> Result<CreatedSlot, ReplicationError> {
        let quoted = quote_ident(slot);
        // The option-list syntax exists from Postgres 15; older servers take the bare keyword.
        let sql = if self.server_major >= 15 {
            format!("CREATE_REPLICATION_SLOT {quoted} LOGICAL pgoutput (SNAPSHOT 'export')")
        } else {
            format!("CREATE_REPLICATION_SLOT {quoted} LOGICAL pgoutput EXPORT_SNAPSHOT")
        };
        let rows = self.simple_query_for(&sql, Some(slot)).await?;
        let row = rows.single_row("CREATE_REPLICATION_SLOT")?;
        let field = |i: usize, what: &str| {
            row.get(i).cloned().flatten().ok_or_else(|| {
                ReplicationError::protocol(format!("{what} in CREATE_REPLICATION_SLOT"), "none")
            })
        };
        Ok(CreatedSlot {
            slot_name: field(0, "slot_name")?,
            consistent_point: parse_lsn(&field(1, "consistent_point")?)?,
            snapshot_name: field(2, "snapshot_name")?,
        })
    }

    /// `START_REPLICATION SLOT … LOGICAL <start>` with pgoutput protocol 1 and logical messages.
    pub async fn start_replication(
        mut self,
        slot: &str,
        start: Lsn,
        publications: &[String],
    ) -> Result<ReplicationStream, ReplicationError> {
        let names = publications
            .iter()
            .map(|p| quote_ident(p))
            .collect::<Vec<_>>()
            .join(",");
        let sql = format!(
            "START_REPLICATION SLOT {} LOGICAL {start} (proto_version '1', publication_names {}, \
             messages 'true')",
            quote_ident(slot),
            quote_literal(&names),
        );
        frontend::query(&sql, &mut self.write_buf)?;
        self.flush().await?;
        let mut failure: Option<ServerError> = None;
        loop {
            let frame = self.read_frame().await?;
            match frame.tag {
                b'W' => {
                    return Ok(ReplicationStream {
                        conn: self,
                        slot: slot.to_owned(),
                    })
                }
                b'N' => log_notice(&frame.body),
                b'S' => {}
                b'E' => failure = Some(parse_error(&frame.body)),
                b'Z' => {
                    let error = failure.unwrap_or_else(|| ServerError {
                        message: "START_REPLICATION ended without starting a stream".to_owned(),
                        ..ServerError::default()
                    });
                    return Err(ReplicationError::from_server(error, Some(slot), &self.user));
                }
                _ => {
                    return Err(ReplicationError::protocol(
                        "CopyBothResponse after START_REPLICATION",
                        frame.describe(),
                    ))
                }
            }
        }
    }

    /// Sends Terminate and closes the socket.
    pub async fn close(mut self) -> Result<(), ReplicationError> {
        frontend::terminate(&mut self.write_buf);
        self.flush().await?;
        self.transport.shutdown().await?;
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), ReplicationError> {
        let pending = self.write_buf.split();
        self.transport.write_all(&pending).await?;
        self.transport.flush().await?;
        Ok(())
    }

    /// Reads the next message. Cancel-safe: partial input stays in `read_buf`.
    async fn read_frame(&mut self) -> Result<Frame, ReplicationError> {
        loop {
            if let Some(frame) = Frame::take(&mut self.read_buf)? {
                return Ok(frame);
            }
            if self.read_buf.capacity() - self.read_buf.len() < READ_CHUNK / 4 {
                self.read_buf.reserve(READ_CHUNK);
            }
            if self.transport.read_buf(&mut self.read_buf).await? == 0 {
                return Err(ReplicationError::Closed);
            }
        }
    }
}

/// A connection inside `START_REPLICATION`'s CopyBoth mode.
#[derive(Debug)]
pub struct ReplicationStream {
    conn: ReplicationConnection,
    slot: String,
}

impl ReplicationStream {
    /// The next CopyData payload (`w` XLogData or `k` keepalive, undecoded), or `None` when the
    /// server ends the stream cleanly. Cancel-safe, so it can sit in a `select!`.
    pub async fn next_copy_data(&mut self) -> Result<Option<Bytes>, ReplicationError> {
        loop {
            let frame = self.conn.read_frame().await?;
            match frame.tag {
                b'd' => return Ok(Some(frame.body)),
                // CopyDone, or CommandComplete from a walsender that is shutting down.
                b'c' | b'C' => return Ok(None),
                b'N' => log_notice(&frame.body),
                b'S' => {}
                b'E' => {
                    let error = parse_error(&frame.body);
                    return Err(ReplicationError::from_server(
                        error,
                        Some(&self.slot),
                        &self.conn.user,
                    ));
                }
                _ => {
                    return Err(ReplicationError::protocol(
                        "CopyData in the replication stream",
                        frame.describe(),
                    ))
                }
            }
        }
    }

    /// Sends one CopyData message (a standby status update) and flushes it.
    pub(crate) async fn send_copy_data(&mut self, payload: &[u8]) -> Result<(), ReplicationError> {
        frontend::CopyData::new(payload)?.write(&mut self.conn.write_buf);
        self.conn.flush().await
    }

    /// Process id of the walsender serving this stream.
    pub fn backend_pid(&self) -> i32 {
        self.conn.backend_pid
    }

    /// Ends COPY and the session politely; errors are irrelevant to a caller walking away.
    pub async fn close(mut self) {
        frontend::copy_done(&mut self.conn.write_buf);
        frontend::terminate(&mut self.conn.write_buf);
        let _ = self.conn.flush().await;
        let _ = self.conn.transport.shutdown().await;
    }
}

fn parse_lsn(text: &str) -> Result<Lsn, ReplicationError> {
    Lsn::from_str(text).map_err(|_| ReplicationError::protocol("an LSN like 0/16B3748", text))
}

/// `"name"` with embedded quotes doubled.
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// `'text'` with embedded quotes doubled.
pub(crate) fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

fn leading_number(text: &str) -> u32 {
    let digits: String = text.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().unwrap_or(0)
}

/// NUL-terminated strings one after another, up to an empty one or the end.
fn cstrings(body: &[u8]) -> Vec<String> {
    body.split(|&b| b == 0)
        .take_while(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

fn parameter_status(body: &[u8]) -> Result<(String, String), ReplicationError> {
    let mut parts = body.split(|&b| b == 0);
    match (parts.next(), parts.next()) {
        (Some(name), Some(value)) => Ok((
            String::from_utf8_lossy(name).into_owned(),
            String::from_utf8_lossy(value).into_owned(),
        )),
        _ => Err(ReplicationError::protocol(
            "ParameterStatus with a name and a value",
            format!("{} bytes", body.len()),
        )),
    }
}

fn parse_error(body: &[u8]) -> ServerError {
    let mut error = ServerError::default();
    for field in body.split(|&b| b == 0) {
        let Some((&kind, value)) = field.split_first() else {
            continue;
        };
        let value = String::from_utf8_lossy(value).into_owned();
        match kind {
            b'V' => error.severity = value,
            b'S' if error.severity.is_empty() => error.severity = value,
            b'C' => error.code = value,
            b'M' => error.message = value,
            b'D' => error.detail = Some(value),
            b'H' => error.hint = Some(value),
            _ => {}
        }
    }
    error
}

fn log_notice(body: &[u8]) {
    let notice = parse_error(body);
    tracing::info!(code = %notice.code, "postgres notice: {}", notice.message);
}

fn row_description(body: &[u8]) -> Result<Vec<String>, ReplicationError> {
    let bad = || ReplicationError::protocol("a well-formed RowDescription", "a truncated one");
    let mut rest = body;
    if rest.len() < 2 {
        return Err(bad());
    }
    let count = u16::from_be_bytes([rest[0], rest[1]]);
    rest = &rest[2..];
    // Each column takes at least 19 bytes: no more room than the body can fill.
    let mut names = Vec::with_capacity(usize::from(count).min(rest.len() / 19));
    for _ in 0..count {
        let end = rest.iter().position(|&b| b == 0).ok_or_else(bad)?;
        names.push(String::from_utf8_lossy(&rest[..end]).into_owned());
        // Name, NUL, then table oid, column, type oid, size, modifier, format: 18 bytes.
        rest = rest.get(end + 1 + 18..).ok_or_else(bad)?;
    }
    Ok(names)
}

fn data_row(body: &[u8]) -> Result<Vec<Option<String>>, ReplicationError> {
    let bad = || ReplicationError::protocol("a well-formed DataRow", "a truncated one");
    let mut rest = body;
    if rest.len() < 2 {
        return Err(bad());
    }
    let count = u16::from_be_bytes([rest[0], rest[1]]);
    rest = &rest[2..];
    // Each value takes at least its 4-byte length.
    let mut values = Vec::with_capacity(usize::from(count).min(rest.len() / 4));
    for _ in 0..count {
        let len_bytes: [u8; 4] = rest
            .get(..4)
            .ok_or_else(bad)?
            .try_into()
            .map_err(|_| bad())?;
        let len = i32::from_be_bytes(len_bytes);
        rest = &rest[4..];
        if len < 0 {
            values.push(None);
            continue;
        }
        let len = len as usize;
        let value = rest.get(..len).ok_or_else(bad)?;
        values.push(Some(String::from_utf8_lossy(value).into_owned()));
        rest = &rest[len..];
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that accepts and then says nothing: without the limit, the replication
    /// connection would wait for its startup answer forever.
    #[tokio::test]
    async fn the_replication_connection_gives_up_at_connect_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("listen");
        let port = listener.local_addr().expect("addr").port();
        let silent = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        let params: ConnectParams =
            format!("postgres://u@127.0.0.1:{port}/db?sslmode=disable&connect_timeout=1")
                .parse()
                .expect("url");
        let started = std::time::Instant::now();
        let result = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            ReplicationConnection::connect(&params),
        )
        .await
        .expect("the connect ends on its own");
        let error = result.expect_err("no answer is a timeout");
        assert!(error.to_string().contains("connect_timeout"), "{error}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        silent.abort();
    }

    fn auth(code: i32, rest: &[u8]) -> Vec<u8> {
        let mut body = code.to_be_bytes().to_vec();
        body.extend_from_slice(rest);
        message(b'R', &body)
    }

    fn guard() -> CleartextGuard {
        CleartextGuard::new(
            Box::new(tokio::io::empty()),
            Arc::new(AtomicBool::new(false)),
        )
    }

    #[test]
    fn the_cleartext_guard_finds_a_cleartext_request_at_any_split_and_nothing_else() {
        // SCRAM: SASL (10), continue (11), final (12), ok (0), then ordinary messages that
        // happen to hold the bytes of a cleartext request.
        let mut scram = auth(10, b"SCRAM-SHA-256\0\0");
        scram.extend(auth(11, b"r=abc,s=def,i=4096"));
        scram.extend(auth(12, b"v=xyz"));
        scram.extend(auth(0, b""));
        scram.extend(auth(3, b""));
        let mut cleartext = message(b'E', &[0; 7]);
        cleartext.extend(message(b'v', &auth(3, b"")));
        cleartext.extend(auth(3, b""));
        for split in 0..scram.len() {
            let mut g = guard();
            assert!(
                g.inspect(&scram[..split]) && g.inspect(&scram[split..]),
                "{split}"
            );
            assert!(g.done);
        }
        for split in 0..cleartext.len() {
            let mut g = guard();
            let passed = g.inspect(&cleartext[..split]) && g.inspect(&cleartext[split..]);
            assert!(!passed, "split at {split}");
        }
        // Byte by byte too.
        let mut g = guard();
        assert!(!cleartext.iter().all(|b| g.inspect(std::slice::from_ref(b))));
    }

    fn message(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        out.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        out.extend_from_slice(body);
        out
    }

    #[test]
    fn frames_split_at_message_boundaries_and_wait_for_the_rest() {
        let mut wire = message(b'W', &[0, 0, 0]);
        wire.extend(message(b'd', b"kpayload"));
        let mut buf = BytesMut::from(&wire[..wire.len() - 3]);
        let first = Frame::take(&mut buf).unwrap().unwrap();
        assert_eq!(first.tag, b'W');
        assert_eq!(&first.body[..], &[0, 0, 0]);
        assert!(
            Frame::take(&mut buf).unwrap().is_none(),
            "second frame is incomplete"
        );
        buf.extend_from_slice(&wire[wire.len() - 3..]);
        let second = Frame::take(&mut buf).unwrap().unwrap();
        assert_eq!((second.tag, &second.body[..]), (b'd', &b"kpayload"[..]));
        assert!(buf.is_empty());
    }

    #[test]
    fn a_huge_length_header_reserves_nothing_until_the_bytes_arrive() {
        // A header announcing a 1 GiB message, then five bytes of it.
        let mut buf = BytesMut::with_capacity(64);
        buf.extend_from_slice(&[b'd', 0x40, 0, 0, 0]);
        buf.extend_from_slice(b"12345");
        let before = buf.capacity();
        assert!(Frame::take(&mut buf).unwrap().is_none(), "incomplete");
        assert_eq!(buf.capacity(), before, "reserved on the header alone");
        assert_eq!(buf.len(), 10, "the partial message stays buffered");
    }

    #[test]
    fn row_headers_claiming_many_columns_reserve_by_the_body() {
        // 65535 columns announced, none present: an error, with no big allocation first.
        assert!(row_description(&[0xff, 0xff]).is_err());
        assert!(data_row(&[0xff, 0xff]).is_err());
    }

    #[test]
    fn a_corrupt_length_is_a_protocol_error_naming_the_length() {
        let mut buf = BytesMut::from(&[b'd', 0, 0, 0, 2][..]);
        let err = Frame::take(&mut buf).err().unwrap();
        assert!(err.to_string().contains("got 2 for message 'd'"), "{err}");
    }

    #[test]
    fn error_fields_are_read_by_their_codes() {
        let body = b"SERROR\0VERROR\0C55006\0Mreplication slot \"s\" is active for PID 7\0\0";
        let error = parse_error(body);
        assert_eq!(error.code, "55006");
        assert_eq!(error.severity, "ERROR");
        assert_eq!(error.message, "replication slot \"s\" is active for PID 7");
    }

    #[test]
    fn data_rows_keep_nulls_and_text() {
        let mut body = vec![0, 2];
        body.extend_from_slice(&3i32.to_be_bytes());
        body.extend_from_slice(b"0/1");
        body.extend_from_slice(&(-1i32).to_be_bytes());
        assert_eq!(data_row(&body).unwrap(), vec![Some("0/1".to_owned()), None]);
        assert!(data_row(&body[..6]).is_err());
    }

    #[test]
    fn row_description_reads_column_names() {
        let mut body = vec![0, 2];
        for name in ["slot_name", "consistent_point"] {
            body.extend_from_slice(name.as_bytes());
            body.push(0);
            body.extend_from_slice(&[0; 18]);
        }
        assert_eq!(
            row_description(&body).unwrap(),
            vec!["slot_name", "consistent_point"]
        );
    }

    #[test]
    fn identifiers_and_literals_are_quoted() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }

    #[test]
    fn urls_without_user_are_rejected_and_passwords_stay_out_of_debug() {
        assert!(ConnectParams::from_str("postgres://127.0.0.1:5/db").is_err());
        let params = ConnectParams::from_str("postgres://u:secret@127.0.0.1:5433/db").unwrap();
        assert_eq!(params.target(), "127.0.0.1:5433");
        assert!(!format!("{params:?}").contains("secret"));
    }

    #[test]
    fn server_version_major_is_the_leading_number() {
        assert_eq!(leading_number("15.4 (Debian 15.4-1)"), 15);
        assert_eq!(leading_number("9.6.2"), 9);
    }
}
