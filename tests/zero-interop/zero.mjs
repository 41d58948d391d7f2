// Zero's own code, loaded from the installed @rocicorp/zero package by file path (its
// `exports` map hides these modules): the change-streamer's downstream schema, the replica
// schema set-up, the Postgres type parsers and the SQLite value mapping a replicator uses.
import {createRequire} from 'node:module';
import path from 'node:path';
import {fileURLToPath, pathToFileURL} from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
export const zeroRoot = path.join(here, 'node_modules', '@rocicorp', 'zero');
export const zeroCacheBin = path.join(zeroRoot, 'out', 'zero', 'src', 'cli.js');

const load = rel => import(pathToFileURL(path.join(zeroRoot, 'out', rel)).href);

export const {downstreamSchema} = await load(
  'zero-cache/src/services/change-streamer/change-streamer.js',
);
export const {BigIntJSON} = await load('shared/src/bigint-json.js');
export const {mapPostgresToLiteColumn} = await load('zero-cache/src/db/pg-to-lite.js');
export const {initReplica} = await load(
  'zero-cache/src/services/change-source/common/replica-schema.js',
);
export const {initReplicationState} = await load(
  'zero-cache/src/services/replicator/schema/replication-state.js',
);
export const {pgClient} = await load('zero-cache/src/types/pg.js');
export const {liteValue} = await load('zero-cache/src/types/lite.js');

const require = createRequire(path.join(zeroRoot, 'package.json'));
export const {LogContext} = await import(
  pathToFileURL(require.resolve('@rocicorp/logger')).href
);
export const Database = require('@rocicorp/zero-sqlite3');

/** A log context that drops everything below warnings. */
export function quietLog() {
  return new LogContext('warn', {}, {log: () => {}});
}

/**
 * Creates an empty Zero replica file at `replicaVersion` for `publications`, through Zero's
 * own replica set-up (the same migration a Zero replication-manager runs after its initial
 * sync), so that a view-syncer subscribes at that version and catches up from the change log.
 */
export async function createEmptyReplica(file, replicaVersion, publications) {
  await initReplica(quietLog(), 'highwater-zero-replica', file, (_lc, tx) => {
    initReplicationState(tx, [...publications], replicaVersion);
  });
}

/**
 * Validates one downstream frame (text, or its parsed value) the way a v6 Zero subscriber reads it: an `{id,msg}`
 * frame with a message that passes `downstreamSchema` in passthrough mode and, for
 * `add-column`, a default its replicator can map. Returns an error message or null.
 */
export function checkDownstreamFrame(text) {
  let frame = text;
  if (typeof text === 'string') {
    try {
      frame = BigIntJSON.parse(text);
    } catch (e) {
      return `not JSON: ${e.message}`;
    }
  }
  if (frame === null || typeof frame !== 'object' || !('msg' in frame) || !('id' in frame)) {
    return 'a v6 subscriber takes only {id,msg} frames';
  }
  let result;
  try {
    result = downstreamSchema.try(frame.msg, {mode: 'passthrough'});
  } catch (e) {
    return `downstreamSchema threw: ${e.message}`;
  }
  if (!result.ok) {
    return `downstreamSchema: ${result.message ?? JSON.stringify(result.issues?.[0])}`;
  }
  const [tag, change] = frame.msg;
  if (tag === 'data' && change.tag === 'add-column') {
    try {
      mapPostgresToLiteColumn(change.table.name, change.column);
    } catch (e) {
      return `add-column: ${e.message}`;
    }
  }
  return null;
}
