"""The README performance table, generated from every `benchmarks/results/*.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.bench.report import SCHEMA

BEGIN = "<!-- bench-table -->"
END = "<!-- /bench-table -->"

HEADER = ("| date | GPUs | model | layers | seq x batch | engine (gate) | anchor | anchor tokens/s/GPU | engine tokens/s/GPU | "
          "speedup | anchor TFLOP/s/GPU | engine TFLOP/s/GPU | anchor peak GiB | engine peak GiB | memory | results |\n"
          "|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def load_results(results_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every results file of this schema in `results_dir`, oldest first."""
    out = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a readable results file: {err}") from err
        if isinstance(data, dict) and data.get("schema") == SCHEMA:
            out.append((path, data))
    return sorted(out, key=lambda item: (item[1].get("date", ""), item[0].name))


def table(results_dir: Path, include_cpu: bool = False, link_base: str = "benchmarks/results") -> str:
    """Markdown table: each engine variant against its launch's reference anchor (the best ok anchor row),
    for every results file (CPU runs left out unless asked); files older than the reference field keep every row.
    """
    lines = [HEADER]
    for path, data in load_results(results_dir):
        dev = data["device"]
        if dev["type"] == "cpu" and not include_cpu:
            continue
        gpus = f"{dev['count']} x {dev['name'].replace('NVIDIA ', '')}"
        model = data.get("model", {}).get("preset", "")
        for c in data["comparisons"]:
            if not c.get("reference", True):
                continue
            a, e = c["anchor"], c["engine"]
            mem = f"{c['mem_ratio']:.2f}x" if c.get("mem_ratio") is not None else "n/a"
            lines.append(
                f"| {data['date'][:10]} | {gpus} | {model} | {c['layers']} | {c['seq']} x {c['batch']} | {e['variant']} ({c['gate']}) | "
                f"{a['variant']} | {a['tokens_per_s_per_gpu']:,.0f} | {e['tokens_per_s_per_gpu']:,.0f} | "
                f"**{c['ratio']:.2f}x** | {a['tflops_per_gpu']:.0f} | {e['tflops_per_gpu']:.0f} | "
                f"{a['peak_mem_gib']:.1f} | {e['peak_mem_gib']:.1f} | {mem} | [{path.name}]({link_base}/{path.name}) |")
    if len(lines) == 1:
        lines.append("| (no GPU results yet: run `bash benchmarks/gpu_run.sh` on the GPUs) |" + " |" * 15)
    return "\n".join(lines)


def replace_section(text: str, new_table: str) -> str:
    """`text` with everything between the bench-table markers replaced by `new_table`."""
    start = text.find(BEGIN)
    if start < 0:
        raise ValueError(f"no {BEGIN} marker found; put {BEGIN} and {END} on their own lines where the "
                         "table belongs")
    body_start = start + len(BEGIN)
    end = text.find(END, body_start)
    if end < 0:
        end = text.find(BEGIN, body_start)  # a second opening marker also closes the section
    if end < 0:
        raise ValueError(f"{BEGIN} has no closing {END} marker after it; add one after the table")
    return text[:body_start] + "\n" + new_table + "\n" + text[end:]


def write_readme(readme: Path, results_dir: Path, include_cpu: bool = False) -> str:
    """Rewrite the table section of `readme` in place; returns the table."""
    new_table = table(results_dir, include_cpu)
    readme = Path(readme)
    readme.write_text(replace_section(readme.read_text(encoding="utf-8"), new_table), encoding="utf-8")
    return new_table
