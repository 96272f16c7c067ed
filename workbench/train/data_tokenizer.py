"""The tokenizer a run's data is tokenized with: which folder (data.tokenizer, the model's own, the shipped one),
refused unless it holds tokenizer files, loaded without hub access, and checked against the model's vocabulary."""

from __future__ import annotations

from pathlib import Path

from workbench.errors import CheckpointError, DataError
from workbench.folder_files import file_inside

# What AutoTokenizer can build a tokenizer from: a fast tokenizer file or a slow one's vocabulary.
# (tokenizer_config.json alone names a class but holds no vocabulary.)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "*.tiktoken",
)


# The other files AutoTokenizer reads from the folder: its class and special tokens, BPE merges, chat templates.
TOKENIZER_SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*",
)


def has_tokenizer_files(path: Path) -> bool:
    """Whether a folder holds something AutoTokenizer can build a tokenizer from."""
    return path.is_dir() and any(any(path.glob(name)) for name in TOKENIZER_FILES)


def check_tokenizer_dir(path: str | Path) -> Path:
    """The tokenizer folder, refused unless it holds tokenizer files (before anything reads or hashes it)."""
    path = Path(path).expanduser()
    hint = (
        "set data.tokenizer to a folder written by tokenizer.save_pretrained() (or leave it unset for the shipped one)"
    )
    if not path.exists():
        raise DataError(f"tokenizer directory {path} does not exist; {hint}")
    if not path.is_dir():
        raise DataError(f"tokenizer path {path} is not a directory; {hint}")
    if not has_tokenizer_files(path):
        present = sorted(p.name for p in path.iterdir())[:8]
        raise DataError(
            f"tokenizer directory {path} has no tokenizer files (looked for "
            f"{', '.join(TOKENIZER_FILES)}; found {present or 'nothing'}); {hint}"
        )
    _check_links_stay_inside(path)
    return path


def _check_links_stay_inside(path: Path) -> None:
    """Refuse a tokenizer file that is a link out of its folder: nothing outside the folders a user named is read
    (the model folder's own tokenizer included; a Hub cache snapshot's links into its blobs are let through)."""
    fix = "copy the tokenizer files into the folder (tokenizer.save_pretrained() writes them all)"
    for pattern in (*TOKENIZER_FILES, *TOKENIZER_SIDE_FILES):
        for found in sorted(path.glob(pattern)):
            try:
                file_inside(path, found.relative_to(path).as_posix(), f"tokenizer directory {path}", fix)
            except CheckpointError as err:
                raise DataError(str(err)) from None


def load_tokenizer(path: str | Path, require_template: bool = True):
    """A local tokenizer directory (no hub access)."""
    from transformers import AutoTokenizer

    path = check_tokenizer_dir(path)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if require_template and not getattr(tok, "chat_template", None):
        raise DataError(f"tokenizer {path} has no chat template; SFT rows are rendered through it")
    return tok


def resolve_tokenizer_dir(data_cfg, model_path: str | None) -> Path:
    """data.tokenizer, else the model folder's own tokenizer (and chat template), else the shipped one."""
    if data_cfg.tokenizer:
        return data_cfg.resolved_tokenizer
    if model_path and has_tokenizer_files(Path(model_path).expanduser()):
        return Path(model_path).expanduser()
    return data_cfg.resolved_tokenizer


def check_vocab(tokenizer_len: int, tokenizer_dir: Path, vocab_size: int) -> None:
    """Refuse a tokenizer with ids the model's embedding does not have."""
    if tokenizer_len > vocab_size:
        raise DataError(
            f"tokenizer {tokenizer_dir} has {tokenizer_len} tokens but the model's "
            f"vocab_size is {vocab_size}; use a matching tokenizer/model"
        )


def pad_token_id(tokenizer) -> int:
    """The id padding uses: pad, else eos, else 0 (padding carries label -100, so its id is never trained)."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0
