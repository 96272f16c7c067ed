"""Triton AdamW: one streaming kernel per parameter tensor, with torch's fused AdamW math.

torch's fused AdamW (aten/src/ATen/native/cuda/fused_adam_utils.cuh) walks every tensor in small
multi_tensor_apply chunks and reaches about half the HBM bandwidth of an H200. This kernel reads
param, grad, exp_avg and exp_avg_sq of one contiguous tensor in large blocks (int64 offsets) and
writes param, exp_avg and exp_avg_sq back: 14 bytes per bf16 element, nothing else (fp32_master:
float32 master and moments, plus the bf16 parameter written in the same pass: 28 bytes).

Numerics follow torch's CUDA functor, computed in float32 and stored in each tensor's dtype:
    p = p - (lr * wd) * p                              (only when lr * wd != 0)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = sqrt(v) / bc2_sqrt + eps
    p = p - (step_size * m) / denom
with step_size = float32(lr / float32(1 - beta1**step)) and bc2_sqrt = float32(sqrt(1 - beta2**step))
computed on the host as torch does (workbench.kernels.adamw.adamw_scalars). torch evaluates the
first three lines and the `+ eps` in double (its scalars are doubles) and rounds to float32;
`precise=True` does the same in float64, the default in float32 (at most one float32 ulp apart,
so rarely one bf16 ulp). Square root and divisions are IEEE-rounded (`sqrt_rn`, `div_rn`) as in
CUDA C++ by default, and FMA contraction is off, so the kernel equals the torch-op version in
workbench.kernels.adamw bit for bit, compiled or in the interpreter.

With stochastic rounding (train.precision "bf16_sr") each bf16 store adds 16 bits of one counter-
based hash of (key, global element index) per element before truncating (stochastic_round.py): the
same bits as the torch-op version, so the two stay equal bit for bit; float32/fp16 tensors round as
usual.
"""

from __future__ import annotations

import contextlib
import struct

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import triton_interpreting
from workbench.kernels.adamw_args import AdamWStep, SRKeys, kernel_supports, squares_size


@triton.jit
def _f64(bits):
    # double-precision scalars travel as their int64 bit patterns (Triton passes Python floats as fp32)
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def store(ptr, offs, x, mask, ROUND_BY_HAND: tl.constexpr):
    if ROUND_BY_HAND:
        if ptr.dtype.element_ty == tl.bfloat16:
            # Triton's interpreter truncates float32 -> bf16: round to nearest even by hand first
            # (CPU tests only), so the interpreter stores what CUDA's cvt.rn stores
            u = x.to(tl.uint32, bitcast=True)
            u = ((u + ((u >> 16) & 1) + 0x7FFF) >> 16) << 16
            x = u.to(tl.float32, bitcast=True)
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mix32(x):
    # lowbias32 on uint32 (wrapping multiplies, logical shifts), as stochastic_round.mix32; the
    # multipliers are uint32 tensors so no Triton version promotes x to a signed type
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def element_bits(key_bits, local, start, BLOCK: tl.constexpr):
    # stochastic_round.random_bits(key, ...) of the global element index start + local (local: int32 in
    # [0, BLOCK)): one hash per element for all three stores. The index's high word is one of two per block (a
    # block spans at most two 2**32 ranges), so two scalar hashes, and the low word is a wrapping 32-bit add: its
    # carry (a low word under the start's) picks the second. The kernel issues more instructions than it loads,
    # and int64 index math per element was a share of them.
    key = key_bits.to(tl.int32).to(tl.uint32, bitcast=True)
    start_lo = (start & 0xFFFFFFFF).to(tl.uint32)
    hash_a = _mix32((start >> 32).to(tl.uint32) ^ key)
    hash_b = _mix32(((start + (BLOCK - 1)) >> 32).to(tl.uint32) ^ key)
    lo = start_lo + local.to(tl.uint32)
    return _mix32(lo ^ tl.where(lo >= start_lo, hash_a, hash_b))


@triton.jit
def block_squares(SQ, g):
    # The program's sum of squared gradients into SQ[program] (the update's caller sums them: the gradient norm
    # without a second read of the gradient); whether it is finite, so a block with an inf or nan stores nothing.
    partial = tl.sum(g * g)
    tl.store(SQ + tl.program_id(0), partial)
    return partial <= 3.4028234663852886e38  # float32's largest: false for inf and nan


@triton.jit
def _sr_bf16(x, bits16):
    # stochastic_round.stochastic_round_bf16: bits16 holds the 16 random bits in its low half
    u = x.to(tl.uint32, bitcast=True)
    u = (u + bits16) & 0xFFFF0000
    return tl.where(x != x, x, u.to(tl.float32, bitcast=True))


@triton.jit
def store_rounded(ptr, offs, x, mask, bits16, SR: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    if SR:
        if ptr.dtype.element_ty == tl.bfloat16:
            x = _sr_bf16(x, bits16)  # exactly representable: the store below does not round
    store(ptr, offs, x, mask, ROUND_BY_HAND)


@triton.jit
def adam_update(
    p, g, m, v, beta1_bits, omb1_bits, beta2_bits, omb2_bits, lr_wd_bits, eps_bits, step_size, bc2_sqrt,
    HAS_WD: tl.constexpr, PRECISE: tl.constexpr, ONE_DIVISION: tl.constexpr,
):  # fmt: skip
    # The float32 (p, m, v) after one step from float32 p, g, m, v: torch's functor, in its order (module docstring).
    # Every AdamW kernel here runs it, the 8-bit one too (triton_adamw8.py): one formula, the same bits.
    # ONE_DIVISION (stochastically rounded bf16 parameters): the step as (step_size * bc2) * m / (sqrt(v) + eps * bc2),
    # torch's step with one IEEE division instead of two; it differs from torch's by float32 roundings, far under the
    # bf16 rounding that follows. The kernel issues more instructions than its bytes need (a division ~8 of ~115
    # an element on sm_90), so one fewer is time: -1.5 ms a Qwen3 L8 step on an H200 (2026-12-04).
    beta1, omb1 = _f64(beta1_bits), _f64(omb1_bits)
    beta2, omb2 = _f64(beta2_bits), _f64(omb2_bits)
    lr_wd, eps = _f64(lr_wd_bits), _f64(eps_bits)
    if PRECISE:
        gd = g.to(tl.float64)
        if HAS_WD:
            pd = p.to(tl.float64)
            p = (pd - lr_wd * pd).to(tl.float32)
        m = (beta1 * m.to(tl.float64) + omb1 * gd).to(tl.float32)
        v = (beta2 * v.to(tl.float64) + omb2 * gd * gd).to(tl.float32)
        denom = (tl.div_rn(tl.sqrt_rn(v), bc2_sqrt).to(tl.float64) + eps).to(tl.float32)
    else:
        if HAS_WD:
            p = p - lr_wd.to(tl.float32) * p
        m = beta1.to(tl.float32) * m + omb1.to(tl.float32) * g
        v = beta2.to(tl.float32) * v + omb2.to(tl.float32) * g * g
        if ONE_DIVISION:
            return p - tl.div_rn((step_size * bc2_sqrt) * m, tl.sqrt_rn(v) + eps.to(tl.float32) * bc2_sqrt), m, v
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps.to(tl.float32)
    return p - tl.div_rn(step_size * m, denom), m, v


@triton.jit
def update_block(
    P, G, M, V, OUT, COEF, SQ, offs, mask, block_start, beta1_bits, omb1_bits, beta2_bits, omb2_bits, lr_wd_bits,
    eps_bits, step_size, bc2_sqrt, key, base, HAS_WD: tl.constexpr, PRECISE: tl.constexpr, SR: tl.constexpr,
    HAS_OUT: tl.constexpr, HAS_COEF: tl.constexpr, HAS_SQ: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # One block of one tensor (elements `offs`, the block's first at `block_start`): loads, the update, stores.
    # Shared by the per-tensor kernel and the multi-tensor one (triton_adamw_multi.py): the same bits.
    p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_COEF:  # gradient clipping's coefficient, in float32: saves a read and a write of every gradient
        g = g * tl.load(COEF)
    m = tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    # The block's sum masks the stores only: loads behind a block reduction wait for it, and this memory-bound
    # kernel then has half its bytes in flight (gpt-oss in-backward 8-bit: +8 ms a step on an H200, 2026-12-03).
    if HAS_SQ:  # (a where, not a scalar `&`: Triton's interpreter refuses a scalar and a tensor mask)
        mask = tl.where(block_squares(SQ, g), mask, False)
    p, m, v = adam_update(
        p, g, m, v, beta1_bits, omb1_bits, beta2_bits, omb2_bits, lr_wd_bits, eps_bits, step_size, bc2_sqrt, HAS_WD,
        PRECISE, SR and P.dtype.element_ty == tl.bfloat16,
    )  # fmt: skip
    bits_p, bits_m, bits_v = offs, offs, offs  # unused unless SR
    if SR:  # stochastic_round.stream_bits: the param low 16 bits, exp_avg_sq high 16, exp_avg (h * C) >> 16
        start = base.to(tl.int64) + block_start
        bits = element_bits(key, (offs - block_start).to(tl.int32), start, BLOCK)
        bits_p = bits & 0xFFFF
        bits_v = bits >> 16
        bits_m = (bits * tl.full(bits.shape, 0x9E3779B1, tl.uint32)) >> 16
    store_rounded(P, offs, p, mask, bits_p, SR, ROUND_BY_HAND)
    store_rounded(M, offs, m, mask, bits_m, SR, ROUND_BY_HAND)
    store_rounded(V, offs, v, mask, bits_v, SR, ROUND_BY_HAND)
    if HAS_OUT:  # fp32_master: P is the float32 master, OUT the bf16 parameter (one pass, no extra copy)
        store(OUT, offs, p, mask, ROUND_BY_HAND)


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
def _adamw_kernel(
    P,
    G,
    M,
    V,
    OUT,
    SKIP,
    COEF,
    SQ,
    n_elements,
    beta1_bits,
    omb1_bits,
    beta2_bits,
    omb2_bits,
    lr_wd_bits,
    eps_bits,
    step_size,
    bc2_sqrt,
    key,
    base,
    HAS_WD: tl.constexpr,
    PRECISE: tl.constexpr,
    SR: tl.constexpr,
    HAS_OUT: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    HAS_COEF: tl.constexpr,
    HAS_SQ: tl.constexpr,
    ROUND_BY_HAND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    if HAS_SKIP:  # torch's found_inf: a nonzero flag stores nothing (read here, not on the host)
        # A scalar test, not a mask term: a flag loaded per element (SKIP + offs * 0) made the mask
        # data-dependent, so loads and stores went one element at a time (63 ms vs 19 ms over the L8
        # model's tensors on the H200, benchmarks/adamw_modes.py)
        if tl.load(SKIP) != 0.0:
            return
    block_start = tl.program_id(0).to(tl.int64) * BLOCK
    update_block(
        P, G, M, V, OUT, COEF, SQ, offs, mask, block_start, beta1_bits, omb1_bits, beta2_bits, omb2_bits,
        lr_wd_bits, eps_bits, step_size, bc2_sqrt, key, base, HAS_WD, PRECISE, SR, HAS_OUT, HAS_COEF, HAS_SQ,
        ROUND_BY_HAND, BLOCK,
    )  # fmt: skip


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def scalar_args(scalars: dict[str, float]) -> tuple:
    """adamw_scalars' values as the kernels take them: the six doubles as int64 bits, step size and bc2 as floats."""
    names = ("beta1", "omb1", "beta2", "omb2", "lr_wd", "eps")
    return (*(_bits(scalars[n]) for n in names), scalars["step_size"], scalars["bc2_sqrt"])


def check_squares(squares: torch.Tensor | None, n: int, block: int, device: torch.device) -> None:
    """Refuse a `squares` buffer that is not float32 on `device` with a float per program."""
    if squares is not None and (
        squares.dtype != torch.float32 or squares.device != device or squares.numel() < squares_size(n, block)
    ):
        raise ValueError(
            f"squares must be {squares_size(n, block)} float32 values on {device}, got {squares.dtype} "
            f"{tuple(squares.shape)} on {squares.device}"
        )


def common_flags(step: AdamWStep, sr: bool) -> dict:
    """The constexpr and launch keywords every AdamW kernel takes (`sr`: bf16 stores rounded stochastically)."""
    return dict(
        HAS_WD=step.scalars["lr_wd"] != 0,
        PRECISE=step.precise,
        SR=sr,
        HAS_SKIP=step.skip is not None,
        HAS_COEF=step.grad_coef is not None,
        ROUND_BY_HAND=triton_interpreting(),
        BLOCK=step.launch.block,
        num_warps=step.launch.num_warps,
        enable_fp_fusion=False,
    )


def key_i32(key: int) -> int:
    # a uint32 key as the int32 of its bits (one argument type whatever the value; bitcast back in the kernel)
    return key - (1 << 32) if key >= 1 << 31 else key


def triton_adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: AdamWStep,
    sr: SRKeys | None = None,
    out: torch.Tensor | None = None,
    squares: torch.Tensor | None = None,
) -> None:
    """One AdamW update of one contiguous tensor, in place, as workbench.kernels.adamw.torch_adamw_step_ (`sr`: bf16
    stores rounded stochastically; `out`: also gets the new parameter; `step`: scalars, skip flag, clip coefficient
    and launch, AdamWLaunch's default measured best); `squares`: zeros of `squares_size(n, step.launch.block)` floats
    that get each block's sum of squared gradients, and a block whose sum is not finite stores nothing."""
    tensors = (param, grad, exp_avg, exp_avg_sq) + (() if out is None else (out,))
    if not kernel_supports(*tensors):
        got = [(tuple(t.shape), t.dtype, str(t.device), t.is_contiguous()) for t in tensors]
        raise ValueError(
            "the Triton AdamW kernel needs contiguous float32/bf16/fp16 tensors of one size on one "
            f"CUDA device (or TRITON_INTERPRET=1), got (shape, dtype, device, contiguous) {got}"
        )
    n = param.numel()
    if n == 0:
        return
    step.check_flags(param.device)
    launch = step.launch
    check_squares(squares, n, launch.block, param.device)
    keys = sr if sr is not None else SRKeys(0, 0)
    # Triton launches on the current device: make it the tensors' one
    guard = torch.cuda.device(param.device) if param.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        _adamw_kernel[(triton.cdiv(n, launch.block),)](
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            param if out is None else out,
            param if step.skip is None else step.skip,
            param if step.grad_coef is None else step.grad_coef,
            param if squares is None else squares,
            n,
            *scalar_args(step.scalars),
            key_i32(keys.key),
            keys.base,
            HAS_OUT=out is not None,
            HAS_SQ=squares is not None,
            **common_flags(step, sr is not None),
        )
