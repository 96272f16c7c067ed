"""TritonAdamW: torch's AdamW state and math, updated by the Triton kernels (one launch per tensor, or one per
list of small tensors), in the precision modes of workbench.train.precision."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from workbench.backends import adamw_kernel
from workbench.config_train import OPTIMIZER_STATES
from workbench.kernels.adamw import adamw_step_
from workbench.kernels.adamw8 import adamw8_step_, quant_block, scale_shape
from workbench.kernels.adamw_args import (
    ADAMW_KERNELS,
    DEFAULT_LAUNCH,
    AdamWLaunch,
    AdamWStep,
    Moments8,
    SRKeys,
    adamw_scalars,
    kernel_supports,
    squares_size,
)
from workbench.kernels.stochastic_round import element_base
from workbench.parallel.dist_utils import local_shard
from workbench.train.precision import OPTIMIZER_PRECISIONS


def _torch_adamw_options() -> dict[str, Any]:
    """torch AdamW's per-group options besides lr, betas, eps and weight_decay, at its defaults."""
    ref = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    return {k: v for k, v in ref.items() if k not in ("lr", "betas", "eps", "weight_decay")}


_STATE_KEYS_8BIT = ("exp_avg_q8", "exp_avg_absmax", "exp_avg_sq_q8", "exp_avg_sq_absmax")


def _blocks_along_rows(p: torch.Tensor) -> bool:
    # a DTensor whose shards cut its rows cannot keep one scale per block of a row on each shard
    placements = getattr(p, "placements", None)
    return placements is None or all(not pl.is_shard() or pl.dim != p.dim() - 1 for pl in placements)


def _scales_like(p: torch.Tensor, qblock: int) -> torch.Tensor:
    """float32 zeros, one per `qblock` elements of each row of `p`; a DTensor sharded as `p` for FSDP2's."""
    local = local_shard(p)
    scales = torch.zeros(scale_shape(local.shape, qblock), dtype=torch.float32, device=local.device)
    if local is p:
        return scales
    from torch.distributed.tensor import DTensor

    shape = scale_shape(p.shape, qblock)
    stride = tuple(int(torch.Size(shape)[i + 1 :].numel()) for i in range(len(shape)))
    return DTensor.from_local(scales, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)


# The default multi_tensor_numel: every adapter, norm, router and k/v projection of a 30B-class MoE shares the
# launches; attention's q/o and the fused experts (tens of millions of elements) keep their own.
MULTI_TENSOR_NUMEL = 1 << 22


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

    `states` "8bit" keeps exp_avg and exp_avg_sq as one-byte codes with a float32 scale per block of
    each row ("exp_avg_q8", "exp_avg_absmax", "exp_avg_sq_q8", "exp_avg_sq_absmax"; rounded
    stochastically, workbench.kernels.adamw8) for every tensor adamw8.quant_block can block, except
    those that share multi-tensor launches (Triton kernel, at most `multi_tensor_numel` elements: a
    LoRA step's hundreds of adapters stay in a few launches; their moments are a negligible share of
    memory); the others keep "full" moments. Its checkpoints load only into an optimizer with the same `states`.

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
        multi_tensor_numel: int = MULTI_TENSOR_NUMEL,
        states: str = "full",
    ) -> None:
        if states not in OPTIMIZER_STATES:
            raise ValueError(f"TritonAdamW states must be one of {OPTIMIZER_STATES}, got {states!r}")
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
        # a launch per tensor costs ~65 us of host time); 0, one launch each. The compiled kernel equals the
        # per-tensor one bit for bit (tests/test_adamw_multi.py); on the H200 the 48-layer LoRA step measured
        # 9.2k / 9.7k tokens/s with it against 7.9k / 8.2k without (alternating, one launch; benchmarks/NOTES.md,
        # 2026-12-02), once its step table went through buffers allocated once.
        self.multi_tensor_numel = multi_tensor_numel
        self._block_maps: dict = {}
        self.precise = bool(precise)
        self.precision, self.seed = precision, seed
        self.states = states
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
        self.__dict__.setdefault("states", "full")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then step counters back on the host (a torch fused AdamW keeps them on the GPU).

        torch casts every loaded state tensor to its parameter's dtype: the float32 master copy and
        moments of fp32_master would come back bf16, so the saved dtypes are put back after it.
        """
        self._check_states_layout(state_dict)
        kept = self._saved_dtype_states(state_dict)
        super().load_state_dict(state_dict)
        for p, key, value in kept:
            self.state[p][key] = value.to(device=p.device)
        self._steps.clear()  # re-read from state["step"] once, at the next step
        for state in self.state.values():
            step = state.get("step")
            if step is not None and not (isinstance(step, torch.Tensor) and step.device.type == "cpu"):
                state["step"] = torch.tensor(float(step), dtype=torch.float32)

    def _check_states_layout(self, state_dict: dict[str, Any]) -> None:
        """Refuse 8-bit moments for an optimizer that keeps full ones (it has no code to read them).

        The other way round needs no refusal: each tensor's update follows the layout of its own state, and an
        8-bit run keeps full moments for some tensors anyway (small ones, or all of a LoRA run's adapters on a
        GPU). A resume that changes train.optimizer_states is refused before this, with the settings.
        """
        saved = [s for s in state_dict.get("state", {}).values() if isinstance(s, dict)]
        eight = sum(1 for s in saved if "exp_avg_q8" in s)
        if self.states == "full" and eight:
            raise ValueError(
                f"the checkpoint's optimizer keeps 8-bit moments for {eight} tensors (train.optimizer_states='8bit') "
                "and this one keeps full ones: resume with train.optimizer_states='8bit'"
            )

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
            steps: dict[int, AdamWStep] = {}  # by step count: usually one per group
            batches: dict[tuple, list] = {}  # (step, dtypes, device, SR) -> [(tensors, sr keys)]: one launch each
            for p in group["params"]:
                index += 1
                if p.grad is not None:
                    self._update(p, group, index, steps, batches)
            for (count, *_), items in batches.items():
                self._step_many(items, steps[count])
        return loss

    @torch.no_grad()
    def step_param(self, p: torch.Tensor, group: dict, index: int) -> None:
        """The update of one parameter `p` of `group` (its position `index` over all groups), now, in one launch."""
        if p.grad is not None:
            self._update(p, group, index, {}, None)

    def step_param_squares(self, p: torch.Tensor, group: dict, index: int) -> torch.Tensor | None:
        """step_param by the Triton kernel, which also sums the gradient's squares (a device scalar, returned) and
        stores nothing for a block of it that is not finite; None, with nothing updated, where torch ops would run."""
        if p.grad is None or self.kernel != "triton" or not kernel_supports(local_shard(p), local_shard(p.grad)):
            return None
        squares: list[torch.Tensor] = []
        self._update(p, group, index, {}, None, squares)
        return squares[0].sum()

    def _squares_buffer(self, squares: list | None, n: int, block: int, device: torch.device) -> torch.Tensor | None:
        # zeros: a program that the skip flag stops before its sum adds nothing
        if squares is None:
            return None
        squares.append(torch.zeros(squares_size(n, block), dtype=torch.float32, device=device))
        return squares[-1]

    def _update(
        self,
        p: torch.Tensor,
        group: dict,
        index: int,
        steps: dict[int, AdamWStep],
        batches: dict | None,
        squares: list | None = None,
    ) -> None:
        # One parameter's update; with `batches`, a small one joins its multi-tensor launch instead; with
        # `squares`, the buffer of the kernel's per-block sums of squared gradients is appended there
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError(
                "TritonAdamW implements plain AdamW: amsgrad and maximize must be False "
                "(a checkpoint of such a torch AdamW needs optimizer='adamw_torch')"
            )
        if p.grad.is_sparse:
            raise RuntimeError("TritonAdamW does not support sparse gradients")
        beta1, beta2 = group["betas"]
        state = self.state[p]
        master = self.precision == "fp32_master" and p.dtype != torch.float32
        if not state and self._moments_in_8bit(p):
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in ("exp_avg_q8", "exp_avg_sq_q8"):
                state[key] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
            for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
                state[key] = _scales_like(p, quant_block(p.shape))
            if master:
                state["master"] = p.detach().to(torch.float32, copy=True)
        elif not state:
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
        if step not in steps:
            scalars = adamw_scalars(step, float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])
            steps[step] = AdamWStep(scalars, self.precise, self.found_inf, self.grad_coef, self.launch)
        if "exp_avg_q8" in state:  # the state's layout decides (a checkpoint may come from another kernel choice)
            self._update8(p, state, index, step, steps[step], master, squares)
            return
        sr = None
        if self.precision == "bf16_sr" and p.dtype == torch.bfloat16:
            if p not in self._bases:
                self._bases[p] = element_base(p)
            base, salt = self._bases[p]
            sr = SRKeys.make(self.seed, step, index, base, salt)
        # fp32_master: the master is updated and the bf16 parameter written from it (to nearest)
        target, out = (local_shard(state["master"]), local_shard(p)) if master else (local_shard(p), None)
        if (
            batches is not None
            and out is None
            and self.kernel == "triton"
            and 0 < target.numel() <= self.multi_tensor_numel
        ):
            tensors = (target, local_shard(p.grad), local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"]))
            if kernel_supports(*tensors):
                batch_key = (step, tuple(t.dtype for t in tensors), target.device, sr is None)
                batches.setdefault(batch_key, []).append((tensors, sr))
                return
        path = adamw_step_(
            target,
            local_shard(p.grad),
            local_shard(state["exp_avg"]),
            local_shard(state["exp_avg_sq"]),
            steps[step],
            sr,
            out,
            kernel=self.kernel,
            squares=self._squares_buffer(squares, target.numel(), self.launch.block, target.device),
        )
        self.updates[path] += 1

    def _moments_in_8bit(self, p: torch.Tensor) -> bool:
        # decided once, when the state is made; afterwards each update follows its state's layout
        if self.states != "8bit" or not quant_block(p.shape) or not _blocks_along_rows(p):
            return False
        # a tensor that shares a multi-tensor launch keeps full moments (a launch of its own costs ~65 us of host time)
        return not (self.kernel == "triton" and local_shard(p).numel() <= self.multi_tensor_numel)

    def _update8(self, p, state, index: int, count: int, step: AdamWStep, master: bool, squares: list | None) -> None:
        # One parameter with 8-bit moments: its own launch; the moment codes are always rounded stochastically.
        # The block size is the state's own (its scales per row), whichever rule made it.
        scales = tuple(state["exp_avg_absmax"].shape)
        qblock = p.shape[-1] // scales[-1] if p.dim() >= 2 and scales and scales[-1] else 0
        if not qblock or scales != scale_shape(p.shape, qblock):
            raise ValueError(
                f"8-bit AdamW state of a parameter of shape {tuple(p.shape)} has scales shaped {scales}: "
                "the checkpoint is of another model or layout"
            )
        if p not in self._bases:
            self._bases[p] = element_base(p)
        base, salt = self._bases[p]
        keys = SRKeys.make(self.seed, count, index, base, salt)
        target, out = (local_shard(state["master"]), local_shard(p)) if master else (local_shard(p), None)
        moments = Moments8(*(local_shard(state[k]) for k in _STATE_KEYS_8BIT), qblock)
        path = adamw8_step_(
            target,
            local_shard(p.grad),
            moments,
            step,
            keys,
            sr_param=self.precision == "bf16_sr",
            out=out,
            kernel=self.kernel,
            squares=self._squares_buffer(squares, target.numel(), max(self.launch.block, qblock), target.device),
        )
        self.updates[path] += 1

    def _step_many(self, items: list, step: AdamWStep) -> None:
        # Only with kernel "triton", which is decided where Triton imports: Triton is optional, and it reads
        # TRITON_INTERPRET when it is imported.
        from workbench.kernels.triton_adamw_multi import triton_adamw_multi_step_

        keys = None if items[0][1] is None else [sr for _, sr in items]
        tensors = [t for t, _ in items]
        triton_adamw_multi_step_(tensors, step, keys, self._block_maps)
        self.updates["triton_multi"] += len(tensors)
