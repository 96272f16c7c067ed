"""Find the ops that force a device -> host read (a "host sync") in a forward/backward, on any device.

Each such read drains the GPU queue, so the Python launch overhead of the next ops is no longer
hidden behind running kernels. `HostSyncRecorder` is a TorchDispatchMode: it sees every aten op
(also those autograd runs in backward) and records the ones whose result the host must wait for,
with the Python frames that issued them. It runs on CPU too, where nothing waits, so a CPU test
can prove a code path sync-free for CUDA (as long as that path is the one CUDA takes).

    with HostSyncRecorder() as rec:
        model(**batch).loss.backward()
    print(rec.report())
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops whose result (a Python scalar, or an output whose size depends on the data) needs the host to
# wait for the device; None marks look-alikes that do not wait. repeat_interleave waits only
# without `output_size`; blocking host<->device copies and boolean-mask indexing are found by
# _needs_host too, .tolist()/.numpy() of CPU tensors by _HostReads.
SYNC_OPS = {
    aten._local_scalar_dense.default: "read a scalar (.item(), int(t), float(t), bool(t), .tolist())",
    aten.item.default: "read a scalar (.item())",
    aten.nonzero.default: "nonzero: output size depends on the data",
    aten.nonzero_static.default: None,  # fixed output size: no sync (listed to say so)
    aten.masked_select.default: "masked_select: output size depends on the data",
    aten._unique.default: "unique: output size depends on the data",
    aten._unique2.default: "unique: output size depends on the data",
    aten.unique_dim.default: "unique: output size depends on the data",
    aten.unique_consecutive.default: "unique_consecutive: output size depends on the data",
    aten.is_nonzero.default: "bool(tensor)",
    aten.equal.default: "torch.equal: a Python bool",
    aten.allclose.default: "torch.allclose: a Python bool",
    aten._assert_async.default: None,  # asynchronous on CUDA: no sync
    aten._assert_async.msg: None,
    aten.bincount.default: "bincount: its output size, max(input) + 1, is read on the host (also with minlength)",
    aten.repeat_interleave.Tensor: "repeat_interleave without output_size",
    aten.repeat_interleave.self_Tensor: "repeat_interleave without output_size",
}
# Frames of torch itself and of this module are plumbing, not where a sync came from.
_SKIP = ("/site-packages/torch/", "/workbench/train/host_syncs.py")


@dataclass(frozen=True)
class HostSync:
    """One recorded host sync: the op, why it syncs, and the innermost non-torch frames (innermost last)."""

    op: str
    why: str
    stack: tuple[str, ...]
    device: str  # where the data read lives: on "cpu" the read itself waits for nothing

    @property
    def origin(self) -> str:
        """The innermost frame outside torch: the line that asked for the read."""
        return self.stack[-1] if self.stack else "?"

    def from_workbench(self) -> bool:
        """Whether the innermost frame outside torch is the engine's own code (not Transformers')."""
        return self.origin.startswith("workbench/")


def _copy_waits(func, args, kwargs) -> bool:
    """A blocking copy between host and device memory: torch waits for the stream (both directions)."""
    if func is aten._to_copy.default:
        src, dst = args[0].device, kwargs.get("device")
        blocking = not kwargs.get("non_blocking", False)
    elif func is aten.copy_.default:
        src, dst = args[1].device, args[0].device
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    else:
        return False
    if dst is None or not blocking:
        return False
    kinds = {torch.device(src).type, torch.device(dst).type}
    return "cpu" in kinds and len(kinds) == 2 and "meta" not in kinds


def _bool_index(func, args) -> bool:
    """x[mask] or x[mask] = v: the kernel turns the mask into indices with nonzero (below this mode)."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _needs_host(func, args, kwargs) -> str | None:
    if _copy_waits(func, args, kwargs):
        return "blocking copy between host and device"
    if _bool_index(func, args):
        return "boolean-mask indexing (a nonzero inside the kernel)"
    why = SYNC_OPS.get(func)
    if why is None:
        return None
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        # output_size is keyword-only in both schemas; with it the output shape is known up front
        if kwargs.get("output_size") is not None:
            return None
    return why


def _frames(depth: int) -> tuple[str, ...]:
    frames = []
    for f in traceback.extract_stack():
        path = f.filename.replace("\\", "/")
        if any(s in path for s in _SKIP):
            continue
        frames.append(f"{_short(path)}:{f.lineno} {f.name}")
    return tuple(frames[-depth:])


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/workbench/", "/tests/"):
        if marker in path:
            head = "" if marker == "/site-packages/" else marker.strip("/") + "/"
            return head + path.split(marker, 1)[1]
    return path


class _HostReads(TorchFunctionMode):
    """.tolist() / .numpy() of a CPU tensor read its memory without an aten op: seen here, a level up.

    On a device the same calls copy to the host first, which the dispatch mode records.
    """

    def __init__(self, recorder: HostSyncRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("tolist", "numpy") and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            self.recorder.syncs.append(
                HostSync(name, f".{name}() reads every element", _frames(self.recorder.depth), "cpu")
            )
        return func(*args, **(kwargs or {}))


class HostSyncRecorder(TorchDispatchMode):
    """Record every op that forces a device -> host read while active; `depth` frames of stack each.

    Call backward inside the `with` too: autograd carries the mode to the ops it runs, so the
    syncs of custom backward functions are recorded with the frames that issued them.
    """

    def __init__(self, depth: int = 6):
        super().__init__()
        self.depth = depth
        self.syncs: list[HostSync] = []

    def __enter__(self):
        self._reads = _HostReads(self)
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._reads.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _needs_host(func, args, kwargs)
        if why is not None:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            device = first.device.type if first is not None else "?"
            self.syncs.append(HostSync(str(func.overloadpacket.__name__), why, _frames(self.depth), device))
        return func(*args, **kwargs)

    def origins(self) -> dict[str, int]:
        """How many syncs came from each origin line."""
        counts: dict[str, int] = {}
        for s in self.syncs:
            key = f"{s.op} @ {s.origin}"
            counts[key] = counts.get(key, 0) + 1
        return counts

    def report(self) -> str:
        """One line per distinct origin (op, count, innermost frames), for a notebook or a log."""
        if not self.syncs:
            return "no host syncs"
        lines, seen = [], {}
        for s in self.syncs:
            key = (s.op, s.stack)
            seen[key] = seen.get(key, 0) + 1
        for (op, stack), n in seen.items():
            lines.append(f"{n} x {op}: " + " <- ".join(reversed(stack)))
        return "\n".join(lines)
