"""TransformerEngine backends on a machine without TE: selection, refusal and install hints.

The TE code paths themselves (kernels, model parity, parameter sharing, state dict keys, the
attention fallback, FP8) run against the real TransformerEngine in tests/test_te.py on a GPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

import workbench.backends as backends
from workbench import BackendConfig, BackendError
from workbench.kernels.rms_norm import rms_norm
from workbench.moe.dispatch import make_dispatcher
from workbench.moe.hf_experts import expert_rows, install_engine_experts

TE_FIELDS = ("experts", "attention", "rms_norm", "linear")


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- selection and refusal (real, no TE)


@pytest.mark.skipif(te_installed(), reason="transformer_engine is installed here; the error path needs it absent")
@pytest.mark.parametrize("field", TE_FIELDS)
def test_explicit_te_without_te_names_the_pip_extra(field):
    with pytest.raises(
        BackendError,
        match=rf"{field}='te' cannot run here: transformer_engine is not installed: "
        r"pip install 'moe-workbench\[te\]'",
    ):
        BackendConfig(**{field: "te"}).resolve("cpu")


@pytest.mark.skipif(te_installed(), reason="transformer_engine is installed here; the error path needs it absent")
def test_te_kernels_without_te_name_the_pip_extra():
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(
        BackendError, match=r"rms_norm='te' needs transformer_engine: pip install 'moe-workbench\[te\]'"
    ):
        rms_norm(x, w, 1e-6, backend="te")
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=8,
        moe_intermediate_size=4,
        num_experts=1,
        num_experts_per_tok=1,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=16,
    )
    experts = transformers.AutoModelForCausalLM.from_config(cfg).model.layers[0].mlp.experts
    install_engine_experts(experts, make_dispatcher("local", 1), "te", (0, 1), 1)
    with pytest.raises(BackendError, match=r"experts='te' needs transformer_engine: .*moe-workbench\[te\]"):
        expert_rows(experts, x, torch.tensor([3]))


def test_auto_resolves_to_torch_paths_without_te(monkeypatch):
    monkeypatch.setattr(backends, "_has_module", lambda name: name != "transformer_engine" and name != "triton")
    for device in ("cpu", "cuda"):
        resolved = BackendConfig().resolve(device)
        assert (resolved.experts, resolved.attention, resolved.rms_norm, resolved.linear) == (
            "grouped_mm",
            "sdpa",
            "torch",
            "torch",
        ), device


def _pretend_te(monkeypatch, capability=(9, 0), import_error=None):
    """TE 'installed' on a CUDA device of `capability` (nothing is imported)."""
    monkeypatch.setattr(backends, "_has_module", lambda name: name == "transformer_engine")
    monkeypatch.setattr(backends, "_cuda_capability", lambda dev: capability)
    monkeypatch.setattr(backends, "_te_import_error", lambda: import_error)


def test_auto_keeps_the_measured_faster_paths_where_te_runs(monkeypatch):
    _pretend_te(monkeypatch, capability=(9, 0))
    resolved = BackendConfig().resolve("cuda")
    # measured on H200: the torch/Triton set beat TE attention+linear+norm (60.7k vs 56.2k tokens/s, one launch)
    assert (resolved.attention, resolved.linear, resolved.experts) == ("sdpa", "torch", "grouped_mm")
    assert resolved.rms_norm == "torch"  # triton is "absent" here
    for field in TE_FIELDS:
        assert getattr(BackendConfig(**{field: "te"}).resolve("cuda"), field) == "te"
    # FP8 runs only through TE: auto's linear follows it
    assert BackendConfig(fp8=True).resolve("cuda").linear == "te"
    # On the CPU TE never runs, installed or not.
    resolved = BackendConfig().resolve("cpu")
    assert (resolved.attention, resolved.rms_norm, resolved.linear) == ("sdpa", "torch", "torch")


@pytest.mark.parametrize(
    "capability,import_error,message",
    [
        ((7, 5), None, r"compute capability >= 8\.0, this GPU has 7\.5"),
        (None, None, r"torch sees none here"),
        ((9, 0), "OSError: libcudnn.so.9: cannot open", r"installed but does not import \(OSError: libcudnn"),
    ],
)
def test_te_refused_on_unsupported_devices_with_a_reason(monkeypatch, capability, import_error, message):
    _pretend_te(monkeypatch, capability=capability, import_error=import_error)
    for field in TE_FIELDS:
        ok, why = backends.availability(field, "te", "cuda")
        assert not ok and why
        with pytest.raises(BackendError, match=message):
            BackendConfig(**{field: "te"}).resolve("cuda")
    auto = BackendConfig().resolve("cuda")
    assert "te" not in (auto.attention, auto.rms_norm, auto.linear, auto.experts)


def test_fp8_is_validated(monkeypatch):
    with pytest.raises(BackendError, match="fp8 must be True or False"):
        BackendConfig(fp8="yes")
    assert BackendConfig.from_dict({"fp8": True}).fp8 is True
    _pretend_te(monkeypatch, capability=(8, 0))
    with pytest.raises(
        BackendError, match=r"fp8=True cannot run here: FP8 \(fp8=True\) need\(s\) compute capability >= 9\.0"
    ):
        BackendConfig(fp8=True).resolve("cuda")
    _pretend_te(monkeypatch, capability=(9, 0))
    with pytest.raises(BackendError, match="neither linear nor experts resolved to 'te'"):
        BackendConfig(fp8=True, linear="torch").resolve("cuda")
    resolved = BackendConfig(fp8=True).resolve("cuda")
    assert resolved.fp8 and resolved.linear == "te" and resolved.experts == "grouped_mm"
    assert BackendConfig(fp8=True, linear="torch", experts="te").resolve("cuda").experts == "te"
    with pytest.raises(BackendError, match="fp8=True cannot run here"):
        BackendConfig(fp8=True).resolve("cpu")
