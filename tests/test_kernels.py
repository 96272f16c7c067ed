"""Kernels vs Transformers: RMSNorm, SwiGLU, (fused) linear cross-entropy; Triton vs torch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from workbench.backends import CHOICES, BackendError
from workbench.kernels.cross_entropy import fused_linear_cross_entropy, linear_cross_entropy, shift_labels
from workbench.kernels.gpt_oss_gate import GPT_OSS_GATE_BACKENDS, ROW_BIAS_BACKENDS
from workbench.kernels.rms_norm import RMS_NORM_BACKENDS, RMSNorm, rms_norm
from workbench.kernels.swiglu import SWIGLU_BACKENDS, SWIGLU_PACKED_BACKENDS, swiglu, swiglu_packed

# Shape suffixes: B batch, S sequence, D hidden, V vocab.

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda_triton = pytest.mark.skipif(
    not (HAS_CUDA and HAS_TRITON), reason="Triton kernels need a CUDA GPU and triton installed"
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against reference b."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---------------------------------------------------------------- RMSNorm


def _norm_forward_backward(module, x, dy):
    """(y, dx, dweight) of `module` on a fresh leaf copy of x, the output's gradient dy."""
    xi = x.clone().requires_grad_()
    y = module(xi)
    y.backward(dy)
    return y.detach(), xi.grad, module.weight.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("shape", [(2, 7, 64), (5, 37)])
def test_rms_norm_torch_matches_hf(dtype, tol, shape):
    torch.manual_seed(0)
    hidden = shape[-1]
    hf = Qwen3MoeRMSNorm(hidden, eps=1e-6).to(dtype)
    ours = RMSNorm(hidden, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.3 * torch.randn(hidden))
    ours.load_state_dict(hf.state_dict())  # same parameter name, same layout
    x = (3 * torch.randn(shape)).to(dtype)
    dy = torch.randn(shape).to(dtype)
    outs = [_norm_forward_backward(module, x, dy) for module in (hf, ours)]
    for ours_t, hf_t in zip(outs[1], outs[0]):
        assert ours_t.dtype == hf_t.dtype
        assert rel_err(ours_t, hf_t) <= tol  # bf16: the same op sequence gives identical bits


def test_rms_norm_mixed_dtype_promotes_like_hf():
    torch.manual_seed(1)
    hf = Qwen3MoeRMSNorm(48)  # float32 weight
    x = torch.randn(4, 48).bfloat16()
    y = rms_norm(x, hf.weight, 1e-6)
    assert y.dtype == torch.float32
    assert torch.equal(y, hf(x))


def test_rms_norm_bad_input():
    with pytest.raises(ValueError, match=r"weight must be 1-D of size x\.shape"):
        rms_norm(torch.randn(3, 8), torch.ones(7))
    with pytest.raises(BackendError, match="unknown rms_norm backend 'cuda'"):
        rms_norm(torch.randn(3, 8), torch.ones(8), backend="cuda")
    with pytest.raises(BackendError, match="unknown rms_norm backend"):
        RMSNorm(8, backend="apex")
    # TE scales by weight or (1 + weight) (zero_centered_gamma) only: another offset is refused when built
    with pytest.raises(ValueError, match=r"rms_norm='te' scales by weight or \(1 \+ weight\) only, got offset=0.5"):
        RMSNorm(8, backend="te", offset=0.5)
    with pytest.raises(ValueError, match="RMSNorm offset must be a number"):
        RMSNorm(8, offset="1")


def _zero_centered_norm_class():
    """Transformers' Qwen3_5MoeRMSNorm (scale 1 + weight, weight initialised to zeros), or a skip naming the version."""
    modeling = pytest.importorskip(
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", reason="this Transformers has no Qwen3.5-MoE"
    )
    return modeling.Qwen3_5MoeRMSNorm


@pytest.mark.parametrize(
    "x_dtype,w_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)]
)
def test_rms_norm_torch_zero_centered_equals_qwen3_5_bit_for_bit(x_dtype, w_dtype):
    # offset=1.0 is Qwen3_5MoeRMSNorm's op sequence: (1 + weight) in float32 times the float32 normalized value,
    # rounded once to the input's dtype (type_as), whatever the weight's dtype
    torch.manual_seed(2)
    hf = _zero_centered_norm_class()(40, eps=1e-6).to(w_dtype)
    ours = RMSNorm(40, eps=1e-6, dtype=w_dtype, offset=1.0)
    assert torch.equal(ours.weight, hf.weight)  # both start at zeros: the neutral scale
    with torch.no_grad():
        hf.weight.copy_(0.3 * torch.randn(40))  # near zero, where 1 + w in bf16 would round
    ours.load_state_dict(hf.state_dict())
    x, dy = (3 * torch.randn(3, 5, 40)).to(x_dtype), torch.randn(3, 5, 40).to(x_dtype)
    outs = [_norm_forward_backward(module, x, dy) for module in (hf, ours)]
    for name, got, want in zip(("y", "dx", "dw"), outs[1], outs[0]):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert "offset=1.0" in repr(ours) and "offset" not in repr(RMSNorm(40))


# ---------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_hf_activation(dtype):
    torch.manual_seed(2)
    gate, up = (torch.randn(6, 45).to(dtype) for _ in range(2))
    dy = torch.randn(6, 45).to(dtype)
    results = []
    for fn in (lambda g, u: ACT2FN["silu"](g) * u, swiglu):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        y = fn(g, u)
        y.backward(dy)
        results.append((y.detach(), g.grad, u.grad))
    for ours_t, ref_t in zip(results[1], results[0]):
        assert torch.equal(ours_t, ref_t)


def test_swiglu_packed_matches_qwen3_moe_layout():
    torch.manual_seed(3)
    inter = 24
    # Qwen3-MoE experts: gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)
    gate_up_proj = torch.randn(2 * inter, 16)
    x = torch.randn(10, 16)
    gate_up = (x @ gate_up_proj.t()).requires_grad_()
    gate, up = F.linear(x, gate_up_proj).chunk(2, dim=-1)
    expected = ACT2FN["silu"](gate) * up
    y = swiglu_packed(gate_up)
    assert torch.allclose(y, expected, rtol=1e-6, atol=1e-6)
    dy = torch.randn_like(y)
    y.backward(dy)
    g, u = gate_up.detach()[:, :inter].requires_grad_(), gate_up.detach()[:, inter:].requires_grad_()
    (F.silu(g) * u).backward(dy)
    assert torch.allclose(gate_up.grad, torch.cat([g.grad, u.grad], dim=-1), rtol=1e-6, atol=1e-6)


def test_swiglu_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        swiglu(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="last dim must be even"):
        swiglu_packed(torch.randn(3, 5))
    with pytest.raises(BackendError, match="unknown swiglu backend"):
        swiglu(torch.randn(3, 4), torch.randn(3, 4), backend="liger")


# ---------------------------------------------------------------- cross-entropy


def _ce_inputs(dtype, batch=2, seq=9, hidden=24, vocab=53, n_ignored=4, seed=4):
    gen = torch.Generator().manual_seed(seed)
    hidden_BSD = torch.randn(batch, seq, hidden, generator=gen).to(dtype)
    weight_VD = (0.2 * torch.randn(vocab, hidden, generator=gen)).to(dtype)
    labels_BS = torch.randint(0, vocab, (batch, seq), generator=gen)
    flat = labels_BS.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:n_ignored]] = -100
    return hidden_BSD, weight_VD, labels_BS


def _hf_loss_and_grads(hidden, weight, labels, num_items_in_batch=None):
    """Qwen3MoeForCausalLM's path: logits = lm_head(hidden), then ForCausalLMLoss."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(h, w)
    loss = ForCausalLMLoss(logits, labels, vocab_size=w.shape[0], num_items_in_batch=num_items_in_batch)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _ours_loss_and_grads(fn, hidden, weight, labels, **kwargs):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, shift_labels(labels), **kwargs)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def test_ce_chunks_are_as_few_as_the_budget_allows_and_about_equal():
    from workbench.kernels.cross_entropy import chunk_bounds

    # Moonlight's vocab: 6 chunks of 1365-1366 tokens, not 5 of 1638 and one of 2
    assert [b - a for a, b in chunk_bounds(8192, 1638)] == [1365, 1365, 1366, 1365, 1365, 1366]
    assert chunk_bounds(0, 5) == []
    for tokens in (1, 2, 15, 17, 100, 1000, 4097, 8192, 8193):
        for budget in (1, 3, 16, 64, 1638, 1766, 8192):
            bounds = chunk_bounds(tokens, budget)
            sizes = [b - a for a, b in bounds]
            assert bounds[0][0] == 0 and bounds[-1][1] == tokens and sum(sizes) == tokens
            assert all(a == b for (_, a), (b, _) in zip(bounds, bounds[1:], strict=False))
            assert len(sizes) == -(-tokens // budget) and max(sizes) <= budget and max(sizes) - min(sizes) <= 1


def test_ce_default_chunks_keep_their_buffers_within_the_budget():
    from workbench.kernels import cross_entropy as ce

    for tokens, vocab, hidden in (
        (8192, 163840, 2048),
        (8192, 151936, 2048),
        (16384, 163840, 2048),
        (8192, 201088, 2880),
    ):
        frozen = ce.default_chunk_size(tokens, vocab, hidden, 2)
        assert frozen * vocab * 2 <= ce.LOGITS_CHUNK_BYTES < (frozen + 1) * vocab * 2  # a frozen head: logits only
        trained = ce.default_chunk_size(tokens, vocab, hidden, 2, weight_grad=True)
        if trained >= tokens:  # one chunk: its logits, no float32 accumulator
            assert tokens * vocab * 2 <= ce.TRAINED_HEAD_CE_BYTES
        else:  # a chunk's logits plus the [V, D] float32 accumulator
            assert trained * vocab * 2 + 4 * vocab * hidden <= ce.TRAINED_HEAD_CE_BYTES
            assert trained > frozen
    # 4096 x 2 tokens of Moonlight and Qwen3 are one chunk; 16k tokens of Moonlight three of 5462 or so
    assert ce.default_chunk_size(8192, 163840, 2048, 2, weight_grad=True) == 8192
    assert len(ce.chunk_bounds(16384, ce.default_chunk_size(16384, 163840, 2048, 2, weight_grad=True))) == 3


@pytest.mark.parametrize("num_items", [None, 11, "tensor"])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_fused_ce_matches_hf_for_causal_lm_loss_fp32(num_items, chunk_size):
    hidden, weight, labels = _ce_inputs(torch.float32)
    if num_items == "tensor":
        num_items = torch.tensor(13)
    ref = _hf_loss_and_grads(hidden, weight, labels, num_items)
    for fn, kwargs in ((fused_linear_cross_entropy, {"chunk_size": chunk_size}), (linear_cross_entropy, {})):
        ours = _ours_loss_and_grads(fn, hidden, weight, labels, num_items_in_batch=num_items, **kwargs)
        for name, a, b in zip(("loss", "d_hidden", "d_weight"), ours, ref):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert rel_err(a, b) < 1e-5, (fn.__name__, name, rel_err(a, b))


@pytest.mark.parametrize("chunk_size", [16, 4096])  # float32 accumulation over chunks; one chunk's bf16 product
def test_fused_ce_bf16_within_tolerance_of_fp32_hf(chunk_size):
    hidden, weight, labels = _ce_inputs(torch.bfloat16, seq=33, vocab=97, hidden=40)
    ref = _hf_loss_and_grads(hidden.float(), weight.float(), labels)
    ours = _ours_loss_and_grads(fused_linear_cross_entropy, hidden, weight, labels, chunk_size=chunk_size)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.bfloat16 and ours[2].dtype == torch.bfloat16
    for name, a, b in zip(("loss", "d_hidden", "d_weight"), ours, ref):
        assert rel_err(a, b) < 2e-2, (name, rel_err(a, b))


def test_fused_ce_never_saves_full_logits():
    batch, seq, hidden_size, vocab = 2, 16, 12, 101
    n_tokens = batch * seq
    hidden, weight, labels = _ce_inputs(torch.float32, batch, seq, hidden_size, vocab)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    saved_numels: list[int] = []

    def pack(t):
        saved_numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fused_linear_cross_entropy(h, w, shift_labels(labels), chunk_size=8)
    assert saved_numels, "the fused path saved nothing: the hook did not see the graph"
    assert max(saved_numels) < n_tokens * vocab
    loss.backward()
    # the same hook does see [N, V] in the unfused path, so the check above can fail
    saved_numels.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_cross_entropy(h, w, shift_labels(labels))
    assert n_tokens * vocab in saved_numels


def test_fused_ce_no_grad_and_frozen_weight():
    hidden, weight, labels = _ce_inputs(torch.float32)
    targets = shift_labels(labels)
    expected = linear_cross_entropy(hidden, weight, targets)
    with torch.no_grad():
        assert rel_err(fused_linear_cross_entropy(hidden, weight, targets, chunk_size=4), expected) < 1e-6
    h = hidden.clone().requires_grad_()
    fused_linear_cross_entropy(h, weight, targets, chunk_size=4).backward()
    h_ref = hidden.clone().requires_grad_()
    linear_cross_entropy(h_ref, weight, targets).backward()
    assert rel_err(h.grad, h_ref.grad) < 1e-5


def test_fused_ce_upstream_gradient_is_applied():
    hidden, weight, labels = _ce_inputs(torch.float32)
    results = []
    for fn in (fused_linear_cross_entropy, linear_cross_entropy):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        (2.5 * fn(h, w, shift_labels(labels))).backward()
        results.append((h.grad, w.grad))
    assert rel_err(results[0][0], results[1][0]) < 1e-5
    assert rel_err(results[0][1], results[1][1]) < 1e-5


def test_shift_labels_matches_hf():
    labels = torch.tensor([[5, 6, 7, -100], [1, 2, 3, 4]])
    assert shift_labels(labels).tolist() == [[6, 7, -100, -100], [2, 3, 4, -100]]


def test_cross_entropy_bad_input():
    hidden, weight, labels = _ce_inputs(torch.float32)
    targets = shift_labels(labels)
    with pytest.raises(ValueError, match=r"last dim must equal weight\.shape"):
        fused_linear_cross_entropy(hidden[..., :-1], weight, targets)
    with pytest.raises(ValueError, match="shift_labels"):
        fused_linear_cross_entropy(hidden, weight, targets[:, 1:])
    with pytest.raises(TypeError, match="integer tensor"):
        fused_linear_cross_entropy(hidden, weight, targets.float())
    bad = targets.clone()
    bad[0, 0] = weight.shape[0]
    with pytest.raises(ValueError, match=f"label {weight.shape[0]} is outside"):
        fused_linear_cross_entropy(hidden, weight, bad)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        fused_linear_cross_entropy(hidden, weight, targets, chunk_size=0)
    with pytest.raises(TypeError, match="share a dtype"):
        fused_linear_cross_entropy(hidden.bfloat16(), weight, targets)


# ---------------------------------------------------------------- registry


def test_each_registry_holds_exactly_the_backends_the_resolver_can_pick():
    # A resolved BackendConfig names the backend; the registry must have it (and nothing the resolver never gives).
    swiglu_family = (SWIGLU_BACKENDS, SWIGLU_PACKED_BACKENDS, GPT_OSS_GATE_BACKENDS, ROW_BIAS_BACKENDS)
    from workbench.moe.hf_experts import EXPERTS_BACKENDS

    for field, registries in (
        ("rms_norm", (RMS_NORM_BACKENDS,)),
        ("swiglu", swiglu_family),
        ("experts", (EXPERTS_BACKENDS,)),
    ):
        for registry in registries:
            assert set(registry) == set(CHOICES[field]) - {"auto"}, (field, registry)


def test_registry_errors_name_what_to_do():
    assert RMS_NORM_BACKENDS.impl("torch")(torch.ones(2, 4), torch.ones(4), 1e-6).shape == (2, 4)
    with pytest.raises(BackendError, match=r"unknown rms_norm backend 'auto'; choose one of \['torch', 'triton', 'te'"):
        RMS_NORM_BACKENDS.impl("auto")
    with pytest.raises(BackendError, match="unknown rms_norm backend 'cuda'"):
        RMSNorm(4, backend="cuda")  # refused when built, not at the first forward
    with pytest.raises(BackendError, match="unknown swiglu backend 'fast'"):
        swiglu(torch.ones(2), torch.ones(2), backend="fast")
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(BackendError, match=r"pip install 'moe-workbench\[te\]'"):
            rms_norm(torch.ones(2, 4), torch.ones(4), backend="te")


def test_triton_backend_on_cpu_tensor_says_use_torch():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: Triton runs on CPU tensors by design")
    with pytest.raises(BackendError, match="CUDA device"):
        rms_norm(torch.randn(2, 4), torch.ones(4), backend="triton")
    with pytest.raises(BackendError, match="CUDA device"):
        swiglu_packed(torch.randn(2, 4), backend="triton")


# ---------------------------------------------------------------- Triton

_TRITON_PARITY_SCRIPT = textwrap.dedent("""
    import sys, torch
    from workbench.kernels.rms_norm import rms_norm
    from workbench.kernels.swiglu import swiglu, swiglu_packed, swiglu_packed_weighted
    device, bf16_tol, shapes = sys.argv[1], float(sys.argv[2]), eval(sys.argv[3])
    torch.manual_seed(0)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    def run(fn, inputs, dy):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = fn(*leaves)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    def check(name, fn_of_backend, inputs, dy, tol):
        ref, got = run(fn_of_backend("torch"), inputs, dy), run(fn_of_backend("triton"), inputs, dy)
        for i, (a, b) in enumerate(zip(got, ref)):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, i, a.dtype, b.dtype)
            err = rel(a, b)
            assert err < tol, (name, i, err)
        print("ok", name, inputs[0].dtype, tuple(inputs[0].shape))

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, bf16_tol)):
        for shape in shapes:
            x = 2 * torch.randn(shape, device=device).to(dtype)
            w = (1 + 0.3 * torch.randn(shape[-1], device=device)).to(dtype)
            dy = torch.randn(shape, device=device).to(dtype)
            check("rms_norm", lambda b: lambda x, w: rms_norm(x, w, 1e-6, backend=b), [x, w], dy, tol)
            g, u = (torch.randn(shape, device=device).to(dtype) for _ in range(2))
            check("swiglu", lambda b: lambda g, u: swiglu(g, u, backend=b), [g, u], dy, tol)
            gu = torch.randn(*shape[:-1], 2 * shape[-1], device=device).to(dtype)
            check("swiglu_packed", lambda b: lambda gu: swiglu_packed(gu, backend=b), [gu], dy, tol)
            # each row scaled by its (float32) routing weight, whose gradient the backward sums over the row
            gu_M2I, dy_MI = gu.reshape(-1, gu.shape[-1]), dy.reshape(-1, shape[-1])
            row_w = 0.05 + torch.rand(gu_M2I.shape[0], device=device)
            check("swiglu_packed_weighted", lambda b: lambda gu, rw: swiglu_packed_weighted(gu, rw, backend=b),
                  [gu_M2I, row_w], dy_MI, tol)
        # fp32 weight with bf16 activations: output promotes to fp32 as in HF
        x = torch.randn(9, 48, device=device).to(dtype)
        w = 1 + 0.3 * torch.randn(48, device=device)
        check("rms_norm_mixed", lambda b: lambda x, w: rms_norm(x, w, 1e-6, backend=b), [x, w],
              torch.randn(9, 48, device=device), tol)
        # a frozen weight (LoRA): the kernel computes no weight gradient; the input's gradient is unchanged
        x, dy = torch.randn(9, 48, device=device).to(dtype), torch.randn(9, 48, device=device).to(dtype)
        w = w.to(dtype)
        frozen = {}
        for b in ("torch", "triton"):
            leaf = x.clone().requires_grad_()
            rms_norm(leaf, w, 1e-6, backend=b).backward(dy)
            frozen[b] = leaf.grad
        assert w.grad is None and rel(frozen["triton"], frozen["torch"]) < tol, rel(frozen["triton"], frozen["torch"])
    print("TRITON PARITY OK")
""")


def _run_script(script: str, ok_marker: str, *args: str, interpret: bool) -> None:
    """Run a test script in a fresh interpreter (TRITON_INTERPRET must be set before triton loads)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"} if interpret else dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and ok_marker in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def _run_triton_parity(device: str, bf16_tol: float, shapes: tuple, interpret: bool) -> None:
    _run_script(_TRITON_PARITY_SCRIPT, "TRITON PARITY OK", device, str(bf16_tol), repr(shapes), interpret=interpret)


@needs_cuda_triton
def test_triton_kernels_match_torch_on_cuda():
    # compiled kernels round like torch (RTNE), so bf16 agrees to about one ulp
    _run_triton_parity("cuda", 1e-2, ((3, 7, 64), (5, 37), (1000, 130), (2, 2048, 2048), (64, 8192)), interpret=False)


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton to run the kernels in Triton's CPU interpreter)"
)
@pytest.mark.skipif(
    HAS_CUDA,
    reason="a CUDA machine runs the compiled kernels instead "
    "(test_triton_kernels_match_torch_on_cuda); the interpreter is for CPU CI",
)
def test_triton_kernels_match_torch_in_interpreter():
    # TRITON_INTERPRET=1 runs the same kernels on CPU tensors; its bf16 casts truncate instead of
    # rounding to nearest, hence the looser bf16 bound here than on CUDA
    # (the interpreter runs one Python loop per program, so shapes stay small)
    _run_triton_parity("cpu", 2e-2, ((3, 7, 64), (5, 37), (300, 16)), interpret=True)


@needs_cuda_triton
def test_fused_ce_on_cuda_matches_hf():
    hidden, weight, labels = _ce_inputs(torch.bfloat16, batch=4, seq=257, hidden=256, vocab=5003)
    ref = _hf_loss_and_grads(hidden.float().cuda(), weight.float().cuda(), labels.cuda())
    ours = _ours_loss_and_grads(fused_linear_cross_entropy, hidden.cuda(), weight.cuda(), labels.cuda(), chunk_size=128)
    for name, a, b in zip(("loss", "d_hidden", "d_weight"), ours, ref):
        assert rel_err(a, b) < 2e-2, (name, rel_err(a, b))


@needs_cuda_triton
def test_fused_ce_triton_kernel_equals_torch_path_on_cuda():
    # vocab past one kernel block (4096) and not a multiple of it; ignored rows and num_items
    hidden, weight, labels = _ce_inputs(torch.bfloat16, batch=3, seq=301, hidden=256, vocab=9001, n_ignored=40)
    hidden, weight, labels = hidden.cuda(), weight.cuda(), labels.cuda()
    ref = _hf_loss_and_grads(hidden.float(), weight.float(), labels, num_items_in_batch=700)
    torch_path = _ours_loss_and_grads(
        fused_linear_cross_entropy, hidden, weight, labels, chunk_size=128, num_items_in_batch=700, use_triton=False
    )
    triton_path = _ours_loss_and_grads(
        fused_linear_cross_entropy, hidden, weight, labels, chunk_size=128, num_items_in_batch=700, use_triton=True
    )
    for name, a, b, r in zip(("loss", "d_hidden", "d_weight"), triton_path, torch_path, ref):
        # both paths take the same bf16 logits; they differ only in float32 summation order
        assert rel_err(a, b) < 2e-3, (name, rel_err(a, b))
        assert rel_err(a, r) < 2e-2, (name, rel_err(a, r))


_TRITON_CE_SCRIPT = textwrap.dedent("""
import torch, sys
sys.path.insert(0, "tests")
from test_kernels import _ce_inputs, _hf_loss_and_grads, _ours_loss_and_grads, rel_err
from workbench.kernels.cross_entropy import fused_linear_cross_entropy
for dtype, tol, vocab in ((torch.float32, 1e-5, 53), (torch.float32, 1e-5, 5000), (torch.bfloat16, 2e-2, 97)):
    hidden, weight, labels = _ce_inputs(dtype, seq=11, vocab=vocab, hidden=16)
    ref = _hf_loss_and_grads(hidden.float(), weight.float(), labels, num_items_in_batch=17)
    for chunk in (1, 7, 64):
        ours = _ours_loss_and_grads(fused_linear_cross_entropy, hidden, weight, labels, chunk_size=chunk,
                                    num_items_in_batch=17, use_triton=True)
        for name, a, b in zip(("loss", "d_hidden", "d_weight"), ours, ref):
            assert rel_err(a, b.to(a.dtype)) < tol, (dtype, vocab, chunk, name, rel_err(a, b.to(a.dtype)))
    # no-grad forward takes the loss-only kernel
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, __import__("workbench.kernels.cross_entropy",
                                          fromlist=["x"]).shift_labels(labels), num_items_in_batch=17,
                                          use_triton=True)
    assert rel_err(loss, ref[0]) < tol
# pass 2's direction changes no bit of the loss or the gradient
from workbench.kernels.triton_cross_entropy import ce_rows_
logits = torch.randn(23, 5000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
targets = torch.randint(0, 5000, (23,), generator=torch.Generator().manual_seed(4))
targets[5] = -100
denom = torch.tensor(19.0)
runs = []
for reverse in (True, False):
    grad = logits.clone()
    runs.append((ce_rows_(grad, targets, denom, -100, True, reverse=reverse), grad))
assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
# an upstream gradient scales the forward's buffers in place (1 leaves them); a second backward is refused
from workbench.kernels.cross_entropy import shift_labels
hidden, weight, labels = _ce_inputs(torch.float32, seq=11, vocab=300, hidden=16)
ref = _hf_loss_and_grads(hidden, weight, labels)
for upstream in (1.0, 2.5):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, shift_labels(labels), chunk_size=7, use_triton=True)
    (upstream * loss).backward(retain_graph=True)
    assert rel_err(h.grad, upstream * ref[1]) < 1e-5 and rel_err(w.grad, upstream * ref[2]) < 1e-5, upstream
    try:
        loss.backward()
    except RuntimeError as err:
        assert "ran twice" in str(err), err
    else:
        raise AssertionError("a second backward through the fused loss was not refused")
print("TRITON CE OK")
""")


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton to run the kernels in Triton's CPU interpreter)"
)
@pytest.mark.skipif(
    HAS_CUDA,
    reason="a CUDA machine runs the compiled kernel instead (test_fused_ce_triton_kernel_equals_torch_path_on_cuda)",
)
def test_fused_ce_triton_kernel_matches_hf_in_interpreter():
    # the fp32 cases must equal HF to float32 rounding; bf16 within bf16 rounding of fp32 HF
    _run_script(_TRITON_CE_SCRIPT, "TRITON CE OK", interpret=True)


def test_fused_ce_triton_refused_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, labels = _ce_inputs(torch.float32)
    with pytest.raises(BackendError, match=r"cross_entropy='triton' cannot run here.*needs a CUDA device"):
        fused_linear_cross_entropy(hidden, weight, shift_labels(labels), use_triton=True)


_TRITON_COMBINE_SCRIPT = textwrap.dedent("""
import torch, sys
from workbench.moe.dispatch.local import permute, sort_by_expert, unpermute

def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

device = sys.argv[1]
for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
    for T, K, E, D in ((37, 8, 16, 130), (5, 3, 4, 1100), (64, 1, 4, 64)):
        g = torch.Generator().manual_seed(T * K + D)
        x = torch.randn(T, D, generator=g).to(device, dtype).requires_grad_()
        logits = torch.randn(T, E, generator=g).to(device)
        w = torch.softmax(logits, -1).topk(K, -1).values.float().requires_grad_()
        ids = torch.softmax(logits, -1).topk(K, -1).indices
        perm, _ = sort_by_expert(ids, E)
        mix = torch.randn(D, D, generator=g).to(device, dtype) / D ** 0.5  # experts stand-in
        rows = permute(x, perm, use_triton=True)
        y = rows @ mix
        out = unpermute(y, w, perm, use_triton=True)
        dy = torch.randn(T, D, generator=g).to(device, dtype)
        (out.float() * dy.float()).sum().backward()
        # float64 reference of the same function
        x64 = x.detach().double().requires_grad_()
        w64 = w.detach().double().requires_grad_()
        y64 = x64[perm.token_of_row] @ mix.double()
        ref = (w64[:, :, None] * y64[perm.row_of_slot].view(T, K, D)).sum(1)
        (ref * dy.double()).sum().backward()
        for name, a, b in (("out", out, ref), ("dx", x.grad, x64.grad), ("dw", w.grad, w64.grad)):
            assert rel(a, b) < tol, (dtype, T, K, D, name, rel(a, b))
    # slots without a row (experts on other ranks): row index N reads nothing, gets no gradient
    from workbench.moe.dispatch.local import expand_to_rows, weighted_sum
    T, K, D = 29, 4, 300
    g = torch.Generator().manual_seed(5)
    has_row = torch.rand(T * K, generator=g) < 0.6
    N = int(has_row.sum())
    slot_of_row = torch.nonzero(has_row).squeeze(1)[torch.randperm(N, generator=g)]
    row_of_slot = torch.full((T * K,), N, dtype=torch.int64)
    row_of_slot[slot_of_row] = torch.arange(N)
    x = torch.randn(T, D, generator=g).to(device, dtype).requires_grad_()
    w = torch.rand(T, K, generator=g).to(device).requires_grad_()
    mix = torch.randn(D, D, generator=g).to(device, dtype) / D ** 0.5
    slot_of_row, row_of_slot = slot_of_row.to(device), row_of_slot.to(device)
    out = weighted_sum(expand_to_rows(x, slot_of_row // K, row_of_slot, K, True) @ mix, w, row_of_slot, slot_of_row,
                       True)
    dy = torch.randn(T, D, generator=g).to(device, dtype)
    (out.float() * dy.float()).sum().backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    mask = has_row.to(device).view(T, K, 1).double()
    ref = (w64[:, :, None] * mask * (x64 @ mix.double())[:, None, :]).sum(1)
    (ref * dy.double()).sum().backward()
    for name, a, b in (("out", out, ref), ("dx", x.grad, x64.grad), ("dw", w.grad, w64.grad)):
        assert rel(a, b) < tol, (dtype, "no-row slots", name, rel(a, b))
    assert (w.grad.view(-1)[~has_row.to(device)] == 0).all()
print("TRITON COMBINE OK")
""")


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton to run the kernels in Triton's CPU interpreter)"
)
def test_triton_combine_matches_float64_reference():
    # CPU runs the kernels in Triton's interpreter; a CUDA machine runs them compiled
    _run_script(_TRITON_COMBINE_SCRIPT, "TRITON COMBINE OK", "cuda" if HAS_CUDA else "cpu", interpret=not HAS_CUDA)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it ships the ptxas this test compiles with)")
@pytest.mark.parametrize("k_p2", [2, 4, 8, 16])
def test_combine_forward_sums_top_k_in_registers(k_p2):
    # The layout Triton gives the [K, BLOCK] tile decides whether the sum over K crosses warps (shared memory and
    # barriers in every program): compiled for sm_90, as a launch on an aligned [N, D] bf16 tensor specializes it.
    from compile_sm90 import compile_for_h200

    from workbench.kernels.triton_combine import BLOCK_D_FWD, _combine_fwd_kernel

    types = dict(Y="*bf16", W="*fp32", ROWS="*i32", OUT="*bf16", RES="*bf16", stride_y="i32", stride_out="i32")
    types.update(stride_res="i32", K="i32", D="i32", N="i32")
    aligned = ("Y", "W", "ROWS", "OUT", "RES", "stride_y", "stride_out", "stride_res", "D", "N")

    def compiled(block, residual=False, weights=True):
        flags = dict(K_P2=k_p2, BLOCK=block, HAS_RES=residual, HAS_W=weights)
        return compile_for_h200(_combine_fwd_kernel, types, flags, divisible=aligned)

    # the weighted combine, with the residual, and the plain sum of rows that carry their weights
    for ours in (compiled(BLOCK_D_FWD), compiled(BLOCK_D_FWD, residual=True), compiled(BLOCK_D_FWD, True, False)):
        assert ours.metadata.shared == 0 and "bar.sync" not in ours.asm["ptx"]
        assert "ld.global.v4.b32" in ours.asm["ptx"] and "st.global.v4.b32" in ours.asm["ptx"]  # 16-byte accesses
    old = compiled(512)  # what the forward ran with before: 2 x 2 warps, the K sum through shared memory
    assert old.metadata.shared > 0 and "bar.sync" in old.asm["ptx"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it ships the ptxas this test compiles with)")
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("width", [128, 2048])
def test_rms_norm_backward_sums_the_weight_gradient_after_its_loop(width, offset):
    # Each tile of the backward sums over its row (dx); the weight gradient's sum over the tile's rows, which
    # crosses warps, waits until after the loop over tiles: compiled for sm_90, the loop holds one reduction.
    from compile_sm90 import compile_for_h200

    from workbench.kernels.triton_rms_norm import _launch_config, _rms_norm_bwd_kernel

    types = dict(DY="*bf16", X="*bf16", W="*bf16", RSTD="*fp32", DX="*bf16", DW_PARTIAL="*fp32", DRES="*bf16")
    types.update(stride_dy="i32", stride_x="i32", stride_dx="i32", stride_dres="i32", M="i32", N="i32")
    types["tiles_per_program"] = "i32"
    rows, block, warps = _launch_config(width)
    aligned = ("DY", "X", "W", "RSTD", "DX", "DW_PARTIAL", "DRES", "stride_dy", "stride_x", "stride_dx", "N")
    flags = dict(BLOCK_M=rows, BLOCK_N=block, WANT_DW=True, HAS_DRES=True, OFFSET=offset)
    ir = compile_for_h200(_rms_norm_bwd_kernel, types, flags, divisible=aligned, warps=warps).asm["ttgir"]
    loop = ir[ir.index("scf.for") :]
    loop = loop[: loop.index("scf.yield")]
    reductions = [line for line in loop.splitlines() if '"tt.reduce"' in line]
    assert len(reductions) == 1 and "axis = 1" in reductions[0], reductions


_RMS_NORM_DW_SCRIPT = textwrap.dedent("""
import sys, torch
from workbench.kernels.triton_rms_norm import _RMSNormFunction, sum_partials

device = sys.argv[1]
g = torch.Generator().manual_seed(0)
# the partials' sum: every row, a ragged last row tile and column block, the weight's dtype
for R, N in ((528, 2048), (130, 17), (1, 128)):
    p = torch.randn(R, N, generator=g).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        got = sum_partials(p, dtype)
        ref = p.double().sum(0)
        assert got.dtype == dtype and got.shape == (N,)
        err = ((got.double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
        assert err < (1e-2 if dtype == torch.bfloat16 else 1e-4), (R, N, dtype, err)
# the norm's weight gradient (its partials no longer zero-filled) against autograd of the formula
for M, N in ((2048, 96), (37, 128), (0, 64)):
    x = torch.randn(M, N, generator=g).to(device).requires_grad_()
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(device).requires_grad_()
    dy = torch.randn(M, N, generator=g).to(device)
    (_RMSNormFunction.apply(x, w, 1e-6) * dy).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ((w2 * (x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6))) * dy).sum().backward()
    assert torch.allclose(w.grad, w2.grad, rtol=1e-4, atol=1e-4), (M, N, (w.grad - w2.grad).abs().max())
    assert M or torch.equal(w.grad, torch.zeros_like(w))
print("RMS NORM DW OK")
""")


def test_rms_norm_weight_gradient_from_its_partials():
    """The Triton norm's dW (per-program partials, no zero fill, summed and cast in one launch) equals autograd's."""
    _run_script(_RMS_NORM_DW_SCRIPT, "RMS NORM DW OK", "cuda" if HAS_CUDA else "cpu", interpret=not HAS_CUDA)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it ships the ptxas this test compiles with)")
def test_rms_norm_forward_compiles_for_both_offsets():
    # the interpreter runs what the compiler may refuse: the zero-centered forward (OFFSET a float constexpr added
    # to the loaded weight) must compile for sm_90 as the standard one does
    from compile_sm90 import compile_for_h200

    from workbench.kernels.triton_rms_norm import _launch_config, _rms_norm_fwd_kernel

    types = dict(X="*bf16", W="*bf16", Y="*bf16", RSTD="*fp32", stride_x="i32", stride_y="i32", M="i32", N="i32")
    types["eps"] = "fp32"
    rows, block, warps = _launch_config(2048)
    for offset in (0.0, 1.0):
        flags = dict(BLOCK_M=rows, BLOCK_N=block, OFFSET=offset)
        assert compile_for_h200(_rms_norm_fwd_kernel, types, flags, warps=warps).asm["ptx"]


_ZERO_CENTERED_SCRIPT = textwrap.dedent("""
import sys, torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm
from workbench.kernels.rms_norm import RMSNorm, rms_norm_residual

device, bf16_tol = sys.argv[1], float(sys.argv[2])
g = torch.Generator().manual_seed(3)

def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()

def run(module, x, dy, residual_grad=None):
    xi = x.clone().requires_grad_()
    if residual_grad is None:
        y = module(xi)
        y.backward(dy)
    else:  # the fused residual path: the residual stream's gradient summed into the norm's input gradient
        y, res = module.forward_residual(xi)
        torch.autograd.backward([y, res], [dy, residual_grad])
    return [y.detach(), xi.grad] + ([module.weight.grad] if module.weight.requires_grad else [])

# Transformers' own Qwen3_5MoeRMSNorm against the engine's Triton norm with offset 1.0, on fresh random inputs and a
# non-zero random weight: float32 tight, bf16 within bf16 rounding; widths narrow (per-head q/k) and wide, ragged
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, bf16_tol)):
    for shape in ((3, 7, 64), (5, 37), (300, 16), (2, 9, 256)):
        n = shape[-1]
        hf = Qwen3_5MoeRMSNorm(n, eps=1e-6).to(device=device, dtype=dtype)
        with torch.no_grad():
            hf.weight.copy_(0.4 * torch.randn(n, generator=g))
        ours = RMSNorm(n, eps=1e-6, backend="triton", device=device, dtype=dtype, offset=1.0)
        ours.load_state_dict(hf.state_dict())
        x = (2 * torch.randn(shape, generator=g)).to(device=device, dtype=dtype)
        dy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        d_res = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        want, got = run(hf, x, dy), run(ours, x, dy)
        hf.weight.grad = ours.weight.grad = None
        for name, a, b in zip(("y", "dx", "dw"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
            assert rel(a, b) < tol, (dtype, shape, name, rel(a, b))
        got = run(ours, x, dy, d_res)
        ours.weight.grad = None
        for name, a, b in zip(("y", "dx", "dw"), got, (want[0], want[1] + d_res.float(), want[2])):
            assert rel(a, b) < tol, (dtype, shape, "residual " + name, rel(a, b))
        # a frozen weight (LoRA's norms): no weight gradient, the same input gradient
        hf.weight.requires_grad_(False)
        ours.weight.requires_grad_(False)
        (y_hf, dx_hf), (y_ours, dx_ours) = run(hf, x, dy), run(ours, x, dy)
        assert ours.weight.grad is None and rel(dx_ours, dx_hf) < tol, (dtype, shape, "frozen")
    # a float32 weight under bf16 activations: the output in the input's dtype (type_as), as Transformers'
    hf = Qwen3_5MoeRMSNorm(48, eps=1e-6).to(device)
    with torch.no_grad():
        hf.weight.copy_(0.4 * torch.randn(48, generator=g))
    ours = RMSNorm(48, eps=1e-6, backend="triton", device=device, offset=1.0)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(9, 48, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(9, 48, generator=g).to(device=device, dtype=dtype)
    for name, a, b in zip(("y", "dx", "dw"), run(ours, x, dy), run(hf, x, dy)):
        assert a.dtype == b.dtype and rel(a, b) < tol, ("mixed", dtype, name, a.dtype, b.dtype)
print("ZERO CENTERED OK")
""")


@pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton to run the kernels in Triton's CPU interpreter)"
)
def test_triton_zero_centered_norm_equals_qwen3_5_norm():
    """offset=1.0 on the Triton path: values and gradients (x, weight; the fused residual's too) equal Transformers'
    Qwen3_5MoeRMSNorm. CUDA runs the compiled kernels (bf16 to about one rounding), a CPU machine the interpreter
    (its bf16 casts truncate: a looser bound)."""
    _zero_centered_norm_class()
    bf16_tol = "1e-2" if HAS_CUDA else "2e-2"
    _run_script(
        _ZERO_CENTERED_SCRIPT, "ZERO CENTERED OK", "cuda" if HAS_CUDA else "cpu", bf16_tol, interpret=not HAS_CUDA
    )


_TRITON_ENGINE_SCRIPT = textwrap.dedent("""
import sys, torch
sys.path.insert(0, "tests")
from test_parity import build_pair, fresh_batch, forward_backward, rel_err
from tiny_models import tiny_qwen3_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf
from workbench.kernels.triton_rope import rope
from workbench.models.families.qwen3_moe.attention import Qwen3MoeEngineAttention

device = sys.argv[1]
# the kernel alone against Transformers' formula, float64 reference, q laid out as [B, S, H, D] memory
g = torch.Generator().manual_seed(3)
x = torch.randn(2, 5, 3, 16, generator=g).transpose(1, 2).to(device)
cos, sin = torch.randn(2, 2, 5, 16, generator=g).to(device)
ref = x.double() * cos.double()[:, None] + hf.rotate_half(x.double()) * sin.double()[:, None]
assert rel_err(rope(x, cos, sin), ref) < 1e-6
# whole engine model (fused RoPE, combine, CE kernels in the interpreter) against Transformers, float32
cfg = tiny_qwen3_moe(head_dim=16)
hf_model, engine = build_pair(cfg, "grouped_mm", 5)
if device != "cpu":  # backends resolve for the device a model is built on: build the engine there
    import workbench
    state = engine.state_dict()
    engine = workbench.AutoModelForCausalLM.from_config(cfg, backend=workbench.BackendConfig(experts="grouped_mm"),
                                                        device=device)
    engine.load_state_dict(state)
assert all(type(l.self_attn) is Qwen3MoeEngineAttention for l in engine.model.layers)
hf_model.to(device), engine.to(device)
ids, labels = (t.to(device) for t in fresh_batch(cfg, 6))
ref, ref_grads = forward_backward(hf_model, ids, labels)
import workbench.models.qkv_projection as qkv, workbench.models.families.qwen3_moe.decoder as decoder
import workbench.kernels.triton_norm_rope as norm_rope
import workbench.moe.router as router
nodes, norms, ropes, passed = [], [], [], []
qkv_apply, norm_residual, rope_apply = qkv._QKVProjection.apply, decoder.norm_residual, norm_rope._NormRope.apply
router_backward = router._float32_linear_backward
qkv._QKVProjection.apply = lambda *a: nodes.append(1) or qkv_apply(*a)
decoder.norm_residual = lambda *a: norms.append(1) or norm_residual(*a)
norm_rope._NormRope.apply = lambda *a: ropes.append(1) or rope_apply(*a)
router._float32_linear_backward = lambda *a: passed.append(a[3] is not None) or router_backward(*a)
# one training forward with its logits (forward_backward runs a second, label-free one for the fused CE's): the
# counts below are one forward's
engine.zero_grad(set_to_none=True)
out = engine(input_ids=ids, labels=labels, output_router_logits=True, use_cache=False, return_logits=True)
out.loss.backward()
grads = {n: p.grad.detach().float().clone() for n, p in engine.named_parameters() if p.grad is not None}
qkv._QKVProjection.apply, decoder.norm_residual, norm_rope._NormRope.apply = qkv_apply, norm_residual, rope_apply
router._float32_linear_backward = router_backward
assert passed == [True] * cfg.num_hidden_layers, passed  # each router's backward sums the experts' input gradient
assert len(nodes) == cfg.num_hidden_layers, nodes  # every layer's q/k/v projections as one node
assert len(norms) == 2 * cfg.num_hidden_layers, norms  # and its residual adds fused (qwen3_moe/decoder.py)
assert len(ropes) == 2 * cfg.num_hidden_layers, ropes  # q and k: the per-head norm and RoPE in one kernel
# CUDA matmuls may use TF32 differently on each side: 1e-4 there, float32 rounding on the CPU
tol = 1e-5 if device == "cpu" else 1e-4
assert rel_err(out.loss, ref.loss) < tol and rel_err(out.logits, ref.logits) < tol
for name, gr in ref_grads.items():
    assert rel_err(grads[name], gr) < tol, (name, rel_err(grads[name], gr))
print("TRITON ENGINE OK")
""")


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton to run the kernels in Triton's CPU interpreter)"
)
def test_triton_rope_and_engine_match_transformers():
    # CPU: the interpreter; CUDA: the compiled kernels (the tiny model's fp32 parity holds on both)
    _run_script(_TRITON_ENGINE_SCRIPT, "TRITON ENGINE OK", "cuda" if HAS_CUDA else "cpu", interpret=not HAS_CUDA)


_GPT_OSS_ROPE_SCRIPT = textwrap.dedent("""
import sys, torch, transformers
sys.path.insert(0, "tests")
from generic_families import tiny_config
from test_generic_families import randomize
from test_parity import rel_err
from transformers.models.gpt_oss import modeling_gpt_oss as hf
import workbench
from workbench.kernels.triton_rope import apply_rope, rope
from workbench.models.families.gpt_oss.attention import GptOssEngineAttention

device = sys.argv[1]
# the kernel alone with GPT-OSS's half-width cos/sin against Transformers' formula, float64, q as [B, S, H, D] memory
g = torch.Generator().manual_seed(3)
x = torch.randn(2, 5, 3, 16, generator=g).transpose(1, 2).to(device)
cos, sin = torch.randn(2, 2, 5, 8, generator=g).to(device)
ref = hf._apply_rotary_emb(x.double(), cos.double()[:, None], sin.double()[:, None])
assert rel_err(rope(x, cos, sin), ref) < 1e-6
# its backward (the rotation's transpose) against float64 autograd of the same formula
w = torch.randn(x.shape, generator=g).to(device)
xd = x.double().requires_grad_()
(hf._apply_rotary_emb(xd, cos.double()[:, None], sin.double()[:, None]) * w.double()).sum().backward()
xg = x.clone().requires_grad_()
(apply_rope(xg, x.clone(), cos, sin)[0] * w).sum().backward()
assert rel_err(xg.grad, xd.grad) < 1e-6
# whole engine model (fused RoPE in both layer types, sinks) against vanilla eager Transformers, float32
cfg = tiny_config("gpt_oss")
torch.manual_seed(0)
ref_model = transformers.AutoModelForCausalLM.from_config(
    cfg, attn_implementation="eager", experts_implementation="eager"
)
randomize(ref_model)
engine = workbench.AutoModelForCausalLM.from_config(cfg, backend=workbench.BackendConfig(rope="triton"), device=device)
engine.load_state_dict(ref_model.state_dict())
assert all(type(l.self_attn) is GptOssEngineAttention for l in engine.model.layers)
ref_model.to(device), engine.to(device)
# count the fused kernel's calls: parity alone holds on Transformers' own RoPE too (5.17's transposed cos/sin once
# sent every layer there, unnoticed)
import workbench.kernels.triton_rope as triton_rope
fused = []
real_apply = triton_rope.apply_rope
triton_rope.apply_rope = lambda *a: fused.append(a[0].shape) or real_apply(*a)
ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(6)).to(device)
outs = []
for model in (ref_model, engine):
    logits = {"return_logits": True} if model is engine else {}  # the default fused CE would build none
    out = model(input_ids=ids, labels=ids, use_cache=False, **logits)
    out.loss.backward()
    outs.append((out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
assert len(fused) == cfg.num_hidden_layers, fused
tol = 1e-5 if device == "cpu" else 1e-4
assert rel_err(outs[1][0], outs[0][0]) < tol
assert set(outs[1][1]) == set(outs[0][1])
for name, gr in outs[0][1].items():
    assert rel_err(outs[1][1][name], gr) < tol, (name, rel_err(outs[1][1][name], gr))
# one layer with cos/sin as transposed views (Transformers 5.17's layout, whichever version runs here)
x = torch.randn(2, 11, cfg.hidden_size, generator=torch.Generator().manual_seed(8)).to(device)
ang = torch.randn(2, cfg.head_dim // 2, 11, generator=torch.Generator().manual_seed(9)).to(device).transpose(1, 2)
pe = (ang.cos(), ang.sin())
assert pe[0].stride(-1) != 1
fused.clear()
attn = engine.model.layers[0].self_attn
got = attn(x, pe, None)[0]
attn.rope = "torch"  # the same module on Transformers' own forward: its RoPE, the same attention function
want = attn(x, pe, None)[0]
assert len(fused) == 1 and rel_err(got, want) < tol, (fused, rel_err(got, want))
print("GPT-OSS ROPE OK")
""")


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton to run the kernels in Triton's CPU interpreter)"
)
def test_gpt_oss_fused_rope_matches_transformers():
    # CPU: the interpreter; CUDA: the compiled kernel (the tiny model's fp32 parity holds on both)
    _run_script(_GPT_OSS_ROPE_SCRIPT, "GPT-OSS ROPE OK", "cuda" if HAS_CUDA else "cpu", interpret=not HAS_CUDA)


def test_engine_attention_says_when_the_fused_rope_falls_back():
    """A layout the fused RoPE refuses (here a head dim that is no power of two) runs Transformers' RoPE, with a
    warning naming the shapes: the fallback that kept GPT-OSS's fused RoPE off on Transformers 5.17 was silent."""
    import copy
    import sys

    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from generic_families import tiny_config

    from workbench.models.families.gpt_oss.attention import GptOssEngineAttention, use_gpt_oss_attention

    cfg = tiny_config("gpt_oss", head_dim=12)
    torch.manual_seed(0)
    vanilla = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    engine = copy.deepcopy(vanilla)
    assert use_gpt_oss_attention(engine, "triton") == cfg.num_hidden_layers
    assert all(type(layer.self_attn) is GptOssEngineAttention for layer in engine.model.layers)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="fused RoPE kernel does not take q"):
        got = engine(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, vanilla(input_ids=ids, use_cache=False).logits, rtol=0, atol=0)


@needs_cuda_triton
def test_triton_scale_in_place_equals_torch_mul_by_device_scalar():
    from workbench.kernels.triton_cross_entropy import scale_

    g = torch.Generator(device="cuda").manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(3001, 517, device="cuda", generator=g).to(dtype)
        for scale in (torch.rand((), device="cuda", generator=g) + 0.5, torch.ones((), device="cuda")):
            # float32 product, one rounding to the tensor's dtype (torch's bf16 * 0-dim float32 tensor
            # would round the scale to bf16 first)
            expected = (x.float() * scale).to(dtype)
            got = scale_(x, scale)
            assert got.data_ptr() == x.data_ptr()
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_kernels_import_no_config_and_no_moe_modules():
    """Kernels take their choice as arguments (BackendConfig decides upstream): no config, moe or model imports."""
    import ast

    root = Path(__file__).resolve().parents[1] / "workbench" / "kernels"
    banned = ("workbench.backends", "workbench.config", "workbench.moe", "workbench.models", "workbench.train")
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):  # function-level imports too
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            found += [f"{path.name}: {n}" for n in names if n.startswith(banned)]
    assert not found, found
