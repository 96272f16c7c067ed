"""The engine's extras on the generic path (fused CE, Triton SwiGLU/RMSNorm/combine, TE, expert_recompute).

Each is chosen through BackendConfig; CPU tests compare with vanilla Transformers in float32, and
where a kernel needs a GPU, check which implementation got installed (the Triton kernels run on CPU
in Triton's interpreter in a subprocess).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from generic_families import census_config, fused_experts_model_types, granite_scaled_logits_config, tiny_config
from test_generic_families import _config, close, close_grads, randomize

from workbench import BackendConfig
from workbench.backends import BackendError
from workbench.kernels.rms_norm import RMSNorm
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.engine_state import engine_state
from workbench.models.families import family_for
from workbench.models.fused_ce import NOT_COMPUTED, LogitsNotComputedError
from workbench.models.generic_extras import is_standard_rms_norm, rms_norm_offset, swap_rms_norms
from workbench.models.random_init import materialize_random
from workbench.moe.dispatch import make_dispatcher
from workbench.moe.hf_experts import engine_experts_modules, is_plain_swiglu

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
FUSED_CE_FAMILIES = ["mixtral", "olmoe", "qwen2_moe", "gpt_oss", "deepseek_v3"]


def _pair(family: str, backend: BackendConfig):
    cfg = _config(family)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    randomize(ref)
    eng = AutoModelForCausalLM.from_config(cfg, backend=backend, device="cpu")
    eng.load_state_dict(ref.state_dict(), strict=True)
    return cfg, ref, eng


def _step(model, ids, **kwargs):
    out = model(input_ids=ids, labels=ids, output_router_logits=True, **kwargs)
    out.loss.backward()
    return out


@pytest.mark.parametrize("family", FUSED_CE_FAMILIES)
def test_fused_ce_loss_aux_and_grads_equal_transformers(family):
    cfg, ref, eng = _pair(family, BackendConfig(experts="grouped_mm", fused_ce=True))
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :4] = -100  # ignored targets, and num_items_in_batch as the trainer passes it
    n = torch.tensor(float((labels[:, 1:] != -100).sum()))
    out_ref = ref(input_ids=ids, labels=labels, output_router_logits=True, num_items_in_batch=n)
    out_eng = eng(input_ids=ids, labels=labels, output_router_logits=True, num_items_in_batch=n)
    # the [tokens, vocab] logits were never built: using them says how to get them
    assert out_eng.logits is NOT_COMPUTED and out_ref.logits is not None
    with pytest.raises(LogitsNotComputedError, match=r"logits were not computed.*return_logits=True"):
        out_eng.logits.argmax(-1)
    close(out_eng.loss, out_ref.loss, f"{family} loss (CE + coef * aux)")
    if getattr(out_ref, "aux_loss", None) is not None:
        close(out_eng.aux_loss, out_ref.aux_loss, f"{family} aux loss")
    out_ref.loss.backward()
    out_eng.loss.backward()
    close_grads(ref, eng, family)
    # without labels the model is Transformers' own: logits come back
    with torch.no_grad():
        close(eng(input_ids=ids).logits, ref(input_ids=ids).logits, f"{family} logits without labels")


def test_fused_ce_refused_where_logits_are_transformed():
    cfg = granite_scaled_logits_config()
    with pytest.raises(ValueError, match=r"fused_ce=True cannot serve model_type 'granitemoe'.*logits_scaling"):
        AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(fused_ce=True), device="cpu")
    # fused_ce=False builds it, and so does the default ('auto'), which is off for this model
    AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(fused_ce=False), device="cpu")
    model = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(), device="cpu")
    assert engine_state(model).backend.fused_ce is False


@pytest.mark.parametrize(
    "family,plain",
    [
        ("mixtral", True),
        ("olmoe", True),
        ("qwen2_moe", True),
        ("qwen3_moe", True),
        ("deepseek_v3", True),
        ("glm4_moe", True),
        ("gpt_oss", False),
    ],
)
def test_plain_swiglu_read_from_the_module(family, plain):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config(family))
    experts = [m for m in model.modules() if hasattr(m, "_apply_gate") and hasattr(m, "gate_up_proj")]
    assert experts and all(is_plain_swiglu(m) is plain for m in experts)


def test_plain_swiglu_probe_without_transformers_default_name(monkeypatch):
    # a Transformers version that names its default gate differently: the gate's own numbers decide
    from transformers.integrations import moe as hf_moe

    monkeypatch.delattr(hf_moe, "_default_apply_gate")
    for family, plain in (("mixtral", True), ("gpt_oss", False)):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(_config(family))
        experts = [m for m in model.modules() if hasattr(m, "_apply_gate") and hasattr(m, "gate_up_proj")]
        assert experts and all(is_plain_swiglu(m) is plain for m in experts), family


def test_swiglu_choice_installed_only_on_gates_with_a_kernel(monkeypatch):
    # On CPU 'auto' resolves to torch; the interpreter script below runs the Triton choice end to end.
    assert BackendConfig().resolve("cpu").swiglu == "torch"
    with pytest.raises(BackendError, match="swiglu='triton' cannot run here"):
        BackendConfig(swiglu="triton").resolve("cpu")
    from workbench.moe.hf_experts import install_engine_experts

    # mixtral: the plain SwiGLU kernel; gpt_oss: its own fused gate kernel, never the plain one
    for family, gpt_oss_gate in (("mixtral", False), ("gpt_oss", True)):
        model = transformers.AutoModelForCausalLM.from_config(_config(family))
        for module in [m for m in model.modules() if hasattr(m, "_apply_gate") and hasattr(m, "gate_up_proj")]:
            rows = family_for(family).expert_rows(module, "triton")  # what the generic path asks the family
            install_engine_experts(
                module, make_dispatcher("local", 4), "grouped_mm", (0, 4), 4, swiglu="triton", family_rows=rows
            )
            assert module.plan.swiglu == "triton", family
            assert (module.plan.family_rows is not None) is gpt_oss_gate, family


def test_rms_norm_probe_accepts_standard_and_refuses_variants():
    with torch.device("meta"):
        mixtral = transformers.AutoModelForCausalLM.from_config(_config("mixtral"))
        deepseek = transformers.AutoModelForCausalLM.from_config(_config("deepseek_v3"))
    standard = [m for model in (mixtral, deepseek) for m in model.modules() if "RMSNorm" in type(m).__name__]
    assert standard and all(is_standard_rms_norm(m) for m in standard)
    with torch.device("meta"):  # a model built under a default device (users write `with torch.device("cuda")`)
        assert all(is_standard_rms_norm(m) for m in standard)
    assert not is_standard_rms_norm(torch.nn.LayerNorm(8, bias=False))  # mean subtraction

    class OnePlus(torch.nn.Module):  # Gemma / Qwen3-Next style: (1 + weight)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    class IgnoresEps(OnePlus):
        def forward(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))

    assert not is_standard_rms_norm(OnePlus()) and not is_standard_rms_norm(IgnoresEps())
    # (1 + weight) is the zero-centered norm the engine takes with offset 1.0; one without eps is neither
    assert rms_norm_offset(OnePlus()) == 1.0 and rms_norm_offset(IgnoresEps()) is None
    assert all(rms_norm_offset(m) == 0.0 for m in standard)
    assert rms_norm_offset(torch.nn.LayerNorm(8, bias=False)) is None
    if "qwen3_5_moe_text" in transformers.CONFIG_MAPPING:
        with torch.device("meta"):
            q35 = transformers.AutoModelForCausalLM.from_config(_config("qwen3_5_moe_text"))
        norms = {type(m).__name__: rms_norm_offset(m) for m in q35.modules() if "RMSNorm" in type(m).__name__}
        # its (1 + weight) norms are zero-centered; the gated norm (two inputs) keeps its forward
        assert norms == {"Qwen3_5MoeRMSNorm": 1.0, "Qwen3_5MoeRMSNormGated": None}, norms
    assert swap_rms_norms(mixtral, "torch") == []  # torch: Transformers' own modules


ZERO_CENTERED_FAMILIES = ["qwen3_5_moe_text", "qwen3_next", "minimax_m3_vl_text"]  # (1 + weight) norms


def _zero_centered_config(family: str):
    if family not in transformers.CONFIG_MAPPING or family not in fused_experts_model_types():
        pytest.skip(f"transformers {transformers.__version__} has no {family} with fused experts")
    return census_config(family)


@pytest.mark.parametrize("family", ZERO_CENTERED_FAMILIES)
def test_swap_takes_zero_centered_norms_with_their_parameters(family, caplog):
    cfg = _zero_centered_config(family)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    hf_norms = {name: m for name, m in model.named_modules() if rms_norm_offset(m) == 1.0}
    assert hf_norms, f"{family}: no zero-centered norm to take"
    weights = {name: m.weight for name, m in hf_norms.items()}
    keys = list(model.state_dict())
    with caplog.at_level("WARNING", logger="workbench.models.generic_extras"):
        swapped = swap_rms_norms(model, "triton")
    assert set(hf_norms) <= set(swapped)
    modules = dict(model.named_modules())
    for name, weight in weights.items():
        norm = modules[name]
        assert isinstance(norm, RMSNorm) and norm.offset == 1.0 and norm.backend == "triton", name
        assert norm.weight is weight and norm.variance_epsilon == hf_norms[name].eps, name  # the very Parameter
    assert list(model.state_dict()) == keys
    # the warning names only norms still on Transformers' forward (gated ones), none of the zero-centered classes
    classes = {type(m).__name__ for m in hf_norms.values()}
    named = [c for record in caplog.records for c in classes if re.search(rf"\b{c}\b", record.getMessage())]
    assert not named, caplog.text


def test_random_init_gives_swapped_zero_centered_norms_their_zeros():
    # Transformers initialises a norm by its class name ("RMSNorm": ones); the engine's zero-centered norm's
    # neutral weight is zeros, as Qwen3_5MoeRMSNorm's own init gives it (ones would scale every norm by 2)
    cfg = _zero_centered_config("qwen3_5_moe_text")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert swap_rms_norms(model, "triton")
    materialize_random(model, torch.device("cpu"), seed=0, dtype=None)
    vanilla = transformers.AutoModelForCausalLM.from_config(cfg)
    offsets = {name: m.offset for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    assert 1.0 in offsets.values()
    state = model.state_dict()
    for name, want in vanilla.state_dict().items():
        if name.removesuffix(".weight") in offsets:
            assert torch.equal(state[name], want), name


def test_expert_recompute_recomputes_and_equals_transformers(monkeypatch):
    from workbench.moe import hf_experts

    cfg, ref, eng = _pair("mixtral", BackendConfig(experts="grouped_mm", expert_recompute=True))
    calls = []
    gate = hf_experts._gate  # the experts' activation, with or without the routing weights in it
    monkeypatch.setattr(hf_experts, "_gate", lambda *args, gate=gate: calls.append(1) or gate(*args))
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    out_ref, out_eng = _step(ref, ids), _step(eng, ids)
    layers = len(engine_experts_modules(eng))
    assert len(calls) == 2 * layers  # each layer's experts ran again in backward
    close(out_eng.loss, out_ref.loss, "loss")
    close_grads(ref, eng, "")


def test_combine_choice_reaches_every_dispatcher():
    assert make_dispatcher("local", 4).use_triton is False
    assert make_dispatcher("local", 4, combine="triton").use_triton is True
    with pytest.raises(ValueError, match=r"combine must be a resolved BackendConfig\.combine"):
        make_dispatcher("local", 4, combine="auto")
    _, _, eng = _pair("olmoe", BackendConfig())
    assert all(m.plan.dispatcher.use_triton is False for _, m in engine_experts_modules(eng))


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None or not HAS_CUDA,
    reason="TransformerEngine runs on CUDA GPUs only and is not installed here",
)
def test_te_linear_and_experts_on_the_generic_path_match_torch_on_cuda():
    cfg = tiny_config("mixtral", hidden_size=64, intermediate_size=64, head_dim=16)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").cuda().bfloat16()
    eng = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(experts="te", linear="te"), device="cuda")
    eng.load_state_dict(ref.state_dict())
    eng.cuda().bfloat16()
    assert any(type(m).__name__ == "TELinear" for m in eng.modules())
    ids = torch.randint(0, cfg.vocab_size, (2, 16), device="cuda")
    with torch.no_grad():
        a, b = eng(input_ids=ids).logits.float(), ref(input_ids=ids).logits.float()
    assert ((a - b).norm() / b.norm()).item() < 3e-2


def _run_in_interpreter(script: str, args: list[str], done: str) -> None:
    """`script` with `args` in a fresh interpreter under TRITON_INTERPRET=1 (read when triton is first imported),
    from the repository root; it must exit 0 and print `done`."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and done in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


_INTERPRETER_SCRIPT = textwrap.dedent("""
import sys, torch, transformers
sys.path.insert(0, "tests")
from test_generic_families import _config, close, close_grads, randomize
from workbench import BackendConfig
from workbench.kernels.rms_norm import RMSNorm
from workbench.moe.hf_experts import engine_experts_modules

resolved = BackendConfig().resolve("cpu")
assert all(getattr(resolved, f) == "triton" for f in ("rms_norm", "swiglu", "combine", "cross_entropy", "rope"))

from test_generic_extras import _pair as pair

def check(family, ref, eng, ids):
    out_ref = ref(input_ids=ids, labels=ids, output_router_logits=True)
    out_eng = eng(input_ids=ids, labels=ids, output_router_logits=True)
    close(out_eng.loss, out_ref.loss, family + " loss")
    out_ref.loss.backward(); out_eng.loss.backward()
    close_grads(ref, eng, family)

for family in sys.argv[1:]:
    # 'auto' under the interpreter: every Triton kernel (RMSNorm, SwiGLU, combine, CE) on the generic path
    cfg, ref, eng = pair(family, BackendConfig(experts="grouped_mm", fused_ce=True))
    assert sum(isinstance(m, RMSNorm) and m.backend == "triton" for m in eng.modules()) >= 2 * cfg.num_hidden_layers
    experts = [m for _, m in engine_experts_modules(eng)]
    assert all(m.plan.dispatcher.use_triton for m in experts)
    assert all(m.plan.swiglu == "triton" for m in experts)  # GPT-OSS: its fused bias + clamped gate
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(7))
    check(family, ref, eng, ids)
    # every choice torch: no Triton kernel may run, although the interpreter would take them
    import workbench.kernels.triton_combine as tc, workbench.kernels.triton_swiglu as ts
    import workbench.kernels.triton_rms_norm as tr, workbench.kernels.triton_cross_entropy as tce
    import workbench.kernels.triton_gpt_oss_gate as tg
    saved = {}
    def forbid(mod, name):
        saved[(mod, name)] = getattr(mod, name)
        setattr(mod, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError(f"{mod.__name__}.{name} ran")))
    for mod, name in ((tc, "combine_forward"), (tc, "combine_backward"), (ts, "swiglu_packed"),
                      (tr, "rms_norm"), (tce, "ce_rows_"), (tce, "scale_"), (tg, "gate"), (tg, "row_bias_")):
        forbid(mod, name)
    torch_only = BackendConfig(experts="grouped_mm", fused_ce=True, rms_norm="torch", swiglu="torch", combine="torch",
                               cross_entropy="torch", rope="torch")
    cfg, ref, eng = pair(family, torch_only)
    check(family, ref, eng, ids)
    for (mod, name), fn in saved.items():
        setattr(mod, name, fn)
    print("ok", family)

# Qwen3-MoE's family extra: the fused-RoPE attention, installed by the generic path with rope='triton'
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf
from workbench.models import generic
from workbench.models.families.qwen3_moe.attention import Qwen3MoeEngineAttention
from workbench.moe.dispatch import LocalDispatcher
cfg = _config("qwen3_moe")
ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
randomize(ref)
eng = transformers.AutoModelForCausalLM.from_config(cfg)
eng.load_state_dict(ref.state_dict())
resolved = BackendConfig(experts="grouped_mm", fused_ce=True).resolve("cpu")
generic.install(eng, resolved, lambda n: LocalDispatcher(n, resolved.combine))
assert all(type(layer.self_attn) is Qwen3MoeEngineAttention for layer in eng.model.layers)
check("qwen3_moe", ref, eng, torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(8)))
print("GENERIC TRITON OK")
""")


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton to run the kernels in Triton's CPU interpreter)"
)
@pytest.mark.skipif(HAS_CUDA, reason="the interpreter is for CPU machines; CUDA runs the compiled kernels")
def test_triton_extras_on_the_generic_path_equal_transformers_in_interpreter():
    _run_in_interpreter(_INTERPRETER_SCRIPT, ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"], "GENERIC TRITON OK")


_ZERO_CENTERED_SCRIPT = textwrap.dedent("""
import sys, torch, transformers
sys.path.insert(0, "tests")
from generic_families import census_config
from test_generic_families import close, close_grads, randomize
from workbench import BackendConfig
from workbench.kernels.rms_norm import RMSNorm
from workbench.models.auto import AutoModelForCausalLM

# rms_norm='triton' only, the rest on torch: the norms are what this checks, and the interpreter is slow
backend = BackendConfig(experts="grouped_mm", rms_norm="triton", swiglu="torch", combine="torch",
                        cross_entropy="torch", rope="torch", fused_ce=False)
for family in sys.argv[1:]:
    cfg = census_config(family)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", dtype=torch.float32)
    randomize(ref)  # every 1-D weight 0.5 + 0.3 x N(0, 1): the zero-centered norms' weights far from zero
    eng = AutoModelForCausalLM.from_config(cfg, backend=backend, device="cpu", dtype=torch.float32)
    eng.load_state_dict(ref.state_dict(), strict=True)
    norms = [m for m in eng.modules() if isinstance(m, RMSNorm)]
    assert sum(m.offset == 1.0 and m.backend == "triton" for m in norms) >= 2 * cfg.num_hidden_layers, norms
    assert not any(type(m).__name__.endswith("RMSNorm") and type(m) is not RMSNorm for m in eng.modules())
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(7))
    out_ref = ref(input_ids=ids, labels=ids)
    out_eng = eng(input_ids=ids, labels=ids, return_logits=True)
    close(out_eng.logits, out_ref.logits, family + " logits")
    out_ref.loss.backward()
    out_eng.loss.backward()
    close_grads(ref, eng, family)
    print("ok", family, len(norms))
print("ZERO CENTERED MODELS OK")
""")


@pytest.mark.slow
@pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton to run the kernels in Triton's CPU interpreter)"
)
@pytest.mark.skipif(HAS_CUDA, reason="the interpreter is for CPU machines; CUDA runs the compiled kernels")
def test_zero_centered_norms_on_triton_equal_transformers_in_interpreter():
    """Qwen3.5-MoE's, Qwen3-Next's and MiniMax-M3's (1 + weight) norms on the engine's Triton RMSNorm: the whole
    tiny model's float32 logits and every gradient equal vanilla Transformers'."""
    families = [f for f in ZERO_CENTERED_FAMILIES if f in transformers.CONFIG_MAPPING]
    _run_in_interpreter(_ZERO_CENTERED_SCRIPT, families, "ZERO CENTERED MODELS OK")


def _shared_aux_worker(rank, world):
    import torch.distributed as dist
    from transformers.models.mixtral import modeling_mixtral

    cfg = tiny_config("mixtral", router_aux_loss_coef=0.1)
    torch.manual_seed(3)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    randomize(ref)
    eng = AutoModelForCausalLM.from_config(cfg, device="cpu")
    eng.load_state_dict(ref.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2 * world, 12), generator=torch.Generator().manual_seed(1))
    mine = ids[2 * rank : 2 * rank + 2]
    calls = []
    real = modeling_mixtral.load_balancing_loss_func
    # Noted in this spawned process only: how often Transformers' own aux loss runs in the engine's forward.
    modeling_mixtral.load_balancing_loss_func = lambda *a, **k: calls.append(1) or real(*a, **k)
    out = eng(input_ids=mine, labels=mine, output_router_logits=True, aux_loss_group=dist.group.WORLD)
    engine_calls = len(calls)
    with torch.no_grad():
        whole = ref(input_ids=ids, output_router_logits=True).aux_loss  # one process, the global batch
        ce = ref(input_ids=mine, labels=mine).loss
    return {
        "calls": engine_calls,
        "aux": out.aux_loss.detach(),
        "whole": whole,
        "loss": out.loss.detach(),
        "ce": ce,
        "router_logits": len(out.router_logits),
        "layers": cfg.num_hidden_layers,
    }


@pytest.mark.slow
def test_shared_aux_loss_is_computed_once_and_adds_up_to_transformers():
    """With aux_loss_group the engine computes the group's aux loss only, not Transformers' per-rank one too."""
    from launch_utils import run_ranks

    results = run_ranks(_shared_aux_worker, 2, timeout=120)
    assert [r["calls"] for r in results] == [0, 0]
    assert all(r["router_logits"] == r["layers"] for r in results)
    close(sum(r["aux"] for r in results), results[0]["whole"], "rank shares vs one process's aux loss")
    for r in results:
        close(r["loss"], r["ce"] + 0.1 * r["aux"], "loss = CE + coef * this rank's share")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_one_process_aux_loss_is_the_engines_and_equals_transformers(family, monkeypatch):
    """Without a group too, the engine computes the aux loss (Transformers' own counts experts with bincount
    in 5.17: a host sync per layer) and gets Transformers' value."""
    import importlib

    cfg = tiny_config(family, router_aux_loss_coef=0.1)
    torch.manual_seed(3)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    randomize(ref)
    eng = AutoModelForCausalLM.from_config(cfg, device="cpu")
    eng.load_state_dict(ref.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids, labels=ids, output_router_logits=True)
    modeling = importlib.import_module(type(ref).__module__)
    calls = []
    real = modeling.load_balancing_loss_func
    monkeypatch.setattr(modeling, "load_balancing_loss_func", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = eng(input_ids=ids, labels=ids, output_router_logits=True)
    assert calls == []
    assert len(out.router_logits) == cfg.num_hidden_layers
    close(out.aux_loss.detach(), want.aux_loss, "engine aux vs Transformers'")
    close(out.loss.detach(), want.loss, "loss = CE + coef * aux")


def test_from_config_builds_on_the_device_it_resolved_for():
    """device= is where the model is built (its backends are resolved for it): 'meta' stands in for a GPU here.

    Built on the CPU instead, a CUDA-resolved model ran its Triton RMSNorm on CPU tensors and failed.
    """
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_family_without_router_modules_keeps_transformers_aux_loss(monkeypatch):
    """Transformers 5.17's GraniteMoE records no router module in `_can_record_outputs` (its layer loop returns the
    logits): the engine builds it with Transformers' own aux loss instead of refusing the model."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from workbench.models.generic_extras import EngineCausalLMSharedAux
    from workbench.models.router_aux import ensure_router_logit_hooks

    recorded = dict(modeling_qwen3_moe.Qwen3MoeModel._can_record_outputs)
    recorded.pop("router_logits")
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeModel, "_can_record_outputs", recorded)
    cfg = tiny_config("qwen3_moe", router_aux_loss_coef=0.1)
    eng = AutoModelForCausalLM.from_config(cfg, device="cpu")
    assert not isinstance(eng, EngineCausalLMSharedAux)
    assert engine_state(eng).router_sink is None
    assert ensure_router_logit_hooks(eng) is False
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    out = eng(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
