"""The names of a run's files (config.json, status.json, metrics.jsonl, error.log) and how a reader names the
metrics lines it skipped: shared by the run's writer (run_dir) and its readers (run_index, run_summary)."""

from __future__ import annotations

CONFIG_FILE = "config.json"
STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
ERROR_LOG = "error.log"  # the tracebacks of failed ranks; the command line prints one line naming this file


def skipped_note(count: int, lines: list[int], file: str = METRICS_FILE) -> str:
    """'skipped 2 damaged lines in metrics.jsonl (lines 4, 9)': what a reader left out, for people."""
    plural = "s" if count != 1 else ""
    where = ""
    if lines:
        more = ", ..." if count > len(lines) else ""
        where = f" (line{'s' if len(lines) > 1 or more else ''} {', '.join(map(str, lines))}{more})"
    return f"skipped {count} damaged line{plural} in {file}{where}"
