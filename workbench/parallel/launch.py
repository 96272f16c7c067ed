"""Spawn N local ranks (one per GPU, or gloo CPU ranks) that each run one function.

The demo and the bench both launch this way; torchrun and the cluster engines are the other ways
in. Every rank leaves with os._exit: gloo can abort at interpreter exit after sub-groups were used
(seen in this project's runs), and a clean barrier + destroy_process_group + _exit avoided it in 30 of 30 runs.
"""

from __future__ import annotations

import importlib
import multiprocessing.util
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` ("" for every interface of this host) right now, for MASTER_PORT.

    Self-contained (it imports what it uses): the cluster ships it by value to an engine on another host.
    """
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _rank_main(rank: int, world: int, port: int, target: str, payload: Any, label: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    code = 0
    try:
        if world > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(rank)
            dist.init_process_group(backend, rank=rank, world_size=world)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        _resolve(target)(payload)
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
    except SystemExit as done:  # the target said why it stopped (report_rank_failure) and names the exit code
        code = done.code if isinstance(done.code, int) and done.code else 1
    except BaseException:  # noqa: BLE001 - print this rank's traceback, exit non-zero
        print(f"[rank {rank}] {label} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit skips multiprocessing's exit hooks: without them the named semaphores made in
    # this rank (tqdm's lock, taken while `datasets` loads files) are never unlinked and the
    # parent's resource tracker warns "leaked semaphore objects". Run the hooks' first stage.
    multiprocessing.util._run_finalizers(0)
    os._exit(code)


# How long a rank that does not print a configuration error waits before it exits: torchrun stops
# every rank as soon as one exits, so a printing rank that is still checking when a silent one
# leaves is killed before it prints and the user sees no message at all.
_SILENT_RANK_GRACE_S = 10.0


def report_config_error(label: str, err: BaseException) -> None:
    """Print a configuration error as one line, from the first rank of each host only.

    Every rank reads the same config and so fails the same way; one line per host (local rank 0,
    i.e. rank 0 on one machine) keeps a launcher's output readable and still shows an error that
    only another host's files cause. The other ranks wait (up to `_SILENT_RANK_GRACE_S`) so that
    the printing rank exits first: torchrun then stops them (SIGTERM, answered with exit code 2,
    as if they had left by themselves) and names the printing rank as the root cause.
    """
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"workbench {label}: {err}", file=sys.stderr, flush=True)
        return
    try:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    except ValueError:  # not the main thread: keep the default SIGTERM
        pass
    time.sleep(_SILENT_RANK_GRACE_S)


def report_rank_failure(
    err: BaseException,
    label: str,
    refused: tuple[type[BaseException], ...] | Callable[[BaseException], bool] = (),
    *,
    debug: bool = False,
    traceback_to: Callable[[str], str | None] | None = None,
    rank: int = 0,
) -> int:
    """Say why this rank failed, from inside the `except` that caught `err`; the exit code: 2 for a refusal (one line,
    see `report_config_error`), else 1 with one line naming where `traceback_to(traceback)` put the traceback (None:
    nowhere, and the line says --debug prints it). The traceback goes to stderr with `debug`, or where there is no
    `traceback_to` (a caller without a place for it)."""
    text = traceback.format_exc()
    if debug:
        print(text, file=sys.stderr, end="", flush=True)
    if isinstance(err, refused) if isinstance(refused, tuple) else refused(err):
        report_config_error(label, err)
        return 2
    where = traceback_to(text) if traceback_to is not None else None
    if debug:
        hint = ""
    elif where:
        hint = f" (traceback in {where})"
    elif traceback_to is not None:
        hint = " (--debug prints its traceback)"
    else:  # a caller with no place for it
        print(text, file=sys.stderr, end="", flush=True)
        hint = ""
    print(f"workbench {label} (rank {rank}): {type(err).__name__}: {err}{hint}", file=sys.stderr, flush=True)
    return 1


def run_in_launched_group(
    fn: Callable[[], None],
    label: str,
    refused: tuple[type[BaseException], ...] | Callable[[BaseException], bool] = (),
    *,
    debug: bool = False,
    traceback_to: Callable[[str], str | None] | None = None,
) -> int:
    """Run `fn` as one rank of the group a launcher (torchrun) described in the environment.

    Returns 0; else the code `report_rank_failure` gives `fn`'s error (`refused`: the error classes, or a test of
    the error, that make it a refusal). A rank of a multi-rank group never returns: it leaves with os._exit.
    """
    from workbench.parallel import dist_utils as du  # torch: the CLI imports this module for `workbench --help`

    created = du.init_from_env()
    multi = du.world_size() > 1
    code = 0
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - report cleanly, exit non-zero
        code = report_rank_failure(err, label, refused, debug=debug, traceback_to=traceback_to, rank=du.rank())
    if multi:
        if code == 0:
            du.shutdown(created)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


@dataclass(frozen=True)
class RankExit:
    """How one spawned rank ended: its exit code, negative for the signal that killed it."""

    rank: int
    exit_code: int

    @property
    def signal_name(self) -> str | None:
        if self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return f"signal {-self.exit_code}"

    def describe(self) -> str:
        if self.signal_name:
            return f"rank {self.rank} was killed by {self.signal_name}"
        return f"rank {self.rank} exited with code {self.exit_code}"


# Grace for the other ranks to fail on their own (and record why) before they are terminated.
FAILURE_GRACE_S = 5.0


def _failed_ranks(ctx: Any, first: int) -> list[RankExit]:
    """Every rank that ended non-zero, the likely cause first: a rank killed by a signal we did
    not send (we terminate with SIGTERM) explains its peers' broken collectives."""
    exits = [RankExit(r, p.exitcode) for r, p in enumerate(ctx.processes) if p.exitcode]

    def cause_first(e: RankExit) -> tuple[bool, bool, int]:
        killed_from_outside = e.exit_code < 0 and e.exit_code != -signal.SIGTERM
        return (not killed_from_outside, e.rank != first, e.rank)

    return sorted(exits, key=cause_first)


def spawn(
    target: str, payload: Any, world: int, label: str, on_failure: Callable[[list[RankExit]], None] | None = None
) -> int:
    """Run `target(payload)` ("module:function") on `world` spawned ranks; 0 if all succeeded, else 2 where the
    likely cause exited with 2 (a refusal), else 1.

    When a rank fails, the others get FAILURE_GRACE_S to stop, then are terminated, and
    `on_failure` gets every failed rank, the likely cause first.
    """
    import torch.multiprocessing as mp

    ctx = mp.spawn(_rank_main, args=(world, free_port(), target, payload, label), nprocs=world, join=False)
    try:
        while not ctx.join(grace_period=FAILURE_GRACE_S):
            pass
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as err:  # tracebacks already printed
        exits = _failed_ranks(ctx, err.error_index) or [RankExit(err.error_index, 1)]
        print(f"workbench {label} failed: " + "; ".join(e.describe() for e in exits), file=sys.stderr)
        if on_failure is not None:
            on_failure(exits)
        return 2 if exits[0].exit_code == 2 else 1  # a refusal (report_rank_failure) keeps its exit code
    return 0
