"""The Studio's Try tab as plain functions: which runs can answer, the sampling settings read from the widgets, one
Send from the prompt to the streamed reply. The widgets (workbench.ui.try_tab) only display what these hand them.

The model answers in the notebook's kernel, on one process (its first GPU, else the CPU), through
workbench.generation: the same loading and streaming `workbench generate` runs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workbench.config_checks import ConfigError
from workbench.errors import CheckpointError
from workbench.generation.load import RunModel, load_run_model
from workbench.generation.run_weights import EXPORT, RunWeights, find_run_dir, latest_weights, runs_with_weights
from workbench.generation.settings import GenerationSettings, check_prompt
from workbench.generation.stream import stream_reply
from workbench.runs.run_dir import RunDir
from workbench.runs.run_names import shown_name

NO_RUNS = "no run with weights yet"


@dataclass(frozen=True)
class RunChoice:
    """One run the picker offers: its label and its folder."""

    label: str
    run_dir: str


def choice_label(weights: RunWeights) -> str:
    """`id (name) · step N` for a checkpoint, `id (name) · export` for an hf/ export."""
    try:
        name = shown_name(RunDir(weights.run_dir).read_config().get("name"))
    except (OSError, ValueError):
        name = None
    where = "export" if weights.source == EXPORT else f"step {_step_of(weights.path)}"
    return f"{weights.run_dir.name}{f' ({name})' if name else ''} · {where}"


def _step_of(ckpt: Path) -> int | str:
    digits = ckpt.name.rpartition("-")[2]
    return int(digits) if digits.isdigit() else ckpt.name


def run_choices(runs_dir: str | os.PathLike) -> list[RunChoice]:
    """The runs of `runs_dir` that have weights, the most recently saved first (the picker's default)."""
    return [RunChoice(choice_label(w), str(w.run_dir)) for w in runs_with_weights(runs_dir)]


def read_settings(max_new_tokens: int, temperature: float, top_p: float, seed: int | None) -> GenerationSettings:
    """The widgets' values as GenerationSettings (ConfigError naming the bad one); a seed below 0 means none."""
    return GenerationSettings(
        max_new_tokens=int(max_new_tokens),
        temperature=float(temperature),
        top_p=float(top_p),
        seed=None if seed is None or int(seed) < 0 else int(seed),
    )


class Replier:
    """Answers prompts with a run's latest weights, keeping the last run's model loaded between Sends.

    The weights are looked up at each Send: once a run has saved a newer checkpoint, that one answers.
    """

    def __init__(self, device: str = "auto", load: Callable[[RunWeights, str], RunModel] = load_run_model) -> None:
        self.device = device
        self._load = load
        self.loaded: RunModel | None = None

    def model_for(self, run_dir: str | os.PathLike) -> RunModel:
        weights = latest_weights(find_run_dir(run_dir))
        if self.loaded is None or self.loaded.weights != weights:
            self.loaded = None  # the previous model goes before the next one loads
            self.loaded = self._load(weights, self.device)
        return self.loaded

    def send(
        self,
        run_dir: str | os.PathLike | None,
        prompt: str,
        settings: Callable[[], GenerationSettings],
        show_reply: Callable[[str], None],
        show_status: Callable[[str], None],
    ) -> str:
        """One Send: settings and prompt checked, the run's model loaded (once), the reply shown as it grows.

        `show_reply` gets the reply so far after each piece; `show_status` one line of what happens (a
        refusal or failure is said there, not raised). Returns the whole reply ("" when refused).
        """
        show_reply("")
        try:
            if not run_dir:
                raise ConfigError(f"{NO_RUNS}: train one (Setup tab) and press Refresh")
            chosen = settings()
            check_prompt(prompt)
            show_status(f"loading {Path(run_dir).name}…")
            loaded = self.model_for(run_dir)
            pieces = stream_reply(loaded, prompt, chosen)
        except (ConfigError, CheckpointError) as err:
            show_status(f"refused: {err}")
            return ""
        except Exception as err:  # noqa: BLE001 - said in the tab, where the user pressed Send
            show_status(f"failed loading the run: {type(err).__name__}: {err}")
            return ""
        where = choice_label(loaded.weights)
        show_status(f"answering with {where}")
        text, count, start = "", 0, time.perf_counter()
        try:
            for piece in pieces:
                text += piece
                count += 1
                show_reply(text)
        except Exception as err:  # noqa: BLE001
            show_status(f"failed while answering: {type(err).__name__}: {err}")
            return text
        seconds = time.perf_counter() - start
        show_status(
            f"{count} pieces in {seconds:.1f} s on {loaded.device} · {where}" if text else f"empty reply · {where}"
        )
        return text
