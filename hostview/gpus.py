"""GPUs with utilization and memory, through NVML (libnvidia-ml, ctypes) where a driver is present.

Loaded lazily and once; where there is no NVML the header says so instead of showing nothing.
"""

from __future__ import annotations

import ctypes
import functools

from .model import Gpu


class _Util(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Mem(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


@functools.lru_cache(maxsize=1)
def _nvml() -> tuple[object | None, str]:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None, "no NVIDIA driver here (libnvidia-ml.so.1 not found)"
    if lib.nvmlInit_v2() != 0:
        return None, "NVML did not initialise (driver not loaded?)"
    return lib, ""


def read_gpus() -> tuple[tuple[Gpu, ...], str]:
    """(GPUs, note): the note says why the tuple is empty."""
    lib, note = _nvml()
    if lib is None:
        return (), note
    n = ctypes.c_uint()
    if lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) != 0:
        return (), "NVML could not count the GPUs"
    out = []
    for i in range(n.value):
        h = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) != 0:
            continue
        name = ctypes.create_string_buffer(96)
        lib.nvmlDeviceGetName(h, name, 96)
        util, mem = _Util(), _Mem()
        u = float(util.gpu) if lib.nvmlDeviceGetUtilizationRates(h, ctypes.byref(util)) == 0 else None
        ok = lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(mem)) == 0
        out.append(Gpu(i, name.value.decode(errors="replace"), u, mem.used if ok else None, mem.total if ok else None))
    return tuple(out), "" if out else "NVML reports no GPUs"
