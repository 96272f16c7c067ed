"""MoE Workbench for JupyterLab: a server API (GPUs, clusters, runs) and a sidebar that shows it."""

from .handlers import setup_handlers

__version__ = "0.1.0"


def _jupyter_labextension_paths() -> list[dict]:
    return [{"src": "labextension", "dest": "moe-workbench-lab"}]


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "moe_workbench_lab"}]


def _load_jupyter_server_extension(server_app) -> None:
    """Add the /moe-workbench/api/ routes to the running server."""
    setup_handlers(server_app.web_app, parent=server_app)
    server_app.log.info("moe_workbench_lab: routes registered under /moe-workbench/api/")
