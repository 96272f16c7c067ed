"""The dense SwiGLU MLPs (shared experts, dense layers) on the fused SwiGLU kernel (models/swiglu_mlp.py).

Which modules qualify is checked on each module's own forward (CPU, no Triton); the whole tiny engine with the
kernel against Transformers in float32 runs in Triton's interpreter on the CPU and compiled on a GPU.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import transformers
from generic_families import tiny_config
from torch import nn
from triton_script import run_triton_script

from workbench.models.swiglu_mlp import is_standard_swiglu_mlp, use_swiglu_mlps

# Families whose tiny configs hold dense SwiGLU MLPs (shared experts; DeepSeek-V3 and GLM-4 MoE a dense layer too)
WITH_MLPS = ["deepseek_v3", "qwen2_moe", "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe"]


def _vanilla(family: str) -> nn.Module:
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family))


@pytest.mark.parametrize("family", WITH_MLPS)
def test_the_families_dense_mlps_qualify_and_nothing_else(family):
    model = _vanilla(family)
    found = [type(m).__name__ for m in model.modules() if is_standard_swiglu_mlp(m)]
    assert found and all("MLP" in name or "Expert" in name for name in found), found
    assert use_swiglu_mlps(model, "torch") == 0  # the torch path is Transformers' own forward
    assert not any(type(m).__name__.startswith("Engine") for m in model.modules())


def test_variants_keep_their_own_forward():
    model = _vanilla("deepseek_v3")
    mlp = next(m for m in model.modules() if is_standard_swiglu_mlp(m))
    gelu = type(mlp).__new__(type(mlp))
    gelu.__dict__.update(mlp.__dict__)
    gelu.act_fn = nn.GELU()  # another activation: down(gelu(gate) * up)
    assert not is_standard_swiglu_mlp(gelu)

    class Scaled(type(mlp)):
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = Scaled.__new__(Scaled)
    scaled.__dict__.update(mlp.__dict__)
    assert not is_standard_swiglu_mlp(scaled)
    extra = type(mlp).__new__(type(mlp))
    extra.__dict__.update(mlp.__dict__)
    extra._modules = {**mlp._modules, "norm": nn.LayerNorm(4)}  # a child the formula does not have
    assert not is_standard_swiglu_mlp(extra)
    assert not is_standard_swiglu_mlp(nn.Linear(3, 3))


_SCRIPT = textwrap.dedent("""
import sys, torch, transformers
sys.path.insert(0, "tests")
from generic_families import tiny_config
from test_parity import fresh_batch, forward_backward, rel_err
import workbench
device = sys.argv[1]
for family in ("deepseek_v3", "qwen2_moe"):
    cfg = tiny_config(family)
    torch.manual_seed(5)
    hf_model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").float()
    backend = workbench.BackendConfig(experts="grouped_mm", swiglu="triton", rms_norm="torch", rope="torch")
    engine = workbench.AutoModelForCausalLM.from_config(cfg, backend=backend, device=device)
    engine.load_state_dict(hf_model.state_dict())
    swapped = [type(m).__name__ for m in engine.modules() if type(m).__name__.startswith("Engine")]
    assert any(name.endswith("MLP") for name in swapped), (family, swapped)
    hf_model.to(device)
    ids, labels = (t.to(device) for t in fresh_batch(cfg, 6))
    ref, ref_grads = forward_backward(hf_model, ids, labels)
    out, grads = forward_backward(engine, ids, labels)
    tol = 1e-5 if device == "cpu" else 1e-4
    errs = rel_err(out.loss, ref.loss), rel_err(out.logits, ref.logits)
    assert max(errs) < tol, (family, errs)
    for name, gr in ref_grads.items():
        assert rel_err(grads[name], gr) < tol, (family, name, rel_err(grads[name], gr))
print("SWIGLU MLP OK")
""")


@pytest.mark.slow  # Triton's interpreter on a CPU machine (tests/triton_script.py)
def test_engine_with_fused_mlps_matches_transformers():
    # compiled where a GPU is present; Triton's interpreter otherwise (the GPU image's Triton 3.6 interpreter cannot
    # run the combine kernels' column loops that the whole model needs)
    run_triton_script(_SCRIPT, "cuda" if torch.cuda.is_available() else "cpu", "SWIGLU MLP OK")
