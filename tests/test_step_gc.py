"""Python's collector paused over training steps (train.gc_every, workbench/train/step_gc.py)."""

from __future__ import annotations

import gc

import pytest

from workbench import RunConfig
from workbench.config_checks import ConfigError
from workbench.train.loop import finetune
from workbench.train.step_gc import StepGC


@pytest.fixture
def collections():
    """The generations of the collections that start while the collector is disabled (explicit ones only)."""
    seen: list[int] = []

    def note(phase, info):
        if phase == "start" and not gc.isenabled():
            seen.append(info["generation"])

    gc.callbacks.append(note)
    was = gc.isenabled()
    yield seen
    gc.callbacks.remove(note)
    gc.enable() if was else gc.disable()


def test_paused_inside_young_collection_on_every_nth_step_then_restored(collections):
    gc.enable()
    pause = StepGC(3)
    pause.after_step(3)  # not paused: no collection of its own
    assert collections == []
    with pause:
        assert not gc.isenabled() and pause.active
        for step in range(1, 8):
            pause.after_step(step)
        assert collections == [1, 1]  # after steps 3 and 6, generations 0-1 only
    assert gc.isenabled() and not pause.active


def test_a_disabled_collector_stays_disabled_and_zero_leaves_it_alone(collections):
    gc.disable()
    with StepGC(2):
        assert not gc.isenabled()
    assert not gc.isenabled()  # the user's choice comes back
    gc.enable()
    with StepGC(0) as pause:
        assert gc.isenabled() and not pause.active
        pause.after_step(10)
    assert gc.isenabled() and collections == []


def test_restored_after_an_error_and_nested():
    gc.enable()
    pause = StepGC(5)
    with pytest.raises(RuntimeError):
        with pause:
            with pause:  # the bench's round inside a fit-like caller: the outer state wins at the end
                assert not gc.isenabled()
            assert not gc.isenabled()
            raise RuntimeError("a step failed")
    assert gc.isenabled()


def test_fit_steps_with_the_collector_paused_and_gives_it_back(tmp_path, collections):
    gc.enable()
    states = []

    class Probe:
        def on_step(self, record):
            states.append(gc.isenabled())

    rc = RunConfig.demo(
        output_dir=str(tmp_path / "runs"),
        data__seq_len=64,
        train__steps=4,
        train__global_batch_size=2,
        train__local_batch_size=2,
        train__save_final_checkpoint=False,
        train__gc_every=2,
    )
    result = finetune(rc, callbacks=[Probe()])
    assert result["state"] == "completed" and len(states) == 4
    assert not any(states) and gc.isenabled()
    assert collections == [1, 1]  # after steps 2 and 4, and no full collection while paused


@pytest.mark.parametrize("bad", [-1, 1.5, True, "50"])
def test_bad_gc_every_is_refused(bad):
    with pytest.raises(ConfigError, match=r"train\.gc_every"):
        RunConfig.demo(train__gc_every=bad)
    with pytest.raises(ValueError, match="every must be an integer"):
        StepGC(bad)
