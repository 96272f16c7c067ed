"""`Trainer.train_step`: one optimizer step of the training loop, queued on the device without a host sync."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.profiler import record_function

from workbench.models.attention_sinks import forward_sequences
from workbench.models.engine_state import engine_state
from workbench.models.host_packing import host_packing
from workbench.models.router_aux import forward_loss_parts
from workbench.moe.bias_update import global_load, update_router_biases
from workbench.parallel import dist_utils as du
from workbench.params import num_experts
from workbench.train.data_batch import IGNORE_INDEX, Batch
from workbench.train.guard import check_finite
from workbench.train.loop_support import all_reduce, micro_batches
from workbench.train.metrics import expert_load_from_router_logits, memory_gib, reset_peak_memory
from workbench.train.optim import clip_grad_norm
from workbench.train.router_entropy import router_entropy_sums
from workbench.train.step_stats import PendingStep, StatsLayout, to_device


class TrainStep:
    """Mixin of workbench.train.loop.Trainer: one optimizer step over this rank's slice of the global batch.

    Data parallelism and the loss. Each optimizer step takes one global batch of
    `global_batch_size` sequences; rank r takes its contiguous slice r of dp equal slices and splits
    it into `grad_accum` micro-batches of `local_batch_size`. The cross-entropy of every micro-batch
    is a *sum* over its tokens divided by the GLOBAL number of loss tokens in the whole global batch
    (all micro-batches, all ranks), so the per-rank contributions add up to exactly the mean over
    the global batch. Gradients are therefore SUMMED over ranks, never averaged: FSDP2 uses a
    gradient divide factor of 1 (workbench.parallel.fsdp) for the engine's models and for any other
    Transformers model alike (every model on more than one rank is sharded). The router aux loss
    comes apart from the cross-entropy (models/router_aux.forward_loss_parts: the forward runs
    without router logits, so its loss is the cross-entropy alone, and the aux loss is computed once
    from the recorded router logits), for the engine's models and vanilla Transformers alike. It is
    this rank's share of the aux loss of the micro-batch across all ranks (shares add up to the
    global micro-batch's aux loss), so it is divided by grad_accum only. The aux loss is a statistic
    of each micro-batch, so runs with different local batch sizes differ in it; the cross-entropy
    part is the same for any split. Each record has loss = ce_loss + router_aux_loss_coef x aux_loss.

    Reads the Trainer's rc, rank, device, hf_config, per_rank, stream and what setup() makes (model,
    optimizer, scheduler, start_step, coef, aux_scale, router_biases, the skip flag and the step queue).
    """

    def train_step(self, step: int) -> None:
        """Queue optimizer step `step` (1-based) on the device, without a host sync; `collect` gives its record."""
        rc, device, clock = self.rc, self.device, self._clock
        reset_peak_memory(device)
        pending = PendingStep(step=step, host={}, start=clock.mark())
        self._queue.started(pending.start)
        if self.backward_updates is not None:
            self.backward_updates.begin(step)
        start = self.rank * self.per_rank
        batch = self.stream.next_batch(rc.train.global_batch_size, start, start + self.per_rank)
        micro = micro_batches(batch, rc.train.local_batch_size)
        # The global loss-token count divides the loss: summed on the device, read by no one on the host
        loss_tokens = to_device((batch.labels[:, 1:] != IGNORE_INDEX).sum().to(torch.float64), device)
        loss_tokens = all_reduce(loss_tokens)
        num_items = loss_tokens.clamp_min(1.0).to(torch.float32)
        ce_sum = torch.zeros((), dtype=torch.float64, device=device)
        aux_sum = torch.zeros((), dtype=torch.float64, device=device)
        loads = []
        entropy = None  # the router entropy per layer summed over micro-batches (train/router_entropy), on the device
        for i, mb in enumerate(micro):
            extra = self._sequences(mb)  # from the host's position_ids, before the copy
            host_positions = mb.position_ids
            mb = Batch(*(to_device(t, device) for t in (mb.input_ids, mb.labels, mb.position_ids)))
            last = i == len(micro) - 1
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2: reduce once per step
                self.model.set_requires_gradient_sync(last)
            t0 = clock.mark()
            with record_function("workbench.forward"), host_packing(host_positions):
                # the cross-entropy and the aux loss come apart (models/router_aux): each is computed once
                parts = forward_loss_parts(
                    self.model,
                    self.model,
                    dict(
                        input_ids=mb.input_ids,
                        labels=mb.labels,
                        position_ids=mb.position_ids,
                        num_items_in_batch=num_items,
                        use_cache=False,
                        **extra,
                    ),
                    group=self._aux_group,
                )
                ce, aux = parts.ce, parts.aux
                objective = ce if aux is None else ce + self.coef * aux * self.aux_scale
            t1 = clock.mark()
            with record_function("workbench.backward"):
                objective.backward()
            pending.phases += [("forward_s", t0, t1), ("backward_s", t1, clock.mark())]
            ce_sum += ce.detach().to(torch.float64)
            if aux is not None:
                aux_sum += aux.detach().to(torch.float64) * self.aux_scale
            if parts.router_logits:
                sums = router_entropy_sums(parts.router_logits)
                entropy = sums if entropy is None else entropy + sums
            if self._expert_load is None and parts.router_logits:
                loads.append(
                    expert_load_from_router_logits(
                        parts.router_logits, self.hf_config.num_experts_per_tok, num_experts(self.hf_config)
                    )
                )
        t3 = clock.mark()
        with record_function("workbench.optimizer"):
            # The norm is computed even with clipping off: the guard needs it.
            # the coefficient goes into the optimizer's update where it can take it (no extra pass)
            if self.backward_updates is not None:  # the parameters were updated inside the backward
                grad_norm = self.backward_updates.take_grad_norm(device)
            else:
                grad_norm = clip_grad_norm(self.grad_params, rc.train.clip_grad_norm, self.optimizer)
            # One reduction gives every rank the same global values, so all ranks skip (and raise) together.
            ce_global, aux_global = all_reduce(torch.stack([ce_sum, aux_sum])).to(device).unbind()
            bad = self._skip.update(step, [ce_global, self.coef * aux_global, grad_norm])
            lr = self.optimizer.param_groups[0]["lr"]
            pending.host.update(lr=lr, tokens=batch.input_ids.numel(), first_step=step == self.start_step + 1)
            if not self._device_skip:
                # torch's single-tensor/foreach AdamW (adamw_torch on the CPU) has no found_inf: the only
                # way to keep a non-finite step off its weights is to look first (on the CPU, where it
                # runs, the read waits for nothing)
                values = {"ce": float(ce_global), "aux": float(aux_global), "grad_norm": float(grad_norm)}
                check_finite(self._guard_values(step, pending.host, values))
            if self.backward_updates is None:
                self.optimizer.step()  # skipped on the device once the flag is set (optimizer.found_inf)
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self._expert_load is not None:
            load = self._expert_load(self.model)
        else:
            load = torch.stack(loads).sum(0) if loads else None
        if self.router_biases is not None:  # after the step: the next forward routes with the new bias
            # A skipped step leaves the biases too: a load of zeros moves no bias (sign(0) = 0)
            kept = torch.where(self._skip.found_inf.to(load.device) > 0, torch.zeros_like(load), load)
            update_router_biases(
                self.router_biases, global_load(kept.to(du.collective_device())), rc.train.router_bias_update_rate
            )
        pending.phases.append(("optimizer_s", t3, clock.mark()))
        scalars = {
            "ce": ce_global,
            "aux": aux_global,
            "grad_norm": grad_norm,
            "bad": bad,
            "skipping": self._skip.found_inf,
            "first_bad": self._skip.first_bad,
            "loss_tokens": loss_tokens,
        }
        if entropy is not None:
            entropy = entropy / len(micro)
        layout = StatsLayout(
            tuple(load.shape) if load is not None else (),
            tuple(b.numel() for b in self.router_biases or ()),
            entropy.numel() if entropy is not None else 0,
        )
        pending.queue_copy(layout, layout.pack(scalars, load, self.router_biases, entropy), clock)
        # A CUDA graph pool's replay memory is not "allocated"; the capture's own step counts it twice (an overestimate)
        graphs = engine_state(self.model).stack_graphs
        # the allocator's counters: host-side, no wait
        peak, now, kind = memory_gib(device, graphs.pool_hidden_bytes if graphs is not None else 0)
        pending.host.update(mem_peak_gib=peak, mem_now_gib=now, mem_kind=kind, time=time.time())
        self._queue.push(pending)
        self._queued = step
        self.step_gc.after_step(step)

    def _sequences(self, mb: Batch) -> dict[str, Any]:
        """GPT-OSS sink attention's documents from the host's position_ids (no device read for their count)."""
        if not self._host_sequences:
            return {}
        found = forward_sequences(self.model, (), {"input_ids": mb.input_ids, "position_ids": mb.position_ids})
        return {k: to_device(v, self.device) if isinstance(v, torch.Tensor) else v for k, v in found.items()}
