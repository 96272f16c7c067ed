"""Host memory (RSS) per rank for a large text corpus through data.kind='datasets' (issue 17).

  python benchmarks/data_rss.py corpus /tmp/corpus 1.0     # ~1 GB parquet of random words
  python benchmarks/data_rss.py build /tmp/corpus          # rank 0: tokenize into the cache (peak RSS)
  torchrun --nproc-per-node 2 benchmarks/data_rss.py map /tmp/corpus   # every rank: map the cache, draw batches

Prints one JSON line per process: peak and current RSS in MiB, the corpus and cache sizes.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def _rss_mib() -> dict[str, float]:
    """Peak RSS, and the current RSS split into anonymous memory (the process's own) and file pages
    (memory-mapped cache files: shared page cache the kernel can drop, counted once per machine)."""
    out = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile"):
                out[f"{key}_mib"] = round(int(value.split()[0]) / 1024, 1)
    with open("/proc/self/smaps_rollup") as f:  # proportional: a page shared by n ranks counts 1/n here
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Pss_Anon", "Pss_File"):
                out[f"{key}_mib"] = round(int(value.split()[0]) / 1024, 1)
    return out


def _size_mib(path: Path) -> float:
    return round(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20, 1)


def corpus(folder: Path, gib: float) -> None:
    """Parquet files of random-word documents (~4 KB each), written a row group at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    words = np.array(["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9))) for _ in range(5000)])
    target, written, part = gib * 2**30, 0, 0
    while written < target:
        with pq.ParquetWriter(folder / f"part-{part:03d}.parquet", pa.schema([("text", pa.string())])) as w:
            for _ in range(16):
                docs = [" ".join(words[rng.integers(0, len(words), 700)]) for _ in range(4096)]
                written += sum(map(len, docs))
                w.write_table(pa.table({"text": docs}))
        part += 1
    print(json.dumps({"corpus_files": part, "corpus_mib": _size_mib(folder)}))


def _cfg(folder: Path):
    from workbench.config import DataConfig

    files = sorted(str(p) for p in folder.glob("*.parquet"))
    return DataConfig(kind="datasets", data_files=files, format="text", seq_len=1024, cache_dir=str(folder / "cache"))


def main() -> None:
    mode, folder = sys.argv[1], Path(sys.argv[2])
    if mode == "corpus":
        return corpus(folder, float(sys.argv[3]))
    from workbench.config import TINY_VOCAB_SIZE
    from workbench.parallel import dist_utils as du
    from workbench.train.data import build_stream

    created = du.init_from_env()
    base = _rss_mib()
    t0 = time.perf_counter()
    stream = build_stream(_cfg(folder), seed=0, vocab_size=TINY_VOCAB_SIZE)
    built = time.perf_counter() - t0
    tokens = 0
    for _ in range(2000):  # 2000 global batches of 8 x 1024 tokens, drawn from all over the shuffled cache
        tokens += stream.next_batch(8, du.rank() * 4, du.rank() * 4 + 4).input_ids.numel()
    print(
        json.dumps(
            {
                "mode": mode,
                "rank": du.rank(),
                "world": du.world_size(),
                "before": base,
                "after": _rss_mib(),
                "seconds": round(built, 1),
                "sequences": len(stream.sequences),
                "cache_mib": _size_mib(folder / "cache"),
                "tokens_drawn": tokens,
            }
        ),
        flush=True,
    )
    du.shutdown(created)


if __name__ == "__main__":
    main()
