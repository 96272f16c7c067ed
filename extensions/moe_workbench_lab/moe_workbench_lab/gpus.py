"""GPU inventory through NVML (nvidia-ml-py); an explicit empty answer where there is none."""

from __future__ import annotations

from typing import Any


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpu_snapshot() -> dict:
    """{"available": bool, "reason": str | None, "gpus": [per-GPU dict]}; never raises."""
    try:
        import pynvml
    except ImportError as err:
        return {"available": False, "reason": f"nvidia-ml-py is not installed ({err})", "gpus": []}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        # The usual case on CPU-only machines: no driver library, or no devices.
        return {"available": False, "reason": f"NVML could not start: {err}", "gpus": []}
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = [_one_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as err:
        return {"available": False, "reason": f"NVML query failed: {err}", "gpus": []}
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    reason = None if gpus else "NVML reports no GPUs"
    return {"available": bool(gpus), "reason": reason, "driver": driver, "gpus": gpus}


def _one_gpu(pynvml: Any, index: int) -> dict:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    gpu = {
        "index": index,
        "name": _text(pynvml.nvmlDeviceGetName(handle)),
        "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
        "memory_used_bytes": int(memory.used),
        "memory_total_bytes": int(memory.total),
        "utilization_pct": None,
        "temperature_c": None,
        "power_w": None,
    }
    # Some fields are unsupported on some devices/MIG slices: report None, not an error.
    try:
        gpu["utilization_pct"] = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError:
        pass
    try:
        gpu["temperature_c"] = int(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    except pynvml.NVMLError:
        pass
    try:
        gpu["power_w"] = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
    except pynvml.NVMLError:
        pass
    return gpu
