"""Triton kernels for the attention sink's elementwise work around a fused attention kernel (imported lazily).

With lse the attention kernel's log-sum-exp and s_h the head's sink logit, the sink-aware output is
O' = O * exp(lse - lse'), lse' = logaddexp(lse, s_h), and the sink's gradient is
dsink_h = -sum over rows of exp(s_h - lse') * rowsum(dO * O') (workbench.models.attention_sinks_kernels). In
torch ops that is a broadcast multiply over O plus three small passes forward, and float32 copies of dO and O', a
product and two sums backward: ~4-5 ms a step of GPT-OSS-20B L8 on the H200 (profile of 2026-12-04). Here one
pass each way: `sink_scale` reads O and lse once and writes O' and lse'; `sink_grad` reads dO and O' once and
writes one partial sum per (row block, head), summed in a fixed order (deterministic).

Tensors come as views [B, H, S, D] (O, dO) and [B, H, S] (lse) with any strides, so the varlen layout
([T, H, D], lse [H, T]) and the padded one ([B, H, S, D]) take the same kernels. Float32 inside; O' is rounded
once to O's dtype, as torch's bf16 * float32 product into a bf16 tensor is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device

# Shape suffixes: B batch, H heads, S sequence (or tokens), D head dim.
_BLOCK_S = 64


@triton.jit
def _sink_scale_kernel(
    O, LSE, SINKS, O_NEW, LSE_NEW, H, S, D,
    so_b, so_h, so_s, sn_b, sn_h, sn_s, sl_b, sl_h, sl_s, sm_b, sm_h, sm_s,
    BLOCK_S: tl.constexpr, D_P2: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    rows = tl.program_id(1).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, D_P2)
    rmask = rows < S
    mask = rmask[:, None] & (cols[None, :] < D)
    lse = tl.load(LSE + b * sl_b + h * sl_h + rows * sl_s, mask=rmask, other=0.0).to(tl.float32)
    sink = tl.load(SINKS + h).to(tl.float32)
    top = tl.maximum(lse, sink)
    lse_new = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
    w = tl.exp(lse - lse_new)
    o = tl.load(O + b * so_b + h * so_h + rows[:, None] * so_s + cols[None, :], mask=mask, other=0.0)
    o_new = o.to(tl.float32) * w[:, None]
    tl.store(O_NEW + b * sn_b + h * sn_h + rows[:, None] * sn_s + cols[None, :], o_new.to(o.dtype), mask=mask)
    tl.store(LSE_NEW + b * sm_b + h * sm_h + rows * sm_s, lse_new, mask=rmask)


@triton.jit
def _sink_grad_kernel(
    DO, O, LSE, SINKS, PARTIAL, H, S, D, n_blocks, n_cols,
    sd_b, sd_h, sd_s, so_b, so_h, so_s, sl_b, sl_h, sl_s,
    BLOCK_S: tl.constexpr, D_P2: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = blk.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, D_P2)
    rmask = rows < S
    mask = rmask[:, None] & (cols[None, :] < D)
    do = tl.load(DO + b * sd_b + h * sd_h + rows[:, None] * sd_s + cols[None, :], mask=mask, other=0.0)
    o = tl.load(O + b * so_b + h * so_h + rows[:, None] * so_s + cols[None, :], mask=mask, other=0.0)
    row = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    lse = tl.load(LSE + b * sl_b + h * sl_h + rows * sl_s, mask=rmask, other=0.0).to(tl.float32)
    sink = tl.load(SINKS + h).to(tl.float32)
    p_sink = tl.where(rmask, tl.exp(sink - lse), 0.0)
    # [H, B * n_blocks]: summed over its last dim afterwards, in one order (no atomics: deterministic)
    tl.store(PARTIAL + h * n_cols + b * n_blocks + blk, tl.sum(p_sink * row, axis=0))


def _check(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    check_triton_device(o, "sink attention glue")
    if o.dim() != 4 or tuple(lse.shape) != tuple(o.shape[:3]) or sinks.shape != o.shape[1:2] or o.stride(-1) != 1:
        raise ValueError(
            f"sink kernels take O [B, H, S, D] with unit stride on D, lse [B, H, S] and sinks [H]; got "
            f"{tuple(o.shape)} (strides {o.stride()}), {tuple(lse.shape)}, {tuple(sinks.shape)}"
        )


def sink_scale(
    o_BHSD: torch.Tensor, lse_BHS: torch.Tensor, sinks: torch.Tensor, o_new: torch.Tensor, lse_new: torch.Tensor
) -> None:
    """o_new = o * exp(lse - lse_new), lse_new = logaddexp(lse, sinks[h]), written into the given views."""
    _check(o_BHSD, lse_BHS, sinks)
    if o_new.shape != o_BHSD.shape or lse_new.shape != lse_BHS.shape or o_new.stride(-1) != 1:
        raise ValueError("sink_scale's outputs must be shaped as its inputs (unit stride on D)")
    B, H, S, D = o_BHSD.shape
    if B * H * S == 0:
        return
    _sink_scale_kernel[(B * H, triton.cdiv(S, _BLOCK_S))](
        o_BHSD, lse_BHS, sinks, o_new, lse_new, H, S, D,
        *o_BHSD.stride()[:3], *o_new.stride()[:3], *lse_BHS.stride(), *lse_new.stride(),
        BLOCK_S=_BLOCK_S, D_P2=triton.next_power_of_2(D),
    )  # fmt: skip


def sink_grad(do_BHSD: torch.Tensor, o_BHSD: torch.Tensor, lse_BHS: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """dsinks (float32, [H]) = -sum over b, s of exp(sinks[h] - lse) * rowsum(dO * O) (lse: the sink-aware one)."""
    _check(o_BHSD, lse_BHS, sinks)
    if do_BHSD.shape != o_BHSD.shape or do_BHSD.stride(-1) != 1:
        raise ValueError(f"dO must be shaped as O with unit stride on D; got {tuple(do_BHSD.shape)}")
    B, H, S, D = o_BHSD.shape
    n_blocks = triton.cdiv(S, _BLOCK_S)
    # every (head, row, block) program writes its slot: no fill needed
    partial = torch.empty(H, B * n_blocks, dtype=torch.float32, device=o_BHSD.device)
    if B * H * S:
        _sink_grad_kernel[(B * H, n_blocks)](
            do_BHSD, o_BHSD, lse_BHS, sinks, partial, H, S, D, n_blocks, B * n_blocks,
            *do_BHSD.stride()[:3], *o_BHSD.stride()[:3], *lse_BHS.stride(),
            BLOCK_S=_BLOCK_S, D_P2=triton.next_power_of_2(D),
        )  # fmt: skip
    return -partial.sum(dim=1)
