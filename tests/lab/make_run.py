"""A real run directory for the lab tests, written by a real `workbench finetune` (2 CPU ranks).

The run is the demo config (tiny model) with a name and eval on (data.eval_every=1 over held-out
rows of the shipped SFT data), so its metrics hold eval_loss / eval_accuracy for the run view.
`make_run_dir(tmp_path)` copies one session-wide run into tmp_path/runs; `python make_run.py
<runs_dir>` runs it into <runs_dir> and prints the run id (extensions/ci.sh uses it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

RUN_ID = "demo-run"
RUN_NAME = "lab test · eval on"
# A second, LoRA run beside the full one: the lab must tell the two apart (name and kind). Its name is
# long, so the sidebar must wrap or cut it and keep it whole in a tooltip; 20 steps, so the run view's
# step axis must reach step 20.
LORA_RUN_ID = "lora-run"
LORA_RUN_NAME = "lab test · LoRA rank 8 on attention, a name long enough to need more than one line"
LORA_RUN_STEPS = 20


def _prompt_completion_rows(folder: Path) -> Path:
    """The shipped SFT data's prompt/response rows as a prompt/completion JSONL file (for data.kind=datasets)."""
    from workbench.config import TINY_SFT_PATH

    rows = [json.loads(line) for line in TINY_SFT_PATH.read_text().splitlines() if line.strip()]
    path = folder / "rows.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": r["prompt"], "completion": r["response"]}) + "\n" for r in rows if "prompt" in r)
    )
    return path


def run_demo(runs_dir: Path, steps: int = 3, run_id: str = RUN_ID) -> str:
    """`workbench finetune` of the demo config, named, with eval, on 2 ranks into runs_dir; returns the run id."""
    from workbench.config import RunConfig

    data_dir = Path(tempfile.mkdtemp(prefix="mwb-lab-data-"))
    config = RunConfig.demo(
        name=RUN_NAME,
        train__steps=steps,
        train__save_final_checkpoint=False,
        data__kind="datasets",
        data__data_files=str(_prompt_completion_rows(data_dir)),
        data__eval_fraction=0.1,
        data__eval_every=1,
        data__cache_dir=str(data_dir / "cache"),
    )
    return _finetune(config, data_dir, runs_dir, run_id)


def run_lora(runs_dir: Path, steps: int = LORA_RUN_STEPS, run_id: str = LORA_RUN_ID) -> str:
    """`workbench finetune` of the demo config as a named LoRA run (rank 8 on attention), no eval; returns the id."""
    from workbench.config import RunConfig
    from workbench.config_lora import LoraConfig

    data_dir = Path(tempfile.mkdtemp(prefix="mwb-lab-data-"))
    config = RunConfig.demo(
        name=LORA_RUN_NAME,
        lora=LoraConfig(rank=8, alpha=16.0, targets=("attention",)),
        train__steps=steps,
        train__save_final_checkpoint=False,
    )
    return _finetune(config, data_dir, runs_dir, run_id)


def _finetune(config, data_dir: Path, runs_dir: Path, run_id: str) -> str:
    config.to_yaml(data_dir / "run.yaml")
    cmd = [
        sys.executable,
        "-m",
        "workbench.cli",
        "finetune",
        str(data_dir / "run.yaml"),
        "--nproc-per-node",
        "2",
        "--output-dir",
        str(runs_dir),
        "--run-id",
        run_id,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ})
    if done.returncode != 0:
        raise RuntimeError(f"workbench finetune failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return run_id


@lru_cache(maxsize=1)
def _session_run() -> Path:
    runs_dir = Path(tempfile.mkdtemp(prefix="mwb-demo-runs-"))
    run_demo(runs_dir)
    return runs_dir / RUN_ID


def make_run_dir(tmp_path: Path) -> tuple[Path, str]:
    """A copy of the session's real demo run under tmp_path/runs; returns (runs_dir, run_id)."""
    runs_dir = Path(tmp_path) / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(_session_run(), runs_dir / RUN_ID)
    return runs_dir, RUN_ID


def trainer_records(first_step: int, count: int) -> list[dict]:
    """Records shaped like the trainer's (both ranks, an expert-load matrix), loss falling with step."""
    return [
        {
            "step": s,
            "rank": rank,
            "loss": 10.0 / s,
            "tokens_per_s_per_gpu": 1000.0 + s,
            "expert_load": [[s % 97] * 8] * 2,
            "time": 1.0 * s,
        }
        for s in range(first_step, first_step + count)
        for rank in (0, 1)
    ]


def append_records(path: Path, records: list[dict]) -> int:
    """Append records as the trainer does (one JSON object per line); returns the bytes written."""
    return append_text(path, "".join(json.dumps(r) + "\n" for r in records))


def append_text(path: Path, text: str) -> int:
    """Append raw text (a torn line, a garbled one); returns the bytes written."""
    with open(path, "a") as f:
        f.write(text)
    return len(text.encode())


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:] not in ([], ["--lora"]):
        sys.exit("usage: python make_run.py <runs_dir> [--lora]")
    print(run_lora(Path(sys.argv[1])) if sys.argv[2:] == ["--lora"] else run_demo(Path(sys.argv[1])))
