// The run view's MoE health charts: one chart per figure of workbench.runs.moe_health (dead experts, the most and
// least loaded expert's share, load CV, router entropy) over steps, from rank 0's records (rank 0's tokens).
import type { IChartSpec } from './runview';
import type { ISeries } from './svg';

// Up to this many MoE layers get a line each (their legend fits a chart); a deeper model's chart shows the mean
// over its layers and the highest and lowest layer at each step instead.
export const LAYER_LINES_MAX = 6;

const FIGURES: { key: string; title: string }[] = [
  { key: 'moe_dead_share', title: 'dead experts (share)' },
  { key: 'moe_max_share', title: "most loaded expert's share" },
  { key: 'moe_min_share', title: "least loaded expert's share" },
  { key: 'moe_load_cv', title: 'expert load CV per layer' },
  { key: 'router_entropy', title: 'router entropy (/ ln E)' }
];

/** Rank 0's per-layer values of `key` as chart series: a line per layer, or mean / highest / lowest layer. */
export function healthSeries(records: Record<string, unknown>[], key: string): ISeries[] {
  const points: { step: number; values: number[] }[] = [];
  for (const r of records) {
    const values = r[key];
    const step = r.step;
    const rank = typeof r.rank === 'number' ? r.rank : 0;
    if (rank !== 0 || typeof step !== 'number' || !Array.isArray(values) || values.length === 0) {
      continue;
    }
    if (values.every(v => typeof v === 'number')) {
      points.push({ step, values: values as number[] });
    }
  }
  if (points.length === 0) {
    return [];
  }
  const layers = Math.max(...points.map(p => p.values.length));
  if (layers <= LAYER_LINES_MAX) {
    return Array.from({ length: layers }, (_, layer) => {
      const held = points.filter(p => layer < p.values.length);
      return { label: `layer ${layer}`, xs: held.map(p => p.step), ys: held.map(p => p.values[layer]) };
    });
  }
  const xs = points.map(p => p.step);
  return [
    { label: `mean of ${layers} layers`, xs, ys: points.map(p => p.values.reduce((a, b) => a + b, 0) / p.values.length) },
    { label: 'highest layer', xs, ys: points.map(p => Math.max(...p.values)) },
    { label: 'lowest layer', xs, ys: points.map(p => Math.min(...p.values)), dashed: true }
  ];
}

/** The run view's MoE health charts, left out for a run whose records have none. */
export function moeHealthSpecs(): IChartSpec[] {
  return FIGURES.map(figure => ({
    title: `${figure.title}, rank 0`,
    optional: true,
    series: records => healthSeries(records as unknown as Record<string, unknown>[], figure.key)
  }));
}
