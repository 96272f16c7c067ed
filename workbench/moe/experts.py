"""Expert weights [num_local_experts, ...] and their compute backends (a small registry)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from workbench.kernels.te_experts import experts_te

# (x_by_expert_ND, tokens_per_expert_E, gate_up_E2IH, down_EHI, gate) -> y_by_expert_ND, where
# gate maps the packed [N, 2I] = cat(gate, up) rows to [N, I] (packed_gate builds it).
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Callable], torch.Tensor]


def is_silu(act) -> bool:
    """Whether `act` is exactly SiLU (torch's module or function, or Transformers' SiLUActivation)."""
    from transformers.activations import SiLUActivation

    return type(act) in (nn.SiLU, SiLUActivation) or act is F.silu


def packed_gate(act: Callable, swiglu: str = "torch") -> Callable[[torch.Tensor], torch.Tensor]:
    """[N, 2I] = cat(gate, up) -> act(gate) * up; the Triton kernel with swiglu='triton' and a SiLU `act`."""
    if swiglu not in ("torch", "triton"):
        raise ValueError(f"swiglu must be a resolved BackendConfig.swiglu, 'torch' or 'triton'; got {swiglu!r}")
    if swiglu == "triton" and is_silu(act):
        # One fused pass over the [N, 2I] tensor instead of four elementwise kernels.
        from workbench.kernels.swiglu import swiglu_packed_triton

        return swiglu_packed_triton

    def gate_torch(gate_up_N2I: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_N2I.chunk(2, dim=-1)
        return act(gate) * up

    return gate_torch


def experts_loop(x_ND, tokens_per_expert, gate_up, down, act) -> torch.Tensor:
    """One matmul pair per expert: correct for any shape, dtype and device (needs a host sync)."""
    counts = tokens_per_expert.tolist()
    outputs, start = [], 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        x_e = x_ND[start:start + count]
        h_e = act(F.linear(x_e, gate_up[e]))
        outputs.append(F.linear(h_e, down[e]))
        start += count
    if not outputs:
        # Keep the weights in the graph so every rank's backward touches the same parameters.
        return x_ND.new_zeros(x_ND.shape) + 0.0 * (gate_up.sum() + down.sum())
    return torch.cat(outputs, dim=0)


def _grouped_mm() -> Callable:
    return getattr(F, "grouped_mm", None) or torch._grouped_mm


def grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM accepts these operands (dtype, device, 16-byte strides)."""
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    allowed = (torch.bfloat16,) if x.device.type == "cuda" else (torch.float32, torch.bfloat16)
    if x.dtype not in allowed or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 8:
        return False
    hidden, inter = down.shape[1], down.shape[2]
    return all((width * x.element_size()) % 16 == 0 for width in (hidden, inter))


def experts_grouped_mm(x_ND, tokens_per_expert, gate_up, down, act) -> torch.Tensor:
    """torch grouped GEMM (no host sync); falls back to the loop where the shapes are refused."""
    if not grouped_mm_supported(x_ND, gate_up, down):
        return experts_loop(x_ND, tokens_per_expert, gate_up, down, act)
    gmm = _grouped_mm()
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    h_N2I = gmm(x_ND, gate_up.transpose(-2, -1), offs=offsets)
    h_NI = act(h_N2I)
    return gmm(h_NI, down.transpose(-2, -1), offs=offsets)


EXPERTS_BACKENDS: dict[str, ExpertsFn] = {
    "loop": experts_loop,
    "grouped_mm": experts_grouped_mm,
    "te": experts_te,  # TransformerEngine GroupedLinear; imports TE only when it runs
}


class GroupedExperts(nn.Module):
    """The experts this rank owns, stored fused as Transformers holds them in memory.

    `gate_up_proj` is [num_local_experts, 2*intermediate, hidden] (gate rows, then up rows) and
    `down_proj` is [num_local_experts, hidden, intermediate], so parameter names and layouts
    equal Transformers' Qwen3-MoE experts and state dicts map one to one.
    """

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, act: Callable,
                 backend: str = "grouped_mm", first_expert: int = 0, num_experts: int | None = None,
                 recompute: bool = False, swiglu: str = "torch"):
        super().__init__()
        if backend not in EXPERTS_BACKENDS:
            raise ValueError(f"unknown experts backend {backend!r}; choose one of {list(EXPERTS_BACKENDS)}")
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act
        self.gate_fn = packed_gate(act, swiglu)
        self.backend = backend
        self.first_expert = first_expert
        self.num_local_experts = gate_up_proj.shape[0]
        self.num_experts = num_experts if num_experts is not None else self.num_local_experts
        self.recompute = recompute

    def forward(self, x_by_expert_ND: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Expert outputs for expert-major tokens, `tokens_per_expert` rows each."""
        fn = EXPERTS_BACKENDS[self.backend]
        if self.recompute and torch.is_grad_enabled():
            # Saves only the input rows; the [N, 2I] and [N, I] intermediates are rebuilt in backward.
            return checkpoint(fn, x_by_expert_ND, tokens_per_expert, self.gate_up_proj, self.down_proj,
                              self.gate_fn, use_reentrant=False)
        return fn(x_by_expert_ND, tokens_per_expert, self.gate_up_proj, self.down_proj, self.gate_fn)

    def extra_repr(self) -> str:
        last = self.first_expert + self.num_local_experts
        return (f"experts [{self.first_expert}, {last}) of {self.num_experts}, backend={self.backend}"
                + (", recompute" if self.recompute else ""))
