"""The engine's sequence mixers (Mamba2, Gated DeltaNet) against Transformers' own torch path, values and gradients.

Each function (kernels/causal_conv, kernels/ssd_scan, kernels/gated_delta) is compared in float32 with the reference
function of the installed Transformers' modeling module on fresh random inputs; each hybrid family's tiny model with
BackendConfig.mixer='chunked' with vanilla Transformers (logits and every gradient); packed documents with each
document run alone (values and gradients), and the swapped modules keep Transformers' state dict keys. The compiled
CUDA path is checked against the eager one on a GPU (skipped here with the reason).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from generic_families import tiny_config
from test_generic_families import close, randomize
from test_packing import check_isolation

from workbench import BackendConfig
from workbench.backends import Platform
from workbench.config_checks import ConfigError
from workbench.kernels.causal_conv import causal_depthwise_conv
from workbench.kernels.gated_delta import chunk_block, chunk_gated_delta, chunk_prepare, scan_chunks, unchunk
from workbench.kernels.ssd_scan import ssd_chunked
from workbench.models import mixer_compile
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.engine_state import engine_state
from workbench.presets import build_preset_config

HYBRIDS = ["lara_mini", "nemotron_h", "qwen3_5_moe_text", "qwen3_next", "qwen4_exp_text"]
# Qwen4ExpTextModel calls its layers without position ids: packed documents cannot reach its mixer (nor its n-gram
# embeddings' conv), as in Transformers' own path
DOCUMENT_HYBRIDS = [f for f in HYBRIDS if f != "qwen4_exp_text"]
CUDA = torch.cuda.is_available()
NEEDS_CUDA = pytest.mark.skipif(not CUDA, reason="the compiled mixers run on CUDA only (eager on the CPU)")


def _hf(module: str):
    """Transformers' modeling module `module` (its torch reference functions), skipping where this version lacks it."""
    return pytest.importorskip(f"transformers.models.{module}.modeling_{module}")


def _inputs(*shapes, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _grads(out: torch.Tensor, inputs) -> list[torch.Tensor]:
    """d(sum(out * w))/d(inputs) for a fixed random w: every output element weighs in."""
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(99))
    return list(torch.autograd.grad((out * w).sum(), inputs))


def _starts(batch: int, seq: int, firsts: dict[int, list[int]]) -> torch.Tensor:
    starts = torch.zeros(batch, seq, dtype=torch.bool)
    starts[:, 0] = True
    for row, cols in firsts.items():
        starts[row, cols] = True
    return starts


def _documents(starts: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, first, end) of every document of the rows."""
    out = []
    for row in range(starts.shape[0]):
        firsts = starts[row].nonzero().flatten().tolist() + [starts.shape[1]]
        out += [(row, a, b) for a, b in zip(firsts[:-1], firsts[1:])]
    return out


# ---------------------------------------------------------------- the conv


def test_conv_equals_transformers_causal_conv1d():
    hf = _hf("nemotron_h")
    x, w, b = _inputs((2, 11, 6), (6, 4), (6,))
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), w, b, activation="silu").transpose(1, 2)
    got = causal_depthwise_conv(x, w, b)
    close(got, ref, "conv")
    for name, g, r in zip("xwb", _grads(got, [x, w, b]), _grads(ref, [x, w, b])):
        close(g, r, f"conv grad {name}")


def test_conv_restarts_at_each_document():
    hf = _hf("nemotron_h")
    x, w = _inputs((2, 13, 5), (5, 4))
    starts = _starts(2, 13, {0: [3, 4, 9], 1: [12]})  # documents of 3, 1, 5, 4 tokens; 12 and 1
    got = causal_depthwise_conv(x, w, None, starts)
    got_grads = _grads(got, [x, w])
    x.grad = w.grad = None
    ref = torch.zeros_like(got)
    for row, a, e in _documents(starts):
        ref[row, a:e] = hf.causal_conv1d_fn(x[row : row + 1, a:e].transpose(1, 2), w, None, "silu")[0].T
    close(got, ref, "conv per document")
    for name, g, r in zip("xw", got_grads, _grads(ref, [x, w])):
        close(g, r, f"conv per document grad {name}")


# ---------------------------------------------------------------- Mamba2's scan


def _ssd_inputs(batch=2, seq=23, heads=4, hdim=3, groups=2, state=5):
    x, dt, B, C, D = _inputs(
        (batch, seq, heads, hdim),
        (batch, seq, heads),
        (batch, seq, groups, state),
        (batch, seq, groups, state),
        (heads,),
    )
    A = (-torch.rand(heads, generator=torch.Generator().manual_seed(5)) * 2 - 0.1).requires_grad_()
    return x, dt, A, B, C, D


def test_ssd_scan_equals_transformers_mamba2_chunk_scan():
    hf = _hf("nemotron_h")
    x, dt, A, B, C, D = inputs = _ssd_inputs()
    bias = torch.full((4,), 0.3)
    ref = hf.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=8, D=D, dt_bias=bias, dt_softplus=True)
    got = ssd_chunked(x, F.softplus(dt + bias), A, B, C, 8, D)  # 23 tokens: two full chunks and a padded one
    close(got, ref, "ssd")
    for name, g, r in zip(("x", "dt", "A", "B", "C", "D"), _grads(got, inputs), _grads(ref, inputs)):
        close(g, r, f"ssd grad {name}")


def test_ssd_scan_keeps_documents_apart():
    hf = _hf("nemotron_h")
    x, dt, A, B, C, D = inputs = _ssd_inputs()
    # documents across chunk boundaries, one inside a chunk, a one-token one, one starting a chunk
    starts = _starts(2, 23, {0: [5, 16, 17], 1: [8, 20]})
    got = ssd_chunked(x, F.softplus(dt), A, B, C, 8, D, starts)
    got_grads = _grads(got, inputs)
    ref = torch.zeros_like(got)
    for row, a, e in _documents(starts):
        one = slice(row, row + 1), slice(a, e)
        ref[row, a:e] = hf.mamba2_chunk_scan(x[one], dt[one], A, B[one], C[one], chunk_size=8, D=D, dt_softplus=True)[0]
    close(got, ref, "ssd per document")
    for name, g, r in zip(("x", "dt", "A", "B", "C", "D"), got_grads, _grads(ref, inputs)):
        close(g, r, f"ssd per document grad {name}")


# ---------------------------------------------------------------- the gated delta rule


def _delta_inputs(batch=2, seq=37, heads=4, kdim=8, vdim=6):
    q, k, v, a, b = _inputs(
        (batch, seq, heads, kdim),
        (batch, seq, heads, kdim),
        (batch, seq, heads, vdim),
        (batch, seq, heads),
        (batch, seq, heads),
    )
    return q, k, v, a, b


@pytest.mark.parametrize("module", ["qwen3_5_moe", "qwen3_next"])
def test_gated_delta_equals_transformers_chunk_rule(module):
    hf = _hf(module)
    q, k, v, a, b = inputs = _delta_inputs()
    ref, _ = hf.torch_chunk_gated_delta_rule(
        q, k, v, g=-F.softplus(a), beta=b.sigmoid(), chunk_size=16, use_qk_l2norm_in_kernel=True
    )
    got = chunk_gated_delta(q, k, v, -F.softplus(a), b.sigmoid(), 16)  # 37 tokens: three chunks, the last padded
    close(got, ref, f"{module} gated delta")
    # the walk in blocks of two chunks (the compiled mixer's calls): the same result
    prepared = chunk_prepare(q, k, v, -F.softplus(a), b.sigmoid(), 16)
    close(unchunk(scan_chunks(prepared, chunk_block, 2), 37), got, f"{module} gated delta in blocks")
    for name, gg, r in zip("qkvab", _grads(got, inputs), _grads(ref, inputs)):
        close(gg, r, f"{module} gated delta grad {name}")


def test_gated_delta_keeps_documents_apart():
    hf = _hf("qwen3_5_moe")
    q, k, v, a, b = inputs = _delta_inputs()
    starts = _starts(2, 37, {0: [5, 16, 17], 1: [30, 32]})
    got = chunk_gated_delta(q, k, v, -F.softplus(a), b.sigmoid(), 16, starts)
    got_grads = _grads(got, inputs)
    g, beta = -F.softplus(a), b.sigmoid()
    ref = torch.zeros_like(got)
    for row, s, e in _documents(starts):  # each document alone, through Transformers' token-by-token recurrence
        one = slice(row, row + 1), slice(s, e)
        ref[row, s:e] = hf.torch_recurrent_gated_delta_rule(
            q[one], k[one], v[one], g=g[one], beta=beta[one], use_qk_l2norm_in_kernel=True
        )[0][0]
    close(got, ref, "gated delta per document")
    for name, gg, r in zip("qkvab", got_grads, _grads(ref, inputs)):
        close(gg, r, f"gated delta per document grad {name}")


# ---------------------------------------------------------------- the families' models


def _config(family: str):
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    return tiny_config(family)


def _pair(family: str, mixer: str = "chunked"):
    cfg = _config(family)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", dtype=torch.float32)
    randomize(ref)
    eng = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(mixer=mixer), device="cpu", dtype=torch.float32)
    eng.load_state_dict(ref.state_dict(), strict=True)
    return cfg, ref, eng


def _engine_mixers(model) -> list[str]:
    return [type(m).__name__ for m in model.modules() if type(m).__module__.startswith("workbench.models.families")]


@pytest.mark.parametrize("family", HYBRIDS)
def test_chunked_mixer_model_equals_vanilla_transformers(family):
    cfg, ref, eng = _pair(family)
    assert engine_state(eng).backend.mixer == "chunked"
    swapped = _engine_mixers(eng)
    assert any("Mamba2" in n or "GatedDeltaNet" in n for n in swapped), swapped
    assert list(eng.state_dict()) == list(ref.state_dict())  # the same keys, in the same order
    # 70 tokens: two chunks of the gated delta rule (64), many of the tiny Mamba2 config's (4)
    ids = torch.randint(0, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(1))
    # return_logits: the default fused CE builds none (tests/test_fused_ce_default.py checks that path)
    out_ref, out_eng = ref(input_ids=ids, labels=ids), eng(input_ids=ids, labels=ids, return_logits=True)
    close(out_eng.logits, out_ref.logits, f"{family} logits")
    out_ref.loss.backward()
    out_eng.loss.backward()
    grads = dict(eng.named_parameters())
    for name, p in ref.named_parameters():
        if p.grad is not None:
            close(grads[name].grad, p.grad, f"{family} grad {name}")


@pytest.mark.parametrize("family", HYBRIDS)
def test_transformers_mixer_keeps_transformers_modules(family):
    _, _, eng = _pair(family, mixer="transformers")
    assert not _engine_mixers(eng)


@pytest.mark.parametrize("family", DOCUMENT_HYBRIDS)
def test_packed_documents_equal_each_document_alone(family):
    model = AutoModelForCausalLM.from_config(
        _config(family), backend=BackendConfig(mixer="chunked"), device="cpu", dtype=torch.float32
    )
    randomize(model)
    check_isolation(model.eval(), f"{family}/chunked mixer")


def test_an_output_gate_other_than_silu_keeps_transformers_mixer_by_refusal():
    # Qwen4-Exp's config may gate its Gated DeltaNet's norm with sigmoid; the engine's mixer computes SiLU
    _config("qwen4_exp_text")  # skips where this Transformers lacks it
    cfg = tiny_config("qwen4_exp_text", output_gate_type="sigmoid")
    with pytest.raises(ValueError, match=r"\['output gate sigmoid'\]: set BackendConfig.mixer='transformers'"):
        AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(mixer="chunked"), device="cpu", dtype=torch.float32)
    kept = AutoModelForCausalLM.from_config(
        cfg, backend=BackendConfig(mixer="transformers"), device="cpu", dtype=torch.float32
    )
    assert not _engine_mixers(kept)


# ---------------------------------------------------------------- the backend choice and the presets


def test_mixer_auto_is_an_engine_mixer_everywhere_and_transformers_is_a_choice():
    # an engine mixer by default on every device (it keeps packed documents apart, Transformers' torch path does
    # not): the Triton walk where Triton runs on CUDA, the torch walk where it does not
    hopper = Platform(device_type="cuda", capability=(9, 0), modules=frozenset({"triton"}))
    assert BackendConfig().resolve(hopper).mixer == "triton"
    assert BackendConfig().resolve(Platform(device_type="cuda", capability=(9, 0))).mixer == "chunked"
    assert BackendConfig().resolve("cpu").mixer == "chunked"
    assert BackendConfig(mixer="transformers").resolve("cpu").mixer == "transformers"


def test_a_mixer_function_that_cannot_compile_runs_eagerly_with_one_warning(caplog):
    def data_dependent(x):
        # a Python branch on a tensor's value: fullgraph compilation refuses it at the first call
        return x * 2 if float(x.sum()) > 0 else x - 1

    x = torch.randn(4, 8).abs()
    call = mixer_compile._compiled_or_eager(data_dependent)
    with caplog.at_level("WARNING", logger=mixer_compile.__name__):
        first, second = call(x), call(x)
    torch.testing.assert_close(first, x * 2, rtol=0, atol=0)
    torch.testing.assert_close(second, x * 2, rtol=0, atol=0)
    assert data_dependent in mixer_compile._COMPILE_FAILED
    warnings = [r for r in caplog.records if "runs eagerly from now on" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize(
    "preset,layers,types",
    [
        ("nemotron-3-nano-30b-a3b", 8, "MEMEM*EM"),
        ("qwen3.5-35b-a3b", 8, "LLLALLLA"),
        ("qwen3-next-80b-a3b", 6, "LLLALL"),
    ],
)
def test_preset_layers_keep_the_family_pattern(preset, layers, types):
    cfg = build_preset_config(preset, layers)
    letter = {"linear_attention": "L" if "qwen" in preset else "M", "full_attention": "A" if "qwen" in preset else "*"}
    letter["moe"] = "E"
    assert cfg.num_hidden_layers == layers
    assert "".join(letter[t] for t in cfg.layer_types) == types


def test_preset_layers_beyond_the_pattern_are_refused():
    with pytest.raises(ConfigError, match=r"layers=53 exceeds the 52 layers of this preset's pattern"):
        build_preset_config("nemotron-3-nano-30b-a3b", 53)


# ---------------------------------------------------------------- CUDA: the compiled path


@NEEDS_CUDA
@pytest.mark.parametrize("family", HYBRIDS)
def test_compiled_mixer_equals_eager_on_cuda(family):
    """The torch.compile'd mixers (CUDA) against the same math eager on the CPU, float32 values and gradients."""
    cfg, ref, eng = _pair(family)
    gpu = AutoModelForCausalLM.from_config(
        cfg, backend=BackendConfig(mixer="chunked"), device="cuda", dtype=torch.float32
    )
    gpu.load_state_dict(ref.state_dict(), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(1))
    out_cpu = eng(input_ids=ids, labels=ids, return_logits=True)  # the default fused CE would build no logits
    out_gpu = gpu(input_ids=ids.cuda(), labels=ids.cuda(), return_logits=True)
    torch.testing.assert_close(out_gpu.logits.cpu(), out_cpu.logits, rtol=1e-4, atol=1e-4)
    out_cpu.loss.backward()
    out_gpu.loss.backward()
    grads = dict(gpu.named_parameters())
    for name, p in eng.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name].grad.cpu(), p.grad, rtol=1e-3, atol=1e-4, msg=name)


@NEEDS_CUDA
@pytest.mark.parametrize("family", HYBRIDS)
def test_compiled_mixer_keeps_documents_apart_in_bf16(family):
    model = AutoModelForCausalLM.from_config(
        _config(family), backend=BackendConfig(mixer="chunked"), device="cuda", dtype=torch.bfloat16
    )
    randomize(model)
    check_isolation(model.eval(), f"{family}/chunked mixer bf16")
