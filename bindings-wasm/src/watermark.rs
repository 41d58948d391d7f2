//! Watermarks: compare LexiVersion watermarks and convert to and from Postgres LSNs.

use std::cmp::Ordering;

use highwater_engine::watermark::{compare_watermarks as compare, Lsn, Watermark};
use wasm_bindgen::prelude::*;

use crate::error::Failure;

/// Compares two watermarks: -1, 0 or 1. Throws `HW_INVALID_WATERMARK` if either is not one.
#[wasm_bindgen(js_name = compareWatermarks)]
pub fn compare_watermarks(a: &str, b: &str) -> Result<i32, Failure> {
    Ok(match compare(a, b)? {
        Ordering::Less => -1,
        Ordering::Equal => 0,
        Ordering::Greater => 1,
    })
}

/// The watermark of a Postgres LSN `H/L` (hex), e.g. `"16/B374D848"` → `"718sh0nk8"`.
/// Throws `HW_INVALID_LSN`.
#[wasm_bindgen(js_name = lsnToWatermark)]
pub fn lsn_to_watermark(lsn: &str) -> Result<String, Failure> {
    Ok(lsn.parse::<Lsn>()?.to_watermark().into_string())
}

/// The LSN (`H/L`, uppercase hex) of a watermark's major part. Throws `HW_INVALID_WATERMARK`,
/// or `HW_WATERMARK_BEYOND_LSN` when the major part exceeds 64 bits.
#[wasm_bindgen(js_name = watermarkToLsn)]
pub fn watermark_to_lsn(watermark: &str) -> Result<String, Failure> {
    Ok(Watermark::parse(watermark)?.to_lsn()?.to_string())
}
