"""The alltoall dispatcher on 2 and 4 gloo ranks against the single-rank dispatcher, slot by slot."""

from __future__ import annotations

import pytest
import torch
from dispatch_compare import random_routing, round_trip
from launch_utils import run_ranks


def _inputs(world: int, T: int, E: int, K: int, D: int):
    """Every rank's tokens, routing and output gradient, the same on every rank (one generator)."""
    g = torch.Generator().manual_seed(11)
    ranks = []
    for _ in range(world):
        ids, w = random_routing(T, E, K, g, "cpu")
        ranks.append((torch.randn(T, D, generator=g), ids, w, torch.randn(T, D, generator=g)))
    return ranks, torch.rand(E, generator=g) + 0.5


def _worker(rank: int, world: int, T: int, E: int, K: int, D: int) -> dict:
    import torch.distributed as dist

    from workbench.moe.dispatch import LocalDispatcher, make_dispatcher

    ranks, scale_E = _inputs(world, T, E, K, D)
    L = E // world
    x, ids, w, grad_out = ranks[rank]
    dispatcher = make_dispatcher("alltoall", E, dist.group.WORLD)
    got = round_trip(dispatcher, x, ids, w, grad_out, scale_E[rank * L : (rank + 1) * L])
    ref = round_trip(LocalDispatcher(E), x, ids, w, grad_out, scale_E)
    # the rows this rank's experts see: expert, then source rank, then source token
    expected_rows = [
        src_x[t]
        for e in range(rank * L, (rank + 1) * L)
        for src_x, src_ids, _, _ in ranks
        for t in range(T)
        if (src_ids[t] == e).any()
    ]
    _, _, handle = dispatcher.dispatch(x, ids, w)
    pairs = torch.zeros(T, world, dtype=torch.bool).scatter_(1, ids // L, True)
    return {
        "rows_equal": torch.equal(got["x_by_expert"], torch.stack(expected_rows)),
        "tokens_per_expert": got["tokens_per_expert"].tolist(),
        "expected_tokens_per_expert": [
            sum(int((r[1] == e).sum()) for r in ranks) for e in range(rank * L, (rank + 1) * L)
        ],
        "errors": {k: (got[k] - ref[k]).abs().max().item() for k in ("out", "grad_x", "grad_w")},
        "scale": {k: ref[k].abs().max().item() for k in ("out", "grad_x", "grad_w")},
        "rows_sent": sum(handle.send_splits),
        "token_rank_pairs": int(pairs.sum()),
        "tokens_skipping_a_rank": int((pairs.sum(1) < world).sum()),
    }


@pytest.mark.slow
@pytest.mark.parametrize("world,E,K", [(2, 8, 2), (4, 16, 3)])
def test_alltoall_equals_single_rank_dispatch_and_sends_each_token_once_per_rank(world, E, K):
    T, D = 24, 16
    results = run_ranks(_worker, world, T, E, K, D)
    # slots without a row on both sides: every receiver gets other ranks' slots, and some tokens skip a rank
    assert any(r["tokens_skipping_a_rank"] for r in results)
    for r in results:
        assert r["rows_equal"]
        assert r["tokens_per_expert"] == r["expected_tokens_per_expert"]
        for key, err in r["errors"].items():
            assert err <= 1e-5 * r["scale"][key], (key, err, r["scale"][key])
        # one row per (token, destination rank), not one per (token, expert)
        assert r["rows_sent"] == r["token_rank_pairs"] < T * K


def _worker_cuda(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from workbench.moe.dispatch import LocalDispatcher, make_dispatcher

    device = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(3)
    T, E, K, D = 4096, 128, 8, 2048
    ids, w = random_routing(T, E, K, g, device)
    x = torch.randn(T, D, generator=g).to(device, torch.bfloat16)
    grad_out = torch.randn(T, D, generator=g).to(device, torch.bfloat16)
    scale = (torch.rand(E, generator=g) + 0.5).to(device)
    got = round_trip(make_dispatcher("alltoall", E, dist.group.WORLD), x, ids, w.to(torch.bfloat16), grad_out, scale)
    ref = round_trip(LocalDispatcher(E), x, ids, w.to(torch.bfloat16), grad_out, scale)
    return {
        k: ((got[k].float() - ref[k].float()).norm() / ref[k].float().norm()).item()
        for k in ("x_by_expert", "out", "grad_x", "grad_w")
    }


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA GPU")
def test_alltoall_over_nccl_on_one_rank_equals_local_dispatch():
    # one rank: NCCL's all-to-all, the Triton kernels and the CUDA sorts of the real path, no peers
    (errors,) = run_ranks(_worker_cuda, 1, backend="nccl")
    assert errors["x_by_expert"] == 0, errors
    assert all(err < 1e-2 for err in errors.values()), errors


def test_combine_of_a_rank_that_received_no_tokens():
    # Skewed routing (e.g. a diverged router) can send every token to the other ranks' experts.
    from workbench.moe.dispatch.local import weighted_sum

    y = torch.zeros(0, 6, requires_grad=True)
    w = torch.zeros(0, 2, requires_grad=True)
    empty = torch.zeros(0, dtype=torch.int64)
    out = weighted_sum(y, w, empty, empty)
    assert out.shape == (0, 6)
    out.sum().backward()
    assert y.grad.shape == (0, 6) and w.grad.shape == (0, 2)


@pytest.mark.parametrize("bound", [0, 1, 127, 255, 256, 4000, 32767, 32768, 70000])
def test_stable_order_on_narrow_keys_is_int64s_stable_order(bound):
    """Expert-major order from keys cast to the narrowest type that holds [0, bound] (one radix pass per byte
    on CUDA) equals int64's stable argsort, ties in slot order, at each type's edge."""
    from workbench.kernels.sorting import stable_order
    from workbench.moe.dispatch.local import sort_by_expert

    g = torch.Generator().manual_seed(bound)
    keys = torch.randint(0, bound + 1, (4096,), generator=g)
    keys[:3] = bound  # the bound itself, tied
    got = stable_order(keys, bound)
    assert torch.equal(got, torch.argsort(keys, stable=True))
    if bound < 300:
        experts = bound + 1
        perm, counts = sort_by_expert(keys.view(-1, 8)[:, : min(8, experts)], experts)
        flat = keys.view(-1, 8)[:, : min(8, experts)].reshape(-1)
        assert torch.equal(perm.slot_order, torch.argsort(flat, stable=True))
        assert torch.equal(counts, torch.bincount(flat, minlength=experts))
    with pytest.raises(ValueError, match="bound"):
        stable_order(keys, -1)
