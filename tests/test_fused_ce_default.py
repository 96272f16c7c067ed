"""The fused cross-entropy is the default wherever the model allows it: RunConfig, the drop-in, the Studio, the bench.

fused_ce='auto' (BackendConfig's default) is on for a model whose logits are lm_head(hidden), off with the reason for
one that transforms them (GraniteMoE's logits_scaling); the default path's loss and gradients equal Transformers'; a
forward with labels returns no logits and reading them says how to get them.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from generic_families import FAMILIES, granite_scaled_logits_config
from test_generic_families import _config, close, close_grads, randomize

from workbench import BackendConfig
from workbench.backends import BackendError
from workbench.bench.cli import add_arguments, config_from_args
from workbench.bench.config import VARIANTS, BenchConfig
from workbench.bench.variant_backend import variant_backend
from workbench.config import RunConfig
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.engine_state import engine_state
from workbench.models.fused_ce import NOT_COMPUTED, LogitsNotComputedError, fused_ce_support, resolve_for_config
from workbench.train.world_checks import check_world
from workbench.ui.panels import BackendPanel, MeshPanel
from workbench.ui.studio import Studio


def test_run_config_defaults_to_fused_ce_where_the_model_allows_it(caplog):
    rc = RunConfig()
    assert rc.backend.fused_ce == "auto" and RunConfig.from_dict(rc.to_dict()).backend.fused_ce == "auto"
    # what the trainer resolves and records (config.json's resolved_backend) for the default tiny Qwen3-MoE
    plan = check_world(rc, 1, rc.model.hf_config(), torch.device("cpu"))
    assert plan.backend.fused_ce is True
    granite = granite_scaled_logits_config()
    can, why = fused_ce_support(granite)
    assert not can and "logits_scaling=4.0" in why
    assert rc.backend.resolve("cpu", fused_ce_support=(can, why)).fused_ce is False
    # as the trainer resolves it (train/world_checks.py): off, and the log says why
    with caplog.at_level(logging.WARNING, logger="workbench.models.fused_ce"):
        assert resolve_for_config(rc.backend, torch.device("cpu"), 1, granite).fused_ce is False
    assert any("granitemoe" in r.message and "logits_scaling=4.0" in r.message for r in caplog.records)
    with pytest.raises(BackendError, match=r"fused_ce=True cannot serve this model: .*logits_scaling=4.0.*'auto'"):
        BackendConfig(fused_ce=True).resolve("cpu", fused_ce_support=(can, why))
    assert BackendConfig(fused_ce=False).resolve("cpu", fused_ce_support=(True, "")).fused_ce is False
    # without the model's answer "auto" stays for the model build to decide
    assert BackendConfig().resolve("cpu").fused_ce == "auto"


def test_drop_in_defaults_to_fused_ce_and_says_why_not(caplog):
    model = AutoModelForCausalLM.from_config(_config("qwen3_moe"), device="cpu")
    assert engine_state(model).backend.fused_ce is True
    with caplog.at_level(logging.WARNING, logger="workbench.models.fused_ce"):
        granite = AutoModelForCausalLM.from_config(granite_scaled_logits_config(), device="cpu")
    assert engine_state(granite).backend.fused_ce is False
    assert any("fused_ce='auto' is off for model_type 'granitemoe'" in r.message for r in caplog.records)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    assert granite(input_ids=ids, labels=ids).logits.shape == (2, 8, 96)  # off: Transformers' own output


def test_studio_defaults_to_fused_ce_and_shows_what_auto_becomes(tmp_path):
    studio = Studio(None, runs_dir=tmp_path)  # its model: the tiny Qwen3-MoE preset
    assert studio.run_config().backend.fused_ce == "auto"
    assert studio.backend.fused_ce_resolution() == (True, "") and studio.mesh.memory_estimate().logits == 0
    panel = BackendPanel(None, "cpu", 1)
    assert panel.backend_config().fused_ce == "auto"
    panel.set_model(_config("qwen3_moe"))
    assert panel.fused_ce_resolution() == (True, "") and "auto = <b>on</b>" in panel.fused_ce_note.value
    panel.set_model(granite_scaled_logits_config())
    fused, why = panel.fused_ce_resolution()
    assert not fused and "auto = <b>off</b>" in panel.fused_ce_note.value and "logits_scaling" in why
    panel.fused_ce.value = True  # asked for on a model that cannot take it: the run would be refused, said here
    assert "refused for this model" in panel.fused_ce_note.value
    panel.fused_ce.value = False
    assert panel.backend_config().fused_ce is False and panel.fused_ce_note.value == ""
    # the memory estimate counts no logits where the loss runs fused, the full logits where it does not
    mesh = MeshPanel(1)
    mesh.set_model(_config("qwen3_moe"))
    assert mesh.memory_estimate().logits == 0
    mesh.set_training(fused_ce=False)
    assert mesh.memory_estimate().logits > 0


def test_bench_engine_row_is_the_products_default():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).backend == BackendConfig() == BenchConfig().backend
    assert config_from_args(parser.parse_args(["--fused-ce"])).backend.fused_ce is True  # accepted, as before
    assert config_from_args(parser.parse_args(["--no-fused-ce"])).backend.fused_ce is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--fused-ce", "--no-fused-ce"])
    # one launch times the default beside the loss from full logits
    assert variant_backend(VARIANTS["engine"], BackendConfig()).fused_ce == "auto"
    assert variant_backend(VARIANTS["engine_no_fused_ce"], BackendConfig()).fused_ce is False


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_default_loss_and_gradients_equal_transformers(family):
    """The default BackendConfig (fused CE on) against Transformers' float32 model: loss and every gradient."""
    cfg = _config(family)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", dtype=torch.float32)
    randomize(ref)
    eng = AutoModelForCausalLM.from_config(cfg, device="cpu", dtype=torch.float32)
    eng.load_state_dict(ref.state_dict(), strict=True)
    # on unless the family's head is more than lm_head(hidden) (e.g. Ergo's float32-output head): then off
    fused, why = fused_ce_support(cfg)
    assert engine_state(eng).backend.fused_ce is fused and (fused or why)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :3] = -100
    torch.manual_seed(11)  # the same draws where a router samples in training mode
    out_ref = ref(input_ids=ids, labels=labels)
    torch.manual_seed(11)
    out_eng = eng(input_ids=ids, labels=labels)
    close(out_eng.loss, out_ref.loss, f"{family} loss")
    out_ref.loss.backward()
    out_eng.loss.backward()
    close_grads(ref, eng, family)
    if not fused:
        close(out_eng.logits, out_ref.logits, f"{family} logits (fused CE off)")
        return
    # no silent None: any use of the logits says how to get them, and each way gives Transformers' own
    assert out_eng.logits is NOT_COMPUTED and out_eng["logits"] is NOT_COMPUTED
    for use in (
        lambda: out_eng.logits.shape,
        lambda: out_eng.logits[:, -1],
        lambda: out_eng.logits.float(),
        lambda: torch.softmax(out_eng.logits, -1),
        lambda: out_eng["logits"] / 2.0,
    ):
        with pytest.raises(LogitsNotComputedError, match=r"return_logits=True"):
            use()
    assert "logits=<logits not computed" in repr(out_eng)  # printing the output works
    with torch.no_grad():
        torch.manual_seed(11)
        want = ref(input_ids=ids, labels=labels)
        torch.manual_seed(11)
        got = eng(input_ids=ids, labels=labels, return_logits=True)
        close(got.logits, want.logits, f"{family} logits (return_logits=True)")
        close(got.loss, want.loss, f"{family} loss (return_logits=True)")
        torch.manual_seed(11)
        want = ref(input_ids=ids).logits
        torch.manual_seed(11)
        close(eng(input_ids=ids).logits, want, f"{family} logits without labels")


@pytest.mark.parametrize("fused_ce", ["auto", False])
def test_a_family_that_upcasts_its_logits_takes_the_fused_ce_in_bf16(fused_ce):
    """Nemotron-H's forward calls `.float()` on its logits: in bf16 that is a new tensor between the lm_head and the
    loss, which the default fused CE takes as the hidden states it handed on (on a GPU it was refused at the first
    step). Its loss and gradients are the full-logits loss's, in bf16's tolerance."""
    cfg = _config("nemotron_h")
    ref = AutoModelForCausalLM.from_config(
        cfg, backend=BackendConfig(fused_ce=False), device="cpu", dtype=torch.bfloat16
    )
    randomize(ref)
    eng = AutoModelForCausalLM.from_config(
        cfg, backend=BackendConfig(fused_ce=fused_ce), device="cpu", dtype=torch.bfloat16
    )
    eng.load_state_dict(ref.state_dict(), strict=True)
    assert engine_state(eng).backend.fused_ce is (fused_ce == "auto")
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    out_ref, out_eng = ref(input_ids=ids, labels=ids), eng(input_ids=ids, labels=ids)
    torch.testing.assert_close(out_eng.loss.float(), out_ref.loss.float(), rtol=2e-2, atol=2e-2)
    out_ref.loss.backward()
    out_eng.loss.backward()
    grads = dict(ref.named_parameters())
    for name, p in eng.named_parameters():
        if p.grad is not None:
            g = grads[name].grad.float()
            scale = max(g.abs().max().item(), 1e-3)
            assert (p.grad.float() - g).abs().max().item() <= 0.05 * scale, name
