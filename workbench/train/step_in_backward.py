"""AdamW updates during backward: each parameter is updated as soon as its gradient is complete.

The update of one tensor needs only that tensor's gradient when nothing global is applied to the
gradients first (no clipping by the global norm, no accumulation over micro-batches). Updating
from a post-accumulate-grad hook then frees each gradient right away, instead of holding all of
them until `optimizer.step()` (the peak of a one-GPU step: parameters + gradients + two moments).
On CUDA the updates can run on a side stream, so the memory-bound AdamW kernels of layer i
overlap the backward GEMMs of layer i-1. The math is TritonAdamW's, unchanged.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from workbench.train.optim import TritonAdamW


class StepInBackward:
    """Hooks that run `optimizer`'s update of each parameter inside backward; call finish() after it."""

    def __init__(self, optimizer: TritonAdamW, side_stream: bool = True) -> None:
        if not isinstance(optimizer, TritonAdamW):
            raise TypeError(f"step-in-backward needs a TritonAdamW (per-tensor updates), got {type(optimizer).__name__}")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("step-in-backward runs on one rank only: with several ranks the gradients are "
                             "reduced (FSDP2) or sharded (experts) after backward, not per tensor inside it")
        params = [(p, g) for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        devices = {p.device for p, _ in params}
        self.optimizer = optimizer
        self.stream = None
        if side_stream and len(devices) == 1 and next(iter(devices)).type == "cuda":
            self.stream = torch.cuda.Stream(device=next(iter(devices)))
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._update, group=g))
                         for p, g in params]

    def _update(self, p: torch.Tensor, group: dict) -> None:
        grad = p.grad
        if self.stream is None:
            self.optimizer.step_param(p, group)
        else:
            # the side stream starts after everything backward queued so far (p's gradient, and
            # the kernels that still read p); the caching allocator must not hand the gradient's
            # memory to the compute stream before the update has read it
            self.stream.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(self.stream):
                self.optimizer.step_param(p, group)
            grad.record_stream(self.stream)
        p.grad = None

    def finish(self) -> None:
        """Make the current stream wait for the updates; call after backward, before the next forward."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def remove(self) -> None:
        """Unhook: later backwards leave gradients in .grad again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
