// HighwaterClient end to end: the built package against a real `highwater serve --sync-rules`
// on a private Postgres, through a TCP proxy the tests sever. Needs the `highwater` binary
// (HIGHWATER_BIN, default <target>/debug/highwater) and a global WebSocket.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { HighwaterClient, MemoryStore } from "highwater";
import { Postgres, Proxy, Serve, TODOS_DDL, mintToken, normalise, sleep, until, scratch } from "./support.mjs";

let pg;
let serve;
let proxy;
let url;

before(async () => {
  pg = new Postgres();
  pg.query(TODOS_DDL);
  pg.query(
    "INSERT INTO todos (id, owner, title, done, secret_note) SELECT i, CASE WHEN i % 3 = 0 THEN 'grace' ELSE 'ada' END, 't' || i, i % 2 = 0, 'hidden' FROM generate_series(1, 60) AS i",
  );
  serve = new Serve(pg);
  await serve.start();
  proxy = new Proxy();
  url = await proxy.start(serve.port);
});

after(async () => {
  await proxy?.stop();
  await serve?.stop();
  pg?.stop();
});

/** Waits until the subscription's rows equal Postgres for `where`. */
async function converges(subscription, where, what) {
  let expected;
  await until(() => {
    expected = normalise(pg.rows(where));
    return JSON.stringify(normalise(subscription.rows())) === JSON.stringify(expected);
  }, what, 30_000).catch((error) => {
    assert.deepEqual(normalise(subscription.rows()), expected, error.message);
  });
}

/** Records per row the `v` of every insert/update event; fails on a repeat or a step back. */
function appliedOnce(subscription) {
  const seen = new Map();
  const problems = [];
  subscription.on("change", ({ inserted, updated }) => {
    for (const row of [...inserted, ...updated]) {
      const last = seen.get(row.id);
      if (last !== undefined && row.v <= last) problems.push(`row ${row.id}: v ${row.v} after ${last}`);
      seen.set(row.id, row.v);
    }
  });
  subscription.on("reset", () => seen.clear());
  return problems;
}

test("three scopes on one socket: a fresh subscribe equals Postgres; omitted columns never arrive", async () => {
  const connections = proxy.connections;
  const client = new HighwaterClient({ url, token: () => serve.token("ada") });
  const all = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
  const done = client.subscribe({ resourceType: "todos", conditions: { owner: "ada", done: true } });
  const open = client.subscribe({ resourceType: "todos", conditions: { owner: "ada", done: false } });
  await Promise.all([all.ready, done.ready, open.ready]);
  assert.deepEqual(normalise(all.rows()), normalise(pg.rows("owner = 'ada'")));
  assert.deepEqual(normalise(done.rows()), normalise(pg.rows("owner = 'ada' AND done")));
  assert.deepEqual(normalise(open.rows()), normalise(pg.rows("owner = 'ada' AND NOT done")));
  assert.equal(all.rows().length, 40);
  assert.ok(all.rows().every((row) => !("secret_note" in row)));
  assert.equal(all.replayedOnLastResume, 40);
  assert.ok(all.cursor && typeof all.cursor.id === "string");
  assert.equal(proxy.connections - connections, 1, "one socket for every scope");
  pg.query("UPDATE todos SET done = NOT done WHERE id = 1");
  await converges(done, "owner = 'ada' AND done", "a row moving between the done scopes");
  await converges(open, "owner = 'ada' AND NOT done", "a row moving between the done scopes");
  await client.close();
});

test("conditions with operators: the scope equals the same WHERE in Postgres, live too; a malformed one throws", async () => {
  const client = new HighwaterClient({ url, token: () => serve.token("ada") });
  const open = client.subscribe({ resourceType: "todos", conditions: { owner: { eq: "ada" }, done: { ne: true } } });
  const either = client.subscribe({ resourceType: "todos", conditions: { owner: "ada", done: [true, false] } });
  await Promise.all([open.ready, either.ready]);
  assert.deepEqual(normalise(open.rows()), normalise(pg.rows("owner = 'ada' AND done <> true")));
  assert.deepEqual(normalise(either.rows()), normalise(pg.rows("owner = 'ada'")));
  pg.query("UPDATE todos SET done = NOT done WHERE id IN (1, 2)");
  await converges(open, "owner = 'ada' AND done <> true", "rows moving in and out of done <> true");
  assert.throws(
    () => client.subscribe({ resourceType: "todos", conditions: { done: { like: "t%" } } }),
    (error) => error.code === "HW_INVALID_SCOPE" && /unknown operator "like"/.test(error.message),
  );
  // Another user's rows stay out of reach whatever the operator: the owner must equal the token's.
  const theirs = client.subscribe({ resourceType: "todos", conditions: { owner: { ne: "ada" } } });
  await assert.rejects(theirs.ready, (error) => error.code === "forbidden");
  await client.close();
});

test("an unauthorized scope is refused with its code while the other scopes go on", async () => {
  const client = new HighwaterClient({ url, token: () => serve.token("ada") });
  const mine = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
  const theirs = client.subscribe({ resourceType: "todos", conditions: { owner: "grace" } });
  const errors = [];
  theirs.on("error", (e) => errors.push(e.code));
  await assert.rejects(theirs.ready, (error) => error.code === "forbidden");
  await mine.ready;
  pg.query("INSERT INTO todos (id, owner, title) VALUES (1000, 'ada', 'after the refusal')");
  await converges(mine, "owner = 'ada'", "the live row after another scope was refused");
  assert.deepEqual(theirs.rows(), []);
  assert.deepEqual(errors, ["forbidden"]);
  pg.query("DELETE FROM todos WHERE id = 1000");
  await converges(mine, "owner = 'ada'", "the delete");
  await client.close();
});

test("the TCP connection severed during 1,000 writes: reconnect, equal, each change applied once", async (t) => {
  const store = new MemoryStore();
  const tokens = [];
  const client = new HighwaterClient({ url, store, token: () => (tokens.push(1), serve.token("ada")) });
  const ada = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
  const grace = new HighwaterClient({ url, token: () => serve.token("grace") });
  const theirs = grace.subscribe({ resourceType: "todos", conditions: { owner: "grace" } });
  t.after(() => Promise.all([client.close(), grace.close()]));
  await Promise.all([ada.ready, theirs.ready]);
  const problems = [...[ada, theirs].map(appliedOnce)];
  const connections = proxy.connections;
  // What each client went through, for the failure message if they do not come back.
  const history = [];
  const started = Date.now();
  for (const [name, c] of [["ada", client], ["grace", grace]]) {
    c.on("status", (s) => history.push(`${Date.now() - started} ms ${name}: ${s.state}${s.reason ? ` (${s.reason})` : ""}`));
  }
  const reconnected = () =>
    until(() => proxy.open === 2, "both clients to reconnect").catch((error) => {
      throw new Error(`${error.message}; open TCP pairs: ${proxy.open}; statuses:\n${history.join("\n")}`);
    });
  // Inserts, updates, owner changes (rows moving between the two scopes) and deletes.
  const statements = [];
  for (let i = 0; i < 1000; i++) {
    const id = 2000 + (i % 50);
    const owner = i % 3 === 0 ? "grace" : "ada";
    const v = i + 1;
    statements.push(
      [
        `INSERT INTO todos (id, owner, title, v) VALUES (${id}, '${owner}', 't${i}', ${v}) ON CONFLICT (id) DO UPDATE SET title = excluded.title, v = excluded.v;`,
        `UPDATE todos SET owner = CASE owner WHEN 'ada' THEN 'grace' ELSE 'ada' END, v = ${v} WHERE id = ${id};`,
        `UPDATE todos SET done = NOT done, v = ${v}, secret_note = 's${i}' WHERE id = ${id};`,
        `DELETE FROM todos WHERE id = ${id};`,
      ][i % 4],
    );
  }
  // Ten batches of a hundred transactions; every other batch has both connections reset
  // while its writes are in flight.
  let severed = 0;
  for (let batch = 0; batch < 10; batch++) {
    if (batch % 2 === 0) await reconnected();
    const writing = pg.script(statements.slice(batch * 100, batch * 100 + 100).join("\n"));
    if (batch % 2 === 0) {
      await sleep(20);
      proxy.sever();
      severed += 1;
    }
    await writing;
  }
  await converges(ada, "owner = 'ada'", "ada's rows after the cuts");
  await converges(theirs, "owner = 'grace'", "grace's rows after the cuts");
  assert.ok(proxy.connections - connections >= 2 * severed, `each cut was followed by reconnects`);
  assert.deepEqual(problems.flat(), []);
  assert.equal(tokens.length, 1 + severed, "the token source runs on every connect");
});

test("the server killed with -9 and restarted: the client reconnects and ends equal", async () => {
  const client = new HighwaterClient({ url, token: () => serve.token("ada") });
  const ada = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
  await ada.ready;
  const problems = appliedOnce(ada);
  await serve.kill9();
  pg.query("INSERT INTO todos (id, owner, title, v) VALUES (3000, 'ada', 'while down', 1)");
  pg.query("DELETE FROM todos WHERE id = 2");
  await until(() => client.status.state === "reconnecting", "the client to notice");
  await serve.start(serve.data);
  await converges(ada, "owner = 'ada'", "equality after the restart");
  assert.equal(client.status.state, "open");
  assert.deepEqual(problems, []);
  await client.close();
});

test("a token that expires mid-session: the token source is called again and sync goes on", async () => {
  const handed = [];
  const client = new HighwaterClient({
    url,
    // The first token is valid for about three more seconds (the server allows 30 s of skew).
    token: async () => {
      handed.push(handed.length === 0 ? "short" : "long");
      return handed.length === 1 ? mintToken("ada", -27_000) : serve.token("ada");
    },
  });
  const ada = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
  await ada.ready;
  const errors = [];
  ada.on("error", (e) => errors.push(e.code));
  await until(() => handed.length >= 2, "the token source to be called again", 15_000);
  await sleep(300);
  pg.query("INSERT INTO todos (id, owner, title) VALUES (4000, 'ada', 'after the refresh')");
  await converges(ada, "owner = 'ada'", "a live row after the token refresh");
  assert.deepEqual(errors, []);
  assert.equal(handed.length, 2);
  await client.close();
});

test("a resync (new data directory, new epoch) gives a reset, then equality", async () => {
  const store = new MemoryStore();
  const client = new HighwaterClient({ url, store, token: () => serve.token("ada") });
  const ada = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
  await ada.ready;
  const before = ada.cursor;
  let resets = 0;
  ada.on("reset", () => resets++);
  // The page is never emptied: rows stay through the reset, and only the row that is gone
  // is ever removed.
  const removed = [];
  let fewest = ada.rows().length;
  ada.on("change", (change) => {
    removed.push(...change.removed.map((row) => Number(row.id)));
    fewest = Math.min(fewest, ada.rows().length);
  });
  await serve.kill9();
  pg.query("DELETE FROM todos WHERE id = 4");
  await serve.start(scratch("data-resynced"));
  await until(() => resets === 1, "the reset", 30_000);
  await converges(ada, "owner = 'ada'", "equality after the reset");
  assert.notEqual(ada.cursor.id.split(":")[0], before.id.split(":")[0], "the cursor moved to the new epoch");
  assert.deepEqual(removed, [4], "only the deleted row left the page");
  assert.ok(fewest >= ada.rows().length, `the page went down to ${fewest} rows`);
  await client.close();
});

test("the server down for 2 s: a Node client connected straight to it is ready again within its backoff", async (t) => {
  // No proxy in between: while the server is down, connects are refused, and Node's WebSocket
  // fires `error` without ever firing `close` for them.
  const client = new HighwaterClient({ url: `ws://127.0.0.1:${serve.port}/sync`, token: () => serve.token("ada") });
  t.after(() => client.close());
  const ada = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
  await ada.ready;
  const reasons = [];
  client.on("status", (s) => reasons.push(`${s.state}${s.reason ? ` (${s.reason})` : ""}`));
  let readyAt = null;
  ada.on("ready", () => (readyAt ??= Date.now()));
  await serve.kill9();
  await until(() => client.status.state === "reconnecting", "the client to notice");
  await sleep(2_000);
  await serve.start(serve.data);
  const upAt = Date.now();
  await until(() => readyAt !== null, "the scope to be ready again", 30_000);
  // Refused connects are failed attempts at once: none waits out the 10 s connect timeout.
  assert.ok(!reasons.some((r) => r.includes("did not open in time")), reasons.join("\n"));
  assert.ok(reasons.some((r) => r.includes("could not connect")), reasons.join("\n"));
  // The backoff window after the few refused attempts of a 2-3 s outage is at most 8 s.
  assert.ok(readyAt - upAt < 8_000, `ready ${readyAt - upAt} ms after the server answered; ${reasons.join("\n")}`);
});

test("a Node app writes through client.mutate, offline and across a restart: each applied once, read-your-writes", async () => {
  const store = new MemoryStore();
  const token = serve.token("ada");
  const first = new HighwaterClient({ url, token, store });
  const todos = first.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
  await todos.ready;
  first.goOffline();
  const made = [];
  for (let i = 0; i < 20; i++) made.push(first.mutate("todos", "insert", { id: 5000 + i, owner: "ada", title: `offline ${i}` }));
  made.push(first.mutate("todos", "update", { id: 5000, title: "offline 0, renamed" }));
  made.push(first.mutate("todos", "delete", { id: 5019 }));
  await Promise.all(made.map((m) => m.stored));
  assert.equal(todos.rows().filter((r) => Number(r.id) >= 5000).length, 19, "shown while offline");
  await first.close();
  assert.equal(pg.query("SELECT count(*) FROM todos WHERE id >= 5000"), "0");

  // The app starts again on the same store and comes online.
  // Started offline, so the restored outbox can be looked at before it drains.
  const second = new HighwaterClient({ url, token, store });
  second.goOffline();
  const again = second.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
  await until(() => second.pendingCount === 22 && again.rows().filter((r) => Number(r.id) >= 5000).length === 19, "the 22 stored mutations, shown");
  second.goOnline();
  const extra = second.mutate("todos", "update", { id: 5001, v: 7 });
  await extra.confirmed;
  // Read-your-writes: when `confirmed` resolves, the row is in the rows as Postgres has it.
  assert.equal(again.rows().find((r) => Number(r.id) === 5001).v, 7);
  await until(() => second.pendingCount === 0, "the outbox to drain");
  assert.equal(pg.query("SELECT count(*) FROM todos WHERE id >= 5000"), "19");
  assert.equal(pg.query("SELECT title FROM todos WHERE id = 5000"), "offline 0, renamed");
  await converges(again, "owner = 'ada'", "ada's scope equal to Postgres after the writes");
  // Refused by the rules: another user's row, a column the rules do not let an update set.
  const rejected = [];
  second.on("rejected", (event) => rejected.push(event.code));
  const grace = second.mutate("todos", "delete", { id: 3 });
  await assert.rejects(grace.confirmed, (error) => error.code === "forbidden");
  const secret = second.mutate("todos", "update", { id: 1, secret_note: "mine now" });
  await assert.rejects(secret.confirmed, (error) => error.code === "forbidden");
  assert.deepEqual(rejected, ["forbidden", "forbidden"]);
  assert.equal(pg.query("SELECT count(*) FROM todos WHERE id = 3"), "1");
  assert.equal(pg.query("SELECT secret_note FROM todos WHERE id = 1"), "hidden");
  await second.close();
});

test("with upload, a Node backend applies batches with highwater.confirm: once, even when its answer is lost", async () => {
  const token = serve.token("ada");
  let uploads = 0;
  const client = new HighwaterClient({
    url,
    token,
    upload: async (mutations, clientId) => {
      uploads += 1;
      for (const m of mutations) {
        // The app's own transaction: its write and highwater.confirm together. HW409: this
        // mutation was applied before (an upload sent again after a lost answer).
        try {
          pg.query(
            `BEGIN; SELECT highwater.confirm('${clientId}', ${m.id}); INSERT INTO todos (id, owner, title) VALUES (${m.row.id}, 'ada', '${m.row.title}'); COMMIT;`,
          );
        } catch (error) {
          if (!String(error.stderr ?? error.message).includes("was applied already")) throw error;
        }
      }
      // The first answer is lost after the backend committed: the client uploads again.
      if (uploads === 1) throw new Error("the connection to the backend dropped");
    },
  });
  const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
  await todos.ready;
  const made = [0, 1, 2].map((i) => client.mutate("todos", "insert", { id: 6000 + i, owner: "ada", title: `uploaded ${i}` }));
  await Promise.all(made.map((m) => m.confirmed));
  assert.ok(uploads >= 2, `uploads: ${uploads}`);
  assert.equal(pg.query("SELECT count(*) FROM todos WHERE id BETWEEN 6000 AND 6002"), "3");
  // Read-your-writes holds for writes the app applied too.
  assert.deepEqual(todos.rows().filter((r) => Number(r.id) >= 6000).map((r) => r.title).sort(), ["uploaded 0", "uploaded 1", "uploaded 2"]);
  assert.equal(client.pendingCount, 0);
  await client.close();
});

test("two clients update one row with ifVersion: one wins, the other gets conflict with the row as it is, and its overlay goes", async () => {
  const token = serve.token("ada");
  const [a, b] = [new HighwaterClient({ url, token }), new HighwaterClient({ url, token })];
  const [subA, subB] = [a, b].map((client) => client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } }));
  await Promise.all([subA.ready, subB.ready]);
  const version = subA.version("1");
  assert.equal(typeof version, "number");
  assert.equal(subB.version("1"), version, "both hold the same version");
  const first = a.mutate("todos", "update", { id: 1, title: "a wins" }, { ifVersion: version });
  await first.confirmed;
  // b still holds the old version: its compare-and-set fails, its overlay is taken back.
  await until(() => subB.version("1") !== version, "b to see a's change");
  const stale = b.mutate("todos", "update", { id: 1, title: "b loses" }, { ifVersion: version });
  assert.equal(subB.rows().find((r) => Number(r.id) === 1).title, "b loses", "shown at once");
  await assert.rejects(stale.confirmed, (error) => error.code === "conflict" && error.row?.title === "a wins" && !("secret_note" in error.row));
  assert.equal(subB.rows().find((r) => Number(r.id) === 1).title, "a wins");
  assert.equal(pg.query("SELECT title FROM todos WHERE id = 1"), "a wins");
  await Promise.all([a.close(), b.close()]);
});
