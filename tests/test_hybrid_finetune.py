"""`workbench finetune` with the tiny Nemotron-H preset (Mamba2, MoE and attention layers), as a user runs it: one
process, a few steps on the shipped SFT rows, the run directory written; and multi-token prediction's loss refused
on the command line before any work (exit code 2, one line)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_cli import _workbench

from workbench.config import ModelConfig, RunConfig


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "cfg.yaml"
    RunConfig.demo(
        model=ModelConfig(preset="tiny-nemotron-h"),
        data__seq_len=64,
        train__global_batch_size=2,
        train__local_batch_size=2,
        train__save_final_checkpoint=False,
    ).to_yaml(cfg)
    return cfg


@pytest.mark.slow
def test_finetune_runs_the_tiny_nemotron_h_preset(tmp_path):
    proc = _workbench(["finetune", str(_config(tmp_path)), "--steps", "3", "--run-id", "hybrid"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "hybrid"
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["preset"] == "tiny-nemotron-h"
    assert saved["resolved_backend"]["mixer"] == "chunked"  # the engine's Mamba2 scan, not Transformers' fallback
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and r.get("step")]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in steps), steps
    assert "run completed" in proc.stdout and "tiny-nemotron-h" in proc.stdout


@pytest.mark.slow
def test_finetune_refuses_mtp_loss_weight_before_any_work(tmp_path):
    proc = _workbench(
        ["finetune", str(_config(tmp_path)), "--run-id", "mtp", "--set", "train.mtp_loss_weight=0.3"], tmp_path
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.mtp_loss_weight=0.3 needs a model with MTP layers" in lines[0], proc.stderr
    assert "set train.mtp_loss_weight to 0" in lines[0]
    assert not (tmp_path / "mtp").exists()  # refused before the run directory
