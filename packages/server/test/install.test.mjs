// The server's npm packages as a user gets them: `scripts/package-server` packs
// `@highwater/server` and this machine's platform package, both are installed from the tarballs
// into a fresh project (offline: the other platforms' optional packages are skipped, as npm
// skips them on a real install), and `npx highwater` runs the binary: `--version`, then a short
// `serve` against a private Postgres, stopped with SIGTERM through the launcher.
// Needs the `highwater` binary (HIGHWATER_BIN, default <target>/debug/highwater).
import assert from "node:assert/strict";
import { execFileSync, spawn, spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";
import { BIN, Postgres, until } from "../../../bindings-wasm/js/test-serve/support.mjs";

const repo = fileURLToPath(new URL("../../../", import.meta.url));
const version = /^version = "([^"]+)"/m.exec(readFileSync(join(repo, "Cargo.toml"), "utf8"))[1];
let work;
let packed;

/** A fresh npm project with `tarballs` installed, offline. */
function project(name, tarballs) {
  const dir = join(work, name);
  execFileSync("mkdir", ["-p", dir]);
  writeFileSync(join(dir, "package.json"), JSON.stringify({ name, private: true }));
  execFileSync("npm", ["install", "--offline", "--no-audit", "--no-fund", "--loglevel=error", ...tarballs], {
    cwd: dir,
    stdio: ["ignore", "ignore", "inherit"],
  });
  return dir;
}

const npx = (dir, args, env = {}) =>
  spawnSync("npx", ["--no-install", "highwater", ...args], { cwd: dir, encoding: "utf8", env: { ...process.env, ...env } });

const freePort = () =>
  new Promise((resolve) => {
    const server = createServer();
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });

before(() => {
  assert.ok(existsSync(BIN), `no highwater binary at ${BIN}: run cargo build -p highwater-host, or set HIGHWATER_BIN`);
  work = mkdtempSync(join(tmpdir(), "highwater-server-npm-"));
  const out = execFileSync(join(repo, "scripts", "package-server"), ["--binary", BIN, "--out", join(work, "packs")], {
    encoding: "utf8",
  });
  packed = JSON.parse(out);
});

after(() => {
  if (work) rmSync(work, { recursive: true, force: true });
});

test("the packages hold the launcher and the binary, and nothing else", () => {
  const list = (tarball) =>
    execFileSync("tar", ["tzf", tarball], { encoding: "utf8" }).trim().split("\n").sort();
  assert.deepEqual(list(packed.server), ["package/README.md", "package/bin/highwater.js", "package/package.json"]);
  assert.deepEqual(list(packed.platform), ["package/README.md", "package/bin/highwater", "package/package.json"]);
  const manifest = JSON.parse(execFileSync("tar", ["xzOf", packed.server, "package/package.json"], { encoding: "utf8" }));
  assert.equal(manifest.version, version);
  assert.equal(manifest.bin.highwater, "bin/highwater.js");
  assert.equal(manifest.optionalDependencies[packed.platformName], version);
  assert.equal(manifest.scripts, undefined, "no install scripts");
  // The manifest as bundlers and Node read it (warnings and suggestions fail too).
  execFileSync(join(repo, "node_modules", ".bin", "publint"), ["--strict", join(work, "packs", "server")], { stdio: "ignore" });
});

/**
 * Starts `command args` in `dir` as a process group of its own, waits until the server answers
 * and has ingested one insert, and returns how to stop it and what it wrote to stderr.
 */
async function serveWith(pg, dir, command, args) {
  const port = await freePort();
  const data = mkdtempSync(join(work, "data-"));
  const child = spawn(command, [...args, "serve", "--upstream", pg.url, "--data", data, "--port", String(port)], {
    cwd: dir,
    stdio: ["ignore", "ignore", "pipe"],
    detached: true,
  });
  let stderr = "";
  child.stderr.on("data", (chunk) => (stderr += chunk));
  // Every process holding stderr has ended (npx, the launcher, the binary).
  const closed = new Promise((resolve) => child.stderr.on("close", resolve));
  const exited = new Promise((resolve) => child.on("exit", (code, signal) => resolve({ code, signal })));
  const killAll = () => {
    try {
      process.kill(-child.pid, "SIGKILL");
    } catch {}
  };
  try {
    await until(async () => (await fetch(`http://127.0.0.1:${port}/health`).catch(() => null))?.ok, "/health", 60_000);
    const id = Date.now() % 1_000_000_000;
    pg.query(`INSERT INTO items VALUES (${id}, 'new')`);
    await until(async () => {
      const text = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text();
      return /^highwater_transactions_total 1$/m.test(text);
    }, "the insert to be ingested", 30_000);
  } catch (error) {
    killAll();
    throw new Error(`${error.message}\n${stderr}`);
  }
  return { child, exited, closed, killAll, stderr: () => stderr };
}

test("npx highwater runs the prebuilt binary: --version, then serve until SIGTERM", async () => {
  const dir = project("app", [packed.platform, packed.server]);
  const shown = npx(dir, ["--version"]);
  assert.equal(shown.status, 0, shown.stderr);
  assert.equal(shown.stdout.trim(), `highwater ${version}`);

  const pg = new Postgres();
  try {
    pg.query("CREATE TABLE items (id int8 PRIMARY KEY, name text)");
    pg.query("INSERT INTO items SELECT i, 'n' || i FROM generate_series(1, 20) AS i");

    // The installed launcher (what npx runs, and what a container or a Procfile runs):
    // SIGTERM to it reaches the binary, which stops cleanly, and the launcher exits as it did.
    const launcher = await serveWith(pg, dir, join(dir, "node_modules", ".bin", "highwater"), []);
    const asked = Date.now();
    launcher.child.kill("SIGTERM");
    const ended = await launcher.exited;
    await launcher.closed;
    assert.deepEqual(ended, { code: 0, signal: null }, launcher.stderr());
    assert.ok(Date.now() - asked < 15_000, "stopped promptly");
    assert.match(launcher.stderr(), /server stopped/);

    // `npx highwater serve` stopped from a terminal or a supervisor that signals the process
    // group: npx, the launcher and the binary all get SIGTERM, and the binary also gets the
    // launcher's copy; it is still one clean stop.
    const viaNpx = await serveWith(pg, dir, "npx", ["--no-install", "highwater"]);
    process.kill(-viaNpx.child.pid, "SIGTERM");
    const timer = setTimeout(viaNpx.killAll, 15_000);
    await viaNpx.closed;
    clearTimeout(timer);
    assert.match(viaNpx.stderr(), /server stopped/);
    assert.doesNotMatch(viaNpx.stderr(), /exiting now/);
  } finally {
    pg.stop();
  }
});

test("without its platform package the launcher says which one and how to get it", () => {
  const dir = project("bare", [packed.server, "--omit=optional"]);
  const run = npx(dir, ["--version"]);
  assert.equal(run.status, 1);
  assert.match(run.stderr, new RegExp(`${packed.platformName} is not installed`));
  assert.match(run.stderr, /--omit=optional/);
  const overridden = npx(dir, ["--version"], { HIGHWATER_BINARY: BIN });
  assert.equal(overridden.status, 0, overridden.stderr);
  assert.equal(overridden.stdout.trim(), `highwater ${version}`);
});
