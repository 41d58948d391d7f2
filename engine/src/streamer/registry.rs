//! Downstream connections: frame ids, outstanding frames and what their acks release (§2.1).

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
}

impl Connection {
    pub fn new(version: u32, ws_batched: bool) -> Self {
        Connection {
            version,
            batched: batch_frames_allowed(version, ws_batched),
            frames: AckQueue::new(),
            sent: VecDeque::new(),
            subscriber: None,
            closing: None,
        }
    }

    /// Frames `messages`: one batch frame when batches are allowed and there are several,
    /// else one `{"id","msg"}` frame each (sharing the serialized message).
    pub fn frame(&mut self, messages: Vec<(Arc<str>, Carried)>) -> Vec<Outgoing> {
        if self.batched && messages.len() > 1 {
            let mut carried = Carried::default();
            let mut texts = Vec::with_capacity(messages.len());
            for (text, c) in messages {
                carried.merge(c);
                texts.push(text);
            }
            let payload = Arc::new(BatchPayload::from_encoded(texts));
            let id = self.next_id(carried, false);
            return vec![Outgoing::Batch { id, payload }];
        }
        messages
            .into_iter()
            .map(|(message, carried)| Outgoing::Message {
                id: self.next_id(carried, false),
                message,
            })
            .collect()
    }

    /// Frames the `error` message whose ack closes the connection.
    pub fn frame_error(&mut self, message: Arc<str>) -> Outgoing {
        Outgoing::Message {
            id: self.next_id(Carried::default(), true),
            message,
        }
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
        assert_eq!(error.id(), Some(3));
        assert!(!c.ack(2).expect("in order").is_error);
        assert!(c.ack(3).expect("in order").is_error);
    }
}
