"""AdamW's per-tensor update: host scalars, a torch-op version, and dispatch to the Triton kernel.

Both versions follow torch's fused CUDA AdamW functor (see triton_adamw.py for the formulas and
where torch rounds). Which one runs is the caller's resolved choice (`kernel`, decided once by
workbench.train.optim from workbench.backends.availability); with "triton" the torch-op version
still serves the tensors the kernel cannot take (non-contiguous, or on CPU without the Triton
interpreter), so one optimizer works on every tensor.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

import torch

from workbench.kernels._triton_util import triton_interpreting
from workbench.kernels.stochastic_round import random_bits, sr_key, stochastic_round_bf16, stream_bits

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ADAMW_KERNELS = ("torch", "triton")


@dataclass(frozen=True)
class AdamWLaunch:
    """How the Triton AdamW kernel is launched: elements per program and warps per program.

    The default, 1024 x 4 (8 elements per thread, one 16-byte load per bf16 tensor), won the sweep
    on 1 x H200 (benchmarks/adamw_sweep.py; benchmarks/NOTES.md, "AdamW and clipping"): 4.19 TB/s over the
    L8 model's tensors vs 3.68 at 4096 x 8, and the kernel's time in the training step 30.3 -> 22.4 ms.
    The square root and two divisions are IEEE-rounded instruction sequences: small programs keep
    enough loads in flight around them. Other values are for that sweep (benchmarks/adamw_sweep.py).
    """

    block: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        if (
            isinstance(self.block, bool)
            or not isinstance(self.block, int)
            or self.block < 128
            or self.block & (self.block - 1)
        ):
            raise ValueError(
                f"AdamWLaunch.block must be a power of two >= 128 (elements per program), got {self.block!r}"
            )
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"AdamWLaunch.num_warps must be one of 1, 2, 4, 8, 16, 32, got {self.num_warps!r}")


DEFAULT_LAUNCH = AdamWLaunch()  # frozen: a shared default, not state


def _f32(x: float) -> float:
    """`x` rounded to the nearest float32 (what a C++ double -> float conversion gives)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def adamw_scalars(
    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> dict[str, float]:
    """Host-side scalars of AdamW step `step` (1-based), rounded where torch's CUDA functor rounds."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an integer >= 1 (the count after this update), got {step!r}")
    bc1 = _f32(1.0 - beta1 ** float(step))  # torch hands its bias corrections to the math as float
    return {
        "beta1": beta1,
        "omb1": 1.0 - beta1,
        "beta2": beta2,
        "omb2": 1.0 - beta2,
        "lr_wd": lr * weight_decay,
        "eps": eps,
        "step_size": _f32(lr / bc1),
        "bc2_sqrt": _f32(math.sqrt(1.0 - beta2 ** float(step))),
    }


class SRKeys(NamedTuple):
    """Stochastic-rounding key of one tensor's AdamW step (one hash per element serves its three stores) and
    its element base."""

    key: int
    base: int = 0

    @classmethod
    def make(cls, seed: int, step: int, param_index: int, base: int = 0, salt: int = 0) -> SRKeys:
        """The key of parameter `param_index` at optimizer step `step` (see stochastic_round.sr_key)."""
        return cls(sr_key(seed, step, param_index, salt), base)


def squares_size(n: int, block: int) -> int:
    """Floats a `squares` buffer needs: one per program of a launch over `n` elements in blocks of `block`."""
    return -(-n // block)


def _refuse_squares(squares: torch.Tensor | None) -> None:
    if squares is not None:
        raise ValueError("per-block squared gradients come from the Triton AdamW kernel: these tensors take torch ops")


def kernel_supports(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernel can update these (param, grad, exp_avg, exp_avg_sq) tensors."""
    first = tensors[0]
    if first.device.type != "cuda" and not triton_interpreting():
        return False
    return all(
        t.is_contiguous() and t.device == first.device and t.numel() == first.numel() and t.dtype in SUPPORTED_DTYPES
        for t in tensors
    )


def adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: dict[str, float],
    precise: bool = False,
    grad_coef: torch.Tensor | None = None,
    one_division: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float32 (param, exp_avg, exp_avg_sq) after one step, in the kernels' operation order (torch ops).

    `one_division` (stochastically rounded bf16 parameters, as the kernels): the step as
    (step_size * bc2) * m / (sqrt(v) + eps * bc2), one division instead of two (triton_adamw.adam_update).
    """
    s = scalars
    wide = torch.float64 if precise else torch.float32
    p, m, v = param.to(torch.float32), exp_avg.to(wide), exp_avg_sq.to(wide)
    g = grad.to(torch.float32)
    if grad_coef is not None:
        g = g * grad_coef.to(g.device)
    g = g.to(wide)
    if s["lr_wd"] != 0:
        pw = p.to(wide)
        p = (pw - s["lr_wd"] * pw).to(torch.float32)
    # the same operation order as the kernel: b1*m + (1-b1)*g and (1-b2)*g*g, rounded to float32
    m = (m * s["beta1"] + (g * s["omb1"])).to(torch.float32)
    v = (v * s["beta2"] + (g * s["omb2"]) * g).to(torch.float32)
    # sqrt in float64 rounded to float32 is the correctly rounded float32 sqrt (CPU torch.sqrt is
    # not); a tensor divisor, since CUDA torch multiplies by the reciprocal of a Python scalar one
    root = v.to(torch.float64).sqrt().to(torch.float32)
    if one_division and not precise:
        # the kernel's float32 scalar products (a product of two float32 values is exact in a double, so rounding
        # it to float32 is float32's own multiply), then one division of tensors (IEEE on CPU and CUDA alike)
        scale = _f32(_f32(s["step_size"]) * _f32(s["bc2_sqrt"]))
        eps_bc2 = _f32(_f32(s["eps"]) * _f32(s["bc2_sqrt"]))
        return p - (m * scale) / (root + eps_bc2), m, v
    denom = ((root / torch.full_like(root, s["bc2_sqrt"])).to(wide) + s["eps"]).to(torch.float32)
    return p - (m * s["step_size"]) / denom, m, v


def torch_adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: dict[str, float],
    precise: bool = False,
    sr: SRKeys | None = None,
    out: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
    grad_coef: torch.Tensor | None = None,
) -> None:
    """The kernel's update in torch ops, in place: float32 math (float64 where `precise`).

    With `sr`, bf16 tensors get the float32 results rounded stochastically (stochastic_round.py)
    instead of to nearest; other dtypes are stored as usual. `out` also receives the new
    parameter, rounded to nearest (fp32_master: `param` is the master copy, `out` the bf16 one).
    `skip`: a scalar tensor (torch's `found_inf`); where it is nonzero every tensor keeps its value,
    decided on the device (no host read). `grad_coef`: a float32 scalar tensor the gradient is
    multiplied by in float32 first (gradient clipping's coefficient, applied here instead of in a
    separate pass over every gradient).
    """
    one_division = sr is not None and param.dtype == torch.bfloat16  # as the kernels decide it
    p, m, v = adam_update(param, grad, exp_avg, exp_avg_sq, scalars, precise, grad_coef, one_division)
    bits = None
    for dst, value, stream in ((param, p, "param"), (exp_avg, m, "exp_avg"), (exp_avg_sq, v, "exp_avg_sq")):
        if sr is not None and dst.dtype == torch.bfloat16:
            if bits is None:
                bits = random_bits(sr.key, sr.base, value.numel(), value.device)
            value = stochastic_round_bf16(value, stream_bits(bits, stream))
        dst.copy_(_unless(skip, dst, value))
    if out is not None:
        out.copy_(_unless(skip, out, p))


def _unless(skip: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`new`, or `old` where the skip flag is set (the old value comes back exactly: a widening cast)."""
    if skip is None:
        return new
    return torch.where(skip.to(new.device) != 0, old.to(new.dtype), new)


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: dict[str, float],
    precise: bool = False,
    sr: SRKeys | None = None,
    out: torch.Tensor | None = None,
    skip: torch.Tensor | None = None,
    grad_coef: torch.Tensor | None = None,
    *,
    kernel: str,
    launch: AdamWLaunch = DEFAULT_LAUNCH,
    squares: torch.Tensor | None = None,
) -> str:
    """Update one tensor in place with `kernel` ("triton": where it takes the tensors, else torch ops); says which.

    `skip`: a float32 scalar tensor on the tensors' device; nonzero leaves every tensor unchanged.
    `grad_coef`: a float32 scalar tensor on that device multiplying the gradient (clipping).
    `launch`: the Triton kernel's block and warps.
    `squares`: the Triton kernel's per-block sums of squared gradients (triton_adamw_step_); refused elsewhere.
    """
    if kernel not in ADAMW_KERNELS:
        raise ValueError(f"AdamW kernel must be one of {ADAMW_KERNELS} (resolved by the caller), got {kernel!r}")
    if param.numel() == 0:
        return "empty"
    extra = () if out is None else (out,)
    if kernel == "triton" and kernel_supports(param, grad, exp_avg, exp_avg_sq, *extra):
        from workbench.kernels.triton_adamw import triton_adamw_step_

        triton_adamw_step_(
            param, grad, exp_avg, exp_avg_sq, scalars, precise, sr, out, skip, grad_coef, launch, squares
        )  # fmt: skip
        return "triton"
    _refuse_squares(squares)
    torch_adamw_step_(param, grad, exp_avg, exp_avg_sq, scalars, precise, sr, out, skip, grad_coef)
    return "torch"
