"""The engine's measured extras on the generic path, each chosen by a resolved BackendConfig field.

- rms_norm: the families' RMSNorm modules with standard semantics (weight * x / rms(x), eps) or zero-centered ones
  ((1 + weight) * x / rms(x): Qwen3.5-MoE, Qwen3-Next) become the engine's RMSNorm (Triton / TE), same `weight`
  Parameter; other variants (mean subtraction, gated norms) stay.
- linear='te': the decoder layers' projections become TE Linears (same Parameters).
- fused_ce: the lm_head + cross-entropy in chunks without [tokens, vocab] logits, inside the
  family's own forward, so its aux loss and output stay Transformers' (models/fused_ce.py: which models
  can take it, what 'auto' becomes, the output without logits).
- fp8: TransformerEngine's FP8 region around the forward; attention='sdpa' on CUDA: cuDNN first.
- swiglu='triton': the dense SwiGLU MLPs (shared experts, dense layers) run the fused SwiGLU kernel
  (models/swiglu_mlp.py).
- A family's own extras (its folder's Family.install_extras, models/families/<model_type>/): Qwen3-MoE's
  fused-RoPE attention, fused-residual decoder layer and float32 router; GPT-OSS's fused-RoPE attention;
  DeepSeek-V3's fused MLA q/k/v and tensor-core router logits.

Experts-side extras (Triton SwiGLU, TE experts, expert_recompute) live in moe/hf_experts.py, the
Triton combine in the dispatchers.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import nn

from workbench.kernels.rms_norm import RMSNorm
from workbench.kernels.te_common import fp8_autocast
from workbench.kernels.te_linear import to_te_linear
from workbench.models.attention_sinks import forward_sequences
from workbench.models.engine_state import EngineState, engine_state
from workbench.models.families import GENERIC, Family
from workbench.models.fused_ce import DeferredLMHead, deferred_logits, fused_ce_for_model, without_logits
from workbench.models.input_embedding import use_engine_embeddings
from workbench.models.router_aux import (
    attach_router_logit_hooks,
    forward_loss_parts,
    has_standard_aux_loss,
    records_router_logits,
)
from workbench.models.save_model import save_pretrained
from workbench.models.swiglu_mlp import use_swiglu_mlps
from workbench.parallel.fsdp import decoder_layers

log = logging.getLogger(__name__)


def attention_backend(backend, device: torch.device):
    """SDPA kernel preference for the forward (the backward follows the forward's choice).

    On Hopper, cuDNN's fused attention runs Qwen3-30B-A3B's causal GQA attention 1.75x faster
    than the flash kernel SDPA picks by default (2.00 vs 3.55 ms fwd+bwd at B2 S4096), so it goes
    first; the others stay as fallbacks for shapes cuDNN refuses.
    """
    if backend is None or backend.attention != "sdpa" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


# ---------------------------------------------------------------- RMSNorm


def _eps_of(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def is_standard_rms_norm(module: nn.Module) -> bool:
    """Whether `module` computes weight * x / sqrt(mean(x^2) + eps) over the last dim, and nothing else.

    Checked on the module itself: one 1-D `weight` parameter, no buffers or children, an eps
    attribute, and its own forward on random float32 CPU inputs (one scale where eps is negligible,
    one where it dominates) equal to the formula. Variants ((1 + weight), mean subtraction, another
    eps) fail the probe and keep their own forward.
    """
    return rms_norm_offset(module) == 0.0


def rms_norm_offset(module: nn.Module) -> float | None:
    """0.0 where `module` is a standard RMSNorm (is_standard_rms_norm), 1.0 where it is zero-centered,
    (1 + weight) * x / sqrt(mean(x^2) + eps) (Qwen3_5MoeRMSNorm, Qwen3NextRMSNorm, Gemma's), None for anything else.

    The same probe for both: the module's own forward on random float32 CPU inputs equal to the formula with that
    offset. The two formulas differ by a whole normalized x, so at most one of them can match.
    """
    params = dict(module.named_parameters(recurse=False))
    eps = _eps_of(module)
    if (
        set(params) != {"weight"}
        or params["weight"].dim() != 1
        or eps is None
        or list(module.children())
        or list(module.buffers(recurse=False))
    ):
        return None
    width = params["weight"].shape[0]
    # CPU tensors named explicitly: a model built under `with torch.device("cuda")` must probe the same way
    g = torch.Generator().manual_seed(width)
    weight = 1.0 + 0.5 * torch.randn(width, generator=g, device="cpu")
    offsets = [0.0, 1.0]
    for scale in (1.0, eps**0.5):
        x = scale * torch.randn(3, width, generator=g, device="cpu")
        normalized = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        try:
            with torch.no_grad():
                got = torch.func.functional_call(module, {"weight": weight}, (x,))
        except Exception:  # a forward that needs more than (x,) is not a plain RMSNorm
            return None
        if not (isinstance(got, torch.Tensor) and got.shape == normalized.shape):
            return None
        offsets = [
            offset
            for offset in offsets
            if torch.allclose(got.float(), (offset + weight) * normalized, rtol=1e-5, atol=1e-6)
        ]
    return offsets[0] if len(offsets) == 1 else None


def swap_rms_norms(model: nn.Module, backend: str) -> list[str]:
    """Every standard or zero-centered RMSNorm of `model` (rms_norm_offset) becomes the engine's RMSNorm(`backend`,
    that offset); names of those swapped.

    backend='torch' swaps nothing: Transformers' own modules are the torch path.
    """
    if backend == "torch":
        return []

    swapped, refused = [], set()
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if "RMSNorm" not in type(child).__name__ and not hasattr(child, "variance_epsilon"):
                continue  # not norm-like at all: skip the probe
            if isinstance(child, RMSNorm):
                continue
            offset = rms_norm_offset(child)
            if offset is None:
                refused.add(type(child).__name__)
                continue
            weight = child.weight
            norm = RMSNorm(weight.shape[0], _eps_of(child), backend, device="meta", offset=offset)
            norm.weight = weight
            setattr(parent, child_name, norm)
            swapped.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    if refused:
        log.warning(
            "rms_norm=%r: %s keep Transformers' forward (neither weight * x / rms(x) nor (1 + weight) * x / rms(x))",
            backend,
            ", ".join(sorted(refused)),
        )
    return swapped


# ---------------------------------------------------------------- TE linear


def swap_linears(model: nn.Module, backend: str, num_experts: int) -> list[str]:
    """linear='te': the decoder layers' nn.Linear projections become TE Linears, same Parameters.

    Left alone: the experts (not nn.Linear), router-shaped layers (num_experts or 1 outputs: routing
    stays in the model dtype) and widths TE's GEMMs refuse (not multiples of 16); lm_head too (the
    fused cross-entropy reads its weight directly).
    """
    if backend != "te":
        return []

    swapped = []
    for layer in decoder_layers(model):
        for parent_name, parent in list(layer.named_modules()):
            for child_name, child in list(parent.named_children()):
                if type(child) is not nn.Linear or child.out_features in (num_experts, 1):
                    continue
                if child.in_features % 16 or child.out_features % 16:
                    continue
                setattr(parent, child_name, to_te_linear(child))
                swapped.append(f"{parent_name}.{child_name}")
    return swapped


class EngineCausalLM:
    """Mixin in front of Transformers' causal LM class: its forward inside the engine's extras."""

    workbench_state: EngineState | None = None  # engine_state(model): what the engine resolved and built for it

    def forward(self, *args, return_logits: bool = False, **kwargs):
        """Transformers' forward; with labels under fused_ce the loss skips the logits (models/fused_ce.py):
        reading them then raises an error that says how to get them. `return_logits=True`: this call computes
        Transformers' loss from full logits and returns them."""
        backend = self.workbench_state.backend
        ids = kwargs.get("input_ids", args[0] if args else None)
        if backend.fp8 and ids is not None and ids.numel() % 16:
            raise ValueError(
                f"fp8=True needs batch x sequence divisible by 16 (TransformerEngine's FP8 "
                f"GEMMs take the token count as a leading dimension); got {tuple(ids.shape)}"
            )
        fused = backend.fused_ce is True and kwargs.get("labels") is not None and not return_logits
        if fused and kwargs.get("logits_to_keep"):
            raise ValueError(
                "logits_to_keep cannot be combined with labels under fused_ce (no logits are built); "
                "pass return_logits=True to compute the loss from full logits"
            )

        with contextlib.ExitStack() as stack:
            stack.enter_context(attention_backend(backend, self.device))
            stack.enter_context(fp8_autocast(backend.fp8))
            if fused:
                stack.enter_context(deferred_logits(self, backend.cross_entropy == "triton"))

            out = super().forward(*args, **kwargs, **forward_sequences(self, args, kwargs))
        return without_logits(out) if fused else out

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Transformers' save; a model sharded over a mesh gathers its experts first (collective); LoRA: merged."""
        state = engine_state(self)
        if state.mesh is None and state.lora is None:
            return super().save_pretrained(save_directory, *args, **kwargs)
        return save_pretrained(self, save_directory, kwargs.get("max_shard_size", "5GB"))


class EngineCausalLMSharedAux(EngineCausalLM):
    """EngineCausalLM for a family with Transformers' standard aux loss, computed once by the engine.

    With router logits asked for, Transformers' forward runs without them (its loss is then the
    cross-entropy alone), the router hooks record the logits, and `loss` is the cross-entropy +
    router_aux_loss_coef x aux, as Transformers returns it (models/router_aux.forward_loss_parts).
    A data-parallel `aux_loss_group` makes the aux loss this rank's share of the group's.
    """

    def forward(self, *args, aux_loss_group=None, **kwargs):
        """EngineCausalLM's forward; `aux_loss_group` (a process group) makes the aux loss this rank's share."""
        router = kwargs.get("output_router_logits")
        router = self.config.output_router_logits if router is None else router
        if not router:
            return super().forward(*args, **kwargs)
        # One process too: Transformers 5.17's own aux loss counts experts with bincount (a host sync per layer)
        parts = forward_loss_parts(self, functools.partial(super().forward, *args), kwargs, group=aux_loss_group)
        out = parts.out
        out["router_logits"] = parts.router_logits
        out["aux_loss"] = parts.aux
        if parts.ce is not None:
            out["loss"] = parts.ce + self.router_aux_loss_coef * parts.aux.to(parts.ce.device)
        return out


def engine_lm_class(hf_class: type, router_modules: bool = True) -> type:
    """A same-named subclass of the Transformers causal LM with the engine's forward (save writes its name).

    It claims the Transformers class's module too: Transformers takes a class from any other module for custom code
    and then skips the class's own checkpoint renaming when it saves, applying the family's renaming to its base
    model instead (DeepSeek-V4's save wrote `model.embed.weight`, `model.hc_head_fn`, ... where vanilla reads
    `model.embed_tokens.weight`, `model.hc_head.hc_fn`); its other module-keyed choices (whether the attention and
    experts implementations can be set) then answer as for the Transformers class.
    `router_modules`: whether Transformers records the router logits from modules (router_aux.records_router_logits);
    the engine's shared aux loss needs them.
    """
    if issubclass(hf_class, EngineCausalLM):
        return hf_class
    shared = router_modules and has_standard_aux_loss(hf_class)
    mixin = EngineCausalLMSharedAux if shared else EngineCausalLM
    return type(
        hf_class.__name__, (mixin, hf_class), {"__module__": hf_class.__module__, "__qualname__": hf_class.__qualname__}
    )


def install_extras(model: nn.Module, backend, num_experts: int, family: Family = GENERIC) -> dict[str, int]:
    """Apply every extra `backend` (resolved) selects to `model`, `family`'s own too; how many modules each changed.

    fused_ce='auto' is decided here for the model as built (models/fused_ce.py), and the model's state holds
    the decision."""
    backend = fused_ce_for_model(backend, model)
    if backend.fused_ce:
        model.get_output_embeddings().__class__ = DeferredLMHead
    counts = {
        "rms_norm": len(swap_rms_norms(model, backend.rms_norm)),
        "linear": len(swap_linears(model, backend.linear, num_experts)),
        "rope": 0,
        "fused_residual": 0,
        "float32_router": 0,
    }
    for extra, changed in family.install_extras(model, backend).items():
        counts[extra] = counts.get(extra, 0) + changed
    counts["swiglu_mlp"] = use_swiglu_mlps(model, backend.swiglu)
    counts["embedding"] = use_engine_embeddings(model, backend.embedding)
    model.__class__ = engine_lm_class(type(model), records_router_logits(model))
    state = engine_state(model)
    state.backend = backend
    if isinstance(model, EngineCausalLMSharedAux) and state.router_sink is None:
        counts["router_hooks"] = attach_router_logit_hooks(model)
    return counts
