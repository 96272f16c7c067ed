"""TransformerEngine backends on a machine without TE: selection, refusal, and the engine's wiring.

The wiring tests run the engine's TE glue against a small stand-in for `transformer_engine.pytorch`
(torch math behind TE 2.20's constructor and forward signatures, as the glue calls them). They
check what the engine does around TE: parameter sharing, state dict keys, gradients reaching the
fused expert weights, Transformers' attention interface and its fallbacks. TE's own kernels are
covered by tests/test_te.py on a GPU.
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_qwen3_moe
from torch import nn

import workbench
import workbench.backends as backends
from workbench import BackendConfig, BackendError
from workbench.kernels import rms_norm, rms_norm_torch, te_attention, te_common, te_experts, te_linear
from workbench.models import qwen3_moe
from workbench.moe.dispatch import LocalDispatcher
from workbench.moe.experts import EXPERTS_BACKENDS, experts_loop

TE_FIELDS = ("experts", "attention", "rms_norm", "linear")


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- selection and refusal (real, no TE)

@pytest.mark.skipif(te_installed(), reason="transformer_engine is installed here; the error path needs it absent")
@pytest.mark.parametrize("field", TE_FIELDS)
def test_explicit_te_without_te_names_the_pip_extra(field):
    with pytest.raises(BackendError, match=rf"{field}='te' cannot run here: transformer_engine is not installed: "
                                           r"pip install 'moe-workbench\[te\]'"):
        BackendConfig(**{field: "te"}).resolve("cpu")


@pytest.mark.skipif(te_installed(), reason="transformer_engine is installed here; the error path needs it absent")
def test_te_kernels_without_te_name_the_pip_extra():
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(BackendError, match=r"rms_norm='te' needs transformer_engine: pip install 'moe-workbench\[te\]'"):
        rms_norm(x, w, 1e-6, backend="te")
    with pytest.raises(BackendError, match=r"experts='te' needs transformer_engine: .*moe-workbench\[te\]"):
        EXPERTS_BACKENDS["te"](x, torch.tensor([3]), torch.randn(1, 4, 8), torch.randn(1, 8, 2), F.silu)


def test_auto_resolves_to_torch_paths_without_te(monkeypatch):
    monkeypatch.setattr(backends, "_has_module", lambda name: name != "transformer_engine" and name != "triton")
    for device in ("cpu", "cuda"):
        resolved = BackendConfig().resolve(device)
        assert (resolved.experts, resolved.attention, resolved.rms_norm, resolved.linear) == \
            ("grouped_mm", "sdpa", "torch", "torch"), device


def _pretend_te(monkeypatch, capability=(9, 0), import_error=None):
    """TE 'installed' on a CUDA device of `capability` (nothing is imported)."""
    monkeypatch.setattr(backends, "_has_module", lambda name: name == "transformer_engine")
    monkeypatch.setattr(backends, "_cuda_capability", lambda dev: capability)
    monkeypatch.setattr(backends, "_te_import_error", lambda: import_error)


def test_auto_keeps_the_measured_faster_paths_where_te_runs(monkeypatch):
    _pretend_te(monkeypatch, capability=(9, 0))
    resolved = BackendConfig().resolve("cuda")
    # measured on H200: the torch/Triton set beat TE attention+linear+norm (52.1k vs 49.5k tokens/s)
    assert (resolved.attention, resolved.linear, resolved.experts) == ("sdpa", "torch", "grouped_mm")
    assert resolved.rms_norm == "torch"  # triton is "absent" here
    for field in TE_FIELDS:
        assert getattr(BackendConfig(**{field: "te"}).resolve("cuda"), field) == "te"
    # FP8 runs only through TE: auto's linear follows it
    assert BackendConfig(fp8=True).resolve("cuda").linear == "te"
    # On the CPU TE never runs, installed or not.
    resolved = BackendConfig().resolve("cpu")
    assert (resolved.attention, resolved.rms_norm, resolved.linear) == ("sdpa", "torch", "torch")


@pytest.mark.parametrize("capability,import_error,message", [
    ((7, 5), None, r"compute capability >= 8\.0, this GPU has 7\.5"),
    (None, None, r"torch sees none here"),
    ((9, 0), "OSError: libcudnn.so.9: cannot open", r"installed but does not import \(OSError: libcudnn"),
])
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
    with pytest.raises(BackendError, match=r"fp8=True cannot run here: FP8 \(fp8=True\) need\(s\) compute capability >= 9\.0"):
        BackendConfig(fp8=True).resolve("cuda")
    _pretend_te(monkeypatch, capability=(9, 0))
    with pytest.raises(BackendError, match="neither linear nor experts resolved to 'te'"):
        BackendConfig(fp8=True, linear="torch").resolve("cuda")
    resolved = BackendConfig(fp8=True).resolve("cuda")
    assert resolved.fp8 and resolved.linear == "te" and resolved.experts == "grouped_mm"
    assert BackendConfig(fp8=True, linear="torch", experts="te").resolve("cuda").experts == "te"
    with pytest.raises(BackendError, match="fp8=True cannot run here"):
        BackendConfig(fp8=True).resolve("cpu")


# ---------------------------------------------------------------- a stand-in for transformer_engine.pytorch

class FakeLinear(nn.Module):
    """te.Linear(in_features, out_features, bias=, params_dtype=, device=); TE adds `_extra_state`."""

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda", **kwargs):
        super().__init__()
        assert not kwargs, kwargs
        self.use_bias = bias
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=params_dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=params_dtype)) if bias else None

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        pass

    def forward(self, inp):
        return F.linear(inp, self.weight, self.bias if self.use_bias else None)


class FakeGroupedLinear(nn.Module):
    """te.GroupedLinear(num_gemms, in, out, bias=, params_dtype=, device=, use_grouped_tensor=)."""

    def __init__(self, num_gemms, in_features, out_features, bias=True, params_dtype=None, device="cuda",
                 use_grouped_tensor=None):
        super().__init__()
        assert not bias and use_grouped_tensor is False
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(
                torch.empty(out_features, in_features, device=device, dtype=params_dtype)))

    def forward(self, inp, m_splits):
        assert isinstance(m_splits, list) and all(type(m) is int for m in m_splits)  # host ints
        parts = inp.split(m_splits)
        return torch.cat([F.linear(p, getattr(self, f"weight{i}")) for i, p in enumerate(parts)])


class _FakeNormFn(torch.autograd.Function):
    """Like TE's op: the backward reads the module's weight again instead of a saved copy."""

    @staticmethod
    def forward(ctx, x, module, weight):
        ctx.module = module
        ctx.save_for_backward(x)
        return rms_norm_torch(x, weight, module.eps)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        weight = ctx.module.weight
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            gx, gw = torch.autograd.grad(rms_norm_torch(x_, w_, ctx.module.eps), (x_, w_), grad)
        return gx, None, gw


class FakeRMSNorm(nn.Module):
    """te.RMSNorm(normalized_shape, eps=, zero_centered_gamma=, device=, dtype=)."""

    def __init__(self, normalized_shape, eps=1e-5, zero_centered_gamma=False, device=None, dtype=None):
        super().__init__()
        assert zero_centered_gamma is False
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(normalized_shape, device=device, dtype=dtype))

    def forward(self, x):
        return _FakeNormFn.apply(x, self, self.weight)


class FakeDotProductAttention(nn.Module):
    """te.DotProductAttention(heads, kv_channels, num_gqa_groups=, attention_dropout=, qkv_format=,
    attn_mask_type=, softmax_scale=); forward(q, k, v) in bshd returns [B, S, H * D]."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", softmax_scale=None):
        super().__init__()
        assert qkv_format == "bshd" and attn_mask_type == "causal" and attention_dropout == 0.0
        self.heads, self.groups, self.scale = num_attention_heads, num_gqa_groups, softmax_scale

    def forward(self, q, k, v, qkv_format=None, attn_mask_type=None):
        assert qkv_format == "bshd" and attn_mask_type == "causal" and q.is_contiguous()
        assert q.shape[2] == self.heads and k.shape[2] == self.groups
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=self.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


@pytest.fixture
def fake_te(monkeypatch):
    """Route the engine's TE glue to the stand-in, with CPU tensors accepted as TE's."""
    fake = types.SimpleNamespace(Linear=FakeLinear, GroupedLinear=FakeGroupedLinear, RMSNorm=FakeRMSNorm,
                                 DotProductAttention=FakeDotProductAttention)
    monkeypatch.setattr(te_common, "import_te", lambda field: fake)
    monkeypatch.setattr(te_common, "on_te_device", lambda x: True)
    te_experts._grouped_linear_shell.cache_clear()
    te_linear.te_linear_class.cache_clear()
    yield fake
    te_experts._grouped_linear_shell.cache_clear()
    te_linear.te_linear_class.cache_clear()


# ---------------------------------------------------------------- wiring, through the stand-in

def test_experts_te_grads_reach_the_fused_weights(fake_te):
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1, 0, 7])  # uneven, with empty experts
    x = torch.randn(int(counts.sum()), 16, requires_grad=True)
    gate_up = torch.randn(6, 2 * 12, 16, requires_grad=True)
    down = torch.randn(6, 16, 12, requires_grad=True)
    outs, grads = [], []
    for fn in (EXPERTS_BACKENDS["te"], experts_loop):
        y = fn(x, counts, gate_up, down, F.silu)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append([t.grad.clone() for t in (x, gate_up, down)])
        for t in (x, gate_up, down):
            t.grad = None
    assert rel_err(outs[0], outs[1]) < 1e-6
    for got, want in zip(*grads):
        assert rel_err(got, want) < 1e-6
    assert grads[0][1][1].abs().sum() == 0  # the empty expert gets a zero gradient
    # The same shape reuses one shell; it keeps meta placeholders, not our tensors, between calls.
    shell = te_experts._grouped_linear_shell(6, 16, 24, torch.float32)
    assert te_experts._grouped_linear_shell.cache_info().hits >= 1
    assert all(p.device.type == "meta" for p in shell.parameters())


def test_experts_te_with_no_tokens_keeps_the_weights_in_the_graph(fake_te):
    gate_up = torch.randn(3, 8, 4, requires_grad=True)
    down = torch.randn(3, 4, 4, requires_grad=True)
    y = EXPERTS_BACKENDS["te"](torch.randn(0, 4), torch.zeros(3, dtype=torch.long), gate_up, down, F.silu)
    y.sum().backward()
    assert y.shape == (0, 4) and gate_up.grad is not None and gate_up.grad.abs().sum() == 0


def test_rms_norm_te_gradient_uses_the_callers_weight(fake_te):
    torch.manual_seed(1)
    x = torch.randn(4, 5, 32, requires_grad=True)
    w = (1 + 0.1 * torch.randn(32)).requires_grad_()
    results = []
    for backend in ("te", "torch"):
        y = rms_norm(x, w, 1e-6, backend=backend)
        (y * torch.randn_like(y, generator=torch.Generator().manual_seed(2))).sum().backward()
        results.append((y.detach(), x.grad.clone(), w.grad.clone()))
        x.grad = w.grad = None
    for got, want in zip(*results):
        assert rel_err(got, want) < 1e-6


def _engine_pair(cfg, backend: BackendConfig):
    """A torch-backend engine model and one installed with `backend`, same weights."""
    torch.manual_seed(3)
    ref = workbench.AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(experts="loop"), device="cpu")
    model = qwen3_moe.Qwen3MoeForCausalLM._from_config(cfg)
    qwen3_moe.install_engine(model, backend, LocalDispatcher)
    model.load_state_dict(ref.state_dict())  # strict: the keys must be the same
    return ref, model


def _step(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, output_router_logits=True, use_cache=False, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("shape", [{}, dict(num_hidden_layers=3, mlp_only_layers=[1])])
def test_all_te_backends_installed_match_torch(fake_te, shape):
    cfg = tiny_qwen3_moe(**shape)
    all_te = BackendConfig(experts="te", attention="te", rms_norm="te", linear="te", dispatcher="local")
    ref, model = _engine_pair(cfg, all_te)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert not any(k.endswith("_extra_state") for k in model.state_dict())
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj).__name__ == "TELinear" and isinstance(layer.self_attn.q_proj, FakeLinear)
    assert type(layer.input_layernorm).__name__ == "RMSNorm" and layer.input_layernorm.backend == "te"
    assert model.config._attn_implementation == te_attention.TE_ATTENTION
    # The model switched its own copy of the config: the caller's, and the reference built from
    # it, keep SDPA.
    assert cfg._attn_implementation != te_attention.TE_ATTENTION
    assert ref.config._attn_implementation == "sdpa" and ref.model.layers[0].self_attn.config is ref.config
    assert all(getattr(m, "config", model.config) is model.config for m in model.modules())
    if "mlp_only_layers" in shape:
        assert type(model.model.layers[1].mlp.down_proj).__name__ == "TELinear"
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    want, want_grads = _step(ref, ids, labels)
    got, got_grads = _step(model, ids, labels)
    assert rel_err(got.logits, want.logits) < 1e-5 and rel_err(got.loss, want.loss) < 1e-5
    assert set(got_grads) == set(want_grads) == {n for n, _ in model.named_parameters()}
    for name, grad in got_grads.items():
        assert rel_err(grad, want_grads[name]) < 1e-4, name
    assert all(m.__dict__.get(te_attention.FALLBACK_ATTR, "unset") is None
               for m in model.modules() if type(m).__name__ == "Qwen3MoeAttention")


def test_te_linear_swap_shares_the_parameters(fake_te):
    cfg = tiny_qwen3_moe(attention_bias=True, num_hidden_layers=3, mlp_only_layers=[1])
    model = workbench.AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(experts="loop"), device="cpu")
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert qwen3_moe.swap_linears(model, "te") == 3 * 4 + 3  # q/k/v/o per layer + the dense MLP
    assert list(model.state_dict()) == keys
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in after)
    assert model.model.layers[0].self_attn.q_proj.bias is before["model.layers.0.self_attn.q_proj.bias"]
    assert qwen3_moe.swap_linears(model, "torch") == 0
    with pytest.raises(TypeError, match="takes a torch.nn.Linear"):
        te_linear.to_te_linear(model.model.layers[0].self_attn.q_proj)


def test_te_attention_falls_back_to_sdpa_for_masks_with_the_reason_recorded(fake_te):
    cfg = tiny_qwen3_moe()
    ref, model = _engine_pair(cfg, BackendConfig(experts="loop", attention="te", rms_norm="torch", linear="torch",
                                                 dispatcher="local"))
    attn = model.model.layers[0].self_attn
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[0, :3] = 0
    packed = torch.cat([torch.arange(4), torch.arange(6)]).expand(2, -1)
    for kwargs, reason in [(dict(attention_mask=padding), "attention mask"),
                           (dict(position_ids=packed), "attention mask")]:
        with pytest.warns(UserWarning, match="attention='te' fell back to SDPA"):
            got, _ = _step(model, ids, labels, **kwargs)
        assert reason in attn.__dict__[te_attention.FALLBACK_ATTR]
        want, _ = _step(ref, ids, labels, **kwargs)
        assert rel_err(got.logits, want.logits) < 1e-6
    _step(model, ids, labels)
    assert attn.__dict__[te_attention.FALLBACK_ATTR] is None  # plain causal: TE again
    # A KV cache with fewer queries than keys (decoding) falls back too.
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8)
    with pytest.warns(UserWarning, match="KV cache"):
        out, _ = te_attention.te_attention_forward(attn, q, k, k.clone(), None, scaling=8 ** -0.5)
    assert out.shape == (1, 1, 4, 8)
