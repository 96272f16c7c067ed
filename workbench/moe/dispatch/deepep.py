"""Expert-parallel dispatch over DeepEP's intranode (NVLink) kernels: the optional `deepep` extra.

Same contract as `alltoall`: rank r owns experts [r*L, (r+1)*L); `dispatch` returns this rank's
rows in expert-major order (expert, then source rank, then source token: the order `alltoall`
produces) with int64 counts per local expert, and `combine` returns each token's weighted sum.

The protocol is `alltoall`'s too: a token goes once to each destination rank (not once per
expert) with its routing weights, each rank sums its own experts' outputs per token weighted (in
float32, local.weighted_sum), and DeepEP's combine adds those per-rank partial sums at home
(in bf16 inside DeepEP, where `alltoall` adds them in float32).

Autograd: dispatch's backward is a DeepEP combine of the gradients (rows and routing weights) with
the same handle; combine's backward is a cached DeepEP dispatch (the handle's layout).

Written against the V1 `deep_ep.Buffer` API (DeepEP 1.2.x; also the `Buffer` of later releases):
get_dispatch_layout / dispatch / combine / destroy. Intranode only (2, 4 or 8 ranks of one host),
bf16 only (DeepEP's combine kernel). The PyPI `deep-ep` needs DeepSeek's patched NVSHMEM; for
intranode use, DeepEP 1.2.x builds from source without NVSHMEM (setup.py's no-NVSHMEM branch).

Buffer lifetime: one `deep_ep.Buffer` per dispatcher (build.py makes one dispatcher per model, so
one per process group), made at the first dispatch and sized from the hidden size and dtype. It is
freed only by `close()`, which is collective over the ep group (DeepEP's destroy synchronizes the
peers): model owners call `workbench.moe.dispatch.close_dispatchers(model)`, and a cluster's
rank-side teardown calls `close_live_dispatchers()`. A dispatcher dropped without `close()` leaks
its buffer (DeepEP prints a warning) rather than risking a destructor that waits for peers.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from workbench.backends import DEEPEP_EP_SIZES, INSTALL_HINT, BackendError
from workbench.kernels.sorting import stable_order
from workbench.moe.dispatch.contract import NO_CAPS
from workbench.moe.dispatch.local import combine_uses_triton, expand_to_rows, weighted_sum

# Shape suffixes: T tokens, D hidden, K top-k, R rows received, N routed rows.

# Limits of DeepEP 1.2.x's intranode kernels, checked here so that a misfit is a clear error
# rather than a device-side assert that takes the CUDA context down with it.
MAX_LOCAL_EXPERTS = 128  # notify_dispatch: one thread per local expert
MAX_TOP_K = 32  # dispatch: one lane per top-k slot
TMA_BYTES_PER_WARP = 8192  # dispatch copies half a row per TMA transfer, plus an 8-byte barrier
ROW_BYTES_MULTIPLE = 32  # rows are copied as int4 pairs


def import_deep_ep():
    """The `deep_ep` module, or a BackendError naming the extra to install."""
    try:
        import deep_ep
    except ImportError as err:
        raise BackendError(
            f"dispatcher='deepep' needs DeepEP, which cannot be imported here ({err}): "
            f"{INSTALL_HINT['deepep']}; or use dispatcher='alltoall'"
        ) from err
    return deep_ep


def nvl_buffer_bytes(deep_ep, hidden_bytes: int, ep_size: int) -> int:
    """DeepEP's recommended NVLink buffer size for rows of `hidden_bytes` over `ep_size` ranks."""
    configs = (deep_ep.Buffer.get_dispatch_config(ep_size), deep_ep.Buffer.get_combine_config(ep_size))
    return max(c.get_nvl_buffer_size_hint(hidden_bytes, ep_size) for c in configs)


class BufferSlot:
    """Holds one communication buffer: made on first use, remade when too small, freed by close()."""

    def __init__(self, make: Callable[[int], Any]):
        self._make = make
        self.buffer: Any = None
        self.num_bytes = 0
        self.key: str | None = None  # the same on every rank of the group (see DeepEPDispatcher._new_buffer)

    def get(self, num_bytes: int) -> Any:
        """The buffer, at least `num_bytes` large (collective when it has to be made)."""
        if self.buffer is None or self.num_bytes < num_bytes:
            self.close()
            self.buffer, self.key = self._make(num_bytes)
            self.num_bytes = num_bytes
        return self.buffer

    def close(self) -> bool:
        """Destroy the buffer if there is one; True if one was destroyed. Idempotent."""
        if self.buffer is None:
            return False
        buffer, self.buffer, self.num_bytes, self.key = self.buffer, None, 0, None
        buffer.destroy()
        return True


@dataclass
class _Exchange:
    """One dispatch's layout in, DeepEP's handle and received routing out (shared with combine)."""

    buffer: Any
    topk_idx_TK: torch.Tensor
    tokens_per_rank: torch.Tensor
    token_in_rank_TP: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    handle: Any = None
    recv_idx_RK: torch.Tensor | None = None
    recv_counts: list[int] = field(default_factory=list)


class _Dispatch(torch.autograd.Function):
    """Tokens and routing weights to the ranks of their experts; the gradients come back by combine."""

    @staticmethod
    def forward(ctx, x_TD, weights_TK, ex: _Exchange):
        recv_x, recv_idx, recv_w, counts, handle, _ = ex.buffer.dispatch(
            x_TD,
            topk_idx=ex.topk_idx_TK,
            topk_weights=weights_TK,
            num_tokens_per_rank=ex.tokens_per_rank,
            is_token_in_rank=ex.token_in_rank_TP,
            num_tokens_per_expert=ex.tokens_per_expert_E,
        )
        ex.handle, ex.recv_idx_RK, ex.recv_counts = handle, recv_idx, list(counts)
        ctx.ex, ctx.hidden = ex, x_TD.shape[1]
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_x_RD, grad_w_RK):
        ex = ctx.ex
        if grad_x_RD is None:
            grad_x_RD = torch.zeros(
                ex.recv_idx_RK.shape[0], ctx.hidden, dtype=torch.bfloat16, device=ex.recv_idx_RK.device
            )
        grad_w = None
        if grad_w_RK is not None and ctx.needs_input_grad[1]:
            grad_w = grad_w_RK.float().contiguous()
        grad_x, grad_weights, _ = ex.buffer.combine(grad_x_RD.contiguous(), ex.handle, topk_weights=grad_w)
        return grad_x, grad_weights, None


class _Combine(torch.autograd.Function):
    """Per-rank partial sums home, added per token; the gradient goes out by a cached dispatch."""

    @staticmethod
    def forward(ctx, partial_RD, ex: _Exchange):
        ctx.ex = ex
        out_TD, _, _ = ex.buffer.combine(partial_RD.contiguous(), ex.handle)
        return out_TD

    @staticmethod
    def backward(ctx, grad_TD):
        grad_RD, *_ = ctx.ex.buffer.dispatch(grad_TD.contiguous(), handle=ctx.ex.handle)
        return grad_RD, None


@dataclass
class DeepEPHandle:
    exchange: _Exchange
    recv_weights_RK: torch.Tensor  # routing weights of the received tokens (0 for other ranks' experts)
    slot_of_row: torch.Tensor  # [N] flattened (received token, slot) of each expert-major row
    row_of_slot: torch.Tensor  # [R*K] expert-major row of each slot, N (a zero row) if not local


class DeepEPDispatcher:
    """Sends each token once to every ep rank owning one of its experts, through DeepEP's NVLink kernels."""

    caps = NO_CAPS  # the two required stages only

    def __init__(self, num_experts: int, ep_group=None, combine: str = "torch"):
        self.use_triton = combine_uses_triton(combine)
        self._deep_ep = import_deep_ep()
        if not torch.cuda.is_available():
            raise BackendError(
                "dispatcher='deepep' needs CUDA GPUs joined by NVLink, and there is no CUDA "
                "device here; use dispatcher='alltoall'"
            )
        if not dist.is_initialized():
            raise BackendError(
                "dispatcher='deepep' needs an initialized NCCL process group "
                "(torch.distributed.init_process_group('nccl')) before it is built"
            )
        self.group = ep_group if ep_group is not None else dist.group.WORLD
        self.ep_size = dist.get_world_size(self.group)
        self.ep_rank = dist.get_rank(self.group)
        if self.ep_size not in DEEPEP_EP_SIZES:
            raise BackendError(
                f"DeepEP's intranode kernels run on {', '.join(map(str, DEEPEP_EP_SIZES))} ranks, "
                f"this ep group has {self.ep_size}; use dispatcher='alltoall'"
            )
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over ep={self.ep_size} ranks")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        if self.num_local_experts > MAX_LOCAL_EXPERTS:
            raise BackendError(
                f"DeepEP's intranode kernels take at most {MAX_LOCAL_EXPERTS} experts per rank, "
                f"got {self.num_local_experts}; use a larger ep or dispatcher='alltoall'"
            )
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.group_ranks = dist.get_process_group_ranks(self.group)
        self._slot = BufferSlot(self._new_buffer)

    # -- buffer lifecycle -------------------------------------------------------------------
    @property
    def open_key(self) -> str | None:
        """A key shared by every rank of the group while a buffer is held, else None."""
        return self._slot.key

    def close(self) -> bool:
        """Free the DeepEP buffer (collective over the ep group); True if one was held. Idempotent."""
        return self._slot.close()

    def _new_buffer(self, num_bytes: int):
        # Every rank learns where the others run and one shared key, in one collective.
        mine = (socket.gethostname(), uuid.uuid4().hex)
        everyone: list = [None] * self.ep_size
        dist.all_gather_object(everyone, mine, group=self.group)
        hosts = sorted({host for host, _ in everyone})
        if len(hosts) > 1:
            raise BackendError(
                f"dispatcher='deepep' runs intranode only (NVLink), but this ep group spans "
                f"hosts {hosts}; use dispatcher='alltoall' or an ep group within one node"
            )
        buffer = self._deep_ep.Buffer(self.group, num_bytes, 0, low_latency_mode=False, explicitly_destroy=True)
        return buffer, everyone[0][1]

    def _buffer_for(self, x_TD: torch.Tensor, top_k: int):
        hidden = x_TD.shape[1]
        if x_TD.dtype != torch.bfloat16:
            raise BackendError(
                f"dispatcher='deepep' moves bfloat16 activations only (DeepEP's combine kernel), "
                f"got {x_TD.dtype}; load the model in bf16 or use dispatcher='alltoall'"
            )
        if x_TD.device != self.device:
            raise BackendError(f"deepep dispatch got a tensor on {x_TD.device}, its buffer is on {self.device}")
        row_bytes = hidden * x_TD.element_size()
        if row_bytes % ROW_BYTES_MULTIPLE or row_bytes // 2 + 8 > TMA_BYTES_PER_WARP:
            raise BackendError(
                f"DeepEP's intranode kernels take rows of a multiple of {ROW_BYTES_MULTIPLE} bytes "
                f"up to {2 * (TMA_BYTES_PER_WARP - 8)} bytes; hidden size {hidden} in bf16 is "
                f"{row_bytes} bytes; use dispatcher='alltoall'"
            )
        if top_k > MAX_TOP_K:
            raise BackendError(f"DeepEP takes at most top-{MAX_TOP_K} routing, got top-{top_k}")
        return self._slot.get(nvl_buffer_bytes(self._deep_ep, hidden * max(x_TD.element_size(), 2), self.ep_size))

    # -- the dispatcher protocol -------------------------------------------------------------
    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        top_k = topk_ids_TK.shape[1]
        buffer = self._buffer_for(x_TD, top_k)
        topk_idx = topk_ids_TK.to(getattr(self._deep_ep, "topk_idx_t", torch.int64)).contiguous()
        tokens_per_rank, _, tokens_per_expert, token_in_rank, _ = buffer.get_dispatch_layout(topk_idx, self.num_experts)
        ex = _Exchange(buffer, topk_idx, tokens_per_rank, token_in_rank, tokens_per_expert)
        # DeepEP takes float32 routing weights; autograd casts their gradient back.
        recv_x, recv_w = _Dispatch.apply(x_TD.contiguous(), topk_weights_TK.float().contiguous(), ex)

        # Expert-major rows: a stable sort of the received (token, slot) pairs by local expert.
        # Received tokens are ordered by source rank, then source token, so each expert's rows come
        # in (source rank, token) order, as alltoall's do. Other ranks' slots (-1) sort last.
        num_rows = sum(ex.recv_counts)  # known on the host: DeepEP's dispatch already synced for it
        flat_idx = ex.recv_idx_RK.reshape(-1)
        keys = torch.where(flat_idx >= 0, flat_idx, torch.full_like(flat_idx, self.num_local_experts))
        slot_of_row = stable_order(keys, self.num_local_experts)[:num_rows]
        row_of_slot = torch.full_like(flat_idx, num_rows, dtype=torch.int64)
        row_of_slot[slot_of_row] = torch.arange(num_rows, device=flat_idx.device)
        x_by_expert = expand_to_rows(recv_x, slot_of_row // top_k, row_of_slot, top_k, self.use_triton)
        tokens_per_local_expert = torch.tensor(ex.recv_counts, dtype=torch.int64).to(self.device)
        return x_by_expert, tokens_per_local_expert, DeepEPHandle(ex, recv_w, slot_of_row, row_of_slot)

    def combine(self, y_by_expert_ND, handle: DeepEPHandle):
        partial_RD = weighted_sum(
            y_by_expert_ND, handle.recv_weights_RK, handle.row_of_slot, handle.slot_of_row, self.use_triton
        )
        return _Combine.apply(partial_RD, handle.exchange)
