"""`datasets` data tokenized once into an on-disk cache of packed, memory-mapped sequences.

The cache is keyed by a hash of everything the tokens depend on: the data files (path, size,
mtime) or dataset name, split, row format and columns, the tokenizer's files (chat template
included), seq_len, packing and the eval holdout. Rank 0 tokenizes (datasets' `map`, with its
progress bar) and packs into int32 `.bin` files; every rank then maps them read-only, so no rank
holds the corpus in memory. A hit skips the tokenizer altogether.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.config import DATA_FILE_BUILDERS
from workbench.parallel import dist_utils as du
from workbench.train.data import (
    IGNORE_INDEX,
    Batch,
    DataError,
    check_vocab,
    iter_packed,
    load_tokenizer,
    pad_sequence_into,
    pad_token_id,
    require_datasets,
)
from workbench.train.data_rows import resolve_columns, tokenize_row, tokenize_texts

# 2: a packed document's first label is -100 (data.iter_packed); caches of 1 still hold it as a target
CACHE_VERSION = 2
ARRAYS = ("input_ids", "labels", "position_ids")
_NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


class MappedSequences:
    """Packed sequences `[n, seq_len]` read from the cache's memory-mapped int32 files."""

    def __init__(self, folder: Path) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        self.folder, self.num_loss_tokens = folder, meta["loss_tokens"]
        shape = (meta["num_sequences"], meta["seq_len"])
        self.arrays = {k: np.memmap(folder / f"{k}.bin", dtype=np.int32, mode="r", shape=shape) for k in ARRAYS}

    def __len__(self) -> int:
        return self.arrays["input_ids"].shape[0]

    def slice(self, start: int, stop: int) -> Batch:
        return Batch(*(torch.from_numpy(self.arrays[k][start:stop].astype(np.int64)) for k in ARRAYS))


# ---------------------------------------------------------------------------------------------
# The key


def _file_fingerprints(path: Path) -> list:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _tokenizer_fingerprint(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if p.is_file() and not p.name.endswith(_NOT_TOKENIZER) and p.stat().st_size < (64 << 20):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _files(value: Any) -> list[Path]:
    if value is None:
        return []
    return [Path(f).expanduser() for f in ([value] if isinstance(value, str) else value)]


def _check_exist(files: list[Path], field: str) -> None:
    for f in files:
        if not f.is_file():
            raise DataError(f"{field}: file {f} does not exist")


def cache_key(cfg, tokenizer_dir: Path) -> str:
    """A hash of every input the cached tokens depend on."""

    def sources(files: list[Path]) -> list:
        return [fp for f in files for fp in _file_fingerprints(f)]

    if cfg.path is not None:
        local = Path(cfg.path).expanduser()
        data = sources([local]) if local.exists() else ["name", cfg.path]
    else:
        data = sources(_files(cfg.data_files))
    parts = {
        "version": CACHE_VERSION,
        "data": data,
        "eval": sources(_files(cfg.eval_files)),
        "split": cfg.split,
        "format": cfg.format,
        "columns": cfg.columns,
        "assistant_only_loss": cfg.assistant_only_loss,
        "seq_len": cfg.seq_len,
        "pack": cfg.pack,
        "max_length": cfg.example_max_length,
        "eval_fraction": cfg.eval_fraction,
        "tokenizer": _tokenizer_fingerprint(tokenizer_dir),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_root(cfg, runs_dir: str | None) -> Path:
    """data.cache_dir, else <runs directory>/.cache/tokenized."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    from workbench.runs.run_dir import default_runs_dir

    return Path(runs_dir or default_runs_dir()).expanduser() / ".cache" / "tokenized"


# ---------------------------------------------------------------------------------------------
# Loading rows


def load_sources(cfg, files: list[Path], work: Path, field: str) -> list[tuple[str, Any]]:
    """(name for errors, Dataset) per local file, or the one save_to_disk folder / named dataset."""
    datasets = require_datasets()
    out = []
    if files:
        _check_exist(files, field)
        for f in files:
            builder = DATA_FILE_BUILDERS[f.suffix.lower()]
            try:
                ds = datasets.load_dataset(builder, data_files=str(f), split="train", cache_dir=str(work / "hf"))
            except Exception as err:
                if "corresponds to no data" in str(err):  # datasets' words for a file without rows
                    raise DataError(f"{f}: the file has no rows") from err
                raise DataError(f"{f}: could not be read as {builder} ({type(err).__name__}: {err})") from err
            out.append((str(f), ds))
        return out
    local = Path(cfg.path).expanduser()
    if local.is_dir():
        try:
            ds = datasets.load_from_disk(str(local))
        except Exception as err:
            raise DataError(
                f"data.path {local} is not a save_to_disk folder ({type(err).__name__}: {err}); "
                "local files go in data.data_files"
            ) from err
        if isinstance(ds, datasets.DatasetDict):
            if cfg.split not in ds:
                raise DataError(
                    f"data.path {local} has no split {cfg.split!r}; its splits: {list(ds)} (set data.split)"
                )
            ds = ds[cfg.split]
        return [(str(local), ds)]
    if local.exists() or cfg.path.startswith((".", "/", "~")):
        raise DataError(
            f"data.path {local} is not a folder written by Dataset.save_to_disk(); local files go in data.data_files"
        )
    try:
        ds = datasets.load_dataset(cfg.path, split=cfg.split, cache_dir=str(work / "hf"))
    except Exception as err:
        raise DataError(
            f"could not load dataset {cfg.path!r} split {cfg.split!r} ({type(err).__name__}: {err}); "
            "offline, save it with save_to_disk() or to parquet and point data.path/data_files at it"
        ) from err
    return [(cfg.path, ds)]


def tokenize_source(cfg, tokenizer, name: str, ds, work: Path, index: int):
    """The Dataset of (input_ids, labels) per row, written by datasets' map into the build folder."""
    datasets = require_datasets()
    if len(ds) == 0:
        raise DataError(f"{name}: the split {cfg.split!r} has no rows")
    fmt, cols = resolve_columns(cfg.format, cfg.columns, list(ds.column_names), name)
    max_length = cfg.example_max_length

    def tokenize(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        wheres = [f"{name}: row {i}" for i in indices]
        if fmt == "text":
            ids = tokenize_texts(tokenizer, batch[cols["text"]], wheres)
            return {"input_ids": ids, "labels": ids}
        out: dict[str, list] = {"input_ids": [], "labels": []}
        for k, where in enumerate(wheres):
            row = {c: batch[c][k] for c in batch}
            ids, labels = tokenize_row(tokenizer, fmt, cols, row, where, cfg.assistant_only_loss)
            if len(ids) > max_length:
                raise DataError(
                    f"{where}: row is {len(ids)} tokens, over data.max_length={max_length}; "
                    "shorten or drop the row, or raise data.max_length / data.seq_len"
                )
            out["input_ids"].append(ids)
            out["labels"].append(labels)
        return out

    features = datasets.Features(
        {"input_ids": datasets.Sequence(datasets.Value("int32")), "labels": datasets.Sequence(datasets.Value("int32"))}
    )
    return fmt, ds.map(
        tokenize,
        batched=True,
        batch_size=256,
        with_indices=True,
        remove_columns=ds.column_names,
        features=features,
        cache_file_name=str(work / f"tokens-{index}.arrow"),
        new_fingerprint=f"workbench-tokens-{index}",
        desc=f"tokenizing {Path(name).name}",
    )


# ---------------------------------------------------------------------------------------------
# Packing into the cache


def _examples(ds, fmt: str, max_length: int, indices=None):
    """(ids, labels) in order; plain-text documents longer than max_length are cut into pieces."""
    view = ds.select(indices) if indices is not None else ds
    for batch in view.iter(batch_size=1024):
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            if fmt != "text":
                yield ids, labels
                continue
            for s in range(0, len(ids), max_length):
                yield ids[s : s + max_length], labels[s : s + max_length]


def write_sequences(folder: Path, examples, seq_len: int, pad_id: int, pack: bool, where: str) -> int:
    """Pack `examples` into folder/{input_ids,labels,position_ids}.bin (int32) and its meta.json; returns the count."""
    folder.mkdir(parents=True)
    files = {k: open(folder / f"{k}.bin", "wb") for k in ARRAYS}
    chunk = {k: np.empty((1024, seq_len), dtype=np.int32) for k in ARRAYS}
    n = fill = loss_tokens = 0

    def flush() -> None:
        nonlocal loss_tokens
        for k in ARRAYS:
            files[k].write(chunk[k][:fill].tobytes())
        loss_tokens += int((chunk["labels"][:fill, 1:] != IGNORE_INDEX).sum())

    try:
        for ids, labels, pos in iter_packed(examples, seq_len, pack):
            pad_sequence_into(
                chunk["input_ids"][fill], chunk["labels"][fill], chunk["position_ids"][fill], ids, labels, pos, pad_id
            )
            fill, n = fill + 1, n + 1
            if fill == len(chunk["input_ids"]):
                flush()
                fill = 0
        flush()
    finally:
        for f in files.values():
            f.close()
    if loss_tokens == 0:
        raise DataError(
            f"{where}: every label is masked, so there is no token to train on; chat rows need "
            "non-empty assistant turns (or set data.assistant_only_loss=false)"
        )
    meta = {"num_sequences": n, "seq_len": seq_len, "loss_tokens": loss_tokens}
    (folder / "meta.json").write_text(json.dumps(meta))
    return n


def _holdout(n: int, fraction: float, where: str) -> tuple[np.ndarray, np.ndarray]:
    k = round(n * fraction)
    if k == 0:
        raise DataError(
            f"{where}: data.eval_fraction={fraction} of {n} rows holds out no row; raise it or set data.eval_files"
        )
    perm = np.random.default_rng(0).permutation(n)  # a fixed seed: the split is part of the cached data
    return np.sort(perm[k:]), np.sort(perm[:k])


def _remove_dead_builds(folder: Path) -> None:
    """Delete this key's half-written builds whose process is gone (a killed build leaves up to 2x the corpus)."""
    for tmp in folder.parent.glob(f".tmp-{folder.name}-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


def build_cache(cfg, tokenizer_dir: Path, vocab_size: int, folder: Path) -> None:
    """Tokenize and pack into `folder` (written beside it, then renamed into place)."""
    datasets = require_datasets()
    _remove_dead_builds(folder)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    work = tmp / "work"
    work.mkdir(parents=True)
    try:
        tokenizer = None

        def tokenized(sources, offset: int):
            nonlocal tokenizer
            parts, fmts = [], set()
            for i, (name, ds) in enumerate(sources):
                fmt, _ = resolve_columns(cfg.format, cfg.columns, list(ds.column_names), name)
                if tokenizer is None:  # after the columns check: a wrong column fails before the tokenizer loads
                    tokenizer = load_tokenizer(tokenizer_dir, require_template=fmt != "text")
                    check_vocab(len(tokenizer), tokenizer_dir, vocab_size)
                fmt, tok_ds = tokenize_source(cfg, tokenizer, name, ds, work, offset + i)
                parts.append(tok_ds)
                fmts.add(fmt)
            return (fmts.pop() if len(fmts) == 1 else "mixed"), datasets.concatenate_datasets(parts)

        sources = load_sources(cfg, _files(cfg.data_files), work, "data.data_files")
        where = ", ".join(name for name, _ in sources)
        fmt, train = tokenized(sources, 0)
        held = None
        if cfg.eval_files is not None:
            eval_sources = load_sources(cfg, _files(cfg.eval_files), work, "data.eval_files")
            held = (", ".join(name for name, _ in eval_sources),) + tokenized(eval_sources, len(sources))
        pad = pad_token_id(tokenizer)
        train_idx = eval_idx = None
        if cfg.eval_fraction:
            train_idx, eval_idx = _holdout(len(train), cfg.eval_fraction, where)
            held = (f"{where} (eval holdout)", fmt, train)
        write_sequences(
            tmp / "train", _examples(train, fmt, cfg.example_max_length, train_idx), cfg.seq_len, pad, cfg.pack, where
        )
        if held is not None:
            write_sequences(
                tmp / "eval",
                _examples(held[2], held[1], cfg.example_max_length, eval_idx),
                cfg.seq_len,
                pad,
                cfg.pack,
                held[0],
            )
        del train, held
        shutil.rmtree(work)
        (tmp / "meta.json").write_text(
            json.dumps({"tokenizer_len": len(tokenizer), "tokenizer": str(tokenizer_dir), "format": fmt, "pad_id": pad})
        )
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / "meta.json").exists():
                raise
            # another run built the same key meanwhile: its cache holds the same tokens, keep it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_cached(cfg, tokenizer_dir: Path, vocab_size: int, runs_dir: str | None = None):
    """(train, eval or None) MappedSequences; rank 0 builds a missing cache while the others wait."""
    _check_exist(_files(cfg.data_files), "data.data_files")
    _check_exist(_files(cfg.eval_files), "data.eval_files")
    folder = cache_root(cfg, runs_dir) / cache_key(cfg, tokenizer_dir)
    error = None
    if du.rank() == 0:
        if (folder / "meta.json").exists():
            print(f"data: tokenized cache {folder}", flush=True)
        else:
            print(f"data: tokenizing into {folder}", flush=True)
            folder.parent.mkdir(parents=True, exist_ok=True)
            try:
                build_cache(cfg, tokenizer_dir, vocab_size, folder)
            except Exception as err:
                du.broadcast_object(f"{err}" if isinstance(err, DataError) else f"rank 0 failed to tokenize: {err!r}")
                raise
    error = du.broadcast_object(error)
    if error:
        raise DataError(error)
    meta = json.loads((folder / "meta.json").read_text())
    check_vocab(meta["tokenizer_len"], tokenizer_dir, vocab_size)
    held = MappedSequences(folder / "eval") if (folder / "eval").is_dir() else None
    return MappedSequences(folder / "train"), held
