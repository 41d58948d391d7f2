// HighwaterClient: live rows of scopes over one socket. The rules (reconnect, heartbeat,
// tokens, resume, cursors) run in the WebAssembly core; this file keeps handles, events and
// store writes.
//
// A fresh process applies its first replay while V8 still compiles the wasm module's hot
// code (Liftoff, then TurboFan), so it replays slower than a warm one (BENCHMARKS.md,
// section "Browser/Node client: package size and replay into `HighwaterClient`"). The
// wake on a page shown again (`#listen`) is tested in the engine and, with a stand-in
// `document`, in the package's Node tests, not yet in a real browser.
import { SyncClientCore, scopeDigest } from "./wasm/api.js";
import type {
  ClientEvent,
  ConnectionStatus,
  CoreRowChange,
  CoreWrite,
  JsonValue,
  MutationOutcome,
  MutationRecord,
  OutboxWrite,
  PersistWrite,
  ScopeCondition,
  SyncCursor,
} from "./wasm/api.js";
import { MemoryStore, type ScopeStore } from "./stores.js";
import { Tabs, type TabMessage } from "./tabs.js";

/** A row: the replicated columns. */
export type Row = Record<string, JsonValue>;

/** One applied server transaction (or a restore from the store, or a reset). */
export interface RowChangeEvent<R = Row> {
  inserted: R[];
  updated: R[];
  removed: R[];
}

export interface ProgressEvent {
  done: number;
  total: number;
}

/** Why a scope or the client reported a problem; `code` is the server's stable code. */
export interface SyncProblem {
  code: string;
  message: string;
}

export type TokenSource = string | null | (() => string | null | undefined | Promise<string | null | undefined>);

export interface HighwaterClientOptions {
  /** The server's sync endpoint, e.g. `ws://localhost:4848/sync`. */
  url: string;
  /** A token, or a function called on every connect (and when a token expired). */
  token?: TokenSource;
  /** Where rows and cursors are kept; default a new `MemoryStore`. */
  store?: ScopeStore;
  /**
   * Share one socket among the tabs of this origin: `true` (named after the store: an
   * `IndexedDbStore`'s name) or a name. The tabs elect a leader with the Web Locks API; it
   * holds the socket and writes the store, the others subscribe through it (BroadcastChannel)
   * and see the same rows, events and status. When the leader's tab closes another takes over
   * and resumes from the stored cursors. Where Web Locks or BroadcastChannel are missing each
   * tab keeps its own socket, and `status.tabs` says `"unshared"`.
   */
  shareTabs?: boolean | string;
  /**
   * Apply writes in the app's own backend instead of through the server: called with batches
   * of pending mutations, in order, while the socket is open. Apply each in a transaction that
   * also runs `SELECT highwater.confirm(clientId, id)` (the client's id is
   * `client.clientId`); the mutation is confirmed once its change comes back. Resolve with
   * `{ rejected: [{ id, code, message }] }` for mutations refused for good; throw to try the
   * batch again later.
   */
  upload?: (mutations: MutationRecord[], clientId: string) => Promise<void | { rejected?: { id: number; code: string; message: string }[] }>;
  /** Key columns of tables whose key is not `id` (to lay mutations over their rows). */
  keys?: Record<string, string[]>;
}

/** What a mutation does: `insert` a row, `update` (the key columns and the changed ones) or
 * `delete` (the key columns). */
export type MutationOp = "insert" | "update" | "delete";

export interface MutateOptions {
  /** Compare-and-set: the row's `serverSequence` this client saw (`subscription.version(id)`).
   * A row changed since is not overwritten: the mutation is rejected with `conflict`. */
  ifVersion?: number;
}

/** Thrown by `Mutation.confirmed` when the server refused the mutation. */
export interface MutationError extends Error {
  name: "HighwaterMutationError";
  /** `forbidden`, `invalid`, `constraint` or `conflict`. */
  code: string;
  /** For `conflict`: the row as it is now (`null` if gone). */
  row?: Record<string, JsonValue> | null;
}

/** A refused mutation, as the client's `rejected` event reports it. */
export interface RejectedEvent {
  mutation: MutationRecord;
  code: string;
  message: string;
  row?: Record<string, JsonValue> | null;
}

/**
 * A queued write. It shows in the rows at once; `confirmed` resolves once the server applied it
 * and its change is in the rows (read-your-writes), or rejects with a `HighwaterMutationError`.
 */
export class Mutation {
  /** The client's number for it; 0 until numbered (while the store loads, or in a tab that does
   * not hold the socket, until the one that does has queued it). */
  id = 0;
  readonly table: string;
  readonly op: MutationOp;
  readonly row: Record<string, JsonValue>;
  readonly confirmed: Promise<void>;
  /**
   * Resolves once the mutation is in the client's store (IndexedDB in browsers), so it
   * survives a reload or a crash of the page; rejects if the store failed. Writes made together
   * are stored in one transaction, within milliseconds. (With `shareTabs`, in a tab that does
   * not hold the socket: once the tab that does has queued it; its store write follows.)
   */
  readonly stored: Promise<void>;
  /** @internal */
  storedResolve!: () => void;
  /** @internal */
  storedReject!: (error: unknown) => void;
  /** @internal */
  resolve!: () => void;
  /** @internal */
  reject!: (error: Error) => void;

  /** @internal */
  constructor(table: string, op: MutationOp, row: Record<string, JsonValue>) {
    this.table = table;
    this.op = op;
    this.row = row;
    this.confirmed = new Promise<void>((resolve, reject) => {
      this.resolve = resolve;
      this.reject = reject;
    });
    this.stored = new Promise<void>((resolve, reject) => {
      this.storedResolve = resolve;
      this.storedReject = reject;
    });
    this.stored.catch(() => undefined);
    // An unobserved rejection is still reported through the client's "rejected" event.
    this.confirmed.catch(() => undefined);
  }
}

/** This tab's part when tabs share a socket (`shareTabs`). */
export type TabRole = "leader" | "follower" | "unshared";

/** The connection's status; `tabs` only when `shareTabs` was asked for. */
export interface ClientStatus extends ConnectionStatus {
  tabs?: TabRole;
}

export interface ScopeParams {
  resourceType: string;
  /**
   * Conditions on the rules' filter columns, all of which must hold: a value is equality
   * (`{ owner: "ada" }`), an array is "any of" (`{ status: ["open", "doing"] }`), an object
   * holds operators (`{ priority: { gte: 3, lt: 10 }, due: { isNull: true } }`).
   */
  conditions?: Record<string, ScopeCondition>;
}

/** Thrown by `ready` when the server refused the scope. */
export interface ScopeError extends Error {
  name: "HighwaterScopeError";
  code: string;
}

type Listener<T> = (value: T) => void;

const EMPTY: readonly Row[] = Object.freeze([]);

class Emitter<Events> {
  #listeners = new Map<keyof Events, Set<Listener<never>>>();

  on<K extends keyof Events>(event: K, listener: Listener<Events[K]>): () => void {
    let set = this.#listeners.get(event);
    if (set === undefined) this.#listeners.set(event, (set = new Set()));
    set.add(listener as Listener<never>);
    return () => this.off(event, listener);
  }

  off<K extends keyof Events>(event: K, listener: Listener<Events[K]>): void {
    this.#listeners.get(event)?.delete(listener as Listener<never>);
  }

  protected emit<K extends keyof Events>(event: K, value: Events[K]): void {
    for (const listener of [...(this.#listeners.get(event) ?? [])]) {
      try {
        (listener as Listener<Events[K]>)(value);
      } catch (error) {
        // A failing listener must not stop the others or the client.
        queueMicrotask(() => {
          throw error;
        });
      }
    }
  }
}

export interface SubscriptionEvents<R = Row> {
  change: RowChangeEvent<R>;
  progress: ProgressEvent;
  reset: void;
  ready: { replayed: number };
  error: SyncProblem;
}

/**
 * A live scope. `ready` resolves once the scope is caught up. `R` is the row type the app
 * declares (`client.subscribe<Todo>(…)`, e.g. from `highwater typegen`); the client does not
 * check rows against it.
 */
export class Subscription<R = Row> extends Emitter<SubscriptionEvents<R>> {
  /** The rows, kept as an array with their `resourceId`s beside them and each id's place, so
   * a change costs what it changes and `rows()` is one array copy. A row object is replaced
   * when the row changes and kept as it is otherwise, so an unchanged row is the same object
   * across changes (memoized views of it need not render again). */
  #rows: Row[] = [];
  #ids: string[] = [];
  #place = new Map<string, number>();
  /** `rows()` as last handed out; dropped by each change. */
  #list: readonly Row[] | null = null;
  readonly params: ScopeParams;
  /** Caught up: the catch-up replay was applied (`channel-subscribed`). Rejects with a
   * `HighwaterScopeError` (its `code`, e.g. `forbidden`) if the server refuses the scope. */
  readonly ready: Promise<void>;
  /** The last problem the scope reported. */
  error: SyncProblem | null = null;
  #client: HighwaterClient;
  #key: number;
  #resolve!: () => void;
  #reject!: (error: Error) => void;
  #settled = false;
  #closed = false;

  /** @internal */
  constructor(client: HighwaterClient, key: number, params: ScopeParams) {
    super();
    this.#client = client;
    this.#key = key;
    this.params = params;
    this.ready = new Promise<void>((resolve, reject) => {
      this.#resolve = resolve;
      this.#reject = reject;
    });
    // Nobody has to await `ready`: an unobserved refusal is still reported through "error".
    this.ready.catch(() => undefined);
  }

  /**
   * The scope's current rows, in no particular order (sort them as you show them). The same
   * array until the rows change, and an unchanged row is the same object across changes: cheap
   * to call on every change, and fit for `useSyncExternalStore`. Do not modify it: it is
   * shared with every caller until the next change.
   */
  rows(): readonly R[] {
    if (this.#closed || this.#client.closed) return EMPTY as readonly unknown[] as readonly R[];
    return (this.#list ??= this.#rows.slice()) as readonly unknown[] as readonly R[];
  }

  /** The persisted cursor: `{id, serverSequence, updatedAt}`, or `null` before the first sync. */
  get cursor(): SyncCursor | null {
    return this.#closed || this.#client.closed ? null : this.#client.cursorOf(this.#key);
  }

  /**
   * Rows applied by the last finished catch-up replay (after a connect or reconnect). While a
   * reconnect's catch-up runs, its rows already show in `rows()` but this is still the previous
   * catch-up's count; each "ready" event carries the new one.
   */
  get replayedOnLastResume(): number {
    return this.#closed || this.#client.closed ? 0 : this.#client.replayedOf(this.#key);
  }

  /**
   * The `serverSequence` of the server's row `resourceId` (for `mutate`'s `ifVersion`), or
   * `null` if the scope does not hold it (or, with `shareTabs`, in a tab that does not hold the
   * socket).
   */
  version(resourceId: string): number | null {
    return this.#closed || this.#client.closed ? null : this.#client.versionOf(this.#key, resourceId);
  }

  /** @internal The stored form of a write from the core: its upserts take the rows held, but
   * for rows shown with a pending mutation laid over them, whose server row comes with it. */
  storedWrite(write: CoreWrite): PersistWrite {
    const ids = write.upserts;
    const sequences = write.serverSequences;
    const rows = this.#rows;
    const place = this.#place;
    let server: (Row | undefined)[] | undefined;
    if (write.shadowed.length > 0) {
      server = [];
      for (const { at, data } of write.shadowed) server[at] = data as Row;
    }
    const upserts = [];
    for (let i = 0; i < ids.length; i++) {
      const id = ids[i];
      let data = server?.[i];
      if (data === undefined) {
        const at = place.get(id);
        data = at === undefined ? undefined : rows[at];
      }
      // Every upsert is a row the same apply reported just before (a change, or a restore).
      if (data !== undefined) upserts.push({ id, serverSequence: sequences[i], data });
    }
    return { forgetCursor: write.forgetCursor, upserts, deletes: write.deletes, cursor: write.cursor };
  }

  /** Takes the core's change into the rows held; returns the public event. */
  #apply(change: CoreRowChange): RowChangeEvent {
    const rows = this.#rows;
    const ids = this.#ids;
    const place = this.#place;
    const removed: Row[] = [];
    for (const id of change.removed) {
      const at = place.get(id);
      if (at === undefined) continue;
      removed.push(rows[at]);
      // The last row takes the removed one's place.
      const last = rows.length - 1;
      rows[at] = rows[last];
      ids[at] = ids[last];
      place.set(ids[at], at);
      rows.pop();
      ids.pop();
      place.delete(id);
    }
    // The core's arrays of rows are the public event's: each row is its columns' object.
    const inserted = change.inserted as Row[];
    const updated = change.updated as Row[];
    this.#put(change.insertedIds, inserted);
    this.#put(change.updatedIds, updated);
    this.#list = null;
    return { inserted, updated, removed };
  }

  /** Each row takes its id's place, or a new one at the end. */
  #put(keys: string[], values: Row[]): void {
    const rows = this.#rows;
    const ids = this.#ids;
    const place = this.#place;
    for (let i = 0; i < keys.length; i++) {
      const id = keys[i];
      const at = place.get(id);
      if (at === undefined) {
        place.set(id, rows.length);
        rows.push(values[i]);
        ids.push(id);
      } else {
        rows[at] = values[i];
      }
    }
  }

  /** Stops syncing the scope; the socket stays open for the others. */
  unsubscribe(): void {
    if (this.#closed) return;
    this.#closed = true;
    if (!this.#client.closed) this.#client.release(this.#key);
  }

  /** @internal */
  deliver(event: ClientEvent): void {
    switch (event.type) {
      case "changed": {
        const change = this.#apply(event.change);
        if (event.reset) this.emit("reset", undefined);
        this.emit("change", change as RowChangeEvent as unknown as RowChangeEvent<R>);
        break;
      }
      case "progress":
        this.emit("progress", { done: event.done, total: event.total });
        break;
      case "ready":
        this.error = null;
        if (!this.#settled) {
          this.#settled = true;
          this.#resolve();
        }
        this.emit("ready", { replayed: event.replayed });
        break;
      case "scopeFailed": {
        this.error = { code: event.code, message: event.message };
        if (!this.#settled) {
          this.#settled = true;
          const error = new Error(event.message) as ScopeError;
          error.name = "HighwaterScopeError";
          error.code = event.code;
          this.#reject(error);
        }
        this.emit("error", this.error);
        break;
      }
      case "error":
        this.emit("error", { code: event.code, message: event.message });
        break;
      default:
        break;
    }
  }
}

export interface ClientEvents {
  status: ClientStatus;
  error: SyncProblem;
  /** A mutation was refused for good; its rows are shown as the server has them again. */
  rejected: RejectedEvent;
  /** The number of mutations not settled yet changed. */
  outbox: { pending: number };
}

/** The scope-sync client: one socket for every subscription, reconnecting on its own. */
export class HighwaterClient extends Emitter<ClientEvents> {
  #core: SyncClientCore;
  #store: ScopeStore;
  #subscriptions = new Map<number, Subscription>();
  #storeKeys = new Map<number, string>();
  #writes = new Map<string, Promise<void>>();
  #nextKey = 1;
  #status: ClientStatus = { state: "connecting" };
  /** Tabs sharing this client's socket (`shareTabs`), when the runtime can. */
  #tabs: Tabs | null = null;
  #role: TabRole | null = null;
  /** As a follower: each scope's cursor and catch-up count, as the leader last said. */
  #remote = new Map<number, { cursor: SyncCursor | null; replayed: number }>();
  /** As the leader: the core key serving each other tab's scope, and back. */
  #proxies = new Map<string, number>();
  #proxied = new Map<number, { tab: string; key: number }>();
  /** Tabs the leader watches for closing. */
  #watched = new Set<string>();
  /** Scopes the core has been given (their store read is done). */
  #inCore = new Set<number>();
  #loading = new Set<Promise<void>>();
  #closed = false;
  #detach: () => void = () => undefined;
  /** Mutations by id, and those not numbered yet (before the outbox is restored, or sent to
   * the leading tab) by a local reference. */
  #mutations = new Map<number, Mutation>();
  #unnumbered = new Map<
    number,
    { mutation: Mutation; ifVersion?: number; forTab?: { tab: string; ref: number }; postedTo?: string }
  >();
  /** As a follower: the tab that leads, once it said so. */
  #leader: string | null = null;
  #nextRef = 1;
  #outboxLoaded = false;
  #outboxWrites: Promise<void> = Promise.resolve();
  /** Outbox writes waiting for the one being stored: they go as one store transaction. */
  #outboxBatch: { writes: OutboxWrite[]; done: Promise<void> } | null = null;
  /** Per mutation id: when its outbox write is stored. */
  #storedIds = new Map<number, Promise<void>>();
  #pending = 0;
  #clientId: string | null = null;
  #upload: HighwaterClientOptions["upload"];

  constructor(options: HighwaterClientOptions) {
    super();
    if (typeof globalThis.WebSocket !== "function") {
      throw new Error(
        "HighwaterClient needs a global WebSocket: browsers and Node 22+ have one; on Node 20 run with --experimental-websocket",
      );
    }
    this.#store = options.store ?? new MemoryStore();
    const token = options.token;
    const source = async (): Promise<string | null> =>
      typeof token === "function" ? ((await token()) ?? null) : (token ?? null);
    this.#upload = options.upload;
    this.#core = new SyncClientCore(options.url, source, (event: ClientEvent) => this.#deliver(event), {
      upload: options.upload !== undefined,
      keys: options.keys ?? {},
    });
    this.#listen();
    const share = options.shareTabs;
    if (share !== undefined && share !== false) {
      const storeName = (this.#store as { name?: unknown }).name;
      const name = typeof share === "string" ? share : typeof storeName === "string" ? storeName : options.url;
      this.#tabs = Tabs.join(
        name,
        (message) => this.#fromTab(message),
        () => this.#lead(),
      );
      this.#role = this.#tabs === null ? "unshared" : "follower";
      this.#status = { state: "connecting", tabs: this.#role };
      // A follower asks who leads; the leader answers and is sent this tab's scopes.
      this.#tabs?.post({ type: "hello", from: this.#tabs.id });
      if (this.#tabs !== null) return;
    }
    this.#restoreOutbox();
    this.#start();
  }

  /** This client's id for its writes (the store keeps it); `null` until the store was read. */
  get clientId(): string | null {
    return this.#clientId;
  }

  /** Mutations not settled yet (in every tab, with `shareTabs`). */
  get pendingCount(): number {
    return this.#pending;
  }

  /** The mutations not settled yet, oldest first; with `shareTabs`, only in the tab that
   * holds the socket (the others see `pendingCount`). */
  pendingMutations(): MutationRecord[] {
    return this.#closed || this.#role === "follower" ? [] : this.#core.pendingMutations();
  }

  /** Reads the outbox from the store (or makes a client id) and gives it to the core; the
   * mutations made meanwhile are queued after it. */
  #restoreOutbox(): void {
    const load = this.#store.loadOutbox?.() ?? Promise.resolve(null);
    const loading = load
      .then(
        (stored) => stored,
        (error: unknown) => {
          // Not read: a fresh client id now could send the stored mutations again under it.
          // Writes wait (shown nowhere yet) and the store is read again.
          this.emit("error", { code: "store-failed", message: `could not read the outbox: ${describe(error)}` });
          if (!this.#closed) setTimeout(() => this.#restoreOutbox(), 2_000);
          return undefined;
        },
      )
      .then((stored) => {
        if (this.#closed || stored === undefined) return;
        const clientId = stored?.clientId ?? newClientId();
        this.#clientId = clientId;
        try {
          this.#core.restoreOutbox(clientId, stored?.lastId ?? 0, stored?.pending ?? []);
        } catch (error) {
          this.emit("error", { code: "store-failed", message: describe(error) });
          this.#core.restoreOutbox(clientId, stored?.lastId ?? 0, []);
        }
        this.#outboxLoaded = true;
        this.#pending = this.#core.pendingMutations().length;
        for (const [ref, { mutation, ifVersion, forTab }] of [...this.#unnumbered]) {
          this.#unnumbered.delete(ref);
          this.#queue(mutation, ifVersion, true);
          if (forTab !== undefined && this.#tabs !== null) {
            this.#tabs.post({ type: "numbered", from: this.#tabs.id, to: forTab.tab, ref: forTab.ref, id: mutation.id });
          }
        }
        this.emit("outbox", { pending: this.#pending });
        if (this.#role === "leader") this.#tabs?.post({ type: "outbox", from: this.#tabs.id, pending: this.#pending });
      })
      .finally(() => this.#loading.delete(loading));
    this.#loading.add(loading);
  }

  /**
   * Queues a write to `table`: it shows in the rows of every scope it belongs to at once, is
   * kept in the store until the server says what became of it (offline and across reloads),
   * and is sent in order. Throws `HW_INVALID_MUTATION` for one the server would refuse as
   * malformed (an update or delete without the key columns, an empty row, an unknown op).
   */
  mutate(table: string, op: MutationOp, row: Record<string, JsonValue>, options: MutateOptions = {}): Mutation {
    if (this.#closed) throw new Error("the client is closed");
    const mutation = new Mutation(table, op, row);
    if (this.#role === "follower" && this.#tabs !== null) {
      const ref = this.#nextRef++;
      const postedTo = this.#leader ?? undefined;
      this.#unnumbered.set(ref, { mutation, ifVersion: options.ifVersion, postedTo });
      // Without a leader yet, it goes once one says it leads.
      if (postedTo !== undefined) {
        this.#tabs.post({ type: "mutate", from: this.#tabs.id, ref, table, op, row, ifVersion: options.ifVersion });
      }
      return mutation;
    }
    if (!this.#outboxLoaded) {
      this.#unnumbered.set(this.#nextRef++, { mutation, ifVersion: options.ifVersion });
      return mutation;
    }
    this.#queue(mutation, options.ifVersion, false);
    return mutation;
  }

  /** Hands a mutation to the core, which throws for a malformed one: thrown to the caller,
   * or for one queued earlier (`deferred`), its `confirmed` rejects. */
  #queue(mutation: Mutation, ifVersion: number | undefined, deferred: boolean): void {
    try {
      mutation.id = this.#core.mutate(mutation.table, mutation.op, mutation.row, ifVersion);
      this.#mutations.set(mutation.id, mutation);
      const stored = this.#storedIds.get(mutation.id) ?? Promise.resolve();
      this.#storedIds.delete(mutation.id);
      stored.then(mutation.storedResolve, mutation.storedReject);
    } catch (error) {
      mutation.storedReject(error);
      if (!deferred) throw error;
      mutation.reject(error as Error);
    }
  }

  /** A settled mutation: its promise, the `rejected` event, and the tabs that wait on it. */
  #settled(result: MutationOutcome): void {
    const mutation = this.#mutations.get(result.id);
    this.#mutations.delete(result.id);
    if (result.status === "confirmed") {
      mutation?.resolve();
    } else {
      const error = new Error(result.message ?? `mutation ${result.id} was rejected`) as MutationError;
      error.name = "HighwaterMutationError";
      error.code = result.code ?? "rejected";
      if (result.row !== undefined) error.row = result.row as Record<string, JsonValue> | null;
      mutation?.reject(error);
      if (mutation !== undefined) {
        const record: MutationRecord = { id: result.id, table: mutation.table, op: mutation.op, row: mutation.row };
        this.emit("rejected", { mutation: record, code: error.code, message: error.message, row: error.row });
      }
    }
  }

  /** Stores an outbox write after the ones before it: writes that come while one is being
   * stored are merged and stored together, as one transaction. */
  #persistOutbox(write: OutboxWrite): void {
    const store = this.#store;
    if (this.#outboxBatch === null) {
      const batch: { writes: OutboxWrite[]; done: Promise<void> } = { writes: [], done: Promise.resolve() };
      batch.done = this.#outboxWrites.then(async () => {
        // Writes from here on go in the next batch.
        if (this.#outboxBatch === batch) this.#outboxBatch = null;
        await store.writeOutbox?.(mergeOutboxWrites(batch.writes));
      });
      this.#outboxWrites = batch.done.catch((error: unknown) =>
        this.emit("error", { code: "store-failed", message: describe(error) }),
      );
      this.#outboxBatch = batch;
    }
    this.#outboxBatch.writes.push(write);
    for (const mutation of write.put) this.#storedIds.set(mutation.id, this.#outboxBatch.done);
    this.#pending = Math.max(0, this.#pending + write.put.length - write.remove.length);
    this.emit("outbox", { pending: this.#pending });
    if (this.#role === "leader") this.#tabs?.post({ type: "outbox", from: this.#tabs.id, pending: this.#pending });
  }

  /** Hands a batch to the app's `upload` and tells the core how it went. */
  #uploadBatch(mutations: MutationRecord[]): void {
    const upload = this.#upload;
    const ids = mutations.map((m) => m.id);
    const clientId = this.#clientId ?? "";
    void Promise.resolve()
      .then(() => (upload === undefined ? undefined : upload(mutations, clientId)))
      .then(
        (answer) => {
          if (!this.#closed) this.#core.uploaded(ids, (answer && answer.rejected) ?? [], undefined);
        },
        (error: unknown) => {
          if (!this.#closed) this.#core.uploaded(ids, [], describe(error));
        },
      );
  }

  /** Opens the socket once the subscriptions made so far have read the store, so stored rows
   * show at once. */
  #start(): void {
    void Promise.resolve()
      .then(() => Promise.allSettled([...this.#loading]))
      .then(() => {
        if (!this.#closed) this.#core.start();
      });
  }

  /** This tab now leads: its scopes are subscribed again from the store (which the old leader
   * kept current), the socket opens, and the other tabs are told to send their scopes. */
  #lead(): void {
    if (this.#closed || this.#tabs === null) return;
    this.#role = "leader";
    this.#remote.clear();
    // Scopes still reading the store reach the core with what it holds now; the others read
    // it again (the old leader kept it current).
    for (const [key, subscription] of this.#subscriptions) {
      if (!this.#proxied.has(key) && this.#inCore.has(key)) this.#intoCore(key, subscription);
    }
    this.#setStatus({ ...this.#status });
    this.#tabs.post({ type: "leader", from: this.#tabs.id });
    // The outbox is this tab's now: read from the store (the old leader kept it), with this
    // tab's mutations the old leader had not numbered queued after it.
    this.#restoreOutbox();
    this.#start();
  }

  /** A message from another tab. */
  #fromTab(message: TabMessage): void {
    const tabs = this.#tabs;
    if (tabs === null || this.#closed) return;
    if (this.#role === "leader") {
      switch (message.type) {
        case "hello":
          tabs.post({ type: "leader", from: tabs.id });
          tabs.post({ type: "status", from: tabs.id, status: this.#status });
          return;
        case "subscribe": {
          const id = `${message.from}:${message.key}`;
          if (this.#proxies.has(id)) return;
          this.subscribe(message.scope as ScopeParams);
          // The key `subscribe` just gave.
          const key = this.#nextKey - 1;
          this.#proxies.set(id, key);
          this.#proxied.set(key, { tab: message.from, key: message.key });
          if (!this.#watched.has(message.from)) {
            this.#watched.add(message.from);
            tabs.watch(message.from, () => this.#dropTab(message.from));
          }
          return;
        }
        case "unsubscribe": {
          const key = this.#proxies.get(`${message.from}:${message.key}`);
          if (key !== undefined) this.#dropProxy(key);
          return;
        }
        case "mutate": {
          const mutation = new Mutation(message.table, message.op as MutationOp, message.row as Record<string, JsonValue>);
          const answer = (id: number, error?: { code: string; message: string }) =>
            tabs.post({ type: "numbered", from: tabs.id, to: message.from, ref: message.ref, id, error });
          if (!this.#outboxLoaded) {
            // Numbered once the store is read, and the other tab told then.
            const forTab = { tab: message.from, ref: message.ref };
            this.#unnumbered.set(this.#nextRef++, { mutation, ifVersion: message.ifVersion, forTab });
            return;
          }
          try {
            this.#queue(mutation, message.ifVersion, false);
            answer(mutation.id);
          } catch (error) {
            const code = (error as { code?: unknown }).code;
            answer(0, { code: typeof code === "string" ? code : "HW_INVALID_MUTATION", message: describe(error) });
          }
          return;
        }
        default:
          return;
      }
    }
    // A follower.
    switch (message.type) {
      case "leader":
        // A new leader (or the answer to hello): it is sent every scope of this tab, and the
        // mutations no leader has numbered yet (one that went while no tab led, or to a
        // leader that closed before it answered).
        if (message.from === this.#leader) return;
        this.#leader = message.from;
        for (const [key, subscription] of this.#subscriptions) {
          tabs.post({ type: "subscribe", from: tabs.id, key, scope: subscription.params });
        }
        for (const [ref, held] of this.#unnumbered) {
          if (held.postedTo === message.from) continue;
          held.postedTo = message.from;
          const { table, op, row } = held.mutation;
          tabs.post({ type: "mutate", from: tabs.id, ref, table, op, row, ifVersion: held.ifVersion });
        }
        return;
      case "status": {
        const status = message.status as ConnectionStatus;
        this.#setStatus(status.reason === undefined ? { state: status.state } : { state: status.state, reason: status.reason });
        return;
      }
      case "numbered": {
        if (message.to !== tabs.id) return;
        const held = this.#unnumbered.get(message.ref);
        if (held === undefined) return;
        this.#unnumbered.delete(message.ref);
        if (message.error !== undefined) {
          const error = new Error(message.error.message) as Error & { code: string };
          error.name = "HighwaterError";
          error.code = message.error.code;
          held.mutation.reject(error);
          held.mutation.storedReject(error);
        } else {
          held.mutation.storedResolve();
          held.mutation.id = message.id;
          this.#mutations.set(message.id, held.mutation);
        }
        return;
      }
      case "settled":
        this.#settled(message.result as MutationOutcome);
        return;
      case "outbox":
        this.#pending = message.pending;
        this.emit("outbox", { pending: message.pending });
        return;
      case "event": {
        if (message.to !== tabs.id) return;
        const subscription = this.#subscriptions.get(message.key);
        if (subscription === undefined) return;
        this.#remote.set(message.key, { cursor: message.cursor as SyncCursor | null, replayed: message.replayed });
        subscription.deliver(message.event as ClientEvent);
        return;
      }
      default:
        return;
    }
  }

  #dropProxy(key: number): void {
    const target = this.#proxied.get(key);
    if (target === undefined) return;
    this.#proxied.delete(key);
    this.#proxies.delete(`${target.tab}:${target.key}`);
    this.#subscriptions.get(key)?.unsubscribe();
  }

  /** Another tab closed: its scopes are no longer served. */
  #dropTab(tab: string): void {
    this.#watched.delete(tab);
    for (const [key, target] of [...this.#proxied]) if (target.tab === tab) this.#dropProxy(key);
  }

  #setStatus(status: ConnectionStatus): void {
    this.#status = this.#role === null ? status : { ...status, tabs: this.#role };
    this.emit("status", this.#status);
    if (this.#role === "leader") this.#tabs?.post({ type: "status", from: this.#tabs.id, status: this.#status });
  }

  /** @internal A scope's cursor: the core's, or as a follower the leader's. */
  cursorOf(key: number): SyncCursor | null {
    const remote = this.#role === "follower" ? this.#remote.get(key) : undefined;
    return remote !== undefined ? remote.cursor : (this.#core.cursor(key) as SyncCursor | null);
  }

  /** @internal A row's server version: the core's (a follower has none). */
  versionOf(key: number, resourceId: string): number | null {
    if (this.#role === "follower") return null;
    return this.#core.version(key, resourceId) ?? null;
  }

  /** @internal A scope's last catch-up count: the core's, or as a follower the leader's. */
  replayedOf(key: number): number {
    const remote = this.#role === "follower" ? this.#remote.get(key) : undefined;
    return remote !== undefined ? remote.replayed : this.#core.replayed(key);
  }

  /**
   * `{state, reason?}`: "connecting" | "open" | "reconnecting" | "offline" | "closed"; with
   * `shareTabs`, also `tabs`: "leader", "follower" or "unshared".
   */
  get status(): ClientStatus {
    return this.#status;
  }

  /**
   * Subscribes a scope; its stored rows show as soon as the store has read them. Throws
   * `HW_INVALID_SCOPE` for malformed conditions (an unknown operator, a nested object, an
   * operand of the wrong kind); `ready` rejects for params the server refuses.
   */
  subscribe<R = Row>(params: ScopeParams): Subscription<R> {
    if (this.#closed) throw new Error("the client is closed");
    const scope = { resourceType: params.resourceType, conditions: params.conditions ?? {} };
    const key = this.#nextKey++;
    const storeKey = scopeDigest({ resourceType: scope.resourceType, conditions: scope.conditions });
    const subscription = new Subscription<R>(this, key, scope);
    this.#subscriptions.set(key, subscription as unknown as Subscription);
    this.#storeKeys.set(key, storeKey);
    this.#intoCore(key, subscription as unknown as Subscription);
    return subscription;
  }

  /**
   * Gives the core a scope with what the store holds for it, once the store's pending writes
   * are done (so stored rows show at once); a scope the core has already is given again, from
   * the store's newer state (a tab that takes the lead). A follower also asks the leader for it.
   */
  #intoCore(key: number, subscription: Subscription): void {
    const storeKey = this.#storeKeys.get(key);
    if (storeKey === undefined) return;
    const params = subscription.params;
    const scope = { resourceType: params.resourceType, conditions: params.conditions ?? {} };
    const again = this.#inCore.has(key);
    const loading: Promise<void> = this.#afterWrites(storeKey)
      .then(() => this.#store.load(storeKey))
      .catch((error: unknown) => {
        subscription.deliver({ type: "error", scope: key, code: "store-failed", message: describe(error) });
        return null;
      })
      .then((stored) => {
        if (this.#closed || !this.#subscriptions.has(key)) return;
        if (again) this.#core.unsubscribe(key);
        this.#core.subscribe(key, scope, stored);
        this.#inCore.add(key);
        if (this.#role === "follower") this.#tabs?.post({ type: "subscribe", from: this.#tabs.id, key, scope });
      })
      .catch((error: unknown) => {
        // Params the core refuses (a blank resourceType, say): the scope fails, `ready` rejects.
        const code = (error as { code?: unknown }).code;
        subscription.deliver({
          type: "scopeFailed",
          scope: key,
          code: typeof code === "string" ? code : "invalid-params",
          message: describe(error),
        });
      })
      .finally(() => this.#loading.delete(loading));
    this.#loading.add(loading);
  }

  /** Closes the socket and stays offline until `goOnline()` (with `shareTabs`, only in the
   * tab that leads: it switches the shared socket). */
  goOffline(): void {
    if (!this.#closed && this.#role !== "follower") this.#core.goOffline();
  }

  /** Reconnects now (also after `goOffline()`); with `shareTabs`, only in the tab that leads. */
  goOnline(): void {
    if (!this.#closed && this.#role !== "follower") this.#core.goOnline();
  }

  /** Closes the socket for good; resolves once every store write has finished. */
  async close(): Promise<void> {
    if (!this.#closed) {
      this.#closed = true;
      this.#detach();
      // The locks go: another tab takes the lead, and the leader drops this tab's scopes.
      this.#tabs?.close();
      this.#core.close();
      // The core holds the emit callback, which holds this client: free it explicitly (later,
      // so a close from inside an event handler does not free the core under its own call).
      const core = this.#core;
      setTimeout(() => core.free(), 0);
    }
    await Promise.allSettled([...this.#writes.values(), this.#outboxWrites]);
  }

  /** Whether `close()` was called. */
  get closed(): boolean {
    return this.#closed;
  }

  /** @internal */
  release(key: number): void {
    this.#subscriptions.delete(key);
    this.#storeKeys.delete(key);
    this.#inCore.delete(key);
    this.#core.unsubscribe(key);
    if (this.#role === "follower") this.#tabs?.post({ type: "unsubscribe", from: this.#tabs.id, key });
  }

  #afterWrites(storeKey: string): Promise<void> {
    return this.#writes.get(storeKey) ?? Promise.resolve();
  }

  #persist(key: number, write: PersistWrite): void {
    const storeKey = this.#storeKeys.get(key);
    if (storeKey === undefined) return;
    const next = this.#afterWrites(storeKey)
      .then(() => this.#store.write(storeKey, write))
      .catch((error: unknown) => {
        this.#subscriptions.get(key)?.deliver({ type: "error", scope: key, code: "store-failed", message: describe(error) });
      });
    this.#writes.set(storeKey, next);
    void next.then(() => {
      if (this.#writes.get(storeKey) === next) this.#writes.delete(storeKey);
    });
  }

  #deliver(event: ClientEvent): void {
    switch (event.type) {
      case "status": {
        // A follower's own core never connects: its status is the leader's.
        if (this.#role === "follower") return;
        this.#setStatus(event.reason === undefined ? { state: event.state } : { state: event.state, reason: event.reason });
        return;
      }
      case "persist": {
        const subscription = this.#subscriptions.get(event.scope);
        if (subscription !== undefined) this.#persist(event.scope, subscription.storedWrite(event.write));
        return;
      }
      case "persistOutbox":
        this.#persistOutbox(event.write);
        return;
      case "settled":
        this.#settled(event.result);
        if (this.#role === "leader") this.#tabs?.post({ type: "settled", from: this.#tabs.id, result: event.result });
        return;
      case "upload":
        this.#uploadBatch(event.mutations);
        return;
      case "error":
        if (event.scope === null || event.scope === undefined) {
          this.emit("error", { code: event.code, message: event.message });
        } else {
          this.#subscriptions.get(event.scope)?.deliver(event);
          this.#forward(event.scope, event);
        }
        return;
      default:
        this.#subscriptions.get(event.scope)?.deliver(event);
        this.#forward(event.scope, event);
    }
  }

  /** A scope served for another tab: its event goes on to that tab, with the scope's cursor. */
  #forward(key: number, event: ClientEvent): void {
    const target = this.#proxied.get(key);
    if (target === undefined || this.#tabs === null) return;
    this.#tabs.post({
      type: "event",
      from: this.#tabs.id,
      to: target.tab,
      key: target.key,
      event,
      cursor: this.#core.cursor(key) as unknown,
      replayed: this.#core.replayed(key),
    });
  }

  /**
   * The browser's online/offline events, and the page shown again (`visibilitychange` to
   * visible, `pageshow` from the back/forward cache), after which the socket is probed rather
   * than trusted (none of these exist in Node; a timer that fires late is noticed by the core).
   */
  #listen(): void {
    type Target = {
      addEventListener?: (type: string, listener: (event?: unknown) => void) => void;
      removeEventListener?: (type: string, listener: (event?: unknown) => void) => void;
    };
    const target = globalThis as unknown as Target;
    if (typeof target.addEventListener !== "function" || typeof target.removeEventListener !== "function") return;
    const online = () => this.#core.browserOnline();
    const offline = () => this.#core.browserOffline();
    const shown = () => this.#core.woke();
    const restored = (event?: unknown) => {
      if ((event as { persisted?: boolean } | undefined)?.persisted) shown();
    };
    const doc = (globalThis as { document?: Target & { visibilityState?: string } }).document;
    const visibility = () => {
      if (doc?.visibilityState === "visible") shown();
    };
    target.addEventListener("online", online);
    target.addEventListener("offline", offline);
    target.addEventListener("pageshow", restored);
    doc?.addEventListener?.("visibilitychange", visibility);
    const nav = (globalThis as { navigator?: { onLine?: boolean } }).navigator;
    if (nav?.onLine === false) this.#core.browserOffline();
    this.#detach = () => {
      target.removeEventListener?.("online", online);
      target.removeEventListener?.("offline", offline);
      target.removeEventListener?.("pageshow", restored);
      doc?.removeEventListener?.("visibilitychange", visibility);
    };
  }
}

/** Outbox writes in order, as one: the last state of each mutation id. */
function mergeOutboxWrites(writes: OutboxWrite[]): OutboxWrite {
  const put = new Map<number, MutationRecord>();
  const remove = new Set<number>();
  let lastId = 0;
  for (const write of writes) {
    lastId = Math.max(lastId, write.lastId);
    for (const mutation of write.put) {
      put.set(mutation.id, mutation);
      remove.delete(mutation.id);
    }
    for (const id of write.remove) {
      put.delete(id);
      remove.add(id);
    }
  }
  return { clientId: writes[writes.length - 1].clientId, lastId, put: [...put.values()], remove: [...remove] };
}

/** A fresh client id: random, 22 characters of letters and digits. */
function newClientId(): string {
  const bytes = new Uint8Array(16);
  globalThis.crypto.getRandomValues(bytes);
  return "c" + Array.from(bytes, (b) => b.toString(36).padStart(2, "0")).join("").slice(0, 21);
}

function describe(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}
