import assert from "node:assert/strict";
import { test } from "node:test";

import * as wasm from "../../dist/wasm/api.js";
import * as highwater from "highwater";

test("the package re-exports every engine binding", () => {
  // The loader and glue internals (a dev build also exports `__wasm`) are not API.
  const internal = (name) => name === "initSync" || name.startsWith("__");
  const missing = Object.keys(wasm).filter((name) => !internal(name) && !(name in highwater));
  assert.deepEqual(missing, []);
  assert.equal(typeof highwater.init, "function");
  assert.equal(typeof highwater.isHighwaterError, "function");
});
