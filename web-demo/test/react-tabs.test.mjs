// A React app (web-demo/test/react-app) in three tabs of headless Chromium against a real
// `highwater demo`: its row types come from `highwater typegen` run on the demo's database and
// the app is type-checked against them with `tsc --strict`, bundled with esbuild, and served as
// the demo's page. The tabs share one socket; a change re-renders only the row it changed; the
// app survives closing the tab that leads.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { copyFileSync, mkdirSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { build } from "esbuild";
import { Demo, highwaterBinary, launchBrowser, repo, resultsDir, until } from "./support.mjs";

const WAIT = 20_000;
const app = join(resultsDir, "react-app");
const source = join(repo, "web-demo", "test", "react-app");

let demo;
let browser;
let context;
let pages = [];

const state = (page) => page.evaluate(() => window.app);
/** The titles of the todos of ada's projects, as Postgres has them. */
const pgTitles = () =>
  JSON.parse(
    demo
      .sql("SELECT coalesce(json_agg(title ORDER BY id), '[]') FROM todos WHERE project_id IN (SELECT project_id FROM members WHERE user_id = 'ada')")
      .trim(),
  );
async function allShowPostgres(what) {
  await until(what, async () => {
    const want = JSON.stringify(pgTitles());
    for (const page of pages) if (JSON.stringify((await state(page))?.titles) !== want) return false;
    return true;
  }, WAIT);
}

describe("a React app in three tabs", { timeout: 240_000 }, () => {
  before(async () => {
    rmSync(app, { recursive: true, force: true });
    mkdirSync(app, { recursive: true });
    demo = await Demo.start({ webDir: app });
    // Typed rows: the demo database's types, then the app checked against them.
    execFileSync(highwaterBinary(), ["typegen", "--upstream", demo.upstream, "--out", join(app, "schema.ts")]);
    copyFileSync(join(source, "app.tsx"), join(app, "app.tsx"));
    copyFileSync(join(source, "index.html"), join(app, "index.html"));
    writeFileSync(
      join(app, "tsconfig.json"),
      JSON.stringify({
        compilerOptions: {
          target: "ES2022",
          module: "ESNext",
          moduleResolution: "Bundler",
          jsx: "react-jsx",
          strict: true,
          noEmit: true,
          lib: ["ES2022", "DOM"],
          types: [],
        },
        files: ["app.tsx"],
      }),
    );
    try {
      execFileSync(join(repo, "node_modules", ".bin", "tsc"), ["-p", join(app, "tsconfig.json")], { encoding: "utf8" });
    } catch (error) {
      throw new Error(`the app does not type-check against the generated types:\n${error.stdout}`);
    }
    await build({
      entryPoints: [join(app, "app.tsx")],
      outfile: join(app, "app.js"),
      bundle: true,
      format: "esm",
      platform: "browser",
      target: "es2022",
      jsx: "automatic",
      define: { "process.env.NODE_ENV": '"production"' },
      logLevel: "error",
    });
    browser = await launchBrowser();
    context = await browser.newContext();
    for (let i = 0; i < 3; i++) {
      const page = await context.newPage();
      page.on("pageerror", (error) => console.log(`# page error: ${error.message}`));
      await page.goto(`${demo.url}?user=ada`);
      await page.waitForSelector('main[data-ready="true"]', { timeout: WAIT });
      pages.push(page);
    }
  });

  after(async () => {
    await browser?.close();
    await demo?.stop();
  });

  test("every tab shows the typed rows live over one socket, and re-renders only the changed row", async () => {
    const tabs = await Promise.all(pages.map(async (page) => (await state(page)).tabs));
    assert.deepEqual([...tabs].sort(), ["follower", "follower", "leader"]);
    await until("one /sync socket", async () => (await demo.syncSockets()) === 1, WAIT);
    await allShowPostgres("Postgres' rows in every tab");
    const before = await Promise.all(pages.map((page) => page.evaluate(() => ({ ...window.renders }))));
    const [{ id }] = JSON.parse(
      demo.sql("SELECT coalesce(json_agg(json_build_object('id', id)), '[]') FROM (SELECT id FROM todos WHERE project_id = 1 ORDER BY id LIMIT 1) t").trim(),
    );
    demo.sql(`UPDATE todos SET title = 'Renamed in Postgres' WHERE id = ${id};`);
    await allShowPostgres("the rename in every tab");
    for (const [i, page] of pages.entries()) {
      const renders = await page.evaluate(() => ({ ...window.renders }));
      const again = Object.keys(renders).filter((key) => renders[key] !== before[i][key]);
      assert.deepEqual(again, [String(id)], "only the renamed row rendered again");
    }
  });

  test("closing the leader's tab leaves the others live", async () => {
    const tabs = await Promise.all(pages.map(async (page) => (await state(page)).tabs));
    const leader = pages[tabs.indexOf("leader")];
    await leader.close();
    pages = pages.filter((page) => page !== leader);
    await until("another tab to lead", async () => (await Promise.all(pages.map(state))).some((s) => s.tabs === "leader"), 5_000);
    demo.sql("INSERT INTO todos (project_id, title) VALUES (1, 'After the leader closed');");
    await allShowPostgres("the new row in the remaining tabs");
    await until("one /sync socket again", async () => (await demo.syncSockets()) === 1, WAIT);
  });

  test("closing a follower's tab leaves the leader serving the rest", async () => {
    const tabs = await Promise.all(pages.map(async (page) => (await state(page)).tabs));
    const follower = pages[tabs.indexOf("follower")];
    await follower.close();
    pages = pages.filter((page) => page !== follower);
    assert.equal((await state(pages[0])).tabs, "leader");
    demo.sql("INSERT INTO todos (project_id, title) VALUES (2, 'After a follower closed');");
    await allShowPostgres("the new row in the last tab");
    assert.equal(await demo.syncSockets(), 1);
  });
});
