//! Encodes pgoutput messages and replication frames, so tests can build byte buffers from values.
//!
//! Built for the engine's own tests and, behind the `testkit` cargo feature, for the
//! deterministic simulation (`highwater-sim`), which plays a simulated Postgres. Not part of
//! the engine's normal build.

use super::frame::{PgTimestamp, PrimaryKeepalive, XLogData};
use super::message::*;

/// One pgoutput message's bytes (the XLogData payload).
pub fn encode(message: &PgoutputMessage<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    match message {
        PgoutputMessage::Begin(b) => {
            out.push(b'B');
            out.extend_from_slice(&b.final_lsn.0.to_be_bytes());
            out.extend_from_slice(&b.commit_time.0.to_be_bytes());
            out.extend_from_slice(&b.xid.to_be_bytes());
        }
        PgoutputMessage::Commit(c) => {
            out.push(b'C');
            out.push(c.flags);
            out.extend_from_slice(&c.commit_lsn.0.to_be_bytes());
            out.extend_from_slice(&c.end_lsn.0.to_be_bytes());
            out.extend_from_slice(&c.commit_time.0.to_be_bytes());
        }
        PgoutputMessage::Origin(o) => {
            out.push(b'O');
            out.extend_from_slice(&o.commit_lsn.0.to_be_bytes());
            cstr(&mut out, o.name);
        }
        PgoutputMessage::Relation(r) => {
            out.push(b'R');
            out.extend_from_slice(&r.oid.to_be_bytes());
            cstr(&mut out, &r.namespace);
            cstr(&mut out, &r.name);
            out.push(r.replica_identity.as_byte());
            out.extend_from_slice(&(r.columns.len() as u16).to_be_bytes());
            for c in &r.columns {
                out.push(c.flags);
                cstr(&mut out, &c.name);
                out.extend_from_slice(&c.type_oid.to_be_bytes());
                out.extend_from_slice(&c.type_modifier.to_be_bytes());
            }
        }
        PgoutputMessage::Type(t) => {
            out.push(b'Y');
            out.extend_from_slice(&t.oid.to_be_bytes());
            cstr(&mut out, &t.namespace);
            cstr(&mut out, &t.name);
        }
        PgoutputMessage::Insert(i) => {
            out.push(b'I');
            out.extend_from_slice(&i.relation_oid.to_be_bytes());
            out.push(b'N');
            tuple(&mut out, &i.new);
        }
        PgoutputMessage::Update(u) => {
            out.push(b'U');
            out.extend_from_slice(&u.relation_oid.to_be_bytes());
            if let Some(old) = &u.old {
                old_tuple(&mut out, old);
            }
            out.push(b'N');
            tuple(&mut out, &u.new);
        }
        PgoutputMessage::Delete(d) => {
            out.push(b'D');
            out.extend_from_slice(&d.relation_oid.to_be_bytes());
            old_tuple(&mut out, &d.old);
        }
        PgoutputMessage::Truncate(t) => {
            out.push(b'T');
            out.extend_from_slice(&(t.relation_oids.len() as u32).to_be_bytes());
            out.push(t.options);
            for oid in &t.relation_oids {
                out.extend_from_slice(&oid.to_be_bytes());
            }
        }
        PgoutputMessage::Message(m) => {
            out.push(b'M');
            out.push(u8::from(m.transactional));
            out.extend_from_slice(&m.lsn.0.to_be_bytes());
            cstr(&mut out, m.prefix);
            out.extend_from_slice(&(m.content.len() as i32).to_be_bytes());
            out.extend_from_slice(m.content);
        }
    }
    out
}

/// Wraps a pgoutput message in an XLogData frame.
pub fn xlog_frame(header: &XLogData<'_>, message: &PgoutputMessage<'_>) -> Vec<u8> {
    let mut out = vec![b'w'];
    out.extend_from_slice(&header.wal_start.0.to_be_bytes());
    out.extend_from_slice(&header.wal_end.0.to_be_bytes());
    out.extend_from_slice(&header.send_time.0.to_be_bytes());
    out.extend_from_slice(&encode(message));
    out
}

/// An XLogData frame with zero header fields.
pub fn xlog(message: &PgoutputMessage<'_>) -> Vec<u8> {
    let header = XLogData {
        wal_start: Default::default(),
        wal_end: Default::default(),
        send_time: PgTimestamp(0),
        payload: &[],
    };
    xlog_frame(&header, message)
}

/// A primary keepalive frame.
pub fn keepalive_frame(k: &PrimaryKeepalive) -> Vec<u8> {
    let mut out = vec![b'k'];
    out.extend_from_slice(&k.wal_end.0.to_be_bytes());
    out.extend_from_slice(&k.send_time.0.to_be_bytes());
    out.push(u8::from(k.reply_requested));
    out
}

fn cstr(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(s.as_bytes());
    out.push(0);
}

fn old_tuple(out: &mut Vec<u8>, old: &OldTuple<'_>) {
    match old {
        OldTuple::Key(t) => {
            out.push(b'K');
            tuple(out, t);
        }
        OldTuple::Full(t) => {
            out.push(b'O');
            tuple(out, t);
        }
    }
}

fn tuple(out: &mut Vec<u8>, t: &Tuple<'_>) {
    out.extend_from_slice(&(t.0.len() as u16).to_be_bytes());
    for value in &t.0 {
        match value {
            TupleValue::Null => out.push(b'n'),
            TupleValue::UnchangedToast => out.push(b'u'),
            TupleValue::Text(bytes) => {
                out.push(b't');
                out.extend_from_slice(&(bytes.len() as i32).to_be_bytes());
                out.extend_from_slice(bytes);
            }
            TupleValue::Binary(bytes) => {
                out.push(b'b');
                out.extend_from_slice(&(bytes.len() as i32).to_be_bytes());
                out.extend_from_slice(bytes);
            }
        }
    }
}
