"""Time the fused CE's softmax-gradient kernel over its launch knobs, and the in-place gradient scale.

    python benchmarks/ce_rows_kernel.py --out $OUT/ce_rows.json

The kernel reads each logits row twice (log-sum-exp, then the gradient over the logits); pass 2 walks a row forwards
or back (`reverse`: from the blocks pass 1 read last). On 2026-12-04 the rows shared among fewer programs were
timed too (a grid-stride loop, since removed: slower, results/2026-12-04-1xh200-ce-rows-kernel-v151936.json).
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path

from workbench.kernels.triton_cross_entropy import ce_rows_, scale_


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="ce_rows.json")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"device": torch.cuda.get_device_name(), "sms": sms, "vocab": args.vocab, "rows": {}}
    for rows in args.rows:
        gen = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(rows, args.vocab, device="cuda", generator=gen).to(torch.bfloat16)
        labels = torch.randint(0, args.vocab, (rows,), device="cuda", generator=gen)
        denom = torch.tensor(float(rows), device="cuda")
        gib = rows * args.vocab * 2 / 2**30
        case = {}
        for reverse in (False, True):
            ms = cuda_event_ms(partial(ce_rows_, logits, labels, denom, -100, True, reverse), args.reps)
            name = f"reverse={reverse}"
            case[name] = {"ms": ms, "hbm_tb_s_if_two_reads": 3 * gib * 2**30 / ms / 1e9}
            print(f"rows {rows}: {name}: {ms:.3f} ms", flush=True)
        results["rows"][str(rows)] = case
        del logits
    grad = torch.randn(args.vocab, args.hidden, device="cuda").to(torch.bfloat16)
    for value in (1.0, 2.5):
        scale = torch.tensor(value, device="cuda")
        ms = cuda_event_ms(partial(scale_, grad, scale), args.reps)
        results[f"scale_{value}_ms"] = ms
        print(f"scale_ by {value} of [{args.vocab}, {args.hidden}] bf16: {ms:.3f} ms", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
