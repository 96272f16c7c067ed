"""Linear (lm_head) + cross-entropy with Transformers' ForCausalLMLoss semantics, fused by chunks.

`fused_linear_cross_entropy` never holds the full [N, V] logits: it walks over chunks of tokens,
builds each chunk's logits (float32 on the torch path; the model dtype with the Triton kernel),
accumulates the loss and, when gradients are needed, the gradients wrt hidden and weight right there
(a loss is a scalar, so backward only rescales them).
Peak extra memory is O(chunk * V) plus one gradient buffer per input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.kernels._triton_util import check_triton_device
from workbench.kernels.mm_fp32 import mm_fp32


def _triton_cross_entropy():
    """workbench.kernels.triton_cross_entropy, imported when a Triton path first runs: Triton is optional, and it reads
    TRITON_INTERPRET when it is imported."""
    import workbench.kernels.triton_cross_entropy as kernels

    return kernels


# Shape suffixes: N tokens (batch x sequence), D hidden, V vocab, C one chunk of tokens.

# Budget for one chunk's logits where the lm_head is frozen (LoRA): chunking then only saves memory.
LOGITS_CHUNK_BYTES = 512 * 2**20
# Budget for the buffers where the lm_head trains: a chunk's logits plus, with more than one chunk, the float32
# weight-gradient accumulator [V, D], which every further chunk reads and writes once. 1 x H200, bf16, D 2048
# (benchmarks/ce_chunks.py, 2026-12-02): 8192 tokens of Moonlight's 163840 vocab in 6 chunks 29.0 ms, 3 chunks
# 27.6, one 25.8 (2.3, 2.9, 3.2 GiB); 16384 tokens in 11 chunks 59.8 ms, 3 chunks 54.5 (4.6 GiB).
TRAINED_HEAD_CE_BYTES = 3 * 2**30


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Next-token targets as ForCausalLMLoss builds them: shift left by one, pad with ignore_index."""
    padded = F.pad(labels, (0, 1), value=ignore_index)
    return padded[..., 1:].contiguous()


def _flatten_checked(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate shapes/dtypes/label range; return hidden [N, D] and labels [N]."""
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear cross-entropy: {name} must be a torch.Tensor, got {type(t).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be the lm_head weight [vocab, hidden], got shape {tuple(weight.shape)}")
    V, D = weight.shape
    if hidden.dim() < 1 or hidden.shape[-1] != D:
        raise ValueError(f"hidden's last dim must equal weight.shape[1]={D}; got hidden {tuple(hidden.shape)}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels must have hidden's leading shape {tuple(hidden.shape[:-1])}; got "
            f"{tuple(labels.shape)} (shift labels with shift_labels() first, not by slicing)"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise TypeError(f"labels must be an integer tensor of token ids, got {labels.dtype}")
    if hidden.dtype != weight.dtype:
        raise TypeError(
            f"hidden and weight must share a dtype (as lm_head needs); got {hidden.dtype} and {weight.dtype}"
        )
    labels_N = labels.reshape(-1)
    check_label_range(labels_N, V, ignore_index)
    return hidden.reshape(-1, D), labels_N


def check_label_range(labels_N: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Refuse a label outside [0, V) that is not ignore_index, without a host sync on an accelerator.

    On the CPU the check reads the labels (free there) and names the first bad one. On a device a
    read would drain its queue every step, so the check is an asynchronous device assert instead:
    a bad label then fails the step at the next sync with torch's device-side assert (the trainer
    has already checked the tokenizer against the vocab size on the host, train/data.build_stream).
    """
    bad = ((labels_N < 0) & (labels_N != ignore_index)) | (labels_N >= vocab_size)
    message = (
        f"a label is outside [0, {vocab_size}) and is not ignore_index={ignore_index}; "
        "check the tokenizer's vocab size against the model's"
    )
    if labels_N.device.type != "cpu":
        torch._assert_async(~bad.any(), message)
        return
    if bool(bad.any()):
        first = int(labels_N[bad][0])
        raise ValueError(
            f"label {first} is outside [0, {vocab_size}) and is not ignore_index={ignore_index}; "
            "check the tokenizer's vocab size against the model's"
        )


def _denominator(
    labels_N: torch.Tensor, ignore_index: int, num_items_in_batch: torch.Tensor | int | None
) -> torch.Tensor:
    """What the summed loss is divided by: num_items_in_batch, else the count of real targets."""
    if num_items_in_batch is None:
        return (labels_N != ignore_index).sum().to(torch.float32)
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, torch.Tensor)):
        raise TypeError(f"num_items_in_batch must be an int, a tensor or None; got {num_items_in_batch!r}")
    return torch.as_tensor(num_items_in_batch, device=labels_N.device).to(torch.float32)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Unfused reference: full logits = hidden @ weight.T, then HF's fixed_cross_entropy."""
    hidden_ND, labels_N = _flatten_checked(hidden, weight, labels, ignore_index)
    logits_NV = F.linear(hidden_ND, weight).float()
    if num_items_in_batch is None:
        return F.cross_entropy(logits_NV, labels_N, ignore_index=ignore_index, reduction="mean")
    loss = F.cross_entropy(logits_NV, labels_N, ignore_index=ignore_index, reduction="sum")
    return loss / _denominator(labels_N, ignore_index, num_items_in_batch)


def _chunk_torch(
    h_CD: torch.Tensor,
    weight_VD: torch.Tensor,
    y_C: torch.Tensor,
    denom: torch.Tensor,
    ignore_index: int,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's summed loss and, if asked, d(loss)/d(logits) in the input dtype (reference path)."""
    logits_CV = F.linear(h_CD, weight_VD).float()
    valid_C = y_C != ignore_index
    target_C = torch.where(valid_C, y_C, 0)
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    target_logit_C = logits_CV.gather(1, target_C[:, None]).squeeze(1)
    loss = torch.where(valid_C, lse_C - target_logit_C, 0.0).sum()
    if not need_grad:
        return loss, None
    # (softmax - onehot) * valid / denom, built in the logits buffer
    grad_CV = logits_CV.sub_(lse_C[:, None]).exp_()
    grad_CV[torch.arange(h_CD.shape[0], device=grad_CV.device), target_C] -= 1.0
    grad_CV.mul_((valid_C.to(torch.float32) / denom)[:, None])
    return loss, grad_CV.to(h_CD.dtype)


def _scaled(grad: torch.Tensor, scale: torch.Tensor, use_triton: bool) -> torch.Tensor:
    """grad * scale in grad's dtype; with `use_triton` in place in one Triton pass, no bytes moved for a scale of 1."""
    if use_triton and grad.is_contiguous():
        return _triton_cross_entropy().scale_(grad, scale.to(grad.device))
    return (grad * scale).to(grad.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden_ND: torch.Tensor,
        weight_VD: torch.Tensor,
        labels_N: torch.Tensor,
        denom: torch.Tensor,
        ignore_index: int,
        chunk_size: int,
        use_triton: bool,
    ) -> torch.Tensor:
        N = hidden_ND.shape[0]
        need_dh, need_dw = hidden_ND.requires_grad, weight_VD.requires_grad
        need_grad = need_dh or need_dw
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        grad_hidden_ND = (
            torch.empty(hidden_ND.shape, dtype=hidden_ND.dtype, device=hidden_ND.device) if need_dh else None
        )
        bounds = chunk_bounds(N, chunk_size)
        # float32 accumulation across chunks keeps bf16 weight gradients as exact as one big matmul;
        # the first chunk's product initializes it (no zero fill of a [V, D] float32 buffer). One chunk is that
        # matmul: its product comes out in the weight's dtype, without the float32 buffer and its cast.
        one_chunk = len(bounds) == 1
        grad_weight_VD = (
            torch.empty(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
            if need_dw and not one_chunk
            else None
        )
        for start, end in bounds:
            h_CD, y_C = hidden_ND[start:end], labels_N[start:end]
            if use_triton:
                # logits in the model dtype, as lm_head makes them; the kernel turns them into the gradient
                grad_CV = F.linear(h_CD, weight_VD)
                loss_sum += _triton_cross_entropy().ce_rows_(grad_CV, y_C, denom, ignore_index, need_grad).sum()
            else:
                loss_C, grad_CV = _chunk_torch(h_CD, weight_VD, y_C, denom, ignore_index, need_grad)
                loss_sum += loss_C
            if not need_grad:
                continue
            if need_dh:
                torch.mm(grad_CV, weight_VD, out=grad_hidden_ND[start:end])
            if need_dw and one_chunk:
                grad_weight_VD = torch.mm(grad_CV.t(), h_CD)
            elif need_dw:
                mm_fp32(grad_CV.t(), h_CD, out=grad_weight_VD, accumulate=start > 0)
        if need_dw and not one_chunk:
            grad_weight_VD = grad_weight_VD.to(weight_VD.dtype)
        ctx.save_for_backward(grad_hidden_ND, grad_weight_VD)
        ctx.use_triton = use_triton
        ctx.handed_out = False
        return loss_sum / denom

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.handed_out:
            # the gradients are the forward's buffers, scaled in place and handed to autograd (which may keep
            # them as .grad and let an optimizer or clipping change them): a second backward cannot reuse them
            raise RuntimeError(
                "backward ran twice through the fused linear cross-entropy (retain_graph): its gradients are "
                "computed in the forward and handed out once; run the forward again for another backward"
            )
        ctx.handed_out = True
        grad_hidden_ND, grad_weight_VD = ctx.saved_tensors
        scale = grad_loss.to(torch.float32)
        dh = None if grad_hidden_ND is None else _scaled(grad_hidden_ND, scale, ctx.use_triton)
        dw = None if grad_weight_VD is None else _scaled(grad_weight_VD, scale, ctx.use_triton)
        return dh, dw, None, None, None, None, None


def chunk_bounds(tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    """(start, end) of as few chunks as `chunk_size` allows, their sizes differing by at most one token.

    The weight gradient is a [V, D] GEMM per chunk whatever its rows: 8192 tokens in chunks of 1638 left a
    2-row chunk that cost a full pass over Moonlight's [163840, 2048] gradient (~1 ms on an H200).
    """
    chunks = max(1, -(-tokens // chunk_size))
    edges = [tokens * i // chunks for i in range(chunks + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def default_chunk_size(
    tokens: int, vocab_size: int, hidden_size: int, logit_bytes: int = 4, weight_grad: bool = False
) -> int:
    """Tokens per chunk: logits within LOGITS_CHUNK_BYTES, or with `weight_grad` all within TRAINED_HEAD_CE_BYTES."""
    if not weight_grad:
        return max(1, LOGITS_CHUNK_BYTES // (logit_bytes * vocab_size))
    if tokens * vocab_size * logit_bytes <= TRAINED_HEAD_CE_BYTES:
        return max(1, tokens)  # one chunk: no float32 accumulator, the weight gradient straight in its dtype
    room = max(TRAINED_HEAD_CE_BYTES - 4 * vocab_size * hidden_size, LOGITS_CHUNK_BYTES)
    return max(1, room // (logit_bytes * vocab_size))


def fused_linear_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_size: int | None = None,
    use_triton: bool = False,
) -> torch.Tensor:
    """ForCausalLMLoss(lm_head(hidden), ...) over already-shifted labels, without [N, V] logits.

    hidden [..., D] and labels [...] (use `shift_labels` on the model's input labels first);
    weight is the lm_head weight [V, D]. Gradients are computed during the forward when any
    input requires grad, so a forward under grad mode costs about as much as forward+backward.
    `use_triton` runs the Triton softmax-gradient kernel (BackendConfig.cross_entropy='triton',
    which resolves only where it runs); the caller chooses, the kernel does not look.
    """
    hidden_flat, labels_flat = _flatten_checked(hidden_ND, weight_VD, labels_N, ignore_index)
    if not isinstance(use_triton, bool):
        raise TypeError(
            f"use_triton must be True or False (BackendConfig.cross_entropy == 'triton'); got {use_triton!r}"
        )
    if use_triton:
        check_triton_device(hidden_flat, "cross_entropy")
    if chunk_size is None:
        # the Triton path keeps logits in the model dtype (no float32 chunk), so more tokens fit
        chunk_size = default_chunk_size(
            hidden_flat.shape[0],
            weight_VD.shape[0],
            weight_VD.shape[1],
            hidden_flat.element_size() if use_triton else 4,
            weight_grad=weight_VD.requires_grad and torch.is_grad_enabled(),
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk), got {chunk_size!r}")
    denom = _denominator(labels_flat, ignore_index, num_items_in_batch)
    return _ChunkedLinearCrossEntropy.apply(
        hidden_flat, weight_VD, labels_flat, denom, ignore_index, chunk_size, bool(use_triton)
    )
