"""The data section of a RunConfig: synthetic tokens, a JSONL SFT file, or a `datasets` dataset."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.config_checks import ConfigError, check_float, check_int

DATA_DIR = Path(__file__).resolve().parent / "data"
TINY_SFT_PATH = DATA_DIR / "tiny_sft.jsonl"
TOKENIZER_DIR = DATA_DIR / "tokenizer"

DATA_KINDS = ("synthetic", "jsonl", "datasets")
# How a `datasets` row becomes tokens (workbench/train/data_rows.py): "auto" picks by the columns present.
ROW_FORMATS = ("auto", "messages", "prompt_completion", "instruction", "text")
# The row fields each format reads; data.columns maps them to the dataset's own column names.
ROW_FIELDS = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "instruction": ("instruction", "input", "output"),
    "text": ("text",),
}
# Local files `datasets` reads by builder name, from the file's extension.
DATA_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from: synthetic tokens, a local JSONL SFT file, or a `datasets` dataset."""

    kind: str = "jsonl"
    # jsonl: the file (None = the shipped tiny dataset); datasets: a save_to_disk folder or a dataset name
    path: str | None = None
    tokenizer: str | None = None  # tokenizer directory; None = model.path's when it has one, else the shipped one
    seq_len: int = 128
    pack: bool = True
    max_length: int | None = None  # longest allowed example in tokens; None = seq_len
    # kind="datasets" only:
    # local parquet/arrow/json/jsonl/csv file(s): a path, a glob (expanded in sorted order) or a list of them
    data_files: Any = None
    split: str = "train"
    format: str = "auto"  # one of ROW_FORMATS
    columns: Any = None  # {row field: dataset column}, e.g. {"prompt": "question", "completion": "answer"}
    assistant_only_loss: bool = True  # chat rows: loss on assistant tokens only (False: on every token)
    cache_dir: str | None = None  # tokenized cache; None = <runs directory>/.cache/tokenized
    eval_fraction: float = 0.0  # share of the rows held out for eval (a seeded choice)
    eval_files: Any = None  # eval rows from their own local file(s) instead (none of them a data_files one)
    eval_every: int = 0  # evaluate every N optimizer steps (and after the last); 0 = never

    def __post_init__(self) -> None:
        if self.kind not in DATA_KINDS:
            raise ConfigError(f"data.kind {self.kind!r} is not one of {list(DATA_KINDS)}")
        check_int(self.seq_len, "data.seq_len", 2)
        check_int(self.max_length, "data.max_length", 2, allow_none=True)
        if self.max_length is not None and self.max_length > self.seq_len:
            raise ConfigError(f"data.max_length ({self.max_length}) cannot exceed data.seq_len ({self.seq_len})")
        if not isinstance(self.pack, bool):
            raise ConfigError(f"data.pack must be true or false, got {self.pack!r}")
        if self.kind == "synthetic" and self.path is not None:
            raise ConfigError("data.path is only used with kind='jsonl' or 'datasets'; drop it for synthetic data")
        for name in ("path", "tokenizer", "cache_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"data.{name} must be a non-empty string, got {value!r}")
        if self.kind != "datasets":
            extra = [
                f"data.{f.name}"
                for f in dataclasses.fields(self)
                if f.name in _DATASETS_ONLY and getattr(self, f.name) != f.default
            ]
            if extra:
                raise ConfigError(f"{', '.join(extra)} only apply to data.kind='datasets' (this is {self.kind!r})")
            return
        self._check_datasets()

    def _check_datasets(self) -> None:
        if (self.path is None) == (self.data_files is None):
            raise ConfigError(
                "data.kind='datasets' needs exactly one of data.data_files (local parquet/arrow/json/"
                "jsonl/csv files) or data.path (a save_to_disk folder or a dataset name), got "
                f"data_files={self.data_files!r}, path={self.path!r}"
            )
        _check_files(self.data_files, "data.data_files")
        _check_files(self.eval_files, "data.eval_files")
        if not isinstance(self.split, str) or not self.split:
            raise ConfigError(f"data.split must be a split name such as 'train', got {self.split!r}")
        if self.format not in ROW_FORMATS:
            raise ConfigError(f"data.format {self.format!r} is not one of {list(ROW_FORMATS)}")
        if self.columns is not None:
            fields = sorted({f for fs in ROW_FIELDS.values() for f in fs})
            if not isinstance(self.columns, dict) or not all(isinstance(v, str) for v in self.columns.values()):
                raise ConfigError(
                    f"data.columns must map row fields to column names, e.g. "
                    f"{{'prompt': 'question'}}, got {self.columns!r}"
                )
            unknown = [k for k in self.columns if k not in fields]
            if unknown:
                raise ConfigError(f"data.columns has unknown row field(s) {unknown}; row fields: {fields}")
        if not isinstance(self.assistant_only_loss, bool):
            raise ConfigError(f"data.assistant_only_loss must be true or false, got {self.assistant_only_loss!r}")
        check_float(self.eval_fraction, "data.eval_fraction", 0.0, 0.5)
        if self.eval_fraction and self.eval_files is not None:
            raise ConfigError("set one of data.eval_fraction or data.eval_files, not both")
        check_int(self.eval_every, "data.eval_every", 0)
        if self.eval_every and not (self.eval_fraction or self.eval_files):
            raise ConfigError("data.eval_every needs eval rows: set data.eval_fraction (e.g. 0.1) or data.eval_files")

    def check_fits(self, hf_config: Any) -> None:
        """Refuse a seq_len longer than the model's max_position_embeddings (before any allocation)."""
        limit = getattr(hf_config, "max_position_embeddings", None)
        if isinstance(limit, int) and self.seq_len > limit:
            raise ConfigError(
                f"data.seq_len ({self.seq_len}) exceeds the model's max_position_embeddings "
                f"({limit}); set data.seq_len to {limit} or less"
            )

    @property
    def resolved_path(self) -> Path:
        return Path(self.path).expanduser() if self.path else TINY_SFT_PATH

    @property
    def resolved_tokenizer(self) -> Path:
        return Path(self.tokenizer).expanduser() if self.tokenizer else TOKENIZER_DIR

    @property
    def example_max_length(self) -> int:
        return self.max_length or self.seq_len


_DATASETS_ONLY = (
    "data_files",
    "split",
    "format",
    "columns",
    "assistant_only_loss",
    "cache_dir",
    "eval_fraction",
    "eval_files",
    "eval_every",
)


def _check_files(value: Any, name: str) -> None:
    if value is None:
        return
    files = [value] if isinstance(value, str) else value
    if not isinstance(files, (list, tuple)) or not files or not all(isinstance(f, str) and f for f in files):
        raise ConfigError(f"{name} must be a file path or a non-empty list of paths, got {value!r}")
    for f in files:
        suffix = Path(f).suffix.lower()
        if suffix not in DATA_FILE_BUILDERS:
            glob = any(c in f for c in "*?[")
            raise ConfigError(
                f"{name}: {f!r} is not one of the file types {sorted(DATA_FILE_BUILDERS)}; "
                + (
                    "a glob names its file type, e.g. 'data/*.parquet'"
                    if glob
                    else "a save_to_disk folder goes in data.path"
                )
            )
