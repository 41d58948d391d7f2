// A stock Zero 1.9 view-syncer (`zero-cache` with ZERO_CHANGE_STREAMER_URI) replicating from
// `highwater serve` over protocol v6: row changes, DDL of every kind, backfills and Zero's
// types; its SQLite replica must end equal to Postgres, table by table, and every frame
// Highwater sent it must pass Zero's own downstream schema.
//
// Needs HIGHWATER_BIN (the `highwater` binary); scripts/zero-interop builds it and runs this.
import {execFileSync} from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import {after, before, test} from 'node:test';
import assert from 'node:assert/strict';

import {BigIntJSON, checkDownstreamFrame, createEmptyReplica} from './zero.mjs';
import {
  Harness,
  PUBLICATION_SQL,
  WORKLOAD,
  assertReplicaEqualsPostgres,
  highwaterBin,
} from './harness.mjs';

const h = new Harness('highwater-zero-');
const replicaFile = path.join(h.work, 'zero-replica.db');

before(async () => {
  await h.startPostgres();
  await h.sql.unsafe(PUBLICATION_SQL);
  const {port, health} = await h.startHighwater();
  const proxyPort = await h.startProxy(`ws://127.0.0.1:${port}`);
  // The view-syncer's replica: empty, at Highwater's replica version (the publication had no
  // tables then), so everything arrives through the change stream.
  await createEmptyReplica(replicaFile, health.replicaVersion, ['highwater_pub']);
  await h.startZeroCache(replicaFile, `http://127.0.0.1:${proxyPort}/`);
  await h.waitFor('the view-syncer to subscribe', () => h.frames.length > 0);
});

after(() => h.stop());

test('a Zero 1.9 view-syncer follows highwater serve and ends equal to Postgres', async () => {
  await h.run(WORKLOAD);
  await assertReplicaEqualsPostgres(h, replicaFile);
});

test("every frame Highwater sent the view-syncer passes Zero's downstream schema", async () => {
  const changes = h.frames.filter(f => f.url.startsWith('/replication/v6/changes'));
  assert.ok(changes.length > WORKLOAD.length, `captured ${changes.length} frames`);
  const tags = new Set();
  const bad = [];
  for (const {text} of changes) {
    const error = checkDownstreamFrame(text);
    if (error) bad.push(`${error}: ${text.slice(0, 300)}`);
    const {msg} = BigIntJSON.parse(text);
    tags.add(msg[0] === 'data' ? msg[1].tag : msg[0]);
  }
  assert.deepEqual(bad, []);
  for (const tag of ['insert', 'update', 'delete', 'truncate', 'create-table', 'rename-table',
    'add-column', 'update-column', 'drop-column', 'drop-table', 'create-index', 'drop-index',
    'backfill', 'backfill-completed', 'status', 'begin', 'commit']) {
    assert.ok(tags.has(tag), `the workload produced ${tag} (saw ${[...tags].join(', ')})`);
  }
  // The same traffic through Highwater's own checker at the view-syncer's version.
  const file = path.join(h.work, 'frames.jsonl');
  fs.writeFileSync(file, changes.map(f => f.text).join('\n') + '\n');
  const out = execFileSync(highwaterBin, ['check-stream', '--protocol', '6', '--direction', 'downstream', file],
    {encoding: 'utf8'});
  assert.match(out, new RegExp(`^${changes.length} passed, 0 failed$`, 'm'));
});
