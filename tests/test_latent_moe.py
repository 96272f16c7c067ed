"""Nemotron 3 Super's and Ultra's LatentMoE (NemotronHConfig.moe_latent_size) on the engine.

Transformers' NemotronHMoE projects each token into the latent width before the routed experts (fc1_latent_proj) and
back after their weighted sum (fc2_latent_proj); the router and the shared expert stay at the hidden width. The
engine's experts run on the latent rows (their fused weights are [E, I, L] and [E, L, I]). Checked here: float32
logits and every gradient against vanilla Transformers on fresh random weights and inputs, the LoRA targets, the
parameter counts and the memory estimate by hand, and DP2 x EP2 on two gloo ranks against one process.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import tiny_config
from launch_utils import run_ranks
from test_generic_families import check_ep, close, close_grads, ep_step_on, randomize

from workbench import AutoModelForCausalLM, BackendConfig
from workbench.config import LoraConfig
from workbench.models.lora import adapter_parameters
from workbench.models.lora_check import check_lora_targets
from workbench.models.meta_model import meta_model
from workbench.params import param_counts
from workbench.ui.memory import estimate_memory

# Between the experts' width (16) and the hidden width (32): a mix-up of any two of them fails on a shape.
LATENT = 24


def latent_config():
    return tiny_config("nemotron_h", moe_latent_size=LATENT)


def _builds_latent_moe() -> bool:
    # an older Transformers (5.17) keeps an unknown config field and builds no projections: nothing to test there
    return any("fc1_latent_proj" in name for name, _ in meta_model(latent_config()).named_parameters())


pytestmark = pytest.mark.skipif(
    not _builds_latent_moe(), reason=f"transformers {transformers.__version__}'s Nemotron-H has no moe_latent_size"
)


@pytest.mark.parametrize("experts", ["loop", "grouped_mm"])
def test_latent_moe_equals_vanilla_transformers(experts):
    cfg = latent_config()
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", dtype=torch.float32)
    randomize(ref, seed=4)
    eng = AutoModelForCausalLM.from_config(
        # fused_ce off: the comparison reads the logits of a forward with labels
        cfg,
        backend=BackendConfig(experts=experts, mixer="chunked", fused_ce=False),
        device="cpu",
        dtype=torch.float32,
    )
    eng.load_state_dict(ref.state_dict(), strict=True)
    moe = eng.model.layers[1].mixer
    assert tuple(moe.experts.up_proj.shape) == (4, 16, LATENT) and moe.experts.plan is not None
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6))
    out_ref = ref(input_ids=ids, labels=ids)
    out_eng = eng(input_ids=ids, labels=ids)
    close(out_eng.logits, out_ref.logits, "latent MoE logits")
    out_ref.loss.backward()
    out_eng.loss.backward()
    close_grads(ref, eng, "latent MoE")
    for name in ("fc1_latent_proj.weight", "fc2_latent_proj.weight", "experts.up_proj", "experts.down_proj"):
        grad = moe.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_lora_targets_are_found_and_the_expert_adapters_are_latent_wide():
    cfg = latent_config()
    targets = ("attention", "mixer", "experts", "shared_experts")
    counts = dict(check_lora_targets(cfg, LoraConfig(rank=2, targets=targets)).by_target)
    assert counts == {"attention": 4, "mixer": 2, "experts": 2, "shared_experts": 4}, counts
    model = AutoModelForCausalLM.from_config(
        cfg, seed=0, device="cpu", backend=BackendConfig(mixer="chunked"), lora=LoraConfig(rank=4, targets=targets)
    )
    experts = {n: p for n, p in adapter_parameters(model) if ".experts." in n}
    shapes = {n.rsplit(".", 1)[-1]: tuple(p.shape) for n, p in experts.items() if ".layers.1." in n}
    # up_proj reads the latent rows (A: [E, L, r]), down_proj gives them back (B: [E, r, L])
    assert shapes == {
        "up_proj_lora_A": (4, LATENT, 4),
        "up_proj_lora_B": (4, 4, 16),
        "down_proj_lora_A": (4, 16, 4),
        "down_proj_lora_B": (4, 4, LATENT),
    }, shapes
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    # B starts at zero, so the B side gets the first gradient
    grads = [p.grad for n, p in experts.items() if "lora_B" in n or "_lora_b" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def _real_params(cfg) -> int:
    return sum(p.numel() for p in meta_model(cfg).parameters())


def test_latent_moe_parameters_flops_and_memory_by_hand():
    # the tests' tiny Nemotron-H (tests/test_hybrid_counts.py: 24460 parameters, 16512 active in matmuls) with
    # L = 24: each relu² expert shrinks from 2 * 32 * 16 to 2 * 24 * 16, each MoE layer gains 2 * 32 * 24
    cfg = latent_config()
    counts = param_counts(cfg)
    assert (counts.expert_matmul, counts.latent_per_layer) == (2 * 24 * 16, 2 * 32 * 24) == (768, 1536)
    assert counts.total == 24460 - 2 * 4 * (1024 - 768) + 2 * 1536 == 25484 == _real_params(cfg)
    assert counts.active_matmul == 16512 - 2 * 2 * (1024 - 768) + 2 * 1536 == 18560
    est = estimate_memory(cfg, 1, 1, seq_len=16, local_batch=2, dtype="float32", device_type="cpu")
    # an MoE layer: its block (2H), the router's 4 probabilities, 2 routed copies at the latent width (2L + 2I each),
    # the combined latent rows (L), the shared expert (2 I_s)
    moe = 2 * 32 + 4 + 2 * (2 * 24 + 2 * 16) + 24 + 2 * 16
    assert est.activations == 32 * 4 * ((2 * 32 + 292) + moe + (2 * 32 + 96) + moe)


@pytest.mark.slow
def test_latent_moe_on_dp2_ep2_equals_one_process(tmp_path):
    check_ep(run_ranks(ep_step_on, 2, latent_config(), str(tmp_path / "saved"), timeout=300))
