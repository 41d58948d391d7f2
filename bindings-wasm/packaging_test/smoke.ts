// Type-checks the published declarations the way a TypeScript user consumes them.
import {
  HighwaterClient,
  MemoryStore,
  type ConnectionStatus,
  type Row,
  compareCursors,
  isHighwaterError,
  type SyncCursor,
} from "highwater";
import {
  BackfillTracker,
  ScopeBridge,
  encodeChangeStreamMessage,
  type BridgeEffect,
  type ChangeStreamMessage,
} from "highwater/tools";

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

// The client API as the README shows it (never connected here: the type check is the test).
export async function liveRows(url: string): Promise<readonly Row[]> {
  const client = new HighwaterClient({ url, token: async () => "jwt", store: new MemoryStore() });
  const todos = client.subscribe({ resourceType: "todos", conditions: { owner: "ada" } });
  todos.on("change", ({ inserted, updated, removed }) => console.log(inserted.length, updated.length, removed.length));
  todos.on("progress", ({ done, total }) => console.log(done, total));
  client.on("status", (status: ConnectionStatus) => console.log(status.state, status.reason ?? ""));
  await todos.ready;
  const cursor = todos.cursor;
  console.log(cursor?.serverSequence, todos.replayedOnLastResume);
  const rows = todos.rows();
  todos.unsubscribe();
  await client.close();
  return rows;
}

// Typed rows: the app's row type (from `highwater typegen`, say) flows to rows and events.
interface Todo {
  id: number | bigint;
  owner: string | null;
  done: boolean;
}
export async function typedRows(client: HighwaterClient): Promise<string[]> {
  const todos = client.subscribe<Todo>({ resourceType: "todos", conditions: { owner: "ada" } });
  todos.on("change", ({ inserted }) => {
    const added: Todo[] = inserted;
    console.log(added.length);
  });
  await todos.ready;
  const rows: readonly Todo[] = todos.rows();
  return rows.filter((todo) => !todo.done).map((todo) => String(todo.id));
}
