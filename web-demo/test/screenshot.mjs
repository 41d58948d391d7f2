#!/usr/bin/env node
// Makes web-demo/screenshot.png (the README's picture): a private demo writing on its own, ada's
// and grace's lists side by side, a few writes from the page, grace switched into ada's Docs
// project, and a backfilled column. Run after scripts/build-wasm:
//   HIGHWATER_BIN=target/debug/highwater node web-demo/test/screenshot.mjs [OUT.png]
import { join } from "node:path";
import { Demo, launchBrowser, repo, until } from "./support.mjs";

const out = process.argv[2] ?? join(repo, "web-demo", "screenshot.png");
const demo = await Demo.start({ writesPerSecond: 2 });
const browser = await launchBrowser();
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 1400 } });
  await page.goto(`${demo.url}?user=ada&with=grace`);
  await page.waitForSelector('[data-scope="with"][data-origin="live"]', { timeout: 20_000 });
  for (const [title, project] of [["Ship the offline mode", "1"], ["Write the release notes", "2"]]) {
    await page.selectOption('[data-scope="all"] .add select', project);
    await page.fill('[data-scope="all"] .add input', title);
    await page.press('[data-scope="all"] .add input', "Enter");
    await until(`"${title}" on the page`, async () => (await page.textContent('[data-scope="all"] .rows')).includes(title));
  }
  const done = await page.getAttribute('[data-scope="all"] .rows li:nth-child(3)', "data-id");
  await page.click(`[data-scope="all"] li[data-id="${done}"] input[type="checkbox"]`);
  await page.waitForSelector(`[data-scope="all"] li.done[data-id="${done}"]`, { timeout: 20_000 });
  // grace joins Docs: its todos move into her list.
  await page.click('[data-scope="with"] .project[data-project="2"] button');
  await page.waitForSelector('[data-scope="with"] .project[data-project="2"][data-member="true"][data-state="idle"]', { timeout: 20_000 });
  await page.click("#add-column");
  await page.waitForSelector('#backfill[data-complete="true"]', { timeout: 20_000 });
  await page.waitForTimeout(2500);
  await page.screenshot({ path: out });
  console.log(out);
} finally {
  await browser.close();
  await demo.stop();
}
