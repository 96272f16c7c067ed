"""EP=4 and EP=8 meshes on 4 and 8 CPU ranks (gloo): the layouts the 4- and 8-GPU machines run."""

from __future__ import annotations

import pytest
import torch
from launch_utils import run_ranks
from test_expert_parallel import LOSS_RTOL, _ep_worker, single_process_run
from tiny_models import tiny_qwen3_moe

import workbench
from workbench.parallel.mesh import MeshConfig, MeshError


@pytest.mark.slow
@pytest.mark.parametrize("world,ep", [(4, 4), (8, 8), (8, 4)])
def test_large_mesh_equals_one_process(moe_checkpoint, tmp_path, world, ep):
    cfg, path = moe_checkpoint
    ref = single_process_run(cfg, path, tmp_path / "single")
    results = run_ranks(_ep_worker, world, str(path), {"dp": world, "ep": ep}, str(tmp_path / "mesh"))
    per_rank = 8 // ep
    for rank, r in enumerate(results):
        first = (rank % ep) * per_rank
        assert r["expert_range"] == (first, first + per_rank)
        assert r["experts_read"] == list(range(first, first + per_rank))  # its experts only, from the checkpoint
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref), rtol=LOSS_RTOL, atol=0)


def _uneven_worker(rank, world):
    cfg = tiny_qwen3_moe(num_experts=6)
    try:
        workbench.AutoModelForCausalLM.from_config(cfg, mesh=MeshConfig(dp=4, ep=4))
    except MeshError as err:
        return str(err)
    return "built"


@pytest.mark.slow
def test_uneven_experts_per_rank_refused_on_four_ranks():
    messages = run_ranks(_uneven_worker, 4)
    assert all("ep=4 does not divide the model's 6 experts" in m and "choose ep in [1, 2]" in m for m in messages)
