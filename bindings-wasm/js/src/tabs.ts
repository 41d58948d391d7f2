// Tabs of one origin sharing one client: a leader elected with the Web Locks API holds the
// socket and the store writes; the others reach it through a BroadcastChannel. Nothing here
// decides what a client does; it only carries messages and says who leads.

/** What one tab tells the others. */
export type TabMessage =
  | { type: "hello"; from: string }
  | { type: "leader"; from: string }
  | { type: "subscribe"; from: string; key: number; scope: unknown }
  | { type: "unsubscribe"; from: string; key: number }
  | { type: "event"; from: string; to: string; key: number; event: unknown; cursor: unknown; replayed: number }
  | { type: "status"; from: string; status: unknown }
  | { type: "mutate"; from: string; ref: number; table: string; op: string; row: unknown; ifVersion?: number }
  | { type: "numbered"; from: string; to: string; ref: number; id: number; error?: { code: string; message: string } }
  | { type: "settled"; from: string; result: unknown }
  | { type: "outbox"; from: string; pending: number };

interface Locks {
  request(name: string, callback: () => Promise<void>): Promise<void>;
  request(name: string, options: { ifAvailable?: boolean }, callback: (lock: unknown) => Promise<void>): Promise<void>;
}

interface Channel {
  postMessage(message: unknown): void;
  close(): void;
  onmessage: ((event: { data: unknown }) => void) | null;
}

/** The Web Locks and BroadcastChannel of this runtime, when it has both. */
function platform(): { locks: Locks; channel: (name: string) => Channel } | null {
  const nav = (globalThis as { navigator?: { locks?: Locks } }).navigator;
  const Broadcast = (globalThis as { BroadcastChannel?: new (name: string) => Channel }).BroadcastChannel;
  if (nav?.locks === undefined || typeof nav.locks.request !== "function" || Broadcast === undefined) return null;
  return { locks: nav.locks, channel: (name) => new Broadcast(name) };
}

/** This tab's link to the other tabs sharing `name`. */
export class Tabs {
  readonly id: string;
  #name: string;
  #locks: Locks;
  #channel: Channel;
  #release: Array<() => void> = [];
  #closed = false;

  private constructor(name: string, locks: Locks, channel: Channel) {
    this.#name = name;
    this.#locks = locks;
    this.#channel = channel;
    this.id = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
  }

  /**
   * Joins the tabs sharing `name`, or `null` where Web Locks or BroadcastChannel are missing
   * (then each tab keeps its own socket). `onMessage` gets the other tabs' messages;
   * `onLeader` is called once, when this tab becomes the leader (at once if no other tab
   * leads, else when the leader's tab closes).
   */
  static join(name: string, onMessage: (message: TabMessage) => void, onLeader: () => void): Tabs | null {
    const found = platform();
    if (found === null) return null;
    const tabs = new Tabs(name, found.locks, found.channel(`highwater:${name}`));
    tabs.#channel.onmessage = (event) => {
      if (!tabs.#closed) onMessage(event.data as TabMessage);
    };
    // Held for the tab's life: the leader watches it to drop this tab's scopes when it is gone.
    tabs.#hold(`highwater:${name}:tab:${tabs.id}`, () => undefined);
    tabs.#hold(`highwater:${name}:leader`, () => {
      if (!tabs.#closed) onLeader();
    });
    return tabs;
  }

  /** Requests `lock` and holds it until `close()`; `granted` runs when it is held. */
  #hold(lock: string, granted: () => void): void {
    void this.#locks
      .request(lock, () => {
        granted();
        return new Promise<void>((resolve) => {
          if (this.#closed) resolve();
          else this.#release.push(resolve);
        });
      })
      .catch(() => undefined);
  }

  /** Calls `gone` once the tab `id` has closed (its lock is free). */
  watch(id: string, gone: () => void): void {
    void this.#locks
      .request(`highwater:${this.#name}:tab:${id}`, async () => {
        if (!this.#closed) gone();
      })
      .catch(() => undefined);
  }

  post(message: TabMessage): void {
    if (!this.#closed) this.#channel.postMessage(message);
  }

  /** Leaves: the locks go (another tab may lead) and the channel closes. */
  close(): void {
    if (this.#closed) return;
    this.#closed = true;
    for (const release of this.#release) release();
    this.#channel.close();
  }
}
