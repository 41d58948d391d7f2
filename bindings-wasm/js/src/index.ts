// The API shared by the Node and browser entry points: the client, cursors, scopes and
// watermarks. The protocol tools (change-stream messages, backfills, the velocious bridge) are
// `highwater/tools`, a module of their own.

export {
  compareCursors,
  compareWatermarks,
  cursorFromPayload,
  cursorToParams,
  isCursorAfter,
  lsnToWatermark,
  scopeDigest,
  SyncClientCore,
  scopeMatches,
  watermarkToLsn,
} from "./wasm/api.js";
export type {
  CursorParamPrefix,
  CursorParamsFormName,
  HighwaterError,
  HighwaterErrorCode,
  JsonValue,
  ScopeCondition,
  ScopeScalar,
  SyncCursor,
} from "./wasm/api.js";

export { HighwaterClient, Mutation, Subscription } from "./client.js";
export type {
  ClientEvents,
  ClientStatus,
  HighwaterClientOptions,
  MutateOptions,
  MutationError,
  MutationOp,
  ProgressEvent,
  RejectedEvent,
  Row,
  RowChangeEvent,
  ScopeError,
  ScopeParams,
  SubscriptionEvents,
  SyncProblem,
  TabRole,
  TokenSource,
} from "./client.js";
export { IndexedDbStore, MemoryStore } from "./stores.js";
export type { ScopeStore, StoredOutbox } from "./stores.js";
export type {
  ClientEvent,
  ConnectionState,
  ConnectionStatus,
  PersistWrite,
  CoreRowChange,
  CoreShadowedRow,
  CoreWrite,
  MutationOutcome,
  MutationRecord,
  OutboxWrite,
  StoredRow,
  StoredScopeData,
} from "./wasm/api.js";

export { isHighwaterError } from "./errors.js";
