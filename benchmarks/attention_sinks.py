"""GPT-OSS attention with sinks on one GPU: fwd+bwd time, peak memory and error of every option.

    python benchmarks/attention_sinks.py $OUT/attention_sinks.json      # ~1 minute on 1 x H200
    python benchmarks/attention_sinks.py $OUT/glue.json flash,cudnn,flash_torch_glue,cudnn_torch_glue  # some only

Shapes of gpt-oss-20b: batch 2, seq 4096, 64 query heads, 8 kv heads, head dim 64, bf16; "sliding" layers
use a 128-token window, "full" layers plain causal. Options:
- hf_eager, hf_flex: Transformers' own eager and flex_attention functions (the anchor's attention);
- flash: workbench.models.attention_sinks on torch's varlen flash kernel (both layer types; the default);
- cudnn: workbench.models.attention_sinks on torch's cuDNN attention op (full causal layers only);
- flash_torch_glue / cudnn_torch_glue: the same with the sink's scaling and gradient in torch ops (default: Triton);
- sdpa_extra_dim_cudnn / _flash: the sink as an extra key through public SDPA, one backend forced (full only);
- sdpa_no_sinks_cudnn / _flash: plain causal SDPA WITHOUT sinks (not exact: the speed floor, for scale);
- flash_packed: the flash option on packed rows (documents 1500 + 2596 | 4096), error vs a masked reference.
Errors: max |option - float32 reference| of out, dq, dk, dv and dsinks, each also divided by the reference's
max |value|; hf_eager in bf16 gives the bf16 error level to compare against. Each option runs in its own
try/except; the JSON (argv[1]) is rewritten after every row, so a crash or timeout keeps earlier rows.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.models import attention_sinks as sk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Without a GPU the script smoke-tests itself at tiny shapes (CUDA-only options then report their error).
B, S, H, HKV, D, WINDOW = (2, 4096, 64, 8, 64, 128) if DEVICE == "cuda" else (2, 64, 8, 2, 16, 8)
SCALE = D**-0.5
DTYPE = torch.bfloat16
REPS = 10
DEADLINE_S = 105  # skip what is left once the script has run this long (the whole must stay < 2 minutes)


def cuda_ms(fn, reps: int = REPS) -> float:
    """Median milliseconds of `fn()` by CUDA events."""
    times = []
    if DEVICE != "cuda":
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
        return statistics.median(times)
    return cuda_event_ms(fn, reps)


def inputs(seed: int = 0):
    """q, k [B, H, S, D] contiguous (as after RoPE), v a transposed view (as from v_proj), sinks, dO."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(B, H, S, D, device=DEVICE, generator=g).to(DTYPE)
    k = torch.randn(B, HKV, S, D, device=DEVICE, generator=g).to(DTYPE)
    v = torch.randn(B, S, HKV, D, device=DEVICE, generator=g).to(DTYPE).transpose(1, 2)
    sinks = (torch.randn(H, device=DEVICE, generator=g) + 1.0).to(DTYPE)
    dout = torch.randn(B, S, H, D, device=DEVICE, generator=g).to(DTYPE)
    return q, k, v, sinks, dout


def reference(q, k, v, sinks, dout, window, starts=None):
    """float32 eager math, in chunks of kv heads (the full score matrix would need ~40 GB); out and grads."""
    outs, dq, dk, dv, dsinks = [], [], [], [], []
    allowed = sk.dense_mask(S, S, window, starts, None, q.device)
    per = 2
    g = H // HKV
    for j in range(0, HKV, per):
        qs = q[:, j * g : (j + per) * g].float().detach().requires_grad_()
        ks, vs = (t[:, j : j + per].float().detach().requires_grad_() for t in (k, v))
        ss = sinks[j * g : (j + per) * g].float().detach().requires_grad_()
        o = sk.reference_attention(qs, ks, vs, ss, SCALE, allowed)
        o.backward(dout[:, :, j * g : (j + per) * g].float())
        outs.append(o.detach())
        dq.append(qs.grad)
        dk.append(ks.grad)
        dv.append(vs.grad)
        dsinks.append(ss.grad)
        del o, qs, ks, vs, ss
    return (torch.cat(outs, 2), torch.cat(dq, 1), torch.cat(dk, 1), torch.cat(dv, 1), torch.cat(dsinks))


class _Attn(nn.Module):
    """What Transformers' attention functions read from the module."""

    def __init__(self, sinks, training: bool = True):
        super().__init__()
        self.sinks = sinks
        self.num_key_value_groups = H // HKV
        self.is_causal = True
        self.training = training


def hf_eager(window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    i = torch.arange(S, device=DEVICE)
    ok = i[None, :] <= i[:, None]
    if window is not None:
        ok &= i[:, None] - i[None, :] < window
    mask = torch.zeros(S, S, device=DEVICE, dtype=DTYPE).masked_fill(~ok, torch.finfo(DTYPE).min)[None, None]

    def run(q, k, v, sinks):
        return eager_attention_forward(_Attn(sinks), q, k, v, mask, scaling=SCALE)[0]

    return run


def hf_flex(window):
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.masking_utils import (
        causal_mask_function,
        flex_attention_mask,
        sliding_window_causal_mask_function,
    )

    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    block_mask = flex_attention_mask(batch_size=B, q_length=S, kv_length=S, mask_function=fn, device=DEVICE)

    def run(q, k, v, sinks):
        # module.training=True makes Transformers compile flex with max-autotune (what the model anchor ran),
        # a compile of minutes: opt in with WB_FLEX_AUTOTUNE=1; the default compile runs the same kernel family
        module = _Attn(sinks, training=os.environ.get("WB_FLEX_AUTOTUNE") == "1")
        return flex_attention_forward(module, q, k, v, block_mask, scaling=SCALE, s_aux=sinks)[0]

    return run


def engine(kernel, position_ids=None, glue=None):
    def make(window):
        def run(q, k, v, sinks):
            return sk.sink_attention(q, k, v, sinks, SCALE, window, position_ids, kernel=kernel, glue=glue)

        return run

    return make


def forced(backend_name, fn):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def make(window):
        if window is not None:
            raise ValueError("full causal layers only")

        def run(q, k, v, sinks):
            with sdpa_kernel([backend]):
                return fn(q, k, v, sinks)

        return run

    return make


def no_sinks(q, k, v, sinks):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True).transpose(1, 2)


def extra_dim(q, k, v, sinks):
    return sk.sdpa_extra_dim(q, k, v, sinks, SCALE)


def measure(make, window, refs, starts=None):
    """One option on one layer type: ms, peak GiB above the inputs, errors vs the float32 reference."""
    run = make(window)
    q, k, v, sinks, dout = inputs()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k)]
    v_leaf = v.detach().transpose(1, 2).contiguous().requires_grad_()  # [B, S, HKV, D] leaf, used transposed
    s_leaf = sinks.detach().clone().requires_grad_()

    def step():
        out = run(leaves[0], leaves[1], v_leaf.transpose(1, 2), s_leaf)
        out.backward(dout)
        return out

    cuda = DEVICE == "cuda"
    out = step()  # warmup (compiles where the option compiles)
    for t in (*leaves, v_leaf, s_leaf):
        t.grad = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    out = step()
    if cuda:
        torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0
    got = (
        out.detach().float(),
        leaves[0].grad.float(),
        leaves[1].grad.float(),
        v_leaf.grad.transpose(1, 2).float(),
        s_leaf.grad.float() if s_leaf.grad is not None else None,
    )
    errors = {}
    key = (window, None if starts is None else "packed")
    if key not in refs:
        refs[key] = reference(q, k, v, sinks, dout, window, starts)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, refs[key]):
        if a is None:
            errors[name] = None
            continue
        err = (a - b).abs().max().item()
        errors[name] = err
        errors[name + "_rel"] = err / max(b.abs().max().item(), 1e-6)
    del out, got

    def timed():
        for t in (*leaves, v_leaf, s_leaf):
            t.grad = None
        step()

    ms = cuda_ms(timed)
    return {"ms_fwd_bwd": ms, "peak_gib": peak, "errors": errors}


def main() -> None:
    out_path = Path(sys.argv[1] if len(sys.argv) > 1 else "attention_sinks.json")
    t0 = time.time()
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None

    report = {
        "shapes": dict(batch=B, seq=S, heads=H, kv_heads=HKV, head_dim=D, window=WINDOW, dtype=str(DTYPE)),
        "env": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "triton": triton_version,
            "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
            "cudnn": torch.backends.cudnn.version(),
        },
        "module_default": dict(sk.CUDA_KERNEL),
        "rows": [],
    }
    pos = torch.stack([torch.cat([torch.arange(S * 3 // 8), torch.arange(S - S * 3 // 8)]), torch.arange(S)]).to(DEVICE)
    packed_starts = sk.document_starts(pos, B, S, DEVICE)
    options = [
        ("flash", engine("flash"), (None, WINDOW), None),
        ("cudnn", engine("cudnn"), (None,), None),
        # the sink's scaling and gradient in torch ops (the default glue is Triton: sk.GLUE_CUDA)
        ("flash_torch_glue", engine("flash", glue="torch"), (None, WINDOW), None),
        ("cudnn_torch_glue", engine("cudnn", glue="torch"), (None,), None),
        ("flash_packed", engine("flash", pos), (None, WINDOW), packed_starts),
        ("sdpa_extra_dim_cudnn", forced("CUDNN_ATTENTION", extra_dim), (None,), None),
        ("sdpa_extra_dim_flash", forced("FLASH_ATTENTION", extra_dim), (None,), None),
        ("sdpa_no_sinks_cudnn", forced("CUDNN_ATTENTION", no_sinks), (None,), None),
        ("sdpa_no_sinks_flash", forced("FLASH_ATTENTION", no_sinks), (None,), None),
        ("hf_eager", hf_eager, (None, WINDOW), None),
        ("hf_flex", hf_flex, (None, WINDOW), None),  # last: its compile (max-autotune in training) is the slowest
    ]
    if len(sys.argv) > 2:  # a comma-separated subset of the options, by name
        wanted = sys.argv[2].split(",")
        options = [o for o in options if o[0] in wanted]
    refs: dict = {}
    for name, make, windows, starts in options:
        for window in windows:
            row = {"option": name, "layer": "full" if window is None else f"sliding{window}"}
            if time.time() - t0 > DEADLINE_S:
                row["error"] = f"skipped: the script passed its {DEADLINE_S} s budget"
            else:
                try:
                    row.update(measure(make, window, refs, starts))
                except Exception as err:  # one option failing must not lose the others
                    row["error"] = f"{type(err).__name__}: {err}"[:600]
                    row["traceback"] = traceback.format_exc()[-1500:]
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            report["rows"].append(row)
            report["elapsed_s"] = round(time.time() - t0, 1)
            out_path.write_text(json.dumps(report, indent=1))
            print_row(row)
    report["best"] = best(report["rows"])
    out_path.write_text(json.dumps(report, indent=1))
    print("best exact option per layer type (set attention_sinks.CUDA_KERNEL from it):", report["best"])
    print(f"wrote {out_path} in {time.time() - t0:.0f} s")


def best(rows: list[dict]) -> dict:
    """Fastest option per layer type whose errors stay within 3x hf_eager's bf16 errors (no_sinks rows excluded)."""
    out = {}
    for layer in sorted({r["layer"] for r in rows}):
        here = [r for r in rows if r["layer"] == layer and "error" not in r]
        eager = next((r for r in here if r["option"] == "hf_eager"), None)

        def exact(r, eager=eager):
            return all(
                (r["errors"].get(k + "_rel") or 0)
                <= 3 * max((eager["errors"].get(k + "_rel") or 0) if eager else 0, 1e-2 / 3)
                for k in ("out", "dq", "dk", "dv", "dsinks")
            )

        ok = [
            r
            for r in here
            if "no_sinks" not in r["option"]
            and "packed" not in r["option"]
            and r["option"] not in ("hf_eager", "hf_flex")
            and exact(r)
        ]
        if ok:
            win = min(ok, key=lambda r: r["ms_fwd_bwd"])
            out[layer] = {"option": win["option"], "ms_fwd_bwd": win["ms_fwd_bwd"]}
    return out


def print_row(row: dict) -> None:
    if "error" in row:
        print(f"{row['option']:24s} {row['layer']:10s} ERROR {row['error'][:200]}", flush=True)
        return
    e = row["errors"]
    rel = " ".join(
        f"{k}={e[k + '_rel']:.1e}" if e.get(k) is not None else f"{k}=-" for k in ("out", "dq", "dk", "dv", "dsinks")
    )
    print(
        f"{row['option']:24s} {row['layer']:10s} {row['ms_fwd_bwd']:8.3f} ms {row['peak_gib']:7.2f} GiB  rel.err {rel}",
        flush=True,
    )


if __name__ == "__main__":
    main()
