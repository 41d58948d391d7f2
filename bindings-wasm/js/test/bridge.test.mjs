import assert from "node:assert/strict";
import { test } from "node:test";

import { ScopeBridge, scopeDigest } from "highwater/tools";

const at = (second) => `2026-07-01T10:00:${String(second).padStart(2, "0")}.000Z`;
const cursor = (sequence) => ({ id: String(sequence), serverSequence: sequence, updatedAt: at(sequence % 60) });
const entry = (sequence, extra = {}) => ({
  id: String(sequence),
  resourceId: `t${sequence}`,
  resourceType: "Task",
  serverSequence: sequence,
  syncType: "update",
  updatedAt: at(Number(sequence) % 60),
  data: { id: `t${sequence}`, title: `Task ${sequence}` },
  projectId: "p1",
  ...extra,
});
const message = (subscriptionId, syncs, echoOrigin = null) =>
  JSON.stringify({ type: "channel-message", subscriptionId, body: { echoOrigin, syncs } });
const SCOPE = scopeDigest({ resourceType: "Task", conditions: { project_id: "p1" } });
const channel = (after) => ({
  scope: SCOPE,
  params: { resourceType: "Task", conditions: { projectId: "p1" }, authenticationToken: "token" },
  ...(after !== undefined && { after }),
});
const types = (effects) => effects.map((effect) => effect.type);

/** A bridge subscribed from `after`, its replay applied and confirmed. */
function subscribed(after) {
  const bridge = new ScopeBridge({ resourceTypes: ["Task"], localOrigin: "device-1" });
  bridge.subscribe([channel(after)]);
  assert.deepEqual(types(bridge.handleFrame({ type: "channel-subscribed", subscriptionId: "sync-1" })), ["ready"]);
  return bridge;
}

test("scenario 09: subscribe, apply the replay, persist the cursor and get ready", () => {
  const bridge = new ScopeBridge({ resourceTypes: ["Task"], localOrigin: "device-1" });
  assert.equal(bridge.state, "unsubscribed");
  const [send, ...rest] = bridge.subscribe([channel(cursor(2))]);
  assert.deepEqual(rest, []);
  assert.equal(send.type, "sendSubscribe");
  assert.equal(send.scope, SCOPE);
  assert.equal(send.subscriptionId, "sync-1");
  assert.deepEqual(JSON.parse(send.frame), {
    type: "channel-subscribe",
    subscriptionId: "sync-1",
    channelType: "velocious-sync",
    params: send.params,
  });
  assert.equal(send.params.afterServerSequence, 2);
  assert.equal(send.params.afterUpdatedAt, at(2));
  assert.equal(bridge.state, "subscribing");

  const [batch] = bridge.handleFrame(message("sync-1", [entry(3), entry(4)]));
  assert.equal(batch.type, "applyBatch");
  assert.equal(batch.reset, false);
  assert.deepEqual(batch.changes.map((c) => c.resourceId), ["t3", "t4"]);
  assert.deepEqual(batch.changes[0].data, { id: "t3", title: "Task 3" });
  assert.deepEqual(batch.changes[1].cursor, cursor(4));
  assert.equal(batch.changes[0].entry.projectId, "p1", "scope attributes stay on the entry");

  assert.deepEqual(bridge.handleFrame({ type: "channel-subscribed", subscriptionId: "sync-1" }), [], "waits for the batch in flight");
  assert.equal(bridge.status().applying, batch.ticket);
  assert.deepEqual(bridge.applied(batch.ticket), [
    { type: "saveCursor", scope: SCOPE, cursor: cursor(4) },
    { type: "ready", generation: 0 },
  ]);
  assert.equal(bridge.state, "subscribed");
  assert.deepEqual(bridge.persistedCursor(SCOPE), cursor(4));
  const status = bridge.status();
  assert.equal(status.state, "subscribed");
  assert.deepEqual(status.channels.map((c) => [c.scope, c.ready, c.persistedCursor]), [[SCOPE, true, cursor(4)]]);
});

test("scenario 16: cursors only move forwards and are saved only on change", () => {
  const bridge = subscribed(cursor(5));
  const [old] = bridge.handleFrame(message("sync-1", [entry(3)]));
  assert.deepEqual(bridge.applied(old.ticket), [], "a duplicate does not regress the cursor");
  const [next] = bridge.handleFrame(message("sync-1", [entry(9), entry(7)]));
  assert.deepEqual(bridge.applied(next.ticket), [{ type: "saveCursor", scope: SCOPE, cursor: cursor(9) }]);
  assert.deepEqual(bridge.persistedCursor(SCOPE), cursor(9));
});

test("big sequences stay exact", () => {
  const bridge = subscribed(null);
  const big = 9007199254740993n;
  const text = `{"type":"channel-message","subscriptionId":"sync-1","body":{"syncs":[{"id":"x","resourceType":"Task","serverSequence":${big},"updatedAt":"${at(1)}","data":{"n":${big}}}]}}`;
  const [batch] = bridge.handleFrame(text);
  assert.equal(batch.changes[0].cursor.serverSequence, big);
  assert.equal(batch.changes[0].data.n, big);
  const [save] = bridge.applied(batch.ticket);
  assert.equal(save.cursor.serverSequence, big);
});

test("scenario 17 and 26: echoes drop, bad messages are reported, a failed apply keeps the cursor", () => {
  const bridge = subscribed(cursor(2));
  assert.deepEqual(bridge.handleFrame(message("sync-1", [entry(8)], "device-1")), [
    { type: "dropped", subscriptionId: "sync-1", reason: "echo" },
  ]);
  const [rejected] = bridge.handleFrame({ type: "channel-message", subscriptionId: "sync-1", body: ["not", "an", "envelope"] });
  assert.equal(rejected.type, "messageRejected");
  assert.equal(rejected.error.code, "invalid-envelope");
  assert.match(rejected.error.message, /envelope object/);
  const [batch] = bridge.handleFrame(message("sync-1", [entry(10)]));
  const [failed] = bridge.applied(batch.ticket, "disk full");
  assert.deepEqual(failed, { type: "applyFailed", ticket: batch.ticket, scope: SCOPE, message: "disk full" });
  assert.deepEqual(bridge.persistedCursor(SCOPE), cursor(2));
  assert.deepEqual(bridge.handleFrame(message("sync-9", [entry(11)])), [
    { type: "dropped", subscriptionId: "sync-9", reason: "unknownSubscription" },
  ]);
});

test("scenario 15: session-gone re-subscribes from the persisted cursor", () => {
  const bridge = subscribed(cursor(4));
  const effects = bridge.handleFrame({ type: "session-gone" });
  const send = effects.find((effect) => effect.type === "sendSubscribe");
  assert.ok(send, JSON.stringify(effects));
  assert.notEqual(send.subscriptionId, "sync-1");
  assert.equal(send.params.afterServerSequence, 4);
  assert.equal(bridge.state, "subscribing");
});

test("scenario 20: unsubscribe sends channel-unsubscribe and bumps the generation", () => {
  const bridge = subscribed(null);
  const [unsubscribe] = bridge.unsubscribe();
  assert.equal(unsubscribe.type, "sendUnsubscribe");
  assert.deepEqual(JSON.parse(unsubscribe.frame), { type: "channel-unsubscribe", subscriptionId: "sync-1" });
  assert.equal(bridge.state, "unsubscribed");
  assert.equal(bridge.generation, 1);
});

test("frames the bridge does not use give no effects", () => {
  const bridge = subscribed(null);
  assert.deepEqual(bridge.handleFrame('{"type":"session-established","sessionId":"s1","graceSeconds":30}'), []);
});

test("misuse throws coded errors", () => {
  assert.throws(() => new ScopeBridge({}), (e) => e.code === "HW_INVALID_ARGUMENT" && /resourceTypes/.test(e.message));
  assert.throws(() => new ScopeBridge({ resourceTypes: ["Task"], colour: "red" }), (e) => e.code === "HW_INVALID_ARGUMENT");
  const bridge = new ScopeBridge({ resourceTypes: ["Task"] });
  assert.throws(() => bridge.subscribe([]), (e) => e.code === "HW_INVALID_BRIDGE_INPUT");
  assert.throws(() => bridge.subscribe([{ ...channel(null), scope: "not-a-digest" }]), (e) => e.code === "HW_INVALID_SCOPE");
  assert.throws(() => bridge.subscribe([{ scope: SCOPE, params: { resourceType: "Task" } }]), (e) => e.code === "HW_INVALID_SCOPE" && /conditions/.test(e.message));
  assert.throws(() => bridge.subscribe([{ scope: SCOPE, params: { resourceType: "Comment", conditions: {} } }]), (e) => e.code === "HW_INVALID_BRIDGE_INPUT");
  assert.throws(() => bridge.handleFrame("{"), (e) => e.code === "HW_INVALID_FRAME");
  assert.throws(() => bridge.handleFrame({ type: "nope" }), (e) => e.code === "HW_INVALID_FRAME" && /nope/.test(e.message));
  bridge.subscribe([channel(null)]);
  const [batch] = bridge.handleFrame(message("sync-1", [entry(1)]));
  assert.throws(() => bridge.applied(batch.ticket + 1), (e) => e.code === "HW_INVALID_BRIDGE_INPUT");
  assert.throws(() => bridge.applied(-1), (e) => e.code === "HW_INVALID_ARGUMENT");
  assert.throws(() => bridge.applied(1.5), (e) => e.code === "HW_INVALID_ARGUMENT");
  assert.throws(() => bridge.persistedCursor("nope"), (e) => e.code === "HW_INVALID_SCOPE");
});
