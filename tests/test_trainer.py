"""The trainer on CPU: determinism, grad accumulation, learning, callbacks, failures, bad input."""

import json
import os
from pathlib import Path

import pytest

from workbench.config import ConfigError, RunConfig
from workbench.errors import DataError
from workbench.runs.run_dir import RunDir
from workbench.train import finetune


def _rc(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "runs"),
        data__seq_len=64,
        train__steps=3,
        train__global_batch_size=4,
        train__local_batch_size=4,
        train__save_final_checkpoint=False,
    )
    base.update(overrides)
    return RunConfig.demo(**base)


def test_same_config_gives_identical_losses_twice(tmp_path):
    a = finetune(_rc(tmp_path))
    b = finetune(_rc(tmp_path))
    assert a["losses"] == b["losses"] and len(a["losses"]) == 3
    assert a["run_id"] != b["run_id"]


@pytest.mark.slow
def test_grad_accumulation_equals_one_big_batch(tmp_path):
    # The aux loss is a per-micro-batch statistic; without it, 4 x 2 sequences == 1 x 8 exactly.
    # float32 on the CPU also on a GPU machine ("auto" would pick bf16 on CUDA there)
    common = dict(
        model__router_aux_loss_coef=0.0, train__global_batch_size=8, model__dtype="float32", model__device="cpu"
    )
    big = finetune(_rc(tmp_path, train__local_batch_size=8, **common))["losses"]
    acc = finetune(_rc(tmp_path, train__local_batch_size=2, **common))["losses"]
    assert acc == pytest.approx(big, rel=1e-5)
    # With the aux loss on, the two differ only by the (small) aux term.
    acc_aux = finetune(
        _rc(
            tmp_path, train__local_batch_size=2, train__global_batch_size=8, model__dtype="float32", model__device="cpu"
        )
    )["losses"]
    assert acc_aux == pytest.approx(big, rel=1e-2) and acc_aux != acc


@pytest.mark.slow
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
    # Step 2's record is read once step 3 is queued behind it (the device does not idle for a read):
    # the stop that record asks for ends the run after step 3, with every queued step kept.
    assert out["state"] == "stopped" and out["step"] == 3 and len(out["losses"]) == 3
    assert out["checkpoint"] and Path(out["checkpoint"], "meta.json").is_file()
    status = RunDir.open(Path(out["run_dir"])).read_status()
    assert status["state"] == "stopped" and status["step"] == 3
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
    with pytest.raises(ConfigError, match=r"learning_rate.*allowed keys"):
        RunConfig.from_yaml(cfg)


def test_existing_run_id_is_not_overwritten(tmp_path):
    finetune(_rc(tmp_path, run_id="same", train__steps=1))
    before = (tmp_path / "runs" / "same" / "metrics.jsonl").read_text()
    with pytest.raises(FileExistsError, match="already exists"):
        finetune(_rc(tmp_path, run_id="same", train__steps=1))
    assert (tmp_path / "runs" / "same" / "metrics.jsonl").read_text() == before


# -- gradient norm across the mesh: FSDP2 DTensor shards + rank-local expert shards ------------


def _grad_norm_worker(rank, port, out_dir):
    import traceback

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from workbench.train.optim import GRAD_NORM_GROUP_ATTR, clip_grad_norm, total_grad_norm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        dense = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        fully_shard(dense, mesh=mesh)
        torch.manual_seed(100 + rank)  # this rank's own "experts": different values per rank
        expert = torch.nn.Parameter(torch.randn(3, 5))
        setattr(expert, GRAD_NORM_GROUP_ATTR, dist.group.WORLD)
        replicated = torch.nn.Parameter(torch.ones(2))  # unmarked plain tensor: same on all ranks
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
        loss = dense(x).pow(2).sum() + (expert * expert).sum() * 3 + replicated.sum() * 2
        loss.backward()
        params = list(dense.parameters()) + [expert, replicated]
        norm = float(total_grad_norm(params))
        # Reference: every shard gathered by hand.
        dense_sq = sum(float(p.grad.full_tensor().pow(2).sum()) for p in dense.parameters())
        expert_sq = [None, None]
        dist.all_gather_object(expert_sq, float(expert.grad.pow(2).sum()))
        ref = (dense_sq + sum(expert_sq) + float(replicated.grad.pow(2).sum())) ** 0.5
        before = clip_grad_norm(params, max_norm=1.0)
        after = float(total_grad_norm(params))
        torch.save({"norm": norm, "ref": ref, "before": before, "after": after}, os.path.join(out_dir, f"r{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    os._exit(code)


@pytest.mark.slow
def test_grad_norm_and_clipping_span_fsdp_shards_and_expert_shards(tmp_path):
    import torch
    import torch.multiprocessing as mp

    from workbench.parallel.launch import free_port

    mp.spawn(_grad_norm_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt") for r in range(2))
    assert r0["norm"] == pytest.approx(r0["ref"], rel=1e-6) and r0["norm"] == pytest.approx(r1["norm"], rel=1e-7)
    assert r0["before"] > 1.0 and r0["after"] == pytest.approx(1.0, rel=1e-4)
    assert r1["after"] == pytest.approx(1.0, rel=1e-4)


# -- the non-finite guard: a NaN loss or grad norm never reaches the weights or a checkpoint ----


def _checkpoint_tensors(ckpt: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(ckpt.parent / "flat.pt"))
    flat, out = torch.load(ckpt.parent / "flat.pt"), {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            out[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)

    walk("", flat)
    return out


@pytest.mark.parametrize("clip", [1.0, None])
def test_nan_grad_norm_with_finite_loss_stops_before_the_update(tmp_path, clip):
    import torch

    from workbench.train.checkpoint import resolve_checkpoint
    from workbench.train.guard import NonFiniteError

    # lr 1e6: step 1 is finite, step 2's backward overflows (grad norm nan) while its loss is finite.
    rc = _rc(
        tmp_path, run_id="diverge", train__steps=4, train__lr=1e6, train__checkpoint_every=1, train__clip_grad_norm=clip
    )
    advice = "lower train.clip_grad_norm" if clip else "enable train.clip_grad_norm"
    with pytest.raises(
        NonFiniteError,
        match=rf"step 2: the gradient norm is nan while the loss \([\d.]+\) is "
        rf"finite.*lower train.lr \(now 1e\+06.*{advice}",
    ):
        finetune(rc)
    run = RunDir.open(tmp_path / "runs" / "diverge")
    assert [m["step"] for m in run.read_metrics()] == [1]  # no record of the refused step
    latest = resolve_checkpoint(run.path)
    assert latest.name == "step-00000001"
    tensors = _checkpoint_tensors(latest)
    assert any(".model." in k for k in tensors) and any(".optim." in k for k in tensors)
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    assert not bad, bad
    assert run.read_status()["state"] == "failed"


def _nan_head_checkpoint(path: Path) -> str:
    import torch
    import transformers
    from tiny_models import tiny_qwen3_moe

    model = transformers.AutoModelForCausalLM.from_config(tiny_qwen3_moe())
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")  # after the router: the aux loss stays finite
    model.save_pretrained(path)
    return str(path)


def _nan_head_rc(tmp_path, ckpt, **overrides):
    from workbench.config import DataConfig, ModelConfig

    return _rc(
        tmp_path, model=ModelConfig(preset=None, path=ckpt), data=DataConfig(kind="synthetic", seq_len=16), **overrides
    )


def test_nan_loss_at_the_first_step_points_at_data_or_init(tmp_path):
    from workbench.train.guard import NonFiniteError

    rc = _nan_head_rc(
        tmp_path, _nan_head_checkpoint(tmp_path / "nan-model"), run_id="nanloss", train__checkpoint_every=1
    )
    with pytest.raises(
        NonFiniteError,
        match=r"step 1: the loss is nan; this is the first step, before any "
        r"update: check the data .* initialization or dtype",
    ):
        finetune(rc)
    checkpoints = tmp_path / "runs" / "nanloss" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())


def test_guard_names_the_aux_loss_and_later_loss_divergence():
    from workbench.train.guard import NonFiniteError, StepValues, check_finite

    ok = StepValues(
        step=5,
        first_step=False,
        resumed_from=None,
        ce_loss=2.0,
        aux_loss=0.3,
        aux_coef=0.01,
        grad_norm=1.5,
        grad_norm_finite=True,
        lr=1e-3,
        train_lr=1e-3,
        clip_grad_norm=1.0,
    )
    check_finite(ok)
    import dataclasses

    with pytest.raises(
        NonFiniteError,
        match=r"step 5: the router aux loss term is nan .*router_aux_loss_coef is nan: "
        r"set a finite value",
    ):
        check_finite(dataclasses.replace(ok, aux_coef=float("nan"), ce_loss=float("nan")))
    with pytest.raises(
        NonFiniteError,
        match=r"step 5: the router aux loss term is inf.*lower or zero "
        r"model.router_aux_loss_coef \(now 0.01\), or lower train.lr",
    ):
        check_finite(dataclasses.replace(ok, aux_loss=float("inf")))
    with pytest.raises(NonFiniteError, match=r"step 5: the loss is inf; earlier updates diverged: lower train.lr"):
        check_finite(dataclasses.replace(ok, ce_loss=float("inf")))
    with pytest.raises(NonFiniteError, match=r"first step after resuming from /ck"):
        check_finite(dataclasses.replace(ok, ce_loss=float("nan"), first_step=True, resumed_from="/ck"))


def _diverge_worker(rank, world, tmp, ckpt):
    from workbench.train.guard import NonFiniteError

    try:
        finetune(_nan_head_rc(Path(tmp), ckpt, run_id="dp-nan", train__local_batch_size=2))
    except NonFiniteError as err:
        return str(err)
    return None


@pytest.mark.slow
def test_all_ranks_stop_together_on_a_non_finite_loss(tmp_path):
    from launch_utils import run_ranks

    ckpt = _nan_head_checkpoint(tmp_path / "nan-model")
    errors = run_ranks(_diverge_worker, 2, str(tmp_path), ckpt, timeout=120)
    assert errors[0] and errors[0] == errors[1] and errors[0].startswith("step 1: the loss is nan"), errors


# -- the step API the bench times: setup(model), train_step(step), collect(wait) ---------------


def test_setup_takes_a_prebuilt_model_and_collect_returns_the_records(tmp_path):
    import torch
    import transformers

    from workbench.train.loop import Trainer

    rc = _rc(tmp_path, model__dtype="float32", model__device="cpu")
    trainer = Trainer(rc)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(trainer.hf_config)  # vanilla Transformers
    before = model.lm_head.weight.detach().clone()
    trainer.setup(model=model)
    assert trainer.model is model
    assert trainer.train_step(1) is None
    trainer.train_step(2)
    records = trainer.collect(wait=True)
    assert [r["step"] for r in records] == [1, 2] and trainer.collect(wait=True) == []
    for key in ("loss", "grad_norm", "tokens", "step_time_s", "forward_s", "backward_s", "optimizer_s", "peak_mem_gib"):
        assert all(isinstance(r[key], float | int) for r in records), key
    assert not torch.equal(model.lm_head.weight, before)  # the given model was trained


def test_grad_norm_takes_the_multi_tensor_norm_and_equals_one_norm_per_tensor(monkeypatch):
    # A LoRA step has hundreds of small adapter grads: one norm launch each was host time per tensor.
    import torch

    from workbench.train.optim import total_grad_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.bfloat16)) for s in ((16, 40), (40,), (3, 5, 7), (1,))]
    for p in params:
        p.grad = torch.randn_like(p)
    calls = []
    foreach = torch._foreach_norm

    def counting(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return foreach(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counting)
    norm = total_grad_norm(params)
    assert calls == [4]  # one call for the four grads of one device
    expected = torch.stack([torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float32) for p in params]).norm()
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
