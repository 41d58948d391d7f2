// Where a HighwaterClient keeps each scope's rows and cursor between runs.
import type { MutationRecord, OutboxWrite, PersistWrite, StoredRow, StoredScopeData, SyncCursor } from "./wasm/api.js";

/** What a store keeps of a client's writes: its id, the last mutation id it gave out, and the
 * mutations not settled yet. */
export interface StoredOutbox {
  clientId: string;
  lastId: number;
  pending: MutationRecord[];
}

/**
 * A scope store. `write` must apply the whole write or none of it (rows, deletions and the
 * cursor together), and writes of one scope must apply in the order given.
 */
export interface ScopeStore {
  /** What the store holds for the scope, or `null` if nothing. */
  load(scope: string): Promise<StoredScopeData | null>;
  write(scope: string, write: PersistWrite): Promise<void>;
  /** The outbox, or `null` if none was kept (the client makes a new client id). A store
   * without these two keeps a client's pending writes in memory only. */
  loadOutbox?(): Promise<StoredOutbox | null>;
  /** Applies one outbox write, all of it or none, in the order given. */
  writeOutbox?(write: OutboxWrite): Promise<void>;
}

interface MemoryScope {
  rows: Map<string, StoredRow>;
  cursor: SyncCursor | null;
}

/** Keeps scopes in memory: the default. Share one between clients to keep rows across them. */
export class MemoryStore implements ScopeStore {
  #scopes = new Map<string, MemoryScope>();
  #outbox: { clientId: string; lastId: number; pending: Map<number, MutationRecord> } | null = null;

  async loadOutbox(): Promise<StoredOutbox | null> {
    const held = this.#outbox;
    if (held === null) return null;
    return { clientId: held.clientId, lastId: held.lastId, pending: [...held.pending.values()].map((m) => structuredClone(m)) };
  }

  async writeOutbox(write: OutboxWrite): Promise<void> {
    if (this.#outbox === null || this.#outbox.clientId !== write.clientId) {
      this.#outbox = { clientId: write.clientId, lastId: 0, pending: new Map() };
    }
    const held = this.#outbox;
    held.lastId = Math.max(held.lastId, write.lastId);
    for (const mutation of write.put) held.pending.set(mutation.id, structuredClone(mutation));
    for (const id of write.remove) held.pending.delete(id);
  }

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
const OUTBOX = "outbox";
const META = "meta";

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
        const request = indexedDB.open(this.name, 2);
        request.onupgradeneeded = () => {
          const db = request.result;
          // Version 1 had rows and cursors; version 2 adds the outbox.
          const has = (name: string) => db.objectStoreNames.contains(name);
          if (!has(ROWS)) db.createObjectStore(ROWS, { keyPath: ["scope", "id"] });
          if (!has(CURSORS)) db.createObjectStore(CURSORS, { keyPath: "scope" });
          if (!has(OUTBOX)) db.createObjectStore(OUTBOX, { keyPath: "id" });
          if (!has(META)) db.createObjectStore(META, { keyPath: "key" });
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

  async loadOutbox(): Promise<StoredOutbox | null> {
    const db = await this.#open();
    const tx = db.transaction([OUTBOX, META], "readonly");
    const pending = request<MutationRecord[]>(tx.objectStore(OUTBOX).getAll());
    const meta = request<{ key: string; clientId: string; lastId: number } | undefined>(tx.objectStore(META).get("outbox"));
    const [mutations, held] = await Promise.all([pending, meta]);
    if (held === undefined) return null;
    return { clientId: held.clientId, lastId: held.lastId, pending: mutations };
  }

  async writeOutbox(write: OutboxWrite): Promise<void> {
    const db = await this.#open();
    const tx = db.transaction([OUTBOX, META], "readwrite");
    const done = new Promise<void>((resolve, reject) => {
      tx.oncomplete = () => resolve();
      tx.onabort = () => reject(tx.error ?? new Error("the IndexedDB transaction was aborted"));
    });
    try {
      const outbox = tx.objectStore(OUTBOX);
      tx.objectStore(META).put({ key: "outbox", clientId: write.clientId, lastId: write.lastId });
      for (const mutation of write.put) outbox.put(mutation);
      for (const id of write.remove) outbox.delete(id);
    } catch (error) {
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
