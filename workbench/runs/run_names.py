"""What a run's id (its folder name) and its label (RunConfig.name) may be: names every reader accepts.

One rule for writers and readers alike. A leading dot would hide the run from listings, a backslash
or a space breaks the lab's URLs and shells, and a name past the file system's limit fails only
when the run folder is made; so a run id is 1 to 128 letters, digits, '.', '_' or '-', starting
with a letter or digit (the default ids, like 20261129-235959-ab12, are of this form).
"""

from __future__ import annotations

import re
from typing import Any

RUN_ID_MAX_CHARS = 128
_RUN_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{RUN_ID_MAX_CHARS - 1}}}")
RUN_ID_RULE = f"1-{RUN_ID_MAX_CHARS} letters, digits, '.', '_' or '-', starting with a letter or digit"
# RunConfig.name, a label for the lab's sidebar: longer ones are refused at config time and cut when read
RUN_NAME_MAX_CHARS = 200
_SHOWN_CHARS = 40  # of a refused id in a message: a crafted 10 MB id must not become a 10 MB message


def shown_id(run_id: Any) -> str:
    """`run_id` as a message shows it: its repr, cut to a readable length (the length said when cut)."""
    text = repr(run_id)
    if len(text) <= _SHOWN_CHARS + 2:
        return text
    size = f"{len(run_id)} characters" if isinstance(run_id, str) else type(run_id).__name__
    return f"{text[:_SHOWN_CHARS]}... ({size})"


def run_id_problem(run_id: Any) -> str | None:
    """Why `run_id` cannot name a run folder (a sentence naming the rule), or None when it can."""
    if isinstance(run_id, str) and _RUN_ID.fullmatch(run_id):
        return None
    return f"run_id {shown_id(run_id)} is not valid: use {RUN_ID_RULE} (e.g. lr3e-4_run2)"


def shown_name(name: Any) -> str | None:
    """A run's label as a listing shows it: None unless a string, cut to RUN_NAME_MAX_CHARS."""
    if not isinstance(name, str):
        return None
    return name if len(name) <= RUN_NAME_MAX_CHARS else name[: RUN_NAME_MAX_CHARS - 3] + "..."
