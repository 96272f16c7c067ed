"""`workbench bench` end to end on real gloo ranks: results schema, same-init loss agreement, README table."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_utils import run_ranks

from workbench.bench.config import BenchConfig, VariantSpec
from workbench.bench.readme import BEGIN, END, history_table, replace_section, table, write_readme
from workbench.config import ConfigError
from workbench.parallel.mesh import MeshConfig

REPO = Path(__file__).resolve().parents[1]
SIDE_KEYS = {"tokens_per_s_per_gpu", "tflops_per_gpu", "peak_mem_gib"}


TWO_RANK_VARIANTS = (
    "anchor",
    "engine",
    "engine_balanced",
    "anchor_cudnn",
    "engine_te",
    "engine_te_experts",
    "engine_recompute",
    "engine_adamw_torch",
    "anchor_liger",
)


@pytest.fixture(scope="module")
def two_rank_result(tmp_path_factory):
    """The CLI's own launcher (--ranks 2, spawned gloo ranks), tiny model, 2 rounds of 1 warm-up + 2 timed steps."""
    out = tmp_path_factory.mktemp("results")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "workbench.bench",
        "--ranks",
        "2",
        "--preset",
        "tiny",
        "--seq",
        "32",
        "--batch",
        "2",
        "--warmup",
        "1",
        "--steps",
        "4",
        "--rounds",
        "2",
        "--variants",
        ",".join(TWO_RANK_VARIANTS),
        "--out-dir",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(out.glob("*.json"))
    assert len(files) == 1, files
    return files[0], json.loads(files[0].read_text()), proc.stdout


@pytest.mark.slow
def test_two_ranks_schema_and_same_init(two_rank_result):
    path, result, stdout = two_rank_result
    assert path.name.endswith("-2xcpu.json") and path.with_suffix(".html").is_file()
    assert "plotly" in path.with_suffix(".html").read_text()[:20000].lower()
    assert result["schema"] == "workbench.bench/2"
    assert result["device"] == {**result["device"], "type": "cpu", "count": 2}
    assert result["versions"]["torch"] == torch.__version__ and result["versions"]["transformers"]
    assert {"commit", "dirty"} <= set(result["git"]) and result["command"].startswith("workbench bench")
    assert result["config"]["engine_mesh"] == {"dp": 2, "ep": 2, "cp": 1, "tp": 1}
    rows = {r["name"]: r for r in result["variants"]}
    assert rows["anchor_cudnn"]["status"] == "skipped" and "GPU" in rows["anchor_cudnn"]["reason"]
    # Liger's Triton kernels cannot run on a CPU: skipped with the reason, like the other CUDA-only rows
    assert rows["anchor_liger"]["status"] == "skipped" and "CUDA" in rows["anchor_liger"]["reason"]
    # optional accelerators absent on this CPU machine: skipped with what to install, not failed
    for name in ("engine_te", "engine_te_experts"):
        assert rows[name]["status"] == "skipped", rows[name]
        assert "moe-workbench[te]" in rows[name]["reason"] or "CUDA" in rows[name]["reason"], rows[name]
    ran = [n for n in TWO_RANK_VARIANTS if rows[n]["status"] == "ok"]
    assert ran == ["anchor", "engine", "engine_balanced", "engine_recompute", "engine_adamw_torch"]
    # alternating rounds: in order, then reversed; the timed steps of both rounds combined
    assert result["order"] == ran + ran[::-1]
    assert "run order (alternating rounds): " + " ".join(ran + ran[::-1]) in stdout
    # no NVML on a CPU: every ok row says its clocks were not sampled, and why
    assert all(rows[n]["gpu_clocks"] is None and rows[n]["gpu_clocks_unavailable"] == "not a CUDA device" for n in ran)
    assert "gpu clocks engine: not sampled (not a CUDA device)" in stdout
    for name in ran:
        row = rows[name]
        assert row["rounds"] == 2 and [len(t) for t in row["round_step_time_s"]] == [2, 2]
        assert len(row["step_time_s"]) == 4 and row["steps"] == 4 and all(t > 0 for t in row["step_time_s"])
        assert len(row["loss"]) == 3 and len(row["round_loss"]) == 2  # the first round's curve: warm-up included
        # every round starts from the same weights and tokens: the same losses
        assert row["round_loss"][1] == pytest.approx(row["round_loss"][0], abs=1e-6)
        # median with p10 and p90 of the combined timed steps
        assert row["p10_step_s"] <= row["median_step_s"] <= row["p90_step_s"]
        assert row["tokens_per_s_per_gpu_p10"] <= row["tokens_per_s_per_gpu"] <= row["tokens_per_s_per_gpu_p90"]
        assert row["tokens_per_s_per_gpu_p10"] == pytest.approx(2 * 32 / row["p90_step_s"])
        assert len(row["peak_mem_gib_per_rank"]) == 2 and row["mem_kind"] == "cpu_rss"
        assert row["tokens_per_s_per_gpu"] == pytest.approx(2 * 32 / row["median_step_s"])
        assert row["tflops_per_gpu"] > 0
        assert row["setup"]["step"] == "workbench.train.loop.Trainer.train_step"
        assert row["setup"]["clip_grad_norm"] == 1.0
    assert rows["anchor"]["setup"]["fsdp"].startswith("fully_shard per decoder layer")
    assert rows["anchor"]["setup"]["optimizer"].startswith("torch.optim.AdamW")
    assert rows["engine"]["setup"]["backend"]["dispatcher"] == "alltoall"
    # the engine with torch's AdamW: the optimizer is the only difference (fp32 here: the same numbers)
    assert rows["engine_adamw_torch"]["setup"]["train.optimizer"] == "adamw_torch"
    assert rows["engine_adamw_torch"]["setup"]["optimizer"].startswith("torch.optim.AdamW")
    assert rows["engine_adamw_torch"]["loss"] == pytest.approx(rows["engine"]["loss"], abs=1e-5)
    # the 2-GPU memory variant: expert MLPs recomputed under EP=2, same numbers as the engine
    assert rows["engine_recompute"]["setup"]["backend"]["expert_recompute"]
    assert rows["engine_recompute"]["loss"] == pytest.approx(rows["engine"]["loss"], abs=1e-5)
    comps = result["comparisons"]
    assert [(c["engine"]["variant"], c["gate"]) for c in comps] == [
        ("engine", "native"),
        ("engine_balanced", "balanced"),
        ("engine_recompute", "native"),
        ("engine_adamw_torch", "native"),
    ]
    for c in comps:
        assert {"world", "layers", "seq", "batch", "gate", "anchor", "engine", "ratio"} <= set(c)
        assert (c["world"], c["layers"], c["seq"], c["batch"]) == (2, 2, 32, 2)
        assert SIDE_KEYS <= set(c["anchor"]) and SIDE_KEYS <= set(c["engine"])
        assert "tokens_per_s_per_gpu_p10" in c["engine"] and "tokens_per_s_per_gpu_p90" in c["anchor"]
        assert c["ratio"] == pytest.approx(c["engine"]["tokens_per_s_per_gpu"] / c["anchor"]["tokens_per_s_per_gpu"])
        assert c["same_init"] is True
    # Same weights and tokens in fp32. The Trainer's losses: on 2 ranks too both aux losses are the global
    # batch's (models/router_aux.forward_loss_parts), so the whole losses differ by float32 rounding only.
    native = comps[0]
    assert native["loss_step0_abs_diff"] < 1e-3 and native["loss_max_abs_diff"] < 5e-3
    # The balanced gate routes differently, so its loss is its own (but from the same init).
    assert rows["engine_balanced"]["init_fingerprint"] == pytest.approx(rows["anchor"]["init_fingerprint"], rel=1e-9)
    assert "engine / anchor:" in stdout and "tokens/s/gpu" in stdout and "p10-p90" in stdout


@pytest.mark.slow
def test_readme_table_from_results(two_rank_result, tmp_path):
    path, result, _ = two_rank_result
    assert "no GPU results yet" in table(path.parent)  # CPU runs are left out by default
    text = table(path.parent, include_cpu=True)
    lines = text.splitlines()
    ok = [r for r in result["variants"] if r["status"] == "ok"]
    assert len(lines) == 2 + len(ok)
    # anchors first, then the native engine row as the headline (bold), then the others, balanced labelled
    assert "| anchor |" in lines[2] and "| 1.00x |" in lines[2]
    ratio = result["comparisons"][0]["ratio"]
    assert "| **engine** |" in lines[3] and f"**{ratio:.2f}x**" in lines[3] and path.name in lines[3]
    engine = next(r for r in ok if r["name"] == "engine")
    assert (
        f"| {engine['tokens_per_s_per_gpu']:,.0f} ({engine['tokens_per_s_per_gpu_p10']:,.0f}-"
        f"{engine['tokens_per_s_per_gpu_p90']:,.0f}) |"
    ) in lines[3]
    balanced = next(line for line in lines if "engine_balanced" in line)
    assert "engine_balanced (balanced gate)" in balanced and "**" not in balanced
    assert all("| Trainer.train_step |" in line for line in lines[2:])
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nintro\n{BEGIN}\nold table\n{END}\n\nafter\n")
    write_readme(readme, path.parent, include_cpu=True)
    new = readme.read_text()
    assert "old table" not in new and text in new and new.startswith("# Title\n\nintro\n") and new.endswith("\nafter\n")
    assert new.count(BEGIN) == 1 and new.count(END) == 1
    with pytest.raises(ValueError, match="marker"):
        replace_section("no markers here", text)
    with pytest.raises(ValueError, match="closing"):
        replace_section(f"{BEGIN}\nopen only", text)
    cli = subprocess.run(
        [sys.executable, "-m", "workbench.bench", "--readme-table", "--include-cpu", "--results-dir", str(path.parent)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert cli.returncode == 0 and cli.stdout.strip() == text
    history = tmp_path / "HISTORY.md"
    history.write_text(f"# History\n{BEGIN}\n{END}\n")
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.bench",
            "--history-table",
            "--include-cpu",
            "--results-dir",
            str(path.parent),
            "--write",
            str(history),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert cli.returncode == 0, cli.stderr
    rows = [line for line in history.read_text().splitlines() if line.startswith(f"| {result['date'][:10]}")]
    assert len(rows) == sum(c["reference"] for c in result["comparisons"])
    assert f"(results/{path.name})" in rows[0]


def _one_rank(rank, world, out_dir):
    from workbench.bench.runner import run_bench

    cfg = BenchConfig(
        preset="tiny",
        seq=16,
        batch=2,
        warmup=0,
        steps=2,
        variants=("anchor", "engine", "anchor_eager", "engine_recompute"),
        out_dir=out_dir,
        html=False,
        fail_fast=True,
    )
    return run_bench(cfg)


@pytest.mark.slow
def test_one_rank_losses_agree(tmp_path):
    (result,) = run_ranks(_one_rank, 1, str(tmp_path), timeout=120)
    rows = {r["name"]: r for r in result["variants"]}
    assert all(r["status"] == "ok" for r in rows.values())
    assert rows["anchor"]["setup"]["fsdp"] == "none (one rank)"
    # One rank: the aux loss is the same statistic on both sides, so whole losses agree at every step.
    for a, e in zip(rows["anchor"]["loss"], rows["engine"]["loss"]):
        assert abs(a - e) < 1e-5
    assert rows["anchor_eager"]["loss"][0] == pytest.approx(rows["anchor"]["loss"][0], abs=1e-5)
    # recomputing the expert MLPs changes memory, not numbers
    assert rows["engine_recompute"]["setup"]["backend"]["expert_recompute"] is True
    for a, e in zip(rows["engine"]["loss"], rows["engine_recompute"]["loss"]):
        assert abs(a - e) < 1e-6
    assert len(list(tmp_path.glob("*.json"))) == 1 and not list(tmp_path.glob("*.html"))


def _accumulating(rank, world, out_dir, accumulation):
    from workbench.bench.runner import run_bench

    cfg = BenchConfig(
        preset="tiny",
        seq=16,
        batch=1,
        accumulation=accumulation,
        warmup=0,
        steps=1,
        variants=("anchor", "engine"),
        out_dir=out_dir,
        html=False,
        fail_fast=True,
    )
    return run_bench(cfg)


def test_accumulation_counts_every_micro_batch(tmp_path):
    """--accumulation N: N micro-batches per optimizer step, each row's tokens per step counting all of them."""
    (one,) = run_ranks(_accumulating, 1, str(tmp_path / "one"), 1, timeout=120)
    (three,) = run_ranks(_accumulating, 1, str(tmp_path / "three"), 3, timeout=120)
    rows1 = {r["name"]: r for r in one["variants"]}
    rows3 = {r["name"]: r for r in three["variants"]}
    assert three["config"]["accumulation"] == 3
    assert three["model"]["floor"]["flops_per_step_per_gpu"] == pytest.approx(
        3 * one["model"]["floor"]["flops_per_step_per_gpu"]
    )
    for name in ("anchor", "engine"):
        assert rows1[name]["tokens_per_step_per_gpu"] == 16
        assert rows3[name]["tokens_per_step_per_gpu"] == 48
    # the step's loss is the mean over its three micro-batches: the first micro-batch alone gives another value
    assert rows3["engine"]["loss"][0] == pytest.approx(rows3["anchor"]["loss"][0], abs=1e-5)
    assert abs(rows3["engine"]["loss"][0] - rows1["engine"]["loss"][0]) > 1e-4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"preset": "nope"}, "unknown model preset"),
        ({"seq": 0}, "seq must be an integer >= 2"),
        ({"batch": 0}, "batch must be an integer >= 1"),
        ({"accumulation": 0}, "accumulation must be an integer >= 1"),
        ({"steps": 0}, "steps must be an integer >= 1"),
        ({"variants": ("anchor", "engin")}, "unknown bench variant"),
        ({"lr": -1.0}, "lr must be a positive number"),
        ({"steps": 3, "rounds": 4}, "rounds \\(4\\) exceeds steps \\(3\\)"),
        ({"rounds": 0}, "rounds must be an integer >= 1"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        BenchConfig(**kwargs)


def test_mesh_that_does_not_fit_is_refused_before_spawning():
    from workbench.bench.cli import launch

    with pytest.raises(ConfigError, match="spans 3 ranks but the world has 2"):
        launch(BenchConfig(mesh=MeshConfig(dp=3, ep=1), out_dir=None), 2)


def test_bench_mesh_and_dtype_are_the_trainers():
    from workbench.bench.runner import bench_mesh
    from workbench.train.model_setup import model_dtype, resolve_mesh

    cfg = BenchConfig(out_dir=None)
    hf = cfg.hf_config()
    assert bench_mesh(cfg, 2, hf) == resolve_mesh(None, 2, hf) == MeshConfig(dp=2, ep=2)
    assert bench_mesh(cfg, 1, hf) == MeshConfig(dp=1, ep=1)  # the engine rows always build on a mesh
    # A mesh that does not fit is refused in the trainer's words.
    with pytest.raises(ConfigError, match=r"mesh MeshConfig\(dp=2, ep=2, cp=1, tp=1\) does not fit this run"):
        bench_mesh(BenchConfig(mesh=MeshConfig(dp=2, ep=2), out_dir=None), 4, hf)
    assert model_dtype(cfg, torch.device("cpu")) == torch.float32
    assert model_dtype(BenchConfig(dtype="bfloat16", out_dir=None), torch.device("cpu")) == torch.bfloat16


def test_cli_bad_input_exit_code(capsys):
    from workbench.bench.cli import main

    assert main(["--preset", "qwen4", "--out-dir", ""]) == 2
    assert "unknown model preset 'qwen4'" in capsys.readouterr().err
    assert main(["--batch", "-1"]) == 2
    assert "batch must be" in capsys.readouterr().err


def test_param_counts_match_the_model():
    import transformers

    from workbench.bench.floor import step_floor
    from workbench.config import preset_config

    cfg = preset_config("tiny", layers=3)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert step_floor(cfg, seq=128, batch=2, world=1)["params_total"] == sum(p.numel() for p in model.parameters())
    big = preset_config("qwen3-30b-a3b", layers=16)
    floor = step_floor(big, seq=4096, batch=2, world=2)
    assert floor["flops_per_token"] == pytest.approx(8.92e9, rel=5e-3)
    assert floor["floor_step_s_at_matmul_peak"] == pytest.approx(2 * 4096 * floor["flops_per_token"] / 794e12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks the GPU path (bf16, events, cuDNN SDPA)")
@pytest.mark.parametrize("ranks", [1, 2])
def test_cuda_tiny_preflight(ranks, tmp_path):
    """Before the big device run: every variant, cuDNN anchor included, on the tiny model in bf16."""
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs, {torch.cuda.device_count()} visible")
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "workbench.bench",
        "--ranks",
        str(ranks),
        "--seq",
        "256",
        "--batch",
        "2",
        "--warmup",
        "2",
        "--steps",
        "4",
        "--variants",
        "anchor,engine,engine_balanced,anchor_cudnn,anchor_eager,anchor_liger,engine_adamw_torch",
        "--out-dir",
        str(tmp_path),
        "--no-html",
        "--fail-fast",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*.json")
    result = json.loads(path.read_text())
    assert result["device"]["type"] == "cuda" and result["device"]["count"] == ranks
    assert all(r["status"] == "ok" and r["mem_kind"] == "cuda_allocated" for r in result["variants"])
    native = next(c for c in result["comparisons"] if c["gate"] == "native" and c["anchor"]["variant"] == "anchor")
    assert native["same_init"] is True
    assert native["loss_step0_abs_diff"] < 5e-2  # bf16 kernels differ; same weights and tokens


@pytest.mark.slow
def test_default_results_go_under_the_runs_dir_with_bounded_threads(tmp_path):
    """From any folder: results land in <runs>/bench, not ./benchmarks/results; CPU threads bounded."""
    elsewhere, runs = tmp_path / "elsewhere", tmp_path / "runs"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=str(REPO), WORKBENCH_RUNS_DIR=str(runs))
    cmd = [
        sys.executable,
        "-m",
        "workbench.bench",
        "--seq",
        "16",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--variants",
        "anchor",
        "--no-html",
    ]
    proc = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(elsewhere.iterdir()) == []
    (path,) = (runs / "bench").glob("*.json")
    # torch's default is one thread per core: one preempted thread stalls every parallel region
    cores = len(os.sched_getaffinity(0))
    assert json.loads(path.read_text())["device"]["threads"] == max(1, cores // 2)


def test_out_dir_flag(monkeypatch, tmp_path):
    from workbench.bench.cli import add_arguments, config_from_args

    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(tmp_path / "runs"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).out_dir == str(tmp_path / "runs" / "bench")
    assert BenchConfig().out_dir == str(tmp_path / "runs" / "bench")
    assert config_from_args(parser.parse_args(["--out-dir", ""])).out_dir is None
    assert config_from_args(parser.parse_args(["--out-dir", "benchmarks/results"])).out_dir == "benchmarks/results"


def test_cpu_threads_respect_omp_num_threads(monkeypatch):
    from workbench.bench.runner import _set_cpu_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert _set_cpu_threads(torch.device("cpu"), 1) is None and torch.get_num_threads() == before
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert _set_cpu_threads(torch.device("cpu"), 1) == before
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
    finally:
        torch.set_num_threads(before)


# -- every family: the generic engine path against its Transformers anchor -------------------------------------


def _family_bench(rank, world, preset, variants, seq, steps):
    from workbench.bench.runner import run_bench

    cfg = BenchConfig(
        preset=preset,
        layers=2,
        seq=seq,
        batch=2,
        warmup=0,
        steps=steps,
        variants=variants,
        out_dir=None,
        html=False,
        fail_fast=True,
    )
    return run_bench(cfg)


def _assert_same_start(rows, anchor, engine, steps_tol, first_tol=1e-5):
    """Same init weights; the same first loss (fp32); later losses within `steps_tol` (Adam on equal grads)."""
    a, e = rows[anchor], rows[engine]
    assert a["status"] == e["status"] == "ok", (a, e)
    assert e["init_fingerprint"] == pytest.approx(a["init_fingerprint"], rel=1e-9)
    assert abs(a["loss"][0] - e["loss"][0]) < first_tol, (a["loss"], e["loss"])
    for x, y in zip(a["loss"], e["loss"]):
        assert abs(x - y) < steps_tol, (a["loss"], e["loss"])


@pytest.mark.slow
def test_deepseek_v3_one_rank_generic_path():
    """A DeepSeek-V3 twin (n_routed_experts, MLA, no aux loss) through the bench on one rank."""
    from workbench.config import preset_config
    from workbench.train.metrics import flops_per_token

    (result,) = run_ranks(
        _family_bench, 1, "tiny-deepseek-v3", ("anchor", "engine", "engine_balanced"), 32, 2, timeout=120
    )
    rows = {r["name"]: r for r in result["variants"]}
    _assert_same_start(rows, "anchor", "engine", 1e-4)
    assert rows["engine"]["setup"]["path"] == "generic" and rows["engine"]["setup"]["gate"] == "native"
    assert result["model"]["model_type"] == "deepseek_v3" and result["model"]["experts"] == 8
    # FLOPs of the family's own formula (MLA widths), and a step floor for it
    cfg = preset_config("tiny-deepseek-v3", 2)
    assert result["model"]["flops_per_token"] == pytest.approx(flops_per_token(cfg, 32))
    assert result["model"]["floor"]["flops_per_token"] == pytest.approx(flops_per_token(cfg, 32))
    assert result["model"]["floor"]["params_experts"] > 0 and rows["engine"]["tflops_per_gpu"] > 0
    # the balanced gate routes round-robin: same init, a different loss
    assert rows["engine_balanced"]["init_fingerprint"] == pytest.approx(rows["anchor"]["init_fingerprint"], rel=1e-9)
    assert abs(rows["engine_balanced"]["loss"][0] - rows["engine"]["loss"][0]) > 1e-5
    assert all(math.isfinite(x) for x in rows["engine_balanced"]["loss"])


@pytest.mark.slow
def test_mixtral_two_ranks_ep2_losses_equal_the_anchor():
    """DP2 x EP2 on gloo through the Trainer: the same start; the whole losses agree (both aux losses are
    the global batch's: the Trainer computes either model's, models/router_aux.forward_loss_parts)."""
    results = run_ranks(_family_bench, 2, "tiny-mixtral", ("anchor", "engine", "engine_balanced"), 32, 3, timeout=180)
    result = results[0]
    assert result["config"]["engine_mesh"] == {"dp": 2, "ep": 2, "cp": 1, "tp": 1}
    rows = {r["name"]: r for r in result["variants"]}
    _assert_same_start(rows, "anchor", "engine", 5e-4, first_tol=5e-4)
    assert rows["engine"]["setup"]["path"] == "generic"
    assert abs(rows["engine_balanced"]["loss"][0] - rows["engine"]["loss"][0]) > 1e-5
    assert all(math.isfinite(x) for x in rows["engine_balanced"]["loss"])
    assert results[1]["variants"][1]["loss"] == rows["engine"]["loss"]  # every rank reports the global numbers


@pytest.mark.slow
def test_gpt_oss_sdpa_refusal_and_reference_anchor():
    """GPT-OSS refuses sdpa (attention sinks): that row is recorded with the reason, and the speedups
    are against the best anchor row that ran, named with its setup."""
    from workbench.bench.report import format_table

    (result,) = run_ranks(
        _family_bench, 1, "tiny-gpt-oss", ("anchor", "anchor_flex", "anchor_eager_attn", "engine"), 32, 1, timeout=120
    )
    rows = {r["name"]: r for r in result["variants"]}
    assert rows["anchor"]["status"] == "skipped"
    assert "GptOssForCausalLM" in rows["anchor"]["reason"] and "'sdpa'" in rows["anchor"]["reason"]
    assert rows["anchor_flex"]["status"] == "skipped" and "CUDA" in rows["anchor_flex"]["reason"]
    _assert_same_start(rows, "anchor_eager_attn", "engine", 1e-5)
    ref = result["reference_anchor"]
    assert ref["variant"] == "anchor_eager_attn" and ref["setup"]["attention"] == "eager"
    assert ref["tokens_per_s_per_gpu"] == rows["anchor_eager_attn"]["tokens_per_s_per_gpu"]
    assert {r["variant"]: r["status"] for r in ref["not_run"]} == {"anchor": "skipped", "anchor_flex": "skipped"}
    (comp,) = result["comparisons"]
    assert comp["reference"] is True and comp["anchor"]["variant"] == "anchor_eager_attn"
    text = format_table(result)
    assert "reference anchor" in text and "engine / anchor_eager_attn: " in text
    assert text.count("(reference anchor)") == 1
    assert "refuses attn_implementation='sdpa'" in text


def _row(name, kind, tps, status="ok", gate="native", mem=1.0):
    base = {"name": name, "kind": kind, "status": status, "gate": gate, "setup": {"attention": name}}
    if status != "ok":
        return {**base, "reason": "refused"}
    return {
        **base,
        "tokens_per_s_per_gpu": tps,
        "tflops_per_gpu": 1.0,
        "peak_mem_gib": mem,
        "mem_kind": "x",
        "median_step_s": 1.0,
        "loss": [1.0],
        "init_fingerprint": 1.0,
    }


def _result(date, preset, rows, layers=8, seq=4096, batch=2):
    from workbench.bench.report import comparisons, reference_anchor

    return {
        "schema": "workbench.bench/2",
        "date": date,
        "model": {"preset": preset, "layers": layers},
        "config": {"layers": layers, "seq": seq, "batch": batch},
        "device": {"type": "cuda", "name": "NVIDIA H200", "count": 1},
        "variants": rows,
        "reference_anchor": reference_anchor(rows),
        "comparisons": comparisons(rows, 1, layers, seq, batch),
    }


def test_reference_is_the_fastest_plain_anchor_and_liger_stands_beside_it(tmp_path):
    from workbench.bench.report import comparisons, reference_anchor

    rows = [
        _row("anchor", "anchor", 0, "skipped"),
        _row("anchor_eager_attn", "anchor", 10.0),
        _row("anchor_flex", "anchor", 20.0),
        _row("anchor_liger", "anchor", 25.0),
        _row("engine", "engine", 40.0),
    ]
    # Liger is faster than every plain anchor, yet the speedups stay against plain Transformers
    assert reference_anchor(rows)["variant"] == "anchor_flex"
    assert reference_anchor([rows[3], rows[4]])["variant"] == "anchor_liger"  # the only anchor that ran
    comps = comparisons(rows, 1, 2, 32, 2)
    assert [(c["anchor"]["variant"], c["reference"]) for c in comps] == [
        ("anchor_flex", True),
        ("anchor_eager_attn", False),
        ("anchor_liger", False),
    ]
    assert comps[0]["ratio"] == pytest.approx(2.0)
    (tmp_path / "r.json").write_text(json.dumps(_result("2026-12-01T12:00:00", "gpt-oss-20b", rows)))
    lines = table(tmp_path).splitlines()
    assert len(lines) == 2 + 4 and "| gpt-oss-20b |" in lines[2] and "| anchor_flex |" in lines[2]
    engine = next(line for line in lines if "**engine**" in line)
    assert "| **2.00x** | **1.60x** |" in engine  # vs the reference anchor, vs anchor_liger


def test_readme_shows_the_latest_launch_per_setup_and_never_a_balanced_headline(tmp_path):
    old = [_row("anchor", "anchor", 10.0), _row("engine", "engine", 15.0)]
    new = [
        _row("anchor", "anchor", 10.0),
        _row("engine", "engine", 20.0),
        _row("engine_balanced", "engine", 30.0, gate="balanced"),
    ]
    other = [_row("anchor", "anchor", 5.0), _row("engine", "engine", 9.0)]
    for name, data in {
        "a.json": _result("2026-12-01T10:00:00", "qwen3-30b-a3b", old),
        "b.json": _result("2026-12-01T12:00:00", "qwen3-30b-a3b", new),
        "c.json": _result("2026-11-30T12:00:00", "qwen3-30b-a3b", other, seq=16384, batch=1),
    }.items():
        (tmp_path / name).write_text(json.dumps(data))
    lines = table(tmp_path).splitlines()[2:]
    assert [line.split(" | ")[3] for line in lines] == ["16384 x 1"] * 2 + ["4096 x 2"] * 3
    assert not any("a.json" in line for line in lines)  # the older launch of that setup is history only
    assert all("b.json" in line for line in lines[2:])
    bold = [line for line in lines if "**" in line]
    assert len(bold) == 2 and all("| **engine** |" in line for line in bold)  # one headline per setup
    assert "| **2.00x** |" in bold[1] and "| 3.00x |" in next(line for line in lines if "balanced gate" in line)
    # a later launch without an engine row (a memory variant beside its anchor) leaves the headline launch quoted
    memory_only = [_row("anchor", "anchor", 10.0), _row("engine_in_backward_ac", "engine", 12.0)]
    (tmp_path / "d.json").write_text(json.dumps(_result("2026-12-01T14:00:00", "qwen3-30b-a3b", memory_only)))
    assert table(tmp_path).splitlines()[2:] == lines
    (tmp_path / "d.json").unlink()
    # the SM clock column: the row's mean clock and power-capped share where NVML sampled it, n/a where not
    assert all(line.split(" | ")[-4] == "n/a" for line in lines)
    capped = {"sm_clock_mhz_mean": 1634.6, "power_capped_share": 0.98, "samples": 50}
    clocked = [_row("anchor", "anchor", 10.0), {**_row("engine", "engine", 21.0), "gpu_clocks": capped}]
    (tmp_path / "e.json").write_text(json.dumps(_result("2026-12-01T15:00:00", "qwen3-30b-a3b", clocked)))
    engine = next(line for line in table(tmp_path).splitlines() if "e.json" in line and "**engine**" in line)
    assert engine.split(" | ")[-4] == "1,635 (98%)"
    (tmp_path / "e.json").unlink()
    history = history_table(tmp_path).splitlines()[2:]
    assert [line.split(" | ")[-1] for line in history] == ["[b.json](results/b.json) |"] * 2 + [
        "[a.json](results/a.json) |",
        "[c.json](results/c.json) |",
    ]  # newest first, every launch


def test_balanced_gate_on_the_generic_experts():
    """BackendConfig(gate="balanced") on the generic path: the experts get round-robin ids, not the router's."""
    import workbench
    from workbench.backends import BackendConfig
    from workbench.config import preset_config
    from workbench.moe.hf_experts import engine_experts_modules
    from workbench.moe.router import balanced_ids

    cfg = preset_config("tiny-mixtral", 2)
    torch.manual_seed(0)
    native = workbench.AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(gate="native"), device="cpu")
    torch.manual_seed(0)
    balanced = workbench.AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(gate="balanced"), device="cpu")
    balanced.load_state_dict(native.state_dict())
    experts_n, experts_b = engine_experts_modules(native)[0][1], engine_experts_modules(balanced)[0][1]
    assert experts_b.plan.gate == "balanced" and experts_n.plan.gate == "native"
    T, K, E = 24, cfg.num_experts_per_tok, cfg.num_local_experts
    x = torch.randn(T, cfg.hidden_size)
    router_ids = torch.zeros(T, K, dtype=torch.long)  # the router put every token on experts 0 (worst case)
    router_ids[:, 1] = 1
    weights = torch.rand(T, K)
    ids = balanced_ids(T, K, E, x.device)
    assert torch.bincount(ids.reshape(-1), minlength=E).tolist() == [T * K // E] * E
    # the router's weights kept as they are, the ids replaced by the balanced assignment
    torch.testing.assert_close(experts_b(x, router_ids, weights), experts_n(x, ids, weights), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(experts_b(x, router_ids, weights), experts_n(x, router_ids, weights), atol=1e-4)
    input_ids = torch.randint(0, cfg.vocab_size, (2, 16))
    out = balanced(input_ids=input_ids, labels=input_ids, output_router_logits=True)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(
        torch.isfinite(p.grad).all() for p in balanced.parameters() if p.grad is not None
    )
    ref = native(input_ids=input_ids, labels=input_ids, output_router_logits=True)
    assert abs(float(out.loss) - float(ref.loss)) > 1e-6


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"attn_implementation": "flash_attention_2"}, "attn_implementation 'flash_attention_2' is not one of"),
        (
            {"attn_implementation": "eager", "sdpa_backend": "cudnn"},
            "sdpa_backend='cudnn' needs attn_implementation='sdpa'",
        ),
        ({"kind": "teacher"}, "variant kind must be 'anchor' or 'engine'"),
        ({"optimizer_in_backward": True}, "optimizer_in_backward=True runs the engine's trainer"),
    ],
)
def test_bad_variant_spec(kwargs, match):
    from workbench.bench.config import VariantSpec

    with pytest.raises(ConfigError, match=match):
        VariantSpec(**{"kind": "anchor", "help": "x", **kwargs})


def _precision_rows(rank, world, out_dir):
    from workbench.bench.runner import run_bench

    cfg = BenchConfig(
        preset="tiny",
        seq=16,
        batch=2,
        warmup=0,
        steps=2,
        dtype="bfloat16",
        precision="fp32_master",
        variants=("anchor", "engine", "engine_bf16", "engine_bf16_sr", "engine_fp32_master"),
        out_dir=out_dir,
        html=False,
        fail_fast=True,
    )
    return run_bench(cfg)


@pytest.mark.slow
def test_precision_variants_reach_the_engine_optimizer(tmp_path):
    (result,) = run_ranks(_precision_rows, 1, str(tmp_path), timeout=180)
    rows = {r["name"]: r for r in result["variants"]}
    assert all(r["status"] == "ok" for r in rows.values())
    # each row's own mode; the plain engine row takes the launch's --precision; the anchor stays torch's bf16 AdamW
    for name, mode in (
        ("engine", "fp32_master"),
        ("engine_bf16", "bf16"),
        ("engine_bf16_sr", "bf16_sr"),
        ("engine_fp32_master", "fp32_master"),
    ):
        assert rows[name]["setup"]["precision"] == mode
    assert rows["engine_bf16_sr"]["setup"]["optimizer"].endswith("precision bf16_sr")
    assert rows["engine_fp32_master"]["setup"]["optimizer"].endswith("precision fp32_master")
    assert rows["anchor"]["setup"]["optimizer"].startswith("torch.optim.AdamW")
    # the same first step (same weights and tokens); the modes differ only in how the update is stored
    first = rows["engine_bf16"]["loss"][0]
    assert all(rows[n]["loss"][0] == pytest.approx(first, abs=1e-6) for n in ("engine_bf16_sr", "engine_fp32_master"))


def _in_backward_rows(rank, world, out_dir):
    from workbench.bench.runner import run_bench

    cfg = BenchConfig(
        preset="tiny", seq=16, batch=2, warmup=0, steps=2,
        variants=(
            "engine", "engine_in_backward", "engine_adamw_per_tensor", "engine_in_backward_ac", "engine_adamw8",
            "engine_in_backward_adamw8",
        ),
        out_dir=out_dir,
        html=False, fail_fast=True,
    )  # fmt: skip
    return run_bench(cfg)


@pytest.mark.slow  # a rank process timing six bench rows: 17 s of the fast loop on 2 busy cores
def test_the_in_backward_row_trains_without_clipping(tmp_path):
    (result,) = run_ranks(_in_backward_rows, 1, str(tmp_path), timeout=180)
    rows = {r["name"]: r for r in result["variants"]}
    assert all(r["status"] == "ok" for r in rows.values())
    inside, after = rows["engine_in_backward"]["setup"], rows["engine"]["setup"]
    assert inside["optimizer_in_backward"] and inside["clip_grad_norm"] is None
    assert not after["optimizer_in_backward"] and after["clip_grad_norm"] == 1.0
    least = rows["engine_in_backward_ac"]["setup"]
    assert least["optimizer_in_backward"] and least["activation_checkpointing"]
    assert not after["activation_checkpointing"]
    assert rows["engine_in_backward_ac"]["loss"] == pytest.approx(rows["engine_in_backward"]["loss"], abs=1e-5)
    from workbench.train.triton_adamw_optimizer import MULTI_TENSOR_NUMEL

    # the per-tensor row differs from the engine row in its AdamW's launches alone (TritonAdamW's; a float32 model
    # on CPU trains with torch's AdamW, which has no such setting: recorded as None)
    per_tensor = rows["engine_adamw_per_tensor"]["setup"]
    if "TritonAdamW" in after["optimizer"]:
        assert (after["adamw_multi_tensor_numel"], per_tensor["adamw_multi_tensor_numel"]) == (MULTI_TENSOR_NUMEL, 0)
    else:
        assert after["adamw_multi_tensor_numel"] is None is per_tensor["adamw_multi_tensor_numel"]
    assert rows["engine_adamw_per_tensor"]["loss"] == pytest.approx(rows["engine"]["loss"], abs=1e-6)
    # the 8-bit rows: the workbench AdamW with one-byte moments, from the same weights and tokens (equal first loss)
    for name, inside_backward in (("engine_adamw8", False), ("engine_in_backward_adamw8", True)):
        setup = rows[name]["setup"]
        assert setup["optimizer_states"] == "8bit" and setup["optimizer"].endswith("8bit moments"), setup
        assert setup["optimizer_in_backward"] is inside_backward
        assert rows[name]["loss"][0] == pytest.approx(rows["engine"]["loss"][0], abs=1e-6)
    assert after["optimizer_states"] == "full" and "moments" not in after["optimizer"]
    # the same weights and tokens: the first loss is before any update
    assert rows["engine_in_backward"]["loss"][0] == pytest.approx(rows["engine"]["loss"][0], abs=1e-6)


def test_precision_flag_and_bad_values():
    from workbench.bench.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--precision", "bf16_sr"])).precision == "bf16_sr"
    assert config_from_args(parser.parse_args([])).precision == "auto"
    with pytest.raises(ConfigError, match="bench precision must be one of"):
        BenchConfig(precision="fp16")
    with pytest.raises(ConfigError, match="variant precision 'fp16'"):
        VariantSpec("engine", "x", precision="fp16")
    with pytest.raises(ConfigError, match="on an engine variant"):
        VariantSpec("anchor", "x", precision="bf16")


# -- the bench times the product's step ---------------------------------------------------------------------


def _bench_then_finetune(rank, world, out_dir):
    """The bench's engine row, then a plain `workbench finetune` of the same model, data and settings."""
    from workbench.bench.anchor import save_init_checkpoint
    from workbench.bench.runner import run_bench
    from workbench.config import DataConfig, ModelConfig, RunConfig, TrainConfig
    from workbench.train.loop import finetune

    cfg = BenchConfig(
        preset="tiny",
        seq=16,
        batch=2,
        warmup=1,
        steps=2,
        rounds=1,
        lr=1e-3,
        variants=("engine", "engine_adamw_torch"),
        out_dir=None,
        html=False,
        fail_fast=True,
    )
    result = run_bench(cfg)
    ckpt = Path(out_dir) / "init"  # the bench's initial checkpoint: the preset's config, seed 0
    save_init_checkpoint(cfg.hf_config(), cfg.seed, torch.device("cpu"), torch.float32, ckpt)
    losses = {}
    for optimizer in ("adamw", "adamw_torch"):
        rc = RunConfig(
            model=ModelConfig(preset=None, path=str(ckpt), dtype="float32"),
            data=DataConfig(kind="synthetic", seq_len=16),
            train=TrainConfig(
                steps=3,
                global_batch_size=2 * world,
                local_batch_size=2,
                lr=1e-3,
                seed=0,
                optimizer=optimizer,
                save_final_checkpoint=False,
            ),
            output_dir=str(Path(out_dir) / "runs"),
        )
        losses[optimizer] = finetune(rc)["losses"]
    return result, losses


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_engine_row_is_the_trainer_step(world, tmp_path):
    """The bench's engine rows train exactly as `workbench finetune` does (clipping, schedule, data, optimizer)."""
    result, losses = run_ranks(_bench_then_finetune, world, str(tmp_path), timeout=180)[0]
    rows = {r["name"]: r for r in result["variants"]}
    assert len(rows["engine"]["loss"]) == 3
    assert rows["engine"]["loss"] == pytest.approx(losses["adamw"], abs=1e-6)
    assert rows["engine_adamw_torch"]["loss"] == pytest.approx(losses["adamw_torch"], abs=1e-6)
    assert result["order"] == ["engine", "engine_adamw_torch"]


def test_alternating_order_and_percentiles():
    import numpy as np

    from workbench.bench.timing import percentile, round_orders, split_steps

    assert round_orders(("a", "b", "c"), 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    assert split_steps(30, 2) == [15, 15] and split_steps(7, 3) == [3, 2, 2] and sum(split_steps(31, 4)) == 31
    values = [0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 1.3]
    for q in (10, 50, 90):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([2.0], 90) == 2.0
    assert BenchConfig(steps=1).rounds == 1 and BenchConfig().rounds == 2 and BenchConfig().steps >= 30


# -- anchor_liger ---------------------------------------------------------------------------------------------


def test_liger_refusals(monkeypatch):
    from workbench.bench.liger import liger_refusal
    from workbench.config import preset_config

    cfg = preset_config("tiny")
    other = preset_config("tiny-gpt-oss")
    other.model_type = "not_a_family"
    if importlib.util.find_spec("liger_kernel") is not None:
        assert liger_refusal(cfg) is None
        assert "no kernels for model_type 'not_a_family'" in liger_refusal(other)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # as if not installed
    from workbench.errors import INSTALL_HINT

    assert INSTALL_HINT["liger"] in liger_refusal(cfg)  # the one liger hint: the package's [gpu] extra


def test_liger_patch_stays_inside_its_row():
    """The Liger anchor's kernels reach its model, and Transformers is as before once the row ends
    (liger-kernel also patches the family's module: RoPE, classes, which later rows would inherit)."""
    pytest.importorskip("liger_kernel.transformers.monkey_patch")
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mod

    from workbench.bench.liger import liger_patched
    from workbench.config import preset_config

    before = dict(vars(mod))
    model = transformers.AutoModelForCausalLM.from_config(preset_config("tiny"))
    with liger_patched(model) as applied:
        assert applied["liger_apply"] == "apply_liger_kernel_to_qwen3_moe"
        assert applied["liger_kernels"]["fused_linear_cross_entropy"] is True
        assert mod.apply_rotary_pos_emb is not before["apply_rotary_pos_emb"]  # on while the row trains
        assert type(model.model.norm).__name__ == "Qwen3MoeRMSNorm" and model.model.norm._get_name() == "LigerRMSNorm"
        assert "forward" in vars(model)  # the fused linear CE forward, on this instance only
    assert all(vars(mod)[k] is v for k, v in before.items())
    fresh = transformers.AutoModelForCausalLM.from_config(preset_config("tiny"))
    assert type(fresh.model.norm) is before["Qwen3MoeRMSNorm"] and "forward" not in vars(fresh)
    assert type(fresh.model.layers[0].mlp.experts) is before["Qwen3MoeExperts"]


def test_engine_adamw_torch_and_anchor_liger_specs():
    from workbench.bench.config import VARIANTS

    assert VARIANTS["engine_adamw_torch"].optimizer == "adamw_torch" and VARIANTS["engine_adamw_torch"].kind == "engine"
    assert VARIANTS["anchor_liger"].liger and VARIANTS["anchor_liger"].needs_cuda
    with pytest.raises(ConfigError, match="on an engine variant"):
        VariantSpec("anchor", "x", optimizer="adamw_torch")
    with pytest.raises(ConfigError, match="an anchor variant only"):
        VariantSpec("engine", "x", liger=True)


def _live_after_bench(rank, world):
    import gc

    from workbench.bench.runner import run_bench

    cfg = BenchConfig(
        preset="tiny",
        seq=16,
        batch=2,
        warmup=1,
        steps=2,
        variants=("anchor", "engine", "engine_adamw_torch"),
        out_dir=None,
        html=False,
        fail_fast=True,
    )
    run_bench(cfg)
    gc.collect()
    live = [
        type(o).__name__
        for o in gc.get_objects()
        if isinstance(o, (torch.nn.Module, torch.optim.Optimizer))
        and type(o).__name__.endswith(("ForCausalLM", "AdamW"))
    ]
    return live


@pytest.mark.slow
def test_every_round_frees_its_model_and_optimizer():
    """A variant's Trainer, model and optimizer are gone when the next one builds (GPU memory between rows)."""
    assert run_ranks(_live_after_bench, 1, timeout=120) == [[]]
