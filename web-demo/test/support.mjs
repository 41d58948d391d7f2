// Pieces of the browser tests: a private `highwater demo` on a free port, SQL straight into its
// Postgres, and headless Chromium driven by playwright-core. Every wait is bounded.
import { execFileSync, spawn } from "node:child_process";
import { existsSync, mkdirSync, readdirSync } from "node:fs";
import { createServer } from "node:net";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

export const repo = join(dirname(fileURLToPath(import.meta.url)), "..", "..");
/** Screenshots and other artifacts of a run (gitignored). */
export const resultsDir = join(repo, "web-demo", "test-results");

const CHROMIUM = process.env.CHROMIUM ?? "/usr/bin/chromium";
const CHROMIUM_ARGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
  "--no-first-run",
];

export async function freePort() {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.unref();
    server.on("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/**
 * Starts counting the first scope's "ready" events; the returned function waits for the next one
 * and gives that catch-up's `replayedOnLastResume`. On a reconnect of the same subscription, the
 * missed rows are applied before the catch-up ends, and until it ends the count is still the
 * previous catch-up's: reading it as soon as the rows show is a race.
 */
export async function nextResume(page, timeoutMs = 20_000) {
  const mark = await page.evaluate(() => {
    if (window.readies === undefined) {
      window.readies = 0;
      window.demo.scopes[0].sub.on("ready", () => window.readies++);
    }
    return window.readies;
  });
  return async () => {
    const { replayed } = await until("the resume's catch-up to finish", () =>
      page.evaluate((mark) => window.readies > mark && { replayed: window.demo.scopes[0].sub.replayedOnLastResume }, mark), timeoutMs);
    return replayed;
  };
}

export async function until(what, check, timeoutMs = 20_000, everyMs = 100) {
  const deadline = Date.now() + timeoutMs;
  let last;
  while (Date.now() < deadline) {
    try {
      const value = await check();
      if (value) return value;
    } catch (error) {
      last = error;
    }
    await new Promise((r) => setTimeout(r, everyMs));
  }
  throw new Error(`Timed out after ${timeoutMs} ms waiting for ${what}${last ? `: ${last.message}` : ""}`);
}

export function highwaterBinary() {
  if (process.env.HIGHWATER_BIN) return process.env.HIGHWATER_BIN;
  const target = process.env.CARGO_TARGET_DIR ?? join(repo, "target");
  return join(target, "debug", "highwater");
}

function psqlBinary() {
  const root = "/usr/lib/postgresql";
  const versions = existsSync(root) ? readdirSync(root).sort((a, b) => Number(b) - Number(a)) : [];
  for (const version of versions) {
    const psql = join(root, version, "bin", "psql");
    if (existsSync(psql)) return psql;
  }
  return "psql";
}

/** `highwater demo` on a free port (or `port`), with its own private Postgres unless `upstream`
 * is given; by default it writes nothing on its own. */
export class Demo {
  static async start({ writesPerSecond = 0, port, upstream, data, webDir } = {}) {
    port ??= await freePort();
    const args = ["demo", "--port", String(port), "--writes-per-second", String(writesPerSecond)];
    if (upstream) args.push("--upstream", upstream);
    if (data) args.push("--data", data);
    if (webDir) args.push("--web-dir", webDir);
    const child = spawn(highwaterBinary(), args, {
      cwd: repo,
      stdio: ["ignore", "pipe", "pipe"],
      env: { ...process.env, RUST_LOG: process.env.RUST_LOG ?? "warn" },
    });
    const demo = new Demo(child, port);
    child.stdout.setEncoding("utf8");
    child.stdout.on("data", (chunk) => (demo.stdout += chunk));
    child.stderr.setEncoding("utf8");
    child.stderr.on("data", (chunk) => (demo.stderr += chunk));
    child.on("exit", (code, signal) => (demo.exited = { code, signal }));
    try {
      await until("the demo to print its upstream", () => demo.exited === null && /upstream\s+(\S+)/.exec(demo.stdout), 60_000);
      await until("the demo to answer /health", async () => {
        if (demo.exited) throw new Error(`the demo exited ${JSON.stringify(demo.exited)}: ${demo.stderr}`);
        return (await fetch(`${demo.url}health`)).ok;
      }, 60_000, 200);
    } catch (error) {
      await demo.stop();
      throw new Error(`${error.message}\nstdout:\n${demo.stdout}\nstderr:\n${demo.stderr}`);
    }
    return demo;
  }

  constructor(child, port) {
    this.child = child;
    this.port = port;
    this.url = `http://127.0.0.1:${port}/`;
    this.stdout = "";
    this.stderr = "";
    this.exited = null;
  }

  get upstream() {
    return /upstream\s+(\S+)/.exec(this.stdout)[1];
  }

  /** Open `/sync` sockets on the server (`/metrics`). */
  async syncSockets() {
    const text = await (await fetch(`${this.url}metrics`)).text();
    return Number(/^highwater_sync_connections (\d+)$/m.exec(text)?.[1] ?? NaN);
  }

  /** Upstream transactions this run of the demo has stored durably (`/health`). */
  async storedTransactions() {
    return (await (await fetch(`${this.url}health`)).json()).storedTransactions;
  }

  /**
   * Waits until this run has stored `count` upstream transactions. A page that (re)subscribes
   * earlier gets what is missing live rather than by its resume's replay.
   */
  async stored(count, what = `${count} stored transactions`) {
    await until(what, async () => (await this.storedTransactions()) >= count);
  }

  /** Runs SQL in Postgres; each statement of `sql` is its own transaction (psql autocommit). */
  sql(sql) {
    return execFileSync(psqlBinary(), ["-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1", "-d", this.upstream, "-f", "-"], {
      input: sql,
      encoding: "utf8",
    }).trim();
  }

  async stop() {
    if (this.exited) return;
    const exited = new Promise((resolve) => this.child.once("exit", resolve));
    this.child.kill("SIGTERM");
    const timer = setTimeout(() => this.child.kill("SIGKILL"), 15_000);
    await exited;
    clearTimeout(timer);
  }
}

export async function launchBrowser() {
  return chromium.launch({ executablePath: CHROMIUM, args: CHROMIUM_ARGS, headless: true });
}

export function screenshotPath(name) {
  mkdirSync(resultsDir, { recursive: true });
  return join(resultsDir, name);
}

/** A private Postgres in `dir` that outlives demo restarts (scripts/pg-start); its URL. */
export function startPostgres(dir) {
  const out = execFileSync(join(repo, "scripts", "pg-start"), [dir], { encoding: "utf8" });
  return out.trim().split("\n").at(-1);
}

export function stopPostgres(dir) {
  execFileSync(join(repo, "scripts", "pg-stop"), [dir, "--rm"], { stdio: "ignore" });
}
