// The repository's golden transcripts and change-stream vectors, checked against Zero 1.9's own
// code rather than against the code that produced them: the pgoutput mapper's expected output
// must pass Zero's downstream schema with the watermarks and commit times Zero's change source
// computes for the same LSNs, and `check-stream --protocol 6 --direction downstream` must agree
// with a Zero 1.9 subscriber on every vector line.
//
// Needs HIGHWATER_BIN (the `highwater` binary); scripts/zero-interop sets it.
import {execFileSync} from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import {test} from 'node:test';
import assert from 'node:assert/strict';
import {fileURLToPath, pathToFileURL} from 'node:url';

import {BigIntJSON, checkDownstreamFrame, zeroRoot} from './zero.mjs';

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, '..', '..');
const goldenDir = path.join(repo, 'engine', 'src', 'pgoutput', 'testdata');
const vectorDir = path.join(repo, 'tests', 'vectors', 'change-stream');
const {toStateVersionString} = await import(pathToFileURL(
  path.join(zeroRoot, 'out', 'zero-cache', 'src', 'services', 'change-source', 'pg', 'lsn.js')).href);

const lines = file => fs.readFileSync(file, 'utf8').split('\n')
  .map((text, i) => ({text, number: i + 1}))
  .filter(l => l.text.trim() !== '');

test("the pgoutput mapper's golden transcripts are what Zero's change source would send", () => {
  const goldens = fs.readdirSync(goldenDir).filter(f => f.endsWith('.expected.jsonl'));
  assert.ok(goldens.length > 0, 'golden transcripts exist');
  for (const golden of goldens) {
    let open = null;
    let messages = 0;
    for (const {text, number} of lines(path.join(goldenDir, golden))) {
      const line = BigIntJSON.parse(text);
      // A commit line also records the end LSN confirmed upstream (`{commit, endLsn}`); other
      // lines record relation bookkeeping, not change-stream messages.
      const value = Array.isArray(line?.commit) ? line.commit : line;
      if (!Array.isArray(value)) continue;
      messages++;
      const where = `${golden}:${number}`;
      assert.equal(checkDownstreamFrame({id: 1, msg: value}), null, where);
      const [tag, body, positions] = value;
      if (tag === 'begin') {
        assert.equal(open, null, `${where}: begin inside a transaction`);
        assert.equal(positions.commitWatermark, toStateVersionString(body.commitLsn), `${where}: commitWatermark`);
        assert.equal(body.json, 's', `${where}: Zero's source sends stringified JSON`);
        open = positions.commitWatermark;
      } else if (tag === 'commit') {
        assert.equal(positions.watermark, toStateVersionString(body.commitLsn), `${where}: watermark`);
        assert.equal(positions.watermark, open, `${where}: commit matches its begin`);
        assert.equal(body.commitTimeMs, Number(BigInt(body.commitTime) / 1000n), `${where}: commitTimeMs`);
        open = null;
      } else if (tag === 'data' && body.relation) {
        const {rowKey, keyColumns, replicaIdentity} = body.relation;
        // Zero's source sends both key forms so that subscribers below v5 get theirs.
        assert.deepEqual(rowKey.columns, keyColumns, `${where}: rowKey and keyColumns`);
        assert.equal(rowKey.type, replicaIdentity, `${where}: rowKey.type and replicaIdentity`);
        assert.notEqual(open, null, `${where}: data outside a transaction`);
      }
    }
    assert.ok(messages > 0, `${golden} has messages`);
    assert.equal(open, null, `${golden} ends outside a transaction`);
  }
});

/** Whether a Zero 1.9 subscriber (protocol v6) takes this line as downstream traffic. */
function zeroV6Takes(text) {
  let value;
  try {
    value = BigIntJSON.parse(text);
  } catch {
    return false;
  }
  return checkDownstreamFrame(Array.isArray(value) ? {id: 1, msg: value} : value) === null;
}

test('check-stream --protocol 6 --direction downstream agrees with a Zero 1.9 subscriber on every vector', () => {
  const highwater = process.env.HIGHWATER_BIN;
  assert.ok(highwater && fs.existsSync(highwater), 'HIGHWATER_BIN must name the highwater binary');
  for (const name of ['valid.jsonl', 'invalid.jsonl']) {
    const file = path.join(vectorDir, name);
    let out;
    try {
      out = execFileSync(highwater, ['check-stream', '--protocol', '6', '--direction', 'downstream', file],
        {encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore']});
    } catch (e) {
      out = e.stdout;
    }
    const rejected = new Set([...out.matchAll(/^line (\d+): /gm)].map(m => Number(m[1])));
    let agreed = 0;
    for (const {text, number} of lines(file)) {
      const zero = zeroV6Takes(text);
      if (!rejected.has(number)) {
        // Nothing Highwater lets through may stop a Zero subscriber.
        assert.ok(zero, `${name}:${number} passes check-stream but a Zero 1.9 subscriber rejects it: ${text}`);
      } else if (name === 'valid.jsonl') {
        // Valid for some version, but not v6 downstream: Zero 1.9 must reject it too.
        assert.ok(!zero, `${name}:${number} is rejected by check-stream but Zero 1.9 takes it: ${text}`);
      }
      // An invalid vector Zero takes is one of Highwater's deliberate extra checks
      // (canonical watermarks, integer frame ids): allowed.
      agreed++;
    }
    assert.ok(agreed > 0 && rejected.size > 0, `${name}: ${agreed} lines, ${rejected.size} rejected`);
  }
});
