"""LoRA: the config section, the engine's adapters (grouped low-rank experts), frozen base, training."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import pytest
import torch
import transformers
from generic_families import tiny_config
from torch.func import functional_call

from workbench import AutoModelForCausalLM, BackendConfig
from workbench.cli_common import config_overrides
from workbench.config import ConfigError, LoraConfig, RunConfig
from workbench.models.lora import adapter_parameters
from workbench.moe.hf_experts import engine_experts_modules
from workbench.moe.lora_experts import adapter_names, expert_delta

# Non-square widths (hidden 32, expert intermediate 8 -> gate_up 16): a transposed adapter cannot pass.
WIDTHS = {
    "qwen3_moe": dict(moe_intermediate_size=8),
    "deepseek_v3": dict(moe_intermediate_size=8),
    "mixtral": dict(intermediate_size=8),
    "gpt_oss": dict(intermediate_size=8),
}
FAMILIES = tuple(WIDTHS)


def _config(family: str):
    return tiny_config(family, **WIDTHS[family])


def randomize_adapters(model, seed: int = 1, std: float = 0.3) -> None:
    """Fresh non-zero adapters (B starts at zero: a test of the update needs B != 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * std)


# ------------------------------------------------------------------------------------------ config


def test_lora_section_yaml_set_and_defaults(tmp_path):
    assert RunConfig.demo().lora is None  # off by default
    args = argparse.Namespace(set=["lora.rank=8", "lora.targets=[attention, experts, shared_experts]"])
    rc = RunConfig.demo().with_overrides(config_overrides(args))
    assert rc.lora == LoraConfig(rank=8, targets=("attention", "experts", "shared_experts"))
    assert rc.lora.scaling == 32.0 / 8
    assert RunConfig.from_yaml(rc.to_yaml(tmp_path / "c.yaml")) == rc
    assert RunConfig.from_yaml("lora:\n  rank: 4\n  alpha: 8\n").lora == LoraConfig(rank=4, alpha=8.0)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"lora.rank": 0}, "lora.rank must be an integer >= 1"),
        ({"lora.rank": 2.5}, "lora.rank"),
        ({"lora.alpha": 0}, "lora.alpha must be > 0"),
        ({"lora.dropout": 1.0}, "lora.dropout must be < 1"),
        ({"lora.targets": ["attention", "mlp"]}, "lora.targets ['mlp'] unknown"),
        ({"lora.targets": []}, "non-empty"),
        ({"lora.rnak": 4}, "unknown key(s) ['rnak'] in lora"),
    ],
)
def test_bad_lora_settings_are_refused(change, needle):
    with pytest.raises(ConfigError) as err:
        RunConfig.demo().with_overrides(change)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "family, target", [("qwen3_moe", "shared_experts"), ("qwen3_moe", "dense_mlp"), ("mixtral", "router")]
)
def test_a_target_the_family_lacks_is_refused(family, target):
    with pytest.raises(ConfigError, match=f"lora.targets \\['{target}'\\] match nothing in model_type '{family}'"):
        AutoModelForCausalLM.from_config(_config(family), lora=LoraConfig(targets=("attention", target)))


def test_trainer_refuses_a_missing_target_before_the_run_directory(tmp_path):
    from workbench.train.loop import Trainer

    rc = RunConfig.demo(output_dir=str(tmp_path / "runs"), train__steps=1).with_overrides({"lora.targets": ["router"]})
    with pytest.raises(ConfigError, match="router"):
        Trainer(rc)
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------ engine


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_with_zero_b_equals_the_base_model(family, tmp_path):
    cfg = _config(family)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, device="cpu")
    lora = AutoModelForCausalLM.from_pretrained(
        tmp_path, device="cpu", lora=LoraConfig(rank=4, targets=("attention", "experts"))
    )
    assert len(adapter_parameters(lora)) > 0 and not adapter_parameters(plain)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(lora(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-6)


def _reference_experts(hf_experts, engine, hidden, top_k_index, top_k_weights):
    """Transformers' own per-expert loop (eager) on W + scaling * A @ B, built from the engine's adapters."""
    params = {}
    for weight in engine.plan.lora.weights:
        name_a, name_b = adapter_names(weight)
        params[weight] = getattr(engine, weight) + expert_delta(
            engine, weight, getattr(engine, name_a), getattr(engine, name_b)
        )
    return functional_call(hf_experts, params, (hidden, top_k_index, top_k_weights))


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_lora_experts_match_a_per_expert_reference(family, backend):
    cfg = _config(family)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    vanilla = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    hf_experts = copy.deepcopy([m for n, m in vanilla.named_modules() if n.endswith("mlp.experts")][-1])
    model = AutoModelForCausalLM.from_config(
        cfg, backend=BackendConfig(experts=backend), seed=0, lora=LoraConfig(rank=4, alpha=6, targets=("experts",))
    )
    engine = engine_experts_modules(model)[-1][1]
    with torch.no_grad():  # the same base weights in both
        for name in engine.plan.layout.param_names():
            getattr(hf_experts, name).copy_(getattr(engine, name))
    randomize_adapters(model)
    tokens, k = 11, cfg.num_experts_per_tok
    hidden = torch.randn(tokens, cfg.hidden_size, requires_grad=True)
    top_k_index = torch.stack([torch.randperm(4)[:k] for _ in range(tokens)])
    top_k_index[0] = torch.tensor([3, 1])[:k]  # expert 0 may get no token: an empty group must work
    top_k_weights = torch.rand(tokens, k)
    out = engine(hidden, top_k_index, top_k_weights)
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref = _reference_experts(hf_experts, engine, ref_hidden, top_k_index, top_k_weights)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    adapters = [p for n, p in engine.named_parameters() if "_lora_" in n]
    got = torch.autograd.grad(out, [hidden, *adapters], grad)
    want = torch.autograd.grad(ref, [ref_hidden, *adapters], grad)
    for g, w in zip(got, want):  # adapter grads sum ~10 rows in another order than the reference's
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_only_adapters_get_gradients_and_optimizer_state():
    from workbench.config import TrainConfig
    from workbench.train.optim import build_optimizer

    cfg = _config("deepseek_v3")
    model = AutoModelForCausalLM.from_config(
        cfg, seed=0, lora=LoraConfig(rank=4, targets=("attention", "experts", "shared_experts", "dense_mlp"))
    )
    randomize_adapters(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    adapters = dict(adapter_parameters(model))
    names = {n.split(".lora_")[0].split("_lora_")[0] for n in adapters}
    # MLA's projections, the shared experts, the dense layer's MLP and both fused expert weights
    for needle in (
        "self_attn.q_a_proj",
        "self_attn.kv_b_proj",
        "mlp.shared_experts.down_proj",
        "layers.0.mlp.gate_proj",
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
    ):
        assert any(needle in n for n in names), needle
    for name, param in model.named_parameters():
        if name in adapters:
            assert param.requires_grad and param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert not param.requires_grad and param.grad is None, name
    opt = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in adapters.values()}


def test_adapters_do_not_depend_on_the_seeded_build_path():
    # A is seeded per (seed, module[, expert]): the same adapters however the model is built or split.
    cfg = _config("qwen3_moe")
    a = AutoModelForCausalLM.from_config(cfg, seed=3, lora=LoraConfig(rank=4))
    torch.manual_seed(99)
    b = AutoModelForCausalLM.from_config(cfg, seed=3, lora=LoraConfig(rank=4))
    c = AutoModelForCausalLM.from_config(cfg, seed=4, lora=LoraConfig(rank=4))
    pa, pb, pc = (dict(adapter_parameters(m)) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(
        pa["model.layers.0.self_attn.q_proj.lora_A.weight"], pc["model.layers.0.self_attn.q_proj.lora_A.weight"]
    )
    assert all(not p.any() for k, p in pa.items() if "lora_B" in k)  # B starts at zero


@pytest.mark.slow
def test_finetune_with_lora_trains_only_the_adapters(tmp_path):
    from workbench.train.loop import finetune

    rc = RunConfig.demo(
        output_dir=str(tmp_path),
        train__steps=8,
        train__lr=1e-2,
        train__global_batch_size=4,
        train__local_batch_size=4,
        train__export_hf=True,
    ).with_overrides({"lora.rank": 4})
    out = finetune(rc)
    losses = out["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    # export_hf of a LoRA run: the merged model (vanilla Transformers loads it) and the adapter beside it
    hf = Path(out["run_dir"]) / "hf"
    assert (hf / "adapter" / "adapter_config.json").is_file()
    merged = transformers.AutoModelForCausalLM.from_pretrained(hf)
    assert merged.config.model_type == "qwen3_moe"


def lora_resume_config(tmp_path, run_id: str, **kw) -> RunConfig:
    """The LoRA resume tests' run (one process or a 2-rank mesh): 5 steps of the demo with rank-4 adapters."""
    return RunConfig.demo(
        output_dir=str(tmp_path / "runs"),
        run_id=run_id,
        data__seq_len=64,
        train__steps=5,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__warmup_steps=1,
        train__lr=1e-2,
        **kw,
    ).with_overrides({"lora.rank": 4})


@pytest.mark.slow
def test_lora_checkpoint_holds_only_adapters_and_resumes_exactly(tmp_path):
    from workbench.train.checkpoint import list_checkpoints, read_dcp_metadata
    from workbench.train.loop import finetune

    def rc(run_id, **kw):
        return lora_resume_config(tmp_path, run_id, **kw)

    full = finetune(rc("full", train__checkpoint_every=3))
    ckpt = list_checkpoints(tmp_path / "runs" / "full" / "checkpoints")[0]
    keys = set(read_dcp_metadata(ckpt).state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all("lora_" in k for k in model_keys), sorted(model_keys)[:5]  # no frozen base tensor
    assert any(k.startswith("optim.state.") and "lora_" in k for k in keys)
    resumed = finetune(rc("resumed", train__resume_from=str(ckpt)))
    assert resumed["losses"] == full["losses"][3:]  # bit for bit: adapters, their Adam moments, lr, data
    # another alpha (the adapters' scale) fits every tensor's shape: refused unless the run accepts it
    from workbench.train.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"lora\.alpha: checkpoint 32(\.0)? vs this run 2\.0"):
        finetune(rc("alpha", train__resume_from=str(ckpt)).with_overrides({"lora.alpha": 2.0}))
    accepted = rc("alpha2", train__resume_from=str(ckpt), train__resume_allow_changes=["lora.alpha"])
    assert finetune(accepted.with_overrides({"lora.alpha": 2.0}))["state"] == "completed"


def test_memory_estimate_counts_the_adapters_the_engine_builds():
    from workbench.models.lora_check import adapter_counts
    from workbench.ui.memory import estimate_memory

    cfg = _config("deepseek_v3")
    lora = LoraConfig(rank=4, targets=("attention", "experts", "shared_experts", "dense_mlp"))
    model = AutoModelForCausalLM.from_config(cfg, seed=0, lora=lora)
    adapters = sum(p.numel() for _, p in adapter_parameters(model))
    base = sum(p.numel() for p in model.parameters()) - adapters
    dense, experts, _ = adapter_counts(cfg, lora)
    assert dense + experts == adapters
    full = estimate_memory(cfg, 1, 1, seq_len=64, local_batch=1, dtype="float32")
    with_lora = estimate_memory(cfg, 1, 1, seq_len=64, local_batch=1, dtype="float32", lora=lora)
    # the frozen base keeps only its float32 weights; the adapters param + grad + two AdamW moments
    assert full.sharded_state == pytest.approx(base * 16, rel=1e-6)
    assert with_lora.sharded_state == pytest.approx(base * 4 + adapters * 16, rel=1e-6)
    assert with_lora.activations > full.activations  # each adapter's x @ A


def test_dropout_acts_on_adapter_inputs_in_training_only():
    cfg = _config("qwen3_moe")
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    models = [AutoModelForCausalLM.from_config(cfg, seed=0, lora=LoraConfig(rank=4, dropout=p)) for p in (0.0, 0.5)]
    for m in models:
        randomize_adapters(m)
        m.eval()
    with torch.no_grad():
        torch.testing.assert_close(models[1](ids).logits, models[0](ids).logits, rtol=1e-5, atol=1e-6)
        models[1].train()
        assert (models[1](ids).logits - models[0](ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("trainable", ["adapters", "adapters_and_input", "all"])
def test_lora_linear_function_equals_autograd_over_the_plain_ops(bias, trainable):
    # The engine's LoRA linear (3 GEMMs forward, <= 5 backward, no gradient for frozen weights) against
    # autograd over x W^T + b + s (x A^T) B^T, float64, fresh random values
    from workbench.models.lora import _LoraLinearFunction

    g = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(2, 5, 7, generator=g), torch.randn(6, 7, generator=g), torch.randn(6, generator=g)
    a, lb = torch.randn(3, 7, generator=g), torch.randn(6, 3, generator=g)
    leaves = [t.double() for t in (x, w, b, a, lb)]
    needs = {"adapters": (0, 0, 0, 1, 1), "adapters_and_input": (1, 0, 0, 1, 1), "all": (1, 1, 1, 1, 1)}[trainable]
    for t, need in zip(leaves, needs):
        t.requires_grad_(bool(need))
    x, w, b, a, lb = leaves
    b = b if bias else None
    y = _LoraLinearFunction.apply(x, w, b, a, lb, 0.7)
    ref = torch.nn.functional.linear(x, w, b) + 0.7 * (x @ a.t()) @ lb.t()
    torch.testing.assert_close(y, ref)
    wanted = [t for t in (x, w, b, a, lb) if t is not None and t.requires_grad]
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(y, wanted, dy), torch.autograd.grad(ref, wanted, dy), strict=True):
        torch.testing.assert_close(got, want)
