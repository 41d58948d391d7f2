// HighwaterClient against a scripted contract server: the WebAssembly core's socket, timer and
// token handling, handles, events and stores. Needs a global WebSocket (Node 22+, or Node 20
// with --experimental-websocket).
import assert from "node:assert/strict";
import { test } from "node:test";
import { HighwaterClient, MemoryStore } from "highwater";
import { ContractServer, byId, until } from "./support/contract-server.mjs";

async function withServer(fn) {
  const server = new ContractServer();
  const url = await server.start();
  try {
    await fn(server, url);
  } finally {
    await server.stop();
  }
}

test("a fresh subscribe equals the server and live changes arrive one event per transaction", () =>
  withServer(async (server, url) => {
    for (let i = 0; i < 250; i++) server.write(`r${i}`, i % 2 ? "ada" : "bob", { n: i });
    const client = new HighwaterClient({ url, token: "t" });
    const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    const progress = [];
    todos.on("progress", (p) => progress.push(p));
    await todos.ready;
    assert.deepEqual(byId(todos.rows()), byId(server.scopeRows("ada")));
    assert.equal(todos.rows().length, 125);
    assert.deepEqual(progress.at(-1), { done: 125, total: 125 });
    assert.equal(todos.replayedOnLastResume, 125);
    assert.equal(typeof todos.cursor.serverSequence, "number");
    assert.equal(client.status.state, "open");
    assert.equal(server.subscribes[0].authenticationToken, "t");

    const changes = [];
    todos.on("change", (c) => changes.push(c));
    server.write("r1", "ada", { n: 1000 });
    server.write("new", "ada", {});
    server.write("r3", "bob", {});
    server.write("r5", null);
    await until(() => changes.length === 4, "four change events");
    assert.deepEqual(changes.map((c) => [c.inserted.length, c.updated.length, c.removed.length]), [
      [0, 1, 0],
      [1, 0, 0],
      [0, 0, 1],
      [0, 0, 1],
    ]);
    assert.deepEqual(byId(todos.rows()), byId(server.scopeRows("ada")));
    await client.close();
    assert.equal(client.status.state, "closed");
  }));

test("rows() is the same array until a change, and an unchanged row is the same object after one", () =>
  withServer(async (server, url) => {
    for (let i = 0; i < 20; i++) server.write(`r${i}`, "ada", { n: i });
    const client = new HighwaterClient({ url, token: "t" });
    try {
      const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
      await todos.ready;
      const before = todos.rows();
      assert.equal(todos.rows(), before, "no change: the same array");
      const changes = [];
      todos.on("change", (c) => changes.push(c));
      server.write("r3", "ada", { n: 300 });
      await until(() => changes.length === 1, "the change");
      const after = todos.rows();
      assert.notEqual(after, before, "a new array after a change");
      const byKey = (rows) => new Map(rows.map((row) => [row.id, row]));
      const [old, now] = [byKey(before), byKey(after)];
      for (const [id, row] of now) {
        if (id === "r3") assert.notEqual(row, old.get(id), "the changed row is a new object");
        else assert.equal(row, old.get(id), `row ${id} kept its identity`);
      }
      // The event hands out the very objects rows() holds.
      assert.equal(changes[0].updated[0], now.get("r3"));
    } finally {
      await client.close();
    }
  }));

test("change events carry rows for as long as any listener is left, also one added after others left", () =>
  withServer(async (server, url) => {
    const client = new HighwaterClient({ url, token: "t" });
    try {
      const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
      const first = [];
      const second = [];
      const stopFirst = todos.on("change", (c) => first.push(c));
      const onSecond = (c) => second.push(c);
      todos.on("change", onSecond);
      await todos.ready;
      server.write("a", "ada", { n: 1 });
      await until(() => second.length === 1, "the first change");
      stopFirst();
      server.write("b", "ada", { n: 2 });
      await until(() => second.length === 2, "the second change");
      assert.equal(first.length, 1);
      assert.deepEqual(second.map((c) => c.inserted.map((row) => row.id)), [["a"], ["b"]]);
      todos.off("change", onSecond);
      server.write("c", "ada", { n: 3 });
      await until(() => todos.rows().length === 3, "the unwatched change applied");
      const third = [];
      todos.on("change", (c) => third.push(c));
      server.write("c", "ada", { n: 4 });
      await until(() => third.length === 1, "the change after a listener came back");
      assert.deepEqual(third[0].updated, [{ id: "c", owner: "ada", n: 4 }]);
      assert.equal(second.length, 2);
    } finally {
      // Also when an assertion failed: an open client would keep the test process alive.
      await client.close();
    }
  }));

test("a killed connection reconnects, resumes from the cursor and applies each change once", () =>
  withServer(async (server, url) => {
    const tokens = [];
    const client = new HighwaterClient({ url, token: async () => `t${tokens.push(1)}` });
    const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await todos.ready;
    const seen = new Map();
    todos.on("change", (c) => {
      for (const row of [...c.inserted, ...c.updated]) {
        assert.ok((seen.get(row.id) ?? -1) < row.v, `row ${row.id} version ${row.v} applied twice or out of order`);
        seen.set(row.id, row.v);
      }
    });
    for (let v = 0; v < 300; v++) {
      server.write(`r${v % 40}`, v % 7 === 0 ? "bob" : "ada", { v });
      if (v % 100 === 50) server.cut();
      if (v % 10 === 0) await new Promise((resolve) => setTimeout(resolve, 5));
    }
    await until(() => client.status.state === "open" && server.sockets.size === 1, "the reconnect");
    await until(
      () => JSON.stringify(byId(todos.rows())) === JSON.stringify(byId(server.scopeRows("ada"))),
      "equality after reconnects",
    );
    assert.ok(server.connections >= 2);
    assert.ok(tokens.length >= server.connections, "the token source runs on every connect");
    const resumed = server.subscribes.slice(1);
    assert.ok(resumed.every((p) => typeof p.afterServerSequence === "number"), "every resume names the cursor");
    await client.close();
  }));

test("an expired token is replaced once; a refused scope fails with its code and the others go on", () =>
  withServer(async (server, url) => {
    server.write("a1", "ada");
    server.write("b1", "bob");
    server.refuse.set("eve", "forbidden");
    server.expired.add("old");
    const handed = [];
    const client = new HighwaterClient({ url, token: () => (handed.push(handed.length ? "new" : "old"), handed.at(-1)) });
    const ada = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    const bob = client.subscribe({ resourceType: "todos", conditions: { owner: "bob" } });
    const eve = client.subscribe({ resourceType: "todos", conditions: { owner: "eve" } });
    await assert.rejects(eve.ready, (error) => error.code === "forbidden" && error.name === "HighwaterScopeError");
    await Promise.all([ada.ready, bob.ready]);
    assert.deepEqual(handed, ["old", "new"]);
    assert.equal(server.connections, 1, "three scopes, one socket, no reconnect for the token");
    assert.deepEqual(ada.rows().map((r) => r.id), ["a1"]);
    assert.deepEqual(bob.rows().map((r) => r.id), ["b1"]);
    // Expired again: reported once, no loop.
    server.expired.add("new");
    const errors = [];
    const mallory = client.subscribe({ resourceType: "todos", conditions: { owner: "ada", x: 1 } });
    mallory.on("error", (e) => errors.push(e.code));
    await assert.rejects(mallory.ready, (error) => error.code === "auth-expired");
    await new Promise((resolve) => setTimeout(resolve, 200));
    assert.deepEqual(errors, ["auth-expired"]);
    assert.equal(handed.length, 3);
    await client.close();
  }));

/** An unsigned JWT-shaped token: the client reads its `iat` and `exp`, the server here none. */
function jwt(claims) {
  const part = (value) => Buffer.from(JSON.stringify(value)).toString("base64url");
  return `${part({ alg: "HS256" })}.${part(claims)}.sig`;
}

test("a token is renewed halfway through a short life: the scope is subscribed again with it, on the same socket", () =>
  withServer(async (server, url) => {
    server.write("a1", "ada");
    const handed = [];
    const now = Math.floor(Date.now() / 1000);
    const client = new HighwaterClient({
      url,
      token: () => (handed.push(jwt({ sub: "ada", n: handed.length, iat: now, exp: now + 4 })), handed.at(-1)),
    });
    const ada = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await ada.ready;
    assert.equal(server.subscribes.at(-1).authenticationToken, handed[0]);
    // A 4 s token is renewed after 2 s, before any expiry.
    await until(() => server.subscribes.at(-1).authenticationToken === handed[1], "the renewed subscribe", 5_000);
    assert.equal(server.connections, 1, "renewed on the same socket");
    server.write("a2", "ada");
    await until(() => ada.rows().length === 2, "a row after the renewal");
    assert.equal(client.status.state, "open");
    await client.close();
  }));

test("a resync gives a reset, then rows equal the server again", () =>
  withServer(async (server, url) => {
    for (let i = 0; i < 20; i++) server.write(`r${i}`, "ada", { i });
    const client = new HighwaterClient({ url });
    const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await todos.ready;
    let resets = 0;
    todos.on("reset", () => resets++);
    server.write("r0", null);
    server.resync();
    server.write("late", "ada");
    await until(() => resets === 1, "the reset");
    await until(
      () => JSON.stringify(byId(todos.rows())) === JSON.stringify(byId(server.scopeRows("ada"))),
      "equality after the reset",
    );
    assert.ok(todos.cursor.id.startsWith("2:"));
    await client.close();
  }));

test("a new client shows stored rows before its socket opens and resumes from the stored cursor", () =>
  withServer(async (server, url) => {
    for (let i = 0; i < 30; i++) server.write(`r${i}`, "ada", { i });
    const store = new MemoryStore();
    const first = new HighwaterClient({ url, store });
    const todos = first.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await todos.ready;
    await first.close();
    server.write("r31", "ada");
    const second = new HighwaterClient({ url, store });
    const again = second.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    const shown = [];
    again.on("change", (c) => shown.push([second.status.state, c.inserted.length]));
    await again.ready;
    assert.deepEqual(shown[0], ["connecting", 30], "stored rows first, before the socket opened");
    assert.equal(again.replayedOnLastResume, 1, "only the newer row is replayed");
    assert.equal(again.rows().length, 31);
    await second.close();
  }));

test("goOffline closes the socket and goOnline reconnects at once", () =>
  withServer(async (server, url) => {
    const client = new HighwaterClient({ url });
    const states = [];
    client.on("status", (s) => states.push(s.state));
    const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await todos.ready;
    client.goOffline();
    await until(() => server.sockets.size === 0, "the socket to close");
    server.write("while-offline", "ada");
    client.goOnline();
    await until(() => todos.rows().length === 1, "the row written while offline");
    assert.deepEqual(states, ["open", "offline", "reconnecting", "open"]);
    await client.close();
  }));

test("row values cross exactly: integers beyond 2^53 as bigint, a __proto__ column as an own key", () =>
  withServer(async (server, url) => {
    server.write("plain", "ada", { n: 1.5, big: 1 });
    const client = new HighwaterClient({ url });
    const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await todos.ready;
    const raw = '{"type":"channel-message","subscriptionId":"SUB","body":{"echoOrigin":null,"syncs":[{"id":"1:9","resourceType":"todos","resourceId":"big","serverSequence":9,"syncType":"update","updatedAt":"2026-12-01T12:00:00.000Z","data":{"id":"big","owner":"ada","big":12345678901234567890,"__proto__":{"x":1}}}]}}';
    const [socket] = server.sockets;
    const [sub] = socket.subs.keys();
    const changes = [];
    todos.on("change", (c) => changes.push(c));
    socket.send(raw.replace("SUB", sub));
    // Without a wide integer the event takes the JSON.parse path: the same values.
    socket.send(raw.replace("SUB", sub).replace('"big","owner"', '"proto","owner"').replace('"resourceId":"big"', '"resourceId":"proto"').replace("12345678901234567890", "7").replace('"1:9"', '"1:10"').replace('"serverSequence":9', '"serverSequence":10'));
    await until(() => changes.length === 2, "the changes");
    const proto = todos.rows().find((row) => row.id === "proto");
    assert.ok(Object.hasOwn(proto, "__proto__"));
    assert.equal(Object.getPrototypeOf(proto), Object.prototype);
    assert.deepEqual(proto.__proto__, { x: 1 });
    const big = todos.rows().find((row) => row.id === "big");
    assert.equal(big.big, 12345678901234567890n);
    assert.ok(Object.hasOwn(big, "__proto__"));
    assert.equal(Object.getPrototypeOf(big), Object.prototype);
    assert.equal(changes[0].inserted[0].big, 12345678901234567890n);
    assert.equal(todos.rows().find((row) => row.id === "plain").n, 1.5);
    await client.close();
  }));

/**
 * A client live on one scope, and the first time it gave up its socket (`at`, `reason`),
 * from status events, not polls of `client.status`: with a short backoff the client can be
 * reconnecting and open again between two polls.
 */
async function liveClientWatchingGiveUp(url) {
  const client = new HighwaterClient({ url });
  const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
  await todos.ready;
  const gaveUp = {};
  client.on("status", (s) => {
    if (s.state === "reconnecting" && gaveUp.at === undefined) Object.assign(gaveUp, { at: Date.now(), reason: s.reason });
  });
  return { client, todos, gaveUp };
}

test("a half-open socket is found by the heartbeat within 10 s and replaced", () =>
  withServer(async (server, url) => {
    const { client, todos, gaveUp } = await liveClientWatchingGiveUp(url);
    server.freeze();
    const frozenAt = Date.now();
    await until(() => gaveUp.at !== undefined, "the heartbeat to give up", 12_000);
    const noticed = gaveUp.at - frozenAt;
    assert.ok(noticed <= 10_000, `noticed after ${noticed} ms`);
    assert.match(gaveUp.reason, /silent/);
    await until(() => client.status.state === "open" && server.connections === 2, "the new socket");
    server.write("after", "ada");
    await until(() => todos.rows().length === 1, "a row on the new socket");
    await client.close();
  }));

test("a page shown again probes its socket: a half-open one is replaced within the probe's 3 s", () =>
  withServer(async (server, url) => {
    // A browser's page and document, as far as the client listens to them.
    const page = new EventTarget();
    const doc = Object.assign(new EventTarget(), { visibilityState: "visible" });
    const saved = Object.getOwnPropertyDescriptors(globalThis);
    globalThis.addEventListener = page.addEventListener.bind(page);
    globalThis.removeEventListener = page.removeEventListener.bind(page);
    globalThis.document = doc;
    try {
      const { client, gaveUp } = await liveClientWatchingGiveUp(url);
      server.freeze();
      const shownAt = Date.now();
      doc.dispatchEvent(new Event("visibilitychange"));
      await until(() => gaveUp.at !== undefined, "the probe to give up", 8_000);
      assert.match(gaveUp.reason, /after the client woke/);
      assert.ok(gaveUp.at - shownAt <= 5_000, `gave up after ${gaveUp.at - shownAt} ms`);
      await until(() => client.status.state === "open" && server.connections === 2, "the new socket");
      // Restored from the back/forward cache on a live socket: probed, answered, kept.
      const pings = server.pings;
      page.dispatchEvent(Object.assign(new Event("pageshow"), { persisted: true }));
      await until(() => server.pings > pings, "the probe's ping", 1_000);
      await new Promise((resolve) => setTimeout(resolve, 3_500));
      assert.equal(server.connections, 2);
      assert.equal(client.status.state, "open");
      await client.close();
    } finally {
      for (const name of ["addEventListener", "removeEventListener", "document"]) {
        if (saved[name]) Object.defineProperty(globalThis, name, saved[name]);
        else delete globalThis[name];
      }
    }
  }));

test("malformed scopes are refused with a code, never an unhandled rejection", () =>
  withServer(async (server, url) => {
    const client = new HighwaterClient({ url });
    assert.throws(
      () => client.subscribe({ resourceType: "todos", conditions: { owner: { nested: 1 } } }),
      (error) => error.code === "HW_INVALID_SCOPE",
    );
    const blank = client.subscribe({ resourceType: " ", conditions: {} });
    await assert.rejects(blank.ready, (error) => error.code === "HW_INVALID_SCOPE");
    const fine = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await fine.ready;
    await client.close();
  }));

test("shareTabs without Web Locks keeps a socket of its own and says so in status", () =>
  withServer(async (server, url) => {
    server.write("r1", "ada", { n: 1 });
    const client = new HighwaterClient({ url, token: "t", shareTabs: "my-app" });
    assert.equal(client.status.tabs, "unshared");
    const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await todos.ready;
    assert.deepEqual(byId(todos.rows()), byId(server.scopeRows("ada")));
    assert.deepEqual(client.status, { state: "open", tabs: "unshared" });
    await client.close();
  }));

test("a mutation shows at once, never leaves the rows, and is confirmed once its change is in them", () =>
  withServer(async (server, url) => {
    server.write("a", "ada", { title: "first" });
    const client = new HighwaterClient({ url });
    const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await todos.ready;
    const seen = [];
    todos.on("change", () => seen.push(new Set(todos.rows().map((r) => r.id))));
    const insert = client.mutate("todos", "insert", { id: "b", owner: "ada", title: "second" });
    // Shown before any answer.
    assert.deepEqual(new Set(todos.rows().map((r) => r.id)), new Set(["a", "b"]));
    const update = client.mutate("todos", "update", { id: "a", title: "edited" }, { ifVersion: todos.version("a") });
    assert.equal(todos.rows().find((r) => r.id === "a").title, "edited");
    await Promise.all([insert.confirmed, update.confirmed]);
    assert.ok(insert.id > 0 && update.id === insert.id + 1);
    // Read-your-writes: the server's rows are in `rows()` when `confirmed` resolves.
    assert.deepEqual(byId(todos.rows()), byId(server.scopeRows("ada")));
    assert.equal(todos.rows().find((r) => r.id === "a").title, "edited");
    // No change event ever dropped a row that was shown.
    for (const ids of seen) assert.ok(ids.has("a") && ids.has("b"), `a change dropped a row: ${[...ids]}`);
    assert.deepEqual(server.applied, [`${client.clientId}:1`, `${client.clientId}:2`]);
    assert.equal(client.pendingCount, 0);
    await client.close();
  }));

test("offline mutations survive a restart of the client and are applied once when it comes online", () =>
  withServer(async (server, url) => {
    const store = new MemoryStore();
    const first = new HighwaterClient({ url, store });
    const todos = first.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await todos.ready;
    first.goOffline();
    for (let i = 0; i < 50; i++) first.mutate("todos", "insert", { id: `o${i}`, owner: "ada", title: `offline ${i}` });
    assert.equal(todos.rows().length, 50);
    await first.close();
    assert.equal(server.applied.length, 0);

    // Started offline, so the restored outbox can be looked at before it drains.
    const second = new HighwaterClient({ url, store });
    second.goOffline();
    const again = second.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await until(() => second.pendingCount === 50 && again.rows().length === 50, "the 50 pending mutations shown again");
    second.goOnline();
    await until(() => second.pendingCount === 0, "the outbox to drain");
    assert.equal(new Set(server.applied).size, 50);
    assert.equal(server.applied.length, 50);
    assert.deepEqual(byId(again.rows()), byId(server.scopeRows("ada")));
    await second.close();
  }));

test("a rejected mutation is taken back and reported with its code", () =>
  withServer(async (server, url) => {
    server.write("a", "ada", { title: "kept" });
    const client = new HighwaterClient({ url });
    const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await todos.ready;
    await until(() => client.clientId !== null, "the outbox to load");
    server.forbid.add(1);
    const rejected = [];
    client.on("rejected", (event) => rejected.push(event));
    const doomed = client.mutate("todos", "delete", { id: "a" });
    assert.equal(todos.rows().length, 0);
    await assert.rejects(doomed.confirmed, (error) => error.name === "HighwaterMutationError" && error.code === "forbidden");
    assert.equal(todos.rows()[0].title, "kept");
    assert.equal(rejected[0].code, "forbidden");
    assert.deepEqual(rejected[0].mutation.row, { id: "a" });
    assert.throws(() => client.mutate("todos", "update", { title: "no key" }), (error) => error.code === "HW_INVALID_MUTATION");
    await client.close();
  }));

test("with upload, the app's backend applies the batch and the client awaits each confirm", () =>
  withServer(async (server, url) => {
    const batches = [];
    let failOnce = true;
    const client = new HighwaterClient({
      url,
      upload: async (mutations, clientId) => {
        batches.push(mutations.map((m) => m.id));
        if (failOnce) {
          failOnce = false;
          throw new Error("backend down");
        }
        for (const m of mutations) {
          if (m.row.title === "refuse me") continue;
          server.appApply(clientId, m.id, m.row);
        }
        return { rejected: mutations.filter((m) => m.row.title === "refuse me").map((m) => ({ id: m.id, code: "invalid", message: "no" })) };
      },
    });
    const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await todos.ready;
    const errors = [];
    client.on("error", (e) => errors.push(e.code));
    const kept = client.mutate("todos", "insert", { id: "u1", owner: "ada", title: "uploaded" });
    const refused = client.mutate("todos", "insert", { id: "u2", owner: "ada", title: "refuse me" });
    await kept.confirmed;
    await assert.rejects(refused.confirmed, (e) => e.code === "invalid");
    // The first upload (mutation 1, queued alone) failed and went again, first in the batch.
    assert.deepEqual(batches[0], [1]);
    assert.equal(batches[1][0], 1);
    assert.ok(errors.includes("upload-failed"));
    assert.deepEqual(server.applied, [`${client.clientId}:1`]);
    assert.deepEqual(todos.rows().map((r) => r.id), ["u1"]);
    await client.close();
  }));

test("an outbox the store cannot read is read again, never replaced by a fresh client id", () =>
  withServer(async (server, url) => {
    const store = new MemoryStore();
    await store.writeOutbox({ clientId: "kept", lastId: 4, put: [{ id: 4, table: "todos", op: "insert", row: { id: "k", owner: "ada" } }], remove: [] });
    let failures = 1;
    const load = store.loadOutbox.bind(store);
    store.loadOutbox = async () => {
      if (failures-- > 0) throw new Error("the disk is busy");
      return load();
    };
    const client = new HighwaterClient({ url, store });
    const errors = [];
    client.on("error", (problem) => errors.push(problem.code));
    const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    const later = client.mutate("todos", "insert", { id: "n", owner: "ada" });
    await later.confirmed;
    assert.deepEqual(errors, ["store-failed"]);
    assert.equal(client.clientId, "kept");
    assert.equal(later.id, 5, "numbered after the stored ones");
    assert.deepEqual(server.applied, ["kept:4", "kept:5"]);
    await until(() => todos.rows().length === 2, "both rows");
    await client.close();
  }));
