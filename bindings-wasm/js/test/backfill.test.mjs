import assert from "node:assert/strict";
import { test } from "node:test";

import { BackfillTracker } from "highwater/tools";

const relation = { schema: "public", name: "foo", rowKey: { columns: ["id"] } };
const begin = ["begin", { tag: "begin" }, { commitWatermark: "01" }];
const commit = ["commit", { tag: "commit" }, { watermark: "01" }];
const rollback = ["rollback", { tag: "rollback" }];
const mark = (progressMark) => ({ progressMark });
const backfill = (columns, progressMarks) => [
  "data",
  { tag: "backfill", relation, columns, watermark: "01", rowValues: [], ...(progressMarks && { progressMarks }) },
];
const completed = (columns, previous) => [
  "data",
  { tag: "backfill-completed", relation, columns, watermark: "01", progressMarks: previous ? { previous } : {} },
];
const request = (columns) => ({
  table: { schema: "public", name: "foo", metadata: null },
  columns: Object.fromEntries(
    Object.entries(columns).map(([name, progress], k) => [name, { id: { attNum: k + 2 }, ...(progress && { progress }) }]),
  ),
});
const progressOf = (tracker) =>
  Object.fromEntries(
    tracker.requests().flatMap((r) => Object.entries(r.columns).map(([name, c]) => [`${r.table.name}.${name}`, c.progress?.progressMark ?? null])),
  );

test("contiguous progress is taken, gaps are ignored", () => {
  const tracker = new BackfillTracker([request({ a: mark("05"), b: null })]);
  assert.equal(tracker.apply(begin).length, 0);
  assert.ok(tracker.inTransaction);
  assert.deepEqual(tracker.apply(backfill(["a", "b"], { previous: mark("05"), current: mark("08") })), ["public.foo.b"]);
  assert.deepEqual(progressOf(tracker), { "foo.a": "05", "foo.b": null }, "uncommitted progress is not reported");
  tracker.apply(commit);
  assert.ok(!tracker.inTransaction);
  assert.deepEqual(progressOf(tracker), { "foo.a": "08", "foo.b": null });

  tracker.apply(begin);
  assert.deepEqual(tracker.apply(backfill(["a", "b"], { current: mark("02") })), [], "a run from scratch is accepted");
  tracker.apply(commit);
  assert.deepEqual(progressOf(tracker), { "foo.a": "02", "foo.b": "02" });
});

test("rollback discards the open transaction", () => {
  const tracker = new BackfillTracker([request({ a: null })]);
  tracker.apply(begin);
  tracker.apply(backfill(["a"], { current: mark("03") }));
  tracker.apply(rollback);
  assert.deepEqual(progressOf(tracker), { "foo.a": null });
});

test("completion removes columns, and the table with its last column", () => {
  const tracker = new BackfillTracker([request({ a: mark("05"), b: mark("05") })]);
  tracker.apply(begin);
  tracker.apply(completed(["a"], mark("05")));
  tracker.apply(commit);
  assert.deepEqual(progressOf(tracker), { "foo.b": "05" });
  assert.ok(!tracker.isEmpty);
  tracker.apply(begin);
  tracker.apply(completed(["b"], mark("04")));
  tracker.apply(commit);
  assert.ok(tracker.isEmpty);
  assert.deepEqual(tracker.requests(), []);
});

test("schema changes add and rename pending columns; text messages work too", () => {
  const tracker = new BackfillTracker();
  assert.ok(tracker.isEmpty);
  tracker.apply(JSON.stringify(begin));
  tracker.apply(
    '["data",{"tag":"add-column","table":{"schema":"public","name":"foo"},"column":{"name":"c","spec":{"pos":3,"dataType":"int8"}},' +
      '"tableMetadata":{"rowKey":{"id":{"attNum":1}}},"backfill":{"attNum":3,"big":9007199254740993}}]',
  );
  tracker.apply(["data", { tag: "update-column", table: { schema: "public", name: "foo" }, old: { name: "c", spec: { pos: 3, dataType: "int8" } }, new: { name: "d", spec: { pos: 3, dataType: "int8" } } }]);
  tracker.apply(commit);
  const [pending] = tracker.requests();
  assert.deepEqual(pending.table, { schema: "public", name: "foo", metadata: { rowKey: { id: { attNum: 1 } } } });
  assert.deepEqual(Object.keys(pending.columns), ["d"]);
  assert.equal(pending.columns.d.id.big, 9007199254740993n, "opaque backfill ids keep big integers");
  assert.equal(pending.columns.d.progress, undefined);
});

test("uncovered lists what another party's stream will not deliver", () => {
  const subscriber = new BackfillTracker([request({ a: mark("05"), b: mark("05") })]);
  const stream = new BackfillTracker([request({ a: mark("03"), b: mark("07") })]);
  assert.deepEqual(subscriber.uncovered(stream), ["public.foo.b"]);
  assert.deepEqual(subscriber.uncovered(new BackfillTracker()), ["public.foo.a", "public.foo.b"]);
});

test("bad requests and messages throw coded errors", () => {
  assert.throws(() => new BackfillTracker([request({ a: null }), request({ b: null })]), (e) => e.code === "HW_INVALID_BACKFILL" && /public\.foo/.test(e.message));
  assert.throws(
    () => new BackfillTracker([request({ a: null }), { table: { schema: "s", metadata: null }, columns: {} }]),
    (e) => e.code === "HW_INVALID_MESSAGE" && e.path === "$[1].table.name" && e.message.startsWith("at $[1].table.name"),
  );
  assert.throws(() => new BackfillTracker({}), (e) => e.code === "HW_INVALID_MESSAGE" && e.path === "$");
  const tracker = new BackfillTracker();
  assert.throws(() => tracker.apply(["begin", { tag: "begin" }, { commitWatermark: "1a" }]), (e) => e.code === "HW_INVALID_MESSAGE" && e.path === "$[2].commitWatermark");
  assert.throws(() => tracker.apply('["begin"'), (e) => e.code === "HW_INVALID_JSON");
  assert.throws(() => tracker.apply(["reserve-snapshot", { taskID: "t" }]), (e) => e.code === "HW_INVALID_MESSAGE", "upstream messages are not part of the stream");
});
