"""TryTab: the Studio's Try tab. Pick a run (the latest by default), write a prompt, Send: the reply streams in.

The widgets only show what workbench.ui.try_logic hands them; the reply is generated in a thread, so the
kernel keeps serving the other tabs (a run's live plots) while it streams.
"""

from __future__ import annotations

import html
import os
import threading
from pathlib import Path

import ipywidgets as W

from workbench.generation.settings import MAX_NEW_TOKENS, MAX_NEW_TOKENS_LIMIT, TEMPERATURE, TOP_P
from workbench.ui.try_logic import NO_RUNS, Replier, read_settings, run_choices

REPLY_STYLE = (
    "white-space:pre-wrap;overflow-wrap:anywhere;margin:0;padding:8px;min-height:3em;"
    "border:1px solid #ccc;border-radius:4px;background:#fafafa;font-family:var(--jp-code-font-family,monospace)"
)


class TryTab:
    """The run picker, prompt, sampling settings, Send and the streamed reply; `widget` is the tab's content."""

    def __init__(self, runs_dir: str | os.PathLike, device: str = "auto", replier: Replier | None = None) -> None:
        self.runs_dir = Path(runs_dir).expanduser()
        self.replier = replier or Replier(device)
        wide = {"description_width": "110px"}
        self.run = W.Dropdown(description="run", style=wide, layout=W.Layout(width="min(100%, 640px)"))
        self.refresh_button = W.Button(
            description="Refresh", tooltip="list the runs again", layout=W.Layout(width="auto")
        )
        self.prompt = W.Textarea(
            placeholder="Ask the model something", description="prompt", style=wide, layout=W.Layout(width="100%")
        )
        num = dict(style=wide, layout=W.Layout(width="240px"))
        self.max_new_tokens = W.BoundedIntText(
            value=MAX_NEW_TOKENS, min=1, max=MAX_NEW_TOKENS_LIMIT, description="max new tokens", **num
        )
        self.temperature = W.BoundedFloatText(
            value=TEMPERATURE, min=0.0, max=5.0, step=0.1, description="temperature", **num
        )
        self.top_p = W.BoundedFloatText(value=TOP_P, min=0.01, max=1.0, step=0.05, description="top-p", **num)
        self.seed = W.IntText(value=-1, description="seed (-1: none)", **num)
        # Send keeps its width; the status line beside it takes the rest and wraps
        self.send_button = W.Button(
            description="Send", button_style="primary", layout=W.Layout(width="auto", flex="0 0 auto")
        )
        self.status = W.HTML(layout=W.Layout(flex="1 1 auto", min_width="0", margin="0 0 0 8px"))
        self.reply = W.HTML(self._reply_html(""))
        self.refresh_button.on_click(lambda _: self.refresh())
        self.send_button.on_click(lambda _: self.send())
        self._thread: threading.Thread | None = None
        settings_row = W.HBox(
            [self.max_new_tokens, self.temperature, self.top_p, self.seed], layout=W.Layout(flex_flow="row wrap")
        )
        self.widget = W.VBox(
            [
                W.HBox([self.run, self.refresh_button], layout=W.Layout(flex_flow="row wrap")),
                self.prompt,
                settings_row,
                W.HBox([self.send_button, self.status], layout=W.Layout(align_items="center")),
                self.reply,
            ],
            layout=W.Layout(width="100%"),
        )
        self.widget.add_class("mwb-try")
        self.refresh()

    def refresh(self) -> None:
        """List the runs with weights again, keeping the chosen one if it is still there (else the latest)."""
        chosen = self.run.value
        choices = [(c.label, c.run_dir) for c in run_choices(self.runs_dir)]
        self.run.options = choices or [(NO_RUNS, "")]
        values = [value for _, value in choices]
        self.run.value = chosen if chosen in values else (values[0] if values else "")

    def send(self, wait: bool = False) -> None:
        """Answer the prompt with the chosen run, in a thread (`wait`: return once the reply is complete)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self.send_button.disabled = True
        values = (self.max_new_tokens.value, self.temperature.value, self.top_p.value, self.seed.value)
        run_dir, prompt = self.run.value, self.prompt.value

        def work() -> None:
            try:
                self.replier.send(
                    run_dir,
                    prompt,
                    lambda: read_settings(*values),
                    lambda text: setattr(self.reply, "value", self._reply_html(text)),
                    lambda line: setattr(
                        self.status, "value", f"<span class='mwb-try-status'>{html.escape(line)}</span>"
                    ),
                )
            finally:
                self.send_button.disabled = False

        self._thread = threading.Thread(target=work, name="workbench-try", daemon=True)
        self._thread.start()
        if wait:
            self._thread.join()

    def wait(self, timeout: float | None = None) -> None:
        """Until the reply being streamed is complete."""
        if self._thread is not None:
            self._thread.join(timeout)

    @staticmethod
    def _reply_html(text: str) -> str:
        return f"<pre class='mwb-try-reply' style='{REPLY_STYLE}'>{html.escape(text)}</pre>"
