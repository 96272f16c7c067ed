"""The hybrid models' sequence mixers counted from the config (no model is built): parameters, FLOPs, activations.

Mamba2 (Nemotron-H's and GraniteMoE-Hybrid's mixer): nh heads of width P (inner width d = nh P), G groups of state
size N, a depthwise causal conv of kernel K over x|B|C (d + 2GN channels):
    in_proj    H -> 2d + 2GN + nh  (z, x|B|C, dt)                  a matmul
    conv1d     (d + 2GN) K, plus its bias (use_conv_bias)
    dt_bias, A_log, D: nh each; the gated norm: d
    out_proj   d -> H                                              a matmul
    (both projections carry biases with use_bias)
Gated DeltaNet (Qwen3.5-MoE's, Qwen3-Next's): nk key heads of width dk (qk = nk dk), nv value heads of width dv
(v = nv dv), a depthwise causal conv over q|k|v (2qk + v channels):
    in projections H -> 2qk + 2v + 2nv  (q|k|v, z, b, a)           matmuls
    conv1d     (2qk + v) K
    dt_bias, A_log: nv each; the gated norm: dv
    out_proj   v -> H                                              a matmul

Training FLOPs per token beyond the 6 x matmul weights every matmul costs (workbench/params.py), as NeMo AutoModel
counts them (its flops_utils, the Nemotron-H and Qwen3.5 formulas): Mamba2's SSD scan 21 d N (7 operations per
inner-width x state element, x 3 for the backward: not a GEMM; the conv is not counted); Gated DeltaNet's conv
6 K (2qk + v) and its delta rule 6 x 4 nv dk dv (NeMo writes nv dv², its models have dk = dv).

Activations one token keeps for backward in a mixer: the in projections' outputs, the conv's output, the mixer's
output and its gated norm's output, and its share of the chunk states (one [heads, key width, value width] state
per chunk: nh P N / chunk_size for Mamba2, nv dk dv / 64 for the gated delta rule's 64-token chunks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GATED_DELTA_CHUNK = 64  # the gated delta rule's chunk (Transformers' and the engine's, models/mixer_gated_delta.py)


@dataclass(frozen=True)
class MixerCounts:
    """One sequence mixer block of one layer, counted from the config."""

    params: int  # every parameter of the block
    matmul: int  # its projection weights (each costs 6 FLOPs per token in training)
    flops_per_token: float  # training FLOPs per token beyond 6 x matmul (NeMo AutoModel's terms)
    activations_per_token: float  # elements one token keeps for backward


# A Mamba2 config field under each family's name: Nemotron-H's, then GraniteMoE-Hybrid's.
MAMBA2_FIELDS = {
    "heads": ("mamba_num_heads", "mamba_n_heads"),
    "head_dim": ("mamba_head_dim", "mamba_d_head"),
    "groups": ("n_groups", "mamba_n_groups"),
    "state": ("ssm_state_size", "mamba_d_state"),
    "kernel": ("conv_kernel", "mamba_d_conv"),
    "bias": ("use_bias", "mamba_proj_bias"),
    "conv_bias": ("use_conv_bias", "mamba_conv_bias"),
    "chunk": ("chunk_size", "mamba_chunk_size"),
}


def _mamba2(cfg: Any, key: str, default: Any = None) -> Any:
    for name in MAMBA2_FIELDS[key]:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def mamba2_counts(cfg: Any) -> MixerCounts:
    """A Mamba2 mixer's counts (module docstring), from Nemotron-H's or GraniteMoE-Hybrid's config fields."""
    hidden, heads, head_dim = cfg.hidden_size, _mamba2(cfg, "heads"), _mamba2(cfg, "head_dim")
    groups, state, kernel = _mamba2(cfg, "groups"), _mamba2(cfg, "state"), _mamba2(cfg, "kernel")
    inner = heads * head_dim
    in_width = 2 * inner + 2 * groups * state + heads
    conv_channels = inner + 2 * groups * state
    matmul = hidden * in_width + inner * hidden
    bias = bool(_mamba2(cfg, "bias", False)) * (in_width + hidden)
    conv = conv_channels * kernel + bool(_mamba2(cfg, "conv_bias", True)) * conv_channels
    params = matmul + bias + conv + 3 * heads + inner
    chunk = _mamba2(cfg, "chunk") or 128
    activations = in_width + conv_channels + 2 * inner + inner * state / chunk
    return MixerCounts(params, matmul, 21.0 * inner * state, activations)


def gated_deltanet_counts(cfg: Any) -> MixerCounts:
    """A Gated DeltaNet's counts (module docstring), from Qwen3.5-MoE's and Qwen3-Next's config fields."""
    hidden, kernel = cfg.hidden_size, cfg.linear_conv_kernel_dim
    key_heads, key_dim = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    value_heads, value_dim = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    qk, v = key_heads * key_dim, value_heads * value_dim
    in_width = 2 * qk + 2 * v + 2 * value_heads
    conv_channels = 2 * qk + v
    matmul = hidden * in_width + v * hidden
    params = matmul + conv_channels * kernel + 2 * value_heads + value_dim
    flops = 6.0 * (kernel * conv_channels + 4 * value_heads * key_dim * value_dim)
    activations = in_width + conv_channels + 2 * v + value_heads * key_dim * value_dim / GATED_DELTA_CHUNK
    return MixerCounts(params, matmul, flops, activations)


MIXER_COUNTS = {"mamba2": mamba2_counts, "gated_deltanet": gated_deltanet_counts}


def mixer_counts(cfg: Any, kind: str) -> MixerCounts:
    """The counts of one `kind` mixer ('mamba2' or 'gated_deltanet': LayerBlocks.mixer) of `cfg`'s model."""
    if kind not in MIXER_COUNTS:
        raise ValueError(f"no counts for sequence mixer {kind!r}; known: {sorted(MIXER_COUNTS)}")
    return MIXER_COUNTS[kind](cfg)
