// Typed access to the server extension's JSON routes under /moe-workbench/api/.
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IGpu {
  index: number;
  name: string;
  memory_used_bytes: number;
  memory_total_bytes: number;
  utilization_pct: number | null;
  temperature_c: number | null;
}

export interface IGpuAnswer {
  available: boolean;
  /** Why there are no GPUs, in plain words. */
  reason: string | null;
  /** The raw error behind `reason`, for a detail line. */
  detail?: string | null;
  gpus: IGpu[];
}

export interface IRank {
  rank: number;
  pid: number | null;
  state: string | null;
}

export interface ICluster {
  id: string;
  readable: boolean;
  error?: string;
  cluster_id?: string;
  profile?: string;
  n_engines?: number;
  ranks?: IRank[];
}

export interface IClusterAnswer {
  available: boolean;
  reason: string | null;
  clusters: ICluster[];
}

export interface IRunKind {
  training: 'full' | 'lora';
  lora_rank: number | null;
  lora_targets: string[] | null;
  data: string;
  eval: string | null;
  /** The one line every listing shows, e.g. 'LoRA r=16 attention+experts · tiny_sft.jsonl (shipped)'. */
  label: string;
}

export interface IRunSummary {
  id: string;
  readable: boolean;
  error?: string;
  /** The name given at launch (RunConfig.name), if any. */
  name?: string | null;
  /** What kind of run it is (workbench.runs.run_kind): full or LoRA r/targets, data source, eval. */
  kind?: IRunKind | null;
  model?: string | null;
  mesh?: Record<string, number> | null;
  backends?: Record<string, unknown> | null;
  state?: string;
  step?: number | null;
  total_steps?: number | null;
  loss?: number | null;
  tokens_per_s_per_gpu?: number | null;
  updated_at?: number | null;
  spark?: { tokens_per_s_per_gpu: number[]; loss: number[] };
}

/** What a run is called: its name given at launch (RunConfig.name), else its folder id. */
export function runTitle(run: IRunSummary): string {
  return run.name || run.id;
}

export interface IRunsAnswer {
  runs_dir: string;
  exists: boolean;
  runs: IRunSummary[];
}

export type MetricRecord = Record<string, number | null | undefined>;

export interface IMetricsAnswer {
  id: string;
  path: string;
  /** Each rank's records, thinned evenly over the whole run by the server. */
  records: MetricRecord[];
  records_seen?: number;
  /** Bytes of metrics.jsonl the server has not read yet (it reads a bounded amount per request). */
  pending_bytes?: number;
}

export interface INotebookList {
  source_dir: string | null;
  reason: string | null;
  notebooks: { name: string; title: string }[];
}

/** Call a route; `query` values that are empty strings are left out. */
export async function requestAPI<T>(
  endpoint: string,
  init: RequestInit = {},
  query: Record<string, string> = {}
): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const params = Object.entries(query)
    .filter(([, v]) => v !== '')
    .map(([k, v]) => `${encodeURIComponent(k)}=${encodeURIComponent(v)}`)
    .join('&');
  const url =
    URLExt.join(settings.baseUrl, 'moe-workbench', 'api', endpoint) +
    (params ? `?${params}` : '');
  const response = await ServerConnection.makeRequest(url, init, settings);
  const text = await response.text();
  if (!response.ok) {
    let message = text;
    try {
      message = JSON.parse(text).message || text;
    } catch {
      // not JSON: keep the raw text
    }
    throw new ServerConnection.ResponseError(response, message);
  }
  return JSON.parse(text) as T;
}
