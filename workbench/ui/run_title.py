"""How the Studio names a run in its headers (Live tab, run panel, progress bar): the name the user gave
it (RunConfig.name), its full id, and its kind (full or LoRA, data, eval) in the words `workbench runs`
uses (workbench.runs.run_kind), so two runs of one model can be told apart at a glance."""

from __future__ import annotations

import html
from typing import Any

from workbench.runs.run_kind import run_kind
from workbench.runs.run_names import shown_name


def run_config_of(run: Any) -> dict:
    """The config of a Run as a dict ({} when the run cannot say yet: its config.json not written)."""
    try:
        config = run.config
    except (OSError, ValueError, AttributeError):
        return {}
    return config if isinstance(config, dict) else {}


def run_title_text(run_id: str, config: dict) -> str:
    """'name (id) · kind' as plain text, for a progress bar or a log line; 'id · kind' without a name."""
    name = shown_name(config.get("name"))
    who = f"{name} ({run_id})" if name else run_id
    return f"{who} \u00b7 {run_kind(config)['label']}"


def run_title_html(run_id: str, config: dict) -> str:
    """The run as an HTML header: its name in bold (when it has one), its full id as code, its kind;
    wrapping on a narrow notebook rather than clipping."""
    name = shown_name(config.get("name"))
    parts = [f"<b class='mwb-run-name'>{html.escape(name)}</b>"] if name else []
    parts.append(f"<code class='mwb-run-id'>{html.escape(run_id)}</code>")
    parts.append(f"<span class='mwb-run-kind' style='color:#555'>{html.escape(run_kind(config)['label'])}</span>")
    return "<span style='overflow-wrap:anywhere'>" + " ".join(parts) + "</span>"
