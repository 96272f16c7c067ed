// MoE Workbench for JupyterLab: sidebar, run views, settings, launcher and palette entries.
import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, MainAreaWidget, WidgetTracker } from '@jupyterlab/apputils';
import { IDocumentManager } from '@jupyterlab/docmanager';
import { ILauncher } from '@jupyterlab/launcher';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { LabIcon } from '@jupyterlab/ui-components';

import { IRunSummary, runTitle } from './api';
import { addNotebookCommands, CATEGORY } from './notebooks';
import { runTooltip } from './runlabel';
import { RunView } from './runview';
import { WorkbenchSidebar } from './sidebar';

const PLUGIN_ID = 'moe-workbench-lab:plugin';

// A 2x2 grid of "experts", one lit: the MoE routing picture in 16 px.
const workbenchIcon = new LabIcon({
  name: 'moe-workbench:icon',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 16 16">' +
    '<g class="jp-icon3" fill="#616161">' +
    '<rect x="1" y="1" width="6" height="6" rx="1"/><rect x="9" y="9" width="6" height="6" rx="1"/>' +
    '<rect x="1" y="9" width="6" height="6" rx="1" opacity="0.45"/>' +
    '<rect x="9" y="1" width="6" height="6" rx="1" opacity="0.45"/></g></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'MoE Workbench sidebar: GPUs, clusters and training runs.',
  autoStart: true,
  requires: [IDocumentManager],
  optional: [ILabShell, ILayoutRestorer, ISettingRegistry, ICommandPalette, ILauncher],
  activate: (
    app: JupyterFrontEnd,
    docManager: IDocumentManager,
    labShell: ILabShell | null,
    restorer: ILayoutRestorer | null,
    settingRegistry: ISettingRegistry | null,
    palette: ICommandPalette | null,
    launcher: ILauncher | null
  ) => {
    let runsDir = '';
    let refreshSeconds = 3;
    const tracker = new WidgetTracker<MainAreaWidget<RunView>>({ namespace: 'moe-workbench-run' });

    const openRun = (run: IRunSummary) => {
      const existing = tracker.find(w => w.content.id === `moe-workbench-run-${run.id}`);
      if (existing) {
        app.shell.activateById(existing.id);
        void existing.content.refresh();
        return;
      }
      const view = new RunView(run, () => runsDir);
      const widget = new MainAreaWidget({ content: view });
      widget.id = `moe-workbench-run-panel-${run.id}`;
      widget.title.label = `Run ${runTitle(run)}`;
      widget.title.caption = runTooltip(run);
      widget.title.icon = workbenchIcon;
      widget.title.closable = true;
      void tracker.add(widget);
      app.shell.add(widget, 'main');
      app.shell.activateById(widget.id);
    };

    const sidebar = new WorkbenchSidebar({ runsDir: () => runsDir, openRun });
    sidebar.title.icon = workbenchIcon;
    app.shell.add(sidebar, 'left', { rank: 600 });
    restorer?.add(sidebar, sidebar.id);

    app.commands.addCommand('moe-workbench:show-sidebar', {
      label: 'Show MoE Workbench Sidebar',
      execute: () => app.shell.activateById(sidebar.id)
    });
    app.commands.addCommand('moe-workbench:refresh', {
      label: 'Refresh MoE Workbench Sidebar',
      execute: () => sidebar.refresh()
    });
    palette?.addItem({ command: 'moe-workbench:show-sidebar', category: CATEGORY });
    palette?.addItem({ command: 'moe-workbench:refresh', category: CATEGORY });

    // Nothing below is awaited: the lab's start waits for every plugin's activate, and these
    // need server round trips.
    sidebar.startPolling(refreshSeconds);
    if (settingRegistry) {
      settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          const apply = () => {
            runsDir = ((settings.get('runsDir').composite as string) ?? '').trim();
            refreshSeconds = (settings.get('refreshSeconds').composite as number) ?? 3;
            sidebar.startPolling(refreshSeconds);
            void sidebar.refresh();
          };
          settings.changed.connect(apply);
          apply();
        })
        .catch(err => console.warn('moe-workbench-lab: settings not loaded, using defaults', err));
    }
    addNotebookCommands(app, docManager, workbenchIcon, palette, launcher).catch(err =>
      console.warn('moe-workbench-lab: workbench notebooks unavailable', err)
    );
  }
};

export default plugin;
