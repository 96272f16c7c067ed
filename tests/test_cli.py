"""The `workbench` command end to end, as a user runs it (subprocesses)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.config import RunConfig
from workbench.train.run_dir import list_runs

ROOT = Path(__file__).resolve().parents[1]


def _workbench(args, runs_dir, timeout=150):
    env = {**os.environ, "WORKBENCH_RUNS_DIR": str(runs_dir), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_demo_on_two_cpu_ranks_writes_a_run_in_under_two_minutes(tmp_path):
    start = time.monotonic()
    proc = _workbench(["demo", "--steps", "8", "--ranks", "2"], tmp_path)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "leaked semaphore" not in proc.stderr, proc.stderr  # the ranks release what they made
    assert elapsed < 120, elapsed
    step_lines = [l for l in proc.stdout.splitlines() if l.startswith("step ")]
    assert len(step_lines) == 8 and "tokens/s/gpu" in step_lines[0]
    runs = list_runs(tmp_path)
    assert len(runs) == 1 and runs[0]["state"] == "completed" and runs[0]["world_size"] == 2
    metrics = [json.loads(l) for l in Path(runs[0]["path"], "metrics.jsonl").read_text().splitlines()]
    assert sorted((m["rank"], m["step"]) for m in metrics) == [(r, s) for r in (0, 1) for s in range(1, 9)]
    losses = [m["loss"] for m in metrics if m["rank"] == 0]
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_finetune_from_yaml_with_overrides(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    RunConfig.demo(data__seq_len=64, train__global_batch_size=4, train__local_batch_size=2).to_yaml(cfg)
    proc = _workbench(["finetune", str(cfg), "--steps", "2", "--run-id", "yamlrun", "--set", "train.lr=0.001"],
                      tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = tmp_path / "yamlrun"
    saved = json.loads((run / "config.json").read_text())
    assert saved["train"]["steps"] == 2 and saved["train"]["lr"] == 0.001
    assert json.loads((run / "status.json").read_text())["state"] == "completed"
    assert "run completed" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "nproc-per-node"])
def test_finetune_under_torchrun_on_two_ranks(tmp_path, launcher):
    cfg = tmp_path / "cfg.yaml"
    RunConfig.demo(data__seq_len=64, train__global_batch_size=4, train__local_batch_size=2).to_yaml(cfg)
    env = {**os.environ, "WORKBENCH_RUNS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    command = ["-m", "workbench.cli", "finetune", str(cfg), "--steps", "2", "--run-id", "trun"]
    if launcher == "torchrun":
        command = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *command]
    else:  # workbench checks the config for 2 ranks, then becomes torchrun
        command = [*command, "--nproc-per-node", "2"]
    proc = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "run completed" in proc.stdout
    config = json.loads((tmp_path / "trun" / "config.json").read_text())
    assert config["world_size"] == 2 and config["resolved_mesh"]["ep"] == 2
    metrics = [json.loads(l) for l in (tmp_path / "trun" / "metrics.jsonl").read_text().splitlines()]
    assert sorted((m["rank"], m["step"]) for m in metrics) == [(0, 1), (0, 2), (1, 1), (1, 2)]


@pytest.mark.slow
def test_finetune_refuses_unknown_yaml_keys(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("train:\n  steps: 2\n  stepz: 3\n")
    proc = _workbench(["finetune", str(cfg)], tmp_path)
    assert proc.returncode == 2
    assert "stepz" in proc.stderr and "allowed keys" in proc.stderr
    assert not any(tmp_path.iterdir()) or list(tmp_path.iterdir()) == [cfg]


@pytest.mark.slow
def test_unknown_subcommand_lists_choices(tmp_path):
    proc = _workbench(["train"], tmp_path)
    assert proc.returncode == 2 and "finetune" in proc.stderr and "demo" in proc.stderr


def test_set_reads_numbers_as_people_write_them():
    from workbench.cli import _overrides, build_parser

    args = build_parser().parse_args(["finetune", "cfg.yaml", "--set", "train.lr=1e-3", "--set", "train.weight_decay=3E-4",
                                      "--set", "train.clip_grad_norm=1E5", "--set", "run_id=1e-3x"])
    overrides = _overrides(args)
    assert overrides == {"train.lr": 1e-3, "train.weight_decay": 3e-4, "train.clip_grad_norm": 1e5, "run_id": "1e-3x"}
    rc = RunConfig.demo().with_overrides(overrides)
    assert (rc.train.lr, rc.train.weight_decay, rc.train.clip_grad_norm, rc.run_id) == (1e-3, 3e-4, 1e5, "1e-3x")


@pytest.mark.slow
def test_mesh_error_under_torchrun_is_one_line_from_rank_0_with_exit_code_2(tmp_path):
    from workbench.parallel.mesh import MeshConfig

    cfg = tmp_path / "cfg.yaml"
    RunConfig.demo(mesh=MeshConfig(dp=3, ep=1), data__seq_len=64, train__global_batch_size=6,
                   train__local_batch_size=2).to_yaml(cfg)
    env = {**os.environ, "WORKBENCH_RUNS_DIR": str(tmp_path / "runs"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "workbench.cli", "finetune", str(cfg)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    ours = [line for line in out.splitlines() if "spans 3 ranks" in line]
    assert ours == ["workbench finetune: mesh MeshConfig(dp=3, ep=1, cp=1, tp=1) does not fit this run: "
                    "MeshConfig(dp=3, ep=1) spans 3 ranks but the world has 2; use dp=2 and an ep in [1, 2]"], out
    assert f"{os.sep}workbench{os.sep}" not in out, out  # no traceback through the workbench's code
    # torchrun itself exits 1 whenever a rank fails; rank 0 (the one that printed) failed first, with 2
    assert proc.returncode == 1 and re.search(r"failed \(exitcode: 2\) local_rank: 0 ", out), out
    assert len(re.findall(r"exitcode\s*: 2 ", out)) == 2, out  # torchrun's summary: both ranks left with 2
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_finetune_nproc_per_node_checks_the_config_once_before_any_rank_starts(tmp_path):
    from workbench.parallel.mesh import MeshConfig

    cfg = tmp_path / "cfg.yaml"
    RunConfig.demo(mesh=MeshConfig(dp=3, ep=1), data__seq_len=64, train__global_batch_size=6,
                   train__local_batch_size=2).to_yaml(cfg)
    env = {**os.environ, "WORKBENCH_RUNS_DIR": str(tmp_path / "runs"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "finetune", str(cfg), "--nproc-per-node", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr.splitlines() == [
        "workbench finetune: mesh MeshConfig(dp=3, ep=1, cp=1, tp=1) does not fit this run: MeshConfig(dp=3, ep=1) "
        "spans 3 ranks but the world has 2; use dp=2 and an ep in [1, 2]"]
    assert not (tmp_path / "runs").exists()


def test_finetune_nproc_per_node_runs_the_same_command_under_torchrun():
    from workbench.cli import _torchrun_argv, build_parser

    args = build_parser().parse_args(["finetune", "c.yaml", "--nproc-per-node", "4", "--set", "train.lr=1e-3",
                                      "--steps", "7", "--run-id", "r1"])
    assert _torchrun_argv(args) == [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    "--nproc-per-node", "4", "-m", "workbench.cli", "finetune", "c.yaml",
                                    "--set", "train.lr=1e-3", "--steps", "7", "--run-id", "r1"]


@pytest.mark.parametrize("item,message", [("train.lr", r"--set expects key=value \(e.g. train.lr=1e-3\), got 'train.lr'"),
                                          ("train.lr=[1", r"--set value '\[1' is not valid YAML: expected ',' or ']'")])
def test_bad_set_item_is_a_config_error(item, message):
    from workbench.cli import _overrides, build_parser
    from workbench.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _overrides(build_parser().parse_args(["finetune", "cfg.yaml", "--set", item]))
