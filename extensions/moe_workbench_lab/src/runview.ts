// Main-area view of one run: its metrics as line plots, refreshed while the run is live.
import { Widget } from '@lumino/widgets';

import { IMetricsAnswer, IRunsAnswer, IRunSummary, MetricRecord, requestAPI, runTitle } from './api';
import { moeHealthSpecs } from './moehealth';
import { meshText, runHeading, runTooltip } from './runlabel';
import { ISeries, lineChart } from './svg';

const LIVE_STATES = new Set(['starting', 'running', 'stopping']);
// The charts fill the view's width: as many columns as fit at CHART_MIN_PX each, sharing the width.
const CHART_MIN_PX = 380;
const CHART_GAP_PX = 12;
const CHART_HEIGHT_PX = 240;

/** One chart of the run view: a title and the series it draws from the run's records. */
export interface IChartSpec {
  title: string;
  series: (records: MetricRecord[]) => ISeries[];
  /** Left out while it has no series (e.g. eval accuracy of a run without eval). */
  optional?: boolean;
}

/** Column count and chart width that fill `available` px (never narrower than one chart of 260 px). */
export function chartGrid(available: number): { columns: number; width: number } {
  const columns = Math.max(1, Math.floor((available + CHART_GAP_PX) / (CHART_MIN_PX + CHART_GAP_PX)));
  const width = Math.max(260, Math.floor((available - CHART_GAP_PX * (columns - 1)) / columns));
  return { columns, width };
}

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
  return keys.flatMap(key => byRank(rank0, key).map(s => ({ ...s, label: key })));
}

export class RunView extends Widget {
  constructor(
    private run: IRunSummary,
    private runsDir: () => string
  ) {
    super();
    this.addClass('mwb-runview');
    this.id = `moe-workbench-run-${run.id}`;
    this.title.closable = true;
    this.header = document.createElement('div');
    this.header.className = 'mwb-runview-header';
    this.plots = document.createElement('div');
    this.plots.className = 'mwb-runview-plots';
    this.node.append(this.header, this.plots);
    this.renderHeader();
    // The plot area's width also changes without a resize of the view (a scrollbar comes or goes).
    this.resizeObserver = new ResizeObserver(() => {
      if (this.plots.clientWidth !== this.drawnWidth) {
        this.redraw();
      }
    });
    this.resizeObserver.observe(this.plots);
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
    this.resizeObserver.disconnect();
    super.dispose();
  }

  protected onAfterAttach(): void {
    void this.refresh();
  }

  private renderHeader(): void {
    const r = this.run;
    const pairs = (obj: Record<string, unknown> | null | undefined) =>
      obj ? Object.entries(obj).map(([k, v]) => `${k}=${v}`).join(', ') : '';
    // The name (or folder id) and kind, as in the sidebar, with the state badge and the folder id.
    const title = document.createElement('div');
    title.className = 'mwb-runview-title';
    const badge = document.createElement('span');
    badge.className = `mwb-badge mwb-state-${r.state}`;
    badge.textContent = r.state ?? '?';
    title.append(runHeading(r, 'mwb-runview-name'), badge);
    if (r.name) {
      const id = document.createElement('span');
      id.className = 'mwb-run-id';
      id.textContent = r.id;
      title.append(id);
    }
    const steps = `${r.step ?? '–'}${r.total_steps ? ' / ' + r.total_steps : ''}`;
    const tps = typeof r.tokens_per_s_per_gpu === 'number' ? ` · ${r.tokens_per_s_per_gpu.toFixed(0)} tok/s/GPU` : '';
    const info = document.createElement('div');
    info.className = 'mwb-runview-info';
    info.textContent = `model: ${r.model ?? '?'} · mesh: ${meshText(r.mesh) || '?'} · step ${steps}${tps}`;
    const backends = document.createElement('div');
    backends.textContent = r.backends ? `backends: ${pairs(r.backends)}` : '';
    this.header.replaceChildren(title, info, backends);
    this.title.label = `Run ${runTitle(r)}`;
    this.title.caption = runTooltip(r);
  }

  // Drawn again at the new width whenever the view's width may have changed.
  protected onResize(): void {
    this.redraw();
  }

  protected onAfterShow(): void {
    this.redraw();
  }

  private redraw(): void {
    if (this.records) {
      this.renderPlots(this.records);
    }
  }

  /** The charts, in order; another view (e.g. MoE health) adds its own specs here. */
  protected chartSpecs(): IChartSpec[] {
    const rank0 = (records: MetricRecord[]) => records.filter(r => (r.rank ?? 0) === 0);
    return [
      {
        title: 'loss (rank 0)',
        // Eval (data.eval_every) is a second, dashed series beside the training loss, on its own steps.
        series: records => [
          ...byRank(rank0(records), 'loss').map(s => ({ ...s, label: 'train' })),
          ...byRank(rank0(records), 'eval_loss').map(s => ({ ...s, label: 'eval', dashed: true }))
        ]
      },
      {
        title: 'eval token accuracy (rank 0)',
        optional: true,
        series: records => byRank(rank0(records), 'eval_accuracy').map(s => ({ ...s, label: 'eval', dashed: true }))
      },
      { title: 'tokens/s per GPU', series: records => byRank(records, 'tokens_per_s_per_gpu') },
      { title: 'TFLOP/s per GPU', series: records => byRank(records, 'tflops_per_gpu') },
      { title: 'peak memory (GiB)', series: records => byRank(records, 'mem_peak_gib') },
      { title: 'expert load CV', series: records => byRank(records, 'expert_load_cv') },
      ...moeHealthSpecs(),
      {
        title: 'step time (s), rank 0',
        series: records => keysOfRank0(records, ['forward_s', 'backward_s', 'optimizer_s', 'step_time_s'])
      }
    ];
  }

  private renderPlots(records: MetricRecord[]): void {
    this.records = records;
    // Measured each time: the charts are drawn at the width they are shown at (text stays its size).
    const style = window.getComputedStyle(this.plots);
    const padding = parseFloat(style.paddingLeft || '0') + parseFloat(style.paddingRight || '0');
    this.drawnWidth = this.plots.clientWidth;
    const available = this.plots.clientWidth - padding;
    const { columns, width } = chartGrid(available > 0 ? available : CHART_MIN_PX);
    // Each column takes its share exactly (the chart is drawn at the whole pixels below it, then
    // stretched by the fraction of a pixel left over, so a row spans the width to the pixel).
    this.plots.style.gridTemplateColumns = `repeat(${columns}, minmax(0, 1fr))`;
    const charts = this.chartSpecs()
      .map(spec => ({ spec, series: spec.series(records) }))
      .filter(({ spec, series }) => !spec.optional || series.length > 0)
      .map(({ spec, series }) => lineChart(spec.title, series, 'step', width, CHART_HEIGHT_PX));
    this.plots.replaceChildren(...charts);
  }

  private header: HTMLDivElement;
  private plots: HTMLDivElement;
  private records: MetricRecord[] | null = null;
  private drawnWidth = -1;
  private resizeObserver: ResizeObserver;
  private timer = 0;
}
