"""One reply, token by token: Transformers' generate() in a worker thread, its new text handed out as it comes.

Each new token's text is the decoded reply so far minus what was already handed out; a token that ends
inside a multi-byte character (decoded as U+FFFD) waits for the next one, so no piece is a broken
character. Closing the iterator early (a consumer that stops reading) stops the generation at its next token.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from workbench.config_checks import ConfigError
from workbench.generation.load import RunModel
from workbench.generation.settings import GenerationSettings, check_prompt
from workbench.train.data_tokenizer import pad_token_id

_DONE = object()
_REPLACEMENT = "\ufffd"


class _Pieces(BaseStreamer):
    """Receives generate()'s tokens (the prompt first, then one per step) and queues the new text of each."""

    def __init__(self, tokenizer: Any, out: queue.Queue) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded reply already queued
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        self.ids.extend(int(t) for t in value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith(_REPLACEMENT):
            self._send(text)

    def end(self) -> None:
        self._send(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _send(self, text: str) -> None:
        if len(text) > self.sent:
            self.out.put(text[self.sent :])
            self.sent = len(text)


class _Stop(StoppingCriteria):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def prompt_ids(loaded: RunModel, prompt: str, settings: GenerationSettings) -> torch.Tensor:
    """The prompt's token ids `[1, T]` on the model's device: through the chat template where there is one and asked."""
    tokenizer = loaded.tokenizer
    check_prompt(prompt)
    if settings.chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and len(ids) + settings.max_new_tokens > limit:
        raise ConfigError(
            f"the prompt ({len(ids)} tokens) and max_new_tokens ({settings.max_new_tokens}) exceed the model's "
            f"{limit} positions: lower max_new_tokens to {max(1, limit - len(ids))} or shorten the prompt"
        )
    return torch.tensor([ids], dtype=torch.long, device=loaded.device)


def generate_kwargs(loaded: RunModel, settings: GenerationSettings) -> dict[str, Any]:
    """generate()'s arguments for `settings`: the sampling ones, and the tokenizer's end and padding ids."""
    tokenizer = loaded.tokenizer
    kwargs = {**settings.generate_kwargs(), "pad_token_id": pad_token_id(tokenizer)}
    if tokenizer.eos_token_id is not None:
        kwargs["eos_token_id"] = tokenizer.eos_token_id
    return kwargs


def stream_reply(loaded: RunModel, prompt: str, settings: GenerationSettings) -> Iterator[str]:
    """The reply to `prompt` in pieces, each as soon as its token is sampled; the prompt is checked before any work."""
    ids = prompt_ids(loaded, prompt, settings)
    kwargs = generate_kwargs(loaded, settings)
    pieces: queue.Queue = queue.Queue()
    stop = threading.Event()
    failure: list[BaseException] = []

    def work() -> None:
        try:
            if settings.seed is not None:
                torch.manual_seed(settings.seed)  # also seeds every CUDA device
            with torch.inference_mode():
                loaded.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    streamer=_Pieces(loaded.tokenizer, pieces),
                    stopping_criteria=StoppingCriteriaList([_Stop(stop)]),
                    **kwargs,
                )
        except BaseException as err:  # noqa: BLE001 - handed to the reader, which raises it
            failure.append(err)
        finally:
            pieces.put(_DONE)

    worker = threading.Thread(target=work, name="workbench-generate", daemon=True)
    return _read(pieces, worker, stop, failure)


def _read(pieces: queue.Queue, worker: threading.Thread, stop: threading.Event, failure: list) -> Iterator[str]:
    worker.start()
    try:
        while (piece := pieces.get()) is not _DONE:
            yield piece
    finally:
        stop.set()
        worker.join()
    if failure:
        raise failure[0]
