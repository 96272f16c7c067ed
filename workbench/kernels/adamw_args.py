"""What every AdamW update takes besides its tensors, shared by its four variants (torch ops and Triton, full and
8-bit moments) and the multi-tensor launch: one step's settings (`AdamWStep`: host scalars, precision of the math,
skip flag, clip coefficient, launch shape), the stochastic-rounding keys of a tensor, 8-bit moments with their block
size, and which tensors the Triton kernels take (decided before Triton is imported).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

import torch

from workbench.kernels._triton_util import triton_interpreting
from workbench.kernels.stochastic_round import sr_key

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


def f32(x: float) -> float:
    """`x` rounded to the nearest float32 (what a C++ double -> float conversion gives)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def adamw_scalars(
    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> dict[str, float]:
    """Host-side scalars of AdamW step `step` (1-based), rounded where torch's CUDA functor rounds."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an integer >= 1 (the count after this update), got {step!r}")
    bc1 = f32(1.0 - beta1 ** float(step))  # torch hands its bias corrections to the math as float
    return {
        "beta1": beta1,
        "omb1": 1.0 - beta1,
        "beta2": beta2,
        "omb2": 1.0 - beta2,
        "lr_wd": lr * weight_decay,
        "eps": eps,
        "step_size": f32(lr / bc1),
        "bc2_sqrt": f32(math.sqrt(1.0 - beta2 ** float(step))),
    }


@dataclass(frozen=True)
class AdamWStep:
    """One AdamW step's settings, the same for every tensor it updates and for every variant.

    `scalars`: adamw_scalars of the step; `precise`: the moments and weight decay in float64 as torch's functor
    (bit-exact with it), else float32 (at most one float32 ulp apart); `skip`: a float32 scalar tensor on the
    tensors' device (torch's `found_inf`), nonzero leaves every tensor unchanged, decided on the device; `grad_coef`:
    a float32 scalar tensor on that device the gradient is multiplied by first (gradient clipping's coefficient,
    applied in the update instead of in a separate pass over every gradient); `launch`: the Triton kernels' block
    and warps.
    """

    scalars: dict[str, float]
    precise: bool = False
    skip: torch.Tensor | None = None
    grad_coef: torch.Tensor | None = None
    launch: AdamWLaunch = DEFAULT_LAUNCH

    def __post_init__(self) -> None:
        if not isinstance(self.scalars, dict):
            raise TypeError(f"AdamWStep.scalars must be adamw_scalars' dict, got {type(self.scalars).__name__}")
        if not isinstance(self.precise, bool):
            raise TypeError(f"AdamWStep.precise must be True or False, got {self.precise!r}")
        if not isinstance(self.launch, AdamWLaunch):
            raise TypeError(f"AdamWStep.launch must be an AdamWLaunch, got {type(self.launch).__name__}")

    def check_flags(self, device: torch.device) -> None:
        """Refuse a skip flag or clip coefficient that is not a float32 scalar on `device` (a kernel reads them)."""
        for name, flag in (("skip", self.skip), ("grad_coef", self.grad_coef)):
            if flag is not None and (flag.numel() != 1 or flag.dtype != torch.float32 or flag.device != device):
                got = f"{flag.dtype} {tuple(flag.shape)} on {flag.device}"
                raise ValueError(f"{name} must be a float32 scalar on {device}, got {got}")


class SRKeys(NamedTuple):
    """Stochastic-rounding key of one tensor's AdamW step (one hash per element serves its three stores) and
    its element base."""

    key: int
    base: int = 0

    @classmethod
    def make(cls, seed: int, step: int, param_index: int, base: int = 0, salt: int = 0) -> SRKeys:
        """The key of parameter `param_index` at optimizer step `step` (see stochastic_round.sr_key)."""
        return cls(sr_key(seed, step, param_index, salt), base)


class Moments8(NamedTuple):
    """A tensor's 8-bit moments (the format in workbench.kernels.adamw8): uint8 codes and float32 scales of exp_avg
    and exp_avg_sq, one scale per `qblock` elements of each row."""

    m_q: torch.Tensor
    m_scale: torch.Tensor
    v_q: torch.Tensor
    v_scale: torch.Tensor
    qblock: int

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.m_q, self.m_scale, self.v_q, self.v_scale


def squares_size(n: int, block: int) -> int:
    """Floats a `squares` buffer needs: one per program of a launch over `n` elements in blocks of `block`."""
    return -(-n // block)


def refuse_squares(squares: torch.Tensor | None) -> None:
    """The torch-op updates sum no squared gradients: a `squares` buffer there is a caller's mistake."""
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


def kernel_supports8(param: torch.Tensor, grad: torch.Tensor, moments: Moments8, out=None) -> bool:
    """Whether the 8-bit Triton kernel can take these tensors (contiguous, one device, CUDA or the interpreter)."""
    tensors = [t for t in (param, grad, *moments.tensors(), out) if t is not None]
    if param.device.type != "cuda" and not triton_interpreting():
        return False
    return all(t.is_contiguous() and t.device == param.device for t in tensors)
