"""GPT-OSS's expert activation: the torch reference vs Transformers, the Triton kernels vs the reference, the model."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from generic_families import tiny_config

from workbench.backends import BackendConfig, BackendError
from workbench.kernels.gpt_oss_gate import add_row_bias, gpt_oss_gate, gpt_oss_gate_torch, row_segments
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.families import family_for
from workbench.models.families.gpt_oss.experts import gpt_oss_expert_rows, is_gpt_oss_gate
from workbench.moe.hf_experts import engine_experts_modules, install_engine_experts, is_fused_experts

# Shape suffixes: N routed rows, D hidden.

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
HAS_TRITON = importlib.util.find_spec("triton") is not None
EPS = torch.finfo(torch.float32).eps
# uneven rows, zero-row experts first, in the middle and last, one expert spanning several 32-row tiles
TOKENS_PER_EXPERT = [0, 5, 0, 0, 40, 1, 0, 17, 33, 2, 0]


def _experts(limit: float = 1.5):
    cfg = tiny_config("gpt_oss", intermediate_size=24, num_local_experts=len(TOKENS_PER_EXPERT))
    module = gpt_oss.GptOssExperts(cfg)
    module.limit = limit  # 5.17's config has no swiglu_limit field; the module attribute is what the gate reads
    return module


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    tol = 64 * EPS * max(b.abs().max().item(), 1e-3)
    assert (a - b).abs().max().item() <= tol, f"{what}: max |diff| {(a - b).abs().max().item():.3g} > {tol:.3g}"


def test_reference_equals_transformers_apply_gate_and_bias():
    module = _experts()
    tpe = torch.tensor(TOKENS_PER_EXPERT)
    N, E, I2 = int(tpe.sum()), tpe.numel(), 2 * module.intermediate_size
    g = torch.Generator().manual_seed(0)
    h = 3 * torch.randn(N, I2, generator=g)
    bias = torch.round(8 * torch.randn(E, I2, generator=g)) / 8  # dyadic: limit - bias + bias is exact
    ids = torch.repeat_interleave(torch.arange(E), tpe)
    h[::3, ::5] = module.limit - bias[ids[::3]][:, ::5]  # some biased values exactly at +-limit
    h[1::3, 1::5] = -module.limit - bias[ids[1::3]][:, 1::5]
    dy = torch.randn(N, I2 // 2, generator=g)
    biased = h + bias[ids]
    assert (biased[:, ::2] > module.limit).any() and (biased[:, 1::2].abs() > module.limit).any()
    assert (biased[:, ::2] == module.limit).any() and (biased[:, 1::2] == -module.limit).any()

    def grads(fn):
        hh, bb = h.clone().requires_grad_(), bias.clone().requires_grad_()
        y = fn(hh, bb)
        y.backward(dy)
        return y.detach(), hh.grad, bb.grad

    ref = grads(lambda hh, bb: module._apply_gate(hh + bb[ids]))  # Transformers' own gate, bias by row index
    got = grads(lambda hh, bb: gpt_oss_gate_torch(hh, bb, row_segments(tpe, N), module.alpha, module.limit))
    for a, b, what in zip(got, ref, ("out", "grad h", "grad bias")):
        _close(a, b, what)
    assert ref[2][[0, 2, 3, 6, 10]].abs().max() == 0  # zero-row experts get no bias gradient


def test_bad_shapes_are_refused_naming_the_problem():
    tpe = torch.tensor([2, 1])
    seg = row_segments(tpe, 3)
    with pytest.raises(ValueError, match="even width"):
        gpt_oss_gate(torch.zeros(3, 5), torch.zeros(2, 5), seg, 1.7, 7.0)
    with pytest.raises(ValueError, match="do not fit biases of 3 experts"):
        gpt_oss_gate(torch.zeros(3, 4), torch.zeros(3, 4), seg, 1.7, 7.0)
    with pytest.raises(ValueError, match="unknown gpt_oss gate backend 'cuda'"):
        add_row_bias(torch.zeros(3, 4), torch.zeros(2, 4), seg, backend="cuda")


_TRITON_SCRIPT = textwrap.dedent("""
    import sys, torch
    from workbench.kernels.gpt_oss_gate import add_row_bias, gpt_oss_gate, row_segments
    device, tpes = sys.argv[1], eval(sys.argv[2])
    torch.manual_seed(0)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    def run(fn, inputs, dy):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = fn(*leaves)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    def check(name, fn, inputs, dy, tol):
        ref = run(lambda *t: fn(*t, "torch"), [t.double() for t in inputs], dy.double())
        got = run(lambda *t: fn(*t, "triton"), inputs, dy)
        for i, (a, b) in enumerate(zip(got, ref)):
            assert a.dtype == inputs[0].dtype and a.shape == b.shape, (name, i, a.dtype, a.shape)
            if b.numel() == 0:
                continue
            err = rel(a, b) if b.abs().max() > 0 else a.abs().max().item()  # zero-row experts: exactly 0
            assert err < tol, (name, i, err)
        print("ok", name, inputs[0].dtype, tuple(inputs[0].shape))

    LIMIT = 2.5

    def gate_inputs(N, E, I, dtype):
        # h beyond +-limit (clamps matter), dyadic biases; no biased value within rounding of the limit
        # (a clamp decision flipped by one rounding is a full-size gradient difference), and in float32
        # some exactly at +-limit (torch passes the gradient there)
        b = (torch.round(8 * torch.randn(E, 2 * I, device=device)) / 8).to(dtype)
        h = (4 * torch.randn(N, 2 * I, device=device)).to(dtype)
        ids = torch.repeat_interleave(torch.arange(E, device=device), tpe, output_size=N)
        for _ in range(8):
            v = h.double() + b[ids].double()
            near = ((v.abs() - LIMIT).abs() < 0.1)
            if not near.any():
                break
            h = torch.where(near, h + 0.375, h)
        if dtype == torch.float32 and N:
            h[::2, ::3] = LIMIT - b[ids[::2]][:, ::3]
            h[1::2, 1::3] = -LIMIT - b[ids[1::2]][:, 1::3]
        return h, b

    for tpe in tpes:
        tpe = torch.tensor(tpe, device=device)
        N, E = int(tpe.sum()), tpe.numel()
        seg = row_segments(tpe, N)
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            for I in (72, 16):
                h, b = gate_inputs(N, E, I, dtype)
                dy = torch.randn(N, I, device=device).to(dtype)
                check("gate", lambda h, b, k: gpt_oss_gate(h, b, seg, 1.702, LIMIT, backend=k), [h, b], dy, tol)
                y = torch.randn(N, 40, device=device).to(dtype)
                b = torch.randn(E, 40, device=device).to(dtype)
                dy = torch.randn(N, 40, device=device).to(dtype)
                # * 1.0: the in-place add needs a non-leaf, as the GEMM output it gets in the engine
                check("row_bias", lambda y, b, k: add_row_bias(y * 1.0, b, seg, backend=k), [y, b], dy, tol)
    print("GPT-OSS GATE OK")
""")


def _run_script(script: str, marker: str, *args: str, interpret: bool) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"} if interpret else dict(os.environ)
    here = Path(__file__).resolve()
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1]), str(here.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and marker in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


TPES = repr([TOKENS_PER_EXPERT, [0, 0, 0], [64, 0, 31, 1]])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_equal_the_reference_in_the_interpreter():
    # float64 torch reference; fp32 kernels to rounding, bf16 to bf16 rounding of the in/outputs
    _run_script(_TRITON_SCRIPT, "GPT-OSS GATE OK", "cpu", TPES, interpret=True)


@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU and triton")
def test_triton_kernels_equal_the_reference_on_cuda():
    _run_script(_TRITON_SCRIPT, "GPT-OSS GATE OK", "cuda", TPES, interpret=False)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it ships the ptxas this test compiles with)")
def test_gate_backward_leaves_the_bias_sums_to_a_segmented_pass():
    # The gate's backward pass writes dh only: summing the bias gradient inside it (per-expert partials of each 32-row
    # tile, across warps) compiled to 31 barriers a program and ran at ~1.2 TB/s on the H200 (2026-12-04). Compiled
    # for sm_90: the pass keeps the one barrier of its gate/up interleave, and the segmented sum reduces after its loop.
    from compile_sm90 import compile_for_h200

    from workbench.kernels.triton_gpt_oss_gate import (
        BLOCK_C,
        BLOCK_I,
        BLOCK_M,
        _gate_bwd_kernel,
        _segment_sum_kernel,
    )

    types = dict(DY="*bf16", H="*bf16", B="*bf16", IDS="*i32", DH="*bf16", N="i32", I="i32", alpha="fp32")
    types.update(stride_dy="i32", stride_h="i32", stride_b="i32", stride_dh="i32", limit="fp32")
    aligned = ("DY", "H", "B", "IDS", "DH", "stride_dy", "stride_h", "stride_b", "stride_dh", "I")
    gate = compile_for_h200(_gate_bwd_kernel, types, dict(BM=BLOCK_M, BI=BLOCK_I), aligned)
    assert gate.asm["ptx"].count("bar.sync") <= 1
    types = dict(X="*bf16", OFFS="*i32", DB="*bf16", C="i32", stride_x="i32", stride_db="i32")
    ir = compile_for_h200(_segment_sum_kernel, types, dict(BM=BLOCK_M, BC=BLOCK_C), ("X", "OFFS", "DB")).asm["ttgir"]
    loop = ir[ir.index("scf.while") :]
    loop = loop[: loop.index("scf.yield")]
    assert '"tt.reduce"' not in loop and '"tt.reduce"' in ir  # rows added per element in the loop, summed once after


def test_the_gate_is_detected_from_the_class_not_the_model_type():
    assert is_gpt_oss_gate(_experts())

    class OtherGate(gpt_oss.GptOssExperts):
        def _apply_gate(self, gate_up):
            return gate_up[..., ::2]

    assert not is_gpt_oss_gate(OtherGate(tiny_config("gpt_oss")))
    no_limit = _experts()
    del no_limit.limit
    assert not is_gpt_oss_gate(no_limit)
    mixtral = transformers.AutoModelForCausalLM.from_config(tiny_config("mixtral"))
    experts = [m for m in mixtral.modules() if is_fused_experts(m)]
    assert experts and not any(is_gpt_oss_gate(m) for m in mixtral.modules())
    # swiglu='triton' on mixtral is the plain SwiGLU kernel, never GPT-OSS's gate
    assert family_for("gpt_oss").expert_rows(experts[0], "triton") is None
    install_engine_experts(experts[0], None, "grouped_mm", (0, 4), 4, swiglu="triton")
    assert experts[0].plan.swiglu == "triton" and experts[0].plan.family_rows is None
    other = OtherGate(tiny_config("gpt_oss"))
    assert family_for("gpt_oss").expert_rows(other, "triton") is None  # the family's kernel only for its own gate
    gpt = _experts()
    assert family_for("gpt_oss").expert_rows(gpt, "torch") is None  # and only where swiglu='triton' asks for it
    rows = family_for("gpt_oss").expert_rows(gpt, "triton")
    module = install_engine_experts(gpt, None, "grouped_mm", (0, 11), 11, swiglu="triton", family_rows=rows)
    assert module.plan.swiglu == "triton" and module.plan.family_rows is gpt_oss_expert_rows
    with pytest.raises(ValueError, match=r"resolved BackendConfig\.swiglu"):
        install_engine_experts(_experts(), None, "grouped_mm", (0, 11), 11, swiglu="auto")


def test_swiglu_choice_is_validated_and_auto_is_torch_on_cpu():
    with pytest.raises(BackendError, match=r"unknown swiglu backend 'cuda'"):
        BackendConfig(swiglu="cuda")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        assert BackendConfig().resolve("cpu").swiglu == "torch"
        with pytest.raises(BackendError, match="swiglu='triton' needs a CUDA device"):
            BackendConfig(swiglu="triton").resolve("cpu")


def _gpt_oss_pair(backend: BackendConfig):
    cfg = tiny_config("gpt_oss", swiglu_limit=0.3)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights large enough that biases and clamps matter
        for _, p in sorted(ref.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.15) + (p.dim() == 1) * 0.5)
    for m in ref.modules():
        if isinstance(m, gpt_oss.GptOssExperts):
            m.limit = 0.3  # 5.17 has no swiglu_limit config field
    eng = AutoModelForCausalLM.from_config(cfg, backend=backend, device="cpu")
    eng.load_state_dict(ref.state_dict(), strict=True)
    for _, m in engine_experts_modules(eng):
        m.limit = 0.3
    return cfg, ref, eng


def _compare_with_vanilla(cfg, ref, eng) -> None:
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    # return_logits: the default fused CE builds none (tests/test_fused_ce_default.py checks that path)
    out_ref, out_eng = ref(input_ids=ids, labels=ids), eng(input_ids=ids, labels=ids, return_logits=True)
    tol = 512 * EPS * out_ref.logits.abs().max().item()
    assert (out_eng.logits - out_ref.logits).abs().max().item() <= tol
    out_ref.loss.backward()
    out_eng.loss.backward()
    grads = dict(eng.named_parameters())
    checked = 0
    for name, p in ref.named_parameters():
        if p.grad is not None:
            scale = max(p.grad.abs().max().item(), 1e-3)
            diff = (grads[name].grad - p.grad).abs().max().item()
            assert diff <= 512 * EPS * scale, f"grad {name}: {diff:.3g}"
            checked += "experts" in name
    assert checked >= 8  # both layers' four expert tensors (weights and biases) got compared


def test_gpt_oss_experts_torch_kernels_equal_vanilla(monkeypatch):
    """The engine's GPT-OSS experts function (bias and gate as separate kernels) with the torch reference."""
    cfg, ref, eng = _gpt_oss_pair(BackendConfig(experts="grouped_mm", swiglu="torch"))
    import workbench.moe.hf_experts as hf_experts

    def torch_kernels(module, x_ND, tokens_per_expert, row_weights_N=None):
        assert row_weights_N is None  # GPT-OSS's biased, clamped gate keeps the weights in the combine
        return gpt_oss_expert_rows(module, x_ND, tokens_per_expert, kernel="torch")

    monkeypatch.setattr(hf_experts, "expert_rows", torch_kernels)
    _compare_with_vanilla(cfg, ref, eng)


_MODEL_SCRIPT = textwrap.dedent("""
    import torch
    from test_gpt_oss_gate import _compare_with_vanilla, _gpt_oss_pair
    from workbench.backends import BackendConfig
    from workbench.moe.hf_experts import engine_experts_modules
    cfg, ref, eng = _gpt_oss_pair(BackendConfig(experts="grouped_mm", swiglu="triton"))
    assert [m.plan.swiglu for _, m in engine_experts_modules(eng)] == ["triton", "triton"]
    _compare_with_vanilla(cfg, ref, eng)
    print("MODEL OK")
""")


def _triton_version() -> tuple[int, ...]:
    import triton

    return tuple(int(p) for p in triton.__version__.split(".")[:2])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_tiny_gpt_oss_with_triton_gate_equals_vanilla_in_the_interpreter():
    if _triton_version() < (3, 9):
        # the model under the interpreter also runs the engine's Triton combine, whose backward
        # (triton_combine.py range() over loaded bounds) Triton 3.6's interpreter rejects
        pytest.skip("Triton < 3.9's interpreter cannot run triton_combine's backward; CUDA tests cover this image")
    _run_script(_MODEL_SCRIPT, "MODEL OK", interpret=True)
