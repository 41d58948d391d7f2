// Runs the package's Node tests. The client needs a global WebSocket: Node 22+ has one, Node 20
// gets it with --experimental-websocket.
import { spawnSync } from "node:child_process";
import { readdirSync } from "node:fs";
import { fileURLToPath } from "node:url";

// `node js/test/run.mjs serve` runs the end-to-end tests against `highwater serve` instead.
const suite = process.argv[2] === "serve" ? "../test-serve/" : "./";
const here = fileURLToPath(new URL(suite, import.meta.url));
const files = readdirSync(here).filter((name) => name.endsWith(".test.mjs")).sort().map((name) => here + name);
const major = Number(process.versions.node.split(".")[0]);
const flags = major < 22 ? ["--experimental-websocket", "--no-warnings=ExperimentalWarning"] : [];
const { status } = spawnSync(process.execPath, [...flags, "--test", "--test-reporter=tap", "--test-concurrency=1", ...files], { stdio: "inherit" });
process.exit(status ?? 1);
