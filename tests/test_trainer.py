"""The trainer on CPU: determinism, grad accumulation, learning, callbacks, failures, bad input."""

import json
import os
from pathlib import Path

import pytest

from workbench.config import ConfigError, RunConfig
from workbench.train import finetune
from workbench.train.data import DataError
from workbench.train.run_dir import RunDir


def _rc(tmp_path, **overrides):
    base = dict(output_dir=str(tmp_path / "runs"), data__seq_len=64, train__steps=3, train__global_batch_size=4,
                train__local_batch_size=4, train__save_final_checkpoint=False)
    base.update(overrides)
    return RunConfig.demo(**base)


def test_same_config_gives_identical_losses_twice(tmp_path):
    a = finetune(_rc(tmp_path))
    b = finetune(_rc(tmp_path))
    assert a["losses"] == b["losses"] and len(a["losses"]) == 3
    assert a["run_id"] != b["run_id"]


def test_grad_accumulation_equals_one_big_batch(tmp_path):
    # The aux loss is a per-micro-batch statistic; without it, 4 x 2 sequences == 1 x 8 exactly.
    common = dict(model__router_aux_loss_coef=0.0, train__global_batch_size=8)
    big = finetune(_rc(tmp_path, train__local_batch_size=8, **common))["losses"]
    acc = finetune(_rc(tmp_path, train__local_batch_size=2, **common))["losses"]
    assert acc == pytest.approx(big, rel=1e-5)
    # With the aux loss on, the two differ only by the (small) aux term.
    acc_aux = finetune(_rc(tmp_path, train__local_batch_size=2, train__global_batch_size=8))["losses"]
    assert acc_aux == pytest.approx(big, rel=1e-2) and acc_aux != acc


def test_loss_decreases_on_the_tiny_data(tmp_path):
    out = finetune(_rc(tmp_path, train__steps=15, train__global_batch_size=8))
    losses = out["losses"]
    assert losses[-1] < losses[0] - 1.0, losses
    assert out["state"] == "completed"


class Recorder:
    def __init__(self, stop_after=None, fail_at=None):
        self.events, self.stop_after, self.fail_at = [], stop_after, fail_at

    def on_start(self, info):
        self.events.append(("start", info))

    def on_step(self, record):
        if record["step"] == self.fail_at:
            raise RuntimeError("callback failure on purpose")
        self.events.append(("step", record))

    def on_end(self, status):
        self.events.append(("end", status))

    def should_stop(self):
        steps = [e for e in self.events if e[0] == "step"]
        return self.stop_after is not None and len(steps) >= self.stop_after


def test_callbacks_metrics_and_run_directory(tmp_path):
    rec = Recorder()
    out = finetune(_rc(tmp_path, run_id="cb"), callbacks=[rec, object()])
    kinds = [k for k, _ in rec.events]
    assert kinds == ["start", "step", "step", "step", "end"]
    info = rec.events[0][1]
    assert info["world_size"] == 1 and info["total_steps"] == 3 and info["run_id"] == "cb"
    run = RunDir.open(Path(out["run_dir"]))
    metrics = run.read_metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["rank"] == 0 for m in metrics)
    assert [m["loss"] for m in metrics] == out["losses"]
    m = metrics[0]
    assert len(m["expert_load"]) == 2 and len(m["expert_load"][0]) == 8
    assert sum(m["expert_load"][0]) == 4 * 64 * 2  # every token to top-2 experts
    assert m["tflops_per_gpu"] > 0 and m["step_time_s"] >= m["forward_s"] + m["backward_s"]
    assert run.read_status()["state"] == "completed" and run.read_config()["train"]["steps"] == 3


def test_should_stop_checkpoints_then_stops(tmp_path):
    rec = Recorder(stop_after=2)
    out = finetune(_rc(tmp_path, train__steps=10), callbacks=[rec])
    assert out["state"] == "stopped" and out["step"] == 2 and len(out["losses"]) == 2
    assert out["checkpoint"] and Path(out["checkpoint"], "meta.json").is_file()
    status = RunDir.open(Path(out["run_dir"])).read_status()
    assert status["state"] == "stopped" and status["step"] == 2
    assert rec.events[-1][0] == "end" and rec.events[-1][1]["state"] == "stopped"


def test_exception_marks_run_failed_with_traceback_and_reraises(tmp_path):
    rec = Recorder(fail_at=2)
    with pytest.raises(RuntimeError, match="on purpose"):
        finetune(_rc(tmp_path, run_id="boom"), callbacks=[rec])
    status = RunDir.open(tmp_path / "runs" / "boom").read_status()
    assert status["state"] == "failed" and "on purpose" in status["error"] and "Traceback" in status["traceback"]
    assert rec.events[-1][1]["state"] == "failed"


# -- bad input: a clear error, before any work, and nothing written or overwritten -------------


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("keep me")
    with pytest.raises(PermissionError, match="not writable"):
        finetune(RunConfig.demo(output_dir=str(blocker / "runs"), train__steps=1))
    assert blocker.read_text() == "keep me"


def test_rows_missing_fields_or_too_long(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "response": "there"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DataError, match=rf"{data}:2: row is missing \['response'\]"):
        finetune(_rc(tmp_path, data__path=str(data)))
    data.write_text(json.dumps({"prompt": "cat " * 100, "response": "dog"}) + "\n")
    with pytest.raises(DataError, match=rf"{data}:1: row is \d+ tokens, over data.max_length=64"):
        finetune(_rc(tmp_path, data__path=str(data)))
    assert not (tmp_path / "runs").exists()  # failed before creating any run directory


def test_yaml_with_unknown_keys_is_refused(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("train:\n  steps: 2\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate.*allowed keys"):
        RunConfig.from_yaml(cfg)


def test_existing_run_id_is_not_overwritten(tmp_path):
    finetune(_rc(tmp_path, run_id="same", train__steps=1))
    before = (tmp_path / "runs" / "same" / "metrics.jsonl").read_text()
    with pytest.raises(FileExistsError, match="already exists"):
        finetune(_rc(tmp_path, run_id="same", train__steps=1))
    assert (tmp_path / "runs" / "same" / "metrics.jsonl").read_text() == before
