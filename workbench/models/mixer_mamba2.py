"""The engine's Mamba2 mixer: Transformers' module (same parameters) whose training forward is the chunked scan.

Transformers' Mamba2 mixers (Nemotron-H's NemotronHMamba2Mixer) hold in_proj, conv1d, dt_bias, A_log, D, norm (a
gated RMSNorm over groups) and out_proj; without mamba_ssm and causal-conv1d (not installable without nvcc or the
internet) their forward runs a torch fallback of many small kernels (87% of a Nemotron 3 Nano L8 step's GPU time on
1 x H100). Here the projections stay the module's own (LoRA, TE or any swap of them still applies) and everything
between them - the causal conv (+ SiLU), dt's softplus and clamp, the chunked SSD scan (kernels/ssd_scan.py), the D
skip and the gated group RMSNorm - is one function of plain torch ops, compiled by torch.compile on CUDA
(models/mixer_compile.py) and eager on the CPU. Packed documents restart the scan and the conv
(models/mixer_documents.py). With a cache (generation) Transformers' own forward runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.kernels.causal_conv import causal_depthwise_conv
from workbench.kernels.ssd_scan import ssd_chunked
from workbench.models.mixer_call import call_cache, padding_mask
from workbench.models.mixer_compile import run_mixer_math
from workbench.models.mixer_documents import mixer_document_starts

# Shape suffixes: B batch, S sequence, I inner width (heads x head dim), H heads.


def mamba2_math(
    projected: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    padding: torch.Tensor | None,
    starts: torch.Tensor | None,
    *,
    heads: int,
    head_dim: int,
    groups: int,
    state: int,
    chunk: int,
    dt_limit: tuple[float, float],
    norm_group: int,
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """in_proj's output [B, S, I + conv + H] -> the gated, normed scan output [B, S, I] for out_proj, in out_dtype."""
    batch, seq, _ = projected.shape
    inner = heads * head_dim
    gate, xbc, dt = projected.split([inner, inner + 2 * groups * state, heads], dim=-1)
    xbc = causal_depthwise_conv(xbc, conv_weight, conv_bias, starts)  # float32, SiLU'd
    if padding is not None:
        xbc = xbc * padding[..., None]
    x, B, C = xbc.split([inner, groups * state, groups * state], dim=-1)
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])
    y = ssd_chunked(
        x.reshape(batch, seq, heads, head_dim),
        dt,
        -torch.exp(A_log.float()),
        B.reshape(batch, seq, groups, state),
        C.reshape(batch, seq, groups, state),
        chunk,
        D,
        starts,
    )
    y = y.reshape(batch, seq, inner // norm_group, norm_group) * F.silu(gate.float()).view(
        batch, seq, inner // norm_group, norm_group
    )
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (norm_weight.float() * y.view(batch, seq, inner)).to(out_dtype)


class EngineMamba2Mixer:
    """Mixin before a Transformers Mamba2 mixer class: the training forward of the chunked scan."""

    def forward(self, hidden_states: torch.Tensor, *args, mixer_position_ids=None, **kwargs):
        """Transformers' forward's result; without a cache, computed by `mamba2_math` (compiled on CUDA)."""
        if call_cache(args, kwargs) is not None:
            return super().forward(hidden_states, *args, **kwargs)
        batch, seq, _ = hidden_states.shape
        padding = padding_mask(args, kwargs)
        if padding is not None:
            hidden_states = (hidden_states * padding[:, :, None]).to(hidden_states.dtype)
        starts = mixer_document_starts(mixer_position_ids, batch, seq, hidden_states.device)
        norm = self.norm
        mixed = run_mixer_math(
            mamba2_math,
            hidden_states.device,
            self.in_proj(hidden_states),
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            self.dt_bias,
            self.A_log,
            self.D,
            norm.weight,
            padding,
            starts,
            heads=self.num_heads,
            head_dim=self.head_dim,
            groups=self.n_groups,
            state=self.ssm_state_size,
            chunk=self.chunk_size,
            dt_limit=(float(self.time_step_limit[0]), float(self.time_step_limit[1])),
            # the gated norm's groups: its own group_size, or (engine RMSNorm swapped in) the mixer's groups
            norm_group=int(getattr(norm, "group_size", self.intermediate_size // self.n_groups)),
            eps=float(norm.variance_epsilon),
            out_dtype=hidden_states.dtype,
        )
        return self.out_proj(mixed)
