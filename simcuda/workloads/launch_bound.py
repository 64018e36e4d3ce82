"""launch_bound, in Python: the same driver-call mix as launch_bound.c, reaching the driver only the
way PyTorch does, through dlopen("libcuda.so.1") and cuGetProcAddress_v2 (the one symbol looked up
by name). Each function is resolved on first use, and its calls are counted under the name dladdr
gives the returned pointer, so with --ptsz they appear as e.g. cuLaunchKernel_ptsz.

Prints one JSON line: {"workload", "mode": "dlopen", "ptsz", "cuda_version", "steps", "elapsed_s",
"calls": {exported name: count}, "check", "per_step"}. Options as launch_bound.c; run with
LD_LIBRARY_PATH from gputrace.simcuda.env(). Python 3.10+, standard library only.

--serve: the GPU benchmarks' job protocol (bench/gpu_jobs.py), so a benchmark harness can be tried
on simcuda: after set-up it prints `ready`, then answers each stdin line `run SECONDS [stamps]` with
{"steps", "seconds", "steps_per_s", "cpu_s", "t0"[, "stamps"]}, `gputime STEPS` with the simulated
kernels' time a step, and ends at `quit` (then the usual report).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import math
import os
import sys
import time
from ctypes import POINTER, byref, c_int, c_uint, c_ulonglong, c_void_p, c_size_t, c_char_p
from typing import Callable

CU_GET_PROC_ADDRESS_DEFAULT = 0
CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
N_ELEMS = 256
DEFAULT_LAUNCH_NS = 6000

# (base name, per-step count) in launch_bound.c's order; see that file for the origin of the mix.
MIX = [
    ("cuCtxGetDevice", 324),
    ("cuDevicePrimaryCtxGetState", 89),
    ("cuLaunchKernel", 21),
    ("cuCtxGetCurrent", 19),
    ("cuLaunchKernelEx", 14),
    ("cuOccupancyMaxActiveBlocksPerMultiprocessor", 4),
    ("cuKernelGetFunction", 4),
    ("cuDeviceGetAttribute", 4),
    ("cuMemcpyDtoDAsync", 1),
    ("cuStreamIsCapturing", 1),
]

CUdeviceptr = c_ulonglong
# Argument types per base name (all return CUresult).
SIGNATURES: dict[str, tuple] = {
    "cuInit": (c_uint,),
    "cuDeviceGet": (POINTER(c_int), c_int),
    "cuDeviceGetAttribute": (POINTER(c_int), c_int, c_int),
    "cuDevicePrimaryCtxRetain": (POINTER(c_void_p), c_int),
    "cuDevicePrimaryCtxRelease": (c_int,),
    "cuDevicePrimaryCtxGetState": (c_int, POINTER(c_uint), POINTER(c_int)),
    "cuCtxSetCurrent": (c_void_p,),
    "cuCtxGetCurrent": (POINTER(c_void_p),),
    "cuCtxGetDevice": (POINTER(c_int), c_void_p),  # the CUDA 13 signature (cuCtxGetDevice_v2)
    "cuModuleLoadData": (POINTER(c_void_p), c_char_p),
    "cuModuleGetFunction": (POINTER(c_void_p), c_void_p, c_char_p),
    "cuModuleUnload": (c_void_p,),
    "cuLibraryLoadData": (POINTER(c_void_p), c_char_p, c_void_p, c_void_p, c_uint, c_void_p, c_void_p, c_uint),
    "cuLibraryGetKernel": (POINTER(c_void_p), c_void_p, c_char_p),
    "cuLibraryUnload": (c_void_p,),
    "cuKernelGetFunction": (POINTER(c_void_p), c_void_p),
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": (POINTER(c_int), c_void_p, c_int, c_size_t),
    "cuLaunchKernel": (c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                       POINTER(c_void_p), POINTER(c_void_p)),
    "cuLaunchKernelEx": (c_void_p, c_void_p, POINTER(c_void_p), POINTER(c_void_p)),
    "cuStreamSynchronize": (c_void_p,),
    "cuStreamIsCapturing": (c_void_p, POINTER(c_int)),
    "cuMemAlloc": (POINTER(CUdeviceptr), c_size_t),
    "cuMemFree": (CUdeviceptr,),
    "cuMemsetD32": (CUdeviceptr, c_uint, c_size_t),
    "cuMemcpyDtoH": (c_void_p, CUdeviceptr, c_size_t),
    "cuMemcpyDtoDAsync": (CUdeviceptr, CUdeviceptr, c_size_t, c_void_p),
}


class CUlaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint),
        ("blockDimX", c_uint), ("blockDimY", c_uint), ("blockDimZ", c_uint),
        ("sharedMemBytes", c_uint), ("hStream", c_void_p), ("attrs", c_void_p), ("numAttrs", c_uint),
    ]


class DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", c_char_p), ("dli_fbase", c_void_p), ("dli_sname", c_char_p), ("dli_saddr", c_void_p)]


def _dladdr() -> Callable[[int], str]:
    for lib in (None, ctypes.util.find_library("dl")):
        try:
            fn = ctypes.CDLL(lib).dladdr
            break
        except (OSError, AttributeError):
            continue
    else:
        sys.exit("launch_bound.py: dladdr not found in libc or libdl")
    fn.argtypes = [c_void_p, POINTER(DlInfo)]
    fn.restype = c_int

    def name_of(addr: int) -> str:
        info = DlInfo()
        if not fn(addr, byref(info)) or not info.dli_sname or info.dli_saddr != addr:
            sys.exit(f"launch_bound.py: no exported symbol at {addr:#x}")
        return info.dli_sname.decode()

    return name_of


class Driver:
    """Driver entry points from cuGetProcAddress_v2, bound on first use, every call counted."""

    def __init__(self, cuda_version: int, ptsz: bool) -> None:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOW | os.RTLD_LOCAL)
        self._getproc = lib.cuGetProcAddress_v2  # the only symbol looked up by name
        self._getproc.argtypes = [c_char_p, POINTER(c_void_p), c_int, ctypes.c_uint64, POINTER(c_int)]
        self._getproc.restype = c_int
        self._version = cuda_version
        self._flags = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM if ptsz else CU_GET_PROC_ADDRESS_DEFAULT
        self._name_of = _dladdr()
        self._bound: dict[str, Callable[..., None]] = {}
        self.counts: dict[str, int] = {}
        self.names: dict[str, str] = {}

    def _bind(self, base: str) -> Callable[..., None]:
        pfn, status = c_void_p(), c_int(-1)
        self.counts["cuGetProcAddress_v2"] = self.counts.get("cuGetProcAddress_v2", 0) + 1
        r = self._getproc(base.encode(), byref(pfn), self._version, self._flags, byref(status))
        if r or not pfn.value:
            sys.exit(f"launch_bound.py: cuGetProcAddress_v2({base}) failed: CUresult {r}, status {status.value}")
        name = self._name_of(pfn.value)
        self.names[base] = name
        fn = ctypes.CFUNCTYPE(c_int, *SIGNATURES[base])(pfn.value)
        counts = self.counts

        def call(*args: object) -> None:
            counts[name] = counts.get(name, 0) + 1
            r = fn(*args)
            if r:
                sys.exit(f"launch_bound.py: {name} failed: CUresult {r}")

        self._bound[base] = call
        return call

    def __getattr__(self, base: str) -> Callable[..., None]:
        bound = self.__dict__.get("_bound", {})
        return bound[base] if base in bound else self._bind(base)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch_bound.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seconds", type=float, default=0.0, help="run for this long instead of --steps")
    p.add_argument("--kernel-ns", type=int, default=5000)
    p.add_argument("--launch-ns", type=int, default=None,
                   help=f"CPU busy-wait per launch (default: $SIMCUDA_LAUNCH_NS, else {DEFAULT_LAUNCH_NS})")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the per-step mix (rounded)")
    p.add_argument("--wait-stdin", action="store_true", help="read a line from stdin before the first driver call")
    p.add_argument("--ready-fd", type=int, default=-1, help='write "ready\\n" here once the driver is loaded')
    p.add_argument("--ptsz", action="store_true", help="ask for per-thread default stream entry points")
    p.add_argument("--dlopen", action="store_true", help="accepted for symmetry with the C workload (always so)")
    p.add_argument("--cuda-version", type=int, default=13000)
    p.add_argument("--serve", action="store_true", help="answer bench/gpu_jobs.py's protocol on stdin (see above)")
    p.add_argument("--hold", action="store_true",
                   help="hold point 1 after setup, 2 after teardown: print what the process holds as a JSON line "
                        "and wait for a line on stdin (as the C workloads' --hold)")
    a = p.parse_args(argv)
    if min(a.steps, a.kernel_ns, a.scale, a.seconds) < 0 or (a.launch_ns is not None and a.launch_ns < 0):
        p.error("numbers must be non-negative")
    return a


class Allocation(ctypes.Structure):
    _fields_ = [("base", c_ulonglong), ("size", c_ulonglong), ("kind", c_int), ("device", c_int),
                ("ctx", c_void_p), ("handle", c_ulonglong), ("offset", c_ulonglong), ("access", c_int),
                ("reserved", c_int)]


def hold(n: int, held: dict) -> None:
    """--hold: print {"hold": n, "allocations": [simcudaListAllocations], **held}; wait for a line."""
    lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOW | os.RTLD_LOCAL)
    fn = lib.simcudaListAllocations
    fn.argtypes = [POINTER(Allocation), c_int]
    fn.restype = c_int
    arr = (Allocation * max(fn(None, 0), 1))()
    count = fn(arr, len(arr))
    allocs = [{"kind": a.kind, "base": a.base, "size": a.size, "handle": a.handle, "offset": a.offset,
               "access": a.access} for a in arr[:count]]
    print(json.dumps({"hold": n, "allocations": allocs, **held}), flush=True)
    sys.stdin.readline()


def share(total: int, j: int, slots: int) -> int:
    return (j + 1) * total // slots - j * total // slots


def serve(one_step: Callable[[], None], kernel_s_per_step: float) -> int:
    """--serve: timed phases on request (bench/gpu_jobs.py's protocol); returns the steps made."""
    print("ready", flush=True)
    done = 0
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        if words[0] == "gputime":
            print(json.dumps({"steps": int(words[1]), "gpu_busy_s_per_step": kernel_s_per_step,
                              "gpu_sum_s_per_step": kernel_s_per_step, "simulated": True}), flush=True)
            continue
        seconds, stamps = float(words[1]), []
        n, c0, t0 = 0, sum(os.times()[:2]), time.monotonic()
        while True:
            one_step()
            n += 1
            now = time.monotonic()
            if "stamps" in words[2:]:
                stamps.append(round(now, 6))
            if now - t0 >= seconds:
                break
        out = {"steps": n, "seconds": now - t0, "steps_per_s": n / (now - t0), "cpu_s": sum(os.times()[:2]) - c0, "t0": t0}
        if stamps:
            out["stamps"] = stamps
        print(json.dumps(out), flush=True)
        done += n
    return done


def main(argv: list[str]) -> int:
    a = parse(argv)
    if a.launch_ns is not None:
        os.environ["SIMCUDA_LAUNCH_NS"] = str(a.launch_ns)
    elif not os.environ.get("SIMCUDA_LAUNCH_NS"):
        os.environ["SIMCUDA_LAUNCH_NS"] = str(DEFAULT_LAUNCH_NS)
    per = {base: math.floor(n * a.scale + 0.5) for base, n in MIX}
    launches = per["cuLaunchKernel"] + per["cuLaunchKernelEx"]
    slots = max(launches, 1)
    image = f"SIMCUDA-MODULE\nkernel inc inc_u32 {a.kernel_ns}\n".encode()

    cu = Driver(a.cuda_version, a.ptsz)
    if a.ready_fd >= 0:
        os.write(a.ready_fd, b"ready\n")
        os.close(a.ready_fd)
    if a.wait_stdin:
        sys.stdin.readline()
    t0 = time.monotonic()

    dev, ctx, mod, fn, f2, lib, kern = c_int(), c_void_p(), c_void_p(), c_void_p(), c_void_p(), c_void_p(), c_void_p()
    buf, buf2 = CUdeviceptr(), CUdeviceptr()
    cu.cuInit(0)
    cu.cuDeviceGet(byref(dev), 0)
    cu.cuDevicePrimaryCtxRetain(byref(ctx), dev)
    cu.cuCtxSetCurrent(ctx)
    cu.cuModuleLoadData(byref(mod), image)
    cu.cuModuleGetFunction(byref(fn), mod, b"inc")
    cu.cuLibraryLoadData(byref(lib), image, None, None, 0, None, None, 0)
    cu.cuLibraryGetKernel(byref(kern), lib, b"inc")
    cu.cuMemAlloc(byref(buf), N_ELEMS * 4)
    cu.cuMemAlloc(byref(buf2), N_ELEMS * 4)
    cu.cuMemsetD32(buf, 0, N_ELEMS)
    if a.hold:
        hold(1, {"contexts": [ctx.value], "modules": [mod.value], "libraries": [lib.value], "streams": [],
                 "events": []})

    stream = None
    n = c_ulonglong(N_ELEMS)
    params = (c_void_p * 2)(ctypes.addressof(buf), ctypes.addressof(n))
    lc = CUlaunchConfig(1, 1, 1, 256, 1, 1, 0, stream, None, 0)
    d, c, flags, active, v, cs = c_int(), c_void_p(), c_uint(), c_int(), c_int(), c_int()
    order = [  # (base, call) in the C workload's order within a slot
        ("cuCtxGetDevice", lambda: cu.cuCtxGetDevice(byref(d), None)),
        ("cuDevicePrimaryCtxGetState", lambda: cu.cuDevicePrimaryCtxGetState(dev, byref(flags), byref(active))),
        ("cuCtxGetCurrent", lambda: cu.cuCtxGetCurrent(byref(c))),
        ("cuDeviceGetAttribute", lambda: cu.cuDeviceGetAttribute(byref(v), CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)),
        ("cuKernelGetFunction", lambda: cu.cuKernelGetFunction(byref(f2), kern)),
        ("cuOccupancyMaxActiveBlocksPerMultiprocessor",
         lambda: cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(byref(v), fn, 256, 0)),
        ("cuStreamIsCapturing", lambda: cu.cuStreamIsCapturing(stream, byref(cs))),
        ("cuLaunchKernel", lambda: cu.cuLaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, stream, params, None)),
        ("cuLaunchKernelEx", lambda: cu.cuLaunchKernelEx(byref(lc), fn, params, None)),
        ("cuMemcpyDtoDAsync", lambda: cu.cuMemcpyDtoDAsync(buf2, buf, N_ELEMS * 4, stream)),
    ]
    plan = [[(call, share(per[base], j, slots)) for base, call in order] for j in range(slots)]

    def one_step() -> None:
        for slot in plan:
            for call, k in slot:
                for _ in range(k):
                    call()
        cu.cuStreamSynchronize(stream)

    step = 0
    if a.serve:
        step = serve(one_step, launches * a.kernel_ns * 1e-9)
    while not a.serve and ((step == 0 or time.monotonic() - t0 < a.seconds) if a.seconds > 0 else step < a.steps):
        one_step()
        step += 1

    host = (c_uint * N_ELEMS)()
    cu.cuMemcpyDtoH(host, buf, ctypes.sizeof(host))
    ok = all(x == step * launches for x in host)
    cu.cuMemFree(buf)
    cu.cuMemFree(buf2)
    cu.cuLibraryUnload(lib)
    cu.cuModuleUnload(mod)
    cu.cuDevicePrimaryCtxRelease(dev)
    if a.hold:
        hold(2, {"contexts": [], "modules": [], "libraries": [], "streams": [], "events": []})

    per_step = {cu.names.get(base, base): k for base, k in per.items()}
    per_step[cu.names["cuStreamSynchronize"]] = 1
    report = {
        "workload": "launch_bound_py", "mode": "dlopen", "ptsz": a.ptsz, "cuda_version": a.cuda_version,
        "steps": step, "elapsed_s": round(time.monotonic() - t0, 6),
        "calls": {k: v for k, v in cu.counts.items() if v}, "check": "ok" if ok else "mismatch", "per_step": per_step,
    }
    print(json.dumps(report), flush=True)
    if not ok:
        print(f"launch_bound.py: device buffer is {host[0]}, expected {step * launches}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
