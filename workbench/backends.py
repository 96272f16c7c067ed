"""BackendConfig and "auto" resolution: the one place that knows which package provides what."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workbench.errors import INSTALL_HINT, BackendError
from workbench.kernels.te_common import import_transformer_engine

# Choices per field. "auto" is resolved by `BackendConfig.resolve`.
CHOICES: dict[str, tuple[str, ...]] = {
    "experts": ("loop", "grouped_mm", "te", "auto"),
    "dispatcher": ("local", "alltoall", "alltoall_overlap", "symm_mem", "deepep", "auto"),
    "gate": ("native", "balanced"),
    "attention": ("sdpa", "te", "sinks", "auto"),
    "rms_norm": ("torch", "triton", "te", "auto"),
    "linear": ("torch", "te", "auto"),
    # The engine's Triton kernels, one choice each (torch = the eager reference that runs anywhere):
    # fused RoPE in Qwen3-MoE's attention, SwiGLU on the experts' packed gate|up rows (and GPT-OSS's
    # fused bias + clamped interleaved SwiGLU, kernels/gpt_oss_gate.py: 5.4x Transformers' gate on
    # 1 x H200, benchmarks/results/2026-12-01-gpt-oss-gate-1xh200.json), the weighted
    # combine (and its transpose, the dispatch backward), the fused cross-entropy's softmax gradient.
    "rope": ("torch", "triton", "auto"),
    "swiglu": ("torch", "triton", "auto"),
    "combine": ("torch", "triton", "auto"),
    "cross_entropy": ("torch", "triton", "auto"),
    # The grouped experts' weight gradient: their own backward's (autograd), or the Triton one that sums its
    # squares for the clipping norm as it stores them (moe/expert_wgrad.py), where the shapes tile.
    "expert_wgrad": ("autograd", "triton", "auto"),
    # The input embedding's gradient: torch's (a zero fill, then the tokens' rows scattered in), or the Triton one
    # that writes each table row once and sums its squares for the clipping norm (kernels/embedding.py).
    "embedding": ("torch", "triton", "auto"),
    # The float32 routers' softmax + top-k (Qwen3-MoE's): torch's ops, or one Triton kernel each way.
    "router": ("torch", "triton", "auto"),
    # The hybrid models' sequence mixers (Mamba2, Gated DeltaNet): Transformers' own module code, or the engine's
    # chunked scans in plain torch ops (models/mixer_mamba2.py, models/mixer_gated_delta.py), compiled on CUDA;
    # triton: chunked, with the gated delta rule's walk over its chunks in Triton (kernels/triton_gated_delta.py);
    # auto's first choice where Triton runs.
    "mixer": ("transformers", "chunked", "triton", "auto"),
}

# TransformerEngine backends run on Ampere or newer (bf16 GEMMs, fused attention); FP8 on Hopper+.
TE_MIN_CAPABILITY = (8, 0)
TE_FP8_MIN_CAPABILITY = (9, 0)

# Preference order used by "auto": first available wins. The dispatcher's auto is alltoall for
# ep > 1 and never symm_mem or deepep: resolve() does not know the activation dtype (DeepEP's
# combine takes bf16 only) nor whether the ep group stays within one node, and neither has beaten
# alltoall in a measured engine step yet; name them explicitly to use them.
#
# TransformerEngine is never auto's first choice for bf16 work: it lost in the one `workbench bench`
# launch that ran both on 1 x H200 (commit 570ddec, Qwen3-30B-A3B, 8 layers, seq 4096 x 2,
# benchmarks/results/2026-12-01-1xh200.json, variants engine / engine_te / engine_te_experts):
# 60,695 tokens/s with sdpa (cuDNN first) + Triton RMSNorm + torch linear, 56,242 with TE
# attention + linear + RMSNorm, 38,092 with TE GroupedLinear experts (the expert GEMMs alone, fwd+bwd,
# 64 experts x 1024 tokens, 2048 -> 1536 on the same GPU: torch grouped_mm 2.31 ms, TE 7.44 ms). The
# engine has been sped up since; the TE variants were not re-measured.
# With fp8=True, linear='auto' becomes 'te' where TE runs: TE is the engine's only FP8 GEMM path.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "experts": ("grouped_mm", "te", "loop"),
    "dispatcher": ("alltoall", "local"),
    # on the generic path a model with attention sinks (GPT-OSS) runs "sinks" where this gives "sdpa"
    # (models/attention_sinks.select_attention): Transformers' sdpa cannot express sinks
    "attention": ("sdpa", "te"),
    "rms_norm": ("triton", "torch", "te"),
    "linear": ("torch", "te"),
    "rope": ("triton", "torch"),
    "swiglu": ("triton", "torch"),
    "combine": ("triton", "torch"),
    "cross_entropy": ("triton", "torch"),
    # autograd: the Triton one lost in the trainer's step on an H200 (backward +3.7 ms, optimizer -2.2; 2026-12-05)
    "expert_wgrad": ("autograd", "triton"),
    # torch: the Triton ones were -0.13 ms a Qwen3 L8 step on an H200 over three A/B rounds, inside noise (2026-12-05)
    "embedding": ("torch", "triton"),
    "router": ("torch", "triton"),
    # triton where it runs (CUDA with Triton), else chunked: both restart the scan and conv at each packed document,
    # where Transformers' torch path carries the state from one document into the next. The Triton walk is the gated
    # delta rule's (a Mamba2 runs its compiled chunked scan either way). Qwen3.5-35B-A3B, 8 layers, seq 4096 x 1 on
    # one H100 (2026-12-06, a196cdb, v5 in the same launch): 26,023 tokens/s with the Triton walk, 20,255 with the
    # compiled torch walk, whose 1,240 launches a layer set its pace (one layer forward + backward: 9.8 ms against
    # 26.2, of which 15.0 ms GPU work).
    "mixer": ("triton", "chunked", "transformers"),
}


# DeepEP's intranode kernels are compiled for these ep group sizes (NVLink peers of one node).
DEEPEP_EP_SIZES = (2, 4, 8)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def gpus_per_node() -> int:
    """GPUs on this host, also on a rank whose CUDA_VISIBLE_DEVICES shows it only its own (NVML ignores it)."""
    import warnings

    count = -1
    raw = getattr(torch.cuda, "_raw_device_count_nvml", None)
    if raw is not None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                count = raw()
        except Exception:  # no NVML library here
            count = -1
    return max(count, torch.cuda.device_count())


def _cuda_capability(dev: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device, None where torch sees no CUDA device."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(dev))


@functools.lru_cache(maxsize=1)
def _te_import_error() -> str | None:
    """Why `import transformer_engine.pytorch` fails here (None when it works); asked once."""
    try:
        import_transformer_engine()
    except Exception as err:  # a broken install fails with OSError/RuntimeError too, not just ImportError
        return f"{type(err).__name__}: {err}"
    return None


# The optional modules a backend may need; Platform.detect asks which of them import here.
OPTIONAL_MODULES = ("triton", "transformer_engine", "deep_ep", "torch.distributed._symmetric_memory")


@dataclass(frozen=True)
class Platform:
    """What one machine offers the backends: the resolver's only inputs besides BackendConfig and ep.

    `Platform.detect(device)` reads them from this process; a test or a remote rank's record can
    build one by hand (no import of triton or TE needed to ask what a CUDA machine would resolve).
    """

    device_type: str = "cpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability (what TE needs); None: no GPU seen
    modules: frozenset[str] = frozenset()  # the OPTIONAL_MODULES that are installed
    # why `import transformer_engine.pytorch` fails (None: it imports); a callable is asked only when needed
    te_import_error: str | Callable[[], str | None] | None = None
    gpus_per_node: int = 0
    triton_interpret: bool = False  # TRITON_INTERPRET=1 (tests only): Triton runs on CPU tensors
    grouped_mm: bool = True  # this torch has torch._grouped_mm / F.grouped_mm

    def __post_init__(self) -> None:
        try:
            ok = isinstance(self.device_type, str) and torch.device(self.device_type).type == self.device_type
        except RuntimeError:
            ok = False
        if not ok:
            raise BackendError(
                f"Platform.device_type must be a torch device type such as 'cpu' or 'cuda' (no "
                f"index); got {self.device_type!r}"
            )
        cap = self.capability
        if cap is not None and not (isinstance(cap, tuple) and len(cap) == 2 and all(isinstance(c, int) for c in cap)):
            raise BackendError(f"Platform.capability must be None or (major, minor) ints, e.g. (9, 0); got {cap!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 0:
            raise BackendError(f"Platform.gpus_per_node must be an int >= 0; got {self.gpus_per_node!r}")
        unknown = set(self.modules) - set(OPTIONAL_MODULES)
        if unknown:
            raise BackendError(f"Platform.modules: unknown {sorted(unknown)}; known: {list(OPTIONAL_MODULES)}")

    @classmethod
    def detect(cls, device: torch.device | str = "cpu") -> Platform:
        """This process's platform for `device`.

        Only what an installed package needs is asked: the compute capability with TE (reading it
        starts CUDA in this process, e.g. a notebook's), the GPU count with DeepEP, TE's import only
        when a TE backend is asked about.
        """
        dev = torch.device(device)
        cuda = dev.type == "cuda"
        modules = frozenset(m for m in OPTIONAL_MODULES if _has_module(m))
        return cls(
            device_type=dev.type,
            capability=_cuda_capability(dev) if cuda and "transformer_engine" in modules else None,
            modules=modules,
            te_import_error=_te_import_error,
            gpus_per_node=gpus_per_node() if cuda and "deep_ep" in modules else 0,
            triton_interpret=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
            grouped_mm=hasattr(torch, "_grouped_mm") or hasattr(torch.nn.functional, "grouped_mm"),
        )

    def te_error(self) -> str | None:
        """Why TE does not import here (asked now if it was left to ask)."""
        return self.te_import_error() if callable(self.te_import_error) else self.te_import_error


def _platform(device: torch.device | str | Platform) -> Platform:
    return device if isinstance(device, Platform) else Platform.detect(device)


def te_availability(device: torch.device | str | Platform = "cpu", fp8: bool = False) -> tuple[bool, str]:
    """Whether TransformerEngine backends (FP8 ones with `fp8`) can run on `device`, and why not."""
    plat = _platform(device)
    if "transformer_engine" not in plat.modules:
        return False, f"transformer_engine is not installed: {INSTALL_HINT['te']}"
    if plat.device_type != "cuda":
        return False, f"TransformerEngine needs a CUDA device, got {plat.device_type}"
    capability = plat.capability
    if capability is None:
        return False, "TransformerEngine needs a CUDA device; torch sees none here"
    need = TE_FP8_MIN_CAPABILITY if fp8 else TE_MIN_CAPABILITY
    if capability < need:
        what = "FP8 (fp8=True)" if fp8 else "the TransformerEngine backends"
        return False, (
            f"{what} need(s) compute capability >= {need[0]}.{need[1]}, this GPU has {capability[0]}.{capability[1]}"
        )
    err = plat.te_error()
    if err is not None:
        return False, f"transformer_engine is installed but does not import ({err}); {INSTALL_HINT['te']}"
    return True, ""


def package_versions() -> dict[str, str | None]:
    """Installed versions of the optional accelerator packages (None where absent)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for key, dist in (
        ("torch", "torch"),
        ("transformers", "transformers"),
        ("triton", "triton"),
        ("transformer_engine", "transformer-engine"),
        ("deep_ep", "deep-ep"),
        ("liger_kernel", "liger-kernel"),
    ):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    if out["transformer_engine"] is None and _has_module("transformer_engine"):
        out["transformer_engine"] = "installed"
    if out["deep_ep"] is None and _has_module("deep_ep"):
        out["deep_ep"] = "installed"
    return out


def availability(
    field: str, choice: str, device: torch.device | str | Platform = "cpu", world_size: int = 1
) -> tuple[bool, str]:
    """Whether `choice` for `field` can run on `device` (or a Platform); the reason (with install hint) if not."""
    pure_torch = (
        "loop",
        "local",
        "torch",
        "sdpa",
        "sinks",
        "native",
        "balanced",
        "alltoall",
        "alltoall_overlap",
        "autograd",
        "auto",
    )
    if choice in pure_torch or (field == "mixer" and choice in ("transformers", "chunked")):
        return True, ""  # pure torch (or resolved later): runs anywhere, nothing to detect
    plat = _platform(device)
    cuda = plat.device_type == "cuda"
    if choice == "grouped_mm":
        ok = plat.grouped_mm
        return ok, "" if ok else "this torch has no grouped_mm; upgrade to torch>=2.9"
    if choice == "te":
        return te_availability(plat)
    if choice == "triton":
        # TRITON_INTERPRET=1 (tests only) runs the kernels on CPU tensors in Triton's interpreter
        interpreted = plat.device_type == "cpu" and plat.triton_interpret
        if not (cuda or interpreted):
            instead = {"expert_wgrad": "autograd", "mixer": "chunked"}.get(field, "torch")
            return False, f"{field}='triton' needs a CUDA device, got {plat.device_type}; use '{instead}'"
        if "triton" not in plat.modules:
            return False, f"triton is not installed: {INSTALL_HINT['triton']}"
        return True, ""
    if choice == "symm_mem":
        # The ep rule holds on every machine: said first, so a fix made on a laptop holds on the GPU too.
        if world_size < 2:
            return False, (
                "symm_mem dispatch exchanges tokens between ranks and needs expert parallelism "
                "(ep >= 2); with ep=1 every expert is local: use 'local' or 'auto'"
            )
        if not cuda:
            return False, f"symm_mem dispatch needs CUDA devices with NVSHMEM, got {plat.device_type}; use 'alltoall'"
        if "torch.distributed._symmetric_memory" not in plat.modules:
            return False, "this torch has no torch.distributed._symmetric_memory; use 'alltoall'"
        return True, ""
    if choice == "deepep":
        if world_size < 2:  # first, as for symm_mem
            return False, "DeepEP exchanges tokens between ep ranks and needs ep >= 2; use 'local' for one rank"
        if "deep_ep" not in plat.modules:
            return False, f"deep_ep is not installed: {INSTALL_HINT['deepep']}"
        if not cuda:
            return False, f"DeepEP needs CUDA GPUs joined by NVLink, got {plat.device_type}; use 'alltoall'"
        if world_size not in DEEPEP_EP_SIZES:
            return False, (
                f"DeepEP's intranode kernels run on {', '.join(map(str, DEEPEP_EP_SIZES))} ranks, "
                f"got {world_size}; use 'alltoall'"
            )
        per_node = plat.gpus_per_node
        if world_size > per_node:
            return False, (
                f"DeepEP runs intranode only (NVLink): {world_size} ranks but this node has {per_node} "
                "GPUs; use 'alltoall'"
            )
        return True, ""
    return False, f"unknown backend {choice!r} for {field!r}"


def adamw_kernel(device: torch.device | str) -> str:
    """The kernel the workbench AdamW (TritonAdamW) runs on `device`: "triton" where Triton runs, else "torch"
    (its torch-op path, the same math)."""
    return "triton" if availability("optimizer", "triton", device)[0] else "torch"


# (field, choice) -> (runs here?, why not): availability on one platform, or a cluster's rank records.
Probe = Callable[[str, str], tuple[bool, str]]


def auto_order(field: str, world_size: int = 1, fp8: bool = False) -> tuple[str, ...]:
    """The choices "auto" tries for `field`, first available wins (AUTO_ORDER with the ep and fp8 rules)."""
    if field == "dispatcher":
        return ("alltoall",) if world_size > 1 else ("local",)
    if field == "linear" and fp8:
        return ("te", "torch")
    return AUTO_ORDER[field]


def pick_auto(field: str, probe: Probe, world_size: int = 1, fp8: bool = False) -> str | None:
    """What "auto" becomes for `field` where `probe` says what runs; None where nothing in its order does."""
    return next((c for c in auto_order(field, world_size, fp8) if probe(field, c)[0]), None)


@dataclass(frozen=True)
class BackendConfig:
    """Which implementation runs each part of the model; validated at construction."""

    experts: str = "auto"
    dispatcher: str = "auto"
    gate: str = "native"
    attention: str = "auto"
    rms_norm: str = "auto"
    linear: str = "auto"
    rope: str = "auto"
    swiglu: str = "auto"
    combine: str = "auto"
    cross_entropy: str = "auto"
    expert_wgrad: str = "auto"
    embedding: str = "auto"
    router: str = "auto"
    mixer: str = "auto"
    # The lm_head + cross-entropy computed in chunks without materializing [tokens, vocab] logits; `cross_entropy`
    # picks its kernel. A forward with labels then returns no logits (reading them says how to get them:
    # models/fused_ce.py). "auto": on wherever the model's logits are lm_head(hidden) and nothing more, off (with
    # the reason) for a family that scales or softcaps them; decided by resolve(..., fused_ce_support=) or, where
    # that was not given, by the model build. Measured on 1 x H100 (2026-12-06, Qwen3-30B-A3B L8, seq 4096 x 2,
    # `workbench finetune`): 65,704 tokens/s at 42.3 GiB fused, 58,214 at 54.8 GiB with full logits.
    fused_ce: bool | str = "auto"
    # Recompute each expert MLP in backward instead of saving its intermediates: -300 MB per MoE
    # layer at 8k tokens x top-8 (Qwen3-30B-A3B shapes) for one more forward of the expert GEMMs.
    expert_recompute: bool = False
    # FP8 GEMMs (TransformerEngine, per-tensor current scaling) for whatever runs on TE: the
    # linear='te' projections and experts='te' (experts='auto' stays on bf16 grouped_mm). Needs
    # compute capability >= 9.0, and (TE's FP8 GEMM limits) tokens per forward divisible by 16 and
    # hidden widths by 16. Attention and norms stay in the model dtype.
    fp8: bool = False
    # dispatcher='alltoall_overlap': the token chunks each MoE layer's all-to-all is cut into, chunk c+1 in flight
    # while chunk c's experts compute (moe/dispatch/alltoall_overlap.py); 1 is alltoall's order. Other
    # dispatchers ignore it.
    dispatch_chunks: int = 2

    def __post_init__(self) -> None:
        for field, choices in CHOICES.items():
            value = getattr(self, field)
            if not isinstance(value, str):
                raise BackendError(
                    f"BackendConfig.{field} must be a string, one of {list(choices)}; "
                    f"got {type(value).__name__} {value!r}"
                )
            if value not in choices:
                raise BackendError(f"unknown {field} backend {value!r}; choose one of {list(choices)}")
        if self.fused_ce != "auto" and not isinstance(self.fused_ce, bool):
            raise BackendError(f"BackendConfig.fused_ce must be True, False or 'auto'; got {self.fused_ce!r}")
        for flag in ("expert_recompute", "fp8"):
            if not isinstance(getattr(self, flag), bool):
                raise BackendError(f"BackendConfig.{flag} must be True or False; got {getattr(self, flag)!r}")
        chunks = self.dispatch_chunks
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise BackendError(
                "BackendConfig.dispatch_chunks must be an integer >= 1 (the token chunks of "
                f"dispatcher='alltoall_overlap', e.g. 2); got {chunks!r}"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackendConfig:
        """Build from a plain mapping, refusing unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise BackendError(f"unknown BackendConfig keys {sorted(unknown)}; known keys: {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping of every field."""
        return dataclasses.asdict(self)

    def is_resolved(self) -> bool:
        """Whether every implementation field names a concrete backend (no "auto" left)."""
        return all(getattr(self, field) != "auto" for field in CHOICES)

    def resolve(
        self,
        device: torch.device | str | Platform = "cpu",
        world_size: int = 1,
        fused_ce_support: tuple[bool, str] | None = None,
    ) -> BackendConfig:
        """The concrete backends for `device` (or a Platform): "auto" replaced, explicit choices checked.

        `fused_ce_support`: (whether the model can take the fused cross-entropy, why not), as
        `workbench.models.fused_ce.fused_ce_support(hf_config)` answers; fused_ce="auto" becomes that answer, and
        fused_ce=True where the model cannot is refused. None (the model is not known here): fused_ce stays as
        set, and the model build decides an "auto" one.
        """
        plat = _platform(device)  # detected once: every field is decided on the same facts
        # everything that is not an implementation choice (gate, the flags) passes through unchanged
        resolved: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name == "gate" or f.name not in CHOICES
        }
        if fused_ce_support is not None:
            resolved["fused_ce"] = self._fused_ce_for(fused_ce_support)
        for field in CHOICES:
            if field == "gate":
                continue
            value = getattr(self, field)
            if value == "auto":
                # every order ends in a choice that runs anywhere: auto always finds one
                value = pick_auto(field, lambda f, c: availability(f, c, plat, world_size), world_size, self.fp8)
            else:
                ok, why = availability(field, value, plat, world_size)
                if not ok:
                    raise BackendError(f"{field}={value!r} cannot run here: {why}")
            resolved[field] = value
        if self.fp8:
            ok, why = te_availability(plat, fp8=True)
            if not ok:
                raise BackendError(f"fp8=True cannot run here: {why}")
            if "te" not in (resolved["linear"], resolved["experts"]):
                raise BackendError(
                    "fp8=True runs the TransformerEngine GEMMs in FP8, but neither linear nor "
                    "experts resolved to 'te'; set linear='te' and/or experts='te'"
                )
        return BackendConfig(**resolved)

    def _fused_ce_for(self, support: tuple[bool, str]) -> bool:
        """fused_ce for a model that can (or cannot, and why) take the fused cross-entropy."""
        can, why = support
        if self.fused_ce is True and not can:
            raise BackendError(
                f"fused_ce=True cannot serve this model: {why}; set fused_ce='auto' (on wherever the model "
                "allows it) or False"
            )
        return can if self.fused_ce == "auto" else self.fused_ce
