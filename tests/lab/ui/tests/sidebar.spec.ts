// The MoE Workbench sidebar in a real JupyterLab: it renders, lists the run, opens its plots.
import { expect, test } from '@jupyterlab/galata';
import * as path from 'path';

const RUN_ID = process.env.MWB_UI_RUN_ID || '';
// tests/lab/make_run.py names its run (RunConfig.name) and turns eval on (data.eval_every=1, 3 steps).
const RUN_NAME = 'lab test · eval on';

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
  await expect(run.locator('.mwb-run-info')).toContainText(/^tiny · dp2·ep2·cp1·tp1 · step 3\/3 · \d+ tok\/s\/GPU$/);
  await expect(run.locator('.mwb-spark-tps polyline')).toHaveCount(1);
  await expect(run.locator('.mwb-spark-loss polyline')).toHaveCount(1);
  // A corrupt run directory beside it is listed as unreadable.
  await expect(sidebar.locator('.mwb-run-unreadable')).toContainText('unreadable');

  await page.screenshot({ path: path.join(ARTIFACTS, 'lab-sidebar.png') });

  // Clicking opens the run's plots in the main area.
  await run.click();
  const view = page.locator(`#moe-workbench-run-${RUN_ID}`);
  await expect(view).toBeVisible();
  await expect(view.locator('.mwb-runview-name')).toHaveText(RUN_NAME);
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
  await page.screenshot({ path: path.join(ARTIFACTS, 'lab-run-view.png') });
});

test('launcher card opens a workbench notebook copied into the root folder', async ({ page }) => {
  const section = page.locator('.jp-Launcher-section').filter({ hasText: 'MoE Workbench' });
  await expect(section).toBeVisible();
  const cards = section.locator('.jp-LauncherCard');
  expect(await cards.count()).toBeGreaterThan(0);
  const label = (await cards.first().locator('.jp-LauncherCard-label').innerText()).trim();
  await cards.first().click();
  // The notebook opens as a document in the main area (its file was copied in by the server).
  const tab = page.locator('.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current');
  await expect(tab).toContainText('.ipynb');
  expect(label.length).toBeGreaterThan(0);
  await expect(page.locator('.jp-NotebookPanel:visible')).toHaveCount(1);
});
