"""The Trainer's read side: step records from the device, the non-finite guard's error, publication.

`Trainer.train_step` queues a step's statistics on the device (workbench.train.step_stats); the
methods here turn the finished ones into records (workbench.train.metrics.step_record), raise the
guard's error for a non-finite step (workbench.train.guard), and hand the records to
metrics.jsonl, the callbacks, the run's status and stdout.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from workbench.runs.moe_health import load_health
from workbench.train.guard import NonFiniteError, StepValues, non_finite_error
from workbench.train.metrics import step_record
from workbench.train.step_stats import PendingStep


class StepRecords:
    """Mixin of workbench.train.loop.Trainer: collecting, recording and publishing its queued steps.

    Reads the Trainer's rc, rank, device, hf_config, coef, resume_ckpt, optimizer, run, callbacks
    and the step queue state setup() makes (_queue, _clock, _queued, _eval_by_step).
    """

    def collect(self, wait: bool = False) -> list[dict[str, Any]]:
        """The records of the steps whose device work has finished, in step order (wait=True: every queued step).

        Raises the non-finite guard's error for the first step whose global loss, aux loss or grad norm
        was not finite (that step and all later ones left the weights as they were). Under more than one
        rank it is raised only with wait=True, at the same step on every rank.
        """
        records, error = self._collect(wait)
        if error is not None:
            raise error
        return records

    def _collect(self, wait: bool, through: int | None = None) -> tuple[list[dict[str, Any]], NonFiniteError | None]:
        """(records ready now, the guard's error or None); the records are those before any bad step."""
        ready, bad = self._queue.ready(wait, through)
        records = [self._record(pending, values, seconds) for pending, values, seconds in ready]
        if bad is None:
            return records, None
        pending, values = bad
        forget = getattr(self.optimizer, "forget_skipped_steps", None)
        if forget is not None:  # TritonAdamW counts steps on the host (torch's fused AdamW restores its own)
            forget(self._queued - pending.step + 1)
        return records, non_finite_error(self._guard_values(int(values["first_bad"]), pending.host, values))

    def _record(self, pending: PendingStep, values: dict[str, Any], step_time: float) -> dict[str, Any]:
        host = pending.host
        timings = {
            "step_time_s": step_time,
            "forward_s": 0.0,
            "backward_s": 0.0,
            "optimizer_s": 0.0,
            **pending.phase_seconds(self._clock),
        }
        extra = {}
        if values["router_bias"] is not None:  # [layers][experts]: the bias after this step's update
            extra["router_bias"] = values["router_bias"]
        if values["expert_load"] is not None:  # dead experts, max/min share, CV per layer (workbench.runs.moe_health)
            extra.update(load_health(values["expert_load"]))
        if values["router_entropy"] is not None:  # [layers], normalised (train/router_entropy)
            extra["router_entropy"] = values["router_entropy"]
        load = torch.tensor(values["expert_load"]) if values["expert_load"] is not None else None
        record = step_record(
            step=pending.step,
            rank=self.rank,
            loss=values["ce"] + self.coef * values["aux"],
            grad_norm=values["grad_norm"],
            lr=host["lr"],
            tokens=host["tokens"],
            seq_len=self.rc.data.seq_len,
            hf_config=self.hf_config,
            timings=timings,
            device=self.device,
            expert_load=load,
            time=host["time"],
            **extra,
        )
        # memory as it was at the end of the step's queueing (step_record reads it now)
        record.update(mem_peak_gib=host["mem_peak_gib"], mem_now_gib=host["mem_now_gib"], mem_kind=host["mem_kind"])
        record.update(ce_loss=values["ce"], aux_loss=values["aux"])  # the global parts of `loss`
        record["peak_mem_gib"] = record["mem_peak_gib"]  # the bench's name for it (TRAINER_API)
        return record

    def _guard_values(self, step: int, host: dict[str, Any], values: dict[str, float]) -> StepValues:
        rc = self.rc
        return StepValues(
            step=step,
            first_step=host["first_step"],
            resumed_from=str(self.resume_ckpt) if self.resume_ckpt is not None else None,
            ce_loss=values["ce"],
            aux_loss=values["aux"],
            aux_coef=self.coef,
            grad_norm=values["grad_norm"],
            grad_norm_finite=math.isfinite(values["grad_norm"]),
            lr=host["lr"],
            train_lr=rc.train.lr,
            clip_grad_norm=rc.train.clip_grad_norm,
        )

    def _publish_or_raise(
        self, wait: bool, losses: list[float], status_base: dict[str, Any], through: int | None = None
    ) -> None:
        """Publish the collected records, then raise the guard's error if a step was not finite."""
        records, error = self._collect(wait, through)
        self._publish(records, losses, status_base)
        if error is not None:
            raise error

    def _publish(self, records: list[dict[str, Any]], losses: list[float], status_base: dict[str, Any]) -> None:
        """Hand collected records to metrics.jsonl, the callbacks, the status and (logging steps') stdout."""
        if not records:
            return
        total = self.rc.train.steps
        for record in records:
            record.update(self._eval_by_step.pop(record["step"], {}))
        losses.extend(r["loss"] for r in records)
        self.run.append_metrics(records)  # one O_APPEND write per rank per collect
        for record in records:
            self.callbacks.call("on_step", record)
        if self.rank == 0:
            # a callback that draws a progress bar (workbench.ui.terminal_progress) has the terminal instead
            bar = any(getattr(cb, "prints_step_lines", False) for cb in self.callbacks.items)
            for record in () if bar else records:  # each logging step's line once, whenever its record arrives
                if record["step"] % self.rc.train.log_every == 0 or record["step"] == total:
                    print(
                        f"step {record['step']:>4}/{total}  loss {record['loss']:.4f}  "
                        f"tokens/s/gpu {record['tokens_per_s_per_gpu']:,.0f}  "
                        f"tflops/gpu {record['tflops_per_gpu']:.3f}  grad_norm {record['grad_norm']:.3f}",
                        flush=True,
                    )
                if "eval_loss" in record:  # after its step's line, if any (the record arrives one step late)
                    print(
                        f"step {record['step']:>4}/{total}  eval_loss {record['eval_loss']:.4f}  "
                        f"eval_accuracy {record['eval_accuracy']:.4f}",
                        flush=True,
                    )
            record = records[-1]
            self.run.write_status("running", step=record["step"], loss=record["loss"], **status_base)
