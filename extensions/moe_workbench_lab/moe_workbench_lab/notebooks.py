"""The workbench notebooks the launcher offers, and copying them into the user's folder."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
from pathlib import Path, PurePosixPath


def notebooks_source_dir() -> tuple[Path | None, str | None]:
    """(folder holding the workbench's notebooks, reason if none): env var, then the checkout."""
    env = os.environ.get("WORKBENCH_NOTEBOOKS_DIR")
    if env:
        path = Path(env).expanduser()
        return (path, None) if path.is_dir() else (None, f"$WORKBENCH_NOTEBOOKS_DIR={env} is not a folder")
    spec = importlib.util.find_spec("workbench")
    if spec is None or not spec.submodule_search_locations:
        return None, "the workbench package is not importable; install it with `pip install -e .`"
    for location in spec.submodule_search_locations:
        # An editable/source install: notebooks/ sits beside the workbench/ package folder.
        candidate = Path(location).resolve().parent / "notebooks"
        if candidate.is_dir():
            return candidate, None
    return None, (
        "no notebooks/ folder beside the workbench package (a non-editable install); "
        "set $WORKBENCH_NOTEBOOKS_DIR to the repository's notebooks/ folder"
    )


def _title(path: Path) -> str:
    """The notebook's first markdown heading, else its file name."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb.get("cells", []):
            if cell.get("cell_type") != "markdown":
                continue
            source = cell.get("source", "")
            text = "".join(source) if isinstance(source, list) else source
            for line in text.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
            break
    except (OSError, ValueError, AttributeError):
        pass
    return path.stem.replace("_", " ").replace("-", " ")


def list_notebooks() -> dict:
    """{"source_dir", "reason", "notebooks": [{"name", "title"}]}, sorted by file name."""
    source, reason = notebooks_source_dir()
    if source is None:
        return {"source_dir": None, "reason": reason, "notebooks": []}
    from workbench.runs.run_index import confine

    real_source = source.resolve()
    names = []
    for path in sorted(source.glob("*.ipynb")):
        try:
            if not path.name.startswith(".") and confine(real_source, path).is_file():
                names.append(path)
        except PermissionError:
            continue  # a link out of the folder: never offered, never read
    return {
        "source_dir": str(source),
        "reason": None if names else f"no .ipynb files in {source}",
        "notebooks": [{"name": p.name, "title": _title(p)} for p in names],
    }


def read_notebook(name: str) -> dict:
    """The notebook `name` from the source folder as a JSON dict (ValueError / KeyError if not)."""
    if Path(name).name != name or not name.endswith(".ipynb"):
        raise ValueError(f"{name!r} is not a notebook file name")
    source, reason = notebooks_source_dir()
    if source is None:
        raise KeyError(reason)
    from workbench.runs.run_index import read_json_confined

    try:
        return read_json_confined(source.resolve(), source / name)
    except FileNotFoundError:
        raise KeyError(f"no notebook {name} in {source}") from None


def copy_target_exists(root_dir: str | os.PathLike, name: str) -> bool:
    """Whether `name` (a path under the server's root) is taken; PermissionError if writing it would follow a link.

    Jupyter's file writer follows a link at the target, a dangling one too (its target is created
    wherever it points), so the lab writes nothing where the file or a folder on its way is a link:
    each part is looked at itself (lstat), never through a link. The root is the server's own.
    """
    path = Path(root_dir)
    parts = PurePosixPath(name).parts
    for i, part in enumerate(parts):
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(mode):
            raise PermissionError(
                f"{'/'.join(parts[: i + 1])} in the server's folder is a link; the lab writes nothing through "
                "a link: remove or rename it, then open the notebook again"
            )
    return True
