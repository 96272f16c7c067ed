// The left-sidebar panel: GPU bars, running ipyparallel clusters, and training runs.
import { Widget } from '@lumino/widgets';

import { IClusterAnswer, IGpuAnswer, IRunsAnswer, IRunSummary, requestAPI } from './api';
import { meshText, runHeading } from './runlabel';
import { sparkline } from './svg';

export interface ISidebarOptions {
  /** Server-side runs folder ('' = the workbench default). */
  runsDir: () => string;
  /** Called when the user clicks a run. */
  openRun: (run: IRunSummary) => void;
}

function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  cls = '',
  text = ''
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (cls) {
    node.className = cls;
  }
  if (text) {
    node.textContent = text;
  }
  return node;
}

const GIB = 1024 ** 3;

export class WorkbenchSidebar extends Widget {
  constructor(private options: ISidebarOptions) {
    super();
    this.id = 'moe-workbench-sidebar';
    this.addClass('mwb-sidebar');
    this.title.caption = 'MoE Workbench';
    const header = h('div', 'mwb-header');
    header.appendChild(h('span', 'mwb-header-title', 'MoE Workbench'));
    const refresh = h('button', 'mwb-refresh jp-Button', '↻');
    refresh.title = 'Refresh now';
    refresh.onclick = () => void this.refresh();
    header.appendChild(refresh);
    this.node.appendChild(header);
    this.gpuSection = this.section('GPUs', 'mwb-gpus');
    this.clusterSection = this.section('Clusters', 'mwb-clusters');
    this.runSection = this.section('Runs', 'mwb-runs');
  }

  /** Poll every `seconds` while visible; call again to change the interval. */
  startPolling(seconds: number): void {
    window.clearInterval(this.timer);
    this.timer = window.setInterval(() => {
      if (this.isVisible) {
        void this.refresh();
      }
    }, Math.max(1, seconds) * 1000);
  }

  dispose(): void {
    window.clearInterval(this.timer);
    super.dispose();
  }

  protected onAfterShow(): void {
    void this.refresh();
  }

  /** Fetch all three routes; each section shows its own error. */
  async refresh(): Promise<void> {
    const runsDir = this.options.runsDir();
    await Promise.all([
      requestAPI<IGpuAnswer>('gpus').then(
        a => this.renderGpus(a),
        e => this.renderError(this.gpuSection, e)
      ),
      requestAPI<IClusterAnswer>('clusters').then(
        a => this.renderClusters(a),
        e => this.renderError(this.clusterSection, e)
      ),
      requestAPI<IRunsAnswer>('runs', {}, { runs_dir: runsDir }).then(
        a => this.renderRuns(a),
        e => this.renderError(this.runSection, e)
      )
    ]);
  }

  private section(title: string, cls: string): HTMLElement {
    const wrapper = h('div', `mwb-section ${cls}`);
    wrapper.appendChild(h('div', 'mwb-section-title', title));
    const body = h('div', 'mwb-section-body');
    body.appendChild(h('div', 'mwb-note', 'loading…'));
    wrapper.appendChild(body);
    this.node.appendChild(wrapper);
    return body;
  }

  private renderError(body: HTMLElement, err: unknown): void {
    body.replaceChildren(h('div', 'mwb-note mwb-error', `error: ${(err as Error).message ?? err}`));
  }

  private renderGpus(answer: IGpuAnswer): void {
    if (!answer.gpus.length) {
      // Plain words first; the raw error (what NVML said) only as a detail line.
      const nodes: HTMLElement[] = [h('div', 'mwb-note mwb-gpu-none', answer.reason ?? 'No GPUs found')];
      if (answer.detail) {
        nodes.push(h('div', 'mwb-detail mwb-gpu-detail', answer.detail));
      }
      this.gpuSection.replaceChildren(...nodes);
      return;
    }
    const rows = answer.gpus.map(gpu => {
      const row = h('div', 'mwb-gpu');
      const used = gpu.memory_used_bytes / GIB;
      const total = gpu.memory_total_bytes / GIB;
      const label = h('div', 'mwb-gpu-label');
      label.appendChild(h('span', 'mwb-gpu-name', `${gpu.index}: ${gpu.name}`));
      const extra = [
        gpu.utilization_pct !== null ? `${gpu.utilization_pct}%` : '',
        gpu.temperature_c !== null ? `${gpu.temperature_c}°C` : ''
      ].filter(Boolean).join(' · ');
      label.appendChild(h('span', 'mwb-gpu-extra', extra));
      row.appendChild(label);
      row.appendChild(this.bar('util', gpu.utilization_pct ?? 0, `util ${gpu.utilization_pct ?? '?'}%`));
      row.appendChild(
        this.bar('mem', total ? (100 * used) / total : 0, `mem ${used.toFixed(1)} / ${total.toFixed(0)} GiB`)
      );
      return row;
    });
    this.gpuSection.replaceChildren(...rows);
  }

  private bar(kind: string, pct: number, text: string): HTMLElement {
    const outer = h('div', `mwb-bar mwb-bar-${kind}`);
    const fill = h('div', 'mwb-bar-fill');
    fill.style.width = `${Math.min(100, Math.max(0, pct)).toFixed(1)}%`;
    outer.appendChild(fill);
    outer.appendChild(h('span', 'mwb-bar-text', text));
    return outer;
  }

  private renderClusters(answer: IClusterAnswer): void {
    if (!answer.clusters.length) {
      this.clusterSection.replaceChildren(
        h('div', 'mwb-note', answer.reason ?? 'No running clusters (start one from a workbench notebook).')
      );
      return;
    }
    const rows = answer.clusters.map(c => {
      const row = h('div', 'mwb-cluster');
      if (!c.readable) {
        row.appendChild(h('div', 'mwb-error', `${c.id}: ${c.error}`));
        return row;
      }
      row.appendChild(h('div', 'mwb-cluster-name', `${c.profile}:${c.cluster_id || '(default)'} — ${c.n_engines} ranks`));
      const ranks = h('div', 'mwb-ranks');
      for (const r of c.ranks ?? []) {
        const chip = h('span', `mwb-rank mwb-state-${r.state ?? 'unknown'}`, String(r.rank));
        chip.title = `rank ${r.rank}, pid ${r.pid ?? '?'}, ${r.state ?? 'unknown'}`;
        ranks.appendChild(chip);
      }
      row.appendChild(ranks);
      return row;
    });
    this.clusterSection.replaceChildren(...rows);
  }

  private renderRuns(answer: IRunsAnswer): void {
    const dirNote = h('div', 'mwb-note mwb-runs-dir', answer.runs_dir);
    dirNote.title = 'Runs directory (change it in Settings → MoE Workbench)';
    if (!answer.runs.length) {
      const why = answer.exists ? 'No runs yet.' : 'The runs directory does not exist yet.';
      this.runSection.replaceChildren(dirNote, h('div', 'mwb-note', `${why} Run \`workbench demo\` or a notebook.`));
      return;
    }
    const rows = answer.runs.map(run => this.runRow(run));
    this.runSection.replaceChildren(dirNote, ...rows);
  }

  private runRow(run: IRunSummary): HTMLElement {
    const row = h('div', 'mwb-run');
    row.dataset.runId = run.id;
    if (!run.readable) {
      row.classList.add('mwb-run-unreadable');
      row.appendChild(h('div', 'mwb-run-id', run.id));
      const err = h('div', 'mwb-error', 'unreadable');
      err.title = run.error ?? '';
      row.appendChild(err);
      return row;
    }
    // The run's name (RunConfig.name, else its folder id) and its kind head the row; a named run's
    // folder id is a detail under them.
    const top = h('div', 'mwb-run-top');
    top.appendChild(h('span', `mwb-badge mwb-state-${run.state}`, run.state ?? '?'));
    top.appendChild(runHeading(run));
    row.appendChild(top);
    if (run.name) {
      row.appendChild(h('div', 'mwb-run-id', run.id));
    }
    if (run.error) {
      // Why a run failed or died (a dead owner is detected by the server, not written by the run).
      const why = h('div', 'mwb-error mwb-run-error', run.error.split('\n')[0]);
      why.title = run.error;
      row.appendChild(why);
    }
    const steps = run.total_steps ? `${run.step ?? 0}/${run.total_steps}` : `${run.step ?? '–'}`;
    const tps = typeof run.tokens_per_s_per_gpu === 'number' ? `${run.tokens_per_s_per_gpu.toFixed(0)} tok/s/GPU` : '';
    const info = [run.model ?? '', meshText(run.mesh), `step ${steps}`, tps].filter(Boolean).join(' · ');
    row.appendChild(h('div', 'mwb-run-info', info));
    const sparks = h('div', 'mwb-run-sparks');
    const tpsBox = h('span', 'mwb-spark-box', 'tok/s ');
    tpsBox.appendChild(sparkline(run.spark?.tokens_per_s_per_gpu ?? [], 80, 20, 'mwb-spark-tps'));
    const lossBox = h('span', 'mwb-spark-box', 'loss ');
    lossBox.appendChild(sparkline(run.spark?.loss ?? [], 80, 20, 'mwb-spark-loss'));
    sparks.append(tpsBox, lossBox);
    row.appendChild(sparks);
    row.title = 'Open this run\u2019s plots';
    row.onclick = () => this.options.openRun(run);
    return row;
  }

  private gpuSection: HTMLElement;
  private clusterSection: HTMLElement;
  private runSection: HTMLElement;
  private timer = 0;
}
