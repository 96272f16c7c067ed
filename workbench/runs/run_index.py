"""Run summaries and plotted series for the lab: confined to one runs folder, metrics read incrementally.

`RunIndex` is per-server state. Each poll re-reads config.json and status.json (small; status must
never be stale), but reads only the bytes appended to each metrics.jsonl since the last poll, at
most `IndexLimits.max_bytes_per_poll` of them. For a summary (`list_runs`) it keeps the record
count, the last rank-0 values and a thinned series per sparkline key; for a run's plots
(`metrics`) it keeps each rank's records, only their `series_fields`, thinned evenly to at most
`IndexLimits.series_points` over the whole run, for the `series_runs` runs asked for last. A
metrics file that shrank or was replaced (another inode) is read again from the start.

Every file is read through `open_confined`: its real path (links resolved) must lie inside the
runs folder, and it must be a regular file, so a link in the runs folder never serves an outside
file and a FIFO never blocks the server.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.runs.liveness import checked_status
from workbench.runs.run_dir import CONFIG_FILE, METRICS_FILE, STATUS_FILE

SPARK_KEYS = ("tokens_per_s_per_gpu", "loss")
# The fields of the last rank-0 record a summary shows (a record may also hold large matrices).
LAST_KEYS = ("step", "loss", "tokens_per_s_per_gpu")
# The fields the lab's run view plots; a record's other fields (expert_load matrices) are not held.
SERIES_FIELDS = (
    "step",
    "rank",
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "mem_peak_gib",
    "mem_now_gib",
    "expert_load_cv",
    "step_time_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "time",
    "eval_loss",
    "eval_accuracy",
)


@dataclass(frozen=True)
class IndexLimits:
    """Bounds on one poll's work and on what the index keeps per run."""

    spark_points: int = 64
    max_bytes_per_poll: int = 32 * 2**20
    max_line_bytes: int = 8 * 2**20
    chunk_bytes: int = 2**20
    series_points: int = 1000  # records held per rank of a plotted run
    series_ranks: int = 256  # ranks held per plotted run; records of higher ranks are counted only
    series_runs: int = 8  # plotted runs held at once; the one asked for longest ago is dropped

    def __post_init__(self) -> None:
        for name in (
            "spark_points",
            "max_bytes_per_poll",
            "max_line_bytes",
            "chunk_bytes",
            "series_points",
            "series_ranks",
            "series_runs",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 2:
                raise ValueError(f"IndexLimits.{name} must be an integer >= 2, got {value!r}")


def one_off_limits() -> IndexLimits:
    """Limits for a reader that asks once (the CLI, a notebook): every metrics byte in one read."""
    return IndexLimits(max_bytes_per_poll=2**62)


def _describe(section: Any) -> Any:
    return section if isinstance(section, (dict, str)) or section is None else str(section)


def _mesh_of(config: dict) -> Any:
    """The mesh the run used: the trainer's resolved mesh, else the configured section or sizes."""
    if config.get("resolved_mesh"):
        return config["resolved_mesh"]
    if config.get("mesh"):
        return config["mesh"]
    sizes = {k: config[k] for k in ("dp", "ep", "tp", "pp") if isinstance(config.get(k), int)}
    return sizes or None


def confine(root: Path, path: Path) -> Path:
    """`path` with links resolved; PermissionError if that lies outside `root` (a resolved folder)."""
    real = Path(path).resolve()
    if not real.is_relative_to(root):
        raise PermissionError(f"{path} leads outside {root} (a link?); not followed")
    return real


def open_confined(root: Path, path: Path) -> int:
    """A read-only fd of the regular file `path`, which must resolve inside `root`."""
    real = confine(root, path)
    # O_NOFOLLOW: a link swapped in after the check is refused; O_NONBLOCK: a FIFO does not block.
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PermissionError(f"{path} is not a regular file; not read")
    return fd


def read_json_confined(root: Path, path: Path) -> dict:
    """A JSON object file read through `open_confined`."""
    with os.fdopen(open_confined(root, path), encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}, expected a JSON object")
    return obj


def parse_record(line: bytes) -> dict | None:
    """One metrics line as a dict, or None for a blank, torn or garbled line."""
    line = line.strip()
    if not line:
        return None
    try:
        obj = json.loads(line.decode("utf-8", errors="replace"))
    except json.JSONDecodeError:
        return None  # a writer crashed mid-line or is writing right now
    return obj if isinstance(obj, dict) else None


class _Thinned:
    """Every `stride`-th value of a series, at most 2 * points of them: even coverage, bounded."""

    def __init__(self, points: int) -> None:
        self.points = points
        self.stride = 1
        self.seen = 0
        self.kept: list[Any] = []
        self.last: Any = None

    def add(self, value: Any) -> None:
        if self.seen % self.stride == 0:
            self.kept.append(value)
            if len(self.kept) >= 2 * self.points:
                self.kept = self.kept[::2]
                self.stride *= 2
        self.seen += 1
        self.last = value

    def values(self) -> list[Any]:
        """At most `points` values spread over the whole series, ending with the latest."""
        if self.seen <= self.points:
            return list(self.kept)
        step = len(self.kept) / self.points
        return [self.kept[int(i * step)] for i in range(self.points - 1)] + [self.last]


class _MetricsTail:
    """How far the index has read one metrics file; a subclass says what it keeps of each record."""

    def __init__(self, ident: tuple[int, int]) -> None:
        self.ident = ident
        self.offset = 0
        self.size = 0
        self.pending = b""  # the start of a line whose newline has not been written yet
        self.skipping = False  # inside a line longer than max_line_bytes

    def pending_bytes(self) -> int:
        """Bytes of the file not read yet (the per-poll bound stopped short)."""
        return max(self.size - self.offset, 0)

    def take(self, record: dict) -> None:
        raise NotImplementedError


class _SummaryTail(_MetricsTail):
    """What a run summary needs of one metrics file: record count, last rank-0 values, sparklines."""

    def __init__(self, ident: tuple[int, int], points: int) -> None:
        super().__init__(ident)
        self.records = 0
        self.last: dict = {}
        self.series = {key: _Thinned(points) for key in SPARK_KEYS}

    def held(self) -> int:
        return len(self.last) + sum(len(s.kept) for s in self.series.values())

    def take(self, record: dict) -> None:
        self.records += 1
        if record.get("rank", 0) != 0:
            return
        self.last = {k: record[k] for k in LAST_KEYS if k in record}
        for key, series in self.series.items():
            value = record.get(key)
            if isinstance(value, (int, float)):
                series.add(value)


class _SeriesTail(_MetricsTail):
    """What a run's plots need of one metrics file: per rank, its records' plotted numbers, thinned."""

    def __init__(self, ident: tuple[int, int], fields: tuple[str, ...], limits: IndexLimits) -> None:
        super().__init__(ident)
        self.fields = fields
        self.limits = limits
        self.seen = 0  # records read, held or not
        self.ranks: dict[int, _Thinned] = {}

    def held(self) -> int:
        return sum(len(s.kept) + 1 for s in self.ranks.values())

    def take(self, record: dict) -> None:
        self.seen += 1
        rank = record.get("rank", 0)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.limits.series_ranks:
            return
        # Numbers only: a crafted file must not make the server hold a large value per point.
        kept = {k: v for k in self.fields if isinstance(v := record.get(k), (int, float)) and not isinstance(v, bool)}
        series = self.ranks.get(rank)
        if series is None:
            series = self.ranks[rank] = _Thinned(self.limits.series_points)
        series.add((self.seen, kept))

    def records(self) -> list[dict]:
        """The held records of every rank, in file order."""
        held = [point for series in self.ranks.values() for point in series.values()]
        return [record for _, record in sorted(held, key=lambda point: point[0])]


class RunIndex:
    """Summaries of the runs in one folder, cached per metrics file between polls; thread-safe."""

    def __init__(self, limits: IndexLimits | None = None, series_fields: tuple[str, ...] = SERIES_FIELDS) -> None:
        self.limits = limits or IndexLimits()
        # step and rank are always held: the plots' x axis and their grouping.
        self.series_fields = tuple(dict.fromkeys(("step", "rank", *series_fields)))
        self.bytes_read = 0  # metrics bytes read since the index was made, for tests and logs
        self._tails: dict[Path, _SummaryTail] = {}
        self._series: dict[Path, _SeriesTail] = {}  # least recently asked for first
        self._lock = threading.Lock()

    def held_values(self) -> int:
        """How many summary values the index holds over all runs (bounded by the limits)."""
        return sum(t.held() for t in self._tails.values())

    def held_records(self) -> int:
        """How many plotted records the index holds over all runs (bounded by the limits)."""
        return sum(t.held() for t in self._series.values())

    def metrics(self, root: Path, path: Path) -> dict:
        """The held records of metrics file `path` (inside the resolved `root`), read up to date.

        `records` holds every rank's records, only `series_fields`, thinned evenly over the whole
        run; `records_seen` counts the records read; `pending_bytes` is there while the per-poll
        bound left part of the file unread.
        """
        with self._lock:
            tail, key = self._read_tail(root, path, self._series, self._new_series)
            if tail is None:
                return {"records": [], "records_seen": 0}
            self._series[key] = self._series.pop(key)  # now the most recently asked for
            while len(self._series) > self.limits.series_runs:
                del self._series[next(iter(self._series))]
            answer = {"records": tail.records(), "records_seen": tail.seen}
            if tail.pending_bytes():
                answer["pending_bytes"] = tail.pending_bytes()
            return answer

    def _new_summary(self, ident: tuple[int, int]) -> _SummaryTail:
        return _SummaryTail(ident, self.limits.spark_points)

    def _new_series(self, ident: tuple[int, int]) -> _SeriesTail:
        return _SeriesTail(ident, self.series_fields, self.limits)

    def list_runs(self, runs_dir: Path) -> list[dict]:
        """One summary per run folder of `runs_dir`, newest id first; unreadable ones are flagged."""
        root = Path(runs_dir).expanduser().resolve()
        with self._lock:
            if not root.is_dir():
                self._tails = {}
                return []
            summaries, seen = [], set()
            for entry in sorted(root.iterdir(), key=lambda p: p.name, reverse=True):
                if entry.name.startswith("."):
                    continue
                try:
                    real = confine(root, entry)
                    if not real.is_dir():
                        continue
                    summary, metrics = self._summarize(root, real, Path(runs_dir) / entry.name)
                    seen.add(metrics)
                    summaries.append(summary)
                except (OSError, ValueError, TypeError, AttributeError) as err:
                    summaries.append(
                        {
                            "id": entry.name,
                            "readable": False,
                            "path": str(Path(runs_dir) / entry.name),
                            "error": f"{type(err).__name__}: {err}",
                        }
                    )
            # Forget runs that were deleted so the cache does not grow with every run ever seen.
            self._tails = {p: t for p, t in self._tails.items() if p in seen}
            return summaries

    def summarize(self, path: Path) -> dict:
        """The summary of one run folder (raises if it cannot be read), confined to its parent."""
        root = path.parent.resolve()
        with self._lock:
            return self._summarize(root, confine(root, path), path)[0]

    def _summarize(self, root: Path, real: Path, shown: Path) -> tuple[dict, Path]:
        config_path, status_path = real / CONFIG_FILE, real / STATUS_FILE
        has_config, has_status = config_path.exists(), status_path.exists()
        if not has_config and not has_status:
            raise FileNotFoundError(f"{shown} is not a run directory (no {CONFIG_FILE} / {STATUS_FILE})")
        config = read_json_confined(root, config_path) if has_config else {}
        status = self._read_status(root, status_path) if has_status else {"state": "unknown", "run_id": shown.name}
        metrics_path = real / METRICS_FILE
        tail, metrics_key = self._read_tail(root, metrics_path, self._tails, self._new_summary)
        model = config.get("model") or {}
        updated = status.get("updated_at")
        if updated is None:
            # lstat: the time of a link itself, never of what it points at.
            times = [p.lstat().st_mtime for p in real.iterdir()]
            updated = max(times) if times else None
        summary = {
            "id": shown.name,
            "readable": True,
            "path": str(shown),
            "name": config.get("name") if isinstance(config.get("name"), str) else None,
            "model": (model.get("preset") or model.get("path")) if isinstance(model, dict) else str(model),
            "model_config": _describe(model),
            "mesh": _describe(_mesh_of(config)),
            "backends": _describe(config.get("resolved_backend") or config.get("backend")),
            "world_size": config.get("world_size"),
            "state": status.get("state", "unknown"),
            "error": status.get("error"),  # why a run failed or died, for the sidebar
            "status": status,
            "step": tail.last.get("step", status.get("step")) if tail else status.get("step"),
            "total_steps": status.get("total_steps"),
            "loss": tail.last.get("loss") if tail else None,
            "tokens_per_s_per_gpu": tail.last.get("tokens_per_s_per_gpu") if tail else None,
            "updated_at": updated,
            "spark": {k: (tail.series[k].values() if tail else []) for k in SPARK_KEYS},
            "metrics_records": tail.records if tail else 0,
        }
        if tail and tail.pending_bytes():
            # The per-poll bound stopped short: say so rather than show old values as current.
            summary["metrics_pending_bytes"] = tail.pending_bytes()
        return summary, metrics_key

    def _read_status(self, root: Path, path: Path) -> dict:
        """status.json, read fresh on every poll: a cached state would hide a run that ended or died."""
        return checked_status(read_json_confined(root, path))

    def _read_tail(
        self, root: Path, path: Path, cache: dict[Path, Any], make: Callable[[tuple[int, int]], Any]
    ) -> tuple[Any, Path]:
        """The tail of `path` in `cache` (`make` one if new), brought up to date from its new bytes."""
        try:
            fd = open_confined(root, path)
        except FileNotFoundError:
            return None, path
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            key = confine(root, path)
            tail = cache.get(key)
            ident = (st.st_dev, st.st_ino)
            if tail is None or tail.ident != ident or st.st_size < tail.offset:
                tail = cache[key] = make(ident)  # new, replaced or truncated
            tail.size = st.st_size
            budget = min(st.st_size - tail.offset, self.limits.max_bytes_per_poll)
            f.seek(tail.offset)
            while budget > 0:
                chunk = f.read(min(self.limits.chunk_bytes, budget))
                if not chunk:
                    break
                budget -= len(chunk)
                tail.offset += len(chunk)
                self.bytes_read += len(chunk)
                self._consume(tail, chunk)
        return tail, key

    def _consume(self, tail: _MetricsTail, chunk: bytes) -> None:
        # The piece after the last newline is a line still being written: keep it for later.
        *complete, tail.pending = (tail.pending + chunk).split(b"\n")
        for line in complete:
            if tail.skipping:
                tail.skipping = False  # the end of an over-long line: drop it
                continue
            record = parse_record(line)
            if record is not None:
                tail.take(record)
        if len(tail.pending) > self.limits.max_line_bytes:
            tail.pending, tail.skipping = b"", True
