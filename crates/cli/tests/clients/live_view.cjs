// The live view in a real headless Chromium (Debian's, driven by playwright-core): open the page,
// type a prompt, send it, wait for the answer, save a screenshot. Prints one JSON object: the
// committed text, the corrections shown, the α and ITL shown, and what the status line said.
//
// usage: node live_view.cjs URL PROMPT MAX_TOKENS SCREENSHOT USER_DATA_DIR
const { chromium } = require("playwright-core");

(async () => {
  const [url, prompt, maxTokens, screenshot, userDataDir] = process.argv.slice(2);
  const context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: "/usr/bin/chromium",
    headless: true,
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-background-networking",
      "--no-first-run",
    ],
    viewport: { width: 960, height: 720 },
  });
  try {
    const page = context.pages()[0] || (await context.newPage());
    const errors = [];
    page.on("pageerror", (e) => errors.push(String(e)));
    await page.goto(url);
    await page.fill("#prompt", prompt);
    await page.fill("#max_tokens", String(maxTokens));
    await page.click("#send");
    // Tentative tokens show while the answer streams.
    let sawTentative = false;
    const t0 = Date.now();
    while (Date.now() - t0 < 120000) {
      const state = await page.evaluate(() => ({
        done: document.body.dataset.done,
        tent: document.querySelector("#answer .tent").textContent,
      }));
      if (state.tent.length > 0) sawTentative = true;
      if (state.done) break;
      await page.waitForTimeout(5);
    }
    const out = await page.evaluate(() => ({
      done: document.body.dataset.done || null,
      text: [...document.querySelectorAll("#answer .ok")].map((e) => e.textContent).join(""),
      rejected: [...document.querySelectorAll("#answer del.rejected")].map((e) => e.textContent),
      fixes: [...document.querySelectorAll("#answer .fix")].map((e) => e.textContent),
      unverified: document.querySelectorAll("#answer .unverified").length,
      alpha: document.getElementById("alpha").textContent,
      itl: document.getElementById("itl").textContent,
      tokens: document.getElementById("tokens").textContent,
      status: document.getElementById("status").textContent,
    }));
    out.saw_tentative = sawTentative;
    out.page_errors = errors;
    await page.screenshot({ path: screenshot, fullPage: true });
    console.log(JSON.stringify(out));
  } finally {
    await context.close();
  }
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
