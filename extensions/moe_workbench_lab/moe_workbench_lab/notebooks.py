"""The workbench notebooks the launcher offers, and copying them into the user's notebooks folder.

The copies go to the user's own folder: `c.MoeWorkbenchLab.notebooks_dir`, else notebooks/ beside the
runs folder (~/moe-workbench/notebooks by default), never into the repository checkout the notebooks
come from (a clean clone's `git status` stays clean).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import stat
from pathlib import Path


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


def plain_title(markdown: str) -> str:
    """A heading's text as a launcher card shows it: code spans and bold without their marks."""
    text = re.sub(r"`([^`]*)`", r"\1", markdown)
    return re.sub(r"\*\*(\S(?:.*?\S)?)\*\*", r"\1", text)


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
                    return plain_title(line.lstrip("#").strip())
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


def repository_checkout() -> Path | None:
    """The source checkout the workbench package runs from (an editable install), else None."""
    spec = importlib.util.find_spec("workbench")
    for location in (spec.submodule_search_locations or []) if spec else []:
        root = Path(location).resolve().parent
        if (root / ".git").exists() or (root / "pyproject.toml").is_file():
            return root
    return None


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def notebooks_target_dir(runs_dir: Path, configured: str = "") -> Path:
    """The folder notebook copies go to; ValueError (naming the setting) if it lies in the repository checkout."""
    target = Path(configured).expanduser() if configured else Path(runs_dir).expanduser().parent / "notebooks"
    target = Path(os.path.abspath(target))
    checkout = repository_checkout()
    if checkout is not None and _inside(target.resolve(), checkout):
        raise ValueError(
            f"the notebooks folder {target} is inside the repository checkout {checkout}; copies there would "
            "show in its `git status`: set c.MoeWorkbenchLab.notebooks_dir (or --MoeWorkbenchLab.notebooks_dir) "
            "to a folder of your own, or serve a runs folder outside the checkout"
        )
    source, _ = notebooks_source_dir()
    if source is not None and target.resolve() == source.resolve():
        raise ValueError(
            f"the notebooks folder {target} is the folder the notebooks are copied from; set "
            "c.MoeWorkbenchLab.notebooks_dir to another folder"
        )
    return target


def copy_notebook(content: dict, target_dir: Path, name: str) -> tuple[Path, bool]:
    """Write `content` as target_dir/name unless that file exists; returns (path, copied).

    The user's copy is never overwritten (it may hold edits). Nothing is written through a link: the
    folder and the file are looked at themselves (lstat), and the file is created exclusively without
    following one (a link planted there between the check and the write is refused by the open).
    """
    target_dir = Path(target_dir)
    for path, what in ((target_dir, "folder"), (target_dir / name, "file")):
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                raise PermissionError(
                    f"the notebooks {what} {path} is a link; the lab writes nothing through a link: remove or "
                    "rename it, then open the notebook again"
                )
        except FileNotFoundError:
            pass
    target_dir.mkdir(parents=True, exist_ok=True)
    path = target_dir / name
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except FileExistsError:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise PermissionError(f"{path} is a link; the lab writes nothing through a link") from None
        return path, False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return path, True


def contents_path(root_dir: str | os.PathLike | None, path: Path) -> str | None:
    """`path` as the server's contents path (relative to its root, '/'-separated), None if outside the root."""
    if root_dir is None:
        return None
    root = Path(os.path.abspath(root_dir)).resolve()
    real = Path(os.path.abspath(path)).resolve()
    if not _inside(real, root):
        return None
    return real.relative_to(root).as_posix()
