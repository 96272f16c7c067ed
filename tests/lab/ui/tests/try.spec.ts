// The Studio's Try tab in a real JupyterLab: a tiny run trained in the notebook's kernel (a step-3 checkpoint, no
// export), the tab picks it, Send streams its greedy reply, which equals workbench.generate's in the same kernel.
import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';
import type { Locator } from '@playwright/test';
import * as fs from 'fs';
import * as os from 'os';
import * as path from 'path';

const REPO = path.resolve(__dirname, '../../../..');
const ARTIFACTS = process.env.MWB_UI_ARTIFACTS || path.join(REPO, 'artifacts');
const PROMPT = 'What does a router do?';
const NEW_TOKENS = 12;

test.setTimeout(175000);
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

// Every visible label, button and tab title whose text does not fit its box (as studio.spec.ts checks).
async function clipped(root: Locator): Promise<string[]> {
  return root.evaluate((el: Element) => {
    const selector = 'label, button, .widget-label, .widget-label-basic, .lm-TabBar-tabLabel, .widget-html-content';
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

// The text input of the labelled ipywidgets number box inside `root`.
function numberBox(root: Locator, label: string): Locator {
  return root.locator('.widget-inline-hbox', { hasText: label }).first().locator('input');
}

test('the Try tab streams a trained run\'s reply', async ({ page, tmpPath }) => {
  fs.mkdirSync(ARTIFACTS, { recursive: true });
  await openLab(page, tmpPath);
  const runsDir = fs.mkdtempSync(path.join(os.tmpdir(), 'mwb-try-runs-'));
  await page.notebook.createNew();
  const source = [
    'import json, workbench',
    'from workbench.config import RunConfig',
    'from workbench.train.loop import finetune',
    'from workbench.ui import Studio',
    `runs_dir = ${JSON.stringify(runsDir)}`,
    'finetune(RunConfig.demo(output_dir=runs_dir, run_id="tried", data__seq_len=64, train__steps=3,',
    '    train__global_batch_size=4, train__local_batch_size=2, train__warmup_steps=1, train__lr=1e-2))',
    `expected = workbench.generate(runs_dir + "/tried", ${JSON.stringify(PROMPT)}, temperature=0, ` +
      `max_new_tokens=${NEW_TOKENS})`,
    'print("EXPECTED", json.dumps(expected))',
    'studio = Studio(None, runs_dir=runs_dir)',
    'studio'
  ].join('\n');
  await page.notebook.setCell(0, 'code', source);
  await page.notebook.runCell(0);
  const output = page.locator('.jp-NotebookPanel:visible .jp-Cell').first().locator('.jp-OutputArea');
  await expect(output).toContainText('EXPECTED "', { timeout: 120000 });
  const printed = (await output.innerText()).match(/EXPECTED (".*")/);
  expect(printed, 'the kernel printed the expected reply').not.toBeNull();
  const expected: string = JSON.parse(printed![1]);
  expect(expected.trim(), 'a tiny trained run answers with some text').not.toEqual('');

  const studio = output.locator('.widget-vbox').filter({ has: page.locator('.widget-tab') }).first();
  await expect(studio.locator('.widget-tab')).toBeVisible({ timeout: 60000 });
  await studio.locator('.lm-TabBar-tab', { hasText: 'Try' }).first().click();
  const tab = studio.locator('.mwb-try');
  await expect(tab).toBeVisible();
  // The latest run is chosen, named by its id and the checkpoint that answers.
  await expect(tab.locator('select')).toHaveCount(1);
  // (ipywidgets writes the option's spaces as no-break spaces)
  expect((await tab.locator('select option:checked').innerText()).replace(/\s/g, ' ')).toBe('tried · step 3');

  await tab.locator('textarea').fill(PROMPT);
  for (const [label, value] of [['temperature', '0'], ['max new tokens', String(NEW_TOKENS)]]) {
    const box = numberBox(tab, label);
    await box.fill(value);
    await box.press('Enter');
  }
  await tab.locator('button', { hasText: 'Send' }).click();
  await expect(tab.locator('.mwb-try-status')).toContainText('pieces in', { timeout: 90000 });
  // Exactly the kernel's own reply (textContent: nothing trimmed or collapsed).
  expect(await tab.locator('.mwb-try-reply').evaluate(el => el.textContent)).toBe(expected);
  await expect(tab.locator('button', { hasText: 'Send' })).toBeEnabled();
  await expect(tab.locator('.mwb-try-status')).toContainText('tried · step 3');
  expect(await clipped(tab), 'clipped labels or buttons in the Try tab').toEqual([]);
  await page.setViewportSize({ width: 760, height: 1000 }); // a narrow notebook: the rows wrap, nothing is cut off
  await expect.poll(() => clipped(tab), { message: 'clipped in a narrow Try tab' }).toEqual([]);
  await page.setViewportSize({ width: 1280, height: 1000 });
  await tab.screenshot({ path: path.join(ARTIFACTS, 'studio-try.png') });
});
