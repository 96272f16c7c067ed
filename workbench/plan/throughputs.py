"""The throughputs a step-time prediction divides by: from the datasheet, or measured on this GPU.

Datasheet-derived (the default): each figure is the GPU's datasheet peak (workbench/plan/gpus.py) times an
efficiency the measured training steps of the README's Performance section and the 48-layer LoRA rows fit
(benchmarks/results/plan-vs-measured.json, tests/test_plan_measured.py):
    dense GEMM          DENSE_EFFICIENCY x bf16 peak
    grouped GEMM        GROUPED_EFFICIENCY by rows per expert (interpolated in log rows)
    attention           ATTENTION_EFFICIENCY by sequence length (flash attention, forward + backward)
    memory-bound        MEMORY_EFFICIENCY x bandwidth (norms, activations, AdamW)
    hybrid mixers       MIXER_EFFICIENCY[kind] x bf16 peak (Mamba2's scan, the gated delta rule: not GEMMs)
Measured (`workbench bench --calibrate`, workbench/bench/calibrate.py): the same figures timed on one GPU, saved as
JSON per GPU name under the user's cache folder (calibration_dir); a plan for that GPU kind uses the file and says so,
its compute figures times IN_STEP_CLOCK (kernels timed alone run at a clock a whole step does not keep).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from workbench.plan.gpus import GPUS

DENSE_EFFICIENCY = 0.62
GROUPED_EFFICIENCY = ((16, 0.08), (64, 0.25), (256, 0.45), (1024, 0.58), (4096, 0.62))
ATTENTION_EFFICIENCY = ((512, 0.25), (2048, 0.38), (8192, 0.45), (32768, 0.47))
MEMORY_EFFICIENCY = 0.85
# The engine's chunked mixers as they run today (compiled torch ops), fit to Nemotron 3 Nano L8 and Qwen3.5 L4 / L8 at
# 4096 tokens on an H100 (2026-12-06): Mamba2's scan ~12 TFLOP/s of its FLOPs, the gated delta rule ~1.75 (a Python
# walk of 64 chunk steps a layer: latency, not arithmetic; `workbench bench --calibrate` timed 10.3 and 0.66)
MIXER_EFFICIENCY = {"mamba2": 0.0124, "gated_deltanet": 0.00177}
# Host time per decoder layer and pass (forward, backward, a recompute) that the GPU work of a layer must cover, or the
# step waits for the launches: Python and autograd's share of ~150 launches per layer
HOST_MS_PER_LAYER = 0.9
HOST_MS_PER_ADAPTER = 0.1  # each LoRA adapter adds its A, B and scaling launches to its layer's pass
CALIBRATION_SCHEMA = "workbench.calibration/1"
# What a kernel timed alone keeps inside a whole training step: the calibration times short bursts at the boost clock,
# a step of an H200 runs power-capped at ~1,700 of ~1,980 MHz (README, Performance: the SM clock column)
IN_STEP_CLOCK = 0.86


@dataclass(frozen=True)
class Throughputs:
    """What one GPU sustains, in the units the step time divides by."""

    gpu: str  # the kind (GPUS key)
    source: str  # "datasheet <kind>" or "calibration <path>"
    dense_tflops: float
    grouped_tflops: tuple[tuple[float, float], ...]  # (rows per expert, TFLOP/s), rows ascending
    attention_tflops: tuple[tuple[float, float], ...]  # (sequence length, TFLOP/s), ascending
    memory_gbps: float
    mixer_tflops: tuple[tuple[str, float], ...]  # ("mamba2" | "gated_deltanet", TFLOP/s)
    link_gbps: float
    host_ms_per_layer: float = HOST_MS_PER_LAYER
    host_ms_per_adapter: float = HOST_MS_PER_ADAPTER

    def grouped(self, rows_per_expert: float) -> float:
        return _interpolate(self.grouped_tflops, rows_per_expert)

    def attention(self, seq_len: float) -> float:
        return _interpolate(self.attention_tflops, seq_len)

    def mixer(self, kind: str) -> float:
        # a kind neither the datasheet figures nor a calibration names: the slowest known, as a plan should err
        efficiency = MIXER_EFFICIENCY.get(kind, min(MIXER_EFFICIENCY.values()))
        return dict(self.mixer_tflops).get(kind, self.dense_tflops * efficiency / DENSE_EFFICIENCY)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Linear in log x between the measured points, flat beyond the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return points[-1][1]


def datasheet_throughputs(kind: str) -> Throughputs:
    """The datasheet-derived figures of a GPU kind (module docstring)."""
    spec = GPUS[kind]
    peak = spec.bf16_tflops
    return Throughputs(
        gpu=kind,
        source=f"datasheet {kind}",
        dense_tflops=DENSE_EFFICIENCY * peak,
        grouped_tflops=tuple((rows, eff * peak) for rows, eff in GROUPED_EFFICIENCY),
        attention_tflops=tuple((seq, eff * peak) for seq, eff in ATTENTION_EFFICIENCY),
        memory_gbps=MEMORY_EFFICIENCY * spec.memory_gbps,
        mixer_tflops=tuple((kind, eff * peak) for kind, eff in MIXER_EFFICIENCY.items()),
        link_gbps=spec.link_gbps,
    )


def calibration_dir() -> Path:
    """Where `workbench bench --calibrate` saves and the plan looks: $WORKBENCH_CALIBRATION_DIR, else
    $XDG_CACHE_HOME/workbench/calibration, else ~/.cache/workbench/calibration."""
    own = os.environ.get("WORKBENCH_CALIBRATION_DIR")
    if own:
        return Path(own).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "workbench" / "calibration"


def calibration_file_name(device_name: str) -> str:
    """The file one GPU's calibration is saved as ("NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3.json")."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + ".json"


def _pairs(value: Any, name: str) -> tuple[tuple[float, float], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be a non-empty list of [x, TFLOP/s] pairs")
    pairs = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(v, (int, float)) for v in item)):
            raise ValueError(f"{name} holds {item!r}, not an [x, TFLOP/s] pair")
        if item[0] <= 0 or item[1] <= 0:
            raise ValueError(f"{name} holds {item!r}: both numbers must be > 0")
        pairs.append((float(item[0]), float(item[1])))
    return tuple(sorted(pairs))


def throughputs_from_calibration(data: dict[str, Any], path: Path) -> Throughputs:
    """A calibration file's figures (what workbench.bench.calibrate writes); ValueError saying what is wrong."""
    if data.get("schema") != CALIBRATION_SCHEMA:
        raise ValueError(f"schema is {data.get('schema')!r}, not {CALIBRATION_SCHEMA!r}")
    kind = data.get("kind")
    if kind not in GPUS:
        raise ValueError(f"kind {kind!r} is not one of {sorted(GPUS)}")
    for name in ("dense_tflops", "memory_gbps"):
        if not isinstance(data.get(name), (int, float)) or data[name] <= 0:
            raise ValueError(f"{name} must be a number > 0, got {data.get(name)!r}")
    mixers = data.get("mixer_tflops") or {}
    if not isinstance(mixers, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in mixers.values()):
        raise ValueError("mixer_tflops must map mixer names to numbers > 0")
    return Throughputs(
        gpu=kind,
        source=f"calibration {path}",
        dense_tflops=IN_STEP_CLOCK * float(data["dense_tflops"]),
        grouped_tflops=tuple((x, IN_STEP_CLOCK * y) for x, y in _pairs(data.get("grouped_tflops"), "grouped_tflops")),
        attention_tflops=tuple(
            (x, IN_STEP_CLOCK * y) for x, y in _pairs(data.get("attention_tflops"), "attention_tflops")
        ),
        memory_gbps=float(data["memory_gbps"]),
        mixer_tflops=tuple(sorted((str(k), IN_STEP_CLOCK * float(v)) for k, v in mixers.items())),
        link_gbps=GPUS[kind].link_gbps,
    )


def find_throughputs(kind: str, device_name: str | None = None, folder: Path | None = None) -> tuple[Throughputs, str]:
    """The calibration for this GPU (its exact name's file first, else any file of the same kind), else the
    datasheet's; and a note when a file was there but could not be used."""
    folder = calibration_dir() if folder is None else folder
    candidates: list[Path] = []
    if device_name:
        candidates.append(folder / calibration_file_name(device_name))
    if folder.is_dir():
        candidates += sorted(p for p in folder.glob("*.json") if p not in candidates)
    notes = []
    for path in candidates:
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            found = throughputs_from_calibration(data, path)
        except (OSError, ValueError) as err:
            notes.append(f"calibration {path} not used ({err}; run `workbench bench --calibrate` again)")
            continue
        if found.gpu == kind:
            return found, "; ".join(notes)
    return datasheet_throughputs(kind), "; ".join(notes)
