"""The multi-tensor Triton AdamW (kernels/triton_adamw_multi.py) equals the per-tensor kernel bit for bit.

Run in Triton's interpreter on CPU (the compiled kernel where a CUDA GPU is present), in a subprocess
so TRITON_INTERPRET applies before triton is imported.
"""

from __future__ import annotations

import textwrap

import pytest
from triton_script import DEVICES, run_triton_script

_SCRIPT = textwrap.dedent("""
    import sys, torch
    from workbench.kernels.adamw import torch_adamw_step_
    from workbench.kernels.adamw_args import AdamWLaunch, AdamWStep, SRKeys, adamw_scalars
    from workbench.kernels.triton_adamw import triton_adamw_step_
    from workbench.kernels.triton_adamw_multi import triton_adamw_multi_step_
    torch.manual_seed(0)
    torch.set_default_device(sys.argv[1])
    launch = AdamWLaunch(block=128, num_warps=4)
    # sizes below, at and across a block; a base that straddles 2**32 inside a block
    sizes, bases = (1, 127, 128, 129, 1000, 3000), (0, 0, 5, 2 ** 32 - 300, 3 * 2 ** 32, 7)
    cache = {}
    for sr_on, wd, skip_value, coef in ((True, 0.0, 0.0, None), (True, 1e-2, 0.0, 0.5), (False, 1e-2, 0.0, None),
                                        (True, 0.0, 1.0, None)):
        skip = torch.tensor(skip_value, dtype=torch.float32)
        grad_coef = None if coef is None else torch.tensor(coef, dtype=torch.float32)
        groups = [((0.02 * torch.randn(n)).bfloat16(), torch.randn(n).bfloat16(), (0.1 * torch.randn(n)).bfloat16(),
                   torch.rand(n).bfloat16()) for n in sizes]
        s = AdamWStep(adamw_scalars(3, 1e-5, 0.9, 0.95, 1e-8, wd), False, skip, grad_coef, launch)
        keys = [SRKeys.make(7, 3, i, base=b) for i, b in enumerate(bases)] if sr_on else None
        one = [[t.clone() for t in g] for g in groups]
        many = [[t.clone() for t in g] for g in groups]
        ref = [[t.clone() for t in g] for g in groups]
        for i, g in enumerate(one):
            triton_adamw_step_(*g, s, sr=None if keys is None else keys[i])
        for i, g in enumerate(ref):
            torch_adamw_step_(*g, s, sr=None if keys is None else keys[i])
        triton_adamw_multi_step_([tuple(g) for g in many], s, sr=keys, cache=cache)
        for a, b, c, g in zip(one, many, ref, groups):
            for x, y, z in zip(a, b, c):
                assert torch.equal(x, y), (sr_on, wd, x.numel(), (x.float() - y.float()).abs().max())
                assert torch.equal(x, z), (sr_on, wd, x.numel())
        moved = any(not torch.equal(b[0], g[0]) for b, g in zip(many, groups))
        assert moved != bool(skip_value)  # the skip flag stores nothing; else the params move
    assert len(cache) == 1  # the block map of these sizes, built once
    # float32 params with bf16 grads: another dtype per role, the same result as the per-tensor kernel
    groups = [(torch.randn(n), torch.randn(n).bfloat16(), torch.zeros(n), torch.zeros(n)) for n in sizes]
    s = AdamWStep(adamw_scalars(1, 1e-3, 0.9, 0.999, 1e-8, 0.0), launch=launch)
    one = [[t.clone() for t in g] for g in groups]
    many = [tuple(t.clone() for t in g) for g in groups]
    for g in one:
        triton_adamw_step_(*g, s)
    triton_adamw_multi_step_(many, s)
    assert all(torch.equal(x, y) for a, b in zip(one, many) for x, y in zip(a, b))
    try:
        triton_adamw_multi_step_([groups[0], tuple(t.bfloat16() for t in groups[1])], s)
    except ValueError as err:
        assert "one dtype per role" in str(err)
    else:
        raise AssertionError("mixed dtypes were taken")
    print("MULTI OK")
""")

# TritonAdamW with multi_tensor_numel: the small tensors share launches, the result is the per-tensor one.
_OPTIMIZER_SCRIPT = textwrap.dedent("""
    import sys, torch
    from workbench.kernels.adamw_args import AdamWLaunch
    from workbench.train.triton_adamw_optimizer import TritonAdamW
    torch.manual_seed(0)
    torch.set_default_device(sys.argv[1])
    shapes = [(16, 40), (40, 16), (7,), (3, 50, 4), (300, 9), (1,)]
    base = [torch.randn(s).mul(0.02).bfloat16() for s in shapes] + [torch.randn(64, 8)]  # one float32 param
    grads = [[torch.randn(s, dtype=b.dtype) for s, b in zip([t.shape for t in base], base)] for _ in range(4)]
    results = []
    for numel in (0, 1000):
        params = [torch.nn.Parameter(b.clone()) for b in base]
        groups = [{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0}]
        opt = TritonAdamW(groups, lr=1e-3, precision="bf16_sr", seed=3, kernel="triton",
                          launch=AdamWLaunch(block=128), multi_tensor_numel=numel)
        opt.found_inf = torch.zeros((), dtype=torch.float32)
        opt.grad_coef = torch.tensor(0.75, dtype=torch.float32)
        for step_grads in grads:
            for q, g in zip(params, step_grads):
                q.grad = g.clone()
            opt.step()
        results.append(([q.detach().clone() for q in params], dict(opt.updates),
                        [opt.state[q]["exp_avg_sq"].clone() for q in params]))
    (p0, u0, v0), (p1, u1, v1) = results
    assert all(torch.equal(a, b) for a, b in zip(p0, p1)) and all(torch.equal(a, b) for a, b in zip(v0, v1))
    assert u0 == {"triton": 28} and u1 == {"triton": 4, "triton_multi": 24}, (u0, u1)  # 6 of 7 tensors <= 1000
    print("OPTIMIZER OK")
""")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("script", ["kernel", "optimizer"])
def test_multi_tensor_kernel_equals_the_per_tensor_kernel_bit_for_bit(device, script):
    code, marker = (_SCRIPT, "MULTI OK") if script == "kernel" else (_OPTIMIZER_SCRIPT, "OPTIMIZER OK")
    run_triton_script(code, device, marker)
