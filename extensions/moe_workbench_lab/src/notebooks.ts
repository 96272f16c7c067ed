// Launcher cards and palette entries that open the workbench notebooks, copied into the user's
// notebooks folder (beside the runs folder, never the repository checkout) if not there yet.
import { JupyterFrontEnd } from '@jupyterlab/application';
import { Dialog, ICommandPalette, showDialog, showErrorMessage } from '@jupyterlab/apputils';
import { IDocumentManager } from '@jupyterlab/docmanager';
import { ILauncher } from '@jupyterlab/launcher';
import { LabIcon } from '@jupyterlab/ui-components';

import { INotebookList, requestAPI } from './api';

export const CATEGORY = 'MoE Workbench';

/** The server's answer to a copy: the contents path to open (null: outside the server's folder). */
interface INotebookCopy {
  path: string | null;
  file: string;
  copied: boolean;
  note?: string;
}

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
      caption:
        `Open ${nb.name}: copied into your notebooks folder (beside the runs folder) if it is not there; ` +
        'your copy is never overwritten',
      icon,
      execute: async () => {
        try {
          const answer = await requestAPI<INotebookCopy>(`notebooks/${encodeURIComponent(nb.name)}`, {
            method: 'POST'
          });
          if (answer.path === null) {
            // Copied, but outside the folder this server shows: say where it is and how to open it.
            await showDialog({
              title: `${nb.name} is in ${answer.file}`,
              body: answer.note ?? '',
              buttons: [Dialog.okButton()]
            });
            return;
          }
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
