"""Reading runs and reporting errors: what `workbench show`/`runs` say of a damaged or huge run, which run ids
exist, and how `workbench finetune` ends when a config, the data or a step fails (the real CLI, in subprocesses).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

import workbench
from workbench.cli import main
from workbench.config import ConfigError, RunConfig
from workbench.runs.run_dir import RunDir
from workbench.train import finetune

try:
    from workbench.runs.run_index import list_runs
except ImportError:  # where it lived at 429045a: these tests are also run against that commit, to see them fail
    from workbench.runs.run_dir import list_runs

# The package under test (a checkout named on PYTHONPATH too): the subprocesses import the same one.
PACKAGE_ROOT = Path(workbench.__file__).resolve().parents[1]


def _cli(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT), "OMP_NUM_THREADS": "1", "WORKBENCH_RUNS_DIR": str(cwd)}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "workbench.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _config(folder: Path, **overrides) -> Path:
    """A tiny run's YAML (the demo model, 64-token rows, 3 steps of 2 sequences, no checkpoint)."""
    settings = dict(
        data__seq_len=64,
        train__steps=3,
        train__global_batch_size=2,
        train__local_batch_size=2,
        train__save_final_checkpoint=False,
    )
    settings.update(overrides)
    path = folder / "cfg.yaml"
    RunConfig.demo(**settings).to_yaml(path)
    return path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A real 3-step run of the tiny model (in this process), completed: config, status, metrics."""
    runs = tmp_path_factory.mktemp("trust-runs")
    rc = RunConfig.demo(
        output_dir=str(runs),
        run_id="done",
        data__seq_len=64,
        train__steps=3,
        train__global_batch_size=2,
        train__local_batch_size=2,
        train__save_final_checkpoint=False,
    )
    return Path(finetune(rc)["run_dir"])


def _copy(run: Path, folder: Path, name: str) -> Path:
    folder.mkdir(exist_ok=True)
    return Path(shutil.copytree(run, folder / name))


# -- a damaged metrics file: readers say what they skipped; status.json's later step is taken -------------


def test_show_of_a_torn_last_metrics_line_says_so_and_takes_the_final_step_from_status(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path / "runs", "torn")
    lines = run.joinpath("metrics.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) == 3
    last = json.loads(lines[-1])
    status = json.loads(run.joinpath("status.json").read_text())
    assert status["step"] == 3 and status["final_loss"] == pytest.approx(last["loss"])
    # The writer died inside step 3's line: half of it is on disk, no newline.
    run.joinpath("metrics.jsonl").write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])

    assert main(["show", str(run)]) == 0
    out = capsys.readouterr().out
    assert "  steps         3/3 " in out, out
    assert f"final {status['final_loss']:.4f} at step 3" in out, out
    step2 = json.loads(lines[1])
    assert f"final {step2['loss']:.4f}" not in out  # the torn file's last complete record is not "final"
    assert "step 3 and its loss from status.json: the last complete record in metrics.jsonl is of step 2" in out
    assert "skipped 1 damaged line in metrics.jsonl (line 3)" in out, out


def test_a_garbled_middle_line_is_named_by_its_line_number(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path / "runs", "garbled")
    lines = run.joinpath("metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = '{"step": 2, "rank": 0, "loss": 6.1\x00garbage}\n'
    run.joinpath("metrics.jsonl").write_text("".join(lines))
    assert main(["show", str(run)]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 damaged line in metrics.jsonl (line 2)" in out, out
    assert "  steps         3/3 " in out and "final" in out and "status.json" not in out
    [summary] = list_runs(tmp_path / "runs")
    assert summary["metrics_skipped"]["lines"] == 1  # the table's reader says so too (its DETAIL column)
    with pytest.warns(UserWarning, match=r"skipped 1 damaged line in metrics.jsonl \(line 2\)"):
        records = RunDir(run).read_metrics()  # a notebook's reader
    assert [r["step"] for r in records] == [1, 3]


# -- run ids: one rule for every writer and reader ---------------------------------------------------


@pytest.mark.parametrize("run_id", [".hidden", "a\\b", "x" * 300, "a b", "-flag", "run\n2"])
def test_run_ids_some_reader_cannot_take_are_refused_when_the_config_is_made(run_id, tmp_path):
    with pytest.raises(ConfigError, match=r"run_id .* is not valid: use 1-128 letters, digits"):
        RunConfig.demo(run_id=run_id)
    with pytest.raises(ValueError, match="is not valid"):
        RunDir.create(tmp_path / "runs", run_id, {})  # refused before the runs folder is touched
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ConfigError, match="run_id '' is not valid"):
        RunConfig.demo(run_id="")


def test_run_ids_every_reader_takes_are_accepted():
    for run_id in ("20261129-235959-ab12", "lr3e-4_run2", "a", "A.b-c_d", "9" * 128):
        assert RunConfig.demo(run_id=run_id).run_id == run_id


# The command's own entry point in this process (`main`, what the console script calls): a refusal before any work
# needs no fresh interpreter, which would spend seconds importing torch to print one line.
def test_finetune_refuses_a_hidden_run_id_with_one_line_and_exit_code_2(tmp_path, capsys):
    code = main(["finetune", str(_config(tmp_path)), "--run-id", ".hidden", "--output-dir", str(tmp_path / "runs")])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert err.splitlines() == [
        "workbench finetune: run_id '.hidden' is not valid: use 1-128 letters, digits, '.', '_' or '-', "
        "starting with a letter or digit (e.g. lr3e-4_run2)"
    ]
    assert out == "" and not (tmp_path / "runs").exists()


def test_demo_refuses_a_too_long_run_id_with_one_line_and_exit_code_2(tmp_path, capsys):
    code = main(["demo", "--run-id", "y" * 300, "--ranks", "1", "--output-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2, err
    [line] = err.splitlines()
    assert line.startswith("workbench demo: run_id 'yyyyy") and "(300 characters) is not valid" in line
    assert len(line) < 300 and not (tmp_path / "runs").exists()


def test_a_run_folder_no_run_id_can_name_is_listed_as_unreadable_with_the_rule(finished_run, tmp_path, capsys):
    runs = tmp_path / "runs"
    _copy(finished_run, runs, "good")
    _copy(finished_run, runs, "made by hand")  # a space: an older version, or a person, made it
    summaries = {s["id"]: s for s in list_runs(runs)}
    assert summaries["good"]["readable"] and summaries["good"]["state"] == "completed"
    bad = summaries["made by hand"]
    assert not bad["readable"] and "run_id 'made by hand' is not valid" in bad["error"], bad
    assert "rename the folder" in bad["error"]

    assert main(["show", "made by hand", "--runs-dir", str(runs)]) == 2
    assert "run_id 'made by hand' is not valid" in capsys.readouterr().err
    assert main(["show", "z" * 300, "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    assert "(300 characters) is not valid" in err and len(err) < 400


# -- finetune's errors: one line; 2 = refused before work, 1 = failed during work ---------------------


@pytest.mark.parametrize(
    "setting,needle",
    [
        (
            "train.optimizer_in_backward=true",
            "train.optimizer_in_backward runs on one rank without gradient "
            "accumulation for now (a gradient must be complete when its hook fires): this run has 2 ranks",
        ),
        (
            "train.cuda_graphs=true",
            "it runs on one rank for now (FSDP2's hooks and collectives are not captured): this run has 2",
        ),
    ],
)
def test_nproc_per_node_refuses_rank_count_options_before_torchrun_starts(tmp_path, setting, needle):
    start = time.monotonic()
    proc = _cli(
        [
            "finetune",
            str(_config(tmp_path, train__global_batch_size=4, train__clip_grad_norm=None)),
            "--set",
            setting,
            "--nproc-per-node",
            "2",
            "--output-dir",
            str(tmp_path / "runs"),
        ],
        tmp_path,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    [line] = proc.stderr.splitlines()  # one line from the launcher: no rank, no torchrun traceback
    assert line.startswith("workbench finetune: train.") and needle in line, line
    assert not (tmp_path / "runs").exists()
    assert time.monotonic() - start < 60  # torchrun never started its ranks


def _bad_rows_config(folder: Path) -> tuple[Path, Path]:
    rows = folder / "rows.jsonl"
    rows.write_text('{"prompt": "hi", "response": "there"}\nnot json at all\n')
    return _config(folder, data__path=str(rows)), rows


def test_a_data_error_is_one_line_with_exit_code_2(tmp_path):
    cfg, rows = _bad_rows_config(tmp_path)
    proc = _cli(["finetune", str(cfg), "--output-dir", str(tmp_path / "runs")], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    ours = [line for line in proc.stderr.splitlines() if line.startswith("workbench")]
    assert len(ours) == 1 and f"{rows}:2" in ours[0], proc.stderr


def test_debug_prints_the_traceback_of_an_error(tmp_path):
    cfg, rows = _bad_rows_config(tmp_path)
    proc = _cli(["finetune", str(cfg), "--output-dir", str(tmp_path / "runs"), "--debug"], tmp_path)
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr and f"{rows}:2" in proc.stderr.splitlines()[-1]


def test_a_failure_during_training_is_one_line_with_exit_code_1_and_the_traceback_in_the_run_folder(tmp_path):
    # lr 1e6 without clipping: step 1 is finite, step 2's backward overflows and the guard stops the run.
    cfg = _config(tmp_path, train__lr=1e6, train__clip_grad_norm=None)
    proc = _cli(["finetune", str(cfg), "--run-id", "diverged", "--output-dir", str(tmp_path / "runs")], tmp_path)
    assert proc.returncode == 1, proc.stderr
    log = tmp_path / "runs" / "diverged" / "error.log"
    ours = [line for line in proc.stderr.splitlines() if line.startswith("workbench")]
    assert ours == [line for line in ours if "NonFiniteError: step 2" in line and f"(traceback in {log})" in line]
    assert len(ours) == 1 and "Traceback" not in proc.stderr, proc.stderr
    text = log.read_text()
    assert text.startswith("--- rank 0, ") and "Traceback (most recent call last)" in text and "NonFiniteError" in text
    assert oct(log.stat().st_mode & 0o777) == "0o600"
    assert RunDir(log.parent).read_status()["state"] == "failed"


# -- size: `runs` reads the end of each metrics file, `show` streams it, configs are capped -------------


def _big_metrics(run: Path, megabytes: int) -> int:
    """Replace the run's metrics with `megabytes` MB of trainer-shaped records (2 ranks); returns the last step."""
    pad = "p" * 1800  # the size of a large model's expert-load matrix, as text cheap to parse
    line = (
        '{{"step": {s}, "rank": {r}, "loss": {loss}, "tokens_per_s_per_gpu": {tps}, "mem_peak_gib": 1.5, '
        '"time": {s}.0, "step_time_s": 1.0, "expert_load": [[1, 2], [3, 4]], "pad": "' + pad + '"}}\n'
    )
    per_step = len(line.format(s=1, r=0, loss=1.0, tps=1000.0)) * 2
    steps = megabytes * 2**20 // per_step
    with open(run / "metrics.jsonl", "w") as f:
        for start in range(1, steps + 1, 1000):
            f.write(
                "".join(
                    line.format(s=s, r=r, loss=10.0 / s, tps=1000.0 + (s % 7))
                    for s in range(start, min(start + 1000, steps + 1))
                    for r in (0, 1)
                )
            )
    status = json.loads((run / "status.json").read_text())
    status.update(step=steps, total_steps=steps, final_loss=10.0 / steps)
    (run / "status.json").write_text(json.dumps(status))
    return steps


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts the bytes read with Linux's /proc/self/io")
def test_runs_reads_the_end_of_a_large_metrics_file_not_all_of_it(finished_run, tmp_path, capsys):
    runs = tmp_path / "runs"
    steps = _big_metrics(_copy(finished_run, runs, "big"), 64)
    _copy(finished_run, runs, "small")
    before = _bytes_read()
    assert main(["runs", str(runs)]) == 0
    read = _bytes_read() - before
    out = capsys.readouterr().out
    assert read < 2**20, read  # of 64 MB: its last records, two config.json and two status.json
    big = next(line for line in out.splitlines() if line.startswith("big "))
    assert f"{steps}/{steps}" in big and f"{10.0 / steps:.4f}" in big, out
    median = statistics.median(1000.0 + (s % 7) for s in range(steps - 9, steps + 1))  # what `show` says too
    assert f" {median:,.0f} " in big, out


def test_show_streams_a_large_metrics_file_in_bounded_memory(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path / "runs", "big")
    steps = _big_metrics(run, 64)
    tracemalloc.start()
    try:
        assert main(["show", str(run)]) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    out = capsys.readouterr().out
    assert peak < 24 * 2**20, peak  # a 64 MB file: chunks and thinned plot points, never its records
    # Figures of every record, not of the thinned ones: tokens/s is 1000 + step % 7, its median over the last 10.
    median = statistics.median(1000.0 + (s % 7) for s in range(steps - 9, steps + 1))
    assert f"  steps         {steps}/{steps} " in out
    assert f"tokens/s/gpu  {median:,.0f} (median of steps {steps - 9}-{steps}" in out
    assert f"final {10.0 / steps:.4f}" in out and "peak 1.50 GiB" in out
    assert "skipped" not in out
    [loss_plot] = [line for line in out.splitlines() if line.startswith("  loss ") and "(steps 1-" in line]
    assert loss_plot.endswith(f"(steps 1-{steps})")


def test_a_config_json_with_a_huge_name_is_refused_unread_and_a_long_one_is_cut(finished_run, tmp_path):
    runs = tmp_path / "runs"
    huge = _copy(finished_run, runs, "huge")
    config = json.loads((huge / "config.json").read_text())
    (huge / "config.json").write_text(json.dumps({**config, "name": "n" * (8 * 2**20)}))
    long = _copy(finished_run, runs, "long")
    (long / "config.json").write_text(json.dumps({**config, "name": "m" * 100_000}))
    summaries = {s["id"]: s for s in list_runs(runs)}
    assert len(json.dumps(summaries)) < 64 * 2**10
    size = (huge / "config.json").stat().st_size
    assert not summaries["huge"]["readable"] and f"config.json is {size:,} bytes" in summaries["huge"]["error"]
    assert "over the 1,048,576" in summaries["huge"]["error"]
    assert summaries["long"]["readable"] and summaries["long"]["name"] == "m" * 197 + "..."
    with pytest.raises(ConfigError, match="at most 200 characters"):
        RunConfig.demo(name="m" * 201)


def test_a_huge_error_message_is_clipped_in_status_json_so_the_run_stays_listed(finished_run, tmp_path):
    run = RunDir(_copy(finished_run, tmp_path / "runs", "boom"))
    message = "KeyError: " + "k" * (4 * 2**20) + " the end"
    run.write_status("failed", error=message, traceback="Traceback (most recent call last):\n" + message)
    assert run.status_path.stat().st_size < 100 * 2**10
    status = run.read_status()
    assert status["error"].startswith("KeyError: kkk") and status["error"].endswith("kkk the end")
    assert "characters left out" in status["error"]
    [summary] = list_runs(tmp_path / "runs")
    assert summary["readable"] and summary["state"] == "failed"


def test_demo_on_a_rank_count_the_batch_cannot_split_is_one_line_before_any_rank(tmp_path, capsys):
    code = main(["demo", "--ranks", "3", "--steps", "1", "--output-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2, err
    [line] = err.splitlines()
    assert line == (
        "workbench demo: train.global_batch_size (8) must be a multiple of local_batch_size (4) x data-parallel "
        "size (3)"
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_demo_rank_refused_inside_the_ranks_says_it_once_without_a_traceback(tmp_path, capfd):
    """Data the ranks refuse (bytes that are not UTF-8) is one line from rank 0 and exit code 2, as finetune says it."""
    from workbench.config import DataConfig, RunConfig
    from workbench.parallel.launch import spawn

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "a\xff\xfe", "completion": "b"}\n')
    rc = RunConfig.demo(
        output_dir=str(tmp_path / "runs"),
        train__steps=1,
        data=DataConfig(kind="datasets", data_files=str(bad), seq_len=64, cache_dir=str(tmp_path / "cache")),
    )
    code = spawn("workbench.cli_demo:demo_rank", {"config": rc.to_dict(), "bar": False}, 2, "demo")
    err = capfd.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    refusals = [line for line in err.splitlines() if line.startswith("workbench demo: ")]
    assert len(refusals) == 1 and str(bad) in refusals[0], err
