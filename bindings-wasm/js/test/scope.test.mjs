import assert from "node:assert/strict";
import { test } from "node:test";

import { scopeDigest, scopeMatches } from "highwater";

test("scope digests", () => {
  const table = [
    [{ resourceType: null, conditions: {}, owner: "token-abc" }, "848fc985-57e9-5355-82a4-467eb5f792cd"],
    [{ resourceType: null, conditions: {} }, "6c2ff54c-cd6a-5ecc-810f-a80b20aa0c85"],
    [{ resourceType: "Task", conditions: { project_id: "p1" } }, "46fa6bff-e1f7-5d79-ba0d-967dec3d28b6"],
    [{ resourceType: "Task", conditions: { status: ["open", "done"], project_id: 5 } }, "3b36dacf-b9e6-5e95-b395-d4b38bd5615b"],
    [{ resourceType: "Task", conditions: { title: "Blåbær" } }, "210e4b5a-443b-52c1-a770-e32636745b9c"],
  ];
  for (const [scope, digest] of table) assert.equal(scopeDigest(scope), digest, JSON.stringify(scope));
});

test("digests ignore condition key order and treat 5.0 as 5", () => {
  const a = scopeDigest({ resourceType: "Task", conditions: { project_id: 5, status: ["open", "done"] } });
  const b = scopeDigest({ resourceType: "Task", conditions: { status: ["open", "done"], project_id: 5.0 } });
  assert.equal(a, b);
  assert.notEqual(a, scopeDigest({ resourceType: "Task", conditions: { status: ["done", "open"], project_id: 5 } }));
  assert.equal(scopeDigest({ resourceType: null }), scopeDigest({ resourceType: null, conditions: {} }));
});

test("digests reject conditions that are not equality", () => {
  assert.throws(
    () => scopeDigest({ resourceType: "Task", conditions: { project: { id: 1 } } }),
    (e) => e.code === "HW_INVALID_SCOPE" && /project/.test(e.message),
  );
  assert.throws(() => scopeDigest({ resourceType: 7, conditions: {} }), (e) => e.code === "HW_INVALID_SCOPE");
});

test("broadcast routing", () => {
  const scope = { resourceType: "Task", conditions: { projectId: [1, 2], state: "open" } };
  assert.ok(scopeMatches(scope, { resourceType: "Task", projectId: 2, state: "open" }));
  assert.ok(scopeMatches(scope, { resourceType: "Task", projectId: "1", state: "open" }), "5 matches \"5\"");
  assert.ok(!scopeMatches(scope, { resourceType: "Task", projectId: 3, state: "open" }));
  assert.ok(!scopeMatches(scope, { resourceType: "Task", projectId: 1 }), "a missing condition key");
  assert.ok(!scopeMatches(scope, { resourceType: "Project", projectId: 1, state: "open" }));
  assert.ok(!scopeMatches(scope, { projectId: 1, state: "open" }), "no type fails closed");

  const allTypes = { resourceType: null, conditions: {}, resourceTypes: ["Task"] };
  assert.ok(scopeMatches(allTypes, { resourceType: "Task", id: 9 }));
  assert.ok(!scopeMatches(allTypes, { resourceType: "Comment", id: 9 }));
  assert.ok(!scopeMatches({ resourceType: null, conditions: {} }, { resourceType: "Task" }));
  assert.ok(scopeMatches({ resourceType: " Task ", conditions: {} }, { resourceType: "Task" }), "types are trimmed");
});

test("routing rejects malformed scopes and params", () => {
  assert.throws(() => scopeMatches({ resourceType: "Task" }, { resourceType: "Task" }), (e) => e.code === "HW_INVALID_SCOPE" && /conditions/.test(e.message));
  assert.throws(() => scopeMatches({ resourceType: "Task", conditions: [] }, {}), (e) => e.code === "HW_INVALID_SCOPE");
  assert.throws(() => scopeMatches({ resourceType: "Task", conditions: {} }, ["Task"]), (e) => e.code === "HW_INVALID_ARGUMENT");
});
