//! The properties of the peer-frame fuzz targets, shared by the fuzz targets and by the
//! regression replay under `engine/tests/`, so both check exactly the same thing.
//!
//! An input is a sequence of WebSocket text frames, one per line, as one peer would send them
//! to a running server.

// Each fuzz target uses one of these.
#![allow(dead_code)]

use highwater_engine::change_stream::{decode_upstream_frame, SubscribeContext, SubscriberMode};
use highwater_engine::scope_sync::server::{
    ConnId as SyncConn, Decision, Grant, PageResult, ScopeServer, ServerConfig, ServerEffect,
    ServerInput,
};
use highwater_engine::scope_sync::{ClientFrame, MutationResult, SubscribeParams};
use highwater_engine::streamer::{ChangeLogState, ConnId, Effect, Streamer, StreamerConfig};
use highwater_engine::watermark::Watermark;

/// The frames of one input: its lines, when it is UTF-8 text.
fn frames(data: &[u8]) -> Option<Vec<&str>> {
    let text = std::str::from_utf8(data).ok()?;
    Some(text.lines().take(64).collect())
}

/// Change-stream upstream frames (acks, `reserve-snapshot`, `start-subscription`) to a
/// streamer: a v8 `/subscribe` socket and a v6 `/changes` subscriber each get every frame.
/// The streamer never panics and answers every frame with effects for that socket only.
pub fn change_stream_upstream(data: &[u8]) {
    let Some(frames) = frames(data) else {
        return;
    };
    let version = Watermark::parse("0a").expect("a watermark");
    let mut streamer = Streamer::new(
        StreamerConfig::new(version.clone()),
        ChangeLogState {
            last_watermark: version.clone(),
            min_watermark: version.clone(),
        },
    );
    let (v8, v6) = (ConnId(1), ConnId(2));
    streamer.open(v8, 8, false);
    streamer.open(v6, 6, true);
    let _ = streamer.subscribe(
        v6,
        SubscribeContext {
            task_id: "task".to_owned(),
            id: "sub".to_owned(),
            mode: SubscriberMode::Serving,
            replica_version: version.clone(),
            watermark: version,
            backfills: None,
            extra: Default::default(),
        },
        0,
    );
    for (n, text) in frames.iter().enumerate() {
        // Decoding alone never panics either.
        let _ = decode_upstream_frame(text);
        let now = n as u64 * 1000;
        for conn in [v8, v6] {
            for effect in streamer.on_client_frame(conn, text, now) {
                let target = match &effect {
                    Effect::Send { conn, .. }
                    | Effect::Close { conn, .. }
                    | Effect::FetchCatchup { conn, .. }
                    | Effect::PauseCatchup { conn }
                    | Effect::ResumeCatchup { conn } => Some(*conn),
                    _ => None,
                };
                assert!(
                    target.is_none_or(|t| t == conn),
                    "a frame from {conn} produced an effect for another socket: {effect:?}"
                );
            }
        }
        let _ = streamer.tick(now);
    }
}

/// Scope-sync client frames to a scope server, the way `/sync` feeds them: decoding never
/// panics, decoded frames round-trip, subscribe params decode without panicking and
/// round-trip, and the server never panics whatever the frames (authorizations granted,
/// pages answered empty, so subscriptions go as far as they can).
pub fn scope_sync_client(data: &[u8]) {
    let Some(frames) = frames(data) else {
        return;
    };
    let mut config = ServerConfig::new("epoch");
    config.takes_writes = true;
    let mut server = ScopeServer::new(config);
    let conn: SyncConn = 1;
    let mut pending = vec![ServerInput::Opened {
        conn,
        session_id: "s-1".to_owned(),
    }];
    let mut now = 0;
    for text in frames {
        if let Ok(frame) = ClientFrame::from_json(text) {
            let encoded = frame.to_json();
            let again = ClientFrame::from_json(&encoded)
                .unwrap_or_else(|e| panic!("re-encoded frame does not decode: {e}\n{encoded}"));
            assert_eq!(again, frame, "decode(encode(frame)) differs");
            if let ClientFrame::ChannelSubscribe { params, .. } = &frame {
                if let Ok(decoded) = SubscribeParams::from_params(params) {
                    let again = SubscribeParams::from_params(&decoded.to_params())
                        .unwrap_or_else(|e| panic!("re-encoded params do not decode: {e}"));
                    assert_eq!(again, decoded, "decode(encode(params)) differs");
                }
            }
        }
        pending.push(ServerInput::Frame {
            conn,
            text: text.to_owned(),
        });
        while let Some(input) = pending.pop() {
            now += 10;
            for effect in server.handle(input, now) {
                match effect {
                    ServerEffect::Authorize {
                        conn,
                        ticket,
                        resource_type,
                        ..
                    } => pending.push(ServerInput::Authorized {
                        conn,
                        ticket,
                        decision: Decision::Granted(Grant {
                            table: resource_type,
                            omit_columns: Vec::new(),
                            expires_at_ms: None,
                            row_filter: None,
                        }),
                    }),
                    ServerEffect::FetchPage {
                        conn,
                        ticket,
                        pass,
                        up_to,
                        ..
                    } => pending.push(ServerInput::PageFetched {
                        conn,
                        ticket,
                        pass,
                        result: PageResult::Rows {
                            up_to: up_to.unwrap_or(0),
                            rows: Vec::new(),
                            total: Some(0),
                            floor: None,
                            access_changed: false,
                        },
                    }),
                    ServerEffect::Send { conn, text } => {
                        // Every frame the server sends is one a client can decode.
                        highwater_engine::scope_sync::ServerFrame::from_json(&text).unwrap_or_else(
                            |e| panic!("server sent an invalid frame: {e}\n{text}"),
                        );
                        pending.push(ServerInput::Written {
                            conn,
                            bytes: text.len(),
                        });
                    }
                    ServerEffect::ApplyMutations {
                        conn,
                        ticket,
                        mutations,
                        ..
                    } => {
                        let results: Vec<MutationResult> = mutations
                            .iter()
                            .map(|m| match m {
                                Ok(m) => MutationResult::confirmed(m.id),
                                Err(e) => {
                                    MutationResult::rejected(e.id, "invalid", e.reason.clone())
                                }
                            })
                            .collect();
                        let replicated = results.iter().map(|r| r.id).max();
                        pending.push(ServerInput::MutationsApplied {
                            conn,
                            ticket,
                            results,
                            replicated,
                        });
                    }
                    ServerEffect::LookUpReplicated { client_id } => {
                        pending.push(ServerInput::Replicated {
                            client_id,
                            last: None,
                        });
                    }
                    // Grants carry no row filter, so no set is ever read.
                    ServerEffect::Close { .. }
                    | ServerEffect::ReadSet { .. }
                    | ServerEffect::ReadMoves { .. } => {}
                }
            }
        }
    }
    let _ = server.handle(ServerInput::Closed { conn }, now + 10);
}
