#!/usr/bin/env node
// Makes web-demo/screenshot.png (the README's picture): a private demo writing on its own, two
// scopes, a few writes from the page and a backfilled column. Run after scripts/build-wasm:
//   HIGHWATER_BIN=target/debug/highwater node web-demo/test/screenshot.mjs
import { join } from "node:path";
import { Demo, launchBrowser, repo, until } from "./support.mjs";

const demo = await Demo.start({ writesPerSecond: 2 });
const browser = await launchBrowser();
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 1400 } });
  await page.goto(`${demo.url}?user=ada&second=1`);
  await page.waitForSelector('[data-scope="open"][data-origin="live"]', { timeout: 20_000 });
  for (const title of ["Ship the offline mode", "Write the release notes"]) {
    await page.fill('[data-scope="all"] .add input', title);
    await page.press('[data-scope="all"] .add input', "Enter");
    await until(`"${title}" on the page`, async () => (await page.textContent('[data-scope="all"] .rows')).includes(title));
  }
  const done = await page.getAttribute('[data-scope="all"] .rows li:nth-child(3)', "data-id");
  await page.click(`[data-scope="all"] li[data-id="${done}"] input[type="checkbox"]`);
  await page.waitForSelector(`[data-scope="all"] li.done[data-id="${done}"]`, { timeout: 20_000 });
  await page.click("#add-column");
  await page.waitForSelector('#backfill[data-complete="true"]', { timeout: 20_000 });
  await page.waitForTimeout(2500);
  const path = join(repo, "web-demo", "screenshot.png");
  await page.screenshot({ path });
  console.log(path);
} finally {
  await browser.close();
  await demo.stop();
}
