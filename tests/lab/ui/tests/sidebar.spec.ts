// The MoE Workbench sidebar in a real JupyterLab: it renders, lists the run, opens its plots.
import { expect, test } from '@jupyterlab/galata';
import * as path from 'path';

const RUN_ID = process.env.MWB_UI_RUN_ID || '';
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

  // GPUs: on a CPU machine the server's reason is shown, not an empty box.
  await expect(sidebar.locator('.mwb-gpus')).toContainText(/No GPUs: |mem /);
  await expect(sidebar.locator('.mwb-clusters')).not.toContainText('loading');

  // The run the CI script wrote, with its status and two sparklines that have lines in them.
  const run = sidebar.locator(`.mwb-run[data-run-id="${RUN_ID}"]`);
  await expect(run).toBeVisible();
  await expect(run.locator('.mwb-badge')).toHaveText('completed');
  await expect(run.locator('.mwb-run-info')).toContainText('tiny');
  await expect(run.locator('.mwb-spark-tps polyline')).toHaveCount(1);
  await expect(run.locator('.mwb-spark-loss polyline')).toHaveCount(1);
  // A corrupt run directory beside it is listed as unreadable.
  await expect(sidebar.locator('.mwb-run-unreadable')).toContainText('unreadable');

  await page.screenshot({ path: path.join(ARTIFACTS, 'lab-sidebar.png') });

  // Clicking opens the run's plots in the main area.
  await run.click();
  const view = page.locator(`#moe-workbench-run-${RUN_ID}`);
  await expect(view).toBeVisible();
  const loss = view.locator('svg.mwb-chart').first();
  await expect(loss.locator('.mwb-chart-title')).toHaveText('loss (rank 0)');
  await expect(loss.locator('polyline.mwb-series')).toHaveCount(1);
  // tokens/s has one line per rank (the run has 2 ranks).
  await expect(view.locator('svg.mwb-chart').nth(1).locator('polyline.mwb-series')).toHaveCount(2);
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
