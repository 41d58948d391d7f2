// `highwater typegen` against a real schema: the types it writes hold every row a real
// `HighwaterClient` receives from `highwater serve` (the rows, written out as a TypeScript
// literal, type-check with `tsc --strict` against the generated interfaces), and the rules'
// omitted columns and unexposed tables are left out.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdirSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";
import { HighwaterClient } from "highwater";
import { BIN, Postgres, Serve, TODOS_DDL, scratch } from "./support.mjs";

const repo = fileURLToPath(new URL("../../../", import.meta.url));
const RULES = {
  tables: {
    todos: { filterColumns: ["owner", "done"], omitColumns: ["secret_note"], require: { owner: "sub" } },
    kinds: { filterColumns: ["id"], omitColumns: ["hidden"] },
  },
};
const KINDS_DDL = `
  CREATE TYPE mood AS ENUM ('sad', 'ok', 'great');
  CREATE DOMAIN positive AS int4 CHECK (VALUE > 0);
  CREATE TABLE kinds (
    id int8 PRIMARY KEY, b bool NOT NULL, i2 int2, i4 int4, i8 int8, f4 float4, f8 float8, n numeric,
    t text, vc varchar(10), u uuid, ts timestamp, tz timestamptz, d date, tm time, j json, jb jsonb,
    ai int4[], at text[], m mood NOT NULL, ma mood[], by bytea, iv interval, p positive, hidden text
  );
  CREATE TABLE unexposed (id int8 PRIMARY KEY);`;

let pg;
let serve;
let work;

before(async () => {
  pg = new Postgres();
  pg.query(TODOS_DDL);
  pg.query(KINDS_DDL);
  pg.query("INSERT INTO todos (id, owner, title, done, secret_note) VALUES (1, 'ada', 'one', true, 's'), (2, 'ada', NULL, false, NULL)");
  pg.query(`INSERT INTO kinds VALUES
    (1, true, 2, 4, 9007199254740993, 1.5, 2.25, 12.5, 'text', 'short', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
     '2026-12-06 10:00:00', '2026-12-06 10:00:00+00', '2026-12-06', '10:30:00', '{"a": [1, null]}', '{"b": {"c": true}}',
     '{1, NULL, 3}', '{"x", NULL}', 'great', '{sad, ok}', '\\x0102', '1 day', 5, 'never sent'),
    (2, false, NULL, NULL, 7, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 'null',
     NULL, '{}', 'sad', NULL, NULL, NULL, NULL, NULL)`);
  serve = new Serve(pg);
  writeFileSync(serve.rules, JSON.stringify(RULES));
  await serve.start();
  work = scratch("typegen");
});

after(async () => {
  await serve?.stop();
  pg?.stop();
  if (work) rmSync(work, { recursive: true, force: true });
});

/** A value as a TypeScript literal: bigints stay bigints. */
function literal(value) {
  if (value === null) return "null";
  if (typeof value === "bigint") return `${value}n`;
  if (Array.isArray(value)) return `[${value.map(literal).join(", ")}]`;
  if (typeof value === "object") {
    return `{ ${Object.entries(value).map(([k, v]) => `${JSON.stringify(k)}: ${literal(v)}`).join(", ")} }`;
  }
  return JSON.stringify(value);
}

test("typegen's interfaces hold every row the client receives, checked by tsc --strict", async () => {
  const rules = join(work, "rules.json");
  writeFileSync(rules, JSON.stringify(RULES));
  execFileSync(BIN, ["typegen", "--upstream", pg.url, "--sync-rules", rules, "--out", join(work, "schema.ts")], {
    stdio: ["ignore", "ignore", "inherit"],
  });
  const schema = readFileSync(join(work, "schema.ts"), "utf8");
  assert.match(schema, /export interface Kinds \{/);
  assert.match(schema, /i8: number \| bigint \| null;/);
  assert.match(schema, /m: "sad" \| "ok" \| "great";/);
  assert.match(schema, /p: string \| null;/, "a domain arrives as text, whatever its base type");
  assert.doesNotMatch(schema, /hidden|secret_note|Unexposed/);

  const client = new HighwaterClient({ url: `ws://127.0.0.1:${serve.port}/sync`, token: serve.token("ada") });
  try {
    const kinds = client.subscribe({ resourceType: "kinds" });
    const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
    await Promise.all([kinds.ready, todos.ready]);
    assert.equal(kinds.rows().length, 2);
    assert.equal(todos.rows().length, 2);
    assert.equal(typeof kinds.rows().find((row) => row.id === 1).i8, "bigint", "past 2^53 a bigint");

    writeFileSync(
      join(work, "check.ts"),
      [
        'import type { Kinds, Tables } from "./schema.js";',
        `export const kinds: Kinds[] = ${literal(kinds.rows())};`,
        `export const todos: Tables["todos"][] = ${literal(todos.rows())};`,
        "// The omitted column is not in the type.",
        "// @ts-expect-error",
        'export const hidden: Kinds["hidden"] = null;',
        "",
      ].join("\n"),
    );
  } finally {
    await client.close();
  }
  mkdirSync(join(work, "node_modules"), { recursive: true });
  symlinkSync(join(repo, "bindings-wasm"), join(work, "node_modules", "highwater"));
  writeFileSync(
    join(work, "tsconfig.json"),
    JSON.stringify({
      compilerOptions: { target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", strict: true, noEmit: true, lib: ["ES2022"], types: [] },
      files: ["check.ts"],
    }),
  );
  try {
    execFileSync(join(repo, "node_modules", ".bin", "tsc"), ["-p", "tsconfig.json"], { cwd: work, encoding: "utf8" });
  } catch (error) {
    assert.fail(`tsc --strict refused the rows against the generated types:\n${error.stdout}\n${readFileSync(join(work, "check.ts"), "utf8")}\n${schema}`);
  }
});
