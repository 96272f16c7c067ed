"""The engine's experts for any Transformers v5 `@use_experts_implementation` module.

The module stays Transformers' own (its parameters, names, layout flags, `_apply_gate`, optional
`post_expert_norm`); only its class is swapped for a subclass whose forward is the engine's:
dispatch (local / alltoall), grouped GEMMs over this rank's experts, weighted combine, in the order of the
dispatcher contract (moe/dispatch/contract.py). Everything it runs with is one frozen ExpertsPlan, resolved once
at install (its one field, `plan`). Under expert parallelism the fused `[E, ...]` tensors hold only experts
[first, last).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint
from transformers.integrations import moe as hf_moe

from workbench.kernels import te_common
from workbench.kernels.gpt_oss_gate import expert_row_bias
from workbench.kernels.registry import KernelRegistry
from workbench.kernels.swiglu import swiglu_packed_triton
from workbench.kernels.te_experts import FP8_ROW_ALIGN, grouped_linear_te
from workbench.moe.dispatch.contract import Dispatcher, caps_of
from workbench.moe.expert_wgrad import WGRAD_BACKENDS, wgrad_refusal
from workbench.moe.grouped_linear import grouped_linear, grouped_mm_dtypes, row_offsets
from workbench.moe.lora_experts import ExpertsLora, lora_rows
from workbench.moe.routed_load import attach_load_counter, count_routed
from workbench.moe.router import GATES, balanced_ids
from workbench.moe.row_weights import weighted_swiglu, weights_fold_into_rows

# Shape suffixes: T tokens, D hidden, E experts, N routed rows, I intermediate; weight_EKN: [E, K in, N out].

# The flags' defaults of the decorator (transformers.integrations.moe); 5.17 lacks some of them.
LAYOUT_DEFAULTS = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}


@dataclass(frozen=True)
class ExpertsLayout:
    """How a Transformers experts module stores its fused weights."""

    has_gate: bool = True
    has_bias: bool = False
    is_transposed: bool = False
    is_concatenated: bool = True
    has_post_expert_norm: bool = False

    @property
    def up_name(self) -> str:
        """The fused up (or gate+up) parameter's name."""
        return "gate_up_proj" if self.has_gate else "up_proj"

    def param_names(self) -> tuple[str, ...]:
        """Every per-expert parameter of the module, `[E, ...]` each."""
        names = (self.up_name, "down_proj")
        return names + tuple(f"{n}_bias" for n in names) if self.has_bias else names


@dataclass(frozen=True)
class ExpertsPlan:
    """What one engine experts module runs with: resolved once, at install (install_engine_experts).

    The fields after `gate` follow from the others and the dispatcher's declared caps (DispatcherCaps), so a plan
    with another dispatcher (`with_dispatcher`) is resolved again.
    """

    layout: ExpertsLayout
    dispatcher: Dispatcher | None  # None: rows only (kernel benchmarks call expert_rows without dispatching)
    backend: str  # BackendConfig.experts: 'grouped_mm', 'loop' or 'te'
    expert_range: tuple[int, int]  # this rank's experts [first, last) of the model's
    grouped_mm_dtypes: tuple[torch.dtype, ...]  # what grouped_mm takes where the experts run; () for 'loop'
    swiglu: str  # 'triton' where the engine has a kernel for the family's gate and BackendConfig.swiglu asked for it
    # the family's own experts on expert-major rows (Family.expert_rows: GPT-OSS's fused gate), else None
    family_rows: Callable | None
    gate_takes_weights: bool  # the rows can take their routing weights in the SwiGLU (moe/row_weights.py)
    recompute: bool  # BackendConfig.expert_recompute
    expert_wgrad: str  # BackendConfig.expert_wgrad
    gate: str  # 'native' or the bench's 'balanced' round-robin assignment
    lora: ExpertsLora | None = None  # the module's LoRA adapters (moe/lora_experts.py)
    # resolved from the dispatcher's caps
    weights_in_rows: bool = field(init=False)  # the rows take their routing weights; the combine sums plain rows
    counts_from_dispatch: bool = field(init=False)  # the dispatch's tokens_per_expert are the router's choices
    combine_adds_residual: bool = field(init=False)  # the combine adds a residual stream handed to forward
    experts_in_dispatcher: bool = field(init=False)  # the dispatcher runs the GEMMs between its exchanges

    def __post_init__(self) -> None:
        caps = caps_of(self.dispatcher)
        object.__setattr__(self, "weights_in_rows", self.gate_takes_weights and caps.rows_take_weights)
        object.__setattr__(self, "counts_from_dispatch", caps.counts_every_expert)
        object.__setattr__(self, "combine_adds_residual", caps.combine_adds_residual)
        object.__setattr__(self, "experts_in_dispatcher", caps.pipelines_experts)

    def with_dispatcher(self, dispatcher: Dispatcher | None) -> ExpertsPlan:
        """This plan with another dispatcher, its caps resolved again."""
        return dataclasses.replace(self, dispatcher=dispatcher)


def is_silu(act) -> bool:
    """Whether `act` is exactly SiLU (torch's module or function, or Transformers' SiLUActivation)."""
    from transformers.activations import SiLUActivation

    return type(act) in (nn.SiLU, SiLUActivation) or act is F.silu


def layout_of(module: nn.Module) -> ExpertsLayout:
    """The layout flags the decorator set on `module`, defaults where this version has none."""
    return ExpertsLayout(**{k: bool(getattr(module, k, v)) for k, v in LAYOUT_DEFAULTS.items()})


def is_fused_experts(module: nn.Module) -> bool:
    """Whether `module` is a v5 experts module: decorated, with fused 3-D `[E, ...]` weights."""
    if isinstance(module, EngineExperts):
        return True
    if not hasattr(module, "has_bias") or not callable(getattr(type(module), "_apply_gate", None)):
        return False
    layout = layout_of(module)
    weights = [getattr(module, layout.up_name, None), getattr(module, "down_proj", None)]
    return all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights)


def _decorated_forward_code():
    class Probe(nn.Module):
        def forward(self, x):
            return x

    return hf_moe.use_experts_implementation(Probe).forward.__code__


# The forward @use_experts_implementation gives a class: one code object for every class it decorates.
DECORATED_FORWARD = _decorated_forward_code()


def decorated_experts_class(cls: type) -> type | None:
    """The class along `cls`'s hierarchy that @use_experts_implementation decorated, or None."""
    for klass in cls.__mro__:
        if getattr(vars(klass).get("forward"), "__code__", None) is DECORATED_FORWARD:
            return klass
    return None


def own_forward_class(module: nn.Module) -> type | None:
    """The subclass of the decorated experts class whose own forward `module` runs around the decorated one
    (Ergo's ErgoExperts: a per-expert norm before the weighted sum), or None where the decorated forward is it."""
    decorated = decorated_experts_class(type(module))
    if decorated is None:
        return None
    for klass in type(module).__mro__:
        if klass is decorated:
            return None
        if klass is not EngineExperts and "forward" in vars(klass):
            return klass
    return None


def own_forward_refusal(module: nn.Module, honoured: tuple[str, ...] = ()) -> str | None:
    """Why the engine must not take `module` over: its class adds steps of its own around the decorated forward, which
    the engine's forward would skip (its weights would get no gradient and the outputs would differ), unless its
    family's expert rows reproduce that class's forward (`honoured`: class names, Family.experts_forwards); or None.
    """
    own = own_forward_class(module)
    if own is None or own.__name__ in honoured:
        return None
    decorated = decorated_experts_class(type(module))
    return (
        f"{own.__name__} overrides the forward of {decorated.__name__} (Transformers' @use_experts_implementation "
        f"class) with steps of its own, which the engine's experts forward would skip: the engine refuses it rather "
        f"than compute something else. Run this model with vanilla Transformers, or give its family a folder "
        f"(workbench/models/families/<model_type>/) whose expert_rows reproduce {own.__name__}.forward and that lists "
        f"it in Family.experts_forwards"
    )


def expert_offsets(module: nn.Module, tokens_per_expert: torch.Tensor) -> torch.Tensor | None:
    """The grouped GEMMs' row offsets, None where `module` runs the per-expert loop."""
    return row_offsets(tokens_per_expert) if module.plan.grouped_mm_dtypes else None


def expert_linear(
    module: nn.Module,
    weight: str,
    x_ND: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """grouped_linear of fused weight `weight` of `module`, plus its LoRA rows where it has adapters.

    `offsets`: expert_offsets of the rows, where the caller shares them over its GEMMs (up and down and their
    adapters use the same rows: one cumsum per layer, each a launch, and LoRA steps are launch-bound).
    """
    plan: ExpertsPlan = module.plan
    dtypes = plan.grouped_mm_dtypes  # decided at install
    if offsets is None:
        offsets = expert_offsets(module, tokens_per_expert)
    weight_E = getattr(module, weight)
    y = grouped_linear(x_ND, tokens_per_expert, weight_E, plan.layout.is_transposed, dtypes, offsets, plan.expert_wgrad)
    delta = lora_rows(module, weight, x_ND, tokens_per_expert, dtypes, offsets)
    return y if delta is None else y + delta


def is_plain_swiglu(module: nn.Module) -> bool:
    """Whether the family's gate is Transformers' default one: silu(gate half) * up half, concatenated.

    Read from the module, not the family name: its class keeps the decorator's default `_apply_gate`
    (a family with its own gate, e.g. GPT-OSS's clamped interleaved one, overrides it) and its
    activation is SiLU. Only then can the Triton packed SwiGLU replace the gate.
    """
    from transformers.integrations import moe as hf_moe

    layout = layout_of(module)
    gate = getattr(type(module), "_apply_gate", None)
    if not (
        layout.has_gate and layout.is_concatenated and gate is not None and is_silu(getattr(module, "act_fn", None))
    ):
        return False
    if gate is getattr(hf_moe, "_default_apply_gate", None):
        return True
    # A version without that name: the gate itself, on values large enough to reach any clamp, must be plain.
    h = 30 * torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        try:
            got = gate(module, h)
        except Exception:
            return False
    return isinstance(got, torch.Tensor) and got.shape == (4, 8) and torch.allclose(got, F.silu(h[:, :8]) * h[:, 8:])


def _gate(module: nn.Module, h_NI2: torch.Tensor, row_weights_N: torch.Tensor | None = None) -> torch.Tensor:
    if row_weights_N is not None:  # the routing weights, applied here instead of in the combine
        return weighted_swiglu(module, h_NI2, row_weights_N)
    plan: ExpertsPlan = module.plan
    if not plan.layout.has_gate:
        return module.act_fn(h_NI2)
    if plan.swiglu == "triton" and plan.family_rows is None:
        return swiglu_packed_triton(h_NI2)  # one pass over [N, 2I] instead of chunk/silu/mul
    # The family's own gate (GPT-OSS's clamped SwiGLU splits interleaved gate/up columns itself).
    return module._apply_gate(h_NI2)


def _te_linear_rows(x_ND: torch.Tensor, counts: list[int], weight_E: torch.Tensor) -> torch.Tensor:
    return grouped_linear_te(x_ND, counts, weight_E)  # TE's GroupedLinear takes [E, out, in]: untransposed


def _expert_rows_te(
    module: nn.Module, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor, row_weights_N: torch.Tensor | None = None
) -> torch.Tensor:
    """experts='te': TE GroupedLinear GEMMs (FP8 inside fp8_autocast: rows padded to 16 per expert)."""
    if row_weights_N is not None:
        raise ValueError("experts='te' applies the routing weights in the combine, not in its rows")

    layout: ExpertsLayout = module.plan.layout
    te = te_common.import_te("experts")  # first: without TE the error names the pip extra
    te_common.check_cuda("experts", x_ND)
    counts = [int(c) for c in tokens_per_expert.tolist()]
    up, down = getattr(module, layout.up_name), module.down_proj
    if sum(counts) == 0:  # keep the weights in the graph so every rank reaches the same parameters
        return x_ND.new_zeros(x_ND.shape) + 0.0 * sum(getattr(module, n).sum() for n in layout.param_names())
    fp8 = te_common.fp8_active()
    rows_x, rows_counts = te.Fp8Padding(len(counts), FP8_ROW_ALIGN)(x_ND, counts) if fp8 else (x_ND, counts)
    row_counts_t = torch.tensor(rows_counts, device=x_ND.device)
    h = _te_linear_rows(rows_x, rows_counts, up)
    if layout.has_bias:
        h = h + expert_row_bias(getattr(module, f"{layout.up_name}_bias"), row_counts_t, h.shape[0])
    y = _te_linear_rows(_gate(module, h), rows_counts, down)
    if layout.has_bias:
        y = y + expert_row_bias(module.down_proj_bias, row_counts_t, y.shape[0])
    if fp8:  # padded rows only ever reach the dropped outputs: no gradient flows from them
        y = te.Fp8Unpadding(len(counts), FP8_ROW_ALIGN)(y, counts)
    return module.post_expert_norm(y) if layout.has_post_expert_norm else y


def _expert_rows_torch(
    module: nn.Module, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor, row_weights_N: torch.Tensor | None = None
) -> torch.Tensor:
    """experts='grouped_mm' / 'loop': torch GEMMs (grouped where the module's grouped_mm dtypes allow).

    `row_weights_N`: each row's routing weight, applied to the SwiGLU's output (moe/row_weights.py).
    """
    plan: ExpertsPlan = module.plan
    layout = plan.layout
    if plan.family_rows is not None:  # the family's own kernel for its gate (models/families/)
        return plan.family_rows(module, x_ND, tokens_per_expert)
    rows = x_ND.shape[0]
    offsets = expert_offsets(module, tokens_per_expert)
    h = expert_linear(module, layout.up_name, x_ND, tokens_per_expert, offsets)
    if layout.has_bias:
        h = h + expert_row_bias(getattr(module, f"{layout.up_name}_bias"), tokens_per_expert, rows)
    h = _gate(module, h, row_weights_N)
    y = expert_linear(module, "down_proj", h, tokens_per_expert, offsets)
    if layout.has_bias:
        y = y + expert_row_bias(module.down_proj_bias, tokens_per_expert, rows)
    if layout.has_post_expert_norm:
        y = module.post_expert_norm(y)
    return y


# The generic path's experts implementations by BackendConfig.experts ('loop' is grouped_mm with no
# grouped_mm dtypes: install_engine_experts decides that once).
EXPERTS_BACKENDS = KernelRegistry(
    "experts", {"loop": _expert_rows_torch, "grouped_mm": _expert_rows_torch, "te": _expert_rows_te}
)


def expert_rows(
    module: nn.Module, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor, row_weights_N: torch.Tensor | None = None
) -> torch.Tensor:
    """The experts' outputs for expert-major rows, as the family computes them (bias, gate, norm).

    `row_weights_N`: the rows' routing weights where the module applies them (plan.weights_in_rows).
    """
    return EXPERTS_BACKENDS[module.plan.backend](module, x_ND, tokens_per_expert, row_weights_N)


class EngineExperts:
    """Mixin put in front of a Transformers experts class: the engine's forward, same parameters."""

    plan: ExpertsPlan  # everything it runs with, resolved once by install_engine_experts

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Transformers' experts call: tokens [T, D], the router's top-k ids and weights [T, K].

        The dispatcher contract's stages in their order (moe/dispatch/contract.py): dispatch, count the routed load,
        the rows' routing weights (where the rows take them), the experts' GEMMs, combine. `residual` (shaped like
        `hidden_states`): a residual stream the combine adds in its sum (the engine's decoder layer passes it where
        plan.combine_adds_residual).
        """
        plan = self.plan
        x_TD = hidden_states.reshape(-1, hidden_states.shape[-1])
        if plan.gate == "balanced":
            # The bench's balanced gate: round-robin ids instead of the router's choice. The router's
            # own weights are kept as they are (not uniform 1/K): they keep the router in the graph
            # and carry the family's scaling (DeepSeek's routed_scaling_factor, GPT-OSS's top-k
            # softmax), so a step's work and numerics differ from a native step only by the assignment.
            top_k_index = balanced_ids(x_TD.shape[0], top_k_index.shape[-1], self.num_experts, x_TD.device)
        dispatcher = plan.dispatcher
        if plan.experts_in_dispatcher:
            return self._pipelined_forward(hidden_states, x_TD, top_k_index, top_k_weights, residual)
        # The profiler's phases (train/profile.py); about a microsecond each with no profiler running.
        with record_function("workbench.dispatch"):
            x_ND, tokens_per_expert, handle = dispatcher.dispatch(x_TD, top_k_index.long(), top_k_weights)
        # the expert load of the plots and the router-bias update; a dispatch that counts every expert's rows
        # already counted the router's choices
        count_routed(self, top_k_index, tokens_per_expert if plan.counts_from_dispatch else None)
        row_weights_N = dispatcher.row_weights(handle) if plan.weights_in_rows else None  # None: combine weighs
        y_ND = self._experts_on_rows(x_ND, tokens_per_expert, row_weights_N)
        combine_args = ()
        if residual is not None:
            if not plan.combine_adds_residual:
                raise ValueError(f"{type(dispatcher).__name__}'s combine adds no residual (its caps)")
            combine_args = (residual.reshape(x_TD.shape),)
        with record_function("workbench.combine"):
            if row_weights_N is None:
                y_TD = dispatcher.combine(y_ND, handle, *combine_args)
            else:
                y_TD = dispatcher.combine(y_ND, handle, *combine_args, weighted=False)
        y_TD = y_TD.to(hidden_states.dtype)
        if y_TD.shape == hidden_states.shape:  # Transformers' MoE blocks pass tokens as [T, D]
            # The combine's own tensor, not a view of it: FSDP2 hooks the experts' output for its pre-backward
            # all-gather, and an in-place op on a returned view would drop that hook (torch warns on every rank).
            return y_TD
        return y_TD.reshape(hidden_states.shape)

    def _experts_on_rows(
        self, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor, row_weights_N: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Stage 3 of the contract: the experts' GEMMs on expert-major rows (recomputed in backward where planned)."""
        with record_function("workbench.experts"):
            if self.plan.recompute and torch.is_grad_enabled():
                # Saves only the input rows; the [N, 2I] and [N, I] intermediates are rebuilt in backward.
                return checkpoint(expert_rows, self, x_ND, tokens_per_expert, row_weights_N, use_reentrant=False)
            return expert_rows(self, x_ND, tokens_per_expert, row_weights_N)

    def _pipelined_forward(self, hidden_states, x_TD, top_k_index, top_k_weights, residual) -> torch.Tensor:
        """The stages run by a dispatcher with caps.pipelines_experts, chunk by chunk, this module's GEMMs between
        its exchanges (moe/dispatch/contract.py: run_stages)."""
        if residual is not None:
            raise ValueError(f"{type(self.plan.dispatcher).__name__}'s combine adds no residual (its caps)")
        count_routed(self, top_k_index, None)  # its counts are its own experts' rows: the router's choices count
        y_TD = self.plan.dispatcher.run_stages(x_TD, top_k_index.long(), top_k_weights, self._experts_on_rows)
        y_TD = y_TD.to(hidden_states.dtype)
        # the combine's own tensor where the shapes agree, as forward returns it (FSDP2 hooks the output)
        return y_TD if y_TD.shape == hidden_states.shape else y_TD.reshape(hidden_states.shape)

    def use_dispatcher(self, dispatcher: Dispatcher) -> None:
        """Run with `dispatcher` from now on (its caps resolved again)."""
        self.plan = self.plan.with_dispatcher(dispatcher)

    def extra_repr(self) -> str:
        """Which experts this rank holds and the GEMM backend."""
        plan = self.plan
        first, last = plan.expert_range
        return (
            f"engine experts [{first}, {last}) of {self.num_experts}, backend={plan.backend}, "
            f"swiglu={plan.swiglu}"
            + (", routing weights in the rows" if plan.weights_in_rows else "")
            + (", recompute" if plan.recompute else "")
        )


def engine_class(hf_class: type) -> type:
    """A subclass of the Transformers experts class with the engine's forward (fully_shard does the same)."""
    if issubclass(hf_class, EngineExperts):
        return hf_class
    return type(f"Engine{hf_class.__name__}", (EngineExperts, hf_class), {"__module__": __name__})


def check_generic_backend(backend: str) -> None:
    """Refuse an experts backend the generic path has no implementation of (before any model is built)."""
    if backend not in EXPERTS_BACKENDS:
        raise ValueError(
            f"experts backend {backend!r} has no generic-path implementation; use one of "
            f"{list(EXPERTS_BACKENDS)} (e.g. BackendConfig(experts='grouped_mm'))"
        )


def install_engine_experts(
    module: nn.Module,
    dispatcher,
    backend: str,
    expert_range: tuple[int, int],
    num_experts: int,
    gate: str = "native",
    swiglu: str = "torch",
    recompute: bool = False,
    device: torch.device | str | None = None,
    wgrad: str = "autograd",
    family_rows: Callable | None = None,
    honoured: tuple[str, ...] = (),
) -> nn.Module:
    """Turn a v5 experts module into the engine's in place; keep only experts [first, last).

    `gate` "balanced" is the bench's round-robin assignment. `swiglu` (a resolved
    BackendConfig.swiglu) takes effect only where the family's gate is plain SwiGLU
    (is_plain_swiglu) or where the family brings its own kernel for it: `family_rows(module, x_ND,
    tokens_per_expert)`, its experts on expert-major rows (models/families/<model_type>: Family.expert_rows,
    GPT-OSS's fused gate); other gates stay the family's own.
    `recompute`: BackendConfig.expert_recompute; `wgrad`: a resolved BackendConfig.expert_wgrad. `device`: where
    the experts will run (the one BackendConfig was resolved for; None: where their weights are now); grouped_mm's
    dtypes there are decided here, once, not per GEMM. A module whose class runs a forward of its own around the
    decorated one is refused unless `family_rows` reproduce it (`honoured`: own_forward_refusal).
    """
    check_generic_backend(backend)
    refusal = own_forward_refusal(module, honoured if family_rows is not None else ())
    if refusal is not None:
        raise ValueError(refusal)
    if gate not in GATES:
        raise ValueError(f"gate {gate!r} is not one of {list(GATES)}")
    if swiglu not in ("torch", "triton"):
        raise ValueError(f"swiglu must be a resolved BackendConfig.swiglu, 'torch' or 'triton'; got {swiglu!r}")
    if wgrad not in WGRAD_BACKENDS:
        raise ValueError(f"wgrad must be a resolved BackendConfig.expert_wgrad, one of {WGRAD_BACKENDS}; got {wgrad!r}")
    layout = layout_of(module)
    if backend == "te" and layout.is_transposed:
        raise ValueError(
            f"experts='te' takes untransposed expert weights [E, out, in]; {type(module).__name__} "
            "stores them transposed: use experts='grouped_mm'"
        )
    first, last = expert_range
    if (first, last) != (0, num_experts):
        # per-expert tensors beside the fused weights (ErgoExperts's post_expert_norm [E, D]) would stay whole on
        # every rank and be reduced as dense ones, while only the owner of an expert computes with its row
        others = [
            n
            for n, p in module.named_parameters()
            if n not in layout.param_names() and p.dim() >= 1 and p.shape[0] == num_experts
        ]
        if others:
            raise ValueError(
                f"{type(module).__name__} holds per-expert parameters besides its fused weights ({', '.join(others)}), "
                "which expert parallelism does not split: use mesh ep=1 (data parallelism over every rank)"
            )
    for name in layout.param_names():
        param = getattr(module, name)
        if param.shape[0] != num_experts:
            raise ValueError(
                f"{type(module).__name__}.{name} holds {param.shape[0]} experts, the config says {num_experts}"
            )
        if (first, last) != (0, num_experts):
            setattr(module, name, nn.Parameter(param.data[first:last].clone(), requires_grad=param.requires_grad))
    run_on = device if device is not None else getattr(module, layout.up_name).device
    plain_swiglu = family_rows is None and is_plain_swiglu(module)
    plan = ExpertsPlan(
        layout=layout,
        dispatcher=dispatcher,
        backend=backend,
        expert_range=(first, last),
        grouped_mm_dtypes=grouped_mm_dtypes(run_on) if backend == "grouped_mm" else (),
        # Triton only where the engine has a kernel for the family's gate (plain SwiGLU, the family's own)
        swiglu=swiglu if family_rows is not None or plain_swiglu else "torch",
        family_rows=family_rows,
        gate_takes_weights=weights_fold_into_rows(layout, backend, plain_swiglu),
        recompute=recompute,
        expert_wgrad=wgrad,
        gate=gate,  # "balanced": the bench's round-robin assignment (EngineExperts.forward)
    )
    module.__class__ = engine_class(type(module))
    module.plan = plan
    if wgrad == "triton":  # a weight the kernel cannot tile keeps autograd's gradient: said once, here
        for name in (layout.up_name, "down_proj"):
            why = wgrad_refusal(getattr(module, name))
            if why is not None:
                warnings.warn(f"expert_wgrad='triton' leaves {name} to autograd: {why}", stacklevel=2)
    module.num_experts = num_experts
    attach_load_counter(module, num_experts)
    return module


def engine_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every engine experts module, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, EngineExperts)]
