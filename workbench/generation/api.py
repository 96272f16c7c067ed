"""The functions behind `workbench.generate` / `workbench.generate_stream` and the CLI: find, load, stream."""

from __future__ import annotations

import os
from collections.abc import Iterator

from workbench.generation.load import RunModel, load_run_model
from workbench.generation.run_weights import RunWeights, find_run_dir, latest_weights, runs_with_weights
from workbench.generation.settings import GenerationSettings, check_prompt
from workbench.generation.stream import stream_reply

__all__ = [
    "GenerationSettings",
    "RunModel",
    "RunWeights",
    "check_prompt",
    "find_run_dir",
    "generate",
    "generate_stream",
    "latest_weights",
    "load",
    "load_run_model",
    "runs_with_weights",
    "stream_reply",
]


def load(run: str | os.PathLike, runs_dir: str | os.PathLike | None = None, device: str = "auto") -> RunModel:
    """Run `run`'s latest weights and tokenizer, loaded on `device` ("auto", "cpu" or "cuda")."""
    return load_run_model(latest_weights(find_run_dir(run, runs_dir)), device)


def generate_stream(
    run: str | os.PathLike | RunModel,
    prompt: str,
    *,
    max_new_tokens: int = GenerationSettings.max_new_tokens,
    temperature: float = GenerationSettings.temperature,
    top_p: float = GenerationSettings.top_p,
    seed: int | None = None,
    chat_template: bool = True,
    runs_dir: str | os.PathLike | None = None,
    device: str = "auto",
) -> Iterator[str]:
    """The reply of run `run` (a run folder, a run id, or what `load` returned) to `prompt`, piece by piece.

    temperature 0 is greedy decoding; `seed` makes a sampled reply repeatable. Settings and the run are
    checked before anything is loaded (workbench.ConfigError, CheckpointError).
    """
    settings = GenerationSettings(max_new_tokens, temperature, top_p, seed, chat_template)
    check_prompt(prompt)
    loaded = run if isinstance(run, RunModel) else load(run, runs_dir, device)
    return stream_reply(loaded, prompt, settings)


def generate(run: str | os.PathLike | RunModel, prompt: str, **settings) -> str:
    """The whole reply of run `run` to `prompt` (generate_stream's arguments)."""
    return "".join(generate_stream(run, prompt, **settings))
