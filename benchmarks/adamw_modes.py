"""What each precision mode of the Triton AdamW costs over the model's tensors, and what its rounding costs.

    python benchmarks/adamw_modes.py --layers 8 --out $OUT/adamw-modes.json

TritonAdamW.step over the Qwen3-30B-A3B parameter shapes at --layers (bf16, random grads, the clip
coefficient and the skip flag set as the trainer sets them) for precision bf16 / bf16_sr / fp32_master,
torch's fused AdamW as the reference, and two kernel probes on the same bytes: stochastic rounding from
one hash per element (instead of one per stored tensor) and round-to-nearest without the IEEE-rounded
square root and divisions (how far the kernel is from the memory bound). TB/s counts 14 bytes per element
(28 for fp32_master). A measurement tool, not a test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from adamw_sweep import model_shapes  # benchmarks/ is this script's folder, first on sys.path
from cuda_timing import cuda_event_ms

from workbench.kernels.triton_adamw import _mix32


@triton.jit
def _probe_kernel(
    P,
    G,
    M,
    V,
    COEF,
    n,
    beta1,
    omb1,
    beta2,
    omb2,
    lr_wd,
    eps,
    step_size,
    bc2_sqrt,
    key,
    ONE_HASH: tl.constexpr,
    FAST_MATH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(COEF + offs * 0)
    m = tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
    p = p - lr_wd * p
    m = beta1 * m + omb1 * g
    v = beta2 * v + omb2 * g * g
    if FAST_MATH:
        denom = tl.sqrt(v) * (1.0 / bc2_sqrt) + eps
        p = p - step_size * m / denom
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
    if ONE_HASH:
        hi = _mix32((offs >> 32).to(tl.uint32) ^ key.to(tl.uint32))
        bits = _mix32((offs & 0xFFFFFFFF).to(tl.uint32) ^ hi)
        bits_v = bits * tl.full(bits.shape, 0x9E3779B1, tl.uint32)
        up = p.to(tl.uint32, bitcast=True)
        p = ((up + (bits & 0xFFFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        um = m.to(tl.uint32, bitcast=True)
        m = ((um + (bits >> 16)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        uv = v.to(tl.uint32, bitcast=True)
        v = ((uv + (bits_v >> 16)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(P + offs, p.to(tl.bfloat16), mask=mask)
    tl.store(M + offs, m.to(tl.bfloat16), mask=mask)
    tl.store(V + offs, v.to(tl.bfloat16), mask=mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default="adamw-modes.json")
    args = ap.parse_args()
    from workbench.train.optim import set_grad_coef, set_skip_flag
    from workbench.train.triton_adamw_optimizer import TritonAdamW

    shapes = model_shapes(args.layers)
    numel = sum(torch.Size(s).numel() for s in shapes)
    params = [torch.nn.Parameter(0.02 * torch.randn(s, device="cuda", dtype=torch.bfloat16)) for s in shapes]
    for p in params:
        p.grad = 1e-3 * torch.randn_like(p)
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers": args.layers,
        "tensors": len(shapes),
        "elements": numel,
        "rows": [],
    }
    coef = torch.ones((), device="cuda")
    skip = torch.zeros((), device="cuda")
    for precision in ("bf16", "bf16_sr", "fp32_master"):
        opt = TritonAdamW(params, lr=1e-5, precision=precision)
        set_skip_flag(opt, skip)
        set_grad_coef(opt, coef)
        opt.step()
        ms = cuda_event_ms(opt.step, 10)
        bytes_per = 28 if precision == "fp32_master" else 14
        row = {"what": f"TritonAdamW {precision}", "ms": ms, "tb_s": bytes_per * numel / ms / 1e9}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        del opt
        torch.cuda.empty_cache()
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    opt.step()
    ms = cuda_event_ms(opt.step, 10)
    out["rows"].append({"what": "torch fused AdamW bf16", "ms": ms, "tb_s": 14 * numel / ms / 1e9})
    print(json.dumps(out["rows"][-1]), flush=True)
    del opt
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for one_hash, fast in ((False, False), (True, False), (False, True), (True, True)):
        for block, warps in ((1024, 4), (2048, 8)):

            def step(one_hash=one_hash, fast=fast, block=block, warps=warps):
                for p, (m, v) in zip(params, states):
                    n = p.numel()
                    _probe_kernel[(triton.cdiv(n, block),)](
                        p,
                        p.grad,
                        m,
                        v,
                        coef,
                        n,
                        0.9,
                        0.1,
                        0.999,
                        0.001,
                        1e-7,
                        1e-8,
                        1e-5,
                        0.5,
                        12345,
                        ONE_HASH=one_hash,
                        FAST_MATH=fast,
                        BLOCK=block,
                        num_warps=warps,
                        enable_fp_fusion=False,
                    )

            step()
            ms = cuda_event_ms(step, 10)
            row = {
                "what": f"probe one_hash={one_hash} fast_math={fast} block={block} warps={warps}",
                "ms": ms,
                "tb_s": 14 * numel / ms / 1e9,
            }
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
