// `highwater/react` in a real React 19 tree (react-dom on a jsdom document, rendering on its own
// schedule as in a page, no act()) against the scripted contract server: live rows, status and
// readiness, and a re-render only for rows that changed.
import assert from "node:assert/strict";
import { test } from "node:test";
import { JSDOM } from "jsdom";
import { HighwaterClient } from "highwater";
import { useScope } from "highwater/react";
import { ContractServer, until } from "./support/contract-server.mjs";

const dom = new JSDOM('<!doctype html><div id="root"></div>');
globalThis.window = dom.window;
globalThis.document = dom.window.document;
// Node 21+ has a navigator of its own.
if (globalThis.navigator === undefined) globalThis.navigator = dom.window.navigator;
const React = await import("react");
const { createRoot } = await import("react-dom/client");
const { createElement: h, memo, useState } = React;

test("useScope renders live rows, and a change re-renders only the rows it changed", async () => {
  const server = new ContractServer();
  const url = await server.start();
  for (let i = 0; i < 20; i++) server.write(`r${i}`, i % 2 ? "ada" : "bob", { n: i });
  const client = new HighwaterClient({ url, token: "t" });
  const renders = new Map();
  const Item = memo(function Item({ row }) {
    renders.set(row.id, (renders.get(row.id) ?? 0) + 1);
    return h("li", { "data-id": row.id }, `${row.id}:${row.n}`);
  });
  let setOwner;
  let state;
  function App() {
    const [owner, set] = useState("ada");
    setOwner = set;
    // A new object literal every render: scopes are compared by value.
    state = useScope(client, { resourceType: "todos", conditions: { owner } });
    const sorted = [...state.rows].sort((a, b) => a.id.localeCompare(b.id));
    return h("ul", null, sorted.map((row) => h(Item, { key: row.id, row })));
  }
  const root = createRoot(document.getElementById("root"));
  const items = () => [...document.querySelectorAll("li")].map((li) => li.textContent).sort();
  const expected = (owner) => server.scopeRows(owner).map((row) => `${row.id}:${row.n}`).sort();
  /** Waits until the page shows `owner`'s rows as the server has them. */
  const shows = (owner, what) => until(() => JSON.stringify(items()) === JSON.stringify(expected(owner)), what);
  try {
    root.render(h(App));
    await shows("ada", "the scope's rows on the page");
    assert.equal(state.ready, true);
    assert.equal(state.status.state, "open");
    assert.equal(state.error, null);
    assert.equal(server.sockets.size, 1);
    const before = new Map(renders);

    // One row changes: only its item renders again.
    server.write("r3", "ada", { n: 300 });
    await shows("ada", "the change on the page");
    const again = [...renders].filter(([id, count]) => count !== before.get(id)).map(([id]) => id);
    assert.deepEqual(again, ["r3"], "only the changed row re-rendered");

    // A row leaves, another arrives.
    server.write("r5", "bob", {});
    server.write("new", "ada", { n: 7 });
    await shows("ada", "the move on the page");

    // A new scope: the old subscription ends, the new one's rows show, on the same socket.
    setOwner("bob");
    await shows("bob", "bob's scope on the page");
    assert.equal(state.ready, true);
    assert.equal(server.sockets.size, 1);

    // Unmounting unsubscribes: the server stops sending that scope.
    root.unmount();
    await until(() => [...server.sockets].every((ws) => ws.subs.size === 0), "the unsubscribe");
  } finally {
    await client.close();
    await server.stop();
  }
});
