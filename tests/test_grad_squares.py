"""The clipping norm's squares summed during the backward (train/grad_squares.py) against the norm summed afterwards.

Fresh random weights and inputs; the norm with the backward's sums equals total_grad_norm's own, bit for bit, and
is the backward's (a gradient changed after its hook ran leaves it as it was); grad accumulation sums only the last
backward's complete gradients; an unarmed backward, a large parameter without a gradient and removed hooks fall back
to summing afterwards; the trainer's steps take their norm from the backward and train as without it. Triton's
interpreter on CPU, the compiled kernel and a side stream where a GPU is present.
"""

from __future__ import annotations

import textwrap

import pytest
from triton_script import DEVICES, run_triton_script

_SCRIPT = textwrap.dedent("""
    import sys, torch
    from workbench.kernels.triton_sum_squares import MIN_NUMEL
    from workbench.train.grad_squares import GradSquares, grad_squares_for
    from workbench.train.optim import total_grad_norm
    device = sys.argv[1]
    torch.manual_seed(11)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    big = torch.nn.Linear(1024, 1024, bias=False)  # 2**20 weights: the kernel's smallest tensor
    model = torch.nn.Sequential(big, torch.nn.Tanh(), torch.nn.Linear(1024, 1100), torch.nn.Tanh(),
                                torch.nn.Linear(1100, 1024)).to(device, dtype)
    unused = torch.nn.Parameter(torch.randn(MIN_NUMEL + 5, device=device, dtype=dtype))  # never gets a gradient
    params = list(model.parameters())
    squares = grad_squares_for(params)
    assert isinstance(squares, GradSquares)

    def backward():
        x = torch.randn(64, 1024, device=device, dtype=dtype)
        model(x).float().square().mean().backward()

    def fresh(ps):
        return total_grad_norm(ps)

    # armed: the backward's sums, equal to the norm summed afterwards
    squares.arm(); backward()
    assert all(p.grad is not None for p in params)
    ref = fresh(params)
    got = total_grad_norm(params, squares)
    assert torch.equal(got, ref), (float(got), float(ref))
    # the sums are the backward's: scale a large gradient after its hook ran, and the backward's norm stays
    squares.arm(); backward()
    before = fresh(params)
    big.weight.grad.mul_(3.0)
    after = fresh(params)
    assert not torch.equal(before, after)
    assert torch.equal(total_grad_norm(params, squares), before)
    # not armed (sum_for disarmed it): summed afterwards, so the scaled gradient counts
    for p in params:
        p.grad = None
    backward()
    big.weight.grad.mul_(3.0)
    assert torch.equal(total_grad_norm(params, squares), fresh(params))
    # accumulation: the first backward unarmed, the last armed; the norm is the accumulated gradients'
    for p in params:
        p.grad = None
    backward()
    squares.arm(); backward()
    acc = fresh(params)
    big.weight.grad.mul_(3.0)
    assert torch.equal(total_grad_norm(params, squares), acc)
    # a large parameter of the group without a gradient: the group is summed afterwards
    with_unused = grad_squares_for(params + [unused])
    for p in params:
        p.grad = None
    with_unused.arm(); squares.arm(); backward()
    big.weight.grad.mul_(3.0)
    assert torch.equal(total_grad_norm(params + [unused], with_unused), fresh(params))
    with_unused.remove()
    # hooks removed: nothing summed in the backward
    squares.remove()
    for p in params:
        p.grad = None
    squares.arm(); backward()
    big.weight.grad.mul_(3.0)
    assert torch.equal(total_grad_norm(params, squares), fresh(params))
    print("GRAD SQUARES OK")
""")


@pytest.mark.parametrize("device", DEVICES)
def test_norm_summed_in_backward_equals_norm_after(device):
    run_triton_script(_SCRIPT, device, "GRAD SQUARES OK")


_TRAINER_SCRIPT = textwrap.dedent("""
    import os, sys, tempfile
    device = sys.argv[1]
    if device == "cpu":  # the interpreter's case on a GPU machine too: the run on the CPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import workbench.kernels.triton_sum_squares as tss
    tss.MIN_NUMEL = 2000  # the demo model's tensors are small: let the kernel (and so the hooks) take its larger ones
    from workbench.config import RunConfig
    from workbench.train.loop import Trainer

    def run(in_backward):
        rc = RunConfig.demo(output_dir=tempfile.mkdtemp(), data__seq_len=64, train__steps=3, train__global_batch_size=4,
                            train__local_batch_size=2, train__save_final_checkpoint=False)
        trainer = Trainer(rc)
        trainer.setup()
        assert str(trainer.device).startswith(device), trainer.device
        if not in_backward:
            trainer.grad_squares.remove()
            trainer.grad_squares = None
        for step in (1, 2, 3):
            trainer.train_step(step)
        records = trainer.collect(wait=True)
        taken = trainer.grad_squares.taken if trainer.grad_squares is not None else 0
        trainer.remove_step_hooks()
        return [(r["grad_norm"], r["loss"]) for r in records], taken

    summed, taken = run(True)
    after, _ = run(False)
    assert taken == 3, taken  # every step's norm (2 micro-batches each) from the last backward's sums
    assert summed == after, (summed, after)
    print("TRAINER GRAD SQUARES OK")
""")


@pytest.mark.slow  # the whole trainer in Triton's interpreter: ~90 s on 2 cores
@pytest.mark.parametrize("device", DEVICES)
def test_trainer_takes_the_norm_from_the_backward(device):
    run_triton_script(_TRAINER_SCRIPT, device, "TRAINER GRAD SQUARES OK")
