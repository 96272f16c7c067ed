"""SFT rows as chat messages, and their tokens: JSONL rows read and checked line by line, each row's messages
refused by name when they cannot be trained on, and tokenized through the chat template with loss only on the
assistant turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.errors import DataError
from workbench.train.data_batch import IGNORE_INDEX
from workbench.train.data_files import max_row_bytes, require_datasets, scan_lines


def _row_line_numbers(path: Path, max_length: int) -> list[int]:
    """1-based line numbers of the non-blank lines, each UTF-8 and within `max_row_bytes(max_length)`."""
    max_bytes = max_row_bytes(max_length)
    too_long = (
        f"more than a row of data.max_length={max_length} tokens can take (64 bytes per token, at least "
        "1 MiB); shorten or drop the row, or write one JSON object per line"
    )
    return scan_lines(path, max_bytes, too_long, "the dataset must be UTF-8 JSON lines (one JSON object per line)")


def _first_bad_json_line(path: Path) -> str:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                return f"{path}:{i}: not valid JSON ({err.msg})"
            if not isinstance(obj, dict):
                return f"{path}:{i}: each line must be a JSON object, got {type(obj).__name__}"
    return f"{path}: could not be read as JSON lines"


def read_jsonl_rows(path: str | Path, max_length: int) -> list[tuple[int, dict]]:
    """(line number, row) pairs read through `datasets.load_dataset("json")` from a local file.

    Every line must be UTF-8 and within `max_row_bytes(max_length)`; both are checked before parsing.
    """
    datasets = require_datasets()

    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"dataset file {path} does not exist")
    lines = _row_line_numbers(path, max_length)
    if not lines:
        raise DataError(f"dataset file {path} is empty")
    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()  # keep per-rank progress bars out of notebook cells
    try:
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
    except Exception as err:  # datasets/pyarrow raise many types; find and name the line ourselves
        raise DataError(_first_bad_json_line(path)) from err
    finally:
        if bars_were_on:
            datasets.utils.enable_progress_bars()
    if len(ds) != len(lines):
        raise DataError(
            f"{path}: datasets read {len(ds)} rows from {len(lines)} non-blank lines; write one JSON object per line"
        )
    return list(zip(lines, ds))


def text_message(message: Any, label: str, where: str, fmt: str) -> dict:
    """{"role", "content"} of one chat message; tool calls and structured content are refused by name."""
    if isinstance(message, dict):
        # datasets gives every message of a column the union of their keys: an absent key reads as None
        calls = next((k for k in ("tool_calls", "function_call") if message.get(k)), None)
        if calls:
            raise DataError(
                f"{where}: {label} has {calls!r}: tool calls are not supported (a row trains on text turns, "
                "each a string 'role' and 'content'); drop the row, or write the call into the content as text"
            )
        if isinstance(message.get("role"), str) and isinstance(message.get("content"), str):
            return {"role": message["role"], "content": message["content"]}
        if isinstance(message.get("content"), list):
            raise DataError(
                f"{where}: {label} has 'content' as a list of parts: structured or multimodal content is not "
                "supported; write the message as one string"
            )
    raise DataError(f"{where}: {label} needs string 'role' and 'content'; {fmt}")


def row_messages(row: dict, where: str) -> list[dict]:
    """Chat messages of a row: {"prompt", "response"} or {"messages": [{"role", "content"}]}."""
    fmt = (
        "rows need 'prompt' and 'response' strings, or 'messages': a list of "
        "{'role', 'content'} with at least one assistant turn"
    )
    messages = row.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list; {fmt}")
        out = [text_message(m, f"messages[{i}]", where, fmt) for i, m in enumerate(messages)]
        if not any(m["role"] == "assistant" for m in out):
            raise DataError(f"{where}: no assistant message to learn from; {fmt}")
        return out
    missing = [k for k in ("prompt", "response") if not isinstance(row.get(k), str)]
    if missing:
        raise DataError(f"{where}: row is missing {missing} (or they are not strings); {fmt}")
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]


def tokenize_messages(tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """Token ids and labels: loss only on assistant turns (their text and end-of-turn token).

    The conversation is rendered incrementally with the chat template; each new piece of text is
    tokenized on its own, so the prompt/response boundary is exact in token space.
    """

    def render(msgs: list[dict], gen: bool) -> str:
        if not msgs and not gen:
            return ""
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    ids: list[int] = []
    labels: list[int] = []
    done = ""
    for k, message in enumerate(messages):
        pieces: list[tuple[str, bool]] = []
        if message["role"] == "assistant":
            prompt = render(messages[:k], True)
            pieces.append((prompt, False))
        full = render(messages[: k + 1], False)
        pieces.append((full, message["role"] == "assistant"))
        for text, trained in pieces:
            if not text.startswith(done):
                raise DataError(
                    f"{where}: the tokenizer's chat template is not prefix-stable, so "
                    "the prompt cannot be masked exactly"
                )
            new = text[len(done) :]
            done = text
            piece_ids = tokenizer(new, add_special_tokens=False)["input_ids"] if new else []
            ids.extend(piece_ids)
            labels.extend(piece_ids if trained else [IGNORE_INDEX] * len(piece_ids))
    return ids, labels


def load_sft_examples(path: str | Path, tokenizer, max_length: int) -> list[tuple[list[int], list[int]]]:
    """Tokenized (ids, labels) per row; malformed or too-long rows raise naming file and line."""
    path = Path(path).expanduser()
    examples = []
    for line, row in read_jsonl_rows(path, max_length):
        where = f"{path}:{line}"
        ids, labels = tokenize_messages(tokenizer, row_messages(dict(row), where), where)
        if len(ids) > max_length:
            raise DataError(
                f"{where}: row is {len(ids)} tokens, over data.max_length={max_length}; "
                "shorten or drop the row, or raise data.max_length / data.seq_len"
            )
        examples.append((ids, labels))
    return examples
