"""`datasets` data tokenized once into an on-disk cache of packed, memory-mapped sequences.

The cache is keyed by a hash of everything the tokens depend on: the data files (path, size,
mtime) or dataset name, split, row format and columns, the tokenizer's files (chat template
included), seq_len, packing and the eval holdout. Rank 0 tokenizes (datasets' `map`, with its
progress bar) and packs into int32 `.bin` files; every rank then maps them read-only, so no rank
holds the corpus in memory. A hit skips the tokenizer altogether, but not the files' digests: rank 0
reads the cache back once per run (data_cache_digest.py), rebuilds it from its sources when it
differs from what was written, and refuses token ids the model's embedding does not have.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.config_data import DATA_FILE_BUILDERS
from workbench.dead_builds import remove_dead_builds, temp_folder
from workbench.errors import DataError
from workbench.parallel import dist_utils as du
from workbench.runs.run_dir import default_runs_dir
from workbench.train.data_batch import Batch, TokenCheck, iter_packed, pad_sequence_into
from workbench.train.data_cache_digest import ARRAYS, ITEM_BYTES, damage, finish, new_hashes
from workbench.train.data_files import check_data_file, check_eval_overlap, require_datasets, resolve_data_files
from workbench.train.data_rows import resolve_columns, tokenize_row, tokenize_texts
from workbench.train.data_tokenizer import check_tokenizer_dir, check_vocab, load_tokenizer, pad_token_id

# 2: a packed document's first label is -100 (data_batch.iter_packed); caches of 1 still hold it as a target
CACHE_VERSION = 2
_NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


class MappedSequences:
    """Packed sequences `[n, seq_len]` read from the cache's memory-mapped int32 files."""

    def __init__(self, folder: Path) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        self.folder, self.num_loss_tokens = folder, meta["loss_tokens"]
        shape = (meta["num_sequences"], meta["seq_len"])
        for k in ARRAYS:  # a short file would fail inside numpy's mmap, a long one map other sequences
            size, expected = (folder / f"{k}.bin").stat().st_size, shape[0] * shape[1] * ITEM_BYTES
            if size != expected:
                raise DataError(
                    f"tokenized cache {folder}: {k}.bin is {size} bytes, meta.json says {expected}; "
                    f"delete {folder.parent} to have it rebuilt"
                )
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


def cache_key(
    cfg, tokenizer_dir: Path, data_files: list[Path] | None = None, eval_files: list[Path] | None = None
) -> str:
    """A hash of every input the cached tokens depend on (the files are data_files/eval_files, globs expanded)."""

    def sources(files: list[Path]) -> list:
        return [fp for f in files for fp in _file_fingerprints(f)]

    if data_files is None:
        data_files = resolve_data_files(cfg.data_files, "data.data_files")
    if eval_files is None:
        eval_files = resolve_data_files(cfg.eval_files, "data.eval_files")
    if cfg.path is not None:
        local = Path(cfg.path).expanduser()
        data = sources([local]) if local.exists() else ["name", cfg.path]
    else:
        data = sources(data_files)
    parts = {
        "version": CACHE_VERSION,
        "data": data,
        "eval": sources(eval_files),
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
    return Path(runs_dir or default_runs_dir()).expanduser() / ".cache" / "tokenized"


# ---------------------------------------------------------------------------------------------
# Loading rows


def load_sources(cfg, files: list[Path], work: Path) -> list[tuple[str, Any]]:
    """(name for errors, Dataset) per local file, or the one save_to_disk folder / named dataset."""
    datasets = require_datasets()
    out = []
    if files:
        for f in files:
            check_data_file(f, cfg.example_max_length)
            builder = DATA_FILE_BUILDERS[f.suffix.lower()]
            try:
                ds = datasets.load_dataset(builder, data_files=str(f), split="train", cache_dir=str(work / "hf"))
            except Exception as err:
                written = _cache_write_error(err, work)
                if written is not None:  # datasets writes its arrow files into the cache: not the data's fault
                    raise OSError(written.errno, written.strerror, written.filename) from err
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
            ids, labels = tokenize_row(tokenizer, fmt, cols, row, where, cfg.assistant_only_loss, max_length)
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
    """Pack `examples` into folder/{input_ids,labels,position_ids}.bin (int32) and its meta.json (with the
    files' BLAKE2b digests); returns the count."""
    folder.mkdir(parents=True)
    files = {k: open(folder / f"{k}.bin", "wb") for k in ARRAYS}
    chunk = {k: np.empty((1024, seq_len), dtype=np.int32) for k in ARRAYS}
    hashes, tokens = new_hashes(), TokenCheck()
    n = fill = 0

    def flush() -> None:
        for k in ARRAYS:
            data = chunk[k][:fill].tobytes()
            files[k].write(data)
            hashes[k].update(data)
        tokens.add(chunk["input_ids"][:fill], chunk["labels"][:fill])

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
    if tokens.loss_tokens == 0:
        raise DataError(f"{where}: every label is masked, so there is no token to train on; {MASKED_FIX}")
    meta = {
        "num_sequences": n,
        "seq_len": seq_len,
        "loss_tokens": tokens.loss_tokens,
        "blake2b": finish(hashes, n, seq_len),
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    return n


MASKED_FIX = "chat rows need non-empty assistant turns (or set data.assistant_only_loss=false)"


def _holdout(n: int, fraction: float, where: str) -> tuple[np.ndarray, np.ndarray]:
    k = round(n * fraction)
    if k == 0:
        raise DataError(
            f"{where}: data.eval_fraction={fraction} of {n} rows holds out no row; raise it or set data.eval_files"
        )
    perm = np.random.default_rng(0).permutation(n)  # a fixed seed: the split is part of the cached data
    return np.sort(perm[k:]), np.sort(perm[:k])


def build_cache(cfg, tokenizer_dir: Path, vocab_size: int, folder: Path) -> None:
    """Tokenize and pack into `folder` (written beside it, then renamed into place)."""
    datasets = require_datasets()
    remove_dead_builds(folder)
    tmp = temp_folder(folder)
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

        sources = load_sources(cfg, resolve_data_files(cfg.data_files, "data.data_files"), work)
        where = ", ".join(name for name, _ in sources)
        fmt, train = tokenized(sources, 0)
        held = None
        if cfg.eval_files is not None:
            eval_files = resolve_data_files(cfg.eval_files, "data.eval_files")
            eval_sources = load_sources(cfg, eval_files, work)
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
    """(train, eval or None) MappedSequences; rank 0 builds a missing cache (rebuilds a damaged one) while the
    others wait, and refuses tokens the model cannot take."""
    data_files = resolve_data_files(cfg.data_files, "data.data_files")
    eval_files = resolve_data_files(cfg.eval_files, "data.eval_files")
    check_eval_overlap(data_files, eval_files)
    check_tokenizer_dir(tokenizer_dir)
    root = cache_root(cfg, runs_dir)
    folder = root / cache_key(cfg, tokenizer_dir, data_files, eval_files)
    names = ", ".join(str(f) for f in data_files) or str(cfg.path)
    parts = {"train": names}
    if cfg.eval_files is not None or cfg.eval_fraction:
        parts["eval"] = ", ".join(str(f) for f in eval_files) or f"{names} (eval holdout)"
    error = None
    if du.rank() == 0:
        try:
            with _writing_cache(cfg, root):
                _ready_cache(cfg, tokenizer_dir, vocab_size, folder, parts)
        except Exception as err:
            du.broadcast_object(f"{err}" if isinstance(err, DataError) else f"rank 0 failed to tokenize: {err!r}")
            raise
    error = du.broadcast_object(error)
    if error:
        raise DataError(error)
    meta = json.loads((folder / "meta.json").read_text())
    check_vocab(meta["tokenizer_len"], tokenizer_dir, vocab_size)
    held = MappedSequences(folder / "eval") if "eval" in parts else None
    return MappedSequences(folder / "train"), held


def _ready_cache(cfg, tokenizer_dir: Path, vocab_size: int, folder: Path, parts: dict[str, str]) -> None:
    """Build `folder` if it is missing, rebuild it if it is damaged, then refuse what the model cannot take."""
    reason = None
    if folder.exists():
        checks, reason = _read_back(folder, parts)
        if reason is None:
            print(f"data: tokenized cache {folder}", flush=True)
        else:
            print(f"data: tokenized cache {folder} is damaged ({reason}); rebuilding it from its sources", flush=True)
            shutil.rmtree(folder)
    if not folder.exists():
        if reason is None:
            print(f"data: tokenizing into {folder}", flush=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            build_cache(cfg, tokenizer_dir, vocab_size, folder)
        except DataError as err:
            if reason is None:
                raise
            raise DataError(
                f"tokenized cache {folder} is damaged ({reason}) and could not be rebuilt from its sources: {err}"
            ) from err
        checks, after = _read_back(folder, parts)
        if after is not None:
            raise DataError(
                f"tokenized cache {folder} does not read back as it was written ({after}); the disk under "
                "data.cache_dir may be failing: delete the folder to rebuild it, or set data.cache_dir elsewhere"
            )
    for part, where in parts.items():
        checks[part].refuse(vocab_size, where, MASKED_FIX)


def _read_back(folder: Path, parts: dict[str, str]) -> tuple[dict[str, TokenCheck], str | None]:
    """The token checks of each part, and why the cache is damaged (None when every digest matches)."""
    checks = {part: TokenCheck() for part in parts}
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if not isinstance(meta.get("tokenizer_len"), int):
            return checks, "meta.json has no tokenizer_len"
    except (OSError, ValueError, AttributeError) as err:
        return checks, f"meta.json is missing or unreadable ({type(err).__name__})"
    for part in parts:
        reason = damage(folder / part, checks[part])
        if reason is not None:
            return checks, reason
    return checks, None


# Where these come from writing the cache, the cache folder is to blame, not the data files.
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _cache_write_error(err: BaseException, root: Path) -> OSError | None:
    """The OSError in err's chain that writing under `root` raised (a full disk, a read-only or unusable folder)."""
    seen: BaseException | None = err
    for _ in range(16):  # the chain is short; a cycle in it must not loop
        if seen is None:
            return None
        if isinstance(seen, OSError):
            name = seen.filename
            under = isinstance(name, (str, os.PathLike)) and Path(name).is_relative_to(root)
            if seen.errno in _WRITE_ERRNOS or under:
                return seen
        seen = seen.__cause__ or seen.__context__
    return None


@contextmanager
def _writing_cache(cfg, root: Path):
    """Turn a failure to write the cache into a DataError naming data.cache_dir and the errno."""
    try:
        yield
    except DataError:
        raise
    except Exception as err:
        found = _cache_write_error(err, root)
        if found is None:
            raise
        name = (
            f"data.cache_dir {root}" if cfg.cache_dir else f"the tokenized cache folder {root} (data.cache_dir unset)"
        )
        code = errno.errorcode.get(found.errno, str(found.errno))
        on = f": {found.filename}" if found.filename else ""
        if root.exists() and not root.is_dir():
            fix = "it is a file, not a folder: set data.cache_dir to a folder"
        elif found.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = (
                "free space there, or set data.cache_dir to a folder on a disk with room (the cache takes 12 "
                "bytes per token, and datasets' arrow files while it is built)"
            )
        else:
            fix = "set data.cache_dir to a folder this user can create and write"
        raise DataError(f"{name}: cannot write the tokenized cache ({code}: {found.strerror}{on}); {fix}") from err
