//! `highwater watch`: subscribes to a Highwater (or any v8 change streamer) and prints every
//! downstream message as one JSON line, acking each frame once printed. Pipe it into
//! `highwater check-stream -` to validate a live stream.

use std::io::Write as _;

use anyhow::{bail, Context as _};
use futures::{SinkExt as _, StreamExt as _};
use highwater_engine::change_stream::{
    ack_frame, decode_downstream_frame, encode_downstream, encode_upstream, message_frame,
    DownstreamMessage, Extra, Frame, ReserveSnapshot, SubscribeContext, SubscriberMode,
    UpstreamMessage,
};
use highwater_engine::watermark::Watermark;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::http::header::AUTHORIZATION;
use tokio_tungstenite::tungstenite::Message as WsMessage;

use crate::runtime;
use crate::serve::load_token;

#[derive(Debug, Clone, clap::Args)]
pub struct WatchArgs {
    /// Base WebSocket URL of the server, e.g. ws://127.0.0.1:4848.
    pub url: String,
    /// Start after this commit watermark (default: the server's current minimum watermark).
    #[arg(long)]
    pub watermark: Option<String>,
    /// Replay the whole change log, from the replica version.
    #[arg(long, conflicts_with = "watermark")]
    pub(crate) from_start: bool,
    /// Exit after this many commits.
    #[arg(long)]
    pub commits: Option<u64>,
    /// File holding the server's replication token (default: the environment variable
    /// HIGHWATER_REPLICATION_TOKEN, if set).
    #[arg(long, value_name = "FILE")]
    pub(crate) replication_token_file: Option<std::path::PathBuf>,
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Runs `highwater watch` until the stream ends, Ctrl-C, or `--commits` commits.
pub fn run(args: WatchArgs) -> anyhow::Result<()> {
    runtime::init_tracing("info");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        tokio::select! {
            result = watch(args) => result,
            _ = runtime::wait_for_signal() => Ok(()),
        }
    })
}

async fn watch(args: WatchArgs) -> anyhow::Result<()> {
    let task_id = format!("watch-{}", std::process::id());
    let url = format!(
        "{}/replication/v8/subscribe?taskID={task_id}",
        args.url.trim_end_matches('/')
    );
    let mut request = url.as_str().into_client_request()?;
    if let Some(token) = load_token(args.replication_token_file.as_deref())? {
        request
            .headers_mut()
            .insert(AUTHORIZATION, token.authorization());
    }
    let (mut socket, _) = tokio_tungstenite::connect_async_with_config(request, None, true)
        .await
        .with_context(|| format!("connecting to {url}"))?;

    // The reservation answer names the replica version and the oldest watermark the log serves.
    let mut next_id = 0u64;
    let mut send = |msg: UpstreamMessage| {
        next_id += 1;
        message_frame(next_id, &encode_upstream(&msg))
    };
    let reserve = send(UpstreamMessage::ReserveSnapshot(ReserveSnapshot {
        task_id: task_id.clone(),
        extra: Extra::new(),
    }));
    socket.send(WsMessage::text(reserve)).await?;
    let reserved = loop {
        let frame = next_frame(&mut socket).await?;
        ack(&mut socket, &frame).await?;
        if let Some(reserved) = frame.into_messages().into_iter().find_map(|m| match m {
            DownstreamMessage::Reserved(reserved) => Some(reserved),
            _ => None,
        }) {
            break reserved;
        }
    };
    let watermark = match (&args.watermark, args.from_start) {
        (Some(text), _) => Watermark::parse(text).context("--watermark")?,
        (None, true) => reserved.replica_version.clone(),
        (None, false) => reserved.min_watermark.clone(),
    };
    let start = send(UpstreamMessage::StartSubscription(SubscribeContext {
        task_id: task_id.clone(),
        id: task_id,
        mode: SubscriberMode::Serving,
        replica_version: reserved.replica_version,
        watermark,
        backfills: Some(Vec::new()),
        extra: Extra::new(),
    }));
    socket.send(WsMessage::text(start)).await?;

    let mut commits = 0u64;
    let mut out = std::io::stdout().lock();
    loop {
        let frame = next_frame(&mut socket).await?;
        for message in frame.messages() {
            writeln!(out, "{}", encode_downstream(message))?;
            match message {
                DownstreamMessage::Commit(_) => {
                    commits += 1;
                    // A batch may hold more transactions: stop at exactly the commit asked for.
                    if args.commits.is_some_and(|limit| commits >= limit) {
                        out.flush()?;
                        return Ok(());
                    }
                }
                DownstreamMessage::Error(_) => {
                    out.flush()?;
                    bail!(
                        "the server ended the subscription with {}",
                        encode_downstream(message)
                    )
                }
                _ => {}
            }
        }
        out.flush()?;
        ack(&mut socket, &frame).await?;
    }
}

/// The next application or ack frame; pings are answered by the socket itself.
async fn next_frame(socket: &mut Socket) -> anyhow::Result<Frame<DownstreamMessage>> {
    loop {
        match socket.next().await {
            Some(Ok(WsMessage::Text(text))) => {
                return decode_downstream_frame(text.as_str()).context("an invalid frame")
            }
            Some(Ok(WsMessage::Close(close))) => bail!("the server closed the stream: {close:?}"),
            Some(Ok(_)) => continue,
            Some(Err(error)) => return Err(error.into()),
            None => bail!("the server closed the stream"),
        }
    }
}

async fn ack(socket: &mut Socket, frame: &Frame<DownstreamMessage>) -> anyhow::Result<()> {
    if let Some(id) = frame.id() {
        socket.send(WsMessage::text(ack_frame(id))).await?;
    }
    Ok(())
}
