// The browser entry point, exercised from Node: nothing works before `init`, everything after.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { compareWatermarks, init, scopeDigest } from "../../dist/web.js";

test("the web entry needs init, and init may run twice", async () => {
  assert.throws(() => compareWatermarks("00", "01"));
  const wasm = readFileSync(new URL("../../dist/wasm/highwater_wasm_bg.wasm", import.meta.url));
  await init(wasm);
  await init(wasm);
  assert.equal(compareWatermarks("00", "0a"), -1);
  assert.equal(scopeDigest({ resourceType: null, conditions: {} }), "6c2ff54c-cd6a-5ecc-810f-a80b20aa0c85");
});
