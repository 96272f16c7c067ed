"""Training data: seeded synthetic tokens, or JSONL SFT rows rendered with the chat template.

Both sources become fixed-length sequences `[seq_len]` of (input_ids, labels, position_ids).
`TokenStream` serves them in a deterministic, seeded order; its only state is how many
sequences have been consumed, so a resumed run continues exactly where the checkpoint left off.
Every rank builds the same stream and takes its own contiguous slice of each global batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.errors import DataError
from workbench.train.data_files import max_row_bytes, scan_lines

IGNORE_INDEX = -100


@dataclass
class Batch:
    """Token tensors `[B, S]`; labels are -100 where no loss is taken (prompts, padding)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> Batch:
        return Batch(self.input_ids[start:stop], self.labels[start:stop], self.position_ids[start:stop])

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.input_ids.to(device), self.labels.to(device), self.position_ids.to(device))

    def num_loss_tokens(self) -> int:
        """Tokens that enter the loss: labels are shifted left by one inside the model."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


class TokenCheck:
    """What the model needs of packed sequences, gathered over blocks of them: ids in its vocabulary,
    labels that are -100 or in it, and at least one label to train on.

    The embedding and the loss would otherwise fail deep inside the first step (an IndexError), or a
    run would "train" on nothing but the aux loss.
    """

    def __init__(self) -> None:
        self.id_range = (0, -1)  # (lowest, highest) token id seen; empty while highest < lowest
        self.label_range = (0, -1)  # the same over the labels that enter the loss
        self.loss_tokens = 0  # labels after the first of a sequence that are not -100 (the shifted loss)

    def add(self, ids: np.ndarray, labels: np.ndarray) -> None:
        """Take in a block `[n, seq_len]` of input ids and labels."""
        if ids.size:
            self.id_range = _widen(self.id_range, int(ids.min()), int(ids.max()))
        kept = labels[labels != IGNORE_INDEX]
        if kept.size:
            self.label_range = _widen(self.label_range, int(kept.min()), int(kept.max()))
        self.loss_tokens += int((labels[:, 1:] != IGNORE_INDEX).sum())

    def refuse(self, vocab_size: int, where: str, masked_fix: str) -> None:
        """Raise a DataError naming `where` if the sequences cannot train a model of `vocab_size` tokens."""
        if self.loss_tokens == 0:
            raise DataError(f"{where}: every label is masked, so there is no token to train on; {masked_fix}")
        for what, (low, high) in (("token id", self.id_range), ("label", self.label_range)):
            bad = low if low < 0 else high if high >= vocab_size else None
            if bad is not None:
                raise DataError(
                    f"{where}: {what} {bad} is outside the model's vocabulary (vocab_size {vocab_size}: ids 0 to "
                    f"{vocab_size - 1}); the tokenizer does not match the model: use the model's own tokenizer "
                    "(data.tokenizer), or a model whose vocab_size covers every id"
                )

    @classmethod
    def of(cls, batch: Batch) -> TokenCheck:
        check = cls()
        check.add(batch.input_ids.numpy(), batch.labels.numpy())
        return check


def _widen(bounds: tuple[int, int], low: int, high: int) -> tuple[int, int]:
    return (low, high) if bounds[1] < bounds[0] else (min(bounds[0], low), max(bounds[1], high))


# ---------------------------------------------------------------------------------------------
# JSONL SFT rows


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
    return path


def load_tokenizer(path: str | Path, require_template: bool = True):
    """A local tokenizer directory (no hub access)."""
    from transformers import AutoTokenizer

    path = check_tokenizer_dir(path)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if require_template and not getattr(tok, "chat_template", None):
        raise DataError(f"tokenizer {path} has no chat template; SFT rows are rendered through it")
    return tok


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


def require_datasets():
    """The `datasets` module, or a DataError saying how to install it (the data kinds that read files need it)."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading data files needs the `datasets` library (data.kind 'jsonl' and 'datasets'): pip install datasets"
        ) from None
    return datasets


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


def iter_packed(examples, seq_len: int, pack: bool = True):
    """(ids, labels, position_ids) lists per sequence: greedy packing in order (or one example each).

    position_ids restart at 0 for every example, which makes Transformers' mask block-diagonal
    (no attention across packed examples). A packed example's first label is -100: the shifted loss would
    otherwise predict it from the previous example's last token (a row's first label is never a target).
    Sequences come unpadded (at most seq_len long).
    """
    cur: tuple[list[int], list[int], list[int]] = ([], [], [])
    for ids, labels in examples:
        if cur[0] and (not pack or len(cur[0]) + len(ids) > seq_len):
            yield cur
            cur = ([], [], [])
        if cur[0] and len(labels):  # not the row's first example: its first token is no target
            labels = [IGNORE_INDEX, *labels[1:]]
        cur[0].extend(ids)
        cur[1].extend(labels)
        cur[2].extend(range(len(ids)))
    if cur[0]:
        yield cur


def pad_sequence_into(
    out_ids, out_labels, out_pos, ids: list[int], labels: list[int], pos: list[int], pad_id: int
) -> None:
    """Write one packed sequence into numpy rows of fixed width; padding gets label -100 and its own positions."""
    k, seq_len = len(ids), out_ids.shape[-1]
    out_ids[:k], out_ids[k:] = ids, pad_id
    out_labels[:k], out_labels[k:] = labels, IGNORE_INDEX
    out_pos[:k] = pos
    out_pos[k:] = np.arange(seq_len - k)  # padding is its own "document"


def pack_examples(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int, pack: bool = True) -> Batch:
    """Fixed-length sequences `[n, seq_len]` from `iter_packed`, in memory."""
    seqs = list(iter_packed(examples, seq_len, pack))
    n = len(seqs)
    arrays = [np.empty((n, seq_len), dtype=np.int64) for _ in range(3)]
    for i, (ids, labels, pos) in enumerate(seqs):
        pad_sequence_into(*(a[i] for a in arrays), ids, labels, pos, pad_id)
    return Batch(*(torch.from_numpy(a) for a in arrays))


# ---------------------------------------------------------------------------------------------
# The stream


class TokenStream:
    """Deterministic, resumable source of global batches (same on every rank)."""

    def __init__(
        self, sequences: Batch | None, *, seed: int, seq_len: int, vocab_size: int | None = None, eval_sequences=None
    ) -> None:
        self.sequences = sequences  # a Batch, or anything with len() and .slice() (data_cache.MappedSequences)
        self.eval_sequences = eval_sequences  # held-out sequences for eval (kind="datasets"), or None
        self.seed = seed
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.consumed = 0  # sequences handed out so far, over all ranks
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None
        if sequences is None and vocab_size is None:
            raise ValueError("synthetic data needs vocab_size")

    @property
    def num_sequences(self) -> int | None:
        return None if self.sequences is None else len(self.sequences)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(len(self.sequences), generator=g)
            self._perm_epoch = epoch
        return self._perm

    def _synthetic(self, index: int) -> Batch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        ids = torch.randint(0, self.vocab_size, (1, self.seq_len), generator=g)
        return Batch(ids, ids.clone(), torch.arange(self.seq_len).unsqueeze(0))

    def _sequence(self, index: int) -> Batch:
        if self.sequences is None:
            return self._synthetic(index)
        n = len(self.sequences)
        j = int(self._permutation(index // n)[index % n])
        return self.sequences.slice(j, j + 1)

    def next_batch(self, global_batch_size: int, start: int = 0, stop: int | None = None) -> Batch:
        """Sequences [start, stop) of the next global batch; advances past the whole batch."""
        stop = global_batch_size if stop is None else stop
        first = self.consumed
        parts = [self._sequence(first + i) for i in range(start, stop)]
        self.consumed += global_batch_size
        return Batch(*(torch.cat([getattr(p, f) for p in parts]) for f in ("input_ids", "labels", "position_ids")))

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed") != self.seed:
            raise ValueError(f"checkpoint data stream used seed {state.get('seed')}, this run uses {self.seed}")
        self.consumed = int(state["consumed"])


def build_stream(
    data_cfg, seed: int, vocab_size: int, model_path: str | None = None, runs_dir: str | None = None
) -> TokenStream:
    """The TokenStream for a DataConfig: JSONL tokenized in memory, `datasets` through the on-disk cache."""
    if data_cfg.kind == "synthetic":
        return TokenStream(None, seed=seed, seq_len=data_cfg.seq_len, vocab_size=vocab_size)
    tokenizer_dir = resolve_tokenizer_dir(data_cfg, model_path)
    if data_cfg.kind == "datasets":
        from workbench.train.data_cache import build_cached

        train, held_out = build_cached(data_cfg, tokenizer_dir, vocab_size, runs_dir)
        return TokenStream(train, seed=seed, seq_len=data_cfg.seq_len, eval_sequences=held_out)
    tokenizer = load_tokenizer(tokenizer_dir)
    check_vocab(len(tokenizer), tokenizer_dir, vocab_size)
    examples = load_sft_examples(data_cfg.resolved_path, tokenizer, data_cfg.example_max_length)
    sequences = pack_examples(examples, data_cfg.seq_len, pad_token_id(tokenizer), data_cfg.pack)
    TokenCheck.of(sequences).refuse(
        vocab_size, f"{data_cfg.resolved_path} (tokenized with {tokenizer_dir})", "rows need non-empty responses"
    )
    return TokenStream(sequences, seed=seed, seq_len=data_cfg.seq_len)


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
