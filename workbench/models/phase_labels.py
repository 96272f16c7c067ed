"""Profiler phase labels on the generic path: `workbench.router` and `workbench.attention` ranges.

workbench/train/profile.py turns the engine's `record_function` ranges into phases_ms. The
dispatch, experts and combine ranges are EngineExperts.forward's own (moe/hf_experts.py); this
module puts the router's and the attention's around the family's own modules, with forward
hooks (no parameter renamed, no class changed). A range costs about a microsecond per call when
no profiler runs, so the labels stay on, as they were on the removed Qwen3 adapter.
"""

from __future__ import annotations

from torch import nn
from torch.profiler import record_function

from workbench.moe.hf_experts import engine_experts_modules

# The attribute the family's MoE block keeps its router under: `gate` (Qwen-MoE, Mixtral, OLMoE,
# DeepSeek-V3, ...) or `router` (GPT-OSS), beside the `experts` module.
ROUTER_NAMES = ("gate", "router")


class PhaseRange:
    """The forward hooks that open and close one profiler range around a module's forward."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.open: list[record_function] = []

    def enter(self, module: nn.Module, args) -> None:
        """Forward pre-hook: open the range."""
        opened = record_function(self.label)
        opened.__enter__()
        self.open.append(opened)

    def leave(self, module: nn.Module, args, output) -> None:
        """Forward hook (also when the forward raises): close it."""
        self.open.pop().__exit__(None, None, None)


def label_module(module: nn.Module, label: str) -> bool:
    """Wrap every forward of `module` in the profiler range `label`; False where it has one already."""
    # the module's own hook registry says whether it has one
    if any(isinstance(getattr(hook, "__self__", None), PhaseRange) for hook in module._forward_pre_hooks.values()):
        return False
    phase = PhaseRange(label)
    module.register_forward_pre_hook(phase.enter)
    module.register_forward_hook(phase.leave, always_call=True)  # closed also when the forward raises
    return True


def router_of(model: nn.Module, experts_name: str) -> nn.Module | None:
    """The router beside the experts module `experts_name` in its MoE block (None where there is none)."""
    block = model.get_submodule(experts_name.rpartition(".")[0])
    for name in ROUTER_NAMES:
        router = getattr(block, name, None)
        if isinstance(router, nn.Module):
            return router
    return None


def label_phases(model: nn.Module) -> dict[str, int]:
    """Label every router and self-attention module of `model` (after the engine's experts are in)."""
    routers = [router_of(model, name) for name, _ in engine_experts_modules(model)]
    attentions = [m.self_attn for m in model.modules() if isinstance(getattr(m, "self_attn", None), nn.Module)]
    return {
        "router": sum(label_module(r, "workbench.router") for r in routers if r is not None),
        "attention": sum(label_module(a, "workbench.attention") for a in attentions),
    }
