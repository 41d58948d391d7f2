// `highwater/react`: a scope as React state. Import it only where React is: the core entry
// points never load it, so a page without React carries none of this.
import { useEffect, useRef, useState, useSyncExternalStore } from "react";
import type { ClientStatus, HighwaterClient, ProgressEvent, Row, ScopeParams, Subscription, SyncProblem } from "./client.js";

/** What `useScope` returns: one snapshot, replaced only when something in it changed. */
export interface ScopeState<R = Row> {
  /**
   * The scope's rows (in no particular order). The same array until the rows change, and an
   * unchanged row is the same object across changes: `React.memo` row components re-render
   * only for rows that changed.
   */
  rows: readonly R[];
  /** The client's connection: `{state, reason?}`, and `tabs` with `shareTabs`. */
  status: ClientStatus;
  /** Caught up with the server (the catch-up replay was applied). */
  ready: boolean;
  /** The catch-up's progress while it runs, `null` before the first page. */
  progress: ProgressEvent | null;
  /** The last problem the scope reported (a refused scope: `forbidden`, `auth-invalid`, …). */
  error: SyncProblem | null;
}

/** One subscription's state for `useSyncExternalStore`: a cached snapshot and its listeners. */
class ScopeStore<R> {
  #snapshot: ScopeState<R>;
  #listeners = new Set<() => void>();
  #detach: Array<() => void>;

  constructor(
    client: HighwaterClient,
    readonly subscription: Subscription<R>,
    /** The scope, as `useScope` compares scopes. */
    readonly key: string,
  ) {
    this.#snapshot = {
      rows: subscription.rows(),
      status: client.status,
      ready: false,
      progress: null,
      error: subscription.error,
    };
    const update = (change: Partial<ScopeState<R>>) => {
      this.#snapshot = { ...this.#snapshot, ...change };
      for (const listener of [...this.#listeners]) listener();
    };
    const rows = () => update({ rows: subscription.rows() });
    this.#detach = [
      subscription.on("change", rows),
      subscription.on("reset", rows),
      subscription.on("progress", (progress) => update({ progress })),
      subscription.on("ready", () => update({ ready: true, error: null, rows: subscription.rows() })),
      subscription.on("error", (error) => update({ error })),
      client.on("status", (status) => update({ status })),
    ];
    // A scope already caught up (its rows were stored and the server confirmed them before
    // this store existed) says so through `ready`.
    subscription.ready.then(
      () => {
        if (!this.#snapshot.ready) update({ ready: true });
      },
      () => undefined,
    );
  }

  subscribe = (listener: () => void): (() => void) => {
    this.#listeners.add(listener);
    return () => this.#listeners.delete(listener);
  };

  getSnapshot = (): ScopeState<R> => this.#snapshot;

  close(): void {
    for (const detach of this.#detach) detach();
    this.#listeners.clear();
    this.subscription.unsubscribe();
  }
}

const noSubscribe = () => () => undefined;

/**
 * Subscribes `scope` on `client` while the component is mounted and returns its state; a new
 * `scope` (compared by value, so an object literal per render is fine) moves the subscription,
 * `null` holds none. The client's one socket carries every scope of every component.
 *
 * ```tsx
 * const { rows, ready } = useScope<Todo>(client, { resourceType: "todos", conditions: { owner } });
 * ```
 */
export function useScope<R = Row>(client: HighwaterClient, scope: ScopeParams | null): ScopeState<R> {
  const key = scope === null ? null : JSON.stringify([scope.resourceType, scope.conditions ?? {}]);
  const [store, setStore] = useState<ScopeStore<R> | null>(null);
  useEffect(() => {
    if (key === null) return undefined;
    const [resourceType, conditions] = JSON.parse(key) as [string, ScopeParams["conditions"]];
    const created = new ScopeStore<R>(client, client.subscribe<R>({ resourceType, conditions }), key);
    setStore(created);
    return () => {
      created.close();
      setStore(null);
    };
  }, [client, key]);
  // Until the effect has subscribed a new scope, the old one's rows are not shown for it.
  const current = store !== null && store.key === key ? store : null;
  const idle = useRef<ScopeState<R> | null>(null);
  const empty = () => {
    if (idle.current === null || idle.current.status !== client.status) {
      idle.current = { rows: [], status: client.status, ready: false, progress: null, error: null };
    }
    return idle.current;
  };
  return useSyncExternalStore(
    current?.subscribe ?? noSubscribe,
    current?.getSnapshot ?? empty,
    current?.getSnapshot ?? empty,
  );
}
