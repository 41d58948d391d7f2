import assert from "node:assert/strict";
import { test } from "node:test";

import * as wasm from "../../dist/wasm/api.js";
import * as toolsWasm from "../../dist/wasm/tools_api.js";
import * as highwater from "highwater";
import * as tools from "highwater/tools";

// The loader and glue internals (a dev build also exports `__wasm`) are not API.
const internal = (name) => name === "initSync" || name.startsWith("__");

test("the package re-exports every binding of the client's module", () => {
  const missing = Object.keys(wasm).filter((name) => !internal(name) && !(name in highwater));
  assert.deepEqual(missing, []);
  assert.equal(typeof highwater.init, "function");
  assert.equal(typeof highwater.isHighwaterError, "function");
});

test("highwater/tools re-exports every binding of the tools' module, and the client has none of them", () => {
  const missing = Object.keys(toolsWasm).filter((name) => !internal(name) && !(name in tools));
  assert.deepEqual(missing, []);
  assert.equal(typeof tools.init, "function");
  assert.equal(typeof tools.isHighwaterError, "function");
  for (const name of ["parseChangeStreamMessage", "BackfillTracker", "ScopeBridge"]) {
    assert.ok(name in tools, name);
    assert.ok(!(name in highwater), `${name} is not in the client's module`);
  }
  assert.ok(!("SyncClientCore" in tools), "the tools' module has no client");
});
