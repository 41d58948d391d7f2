// A small scope-sync server that follows the wire contract, for client tests that need to
// script faults precisely (the real `highwater serve` runs in client_serve.test.mjs).
import { WebSocketServer } from "ws";

export class ContractServer {
  /** @type {Map<string, {seq: number, owner: string | null, data: object | null}>} */
  rows = new Map();
  seq = 0;
  epoch = 1;
  connections = 0;
  /** Every subscribe frame's params, in order. */
  subscribes = [];
  /** Scope owners refused with this code. */
  refuse = new Map();
  /** Tokens refused as expired. */
  expired = new Set();
  sockets = new Set();
  /** App-level pings answered. */
  pings = 0;
  /** Rows per replay page (`highwater serve` sends 1,000). */
  pageRows = 100;
  /** Per client: the last mutation id applied (applied once, as `highwater serve` does). */
  lastApplied = new Map();
  /** Mutations applied, in order: `${clientId}:${id}`. */
  applied = [];
  /** Mutation ids to refuse with `forbidden`. */
  forbid = new Set();
  /** Sockets waiting for an app backend's confirm: [ws, clientId, id]. */
  awaiting = [];

  /** An app backend applies a mutation and confirms it (`highwater.confirm`): the row
   * changes, and sockets awaiting it are answered after the change. */
  appApply(clientId, id, row) {
    this.lastApplied.set(clientId, Math.max(this.lastApplied.get(clientId) ?? 0, id));
    this.applied.push(`${clientId}:${id}`);
    this.write(String(row.id), row.owner, row);
    this.#answerAwaits();
  }

  #answerAwaits() {
    this.awaiting = this.awaiting.filter(([ws, clientId, id]) => {
      if (id > (this.lastApplied.get(clientId) ?? 0)) return true;
      ws.send(JSON.stringify({ type: "mutation-result", clientId, results: [{ id, status: "confirmed" }] }));
      return false;
    });
  }

  async start() {
    this.wss = new WebSocketServer({ port: 0, host: "127.0.0.1" });
    await new Promise((resolve) => this.wss.once("listening", resolve));
    this.wss.on("connection", (ws) => this.#connection(ws));
    return `ws://127.0.0.1:${this.wss.address().port}/sync`;
  }

  async stop() {
    for (const ws of this.sockets) ws.terminate();
    await new Promise((resolve) => this.wss.close(resolve));
  }

  /** Makes every connection half-open: the server stops reading and sending, the TCP stays up. */
  freeze() {
    for (const ws of this.sockets) {
      ws.frozen = true;
      ws._socket.pause();
    }
  }

  /** Kills every connection without a close handshake (the client sees 1006). */
  cut() {
    for (const ws of this.sockets) ws.terminate();
  }

  write(id, owner, fields = {}) {
    const old = this.rows.get(id);
    this.seq += 1;
    const data = owner === null ? null : { id, owner, ...fields };
    this.rows.set(id, { seq: this.seq, owner, data });
    for (const ws of this.sockets) {
      for (const [sub, scope] of ws.subs) {
        if (old?.owner === scope || owner === scope) this.#send(ws, sub, [this.#entry(id, scope)]);
      }
    }
  }

  scopeRows(owner) {
    return [...this.rows.values()].filter((row) => row.owner === owner).map((row) => row.data);
  }

  /** A resync: a new epoch, every row renumbered; connected clients are cut. */
  resync() {
    this.epoch += 1;
    this.seq = 0;
    for (const row of this.rows.values()) row.seq = ++this.seq;
    this.cut();
  }

  #entry(id, scope) {
    const row = this.rows.get(id);
    const inScope = row.owner === scope;
    return {
      id: `${this.epoch}:${row.seq}`,
      resourceType: "todos",
      resourceId: id,
      serverSequence: row.seq,
      syncType: inScope ? "update" : "delete",
      updatedAt: "2026-12-01T12:00:00.000Z",
      data: inScope ? row.data : null,
      owner: scope,
    };
  }

  #send(ws, sub, syncs, extra = {}) {
    if (ws.frozen) return;
    ws.send(JSON.stringify({ type: "channel-message", subscriptionId: sub, body: { echoOrigin: null, syncs, ...extra } }));
  }

  /** A `mutate` frame: each mutation applied once, its change sent (echoed to the writer),
   * then the results. */
  #mutate(ws, frame) {
    const results = [];
    for (const m of frame.mutations) {
      const last = this.lastApplied.get(frame.clientId) ?? 0;
      if (m.id <= last) {
        results.push({ id: m.id, status: "confirmed" });
        continue;
      }
      this.lastApplied.set(frame.clientId, m.id);
      if (this.forbid.has(m.id)) {
        results.push({ id: m.id, status: "rejected", code: "forbidden", message: "not yours" });
        continue;
      }
      this.applied.push(`${frame.clientId}:${m.id}`);
      const id = String(m.row.id);
      const old = this.rows.get(id);
      const fields = { ...(old?.data ?? {}), ...m.row, id };
      const owner = m.op === "delete" ? null : (fields.owner ?? old?.owner ?? null);
      this.seq += 1;
      this.rows.set(id, { seq: this.seq, owner, data: owner === null ? null : { ...fields, owner } });
      for (const other of this.sockets) {
        for (const [sub, scope] of other.subs) {
          if (old?.owner !== scope && owner !== scope) continue;
          const echo = other === ws ? { clientId: frame.clientId, mutationIds: [m.id] } : null;
          if (other.frozen) continue;
          other.send(JSON.stringify({ type: "channel-message", subscriptionId: sub, body: { echoOrigin: echo, syncs: [this.#entry(id, scope)] } }));
        }
      }
      results.push({ id: m.id, status: "confirmed" });
    }
    ws.send(JSON.stringify({ type: "mutation-result", clientId: frame.clientId, results }));
  }

  #connection(ws) {
    this.connections += 1;
    ws.subs = new Map();
    this.sockets.add(ws);
    ws.on("close", () => this.sockets.delete(ws));
    ws.send(JSON.stringify({ type: "session-established", sessionId: `s${this.connections}`, graceSeconds: 0 }));
    ws.on("message", (raw) => {
      const frame = JSON.parse(String(raw));
      if (frame.type === "ping") {
        this.pings += 1;
        return ws.send(JSON.stringify({ type: "pong" }));
      }
      if (frame.type === "session-resume") return ws.send(JSON.stringify({ type: "session-gone" }));
      if (frame.type === "channel-unsubscribe") return ws.subs.delete(frame.subscriptionId);
      if (frame.type === "mutate") return this.#mutate(ws, frame);
      if (frame.type === "await-mutations") {
        for (const id of frame.ids) this.awaiting.push([ws, frame.clientId, id]);
        return this.#answerAwaits();
      }
      if (frame.type !== "channel-subscribe") return;
      const { subscriptionId: sub, params } = frame;
      this.subscribes.push(params);
      const owner = params.conditions.owner;
      const refusal = this.refuse.get(owner) ?? (this.expired.has(params.authenticationToken) ? "auth-expired" : null);
      if (refusal) {
        return ws.send(JSON.stringify({ type: "channel-error", subscriptionId: sub, message: `refused: ${refusal}`, code: refusal }));
      }
      ws.subs.set(sub, owner);
      const stale = params.afterId !== undefined && !String(params.afterId).startsWith(`${this.epoch}:`);
      const after = stale ? 0 : (params.afterServerSequence ?? 0);
      if (stale) this.#send(ws, sub, [], { reset: { reason: "epoch-changed" } });
      const ids = [...this.rows.keys()].filter((id) => {
        const row = this.rows.get(id);
        return row.seq > after && (row.owner === owner || after > 0);
      });
      const total = ids.length;
      for (let i = 0; i < ids.length; i += this.pageRows) {
        const page = ids.slice(i, i + this.pageRows);
        this.#send(ws, sub, page.map((id) => this.#entry(id, owner)), { progress: { done: i + page.length, total } });
      }
      ws.send(JSON.stringify({ type: "channel-subscribed", subscriptionId: sub }));
    });
  }
}

/** Resolves when `check()` is true; rejects after `ms` with `what`. */
export async function until(check, what, ms = 10_000) {
  const deadline = Date.now() + ms;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

export const byId = (rows) => Object.fromEntries(rows.map((row) => [row.id, row]).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)));
