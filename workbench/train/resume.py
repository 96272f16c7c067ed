"""Before a run resumes: every check of its checkpoint, cheapest refusal first, and the data state it continues.

Everything here runs before the model is built and before the run directory exists, so a refusal
costs seconds and leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.parallel import dist_utils as du
from workbench.train.checkpoint import (
    check_compatible,
    check_settings,
    clean_leftovers,
    resolve_checkpoint,
    verify_checkpoint,
)
from workbench.train.lora_base import (
    base_record,
    check_base_description,
    check_base_weights,
    describe_base,
    saved_base,
)


def prepare_resume(rc: Any, hf_config: Any) -> tuple[Path | None, dict[str, Any] | None]:
    """Collective: (the checkpoint this run resumes from or None, this run's LoRA base record or None).

    Refuses (CheckpointError) the latest checkpoint of a run that is still alive, a damaged or crafted
    checkpoint, another model shape, another LoRA base, LoRA turned on or off, and other schedule/data
    settings unless accepted; then removes the unfinished saves of the run resumed from (never of a live
    one). A model.path LoRA base is hashed here (workbench.train.lora_base), after the cheaper checks.
    """
    description = describe_base(rc)
    if not rc.train.resume_from:
        return None, base_record(description)
    ckpt = resolve_checkpoint(rc.train.resume_from)
    meta = verify_checkpoint(ckpt)
    check_compatible(ckpt, hf_config)
    saved = saved_base(ckpt, meta)
    # Before the settings: a preset base is also train.seed's, whose change the settings check could offer to accept.
    check_base_description(ckpt, saved, description)
    accepted = check_settings(ckpt, rc)
    base = base_record(description)
    check_base_weights(ckpt, saved, base)
    if du.rank() == 0 and accepted:
        print(
            f"resuming from {ckpt} with changed settings (train.resume_allow_changes): " + "; ".join(accepted),
            flush=True,
        )
    for leftover in clean_leftovers(ckpt):
        print(f"removed {leftover}: a save that never finished", flush=True)
    return ckpt, base


def resumed_data_state(data_state: dict[str, Any], rc: Any) -> dict[str, Any]:
    """The checkpoint's data stream state as this run continues it: at the saved position, in this run's
    seed's order where train.resume_allow_changes accepted another train.seed (check_settings refused it
    otherwise)."""
    if "train.seed" in rc.train.resume_allow_changes and "seed" in data_state:
        return {**data_state, "seed": rc.train.seed}
    return data_state
