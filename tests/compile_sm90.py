"""Compile a Triton kernel for the H200 (sm_90) on any machine: Triton ships ptxas, no GPU is needed.

Triton's interpreter runs code the compiler refuses (a plain global, a layout it cannot build) and says nothing of
the layout the compiled kernel gets; this does both, on CPU CI.
"""

from __future__ import annotations

import inspect


def compile_for_h200(kernel, types: dict[str, str], constexprs: dict, divisible: tuple[str, ...] = (), warps: int = 4):
    """The compiled kernel for sm_90: `types` per argument ("*bf16", "i32", ...; the rest int64 or constexpr),
    `divisible`: arguments a launch specializes as multiples of 16 (aligned pointers, strides), as Triton's JIT does."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: types.get(n) or ("constexpr" if n in constexprs else "i64") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
