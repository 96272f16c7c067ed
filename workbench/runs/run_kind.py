"""What kind of run a config.json describes, in a few words: full or LoRA (rank, targets), where its data
came from, whether and how it evaluated. Every listing shows the same words (`workbench runs`, the
Studio's Compare list and run headers, the lab's sidebar), so runs of one model can be told apart.

Torch-free and forgiving: a config.json from an older version or edited by hand gives "?" parts,
never an error.
"""

from __future__ import annotations

import os
from typing import Any

SHIPPED_DATA = "tiny_sft.jsonl (shipped)"
_PART_CHARS = 40  # of a path or dataset name in the label: the full value is in the run's config.json


def _cut(text: str) -> str:
    return text if len(text) <= _PART_CHARS else "..." + text[-(_PART_CHARS - 3) :]


def _files_label(files: Any) -> str:
    """data_files as a label: one file's name, or the first one's and how many more."""
    if isinstance(files, dict):  # {split: files}
        files = [f for value in files.values() for f in (value if isinstance(value, list) else [value])]
    if isinstance(files, str):
        files = [files]
    if not isinstance(files, list) or not files:
        return "?"
    first = os.path.basename(str(files[0])) or str(files[0])
    return _cut(first) + (f" +{len(files) - 1}" if len(files) > 1 else "")


def data_label(data: Any) -> str:
    """Where a run's tokens came from: 'synthetic', the shipped SFT file, a file's or dataset's name."""
    if not isinstance(data, dict):
        return "?"
    kind = data.get("kind", "jsonl")
    if kind == "synthetic":
        return "synthetic"
    path = data.get("path")
    if kind == "jsonl":
        return SHIPPED_DATA if not path else _cut(os.path.basename(str(path)) or str(path))
    if kind == "datasets":
        return _files_label(data.get("data_files")) if data.get("data_files") is not None else _cut(str(path))
    return str(kind)


def eval_label(data: Any) -> str | None:
    """How a run evaluated ('every 5 steps on 10% held out'), None when it did not."""
    if not isinstance(data, dict) or not data.get("eval_every"):
        return None
    fraction, files = data.get("eval_fraction"), data.get("eval_files")
    held = (
        f"{fraction:.0%} held out"
        if isinstance(fraction, (int, float)) and fraction
        else _files_label(files)
        if files is not None
        else "?"
    )
    return f"every {data['eval_every']} steps on {held}"


def run_kind(config: Any) -> dict[str, Any]:
    """{"training": "full" | "lora", "lora_rank", "lora_targets", "data", "eval", "label"} of a config.json.

    `label` is the one line a listing shows, e.g. "LoRA r=16 attention+experts · tiny_sft.jsonl (shipped)
    · eval every 5 steps on 10% held out".
    """
    config = config if isinstance(config, dict) else {}
    lora = config.get("lora")
    data = config.get("data")
    kind: dict[str, Any] = {
        "training": "lora" if isinstance(lora, dict) else "full",
        "lora_rank": lora.get("rank") if isinstance(lora, dict) else None,
        "lora_targets": list(lora.get("targets") or []) if isinstance(lora, dict) else None,
        "data": data_label(data) if data is not None else "?",
        "eval": eval_label(data),
    }
    if isinstance(lora, dict):
        targets = "+".join(str(t) for t in kind["lora_targets"]) or "?"
        training = f"LoRA r={kind['lora_rank'] if kind['lora_rank'] is not None else '?'} {targets}"
    else:
        training = "full"
    parts = [training, kind["data"]] + ([f"eval {kind['eval']}"] if kind["eval"] else [])
    kind["label"] = " \u00b7 ".join(parts)
    return kind
