// Where a HighwaterClient keeps each scope's rows and cursor between runs.
import type { PersistWrite, StoredRow, StoredScopeData, SyncCursor } from "./wasm/api.js";

/**
 * A scope store. `write` must apply the whole write or none of it (rows, deletions and the
 * cursor together), and writes of one scope must apply in the order given.
 */
export interface ScopeStore {
  /** What the store holds for the scope, or `null` if nothing. */
  load(scope: string): Promise<StoredScopeData | null>;
  write(scope: string, write: PersistWrite): Promise<void>;
}

interface MemoryScope {
  rows: Map<string, StoredRow>;
  cursor: SyncCursor | null;
}

/** Keeps scopes in memory: the default. Share one between clients to keep rows across them. */
export class MemoryStore implements ScopeStore {
  #scopes = new Map<string, MemoryScope>();

  async load(scope: string): Promise<StoredScopeData | null> {
    const held = this.#scopes.get(scope);
    if (held === undefined) return null;
    return { rows: [...held.rows.values()].map((row) => structuredClone(row)), cursor: structuredClone(held.cursor) };
  }

  async write(scope: string, write: PersistWrite): Promise<void> {
    let held = this.#scopes.get(scope);
    if (held === undefined) {
      held = { rows: new Map(), cursor: null };
      this.#scopes.set(scope, held);
    }
    if (write.forgetCursor) held.cursor = null;
    for (const row of write.upserts) held.rows.set(row.id, row);
    for (const id of write.deletes) held.rows.delete(id);
    if (write.cursor) held.cursor = write.cursor;
  }
}

const ROWS = "rows";
const CURSORS = "cursors";

/**
 * Keeps scopes in IndexedDB (browsers): each write is ONE IndexedDB transaction over the
 * scope's rows and its cursor, so a reload finds rows and cursor that belong together.
 */
export class IndexedDbStore implements ScopeStore {
  readonly name: string;
  #db: Promise<IDBDatabase> | null = null;

  constructor(name = "highwater") {
    this.name = name;
  }

  #open(): Promise<IDBDatabase> {
    if (this.#db === null) {
      this.#db = new Promise((resolve, reject) => {
        if (typeof indexedDB === "undefined") {
          reject(new Error("IndexedDbStore needs IndexedDB; use MemoryStore where there is none"));
          return;
        }
        const request = indexedDB.open(this.name, 1);
        request.onupgradeneeded = () => {
          const db = request.result;
          db.createObjectStore(ROWS, { keyPath: ["scope", "id"] });
          db.createObjectStore(CURSORS, { keyPath: "scope" });
        };
        request.onsuccess = () => resolve(request.result);
        request.onerror = () => reject(request.error ?? new Error(`could not open IndexedDB database ${this.name}`));
      });
    }
    return this.#db;
  }

  async load(scope: string): Promise<StoredScopeData | null> {
    const db = await this.#open();
    const tx = db.transaction([ROWS, CURSORS], "readonly");
    const rows = request<{ id: string; serverSequence: number | bigint | null; data: Record<string, never> }[]>(
      tx.objectStore(ROWS).getAll(scopeRange(scope)),
    );
    const cursor = request<{ cursor: SyncCursor } | undefined>(tx.objectStore(CURSORS).get(scope));
    const [held, stored] = await Promise.all([rows, cursor]);
    if (held.length === 0 && stored === undefined) return null;
    return {
      rows: held.map(({ id, serverSequence, data }) => ({ id, serverSequence, data })),
      cursor: stored?.cursor ?? null,
    };
  }

  async write(scope: string, write: PersistWrite): Promise<void> {
    const db = await this.#open();
    const tx = db.transaction([ROWS, CURSORS], "readwrite");
    const done = new Promise<void>((resolve, reject) => {
      tx.oncomplete = () => resolve();
      tx.onabort = () => reject(tx.error ?? new Error("the IndexedDB transaction was aborted"));
    });
    try {
      const rows = tx.objectStore(ROWS);
      const cursors = tx.objectStore(CURSORS);
      if (write.forgetCursor) cursors.delete(scope);
      for (const row of write.upserts) rows.put({ scope, id: row.id, serverSequence: row.serverSequence, data: row.data });
      for (const id of write.deletes) rows.delete([scope, id]);
      if (write.cursor) cursors.put({ scope, cursor: write.cursor });
    } catch (error) {
      // A request that throws (a value IndexedDB cannot clone) must not leave the ones before it
      // to commit on their own: all of the write or none.
      done.catch(() => undefined);
      tx.abort();
      throw error;
    }
    await done;
  }

  /** Closes the database connection (a later call opens it again). */
  close(): void {
    const db = this.#db;
    this.#db = null;
    void db?.then((open) => open.close(), () => undefined);
  }
}

/** Every `[scope, id]` key: arrays sort after strings, so `[scope, []]` is past every id. */
function scopeRange(scope: string): IDBKeyRange {
  return IDBKeyRange.bound([scope], [scope, []]);
}

function request<T>(req: IDBRequest): Promise<T> {
  return new Promise((resolve, reject) => {
    req.onsuccess = () => resolve(req.result as T);
    req.onerror = () => reject(req.error);
  });
}
