"""Resume refuses damaged, crafted or mismatched checkpoints before any run directory, and runs no code."""

import os
import pickle
import shutil

import pytest
import torch

from workbench.config import ConfigError, RunConfig, TrainConfig
from workbench.runs.run_dir import RunDir
from workbench.train import finetune
from workbench.train.checkpoint import CheckpointError, list_checkpoints, resolve_checkpoint
from workbench.train.loop import Trainer
from workbench.train.manifest import write_manifest
from workbench.train.safe_load import read_dcp_metadata


def _rc(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path / "runs"),
        data__seq_len=64,
        train__steps=2,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__warmup_steps=1,
    )
    base.update(overrides)
    return RunConfig.demo(**base)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A finished 2-step run with its step-2 checkpoint (trained once for the module)."""
    root = tmp_path_factory.mktemp("saved")
    finetune(_rc(root, run_id="src"))
    return root / "runs" / "src"


@pytest.fixture
def ckpt(saved_run, tmp_path):
    """A private copy of the saved run's checkpoint; tmp_path/runs is where a resume would write."""
    run = tmp_path / "src"
    shutil.copytree(saved_run, run)
    (tmp_path / "runs").mkdir()
    return run / "checkpoints" / "step-00000002"


def _refused(tmp_path, ckpt, match, **overrides) -> str:
    with pytest.raises(CheckpointError, match=match) as info:
        finetune(_rc(tmp_path, run_id="resumed", train__resume_from=str(ckpt), **overrides))
    assert os.listdir(tmp_path / "runs") == []  # refused before any run directory was made
    return str(info.value)


# -- A4: the manifest -------------------------------------------------------------------------------


def test_same_size_overwrite_of_a_shard_is_refused_naming_it(tmp_path, ckpt):
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _refused(tmp_path, ckpt, r"__0_0.distcp: contents differ from the manifest \(same size")


@pytest.mark.parametrize("name", ["__0_0.distcp", "trainer_state.json", ".metadata", "rng/rank-00000.pt"])
def test_truncated_file_is_refused_naming_it(tmp_path, ckpt, name):
    path = ckpt / name
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    _refused(tmp_path, ckpt, rf"{name}: {size // 2} bytes, the manifest says {size} \(truncated")


def test_meta_json_that_is_not_json_is_refused_naming_it(tmp_path, ckpt):
    (ckpt / "meta.json").write_text("{not json", encoding="utf-8")
    _refused(tmp_path, ckpt, r"meta.json: .*the manifest")
    write_manifest(ckpt)  # the same damage with a manifest that agrees: still named
    _refused(tmp_path, ckpt, r"meta.json is not valid JSON")


def test_checkpoint_without_manifest_is_refused(tmp_path, ckpt):
    (ckpt / "manifest.json").unlink()
    _refused(tmp_path, ckpt, r"has no manifest.json")


# -- B1: nothing in a checkpoint runs code ------------------------------------------------------------


class _RunsCode:
    """Unpickling this runs a shell command (what a crafted checkpoint file would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_rng_file_does_not_run(tmp_path, ckpt):
    marker = tmp_path / "ran"
    torch.save({"torch": torch.get_rng_state(), "python": _RunsCode(marker)}, ckpt / "rng" / "rank-00000.pt")
    write_manifest(ckpt)  # an attacker rewrites the manifest too
    _refused(tmp_path, ckpt, r"rng/rank-00000.pt holds more than tensors and plain values, refused")
    assert not marker.exists()


def test_crafted_trainer_state_pt_of_the_old_format_does_not_run(tmp_path, ckpt):
    marker = tmp_path / "ran"
    (ckpt / "trainer_state.json").unlink(missing_ok=True)  # (checkpoints before the JSON format had none)
    torch.save({"step": 2, "x": _RunsCode(marker)}, ckpt / "trainer_state.pt")
    write_manifest(ckpt)
    _refused(tmp_path, ckpt, r"trainer_state.json is missing")
    assert not marker.exists()


def test_crafted_dcp_metadata_does_not_run(tmp_path, ckpt):
    marker = tmp_path / "ran"
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    write_manifest(ckpt)
    _refused(tmp_path, ckpt, r"\.metadata is not DCP metadata, refused without loading it .*posix.system")
    assert not marker.exists()


def test_crafted_value_inside_a_shard_does_not_run(tmp_path, ckpt):
    # DCP keeps non-tensor values (optimizer hyper-parameters) as pickles inside the .distcp files.
    marker = tmp_path / "ran"
    metadata = read_dcp_metadata(ckpt)
    shard = ckpt / "__0_0.distcp"
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        torch.save(_RunsCode(marker), f)
    ((_, info),) = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == "optim.param_groups.0.lr"]
    info.offset, info.length = offset, shard.stat().st_size - offset
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    write_manifest(ckpt)
    _refused(tmp_path, ckpt, r"the value optim.param_groups.0.lr in .*__0_0.distcp is not a plain value")
    assert not marker.exists()


# -- A5: the schedule and the data position -------------------------------------------------------------


def test_resume_with_other_steps_and_seq_len_is_refused_listing_each(tmp_path, ckpt):
    message = _refused(
        tmp_path, ckpt, "this run changes settings the checkpoint was saved with", train__steps=4, data__seq_len=96
    )
    assert "train.steps: checkpoint 2 vs this run 4" in message
    assert "data.seq_len: checkpoint 64 vs this run 96" in message
    assert "train.resume_allow_changes: [data.seq_len, train.steps]" in message


@pytest.mark.slow
def test_accepted_change_of_steps_continues_on_the_new_schedule(tmp_path, ckpt):
    out = finetune(
        _rc(
            tmp_path,
            run_id="longer",
            train__steps=4,
            train__resume_from=str(ckpt),
            train__resume_allow_changes=["train.steps"],
        )
    )
    assert out["state"] == "completed" and out["step"] == 4 and len(out["losses"]) == 2
    fresh = finetune(_rc(tmp_path, run_id="fresh", train__steps=4))
    lr_resumed = [m["lr"] for m in RunDir.open(out["run_dir"]).read_metrics()]
    lr_fresh = [m["lr"] for m in RunDir.open(fresh["run_dir"]).read_metrics()]
    assert lr_resumed == lr_fresh[2:]  # steps 3 and 4 follow the 4-step cosine, not the saved 2-step one


def test_changed_weight_decay_is_refused_and_when_accepted_this_runs_value_is_used(tmp_path, ckpt):
    _refused(tmp_path, ckpt, r"train.weight_decay: checkpoint 0.0 vs this run 0.1", train__weight_decay=0.1)

    rc = _rc(
        tmp_path,
        run_id="wd",
        train__steps=3,
        train__weight_decay=0.1,
        train__resume_from=str(ckpt),
        train__resume_allow_changes=["train.weight_decay", "train.steps"],
    )
    trainer = Trainer(rc)
    trainer.setup()  # loads the checkpoint, whose optimizer state says weight_decay 0.0
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.1, 0.0]  # decay, no-decay groups


def test_resume_allow_changes_names_only_known_fields():
    with pytest.raises(ConfigError, match=r"train.resume_allow_changes must be a list of names from \['train.steps'"):
        TrainConfig(resume_allow_changes=["train.stepz"])
    assert TrainConfig(resume_allow_changes=["data.seq_len"]).resume_allow_changes == ("data.seq_len",)


# -- C3: unfinished saves ---------------------------------------------------------------------------


def test_unfinished_saves_are_never_resumed_and_removed_at_the_next_start(tmp_path, ckpt):
    root = ckpt.parent
    newer = root / ".tmp-step-00000009"
    shutil.copytree(ckpt, newer)  # complete-looking, with meta.json and a valid manifest
    shutil.copytree(ckpt, root / ".old-step-00000002")
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002"]
    assert resolve_checkpoint(root.parent) == ckpt
    with pytest.raises(CheckpointError, match="a save that never finished"):
        resolve_checkpoint(newer)
    finetune(
        _rc(
            tmp_path,
            run_id="next",
            train__steps=3,
            train__resume_from=str(root.parent),
            train__resume_allow_changes=["train.steps"],
        )
    )
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]


# -- two gloo ranks: the check is collective (each rank hashes a share) and every rank refuses ----------


def _two_rank_resume(rank, world, config):
    try:
        finetune(RunConfig.from_dict(config))
    except CheckpointError as err:
        return str(err)
    return "resumed"


@pytest.mark.slow
def test_two_ranks_both_refuse_a_damaged_shard(tmp_path):
    from launch_utils import run_ranks

    saved = _rc(tmp_path, run_id="two", output_dir=str(tmp_path / "saved"))
    run_ranks(_two_rank_resume, 2, saved.to_dict())
    ckpt = tmp_path / "saved" / "two" / "checkpoints" / "step-00000002"
    shards = sorted(p.name for p in ckpt.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    shard = ckpt / shards[1]  # hashed by one rank only (sorted files, rank r takes every second)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    (tmp_path / "runs").mkdir()
    messages = run_ranks(_two_rank_resume, 2, _rc(tmp_path, train__resume_from=str(ckpt)).to_dict())
    assert messages[0] == messages[1] and "__1_0.distcp: contents differ from the manifest" in messages[0]
    assert os.listdir(tmp_path / "runs") == []
