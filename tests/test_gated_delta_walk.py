"""The gated delta rule's walk over its chunks in Triton (kernels/triton_gated_delta.py, BackendConfig.mixer='triton')
against the torch walk.

The kernel's outputs and the gradients of every input (the corrected values, the key/query reads, the within-chunk
attention, the keys into the state and the chunk decays) equal kernels/gated_delta.scan_chunks' in float32 on fresh
random inputs, with and without packed documents: in Triton's interpreter on a CPU machine, compiled on a GPU. A
Qwen3.5-MoE model with mixer='triton' equals the same model with mixer='chunked' (logits and every gradient), in the
interpreter here and against the eager CPU model on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from test_generic_families import randomize
from triton_script import DEVICES, run_triton_script

from workbench import BackendConfig
from workbench.backends import BackendError, Platform
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.mixer_gated_delta import walk_supported
from workbench.presets import build_preset_config

SCRIPT = r"""
import sys
import torch
from workbench.kernels.gated_delta import chunk_prepare, scan_chunks
from workbench.kernels.triton_gated_delta import walk_chunks

device = sys.argv[1]
gen = torch.Generator().manual_seed(7)


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device).requires_grad_()


def close(a, b, what):
    # float32 sums of a few hundred products in another order: within 1e-5 of the tensor's scale (84 units of its
    # last place), elementwise, which a wrong term or a lost block of V columns exceeds by orders of magnitude
    diff, tol = (a - b).abs().max().item(), 1e-5 * max(b.abs().max().item(), 1.0)
    assert diff <= tol, f"{what}: max |diff| {diff:.3g} > {tol:.3g}"


def compare(inputs, what):
    want = scan_chunks(inputs)
    got = walk_chunks(inputs)
    close(got, want, what)
    w = torch.randn(want.shape, generator=gen).to(device)
    want_grads = torch.autograd.grad((want * w).sum(), inputs)
    got_grads = torch.autograd.grad((got * w).sum(), inputs)
    for name, a, b in zip(("u", "w_and_q", "attn", "k_out", "decay"), got_grads, want_grads):
        close(a, b, f"{what}: d{name}")


# the walk's own inputs, random (two V blocks: V = 128 > the kernel's 64 columns a program)
B, H, c, L, K, V = 2, 3, 5, 16, 32, 128
decay = (torch.rand(B, H, c, 1, 1, generator=gen) * 0.5 + 0.4).to(device).requires_grad_()
compare((rand(B, H, c, L, V), rand(B, H, c, 2 * L, K, scale=0.2), rand(B, H, c, L, L, scale=0.3),
         rand(B, H, c, L, K, scale=0.2), decay), "random inputs")

# chunk_prepare's, from q, k, v, g, beta over 70 tokens (the last chunk padded), one row of three packed documents
S, heads = 70, 2
q, k, v = rand(B, S, heads, 16), rand(B, S, heads, 16), rand(B, S, heads, 32)
g = (-torch.rand(B, S, heads, generator=gen) * 0.5).to(device)
beta = torch.rand(B, S, heads, generator=gen).to(device)
starts = torch.zeros(B, S, dtype=torch.bool)
starts[:, 0] = True
starts[1, [23, 40]] = True
for docs in (None, starts.to(device)):
    prepared = chunk_prepare(q, k, v, g, beta, 16, docs)
    compare(tuple(t.detach().requires_grad_() for t in prepared), f"chunk_prepare, documents {docs is not None}")
# Qwen3.5's widths (keys and values 128, chunks of 64): two V blocks forward, four backward
B, H, c, L, K, V = 1, 2, 3, 64, 128, 128
decay = (torch.rand(B, H, c, 1, 1, generator=gen) * 0.5 + 0.4).to(device).requires_grad_()
compare((rand(B, H, c, L, V), rand(B, H, c, 2 * L, K, scale=0.1), rand(B, H, c, L, L, scale=0.1),
         rand(B, H, c, L, K, scale=0.1), decay), "Qwen3.5's widths")

print("WALK EQUAL")
"""


@pytest.mark.parametrize("device", DEVICES)
def test_triton_walk_equals_the_torch_walk(device):
    run_triton_script(SCRIPT, device, "WALK EQUAL")


def test_the_walk_takes_only_widths_its_dot_products_can():
    assert walk_supported(128, 128, 64) and walk_supported(16, 32, 16)
    assert not walk_supported(8, 32, 64)  # a tiny test model's keys: the torch walk
    assert not walk_supported(96, 128, 64) and not walk_supported(512, 128, 64)


MODEL_SCRIPT = r"""
import sys
import torch
import transformers
sys.path.insert(0, "tests")
from test_generic_families import randomize
from workbench import BackendConfig
from workbench.models.auto import AutoModelForCausalLM
from workbench.presets import build_preset_config

cfg = build_preset_config("tiny-qwen3.5-moe", None)
ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
randomize(ref)
models = {}
for mixer in ("chunked", "triton"):
    models[mixer] = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(mixer=mixer), dtype=torch.float32)
    models[mixer].load_state_dict(ref.state_dict(), strict=True)
walks = [m.triton_walk for m in models["triton"].modules() if hasattr(m, "triton_walk")]
assert walks and all(walks), walks
assert not any(m.triton_walk for m in models["chunked"].modules() if hasattr(m, "triton_walk"))
ids = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(3))
out = {k: m(input_ids=ids, labels=ids, return_logits=True) for k, m in models.items()}
scale = out["chunked"].logits.abs().max().item()
diff = (out["triton"].logits - out["chunked"].logits).abs().max().item()
assert diff <= 1e-5 * max(scale, 1.0), (diff, scale)
for o in out.values():
    o.loss.backward()
grads = dict(models["triton"].named_parameters())
for name, p in models["chunked"].named_parameters():
    if p.grad is not None:
        g = grads[name].grad
        assert (g - p.grad).abs().max().item() <= 1e-4 * max(p.grad.abs().max().item(), 1e-3), name
print("MODEL EQUAL")
"""


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernel instead (the [cuda] case)"
)
def test_qwen3_5_model_with_the_triton_walk_equals_the_torch_walk_in_the_interpreter():
    run_triton_script(MODEL_SCRIPT, "cpu", "MODEL EQUAL")


def test_mixer_triton_is_the_default_where_triton_runs_and_chunked_a_choice():
    hopper = Platform(device_type="cuda", capability=(9, 0), modules=frozenset({"triton"}))
    assert BackendConfig().resolve(hopper).mixer == "triton"
    assert BackendConfig(mixer="chunked").resolve(hopper).mixer == "chunked"
    assert BackendConfig().resolve(Platform(device_type="cuda", capability=(9, 0))).mixer == "chunked"
    with pytest.raises(BackendError, match=r"mixer='triton' needs a CUDA device, got cpu; use 'chunked'"):
        BackendConfig(mixer="triton").resolve(Platform(device_type="cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton walk runs on CUDA (the CPU runs the torch walk)")
def test_qwen3_5_model_with_the_triton_walk_equals_the_eager_model():
    cfg = build_preset_config("tiny-qwen3.5-moe", None)
    assert walk_supported(cfg.linear_key_head_dim, cfg.linear_value_head_dim, 64)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(ref)
    models = {}
    for device in ("cpu", "cuda"):
        models[device] = AutoModelForCausalLM.from_config(
            cfg, backend=BackendConfig(mixer="chunked"), device=device, dtype=torch.float32
        )
        models[device].load_state_dict(ref.state_dict(), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(3))
    cpu = models["cpu"](input_ids=ids, labels=ids, return_logits=True)
    gpu = models["cuda"](input_ids=ids.cuda(), labels=ids.cuda(), return_logits=True)
    # 2.7e-4 at most on an H100 (2026-12-06): the GPU's float32 solve and reductions in another order than the CPU's
    torch.testing.assert_close(gpu.logits.cpu(), cpu.logits, rtol=1e-3, atol=5e-4)
    cpu.loss.backward()
    gpu.loss.backward()
    grads = dict(models["cuda"].named_parameters())
    for name, p in models["cpu"].named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name].grad.cpu(), p.grad, rtol=1e-3, atol=1e-4, msg=name)


# What an H100 or H200 gives one block (227 KiB): the forward at these widths asked for 288 KiB with triton's
# default three pipeline stages on an H100 (2026-12-06) and failed at launch; compiled here for sm_90 without a GPU.
HOPPER_SHARED_BYTES = 232448


@pytest.mark.slow
def test_walk_kernels_fit_hoppers_shared_memory_at_qwen3_5_widths():
    triton = pytest.importorskip("triton")
    compiler = pytest.importorskip("triton.compiler")
    from triton.backends.compiler import GPUTarget

    from workbench.kernels import triton_gated_delta as walk

    def shared_bytes(kernel, pointers, ints, block_v):
        signature = dict.fromkeys(pointers, "*fp32") | dict.fromkeys(ints, "i32")
        constants = {"K": 128, "V": 128, "L": 64, "BV": block_v}
        source = compiler.ASTSource(
            fn=kernel, signature=signature | dict.fromkeys(constants, "constexpr"), constexprs=constants
        )
        options = {"num_warps": walk.WARPS, "num_stages": walk.STAGES}
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared

    forward = shared_bytes(walk._walk_fwd, ["U", "WQ", "KO", "D", "S_IN", "VN"], ["n_chunks"], walk.BLOCK_V)
    backward = shared_bytes(
        walk._walk_bwd, ["DVN_A", "QT_DO", "WQ", "KO", "D", "DVN", "DS_OUT"], ["n_chunks"], walk.BLOCK_V
    )
    assert forward <= HOPPER_SHARED_BYTES and backward <= HOPPER_SHARED_BYTES, (forward, backward)
