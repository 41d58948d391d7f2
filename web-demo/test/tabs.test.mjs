// Three tabs of the demo in one headless Chromium profile share one socket: one tab leads (Web
// Locks) and serves the others' scopes (BroadcastChannel); every tab shows the same live rows;
// closing the leader's tab hands the socket to another, which resumes from the stored cursor.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { Demo, launchBrowser, until } from "./support.mjs";

const WAIT = 20_000;

let demo;
let browser;
let context;
let pages = [];

const role = (page) => page.evaluate(() => window.demo.client.status.tabs);
const titles = (page) =>
  page.evaluate(() => window.demo.scopes.find((s) => s.key === "all").sub.rows().map((r) => r.title).sort());
/** The titles of the todos of ada's projects, as Postgres has them. */
const pgTitles = () =>
  demo
    .sql("SELECT coalesce(json_agg(title ORDER BY title), '[]') FROM todos WHERE project_id IN (SELECT project_id FROM members WHERE user_id = 'ada')")
    .trim();
/** Every open tab shows ada's rows exactly as Postgres has them. */
async function allEqualPostgres(what) {
  await until(what, async () => {
    const want = JSON.stringify(JSON.parse(pgTitles()).sort());
    for (const page of pages) if (JSON.stringify(await titles(page)) !== want) return false;
    return true;
  }, WAIT);
}

describe("tabs sharing one socket", { timeout: 180_000 }, () => {
  before(async () => {
    demo = await Demo.start();
    browser = await launchBrowser();
    context = await browser.newContext();
    for (let i = 0; i < 3; i++) {
      const page = await context.newPage();
      page.on("pageerror", (error) => console.log(`# page error: ${error.message}`));
      await page.goto(`${demo.url}?user=ada`);
      await page.waitForSelector('html[data-wasm="ready"]', { timeout: WAIT });
      pages.push(page);
    }
  });

  after(async () => {
    await browser?.close();
    await demo?.stop();
  });

  test("one tab leads, every tab is live, and the server holds one socket", async () => {
    for (const page of pages) {
      await page.waitForSelector('[data-scope="all"][data-origin="live"]', { timeout: WAIT });
    }
    const roles = await Promise.all(pages.map(role));
    assert.deepEqual([...roles].sort(), ["follower", "follower", "leader"]);
    await until("one /sync socket", async () => (await demo.syncSockets()) === 1, WAIT);
    for (const [i, page] of pages.entries()) {
      assert.equal(await page.evaluate(() => window.demo.client.status.state), "open");
      // The page says which tab holds the socket; only that one can take it offline.
      const leads = roles[i] === "leader";
      assert.equal(await page.textContent("#tabs"), leads ? "socket in this tab" : "socket in another tab");
      assert.equal(await page.isDisabled("#offline"), !leads);
    }
    const title = `Seen in every tab ${Date.now()}`;
    demo.sql(`INSERT INTO todos (project_id, title) VALUES (1, '${title}');`);
    await allEqualPostgres("the new row in every tab");
  });

  test("a tab without the socket writes through the one that has it: shown in every tab, applied once", async () => {
    const roles = await Promise.all(pages.map(role));
    const follower = pages[roles.indexOf("follower")];
    const title = `Written in a follower tab ${Date.now()}`;
    // The follower's mutation is numbered and sent by the leader; `confirmed` resolves here.
    const id = await follower.evaluate(async (title) => {
      const id = Date.now() * 1000 + 7;
      const mutation = window.demo.client.mutate("todos", "insert", { id, project_id: 1, title });
      await mutation.confirmed;
      return mutation.id > 0 && id;
    }, title);
    assert.ok(id, "the follower learned its mutation's number");
    assert.equal(demo.sql(`SELECT count(*) FROM todos WHERE title = '${title}';`), "1");
    await allEqualPostgres("the follower's write in every tab");
    assert.equal(await follower.evaluate(() => window.demo.client.pendingCount), 0);
  });

  test("closing the leader's tab hands the socket to another tab, which resumes from its cursor", async () => {
    const roles = await Promise.all(pages.map(role));
    const leader = pages[roles.indexOf("leader")];
    const total = (await titles(leader)).length;
    await leader.close();
    pages = pages.filter((page) => page !== leader);
    const closed = Date.now();
    await until("another tab to lead", async () => (await Promise.all(pages.map(role))).includes("leader"), 5_000);
    const tookOver = Date.now() - closed;
    console.log(`# a new leader after ${tookOver} ms`);
    await until("one /sync socket again", async () => (await demo.syncSockets()) === 1, WAIT);
    const title = `After the leader closed ${Date.now()}`;
    demo.sql(`INSERT INTO todos (project_id, title) VALUES (2, '${title}');`);
    await allEqualPostgres("the row after the hand-over in both tabs");
    // The new leader resumed from the stored cursor: its catch-up replayed a few rows, not the
    // whole scope.
    const newLeader = pages[(await Promise.all(pages.map(role))).indexOf("leader")];
    const replayed = await newLeader.evaluate(() => window.demo.scopes.find((s) => s.key === "all").sub.replayedOnLastResume);
    assert.ok(replayed < total, `replayed ${replayed} of ${total}`);
  });
});
