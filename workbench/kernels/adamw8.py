"""AdamW with 8-bit moments: the block format, a torch-op update, and dispatch to the Triton kernel.

Full fine-tuning of a bf16 MoE keeps weights (2 bytes per parameter) and two bf16 moments (4 bytes):
the moments are two thirds of the optimizer-side memory. Here each moment is one byte per element plus
one float32 scale per block of `QBLOCK` elements (the block's largest magnitude), as in Dettmers et
al.'s blockwise 8-bit Adam (bitsandbytes, HF Trainer's optim="adamw_bnb_8bit", Unsloth's default):
6 -> ~4 bytes per parameter, and 14 -> 10 bytes of optimizer traffic per element.

The codes are small floats relative to the block's scale, so small moments keep relative precision:
    exp_avg     sign, 4-bit exponent, 3-bit mantissa: |m| / absmax in {0} and [2**-14, 1] (a signed 0 reads -0)
    exp_avg_sq  5-bit exponent, 3-bit mantissa:        v / absmax  in {0} and [2**-30, 1]
A 3-bit mantissa is coarse (one part in 16): exp_avg_sq moves by (1 - beta2) = 0.1% a step, far
under that, and rounding to nearest would freeze it. Every code is therefore rounded stochastically
(unbiased: E[decode(code)] = the float32 moment), with the bits of the element's one hash that the
bf16 stores use (stochastic_round.stream_bits), so a run and its resume draw the same. Magnitudes
under the smallest code go to 0 or the smallest code with the unbiased probability (exp_avg) or to
the smallest code (exp_avg_sq: a nonzero second moment read back as 0 would make m / (sqrt(v) + eps)
explode); exact zeros stay 0. The update itself uses the new float32 moments; only the stored ones
are rounded.

Blocks run along each row (the last dimension), so a block never spans two rows: the scales are
shaped [*shape[:-1], shape[-1] // QBLOCK] and shard with the parameter along dim 0 (FSDP2).
`quant_block` picks the largest power of two <= 256 dividing the last dimension; tensors it cannot
block (1-D, small, or rows not a multiple of 32) keep moments in their dtype, as bitsandbytes keeps
small tensors in 32 bits.
"""

from __future__ import annotations

import torch

from workbench.kernels.adamw import adam_update, unless_skipped
from workbench.kernels.adamw_args import AdamWStep, Moments8, SRKeys, kernel_supports8, refuse_squares
from workbench.kernels.stochastic_round import random_bits, stochastic_round_bf16, stream_bits

QBLOCK_MAX = 256
QBLOCK_MIN = 32
MIN_8BIT_NUMEL = 4096  # smaller tensors keep their moments in their dtype (a negligible share of memory)
# Exponent offsets: a code's exponent field e >= 1 stands for 2**(e - 15) (exp_avg) or 2**(e - 31) (exp_avg_sq)
_M_OFFSET, _V_OFFSET = 112, 96
_M_TINY, _V_TINY = 2.0**-14, 2.0**-30


def quant_block(shape: torch.Size | tuple[int, ...]) -> int:
    """Elements per scale for a tensor of `shape`: a power of two dividing its rows, or 0 (keep full moments)."""
    if len(shape) < 2 or torch.Size(shape).numel() < MIN_8BIT_NUMEL:
        return 0
    last = shape[-1]
    qb = QBLOCK_MAX
    while qb >= QBLOCK_MIN:
        if last % qb == 0:
            return qb
        qb //= 2
    return 0


def scale_shape(shape: torch.Size | tuple[int, ...], qblock: int) -> tuple[int, ...]:
    """The shape of a moment's scales: one per `qblock` elements of each row."""
    return (*shape[:-1], shape[-1] // qblock)


def _encode(y: torch.Tensor, r16: torch.Tensor, offset: int, tiny: float, floor_tiny: bool) -> torch.Tensor:
    # y in [0, 1] float32 -> exponent/mantissa code (int64), rounded stochastically with 16 bits r16
    u = y.view(torch.int32).to(torch.int64)
    u = (u + (r16 << 4)) & 0xFFF00000  # 3 mantissa bits kept, the 20 below decide the rounding
    code = (((u >> 23) - offset) << 3) | ((u >> 20) & 7)
    small = y < tiny
    if floor_tiny:
        low = torch.where(y > 0, 1 << 3, 0)
    else:
        low = torch.where(y * (1.0 / tiny) > r16.to(torch.float32) * (1.0 / 65536), 1 << 3, 0)
    return torch.where(small, low, code)


def _decode(code: torch.Tensor, offset: int) -> torch.Tensor:
    # exponent/mantissa code (int64, no sign) -> float32 in {0} and [tiny, 1]
    e = code >> 3
    bits = ((e + offset) << 23) | ((code & 7) << 20)
    value = bits.to(torch.int32).view(torch.float32)
    return torch.where(e == 0, torch.zeros_like(value), value)


def decode_moments(
    m_q: torch.Tensor, m_scale: torch.Tensor, v_q: torch.Tensor, v_scale: torch.Tensor, qblock: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 exp_avg and exp_avg_sq that the codes and scales stand for (flat)."""
    mc = m_q.reshape(-1).to(torch.int64)
    m = _decode(mc & 0x7F, _M_OFFSET) * m_scale.reshape(-1).repeat_interleave(qblock)
    m = torch.where(mc >= 128, -m, m)  # a sign on a zero magnitude (the float's -0.0) decodes to -0.0
    v = _decode(v_q.reshape(-1).to(torch.int64), _V_OFFSET) * v_scale.reshape(-1).repeat_interleave(qblock)
    return m, v


def encode_moments(
    m: torch.Tensor, v: torch.Tensor, bits: torch.Tensor, qblock: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(exp_avg codes, scales, exp_avg_sq codes, scales) of float32 moments, with the element hashes `bits`."""
    m2, v2 = m.reshape(-1, qblock), v.reshape(-1, qblock)
    m_abs = m2.abs()
    m_max = m_abs.amax(dim=1, keepdim=True)
    v_max = v2.amax(dim=1, keepdim=True)
    # one reciprocal per block (the kernel's divisions were per element), capped at 1 against its rounding
    one = torch.ones_like(m_max)
    y_m = torch.minimum(m_abs * (one / torch.where(m_max > 0, m_max, one)), one)
    y_v = torch.minimum(v2 * (one / torch.where(v_max > 0, v_max, one)), one)
    b = bits.reshape(-1, qblock)
    mag = _encode(y_m, stream_bits(b, "exp_avg"), _M_OFFSET, _M_TINY, floor_tiny=False)
    m_code = mag | torch.signbit(m2).to(torch.int64) << 7  # the float's sign bit, zeros included
    v_code = _encode(y_v, stream_bits(b, "exp_avg_sq"), _V_OFFSET, _V_TINY, floor_tiny=True)
    return m_code.to(torch.uint8), m_max.reshape(-1), v_code.to(torch.uint8), v_max.reshape(-1)


def _triton_adamw8():
    """workbench.kernels.triton_adamw8, imported when the Triton kernel first runs: Triton is optional, and it reads
    TRITON_INTERPRET when it is imported."""
    import workbench.kernels.triton_adamw8 as kernels

    return kernels


def torch_adamw8_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    moments: Moments8,
    step: AdamWStep,
    keys: SRKeys,
    sr_param: bool = False,
    out: torch.Tensor | None = None,
) -> None:
    """The 8-bit kernel's update in torch ops, in place (the math of adamw.torch_adamw_step_ on decoded moments).

    `keys`: the element hashes' key and base (moments are always rounded stochastically); `sr_param`: the
    bf16 parameter too (train.precision "bf16_sr"), else to nearest; `out` and `step` as there.
    """
    m_q, m_scale, v_q, v_scale, qblock = moments
    m_old, v_old = decode_moments(m_q, m_scale, v_q, v_scale, qblock)
    p, m, v = adam_update(
        param.reshape(-1), grad.reshape(-1), m_old, v_old, step.scalars, step.precise, step.grad_coef
    )  # fmt: skip
    bits = random_bits(keys.key, keys.base, p.numel(), p.device)
    m_code, m_max, v_code, v_max = encode_moments(m, v, bits, qblock)
    new_p = p
    if sr_param and param.dtype == torch.bfloat16:
        new_p = stochastic_round_bf16(p, stream_bits(bits, "param"))
    param.copy_(unless_skipped(step.skip, param, new_p.reshape(param.shape)))
    for dst, value in ((m_q, m_code), (m_scale, m_max), (v_q, v_code), (v_scale, v_max)):
        dst.copy_(unless_skipped(step.skip, dst, value.reshape(dst.shape)))
    if out is not None:
        out.copy_(unless_skipped(step.skip, out, p.reshape(out.shape)))


def adamw8_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    moments: Moments8,
    step: AdamWStep,
    keys: SRKeys,
    sr_param: bool = False,
    out: torch.Tensor | None = None,
    squares: torch.Tensor | None = None,
    *,
    kernel: str,
) -> str:
    """Update one tensor with 8-bit moments in place by `kernel` ("triton" where it takes them, else torch ops);
    `squares` as adamw.adamw_step_'s (the Triton kernel only)."""
    if param.numel() == 0:
        return "empty"
    qblock = moments.qblock
    if param.numel() % qblock or moments.m_scale.numel() * qblock != param.numel():
        raise ValueError(
            f"8-bit AdamW: {param.numel()} elements do not make {moments.m_scale.numel()} blocks of {qblock}"
        )
    if kernel == "triton" and kernel_supports8(param, grad, moments, out):
        _triton_adamw8().triton_adamw8_step_(param, grad, moments, step, keys, sr_param, out, squares)
        return "triton8"
    refuse_squares(squares)
    torch_adamw8_step_(param, grad, moments, step, keys, sr_param, out)
    return "torch8"
