"""Which attention kernel runs MLA's shapes fastest: q/k head dim 192 (nope 128 + rope 64), v head dim 128.

    python benchmarks/mla_attention.py --out $OUT/mla.json     # Moonlight-16B-A3B shapes, seq 4096 x 2

Transformers' DeepSeek-V3 attention hands torch SDPA q/k of 192 and v of 128; torch's flash backend
needs equal head dims, so SDPA falls back to another backend. This times fwd+bwd (bf16, causal) of:
SDPA as chosen by torch, each SDPA backend forced, and flash / cuDNN with v zero-padded to 192 (the
output sliced back), each against the float32 math reference. A measurement tool, not a test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path
from torch.nn.attention import SDPBackend, sdpa_kernel


def attention(q, k, v, backend, pad_v: bool):
    """Causal SDPA with `backend` forced (None: torch's choice); v padded to q's head dim if asked."""
    dv = v.shape[-1]
    if pad_v:
        v = F.pad(v, (0, q.shape[-1] - dv))
    if backend is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5)
    else:
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5)
    return out[..., :dv] if pad_v else out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--qk-dim", type=int, default=192)
    p.add_argument("--v-dim", type=int, default=128)
    p.add_argument("--out", default="mla.json")
    args = p.parse_args()
    torch.manual_seed(0)
    shape = (args.batch, args.heads, args.seq)
    q = torch.randn(*shape, args.qk_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(*shape, args.qk_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(*shape, args.v_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(*shape, args.v_dim, device="cuda", dtype=torch.bfloat16)
    small = slice(0, 1024)  # the float32 reference at a quarter of the sequence (memory)
    qs, ks, vs = (t[:, :, small].detach().float() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=args.qk_dim**-0.5)
    cases = {
        "sdpa_default": (None, False),
        "sdpa_efficient": (SDPBackend.EFFICIENT_ATTENTION, False),
        "sdpa_cudnn": (SDPBackend.CUDNN_ATTENTION, False),
        "sdpa_flash": (SDPBackend.FLASH_ATTENTION, False),
        "flash_pad_v": (SDPBackend.FLASH_ATTENTION, True),
        "cudnn_pad_v": (SDPBackend.CUDNN_ATTENTION, True),
    }
    result: dict = {
        "args": vars(args),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "cases": {},
    }
    for name, (backend, pad_v) in cases.items():
        try:
            with torch.no_grad():
                err = (
                    (attention(q[:, :, small], k[:, :, small], v[:, :, small], backend, pad_v).float() - ref)
                    .abs()
                    .max()
                    .item()
                )

            def step(backend=backend, pad_v=pad_v):
                q.grad = k.grad = v.grad = None
                attention(q, k, v, backend, pad_v).backward(grad)

            step()
            ms = cuda_event_ms(step, 10)
            result["cases"][name] = {"fwd_bwd_ms": ms, "max_abs_err_vs_fp32": err}
        except Exception as e:  # noqa: BLE001 - a backend that refuses the shapes is a finding
            result["cases"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(name, json.dumps(result["cases"][name]), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
