"""Triton softmax + top-k of a router's float32 logits, forward and backward one kernel each (imported lazily).

torch's path is a softmax, `torch.topk` (a radix select and a bitonic sort of the k: ~64 us a call at 8192 x 128 on
an H200, 2026-12-04 trace), the renormalization's sum and division, and in the backward a scatter of the k
gradients into [T, E], the renormalization's and the softmax's backward: ~10 launches a layer over a [T, E] float32
tensor of 4 MB. Here one program takes a block of rows whole: the softmax in registers, k rounds of argmax (the
descending order torch returns; on a tie the lower expert id first, where torch's order is its implementation's),
one store each of weights and ids; the backward recomputes the softmax from the logits and writes the logits'
gradient once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device

# Shape suffixes: T tokens, E experts, K top-k.

BLOCK_T = 16


@triton.jit
def _softmax_rows(Z, rows, cols, T, E, stride_z):
    """The float32 softmax of a block of rows [BLOCK, E_P2] (padding columns 0; rows past T are not used)."""
    z = tl.load(
        Z + rows[:, None].to(tl.int64) * stride_z + cols[None, :],
        mask=(rows[:, None] < T) & (cols[None, :] < E),
        other=float("-inf"),
    )
    e = tl.exp(z - tl.max(z, axis=1)[:, None])
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _topk_fwd_kernel(
    Z, W, IDS, T, E, stride_z,
    K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, E_P2)
    ks = tl.arange(0, K_P2)
    rmask = rows < T
    p = _softmax_rows(Z, rows, cols, T, E, stride_z)
    # padding columns never win; a NaN wins first, as torch's topk ranks NaN highest (its weight stays NaN): a row
    # of NaN logits still gets k distinct experts in range, and the step's non-finite check stops the run
    left = tl.where(cols[None, :] < E, tl.where(p == p, p, 2.0), -1.0)
    weights = tl.zeros((BLOCK, K_P2), tl.float32)
    ids = tl.zeros((BLOCK, K_P2), tl.int32)
    for k in tl.static_range(K):
        best = tl.max(left, axis=1)
        # the lowest column holding the row's maximum
        at = tl.min(tl.where(left == best[:, None], cols[None, :], E_P2), axis=1)
        chosen = tl.sum(tl.where(cols[None, :] == at[:, None], p, 0.0), axis=1)
        weights = tl.where(ks[None, :] == k, chosen[:, None], weights)
        ids = tl.where(ks[None, :] == k, at[:, None], ids)
        left = tl.where(cols[None, :] == at[:, None], -1.0, left)
    if NORM:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    out = rows[:, None].to(tl.int64) * K + ks[None, :]
    omask = rmask[:, None] & (ks[None, :] < K)
    tl.store(W + out, weights, mask=omask)
    tl.store(IDS + out, ids.to(IDS.dtype.element_ty), mask=omask)


@triton.jit
def _topk_bwd_kernel(
    Z, IDS, W, GW, GZ, T, E, stride_z, stride_gz,
    K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, E_P2)
    ks = tl.arange(0, K_P2)
    rmask = rows < T
    cmask = cols[None, :] < E
    p = _softmax_rows(Z, rows, cols, T, E, stride_z)
    kidx = rows[:, None].to(tl.int64) * K + ks[None, :]
    kmask = rmask[:, None] & (ks[None, :] < K)
    ids = tl.load(IDS + kidx, mask=kmask, other=-1).to(tl.int32)
    g = tl.load(GW + kidx, mask=kmask, other=0.0).to(tl.float32)
    if NORM:  # w_k = p_k / S: d/dp_k = (g_k - sum_m g_m w_m) / S, with S the sum of the chosen p
        w = tl.load(W + kidx, mask=kmask, other=0.0).to(tl.float32)
        chosen = tl.zeros((BLOCK, K_P2), tl.float32)
        for k in tl.static_range(K):
            at = tl.sum(tl.where(ks[None, :] == k, ids, 0), axis=1)
            pk = tl.sum(tl.where(cols[None, :] == at[:, None], p, 0.0), axis=1)
            chosen = tl.where(ks[None, :] == k, pk[:, None], chosen)
        total = tl.sum(chosen, axis=1)
        g = (g - tl.sum(g * w, axis=1)[:, None]) / total[:, None]
    # the chosen probabilities' gradient spread over the experts' columns
    dp = tl.zeros((BLOCK, E_P2), tl.float32)
    for k in tl.static_range(K):
        at = tl.sum(tl.where(ks[None, :] == k, ids, 0), axis=1)
        gk = tl.sum(tl.where(ks[None, :] == k, g, 0.0), axis=1)
        dp += tl.where(cols[None, :] == at[:, None], gk[:, None], 0.0)
    dz = p * (dp - tl.sum(dp * p, axis=1)[:, None])
    tl.store(GZ + rows[:, None].to(tl.int64) * stride_gz + cols[None, :], dz, mask=rmask[:, None] & cmask)


def _launch_args(logits_TE: torch.Tensor, top_k: int) -> dict:
    E = logits_TE.shape[1]
    return dict(K=top_k, K_P2=max(2, triton.next_power_of_2(top_k)), E_P2=triton.next_power_of_2(E), BLOCK=BLOCK_T)


class _SoftmaxTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE: torch.Tensor, top_k: int, norm: bool):
        T, E = logits_TE.shape
        weights_TK = torch.empty((T, top_k), dtype=torch.float32, device=logits_TE.device)
        ids_TK = torch.empty((T, top_k), dtype=torch.int64, device=logits_TE.device)
        if T:
            _topk_fwd_kernel[(triton.cdiv(T, BLOCK_T),)](
                logits_TE, weights_TK, ids_TK, T, E, logits_TE.stride(0), NORM=norm, **_launch_args(logits_TE, top_k)
            )
        ctx.save_for_backward(logits_TE, ids_TK, weights_TK)
        ctx.norm = norm
        ctx.mark_non_differentiable(ids_TK)
        return weights_TK, ids_TK

    @staticmethod
    def backward(ctx, grad_weights_TK: torch.Tensor, _grad_ids):
        logits_TE, ids_TK, weights_TK = ctx.saved_tensors
        T, E = logits_TE.shape
        top_k = ids_TK.shape[1]
        grad_TE = torch.empty((T, E), dtype=torch.float32, device=logits_TE.device)
        if T:
            grad_weights_TK = grad_weights_TK.float().contiguous()
            _topk_bwd_kernel[(triton.cdiv(T, BLOCK_T),)](
                logits_TE, ids_TK, weights_TK, grad_weights_TK, grad_TE, T, E, logits_TE.stride(0), grad_TE.stride(0),
                NORM=ctx.norm, **_launch_args(logits_TE, top_k),
            )  # fmt: skip
        return grad_TE.to(logits_TE.dtype), None, None


def softmax_topk(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] float32, ids [T, K] int64): the top-k of the float32 softmax, renormalized if asked."""
    check_triton_device(logits_TE, "router")
    if logits_TE.dim() != 2 or logits_TE.dtype != torch.float32:
        raise ValueError(f"router='triton' takes float32 logits [T, E]; got {logits_TE.dtype} {tuple(logits_TE.shape)}")
    E = logits_TE.shape[1]
    if not 0 < top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}] (the experts), got {top_k}")
    logits_TE = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
    return _SoftmaxTopK.apply(logits_TE, top_k, bool(norm_topk_prob))
