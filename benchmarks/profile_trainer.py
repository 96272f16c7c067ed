"""Where the product's training step (Trainer.train_step) spends its time on one GPU, and where the GPU idles.

    python benchmarks/profile_trainer.py --layers 8 --precision bf16_sr,bf16 --out $OUT/prof

Per precision mode: the step time over `--steps` queued steps (CUDA events, no sync inside), the phase
records the trainer itself reports, then one profiled step: device time by kernel, the GPU's idle gaps
(largest first, with the kernel before and after each gap and the CPU op running when the gap began) and
a gzipped Chrome trace. Random init, synthetic tokens: a measurement tool, not a test.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def idle_gaps(prof, min_us: float = 20.0) -> dict:
    """GPU kernel intervals of one profiled window: busy time, idle gaps and what surrounds them.

    The device-side copies of record_function ranges (workbench.forward, Optimizer.step#...) span the gaps
    between kernels: counted as busy, they hid most of the idle time (32.9 ms where the trace's kernels,
    copies and memsets alone gave 102.4, 2026-12-01), so they are left out.
    """
    kernels, cpu_ops = [], []
    for evt in prof.events():
        annotation = getattr(evt, "is_user_annotation", False) or evt.name.startswith(("workbench.", "Optimizer."))
        if str(evt.device_type).endswith("CUDA") and evt.time_range.elapsed_us() > 0 and not annotation:
            kernels.append((evt.time_range.start, evt.time_range.end, evt.name))
        elif str(evt.device_type).endswith("CPU") and evt.name.startswith(
            ("aten::", "workbench.", "cuda", "Optimizer")
        ):
            cpu_ops.append((evt.time_range.start, evt.time_range.end, evt.name))
    kernels.sort()
    if not kernels:
        return {}
    busy, gaps, end = 0.0, [], kernels[0][0]
    prev_name = ""
    for start, stop, name in kernels:
        if start > end:
            gaps.append((start - end, end, prev_name, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev_name = stop, name
    wall = end - kernels[0][0]
    gaps.sort(reverse=True)

    def cpu_at(t: float) -> str:
        inner = [op for op in cpu_ops if op[0] <= t <= op[1]]
        return min(inner, key=lambda op: op[1] - op[0])[2] if inner else ""

    top = [
        {"gap_us": g, "after": a[:90], "before": b[:90], "cpu_op_at_gap_start": cpu_at(t)}
        for g, t, a, b in gaps[:25]
        if g >= min_us
    ]
    return {
        "wall_ms": wall / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": (wall - busy) / 1e3,
        "gaps_over_min": sum(1 for g in gaps if g[0] >= min_us),
        "top_gaps": top,
    }


def cuda_only_idle(trainer, step: int, steps: int = 3) -> dict:
    """The GPU's idle time over `steps` more steps, traced with CUDA activity only: no CPU op recording slows the host,
    so the gaps are the step's own (launch latency and host-bound stretches), not the profiler's."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step += 1
            trainer.train_step(step)
        torch.cuda.synchronize()
    trainer.collect(wait=True)
    tl = idle_gaps(prof)
    kernels = sum(1 for e in prof.events() if str(e.device_type).endswith("CUDA") and e.time_range.elapsed_us() > 0)
    out = {k: tl.get(k, 0.0) / steps for k in ("wall_ms", "busy_ms", "idle_ms")}
    out.update(kernels_per_step=kernels / steps, gaps_over_20us_per_step=tl.get("gaps_over_min", 0) / steps)
    out["top_gaps"] = [{k: g[k] for k in ("gap_us", "after", "before")} for g in tl.get("top_gaps", [])[:10]]
    return out


def profile_window(trainer, step: int, res: dict, out_dir: Path, precision: str) -> None:
    """Profile two more steps: phases, idle gaps, top kernels and CPU ops into `res`, a gzipped trace to `out_dir`."""
    from workbench.train.profile import phase_breakdown

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA], record_shapes=True
    ) as prof:
        for _ in range(2):
            step += 1
            trainer.train_step(step)
        torch.cuda.synchronize()
    trainer.collect(wait=True)
    res["phases_ms_per_step"] = phase_breakdown(prof.events(), "cuda", 2)
    res["gpu_timeline"] = idle_gaps(prof)
    kernels: dict[str, float] = {}
    for evt in prof.key_averages():
        if evt.device_time_total > 0 and str(evt.device_type).endswith("CUDA"):
            kernels[evt.key] = evt.device_time_total / 1e3 / 2
    res["top_kernels_ms_per_step"] = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
    res["kernel_total_ms_per_step"] = sum(kernels.values())
    ops = []
    for evt in prof.key_averages():
        if evt.key.startswith(("aten::", "workbench.", "cuda")) and evt.cpu_time_total > 0:
            ops.append((evt.key, evt.cpu_time_total / 1e3 / 2, evt.count // 2))
    res["top_cpu_ops_ms_per_step"] = sorted(ops, key=lambda o: -o[1])[:40]
    # which aten call (with its input shapes) launched the device time: names the generic elementwise kernels
    by_call = [
        (evt.key, str(evt.input_shapes)[:160], evt.self_device_time_total / 1e3 / 2, evt.count // 2)
        for evt in prof.key_averages(group_by_input_shape=True)
        if evt.key.startswith("aten::") and evt.self_device_time_total > 0
    ]
    res["top_aten_calls_device_ms_per_step"] = sorted(by_call, key=lambda o: -o[2])[:60]
    trace = out_dir / f"trace-{precision}.json"
    t0 = time.perf_counter()
    prof.export_chrome_trace(str(trace))
    res["trace_export_s"] = time.perf_counter() - t0
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    tl = res["gpu_timeline"]
    print(
        f"{precision}: wall {tl.get('wall_ms', 0):.1f} ms busy {tl.get('busy_ms', 0):.1f} "
        f"idle {tl.get('idle_ms', 0):.1f}"
    )
    for g in tl.get("top_gaps", [])[:12]:
        print(
            f"  gap {g['gap_us']:8.0f} us  cpu={g['cpu_op_at_gap_start'][:40]:40s} "
            f"after={g['after'][:50]} before={g['before'][:50]}"
        )
    for name, ms in res["top_kernels_ms_per_step"][:20]:
        print(f"  {ms:8.2f} ms  {name[:110]}")
    for name, shapes, ms, calls in res["top_aten_calls_device_ms_per_step"][:40]:
        print(f"  {ms:8.2f} ms  {calls:4d}x {name} {shapes[:120]}")


def profile_mode(args, precision: str, out_dir: Path) -> dict:
    """Build the trainer in this precision mode, time queued steps, profile one."""
    from workbench.backends import BackendConfig
    from workbench.config import DataConfig, LoraConfig, ModelConfig, RunConfig, TrainConfig
    from workbench.models.engine_state import engine_state
    from workbench.train.loop import Trainer

    runs = Path(tempfile.mkdtemp(prefix="prof-trainer-"))
    steps = args.warmup + args.steps + 2
    train = TrainConfig(
        steps=steps,
        global_batch_size=args.batch,
        local_batch_size=args.batch,
        lr=args.lr,
        seed=0,
        optimizer=args.optimizer,
        precision=precision,
        save_final_checkpoint=False,
        log_every=steps,
        activation_checkpointing=args.ac,
        gc_every=args.gc_every,
        cuda_graphs=args.cuda_graphs,
        optimizer_states=args.optimizer_states,
        optimizer_in_backward=args.in_backward,
        clip_grad_norm=None if args.in_backward else 1.0,  # the backward's updates cannot clip by the global norm
    )
    rc = RunConfig(
        model=ModelConfig(preset=args.preset, layers=args.layers, dtype="bfloat16"),
        # expert_wgrad, embedding and router only when asked: an A/B's older workbench/ may lack the field
        backend=BackendConfig(
            fused_ce=True,
            gate=args.gate,
            **({} if args.expert_wgrad == "auto" else {"expert_wgrad": args.expert_wgrad}),
            **({} if args.embedding == "auto" else {"embedding": args.embedding}),
            **({} if args.router == "auto" else {"router": args.router}),
            **({} if args.mixer == "auto" else {"mixer": args.mixer}),
        ),
        data=DataConfig(kind="synthetic", seq_len=args.seq),
        train=train,
        output_dir=str(runs),
        run_id=f"prof-{precision}",
        lora=LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_rank else None,
    )
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer = Trainer(rc)
    trainer.setup()
    if args.adamw_multi_numel is not None:  # TritonAdamW's multi-tensor launches (None: its default)
        trainer.optimizer.multi_tensor_numel = args.adamw_multi_numel
    if args.updates_one_stream and trainer.backward_updates is not None:  # the A/B of the update stream
        from workbench.train.backward_updates import BackwardUpdates

        trainer.backward_updates.remove()
        trainer.backward_updates = BackwardUpdates(trainer.optimizer, trainer._skip, side_stream=False)
    build_s = time.perf_counter() - t0
    if args.repeat_batch:  # benchmarks/lora_h200.py's setting: the same batch every step (the loss falls: memorized)
        serve, kept = trainer.stream.next_batch, []

        def same_batch(*where):
            if not kept:
                kept.append(serve(*where))
            return kept[0]

        trainer.stream.next_batch = same_batch
    step = 0
    pause = trainer.step_gc.__enter__()  # as fit() steps: Python's collector paused (train.gc_every)
    for _ in range(args.warmup):
        step += 1
        trainer.train_step(step)
    warm_records = trainer.collect(wait=True)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        step += 1
        trainer.train_step(step)
    stop.record()
    records = trainer.collect(wait=True)
    step_ms = start.elapsed_time(stop) / args.steps
    res = {
        "precision": precision,
        "optimizer": args.optimizer,
        "optimizer_states": args.optimizer_states,
        "in_backward": args.in_backward,
        "updates_one_stream": args.updates_one_stream,
        "sink_kernel_full": args.sink_kernel_full,
        "expert_wgrad": args.expert_wgrad,
        "embedding": args.embedding,
        "router": args.router,
        "build_s": build_s,
        "step_ms_queued": step_ms,
        "tokens_per_s": args.batch * args.seq / step_ms * 1e3,
        "records_median_ms": {
            k: 1e3 * statistics.median(r[k] for r in records)
            for k in ("step_time_s", "forward_s", "backward_s", "optimizer_s")
            if k in records[0]
        },
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,  # build included
        # a CUDA graph pool's replay memory counts as free to the allocator: added (train/stack_graphs.py)
        "graph_pool_hidden_gib": getattr(engine_state(trainer.model).stack_graphs, "pool_hidden_bytes", 0) / 2**30,
        "step_peak_gib": max(r.get("mem_peak_gib", 0.0) for r in records),
        "losses": [round(float(r["loss"]), 4) for r in warm_records + records],
        "optimizer_updates": dict(getattr(trainer.optimizer, "updates", {})),
        "cuda_graph_replays": getattr(engine_state(trainer.model).stack_graphs, "replays", None),
    }
    if args.idle:
        res["gpu_idle_cuda_only"] = cuda_only_idle(trainer, step)
        step += 3
    print(precision, json.dumps(res), flush=True)
    if not args.no_trace:
        profile_window(trainer, step, res, out_dir, precision)
    pause.__exit__(None, None, None)
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    shutil.rmtree(runs, ignore_errors=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--gate", default="native")
    p.add_argument("--expert-wgrad", default="auto", help="BackendConfig.expert_wgrad: auto, autograd or triton")
    p.add_argument("--embedding", default="auto", help="BackendConfig.embedding: auto, torch or triton")
    p.add_argument("--router", default="auto", help="BackendConfig.router: auto, torch or triton")
    p.add_argument("--mixer", default="auto", help="BackendConfig.mixer: auto, chunked, triton or transformers")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--precision", default="bf16_sr,bf16", help="comma-separated train.precision modes")
    p.add_argument("--optimizer-states", default="full", help="train.optimizer_states: full, or 8bit moments")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA on attention + experts at this rank (0: full)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing (train.activation_checkpointing)")
    p.add_argument(
        "--ce-chunk-mib",
        type=int,
        default=None,
        help="experiment: the fused CE's budget with a trained lm_head in MiB (cross_entropy.TRAINED_HEAD_CE_BYTES)",
    )
    p.add_argument("--no-trace", action="store_true", help="time the steps only: no profiled step")
    p.add_argument(
        "--idle", action="store_true", help="also the GPU's idle time a step, traced with CUDA activity only"
    )
    p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate")
    p.add_argument("--repeat-batch", action="store_true", help="train on the first batch every step (as lora_h200.py)")
    p.add_argument("--in-backward", action="store_true", help="train.optimizer_in_backward (no clipping)")
    p.add_argument("--updates-one-stream", action="store_true", help="in-backward updates on the backward's stream")
    p.add_argument(
        "--sink-kernel-full", default=None, help="experiment: GPT-OSS sink attention's kernel for full layers (cudnn)"
    )
    p.add_argument("--cuda-graphs", action="store_true", help="train.cuda_graphs: the decoder stack as CUDA graphs")
    p.add_argument(
        "--adamw-multi-numel", type=int, default=None, help="TritonAdamW: tensors up to this size share one launch"
    )
    p.add_argument("--gc-every", type=int, default=50, help="train.gc_every (0: Python's automatic collection)")
    p.add_argument("--out", default="profile-out")
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__, "modes": []}
    from unittest import mock

    from workbench.kernels import cross_entropy

    budget = args.ce_chunk_mib * 2**20 if args.ce_chunk_mib else cross_entropy.TRAINED_HEAD_CE_BYTES
    from workbench.models import attention_sinks

    kernels = dict(attention_sinks.CUDA_KERNEL, **({"full": args.sink_kernel_full} if args.sink_kernel_full else {}))
    for precision in args.precision.split(","):
        with (
            mock.patch.object(cross_entropy, "TRAINED_HEAD_CE_BYTES", budget),
            mock.patch.dict(attention_sinks.CUDA_KERNEL, kernels),
        ):
            result["modes"].append(profile_mode(args, precision, out_dir))
        (out_dir / "profile-trainer.json").write_text(json.dumps(result, indent=1, default=str))
    print("wrote", out_dir / "profile-trainer.json")


if __name__ == "__main__":
    main()
