//! Deterministic end-to-end simulation of Highwater: a simulated Postgres sends pgoutput
//! frames into the engine's change streamer; simulated storage keeps the change log and the
//! replica and can crash at any point; change-stream subscribers and scope-sync clients talk to
//! the streamer and the scope server over a simulated network that delays, drops and half-opens
//! connections. One seed drives every choice, invariants are checked after every step, and a
//! failing seed replays exactly (`scripts/simulate --seed S --trace`).

pub mod access;
pub mod ingest;
pub mod rng;
pub mod storage;
pub mod upstream;
pub mod world;

pub use world::{describe, run, AccessBug, BackfillBug, Options, Outcome};
