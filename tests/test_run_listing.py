"""A run as every reader shows it: its name and kind, and one tokens/s per GPU, the same in `workbench runs`,
`workbench show`, the Studio (Live strip, Compare list and table) and the lab's run summaries."""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.config import RunConfig
from workbench.config_data import DataConfig
from workbench.config_lora import LoraConfig
from workbench.runs.run_dir import RunDir
from workbench.runs.run_index import RunIndex, list_runs
from workbench.runs.run_kind import run_kind
from workbench.runs.throughput import run_throughput

ROOT = Path(__file__).resolve().parents[1]
STEPS, RANKS = 15, 2


def _records() -> list[dict]:
    """Trainer-shaped step records of 2 ranks: a slow first step (warm-up), a slow step 12 (an eval)."""
    rng = random.Random(0)
    records = []
    for step in range(1, STEPS + 1):
        for rank in range(RANKS):
            tps = 50.0 if step == 1 else 400.0 if step == 12 else rng.uniform(900, 1100)
            records.append(
                {
                    "step": step,
                    "rank": rank,
                    "loss": 10.0 / step,
                    "tokens_per_s_per_gpu": tps,
                    "tflops_per_gpu": tps / 1000,
                    "step_time_s": 512 / tps,
                    "mem_peak_gib": 0.5,
                    "mem_kind": "cpu_rss",
                    "time": 1000.0 + step,
                }
            )
    return records


@pytest.fixture
def lora_run(tmp_path: Path) -> Path:
    config = RunConfig.demo(
        name="lr 3e-4, rank 8",
        train__steps=STEPS,
        lora=LoraConfig(rank=8, targets=("attention", "experts")),
        data=DataConfig(
            kind="datasets", data_files=str(tmp_path / "rows.parquet"), eval_fraction=0.1, eval_every=5, seq_len=64
        ),
    ).to_dict()
    run = RunDir.create(tmp_path / "runs", "20261206-060000-aaaa", {**config, "world_size": RANKS})
    run.append_metrics(_records())
    run.write_status("completed", step=STEPS, total_steps=STEPS)
    return run.path


def test_one_tokens_per_s_in_runs_show_and_the_studio(lora_run, capsys):
    from workbench.ui.series import compare_frame, run_list_label, summarize
    from workbench.ui.summary import summarize_live

    records = _records()
    # The definition, computed here by hand: steps 6-15 (the latest 10; step 1 is the warm-up), mean over
    # ranks, then the median: the slow step 12 does not move it.
    per_step = [statistics.fmean(r["tokens_per_s_per_gpu"] for r in records if r["step"] == s) for s in range(6, 16)]
    expected = statistics.median(per_step)
    assert run_throughput(records) == pytest.approx(expected)

    assert main(["runs", str(lora_run.parent)]) == 0
    runs_out = capsys.readouterr().out
    assert main(["show", str(lora_run)]) == 0
    show_out = capsys.readouterr().out
    shown = f"{expected:,.0f}"
    [row] = [line for line in runs_out.splitlines() if line.startswith(lora_run.name)]
    assert f" {shown} " in row, runs_out
    assert f"tokens/s/gpu  {shown} (median of steps 6-15; step 1, the warm-up, left out)" in show_out, show_out

    [summary] = list_runs(lora_run.parent)  # what the lab's server sends, and the Compare list reads
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(expected)
    assert summary["tokens_per_s_steps"] == list(range(6, 16))
    assert f"{shown} tok/s/GPU" in run_list_label(summary)
    lab = RunIndex().list_runs(lora_run.parent)[0]  # the server's incremental index: the same figure
    assert lab["tokens_per_s_per_gpu"] == pytest.approx(expected) and lab["kind"] == summary["kind"]
    assert summarize_live(records, STEPS).tokens_per_s_per_gpu == pytest.approx(expected)  # the Live strip
    table = summarize(compare_frame([lora_run]))  # the Compare table
    assert table["tokens/s/GPU"].iloc[0] == pytest.approx(expected)


def test_runs_and_show_name_the_run_and_its_kind(lora_run, capsys):
    assert main(["runs", str(lora_run.parent)]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:2] == ["RUN", "NAME"] and "KIND" in header.split()
    kind = "LoRA r=8 attention+experts \u00b7 rows.parquet \u00b7 eval every 5 steps on 10% held out"
    assert "lr 3e-4, rank 8" in row and row.rstrip().endswith(kind), row
    assert main(["show", str(lora_run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == ["  name          lr 3e-4, rank 8", f"  kind          {kind}"]


def test_run_kind_names_full_runs_their_data_and_no_eval():
    full = RunConfig.demo().to_dict()
    assert run_kind(full)["label"] == "full \u00b7 tiny_sft.jsonl (shipped)"
    synthetic = {**full, "data": {**full["data"], "kind": "synthetic"}}
    assert run_kind(synthetic) | {"label": None} == {
        "training": "full",
        "lora_rank": None,
        "lora_targets": None,
        "data": "synthetic",
        "eval": None,
        "label": None,
    }
    assert run_kind({})["label"] == "full \u00b7 ?"  # an old or hand-made config.json: no error


def test_a_closed_pipe_ends_runs_and_show_quietly(lora_run):
    """`workbench show RUN | head` closes the pipe early: no BrokenPipeError traceback (`python -m workbench.bench`
    too)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for module, *args in (
        ["workbench.cli", "runs", str(lora_run.parent)],
        ["workbench.cli", "show", str(lora_run)],
        ["workbench.bench", "--history-table", "--results-dir", str(lora_run.parent)],
    ):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first write: every write fails with EPIPE
        proc = subprocess.run([sys.executable, "-m", module, *args], stdout=write_end, stderr=subprocess.PIPE, env=env)
        os.close(write_end)
        assert proc.stderr == b"", proc.stderr.decode()
        assert proc.returncode == 1


def test_the_studio_names_the_run_in_its_headers_compare_list_legend_and_table(lora_run):
    from workbench.cluster.run import Run
    from workbench.ui.plots import CompareRuns, LivePlots
    from workbench.ui.series import run_list_label
    from workbench.ui.summary import ProgressLine, SummaryStrip

    run = Run.from_dir(lora_run)
    kind = "LoRA r=8 attention+experts \u00b7 rows.parquet \u00b7 eval every 5 steps on 10% held out"
    live = LivePlots(run)
    assert "<b class='mwb-run-name'>lr 3e-4, rank 8</b>" in live.title.value and lora_run.name in live.title.value
    assert kind in live.title.value
    progress = ProgressLine(run)
    assert f"lr 3e-4, rank 8 ({lora_run.name}) \u00b7 {kind}: completed at step {STEPS}/{STEPS}" in (
        progress.label.value
    )
    strip = SummaryStrip()
    strip.attach(run)
    [summary] = list_runs(lora_run.parent)
    assert run_list_label(summary).startswith(f"lr 3e-4, rank 8 ({lora_run.name})  \u00b7  completed")
    compare = CompareRuns(runs_dir=lora_run.parent)
    assert [label for label, _ in compare.picker.options] == [run_list_label(summary)]
    table = compare.set_runs([lora_run])
    assert list(table.index) == ["lr 3e-4, rank 8"]  # the legend's and the table's label: the run's name
    assert table["kind"].iloc[0] == kind and table["run_id"].iloc[0] == lora_run.name
    assert {trace.name for trace in compare.figure.data} == {"lr 3e-4, rank 8"}
    assert strip.summary.tokens_per_s_per_gpu == pytest.approx(table["tokens/s/GPU"].iloc[0])


def test_the_terminal_bar_is_labelled_with_the_runs_name():
    from workbench.ui.terminal_progress import bar_label

    assert bar_label({"run_id": "20261206-060000-aaaa", "config": {"name": "lr 3e-4, rank 8"}}) == "lr 3e-4, rank 8"
    assert bar_label({"run_id": "20261206-060000-aaaa", "config": {"name": None}}) == "20261206-060000-aaaa"
    assert bar_label({"run_id": "x", "config": {"name": "n" * 60}}) == "n" * 37 + "..."
