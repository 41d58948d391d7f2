import assert from "node:assert/strict";
import { test } from "node:test";

import { compareCursors, cursorFromPayload, cursorToParams, isCursorAfter } from "highwater";

const T0 = "2026-07-01T10:00:00.000Z";
const T1 = "2026-07-01T10:00:01.000Z";
const cursor = (id, serverSequence, updatedAt) => ({ id, serverSequence, updatedAt });

test("payloads parse into cursors", () => {
  const table = [
    [null, null],
    [undefined, null],
    ["", null],
    [0, null],
    [false, null],
    [T0, cursor(null, null, T0)],
    [{ id: 42, serverSequence: 1234, updatedAt: T0 }, cursor("42", 1234, T0)],
    [JSON.stringify({ id: "42", serverSequence: "1234", updatedAt: T0 }), cursor("42", 1234, T0)],
    [{ serverSequence: 5 }, null],
    ["1700000000", null],
    ['"2026-07-01"', cursor(null, null, "2026-07-01")],
    [{ id: "a", serverSequence: 0, updatedAt: T0 }, cursor("a", 0, T0)],
    [{ id: "a", serverSequence: " 7 ", updatedAt: T0 }, cursor("a", 7, T0)],
    [[T0], null],
  ];
  for (const [payload, expected] of table) {
    assert.deepEqual(cursorFromPayload(payload), expected, JSON.stringify(payload));
  }
  // A bad sequence inside a string makes the whole text a legacy timestamp...
  const text = JSON.stringify({ id: "a", serverSequence: "abc", updatedAt: T0 });
  assert.deepEqual(cursorFromPayload(text), cursor(null, null, text));
  // ...but in an object it is an error.
  assert.throws(
    () => cursorFromPayload({ id: "a", serverSequence: "abc", updatedAt: T0 }),
    (error) => error.code === "HW_INVALID_CURSOR" && /serverSequence/.test(error.message),
  );
});

test("sequences beyond 2^53 - 1 stay exact as bigint", () => {
  const parsed = cursorFromPayload(`{"id":"x","serverSequence":9007199254740993,"updatedAt":"${T0}"}`);
  assert.equal(parsed.serverSequence, 9007199254740993n);
  assert.equal(compareCursors(parsed, cursor("x", 9007199254740992n, T0)), 1);
  assert.deepEqual(cursorToParams("after", parsed, "client"), {
    afterId: "x",
    afterServerSequence: 9007199254740993n,
    afterUpdatedAt: T0,
  });
});

test("cursor comparison examples", () => {
  const table = [
    [1, cursor("a", 5, T0), null, true],
    [2, null, cursor("a", 5, T0), false],
    [3, cursor("b", 11, T1), cursor("a", 10, T0), true],
    [4, cursor("a", 10, T0), cursor("a", 10, T0), false],
    [5, cursor("x", 9, T1), cursor("y", 10, T0), false],
    [6, cursor("x", 11, T0), cursor("y", 10, T1), true],
    [7, cursor("a", 12, T1), cursor(null, null, T0), true],
    [8, cursor("a", 12, T0), cursor(null, null, T1), false],
    [9, cursor("b", null, T0), cursor("a", null, T0), true],
    [10, cursorFromPayload({ id: "p", serverSequence: "12", updatedAt: T0 }), cursorFromPayload({ id: "p", serverSequence: "9", updatedAt: T0 }), true],
    [11, cursor("a", null, "2026-07-01T10:00:00Z"), cursor("a", null, T0), false],
    [12, cursor("10", null, T0), cursor("9", null, T0), false],
  ];
  for (const [example, candidate, current, after] of table) {
    assert.equal(isCursorAfter(candidate, current), after, `example ${example}`);
    assert.equal(compareCursors(candidate, current) === 1, after, `example ${example} via compare`);
  }
  assert.equal(compareCursors(null, undefined), 0);
  assert.equal(compareCursors(cursor("a", null, "2026-07-01T10:00:00Z"), cursor("a", null, T0)), 0);
});

test("compareCursors is antisymmetric over a mixed set", () => {
  const cursors = [null, cursor("a", 1, T0), cursor("b", 2, T0), cursor("c", 2, T1), cursor(null, null, T0), cursor("z", null, T1)];
  for (const a of cursors) {
    for (const b of cursors) {
      assert.equal(compareCursors(a, b), -compareCursors(b, a) || 0, `${JSON.stringify(a)} vs ${JSON.stringify(b)}`);
    }
  }
});

test("params: the client form omits a zero sequence", () => {
  const c = cursor("42", 1234, T0);
  assert.deepEqual(cursorToParams("after", c, "client"), { afterId: "42", afterServerSequence: 1234, afterUpdatedAt: T0 });
  assert.deepEqual(cursorToParams("upTo", c, "server"), { upToId: "42", upToServerSequence: 1234, upToUpdatedAt: T0 });
  const zero = cursor(null, 0, T0);
  assert.deepEqual(cursorToParams("after", zero, "client"), { afterId: null, afterUpdatedAt: T0 });
  assert.deepEqual(cursorToParams("after", zero, "server"), { afterId: null, afterServerSequence: 0, afterUpdatedAt: T0 });
  assert.deepEqual(Object.keys(cursorToParams("after", c, "client")), ["afterId", "afterServerSequence", "afterUpdatedAt"]);
  assert.deepEqual(cursorToParams("after", null, "client"), {});
});

test("bad arguments throw coded errors", () => {
  assert.throws(() => cursorToParams("before", null, "client"), (e) => e.code === "HW_INVALID_ARGUMENT" && /before/.test(e.message));
  assert.throws(() => cursorToParams("after", null, "browser"), (e) => e.code === "HW_INVALID_ARGUMENT");
  assert.throws(() => compareCursors({ id: "a" }, null), (e) => e.code === "HW_INVALID_CURSOR" && /updatedAt/.test(e.message));
  assert.throws(() => isCursorAfter("2026-07-01", null), (e) => e.code === "HW_INVALID_CURSOR");
});
