"""`run_bench(BenchConfig) -> dict`: every variant in one launch, on the same weights and tokens."""

from __future__ import annotations

import gc
import os
import shutil
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workbench.bench.config import VARIANTS, BenchConfig
from workbench.config import ConfigError
from workbench.params import num_experts
from workbench.parallel import dist_utils as du
from workbench.train.metrics import flops_per_token, tflops_per_gpu


def _ensure_group() -> bool:
    """One process without a group gets a 1-rank group (the engine's mesh build needs one)."""
    if du.initialized():
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return du.init_from_env()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return True


def _dtype(cfg: BenchConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def resolve_mesh(cfg: BenchConfig, world: int, num_experts: int):
    """The engine's mesh: the configured one checked against the world, else dp=world, ep=world."""
    from workbench.parallel.mesh import MeshConfig, MeshError

    mesh = cfg.mesh
    if mesh is None:
        mesh = MeshConfig(dp=world, ep=world if num_experts % world == 0 else 1)
    try:
        mesh.validate(world, num_experts)
    except MeshError as err:
        raise ConfigError(f"bench mesh does not fit: {err}") from err
    return mesh


def cpu_threads(local_world: int) -> int:
    """Intra-op threads for one CPU bench rank: half this process's cores, shared among the ranks
    of this host.

    OpenMP waits for every thread at each parallel region, so a thread that another busy process
    preempts stalls them all: on 16 cores with one busy process, 16 threads ran the tiny bench at
    237 tokens/s, 15 at 5,317, 8 at 5,979 (and 8 lose little when the machine is idle).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // (2 * local_world))


def _set_cpu_threads(device: torch.device, world: int) -> int | None:
    """Bound this process's threads on CPU unless OMP_NUM_THREADS says otherwise; the old count."""
    if device.type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE") or world)))
    return before


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    du.barrier()


def _shared_tmpdir(base: str | None) -> Path:
    path = tempfile.mkdtemp(prefix="workbench-bench-", dir=base) if du.rank() == 0 else None
    return Path(du.broadcast_object(path))


def run_variant(name: str, cfg: BenchConfig, hf_config, mesh, checkpoint: Path | None, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    """Build, train and time one variant; its row for the results (status ok/skipped/failed)."""
    from workbench.bench.anchor import CUDNN_REASON, attention_refusal, build_anchor
    from workbench.bench.engine import build_engine
    from workbench.bench.timing import run_steps
    from workbench.bench.variant import weight_fingerprint

    spec = VARIANTS[name]
    row: dict[str, Any] = {"name": name, "kind": spec.kind, "help": spec.help,
                           "gate": spec.gate if spec.kind == "engine" else "native"}
    if spec.needs_cuda and device.type != "cuda":
        return {**row, "status": "skipped", "reason": spec.cuda_reason or CUDNN_REASON}
    if spec.kind == "anchor":
        refused = attention_refusal(hf_config, spec.attn_implementation)
        if refused is not None:  # e.g. GPT-OSS and sdpa: recorded, not built
            return {**row, "status": "skipped", "reason": refused}
    if spec.kind == "engine" and spec.backend:
        from workbench.backends import BackendError
        from workbench.bench.engine import variant_backend

        try:
            variant_backend(spec, cfg.backend).resolve(device, world_size=mesh.ep)
        except BackendError as err:  # an extra that is not installed here is a skip, not a failure
            return {**row, "status": "skipped", "reason": str(err)}
    prep = None
    try:
        t0 = time.perf_counter()
        if spec.kind == "anchor":
            prep = build_anchor(spec, hf_config, cfg.seed, cfg.lr, device, dtype)
        else:
            prep = build_engine(spec, checkpoint, cfg.backend, mesh, cfg.lr, cfg.batch, cfg.seq, device, dtype,
                                precision=spec.precision or cfg.precision, seed=cfg.seed)
        row["init_fingerprint"] = weight_fingerprint(prep.model)
        du.barrier()
        row["build_s"] = time.perf_counter() - t0
        row["setup"] = prep.setup
        measured = run_steps(prep, warmup=cfg.warmup, steps=cfg.steps, seed=cfg.seed, batch=cfg.batch, seq=cfg.seq,
                             vocab_size=hf_config.vocab_size, device=device)
    except Exception as err:  # noqa: BLE001 - one failing variant must not lose the others' numbers
        if cfg.fail_fast:
            raise
        traceback.print_exc()
        return {**row, "status": "failed", "reason": f"{type(err).__name__}: {err}"}
    finally:
        if prep is not None and spec.kind == "engine":
            from workbench.moe.dispatch import close_dispatchers

            close_dispatchers(prep.model)  # collective: every rank leaves run_variant here
        del prep
        _free(device)
    coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    tokens = cfg.batch * cfg.seq
    median = measured["median_step_s"]
    row.update(measured)
    row.update({
        "status": "ok", "warmup": cfg.warmup, "steps": cfg.steps, "tokens_per_step_per_gpu": tokens,
        "loss": [c + coef * a for c, a in zip(measured["ce"], measured["aux"])],
        "tokens_per_s_per_gpu": tokens / median if median > 0 else 0.0,
        "tflops_per_gpu": tflops_per_gpu(hf_config, cfg.seq, tokens, median),
    })
    return row


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run every variant of `cfg` on this rank (collective: all ranks call it); the results dict.

    Rank 0 also prints the table and writes `<out_dir>/<name>.json` (+ `.html` when plotly is
    installed). Works under torchrun, inside workbench.Cluster engines, or in one plain process.
    """
    if not isinstance(cfg, BenchConfig):
        raise TypeError(f"run_bench needs a workbench.bench.BenchConfig, got {type(cfg).__name__}")
    from workbench.bench.report import build_result, format_table, write_result

    hf_config = cfg.hf_config()
    device = du.pick_device()  # before the group: nccl wants the rank's device set first
    created = _ensure_group()
    threads_before = None
    try:
        world, rank = du.world_size(), du.rank()
        threads_before = _set_cpu_threads(device, world)
        mesh = resolve_mesh(cfg, world, num_experts(hf_config))  # bad input fails before heavy work
        cfg.backend.resolve(device, world_size=mesh.ep)
        dtype = _dtype(cfg, device)
        started = time.time()
        needs_ckpt = any(VARIANTS[v].kind == "engine" for v in cfg.variants)
        tmp = _shared_tmpdir(os.environ.get("WORKBENCH_BENCH_TMP")) if needs_ckpt else None
        rows = []
        try:
            if tmp is not None:
                from workbench.bench.anchor import save_init_checkpoint

                save_init_checkpoint(hf_config, cfg.seed, device, dtype, tmp)
                _free(device)
            for name in cfg.variants:
                row = run_variant(name, cfg, hf_config, mesh, tmp, device, dtype)
                rows.append(row)
                if rank == 0:
                    status = row["status"] if row["status"] != "ok" else (
                        f"{row['tokens_per_s_per_gpu']:,.0f} tokens/s/gpu, {row['peak_mem_gib']:.2f} GiB peak")
                    print(f"bench: {name}: {status} {row.get('reason', '')}", flush=True)
        finally:
            du.barrier()
            if tmp is not None and rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        result = build_result(cfg, rows, hf_config=hf_config, world=world, device=device, mesh=mesh, dtype=dtype,
                              started=started, flops_per_token=flops_per_token(hf_config, cfg.seq))
        if rank == 0:
            print(format_table(result), flush=True)
            if cfg.out_dir is not None:
                paths = write_result(result, Path(cfg.out_dir), cfg.name, html=cfg.html)
                result["files"] = {k: str(v) for k, v in paths.items()}
                for kind, path in paths.items():
                    print(f"bench: wrote {kind} {path}", flush=True)
        return result
    finally:
        if threads_before is not None:  # a Cluster engine or notebook keeps its own setting
            torch.set_num_threads(threads_before)
        if created:
            du.shutdown(True)
