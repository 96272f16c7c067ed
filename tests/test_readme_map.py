"""The README's "Dive into the code" map and Layout name files and folders that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 4)
    return text[start : end if end != -1 else None]


def _paths(cell: str, base: str) -> list[Path]:
    """Backticked paths of a table cell; a bare `dir/file.py` is under the row's first `workbench/...` folder."""
    out = []
    for item in re.findall(r"`([^`]+)`", cell):
        item = item.split(" ")[0].rstrip(",")
        if "/" not in item or item.startswith("("):
            continue
        for expanded in _expand(item):
            path = (
                ROOT / expanded
                if expanded.split("/")[0] in ("workbench", "extensions", "tests")
                else ROOT / base / expanded
            )
            out.append(path)
    return out


def _expand(item: str) -> list[str]:
    m = re.search(r"\{([^}]+)\}", item)
    if not m:
        return [item]
    return [item[: m.start()] + part + item[m.end() :] for part in m.group(1).split(",")]


def test_every_file_the_code_map_names_exists():
    rows = [line for line in _section("Dive into the code").splitlines() if line.startswith("| ") and "---" not in line]
    missing = []
    for row in rows[1:]:
        cell = row.split("|")[2]
        for path in _paths(cell, "workbench"):
            if "*" in path.name:
                if not list(path.parent.glob(path.name)):
                    missing.append(str(path.relative_to(ROOT)))
            elif not path.exists():
                missing.append(str(path.relative_to(ROOT)))
    assert len(rows) > 10 and not missing, missing


def test_layout_names_every_package_folder():
    layout = _section("Layout")
    folders = sorted(p.name for p in (ROOT / "workbench").iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert [f for f in folders if f"`{f}/`" not in layout] == []
