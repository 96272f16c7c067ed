"""The cluster's errors: `ClusterError`, `RankError`, and the text of a rank's remote traceback."""

from __future__ import annotations

import re


class ClusterError(RuntimeError):
    """The cluster could not start, attach, or reach its engines."""


class RankError(RuntimeError):
    """A rank failed: `rank`, its remote `traceback`, and `errors` for every failed rank."""

    def __init__(self, rank: int, traceback: str, errors: dict[int, str] | None = None) -> None:
        self.rank = rank
        self.traceback = traceback
        self.errors = dict(errors or {rank: traceback})
        others = sorted(set(self.errors) - {rank})
        also = f" (ranks {others} failed too; see .errors)" if others else ""
        super().__init__(f"rank {rank} failed{also}:\n{traceback}")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def describe_remote_error(err: BaseException) -> str:
    """The remote traceback text of an ipyparallel error (or a local description)."""
    ename, evalue = getattr(err, "ename", None), getattr(err, "evalue", None)
    if ename == "RankFailure" and isinstance(evalue, str):
        # Our engine wrapper carries the plain traceback; drop its "rank N failed:" header.
        return evalue.split("\n", 1)[1] if evalue.startswith("rank ") else evalue
    tb = getattr(err, "traceback", None)
    if isinstance(tb, str) and tb:
        return _ANSI.sub("", tb)
    if ename:
        return f"{ename}: {evalue}"
    return f"{type(err).__name__}: {err}"
