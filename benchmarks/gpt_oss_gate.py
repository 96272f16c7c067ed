"""GPU microbench: GPT-OSS's expert activation, Transformers' ops vs the fused Triton kernels.

    python benchmarks/gpt_oss_gate.py OUT.json    (1 x H200, < 60 s)

gpt-oss-20b shapes at seq 4096 x 2, top-4: N = 32768 expert-major rows, 2I = 5760, H = 2880, 32
experts, bf16. Rows: (a) bias + Transformers' GptOssExperts._apply_gate vs the Triton gate; (b) the
down-projection bias (repeat_interleave add vs in-place Triton add); (c) the whole expert_rows
(GEMMs included) with swiglu='torch' vs 'triton'. Each: fwd+bwd ms (median of CUDA-event timings)
and the peak memory above the inputs; also the relative error of the Triton outputs and gradients
against the float32 torch reference (whole expert_rows: against the bf16 torch path).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path


def timed(fn, iters: int = 20, warmup: int = 3) -> tuple[float, float]:
    """Median ms of fn() and the peak GiB it allocates beyond what was live before."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = cuda_event_ms(fn, iters)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main(out_path: str) -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from workbench.kernels.gpt_oss_gate import add_row_bias, gpt_oss_gate, row_segments
    from workbench.models.families import family_for
    from workbench.moe.hf_experts import expert_rows, install_engine_experts

    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    T, K, E, H, I = 8192, 4, 32, 2880, 2880
    N = T * K
    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    module = GptOssExperts(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
        module.gate_up_proj_bias.normal_(0, 1.0)  # biases large enough that the clamp matters
    module = module.to(dev, dt)
    ids = torch.randint(0, E, (N,), device=dev)
    tpe = torch.bincount(ids, minlength=E)
    seg = row_segments(tpe, N)
    h = (4 * torch.randn(N, 2 * I, device=dev)).to(dt)  # beyond +-limit (7): clamps matter
    dy = torch.randn(N, I, device=dev, dtype=dt)
    results: dict = {"shapes": {"N": N, "2I": 2 * I, "H": H, "experts": E, "dtype": "bf16"}}

    def gate_step(kernel: str, fp32: bool = False):
        hh = h.detach().float().requires_grad_() if fp32 else h.detach().requires_grad_()
        bias = module.gate_up_proj_bias
        if fp32:  # the float32 reference: the error of each bf16 path against exact-ish math
            bias = bias.detach().float().requires_grad_()

        def step():
            hh.grad = None
            bias.grad = None
            if kernel == "hf":
                y = module._apply_gate(hh + torch.repeat_interleave(bias, tpe, dim=0, output_size=N))
            else:
                y = gpt_oss_gate(hh, bias, seg, module.alpha, module.limit, backend=kernel)
            y.backward(dy.to(y.dtype))
            return y, hh.grad, bias.grad

        return step

    ref = [t.detach() for t in gate_step("torch", fp32=True)()]
    for name in ("hf", "triton"):
        ms, gib = timed(gate_step(name))
        results[f"gate_{name}"] = {"fwd_bwd_ms": ms, "peak_gib": gib}
    got = gate_step("triton")()
    hf = gate_step("hf")()
    results["gate_triton"]["rel_err_vs_fp32"] = [rel(a, b) for a, b in zip(got, ref)]
    results["gate_hf"]["rel_err_vs_fp32"] = [rel(a, b) for a, b in zip(hf, ref)]

    y0 = torch.randn(N, H, device=dev, dtype=dt)
    dyh = torch.randn(N, H, device=dev, dtype=dt)

    def bias_step(kernel: str, fp32: bool = False):
        yy = y0.detach().float().requires_grad_() if fp32 else y0.detach().requires_grad_()
        bias = module.down_proj_bias.detach().float().requires_grad_() if fp32 else module.down_proj_bias

        def step():
            yy.grad = None
            bias.grad = None
            out = add_row_bias(yy * 1.0, bias, seg, backend=kernel)  # * 1.0: a GEMM output stand-in
            out.backward(dyh.to(out.dtype))
            return out, yy.grad, bias.grad

        return step

    ref = bias_step("torch", fp32=True)()
    bf16 = bias_step("torch")()
    results["down_bias_torch_rel_err_vs_fp32"] = [rel(a, b) for a, b in zip(bf16, ref)]
    for name in ("torch", "triton"):
        ms, gib = timed(bias_step(name))
        results[f"down_bias_{name}"] = {"fwd_bwd_ms": ms, "peak_gib": gib}
    got = bias_step("triton")()
    results["down_bias_triton"]["rel_err_vs_fp32"] = [rel(a, b) for a, b in zip(got, ref)]

    install_engine_experts(module, None, "grouped_mm", (0, E), E, swiglu="torch")
    x = torch.randn(N, H, device=dev, dtype=dt)
    dyx = torch.randn(N, H, device=dev, dtype=dt)

    def rows_step(kernel: str):
        xx = x.detach().requires_grad_()

        def step():
            # the rows of the module's plan with swiglu=kernel: GPT-OSS's fused gate (its family's rows) or torch's
            module.plan = dataclasses.replace(
                module.plan, swiglu=kernel, family_rows=family_for("gpt_oss").expert_rows(module, kernel)
            )
            xx.grad = None
            for p in module.parameters():
                p.grad = None
            y = expert_rows(module, xx, tpe)
            y.backward(dyx)
            return [y, xx.grad] + [p.grad for p in module.parameters()]

        return step

    ref = [t.detach().float() for t in rows_step("torch")()]
    for name in ("torch", "triton"):
        ms, gib = timed(rows_step(name), iters=10)
        results[f"expert_rows_{name}"] = {"fwd_bwd_ms": ms, "peak_gib": gib}
    got = rows_step("triton")()
    results["expert_rows_triton"]["rel_err_vs_torch_bf16"] = [rel(a, b) for a, b in zip(got, ref)]
    for key in ("gate", "expert_rows"):
        base = results[f"{key}_{'hf' if key == 'gate' else 'torch'}"]["fwd_bwd_ms"]
        results[f"{key}_speedup"] = base / results[f"{key}_triton"]["fwd_bwd_ms"]
    results["down_bias_speedup"] = results["down_bias_torch"]["fwd_bwd_ms"] / results["down_bias_triton"]["fwd_bwd_ms"]
    text = json.dumps(results, indent=1)
    print(text)
    with open(out_path, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/gpt_oss_gate.py OUT.json")
    main(sys.argv[1])
