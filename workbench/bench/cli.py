"""`workbench bench`: arguments and launch modes (plain process, torchrun, or --ranks N spawned)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from workbench.backends import CHOICES, BackendConfig, BackendError
from workbench.bench.config import DEFAULT_VARIANTS, VARIANTS, BenchConfig
from workbench.bench.plot import write_html
from workbench.bench.readme import history_table, table, write_readme
from workbench.config import PRECISIONS, ConfigError
from workbench.parallel.launch import run_in_launched_group, spawn
from workbench.parallel.mesh import MeshConfig


def _runner():
    """workbench.bench.runner, imported when variants are run: it imports the trainer and Transformers, which
    `workbench bench --help`, --readme-table and --html never need."""
    import workbench.bench.runner as runner

    return runner


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench subcommand's flags."""
    p.add_argument(
        "--preset",
        default="tiny",
        help="model preset (workbench.presets: tiny, qwen3-30b-a3b, "
        "gpt-oss-20b, moonlight-16b-a3b, mixtral-8x7b, olmoe-1b-7b and their tiny-* twins)",
    )
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--batch", type=int, default=2, help="local batch: sequences per rank per micro-batch")
    p.add_argument(
        "--accumulation",
        type=int,
        default=1,
        help="micro-batches per optimizer step (tokens/s counts them all; the optimizer runs once per step)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed trainer steps first, in every round")
    p.add_argument("--steps", type=int, default=30, help="timed trainer steps per variant, split over the rounds")
    p.add_argument(
        "--rounds",
        type=int,
        help="rounds: variants in order, then reversed, ... (ABC CBA ...); "
        "each round builds every variant afresh (default: 2, or 1 with --steps 1)",
    )
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma list from {list(VARIANTS)} (default: %(default)s)",
    )
    p.add_argument("--dp", type=int, help="engine mesh data-parallel size (default: world size)")
    p.add_argument("--ep", type=int, help="engine mesh expert-parallel size (default: world size if it divides E)")
    for field, choices in CHOICES.items():
        if field != "gate":
            p.add_argument(
                f"--{field.replace('_', '-')}", choices=choices, default="auto", help=f"engine {field} backend"
            )
    fused_ce = p.add_mutually_exclusive_group()
    fused_ce.add_argument(
        "--fused-ce",
        dest="fused_ce",
        action="store_const",
        const=True,
        default="auto",
        help="engine: fused linear cross-entropy, refused for a model that cannot take it (the default, 'auto', "
        "has it on wherever the model allows)",
    )
    fused_ce.add_argument(
        "--no-fused-ce",
        dest="fused_ce",
        action="store_const",
        const=False,
        help="engine: the loss from full [tokens, vocab] logits (an ablation; the engine_no_fused_ce row times it "
        "beside the default in one launch)",
    )
    p.add_argument(
        "--expert-recompute",
        action="store_true",
        help="engine: recompute expert MLPs in backward (less activation memory)",
    )
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument(
        "--precision",
        default="auto",
        choices=PRECISIONS,
        help="engine AdamW precision (train.precision) where the variant sets none; "
        "engine_bf16 / engine_bf16_sr / engine_fp32_master time each mode",
    )
    p.add_argument(
        "--out-dir",
        help="results directory (default: <runs>/bench, <runs> being "
        "$WORKBENCH_RUNS_DIR or ~/moe-workbench/runs; '' writes nothing; the repository's "
        "published results: benchmarks/results)",
    )
    p.add_argument("--name", help="results file stem (default: <date>-<device>)")
    p.add_argument("--no-html", action="store_true", help="skip the HTML plot")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing variant")
    p.add_argument("--ranks", type=int, help="spawn this many local ranks (GPUs, else gloo CPU ranks)")
    p.add_argument(
        "--readme-table",
        action="store_true",
        help="print the README performance table (the latest launch per setup) from --results-dir (no benchmark runs)",
    )
    p.add_argument(
        "--history-table",
        action="store_true",
        help="print the dated history table (benchmarks/HISTORY.md) from --results-dir instead",
    )
    p.add_argument(
        "--write",
        metavar="FILE",
        help="with --readme-table / --history-table: replace the table "
        "between <!-- bench-table --> and <!-- /bench-table --> in this file",
    )
    p.add_argument("--results-dir", default="benchmarks/results", help="where --readme-table reads")
    p.add_argument("--include-cpu", action="store_true", help="with --readme-table: keep CPU runs")
    p.add_argument("--html", metavar="RESULT_JSON", help="(re)write the HTML plot of a results file and exit")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="time the throughputs the run plan divides by on this device (workbench/bench/calibrate.py) and save "
        "them for `workbench plan` (no benchmark runs)",
    )
    p.add_argument(
        "--out", metavar="FILE", help="with --calibrate: the JSON to write (default: ~/.cache/workbench/calibration/)"
    )


def config_from_args(args: argparse.Namespace):
    """BenchConfig from parsed flags (ConfigError/MeshError/BackendError on bad input)."""
    mesh = None
    if args.dp is not None or args.ep is not None:
        world = args.dp or args.ranks or int(os.environ.get("WORLD_SIZE", "1"))
        mesh = MeshConfig(dp=world, ep=args.ep or 1)
    backend = BackendConfig(
        **{f: getattr(args, f) for f in CHOICES if f != "gate"},
        fused_ce=args.fused_ce,
        expert_recompute=args.expert_recompute,
    )
    launcher = "torchrun " if "TORCHELASTIC_RUN_ID" in os.environ else ""
    command = launcher + "workbench bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
    out = {} if args.out_dir is None else {"out_dir": args.out_dir or None}
    return BenchConfig(
        preset=args.preset,
        layers=args.layers,
        seq=args.seq,
        batch=args.batch,
        accumulation=args.accumulation,
        warmup=args.warmup,
        steps=args.steps,
        rounds=args.rounds,
        lr=args.lr,
        seed=args.seed,
        variants=args.variants,
        mesh=mesh,
        backend=backend,
        dtype=args.dtype,
        precision=args.precision,
        name=args.name,
        command=command.strip(),
        html=not args.no_html,
        fail_fast=args.fail_fast,
        **out,
    )


def _bench_rank(cfg_dict: dict) -> None:
    """What each spawned bench rank runs."""
    _runner().run_bench(BenchConfig.from_dict(cfg_dict))


def launch(cfg, ranks: int) -> int:
    """Run `cfg` on `ranks` spawned local processes; 0 when every rank succeeded."""
    import torch

    if torch.cuda.is_available() and ranks > torch.cuda.device_count():
        raise ConfigError(f"--ranks {ranks} but only {torch.cuda.device_count()} GPU(s) are visible")
    if cfg.mesh is not None:  # the ranks' own check (bench_mesh), before any rank is spawned
        _runner().bench_mesh(cfg, ranks, cfg.hf_config())

    return spawn("workbench.bench.cli:_bench_rank", cfg.to_dict(), ranks, "bench")


def run(args: argparse.Namespace) -> int:
    """Entry of `workbench bench`."""
    if args.readme_table or args.history_table:
        history = args.history_table
        try:
            text = (
                write_readme(Path(args.write), Path(args.results_dir), args.include_cpu, history=history)
                if args.write
                else (history_table if history else table)(Path(args.results_dir), args.include_cpu)
            )
        except (OSError, ValueError) as err:
            print(f"workbench bench --readme-table: {err}", file=sys.stderr)
            return 2
        print(text)
        return 0
    if args.calibrate:  # workbench.bench.calibrate imports the kernels: only when asked for
        import workbench.bench.calibrate as calibration

        return calibration.run(args.out)
    if args.html:
        path = Path(args.html)
        written = write_html(json.loads(path.read_text(encoding="utf-8")), path.with_suffix(".html"))
        if written is None:
            return 1
        print(f"wrote {written}")
        return 0
    try:
        cfg = config_from_args(args)
        if args.ranks is not None and args.ranks < 1:
            raise ConfigError(f"--ranks must be >= 1, got {args.ranks}")
    except (ConfigError, BackendError, ValueError) as err:
        print(f"workbench bench: {err}", file=sys.stderr)
        return 2
    if args.ranks and args.ranks > 1 and "WORLD_SIZE" not in os.environ:
        try:
            return launch(cfg, args.ranks)
        except ConfigError as err:
            print(f"workbench bench: {err}", file=sys.stderr)
            return 2
    return _run_here(cfg)


def _run_here(cfg) -> int:
    """This process is one rank (torchrun) or the whole run (one process)."""
    runner = _runner()
    return run_in_launched_group(lambda: runner.run_bench(cfg), "bench", (ConfigError,))


def main(argv: list[str] | None = None) -> int:
    """`python -m workbench.bench ...`: the bench without the workbench CLI around it."""
    parser = argparse.ArgumentParser(prog="workbench bench", description="Transformers v5 anchor vs the engine")
    add_arguments(parser)
    return run(parser.parse_args(argv))
