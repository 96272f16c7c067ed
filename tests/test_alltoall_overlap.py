"""The overlapped all-to-all dispatcher (alltoall_overlap) on gloo CPU ranks: chunked equals unchunked equals one
process, forward and backward; its stages run in the contract's order, interleaved across chunks."""

from __future__ import annotations

import pytest
import torch
from dispatch_compare import random_routing
from launch_utils import run_ranks

from workbench.backends import BackendConfig, BackendError
from workbench.moe.dispatch.alltoall_overlap import chunk_bounds

# Shape suffixes: T tokens, D hidden, E experts, K top-k, N routed rows.

# Tokens per rank: uneven, none a multiple of 2 or 3, and rank 1 has fewer tokens than 3 chunks (an empty chunk).
TOKENS_OF_RANK = (23, 2, 17, 11)
D, H = 8, 12


def _inputs(world: int, E: int, K: int):
    """Every rank's tokens, routing and output gradient, and the experts' weights; one generator: the same on every
    rank. Expert 1 receives no token from any rank."""
    g = torch.Generator().manual_seed(21)
    ranks = []
    for r in range(world):
        T = TOKENS_OF_RANK[r]
        ids, w = random_routing(T, E - 1, K, g, "cpu")
        ids = ids + (ids >= 1).long()  # skip expert 1
        ranks.append((torch.randn(T, D, generator=g), ids, w, torch.randn(T, D, generator=g)))
    up_EDH = torch.randn(E, D, H, generator=g) / D**0.5
    down_EHD = torch.randn(E, H, D, generator=g) / H**0.5
    return ranks, up_EDH, down_EHD


def _experts(up_EDH: torch.Tensor, down_EHD: torch.Tensor):
    """Expert MLPs on expert-major rows: a loop of matmuls over the experts' row runs (a real GEMM per expert)."""

    def run(x_ND: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs = [
            torch.nn.functional.silu(rows @ up_EDH[e]) @ down_EHD[e]
            for e, rows in enumerate(torch.split(x_ND, tokens_per_expert.tolist()))
        ]
        return torch.cat(outs) if outs else x_ND[:0]

    return run


def _round_trip(run, x_TD, ids, w_TK, grad_out, up, down) -> dict:
    """`run(x, ids, w, experts)` -> out; backward of <out, grad_out>: the output and every gradient."""
    x = x_TD.clone().requires_grad_(True)
    w = w_TK.clone().requires_grad_(True)
    up, down = up.clone().requires_grad_(True), down.clone().requires_grad_(True)
    out = run(x, ids, w, _experts(up, down))
    out.backward(grad_out)
    return {"out": out.detach(), "grad_x": x.grad, "grad_w": w.grad, "grad_up": up.grad, "grad_down": down.grad}


def _local(x, ids, w, experts, E):
    from workbench.moe.dispatch import LocalDispatcher

    dispatcher = LocalDispatcher(E)
    x_ND, tokens_per_expert, handle = dispatcher.dispatch(x, ids, w)
    return dispatcher.combine(experts(x_ND, tokens_per_expert), handle)


def _worker(rank: int, world: int, E: int, K: int, device: str = "cpu") -> dict:
    import torch.distributed as dist

    from workbench.moe.dispatch import make_dispatcher

    ranks, up, down = _inputs(world, E, K)
    on = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    ranks = [tuple(t.to(on) for t in r) for r in ranks]
    up, down = up.to(on), down.to(on)
    L = E // world
    mine = slice(rank * L, (rank + 1) * L)
    x, ids, w, grad_out = ranks[rank]
    one_process = _round_trip(lambda *a: _local(*a, E), x, ids, w, grad_out, up, down)
    # the reference's expert gradients: every rank's tokens through this rank's experts, summed
    for src in range(world):
        if src != rank:
            other = _round_trip(lambda *a: _local(*a, E), *ranks[src], up, down)
            one_process["grad_up"] = one_process["grad_up"] + other["grad_up"]
            one_process["grad_down"] = one_process["grad_down"] + other["grad_down"]
    one_process["grad_up"], one_process["grad_down"] = one_process["grad_up"][mine], one_process["grad_down"][mine]

    def plain(x, ids, w, experts):
        dispatcher = make_dispatcher("alltoall", E, dist.group.WORLD)
        x_ND, tokens_per_expert, handle = dispatcher.dispatch(x, ids, w)
        return dispatcher.combine(experts(x_ND, tokens_per_expert), handle)

    got = {"alltoall": _round_trip(plain, x, ids, w, grad_out, up[mine], down[mine])}
    for chunks in (1, 2, 3):
        dispatcher = make_dispatcher("alltoall_overlap", E, dist.group.WORLD, chunks=chunks)
        got[chunks] = _round_trip(dispatcher.run_stages, x, ids, w, grad_out, up[mine], down[mine])
    errors = {name: {k: (r[k] - one_process[k]).abs().max().item() for k in one_process} for name, r in got.items()}
    # chunked against unchunked: the same rows, the GEMMs on fewer of them at a time
    chunked = {c: {k: (got[c][k] - got[1][k]).abs().max().item() for k in one_process} for c in (2, 3)}
    return {
        "errors": errors,
        "chunked": chunked,
        "one_chunk_is_alltoall": all(torch.equal(got[1][k], got["alltoall"][k]) for k in one_process),
        "scale": {k: v.abs().max().item() for k, v in one_process.items()},
        "expert_1_rows": int((ids == 1).sum()),
    }


@pytest.mark.slow
@pytest.mark.parametrize("world,E,K", [(2, 8, 2), (4, 8, 3)])
def test_overlap_in_1_2_3_chunks_equals_alltoall_and_one_process(world, E, K):
    results = run_ranks(_worker, world, E, K)
    for rank, r in enumerate(results):
        assert r["expert_1_rows"] == 0
        # one chunk runs alltoall's stages in alltoall's order: bit for bit its result
        assert r["one_chunk_is_alltoall"], rank
        for name, errors in r["errors"].items():
            for key, err in errors.items():
                assert err <= 1e-5 * max(r["scale"][key], 1.0), (rank, name, key, err)
        for chunks, errors in r["chunked"].items():
            for key, err in errors.items():
                assert err <= 1e-6 * max(r["scale"][key], 1.0), (rank, chunks, key, err)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL and CUDA streams need a CUDA GPU")
@pytest.mark.parametrize("world", [1, 2])
def test_overlap_over_nccl_equals_alltoall_and_one_process(world):
    # NCCL's async all-to-alls on its own stream, waited for by the compute stream, forward and backward
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    for rank, r in enumerate(run_ranks(_worker, world, 8, 2, "cuda", backend="nccl")):
        assert r["one_chunk_is_alltoall"], rank
        for name, errors in r["errors"].items():
            for key, err in errors.items():
                assert err <= 1e-4 * max(r["scale"][key], 1.0), (rank, name, key, err)
        for chunks, errors in r["chunked"].items():
            for key, err in errors.items():
                assert err <= 1e-5 * max(r["scale"][key], 1.0), (rank, chunks, key, err)


class _Mark(torch.autograd.Function):
    """Identity whose backward notes `what` in `log`: where a chunk's expert backward starts and ends."""

    @staticmethod
    def forward(ctx, x, log, what):
        ctx.log, ctx.what = log, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.what)
        return grad, None, None


def _recording_worker(rank: int, world: int, chunks: int, slow_send: tuple[int, int, float] | None = None) -> dict:
    """One forward and backward of run_stages with every stage, every exchange's issue and wait (both ways) and
    each chunk's expert backward noted in order. `slow_send` (rank, chunk, seconds): that rank sleeps before it
    sends that chunk; the stages' wall-clock times come back too."""
    import time

    import torch.distributed as dist

    import workbench.moe.dispatch.alltoall_overlap as overlap

    log: list[tuple] = []
    times: dict[tuple, float] = {}

    class RecordingExchange(overlap.Exchange):
        made = 0

        def __init__(self, *args):
            super().__init__(*args)
            self.number = RecordingExchange.made
            RecordingExchange.made += 1

        def start(self, tensors):
            log.append(("issue", self.number))
            super().start(tensors)

        def wait(self):
            log.append(("wait", self.number))
            return super().wait()

        def start_backward(self, grads):
            log.append(("issue_backward", self.number))
            super().start_backward(grads)

        def wait_backward(self):
            log.append(("wait_backward", self.number))
            return super().wait_backward()

    overlap.Exchange = RecordingExchange  # this spawned process only

    class Recording(overlap.AllToAllOverlapDispatcher):
        def _note(self, stage, chunk):
            log.append((stage, chunk.index))
            times[(stage, chunk.index)] = time.time()

        def route(self, chunk, *args):
            self._note("route", chunk)
            return super().route(chunk, *args)

        def send(self, chunk, sent):
            if slow_send is not None and slow_send[:2] == (rank, chunk.index):
                time.sleep(slow_send[2])
            self._note("send", chunk)
            return super().send(chunk, sent)

        def receive(self, chunk):
            self._note("receive", chunk)
            return super().receive(chunk)

        def send_back(self, chunk, y_ND):
            self._note("send_back", chunk)
            return super().send_back(chunk, y_ND)

        def combine_chunk(self, chunk):
            self._note("combine", chunk)
            return super().combine_chunk(chunk)

    ranks, up, down = _inputs(world, 4, 2)
    x, ids, w, grad_out = ranks[rank]
    x, w = x.requires_grad_(True), w.requires_grad_(True)
    dispatcher = Recording(4, dist.group.WORLD, chunks=chunks)
    L = dispatcher.num_local_experts
    mine = slice(rank * L, (rank + 1) * L)
    experts = _experts(up[mine].requires_grad_(True), down[mine].requires_grad_(True))
    chunk_of_call = iter(range(chunks))

    def recorded_experts(x_ND, tokens_per_expert):
        c = next(chunk_of_call)
        log.append(("experts", c))
        times[("experts", c)] = time.time()
        y_ND = experts(_Mark.apply(x_ND, log, ("experts_backward_end", c)), tokens_per_expert)
        return _Mark.apply(y_ND, log, ("experts_backward", c))

    out = dispatcher.run_stages(x, ids, w, recorded_experts)
    assert out.shape == x.shape
    log.append(("backward", -1))
    out.backward(grad_out)
    return {"log": log, "times": times}


def _in_flight_at(log: list[tuple], event: tuple, issue: str, wait: str) -> set[int]:
    """The exchanges issued (`issue`) and not yet waited for (`wait`) where `event` is in `log`."""
    flying: set[int] = set()
    for entry in log[: log.index(event)]:
        if entry[0] == issue:
            flying.add(entry[1])
        elif entry[0] == wait:
            flying.discard(entry[1])
    return flying


@pytest.mark.slow
def test_stages_run_in_the_contracts_order_per_chunk_and_exchanges_overlap_the_experts_both_ways():
    chunks = 3
    stages = ["route", "send", "receive", "experts", "send_back", "combine"]
    for result in run_ranks(_recording_worker, 2, chunks):
        log = result["log"]
        forward = [e for e in log[: log.index(("backward", -1))] if e[0] in stages]
        assert sorted(forward) == sorted((s, c) for s in stages for c in range(chunks))  # each stage once per chunk
        at = {call: i for i, call in enumerate(forward)}
        for c in range(chunks):
            # the contract's order within a chunk
            assert [at[(s, c)] for s in stages] == sorted(at[(s, c)] for s in stages), forward
        for c in range(chunks - 1):
            # chunk c+1 is in flight while chunk c's experts compute ...
            assert at[("send", c + 1)] < at[("experts", c)], forward
            # ... and chunk c's sums travel home while chunk c+1's experts compute
            assert at[("send_back", c)] < at[("experts", c + 1)] < at[("combine", c)], forward
        # two exchanges per chunk (out and back), each issued then waited for once in forward, once in backward
        for issue, wait in (("issue", "wait"), ("issue_backward", "wait_backward")):
            assert sorted(e[1] for e in log if e[0] == issue) == list(range(2 * chunks)), log
            assert sorted(e[1] for e in log if e[0] == wait) == list(range(2 * chunks)), log
            assert all(log.index((issue, n)) < log.index((wait, n)) for n in range(2 * chunks)), log
        for c in range(chunks):
            # every chunk's expert GEMMs run with an exchange in flight, in forward and in backward
            assert _in_flight_at(log, ("experts", c), "issue", "wait"), (c, log)
            assert _in_flight_at(log, ("experts_backward", c), "issue_backward", "wait_backward"), (c, log)
            assert log.index(("experts_backward", c)) < log.index(("experts_backward_end", c))


@pytest.mark.slow
def test_a_send_returns_before_its_rows_arrive():
    # rank 1 sleeps 1 s before sending chunk 1: rank 0 has issued its own chunk-1 all-to-all by then, and computes
    # chunk 0's experts while that exchange waits for rank 1 (a blocking send would hold rank 0 until rank 1 sent)
    first, second = run_ranks(_recording_worker, 2, 2, (1, 1, 1.0))
    assert first["times"][("send", 1)] < first["times"][("experts", 0)] < second["times"][("send", 1)] - 0.5


def test_dispatch_chunks_is_validated_before_any_model_is_built():
    assert BackendConfig().dispatch_chunks == 2
    assert (
        BackendConfig(dispatcher="alltoall_overlap", dispatch_chunks=3).resolve("cpu", world_size=2).dispatch_chunks
        == 3
    )
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(BackendError, match="dispatch_chunks must be an integer >= 1"):
            BackendConfig(dispatch_chunks=bad)
    assert BackendConfig.from_dict(BackendConfig(dispatch_chunks=4).to_dict()).dispatch_chunks == 4


def test_the_overlapped_dispatcher_declares_that_it_runs_the_experts():
    from workbench.moe.dispatch import DispatcherCaps
    from workbench.moe.dispatch.alltoall import AllToAllDispatcher
    from workbench.moe.dispatch.alltoall_overlap import AllToAllOverlapDispatcher

    assert AllToAllOverlapDispatcher.caps == DispatcherCaps(pipelines_experts=True)
    assert not AllToAllDispatcher.caps.pipelines_experts


def test_chunk_bounds_cover_every_token_once():
    for tokens in (0, 1, 2, 7, 23):
        for chunks in (1, 2, 3, 5):
            bounds = chunk_bounds(tokens, chunks)
            assert len(bounds) == chunks and bounds[0][0] == 0 and bounds[-1][1] == tokens
            assert all(a <= b and b == bounds[i + 1][0] for i, (a, b) in enumerate(bounds[:-1]))
            sizes = [b - a for a, b in bounds]
            assert max(sizes) - min(sizes) <= 1


# The dispatchers that run on gloo CPU ranks, against one process (symm_mem: its own test below).
# "+recompute": the expert GEMMs recomputed per chunk (expert_recompute) inside decoder layers replayed in backward
# (activation checkpointing): every exchange runs again in the replay.
MODEL_DISPATCHERS = ("local", "alltoall", "alltoall_overlap", "alltoall_overlap+recompute")
MODEL_STEPS = 3


def _model_worker(rank: int, world: int, ckpt: str, dispatchers: tuple[str, ...]) -> dict:
    """Per dispatcher: MODEL_STEPS SGD steps on dp=world (ep=world, or 1 for 'local'), each rank on its own fresh
    random tokens, beside one process on the whole batch: each step's loss and largest relative gradient error."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import workbench
    from workbench.models.engine_state import engine_state
    from workbench.models.generic import engine_experts_modules
    from workbench.parallel.mesh import MeshConfig, dense_mesh
    from workbench.train.activation_checkpoint import apply_activation_checkpointing

    out = {}
    for name in dispatchers:
        dispatcher, recompute = name.removesuffix("+recompute"), name.endswith("+recompute")
        ep = 1 if dispatcher == "local" else world
        backend = workbench.BackendConfig(
            experts="grouped_mm", dispatcher=dispatcher, dispatch_chunks=3, expert_recompute=recompute
        )
        model = workbench.AutoModelForCausalLM.from_pretrained(ckpt, mesh=MeshConfig(dp=world, ep=ep), backend=backend)
        if recompute:
            assert apply_activation_checkpointing(model) == model.config.num_hidden_layers
        ref = workbench.AutoModelForCausalLM.from_pretrained(ckpt, device="cpu")
        experts = {f"{n}.{p}" for n, m in engine_experts_modules(model) for p in m.plan.layout.param_names()}
        # the class, and whether the experts module hands it the GEMMs (run_stages) or calls dispatch and combine
        kinds = {
            (type(m.plan.dispatcher).__name__, m.plan.experts_in_dispatcher) for _, m in engine_experts_modules(model)
        }
        # SGD: AdamW's first steps are about lr whatever the gradient's size, so float32 rounding of a near-zero
        # gradient (summed over ranks in another order) would move a weight by a whole step
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
        ref_params = dict(ref.named_parameters())
        # the router's aux loss (coefficient 0.02) over the whole batch's routing, as one process computes it
        aux = {"output_router_logits": True, "aux_loss_group": dense_mesh(engine_state(model).device_mesh).get_group()}
        steps = []
        for step in range(MODEL_STEPS):
            g = torch.Generator().manual_seed(100 + step)
            ids = torch.randint(0, model.config.vocab_size, (2 * world, 11), generator=g)
            labels = ids.clone()
            labels[:, :2] = -100
            items = (labels[:, 1:] != -100).sum()
            mine = slice(2 * rank, 2 * rank + 2)
            loss = model(input_ids=ids[mine], labels=labels[mine], num_items_in_batch=items, **aux).loss
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            ref_loss = ref(input_ids=ids, labels=labels, num_items_in_batch=items, output_router_logits=True).loss
            ref_loss.backward()
            worst = 0.0
            for pname, p in model.named_parameters():
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                want = ref_params[pname].grad
                if pname in experts and grad.shape[0] != want.shape[0]:
                    first = rank % ep * grad.shape[0]
                    want = want[first : first + grad.shape[0]]
                worst = max(worst, (grad - want).abs().max().item() / max(want.abs().max().item(), 1e-3))
            steps.append({"loss": total.item(), "ref_loss": ref_loss.item(), "grad_rel": worst})
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        out[name] = {"steps": steps, "dispatchers": sorted(kinds)}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_cpu_dispatcher_trains_as_one_process(moe_checkpoint, world):
    results = run_ranks(_model_worker, world, str(moe_checkpoint[1]), MODEL_DISPATCHERS)
    classes = {
        "local": ("LocalDispatcher", False),
        "alltoall": ("AllToAllDispatcher", False),
        "alltoall_overlap": ("AllToAllOverlapDispatcher", True),
        "alltoall_overlap+recompute": ("AllToAllOverlapDispatcher", True),
    }
    for rank, r in enumerate(results):
        for name in MODEL_DISPATCHERS:
            assert r[name]["dispatchers"] == [classes[name]], (rank, name)
            for step, s in enumerate(r[name]["steps"]):
                assert abs(s["loss"] - s["ref_loss"]) <= 1e-5 * abs(s["ref_loss"]), (rank, name, step, s)
                assert s["grad_rel"] <= 1e-4, (rank, name, step, s)


def test_symm_mem_on_gloo_cpu_ranks():
    from workbench.backends import availability

    runs, why = availability("dispatcher", "symm_mem", "cpu", 2)
    assert not runs and "CUDA" in why
    pytest.skip(
        f"symm_mem cannot run on gloo CPU ranks ({why}); on 2 GPUs tests/test_symm_mem.py compares its loss and "
        "gradients with alltoall's"
    )


def test_bench_variant_runs_the_overlapped_dispatcher_beside_engine():
    from workbench.bench.config import VARIANTS, VariantSpec
    from workbench.bench.variant_backend import variant_backend
    from workbench.config import ConfigError

    backend = variant_backend(VARIANTS["engine_alltoall_overlap"], BackendConfig())
    assert (backend.dispatcher, backend.dispatch_chunks) == ("alltoall_overlap", 2)
    assert variant_backend(VARIANTS["engine"], BackendConfig()).dispatcher == "auto"  # alltoall on ep >= 2
    for bad in (0, True, "2"):
        with pytest.raises(ConfigError, match="dispatch_chunks"):
            VariantSpec("engine", "bad", backend=(("dispatch_chunks", bad),))
