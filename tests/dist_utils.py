"""Run a function on N CPU ranks over gloo (real torch.distributed) and collect results."""

from __future__ import annotations

import os
import queue as queue_module
import socket
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, store_file: str, backend: str, env: dict, fn, args, queue) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        import torch

        if backend == "nccl":
            torch.cuda.set_device(rank)

        # Many ranks share 2 CI cores: one intra-op thread each, or OpenMP spin-waits starve gloo.
        torch.set_num_threads(1)
        # A file rendezvous: a free port picked by the parent can be taken by another process
        # before the ranks bind it (seen once under a concurrent CI run: a 240 s hang).
        dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    # gloo can abort at interpreter exit after sub-groups were used (facts.md): leave at once.
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout: float = 240.0, backend: str = "gloo", env: dict | None = None) -> list:
    """Like `_run_ranks_once`; a launch whose ranks never report (a rendezvous hang seen about once
    in four 8-rank CI runs on 2 cores) is killed and launched once more. Rank errors are not retried."""
    try:
        return _run_ranks_once(fn, world, *args, timeout=timeout, backend=backend, env=env)
    except queue_module.Empty:
        return _run_ranks_once(fn, world, *args, timeout=timeout, backend=backend, env=env)


def _run_ranks_once(fn, world: int, *args, timeout: float = 240.0, backend: str = "gloo",
                    env: dict | None = None) -> list:
    """fn(rank, world, *args) on `world` ranks (gloo, or nccl with one GPU each) with `env` set;
    returns per-rank results, raises a rank's error."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    store_file = tempfile.mktemp(prefix="wb-gloo-store-")
    procs = [ctx.Process(target=_worker, args=(r, world, port, store_file, backend, env or {}, fn, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, state, payload = queue.get(timeout=timeout)
            if state == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if os.path.exists(store_file):
            os.remove(store_file)
    return [results[r] for r in range(world)]
