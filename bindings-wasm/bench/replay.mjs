#!/usr/bin/env node
// Client replay benchmark: how fast HighwaterClient takes in a full-scope catch-up replay.
//   node --experimental-websocket bench/replay.mjs [rows]          (Node 22+: no flag)
// 1. "client apply": a scripted contract server in a child process sends the replay as fast as
//    it can; the time from subscribe to `ready` measures the client (socket, JSON, apply).
// 2. "end to end": the same scope from a real `highwater serve` on a private Postgres (needs the
//    binary, see js/test-serve/support.mjs), from the server's replica to the client's rows.
// Prints a table; numbers go to BENCHMARKS.md by hand.
import { fork } from "node:child_process";
import { fileURLToPath } from "node:url";
import { HighwaterClient } from "highwater";

const rows = Number(process.argv[2] ?? 100_000);

if (process.argv[2] === "--serve-contract") {
  const { ContractServer } = await import("../js/test/support/contract-server.mjs");
  const server = new ContractServer();
  const url = await server.start();
  for (let i = 0; i < Number(process.argv[3]); i++) server.write(`r${i}`, "ada", { title: `todo ${i}`, done: i % 2 === 0, n: i });
  process.send(url);
} else {
  const results = [];
  async function timeReplay(url, token, expected) {
    const client = new HighwaterClient({ url, token });
    const start = performance.now();
    const scope = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await scope.ready;
    const ms = performance.now() - start;
    if (scope.rows().length !== expected) throw new Error(`expected ${expected} rows, got ${scope.rows().length}`);
    await client.close();
    return ms;
  }

  const child = fork(fileURLToPath(import.meta.url), ["--serve-contract", String(rows)], { execArgv: [] });
  const url = await new Promise((resolve) => child.once("message", resolve));
  for (let run = 0; run < 3; run++) results.push(["client apply (contract server)", rows, await timeReplay(url, null, rows)]);
  child.kill();

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
        await timeReplay(url, token, rows);
        return true;
      } catch {
        return false;
      }
    }, "the replica to hold every row", 300_000);
    for (let run = 0; run < 3; run++) results.push(["end to end (highwater serve)", rows, await timeReplay(url, token, rows)]);
  } finally {
    await serve?.stop();
    pg.stop();
  }

  console.log(`| replay | rows | ms | rows/s |\n|---|---:|---:|---:|`);
  for (const [what, n, ms] of results) console.log(`| ${what} | ${n} | ${ms.toFixed(0)} | ${Math.round((n / ms) * 1000)} |`);
}
