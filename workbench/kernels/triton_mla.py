"""Multi-head latent attention's (DeepSeek-V3, Moonlight) query/key/value assembly with RoPE, one Triton kernel.

Transformers splits q into its no-position and rotary parts, rotates the rotary part (interleaved pairs
as strided slices, or rotate_half), concatenates them back, rotates the one shared rotary key, broadcasts
it over the heads and copies it beside every head's no-position key: on Moonlight L8 at 8k tokens a
profile shows ~3.5 ms of `cat` and ~2.8 ms of copies per step (1 x H200, 2026-12-02), and the backward
as many. Here one kernel per direction reads q, the kv_b projection and the shared rotary key once and
writes query, key and value [B, S, H, D] once; the backward writes the gradients of those three inputs,
the shared key's summed over heads. Numerics: float32 inside, rounded once to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device

# Shape suffixes: B batch, S sequence, H heads, Q query/key head dim (nope + rope), K kv_b head dim
# (nope + v), R rotary dim.


@triton.jit
def _rotation(cos_ptr, sin_ptr, cols, cmask, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The pair (x1, x2) a rotary angle mixes and that angle's (c1, s1, c2, s2), float32."""
    if INTERLEAVE:  # pairs (x0, x1), (x2, x3), ...; Transformers takes the angle from cos's first half
        i1, i2 = 2 * cols, 2 * cols + 1
        c1 = tl.load(cos_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        c2, s2 = c1, s1
    else:  # rotate_half: (x_j, x_{j+R/2})
        i1, i2 = cols, cols + HALF
        c1 = tl.load(cos_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    return i1, i2, c1, s1, c2, s2


@triton.jit
def _head_columns(H, NOPE: tl.constexpr, HALF: tl.constexpr, H_P2: tl.constexpr, NOPE_P2: tl.constexpr,
                  HALF_P2: tl.constexpr):  # fmt: skip
    """One program's head rows, no-position columns and rotary pair columns, with their masks."""
    heads = tl.arange(0, H_P2)[:, None]
    hmask = heads < H
    nope = tl.arange(0, NOPE_P2)[None, :]
    cols = tl.arange(0, HALF_P2)
    cmask = cols < HALF
    return heads, hmask, nope, hmask & (nope < NOPE), cols, cmask


@triton.jit
def _mla_fwd_kernel(
    Q, KV, KR, COS, SIN, QO, KO, VO,
    S, H,
    sq_b, sq_s, sq_h, skv_b, skv_s, skv_h, skr_b, skr_s, sc_b, sc_s,
    NOPE: tl.constexpr, HALF: tl.constexpr, V: tl.constexpr,
    H_P2: tl.constexpr, NOPE_P2: tl.constexpr, HALF_P2: tl.constexpr, V_P2: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # one (batch, position): every head shares its angles and rotary key
    b = pid // S
    s = pid % S
    QD: tl.constexpr = NOPE + 2 * HALF
    heads, hmask, nope, nmask, cols, cmask = _head_columns(H, NOPE, HALF, H_P2, NOPE_P2, HALF_P2)
    out_row = pid * H * QD + heads * QD  # query and key: contiguous [B, S, H, QD]
    # the no-position parts: copies
    q_row = Q + b * sq_b + s * sq_s + heads * sq_h
    tl.store(QO + out_row + nope, tl.load(q_row + nope, mask=nmask), mask=nmask)
    kv_row = KV + b * skv_b + s * skv_s + heads * skv_h
    tl.store(KO + out_row + nope, tl.load(kv_row + nope, mask=nmask), mask=nmask)
    vcols = tl.arange(0, V_P2)[None, :]
    vmask = hmask & (vcols < V)
    tl.store(VO + pid * H * V + heads * V + vcols, tl.load(kv_row + NOPE + vcols, mask=vmask), mask=vmask)
    # the rotary parts
    c_base = b * sc_b + s * sc_s
    i1, i2, c1, s1, c2, s2 = _rotation(COS + c_base, SIN + c_base, cols, cmask, HALF, INTERLEAVE)
    qmask = hmask & cmask[None, :]
    x1 = tl.load(q_row + NOPE + i1[None, :], mask=qmask, other=0.0).to(tl.float32)
    x2 = tl.load(q_row + NOPE + i2[None, :], mask=qmask, other=0.0).to(tl.float32)
    y1 = x1 * c1[None, :] - x2 * s1[None, :]
    y2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(QO + out_row + NOPE + cols[None, :], y1.to(QO.dtype.element_ty), mask=qmask)
    tl.store(QO + out_row + NOPE + HALF + cols[None, :], y2.to(QO.dtype.element_ty), mask=qmask)
    kr = KR + b * skr_b + s * skr_s
    k1 = tl.load(kr + i1, mask=cmask, other=0.0).to(tl.float32)
    k2 = tl.load(kr + i2, mask=cmask, other=0.0).to(tl.float32)
    r1 = (k1 * c1 - k2 * s1).to(KO.dtype.element_ty)
    r2 = (k2 * c2 + k1 * s2).to(KO.dtype.element_ty)
    zero = tl.zeros([H_P2, HALF_P2], dtype=KO.dtype.element_ty)
    tl.store(KO + out_row + NOPE + cols[None, :], zero + r1[None, :], mask=qmask)
    tl.store(KO + out_row + NOPE + HALF + cols[None, :], zero + r2[None, :], mask=qmask)


@triton.jit
def _mla_bwd_kernel(
    GQO, GKO, GVO, COS, SIN, GQ, GKV, GKR,
    S, H,
    sc_b, sc_s,
    NOPE: tl.constexpr, HALF: tl.constexpr, V: tl.constexpr,
    H_P2: tl.constexpr, NOPE_P2: tl.constexpr, HALF_P2: tl.constexpr, V_P2: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    b = pid // S
    s = pid % S
    QD: tl.constexpr = NOPE + 2 * HALF
    KD: tl.constexpr = NOPE + V
    heads, hmask, nope, nmask, cols, cmask = _head_columns(H, NOPE, HALF, H_P2, NOPE_P2, HALF_P2)
    qmask = hmask & cmask[None, :]
    row = pid * H * QD + heads * QD  # every gradient here is contiguous
    kv_row = pid * H * KD + heads * KD
    tl.store(GQ + row + nope, tl.load(GQO + row + nope, mask=nmask), mask=nmask)
    tl.store(GKV + kv_row + nope, tl.load(GKO + row + nope, mask=nmask), mask=nmask)
    vcols = tl.arange(0, V_P2)[None, :]
    vmask = hmask & (vcols < V)
    tl.store(GKV + kv_row + NOPE + vcols, tl.load(GVO + pid * H * V + heads * V + vcols, mask=vmask), mask=vmask)
    c_base = b * sc_b + s * sc_s
    i1, i2, c1, s1, c2, s2 = _rotation(COS + c_base, SIN + c_base, cols, cmask, HALF, INTERLEAVE)
    # the transpose of [[c1, -s1], [s2, c2]] applied to the output gradient
    g1 = tl.load(GQO + row + NOPE + cols[None, :], mask=qmask, other=0.0).to(tl.float32)
    g2 = tl.load(GQO + row + NOPE + HALF + cols[None, :], mask=qmask, other=0.0).to(tl.float32)
    tl.store(GQ + row + NOPE + i1[None, :], (g1 * c1[None, :] + g2 * s2[None, :]).to(GQ.dtype.element_ty), mask=qmask)
    tl.store(GQ + row + NOPE + i2[None, :], (g2 * c2[None, :] - g1 * s1[None, :]).to(GQ.dtype.element_ty), mask=qmask)
    # the shared rotary key reached every head: its gradient is the heads' sum
    h1 = tl.sum(tl.load(GKO + row + NOPE + cols[None, :], mask=qmask, other=0.0).to(tl.float32), axis=0)
    h2 = tl.sum(tl.load(GKO + row + NOPE + HALF + cols[None, :], mask=qmask, other=0.0).to(tl.float32), axis=0)
    tl.store(GKR + pid * 2 * HALF + i1, (h1 * c1 + h2 * s2).to(GKR.dtype.element_ty), mask=cmask)
    tl.store(GKR + pid * 2 * HALF + i2, (h2 * c2 - h1 * s1).to(GKR.dtype.element_ty), mask=cmask)


def _sizes(q_BSHQ: torch.Tensor, kv_BSHK: torch.Tensor, nope: int) -> dict:
    H, R = q_BSHQ.shape[2], q_BSHQ.shape[3] - nope
    V = kv_BSHK.shape[3] - nope
    p2 = triton.next_power_of_2
    return dict(
        NOPE=nope, HALF=R // 2, V=V, H_P2=max(2, p2(H)), NOPE_P2=max(2, p2(nope)), HALF_P2=max(2, p2(R // 2)),
        V_P2=max(2, p2(V)),
    )  # fmt: skip


def angles_supported(cos_BSR: torch.Tensor, batch: int, seq: int, rot_dim: int) -> bool:
    """Whether the kernels take these RoPE angles: [1 or B, S, R], R even, unit stride on R."""
    return (
        cos_BSR.dim() == 3
        and rot_dim > 0
        and rot_dim % 2 == 0
        and cos_BSR.shape[1:] == (seq, rot_dim)
        and cos_BSR.shape[0] in (1, batch)
        and cos_BSR.stride(-1) == 1
    )


def supported(q_BSHQ, kv_BSHK, k_rot_BSR, cos_BSR, nope: int) -> bool:
    """Shapes the kernels take: the angles', and unit stride on the last dim of every input."""
    if not (q_BSHQ.dim() == kv_BSHK.dim() == 4 and k_rot_BSR.dim() == 3):
        return False
    B, S, H, QD = q_BSHQ.shape
    return (
        angles_supported(cos_BSR, B, S, QD - nope)
        and kv_BSHK.shape[:3] == (B, S, H)
        and kv_BSHK.shape[3] > nope
        and k_rot_BSR.shape == (B, S, QD - nope)
        and all(t.stride(-1) == 1 for t in (q_BSHQ, kv_BSHK, k_rot_BSR))
    )


class _MlaQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BSHQ, kv_BSHK, k_rot_BSR, cos, sin, nope: int, interleave: bool):
        check_triton_device(q_BSHQ, "rope")
        B, S, H, QD = q_BSHQ.shape
        sizes = _sizes(q_BSHQ, kv_BSHK, nope)
        query = torch.empty((B, S, H, QD), dtype=q_BSHQ.dtype, device=q_BSHQ.device)
        key = torch.empty_like(query)
        value = torch.empty((B, S, H, sizes["V"]), dtype=kv_BSHK.dtype, device=kv_BSHK.device)
        cos_b = 0 if cos.shape[0] == 1 else cos.stride(0)
        if B * S:
            _mla_fwd_kernel[(B * S,)](
                q_BSHQ, kv_BSHK, k_rot_BSR, cos, sin, query, key, value,
                S, H,
                q_BSHQ.stride(0), q_BSHQ.stride(1), q_BSHQ.stride(2),
                kv_BSHK.stride(0), kv_BSHK.stride(1), kv_BSHK.stride(2),
                k_rot_BSR.stride(0), k_rot_BSR.stride(1), cos_b, cos.stride(1),
                INTERLEAVE=interleave, num_warps=4, **sizes,
            )  # fmt: skip
        ctx.save_for_backward(cos, sin)
        ctx.shapes = (q_BSHQ.shape, kv_BSHK.shape, k_rot_BSR.shape, k_rot_BSR.dtype, interleave, sizes)
        return query, key, value

    @staticmethod
    def backward(ctx, g_query, g_key, g_value):
        cos, sin = ctx.saved_tensors
        q_shape, kv_shape, kr_shape, kr_dtype, interleave, sizes = ctx.shapes
        ref = next(g for g in (g_query, g_key, g_value) if g is not None)
        # an output without a gradient contributes none
        g_query = torch.zeros(q_shape, dtype=ref.dtype, device=ref.device) if g_query is None else g_query.contiguous()
        g_key = torch.zeros(q_shape, dtype=ref.dtype, device=ref.device) if g_key is None else g_key.contiguous()
        v_shape = (*kv_shape[:3], sizes["V"])
        g_value = torch.zeros(v_shape, dtype=ref.dtype, device=ref.device) if g_value is None else g_value.contiguous()
        g_q = torch.empty(q_shape, dtype=g_query.dtype, device=ref.device)
        g_kv = torch.empty(kv_shape, dtype=g_key.dtype, device=ref.device)
        g_kr = torch.empty(kr_shape, dtype=kr_dtype, device=ref.device)
        B, S, H = q_shape[:3]
        cos_b = 0 if cos.shape[0] == 1 else cos.stride(0)
        if B * S:
            _mla_bwd_kernel[(B * S,)](
                g_query, g_key, g_value, cos, sin, g_q, g_kv, g_kr,
                S, H, cos_b, cos.stride(1),
                INTERLEAVE=interleave, num_warps=4, **sizes,
            )  # fmt: skip
        return g_q, g_kv, g_kr, None, None, None, None


def mla_qkv(
    q_BSHQ: torch.Tensor,
    kv_BSHK: torch.Tensor,
    k_rot_BSR: torch.Tensor,
    cos_BSR: torch.Tensor,
    sin_BSR: torch.Tensor,
    nope: int,
    interleave: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's (query, key, value) [B, S, H, *] as Transformers' DeepseekV3Attention builds them; cos/sin get no grad.

    q: the q projection [B, S, H, nope + R]; kv: the kv_b projection [B, S, H, nope + V]; k_rot: the shared
    rotary key [B, S, R]; `interleave`: config.rope_interleave (pairs (x0, x1), ...) or rotate_half.
    """
    cos, sin = cos_BSR.detach(), sin_BSR.detach()
    if sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError(f"mla_qkv: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must share shape and strides")
    if not supported(q_BSHQ, kv_BSHK, k_rot_BSR, cos, nope):
        shapes = [tuple(t.shape) for t in (q_BSHQ, kv_BSHK, k_rot_BSR, cos)]
        raise ValueError(f"mla_qkv: unsupported shapes q, kv, k_rot, cos {shapes} for nope={nope}")
    return _MlaQKV.apply(q_BSHQ, kv_BSHK, k_rot_BSR, cos, sin, int(nope), bool(interleave))
