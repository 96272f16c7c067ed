// The Studio notebook widget in a real JupyterLab, on a real 2-CPU-rank ipyparallel cluster started
// from the notebook: every tab before, during and after a run; nothing cut off; the empty states;
// Start disabled while a run goes; the summary strip's figures equal to the run's metrics.jsonl.
import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';
import type { Locator } from '@playwright/test';
import * as fs from 'fs';
import * as os from 'os';
import * as path from 'path';

const REPO = path.resolve(__dirname, '../../../..');
const ARTIFACTS = process.env.MWB_UI_ARTIFACTS || path.join(REPO, 'artifacts');
const TABS = ['Setup', 'Live', 'Compare', 'Profile'];
const LONG_RUN_STEPS = 100000; // never ends by itself: the test stops it once it has seen it running
const SHORT_RUN_STEPS = 6;

test.setTimeout(175000);
const T0 = Date.now();
const mark = (what: string) => console.log(`studio.spec: ${what} at ${((Date.now() - T0) / 1000).toFixed(1)} s`);
test.use({
  autoGoto: false, // openLab: Galata's own start-up wait is 15 s, which a loaded 2-core machine can exceed
  viewport: { width: 1280, height: 1000 },
  actionTimeout: 30000,
  waitForApplication: async ({ baseURL }, use) => {
    await use(async (page, helpers) => {
      await page.locator('#jupyterlab-splash').waitFor({ state: 'detached', timeout: 60000 });
      await helpers.waitForCondition(() => helpers.activity.isTabActive('Launcher'), 60000);
    });
  }
});

// Every visible label, button and tab title whose text does not fit its box.
async function clipped(root: Locator): Promise<string[]> {
  return root.evaluate((el: Element) => {
    const selector = 'label, button, .widget-label, .widget-label-basic, .widget-readout, .lm-TabBar-tabLabel, ' +
      '.widget-html-content, .mwb-fig, .widget-inline-hbox > .widget-label';
    const out: string[] = [];
    for (const node of Array.from(el.querySelectorAll(selector)) as HTMLElement[]) {
      const visible = node.offsetParent !== null && node.clientWidth > 0;
      if (visible && node.scrollWidth > node.clientWidth + 1) {
        out.push(`${node.className}: "${(node.textContent || '').trim().slice(0, 60)}" ` +
          `(${node.scrollWidth} > ${node.clientWidth})`);
      }
    }
    return out;
  });
}

async function openTab(studio: Locator, name: string): Promise<Locator> {
  await studio.locator('.lm-TabBar-tab', { hasText: name }).first().click();
  const panel = studio.locator('.widget-tab-contents > .widget-box:visible').first();
  await expect(panel).toBeVisible();
  return panel;
}

async function checkTab(page: IJupyterLabPageFixture, studio: Locator, name: string, when: string) {
  const panel = await openTab(studio, name);
  expect(await clipped(studio), `clipped labels or buttons in ${name} (${when})`).toEqual([]);
  await studio.screenshot({ path: path.join(ARTIFACTS, `studio-${name.toLowerCase()}-${when}.png`) });
  return panel;
}

function median(values: number[]): number {
  const s = [...values].sort((a, b) => a - b);
  const mid = Math.floor(s.length / 2);
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
}

// The strip's definition (workbench/ui/summary.py): per step the mean over ranks, then the median
// over the latest 10 complete steps, the first (warm-up) step left out.
function expectedFigures(runDir: string) {
  const records = fs.readFileSync(path.join(runDir, 'metrics.jsonl'), 'utf8').split('\n')
    .filter(line => line.trim()).map(line => JSON.parse(line));
  const ranks = new Set(records.map(r => r.rank));
  const byStep = new Map<number, any[]>();
  for (const r of records) byStep.set(r.step, [...(byStep.get(r.step) || []), r]);
  const steps = [...byStep.keys()].sort((a, b) => a - b);
  const complete = steps.filter(s => byStep.get(s)!.length === ranks.size);
  const steady = complete.length > 1 ? complete.slice(1) : complete;
  const window = steady.slice(-10);
  const mean = (s: number, key: string) => byStep.get(s)!.reduce((a, r) => a + r[key], 0) / byStep.get(s)!.length;
  const last = steps[steps.length - 1];
  const lastRank0 = byStep.get(last)!.find(r => r.rank === 0);
  return {
    step: last,
    tokens_per_s_per_gpu: median(window.map(s => mean(s, 'tokens_per_s_per_gpu'))),
    tflops_per_gpu: median(window.map(s => mean(s, 'tflops_per_gpu'))),
    loss: lastRank0.loss,
    mem_rank0: lastRank0.mem_peak_gib,
    mem_rank1: byStep.get(last)!.find(r => r.rank === 1).mem_peak_gib
  };
}

async function stripValue(studio: Locator, key: string): Promise<number> {
  const value = await studio.locator(`.mwb-strip .mwb-fig[data-key="${key}"]`).getAttribute('data-value');
  expect(value, `strip figure ${key}`).not.toBeNull();
  return parseFloat(value!);
}

async function expectStripMatches(studio: Locator, runDir: string) {
  const want = expectedFigures(runDir);
  expect(await stripValue(studio, 'step')).toBe(want.step);
  await expect(studio.locator('.mwb-fig[data-key="step"] .mwb-fig-value')).toHaveText(
    new RegExp(`^${want.step}/\\d+$`));
  for (const key of ['tokens_per_s_per_gpu', 'tflops_per_gpu', 'loss', 'mem_rank0', 'mem_rank1'] as const) {
    const got = await stripValue(studio, key);
    expect(Math.abs(got - want[key]), `${key}: strip ${got}, metrics.jsonl ${want[key]}`)
      .toBeLessThanOrEqual(1e-9 * Math.max(1, Math.abs(want[key])));
  }
  // What the strip prints is the same number, formatted.
  await expect(studio.locator('.mwb-fig[data-key="tokens_per_s_per_gpu"] .mwb-fig-value')).toHaveText(
    Math.round(want.tokens_per_s_per_gpu).toLocaleString('en-US'));
  await expect(studio.locator('.mwb-fig[data-key="loss"] .mwb-fig-value')).toHaveText(want.loss.toFixed(4));
  await expect(studio.locator('.mwb-fig[data-key="mfu_pct"] .mwb-fig-value')).toHaveText('n/a'); // CPU
}

function runDirs(runsDir: string): string[] {
  return fs.readdirSync(runsDir).map(d => path.join(runsDir, d)).filter(d => fs.existsSync(path.join(d, 'status.json')));
}

function runState(runDir: string): string {
  return JSON.parse(fs.readFileSync(path.join(runDir, 'status.json'), 'utf8')).state;
}

async function openLab(page: IJupyterLabPageFixture, tmpPath: string) {
  for (let attempt = 1; ; attempt++) {
    try {
      await page.goto(`tree/${tmpPath}`);
      return;
    } catch (err) {
      // The page keeps loading meanwhile; a second goto finds its assets cached.
      if (attempt === 3 || !String(err).includes('Timed out waiting for condition')) throw err;
      mark(`JupyterLab not started after 15 s (attempt ${attempt}), loading it again`);
    }
  }
}

test('studio tabs before, during and after a run on a 2-rank cluster', async ({ page, tmpPath }) => {
  fs.mkdirSync(ARTIFACTS, { recursive: true });
  await openLab(page, tmpPath);
  mark('lab ready');
  const runsDir = fs.mkdtempSync(path.join(os.tmpdir(), 'mwb-studio-runs-'));
  await page.notebook.createNew();
  const source = [
    'import workbench',
    'print("workbench from", workbench.__file__)',
    'from workbench.cluster import Cluster',
    'from workbench.ui import Studio',
    'cluster = Cluster(n=2, devices="cpu")',
    `studio = Studio(cluster, runs_dir=${JSON.stringify(runsDir)}, steps=${LONG_RUN_STEPS})`,
    'studio'
  ].join('\n');
  await page.notebook.setCell(0, 'code', source);
  await page.notebook.runCell(0);
  const output = page.locator('.jp-NotebookPanel:visible .jp-Cell').first().locator('.jp-OutputArea');
  // The kernel imports this checkout's workbench (PYTHONPATH or the editable install).
  await expect(output).toContainText(`workbench from ${path.join(REPO, 'workbench', '__init__.py')}`,
    { timeout: 60000 });
  const studio = output.locator('.widget-vbox').filter({ has: page.locator('.widget-tab') }).first();
  await expect(studio.locator('.widget-tab')).toBeVisible({ timeout: 60000 });
  const tab = studio.locator('.widget-tab').first();
  mark('studio shown');

  try {
    // -- before any run --------------------------------------------------------------------------
    const setup = await checkTab(page, tab, 'Setup', 'before');
    await expect(setup.locator('.mwb-unavailable summary')).toContainText('unavailable');
    await expect(setup.locator('.p-Accordion, .lm-Accordion, .widget-accordion').first()).toContainText('Benchmark');
    // A narrow notebook: the rows wrap, nothing is cut off.
    await page.setViewportSize({ width: 760, height: 1000 });
    await expect.poll(() => clipped(tab), { message: 'clipped in a narrow Setup tab' }).toEqual([]);
    await tab.screenshot({ path: path.join(ARTIFACTS, 'studio-setup-narrow.png') });
    await page.setViewportSize({ width: 1280, height: 1000 });
    const live = await checkTab(page, tab, 'Live', 'before');
    await expect(live.locator('.mwb-strip-empty')).toContainText('no run yet');
    const compare = await checkTab(page, tab, 'Compare', 'before');
    await expect(compare.locator('.mwb-empty')).toContainText('No runs in');
    await compare.locator('button', { hasText: 'Compare' }).click();
    await expect(compare.locator('.mwb-empty')).toContainText('No run selected');
    await expect(compare.locator('.js-plotly-plot')).toBeHidden();
    const profile = await checkTab(page, tab, 'Profile', 'before');
    await expect(profile.locator('.mwb-empty')).toContainText('No profile yet');
    await expect(profile.locator('button', { hasText: 'Profile' })).toBeEnabled();
    await expect(profile.locator('.js-plotly-plot')).toBeHidden();

    mark('before-run checks done');
    // -- during a run: started from the Setup tab, followed in the Live tab, then stopped ---------
    await (await openTab(tab, 'Setup')).locator('button', { hasText: 'Start' }).click();
    const liveNow = await openTab(tab, 'Live');
    await expect(liveNow.locator('.mwb-progress-text')).toContainText('running', { timeout: 60000 });
    await expect(liveNow.locator('.mwb-fig[data-key="tokens_per_s_per_gpu"]')).toHaveAttribute('data-value', /\d/,
      { timeout: 60000 });
    await expect(liveNow.locator('button', { hasText: 'Start' })).toBeDisabled();
    await expect(liveNow.locator('button', { hasText: 'Stop' })).toBeEnabled();
    expect(await clipped(tab), 'clipped labels or buttons in Live (during)').toEqual([]);
    const setupNow = await openTab(tab, 'Setup');
    await expect(setupNow.locator('button', { hasText: 'Start' })).toBeDisabled();
    expect(await clipped(tab), 'clipped labels or buttons in Setup (during)').toEqual([]);
    await expect((await openTab(tab, 'Profile')).locator('button', { hasText: 'Profile' })).toBeDisabled();
    await checkTab(page, tab, 'Live', 'during');
    await liveNow.locator('button', { hasText: 'Stop' }).click();
    await expect(liveNow.locator('.mwb-progress-text')).toContainText('stopped at step', { timeout: 60000 });
    mark('first run stopped');
    const [longRun] = runDirs(runsDir);
    expect(runState(longRun)).toBe('stopped');
    await expectStripMatches(tab, longRun);

    // -- a short run to its end: the strip against its metrics, then Compare both and Profile -----
    const setupAgain = await openTab(tab, 'Setup');
    await expect(setupAgain.locator('button', { hasText: 'Start' })).toBeEnabled();
    const steps = setupAgain.locator('.widget-inline-hbox', { hasText: 'steps' }).first().locator('input');
    await steps.fill(String(SHORT_RUN_STEPS));
    await steps.press('Enter');
    await setupAgain.locator('button', { hasText: 'Start' }).click();
    await openTab(tab, 'Live');
    await expect(liveNow.locator('.mwb-progress-text')).toContainText(`completed at step ${SHORT_RUN_STEPS}/`,
      { timeout: 90000 });
    mark('second run completed');
    const shortRun = runDirs(runsDir).find(d => d !== longRun)!;
    expect(runState(shortRun)).toBe('completed');
    await expectStripMatches(tab, shortRun);
    await checkTab(page, tab, 'Live', 'after');
    // The plots were drawn in a hidden tab; they fill the Live tab's width all the same.
    const plot = liveNow.locator('.js-plotly-plot').first();
    await expect.poll(async () => (await plot.boundingBox())!.width, { message: 'live plots fill the tab' })
      .toBeGreaterThan((await liveNow.boundingBox())!.width - 80);
    await checkTab(page, tab, 'Setup', 'after');

    const compareAfter = await openTab(tab, 'Compare');
    await compareAfter.locator('button', { hasText: 'Refresh' }).click();
    const options = compareAfter.locator('select option');
    await expect(options).toHaveCount(2);
    for (const text of await options.allInnerTexts()) {
      expect(text, 'the run list shows no Python dict text').not.toMatch(/[{}]/);
    }
    // Select both runs (the options' values are ipywidgets' indices, their text the run list's lines).
    await compareAfter.locator('select').selectOption(await options.evaluateAll(os => os.map(o => (o as HTMLOptionElement).value)));
    await compareAfter.locator('button', { hasText: 'Compare' }).click();
    await expect(compareAfter.locator('.js-plotly-plot')).toBeVisible();
    await expect(compareAfter.locator('.mwb-empty')).toBeHidden();
    // The figure follows the notebook's width (it was drawn in a hidden tab).
    await expect.poll(async () => (await compareAfter.locator('.js-plotly-plot').boundingBox())!.width)
      .toBeGreaterThan((await compareAfter.boundingBox())!.width - 80);
    // The runs differ only in their steps: the labels say that and nothing else.
    const legend = compareAfter.locator('.legend .legendtext');
    await expect(legend).toHaveCount(2);
    expect((await legend.allTextContents()).sort()).toEqual([`steps=${LONG_RUN_STEPS}`, `steps=${SHORT_RUN_STEPS}`]);
    await checkTab(page, tab, 'Compare', 'after');

    mark('compared');
    const profileAfter = await openTab(tab, 'Profile');
    await profileAfter.locator('button', { hasText: 'Profile' }).click();
    await expect(profileAfter.locator('.js-plotly-plot')).toBeVisible({ timeout: 90000 });
    await expect(profileAfter.locator('.mwb-empty')).toBeHidden();
    await expect(profileAfter).toContainText('profiled 3 steps on 2 ranks');
    await checkTab(page, tab, 'Profile', 'after');
    mark('profiled');
  } finally {
    // Stop the engines; a failure here must not hide the test's own.
    try {
      await page.notebook.addCell('code', 'cluster.stop()');
      await page.notebook.runCell((await page.notebook.getCellCount()) - 1);
    } catch (err) {
      mark(`cluster.stop() cell failed: ${err}`);
    }
  }
});
