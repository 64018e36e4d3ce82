"""simcuda: a simulated CUDA driver and workloads for tests that need no GPU.

`driver_dir()` builds `libcuda.so.1` (real driver API names and signatures, device memory in host
memory, kernels as builtin host functions run by one worker thread per stream) and returns the
directory to put first on LD_LIBRARY_PATH; `env()` does that for a child's environment and
`workload(name)` gives the argv prefix of a built workload. Everything is compiled once per source
hash through gputrace.base.native.build.

Knobs (environment, read at cuInit): SIMCUDA_KERNEL_NS overrides every kernel's duration,
SIMCUDA_LAUNCH_NS makes each launch busy-wait that long on the caller's CPU, SIMCUDA_MEM_BYTES sets
device memory (default 16 GiB), SIMCUDA_DEVICES the device count (default 1), SIMCUDA_FAIL_COPY_BYTES
makes every asynchronous copy of exactly that many bytes fail with CUDA_ERROR_ILLEGAL_ADDRESS (to test
how callers handle driver errors), SIMCUDA_DEVICE=SOCKET device mode: device memory held by a
simcuda-device daemon outside the process, as on a GPU (simcuda/device.py starts one),
SIMCUDA_GROUP=ID:NRANKS:RANK makes the process a rank of a group: its allreduce_u32 kernels complete
only once every rank has run its matching one, as NCCL's do (the `collective` workload sets it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

from gputrace.base.native import build

__all__ = [
    "BUILTIN_KERNELS", "WORKLOADS", "driver_dir", "env", "library_path", "module_image", "workload",
]

_HERE = Path(__file__).resolve().parent
_WORKLOADS_DIR = _HERE / "workloads"
_HEADERS = (_HERE / "cuda.h", _HERE / "simcuda.h")

#: Builtin kernels a module image may name, with their parameters (packed at natural alignment).
BUILTIN_KERNELS: Mapping[str, str] = {
    "spin": "()",
    "fill_u32": "(u32 *dst, u32 value, u64 n)",
    "add_f32": "(f32 *a, f32 *b, f32 *out, u64 n)",
    "scale_f32": "(f32 *x, f32 alpha, u64 n)",
    "inc_u32": "(u32 *p, u64 n)",
    "sum_u32": "(u32 *src, u64 n, u64 *out)",
    "lcg_u32": "(u32 *x, u32 add, u64 n)",
    # A collective: completes once every rank of the process's SIMCUDA_GROUP has run its matching one.
    "allreduce_u32": "(u32 *buf, u64 n)",
}

#: Workload names accepted by workload(): the C programs, and the Python ctypes one.
WORKLOADS = ("launch_bound", "gpu_bound", "alloc_free", "pattern", "train", "phases", "collective", "worker",
             "launch_bound_py")


def library_path() -> Path:
    """The built simulated driver, `.../libcuda.so.1` (soname libcuda.so.1)."""
    return build(
        "libcuda.so.1",
        [_HERE / "libcuda.c"],
        shared=True,
        soname="libcuda.so.1",
        # -fno-ipa-icf: identical wrappers (cuX and cuX_v2) must keep distinct addresses, or a
        # uprobe on one would count calls to the other.
        cflags=["-fvisibility=hidden", "-fno-ipa-icf", "-pthread"],
        ldflags=["-pthread"],
        headers=_HEADERS,
    )


def driver_dir() -> Path:
    """Directory holding libcuda.so.1 and a libcuda.so symlink (for -lcuda at link time)."""
    lib = library_path()
    link = lib.parent / "libcuda.so"
    if not link.is_symlink():
        tmp = lib.parent / f".libcuda.so.{os.getpid()}"
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        os.symlink(lib.name, tmp)
        os.replace(tmp, link)  # atomic: a concurrent builder sees the old link or the new one
    return lib.parent


def env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` (default os.environ) with driver_dir() first on LD_LIBRARY_PATH."""
    out = dict(os.environ if base is None else base)
    parts = [str(driver_dir())] + [p for p in out.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    out["LD_LIBRARY_PATH"] = os.pathsep.join(parts)
    return out


def workload(name: str) -> list[str]:
    """The argv prefix that runs workload `name` (run it with env(), so libcuda.so.1 resolves)."""
    if name == "launch_bound_py":
        return [sys.executable, str(_WORKLOADS_DIR / "launch_bound.py")]
    if name not in WORKLOADS:
        raise ValueError(f"unknown simcuda workload {name!r}; known: {', '.join(WORKLOADS)}")
    ddir = driver_dir()
    exe = build(
        name,
        [_WORKLOADS_DIR / f"{name}.c"],
        cflags=[f"-I{_HERE}", "-pthread"],
        # No rpath on purpose: the driver is found through LD_LIBRARY_PATH, as a real one would be.
        # The driver's directory is part of the build hash, so a changed driver relinks these.
        ldflags=[f"-L{ddir}", "-lcuda", "-ldl", "-lm", "-pthread"],
        headers=(*_HEADERS, _HERE / "workload.h"),
    )
    return [str(exe)]


def module_image(kernels: Mapping[str, tuple[str, int]]) -> bytes:
    """A module image for cuModuleLoadData/cuLibraryLoadData: {name: (builtin, duration_ns)},
    NUL-terminated."""
    lines = ["SIMCUDA-MODULE"]
    for name, (builtin, ns) in kernels.items():
        if builtin not in BUILTIN_KERNELS:
            raise ValueError(f"unknown builtin kernel {builtin!r}")
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"kernel name {name!r} must be non-empty without whitespace")
        lines.append(f"kernel {name} {builtin} {int(ns)}")
    return ("\n".join(lines) + "\n").encode() + b"\0"
