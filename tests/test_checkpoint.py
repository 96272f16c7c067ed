"""DCP checkpoints: exact resume, atomic saves under an injected failure, refusing another shape."""

import os

import pytest
from launch_utils import run_ranks
from save_faults import fail_save_at

from workbench.config import RunConfig
from workbench.train import finetune
from workbench.train.checkpoint import CheckpointError, list_checkpoints, resolve_checkpoint


def _rc(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "runs"),
        data__seq_len=64,
        train__steps=5,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__warmup_steps=1,
    )
    base.update(overrides)
    return RunConfig.demo(**base)


@pytest.mark.slow
def test_resume_at_step_3_reproduces_steps_4_and_5_exactly(tmp_path):
    full = finetune(_rc(tmp_path, run_id="full", train__checkpoint_every=3))
    ckpts = list_checkpoints(tmp_path / "runs" / "full" / "checkpoints")
    assert [c.name for c in ckpts] == ["step-00000003", "step-00000005"]
    resumed = finetune(_rc(tmp_path, run_id="resumed", train__resume_from=str(ckpts[0])))
    assert resumed["losses"] == full["losses"][3:]  # bit-for-bit: model, Adam moments, lr, data position
    assert resumed["step"] == 5


def test_resume_from_a_run_directory_uses_its_latest_checkpoint(tmp_path):
    finetune(_rc(tmp_path, run_id="a", train__steps=2))
    assert resolve_checkpoint(tmp_path / "runs" / "a").name == "step-00000002"
    out = finetune(
        _rc(
            tmp_path,
            run_id="b",
            train__steps=3,
            train__resume_from=str(tmp_path / "runs" / "a"),
            train__resume_allow_changes=["train.steps"],
        )
    )
    assert len(out["losses"]) == 1 and out["step"] == 3


@pytest.mark.slow
def test_failure_mid_save_leaves_previous_checkpoint_loadable(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        fail_save_at(patch, step=4, fault="error")
        with pytest.raises(RuntimeError, match="failing on purpose"):
            finetune(_rc(tmp_path, run_id="crash", train__steps=6, train__checkpoint_every=2))
    root = tmp_path / "runs" / "crash" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step-00000004", "step-00000002"]
    assert resolve_checkpoint(tmp_path / "runs" / "crash").name == "step-00000002"
    # The interrupted save is ignored; resuming from the run continues from step 2 and can save 4.
    reference = finetune(_rc(tmp_path, run_id="ref", train__steps=6, train__checkpoint_every=2))
    out = finetune(
        _rc(
            tmp_path,
            run_id="again",
            train__steps=6,
            train__checkpoint_every=2,
            train__resume_from=str(tmp_path / "runs" / "crash"),
        )
    )
    assert out["losses"] == reference["losses"][2:]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]  # the unfinished save is gone
    assert [p.name for p in list_checkpoints(tmp_path / "runs" / "again" / "checkpoints")] == [
        "step-00000004",
        "step-00000006",
    ]


def test_resume_from_another_model_shape_is_refused_before_training(tmp_path):
    finetune(_rc(tmp_path, run_id="two", train__steps=1))
    runs_before = sorted(os.listdir(tmp_path / "runs"))
    ckpt_files = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs" / "two").rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError) as info:
        finetune(_rc(tmp_path, run_id="three", model__layers=3, train__resume_from=str(tmp_path / "runs" / "two")))
    assert "num_hidden_layers: checkpoint 2 vs this run 3" in str(info.value)
    assert sorted(os.listdir(tmp_path / "runs")) == runs_before  # no run directory was created
    assert {p: p.stat().st_mtime_ns for p in ckpt_files} == ckpt_files  # nothing touched


def test_resume_from_a_path_without_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        finetune(_rc(tmp_path, train__resume_from=str(tmp_path)))


def test_one_checkpoint_error_for_loading_weights_and_resuming(tmp_path):
    import workbench
    from workbench.models.hf_io import checkpoint_key_files

    # `except workbench.CheckpointError` catches a refused resume and a refused from_pretrained alike.
    with pytest.raises(workbench.CheckpointError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(workbench.CheckpointError, match=r"no model\.safetensors"):
        checkpoint_key_files(tmp_path)


def test_no_environment_variable_breaks_a_save(tmp_path, monkeypatch):
    # The fault injection of the tests is theirs (tests/save_faults.py): the product reads no such variable.
    monkeypatch.setenv("WORKBENCH_FAULT_INJECT", "checkpoint_mid_save")
    finetune(_rc(tmp_path, run_id="plain", train__steps=1, train__checkpoint_every=1))
    assert [c.name for c in list_checkpoints(tmp_path / "runs" / "plain" / "checkpoints")] == ["step-00000001"]


# -- two gloo ranks -----------------------------------------------------------------------------


def _two_rank_losses(rank, world, configs):
    return [finetune(RunConfig.from_dict(c))["losses"] for c in configs]


@pytest.mark.slow
def test_two_rank_resume_reproduces_steps_4_and_5(tmp_path):
    full = _rc(tmp_path, run_id="full2", train__checkpoint_every=3)
    resumed = _rc(
        tmp_path,
        run_id="resumed2",
        train__resume_from=str(tmp_path / "runs" / "full2" / "checkpoints" / "step-00000003"),
    )
    r0, r1 = run_ranks(_two_rank_losses, 2, [full.to_dict(), resumed.to_dict()])
    assert r0 == r1  # every rank reports the global loss
    (full_losses, resumed_losses) = r0
    assert len(full_losses) == 5 and resumed_losses == full_losses[3:]
