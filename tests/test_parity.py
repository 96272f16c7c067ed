"""The engine equals Transformers' own Qwen3-MoE: logits, loss (with aux loss) and every gradient."""

from __future__ import annotations

import zlib

import pytest
import torch
import transformers
from tiny_models import PARITY_SHAPES, tiny_qwen3_moe

import workbench
from workbench.models.fused_ce import NOT_COMPUTED
from workbench.moe.hf_experts import engine_experts_modules


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def build_pair(cfg, experts: str, seed: int, fused_ce: bool | str = "auto"):
    torch.manual_seed(seed)
    # The eager reference: Transformers' own grouped_mm refuses odd widths.
    hf_model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").float()
    engine = workbench.AutoModelForCausalLM.from_config(
        cfg, backend=workbench.BackendConfig(experts=experts, fused_ce=fused_ce), device="cpu"
    )
    engine.load_state_dict(hf_model.state_dict())
    return hf_model, engine


def fresh_batch(cfg, seed: int, batch=3, seq=11):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a masked prompt, as SFT batches have
    return ids, labels


def forward_backward(model, ids, labels):
    model.zero_grad(set_to_none=True)
    # no KV cache, as the Trainer runs: with one, the engine's attention classes run Transformers' own forward
    out = model(input_ids=ids, labels=labels, output_router_logits=True, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    if out.logits is NOT_COMPUTED:  # the engine's default fused CE built none: those of the forward without labels
        with torch.no_grad():
            out.logits = model(input_ids=ids, output_router_logits=True, use_cache=False).logits
    return out, grads


@pytest.mark.parametrize("shape", list(PARITY_SHAPES))
@pytest.mark.parametrize("experts", ["loop", "grouped_mm"])
def test_float32_parity(shape, experts):
    cfg = tiny_qwen3_moe(**PARITY_SHAPES[shape])
    seed = zlib.crc32(f"{shape}-{experts}".encode()) % 10_000
    hf_model, engine = build_pair(cfg, experts, seed)
    assert engine_experts_modules(engine)  # Qwen3-MoE runs on the generic engine path
    ids, labels = fresh_batch(cfg, seed + 1)
    ref, ref_grads = forward_backward(hf_model, ids, labels)
    out, grads = forward_backward(engine, ids, labels)
    assert out.aux_loss is not None and ref.aux_loss.item() > 0
    assert rel_err(out.logits, ref.logits) < 1e-5
    assert rel_err(out.loss, ref.loss) < 1e-5
    assert rel_err(out.aux_loss, ref.aux_loss) < 1e-5
    assert set(grads) == set(ref_grads) and len(grads) == len(list(engine.parameters()))
    for name, g in ref_grads.items():
        assert g.abs().sum() > 0, f"{name} got no gradient: the test would prove nothing"
        assert rel_err(grads[name], g) < 1e-5, name


def flat(grads: dict, names) -> torch.Tensor:
    return torch.cat([grads[n].flatten() for n in names])


@pytest.mark.parametrize("shape", list(PARITY_SHAPES))
@pytest.mark.parametrize("experts", ["loop", "grouped_mm"])
def test_bfloat16_against_float32_hf(shape, experts):
    """bf16 engine vs float32 Transformers, with Transformers' own bf16 model as the noise yardstick.

    Logits, loss, aux loss and the whole gradient stay within 2e-2. Per parameter, a bf16 run of
    a tiny random model flips some near-tied top-k choices, which moves single experts' gradients
    by more than 2e-2 for Transformers' own bf16 model too; so each parameter must be within 3e-2
    or no further than 1.5x Transformers-bf16's error for dense parameters (attention, norms,
    embeddings); expert/router parameters within 0.25 or 2x Transformers-bf16's error (a flipped
    token moves them; a wrong layout or weighting would be off by O(1)).
    """
    cfg = tiny_qwen3_moe(**PARITY_SHAPES[shape])
    seed = zlib.crc32(f"{shape}-{experts}-bf16".encode()) % 10_000
    hf_model, engine = build_pair(cfg, experts, seed)
    hf_bf16 = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    hf_bf16.load_state_dict(hf_model.state_dict())
    hf_bf16, engine = hf_bf16.to(torch.bfloat16), engine.to(torch.bfloat16)
    ids, labels = fresh_batch(cfg, seed + 1, batch=4, seq=32)
    ref, ref_grads = forward_backward(hf_model, ids, labels)
    out, grads = forward_backward(engine, ids, labels)
    _, bf16_grads = forward_backward(hf_bf16, ids, labels)
    assert out.logits.dtype == torch.bfloat16
    assert rel_err(out.logits.float(), ref.logits) < 2e-2
    assert rel_err(out.loss.float(), ref.loss) < 2e-2
    assert rel_err(out.aux_loss.float(), ref.aux_loss) < 2e-2
    names = sorted(ref_grads)
    assert rel_err(flat(grads, names), flat(ref_grads, names)) < 2e-2
    for name in names:
        err = rel_err(grads[name], ref_grads[name])
        if ".mlp.experts." in name or ".mlp.gate." in name:
            assert err < max(0.25, 2 * rel_err(bf16_grads[name], ref_grads[name])), name
        else:
            # 3e-2: bf16 CPU kernels differ by machine (an AMD EPYC gave 0.022 for a k_norm weight whose
            # Transformers-bf16 error was 0.014); a wrong layout or scale is off by O(1)
            assert err < max(3e-2, 1.5 * rel_err(bf16_grads[name], ref_grads[name])), (name, err)


def test_grouped_mm_really_runs_grouped_gemm(monkeypatch):
    """The grouped_mm backend must not silently take the loop fallback on supported shapes."""
    from workbench.moe import grouped_linear

    cfg = tiny_qwen3_moe()
    _, engine = build_pair(cfg, "grouped_mm", 3)
    calls = []
    real = grouped_linear.grouped_mm_op()
    monkeypatch.setattr(grouped_linear, "grouped_mm_op", lambda: lambda *a, **k: calls.append(1) or real(*a, **k))
    ids, labels = fresh_batch(cfg, 4)
    engine(input_ids=ids, labels=labels).loss.backward()
    assert len(calls) == 2 * cfg.num_hidden_layers  # gate_up and down of every MoE layer, no loop fallback


@pytest.mark.parametrize("experts", ["loop", "grouped_mm"])
def test_fused_ce_matches_unfused_loss_and_gradients(experts):
    cfg = tiny_qwen3_moe(vocab_size=257)
    hf_model, unfused = build_pair(cfg, experts, 21, fused_ce=False)
    fused = workbench.AutoModelForCausalLM.from_config(
        cfg, backend=workbench.BackendConfig(experts=experts, fused_ce=True), device="cpu"
    )
    fused.load_state_dict(hf_model.state_dict())
    ids, labels = fresh_batch(cfg, 22)
    assert fused(input_ids=ids, labels=labels).logits is NOT_COMPUTED  # the full logits tensor is never built
    ref, ref_grads = forward_backward(hf_model, ids, labels)
    a, a_grads = forward_backward(unfused, ids, labels)
    b, b_grads = forward_backward(fused, ids, labels)
    assert rel_err(b.loss, ref.loss) < 1e-5 and rel_err(a.loss, ref.loss) < 1e-5
    for name, g in ref_grads.items():
        assert rel_err(b_grads[name], g) < 1e-5, name
        assert rel_err(a_grads[name], g) < 1e-5, name


def test_rms_norm_backend_is_really_installed():
    """A non-torch rms_norm backend replaces every Transformers RMSNorm (same weights)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    from workbench.kernels.rms_norm import RMSNorm
    from workbench.models.generic_extras import swap_rms_norms

    cfg = tiny_qwen3_moe()
    hf_model, engine = build_pair(cfg, "loop", 31)
    count = sum(isinstance(m, Qwen3MoeRMSNorm) for m in engine.modules())
    assert len(swap_rms_norms(engine, "triton")) == count > 0
    assert not any(isinstance(m, Qwen3MoeRMSNorm) for m in engine.modules())
    assert all(m.backend == "triton" for m in engine.modules() if isinstance(m, RMSNorm))
    assert set(dict(engine.named_parameters())) == set(dict(hf_model.named_parameters()))


def _saved_bytes(model, ids, labels) -> int:
    """Bytes autograd keeps for backward during one forward (each storage counted once)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=labels, output_router_logits=True)
    out.loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("experts", ["loop", "grouped_mm"])
def test_expert_recompute_same_numbers_less_saved(experts):
    cfg = tiny_qwen3_moe(**PARITY_SHAPES["base"])
    hf_model, plain = build_pair(cfg, experts, 31)
    recompute = workbench.AutoModelForCausalLM.from_config(
        cfg, backend=workbench.BackendConfig(experts=experts, expert_recompute=True), device="cpu"
    )
    recompute.load_state_dict(hf_model.state_dict())
    assert all(m.plan.recompute for _, m in engine_experts_modules(recompute))
    ids, labels = fresh_batch(cfg, 32)
    ref, ref_grads = forward_backward(hf_model, ids, labels)
    out, grads = forward_backward(recompute, ids, labels)
    assert rel_err(out.loss, ref.loss) < 1e-5
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) < 1e-5, name
    assert _saved_bytes(recompute, ids, labels) < _saved_bytes(plain, ids, labels)
