// HighwaterClient: live rows of scopes over one socket. The rules (reconnect, heartbeat,
// tokens, resume, cursors) run in the WebAssembly core; this file keeps handles, events and
// store writes.
import { SyncClientCore, scopeDigest } from "./wasm/api.js";
import type { ClientEvent, ConnectionStatus, CoreRowChange, CoreWrite, JsonValue, PersistWrite, ScopeCondition, SyncCursor } from "./wasm/api.js";
import { MemoryStore, type ScopeStore } from "./stores.js";

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
    return this.#closed || this.#client.closed ? null : (this.#client.core().cursor(this.#key) as SyncCursor | null);
  }

  /**
   * Rows applied by the last finished catch-up replay (after a connect or reconnect). While a
   * reconnect's catch-up runs, its rows already show in `rows()` but this is still the previous
   * catch-up's count; each "ready" event carries the new one.
   */
  get replayedOnLastResume(): number {
    return this.#closed || this.#client.closed ? 0 : this.#client.core().replayed(this.#key);
  }

  /** @internal The stored form of a write from the core: its upserts take the rows held. */
  storedWrite(write: CoreWrite): PersistWrite {
    const upserts = [];
    for (const { id, serverSequence } of write.upserts) {
      const place = this.#place.get(id);
      const data = place === undefined ? undefined : this.#rows[place];
      // Every upsert is a row the same apply reported just before (a change, or a restore).
      if (data !== undefined) upserts.push({ id, serverSequence, data });
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
    // An inserted or updated row takes its id's place, or a new one at the end.
    const put = ({ id, data }: CoreRowChange["inserted"][number]): Row => {
      const row = data as Row;
      const at = place.get(id);
      if (at === undefined) {
        place.set(id, rows.length);
        rows.push(row);
        ids.push(id);
      } else {
        rows[at] = row;
      }
      return row;
    };
    const inserted = change.inserted.map(put);
    const updated = change.updated.map(put);
    this.#list = null;
    return { inserted, updated, removed };
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
  status: ConnectionStatus;
  error: SyncProblem;
}

/** The scope-sync client: one socket for every subscription, reconnecting on its own. */
export class HighwaterClient extends Emitter<ClientEvents> {
  #core: SyncClientCore;
  #store: ScopeStore;
  #subscriptions = new Map<number, Subscription>();
  #storeKeys = new Map<number, string>();
  #writes = new Map<string, Promise<void>>();
  #nextKey = 1;
  #status: ConnectionStatus = { state: "connecting" };
  #loading = new Set<Promise<void>>();
  #closed = false;
  #detach: () => void = () => undefined;

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
    this.#core = new SyncClientCore(options.url, source, (event: ClientEvent) => this.#deliver(event));
    this.#listen();
    // Subscriptions made right after construction load from the store before the socket opens,
    // so stored rows show at once.
    void Promise.resolve()
      .then(() => Promise.allSettled([...this.#loading]))
      .then(() => {
        if (!this.#closed) this.#core.start();
      });
  }

  /** `{state, reason?}`: "connecting" | "open" | "reconnecting" | "offline" | "closed". */
  get status(): ConnectionStatus {
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
    const loading: Promise<void> = this.#afterWrites(storeKey)
      .then(() => this.#store.load(storeKey))
      .catch((error: unknown) => {
        subscription.deliver({ type: "error", scope: key, code: "store-failed", message: describe(error) });
        return null;
      })
      .then((stored) => {
        if (this.#closed || !this.#subscriptions.has(key)) return;
        this.#core.subscribe(key, scope, stored);
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
    return subscription;
  }

  /** Closes the socket and stays offline until `goOnline()`. */
  goOffline(): void {
    if (!this.#closed) this.#core.goOffline();
  }

  /** Reconnects now (also after `goOffline()`). */
  goOnline(): void {
    if (!this.#closed) this.#core.goOnline();
  }

  /** Closes the socket for good; resolves once every store write has finished. */
  async close(): Promise<void> {
    if (!this.#closed) {
      this.#closed = true;
      this.#detach();
      this.#core.close();
      // The core holds the emit callback, which holds this client: free it explicitly (later,
      // so a close from inside an event handler does not free the core under its own call).
      const core = this.#core;
      setTimeout(() => core.free(), 0);
    }
    await Promise.allSettled([...this.#writes.values()]);
  }

  /** Whether `close()` was called. */
  get closed(): boolean {
    return this.#closed;
  }

  /** @internal */
  core(): SyncClientCore {
    return this.#core;
  }

  /** @internal */
  release(key: number): void {
    this.#subscriptions.delete(key);
    this.#storeKeys.delete(key);
    this.#core.unsubscribe(key);
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
        this.#status = event.reason === undefined ? { state: event.state } : { state: event.state, reason: event.reason };
        this.emit("status", this.#status);
        return;
      }
      case "persist": {
        const subscription = this.#subscriptions.get(event.scope);
        if (subscription !== undefined) this.#persist(event.scope, subscription.storedWrite(event.write));
        return;
      }
      case "error":
        if (event.scope === null || event.scope === undefined) {
          this.emit("error", { code: event.code, message: event.message });
        } else {
          this.#subscriptions.get(event.scope)?.deliver(event);
        }
        return;
      default:
        this.#subscriptions.get(event.scope)?.deliver(event);
    }
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

function describe(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}
