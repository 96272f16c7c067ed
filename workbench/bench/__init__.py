"""`workbench bench`: the Transformers v5 anchor and the engine, timed side by side in one launch.

run_bench is in workbench.bench.runner, BenchConfig and the variants in workbench.bench.config.
"""
