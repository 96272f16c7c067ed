// How a run is shown wherever it appears (sidebar row, run view header, tab title): its name, or its
// folder id when unnamed, then one short line of what kind of run it is (full or LoRA, data, eval).
import { IRunSummary, runTitle } from './api';

/** 'dp2 × ep2': the product's two mesh axes; sizes of other axes are not shown. */
export function meshText(mesh: Record<string, number> | null | undefined): string {
  if (!mesh || typeof mesh !== 'object') {
    return '';
  }
  return ['dp', 'ep']
    .filter(k => typeof mesh[k] === 'number')
    .map(k => `${k}${mesh[k]}`)
    .join(' × ');
}

/** The kind line the server sends (full vs LoRA r/targets, data source, eval), or '' from an older server. */
export function kindText(run: IRunSummary): string {
  return typeof run.kind?.label === 'string' ? run.kind.label : '';
}

/** What a tooltip says about a run: its full name, its folder id and its kind. */
export function runTooltip(run: IRunSummary): string {
  const head = run.name ? `${run.name}\nrun folder ${run.id}` : `run folder ${run.id}`;
  const kind = kindText(run);
  return kind ? `${head}\n${kind}` : head;
}

/**
 * The run's name (the folder id when unnamed) over its kind line. The name wraps to two lines at
 * most and is cut with an ellipsis beyond; the tooltip always holds it whole.
 */
export function runHeading(run: IRunSummary, cls = ''): HTMLDivElement {
  const box = document.createElement('div');
  box.className = `mwb-run-heading ${cls}`.trim();
  const name = document.createElement('span');
  name.className = `mwb-run-name${run.name ? '' : ' mwb-run-unnamed'}`;
  name.textContent = runTitle(run);
  name.title = runTooltip(run);
  box.appendChild(name);
  const kind = kindText(run);
  if (kind) {
    const line = document.createElement('div');
    line.className = `mwb-run-kind mwb-kind-${run.kind?.training ?? 'unknown'}`;
    line.textContent = kind;
    line.title = kind;
    box.appendChild(line);
  }
  return box;
}
