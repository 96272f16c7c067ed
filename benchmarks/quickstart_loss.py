"""Does the quickstart's loss fall on the real architecture? (issue 18 item 13; a check, not a test)

    python benchmarks/quickstart_loss.py --out $OUT/quickstart-loss            # 1 x H200, ~2 minutes
    python benchmarks/quickstart_loss.py --preset tiny --seq 128 --out /tmp/q   # the same on a CPU

Runs `workbench finetune` with notebook 01's config for a big preset (the shipped SFT rows, fused
cross-entropy, lr 3e-4, no checkpoint) and prints the rank-0 loss per step against ln V, the loss of
a uniform guess, which uniform random tokens (the notebook's old data) can never go below.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from workbench.backends import BackendConfig
    from workbench.config import DataConfig, ModelConfig, RunConfig

    tiny = args.preset.startswith("tiny")
    config = RunConfig.demo(  # notebook 01's config cell, for one rank
        name=f"quickstart {args.preset}",
        model=ModelConfig(preset=args.preset, layers=None if tiny else args.layers),
        data=DataConfig(kind="jsonl", seq_len=args.seq),
        backend=BackendConfig(fused_ce=not tiny),
        train__steps=args.steps,
        train__local_batch_size=args.local_batch,
        train__global_batch_size=args.local_batch,
        train__lr=3e-3 if tiny else 3e-4,
        train__save_final_checkpoint=False,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config.to_yaml(out / "quickstart.yaml")
    cmd = [
        sys.executable,
        "-m",
        "workbench.cli",
        "finetune",
        str(out / "quickstart.yaml"),
        "--output-dir",
        str(out / "runs"),
        "--run-id",
        "quickstart",
    ]
    done = subprocess.run(cmd)
    if done.returncode != 0:
        return done.returncode
    records = [json.loads(line) for line in (out / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in sorted(records, key=lambda r: r["step"]) if r.get("rank", 0) == 0]
    ln_v = math.log(config.model.hf_config().vocab_size)
    print("loss per step:", " ".join(f"{v:.3f}" for v in losses))
    verdict = "falls below" if losses[-1] < ln_v else "does NOT fall below"
    print(f"ln V = {ln_v:.3f}; the loss goes {losses[0]:.3f} -> {losses[-1]:.3f}: it {verdict} ln V")
    (out / "quickstart-loss.json").write_text(json.dumps({"losses": losses, "ln_v": ln_v}))
    return 0 if losses[-1] < ln_v else 1


if __name__ == "__main__":
    sys.exit(main())
