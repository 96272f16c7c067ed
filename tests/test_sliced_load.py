"""from_pretrained(path, mesh=) on the generic path reads only this rank's experts of the checkpoint."""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import tiny_config
from launch_utils import run_ranks
from safetensors.torch import load_file, save_file

EPS = torch.finfo(torch.float32).eps
FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"]


def _save_vanilla(family: str, path) -> str:
    """A checkpoint as vanilla Transformers writes it (its own disk layout), from fresh random weights."""
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family))
    with torch.no_grad():
        for p in model.parameters():  # larger than Transformers' init, so every expert matters in the logits
            p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return str(path)


def _build(path: str, mesh_kwargs: dict):
    from workbench.models.auto import AutoModelForCausalLM
    from workbench.parallel.mesh import MeshConfig

    return AutoModelForCausalLM.from_pretrained(path, mesh=MeshConfig(**mesh_kwargs))


def _load_worker(rank, world, path, mesh_kwargs, tokens):
    from torch.distributed.tensor import DTensor

    from workbench.models.engine_state import engine_state
    from workbench.moe.hf_experts import engine_experts_modules

    model = _build(path, mesh_kwargs)
    experts = {}
    for name, module in engine_experts_modules(model):
        for pname in module.plan.layout.param_names():
            value = getattr(module, pname)
            experts[f"{name}.{pname}"] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return {
        "experts": experts,
        "range": engine_state(model).expert_range,
        "read": engine_state(model).checkpoint_read,
        "logits": logits,
    }


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_reads_only_its_experts_and_equals_vanilla(family, tmp_path):
    path = _save_vanilla(family, tmp_path / "ckpt")
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    want = vanilla.state_dict()
    tokens = torch.randint(0, vanilla.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_logits = vanilla(input_ids=tokens).logits
    results = run_ranks(_load_worker, 2, path, dict(dp=2, ep=2), tokens, timeout=300)
    expert_keys = results[0]["experts"].keys()
    checkpoint_expert_bytes = sum(want[k].numel() * want[k].element_size() for k in expert_keys)
    assert expert_keys and all(k in want for k in expert_keys), sorted(expert_keys)
    for r in results:
        first, last = r["range"]
        assert last - first == want[next(iter(expert_keys))].shape[0] // 2
        for key, value in r["experts"].items():
            assert torch.equal(value, want[key][first:last]), key
        torch.testing.assert_close(r["logits"], want_logits, rtol=64 * EPS, atol=64 * EPS * want_logits.abs().max())
        # this rank's half of the experts, and nothing of the other half
        assert r["read"].expert_bytes == checkpoint_expert_bytes // 2, (r["read"], checkpoint_expert_bytes)
        dense_bytes = sum(
            v.numel() * v.element_size()
            for k, v in want.items()
            if k not in expert_keys and not (vanilla.config.tie_word_embeddings and k == "lm_head.weight")
        )
        assert r["read"].bytes == r["read"].expert_bytes + dense_bytes, r["read"]


def _refusal_worker(rank, world, path):
    from workbench.models.hf_io import CheckpointError

    try:
        _build(path, dict(dp=2, ep=2))
    except CheckpointError as err:
        return str(err)
    return "built"


def _damage(path: str, edit) -> None:
    state = load_file(f"{path}/model.safetensors")
    edit(state)
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})


# A tensor of an expert that rank 1 holds: rank 0 must refuse too (no rank may wait in a collective).
DAMAGED = {
    "qwen3_moe": "model.layers.1.mlp.experts.3.up_proj.weight",
    "mixtral": "model.layers.0.block_sparse_moe.experts.2.w3.weight",
    "gpt_oss": "model.layers.1.mlp.experts.down_proj",
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(DAMAGED))
def test_a_missing_tensor_is_refused_on_every_rank_naming_it(family, tmp_path):
    path = _save_vanilla(family, tmp_path / "ckpt")
    _damage(path, lambda state: state.pop(DAMAGED[family]))
    for message in run_ranks(_refusal_worker, 2, path, timeout=300):
        assert DAMAGED[family] in message or DAMAGED[family].rsplit(".", 1)[0] in message, message


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_tensor_of_the_wrong_shape_is_refused_on_every_rank_naming_it(family, tmp_path):
    path = _save_vanilla(family, tmp_path / "ckpt")
    key = DAMAGED[family]
    _damage(path, lambda state: state.update({key: state[key][..., :-1].contiguous()}))
    for message in run_ranks(_refusal_worker, 2, path, timeout=300):
        assert key in message and "shape" in message, message


def test_rules_come_from_transformers_conversion_mapping():
    from workbench.models.sliced_load import disk_rules

    mixtral = disk_rules("mixtral")
    assert (".block_sparse_moe.", ".mlp.") in mixtral.renames
    assert {m.target: m.sources for m in mixtral.merges} == {
        ".experts.gate_up_proj": (".experts.*.w1.weight", ".experts.*.w3.weight"),
        ".experts.down_proj": (".experts.*.w2.weight",),
    }
    assert disk_rules("gpt_oss").merges == ()  # fused on disk too: rows sliced, nothing merged


def _fallback_worker(rank, world, path):
    import logging

    from torch.distributed.tensor import DTensor

    from workbench.models.engine_state import engine_state
    from workbench.moe.hf_experts import engine_experts_modules

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("workbench.models.mesh_build").addHandler(handler)
    model = _build(path, dict(dp=2, ep=2))
    name, module = engine_experts_modules(model)[0]
    down = module.down_proj
    return {
        "log": records,
        "read": engine_state(model).checkpoint_read,
        "range": engine_state(model).expert_range,
        "key": f"{name}.down_proj",
        "down": (down.full_tensor() if isinstance(down, DTensor) else down).detach(),
    }


@pytest.mark.slow
def test_a_rule_the_reader_cannot_follow_falls_back_to_transformers_with_one_log_line(tmp_path):
    # Qwen3.5-MoE's multimodal checkpoints keep the text model under model.language_model.: Transformers
    # moves it with a regex PrefixChange the sliced reader does not follow.
    path = _save_vanilla("qwen3_5_moe_text", tmp_path / "ckpt")
    _damage(
        path,
        lambda state: state.update(
            {
                k.replace("model.", "model.language_model.", 1): state.pop(k)
                for k in [k for k in state if k.startswith("model.")]
            }
        ),
    )
    want = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    for r in run_ranks(_fallback_worker, 2, path, timeout=300):
        assert r["read"] is None
        assert [m for m in r["log"] if "not known to the sliced reader" in m and "PrefixChange" in m], r["log"]
        first, last = r["range"]
        assert torch.equal(r["down"], want[r["key"]][first:last])


def _bf16_bias_worker(rank, world, path):
    from workbench.models.auto import AutoModelForCausalLM
    from workbench.moe.bias_update import router_biases
    from workbench.parallel.mesh import MeshConfig

    model = AutoModelForCausalLM.from_pretrained(path, mesh=MeshConfig(dp=2, ep=2), dtype=torch.bfloat16)
    return [(b.dtype, b.detach().clone()) for b in router_biases(model)]


@pytest.mark.slow
def test_a_bf16_model_on_a_mesh_keeps_the_router_bias_float32_with_its_values(tmp_path):
    """Transformers keeps e_score_correction_bias float32 in a bf16 model; a plain .to(bf16) rounded it."""
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("deepseek_v3"))
    biases = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    with torch.no_grad():
        for b in biases:
            b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(3)))
    path = str(tmp_path / "ckpt")
    model.save_pretrained(path)
    want = [b.clone() for b in biases]
    assert want and all(not torch.equal(w, w.bfloat16().float()) for w in want)  # values bf16 cannot hold
    for biases in run_ranks(_bf16_bias_worker, 2, path, timeout=300):
        assert len(biases) == len(want)
        for (dtype, got), w in zip(biases, want):
            assert dtype == torch.float32 and torch.equal(got, w)


def test_one_parse_of_the_checkpoint_index_per_load(tmp_path, monkeypatch):
    """plan_rank_read parses which file holds each key; the read reuses that map instead of parsing again."""
    import workbench.models.sliced_load as sliced_load
    from workbench.models.auto import AutoModelForCausalLM

    path = _save_vanilla("mixtral", tmp_path / "ckpt")
    want = load_file(f"{path}/model.safetensors")
    model = AutoModelForCausalLM.from_config(tiny_config("mixtral"), device="cpu")
    parses = []
    real = sliced_load.checkpoint_key_files
    monkeypatch.setattr(sliced_load, "checkpoint_key_files", lambda p: parses.append(p) or real(p))
    plan = sliced_load.plan_rank_read(model, path, (0, 4))
    sliced_load.load_rank_slice(model, path, plan, (0, 4))
    assert len(parses) == 1, parses
    key = "model.layers.0.mlp.experts.down_proj"
    assert torch.equal(model.state_dict()[key][2], want["model.layers.0.block_sparse_moe.experts.2.w2.weight"])
