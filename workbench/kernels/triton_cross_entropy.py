"""Triton softmax-gradient kernel for the chunked linear cross-entropy (imported lazily).

The torch path turns each chunk's bf16 logits into a float32 copy and runs five elementwise ops
over it (logsumexp, gather, exp, one-hot subtract, scale, cast back): about 14 bytes of memory
traffic per logit. This kernel reads the bf16 logits twice (online max/sum, then the gradient)
and writes the bf16 gradient over them in place: 6 bytes per logit, and no float32 chunk, so a
chunk holds 2x the tokens in the same memory and the fp32 weight-gradient accumulation runs
half as often. Logits stay the bf16 values lm_head produces, as in Transformers' loss.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device

# Shape suffixes: C one chunk of tokens, V vocab.

BLOCK_V = 4096


@triton.jit
def _ce_rows_kernel(
    LOGITS, LABELS, LOSS, DENOM, stride_row, V, ignore_index, WRITE_GRAD: tl.constexpr, REVERSE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    label = tl.load(LABELS + row).to(tl.int64)
    valid = label != ignore_index
    target = tl.where(valid, label, 0)
    # pass 1: online log-sum-exp in float32
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    target_logit = tl.load(base + target).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - target_logit, 0.0))
    if WRITE_GRAD:
        # pass 2: d(loss)/d(logits) = (softmax - onehot) * valid / denom, over the logits. REVERSE walks back from the
        # blocks pass 1 read last, the likeliest still in the L2: 2.069 -> 2.050 ms for 8192 x 151936 on the H200.
        # Sharing the rows among ~one program per SM, to keep every row in flight within the L2, was slower (132
        # programs 4.7 ms, 528 2.2 ms on the H200, 2026-12-04).
        scale = tl.where(valid, 1.0 / tl.load(DENOM).to(tl.float32), 0.0)
        n_blocks = tl.cdiv(V, BLOCK)
        for i in range(n_blocks):
            start = ((n_blocks - 1 - i) if REVERSE else i) * BLOCK
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
            tl.store(base + cols, (g * scale).to(LOGITS.dtype.element_ty), mask=mask)


def ce_rows_(
    logits_CV: torch.Tensor,
    labels_C: torch.Tensor,
    denom: torch.Tensor,
    ignore_index: int,
    write_grad: bool,
    reverse: bool = True,
) -> torch.Tensor:
    """Per-row loss (float32 [C]); with `write_grad`, overwrite logits with d(sum loss / denom)/d(logits).

    `reverse`: pass 2 walks each row backwards (a benchmark knob, benchmarks/ce_rows_kernel.py; the bits do not
    change).
    """
    check_triton_device(logits_CV, "cross_entropy")
    if logits_CV.stride(-1) != 1:
        raise ValueError("ce_rows_ needs logits with unit stride along the vocabulary")
    C, V = logits_CV.shape
    loss_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    if C:
        block = min(BLOCK_V, triton.next_power_of_2(V))
        _ce_rows_kernel[(C,)](
            logits_CV,
            labels_C,
            loss_C,
            denom,
            logits_CV.stride(0),
            V,
            ignore_index,
            WRITE_GRAD=write_grad,
            REVERSE=reverse,
            BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )
    return loss_C


@triton.jit
def _scale_kernel(X, SCALE, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(SCALE).to(tl.float32)
    # a scale of exactly 1 (a plain loss.backward()) moves no bytes: masked loads and stores issue no requests
    # (a where, not `&`: Triton's interpreter refuses a scalar and a tensor mask)
    mask = tl.where(s != 1.0, offs < n_elements, False)
    x = tl.load(X + offs, mask=mask).to(tl.float32)
    tl.store(X + offs, (x * s).to(X.dtype.element_ty), mask=mask)


def scale_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale in place (a 0-dim float tensor on x's device), float32 math; no memory traffic when it is 1.

    torch's `x * scale` by a 0-dim CUDA tensor takes its broadcasting, unvectorized elementwise path (1.1 ms for
    the [151936, 2048] bf16 lm_head gradient on H200); here 0.35 ms, and with a scale of 1 (what `loss.backward()`
    hands the fused loss) 0.08 ms at 4096 elements a program, only the programs' launches.
    """
    check_triton_device(x, "cross_entropy")
    if not x.is_contiguous() or scale.numel() != 1 or scale.device != x.device:
        raise ValueError("scale_() needs a contiguous tensor and a one-element scale on its device")
    n = x.numel()
    if n:
        _scale_kernel[(triton.cdiv(n, 16384),)](x, scale, n, BLOCK=16384, num_warps=8)
    return x
