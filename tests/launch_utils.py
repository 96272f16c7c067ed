"""Run a function on N CPU ranks over gloo (real torch.distributed) and collect results."""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from multiprocessing.connection import wait

import torch.distributed as dist
import torch.multiprocessing as mp

from workbench.parallel.launch import free_port


def _worker(rank: int, world: int, port: int, store_file: str, backend: str, env: dict, fn, args, conn) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
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
        # A Pipe's send writes in this thread and returns once the bytes are in the pipe (a Queue's
        # put hands them to a feeder thread that os._exit below can kill mid-message).
        # Plain pickle: torch's multiprocessing pickler would pass tensors as shared-memory file
        # descriptors, which the parent can only fetch from a sender that is still alive.
        conn.send_bytes(pickle.dumps(("ok", result)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        except BaseException:
            pass  # the parent then sees the pipe close without a result and reports the exit code
    # gloo can abort at interpreter exit after sub-groups were used (seen in this project's runs): leave at once.
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout: float = 240.0, backend: str = "gloo", env: dict | None = None) -> list:
    """fn(rank, world, *args) on `world` ranks (gloo, or nccl with one GPU each) with `env` set;
    returns per-rank results. Raises at once on a rank's error or on a rank that exited without a
    result (with its exit code); TimeoutError names the ranks still silent after `timeout` s."""
    ctx = mp.get_context("spawn")
    port = free_port()
    store_file = tempfile.mktemp(prefix="wb-gloo-store-")
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, store_file, backend, env or {}, fn, args, pipes[r][1]))
        for r in range(world)
    ]
    results: dict[int, object] = {}
    ok = False
    try:
        for p, (_, send) in zip(procs, pipes):
            p.start()
            send.close()  # the child holds the only write end: its exit reads as EOF here
        pending = {pipes[r][0]: r for r in range(world)}
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(
                    f"ranks {sorted(pending.values())} of {world} sent no result within {timeout:.0f} s "
                    f"(alive: {[r for r in sorted(pending.values()) if procs[r].is_alive()]})"
                )
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    state, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    procs[rank].join(timeout=10)
                    raise RuntimeError(
                        f"rank {rank} exited without a result (exit code {procs[rank].exitcode})"
                    ) from None
                if state == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{payload}")
                results[rank] = payload
        ok = True
    finally:
        for p in procs:
            if p.pid is None:
                continue
            p.join(timeout=30 if ok else 1)  # after a failure the others may wait in a collective
            if p.is_alive():
                p.kill()
                p.join()
        for recv, _ in pipes:
            recv.close()
        if os.path.exists(store_file):
            os.remove(store_file)
    return [results[r] for r in range(world)]
