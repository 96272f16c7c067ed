"""The dispatch's row copies as a Triton gather (kernels/triton_gather_rows.py): the same rows as index_select, and
the local dispatcher's forward and gradients unchanged with it."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from triton_script import DEVICES, run_triton_script

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)"
)

_KERNEL_SCRIPT = textwrap.dedent("""
import sys, torch
from workbench.kernels.triton_gather_rows import gather_rows

device = sys.argv[1]
g = torch.Generator().manual_seed(0)
# widths below, at and over one program's 2048 columns, odd ones, rows not a multiple of a program's, no rows
for T, N, D, dtype in ((37, 300, 2048, torch.bfloat16), (5, 17, 300, torch.float32), (9, 64, 4100, torch.bfloat16),
                       (3, 0, 64, torch.bfloat16), (1, 7, 1, torch.float32)):
    x = torch.randn(T, D, generator=g).to(device, dtype)
    index = torch.randint(0, T, (N,), generator=g).to(device)
    got = gather_rows(x, index)
    assert got.shape == (N, D) and got.dtype == dtype, (got.shape, got.dtype)
    assert torch.equal(got, x.index_select(0, index)), (T, N, D)
    # a strided source (a column slice) and int32 indices
    wide = torch.randn(T, D + 8, generator=g).to(device, dtype)
    assert torch.equal(gather_rows(wide[:, 8:], index.int()), wide[:, 8:].index_select(0, index))
try:
    gather_rows(torch.zeros(2, 3, 4, device=device), torch.zeros(2, dtype=torch.long, device=device))
    raise AssertionError("a 3-D source was accepted")
except ValueError as err:
    assert "2-D" in str(err)

# the local dispatcher with its Triton kernels: rows and gradients as with index_select (float64 reference)
from workbench.moe.dispatch.local import LocalDispatcher

T, D, E, K = 40, 96, 8, 4
x = torch.randn(T, D, generator=g).to(device).requires_grad_()
ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
weights = torch.rand(T, K, generator=g).to(device)
mix = torch.randn(D, D, generator=g).to(device) / D ** 0.5
results = {}
for combine in ("torch", "triton"):
    leaf = x.detach().clone().requires_grad_()
    dispatcher = LocalDispatcher(E, combine=combine)
    rows, _, handle = dispatcher.dispatch(leaf, ids, weights)
    rows = rows * dispatcher.row_weights(handle)[:, None].to(rows.dtype)
    out = dispatcher.combine(rows @ mix, handle, weighted=False)
    out.backward(torch.ones_like(out))
    results[combine] = (rows.detach(), out.detach(), leaf.grad)
for a, b in zip(results["torch"], results["triton"]):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
print("GATHER ROWS OK")
""")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_gather_rows_equals_index_select_and_keeps_the_dispatch(device):
    run_triton_script(_KERNEL_SCRIPT, device, "GATHER ROWS OK")


@needs_triton
def test_gather_rows_kernel_compiles_for_sm90_with_16_byte_accesses():
    # the interpreter does not compile: this catches what only the GPU's compiler would refuse, and the vector width
    from compile_sm90 import compile_for_h200

    from workbench.kernels.triton_gather_rows import _gather_rows_kernel, launch_shape

    rows, block_d = launch_shape(2048)
    assert (rows, block_d) == (4, 2048)
    types = dict(X="*bf16", INDEX="*i64", OUT="*bf16", N="i32", D="i32", stride_x="i32", stride_out="i32")
    aligned = ("X", "INDEX", "OUT", "D", "stride_x", "stride_out")
    ptx = compile_for_h200(_gather_rows_kernel, types, dict(ROWS=rows, BLOCK_D=block_d), aligned, warps=8).asm["ptx"]
    assert "ld.local" not in ptx and "st.local" not in ptx  # no spills
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx  # 16-byte loads and stores
