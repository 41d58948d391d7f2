import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { describe, test } from "node:test";

import {
  encodeChangeStreamFrame,
  encodeChangeStreamMessage,
  isHighwaterError,
  parseChangeStreamFrame,
  parseChangeStreamMessage,
} from "highwater/tools";

import { jsRepresentationErrors, missingFrom, parseRaw } from "./support/raw-json.mjs";

const VECTORS = new URL("../../../tests/vectors/change-stream/", import.meta.url);

/** The lines of a vector file (a final newline does not make a line). */
function lines(name) {
  const text = readFileSync(new URL(name, VECTORS), "utf8");
  return (text.endsWith("\n") ? text.slice(0, -1) : text).split("\n");
}

const isBareMessage = (line) => line.trimStart().startsWith("[");

/** Asserts `text` keeps everything of `original` (raw parses); the engine may only add `rowKey`. */
function assertKeeps(original, text, label) {
  const { differences, added } = missingFrom(original, parseRaw(text));
  assert.deepEqual(differences, [], `${label}: values changed in ${text}`);
  assert.deepEqual(
    added.filter((path) => !path.endsWith(".rowKey")),
    [],
    `${label}: keys invented in ${text}`,
  );
}

/** Round-trips one message (JS value + its original raw parse) and checks it is stable. */
function checkMessage(message, raw, label) {
  assert.deepEqual(jsRepresentationErrors(raw, message), [], `${label}: JS representation`);
  const encoded = encodeChangeStreamMessage(message);
  assertKeeps(raw, encoded, label);
  assert.equal(encodeChangeStreamMessage(parseChangeStreamMessage(encoded)), encoded, `${label}: stable`);
}

describe("every valid vector round-trips", () => {
  for (const [index, line] of lines("valid.jsonl").entries()) {
    const label = `valid.jsonl:${index + 1}`;
    test(`${label} ${line.slice(0, 60)}`, () => {
      const raw = parseRaw(line);
      if (isBareMessage(line)) {
        checkMessage(parseChangeStreamMessage(line), raw, label);
        return;
      }
      const frame = parseChangeStreamFrame(line);
      if (raw.has("msg")) checkMessage(frame.msg, raw.get("msg"), `${label} msg`);
      if (raw.has("batch")) {
        assert.equal(frame.batch.length, raw.get("batch").length);
        frame.batch.forEach((message, k) => checkMessage(message, raw.get("batch")[k], `${label} batch[${k}]`));
      }
      const encoded = encodeChangeStreamFrame(frame);
      assertKeeps(raw, encoded, label);
      assert.equal(encodeChangeStreamFrame(parseChangeStreamFrame(encoded)), encoded, `${label}: stable`);
    });
  }
});

describe("every invalid vector throws with its path", () => {
  const expected = lines("invalid.expected.jsonl").map((line) => JSON.parse(line));
  const invalid = lines("invalid.jsonl");
  test("one expectation per line", () => assert.equal(expected.length, invalid.length));
  for (const [index, line] of invalid.entries()) {
    const { path, reason } = expected[index];
    test(`invalid.jsonl:${index + 1} ${path} ${reason}`, () => {
      const parse = isBareMessage(line) ? parseChangeStreamMessage : parseChangeStreamFrame;
      assert.throws(
        () => parse(line),
        (error) => {
          assert.ok(error instanceof Error);
          assert.ok(isHighwaterError(error));
          const code = error.message.includes("expected JSON text") ? "HW_INVALID_JSON" : "HW_INVALID_MESSAGE";
          assert.equal(error.code, code, error.message);
          assert.equal(error.path, path, error.message);
          assert.ok(error.message.includes(reason), `${JSON.stringify(error.message)} mentions ${reason}`);
          return true;
        },
      );
    });
  }
});

const BIG_ROW =
  '["data",{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},' +
  '"new":{"id":9007199254740993,"safe":9007199254740991,"neg":-9007199254740992,"huge":123456789012345678901234567890,' +
  '"f":1.5,"list":[18446744073709551616,1]}}]';

test("integers beyond 2^53 - 1 become bigint, others stay numbers", () => {
  const row = parseChangeStreamMessage(BIG_ROW)[1].new;
  assert.equal(row.id, 9007199254740993n);
  assert.equal(row.safe, 9007199254740991);
  assert.equal(row.neg, -9007199254740992n);
  assert.equal(row.huge, 123456789012345678901234567890n);
  assert.equal(row.f, 1.5);
  assert.deepEqual(row.list, [18446744073709551616n, 1]);
  assert.equal(encodeChangeStreamMessage(parseChangeStreamMessage(BIG_ROW)), BIG_ROW);
});

test("bigint values written from JS are encoded exactly", () => {
  const message = [
    "data",
    {
      tag: "insert",
      relation: { schema: "s", name: "t", rowKey: { columns: ["id"] } },
      new: { id: 2n ** 70n, small: 5n, neg: -(2n ** 64n), n: 7, x: 0.25 },
    },
  ];
  const text = encodeChangeStreamMessage(message);
  assert.ok(text.includes('"new":{"id":1180591620717411303424,"small":5,"neg":-18446744073709551616,"n":7,"x":0.25}'), text);
  assert.equal(parseChangeStreamMessage(text)[1].new.id, 2n ** 70n);
});

test("unknown keys at every level survive, in order", () => {
  const message = [
    "data",
    {
      tag: "insert",
      relation: { schema: "s", name: "t", rowKey: { columns: ["id"], later: { z: 1, a: [2n ** 64n] } }, extra: true },
      new: { z: 1, a: 2, m: 3 },
      futureField: { b: null, a: "kept" },
    },
  ];
  const back = parseChangeStreamMessage(encodeChangeStreamMessage(message));
  assert.deepEqual(back, message);
  assert.deepEqual(Object.keys(back[1].new), ["z", "a", "m"]);
  assert.deepEqual(Object.keys(back[1].futureField), ["b", "a"]);
});

test("a __proto__ column is an own property, not a prototype", () => {
  const text = '["data",{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"new":{"id":1,"__proto__":{"x":1}}}]';
  const row = parseChangeStreamMessage(text)[1].new;
  assert.equal(Object.getPrototypeOf(row), Object.prototype);
  assert.ok(Object.hasOwn(row, "__proto__"));
  assert.equal(row.x, undefined);
  assert.equal(encodeChangeStreamMessage(parseChangeStreamMessage(text)), text);
});

describe("encoding rejects what is not a valid message", () => {
  const insert = (row) => ["data", { tag: "insert", relation: { schema: "s", name: "t", rowKey: { columns: ["id"] } }, new: row }];
  const cases = [
    ["a bad watermark", ["begin", { tag: "begin" }, { commitWatermark: "1a" }], "HW_INVALID_MESSAGE", "$[2].commitWatermark"],
    ["a wrong tag", ["rollback", { tag: "commit" }], "HW_INVALID_MESSAGE", "$[1].tag"],
    ["a big integer in a number field", ["commit", { tag: "commit", commitTimeMs: 2n ** 60n }, { watermark: "00" }], "HW_INVALID_MESSAGE", "$[1].commitTimeMs"],
    ["a function", insert({ id: 1, f: () => 1 }), "HW_INVALID_VALUE", "$[1].new.f"],
    ["NaN", insert({ id: Number.NaN }), "HW_INVALID_VALUE", "$[1].new.id"],
    ["Infinity in an array", insert({ id: 1, "a b": [1, Infinity] }), "HW_INVALID_VALUE", '$[1].new["a b"][1]'],
    ["a Date", insert({ id: 1, at: new Date(0) }), "HW_INVALID_VALUE", "$[1].new.at"],
    ["undefined in an array", insert({ id: 1, list: [undefined] }), "HW_INVALID_VALUE", "$[1].new.list[0]"],
    ["a string", "begin", "HW_INVALID_MESSAGE", "$"],
  ];
  for (const [what, message, code, path] of cases) {
    test(what, () => {
      assert.throws(
        () => encodeChangeStreamMessage(message),
        (error) => error instanceof Error && error.code === code && error.path === path,
      );
    });
  }
  test("a cycle is refused, not followed", () => {
    const row = { id: 1 };
    row.self = row;
    assert.throws(
      () => encodeChangeStreamMessage(insert(row)),
      (error) => error.code === "HW_INVALID_VALUE" && error.path.startsWith("$[1].new.self.self") && /cycle/.test(error.message),
    );
  });
  test("undefined object members are left out, like JSON.stringify", () => {
    const text = encodeChangeStreamMessage(insert({ id: 1, gone: undefined }));
    assert.ok(text.endsWith('"new":{"id":1}}]'), text);
  });
  test("a frame must be an object", () => {
    assert.throws(
      () => encodeChangeStreamFrame(["status", { tag: "status" }]),
      (error) => error.code === "HW_INVALID_MESSAGE" && error.path === "$",
    );
  });
});
