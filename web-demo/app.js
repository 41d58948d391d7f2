// The demo page: one HighwaterClient per user shown (one socket each, rows cached in IndexedDB),
// scopes on `todos` (all the user may read, optionally the open ones too), `projects` and
// `members`; todos written through the client with their round trip timed from the click until
// the server confirmed them, and project memberships switched upstream through the demo's
// endpoint, timed until the user's page holds the change.
import { init, HighwaterClient, IndexedDbStore } from "/pkg/web.js";

const USERS = ["ada", "grace", "linus"];
const BASE_COLUMNS = new Set(["id", "project_id", "title", "done", "updated_at"]);
/** Project hues, by id; others get one from their id. */
const HUES = { 1: 188, 2: 262, 3: 32, 4: 338 };
const STATUS_TEXT = {
  connecting: "Connecting",
  open: "Live",
  reconnecting: "Reconnecting",
  offline: "Offline",
  closed: "Closed",
};

const $ = (selector, root = document) => root.querySelector(selector);
const params = () => new URLSearchParams(location.search);

const state = {
  user: pickUser(),
  beside: null,
  second: params().get("second") === "1",
  // One per user shown, the signed-in user's first: {user, client, scopes, projects, members, switches}.
  panels: [],
  // Every panel's todos scopes, the signed-in user's first:
  // {key, user, panel, title, where, conditions, sub, el, seen: Map<id, json>, subscribed}.
  scopes: [],
  // Every project, id → name (`/demo/projects`): a user reads only the projects it is in, and
  // the switches need the others' names too.
  projects: new Map(),
  columns: [], // columns added from this page: {name, t0, arrivedMs}
  offline: false,
};
state.beside = pickBeside();

function pickUser() {
  const asked = params().get("user") ?? localStorage.getItem("highwater-demo-user");
  return USERS.includes(asked) ? asked : "ada";
}

function pickBeside() {
  const asked = params().get("with");
  return USERS.includes(asked) && asked !== state.user ? asked : null;
}

async function token(user) {
  const response = await fetch(`/demo/token?sub=${encodeURIComponent(user)}`);
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

// ---- clients and scopes ------------------------------------------------------------------

function start() {
  stop();
  state.offline = false;
  const specs = [
    { key: "all", title: `${state.user}'s todos`, conditions: {} },
  ];
  if (state.second) {
    specs.push({ key: "open", title: `${state.user}'s open todos`, conditions: { done: false } });
  }
  const container = $("#scopes");
  container.replaceChildren();
  state.panels = [openPanel(state.user, specs)];
  if (state.beside) {
    state.panels.push(openPanel(state.beside, [{ key: "with", title: `${state.beside}'s todos`, conditions: {} }]));
  }
  state.scopes = state.panels.flatMap((panel) => panel.scopes);
  container.dataset.count = state.scopes.length;
  window.demo = { client: state.panels[0].client, scopes: state.scopes, panels: state.panels, state };
  renderStatus();
  renderPending();
  for (const panel of state.panels) renderMemberships(panel);
}

/** A user's client and scopes: its todos (one card per spec), and the projects and memberships
 * it may read, which the first card's switches show. */
function openPanel(user, specs) {
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/sync`;
  // Tabs of one user share one socket: the leader tab's client serves the others' scopes with
  // its token, so the share (and the store, which holds scopes by their conditions) is the user's.
  const client = new HighwaterClient({
    url,
    token: () => token(user),
    store: new IndexedDbStore(`highwater-demo-${user}`),
    shareTabs: `highwater-demo-${user}`,
  });
  const panel = { user, client, scopes: [], switches: new Map() };
  client.on("status", () => renderStatus());
  client.on("outbox", () => renderPending());
  client.on("rejected", ({ code, message }) => logLine(`Refused (${code}): ${message}`, "error"));
  panel.projects = client.subscribe({ resourceType: "projects", conditions: {} });
  panel.members = client.subscribe({ resourceType: "members", conditions: {} });
  for (const sub of [panel.projects, panel.members]) {
    for (const event of ["change", "reset", "ready"]) sub.on(event, () => renderMemberships(panel));
  }
  const where = `project_id IN (SELECT project_id FROM members WHERE user_id = '${user}')`;
  panel.scopes = specs.map((spec) => {
    const el = $("#scope-template").content.firstElementChild.cloneNode(true);
    el.dataset.scope = spec.key;
    el.dataset.user = user;
    $(".scope-title", el).textContent = spec.title;
    const done = "done" in spec.conditions ? ` AND done = ${spec.conditions.done}` : "";
    $(".scope-where", el).innerHTML = `<code>todos</code> where <code>${where}${done}</code>`;
    $(".scope-where", el).title = "The rules' row filter, with this user's token's sub in place of auth.sub";
    $(".add", el).addEventListener("submit", (event) => {
      event.preventDefault();
      const form = event.target;
      const title = form.elements.title.value.trim();
      if (title && form.elements.project.value) addTodo(panel, title, Number(form.elements.project.value));
      form.elements.title.value = "";
    });
    $("#scopes").append(el);
    const sub = client.subscribe({ resourceType: "todos", conditions: spec.conditions });
    const scope = { ...spec, user, panel, where, sub, el, seen: new Map(), subscribed: false, replay: null };
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
  $(".memberships", panel.scopes[0].el).hidden = false;
  return panel;
}

function stop() {
  for (const panel of state.panels) {
    for (const scope of panel.scopes) scope.sub.unsubscribe();
    panel.projects.unsubscribe();
    panel.members.unsubscribe();
    panel.client.close();
  }
  state.panels = [];
  state.scopes = [];
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

// ---- projects and memberships ------------------------------------------------------------

async function loadProjects() {
  try {
    const { projects } = await api("GET", "/demo/projects");
    state.projects = new Map(projects.map((p) => [String(p.id), p.name]));
  } catch (error) {
    logLine(`Reading the projects: ${error.message}`, "error");
  }
}

function projectName(id, panel) {
  const key = String(id);
  const synced = panel?.projects.rows().find((p) => String(p.id) === key);
  return state.projects.get(key) ?? synced?.name ?? `project ${key}`;
}

function hue(id) {
  return HUES[id] ?? (Number(id) * 67) % 360;
}

/** The projects `panel`'s user is a member of, by id, as its page holds them. */
function memberOf(panel) {
  return new Set(panel.members.rows().filter((m) => m.user_id === panel.user).map((m) => String(m.project_id)));
}

/** Every project id the page knows: all of them, or at least those a panel reads. */
function allProjects() {
  const ids = new Set(state.projects.keys());
  for (const panel of state.panels) for (const p of panel.projects.rows()) ids.add(String(p.id));
  return [...ids].sort((a, b) => Number(a) - Number(b));
}

function renderMemberships(panel) {
  if (!panel.scopes.length) return;
  const mine = memberOf(panel);
  // A switch waits for the membership to reach this user's page: then its rows have too.
  for (const [id, change] of panel.switches) {
    if (change.requested && mine.has(id) === change.want) {
      panel.switches.delete(id);
      const ms = Math.round(performance.now() - change.t0);
      const name = projectName(id, panel);
      logLine(change.want ? `${panel.user} joined ${name}` : `${panel.user} left ${name}`, "ok", ms, "From the click until the membership, and the project's rows, reached this page");
    }
  }
  const todos = panel.scopes[0].sub.rows();
  const list = $(".project-list", panel.scopes[0].el);
  const ids = allProjects();
  for (const id of ids) {
    let item = list.querySelector(`li[data-project="${CSS.escape(id)}"]`);
    if (!item) {
      item = document.createElement("li");
      item.className = "project";
      item.dataset.project = id;
      item.style.setProperty("--hue", hue(id));
      const button = document.createElement("button");
      button.type = "button";
      button.setAttribute("role", "switch");
      button.innerHTML = '<span class="knob" aria-hidden="true"></span><span class="project-name"></span><span class="count"></span>';
      button.addEventListener("click", () => switchMembership(panel, id, button.getAttribute("aria-checked") !== "true"));
      const people = document.createElement("span");
      people.className = "people";
      item.append(button, people);
      list.append(item);
    }
    const change = panel.switches.get(id);
    const member = change ? change.want : mine.has(id);
    const name = projectName(id, panel);
    const button = $("button", item);
    button.setAttribute("aria-checked", String(member));
    button.disabled = Boolean(change);
    button.title = member
      ? `${panel.user} is in ${name}: click to take ${panel.user} out (upstream, as an admin would)`
      : `${panel.user} is not in ${name}: click to add ${panel.user} (upstream, as an admin would)`;
    item.dataset.member = String(member);
    item.dataset.state = change ? "pending" : "idle";
    $(".project-name", item).textContent = name;
    const count = todos.filter((t) => String(t.project_id) === id).length;
    $(".count", item).textContent = mine.has(id) ? count : "";
    // Who else is in it: this user reads the memberships of its own projects only.
    const others = panel.members
      .rows()
      .filter((m) => String(m.project_id) === id && m.user_id !== panel.user)
      .map((m) => m.user_id)
      .sort();
    $(".people", item).textContent = !mine.has(id) ? "" : others.length ? `with ${others.join(", ")}` : "only you";
  }
  for (const item of [...list.children]) if (!ids.includes(item.dataset.project)) item.remove();
  for (const scope of panel.scopes) renderProjectChoice(scope, mine);
}

async function switchMembership(panel, id, want) {
  const change = { want, t0: performance.now(), requested: false };
  panel.switches.set(id, change);
  renderMemberships(panel);
  try {
    await api(want ? "PUT" : "DELETE", `/demo/projects/${id}/members/${encodeURIComponent(panel.user)}`);
    change.requested = true;
  } catch (error) {
    panel.switches.delete(id);
    logLine(`Switching ${panel.user}'s membership of ${projectName(id, panel)}: ${error.message}`, "error");
  }
  renderMemberships(panel);
}

/** The add form's project choice: the projects the user is in. */
function renderProjectChoice(scope, mine) {
  const select = $(".add select", scope.el);
  const ids = [...mine].sort((a, b) => Number(a) - Number(b));
  const key = ids.map((id) => `${id}:${projectName(id, scope.panel)}`).join(",");
  if (select.dataset.key !== key) {
    const chosen = select.value;
    select.replaceChildren(...ids.map((id) => new Option(projectName(id, scope.panel), id, false, id === chosen)));
    select.dataset.key = key;
  }
  const input = $(".add input", scope.el);
  const none = ids.length === 0;
  select.disabled = none;
  $(".add button", scope.el).disabled = none;
  input.disabled = none;
  input.placeholder = none ? "Join a project to add todos" : "New todo…";
}

// ---- rendering ---------------------------------------------------------------------------

function rowsOf(scope) {
  return [...scope.sub.rows()].sort((a, b) => Number(b.id) - Number(a.id));
}

function refresh(scope) {
  const rows = rowsOf(scope);
  const el = scope.el;
  // Rows a pending mutation is laid over: shown at once, marked until the server confirms.
  const pending = new Set(scope.panel.client.pendingMutations().map((m) => String(m.row.id)));
  const list = $(".rows", el);
  const next = new Map();
  const projects = allProjects().join(",");
  const items = rows.map((row) => {
    const id = String(row.id);
    const json = JSON.stringify(row) + (pending.has(id) ? " pending" : "") + projects;
    next.set(id, json);
    let item = list.querySelector(`li[data-id="${CSS.escape(id)}"]`);
    // A row being renamed stays as it is until the rename ends (which renders it again).
    if (item && (item.dataset.json === json || item.querySelector("input.rename"))) return item;
    const fresh = renderRow(row, scope, pending.has(id), json);
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
    const live = scope.subscribed && scope.panel.client.status?.state === "open";
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
  if (scope === scope.panel.scopes[0]) renderMemberships(scope.panel);
  renderBackfill();
}

function renderRow(row, scope, pending, json) {
  const id = String(row.id);
  const project = String(row.project_id);
  const item = document.createElement("li");
  item.className = `row${row.done ? " done" : ""}${pending ? " pending" : ""}`;
  item.dataset.id = id;
  item.dataset.project = project;
  item.dataset.json = json;
  if (pending) item.title = "Shown now; waiting for the server to confirm it";

  const check = document.createElement("input");
  check.type = "checkbox";
  check.checked = Boolean(row.done);
  check.title = row.done ? "Mark as not done" : "Mark as done";
  check.addEventListener("change", () =>
    write(scope.panel, `${row.done ? "Reopened" : "Completed"} “${row.title}”`, "update", { id: row.id, done: !row.done }),
  );

  const title = document.createElement("span");
  title.className = "title";
  title.textContent = row.title;
  title.title = "Double-click to rename";
  title.addEventListener("dblclick", () => rename(row, scope, title));

  const chip = document.createElement("span");
  chip.className = "project-chip";
  chip.style.setProperty("--hue", hue(project));
  chip.textContent = projectName(project, scope.panel);

  const extras = document.createElement("span");
  extras.className = "extras";
  for (const [key, value] of Object.entries(row)) {
    if (BASE_COLUMNS.has(key)) continue;
    const extra = document.createElement("span");
    extra.className = "chip";
    extra.dataset.column = key;
    extra.textContent = `${key}: ${value}`;
    extras.append(extra);
  }

  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = `#${id}`;

  const move = document.createElement("select");
  move.className = "move";
  move.title = "Move to another project: to one this user is not in, the rules refuse it (nobody moves a row out of their own reach)";
  for (const other of allProjects()) {
    const name = projectName(other, scope.panel);
    move.append(new Option(other === project ? name : `→ ${name}`, other, false, other === project));
  }
  move.addEventListener("change", () => {
    const to = move.value;
    write(scope.panel, `Moved “${row.title}” to ${projectName(to, scope.panel)}`, "update", { id: row.id, project_id: Number(to) });
  });

  const edit = iconButton("Rename", "✎", () => rename(row, scope, title));
  const remove = iconButton("Delete", "✕", () =>
    write(scope.panel, `Deleted “${row.title}”`, "delete", { id: row.id }),
  );
  remove.classList.add("danger");

  const body = document.createElement("span");
  body.className = "body";
  const sub = document.createElement("span");
  sub.className = "sub";
  sub.append(chip, meta, extras);
  body.append(title, sub);
  item.append(check, body, move, edit, remove);
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
    write(scope.panel, `Renamed to “${title}”`, "update", { id: row.id, title });
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") finish(false);
  });
  // Later, not in the blur: a blur can come from the row being taken out of the list, and
  // moving nodes from inside that removal throws.
  input.addEventListener("blur", () => setTimeout(() => finish(true)));
}

function renderStatus() {
  // The signed-in user's socket; a second user's panel shows its own state in its badge.
  const status = state.panels[0]?.client.status ?? { state: "connecting" };
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

function addTodo(panel, title, project) {
  write(panel, `Added “${title}” to ${projectName(project, panel)}`, "insert", { id: newId(), project_id: project, title });
}

function write(panel, label, op, row) {
  const t0 = performance.now();
  const who = panel === state.panels[0] ? "" : `${panel.user}: `;
  let mutation;
  try {
    mutation = panel.client.mutate("todos", op, row);
  } catch (error) {
    logLine(`${who}${label}: ${error.message}`, "error");
    return;
  }
  mutation.confirmed.then(
    () => {
      const ms = Math.round(performance.now() - t0);
      $("#latency").textContent = `${ms} ms`;
      logLine(`${who}${label}`, "ok", ms);
    },
    () => {}, // The client's "rejected" event logs why.
  );
  for (const scope of panel.scopes) refresh(scope);
}

function renderPending() {
  const count = state.panels.reduce((sum, panel) => sum + (panel.client.pendingCount ?? 0), 0);
  const el = $("#pending");
  el.textContent = count === 0 ? "" : `${count} pending`;
  el.dataset.count = count;
  el.title = count === 0 ? "" : "Writes shown here, kept in IndexedDB, not yet confirmed by the server";
  for (const scope of state.scopes) refresh(scope);
}

function logLine(text, kind, ms, timeTitle) {
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
    time.title = timeTitle ?? "From the click until the server confirmed it and its change was in this page's rows";
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

function setParam(name, value) {
  const next = params();
  if (value) next.set(name, value);
  else next.delete(name);
  history.replaceState(null, "", `?${next}`);
}

function selectUser(user) {
  state.user = user;
  localStorage.setItem("highwater-demo-user", user);
  for (const button of document.querySelectorAll("#users button")) {
    button.setAttribute("aria-checked", String(button.dataset.user === user));
  }
  setParam("user", user);
  if (state.beside === user) selectBeside(null, false);
  renderBesideChoice();
  start();
}

function selectBeside(user, restart = true) {
  state.beside = user || null;
  setParam("with", state.beside);
  renderBesideChoice();
  if (restart) start();
}

function renderBesideChoice() {
  const select = $("#beside");
  select.value = state.beside ?? "";
  for (const option of select.options) option.disabled = option.value === state.user;
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
  $("#beside").addEventListener("change", (event) => selectBeside(event.target.value));
  $("#second").checked = state.second;
  $("#second").addEventListener("change", (event) => {
    state.second = event.target.checked;
    setParam("second", state.second ? "1" : null);
    start();
  });
  $("#offline").disabled = false;
  $("#offline").addEventListener("click", () => {
    state.offline = !state.offline;
    for (const panel of state.panels) {
      if (state.offline) panel.client.goOffline();
      else panel.client.goOnline();
    }
    renderStatus();
  });
  $("#add-column").disabled = false;
  $("#add-column").addEventListener("click", addColumn);
  // Rows restored from IndexedDB arrive without a server event: look again now and then.
  setInterval(() => state.scopes.forEach(refresh), 1000);
  // The switches' names; the lists do not wait for them.
  loadProjects().then(() => state.panels.forEach(renderMemberships));
  selectUser(state.user);
}

main();
