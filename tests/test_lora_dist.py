"""LoRA under expert parallelism + FSDP2 on 2 gloo ranks equals one process; each rank holds its experts' adapters."""

from __future__ import annotations

import pytest
import torch
import transformers
from launch_utils import run_ranks
from safetensors.torch import load_file
from test_expert_parallel import train_losses
from test_lora import lora_resume_config
from tiny_models import tiny_qwen3_moe

import workbench
from workbench.config import LoraConfig
from workbench.models.engine_state import engine_state
from workbench.models.lora_export import save_lora_adapter
from workbench.parallel.mesh import MeshConfig, dense_mesh

pytestmark = pytest.mark.slow

LORA = LoraConfig(rank=4, alpha=8, targets=("attention", "experts"))


def _ep_worker(rank: int, world: int, ckpt: str, mesh: dict, out: str):
    model = workbench.AutoModelForCausalLM.from_pretrained(
        ckpt, mesh=MeshConfig(**mesh), lora=LORA, seed=0, backend=workbench.BackendConfig(experts="grouped_mm")
    )
    experts = model.model.layers[0].mlp.experts
    local = {
        n: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
        for n, p in experts.named_parameters(recurse=False)
    }
    # train_losses's AdamW takes model.parameters(): frozen ones get no grad, so no update and no state
    losses = train_losses(
        model, model.config, rank, world, group=dense_mesh(engine_state(model).device_mesh).get_group()
    )
    grads_on_base = sum(p.grad is not None for n, p in model.named_parameters() if "lora" not in n)
    save_lora_adapter(model, out)
    return {"losses": losses, "local": local, "range": engine_state(model).expert_range, "base_grads": grads_on_base}


def test_lora_dp2_ep2_equals_one_process(tmp_path):
    cfg = tiny_qwen3_moe(num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    torch.manual_seed(5)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "ckpt")
    single = workbench.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", device="cpu", lora=LORA, seed=0)
    ref = train_losses(single, cfg, 0, 1)
    save_lora_adapter(single, tmp_path / "single")
    results = run_ranks(_ep_worker, 2, str(tmp_path / "ckpt"), {"dp": 2, "ep": 2}, str(tmp_path / "ep"))
    assert [r["range"] for r in results] == [(0, 4), (4, 8)]
    for r in results:
        # each rank holds only its 4 experts' base weights and adapters: A [4, in, r], B [4, r, out]
        assert r["local"]["gate_up_proj"][0] == 4 and r["local"]["gate_up_proj_lora_A"] == (4, 32, 4)
        assert r["local"]["gate_up_proj_lora_B"] == (4, 4, 32) and r["local"]["down_proj_lora_A"] == (4, 16, 4)
        assert r["base_grads"] == 0
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref), rtol=1e-5, atol=0)
    assert ref[-1] < ref[0]
    # The adapter written from the sharded run (experts gathered over ep) equals the single process's.
    a = load_file(tmp_path / "single" / "adapter_model.safetensors")
    b = load_file(tmp_path / "ep" / "adapter_model.safetensors")
    assert set(a) == set(b)
    for k in a:  # AdamW steps on gradients summed over ranks in another order (as in test_expert_parallel)
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=2e-4, msg=lambda m, k=k: f"{k}: {m}")


def _finetune_all(rank, world, configs):
    from workbench.config import RunConfig
    from workbench.train import finetune

    return [finetune(RunConfig.from_dict(c))["losses"] for c in configs]


def test_lora_two_rank_ep_resume_is_exact(tmp_path):
    # dp=2, ep=2 (the default mesh for 2 ranks): each rank's expert adapters and their Adam moments are
    # saved as their own expert block and come back to the same rank.

    def rc(run_id, **kw):
        return lora_resume_config(tmp_path, run_id, **kw)

    full = rc("full", train__checkpoint_every=3)
    resumed = rc("resumed", train__resume_from=str(tmp_path / "runs" / "full" / "checkpoints" / "step-00000003"))
    r0, r1 = run_ranks(_finetune_all, 2, [full.to_dict(), resumed.to_dict()])
    assert r0 == r1
    full_losses, resumed_losses = r0
    assert resumed_losses == full_losses[3:]
