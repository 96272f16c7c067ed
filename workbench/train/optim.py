"""AdamW, the warmup + cosine schedule, and gradient clipping across the whole device mesh."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from workbench.backends import BackendError, adamw_kernel, availability
from workbench.config_train import OPTIMIZERS
from workbench.kernels import grad_squares
from workbench.kernels._triton_util import triton_interpreting
from workbench.parallel.dist_utils import local_shard
from workbench.parallel.fsdp import GRAD_NORM_GROUP_ATTR  # set by the mesh builders, read here
from workbench.train.precision import needs_workbench_adamw, resolve_precision
from workbench.train.triton_adamw_optimizer import TritonAdamW


def resolve_optimizer(name: str, device: torch.device | str) -> str:
    """The optimizer `name` stands for on `device`: "adamw" is the Triton one on CUDA, else torch's."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")
    device = torch.device(device)
    if name == "adamw":
        return "adamw_triton" if adamw_kernel(device) == "triton" else "adamw_torch"
    if name == "adamw_triton" and device.type == "cuda":
        ok, why = availability("optimizer", "triton", device)
        if not ok:
            raise BackendError(f"optimizer='adamw_triton' cannot run here: {why}; or use 'adamw_torch'")
    return name


def build_optimizer(model: torch.nn.Module, train_cfg, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (Triton or fused torch on CUDA, see resolve_optimizer); no weight decay on norms or biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": train_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    name = getattr(train_cfg, "optimizer", "adamw")
    if getattr(train_cfg, "optimizer_in_backward", False) and name == "adamw":
        name = "adamw_triton"  # its per-parameter update (step_param); the torch-op kernel where Triton cannot run
    return make_adamw(
        groups,
        name,
        device,
        lr=train_cfg.lr,
        betas=train_cfg.betas,
        precision=getattr(train_cfg, "precision", "auto"),
        seed=train_cfg.seed,
        states=getattr(train_cfg, "optimizer_states", "full"),
    )


def adamw_precision(precision: str, name: str, params) -> str:
    """The train.precision mode AdamW `name` runs `params` in ("auto" with torch's AdamW on bf16 is plain bf16)."""
    mode = resolve_precision(precision, params)
    if precision == "auto" and name == "adamw_torch" and mode != "fp32":
        mode = "bf16"
    return mode


def make_adamw(
    param_groups: list[dict],
    name: str,
    device: torch.device,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    precision: str = "auto",
    seed: int = 0,
    states: str = "full",
) -> torch.optim.Optimizer:
    """The AdamW `name` resolves to on `device`: TritonAdamW, or torch's (fused on CUDA).

    `precision` (train.precision, see workbench.train.precision) "bf16_sr" and "fp32_master" on a
    bf16 model need TritonAdamW: it is used for "adamw" on every device (its torch-op path on CPU).
    With "adamw_torch", "auto" is what torch's AdamW does (bf16: round to nearest). `states` "8bit"
    (train.optimizer_states) keeps 8-bit moments: TritonAdamW for "adamw" on every device too.
    """
    mode = adamw_precision(precision, name, [p for g in param_groups for p in g["params"]])
    if states != "full":
        if name == "adamw_torch":
            raise ValueError(
                f"train.optimizer_states={states!r} needs the workbench AdamW; use optimizer 'adamw' or 'adamw_triton'"
            )
        resolve_optimizer(name, device)
        return TritonAdamW(
            param_groups,
            lr=lr,
            betas=betas,
            precision="bf16" if mode == "fp32" else mode,
            seed=seed,
            kernel=adamw_kernel(device),
            states=states,
        )
    if needs_workbench_adamw(mode):
        if name == "adamw_torch":
            raise ValueError(
                f"train.precision={precision!r} ({mode}) needs the workbench AdamW; use "
                "optimizer 'adamw' or 'adamw_triton', or precision 'bf16'"
            )
        resolve_optimizer(name, device)  # refuses adamw_triton where it cannot run
        return TritonAdamW(param_groups, lr=lr, betas=betas, precision=mode, seed=seed, kernel=adamw_kernel(device))
    if resolve_optimizer(name, device) == "adamw_triton":
        return TritonAdamW(param_groups, lr=lr, betas=betas, kernel=adamw_kernel(device))
    kwargs = {"fused": True} if torch.device(device).type == "cuda" else {"foreach": False}
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, **kwargs)


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """How an optimizer from `make_adamw` is named in results files."""
    if isinstance(optimizer, TritonAdamW):
        return (
            f"workbench TritonAdamW (same math as torch's fused AdamW), kernel {optimizer.kernel}, "
            f"precision {optimizer.precision}" + ("" if optimizer.states == "full" else f", {optimizer.states} moments")
        )
    kind = "fused=True" if optimizer.defaults.get("fused") else "foreach=False"
    return f"torch.optim.AdamW({kind})"


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr before optimizer step `step` (0-based): linear warmup, cosine decay."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """Picklable lr lambda (so LambdaLR.state_dict keeps it out of the way)."""

    def __init__(self, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> None:
        self.total_steps, self.warmup_steps, self.min_lr_ratio = total_steps, warmup_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.total_steps, self.warmup_steps, self.min_lr_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine to lr * min_lr_ratio over train.steps."""
    fn = WarmupCosine(train_cfg.steps, train_cfg.warmup_steps, train_cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def _is_dtensor(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def _norms_fp32(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's float32 L2 norm: torch's multi-tensor norm where the grads share a device (a few launches
    instead of one per tensor: a LoRA step has hundreds of small adapter grads), else one norm each."""
    if len({g.device for g in grads}) == 1:
        try:
            return list(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
        except (RuntimeError, TypeError, NotImplementedError):  # a tensor subclass or version without it
            pass
    return [torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads]


def _local_sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """Σ ||g||² by the Triton kernel where plain grads on one device include large ones it takes; else None."""
    if len({g.device for g in grads}) != 1 or (grads[0].device.type != "cuda" and not triton_interpreting()):
        return None
    # Triton is optional, and it reads TRITON_INTERPRET when it is imported: imported where its kernel runs
    from workbench.kernels.triton_sum_squares import sum_of_squares, takes

    detached = [g.detach() for g in grads]
    return sum_of_squares(detached) if any(takes(g) for g in detached) else None


def total_grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of all gradients, the same value on every rank.

    DTensor grads (FSDP2 shards) are grouped by mesh and placement, and their norms reduced over
    that mesh with `full_tensor()`. Plain or DTensor grads marked with GRAD_NORM_GROUP_ATTR have
    their squared norm summed over the marked group. Unmarked plain grads are replicated and
    counted once. A gradient whose squares its kernel already summed (kernels/grad_squares.py) is
    not read again.
    """
    buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    summed: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    groups: dict[tuple, object] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        marker = getattr(p, GRAD_NORM_GROUP_ATTR, None)
        if _is_dtensor(g):
            key = ("dtensor", id(g.device_mesh), tuple(g.placements), id(marker))
        else:
            key = ("local", id(marker))
        groups[key] = marker
        known = grad_squares.take(p)
        if known is not None:
            summed[key].append(known)
        else:
            buckets[key].append(g)
    squares: list[torch.Tensor] = []
    for key, marker in groups.items():
        grads, sq = buckets.get(key, []), None
        if grads:
            sq = _local_sum_of_squares(grads) if key[0] == "local" else None
            if sq is None:
                sq = torch.linalg.vector_norm(torch.stack(_norms_fp32([g.detach() for g in grads])), 2.0) ** 2
            if _is_dtensor(sq):
                sq = sq.full_tensor()
        if summed.get(key):
            known = torch.stack(summed[key]).sum()
            sq = known if sq is None else sq.to(known.device) + known
        if marker is not None:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=marker)
        squares.append(sq)
    if not squares:
        return torch.zeros(())
    device = squares[0].device
    return torch.sqrt(torch.stack([s.to(device) for s in squares]).sum())


def clip_grad_norm(
    params: Iterable[torch.nn.Parameter], max_norm: float | None, optimizer: torch.optim.Optimizer | None = None
) -> torch.Tensor:
    """Scale all grads so their global norm is at most `max_norm`; return the norm before clipping (a device scalar).

    torch's rule, on the device (no host read): grads times min(1, max_norm / (norm + 1e-6)). The
    norm is computed with max_norm=None too (the trainer's non-finite guard needs it); a non-finite
    norm clips nothing (its coefficient would turn every grad into NaN): the guard skips the step.
    With an `optimizer` that can apply the coefficient inside its update (set_grad_coef), the
    grads are left as they are and the next `optimizer.step()` clips them (one pass over the
    gradients fewer: a read and a write of each).
    """
    params = [p for p in params if p.grad is not None]
    norm = total_grad_norm(params)
    if max_norm is None or not params:
        if optimizer is not None:
            set_grad_coef(optimizer, None)
        return norm
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(coef), coef, torch.ones_like(coef)).to(torch.float32)
    if optimizer is not None and set_grad_coef(optimizer, coef):
        return norm
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = local_shard(p.grad)  # every shard times the same global coefficient
        by_kind[(g.device, g.dtype)].append(g)
    for (device, _), grads in by_kind.items():
        torch._foreach_mul_(grads, coef.to(device))
    return norm


def _fused_torch_adam(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and all(
        g.get("fused") for g in optimizer.param_groups
    )


def set_grad_coef(optimizer: torch.optim.Optimizer, coef: torch.Tensor | None) -> bool:
    """Make `optimizer`'s next step multiply every gradient by `coef` (a float32 device scalar; None: by 1).

    TritonAdamW multiplies in its kernel; torch's fused Adam/AdamW divides by its `grad_scale`
    (the AMP unscale), so it gets 1 / coef. Other optimizers cannot: False, and the caller scales
    the gradients itself.
    """
    if isinstance(optimizer, TritonAdamW):
        optimizer.grad_coef = coef
        return True
    if _fused_torch_adam(optimizer):
        optimizer.grad_scale = None if coef is None else torch.reciprocal(coef)
        return True
    return False


def set_skip_flag(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> bool:
    """Make `optimizer` skip its update while `found_inf` (a float32 device scalar) is 1; whether it can.

    TritonAdamW and torch's fused Adam/AdamW read the flag on the device (torch's fused path also
    restores its step counts). Other optimizers cannot: the trainer then checks on the host.
    """
    if not (isinstance(optimizer, TritonAdamW) or _fused_torch_adam(optimizer)):
        return False
    optimizer.found_inf = found_inf
    return True
