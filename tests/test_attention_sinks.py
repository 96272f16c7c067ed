"""The engine's sink-aware attention (GPT-OSS): parity with vanilla Transformers' eager, packed documents, selection."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import transformers
from generic_families import tiny_config
from test_generic_families import close, randomize

from workbench import BackendConfig
from workbench.backends import BackendError
from workbench.models import attention_sinks as sinks_mod
from workbench.models.attention_sinks import (
    SINK_ATTENTION,
    dense_mask,
    reference_attention,
    sdpa_extra_dim,
    select_attention,
    sink_attention,
    use_sink_attention,
)
from workbench.models.auto import AutoModelForCausalLM

SEQ = 12
WINDOW = 4  # < SEQ: the sliding layer's window matters


def _gpt_oss_pair():
    """Vanilla eager GPT-OSS (both layer types, fresh random weights incl. nonzero sinks) and its engine twin."""
    cfg = tiny_config("gpt_oss", sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomize(ref)
    for layer in ref.model.layers:
        assert layer.self_attn.sinks.abs().min() > 0
    eng = copy.deepcopy(ref)
    use_sink_attention(eng)
    assert eng.config._attn_implementation == SINK_ATTENTION and ref.config._attn_implementation == "eager"
    return ref, eng


def _no_fallback():
    """Turn the eager-math fallback's warning into an error: these calls must run the fused kernel's math."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("error", message=".*workbench_sinks.*eager math.*")
    return ctx


def _loss_and_grads(model, ids, position_ids=None):
    out = model(input_ids=ids, position_ids=position_ids)
    weights = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(7))
    (out.logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grads


def test_gpt_oss_logits_and_grads_equal_eager():
    ref, eng = _gpt_oss_pair()
    ids = torch.randint(0, ref.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    want_logits, want = _loss_and_grads(ref, ids)
    ctx = _no_fallback()
    try:
        got_logits, got = _loss_and_grads(eng, ids)
    finally:
        ctx.__exit__(None, None, None)
    close(got_logits, want_logits, "logits")
    assert set(got) == set(want)
    for name in want:
        close(got[name], want[name], name)
    for i in range(2):  # the sinks' own gradient, on both layer types
        assert want[f"model.layers.{i}.self_attn.sinks"].abs().max() > 0


def test_packed_documents_equal_separate_runs():
    """Two documents in one row (position_ids restarting): each equals running it alone, logits and grads."""
    ref, eng = _gpt_oss_pair()
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, ref.config.vocab_size, (1, 7), generator=g)
    b = torch.randint(0, ref.config.vocab_size, (1, SEQ - 7), generator=g)
    packed = torch.cat([a, b], dim=1)
    position_ids = torch.cat([torch.arange(7), torch.arange(SEQ - 7)])[None]
    ctx = _no_fallback()
    try:
        out = eng(input_ids=packed, position_ids=position_ids).logits
        out.sum().backward()
    finally:
        ctx.__exit__(None, None, None)
    got = {n: p.grad.clone() for n, p in eng.named_parameters() if p.grad is not None}
    la, lb = ref(input_ids=a).logits, ref(input_ids=b).logits
    (la.sum() + lb.sum()).backward()
    close(out[:, :7].detach(), la.detach(), "logits of document 1")
    close(out[:, 7:].detach(), lb.detach(), "logits of document 2")
    for name, p in ref.named_parameters():
        if p.grad is not None:
            close(got[name], p.grad, name)


def test_padding_mask_falls_back_to_eager_math():
    """A padding mask runs the eager math (warned) and equals vanilla eager on the real tokens."""
    ref, eng = _gpt_oss_pair()
    ids = torch.randint(0, ref.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    want = ref(input_ids=ids, attention_mask=mask).logits
    with pytest.warns(UserWarning, match="padding attention mask"):
        got = eng(input_ids=ids, attention_mask=mask).logits
    close(got[0], want[0], "unpadded row")
    close(got[1, 3:], want[1, 3:], "padded row, real tokens")


def _qkv(b=2, h=4, hkv=2, s=SEQ, d=8, seed=4):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, s, d, generator=g).requires_grad_() for n in (h, hkv, hkv))
    return q, k, v, (torch.randn(h, generator=g) + 1).requires_grad_()


def _fwd_bwd(fn, q, k, v, sinks):
    out = fn()
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.device)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v, sinks))
    return (out, *grads)


def test_sdpa_extra_dim_equals_reference():
    """The public-SDPA option (sink as an extra key over extra head dims) is exact, sinks' grad included."""
    q, k, v, s = _qkv()
    allowed = dense_mask(SEQ, SEQ, None, None, None, q.device)
    want = _fwd_bwd(lambda: reference_attention(q, k, v, s, 0.3, allowed), q, k, v, s)
    got = _fwd_bwd(lambda: sdpa_extra_dim(q, k, v, s, 0.3), q, k, v, s)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        close(a, b, name)


class _VarlenOnCpu(sinks_mod._FlashVarlen):
    """Stand-in for torch's CUDA varlen flash kernel (absent on CPU): its layouts and window rule, per document.

    Same contract as the CUDA op: q/k/v [T, H, D], cu_seqlens, left window inclusive, lse [H, T]; computed
    with the CPU flash op on each document, so the glue around the CUDA kernel (cu_seqlens, the window
    conversion, the [H, T] lse layout, the sinks' gradient in that layout) runs for real.
    """

    def _segments(self):
        cu = self.cu.tolist()
        return list(itertools.pairwise(cu))

    def _mask(self, n, dtype):
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        ok = (j <= i) & ((i - j <= self.left) if self.left is not None else True)
        return torch.zeros(n, n, dtype=dtype).masked_fill(~ok, float("-inf"))

    @staticmethod
    def _bhsd(t, rep):
        return t.transpose(0, 1)[None].repeat_interleave(rep, dim=1)

    def forward(self, q, k, v):
        rep = q.shape[1] // k.shape[1]
        outs, lses = [], []
        for a, b in self._segments():
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                self._bhsd(q[a:b], 1),
                self._bhsd(k[a:b], rep),
                self._bhsd(v[a:b], rep),
                0.0,
                False,
                attn_mask=self._mask(b - a, q.dtype),
                scale=self.scaling,
            )
            outs.append(o[0].transpose(0, 1))
            lses.append(lse[0])
        return torch.cat(outs).contiguous(), torch.cat(lses, dim=1).contiguous(), None

    def backward(self, dout, q, k, v, out, lse, state):
        rep = q.shape[1] // k.shape[1]
        dq, dk, dv = [], [], []
        for a, b in self._segments():
            g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                self._bhsd(dout[a:b], 1),
                self._bhsd(q[a:b], 1),
                self._bhsd(k[a:b], rep),
                self._bhsd(v[a:b], rep),
                self._bhsd(out[a:b], 1),
                lse[:, a:b][None].contiguous(),
                0.0,
                False,
                attn_mask=self._mask(b - a, q.dtype),
                scale=self.scaling,
            )
            dq.append(g[0][0].transpose(0, 1))
            for acc, t in ((dk, g[1]), (dv, g[2])):
                t = t[0].view(k.shape[1], rep, b - a, -1).sum(1)  # fold the repeated heads back (GQA)
                acc.append(t.transpose(0, 1))
        return torch.cat(dq), torch.cat(dk), torch.cat(dv)


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("packed", [False, True])
def test_flash_varlen_glue_equals_reference(monkeypatch, window, packed):
    """The CUDA path's glue (varlen layout, window, documents, sinks) equals eager math, kernel stood in on CPU."""
    monkeypatch.setattr(sinks_mod, "_FlashVarlen", _VarlenOnCpu)
    q, k, v, s = _qkv()
    pos = torch.cat([torch.arange(5), torch.arange(SEQ - 5)])[None].expand(2, -1) if packed else None
    starts = sinks_mod.document_starts(pos, 2, SEQ, q.device)
    allowed = dense_mask(SEQ, SEQ, window, starts, None, q.device)
    want = _fwd_bwd(lambda: reference_attention(q, k, v, s, 0.3, allowed), q, k, v, s)
    got = _fwd_bwd(lambda: sink_attention(q, k, v, s, 0.3, window, pos, kernel="flash"), q, k, v, s)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        close(a, b, name)


class _CudnnOnCpu(sinks_mod._CudnnSdpa):
    """Stand-in for torch's CUDA cuDNN attention op (absent on CPU), with its contract: q [B, H, S, D] and k/v with
    fewer heads (GQA), out shaped as q, lse [B, H, S, 1] (the shape torch returns on some versions), the backward
    given (out, lse) and dO; computed with the CPU flash op, so the runner's glue around the kernel runs for real."""

    def forward(self, q, k, v):
        rep = q.shape[1] // k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), 0.0, True, scale=self.scaling
        )
        return out, lse.reshape(*lse.shape[:3]), ((*lse.shape[:3], 1),)

    def backward(self, dout, q, k, v, out, lse, state):
        rep = q.shape[1] // k.shape[1]
        assert tuple(lse.reshape(state[0]).shape) == state[0]  # the lse handed back keeps the op's own shape
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), out, lse, 0.0, True, scale=self.scaling
        )
        fold = lambda t: t.view(k.shape[0], k.shape[1], rep, *t.shape[2:]).sum(2)  # noqa: E731 (GQA heads back)
        return dq, fold(dk), fold(dv)


def test_cudnn_runner_glue_equals_reference(monkeypatch):
    """The cuDNN path's glue (GQA as given, lse layout, sinks' gradient) equals eager math, kernel stood in on CPU."""
    monkeypatch.setattr(sinks_mod, "_CudnnSdpa", _CudnnOnCpu)
    q, k, v, s = _qkv()
    allowed = dense_mask(SEQ, SEQ, None, None, None, q.device)
    want = _fwd_bwd(lambda: reference_attention(q, k, v, s, 0.3, allowed), q, k, v, s)
    got = _fwd_bwd(lambda: sink_attention(q, k, v, s, 0.3, None, None, kernel="cudnn"), q, k, v, s)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        close(a, b, name)


def test_full_only_kernels_refuse_windows_and_documents_and_auto_falls_back(monkeypatch):
    q, k, v, s = _qkv()
    pos = torch.cat([torch.arange(5), torch.arange(SEQ - 5)])[None].expand(2, -1)
    for kernel in sinks_mod.FULL_ONLY:
        with pytest.raises(ValueError, match="full causal attention of unpacked rows only"):
            sink_attention(q, k, v, s, 0.3, WINDOW, None, kernel=kernel)
        with pytest.raises(ValueError, match="full causal attention of unpacked rows only"):
            sink_attention(q, k, v, s, 0.3, None, pos, kernel=kernel)
    monkeypatch.setitem(sinks_mod.CUDA_KERNEL, "full", "cudnn")
    cuda = torch.device("cuda")
    assert sinks_mod.pick_kernel(cuda, None, packed=False) == "cudnn"
    assert sinks_mod.pick_kernel(cuda, WINDOW, packed=False) == "flash"
    assert sinks_mod.pick_kernel(cuda, None, packed=True) == "flash"
    assert sinks_mod.pick_kernel(cuda, None, packed=False, head_dim=sinks_mod.CUDNN_MAX_HEAD_DIM) == "cudnn"
    assert sinks_mod.pick_kernel(cuda, None, packed=False, head_dim=2 * sinks_mod.CUDNN_MAX_HEAD_DIM) == "flash"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's cuDNN attention needs a CUDA GPU")
def test_cudnn_kernel_equals_flash_and_float32_reference_on_cuda():
    """The real cuDNN op (bf16, GPT-OSS's head dim 64, GQA 4:1) against the flash path and float32 eager math."""
    g = torch.Generator(device="cuda").manual_seed(8)
    b, h, hkv, seq, d = 2, 8, 2, 512, 64
    q = torch.randn(b, seq, h, d, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)  # as q_proj's view
    k, v = (torch.randn(b, hkv, seq, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    s = (torch.randn(h, device="cuda", generator=g) + 1).to(torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, s)]
    allowed = dense_mask(seq, seq, None, None, None, q.device)
    ref32 = [t.float().detach().requires_grad_() for t in leaves]
    want = _fwd_bwd(lambda: reference_attention(*ref32, d**-0.5, allowed), *ref32)
    errors = {}
    for kernel in ("cudnn", "flash"):
        got = _fwd_bwd(lambda kernel=kernel: sink_attention(*leaves, d**-0.5, None, None, kernel=kernel), *leaves)
        assert got[0].dtype == torch.bfloat16 and torch.isfinite(got[0]).all()
        errors[kernel] = [((a.float() - w).norm() / w.norm()).item() for a, w in zip(got, want)]
    for name, cudnn, flash in zip(("out", "dq", "dk", "dv", "dsinks"), errors["cudnn"], errors["flash"]):
        # both are the exact sink softmax in bf16: cuDNN's error at the flash kernel's level
        assert cudnn <= 2 * flash + 1e-3 and cudnn < 3e-2, f"{name}: cudnn {cudnn:.3g}, flash {flash:.3g}"


def test_generic_path_selects_sink_attention_for_gpt_oss_only():
    """attention='auto': GPT-OSS gets the engine's sink attention; Mixtral (no sinks) keeps Transformers' choice."""
    gpt = AutoModelForCausalLM.from_config(tiny_config("gpt_oss"), device="cpu")
    assert gpt.config._attn_implementation == SINK_ATTENTION
    mix_cfg = tiny_config("mixtral", sliding_window=None)
    vanilla = transformers.AutoModelForCausalLM.from_config(mix_cfg)
    mix = AutoModelForCausalLM.from_config(mix_cfg, device="cpu")
    assert mix.config._attn_implementation == vanilla.config._attn_implementation != SINK_ATTENTION


def test_explicit_sinks_on_mixtral_equals_vanilla():
    """attention='sinks' on a family without sinks is plain causal attention: logits equal vanilla's."""
    cfg = tiny_config("mixtral", sliding_window=None)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    randomize(ref)
    eng = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(attention="sinks"), device="cpu")
    eng.load_state_dict(ref.state_dict())
    assert eng.config._attn_implementation == SINK_ATTENTION
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(6))
    close(eng(input_ids=ids).logits, ref(input_ids=ids).logits, "logits")


def test_te_attention_is_the_model_attention_where_it_is_asked_for():
    # attention='te' once set nothing on the generic path: Transformers' sdpa ran under the 'te' name
    from workbench.kernels.te_attention import TE_ATTENTION, te_attention_forward

    model = transformers.AutoModelForCausalLM.from_config(tiny_config("mixtral", sliding_window=None))
    assert select_attention(model, "te") == TE_ATTENTION
    assert model.config._attn_implementation == TE_ATTENTION
    assert transformers.AttentionInterface()[TE_ATTENTION] is te_attention_forward
    assert select_attention(transformers.AutoModelForCausalLM.from_config(tiny_config("mixtral")), "sdpa") is None


def test_te_attention_refused_for_sinks():
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("gpt_oss"))
    with pytest.raises(BackendError, match="attention='te' cannot run the attention sinks"):
        select_attention(model, "te")


_TRITON_GLUE_SCRIPT = """
import sys, torch
sys.path.insert(0, "tests")
import test_attention_sinks as t
from workbench.models import attention_sinks as sinks_mod
from workbench.models.attention_sinks import sink_attention

# the CUDA runners stood in on CPU (their layouts: varlen [T, H, D] with lse [H, T]; cuDNN's [B, H, S, D]), the
# sink's glue on the Triton kernels in the interpreter against the torch ops
sinks_mod._FlashVarlen, sinks_mod._CudnnSdpa = t._VarlenOnCpu, t._CudnnOnCpu
q, k, v, s = t._qkv(d=12)  # a head dim that is no power of two: the kernels' column mask
pos = torch.cat([torch.arange(5), torch.arange(t.SEQ - 5)])[None].expand(2, -1)
for kernel, window, position_ids in (("flash", t.WINDOW, None), ("flash", None, pos), ("cudnn", None, None)):
    runs = [
        t._fwd_bwd(lambda: sink_attention(q, k, v, s, 0.3, window, position_ids, kernel=kernel, glue=g), q, k, v, s)
        for g in ("triton", "torch")
    ]
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), *runs):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6), (kernel, name, (a - b).abs().max())
print("SINK GLUE OK")
"""


@pytest.mark.slow  # Triton's interpreter on a CPU machine (tests/triton_script.py)
def test_sink_glue_triton_equals_torch_ops_in_the_interpreter():
    """The Triton kernels for the sink's scaling and gradient equal the torch ops, for both CUDA runners' layouts."""
    from test_kernels import _run_script

    _run_script(_TRITON_GLUE_SCRIPT, "SINK GLUE OK", interpret=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton glue needs a CUDA GPU")
def test_sink_glue_triton_equals_torch_ops_on_cuda():
    """Compiled glue against the torch ops on the real kernels (bf16, GPT-OSS's head dim 64, both layer types)."""
    g = torch.Generator(device="cuda").manual_seed(9)
    b, h, hkv, seq, d = 2, 8, 2, 1024, 64
    q = torch.randn(b, seq, h, d, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(b, hkv, seq, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    s = (torch.randn(h, device="cuda", generator=g) + 1).to(torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, s)]

    def run(kernel, window, glue):
        return _fwd_bwd(lambda: sink_attention(*leaves, d**-0.5, window, None, kernel=kernel, glue=glue), *leaves)

    for kernel, window in (("cudnn", None), ("flash", 128), ("flash", None)):
        got, want = run(kernel, window, "triton"), run(kernel, window, "torch")
        for name, a, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
            err = ((a.float() - w.float()).norm() / w.float().norm()).item()
            assert err < 1e-2, f"{kernel} window {window} {name}: {err:.3g}"
