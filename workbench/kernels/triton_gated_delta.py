"""The gated delta rule's walk over its chunks in two Triton kernels (forward and backward), float32 state.

kernels/gated_delta.py prepares every chunk at once (chunk_prepare: the triangular solves, the decays); what is left
is a recurrence over the chunks on the [K, V] state of each (batch, head), which in torch ops is a loop of c chunk
steps of three small matmuls each, forward and backward: at 4096 tokens 64 steps per layer of kernels far too small
to fill a GPU. Here one program walks all the chunks of one (batch, head, block of V columns) with the state in
registers: the forward stores each chunk's incoming state and its corrected values for the backward, which walks
the chunks in reverse carrying the state's gradient. The products are float32 (input_precision "ieee"): the
recurrence compounds rounding over the chunks, and it is what the torch walk computes.

Per chunk (S its incoming state, [K, V]; W, Q [L, K]; U [L, V]; A [L, L]; KO [L, K]; d a scalar):
    Vn = U - W S,   O = Q S + A Vn,   S' = d S + KO^T Vn
and back, with dS' the gradient reaching S':
    dVn = A^T dO + KO dS',  dA = dO Vn^T,  dKO = Vn dS'^T,  dd = <S, dS'>,  dW = -dVn S^T,  dQ = dO S^T,
    dS = d dS' + W^T (-dVn) + Q^T dO.
Each program sees a block of V columns, so dA, dKO, dW, dQ and dd are partial sums, added up over the blocks after.

Shape suffixes: B batch, H heads, c chunks, L positions in a chunk, K key dim, V value dim, P V-blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device

# V columns per program: 16, the narrowest tl.dot takes, so that at V = 128 eight programs a (batch, head) walk the
# chunks side by side. The walk is sequential over the chunks: with 64 columns (two programs a head, 64 programs for
# Qwen3.5's 32 heads on an H200's 132 SMs) its forward took 324 ms a step against the compiled torch walk's 134
# (Qwen3.5 L8, seq 4096 x 1, 2026-12-06). One pipeline stage: with triton's default of three, the forward at keys and
# values 128 wide asked for 288 KiB of shared memory on an H100 (227 there), 2026-12-06.
BLOCK_V = 16
BLOCK_V_BACKWARD = 16
STAGES = 1
WARPS = 4


@triton.jit
def _walk_fwd(
    U,
    WQ,
    A,
    KO,
    D,
    O,
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
        q = tl.load(WQ + at * 2 * L * K + (L + rl)[:, None] * K + rk[None, :])
        a = tl.load(A + at * L * L + rl[:, None] * L + rl[None, :])
        ko = tl.load(KO + at * L * K + rl[:, None] * K + rk[None, :])
        d = tl.load(D + at)
        tl.store(S_IN + at * K * V + rk[:, None] * V + rv[None, :], state)
        v_new = tl.load(U + lv) - tl.dot(w, state, input_precision="ieee")
        out = tl.dot(q, state, input_precision="ieee") + tl.dot(a, v_new, input_precision="ieee")
        tl.store(O + lv, out)
        tl.store(VN + lv, v_new)
        state = state * d + tl.dot(tl.trans(ko), v_new, input_precision="ieee")


@triton.jit
def _walk_bwd(
    DO,
    WQ,
    A,
    KO,
    D,
    S_IN,
    VN,
    DU,
    DWQ_P,
    DA_P,
    DKO_P,
    DD_P,
    n_chunks,
    n_all,
    K: tl.constexpr,
    V: tl.constexpr,
    L: tl.constexpr,
    BV: tl.constexpr,
):
    bh = tl.program_id(0)
    vb = tl.program_id(1)
    rv = vb * BV + tl.arange(0, BV)
    rl = tl.arange(0, L)
    rk = tl.arange(0, K)
    d_state = tl.zeros([K, BV], dtype=tl.float32)
    for j in range(n_chunks):
        at = (bh * n_chunks + n_chunks - 1 - j).to(tl.int64)
        part = vb * n_all + at  # this V-block's partial sums of the chunk's gradients
        lv = at * L * V + rl[:, None] * V + rv[None, :]
        d_out = tl.load(DO + lv)
        v_new = tl.load(VN + lv)
        state = tl.load(S_IN + at * K * V + rk[:, None] * V + rv[None, :])
        w = tl.load(WQ + at * 2 * L * K + rl[:, None] * K + rk[None, :])
        q = tl.load(WQ + at * 2 * L * K + (L + rl)[:, None] * K + rk[None, :])
        a = tl.load(A + at * L * L + rl[:, None] * L + rl[None, :])
        ko = tl.load(KO + at * L * K + rl[:, None] * K + rk[None, :])
        d = tl.load(D + at)
        d_v_new = tl.dot(tl.trans(a), d_out, input_precision="ieee") + tl.dot(ko, d_state, input_precision="ieee")
        tl.store(DU + lv, d_v_new)
        tl.store(
            DA_P + part * L * L + rl[:, None] * L + rl[None, :], tl.dot(d_out, tl.trans(v_new), input_precision="ieee")
        )
        tl.store(
            DKO_P + part * L * K + rl[:, None] * K + rk[None, :],
            tl.dot(v_new, tl.trans(d_state), input_precision="ieee"),
        )
        tl.store(DD_P + part, tl.sum(state * d_state))
        d_read_w = -d_v_new
        tl.store(
            DWQ_P + part * 2 * L * K + rl[:, None] * K + rk[None, :],
            tl.dot(d_read_w, tl.trans(state), input_precision="ieee"),
        )
        tl.store(
            DWQ_P + part * 2 * L * K + (L + rl)[:, None] * K + rk[None, :],
            tl.dot(d_out, tl.trans(state), input_precision="ieee"),
        )
        d_state = (
            d_state * d
            + tl.dot(tl.trans(w), d_read_w, input_precision="ieee")
            + tl.dot(tl.trans(q), d_out, input_precision="ieee")
        )


class GatedDeltaWalk(torch.autograd.Function):
    """chunk_prepare's (u, w_and_q, attn, k_out, decay) -> the outputs [B, H, c, L, V] from a zero state."""

    @staticmethod
    def forward(ctx, u_BHcLV, wq_BHc2LK, attn_BHcLL, k_out_BHcLK, decay_BHc11):
        check_triton_device(u_BHcLV, "mixer walk")
        u = u_BHcLV.float().contiguous()
        wq = wq_BHc2LK.float().contiguous()
        attn = attn_BHcLL.float().contiguous()
        k_out = k_out_BHcLK.float().contiguous()
        decay = decay_BHc11.float().expand(*u.shape[:3], 1, 1).contiguous()
        batch, heads, n_chunks, chunk, vdim = u.shape
        kdim = k_out.shape[-1]
        out = torch.empty_like(u)
        v_new = torch.empty_like(u)
        s_in = u.new_empty(batch, heads, n_chunks, kdim, vdim)
        bv = min(BLOCK_V, vdim)
        grid = (batch * heads, vdim // bv)
        _walk_fwd[grid](
            u,
            wq,
            attn,
            k_out,
            decay,
            out,
            s_in,
            v_new,
            n_chunks,
            K=kdim,
            V=vdim,
            L=chunk,
            BV=bv,
            num_warps=WARPS,
            num_stages=STAGES,
        )
        ctx.save_for_backward(wq, attn, k_out, decay, s_in, v_new)
        ctx.decay_shape = decay_BHc11.shape
        return out

    @staticmethod
    def backward(ctx, d_out_BHcLV):
        wq, attn, k_out, decay, s_in, v_new = ctx.saved_tensors
        batch, heads, n_chunks, chunk, vdim = v_new.shape
        kdim = k_out.shape[-1]
        bv = min(BLOCK_V_BACKWARD, vdim)
        blocks = vdim // bv
        n_all = batch * heads * n_chunks
        d_out = d_out_BHcLV.float().contiguous()
        d_u = torch.empty_like(v_new)
        d_wq_P = wq.new_empty(blocks, *wq.shape)
        d_attn_P = attn.new_empty(blocks, *attn.shape)
        d_k_out_P = k_out.new_empty(blocks, *k_out.shape)
        d_decay_P = decay.new_empty(blocks, *decay.shape)
        _walk_bwd[(batch * heads, blocks)](
            d_out,
            wq,
            attn,
            k_out,
            decay,
            s_in,
            v_new,
            d_u,
            d_wq_P,
            d_attn_P,
            d_k_out_P,
            d_decay_P,
            n_chunks,
            n_all,
            K=kdim,
            V=vdim,
            L=chunk,
            BV=bv,
            num_warps=WARPS,
            num_stages=STAGES,
        )
        d_decay = d_decay_P.sum(0).sum_to_size(ctx.decay_shape)
        return d_u, d_wq_P.sum(0), d_attn_P.sum(0), d_k_out_P.sum(0), d_decay


def walk_chunks(prepared: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[B, H, c, L, V]: chunk_prepare's tensors walked from a zero state (kernels/gated_delta.scan_chunks' result)."""
    return GatedDeltaWalk.apply(*prepared)
