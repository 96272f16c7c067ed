"""Code that runs inside the ipyparallel engines: process-group setup, rank facts, the run entry.

Everything here executes on an engine (one per rank). It must never import ipywidgets, pandas or
plotly: the engines of a GPU node often have only the training stack installed.
"""

from __future__ import annotations

import os
import platform
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

STOP_FILE = "stop_requested"


def _standalone(fn):
    """Ship `fn` by value without importing `workbench` on the engine (it pulls in transformers).

    ipyparallel re-imports a function's module on the engine before calling it; marking it as
    defined in __main__ skips that, which keeps cluster start-up to about torch's import time.
    Such functions must import what they use inside their body and touch no module globals.
    """
    fn.__module__ = "__main__"
    return fn


@_standalone
def launcher_rank() -> dict:
    """What this engine knows about its place before the process group exists."""
    import os
    import socket

    def first_int(names):
        for var in names:
            if os.environ.get(var, "").isdigit():
                return int(os.environ[var])
        return None

    # Set by our local launcher (RANK), mpiexec (OMPI_/PMI_), srun (SLURM_).
    rank = first_int(("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"))
    local_rank = first_int(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"))
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = "127.0.0.1"
    return {
        "rank": rank,
        "local_rank": local_rank,
        "hostname": socket.gethostname(),
        "address": address,
        "pid": os.getpid(),
    }


@_standalone
def init_process_group(
    rank: int,
    world_size: int,
    local_rank: int,
    master_addr: str,
    master_port: int,
    backend: str,
    timeout_s: float = 120.0,
) -> dict:
    """Set the torchrun-style environment on this engine and join the process group."""
    import datetime
    import os

    import torch  # first: it may be importing already in the engine's pre-warm thread
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    if backend == "nccl":
        # With CUDA_VISIBLE_DEVICES narrowed to one GPU the engine sees it as device 0.
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "pid": os.getpid()}


@_standalone
def process_group_ready() -> bool:
    """Whether this engine is in an initialized process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@_standalone
def shutdown_process_group() -> bool:
    """Free dispatcher buffers, then barrier and destroy: gloo can abort at process exit if the group is left alive."""
    import sys

    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    # DeepEP buffers of models still alive here are freed while every rank can still agree on them
    # (their destroy waits for the peers). No model was ever built if the module was never imported.
    dispatch = sys.modules.get("workbench.moe.dispatch")
    if dispatch is not None:
        try:
            dispatch.close_live_dispatchers()
        except Exception:
            pass  # a rank that cannot agree leaves its buffers to process exit
    dist.barrier()
    dist.destroy_process_group()
    return True


# Run by each engine as it starts (IPEngine.startup_command): importing torch in a thread while
# the engine registers hides most of its ~1.5 s import from the cluster start-up.
PREWARM_COMMAND = (
    "import threading; threading.Thread(target=__import__, args=('torch',), "
    "name='workbench-prewarm', daemon=True).start()"
)


def _device_facts(backend: str) -> dict[str, Any]:
    import torch

    if backend == "nccl" and torch.cuda.is_available():
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {
            "device": f"cuda:{index}",
            "device_name": props.name,
            "device_memory_gib": round(props.total_memory / 2**30, 2),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
    import psutil  # an ipyparallel dependency, so present on every engine

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "device": "cpu",
        "device_name": name,
        "device_memory_gib": round(psutil.virtual_memory().total / 2**30, 2),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def rank_info(backend: str) -> dict[str, Any]:
    """One record describing this rank: host, pid, device, installed backends, versions."""
    import ipyparallel
    import torch
    import torch.distributed as dist

    # torch, on the engine only: the notebook's client imports this module and stays without it
    from workbench.backends import CHOICES, availability, package_versions

    facts = _device_facts(backend)
    device = "cuda" if facts["device"].startswith("cuda") else "cpu"
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    available = {}
    for field, choices in CHOICES.items():
        for choice in choices:
            if choice == "auto":
                continue
            ok, reason = availability(field, choice, device=device, world_size=world_size)
            available[f"{field}.{choice}"] = {"available": ok, "reason": reason}
    return {
        "rank": dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0)),
        "world_size": world_size,
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        **facts,
        "process_group": dist.get_backend() if dist.is_initialized() else None,
        "packages": package_versions(),
        "backends": available,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ipyparallel": ipyparallel.__version__,
        },
    }


def carries_expert_load(step: int, total_steps: int | None, every: int) -> bool:
    """Whether the published record of `step` keeps its [layers][experts] matrix: steps 1, 1+every, ... and the last.

    A rule of the step alone, so every rank sends the matrices of the same steps and the client can
    sum them over ranks; metrics.jsonl keeps the matrix of every step.
    """
    return (step - 1) % every == 0 or (total_steps is not None and step == total_steps)


class StreamCallback:
    """Publishes each of this rank's step records once to the notebook over ipyparallel's data channel.

    `publish_data` keeps only the latest value per key on the client, so a message carries the
    records not published before with their sequence range (`first_seq`..`last_seq`, counting this
    rank's records from 1). A client that missed messages between two polls sees the gap in the
    range and reads those records from metrics.jsonl, which the trainer appends before on_step.
    The expert-load matrix stays only on the records `carries_expert_load` picks. Each on_step
    publishes at once by default (the trainer may call it several times in a row; the client
    reads the ones a later message replaced from disk). With `min_interval_s`, records that come
    sooner after the last message wait for the next on_step; `on_end` sends what is left.
    """

    def __init__(
        self, min_interval_s: float = 0.0, load_every: int = 10, publish: Callable[[dict], None] | None = None
    ) -> None:
        if load_every < 1:
            raise ValueError(f"load_every must be >= 1 step, got {load_every}")
        self.min_interval_s = min_interval_s
        self.load_every = load_every
        self._publish_fn = publish
        self.total_steps: int | None = None
        self.pending: list[dict] = []
        self.seq = 0  # records seen
        self.published = 0  # records handed to the channel (or dropped when there is none)
        self._last_publish = float("-inf")

    def on_start(self, info: dict) -> None:
        self.total_steps = info.get("total_steps")

    def on_step(self, record: dict) -> None:
        self.seq += 1
        record = dict(record)
        if not carries_expert_load(int(record.get("step", self.seq)), self.total_steps, self.load_every):
            record.pop("expert_load", None)
        self.pending.append(record)
        self._publish()

    def on_end(self, status: dict) -> None:
        self._publish(force=True)

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.pending or (not force and now - self._last_publish < self.min_interval_s):
            return
        message = {"first_seq": self.published + 1, "last_seq": self.seq, "records": self.pending}
        # Sent or not, these records are done here: they are on disk, and the range tells the client.
        self.pending, self.published, self._last_publish = [], self.seq, now
        try:
            publish = self._publish_fn
            if publish is None:
                from ipyparallel.datapub import publish_data as publish
            publish(message)
        except Exception:  # not inside an engine (e.g. torchrun): streaming is optional
            return


class StopFileCallback:
    """`should_stop()` is true once the client has written <run_dir>/stop_requested.

    The engine is busy inside `apply_async`, so it cannot receive a message from the notebook;
    a file in the run directory needs no extra channel, works from any kernel or from the lab
    sidebar, and survives a notebook restart. The trainer checks it on rank 0 only and broadcasts.
    """

    def __init__(self, stop_file: str | os.PathLike) -> None:
        self.stop_file = Path(stop_file)

    def should_stop(self) -> bool:
        return self.stop_file.exists()


def run_finetune(
    config: dict, target: str = "workbench.train:finetune", load_every: int = 10, min_interval_s: float = 0.0
) -> dict:
    """Engine entry of `Cluster.finetune`: run the trainer with the stream and stop callbacks.

    `target` names the function ("module:attr") called as fn(run_config, callbacks=[...]).
    Returns {"rank", "status", "published"}: the records went out over the data channel, and
    `published` counts them so the client can read any it missed from metrics.jsonl.
    Raises with this rank's traceback attached so the notebook can say which rank failed.
    """
    import importlib

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    stream = StreamCallback(min_interval_s=min_interval_s, load_every=load_every)
    try:
        from workbench.config import RunConfig  # torch, on the engine only (as rank_info's imports)

        run_config = RunConfig.from_dict(config)
        run_dir = Path(run_config.output_dir).expanduser() / run_config.run_id
        module_name, _, attr = target.partition(":")
        fn = getattr(importlib.import_module(module_name), attr)
        status = fn(run_config, callbacks=[stream, StopFileCallback(run_dir / STOP_FILE)])
    except BaseException as err:
        stream.on_end({})
        remote_traceback = traceback.format_exc()
        # Leave the group so peers blocked in a collective with us fail now, not at the timeout;
        # the cluster re-initializes it before the next run.
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        raise RankFailure(rank, remote_traceback) from err
    stream.on_end(status if isinstance(status, dict) else {})
    return {"rank": rank, "status": status, "published": stream.seq}


class RankFailure(RuntimeError):
    """An exception raised on an engine, carrying its rank and the full remote traceback."""

    def __init__(self, rank: int, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return (RankFailure, (self.rank, self.remote_traceback))


@_standalone
def engine_environment() -> dict:
    """The rank-related environment of this engine (for tests and debugging)."""
    import os
    import sys

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
    return {k: os.environ.get(k) for k in keys} | {"pid": str(os.getpid()), "executable": sys.executable}
