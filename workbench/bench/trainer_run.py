"""One round of one variant: its RunConfig, `Trainer(rc)`, `setup(model=...)`, `train_step`, `collect`.

Every variant runs the product's training step (workbench.train.loop.Trainer: clipping, schedule,
the non-finite guard, metrics and the data stream) on the same synthetic tokens (the bench's seq,
batch and seed). The engine variants load the launch's shared initial checkpoint; the anchors are
vanilla Transformers models from the same seed (workbench.bench.anchor) handed to the Trainer.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from workbench.bench.anchor import build_anchor
from workbench.bench.config import BenchConfig, VariantSpec
from workbench.bench.gpu_clocks import ClockSampler
from workbench.bench.variant import weight_fingerprint
from workbench.bench.variant_backend import variant_backend
from workbench.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from workbench.models.engine_state import engine_state
from workbench.moe.dispatch import close_dispatchers
from workbench.parallel import dist_utils as du
from workbench.parallel.mesh import MeshConfig
from workbench.train.loop import Trainer
from workbench.train.optim import adamw_precision, describe_optimizer

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def run_config(
    name: str,
    spec: VariantSpec,
    cfg: BenchConfig,
    *,
    checkpoint: Path | None,
    runs_dir: Path,
    world: int,
    dtype: torch.dtype,
    steps: int,
    round_index: int,
) -> RunConfig:
    """The RunConfig a variant's round trains with: synthetic data, clip 1.0 (none in the backward), the schedule."""
    if spec.kind == "engine":
        model = ModelConfig(preset=None, path=str(checkpoint), dtype=_DTYPE_NAMES[dtype])
        mesh, backend = cfg.mesh, variant_backend(spec, cfg.backend)
        optimizer, precision = spec.optimizer, spec.precision or cfg.precision
    else:  # a prebuilt Transformers model: dp over every rank (workbench.bench.anchor shards it so)
        model = ModelConfig(preset=cfg.preset, layers=cfg.layers, dtype=_DTYPE_NAMES[dtype])
        mesh = MeshConfig(dp=world, ep=1) if world > 1 else None
        backend = cfg.backend
        optimizer, precision = "adamw_torch", "bf16"  # torch's AdamW (fused on CUDA), plain bf16: what users run
    train = TrainConfig(
        steps=steps,
        global_batch_size=cfg.batch * world * cfg.accumulation,
        local_batch_size=cfg.batch,
        lr=cfg.lr,
        seed=cfg.seed,
        optimizer=optimizer,
        precision=precision,
        save_final_checkpoint=False,
        log_every=steps,
        # updates inside the backward cannot clip by the global norm (train/backward_updates.py)
        optimizer_in_backward=spec.optimizer_in_backward,
        clip_grad_norm=None if spec.optimizer_in_backward else 1.0,
        cuda_graphs=spec.cuda_graphs,
        activation_checkpointing=spec.activation_checkpointing,
        optimizer_states=spec.optimizer_states,  # "full" on every anchor (VariantSpec refuses anything else)
        fit="off",  # the bench measures what it is asked to, an out-of-memory row included, never a plan's guess
    )
    return RunConfig(
        model=model,
        mesh=mesh,
        backend=backend,
        data=DataConfig(kind="synthetic", seq_len=cfg.seq),
        train=train,
        output_dir=str(runs_dir),
        run_id=f"{name}-round{round_index}",
    )


def train_round(
    name: str,
    spec: VariantSpec,
    cfg: BenchConfig,
    hf_config,
    *,
    checkpoint: Path | None,
    runs_dir: Path,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    timed_steps: int,
    round_index: int,
    fingerprint: bool,
) -> dict[str, Any]:
    """Build the variant, train `cfg.warmup + timed_steps` trainer steps; this rank's records and setup.

    Frees the model, optimizer and Trainer before returning (the next variant needs the memory).
    """
    steps = cfg.warmup + timed_steps
    rc = run_config(
        name,
        spec,
        cfg,
        checkpoint=checkpoint,
        runs_dir=runs_dir,
        world=world,
        dtype=dtype,
        steps=steps,
        round_index=round_index,
    )
    out: dict[str, Any] = {}
    trainer = None
    with contextlib.ExitStack() as stack:  # the anchor's Liger patch and SDPA backend stay on for its steps only
        try:
            t0 = time.perf_counter()
            trainer = Trainer(rc)
            if spec.kind == "anchor":
                model, setup = build_anchor(spec, hf_config, cfg.seed, device, dtype, stack)
                trainer.setup(model=model)
                del model
            else:
                trainer.setup()
                if spec.adamw_multi_numel is not None and hasattr(trainer.optimizer, "multi_tensor_numel"):
                    trainer.optimizer.multi_tensor_numel = spec.adamw_multi_numel
                resolved = engine_state(trainer.model).backend
                setup = {
                    "library": "workbench",
                    "backend": (resolved or trainer.backend).to_dict(),
                    "mesh": trainer.mesh.to_dict() if trainer.mesh is not None else {"dp": 1, "ep": 1},
                    "gate": spec.gate,
                    "path": "generic",
                    "attention": getattr(trainer.model.config, "_attn_implementation", None),
                    "fsdp": "workbench.models.mesh_build (summed grads)" if world > 1 else "none (one rank)",
                    "dtype": str(dtype),
                }
            setup.update(
                {
                    "step": "workbench.train.loop.Trainer.train_step",
                    "train.optimizer": rc.train.optimizer,
                    "optimizer": describe_optimizer(trainer.optimizer),
                    "precision": adamw_precision(
                        rc.train.precision, rc.train.optimizer, list(trainer.model.parameters())
                    ),
                    "clip_grad_norm": rc.train.clip_grad_norm,
                    "optimizer_in_backward": rc.train.optimizer_in_backward,
                    "adamw_multi_tensor_numel": getattr(trainer.optimizer, "multi_tensor_numel", None),
                    "cuda_graphs": rc.train.cuda_graphs,
                    "schedule": f"warmup {rc.train.warmup_steps} + cosine to {rc.train.min_lr_ratio} x lr "
                    f"over {steps} steps",
                    "activation_checkpointing": rc.train.activation_checkpointing,
                    "optimizer_states": rc.train.optimizer_states,
                }
            )
            if fingerprint:
                out["init_fingerprint"] = weight_fingerprint(trainer.model)
            du.barrier()
            out["build_s"] = time.perf_counter() - t0
            out["setup"] = setup
            stack.enter_context(trainer.step_gc)  # as fit() steps: Python's collector paused (train.gc_every)
            clocks = ClockSampler(device)  # SM clock and power of the timed steps (the GPU may cap its power)
            for step in range(1, steps + 1):
                if step == cfg.warmup + 1:
                    clocks.start()
                trainer.train_step(step)
            out["records"] = trainer.collect(wait=True)
            out["gpu_clocks"] = clocks.stop()
            out["gpu_clocks_unavailable"] = clocks.unavailable
            graphs = engine_state(trainer.model).stack_graphs
            if graphs is not None:  # a graphs row says whether it replayed, and why a step did not
                setup["cuda_graph_replays"] = graphs.replays
                setup["cuda_graph_eager_forwards"] = dict(graphs.eager_forwards)
                setup["cuda_graph_refused"] = graphs.refused
                if graphs.replays < steps - 1:  # the first step runs eagerly by design: it checks the layers
                    raise RuntimeError(
                        f"{name}: train.cuda_graphs replayed {graphs.replays} of {steps} steps "
                        f"({graphs.refused or graphs.eager_forwards}): the row would time eager steps as graphed ones"
                    )
        finally:
            if trainer is not None:
                trainer.end_backward_updates()  # as fit() ends: no hooks left on a model
            if trainer is not None and getattr(trainer, "model", None) is not None and spec.kind == "engine":
                close_dispatchers(trainer.model)  # collective: every rank leaves the round here
            del trainer
    return out
