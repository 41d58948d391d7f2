// `highwater/tanstack-db` against the scripted contract server: a scope as a TanStack DB
// collection, ready once caught up, live through a live query, and a refused scope failing
// `preload()`.
import assert from "node:assert/strict";
import { test } from "node:test";
import { createCollection, createLiveQueryCollection, eq } from "@tanstack/db";
import { HighwaterClient } from "highwater";
import { highwaterCollectionOptions } from "highwater/tanstack-db";
import { ContractServer, until } from "./support/contract-server.mjs";

const sortedIds = (collection) => [...collection.values()].map((row) => row.id).sort();

test("a scope is a collection: ready when caught up, live, one transaction per server transaction", async () => {
  const server = new ContractServer();
  const url = await server.start();
  for (let i = 0; i < 12; i++) server.write(`r${i}`, i % 3 ? "ada" : "bob", { n: i, done: i % 2 === 0 });
  const client = new HighwaterClient({ url, token: "t" });
  try {
    const todos = createCollection(
      highwaterCollectionOptions({
        client,
        scope: { resourceType: "todos", conditions: { owner: "ada" } },
        getKey: (row) => row.id,
      }),
    );
    await todos.preload();
    assert.equal(todos.status, "ready");
    const ada = server.scopeRows("ada");
    assert.deepEqual(sortedIds(todos), ada.map((row) => row.id).sort());
    // The row's columns (TanStack DB adds its own `$` fields beside them).
    const { id, owner, n, done: isDone } = todos.get("r1");
    assert.deepEqual({ id, owner, n, done: isDone }, ada.find((row) => row.id === "r1"));
    assert.equal(todos.utils.error(), null);

    // A live query over the collection follows the scope.
    const done = createLiveQueryCollection((q) =>
      q.from({ todo: todos }).where(({ todo }) => eq(todo.done, true)),
    );
    await done.preload();
    const doneIds = () => server.scopeRows("ada").filter((row) => row.done).map((row) => row.id).sort();
    assert.deepEqual(sortedIds(done), doneIds());

    const batches = [];
    // With the initial state first (a subscriber is told of rows it has seen), then dropped.
    todos.subscribeChanges((changes) => batches.push(changes.map((c) => `${c.type}:${c.key}`).sort()), {
      includeInitialState: true,
    });
    assert.equal(batches.length, 1);
    batches.length = 0;
    server.write("r1", "ada", { n: 100, done: true }); // an update into the live query
    server.write("r2", "bob", {}); // leaves the scope
    server.write("x", "ada", { n: 5, done: true }); // arrives
    await until(() => todos.get("r1")?.n === 100 && !todos.has("r2") && todos.has("x"), "the live changes");
    await until(() => JSON.stringify(sortedIds(done)) === JSON.stringify(doneIds()), "the live query");
    assert.deepEqual(sortedIds(todos), server.scopeRows("ada").map((row) => row.id).sort());
    assert.deepEqual(batches, [["update:r1"], ["delete:r2"], ["insert:x"]], "one batch per server transaction");

    await done.cleanup();
    await todos.cleanup();
    await until(() => [...server.sockets].every((ws) => ws.subs.size === 0), "the unsubscribe");
  } finally {
    await client.close();
    await server.stop();
  }
});

test("a scope the server refuses fails the collection's preload with its code", async () => {
  const server = new ContractServer();
  const url = await server.start();
  server.refuse.set("ada", "forbidden");
  const client = new HighwaterClient({ url, token: "t" });
  try {
    const todos = createCollection(
      highwaterCollectionOptions({ client, scope: { resourceType: "todos", conditions: { owner: "ada" } }, getKey: (row) => row.id }),
    );
    await assert.rejects(todos.preload(), (error) => error.code === "forbidden");
    assert.equal(todos.status, "error");
  } finally {
    await client.close();
    await server.stop();
  }
});

test("writes on the collection go through client.mutate: persisted once the synced row is in, a refused one rolled back", async () => {
  const server = new ContractServer();
  const url = await server.start();
  server.write("a", "ada", { n: 1 });
  const client = new HighwaterClient({ url, token: "t" });
  try {
    const todos = createCollection(
      highwaterCollectionOptions({ client, scope: { resourceType: "todos", conditions: { owner: "ada" } }, getKey: (row) => row.id }),
    );
    await todos.preload();
    const inserted = todos.insert({ id: "b", owner: "ada", n: 2 });
    assert.equal(todos.get("b")?.n, 2, "optimistic");
    await inserted.isPersisted.promise;
    assert.deepEqual(server.scopeRows("ada").map((r) => r.id).sort(), ["a", "b"]);
    const updated = todos.update("a", (draft) => {
      draft.n = 10;
    });
    await updated.isPersisted.promise;
    assert.equal(server.rows.get("a").data.n, 10);
    assert.equal(todos.get("a")?.n, 10);
    // Refused by the server: the transaction fails and the row comes back.
    server.forbid.add(3);
    const removed = todos.delete("a");
    await assert.rejects(removed.isPersisted.promise, (error) => error.code === "forbidden");
    await until(() => todos.has("a"), "the row back after the refusal");
    assert.equal(server.applied.length, 2);
    await todos.cleanup();
  } finally {
    await client.close();
    await server.stop();
  }
});
