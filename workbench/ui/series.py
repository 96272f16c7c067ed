"""Plot data from step records: pure functions the plot widgets draw and tests check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.errors import BackendError
from workbench.runs.run_dir import RunDir
from workbench.runs.run_kind import run_kind
from workbench.runs.run_names import shown_name
from workbench.runs.throughput import StepThroughput, run_throughput

LIVE_PANELS = {
    "tokens_per_s_per_gpu": "tokens/s per GPU",
    "tflops_per_gpu": "TFLOP/s per GPU",
    "mem_peak_gib": "peak memory per rank (GiB)",
    "loss": "loss",
}
PER_RANK = ("tokens_per_s_per_gpu", "tflops_per_gpu", "mem_peak_gib")


def live_series(records: list[dict]) -> dict[str, Any]:
    """Per-rank lines, the loss line and the latest expert-load matrix from step records.

    Returns {"per_rank": {metric: {rank: (steps, values)}}, "loss": (steps, values),
    "eval_loss": (steps, values) of the steps that ran eval (data.eval_every),
    "expert_load": {"step", "z": [layer][expert] load / uniform load, summed over ranks},
    "warmup_step": the run's first step when later ones exist (its compile/allocate time is no
    throughput: the plots keep it off their scale), else None}.
    The expert load uses the latest step that every rank has reported.
    """
    ordered = sorted(records, key=lambda r: (r["step"], r["rank"]))
    per_rank: dict[str, dict[int, tuple[list, list]]] = {m: {} for m in PER_RANK}
    for r in ordered:
        for metric in PER_RANK:
            if r.get(metric) is not None:
                steps, values = per_rank[metric].setdefault(int(r["rank"]), ([], []))
                steps.append(int(r["step"]))
                values.append(float(r[metric]))
    global_by_step: dict[str, dict[int, float]] = {"loss": {}, "eval_loss": {}}
    for r in ordered:  # every rank reports the global (eval) loss; take the lowest rank's
        for key, by_step in global_by_step.items():
            if r.get(key) is not None and int(r["step"]) not in by_step:
                by_step[int(r["step"])] = float(r[key])
    loss_by_step, eval_by_step = global_by_step["loss"], global_by_step["eval_loss"]
    ranks = {int(r["rank"]) for r in ordered}
    load = {"step": None, "z": []}
    by_step: dict[int, list[dict]] = {}
    for r in ordered:
        if r.get("expert_load"):
            by_step.setdefault(int(r["step"]), []).append(r)
    complete = [s for s, rs in by_step.items() if {int(r["rank"]) for r in rs} == ranks]
    if complete:
        step = max(complete)
        load = {"step": step, "z": expert_load_matrix([r["expert_load"] for r in by_step[step]])}
    return {
        "per_rank": per_rank,
        "loss": (list(loss_by_step), list(loss_by_step.values())),
        "eval_loss": (list(eval_by_step), list(eval_by_step.values())),
        "expert_load": load,
        "warmup_step": warmup_step(ordered),
    }


def warmup_step(records: list[dict]) -> int | None:
    """The first step of the records when there are later ones (None for 0 or 1 steps)."""
    steps = {int(r["step"]) for r in records if "step" in r}
    return min(steps) if len(steps) > 1 else None


Line = tuple[list, list]  # (steps, values)


def split_warmup(steps: list[int], values: list[float], warmup: int | None) -> tuple[Line, Line]:
    """((steady steps, values), (warm-up steps, values)) of one line."""
    steady = [(s, v) for s, v in zip(steps, values) if s != warmup]
    warm = [(s, v) for s, v in zip(steps, values) if s == warmup]
    return (([s for s, _ in steady], [v for _, v in steady]), ([s for s, _ in warm], [v for _, v in warm]))


def axis_range(values: list[float], pad: float = 0.08) -> list[float] | None:
    """[low, high] around `values` with `pad` of their span each side (None without values)."""
    finite = [v for v in values if v == v]
    if not finite:
        return None
    low, high = min(finite), max(finite)
    span = (high - low) or abs(high) or 1.0
    return [low - pad * span, high + pad * span]


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average (TensorBoard's smoothing: 0 = raw, 0.9 = strong), bias-corrected."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out, acc = [], 0.0
    for i, v in enumerate(values, start=1):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight**i) if weight else v)
    return out


def load_color_range(z: list[list[float]]) -> tuple[float, float]:
    """The expert-load colour bar: from 0 (an expert nobody routes to) to max(2, the largest load)."""
    top = max((v for row in z for v in row), default=0.0)
    return 0.0, max(2.0, float(top))


def load_colorscale(zmax: float) -> list[list]:
    """Blue (idle) at 0, white at 1 (the uniform share), red (hot) at `zmax`."""
    mid = 1.0 / zmax
    return [[0.0, "#2166ac"], [mid, "#f7f7f7"], [1.0, "#b2182b"]]


def expert_load_matrix(loads: list[list[list[float]]]) -> list[list[float]]:
    """Sum [layer][expert] counts over ranks; divide each layer by its uniform share (1.0 = even)."""
    layers = len(loads[0])
    out = []
    for layer in range(layers):
        counts = [sum(rank_load[layer][e] for rank_load in loads) for e in range(len(loads[0][layer]))]
        total = sum(counts)
        uniform = total / len(counts) if counts and total else 1.0
        out.append([c / uniform for c in counts])
    return out


def _config_and_records(run: Any) -> tuple[dict, list[dict], str]:
    if isinstance(run, (str, Path)):
        rd = RunDir.open(run)
        config = rd.read_config() if rd.config_path.exists() else {}
        return config, rd.read_metrics(), rd.run_id
    df = run.metrics
    rd = RunDir(Path(run.path))
    # The trainer's config.json records what "auto" became; the config the notebook sent does not.
    config = rd.read_config() if rd.config_path.exists() else run.config
    return config, df.to_dict("records"), run.run_id


def resolved_settings(config: dict) -> dict:
    """A run's settings as it trained: its recorded resolved backends and mesh in place of the asked-for ones.

    A config without a record (a run whose rank 0 has not written config.json yet) has its backends
    resolved here with `BackendConfig.resolve` for its device, which is what its ranks will do.
    """
    out = {k: v for k, v in config.items() if k not in ("resolved_backend", "resolved_mesh")}
    if config.get("resolved_backend"):
        out["backend"] = config["resolved_backend"]
    elif isinstance(config.get("backend"), dict):
        from workbench.backends import BackendConfig  # imports torch: `workbench show` runs without it

        try:
            mesh = config.get("mesh") or {}
            out["backend"] = (
                BackendConfig.from_dict(config["backend"])
                .resolve(config.get("device") or "cpu", world_size=int(mesh.get("ep") or 1))
                .to_dict()
            )
        except (BackendError, TypeError, ValueError):
            pass  # shown as asked for
    if config.get("resolved_mesh"):
        out["mesh"] = config["resolved_mesh"]
    return out


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# Bookkeeping, not settings: where a run lives, and the top-level copies of the mesh's sizes.
# The name leads a label of its own (labels_from_configs).
IGNORED_FOR_LABELS = ("run_id", "name", "output_dir", "train.resume_from", "train.resume_allow_changes", "dp")


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(_show(v) for v in value)
    return str(value)


def labels_from_configs(configs: list[dict], ids: list[str]) -> list[str]:
    """Name each run by the resolved settings that differ between the runs, e.g. "experts=loop · gate=balanced".

    Settings are compared as the runs trained (resolved_settings): "auto" and the backend it
    became are the same setting. A run with nothing different is named by its id.
    """
    flat = [_flatten(resolved_settings(c)) for c in configs]
    keys = sorted({k for f in flat for k in f} - set(IGNORED_FOR_LABELS))
    differing = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]
    short = {k: k.rsplit(".", 1)[-1] for k in differing}
    names = {k: short[k] if list(short.values()).count(short[k]) == 1 else k for k in differing}
    labels = []
    for config, f, run_id in zip(configs, flat, ids):
        name = shown_name(config.get("name"))
        parts = ([name] if name else []) + [f"{names[k]}={_show(f.get(k))}" for k in differing]
        labels.append(" \u00b7 ".join(parts) if parts else run_id)
    if len(set(labels)) < len(labels):  # same settings twice: keep them apart by id
        labels = [f"{label} ({run_id})" for label, run_id in zip(labels, ids)]
    return labels


def run_list_label(summary: dict) -> str:
    """One line of the Compare tab's run list from a `list_runs` summary: name and id, state, model, kind,
    mesh, progress, tokens/s (the run's one figure: workbench.runs.throughput)."""
    mesh = summary.get("mesh")
    who = f"{summary['name']} ({summary['id']})" if summary.get("name") else summary["id"]
    parts = [who, summary.get("state") or "?", str(summary.get("model") or "?")]
    if (summary.get("kind") or {}).get("label"):
        parts.append(summary["kind"]["label"])
    if isinstance(mesh, dict):
        sizes = [f"{k}{v}" for k, v in mesh.items() if isinstance(v, int) and (v > 1 or k == "dp")]
        parts.append("\u00b7".join(sizes))
    if summary.get("step") is not None:
        total = summary.get("total_steps")
        parts.append(f"step {summary['step']}/{total}" if total else f"step {summary['step']}")
    if summary.get("tokens_per_s_per_gpu"):
        parts.append(f"{summary['tokens_per_s_per_gpu']:,.0f} tok/s/GPU")
    return "  \u00b7  ".join(parts)


def compare_frame(runs: list[Any], labels: list[str] | None = None):
    """One DataFrame of every step record of every run, with a `label` column per run."""
    import pandas as pd

    if not runs:
        raise ValueError("give at least one run (a run directory or a Run) to compare")
    loaded = [_config_and_records(r) for r in runs]
    if labels is None:
        labels = labels_from_configs([c for c, _, _ in loaded], [i for _, _, i in loaded])
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    frames = []
    for (config, records, run_id), label in zip(loaded, labels):
        if not records:
            raise ValueError(f"run {run_id} has no step records yet")
        df = pd.DataFrame(records)
        df["label"], df["run_id"], df["kind"] = label, run_id, run_kind(config)["label"]
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def summarize(frame):
    """Per run: its id and kind, steps, tokens/s and TFLOP/s per GPU (the run's one figure: workbench.runs.throughput),
    step time (median over the same steps of the slowest rank's), memory, loss."""
    import pandas as pd

    rows = []
    for label, df in frame.groupby("label", sort=False):
        records = df.to_dict("records")
        throughput = StepThroughput()
        for record in records:
            throughput.add(record)
        window = throughput.window_steps()
        steady = df[df["step"].isin(window)] if window else df
        last = df[df["step"] == df["step"].max()]
        rows.append(
            {
                "run": label,
                "run_id": df["run_id"].iloc[0],
                "kind": df["kind"].iloc[0] if "kind" in df else "",
                "steps": int(df["step"].max()),
                "tokens/s/GPU": throughput.value(),
                "TFLOP/s/GPU": run_throughput(records, "tflops_per_gpu"),
                "step s": steady.groupby("step")["step_time_s"].max().median(),
                "peak GiB": df["mem_peak_gib"].max(),
                "load CV": df["expert_load_cv"].mean() if "expert_load_cv" in df else float("nan"),
                "final loss": last["loss"].mean(),
            }
        )
    return pd.DataFrame(rows).set_index("run")
