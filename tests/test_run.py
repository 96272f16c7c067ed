"""Run: the real trainer (workbench.train.finetune) on a 2-rank ipyparallel cluster over gloo."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest

pytest.importorskip("ipyparallel")

from workbench.cluster import RankError, Run
from workbench.config import RunConfig

STEP_FIELDS = {
    "step",
    "rank",
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "mem_peak_gib",
    "mem_now_gib",
    "expert_load",
    "expert_load_cv",
    "step_time_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "time",
}
# The `cluster` fixture (tests/conftest.py) is one cluster for the module: a failed run leaves it usable (the
# process group is re-joined), and the killed-engine test, which runs last, restarts it.


def _demo(tmp_path, **overrides) -> RunConfig:
    return RunConfig.demo(output_dir=str(tmp_path), **overrides)


def _wait_for_step(run: Run, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while (run.last_step or 0) < step:
        assert not run.done, f"run ended early: {run.status}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s: {run.status}"
        time.sleep(0.05)


@pytest.mark.slow
def test_run_streams_every_step_from_both_ranks(cluster, tmp_path):
    steps = 4
    live: list[tuple[int, int]] = []
    t0 = time.monotonic()
    run = cluster.finetune(_demo(tmp_path, train__steps=steps))
    assert time.monotonic() - t0 < 2, "finetune must return at once"
    assert not run.done
    run.on_metrics(lambda records: live.extend((r["rank"], r["step"]) for r in records))
    streamed = []
    reader = threading.Thread(target=lambda: streamed.extend((r["rank"], r["step"]) for r in run))
    reader.start()
    bar, label = run.progress.children  # ipywidgets, created lazily on the notebook side only
    status = run.wait(timeout=300)
    reader.join(timeout=30)

    expected = {(rank, step) for rank in (0, 1) for step in range(1, steps + 1)}
    assert status["state"] == "completed" and run.done
    assert sorted(live) == sorted(expected)  # each (rank, step) exactly once
    assert sorted(streamed) == sorted(expected)
    assert run.delivery.get("stream", 0) > 0, f"nothing arrived live: {run.delivery}"
    assert bar.value == steps and bar.max == steps and bar.bar_style == "success"
    assert label.value.startswith(f"completed at step {steps}/{steps}")
    df = run.metrics
    assert STEP_FIELDS <= set(df.columns)
    assert set(zip(df["rank"], df["step"])) == expected and len(df) == len(expected)
    # Both ranks train the same model on the same global batch: identical loss per step.
    by_rank = df.pivot(index="step", columns="rank", values="loss")
    assert (by_rank[0] - by_rank[1]).abs().max() < 1e-5

    # The record on disk outlives this Run object (and the kernel).
    reopened = Run.from_dir(run.path)
    assert reopened.done and reopened.state == "completed"
    assert set(zip(reopened.metrics["rank"], reopened.metrics["step"])) == expected
    with pytest.raises(RuntimeError, match="read-only"):
        reopened.stop()


def _delivered_once(run: Run, live: list[tuple[int, int]], steps: int) -> None:
    expected = {(rank, step) for rank in (0, 1) for step in range(1, steps + 1)}
    assert sorted(live) == sorted(expected)  # subscribers saw each (rank, step) exactly once
    assert sorted((r["rank"], r["step"]) for r in run.records) == sorted(expected)
    assert sum(run.delivery.values()) == len(expected), run.delivery


@pytest.mark.slow
def test_each_record_crosses_the_data_channel_once(cluster, tmp_path):
    from stream_spy import read_tap

    steps = 12
    run = cluster.finetune(
        _demo(tmp_path, train__steps=steps, train__save_final_checkpoint=False),
        target="tests.stream_spy:finetune_tapped",
    )
    live: list[tuple[int, int]] = []
    run.on_metrics(lambda records: live.extend((r["rank"], r["step"]) for r in records))
    run.wait(timeout=300)
    _delivered_once(run, live, steps)
    for rank, ar in enumerate(run._results):
        result = ar.get()
        assert "records" not in result and result["published"] == steps  # the end resends nothing
        messages = read_tap(run.path, rank)
        sent = [s for m in messages for s in m["steps"]]
        assert sent == list(range(1, steps + 1)), messages  # every record once, in order
        assert [(m["first"], m["last"]) for m in messages] == [
            (m["first"], m["first"] + len(m["steps"]) - 1) for m in messages
        ]
        assert sum(m["loads"] for m in messages) == 3  # steps 1, 11 and the last, 12
        per_step = sum(m["bytes"] for m in messages) / steps
        print(f"\nrank {rank}: {len(messages)} messages, {per_step:.0f} bytes per step")
    assert run.records[-1]["step"] == steps and run.records[-1]["expert_load"]  # the plots' heatmap
    assert run._store.held_loads() == 2
    df = run.metrics  # from metrics.jsonl: every step's matrix
    assert df["expert_load"].map(len).gt(0).all() and len(df) == 2 * steps


@pytest.mark.slow
def test_records_the_notebook_missed_come_from_disk_once(cluster, tmp_path):
    from stream_spy import read_tap

    steps = 10
    run = cluster.finetune(
        _demo(tmp_path, train__steps=steps, train__save_final_checkpoint=False),
        target="tests.stream_spy:finetune_dropping",
        poll_interval=1.0,
    )
    live: list[tuple[int, int]] = []
    run.on_metrics(lambda records: live.extend((r["rank"], r["step"]) for r in records))
    run.wait(timeout=300)
    _delivered_once(run, live, steps)
    assert run.delivery.get("disk", 0) >= 2 * 3, run.delivery  # records 3..5 of each rank never came live
    for rank in (0, 1):
        assert any(m["dropped"] for m in read_tap(run.path, rank))


@pytest.mark.slow
def test_stop_halts_within_one_step_and_checkpoint_resumes(cluster, tmp_path):
    run = cluster.finetune(_demo(tmp_path, train__steps=500))
    _wait_for_step(run, 2)
    requested_at = time.time()
    status = run.stop(timeout=120)
    assert status["state"] == "stopped" and run.state == "stopped"
    df = run.metrics
    # At most the step in flight when stop() was called finishes afterwards. Counted in steps: the ranks end a step
    # moments apart (rank 1 records it after the collective rank 0 left first), so one rank's last step before the
    # request can carry a later time stamp than another's.
    stopped_at = int(status["step"])
    finished_before = int(df[df["time"] <= requested_at]["step"].max())
    assert stopped_at <= finished_before + 1, (stopped_at, finished_before, df[["rank", "step", "time"]].to_dict())
    assert stopped_at < 500 and set(df["step"]) == set(range(1, stopped_at + 1))
    checkpoint = status["checkpoint"]
    assert checkpoint and os.path.isdir(checkpoint)
    assert json.loads((run.path / "status.json").read_text())["state"] == "stopped"

    # Loadable: a new run resumes from it on the same cluster and continues at the next step.
    resumed = cluster.finetune(
        _demo(
            tmp_path,
            train__steps=stopped_at + 1,
            train__resume_from=checkpoint,
            train__resume_allow_changes=["train.steps"],
        )
    )
    resumed.wait(timeout=300)
    assert sorted(resumed.metrics["step"].unique()) == [stopped_at + 1]


@pytest.mark.slow
def test_a_failing_rank_reaches_the_notebook_with_its_rank(cluster, tmp_path):
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"prompt": "hi"}\n{"nothing": 1}\n')  # rows without a response
    run = cluster.finetune(_demo(tmp_path / "runs", data__path=str(bad_rows)))
    with pytest.raises(RankError) as info:
        run.wait(timeout=300)
    err = info.value
    assert err.rank in (0, 1) and f"rank {err.rank} failed" in str(err)
    assert set(err.errors) == {0, 1}  # the data is bad for every rank: both report
    for tb in err.errors.values():
        assert "Traceback" in tb and "bad.jsonl" in tb, tb[-500:]
    assert run.state == "failed" and run.status["failed_ranks"] == [0, 1]

    # The cluster is still usable: the next run re-joins the process group and completes.
    ok = cluster.finetune(_demo(tmp_path / "runs", train__steps=2))
    assert ok.wait(timeout=300)["state"] == "completed"


@pytest.mark.slow
def test_killed_engine_fails_the_run_within_10s_and_restart_recovers(cluster, tmp_path):
    run = cluster.finetune(_demo(tmp_path, train__steps=500))
    _wait_for_step(run, 1)
    victim = cluster.pids()["engines"][1]
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    while not run.done:
        assert time.monotonic() - killed_at < 10, f"run not failed 10 s after kill -9: {run.status}"
        time.sleep(0.05)
    print(f"\nkilled engine noticed in {time.monotonic() - killed_at:.2f} s")
    assert run.state == "failed"
    with pytest.raises(RankError) as info:
        run.wait(timeout=1)
    assert 1 in info.value.errors and "died" in info.value.errors[1]
    assert json.loads((run.path / "status.json").read_text())["state"] == "failed"

    old = cluster.pids()
    cluster.restart()
    assert cluster.running
    assert not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in old["engines"].values()
    )
    again = cluster.finetune(_demo(tmp_path, train__steps=2))
    assert again.wait(timeout=300)["state"] == "completed"
    assert set(zip(again.metrics["rank"], again.metrics["step"])) == {(0, 1), (0, 2), (1, 1), (1, 2)}


def test_progress_eta_formatting():
    from workbench.ui.progress import estimate_eta, format_eta

    assert format_eta(None) == "?" and format_eta(65) == "1:05" and format_eta(3723) == "1:02:03"
    # The median ignores the slow first step: 8 steps left at 0.5 s each.
    assert estimate_eta([9.0, 0.5, 0.5, 0.6, 0.4], steps_done=2, total_steps=10) == 4.0
    assert estimate_eta([], 2, 10) is None and estimate_eta([1.0], 2, None) is None
