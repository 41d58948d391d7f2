#!/usr/bin/env node
// Client replay benchmark: how fast HighwaterClient takes in a full-scope catch-up replay.
//   node --experimental-websocket bench/replay.mjs [rows]          (Node 22+: no flag)
// 1. "client apply": a scripted contract server in a child process sends the replay as fast as
//    it can; the time from subscribe to `ready` measures the client (socket, JSON, apply).
// 2. "end to end": the same scope from a real `highwater serve` on a private Postgres (the
//    binary at HIGHWATER_BIN, or <target>/release/highwater, or <target>/debug/highwater),
//    from the server's replica to the client's rows.
// Each is run in fresh Node processes (the first replay of a process, while V8 still compiles
// the module's hot code) and warm (later replays in the same process), without a listener and
// with a `change` listener that reads `rows()` on every change, as a page re-rendering its list
// does. Each run ends with every row in `rows()`. Prints a table; numbers go to BENCHMARKS.md
// by hand. `HIGHWATER_BENCH_JSON=1` prints the results as JSON instead; `HIGHWATER_PACKAGE` names
// another build of the package to measure (its `dist/node.js`).
// Two builds side by side: `HIGHWATER_PACKAGES=a/dist/node.js,b/dist/node.js` alternates them
// round by round in the same minutes (`HIGHWATER_ROUNDS`, 6), each round a fresh process per
// build with three replays (the first fresh, the other two warm), no listener; it prints each
// build's fresh runs and the medians (of an even count, the slower middle run).
import { fork } from "node:child_process";
import { existsSync } from "node:fs";
import { fileURLToPath } from "node:url";

const here = fileURLToPath(import.meta.url);

/** One replay from subscribe to `ready` with every row in `rows()`; milliseconds. */
async function timeReplay(HighwaterClient, url, token, expected, listener, resourceType = "todos", owner = "ada") {
  const client = new HighwaterClient({ url, token });
  const start = performance.now();
  const scope = client.subscribe({ resourceType, conditions: { owner } });
  let shown = 0;
  if (listener === "page") scope.on("change", () => (shown = scope.rows().length));
  await scope.ready;
  const rows = scope.rows();
  const ms = performance.now() - start;
  if (rows.length !== expected) throw new Error(`expected ${expected} rows, got ${rows.length}`);
  if (listener === "page" && shown !== expected) throw new Error(`the page showed ${shown} rows`);
  await client.close();
  return ms;
}

if (process.argv[2] === "--serve-contract") {
  const { ContractServer } = await import("../js/test/support/contract-server.mjs");
  const server = new ContractServer();
  server.pageRows = 1000; // as `highwater serve` pages a replay
  const url = await server.start();
  for (let i = 0; i < Number(process.argv[3]); i++) server.write(`r${i}`, "ada", { title: `todo ${i}`, done: i % 2 === 0, n: i });
  process.send(url);
} else if (process.argv[2] === "--replay") {
  // One process: `runs` replays in a row; the first is the fresh one. The times go to the
  // parent through IPC, or as JSON on stdout (`highwater-bench sync` runs this mode).
  const [url, token, rows, listener, runs, resourceType, owner] = process.argv.slice(3);
  // HIGHWATER_PACKAGE: another build's entry point (dist/node.js), to compare builds.
  const { HighwaterClient } = await import(process.env.HIGHWATER_PACKAGE ?? "highwater");
  const times = [];
  for (let run = 0; run < Number(runs); run++) {
    times.push(await timeReplay(HighwaterClient, url, token === "-" ? null : token, Number(rows), listener, resourceType, owner));
  }
  if (process.send) process.send(times);
  else console.log(JSON.stringify(times));
} else {
  const rows = Number(process.argv[2] ?? 100_000);
  const flags = Number(process.versions.node.split(".")[0]) < 22 ? ["--experimental-websocket", "--no-warnings=ExperimentalWarning"] : [];
  /** `runs` replays in a new Node process (of the build `pkg`, if given); their times. */
  const replays = (url, token, listener, runs, pkg) =>
    new Promise((resolve, reject) => {
      const env = pkg === undefined ? process.env : { ...process.env, HIGHWATER_PACKAGE: pkg };
      const child = fork(here, ["--replay", url, token ?? "-", String(rows), listener, String(runs)], { execArgv: flags, env });
      child.once("message", resolve);
      child.once("exit", (code) => code !== 0 && reject(new Error(`a replay process exited with ${code}`)));
    });
  const results = [];
  const packages = process.env.HIGHWATER_PACKAGES?.split(",").filter(Boolean);
  const rounds = Number(process.env.HIGHWATER_ROUNDS ?? 6);
  async function measure(what, url, token) {
    if (packages !== undefined) {
      const runs = new Map(packages.map((pkg) => [pkg, { fresh: [], warm: [] }]));
      for (let round = 0; round < rounds; round++) {
        for (const pkg of packages) {
          const [fresh, ...warm] = await replays(url, token, "none", 3, pkg);
          runs.get(pkg).fresh.push(fresh);
          runs.get(pkg).warm.push(...warm);
        }
      }
      for (const [pkg, { fresh, warm }] of runs) results.push({ what, pkg, listener: "none", fresh, warm });
      return;
    }
    for (const listener of ["none", "page"]) {
      const fresh = [];
      for (let process = 0; process < 3; process++) fresh.push((await replays(url, token, listener, 1))[0]);
      const warm = (await replays(url, token, listener, 4)).slice(1);
      results.push({ what, listener, fresh, warm });
    }
  }

  const child = fork(here, ["--serve-contract", String(rows)], { execArgv: [] });
  const url = await new Promise((resolve) => child.once("message", resolve));
  await measure("client apply (contract server)", url, null);
  child.kill();

  const repo = fileURLToPath(new URL("../../", import.meta.url));
  const target = process.env.CARGO_TARGET_DIR ?? `${repo}target`;
  process.env.HIGHWATER_BIN ??= [`${target}/release/highwater`, `${target}/debug/highwater`].find(existsSync);
  const { Postgres, Serve, TODOS_DDL, until } = await import("../js/test-serve/support.mjs");
  const pg = new Postgres();
  let serve;
  try {
    pg.query(TODOS_DDL);
    pg.query(`INSERT INTO todos (id, owner, title, done, v) SELECT i, 'ada', 'todo ' || i, i % 2 = 0, 1 FROM generate_series(1, ${rows}) AS i`);
    serve = new Serve(pg);
    await serve.start();
    const url = `ws://127.0.0.1:${serve.port}/sync`;
    const token = serve.token("ada");
    // Wait until the replica holds every row (a replay that comes up short is retried).
    await until(async () => {
      try {
        await replays(url, token, "none", 1);
        return true;
      } catch {
        return false;
      }
    }, "the replica to hold every row", 300_000);
    await measure(`end to end (${process.env.HIGHWATER_BIN.includes("release") ? "release" : "debug"} highwater serve)`, url, token);
  } finally {
    await serve?.stop();
    pg.stop();
  }

  if (process.env.HIGHWATER_BENCH_JSON) {
    console.log(JSON.stringify({ rows, results }));
  } else if (packages !== undefined) {
    const rate = (ms) => Math.round((rows / ms) * 1000);
    const median = (times) => [...times].sort((a, b) => a - b)[Math.floor(times.length / 2)];
    console.log(`${rows.toLocaleString("en")} rows, rows/s, builds alternated over ${rounds} rounds (subscribe to ready, no listener)\n`);
    console.log(`| replay | build | fresh runs | fresh median | warm median |\n|---|---|---|---:|---:|`);
    for (const { what, pkg, fresh, warm } of results) {
      const runs = fresh.map((ms) => rate(ms).toLocaleString("en")).join(", ");
      console.log(`| ${what} | ${pkg} | ${runs} | ${rate(median(fresh)).toLocaleString("en")} | ${rate(median(warm)).toLocaleString("en")} |`);
    }
  } else {
    const rate = (ms) => Math.round((rows / ms) * 1000).toLocaleString("en");
    console.log(`${rows.toLocaleString("en")} rows, rows/s per run (subscribe to ready, every row in rows())\n`);
    console.log(`| replay | change listener | fresh process (3 runs) | warm (3 runs) |\n|---|---|---|---|`);
    for (const { what, listener, fresh, warm } of results) {
      const page = listener === "page" ? "reads rows() on each change" : "none";
      console.log(`| ${what} | ${page} | ${fresh.map(rate).join(", ")} | ${warm.map(rate).join(", ")} |`);
    }
  }
}
