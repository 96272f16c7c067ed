"""GPU inventory through NVML (nvidia-ml-py); an explicit empty answer where there is none."""

from __future__ import annotations

from typing import Any


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


NO_GPU = "No NVIDIA GPU on this machine"


def _none(reason: str, detail: str | None) -> dict:
    """No GPUs: `reason` in plain words for the sidebar, `detail` the raw error for a detail line."""
    return {"available": False, "reason": reason, "detail": detail, "gpus": []}


def _init_failure(pynvml: Any, err: Exception) -> dict:
    """Why NVML did not start, said plainly: no driver library is a machine without NVIDIA GPUs."""
    raw = f"NVML could not start: {err}"
    if isinstance(err, getattr(pynvml, "NVMLError_LibraryNotFound", ())):
        return _none(NO_GPU, f"{raw} (no NVIDIA driver library is installed)")
    if isinstance(err, getattr(pynvml, "NVMLError_DriverNotLoaded", ())):
        return _none(f"{NO_GPU} that the driver can see (the NVIDIA driver is not loaded)", raw)
    if isinstance(err, getattr(pynvml, "NVMLError_NoPermission", ())):
        return _none("NVIDIA GPUs cannot be read: no permission", raw)
    return _none("NVIDIA GPUs cannot be read: the driver did not answer", raw)


def gpu_snapshot() -> dict:
    """{"available", "reason" (plain words or None), "detail" (the raw error), "gpus"}; never raises."""
    try:
        import pynvml
    except ImportError as err:
        return _none("GPU monitoring is off: the nvidia-ml-py package is not installed", str(err))
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return _init_failure(pynvml, err)
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = [_one_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as err:
        return _none("NVIDIA GPUs cannot be read: the driver did not answer", f"NVML query failed: {err}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    if not gpus:
        return {**_none(NO_GPU, f"NVIDIA driver {driver} reports no GPUs"), "driver": driver}
    return {"available": True, "reason": None, "detail": None, "driver": driver, "gpus": gpus}


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
