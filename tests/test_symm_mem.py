"""The symm_mem dispatcher: selection and fallback on CPU; parity with alltoall on 2 CUDA GPUs.

Script mode (2 GPUs, self-spawning): python tests/test_symm_mem.py --bench
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Shape suffixes: P ep ranks, L local experts.

# Script mode: import workbench from this checkout and the test helpers beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest
import torch
import torch.distributed as dist
from dispatch_compare import (
    bench_two_gpus,
    check_generic_family_grads,
    generic_family_grads,
    random_routing,
    round_trip,
)
from launch_utils import run_ranks

from workbench.backends import BackendConfig, BackendError
from workbench.moe.dispatch import make_dispatcher

# Multicast/NVLS off (shared/gpu notes): NCCL, torch symmetric memory and NVSHMEM each have a switch.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# NVSHMEM's default symmetric heap is 1 GiB; the bench's two row buffers take ~1.07 GiB per rank.
NVSHMEM_HEAP_BYTES = str(4 << 30)


# ---------------------------------------------------------------- CPU: selection and fallback


def test_explicit_symm_mem_on_cpu_is_refused_naming_alltoall():
    with pytest.raises(BackendError, match="alltoall"):
        BackendConfig(dispatcher="symm_mem").resolve("cpu", world_size=2)


@pytest.mark.parametrize("world_size,expected", [(1, "local"), (2, "alltoall"), (8, "alltoall")])
def test_auto_never_picks_symm_mem_on_cpu(world_size, expected):
    assert BackendConfig(dispatcher="auto").resolve("cpu", world_size=world_size).dispatcher == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error; this machine has CUDA")
def test_constructing_without_cuda_says_what_to_use():
    from workbench.moe.dispatch.symm_mem import SymmMemDispatcher

    with pytest.raises(BackendError, match=r"CUDA.*alltoall"):
        SymmMemDispatcher(8, None)
    with pytest.raises(BackendError, match=r"CUDA.*alltoall"):
        make_dispatcher("symm_mem", 8, None)


# ---------------------------------------------------------------- 2 GPUs: spawn helpers


def run_gpu_ranks(fn, world: int, *args, timeout: float = 300.0) -> list:
    """fn(rank, world, *args) on `world` NCCL ranks, one GPU each, multicast off, a large NVSHMEM heap."""
    env = {**GPU_ENV, "NVSHMEM_SYMMETRIC_SIZE": os.environ.get("NVSHMEM_SYMMETRIC_SIZE", NVSHMEM_HEAP_BYTES)}
    return run_ranks(fn, world, *args, timeout=timeout, backend="nccl", env=env)


def _parity_worker(rank, world, configs):
    device = torch.device("cuda", rank)
    group = dist.new_group(list(range(world)))
    report = []
    dispatchers = {}
    for num_experts, num_tokens, top_k, hidden, dtype_name in configs:
        dtype = getattr(torch, dtype_name)
        key = num_experts
        if key not in dispatchers:  # one of each per expert count: later configs reuse the buffers
            dispatchers[key] = (
                make_dispatcher("alltoall", num_experts, group),
                make_dispatcher("symm_mem", num_experts, group),
            )
        reference, candidate = dispatchers[key]
        g = torch.Generator().manual_seed(1234 + 97 * rank + num_tokens)
        ids, weights = random_routing(num_tokens, num_experts, top_k, g, device)
        x = torch.randn(num_tokens, hidden, generator=g).to(device, dtype)
        grad_out = torch.randn(num_tokens, hidden, generator=g).to(device, dtype)
        scale = (torch.rand(num_experts // world, generator=g) + 0.5).to(device)
        a = round_trip(reference, x, ids, weights.to(dtype), grad_out, scale)
        b = round_trip(candidate, x, ids, weights.to(dtype), grad_out, scale)
        row = {
            "config": (num_experts, num_tokens, top_k, hidden, dtype_name),
            "rows": int(a["x_by_expert"].shape[0]),
            "tokens_per_expert": a["tokens_per_expert"].tolist(),
        }
        for name in a:
            row[name] = (
                tuple(a[name].shape) == tuple(b[name].shape),
                float((a[name].double() - b[name].double()).abs().max()) if a[name].numel() else 0.0,
                float(a[name].double().abs().max()) if a[name].numel() else 0.0,
            )
        report.append(row)
    for _, candidate in dispatchers.values():
        candidate.release()
    return report


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="symm_mem parity needs 2 CUDA GPUs with NVSHMEM")
def test_symm_mem_equals_alltoall_forward_and_backward_on_2_gpus():
    configs = [
        (8, 96, 2, 64, "float32"),  # 4 experts per rank
        (8, 96, 2, 64, "bfloat16"),
        (8, 40, 2, 64, "float32"),  # fewer tokens than the first call: buffers reused
        (128, 256, 8, 256, "bfloat16"),  # Qwen3-30B-A3B routing shape: 64 experts per rank
        (128, 256, 8, 256, "float32"),
        (128, 256, 8, 256, "bfloat16"),  # again: the swapped buffers of the second round
    ]
    reports = run_gpu_ranks(_parity_worker, 2, configs)
    for rank, report in enumerate(reports):
        for row in report:
            assert row["rows"] > 0
            assert max(row["tokens_per_expert"]) != min(row["tokens_per_expert"]), "routing should be uneven"
            for name in ("x_by_expert", "tokens_per_expert", "out", "grad_x", "grad_w"):
                same_shape, diff, ref = row[name]
                # rows and counts are copies in the same order: exact. symm_mem sums each token's k
                # expert rows at home in float32; alltoall sums per rank first (one rounding of each
                # rank's partial sum to the model dtype)
                if name in ("x_by_expert", "tokens_per_expert"):
                    tol = 0.0
                else:
                    tol = (1e-6 if row["config"][-1] == "float32" else 2e-2) * max(ref, 1.0)
                assert same_shape, f"rank {rank} {row['config']} {name}: shapes differ"
                assert diff <= tol, f"rank {rank} {row['config']} {name}: max |symm_mem - alltoall| = {diff}"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="symm_mem on the generic path needs 2 CUDA GPUs with NVSHMEM")
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_generic_family_on_symm_mem_equals_alltoall_on_2_gpus(family):
    """The generic path's experts modules (family router weights and ids) through symm_mem, DP2 x EP2, bf16."""
    results = run_gpu_ranks(generic_family_grads, 2, family, ("alltoall", "symm_mem"))
    check_generic_family_grads(results, "alltoall", "symm_mem")


def test_expert_major_order_regroups_received_rows_by_expert_then_source():
    from workbench.moe.dispatch.symm_mem import expert_major_order

    # source 0 sends 1 row for local expert 0 and 2 for expert 1; source 1 sends 2 and 1
    counts_PL = torch.tensor([[1, 2], [2, 1]])
    assert expert_major_order(counts_PL, 6).tolist() == [0, 3, 4, 1, 2, 5]


# ---------------------------------------------------------------- script mode: timing table

if __name__ == "__main__":
    if "--bench" in sys.argv:
        bench_two_gpus(run_gpu_ranks, "symm_mem")
    else:
        sys.exit(pytest.main([__file__, "-v"]))
