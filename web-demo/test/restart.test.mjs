// The page across a server restart: the demo stops and starts again on the same Postgres and data
// directory; the page reconnects on its own and resumes from its cursor.
import assert from "node:assert/strict";
import { chmodSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { Demo, freePort, launchBrowser, nextResume, startPostgres, stopPostgres, until } from "./support.mjs";

const WAIT = 20_000;
let work;
let upstream;
let demo;
let browser;

before(() => {
  work = mkdtempSync(join(tmpdir(), "highwater-web-restart-"));
  chmodSync(work, 0o755); // Postgres runs as its own user when the tests run as root
  upstream = startPostgres(join(work, "pg"));
});

after(async () => {
  await browser?.close();
  await demo?.stop();
  if (work) {
    if (upstream) stopPostgres(join(work, "pg"));
    rmSync(work, { recursive: true, force: true });
  }
});

test("after a server restart the page reconnects by itself and gets only what it missed", { timeout: 180_000 }, async () => {
  const port = await freePort();
  const options = { port, upstream, data: join(work, "data") };
  demo = await Demo.start(options);
  browser = await launchBrowser();
  const page = await browser.newPage();
  page.on("pageerror", (error) => console.log(`# page error: ${error.message}`));
  const rows = () => page.evaluate(() => window.demo.scopes[0].sub.rows().map((r) => ({ ...r })));
  await page.goto(`${demo.url}?user=linus`);
  await page.waitForSelector('[data-scope="all"][data-origin="live"]', { timeout: WAIT });
  const before = await until("the seed rows of linus's project, Infra", async () => {
    const held = await rows();
    return held.length >= 3 && held;
  }, WAIT);
  const cursorBefore = await page.evaluate(() => window.demo.scopes[0].sub.cursor.serverSequence);
  const resumed = await nextResume(page);

  await demo.stop();
  await page.waitForSelector('#status:not([data-state="open"])', { timeout: WAIT });
  // Until the restarted server has stored the row written while it was down, a resubscribing
  // page would get an empty replay and the row live: correct, but not the resume this test is
  // about. The page fetches a token on every connect, so its token requests wait until then;
  // the page's own reconnect loop does the rest.
  let storedMissedRow;
  const stored = new Promise((resolve) => (storedMissedRow = resolve));
  const tokens = "**/demo/token*";
  await page.route(tokens, async (route) => {
    await stored;
    await route.continue();
  });
  demo.sql(`INSERT INTO todos (project_id, title) VALUES (4, 'Written while the server was down');`);

  demo = await Demo.start(options);
  await demo.stored(1, "the restarted server to store the row it missed");
  storedMissedRow();
  await page.unrouteAll({ behavior: "wait" }); // lets the held requests through first
  await page.waitForSelector('#status[data-state="open"]', { timeout: 60_000 }).catch(async (error) => {
    const status = await page.getAttribute("#status", "title");
    throw new Error(`${error.message}\nclient status: ${status}\ndemo stderr:\n${demo.stderr.slice(-2000)}`);
  });
  const held = await until("the row written during the restart", async () => {
    const now = await rows();
    return now.some((r) => r.title === "Written while the server was down") && now;
  }, WAIT);
  assert.equal(held.length, before.length + 1, "the rows held before, plus the one missed");
  assert.equal(new Set(held.map((r) => r.id)).size, held.length, "no row twice");
  const replayed = await resumed();
  assert.equal(replayed, 1, "the same replica resumes from the cursor: one row replayed, not the scope");
  const cursorAfter = await page.evaluate(() => window.demo.scopes[0].sub.cursor.serverSequence);
  assert.ok(cursorAfter > cursorBefore, `the cursor advanced (${cursorBefore} → ${cursorAfter})`);
});
