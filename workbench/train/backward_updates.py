"""Each parameter's AdamW update inside the backward, as soon as its gradient is complete (train.optimizer_in_backward).

With the update after the backward every gradient is alive at once: for the 8-layer GPT-OSS-20B architecture
that is 15.5 GB of bf16 gradients beside 15.5 GB of weights and 31 GB of moments, the whole of the engine's
57.9 GiB peak (benchmarks/NOTES.md, "Memory"). Here a post-accumulate-grad hook on each parameter runs
TritonAdamW's update of that parameter and frees its gradient, so about one layer's gradients are alive at a
time (torchtitan and PyTorch's own tutorial do the same). What it costs: no clipping by the global norm (it
needs every gradient before any update) and no gradient accumulation, both refused by the config and the
trainer. The non-finite guard still holds: no non-finite value reaches a weight. The Triton kernel sums each
gradient's squares as it updates (the norm without a second read of every gradient) and stores nothing for a
block whose sum is not finite; with torch ops the norm comes first and a non-finite one sets the sticky skip
flag before the update reads it. Either way the step is then partly applied (its finite gradients, already
used), the step's end sets the flag from the global norm, and the run stops at the next read, as every
non-finite step does.

On CUDA the updates run on a stream of their own, each after the backward work queued before its hook: the
update streams memory while the backward's GEMMs that follow hold the tensor cores, instead of between them.
The freed gradient stays reserved for that stream (record_stream) until its update has read it, and the step's
end waits for the stream (take_grad_norm) before anything reads a weight or a moment again.
"""

from __future__ import annotations

import torch

from workbench.parallel.dist_utils import local_shard
from workbench.train.step_stats import SkipFlag
from workbench.train.triton_adamw_optimizer import TritonAdamW


class BackwardUpdates:
    """Hooks that update each trainable parameter with `optimizer` when its gradient is complete, then free it."""

    def __init__(self, optimizer: torch.optim.Optimizer, skip: SkipFlag, side_stream: bool = True) -> None:
        if not isinstance(optimizer, TritonAdamW):
            raise TypeError(
                "updates inside the backward need TritonAdamW (its per-parameter update), got "
                f"{type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.skip = skip  # the trainer's sticky flag, read by every update
        self.step = 0  # the step whose backward runs (begin), where a non-finite gradient is reported
        optimizer.found_inf = skip.found_inf
        optimizer.grad_coef = None  # no clipping: nothing scales the gradients
        # torch's LR scheduler warns that its step came first unless optimizer.step() ran; the updates run here
        optimizer._opt_called = True
        self._where: dict[torch.Tensor, tuple[dict, int]] = {}
        index = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._where[p] = (group, index)  # the index is the stochastic-rounding key's, as in step()
                index += 1
        self._squares: list[torch.Tensor] = []  # this step's squared gradient norms, one per parameter
        self._side_stream = side_stream  # `side_stream=False`: every update on the backward's own stream (the A/B)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._update) for p in self._where]

    def begin(self, step: int) -> None:
        """Step `step`'s backward comes next; refused once the hooks are off (the run has ended)."""
        if not self._handles:
            raise RuntimeError(
                "this trainer's run has ended and its update hooks are off the parameters: a step now would "
                "update nothing; build a new Trainer to train on"
            )
        self.step = step

    def _update(self, p: torch.Tensor) -> None:
        grad = p.grad
        stream = self._stream_for(grad)
        if stream is None:
            self._apply(p)
        else:
            stream.wait_stream(torch.cuda.current_stream(grad.device))  # the backward that made this gradient
            with torch.cuda.stream(stream):
                self._apply(p)
            grad.record_stream(stream)  # its memory is not handed out again before the update has read it
        p.grad = None

    def _apply(self, p: torch.Tensor) -> None:
        group, index = self._where[p]
        # The Triton kernel sums the gradient's squares as it updates (no second read of the gradient) and
        # stores nothing for a block that is not finite; the step's end sets the flag from the norm.
        square = self.optimizer.step_param_squares(p, group, index)
        if square is None:  # torch ops: the norm first, so a non-finite gradient sets the flag before its update
            square = torch.linalg.vector_norm(local_shard(p.grad), dtype=torch.float32).square()
            self.skip.update(self.step, [square])
            self.optimizer.step_param(p, group, index)
        self._squares.append(square)

    def _stream_for(self, grad: torch.Tensor) -> torch.cuda.Stream | None:
        # a plain CUDA gradient outside graph capture; the rest update where the backward runs
        if not self._side_stream or grad.device.type != "cuda" or hasattr(grad, "_local_tensor"):
            return None
        if torch.cuda.is_current_stream_capturing():
            return None
        if grad.device not in self._streams:
            self._streams[grad.device] = torch.cuda.Stream(grad.device)
        return self._streams[grad.device]

    def _join(self) -> None:
        # work queued after this on the current stream waits for every update queued on the update streams
        for stream in self._streams.values():
            torch.cuda.current_stream(stream.device).wait_stream(stream)

    def take_grad_norm(self, device: torch.device) -> torch.Tensor:
        """The global gradient norm of the backward just run (a device scalar), and a fresh start for the next.

        Also where the step's updates are joined: the current stream waits for the update stream."""
        self._join()
        squares, self._squares = self._squares, []
        if not squares:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack(squares).sum().sqrt()

    def remove(self) -> None:
        """Take the hooks off at the run's end: a model trained on afterwards (another Trainer) is not updated twice."""
        self._join()  # an update still queued there finishes before anything after
        for handle in self._handles:
            handle.remove()
        self._handles = []
