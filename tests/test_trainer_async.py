"""The trainer's step without host syncs: records read back later, the non-finite guard on the device."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from generic_families import tiny_config
from launch_utils import run_ranks

from workbench.config import DataConfig, ModelConfig, RunConfig
from workbench.models.router_aux import forward_loss_parts
from workbench.train.guard import NonFiniteError
from workbench.train.host_syncs import HostSyncRecorder
from workbench.train.loop import Trainer
from workbench.train.optim import set_skip_flag
from workbench.train.triton_adamw_optimizer import TritonAdamW


def _saved(family: str, path: Path) -> str:
    from workbench.config import TINY_VOCAB_SIZE

    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    torch.manual_seed(0)
    cfg = tiny_config(family, vocab_size=TINY_VOCAB_SIZE)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def _rc(ckpt: str, out: str, **overrides) -> RunConfig:
    base = dict(
        train__steps=4,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__lr=1e-2,
        train__warmup_steps=0,
        train__save_final_checkpoint=False,
        train__log_every=100,
    )
    return RunConfig.demo(
        model=ModelConfig(preset=None, path=ckpt, dtype="float32", device="cpu"),
        data=DataConfig(kind="synthetic", seq_len=16),
        output_dir=out,
        **{**base, **overrides},
    )


# -- no host read in a step ------------------------------------------------------------------------------


def _allowed(sync) -> bool:
    """Reads that wait for nothing on a GPU either, each with why."""
    stack = " ".join(sync.stack)
    function = sync.origin.rsplit(" ", 1)[-1]
    if sync.device == "cpu" and sync.origin.startswith("workbench/train/data.py"):
        return True  # the data stream picks its host-side sequences (before any copy to the device)
    if function == "flash_sequences" and "workbench/train/loop_step.py" in stack and "_sequences" in stack:
        return True  # the sink attention's documents, counted from the batch's host position_ids
    if function == "host_rows_packed" and sync.device == "cpu":
        return True  # whether the batch's rows restart, from its host position ids (models/host_packing.py)
    if function == "check_label_range" and sync.device == "cpu":
        return True  # an asynchronous assert on a device (tests/test_host_syncs.py)
    # any other read, Transformers' too: its 5.17 aux loss had one per layer (the engine's has none), and its masks'
    # packed-rows check is answered from the host's position ids (models/host_packing.py)
    return False


def _step_syncs(trainer: Trainer) -> list[str]:
    trainer.train_step(trainer.start_step + 1)  # first-step reads (optimizer state, counters) stay out
    trainer.collect(wait=True)
    with HostSyncRecorder(depth=10) as rec:
        trainer.train_step(trainer.start_step + 2)  # a step fit() does not wait on
    return [f"{s.op} @ {' <- '.join(reversed(s.stack))}" for s in rec.syncs if not _allowed(s)]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_a_train_step_reads_nothing_back_from_the_device(family, tmp_path):
    extra = {"train__router_bias_update_rate": 1e-3} if family == "deepseek_v3" else {}
    trainer = Trainer(
        _rc(
            _saved(family, tmp_path / "m"),
            str(tmp_path / "runs"),
            train__optimizer="adamw_triton",
            train__clip_grad_norm=0.5,
            **extra,
        )
    )
    trainer.setup()
    assert _step_syncs(trainer) == []
    records = trainer.collect(wait=True)
    assert [r["step"] for r in records] == [2] and records[0]["loss"] > 0


def test_a_train_step_on_packed_documents_reads_nothing_back(tmp_path):
    """Packed user data (the shipped JSONL, pack=True): Transformers' packed-rows check is answered from the host."""
    from workbench.config import ModelConfig
    from workbench.models.host_packing import host_rows_packed

    rc = RunConfig.demo(
        model=ModelConfig(dtype="float32", device="cpu"),
        output_dir=str(tmp_path / "runs"),
        data__seq_len=64,
        data__pack=True,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__log_every=100,
        train__save_final_checkpoint=False,
        train__optimizer="adamw_triton",  # its skip flag lives on the device (torch's CPU AdamW looks first)
    )
    trainer = Trainer(rc)
    trainer.setup()
    assert host_rows_packed(trainer.stream.next_batch(4).position_ids)  # the stream's rows hold several documents
    assert _step_syncs(trainer) == []


# The all-to-all dispatcher's one read per MoE layer: the uneven exchange's split sizes are host ints
# (workbench/moe/dispatch/alltoall.py); everything the trainer adds is reduced on the device.
DISPATCH = "tolist @ workbench/moe/dispatch/alltoall.py"


def _dp2_ep2_worker(rank, world, ckpt, out):
    from workbench.moe.hf_experts import engine_experts_modules

    trainer = Trainer(_rc(ckpt, out, train__optimizer="adamw_triton", train__clip_grad_norm=0.5))
    trainer.setup()
    return {
        "syncs": _step_syncs(trainer),
        "mesh": str(trainer.mesh),
        "accum": trainer.accum,
        "layers": len(engine_experts_modules(trainer.model)),
        "loss": trainer.collect(wait=True)[0]["loss"],
    }


@pytest.mark.slow
def test_a_dp2_ep2_train_step_reads_nothing_back_but_the_dispatch_sizes(tmp_path):
    ckpt = _saved("qwen3_moe", tmp_path / "m")
    results = run_ranks(_dp2_ep2_worker, 2, ckpt, str(tmp_path / "runs"), timeout=300)
    assert results[0]["mesh"] == "MeshConfig(dp=2, ep=2, cp=1, tp=1)"
    for r in results:
        assert [s for s in r["syncs"] if not s.startswith(DISPATCH)] == [], r["syncs"]
        assert len(r["syncs"]) == r["layers"] * r["accum"], r["syncs"]
    assert results[0]["loss"] == results[1]["loss"]  # the global loss, reduced on the device


def test_sink_attention_documents_come_from_the_host_batch(tmp_path):
    """GPT-OSS: the trainer hands the documents in; the model then derives none (and the loss is the same)."""
    trainer = Trainer(_rc(_saved("gpt_oss", tmp_path / "m"), str(tmp_path / "runs")))
    trainer.setup()
    batch = trainer.stream.next_batch(2)
    pos = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16)  # two documents per row
    given = trainer._sequences(type(batch)(batch.input_ids, batch.labels, pos))
    assert given["cu_seq_lens_q"].tolist() == [0, 6, 16, 22, 32]
    kwargs = dict(input_ids=batch.input_ids, labels=batch.labels, position_ids=pos, use_cache=False)
    with HostSyncRecorder(depth=10) as rec:
        with_given = trainer.model(**kwargs, **given).loss
    assert [s for s in rec.syncs if s.origin.rsplit(" ", 1)[-1] == "flash_sequences"] == []
    torch.testing.assert_close(with_given, trainer.model(**kwargs).loss, rtol=1e-6, atol=1e-7)


# -- records: the same values, later -----------------------------------------------------------------------


def test_records_equal_a_synchronous_reference_step(tmp_path):
    """loss, grad_norm and tokens from collect() against the same steps done by hand with torch's clipping."""
    ckpt = _saved("qwen3_moe", tmp_path / "m")
    rc = _rc(ckpt, str(tmp_path / "runs"), train__steps=3, train__clip_grad_norm=0.5)
    ref = Trainer(rc)
    ref.setup()
    want = []
    for _ in range(3):
        batch = ref.stream.next_batch(4)
        items = torch.tensor(float((batch.labels[:, 1:] != -100).sum()))
        ce_sum, aux_sum = 0.0, 0.0
        for mb in (batch.slice(0, 2), batch.slice(2, 4)):
            parts = forward_loss_parts(
                ref.model,
                ref.model,
                dict(
                    input_ids=mb.input_ids,
                    labels=mb.labels,
                    position_ids=mb.position_ids,
                    num_items_in_batch=items,
                    use_cache=False,
                ),
            )
            (parts.ce + ref.coef * parts.aux / 2).backward()
            ce_sum, aux_sum = ce_sum + float(parts.ce.detach()), aux_sum + float(parts.aux.detach()) / 2
        norm = float(torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 0.5))
        ref.optimizer.step()
        ref.scheduler.step()
        ref.optimizer.zero_grad(set_to_none=True)
        want.append({"loss": ce_sum + ref.coef * aux_sum, "grad_norm": norm, "tokens": batch.input_ids.numel()})
    trainer = Trainer(rc)
    trainer.setup()
    for step in (1, 2, 3):
        trainer.train_step(step)
    got = trainer.collect(wait=True)
    assert [r["step"] for r in got] == [1, 2, 3]
    for g, w in zip(got, want):
        assert g["tokens"] == w["tokens"]
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5) and g["grad_norm"] == pytest.approx(
            w["grad_norm"], rel=1e-5
        )
        assert g["step_time_s"] >= g["forward_s"] + g["backward_s"] + g["optimizer_s"] > 0


def test_fit_publishes_every_step_once_in_order_when_it_waits_only_at_the_end(tmp_path):
    from workbench.runs.run_dir import RunDir

    ckpt = _saved("qwen3_moe", tmp_path / "m")
    seen = []

    class Steps:
        def on_step(self, record):
            seen.append(record["step"])

    trainer = Trainer(_rc(ckpt, str(tmp_path / "runs"), train__steps=5), callbacks=[Steps()])
    trainer.setup()
    result = trainer.fit()
    assert seen == [1, 2, 3, 4, 5] and len(result["losses"]) == 5
    assert [m["step"] for m in RunDir.open(Path(result["run_dir"])).read_metrics()] == [1, 2, 3, 4, 5]


# -- the non-finite guard on the device --------------------------------------------------------------------


def _state(opt, p):
    return {k: v.clone() for k, v in opt.state[p].items()}


def check_skip(make, device="cpu") -> None:
    """A set flag leaves the weights and the whole optimizer state (moments, step) as they were."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, device=device)), torch.nn.Parameter(torch.randn(7, device=device))]
    opt = make(params)
    flag = torch.zeros((), dtype=torch.float32, device=device)
    assert set_skip_flag(opt, flag)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    weights, states = [p.detach().clone() for p in params], [_state(opt, p) for p in params]
    flag.fill_(1.0)
    for _ in range(2):
        for p in params:
            p.grad = torch.full_like(p, float("nan"))
        opt.step()
    if isinstance(opt, TritonAdamW):  # its step counts are host ints: the trainer takes skipped ones back
        assert all(float(opt.state[p]["step"]) == 3.0 for p in params)
        opt.forget_skipped_steps(2)
    for p, w, s in zip(params, weights, states):
        assert torch.equal(p.detach(), w)
        for key, value in _state(opt, p).items():
            assert torch.equal(value, s[key]), key
    flag.fill_(0.0)  # cleared, the next finite step updates again
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert not any(torch.equal(p.detach(), w) for p, w in zip(params, weights))
    assert all(float(opt.state[p]["step"]) == 2.0 for p in params)


def test_torch_fused_adamw_skips_on_the_flag():
    check_skip(lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True))


@pytest.mark.parametrize("precision", ["bf16", "fp32_master"])
def test_triton_adamw_torch_path_skips_on_the_flag(precision, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    check_skip(lambda ps: TritonAdamW(ps, lr=0.1, precision=precision))


def test_optimizer_without_a_device_flag_is_refused():
    p = torch.nn.Parameter(torch.ones(2))
    assert not set_skip_flag(torch.optim.AdamW([p], foreach=False), torch.zeros(()))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is for CPU CI")
@pytest.mark.parametrize("check", ["check_skip", "check_fused_clip"])
def test_triton_adamw_kernel_honours_the_skip_flag_and_the_clip_coefficient_in_the_interpreter(check):
    pytest.importorskip("triton")
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, "tests")
        from test_trainer_async import {check}
        from workbench.train.triton_adamw_optimizer import TritonAdamW
        opts = []
        {check}(lambda ps: opts.append(TritonAdamW(ps, lr=0.1)) or opts[-1])
        kernel_updates = [o.updates["triton"] + o.updates["triton_multi"] for o in opts]
        assert all(n > 0 for n in kernel_updates) and all(o.updates["torch"] == 0 for o in opts), [
            o.updates for o in opts
        ]
        print("KERNEL OK")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "KERNEL OK" in proc.stdout, proc.stdout + proc.stderr


# -- clipping inside the optimizer's update ------------------------------------------------------------------


def check_fused_clip(make, device="cpu", grad_dtype=torch.float32) -> None:
    """clip_grad_norm(..., optimizer) leaves the grads and the update clips them: the same weights and
    states as clipping the grads first (float32 grads: the same product, so bit for bit)."""
    from workbench.train.optim import clip_grad_norm

    runs = []
    for fused in (False, True):
        torch.manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(5, 3, device=device, dtype=grad_dtype)),
            torch.nn.Parameter(torch.randn(7, device=device, dtype=grad_dtype)),
        ]
        opt = make(params)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = (4 * torch.randn(p.shape, generator=g)).to(device=device, dtype=grad_dtype)
            before = [p.grad.clone() for p in params]
            norm = clip_grad_norm(params, 0.5, opt if fused else None)
            assert float(norm) > 0.5  # the clip acts
            assert all(torch.equal(p.grad, b) for p, b in zip(params, before)) == fused  # fused: grads untouched
            opt.step()
        runs.append(([p.detach().clone() for p in params], [_state(opt, p) for p in params]))
    (w0, s0), (w1, s1) = runs
    for a, b in zip(w0, w1):
        torch.testing.assert_close(a, b, rtol=0, atol=0) if grad_dtype == torch.float32 else torch.testing.assert_close(
            a, b
        )
    for a, b in zip(s0, s1):
        for key in a:
            torch.testing.assert_close(
                a[key], b[key], rtol=0, atol=0
            ) if grad_dtype == torch.float32 else torch.testing.assert_close(a[key], b[key])


@pytest.mark.parametrize("precision", ["bf16", "fp32_master"])
def test_triton_adamw_torch_path_applies_the_clip_coefficient(precision, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    check_fused_clip(lambda ps: TritonAdamW(ps, lr=0.1, precision=precision))


def test_torch_fused_adamw_applies_the_clip_coefficient_as_its_grad_scale():
    # torch divides by grad_scale (the AMP unscale): 1 / coef, so a rounding apart from clipping first
    from workbench.train.optim import clip_grad_norm

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(2)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    a, b = torch.optim.AdamW(ps, lr=0.1, fused=True), torch.optim.AdamW(qs, lr=0.1, fused=True)
    for _ in range(3):
        for p, q in zip(ps, qs):
            p.grad = 4 * torch.randn_like(p)
            q.grad = p.grad.clone()
        clip_grad_norm(ps, 0.5)
        clip_grad_norm(qs, 0.5, b)
        assert b.grad_scale is not None and float(b.grad_scale) > 1
        a.step()
        b.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    clip_grad_norm(qs, None, b)  # clipping off: no scale left behind from the last step
    assert b.grad_scale is None


def test_an_optimizer_without_a_fused_coefficient_gets_clipped_grads():
    from workbench.train.optim import clip_grad_norm

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    opt = torch.optim.AdamW([p], foreach=False)
    clip_grad_norm([p], 1.0, opt)
    torch.testing.assert_close(p.grad.norm(), torch.tensor(1.0), rtol=1e-5, atol=0)


def _diverging(tmp_path, optimizer, **overrides):
    return _rc(
        _saved("qwen3_moe", tmp_path / "m"),
        str(tmp_path / "runs"),
        train__optimizer=optimizer,
        train__clip_grad_norm=1.0,
        **overrides,
    )


def _nan_gradients_from_step_2(trainer: Trainer) -> None:
    """From the second optimizer step on, one parameter's gradient is NaN (its loss stays finite).

    A fault injected on purpose: an overflowing learning rate reached NaN at another step, or not
    at all, depending on the torch / Transformers versions.
    """
    backwards = [0]

    def poison(grad):
        backwards[0] += 1
        return grad * float("nan") if backwards[0] > trainer.accum else grad

    next(p for p in trainer.model.parameters() if p.requires_grad).register_hook(poison)


def test_a_non_finite_step_and_all_later_ones_leave_weights_and_optimizer_state(tmp_path):
    trainer = Trainer(_diverging(tmp_path, "adamw_triton", run_id="skip"))
    trainer.setup()
    _nan_gradients_from_step_2(trainer)
    trainer.train_step(1)
    assert [r["step"] for r in trainer.collect(wait=True)] == [1]
    params = list(trainer.model.parameters())
    weights = [p.detach().clone() for p in params]
    states = [_state(trainer.optimizer, p) for p in params]
    for step in (2, 3, 4):  # queued without a look: the device flag skips 2 and, sticky, 3 and 4
        trainer.train_step(step)
    with pytest.raises(NonFiniteError, match=r"^step 2: the gradient norm is nan while the loss"):
        trainer.collect(wait=True)
    for p, w, s in zip(params, weights, states):
        assert torch.equal(p.detach(), w)
        for key, value in _state(trainer.optimizer, p).items():
            assert torch.equal(value, s[key]), key  # the step counts too: 1, the skipped ones forgotten


@pytest.mark.parametrize("optimizer", ["adamw_triton", "adamw_torch"])  # device flag; host check (CPU torch)
def test_the_run_fails_naming_the_first_bad_step_with_no_checkpoint_after_it(tmp_path, optimizer, monkeypatch):
    from workbench.runs.run_dir import RunDir
    from workbench.train import finetune
    from workbench.train.checkpoint import resolve_checkpoint

    setup = Trainer.setup

    def setup_then_poison(self, model=None):
        setup(self, model)
        _nan_gradients_from_step_2(self)

    monkeypatch.setattr(Trainer, "setup", setup_then_poison)

    # a checkpoint is due at step 3; the device flag of step 2 is only read when step 3 waits, before the save
    rc = _diverging(tmp_path, optimizer, run_id="fail", train__steps=5, train__checkpoint_every=3)
    with pytest.raises(NonFiniteError, match=r"^step 2: the gradient norm is nan"):
        finetune(rc)
    run = RunDir.open(tmp_path / "runs" / "fail")
    assert [m["step"] for m in run.read_metrics()] == [1]
    assert run.read_status()["state"] == "failed"
    checkpoints = run.path / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir()), list(checkpoints.iterdir())
    with pytest.raises(Exception, match="no complete checkpoint"):
        resolve_checkpoint(run.path)


@pytest.mark.slow
def test_stop_is_polled_after_the_steps_that_read_the_device(tmp_path):
    """should_stop is asked where the trainer waited anyway (a collective read): every log_every steps here.

    The logging step 3 is read once step 4 is queued behind it (the device never idles for a log
    line), so the first poll that sees a record comes before step 5: the run stops after step 4.
    """
    from workbench.train import finetune

    class StopAtOnce:
        def __init__(self):
            self.asked = []

        def on_step(self, record):
            self.asked.append(record["step"])

        def should_stop(self):
            return bool(self.asked)

    ckpt = _saved("qwen3_moe", tmp_path / "m")
    out = finetune(_rc(ckpt, str(tmp_path / "runs"), train__steps=9, train__log_every=3), callbacks=[StopAtOnce()])
    assert out["state"] == "stopped" and out["step"] == 4 and len(out["losses"]) == 4


def test_a_logging_read_waits_only_through_its_step():
    """`ready(wait=True, through=k)` blocks on marks up to step k's end; the newer step stays queued on the device."""
    import torch

    from workbench.train.step_stats import Clock, PendingStep, StatsLayout, StepQueue

    class Device(Clock):
        """A device that has run up to tick `passed` (marks are ticks); wait() runs it on to a mark."""

        def __init__(self):
            super().__init__(torch.device("cpu"))
            self.ticks, self.passed, self.waited = 0, 0, []

        def mark(self):
            self.ticks += 1
            return self.ticks

        def done(self, mark):
            return mark <= self.passed

        def wait(self, mark):
            self.waited.append(mark)
            self.passed = max(self.passed, mark)

    clock = Device()
    queue = StepQueue(clock, world=1)
    starts = {}
    for step in (1, 2, 3):
        pending = PendingStep(step=step, host={}, start=clock.mark())
        starts[step] = pending.start
        queue.started(pending.start)
        stats = StatsLayout().pack(
            {
                name: torch.zeros((), dtype=torch.float64)
                for name in ("ce", "aux", "grad_norm", "bad", "skipping", "first_bad", "loss_tokens")
            },
            None,
            None,
        )
        pending.queue_copy(StatsLayout(), stats, clock)
        queue.push(pending)
    ready, bad = queue.ready(True, through=2)
    assert bad is None and [p.step for p, _, _ in ready] == [1, 2]
    assert max(clock.waited) == starts[3]  # step 2 ends where step 3 starts: nothing of step 3 waited for
    assert [p.step for p in queue.items] == [3]
    ready, _ = queue.ready(True)
    assert [p.step for p, _, _ in ready] == [3]


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the compiled Triton kernel and torch's CUDA fused AdamW need a GPU"
)
@pytest.mark.parametrize(
    "make",
    [lambda ps: TritonAdamW(ps, lr=0.1), lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True)],
    ids=["triton_adamw", "torch_fused_adamw"],
)
def test_on_cuda_the_skip_flag_and_the_clip_coefficient_act_in_the_compiled_kernels(make):
    pytest.importorskip("triton")
    check_skip(make, device="cuda")
    if isinstance(make([torch.nn.Parameter(torch.zeros(1, device="cuda"))]), TritonAdamW):
        check_fused_clip(make, device="cuda")  # torch's grad_scale divides: a rounding apart, tested on the CPU
