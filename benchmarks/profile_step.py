"""Where one engine training step spends its GPU time, on one GPU (issue 6 profiling).

    python benchmarks/profile_step.py --layers 8 --out $OUT/profile   # Qwen3-30B-A3B shapes, seq 4096 x 2

Writes <out>/profile-<tag>.json: step time (CUDA events, median of the profiled steps), the
engine's phase breakdown (workbench.train.profile.phase_breakdown) and the top kernels by device
time; plus a fused cross-entropy microbenchmark at the same shapes (torch path vs Triton path).
Random init, synthetic tokens: a measurement tool, not a test.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path


def ce_microbench(tokens: int, hidden: int, vocab: int) -> dict:
    """fused_linear_cross_entropy fwd+grads at the model's lm_head shape, both paths."""
    from workbench.kernels.cross_entropy import fused_linear_cross_entropy

    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(vocab, hidden, device="cuda")).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device="cuda")
    out = {
        "tokens": tokens,
        "hidden": hidden,
        "vocab": vocab,
        "matmul_floor_ms": 6 * tokens * hidden * vocab / 794e12 * 1e3,
    }
    for name, use_triton in (("torch", False), ("triton", True)):

        def step(use_triton=use_triton):
            fused_linear_cross_entropy(h, w, y, use_triton=use_triton).backward()

        step()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out[f"{name}_ms"] = cuda_event_ms(step, 5)
        out[f"{name}_extra_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        h.grad = w.grad = None
    return out


def adamw_microbench(numel: int = 1 << 28) -> dict:
    """One bf16 tensor (an expert weight's size), 14 bytes of traffic per element per step."""
    from workbench.train.optim import TritonAdamW

    out = {"numel": numel}
    for name, make in (
        ("triton", lambda ps: TritonAdamW(ps, lr=1e-4)),
        ("torch_fused", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
    ):
        p = torch.nn.Parameter(torch.randn(numel, device="cuda", dtype=torch.bfloat16))
        p.grad = torch.randn_like(p)
        opt = make([p])
        opt.step()
        ms = cuda_event_ms(opt.step, 10)
        out[f"{name}_ms"], out[f"{name}_tb_s"] = ms, 14 * numel / ms / 1e9
        del p, opt
        torch.cuda.empty_cache()
    return out


def adamw_in_model(train_step, params: list, configs: str) -> list[dict]:
    """TritonAdamW.step alone on the model's parameters and gradients, per kernel block/warps setting.

    Also the whole training step per setting: the optimizer's share of it is the kernel as the
    backward leaves the GPU, which "alone" separates from the kernel's speed on these tensors.
    Each setting gets its own optimizer (AdamWLaunch is a constructor parameter, not a global).
    """
    from workbench.kernels.adamw import AdamWLaunch
    from workbench.train.optim import TritonAdamW

    numel = sum(p.numel() for p in params)
    rows = []
    for item in configs.split(","):
        block, warps = (int(x) for x in item.split("x"))
        opt = TritonAdamW(params, lr=1e-5, launch=AdamWLaunch(block, warps))
        step = functools.partial(train_step, opt)
        step()  # compiles this configuration
        step_ms = cuda_event_ms(step, 3)
        for p in params:
            p.grad = torch.randn_like(p)
        alone = cuda_event_ms(opt.step, 5)
        rows.append(
            {
                "block": block,
                "warps": warps,
                "step_ms": step_ms,
                "alone_ms": alone,
                "alone_tb_s": 14 * numel / alone / 1e9,
            }
        )
        opt.zero_grad(set_to_none=True)
        opt.state.clear()  # this setting's moments go before the next setting's are made
        torch.cuda.empty_cache()
        print("adamw in model:", json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b", help="a workbench preset (workbench.config.PRESETS)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--gate", default="native")
    p.add_argument("--experts", default="auto")
    p.add_argument("--tag", default="engine")
    p.add_argument("--out", default="profile-out")
    p.add_argument("--no-ce-bench", action="store_true")
    p.add_argument("--anchor", action="store_true", help="profile the Transformers v5 anchor instead")
    p.add_argument(
        "--adamw-configs",
        default="",
        help="BLOCKxWARPS list (e.g. 4096x8,1024x4): time TritonAdamW.step alone on the model's tensors",
    )
    args = p.parse_args()

    import workbench
    from workbench.backends import BackendConfig
    from workbench.config import preset_config
    from workbench.train.profile import phase_breakdown

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"args": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    config = preset_config(args.preset, args.layers)
    if not args.no_ce_bench:
        result["ce_microbench"] = ce_microbench(args.batch * args.seq, config.hidden_size, config.vocab_size)
        print("ce:", json.dumps(result["ce_microbench"]), flush=True)
        result["adamw_microbench"] = adamw_microbench()
        print("adamw:", json.dumps(result["adamw_microbench"]), flush=True)
        torch.cuda.empty_cache()

    torch.manual_seed(0)
    t0 = time.perf_counter()
    if args.anchor:
        from workbench.bench.anchor import build_hf_model

        model = build_hf_model(config, 0, torch.device("cuda"), torch.bfloat16, "grouped_mm")
    else:
        backend = BackendConfig(experts=args.experts, gate=args.gate, fused_ce=True)
        with torch.device("cuda"):
            model = workbench.AutoModelForCausalLM.from_config(config, backend=backend, dtype=torch.bfloat16)
    model.to("cuda").train()
    result["build_s"] = time.perf_counter() - t0
    if args.anchor:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    else:
        from workbench.train.optim import TritonAdamW

        opt = TritonAdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")

    def train_step(optimizer):
        out = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
        out.loss.backward()
        with torch.profiler.record_function("workbench.optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def step():
        train_step(opt)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    result["step_ms"] = cuda_event_ms(step, 5)
    result["tokens_per_s"] = args.batch * args.seq / result["step_ms"] * 1e3
    result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(
        f"step {result['step_ms']:.1f} ms, {result['tokens_per_s']:,.0f} tokens/s, peak {result['peak_gib']:.1f} GiB",
        flush=True,
    )
    if args.adamw_configs and not args.anchor:
        result["adamw_in_model"] = adamw_in_model(
            train_step, [p for g in opt.param_groups for p in g["params"]], args.adamw_configs
        )
    steps = 2
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA], record_shapes=True
    ) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    result["phases_ms_per_step"] = phase_breakdown(prof.events(), "cuda", steps)
    kernels = {}
    for evt in prof.key_averages():
        if evt.device_time_total > 0 and str(evt.device_type).endswith("CUDA"):
            kernels[evt.key] = evt.device_time_total / 1e3 / steps
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
    result["top_kernels_ms_per_step"] = top
    result["kernel_total_ms_per_step"] = sum(kernels.values())
    for name, ms in top[:25]:
        print(f"{ms:8.2f} ms  {name[:110]}")
    # which aten ops (with shapes) the device time belongs to: finds the copies and casts
    ops = []
    for evt in prof.key_averages(group_by_input_shape=True):
        own = getattr(evt, "self_device_time_total", 0) or 0
        if own > 0 and evt.key.startswith("aten::"):
            ops.append((evt.key, str(evt.input_shapes)[:160], own / 1e3 / steps, evt.count // steps))
    result["top_aten_ops_ms_per_step"] = sorted(ops, key=lambda o: -o[2])[:40]
    for key, shapes, ms, calls in result["top_aten_ops_ms_per_step"][:20]:
        print(f"{ms:8.2f} ms x{calls:<4} {key} {shapes}")
    path = out_dir / f"profile-{args.tag}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print("wrote", path)


if __name__ == "__main__":
    main()
