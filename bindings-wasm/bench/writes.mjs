#!/usr/bin/env node
// Client writes benchmark: HighwaterClient's outbox against a real `highwater serve`.
//   node [--experimental-websocket] bench/writes.mjs [--json] URL TOKEN TABLE OWNER [mutations] [single] [firstId]
// (Node 22+: no flag.) `highwater-bench writes` runs it against its private Postgres and server
// (write rules on TABLE, scopes by `owner` = the token's `sub`) and reads the JSON `--json` prints.
// 1. Flush: a client with a MemoryStore, subscribed to OWNER's scope, goes offline, queues
//    `mutations` (10,000) inserts, goes online; timed from goOnline() until pendingCount is 0
//    (the `outbox` event). The client sends them as it always does: frames of 100, one in flight.
// 2. Latency: `single` (200) inserts one after the other, each from mutate() until its
//    `confirmed` resolves (the server answers once the change came back to the scope).
// Rows get ids from `firstId` on. `HIGHWATER_PACKAGE` names another build of the package (its
// `dist/node.js`).
const args = process.argv.slice(2);
const json = args[0] === "--json";
if (json) args.shift();
const [url, token, table, owner] = args;
if (owner === undefined) {
  console.error("usage: writes.mjs [--json] URL TOKEN TABLE OWNER [mutations] [single] [firstId]");
  process.exit(2);
}
const total = Number(args[4] ?? 10_000);
const single = Number(args[5] ?? 200);
let nextId = Number(args[6] ?? 1);

const { HighwaterClient, MemoryStore } = await import(process.env.HIGHWATER_PACKAGE ?? "highwater");

/** Resolves once `event` fires with a value `test` accepts. */
const when = (emitter, event, test) =>
  new Promise((resolve) => {
    const off = emitter.on(event, (value) => {
      if (test(value)) {
        off();
        resolve(value);
      }
    });
  });

const client = new HighwaterClient({ url, token, store: new MemoryStore() });
const rejected = [];
client.on("rejected", (event) => rejected.push(event));
const scope = client.subscribe({ resourceType: table, conditions: { owner } });
await scope.ready;
const insert = () => {
  const id = nextId++;
  return client.mutate(table, "insert", { id, owner, payload: `write ${id}` });
};

// 1. Offline, queue, online.
let queueMs = null;
let flushMs = null;
if (total > 0) {
  const offline = client.status.state === "offline" ? null : when(client, "status", (s) => s.state === "offline");
  client.goOffline();
  await offline;
  const queueStart = performance.now();
  const queued = [];
  for (let i = 0; i < total; i++) queued.push(insert());
  queueMs = performance.now() - queueStart;
  if (client.pendingCount !== total) throw new Error(`expected ${total} pending mutations, got ${client.pendingCount}`);
  const drained = when(client, "outbox", ({ pending }) => pending === 0);
  const flushStart = performance.now();
  client.goOnline();
  await drained;
  flushMs = performance.now() - flushStart;
  await Promise.all(queued.map((m) => m.confirmed));
  const held = scope.rows().length;
  if (held !== total) throw new Error(`expected ${total} rows in the scope after the flush, got ${held}`);
}

// 2. One at a time.
const latencies = [];
for (let i = 0; i < single; i++) {
  const start = performance.now();
  await insert().confirmed;
  latencies.push(performance.now() - start);
}
if (rejected.length > 0) throw new Error(`${rejected.length} mutations were rejected, the first: ${rejected[0].code} ${rejected[0].message}`);
await client.close();

if (json) {
  console.log(JSON.stringify({ queueMs, flushMs, latencies }));
} else {
  const sorted = [...latencies].sort((a, b) => a - b);
  const at = (p) => sorted[Math.max(1, Math.ceil(sorted.length * p)) - 1]?.toFixed(1) ?? "-";
  if (total > 0) {
    console.log(`${total} mutate() calls while offline: ${queueMs.toFixed(0)} ms`);
    console.log(`goOnline() -> pendingCount 0: ${flushMs.toFixed(0)} ms, ${((total * 1000) / flushMs).toFixed(0)} mutations/s`);
  }
  console.log(`${single} single mutations, mutate() -> confirmed: p50 ${at(0.5)} ms, p99 ${at(0.99)} ms, max ${at(1)} ms`);
}
