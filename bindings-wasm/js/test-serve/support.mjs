// A private Postgres, a real `highwater serve --sync-rules`, and a TCP proxy the tests can
// sever, for HighwaterClient tests end to end. Everything started here is stopped by pid.
import { execFileSync, spawn } from "node:child_process";
import { chmodSync, existsSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { createServer, connect } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const repo = fileURLToPath(new URL("../../../", import.meta.url));
const targetDir = process.env.CARGO_TARGET_DIR ?? join(repo, "target");
export const BIN = process.env.HIGHWATER_BIN ?? join(targetDir, "debug", "highwater");
const PG_BIN = (() => {
  const versions = readdirSync("/usr/lib/postgresql").sort((a, b) => Number(a) - Number(b));
  return join("/usr/lib/postgresql", versions.at(-1), "bin");
})();

export const SECRET = "a client test secret that is longer than thirty-two bytes";
export const RULES = {
  tables: {
    todos: {
      filterColumns: ["owner", "done"],
      omitColumns: ["secret_note"],
      require: { owner: "sub" },
      write: { insert: true, update: ["title", "done", "v"], delete: true },
    },
  },
};
export const TODOS_DDL =
  "CREATE TABLE todos (id int8 PRIMARY KEY, owner text, title text, done bool NOT NULL DEFAULT false, v int NOT NULL DEFAULT 0, secret_note text)";

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Resolves when `check()` (maybe async) is true; throws `what` after `ms`. */
// Generous: a loaded CI machine can stretch a few backoff rounds well past 20 s.
export async function until(check, what, ms = 60_000) {
  const deadline = Date.now() + ms;
  for (;;) {
    if (await check()) return;
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await sleep(50);
  }
}

export function scratch(name) {
  const dir = mkdtempSync(join(tmpdir(), `highwater-client-${name}-`));
  chmodSync(dir, 0o755);
  return dir;
}

export class Postgres {
  constructor() {
    this.dir = scratch("pg");
    this.url = execFileSync(join(repo, "scripts", "pg-start"), [this.dir], { encoding: "utf8" }).trim();
  }

  /** Runs SQL (one autocommit transaction per statement) and returns psql's unaligned output. */
  query(sql) {
    return execFileSync(join(PG_BIN, "psql"), ["-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", this.url], {
      input: sql,
      encoding: "utf8",
    }).trim();
  }

  /** Runs a long SQL script in the background. */
  script(sql) {
    const child = spawn(join(PG_BIN, "psql"), ["-X", "-q", "-v", "ON_ERROR_STOP=1", this.url], {
      stdio: ["pipe", "ignore", "inherit"],
    });
    child.stdin.end(sql);
    return new Promise((resolve, reject) =>
      child.on("exit", (code) => (code === 0 ? resolve() : reject(new Error(`psql exited with ${code}`)))),
    );
  }

  /** The scope's rows as the client should see them (omitted columns left out). */
  rows(where) {
    const json = this.query(
      `SELECT coalesce(json_agg(json_build_object('id', id, 'owner', owner, 'title', title, 'done', done, 'v', v) ORDER BY id), '[]') FROM todos WHERE ${where}`,
    );
    return JSON.parse(json);
  }

  stop() {
    execFileSync(join(repo, "scripts", "pg-stop"), [this.dir], { stdio: "ignore" });
    rmSync(this.dir, { recursive: true, force: true });
  }
}

export class Serve {
  constructor(pg) {
    if (!existsSync(BIN)) {
      throw new Error(`no highwater binary at ${BIN}: run cargo build -p highwater-host, or set HIGHWATER_BIN`);
    }
    this.pg = pg;
    this.files = scratch("sync-files");
    this.rules = join(this.files, "rules.json");
    this.secret = join(this.files, "secret");
    writeFileSync(this.rules, JSON.stringify(RULES));
    writeFileSync(this.secret, SECRET);
    this.port = 0;
  }

  async start(data = scratch("data")) {
    this.data = data;
    (this.dirs ??= new Set()).add(data);
    this.port ||= await freePort();
    this.child = spawn(
      BIN,
      [
        "serve", "--upstream", this.pg.url, "--data", data, "--port", String(this.port), "--host", "127.0.0.1",
        "--sync-rules", this.rules, "--sync-secret-file", this.secret,
      ],
      { stdio: ["ignore", "ignore", "inherit"], env: { ...process.env, RUST_LOG: "warn" } },
    );
    const child = this.child;
    await until(async () => {
      if (child.exitCode !== null) throw new Error(`highwater serve exited with ${child.exitCode}`);
      try {
        return (await fetch(`http://127.0.0.1:${this.port}/health`)).ok;
      } catch {
        return false;
      }
    }, "highwater serve to answer /health", 60_000);
  }

  /** `kill -9`: no chance to clean up. */
  async kill9() {
    const child = this.child;
    child.kill("SIGKILL");
    if (child.exitCode === null && child.signalCode === null) await new Promise((resolve) => child.once("exit", resolve));
  }

  /** `highwater token` for `sub`, signed with the server's secret. */
  token(sub, ttl = "1h") {
    return execFileSync(BIN, ["token", "--sub", sub, "--ttl", ttl, "--sync-secret-file", this.secret], {
      encoding: "utf8",
    }).trim();
  }

  async stop() {
    if (this.child) await this.kill9();
    for (const dir of [this.files, ...(this.dirs ?? [])]) rmSync(dir, { recursive: true, force: true });
  }
}

/** A TCP proxy in front of the server whose connections can be reset (no WebSocket close). */
export class Proxy {
  connections = 0;
  #pairs = new Set();

  async start(port) {
    this.server = createServer((client) => {
      this.connections += 1;
      const upstream = connect(port, "127.0.0.1");
      const pair = { client, upstream };
      this.#pairs.add(pair);
      const drop = () => {
        this.#pairs.delete(pair);
        client.destroy();
        upstream.destroy();
      };
      client.on("error", drop).on("close", drop);
      upstream.on("error", drop).on("close", drop);
      client.pipe(upstream);
      upstream.pipe(client);
    });
    await new Promise((resolve) => this.server.listen(0, "127.0.0.1", resolve));
    return `ws://127.0.0.1:${this.server.address().port}/sync`;
  }

  get open() {
    return this.#pairs.size;
  }

  /** Resets every connection: the client sees the TCP connection die (RST), not a close frame. */
  sever() {
    for (const { client, upstream } of this.#pairs) {
      client.resetAndDestroy();
      upstream.destroy();
    }
    this.#pairs.clear();
  }

  async stop() {
    this.sever();
    await new Promise((resolve) => this.server.close(resolve));
  }
}

export async function freePort() {
  const server = createServer();
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address();
  await new Promise((resolve) => server.close(resolve));
  return port;
}

/** Rows by id, in the shape Postgres gives (the client may hold more columns than compared). */
export function normalise(rows) {
  return rows
    .map(({ id, owner, title, done, v }) => ({ id: Number(id), owner, title, done, v }))
    .sort((a, b) => a.id - b.id);
}

/** An HS256 token signed with the test secret, expiring `expiresInMs` from now (may be past). */
export async function mintToken(sub, expiresInMs) {
  const { createHmac } = await import("node:crypto");
  const encode = (value) => Buffer.from(JSON.stringify(value)).toString("base64url");
  const now = Date.now();
  const body = `${encode({ alg: "HS256", typ: "JWT" })}.${encode({ sub, iat: Math.floor(now / 1000), exp: Math.floor((now + expiresInMs) / 1000) })}`;
  return `${body}.${createHmac("sha256", SECRET).update(body).digest("base64url")}`;
}
