"""The run plan (workbench.plan) on CPU: its parts sum to its peak for every family and mesh, each setting moves the
part it should, the options fit when applied and come fastest first, the trainer refuses a run that cannot fit before
anything is built and applies train.fit auto's option on a tiny run, `workbench plan --json`, and a calibration
measured on this CPU is what the plan then divides by."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from workbench.bench.calibrate import calibrate, save_calibration
from workbench.cli import main
from workbench.config import RunConfig, TrainConfig
from workbench.config_checks import ConfigError
from workbench.params import param_counts
from workbench.plan import auto_option, plan_run
from workbench.plan.gpus import GIB
from workbench.plan.memory import PARTS
from workbench.train.fit_check import DoesNotFitError
from workbench.train.loop import finetune
from workbench.ui.logic import model_mesh_options
from workbench.ui.mesh_plan import chosen_plan_html, gib_text, mesh_plans, mesh_plans_html

TINY_PRESETS = (
    "tiny",
    "tiny-deepseek-v3",
    "tiny-gpt-oss",
    "tiny-mixtral",
    "tiny-nemotron-h",
    "tiny-olmoe",
    "tiny-qwen3-next",
    "tiny-qwen3.5-moe",
)
HYBRIDS = ("tiny-nemotron-h", "tiny-qwen3-next", "tiny-qwen3.5-moe", "nemotron-3-nano-30b-a3b", "qwen3.5-35b-a3b")


@pytest.fixture(autouse=True)
def no_calibration_of_this_machine(tmp_path, monkeypatch):
    """The plans here divide by the datasheet's figures, not by a calibration this machine may hold."""
    monkeypatch.setenv("WORKBENCH_CALIBRATION_DIR", str(tmp_path / "no-calibration"))


def run_config(preset: str, layers: int | None = None, seq: int = 4096, batch: int = 2, **sets) -> RunConfig:
    rc = RunConfig.from_dict(
        {
            "model": {"preset": preset, "layers": layers, "dtype": "bfloat16"},
            "data": {"kind": "synthetic", "seq_len": seq},
            "train": {"local_batch_size": batch, "global_batch_size": batch * 8},
            "backend": {"fused_ce": True},
        }
    )
    return rc.with_overrides(sets) if sets else rc


@pytest.mark.parametrize("preset", TINY_PRESETS)
@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_parts_sum_to_the_peak_for_every_family_and_mesh(preset, gpus):
    rc = run_config(preset, seq=256, batch=1)
    plan = plan_run(rc, gpus=gpus, gpu="h100", with_options=False)
    assert set(plan.parts) == set(PARTS)
    assert sum(plan.parts.values()) == pytest.approx(plan.peak_gib_per_rank, rel=1e-9)
    assert all(v >= 0 for v in plan.parts.values()), plan.parts
    assert sum(plan.time_parts.values()) == pytest.approx(plan.step_s, rel=1e-9)
    assert plan.step_s > 0 and plan.tokens_per_s_per_gpu > 0
    assert plan.dp == gpus and gpus % plan.ep == 0
    if preset in HYBRIDS:  # the hybrid's own sequence mixer is timed (Mamba2's scan, the gated delta rule)
        assert plan.time_parts["mixers"] > 0


@pytest.mark.parametrize("preset", ["nemotron-3-nano-30b-a3b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"])
def test_full_size_hybrids_plan_every_mesh(preset):
    rc = run_config(preset, layers=8)
    for gpus, ep in ((1, 1), (8, 1), (8, 8)):
        plan = plan_run(rc.with_overrides({"mesh.dp": gpus, "mesh.ep": ep}), gpu="h200", with_options=False)
        assert (plan.dp, plan.ep) == (gpus, ep)
        assert plan.time_parts["mixers"] > 0 and plan.parts["activations"] + plan.parts["gradients"] > 0


def test_each_setting_moves_its_part():
    base = run_config("qwen3-30b-a3b", layers=4)
    plan = plan_run(base, gpu="h100", with_options=False)
    counts = param_counts(base.model.hf_config())
    assert plan.parts["weights"] == pytest.approx(counts.total * 2 / GIB)
    assert plan.parts["optimizer_states"] == pytest.approx(counts.total * 4 / GIB)  # two bf16 moments
    ac = plan_run(base.with_overrides({"train.activation_checkpointing": True}), gpu="h100", with_options=False)
    assert ac.step_s > plan.step_s  # the recomputed forward
    eight = plan_run(base.with_overrides({"train.optimizer_states": "8bit"}), gpu="h100", with_options=False)
    assert eight.parts["optimizer_states"] == pytest.approx(counts.total * (2 + 8 / 64) / GIB)
    master = plan_run(base.with_overrides({"train.precision": "fp32_master"}), gpu="h100", with_options=False)
    assert master.parts["master_weights"] == pytest.approx(counts.total * 4 / GIB)
    logits = plan_run(base.with_overrides({"backend.fused_ce": False}), gpu="h100", with_options=False)
    tokens = 4096 * 2
    assert logits.parts["logits"] == pytest.approx(tokens * counts.vocab * (2 + 8) / GIB)
    assert plan.parts["logits"] == 0  # the fused cross-entropy keeps no full logits
    auto = plan_run(base.with_overrides({"backend.fused_ce": "auto"}), gpu="h100", with_options=False)
    assert auto.parts["logits"] == 0  # "auto" is what the model allows: Qwen3's logits are lm_head(hidden)
    lora = plan_run(base.with_overrides({"lora.rank": 16}), gpu="h100", with_options=False)
    assert lora.parts["optimizer_states"] == 0 and lora.parts["gradients"] == 0 and lora.parts["lora"] > 0
    graphs = plan_run(base.with_overrides({"lora.rank": 16, "train.cuda_graphs": True}), gpu="h100", with_options=False)
    assert graphs.parts["cuda_graph_pool"] == pytest.approx(lora.parts["activations"])
    assert graphs.time_parts["host_wait"] == 0
    two = plan_run(base.with_overrides({"mesh.dp": 2, "mesh.ep": 2}), gpu="h100", with_options=False)
    assert two.parts["weights"] == pytest.approx(plan.parts["weights"] / 2)
    assert two.parts["fsdp_gathers"] > 0 and two.time_parts["communication"] > 0


def test_partial_checkpointing_lies_between_none_and_all_and_is_offered_where_it_fits():
    base = run_config("qwen3-30b-a3b", layers=8)
    none, half, every = (
        plan_run(base.with_overrides(change), gpu="h100", with_options=False)
        for change in (
            {},
            {"train.activation_checkpointing": True, "train.activation_checkpointing_layers": 4},
            {"train.activation_checkpointing": True},
        )
    )
    assert every.parts["activations"] < half.parts["activations"] < none.parts["activations"]
    assert none.step_s < half.step_s < every.step_s  # half the layers recompute
    # The 48-layer LoRA of an 80 GB card (measured: out of memory eager, 62.7 GiB with every layer checkpointed):
    # checkpointing only some of the layers fits too, recomputes less, and is what train.fit auto takes.
    lora48 = run_config("qwen3-30b-a3b", batch=1, **{"lora.rank": 16, "train.global_batch_size": 1})
    plan = plan_run(lora48, gpu="h100")
    assert not plan.fits
    partial = [o for o in plan.options if o.change.get("train.activation_checkpointing_layers")]
    full = [o for o in plan.options if o.change == {"train.activation_checkpointing": True}]
    assert partial and full and all(o.fits for o in partial + full)
    assert max(o.tokens_per_s_per_gpu for o in partial) > full[0].tokens_per_s_per_gpu
    chosen = auto_option(plan.options, 1)
    assert chosen is not None and chosen.change.get("train.activation_checkpointing_layers"), chosen
    # eighths of the 48 layers; of the counts that fit alone only the fewest is listed, and an eighth fewer does not fit
    alone = [o for o in partial if len(o.change) == 2]
    assert len(alone) == 1 and all(o.change["train.activation_checkpointing_layers"] % 6 == 0 for o in partial)
    count = alone[0].change["train.activation_checkpointing_layers"]
    fewer = {"train.activation_checkpointing": True, "train.activation_checkpointing_layers": count - 6}
    assert count > 6 and not plan_run(lora48.with_overrides(fewer), gpu="h100", with_options=False).fits


def test_options_fit_when_applied_and_come_fastest_first():
    rc = run_config("qwen3-30b-a3b", seq=4096, batch=1, **{"lora.rank": 16, "train.global_batch_size": 1})
    plan = plan_run(rc, gpus=1, gpu="h100")
    assert not plan.fits and plan.peak_gib_per_rank > plan.usable_gib
    assert plan.options and all(o.fits for o in plan.options)
    speeds = [o.tokens_per_s_per_gpu for o in plan.options]
    assert speeds == sorted(speeds, reverse=True)
    assert {"train.activation_checkpointing": True} in [o.change for o in plan.options]
    for option in plan.options:
        again = plan_run(rc.with_overrides(option.change), gpus=option.gpus, gpu="h100", with_options=False)
        assert again.fits and again.peak_gib_per_rank == pytest.approx(option.peak_gib_per_rank)
    chosen = auto_option(plan.options, 1)
    assert chosen is not None and chosen.gpus == 1 and not chosen.changes_training
    assert "--set train.activation_checkpointing=true" in plan.refusal()


def test_a_run_that_cannot_fit_the_host_is_refused_before_anything_is_built(tmp_path):
    rc = RunConfig.from_dict(
        {
            "model": {"preset": "qwen3-next-80b-a3b"},  # float32 on a CPU: over a terabyte
            "data": {"kind": "synthetic", "seq_len": 512},
            "train": {"steps": 1, "local_batch_size": 1, "global_batch_size": 1},
            "output_dir": str(tmp_path / "runs"),
        }
    )
    start = time.perf_counter()
    with pytest.raises(DoesNotFitError, match="GiB available per rank") as refused:
        finetune(rc)
    assert isinstance(refused.value, ConfigError)  # exit code 2 on the command line
    assert time.perf_counter() - start < 30
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # no run folder


def _tiny(tmp_path: Path, **sets) -> RunConfig:
    rc = RunConfig.demo(data__kind="synthetic", train__steps=2, output_dir=str(tmp_path / "runs"))
    return rc.with_overrides(sets)


def test_fit_auto_applies_the_fastest_option_on_a_tiny_run(tmp_path, capsys):
    rc = _tiny(tmp_path)
    full = plan_run(rc, gpus=1, gpu="cpu", gpu_memory_gib=1e6).peak_gib_per_rank
    budget = full * 0.9
    expected = auto_option(plan_run(rc, gpus=1, gpu="cpu", gpu_memory_gib=budget).options, 1)
    assert expected is not None
    with pytest.raises(DoesNotFitError, match="--set"):  # train.fit check (the default) refuses it
        finetune(rc.with_overrides({"train.fit_memory_gib": budget}))
    result = finetune(rc.with_overrides({"train.fit": "auto", "train.fit_memory_gib": budget}))
    assert result["state"] == "completed"
    recorded = json.loads((Path(result["run_dir"]) / "config.json").read_text())
    for key, value in expected.change.items():
        section, name = key.split(".")
        assert recorded[section][name] == value, (key, recorded[section])
    assert expected.flags(1) in capsys.readouterr().err


def test_train_fit_settings_are_checked():
    with pytest.raises(ConfigError, match=r"train\.fit must be one of"):
        TrainConfig(fit="sometimes")
    with pytest.raises(ConfigError, match="fit_memory_gib"):
        TrainConfig(fit_memory_gib=0)


def test_cli_plan_prints_one_json_object(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    run_config("qwen3-30b-a3b", layers=48, batch=1, **{"lora.rank": 16, "train.global_batch_size": 1}).to_yaml(config)
    assert main(["plan", str(config), "--gpu", "h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"peak_gib_per_rank", "fits", "step_s", "tokens_per_s_per_gpu", "parts", "options"} <= set(out)
    assert out["fits"] is False and out["options"] and all(o["fits"] for o in out["options"])
    assert main(["plan", str(config), "--gpu", "h200", "--set", "train.activation_checkpointing=true", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True
    assert main(["plan", str(config), "--gpu", "v100"]) == 2
    assert "unknown gpu 'v100'" in capsys.readouterr().err


def test_a_calibration_measured_on_this_cpu_is_what_the_plan_uses(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CALIBRATION_DIR", str(tmp_path / "calibration"))
    rc = _tiny(tmp_path)
    assert plan_run(rc, gpus=1, gpu="cpu", with_options=False).throughputs == "datasheet cpu"
    assert main(["bench", "--calibrate"]) == 0
    path = tmp_path / "calibration" / "cpu.json"
    data = json.loads(path.read_text())
    assert data["kind"] == "cpu" and data["dense_tflops"] > 0 and len(data["grouped_tflops"]) == 3
    assert set(data["mixer_tflops"]) == {"mamba2", "gated_deltanet"}
    plan = plan_run(rc, gpus=1, gpu="cpu", with_options=False)
    assert plan.throughputs == f"calibration {path}"
    path.write_text("{not json")
    broken = plan_run(rc, gpus=1, gpu="cpu", with_options=False)
    assert broken.throughputs == "datasheet cpu" and "not used" in broken.notes[0]
    out = save_calibration(calibrate(torch.device("cpu")), tmp_path / "elsewhere.json")
    assert out.is_file() and not os.path.exists(tmp_path / "calibration" / "elsewhere.json")


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA out-of-memory needs a CUDA device")
def test_a_step_out_of_cuda_memory_stops_with_the_plan_beside_it(tmp_path):
    from workbench.train.fit_check import OutOfMemoryStop

    free, _ = torch.cuda.mem_get_info()
    rc = RunConfig.from_dict(
        {
            "model": {"preset": "qwen3-30b-a3b", "layers": 2},
            "data": {"kind": "synthetic", "seq_len": 32768},
            "train": {"steps": 1, "local_batch_size": 64, "global_batch_size": 64, "fit": "off"},
            "backend": {"fused_ce": False},
            "output_dir": str(tmp_path / "runs"),
        }
    )
    assert plan_run(rc, gpus=1, with_options=False).peak_gib_per_rank > free / GIB
    with pytest.raises(OutOfMemoryStop, match=r"CUDA out of memory in step 1: .* GiB allocated at the peak, planned"):
        finetune(rc)


def test_setup_tab_plans_each_mesh_and_says_why_one_does_not_fit():
    qwen = RunConfig.from_dict({"model": {"preset": "qwen3-30b-a3b"}}).model.hf_config()
    training = dict(seq_len=4096, local_batch=2, dtype="auto", fused_ce=True, activation_checkpointing=False)
    options = model_mesh_options(8, qwen)
    plans = mesh_plans(qwen, options, training, "cuda", 79.1, "NVIDIA H100 80GB HBM3")
    assert [mp.option.mesh.ep for mp in plans] == [1, 2, 4, 8]
    assert all(mp.plan is not None and mp.plan.gpu == "h100" for mp in plans)
    text = mesh_plans_html(plans, options[-1])
    # ep=1 alone fits: its one-rank dispatch lets the experts take their routing weights in their rows, so the combine
    # keeps no expert outputs (k x H a token and layer, which every ep > 1 keeps)
    assert [mp.plan.fits for mp in plans] == [True, False, False, False]
    assert text.count("does not fit") == 3 and "activations" in text and "tokens/s per GPU" in text
    assert "would fit with: --set" in chosen_plan_html(plans[-1], qwen)
    tiny = RunConfig.demo().model.hf_config()
    small = mesh_plans(tiny, model_mesh_options(2, tiny), dict(seq_len=128, local_batch=4), "cpu", 64.0)
    assert all(mp.plan.fits for mp in small) and "MiB" in mesh_plans_html(small, None)
    assert gib_text(0.57) == "0.57 GiB" and gib_text(42.31) == "42.3 GiB" and gib_text(0.004) == "4.1 MiB"


def test_workbench_finetune_refuses_a_run_that_cannot_fit_with_one_line_and_exit_code_2(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    big = {"model": {"preset": "qwen3-next-80b-a3b"}, "data": {"kind": "synthetic", "seq_len": 512}}
    RunConfig.from_dict(big).to_yaml(config)
    assert main(["finetune", str(config), "--output-dir", str(tmp_path / "runs"), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the run is planned at" in err[0] and "train.fit: off" in err[0], err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
