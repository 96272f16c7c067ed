"""Model, checkpoint and export folders: nothing is read from outside a folder, an export folder holds one
kind, a failed save leaves nothing half-written, and a mis-shaped tensor is one error that names it."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from generic_families import tiny_config
from safetensors.torch import load_file, save_file
from test_lora import _config, randomize_adapters

import workbench
from workbench import AutoModelForCausalLM
from workbench.config import ConfigError, LoraConfig, ModelConfig, RunConfig, preset_config
from workbench.errors import CheckpointError
from workbench.models.hf_io import checkpoint_key_files
from workbench.models.lora_export import save_lora_adapter, save_merged
from workbench.models.sliced_load import plan_rank_read

# The checkout whose workbench this process imported (a subprocess runs the same one).
ROOT = Path(workbench.__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"


def _save(config, path: Path, **kw) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path, **kw)
    return path


def _sharded(tmp_path, config=None) -> Path:
    """A tiny Qwen3-MoE checkpoint in several shards with an index."""
    path = _save(config or tiny_config("qwen3_moe"), tmp_path / "model", max_shard_size="40KB")
    assert (path / INDEX).is_file()
    return path


def _move_a_shard_out(path: Path, outside: Path, name_in_index) -> str:
    """Move one shard to `outside` and make the index name it as `name_in_index(outside, shard)`."""
    index = json.loads((path / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    outside.mkdir(exist_ok=True)
    shutil.move(path / shard, outside / shard)
    named = name_in_index(outside, shard)
    index["weight_map"] = {k: (named if f == shard else f) for k, f in index["weight_map"].items()}
    (path / INDEX).write_text(json.dumps(index))
    return named


NAMES_OUTSIDE = {
    "absolute": lambda outside, shard: str(outside / shard),
    "dotdot": lambda outside, shard: f"../{outside.name}/{shard}",
}


# ------------------------------------------------------------------ every file a folder names stays inside


@pytest.mark.parametrize("how", sorted(NAMES_OUTSIDE))
def test_an_index_naming_a_shard_outside_the_folder_is_refused(how, tmp_path):
    path = _sharded(tmp_path)
    named = _move_a_shard_out(path, tmp_path / "outside", NAMES_OUTSIDE[how])
    with pytest.raises(CheckpointError, match="outside") as info:
        checkpoint_key_files(path)
    assert named in str(info.value) and str(path) in str(info.value)


def test_a_shard_that_is_a_link_out_of_the_folder_is_refused(tmp_path):
    path = _sharded(tmp_path)
    shard = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))[0]
    (tmp_path / "elsewhere").mkdir()
    shutil.move(path / shard, tmp_path / "elsewhere" / shard)
    (path / shard).symlink_to(tmp_path / "elsewhere" / shard)
    with pytest.raises(CheckpointError, match="link") as info:
        checkpoint_key_files(path)
    assert str(tmp_path / "elsewhere") in str(info.value)


def test_a_hub_cache_snapshot_linking_into_its_blobs_still_loads(tmp_path):
    """The Hub cache keeps snapshots/<rev>/<file> as links into the same repository's blobs/: allowed."""
    saved = _save(tiny_config("qwen3_moe"), tmp_path / "saved")
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, file in enumerate(sorted(saved.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    assert set(checkpoint_key_files(snapshot)) == set(load_file(saved / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(snapshot, device="cpu")
    want = transformers.AutoModelForCausalLM.from_pretrained(saved).state_dict()
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], want["model.embed_tokens.weight"])


def test_the_sliced_reader_refuses_a_shard_outside_before_reading_anything(tmp_path):
    """The mesh's reader plans from the index: a name outside the folder is refused at the plan."""
    path = _sharded(tmp_path, tiny_config("mixtral"))
    _move_a_shard_out(path, tmp_path / "outside", NAMES_OUTSIDE["dotdot"])
    model = AutoModelForCausalLM.from_config(tiny_config("mixtral"), device="cpu")
    with pytest.raises(CheckpointError, match="points outside"):
        plan_rank_read(model, path, (0, 4))


def test_from_pretrained_on_one_rank_refuses_a_linked_out_weights_file(tmp_path):
    path = _save(tiny_config("qwen3_moe"), tmp_path / "model")
    (tmp_path / "elsewhere").mkdir()
    shutil.move(path / "model.safetensors", tmp_path / "elsewhere" / "model.safetensors")
    (path / "model.safetensors").symlink_to(tmp_path / "elsewhere" / "model.safetensors")
    with pytest.raises(CheckpointError, match="outside"):
        AutoModelForCausalLM.from_pretrained(path, device="cpu")


def test_model_path_with_an_index_naming_outside_is_a_config_error(tmp_path):
    path = _sharded(tmp_path)
    _move_a_shard_out(path, tmp_path / "outside", NAMES_OUTSIDE["absolute"])
    with pytest.raises(ConfigError, match="outside"):
        ModelConfig(preset=None, path=str(path)).hf_config()


@pytest.mark.slow
def test_finetune_on_a_mesh_refuses_a_shard_outside_with_exit_2_before_any_rank(tmp_path):
    path = _save(preset_config("tiny"), tmp_path / "model", max_shard_size="200KB")
    assert (path / INDEX).is_file()
    _move_a_shard_out(path, tmp_path / "outside", NAMES_OUTSIDE["dotdot"])
    cfg = tmp_path / "cfg.yaml"
    RunConfig.demo(
        model=ModelConfig(preset=None, path=str(path)),
        data__seq_len=64,
        train__steps=1,
        train__global_batch_size=4,
        train__local_batch_size=2,
    ).to_yaml(cfg)
    env = {**os.environ, "WORKBENCH_RUNS_DIR": str(tmp_path / "runs"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    args = ["finetune", str(cfg), "--nproc-per-node", "2", "--set", "mesh.dp=2", "--set", "mesh.ep=2"]
    proc = subprocess.run(
        [sys.executable, "-m", "workbench.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "outside" in lines[0] and str(path) in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_resume_refuses_a_checkpoint_file_that_links_out(tmp_path):
    """Same size and hash as the manifest says, but a link to a copy outside: not read."""
    from workbench.train.manifest import verify_manifest, write_manifest

    ckpt = tmp_path / "step-00000002"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text('{"step": 2}')
    (ckpt / "__0_0.distcp").write_bytes(b"\x01" * 64)
    write_manifest(ckpt)
    verify_manifest(ckpt)  # as saved: accepted
    outside = tmp_path / "outside.distcp"
    shutil.copy(ckpt / "__0_0.distcp", outside)
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"cannot resume from .*outside"):
        verify_manifest(ckpt)


# ------------------------------------------------------------------ an export folder holds one kind


def _lora_model(tmp_path):
    cfg = _config("qwen3_moe")
    _save(cfg, tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", device="cpu", lora=LoraConfig(rank=4, alpha=6, targets=("attention", "experts"))
    )
    randomize_adapters(model)
    return model.eval()


def test_an_adapter_is_refused_in_a_folder_holding_the_merged_model(tmp_path):
    model = _lora_model(tmp_path)
    out = tmp_path / "export"
    save_merged(model, out)
    with pytest.raises(ValueError, match="another folder") as info:
        save_lora_adapter(model, out)
    assert str(out) in str(info.value) and "config.json" in str(info.value)
    assert not (out / "adapter_config.json").exists()
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    with torch.no_grad():  # vanilla from_pretrained still gives the merged model, the update applied once
        torch.testing.assert_close(
            transformers.AutoModelForCausalLM.from_pretrained(out)(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5
        )


def test_the_merged_model_is_refused_in_a_folder_holding_an_adapter(tmp_path):
    model = _lora_model(tmp_path)
    out = tmp_path / "export"
    save_lora_adapter(model, out)
    with pytest.raises(ValueError, match="another folder") as info:
        save_merged(model, out)
    assert str(out) in str(info.value) and "adapter_config.json" in str(info.value)
    assert not (out / "config.json").exists()


# ------------------------------------------------------------------ clear messages


def test_an_adapter_to_a_file_path_says_it_is_a_file(tmp_path):
    model = _lora_model(tmp_path)
    target = tmp_path / "adapter.safetensors"
    target.write_text("mine")
    with pytest.raises(ValueError, match="is a file, not a folder") as info:
        save_lora_adapter(model, target)
    assert str(target) in str(info.value)
    assert target.read_text() == "mine"


def _disk_fills_at_the_weights(monkeypatch):
    """The weights' write stops as a full disk stops it: part of the file written, then ENOSPC."""

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)


def test_save_merged_on_a_full_disk_leaves_nothing_and_says_so(tmp_path, monkeypatch):
    model = _lora_model(tmp_path)
    out = tmp_path / "merged"
    _disk_fills_at_the_weights(monkeypatch)
    with pytest.raises(OSError, match="disk is full") as info:
        save_merged(model, out)
    assert info.value.errno == errno.ENOSPC and str(out) in str(info.value)
    assert not out.exists()  # no config.json without its weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]  # and no temporary folder left


def test_a_full_disk_keeps_the_previous_export_whole(tmp_path, monkeypatch):
    model = _lora_model(tmp_path)
    out = tmp_path / "merged"
    save_merged(model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _disk_fills_at_the_weights(monkeypatch)
    with pytest.raises(OSError, match="disk is full"):
        save_merged(model, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_killed_saves_leftover_folder_is_removed_by_the_next_save(tmp_path):
    """A save killed before its rename leaves `.tmp-<name>-<pid>`; the next save to that folder removes it, and keeps
    the folder of a writer that is still alive."""
    model = _lora_model(tmp_path)
    out = tmp_path / "merged"
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dead = tmp_path / f".tmp-merged-{ended.pid}"
    live = tmp_path / f".tmp-merged-{os.getppid()}"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 64)
    save_merged(model, out)
    assert not dead.exists() and live.exists()
    assert (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["base", "merged", live.name])


def _mis_shape(path: Path, key: str) -> tuple[int, ...]:
    state = load_file(path / "model.safetensors")
    want = tuple(state[key].shape)
    state[key] = state[key][..., :-1].contiguous()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return want


def test_a_mis_shaped_expert_on_one_rank_is_one_error_naming_tensor_file_and_shapes(tmp_path, capfd):
    path = _save(tiny_config("qwen3_moe"), tmp_path / "model")
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    want = _mis_shape(path, key)
    capfd.readouterr()
    with pytest.raises(CheckpointError) as info:
        AutoModelForCausalLM.from_pretrained(path, device="cpu")
    message = str(info.value)
    got = (want[0], want[1] - 1)
    for part in (key, str(path / "model.safetensors"), str(got), str(want)):
        assert part in message, (part, message)
    assert "LOAD REPORT" not in "".join(capfd.readouterr())  # refused before Transformers reads the weights


def test_the_sliced_reader_refuses_every_expert_mis_shaped_alike_at_the_plan(tmp_path):
    """All experts equally mis-shaped (so they agree with each other): refused from the headers, naming the file."""
    path = _save(tiny_config("mixtral"), tmp_path / "model")
    state = load_file(path / "model.safetensors")
    keys = [k for k in state if ".block_sparse_moe.experts." in k and k.endswith(".w3.weight")]
    want = tuple(state[keys[0]].shape)
    for k in keys:
        state[k] = state[k][:-1].contiguous()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_config(tiny_config("mixtral"), device="cpu")
    with pytest.raises(CheckpointError) as info:
        plan_rank_read(model, path, (0, 4))
    message = str(info.value)
    assert any(k in message for k in keys) and "model.safetensors" in message
    assert str((want[0] - 1, want[1])) in message and str(want) in message
