// The demo page: one HighwaterClient (one socket, rows cached in IndexedDB), one or two scopes on
// `todos` for the chosen user, and writes through the demo's endpoints with their round trip timed
// from the click until the change is visible in the scope.
import { init, HighwaterClient, IndexedDbStore } from "/pkg/web.js";

const USERS = ["ada", "grace", "linus"];
const BASE_COLUMNS = new Set(["id", "owner", "title", "done", "updated_at"]);
const STATUS_TEXT = {
  connecting: "Connecting",
  open: "Live",
  reconnecting: "Reconnecting",
  offline: "Offline",
  closed: "Closed",
};

const $ = (selector, root = document) => root.querySelector(selector);

const state = {
  user: pickUser(),
  second: new URLSearchParams(location.search).get("second") === "1",
  client: null,
  scopes: [], // {key, title, where, conditions, sub, el, seen: Map<id, json>, subscribed}
  columns: [], // columns added from this page: {name, t0, arrivedMs}
  offline: false,
};

function pickUser() {
  const asked = new URLSearchParams(location.search).get("user") ?? localStorage.getItem("highwater-demo-user");
  return USERS.includes(asked) ? asked : "ada";
}

async function token() {
  const response = await fetch(`/demo/token?sub=${encodeURIComponent(state.user)}`);
  if (!response.ok) throw new Error(`Token endpoint answered ${response.status}`);
  return (await response.json()).token;
}

async function api(method, path, body) {
  const response = await fetch(path, {
    method,
    headers: body === undefined ? {} : { "content-type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  const json = text ? JSON.parse(text) : {};
  if (!response.ok) throw new Error(json.error ?? `${method} ${path} answered ${response.status}`);
  return json;
}

// ---- client and scopes -------------------------------------------------------------------

function start() {
  stop();
  state.offline = false;
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/sync`;
  // Tabs of one user share one socket: the leader tab's client serves the others' scopes with
  // its token, so the share is named after the user.
  const client = new HighwaterClient({
    url,
    token,
    store: new IndexedDbStore("highwater-demo"),
    shareTabs: `highwater-demo-${state.user}`,
  });
  state.client = client;
  client.on("status", () => renderStatus());
  client.on("outbox", () => renderPending());
  client.on("rejected", ({ code, message }) => logLine(`Refused (${code}): ${message}`, "error"));
  const specs = [
    {
      key: "all",
      title: `${state.user}'s todos`,
      where: `owner = '${state.user}'`,
      conditions: { owner: state.user },
    },
  ];
  if (state.second) {
    specs.push({
      key: "open",
      title: `${state.user}'s open todos`,
      where: `owner = '${state.user}' and done = false`,
      conditions: { owner: state.user, done: false },
    });
  }
  const container = $("#scopes");
  container.replaceChildren();
  container.classList.toggle("two", specs.length > 1);
  state.scopes = specs.map((spec) => {
    const el = $("#scope-template").content.firstElementChild.cloneNode(true);
    el.dataset.scope = spec.key;
    $(".scope-title", el).textContent = spec.title;
    $(".scope-where", el).innerHTML = `<code>todos</code> where <code>${spec.where}</code>`;
    $(".add", el).addEventListener("submit", (event) => {
      event.preventDefault();
      const input = event.target.elements.title;
      const title = input.value.trim();
      if (title) addTodo(title);
      input.value = "";
    });
    container.append(el);
    const sub = client.subscribe({ resourceType: "todos", conditions: spec.conditions });
    const scope = { ...spec, sub, el, seen: new Map(), subscribed: false, replay: null };
    sub.on("change", () => refresh(scope));
    sub.on("reset", () => refresh(scope));
    sub.on("progress", (p) => {
      scope.replay = p;
      refresh(scope);
    });
    // "ready" comes after every catch-up: the first subscribe and each resume.
    sub.on("ready", () => {
      scope.subscribed = true;
      scope.replay = null;
      refresh(scope);
    });
    sub.on("error", (problem) => scopeError(scope, problem));
    return scope;
  });
  window.demo = { client, scopes: state.scopes, state };
  renderStatus();
  renderPending();
  for (const scope of state.scopes) refresh(scope);
}

function stop() {
  if (!state.client) return;
  for (const scope of state.scopes) scope.sub.unsubscribe();
  state.client.close();
  state.client = null;
}

function scopeError(scope, error) {
  // A failed scope (refused by the server) is marked; other problems are only logged.
  if (scope.sub.error) {
    const badge = $(".origin", scope.el);
    badge.textContent = error?.code ?? "error";
    badge.dataset.kind = "error";
    badge.title = error?.message ?? String(error);
  }
  logLine(`Scope ${scope.title}: ${error?.message ?? error}`, "error");
}

// ---- rendering ---------------------------------------------------------------------------

function rowsOf(scope) {
  return [...scope.sub.rows()].sort((a, b) => Number(b.id) - Number(a.id));
}

function refresh(scope) {
  const rows = rowsOf(scope);
  const el = scope.el;
  // Rows a pending mutation is laid over: shown at once, marked until the server confirms.
  const pending = new Set((state.client?.pendingMutations() ?? []).map((m) => String(m.row.id)));
  const list = $(".rows", el);
  const next = new Map();
  const items = rows.map((row) => {
    const id = String(row.id);
    const json = JSON.stringify(row) + (pending.has(id) ? " pending" : "");
    next.set(id, json);
    let item = list.querySelector(`li[data-id="${CSS.escape(id)}"]`);
    if (item && item.dataset.json === json) return item;
    const fresh = renderRow(row, scope, pending.has(id));
    if (scope.seen.size > 0 || scope.subscribed) {
      fresh.classList.add("flash");
      // Once only: re-inserting the node on the next render must not replay the animation.
      fresh.addEventListener("animationend", () => fresh.classList.remove("flash"), { once: true });
    }
    return fresh;
  });
  // Touch only nodes that moved or changed, so a running animation is not restarted.
  items.forEach((item, i) => {
    if (list.children[i] !== item) list.insertBefore(item, list.children[i] ?? null);
  });
  while (list.children.length > items.length) list.lastElementChild.remove();
  scope.seen = next;
  $(".empty-rows", el).hidden = rows.length > 0;

  $(".stat-rows", el).textContent = rows.length;
  el.dataset.rowCount = rows.length;
  const cursor = scope.sub.cursor;
  const cursorEl = $(".stat-cursor", el);
  if (cursor) {
    cursorEl.innerHTML = `<span class="seq">#${cursor.serverSequence}</span> <span class="muted">${cursor.id}</span>`;
    cursorEl.title = `updatedAt ${cursor.updatedAt}`;
    el.dataset.cursorSeq = cursor.serverSequence;
  } else {
    cursorEl.textContent = "none yet";
    delete el.dataset.cursorSeq;
  }
  const replayed = scope.subscribed ? scope.sub.replayedOnLastResume : null;
  $(".stat-replayed", el).textContent = replayed == null ? "–" : `${replayed} replayed`;
  el.dataset.replayed = replayed ?? "";

  const badge = $(".origin", el);
  if (badge.dataset.kind !== "error") {
    const live = scope.subscribed && state.client?.status?.state === "open";
    badge.dataset.kind = live ? "live" : rows.length > 0 ? "cached" : "waiting";
    badge.textContent = live ? "live" : rows.length > 0 ? "from IndexedDB" : "waiting";
    el.dataset.origin = badge.dataset.kind;
  }

  const progress = $(".progress", el);
  const replay = scope.replay;
  progress.hidden = !replay || !(replay.total > 0) || replay.done >= replay.total;
  if (!progress.hidden) {
    $(".bar", progress).style.width = `${Math.min(100, (100 * replay.done) / replay.total)}%`;
    $(".progress-text", progress).textContent = `Catching up: ${replay.done} of ${replay.total} rows`;
  }
  renderBackfill();
}

function renderRow(row, scope, pending) {
  const id = String(row.id);
  const item = document.createElement("li");
  item.className = `row${row.done ? " done" : ""}${pending ? " pending" : ""}`;
  item.dataset.id = id;
  item.dataset.json = JSON.stringify(row) + (pending ? " pending" : "");
  if (pending) item.title = "Shown now; waiting for the server to confirm it";

  const check = document.createElement("input");
  check.type = "checkbox";
  check.checked = Boolean(row.done);
  check.title = row.done ? "Mark as not done" : "Mark as done";
  check.addEventListener("change", () =>
    write(`${row.done ? "Reopened" : "Completed"} “${row.title}”`, "update", { id: row.id, done: !row.done }),
  );

  const title = document.createElement("span");
  title.className = "title";
  title.textContent = row.title;
  title.title = "Double-click to rename";
  title.addEventListener("dblclick", () => rename(row, scope, title));

  const extras = document.createElement("span");
  extras.className = "extras";
  for (const [key, value] of Object.entries(row)) {
    if (BASE_COLUMNS.has(key)) continue;
    const chip = document.createElement("span");
    chip.className = "chip";
    chip.dataset.column = key;
    chip.textContent = `${key}: ${value}`;
    extras.append(chip);
  }

  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = `#${id}`;

  const owner = document.createElement("select");
  owner.className = "owner";
  owner.title = "Give to another user: the rules refuse it (a user may not move a row out of their own reach)";
  for (const user of USERS) {
    const option = new Option(user === row.owner ? user : `→ ${user}`, user, false, user === row.owner);
    owner.append(option);
  }
  owner.addEventListener("change", () => {
    const to = owner.value;
    write(`Gave “${row.title}” to ${to}`, "update", { id: row.id, owner: to });
  });

  const edit = iconButton("Rename", "✎", () => rename(row, scope, title));
  const remove = iconButton("Delete", "✕", () =>
    write(`Deleted “${row.title}”`, "delete", { id: row.id }),
  );
  remove.classList.add("danger");

  const body = document.createElement("span");
  body.className = "body";
  const sub = document.createElement("span");
  sub.className = "sub";
  sub.append(meta, extras);
  body.append(title, sub);
  item.append(check, body, owner, edit, remove);
  return item;
}

function iconButton(label, glyph, onClick) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "icon";
  button.title = label;
  button.setAttribute("aria-label", label);
  button.textContent = glyph;
  button.addEventListener("click", onClick);
  return button;
}

function rename(row, scope, titleEl) {
  const input = document.createElement("input");
  input.className = "rename";
  input.value = row.title;
  input.maxLength = 200;
  titleEl.replaceWith(input);
  input.focus();
  input.select();
  let done = false;
  const finish = (save) => {
    if (done) return;
    done = true;
    const title = input.value.trim();
    input.replaceWith(titleEl);
    if (!save || !title || title === row.title) return;
    write(`Renamed to “${title}”`, "update", { id: row.id, title });
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
}

function renderStatus() {
  const status = state.client?.status ?? { state: "connecting" };
  const el = $("#status");
  el.dataset.state = status.state;
  $("#status-text").textContent = STATUS_TEXT[status.state] ?? status.state;
  el.title = status.reason ?? "";
  // Tabs of one user share one socket: say which tab holds it.
  const follower = status.tabs === "follower";
  $("#tabs").textContent =
    status.tabs === "leader" ? "socket in this tab" : follower ? "socket in another tab" : "";
  const toggle = $("#offline");
  toggle.textContent = state.offline ? "Go online" : "Go offline";
  toggle.classList.toggle("active", state.offline);
  toggle.disabled = follower;
  toggle.title = follower ? "The tab that holds the socket can take it offline" : "";
  for (const scope of state.scopes) refresh(scope);
}

// ---- writes and their round trips --------------------------------------------------------

// Writes go through the client: shown at once, kept in IndexedDB until the server confirms
// them (offline and across reloads), applied once. The time logged runs from the click to
// `confirmed`: the server applied the write and its change is in this page's rows.

/** A new todo's id, made here so the row can show before the server has it: a bigint above
 * the ids Postgres hands out, unique enough for a demo. */
function newId() {
  return Date.now() * 1000 + Math.floor(Math.random() * 1000);
}

function addTodo(title) {
  write(`Added “${title}”`, "insert", { id: newId(), owner: state.user, title });
}

function write(label, op, row) {
  const t0 = performance.now();
  let mutation;
  try {
    mutation = state.client.mutate("todos", op, row);
  } catch (error) {
    logLine(`${label}: ${error.message}`, "error");
    return;
  }
  mutation.confirmed.then(
    () => {
      const ms = Math.round(performance.now() - t0);
      $("#latency").textContent = `${ms} ms`;
      logLine(label, "ok", ms);
    },
    () => {}, // The client's "rejected" event logs why.
  );
  for (const scope of state.scopes) refresh(scope);
}

function renderPending() {
  const count = state.client?.pendingCount ?? 0;
  const el = $("#pending");
  el.textContent = count === 0 ? "" : `${count} pending`;
  el.dataset.count = count;
  el.title = count === 0 ? "" : "Writes shown here, kept in IndexedDB, not yet confirmed by the server";
  for (const scope of state.scopes) refresh(scope);
}

function logLine(text, kind, ms) {
  const log = $("#log");
  $(".empty", log)?.remove();
  const item = document.createElement("li");
  item.className = kind;
  const label = document.createElement("span");
  label.textContent = text;
  item.append(label);
  if (ms !== undefined) {
    const time = document.createElement("span");
    time.className = "ms";
    time.textContent = `${ms} ms`;
    time.title = "From the click until the server confirmed it and its change was in this page's rows";
    item.append(time);
  }
  log.prepend(item);
  while (log.children.length > 8) log.lastElementChild.remove();
}

// ---- schema change -----------------------------------------------------------------------

async function addColumn() {
  const button = $("#add-column");
  button.disabled = true;
  const t0 = performance.now();
  try {
    const { column } = await api("POST", "/demo/columns");
    state.columns.push({ name: column, t0, arrivedMs: null });
    logLine(`ALTER TABLE todos ADD COLUMN ${column}`, "info");
    renderBackfill();
  } catch (error) {
    logLine(`Adding a column: ${error.message}`, "error");
  } finally {
    button.disabled = false;
  }
}

function renderBackfill() {
  const column = state.columns.at(-1);
  const el = $("#backfill");
  if (!column || !state.scopes.length) return;
  const rows = [...state.scopes[0].sub.rows()];
  const have = rows.filter((r) => column.name in r).length;
  if (column.arrivedMs === null && rows.length > 0 && have === rows.length) {
    column.arrivedMs = Math.round(performance.now() - column.t0);
    logLine(`Backfill of ${column.name} arrived in all ${rows.length} rows`, "ok", column.arrivedMs);
  }
  el.dataset.column = column.name;
  el.dataset.complete = String(column.arrivedMs !== null);
  el.textContent =
    column.arrivedMs === null
      ? `${column.name}: ${have} of ${rows.length} rows…`
      : `${column.name}: in all ${rows.length} rows, ${column.arrivedMs} ms`;
}

// ---- wiring ------------------------------------------------------------------------------

function selectUser(user) {
  state.user = user;
  localStorage.setItem("highwater-demo-user", user);
  for (const button of document.querySelectorAll("#users button")) {
    button.setAttribute("aria-checked", String(button.dataset.user === user));
  }
  const params = new URLSearchParams(location.search);
  params.set("user", user);
  history.replaceState(null, "", `?${params}`);
  start();
}

async function main() {
  try {
    await init();
  } catch (error) {
    document.documentElement.dataset.wasm = "failed";
    $("#status-text").textContent = "The WebAssembly module failed to load";
    $("#status").dataset.state = "closed";
    throw error;
  }
  document.documentElement.dataset.wasm = "ready";
  for (const button of document.querySelectorAll("#users button")) {
    button.addEventListener("click", () => selectUser(button.dataset.user));
  }
  $("#second").checked = state.second;
  $("#second").addEventListener("change", (event) => {
    state.second = event.target.checked;
    const params = new URLSearchParams(location.search);
    if (state.second) params.set("second", "1");
    else params.delete("second");
    history.replaceState(null, "", `?${params}`);
    start();
  });
  $("#offline").disabled = false;
  $("#offline").addEventListener("click", () => {
    state.offline = !state.offline;
    if (state.offline) state.client.goOffline();
    else state.client.goOnline();
    renderStatus();
  });
  $("#add-column").disabled = false;
  $("#add-column").addEventListener("click", addColumn);
  // Rows restored from IndexedDB arrive without a server event: look again now and then.
  setInterval(() => state.scopes.forEach(refresh), 1000);
  selectUser(state.user);
}

main();
