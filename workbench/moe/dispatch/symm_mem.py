"""Expert-parallel dispatch over torch symmetric memory (NVSHMEM): device-side split sizes.

Same semantics as `alltoall` (rank r owns experts [r*L, (r+1)*L), expert-major rows out,
weighted sums back), but the token rows travel through `torch.ops.symm_mem.all_to_all_vdev`,
which reads the per-rank split sizes from device memory: the collective itself needs no host
sync. One small host read per dispatch remains, because the output's row count is its shape.

Why the 1-D op and not `all_to_all_vdev_2d` (which would emit expert-major rows directly): in
torch 2.11 the 2-D kernels take at most 16 experts per rank (NUM_TILES), and Qwen3-30B-A3B puts
64 on each of 2 ranks. The local (src, expert) -> (expert, src) regrouping is the same gather
the `alltoall` dispatcher does, so both produce identical rows in identical order.

Buffers: two symmetric row buffers (each big enough for the worst case, every rank sending all
its rows to one rank) and two pairs of split tensors, per (hidden, dtype), allocated once and
reused. Each exchange sends from one and receives into the other, and the next exchange swaps
them: a peer that is one exchange behind may still be reading (pull kernels) our last send
buffer, so we never write the next payload into it. They live on the dispatcher instance, so a
new process group (a cluster restart) gets a new dispatcher and new buffers; `release()` drops them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from workbench.backends import BackendError
from workbench.moe.dispatch.contract import NO_CAPS
from workbench.moe.dispatch.local import (
    GatherRows,
    Permutation,
    combine_uses_triton,
    inverse_permutation,
    permute,
    sort_by_expert,
    unpermute,
)

# Shape suffixes: T tokens, D hidden, N routed rows, P ep ranks (peers), E experts, L local experts.

# Argument names of the op schema this module was written against (torch 2.9 .. 2.13):
#   symm_mem::all_to_all_vdev(Tensor input, Tensor(a!) out, Tensor in_splits,
#                             Tensor(a!) out_splits_offsets, str group_name) -> ()
# in_splits: int64[P] rows sent to each peer; out_splits_offsets: int64[2, P], row 0 rows
# received from each peer, row 1 their offsets in `out` (exclusive prefix sum, rank order).
EXPECTED_ARGS = ("input", "out", "in_splits", "out_splits_offsets", "group_name")

# Older NVSHMEM pull kernels split each peer's bytes evenly over up to 64 blocks and assert that
# the division is exact; whole rows of a multiple of 64 bytes always divide.
ROW_BYTES_MULTIPLE = 64


def _check_symm_mem_support(device: torch.device) -> None:
    """Raise a clear error unless torch symmetric memory with NVSHMEM can run here."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as err:
        raise BackendError(
            f"this torch ({torch.__version__}) has no torch.distributed._symmetric_memory; use dispatcher='alltoall'"
        ) from err
    if not symm_mem.is_nvshmem_available():
        raise BackendError(
            "torch symmetric memory cannot load NVSHMEM (libnvshmem_host.so.3) here; "
            "install nvshmem (pip install nvidia-nvshmem-cu12/cu13) or use dispatcher='alltoall'"
        )
    op = getattr(getattr(torch.ops, "symm_mem", None), "all_to_all_vdev", None)
    if op is None:
        raise BackendError(
            f"this torch ({torch.__version__}) has no torch.ops.symm_mem.all_to_all_vdev; use dispatcher='alltoall'"
        )
    names = tuple(a.name for a in op.default._schema.arguments)
    if names != EXPECTED_ARGS:
        raise BackendError(
            f"torch.ops.symm_mem.all_to_all_vdev has arguments {names}, this dispatcher expects "
            f"{EXPECTED_ARGS} (torch 2.9-2.13); use dispatcher='alltoall'"
        )
    current = symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else None
    if current != "NVSHMEM":
        try:
            symm_mem.set_backend("NVSHMEM")
        except RuntimeError as err:
            raise BackendError(
                f"symmetric memory already uses the {current} backend in this process "
                "(it cannot change after the first allocation); use dispatcher='alltoall'"
            ) from err


def _enable_group(group_name: str, device: torch.device) -> None:
    """Register the group with symmetric memory where this torch still needs it (before 2.9)."""
    import torch.distributed._symmetric_memory as symm_mem

    torch.empty(1, device=device)  # NVSHMEM allocation needs a live CUDA context on this device
    enable = symm_mem.enable_symm_mem_for_group
    if not hasattr(enable, "__deprecated__") and not symm_mem.is_symm_mem_enabled_for_group(group_name):
        enable(group_name)


class _Buffers:
    """Symmetric row buffers and split tensors for one (hidden, dtype), swapped every exchange."""

    def __init__(
        self, capacity_rows: int, hidden: int, dtype: torch.dtype, device: torch.device, group_name: str, ep_size: int
    ):
        import torch.distributed._symmetric_memory as symm_mem

        self.capacity_rows = capacity_rows
        self.group_name = group_name
        self.rows = [symm_mem.empty(capacity_rows, hidden, dtype=dtype, device=device) for _ in range(2)]
        self.in_splits = [symm_mem.empty(ep_size, dtype=torch.int64, device=device) for _ in range(2)]
        self.out_splits_offsets = [symm_mem.empty(2, ep_size, dtype=torch.int64, device=device) for _ in range(2)]
        for t in (*self.rows, *self.in_splits, *self.out_splits_offsets):
            symm_mem.rendezvous(t, group_name)  # collective: every rank allocates in the same order
        self.step = 0

    def exchange(self, x_ND: torch.Tensor, send_splits_P: torch.Tensor, num_out_rows: int) -> torch.Tensor:
        """Rows of x go to peers by `send_splits_P` (device int64); returns the rows received, by source rank."""
        num_rows = x_ND.shape[0]
        if num_rows > self.capacity_rows or num_out_rows > self.capacity_rows:
            raise BackendError(
                f"symm_mem exchange of {num_rows} -> {num_out_rows} rows exceeds the "
                f"{self.capacity_rows}-row buffers sized at the first dispatch; keep tokens per "
                "rank fixed, or build a new dispatcher for the larger batch"
            )
        i = self.step % 2
        self.step += 1
        send, recv = self.rows[i], self.rows[1 - i]
        send[:num_rows].copy_(x_ND)
        self.in_splits[i].copy_(send_splits_P)
        # Whole buffers go in: older kernels address a symmetric tensor from its allocation base.
        torch.ops.symm_mem.all_to_all_vdev(send, recv, self.in_splits[i], self.out_splits_offsets[i], self.group_name)
        return recv[:num_out_rows].clone()  # the buffer is reused by the next exchange


class _SymmMemExchange(torch.autograd.Function):
    """Token rows to their peers; the gradient takes the reverse trip (swapped splits)."""

    @staticmethod
    def forward(ctx, x_ND, buffers: _Buffers, send_splits_P, recv_splits_P, num_out_rows: int):
        ctx.buffers = buffers
        ctx.num_in_rows = x_ND.shape[0]
        ctx.save_for_backward(recv_splits_P)
        return buffers.exchange(x_ND.contiguous(), send_splits_P, num_out_rows)

    @staticmethod
    def backward(ctx, grad_ND):
        (recv_splits_P,) = ctx.saved_tensors
        grad_in = ctx.buffers.exchange(grad_ND.contiguous(), recv_splits_P, ctx.num_in_rows)
        return grad_in, None, None, None, None


def expert_major_order(counts_PL: torch.Tensor, total: int) -> torch.Tensor:
    """Index of the received rows in (expert, source rank) order.

    Received rows arrive grouped by source rank, each source's rows grouped by local expert;
    the experts want all rows of expert 0 first, then expert 1, and so on.
    """
    num_src, num_local = counts_PL.shape
    flat = counts_PL.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # start of chunk (src, e) in received rows
    order_chunks = torch.arange(num_src * num_local, device=flat.device)
    order_chunks = order_chunks.view(num_src, num_local).t().reshape(-1)  # (e, src) chunk order
    chunk_sizes = flat[order_chunks]
    chunk_starts = starts[order_chunks]
    within = torch.arange(total, device=flat.device) - torch.repeat_interleave(
        torch.cumsum(chunk_sizes, 0) - chunk_sizes, chunk_sizes, output_size=total
    )
    return torch.repeat_interleave(chunk_starts, chunk_sizes, output_size=total) + within


@dataclass
class SymmMemHandle:
    perm: Permutation
    topk_weights_TK: torch.Tensor
    sent_per_rank: torch.Tensor  # [P] rows this rank sent to each ep rank (device)
    received_per_rank: torch.Tensor  # [P] rows this rank received from each ep rank (device)
    received_order: torch.Tensor  # expert-major row -> received row
    expert_major_order: torch.Tensor  # its inverse


class SymmMemDispatcher:
    """Sends each (token, slot) to the ep rank owning its expert through NVSHMEM symmetric memory."""

    caps = NO_CAPS  # the two required stages only

    def __init__(self, num_experts: int, ep_group=None, combine: str = "torch"):
        self.use_triton = combine_uses_triton(combine)
        if not torch.cuda.is_available():
            raise BackendError(
                "dispatcher='symm_mem' needs CUDA devices with NVSHMEM (torch symmetric memory) "
                "and there is no CUDA device here; use dispatcher='alltoall'"
            )
        if not dist.is_initialized():
            raise BackendError(
                "dispatcher='symm_mem' needs an initialized NCCL process group "
                "(torch.distributed.init_process_group('nccl')) before it is built"
            )
        self.device = torch.device("cuda", torch.cuda.current_device())
        _check_symm_mem_support(self.device)
        self.group = ep_group if ep_group is not None else dist.group.WORLD
        self.group_name = self.group.group_name
        _enable_group(self.group_name, self.device)
        self.ep_size = dist.get_world_size(self.group)
        self.ep_rank = dist.get_rank(self.group)
        if self.ep_size < 2:
            raise BackendError(
                "dispatcher='symm_mem' exchanges tokens between ep ranks and needs ep >= 2; "
                "use dispatcher='local' for ep=1"
            )
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over ep={self.ep_size} ranks")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self._capacity_rows: int | None = None
        self._buffers: dict[tuple[int, torch.dtype], _Buffers] = {}

    def release(self) -> None:
        """Drop the symmetric buffers (call before the process group goes away)."""
        self._buffers.clear()
        self._capacity_rows = None

    def _buffers_for(self, x_ND: torch.Tensor) -> _Buffers:
        hidden, dtype = x_ND.shape[-1], x_ND.dtype
        if x_ND.device != self.device:
            raise BackendError(f"symm_mem dispatch got a tensor on {x_ND.device}, its buffers are on {self.device}")
        if (hidden * x_ND.element_size()) % ROW_BYTES_MULTIPLE:
            raise BackendError(
                f"symm_mem dispatch needs rows of a multiple of {ROW_BYTES_MULTIPLE} bytes; hidden "
                f"size {hidden} in {dtype} is {hidden * x_ND.element_size()} bytes; use 'alltoall'"
            )
        key = (hidden, dtype)
        if key not in self._buffers:
            if self._capacity_rows is None:
                raise BackendError("symm_mem combine before any dispatch (or after release()): dispatch first")
            if not dist.is_initialized():
                raise BackendError("the process group of this symm_mem dispatcher was destroyed; build a new one")
            self._buffers[key] = _Buffers(
                self._capacity_rows, hidden, dtype, self.device, self.group_name, self.ep_size
            )
        return self._buffers[key]

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        perm, tokens_per_expert_E = sort_by_expert(topk_ids_TK, self.num_experts)
        x_sorted = permute(x_TD, perm, self.use_triton)  # ordered by expert, hence by destination rank

        # The whole [P, E] traffic matrix on every rank, so that every rank takes the same decision
        # about buffer sizes (an error on one rank alone would leave the others waiting).
        counts_PE = torch.empty(self.ep_size * self.num_experts, dtype=torch.int64, device=x_TD.device)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.13
        all_gather(counts_PE, tokens_per_expert_E, group=self.group)
        counts_PPL = counts_PE.view(self.ep_size, self.ep_size, self.num_local_experts)  # [src, dst, e]
        traffic_PP = counts_PPL.sum(2)  # rows src sends to dst
        sent_max, received_max, received_mine = torch.stack(
            [traffic_PP.sum(1).max(), traffic_PP.sum(0).max(), traffic_PP[:, self.ep_rank].sum()]
        ).tolist()
        if self._capacity_rows is None:
            # Worst case: every rank sends all of its rows to one rank.
            self._capacity_rows = self.ep_size * max(sent_max, 1)  # no zero-size symmetric allocation
        if max(sent_max, received_max) > self._capacity_rows:
            raise BackendError(
                f"symm_mem dispatch of up to {max(sent_max, received_max)} rows per rank exceeds the "
                f"{self._capacity_rows}-row buffers sized at the first dispatch; keep tokens per "
                "rank fixed, or build a new dispatcher for the larger batch"
            )
        buffers = self._buffers_for(x_sorted)

        counts_received_PL = counts_PPL[:, self.ep_rank]  # [src, my local expert]
        sent_per_rank = traffic_PP[self.ep_rank].contiguous()
        received_per_rank = counts_received_PL.sum(1)
        x_received = _SymmMemExchange.apply(x_sorted, buffers, sent_per_rank, received_per_rank, received_mine)
        received_order = expert_major_order(counts_received_PL, received_mine)
        inverse = inverse_permutation(received_order)
        x_by_expert = GatherRows.apply(x_received, received_order, inverse)
        handle = SymmMemHandle(perm, topk_weights_TK, sent_per_rank, received_per_rank, received_order, inverse)
        return x_by_expert, counts_received_PL.sum(0), handle

    def combine(self, y_by_expert_ND, handle: SymmMemHandle):
        # Undo the local regrouping, send rows home, then weight and sum per token.
        y_received = GatherRows.apply(y_by_expert_ND, handle.expert_major_order, handle.received_order)
        buffers = self._buffers_for(y_received)
        num_home_rows = handle.perm.num_tokens * handle.perm.top_k
        y_sorted = _SymmMemExchange.apply(
            y_received, buffers, handle.received_per_rank, handle.sent_per_rank, num_home_rows
        )
        return unpermute(y_sorted, handle.topk_weights_TK, handle.perm, self.use_triton)
