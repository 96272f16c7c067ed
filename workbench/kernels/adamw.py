"""AdamW's per-tensor update: a torch-op version, and dispatch to the Triton kernel.

Both versions follow torch's fused CUDA AdamW functor (see triton_adamw.py for the formulas and
where torch rounds) and take the step's settings as one AdamWStep (adamw_args.py). Which one runs is the
caller's resolved choice (`kernel`, decided once by workbench.backends.adamw_kernel); with "triton" the torch-op version
still serves the tensors the kernel cannot take (non-contiguous, or on CPU without the Triton
interpreter), so one optimizer works on every tensor.
"""

from __future__ import annotations

import torch

from workbench.kernels.adamw_args import (
    ADAMW_KERNELS,
    AdamWStep,
    SRKeys,
    f32,
    kernel_supports,
    refuse_squares,
)
from workbench.kernels.stochastic_round import random_bits, stochastic_round_bf16, stream_bits


def _triton_adamw():
    """workbench.kernels.triton_adamw, imported when the Triton kernel first runs: Triton is optional, and it reads
    TRITON_INTERPRET when it is imported."""
    import workbench.kernels.triton_adamw as kernels

    return kernels


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
        scale = f32(f32(s["step_size"]) * f32(s["bc2_sqrt"]))
        eps_bc2 = f32(f32(s["eps"]) * f32(s["bc2_sqrt"]))
        return p - (m * scale) / (root + eps_bc2), m, v
    denom = ((root / torch.full_like(root, s["bc2_sqrt"])).to(wide) + s["eps"]).to(torch.float32)
    return p - (m * s["step_size"]) / denom, m, v


def torch_adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: AdamWStep,
    sr: SRKeys | None = None,
    out: torch.Tensor | None = None,
) -> None:
    """The kernel's update in torch ops, in place: float32 math (float64 where `step.precise`).

    With `sr`, bf16 tensors get the float32 results rounded stochastically (stochastic_round.py)
    instead of to nearest; other dtypes are stored as usual. `out` also receives the new
    parameter, rounded to nearest (fp32_master: `param` is the master copy, `out` the bf16 one).
    `step.skip` and `step.grad_coef` as AdamWStep says (no host read).
    """
    one_division = sr is not None and param.dtype == torch.bfloat16  # as the kernels decide it
    p, m, v = adam_update(
        param, grad, exp_avg, exp_avg_sq, step.scalars, step.precise, step.grad_coef, one_division
    )  # fmt: skip
    bits = None
    for dst, value, stream in ((param, p, "param"), (exp_avg, m, "exp_avg"), (exp_avg_sq, v, "exp_avg_sq")):
        if sr is not None and dst.dtype == torch.bfloat16:
            if bits is None:
                bits = random_bits(sr.key, sr.base, value.numel(), value.device)
            value = stochastic_round_bf16(value, stream_bits(bits, stream))
        dst.copy_(unless_skipped(step.skip, dst, value))
    if out is not None:
        out.copy_(unless_skipped(step.skip, out, p))


def unless_skipped(skip: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`new`, or `old` where the skip flag is set (the old value comes back exactly: a widening cast)."""
    if skip is None:
        return new
    return torch.where(skip.to(new.device) != 0, old.to(new.dtype), new)


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: AdamWStep,
    sr: SRKeys | None = None,
    out: torch.Tensor | None = None,
    squares: torch.Tensor | None = None,
    *,
    kernel: str,
) -> str:
    """Update one tensor in place with `kernel` ("triton": where it takes the tensors, else torch ops); says which.

    `sr` and `out` as torch_adamw_step_'s; `squares`: the Triton kernel's per-block sums of squared gradients
    (triton_adamw_step_), refused elsewhere.
    """
    if kernel not in ADAMW_KERNELS:
        raise ValueError(f"AdamW kernel must be one of {ADAMW_KERNELS} (resolved by the caller), got {kernel!r}")
    if param.numel() == 0:
        return "empty"
    extra = () if out is None else (out,)
    if kernel == "triton" and kernel_supports(param, grad, exp_avg, exp_avg_sq, *extra):
        _triton_adamw().triton_adamw_step_(param, grad, exp_avg, exp_avg_sq, step, sr, out, squares)
        return "triton"
    refuse_squares(squares)
    torch_adamw_step_(param, grad, exp_avg, exp_avg_sq, step, sr, out)
    return "torch"
