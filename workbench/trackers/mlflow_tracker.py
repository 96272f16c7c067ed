"""MLflow: a SQLite tracking store in <run>/mlflow/mlflow.db (artifacts beside it), through MLflow's client.

Read it with `mlflow ui --backend-store-uri sqlite:///<run>/mlflow/mlflow.db`, or MlflowClient on that URI.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

FOLDER = "mlflow"
EXPERIMENT = "moe-workbench"
# MlflowClient.log_batch's limits per call
MAX_METRICS, MAX_PARAMS, MAX_PARAM_CHARS = 1000, 100, 6000
STATUS = {"completed": RunStatus.FINISHED, "stopped": RunStatus.KILLED}


def tracking_uri(run_dir: Path) -> str:
    """The SQLite store of the run in `run_dir`."""
    return f"sqlite:///{(Path(run_dir) / FOLDER / 'mlflow.db').resolve()}"


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`config` as MLflow params: "section.key" -> the value's text (cut to MLflow's limit)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:MAX_PARAM_CHARS]
    return out


class MlflowTracker:
    def __init__(self, client: MlflowClient, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def log(self, scalars: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in scalars.items()]
        for i in range(0, len(metrics), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MAX_METRICS])

    def close(self, state: str) -> None:
        self.client.set_terminated(self.run_id, RunStatus.to_string(STATUS.get(state, RunStatus.FAILED)))


def open_run(run_dir: Path, run_name: str, config: dict[str, Any]) -> MlflowTracker:
    folder = Path(run_dir) / FOLDER
    folder.mkdir(exist_ok=True)
    client = MlflowClient(tracking_uri=tracking_uri(run_dir))
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        experiment_id = client.create_experiment(
            EXPERIMENT, artifact_location=(folder / "artifacts").resolve().as_uri()
        )
    else:
        experiment_id = experiment.experiment_id
    run = client.create_run(experiment_id, run_name=run_name)
    params = [Param(k, v) for k, v in flat_params(config).items()]
    for i in range(0, len(params), MAX_PARAMS):
        client.log_batch(run.info.run_id, params=params[i : i + MAX_PARAMS])
    return MlflowTracker(client, run.info.run_id)
