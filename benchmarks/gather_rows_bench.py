"""The dispatch's row copy at Qwen3's shape (8192 tokens x top-8, 2048 wide, bf16): torch's index_select against the
Triton gather (kernels/triton_gather_rows.py), CUDA events over 50 calls after a warmup, and their equality."""

import json
import sys

import torch

from workbench.kernels.triton_gather_rows import gather_rows


def timed_ms(fn, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


if __name__ == "__main__":
    T, K, D = 8192, 8, 2048
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    index = torch.sort(torch.randint(0, 128, (T * K,), device="cuda"), stable=True).indices // K
    assert torch.equal(gather_rows(x, index), x.index_select(0, index))
    result = {
        "index_select_ms": timed_ms(lambda: x.index_select(0, index)),
        "triton_ms": timed_ms(lambda: gather_rows(x, index)),
    }
    print(json.dumps(result))
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(json.dumps(result))
