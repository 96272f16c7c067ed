"""JSON routes under /moe-workbench/api/, behind jupyter_server's own authentication."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import ensure_async, url_path_join
from tornado import web

from .clusters import ClusterWatcher
from .gpus import gpu_snapshot
from .notebooks import list_notebooks, read_notebook

AUTH_RESOURCE = "moe_workbench"
CLUSTER_WATCHER_KEY = "moe_workbench_cluster_watcher"
SPARK_POINTS = 64
# Metrics a plot needs; expert_load matrices are only sent when asked for (they are large).
DEFAULT_METRIC_FIELDS = (
    "step", "rank", "loss", "grad_norm", "lr", "tokens_per_s_per_gpu", "tflops_per_gpu",
    "mem_peak_gib", "mem_now_gib", "expert_load_cv", "step_time_s", "forward_s", "backward_s",
    "optimizer_s", "time",
)


def _run_dir_module():
    """workbench.train.run_dir, or None if the workbench package is not installed here."""
    try:
        from workbench.train import run_dir
    except ImportError:
        return None
    return run_dir


class WorkbenchHandler(APIHandler):
    """Base: every route is authenticated and authorized against one resource."""

    auth_resource = AUTH_RESOURCE

    def write_json(self, obj: object) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(obj, default=str))

    def runs_dir(self) -> Path:
        """The runs folder: ?runs_dir=... from the lab setting, else the workbench default."""
        chosen = self.get_query_argument("runs_dir", "").strip()
        if chosen:
            return Path(chosen).expanduser()
        run_dir = _run_dir_module()
        if run_dir is None:
            raise web.HTTPError(503, "the workbench package is not importable on the server")
        return run_dir.default_runs_dir()


class GpusHandler(WorkbenchHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.write_json(await asyncio.to_thread(gpu_snapshot))


class ClustersHandler(WorkbenchHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        watcher: ClusterWatcher = self.settings[CLUSTER_WATCHER_KEY]
        # On the loop thread on purpose (see ClusterWatcher); it only reads small JSON files.
        self.write_json(watcher.snapshot())


def _downsample(values: list, points: int = SPARK_POINTS) -> list:
    if len(values) <= points:
        return values
    stride = len(values) / points
    return [values[int(i * stride)] for i in range(points - 1)] + [values[-1]]


def _runs_with_sparklines(runs_dir: Path) -> dict:
    run_dir = _run_dir_module()
    runs = run_dir.list_runs(runs_dir)
    for summary in runs:
        if not summary.get("readable"):
            continue
        try:
            records = run_dir.RunDir(runs_dir / summary["id"]).read_metrics()
        except OSError as err:
            summary["spark_error"] = str(err)
            continue
        rank0 = [r for r in records if r.get("rank", 0) == 0]
        summary["spark"] = {
            key: _downsample([r.get(key) for r in rank0 if isinstance(r.get(key), (int, float))])
            for key in ("tokens_per_s_per_gpu", "loss")
        }
    return {"runs_dir": str(runs_dir), "exists": runs_dir.is_dir(), "runs": runs}


class RunsHandler(WorkbenchHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.write_json(await asyncio.to_thread(_runs_with_sparklines, self.runs_dir()))


class RunMetricsHandler(WorkbenchHandler):
    @web.authenticated
    @authorized
    async def get(self, run_id: str) -> None:
        if run_id in {".", ".."} or "/" in run_id or "\\" in run_id:
            raise web.HTTPError(400, f"bad run id {run_id!r}")
        run_dir = _run_dir_module()
        path = self.runs_dir() / run_id
        try:
            run = run_dir.RunDir.open(path)
        except FileNotFoundError as err:
            raise web.HTTPError(404, str(err)) from None
        fields_arg = self.get_query_argument("fields", "")
        fields = [f for f in fields_arg.split(",") if f] or list(DEFAULT_METRIC_FIELDS)
        rank_arg = self.get_query_argument("rank", "")
        records = await asyncio.to_thread(run.read_metrics)
        if rank_arg != "":
            records = [r for r in records if str(r.get("rank", 0)) == rank_arg]
        if fields != ["*"]:
            records = [{k: r[k] for k in fields if k in r} for r in records]
        self.write_json({"id": run_id, "path": str(path), "records": records})


class NotebooksHandler(WorkbenchHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.write_json(await asyncio.to_thread(list_notebooks))


class NotebookCopyHandler(WorkbenchHandler):
    """POST: copy a workbench notebook to the server's root folder unless it is already there."""

    @web.authenticated
    @authorized
    async def post(self, name: str) -> None:
        try:
            content = await asyncio.to_thread(read_notebook, name)
        except ValueError as err:
            raise web.HTTPError(400, str(err)) from None
        except KeyError as err:
            raise web.HTTPError(404, str(err.args[0])) from None
        contents = self.contents_manager
        # Never overwrite: the user's copy may hold edits; we just open it.
        if await ensure_async(contents.file_exists(name)):
            self.write_json({"path": name, "copied": False})
            return
        model = {"type": "notebook", "format": "json", "content": content}
        await ensure_async(contents.save(model, name))
        self.write_json({"path": name, "copied": True})


def setup_handlers(web_app, parent=None) -> None:
    """Register the routes under <base_url>moe-workbench/api/."""
    web_app.settings[CLUSTER_WATCHER_KEY] = ClusterWatcher(parent=parent)
    base = url_path_join(web_app.settings["base_url"], "moe-workbench", "api")
    web_app.add_handlers(".*$", [
        (url_path_join(base, "gpus"), GpusHandler),
        (url_path_join(base, "clusters"), ClustersHandler),
        (url_path_join(base, "runs"), RunsHandler),
        (url_path_join(base, "runs", r"([^/]+)", "metrics"), RunMetricsHandler),
        (url_path_join(base, "notebooks"), NotebooksHandler),
        (url_path_join(base, "notebooks", r"([^/]+\.ipynb)"), NotebookCopyHandler),
    ])
