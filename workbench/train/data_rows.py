"""`datasets` rows to token ids and labels: conversational, prompt/completion, instruction, plain text.

A row format names the fields it reads (config.ROW_FIELDS); `data.columns` maps them to the
dataset's columns. Chat formats are rendered with the tokenizer's chat template and, with
`assistant_only_loss`, trained on assistant tokens only; plain text is trained on every token.
"""

from __future__ import annotations

from typing import Any

from workbench.config_data import ROW_FIELDS
from workbench.errors import DataError
from workbench.train.data_files import MAX_DOCUMENT_BYTES, max_row_bytes
from workbench.train.data_messages import text_message, tokenize_messages

OPTIONAL_FIELDS = {"input"}  # instruction rows may leave out the input


def resolve_columns(fmt: str, columns: dict[str, str] | None, present: list[str], where: str) -> tuple[str, dict]:
    """(format, {field: column}) for a dataset with `present` columns; refuses missing ones, listing those present."""
    columns = dict(columns or {})

    def mapping(name: str) -> dict[str, str]:
        m = {f: columns.get(f, f) for f in ROW_FIELDS[name]}
        if (
            name == "prompt_completion"
            and "completion" not in columns
            and "completion" not in present
            and "response" in present
        ):
            m["completion"] = "response"  # the shipped JSONL's name for it
        return m

    if fmt == "auto":
        for name in ROW_FIELDS:
            m = mapping(name)
            if all(c in present for f, c in m.items() if f not in OPTIONAL_FIELDS):
                return name, {f: c for f, c in m.items() if c in present}
        raise DataError(
            f"{where}: no row format fits the columns {present}; expected one of "
            + "; ".join(f"{n}: {list(fs)}" for n, fs in ROW_FIELDS.items())
            + ". Name the format with data.format and map columns with data.columns, "
            "e.g. {'prompt': 'question', 'completion': 'answer'}"
        )
    m = mapping(fmt)
    missing = [c for f, c in m.items() if f not in OPTIONAL_FIELDS and c not in present]
    if missing:
        raise DataError(
            f"{where}: data.format={fmt!r} needs column(s) {missing}, but the dataset has {present}; "
            "map them with data.columns, e.g. {'"
            + next(f for f, c in m.items() if c in missing)
            + f"': '{present[0] if present else 'column'}'}}"
        )
    return fmt, {f: c for f, c in m.items() if c in present}


def row_to_messages(fmt: str, cols: dict[str, str], row: dict[str, Any], where: str) -> list[dict]:
    """The chat messages of one row of a chat format."""

    def text(field: str) -> str:
        value = row.get(cols[field]) if field in cols else None
        if field in OPTIONAL_FIELDS and value is None:
            return ""
        if not isinstance(value, str):
            raise DataError(
                f"{where}: column {cols[field]!r} must be a string, got {type(value).__name__} {str(value)[:60]!r}"
            )
        return value

    if fmt == "prompt_completion":
        return [{"role": "user", "content": text("prompt")}, {"role": "assistant", "content": text("completion")}]
    if fmt == "instruction":
        extra = text("input")
        prompt = text("instruction") + (f"\n\n{extra}" if extra else "")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": text("output")}]
    messages = row.get(cols["messages"])
    fmt_hint = f"column {cols['messages']!r} must be a list of {{'role', 'content'}} with an assistant turn"
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {fmt_hint}, got {str(messages)[:60]!r}")
    out = [text_message(m, f"message {i}", where, fmt_hint) for i, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant message to learn from; {fmt_hint}")
    return out


def _text_chars(value: Any) -> int:
    """Characters of text in a row's value (strings inside lists and mappings included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0


def tokenize_row(
    tokenizer,
    fmt: str,
    cols: dict[str, str],
    row: dict[str, Any],
    where: str,
    assistant_only: bool,
    max_length: int,
) -> tuple[list[int], list[int]]:
    """(ids, labels) of one chat-format row; a row too long to fit and a chat template that fails on it name it.

    The length is bounded in characters before the row is rendered or tokenized: tokenizing a
    row of hundreds of megabytes takes tens of gigabytes, only to refuse it by its token count.
    """
    chars, bound = sum(_text_chars(row.get(c)) for c in cols.values()), max_row_bytes(max_length)
    if chars > bound:
        raise DataError(
            f"{where}: row holds {chars} characters of text, more than a row of data.max_length={max_length} "
            "tokens can take (64 per token, at least 1 MiB); shorten or drop the row, or raise "
            "data.max_length / data.seq_len"
        )
    messages = row_to_messages(fmt, cols, row, where)
    try:
        ids, labels = tokenize_messages(tokenizer, messages, where)
    except DataError:
        raise
    except Exception as err:  # jinja raises TemplateError and others from inside the template
        raise DataError(
            f"{where}: the chat template failed on this row ({type(err).__name__}: {err}); "
            "fix the row or the template, or use data.format='text'"
        ) from err
    return ids, (labels if assistant_only else list(ids))


def tokenize_texts(tokenizer, texts: list[Any], wheres: list[str]) -> list[list[int]]:
    """Token ids of plain-text rows (continued pretraining), each ending in the eos token.

    verbose=False: a document longer than the model's max length is expected here (it is cut into pieces).
    """
    for text, where in zip(texts, wheres):
        if not isinstance(text, str):
            raise DataError(f"{where}: text column must hold strings, got {type(text).__name__}")
        if len(text) > MAX_DOCUMENT_BYTES:
            raise DataError(
                f"{where}: the document holds {len(text)} characters, over {MAX_DOCUMENT_BYTES} (a document is "
                "tokenized whole before it is cut into data.max_length pieces); split it into several rows"
            )
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [ids + eos for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]]
