"""Run a Triton test script in a fresh interpreter: Triton's interpreter on CPU, the compiled kernels on CUDA.

TRITON_INTERPRET must be set before triton is first imported, hence a subprocess per script.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# The devices a kernel test runs on: Triton's interpreter on a CPU machine, the compiled kernel where a GPU is present.
# On the GPU image the interpreter is Triton 3.6's, which cannot take a loop bound derived from a program id or an
# argument under NumPy 2 ("only 0-dimensional arrays can be converted", 2026-12-04): there the compiled
# kernel is the test, and CPU machines (Triton 3.9) run the interpreter.
# The interpreter runs a kernel in Python, 10-100 times slower than torch: 5-100 s a test on 2 cores, over a third of
# the fast loop's time. So the [cpu] cases are `slow`: the full loop (CI) runs them, the fast loop keeps the torch
# paths a CPU machine trains with (the product runs Triton kernels on CUDA only).
INTERPRETER_MARK = pytest.mark.slow
DEVICES = [
    pytest.param(
        "cpu",
        marks=[
            pytest.mark.skipif(
                torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernel instead (the [cuda] case)"
            ),
            INTERPRETER_MARK,
        ],
    ),
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled Triton kernel needs a CUDA GPU"),
    ),
]


def run_triton_script(code: str, device: str, marker: str, timeout: float = 600) -> None:
    """Run `code` with argv[1] = `device`; fail with its output unless it exits 0 and prints `marker`.

    The code runs from a file, not `python -c`: Triton compiles a script's own @triton.jit functions from their
    source file (the interpreter does not need one, so `-c` passed on CPU and failed on the GPU).
    """
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"} if device == "cpu" else dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "triton_test_script.py"
        script.write_text(code)
        proc = subprocess.run(
            [sys.executable, str(script), device],
            env=env,
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    assert proc.returncode == 0 and marker in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
