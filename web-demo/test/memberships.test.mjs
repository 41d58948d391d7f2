// Project memberships in the web demo: ada's and grace's lists side by side (two clients, two
// sockets); grace switched into ada's Docs project gets its todos live, and loses them when
// switched out. A todo of a project grace is not in never reaches her page, not even for a moment.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import { Demo, launchBrowser, until } from "./support.mjs";

const WAIT = 20_000;
/** How soon a membership switched on the page must have moved the project's rows. */
const LIVE_MS = 1_000;
/** The seed: ada is in Launch (1) and Docs (2), grace in Launch and Hiring (3), linus in Infra (4). */
const LAUNCH = 1;
const DOCS = 2;
const HIRING = 3;
const INFRA = 4;

let demo;
let browser;
let page;

/** The rows the page holds in a scope ("all": ada's, "with": grace's). */
const rows = (key) =>
  page.evaluate((key) => window.demo.scopes.find((s) => s.key === key).sub.rows().map((r) => ({ ...r })), key);
const ids = (held) => held.map((r) => Number(r.id)).sort((a, b) => a - b);
const projectsOf = (held) => new Set(held.map((r) => Number(r.project_id)));
/** Ids of the todos of these projects in Postgres. */
const pgIds = (...projects) =>
  demo.sql(`SELECT id FROM todos WHERE project_id IN (${projects.join(", ")}) ORDER BY id;`).split("\n").filter(Boolean).map(Number);
const graceSwitch = (project) => `[data-scope="with"] .project[data-project="${project}"]`;

/** Watches grace's rows on every change from now on: a row of a project in `window.notGrace`
 * is recorded, however briefly it was there. */
async function watchGrace(projects) {
  await page.evaluate((projects) => {
    window.notGrace = projects;
    if (window.leaks) return;
    window.leaks = [];
    const sub = window.demo.scopes.find((s) => s.key === "with").sub;
    sub.on("change", () => {
      for (const row of sub.rows()) {
        if (window.notGrace.includes(Number(row.project_id))) window.leaks.push({ ...row });
      }
    });
  }, projects);
}

/** Clicks grace's switch of `project` and waits until her rows are those of `projects`; the ms
 * from the click until then. */
async function switchGrace(project, projects, what) {
  const want = pgIds(...projects);
  const started = Date.now();
  await page.click(`${graceSwitch(project)} button`);
  await until(what, async () => JSON.stringify(ids(await rows("with"))) === JSON.stringify(want), WAIT, 20);
  return Date.now() - started;
}

describe("project memberships switched in the page", { timeout: 180_000 }, () => {
  before(async () => {
    demo = await Demo.start();
    browser = await launchBrowser();
    const context = await browser.newContext({ viewport: { width: 1280, height: 1000 } });
    page = await context.newPage();
    page.on("pageerror", (error) => console.log(`# page error: ${error.message}`));
    await page.goto(`${demo.url}?user=ada&with=grace`);
    await page.waitForSelector('html[data-wasm="ready"]', { timeout: WAIT });
    await page.waitForSelector('[data-scope="all"][data-origin="live"]', { timeout: WAIT });
    await page.waitForSelector('[data-scope="with"][data-origin="live"]', { timeout: WAIT });
  });

  after(async () => {
    await browser?.close();
    await demo?.stop();
  });

  test("two panels, each with its own user's projects", async () => {
    await watchGrace([DOCS, INFRA]);
    const want = pgIds(LAUNCH, HIRING);
    await until("grace's Launch and Hiring todos", async () => JSON.stringify(ids(await rows("with"))) === JSON.stringify(want), WAIT);
    await until("ada's Launch and Docs todos", async () =>
      JSON.stringify(ids(await rows("all"))) === JSON.stringify(pgIds(LAUNCH, DOCS)), WAIT);
    assert.equal(await page.getAttribute(graceSwitch(DOCS), "data-member"), "false");
    assert.equal(await page.getAttribute(graceSwitch(HIRING), "data-member"), "true");
    assert.equal(await page.evaluate(() => window.demo.panels.map((p) => p.user).join()), "ada,grace");
  });

  test("grace switched into Docs: its todos appear in her list within a second", async () => {
    await watchGrace([INFRA]);
    const ms = await switchGrace(DOCS, [LAUNCH, DOCS, HIRING], "Docs' todos in grace's list");
    console.log(`# grace's list had Docs' todos ${ms} ms after the click`);
    assert.ok(ms <= LIVE_MS, `Docs' todos took ${ms} ms to reach grace's list`);
    assert.deepEqual([...projectsOf(await rows("with"))].sort(), [LAUNCH, DOCS, HIRING]);
    assert.equal(demo.sql("SELECT count(*) FROM members WHERE project_id = 2 AND user_id = 'grace';"), "1");
    // Both see who shares Docs now; the page logs the switch with its time.
    await page.waitForSelector(`${graceSwitch(DOCS)}[data-member="true"][data-state="idle"]`, { timeout: WAIT });
    await until("grace's Docs switch naming ada", async () => (await page.textContent(`${graceSwitch(DOCS)} .people`)) === "with ada", WAIT);
    await until("ada's Docs switch naming grace", async () =>
      (await page.textContent(`[data-scope="all"] .project[data-project="${DOCS}"] .people`)) === "with grace", WAIT);
    await until("the switch logged", async () => /grace joined Docs\d+ ms/.test(await page.textContent("#log")), WAIT);
  });

  test("a todo ada adds to the project they share appears in grace's list", async () => {
    for (const project of [DOCS, LAUNCH]) {
      const title = `Shared by ada in project ${project} ${Date.now()}`;
      await page.selectOption('[data-scope="all"] .add select', String(project));
      await page.fill('[data-scope="all"] .add input', title);
      await page.press('[data-scope="all"] .add input', "Enter");
      const row = await until(`"${title}" in grace's list`, async () => (await rows("with")).find((r) => r.title === title), WAIT);
      assert.equal(Number(row.project_id), project);
      await until(`"${title}" confirmed`, () => page.evaluate(() => window.demo.client.pendingCount === 0), WAIT);
      assert.equal(demo.sql(`SELECT project_id FROM todos WHERE title = '${title}';`), String(project));
    }
  });

  test("grace switched out of Docs: its todos leave her list within a second, and later ones never come", async () => {
    const ms = await switchGrace(DOCS, [LAUNCH, HIRING], "Docs' todos gone from grace's list");
    console.log(`# Docs' todos left grace's list ${ms} ms after the click`);
    assert.ok(ms <= LIVE_MS, `Docs' todos took ${ms} ms to leave grace's list`);
    await watchGrace([DOCS, INFRA]);
    assert.equal(demo.sql("SELECT count(*) FROM members WHERE project_id = 2 AND user_id = 'grace';"), "0");
    // ada keeps them.
    assert.ok(projectsOf(await rows("all")).has(DOCS), "ada still sees Docs");

    // New todos of Docs and Infra: ada gets the Docs one; grace neither, not even for a moment.
    const stamp = Date.now();
    demo.sql(`INSERT INTO todos (project_id, title) VALUES (${DOCS}, 'Docs after grace left ${stamp}');
              INSERT INTO todos (project_id, title) VALUES (${INFRA}, 'Infra ${stamp}');
              INSERT INTO todos (project_id, title) VALUES (${HIRING}, 'Hiring ${stamp}');`);
    await until("the Docs todo in ada's list", async () => (await rows("all")).some((r) => r.title === `Docs after grace left ${stamp}`), WAIT);
    // The Hiring one, committed last, reaching grace shows the others had their chance.
    await until("the Hiring todo in grace's list", async () => (await rows("with")).some((r) => r.title === `Hiring ${stamp}`), WAIT);
    const held = await rows("with");
    assert.deepEqual(ids(held), pgIds(LAUNCH, HIRING), "grace holds the todos of Launch and Hiring, no other");
    assert.deepEqual(await page.evaluate(() => window.leaks), [], "a todo of a project grace is not in reached her page");
    assert.equal(await page.$$eval('[data-scope="with"] .rows li', (els) => els.filter((e) => ![1, 3].includes(Number(e.dataset.project))).length), 0);
  });
});
