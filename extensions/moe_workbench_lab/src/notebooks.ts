// Launcher cards and palette entries that open the workbench notebooks (copied in if missing).
import { JupyterFrontEnd } from '@jupyterlab/application';
import { ICommandPalette, showErrorMessage } from '@jupyterlab/apputils';
import { IDocumentManager } from '@jupyterlab/docmanager';
import { ILauncher } from '@jupyterlab/launcher';
import { LabIcon } from '@jupyterlab/ui-components';

import { INotebookList, requestAPI } from './api';

export const CATEGORY = 'MoE Workbench';

/** Ask the server for the notebook list and register one command per notebook. */
export async function addNotebookCommands(
  app: JupyterFrontEnd,
  docManager: IDocumentManager,
  icon: LabIcon,
  palette: ICommandPalette | null,
  launcher: ILauncher | null
): Promise<INotebookList> {
  const list = await requestAPI<INotebookList>('notebooks');
  list.notebooks.forEach((nb, rank) => {
    const command = `moe-workbench:open-notebook:${nb.name}`;
    app.commands.addCommand(command, {
      label: nb.title,
      caption: `Open ${nb.name} (copied into your folder if it is not there; your copy is never overwritten)`,
      icon,
      execute: async () => {
        try {
          const answer = await requestAPI<{ path: string; copied: boolean }>(
            `notebooks/${encodeURIComponent(nb.name)}`,
            { method: 'POST' }
          );
          return docManager.openOrReveal(answer.path);
        } catch (err) {
          await showErrorMessage('MoE Workbench', `Could not open ${nb.name}: ${(err as Error).message}`);
        }
      }
    });
    palette?.addItem({ command, category: CATEGORY });
    launcher?.add({ command, category: CATEGORY, rank });
  });
  return list;
}
