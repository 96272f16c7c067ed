"""Resume and LoRA settings that used to pass silently or fail late: each is refused up front with a fix that
works when followed, and a resume never touches the files of a run that is still alive."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from workbench import AutoModelForCausalLM
from workbench.config import ConfigError, LoraConfig, RunConfig, preset_config
from workbench.config_io import load_yaml
from workbench.runs.run_dir import RunDir
from workbench.train import finetune
from workbench.train.checkpoint import CheckpointError


def _rc(tmp_path, run_id: str, lora_rank: int | None = 4, **kw) -> RunConfig:
    """A 2-step tiny run (LoRA rank 4 unless lora_rank is None) writing under tmp_path/runs."""
    base = dict(
        output_dir=str(tmp_path / "runs"),
        run_id=run_id,
        data__seq_len=64,
        train__steps=2,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__warmup_steps=1,
        train__lr=1e-2,
    )
    base.update(kw)
    rc = RunConfig.demo(**base)
    return rc if lora_rank is None else rc.with_overrides({"lora.rank": lora_rank})


def _no_run_dir(tmp_path, run_id: str) -> bool:
    return not (tmp_path / "runs" / run_id).exists()


# -- a LoRA rank wider than the layers it adapts ---------------------------------------------------------


def test_lora_rank_wider_than_a_layer_is_refused_before_any_work_naming_the_largest(tmp_path):
    # The tiny preset: hidden 64, k_proj 64 -> 32, experts' down_proj 32 -> 64: the largest useful rank is 32.
    # Experts only: their down_proj bounds it; the check guards the model API as well as the trainer.
    with pytest.raises(ConfigError, match=r"mlp\.experts\.down_proj has a 64 x 32 weight.* is 32"):
        AutoModelForCausalLM.from_config(preset_config("tiny"), lora=LoraConfig(rank=33, targets=("experts",)))
    with pytest.raises(ConfigError, match=r"the largest allowed rank .* is 32: set lora.rank to 32 or less") as info:
        finetune(_rc(tmp_path, "wide", lora_rank=100_000))
    assert _no_run_dir(tmp_path, "wide")
    assert "model.layers.0." in str(info.value)  # names the layer that limits it
    # following the advice trains
    largest = int(re.search(r"set lora.rank to (\d+) or less", str(info.value)).group(1))
    assert finetune(_rc(tmp_path, "largest", lora_rank=largest, train__steps=1))["state"] == "completed"


# -- the fixes a refusal suggests, followed ----------------------------------------------------------------


def _sets(text: str) -> dict:
    """The overrides of every `--set key=value` in `text`, read as the CLI reads them (YAML values)."""
    out = {}
    for quoted, plain in re.findall(r"--set (?:'([^']*)'|(\S+))", text):
        key, value = (quoted or plain.rstrip(",;)")).split("=", 1)
        out[key] = load_yaml(value)
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A finished 2-step LoRA run (tiny preset, rank 4, seed 0) and a finished full fine-tune, trained once."""
    root = tmp_path_factory.mktemp("saved")
    finetune(_rc(root, "lora"))
    finetune(_rc(root, "full", lora_rank=None))
    return root / "runs"


def _refused(tmp_path, rc: RunConfig, match: str) -> str:
    with pytest.raises(CheckpointError, match=match) as info:
        finetune(rc)
    assert _no_run_dir(tmp_path, rc.run_id)  # refused before the model was built or a run directory made
    return str(info.value)


@pytest.mark.parametrize(
    "change, needle",
    [({"lora.rank": 8}, "lora.rank: checkpoint 4 vs this run 8"), ({"lora.targets": ["attention"]}, "lora.targets")],
    ids=["rank", "targets"],
)
def test_adapter_shapes_cannot_change_on_resume_and_the_fix_offered_works(tmp_path, lora_run, change, needle):
    key = next(iter(change))
    # Accepting the change is refused where the config is read: the tensors could not be loaded.
    with pytest.raises(ConfigError, match=rf"{key} cannot change on resume"):
        _rc(tmp_path, "x", train__resume_allow_changes=[key])
    rc = _rc(tmp_path, "changed", train__resume_from=str(lora_run / "lora")).with_overrides(change)
    message = _refused(tmp_path, rc, "cannot change on resume")
    assert needle in message and "resume_allow_changes" not in message  # no false way out
    fixed = rc.with_overrides(_sets(message.split(", or start a new run")[0]))
    assert fixed.lora.to_dict() == _rc(tmp_path, "x").lora.to_dict()
    assert finetune(fixed)["state"] == "completed"


def test_turning_lora_off_on_resume_is_refused_and_both_fixes_offered_work(tmp_path, lora_run):
    rc = _rc(tmp_path, "off", lora_rank=None, train__resume_from=str(lora_run / "lora"))
    message = _refused(tmp_path, rc, "LoRA cannot be turned off on resume")
    resume_part, export_part = message.split("; to fine-tune every weight from there")
    # 1: resume with the checkpoint's lora section
    assert finetune(rc.with_overrides(_sets(resume_part)))["state"] == "completed"
    # 2: that resume writes the merged model, and a full fine-tune starts from it
    exported = finetune(
        rc.with_overrides({**_sets(resume_part), **_sets(export_part.split(" to that resume")[0])}).replace(
            run_id="export"
        )
    )
    new_run = {
        k: v.replace("<its run>", exported["run_dir"]) if isinstance(v, str) else v
        for k, v in _sets(export_part.split("start a new run with")[1]).items()
    }
    out = finetune(_rc(tmp_path, "full-from-lora", lora_rank=None).with_overrides(new_run))
    assert out["state"] == "completed" and out["step"] == 2


def test_turning_lora_on_on_resume_is_refused_and_both_fixes_offered_work(tmp_path, lora_run):
    rc = _rc(tmp_path, "on", train__resume_from=str(lora_run / "full"))
    message = _refused(tmp_path, rc, "LoRA cannot be turned on on resume")
    resume_part, export_part = message.split("; to train adapters on top of it")
    assert finetune(rc.with_overrides(_sets(resume_part)))["state"] == "completed"
    without_lora = rc.with_overrides(_sets(resume_part))
    exported = finetune(
        without_lora.with_overrides(_sets(export_part.split(" to that resume")[0])).replace(run_id="export")
    )
    new_run = {
        k: v.replace("<its run>", exported["run_dir"]) if isinstance(v, str) else v
        for k, v in _sets(export_part.split("start a new LoRA run with")[1]).items()
    }
    out = finetune(_rc(tmp_path, "lora-from-full").with_overrides(new_run))
    assert out["state"] == "completed" and out["step"] == 2


def test_changed_seed_is_refused_up_front_and_each_fix_offered_works(tmp_path, lora_run):
    # A full fine-tune: the seed orders the data (the weights come from the checkpoint).
    rc = _rc(tmp_path, "seed", lora_rank=None, train__seed=1, train__steps=3, train__resume_from=str(lora_run / "full"))
    message = _refused(tmp_path, rc, r"train.seed: checkpoint 0 vs this run 1")
    keep, accept = message.split(", or accept")
    assert finetune(rc.with_overrides(_sets(keep)))["state"] == "completed"
    out = finetune(rc.with_overrides(_sets(accept)).replace(run_id="seed-accepted"))
    assert out["state"] == "completed" and out["step"] == 3 and len(out["losses"]) == 1
    # the data continues at the saved position, in the new seed's order
    state = json.loads((Path(out["checkpoint"]) / "trainer_state.json").read_text())
    assert state["data"] == {"consumed": 12, "seed": 1}


def test_changed_seed_of_a_lora_preset_base_is_refused_with_the_fix_that_works(tmp_path, lora_run):
    # The preset's base weights are drawn from train.seed: another seed is another base, never an accepted change.
    rc = _rc(tmp_path, "seed", train__seed=1, train__resume_from=str(lora_run / "lora"))
    message = _refused(tmp_path, rc, r"trained on preset 'tiny' built with train.seed 0, .* train.seed 1")
    assert "resume_allow_changes" not in message
    assert finetune(rc.with_overrides(_sets(message.split(", or train new adapters")[0])))["state"] == "completed"


# -- a LoRA checkpoint resumed on another base -------------------------------------------------------------


def _tiny_folder(path: Path, seed: int) -> Path:
    """A saved tiny preset model (the preset's shapes) with weights drawn from `seed`."""
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(preset_config("tiny")).save_pretrained(path)
    return path


def _on_path(rc: RunConfig, path: Path) -> RunConfig:
    return rc.with_overrides({"model.preset": None, "model.path": str(path)})


def test_lora_resume_on_a_folder_instead_of_its_preset_is_refused_naming_both(tmp_path, lora_run):
    folder = _tiny_folder(tmp_path / "base", seed=3)  # the same shapes: every other check passes
    rc = _on_path(_rc(tmp_path, "other", train__resume_from=str(lora_run / "lora")), folder)
    message = _refused(tmp_path, rc, r"trained on preset 'tiny' built with train.seed 0, and this run builds")
    assert f"model.path {folder}" in message
    assert finetune(rc.with_overrides(_sets(message.split(", or train new adapters")[0])))["state"] == "completed"


def test_lora_resume_on_other_weights_of_the_same_shape_is_refused_and_a_moved_base_is_not(tmp_path):
    base, other = _tiny_folder(tmp_path / "base", seed=3), _tiny_folder(tmp_path / "other", seed=4)
    trained = finetune(_on_path(_rc(tmp_path, "a"), base))
    ckpt = trained["checkpoint"]
    # another folder, other weights
    rc = _on_path(_rc(tmp_path, "b", train__resume_from=ckpt), other)
    message = _refused(tmp_path, rc, rf"trained on the base weights of {base}, and this run's model.path {other}")
    assert finetune(rc.with_overrides(_sets(message.split(", or train new adapters")[0])))["state"] == "completed"
    # the same files in another folder: the same base
    moved = tmp_path / "moved"
    shutil.copytree(base, moved)
    assert finetune(_on_path(_rc(tmp_path, "c", train__resume_from=ckpt), moved))["state"] == "completed"
    # the folder's weights replaced in place
    shutil.copy(other / "model.safetensors", base / "model.safetensors")
    _refused(
        tmp_path, _on_path(_rc(tmp_path, "d", train__resume_from=ckpt), base), rf"the weight files in {base} changed"
    )


# -- resuming from a run that is still alive ---------------------------------------------------------------


_OWNER = """
import sys, time
from workbench.runs.run_dir import RunDir
RunDir.open(sys.argv[1]).write_status("running", step=2, total_steps=9)
print("running", flush=True)
time.sleep(120)
"""


def test_resume_from_a_live_run_never_touches_it(tmp_path, lora_run):
    # Run A's folder, then A "alive": another process records itself as its owner, as a training rank 0 does,
    # and A is writing its next save.
    run_a = tmp_path / "a"
    shutil.copytree(lora_run / "full", run_a)
    saving = run_a / "checkpoints" / ".tmp-step-00000003"
    saving.mkdir()
    (saving / "__0_0.distcp").write_bytes(b"half of a shard")
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(run_a)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "running"
        assert RunDir.open(run_a).read_checked_status()["state"] == "running"
        rc = _rc(tmp_path, "b", lora_rank=None, train__steps=3, train__resume_allow_changes=["train.steps"])
        message = _refused(tmp_path, rc.with_overrides({"train.resume_from": str(run_a)}), "is still running")
        assert (
            f"pid {owner.pid}" in message and "step 2 of 9" in message and "Wait for it to end, or stop it" in message
        )
        assert saving.is_dir() and (saving / "__0_0.distcp").read_bytes() == b"half of a shard"
        # Its finished checkpoint, named, branches from it without touching the save in progress.
        finished = re.search(r"pass that folder, e\.g\. (\S+)$", message).group(1)
        out = finetune(rc.with_overrides({"train.resume_from": finished}))
        assert out["state"] == "completed" and out["step"] == 3
        assert saving.is_dir() and (saving / "__0_0.distcp").read_bytes() == b"half of a shard"
        assert RunDir.open(run_a).read_checked_status()["state"] == "running"
    finally:
        owner.kill()
        owner.wait()
    # Once its owner is gone the run reads "died": resuming from it is allowed and clears the unfinished save.
    assert RunDir.open(run_a).read_checked_status()["state"] == "died"
    out = finetune(rc.with_overrides({"train.resume_from": str(run_a), "run_id": "c"}))
    assert out["state"] == "completed" and not saving.exists()
