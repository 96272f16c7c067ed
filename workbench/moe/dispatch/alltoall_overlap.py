"""Expert-parallel all-to-all in token chunks, pipelined with the experts' GEMMs.

BackendConfig.dispatcher='alltoall_overlap', BackendConfig.dispatch_chunks chunks. The plain alltoall dispatcher
sends every row, waits, computes, sends back and waits: the links idle while the experts compute and the GEMMs
idle while rows travel. Here a layer's tokens are cut into `chunks` contiguous runs, each taken through
alltoall's stages (route -> send -> the experts' GEMMs -> send back -> combine), and the runs are interleaved:
chunk c+1's rows are in flight (an async all-to-all: a gloo work handle on CPU ranks, NCCL's own stream on GPUs)
while chunk c's experts compute, and chunk c's partial sums travel home while chunk c+1's experts compute.

The backward mirrors it. Each exchange is two autograd nodes, one that issues the all-to-all and one that waits
for it; autograd runs the nodes made later in the forward first, so in backward a chunk's reversed exchange is
issued by one node and waited by another that runs after the next chunk's expert backward.

Chunks of tokens, not of destination ranks: every chunk keeps every rank's experts busy (a chunk of destinations
leaves the ranks outside it idle, and ties the count to the ep size), any count runs on any ep size, and a chunk's
rows are alltoall's rows for those tokens, so the result is the unchunked one up to the GEMMs' rounding on fewer
rows. What it costs: each chunk is one grouped GEMM over fewer rows per expert, and three all-to-alls each way per
chunk (the split sizes are still one exchange and one host sync per layer).

The experts module hands the GEMMs to `run_stages` (caps.pipelines_experts) instead of calling dispatch and
combine; those two stages (inherited from AllToAllDispatcher) still work, unchunked, for callers that move rows
without experts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.profiler import record_function

from workbench.moe.dispatch.alltoall import AllToAllDispatcher, SentRows, expert_major, rank_counts, route_tokens
from workbench.moe.dispatch.contract import DispatcherCaps
from workbench.moe.dispatch.local import expand_to_rows, weighted_sum

# Shape suffixes: T tokens, D hidden, K top-k, P ep ranks, S rows sent, R rows received, N routed rows.

# The experts' GEMMs on expert-major rows: (rows, rows per local expert) -> the experts' outputs, one per row.
ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Exchange:
    """One uneven all-to-all of a few tensors over an ep group, issued now and finished later, both ways."""

    def __init__(self, group, send_splits: list[int], recv_splits: list[int]):
        self.group = group
        self.send_splits, self.recv_splits = send_splits, recv_splits
        self._works: list = []
        self._held: list[torch.Tensor] = []  # what the collectives read and write until they are waited for
        self._outs: list[torch.Tensor] = []
        self._differentiable: list[bool] = []

    def _issue(self, tensors: Sequence[torch.Tensor], out_splits: list[int], in_splits: list[int]) -> None:
        self._works, self._held, self._outs = [], [], []
        for t in tensors:
            src = t.contiguous()
            out = t.new_empty((sum(out_splits), *t.shape[1:]))
            work = dist.all_to_all_single(out, src, out_splits, in_splits, group=self.group, async_op=True)
            self._works.append(work)
            self._held.append(src)
            self._outs.append(out)

    def _finish(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()
        outs = self._outs
        self._works, self._held, self._outs = [], [], []
        return outs

    def start(self, tensors: Sequence[torch.Tensor]) -> None:
        """Send `tensors` (rows by destination rank, send_splits of them to each)."""
        self._differentiable = [t.is_floating_point() for t in tensors]
        self._issue(tensors, self.recv_splits, self.send_splits)

    def wait(self) -> list[torch.Tensor]:
        """What `start` sent here: recv_splits rows from each rank, per tensor."""
        return self._finish()

    def start_backward(self, grads: Sequence[torch.Tensor]) -> None:
        """Send the received tensors' gradients back (the differentiable ones)."""
        self._issue([g for g, d in zip(grads, self._differentiable) if d], self.send_splits, self.recv_splits)

    def wait_backward(self) -> list[torch.Tensor | None]:
        """The sent tensors' gradients (None for the integer ones), in `start`'s order."""
        grads = iter(self._finish())
        return [next(grads) if d else None for d in self._differentiable]


class _Send(torch.autograd.Function):
    """Issues an exchange; its backward waits for the reversed one (issued by _Receive's backward)."""

    @staticmethod
    def forward(ctx, exchange: Exchange, *sent: torch.Tensor):
        exchange.start(sent)
        ctx.exchange = exchange
        # an empty tensor that puts _Receive after this node in the graph
        return sent[0].new_empty(0)

    @staticmethod
    def backward(ctx, _grad_token):
        return (None, *ctx.exchange.wait_backward())


class _Receive(torch.autograd.Function):
    """Waits for an exchange; its backward issues the reversed one and returns before it arrives."""

    @staticmethod
    def forward(ctx, exchange: Exchange, token: torch.Tensor):
        received = exchange.wait()
        ctx.exchange = exchange
        ctx.token_like = token.new_zeros(0)
        # autograd hands zeros for an output that got no gradient (materialized): every rank sends the same rows
        ctx.mark_non_differentiable(*[r for r in received if not r.is_floating_point()])
        return tuple(received)

    @staticmethod
    def backward(ctx, *grads):
        ctx.exchange.start_backward(grads)
        return None, ctx.token_like


def send(exchange: Exchange, *tensors: torch.Tensor) -> torch.Tensor:
    """Issue `exchange` of `tensors`; the returned token goes to `receive`."""
    return _Send.apply(exchange, *tensors)


def receive(exchange: Exchange, token: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Wait for `exchange`: what the ranks sent here."""
    return _Receive.apply(exchange, token)


@dataclass
class Chunk:
    """One run of a layer's tokens [first, last) through the stages, with what each stage leaves for the next."""

    index: int
    first: int
    last: int
    send_splits: list[int]
    recv_splits: list[int]
    num_rows: int  # expert-major rows this rank's experts compute for the chunk
    sent: SentRows | None = None
    out: Exchange | None = None
    out_token: torch.Tensor | None = None
    recv_weights_RK: torch.Tensor | None = None
    row_of_slot: torch.Tensor | None = None
    slot_of_row: torch.Tensor | None = None
    back: Exchange | None = None
    back_token: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.last - self.first


def chunk_bounds(num_tokens: int, chunks: int) -> list[tuple[int, int]]:
    """[first, last) of each chunk: as even as whole tokens allow (a chunk may be empty when tokens < chunks)."""
    cuts = [c * num_tokens // chunks for c in range(chunks + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


class AllToAllOverlapDispatcher(AllToAllDispatcher):
    """alltoall's rows in `chunks` token chunks, each chunk's exchanges overlapping its neighbours' expert GEMMs."""

    # runs the experts itself (run_stages); its combine weighs and sends home, as alltoall's
    caps = DispatcherCaps(pipelines_experts=True)

    def __init__(self, num_experts: int, ep_group, combine: str = "torch", chunks: int = 2):
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"dispatch chunks must be an integer >= 1, got {chunks!r}")
        super().__init__(num_experts, ep_group, combine)
        self.chunks = chunks

    def plan_chunks(self, topk_ids_TK: torch.Tensor) -> list[Chunk]:
        """Every chunk's split sizes: one exchange of the counts and one host sync for the layer."""
        P, C = self.ep_size, self.chunks
        bounds = chunk_bounds(topk_ids_TK.shape[0], C)
        counts_sent = torch.stack([rank_counts(topk_ids_TK[a:b], P, self.num_local_experts)[1] for a, b in bounds], 1)
        counts_recv = torch.empty_like(counts_sent)  # [src rank, chunk, (rows, slots)]
        dist.all_to_all_single(counts_recv, counts_sent, group=self.group)
        sizes = torch.cat([counts_sent[:, :, 0], counts_recv[:, :, 0], counts_recv[:, :, 1].sum(0, keepdim=True)])
        rows = sizes.t().tolist()  # per chunk: P sent, P received, the rows for the experts
        return [Chunk(c, a, b, rows[c][:P], rows[c][P : 2 * P], rows[c][2 * P]) for c, (a, b) in enumerate(bounds)]

    # The stages, one chunk each, in the contract's order for every chunk.

    def route(self, chunk: Chunk, x_TD, topk_ids_TK, topk_weights_TK) -> list[torch.Tensor]:
        """The chunk's sent rows, their slots' local expert ids and routing weights."""
        ids = topk_ids_TK[chunk.first : chunk.last]
        in_rank_TP, _ = rank_counts(ids, self.ep_size, self.num_local_experts)
        chunk.sent = route_tokens(
            ids, topk_weights_TK[chunk.first : chunk.last], in_rank_TP, sum(chunk.send_splits), self.num_local_experts
        )
        x_sent = expand_to_rows(
            x_TD[chunk.first : chunk.last],
            chunk.sent.token_of_row,
            chunk.sent.home_row_of_slot,
            self.ep_size,
            self.use_triton,
        )
        return [x_sent, chunk.sent.weights_SK, chunk.sent.ids_SK]

    def send(self, chunk: Chunk, sent: list[torch.Tensor]) -> None:
        """Issue the chunk's all-to-all (returns at once; `receive` waits)."""
        chunk.out = Exchange(self.group, chunk.send_splits, chunk.recv_splits)
        chunk.out_token = send(chunk.out, *sent)

    def receive(self, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the chunk's rows: expert-major rows and rows per local expert."""
        recv_x, chunk.recv_weights_RK, recv_ids = receive(chunk.out, chunk.out_token)
        x_ND, tokens_per_expert, chunk.row_of_slot, chunk.slot_of_row = expert_major(
            recv_x, recv_ids, self.num_local_experts, chunk.num_rows, self.use_triton
        )
        return x_ND, tokens_per_expert

    def send_back(self, chunk: Chunk, y_ND: torch.Tensor) -> None:
        """Weigh and sum the experts' rows per received row, and issue their all-to-all home."""
        partial_RD = weighted_sum(y_ND, chunk.recv_weights_RK, chunk.row_of_slot, chunk.slot_of_row, self.use_triton)
        chunk.back = Exchange(self.group, chunk.recv_splits, chunk.send_splits)
        chunk.back_token = send(chunk.back, partial_RD)

    def combine_chunk(self, chunk: Chunk) -> torch.Tensor:
        """Wait for the chunk's partial sums and add them per token: its tokens' outputs [last - first, D]."""
        (partial_home_SD,) = receive(chunk.back, chunk.back_token)
        ones_TP = torch.ones(chunk.num_tokens, self.ep_size, device=partial_home_SD.device)
        sent = chunk.sent
        return weighted_sum(partial_home_SD, ones_TP, sent.home_row_of_slot, sent.home_slot_of_row, self.use_triton)

    def run_stages(self, x_TD, topk_ids_TK, topk_weights_TK, experts: ExpertsFn) -> torch.Tensor:
        """The layer's outputs [T, D]: every chunk through route, send, receive, `experts`, send back, combine.

        Chunk c+1 is routed and sent before chunk c's experts run, and chunk c's sums are combined after chunk
        c+1's experts ran: each exchange has a chunk's GEMMs to hide behind.
        """
        # The profiler's phases (train/profile.py), as the experts module labels the unchunked stages; `experts`
        # labels its own.
        with record_function("workbench.dispatch"):
            chunks = self.plan_chunks(topk_ids_TK)
        outputs: list[torch.Tensor] = []

        def issue(chunk: Chunk) -> None:
            with record_function("workbench.dispatch"):
                self.send(chunk, self.route(chunk, x_TD, topk_ids_TK, topk_weights_TK))

        def finish(chunk: Chunk) -> None:
            with record_function("workbench.combine"):
                outputs.append(self.combine_chunk(chunk))

        issue(chunks[0])
        for c, chunk in enumerate(chunks):
            if c + 1 < len(chunks):
                issue(chunks[c + 1])
            with record_function("workbench.dispatch"):
                x_ND, tokens_per_expert = self.receive(chunk)
            y_ND = experts(x_ND, tokens_per_expert)
            with record_function("workbench.combine"):
                self.send_back(chunk, y_ND)
            if c > 0:
                finish(chunks[c - 1])
        finish(chunks[-1])
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
