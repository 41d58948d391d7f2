// `highwater/tools`, shared by its Node and browser entry points: the protocol tools of the
// engine, in a WebAssembly module of their own (a page that only syncs scopes loads none of
// this): change-stream messages and frames, backfill tracking, the velocious scope bridge, and
// the cursor and watermark helpers they work with.
export {
  BackfillTracker,
  compareCursors,
  compareWatermarks,
  cursorFromPayload,
  cursorToParams,
  encodeChangeStreamFrame,
  encodeChangeStreamMessage,
  isCursorAfter,
  lsnToWatermark,
  parseChangeStreamFrame,
  parseChangeStreamMessage,
  ScopeBridge,
  scopeDigest,
  scopeMatches,
  watermarkToLsn,
} from "./wasm/tools_api.js";
export type {
  BackfillRequest,
  BridgeEffect,
  BridgeState,
  BridgeStatus,
  ChangeStreamFrame,
  ChangeStreamMessage,
  ChannelStatus,
  CursorParamPrefix,
  CursorParamsFormName,
  DropReason,
  HighwaterError,
  HighwaterErrorCode,
  JsonValue,
  MessageRejection,
  RemoteChange,
  ScopeBridgeConfig,
  ScopeChannel,
  ScopeCondition,
  ScopeScalar,
  SubscribedScope,
  SyncCursor,
  SyncScope,
} from "./wasm/tools_api.js";
export { isHighwaterError } from "./errors.js";
