"""The generic engine path for Transformers v5 MoE families: parity with vanilla Transformers, EP, training."""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import FAMILIES, tiny_config
from launch_utils import run_ranks

from workbench import BackendConfig
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.engine_state import engine_state
from workbench.models.full_state import full_state_dict
from workbench.models.generic import UnsupportedModelError
from workbench.moe.grouped_linear import grouped_mm_dtypes, grouped_mm_ok
from workbench.moe.hf_experts import engine_experts_modules

EPS = torch.finfo(torch.float32).eps
GENERIC = list(FAMILIES)  # qwen3_moe too: the generic path plus its own extras


def _config(family: str, **overrides):
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    if family == "gpt_oss":
        overrides.setdefault("swiglu_limit", 0.3)  # small, so the random activations reach the clamp
    return tiny_config(family, **overrides)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Fresh weights large enough to exercise every term (biases, clamps, norms), not Transformers' init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.15) + (p.dim() == 1) * 0.5)


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal up to float32 rounding of sums of a few hundred terms, relative to the tensor's scale."""
    scale = max(b.abs().max().item(), 1e-3)
    tol = 512 * EPS * scale
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"{what}: max |diff| {diff:.3g} > {tol:.3g}"


def close_grads(ref, eng, what: str) -> None:
    """Every gradient of the engine twin equal to the reference's (`close`), by parameter name."""
    grads = dict(eng.named_parameters())
    for name, p in ref.named_parameters():
        if p.grad is not None:
            close(grads[name].grad, p.grad, f"{what} grad {name}")


def _pair(family: str, backend: str):
    cfg = _config(family)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", dtype=torch.float32)
    randomize(ref)
    # device="cpu", float32: the reference runs here; on a GPU machine "auto" would pick CUDA kernels
    eng = AutoModelForCausalLM.from_config(
        cfg, backend=BackendConfig(experts=backend), device="cpu", dtype=torch.float32
    )
    eng.load_state_dict(ref.state_dict(), strict=True)
    return cfg, ref, eng


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_gradients_equal_vanilla_transformers(family, backend):
    cfg, ref, eng = _pair(family, backend)
    experts = engine_experts_modules(eng)  # every family, Qwen3-MoE included, runs on the generic path
    assert experts, f"{family}: no experts module became the engine's"
    assert all(m.plan.backend == backend for _, m in experts)
    # the tiny widths are multiples of 8: grouped_mm runs for real, not its loop fallback
    x = torch.zeros(4, cfg.hidden_size)
    assert grouped_mm_ok(x, experts[0][1].down_proj.transpose(-2, -1), grouped_mm_dtypes("cpu"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    # return_logits: the default fused CE builds none (tests/test_fused_ce_default.py checks that path)
    out_ref, out_eng = ref(input_ids=ids, labels=ids), eng(input_ids=ids, labels=ids, return_logits=True)
    close(out_eng.logits, out_ref.logits, f"{family} logits")
    out_ref.loss.backward()
    out_eng.loss.backward()
    close_grads(ref, eng, family)


def test_gpt_oss_biases_and_clamp_are_exercised():
    """The GPT-OSS parity above would be vacuous if its biases or clamp never mattered."""
    cfg, _, eng = _pair("gpt_oss", "grouped_mm")
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    base = eng(input_ids=ids).logits
    with torch.no_grad():
        for _, m in engine_experts_modules(eng):
            m.down_proj_bias.zero_()
    assert (eng(input_ids=ids).logits - base).abs().max() > 1e-3
    h = torch.randn(64, 2 * cfg.intermediate_size)
    clamped = engine_experts_modules(eng)[0][1]._apply_gate(h * 10)
    assert clamped.abs().max() <= (cfg.swiglu_limit + 1) * cfg.swiglu_limit + 1e-6


def test_odd_widths_fall_back_to_the_loop_and_stay_exact():
    cfg = _config("mixtral", hidden_size=36, intermediate_size=13, head_dim=10, vocab_size=101)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    randomize(ref)
    eng = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(experts="grouped_mm"), device="cpu")
    eng.load_state_dict(ref.state_dict())
    experts = engine_experts_modules(eng)[0][1]
    assert not grouped_mm_ok(torch.zeros(1, 36), experts.down_proj.transpose(-2, -1), experts.plan.grouped_mm_dtypes)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    close(eng(input_ids=ids).logits, ref(input_ids=ids).logits, "odd-width logits")


def test_dense_model_stays_vanilla():
    cfg = transformers.AutoConfig.for_model(
        "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    assert type(model) is transformers.LlamaForCausalLM and not engine_experts_modules(model)


def test_moe_without_fused_experts_is_refused_naming_supported_families():
    if "jetmoe" not in transformers.CONFIG_MAPPING:
        pytest.skip("no jetmoe in this transformers")
    cfg = transformers.AutoConfig.for_model(
        "jetmoe",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        kv_channels=8,
        num_key_value_heads=2,
        intermediate_size=32,
    )
    with pytest.raises(
        UnsupportedModelError,
        match=r"'jetmoe' is a Mixture-of-Experts model whose experts are "
        r"not Transformers v5 fused .*tested: deepseek_v3, .*glm4_moe, "
        r"gpt_oss, .*mixtral",
    ):
        AutoModelForCausalLM.from_config(cfg)


def _ep_worker(rank, world, family, save_dir):
    return ep_step_on(rank, world, _config(family), save_dir)


def ep_step_on(rank, world, cfg, save_dir):
    """One training step of `cfg`'s model on dp = ep = `world` gloo ranks, each on its own tokens, against vanilla
    Transformers on the whole batch in one process: the loss, every gradient, the experts each rank holds, and the
    gathered save loaded by vanilla Transformers (rank 0)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from workbench.models import generic
    from workbench.models.auto import save_pretrained
    from workbench.parallel.mesh import MeshConfig

    model = AutoModelForCausalLM.from_config(
        cfg, mesh=MeshConfig(dp=world, ep=world), seed=3, backend=BackendConfig(experts="grouped_mm")
    )
    num = generic.num_experts(model, cfg)
    first, last = rank * num // world, (rank + 1) * num // world
    held = {}
    for name, m in engine_experts_modules(model):
        assert m.plan.expert_range == (first, last)
        w = m.down_proj.to_local() if isinstance(m.down_proj, DTensor) else m.down_proj
        held[name] = w.shape[0]
    full = full_state_dict(model)  # collective
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    ref.load_state_dict(full, strict=True)

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (2 * world, 10), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    items = (labels[:, 1:] != -100).sum()
    per = ids.shape[0] // world
    mine = slice(rank * per, (rank + 1) * per)  # different tokens per rank
    loss = model(input_ids=ids[mine], labels=labels[mine], num_items_in_batch=items).loss
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    ref_out = ref(input_ids=ids, labels=labels)
    ref_out.loss.backward()
    ref_grads = dict(ref.named_parameters())
    worst = 0.0
    experts = {f"{n}.{p}" for n, m in engine_experts_modules(model) for p in m.plan.layout.param_names()}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = ref_grads[name].grad
        want = want[first:last] if name in experts else want
        scale = max(want.abs().max().item(), 1e-3)
        worst = max(worst, (grad - want).abs().max().item() / scale)
    save_pretrained(model, save_dir)
    logits_diff = None
    if rank == 0:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(save_dir, experts_implementation="eager")
        ref.zero_grad()
        logits_diff = (loaded(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    return dict(
        loss=total.item(), ref_loss=ref_out.loss.item(), held=held, num=num, grad_rel=worst, logits_diff=logits_diff
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "family", ["mixtral", "gpt_oss", "deepseek_v3", "olmoe", "qwen2_moe", "glm4_moe", "qwen3_5_moe_text"]
)
def test_dp2_ep2_equals_one_process_and_saves_for_vanilla(family, tmp_path):
    _config(family)  # skip early where this transformers lacks the family
    check_ep(run_ranks(_ep_worker, 2, family, str(tmp_path / "saved"), timeout=300))


def check_ep(results: list) -> None:
    """The ranks of ep_step_on agree with one process (loss, gradients, logits after the save) and each held its
    share of the experts."""
    for r in results:
        assert abs(r["loss"] - r["ref_loss"]) <= 64 * EPS * abs(r["ref_loss"]), r
        assert r["grad_rel"] <= 512 * EPS, r
        assert set(r["held"].values()) == {r["num"] // len(results)}, r  # each rank holds only its experts
    assert results[0]["logits_diff"] <= 1e-5, results[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_ep4_on_four_ranks_equals_one_process(family, tmp_path):
    check_ep(run_ranks(_ep_worker, 4, family, str(tmp_path / "saved"), timeout=300))


def _saved(family: str, path, **overrides) -> str:
    cfg = _config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3", "olmoe", "qwen2_moe", "glm4_moe"])
def test_trainer_steps_on_the_generic_path_lower_the_loss(family, tmp_path):
    from workbench.config import TINY_VOCAB_SIZE, ModelConfig, RunConfig
    from workbench.train import finetune

    path = _saved(family, tmp_path / "m", vocab_size=TINY_VOCAB_SIZE)  # the shipped tokenizer's
    rc = RunConfig.demo(
        output_dir=str(tmp_path / "runs"),
        model=ModelConfig(preset=None, path=path),
        data__seq_len=64,
        train__steps=8,
        train__global_batch_size=4,
        train__local_batch_size=4,
        train__save_final_checkpoint=False,
    )
    losses = finetune(rc)["losses"]
    assert losses[-1] < losses[0] - 0.05, losses


def _pretrained_worker(rank, world, path, mesh_kwargs):
    from torch.distributed.tensor import DTensor

    from workbench.parallel.mesh import MeshConfig

    model = AutoModelForCausalLM.from_pretrained(path, mesh=MeshConfig(**mesh_kwargs))
    shapes = {
        n: tuple((m.down_proj.to_local() if isinstance(m.down_proj, DTensor) else m.down_proj).shape)
        for n, m in engine_experts_modules(model)
    }
    full = full_state_dict(model)
    return shapes, {k: v for k, v in full.items() if ".experts." in k or k.endswith("embed_tokens.weight")}


@pytest.mark.slow
def test_from_pretrained_on_a_mesh_keeps_this_ranks_experts_of_the_checkpoint(tmp_path):
    path = _saved("gpt_oss", tmp_path / "m")
    want = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    results = run_ranks(_pretrained_worker, 2, path, dict(dp=2, ep=2), timeout=300)
    for shapes, full in results:
        assert all(s[0] == 2 for s in shapes.values()), shapes  # 4 experts over ep=2
        for k, v in full.items():
            assert torch.equal(v, want[k]), k


def _init_worker(rank, world, family, ep):
    from workbench.parallel.mesh import MeshConfig

    model = AutoModelForCausalLM.from_config(_config(family), mesh=MeshConfig(dp=world, ep=ep), seed=5)
    return full_state_dict(model)


@pytest.mark.slow
def test_random_init_on_a_mesh_is_independent_of_ep():
    a = run_ranks(_init_worker, 2, "deepseek_v3", 1, timeout=300)[0]
    b = run_ranks(_init_worker, 2, "deepseek_v3", 2, timeout=300)[0]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert torch.isfinite(a[k]).all(), k
    bias = [k for k in a if k.endswith("e_score_correction_bias")]
    assert bias and all(torch.count_nonzero(a[k]) == 0 for k in bias)  # Transformers' own init of buffers


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_default_mesh_splits_generic_experts_and_explicit_ep_is_allowed(family):
    from workbench.parallel.mesh import MeshConfig
    from workbench.train.model_setup import resolve_mesh

    cfg = _config(family)
    assert resolve_mesh(None, 2, cfg) == MeshConfig(dp=2, ep=2)
    assert resolve_mesh(MeshConfig(dp=4, ep=4), 4, cfg) == MeshConfig(dp=4, ep=4)


def _trainer_run(ckpt: str, out: str, local_batch: int, **overrides) -> dict:
    from workbench.config import DataConfig, ModelConfig, RunConfig
    from workbench.train.loop import Trainer

    # device="cpu", float32: the single-process reference runs like the gloo ranks also on a GPU machine
    rc = RunConfig.demo(
        model=ModelConfig(preset=None, path=ckpt, dtype="float32", device="cpu"),
        data=DataConfig(kind="synthetic", seq_len=16),
        output_dir=out,
        train__steps=3,
        train__global_batch_size=4,
        train__local_batch_size=local_batch,
        train__lr=1e-2,
        train__warmup_steps=0,
        train__export_hf=True,
        **overrides,
    )
    trainer = Trainer(rc)
    trainer.setup()
    result = trainer.fit()
    mesh = str(engine_state(trainer.model).mesh)
    return {"losses": result["losses"], "hf_dir": result["hf_dir"], "mesh": mesh}


def _trainer_worker(rank, world, ckpt, out):
    return _trainer_run(ckpt, out, local_batch=2)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_trainer_on_dp2_ep2_equals_one_process_and_exports_for_vanilla(family, tmp_path):
    ckpt = _saved(family, tmp_path / "m")
    # the global batch in one micro-batch: on dp=2 each rank's aux loss is its share of that batch's aux loss
    single = _trainer_run(ckpt, str(tmp_path / "single"), local_batch=4)
    r0, r1 = run_ranks(_trainer_worker, 2, ckpt, str(tmp_path / "mesh"), timeout=300)
    assert r0["mesh"] == "MeshConfig(dp=2, ep=2, cp=1, tp=1)", r0["mesh"]  # the default mesh splits the experts
    assert r0["losses"] == r1["losses"]
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-6)
    a = transformers.AutoModelForCausalLM.from_pretrained(r0["hf_dir"]).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(single["hf_dir"]).state_dict()
    assert a.keys() == b.keys()
    for k in a:  # AdamW's sqrt(v) amplifies rounding of near-zero gradients: a fraction of lr after 3 steps
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the bf16 grouped-GEMM path on device")
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_bf16_on_cuda_matches_transformers_grouped_mm(family):
    cfg = _config(family)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="grouped_mm")
    randomize(ref)
    ref = ref.to("cuda", torch.bfloat16)
    eng = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(experts="grouped_mm"), device="cuda")
    eng = eng.to("cuda", torch.bfloat16)
    eng.load_state_dict(ref.state_dict(), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2)).cuda()
    out_ref, out_eng = ref(input_ids=ids, labels=ids), eng(input_ids=ids, labels=ids)
    # bf16: both round every product to 8 bits of mantissa, in different orders
    torch.testing.assert_close(out_eng.loss.float(), out_ref.loss.float(), rtol=2e-2, atol=2e-2)
    out_eng.loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in eng.parameters())


def test_the_fused_experts_check_builds_one_meta_model_per_config(monkeypatch):
    """Equal configs share one meta build; a changed field is asked again (the key is taken per call)."""
    from workbench.models import generic

    generic._has_fused_experts.cache_clear()  # other tests in this process may have asked already
    builds = []
    real = generic.meta_model
    monkeypatch.setattr(generic, "meta_model", lambda cfg: builds.append(cfg.num_hidden_layers) or real(cfg))
    cfg = _config("mixtral", num_hidden_layers=3)
    assert generic.has_fused_experts(cfg) and generic.has_fused_experts(_config("mixtral", num_hidden_layers=3))
    assert builds == [3]
    cfg.num_hidden_layers = 1
    assert generic.has_fused_experts(cfg)
    assert builds == [3, 1]


def test_grouped_mm_dtypes_are_decided_once_at_install_and_passed_down():
    """Which dtypes grouped_mm takes is the device's, decided at install; the GEMMs only read the decision."""
    from workbench.moe.grouped_linear import grouped_linear

    cfg = _config("mixtral")
    grouped = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(experts="grouped_mm"), device="cpu")
    loop = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(experts="loop"), device="cpu")
    assert {m.plan.grouped_mm_dtypes for _, m in engine_experts_modules(grouped)} == {(torch.float32, torch.bfloat16)}
    assert {m.plan.grouped_mm_dtypes for _, m in engine_experts_modules(loop)} == {()}
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(10, 16, generator=g), torch.randn(4, 8, 16, generator=g)
    counts = torch.tensor([3, 0, 7, 0])
    # float32 rows with a bf16-only decision (a CUDA device's) take the loop: the same numbers
    close(
        grouped_linear(x, counts, weight, False, (torch.bfloat16,)),
        grouped_linear(x, counts, weight, False, (torch.float32,)),
        "loop vs grouped_mm rows",
    )
