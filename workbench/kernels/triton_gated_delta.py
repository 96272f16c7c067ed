"""The gated delta rule's walk over its chunks in two Triton kernels (forward and backward), float32 state.

kernels/gated_delta.py prepares every chunk at once (chunk_prepare: the triangular solves, the decays); what is left
is a recurrence over the chunks on the [K, V] state of each (batch, head), which in torch ops is a loop of c chunk
steps of three small matmuls each, forward and backward: at 4096 tokens 64 steps per layer of kernels far too small
to fill a GPU, and the host's launches set the pace (Qwen3.5's widths on an H100, 2026-12-06: 1,240 kernels and
28 ms a layer forward + backward, 15 ms of them on the GPU). Here one program walks all the chunks of one (batch,
head, block of V columns) with the state in registers, and the walk keeps only what depends on the state before it:
    forward   Vn = U - W S,   S' = d S + KO^T Vn                      (S the chunk's incoming state, [K, V])
    backward  dVn = A^T dO + KO dS',   dS = d dS' - W^T dVn + Q^T dO  (dS' the gradient reaching S')
Everything else is a batched matmul over all the chunks at once, outside the walk: the output O = Q S + A Vn from
the stored incoming states and corrected values, and in the backward A^T dO and Q^T dO before the walk, dW = -dVn S^T,
dQ = dO S^T, dA = dO Vn^T, dKO = Vn dS'^T and dd = <S, dS'> after it (the walk stores each chunk's dS'). Two small
products a chunk in the sequential part instead of four forward and eight backward: the walk with all products
inside took 2.5 ms forward and 9.0 ms backward per layer at Qwen3.5's widths on an H100 (2026-12-06), its backward
writing per-V-block partial sums of dW, dQ, dA and dKO; the whole layer forward + backward went from 18.9 ms to 9.8
(with eight warps, the same machine kind).
The products are float32 (input_precision "ieee"): the recurrence compounds rounding over the chunks, and it is what
the torch walk computes (one Qwen3.5 layer's bf16 output within 4.4e-4 of the compiled torch walk's, its input
gradient within 3.1e-3, relative to their largest values, on an H100 2026-12-06). "tf32" products hit an illegal
memory access there (Triton 3.6).

Shape suffixes: B batch, H heads, c chunks, L positions in a chunk, K key dim, V value dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device

# V columns per program: 16, the narrowest tl.dot takes, so that at V = 128 eight programs a (batch, head) walk the
# chunks side by side. The walk is sequential over the chunks: with 64 columns (two programs a head, 64 programs for
# Qwen3.5's 32 heads on an H200's 132 SMs) its forward took 324 ms a step against the compiled torch walk's 134
# (Qwen3.5 L8, seq 4096 x 1, 2026-12-06).
BLOCK_V = 16
# Pipeline stages of the loop's loads (W and KO, 32 KiB each a chunk at Qwen3.5's widths): the next chunks' loads do
# not wait for the state, so they can be in flight while this chunk's products run. The shared memory this asks for
# at Qwen3.5's widths is checked against what a Hopper block may have (tests/test_gated_delta_walk.py).
STAGES = 2
# Eight warps: the float32 products hold their operands' K-long rows in registers; compiled for sm_90 without a GPU
# (Triton 3.9's ptxas), four warps spilled 5.8 KB a thread in the forward and eight 0.4 KB. One Qwen3.5 layer forward
# + backward on an H100 (Triton 3.6, 2026-12-06): 9.8 ms with eight, 21.9 with four.
WARPS = 8


@triton.jit
def _walk_fwd(
    U,
    WQ,
    KO,
    D,
    S_IN,
    VN,
    n_chunks,
    K: tl.constexpr,
    V: tl.constexpr,
    L: tl.constexpr,
    BV: tl.constexpr,
):
    bh = tl.program_id(0)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    rl = tl.arange(0, L)
    rk = tl.arange(0, K)
    state = tl.zeros([K, BV], dtype=tl.float32)
    for i in range(n_chunks):
        at = (bh * n_chunks + i).to(tl.int64)
        lv = at * L * V + rl[:, None] * V + rv[None, :]
        w = tl.load(WQ + at * 2 * L * K + rl[:, None] * K + rk[None, :])
        ko = tl.load(KO + at * L * K + rl[:, None] * K + rk[None, :])
        d = tl.load(D + at)
        tl.store(S_IN + at * K * V + rk[:, None] * V + rv[None, :], state)
        v_new = tl.load(U + lv) - tl.dot(w, state, input_precision="ieee")
        tl.store(VN + lv, v_new)
        state = state * d + tl.dot(tl.trans(ko), v_new, input_precision="ieee")


@triton.jit
def _walk_bwd(
    DVN_A,
    QT_DO,
    WQ,
    KO,
    D,
    DVN,
    DS_OUT,
    n_chunks,
    K: tl.constexpr,
    V: tl.constexpr,
    L: tl.constexpr,
    BV: tl.constexpr,
):
    bh = tl.program_id(0)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    rl = tl.arange(0, L)
    rk = tl.arange(0, K)
    d_state = tl.zeros([K, BV], dtype=tl.float32)  # the gradient reaching the state leaving the chunk
    for j in range(n_chunks):
        at = (bh * n_chunks + n_chunks - 1 - j).to(tl.int64)
        lv = at * L * V + rl[:, None] * V + rv[None, :]
        kv = at * K * V + rk[:, None] * V + rv[None, :]
        w = tl.load(WQ + at * 2 * L * K + rl[:, None] * K + rk[None, :])
        ko = tl.load(KO + at * L * K + rl[:, None] * K + rk[None, :])
        d = tl.load(D + at)
        tl.store(DS_OUT + kv, d_state)
        d_v_new = tl.load(DVN_A + lv) + tl.dot(ko, d_state, input_precision="ieee")
        tl.store(DVN + lv, d_v_new)
        d_state = d_state * d - tl.dot(tl.trans(w), d_v_new, input_precision="ieee") + tl.load(QT_DO + kv)


class GatedDeltaWalk(torch.autograd.Function):
    """chunk_prepare's (u, w_and_q, attn, k_out, decay) -> the outputs [B, H, c, L, V] from a zero state."""

    @staticmethod
    def forward(ctx, u_BHcLV, wq_BHc2LK, attn_BHcLL, k_out_BHcLK, decay_BHc11):
        check_triton_device(u_BHcLV, "mixer walk")
        u = u_BHcLV.float().contiguous()
        wq = wq_BHc2LK.float().contiguous()
        attn = attn_BHcLL.float()
        k_out = k_out_BHcLK.float().contiguous()
        decay = decay_BHc11.float().expand(*u.shape[:3], 1, 1).contiguous()
        batch, heads, n_chunks, chunk, vdim = u.shape
        kdim = k_out.shape[-1]
        v_new = torch.empty_like(u)
        s_in = u.new_empty(batch, heads, n_chunks, kdim, vdim)
        bv = min(BLOCK_V, vdim)
        _walk_fwd[(batch * heads, vdim // bv)](
            u, wq, k_out, decay, s_in, v_new, n_chunks, K=kdim, V=vdim, L=chunk, BV=bv,
            num_warps=WARPS, num_stages=STAGES,
        )  # fmt: skip
        out = wq[..., chunk:, :] @ s_in + attn @ v_new
        ctx.save_for_backward(wq, attn, k_out, decay, s_in, v_new)
        ctx.decay_shape = decay_BHc11.shape
        return out

    @staticmethod
    def backward(ctx, d_out_BHcLV):
        wq, attn, k_out, decay, s_in, v_new = ctx.saved_tensors
        batch, heads, n_chunks, chunk, vdim = v_new.shape
        kdim = k_out.shape[-1]
        d_out = d_out_BHcLV.float()
        q = wq[..., chunk:, :]
        d_v_new_attn = (attn.transpose(-1, -2) @ d_out).contiguous()
        qt_d_out = (q.transpose(-1, -2) @ d_out).contiguous()
        d_v_new = torch.empty_like(v_new)
        d_s_out = torch.empty_like(s_in)
        bv = min(BLOCK_V, vdim)
        _walk_bwd[(batch * heads, vdim // bv)](
            d_v_new_attn, qt_d_out, wq, k_out, decay, d_v_new, d_s_out, n_chunks, K=kdim, V=vdim, L=chunk, BV=bv,
            num_warps=WARPS, num_stages=STAGES,
        )  # fmt: skip
        s_in_T = s_in.transpose(-1, -2)
        d_wq = torch.cat([-(d_v_new @ s_in_T), d_out @ s_in_T], dim=-2)
        d_attn = d_out @ v_new.transpose(-1, -2)
        d_k_out = v_new @ d_s_out.transpose(-1, -2)
        d_decay = (s_in * d_s_out).sum((-1, -2), keepdim=True).sum_to_size(ctx.decay_shape)
        return d_v_new, d_wq, d_attn, d_k_out, d_decay


def walk_chunks(prepared: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[B, H, c, L, V]: chunk_prepare's tensors walked from a zero state (kernels/gated_delta.scan_chunks' result)."""
    return GatedDeltaWalk.apply(*prepared)
