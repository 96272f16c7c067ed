// The quickstart notebook as a user runs it in a real JupyterLab: Run All (a 2-CPU-rank cluster, the Studio, a short
// run from code), then the Studio's Profile button on the cluster the notebook left running.
import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';
import * as path from 'path';

const REPO = path.resolve(__dirname, '../../../..');
const ARTIFACTS = process.env.MWB_UI_ARTIFACTS || path.join(REPO, 'artifacts');
const NOTEBOOK = '01_quickstart.ipynb';

test.setTimeout(300000);
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

async function openLab(page: IJupyterLabPageFixture, tmpPath: string) {
  for (let attempt = 1; ; attempt++) {
    try {
      await page.goto(`tree/${tmpPath}`);
      return;
    } catch (err) {
      // The page keeps loading meanwhile; a second goto finds its assets cached.
      if (attempt === 3 || !String(err).includes('Timed out waiting for condition')) throw err;
    }
  }
}

test('after the quickstart\'s cells the Studio profiles on its cluster', async ({ page, tmpPath }) => {
  await openLab(page, tmpPath);
  await page.contents.uploadFile(path.join(REPO, 'notebooks', NOTEBOOK), `${tmpPath}/${NOTEBOOK}`);
  await page.notebook.openByPath(`${tmpPath}/${NOTEBOOK}`);
  await page.notebook.activate(NOTEBOOK);
  const panel = page.locator('.jp-NotebookPanel:visible');

  // Run All, then wait for every cell to have run: the cluster's start and the run take a minute or two here.
  await page.evaluate(() => (window as any).galata.resetExecutionCount());
  await page.menu.clickMenuItem('Run>Run All Cells');
  await expect
    .poll(() => page.evaluate(() => (window as any).galata.haveBeenExecuted()), {
      timeout: 240000,
      message: 'every cell of the quickstart ran (a cell that raised stops Run All)'
    })
    .toBe(true);
  await expect(panel.locator('.jp-OutputArea', { hasText: 'Traceback' })).toHaveCount(0);
  await expect(panel.locator('.jp-OutputArea', { hasText: /ok: \d+ \(rank, step\) records/ })).toHaveCount(1);

  // The Studio the notebook displayed: its Profile tab profiles on the cluster the notebook left up.
  const studio = panel.locator('.widget-tab').first();
  await studio.locator('.lm-TabBar-tab', { hasText: 'Profile' }).first().click();
  const profile = studio.locator('.widget-tab-contents > .widget-box:visible').first();
  await expect(profile.locator('.mwb-empty')).toContainText('No profile yet');
  await profile.locator('button', { hasText: 'Profile' }).click();
  await expect(profile.locator('.js-plotly-plot')).toBeVisible({ timeout: 120000 });
  await expect(profile).toContainText(/profiled \d+ steps on 2 ranks/);
  await expect(profile).not.toContainText('not running');
  await studio.screenshot({ path: path.join(ARTIFACTS, 'quickstart-studio-profile.png') });
});
