"""The input embedding's gradient from the Triton kernel that writes each table row once with its sum of squares
(kernels/triton_embedding.py, kernels/embedding.py, models/input_embedding.py, BackendConfig.embedding)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch
from torch import nn
from triton_script import DEVICES, run_triton_script

from workbench import BackendConfig
from workbench.backends import BackendError
from workbench.models.input_embedding import EngineEmbedding, is_plain_embedding, use_engine_embeddings

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)"
)

_KERNEL_SCRIPT = textwrap.dedent("""
import sys, torch
import torch.nn.functional as F
from workbench.kernels.triton_embedding import embedding_backward

device = sys.argv[1]
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for V, D, T, pad in ((50, 48, 37, None), (30, 1100, 64, 3), (7, 16, 0, None), (5, 32, 203, None)):
        ids = torch.randint(0, V, (T,), generator=g)
        if T:
            ids[:5] = ids[0]  # a row several tokens share
            if pad is not None:
                ids[-3:] = pad
        ids = ids.to(device)
        grad = torch.randn(T, D, generator=g).to(dtype).to(device)
        got, partials = embedding_backward(grad, ids, V, pad)
        ref = torch.zeros(V, D, dtype=torch.float64, device=device).index_add_(0, ids, grad.double())
        if pad is not None:
            ref[pad] = 0
        assert got.dtype == dtype and got.shape == (V, D)
        # float32 sums, one rounding (the interpreter's bf16 casts truncate: up to one bf16 step)
        step = 2**-7 if dtype == torch.bfloat16 else 2**-20
        bad = (got.double() - ref).abs() > step * ref.abs() + 1e-6
        assert not bad.any(), (dtype, V, D, (got.double() - ref).abs().max().item())
        assert (got[ref.abs().sum(1) == 0] == 0).all()  # untouched rows are written as zeros, not left unset
        want = got.float().square().sum()
        assert partials.shape == (V,) and abs(partials.sum().item() - want.item()) <= 1e-5 * want.item() + 1e-12
        # torch's own embedding gradient
        w = torch.zeros(V, D, dtype=dtype, device=device, requires_grad=True)
        F.embedding(ids, w, pad).backward(grad)
        err = (got.double() - w.grad.double()).norm() / max(w.grad.double().norm(), 1e-30)
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-6), (dtype, err)
print("EMBEDDING KERNEL OK")
""")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_kernel_matches_float64_with_its_squares(device):
    run_triton_script(_KERNEL_SCRIPT, device, "EMBEDDING KERNEL OK")


_MODEL_SCRIPT = textwrap.dedent("""
import sys, torch
sys.path.insert(0, "tests")
from tiny_models import tiny_qwen3_moe
import workbench
from workbench.kernels import grad_squares
from workbench.models.input_embedding import EngineEmbedding
from workbench.train.optim import total_grad_norm

device = sys.argv[1]
cfg = tiny_qwen3_moe(hidden_size=64, moe_intermediate_size=32, head_dim=16)
models = {}
for embedding in ("torch", "triton"):
    backend = workbench.BackendConfig(experts="grouped_mm", embedding=embedding)
    models[embedding] = workbench.AutoModelForCausalLM.from_config(cfg, backend=backend, device=device,
                                                                    dtype=torch.bfloat16, seed=0)
models["triton"].load_state_dict(models["torch"].state_dict())
table = models["triton"].get_input_embeddings()
assert type(table) is EngineEmbedding and type(models["torch"].get_input_embeddings()) is torch.nn.Embedding
ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2)).to(device)
ids[0, :4] = ids[0, 0]
for model in models.values():
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
ref = dict(models["torch"].named_parameters())
for name, p in models["triton"].named_parameters():
    r = ref[name].grad.float()
    err = ((p.grad.float() - r).norm() / r.norm()).item()
    assert err < (1e-2 if p is table.weight else 1e-6), (name, err)
    assert hasattr(p, grad_squares.ATTR) == (p is table.weight), name
# autograd took the kernel's tensor as .grad (a copy would leave the squares unused)
assert getattr(table.weight, grad_squares.ATTR).ptr == table.weight.grad.data_ptr()
params = list(models["triton"].parameters())
want = torch.cat([p.grad.float().flatten() for p in params]).norm()
got = total_grad_norm(params)
assert abs(got.item() - want.item()) <= 1e-4 * want.item(), (got, want)
assert not hasattr(table.weight, grad_squares.ATTR)  # the norm took the record
# a second backward accumulates into .grad: the recorded squares no longer describe it and the norm reads it
for model in models.values():
    model(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()
want = torch.cat([p.grad.float().flatten() for p in params]).norm()
assert abs(total_grad_norm(params).item() - want.item()) <= 1e-4 * want.item()
# a table tied to the lm_head: its .grad is the sum of both gradients, so the kernel's squares must not be used
tied_cfg = tiny_qwen3_moe(hidden_size=64, moe_intermediate_size=32, head_dim=16, tie_word_embeddings=True)
backend = workbench.BackendConfig(experts="grouped_mm", embedding="triton")
tied = workbench.AutoModelForCausalLM.from_config(tied_cfg, backend=backend, device=device, dtype=torch.bfloat16,
                                                  seed=0)
assert tied.get_input_embeddings().weight is tied.get_output_embeddings().weight
tied(input_ids=ids, labels=ids).loss.backward()
params = list(tied.parameters())
want = torch.cat([p.grad.float().flatten() for p in params]).norm()
assert abs(total_grad_norm(params).item() - want.item()) <= 1e-4 * want.item(), (total_grad_norm(params), want)
print("EMBEDDING MODEL OK")
""")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_engine_embedding_gradient_and_the_norm_that_takes_its_squares(device):
    run_triton_script(_MODEL_SCRIPT, device, "EMBEDDING MODEL OK")


def test_only_a_plain_input_embedding_is_swapped():
    class Tiny(nn.Module):
        def __init__(self, table):
            super().__init__()
            self.table = table

        def get_input_embeddings(self):
            return self.table

    assert use_engine_embeddings(Tiny(nn.Embedding(10, 4)), "torch") == 0
    for refused in (nn.Embedding(10, 4, max_norm=1.0), nn.Embedding(10, 4, scale_grad_by_freq=True),
                    nn.Embedding(10, 4, sparse=True)):  # fmt: skip
        assert not is_plain_embedding(refused)
        assert use_engine_embeddings(Tiny(refused), "triton") == 0 and type(refused) is nn.Embedding
    plain = nn.Embedding(10, 4, padding_idx=2)
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    assert use_engine_embeddings(Tiny(plain), "triton") == 1 and type(plain) is EngineEmbedding
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in state.items())  # same parameter, same names


def test_embedding_backend_resolves_and_refuses_triton_without_cuda():
    assert BackendConfig().resolve("cpu").embedding == "torch"
    with pytest.raises(BackendError, match=r"embedding='triton' needs a CUDA device.*use 'torch'"):
        BackendConfig(embedding="triton").resolve("cpu")
    with pytest.raises(BackendError, match="unknown embedding backend"):
        BackendConfig(embedding="sparse")


@needs_triton
def test_kernel_compiles_for_sm90_without_spills():
    # the interpreter does not compile: this catches what only the GPU's compiler would refuse
    from compile_sm90 import compile_for_h200

    from workbench.kernels.triton_embedding import BLOCK_D, BLOCK_T, _embedding_bwd_kernel

    types = dict(G="*bf16", ORDER="*i32", ENDS="*i32", DW="*bf16", PARTIALS="*fp32", stride_g="i32")
    types.update(stride_dw="i32", D="i32", PAD="i32")
    aligned = ("G", "DW", "stride_g", "stride_dw", "D")
    for pad in (False, True):
        flags = dict(BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, HAS_PAD=pad)
        kernel = compile_for_h200(_embedding_bwd_kernel, types, flags, divisible=aligned)
        ptx = kernel.asm["ptx"]
        assert "ld.local" not in ptx and "st.local" not in ptx  # no spills
        assert "st.global.v4.b32" in ptx and "ld.global.v4.b32" in ptx  # 16-byte loads and stores of the rows
        # the sum over the tokens stays in registers: shared memory only for the row's one sum of squares
        assert kernel.metadata.shared <= 64, kernel.metadata.shared
