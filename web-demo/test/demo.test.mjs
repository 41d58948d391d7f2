// The web demo in headless Chromium against a real `highwater demo` (private Postgres, scope
// sync, the built npm package). Needs `scripts/build-wasm` and the `highwater` binary built.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { Demo, launchBrowser, nextResume, screenshotPath, until } from "./support.mjs";

const WAIT = 20_000;
/** The seed: ada is in Launch (1) and Docs (2), grace in Launch and Hiring (3), linus in Infra (4). */
const LAUNCH = 1;
const DOCS = 2;
const HIRING = 3;
const INFRA = 4;

let demo;
let browser;
let context;
let page;

/** The rows the page holds in a scope, from its client. */
const rows = (key = "all") =>
  page.evaluate((key) => window.demo.scopes.find((s) => s.key === key).sub.rows().map((r) => ({ ...r })), key);
/** Ids of the todos of `project` in Postgres. */
const projectIds = (project) =>
  demo.sql(`SELECT id FROM todos WHERE project_id = ${project} ORDER BY id;`).split("\n").filter(Boolean).map(Number);
const cursorSequence = () => page.evaluate(() => window.demo.scopes[0].sub.cursor?.serverSequence ?? null);
const titlesOnPage = () => page.$$eval('[data-scope="all"] .rows .title', (els) => els.map((e) => e.textContent));

async function openPage(query = "?user=ada") {
  page.removeAllListeners("pageerror");
  page.on("pageerror", (error) => console.log(`# page error: ${error.message}`));
  await page.goto(`${demo.url}${query}`);
  await page.waitForSelector('html[data-wasm="ready"]', { timeout: WAIT });
}

async function waitLive() {
  await page.waitForSelector('[data-scope="all"][data-origin="live"]', { timeout: WAIT });
}

describe("web demo", { timeout: 240_000 }, () => {
  before(async () => {
    demo = await Demo.start();
    browser = await launchBrowser();
    context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
    page = await context.newPage();
  });

  after(async () => {
    await browser?.close();
    await demo?.stop();
  });

  test("the page loads, the WebAssembly is ready and the todos of ada's projects are live", async () => {
    await openPage();
    await waitLive();
    const want = [...projectIds(LAUNCH), ...projectIds(DOCS)].sort((a, b) => a - b);
    assert.equal(want.length, 7, "the seed gives Launch four todos and Docs three");
    const held = await until("the seed rows of Launch and Docs", async () => {
      const r = await rows();
      return r.length >= want.length && r;
    }, WAIT);
    assert.deepEqual(held.map((r) => Number(r.id)).sort((a, b) => a - b), want, "ada's scope holds the todos of her projects, no other");
    assert.equal(await page.textContent("#status-text"), "Live");
    assert.equal(await page.$$eval('[data-scope="all"] .rows li', (els) => els.length), held.length);
    // Each todo is labelled with its project; the switches show ada's memberships and who shares them.
    const labels = await page.$$eval('[data-scope="all"] .rows .project-chip', (els) => [...new Set(els.map((e) => e.textContent))].sort());
    assert.deepEqual(labels, ["Docs", "Launch"]);
    await until("the membership switches", async () => {
      const switches = await page.$$eval('[data-scope="all"] .project', (els) =>
        els.map((e) => [e.querySelector(".project-name").textContent, e.dataset.member, e.querySelector(".people").textContent]));
      return JSON.stringify(switches) ===
        JSON.stringify([["Launch", "true", "with grace"], ["Docs", "true", "only you"], ["Hiring", "false", ""], ["Infra", "false", ""]]);
    }, WAIT);
  });

  test("a row inserted directly in Postgres appears", async () => {
    const title = `Inserted by psql ${Date.now()}`;
    demo.sql(`INSERT INTO todos (project_id, title) VALUES (${DOCS}, '${title}');`);
    await until("the psql row on the page", async () => (await titlesOnPage()).includes(title), WAIT);
    demo.sql(`INSERT INTO todos (project_id, title) VALUES (${HIRING}, 'Not for ada ${title}');`);
    await new Promise((r) => setTimeout(r, 1000));
    assert.ok(!(await titlesOnPage()).some((t) => t.startsWith("Not for ada")), "a todo of Hiring stays out of ada's scope");
  });

  test("offline, 100 upstream writes, online: all 100 arrive exactly once, replayed from the cursor", async () => {
    await waitLive();
    const before = await cursorSequence();
    assert.notEqual(before, null, "the scope has a cursor before going offline");
    const resumed = await nextResume(page);
    await page.click("#offline");
    await page.waitForSelector('#status[data-state="offline"]', { timeout: WAIT });

    const statements = Array.from({ length: 100 }, (_, i) => `INSERT INTO todos (project_id, title) VALUES (${DOCS}, 'Offline write ${i}');`);
    const stored = await demo.storedTransactions();
    demo.sql(statements.join("\n"));
    // The server has them (one transaction each), with the page still offline.
    await demo.stored(stored + 100, "the server to store the 100 offline writes");
    // Live delivery follows a store within milliseconds: an online page would have them by now.
    await new Promise((r) => setTimeout(r, 500));
    assert.equal((await rows()).filter((r) => r.title.startsWith("Offline write")).length, 0, "nothing arrives while offline");

    await page.click("#offline");
    await until("all 100 offline writes", async () => (await rows()).filter((r) => r.title.startsWith("Offline write")).length >= 100, WAIT);
    await waitLive();
    const held = await rows();
    const titles = held.filter((r) => r.title.startsWith("Offline write")).map((r) => r.title);
    assert.equal(titles.length, 100);
    assert.equal(new Set(titles).size, 100, "each write exactly once");
    const ids = held.map((r) => String(r.id));
    assert.equal(new Set(ids).size, ids.length, "no row twice in the scope");
    const domTitles = (await titlesOnPage()).filter((t) => t.startsWith("Offline write"));
    assert.equal(domTitles.length, 100, "the list shows each once");
    const afterSequence = await cursorSequence();
    assert.ok(afterSequence > before, `the cursor advanced (${before} → ${afterSequence})`);
    const replayed = await resumed();
    assert.equal(replayed, 100, "the resume replays only the missed rows");
    assert.equal(await page.getAttribute('[data-scope="all"]', "data-replayed"), "100");
  });

  test("add, complete, rename, move and delete through the page, each with its round trip", async () => {
    const title = `Typed in the page ${Date.now()}`;
    await page.selectOption('[data-scope="all"] .add select', String(DOCS));
    await page.fill('[data-scope="all"] .add input', title);
    await page.press('[data-scope="all"] .add input', "Enter");
    const added = await until("the added row", async () => (await rows()).find((r) => r.title === title), WAIT);
    await until("a timed round trip", async () => /Added “.*” to Docs\d+ ms/.test(await page.textContent("#log")), WAIT);
    assert.match(await page.textContent("#latency"), /^\d+ ms$/);
    assert.equal(demo.sql(`SELECT project_id FROM todos WHERE id = ${added.id};`), String(DOCS));

    const item = `[data-scope="all"] li[data-id="${added.id}"]`;
    await page.click(`${item} input[type="checkbox"]`);
    await until("the row done", async () => (await rows()).find((r) => r.id === added.id)?.done === true, WAIT);

    await page.click(`${item} button[title="Rename"]`);
    await page.fill(`${item} input.rename`, `${title} (renamed)`);
    await page.press(`${item} input.rename`, "Enter");
    await until("the new title", async () => (await rows()).find((r) => r.id === added.id)?.title === `${title} (renamed)`, WAIT);

    // To another of ada's projects: allowed.
    await page.selectOption(`${item} select.move`, String(LAUNCH));
    await until("the row in Launch", async () => Number((await rows()).find((r) => r.id === added.id)?.project_id) === LAUNCH, WAIT);
    await until("the move confirmed", async () => /Moved “.*” to Launch\d+ ms/.test(await page.textContent("#log")), WAIT);
    assert.equal(demo.sql(`SELECT project_id FROM todos WHERE id = ${added.id};`), String(LAUNCH));
    assert.equal(await page.textContent(`${item} .project-chip`), "Launch");

    await page.click(`${item} button[title="Delete"]`);
    // Gone at once (the client lays its delete over the row), and from Postgres once confirmed.
    await until("the row gone", async () => !(await rows()).some((r) => r.id === added.id), WAIT);
    await until("the delete confirmed", async () => /Deleted “.*”\d+ ms/.test(await page.textContent("#log")), WAIT);
    assert.equal(demo.sql(`SELECT count(*) FROM todos WHERE id = ${added.id};`), "0");
  });

  test("moving a row to a project ada is not in is refused by the rules, and the row stays", async () => {
    const [row] = (await rows()).filter((r) => r.title.startsWith("Offline write"));
    await page.selectOption(`[data-scope="all"] li[data-id="${row.id}"] select.move`, String(HIRING));
    await until("the refusal logged", async () => /Refused \(forbidden\)/.test(await page.textContent("#log")), WAIT);
    await until("the row back in Docs", async () => Number((await rows()).find((r) => r.id === row.id)?.project_id) === DOCS, WAIT);
    assert.equal(demo.sql(`SELECT project_id FROM todos WHERE id = ${row.id};`), String(DOCS));
  });

  test("a reload shows the rows from IndexedDB before reconnecting", async () => {
    const held = (await rows()).map((r) => r.id).sort();
    // Hold every /sync socket: the page opens it, the server never hears of it.
    await page.routeWebSocket(/\/sync$/, () => {});
    await page.reload();
    await page.waitForSelector('html[data-wasm="ready"]', { timeout: WAIT });
    await until("the cached rows", async () => {
      const now = await rows();
      return now.length === held.length;
    }, WAIT);
    assert.deepEqual((await rows()).map((r) => r.id).sort(), held, "the same rows, from IndexedDB");
    assert.equal(await page.getAttribute('[data-scope="all"]', "data-origin"), "cached");
    assert.equal((await titlesOnPage()).length, held.length);
    assert.notEqual(await page.getAttribute("#status", "data-state"), "closed");
    // The rest runs on a page whose socket reaches the server. A row written meanwhile: the new
    // page starts from IndexedDB's rows and cursor, so the server replays that one row only.
    await page.close();
    const stored = await demo.storedTransactions();
    demo.sql(`INSERT INTO todos (project_id, title) VALUES (${LAUNCH}, 'Written while reloading');`);
    await demo.stored(stored + 1, "the server to store the row written while reloading");
    page = await context.newPage();
    await openPage();
    await waitLive();
    const replayed = await until("the resume to be counted", () =>
      page.evaluate(() => window.demo.scopes[0].sub.replayedOnLastResume || null), WAIT);
    assert.equal(replayed, 1, "only the row written after the stored cursor is replayed");
    assert.ok((await rows()).some((r) => r.title === "Written while reloading"));
  });

  test("a column added upstream arrives in every row by backfill", async () => {
    await openPage();
    await waitLive();
    await page.click("#add-column");
    await page.waitForSelector('#backfill[data-complete="true"]', { timeout: WAIT });
    const held = await rows();
    assert.ok(held.length > 0);
    assert.ok(held.every((r) => r.priority === 3), "every row has the new column's default");
  });

  test("fifty writes made offline survive a reload and are applied once when online, without a flicker", async () => {
    await openPage();
    await waitLive();
    // Offline: every /sync socket stays up but reaches nothing, until `online` is set; the
    // client's heartbeat then replaces the dead socket with one that reaches the server.
    let online = false;
    await page.routeWebSocket(/\/sync$/, (ws) => {
      if (online) ws.connectToServer();
    });
    await page.reload();
    await page.waitForSelector('html[data-wasm="ready"]', { timeout: WAIT });
    const stamp = Date.now();
    // Queued, and in IndexedDB (`stored`), before the page goes away.
    await page.evaluate(async (stamp) => {
      const made = [];
      for (let i = 0; i < 50; i++) {
        made.push(window.demo.client.mutate("todos", "insert", { id: stamp * 1000 + i, project_id: 1, title: `Offline ${stamp} ${i}` }));
      }
      await Promise.all(made.map((m) => m.stored));
    }, stamp);
    assert.equal(await page.evaluate(() => window.demo.client.pendingCount), 50);
    await page.reload();
    await page.waitForSelector('html[data-wasm="ready"]', { timeout: WAIT });
    await until("the 50 shown as pending after the reload", async () =>
      (await page.$$('[data-scope="all"] li.pending')).length === 50, WAIT);
    assert.equal(await page.textContent("#pending"), "50 pending");
    await page.screenshot({ path: screenshotPath("demo-pending.png"), fullPage: false });
    assert.equal(demo.sql(`SELECT count(*) FROM todos WHERE title LIKE 'Offline ${stamp} %';`), "0");
    // Every change event from here on must still show all 50 rows.
    await page.evaluate(() => {
      window.flicker = [];
      const sub = window.demo.scopes[0].sub;
      const ids = window.demo.client.pendingMutations().map((m) => String(m.row.id));
      sub.on("change", () => {
        const shown = new Set(sub.rows().map((r) => String(r.id)));
        for (const id of ids) if (!shown.has(id)) window.flicker.push(id);
      });
    });
    online = true;
    await until("the outbox drained", () => page.evaluate(() => window.demo.client.pendingCount === 0), 60_000);
    assert.equal(demo.sql(`SELECT count(*) FROM todos WHERE title LIKE 'Offline ${stamp} %';`), "50");
    assert.equal(demo.sql(`SELECT count(DISTINCT title) FROM todos WHERE title LIKE 'Offline ${stamp} %';`), "50");
    assert.deepEqual(await page.evaluate(() => window.flicker), [], "a row left the list between shown and confirmed");
    await until("no row marked pending", async () => (await page.$$('[data-scope="all"] li.pending')).length === 0, WAIT);
    assert.equal((await rows()).filter((r) => r.title.startsWith(`Offline ${stamp} `)).length, 50);
  });

  test("a screenshot of the live page is saved", async () => {
    await page.check("#second");
    await page.waitForSelector('[data-scope="open"][data-origin="live"]', { timeout: WAIT });
    const open = await rows("open");
    assert.ok(open.every((r) => r.done === false), "the second scope holds only open todos");
    const path = screenshotPath("demo.png");
    await page.screenshot({ path, fullPage: false });
    console.log(`# screenshot: ${path}`);
  });
});
