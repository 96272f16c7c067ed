"""The decoder's dense SwiGLU MLPs (shared experts, dense layers) with the engine's fused SwiGLU kernel.

DeepSeek-V3 and Moonlight (shared experts, the first dense layers), Qwen2-MoE (the shared expert), GLM-4 MoE and
others compute down_proj(silu(gate_proj(x)) * up_proj(x)) with eager elementwise kernels: silu and mul forward,
silu_backward and two muls backward (1 x H200, Moonlight L8 seq 4096 x 2: ~1.7 ms of the step, profile of
2026-12-02). With swiglu='triton' one kernel runs each way, as in the experts. A module qualifies on itself: exactly
the nn.Linear children gate_proj, up_proj and down_proj, no other parameters or buffers, and its own forward on
probe weights equal to the formula; anything else keeps Transformers' forward. The engine class subclasses the
module's own (a class swap), so parameter names, state dict keys and LoRA wrapping of the projections are unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from workbench.kernels.swiglu import swiglu

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_standard_swiglu_mlp(module: nn.Module) -> bool:
    """Whether `module` is exactly down_proj(silu(gate_proj(x)) * up_proj(x)) over three nn.Linear children."""
    children = dict(module.named_children())
    if not all(type(children.get(name)) is nn.Linear for name in _PROJECTIONS):
        return False
    if set(children) - {*_PROJECTIONS, "act_fn"} or list(module.buffers()):
        return False
    params = dict(module.named_parameters())
    if not all(f"{name}.weight" in params for name in _PROJECTIONS):
        return False
    # probe weights on the CPU (the model's own may be on meta or a GPU), biases where the module has them
    g = torch.Generator().manual_seed(0)
    hidden, inner = 5, 3
    shapes = {"gate_proj": (inner, hidden), "up_proj": (inner, hidden), "down_proj": (hidden, inner)}
    probe = {}
    for name in params:
        proj, kind = name.split(".", 1)
        if proj not in shapes or kind not in ("weight", "bias"):
            return False
        shape = shapes[proj] if kind == "weight" else shapes[proj][:1]
        probe[name] = torch.randn(shape, generator=g, device="cpu")
    x = torch.randn(4, hidden, generator=g, device="cpu")
    gate = F.linear(x, probe["gate_proj.weight"], probe.get("gate_proj.bias"))
    up = F.linear(x, probe["up_proj.weight"], probe.get("up_proj.bias"))
    want = F.linear(F.silu(gate) * up, probe["down_proj.weight"], probe.get("down_proj.bias"))
    try:
        with torch.no_grad():
            got = torch.func.functional_call(module, probe, (x,))
    except Exception:  # a forward that needs more than (x,) is not this MLP
        return False
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)


class EngineSwiGLU:
    """Mixin put in front of a Transformers MLP class: its forward on the fused SwiGLU kernel."""

    swiglu_backend: str = "torch"  # the resolved BackendConfig.swiglu, set by use_swiglu_mlps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down_proj(swiglu(gate_proj(x), up_proj(x))) with the fused kernel."""
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_backend))


@functools.cache
def _engine_class(hf_class: type) -> type:
    """The engine subclass of one Transformers MLP class (one per class, so isinstance checks keep working)."""
    return type(f"Engine{hf_class.__name__}", (EngineSwiGLU, hf_class), {"__module__": __name__})


def use_swiglu_mlps(model: nn.Module, backend: str) -> int:
    """Every standard dense SwiGLU MLP of `model` runs the `backend` SwiGLU kernel; how many ('torch': none)."""
    if backend == "torch":
        return 0
    probed: dict[type, bool] = {}
    swapped = 0
    for module in model.modules():
        cls = type(module)
        if cls.__module__ == __name__:
            continue  # already the engine's
        if cls not in probed:
            probed[cls] = is_standard_swiglu_mlp(module)
        if probed[cls]:
            module.__class__ = _engine_class(cls)
            module.swiglu_backend = backend
            swapped += 1
    return swapped
