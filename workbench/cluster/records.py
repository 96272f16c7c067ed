"""The notebook's one in-memory store of a run's step records, and the gap reader of metrics.jsonl.

The store holds each (rank, step) record once, without its [layers][experts] expert-load matrix;
matrices are held only for the plots' latest step (the newest step every rank has one for) and
newer steps, since metrics.jsonl keeps the full history. A gap in the stream is filled by
reading metrics.jsonl backward from its end, only as far as the missing records lie.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

from workbench.runs.run_index import parse_record

LOAD_KEY = "expert_load"


class RecordStore:
    """Step records by (rank, step), each once; expert-load matrices of the latest complete step only."""

    def __init__(self, world_size: int | None = None) -> None:
        self.world_size = world_size  # None: complete means every rank seen so far
        self._records: dict[tuple[int, int], dict] = {}
        self._loads: dict[int, dict[int, list]] = {}  # step -> rank -> matrix
        self._counts: dict[int, int] = {}
        self._sources: dict[str, int] = {}
        self._lock = threading.RLock()

    def add(self, records: list[dict], source: str) -> list[dict]:
        """Keep the records not held yet; returns them (with a matrix where held), by (step, rank)."""
        new = []
        with self._lock:
            for record in records:
                if "rank" not in record or "step" not in record:
                    continue
                key = (int(record["rank"]), int(record["step"]))
                if key in self._records:
                    continue
                self._records[key] = {k: v for k, v in record.items() if k != LOAD_KEY}
                self._counts[key[0]] = self._counts.get(key[0], 0) + 1
                if record.get(LOAD_KEY):
                    self._loads.setdefault(key[1], {})[key[0]] = record[LOAD_KEY]
                new.append(key)
            self._prune_loads()
            self._sources[source] = self._sources.get(source, 0) + len(new)
            return [self._with_load(k) for k in sorted(new, key=lambda k: (k[1], k[0]))]

    def _ranks(self) -> set[int]:
        if self.world_size is not None:
            return set(range(self.world_size))
        return set(self._counts)

    def _prune_loads(self) -> None:
        ranks = self._ranks()
        complete = [s for s, by_rank in self._loads.items() if set(by_rank) >= ranks]
        if complete:
            latest = max(complete)
            for step in [s for s in self._loads if s < latest]:
                del self._loads[step]

    def _with_load(self, key: tuple[int, int]) -> dict:
        load = self._loads.get(key[1], {}).get(key[0])
        record = self._records[key]
        return {**record, LOAD_KEY: load} if load is not None else record

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._records

    def count(self, rank: int) -> int:
        """How many records of `rank` are held."""
        with self._lock:
            return self._counts.get(rank, 0)

    def records(self) -> list[dict]:
        """Every held record ordered by (step, rank); matrices only on the steps still held."""
        with self._lock:
            return [self._with_load(k) for k in sorted(self._records, key=lambda k: (k[1], k[0]))]

    def last_step(self) -> int | None:
        with self._lock:
            return max((s for _, s in self._records), default=None)

    def held_loads(self) -> int:
        """How many expert-load matrices are held (bounded: about one step's worth per rank)."""
        with self._lock:
            return sum(len(by_rank) for by_rank in self._loads.values())

    @property
    def sources(self) -> dict[str, int]:
        with self._lock:
            return dict(self._sources)


class GapFiller:
    """Reads into a store the published records it lacks, from the end of metrics.jsonl."""

    def __init__(self, store: RecordStore, metrics_path: str | os.PathLike) -> None:
        self.store = store
        self.metrics_path = metrics_path
        self._unfilled_at: int | None = None  # file size at the last scan that found too few

    def fill(self, published: dict[int, int]) -> list[dict]:
        """Add the missing records of each rank (published[rank] records were sent); returns them."""
        missing = {r: n - self.store.count(r) for r, n in published.items() if n > self.store.count(r)}
        if not missing:
            return []
        try:
            size = os.stat(self.metrics_path).st_size
        except OSError:
            return []
        if size == self._unfilled_at:
            return []  # scanned already: the records were not written (yet)
        found: list[dict] = []
        for record in records_from_end(self.metrics_path):
            rank, step = record.get("rank"), record.get("step")
            if rank in missing and isinstance(step, int) and (rank, step) not in self.store:
                found.append(record)
                missing[rank] -= 1
                if missing[rank] <= 0:
                    del missing[rank]
                    if not missing:
                        break
        self._unfilled_at = size if missing else None
        return self.store.add(found[::-1], "disk")


def records_from_end(path: str | os.PathLike, chunk_bytes: int = 2**20) -> Iterator[dict]:
    """The complete records of a metrics.jsonl, last first, read backward in chunks.

    A line still being written (no newline yet) and a garbled line are skipped. The caller stops
    iterating once it has what it needs, so a gap costs about the bytes written since it began.
    """
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        pos = f.seek(0, os.SEEK_END)
        head = b""  # the start of the earliest line read so far, cut by the chunk boundary
        at_end = True  # still inside the last line, which has no newline while it is being written
        while pos > 0:
            start = max(0, pos - chunk_bytes)
            f.seek(start)
            lines = (f.read(pos - start) + head).split(b"\n")
            pos = start
            if at_end:
                if len(lines) == 1:  # no newline yet: all of it belongs to the unfinished line
                    head = b""
                    continue
                lines.pop()
                at_end = False
            head = lines.pop(0) if start > 0 else b""
            for line in reversed(lines):
                record = parse_record(line)
                if record is not None:
                    yield record
