"""TransformerEngine backends on a GPU against the torch backends: logits, loss, gradients, state dict.

Run from the repository root:  PYTHONPATH=. python -m pytest tests/test_te.py -q
Every test skips, with the reason, without a CUDA GPU of compute capability >= 8.0 or without an
importable transformer_engine. Each test builds its own models, so one failing TE API does not
hide the others.

Tolerances (all relative L2 errors, `rel_err`):
- float32: 5e-3 on outputs, 1e-2 on gradients. TE may run float32 GEMMs as TF32 (10-bit mantissa,
  ~1e-3 after two layers) while the torch reference runs with TF32 off; a wiring mistake (a wrong
  transpose, a dropped weight or gradient) gives errors of order 1.
- bfloat16: both the TE and the torch bf16 model are compared with a float32 model holding the
  same (bf16-representable) weights: TE must be within 2x the torch bf16 path's own error plus
  1e-2 (~2.5 bf16 roundoffs, 2^-8 each) for quantities where torch's error happens to be tiny.
- The model tests use the balanced gate: routing is then fixed, so a near-tie in router scores
  cannot send a token to different experts in the two models (routing is torch code, not TE).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_qwen3_moe

import workbench
from workbench import BackendConfig


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "TransformerEngine backends need a CUDA GPU"
    capability = torch.cuda.get_device_capability()
    if capability < (8, 0):
        return f"TransformerEngine backends need compute capability >= 8.0, this GPU has {capability}"
    from workbench.kernels.te_common import import_transformer_engine

    try:
        # the engine's own loader (shares torch's cuDNN with TE), as the backends import it
        import_transformer_engine()
    except Exception as err:  # not installed, or installed but broken (missing CUDA libraries)
        return f"transformer_engine does not import: {type(err).__name__}: {err}"
    return None


SKIP = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

TORCH = dict(
    experts="grouped_mm", attention="sdpa", rms_norm="torch", linear="torch", dispatcher="local", gate="balanced"
)
TE_CASES = {
    "attention": dict(attention="te"),
    "linear": dict(linear="te"),
    "rms_norm": dict(rms_norm="te"),
    "experts": dict(experts="te"),
    "all": dict(attention="te", linear="te", rms_norm="te", experts="te"),
}
FP32_OUT, FP32_GRAD = 5e-3, 1e-2
BF16_FACTOR, BF16_SLACK = 2.0, 1e-2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def te_config(**overrides):
    """A tiny Qwen3-MoE whose widths are multiples of 16 (TE's GEMM and FP8 alignment)."""
    fields = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    fields.update(overrides)
    return tiny_qwen3_moe(**fields)


@pytest.fixture(autouse=True)
def exact_float32():
    """float32 references without TF32, whatever the process default."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def build(cfg, overrides: dict, state: dict, dtype: torch.dtype):
    """The engine model with TORCH backends except `overrides`, loaded with `state`, on the GPU."""
    backend = BackendConfig(**{**TORCH, **overrides})
    model = workbench.AutoModelForCausalLM.from_config(cfg, backend=backend, device="cuda")
    model.load_state_dict(state)  # strict: TE swaps must leave the keys alone
    return model.to("cuda", dtype)


def reference_state(cfg, seed: int, dtype: torch.dtype) -> dict:
    """Random weights, rounded to `dtype` so that every model under comparison holds the same values."""
    torch.manual_seed(seed)
    model = workbench.AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(**TORCH), device="cpu")
    return {k: v.to(dtype).float() for k, v in model.state_dict().items()}


def batch(cfg, seed: int, size=2, seq=32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (size, seq), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    return ids.cuda(), labels.cuda()


def step(model, ids, labels, **kwargs):
    """Logits, loss and every parameter's gradient (float32 copies)."""
    model.zero_grad(set_to_none=True)
    # return_logits: the default fused CE builds none (the loss from full logits, as before it was the default)
    out = model(input_ids=ids, labels=labels, output_router_logits=True, use_cache=False, return_logits=True, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), out.loss.detach().float(), grads


def assert_bf16_close(name: str, got: torch.Tensor, torch_bf16: torch.Tensor, fp32: torch.Tensor) -> None:
    err_te, err_torch = rel_err(got, fp32), rel_err(torch_bf16, fp32)
    assert err_te <= BF16_FACTOR * err_torch + BF16_SLACK, (
        f"{name}: TE bf16 is {err_te:.3g} from float32, the torch bf16 path {err_torch:.3g}"
    )


# ---------------------------------------------------------------- resolution


def test_te_and_torch_share_one_cudnn():
    # TE imported through the engine must leave torch's cuDNN usable (the image's system cuDNN 9.14
    # beside torch's 9.19 broke one or the other before import_transformer_engine loaded torch's)
    assert torch.backends.cudnn.version() is not None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.isfinite(out).all()


def test_auto_prefers_the_measured_faster_paths_with_te_installed():
    resolved = BackendConfig().resolve("cuda")
    assert (resolved.attention, resolved.rms_norm, resolved.linear) == ("sdpa", "triton", "torch")
    assert resolved.experts == "grouped_mm"
    assert BackendConfig(fp8=True).resolve("cuda").linear == "te"
    for field in ("experts", "attention", "rms_norm", "linear"):
        assert getattr(BackendConfig(**{field: "te"}).resolve("cuda"), field) == "te"


# ---------------------------------------------------------------- kernels on random tensors


@pytest.mark.parametrize("offset", [0.0, 1.0])  # 1.0: zero-centered (Qwen3.5-MoE), TE's zero_centered_gamma
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_te_kernel(dtype, offset):
    from workbench.kernels.rms_norm import rms_norm

    g = torch.Generator(device="cuda").manual_seed(11)
    x32 = torch.randn(4, 33, 128, device="cuda", generator=g)
    w32 = 1 - offset + 0.2 * torch.randn(128, device="cuda", generator=g)
    dy32 = torch.randn(4, 33, 128, device="cuda", generator=g)

    def run(backend, dt):
        # copy=True: a float32 .to() returns the same tensor, and the bf16 run would then see a non-leaf
        x = x32.to(dt, copy=True).requires_grad_()
        w = w32.to(dt, copy=True).requires_grad_()
        y = rms_norm(x, w, 1e-6, backend=backend, offset=offset)
        (y.float() * dy32).sum().backward()
        return y.float(), x.grad.float(), w.grad.float()

    ref = run("torch", torch.float32)
    got = run("te", dtype)
    if dtype == torch.float32:
        for name, a, b in zip(("y", "dx", "dw"), got, ref):
            assert rel_err(a, b) < 1e-5, name  # elementwise + one reduction, no GEMM
    else:
        base = run("torch", dtype)
        for name, a, b, r in zip(("y", "dx", "dw"), got, base, ref):
            assert_bf16_close(name, a, b, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_te_kernel_uneven_counts(dtype):
    import transformers

    from workbench.moe.dispatch import make_dispatcher
    from workbench.moe.hf_experts import expert_rows, install_engine_experts

    g = torch.Generator(device="cuda").manual_seed(12)
    counts = torch.tensor([5, 0, 17, 1, 0, 32, 9, 3], device="cuda")  # uneven, two experts empty
    n = int(counts.sum())
    x32 = torch.randn(n, 128, device="cuda", generator=g)
    gate_up32 = 0.05 * torch.randn(8, 2 * 64, 128, device="cuda", generator=g)
    down32 = 0.05 * torch.randn(8, 128, 64, device="cuda", generator=g)
    dy32 = torch.randn(n, 128, device="cuda", generator=g)
    cfg = tiny_qwen3_moe(hidden_size=128, moe_intermediate_size=64, num_experts=8)

    def run(backend, dt):
        experts = transformers.AutoModelForCausalLM.from_config(cfg).model.layers[0].mlp.experts.cuda()
        experts.gate_up_proj = torch.nn.Parameter(gate_up32.to(dt, copy=True))
        experts.down_proj = torch.nn.Parameter(down32.to(dt, copy=True))
        install_engine_experts(experts, make_dispatcher("local", 8), backend, (0, 8), 8)
        x = x32.to(dt, copy=True).requires_grad_()
        y = expert_rows(experts, x, counts)
        (y.float() * dy32).sum().backward()
        return y.float(), x.grad.float(), experts.gate_up_proj.grad.float(), experts.down_proj.grad.float()

    ref = run("loop", torch.float32)
    got = run("te", dtype)
    names = ("y", "dx", "dgate_up", "ddown")
    if dtype == torch.float32:
        for name, a, b in zip(names, got, ref):
            assert rel_err(a, b) < (FP32_OUT if name == "y" else FP32_GRAD), name
    else:
        base = run("loop", dtype)
        for name, a, b, r in zip(names, got, base, ref):
            assert_bf16_close(name, a, b, r)
    for empty in (1, 4):  # TE zeroes the weight gradient of an expert with no rows
        assert got[2][empty].abs().max() == 0 and got[3][empty].abs().max() == 0


@pytest.mark.parametrize("case", list(TE_CASES))
def test_model_float32_matches_torch_backends(case):
    cfg = te_config()
    state = reference_state(cfg, seed=20, dtype=torch.float32)
    ids, labels = batch(cfg, seed=21)
    want = step(build(cfg, {}, state, torch.float32), ids, labels)
    got = step(build(cfg, TE_CASES[case], state, torch.float32), ids, labels)
    assert rel_err(got[0], want[0]) < FP32_OUT
    assert rel_err(got[1], want[1]) < FP32_OUT
    assert set(got[2]) == set(want[2])
    for name, grad in got[2].items():
        assert rel_err(grad, want[2][name]) < FP32_GRAD, name


@pytest.mark.parametrize("case", list(TE_CASES))
def test_model_bf16_as_close_to_float32_as_torch_bf16(case):
    cfg = te_config()
    state = reference_state(cfg, seed=30, dtype=torch.bfloat16)
    ids, labels = batch(cfg, seed=31)
    ref = step(build(cfg, {}, state, torch.float32), ids, labels)
    base = step(build(cfg, {}, state, torch.bfloat16), ids, labels)
    got = step(build(cfg, TE_CASES[case], state, torch.bfloat16), ids, labels)
    assert_bf16_close("logits", got[0], base[0], ref[0])
    assert_bf16_close("loss", got[1], base[1], ref[1])
    assert set(got[2]) == set(ref[2])
    for name in ref[2]:
        assert_bf16_close(name, got[2][name], base[2][name], ref[2][name])


def test_linear_te_covers_dense_mlp_layers():
    cfg = te_config(num_hidden_layers=3, mlp_only_layers=[1])
    state = reference_state(cfg, seed=40, dtype=torch.float32)
    ids, labels = batch(cfg, seed=41)
    model = build(cfg, dict(linear="te"), state, torch.float32)
    assert type(model.model.layers[1].mlp.gate_proj).__name__ == "TELinear"
    want = step(build(cfg, {}, state, torch.float32), ids, labels)
    got = step(model, ids, labels)
    assert rel_err(got[0], want[0]) < FP32_OUT
    for name, grad in got[2].items():
        assert rel_err(grad, want[2][name]) < FP32_GRAD, name


# ---------------------------------------------------------------- state dict, checkpoints, fallbacks


def test_te_swaps_leave_the_state_dict_alone(tmp_path):
    import transformers

    cfg = te_config()
    state = reference_state(cfg, seed=50, dtype=torch.float32)
    plain = build(cfg, {}, state, torch.float32)
    model = build(cfg, TE_CASES["all"], state, torch.float32)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "TELinear"
    keys = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert keys == {k: tuple(v.shape) for k, v in plain.state_dict().items()}
    assert not any("_extra_state" in k for k in keys)
    params = dict(model.named_parameters())
    assert params["model.layers.0.self_attn.q_proj.weight"] is model.model.layers[0].self_attn.q_proj.weight
    plain.load_state_dict(model.state_dict())  # both directions, strict
    model.save_pretrained(tmp_path)
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(vanilla.model.layers[0].self_attn.q_proj.weight, state["model.layers.0.self_attn.q_proj.weight"])
    assert vanilla.config._attn_implementation != "workbench_te"


def test_te_attention_falls_back_to_sdpa_for_a_padding_mask():
    from workbench.kernels.te_attention import FALLBACK_ATTR

    cfg = te_config()
    state = reference_state(cfg, seed=60, dtype=torch.bfloat16)
    ids, labels = batch(cfg, seed=61)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    model = build(cfg, dict(attention="te"), state, torch.bfloat16)
    with pytest.warns(UserWarning, match="fell back to SDPA"):
        got = step(model, ids, labels, attention_mask=mask)
    assert "attention mask" in model.model.layers[0].self_attn.__dict__[FALLBACK_ATTR]
    want = step(build(cfg, {}, state, torch.bfloat16), ids, labels, attention_mask=mask)
    assert rel_err(got[0], want[0]) < 1e-6  # the same SDPA call
    step(model, ids, labels)
    assert model.model.layers[0].self_attn.__dict__[FALLBACK_ATTR] is None


# ---------------------------------------------------------------- FP8


@pytest.mark.skipif(
    SKIP is None and torch.cuda.get_device_capability() < (9, 0), reason="FP8 needs compute capability >= 9.0"
)
def test_fp8_runs_and_stays_near_bf16():
    cfg = te_config()
    state = reference_state(cfg, seed=70, dtype=torch.bfloat16)
    # 2 x 40 tokens: a multiple of 16 (TE's FP8 weight-gradient GEMMs take the token count as a
    # leading dimension: 2 x 28 failed "lda % 16 == 0" on H200), and rows per expert that are not,
    # so the experts go through the 16-row padding.
    ids, labels = batch(cfg, seed=71, seq=40)
    bf16 = step(build(cfg, TE_CASES["all"], state, torch.bfloat16), ids, labels)
    fp8 = step(build(cfg, {**TE_CASES["all"], "fp8": True}, state, torch.bfloat16), ids, labels)
    assert torch.isfinite(fp8[0]).all() and torch.isfinite(fp8[1])
    # E4M3 keeps 3 mantissa bits (~6% per element); broken scaling gives errors of order 1 or inf.
    assert rel_err(fp8[0], bf16[0]) < 0.25
    assert abs(fp8[1].item() - bf16[1].item()) < 0.05 * abs(bf16[1].item())
    assert set(fp8[2]) == set(bf16[2])
    for name, grad in fp8[2].items():
        assert torch.isfinite(grad).all(), name
        assert rel_err(grad, bf16[2][name]) < 0.5, name
