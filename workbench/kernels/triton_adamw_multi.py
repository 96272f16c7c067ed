"""Triton AdamW over many tensors in one launch: the per-tensor kernel's update, addressed through a table.

A LoRA step updates hundreds of small adapters (576 tensors for r=16 on the 48-layer Qwen3-30B-A3B): one
Triton launch each cost ~65 us of host time, 38 ms of a 365 ms step on the H200 (benchmarks/NOTES.md,
2026-12-01), while their bytes take about 2 ms. Here one launch covers a list of tensors: program i
updates block i of the concatenated blocks; its tensor comes from a block -> tensor map (built once per
list of sizes, kept on the device) and its addresses, size, first block, stochastic-rounding key and
element base from a table of int64 rows sent each step (grads are new tensors every step), through buffers
allocated once. The update itself is triton_adamw.update_block, so each tensor's result equals
triton_adamw_step_'s bit for bit.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from workbench.kernels.adamw_args import AdamWStep, SRKeys, kernel_supports
from workbench.kernels.triton_adamw import common_flags, scalar_args, update_block

# Rows of the per-step table, each n_tensors int64 long.
_ROWS = ("param", "grad", "exp_avg", "exp_avg_sq", "numel", "first_block", "sr_key", "sr_base")
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit(do_not_specialize=["n_tensors", "beta1_bits", "omb1_bits", "beta2_bits", "omb2_bits", "lr_wd_bits",
                               "eps_bits", "step_size", "bc2_sqrt"])  # fmt: skip
def _adamw_multi_kernel(
    TABLE, BLOCK_TENSOR, SKIP, COEF, n_tensors, beta1_bits, omb1_bits, beta2_bits, omb2_bits, lr_wd_bits, eps_bits,
    step_size, bc2_sqrt, P_DT: tl.constexpr, G_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
    HAS_WD: tl.constexpr, PRECISE: tl.constexpr, SR: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_COEF: tl.constexpr,
    ROUND_BY_HAND: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    if HAS_SKIP:  # a scalar test, as in the per-tensor kernel (a per-element flag made every access scalar)
        if tl.load(SKIP) != 0.0:
            return
    t = tl.load(BLOCK_TENSOR + pid).to(tl.int64)
    P = tl.load(TABLE + t).to(tl.pointer_type(P_DT))
    G = tl.load(TABLE + n_tensors + t).to(tl.pointer_type(G_DT))
    M = tl.load(TABLE + 2 * n_tensors + t).to(tl.pointer_type(M_DT))
    V = tl.load(TABLE + 3 * n_tensors + t).to(tl.pointer_type(V_DT))
    n = tl.load(TABLE + 4 * n_tensors + t)
    block_start = (pid - tl.load(TABLE + 5 * n_tensors + t)) * BLOCK
    key = tl.load(TABLE + 6 * n_tensors + t)
    base = tl.load(TABLE + 7 * n_tensors + t)
    offs = block_start + tl.arange(0, BLOCK)
    mask = offs < n
    update_block(
        P, G, M, V, P, COEF, P, offs, mask, block_start, beta1_bits, omb1_bits, beta2_bits, omb2_bits, lr_wd_bits,
        eps_bits, step_size, bc2_sqrt, key, base, HAS_WD, PRECISE, SR, False, HAS_COEF, False, ROUND_BY_HAND, BLOCK,
    )  # fmt: skip


class _ListState:
    """What one list of sizes keeps between steps: its block map, and the step table's buffers on CUDA.

    The table goes to the device through two pinned host buffers used in turn and one device buffer, all
    allocated once: a `pin_memory()` per step allocated a pinned block whenever the last one's copy had not
    run yet (the host runs ahead of the device), and the steps measured with that path on the H200 were
    slower in their forward (LoRA48 ~8.2k against ~10.6k tokens/s, 2026-12-02). The device buffer is rewritten on the
    stream after the previous kernel that read it; a host buffer is rewritten once its copy two steps ago has run.
    """

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks
        self.host: list[torch.Tensor] = []
        self.copied: list = [None, None]  # the CUDA event after each host buffer's last copy
        self.device_table: torch.Tensor | None = None
        self.turn = 0

    def to_device(self, table: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`table` (int64, on the host) in the device buffer, by an asynchronous copy on the current stream."""
        if not self.host:
            self.host = [torch.empty(table.shape, dtype=table.dtype, device="cpu", pin_memory=True) for _ in range(2)]
            self.device_table = torch.empty(table.shape, dtype=table.dtype, device=device)
        turn, self.turn = self.turn, 1 - self.turn
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()  # queued two steps ago: done unless the host is that far ahead
        self.host[turn].copy_(table)
        self.device_table.copy_(self.host[turn], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.copied[turn] = event
        return self.device_table


def block_map(numels: list[int], block: int, device: torch.device) -> torch.Tensor:
    """int32 [total blocks]: the tensor each program updates (tensor i owns cdiv(numel_i, block) blocks)."""
    # built on the host whatever torch's default device is, then moved once
    counts = torch.tensor([triton.cdiv(n, block) for n in numels], dtype=torch.int64, device="cpu")
    ids = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32, device="cpu"), counts)
    return ids.to(device)


def triton_adamw_multi_step_(
    tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    step: AdamWStep,
    sr: list[SRKeys] | None = None,
    cache: dict | None = None,
) -> None:
    """triton_adamw_step_ for every (param, grad, exp_avg, exp_avg_sq) of `tensors` in one launch, in place.

    All share `step` (one step count) and, per role, one dtype and device; `sr`: one key per tensor
    (bf16 stores rounded stochastically) or None; `cache`: a dict kept by the caller, holding the block
    map of each list of sizes (static over a run) so it is built once.
    """
    if not tensors:
        return
    first = tensors[0]
    device = first[0].device
    for group in tensors:
        if not kernel_supports(*group) or group[0].device != device:
            raise ValueError(
                "the multi-tensor AdamW needs contiguous float tensors of one size per group on one device"
            )
        if any(t.dtype != f.dtype for t, f in zip(group, first)):
            raise ValueError(
                "the multi-tensor AdamW takes one dtype per role (param, grad, exp_avg, exp_avg_sq), got "
                f"{[t.dtype for t in group]} beside {[t.dtype for t in first]}"
            )
    if sr is not None and len(sr) != len(tensors):
        raise ValueError(f"sr needs one SRKeys per tensor: {len(sr)} for {len(tensors)} tensors")
    numels = [g[0].numel() for g in tensors]
    if min(numels) == 0:
        raise ValueError("the multi-tensor AdamW takes no empty tensors (the caller skips them)")
    launch = step.launch
    key = (str(device), launch.block, tuple(numels))
    cache = {} if cache is None else cache
    if key not in cache:
        if len(cache) >= 16:  # a few lists of sizes per step (groups, dtypes); sizes are static over a run
            cache.pop(next(iter(cache)))
        cache[key] = _ListState(block_map(numels, launch.block, device))
    state = cache[key]
    blocks = state.blocks
    firsts, at = [], 0
    for n in numels:
        firsts.append(at)
        at += triton.cdiv(n, launch.block)
    rows = [[g[i].data_ptr() for g in tensors] for i in range(4)]
    rows += [numels, firsts]
    rows += [[k.key for k in sr], [k.base for k in sr]] if sr is not None else [[0] * len(tensors)] * 2
    assert len(rows) == len(_ROWS)
    # on the host even under torch.set_default_device("cuda")
    table = torch.tensor(rows, dtype=torch.int64, device="cpu")
    step.check_flags(device)
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:  # the table's copy and event on the tensors' device, as the launch
        if device.type == "cuda":
            table = state.to_device(table, device)
        _adamw_multi_kernel[(blocks.numel(),)](
            table,
            blocks,
            table if step.skip is None else step.skip,
            table if step.grad_coef is None else step.grad_coef,
            len(tensors),
            *scalar_args(step.scalars),
            P_DT=_TL_DTYPES[first[0].dtype],
            G_DT=_TL_DTYPES[first[1].dtype],
            M_DT=_TL_DTYPES[first[2].dtype],
            V_DT=_TL_DTYPES[first[3].dtype],
            **common_flags(step, sr is not None),
        )
