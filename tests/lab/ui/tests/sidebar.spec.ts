// The MoE Workbench sidebar in a real JupyterLab: it renders, lists the runs, opens their plots; a named
// full run and a named LoRA run are told apart (name and kind) in the sidebar and in their run views;
// the run view's charts fill its width, their tick labels never repeat, the step axis reaches the last step.
import { expect, test } from '@jupyterlab/galata';
import type { Locator, Page } from '@playwright/test';
import * as fs from 'fs';
import * as path from 'path';

const RUN_ID = process.env.MWB_UI_RUN_ID || '';
const LORA_RUN_ID = process.env.MWB_UI_LORA_RUN_ID || '';
// tests/lab/make_run.py names its runs (RunConfig.name): a full run with eval on (data.eval_every=1,
// 3 steps) and a LoRA run (rank 8 on attention, 20 steps) with a long name.
const RUN_NAME = 'lab test · eval on';
const LORA_RUN_NAME = 'lab test · LoRA rank 8 on attention, a name long enough to need more than one line';
const LORA_RUN_STEPS = 20;

/** Pairs of an SVG's title / legend texts closer than 4 px (touching reads as one run of text). */
async function overlappingTexts(chart: import('@playwright/test').Locator): Promise<string[]> {
  return chart.evaluate((svg: SVGSVGElement) => {
    const texts = [...svg.querySelectorAll('text.mwb-chart-title, text.mwb-legend')] as SVGTextElement[];
    const boxes = texts.map(t => ({ label: t.textContent ?? '', b: t.getBBox() }));
    const hits: string[] = [];
    boxes.forEach((p, i) =>
      boxes.slice(i + 1).forEach(q => {
        const gap = 4;
        const apart = p.b.x + p.b.width + gap <= q.b.x || q.b.x + q.b.width + gap <= p.b.x ||
          p.b.y + p.b.height <= q.b.y || q.b.y + q.b.height <= p.b.y;
        if (!apart) {
          hits.push(`${p.label} | ${q.label}`);
        }
      })
    );
    return hits;
  });
}
const ARTIFACTS = process.env.MWB_UI_ARTIFACTS || path.resolve(__dirname, '../../../../artifacts');

/** Each chart's tick labels, y and x, as drawn. */
async function tickTexts(chart: Locator): Promise<{ y: string[]; x: string[] }> {
  return {
    y: await chart.locator('text.mwb-tick-y').allTextContents(),
    x: await chart.locator('text.mwb-tick-x').allTextContents()
  };
}

/**
 * How the run view's charts sit in its plot area, measured in the page: the area's content width, and
 * per row of charts (same top) the span from the first chart's left edge to the last one's right edge.
 */
async function chartRows(view: Locator): Promise<{ area: number; rows: { count: number; span: number }[] }> {
  return view.locator('.mwb-runview-plots').evaluate((area: HTMLElement) => {
    const style = window.getComputedStyle(area);
    const inner = area.getBoundingClientRect();
    const left = inner.left + parseFloat(style.paddingLeft);
    const width = inner.width - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    const rows = new Map<number, { l: number; r: number; count: number }>();
    for (const chart of Array.from(area.querySelectorAll('svg.mwb-chart'))) {
      const b = chart.getBoundingClientRect();
      const top = Math.round(b.top);
      const row = rows.get(top) ?? { l: Infinity, r: -Infinity, count: 0 };
      rows.set(top, { l: Math.min(row.l, b.left - left), r: Math.max(row.r, b.right - left), count: row.count + 1 });
    }
    return { area: width, rows: [...rows.values()].map(r => ({ count: r.count, span: r.r - Math.min(0, r.l) })) };
  });
}

/** The full rows of charts span the plot area's width (within 2 px); none is wider than it. */
async function expectChartsFillWidth(view: Locator, what: string) {
  const { area, rows } = await chartRows(view);
  const columns = Math.max(...rows.map(r => r.count));
  for (const row of rows.filter(r => r.count === columns)) {
    expect(row.span, `${what}: a full row of ${columns} charts spans ${row.span} of ${area} px`).toBeGreaterThan(area - 2);
    expect(row.span, `${what}: charts wider than the view`).toBeLessThanOrEqual(area + 1);
  }
}

async function openRunView(page: Page, sidebar: Locator, runId: string): Promise<Locator> {
  await sidebar.locator(`.mwb-run[data-run-id="${runId}"]`).click();
  const view = page.locator(`#moe-workbench-run-${runId}`);
  await expect(view).toBeVisible();
  await expect(view.locator('svg.mwb-chart').first()).toBeVisible();
  return view;
}

// Galata's default start-up wait gives the lab 15 s; a busy 2-core CI machine can need more.
test.use({
  waitForApplication: async ({ baseURL }, use) => {
    await use(async (page, helpers) => {
      await page.locator('#jupyterlab-splash').waitFor({ state: 'detached', timeout: 60000 });
      await helpers.waitForCondition(() => helpers.activity.isTabActive('Launcher'), 60000);
      await helpers.activity.activateTab('Launcher');
    });
  }
});

test('sidebar lists the run and opens its plots', async ({ page }) => {
  expect(RUN_ID, 'extensions/ci.sh sets MWB_UI_RUN_ID to the run it wrote').not.toBe('');

  // The sidebar tab is in the left area; open it.
  await page.click('.jp-SideBar.jp-mod-left [data-id="moe-workbench-sidebar"]');
  const sidebar = page.locator('#moe-workbench-sidebar');
  await expect(sidebar).toBeVisible();
  await expect(sidebar.locator('.mwb-header-title')).toHaveText('MoE Workbench');

  // GPUs: on a CPU machine plain words, NVML's own error only in the detail line under them.
  const gpus = sidebar.locator('.mwb-gpus');
  await expect(gpus).toContainText(/No NVIDIA GPU on this machine|mem /);
  if (await gpus.locator('.mwb-gpu-none').count()) {
    await expect(gpus.locator('.mwb-gpu-none')).not.toContainText('NVML');
    await expect(gpus.locator('.mwb-gpu-detail')).toContainText('NVML');
  }
  await expect(sidebar.locator('.mwb-clusters')).not.toContainText('loading');

  // The run the CI script wrote, with its status and two sparklines that have lines in them.
  const run = sidebar.locator(`.mwb-run[data-run-id="${RUN_ID}"]`);
  await expect(run).toBeVisible();
  await expect(run.locator('.mwb-badge')).toHaveText('completed');
  // Named at launch: the name heads the row, the folder id under it; then model, mesh and tokens/s.
  await expect(run.locator('.mwb-run-name')).toHaveText(RUN_NAME);
  await expect(run.locator('.mwb-run-id')).toHaveText(RUN_ID);
  // The mesh as the product knows it: dp x ep only.
  await expect(run.locator('.mwb-run-info')).toContainText(/^tiny · dp2 × ep2 · step 3\/3 · \d+ tok\/s\/GPU$/);
  await expect(run.locator('.mwb-run-kind')).toContainText(/^full · rows\.jsonl · eval every 1 steps/);
  await expect(run.locator('.mwb-spark-tps polyline')).toHaveCount(1);
  await expect(run.locator('.mwb-spark-loss polyline')).toHaveCount(1);
  // A corrupt run directory beside it is listed as unreadable.
  await expect(sidebar.locator('.mwb-run-unreadable')).toContainText('unreadable');

  // The LoRA run beside it: its long name heads the row whole (wrapped, never one clipped line) and
  // whole in the tooltip; its kind line says LoRA, its rank and targets.
  const lora = sidebar.locator(`.mwb-run[data-run-id="${LORA_RUN_ID}"]`);
  await expect(lora.locator('.mwb-run-name')).toHaveText(LORA_RUN_NAME);
  expect(await lora.locator('.mwb-run-name').getAttribute('title')).toContain(LORA_RUN_NAME);
  await expect(lora.locator('.mwb-run-kind')).toContainText(/^LoRA r=8 attention · /);
  await expect(lora.locator('.mwb-run-info')).toContainText(`step ${LORA_RUN_STEPS}/${LORA_RUN_STEPS}`);
  const nameBox = await lora.locator('.mwb-run-name').evaluate((el: HTMLElement) => ({
    height: el.getBoundingClientRect().height,
    fontSize: parseFloat(window.getComputedStyle(el).fontSize)
  }));
  expect(nameBox.height, 'the long name wraps to a second line').toBeGreaterThan(1.8 * nameBox.fontSize);
  // The two rows differ in the words a reader sees first.
  expect(await lora.locator('.mwb-run-kind').innerText()).not.toEqual(await run.locator('.mwb-run-kind').innerText());
  // An unnamed run shows its folder id whole where the name goes (wrapped, not cut), with its kind line.
  const UNNAMED = process.env.MWB_UI_UNNAMED_RUN_ID || '';
  if (UNNAMED) {
    const unnamed = sidebar.locator(`.mwb-run[data-run-id="${UNNAMED}"]`);
    await expect(unnamed.locator('.mwb-run-name.mwb-run-unnamed')).toHaveText(UNNAMED);
    await expect(unnamed.locator('.mwb-run-kind')).toContainText(/^full · /);
    const box = await unnamed.locator('.mwb-run-name').evaluate((el: HTMLElement) => ({
      cut: el.scrollWidth > el.clientWidth + 1 || el.scrollHeight > el.clientHeight + 1
    }));
    expect(box.cut, 'the folder id is shown whole').toBe(false);
  }

  await page.screenshot({ path: path.join(ARTIFACTS, 'lab-sidebar.png') });

  // Clicking opens the run's plots in the main area.
  await run.click();
  const view = page.locator(`#moe-workbench-run-${RUN_ID}`);
  await expect(view).toBeVisible();
  await expect(view.locator('.mwb-runview-name .mwb-run-name')).toHaveText(RUN_NAME);
  await expect(view.locator('.mwb-runview-name .mwb-run-kind')).toContainText(/^full · /);
  await expect(view.locator('.mwb-runview-info')).toContainText('mesh: dp2 × ep2 ·');
  await expect(page.locator('.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current')).toContainText(`Run ${RUN_NAME}`);
  const loss = view.locator('svg.mwb-chart').first();
  await expect(loss.locator('.mwb-chart-title')).toHaveText('loss (rank 0)');
  // The training loss and, dashed, the eval loss of each of the 3 eval steps.
  await expect(loss.locator('polyline.mwb-series')).toHaveCount(2);
  await expect(loss.locator('polyline.mwb-series-dashed')).toHaveCount(1);
  const evalPoints = await loss.locator('polyline.mwb-series-dashed').getAttribute('points');
  expect(evalPoints?.trim().split(/\s+/)).toHaveLength(3);
  await expect(loss.locator('text.mwb-legend')).toHaveText(['train', 'eval']);
  const accuracy = view.locator('svg.mwb-chart').nth(1);
  await expect(accuracy.locator('.mwb-chart-title')).toHaveText('eval token accuracy (rank 0)');
  await expect(accuracy.locator('polyline.mwb-series-dashed')).toHaveCount(1);
  // tokens/s has one line per rank (the run has 2 ranks).
  const tokens = view.locator('svg.mwb-chart').nth(2);
  await expect(tokens.locator('.mwb-chart-title')).toHaveText('tokens/s per GPU');
  await expect(tokens.locator('polyline.mwb-series')).toHaveCount(2);
  // No chart's title and legend overlap (the step-time chart's four entries once ran into its title).
  const stepTime = view.locator('svg.mwb-chart').filter({ hasText: 'step time (s), rank 0' });
  await expect(stepTime.locator('text.mwb-legend')).toHaveCount(4);
  for (const chart of await view.locator('svg.mwb-chart').all()) {
    expect(await overlappingTexts(chart)).toEqual([]);
  }
  await stepTime.screenshot({ path: path.join(ARTIFACTS, 'lab-run-view-step-time.png') });
  // The MoE health charts: a line per MoE layer of the tiny model (2 layers), one chart per figure.
  const dead = view.locator('svg.mwb-chart').filter({ hasText: 'dead experts (share), rank 0' });
  await expect(dead.locator('text.mwb-legend')).toHaveText(['layer 0', 'layer 1']);
  await expect(dead.locator('polyline.mwb-series')).toHaveCount(2);
  await expect(view.locator('svg.mwb-chart').filter({ hasText: 'router entropy (/ ln E), rank 0' })).toHaveCount(1);
  await page.screenshot({ path: path.join(ARTIFACTS, 'lab-run-view.png') });
  await expectChartsFillWidth(view, 'full run');
});

test('a named LoRA run and a named full run are told apart; charts fill the width, ticks read apart', async ({
  page
}) => {
  expect(LORA_RUN_ID, 'extensions/ci.sh sets MWB_UI_LORA_RUN_ID to the LoRA run it wrote').not.toBe('');
  await page.click('.jp-SideBar.jp-mod-left [data-id="moe-workbench-sidebar"]');
  const sidebar = page.locator('#moe-workbench-sidebar');
  await expect(sidebar.locator(`.mwb-run[data-run-id="${LORA_RUN_ID}"]`)).toBeVisible();

  const full = await openRunView(page, sidebar, RUN_ID);
  const lora = await openRunView(page, sidebar, LORA_RUN_ID);
  // The run view's header and its tab: the name and the kind, the LoRA rank and targets in it.
  await expect(lora.locator('.mwb-runview-name .mwb-run-name')).toHaveText(LORA_RUN_NAME);
  await expect(lora.locator('.mwb-runview-name .mwb-run-kind')).toContainText(/^LoRA r=8 attention · /);
  await expect(page.locator('.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current')).toContainText('Run lab test · LoRA');
  const tabCaption = await page.locator('.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current').getAttribute('title');
  expect(tabCaption).toContain(LORA_RUN_NAME);

  // Every chart: distinct tick labels on both axes; the step axis runs from the first to the last step.
  const charts = await lora.locator('svg.mwb-chart').all();
  expect(charts.length).toBeGreaterThan(4);
  for (const chart of charts) {
    const title = await chart.locator('.mwb-chart-title').textContent();
    const { y, x } = await tickTexts(chart);
    expect(new Set(y).size, `${title}: y tick labels ${JSON.stringify(y)} repeat`).toBe(y.length);
    expect(new Set(x).size, `${title}: x tick labels ${JSON.stringify(x)} repeat`).toBe(x.length);
    expect(y.length, `${title}: y ticks`).toBeGreaterThanOrEqual(3);
    expect(x[0], `${title}: the step axis starts at the first step`).toBe('1');
    expect(x[x.length - 1], `${title}: the step axis reaches the last step`).toBe(String(LORA_RUN_STEPS));
  }
  await expectChartsFillWidth(lora, 'LoRA run, 1280 px');
  await page.screenshot({ path: path.join(ARTIFACTS, 'lab-run-view-lora.png') });
  // Narrower and wider windows: the charts are drawn again at the width they are shown at.
  for (const width of [900, 1700]) {
    await page.setViewportSize({ width, height: 900 });
    await expect.poll(async () => {
      const { area, rows } = await chartRows(lora);
      const columns = Math.max(...rows.map(r => r.count));
      const misfits = rows.filter(r => r.count === columns && !(r.span > area - 2 && r.span <= area + 1));
      return misfits.map(r => `${r.count} charts span ${r.span} of ${area} px`).join('; ');
    }, { message: `charts fill the view at ${width} px` }).toBe('');
  }
  await page.screenshot({ path: path.join(ARTIFACTS, 'lab-run-view-lora-wide.png') });
  // The full run's view, back in front: its header says full, not LoRA.
  await sidebar.locator(`.mwb-run[data-run-id="${RUN_ID}"]`).click();
  await expect(full.locator('.mwb-runview-name .mwb-run-kind')).toContainText(/^full · /);
  await expect(full.locator('.mwb-runview-name .mwb-run-kind')).not.toContainText('LoRA');
  await expectChartsFillWidth(full, 'full run, 1700 px');
});

test('launcher card opens a workbench notebook copied into the notebooks folder beside the runs', async ({
  page
}) => {
  const section = page.locator('.jp-Launcher-section').filter({ hasText: 'MoE Workbench' });
  await expect(section).toBeVisible();
  const cards = section.locator('.jp-LauncherCard');
  expect(await cards.count()).toBeGreaterThan(0);
  const labels = (await cards.locator('.jp-LauncherCard-label').allInnerTexts()).map(t => t.trim());
  expect(labels.filter(l => l.includes('`')), 'card labels show no markdown backticks').toEqual([]);
  const label = labels[0];
  await cards.first().click();
  // The notebook opens as a document in the main area, from the user's notebooks folder.
  const tab = page.locator('.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current');
  await expect(tab).toContainText('.ipynb');
  expect(label.length).toBeGreaterThan(0);
  await expect(page.locator('.jp-NotebookPanel:visible')).toHaveCount(1);
  const name = (await tab.innerText()).trim();
  const runsDir = process.env.WORKBENCH_RUNS_DIR || '';
  if (runsDir) {
    // extensions/ci.sh serves <root>/moe-workbench/runs: the copy is in <root>/moe-workbench/notebooks.
    const folder = path.join(path.dirname(runsDir), 'notebooks');
    expect(fs.existsSync(path.join(folder, name)), `${name} copied into ${folder}`).toBe(true);
    expect(fs.existsSync(path.join(path.dirname(path.dirname(runsDir)), name)), 'nothing copied into the root').toBe(false);
    const opened = await page.evaluate(() => (window as any).jupyterapp.shell.currentWidget?.context?.path);
    expect(opened).toBe(`moe-workbench/notebooks/${name}`);
  }
});
