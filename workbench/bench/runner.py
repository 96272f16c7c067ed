"""`run_bench(BenchConfig) -> dict`: every variant in one launch, on the same weights and tokens."""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workbench.backends import BackendError
from workbench.bench.anchor import CUDNN_REASON, attention_refusal, save_init_checkpoint
from workbench.bench.config import VARIANTS, BenchConfig, VariantSpec
from workbench.bench.gpu_clocks import merge as merge_clocks
from workbench.bench.liger import liger_refusal
from workbench.bench.report import build_result, format_table, write_result
from workbench.bench.timing import combine_rounds, round_orders, split_steps
from workbench.bench.trainer_run import train_round
from workbench.bench.variant_backend import variant_backend
from workbench.parallel import dist_utils as du
from workbench.parallel.launch import free_port
from workbench.parallel.mesh import MeshConfig
from workbench.train.metrics import flops_per_token, tflops_per_gpu
from workbench.train.model_setup import model_dtype, resolve_mesh


def _ensure_group() -> bool:
    """One process without a group gets a 1-rank group (the engine's mesh build needs one)."""
    if du.initialized():
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return du.init_from_env()
    port = free_port()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return True


def bench_mesh(cfg: BenchConfig, world: int, hf_config):
    """The engine variants' mesh: the trainer's rule (train/model_setup.resolve_mesh), dp=ep=1 for one rank."""
    return resolve_mesh(cfg.mesh, world, hf_config) or MeshConfig(dp=1, ep=1)


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


def _skip_reason(spec: VariantSpec, cfg: BenchConfig, hf_config, mesh, device: torch.device) -> str | None:
    """Why a variant cannot run here (recorded as skipped, never built); None when it can."""
    if spec.needs_cuda and device.type != "cuda":
        return spec.cuda_reason or CUDNN_REASON
    if spec.kind == "anchor":
        refused = attention_refusal(hf_config, spec.attn_implementation)
        if refused is not None:  # e.g. GPT-OSS and sdpa: recorded, not built
            return refused
        if spec.liger:
            return liger_refusal(hf_config)
    if spec.kind == "engine" and spec.backend:
        try:
            variant_backend(spec, cfg.backend).resolve(device, world_size=mesh.ep)
        except BackendError as err:  # an extra that is not installed here is a skip, not a failure
            return str(err)
    return None


def _row(name: str, spec: VariantSpec) -> dict[str, Any]:
    return {
        "name": name,
        "kind": spec.kind,
        "help": spec.help,
        "gate": spec.gate if spec.kind == "engine" else "native",
    }


def _finish(row: dict[str, Any], rounds: list[list[dict]], cfg: BenchConfig, hf_config, world: int) -> dict[str, Any]:
    """A variant's ok row from its records of every round."""
    measured = combine_rounds(rounds, cfg.warmup, world)
    tokens = cfg.batch * cfg.seq * cfg.accumulation
    row.update(measured)

    def tps(seconds: float) -> float:
        return tokens / seconds if seconds > 0 else 0.0

    row.update(
        {
            "status": "ok",
            "warmup": cfg.warmup,
            "steps": len(measured["step_time_s"]),
            "rounds": len(rounds),
            "tokens_per_step_per_gpu": tokens,
            "tokens_per_s_per_gpu": tps(measured["median_step_s"]),
            # p10 of the throughput is the p90 of the step time (the slow end), and the other way round
            "tokens_per_s_per_gpu_p10": tps(measured["p90_step_s"]),
            "tokens_per_s_per_gpu_p90": tps(measured["p10_step_s"]),
            "tflops_per_gpu": tflops_per_gpu(hf_config, cfg.seq, tokens, measured["median_step_s"]),
        }
    )
    return row


def run_variants(
    cfg: BenchConfig, hf_config, mesh, tmp: Path, device: torch.device, dtype: torch.dtype, world: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every variant in alternating rounds (ABC CBA ...); the rows (in cfg.variants order) and the run order."""
    rows = {name: _row(name, VARIANTS[name]) for name in cfg.variants}
    for name, row in rows.items():
        reason = _skip_reason(VARIANTS[name], cfg, hf_config, mesh, device)
        if reason is not None:
            row.update(status="skipped", reason=reason)
    records: dict[str, list[list[dict]]] = {name: [] for name in cfg.variants}
    clocks: dict[str, list[dict | None]] = {name: [] for name in cfg.variants}
    order: list[str] = []
    for r, (names, n) in enumerate(zip(round_orders(cfg.variants, cfg.rounds), split_steps(cfg.steps, cfg.rounds))):
        for name in names:
            row = rows[name]
            if "status" in row:  # skipped, or failed in an earlier round
                continue
            order.append(name)
            out = None
            try:
                out = train_round(
                    name,
                    VARIANTS[name],
                    cfg,
                    hf_config,
                    checkpoint=tmp / "init",
                    runs_dir=tmp / "runs",
                    world=world,
                    device=device,
                    dtype=dtype,
                    timed_steps=n,
                    round_index=r,
                    fingerprint=r == 0,
                )
            except Exception as err:  # noqa: BLE001 - one failing variant must not lose the others' numbers
                if cfg.fail_fast:
                    raise
                traceback.print_exc()
                row.update(status="failed", reason=f"{type(err).__name__}: {err}", failed_round=r)
            _free(device)  # here, not in a handler: a live traceback would keep the failed variant's tensors
            if out is None:
                continue
            if r == 0:
                row.update(init_fingerprint=out["init_fingerprint"], build_s=out["build_s"], setup=out["setup"])
            records[name].append(out["records"])
            clocks[name].append(out.get("gpu_clocks"))
            if out.get("gpu_clocks_unavailable"):
                row["gpu_clocks_unavailable"] = out["gpu_clocks_unavailable"]
            if du.rank() == 0:
                # This rank's median step of the round, before the table: a launch cut short keeps it in the log
                steps_s = [float(rec["step_time_s"]) for rec in out["records"][cfg.warmup :]]
                median = statistics.median(steps_s) if steps_s else float("nan")
                print(
                    f"bench: round {r + 1}/{cfg.rounds} {name}: {n} timed steps, median step {1e3 * median:.1f} ms "
                    f"(this rank), build {out.get('build_s', float('nan')):.1f} s",
                    flush=True,
                )
    for name, row in rows.items():
        if "status" not in row:
            _finish(row, records[name], cfg, hf_config, world)
            row["gpu_clocks"] = merge_clocks(clocks[name])  # this rank's GPU over the variant's timed steps
            if row["gpu_clocks"] and "energy_j" in row["gpu_clocks"] and row["steps"]:
                row["gpu_clocks"]["energy_j_per_step"] = row["gpu_clocks"]["energy_j"] / row["steps"]
    return [rows[name] for name in cfg.variants], order


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run every variant of `cfg` on this rank (collective: all ranks call it); the results dict.

    Rank 0 also prints the table and writes `<out_dir>/<name>.json` (+ `.html` when plotly is
    installed). Works under torchrun, inside workbench.Cluster engines, or in one plain process.
    """
    if not isinstance(cfg, BenchConfig):
        raise TypeError(f"run_bench needs a workbench.bench.BenchConfig, got {type(cfg).__name__}")

    hf_config = cfg.hf_config()
    device = du.pick_device()  # before the group: nccl wants the rank's device set first
    created = _ensure_group()
    threads_before = None
    try:
        world, rank = du.world_size(), du.rank()
        threads_before = _set_cpu_threads(device, world)
        mesh = bench_mesh(cfg, world, hf_config)  # bad input fails before heavy work
        cfg.backend.resolve(device, world_size=mesh.ep)
        dtype = model_dtype(cfg, device)
        started = time.time()
        # The shared initial checkpoint (engine variants) and the Trainer's run directories
        tmp = _shared_tmpdir(os.environ.get("WORKBENCH_BENCH_TMP"))
        try:
            if any(VARIANTS[v].kind == "engine" for v in cfg.variants):
                save_init_checkpoint(hf_config, cfg.seed, device, dtype, tmp / "init")
                _free(device)
            rows, order = run_variants(cfg, hf_config, mesh, tmp, device, dtype, world)
            if rank == 0:
                for row in rows:
                    status = (
                        row["status"]
                        if row["status"] != "ok"
                        else (
                            f"{row['tokens_per_s_per_gpu']:,.0f} tokens/s/gpu "
                            f"(p10-p90 {row['tokens_per_s_per_gpu_p10']:,.0f}"
                            f"-{row['tokens_per_s_per_gpu_p90']:,.0f}), {row['peak_mem_gib']:.2f} GiB peak"
                        )
                    )
                    print(f"bench: {row['name']}: {status} {row.get('reason', '')}", flush=True)
        finally:
            du.barrier()
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        result = build_result(
            cfg,
            rows,
            hf_config=hf_config,
            world=world,
            device=device,
            mesh=mesh,
            dtype=dtype,
            started=started,
            flops_per_token=flops_per_token(hf_config, cfg.seq),
            order=order,
        )
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
