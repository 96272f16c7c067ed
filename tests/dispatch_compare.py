"""Shared by the GPU dispatcher tests (symm_mem, deepep): routing, a round trip, and the timing table."""

from __future__ import annotations

import statistics
import sys

import torch
import torch.distributed as dist

from workbench.moe.dispatch import make_dispatcher

# Shape suffixes: T tokens, D hidden, K top-k.


def random_routing(num_tokens: int, num_experts: int, top_k: int, generator, device):
    """Distinct top-k ids per token from a skewed expert popularity (uneven counts), softmax weights."""
    popularity = torch.rand(num_experts, generator=generator) ** 3 + 1e-3
    ids = torch.multinomial(popularity.expand(num_tokens, -1), top_k, replacement=False, generator=generator)
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=generator), dim=-1)
    return ids.to(device), weights.to(device)


def round_trip(dispatcher, x_TD, ids_TK, w_TK, grad_out_TD, expert_scale_E_local):
    """dispatch -> a per-expert elementwise 'expert' -> combine -> backward; everything the tests compare."""
    x = x_TD.clone().requires_grad_(True)
    w = w_TK.clone().requires_grad_(True)
    x_by_expert, tokens_per_expert, handle = dispatcher.dispatch(x, ids_TK, w)
    scale_rows = torch.repeat_interleave(
        expert_scale_E_local, tokens_per_expert, dim=0, output_size=x_by_expert.shape[0]
    )
    y = torch.tanh(x_by_expert) * scale_rows[:, None].to(x_by_expert.dtype)
    out = dispatcher.combine(y, handle)
    out.backward(grad_out_TD)
    return {
        "x_by_expert": x_by_expert.detach(),
        "tokens_per_expert": tokens_per_expert,
        "out": out.detach(),
        "grad_x": x.grad,
        "grad_w": w.grad,
    }


def bench_worker(rank, world, candidate, num_tokens, top_k, hidden, num_experts, iters):
    """Median ms of dispatch+combine forward, and forward+backward, for alltoall and `candidate`."""
    device = torch.device("cuda", rank)
    group = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(7 + rank)
    ids, weights = random_routing(num_tokens, num_experts, top_k, g, device)
    x = torch.randn(num_tokens, hidden, generator=g).to(device, torch.bfloat16)
    grad_out = torch.randn(num_tokens, hidden, generator=g).to(device, torch.bfloat16)
    weights = weights.to(torch.bfloat16)
    rows = {}
    for name in ("alltoall", candidate):
        dispatcher = make_dispatcher(name, num_experts, group)
        times = {"fwd": [], "fwd+bwd": []}
        for it in range(iters + 3):
            xr = x.clone().requires_grad_(True)
            wr = weights.clone().requires_grad_(True)
            start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            dist.barrier(group)
            start.record()
            x_by_expert, _, handle = dispatcher.dispatch(xr, ids, wr)
            out = dispatcher.combine(x_by_expert * 2, handle)
            mid.record()
            out.backward(grad_out)
            end.record()
            torch.cuda.synchronize()
            if it >= 3:
                times["fwd"].append(start.elapsed_time(mid))
                times["fwd+bwd"].append(start.elapsed_time(end))
        rows[name] = {k: statistics.median(v) for k, v in times.items()}
        for release in ("close", "release"):  # free symmetric / DeepEP buffers before the next one
            if hasattr(dispatcher, release):
                getattr(dispatcher, release)()
                break
    return rows


def print_bench(results, num_tokens, top_k, hidden, num_experts, iters) -> None:
    """The timing table of `bench_worker` results, one row per rank and dispatcher."""
    print(
        f"torch {torch.__version__}; {num_tokens} tokens x top-{top_k} x {hidden} bf16 per rank, "
        f"{num_experts} experts over 2 ranks; median of {iters} (CUDA events), ms"
    )
    print(f"{'dispatcher':<10} {'rank':>4} {'fwd':>9} {'fwd+bwd':>9}")
    for rank, rows in enumerate(results):
        for name, t in rows.items():
            print(f"{name:<10} {rank:>4} {t['fwd']:>9.3f} {t['fwd+bwd']:>9.3f}")


def bench_two_gpus(
    run_gpu_ranks, candidate: str, num_tokens=8192, top_k=8, hidden=2048, num_experts=128, iters=20
) -> None:
    """Script mode of a dispatcher test: median ms of `candidate` and alltoall on 2 GPUs, as a table."""
    if torch.cuda.device_count() < 2:
        sys.exit("--bench needs 2 CUDA GPUs")
    results = run_gpu_ranks(bench_worker, 2, candidate, num_tokens, top_k, hidden, num_experts, iters)
    print_bench(results, num_tokens, top_k, hidden, num_experts, iters)


def generic_family_grads(rank: int, world: int, family: str, dispatchers: tuple[str, ...]) -> dict:
    """Loss and gradients of a tiny generic-path family on DP x EP = world, bf16 on this rank's GPU, per dispatcher.

    The same seed builds the same weights for each dispatcher; each rank takes its own tokens.
    """
    import torch
    from generic_families import tiny_config
    from torch.distributed.tensor import DTensor

    from workbench import BackendConfig
    from workbench.models.auto import AutoModelForCausalLM
    from workbench.moe.dispatch import close_dispatchers
    from workbench.parallel.mesh import MeshConfig

    cfg = tiny_config(family, hidden_size=64, head_dim=16)  # 128-byte bf16 rows: symm_mem's and DeepEP's multiples
    ids = torch.randint(0, cfg.vocab_size, (2 * world, 32), generator=torch.Generator().manual_seed(5))
    mine = ids[2 * rank : 2 * rank + 2].cuda()
    out = {}
    for name in dispatchers:
        model = AutoModelForCausalLM.from_config(
            cfg,
            mesh=MeshConfig(dp=world, ep=world),
            seed=3,
            dtype=torch.bfloat16,
            backend=BackendConfig(dispatcher=name, experts="grouped_mm"),
        )
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        grads = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float().cpu()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        out[name] = {"loss": float(loss), "grads": grads}
        close_dispatchers(model)
    return out


def check_generic_family_grads(results: list[dict], reference: str, candidate: str) -> None:
    """The candidate dispatcher's loss and gradients equal the reference's up to bf16 rounding, on every rank."""
    for rank, r in enumerate(results):
        a, b = r[reference], r[candidate]
        assert abs(a["loss"] - b["loss"]) <= 2e-2 * max(abs(a["loss"]), 1.0), (rank, a["loss"], b["loss"])
        assert a["grads"].keys() == b["grads"].keys()
        for n, g in a["grads"].items():
            diff = float((g - b["grads"][n]).abs().max())
            assert diff <= 5e-2 * max(float(g.abs().max()), 1e-2), (
                f"rank {rank} {n}: |{candidate} - {reference}| {diff}"
            )
