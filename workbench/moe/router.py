"""Routing: router scores -> top-k expert ids and weights; the balanced gate; the aux loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from workbench.kernels.mm_fp32 import mm_fp32, mm_pair, mm_pair_t, split_pair, tensor_core_path
from workbench.kernels.registry import KernelRegistry

# Shape suffixes: T tokens, D hidden, E experts, K top-k.

GATES = ("native", "balanced")


def router_logits(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """Router scores computed in float32.

    In bf16 the router's gradient is a small difference of large terms (softmax, top-k
    renormalization); float32 logits keep it within 2e-2 of a float32 model, where bf16 logits
    were 18% off. The cost is one [T, D] x [D, E] matmul, under 1% of the experts' FLOPs.
    """
    return _Float32Linear.apply(x_TD, weight_ED)


def router_logits_passing(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(router_logits(x, w), x): the experts take the second, and the router's backward adds their input gradient
    to its own in the GEMM that computes it (autograd would add the two in an elementwise kernel of its own)."""
    return _Float32LinearPassing.apply(x_TD, weight_ED)


def _float32_linear_backward(
    grad_TE: torch.Tensor,
    x_TD: torch.Tensor,
    weight_ED: torch.Tensor,
    grad_pass_TD: torch.Tensor | None,
    needs_input_grad: tuple[bool, ...],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input gradient (plus `grad_pass_TD`, another gradient of the same input) and the weight gradient."""
    grad_x = grad_w = None
    if x_TD.dtype == weight_ED.dtype and tensor_core_path(grad_TE, weight_ED):
        # The float32 upstream as bf16 high and low halves side by side: each gradient is one GEMM, the input's
        # with the passed gradient added in its epilogue (mm_fp32.mm_pair).
        pair_T2E = split_pair(grad_TE, weight_ED.dtype)
        if needs_input_grad[0]:
            grad_x = mm_pair(pair_T2E, weight_ED, grad_pass_TD)
        if needs_input_grad[1]:
            grad_w = mm_pair_t(pair_T2E, x_TD).to(weight_ED.dtype)
        return grad_x, grad_w
    if needs_input_grad[0]:
        grad_x = mm_fp32(grad_TE, weight_ED)
        if grad_pass_TD is not None:
            grad_x += grad_pass_TD
        grad_x = grad_x.to(x_TD.dtype)
    if needs_input_grad[1]:
        grad_w = mm_fp32(grad_TE.t(), x_TD).to(weight_ED.dtype)
    return grad_x, grad_w


class _Float32Linear(torch.autograd.Function):
    """F.linear(x.float(), w.float()) that saves x in its own dtype, not its float32 copy.

    Autograd of the plain expression keeps the [T, D] float32 copy alive until backward (64 MB
    per MoE layer at 8k tokens x 2048). On CUDA the products run as bf16 GEMMs with float32
    results (workbench.kernels.mm_fp32: the same products, float32 sums), not float32 FMA GEMMs.
    """

    @staticmethod
    def forward(ctx, x_TD, weight_ED):
        ctx.save_for_backward(x_TD, weight_ED)
        return mm_fp32(x_TD, weight_ED.t())

    @staticmethod
    def backward(ctx, grad_TE):
        x_TD, weight_ED = ctx.saved_tensors
        return _float32_linear_backward(grad_TE, x_TD, weight_ED, None, ctx.needs_input_grad)


class _Float32LinearPassing(torch.autograd.Function):
    """_Float32Linear that also returns its input (for the experts), both gradients of which it sums itself."""

    @staticmethod
    def forward(ctx, x_TD, weight_ED):
        ctx.save_for_backward(x_TD, weight_ED)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not a zero tensor to add
        return mm_fp32(x_TD, weight_ED.t()), x_TD.view_as(x_TD)

    @staticmethod
    def backward(ctx, grad_TE, grad_pass_TD):
        x_TD, weight_ED = ctx.saved_tensors
        if grad_TE is None:  # the logits took no part in the loss
            return grad_pass_TD, None
        return _float32_linear_backward(grad_TE, x_TD, weight_ED, grad_pass_TD, ctx.needs_input_grad)


def softmax_topk(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (in float32), top-k; weights keep the logits' dtype."""
    probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float32)
    weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype), ids_TK


def softmax_topk_triton(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk in one Triton kernel each way (float32 logits; kernels/triton_router_topk.py)."""
    # Triton: optional, imported where its kernel runs
    from workbench.kernels.triton_router_topk import softmax_topk as triton_softmax_topk

    weights_TK, ids_TK = triton_softmax_topk(logits_TE, top_k, norm_topk_prob)
    return weights_TK.to(logits_TE.dtype), ids_TK


# The native gate's softmax + top-k by BackendConfig.router (the engine's float32 routers: Qwen3-MoE's,
# models/families/qwen3_moe/router.py).
SOFTMAX_TOPK_BACKENDS = KernelRegistry("router", {"torch": softmax_topk, "triton": softmax_topk_triton})


def balanced_ids(num_tokens: int, top_k: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """Round-robin assignment: slot j of token t goes to expert (t*top_k + j) % num_experts.

    Every expert receives the same count whenever num_tokens*top_k is a multiple of num_experts,
    and a token's k experts are distinct because top_k <= num_experts. Benchmarks use this to
    measure the engine without the routing imbalance of a randomly initialized router.
    """
    slots = torch.arange(num_tokens * top_k, device=device, dtype=torch.int64)
    return (slots % num_experts).view(num_tokens, top_k)


def balanced_topk(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Balanced gate: round-robin ids; weights are the router's probabilities at those ids.

    Gathering the real probabilities keeps the router in the autograd graph, so the step's
    compute and communication pattern equals a native step except for the assignment.
    """
    num_tokens, num_experts = logits_TE.shape
    ids_TK = balanced_ids(num_tokens, top_k, num_experts, logits_TE.device)
    probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float32)
    weights_TK = probs_TE.gather(1, ids_TK)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(logits_TE.dtype), ids_TK


def route(
    logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool, gate: str = "native"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k weights and ids for `gate` in {"native", "balanced"}."""
    if gate == "native":
        return softmax_topk(logits_TE, top_k, norm_topk_prob)
    if gate == "balanced":
        return balanced_topk(logits_TE, top_k, norm_topk_prob)
    raise ValueError(f"unknown gate {gate!r}; choose one of {list(GATES)}")


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    group=None,
    topk_ids: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Switch-Transformer auxiliary loss as Transformers computes it for Qwen-MoE families.

    Fraction of top-k assignments per expert times mean router probability per expert, summed
    over experts, pooled over all layers (counts and probabilities are summed across layers
    first, then normalized by the total number of rows), times num_experts.

    With a data-parallel `group`, counts and rows are summed over the group and this rank
    returns its share (its own probability sums against the global fractions): the shares
    add up to the aux loss of the global batch, and so do their gradients.
    """
    device = router_logits[0].device
    assigned_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask_T = None
    if attention_mask is not None:
        mask_T = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    if topk_ids is not None and len(topk_ids) != len(router_logits):
        raise ValueError(f"topk_ids has {len(topk_ids)} layers, router_logits {len(router_logits)}")
    unmasked_ids = []  # every layer's ids, counted at once below
    for layer, logits_TE in enumerate(router_logits):
        probs_TE = F.softmax(logits_TE.to(device), dim=-1).float()
        if topk_ids is None:
            _, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
        else:
            ids_TK = topk_ids[layer].to(device)
        if mask_T is None:
            unmasked_ids.append(ids_TK.reshape(-1))
            prob_sum_E = prob_sum_E + probs_TE.sum(dim=0)
            rows = rows + probs_TE.shape[0]
        else:
            assigned_E = assigned_E.scatter_add(0, ids_TK.reshape(-1), mask_T.repeat_interleave(top_k))
            prob_sum_E = prob_sum_E + (probs_TE * mask_T[:, None]).sum(dim=0)
            rows = rows + mask_T.sum()
    if unmasked_ids:
        # one histogram of all layers' choices (shared-memory counts, exact in float32 below 2**24 slots) where a
        # scatter_add a layer contended on E bins: ~23 us a Qwen3 layer on an H200 (2026-12-04). CUDA's histc
        # refuses to run under torch.use_deterministic_algorithms: the scatter_add then.
        ids = torch.cat(unmasked_ids)
        if torch.are_deterministic_algorithms_enabled():
            assigned_E = assigned_E.scatter_add(0, ids, torch.ones(ids.numel(), device=device))
        else:
            assigned_E = assigned_E + torch.histc(ids.float(), bins=num_experts, min=0, max=num_experts - 1)
    if group is not None:
        import torch.distributed as dist

        totals = torch.cat([assigned_E, rows.reshape(1)])
        dist.all_reduce(totals, group=group)
        assigned_E, rows = totals[:-1], totals[-1]
    return (assigned_E / rows * (prob_sum_E / rows)).sum() * num_experts
