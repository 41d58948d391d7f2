#!/usr/bin/env node
// Packaging smoke test: packs the built package, installs the tarball into a fresh project and
// uses it the way a user would (Node ESM import, TypeScript against the shipped .d.ts, and the
// README's examples type-checked).
// Run `npm run build:wasm` first.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { cpSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const here = fileURLToPath(new URL(".", import.meta.url));
const packageDir = join(here, "..");
const tsc = join(packageDir, "..", "node_modules", ".bin", "tsc");
const run = (command, args, cwd) => execFileSync(command, args, { cwd, encoding: "utf8", stdio: ["ignore", "pipe", "inherit"] });

if (!existsSync(join(packageDir, "dist", "wasm", "highwater_wasm_bg.wasm"))) {
  console.error("packaging test: bindings-wasm/dist is missing; run `npm run build:wasm` first");
  process.exit(1);
}

const work = mkdtempSync(join(tmpdir(), "highwater-package-"));
try {
  const [packed] = JSON.parse(run("npm", ["pack", "--json", "--pack-destination", work], packageDir));
  const files = packed.files.map((file) => file.path).sort();
  assert.deepEqual(files, [
    "README.md",
    "dist/client.d.ts",
    "dist/client.js",
    "dist/errors.d.ts",
    "dist/errors.js",
    "dist/index.d.ts",
    "dist/index.js",
    "dist/node-init.d.ts",
    "dist/node-init.js",
    "dist/node.d.ts",
    "dist/node.js",
    "dist/react.d.ts",
    "dist/react.js",
    "dist/stores.d.ts",
    "dist/stores.js",
    "dist/tabs.d.ts",
    "dist/tabs.js",
    "dist/tanstack-db.d.ts",
    "dist/tanstack-db.js",
    "dist/tools-node-init.d.ts",
    "dist/tools-node-init.js",
    "dist/tools-node.d.ts",
    "dist/tools-node.js",
    "dist/tools-web.d.ts",
    "dist/tools-web.js",
    "dist/tools.d.ts",
    "dist/tools.js",
    "dist/wasm/api.d.ts",
    "dist/wasm/api.js",
    "dist/wasm/highwater_tools.d.ts",
    "dist/wasm/highwater_tools.js",
    "dist/wasm/highwater_tools_bg.wasm",
    "dist/wasm/highwater_tools_bg.wasm.d.ts",
    "dist/wasm/highwater_wasm.d.ts",
    "dist/wasm/highwater_wasm.js",
    "dist/wasm/highwater_wasm_bg.wasm",
    "dist/wasm/highwater_wasm_bg.wasm.d.ts",
    "dist/wasm/tools_api.d.ts",
    "dist/wasm/tools_api.js",
    "dist/web.d.ts",
    "dist/web.js",
    "package.json",
  ]);

  // The package's metadata as bundlers and Node resolve it: publint (warnings fail too) and
  // arethetypeswrong on the tarball (ESM only: a `require` of it is not supported).
  const bin = (name) => join(packageDir, "..", "node_modules", ".bin", name);
  run(bin("publint"), ["--strict"], packageDir);
  run(bin("attw"), [join(work, packed.filename), "--profile", "esm-only"], work);

  const project = join(work, "project");
  cpSync(here, project, { recursive: true, filter: (path) => !path.endsWith("run.mjs") });
  writeFileSync(join(project, "package.json"), JSON.stringify({ name: "highwater-smoke", private: true, type: "module" }));
  run("npm", ["install", "--no-audit", "--no-fund", "--loglevel=error", join(work, packed.filename)], project);

  const output = JSON.parse(run("node", ["smoke.mjs"], project));
  assert.deepEqual(output, {
    watermark: -1,
    changeStream: "9007199254740993n",
    cursor: 7,
    scope: "46fa6bff-e1f7-5d79-ba0d-967dec3d28b6",
    backfill: true,
    bridge: "unsubscribed",
    error: "HW_INVALID_WATERMARK",
  });

  // Type-check as a Node user (with @types/node) and as a browser user (ES2022 and the DOM
  // only: no @types/node, no ESNext.Disposable lib).
  const typeConfigs = {
    node: { lib: ["ES2022"], types: ["node"], typeRoots: [join(packageDir, "..", "node_modules", "@types")] },
    browser: { lib: ["ES2022", "DOM"], types: [] },
  };
  // `highwater/react` needs React's types, as any React app has them.
  mkdirSync(join(project, "node_modules", "@types"), { recursive: true });
  symlinkSync(join(packageDir, "..", "node_modules", "@types", "react"), join(project, "node_modules", "@types", "react"));
  // `highwater/tanstack-db` needs TanStack DB's, as an app using it has them.
  mkdirSync(join(project, "node_modules", "@tanstack"), { recursive: true });
  symlinkSync(join(packageDir, "..", "node_modules", "@tanstack", "db"), join(project, "node_modules", "@tanstack", "db"));
  for (const [user, options] of Object.entries(typeConfigs)) {
    const compilerOptions = { target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", strict: true, noEmit: true, ...options };
    // TanStack DB's own declarations need the DOM's (IndexedDB, Storage): browser apps only.
    const files = ["smoke.ts", "smoke-react.ts", ...(user === "browser" ? ["smoke-tanstack-db.ts"] : [])];
    writeFileSync(join(project, `tsconfig.${user}.json`), JSON.stringify({ compilerOptions, files }));
    run(tsc, ["-p", `tsconfig.${user}.json`], project);
  }
  // The README's examples, as a user copies them: every `js` and `tsx` block, and the module
  // script of every `html` block, type-checked against the installed package (Node and DOM types; not
  // strict, as plain JavaScript is written, but wrong names, arguments and fields fail).
  const readme = readFileSync(join(packageDir, "README.md"), "utf8");
  const examples = [];
  for (const [, lang, body] of readme.matchAll(/^```(js|tsx|html)\n([\s\S]*?)^```$/gm)) {
    const code = lang === "html" ? /<script type="module">\n([\s\S]*?)<\/script>/.exec(body)?.[1] : body;
    if (code) examples.push({ code, ext: lang === "tsx" ? "tsx" : "mts" });
  }
  assert.ok(examples.length >= 4, `README examples found: ${examples.length}`);
  const exampleFiles = examples.map(({ code, ext }, i) => {
    const name = `readme-${i + 1}.${ext}`;
    // Each example is a module of its own (its names do not meet the others').
    writeFileSync(join(project, name), `${code}\nexport {};\n`);
    return name;
  });
  const readmeOptions = {
    target: "ES2022",
    module: "NodeNext",
    moduleResolution: "NodeNext",
    lib: ["ES2022", "DOM"],
    types: ["node"],
    typeRoots: [join(packageDir, "..", "node_modules", "@types")],
    jsx: "react-jsx",
    strict: false,
    noEmit: true,
  };
  writeFileSync(join(project, "tsconfig.readme.json"), JSON.stringify({ compilerOptions: readmeOptions, files: exampleFiles }));
  run(tsc, ["-p", "tsconfig.readme.json"], project);

  console.log(`packaging test: ok (${packed.filename}, ${packed.size} bytes packed, ${packed.unpackedSize} unpacked)`);
} finally {
  rmSync(work, { recursive: true, force: true });
}
