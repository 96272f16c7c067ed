"""Updates inside the backward (train.optimizer_in_backward, workbench/train/backward_updates.py)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from tiny_models import trained
from triton_script import DEVICES, run_triton_script

from workbench import RunConfig
from workbench.config_checks import ConfigError
from workbench.train.guard import NonFiniteError
from workbench.train.loop import Trainer


def _rc(tmp_path, run_id, **overrides):
    base = dict(
        output_dir=str(tmp_path / "runs"),
        run_id=run_id,
        data__seq_len=64,
        train__steps=3,
        train__global_batch_size=2,
        train__local_batch_size=2,
        train__save_final_checkpoint=False,
        train__optimizer="adamw_triton",  # both runs the same AdamW (its torch-op kernel on the CPU)
        train__clip_grad_norm=None,
        train__lr=1e-3,
        model__device="cpu",
        model__dtype="float32",
    )
    base.update(overrides)
    return RunConfig.demo(**base)


@pytest.mark.parametrize("ac", [False, True])  # with activation checkpointing the layers recompute in the backward
def test_updates_inside_the_backward_equal_the_step_after_it_and_free_the_gradients(tmp_path, ac):
    after, after_records = trained(_rc(tmp_path, "after", train__activation_checkpointing=ac), 3)
    inside_rc = _rc(tmp_path, "inside", train__optimizer_in_backward=True, train__activation_checkpointing=ac)
    inside = Trainer(inside_rc)
    inside.setup()
    params = inside.grad_params
    alive = []
    step_param = inside.optimizer.step_param

    def counting(p, group, index):
        alive.append(sum(q.grad is not None for q in params))
        step_param(p, group, index)

    inside.optimizer.step_param = counting
    for step in range(1, 4):
        inside.train_step(step)
    inside_records = inside.collect(wait=True)
    assert [r["loss"] for r in inside_records] == [r["loss"] for r in after_records]
    assert [r["grad_norm"] for r in inside_records] == pytest.approx([r["grad_norm"] for r in after_records], rel=1e-6)
    for (name, a), b in zip(after.model.named_parameters(), inside.model.parameters()):
        assert torch.equal(a, b), name
    assert len(alive) == 3 * len(params)  # every parameter updated once per step, by its hook
    assert max(alive) < len(params) / 2  # the gradients never all live at once (after the backward they all do)
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("device", DEVICES)  # CUDA: the Triton kernels' own squares and non-finite blocks
def test_a_non_finite_gradient_stops_the_run_and_reaches_no_weight(tmp_path, device):
    # lr 1e6: step 1 is finite, step 2's backward overflows (as tests/test_trainer.py's guard test)
    on_gpu = dict(model__device="cuda", train__optimizer="adamw") if device == "cuda" else {}
    rc = _rc(tmp_path, "diverge", train__steps=4, train__lr=1e6, train__optimizer_in_backward=True, **on_gpu)
    trainer = Trainer(rc)
    trainer.setup()
    with pytest.raises(NonFiniteError, match=r"step 2: the gradient norm is (nan|inf)"):
        trainer.fit()
    bad = [n for n, p in trainer.model.named_parameters() if not torch.isfinite(p).all()]
    assert not bad, bad
    # the run is over, also when it failed: no hook is left on the model, and a further step is refused
    assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in trainer.model.parameters())
    with pytest.raises(RuntimeError, match="its update hooks are off the parameters"):
        trainer.train_step(5)
    states = [t for s in trainer.optimizer.state.values() for t in s.values() if t.is_floating_point()]
    assert all(torch.isfinite(t).all() for t in states)


def test_bad_settings_are_refused_before_any_model_is_built(tmp_path):
    with pytest.raises(ConfigError, match=r"clip_grad_norm=1\.0\) needs every gradient first"):
        RunConfig.demo(train__optimizer_in_backward=True)
    with pytest.raises(ConfigError, match=r"per-parameter update: set train\.optimizer"):
        RunConfig.demo(train__optimizer_in_backward=True, train__clip_grad_norm=None, train__optimizer="adamw_torch")
    with pytest.raises(ConfigError, match="must be true or false"):
        RunConfig.demo(train__optimizer_in_backward="yes")
    rc = _rc(tmp_path, "accum", train__optimizer_in_backward=True, train__global_batch_size=4)
    with pytest.raises(ConfigError, match=r"without gradient accumulation for now.*2 micro-batches"):
        Trainer(rc)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the update stream is CUDA's (this machine has no GPU)")
def test_updates_on_their_own_cuda_stream_equal_those_on_the_backwards_stream(tmp_path):
    from workbench.train.backward_updates import BackwardUpdates

    kw = dict(model__device="cuda", train__optimizer_in_backward=True, train__optimizer="adamw", train__steps=4)
    results = {}
    for side_stream in (False, True):
        trainer = Trainer(_rc(tmp_path, f"side{side_stream}", **kw))
        trainer.setup()
        trainer.backward_updates.remove()
        trainer.backward_updates = BackwardUpdates(trainer.optimizer, trainer._skip, side_stream=side_stream)
        for step in range(1, 5):
            trainer.train_step(step)
        records = trainer.collect(wait=True)
        assert bool(trainer.backward_updates._streams) == side_stream  # the updates ran where they were asked to
        results[side_stream] = ([r["loss"] for r in records], [p.detach().clone() for p in trainer.model.parameters()])
        trainer.end_backward_updates()
    (loss_a, params_a), (loss_b, params_b) = results[False], results[True]
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


_SQUARES_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from workbench.kernels.adamw_args import AdamWLaunch, AdamWStep, Moments8, SRKeys, adamw_scalars, squares_size
    from workbench.kernels.adamw8 import quant_block, scale_shape
    from workbench.kernels.triton_adamw import triton_adamw_step_
    from workbench.kernels.triton_adamw8 import triton_adamw8_step_

    device = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    launch = AdamWLaunch(block=256)
    shape, programs = (16, 256), 16  # one row a program (16 rows: 8-bit moments start at 4096 elements)
    p0 = (torch.randn(shape, generator=g) * 0.02).bfloat16().to(device)
    grad = (torch.randn(shape, generator=g) * 1e-3).bfloat16().to(device)
    coef, skip = torch.tensor(0.5, device=device), torch.zeros((), device=device)
    s = AdamWStep(adamw_scalars(2, 1e-3, 0.9, 0.999, 1e-8, 0.01), False, skip, coef, launch)
    keys = SRKeys.make(3, 2, 1, 2**32 - 700)  # its second program straddles 2**32
    qb = quant_block(shape)

    def full_state():
        return [p0.clone(), (torch.rand(shape, generator=g) * 1e-4).bfloat16().to(device),
                (torch.rand(shape, generator=g) * 1e-8).bfloat16().to(device)]

    def full(state, grad, squares):
        triton_adamw_step_(state[0], grad, state[1], state[2], s, keys, None, squares)

    def eight_state():
        return [p0.clone(), torch.randint(8, 250, shape, generator=g, dtype=torch.uint8).to(device),
                (torch.rand(scale_shape(shape, qb), generator=g) * 1e-4).to(device),
                torch.randint(8, 250, shape, generator=g, dtype=torch.uint8).to(device),
                (torch.rand(scale_shape(shape, qb), generator=g) * 1e-8).to(device)]

    def eight(state, grad, squares):
        triton_adamw8_step_(state[0], grad, Moments8(*state[1:], qb), s, keys, True, None, squares)

    for make, update in ((full_state, full), (eight_state, eight)):
        start = make()
        plain, fused = [t.clone() for t in start], [t.clone() for t in start]
        update(plain, grad, None)
        squares = torch.zeros(squares_size(grad.numel(), 256), device=device)
        update(fused, grad, squares)
        assert all(torch.equal(a, b) for a, b in zip(plain, fused)), update.__name__  # the same bits
        assert squares.numel() == programs
        torch.testing.assert_close(squares.sum(), (grad.float() * 0.5).square().sum(), rtol=1e-5, atol=0)
        # an inf in row 3 (program 3): that block keeps its old values, every other block updates as before
        bad = grad.clone()
        bad[3, 17] = float("inf")
        broken = [t.clone() for t in start]
        squares.zero_()
        update(broken, bad, squares)
        others = [r for r in range(programs) if r != 3]
        assert not torch.isfinite(squares[3]) and bool(torch.isfinite(squares[others]).all())
        for old, a, b in zip(start, plain, broken):  # weights, moments, codes and scales alike, row by row
            assert torch.equal(b[3], old[3]) and not torch.equal(a[3], old[3]), update.__name__
            assert torch.equal(a[others], b[others]), update.__name__
    print("SQUARES OK")
""")


@pytest.mark.parametrize("device", DEVICES)
def test_the_kernels_sum_the_gradients_squares_and_store_no_block_that_is_not_finite(device):
    run_triton_script(_SQUARES_SCRIPT, device, "SQUARES OK", timeout=300)


@pytest.mark.parametrize("kernel", ["bf16 moments", "8-bit moments"])
def test_the_kernels_norm_keeps_their_16_byte_loads_and_stores(kernel):
    # a data-dependent mask once made the AdamW kernel load and store one element at a time (3x slower on the
    # H200): the finite test of a block's squares is a scalar, so the compiled sm_90 code keeps its vector accesses
    pytest.importorskip("triton")
    from compile_sm90 import compile_for_h200

    from workbench.kernels.triton_adamw import _adamw_kernel
    from workbench.kernels.triton_adamw8 import _adamw8_kernel

    flags = dict(HAS_WD=True, PRECISE=False, SR=True, HAS_OUT=False, HAS_SKIP=True, HAS_COEF=False)
    scalars = dict(SKIP="*fp32", COEF="*fp32", SQ="*fp32", step_size="fp32", bc2_sqrt="fp32", key="i32")
    if kernel == "bf16 moments":
        fn, types = _adamw_kernel, dict(P="*bf16", G="*bf16", M="*bf16", V="*bf16", OUT="*bf16", **scalars)
        divisible, extra = ("P", "G", "M", "V", "OUT", "n_elements"), {}
    else:
        fn = _adamw8_kernel
        types = dict(P="*bf16", G="*bf16", MQ="*u8", MS="*fp32", VQ="*u8", VS="*fp32", OUT="*bf16", **scalars)
        divisible, extra = ("P", "G", "MQ", "MS", "VQ", "VS", "OUT"), dict(QB=64)
    ptx = {
        sq: compile_for_h200(
            fn, types, dict(flags, HAS_SQ=sq, ROUND_BY_HAND=False, BLOCK=1024, **extra), divisible
        ).asm["ptx"]
        for sq in (False, True)
    }
    for access in ("ld.global.v4", "st.global.v4", "st.global.v2"):
        assert ptx[True].count(access) == ptx[False].count(access), access
    assert ptx[True].count("st.global.v4") > 0
