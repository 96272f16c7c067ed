"""Per-head RMSNorm + RoPE in one kernel each way (kernels/triton_norm_rope.py) against the two kernels it replaces
and against Transformers' float32 q_norm + apply_rotary_pos_emb."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from triton_script import DEVICES, run_triton_script

HAS_TRITON = importlib.util.find_spec("triton") is not None

_SCRIPT = textwrap.dedent("""
import sys, torch
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf
from workbench.kernels.rms_norm import rms_norm
from workbench.kernels.triton_norm_rope import norm_rope
from workbench.kernels.triton_rope import apply_rope

device = sys.argv[1]
g = torch.Generator().manual_seed(0)

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

# q laid out as [B, S, H, D] memory seen as [B, H, S, D], as the engine's attention hands it; full- and half-width
# cos/sin (Qwen3's cat(c, c), GPT-OSS's halves); 5 heads (not a power of two)
for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
    for B, S, H, D, half in ((2, 7, 5, 32, False), (1, 9, 4, 64, True), (2, 33, 8, 128, False)):
        x0 = torch.randn(B, S, H, D, generator=g).to(dtype).to(device).transpose(1, 2)
        w0 = (1 + 0.2 * torch.randn(D, generator=g)).to(dtype).to(device)
        width = D // 2 if half else D
        ang = torch.randn(B, S, width, generator=g)
        cos, sin = ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)
        dy = torch.randn(B, H, S, D, generator=g).to(dtype).to(device)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = norm_rope(x, w, 1e-6, cos, sin)
        assert y.stride() == x0.stride(), (y.stride(), x0.stride())  # the input's layout
        y.backward(dy)
        # the two kernels it replaces, composed: the norm on the [B, S, H, D] view, then RoPE
        xs, ws = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        normed = rms_norm(xs.transpose(1, 2), ws, 1e-6, "triton").transpose(1, 2)
        ys = apply_rope(normed, normed, cos, sin)[0]
        ys.backward(dy)
        # Transformers' formula in float32
        xr, wr = x0.float().clone().requires_grad_(), w0.float().clone().requires_grad_()
        cf, sf = (torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)) if half else (cos, sin)
        nr = rms_norm(xr.transpose(1, 2), wr, 1e-6, "torch").transpose(1, 2)
        yr = nr * cf.float()[:, None] + hf.rotate_half(nr) * sf.float()[:, None]
        yr.backward(dy.float())
        for name, a, b, r in (("y", y, ys, yr), ("dx", x.grad, xs.grad, xr.grad), ("dw", w.grad, ws.grad, wr.grad)):
            assert rel(a, b) < tol, (dtype, (B, S, H, D, half), name, "vs two kernels", rel(a, b))
            assert rel(a, r) < (2e-5 if dtype == torch.float32 else 2e-2), (dtype, name, "vs float32", rel(a, r))
# a frozen weight (LoRA's norms): no weight gradient, the same input gradient
x = x0.clone().requires_grad_()
norm_rope(x, w0, 1e-6, cos, sin).backward(dy)
assert rel(x.grad, xs.grad) < 2e-2
print("NORM ROPE OK")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton: its interpreter runs on CPU)")
@pytest.mark.parametrize("device", DEVICES)
def test_norm_rope_equals_the_norm_then_rope_kernels_and_transformers(device):
    run_triton_script(_SCRIPT, device, "NORM ROPE OK")
