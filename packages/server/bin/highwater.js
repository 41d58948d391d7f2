#!/usr/bin/env node
// `highwater` from npm: runs the prebuilt server binary of the platform package npm installed
// beside this one (an optional dependency, chosen by npm from its `os`, `cpu` and `libc`), with
// the same arguments, stdio and exit code. Signals sent to this process are passed on, so
// `npx @highwater/server serve …` stops gracefully on SIGTERM or Ctrl-C like the binary itself.
"use strict";

const { spawn } = require("node:child_process");
const { existsSync } = require("node:fs");

/** Platform package by `<platform>-<arch>[-<libc>]`; keep in step with package.json. */
const PACKAGES = {
  "linux-x64-gnu": "@highwater/server-linux-x64-gnu",
  "linux-arm64-gnu": "@highwater/server-linux-arm64-gnu",
  "darwin-x64": "@highwater/server-darwin-x64",
  "darwin-arm64": "@highwater/server-darwin-arm64",
  "win32-x64": "@highwater/server-win32-x64-msvc",
};

function fail(message) {
  process.stderr.write(`highwater: ${message}\n`);
  process.exit(1);
}

function platformKey() {
  const { platform, arch } = process;
  if (platform !== "linux") return `${platform}-${arch}`;
  // glibcVersionRuntime is set on glibc and absent on musl (Alpine).
  const glibc = process.report?.getReport?.().header?.glibcVersionRuntime;
  return `${platform}-${arch}-${glibc ? "gnu" : "musl"}`;
}

function binaryPath() {
  const override = process.env.HIGHWATER_BINARY;
  if (override) {
    if (!existsSync(override)) fail(`HIGHWATER_BINARY is ${override}, which does not exist`);
    return override;
  }
  const key = platformKey();
  const name = PACKAGES[key];
  if (!name) {
    fail(
      `there is no prebuilt server for ${key}. Build it from source ` +
        "(cargo install --path host-native in the Highwater repository) and set HIGHWATER_BINARY, " +
        "or run the Docker image.",
    );
  }
  const file = process.platform === "win32" ? "highwater.exe" : "highwater";
  try {
    return require.resolve(`${name}/bin/${file}`);
  } catch {
    return fail(
      `the platform package ${name} is not installed. npm installs it as an optional ` +
        "dependency of @highwater/server: reinstall without --omit=optional (or --no-optional), " +
        "and make sure the lockfile was not written on another platform.",
    );
  }
}

const child = spawn(binaryPath(), process.argv.slice(2), { stdio: "inherit" });
const forwarded = ["SIGINT", "SIGTERM", "SIGHUP"];
for (const signal of forwarded) {
  process.on(signal, () => {
    if (child.exitCode === null && child.signalCode === null) child.kill(signal);
  });
}
child.on("error", (error) => fail(`could not start ${child.spawnfile}: ${error.message}`));
child.on("exit", (code, signal) => {
  if (signal) {
    // End the way the binary did, so a supervisor sees the same signal.
    for (const name of forwarded) process.removeAllListeners(name);
    process.kill(process.pid, signal);
    return;
  }
  process.exit(code ?? 1);
});
