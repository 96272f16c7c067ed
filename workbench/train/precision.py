"""train.precision: how the optimizer stores a bf16 model's weights and AdamW states.

    bf16         params, grads and states bf16; each update rounded to nearest. At fine-tuning
                 learning rates most updates are under half a bf16 ulp and round back (lost).
    bf16_sr      bf16 params and states; the update computed in float32 and rounded
                 stochastically (unbiased: E[round(x)] = x), so small updates survive on
                 average. Same memory and optimizer bandwidth as bf16 (14 bytes per element).
    fp32_master  float32 master weights and states in the optimizer, bf16 params for compute,
                 written from it in the same kernel pass: +8 bytes per parameter, and 28 bytes of
                 optimizer traffic per element instead of 14.
    auto         bf16_sr: it tracks a float32 reference at lr 1e-5 (tests/test_precision.py)
                 at bf16's cost. With optimizer "adamw_torch" (no SR, no master copy) it is bf16.

States stay bf16 in bf16_sr: their updates are relative (beta * m + (1 - beta) * g), far above a
bf16 ulp, and they are rounded stochastically too, so no bias accumulates; float32 states would
cost 4 bytes per parameter more for no gain the test can see (bf16_sr already keeps the whole
reference update there). On float32 weights every mode is plain
float32 (float32 weights are their own master; nothing is rounded to bf16): a no-op, not an
error, so one config runs on a CPU (float32 by default) and a GPU (bf16). Only bf16 tensors are
rounded stochastically; fp16 ones round to nearest (or use fp32_master).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from workbench.config import PRECISIONS

DEFAULT_PRECISION = "bf16_sr"
LOW_PRECISION = (torch.bfloat16, torch.float16)
# what TritonAdamW implements; "fp32" = float32 weights, the update of every mode
OPTIMIZER_PRECISIONS = ("bf16", "bf16_sr", "fp32_master")


def resolve_precision(precision: str, params: Iterable[torch.Tensor]) -> str:
    """The mode `precision` means for these parameters: "fp32" when none is bf16/fp16, "auto" resolved."""
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {PRECISIONS}, got {precision!r}")
    if not any(p.dtype in LOW_PRECISION for p in params):
        return "fp32"
    return DEFAULT_PRECISION if precision == "auto" else precision


def needs_workbench_adamw(mode: str) -> bool:
    """Whether a resolved mode needs TritonAdamW (torch's AdamW has no SR and no master copy)."""
    return mode in ("bf16_sr", "fp32_master")
