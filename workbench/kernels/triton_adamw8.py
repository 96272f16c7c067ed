"""Triton AdamW with 8-bit moments (the format in workbench.kernels.adamw8): one streaming kernel per tensor.

Each program takes BLOCK // QB scale blocks of QB elements as a [rows, QB] tile: it decodes the old
moments, runs triton_adamw's update math in the same order, takes each row's largest magnitude as
the new scale and stores the codes rounded stochastically. Reads 2 + 2 + 1 + 1 bytes per bf16
element and writes 2 + 1 + 1 (+ 8 / QB of scales), against 8 + 6 for bf16 moments. The bits equal
adamw8.torch_adamw8_step_'s, compiled or in the interpreter (tests/test_adamw8.py).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from workbench.kernels.adamw_args import AdamWStep, Moments8, SRKeys, kernel_supports8
from workbench.kernels.triton_adamw import (
    adam_update,
    block_squares,
    check_squares,
    common_flags,
    element_bits,
    key_i32,
    scalar_args,
    store,
    store_rounded,
)


@triton.jit
def _decode(bits, OFFSET: tl.constexpr):
    # adamw8._decode in fewer instructions (the kernel is bound by the instructions it issues, not by its bytes):
    # the code's exponent and mantissa fields shifted into place (`bits`, sign included) are a float whose
    # exponent is OFFSET too small, and an exact multiply by 2**OFFSET restores it. A zero exponent field (code
    # 0, or the signed 128) is a float zero already: no test, no select.
    return bits.to(tl.float32, bitcast=True) * (2.0**OFFSET)


@triton.jit
def _encode(y, r16, OFFSET: tl.constexpr, TINY: tl.constexpr, FLOOR_TINY: tl.constexpr):
    # adamw8._encode: y in [0, 1], 16 random bits r16 (int32) -> code. For y >= TINY the rounded float's bits
    # shifted right by 20 are its exponent and 3 mantissa bits: the code less OFFSET's exponent (no mask, no fields).
    # FLOOR_TINY: (0, TINY) takes TINY's code (8) by a clamp before the arithmetic, and one select keeps zeros 0.
    if FLOOR_TINY:
        y_code = tl.maximum(y, TINY)
    else:
        y_code = y
    code = ((y_code.to(tl.int32, bitcast=True) + (r16 << 4)) >> 20) - (OFFSET << 3)
    if FLOOR_TINY:
        code = tl.where(y > 0.0, code, 0)
    else:
        # adamw8's y / TINY > r16 / 2**16 with both scalings moved to one side: powers of two, exact
        low = tl.where(y > r16.to(tl.float32) * (TINY / 65536), 8, 0)
        code = tl.where(y < TINY, low, code)
    return code


@triton.jit(
    do_not_specialize=[
        "beta1_bits",
        "omb1_bits",
        "beta2_bits",
        "omb2_bits",
        "lr_wd_bits",
        "eps_bits",
        "step_size",
        "bc2_sqrt",
        "key",
        "base",
    ]
)
def _adamw8_kernel(
    P, G, MQ, MS, VQ, VS, OUT, SKIP, COEF, SQ, n_blocks, beta1_bits, omb1_bits, beta2_bits, omb2_bits, lr_wd_bits,
    eps_bits, step_size, bc2_sqrt, key, base, HAS_WD: tl.constexpr, PRECISE: tl.constexpr, SR: tl.constexpr,
    HAS_OUT: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_COEF: tl.constexpr, HAS_SQ: tl.constexpr,
    ROUND_BY_HAND: tl.constexpr, QB: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    if HAS_SKIP:  # torch's found_inf: a nonzero flag stores nothing
        if tl.load(SKIP) != 0.0:
            return
    ROWS: tl.constexpr = BLOCK // QB
    block_start = tl.program_id(0).to(tl.int64) * BLOCK
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_blocks
    offs = rows[:, None] * QB + tl.arange(0, QB)[None, :]
    mask = rmask[:, None]
    p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_COEF:
        g = g * tl.load(COEF)
    mc = tl.load(MQ + offs, mask=mask, other=0).to(tl.int32)
    # the code's sign bit moved to the float's (a negated decode times a positive scale is the negated product)
    m = _decode(((mc & 0x7F) << 20) | ((mc & 0x80) << 24), 112)
    m = m * tl.load(MS + rows, mask=rmask, other=0.0)[:, None]
    v = _decode(tl.load(VQ + offs, mask=mask, other=0).to(tl.int32) << 20, 96)
    v = v * tl.load(VS + rows, mask=rmask, other=0.0)[:, None]
    if HAS_SQ:  # a program whose gradients are not all finite stores nothing (its codes and scales too); after
        # the loads, which would wait for the block's sum (triton_adamw.update_block)
        finite = block_squares(SQ, g)
        mask = tl.where(finite, mask, False)  # (a where: the interpreter refuses a scalar `&` a tensor mask)
        rmask = tl.where(finite, rmask, False)
    p, m, v = adam_update(
        p, g, m, v, beta1_bits, omb1_bits, beta2_bits, omb2_bits, lr_wd_bits, eps_bits, step_size, bc2_sqrt, HAS_WD,
        PRECISE, False,
    )  # fmt: skip
    local = tl.arange(0, ROWS)[:, None] * QB + tl.arange(0, QB)[None, :]  # offs - block_start, in int32
    bits = element_bits(key, local, base.to(tl.int64) + block_start, BLOCK)
    m_abs = tl.abs(m)
    m_max = tl.max(m_abs, axis=1)
    v_max = tl.max(v, axis=1)
    # one reciprocal per block, not a division per element; capped at 1 against its rounding
    ones = tl.full(m_max.shape, 1.0, tl.float32)
    y_m = tl.minimum(m_abs * tl.div_rn(ones, tl.where(m_max > 0.0, m_max, ones))[:, None], 1.0)
    y_v = tl.minimum(v * tl.div_rn(ones, tl.where(v_max > 0.0, v_max, ones))[:, None], 1.0)
    r_m = ((bits * tl.full(bits.shape, 0x9E3779B1, tl.uint32)) >> 16).to(tl.int32)
    r_v = (bits >> 16).to(tl.int32)
    mag = _encode(y_m, r_m, 112, 6.103515625e-05, False)  # 2**-14
    m_code = mag | ((m.to(tl.int32, bitcast=True) >> 24) & 128)  # the float's sign bit, zeros included
    v_code = _encode(y_v, r_v, 96, 9.313225746154785e-10, True)  # 2**-30
    store_rounded(P, offs, p, mask, bits & 0xFFFF, SR, ROUND_BY_HAND)
    tl.store(MQ + offs, m_code.to(tl.uint8), mask=mask)
    tl.store(VQ + offs, v_code.to(tl.uint8), mask=mask)
    tl.store(MS + rows, m_max, mask=rmask)
    tl.store(VS + rows, v_max, mask=rmask)
    if HAS_OUT:  # fp32_master: P is the float32 master, OUT the bf16 parameter
        store(OUT, offs, p, mask, ROUND_BY_HAND)


def triton_adamw8_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    moments: Moments8,
    step: AdamWStep,
    keys: SRKeys,
    sr_param: bool = False,
    out: torch.Tensor | None = None,
    squares: torch.Tensor | None = None,
) -> None:
    """One 8-bit-moment AdamW update of one contiguous tensor, in place (as adamw8.torch_adamw8_step_);
    `squares` as triton_adamw.triton_adamw_step_'s, one float per program of max(step.launch.block, qblock)."""
    m_q, m_scale, v_q, v_scale, qblock = moments
    if not kernel_supports8(param, grad, moments, out):
        raise ValueError(
            "the Triton 8-bit AdamW kernel needs contiguous tensors on one CUDA device (or TRITON_INTERPRET=1)"
        )
    if m_q.dtype != torch.uint8 or v_q.dtype != torch.uint8 or m_scale.dtype != torch.float32:
        raise ValueError(f"8-bit AdamW state must be uint8 codes and float32 scales, got {m_q.dtype}, {m_scale.dtype}")
    n = param.numel()
    if n == 0:
        return
    step.check_flags(param.device)
    flags = common_flags(step, bool(sr_param and param.dtype == torch.bfloat16))
    flags["BLOCK"] = max(step.launch.block, qblock)
    check_squares(squares, n, flags["BLOCK"], param.device)
    guard = torch.cuda.device(param.device) if param.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        _adamw8_kernel[(triton.cdiv(n, flags["BLOCK"]),)](
            param,
            grad,
            m_q,
            m_scale,
            v_q,
            v_scale,
            param if out is None else out,
            param if step.skip is None else step.skip,
            param if step.grad_coef is None else step.grad_coef,
            param if squares is None else squares,
            n // qblock,
            *scalar_args(step.scalars),
            key_i32(keys.key),
            keys.base,
            QB=qblock,
            HAS_OUT=out is not None,
            HAS_SQ=squares is not None,
            **flags,
        )
