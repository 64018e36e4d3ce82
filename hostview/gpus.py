"""The host's GPUs, with utilization, memory and the processes on each, through NVML (nvidia-ml-py's
`pynvml`) where a driver is present.

Initialised lazily and once; where there is no NVML the frame says why instead of showing nothing.
A figure NVML does not give for a device (utilization on some MIG or vGPU setups, a process's memory
where the driver hides it) is None, never 0.
"""

from __future__ import annotations

import functools

from .model import Gpu


@functools.lru_cache(maxsize=1)
def _nvml():
    """(the pynvml module, initialised; or None) and why not."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, ("no NVIDIA driver here (libnvidia-ml.so.1 not found)"
                      if isinstance(exc, pynvml.NVMLError_LibraryNotFound) else f"NVML did not initialise: {exc}")
    return pynvml, ""


def _or_none(nv, fn, *args):
    try:
        return fn(*args)
    except nv.NVMLError:
        return None


def _processes(nv, h) -> tuple[tuple[int, int | None], ...]:
    """(pid, bytes of this GPU's memory it holds) for every compute process on the device."""
    procs = _or_none(nv, nv.nvmlDeviceGetComputeRunningProcesses, h) or []
    out = {}
    for p in procs:
        used = getattr(p, "usedGpuMemory", None)
        out[int(p.pid)] = None if used is None or used == getattr(nv, "NVML_VALUE_NOT_AVAILABLE", -1) else int(used)
    return tuple(sorted(out.items()))


def read_gpus() -> tuple[tuple[Gpu, ...], str]:
    """(GPUs, note): the note says why the tuple is empty."""
    nv, note = _nvml()
    if nv is None:
        return (), note
    n = _or_none(nv, nv.nvmlDeviceGetCount)
    if n is None:
        return (), "NVML could not count the GPUs"
    out = []
    for i in range(n):
        h = _or_none(nv, nv.nvmlDeviceGetHandleByIndex, i)
        if h is None:
            continue
        name = _or_none(nv, nv.nvmlDeviceGetName, h) or "?"
        util = _or_none(nv, nv.nvmlDeviceGetUtilizationRates, h)
        mem = _or_none(nv, nv.nvmlDeviceGetMemoryInfo, h)
        out.append(Gpu(i, name.decode(errors="replace") if isinstance(name, bytes) else name,
                       float(util.gpu) if util is not None else None,
                       int(mem.used) if mem is not None else None, int(mem.total) if mem is not None else None,
                       _processes(nv, h)))
    return tuple(out), "" if out else "NVML reports no GPUs"
