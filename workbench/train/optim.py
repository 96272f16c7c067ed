"""AdamW, the warmup + cosine schedule, and gradient clipping across the whole device mesh."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from workbench.backends import BackendError, availability
from workbench.config import OPTIMIZERS
from workbench.kernels.adamw import (
    ADAMW_KERNELS,
    DEFAULT_LAUNCH,
    AdamWLaunch,
    SRKeys,
    adamw_scalars,
    adamw_step_,
    kernel_supports,
)
from workbench.kernels.stochastic_round import element_base
from workbench.parallel.fsdp import GRAD_NORM_GROUP_ATTR  # set by the mesh builders, read here
from workbench.train.precision import OPTIMIZER_PRECISIONS, needs_workbench_adamw, resolve_precision


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


def adamw_kernel(device: torch.device | str) -> str:
    """The kernel TritonAdamW runs on `device`: "triton" where workbench.backends says Triton runs, else "torch"."""
    return "triton" if availability("optimizer", "triton", device)[0] else "torch"


def build_optimizer(model: torch.nn.Module, train_cfg, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (Triton or fused torch on CUDA, see resolve_optimizer); no weight decay on norms or biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": train_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return make_adamw(
        groups,
        getattr(train_cfg, "optimizer", "adamw"),
        device,
        lr=train_cfg.lr,
        betas=train_cfg.betas,
        precision=getattr(train_cfg, "precision", "auto"),
        seed=train_cfg.seed,
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
) -> torch.optim.Optimizer:
    """The AdamW `name` resolves to on `device`: TritonAdamW, or torch's (fused on CUDA).

    `precision` (train.precision, see workbench.train.precision) "bf16_sr" and "fp32_master" on a
    bf16 model need TritonAdamW: it is used for "adamw" on every device (its torch-op path on CPU).
    With "adamw_torch", "auto" is what torch's AdamW does (bf16: round to nearest).
    """
    mode = adamw_precision(precision, name, [p for g in param_groups for p in g["params"]])
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
            f"precision {optimizer.precision}"
        )
    kind = "fused=True" if optimizer.defaults.get("fused") else "foreach=False"
    return f"torch.optim.AdamW({kind})"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (without to_local's autograd overhead), or the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def _torch_adamw_options() -> dict[str, Any]:
    """torch AdamW's per-group options besides lr, betas, eps and weight_decay, at its defaults."""
    ref = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    return {k: v for k, v in ref.items() if k not in ("lr", "betas", "eps", "weight_decay")}


class TritonAdamW(torch.optim.Optimizer):
    """AdamW with torch's fused CUDA math, one Triton kernel launch per parameter tensor.

    State per parameter is torch AdamW's: "step" (a CPU float32 scalar tensor, as in torch's
    non-fused AdamW), "exp_avg" and "exp_avg_sq" (shaped, typed and placed like the parameter:
    DTensors for FSDP2 parameters), so torch.distributed.checkpoint saves and reshards it the same
    way. Param groups also carry torch AdamW's other options at their defaults (amsgrad, fused, ...)
    so a DCP checkpoint of either optimizer loads into the other. Each step counter has a Python
    int shadow, so a step never reads a tensor. FSDP2 parameters are updated through their local
    shards; a tensor the kernel cannot take (non-contiguous, or on CPU without TRITON_INTERPRET=1)
    gets the same math in torch ops (`updates` counts both paths). `precise=True` computes the moments and the
    weight decay in float64 as torch's functor does (bit-exact with it), the default in float32 (at most one
    float32 ulp apart).

    `precision` (workbench.train.precision) acts on bf16/fp16 parameters only: "bf16" stores the
    float32 results rounded to nearest, "bf16_sr" rounds bf16 ones stochastically with bits hashed
    from (`seed`, step, parameter index in param_groups order, element index: global for FSDP2
    dim-0 shards), so a run and its resume draw the same bits; "fp32_master" keeps a float32
    "master" copy and float32 moments in the state (saved by DCP like the others), updates it and
    copies it into the parameter.

    `kernel` ("triton" or "torch"; None: adamw_kernel of the first parameter's device) is decided
    here, once; `launch` is the Triton kernel's block and warps (AdamWLaunch, a benchmark knob).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        precise: bool = False,
        precision: str = "bf16",
        seed: int = 0,
        kernel: str | None = None,
        launch: AdamWLaunch = DEFAULT_LAUNCH,
        multi_tensor_numel: int = 0,
    ) -> None:
        if isinstance(multi_tensor_numel, bool) or not isinstance(multi_tensor_numel, int) or multi_tensor_numel < 0:
            raise ValueError(f"multi_tensor_numel must be an integer >= 0, got {multi_tensor_numel!r}")
        if kernel is not None and kernel not in ADAMW_KERNELS:
            raise ValueError(
                f"TritonAdamW kernel must be one of {ADAMW_KERNELS} or None (where the parameters are), got {kernel!r}"
            )
        if not isinstance(launch, AdamWLaunch):
            raise TypeError(f"TritonAdamW launch must be an AdamWLaunch, got {type(launch).__name__}")
        if precision not in OPTIMIZER_PRECISIONS:
            raise ValueError(f"TritonAdamW precision must be one of {OPTIMIZER_PRECISIONS}, got {precision!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if isinstance(lr, torch.Tensor) or not 0.0 <= lr:
            raise ValueError(f"lr must be a float >= 0, got {lr!r}")
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")
        if not 0.0 <= eps:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **_torch_adamw_options())
        super().__init__(params, defaults)
        if kernel is None:
            first = next((p for g in self.param_groups for p in g["params"]), None)
            kernel = adamw_kernel(first.device if first is not None else "cpu")
        self.kernel, self.launch = kernel, launch
        # Tensors of at most this many elements share one launch per group and step (kernels/triton_adamw_multi.py:
        # a launch per tensor costs ~65 us of host time); 0, one launch each. Off by default until measured on a GPU.
        self.multi_tensor_numel = multi_tensor_numel
        self._block_maps: dict = {}
        self.precise = bool(precise)
        self.precision, self.seed = precision, seed
        self._steps: dict[torch.Tensor, int] = {}
        self._bases: dict[torch.Tensor, tuple[int, int]] = {}  # element_base per parameter
        self.updates: Counter[str] = Counter()  # tensor updates by path: "triton", "torch", "empty"
        # A float32 device scalar, as torch's fused AdamW takes it: 1 skips every update (set_skip_flag)
        self.found_inf: torch.Tensor | None = None
        # A float32 device scalar every gradient is multiplied by inside the update (clip_grad_norm's)
        self.grad_coef: torch.Tensor | None = None

    def forget_skipped_steps(self, n: int) -> None:
        """Take back `n` counted steps that `found_inf` skipped (host counts, unlike torch's fused ones)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        for p, step in list(self._steps.items()):
            self._steps[p] = max(0, step - n)
            self.state[p]["step"].fill_(float(self._steps[p]))

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_steps", {})
        self.__dict__.setdefault("precise", False)
        self.__dict__.setdefault("precision", "bf16")
        self.__dict__.setdefault("seed", 0)
        self.__dict__.setdefault("_bases", {})
        self.__dict__.setdefault("updates", Counter())
        self.__dict__.setdefault("found_inf", None)
        self.__dict__.setdefault("grad_coef", None)
        self.__dict__.setdefault("kernel", "triton")  # pickled before the choice was made here: as it ran then
        self.__dict__.setdefault("launch", DEFAULT_LAUNCH)
        self.__dict__.setdefault("multi_tensor_numel", 0)
        self.__dict__.setdefault("_block_maps", {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then step counters back on the host (a torch fused AdamW keeps them on the GPU).

        torch casts every loaded state tensor to its parameter's dtype: the float32 master copy and
        moments of fp32_master would come back bf16, so the saved dtypes are put back after it.
        """
        kept = self._saved_dtype_states(state_dict)
        super().load_state_dict(state_dict)
        for p, key, value in kept:
            self.state[p][key] = value.to(device=p.device)
        self._steps.clear()  # re-read from state["step"] once, at the next step
        for state in self.state.values():
            step = state.get("step")
            if step is not None and not (isinstance(step, torch.Tensor) and step.device.type == "cpu"):
                state["step"] = torch.tensor(float(step), dtype=torch.float32)

    def _saved_dtype_states(self, state_dict: dict[str, Any]) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
        """(param, key, saved tensor) for state tensors whose dtype differs from their parameter's."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        out = []
        for pid, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if (
                    key != "step"
                    and isinstance(value, torch.Tensor)
                    and value.is_floating_point()
                    and value.dtype != p.dtype
                ):
                    out.append((p, key, value))
        return out

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1  # the parameter's position over all groups: part of its stochastic-rounding key
        for group in self.param_groups:
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError(
                    "TritonAdamW implements plain AdamW: amsgrad and maximize must be False "
                    "(a checkpoint of such a torch AdamW needs optimizer='adamw_torch')"
                )
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            scalars_by_step: dict[int, dict[str, float]] = {}
            batches: dict[tuple, list] = {}  # (step, dtypes, device, SR) -> [(tensors, sr keys)]: one launch each
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("TritonAdamW does not support sparse gradients")
                state = self.state[p]
                master = self.precision == "fp32_master" and p.dtype != torch.float32
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    dtype = torch.float32 if master else p.dtype
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                    if master:
                        state["master"] = p.detach().to(torch.float32, copy=True)
                step = self._steps.get(p)
                if step is None:  # fresh state or just loaded: the only read of the counter
                    step = int(state["step"].item())
                step += 1
                self._steps[p] = step
                state["step"].fill_(float(step))
                if step not in scalars_by_step:  # usually one step count per group
                    scalars_by_step[step] = adamw_scalars(step, lr, beta1, beta2, group["eps"], group["weight_decay"])
                scalars = scalars_by_step[step]
                sr = None
                if self.precision == "bf16_sr" and p.dtype == torch.bfloat16:
                    if p not in self._bases:
                        self._bases[p] = element_base(p)
                    base, salt = self._bases[p]
                    sr = SRKeys.make(self.seed, step, index, base, salt)
                # fp32_master: the master is updated and the bf16 parameter written from it (to nearest)
                target, out = (_local(state["master"]), _local(p)) if master else (_local(p), None)
                if out is None and self.kernel == "triton" and 0 < target.numel() <= self.multi_tensor_numel:
                    tensors = (target, _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]))
                    if kernel_supports(*tensors):
                        batch_key = (step, tuple(t.dtype for t in tensors), target.device, sr is None)
                        batches.setdefault(batch_key, []).append((tensors, sr))
                        continue
                path = adamw_step_(
                    target,
                    _local(p.grad),
                    _local(state["exp_avg"]),
                    _local(state["exp_avg_sq"]),
                    scalars,
                    self.precise,
                    sr,
                    out,
                    self.found_inf,
                    self.grad_coef,
                    kernel=self.kernel,
                    launch=self.launch,
                )
                self.updates[path] += 1
            for (step, *_), items in batches.items():
                self._step_many(items, scalars_by_step[step])
        return loss

    def _step_many(self, items: list, scalars: dict[str, float]) -> None:
        from workbench.kernels.triton_adamw_multi import triton_adamw_multi_step_

        keys = None if items[0][1] is None else [sr for _, sr in items]
        tensors = [t for t, _ in items]
        triton_adamw_multi_step_(
            tensors, scalars, self.precise, keys, self.found_inf, self.grad_coef, self.launch, self._block_maps
        )
        self.updates["triton_multi"] += len(tensors)


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


def total_grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of all gradients, the same value on every rank.

    DTensor grads (FSDP2 shards) are grouped by mesh and placement, and their norms reduced over
    that mesh with `full_tensor()`. Plain or DTensor grads marked with GRAD_NORM_GROUP_ATTR have
    their squared norm summed over the marked group. Unmarked plain grads are replicated and
    counted once.
    """
    buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
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
        buckets[key].append(g)
        groups[key] = marker
    squares: list[torch.Tensor] = []
    for key, grads in buckets.items():
        norms = [torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float32) for g in grads]
        sq = torch.linalg.vector_norm(torch.stack(norms), 2.0) ** 2
        if _is_dtensor(sq):
            sq = sq.full_tensor()
        marker = groups[key]
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
        g = _local(p.grad)  # every shard times the same global coefficient
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
