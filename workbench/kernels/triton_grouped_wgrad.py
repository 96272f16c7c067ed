"""Grouped weight gradients in Triton, each with its sum of squares taken from the registers that hold it.

For expert-major rows (OFFSETS: each expert's end row), out[e] = a[rows of e]^T @ b[rows of e], [E, M, N] from
a [T, M] and b [T, N]: the weight gradient of a grouped linear layer, its depth (the expert's rows) ragged. The
trainer's clipping norm needs Σ out² and read every expert gradient again for it (1.2 GB a Qwen3-30B-A3B layer,
~0.3 ms on an H200); here each output tile stores the sum of squares of its bf16 values beside it, one float32 a
tile, summed in a fixed order by the caller.

One program per SM walks the tiles (persistent); a tile loads its expert's rows in BK blocks through TMA
descriptors over the whole [T, M] and [T, N] tensors. Rows past the expert's end belong to the next expert, so
only the last partial block is masked in registers (a mask on every block would route each TMA load through the
registers on its way to the tensor cores). Inductor's grouped-GEMM template (torch/_inductor/kernel/mm_grouped.py)
walks ragged-K groups the same way; this kernel adds the squares and takes each tile's expert from its index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from workbench.kernels._triton_util import triton_interpreting

# Shape suffixes: T rows (expert-major tokens), E experts, M and N the weight gradient's two dims.


@triton.jit
def _block_product(a, b, acc, UPCAST: tl.constexpr):
    # acc + a^T b; UPCAST (Triton's CPU interpreter only, whose bf16 dot returns garbage in Triton 3.9) multiplies
    # the same values in float32
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a.T, b, acc)


@triton.jit
def _grouped_wgrad_kernel(
    a_desc, b_desc, out_desc, OUT, SQ, OFFSETS, M, NUM_TILES, NUM_PROGRAMS,
    TILES_M: tl.constexpr, TILES_N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    TMA_STORE: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    for tile in tl.range(tl.program_id(0), NUM_TILES, NUM_PROGRAMS, flatten=FLATTEN):
        # tiles of one expert are consecutive: the programs in flight share its rows in the L2
        e = tile // (TILES_M * TILES_N)
        r = tile % (TILES_M * TILES_N)
        m0 = (r // TILES_N) * BM
        n0 = (r % TILES_N) * BN
        end = tl.load(OFFSETS + e)
        start = tl.load(OFFSETS + e - 1, mask=e > 0, other=0)
        full = (end - start) // BK
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(0, full, warp_specialize=WARP_SPECIALIZE):
            acc = _block_product(a_desc.load([start + k * BK, m0]), b_desc.load([start + k * BK, n0]), acc, UPCAST)
        k0 = start + full * BK
        if k0 < end:  # the expert's last rows: the block's rows past its end are the next expert's
            rows = k0 + tl.arange(0, BK)
            a = tl.where((rows < end)[:, None], a_desc.load([k0, m0]), 0.0)
            b = tl.where((rows < end)[:, None], b_desc.load([k0, n0]), 0.0)
            acc = _block_product(a, b, acc, UPCAST)
        c = acc.to(OUT.dtype.element_ty)
        if TMA_STORE:  # stages the tile in shared memory (64 KB at 128 x 256): one pipeline stage fewer fits
            out_desc.store([e * M + m0, n0], c)
        else:
            rows_out = (e * M + m0 + tl.arange(0, BM)).to(tl.int64)
            tl.store(OUT + rows_out[:, None] * (TILES_N * BN) + n0 + tl.arange(0, BN)[None, :], c)
        c32 = c.to(tl.float32)  # the stored values' squares, as a norm of the gradient reads them
        tl.store(SQ + tile, tl.sum(c32 * c32))


def blocks_for(m: int, n: int) -> tuple[int, int, int] | None:
    """(BM, BN, BK) whose tiles divide [m, n] (the stores are whole TMA tiles), the largest first; None if none."""
    for bm, bn in ((128, 256), (128, 128), (64, 128), (64, 64), (32, 32), (16, 16)):
        if m % bm == 0 and n % bn == 0:
            return bm, bn, 64 if bm >= 64 else 16
    return None


def supports(dtype: torch.dtype, device: torch.device, m: int, n: int) -> bool:
    """Whether the kernel computes [E, m, n] gradients of `dtype` operands on `device` (a 16-bit dtype, tiles that
    divide, a GPU or the interpreter)."""
    return (
        dtype in (torch.bfloat16, torch.float16)
        and (device.type == "cuda" or triton_interpreting())
        and blocks_for(m, n) is not None
    )


def _num_programs(device: torch.device, tiles: int) -> int:
    if device.type == "cuda":
        return min(tiles, torch.cuda.get_device_properties(device).multi_processor_count)
    return min(tiles, 4)


def grouped_wgrad(
    a_TM: torch.Tensor,
    b_TN: torch.Tensor,
    offsets_E: torch.Tensor,
    tma_store: bool = False,
    stages: int | None = None,
    flatten: bool = False,
    blocks: tuple[int, int, int, int] | None = None,
    warp_specialize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [E, M, N] with out[e] = a_e^T b_e, float32 squares per output tile); a and b row-major.

    `tma_store`, `stages`, `flatten`, `warp_specialize`, `blocks` (BM, BN, BK, warps): launch choices for
    benchmarks/grouped_wgrad.py (None: blocks_for's tiles, 8 warps at 128 rows); `stages` None: 4 for 128-row tiles
    (3 with the TMA store, whose staging needs the room), else 2.
    """
    a_TM, b_TN = a_TM.contiguous(), b_TN.contiguous()
    experts, (m, n) = offsets_E.shape[0], (a_TM.shape[1], b_TN.shape[1])
    bm, bn, bk = blocks_for(m, n) if blocks is None else blocks[:3]
    if m % bm or n % bn:
        raise ValueError(f"tiles {bm} x {bn} do not divide the [{m}, {n}] gradient")
    warps = (8 if bm >= 128 else 4) if blocks is None else blocks[3]
    out_EMN = torch.empty(experts, m, n, dtype=a_TM.dtype, device=a_TM.device)
    tiles = experts * (m // bm) * (n // bn)
    squares = torch.empty(tiles, dtype=torch.float32, device=a_TM.device)
    if tiles == 0:
        return out_EMN, squares
    programs = _num_programs(a_TM.device, tiles)
    big = bm >= 128
    if stages is None:
        stages = (3 if tma_store else 4) if big else 2
    _grouped_wgrad_kernel[(programs,)](
        TensorDescriptor.from_tensor(a_TM, [bk, bm]),
        TensorDescriptor.from_tensor(b_TN, [bk, bn]),
        TensorDescriptor.from_tensor(out_EMN.view(experts * m, n), [bm, bn]),
        out_EMN,
        squares,
        offsets_E.to(torch.int32),
        m,
        tiles,
        programs,
        TILES_M=m // bm,
        TILES_N=n // bn,
        BM=bm,
        BN=bn,
        BK=bk,
        TMA_STORE=tma_store,
        FLATTEN=flatten,
        WARP_SPECIALIZE=warp_specialize,
        UPCAST=triton_interpreting(),
        num_warps=warps,
        num_stages=stages,
    )
    return out_EMN, squares
