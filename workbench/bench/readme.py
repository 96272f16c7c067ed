"""The README's latest-result-per-setup table and benchmarks/HISTORY.md's dated table.

Both are built from `benchmarks/results/*.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.bench.report import SCHEMAS, reference_anchor

BEGIN = "<!-- bench-table -->"
END = "<!-- /bench-table -->"
HEADLINE = "engine"  # the native router in the default precision: the row a setup is quoted by
LIGER = "anchor_liger"
_STEP = {"workbench.bench/1": "bench loop", "workbench.bench/2": "Trainer.train_step"}

LATEST_HEADER = (
    "| GPUs | model | layers | seq x batch | variant | tokens/s/GPU median (p10-p90) | vs anchor | vs anchor_liger "
    "| TFLOP/s/GPU | peak GiB | memory vs anchor | SM MHz (power-capped) | timed | date | results |\n"
    "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"
)
HISTORY_HEADER = (
    "| date | GPUs | model | layers | seq x batch | engine (gate) | anchor | anchor tokens/s/GPU | "
    "engine tokens/s/GPU (p10-p90) | speedup | anchor TFLOP/s/GPU | engine TFLOP/s/GPU | anchor peak GiB | "
    "engine peak GiB | memory | timed | results |\n"
    "|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
)


def load_results(results_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every results file of a known schema in `results_dir`, oldest first."""
    out = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a readable results file: {err}") from err
        if isinstance(data, dict) and data.get("schema") in SCHEMAS:
            out.append((path, data))
    return sorted(out, key=lambda item: (item[1].get("date", ""), item[0].name))


def _gpus(data: dict[str, Any]) -> str:
    dev = data["device"]
    return f"{dev['count']} x {dev['name'].replace('NVIDIA ', '')}"


def _config(data: dict[str, Any]) -> tuple[int, int, int | str]:
    cfg = data.get("config", {})
    layers = data.get("model", {}).get("layers", cfg.get("layers"))
    # several micro-batches a step are another setup (the optimizer's pass shared among them), and say so
    accumulation = cfg.get("accumulation", 1)
    batch = cfg.get("batch") if accumulation == 1 else f"{cfg.get('batch')}, {accumulation} micro-batches a step"
    return layers, cfg.get("seq"), batch


def setup_key(data: dict[str, Any]) -> tuple:
    """What makes two launches the same setup: device, model, layers, seq x batch."""
    dev = data["device"]
    return (dev["type"], dev["name"], dev["count"], data.get("model", {}).get("preset", ""), *_config(data))


def _spread(row: dict[str, Any]) -> str:
    median = f"{row['tokens_per_s_per_gpu']:,.0f}"
    if "tokens_per_s_per_gpu_p10" not in row:
        return median
    return f"{median} ({row['tokens_per_s_per_gpu_p10']:,.0f}-{row['tokens_per_s_per_gpu_p90']:,.0f})"


def _ratio(num: float | None, den: float | None, bold: bool = False) -> str:
    if not num or not den:
        return "n/a"
    text = f"{num / den:.2f}x"
    return f"**{text}**" if bold else text


def _clock(row: dict[str, Any]) -> str:
    """Mean SM clock of the row's timed steps and the share of samples the power cap held ('n/a': not sampled)."""
    c = row.get("gpu_clocks")
    if not c:
        return "n/a"
    return f"{c['sm_clock_mhz_mean']:,.0f} ({100 * c['power_capped_share']:.0f}%)"


def _latest_rows(path: Path, data: dict[str, Any]) -> list[str]:
    ok = [r for r in data["variants"] if r.get("status") == "ok"]
    # files older than the reference field: the same rule, applied now
    ref_name = (data.get("reference_anchor") or reference_anchor(data["variants"]) or {}).get("variant")
    ref = next((r for r in ok if r["name"] == ref_name), None)
    liger = next((r for r in ok if r["name"] == LIGER), None)
    # anchors first (the reference first), then the headline engine row, then the other engine rows
    ok.sort(key=lambda r: (r["kind"] != "anchor", r["name"] != ref_name, r["name"] != HEADLINE))
    gpus, model = _gpus(data), data.get("model", {}).get("preset", "")
    layers, seq, batch = _config(data)
    out = []
    for r in ok:
        name = r["name"] + (" (balanced gate)" if r.get("gate") == "balanced" else "")
        headline = r["name"] == HEADLINE
        if headline:
            name = f"**{name}**"
        anchor_mem = ref["peak_mem_gib"] if ref else None
        out.append(
            f"| {gpus} | {model} | {layers} | {seq} x {batch} | {name} | {_spread(r)} | "
            f"{_ratio(r['tokens_per_s_per_gpu'], ref and ref['tokens_per_s_per_gpu'], headline)} | "
            f"{_ratio(r['tokens_per_s_per_gpu'], liger and liger['tokens_per_s_per_gpu'], headline)} | "
            f"{r['tflops_per_gpu']:.0f} | {r['peak_mem_gib']:.1f} | {_ratio(r['peak_mem_gib'], anchor_mem)} | "
            f"{_clock(r)} | {_STEP[data['schema']]} | {data['date'][:10]} | "
            f"[{path.name}](benchmarks/results/{path.name}) |"
        )
    return out


def table(results_dir: Path, include_cpu: bool = False) -> str:
    """The README table: for each setup (device, model, layers, seq x batch) its latest launch with an engine
    row, every row that ran against that launch's own anchors. The native-router engine row is the headline (bold);
    balanced-gate rows stand beside it, labelled, never as the headline."""
    latest: dict[tuple, tuple[Path, dict[str, Any]]] = {}
    quoted: dict[tuple, tuple[Path, dict[str, Any]]] = {}  # the latest launch with a headline row, per setup
    for path, data in load_results(results_dir):  # oldest first: the last one per setup wins
        if data["device"]["type"] == "cpu" and not include_cpu:
            continue
        latest[setup_key(data)] = (path, data)
        if any(r.get("name") == HEADLINE and r.get("status") == "ok" for r in data.get("variants", [])):
            quoted[setup_key(data)] = (path, data)
    # A launch of other rows only (a memory variant beside its anchor) does not push the headline out: it
    # stands in benchmarks/HISTORY.md
    latest.update(quoted)
    lines = [LATEST_HEADER]
    for key in sorted(latest, key=lambda k: tuple(str(x) for x in k)):
        lines.extend(_latest_rows(*latest[key]))
    if len(lines) == 1:
        lines.append("| (no GPU results yet: run benchmarks/suites/readme_tables.sh on a GPU) |" + " |" * 13)
    return "\n".join(lines)


def history_table(results_dir: Path, include_cpu: bool = False, link_base: str = "results") -> str:
    """benchmarks/HISTORY.md's table: every launch, newest first, each engine row against its reference anchor."""
    lines = [HISTORY_HEADER]
    for path, data in reversed(load_results(results_dir)):
        if data["device"]["type"] == "cpu" and not include_cpu:
            continue
        rows = {r["name"]: r for r in data["variants"]}
        for c in data["comparisons"]:
            if not c.get("reference", True):
                continue
            a, e = c["anchor"], c["engine"]
            mem = f"{c['mem_ratio']:.2f}x" if c.get("mem_ratio") is not None else "n/a"
            lines.append(
                f"| {data['date'][:10]} | {_gpus(data)} | {data.get('model', {}).get('preset', '')} | {c['layers']} | "
                f"{c['seq']} x {c['batch']} | {e['variant']} ({c['gate']}) | {a['variant']} | "
                f"{a['tokens_per_s_per_gpu']:,.0f} | {_spread(rows.get(e['variant'], e))} | **{c['ratio']:.2f}x** | "
                f"{a['tflops_per_gpu']:.0f} | {e['tflops_per_gpu']:.0f} | {a['peak_mem_gib']:.1f} | "
                f"{e['peak_mem_gib']:.1f} | {mem} | {_STEP[data['schema']]} | [{path.name}]({link_base}/{path.name}) |"
            )
    if len(lines) == 1:
        lines.append("| (no GPU results yet) |" + " |" * 16)
    return "\n".join(lines)


def replace_section(text: str, new_table: str) -> str:
    """`text` with everything between the bench-table markers replaced by `new_table`."""
    start = text.find(BEGIN)
    if start < 0:
        raise ValueError(f"no {BEGIN} marker found; put {BEGIN} and {END} on their own lines where the table belongs")
    body_start = start + len(BEGIN)
    end = text.find(END, body_start)
    if end < 0:
        end = text.find(BEGIN, body_start)  # a second opening marker also closes the section
    if end < 0:
        raise ValueError(f"{BEGIN} has no closing {END} marker after it; add one after the table")
    return text[:body_start] + "\n" + new_table + "\n" + text[end:]


def write_readme(readme: Path, results_dir: Path, include_cpu: bool = False, history: bool = False) -> str:
    """Rewrite the table section of `readme` (README.md, or HISTORY.md with history=True) in place; the table."""
    new_table = (history_table if history else table)(results_dir, include_cpu)
    readme = Path(readme)
    readme.write_text(replace_section(readme.read_text(encoding="utf-8"), new_table), encoding="utf-8")
    return new_table
