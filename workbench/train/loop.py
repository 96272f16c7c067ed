"""`workbench.finetune(run_config, callbacks)`: the training loop every rank runs.

Works inside an initialized process group (torchrun, the workbench cluster engines) or in a
single process with no group (world of 1).

Data parallelism and the loss. Each optimizer step takes one global batch of
`global_batch_size` sequences; rank r takes its contiguous slice r of dp equal slices and splits
it into `grad_accum` micro-batches of `local_batch_size`. The cross-entropy of every micro-batch
is a *sum* over its tokens divided by the GLOBAL number of loss tokens in the whole global batch
(all micro-batches, all ranks), so the per-rank contributions add up to exactly the mean over
the global batch. Gradients are therefore SUMMED over ranks, never averaged: FSDP2 uses a
gradient divide factor of 1 (workbench.parallel.fsdp) for the engine's models and for any other
Transformers model alike (every model on more than one rank is sharded). The router aux loss:
the engine's model takes `aux_loss_group` and then returns this rank's share of the aux loss of
the micro-batch across all ranks (shares add up to the global micro-batch's aux loss), so it is
divided by grad_accum only. A model without that argument (vanilla Transformers) gives a
per-rank mean, divided by grad_accum x world. The aux loss is a statistic of each micro-batch,
so runs with different local batch sizes differ in it; the cross-entropy part is the same for
any split.

A step whose global loss, aux loss or gradient norm is not finite stops the run before
`optimizer.step()` (workbench.train.guard): it never reaches the weights or a checkpoint.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from workbench.config import RunConfig
from workbench.moe.bias_update import (RouterBiasError, check_router_bias, global_load, keep_router_biases_fp32,
                                       update_router_biases)
from workbench.moe.dispatch import close_dispatchers
from workbench.params import num_experts
from workbench.parallel import dist_utils as du
from workbench.train.activation_checkpoint import apply_activation_checkpointing
from workbench.train.checkpoint import (check_compatible, check_settings, clean_leftovers, export_hf,
                                        load_checkpoint, resolve_checkpoint, run_settings, save_checkpoint,
                                        verify_checkpoint)
from workbench.train.data import Batch, build_stream
from workbench.train.data_eval import eval_metrics
from workbench.train.guard import StepValues, check_finite
from workbench.train.metrics import expert_load_from_router_logits, reset_peak_memory, step_record
from workbench.train.model_setup import build_model, model_dtype, resolve_mesh
from workbench.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from workbench.train.liveness import Heartbeat, record_termination
from workbench.train.run_dir import RunDir, default_runs_dir, new_run_id, private_files


class _Callbacks:
    """Calls optional hooks on user callback objects."""

    def __init__(self, callbacks: list | None) -> None:
        self.items = list(callbacks or [])

    def call(self, name: str, arg: Any) -> None:
        for cb in self.items:
            fn = getattr(cb, name, None)
            if fn is not None:
                fn(arg)

    def should_stop(self) -> bool:
        return any(bool(cb.should_stop()) for cb in self.items if hasattr(cb, "should_stop"))


def _open_run_dir(rc: RunConfig, extra: dict[str, Any]) -> RunDir:
    """Rank 0 creates the run directory; every rank gets it (or rank 0's error)."""
    result: Any = None
    if du.rank() == 0:
        try:
            runs_dir = Path(rc.output_dir).expanduser() if rc.output_dir else default_runs_dir()
            config = {**rc.to_dict(), **extra}
            config["run_id"] = rc.run_id or new_run_id()
            result = str(RunDir.create(runs_dir, config["run_id"], config).path)
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            result = err
    result = du.broadcast_object(result)
    if isinstance(result, BaseException):
        raise result
    return RunDir(Path(result))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _micro_batches(batch: Batch, size: int) -> list[Batch]:
    return [batch.slice(i, i + size) for i in range(0, len(batch), size)]


class Trainer:
    """One run on this rank: model, optimizer, schedule, data stream, run directory."""

    def __init__(self, rc: RunConfig, callbacks: list | None = None) -> None:
        self.rc = rc
        self.callbacks = _Callbacks(callbacks)
        self.rank, self.world = du.rank(), du.world_size()
        self.device = du.pick_device(rc.model.device)
        self.hf_config = rc.model.hf_config()
        rc.data.check_fits(self.hf_config)  # before a seq_len-sized allocation fails far later
        self.mesh = resolve_mesh(rc.mesh, self.world, self.hf_config)
        self.dp = self.mesh.dp if self.mesh is not None else self.world
        if rc.train.router_bias_update_rate > 0:  # refused before any heavy work (a meta model only)
            from workbench.models.generic import meta_model

            _router_biases(meta_model(self.hf_config), self.hf_config, meta=True)
        self.accum = rc.train.accumulation_steps(self.dp)
        self.per_rank = rc.train.global_batch_size // self.dp
        self.resume_ckpt = None
        if rc.train.resume_from:
            # Before any heavy work or a run directory: a damaged or crafted checkpoint, another model
            # shape, or other schedule/data settings (unless accepted) are refused here.
            self.resume_ckpt = resolve_checkpoint(rc.train.resume_from)
            verify_checkpoint(self.resume_ckpt)
            check_compatible(self.resume_ckpt, self.hf_config)
            accepted = check_settings(self.resume_ckpt, rc)
            if self.rank == 0 and accepted:
                print(f"resuming from {self.resume_ckpt} with changed settings (train.resume_allow_changes): "
                      + "; ".join(accepted), flush=True)
            for leftover in clean_leftovers(self.resume_ckpt):
                print(f"removed {leftover}: a save that never finished", flush=True)
        torch.manual_seed(rc.train.seed)
        self.stream = build_stream(rc.data, rc.train.seed, self.hf_config.vocab_size, model_path=rc.model.path,
                                   runs_dir=rc.output_dir)
        mesh_sizes = self.mesh.to_dict() if self.mesh is not None else {"dp": 1, "ep": 1}
        # Resolved once, with the mesh's ep: the run records the backends the model is then built with.
        self.backend = rc.backend.resolve(self.device, world_size=mesh_sizes["ep"])
        self.run = _open_run_dir(rc, {"world_size": self.world, "dp": self.dp, "grad_accum": self.accum,
                                      "device": self.device.type, "resolved_mesh": mesh_sizes,
                                      "resolved_backend": self.backend.to_dict()})

    def setup(self) -> None:
        rc = self.rc
        torch.manual_seed(rc.train.seed)
        self.model = build_model(rc, self.hf_config, self.mesh, self.device, model_dtype(rc.model, self.device),
                                 self.backend)
        if self.world > 1 and not _is_parallel(self.model):
            # Each rank would train its own copy: refuse rather than report a run that is not one.
            raise RuntimeError(f"the model ({type(self.model).__name__}) was not sharded over the {self.world} "
                               "ranks, so its gradients would not be synchronized; this is a bug in "
                               "workbench.train.model_setup.build_model, please report it")
        self.model.train()
        if rc.train.activation_checkpointing:
            # torch's composable checkpoint per decoder layer, not Transformers' (train/activation_checkpoint.py)
            apply_activation_checkpointing(self.model)
        if rc.train.router_bias_update_rate > 0:
            keep_router_biases_fp32(self.model)  # before a resume loads the saved float32 values into it
        self.optimizer = build_optimizer(self.model, rc.train, self.device)
        self.scheduler = build_scheduler(self.optimizer, rc.train)
        self.start_step = 0
        if self.resume_ckpt is not None:
            state = load_checkpoint(self.resume_ckpt, self.model, self.optimizer, self.scheduler)
            self.stream.load_state_dict(state["data"])
            self.start_step = int(state["step"])
        self._expert_load = _expert_load_reader(self.model)
        self.router_biases = None
        if rc.train.router_bias_update_rate > 0:
            self.router_biases = _router_biases(self.model, self.hf_config)
        self.coef = float(getattr(self.hf_config, "router_aux_loss_coef", 0.0) or 0.0)
        self.forward_kwargs: dict[str, Any] = {}
        self.aux_scale = 1.0 / (self.accum * self.world)
        if self.world > 1 and _accepts(self.model, "aux_loss_group"):
            import torch.distributed as dist

            self.forward_kwargs["aux_loss_group"] = dist.group.WORLD  # dp spans the whole world
            self.aux_scale = 1.0 / self.accum

    # -- one step ---------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, Any]:
        rc, device = self.rc, self.device
        reset_peak_memory(device)
        t_start = time.perf_counter()
        start = self.rank * self.per_rank
        batch = self.stream.next_batch(rc.train.global_batch_size, start, start + self.per_rank)
        micro = _micro_batches(batch, rc.train.local_batch_size)
        (global_tokens,) = du.all_reduce_sum([float(batch.num_loss_tokens())])
        num_items = torch.tensor(max(1.0, global_tokens), device=device)
        ce_sum, aux_sum, fwd_s, bwd_s = 0.0, 0.0, 0.0, 0.0
        loads = []
        for i, mb in enumerate(micro):
            mb = mb.to(device)
            last = i == len(micro) - 1
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2: reduce once per step
                self.model.set_requires_gradient_sync(last)
            t0 = time.perf_counter()
            with record_function("workbench.forward"):
                out = self.model(input_ids=mb.input_ids, labels=mb.labels, position_ids=mb.position_ids,
                                 output_router_logits=True, num_items_in_batch=num_items, use_cache=False,
                                 **self.forward_kwargs)
                aux = out.aux_loss if getattr(out, "aux_loss", None) is not None else None
                ce = out.loss - self.coef * aux if aux is not None else out.loss
                objective = ce
                if aux is not None:
                    objective = objective + self.coef * aux * self.aux_scale
            _sync(device)
            t1 = time.perf_counter()
            with record_function("workbench.backward"):
                objective.backward()
            _sync(device)
            t2 = time.perf_counter()
            fwd_s += t1 - t0
            bwd_s += t2 - t1
            ce_sum += float(ce.detach())
            aux_sum += float(aux.detach()) * self.aux_scale if aux is not None else 0.0
            if self._expert_load is None and getattr(out, "router_logits", None):
                loads.append(expert_load_from_router_logits(out.router_logits, self.hf_config.num_experts_per_tok,
                                                            num_experts(self.hf_config)))
        t3 = time.perf_counter()
        with record_function("workbench.optimizer"):
            # The norm is computed even with clipping off: the guard below needs it.
            grad_norm = clip_grad_norm(self.model.parameters(), rc.train.clip_grad_norm)
            lr = self.optimizer.param_groups[0]["lr"]
            # One reduction gives every rank the same global values, so all ranks pass or raise together.
            ce_global, aux_global, bad_norm = du.all_reduce_sum(
                [ce_sum, aux_sum, 0.0 if math.isfinite(grad_norm) else 1.0])
            check_finite(StepValues(
                step=step, first_step=step == self.start_step + 1,
                resumed_from=str(self.resume_ckpt) if self.resume_ckpt is not None else None,
                ce_loss=ce_global, aux_loss=aux_global, aux_coef=self.coef, grad_norm=grad_norm,
                grad_norm_finite=bad_norm == 0.0, lr=lr, train_lr=rc.train.lr,
                clip_grad_norm=rc.train.clip_grad_norm))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self._expert_load is not None:
            load = self._expert_load(self.model)
        else:
            load = torch.stack(loads).sum(0) if loads else None
        if self.router_biases is not None:  # after the step: the next forward routes with the new bias
            rate = rc.train.router_bias_update_rate
            update_router_biases(self.router_biases, global_load(load.to(du.collective_device())), rate)
        _sync(device)
        t4 = time.perf_counter()
        loss = ce_global + self.coef * aux_global
        load = load.cpu() if load is not None else None
        timings = {"step_time_s": t4 - t_start, "forward_s": fwd_s, "backward_s": bwd_s, "optimizer_s": t4 - t3}
        extra = {}
        if self.router_biases is not None:  # [layers][experts], a few floats: the bias after this step's update
            extra["router_bias"] = [b.detach().float().cpu().reshape(-1).tolist() for b in self.router_biases]
        return step_record(step=step, rank=self.rank, loss=loss, grad_norm=grad_norm, lr=lr,
                           tokens=batch.input_ids.numel(), seq_len=rc.data.seq_len, hf_config=self.hf_config,
                           timings=timings, device=device, expert_load=load, time=time.time(), **extra)

    # -- the run ----------------------------------------------------------------------------

    def save(self, step: int) -> Path:
        return save_checkpoint(self.run.checkpoints_dir, step, self.model, self.optimizer, self.scheduler,
                               self.stream.state_dict(), self.hf_config, run_settings(self.rc))

    def fit(self) -> dict[str, Any]:
        rc, total = self.rc, self.rc.train.steps
        status_base = {"total_steps": total, "world_size": self.world}
        if self.rank == 0:
            self.run.write_status("running", step=self.start_step, **status_base)
        self.callbacks.call("on_start", {
            "run_id": self.run.run_id, "run_dir": str(self.run.path), "rank": self.rank, "world_size": self.world,
            "dp": self.dp, "grad_accum": self.accum, "start_step": self.start_step, "total_steps": total,
            "device": str(self.device), "config": rc.to_dict(),
            "num_params": sum(p.numel() for p in self.model.parameters()),
        })
        losses: list[float] = []
        state, step, last_ckpt = "completed", self.start_step, None
        for step in range(self.start_step + 1, total + 1):
            stop = du.broadcast_flag(self.callbacks.should_stop() if self.rank == 0 else False)
            if stop:
                state, step = "stopped", step - 1
                break
            record = self.train_step(step)
            record.update(eval_metrics(self, step))  # data.eval_every: eval_loss / eval_accuracy on this step
            losses.append(record["loss"])
            self.run.append_metrics([record])  # one O_APPEND write per rank per step
            self.callbacks.call("on_step", record)
            if self.rank == 0:
                if step % rc.train.log_every == 0 or step == total:
                    print(f"step {step:>4}/{total}  loss {record['loss']:.4f}  "
                          f"tokens/s/gpu {record['tokens_per_s_per_gpu']:,.0f}  "
                          f"tflops/gpu {record['tflops_per_gpu']:.3f}  grad_norm {record['grad_norm']:.3f}",
                          flush=True)
                self.run.write_status("running", step=step, loss=record["loss"], **status_base)
            if rc.train.checkpoint_every and step % rc.train.checkpoint_every == 0 and step < total:
                last_ckpt = self.save(step)
        if state == "stopped" or rc.train.save_final_checkpoint:
            if step > self.start_step or last_ckpt is None:
                last_ckpt = self.save(step)
        hf_dir = None
        if state == "completed" and rc.train.export_hf:
            hf_dir = export_hf(self.model, self.run.path / "hf")
        result = {"state": state, "run_id": self.run.run_id, "run_dir": str(self.run.path), "step": step,
                  "total_steps": total, "losses": losses, "final_loss": losses[-1] if losses else None,
                  "checkpoint": str(last_ckpt) if last_ckpt else None, "hf_dir": str(hf_dir) if hf_dir else None}
        if self.rank == 0:
            self.run.write_status(state, step=step, final_loss=result["final_loss"],
                                  checkpoint=result["checkpoint"], **status_base)
        self.callbacks.call("on_end", result)
        return result


def _accepts(model: torch.nn.Module, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _is_parallel(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _expert_load_reader(model: torch.nn.Module):
    """This rank's routed tokens [layers, experts] since the last read (the engine's counters), or None."""
    from workbench.moe.routed_load import load_counters, pop_routed_load

    reader = pop_routed_load if load_counters(model) else None
    if reader is not None:
        reader(model)  # start from zero
    return reader


def _router_biases(model: torch.nn.Module, hf_config, meta: bool = False) -> list:
    """The score-correction biases train.router_bias_update_rate updates, one per engine MoE layer."""
    from workbench.config import ConfigError
    from workbench.moe.routed_load import load_counters

    counters = len(load_counters(model)) if not meta else None  # a meta model has no engine yet
    try:
        if not meta and not counters:
            raise RouterBiasError(f"train.router_bias_update_rate needs the engine's expert counts, and this "
                                  f"{getattr(hf_config, 'model_type', None)!r} model runs without the engine's "
                                  "experts; set train.router_bias_update_rate to 0")
        return check_router_bias(model, getattr(hf_config, "model_type", None), counters)
    except RouterBiasError as err:
        raise ConfigError(str(err)) from err


def finetune(run_config: RunConfig, callbacks: list | None = None) -> dict[str, Any]:
    """Run one fine-tuning job on this rank; returns {"state", "run_id", "run_dir", "losses", ...}.

    Callbacks are objects with any of: on_start(info), on_step(record) (every step, every rank,
    that rank's record), on_end(result), should_stop() (polled on rank 0 at each step boundary;
    all ranks stop together, after a checkpoint, with status "stopped"). On an exception the
    status becomes "failed" with the traceback and the exception is re-raised. While it runs,
    rank 0 keeps a heartbeat in status.json so that readers can tell a killed run ("died");
    everything it writes is private to the user (directories 0700, files 0600).
    """
    if not isinstance(run_config, RunConfig):
        raise TypeError(f"finetune needs a workbench.RunConfig, got {type(run_config).__name__}")
    with private_files():
        trainer = Trainer(run_config, callbacks)  # validation, data and run dir: errors before heavy work
        heartbeat = Heartbeat(trainer.run.beat).start() if trainer.rank == 0 else None

        def terminated(name: str) -> None:
            trainer.run.mark_failed(f"rank {trainer.rank} was stopped by {name} (a launcher stops the other "
                                    "ranks this way when one fails)", rank=trainer.rank, signal=name)

        try:
            with record_termination(terminated):
                return _train(trainer)
        finally:
            if heartbeat is not None:
                heartbeat.stop()


def _train(trainer: Trainer) -> dict[str, Any]:
    try:
        trainer.setup()
        result = trainer.fit()
        # Collective on success (every rank got here): free dispatcher buffers (DeepEP) now
        # rather than leak them into the next run of a long-lived notebook kernel.
        close_dispatchers(trainer.model)
        return result
    except BaseException as err:
        tb = traceback.format_exc()
        error = f"{type(err).__name__}: {err}"
        try:
            trainer.run.write_status("failed", **trainer.run.progress(), error=error, traceback=tb,
                                     rank=trainer.rank)
        except OSError as write_err:  # keep the run's own error, not this one
            print(f"workbench: could not record the failure in {trainer.run.status_path}: {write_err}",
                  file=sys.stderr, flush=True)
        finally:
            trainer.callbacks.call("on_end", {"state": "failed", "run_id": trainer.run.run_id,
                                              "run_dir": str(trainer.run.path), "rank": trainer.rank,
                                              "error": error, "traceback": tb})
        raise
