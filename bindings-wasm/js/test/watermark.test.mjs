import assert from "node:assert/strict";
import { test } from "node:test";

import { compareWatermarks, isHighwaterError, lsnToWatermark, watermarkToLsn } from "highwater";

// Worked examples of docs/protocol/change-stream.md, "Watermarks": LSN text, watermark.
const LSNS = [
  ["0/0", "00"],
  ["0/A", "0a"],
  ["0/16B3748", "4e672g"],
  ["0/1A2B3C4D", "579e6a5"],
  ["1/0", "61z141z4"],
  ["16/B374D848", "718sh0nk8"],
  ["FFFFFFFF/FFFFFFFF", "c3w5e11264sgsf"],
];

test("lsn and watermark convert both ways", () => {
  for (const [lsn, watermark] of LSNS) {
    assert.equal(lsnToWatermark(lsn), watermark, lsn);
    assert.equal(watermarkToLsn(watermark), lsn, watermark);
  }
  assert.equal(lsnToWatermark("16/b374d848"), "718sh0nk8", "lowercase hex is accepted");
});

test("the lsn of a state version is the lsn of its major part", () => {
  assert.equal(watermarkToLsn("718sh0nk8.123"), "16/B374D848");
  assert.equal(watermarkToLsn("579e6a5.01"), "0/1A2B3C4D");
});

test("compareWatermarks orders majors, then minors", () => {
  const ascending = ["00", "0a", "0z", "110", "579e6a5", "579e6a5.01", "579e6a5.02", "579e6a6", "c3w5e11264sgsf"];
  for (const [i, a] of ascending.entries()) {
    for (const [j, b] of ascending.entries()) {
      assert.equal(compareWatermarks(a, b), Math.sign(i - j), `${a} vs ${b}`);
    }
  }
});

test("watermark order equals lsn order for random positions", () => {
  // Deterministic LCG so a failure replays.
  let seed = 0x2545f4914f6cdd1dn;
  const next = () => (seed = (seed * 6364136223846793005n + 1442695040888963407n) & 0xffffffffffffffffn);
  const lsnText = (v) => `${(v >> 32n).toString(16).toUpperCase()}/${(v & 0xffffffffn).toString(16).toUpperCase()}`;
  for (let k = 0; k < 500; k++) {
    // Mix in small values so short encodings are compared with long ones.
    const a = k % 3 === 0 ? next() % 5000n : next();
    const b = next() >> (next() % 64n);
    const expected = a < b ? -1 : a > b ? 1 : 0;
    const [wa, wb] = [lsnToWatermark(lsnText(a)), lsnToWatermark(lsnText(b))];
    assert.equal(compareWatermarks(wa, wb), expected, `${lsnText(a)} vs ${lsnText(b)}`);
    assert.equal(watermarkToLsn(wa), lsnText(a));
  }
});

test("invalid input throws coded errors", () => {
  const cases = [
    [() => compareWatermarks("0A", "00"), "HW_INVALID_WATERMARK", /0A/],
    [() => compareWatermarks("00", "00.01.01"), "HW_INVALID_WATERMARK", /00\.01\.01/],
    [() => compareWatermarks("", "00"), "HW_INVALID_WATERMARK", /StateVersion/],
    [() => watermarkToLsn("1a"), "HW_INVALID_WATERMARK", /"1a"/],
    [() => lsnToWatermark("G/0"), "HW_INVALID_LSN", /G\/0/],
    [() => lsnToWatermark("123456789/0"), "HW_INVALID_LSN", /LSN/],
    [() => watermarkToLsn(`z${"z".repeat(36)}`), "HW_WATERMARK_BEYOND_LSN", /beyond 64 bits/],
  ];
  for (const [call, code, message] of cases) {
    assert.throws(call, (error) => {
      assert.ok(error instanceof Error, "a real Error");
      assert.equal(error.name, "HighwaterError");
      assert.equal(error.code, code);
      assert.match(error.message, message);
      assert.equal(error.path, undefined, "no path outside decoding");
      assert.ok(isHighwaterError(error, code));
      assert.ok(!isHighwaterError(error, "HW_INVALID_MESSAGE"));
      return true;
    });
  }
  assert.ok(!isHighwaterError(new Error("plain")));
});
