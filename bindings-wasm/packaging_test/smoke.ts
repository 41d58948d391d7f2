// Type-checks the published declarations the way a TypeScript user consumes them.
import {
  BackfillTracker,
  ScopeBridge,
  compareCursors,
  encodeChangeStreamMessage,
  isHighwaterError,
  type BridgeEffect,
  type ChangeStreamMessage,
  type SyncCursor,
} from "highwater";

const cursor: SyncCursor = { id: "1", serverSequence: 7n, updatedAt: "2026-07-01T10:00:00.000Z" };
const order: number = compareCursors(cursor, null);
const message: ChangeStreamMessage = ["rollback", { tag: "rollback" }];
const text: string = encodeChangeStreamMessage(message);
const ignored: string[] = new BackfillTracker(null).apply(message);
const effects: BridgeEffect[] = new ScopeBridge({ resourceTypes: ["Task"] }).unsubscribe();
for (const effect of effects) {
  if (effect.type === "applyBatch") {
    const ticket: number = effect.ticket;
    console.log(ticket, effect.changes.length);
  }
}
try {
  encodeChangeStreamMessage(["begin"]);
} catch (error) {
  if (isHighwaterError(error)) console.log(error.code, error.path ?? "");
}
console.log(order, text, ignored);
