"""The plan against measured steps: a RunConfig per measured row, the plan's peak and tokens/s beside the
measurement, and the README's "Plan a run" table generated from them (tests/test_plan_measured.py checks the same
rows against the bounds).

    python -m workbench.plan.table benchmarks/results/plan-vs-measured.json [--write README.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from workbench.config import RunConfig
from workbench.plan.run_plan import plan_run

BEGIN = "<!-- plan-table -->"
END = "<!-- /plan-table -->"
MEMORY_BOUND = 0.10  # the plan's peak within 10% of the measured one
TIME_BOUND = 0.15  # its step time within 15% (the one-GPU rows; a row may say its time is not comparable)


def measured_rows(path: Path) -> list[dict[str, Any]]:
    return json.loads(Path(path).read_text())["rows"]


def row_config(row: dict[str, Any]) -> RunConfig:
    """The RunConfig a measured row ran: the preset at its depth in bf16, synthetic data, one sequence batch, the
    fused cross-entropy the bench and the trainer ran with, and the row's own settings."""
    base = RunConfig.from_dict(
        {
            "model": {"preset": row["preset"], "layers": row["layers"], "dtype": "bfloat16"},
            "data": {"kind": "synthetic", "seq_len": row["seq"]},
            "train": {"local_batch_size": row["batch"], "global_batch_size": row["batch"] * row.get("gpus", 1)},
            "backend": {"fused_ce": True},
        }
    )
    return base.with_overrides(row["set"])


def compare(row: dict[str, Any]) -> dict[str, Any]:
    """The plan of a row beside its measurement: peaks, tokens/s, their ratios (None where not measured)."""
    # the datasheet's figures, whatever this machine calibrated: the table and its test are the same everywhere
    plan = plan_run(row_config(row), gpus=row.get("gpus", 1), gpu=row["gpu"], with_options=False, use_calibration=False)
    peak, speed = row.get("peak_gib"), row.get("tokens_per_s")
    return {
        "row": row,
        "plan": plan,
        "peak_ratio": plan.peak_gib_per_rank / peak if peak else None,
        "time_ratio": speed / plan.tokens_per_s_per_gpu if speed else None,  # predicted step / measured step
    }


def _pct(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{(ratio - 1) * 100:+.1f}%"


def markdown_table(path: Path) -> str:
    lines = [
        "| GPU | run | measured peak GiB | plan GiB | off | measured tokens/s | plan tokens/s | step off | plan fits |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in map(compare, measured_rows(path)):
        row, plan = c["row"], c["plan"]
        measured = f"{row['peak_gib']:.1f}" if row.get("peak_gib") else f"OOM at {row['oom_at_gib']:.1f}+"
        speed = f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") else "n/a"
        # a row whose step the test does not hold to the plan says why in a word or two (`time_note`)
        step = _pct(c["time_ratio"]) + (
            "" if row.get("time_checked", True) else f" ({row.get('time_note', 'older code')})"
        )
        lines.append(
            f"| {row.get('gpus', 1)} x {row['gpu'].upper()} | {row['label']} | {measured} | "
            f"{plan.peak_gib_per_rank:.1f} | "
            f"{_pct(c['peak_ratio'])} | {speed} | {plan.tokens_per_s_per_gpu:,.0f} | {step} | "
            f"{'yes' if plan.fits else 'no'} |"
        )
    return "\n".join(lines)


def replace_section(text: str, table: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"put {BEGIN} and {END} on their own lines where the table belongs")
    return text[: start + len(BEGIN)] + "\n" + table + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the plan against measured steps, as a markdown table")
    parser.add_argument("rows", type=Path, help="plan-vs-measured.json")
    parser.add_argument("--write", type=Path, help="a README to rewrite between the plan-table markers")
    args = parser.parse_args(argv)
    table = markdown_table(args.rows)
    if args.write:
        args.write.write_text(replace_section(args.write.read_text(), table))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
