"""Stochastic rounding float32 -> bfloat16 from a counter-based hash (no RNG state).

A bf16 weight ~0.02 has an ulp of 2**-13 ~ 1.2e-4: an AdamW step of lr 1e-5 is under half an ulp
and round-to-nearest gives the old value back (the update is lost). Rounding up with probability
(x - down) / ulp keeps E[round(x)] = x, so small updates survive on average. The random bits
of element i come from lowbias32 (a 32-bit integer mixer) over (seed, step, parameter index)
folded on the host into one key, then the element's 64-bit index: the same inputs give the same
bits on CPU, in the Triton kernel (triton_adamw.py) and after a resume, with nothing to save.
Element indices are global where a shard knows its place (see `element_base`).

One hash per element serves the three tensors an AdamW step stores (`stream_bits`): the param
takes its low 16 bits, exp_avg_sq its high 16, exp_avg the high 16 of the hash times an odd
constant (a bijection of 32 bits, so uniform too). Three hashes cost the H200 kernel 4.6 ms over
round-to-nearest on the L8 model's tensors, one 0.8 ms (benchmarks/adamw_modes.py).
"""

from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers (Wellons' hash-prospector)
_C_MOMENT = 0x9E3779B1  # odd (golden-ratio) multiplier: exp_avg's bits from the element's one hash
# What each stored tensor of an AdamW step takes from the element's 32 bits (stream_bits).
STREAMS = ("param", "exp_avg", "exp_avg_sq")


def mix32(x: int) -> int:
    """lowbias32 of a Python int's low 32 bits (host side: keys)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _C1) & MASK32
    x ^= x >> 15
    x = (x * _C2) & MASK32
    return x ^ (x >> 16)


def sr_key(seed: int, step: int, param_index: int, salt: int = 0) -> int:
    """The 32-bit key of one parameter's AdamW step (`salt`: a shard without a global offset)."""
    k = mix32(seed)
    for part in (step, param_index, salt):
        k = mix32(k ^ mix32(part))
    return k


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # low 32 bits of x * c in int64 without overflow: x < 2**32, c split into 16-bit halves
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def _mix32_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def random_bits(key: int, base: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """32 random bits (int64 holding uint32) for elements base .. base + numel - 1 under `key`."""
    idx = torch.arange(base, base + numel, dtype=torch.int64, device=device)
    hi = _mix32_t((idx >> 32) ^ key)
    return _mix32_t((idx & MASK32) ^ hi)


def stream_bits(bits: torch.Tensor, stream: str) -> torch.Tensor:
    """The 16 random bits (in the low half) that tensor `stream` of STREAMS takes from `random_bits`."""
    if stream == "param":
        return bits & 0xFFFF
    if stream == "exp_avg_sq":
        return bits >> 16
    if stream == "exp_avg":
        return _mul32(bits, _C_MOMENT) >> 16
    raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")


def stochastic_round_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """float32 `x` rounded to bf16-representable float32 values: up with probability frac/ulp.

    Adding 16 random bits below bf16's last mantissa bit then truncating carries into it with
    exactly that probability (sign-magnitude: the same for negative values); NaN stays NaN.
    """
    u = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & MASK32
    r = (u + (bits.view(x.shape) & 0xFFFF)) & 0xFFFF0000
    r = torch.where(r >= 2**31, r - 2**32, r).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x, r)


def element_base(t: torch.Tensor) -> tuple[int, int]:
    """(index of this tensor's first element in its full tensor, salt) for the hash.

    A DTensor shard that is a contiguous slab of the full tensor (FSDP2's dim-0 shards) hashes its
    global element indices: its bits do not depend on the mesh. Other layouts use local indices
    with the shard's global offset as salt, so shards still get distinct bits.
    """
    if getattr(t, "_local_tensor", None) is None:
        return 0, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape[1:]) == tuple(t.shape[1:]) and all(o == 0 for o in offset[1:]):
        return int(offset[0]) * math.prod(t.shape[1:]), 0
    salt = 0
    for o in offset:
        salt = mix32(salt ^ mix32(int(o)))
    return 0, salt
