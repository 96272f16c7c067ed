"""`workbench bench`: the Transformers v5 anchor and the engine, timed side by side in one launch."""

from workbench.bench.config import DEFAULT_VARIANTS, VARIANTS, BenchConfig


def run_bench(cfg: BenchConfig) -> dict:
    """Run every variant of `cfg` on this rank (collective over the process group); the results."""
    from workbench.bench.runner import run_bench as _run

    return _run(cfg)


__all__ = ["DEFAULT_VARIANTS", "VARIANTS", "BenchConfig", "run_bench"]
