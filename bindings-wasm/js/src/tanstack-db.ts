// `highwater/tanstack-db`: a scope as a TanStack DB collection. Import it only where TanStack DB
// is: the core entry points never load it.
import type { CollectionConfig, DeleteMutationFn, InsertMutationFn, SyncConfig, UpdateMutationFn } from "@tanstack/db";
import type { HighwaterClient, Row, RowChangeEvent, ScopeParams, Subscription, SyncProblem } from "./client.js";
import type { JsonValue } from "./wasm/api.js";

/** What `highwaterCollectionOptions` needs. */
export interface HighwaterCollectionConfig<T extends object, K extends string | number> {
  /** The client whose socket carries the scope (one socket for every collection). */
  client: HighwaterClient;
  /** The scope the collection holds: `{ resourceType, conditions }`. */
  scope: ScopeParams;
  /** The row's key: its primary key column(s). */
  getKey: (row: T) => K;
  /** The collection's id (default: derived from the scope). */
  id?: string;
  /** The table's key columns, which name the row of an update or delete (default `["id"]`;
   * give the client the same in its `keys` option). */
  keyColumns?: string[];
}

/** What the collection's `utils` say about the scope behind it. */
export interface HighwaterCollectionUtils {
  [key: string]: unknown;
  /** The subscription while the collection syncs, `null` before and after. */
  subscription: () => Subscription | null;
  /** The last problem the scope reported (a refused scope: `forbidden`, …), or `null`. */
  error: () => SyncProblem | null;
}

/**
 * Collection options that sync a Highwater scope into a TanStack DB collection: each server
 * transaction is one sync transaction (its inserts, updates and removals together), the
 * collection is ready once the scope caught up, and a refused scope fails its `preload()`.
 * Rows stored by the client (its `store`) show before the socket is open.
 *
 * Inserts, updates and deletes on the collection go through `client.mutate` (kept in the
 * client's outbox, offline too, and checked by the server's write rules); each handler resolves
 * once the server applied the mutation and its row is in the scope, so the collection's
 * optimistic state gives way to the synced row without a gap. A refused mutation rejects the
 * transaction (a `HighwaterMutationError` with its `code`) and rolls it back.
 *
 * ```ts
 * const todos = createCollection(highwaterCollectionOptions<Todo, number>({
 *   client, scope: { resourceType: "todos", conditions: { owner: "ada" } }, getKey: (t) => t.id,
 * }));
 * ```
 */
export function highwaterCollectionOptions<T extends object = Row, K extends string | number = string | number>(
  config: HighwaterCollectionConfig<T, K>,
): CollectionConfig<T, K, never, HighwaterCollectionUtils> & { utils: HighwaterCollectionUtils } {
  let current: Subscription<T> | null = null;
  let problem: SyncProblem | null = null;
  const sync: SyncConfig<T, K>["sync"] = ({ begin, write, commit, markReady, markError }) => {
    const subscription = config.client.subscribe<T>(config.scope);
    current = subscription;
    problem = null;
    let ready = false;
    const apply = ({ inserted, updated, removed }: RowChangeEvent<T>) => {
      if (inserted.length + updated.length + removed.length === 0) return;
      begin();
      for (const value of inserted) write({ type: "insert", value });
      for (const value of updated) write({ type: "update", value });
      for (const value of removed) write({ type: "delete", value });
      commit();
    };
    // Rows already held (stored ones the client restored before this collection synced).
    apply({ inserted: [...subscription.rows()], updated: [], removed: [] });
    const detach = [
      subscription.on("change", apply),
      subscription.on("error", (error) => {
        problem = error;
      }),
    ];
    subscription.ready.then(
      () => {
        ready = true;
        markReady();
      },
      (error: unknown) => {
        if (!ready) markError(error);
      },
    );
    return () => {
      for (const off of detach) off();
      subscription.unsubscribe();
      if (current === subscription) current = null;
    };
  };
  const table = config.scope.resourceType;
  const keyColumns = config.keyColumns ?? ["id"];
  const keyOf = (row: object): Record<string, JsonValue> =>
    Object.fromEntries(keyColumns.map((column) => [column, (row as Record<string, JsonValue>)[column]]));
  // The row's columns, without the fields TanStack DB adds to the rows it hands out.
  const columns = (row: object): Record<string, JsonValue> =>
    Object.fromEntries(Object.entries(row).filter(([column]) => !column.startsWith("$"))) as Record<string, JsonValue>;
  const onInsert: InsertMutationFn<T, K, HighwaterCollectionUtils> = async ({ transaction }) => {
    await Promise.all(transaction.mutations.map((m) => config.client.mutate(table, "insert", columns(m.modified)).confirmed));
  };
  const onUpdate: UpdateMutationFn<T, K, HighwaterCollectionUtils> = async ({ transaction }) => {
    await Promise.all(
      transaction.mutations.map(
        (m) => config.client.mutate(table, "update", { ...columns(m.changes), ...keyOf(m.original) }).confirmed,
      ),
    );
  };
  const onDelete: DeleteMutationFn<T, K, HighwaterCollectionUtils> = async ({ transaction }) => {
    await Promise.all(transaction.mutations.map((m) => config.client.mutate(table, "delete", keyOf(m.original)).confirmed));
  };
  return {
    id: config.id ?? `highwater:${config.scope.resourceType}:${JSON.stringify(config.scope.conditions ?? {})}`,
    getKey: config.getKey,
    sync: { sync, rowUpdateMode: "full" },
    onInsert,
    onUpdate,
    onDelete,
    utils: {
      subscription: () => current as unknown as Subscription | null,
      error: () => problem,
    },
  };
}
