"""The train section of a RunConfig: steps, batch sizes, AdamW, schedule, checkpoints, resume rules."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config_checks import ConfigError, check_float, check_int
from workbench.trackers.registry import INSTALL_EXTRA, TRACKERS, missing_packages

# "adamw": Triton AdamW on CUDA (torch's fused math, more bandwidth), torch AdamW elsewhere;
# "adamw_torch": always torch.optim.AdamW (fused on CUDA); "adamw_triton": always TritonAdamW
OPTIMIZERS = ("adamw", "adamw_torch", "adamw_triton")
# How a bf16 model's weights are updated (workbench.train.precision); on float32 weights every one is plain float32.
PRECISIONS = ("auto", "bf16", "bf16_sr", "fp32_master")
# How the workbench AdamW keeps its moments: in the weights' dtype, or 8-bit blockwise (workbench.kernels.adamw8)
OPTIMIZER_STATES = ("full", "8bit")
# What the trainer does with the run's plan (workbench.plan) before it builds anything: "check" refuses a run planned
# not to fit its device, naming the changes that would; "auto" applies the fastest of them that keeps the training and
# the rank count, and says which; "off" builds without asking
FIT_MODES = ("check", "auto", "off")

# Settings a resume must keep, always: the tensors in the checkpoint (weights, adapters, optimizer state)
# are laid out by them, so accepting another value could only fail inside the load. Turning LoRA on or off
# is refused as well (workbench.train.checkpoint_checks), with its own way forward.
FIXED_WHY = {
    "train.precision": "fp32_master keeps float32 master weights in the optimizer state and the others do not",
    "train.optimizer_states": "8-bit and full moments are different state",
    "lora.rank": "the adapters in the checkpoint are [rank, in] and [out, rank] tensors",
    "lora.targets": "the checkpoint holds adapters on those layers only",
}
FIXED_ON_RESUME = tuple(FIXED_WHY)
# Settings a resume must keep unless train.resume_allow_changes names them: the LR schedule, the
# optimizer's update and the data position and order in the checkpoint depend on them. train.optimizer
# is not one: torch's and the Triton AdamW share their state and may be swapped on resume. train.seed
# orders the data (an accepted change continues at the saved position in the new seed's order); it also
# builds a preset's base, which a LoRA resume must keep (workbench.train.lora_base).
RESUME_FIELDS = (
    "train.steps",
    "train.warmup_steps",
    "train.lr",
    "train.min_lr_ratio",
    "train.global_batch_size",
    "train.weight_decay",
    "train.betas",
    "train.precision",
    "train.optimizer_states",
    "train.seed",
    "data.kind",
    "data.path",
    "data.tokenizer",
    "data.seq_len",
    "data.pack",
    "data.max_length",
    "data.data_files",
    "data.split",
    "data.format",
    "data.columns",
    "data.assistant_only_loss",
    "data.eval_fraction",
    "data.eval_files",
    "lora.rank",
    "lora.alpha",
    "lora.dropout",
    "lora.targets",
)


@dataclass(frozen=True)
class TrainConfig:
    """Optimization and bookkeeping: steps, batch sizes, AdamW, schedule, checkpoints."""

    steps: int = 20
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    local_batch_size: int = 4  # sequences per forward on one rank
    grad_accum: int | None = None  # None = global / (local * dp); if set it must agree
    lr: float = 3e-3
    warmup_steps: int = 2
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    clip_grad_norm: float | None = 1.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    optimizer: str = "adamw"  # one of OPTIMIZERS
    # one of PRECISIONS: "bf16" rounds each update to nearest (loses most at lr 1e-5), "bf16_sr" rounds
    # it stochastically, "fp32_master" keeps float32 weights in the optimizer; "auto" = bf16_sr
    precision: str = "auto"
    # one of OPTIMIZER_STATES: "8bit" stores exp_avg and exp_avg_sq in one byte each (plus a float32 scale per
    # block of up to 256 elements), rounded stochastically: 6 -> ~4 bytes per bf16 parameter
    optimizer_states: str = "full"
    seed: int = 0
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (train/activation_checkpoint.py)
    # With activation_checkpointing: how many decoder layers recompute (the first N); null = every layer. Fewer
    # layers recompute less where the memory allows it (workbench plan offers the count that fits).
    activation_checkpointing_layers: int | None = None
    # Update each parameter inside the backward and free its gradient (train/backward_updates.py): about one layer's
    # gradients alive instead of all; needs clip_grad_norm null, one rank and no gradient accumulation
    optimizer_in_backward: bool = False
    # Replay the decoder stack as CUDA graphs (train/stack_graphs.py): host-bound steps (LoRA) stop waiting for the
    # launches; one CUDA rank, no activation checkpointing
    cuda_graphs: bool = False
    # Aux-loss-free balancing (DeepSeek-V3): after each step, bias_e += rate * sign(mean load - load_e); 0 = off.
    router_bias_update_rate: float = 0.0
    # Multi-token prediction (DeepSeek-V3, Nemotron 3 Super): add weight x the MTP layers' cross-entropy to the loss;
    # 0 = off. Refused above 0 while Transformers builds no MTP layers in the model (workbench/models/mtp.py).
    mtp_loss_weight: float = 0.0
    checkpoint_every: int | None = None  # steps; None = only at the end
    save_final_checkpoint: bool = True
    export_hf: bool = False  # write a vanilla HF checkpoint (save_pretrained) at the end
    log_every: int = 1  # print to stdout every N steps (metrics are recorded every step)
    # Python's garbage collector off during steps, generations 0-1 collected every N steps (train/step_gc.py); 0 =
    # Python's automatic collection
    gc_every: int = 50
    fit: str = "check"  # one of FIT_MODES
    # the memory per rank the plan checks against; None = the device's (a GPU's total, a CPU host's available memory)
    fit_memory_gib: float | None = None
    resume_from: str | None = None  # a checkpoint directory, or a run directory (latest checkpoint)
    resume_allow_changes: tuple[str, ...] = ()  # RESUME_FIELDS this run may change from the checkpoint's
    # Experiment trackers rank 0 reports every step record to, inside the run's folder, offline (workbench/trackers):
    # any of "tensorboard", "wandb", "mlflow"; their libraries come with the `trackers` pip extra
    report_to: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_int(self.steps, "train.steps", 1)
        check_int(self.global_batch_size, "train.global_batch_size", 1)
        check_int(self.local_batch_size, "train.local_batch_size", 1)
        check_int(self.grad_accum, "train.grad_accum", 1, allow_none=True)
        if self.global_batch_size % self.local_batch_size:
            raise ConfigError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"train.local_batch_size ({self.local_batch_size})"
            )
        check_float(self.lr, "train.lr", 0.0)
        check_int(self.warmup_steps, "train.warmup_steps", 0)
        check_float(self.min_lr_ratio, "train.min_lr_ratio", 0.0, 1.0)
        if self.clip_grad_norm is not None:
            check_float(self.clip_grad_norm, "train.clip_grad_norm", 0.0)
            if self.clip_grad_norm == 0:  # clipping to norm 0 zeroes every update: the run would not train
                raise ConfigError(
                    "train.clip_grad_norm must be > 0 (0 zeroes every update); use null (None) to turn clipping off"
                )
        check_float(self.weight_decay, "train.weight_decay", 0.0)
        if (
            not isinstance(self.betas, (tuple, list))
            or len(self.betas) != 2
            or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas)
        ):
            raise ConfigError(f"train.betas must be two finite numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.optimizer == "adamw_torch" and self.precision in ("bf16_sr", "fp32_master"):
            raise ConfigError(
                f"train.precision={self.precision!r} needs the workbench AdamW: set train.optimizer "
                "to 'adamw' (or 'adamw_triton'), or train.precision to 'bf16'"
            )
        if self.optimizer_states not in OPTIMIZER_STATES:
            raise ConfigError(
                f"train.optimizer_states must be one of {OPTIMIZER_STATES}, got {self.optimizer_states!r}"
            )
        if self.optimizer == "adamw_torch" and self.optimizer_states != "full":
            raise ConfigError(
                "train.optimizer_states='8bit' needs the workbench AdamW (torch's keeps full moments): set "
                "train.optimizer to 'adamw' (or 'adamw_triton'), or optimizer_states to 'full'"
            )
        check_int(self.seed, "train.seed", 0)
        check_float(self.router_bias_update_rate, "train.router_bias_update_rate", 0.0)
        check_float(self.mtp_loss_weight, "train.mtp_loss_weight", 0.0)
        check_int(self.checkpoint_every, "train.checkpoint_every", 1, allow_none=True)
        check_int(self.log_every, "train.log_every", 1)
        check_int(self.gc_every, "train.gc_every", 0)
        if self.fit not in FIT_MODES:
            raise ConfigError(f"train.fit must be one of {FIT_MODES}, got {self.fit!r}")
        if self.fit_memory_gib is not None:
            check_float(self.fit_memory_gib, "train.fit_memory_gib", 0.0)
            if self.fit_memory_gib == 0:
                raise ConfigError("train.fit_memory_gib must be > 0 GiB (null: the device's memory)")
        allowed = self.resume_allow_changes
        if (
            not isinstance(allowed, (tuple, list))
            or not all(isinstance(n, str) for n in allowed)
            or set(allowed) - set(RESUME_FIELDS)
        ):
            raise ConfigError(
                "train.resume_allow_changes must be a list of names from "
                f"{[n for n in RESUME_FIELDS if n not in FIXED_ON_RESUME]}, got {allowed!r}"
            )
        for name in FIXED_ON_RESUME:
            if name in allowed:  # accepting the change would get past the settings check, then fail inside DCP
                raise ConfigError(
                    f"{name} cannot change on resume ({FIXED_WHY[name]}): drop it from train.resume_allow_changes "
                    "and keep the checkpoint's value, or start a new run (without train.resume_from) with another one"
                )
        object.__setattr__(self, "resume_allow_changes", tuple(allowed))
        self._check_report_to()
        for name in (
            "activation_checkpointing",
            "optimizer_in_backward",
            "cuda_graphs",
            "save_final_checkpoint",
            "export_hf",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"train.{name} must be true or false, got {getattr(self, name)!r}")
        if self.optimizer_in_backward and self.clip_grad_norm is not None:
            raise ConfigError(
                "train.optimizer_in_backward updates each parameter as soon as its gradient is complete, and "
                f"clipping by the global norm (train.clip_grad_norm={self.clip_grad_norm}) needs every gradient "
                "first: set train.clip_grad_norm to null, or optimizer_in_backward to false"
            )
        if self.activation_checkpointing_layers is not None:
            if not self.activation_checkpointing:
                raise ConfigError(
                    "train.activation_checkpointing_layers says how many layers recompute under activation "
                    "checkpointing: set train.activation_checkpointing to true, or drop the count"
                )
            check_int(self.activation_checkpointing_layers, "train.activation_checkpointing_layers", 1)
        if self.cuda_graphs and self.activation_checkpointing:
            raise ConfigError(
                "train.cuda_graphs captures the decoder stack's forward and backward once; activation checkpointing "
                "recomputes layers inside the backward, which the capture does not take: set one of them to false"
            )
        if self.optimizer_in_backward and self.optimizer == "adamw_torch":
            raise ConfigError(
                "train.optimizer_in_backward runs the workbench AdamW's per-parameter update: set train.optimizer "
                "to 'adamw' or 'adamw_triton'"
            )

    def _check_report_to(self) -> None:
        names = self.report_to
        if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n in TRACKERS for n in names):
            raise ConfigError(f"train.report_to must be a list of names from {list(TRACKERS)}, got {names!r}")
        if len(set(names)) != len(names):
            raise ConfigError(f"train.report_to names a tracker twice: {list(names)!r}")
        for name in names:
            missing = missing_packages(name)
            if missing:
                raise ConfigError(
                    f"train.report_to names {name!r}, whose library is not installed: {INSTALL_EXTRA} (or "
                    f"pip install {' '.join(missing)}), or drop {name!r} from train.report_to"
                )
        object.__setattr__(self, "report_to", tuple(names))

    def accumulation_steps(self, dp: int) -> int:
        """Micro-batches per rank per optimizer step for a data-parallel size `dp`."""
        per_rank, rem = divmod(self.global_batch_size, dp)
        if rem or per_rank % self.local_batch_size:
            raise ConfigError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"local_batch_size ({self.local_batch_size}) x data-parallel size ({dp})"
            )
        accum = per_rank // self.local_batch_size
        if self.grad_accum is not None and self.grad_accum != accum:
            raise ConfigError(
                f"train.grad_accum={self.grad_accum} disagrees with global_batch_size / "
                f"(local_batch_size x dp) = {accum}; drop grad_accum or fix the batch sizes"
            )
        return accum
