"""The local data files a config names, checked before anything parses them.

`resolve_data_files` turns data.data_files / data.eval_files into the files they name: globs expanded
(sorted, as `datasets` expands them), each an existing file of a known type, none named twice.
`check_data_file` reads a JSON or CSV file once, a bounded line at a time, so an empty file, a
non-UTF-8 byte or a huge row is named by file and line before datasets or pyarrow parse anything.
"""

from __future__ import annotations

import codecs
import glob
from collections import Counter
from pathlib import Path
from typing import Any

from workbench.config_data import DATA_FILE_BUILDERS
from workbench.errors import DataError

# One plain-text document is tokenized whole before it is cut into max_length pieces, so its row has no
# token bound; this bounds what one tokenizer call holds (tokenizing one 200 MB row took 23 GB resident).
MAX_DOCUMENT_BYTES = 16 << 20
_GLOB_CHARS = ("*", "?", "[")
_ICONV = "re-encode it, e.g. `iconv -f latin1 -t utf-8`"


def max_row_bytes(max_length: int) -> int:
    """The byte bound on one chat row (a JSONL line, or a row's text), checked before parsing or tokenizing.

    A token is a few bytes of text (at most ~12 as escaped JSON for CJK or emoji), so 64 bytes per
    token refuses only rows that can never fit in `max_length` tokens; the 1 MiB floor leaves room
    for short rows with extra fields.
    """
    return max(1 << 20, 64 * max_length)


def max_line_bytes(max_length: int) -> int:
    """The bound on one line of a data file, before its format (chat rows or plain-text documents) is known."""
    return max(MAX_DOCUMENT_BYTES, max_row_bytes(max_length))


# ---------------------------------------------------------------------------------------------
# Which files


def resolve_data_files(value: Any, field: str) -> list[Path]:
    """The files `value` (a path, a glob, or a list of them) names, in order; refuses a file named twice."""
    if value is None:
        return []
    files = [f for entry in ([value] if isinstance(value, str) else value) for f in _expand(entry, field)]
    seen: dict[Path, Path] = {}
    for f in files:
        key = f.resolve()
        if key in seen:
            how = f" (as {seen[key]} and {f})" if seen[key] != f else ""
            raise DataError(
                f"{field} names the file {key} twice{how}: its rows would be trained on twice; list each file once"
            )
        seen[key] = f
    return files


def check_eval_overlap(train: list[Path], held: list[Path]) -> None:
    """Refuse eval files that are training files: eval_loss would then measure rows the model trained on."""
    shared = sorted({f.resolve() for f in train} & {f.resolve() for f in held})
    if shared:
        raise DataError(
            f"data.eval_files and data.data_files both name {shared[0]}: its rows would be evaluated after "
            "training on them, so eval_loss would not measure held-out data; name eval files that are not "
            "training files, or hold out rows with data.eval_fraction instead"
        )


def _expand(entry: str, field: str) -> list[Path]:
    path = Path(entry).expanduser()
    if not path.exists() and any(c in str(path) for c in _GLOB_CHARS):
        matches = sorted(Path(m) for m in glob.glob(str(path), recursive=True))
        files = [m for m in matches if m.is_file()]
        if not files:
            what = "only folders" if matches else "nothing"
            raise DataError(f"{field}: the pattern {entry!r} matches {what}; it must match at least one data file")
        for f in files:
            if f.suffix.lower() not in DATA_FILE_BUILDERS:
                raise DataError(
                    f"{field}: the pattern {entry!r} matches {f}, which is not one of the file types "
                    f"{sorted(DATA_FILE_BUILDERS)}; narrow the pattern (e.g. end it in *.parquet)"
                )
        return files
    if path.is_dir():
        kinds = Counter(p.suffix.lower() for p in path.iterdir() if p.suffix.lower() in DATA_FILE_BUILDERS)
        example = path / f"*{kinds.most_common(1)[0][0] if kinds else '.parquet'}"
        extra = "; a folder written by Dataset.save_to_disk() goes in data.path" if field == "data.data_files" else ""
        raise DataError(f"{field}: {path} is a folder, not a file; name its files, e.g. '{example}'{extra}")
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise DataError(f"{field}: file {path} does not exist{where}")
    return [path]


# ---------------------------------------------------------------------------------------------
# What is in them


def require_datasets():
    """The `datasets` module, or a DataError saying how to install it (the data kinds that read files need it)."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading data files needs the `datasets` library (data.kind 'jsonl' and 'datasets'): pip install datasets"
        ) from None
    return datasets


def scan_lines(path: Path, max_bytes: int, too_long: str, encoding: str) -> list[int]:
    """1-based numbers of the non-blank lines (datasets skips blank ones).

    Reads at most `max_bytes + 1` bytes of each line, so a huge line is refused without loading it
    (`too_long` says why and what to do), and checks that every line is UTF-8 (`encoding` says
    what the file must be) before datasets/pyarrow sees the file.
    """
    lines = []
    with open(path, "rb") as f:
        for i, raw in enumerate(iter(lambda: f.readline(max_bytes + 1), b""), 1):
            whole = raw.endswith(b"\n") or len(raw) <= max_bytes
            try:
                # A line cut at the bound may end inside a character: decode it incrementally.
                text = codecs.getincrementaldecoder("utf-8")().decode(raw, final=whole)
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path}:{i}: not UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of "
                    f"the line); {encoding}: {_ICONV}"
                ) from None
            if not whole:
                raise DataError(f"{path}:{i}: row is over {max_bytes} bytes, {too_long}")
            if text.strip():
                lines.append(i)
    return lines


def _check_utf8(path: Path, encoding: str) -> None:
    """The whole file decodes as UTF-8 (read in blocks: a JSON document may be one long line)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path}: not UTF-8 (near byte {offset + err.start + 1}); {encoding}: {_ICONV}"
                ) from None
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 (the file ends inside a character); {encoding}: {_ICONV}") from None


def _first_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            stripped = block.lstrip()
            if stripped:
                return stripped[:1]
    return b""


def check_data_file(path: Path, max_length: int) -> None:
    """Refuse an empty file, and (JSON, CSV) a non-UTF-8 byte or a line over `max_line_bytes`, naming the line."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".jsonl", ".csv"):
        if path.stat().st_size == 0:
            raise DataError(f"{path}: the file is empty (0 bytes); write rows into it or leave it out")
        return
    kind = "JSON lines (one JSON object per line)" if suffix != ".csv" else "CSV"
    encoding = f"the data file must be UTF-8 {kind}"
    if suffix != ".csv" and _first_byte(path) == b"[":  # one JSON array of rows: its lines are not rows
        _check_utf8(path, encoding)
        return
    bound = max_line_bytes(max_length)
    too_long = (
        f"more than any row can take (a chat row of data.max_length={max_length} tokens takes at most "
        f"{max_row_bytes(max_length)}, a plain-text document at most {bound}); shorten or split the row"
    )
    if not scan_lines(path, bound, too_long, encoding):
        raise DataError(f"{path}: the file is empty (no rows); write rows into it or leave it out")
