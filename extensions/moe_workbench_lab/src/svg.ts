// Tiny dependency-free SVG charts: sidebar sparklines and the run view's line plots.
const SVG_NS = 'http://www.w3.org/2000/svg';

function el<K extends keyof SVGElementTagNameMap>(
  tag: K,
  attrs: Record<string, string | number> = {}
): SVGElementTagNameMap[K] {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) {
    node.setAttribute(k, String(v));
  }
  return node;
}

function extent(values: number[]): [number, number] {
  let lo = Math.min(...values);
  let hi = Math.max(...values);
  if (!isFinite(lo) || !isFinite(hi)) {
    return [0, 1];
  }
  if (hi === lo) {
    // A flat line still needs a visible range.
    const pad = Math.abs(hi) * 0.05 || 1;
    lo -= pad;
    hi += pad;
  }
  return [lo, hi];
}

/** A small line without axes; empty series give an empty box. */
export function sparkline(values: number[], width = 90, height = 22, cls = ''): SVGSVGElement {
  const svg = el('svg', {
    width,
    height,
    viewBox: `0 0 ${width} ${height}`,
    class: `mwb-sparkline ${cls}`.trim()
  });
  if (values.length < 2) {
    return svg;
  }
  const [lo, hi] = extent(values);
  const points = values.map((v, i) => {
    const x = (i / (values.length - 1)) * (width - 2) + 1;
    const y = height - 1 - ((v - lo) / (hi - lo)) * (height - 2);
    return `${x.toFixed(1)},${y.toFixed(1)}`;
  });
  svg.appendChild(el('polyline', { points: points.join(' '), fill: 'none' }));
  return svg;
}

export interface ISeries {
  label: string;
  xs: number[];
  ys: number[];
  /** Drawn dashed (e.g. eval loss beside the training loss). */
  dashed?: boolean;
}

// An upper estimate of a 10px legend character's width: entries are placed before the chart is in
// the page (nothing can be measured yet), so they are spaced by this, never closer.
const LEGEND_CHAR_PX = 6.5;
const LEGEND_ROW_PX = 13;
// Space between the title's baseline row and the legend's first row: a title's descenders (p, /) reach
// 3-4 px below its baseline.
const LEGEND_TOP_PX = 4;

/** Legend entries left to right under the title, wrapped to more rows when they do not fit. */
function legendLayout(labels: string[], left: number, right: number): { x: number; row: number }[] {
  let x = left;
  let row = 0;
  return labels.map(label => {
    const w = 14 + label.length * LEGEND_CHAR_PX; // a swatch, then the text
    if (x > left && x + w > right) {
      x = left;
      row += 1;
    }
    const at = { x, row };
    x += w + 10;
    return at;
  });
}

/** The 1, 2 or 5 times a power of ten nearest above `raw`: a step that reads well on an axis. */
function niceStep(raw: number): number {
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const scaled = raw / power;
  return (scaled <= 1 ? 1 : scaled <= 2 ? 2 : scaled <= 5 ? 5 : 10) * power;
}

/**
 * Tick labels for values `step` apart: decimals chosen from the step, so that neighbours always read
 * differently (0.465, 0.470, ... where a fixed 2 decimals printed 0.47 four times); thousands as k / M.
 */
export function tickLabels(values: number[], step: number): string[] {
  const top = Math.max(...values.map(Math.abs));
  const [scale, suffix] = top >= 1e6 ? [1e6, 'M'] : top >= 1e4 ? [1e3, 'k'] : [1, ''];
  const decimals = Math.max(0, Math.ceil(-Math.log10(step / scale) - 1e-9));
  if (decimals > 6) {
    // Steps this small next to the values: exponent form with enough digits for the step.
    const digits = Math.max(1, Math.ceil(Math.log10(top / step)));
    return values.map(v => (v === 0 ? '0' : v.toExponential(digits)));
  }
  return values.map(v => `${(v / scale).toFixed(decimals)}${suffix}`);
}

/** About `count` ticks at a nice step; the axis widened to the outer ticks so they sit at its ends. */
export function valueTicks(lo: number, hi: number, count = 5): { lo: number; hi: number; ticks: number[]; step: number } {
  const step = niceStep((hi - lo) / Math.max(1, count - 1));
  const first = Math.floor(lo / step + 1e-9);
  const last = Math.ceil(hi / step - 1e-9);
  const ticks: number[] = [];
  for (let i = first; i <= last; i++) {
    ticks.push(i * step);
  }
  return { lo: first * step, hi: last * step, ticks, step };
}

/**
 * Whole-step ticks over [first, last]: both ends always (the axis covers every step, and says so),
 * multiples of a nice stride between them, none closer than half a stride to an end.
 */
export function stepTicks(first: number, last: number, count = 5): { ticks: number[]; step: number } {
  if (last <= first) {
    return { ticks: [first], step: 1 };
  }
  const stride = Math.max(1, niceStep((last - first) / Math.max(1, count - 1)));
  const ticks = [first];
  for (let t = Math.ceil(first / stride) * stride; t < last; t += stride) {
    if (t - first >= stride / 2 && last - t >= stride / 2) {
      ticks.push(t);
    }
  }
  ticks.push(last);
  return { ticks, step: stride };
}

/** A line chart with axes, ticks and a legend; one colour class per series. */
export function lineChart(
  title: string,
  series: ISeries[],
  xLabel = 'step',
  width = 420,
  height = 220
): SVGSVGElement {
  // The legend has its own rows between the title and the plot, so it never overlaps the title.
  const legend = series.length > 1 ? legendLayout(series.map(s => s.label), 52, width - 10) : [];
  const legendRows = legend.length ? Math.max(...legend.map(l => l.row)) + 1 : 0;
  const m = { left: 52, right: 10, top: 22 + legendRows * LEGEND_ROW_PX + (legendRows ? LEGEND_TOP_PX : 0), bottom: 30 };
  const svg = el('svg', {
    width,
    height,
    viewBox: `0 0 ${width} ${height}`,
    class: 'mwb-chart'
  });
  const heading = el('text', { x: m.left, y: 14, class: 'mwb-chart-title' });
  heading.textContent = title;
  svg.appendChild(heading);
  const xs = series.flatMap(s => s.xs);
  const ys = series.flatMap(s => s.ys);
  if (xs.length === 0) {
    const empty = el('text', { x: width / 2, y: height / 2, class: 'mwb-chart-empty' });
    empty.textContent = 'no data yet';
    svg.appendChild(empty);
    return svg;
  }
  // Steps are integers: tick whole steps from the first to the last step; other x values and every
  // y axis get nice ticks, the axis widened to them.
  const integerX = xs.every(x => Number.isInteger(x));
  const [xa, xb] = extent(xs);
  const xt = integerX ? { ...stepTicks(Math.min(...xs), Math.max(...xs)), lo: xa, hi: xb } : valueTicks(xa, xb);
  const [x0, x1] = [xt.lo, xt.hi];
  const [ya, yb] = extent(ys);
  const yt = valueTicks(ya, yb);
  const [y0, y1] = [yt.lo, yt.hi];
  const px = (x: number) => m.left + ((x - x0) / (x1 - x0)) * (width - m.left - m.right);
  const py = (y: number) => height - m.bottom - ((y - y0) / (y1 - y0)) * (height - m.top - m.bottom);
  const axes = el('g', { class: 'mwb-axes' });
  axes.appendChild(el('line', { x1: m.left, y1: height - m.bottom, x2: width - m.right, y2: height - m.bottom }));
  axes.appendChild(el('line', { x1: m.left, y1: m.top, x2: m.left, y2: height - m.bottom }));
  tickLabels(yt.ticks, yt.step).forEach((label, i) => {
    const t = el('text', { x: m.left - 4, y: py(yt.ticks[i]) + 3, class: 'mwb-tick mwb-tick-y' });
    t.textContent = label;
    axes.appendChild(t);
  });
  const xLabels = integerX ? xt.ticks.map(v => String(v)) : tickLabels(xt.ticks, xt.step);
  xLabels.forEach((label, i) => {
    const tx = el('text', { x: px(xt.ticks[i]), y: height - m.bottom + 12, class: 'mwb-tick mwb-tick-x' });
    tx.textContent = label;
    axes.appendChild(tx);
  });
  const xl = el('text', { x: (width + m.left) / 2, y: height - 4, class: 'mwb-axis-label' });
  xl.textContent = xLabel;
  axes.appendChild(xl);
  svg.appendChild(axes);
  series.forEach((s, k) => {
    const cls = `mwb-series mwb-series-${k % 6}${s.dashed ? ' mwb-series-dashed' : ''}`;
    const pts = s.xs.map((x, i) => `${px(x).toFixed(1)},${py(s.ys[i]).toFixed(1)}`).join(' ');
    svg.appendChild(el('polyline', { points: pts, fill: 'none', class: cls }));
    if (s.xs.length === 1) {
      svg.appendChild(el('circle', { cx: px(s.xs[0]), cy: py(s.ys[0]), r: 3, class: `mwb-series mwb-series-${k % 6}` }));
    }
    if (legend.length) {
      const y = 14 + LEGEND_TOP_PX + (legend[k].row + 1) * LEGEND_ROW_PX;
      const swatch = el('line', { x1: legend[k].x, y1: y - 3, x2: legend[k].x + 10, y2: y - 3, class: cls });
      const text = el('text', { x: legend[k].x + 14, y, class: `mwb-legend mwb-series-${k % 6}` });
      text.textContent = s.label;
      svg.append(swatch, text);
    }
  });
  return svg;
}
