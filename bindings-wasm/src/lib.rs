//! WebAssembly bindings of the Highwater engine: the npm package `highwater`.
//!
//! This crate only converts types and maps errors; every rule lives in `highwater-engine`.
//! One module per exported concept; `error` maps engine errors to coded JS errors and `json`
//! converts JSON values exactly (big integers become `BigInt`).

mod backfill;
mod bridge;
mod change_stream;
mod client;
mod cursor;
mod error;
mod json;
mod scope;
mod watermark;
