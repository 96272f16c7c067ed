"""One training step's loss and gradients at a preset's real shapes on one GPU: the engine and Transformers' own
model in bf16, each against a float32 Transformers reference from the same weights and tokens.

    python benchmarks/grad_parity.py --preset gpt-oss-20b --layers 2 --out $OUT/grad_parity.json

Why: the bench's loss curves of engine and anchor part after the first AdamW step for GPT-OSS (its first step
moves every weight by about lr whatever the gradient's size, so sign noise in small gradients shows), while the
unit tests compare tiny configs. Here each parameter's bf16 gradient is scored against float32 by
||g - g32|| / ||g32|| and by the fraction of elements whose sign differs; the engine is right where its errors
stand at the bf16 anchor's level. A measurement tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def loss_and_grads(model, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean cross-entropy of `ids` as labels and every parameter's gradient (float32 copies)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(out.loss), grads


def scores(grads: dict, ref: dict) -> dict[str, dict[str, float]]:
    """Per parameter: relative error and sign disagreement against the float32 gradients."""
    out = {}
    for name, g32 in ref.items():
        g = grads.get(name)
        if g is None:
            out[name] = {"missing": 1.0}
            continue
        nz = g32 != 0
        out[name] = {
            "rel_err": float((g - g32).norm() / g32.norm().clamp_min(1e-30)),
            "sign_flip": float(((g.sign() != g32.sign()) & nz).sum() / nz.sum().clamp_min(1)),
        }
    return out


# Engine variants scored (BackendConfig fields; "dtype" the model's): the product's default, without the fused
# linear cross-entropy, with every Triton kernel swapped for torch ops, and in float32 (the engine's own math).
ENGINE_VARIANTS = {
    "engine": {"fused_ce": True},
    "engine_no_fused_ce": {"fused_ce": False},
    "engine_torch_kernels": {
        "fused_ce": False,
        "rms_norm": "torch",
        "rope": "torch",
        "swiglu": "torch",
        "combine": "torch",
        "cross_entropy": "torch",
    },
    "engine_fp32": {"fused_ce": True, "dtype": torch.float32},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--anchor-attention", default="flex_attention")
    p.add_argument("--out", default="grad_parity.json")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (tiny presets)")
    p.add_argument("--engines", default="engine", help=f"comma-separated, of {list(ENGINE_VARIANTS)}")
    args = p.parse_args()
    unknown = sorted(set(args.engines.split(",")) - set(ENGINE_VARIANTS))
    if unknown:  # before any model is built
        p.error(f"unknown --engines {unknown}; choose from {list(ENGINE_VARIANTS)}")
    import transformers

    import workbench
    from workbench.bench.anchor import build_hf_model
    from workbench.config import preset_config
    from workbench.models.cast import cast_like_transformers

    t0 = time.time()
    dev = torch.device(args.device)
    cfg = preset_config(args.preset, args.layers)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(dev)
    ref = build_hf_model(cfg, 0, dev, torch.float32, "eager", "eager")
    # every model starts from the bf16 weights; the reference runs them in float32 math
    state = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
    ref.load_state_dict({k: v.float() for k, v in state.items()})
    ref_loss, ref_grads = loss_and_grads(ref, ids)
    del ref
    torch.cuda.empty_cache()  # a no-op where CUDA never started
    result = {
        "preset": args.preset,
        "layers": args.layers,
        "tokens": args.batch * args.seq,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "loss": {"float32": ref_loss},
    }
    anchor = build_hf_model(cfg, 0, dev, torch.bfloat16, "grouped_mm", args.anchor_attention)
    anchor.load_state_dict(state)
    loss, grads = loss_and_grads(anchor, ids)
    result["loss"]["anchor_bf16"] = loss
    anchor_scores = scores(grads, ref_grads)
    del anchor, grads
    torch.cuda.empty_cache()  # a no-op where CUDA never started
    rows = {name: {"param": name, "anchor": anchor_scores[name]} for name in ref_grads}
    ran = ["anchor"]
    for variant in args.engines.split(","):
        fields = dict(ENGINE_VARIANTS[variant])
        dtype = fields.pop("dtype", torch.bfloat16)
        try:
            engine = workbench.AutoModelForCausalLM.from_config(
                cfg, backend=workbench.BackendConfig(**fields), device=dev
            )
            # the Trainer's cast (train/model_setup): float32 rotary frequencies stay float32, as Transformers'
            cast_like_transformers(engine, dtype).load_state_dict({k: v.to(dtype) for k, v in state.items()})
            loss, grads = loss_and_grads(engine, ids)
        except Exception as err:  # one variant failing (a kernel without float32) must not lose the others
            result.setdefault("errors", {})[variant] = f"{type(err).__name__}: {err}"[:500]
            print(variant, "failed:", result["errors"][variant])
            continue
        result["loss"][variant] = loss
        ran.append(variant)
        for name, score in scores(grads, ref_grads).items():
            rows[name][variant] = score
        del engine, grads
        torch.cuda.empty_cache()
    result["params"] = list(rows.values())
    result["elapsed_s"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("loss", {k: round(v, 5) for k, v in result["loss"].items()})
    print(f"{'param':50s} " + " ".join(f"{k[:16]:>16s}" for k in ran))
    for r in result["params"]:
        cells = [r[k] for k in ran]
        print(
            f"{r['param'][:50]:50s} "
            + " ".join(f"{c.get('rel_err', -1):9.2e} {c.get('sign_flip', -1):.2f}" for c in cells)
        )


if __name__ == "__main__":
    main()
