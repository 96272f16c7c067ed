"""The workbench's core packages import each other without cycles: kernels < backends < moe < parallel < models < train;
runs (a run's files) imports none of them.

Imports are read from the source (top-level and inside functions alike: a lazy import is still a
dependency), so a cycle hidden behind a function-level import fails here too; the same holds between the
modules of every package (test_modules_import_without_cycles).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "moe", "parallel", "models", "train", "runs")
# Top-level modules that are layers of their own: the one place that decides which backend runs.
MODULES = ("backends",)
NODES = PACKAGES + MODULES
# What a kernel may import from the workbench: other kernels, and the leaf module of the error it raises.
KERNEL_IMPORTS_ALLOWED = ("workbench.kernels", "workbench.errors")


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
                base = package[: len(package) - node.level + 1]
                out.add(".".join(base + ((node.module,) if node.module else ())))
            else:
                out.add(node.module)
    return {name for name in out if name.split(".")[0] == "workbench"}


def _node(parts: tuple[str, ...]) -> str | None:
    """The layer a module (dotted name parts, "workbench" first) belongs to, None outside NODES."""
    if len(parts) > 2 and parts[1] in PACKAGES:
        return parts[1]
    if len(parts) == 2 and parts[1] in NODES:
        return parts[1]
    return None


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(from layer, to layer) -> the files that make that edge, for the core packages and modules."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted((ROOT / "workbench").rglob("*.py")):
        source = _node(path.relative_to(ROOT).with_suffix("").parts)
        if source is None:
            continue
        for name in _imported_modules(path):
            target = _node(tuple(name.split(".")))
            if target is not None and target != source:
                edges[(source, target)].append(str(path.relative_to(ROOT)))
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

    reachable = {p: reach(p) for p in NODES}
    groups = {
        frozenset(q for q in NODES if q in reachable[p] and p in reachable[q]) | {p} for p in NODES if p in reachable[p]
    }
    return sorted(sorted(g) for g in groups)


def test_core_packages_import_without_cycles():
    edges = package_edges()
    found = cycles(edges)
    assert not found, "import cycles between workbench packages: " + "; ".join(
        " <-> ".join(c)
        + " via "
        + ", ".join(f"{a}->{b} ({files[0]})" for (a, b), files in edges.items() if a in c and b in c)
        for c in found
    )


def test_kernels_import_no_moe():
    assert ("kernels", "moe") not in package_edges(), package_edges().get(("kernels", "moe"))


def test_kernels_import_no_config_and_no_backend_choice():
    # Which kernel runs is decided in workbench.backends and passed down by name: a kernel reading
    # the config or the resolver would be a second place that decides.
    found = {}
    for path in sorted((ROOT / "workbench" / "kernels").rglob("*.py")):
        bad = sorted(
            m
            for m in _imported_modules(path)
            if not any(m == ok or m.startswith(ok + ".") for ok in KERNEL_IMPORTS_ALLOWED)
        )
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    assert not found, found


def test_the_cycle_check_sees_a_cycle_through_a_lazy_import():
    # the checker itself: an edge each way (as kernels -> moe -> kernels once was) is one cycle
    assert cycles({("kernels", "moe"): [], ("moe", "kernels"): []}) == [["kernels", "moe"]]
    assert cycles({("moe", "backends"): [], ("backends", "kernels"): [], ("kernels", "backends"): []}) == [
        ["backends", "kernels"]
    ]
    assert cycles({("moe", "kernels"): []}) == []


def module_imports(root: Path) -> dict[str, dict[str, int]]:
    """Module -> {workbench module it imports: the line of the first such import}, for every module under
    root/workbench. Every import counts (inside functions and TYPE_CHECKING blocks too), relative ones resolved;
    `from pkg import name` is an edge to pkg, and to pkg.name too where that is a module (a submodule importing
    its own package's __init__, which imports it, is a circle)."""
    files = {}
    for path in sorted((root / "workbench").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                if target in files and target != name:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The sets of two or more modules that reach each other through their imports (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph.get(target, {}))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return sorted(found)


def _loop(group: list[str], graph: dict[str, dict[str, int]]) -> str:
    """One import loop through the group's first module, as 'a (line 3) -> b (line 7) -> a'."""
    members, start = set(group), group[0]
    came_from: dict[str, str] = {}
    todo = [start]
    while todo and start not in came_from:
        node = todo.pop(0)
        for target in graph[node]:
            if target in members and target not in came_from:
                came_from[target] = node
                todo.append(target)
    path, node = [start], start
    while True:
        node = came_from[node]
        path.append(node)
        if node == start:
            break
    path.reverse()
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])) + f" -> {start}"


def test_modules_import_without_cycles():
    # Between modules, not only packages: a circle kept alive by an import inside a function is a circle too.
    graph = module_imports(ROOT)
    found = strongly_connected(graph)
    assert not found, "modules that import each other (imports inside functions count):\n" + "\n".join(
        f"{' <-> '.join(group)}\n    e.g. {_loop(group, graph)}" for group in found
    )


def test_the_module_cycle_check_sees_lazy_imports_and_a_package_importing_its_submodule(tmp_path):
    files = {
        "workbench/__init__.py": "",
        "workbench/a.py": "def f():\n    from workbench.b import g\n",  # inside a function: still an edge
        "workbench/b.py": "from . import a\n",  # relative, a submodule by name
        "workbench/c.py": "import workbench.b\n",  # imports, is not imported: no circle
        "workbench/sub/__init__.py": "from workbench.sub.leaf import x\n",
        "workbench/sub/leaf.py": "from workbench.sub import other\n",  # through the package that imports it
        "workbench/sub/other.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = module_imports(tmp_path)
    assert graph["workbench.sub.leaf"] == {"workbench.sub": 1, "workbench.sub.other": 1}
    assert strongly_connected(graph) == [["workbench.a", "workbench.b"], ["workbench.sub", "workbench.sub.leaf"]]
    assert _loop(["workbench.a", "workbench.b"], graph) == "workbench.a (line 2) -> workbench.b (line 1) -> workbench.a"


def test_device_helper_imports_no_workbench_package():
    # default_device is used by models, parallel and train alike: it must sit below all of them.
    assert _imported_modules(ROOT / "workbench" / "devices.py") == set()


@pytest.mark.slow
@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_alone_in_a_fresh_interpreter(package):
    modules = sorted(
        f"workbench.{package}.{p.stem}" for p in (ROOT / "workbench" / package).glob("*.py") if p.stem != "__init__"
    )
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    proc = subprocess.run(
        [sys.executable, "-c", code, f"workbench.{package}", *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_run_files_are_shared_persistence_below_the_trainer():
    # The trainer, the cluster, the Studio and the lab's server read runs: workbench.runs, not the trainer.
    files = sorted((ROOT / "workbench" / "runs").glob("*.py"))
    assert files, "workbench/runs is missing"
    for path in files:
        others = {m for m in _imported_modules(path) if not m.startswith("workbench.runs")}
        assert not others, f"{path.relative_to(ROOT)} imports {sorted(others)}"
    assert not (ROOT / "workbench" / "cluster" / "progress.py").exists(), "the run's progress bar is UI (workbench/ui)"


def _top_level_definitions() -> dict[str, list[str]]:
    """Top-level function and class name -> the workbench files defining it."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted((ROOT / "workbench").rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found[node.name].append(str(path.relative_to(ROOT)))
    return found


# Helpers that had twins: one definition each, which every caller imports.
ONE_HOME = {
    "CheckpointError": "workbench/errors.py",
    "free_port": "workbench/parallel/launch.py",
    "resolve_mesh": "workbench/models/mesh_choice.py",
    "resolve_dtype_name": "workbench/devices.py",
    "param_counts": "workbench/params.py",
}
# Private re-writes of workbench/parallel/dist_utils' rank(), world_size(), barrier() and of the dtype rule.
TWIN_NAMES = ("_rank", "_world", "_world_size", "_barrier", "_dtype")


def test_shared_helpers_have_one_definition():
    found = _top_level_definitions()
    assert {name: found[name] for name in ONE_HOME} == {name: [home] for name, home in ONE_HOME.items()}
    assert not {name: found[name] for name in TWIN_NAMES if found[name]}
    # free_port's body written inline elsewhere (the bench and a test once did): one place picks ports.
    picks = "getsockname" + "()[1]"
    sources = [*(ROOT / "workbench").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    assert sorted(str(p.relative_to(ROOT)) for p in sources if picks in p.read_text()) == [
        "workbench/parallel/launch.py"
    ]


def test_test_helpers_shadow_no_workbench_module():
    # tests/ is on sys.path first: a helper named like a workbench module (dist_utils) reads as that module.
    ours = {p.stem for p in (ROOT / "workbench").rglob("*.py")}
    helpers = {p.stem for p in (ROOT / "tests").glob("*.py") if not p.stem.startswith(("test_", "conftest"))}
    assert not helpers & ours, sorted(helpers & ours)
    engines = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "workbench").rglob("engine.py"))
    assert len(engines) == 1, f"'engine' names more than one module: {engines}"


def test_every_source_folder_is_a_package_the_wheel_ships():
    # pyproject's [tool.setuptools.packages.find] finds regular packages only: a folder of modules
    # without __init__.py works from a checkout (editable install) and is missing from a wheel.
    import setuptools

    found = set(setuptools.find_packages(where=str(ROOT), include=["workbench*"]))
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "workbench").rglob("*.py")}
    folders.discard("workbench.data")  # package data (pyproject's package-data), its build script included
    assert sorted(folders - found) == []


def test_ui_logic_imports_without_the_widget_packages():
    # The GPU image has no ipywidgets/plotly/anywidget; its backend-resolution tests import workbench.ui.logic.
    # Blocked in sys.modules, an import of any of them raises ImportError.
    code = (
        "import sys\n"
        "for m in ('ipywidgets', 'plotly', 'anywidget', 'ipyparallel'):\n"
        "    sys.modules[m] = None\n"
        "from workbench.ui import resolve_auto, estimate_memory\n"
        "import workbench.ui.logic, workbench.ui.memory\n"
        "try:\n"
        "    from workbench.ui import Studio\n"
        "except ImportError:\n"
        "    print('widgets need the lab extra')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "widgets need the lab extra"


def test_the_core_packages_import_only_the_config_checks_leaf():
    # workbench.config reads presets and builds MeshConfig / model checks (it imports parallel and models);
    # below it, only the leaf config_checks (ConfigError and the value checks) may be imported.
    upper = {f"workbench.{name}" for name in ("config", "config_io", "config_train", "config_data", "config_lora")}
    offenders = []
    for package in ("kernels", "moe", "parallel", "models", "runs"):
        for path in sorted((ROOT / "workbench" / package).rglob("*.py")):
            bad = sorted(_imported_modules(path) & upper)
            if bad:
                offenders.append(f"{path.relative_to(ROOT)}: {bad}")
    for leaf in ("backends.py", "devices.py", "config_checks.py"):
        bad = sorted(_imported_modules(ROOT / "workbench" / leaf) & upper)
        if bad:
            offenders.append(f"workbench/{leaf}: {bad}")
    assert not offenders, offenders
