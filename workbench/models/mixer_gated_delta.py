"""The engine's Gated DeltaNet: Transformers' module (same parameters) whose training forward is the chunked rule.

Transformers' Gated DeltaNet (Qwen3.5's Qwen3_5MoeGatedDeltaNet, Qwen3-Next's Qwen3NextGatedDeltaNet) holds its input
projections, conv1d, dt_bias, A_log, norm (an RMSNorm per head gated by SiLU(z)) and out_proj; without
flash-linear-attention (which refuses Hopper with the image's Triton 3.6) its forward runs a torch fallback that
solves the chunks' triangular systems and walks the chunks in thousands of small kernels. Here the projections stay
the module's own and the rest is plain torch ops (kernels/gated_delta.py) in three steps, each compiled by
torch.compile on CUDA (models/mixer_compile.py) and eager on the CPU: the rule's inputs (the causal conv + SiLU, the
l2-normed q and k, beta and the decay g, every chunk's triangular solve), the walk over the chunks, and the gated
norm. The walk is a recurrence on the float32 state: a Python loop of one compiled block of CHUNKS_PER_CALL chunk
steps (compiling the whole unrolled walk took 177 s against 81 s with a one-chunk block at 1024 tokens on the 2-core
CPU, and grows with the chunk count). At 4096 tokens that is 64 steps of three tiny matmuls per layer, 1,240 kernels
a layer forward + backward whose launches set the pace (28 ms a layer on an H100 for 15 ms of GPU work, 2026-12-06).
BackendConfig.mixer='triton', auto's choice on CUDA, walks every chunk in one launch of a Triton kernel each way
instead (kernels/triton_gated_delta.py): 9.8 ms a layer, and Qwen3.5 L8 at 26,023 tokens/s against the compiled
walk's 20,255 on an H100 (2026-12-06); the compiled walk is the CPU's path and widths the kernel cannot take.
Packed documents restart the rule and the conv (models/mixer_documents.py). With a cache (generation) Transformers'
own forward runs.

The family supplies how its projections give (conv input, z, b, a): Qwen3.5 has one projection each, Qwen3-Next two
fused ones (in_proj_qkvz, in_proj_ba) split per key head by its own `fix_query_key_value_ordering`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.kernels._triton_util import triton_interpreting
from workbench.kernels.causal_conv import causal_depthwise_conv
from workbench.kernels.gated_delta import chunk_block, chunk_prepare, scan_chunks, unchunk
from workbench.models.mixer_call import call_cache, padding_mask
from workbench.models.mixer_compile import mixer_math, run_mixer_math
from workbench.models.mixer_documents import mixer_document_starts

# Transformers' chunk size for the rule (torch_chunk_gated_delta_rule's default).
CHUNK = 64
# Chunks walked by one call of the compiled block: fewer calls (each a guard check, an autograd node and a few kernel
# launches, forward and backward) against a longer unrolled graph to compile. One Qwen3.5 layer forward + backward on
# an H100 (2026-12-06): 28.2 ms with 8, 26.8 with 16, 36.4 with the whole walk as one graph.
CHUNKS_PER_CALL = 8


def gated_delta_inputs(
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    padding: torch.Tensor | None,
    starts: torch.Tensor | None,
    *,
    key_heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    chunk: int,
) -> tuple[torch.Tensor, ...]:
    """(q|k|v before the conv [B, S, 2 Hk Dk + Hv Dv], b, a [B, S, Hv]) -> the rule's chunk_prepare tensors."""
    batch, seq, _ = mixed_qkv.shape
    x = causal_depthwise_conv(mixed_qkv, conv_weight, conv_bias, starts)  # float32, SiLU'd
    if padding is not None:
        x = x * padding[..., None]
    q, k, v = x.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=-1)
    q = q.reshape(batch, seq, key_heads, key_dim)
    k = k.reshape(batch, seq, key_heads, key_dim)
    if value_heads != key_heads:  # each query/key head serves value_heads // key_heads consecutive value heads
        q = q.repeat_interleave(value_heads // key_heads, dim=2)
        k = k.repeat_interleave(value_heads // key_heads, dim=2)
    beta = b.float().sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return chunk_prepare(q, k, v.reshape(batch, seq, value_heads, value_dim), g, beta, chunk, starts)


def gated_delta_output(
    o_chunks: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, *, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """The rule's chunked output [B, Hv, c, L, Dv] and z [B, S, Hv Dv] -> the gated, normed [B, S, Hv Dv] for
    out_proj, in out_dtype."""
    batch, seq = z.shape[:2]
    heads, value_dim = o_chunks.shape[1], o_chunks.shape[-1]
    o = unchunk(o_chunks, seq)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    o = norm_weight.float() * o * F.silu(z.float().reshape(batch, seq, heads, value_dim))
    return o.reshape(batch, seq, heads * value_dim).to(out_dtype)


def gated_delta_math(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    padding: torch.Tensor | None,
    starts: torch.Tensor | None,
    *,
    key_heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    chunk: int,
    eps: float,
    out_dtype: torch.dtype,
    triton_walk: bool = False,
) -> torch.Tensor:
    """The mixer between its projections: the three steps above, each compiled on CUDA (eager elsewhere)."""
    device = mixed_qkv.device
    dims = dict(key_heads=key_heads, value_heads=value_heads, key_dim=key_dim, value_dim=value_dim, chunk=chunk)
    prepared = run_mixer_math(
        gated_delta_inputs, device, mixed_qkv, b, a, conv_weight, conv_bias, A_log, dt_bias, padding, starts, **dims
    )
    o_chunks = walk_over_chunks(
        prepared, device, triton_walk=triton_walk, key_dim=key_dim, value_dim=value_dim, chunk=chunk
    )
    return run_mixer_math(gated_delta_output, device, o_chunks, z, norm_weight, eps=eps, out_dtype=out_dtype)


def walk_over_chunks(
    prepared: tuple[torch.Tensor, ...],
    device: torch.device,
    *,
    triton_walk: bool,
    key_dim: int,
    value_dim: int,
    chunk: int,
) -> torch.Tensor:
    """The outputs [B, H, c, L, V] of the walk over the chunks: with `triton_walk` (BackendConfig.mixer='triton') on
    CUDA one Triton program per (batch, head, block of V) walks them all (kernels/triton_gated_delta.py); else, or
    for widths its tl.dot cannot take, the torch loop of chunk blocks (compiled on CUDA)."""
    if triton_walk and (device.type == "cuda" or triton_interpreting()) and walk_supported(key_dim, value_dim, chunk):
        # Triton is optional (a CPU install may lack it): imported where a CUDA device runs it
        from workbench.kernels.triton_gated_delta import walk_chunks

        return walk_chunks(prepared)
    return scan_chunks(prepared, mixer_math(chunk_block, device), CHUNKS_PER_CALL)


def walk_supported(key_dim: int, value_dim: int, chunk: int) -> bool:
    """Whether the Triton walk takes these widths: powers of two of at least 16, keys at most 256 wide."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (key_dim, value_dim, chunk)) and key_dim <= 256


class EngineGatedDeltaNet:
    """Mixin before a Transformers Gated DeltaNet class: the training forward of the chunked rule.

    `triton_walk` (BackendConfig.mixer='triton', set where the engine takes the module over) walks the chunks in
    Triton on CUDA.

    `projections(hidden_states)` -> (conv input, z, b, a): one projection each, as Qwen3.5-MoE, Lara-Mini and
    Qwen4-Exp hold them; a family with another layout overrides it (Qwen3-Next's two fused projections).
    """

    def projections(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q|k|v before the conv, z, b, a) from the module's own projections."""
        return (
            self.in_proj_qkv(hidden_states),
            self.in_proj_z(hidden_states),
            self.in_proj_b(hidden_states),
            self.in_proj_a(hidden_states),
        )

    triton_walk: bool = False

    def forward(self, hidden_states: torch.Tensor, *args, mixer_position_ids=None, **kwargs):
        """Transformers' forward's result; without a cache, computed by `gated_delta_math` (compiled on CUDA)."""
        if call_cache(args, kwargs) is not None:
            return super().forward(hidden_states, *args, **kwargs)
        batch, seq, _ = hidden_states.shape
        padding = padding_mask(args, kwargs)
        if padding is not None:
            hidden_states = (hidden_states * padding[:, :, None]).to(hidden_states.dtype)
        starts = mixer_document_starts(mixer_position_ids, batch, seq, hidden_states.device)
        mixed_qkv, z, b, a = self.projections(hidden_states)
        out = gated_delta_math(
            mixed_qkv,
            z,
            b,
            a,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            self.A_log,
            self.dt_bias,
            self.norm.weight,
            padding,
            starts,
            key_heads=self.num_k_heads,
            value_heads=self.num_v_heads,
            key_dim=self.head_k_dim,
            value_dim=self.head_v_dim,
            chunk=CHUNK,
            eps=float(self.norm.variance_epsilon),
            out_dtype=hidden_states.dtype,
            triton_walk=self.triton_walk,
        )
        return self.out_proj(out)
