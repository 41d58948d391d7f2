// The stores behind HighwaterClient: IndexedDbStore (on fake-indexeddb in Node; the web demo's
// browser test runs it in Chromium) and MemoryStore keep the same contract.
import assert from "node:assert/strict";
import { test } from "node:test";
import { IDBFactory, IDBKeyRange } from "fake-indexeddb";
import { IndexedDbStore, MemoryStore } from "highwater";

globalThis.indexedDB = new IDBFactory();
globalThis.IDBKeyRange = IDBKeyRange;

const cursor = (seq) => ({ id: `1:${seq}`, serverSequence: seq, updatedAt: "2026-12-01T12:00:00.000Z" });
const row = (id, seq, extra = {}) => ({ id, serverSequence: seq, data: { id, ...extra } });

for (const [name, make] of [
  ["MemoryStore", () => new MemoryStore()],
  ["IndexedDbStore", () => new IndexedDbStore(`test-${Math.random()}`)],
]) {
  test(`${name}: rows, deletes, cursor and forgetting the cursor, scope by scope`, async () => {
    const store = make();
    assert.equal(await store.load("a"), null);
    await store.write("a", { forgetCursor: false, upserts: [row("1", 1), row("2", 2, { big: 2n ** 60n })], deletes: [], cursor: null });
    await store.write("b", { forgetCursor: false, upserts: [row("1", 3)], deletes: [], cursor: cursor(3) });
    await store.write("a", { forgetCursor: false, upserts: [row("3", 4)], deletes: ["1"], cursor: cursor(4) });
    const a = await store.load("a");
    assert.deepEqual(a.rows.map((r) => r.id).sort(), ["2", "3"]);
    assert.equal(a.rows.find((r) => r.id === "2").data.big, 2n ** 60n);
    assert.deepEqual(a.cursor, cursor(4));
    // A write without a cursor keeps the stored one.
    await store.write("a", { forgetCursor: false, upserts: [row("4", 5)], deletes: [], cursor: null });
    assert.deepEqual((await store.load("a")).cursor, cursor(4));
    // A reset forgets that scope's cursor only and keeps its rows (the replay after it
    // overwrites them, and deletes what it did not deliver once confirmed).
    await store.write("a", { forgetCursor: true, upserts: [row("9", 1)], deletes: [], cursor: null });
    const reset = await store.load("a");
    assert.deepEqual(reset.rows.map((r) => r.id).sort(), ["2", "3", "4", "9"]);
    assert.equal(reset.cursor, null);
    assert.deepEqual(await store.load("b"), { rows: [row("1", 3)], cursor: cursor(3) });
  });
}

test("IndexedDbStore: a write that fails stores none of it", async () => {
  const store = new IndexedDbStore(`test-${Math.random()}`);
  await store.write("a", { forgetCursor: false, upserts: [row("1", 1)], deletes: [], cursor: cursor(1) });
  // A function cannot be cloned into IndexedDB: the transaction aborts after the first put.
  await assert.rejects(
    store.write("a", { forgetCursor: true, upserts: [row("2", 2), row("3", 3, { bad: () => 1 })], deletes: [], cursor: cursor(3) }),
  );
  assert.deepEqual(await store.load("a"), { rows: [row("1", 1)], cursor: cursor(1) });
});

const mutation = (id, extra = {}) => ({ id, table: "todos", op: "insert", row: { id: `t${id}`, ...extra } });

for (const [name, make] of [
  ["MemoryStore", () => new MemoryStore()],
  ["IndexedDbStore", () => new IndexedDbStore(`outbox-${Math.random()}`)],
]) {
  test(`${name}: the outbox keeps its client id, last id and pending mutations`, async () => {
    const store = make();
    assert.equal(await store.loadOutbox(), null);
    await store.writeOutbox({ clientId: "c1", lastId: 2, put: [mutation(1), mutation(2, { n: 2n ** 60n })], remove: [] });
    await store.writeOutbox({ clientId: "c1", lastId: 3, put: [mutation(3)], remove: [1] });
    const held = await store.loadOutbox();
    assert.equal(held.clientId, "c1");
    assert.equal(held.lastId, 3);
    assert.deepEqual(held.pending.map((m) => m.id).sort(), [2, 3]);
    assert.equal(held.pending.find((m) => m.id === 2).row.n, 2n ** 60n);
    // Emptied, the last id stays: a reload goes on counting.
    await store.writeOutbox({ clientId: "c1", lastId: 3, put: [], remove: [2, 3] });
    assert.deepEqual(await store.loadOutbox(), { clientId: "c1", lastId: 3, pending: [] });
  });
}

test("IndexedDbStore: a database of the first version gains the outbox and keeps its rows", async () => {
  const name = `upgrade-${Math.random()}`;
  await new Promise((resolve, reject) => {
    const open = indexedDB.open(name, 1);
    open.onupgradeneeded = () => {
      open.result.createObjectStore("rows", { keyPath: ["scope", "id"] });
      open.result.createObjectStore("cursors", { keyPath: "scope" });
    };
    open.onsuccess = () => {
      const tx = open.result.transaction(["rows"], "readwrite");
      tx.objectStore("rows").put({ scope: "a", id: "1", serverSequence: 1, data: { id: "1" } });
      tx.oncomplete = () => {
        open.result.close();
        resolve();
      };
    };
    open.onerror = () => reject(open.error);
  });
  const store = new IndexedDbStore(name);
  assert.deepEqual((await store.load("a")).rows, [row("1", 1)]);
  await store.writeOutbox({ clientId: "c9", lastId: 1, put: [mutation(1)], remove: [] });
  assert.equal((await store.loadOutbox()).pending.length, 1);
  store.close();
});
