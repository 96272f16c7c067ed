"""The decoder stack replayed as CUDA graphs (train.cuda_graphs, workbench/train/stack_graphs.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from tiny_models import trained

from workbench import RunConfig
from workbench.config import DataConfig, LoraConfig
from workbench.config_checks import ConfigError
from workbench.models.engine_state import engine_state
from workbench.train.loop import Trainer

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def _rc(tmp_path, run_id, device, **overrides):
    base = dict(
        output_dir=str(tmp_path / "runs"),
        run_id=run_id,
        data=DataConfig(kind="synthetic", seq_len=64),
        train__steps=4,
        train__global_batch_size=2,
        train__local_batch_size=2,
        train__save_final_checkpoint=False,
        train__lr=1e-3,
        train__gc_every=0,
        model__device=device,
        model__dtype="bfloat16" if device == "cuda" else "float32",
    )
    base.update(overrides)
    return RunConfig.demo(**base)


def test_bad_settings_are_refused_before_any_model_is_built(tmp_path):
    with pytest.raises(ConfigError, match="activation checkpointing"):
        _rc(tmp_path, "ac", "cpu", train__cuda_graphs=True, train__activation_checkpointing=True)
    with pytest.raises(ConfigError, match=r"train\.cuda_graphs must be true or false"):
        _rc(tmp_path, "bad", "cpu", train__cuda_graphs="yes")
    # every reason at once: the device, gradient accumulation, the experts' backend
    rc = _rc(tmp_path, "cpu", "cpu", train__cuda_graphs=True, train__local_batch_size=1, backend__expert_recompute=True)
    with pytest.raises(ConfigError, match="cannot run here") as refused:
        Trainer(rc)
    for reason in ("this run's device is cpu", "2 micro-batches per step", "expert_recompute are not capturable"):
        assert reason in str(refused.value), (reason, str(refused.value))


def test_installed_graphs_leave_names_and_the_eager_forward_alone(tmp_path):
    # On the CPU (no capture possible) the swapped layers run their own forward: same keys, same logits.
    from workbench.train.stack_graphs import StackGraphs, install_stack_graphs

    trainer = Trainer(_rc(tmp_path, "plain", "cpu"))
    trainer.setup()
    model = trainer.model
    keys = list(model.state_dict())
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    graphs = install_stack_graphs(model)
    assert isinstance(graphs, StackGraphs) and list(model.state_dict()) == keys
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert torch.equal(got, want)
    model(input_ids=ids, labels=ids).loss.backward()  # a KV cache (use_cache defaults to the config's true)
    # a training forward on the CPU: eager, with its reason counted
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert graphs.replays == 0
    cache = "cache set" if "cache set" in graphs.eager_forwards else "past_key_values set"  # transformers 5.17's name
    assert graphs.eager_forwards == {cache: 1, "hidden states not on a CUDA device": 1}


@pytest.mark.parametrize(
    "preset,lora,packed",
    [("tiny", False, True), ("tiny", True, False), ("tiny-deepseek-v3", False, False), ("tiny-olmoe", False, True)],
)
def test_the_bookkeeping_around_the_capture_on_the_cpu(tmp_path, monkeypatch, preset, lora, packed):
    # CUDA graphs need a GPU: here the captured callable is the eager stack itself, so the check pass, the hand-on
    # of the later layers, the router logits (the aux loss) and the packed documents' mask as an input are what is
    # tested; test_replayed_steps_equal_eager_steps replays real graphs on a GPU
    from workbench.train import stack_graphs as sg

    why = sg.StackGraphs._why_eager
    monkeypatch.setattr(sg, "graph_stack", lambda stack, sample: (stack, 0))
    monkeypatch.setattr(
        sg.StackGraphs,
        "_why_eager",
        lambda self, *a, **k: {"hidden states not on a CUDA device": None}.get(why(self, *a, **k), why(self, *a, **k)),
    )
    extra = {"model__preset": preset}
    if lora:
        extra["lora"] = LoraConfig(rank=8, alpha=16, targets=("attention", "experts"))
    if packed:  # the shipped SFT rows packed: a [B, 1, S, S] mask per step
        extra["data"] = DataConfig(kind="jsonl", seq_len=64, pack=True)
    _, eager_records = trained(_rc(tmp_path, "eager", "cpu", **extra), 4)
    trainer = Trainer(_rc(tmp_path, "graphed", "cpu", **extra))
    trainer.setup()
    graphs = sg.install_stack_graphs(trainer.model)
    for step in range(1, 5):
        trainer.train_step(step)
    records = trainer.collect(wait=True)
    assert graphs.ready and graphs.replays == 3 and not graphs.eager_forwards and graphs.refused is None
    # the mask is an input exactly where the data has one; the position ids always are
    named = dict(graphs.signature[3:])
    assert (named["attention_mask"] is not None) == packed and named["position_ids"] is not None
    assert [r["loss"] for r in records] == [r["loss"] for r in eager_records]
    assert [r["expert_load"] for r in records] == [r["expert_load"] for r in eager_records]


@CUDA
@pytest.mark.parametrize(
    "preset,lora,packed",
    [
        ("tiny", False, False),
        ("tiny", True, False),
        ("tiny", True, True),
        ("tiny-deepseek-v3", False, False),
        ("tiny-mixtral", False, False),
        ("tiny-olmoe", False, False),
    ],
)
def test_replayed_steps_equal_eager_steps(tmp_path, preset, lora, packed, caplog):
    extra = {"model__preset": preset}
    if packed:
        extra["data"] = DataConfig(kind="jsonl", seq_len=64, pack=True)
    if lora:
        extra["lora"] = LoraConfig(rank=8, alpha=16, targets=("attention", "experts"))
    eager, eager_records = trained(_rc(tmp_path, "eager", "cuda", **extra), 4)
    with caplog.at_level(logging.INFO, logger="workbench"):
        graphed, graphed_records = trained(_rc(tmp_path, "graphed", "cuda", train__cuda_graphs=True, **extra), 4)
    graphs = engine_state(graphed.model).stack_graphs
    # step 1 runs eagerly and checks every layer's inputs; steps 2-4 replay
    assert graphs.ready and graphs.replays == 3 and not graphs.eager_forwards, graphs.eager_forwards
    assert any("captured" in r.getMessage() for r in caplog.records)
    # the same kernels in the same order: equal up to what a capture may change (cuBLAS workspaces)
    for a, b in zip(eager_records, graphed_records, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=2e-3), (a["loss"], b["loss"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2)
        if a.get("expert_load") is not None:
            assert b["expert_load"] == a["expert_load"]  # the warm-up passes are not counted
    # the steps trained (random tokens: the loss sits at log(vocab), so the weights, not the loss, show it)
    fresh = dict(trained(_rc(tmp_path, "fresh", "cuda", **extra), 0)[0].model.named_parameters())
    moved = max(
        (p.float() - fresh[n].float()).abs().max().item() for n, p in eager.model.named_parameters() if p.requires_grad
    )
    assert moved > 1e-4, moved
    # the replays' activations live in the capture's pool, which the allocator counts as free: added back
    assert graphs.pool_hidden_bytes > 0 and graphed_records[-1]["mem_kind"] == "cuda_allocated+graph_pool"
    assert graphed_records[-1]["mem_peak_gib"] >= 0.9 * eager_records[-1]["mem_peak_gib"]
    params_a = dict(eager.model.named_parameters())
    for name, b in graphed.model.named_parameters():
        if b.requires_grad:
            torch.testing.assert_close(b.float(), params_a[name].float(), atol=2e-2, rtol=2e-2, msg=name)
    # eval and another shape run eagerly (and give the eager model's numbers)
    ids = torch.randint(0, graphed.model.config.vocab_size, (1, 32), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(graphed.model(input_ids=ids).logits, eager.model(input_ids=ids).logits)
    graphed.model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert any(why.startswith("other inputs than the captured ones (hidden (1, 32, ") for why in graphs.eager_forwards)


@CUDA
def test_a_layer_with_other_inputs_than_layer_0_is_never_replayed(tmp_path):
    def other_embeddings(module, args, kwargs):  # layer 1 gets its own (equal) position embeddings tuple
        kwargs["position_embeddings"] = tuple(t.clone() for t in kwargs["position_embeddings"])
        return args, kwargs

    trainer = Trainer(_rc(tmp_path, "refused", "cuda", train__cuda_graphs=True))
    trainer.setup()
    graphs = engine_state(trainer.model).stack_graphs
    handle = graphs.layers[1].register_forward_pre_hook(other_embeddings, with_kwargs=True)
    for step in (1, 2):
        trainer.train_step(step)
    assert graphs.replays == 0 and graphs.graphed is None and "decoder layer 1" in graphs.refused
    handle.remove()
    # once captured, a layer called with other inputs than the replay used stops the run
    other = Trainer(_rc(tmp_path, "stops", "cuda", train__cuda_graphs=True))
    other.setup()
    graphs = engine_state(other.model).stack_graphs
    for step in (1, 2):
        other.train_step(step)
    assert graphs.replays == 1
    graphs.layers[1].register_forward_pre_hook(other_embeddings, with_kwargs=True)
    with pytest.raises(RuntimeError, match="decoder layer 1 was called with other inputs than layer 0"):
        other.train_step(3)


def _refusal_on(rank, world, out_dir):
    try:
        Trainer(_rc(Path(out_dir), f"ranks-{rank}", "cpu", train__cuda_graphs=True, train__local_batch_size=1))
    except ConfigError as err:
        return str(err)
    return None


@pytest.mark.slow
def test_several_ranks_are_refused(tmp_path):
    from launch_utils import run_ranks

    for message in run_ranks(_refusal_on, 2, str(tmp_path), timeout=120):
        assert message is not None and "this run has 2" in message and "device is cpu" in message, message
