"""Checkpoint directories: their file names, finding the complete ones, meta.json, removing unfinished saves."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from workbench.errors import CheckpointError
from workbench.parallel import dist_utils as du
from workbench.train.checkpoint_owner import describe_live, live_status, owning_run
from workbench.train.safe_load import read_json

META_FILE = "meta.json"
TRAINER_STATE_FILE = "trainer_state.json"
STEP_PREFIX = "step-"
LEFTOVER_PREFIXES = (".tmp-step-", ".old-step-")  # saves that never finished (see checkpoint.save_checkpoint)
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "tie_word_embeddings",
)


def model_shape(hf_config: Any) -> dict[str, Any]:
    """The config fields that decide tensor shapes."""
    return {k: getattr(hf_config, k, None) for k in SHAPE_FIELDS}


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def list_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """Complete checkpoints under a checkpoints directory, oldest first."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX) and (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a step dir, a checkpoints dir or a run dir (latest wins)."""
    path = Path(path).expanduser()
    if path.name.startswith(LEFTOVER_PREFIXES):
        raise CheckpointError(
            f"{path} is a save that never finished (a run stopped while writing it); "
            f"pass the run directory or one of its {STEP_PREFIX}* checkpoints"
        )
    if (path / META_FILE).is_file():
        return path
    for root in (path, path / "checkpoints"):
        found = list_checkpoints(root)
        if found:
            _refuse_latest_of_live_run(path, found[-1])
            return found[-1]
    raise CheckpointError(
        f"no complete checkpoint at {path} (looked for {META_FILE} in it, in step-* "
        "subdirectories and under checkpoints/); pass a run or checkpoint directory"
    )


def _refuse_latest_of_live_run(path: Path, latest: Path) -> None:
    # "The latest checkpoint" of a run that still trains moves while this run starts, and resuming a run
    # that has not ended is most often a mistake (it looked stopped). A finished step-* folder of it is
    # never rewritten, so naming one explicitly branches from it without touching the live run.
    # Rank 0 decides for all: ranks on other machines judge liveness by the heartbeat, rank 0's by the pid.
    status = du.broadcast_object(live_status(latest) if du.rank() == 0 else None)
    if status is not None:
        raise CheckpointError(
            f"cannot resume from {path}: {describe_live(owning_run(latest), status)}, and its latest "
            "checkpoint changes as it trains. Wait for it to end, or stop it, then resume from it; to branch "
            f"from a checkpoint it has finished while it goes on, pass that folder, e.g. {latest}"
        )


def read_meta(ckpt: Path) -> dict[str, Any]:
    """meta.json of a checkpoint; CheckpointError naming the file if it is not JSON."""
    return read_json(Path(ckpt) / META_FILE, Path(ckpt))


def clean_leftovers(ckpt: Path) -> list[Path]:
    """Rank 0: remove unfinished saves (`.tmp-step-*`, `.old-step-*`) next to checkpoint `ckpt`.

    Nothing is removed while the run that holds `ckpt` is alive: its `.tmp-step-*` is the save it is writing.
    """
    if du.rank() != 0 or not ckpt.name.startswith(STEP_PREFIX) or live_status(ckpt) is not None:
        return []
    removed = [p for p in ckpt.parent.iterdir() if p.is_dir() and p.name.startswith(LEFTOVER_PREFIXES)]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed
