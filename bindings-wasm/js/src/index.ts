// The API shared by the Node and browser entry points: the engine's exports plus JS conveniences.
import type { HighwaterError, HighwaterErrorCode } from "./wasm/api.js";

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
  SyncClientCore,
  scopeMatches,
  watermarkToLsn,
} from "./wasm/api.js";
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
} from "./wasm/api.js";

export { HighwaterClient, Subscription } from "./client.js";
export type {
  ClientEvents,
  ClientStatus,
  HighwaterClientOptions,
  ProgressEvent,
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
export type { ScopeStore } from "./stores.js";
export type {
  ClientEvent,
  ConnectionState,
  ConnectionStatus,
  PersistWrite,
  ChangedRowData,
  CoreRowChange,
  CoreUpsert,
  CoreWrite,
  StoredRow,
  StoredScopeData,
} from "./wasm/api.js";

/** True for errors thrown by this package; narrow further with `code`. */
export function isHighwaterError(error: unknown, code?: HighwaterErrorCode): error is HighwaterError {
  return (
    error instanceof Error &&
    error.name === "HighwaterError" &&
    typeof (error as Partial<HighwaterError>).code === "string" &&
    (code === undefined || (error as HighwaterError).code === code)
  );
}
