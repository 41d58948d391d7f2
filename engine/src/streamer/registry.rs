//! Downstream connections: frame ids, outstanding frames and what their acks release
//! (`docs/protocol/change-stream.md`, "Framing").
//!
//! Connections framing the same burst as batch frames share one serialized payload
//! ([`SharedBatch`]). A connection that may not get batch frames (below v7, without
//! `wsBatched`) gets one frame and one ack per message.
//!
//! Not built: routing a burst once for every subscriber at the same position. Each message is
//! still offered to each subscriber in turn, on the ingest thread under the streamer's lock,
//! which at many subscribers is much of the server's CPU (`BENCHMARKS.md`, section "Fan-out:
//! one change stream to many subscribers, and catch-up from the log", "What bounds it"). Tried
//! and not kept: ack-clocked framing, where a connection with a frame unacknowledged at the end
//! of a burst keeps holding its messages until the ack. Acks were back before most bursts
//! ended, so frames hardly grew, and a remote subscriber's messages would wait up to a round
//! trip whenever a frame is in flight.

use std::collections::VecDeque;
use std::sync::Arc;

use super::subscriber::{Carried, Subscriber};
use super::Outgoing;
use crate::change_stream::{batch_frames_allowed, AckError, AckQueue, BatchPayload};

/// A frame sent and not yet acknowledged.
#[derive(Debug, Clone)]
pub struct SentFrame {
    pub carried: Carried,
    /// The `error` message: its ack ends the connection.
    pub is_error: bool,
}

/// One change-stream connection (any endpoint).
#[derive(Debug, Clone)]
pub struct Connection {
    /// The protocol version from the URL path.
    pub version: u32,
    /// Whether `{"id","batch"}` frames may be sent.
    pub batched: bool,
    frames: AckQueue,
    /// Parallel to `frames`' outstanding ids.
    sent: VecDeque<SentFrame>,
    pub subscriber: Option<Subscriber>,
    /// Set once an `error` was sent: the connection closes at its ack or at this deadline.
    pub closing: Option<u64>,
    /// Live messages held for one batch frame at the end of the upstream burst (batched
    /// connections only); anything else framed for the connection goes out after them.
    held: Vec<(Arc<str>, Carried)>,
    held_bytes: usize,
}

/// The batch payload framed last, kept while the streamer frames one burst for every
/// connection: live subscribers of a burst at one protocol version are sent the same
/// messages (the same shared texts), so they share one serialized payload instead of each
/// copying the burst's texts into a payload of its own.
#[derive(Debug, Default)]
pub struct SharedBatch {
    texts: Vec<Arc<str>>,
    payload: Option<Arc<BatchPayload>>,
}

impl SharedBatch {
    /// The payload of the texts of `messages`: the last one built if it holds the very same
    /// texts.
    fn payload(&mut self, messages: &[(Arc<str>, Carried)]) -> Arc<BatchPayload> {
        if let Some(payload) = &self.payload {
            let same = messages.len() == self.texts.len()
                && messages
                    .iter()
                    .zip(&self.texts)
                    .all(|((a, _), b)| Arc::ptr_eq(a, b));
            if same {
                return payload.clone();
            }
        }
        self.texts.clear();
        self.texts
            .extend(messages.iter().map(|(text, _)| text.clone()));
        let payload = Arc::new(BatchPayload::from_slice(&self.texts));
        self.payload = Some(payload.clone());
        payload
    }

    /// Lets go of the last payload (at the end of a burst).
    pub fn clear(&mut self) {
        self.texts.clear();
        self.payload = None;
    }
}

/// A held burst goes out as soon as it holds this many messages…
pub const HELD_MAX_MESSAGES: usize = 512;
/// …or this many bytes of message text, so a long burst still streams.
pub const HELD_MAX_BYTES: usize = 256 * 1024;

impl Connection {
    pub fn new(version: u32, ws_batched: bool) -> Self {
        Connection {
            version,
            batched: batch_frames_allowed(version, ws_batched),
            frames: AckQueue::new(),
            sent: VecDeque::new(),
            subscriber: None,
            closing: None,
            held: Vec::new(),
            held_bytes: 0,
        }
    }

    /// Live messages of the upstream burst: a batched connection holds them (until
    /// [`Connection::frame`] or a full hold frames them as one batch), any other frames them at
    /// once. Returns the frames to send now.
    pub fn hold(
        &mut self,
        messages: &mut Vec<(Arc<str>, Carried)>,
        shared: &mut SharedBatch,
    ) -> Vec<Outgoing> {
        if !self.batched {
            return self.frame_sharing(messages, shared);
        }
        self.held_bytes += messages.iter().map(|(text, _)| text.len()).sum::<usize>();
        self.held.append(messages);
        if self.held.len() >= HELD_MAX_MESSAGES || self.held_bytes >= HELD_MAX_BYTES {
            return self.frame_sharing(&mut Vec::new(), shared);
        }
        Vec::new()
    }

    /// Whether live messages wait for the end of the burst.
    pub fn holds(&self) -> bool {
        !self.held.is_empty()
    }

    /// Frames `messages`: one batch frame when batches are allowed and there are several,
    /// else one `{"id","msg"}` frame each (sharing the serialized message).
    /// Held messages go first, in the same frame.
    pub fn frame(&mut self, mut messages: Vec<(Arc<str>, Carried)>) -> Vec<Outgoing> {
        self.frame_sharing(&mut messages, &mut SharedBatch::default())
    }

    /// [`Connection::frame`] of what `messages` holds (leaving it empty, its allocation kept
    /// for the caller), reusing `shared`'s payload when it holds the same messages.
    pub fn frame_sharing(
        &mut self,
        messages: &mut Vec<(Arc<str>, Carried)>,
        shared: &mut SharedBatch,
    ) -> Vec<Outgoing> {
        if self.held.is_empty() {
            return self.frame_all(messages, shared);
        }
        self.held_bytes = 0;
        // The held list is framed in place and handed back empty, so a connection held for
        // every burst keeps one allocation for it.
        let mut all = std::mem::take(&mut self.held);
        all.append(messages);
        let frames = self.frame_all(&mut all, shared);
        self.held = all;
        frames
    }

    /// Frames `messages` and empties it.
    fn frame_all(
        &mut self,
        messages: &mut Vec<(Arc<str>, Carried)>,
        shared: &mut SharedBatch,
    ) -> Vec<Outgoing> {
        if self.batched && messages.len() > 1 {
            let payload = shared.payload(messages);
            let mut carried = Carried::default();
            for (_, c) in messages.drain(..) {
                carried.merge(c);
            }
            let id = self.next_id(carried, false);
            return vec![Outgoing::Batch { id, payload }];
        }
        messages
            .drain(..)
            .map(|(message, carried)| Outgoing::Message {
                id: self.next_id(carried, false),
                message,
            })
            .collect()
    }

    /// Frames the `error` message whose ack closes the connection, after any held messages.
    pub fn frame_error(&mut self, message: Arc<str>) -> Vec<Outgoing> {
        let mut frames = self.frame(Vec::new());
        frames.push(Outgoing::Message {
            id: self.next_id(Carried::default(), true),
            message,
        });
        frames
    }

    fn next_id(&mut self, carried: Carried, is_error: bool) -> u64 {
        self.sent.push_back(SentFrame { carried, is_error });
        self.frames.next_id()
    }

    /// Takes an ack, which must be for the oldest outstanding frame.
    pub fn ack(&mut self, id: u64) -> Result<SentFrame, AckError> {
        self.frames.ack(id)?;
        // `frames` and `sent` grow and shrink together.
        Ok(self.sent.pop_front().unwrap_or(SentFrame {
            carried: Carried::default(),
            is_error: false,
        }))
    }

    /// Frames sent but not yet acknowledged.
    pub fn outstanding(&self) -> usize {
        self.frames.outstanding()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::watermark::Watermark;

    fn carried(commit: Option<&str>, backlog: usize) -> Carried {
        Carried {
            backlog_bytes: backlog,
            catchup_bytes: 0,
            live_bytes: 0,
            commit: commit.map(|c| Watermark::parse(c).expect("watermark")),
        }
    }

    #[test]
    fn batches_only_where_allowed() {
        let messages = || {
            vec![
                (Arc::<str>::from("[1]"), carried(None, 3)),
                (Arc::<str>::from("[2]"), carried(Some("0a"), 3)),
            ]
        };
        let mut legacy = Connection::new(6, false);
        let frames = legacy.frame(messages());
        let texts: Vec<String> = frames.iter().map(Outgoing::to_text).collect();
        assert_eq!(texts, [r#"{"id":1,"msg":[1]}"#, r#"{"id":2,"msg":[2]}"#]);
        let mut v7 = Connection::new(7, false);
        let frames = v7.frame(messages());
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].to_text(), r#"{"id":1,"batch":[[1],[2]]}"#);
        // The batch's ack releases both messages' accounting at once.
        let acked = v7.ack(1).expect("in order");
        assert_eq!(acked.carried, carried(Some("0a"), 6));
        // A single message still goes out as a plain frame.
        let single = v7.frame(vec![(Arc::<str>::from("[3]"), Carried::default())]);
        assert_eq!(single[0].to_text(), r#"{"id":2,"msg":[3]}"#);
    }

    #[test]
    fn a_frame_written_into_a_reused_buffer_is_its_text() {
        let mut v8 = Connection::new(8, false);
        let mut frames = v8.frame(vec![
            (Arc::<str>::from("[1]"), Carried::default()),
            (Arc::<str>::from("[2]"), Carried::default()),
        ]);
        frames.extend(v8.frame(vec![(Arc::<str>::from("[3]"), Carried::default())]));
        frames.push(Outgoing::Ack { id: 12 });
        let mut buf = String::from("left over from the frame before");
        let mut written = Vec::new();
        for frame in &frames {
            buf.clear();
            frame.write_text(&mut buf).expect("a String takes any text");
            assert_eq!(buf, frame.to_text());
            written.push(buf.clone());
        }
        assert_eq!(
            written,
            [
                r#"{"id":1,"batch":[[1],[2]]}"#,
                r#"{"id":2,"msg":[3]}"#,
                r#"{"ack":12}"#
            ]
        );
    }

    #[test]
    fn held_messages_go_out_first_as_one_batch() {
        let text = |n: u32| Arc::<str>::from(format!("[{n}]"));
        let mut v8 = Connection::new(8, false);
        assert!(v8
            .hold(
                &mut vec![(text(1), carried(None, 0))],
                &mut SharedBatch::default()
            )
            .is_empty());
        assert!(v8
            .hold(
                &mut vec![(text(2), carried(Some("0a"), 0))],
                &mut SharedBatch::default()
            )
            .is_empty());
        assert!(v8.holds());
        // The next frame of any kind carries the held messages before its own.
        let frames = v8.frame(vec![(text(3), carried(None, 0))]);
        assert!(!v8.holds());
        let texts: Vec<String> = frames.iter().map(Outgoing::to_text).collect();
        assert_eq!(texts, [r#"{"id":1,"batch":[[1],[2],[3]]}"#]);
        assert!(
            v8.frame(Vec::new()).is_empty(),
            "nothing held, nothing sent"
        );
        // An error goes out after what was held.
        v8.hold(
            &mut vec![(text(4), carried(None, 0))],
            &mut SharedBatch::default(),
        );
        let frames = v8.frame_error(text(5));
        let texts: Vec<String> = frames.iter().map(Outgoing::to_text).collect();
        assert_eq!(texts, [r#"{"id":2,"msg":[4]}"#, r#"{"id":3,"msg":[5]}"#]);
        // A connection without batch frames holds nothing.
        let mut v6 = Connection::new(6, false);
        assert_eq!(
            v6.hold(
                &mut vec![(text(1), carried(None, 0))],
                &mut SharedBatch::default()
            )
            .len(),
            1
        );
        assert!(!v6.holds());
    }

    #[test]
    fn connections_holding_the_same_burst_share_one_payload() {
        let burst: Vec<Arc<str>> = (1..=3).map(|n| Arc::from(format!("[{n}]"))).collect();
        let messages = |texts: &[Arc<str>]| -> Vec<(Arc<str>, Carried)> {
            texts
                .iter()
                .map(|t| (t.clone(), Carried::default()))
                .collect()
        };
        let payload = |frames: Vec<Outgoing>| match frames.as_slice() {
            [Outgoing::Batch { payload, .. }] => payload.clone(),
            other => panic!("expected one batch frame, found {other:?}"),
        };
        let mut shared = SharedBatch::default();
        let mut framed = Vec::new();
        // Two connections at different frame ids, then one that was sent only part of the
        // burst, then one sent equal texts that are not the same shared ones.
        let mut late = Connection::new(8, false);
        late.frame(messages(&burst[..1]));
        let copies: Vec<Arc<str>> = burst.iter().map(|t| Arc::from(&**t)).collect();
        for (mut c, texts) in [
            (Connection::new(8, false), &burst[..]),
            (late, &burst[..]),
            (Connection::new(8, false), &burst[1..]),
            (Connection::new(8, false), &copies[..]),
        ] {
            assert!(c.hold(&mut messages(texts), &mut shared).is_empty());
            let frames = c.frame_sharing(&mut Vec::new(), &mut shared);
            let text = frames[0].to_text();
            framed.push((payload(frames), text));
        }
        assert!(
            Arc::ptr_eq(&framed[0].0, &framed[1].0),
            "one payload for both"
        );
        assert_eq!(framed[0].1, r#"{"id":1,"batch":[[1],[2],[3]]}"#);
        assert_eq!(framed[1].1, r#"{"id":2,"batch":[[1],[2],[3]]}"#);
        assert_eq!(framed[2].1, r#"{"id":1,"batch":[[2],[3]]}"#);
        assert!(!Arc::ptr_eq(&framed[1].0, &framed[2].0));
        assert_eq!(framed[3].1, r#"{"id":1,"batch":[[1],[2],[3]]}"#);
        shared.clear();
        assert!(shared.payload.is_none() && shared.texts.is_empty());
    }

    #[test]
    fn a_full_hold_streams_without_waiting_for_the_burst_to_end() {
        let mut v8 = Connection::new(8, false);
        let mut frames = Vec::new();
        for n in 0..HELD_MAX_MESSAGES {
            frames.extend(v8.hold(
                &mut vec![(Arc::<str>::from(format!("[{n}]")), Carried::default())],
                &mut SharedBatch::default(),
            ));
        }
        assert_eq!(frames.len(), 1, "one batch of {HELD_MAX_MESSAGES} messages");
        assert!(!v8.holds());
        let big: Arc<str> = format!("[\"{}\"]", "x".repeat(HELD_MAX_BYTES)).into();
        assert_eq!(
            v8.hold(
                &mut vec![(big, Carried::default())],
                &mut SharedBatch::default()
            )
            .len(),
            1,
            "bytes bound it too"
        );
    }

    #[test]
    fn acks_must_be_in_order() {
        let mut c = Connection::new(6, false);
        c.frame(vec![
            (Arc::<str>::from("[1]"), Carried::default()),
            (Arc::<str>::from("[2]"), Carried::default()),
        ]);
        assert!(matches!(
            c.ack(2),
            Err(AckError::OutOfOrder {
                expected: 1,
                found: 2
            })
        ));
        assert!(c.ack(1).is_ok());
        assert_eq!(c.outstanding(), 1);
        let error = c.frame_error(Arc::from("[3]"));
        assert_eq!(error.len(), 1);
        assert_eq!(error[0].id(), Some(3));
        assert!(!c.ack(2).expect("in order").is_error);
        assert!(c.ack(3).expect("in order").is_error);
    }
}
