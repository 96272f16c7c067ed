"""Engine-side taps on ipyparallel's data channel for the run tests (targets of `cluster.finetune`).

`finetune_tapped` runs the real trainer and logs every message the rank publishes (its sequence
range, steps, expert-load matrices and serialized bytes) to <run_dir>/tap_rank<r>.jsonl.
`finetune_dropping` also withholds the messages that hold records 3..5, as if the notebook had
not polled before the next message replaced them, so those records must come from disk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _range(message: dict) -> tuple[int, int]:
    if "last_seq" in message:
        return int(message["first_seq"]), int(message["last_seq"])
    # The earlier format: {"seq", "records": the last records}.
    return int(message["seq"]) - len(message["records"]) + 1, int(message["seq"])


def _tapped(run_config, callbacks, drop: range | None):
    import ipyparallel.datapub as datapub
    from ipyparallel.serialize import serialize_object

    from workbench.train import finetune

    rank = int(os.environ.get("RANK", 0))
    log = Path(run_config.output_dir) / run_config.run_id / f"tap_rank{rank}.jsonl"
    real = datapub.publish_data

    def tap(message: dict) -> None:
        first, last = _range(message)
        dropped = drop is not None and first <= drop.stop - 1 and last >= drop.start
        entry = {
            "first": first,
            "last": last,
            "steps": [r["step"] for r in message["records"]],
            "loads": sum(1 for r in message["records"] if r.get("expert_load")),
            "bytes": sum(memoryview(b).nbytes for b in serialize_object(message)),
            "dropped": dropped,
        }
        with open(log, "a") as f:
            f.write(json.dumps(entry) + "\n")
        if not dropped:
            real(message)

    datapub.publish_data = tap
    try:
        return finetune(run_config, callbacks=callbacks)
    finally:
        datapub.publish_data = real


def finetune_tapped(run_config, callbacks=None):
    """`workbench.train.finetune` with every published message logged."""
    return _tapped(run_config, callbacks, drop=None)


def finetune_dropping(run_config, callbacks=None):
    """`finetune_tapped`, withholding the messages that carry records 3..5 of this rank."""
    return _tapped(run_config, callbacks, drop=range(3, 6))


def read_tap(run_dir, rank: int) -> list[dict]:
    """The messages rank published, in order."""
    path = Path(run_dir) / f"tap_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
