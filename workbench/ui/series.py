"""Plot data from step records: pure functions the plot widgets draw and tests check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LIVE_PANELS = {"tokens_per_s_per_gpu": "tokens/s per GPU", "tflops_per_gpu": "TFLOP/s per GPU",
               "mem_peak_gib": "peak memory per rank (GiB)", "loss": "loss"}
PER_RANK = ("tokens_per_s_per_gpu", "tflops_per_gpu", "mem_peak_gib")


def live_series(records: list[dict]) -> dict[str, Any]:
    """Per-rank lines, the loss line and the latest expert-load matrix from step records.

    Returns {"per_rank": {metric: {rank: (steps, values)}}, "loss": (steps, values),
    "eval_loss": (steps, values) of the steps that ran eval (data.eval_every),
    "expert_load": {"step", "z": [layer][expert] load / uniform load, summed over ranks}}.
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
    return {"per_rank": per_rank, "loss": (list(loss_by_step), list(loss_by_step.values())),
            "eval_loss": (list(eval_by_step), list(eval_by_step.values())), "expert_load": load}


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
    from workbench.runs.run_dir import RunDir

    if isinstance(run, (str, Path)):
        rd = RunDir.open(run)
        config = rd.read_config() if rd.config_path.exists() else {}
        return config, rd.read_metrics(), rd.run_id
    df = run.metrics
    return run.config, df.to_dict("records"), run.run_id


def _flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


IGNORED_FOR_LABELS = ("run_id", "output_dir", "train.resume_from", "train.resume_allow_changes")


def labels_from_configs(configs: list[dict], ids: list[str]) -> list[str]:
    """Name each run by the config values that differ between the runs (else by its id)."""
    flat = [_flatten(c) for c in configs]
    keys = sorted({k for f in flat for k in f} - set(IGNORED_FOR_LABELS))
    differing = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]
    labels = []
    for f, run_id in zip(flat, ids):
        parts = [f"{k.split('.', 1)[-1]}={f.get(k)}" for k in differing]
        labels.append(" ".join(parts) if parts else run_id)
    if len(set(labels)) < len(labels):  # same settings twice: keep them apart by id
        labels = [f"{label} ({run_id})" for label, run_id in zip(labels, ids)]
    return labels


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
        df["label"], df["run_id"] = label, run_id
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def summarize(frame):
    """Per run: steps, median tokens/s and TFLOP/s per GPU (first step excluded), step time, memory, loss."""
    import pandas as pd

    rows = []
    for label, df in frame.groupby("label", sort=False):
        steady = df[df["step"] > df["step"].min()] if df["step"].nunique() > 1 else df
        last = df[df["step"] == df["step"].max()]
        rows.append({"run": label, "run_id": df["run_id"].iloc[0], "steps": int(df["step"].max()),
                     "tokens/s/GPU": steady.groupby("step")["tokens_per_s_per_gpu"].mean().median(),
                     "TFLOP/s/GPU": steady.groupby("step")["tflops_per_gpu"].mean().median(),
                     "step s": steady.groupby("step")["step_time_s"].max().median(),
                     "peak GiB": df["mem_peak_gib"].max(),
                     "load CV": df["expert_load_cv"].mean() if "expert_load_cv" in df else float("nan"),
                     "final loss": last["loss"].mean()})
    return pd.DataFrame(rows).set_index("run")
