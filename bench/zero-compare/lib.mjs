// Helpers shared by the orchestrator (bench.mjs), the client driver (driver.mjs) and Zero's
// query endpoint (zero-query-server.mjs): HS256 tokens, ports, process-tree memory and CPU, stats.
import { createHmac, timingSafeEqual } from "node:crypto";
import { readdirSync, readFileSync } from "node:fs";
import { createServer } from "node:net";
import { cpus as cpuInfo } from "node:os";

/** The secret both systems verify tokens with (HS256, ≥ 32 bytes). */
export const SECRET = "highwater-vs-zero benchmark secret, longer than thirty-two bytes";

const b64 = (value) => Buffer.from(JSON.stringify(value)).toString("base64url");

/** An HS256 JWT for `sub`, valid for `ttlSec` seconds (as the repo's tests mint them). */
export function mintToken(sub, ttlSec = 3600) {
  const now = Math.floor(Date.now() / 1000);
  const body = `${b64({ alg: "HS256", typ: "JWT" })}.${b64({ sub, iat: now, exp: now + ttlSec })}`;
  return `${body}.${createHmac("sha256", SECRET).update(body).digest("base64url")}`;
}

/** Verifies an HS256 JWT signed with SECRET; returns its claims or throws. */
export function verifyToken(token) {
  const parts = String(token ?? "").split(".");
  if (parts.length !== 3) throw new Error("malformed token");
  const header = JSON.parse(Buffer.from(parts[0], "base64url").toString());
  if (header.alg !== "HS256") throw new Error("unexpected alg");
  const want = createHmac("sha256", SECRET).update(`${parts[0]}.${parts[1]}`).digest();
  const got = Buffer.from(parts[2], "base64url");
  if (got.length !== want.length || !timingSafeEqual(got, want)) throw new Error("bad signature");
  const claims = JSON.parse(Buffer.from(parts[1], "base64url").toString());
  if (typeof claims.exp === "number" && claims.exp * 1000 < Date.now()) throw new Error("expired");
  if (typeof claims.sub !== "string") throw new Error("no sub");
  return claims;
}

export async function freePort() {
  const server = createServer();
  await new Promise((resolve, reject) => server.once("error", reject).listen(0, "127.0.0.1", resolve));
  const { port } = server.address();
  await new Promise((resolve) => server.close(resolve));
  return port;
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Polls `check()` until it returns a truthy value; throws `what` after `ms`. */
export async function until(check, what, ms, everyMs = 100) {
  const deadline = Date.now() + ms;
  let last;
  for (;;) {
    try {
      const v = await check();
      if (v) return v;
    } catch (e) {
      last = e;
    }
    if (Date.now() > deadline) {
      throw new Error(`timed out after ${ms} ms waiting for ${what}${last ? ` (${last.message})` : ""}`);
    }
    await sleep(everyMs);
  }
}

/** Rejects with `what` if `promise` has not settled within `ms`. */
export function withTimeout(promise, ms, what) {
  let timer;
  return Promise.race([
    promise.finally(() => clearTimeout(timer)),
    new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what}`)), ms);
    }),
  ]);
}

/** Every pid whose ancestry includes `root` (and `root` itself), from /proc. */
export function processTree(root) {
  const parent = new Map();
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      const stat = readFileSync(`/proc/${entry}/stat`, "utf8");
      // The command name may hold spaces and parentheses: the fields after the last ')'.
      const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
      parent.set(Number(entry), Number(fields[1]));
    } catch {
      // the process ended while we looked
    }
  }
  const pids = [root];
  for (let i = 0; i < pids.length; i++) {
    for (const [pid, ppid] of parent) if (ppid === pids[i]) pids.push(pid);
  }
  return pids.filter((pid) => pid === root || parent.has(pid));
}

/** A `/proc/<pid>/<file>` field in KiB (0 if the process is gone). */
function procKiB(pid, file, field) {
  try {
    const m = new RegExp(`^${field}:\\s+(\\d+) kB`, "m").exec(readFileSync(`/proc/${pid}/${file}`, "utf8"));
    return m ? Number(m[1]) : 0;
  } catch {
    return 0;
  }
}

/**
 * Memory of the process trees rooted at `roots` (each process once), in KiB: the sum of their
 * resident sets, and of their proportional sets (PSS: a page shared by k processes counts 1/k,
 * so the Node binary and libraries that several workers map count once).
 */
export function treeRss(roots) {
  const pids = new Set(roots.flatMap((root) => processTree(root)));
  let kib = 0;
  let pssKib = 0;
  let processes = 0;
  for (const pid of pids) {
    const r = procKiB(pid, "status", "VmRSS");
    if (r > 0) {
      kib += r;
      pssKib += procKiB(pid, "smaps_rollup", "Pss");
      processes += 1;
    }
  }
  return { kib, pssKib, processes };
}

/** CPU seconds (user + system) used so far by the live processes of the trees at `roots`. */
export function treeCpuSeconds(roots) {
  const ticksPerSecond = 100; // USER_HZ, 100 on Linux
  let ticks = 0;
  for (const pid of new Set(roots.flatMap((root) => processTree(root)))) {
    try {
      const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
      const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
      ticks += Number(fields[11]) + Number(fields[12]);
    } catch {
      // the process ended while we looked
    }
  }
  return ticks / ticksPerSecond;
}

export function percentile(sorted, p) {
  if (sorted.length === 0) return NaN;
  const i = Math.min(sorted.length - 1, Math.max(0, Math.ceil((p / 100) * sorted.length) - 1));
  return sorted[i];
}

export function loadavg() {
  return readFileSync("/proc/loadavg", "utf8").split(" ").slice(0, 3).join(" ");
}

/** The CPU model and how many logical cores this machine has. */
export function machine() {
  const cpus = cpuInfo();
  return { cpu: cpus[0]?.model ?? "unknown CPU", cores: cpus.length };
}

