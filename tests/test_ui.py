"""workbench.ui headless: panel logic, memory estimate, plots fed by real runs, Studio on a real cluster."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

import torch
import transformers

from workbench.backends import BackendConfig
from workbench.config import ConfigError, RunConfig, preset_config
from workbench.ui import (
    BackendPanel,
    CompareRuns,
    LivePlots,
    MeshPanel,
    ModelPanel,
    backend_choices,
    estimate_memory,
    mesh_options,
    param_counts,
    resolve_auto,
)
from workbench.ui.memory import GIB
from workbench.ui.series import live_series
from workbench.ui.step_ticks import step_dtick


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
    for field, value in (
        ("experts", "te"),
        ("dispatcher", "symm_mem"),
        ("dispatcher", "deepep"),
        ("rms_norm", "triton"),
        ("dispatcher", "local"),
    ):
        c = by[field][value]
        assert not c.available and c.reason, (field, value)
    assert "ep=2" in by["dispatcher"]["local"].reason
    assert by["experts"]["grouped_mm"].available and by["gate"]["balanced"].available
    assert resolve_auto("dispatcher", None, "cpu", 2) == "alltoall"
    assert resolve_auto("experts", None, "cpu", 1) == "grouped_mm"


def test_backend_choices_from_rank_records_name_the_rank():
    # Two ranks that disagree: rank 1 lacks grouped_mm (as cluster.info() would report it).
    def record(rank, grouped_ok):
        backends = {
            "experts.grouped_mm": {"available": grouped_ok, "reason": "" if grouped_ok else "old torch"},
            "experts.loop": {"available": True, "reason": ""},
        }
        return {"rank": rank, "device": "cpu", "world_size": 2, "backends": backends}

    infos = [record(0, True), record(1, False)]
    experts = {c.value: c for c in backend_choices(infos, "cpu", 2)["experts"]}
    assert not experts["grouped_mm"].available and experts["grouped_mm"].reason == "rank 1: old torch"
    assert resolve_auto("experts", infos, "cpu", 2) == "loop"
    panel = BackendPanel(infos, "cpu", 2)
    button = panel.rows["experts"].buttons["grouped_mm"]
    assert button.disabled and "old torch" in button.tooltip
    assert ("experts=grouped_mm", "rank 1: old torch") in panel.rows["experts"].reasons
    assert "rank 1: old torch" in panel.unavailable.value and "<details" in panel.unavailable.value
    assert "auto = <b>loop</b>" in panel.rows["experts"].auto.value
    with pytest.raises(ValueError, match="unavailable"):
        panel.rows["experts"].value = "grouped_mm"
    panel.rows["experts"].value = "loop"
    panel.balanced_gate.value = True
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
    # Transformers on the H200, bf16, seq 4096, batch 2: peak GiB measured by the bench's anchor.
    for layers, dp, measured in ((8, 1, 59.6), (8, 2, 46.3), (16, 2, 72.1)):
        e = estimate_memory(
            preset_config("qwen3-30b-a3b", layers), dp, 1, seq_len=4096, local_batch=2, dtype="bfloat16"
        )
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


# -- every family ---------------------------------------------------------------------------------


def test_model_picker_lists_presets_by_family_with_total_and_active_params():
    from workbench.config import PRESETS
    from workbench.models.families import REGISTERED
    from workbench.ui.logic import preset_options

    options = preset_options()
    assert [o.name for o in options] == list(PRESETS)
    families = [o.family for o in options]
    with_presets = [f for f in REGISTERED if f.presets]  # a family may add none (Ergo)
    assert len(set(families)) == len(with_presets) and all(
        f == g or f not in families[i + 1 :] for i, (f, g) in enumerate(zip(families, families[1:]))
    )  # each family together
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


@pytest.mark.parametrize(
    "name,experts",
    [("gpt-oss-20b", 32), ("moonlight-16b-a3b", 64), ("mixtral-8x7b", 8), ("olmoe-1b-7b", 64), ("tiny-deepseek-v3", 8)],
)
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
    # Activations: layer 0 dense, layers 1-3 MoE with the router's 64 probabilities, k=6 routed copies (their input,
    # gate/up and activation, and at ep=2 their output: the all-to-all combine weighs the rows) and the 2 shared
    # experts' gate/up and activation; MLA widths (kv_a's output and its norm's)
    H, heads, qk, v = 2048, 16, 192, 128
    attention = heads * (2 * qk + 2 * v) + 2 * 512 + 64
    dense = 4 * H + attention + 3 * 11264
    moe = 4 * H + attention + 64 + 6 * (2 * H + 3 * 1408) + 3 * 2 * 1408
    assert est.activations == pytest.approx(4096 * 2 * 2 * (dense + 3 * moe))


@pytest.fixture(scope="module")
def tiny_run_dir(tmp_path_factory):
    """A real 3-step single-process run of the tiny model."""
    from workbench.train import finetune

    out = tmp_path_factory.mktemp("runs")
    result = finetune(RunConfig.demo(output_dir=str(out), train__steps=3, train__save_final_checkpoint=False))
    return result["run_dir"]


def test_live_plots_draw_real_records(tiny_run_dir):
    from workbench.runs.run_dir import RunDir

    records = RunDir.open(tiny_run_dir).read_metrics()
    plots = LivePlots()
    plots.update(records[:1])
    plots.update(records[1:])
    traces = {(t.name, tuple(t.x)): t for t in plots.figure.data if t.type == "scatter"}
    tokens = [t for t in plots.figure.data if t.type == "scatter" and t.showlegend]
    # The line holds the steps after the warm-up step 1; step 1 is a marker of its own.
    assert len(tokens) == 1 and list(tokens[0].x) == [2, 3]
    assert list(tokens[0].y) == [r["tokens_per_s_per_gpu"] for r in records[1:]]
    warm = [t for t in plots.figure.data if t.name == "warm-up step, rank 0" and t.xaxis == "x"][0]
    assert list(warm.x) == [1] and list(warm.y) == [records[0]["tokens_per_s_per_gpu"]]
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
    assert list(tokens[0].x) == [2, 3]
    heat = [t for t in plots.figure.data if t.type == "heatmap"][0]
    assert list(map(list, heat.z)) == live_series(run.records)["expert_load"]["z"]
    assert "step 3" in plots.figure.layout.annotations[4].text


def test_live_plots_png(tiny_run_dir, tmp_path):
    pytest.importorskip("matplotlib", reason="the PNG fallback needs matplotlib (the lab extra)")
    from workbench.runs.run_dir import RunDir

    plots = LivePlots()
    plots.update(RunDir.open(tiny_run_dir).read_metrics())
    png = plots.save_png(tmp_path / "sub" / "live.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_live_series_waits_for_every_rank():
    def rec(rank, step, load):
        return {
            "rank": rank,
            "step": step,
            "loss": 1.0 / step,
            "tokens_per_s_per_gpu": 10.0 * step,
            "tflops_per_gpu": 0.1,
            "mem_peak_gib": 1.0 + rank,
            "expert_load": load,
        }

    records = [rec(0, 1, [[1, 3]]), rec(1, 1, [[3, 1]]), rec(0, 2, [[4, 0]])]
    series = live_series(records)
    assert series["expert_load"]["step"] == 1  # step 2 lacks rank 1
    assert series["expert_load"]["z"] == [[1.0, 1.0]]
    assert series["per_rank"]["mem_peak_gib"][1] == ([1], [2.0])
    assert series["loss"] == ([1, 2], [1.0, 0.5])


def test_compare_runs_labels_by_difference(tiny_run_dir, tmp_path):
    from workbench.train import finetune

    other = finetune(
        RunConfig.demo(
            output_dir=str(tmp_path),
            train__steps=2,
            train__save_final_checkpoint=False,
            backend=BackendConfig(experts="loop", gate="balanced"),
        )
    )
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


# -- a Studio that looks finished ----------------------------------------------------------------------


def test_summary_strip_figures_from_a_real_runs_metrics(tiny_run_dir):
    import statistics

    from workbench.runs.run_dir import RunDir
    from workbench.ui.series import ema
    from workbench.ui.summary import peak_tflops, strip_html, summarize_live

    records = RunDir.open(tiny_run_dir).read_metrics()
    by_step = {r["step"]: r for r in records}  # one rank
    s = summarize_live(records, total_steps=10, capacities_gib={0: 8.0}, peak=100.0, smoothing=0.5)
    assert s.step == 3 and s.total_steps == 10 and s.window == (2, 3)  # warm-up step 1 left out
    tokens = [by_step[k]["tokens_per_s_per_gpu"] for k in (2, 3)]
    assert s.tokens_per_s_per_gpu == pytest.approx(statistics.median(tokens))
    tflops = statistics.median([by_step[k]["tflops_per_gpu"] for k in (2, 3)])
    assert s.tflops_per_gpu == pytest.approx(tflops) and s.mfu_pct == pytest.approx(tflops)  # peak 100
    step_time = statistics.median([by_step[k]["step_time_s"] for k in (2, 3)])
    assert s.eta_s == pytest.approx(7 * step_time)
    (mem,) = s.memory
    assert (mem.rank, mem.used_gib, mem.capacity_gib, mem.kind) == (0, by_step[3]["mem_peak_gib"], 8.0, "cpu_rss")
    assert s.loss == by_step[3]["loss"]
    assert s.loss_smoothed == pytest.approx(ema([by_step[k]["loss"] for k in (1, 2, 3)], 0.5)[-1])
    assert s.loss_smoothed != s.loss
    html_text = strip_html(s)
    assert f"data-key='tokens_per_s_per_gpu' data-value='{s.tokens_per_s_per_gpu!r}'" in html_text
    assert f"{s.tokens_per_s_per_gpu:,.0f}" in html_text and f"{s.loss:.4f}" in html_text
    assert f"{mem.used_gib:.2f} / 8.0" in html_text
    # No datasheet peak for a CPU: MFU is n/a, not 0.
    cpu = summarize_live(records, total_steps=3)
    assert cpu.mfu_pct is None and cpu.eta_s == 0 and ">n/a<" in strip_html(cpu)
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("Intel(R) Xeon(R)") is None


def test_summary_strip_takes_the_mean_over_ranks_and_waits_for_every_rank():
    from workbench.ui.summary import summarize_live

    def rec(rank, step, tps, t):
        return {
            "rank": rank,
            "step": step,
            "loss": 2.0 / step,
            "tokens_per_s_per_gpu": tps,
            "tflops_per_gpu": 1.0,
            "step_time_s": t,
            "mem_peak_gib": 1.0 + rank,
            "mem_kind": "cuda_allocated",
        }

    records = [
        rec(0, 1, 5.0, 9.0),
        rec(1, 1, 7.0, 9.5),
        rec(0, 2, 100.0, 1.0),
        rec(1, 2, 200.0, 2.0),
        rec(0, 3, 1000.0, 0.1),
    ]  # step 3 lacks rank 1
    s = summarize_live(records, total_steps=4)
    assert s.window == (2,) and s.tokens_per_s_per_gpu == 150.0 and s.step_time_s == 2.0  # slowest rank
    assert s.step == 3 and s.eta_s == 2.0 and [m.used_gib for m in s.memory] == [1.0, 2.0]


def test_live_plots_keep_the_warm_up_step_off_the_scale(tiny_run_dir):
    from workbench.runs.run_dir import RunDir

    records = RunDir.open(tiny_run_dir).read_metrics()
    records[0] = {**records[0], "tokens_per_s_per_gpu": records[0]["tokens_per_s_per_gpu"] / 20}  # a slow warm-up
    plots = LivePlots()
    plots.update(records)
    steady = [r["tokens_per_s_per_gpu"] for r in records[1:]]
    low, high = plots.figure.layout.yaxis.range
    assert low <= min(steady) and high >= max(steady) and low > records[0]["tokens_per_s_per_gpu"]
    assert "warm-up step 1" in plots.warmup_note.value and "tokens/s per GPU" in plots.warmup_note.value
    assert plots.figure.layout.annotations[0].text == "tokens/s per GPU"  # no subtitle to run into the next title
    warm = [t for t in plots.figure.data if t.name == "warm-up step, rank 0" and t.yaxis == "y"]
    assert list(warm[0].x) == [1] and warm[0].mode == "markers"
    # Memory and loss keep every step on their scale.
    assert plots.figure.layout.yaxis3.range is None
    assert list([t for t in plots.figure.data if t.name == "loss"][0].x) == [1, 2, 3]


def test_expert_load_colour_bar_starts_at_zero(tiny_run_dir):
    from workbench.runs.run_dir import RunDir

    plots = LivePlots()
    plots.update(RunDir.open(tiny_run_dir).read_metrics())
    heat = [t for t in plots.figure.data if t.type == "heatmap"][0]
    top = max(v for row in heat.z for v in row)
    assert heat.zmin == 0 and heat.zmax == max(2.0, top) and heat.zmid is None
    # White (the uniform share) sits at load 1.0 on the bar.
    assert [stop for stop, _ in heat.colorscale] == pytest.approx([0.0, 1.0 / heat.zmax, 1.0])


def test_loss_smoothing(tiny_run_dir):
    from workbench.runs.run_dir import RunDir
    from workbench.ui.series import ema

    records = RunDir.open(tiny_run_dir).read_metrics()
    plots = LivePlots()
    plots.update(records)
    assert not [t for t in plots.figure.data if t.name == "loss (smoothed)"]
    plots.smoothing.value = 0.6
    (smooth,) = [t for t in plots.figure.data if t.name == "loss (smoothed)"]
    assert list(smooth.y) == pytest.approx(ema([r["loss"] for r in records], 0.6))
    assert ema([4.0, 2.0], 0.5) == pytest.approx([4.0, (0.25 * 4 + 0.5 * 2) / 0.75])
    with pytest.raises(ValueError, match="smoothing"):
        ema([1.0], 1.0)


def test_compare_labels_come_from_resolved_settings(tiny_run_dir, tmp_path):
    from workbench.train import finetune
    from workbench.ui.series import labels_from_configs, resolved_settings

    # The same backends asked for by name that "auto" resolved to in tiny_run_dir: not a difference.
    explicit = BackendConfig(experts="grouped_mm", dispatcher="local", attention="sdpa", rms_norm="torch")
    other = finetune(
        RunConfig.demo(output_dir=str(tmp_path), train__steps=2, train__save_final_checkpoint=False, backend=explicit)
    )
    compare = CompareRuns([tiny_run_dir, other["run_dir"]])
    assert list(compare.frame.groupby("label", sort=False).size().index) == ["steps=3", "steps=2"]
    balanced = finetune(
        RunConfig.demo(
            output_dir=str(tmp_path),
            train__steps=2,
            train__save_final_checkpoint=False,
            backend=BackendConfig(experts="loop", gate="balanced"),
        )
    )
    compare.set_runs([other["run_dir"], balanced["run_dir"]])
    labels = list(compare.frame.groupby("label", sort=False).size().index)
    assert labels == ["experts=grouped_mm \u00b7 gate=native", "experts=loop \u00b7 gate=balanced"]
    # A config the trainer has not recorded yet is resolved as its ranks will resolve it.
    asked = RunConfig.demo().to_dict()
    assert resolved_settings(asked)["backend"]["experts"] == "grouped_mm"
    named = RunConfig.demo(backend=explicit).to_dict()
    assert labels_from_configs([asked, named], ["a", "b"]) == ["a", "b"]  # nothing differs: named by id


def test_compare_tab_empty_states_and_run_list(tiny_run_dir, tmp_path):
    from pathlib import Path

    empty_dir = tmp_path / "none"
    compare = CompareRuns(runs_dir=empty_dir)
    assert "No runs in" in compare.empty.value and compare.plots.layout.display == "none"
    compare = CompareRuns(runs_dir=Path(tiny_run_dir).parent)
    assert "No runs compared yet" in compare.empty.value and compare.plots.layout.display == "none"
    assert compare.compare_selected() is None
    assert "No run selected" in compare.empty.value and compare.plots.layout.display == "none"
    ((label, path),) = compare.picker.options
    assert "{" not in label and label.startswith(Path(tiny_run_dir).name) and "tiny" in label
    assert "completed" in label and "dp1" in label and "step 3/3" in label
    compare.picker.value = (path,)
    table = compare.compare_selected()
    assert list(table["steps"]) == [3] and compare.empty.layout.display == "none" and compare.plots.layout.display == ""
    # The legend sits under the plots, clear of the subplot titles.
    assert compare.figure.layout.legend.y < 0


def test_profile_tab_before_the_first_profile():
    from workbench.ui import ProfilePanel

    panel = ProfilePanel()
    assert "No profile yet" in panel.empty.value and "<b>Profile</b>" in panel.empty.value
    assert panel.results.layout.display == "none" and panel.empty.layout.display != "none"
    assert panel.button.description == "Profile" and not panel.button.disabled
    assert len(panel.figure.data) == 0 and not panel.figure.layout.title.text
    panel.button.click()  # no cluster: the reason shows in the tab, not only in the kernel log
    assert "needs a cluster" in panel.status.value and not panel.button.disabled


def test_balanced_gate_is_a_benchmark_setting():
    panel = BackendPanel(None, "cpu", 2)
    assert "gate" not in panel.rows  # not a choice beside the real router
    assert panel.backend_config().gate == "native"
    assert "benchmark" in panel.balanced_gate.description and panel.benchmark.get_title(0) == "Benchmark settings"
    panel.balanced_gate.value = True
    assert panel.backend_config().gate == "balanced"
    assert BackendPanel(None, "cpu", 2, backend=BackendConfig(gate="balanced")).balanced_gate.value


def test_setup_labels_take_the_width_of_their_text():
    from workbench.ui import ModelPanel
    from workbench.ui.run_panel import RunPanel

    panels = [ModelPanel().widget, MeshPanel(2).widget, BackendPanel(None, "cpu", 2).widget, RunPanel().widget]

    def walk(w):
        yield w
        for child in getattr(w, "children", ()):
            yield from walk(child)

    import ipywidgets as W

    widgets = [w for p in panels for w in walk(p)]
    buttons = [w for w in widgets if isinstance(w, (W.Button, W.ToggleButton))]
    assert buttons and all(b.layout.width == "auto" for b in buttons)  # as wide as their text
    described = [w for w in widgets if getattr(w, "description", "") and w not in buttons]
    fixed = [
        w.description
        for w in described
        if w.style.description_width != "initial" and not (hasattr(w, "indent") and w.indent is False)
    ]
    assert described and fixed == []  # a fixed description width cut "global batch" to "global bat..."
    rows = [w for w in widgets if isinstance(w, W.HBox)]
    assert all(r.layout.flex_flow == "row wrap" for r in rows)  # rows wrap on a narrow notebook


def test_progress_bars_cut_nothing_off(tiny_run_dir):
    from workbench.cluster import Run
    from workbench.ui.summary import ProgressLine

    run = Run.from_dir(tiny_run_dir)
    bar, label = run.progress.children  # the Run's own bar (run.progress in a notebook)
    assert bar.description == "" and label.layout.width == "auto" and run.progress.layout.flex_flow == "row wrap"
    assert label.value.startswith("completed at step 3/3")
    line = ProgressLine(run)  # the Studio's: an HTML line that wraps
    assert line.bar.value == 3 and line.widget.layout.flex_flow == "row wrap"
    assert "completed at step 3/3 in " in line.label.value


def test_figures_follow_the_width_the_browser_reports():
    from workbench.ui.resize import FigureFit

    plots, compare = LivePlots(), CompareRuns()
    fit = FigureFit()
    fit.fit(plots.figure, margin_px=48)
    fit.fit(compare.figure, margin_px=48)
    assert plots.figure.layout.width is None  # nothing measured yet: plotly's own size
    fit.width = 1000  # what the widget's ResizeObserver sends from the page
    assert plots.figure.layout.width == compare.figure.layout.width == 952
    fit.width = 300  # a very narrow notebook: never below a readable minimum
    assert plots.figure.layout.width == 320


def test_every_studio_figure_follows_the_studios_width(tmp_path):
    from workbench.ui import Studio

    studio = Studio(None, runs_dir=tmp_path)
    studio.fit.width = 1000
    figures = (studio.live.figure, studio.live.health.figure, studio.compare.figure, studio.profiler.figure)
    assert [f.layout.width for f in figures] == [952] * 4  # the MoE health plots under the heatmap too


# -- on a real 2-rank cluster ---------------------------------------------------------------------------


@pytest.mark.slow
def test_studio_runs_and_profiles_on_a_cluster(cluster, tmp_path):
    from workbench.ui import Studio

    studio = Studio(cluster, runs_dir=tmp_path, steps=2)
    assert [studio.tabs.get_title(i) for i in range(4)] == ["Setup", "Live", "Compare", "Profile"]
    assert [o.mesh.ep for _, o in studio.mesh.mesh.options] == [1, 2]
    assert studio.backend.rows["dispatcher"].buttons["local"].disabled  # default mesh ep=2
    assert "rank 0:" in studio.backend.unavailable.value  # te unavailable, from cluster.info()
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
    # The summary strip shows the run's own metrics.jsonl figures, both ranks' memory against their RAM.
    from workbench.runs.run_dir import RunDir
    from workbench.ui.summary import summarize_live

    disk = RunDir.open(run.path).read_metrics()
    assert studio.strip.summary == summarize_live(disk, 2, studio.strip.capacities)
    assert [m.rank for m in studio.strip.summary.memory] == [0, 1] and set(studio.strip.capacities) == {0, 1}
    assert studio.strip.summary.step == 2 and "2/2" in studio.strip.widget.value
    assert not studio.run_panel.start_button.disabled and not studio.profiler.button.disabled
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
    assert run is not None and not panel.stop_button.disabled and panel.start_button.disabled
    deadline = time.monotonic() + 120
    while (run.last_step or 0) < 1:
        assert time.monotonic() < deadline and not run.done, run.status
        time.sleep(0.05)
    panel.stop_button.click()
    status = run.wait(timeout=120)
    assert status["state"] == "stopped" and status["step"] < 200
    assert "stopped" in panel.status.value and panel.stop_button.disabled and not panel.start_button.disabled
    assert bar_value(panel) == status["step"]
    assert max(live.series()["loss"][0]) == status["step"]
    # Redraws are throttled while the run goes; the last records are drawn once it ends.
    (loss,) = [t for t in live.figure.data if t.name == "loss"]
    assert max(loss.x) == status["step"]


def bar_value(panel) -> int:
    bar, _ = panel.progress.children[0].children
    return bar.value


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: phase times from kernel (device) times")
def test_profile_on_cuda_uses_kernel_times(tmp_path):
    from workbench.train.profile import profile_finetune
    from workbench.ui.profile import load_profile

    result = profile_finetune(
        RunConfig.demo(output_dir=str(tmp_path), train__steps=3, train__save_final_checkpoint=False)
    )
    (prof,) = load_profile(result["run_dir"])
    assert prof["device"] == "cuda" and prof["steps"] == 2
    phases = prof["phases_ms"]
    assert {"router", "dispatch", "experts", "combine"} <= set(phases) and all(v > 0 for v in phases.values())
    # Kernel time inside the MoE phases cannot exceed the wall time of a step.
    from workbench.runs.run_dir import RunDir

    steps = [r for r in RunDir.open(result["run_dir"]).read_metrics() if r["step"] > 1]
    step_ms = 1000 * sum(r["step_time_s"] for r in steps) / len(steps)
    moe_ms = sum(phases[p] for p in ("router", "dispatch", "experts", "combine"))
    assert moe_ms < step_ms, (phases, step_ms)
    assert any("kernel" in op["name"].lower() or "gemm" in op["name"].lower() for op in prof["top_ops"])


def test_step_axes_tick_whole_steps_that_read_apart():
    assert step_dtick(1, 3) == 1  # plotly's own ticks put 1.5 and 2.5 on a three-step axis
    assert step_dtick(1, 20) == 5 and step_dtick(1, 100_000) == 20_000
    for first, last in [(1, 1), (1, 2), (1, 7), (3, 50), (1, 999), (10, 12345)]:
        dtick = step_dtick(first, last)
        assert isinstance(dtick, int) and dtick >= 1
        assert (last - first) / dtick <= 5  # at most 6 ticks
        assert str(dtick).strip("0") in ("1", "2", "5")


def test_live_plots_step_axes_and_colour_bar_stay_inside_the_figure(tiny_run_dir):
    from workbench.runs.run_dir import RunDir

    plots = LivePlots()
    plots.update(RunDir.open(tiny_run_dir).read_metrics())
    for name in ("xaxis", "xaxis2", "xaxis3", "xaxis4"):
        assert plots.figure.layout[name].dtick == 1  # the tiny run's 3 steps: ticks 1, 2, 3
    heat = [t for t in plots.figure.data if t.type == "heatmap"][0]
    assert heat.colorbar.x == 1.0 and heat.colorbar.xanchor == "right"  # no margin widened beyond the plots
    assert plots.figure.get_subplot(2, 2).xaxis.domain[1] < heat.colorbar.x
