//! Scope sync: the velocious-compatible channel over which clients subscribe to the rows of a
//! scope, replay them from a cursor, follow them live and write back.
//!
//! The folder holds the whole protocol, from the bytes on the wire to both ends:
//! - [`wire`]: frames, envelopes, conditions, mutations and subscribe params (strict decoding,
//!   typed errors); re-exported here.
//! - [`cursor`] and [`scope`]: cursors and their order, scopes and their digests.
//! - [`rules`]: the rules file (who may read and write which rows), row filters and their
//!   subqueries.
//! - [`feed`]: the scope feed's rules, which the replica keeping the feed applies: exits, a
//!   commit's entries, the exits a replay page carries.
//! - [`server`]: the scope server, a state machine that answers subscriptions (replay, then
//!   live), routes committed changes, moves rows as access changes and admits writes;
//!   [`replay`] plans its pages.
//! - [`client`]: `HighwaterClient`'s core (subscriptions, the local store, the outbox), and
//!   [`realtime_bridge`], the low-level per-scope cursor advancement under it.
//!
//! [`coercion`](self) holds the value forms every part compares in (JavaScript's string form,
//! number text); nothing here imports from outside the folder but the engine's shared parts.

pub(crate) mod coercion;

pub mod client;
pub mod cursor;
pub mod feed;
pub mod realtime_bridge;
pub mod replay;
pub mod rules;
pub mod scope;
pub mod server;
pub mod wire;

pub use coercion::js_string_form;
pub use wire::*;
