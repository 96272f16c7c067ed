"""`workbench.finetune(run_config, callbacks)`: the training loop every rank runs.

Works inside an initialized process group (torchrun, the workbench cluster engines) or in a
single process with no group (world of 1). One step, its data-parallel split and its loss:
workbench.train.loop_step.

Host syncs. `train_step` queues a step and returns: its loss sums, token count, grad norm,
non-finite flag and expert load stay on the device and come back with the step's record from
`collect` (workbench.train.step_stats). `fit` waits for the device only on logging and checkpoint
steps and at the end; on other steps a record arrives once the next step has started.

A step whose global loss, aux loss or gradient norm is not finite never reaches the weights or a
checkpoint (workbench.train.guard): a sticky device flag makes the optimizer skip it and every
later step, and the next `collect(wait=True)` (before any checkpoint) raises naming it.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from workbench.config import RunConfig
from workbench.models.attention_sinks import runs_sink_attention
from workbench.models.router_aux import ensure_router_logit_hooks
from workbench.moe.bias_update import keep_router_biases_fp32
from workbench.moe.dispatch import close_dispatchers
from workbench.parallel import dist_utils as du
from workbench.runs.liveness import Heartbeat, record_termination
from workbench.runs.run_dir import private_files
from workbench.trackers.reporter import TrackerReport
from workbench.train.activation_checkpoint import apply_activation_checkpointing
from workbench.train.backward_updates import BackwardUpdates
from workbench.train.checkpoint import export_hf, load_checkpoint, run_settings, save_checkpoint, step_dir_name
from workbench.train.data import build_stream
from workbench.train.data_eval import eval_metrics
from workbench.train.fit_check import fit_run, out_of_memory_stop
from workbench.train.guard import NonFiniteError
from workbench.train.loop_records import StepRecords
from workbench.train.loop_step import TrainStep
from workbench.train.loop_support import (
    Callbacks,
    expert_load_reader,
    is_parallel,
    open_run_dir,
    router_biases_to_update,
)
from workbench.train.model_setup import build_model, model_dtype
from workbench.train.optim import build_optimizer, build_scheduler, set_skip_flag
from workbench.train.resume import prepare_resume, resumed_data_state
from workbench.train.stack_graphs import install_stack_graphs
from workbench.train.step_gc import StepGC
from workbench.train.step_stats import Clock, SkipFlag, StepQueue
from workbench.train.world_checks import check_world


class Trainer(TrainStep, StepRecords):
    """One run on this rank: model, optimizer, schedule, data stream, run directory."""

    def __init__(self, rc: RunConfig, callbacks: list | None = None) -> None:
        self.rc = rc
        self.callbacks = Callbacks(callbacks)
        self.step_gc = StepGC(rc.train.gc_every)  # fit() and the bench step under it
        self.rank, self.world = du.rank(), du.world_size()
        self.device = du.pick_device(rc.model.device)
        self.hf_config = rc.model.hf_config()
        # Every refusal that depends on the rank count, before any heavy work: the same function
        # `workbench finetune --nproc-per-node N` runs before torchrun starts a rank.
        plan = check_world(rc, self.world, self.hf_config, self.device)
        # The run's plan (workbench.plan), before any weight or run directory: a run that cannot fit the device is
        # refused naming what would fit, or with train.fit auto changed to the fastest of those (checked again)
        fitted, self.plan = fit_run(rc, self.world, self.hf_config, self.device, plan.backend)
        if fitted is not rc:
            self.rc = rc = fitted
            plan = check_world(rc, self.world, self.hf_config, self.device)
        self.mesh, self.dp, self.accum, self.backend = plan.mesh, plan.dp, plan.accum, plan.backend
        mesh_sizes = plan.mesh_sizes
        self.per_rank = rc.train.global_batch_size // self.dp
        # Before any heavy work or a run directory: a live run's latest checkpoint, a damaged or crafted one,
        # another model shape or LoRA base, or other settings (unless accepted) are refused here.
        self.resume_ckpt, self.lora_base = prepare_resume(rc, self.hf_config)
        torch.manual_seed(rc.train.seed)
        self.stream = build_stream(
            rc.data, rc.train.seed, self.hf_config.vocab_size, model_path=rc.model.path, runs_dir=rc.output_dir
        )
        self.run = open_run_dir(
            rc,
            {
                "world_size": self.world,
                "dp": self.dp,
                "grad_accum": self.accum,
                "device": self.device.type,
                "resolved_mesh": mesh_sizes,
                "resolved_backend": self.backend.to_dict(),
            },
        )
        if self.rank == 0 and rc.train.report_to:  # the trackers log rank 0's records (workbench/trackers)
            self.callbacks.items.append(TrackerReport(rc.train.report_to))

    def setup(self, model: torch.nn.Module | None = None) -> None:
        """Build the model from the run config (or take `model`, prebuilt and sharded), optimizer, schedule."""
        rc = self.rc
        torch.manual_seed(rc.train.seed)
        if model is None:
            model = build_model(
                rc, self.hf_config, self.mesh, self.device, model_dtype(rc.model, self.device), self.backend
            )
            where = "workbench.train.model_setup.build_model, please report it"
        else:
            where = "the caller of Trainer.setup(model): shard it (FSDP2) before handing it over"
        self.model = model
        if self.world > 1 and not is_parallel(self.model):
            # Each rank would train its own copy: refuse rather than report a run that is not one.
            raise RuntimeError(
                f"the model ({type(self.model).__name__}) was not sharded over the {self.world} "
                f"ranks, so its gradients would not be synchronized; this is a bug in {where}"
            )
        self.model.train()
        if rc.train.activation_checkpointing:
            # torch's composable checkpoint per decoder layer, not Transformers' (train/activation_checkpoint.py)
            apply_activation_checkpointing(self.model, rc.train.activation_checkpointing_layers)
        if rc.train.cuda_graphs:  # captured at the first training forward (train/stack_graphs.py)
            install_stack_graphs(self.model)
        if rc.train.router_bias_update_rate > 0:
            keep_router_biases_fp32(self.model)  # before a resume loads the saved float32 values into it
        self.optimizer = build_optimizer(self.model, rc.train, self.device)
        # What clipping walks each step: the model's trainable parameters, listed once (a LoRA model's
        # parameters() walks every frozen base module too, ~5 ms of host time per step at 48 layers)
        self.grad_params = [p for p in self.model.parameters() if p.requires_grad]
        self.scheduler = build_scheduler(self.optimizer, rc.train)
        self.start_step = 0
        if self.resume_ckpt is not None:
            state = load_checkpoint(self.resume_ckpt, self.model, self.optimizer, self.scheduler)
            self.stream.load_state_dict(resumed_data_state(state["data"], rc))
            self.start_step = int(state["step"])
        self._expert_load = expert_load_reader(self.model)
        self.router_biases = None
        if rc.train.router_bias_update_rate > 0:
            self.router_biases = router_biases_to_update(self.model, self.hf_config)
        self._clock = Clock(self.device)
        self._queue = StepQueue(self._clock, self.world)  # queued steps not yet collected
        self._eval_by_step: dict[int, dict[str, float]] = {}  # eval keys waiting for their step's record
        self._queued = self.start_step
        self._skip = SkipFlag(self.device)
        self._device_skip = set_skip_flag(self.optimizer, self._skip.found_inf)
        self.backward_updates = None
        if rc.train.optimizer_in_backward:  # each parameter updated by its own hook (train/backward_updates.py)
            self.backward_updates = BackwardUpdates(self.optimizer, self._skip)
        self._host_sequences = runs_sink_attention(self.model)
        self.coef = float(getattr(self.hf_config, "router_aux_loss_coef", 0.0) or 0.0)
        ensure_router_logit_hooks(self.model)  # the aux loss comes from them, on any model with one
        self._aux_group = None
        if self.world > 1:
            import torch.distributed as dist

            self._aux_group = dist.group.WORLD  # dp spans the whole world
        # Each micro-batch's aux loss is this rank's share of the global micro-batch's: the shares add
        # up over ranks, and the mean over micro-batches divides by grad_accum.
        self.aux_scale = 1.0 / self.accum

    # -- the run ----------------------------------------------------------------------------

    def save(self, step: int) -> Path:
        return save_checkpoint(
            self.run.checkpoints_dir,
            step,
            self.model,
            self.optimizer,
            self.scheduler,
            self.stream.state_dict(),
            self.hf_config,
            run_settings(self.rc),
            self.lora_base,
        )

    def fit(self) -> dict[str, Any]:
        """Run the steps from start_step + 1 to train.steps (Python's collector paused: train.gc_every)."""
        try:
            with self.step_gc:
                return self._fit()
        finally:
            self.end_backward_updates()

    def end_backward_updates(self) -> None:
        """Take train.optimizer_in_backward's hooks off the parameters (the run's end; nothing without them)."""
        if getattr(self, "backward_updates", None) is not None:
            self.backward_updates.remove()

    def _fit(self) -> dict[str, Any]:
        rc, total = self.rc, self.rc.train.steps
        status_base = {"total_steps": total, "world_size": self.world}
        if self.rank == 0:
            self.run.write_status("running", step=self.start_step, **status_base)
        self.callbacks.call(
            "on_start",
            {
                "run_id": self.run.run_id,
                "run_dir": str(self.run.path),
                "rank": self.rank,
                "world_size": self.world,
                "dp": self.dp,
                "grad_accum": self.accum,
                "start_step": self.start_step,
                "total_steps": total,
                "device": str(self.device),
                "config": rc.to_dict(),
                "num_params": sum(p.numel() for p in self.model.parameters()),
            },
        )
        losses: list[float] = []
        state, step, last_ckpt, waited, log_due = "completed", self.start_step, None, True, None
        for step in range(self.start_step + 1, total + 1):
            # Polled where the last step waited for the device anyway (the flag is a collective read, a
            # host sync under NCCL): every logging or checkpoint step, the same steps on every rank.
            if waited and du.broadcast_flag(self.callbacks.should_stop() if self.rank == 0 else False):
                state, step = "stopped", step - 1
                break
            try:
                self.train_step(step)
            except NonFiniteError:  # the host check of an optimizer that cannot skip on the device
                self._publish(self._collect(wait=True)[0], losses, status_base)
                raise
            except torch.OutOfMemoryError:  # the measured peak beside the plan, and what would fit
                raise out_of_memory_stop(rc, self.world, self.hf_config, self.device, self.backend, step) from None
            # data.eval_every: eval_loss / eval_accuracy of the weights after this step, merged into its
            # record when that is collected (the eval reads its loss: a wait, on eval steps only)
            evaluated = eval_metrics(self, step)
            if evaluated:
                self._eval_by_step[step] = evaluated
            log = step % rc.train.log_every == 0 or step == total
            ckpt = bool(rc.train.checkpoint_every and step % rc.train.checkpoint_every == 0 and step < total)
            if step == total:  # the wait after the loop reads it
                break
            # Waiting drains the device queue: only where a checkpoint follows or a callback asks for it.
            # A logging step's line is printed one step late, once the next step is queued behind it, so
            # the device never idles while the host reads (with log_every=1 too).
            drain = ckpt or self.callbacks.every_step()
            waited = drain or log_due is not None
            self._publish_or_raise(waited, losses, status_base, through=None if drain else log_due)
            log_due = step if log and not drain else None
            if ckpt:
                last_ckpt = self.save(step)  # after a wait that passed the guard: no step in it was non-finite
        self._publish_or_raise(True, losses, status_base)  # before any save below
        if state == "stopped" or rc.train.save_final_checkpoint:
            # A step-* folder is written once: a stop right after a checkpoint keeps it (another run may be
            # resuming from it while this one ends).
            if last_ckpt is None or last_ckpt.name != step_dir_name(step):
                last_ckpt = self.save(step)
        hf_dir = None
        if state == "completed" and rc.train.export_hf:
            hf_dir = export_hf(self.model, self.run.path / "hf")
        result = {
            "state": state,
            "run_id": self.run.run_id,
            "run_dir": str(self.run.path),
            "step": step,
            "total_steps": total,
            "losses": losses,
            "final_loss": losses[-1] if losses else None,
            "checkpoint": str(last_ckpt) if last_ckpt else None,
            "hf_dir": str(hf_dir) if hf_dir else None,
        }
        if self.rank == 0:
            self.run.write_status(
                state, step=step, final_loss=result["final_loss"], checkpoint=result["checkpoint"], **status_base
            )
        self.callbacks.call("on_end", result)
        return result


def finetune(run_config: RunConfig, callbacks: list | None = None) -> dict[str, Any]:
    """Run one fine-tuning job on this rank; returns {"state", "run_id", "run_dir", "losses", ...}.

    Callbacks are objects with any of: on_start(info), on_step(record) (every step, every rank,
    that rank's record, once, in step order; the trainer waits for the device only before a
    checkpoint (train.checkpoint_every) and for a logging step's record (train.log_every), which it
    reads once the next step is queued behind it; in between a record arrives when the next step has
    started, or with the next read), on_end(result), should_stop()
    (polled on rank 0 at the step boundaries after such a read; all ranks stop together, after a
    checkpoint, with status "stopped"); `collect_every_step = True` on a callback makes every
    step a read (the profiler's). On an exception the
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
            trainer.run.mark_failed(
                f"rank {trainer.rank} was stopped by {name} (a launcher stops the other ranks this way when one fails)",
                rank=trainer.rank,
                signal=name,
            )

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
            trainer.run.write_status("failed", **trainer.run.progress(), error=error, traceback=tb, rank=trainer.rank)
        except OSError as write_err:  # keep the run's own error, not this one
            print(
                f"workbench: could not record the failure in {trainer.run.status_path}: {write_err}",
                file=sys.stderr,
                flush=True,
            )
        finally:
            trainer.callbacks.call(
                "on_end",
                {
                    "state": "failed",
                    "run_id": trainer.run.run_id,
                    "run_dir": str(trainer.run.path),
                    "rank": trainer.rank,
                    "error": error,
                    "traceback": tb,
                },
            )
        raise
