// A user saving in JupyterLab with widget state on: plotly figures render and the file stays small.
import { expect, galata, test } from '@jupyterlab/galata';

test.use({
  // "Save Jupyter widget state in notebooks" on: the setting under which each stock plotly
  // FigureWidget wrote its 5 MB script into the notebook (off by default: then no state is saved).
  mockSettings: {
    ...galata.DEFAULT_SETTINGS,
    '@jupyter-widgets/jupyterlab-manager:plugin': { saveState: true }
  },
  waitForApplication: async ({ baseURL }, use) => {
    await use(async (page, helpers) => {
      await page.locator('#jupyterlab-splash').waitFor({ state: 'detached', timeout: 60000 });
      await helpers.waitForCondition(() => helpers.activity.isTabActive('Launcher'), 60000);
      await helpers.activity.activateTab('Launcher');
    });
  }
});

test('workbench figures render and a notebook saved with their widget state stays small', async ({
  page,
  tmpPath
}) => {
  const name = 'figures.ipynb';
  await page.notebook.createNew(name);
  // The Studio's figures come from workbench.ui.slim_figure.figure_widget (LivePlots, CompareRuns, Profile).
  await page.notebook.setCell(
    0,
    'code',
    [
      'import ipywidgets as W',
      'import plotly.graph_objects as go',
      'from workbench.ui.slim_figure import figure_widget',
      'figures = [figure_widget(go.Figure(go.Scatter(x=[1, 2, 3], y=[3, 1, i]))) for i in range(3)]',
      'W.VBox(figures)'
    ].join('\n')
  );
  await page.notebook.runCell(0);
  // The loader imported plotly's script from the server extension and drew each figure.
  const plots = page.locator('.jp-OutputArea-output .js-plotly-plot');
  await expect(plots).toHaveCount(3, { timeout: 60000 });
  await expect(plots.first().locator('.scatterlayer .trace')).toHaveCount(1);

  await page.notebook.save();
  const response = await page.request.get(
    `/api/contents/${tmpPath}/${name}?type=file&format=text&content=1`
  );
  expect(response.ok()).toBe(true);
  const text: string = (await response.json()).content;
  const state = JSON.parse(text).metadata.widgets['application/vnd.jupyter.widget-state+json'].state;
  const figures = Object.values(state).filter((m: any) => m.model_name === 'AnyModel') as any[];
  expect(figures).toHaveLength(3); // the widget state was saved ...
  // ... each holding the loader, not plotly's script (compared as numbers: the script is 5 MB to print).
  expect(figures.map(f => f.state._esm.length < 2000 && f.state._esm.includes('moe-workbench/plotly/'))).toEqual([
    true,
    true,
    true
  ]);
  expect(text.length).toBeLessThan(1024 * 1024);

  // Reopened after a kernel shutdown (the new kernel knows none of these figures): drawn from the saved state.
  await page.notebook.close();
  await page.kernel.shutdownAll();
  await page.notebook.openByPath(`${tmpPath}/${name}`);
  await expect(page.locator('.jp-OutputArea-output .js-plotly-plot')).toHaveCount(3, { timeout: 60000 });
});
