"""Mamba2's selective scan (state space duality, SSD) in chunks, as a few large batched matmuls in float32.

The recurrence per head (state h [P, N], P = head dim, N = state size):
    h_t = exp(dt_t * A) * h_(t-1) + dt_t * x_t B_t^T,     y_t = h_t C_t + D * x_t
is a linear attention with a scalar decay. In chunks of `chunk` tokens it becomes:
- within a chunk: y = (C B^T * L) (dt x), L[i, j] = exp(cs_i - cs_j) for j <= i, cs the chunk's cumulative sum of
  dt * A (a quadratic form, one batched matmul per group);
- each chunk's own end state: sum_j exp(cs_last - cs_j) dt_j x_j B_j^T (one batched matmul);
- between chunks: the state entering chunk k is sum_(z < k) exp(sum of the chunk totals z+1 .. k-1) * state_z,
  one [chunks x chunks] decay matrix (built from segment sums, not differences of a long cumulative sum) applied in
  one einsum: no Python loop over chunks or time steps;
- its read-out: y_i += exp(cs_i) C_i h_k.
Everything is float32 (the carried state included, [B, chunks, H, P, N]) whatever the model dtype.

Packed documents (`starts`, True at each document's first token) keep their states apart: every decay that would
carry state across a document's first token is zero (a mask on the document index, exact, instead of a huge
negative log-decay that would cost float32 precision in the cumulative sums).

Plain torch ops, so `torch.compile` fuses the elementwise work around the matmuls into a few Triton kernels of the
Triton that ships with the user's torch, and autograd gives the backward (models/mixer_mamba2.py compiles it on
CUDA); the reference it is tested against is Transformers' own torch path (tests/test_mixers.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.kernels.causal_conv import document_index

# Shape suffixes: B batch, S sequence, H heads, P head dim, G groups (of B and C), R heads per group, N state size,
# c chunks, L positions in a chunk (i the target, j the source).


def _segment_sums(x: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [..., n, n]: entry [i, j] = sum of x[j+1 .. i] for j <= i, -inf above the diagonal.

    Each entry is summed afresh from the terms it covers (a masked cumulative sum), so a decay between two close
    chunks is exact even when the sequence's running total is large.
    """
    n = x.shape[-1]
    rep = x[..., None, :].expand(*x.shape, n).transpose(-1, -2)  # [..., i, j] = x[i]
    ones = torch.ones(n, n, dtype=torch.bool, device=x.device)
    sums = rep.masked_fill(~ones.tril(-1), 0.0).cumsum(dim=-2)
    return sums.masked_fill(ones.triu(1), float("-inf"))


def ssd_chunked(
    x_BSHP: torch.Tensor,
    dt_BSH: torch.Tensor,
    A_H: torch.Tensor,
    B_BSGN: torch.Tensor,
    C_BSGN: torch.Tensor,
    chunk: int,
    D_H: torch.Tensor | None = None,
    starts_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [B, S, H, P] float32 of the Mamba2 scan from a zero state; `dt` already softplus'd and clamped."""
    batch, seq, heads, hdim = x_BSHP.shape
    groups, nstate = B_BSGN.shape[-2:]
    per_group = heads // groups
    x = x_BSHP.float()
    dt = dt_BSH.float()
    pad = (-seq) % chunk
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))  # padded tokens carry nothing and decay nothing
    a = F.pad(dt * A_H.float(), (0, 0, 0, pad))
    Bm = F.pad(B_BSGN.float(), (0, 0, 0, 0, 0, pad))
    Cm = F.pad(C_BSGN.float(), (0, 0, 0, 0, 0, pad))
    n_chunks = (seq + pad) // chunk
    shape = (batch, n_chunks, chunk)
    xdt = xdt.view(*shape, groups, per_group, hdim)
    Bm = Bm.view(*shape, groups, nstate)
    Cm = Cm.view(*shape, groups, nstate)
    cs_BcLH = a.view(*shape, heads).cumsum(dim=2)  # within each chunk
    cs_BcHL = cs_BcLH.transpose(2, 3)

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    if starts_BS is None:
        same_ij, to_end_mask, carried_mask, chunk_mask = causal, None, None, None
    else:
        doc = document_index(starts_BS)
        doc = torch.cat([doc, doc[:, -1:].expand(-1, pad)], dim=1).view(shape)  # [B, c, L]; padding: the last doc
        end = doc[:, :, -1]  # [B, c]: the document each chunk ends in
        same_ij = causal & (doc[:, :, None, :, None] == doc[:, :, None, None, :])  # [B, c, 1, i, j]
        to_end_mask = (doc == end[:, :, None])[..., None]  # [B, c, L, 1]: token j's state reaches its chunk's end
        prev_end = F.pad(end[:, :-1], (1, 0), value=-1)  # the document the chunk's incoming state belongs to
        carried_mask = (doc == prev_end[:, :, None])[..., None]  # [B, c, L, 1]: token i reads the incoming state
        chunk_mask = end[:, :, None] == end[:, None, :]  # [B, c(i), c(z)]: chunk z's end state reaches chunk i's end

    # within each chunk: the quadratic form with the decay mask
    decay_BcHij = torch.exp((cs_BcHL[..., :, None] - cs_BcHL[..., None, :]).masked_fill(~same_ij, float("-inf")))
    scores = torch.einsum("bclgn,bcsgn->bcgls", Cm, Bm)  # [B, c, G, i, j]
    weights = scores[:, :, :, None] * decay_BcHij.view(batch, n_chunks, groups, per_group, chunk, chunk)
    y = torch.einsum("bcgrls,bcsgrp->bclgrp", weights, xdt)

    # each chunk's end state, from its own tokens
    to_end = torch.exp(cs_BcLH[:, :, -1:] - cs_BcLH)  # [B, c, L, H]
    if to_end_mask is not None:
        to_end = to_end * to_end_mask
    states = torch.einsum(
        "bclgn,bclgrp->bcgrpn", Bm, xdt * to_end.view(*shape, groups, per_group, 1)
    )  # [B, c, G, R, P, N]

    # between chunks: the state at each chunk's end from every earlier chunk's own state, one decay matrix
    totals_BHc = cs_BcLH[:, :, -1].transpose(1, 2)  # [B, H, c]
    chunk_decay = torch.exp(_segment_sums(totals_BHc))  # [B, H, c(i), c(z)]: chunk z's end to chunk i's end
    if chunk_mask is not None:
        chunk_decay = chunk_decay * chunk_mask[:, None]
    ends = torch.einsum("bgrcz,bzgrpn->bcgrpn", chunk_decay.view(batch, groups, per_group, n_chunks, n_chunks), states)
    incoming = F.pad(ends[:, :-1], (0, 0, 0, 0, 0, 0, 0, 0, 1, 0))  # the first chunk starts from zero

    # the incoming state's read-out
    read = torch.exp(cs_BcLH)  # [B, c, L, H]
    if carried_mask is not None:
        read = read * carried_mask
    y = y + torch.einsum("bclgn,bcgrpn->bclgrp", Cm, incoming) * read.view(*shape, groups, per_group, 1)

    y = y.reshape(batch, n_chunks * chunk, heads, hdim)[:, :seq]
    if D_H is not None:
        y = y + x * D_H.float()[:, None]
    return y
