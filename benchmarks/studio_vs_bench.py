"""Is the Studio's live tokens/s/GPU the bench's figure? (the goal: within 3% for the same config; a check, not a test)

    python benchmarks/studio_vs_bench.py --out $OUT/studio-vs-bench          # 1 x H200, ~3 minutes
    python benchmarks/studio_vs_bench.py --preset tiny --layers 2 --seq 64 --out /tmp/svb   # plumbing, on a CPU

Runs `workbench bench --variants engine` (the trainer's step, median of the timed steps), then the same
RunConfig (preset, layers, seq x batch, lr, seed, synthetic data, default backends and precision) on a
workbench.Cluster rank, as the Studio's Run button does, and reads what the Studio's summary strip shows:
`workbench.ui.summary.summarize_live(run.records, ...)` (median over its window of the latest steps).
Prints both and their ratio; writes them as JSON. The GPU machine needs ipyparallel and its Jupyter packages
(the package's lab extras: pip install -e '.[lab]').
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def bench_engine(args, out: Path) -> dict:
    """The bench's engine row for this shape (its own launch)."""
    cmd = [
        sys.executable, "-m", "workbench.bench", "--preset", args.preset, "--layers", str(args.layers), "--seq",
        str(args.seq), "--batch", str(args.batch), "--warmup", "2", "--steps", str(args.steps), "--rounds", "1",
        "--variants", "engine", "--no-html", "--out-dir", str(out), "--name", "studio-vs-bench",
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    result = json.loads((out / "studio-vs-bench.json").read_text())
    row = next(v for v in result["variants"] if v["name"] == "engine")
    return {"tokens_per_s_per_gpu": row["tokens_per_s_per_gpu"], "command": " ".join(cmd[1:])}


def studio_run(args, runs: Path) -> dict:
    """The same RunConfig on a Cluster rank; the Studio's summary of its records."""
    from workbench import Cluster
    from workbench.backends import BackendConfig
    from workbench.config import DataConfig, ModelConfig, RunConfig, TrainConfig
    from workbench.ui.summary import summarize_live

    steps = args.steps + 2
    rc = RunConfig(
        model=ModelConfig(preset=args.preset, layers=args.layers, dtype="bfloat16"),
        backend=BackendConfig(),  # the product's defaults, as the bench's engine row
        data=DataConfig(kind="synthetic", seq_len=args.seq),
        train=TrainConfig(
            steps=steps, global_batch_size=args.batch, local_batch_size=args.batch, lr=3e-4, seed=0,
            save_final_checkpoint=False,
        ),
        output_dir=str(runs),
        run_id="studio-vs-bench",
    )  # fmt: skip
    with Cluster(n=1) as cluster:
        run = cluster.finetune(rc)
        run.wait(timeout=args.timeout)
        summary = summarize_live(run.records, steps)
    return {"tokens_per_s_per_gpu": summary.tokens_per_s_per_gpu, "window": list(summary.window)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = bench_engine(args, out)
    studio = studio_run(args, Path(tempfile.mkdtemp(prefix="studio-vs-bench-")))
    ratio = studio["tokens_per_s_per_gpu"] / bench["tokens_per_s_per_gpu"]
    result = {"args": vars(args), "bench": bench, "studio": studio, "studio_over_bench": ratio}
    (out / "studio-vs-bench-summary.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"bench engine {bench['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU; Studio summary "
        f"{studio['tokens_per_s_per_gpu']:,.0f} (steps {studio['window']}); ratio {ratio:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
