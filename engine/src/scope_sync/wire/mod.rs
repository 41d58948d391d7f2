//! The wire forms of the scope-sync channel: frames, envelopes, conditions, mutations and
//! subscribe params of the velocious-compatible WebSocket protocol.
//!
//! Decoding is strict: a frame, body or param of the wrong shape is a typed error naming the
//! field, what was expected and what arrived. Unknown keys are ignored in frames and kept in
//! bodies and params, so relays lose nothing.

mod conditions;
mod envelope;
mod frame;
mod mutation;
mod row;
mod subscribe;

pub use conditions::{
    compare, operand_bool, operand_number, operand_text, ConditionError, Conditions, Test,
    MAX_LIST_VALUES, OPERATORS,
};
pub use envelope::{
    EnvelopeError, EnvelopeWithRows, KeptBody, SyncEntry, SyncEnvelope, CURSOR_KEY, MOVES_KEY,
};
pub use frame::{ClientFrame, FrameError, ServerFrame, SYNC_CHANNEL_TYPE};
pub use mutation::{
    parse_confirm_message, rejection, valid_client_id, BatchResults, Echo, InvalidMutation,
    Mutation, MutationIdError, MutationOp, MutationResult, MutationStatus, CONFIRM_MESSAGE_PREFIX,
    MAX_CLIENT_ID_BYTES, MAX_MUTATIONS_PER_FRAME, MAX_ROW_COLUMNS,
};
pub use row::RowText;
pub use subscribe::{
    page_limit, request_sequence, SubscribeError, SubscribeParams, DEFAULT_PAGE_LIMIT,
    MAX_PAGE_LIMIT,
};
