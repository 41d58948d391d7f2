//! Engine errors become JS `Error` objects with a stable `code` (and a `path` for decode errors).
//!
//! Every engine error type is mapped here and nowhere else, so the codes stay one list.

use std::fmt;

use highwater_engine::backfill::BackfillError;
use highwater_engine::change_stream::DecodeError;
use highwater_engine::scope_sync::cursor::CursorError;
use highwater_engine::scope_sync::realtime_bridge::BridgeError;
use highwater_engine::scope_sync::scope::ScopeError;
use highwater_engine::scope_sync::{FrameError, SubscribeError};
use highwater_engine::watermark::WatermarkError;
use wasm_bindgen::prelude::*;

/// The stable codes a thrown error carries in its `code` property.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorCode {
    InvalidWatermark,
    InvalidLsn,
    WatermarkBeyondLsn,
    InvalidJson,
    InvalidMessage,
    InvalidValue,
    InvalidArgument,
    InvalidCursor,
    InvalidScope,
    InvalidBackfill,
    InvalidFrame,
    InvalidBridgeInput,
    /// Thrown by the client only.
    #[cfg_attr(not(feature = "client"), allow(dead_code))]
    InvalidMutation,
}

impl ErrorCode {
    /// Every code, in the order the TypeScript union lists them.
    #[cfg(test)]
    const ALL: &'static [ErrorCode] = &[
        ErrorCode::InvalidWatermark,
        ErrorCode::InvalidLsn,
        ErrorCode::WatermarkBeyondLsn,
        ErrorCode::InvalidJson,
        ErrorCode::InvalidMessage,
        ErrorCode::InvalidValue,
        ErrorCode::InvalidArgument,
        ErrorCode::InvalidCursor,
        ErrorCode::InvalidScope,
        ErrorCode::InvalidBackfill,
        ErrorCode::InvalidFrame,
        ErrorCode::InvalidBridgeInput,
        ErrorCode::InvalidMutation,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidWatermark => "HW_INVALID_WATERMARK",
            ErrorCode::InvalidLsn => "HW_INVALID_LSN",
            ErrorCode::WatermarkBeyondLsn => "HW_WATERMARK_BEYOND_LSN",
            ErrorCode::InvalidJson => "HW_INVALID_JSON",
            ErrorCode::InvalidMessage => "HW_INVALID_MESSAGE",
            ErrorCode::InvalidValue => "HW_INVALID_VALUE",
            ErrorCode::InvalidArgument => "HW_INVALID_ARGUMENT",
            ErrorCode::InvalidCursor => "HW_INVALID_CURSOR",
            ErrorCode::InvalidScope => "HW_INVALID_SCOPE",
            ErrorCode::InvalidBackfill => "HW_INVALID_BACKFILL",
            ErrorCode::InvalidFrame => "HW_INVALID_FRAME",
            ErrorCode::InvalidBridgeInput => "HW_INVALID_BRIDGE_INPUT",
            ErrorCode::InvalidMutation => "HW_INVALID_MUTATION",
        }
    }
}

// Kept in step with `ErrorCode` by `typescript_union_lists_every_code` below. The custom
// section below reads it in a way the dead-code lint does not see.
#[allow(dead_code)]
const ERROR_TS: &str = r#"
/** The stable `code` of every error the package throws. */
export type HighwaterErrorCode =
  | "HW_INVALID_WATERMARK"
  | "HW_INVALID_LSN"
  | "HW_WATERMARK_BEYOND_LSN"
  | "HW_INVALID_JSON"
  | "HW_INVALID_MESSAGE"
  | "HW_INVALID_VALUE"
  | "HW_INVALID_ARGUMENT"
  | "HW_INVALID_CURSOR"
  | "HW_INVALID_SCOPE"
  | "HW_INVALID_BACKFILL"
  | "HW_INVALID_FRAME"
  | "HW_INVALID_BRIDGE_INPUT"
  | "HW_INVALID_MUTATION";

/** What the package throws: a plain `Error` with a stable `code`; decode errors also carry `path`. */
export interface HighwaterError extends Error {
  name: "HighwaterError";
  code: HighwaterErrorCode;
  /** Where in the input the problem is, e.g. `$[1].new.id` (decode errors only; `$` is the whole input). */
  path?: string;
}
"#;

#[wasm_bindgen(typescript_custom_section)]
const ERROR_TS_SECTION: &str = ERROR_TS;

/// An error on its way to JS: becomes an `Error` named `HighwaterError` with `code` and `path`.
/// `pub` only because exported methods return it; the module itself is private.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub(crate) code: ErrorCode,
    pub(crate) message: String,
    pub(crate) path: Option<String>,
}

impl Failure {
    pub(crate) fn new(code: ErrorCode, message: impl fmt::Display) -> Self {
        Failure {
            code,
            message: message.to_string(),
            path: None,
        }
    }

    pub(crate) fn at(mut self, path: impl Into<String>) -> Self {
        self.path = Some(path.into());
        self
    }
}

impl From<Failure> for JsValue {
    fn from(failure: Failure) -> JsValue {
        let error = js_sys::Error::new(&failure.message);
        error.set_name("HighwaterError");
        // Setting a data property on a fresh Error object cannot fail.
        let _ = js_sys::Reflect::set(&error, &"code".into(), &failure.code.as_str().into());
        if let Some(path) = &failure.path {
            let _ = js_sys::Reflect::set(&error, &"path".into(), &path.into());
        }
        error.into()
    }
}

impl From<WatermarkError> for Failure {
    fn from(error: WatermarkError) -> Self {
        let code = match error {
            WatermarkError::BadLsn { .. } => ErrorCode::InvalidLsn,
            WatermarkError::MajorTooLarge { .. } => ErrorCode::WatermarkBeyondLsn,
            WatermarkError::Empty
            | WatermarkError::BadDigit { .. }
            | WatermarkError::LengthMismatch { .. }
            | WatermarkError::LeadingZero { .. }
            | WatermarkError::BadStateVersion { .. } => ErrorCode::InvalidWatermark,
        };
        Failure::new(code, error)
    }
}

impl From<DecodeError> for Failure {
    fn from(error: DecodeError) -> Self {
        let code = match error {
            DecodeError::Syntax { .. } => ErrorCode::InvalidJson,
            _ => ErrorCode::InvalidMessage,
        };
        let path = error.path().to_owned();
        Failure::new(code, error).at(path)
    }
}

impl From<CursorError> for Failure {
    fn from(error: CursorError) -> Self {
        let code = match error {
            CursorError::BadPrefix { .. } | CursorError::BadForm { .. } => {
                ErrorCode::InvalidArgument
            }
            CursorError::BadSequence { .. }
            | CursorError::SequenceOutOfRange { .. }
            | CursorError::BadId { .. }
            | CursorError::NotACursor { .. } => ErrorCode::InvalidCursor,
        };
        Failure::new(code, error)
    }
}

impl From<ScopeError> for Failure {
    fn from(error: ScopeError) -> Self {
        Failure::new(ErrorCode::InvalidScope, error)
    }
}

impl From<BackfillError> for Failure {
    fn from(error: BackfillError) -> Self {
        Failure::new(ErrorCode::InvalidBackfill, error)
    }
}

impl From<SubscribeError> for Failure {
    fn from(error: SubscribeError) -> Self {
        let code = match error {
            SubscribeError::Scope(_) => ErrorCode::InvalidScope,
            SubscribeError::BadAfterSequence { .. }
            | SubscribeError::BadAfterUpdatedAt { .. }
            | SubscribeError::BadAfterId { .. } => ErrorCode::InvalidCursor,
            SubscribeError::BadLimit { .. } | SubscribeError::BadAuthenticationToken { .. } => {
                ErrorCode::InvalidArgument
            }
        };
        Failure::new(code, error)
    }
}

impl From<FrameError> for Failure {
    fn from(error: FrameError) -> Self {
        Failure::new(ErrorCode::InvalidFrame, error)
    }
}

impl From<BridgeError> for Failure {
    fn from(error: BridgeError) -> Self {
        Failure::new(ErrorCode::InvalidBridgeInput, error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typescript_union_lists_every_code() {
        let listed: Vec<&str> = ERROR_TS
            .split('"')
            .filter(|s| s.starts_with("HW_"))
            .collect();
        let codes: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(listed, codes);
    }

    #[test]
    fn codes_are_distinct() {
        let mut codes: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), ErrorCode::ALL.len());
    }

    #[test]
    fn watermark_errors_map_by_kind() {
        let code = |e: WatermarkError| Failure::from(e).code;
        assert_eq!(
            code(WatermarkError::BadLsn { text: "x".into() }),
            ErrorCode::InvalidLsn
        );
        assert_eq!(
            code(WatermarkError::MajorTooLarge { text: "x".into() }),
            ErrorCode::WatermarkBeyondLsn
        );
        assert_eq!(code(WatermarkError::Empty), ErrorCode::InvalidWatermark);
        let failure = Failure::from(WatermarkError::BadStateVersion { text: "0a-".into() });
        assert!(failure.message.contains("0a-"), "{}", failure.message);
        assert_eq!(failure.path, None);
    }

    #[test]
    fn decode_errors_keep_their_path() {
        let failure = Failure::from(DecodeError::Missing {
            path: "$[1].new".into(),
            expected: "an object".into(),
        });
        assert_eq!(failure.code, ErrorCode::InvalidMessage);
        assert_eq!(failure.path.as_deref(), Some("$[1].new"));
        let syntax = Failure::from(DecodeError::Syntax {
            message: "EOF".into(),
        });
        assert_eq!(syntax.code, ErrorCode::InvalidJson);
        assert_eq!(syntax.path.as_deref(), Some("$"));
    }
}
