"""The generic engine path's training features: activation checkpointing, expert load, the router-bias update."""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import tiny_config
from launch_utils import run_ranks

from workbench import BackendConfig
from workbench.config import ConfigError, DataConfig, ModelConfig, RunConfig, TrainConfig
from workbench.models.auto import AutoModelForCausalLM
from workbench.moe.bias_update import router_biases, update_router_biases
from workbench.moe.dispatch import NO_CAPS
from workbench.moe.hf_experts import engine_experts_modules
from workbench.train.activation_checkpoint import apply_activation_checkpointing
from workbench.train.world_checks import check_world

EPS = torch.finfo(torch.float32).eps


def _config(family: str, **overrides):
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    return tiny_config(family, **overrides)


def _count_expert_calls(model) -> list[int]:
    """How often each experts module ran (forward and any recomputation): a forward hook, no mock."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    for _, m in engine_experts_modules(model):
        m.register_forward_hook(hook)
    return calls


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-3)


# -- activation checkpointing ----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_activation_checkpointing_replays_each_layer_with_equal_gradients(family):
    cfg = _config(family)
    models = [AutoModelForCausalLM.from_config(cfg, device="cpu", dtype=torch.float32) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    assert apply_activation_checkpointing(models[1]) == cfg.num_hidden_layers
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    calls = []
    for model in models:
        model.train()
        calls.append(_count_expert_calls(model))
        model(input_ids=ids, labels=ids).loss.backward()
    moe_layers = len(engine_experts_modules(models[0]))
    assert calls[0][0] == moe_layers and calls[1][0] == 2 * moe_layers  # the backward ran each layer again
    grads = dict(models[1].named_parameters())  # the same names: no wrapper module in between
    for name, p in models[0].named_parameters():
        assert _rel_diff(grads[name].grad, p.grad) <= 64 * EPS, name


def test_partial_activation_checkpointing_replays_only_the_first_layers():
    """train.activation_checkpointing_layers=N: the first N decoder layers run again in the backward, the rest do
    not, and the gradients are those of the model without checkpointing."""
    cfg = _config("mixtral", num_hidden_layers=3)
    models = [AutoModelForCausalLM.from_config(cfg, device="cpu", dtype=torch.float32) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    assert apply_activation_checkpointing(models[1], 1) == 1
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    calls = []
    for model in models:
        model.train()
        calls.append(_count_expert_calls(model))
        model(input_ids=ids, labels=ids).loss.backward()
    assert calls[0][0] == 3 and calls[1][0] == 4  # three layers, one of them again
    grads = dict(models[1].named_parameters())
    for name, p in models[0].named_parameters():
        assert _rel_diff(grads[name].grad, p.grad) <= 64 * EPS, name
    with pytest.raises(ValueError, match=r"activation_checkpointing_layers=4 exceeds the model's 3 decoder layers"):
        apply_activation_checkpointing(AutoModelForCausalLM.from_config(cfg, device="cpu"), 4)


def test_activation_checkpointing_layers_are_checked_before_the_build():
    with pytest.raises(ConfigError, match=r"set train.activation_checkpointing to true, or drop the count"):
        TrainConfig(activation_checkpointing_layers=2)
    with pytest.raises(ConfigError, match=r"activation_checkpointing_layers"):
        TrainConfig(activation_checkpointing=True, activation_checkpointing_layers=0)
    rc = RunConfig(
        model=ModelConfig(preset="tiny"),
        train=TrainConfig(activation_checkpointing=True, activation_checkpointing_layers=99),
    )
    with pytest.raises(ConfigError, match=r"=99 exceeds the model's \d+ decoder layers: set it to at most \d+"):
        check_world(rc, 1, rc.model.hf_config(), torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine sets an SDPA preference only on CUDA")
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_activation_checkpointing_on_cuda_replays_with_the_same_attention_kernel(family):
    # Found on an H200: the replay outside the forward's sdpa_kernel preference picked flash instead of
    # cuDNN and torch's checkpoint refused the differently shaped saved tensors.
    cfg = _config(family)
    models = [
        AutoModelForCausalLM.from_config(cfg, device="cuda", dtype=torch.bfloat16, seed=0).cuda() for _ in range(2)
    ]
    models[1].load_state_dict(models[0].state_dict())
    apply_activation_checkpointing(models[1])
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    for model in models:
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
    grads = dict(models[1].named_parameters())
    for name, p in models[0].named_parameters():
        assert _rel_diff(grads[name].grad.float(), p.grad.float()) <= 2e-2, name


def _ac_worker(rank, world, family):
    from torch.distributed.tensor import DTensor

    from workbench.parallel.mesh import MeshConfig

    cfg = _config(family)
    ids = torch.randint(0, cfg.vocab_size, (2 * world, 10), generator=torch.Generator().manual_seed(4))
    mine = ids[rank * 2 : (rank + 1) * 2]  # different tokens per rank
    grads, calls = [], []
    for checkpointed in (False, True):
        model = AutoModelForCausalLM.from_config(
            cfg, mesh=MeshConfig(dp=world, ep=world), seed=3, backend=BackendConfig(experts="grouped_mm")
        )
        model.train()
        if checkpointed:
            apply_activation_checkpointing(model)  # after fully_shard: the trainer's order
        calls.append(_count_expert_calls(model))
        model(input_ids=mine, labels=mine, num_items_in_batch=torch.tensor(ids[:, 1:].numel())).loss.backward()
        grads.append(
            {
                n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for n, p in model.named_parameters()
            }
        )
    worst = max(_rel_diff(grads[1][n], grads[0][n]) for n in grads[0])
    return {"worst": worst, "calls": [c[0] for c in calls], "moe_layers": len(engine_experts_modules(model))}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_activation_checkpointing_under_dp2_ep2_keeps_gradients(family):
    _config(family)
    for r in run_ranks(_ac_worker, 2, family, timeout=300):
        # the experts (and their all-to-alls) ran again in backward on every rank, gradients unchanged
        assert r["calls"] == [r["moe_layers"], 2 * r["moe_layers"]], r
        assert r["worst"] <= 64 * EPS, r


def _trainer_ac_worker(rank, world, ckpt, out):
    from workbench.train.loop import Trainer

    trainer = Trainer(_rc(ckpt, out, train__activation_checkpointing=True))
    trainer.setup()
    calls = _count_expert_calls(trainer.model)
    trainer.train_step(1)
    return {
        "calls": calls[0],
        "moe_layers": len(engine_experts_modules(trainer.model)),
        "accum": trainer.accum,
        "mesh": str(trainer.mesh),
    }


@pytest.mark.slow
def test_trainer_checkpoints_every_layer_under_fsdp2_and_ep(tmp_path):
    """Transformers' gradient_checkpointing_enable after fully_shard left Mixtral's layers unrecomputed."""
    ckpt = _saved("mixtral", tmp_path / "m")
    for r in run_ranks(_trainer_ac_worker, 2, ckpt, str(tmp_path / "runs"), timeout=300):
        assert r["mesh"] == "MeshConfig(dp=2, ep=2, cp=1, tp=1)"
        assert r["calls"] == 2 * r["moe_layers"] * r["accum"], r


# -- the trainer: expert load, router-bias update ----------------------------------------------------------


def _saved(family: str, path, **overrides) -> str:
    from workbench.config import TINY_VOCAB_SIZE

    cfg = _config(family, vocab_size=TINY_VOCAB_SIZE, **overrides)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


class Records:
    def __init__(self):
        self.items = []

    def on_step(self, record):
        self.items.append(record)


def _rc(ckpt: str, out: str, **overrides) -> RunConfig:
    # device="cpu", float32: the same run on a GPU machine as here
    base = dict(
        train__steps=3,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__lr=1e-2,
        train__warmup_steps=0,
        train__save_final_checkpoint=False,
    )
    return RunConfig.demo(
        model=ModelConfig(preset=None, path=ckpt, dtype="float32", device="cpu"),
        data=DataConfig(kind="synthetic", seq_len=16),
        output_dir=out,
        **{**base, **overrides},
    )


def _fit(rc: RunConfig):
    from workbench.train.loop import Trainer

    records = Records()
    trainer = Trainer(rc, callbacks=[records])
    trainer.setup()
    result = trainer.fit()
    return trainer, result, records.items


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,ac",
    [("mixtral", False), ("deepseek_v3", True), ("gpt_oss", False), ("qwen2_moe", True), ("glm4_moe", False)],
)
def test_expert_load_record_counts_every_routed_token_per_layer(family, ac, tmp_path):
    ckpt = _saved(family, tmp_path / "m")
    trainer, _, records = _fit(_rc(ckpt, str(tmp_path / "runs"), train__activation_checkpointing=ac))
    cfg = trainer.hf_config
    layers = len(engine_experts_modules(trainer.model))
    for r in records:
        load = torch.tensor(r["expert_load"])
        assert load.shape == (layers, engine_experts_modules(trainer.model)[0][1].num_experts), load.shape
        # every (token, slot) once: not twice under activation checkpointing, not from router logits
        assert load.sum(1).tolist() == [r["tokens"] * cfg.num_experts_per_tok] * layers, (r["step"], load)


def test_expert_load_is_the_routing_the_experts_ran(tmp_path):
    """DeepSeek-V3 picks experts by score + bias within the best groups: top-k of the raw logits is not its routing."""
    from workbench.config import TINY_VOCAB_SIZE

    cfg = _config("deepseek_v3", vocab_size=TINY_VOCAB_SIZE)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    for bias in router_biases(model):
        bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # group 1 (experts 2, 3) always wins, top-2 = both
    model.save_pretrained(tmp_path / "m")
    _, _, records = _fit(_rc(str(tmp_path / "m"), str(tmp_path / "runs"), train__steps=1, train__lr=0.0))
    tokens = records[0]["tokens"]
    assert records[0]["expert_load"] == [[0, 0, tokens, tokens]]


def test_router_bias_update_rate_is_validated_and_refused_without_a_bias(tmp_path):
    for bad in (-0.1, float("nan"), "0.1", True):
        with pytest.raises(ConfigError, match=r"train\.router_bias_update_rate"):
            TrainConfig(router_bias_update_rate=bad)
    from workbench.train.loop import Trainer

    ckpt = _saved("mixtral", tmp_path / "m")
    with pytest.raises(
        ConfigError,
        match=r"router_bias_update_rate > 0 needs .*'mixtral' has none.*set "
        r"train.router_bias_update_rate to 0",
    ):
        Trainer(_rc(ckpt, str(tmp_path / "runs"), train__router_bias_update_rate=0.01))
    assert not (tmp_path / "runs").exists()  # refused before the run directory


def test_router_bias_update_refuses_a_model_without_the_engines_expert_counts(tmp_path):
    """A prebuilt vanilla DeepSeek-V3 has the bias but not the engine's counters: the update cannot see the load."""
    import inspect

    from workbench.train.loop import Trainer

    if "model" not in inspect.signature(Trainer.setup).parameters:
        pytest.skip("Trainer.setup takes no prebuilt model in this tree (TRAINER_API)")
    ckpt = _saved("deepseek_v3", tmp_path / "m")
    trainer = Trainer(_rc(ckpt, str(tmp_path / "runs"), train__router_bias_update_rate=0.01))
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(ckpt)  # Transformers' experts: no counters
    assert router_biases(vanilla) and not engine_experts_modules(vanilla)
    with pytest.raises(
        ConfigError,
        match=r"router_bias_update_rate needs the engine's expert counts.*'deepseek_v3'"
        r".*set train.router_bias_update_rate to 0",
    ):
        trainer.setup(model=vanilla)


def test_bias_update_lowers_overloaded_experts_and_raises_idle_ones():
    biases = [torch.zeros(4), torch.full((1, 4), 0.5)]  # a buffer [E], and ernie4_5_moe's [1, E]
    load = torch.tensor([[10, 0, 2, 4], [3, 3, 3, 3]])  # layer 0: mean 4
    update_router_biases(biases, load, 0.25)
    assert biases[0].tolist() == [-0.25, 0.25, 0.25, 0.0]
    assert biases[1].tolist() == [[0.5] * 4]  # balanced: unchanged


def _expected_biases(start: list[torch.Tensor], loads: list[torch.Tensor], rate: float) -> list[torch.Tensor]:
    out = [b.clone() for b in start]
    for load in loads:
        update_router_biases(out, load, rate)
    return out


@pytest.mark.slow
def test_bias_update_follows_the_global_load_each_step_on_one_rank(tmp_path):
    ckpt = _saved("deepseek_v3", tmp_path / "m", num_hidden_layers=3)
    trainer, _, records = _fit(_rc(ckpt, str(tmp_path / "runs"), train__router_bias_update_rate=0.01))
    got = [b.clone() for b in router_biases(trainer.model)]
    assert len(got) == 2  # first_k_dense_replace=1: two MoE layers
    want = _expected_biases([torch.zeros_like(b) for b in got], [torch.tensor(r["expert_load"]) for r in records], 0.01)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in got)
    assert records[-1]["router_bias"] == [g.tolist() for g in got]  # the metrics record the bias after the step


def test_bias_update_keeps_the_bias_in_float32_in_a_bf16_model(tmp_path):
    cfg = _config("deepseek_v3", vocab_size=96)
    from workbench.config import TINY_VOCAB_SIZE

    model = transformers.AutoModelForCausalLM.from_config(_config("deepseek_v3", vocab_size=TINY_VOCAB_SIZE))
    for bias in router_biases(model):
        bias.fill_(0.5)  # bf16 spacing at 0.5 is 2**-8: a step of 1e-3 would round away
    model.save_pretrained(tmp_path / "m")
    rc = _rc(str(tmp_path / "m"), str(tmp_path / "runs"), train__steps=1, train__router_bias_update_rate=1e-3)
    trainer, _, records = _fit(rc.with_overrides({"model.dtype": "bfloat16"}))
    (bias,) = router_biases(trainer.model)
    assert bias.dtype == torch.float32 and cfg.n_routed_experts == bias.numel()
    load = torch.tensor(records[0]["expert_load"][0], dtype=torch.float64)
    want = 0.5 + 1e-3 * torch.sign(load.mean() - load)
    torch.testing.assert_close(bias.double(), want, rtol=0, atol=1e-7)


def _bias_worker(rank, world, ckpt, out):
    trainer, result, records = _fit(_rc(ckpt, out, train__router_bias_update_rate=0.01))
    return {
        "biases": [b.clone() for b in router_biases(trainer.model)],
        "loads": [r["expert_load"] for r in records],
        "tokens": [r["tokens"] for r in records],
        "mesh": str(trainer.mesh),
        "losses": result["losses"],
    }


@pytest.mark.slow
def test_bias_update_under_dp2_ep2_is_equal_on_all_ranks_and_uses_the_whole_batch(tmp_path):
    ckpt = _saved("deepseek_v3", tmp_path / "m")
    r0, r1 = run_ranks(_bias_worker, 2, ckpt, str(tmp_path / "runs"), timeout=300)
    assert r0["mesh"] == "MeshConfig(dp=2, ep=2, cp=1, tp=1)"
    for a, b in zip(r0["biases"], r1["biases"]):
        assert torch.equal(a, b)
    # each rank records its own tokens' load; the update used their sum
    glob = [torch.tensor(a) + torch.tensor(b) for a, b in zip(r0["loads"], r1["loads"])]
    assert all(torch.tensor(a).sum(1).tolist() == [t * 2] for a, t in zip(r0["loads"], r0["tokens"]))
    want = _expected_biases([torch.zeros_like(b) for b in r0["biases"]], glob, 0.01)
    for g, w in zip(r0["biases"], want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-7)


@pytest.mark.slow
def test_bias_update_resumes_exactly_from_a_checkpoint(tmp_path):
    ckpt = _saved("glm4_moe", tmp_path / "m", num_hidden_layers=3)
    common = dict(train__router_bias_update_rate=0.02, train__steps=5)
    full, _, _ = _fit(_rc(ckpt, str(tmp_path / "a"), **common))
    _fit(_rc(ckpt, str(tmp_path / "b"), train__checkpoint_every=2, run_id="b", **common))
    ckpts = sorted((tmp_path / "b" / "b" / "checkpoints").glob("step-*"))  # steps 2 and 4
    resumed, _, _ = _fit(_rc(ckpt, str(tmp_path / "c"), train__resume_from=str(ckpts[0]), **common))
    assert resumed.start_step == 2
    for a, b in zip(router_biases(full.model), router_biases(resumed.model)):
        assert torch.equal(a, b)
    assert any(b.abs().sum() > 0 for b in router_biases(full.model))


def test_model_device_pins_the_cpu_and_is_validated():
    from workbench.parallel import dist_utils as du

    assert du.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"model.device 'gpu' is not one of \['auto', 'cpu', 'cuda'\]"):
        ModelConfig(device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"model\.device='cuda' needs a CUDA GPU"):
            du.pick_device("cuda")


def test_an_untested_v5_fused_family_runs_on_the_generic_path_with_one_line_naming_it(caplog):
    from workbench.models.generic import UnsupportedModelError, has_fused_experts

    cfg = _config("granitemoe", intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    try:
        has_fused_experts(cfg)
    except UnsupportedModelError:
        pytest.skip(f"transformers {transformers.__version__} does not fuse granitemoe's experts")
    with caplog.at_level("WARNING", logger="workbench"):
        model = AutoModelForCausalLM.from_config(cfg, device="cpu", dtype=torch.float32)
    assert len(engine_experts_modules(model)) == cfg.num_hidden_layers
    lines = [r.getMessage() for r in caplog.records if "granitemoe" in r.getMessage()]
    untested = [line for line in lines if "not among the families tested" in line]
    assert len(untested) == 1 and "generic engine path" in untested[0], lines
    # its forward divides the logits by logits_scaling (1.0 here): the default fused CE stays off, said once
    assert [line for line in lines if line not in untested] == [
        "fused_ce='auto' is off for model_type 'granitemoe': its config sets logits_scaling=1.0 (logits are "
        "transformed before the loss); its loss builds the full logits"
    ], lines
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for _, m in engine_experts_modules(model) for p in m.parameters())


class _HeldBuffer:
    """A dispatcher holding a buffer until close(), as DeepEPDispatcher does."""

    caps = NO_CAPS

    def __init__(self):
        self.open_key, self.closes = "k", 0

    def close(self) -> bool:
        self.closes += 1
        held, self.open_key = self.open_key is not None, None
        return held


def test_close_dispatchers_frees_the_generic_paths_dispatcher_once():
    from workbench.moe.dispatch import close_dispatchers

    model = AutoModelForCausalLM.from_config(_config("mixtral"), device="cpu", dtype=torch.float32)
    held = _HeldBuffer()
    for _, m in engine_experts_modules(model):
        m.use_dispatcher(held)  # build.py shares one dispatcher between the MoE layers
    assert close_dispatchers(model) == 1 and held.closes == 1


def test_a_bf16_model_keeps_the_router_bias_values_of_its_checkpoint(tmp_path):
    """One process: the trainer's cast to bf16 keeps e_score_correction_bias float32, values included."""
    from workbench.config import TINY_VOCAB_SIZE

    model = transformers.AutoModelForCausalLM.from_config(_config("deepseek_v3", vocab_size=TINY_VOCAB_SIZE))
    for bias in router_biases(model):
        bias.copy_(torch.tensor([0.1234567, -0.7654321, 0.3333333, 1.0e-3]))  # none representable in bf16
    want = [b.clone() for b in router_biases(model)]
    model.save_pretrained(tmp_path / "m")
    rc = _rc(str(tmp_path / "m"), str(tmp_path / "runs"), train__steps=1, train__lr=0.0)
    trainer, _, _ = _fit(rc.with_overrides({"model.dtype": "bfloat16"}))
    got = router_biases(trainer.model)
    assert [b.dtype for b in got] == [torch.float32] * len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g, w)
