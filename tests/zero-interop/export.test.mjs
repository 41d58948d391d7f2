// A stock Zero 1.9 view-syncer that starts from Highwater alone: its replica is exported by
// `highwater zero-replica --from` out of a running Highwater whose tables already held rows
// at its initial sync, with no Zero replication-manager and no Zero initial sync. The export
// must have exactly the layout Zero's own initial sync writes (checked against one made by
// Zero's code for the same publication), the view-syncer must subscribe at the export's
// watermark, follow the rest of the workload, and end equal to Postgres table by table.
//
// Needs HIGHWATER_BIN (the `highwater` binary); scripts/zero-interop builds it and runs this.
import {execFileSync} from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import {after, before, test} from 'node:test';
import assert from 'node:assert/strict';

import {Database, checkDownstreamFrame, createReferenceReplica} from './zero.mjs';
import {
  Harness,
  PUBLICATION_SQL,
  WORKLOAD,
  assertReplicaEqualsPostgres,
  highwaterBin,
} from './harness.mjs';

const h = new Harness('highwater-zero-export-');
const replicaFile = path.join(h.work, 'zero', 'replica.db');
const referenceFile = path.join(h.work, 'reference.db');

// Before Highwater's initial sync: tables with rows, a unique constraint, secondary indexes.
const SEED = [
  PUBLICATION_SQL,
  ...WORKLOAD.slice(0, 2),
  `CREATE UNIQUE INDEX issue_u ON issue (u)`,
  `CREATE INDEX issue_ts_desc ON issue (ts DESC, id)`,
  `CREATE TABLE label (id int4 PRIMARY KEY, name text NOT NULL UNIQUE, issue_id int8, m mood)`,
  `INSERT INTO label VALUES (1, 'bug', 1, 'sad'), (2, 'idea', NULL, NULL)`,
];
// Between the initial sync and the export: the export's watermark is past the replica version.
const BEFORE_EXPORT = [...WORKLOAD.slice(2, 6), `UPDATE label SET name = 'bug!' WHERE id = 1`];
const AFTER_EXPORT = [...WORKLOAD.slice(6), `DELETE FROM label WHERE id = 2`];

let health;
let exported;

before(async () => {
  await h.startPostgres();
  await h.run(SEED);
  ({health} = await h.startHighwater());
  await h.run(BEFORE_EXPORT);
  // Highwater has applied the last of them once its replica shows it.
  const hw = new Database(path.join(h.work, 'hw', 'replica.db'), {readonly: true, fileMustExist: true});
  try {
    await h.waitFor('Highwater to apply the changes before the export', () =>
      hw.prepare(`SELECT name FROM label WHERE id = 1`).get()?.name === 'bug!');
  } finally {
    hw.close();
  }
  fs.mkdirSync(path.dirname(replicaFile));
  const out = execFileSync(highwaterBin, [
    'zero-replica', '--from', `http://127.0.0.1:${h.highwaterPort}`, '--out', replicaFile,
  ], {encoding: 'utf8'});
  const m = /Zero replica at watermark (\S+) \(replica version (\S+)\), (\d+) tables, (\d+) rows/.exec(out);
  assert.ok(m, `zero-replica printed: ${out}`);
  exported = {watermark: m[1], replicaVersion: m[2], tables: Number(m[3]), rows: Number(m[4])};
  await createReferenceReplica(referenceFile, h.sql, health.replicaVersion, ['highwater_pub']);
});

after(() => h.stop());

function dump(file) {
  const db = new Database(file, {readonly: true, fileMustExist: true});
  db.defaultSafeIntegers(true);
  try {
    return {
      schema: db.prepare(`SELECT type, name, tbl_name, sql FROM sqlite_schema
                          WHERE name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name`).all(),
      columns: db.prepare(`SELECT * FROM "_zero.column_metadata" ORDER BY table_name, column_name`).all(),
      versions: db.prepare(`SELECT * FROM "_zero.versionHistory"`).all(),
      config: db.prepare(`SELECT replicaVersion, publications, initialSyncContext, lock
                          FROM "_zero.replicationConfig"`).all(),
      state: db.prepare(`SELECT stateVersion FROM "_zero.replicationState"`).get(),
      events: db.prepare(`SELECT event FROM "_zero.runtimeEvents"`).all(),
      changeLog: db.prepare(`SELECT count(*) AS n FROM "_zero.changeLog2"`).get().n,
    };
  } finally {
    db.close();
  }
}

test("the exported replica has the layout of Zero's own initial sync, at the export's watermark", () => {
  assert.equal(exported.replicaVersion, health.replicaVersion);
  assert.ok(exported.watermark > exported.replicaVersion, `watermark ${exported.watermark} is past the replica version`);
  assert.equal(exported.tables, 2);
  assert.equal(exported.rows, 6, 'issue: 1, 20, 4, 5; label: 1, 2');
  const got = dump(replicaFile);
  const want = dump(referenceFile);
  assert.deepEqual(got.schema, want.schema, 'tables and indexes, statement by statement');
  assert.ok(got.schema.some(s => s.name === 'issue_pkey' && /^CREATE UNIQUE INDEX/.test(s.sql)));
  assert.ok(got.schema.some(s => s.name === 'label_name_key' && /^CREATE UNIQUE INDEX/.test(s.sql)));
  assert.deepEqual(got.columns, want.columns, 'column metadata');
  assert.deepEqual(got.versions, want.versions, 'replica schema version');
  assert.deepEqual(got.config, want.config, 'replication config');
  assert.deepEqual(got.events, want.events);
  assert.equal(got.changeLog, 0n);
  assert.equal(got.state.stateVersion, exported.watermark);

  // Rows keep their versions: the ones changed after the initial sync carry their commit's.
  const db = new Database(replicaFile, {readonly: true, fileMustExist: true});
  try {
    const versions = Object.fromEntries(db.prepare(`SELECT id, _0_version AS v FROM issue`).all()
      .map(r => [r.id, r.v]));
    assert.deepEqual(Object.keys(versions).sort(), ['1', '20', '4', '5']);
    for (const v of Object.values(versions)) {
      assert.ok(v >= exported.replicaVersion && v <= exported.watermark, `row version ${v}`);
    }
    assert.ok(versions[1] > exported.replicaVersion, 'an updated row has its update\'s version');
    assert.equal(db.prepare(`SELECT _0_version AS v FROM label WHERE id = 2`).get().v, exported.replicaVersion);
  } finally {
    db.close();
  }
  // Never over an existing replica.
  assert.throws(() => execFileSync(highwaterBin, [
    'zero-replica', '--from', `http://127.0.0.1:${h.highwaterPort}`, '--out', replicaFile,
  ], {encoding: 'utf8', stdio: 'pipe'}), /already exists/);
});

test('a Zero 1.9 view-syncer started from the export follows Highwater and ends equal to Postgres', async () => {
  const proxyPort = await h.startProxy(`ws://127.0.0.1:${h.highwaterPort}`);
  await h.startZeroCache(replicaFile, `http://127.0.0.1:${proxyPort}/`);
  await h.waitFor('the view-syncer to subscribe', () => h.frames.length > 0);
  const subscribed = h.frames.find(f => f.url.startsWith('/replication/v6/changes'));
  assert.ok(subscribed, `the view-syncer subscribed (${h.frames[0]?.url})`);
  const query = new URL(subscribed.url, 'http://x').searchParams;
  assert.equal(query.get('replicaVersion'), exported.replicaVersion);
  assert.equal(query.get('watermark'), exported.watermark);

  await h.run(AFTER_EXPORT);
  await assertReplicaEqualsPostgres(h, replicaFile);
  const bad = h.frames
    .filter(f => f.url.startsWith('/replication/v6/changes'))
    .map(f => [checkDownstreamFrame(f.text), f.text.slice(0, 300)])
    .filter(([error]) => error);
  assert.deepEqual(bad, []);
});
