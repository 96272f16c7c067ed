"""The GPU's SM clock, power draw and power-cap throttling while a bench variant's timed steps run (NVML).

Why the bench records them: on the H200 the engine's Qwen3-30B-A3B step draws the board's power limit and its SM
clock falls to ~1,500-1,800 MHz (NVML's software power cap active in ~all samples), while Transformers' slower step
runs at ~1,950 MHz under the same limit (2026-12-04, nvidia-smi at 250 ms). A speed ratio is then a ratio at
different clocks: the rows say which. NVML comes from `nvidia-ml-py` (the `gpu` extra); without it, or without an
NVIDIA driver, nothing is sampled and the rows say why. The board's energy counter over the same window gives joules
per step (energy is what a power-capped board rations). The window opens when the first timed step is queued and
closes when the last one is read back, so it can hold the tail of a warm-up step the device was still running.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

# nvmlClocksEventReasons bits (nvml.h; pynvml's nvmlClocksEventReason* constants): what holds the SM clock down
POWER_CAP_REASONS = 0x4 | 0x80  # SwPowerCap, HwPowerBrakeSlowdown
THERMAL_REASONS = 0x20 | 0x40 | 0x8  # SwThermalSlowdown, HwThermalSlowdown, HwSlowdown


@dataclass(frozen=True)
class ClockSample:
    """One NVML reading: host time (s), SM clock (MHz), board power (W), the clock-event reasons bitmask."""

    t: float
    sm_mhz: int
    power_w: float
    reasons: int


def summarize(samples: list[ClockSample], limits: dict[str, float] | None = None) -> dict[str, Any] | None:
    """Mean / min SM clock, mean power and the share of samples held by the power cap or heat; None if empty."""
    if not samples:
        return None
    n = len(samples)
    return {
        "samples": n,
        "sm_clock_mhz_mean": sum(s.sm_mhz for s in samples) / n,
        "sm_clock_mhz_min": min(s.sm_mhz for s in samples),
        "power_w_mean": sum(s.power_w for s in samples) / n,
        "power_capped_share": sum(1 for s in samples if s.reasons & POWER_CAP_REASONS) / n,
        "thermal_share": sum(1 for s in samples if s.reasons & THERMAL_REASONS) / n,
        **(limits or {}),
    }


def merge(summaries: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One variant's summary over its rounds, weighted by their samples (rounds without samples left out)."""
    parts = [s for s in summaries if s]
    if not parts:
        return None
    n = sum(s["samples"] for s in parts)
    out = {k: v for k, v in parts[0].items() if k not in ("samples",)}
    for key in ("sm_clock_mhz_mean", "power_w_mean", "power_capped_share", "thermal_share"):
        out[key] = sum(s[key] * s["samples"] for s in parts) / n
    out["sm_clock_mhz_min"] = min(s["sm_clock_mhz_min"] for s in parts)
    out["samples"] = n
    if all("energy_j" in s for s in parts):  # the board's energy counter over every round's window
        out["energy_j"] = sum(s["energy_j"] for s in parts)
        out["window_s"] = sum(s["window_s"] for s in parts)
    else:
        out.pop("energy_j", None)
        out.pop("window_s", None)
    return out


def _nvml_handle(device: torch.device):
    """(pynvml, handle, limits) for `device`, or (None, reason, {}) where NVML cannot read it."""
    if device.type != "cuda":
        return None, "not a CUDA device", {}
    try:
        import pynvml
    except ImportError:
        return None, "NVML bindings not installed (pip install nvidia-ml-py, or the moe-workbench[gpu] extra)", {}
    try:
        pynvml.nvmlInit()
        # torch's own mapping of a CUDA device to NVML's index (CUDA_VISIBLE_DEVICES and UUIDs included)
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))
        limits = {
            "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3,
            "sm_clock_mhz_max": pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
        }
    except Exception as err:  # noqa: BLE001 - NVML errors are many classes; the row only says why
        return None, f"NVML: {type(err).__name__}: {err}", {}
    return pynvml, handle, limits


class ClockSampler:
    """Samples `device` every `period_s` on a daemon thread between `start()` and `stop()` (a no-op without NVML)."""

    def __init__(self, device: torch.device, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self._nvml, self._handle, self._limits = _nvml_handle(device)
        self.unavailable = None if self._nvml is not None else self._handle
        self._samples: list[ClockSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._window: tuple[float, int | None] = (0.0, None)

    def _read(self) -> ClockSample:
        nvml, h = self._nvml, self._handle
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = reasons or nvml.nvmlDeviceGetCurrentClocksThrottleReasons  # its name before NVML 12.2
        return ClockSample(
            time.monotonic(),
            nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
            nvml.nvmlDeviceGetPowerUsage(h) / 1e3,
            int(reasons(h)),
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._samples.append(self._read())
            except Exception as err:  # noqa: BLE001 - a failing read ends sampling; the summary says so
                self.unavailable = f"NVML read failed: {type(err).__name__}: {err}"
                return
            self._stop.wait(self.period_s)

    def _energy_mj(self) -> int | None:
        # the board's energy since the driver loaded (mJ, Volta and later): energy per step under a power cap,
        # where time alone hides what the clock gave up
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception:  # noqa: BLE001 - a board without the counter: no energy, the rest stands
            return None

    def start(self) -> None:
        """Start sampling (again: earlier samples are dropped)."""
        if self._nvml is None or self._thread is not None:
            return
        self._window = (time.monotonic(), self._energy_mj())
        self._samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="workbench-clocks", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any] | None:
        """Stop sampling; the summary of the samples (None without NVML or samples)."""
        if self._thread is None:
            return summarize(self._samples, self._limits)
        self._stop.set()
        self._thread.join()
        self._thread = None
        summary = summarize(self._samples, self._limits)
        (t0, e0), e1 = self._window, self._energy_mj()
        if summary is not None and e0 is not None and e1 is not None:
            summary.update(energy_j=(e1 - e0) / 1e3, window_s=time.monotonic() - t0)
        return summary
