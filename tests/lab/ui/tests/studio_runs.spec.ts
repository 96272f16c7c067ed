// The Studio's Live plots and Compare tab over two real finished runs (tests/lab/make_run.py: a named full
// run with eval, a named 20-step LoRA run), reopened with Run.from_dir: the two are told apart by name
// and kind in Live's header, Compare's list, legend and table; Live's top row of plots fills the
// figure's width; no subplot title runs into its neighbour; tick labels never repeat.
import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';
import type { Locator } from '@playwright/test';
import * as path from 'path';

const RUNS_DIR = process.env.WORKBENCH_RUNS_DIR || '';
const RUN_ID = process.env.MWB_UI_RUN_ID || '';
const LORA_RUN_ID = process.env.MWB_UI_LORA_RUN_ID || '';
const RUN_NAME = 'lab test · eval on';
const LORA_RUN_NAME = 'lab test · LoRA rank 8 on attention, a name long enough to need more than one line';
const ARTIFACTS = process.env.MWB_UI_ARTIFACTS || path.resolve(__dirname, '../../../../artifacts');

test.setTimeout(150000);
test.use({
  autoGoto: false,
  viewport: { width: 1280, height: 1000 },
  actionTimeout: 30000,
  waitForApplication: async ({ baseURL }, use) => {
    await use(async (page, helpers) => {
      await page.locator('#jupyterlab-splash').waitFor({ state: 'detached', timeout: 60000 });
      await helpers.waitForCondition(() => helpers.activity.isTabActive('Launcher'), 60000);
    });
  }
});

/** Pairs of a plotly figure's annotation texts (subplot titles and their subtitles) whose boxes overlap. */
async function overlappingTitles(figure: Locator): Promise<string[]> {
  return figure.evaluate((el: Element) => {
    const boxes = Array.from(el.querySelectorAll('.annotation-text'))
      .map(t => ({ text: (t.textContent || '').slice(0, 40), b: (t as SVGGraphicsElement).getBoundingClientRect() }))
      .filter(x => x.b.width > 0);
    const hits: string[] = [];
    boxes.forEach((p, i) =>
      boxes.slice(i + 1).forEach(q => {
        const apart = p.b.right + 4 <= q.b.left || q.b.right + 4 <= p.b.left || p.b.bottom <= q.b.top || q.b.bottom <= p.b.top;
        if (!apart) {
          hits.push(`${p.text} | ${q.text}`);
        }
      })
    );
    return hits;
  });
}

/** Per plotly axis: its tick labels as drawn, where any repeats. */
async function repeatedTicks(figure: Locator): Promise<string[]> {
  return figure.evaluate((el: Element) => {
    const out: string[] = [];
    for (const group of Array.from(el.querySelectorAll('g.xtick, g.ytick')).map(t => t.parentElement!)) {
      const labels = Array.from(group.querySelectorAll(':scope > g > text')).map(t => t.textContent || '');
      if (new Set(labels).size < labels.length) {
        out.push(`${group.getAttribute('class')}: ${labels.join(', ')}`);
      }
    }
    return [...new Set(out)];
  });
}

/** The top row's plot areas (the first `n` subplots' drag boxes): their span against the figure's width. */
async function topRowSpan(figure: Locator, n: number): Promise<{ span: number; width: number; left: number }> {
  return figure.evaluate((el: Element, count: number) => {
    const svg = el.querySelector('svg.main-svg')!.getBoundingClientRect();
    const boxes = Array.from(el.querySelectorAll('.draglayer .nsewdrag'))
      .map(r => r.getBoundingClientRect())
      .sort((a, b) => a.top - b.top || a.left - b.left);
    const top = boxes.filter(b => Math.abs(b.top - boxes[0].top) < 2).slice(0, count);
    const left = Math.min(...top.map(b => b.left));
    const right = Math.max(...top.map(b => b.right));
    return { span: right - left, width: svg.width, left: left - svg.left };
  }, n);
}

async function runCell(page: IJupyterLabPageFixture, index: number, source: string): Promise<Locator> {
  if (index > 0) {
    await page.notebook.addCell('code', source);
  } else {
    await page.notebook.setCell(0, 'code', source);
  }
  await page.notebook.runCell(index);
  return page.locator('.jp-NotebookPanel:visible .jp-Cell').nth(index).locator('.jp-OutputArea');
}

test('Live and Compare tell a named LoRA run from a named full run; the plots fill their width', async ({
  page,
  tmpPath
}) => {
  expect(RUNS_DIR && RUN_ID && LORA_RUN_ID, 'extensions/ci.sh sets the runs folder and both run ids').toBeTruthy();
  await page.goto(`tree/${tmpPath}`);
  await page.notebook.createNew();
  // No indented blocks: the cell editor indents typed lines by itself.
  const setup = [
    'import ipywidgets as W',
    'from workbench.cluster.run import Run',
    'from workbench.ui.plots import CompareRuns, LivePlots',
    'from workbench.ui.resize import FigureFit',
    `RUNS = ${JSON.stringify(RUNS_DIR)}`,
    `runs = [Run.from_dir(f"{RUNS}/{r}") for r in (${JSON.stringify(RUN_ID)}, ${JSON.stringify(LORA_RUN_ID)})]`,
    'lives = [LivePlots() for _ in runs]',
    '_ = [live.attach(run) for live, run in zip(lives, runs)]',
    'compare = CompareRuns(runs_dir=RUNS)',
    'fit = FigureFit()',
    '_ = [fit.fit(figure, margin_px=48) for figure in [live.figure for live in lives] + [compare.figure]]',
    'boxes = [W.VBox([live.widget]).add_class("mwb-test-live") for live in lives]',
    'W.VBox(boxes + [W.VBox([compare.widget]).add_class("mwb-test-compare"), fit], layout=W.Layout(width="100%"))'
  ].join('\n');
  const output = await runCell(page, 0, setup);
  const lives = output.locator('.mwb-test-live');
  await expect(lives).toHaveCount(2, { timeout: 90000 });
  const liveFigure = (i: number) => lives.nth(i).locator('.js-plotly-plot').first();
  await expect(liveFigure(1)).toBeVisible({ timeout: 90000 });
  const compareBox = output.locator('.mwb-test-compare');

  // Live: the header names the run and says its kind.
  const titles = lives.locator('.widget-html-content', { hasText: 'Live' });
  await expect(titles.nth(0)).toContainText(RUN_NAME);
  await expect(titles.nth(0)).toContainText(/full · rows\.jsonl/);
  await expect(titles.nth(1)).toContainText(LORA_RUN_NAME);
  await expect(titles.nth(1)).toContainText('LoRA r=8 attention');

  for (const [i, what] of [[0, 'full'], [1, 'LoRA']] as const) {
    const figure = liveFigure(i);
    // The top row (tokens/s, TFLOP/s, memory) spans the figure less its side margins.
    await expect.poll(async () => {
      const { span, width, left } = await topRowSpan(figure, 3);
      return span >= width - left - 40 ? '' : `top row spans ${span.toFixed(0)} of ${width.toFixed(0)} px (left ${left.toFixed(0)})`;
    }, { message: `Live (${what}): the top row fills the figure` }).toBe('');
    expect(await overlappingTitles(figure), `Live (${what}): titles run into each other`).toEqual([]);
    expect(await repeatedTicks(figure), `Live (${what}): repeated tick labels`).toEqual([]);
    await figure.screenshot({ path: path.join(ARTIFACTS, `studio-live-${what.toLowerCase()}.png`) });
    // The MoE health small multiples under it: five titles side by side, none running into the next.
    const health = lives.nth(i).locator('.js-plotly-plot').nth(1);
    expect(await overlappingTitles(health), `MoE health (${what}): titles run into each other`).toEqual([]);
    expect(await repeatedTicks(health), `MoE health (${what}): repeated tick labels`).toEqual([]);
  }

  // Compare: the list, then both runs plotted; the legend and the table name each run and its kind.
  const picker = compareBox.locator('select').first();
  const options = picker.locator('option');
  // The folder may hold other runs too (the quickstart's, an unnamed copy): the two named ones are listed apart.
  await expect.poll(() => options.count()).toBeGreaterThanOrEqual(2);
  // ipywidgets writes the options' spaces as no-break spaces.
  const listed = (await options.allInnerTexts()).map(t => t.replace(/\u00a0/g, ' '));
  const loraRow = listed.find(t => t.includes(LORA_RUN_NAME));
  const fullRow = listed.find(t => t.includes(`${RUN_NAME} (${RUN_ID})`));
  expect(loraRow, 'the LoRA run in the list').toContain('LoRA r=8 attention');
  expect(fullRow, 'the full run in the list').toContain('full ·');
  // each named run by its id, which the list shows after its name
  const values = await options.evaluateAll(
    (os, ids) => os.filter(o => ids.some(id => (o.textContent || '').includes(`(${id})`))).map(o => (o as HTMLOptionElement).value),
    [RUN_ID, LORA_RUN_ID]
  );
  expect(values, 'both named runs selectable').toHaveLength(2);
  await picker.selectOption(values);
  await compareBox.locator('button', { hasText: 'Compare' }).click();
  const compareFigure = compareBox.locator('.js-plotly-plot').first();
  const legend = compareFigure.locator('.legend .legendtext');
  await expect(legend).toHaveCount(2);
  const legendTexts = await legend.allTextContents();
  expect(legendTexts.some(t => t.startsWith('lab test · LoRA')), `legend ${legendTexts}`).toBe(true);
  expect(legendTexts.some(t => t.startsWith(RUN_NAME)), `legend ${legendTexts}`).toBe(true);
  const table = compareBox.locator('table').last();
  await expect(table).toContainText(LORA_RUN_NAME.slice(0, 30));
  await expect(table).toContainText(RUN_NAME);
  expect(await repeatedTicks(compareFigure), 'Compare: repeated tick labels').toEqual([]);
  await output.screenshot({ path: path.join(ARTIFACTS, 'studio-live-compare.png') });
});
