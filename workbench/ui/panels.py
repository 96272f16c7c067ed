"""Setup panels: ModelPanel, MeshPanel, BackendPanel, RunPanel (ipywidgets 8).

Each panel shows what `workbench.ui.logic` / `workbench.ui.memory` compute and hands back a piece of
the RunConfig; none of them builds a model.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import ipywidgets as W

from workbench.backends import CHOICES, BackendConfig
from workbench.config import DTYPES, PRESETS, ConfigError, ModelConfig
from workbench.parallel.mesh import MeshConfig
from workbench.ui.logic import (
    CUSTOM_CHECKPOINT,
    backend_choices,
    format_params,
    fused_ce_choice,
    model_mesh_options,
    model_summary,
    preset_options,
    resolve_auto,
)
from workbench.ui.memory import estimate_memory
from workbench.ui.mesh_plan import chosen_plan_html, mesh_plans, mesh_plans_html


def _error_html(text: str) -> str:
    return f"<span style='color:#b00020'>{html.escape(text)}</span>" if text else ""


# Labels and descriptions take the width their text needs: a fixed width cut them off ("global bat…").
WIDE = {"description_width": "initial"}
# Settings that exist for benchmarks, not for training a model: shown apart from the real choices.
BENCHMARK_FIELDS = ("gate",)


def fit_layout() -> W.Layout:
    """A control as wide as its content, never squeezed (a row wraps instead)."""
    return W.Layout(width="auto", flex="0 0 auto")


def wrap_row(children: list, **layout: Any) -> W.HBox:
    """A row that wraps onto the next line on a narrow notebook instead of cutting its children off."""
    return W.HBox(children, layout=W.Layout(flex_flow="row wrap", align_items="center", **layout))


def unavailable_html(reasons: list[tuple[str, str]]) -> str:
    """One collapsible line listing the choices the ranks cannot run and why (empty when none)."""
    if not reasons:
        return ""
    items = "".join(f"<li><code>{html.escape(name)}</code>: {html.escape(why)}</li>" for name, why in reasons)
    return (
        f"<details class='mwb-unavailable' style='color:#666;font-size:12px'><summary>{len(reasons)} "
        "choices unavailable on these ranks (greyed out; hover one for why)</summary>"
        f"<ul style='margin:2px 0 0 0'>{items}</ul></details>"
    )


class ModelPanel:
    """A preset (listed by family with total and active parameters) with a layer count, or a local checkpoint."""

    def __init__(
        self, preset: str = "tiny", layers: int | None = None, path: str | None = None, dtype: str = "auto"
    ) -> None:
        options = [(o.label, o.name) for o in preset_options()]
        self.preset = W.Dropdown(
            options=[*options, (CUSTOM_CHECKPOINT, CUSTOM_CHECKPOINT)],
            description="model",
            style=WIDE,
            layout=W.Layout(width="max-content", max_width="100%"),
        )
        self.layers = W.BoundedIntText(
            min=1, max=1024, description="layers", style=WIDE, layout=W.Layout(width="150px")
        )
        self.path = W.Text(
            placeholder="/path/to/checkpoint (config.json + safetensors)",
            description="path",
            style=WIDE,
            layout=W.Layout(width="100%"),
        )
        self.dtype = W.Dropdown(
            options=list(DTYPES), value=dtype, description="dtype", style=WIDE, layout=W.Layout(width="max-content")
        )
        self.summary = W.HTML()
        self.error = W.HTML()
        self._listeners: list[Callable[[], None]] = []
        self._cache: tuple[ModelConfig, Any] | None = None
        self.preset.value = CUSTOM_CHECKPOINT if path else preset
        self.path.value = path or ""
        self.layers.value = layers or self._preset_layers(self.preset.value)
        self.preset.observe(self._on_preset, "value")
        for w in (self.layers, self.path, self.dtype):
            w.observe(lambda _: self._changed(), "value")
        self.widget = W.VBox(
            [
                W.HTML("<b>Model</b>"),
                wrap_row([self.preset, self.layers, self.dtype]),
                self.path,
                self.summary,
                self.error,
            ]
        )
        self._sync_path_visibility()
        self._changed()

    @staticmethod
    def _preset_layers(name: str) -> int:
        return PRESETS[name].layers if name in PRESETS else 1

    def _on_preset(self, change: dict) -> None:
        if change["new"] in PRESETS:
            self.layers.value = self._preset_layers(change["new"])
        self._sync_path_visibility()
        self._changed()

    def _sync_path_visibility(self) -> None:
        self.path.layout.display = "" if self.preset.value == CUSTOM_CHECKPOINT else "none"

    def on_change(self, fn: Callable[[], None]) -> None:
        """Call fn() whenever the model changes."""
        self._listeners.append(fn)

    def _changed(self) -> None:
        cfg = self.hf_config()
        if cfg is not None:
            s = model_summary(cfg)
            shared = f" + {s['shared_experts']} shared" if s["shared_experts"] else ""
            self.summary.value = (
                f"{s['model_type']}: {s['layers']} layers, hidden {s['hidden']}, "
                f"{s['experts']} experts (top-{s['top_k']}){shared}, "
                f"{format_params(s['params'])} params, {format_params(s['active_params'])} active"
            )
        else:
            self.summary.value = ""
        for fn in list(self._listeners):
            fn()

    def model_config(self) -> ModelConfig:
        """The ModelConfig the widgets describe (raises ConfigError if they describe none)."""
        if self.preset.value == CUSTOM_CHECKPOINT:
            path = self.path.value.strip()
            if not path:
                raise ConfigError("enter the directory of a local checkpoint (it holds config.json)")
            return ModelConfig(preset=None, path=path, layers=None, dtype=self.dtype.value)
        return ModelConfig(preset=self.preset.value, layers=self.layers.value, dtype=self.dtype.value)

    def hf_config(self) -> Any | None:
        """The transformers config of the chosen model, or None (the reason is shown)."""
        try:
            model = self.model_config()
            if self._cache is None or self._cache[0] != model:
                self._cache = (model, model.hf_config())
            self.error.value = ""
            return self._cache[1]
        except (ConfigError, OSError, ValueError) as err:
            self.error.value = _error_html(str(err))
            return None


class MeshPanel:
    """Only the dp x ep meshes that fit the cluster and the model; experts, and each mesh's plan: memory per rank,
    tokens/s per GPU, and why a mesh would not fit (workbench.ui.mesh_plan)."""

    def __init__(
        self,
        world_size: int,
        device_type: str = "cpu",
        device_memory_gib: float | None = None,
        device_name: str | None = None,
    ) -> None:
        self.world_size = world_size
        self.device_type = device_type
        self.device_memory_gib = device_memory_gib
        self.device_name = device_name  # the GPU's name: which datasheet figures the plan uses
        self.mesh = W.Dropdown(description="mesh", style=WIDE, layout=W.Layout(width="max-content", max_width="100%"))
        self.details = W.HTML()
        self._cfg: Any = None
        self._training = dict(
            seq_len=128,
            local_batch=4,
            dtype="auto",
            activation_checkpointing=False,
            fused_ce="auto",  # BackendConfig.fused_ce as set; the estimate asks what it becomes for the model
            lora=None,
            optimizer_states="full",
        )
        self._listeners: list[Callable[[], None]] = []
        self.mesh.observe(lambda _: self._changed(), "value")
        self.widget = W.VBox([W.HTML(f"<b>Mesh</b> ({world_size} ranks, {device_type})"), self.mesh, self.details])

    def on_change(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def set_model(self, hf_config: Any) -> None:
        """Offer the meshes valid for this model's expert count."""
        self._cfg = hf_config
        if hf_config is None:
            self.mesh.options, self.details.value = [], ""
            return
        previous = self.mesh.value.mesh if self.mesh.value is not None else None
        options = model_mesh_options(self.world_size, hf_config)
        self.mesh.options = [(o.label, o) for o in options]
        # Keep the user's choice if it still fits, else the widest expert split.
        keep = [o for o in options if o.mesh == previous]
        self.mesh.value = keep[0] if keep else options[-1]
        self._changed()

    def set_training(self, **training: Any) -> None:
        """seq_len, local_batch, dtype, activation_checkpointing, fused_ce, lora, optimizer_states for the estimate."""
        self._training.update(training)
        self._changed()

    def mesh_config(self) -> MeshConfig | None:
        return self.mesh.value.mesh if self.mesh.value is not None else None

    def memory_estimate(self):
        """The MemoryEstimate of one rank for the chosen mesh, or None."""
        mesh = self.mesh_config()
        if mesh is None or self._cfg is None:
            return None
        t = self._training
        return estimate_memory(
            self._cfg,
            mesh.dp,
            mesh.ep,
            seq_len=t["seq_len"],
            local_batch=t["local_batch"],
            dtype=t["dtype"],
            device_type=self.device_type,
            activation_checkpointing=t["activation_checkpointing"],
            fused_ce=fused_ce_choice(t["fused_ce"], self._cfg)[0],
            lora=t.get("lora"),
            optimizer_states=t.get("optimizer_states", "full"),
        )

    def _changed(self) -> None:
        option = self.mesh.value
        if option is None or self._cfg is None:
            self.details.value = ""
        else:
            ranges = ", ".join(f"ep rank {i}: experts {a}-{b - 1}" for i, (a, b) in enumerate(option.expert_ranges))
            experts = f"{option.experts_per_rank} experts per rank ({ranges})" if ranges else "no routed experts"
            plans = mesh_plans(
                self._cfg,
                [o for _, o in self.mesh.options],
                self._training,
                self.device_type,
                self.device_memory_gib,
                self.device_name,
            )
            chosen = next((mp for mp in plans if mp.option == option), None)
            extra = f"<br>{chosen_plan_html(chosen, self._cfg)}" if chosen is not None else ""
            self.details.value = f"{experts}<br>{mesh_plans_html(plans, option)}{extra}"
        for fn in list(self._listeners):
            fn()


class ChoiceRow:
    """One BackendConfig field as toggle buttons; unavailable choices are disabled, the reason on hover."""

    def __init__(self, field: str, choices: list, value: str) -> None:
        self.field = field
        self.buttons: dict[str, W.ToggleButton] = {}
        for c in choices:
            self.buttons[c.value] = W.ToggleButton(description=c.value, value=c.value == value, layout=fit_layout())
            self.buttons[c.value].observe(self._on_toggle(c.value), "value")
        self.auto = W.HTML(layout=fit_layout())
        self.reasons: list[tuple[str, str]] = []  # (field.choice, why) of the disabled choices
        label = W.Label(field, layout=W.Layout(width="auto", min_width="104px", flex="0 0 auto"))
        self.widget = wrap_row([label, *self.buttons.values(), self.auto])
        self.set_choices(choices)

    def _on_toggle(self, value: str) -> Callable[[dict], None]:
        def handler(change: dict) -> None:
            if change["new"]:
                for other, button in self.buttons.items():
                    if other != value and button.value:
                        button.value = False
            elif not any(b.value for b in self.buttons.values()):
                self.buttons[value].value = True  # one choice stays selected

        return handler

    def set_choices(self, choices: list) -> None:
        reasons = []
        for c in choices:
            button = self.buttons[c.value]
            button.disabled = not c.available
            button.tooltip = f"unavailable: {c.reason}" if not c.available else (c.reason or c.value)
            if not c.available:
                reasons.append((f"{self.field}={c.value}", c.reason))
                if button.value:  # the chosen one went away: fall back to the first available
                    button.value = False
                    first = next(x for x in choices if x.available)
                    self.buttons[first.value].value = True
        self.choices = {c.value: c for c in choices}
        self.reasons = reasons

    @property
    def value(self) -> str:
        return next(v for v, b in self.buttons.items() if b.value)

    @value.setter
    def value(self, new: str) -> None:
        if new not in self.buttons:
            raise ValueError(f"{self.field} has no choice {new!r}; choices: {list(self.buttons)}")
        if not self.choices[new].available:
            raise ValueError(f"{self.field}={new!r} is unavailable: {self.choices[new].reason}")
        self.buttons[new].value = True


class BackendPanel:
    """Every BackendConfig field; what the ranks lack is disabled with why; what "auto" becomes.

    The balanced gate (round-robin routing, BackendConfig.gate="balanced") is a benchmark setting:
    it trains no router, so it sits under "Benchmark settings", not beside the real router.
    """

    def __init__(
        self,
        rank_infos: list[dict] | None = None,
        device_type: str = "cpu",
        world_size: int = 1,
        backend: BackendConfig | None = None,
    ) -> None:
        self.rank_infos, self.device_type, self.world_size, self.ep = rank_infos, device_type, world_size, 1
        backend = backend or BackendConfig()
        choices = backend_choices(rank_infos, device_type, world_size, self.ep)
        self.rows = {f: ChoiceRow(f, choices[f], getattr(backend, f)) for f in CHOICES if f not in BENCHMARK_FIELDS}
        # BackendConfig.fused_ce: "auto" (on wherever the model's logits are lm_head(hidden)), on, off
        self.fused_ce = W.Dropdown(
            options=[("auto", "auto"), ("on", True), ("off", False)],
            value=backend.fused_ce,
            description="fused linear cross-entropy",
            style=WIDE,
            layout=fit_layout(),
        )
        self.fused_ce_note = W.HTML(layout=fit_layout())
        self.hf_config: Any = None  # the model's Transformers config (set_model): what fused_ce "auto" becomes
        self.expert_recompute = W.Checkbox(
            value=backend.expert_recompute,
            indent=False,
            layout=fit_layout(),
            description="recompute expert MLPs (less memory)",
        )
        self.fp8 = W.Checkbox(
            value=backend.fp8, description="FP8 GEMMs (TransformerEngine, Hopper)", indent=False, layout=fit_layout()
        )
        self.balanced_gate = W.Checkbox(
            value=backend.gate == "balanced",
            indent=False,
            layout=fit_layout(),
            description="balanced gate: round-robin routing, benchmark only",
        )
        self.balanced_gate.tooltip = (
            "gate='balanced' sends tokens to experts round-robin (perfectly even load) "
            "to measure dispatch and expert kernels; the model's router is not used or "
            "trained, so a run with it is no fine-tuning"
        )
        self.benchmark = W.Accordion(
            children=[
                W.VBox(
                    [
                        self.balanced_gate,
                        W.HTML(
                            "<small style='color:#666'>For speed measurements (workbench bench): "
                            "the loss of such a run means nothing.</small>"
                        ),
                    ]
                )
            ],
            titles=("Benchmark settings",),
            selected_index=None,
        )
        self.unavailable = W.HTML()
        self.fp8.observe(lambda _: self._show_auto(), "value")  # fp8 makes an auto linear TE where TE runs
        self.fused_ce.observe(lambda _: self._show_fused_ce(), "value")
        for row in self.rows.values():
            for b in row.buttons.values():
                b.observe(lambda _: self._show_auto(), "value")
        self.widget = W.VBox(
            [
                W.HTML("<b>Backends</b>"),
                *[r.widget for r in self.rows.values()],
                self.unavailable,
                wrap_row([self.fused_ce, self.fused_ce_note]),
                wrap_row([self.expert_recompute, self.fp8]),
                self.benchmark,
            ]
        )
        self._show_unavailable()
        self._show_auto()
        self._show_fused_ce()

    def set_model(self, hf_config: Any) -> None:
        """The model the backends are for: what fused_ce "auto" becomes depends on its logits."""
        self.hf_config = hf_config
        self._show_fused_ce()

    def fused_ce_resolution(self) -> tuple[bool, str]:
        """(whether the loss runs fused for the chosen fused_ce on this model, why not): ui.logic.fused_ce_choice."""
        return fused_ce_choice(self.fused_ce.value, self.hf_config)

    def _show_fused_ce(self) -> None:
        fused, why = self.fused_ce_resolution()
        value = self.fused_ce.value
        if why and value is True:
            text = f"<span style='color:#b00020'>refused for this model: {html.escape(why)}</span>"
        elif value == "auto":
            text = "&rarr; auto = <b>on</b>" if fused else f"&rarr; auto = <b>off</b>: {html.escape(why)}"
        else:
            text = ""
        self.fused_ce_note.value = f"<small>{text}</small>" if text else ""

    def set_ep(self, ep: int) -> None:
        """Re-check choices that depend on the mesh (the local dispatcher cannot do ep > 1)."""
        self.ep = ep
        choices = backend_choices(self.rank_infos, self.device_type, self.world_size, ep)
        for field, row in self.rows.items():
            row.set_choices(choices[field])
        self._show_unavailable()
        self._show_auto()

    def _show_unavailable(self) -> None:
        self.unavailable.value = unavailable_html([r for row in self.rows.values() for r in row.reasons])

    def choices(self) -> dict[str, dict[str, Any]]:
        """{field: {choice: Choice}} as currently shown."""
        return {f: dict(r.choices) for f, r in self.rows.items()}

    def auto_resolution(self) -> dict[str, str | None]:
        """What each "auto" field resolves to on these ranks."""
        return {
            f: resolve_auto(f, self.rank_infos, self.device_type, self.world_size, fp8=self.fp8.value)
            for f in self.rows
            if "auto" in CHOICES[f]
        }

    def _show_auto(self) -> None:
        resolved = self.auto_resolution()
        for field, row in self.rows.items():
            row.auto.value = f"<small>&rarr; auto = <b>{resolved.get(field)}</b></small>" if row.value == "auto" else ""

    def backend_config(self) -> BackendConfig:
        return BackendConfig(
            **{f: r.value for f, r in self.rows.items()},
            fused_ce=self.fused_ce.value,
            gate="balanced" if self.balanced_gate.value else "native",
            expert_recompute=self.expert_recompute.value,
            fp8=self.fp8.value,
        )
