"""LoRA (rank 16, attention + experts) on the full Qwen3-30B-A3B architecture: the engine vs Transformers v5 + PEFT.

    python benchmarks/lora_h200.py engine $OUT/lora_engine.json            # ~3 min on 1 x H200
    python benchmarks/lora_h200.py engine_ac $OUT/lora_engine_ac.json      # activation checkpointing
    python benchmarks/lora_h200.py peft_ac $OUT/lora_peft_ac.json          # Transformers + PEFT, grad ckpt
    python benchmarks/lora_h200.py peft $OUT/lora_peft.json                # (out of memory at 139 GiB)

Random-init bf16 base built on the GPU (48 layers unless --layers), seq 4096, batch 1, LoRA r=16
alpha 32 on q/k/v/o and the fused experts' gate_up_proj / down_proj, torch fused AdamW on the
adapters only, one fixed random batch repeated (the loss must fall: it memorizes). Writes tokens/s
(median of the timed steps, CUDA-synchronized), peak memory, trainable parameters and the losses; an
error (e.g. out of memory) is recorded instead. Each mode in its own process. Without a GPU it runs a
tiny smoke test (--preset tiny --layers 2 --seq 64).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RANK, ALPHA = 16, 32


def _engine(cfg, checkpointing: bool):
    from workbench import AutoModelForCausalLM, BackendConfig
    from workbench.config import LoraConfig

    model = AutoModelForCausalLM.from_config(
        cfg,
        backend=BackendConfig(),
        dtype=torch.bfloat16,
        seed=0,
        lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=("attention", "experts")),
    )
    if checkpointing:
        from workbench.train.activation_checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    return model


def _peft(cfg, checkpointing: bool):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.bfloat16, experts_implementation="grouped_mm"
    )
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    config = peft.LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    return peft.get_peft_model(model, config)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["engine", "engine_ac", "peft", "peft_ac"])
    p.add_argument("out")
    cuda = torch.cuda.is_available()
    p.add_argument("--preset", default="qwen3-30b-a3b" if cuda else "tiny")
    p.add_argument("--layers", type=int, default=None if cuda else 2)
    p.add_argument("--seq", type=int, default=4096 if cuda else 64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    from workbench.config import preset_config

    device = torch.device("cuda" if cuda else "cpu")
    cfg = preset_config(args.preset, args.layers)
    result = {
        "mode": args.mode,
        "preset": args.preset,
        "layers": cfg.num_hidden_layers,
        "seq": args.seq,
        "batch": 1,
        "rank": RANK,
        "alpha": ALPHA,
        "targets": ["q/k/v/o", "experts.gate_up_proj", "experts.down_proj"],
        "torch": torch.__version__,
    }
    try:
        t0 = time.perf_counter()
        with device:
            model = (_engine if args.mode.startswith("engine") else _peft)(cfg, args.mode.endswith("_ac"))
        model.train()
        result["build_s"] = time.perf_counter() - t0
        trainable = [q for q in model.parameters() if q.requires_grad]
        result["trainable_params"] = sum(q.numel() for q in trainable)
        result["frozen_params"] = sum(q.numel() for q in model.parameters() if not q.requires_grad)
        opt = torch.optim.AdamW(trainable, lr=1e-4, fused=cuda)
        ids = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for step in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))  # a sync: the step is done
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        result.update(
            losses=losses,
            loss_falls=losses[-1] < losses[0],
            step_s_median=statistics.median(times),
            tokens_per_s=args.seq / statistics.median(times),
            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        )
    except Exception as err:  # noqa: BLE001 - recorded: an OOM is a result here
        result.update(error=f"{type(err).__name__}: {str(err)[:800]}", traceback=traceback.format_exc()[-3000:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}, indent=2))


if __name__ == "__main__":
    main()
