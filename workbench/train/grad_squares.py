"""The clipping norm's squared gradients summed inside the backward, each as soon as the step's last backward ends it.

Why: after the backward the clipping norm read every gradient once more while nothing else ran (~11 GB for the
Qwen3-30B-A3B architecture at 8 layers, ~3 ms of an H200 step; benchmarks/NOTES.md). Here a post-accumulate-grad
hook on each parameter whose gradient kernels/triton_sum_squares takes queues that read as soon as the gradient is
final: on CUDA on a stream of its own, beside the backward's GEMMs that follow. The partial sums land in one buffer
per norm group, in the order optim.total_grad_norm lists the gradients, so the norm is the same float32 value, bit
for bit, as summing them afterwards. A group with a gradient the hooks did not see this step (a CUDA graph's
replay, a parameter that got no gradient) is summed afterwards, as before.

No record_stream on the gradients: nothing frees one before the optimizer phase, which first makes the step's
stream wait for this one (`sum_for`), so the allocator may hand their memory straight to the next step (a
record_stream would hold it until the GPU reached that point, while the host queues the next forward ahead of it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from workbench.kernels._triton_util import triton_interpreting
from workbench.parallel.fsdp import GRAD_NORM_GROUP_ATTR


@dataclass(frozen=True)
class _Slot:
    group: int  # index into GradSquares._groups
    first: int  # its first partial sum in the group's buffer


def summed_in_backward(p: torch.nn.Parameter) -> bool:
    """Whether GradSquares can sum `p`'s gradient in the backward: a large plain float tensor where the kernel runs."""
    if not (p.requires_grad and type(p.data) is torch.Tensor and (p.device.type == "cuda" or triton_interpreting())):
        return False
    if importlib.util.find_spec("triton") is None:  # a CUDA build without Triton: summed afterwards by torch
        return False
    from workbench.kernels.triton_sum_squares import _DTYPES, MIN_NUMEL  # Triton is there: CUDA or its interpreter

    return p.dtype in _DTYPES and p.numel() >= MIN_NUMEL


def grad_squares_for(params: list[torch.nn.Parameter]) -> GradSquares | None:
    """GradSquares over `params`, or None where none of them qualifies (a CPU run: nothing to sum in the backward)."""
    return GradSquares(params) if any(summed_in_backward(p) for p in params) else None


class GradSquares:
    """Post-accumulate-grad hooks that sum each large gradient's squares once `arm()` says the next backward ends it."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        from workbench.kernels.triton_sum_squares import programs_for, squares_into, takes

        self._squares_into, self._takes = squares_into, takes  # Triton imported only where a gradient qualifies
        self._slots: dict[torch.nn.Parameter, _Slot] = {}
        self._groups: list[list[torch.nn.Parameter]] = []  # each norm group's parameters, in `params` order
        group_of: dict[int, int] = {}
        sizes: list[int] = []
        for p in params:
            if not summed_in_backward(p):
                continue
            key = id(getattr(p, GRAD_NORM_GROUP_ATTR, None))
            if key not in group_of:
                group_of[key] = len(self._groups)
                self._groups.append([])
                sizes.append(0)
            g = group_of[key]
            self._slots[p] = _Slot(g, sizes[g])
            self._groups[g].append(p)
            sizes[g] += programs_for(p.numel())
        self._buffers = [
            torch.empty(n, dtype=torch.float32, device=grp[0].device) for n, grp in zip(sizes, self._groups)
        ]
        self._armed = False
        self._seen: set[torch.nn.Parameter] = set()
        self.taken = 0  # norm groups whose squares came from the backward's sums (tests check the path is used)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._slots]

    def arm(self) -> None:
        """The next backward completes this step's gradients: sum each one's squares as soon as it is complete."""
        self._armed = True
        self._seen.clear()

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        g = p.grad
        if not self._armed or g is None or not self._takes(g) or g.shape != p.shape:
            self._seen.discard(p)  # a gradient changed after its sum (an unarmed backward): summed afterwards
            return
        slot = self._slots[p]
        buffer = self._buffers[slot.group]
        if g.device.type != "cuda":  # Triton's interpreter (the CPU tests): inline
            self._squares_into(g, buffer, slot.first)
        elif torch.cuda.is_current_stream_capturing():  # a CUDA graph replays without hooks: summed afterwards
            self._seen.discard(p)
            return
        else:
            stream = self._streams.get(g.device)
            if stream is None:
                stream = self._streams[g.device] = torch.cuda.Stream(g.device)
            stream.wait_stream(torch.cuda.current_stream(g.device))  # the backward that completed this gradient
            with torch.cuda.stream(stream):
                self._squares_into(g, buffer, slot.first)
        # A second call in one backward (a reentrant checkpoint accumulates twice) rewrites the slot from the sum
        self._seen.add(p)

    def sum_for(self, params: list[torch.nn.Parameter]) -> torch.Tensor | None:
        """Σ of the partials of `params` (large gradients of one norm group, in parameter order) if this step's
        backward summed exactly those; else None (the caller sums them). Waits for the summing stream; disarms."""
        self._armed = False
        for stream in self._streams.values():
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        slot = self._slots.get(params[0]) if params else None
        group = self._groups[slot.group] if slot is not None else []
        same = len(group) == len(params) and all(a is b for a, b in zip(group, params))
        if not same or not all(p in self._seen for p in params):
            return None
        self.taken += 1
        return self._buffers[slot.group].sum()

    def remove(self) -> None:
        """Take the hooks off the parameters (the run's end)."""
        self._armed = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
