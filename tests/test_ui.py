"""workbench.ui headless: panel logic, memory estimate, plots fed by real runs, Studio on a real cluster."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

import torch  # noqa: E402
import transformers  # noqa: E402

from workbench.backends import BackendConfig  # noqa: E402
from workbench.config import ConfigError, RunConfig, preset_config  # noqa: E402
from workbench.ui import (BackendPanel, CompareRuns, LivePlots, MeshPanel, ModelPanel,  # noqa: E402
                          backend_choices, estimate_memory, mesh_options, param_counts, resolve_auto)
from workbench.ui.memory import GIB  # noqa: E402
from workbench.ui.series import live_series  # noqa: E402


@pytest.mark.parametrize("world, expected_ep", [(1, [1]), (2, [1, 2]), (4, [1, 2, 4]), (8, [1, 2, 4, 8])])
def test_valid_meshes_for_128_experts(world, expected_ep):
    options = mesh_options(world, 128)
    assert [o.mesh.ep for o in options] == expected_ep
    assert all(o.mesh.dp == world and o.mesh.edp == world // o.mesh.ep for o in options)
    for o in options:
        assert o.experts_per_rank == 128 // o.mesh.ep
        # The ep ranks' expert ranges tile 0..127 without overlap.
        covered = [e for a, b in o.expert_ranges for e in range(a, b)]
        assert covered == list(range(128))


def test_meshes_respect_expert_count():
    assert [o.mesh.ep for o in mesh_options(8, 6)] == [1, 2]  # 4 and 8 do not divide 6 experts
    assert [o.mesh.ep for o in mesh_options(4, 8)] == [1, 2, 4]
    with pytest.raises(ValueError, match="experts"):
        mesh_options(2, 0)


def test_mesh_panel_offers_only_valid_meshes():
    panel = MeshPanel(world_size=8, device_type="cuda", device_memory_gib=140)
    panel.set_model(preset_config("qwen3-30b-a3b", layers=8))
    labels = [label for label, _ in panel.mesh.options]
    assert len(labels) == 4 and all("dp=8" in label for label in labels)
    assert panel.mesh_config().ep == 8  # default: the widest expert split
    assert "16 experts per rank" in panel.details.value and "GiB" in panel.details.value
    panel.set_model(preset_config("tiny"))  # 8 experts: ep=8 still fits
    assert [o.mesh.ep for _, o in panel.mesh.options] == [1, 2, 4, 8]


def test_disabled_backends_carry_reasons():
    choices = backend_choices(None, device_type="cpu", world_size=2, ep=2)
    by = {f: {c.value: c for c in cs} for f, cs in choices.items()}
    for field, value in (("experts", "te"), ("dispatcher", "symm_mem"), ("dispatcher", "deepep"),
                         ("rms_norm", "triton"), ("dispatcher", "local")):
        c = by[field][value]
        assert not c.available and c.reason, (field, value)
    assert "ep=2" in by["dispatcher"]["local"].reason
    assert by["experts"]["grouped_mm"].available and by["gate"]["balanced"].available
    assert resolve_auto("dispatcher", None, "cpu", 2) == "alltoall"
    assert resolve_auto("experts", None, "cpu", 1) == "grouped_mm"


def test_backend_choices_from_rank_records_name_the_rank():
    # Two ranks that disagree: rank 1 lacks grouped_mm (as cluster.info() would report it).
    def record(rank, grouped_ok):
        backends = {"experts.grouped_mm": {"available": grouped_ok, "reason": "" if grouped_ok else "old torch"},
                    "experts.loop": {"available": True, "reason": ""}}
        return {"rank": rank, "device": "cpu", "world_size": 2, "backends": backends}

    infos = [record(0, True), record(1, False)]
    experts = {c.value: c for c in backend_choices(infos, "cpu", 2)["experts"]}
    assert not experts["grouped_mm"].available and experts["grouped_mm"].reason == "rank 1: old torch"
    assert resolve_auto("experts", infos, "cpu", 2) == "loop"
    panel = BackendPanel(infos, "cpu", 2)
    button = panel.rows["experts"].buttons["grouped_mm"]
    assert button.disabled and "old torch" in button.tooltip
    assert "rank 1: old torch" in panel.rows["experts"].reasons.value
    assert "auto = <b>loop</b>" in panel.rows["experts"].auto.value
    with pytest.raises(ValueError, match="unavailable"):
        panel.rows["experts"].value = "grouped_mm"
    panel.rows["experts"].value = "loop"
    panel.rows["gate"].value = "balanced"
    assert panel.backend_config() == BackendConfig(experts="loop", gate="balanced")
    panel.expert_recompute.value = True
    assert panel.backend_config() == BackendConfig(experts="loop", gate="balanced", expert_recompute=True)
    panel.fp8.value = True  # validated when resolved on the ranks (needs TE on Hopper)
    assert panel.backend_config().fp8 is True
    panel.set_ep(2)  # the local dispatcher cannot serve ep=2
    assert panel.rows["dispatcher"].buttons["local"].disabled


def test_param_counts_match_the_real_model():
    cfg = preset_config("tiny", layers=3)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    counts = param_counts(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counts.experts == experts
    big = param_counts(preset_config("qwen3-30b-a3b"))
    assert 30.4e9 < big.total < 30.6e9 and 3.2e9 < big.active < 3.5e9  # "30B-A3B"


def test_memory_estimate_hand_count_and_measured_anchors():
    cfg = preset_config("qwen3-30b-a3b", layers=8)
    # Hand count of the sharded state for dp=4, ep=2 in bf16: 8 bytes per param, all params / dp.
    H, V, E, I, L = 2048, 151936, 128, 768, 8
    attention = H * 32 * 128 * 2 + H * 4 * 128 * 2 + 2 * 128
    dense = 2 * V * H + (2 * L + 1) * H + L * (attention + E * H)
    experts = L * E * 3 * H * I
    est = estimate_memory(cfg, 4, 2, seq_len=4096, local_batch=2, dtype="bfloat16")
    assert est.sharded_state == pytest.approx((dense / 4 + experts / 4) * 8)
    assert est.gathered == pytest.approx(2 * (2 * (2 * V * H) + 3 * (attention + E * H + E // 2 * 3 * H * I)))
    # More ep -> smaller gathered experts layer; activation checkpointing and fused CE shrink it.
    assert estimate_memory(cfg, 4, 4, seq_len=4096, local_batch=2).total < est.total
    small = estimate_memory(cfg, 4, 2, seq_len=4096, local_batch=2, activation_checkpointing=True, fused_ce=True)
    assert small.logits == 0 and small.activations < est.activations / 4
    # facts.md: Transformers on H200, bf16, seq 4096, batch 2 (peak GiB measured).
    for layers, dp, measured in ((8, 1, 59.6), (8, 2, 46.3), (16, 2, 72.1)):
        e = estimate_memory(preset_config("qwen3-30b-a3b", layers), dp, 1, seq_len=4096, local_batch=2,
                            dtype="bfloat16")
        assert abs(e.total / GIB - measured) / measured < 0.10, (layers, dp, e.as_gib())
    with pytest.raises(ValueError, match="ep dividing dp"):
        estimate_memory(cfg, 4, 3, seq_len=128, local_batch=1)
    with pytest.raises(ValueError, match="does not divide the model's 128 experts"):
        estimate_memory(cfg, 6, 3, seq_len=128, local_batch=1)


def test_model_panel_presets_and_checkpoint(tmp_path):
    panel = ModelPanel()
    assert panel.model_config().preset == "tiny" and panel.layers.value == 2
    panel.preset.value = "qwen3-30b-a3b"
    assert panel.layers.value == 48
    panel.layers.value = 8
    assert panel.hf_config().num_hidden_layers == 8 and "128 experts" in panel.summary.value
    panel.preset.value = "local checkpoint"
    assert panel.hf_config() is None and "directory" in panel.error.value
    panel.path.value = str(tmp_path)
    assert panel.hf_config() is None and "config.json" in panel.error.value
    preset_config("tiny").save_pretrained(tmp_path)
    assert panel.hf_config().num_experts == 8 and panel.error.value == ""


# -- every family (issue 14 item 6) -----------------------------------------------------------------


def test_model_picker_lists_presets_by_family_with_total_and_active_params():
    from workbench.config import PRESETS
    from workbench.ui.logic import preset_options

    options = preset_options()
    assert [o.name for o in options] == list(PRESETS)
    families = [o.family for o in options]
    assert len(set(families)) == 5 and all(f == g or f not in families[i + 1:] for i, (f, g) in
                                           enumerate(zip(families, families[1:])))  # each family together
    by = {o.name: o for o in options}
    assert by["gpt-oss-20b"].label == "GPT-OSS \u00b7 gpt-oss-20b (20.9B total, 4.19B active, openai/gpt-oss-20b)"
    assert by["moonlight-16b-a3b"].label.startswith("DeepSeek-V3 \u00b7 moonlight-16b-a3b (16B total, 2.91B active")
    assert "46.7B total, 12.9B active" in by["mixtral-8x7b"].label and "6.92B total" in by["olmoe-1b-7b"].label
    panel = ModelPanel()
    assert [value for _, value in panel.preset.options] == [*PRESETS, "local checkpoint"]
    panel.preset.value = "moonlight-16b-a3b"
    assert panel.layers.value == 27
    assert panel.hf_config().model_type == "deepseek_v3"
    assert "64 experts (top-6) + 2 shared" in panel.summary.value and "B active" in panel.summary.value


@pytest.mark.parametrize("name,experts", [("gpt-oss-20b", 32), ("moonlight-16b-a3b", 64), ("mixtral-8x7b", 8),
                                          ("olmoe-1b-7b", 64), ("tiny-deepseek-v3", 8)])
def test_mesh_panel_knows_each_familys_expert_count(name, experts):
    panel = MeshPanel(world_size=8, device_type="cuda", device_memory_gib=140)
    panel.set_model(preset_config(name, layers=4))
    assert [o.mesh.ep for _, o in panel.mesh.options] == [1, 2, 4, 8]
    assert f"{experts // 8} experts per rank" in panel.details.value and "GiB" in panel.details.value


def test_mesh_panel_for_a_model_without_routed_experts_offers_data_parallel_only():
    panel = MeshPanel(world_size=2)
    panel.set_model(preset_config("tiny-deepseek-v3", layers=1))  # only its dense first layer
    assert [label for label, _ in panel.mesh.options] == ["dp=2 (no routed experts)"]
    assert "no routed experts" in panel.details.value


def test_memory_estimate_of_deepseek_v3_counts_shared_experts_and_mla():
    cfg = preset_config("moonlight-16b-a3b", layers=4)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    routed = sum(v for n, v in numel.items() if ".mlp.experts." in n)
    est = estimate_memory(cfg, 4, 2, seq_len=4096, local_batch=2, dtype="bfloat16")
    assert est.sharded_state == pytest.approx(((sum(numel.values()) - routed) / 4 + routed / 4) * 8)
    # Gathered: root (embed + lm_head, + grads) and 3 x the largest layer: attention, router, 2 shared
    # experts and this rank's 32 of 64 routed experts (larger than layer 0's dense MLP).
    def part(prefix):
        return sum(v for n, v in numel.items() if n.startswith(f"model.layers.1.{prefix}"))

    layer = part("self_attn.") + part("mlp.gate.") + part("mlp.shared_experts.") + part("mlp.experts.") // 2
    assert layer > sum(v for n, v in numel.items() if n.startswith("model.layers.0.mlp."))
    assert est.gathered == pytest.approx(2 * (2 * 2 * 163840 * 2048 + 3 * layer))
    # Activations: layer 0 dense, layers 1-3 MoE with k=6 routed + shared copies; MLA widths.
    H, heads, qk, v = 2048, 16, 192, 128
    attention = heads * (2 * qk + 2 * v) + 512 + 64
    dense = 4 * H + attention + 2 * H + 3 * 11264
    moe = 4 * H + attention + 2 * H + 6 * (2 * H + 3 * 1408) + (2 * H + 3 * 2 * 1408)
    assert est.activations == pytest.approx(4096 * 2 * 2 * (dense + 3 * moe))


@pytest.fixture(scope="module")
def tiny_run_dir(tmp_path_factory):
    """A real 3-step single-process run of the tiny model."""
    from workbench.train import finetune

    out = tmp_path_factory.mktemp("runs")
    result = finetune(RunConfig.demo(output_dir=str(out), train__steps=3, train__save_final_checkpoint=False))
    return result["run_dir"]


def test_live_plots_draw_real_records(tiny_run_dir):
    from workbench.train.run_dir import RunDir

    records = RunDir.open(tiny_run_dir).read_metrics()
    plots = LivePlots()
    plots.update(records[:1])
    plots.update(records[1:])
    traces = {(t.name, tuple(t.x)): t for t in plots.figure.data if t.type == "scatter"}
    tokens = [t for t in plots.figure.data if t.type == "scatter" and t.showlegend]
    assert len(tokens) == 1 and list(tokens[0].x) == [1, 2, 3]
    assert list(tokens[0].y) == [r["tokens_per_s_per_gpu"] for r in records]
    loss = [t for t in plots.figure.data if t.name == "loss"][0]
    assert list(loss.y) == [r["loss"] for r in records]
    heat = [t for t in plots.figure.data if t.type == "heatmap"][0]
    load = records[-1]["expert_load"]
    assert len(heat.z) == len(load) == 2
    for layer, counts in enumerate(load):
        uniform = sum(counts) / len(counts)
        assert list(heat.z[layer]) == pytest.approx([c / uniform for c in counts])
    assert traces and len(plots.records) == 3


def test_live_plots_draw_the_runs_own_records(tiny_run_dir):
    from workbench.cluster import Run

    run = Run.from_dir(tiny_run_dir)
    plots = LivePlots(run)
    assert plots._records == {}  # no second copy of the run's records
    assert plots.records == run.records and [r["step"] for r in plots.records] == [1, 2, 3]
    tokens = [t for t in plots.figure.data if t.type == "scatter" and t.showlegend]
    assert list(tokens[0].x) == [1, 2, 3]
    heat = [t for t in plots.figure.data if t.type == "heatmap"][0]
    assert list(map(list, heat.z)) == live_series(run.records)["expert_load"]["z"]
    assert "step 3" in plots.figure.layout.annotations[4].text


def test_live_plots_png(tiny_run_dir, tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG fallback needs matplotlib (the lab extra)")
    from workbench.train.run_dir import RunDir

    plots = LivePlots()
    plots.update(RunDir.open(tiny_run_dir).read_metrics())
    png = plots.save_png(tmp_path / "sub" / "live.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_live_series_waits_for_every_rank():
    def rec(rank, step, load):
        return {"rank": rank, "step": step, "loss": 1.0 / step, "tokens_per_s_per_gpu": 10.0 * step,
                "tflops_per_gpu": 0.1, "mem_peak_gib": 1.0 + rank, "expert_load": load}

    records = [rec(0, 1, [[1, 3]]), rec(1, 1, [[3, 1]]), rec(0, 2, [[4, 0]])]
    series = live_series(records)
    assert series["expert_load"]["step"] == 1  # step 2 lacks rank 1
    assert series["expert_load"]["z"] == [[1.0, 1.0]]
    assert series["per_rank"]["mem_peak_gib"][1] == ([1], [2.0])
    assert series["loss"] == ([1, 2], [1.0, 0.5])


def test_compare_runs_labels_by_difference(tiny_run_dir, tmp_path):
    from workbench.train import finetune

    other = finetune(RunConfig.demo(output_dir=str(tmp_path), train__steps=2, train__save_final_checkpoint=False,
                                    backend=BackendConfig(experts="loop", gate="balanced")))
    compare = CompareRuns([tiny_run_dir, other["run_dir"]])
    summary = compare.frame.groupby("label").size()
    labels = list(summary.index)
    assert any("gate=balanced" in label for label in labels) and any("gate=native" in label for label in labels)
    table = compare.set_runs([tiny_run_dir, other["run_dir"]], labels=["native", "balanced"])
    assert list(table.index) == ["native", "balanced"]
    assert table.loc["balanced", "load CV"] == 0.0  # round-robin gate: every expert equally loaded
    assert table.loc["native", "load CV"] > 0.05
    assert len([t for t in compare.figure.data if t.showlegend]) == 2
    with pytest.raises(ValueError, match="at least one"):
        compare.set_runs([])


# -- on a real 2-rank cluster ---------------------------------------------------------------------------


@pytest.mark.slow
def test_studio_runs_and_profiles_on_a_cluster(cluster, tmp_path):
    from workbench.ui import Studio

    studio = Studio(cluster, runs_dir=tmp_path, steps=2)
    assert [studio.tabs.get_title(i) for i in range(4)] == ["Setup", "Live", "Compare", "Profile"]
    assert [o.mesh.ep for _, o in studio.mesh.mesh.options] == [1, 2]
    assert studio.backend.rows["dispatcher"].buttons["local"].disabled  # default mesh ep=2
    assert "rank 0:" in studio.backend.rows["experts"].reasons.value  # te unavailable, from cluster.info()
    studio.run_panel.global_batch.value = 3
    with pytest.raises(ConfigError, match="multiple"):
        studio.run_config()
    studio.run_panel.start_button.click()
    assert studio.run_panel.run is None and "multiple" in studio.run_panel.status.value
    studio.run_panel.global_batch.value = 8
    run = studio.start()
    run.wait(timeout=240)
    assert studio.tabs.selected_index == 1 and studio.run_panel.stop_button.disabled
    ranks = {t.name for t in studio.live.figure.data if t.type == "scatter" and t.showlegend}
    assert ranks == {"rank 0", "rank 1"}
    assert len(studio.live.records) == 4
    assert any(str(run.path) == value for _, value in studio.compare.picker.options)

    profile_run = studio.profiler.profile(wait=True)
    assert profile_run.state == "completed"
    profiles = studio.profiler.profiles
    assert [p["rank"] for p in profiles] == [0, 1]
    for prof in profiles:
        assert {"router", "dispatch", "experts", "combine"} <= set(prof["phases_ms"])
        assert all(v > 0 for v in prof["phases_ms"].values())
        assert prof["communication_ms"] > 0  # gloo all-to-all and reductions
        trace = json.loads(open(prof["trace"]).read())
        assert any(e.get("name") == "workbench.dispatch" for e in trace["traceEvents"])
    assert "download trace_rank1.json.gz" in studio.profiler.links.value
    assert len(studio.profiler.figure.data) == 2


@pytest.mark.slow
def test_run_panel_stop_button_stops_the_run(cluster, tmp_path):
    import time

    from workbench.ui import RunPanel

    panel = RunPanel(cluster, runs_dir=str(tmp_path), steps=200)
    live = LivePlots()
    panel.on_run(live.attach)
    panel.start_button.click()
    run = panel.run
    assert run is not None and not panel.stop_button.disabled
    deadline = time.monotonic() + 120
    while (run.last_step or 0) < 1:
        assert time.monotonic() < deadline and not run.done, run.status
        time.sleep(0.05)
    panel.stop_button.click()
    status = run.wait(timeout=120)
    assert status["state"] == "stopped" and status["step"] < 200
    assert "stopped" in panel.status.value and panel.stop_button.disabled
    assert bar_value(panel) == status["step"]
    assert max(live.series()["loss"][0]) == status["step"]


def bar_value(panel) -> int:
    bar, _ = panel.progress.children[0].children
    return bar.value


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: phase times from kernel (device) times")
def test_profile_on_cuda_uses_kernel_times(tmp_path):
    from workbench.train.profile import profile_finetune
    from workbench.ui.profile import load_profile

    result = profile_finetune(RunConfig.demo(output_dir=str(tmp_path), train__steps=3,
                                             train__save_final_checkpoint=False))
    (prof,) = load_profile(result["run_dir"])
    assert prof["device"] == "cuda" and prof["steps"] == 2
    phases = prof["phases_ms"]
    assert {"router", "dispatch", "experts", "combine"} <= set(phases) and all(v > 0 for v in phases.values())
    # Kernel time inside the MoE phases cannot exceed the wall time of a step.
    from workbench.train.run_dir import RunDir

    steps = [r for r in RunDir.open(result["run_dir"]).read_metrics() if r["step"] > 1]
    step_ms = 1000 * sum(r["step_time_s"] for r in steps) / len(steps)
    moe_ms = sum(phases[p] for p in ("router", "dispatch", "experts", "combine"))
    assert moe_ms < step_ms, (phases, step_ms)
    assert any("kernel" in op["name"].lower() or "gemm" in op["name"].lower() for op in prof["top_ops"])
