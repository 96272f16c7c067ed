"""RunPanel: training settings, start / stop, the run's progress bar."""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipywidgets as W

from workbench.config import (
    DATA_FILE_BUILDERS,
    DATA_KINDS,
    LORA_TARGETS,
    ConfigError,
    DataConfig,
    LoraConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
)
from workbench.ui.panels import WIDE, fit_layout, wrap_row
from workbench.ui.run_title import run_config_of, run_title_html
from workbench.ui.summary import ProgressLine


class RunPanel:
    """Steps, batch, sequence length, data; Start sends the RunConfig to the cluster, Stop ends it.

    `model`, `mesh` and `backend` are the other panels (any may be None: then the demo's choice).
    """

    def __init__(
        self,
        cluster: Any = None,
        model: Any = None,
        mesh: Any = None,
        backend: Any = None,
        runs_dir: str | None = None,
        steps: int = 20,
    ) -> None:
        self.cluster, self.model, self.mesh, self.backend = cluster, model, mesh, backend
        num = dict(style=WIDE, layout=W.Layout(width="200px"))
        self.steps = W.BoundedIntText(value=steps, min=1, max=10**7, description="steps", **num)
        self.seq_len = W.BoundedIntText(value=128, min=2, max=1 << 20, description="seq len", **num)
        self.global_batch = W.BoundedIntText(value=8, min=1, max=1 << 20, description="global batch", **num)
        self.local_batch = W.BoundedIntText(value=4, min=1, max=1 << 20, description="local batch", **num)
        self.lr = W.FloatText(value=3e-3, description="lr", **num)
        self.data_kind = W.Dropdown(
            options=list(DATA_KINDS),
            value="jsonl",
            description="data",
            style=WIDE,
            layout=W.Layout(width="max-content"),
        )
        self.data_path = W.Text(
            placeholder="jsonl file (empty: the shipped tiny SFT set); datasets: a parquet/"
            "json/csv file or a save_to_disk folder",
            description="path",
            style=WIDE,
            layout=W.Layout(width="100%"),
        )
        self.activation_checkpointing = W.Checkbox(
            value=False, description="activation checkpointing", indent=False, layout=fit_layout()
        )
        # train.cuda_graphs: the decoder stack replayed as CUDA graphs (one GPU; host-bound steps such as LoRA)
        self.cuda_graphs = W.Checkbox(
            value=False,
            description="CUDA graphs",
            indent=False,
            layout=fit_layout(),
            tooltip="replay the decoder layers as CUDA graphs: one GPU, no activation checkpointing (LoRA steps "
            "stop waiting on Python)",
        )
        # train.optimizer_states: AdamW's two moments in one byte each (blockwise scales, stochastic rounding)
        self.adamw_8bit = W.Checkbox(
            value=False,
            description="8-bit AdamW moments",
            indent=False,
            layout=fit_layout(),
            tooltip="keep AdamW's moments in 8 bits: about 2 bytes less per bf16 parameter (train.optimizer_states)",
        )
        self.save_checkpoint = W.Checkbox(
            value=True, description="save final checkpoint", indent=False, layout=fit_layout()
        )
        # LoRA (RunConfig.lora): off = full fine-tuning
        self.lora = W.Checkbox(value=False, description="LoRA", indent=False, layout=fit_layout())
        self.lora_rank = W.BoundedIntText(value=16, min=1, max=4096, description="rank", **num)
        self.lora_alpha = W.BoundedFloatText(value=32.0, min=1e-6, max=1e6, description="alpha", **num)
        self.lora_targets = W.SelectMultiple(
            options=list(LORA_TARGETS),
            value=("attention", "experts"),
            description="targets",
            rows=len(LORA_TARGETS),
            style=WIDE,
            layout=W.Layout(width="auto"),
        )
        self.runs_dir = W.Text(
            value=runs_dir or "",
            placeholder="runs directory (empty: default)",
            description="runs dir",
            style=WIDE,
            layout=W.Layout(width="100%"),
        )
        self.start_button = W.Button(
            description="Start",
            button_style="success",
            icon="play",
            layout=fit_layout(),
            tooltip="start the run the Setup tab describes",
        )
        self.stop_button = W.Button(
            description="Stop",
            button_style="danger",
            icon="stop",
            disabled=True,
            layout=fit_layout(),
            tooltip="stop at the next step boundary (checkpoints first)",
        )
        self.buttons = wrap_row([self.start_button, self.stop_button])
        self.status = W.HTML()
        self.progress = W.Box()
        self.run = None
        self._listeners: list[Callable[[Any], None]] = []
        self._changed_listeners: list[Callable[[], None]] = []
        self.start_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.stop())
        for w in (
            self.seq_len,
            self.local_batch,
            self.activation_checkpointing,
            self.adamw_8bit,
            self.lora,
            self.lora_rank,
            self.lora_targets,
        ):
            w.observe(lambda _: self._notify_changed(), "value")
        self.widget = W.VBox(
            [
                W.HTML("<b>Run</b>"),
                wrap_row([self.steps, self.lr, self.global_batch, self.local_batch, self.seq_len, self.data_kind]),
                self.data_path,
                wrap_row([self.activation_checkpointing, self.cuda_graphs, self.adamw_8bit, self.save_checkpoint]),
                wrap_row([self.lora, self.lora_rank, self.lora_alpha, self.lora_targets]),
                self.runs_dir,
                self.buttons,
                self.progress,
                self.status,
            ]
        )

    def _say(self, text: str) -> None:
        # Paths and run ids are long unbroken words: let them break rather than run out of the tab.
        self.status.value = f"<div style='overflow-wrap:anywhere'>{text}</div>"

    def on_run(self, fn: Callable[[Any], None]) -> None:
        """Call fn(run) for every run this panel starts (e.g. LivePlots.attach)."""
        self._listeners.append(fn)

    def on_change(self, fn: Callable[[], None]) -> None:
        """Call fn() when a setting that changes memory use changes."""
        self._changed_listeners.append(fn)

    def _notify_changed(self) -> None:
        for fn in list(self._changed_listeners):
            fn()

    def training(self) -> dict[str, Any]:
        """What the memory estimate needs from this panel."""
        try:
            lora = self.lora_config()
        except ConfigError:
            lora = None  # run_config() says what is wrong
        return {
            "seq_len": self.seq_len.value,
            "local_batch": self.local_batch.value,
            "activation_checkpointing": self.activation_checkpointing.value,
            "lora": lora,
            "optimizer_states": self.optimizer_states(),
        }

    def optimizer_states(self) -> str:
        """train.optimizer_states the checkbox stands for."""
        return "8bit" if self.adamw_8bit.value else "full"

    def lora_config(self) -> LoraConfig | None:
        """The LoRA section the LoRA widgets describe, None when LoRA is off."""
        if not self.lora.value:
            return None
        return LoraConfig(
            rank=self.lora_rank.value, alpha=float(self.lora_alpha.value), targets=tuple(self.lora_targets.value)
        )

    def run_config(self) -> RunConfig:
        """The RunConfig all panels describe (ConfigError / MeshError / BackendError say what is wrong)."""
        path, kind = self.data_path.value.strip() or None, self.data_kind.value
        where: dict[str, Any] = {"path": path if kind == "jsonl" else None}
        if kind == "datasets":  # a file with a known extension is data_files, anything else a folder or name
            is_file = path is not None and Path(path).suffix.lower() in DATA_FILE_BUILDERS
            where = {"data_files": path} if is_file else {"path": path}
        data = DataConfig(kind=kind, seq_len=self.seq_len.value, pack=True, **where)
        train = TrainConfig(
            steps=self.steps.value,
            global_batch_size=self.global_batch.value,
            local_batch_size=self.local_batch.value,
            lr=float(self.lr.value),
            warmup_steps=min(2, self.steps.value - 1) if self.steps.value > 1 else 0,
            activation_checkpointing=self.activation_checkpointing.value,
            cuda_graphs=self.cuda_graphs.value,
            optimizer_states=self.optimizer_states(),
            save_final_checkpoint=self.save_checkpoint.value,
        )
        kwargs: dict[str, Any] = {
            "data": data,
            "train": train,
            "lora": self.lora_config(),
            "output_dir": self.runs_dir.value.strip() or None,
        }
        kwargs["model"] = self.model.model_config() if self.model is not None else ModelConfig()
        if self.mesh is not None:
            kwargs["mesh"] = self.mesh.mesh_config()
        if self.backend is not None:
            kwargs["backend"] = self.backend.backend_config()
        config = RunConfig(**kwargs)
        if config.mesh is not None:
            train.accumulation_steps(config.mesh.dp)  # batch sizes must split over dp: say so now
        return config

    def start(self, config: RunConfig | None = None):
        """Start `config` (default: the panels' config) on the cluster; returns the Run or None."""
        if self.cluster is None:
            self._say("<span style='color:#b00020'>no cluster: RunPanel(cluster=...)</span>")
            return None
        if self.run is not None and not self.run.done:
            self._say("a run is in progress; stop it first")
            return None
        try:
            config = config or self.run_config()
            run = self.cluster.finetune(config)
        except (ConfigError, ValueError, TypeError, RuntimeError, FileExistsError) as err:
            self._say(f"<span style='color:#b00020'>{html.escape(str(err))}</span>")
            return None
        self.run = run
        self._say(f"run {run_title_html(run.run_id, run_config_of(run))} in {html.escape(str(run.path))}")
        self.progress.children = [ProgressLine(run).widget]
        self.start_button.disabled, self.stop_button.disabled = True, False  # one run at a time
        run.on_metrics(lambda _: self._on_progress())
        for fn in list(self._listeners):
            fn(run)
        return run

    def _on_progress(self) -> None:
        if self.run is not None and self.run.done:
            self.start_button.disabled, self.stop_button.disabled = False, True
            error = self.run.error
            state = self.run.state
            text = f"run {run_title_html(self.run.run_id, run_config_of(self.run))} {state}"
            if error is not None:
                text += f": rank {error.rank} failed<pre>{html.escape(error.traceback[-1500:])}</pre>"
            self._say(text)

    def stop(self) -> None:
        """Ask the run to stop at the next step boundary (it checkpoints first)."""
        if self.run is not None and not self.run.done:
            self.run.stop(wait=False)
            self._say(f"stopping <code>{html.escape(self.run.run_id)}</code> at the next step")
