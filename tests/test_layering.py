"""The workbench's core packages import each other without cycles: kernels < moe < parallel < models < train.

Imports are read from the source (top-level and inside functions alike: a lazy import is still a
dependency), so a cycle hidden behind a function-level import fails here too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "moe", "parallel", "models", "train")
# The qwen3 engineer's part of issue 14 item 4 (kernels import no moe / config modules): until it
# lands, kernels/te_experts.py imports workbench.moe.
def _imported_modules(path: Path) -> set[str]:
    """Absolute names of every `workbench...` module a file imports, anywhere in it."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1]  # a module's package; an __init__ is its own package
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                out.add(".".join(base + ((node.module,) if node.module else ())))
            else:
                out.add(node.module)
    return {name for name in out if name.split(".")[0] == "workbench"}


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(from package, to package) -> the files that make that edge, for the core packages."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted((ROOT / "workbench").rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if len(parts) < 3 or parts[1] not in PACKAGES:
            continue
        for name in _imported_modules(path):
            target = name.split(".")
            if len(target) > 1 and target[1] in PACKAGES and target[1] != parts[1]:
                edges[(parts[1], target[1])].append(str(path.relative_to(ROOT)))
    return edges


def cycles(edges) -> list[list[str]]:
    """Every package pair or longer loop reachable back to itself (one entry per strongly connected set)."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reachable = {p: reach(p) for p in PACKAGES}
    groups = {frozenset(q for q in PACKAGES if q in reachable[p] and p in reachable[q]) | {p}
              for p in PACKAGES if p in reachable[p]}
    return sorted(sorted(g) for g in groups)


def test_core_packages_import_without_cycles():
    edges = {e: files for e, files in package_edges().items() if e != ("kernels", "moe")}
    found = cycles(edges)
    assert not found, "import cycles between workbench packages: " + "; ".join(
        " <-> ".join(c) + " via " + ", ".join(f"{a}->{b} ({files[0]})" for (a, b), files in edges.items()
                                            if a in c and b in c) for c in found)


def test_kernels_import_no_moe():
    assert ("kernels", "moe") not in package_edges(), package_edges().get(("kernels", "moe"))


def test_device_helper_imports_no_workbench_package():
    # default_device is used by models, parallel and train alike: it must sit below all of them.
    assert _imported_modules(ROOT / "workbench" / "devices.py") == set()


@pytest.mark.slow
@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_alone_in_a_fresh_interpreter(package):
    modules = sorted(f"workbench.{package}.{p.stem}" for p in (ROOT / "workbench" / package).glob("*.py")
                     if p.stem != "__init__")
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    proc = subprocess.run([sys.executable, "-c", code, f"workbench.{package}", *modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
