"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) in chunks, float32 state, plain torch ops.

The recurrence per head (state S [Dk, Dv], keys and queries l2-normalized, queries scaled by Dk^-1/2):
    S_t = exp(g_t) S_(t-1) + k_t (beta_t (v_t - exp(g_t) S_(t-1)^T k_t))^T,     o_t = S_t^T q_t
In chunks of `chunk` tokens (the WY / UT form of the delta rule):
- within a chunk, with Gamma[i, j] = exp(cg_i - cg_j) for j <= i (cg the chunk's cumulative sum of g), the
  triangular system T = (I + strictly_lower((beta k) k^T * Gamma))^-1 gives the chunk's corrected values
  u = T (beta v) and the keys that read the incoming state w = T (beta k exp(cg)): one batched
  `torch.linalg.solve_triangular` for both (Transformers' torch path solves the same system);
- across chunks a loop of seq / chunk steps, each three batched matmuls on the float32 state:
  v' = u - w S,  o = (q exp(cg)) S + (q k^T * Gamma) v',  S = exp(cg_last) S + (k exp(cg_last - cg))^T v'.

Packed documents (`starts`, True at each document's first token) keep their states apart: Gamma is zero between
two documents, a token reads (and corrects against) the incoming state only if its document began before the chunk,
and the state leaving a chunk holds only the document the chunk ends in.

torch.compile on CUDA fuses the elementwise work (models/mixer_gated_delta.py compiles chunk_prepare and chunk_block
apart: the walk over the chunks stays a Python loop of one compiled block of chunks); the inductor-generated Triton
runs on the Triton that ships with the user's torch, and autograd gives the backward. The reference it is tested
against is Transformers' own torch path (tests/test_mixers.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from workbench.kernels.causal_conv import document_index

# Shape suffixes: B batch, H heads, S sequence, c chunks, L positions in a chunk, K key dim, V value dim.


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the flash-linear-attention convention Transformers follows)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_prepare(
    q_BSHK: torch.Tensor,
    k_BSHK: torch.Tensor,
    v_BSHV: torch.Tensor,
    g_BSH: torch.Tensor,
    beta_BSH: torch.Tensor,
    chunk: int,
    starts_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The within-chunk work: (u, w_and_q, attn, k_out, decay), each [B, H, c, ...] float32 (see chunk_scan)."""
    batch, seq, heads, kdim = k_BSHK.shape
    pad = (-seq) % chunk
    n_chunks = (seq + pad) // chunk

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [B, S, H, ...] -> [B, H, c, L, ...] float32, padded with zeros
        t = t.float()
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.view(batch, n_chunks, chunk, heads, *t.shape[3:]).movedim(3, 1)

    q = chunked(l2_normalize(q_BSHK.float()) * kdim**-0.5)
    k = chunked(l2_normalize(k_BSHK.float()))
    v = chunked(v_BSHV)
    beta = chunked(beta_BSH)[..., None]
    cg = chunked(g_BSH).cumsum(dim=-1)  # [B, H, c, L]

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    if starts_BS is None:
        same_ij, carried, to_end, last_carried = causal, None, None, None
    else:
        doc = document_index(starts_BS)
        doc = torch.cat([doc, doc[:, -1:].expand(-1, pad)], dim=1).view(batch, 1, n_chunks, chunk)
        end = doc[..., -1:]  # [B, 1, c, 1]
        prev_end = F.pad(end[:, :, :-1], (0, 0, 1, 0), value=-1)
        same_ij = causal & (doc[..., :, None] == doc[..., None, :])
        carried = (doc == prev_end)[..., None]  # [B, 1, c, L, 1]: the token's document began before the chunk
        to_end = (doc == end)[..., None]  # the token's document is the one the chunk ends in
        last_carried = carried[..., -1, :]  # [B, 1, c, 1]: the whole chunk is one document carried in

    gamma = torch.exp((cg[..., :, None] - cg[..., None, :]).masked_fill(~same_ij, float("-inf")))  # [B, H, c, i, j]
    k_beta = k * beta
    system = (k_beta @ k.transpose(-1, -2)) * gamma  # its diagonal is ignored: the solve takes a unit diagonal
    reads = k_beta * cg.exp()[..., None]
    if carried is not None:
        reads = reads * carried
    solved = torch.linalg.solve_triangular(
        system, torch.cat([v * beta, reads], dim=-1), upper=False, unitriangular=True
    )
    u, w = solved.split([v.shape[-1], kdim], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * gamma
    q_in = q * cg.exp()[..., None]
    k_out = k * (cg[..., -1:] - cg).exp()[..., None]
    decay = cg[..., -1].exp()[..., None, None]  # [B, H, c, 1, 1]
    if carried is not None:
        q_in = q_in * carried
        k_out = k_out * to_end
        decay = decay * last_carried[..., None]
    return u, torch.cat([w, q_in], dim=-2), attn, k_out, decay


def chunk_step(
    state_BHKV: torch.Tensor,
    u: torch.Tensor,
    w_and_q: torch.Tensor,
    attn: torch.Tensor,
    k_out: torch.Tensor,
    decay: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk across the state: (output [B, H, L, V], next state); the inputs are chunk_prepare's at one chunk."""
    chunk = u.shape[-2]
    read = w_and_q @ state_BHKV  # [B, H, 2L, V]: what the incoming state predicts for the keys, and the queries' read
    v_new = u - read[..., :chunk, :]
    out = read[..., chunk:, :] + attn @ v_new
    return out, state_BHKV * decay + k_out.transpose(-1, -2) @ v_new


def chunk_block(
    state_BHKV: torch.Tensor,
    u: torch.Tensor,
    w_and_q: torch.Tensor,
    attn: torch.Tensor,
    k_out: torch.Tensor,
    decay: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive chunks across the state, one chunk_step each: (outputs [B, H, n, L, V], state after the last)."""
    outs = []
    for i in range(u.shape[2]):
        out, state_BHKV = chunk_step(
            state_BHKV, u[:, :, i], w_and_q[:, :, i], attn[:, :, i], k_out[:, :, i], decay[:, :, i]
        )
        outs.append(out)
    return torch.stack(outs, dim=2), state_BHKV


def scan_chunks(
    prepared: tuple[torch.Tensor, ...], block: Callable = chunk_block, chunks_per_block: int | None = None
) -> torch.Tensor:
    """[B, H, c, L, V]: chunk_prepare's tensors walked from a zero state, `chunks_per_block` chunks (None: all) a
    call of `block` (chunk_block, or its compiled form: a small graph reused c / chunks_per_block times, where
    compiling the whole unrolled walk takes longer with every chunk)."""
    u, _, _, k_out, _ = prepared
    batch, heads, n_chunks = u.shape[:3]
    per_block = n_chunks if chunks_per_block is None else chunks_per_block
    state = u.new_zeros(batch, heads, k_out.shape[-1], u.shape[-1])
    outs = []
    for first in range(0, n_chunks, per_block):
        part = slice(first, first + per_block)
        out, state = block(state, *(t[:, :, part] for t in prepared))
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def unchunk(o_BHcLV: torch.Tensor, seq: int) -> torch.Tensor:
    """[B, H, c, L, V] -> [B, S, H, V] (the padding dropped)."""
    return o_BHcLV.flatten(2, 3)[:, :, :seq].transpose(1, 2)


def chunk_gated_delta(
    q_BSHK: torch.Tensor,
    k_BSHK: torch.Tensor,
    v_BSHV: torch.Tensor,
    g_BSH: torch.Tensor,
    beta_BSH: torch.Tensor,
    chunk: int = 64,
    starts_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """o [B, S, H, V] float32 of the gated delta rule from a zero state (q and k get their l2 norm and scale here)."""
    prepared = chunk_prepare(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, chunk, starts_BS)
    return unchunk(scan_chunks(prepared), q_BSHK.shape[1])
