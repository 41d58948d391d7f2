//! WebAssembly bindings of the Highwater engine: the npm package `highwater`.
//!
//! This crate only converts types and maps errors; every rule lives in `highwater-engine`.
//! One module per exported concept; `error` maps engine errors to coded JS errors and `json`
//! converts JSON values exactly (big integers become `BigInt`). The `client` and `tools`
//! features select what one build exports (the package's two modules).

#[cfg(feature = "tools")]
mod backfill;
#[cfg(feature = "tools")]
mod bridge;
#[cfg(feature = "tools")]
mod change_stream;
#[cfg(feature = "client")]
mod client;
mod cursor;
mod error;
mod json;
mod scope;
mod watermark;
