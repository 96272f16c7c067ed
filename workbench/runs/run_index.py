"""Run summaries and plotted series for the lab: confined to one runs folder, metrics read incrementally.

`RunIndex` is per-server state. Each poll re-reads config.json and status.json (small; status must
never be stale), but reads only the bytes appended to each metrics.jsonl since the last poll, at
most `IndexLimits.max_bytes_per_poll` of them. For a summary (`list_runs`) it keeps the record
count, the last rank-0 values and a thinned series per sparkline key; for a run's plots
(`metrics`) it keeps each rank's records, only their `series_fields`, thinned evenly to at most
`IndexLimits.series_points` over the whole run, for the `series_runs` runs asked for last. A
metrics file that shrank or was replaced (another inode) is read again from the start.

A reader that asks once (`workbench runs`, a notebook) uses `one_off_index()`: its summaries read
status.json and only the last records of each metrics file (`IndexLimits.tail_bytes`, growing to
at most `max_tail_bytes`), so listing a folder with a 1 GB metrics file reads kilobytes. JSON files
(config.json, status.json) over `IndexLimits.max_json_bytes` are refused, not read, and a run's
label is cut to RUN_NAME_MAX_CHARS: one crafted file cannot make every poll of the runs list huge.
Lines that are not records (torn, garbled, over-long) are counted with their line numbers, and a
summary says so (`metrics_skipped`); a summary whose status.json is ahead of the last complete
metrics record takes step and loss from status.json (`progress_from`).

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

from workbench.runs.liveness import LIVE_STATES, checked_status
from workbench.runs.moe_health import HEALTH_KEYS
from workbench.runs.run_files import CONFIG_FILE, METRICS_FILE, STATUS_FILE, skipped_note
from workbench.runs.run_kind import run_kind
from workbench.runs.run_names import run_id_problem, shown_name
from workbench.runs.throughput import THROUGHPUT_WINDOW, StepThroughput

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
    *HEALTH_KEYS,  # [layers] lists of numbers each (workbench.runs.moe_health): the lab's MoE health view
)
# A held list field's longest length: a crafted file must not make the server hold a long list per point.
SERIES_LIST_MAX = 1024


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
    max_json_bytes: int = 2**20  # config.json / status.json larger than this are refused (a real one is a few kB)
    tail_bytes: int = 2**16  # a one-off summary reads this much of a metrics file's end first ...
    max_tail_bytes: int = 16 * 2**20  # ... and at most this much, looking for the last rank-0 record
    skipped_lines_kept: int = 8  # line numbers of skipped lines a reader names (it counts them all)

    def __post_init__(self) -> None:
        for name in (
            "spark_points",
            "max_bytes_per_poll",
            "max_line_bytes",
            "chunk_bytes",
            "series_points",
            "series_ranks",
            "series_runs",
            "max_json_bytes",
            "tail_bytes",
            "max_tail_bytes",
            "skipped_lines_kept",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 2:
                raise ValueError(f"IndexLimits.{name} must be an integer >= 2, got {value!r}")


def one_off_limits() -> IndexLimits:
    """Limits for a reader that asks once (the CLI, a notebook): every metrics byte in one read."""
    return IndexLimits(max_bytes_per_poll=2**62)


def one_off_index() -> RunIndex:
    """An index for a reader that asks once: summaries from status.json and the end of each metrics file."""
    return RunIndex(one_off_limits(), whole_metrics=False)


def summarize_run(path: str | os.PathLike) -> dict:
    """A JSON-able summary of one run directory (raises if it cannot be read): status.json and the end of
    its metrics file."""
    return one_off_index().summarize(Path(path).expanduser())


def list_runs(runs_dir: str | os.PathLike) -> list[dict]:
    """One summary per run subdirectory, newest id first; unreadable runs are flagged, not raised.

    Each reads status.json and the end of the metrics file, never the whole file."""
    return one_off_index().list_runs(Path(runs_dir).expanduser())


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


def read_json_confined(root: Path, path: Path, max_bytes: int | None = None) -> dict:
    """A JSON object file read through `open_confined`; one over `max_bytes` (if given) is refused unread."""
    with os.fdopen(open_confined(root, path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and max(size, len(data)) > max_bytes:
        raise ValueError(
            f"{path.name} is {max(size, len(data)):,} bytes, over the {max_bytes:,} a run's {path.name} may "
            "hold; not read (a workbench run writes a few kB)"
        )
    obj = json.loads(data.decode("utf-8"))
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
    except (json.JSONDecodeError, RecursionError):
        return None  # a writer crashed mid-line or is writing right now
    return obj if isinstance(obj, dict) else None


class Thinned:
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
        self.lines = 0  # complete lines read (the line number of the last one)
        self.skipped = 0  # complete lines that held no record: torn by a crash, garbled, over-long
        self.skipped_at: list[int] = []  # the first few of their line numbers

    def pending_bytes(self) -> int:
        """Bytes of the file not read yet (the per-poll bound stopped short)."""
        return max(self.size - self.offset, 0)

    def skip(self, kept: int) -> None:
        """The line just read holds no record: count it, and keep its number among the first `kept`."""
        self.skipped += 1
        if len(self.skipped_at) < kept:
            self.skipped_at.append(self.lines)

    def skipped_lines(self, ended: bool) -> tuple[int, list[int]]:
        """How many lines were skipped and the first line numbers; `ended`: the writer is gone, so an
        unfinished last line is torn too (while a run lives it is a line being written)."""
        torn = ended and not self.pending_bytes() and (self.skipping or bool(self.pending.strip()))
        count, at = self.skipped, list(self.skipped_at)
        if torn:
            count += 1
            if len(at) == self.skipped:  # every skipped line is named so far: name this one too
                at.append(self.lines + 1)
        return count, at

    def take(self, record: dict) -> None:
        raise NotImplementedError


class _SummaryTail(_MetricsTail):
    """What a run summary needs of one metrics file: record count, last rank-0 values, sparklines."""

    def __init__(self, ident: tuple[int, int], points: int) -> None:
        super().__init__(ident)
        self.records = 0
        self.last: dict = {}
        self.series = {key: Thinned(points) for key in SPARK_KEYS}
        self.throughput = StepThroughput()

    def held(self) -> int:
        return len(self.last) + sum(len(s.kept) for s in self.series.values())

    def take(self, record: dict) -> None:
        self.records += 1
        self.throughput.add(record)
        if record.get("rank", 0) != 0:
            return
        self.last = {k: record[k] for k in LAST_KEYS if k in record}
        for key, series in self.series.items():
            value = record.get(key)
            if isinstance(value, (int, float)):
                series.add(value)


class SeriesRecords:
    """What a run's plots need of its records: per rank, their plotted numbers, thinned evenly over the run."""

    def __init__(self, fields: tuple[str, ...], limits: IndexLimits) -> None:
        self.fields = fields
        self.limits = limits
        self.seen = 0  # records read, held or not
        self.ranks: dict[int, Thinned] = {}

    def held(self) -> int:
        return sum(len(s.kept) + 1 for s in self.ranks.values())

    def take(self, record: dict) -> None:
        self.seen += 1
        rank = record.get("rank", 0)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.limits.series_ranks:
            return
        # Numbers only, or the health fields' short lists of numbers: a crafted file must not make the server hold
        # a large value per point.
        kept = {k: v for k in self.fields if _is_number(v := record.get(k)) or (k in HEALTH_KEYS and _is_numbers(v))}
        series = self.ranks.get(rank)
        if series is None:
            series = self.ranks[rank] = Thinned(self.limits.series_points)
        series.add((self.seen, kept))

    def records(self) -> list[dict]:
        """The held records of every rank, in file order."""
        held = [point for series in self.ranks.values() for point in series.values()]
        return [record for _, record in sorted(held, key=lambda point: point[0])]


class _SeriesTail(SeriesRecords, _MetricsTail):
    """A plotted run's metrics file as the index reads it: how far, and its `SeriesRecords`."""

    def __init__(self, ident: tuple[int, int], fields: tuple[str, ...], limits: IndexLimits) -> None:
        _MetricsTail.__init__(self, ident)
        SeriesRecords.__init__(self, fields, limits)


class _ForwardTail(_MetricsTail):
    """A one-off read of a whole metrics file, every record handed to `take` (see `scan_metrics`)."""

    def __init__(self, ident: tuple[int, int], take: Callable[[dict], None]) -> None:
        super().__init__(ident)
        self.take = take  # type: ignore[method-assign]


class RunIndex:
    """Summaries of the runs in one folder, cached per metrics file between polls; thread-safe."""

    def __init__(
        self,
        limits: IndexLimits | None = None,
        series_fields: tuple[str, ...] = SERIES_FIELDS,
        whole_metrics: bool = True,
    ) -> None:
        """`whole_metrics` False: a summary reads only the end of each metrics file (`one_off_index`)."""
        self.limits = limits or IndexLimits()
        self.whole_metrics = whole_metrics
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
            if tail.skipped:
                answer["skipped"] = {
                    "lines": tail.skipped,
                    "at": tail.skipped_at,
                    "note": skipped_note(tail.skipped, tail.skipped_at),
                }
            return answer

    def scan_metrics(self, run_path: Path, take: Callable[[dict], None]) -> dict:
        """Every record of a run's metrics file handed to `take`, read in chunks (memory bounded by
        the longest line); returns {"lines", "skipped", "skipped_at", "bytes"} (skipped counts a torn
        last line when the run no longer lives)."""
        real = Path(run_path).expanduser().resolve()
        with self._lock:
            tail, _ = self._read_tail(real, real / METRICS_FILE, {}, lambda ident: _ForwardTail(ident, take))
            if tail is None:
                return {"lines": 0, "skipped": 0, "skipped_at": [], "bytes": 0}
            try:
                status = self._read_status(real, real / STATUS_FILE)
            except (OSError, ValueError):
                status = {}
            skipped, at = tail.skipped_lines(ended=status.get("state") not in LIVE_STATES)
            return {"lines": tail.lines, "skipped": skipped, "skipped_at": at, "bytes": tail.offset}

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
                    problem = run_id_problem(entry.name)
                    if problem:  # made by hand or by an older version: named, so it can be renamed
                        raise ValueError(f"{problem}; rename the folder to list and plot it")
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
        problem = run_id_problem(path.name)
        if problem:
            raise ValueError(f"{problem}; rename the folder to read it")
        root = path.parent.resolve()
        with self._lock:
            return self._summarize(root, confine(root, path), path)[0]

    def _summarize(self, root: Path, real: Path, shown: Path) -> tuple[dict, Path]:
        config_path, status_path = real / CONFIG_FILE, real / STATUS_FILE
        has_config, has_status = config_path.exists(), status_path.exists()
        if not has_config and not has_status:
            raise FileNotFoundError(f"{shown} is not a run directory (no {CONFIG_FILE} / {STATUS_FILE})")
        config = read_json_confined(root, config_path, self.limits.max_json_bytes) if has_config else {}
        status = self._read_status(root, status_path) if has_status else {"state": "unknown", "run_id": shown.name}
        metrics_path = real / METRICS_FILE
        if self.whole_metrics:
            tail, metrics_key = self._read_tail(root, metrics_path, self._tails, self._new_summary)
        else:
            tail, metrics_key = self._read_end(root, metrics_path), metrics_path
        model = config.get("model") or {}
        updated = status.get("updated_at")
        if updated is None:
            # lstat: the time of a link itself, never of what it points at.
            times = [p.lstat().st_mtime for p in real.iterdir()]
            updated = max(times) if times else None
        last = tail.last if tail else {}
        step, loss = last.get("step", status.get("step")), last.get("loss")
        status_step = status.get("step")
        # A crash can tear the last metrics line while status.json holds that step: take both from it.
        ahead = _is_int(status_step) and (not _is_int(last.get("step")) or status_step > last["step"])
        if ahead:
            losses = [status[k] for k in ("final_loss", "loss") if _is_number(status.get(k))]
            step, loss = status_step, (losses[0] if losses else None)
        summary = {
            "id": shown.name,
            "readable": True,
            "path": str(shown),
            "name": shown_name(config.get("name")),
            "model": (model.get("preset") or model.get("path")) if isinstance(model, dict) else str(model),
            "model_config": _describe(model),
            "mesh": _describe(_mesh_of(config)),
            "backends": _describe(config.get("resolved_backend") or config.get("backend")),
            "world_size": config.get("world_size"),
            "state": status.get("state", "unknown"),
            "error": status.get("error"),  # why a run failed or died, for the sidebar
            "status": status,
            "step": step,
            "total_steps": status.get("total_steps"),
            "loss": loss,
            # The run's one tokens/s figure (workbench.runs.throughput), and the steps it is the median of.
            "tokens_per_s_per_gpu": tail.throughput.value() if tail else None,
            "tokens_per_s_steps": tail.throughput.window_steps() if tail else [],
            "kind": run_kind(config),
            "updated_at": updated,
            "spark": {k: (tail.series[k].values() if tail else []) for k in SPARK_KEYS},
            # A one-off summary reads only the file's end: it does not know how many records there are.
            "metrics_records": (tail.records if tail else 0) if self.whole_metrics else None,
        }
        if ahead:
            summary["progress_from"] = STATUS_FILE
        if tail and tail.pending_bytes():
            # The per-poll bound stopped short: say so rather than show old values as current.
            summary["metrics_pending_bytes"] = tail.pending_bytes()
        if tail:
            skipped, at = tail.skipped_lines(ended=status.get("state") not in LIVE_STATES)
            if skipped:
                # A one-off summary counts in the end it read only, where line numbers are not known.
                at = at if self.whole_metrics else []
                summary["metrics_skipped"] = {"lines": skipped, "at": at, "note": skipped_note(skipped, at)}
        return summary, metrics_key

    def _read_end(self, root: Path, path: Path) -> _SummaryTail | None:
        """A summary tail of only the end of `path`: the last `tail_bytes`, read again four times as
        far back while it holds no rank-0 step record or too few steps for the run's tokens/s (the
        window's, one the cut may have torn and the one being written), up to `max_tail_bytes`."""
        try:
            fd = open_confined(root, path)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            window = self.limits.tail_bytes
            while True:
                start = max(st.st_size - window, 0)
                f.seek(start)
                data = f.read(st.st_size - start)
                self.bytes_read += len(data)
                tail = self._new_summary((st.st_dev, st.st_ino))
                tail.size = st.st_size
                if start > 0:
                    data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""  # the first line is cut
                tail.offset = st.st_size
                self._consume(tail, data)
                enough = "step" in tail.last and len(tail.throughput.steps) >= THROUGHPUT_WINDOW + 2
                if enough or start == 0 or window >= self.limits.max_tail_bytes:
                    return tail
                window = min(window * 4, self.limits.max_tail_bytes)

    def _read_status(self, root: Path, path: Path) -> dict:
        """status.json, read fresh on every poll: a cached state would hide a run that ended or died."""
        return checked_status(read_json_confined(root, path, self.limits.max_json_bytes))

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
        kept = self.limits.skipped_lines_kept
        for line in complete:
            tail.lines += 1
            if tail.skipping:
                tail.skipping = False  # the end of an over-long line: drop it
                tail.skip(kept)
                continue
            record = parse_record(line)
            if record is not None:
                tail.take(record)
            elif line.strip():
                tail.skip(kept)
        if len(tail.pending) > self.limits.max_line_bytes:
            tail.pending, tail.skipping = b"", True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_numbers(value: Any) -> bool:
    """A list of at most SERIES_LIST_MAX numbers."""
    return isinstance(value, list) and len(value) <= SERIES_LIST_MAX and all(_is_number(v) for v in value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
