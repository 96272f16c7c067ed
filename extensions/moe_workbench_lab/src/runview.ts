// Main-area view of one run: its metrics as line plots, refreshed while the run is live.
import { Widget } from '@lumino/widgets';

import { IMetricsAnswer, IRunsAnswer, IRunSummary, MetricRecord, requestAPI, runTitle } from './api';
import { ISeries, lineChart } from './svg';

const LIVE_STATES = new Set(['starting', 'running', 'stopping']);

/** Per-rank series of `key` against step (ranks with no values are left out). */
function byRank(records: MetricRecord[], key: string): ISeries[] {
  const ranks = new Map<number, ISeries>();
  for (const r of records) {
    const y = r[key];
    const x = r.step;
    if (typeof y !== 'number' || typeof x !== 'number') {
      continue;
    }
    const rank = typeof r.rank === 'number' ? r.rank : 0;
    if (!ranks.has(rank)) {
      ranks.set(rank, { label: `rank ${rank}`, xs: [], ys: [] });
    }
    ranks.get(rank)!.xs.push(x);
    ranks.get(rank)!.ys.push(y);
  }
  return [...ranks.entries()].sort((a, b) => a[0] - b[0]).map(([, s]) => s);
}

/** Several keys of rank 0 as one series each. */
function keysOfRank0(records: MetricRecord[], keys: string[]): ISeries[] {
  const rank0 = records.filter(r => (r.rank ?? 0) === 0);
  return keys
    .map(key => byRank(rank0, key)[0])
    .filter((s): s is ISeries => s !== undefined)
    .map((s, i) => ({ ...s, label: keys[i] }));
}

export class RunView extends Widget {
  constructor(
    private run: IRunSummary,
    private runsDir: () => string
  ) {
    super();
    this.addClass('mwb-runview');
    this.id = `moe-workbench-run-${run.id}`;
    this.title.label = `Run ${runTitle(run)}`;
    this.title.caption = run.id;
    this.title.closable = true;
    this.header = document.createElement('div');
    this.header.className = 'mwb-runview-header';
    this.plots = document.createElement('div');
    this.plots.className = 'mwb-runview-plots';
    this.node.append(this.header, this.plots);
    this.renderHeader();
  }

  async refresh(): Promise<void> {
    const query = { runs_dir: this.runsDir() };
    let behind = false;
    try {
      const [metrics, runs] = await Promise.all([
        requestAPI<IMetricsAnswer>(`runs/${encodeURIComponent(this.run.id)}/metrics`, {}, query),
        requestAPI<IRunsAnswer>('runs', {}, query)
      ]);
      this.run = runs.runs.find(r => r.id === this.run.id) ?? this.run;
      this.renderHeader();
      this.renderPlots(metrics.records);
      // A large metrics file is read a bounded piece per request: keep asking until it is all read.
      behind = (metrics.pending_bytes ?? 0) > 0;
    } catch (err) {
      this.plots.replaceChildren(document.createTextNode(`error: ${(err as Error).message}`));
    }
    window.clearTimeout(this.timer);
    if (!this.isDisposed && (behind || LIVE_STATES.has(this.run.state ?? ''))) {
      this.timer = window.setTimeout(() => void this.refresh(), 3000);
    }
  }

  dispose(): void {
    window.clearTimeout(this.timer);
    super.dispose();
  }

  protected onAfterAttach(): void {
    void this.refresh();
  }

  private renderHeader(): void {
    const r = this.run;
    const pairs = (obj: Record<string, unknown> | null | undefined) =>
      obj ? Object.entries(obj).map(([k, v]) => `${k}=${v}`).join(', ') : '';
    const title = document.createElement('div');
    const name = document.createElement('b');
    name.className = 'mwb-runview-name';
    name.textContent = runTitle(r);
    const badge = document.createElement('span');
    badge.className = `mwb-badge mwb-state-${r.state}`;
    badge.textContent = r.state ?? '?';
    title.append(name, ' ', badge);
    if (r.name) {
      const id = document.createElement('span');
      id.className = 'mwb-run-id';
      id.textContent = ` ${r.id}`;
      title.append(id);
    }
    const steps = `${r.step ?? '–'}${r.total_steps ? ' / ' + r.total_steps : ''}`;
    const info = document.createElement('div');
    info.textContent = `model: ${r.model ?? '?'} · mesh: ${pairs(r.mesh) || '?'} · step ${steps}`;
    const backends = document.createElement('div');
    backends.textContent = r.backends ? `backends: ${pairs(r.backends)}` : '';
    this.header.replaceChildren(title, info, backends);
  }

  private renderPlots(records: MetricRecord[]): void {
    const rank0 = records.filter(r => (r.rank ?? 0) === 0);
    // Eval (data.eval_every) is a second, dashed series beside the training loss, on its own steps.
    const evalLoss = byRank(rank0, 'eval_loss');
    const loss = [
      ...byRank(rank0, 'loss').map(s => ({ ...s, label: 'train' })),
      ...evalLoss.map(s => ({ ...s, label: 'eval', dashed: true }))
    ];
    const evalAccuracy = byRank(rank0, 'eval_accuracy').map(s => ({ ...s, label: 'eval', dashed: true }));
    const charts = [
      lineChart('loss (rank 0)', loss),
      ...(evalAccuracy.length ? [lineChart('eval token accuracy (rank 0)', evalAccuracy)] : []),
      lineChart('tokens/s per GPU', byRank(records, 'tokens_per_s_per_gpu')),
      lineChart('TFLOP/s per GPU', byRank(records, 'tflops_per_gpu')),
      lineChart('peak memory (GiB)', byRank(records, 'mem_peak_gib')),
      lineChart('expert load CV', byRank(records, 'expert_load_cv')),
      lineChart('step time (s), rank 0', keysOfRank0(records, ['forward_s', 'backward_s', 'optimizer_s', 'step_time_s']))
    ];
    this.plots.replaceChildren(...charts);
  }

  private header: HTMLDivElement;
  private plots: HTMLDivElement;
  private timer = 0;
}
