"""Qwen3-MoE adapter: which HF modules are the MoE blocks, and the expert weight layouts."""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn
from torch.profiler import record_function
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from workbench.backends import BackendConfig
from workbench.kernels.te_common import fp8_autocast
from workbench.models.qwen3_attention import use_engine_attention
from workbench.moe.experts import GroupedExperts
from workbench.moe.layer import MoEBlock
from workbench.moe.router import load_balancing_loss, route, router_logits

MODEL_TYPE = "qwen3_moe"


class Qwen3MoeRouter(hf.Qwen3MoeTopKRouter):
    """Qwen3-MoE's router with a selectable gate.

    It subclasses Transformers' router so the model's own output recording still captures
    `router_logits` (HF hooks it by class), which keeps the aux loss computed by Transformers.
    """

    def __init__(self, config, weight: nn.Parameter, gate: str):
        nn.Module.__init__(self)
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.hidden_dim = config.hidden_size
        self.weight = weight
        self.gate_kind = gate

    def forward(self, hidden_states: torch.Tensor):
        x_TD = hidden_states.reshape(-1, self.hidden_dim)
        logits_TE = router_logits(x_TD, self.weight)
        weights_TK, ids_TK = route(logits_TE, self.top_k, self.norm_topk_prob, self.gate_kind)
        return logits_TE, weights_TK, ids_TK

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, gate={self.gate_kind}"


class Qwen3MoeForCausalLM(hf.Qwen3MoeForCausalLM):
    """Transformers' Qwen3-MoE causal LM whose forward can use the fused linear cross-entropy.

    The class keeps Transformers' name so `save_pretrained` writes `architectures:
    ["Qwen3MoeForCausalLM"]` and vanilla Transformers, vLLM and SGLang load the checkpoint.
    """

    workbench_backend: BackendConfig | None = None

    def forward(self, input_ids=None, labels=None, output_router_logits=None, aux_loss_group=None, **kwargs):
        """Transformers' forward; with labels, the loss goes through the engine's kernels.

        `fused_ce` computes the loss from hidden states without materializing logits (logits come
        back None). `aux_loss_group` (a data-parallel process group) makes the aux loss this
        rank's share of the global batch's aux loss, so shares and gradients add up exactly.
        """
        backend = self.workbench_backend
        fp8 = backend is not None and backend.fp8
        if fp8 and input_ids is not None and input_ids.numel() % 16:
            raise ValueError(f"fp8=True needs batch x sequence divisible by 16 (TransformerEngine's FP8 "
                             f"GEMMs take the token count as a leading dimension); got {tuple(input_ids.shape)}")
        with attention_backend(backend, self.device), fp8_autocast(fp8):
            if labels is None or backend is None:
                return super().forward(input_ids=input_ids, labels=labels,
                                       output_router_logits=output_router_logits, **kwargs)
            return self._engine_forward(input_ids, labels, output_router_logits, aux_loss_group, **kwargs)

    def _engine_forward(self, input_ids, labels, output_router_logits, aux_loss_group, **kwargs):
        backend = self.workbench_backend
        from workbench.kernels.cross_entropy import fused_linear_cross_entropy, shift_labels

        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        num_items = kwargs.pop("num_items_in_batch", None)
        logits_to_keep = kwargs.pop("logits_to_keep", 0)
        if logits_to_keep:
            raise ValueError("logits_to_keep cannot be combined with labels")
        outputs = self.model(input_ids=input_ids, output_router_logits=output_router_logits, **kwargs)
        hidden = outputs.last_hidden_state
        logits = None
        if backend.fused_ce:
            loss = fused_linear_cross_entropy(hidden, self.lm_head.weight, shift_labels(labels),
                                              num_items_in_batch=num_items,
                                              use_triton=backend.cross_entropy == "triton")
        else:
            logits = self.lm_head(hidden)
            loss = self.loss_function(logits, labels, self.vocab_size, num_items_in_batch=num_items)
        aux_loss = None
        if output_router_logits:
            aux_loss = load_balancing_loss(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                           kwargs.get("attention_mask"), group=aux_loss_group)
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits,
                                         hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                                         router_logits=outputs.router_logits)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Transformers' save; a model sharded over a mesh gathers its experts first (collective)."""
        if getattr(self, "workbench_mesh", None) is None:
            return super().save_pretrained(save_directory, *args, **kwargs)
        from workbench.models.auto import save_pretrained

        return save_pretrained(self, save_directory, kwargs.get("max_shard_size", "5GB"))


CAUSAL_LM_CLASS = Qwen3MoeForCausalLM


def attention_backend(backend: BackendConfig | None, device: torch.device):
    """SDPA kernel preference for the forward (the backward follows the forward's choice).

    On Hopper, cuDNN's fused attention runs this model's causal GQA attention 1.75x faster than
    the flash kernel SDPA picks by default (facts.md: 2.00 vs 3.55 ms fwd+bwd at B2 S4096), so
    it goes first; the others stay as fallbacks for shapes cuDNN refuses.
    """
    if backend is None or backend.attention != "sdpa" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def num_experts(config) -> int:
    """Routed experts per MoE layer."""
    return config.num_experts


def validate_config(config) -> None:
    """Refuse configs the engine (or Transformers) cannot run, before any weights are built."""
    if config.num_experts <= 0:
        raise ValueError(f"Qwen3-MoE config has num_experts={config.num_experts}; an MoE model needs >= 1 expert")
    if not 1 <= config.num_experts_per_tok <= config.num_experts:
        raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} must be between 1 and "
                         f"num_experts={config.num_experts}: lower num_experts_per_tok or add experts")


def install_engine(model: Qwen3MoeForCausalLM, backend: BackendConfig, make_dispatcher,
                   expert_range: tuple[int, int] | None = None) -> list[MoEBlock]:
    """Replace every sparse MoE block by the engine's, reusing (or slicing) its parameters.

    `expert_range` = [first, last) keeps only those experts (expert parallelism).
    """
    config = model.config
    first, last = expert_range or (0, config.num_experts)
    blocks = []
    for layer in model.model.layers:
        old = layer.mlp
        if not isinstance(old, hf.Qwen3MoeSparseMoeBlock):
            continue
        gate_up, down = old.experts.gate_up_proj, old.experts.down_proj
        if (first, last) != (0, config.num_experts):
            gate_up = nn.Parameter(gate_up.data[first:last].clone(), requires_grad=gate_up.requires_grad)
            down = nn.Parameter(down.data[first:last].clone(), requires_grad=down.requires_grad)
        experts = GroupedExperts(gate_up, down, old.experts.act_fn, backend.experts, first, config.num_experts,
                                 recompute=backend.expert_recompute, swiglu=backend.swiglu)
        router = Qwen3MoeRouter(config, old.gate.weight, backend.gate)
        layer.mlp = MoEBlock(router, experts, make_dispatcher(config.num_experts), config.num_experts)
        blocks.append(layer.mlp)
    swap_rms_norms(model, backend.rms_norm)
    use_engine_attention(model, backend.rope)
    swap_linears(model, backend.linear)
    if backend.attention == "te":
        from workbench.kernels.te_attention import use_te_attention

        use_te_attention(model)
    for layer in model.model.layers:
        label_module(layer.self_attn, "workbench.attention")
    model.workbench_backend = backend
    return blocks


def label_module(module: nn.Module, label: str) -> None:
    """Wrap every forward of `module` in a profiler range, without renaming its parameters."""

    def enter(mod, args):
        mod._workbench_range = record_function(label)
        mod._workbench_range.__enter__()

    def leave(mod, args, output):
        mod._workbench_range.__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def swap_rms_norms(model: nn.Module, rms_norm_backend: str) -> int:
    """Replace Transformers' RMSNorms by the kernel backend's, keeping the same `weight` parameter."""
    if rms_norm_backend == "torch":
        return 0  # Transformers' own module is the torch reference
    from workbench.kernels.rms_norm import RMSNorm

    swapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, hf.Qwen3MoeRMSNorm):
                norm = RMSNorm(child.weight.shape[0], child.variance_epsilon, rms_norm_backend, device="meta")
                norm.weight = child.weight
                setattr(parent, child_name, norm)
                swapped += 1
    return swapped


def swap_linears(model: nn.Module, linear_backend: str) -> int:
    """linear='te': attention q/k/v/o and dense-MLP projections become TE Linears (same Parameters).

    The router and the experts are not nn.Linear modules and stay; lm_head stays too (the fused
    cross-entropy reads its weight directly).
    """
    if linear_backend != "te":
        return 0  # "torch": Transformers' own nn.Linear modules
    from workbench.kernels.te_linear import swap_linears as swap_children

    swapped = 0
    for layer in model.model.layers:
        swapped += swap_children(layer.self_attn)
        if isinstance(layer.mlp, hf.Qwen3MoeMLP):  # mlp_only_layers
            swapped += swap_children(layer.mlp)
    return swapped


# Checkpoint layout on disk (what Transformers' save_pretrained writes for Qwen3-MoE):
#   model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight  ([I, H], [I, H], [H, I])
# and in memory: model.layers.{l}.mlp.experts.gate_up_proj [E, 2I, H], .down_proj [E, H, I].
EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
FUSED_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def fused_to_disk(name: str, tensor: torch.Tensor, first_expert: int = 0) -> dict[str, torch.Tensor]:
    """In-memory tensor -> the per-expert tensors Transformers writes (experts numbered globally)."""
    match = FUSED_KEY.match(name)
    if match is None:
        return {name: tensor}
    prefix, kind = match.groups()
    out = {}
    for local, expert_w in enumerate(tensor):
        e = first_expert + local
        if kind == "down_proj":
            out[f"{prefix}.{e}.down_proj.weight"] = expert_w
        else:
            gate, up = expert_w.chunk(2, dim=0)
            out[f"{prefix}.{e}.gate_proj.weight"] = gate
            out[f"{prefix}.{e}.up_proj.weight"] = up
    return out


def disk_keys_for(name: str, expert_range: tuple[int, int]) -> list[str]:
    """The on-disk keys one in-memory tensor is assembled from (only the given experts)."""
    match = FUSED_KEY.match(name)
    if match is None:
        return [name]
    prefix, kind = match.groups()
    if kind == "down_proj":
        return [f"{prefix}.{e}.down_proj.weight" for e in range(*expert_range)]
    return [f"{prefix}.{e}.{p}_proj.weight" for e in range(*expert_range) for p in ("gate", "up")]


def assemble_from_disk(name: str, tensors: dict[str, torch.Tensor], expert_range: tuple[int, int]) -> torch.Tensor:
    """Stack per-expert disk tensors into the in-memory fused layout for `expert_range`."""
    match = FUSED_KEY.match(name)
    if match is None:
        return tensors[name]
    prefix, kind = match.groups()
    if kind == "down_proj":
        return torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(*expert_range)])
    return torch.stack([torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"],
                                   tensors[f"{prefix}.{e}.up_proj.weight"]]) for e in range(*expert_range)])
