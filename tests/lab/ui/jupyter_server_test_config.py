"""Jupyter server for the Galata UI test: galata's test settings (no token), our extension on."""

import os

from jupyterlab.galata import configure_jupyter_server

configure_jupyter_server(c)  # noqa: F821 (c is the config object jupyter passes in)
c.ServerApp.port = int(os.environ.get("MWB_UI_PORT", "8899"))  # noqa: F821
c.ServerApp.allow_root = True  # noqa: F821 (CI runs as root)
c.ServerApp.jpserver_extensions = {"moe_workbench_lab": True}  # noqa: F821
c.LabApp.news_url = None  # noqa: F821 (no network: skip the news fetch)
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"  # noqa: F821
