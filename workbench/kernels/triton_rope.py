"""Triton rotary position embedding (rotate-half convention), forward and backward (imported lazily).

Transformers applies RoPE as `x * cos + rotate_half(x) * sin`: a `cat` for rotate_half, a neg, two
multiplies and an add per tensor, each a full pass over q ([B, 32, S, 128] for Qwen3-30B-A3B) and
k, and as many again in backward: ~7 ms of a 141 ms 1 x H200 step at 8k tokens (profile of
2026-12-01). One kernel per direction reads x (or its gradient) once and writes the result once.
Numerics: float32 inside, rounded once to x's dtype (Transformers rounds after each op in bf16).
cos/sin come as Transformers' rotary embeddings make them: [B, S, D] (cos = cat(c, c), Llama / Qwen style) or
[B, S, D / 2] (GPT-OSS's half-width c and s, applied to both halves: the same rotation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device

# Shape suffixes: B batch, H heads, S sequence, D head dim.


@triton.jit
def _rope_kernel(
    X,
    COS,
    SIN,
    OUT,
    S,
    H,
    sx_b,
    sx_h,
    sx_s,
    so_b,
    so_h,
    so_s,
    sc_b,
    sc_s,
    HALF: tl.constexpr,
    H_P2: tl.constexpr,
    BACKWARD: tl.constexpr,
    COS_HALF_WIDTH: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # one (batch, position): every head shares its cos/sin
    b = pid // S
    s = pid % S
    heads = tl.arange(0, H_P2)
    cols = tl.arange(0, HALF)
    hmask = heads[:, None] < H
    c_base = b * sc_b + s * sc_s
    c1 = tl.load(COS + c_base + cols).to(tl.float32)[None, :]
    s1 = tl.load(SIN + c_base + cols).to(tl.float32)[None, :]
    if COS_HALF_WIDTH:  # one c and s for both halves
        c2 = c1
        s2 = s1
    else:
        c2 = tl.load(COS + c_base + HALF + cols).to(tl.float32)[None, :]
        s2 = tl.load(SIN + c_base + HALF + cols).to(tl.float32)[None, :]
    x_ptr = X + b * sx_b + s * sx_s + heads[:, None] * sx_h + cols[None, :]
    x1 = tl.load(x_ptr, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=hmask, other=0.0).to(tl.float32)
    if BACKWARD:
        # the transpose of [[c1, -s1], [s2, c2]] applied to the output gradient
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    o_ptr = OUT + b * so_b + s * so_s + heads[:, None] * so_h + cols[None, :]
    tl.store(o_ptr, y1.to(OUT.dtype.element_ty), mask=hmask)
    tl.store(o_ptr + HALF, y2.to(OUT.dtype.element_ty), mask=hmask)


def supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Shapes the kernel takes: x [B, H, S, D] with unit stride on D, cos [B or 1, S, D or D / 2], D even and a
    power of 2."""
    D = x.shape[-1]
    return (
        x.dim() == 4
        and cos.dim() == 3
        and x.stride(-1) == 1
        and D % 2 == 0
        and (D & (D - 1)) == 0
        and cos.shape[-2] == x.shape[2]
        and cos.shape[-1] in (D, D // 2)
        and cos.shape[0] in (1, x.shape[0])
        and cos.stride(-1) == 1
    )


def rope(x_BHSD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (or, with `backward`, its transpose applied to a gradient); half-width cos/sin
    [B, S, D / 2] stand for cat(cos, cos) and cat(sin, sin)."""
    check_triton_device(x_BHSD, "rope")
    if not supported(x_BHSD, cos_BSD) or sin_BSD.shape != cos_BSD.shape or sin_BSD.stride() != cos_BSD.stride():
        raise ValueError(f"rope kernel: unsupported shapes x {tuple(x_BHSD.shape)} cos {tuple(cos_BSD.shape)}")
    B, H, S, D = x_BHSD.shape
    out = torch.empty_like(x_BHSD)  # keeps x's layout (often [B, S, H, D] memory seen as [B, H, S, D])
    if out.stride(-1) != 1:
        out = torch.empty(x_BHSD.shape, dtype=x_BHSD.dtype, device=x_BHSD.device)
    cos_b = 0 if cos_BSD.shape[0] == 1 else cos_BSD.stride(0)
    if B * S:
        _rope_kernel[(B * S,)](
            x_BHSD,
            cos_BSD,
            sin_BSD,
            out,
            S,
            H,
            x_BHSD.stride(0),
            x_BHSD.stride(1),
            x_BHSD.stride(2),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            cos_b,
            cos_BSD.stride(1),
            HALF=D // 2,
            H_P2=max(2, triton.next_power_of_2(H)),
            BACKWARD=backward,
            COS_HALF_WIDTH=cos_BSD.shape[-1] != D,
            num_warps=4,
        )
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        return rope(grad, cos, sin, backward=True), None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Transformers' apply_rotary_pos_emb (unsqueeze_dim=1) for q/k [B, H, S, D]; cos/sin get no gradient."""
    cos, sin = cos.detach(), sin.detach()
    return _Rope.apply(q, cos, sin), _Rope.apply(k, cos, sin)
