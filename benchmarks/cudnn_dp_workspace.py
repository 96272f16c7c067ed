"""cuDNN SDPA backward with and without its dP workspace (CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT), Qwen3's shapes.

    python benchmarks/cudnn_dp_workspace.py --out $OUT/cudnn_dp.json

cudnn-frontend builds the backward with a float32 dQ accumulator (atomics, then a conversion kernel) unless the
dP tensor (b * h * s_q * s_kv * 2 bytes, padded to 64) fits its workspace limit, 256 MB by default; the limit is an
environment variable read when the graph is built. Each setting runs in its own process (torch caches the graph per
shape) and times forward + backward of torch's cuDNN attention; the gradients of each setting are compared with
the default's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, os, sys, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, "benchmarks")
from cuda_timing import cuda_event_ms
b, h, kv, s, d, reps, save = (int(a) for a in sys.argv[1:8])
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(b, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
k = torch.randn(b, kv, s, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
v = torch.randn(b, kv, s, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
do = torch.randn(b, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16)
def fwd():
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
def step():
    out = fwd()
    return torch.autograd.grad(out, (q, k, v), do)
grads = step()
torch.cuda.synchronize()
fwd_ms = cuda_event_ms(lambda: fwd(), reps)
out = fwd()
def bwd():
    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
bwd_ms = cuda_event_ms(bwd, reps)
peak = torch.cuda.max_memory_allocated() / 2**30
if save:
    torch.save([t.cpu() for t in grads], sys.argv[8])
print(json.dumps({"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "peak_gib": peak}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="2,32,4,4096,128;1,32,4,16384,128")
    p.add_argument("--limits", default="default,4294967296,34359738368")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="cudnn_dp.json")
    args = p.parse_args()
    import torch

    results = []
    for shape in args.shapes.split(";"):
        grads_by_limit = {}
        for limit in args.limits.split(","):
            env = dict(os.environ)
            env.pop("CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT", None)
            if limit != "default":
                env["CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT"] = limit
            path = f"/tmp/cudnn_dp_grads_{limit}.pt"
            cmd = [sys.executable, "-c", CHILD, *shape.split(","), str(args.reps), "1", path]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            row = {"shape": shape, "limit": limit}
            if proc.returncode:
                row["error"] = proc.stderr[-800:]
            else:
                row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                grads_by_limit[limit] = torch.load(path)
                base = grads_by_limit.get("default")
                if base is not None and limit != "default":
                    row["max_abs_diff_vs_default"] = [
                        float((a.float() - c.float()).abs().max()) for a, c in zip(grads_by_limit[limit], base)
                    ]
            print(json.dumps(row), flush=True)
            results.append(row)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
