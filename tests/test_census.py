"""Every family of the installed Transformers with v5 fused experts, checked family by family against vanilla.

The families are found, not listed: every model_type whose causal LM's modeling module holds a class decorated with
@use_experts_implementation (tests/generic_families.fused_experts_model_types), so a new Transformers release is
checked as soon as it is installed. Each gets a tiny config from its own config class (generic_families.census_config)
and is checked for: float32 logits and every gradient of the engine against vanilla Transformers on fresh random
weights and inputs; the engine model's save_pretrained loaded by vanilla Transformers with equal logits; the LoRA
targets attention and experts found. A family the engine cannot run must be refused with a clear error
(REFUSED), never run wrong.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import census_config, composite_model_types, fused_experts_model_types
from test_generic_families import close, close_grads, randomize

from workbench import BackendConfig
from workbench.config import LoraConfig
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.lora_check import check_lora_targets
from workbench.moe.hf_experts import engine_experts_modules

FAMILIES = fused_experts_model_types()
# Families the engine refuses, with what the refusal must say (none on this Transformers).
REFUSED: dict[str, str] = {}


def test_the_census_finds_the_known_families():
    # The enumeration itself must not silently shrink: the families the tests have long covered are all in it,
    # and every composite (vision + text) family is covered through its text model_type.
    assert {"qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "olmoe", "nemotron_h", "qwen3_5_moe_text"} <= set(
        FAMILIES
    )
    assert all(text in FAMILIES for text in composite_model_types().values())


def _vanilla(cfg):
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", dtype=torch.float32)
    randomize(ref, seed=3)
    return ref


def _engine(cfg):
    # device="cpu", float32: the comparison runs here; mixer="chunked": the engine's own mixers on hybrids
    return AutoModelForCausalLM.from_config(
        cfg, backend=BackendConfig(experts="grouped_mm", mixer="chunked"), device="cpu", dtype=torch.float32
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_family_equals_vanilla_and_saves_for_vanilla(family, tmp_path):
    cfg = census_config(family)
    if family in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[family]):
            _engine(cfg)
        return
    ref = _vanilla(cfg)
    eng = _engine(cfg)
    assert engine_experts_modules(eng), f"{family}: no experts module became the engine's"
    eng.load_state_dict(ref.state_dict(), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    # the same random draws in both forwards: some routers sample in training mode (PhiMoE's sparsemixer)
    torch.manual_seed(11)
    out_ref = ref(input_ids=ids, labels=ids)
    torch.manual_seed(11)
    # return_logits: the default fused CE builds none (tests/test_fused_ce_default.py checks that path)
    out_eng = eng(input_ids=ids, labels=ids, return_logits=True)
    close(out_eng.logits, out_ref.logits, f"{family} logits")
    out_ref.loss.backward()
    out_eng.loss.backward()
    close_grads(ref, eng, family)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    missing = [n for n, p in eng.named_parameters() if p.grad is None and ref_grads[n] is not None]
    assert not missing, f"{family}: no gradient reaches {missing}"  # a weight the engine's forward skips

    eng.save_pretrained(tmp_path / "saved")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", experts_implementation="eager")
    ref.eval()  # deterministic routing for the reload check
    with torch.no_grad():
        close(loaded.eval()(input_ids=ids).logits, ref(input_ids=ids).logits, f"{family} saved -> vanilla logits")


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_finds_attention_and_experts(family):
    cfg = census_config(family)
    plan = check_lora_targets(cfg, LoraConfig(rank=2, targets=("attention", "experts")))
    counts = dict(plan.by_target)
    assert counts["attention"] > 0 and counts["experts"] > 0, counts
