"""train.report_to: a tiny CPU run reports its records to TensorBoard, W&B (offline) and MLflow (SQLite) inside its
folder, each read back with that tracker's own reader; bad names and missing libraries are refused at config time."""

import json
import math
import struct
from pathlib import Path

import pytest
from test_trainer import _rc as trainer_config

from workbench.config import ConfigError
from workbench.runs.moe_health import HEALTH_KEYS
from workbench.trackers import registry
from workbench.trackers.scalars import step_scalars
from workbench.train import finetune

INSTALLED = {name: not registry.missing_packages(name) for name in registry.TRACKERS}


def _rc(tmp_path, **overrides):
    return trainer_config(tmp_path, **{"train__local_batch_size": 2, **overrides})


def test_report_to_is_empty_by_default_and_refuses_unknown_or_repeated_names(tmp_path):
    assert _rc(tmp_path).train.report_to == ()
    with pytest.raises(ConfigError, match=r"train\.report_to must be a list of names from \['tensorboard'"):
        _rc(tmp_path, train__report_to=["tensorbord"])
    with pytest.raises(ConfigError, match=r"train\.report_to must be a list"):
        _rc(tmp_path, train__report_to="wandb")
    with pytest.raises(ConfigError, match="names a tracker twice"):
        _rc(tmp_path, train__report_to=["tensorboard", "tensorboard"])


def test_a_tracker_whose_library_is_missing_is_refused_naming_the_extra(tmp_path, monkeypatch):
    # a tracker needing a library that no environment has: the check must name it and the pip extra
    spec = registry.TrackerSpec("workbench.trackers.wandb_tracker", ("no_such_lib_xyz",), ("no-such-lib-xyz",))
    monkeypatch.setitem(registry.TRACKERS, "wandb", spec)
    with pytest.raises(ConfigError) as err:
        _rc(tmp_path, train__report_to=["wandb"])
    message = str(err.value)
    assert "pip install no-such-lib-xyz" in message and "pip install -e '.[trackers]'" in message
    assert "drop 'wandb'" in message


def test_step_scalars_flatten_a_record():
    record = {
        "step": 3,
        "rank": 0,
        "time": 1.0,
        "loss": 2.5,
        "lr": 1e-3,
        "tokens_per_s_per_gpu": 10.0,
        "mem_kind": "cpu_rss",
        "expert_load": [[1, 2]],
        "moe_dead_share": [0.0, 0.5],
        "router_entropy": [0.25, 0.75],
        "eval_loss": 2.0,
    }
    scalars = step_scalars(record)
    assert scalars == {
        "loss": 2.5,
        "lr": 1e-3,
        "tokens_per_s_per_gpu": 10.0,
        "eval_loss": 2.0,
        "moe_dead_share/layer_00": 0.0,
        "moe_dead_share/layer_01": 0.5,
        "moe_dead_share/mean": 0.25,
        "router_entropy/layer_00": 0.25,
        "router_entropy/layer_01": 0.75,
        "router_entropy/mean": 0.5,
    }


def _wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    """step -> logged values, from a .wandb file: W&B's record protobufs (its own schema) in LevelDB-style log
    blocks of 32 KiB (7-byte file header, then records of a 7-byte header: crc32, length, type; a record that
    does not fit its block is split FIRST / MIDDLE / LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, history = 32768, 7, b"", {}
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):  # FULL, FIRST
            pending = payload
        else:  # MIDDLE, LAST
            pending += payload
        if kind in (1, 4):  # FULL, LAST: a whole record
            record = pb.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                history[int(items.get("_step", record.history.step.num))] = items
    return history


# slow: importing TensorBoard and MLflow and building MLflow's SQLite schema take ~20 s of the ~26 s on 2 cores
@pytest.mark.slow
@pytest.mark.skipif(not all(INSTALLED.values()), reason=f"the trackers extra is not installed: {INSTALLED}")
def test_a_tiny_run_reports_every_step_to_tensorboard_wandb_and_mlflow(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from workbench.trackers.mlflow_tracker import tracking_uri

    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default must be offline
    rc = _rc(tmp_path, name="tracked-run", train__report_to=["tensorboard", "wandb", "mlflow"])
    out = finetune(rc)
    run_dir = Path(out["run_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loss = {r["step"]: r["loss"] for r in records}
    assert sorted(loss) == [1, 2, 3]
    layers = len(records[0]["moe_dead_share"])

    # TensorBoard's own reader
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tb_loss = {e.step: e.value for e in events.Scalars("loss")}
    assert tb_loss == pytest.approx(loss, rel=1e-6)  # event files hold float32
    tags = set(events.Tags()["scalars"])
    assert {"lr", "tokens_per_s_per_gpu", "tflops_per_gpu", "mem_peak_gib"} <= tags
    assert {f"{k}/layer_{i:02d}" for k in HEALTH_KEYS for i in range(layers)} <= tags

    # W&B's offline run: its .wandb file, its protobuf records
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = _wandb_history(run_file)
    assert {s: h["loss"] for s, h in history.items()} == loss
    assert history[3]["router_entropy/layer_00"] == records[2]["router_entropy"][0]

    # MLflow's client on the run's SQLite store
    client = MlflowClient(tracking_uri=tracking_uri(run_dir))
    (run,) = client.search_runs([client.get_experiment_by_name("moe-workbench").experiment_id])
    assert run.info.run_name == "tracked-run" and run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "3"
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == loss
    dead = client.get_metric_history(run.info.run_id, "moe_dead_share/mean")
    assert [m.value for m in sorted(dead, key=lambda m: m.step)] == [
        pytest.approx(math.fsum(r["moe_dead_share"]) / layers) for r in records
    ]


def test_the_default_run_reports_to_no_tracker(tmp_path):
    out = finetune(_rc(tmp_path))
    run_dir = Path(out["run_dir"])
    assert not any((run_dir / name).exists() for name in ("tensorboard", "wandb", "mlflow"))


@pytest.mark.slow
@pytest.mark.skipif(not INSTALLED["tensorboard"], reason="tensorboard is not installed")
def test_on_two_ranks_only_rank_0_reports(tmp_path):
    import os
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(__file__).resolve().parents[1]
    cfg = tmp_path / "cfg.yaml"
    _rc(tmp_path, train__steps=2, train__report_to=["tensorboard"]).to_yaml(cfg)
    env = {**os.environ, "WORKBENCH_RUNS_DIR": str(tmp_path), "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    command = ["-m", "workbench.cli", "finetune", str(cfg), "--run-id", "two", "--nproc-per-node", "2"]
    proc = subprocess.run([sys.executable, *command], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = Path(_rc(tmp_path).output_dir) / "two"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["rank"] for r in records}) == [0, 1]
    # one writer, rank 0's (each SummaryWriter writes its own events file)
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    rank0 = {r["step"]: r for r in records if r["rank"] == 0}
    assert {e.step: e.value for e in events.Scalars("tokens")} == {s: r["tokens"] for s, r in rank0.items()}
    assert {e.step: e.value for e in events.Scalars("moe_dead_share/layer_00")} == pytest.approx(
        {s: r["moe_dead_share"][0] for s, r in rank0.items()}
    )
