"""The results record of a launch: environment, per-variant rows, anchor/engine comparisons, table."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from workbench.bench.config import VARIANTS
from workbench.bench.plot import write_html
from workbench.params import num_experts

# /2: every variant timed through workbench.train.loop.Trainer.train_step, in alternating rounds, with
# p10/p90; /1: the bench's own training loop (still read by the README and history tables).
SCHEMA = "workbench.bench/2"
SCHEMAS = ("workbench.bench/1", SCHEMA)
METRICS = ("tokens_per_s_per_gpu", "tflops_per_gpu", "peak_mem_gib")
SAME_INIT_RTOL = 1e-6


def _version(dist_name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """torch, transformers, triton, NCCL, CUDA, cuDNN, Python and workbench versions."""
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "nccl": nccl,
        "cuda": torch.version.cuda,
        "cudnn": str(cudnn) if cudnn else None,
        "python": platform.python_version(),
        "workbench": _version("moe-workbench"),
    }


def git_commit() -> dict[str, Any]:
    """$WORKBENCH_GIT_COMMIT when set (a copied tree may carry a stale .git), else the checkout's."""
    import os

    if os.environ.get("WORKBENCH_GIT_COMMIT"):
        return {"commit": os.environ["WORKBENCH_GIT_COMMIT"], "dirty": None, "source": "WORKBENCH_GIT_COMMIT"}
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = (
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            != ""
        )
    except (OSError, subprocess.SubprocessError):
        sha, dirty = "", None
    if not sha:
        sha, dirty = os.environ.get("WORKBENCH_GIT_COMMIT", "unknown"), None
    return {"commit": sha, "dirty": dirty}


def device_info(device: torch.device, world: int) -> dict[str, Any]:
    """Which accelerator ran it, and how many ranks (on CPU: rank 0's intra-op threads too)."""
    if device.type == "cuda":
        return {"type": device.type, "name": torch.cuda.get_device_name(device), "count": world}
    return {
        "type": device.type,
        "name": platform.processor() or "cpu",
        "count": world,
        "threads": torch.get_num_threads(),
    }


def device_slug(info: dict[str, Any]) -> str:
    """Short file-name form: '2xh200', '2xcpu'."""
    name = (
        "cpu" if info["type"] == "cpu" else re.sub(r"^nvidia-?", "", re.sub(r"[^a-z0-9]+", "-", info["name"].lower()))
    )
    return f"{info['count']}x{name.strip('-') or info['type']}"


SPREAD = ("tokens_per_s_per_gpu_p10", "tokens_per_s_per_gpu_p90", "p10_step_s", "p90_step_s")


def _side(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "variant": row["name"],
        **{k: row[k] for k in METRICS},
        "mem_kind": row["mem_kind"],
        "median_step_s": row["median_step_s"],
        **{k: row[k] for k in SPREAD if k in row},
    }


REFERENCE_RULE = (
    "the best ok anchor row of plain Transformers: the fastest anchor variant that ran without "
    "Liger kernels (tokens/s per GPU); anchor_liger is compared beside it"
)


def _is_liger(row: dict[str, Any]) -> bool:
    spec = VARIANTS.get(row.get("name"))
    return spec is not None and spec.liger


def reference_anchor(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The anchor row the speedups are computed against, with its setup and the anchors that did not run."""
    anchors = [r for r in rows if r.get("kind") == "anchor"]
    ok = [r for r in anchors if r.get("status") == "ok"]
    if not ok:
        return None
    best = max(
        [r for r in ok if not _is_liger(r)] or ok, key=lambda r: r["tokens_per_s_per_gpu"]
    )  # max keeps the first of equals: registry order
    return {
        "variant": best["name"],
        "rule": REFERENCE_RULE,
        "setup": best.get("setup", {}),
        **{k: best[k] for k in METRICS},
        "not_run": [
            {"variant": r["name"], "status": r["status"], "reason": r.get("reason", "")}
            for r in anchors
            if r.get("status") != "ok"
        ],
    }


def comparisons(rows: list[dict[str, Any]], world: int, layers: int, seq: int, batch: int) -> list[dict[str, Any]]:
    """Each engine variant against each anchor variant that ran (the reference anchor first)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    reference = reference_anchor(rows)
    ref_name = reference["variant"] if reference is not None else None
    anchors = sorted(
        (r for r in ok if r["kind"] == "anchor"), key=lambda r: (r["name"] != ref_name, r["name"] != "anchor")
    )
    out = []
    for engine in (r for r in ok if r["kind"] == "engine"):
        for anchor in anchors:
            # the Trainer's global loss (CE + coef x aux) per step; the Trainer computes the aux loss of
            # either model as a global-batch statistic (models/router_aux.forward_loss_parts), so
            # on several ranks too both parts compare
            n = min(len(anchor["loss"]), len(engine["loss"]))
            diffs = [abs(a - b) for a, b in zip(anchor["loss"][:n], engine["loss"][:n])]
            fa, fe = anchor.get("init_fingerprint"), engine.get("init_fingerprint")
            same_init = fa is not None and fe is not None and abs(fa - fe) <= SAME_INIT_RTOL * max(1.0, abs(fa))
            out.append(
                {
                    "world": world,
                    "layers": layers,
                    "seq": seq,
                    "batch": batch,
                    "gate": engine["gate"],
                    "anchor": _side(anchor),
                    "engine": _side(engine),
                    "reference": anchor["name"] == ref_name,
                    "ratio": engine["tokens_per_s_per_gpu"] / anchor["tokens_per_s_per_gpu"],
                    "tflops_ratio": engine["tflops_per_gpu"] / anchor["tflops_per_gpu"]
                    if anchor["tflops_per_gpu"]
                    else None,
                    "mem_ratio": engine["peak_mem_gib"] / anchor["peak_mem_gib"] if anchor["peak_mem_gib"] else None,
                    "same_init": same_init,
                    "loss_step0_abs_diff": diffs[0] if diffs else None,
                    "loss_max_abs_diff": max(diffs) if diffs else None,
                }
            )
    return out


def build_result(
    cfg,
    rows,
    *,
    hf_config,
    world: int,
    device: torch.device,
    mesh,
    dtype: torch.dtype,
    started: float,
    flops_per_token: float,
    order: list[str] | None = None,
) -> dict[str, Any]:
    """The whole JSON record of one launch."""
    # the trainer's FLOP count (train.metrics imports the trainer): --readme-table and --html read results without it
    from workbench.bench.floor import step_floor

    layers = hf_config.num_hidden_layers
    info = device_info(device, world)
    return {
        "schema": SCHEMA,
        "date": _dt.datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds"),
        "device": info,
        "versions": versions(),
        "git": git_commit(),
        "command": cfg.command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "config": {**cfg.to_dict(), "layers": layers, "dtype": str(dtype), "engine_mesh": mesh.to_dict()},
        "model": {
            "preset": cfg.preset,
            "model_type": hf_config.model_type,
            "layers": layers,
            "hidden": hf_config.hidden_size,
            "experts": num_experts(hf_config),
            "top_k": hf_config.num_experts_per_tok,
            "vocab": hf_config.vocab_size,
            "flops_per_token": flops_per_token,
            "floor": step_floor(hf_config, cfg.seq, cfg.batch * cfg.accumulation, world),
        },
        "variants": rows,
        # the variants in the order they ran, one entry per round (ABC CBA ...)
        "order": list(order or []),
        "reference_anchor": reference_anchor(rows),
        "comparisons": comparisons(rows, world, layers, cfg.seq, cfg.batch),
    }


def clock_lines(variants: list[dict[str, Any]]) -> list[str]:
    """Each ok row's SM clock and power over its timed steps (rank 0's GPU), or why they were not sampled."""
    lines = []
    for r in variants:
        if r["status"] != "ok":
            continue
        c = r.get("gpu_clocks")
        if c is None:
            if r.get("gpu_clocks_unavailable"):
                lines.append(f"gpu clocks {r['name']}: not sampled ({r['gpu_clocks_unavailable']})")
            continue
        limit = f" of {c['power_limit_w']:.0f} W" if c.get("power_limit_w") else ""
        top = f" (max {c['sm_clock_mhz_max']})" if c.get("sm_clock_mhz_max") else ""
        lines.append(
            f"gpu clocks {r['name']}: SM {c['sm_clock_mhz_mean']:,.0f} MHz mean, {c['sm_clock_mhz_min']:,} min{top}; "
            f"{c['power_w_mean']:.0f} W{limit}; power cap held the clock in {100 * c['power_capped_share']:.0f}% "
            f"of {c['samples']} samples, heat in {100 * c['thermal_share']:.0f}%"
            + (f"; {c['energy_j_per_step']:.1f} J a step" if c.get("energy_j_per_step") is not None else "")
        )
    return lines


def format_table(result: dict[str, Any]) -> str:
    """Plain-text table of every variant, then the engine/anchor ratios."""
    ref_name = (result.get("reference_anchor") or {}).get("variant")
    lines = [
        f"{'variant':<18} {'status':<8} {'tokens/s/gpu':>13} {'p10-p90':>15} {'TFLOP/s/gpu':>12} {'peak GiB':>9} "
        f"{'step ms':>9} {'fwd/bwd/opt ms':>18} {'loss[0]':>9} {'loss[-1]':>9}"
    ]
    for r in result["variants"]:
        if r["status"] != "ok":
            lines.append(f"{r['name']:<18} {r['status']:<8} {r.get('reason', '')}")
            continue
        phases = "/".join(f"{r[k] * 1e3:.0f}" for k in ("median_forward_s", "median_backward_s", "median_optimizer_s"))
        spread = f"{r['tokens_per_s_per_gpu_p10']:,.0f}-{r['tokens_per_s_per_gpu_p90']:,.0f}"
        lines.append(
            f"{r['name']:<18} {'ok':<8} {r['tokens_per_s_per_gpu']:>13,.0f} {spread:>15} {r['tflops_per_gpu']:>12.2f} "
            f"{r['peak_mem_gib']:>9.2f} {r['median_step_s'] * 1e3:>9.1f} {phases:>18} "
            f"{r['loss'][0]:>9.4f} {r['loss'][-1]:>9.4f}" + ("  <- reference anchor" if r["name"] == ref_name else "")
        )
    ref = result.get("reference_anchor")
    if ref is not None:
        setup = ref["setup"]
        lines.append(
            f"reference anchor ({ref['rule']}): {ref['variant']}: attention {setup.get('attention')}, "
            f"experts {setup.get('experts_implementation')}, {ref['tokens_per_s_per_gpu']:,.0f} tokens/s/gpu"
        )
        for r in ref["not_run"]:
            lines.append(f"  anchor {r['variant']} {r['status']}: {r['reason']}")
    for c in result["comparisons"]:
        mem = f"{c['mem_ratio']:.2f}" if c["mem_ratio"] is not None else "n/a"
        lines.append(
            f"{c['engine']['variant']} / {c['anchor']['variant']}: {c['ratio']:.2f}x tokens/s, "
            f"{mem}x peak memory, same init {c['same_init']}, "
            f"|loss diff| step0 {c['loss_step0_abs_diff']:.2e} max {c['loss_max_abs_diff']:.2e}"
            + (" (reference anchor)" if c.get("reference") else "")
        )
    lines += clock_lines(result["variants"])
    if result.get("order"):
        lines.append("run order (alternating rounds): " + " ".join(result["order"]))
    mem_kind = next((r["mem_kind"] for r in result["variants"] if r["status"] == "ok"), None)
    if mem_kind == "cpu_rss":
        lines.append("peak memory on CPU is the process's peak RSS over its lifetime (not per variant)")
    return "\n".join(lines)


def _free_stem(out_dir: Path, stem: str) -> str:
    candidate, n = stem, 2
    while (out_dir / f"{candidate}.json").exists():
        candidate, n = f"{stem}-{n}", n + 1
    return candidate


def write_result(result: dict[str, Any], out_dir: Path, name: str | None = None, html: bool = True) -> dict[str, Path]:
    """Write `<out_dir>/<date>-<device>.json` (never overwriting) and its HTML plot if plotly is here."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = name or f"{result['date'][:10]}-{device_slug(result['device'])}"
    stem = _free_stem(out_dir, stem)
    paths = {"json": out_dir / f"{stem}.json"}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if html:
        written = write_html(result, out_dir / f"{stem}.html")
        if written is not None:
            paths["html"] = written
    return paths
