"""The run plan against measured one-GPU steps (benchmarks/results/plan-vs-measured.json): peak memory within 10%,
step time within 15%, a run measured out of memory planned not to fit; the README's "Plan a run" table is the one
these rows generate."""

from __future__ import annotations

from pathlib import Path

import pytest

from workbench.plan.table import BEGIN, END, MEMORY_BOUND, TIME_BOUND, compare, markdown_table, measured_rows

ROOT = Path(__file__).resolve().parents[1]
ROWS = ROOT / "benchmarks" / "results" / "plan-vs-measured.json"


@pytest.mark.parametrize("row", measured_rows(ROWS), ids=lambda r: f"{r['gpu']}-{r['label']}")
def test_plan_matches_measured_step(row):
    c = compare(row)
    plan = c["plan"]
    if row.get("peak_gib"):
        assert abs(c["peak_ratio"] - 1) <= MEMORY_BOUND, (plan.peak_gib_per_rank, row["peak_gib"], plan.parts)
        assert plan.fits
    else:  # measured out of memory: the plan must refuse it
        assert not plan.fits and plan.peak_gib_per_rank > row["oom_at_gib"], plan.peak_gib_per_rank
    if row.get("tokens_per_s") and row.get("time_checked", True):
        assert abs(c["time_ratio"] - 1) <= TIME_BOUND, (plan.tokens_per_s_per_gpu, row["tokens_per_s"], plan.time_parts)


def test_readme_table_is_generated_from_the_rows():
    text = (ROOT / "README.md").read_text()
    assert BEGIN in text and END in text
    shown = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()
    assert shown == markdown_table(ROWS), (
        "README's plan table is stale: python -m workbench.plan.table benchmarks/results/plan-vs-measured.json "
        "--write README.md"
    )
