"""The tokenized cache's integrity: a BLAKE2b digest of each packed file, written with meta.json, checked on load.

A cache is trusted for what it holds: an overwritten, truncated or hand-edited `.bin` file would
otherwise be trained on (or fail inside numpy's mmap), so every load reads the files back once,
compares them with the digests the build wrote, and gathers the token checks (`TokenCheck`) in the
same pass. Each digest ends with the shape `[num_sequences, seq_len]`, so a meta.json that
describes the same bytes as other sequences does not match either.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from workbench.train.data_batch import TokenCheck

ARRAYS = ("input_ids", "labels", "position_ids")
ITEM_BYTES = np.dtype(np.int32).itemsize
_BLOCK_BYTES = 8 << 20  # read back in blocks of whole sequences of about this size


def new_hashes() -> dict[str, hashlib.blake2b]:
    """One BLAKE2b per packed file, fed its bytes as they are written (or read back)."""
    return {k: hashlib.blake2b(digest_size=32) for k in ARRAYS}


def finish(hashes: dict[str, hashlib.blake2b], num_sequences: int, seq_len: int) -> dict[str, str]:
    """The digests, each closed with the shape its bytes are read as."""
    shape = f"|{num_sequences}x{seq_len}".encode()
    out = {}
    for k, h in hashes.items():
        h = h.copy()
        h.update(shape)
        out[k] = h.hexdigest()
    return out


def read_back(folder: Path, num_sequences: int, seq_len: int, tokens: TokenCheck) -> dict[str, str]:
    """The digests of the packed files, read once in blocks of sequences; `tokens` takes in every block."""
    hashes = new_hashes()
    rows = max(1, _BLOCK_BYTES // (seq_len * ITEM_BYTES))
    files = {k: open(folder / f"{k}.bin", "rb") for k in ARRAYS}
    try:
        for _ in range(0, num_sequences, rows):
            block = {k: f.read(rows * seq_len * ITEM_BYTES) for k, f in files.items()}
            for k in ARRAYS:
                hashes[k].update(block[k])
            as_rows = {k: np.frombuffer(block[k], dtype=np.int32).reshape(-1, seq_len) for k in ("input_ids", "labels")}
            tokens.add(as_rows["input_ids"], as_rows["labels"])
    finally:
        for f in files.values():
            f.close()
    return finish(hashes, num_sequences, seq_len)


def damage(folder: Path, tokens: TokenCheck) -> str | None:
    """Why folder's packed files are not the ones its meta.json describes, or None when they are.

    Sizes are compared with meta.json before a byte is read (a short file would fail numpy's mmap);
    then every file is read once against its digest, and `tokens` takes in the sequences.
    """
    try:
        meta = json.loads((folder / "meta.json").read_text())
        n, seq_len, digests = meta["num_sequences"], meta["seq_len"], meta["blake2b"]
    except FileNotFoundError:
        return f"{folder.name}/meta.json is missing"
    except (OSError, ValueError, TypeError, KeyError) as err:
        return f"{folder.name}/meta.json is unreadable or has no digest ({type(err).__name__}: {err})"
    if not (isinstance(n, int) and isinstance(seq_len, int) and n >= 0 and seq_len > 0 and isinstance(digests, dict)):
        return f"{folder.name}/meta.json does not describe packed sequences"
    expected = n * seq_len * ITEM_BYTES
    for k in ARRAYS:
        path = folder / f"{k}.bin"
        if not path.is_file():
            return f"{folder.name}/{path.name} is missing"
        size = path.stat().st_size
        if size != expected:
            return f"{folder.name}/{path.name} is {size} bytes, meta.json says {n} x {seq_len} int32 ({expected} bytes)"
    found = read_back(folder, n, seq_len, tokens)
    for k in ARRAYS:
        if found[k] != digests.get(k):
            return f"{folder.name}/{k}.bin does not match its digest in meta.json"
    if tokens.loss_tokens != meta.get("loss_tokens"):
        return (
            f"{folder.name}/meta.json says {meta.get('loss_tokens')} loss tokens, the labels hold {tokens.loss_tokens}"
        )
    return None
