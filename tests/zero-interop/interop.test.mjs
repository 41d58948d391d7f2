// A stock Zero 1.9 view-syncer (`zero-cache` with ZERO_CHANGE_STREAMER_URI) replicating from
// `highwater serve` over protocol v6: row changes, DDL of every kind, backfills and Zero's
// types; its SQLite replica must end equal to Postgres, table by table, and every frame
// Highwater sent it must pass Zero's own downstream schema.
//
// Needs HIGHWATER_BIN (the `highwater` binary); scripts/zero-interop builds it and runs this.
import {spawn, execFileSync} from 'node:child_process';
import fs from 'node:fs';
import http from 'node:http';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import {after, before, test} from 'node:test';
import assert from 'node:assert/strict';
import {fileURLToPath} from 'node:url';
import {createRequire} from 'node:module';

import {
  BigIntJSON,
  Database,
  checkDownstreamFrame,
  createEmptyReplica,
  liteValue,
  pgClient,
  quietLog,
  zeroCacheBin,
  zeroRoot,
} from './zero.mjs';

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, '..', '..');
const {WebSocket, WebSocketServer} = createRequire(path.join(zeroRoot, 'package.json'))('ws');

const highwaterBin = process.env.HIGHWATER_BIN;
const WAIT_MS = 90_000;

const work = fs.mkdtempSync(path.join(os.tmpdir(), 'highwater-zero-'));
fs.chmodSync(work, 0o755);
const children = [];
let pgDir;
let upstreamUrl;
let sql;
let proxy;
const frames = [];

function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.listen(0, '127.0.0.1', () => {
      const {port} = srv.address();
      srv.close(() => resolve(port));
    });
    srv.on('error', reject);
  });
}

function start(name, cmd, args, env = {}) {
  const log = fs.openSync(path.join(work, `${name}.log`), 'a');
  const child = spawn(cmd, args, {
    env: {...process.env, ...env},
    stdio: ['ignore', log, log],
  });
  child.name = name;
  children.push(child);
  return child;
}

function logTail(name, lines = 30) {
  try {
    return fs.readFileSync(path.join(work, `${name}.log`), 'utf8').split('\n').slice(-lines).join('\n');
  } catch {
    return '(no log)';
  }
}

/** Polls `probe` until it returns a truthy value; fails with `what` and the logs. */
async function waitFor(what, probe, ms = WAIT_MS) {
  const deadline = Date.now() + ms;
  let last;
  while (Date.now() < deadline) {
    for (const child of children) {
      if (child.exitCode !== null && !child.expectedExit) {
        throw new Error(`${child.name} exited (${child.exitCode}) while waiting for ${what}:\n${logTail(child.name)}`);
      }
    }
    try {
      const v = await probe();
      if (v) return v;
    } catch (e) {
      last = e;
    }
    await new Promise(r => setTimeout(r, 200));
  }
  throw new Error(`timed out after ${ms} ms waiting for ${what}${last ? ` (${last.message})` : ''}\n` +
    `--- highwater ---\n${logTail('highwater')}\n--- zero-cache ---\n${logTail('zero-cache')}`);
}

function getJson(url) {
  return new Promise((resolve, reject) => {
    http.get(url, res => {
      let body = '';
      res.on('data', c => (body += c));
      res.on('end', () => (res.statusCode === 200 ? resolve(JSON.parse(body)) : reject(new Error(`${res.statusCode}`))));
    }).on('error', reject);
  });
}

/** A WebSocket proxy in front of Highwater that records every frame it sends downstream. */
function startProxy(port, target) {
  const wss = new WebSocketServer({host: '127.0.0.1', port});
  wss.on('connection', (client, req) => {
    const upstream = new WebSocket(`${target}${req.url}`);
    const pending = [];
    upstream.on('open', () => pending.splice(0).forEach(m => upstream.send(m)));
    upstream.on('message', (data, isBinary) => {
      if (!isBinary) frames.push({url: req.url, text: data.toString()});
      client.send(data, {binary: isBinary});
    });
    upstream.on('close', (code, reason) => client.close(code === 1005 ? 1000 : code, reason));
    upstream.on('error', () => client.terminate());
    client.on('message', (data, isBinary) => {
      const m = isBinary ? data : data.toString();
      if (upstream.readyState === WebSocket.OPEN) upstream.send(m);
      else pending.push(m);
    });
    client.on('close', () => upstream.close());
    client.on('error', () => upstream.terminate());
  });
  return wss;
}

before(async () => {
  assert.ok(highwaterBin && fs.existsSync(highwaterBin), 'HIGHWATER_BIN must name the highwater binary');
  pgDir = path.join(work, 'pg');
  upstreamUrl = execFileSync(path.join(repo, 'scripts', 'pg-start'), [pgDir], {encoding: 'utf8'}).trim();
  sql = pgClient(quietLog(), upstreamUrl, 'interop-test');
  await sql.unsafe(`
    CREATE DATABASE zero_cvr;
  `);
  // Published by schema, so tables created later are followed and one added from another
  // schema is a table new to the publication (backfilled).
  await sql.unsafe(`
    CREATE SCHEMA other;
    CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
    CREATE PUBLICATION highwater_pub FOR TABLES IN SCHEMA public;
  `);

  const hwPort = await freePort();
  start('highwater', highwaterBin, [
    'serve', '--upstream', upstreamUrl, '--data', path.join(work, 'hw'),
    '--host', '127.0.0.1', '--port', String(hwPort),
    '--purge-delay-ms', '3600000',
  ], {RUST_LOG: 'info'});
  const health = await waitFor('highwater serve to be healthy', () =>
    getJson(`http://127.0.0.1:${hwPort}/health`));

  const proxyPort = await freePort();
  proxy = startProxy(proxyPort, `ws://127.0.0.1:${hwPort}`);

  // The view-syncer's replica: empty, at Highwater's replica version (the publication had no
  // tables then), so everything arrives through the change stream.
  const replicaFile = path.join(work, 'zero-replica.db');
  await createEmptyReplica(replicaFile, health.replicaVersion, ['highwater_pub']);

  const cvrUrl = upstreamUrl.replace(/\/[^/]*$/, '/zero_cvr');
  start('zero-cache', process.execPath, [zeroCacheBin], {
    ZERO_UPSTREAM_DB: upstreamUrl,
    ZERO_CVR_DB: cvrUrl,
    ZERO_CHANGE_DB: cvrUrl,
    ZERO_REPLICA_FILE: replicaFile,
    ZERO_CHANGE_STREAMER_URI: `http://127.0.0.1:${proxyPort}/`,
    ZERO_PORT: String(await freePort()),
    ZERO_NUM_SYNC_WORKERS: '1',
    ZERO_LOG_LEVEL: 'info',
    ZERO_ENABLE_TELEMETRY: 'false',
    ZERO_ADMIN_PASSWORD: 'interop',
  });
  await waitFor('the view-syncer to subscribe', () => frames.length > 0);
});

after(async () => {
  proxy?.close();
  for (const child of children.reverse()) {
    child.expectedExit = true;
    if (child.exitCode === null) {
      child.kill('SIGTERM');
      await Promise.race([
        new Promise(r => child.once('exit', r)),
        new Promise(r => setTimeout(r, 10_000)),
      ]);
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
    }
  }
  await sql?.end({timeout: 5});
  if (pgDir) execFileSync(path.join(repo, 'scripts', 'pg-stop'), [pgDir], {stdio: 'ignore'});
  if (!process.env.KEEP_ZERO_INTEROP) fs.rmSync(work, {recursive: true, force: true});
  else console.log(`# kept ${work}`);
});

const ISSUE_ROWS = `
  (1, 'one', true, 1, 9007199254740993, 1.5, 12.25, '2024-05-06 07:08:09.123+00',
   '2024-05-06 07:08:09.5', '2024-05-06', '07:08:09.25', '{"a": [1, 2], "b": null}', '[1, "x"]',
   'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', 'happy', '{a,"b c"}', '{1,2,3}', 'var', 'ab', 0.5, 7),
  (2, 'two', false, -2, -5, -0.25, 0, '1999-12-31 23:59:59+00', '1999-12-31 23:59:59',
   '1999-12-31', '23:59:59', '[]', '{}', 'b0eebc99-9c0b-4ef8-bb6d-6bb9bd380a12', 'sad', '{}', '{}',
   '', 'x', -1, 0),
  (3, 'three', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
   NULL, NULL, NULL, NULL, NULL),
  (4, 'four', true, 4, 4, 4, 4, '2030-01-01 00:00:00+00', '2030-01-01 00:00:00', '2030-01-01',
   '00:00:00', '"s"', '"s"', 'c0eebc99-9c0b-4ef8-bb6d-6bb9bd380a13', 'ok', '{z}', '{4}', 'v', 'c',
   4, 4)`;

// One statement (or explicit transaction) per entry: each is its own upstream transaction.
const WORKLOAD = [
  `CREATE TABLE issue (id int8 PRIMARY KEY, title text NOT NULL, done bool, n int4, big int8,
     f float8, num numeric, ts timestamptz, t timestamp, d date, tm time, j jsonb, js json,
     u uuid, m mood, tags text[], ints int4[], v varchar(20), c char(3), r real, s smallint)`,
  `INSERT INTO issue VALUES ${ISSUE_ROWS}`,
  `UPDATE issue SET title = 'one!', j = '{"k": "v"}' WHERE id = 1`,
  `UPDATE issue SET id = 20 WHERE id = 2`,
  `DELETE FROM issue WHERE id = 3`,
  `BEGIN; INSERT INTO issue (id, title) VALUES (5, 'five'); UPDATE issue SET n = 50 WHERE id = 5;
   DELETE FROM issue WHERE id = 4; INSERT INTO issue (id, title) VALUES (4, 'four again'); COMMIT`,
  `BEGIN; INSERT INTO issue (id, title) VALUES (6, 'rolled back'); ROLLBACK`,
  `CREATE TABLE scratch (id int4 PRIMARY KEY, x text)`,
  `INSERT INTO scratch VALUES (1, 'a'), (2, 'b')`,
  `TRUNCATE scratch`,
  `INSERT INTO scratch VALUES (3, 'c')`,
  `CREATE INDEX issue_title ON issue (title)`,
  `CREATE UNIQUE INDEX issue_n_desc ON issue (n DESC)`,
  `DROP INDEX issue_title`,
  `ALTER TABLE issue RENAME COLUMN n TO points`,
  `ALTER TABLE issue DROP COLUMN s`,
  `ALTER TABLE issue ALTER COLUMN r TYPE float8`,
  // Backfills: volatile and literal-timestamp defaults; a constant and a text default go as dflt.
  `ALTER TABLE issue ADD COLUMN updated timestamptz DEFAULT now()`,
  `ALTER TABLE issue ADD COLUMN since timestamptz DEFAULT '2024-01-01 00:00:00+00'`,
  `ALTER TABLE issue ADD COLUMN score int4 DEFAULT 5`,
  `ALTER TABLE issue ADD COLUMN label text DEFAULT 'none'`,
  `ALTER TABLE issue ADD COLUMN serial_no serial`,
  `INSERT INTO issue (id, title) VALUES (7, 'after ddl')`,
  `ALTER TABLE scratch RENAME TO scratch2`,
  `CREATE TABLE gone (id int4 PRIMARY KEY)`,
  `DROP TABLE gone`,
  // A table new to the publication, and one moved into the published schema, both with rows.
  `CREATE TABLE other.extra (id int4 PRIMARY KEY, v text)`,
  `INSERT INTO other.extra VALUES (1, 'x'), (2, 'y')`,
  `ALTER PUBLICATION highwater_pub ADD TABLE other.extra`,
  `CREATE TABLE other.moved (id int4 PRIMARY KEY, v text, at timestamptz DEFAULT now())`,
  `INSERT INTO other.moved (id, v) VALUES (1, 'm')`,
  `ALTER TABLE other.moved SET SCHEMA public`,
  `UPDATE other.extra SET v = 'x2' WHERE id = 1`,
  `INSERT INTO moved (id, v) VALUES (2, 'n')`,
  `UPDATE issue SET score = 9, label = 'set' WHERE id = 1`,
  `CREATE TABLE marker (id int4 PRIMARY KEY)`,
  `INSERT INTO marker VALUES (1)`,
];

function liteTableName(schema, name) {
  return schema === 'public' ? name : `${schema}.${name}`;
}

/** A comparable form of a SQLite / lite value: bigints and numbers by value, JSON parsed. */
function norm(v, declared) {
  if (v === null || v === undefined) return null;
  if (typeof v === 'bigint') return `n:${v}`;
  if (typeof v === 'number') return Number.isInteger(v) ? `n:${BigInt(v)}` : `f:${v}`;
  if (typeof v === 'string' && /^(json|jsonb)\b/.test(declared)) return `j:${JSON.stringify(JSON.parse(v))}`;
  if (typeof v === 'string' && /TEXT_ARRAY/.test(declared)) return `a:${JSON.stringify(JSON.parse(v))}`;
  return `s:${v}`;
}

test('a Zero 1.9 view-syncer follows highwater serve and ends equal to Postgres', async () => {
  // One connection, so that BEGIN … COMMIT / ROLLBACK entries hold together.
  const conn = await sql.reserve();
  try {
    for (const statement of WORKLOAD) {
      await conn.unsafe(statement);
    }
  } finally {
    conn.release();
  }
  const replica = new Database(path.join(work, 'zero-replica.db'), {readonly: true, fileMustExist: true});
  replica.defaultSafeIntegers(true);
  try {
    await waitFor('the marker row in the Zero replica', () => {
      try {
        return replica.prepare('SELECT 1 FROM marker WHERE id = 1').get();
      } catch {
        return false;
      }
    });
    // Backfills run beside the stream: wait until none is pending in the view-syncer.
    await waitFor('the Zero replica to finish its backfills', () =>
      replica.prepare(`SELECT count(*) AS n FROM "_zero.column_metadata" WHERE backfill IS NOT NULL`).get().n === 0n);

    const published = await sql`
      SELECT schemaname AS schema, tablename AS name FROM pg_publication_tables
      WHERE pubname = 'highwater_pub' ORDER BY 1, 2`;
    const expectedTables = published.map(t => liteTableName(t.schema, t.name)).sort();
    const replicaTables = replica
      .prepare(`SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE '\\_zero.%' ESCAPE '\\' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'`)
      .all()
      .map(r => r.name)
      .sort();
    assert.deepEqual(replicaTables, expectedTables, 'replicated tables');
    assert.ok(expectedTables.includes('other.extra') && expectedTables.includes('moved'));

    for (const {schema, name} of published) {
      const table = liteTableName(schema, name);
      const columns = replica.prepare(`SELECT name, type FROM pragma_table_info(?)`).all(table)
        .filter(c => c.name !== '_0_version');
      const pgColumns = await sql`
        SELECT a.attname AS name FROM pg_attribute a
        WHERE a.attrelid = ${`"${schema}"."${name}"`}::regclass AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY a.attnum`;
      assert.deepEqual(columns.map(c => c.name).sort(), pgColumns.map(c => c.name).sort(), `columns of ${table}`);
      const list = columns.map(c => `"${c.name}"`).join(', ');
      const want = (await sql.unsafe(`SELECT ${list} FROM "${schema}"."${name}" ORDER BY id`))
        .map(row => columns.map(c => norm(liteValue(row[c.name], c.type, 'p'), c.type)));
      const got = replica.prepare(`SELECT ${list} FROM "${table}" ORDER BY id`).raw().all()
        .map(row => row.map((v, i) => norm(v, columns[i].type)));
      assert.deepEqual(got, want, `rows of ${table}`);
    }
    const versions = replica.prepare(`SELECT stateVersion FROM "_zero.replicationState"`).get();
    assert.ok(versions.stateVersion, 'the replica has a state version');
  } finally {
    replica.close();
  }
});

test("every frame Highwater sent the view-syncer passes Zero's downstream schema", async () => {
  const changes = frames.filter(f => f.url.startsWith('/replication/v6/changes'));
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
  const file = path.join(work, 'frames.jsonl');
  fs.writeFileSync(file, changes.map(f => f.text).join('\n') + '\n');
  const out = execFileSync(highwaterBin, ['check-stream', '--protocol', '6', '--direction', 'downstream', file],
    {encoding: 'utf8'});
  assert.match(out, new RegExp(`^${changes.length} passed, 0 failed$`, 'm'));
});
