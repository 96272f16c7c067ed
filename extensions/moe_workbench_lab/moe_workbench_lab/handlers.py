"""JSON routes under /moe-workbench/api/, behind jupyter_server's own authentication."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
from pathlib import Path

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from traitlets import Unicode
from traitlets.config import Configurable

from .clusters import ClusterWatcher
from .gpus import gpu_snapshot
from .notebooks import contents_path, copy_notebook, list_notebooks, notebooks_target_dir, read_notebook

AUTH_RESOURCE = "moe_workbench"
CLUSTER_WATCHER_KEY = "moe_workbench_cluster_watcher"
RUN_INDEX_KEY = "moe_workbench_run_index"
SETTINGS_KEY = "moe_workbench_settings"
PLOTLY_BUNDLE_KEY = "moe_workbench_plotly_bundle_gz"


def _run_dir_module():
    """workbench.runs.run_dir, or None if the workbench package is not installed here."""
    try:
        from workbench.runs import run_dir
    except ImportError:
        return None
    return run_dir


def _run_index_module():
    """workbench.runs.run_index; 503 if the workbench package is not installed here."""
    try:
        from workbench.runs import run_index
    except ImportError:
        raise web.HTTPError(503, "the workbench package is not importable on the server") from None
    return run_index


class MoeWorkbenchLab(Configurable):
    """Server-side settings: the one runs folder this server serves (`c.MoeWorkbenchLab.runs_dir`)."""

    runs_dir = Unicode(
        "",
        config=True,
        help=(
            "The runs folder the lab serves. Empty: $WORKBENCH_RUNS_DIR, else ~/moe-workbench/runs. "
            "The sidebar's 'Runs directory' setting must name this folder (or be empty)."
        ),
    )

    notebooks_dir = Unicode(
        "",
        config=True,
        help=(
            "Where the launcher's cards copy the workbench notebooks before opening them. Empty: notebooks/ "
            "beside the runs folder (~/moe-workbench/notebooks by default). Never the repository checkout."
        ),
    )

    def allowed_runs_dir(self) -> Path:
        """The configured runs folder; read per request so $WORKBENCH_RUNS_DIR is honoured."""
        if self.runs_dir:
            return Path(self.runs_dir).expanduser()
        run_dir = _run_dir_module()
        if run_dir is None:
            raise web.HTTPError(503, "the workbench package is not importable on the server")
        return run_dir.default_runs_dir()


class WorkbenchHandler(APIHandler):
    """Base: every route is authenticated and authorized against one resource."""

    auth_resource = AUTH_RESOURCE

    def write_json(self, obj: object) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(obj, default=str))

    def runs_dir(self) -> Path:
        """The server's runs folder; a ?runs_dir= (the sidebar setting) must name that same folder."""
        allowed = self.settings[SETTINGS_KEY].allowed_runs_dir()
        chosen = self.get_query_argument("runs_dir", "").strip()
        if "\0" in chosen:
            raise web.HTTPError(400, "runs_dir holds a NUL character")
        # Any other folder is refused: the request must not choose what the server reads.
        if chosen and _real(Path(chosen).expanduser()) != _real(allowed):
            raise web.HTTPError(
                403,
                (
                    f"runs_dir {chosen!r} is not this server's runs directory {str(allowed)!r}; clear the "
                    "sidebar's 'Runs directory' setting, or start jupyter with "
                    "--MoeWorkbenchLab.runs_dir=<folder> (or $WORKBENCH_RUNS_DIR) to serve another folder"
                ),
            )
        return allowed

    def run_index(self):
        """The server's one RunIndex (made on first use, on the loop thread, so never twice)."""
        if self.settings.get(RUN_INDEX_KEY) is None:
            self.settings[RUN_INDEX_KEY] = _run_index_module().RunIndex()
        return self.settings[RUN_INDEX_KEY]


def _real(path: Path) -> Path:
    return Path(os.path.abspath(path)).resolve()


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


class RunsHandler(WorkbenchHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        runs_dir = self.runs_dir()
        runs = await asyncio.to_thread(self.run_index().list_runs, runs_dir)
        self.write_json({"runs_dir": str(runs_dir), "exists": runs_dir.is_dir(), "runs": runs})


class RunMetricsHandler(WorkbenchHandler):
    """A run's plotted records (RunIndex.metrics: read incrementally, thinned, only plotted fields)."""

    @web.authenticated
    @authorized
    async def get(self, run_id: str) -> None:
        index = _run_index_module()
        # run_id arrives URL-decoded (%2e%2e is "..", %2F is "/"): the rule every writer and reader of
        # run ids shares (workbench.runs.run_names) refuses those, and any id no run can have, unread.
        problem = index.run_id_problem(run_id)
        if problem:
            raise web.HTTPError(400, f"bad run id: {problem}")
        runs_dir = self.runs_dir()
        root, path = _real(runs_dir), runs_dir / run_id
        try:
            real = index.confine(root, path)
        except PermissionError as err:
            raise web.HTTPError(403, str(err)) from None
        if not real.is_dir():
            raise web.HTTPError(404, f"no run directory at {path}")
        if not (real / index.CONFIG_FILE).exists() and not (real / index.STATUS_FILE).exists():
            raise web.HTTPError(404, f"{path} is not a run directory (no {index.CONFIG_FILE} / {index.STATUS_FILE})")
        run_index = self.run_index()
        fields_arg = self.get_query_argument("fields", "")
        fields = [f for f in fields_arg.split(",") if f] or list(run_index.series_fields)
        # Checked before reading: the index holds only the plotted fields, so others cannot be sent.
        unheld = [f for f in fields if f not in run_index.series_fields] if fields != ["*"] else []
        if unheld:
            raise web.HTTPError(
                400,
                (
                    f"fields {', '.join(unheld)} are not served: the server keeps only the plotted "
                    f"fields ({', '.join(run_index.series_fields)}); read the others in a notebook with "
                    f"workbench.runs.run_dir.RunDir({str(path)!r}).read_metrics()"
                ),
            )
        rank_arg = self.get_query_argument("rank", "")
        try:
            answer = await asyncio.to_thread(run_index.metrics, root, real / index.METRICS_FILE)
        except PermissionError as err:
            raise web.HTTPError(403, str(err)) from None
        records = answer["records"]
        if rank_arg != "":
            records = [r for r in records if str(r.get("rank", 0)) == rank_arg]
        if fields != ["*"]:
            records = [{k: r[k] for k in fields if k in r} for r in records]
        self.write_json({**answer, "id": run_id, "path": str(path), "records": records})


class NotebooksHandler(WorkbenchHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.write_json(await asyncio.to_thread(list_notebooks))


class NotebookCopyHandler(WorkbenchHandler):
    """POST: copy a workbench notebook into the user's notebooks folder unless it is there; say where to open it.

    Answer: {"path": contents path to open, or None when the folder is outside the server's root,
    "file": the copy on disk, "copied": whether it was written now, "note": why it cannot be opened here}.
    """

    @web.authenticated
    @authorized
    async def post(self, name: str) -> None:
        try:
            content = await asyncio.to_thread(read_notebook, name)
        except PermissionError as err:
            raise web.HTTPError(403, str(err)) from None
        except ValueError as err:
            raise web.HTTPError(400, str(err)) from None
        except KeyError as err:
            raise web.HTTPError(404, str(err.args[0])) from None
        settings: MoeWorkbenchLab = self.settings[SETTINGS_KEY]
        try:
            folder = notebooks_target_dir(settings.allowed_runs_dir(), settings.notebooks_dir)
        except ValueError as err:
            raise web.HTTPError(409, str(err)) from None
        try:
            # Never overwritten: the user's copy may hold edits; it is just opened.
            path, copied = await asyncio.to_thread(copy_notebook, content, folder, name)
        except PermissionError as err:
            raise web.HTTPError(403, str(err)) from None
        root_dir = getattr(self.contents_manager, "root_dir", None)  # a file-backed contents manager's folder
        shown = contents_path(root_dir, path)
        answer = {"path": shown, "file": str(path), "copied": copied}
        if shown is None:
            answer["note"] = (
                f"{path} is outside the folder this server shows ({root_dir}), so the lab cannot open it here: "
                f"run `jupyter lab --notebook-dir {folder.parent}` to work in it, or set "
                "c.MoeWorkbenchLab.notebooks_dir to a folder inside the server's folder (not the repository "
                "checkout)"
            )
        self.write_json(answer)


class PlotlyBundleHandler(web.RequestHandler):
    """plotly's FigureWidget script, for workbench.ui.slim_figure's loader (keeps saved notebooks small).

    Not behind the token, like JupyterLab's own static files: it is a public library's script,
    and a dynamic import() in the page must load it however the user logged in.
    """

    async def get(self, version: str) -> None:
        try:
            import plotly
        except ImportError:
            raise web.HTTPError(404, "plotly is not installed on the server") from None
        if version != plotly.__version__:
            # The loader names the kernel's plotly: another version's script may not match its messages.
            raise web.HTTPError(404, f"the server has plotly {plotly.__version__}, not {version}")
        path = Path(plotly.__file__).parent / "package_data" / "widgetbundle.js"
        if not path.is_file():
            raise web.HTTPError(404, f"plotly {version} has no {path.name}")
        body = self.settings.get(PLOTLY_BUNDLE_KEY)
        if body is None:
            # Compressed once per server (5 MB of JavaScript is ~1.5 MB gzipped; tornado does not compress).
            body = await asyncio.to_thread(lambda: gzip.compress(path.read_bytes(), compresslevel=6))
            self.settings[PLOTLY_BUNDLE_KEY] = body
        self.set_header("Content-Type", "text/javascript; charset=utf-8")
        # The URL holds the version: a cached copy is valid until plotly changes, so keep it.
        self.set_header("Cache-Control", "public, max-age=31536000, immutable")
        if "gzip" in self.request.headers.get("Accept-Encoding", ""):
            self.set_header("Content-Encoding", "gzip")
            self.finish(body)
        else:
            self.finish(gzip.decompress(body))


def setup_handlers(web_app, parent=None) -> None:
    """Register the routes under <base_url>moe-workbench/api/."""
    web_app.settings[CLUSTER_WATCHER_KEY] = ClusterWatcher(parent=parent)
    web_app.settings[SETTINGS_KEY] = MoeWorkbenchLab(parent=parent)
    web_app.settings[RUN_INDEX_KEY] = None  # made on first use: importing workbench is not free
    base = url_path_join(web_app.settings["base_url"], "moe-workbench", "api")
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base, "gpus"), GpusHandler),
            (url_path_join(base, "clusters"), ClustersHandler),
            (url_path_join(base, "runs"), RunsHandler),
            (url_path_join(base, "runs", r"([^/]+)", "metrics"), RunMetricsHandler),
            (url_path_join(base, "notebooks"), NotebooksHandler),
            (url_path_join(base, "notebooks", r"([^/]+\.ipynb)"), NotebookCopyHandler),
            (
                url_path_join(
                    web_app.settings["base_url"], "moe-workbench", "plotly", r"([0-9A-Za-z.+-]+)", "widgetbundle.js"
                ),
                PlotlyBundleHandler,
            ),
        ],
    )
