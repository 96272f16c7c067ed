"""TritonAdamW's kernel is chosen once (workbench.backends), its launch shape is a parameter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import workbench.backends as backends
from workbench.kernels.adamw import adamw_step_
from workbench.kernels.adamw_args import AdamWLaunch, AdamWStep, adamw_scalars
from workbench.train.optim import describe_optimizer, make_adamw
from workbench.train.triton_adamw_optimizer import TritonAdamW

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _param(n: int = 7, dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(n, dtype=dtype))
    p.grad = torch.randn(n, dtype=dtype)
    return p


def test_the_kernel_is_decided_when_the_optimizer_is_built(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert TritonAdamW([_param()]).kernel == "torch"  # CPU parameters, no interpreter: backends says torch
    monkeypatch.setattr(
        backends,
        "availability",
        lambda field, choice, device, world_size=1: (
            (True, "") if torch.device(device).type == "cuda" else (False, "needs CUDA")
        ),
    )
    groups = [{"params": [_param(dtype=torch.bfloat16)]}]  # bf16: bf16_sr needs the workbench AdamW
    assert make_adamw(groups, "adamw", torch.device("cuda"), lr=1e-3).kernel == "triton"
    assert make_adamw(groups, "adamw", torch.device("cuda"), lr=1e-3, precision="bf16_sr").kernel == "triton"
    assert make_adamw(groups, "adamw", torch.device("cpu"), lr=1e-3, precision="bf16_sr").kernel == "torch"
    # CUDA without triton: the workbench AdamW that bf16_sr needs runs its torch ops (no triton import later)
    monkeypatch.setattr(
        backends, "availability", lambda *a, **k: (False, "triton is not installed: pip install triton")
    )
    assert make_adamw(groups, "adamw", torch.device("cuda"), lr=1e-3, precision="bf16_sr").kernel == "torch"


def test_an_explicit_torch_kernel_is_kept_and_bad_choices_are_refused():
    p = _param()
    opt = TritonAdamW([p], kernel="torch")
    opt.step()
    assert opt.updates == {"torch": 1}
    assert describe_optimizer(opt).endswith("kernel torch, precision bf16")  # results files say which ran
    with pytest.raises(ValueError, match="kernel must be one of"):
        TritonAdamW([p], kernel="cuda")
    with pytest.raises(TypeError, match="AdamWLaunch"):
        TritonAdamW([p], launch=(1024, 4))
    with pytest.raises(ValueError, match="power of two"):
        AdamWLaunch(block=1000)
    with pytest.raises(ValueError, match="num_warps"):
        AdamWLaunch(num_warps=3)
    s = adamw_scalars(1, 1e-3, 0.9, 0.999, 1e-8, 0.0)
    with pytest.raises(ValueError, match="resolved by the caller"):
        adamw_step_(p.data, p.grad, torch.zeros(7), torch.zeros(7), AdamWStep(s), kernel="auto")


def check_launch_shapes(device: str) -> None:
    """Every launch shape gives the torch-op update bit for bit (n is no multiple of any block);
    kernel="torch" stays torch even where Triton could run."""
    from workbench.kernels.adamw import torch_adamw_step_
    from workbench.kernels.triton_adamw import triton_adamw_step_

    s = adamw_scalars(3, 1e-2, 0.9, 0.999, 1e-8, 0.1)
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        base = [torch.randn(1000, generator=g).to(dtype) for _ in range(2)]
        base = [t.to(device) for t in base + [0.1 * base[1], 0.01 * base[1] * base[1]]]
        ref = [t.clone() for t in base]
        torch_adamw_step_(*ref, AdamWStep(s))
        for launch in (AdamWLaunch(128, 1), AdamWLaunch(512, 2), AdamWLaunch()):
            got = [t.clone() for t in base]
            triton_adamw_step_(*got, AdamWStep(s, launch=launch))
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (dtype, launch)
    p = torch.nn.Parameter(torch.randn(300, device=device))
    p.grad = torch.randn(300, device=device)
    opt = TritonAdamW([p], launch=AdamWLaunch(128, 1), multi_tensor_numel=0)  # the per-tensor launch
    assert opt.kernel == "triton"
    opt.step()
    assert opt.updates == {"triton": 1}, opt.updates
    opt = TritonAdamW([p], kernel="torch")
    opt.step()
    assert opt.updates == {"torch": 1}, opt.updates


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the interpreter runs the kernel on CPU)")
def test_the_launch_shape_is_a_parameter_of_the_kernel_not_module_state():
    import workbench.kernels.triton_adamw as kernel

    assert not hasattr(kernel, "BLOCK") and not hasattr(kernel, "NUM_WARPS")


@pytest.mark.slow  # Triton's interpreter (tests/triton_script.py)
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the interpreter runs the kernel on CPU)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernel instead")
def test_launch_shapes_in_the_interpreter():
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        from test_adamw_kernel_choice import check_launch_shapes
        check_launch_shapes("cpu")
        print("LAUNCH OK")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "LAUNCH OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")
def test_launch_shapes_compiled_on_cuda():
    check_launch_shapes("cuda")
