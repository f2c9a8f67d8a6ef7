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
    // Tentative tokens are put in the view while the answer streams. A mutation observer records
    // every text the tentative tail is given: sampling the page would miss them where the browser
    // reads the whole stream in one go (a loaded machine, a fast loopback answer).
    await page.evaluate(() => {
      window.__tentative = [];
      new MutationObserver((records) => {
        for (const r of records) {
          const el = r.target.nodeType === Node.TEXT_NODE ? r.target.parentElement : r.target;
          if (!el || !el.classList || !el.classList.contains("tent")) continue;
          for (const n of r.addedNodes) if (n.data) window.__tentative.push(n.data);
          if (r.type === "characterData" && r.target.data) window.__tentative.push(r.target.data);
        }
      }).observe(document.getElementById("answer"), {
        subtree: true,
        childList: true,
        characterData: true,
      });
    });
    await page.click("#send");
    const t0 = Date.now();
    while (Date.now() - t0 < 120000) {
      if (await page.evaluate(() => document.body.dataset.done)) break;
      await page.waitForTimeout(20);
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
    out.tentative_shown = await page.evaluate(() => window.__tentative.length);
    out.saw_tentative = out.tentative_shown > 0;
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
