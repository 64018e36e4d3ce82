"""simcuda, the simulated CUDA driver: its API through ctypes, and its workloads' call counts."""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import subprocess
import sys
import threading
import time
from ctypes import POINTER, byref, c_char_p, c_float, c_int, c_size_t, c_uint, c_uint64, c_ulonglong, c_void_p
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from gputrace import simcuda

SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, NOT_INITIALIZED = 0, 1, 2, 3
INVALID_DEVICE, INVALID_IMAGE, INVALID_CONTEXT, FILE_NOT_FOUND = 101, 200, 201, 301
INVALID_HANDLE, NOT_FOUND, NOT_READY, NOT_SUPPORTED = 400, 500, 600, 801
PER_THREAD = 2
MB = 1 << 20

CUdeviceptr = c_ulonglong
P = POINTER


class MemProp(ctypes.Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("loc_type", c_int), ("loc_id", c_int),
                ("win32", c_void_p), ("flags", ctypes.c_ubyte * 8)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("loc_type", c_int), ("loc_id", c_int), ("flags", c_int)]


class Allocation(ctypes.Structure):
    _fields_ = [("base", c_ulonglong), ("size", c_ulonglong), ("kind", c_int), ("device", c_int),
                ("ctx", c_void_p), ("handle", c_ulonglong), ("offset", c_ulonglong), ("access", c_int),
                ("reserved", c_int)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", c_uint), ("gridDimY", c_uint), ("gridDimZ", c_uint), ("blockDimX", c_uint),
                ("blockDimY", c_uint), ("blockDimZ", c_uint), ("sharedMemBytes", c_uint), ("hStream", c_void_p),
                ("attrs", c_void_p), ("numAttrs", c_uint)]


LAUNCH = [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p, P(c_void_p), P(c_void_p)]
SIGNATURES: dict[str, list] = {
    "cuInit": [c_uint],
    "cuDriverGetVersion": [P(c_int)],
    "cuGetErrorName": [c_int, P(c_char_p)],
    "cuGetErrorString": [c_int, P(c_char_p)],
    "cuGetProcAddress": [c_char_p, P(c_void_p), c_int, c_uint64],
    "cuGetProcAddress_v2": [c_char_p, P(c_void_p), c_int, c_uint64, P(c_int)],
    "cuGetExportTable": [P(c_void_p), c_void_p],
    "cuDeviceGet": [P(c_int), c_int],
    "cuDeviceGetCount": [P(c_int)],
    "cuDeviceGetName": [c_char_p, c_int, c_int],
    "cuDeviceGetAttribute": [P(c_int), c_int, c_int],
    "cuDeviceTotalMem_v2": [P(c_size_t), c_int],
    "cuDeviceGetUuid_v2": [c_char_p, c_int],
    "cuDevicePrimaryCtxRetain": [P(c_void_p), c_int],
    "cuDevicePrimaryCtxGetState": [c_int, P(c_uint), P(c_int)],
    "cuCtxCreate_v2": [P(c_void_p), c_uint, c_int],
    "cuCtxDestroy_v2": [c_void_p],
    "cuCtxGetCurrent": [P(c_void_p)],
    "cuCtxSetCurrent": [c_void_p],
    "cuCtxPushCurrent_v2": [c_void_p],
    "cuCtxPopCurrent_v2": [P(c_void_p)],
    "cuCtxGetDevice": [P(c_int)],
    "cuCtxGetDevice_v2": [P(c_int), c_void_p],
    "cuCtxSynchronize": [],
    "cuMemAlloc_v2": [P(CUdeviceptr), c_size_t],
    "cuMemFree_v2": [CUdeviceptr],
    "cuMemAllocPitch_v2": [P(CUdeviceptr), P(c_size_t), c_size_t, c_size_t, c_uint],
    "cuMemAllocHost_v2": [P(c_void_p), c_size_t],
    "cuMemFreeHost": [c_void_p],
    "cuMemAllocAsync": [P(CUdeviceptr), c_size_t, c_void_p],
    "cuMemFreeAsync": [CUdeviceptr, c_void_p],
    "cuMemGetInfo_v2": [P(c_size_t), P(c_size_t)],
    "cuMemcpyHtoD_v2": [CUdeviceptr, c_void_p, c_size_t],
    "cuMemcpyDtoH_v2": [c_void_p, CUdeviceptr, c_size_t],
    "cuMemcpyDtoD_v2": [CUdeviceptr, CUdeviceptr, c_size_t],
    "cuMemcpyHtoDAsync_v2": [CUdeviceptr, c_void_p, c_size_t, c_void_p],
    "cuMemcpyDtoHAsync_v2": [c_void_p, CUdeviceptr, c_size_t, c_void_p],
    "cuMemsetD8_v2": [CUdeviceptr, ctypes.c_ubyte, c_size_t],
    "cuMemsetD32_v2": [CUdeviceptr, c_uint, c_size_t],
    "cuMemAddressReserve": [P(CUdeviceptr), c_size_t, c_size_t, CUdeviceptr, c_ulonglong],
    "cuMemAddressFree": [CUdeviceptr, c_size_t],
    "cuMemCreate": [P(c_ulonglong), c_size_t, P(MemProp), c_ulonglong],
    "cuMemRelease": [c_ulonglong],
    "cuMemMap": [CUdeviceptr, c_size_t, c_size_t, c_ulonglong, c_ulonglong],
    "cuMemUnmap": [CUdeviceptr, c_size_t],
    "cuMemSetAccess": [CUdeviceptr, c_size_t, P(AccessDesc), c_size_t],
    "cuMemGetAllocationGranularity": [P(c_size_t), P(MemProp), c_int],
    "cuStreamCreate": [P(c_void_p), c_uint],
    "cuStreamDestroy_v2": [c_void_p],
    "cuStreamSynchronize": [c_void_p],
    "cuStreamQuery": [c_void_p],
    "cuStreamWaitEvent": [c_void_p, c_void_p, c_uint],
    "cuEventCreate": [P(c_void_p), c_uint],
    "cuEventDestroy_v2": [c_void_p],
    "cuEventRecord": [c_void_p, c_void_p],
    "cuEventSynchronize": [c_void_p],
    "cuEventQuery": [c_void_p],
    "cuEventElapsedTime": [P(c_float), c_void_p, c_void_p],
    "cuModuleLoadData": [P(c_void_p), c_char_p],
    "cuModuleLoad": [P(c_void_p), c_char_p],
    "cuModuleUnload": [c_void_p],
    "cuModuleGetFunction": [P(c_void_p), c_void_p, c_char_p],
    "cuLibraryLoadData": [P(c_void_p), c_char_p, c_void_p, c_void_p, c_uint, c_void_p, c_void_p, c_uint],
    "cuLibraryGetKernel": [P(c_void_p), c_void_p, c_char_p],
    "cuLibraryUnload": [c_void_p],
    "cuKernelGetFunction": [P(c_void_p), c_void_p],
    "cuFuncGetAttribute": [P(c_int), c_int, c_void_p],
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": [P(c_int), c_void_p, c_int, c_size_t],
    "cuLaunchKernel": LAUNCH,
    "cuLaunchKernel_ptsz": LAUNCH,
    "cuLaunchKernelEx": [P(LaunchConfig), c_void_p, P(c_void_p), P(c_void_p)],
    "simcudaListAllocations": [P(Allocation), c_int],
    "simcudaArena": [P(c_ulonglong), P(c_ulonglong)],
    "simcudaBusyWait": [c_ulonglong],
}


class Driver:
    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        for name, args in SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes = args
            fn.restype = None if name.startswith("simcudaB") or name == "simcudaArena" else c_int

    def __call__(self, name: str, *args: object) -> int:
        return getattr(self.lib, name)(*args)

    def ok(self, name: str, *args: object) -> None:
        r = self(name, *args)
        assert r == SUCCESS, f"{name} returned {r}"

    def alloc(self, size: int) -> int:
        p = CUdeviceptr()
        self.ok("cuMemAlloc_v2", byref(p), size)
        return p.value

    def stream(self) -> c_void_p:
        s = c_void_p()
        self.ok("cuStreamCreate", byref(s), 0)
        return s

    def event(self, flags: int = 0) -> c_void_p:
        e = c_void_p()
        self.ok("cuEventCreate", byref(e), flags)
        return e

    def module(self, kernels: dict[str, tuple[str, int]]) -> c_void_p:
        m = c_void_p()
        self.ok("cuModuleLoadData", byref(m), simcuda.module_image(kernels))
        return m

    def function(self, mod: c_void_p, name: str) -> c_void_p:
        f = c_void_p()
        self.ok("cuModuleGetFunction", byref(f), mod, name.encode())
        return f

    def launch(self, f: c_void_p, *params: ctypes._SimpleCData, stream: object = None, name: str = "cuLaunchKernel") -> int:
        kp = (c_void_p * max(len(params), 1))(*[ctypes.addressof(p) for p in params])
        return self(name, f, 1, 1, 1, 32, 1, 1, 0, stream, kp if params else None, None)

    def read(self, ptr: int, n: int) -> bytes:
        buf = ctypes.create_string_buffer(n)
        self.ok("cuMemcpyDtoH_v2", buf, ptr, n)
        return buf.raw

    def write(self, ptr: int, data: bytes) -> None:
        self.ok("cuMemcpyHtoD_v2", ptr, data, len(data))

    def free_bytes(self) -> int:
        free, total = c_size_t(), c_size_t()
        self.ok("cuMemGetInfo_v2", byref(free), byref(total))
        return free.value

    def allocations(self) -> list[Allocation]:
        n = self.lib.simcudaListAllocations(None, 0)
        arr = (Allocation * n)()
        assert self.lib.simcudaListAllocations(arr, n) == n
        return list(arr)


@pytest.fixture(scope="module")
def cu() -> Driver:
    d = Driver(simcuda.library_path())
    d.ok("cuInit", 0)
    ctx = c_void_p()
    d.ok("cuDevicePrimaryCtxRetain", byref(ctx), 0)
    d.ok("cuCtxSetCurrent", ctx)
    return d


def run_py(code: str, **kw: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=simcuda.env(), capture_output=True, text=True,
                          timeout=60, **kw)


# --- the library file --------------------------------------------------------------------------

REQUIRED = """cuInit cuDriverGetVersion cuDeviceGet cuDeviceGetCount cuDeviceGetName cuDeviceGetAttribute
cuDeviceTotalMem_v2 cuDeviceGetUuid cuDeviceGetUuid_v2 cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRelease_v2
cuDevicePrimaryCtxGetState cuDevicePrimaryCtxSetFlags_v2 cuDevicePrimaryCtxReset_v2 cuCtxCreate_v2 cuCtxDestroy_v2
cuCtxGetCurrent cuCtxSetCurrent cuCtxGetDevice cuCtxGetDevice_v2 cuCtxPushCurrent_v2 cuCtxPopCurrent_v2
cuCtxSynchronize cuMemAlloc_v2 cuMemFree_v2 cuMemAllocPitch_v2 cuMemAllocHost_v2 cuMemFreeHost cuMemHostAlloc
cuMemAllocAsync cuMemAllocAsync_ptsz cuMemFreeAsync cuMemFreeAsync_ptsz cuMemGetInfo_v2 cuMemcpyHtoD_v2
cuMemcpyDtoH_v2 cuMemcpyDtoD_v2 cuMemcpyHtoDAsync_v2 cuMemcpyDtoHAsync_v2 cuMemcpyDtoDAsync_v2
cuMemcpyHtoDAsync_v2_ptsz cuMemcpyDtoHAsync_v2_ptsz cuMemcpyDtoDAsync_v2_ptsz cuMemsetD8_v2 cuMemsetD32_v2
cuStreamCreate cuStreamCreateWithPriority cuStreamDestroy_v2 cuStreamSynchronize cuStreamSynchronize_ptsz
cuStreamQuery cuStreamIsCapturing cuStreamWaitEvent cuEventCreate cuEventDestroy_v2 cuEventRecord
cuEventRecord_ptsz cuEventSynchronize cuEventQuery cuEventElapsedTime cuModuleLoadData cuModuleLoad cuModuleUnload
cuModuleGetFunction cuLibraryLoadData cuLibraryUnload cuLibraryGetKernel cuKernelGetFunction cuFuncGetAttribute
cuOccupancyMaxActiveBlocksPerMultiprocessor cuOccupancyMaxPotentialBlockSize cuLaunchKernel cuLaunchKernel_ptsz
cuLaunchKernelEx cuLaunchKernelEx_ptsz cuMemAddressReserve cuMemAddressFree cuMemCreate cuMemRelease cuMemMap
cuMemUnmap cuMemSetAccess cuMemGetAllocationGranularity cuGetProcAddress cuGetProcAddress_v2 cuGetExportTable
cuGetErrorName cuGetErrorString simcudaBusyWait""".split()


def dynsyms(path: Path) -> dict[str, int]:
    with open(path, "rb") as f:
        elf = ELFFile(f)
        return {s.name: s["st_value"] for s in elf.get_section_by_name(".dynsym").iter_symbols()
                if s["st_shndx"] != "SHN_UNDEF" and s["st_info"]["type"] == "STT_FUNC"}


def test_library_is_named_and_exports_like_the_real_one() -> None:
    d = simcuda.driver_dir()
    lib = simcuda.library_path()
    assert lib == d / "libcuda.so.1"
    assert (d / "libcuda.so").resolve() == lib.resolve()
    with open(lib, "rb") as f:
        soname = [t.soname for t in ELFFile(f).get_section_by_name(".dynamic").iter_tags() if t.entry.d_tag == "DT_SONAME"]
    assert soname == ["libcuda.so.1"]
    syms = dynsyms(lib)
    assert not set(REQUIRED) - set(syms)
    # Every entry point at its own address, so a uprobe on one never counts another's calls.
    cu_syms = {n: v for n, v in syms.items() if n.startswith("cu")}
    assert len(set(cu_syms.values())) == len(cu_syms)
    # Nothing but the API leaks out of the library.
    assert all(n.startswith(("cu", "simcuda")) for n in syms), sorted(n for n in syms if not n.startswith("cu"))


def test_calls_before_cuinit_fail_and_cuinit_validates_flags() -> None:
    code = f"""
import ctypes
from ctypes import byref, c_int, c_void_p, c_ulonglong
lib = ctypes.CDLL({str(simcuda.library_path())!r})
n, p, v, pfn = c_int(), c_ulonglong(), c_int(), c_void_p()
out = [lib.cuDeviceGetCount(byref(n)), lib.cuMemAlloc_v2(byref(p), ctypes.c_size_t(16)),
       lib.cuCtxGetCurrent(byref(pfn)), lib.cuDriverGetVersion(byref(v)), v.value,
       lib.cuGetProcAddress_v2(b"cuInit", byref(pfn), 13000, ctypes.c_uint64(0), None), lib.cuInit(1), lib.cuInit(0),
       lib.cuDeviceGetCount(byref(n)), n.value, lib.cuMemAlloc_v2(byref(p), ctypes.c_size_t(16))]
print(out)
"""
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    assert eval(r.stdout) == [NOT_INITIALIZED, NOT_INITIALIZED, NOT_INITIALIZED, SUCCESS, 13000, SUCCESS,
                              INVALID_VALUE, SUCCESS, SUCCESS, 1, INVALID_CONTEXT]


def test_errors_and_versions(cu: Driver) -> None:
    s = c_char_p()
    cu.ok("cuGetErrorName", INVALID_HANDLE, byref(s))
    assert s.value == b"CUDA_ERROR_INVALID_HANDLE"
    cu.ok("cuGetErrorString", OUT_OF_MEMORY, byref(s))
    assert s.value == b"out of memory"
    assert cu("cuGetErrorName", 12345, byref(s)) == INVALID_VALUE and s.value is None
    table, uuid = c_void_p(), ctypes.create_string_buffer(16)
    assert cu("cuGetExportTable", byref(table), uuid) == NOT_SUPPORTED and table.value is None


def test_device_queries(cu: Driver) -> None:
    n, dev, v = c_int(), c_int(), c_int()
    cu.ok("cuDeviceGetCount", byref(n))
    assert n.value == 1
    cu.ok("cuDeviceGet", byref(dev), 0)
    assert cu("cuDeviceGet", byref(dev), 1) == INVALID_DEVICE
    name = ctypes.create_string_buffer(64)
    cu.ok("cuDeviceGetName", name, 64, 0)
    assert name.value
    cu.ok("cuDeviceGetAttribute", byref(v), 75, 0)  # compute capability major
    assert v.value == 9
    cu.ok("cuDeviceGetAttribute", byref(v), 102, 0)  # VMM supported
    assert v.value == 1
    assert cu("cuDeviceGetAttribute", byref(v), 100000, 0) == INVALID_VALUE
    assert cu("cuDeviceGetAttribute", byref(v), 16, 7) == INVALID_DEVICE
    total = c_size_t()
    cu.ok("cuDeviceTotalMem_v2", byref(total), 0)
    assert total.value >= 1 << 30
    uuid = ctypes.create_string_buffer(16)
    cu.ok("cuDeviceGetUuid_v2", uuid, 0)
    assert uuid.raw.strip(b"\0")
    flags, active = c_uint(), c_int()
    cu.ok("cuDevicePrimaryCtxGetState", 0, byref(flags), byref(active))
    assert active.value == 1


# --- memory ------------------------------------------------------------------------------------

def test_alloc_copy_memset_round_trip(cu: Driver) -> None:
    base, size = c_ulonglong(), c_ulonglong()
    cu.lib.simcudaArena(byref(base), byref(size))
    free0 = cu.free_bytes()
    a, b = cu.alloc(MB), cu.alloc(MB + 1)
    assert base.value <= a < base.value + size.value and base.value <= b < base.value + size.value
    assert cu.free_bytes() <= free0 - 2 * MB
    data = os.urandom(MB)
    cu.write(a, data)
    assert cu.read(a, MB) == data
    cu.ok("cuMemcpyDtoD_v2", b, a, MB)
    assert cu.read(b, MB) == data
    cu.ok("cuMemsetD8_v2", a + 10, 0xAB, 100)
    cu.ok("cuMemsetD32_v2", b, 0xDEADBEEF, 4)
    got_a, got_b = cu.read(a, MB), cu.read(b, 64)
    assert got_a[:10] == data[:10] and got_a[10:110] == b"\xab" * 100 and got_a[110:] == data[110:]
    assert got_b[:16] == struct.pack("<I", 0xDEADBEEF) * 4 and got_b[16:] == data[16:64]
    # A range that runs past the allocation, a host pointer, a misaligned 32-bit memset.
    host = ctypes.create_string_buffer(16)
    assert cu("cuMemcpyDtoH_v2", host, a + MB - 8, 16) == INVALID_VALUE
    assert cu("cuMemcpyDtoH_v2", host, ctypes.addressof(host), 16) == INVALID_VALUE
    assert cu("cuMemcpyHtoD_v2", a, b, 16) == INVALID_VALUE  # a device pointer is no host source
    assert cu("cuMemsetD32_v2", a + 2, 0, 4) == INVALID_VALUE
    cu.ok("cuMemFree_v2", a)
    cu.ok("cuMemFree_v2", b)
    assert cu.free_bytes() == free0
    # Freed memory is gone: copies and a second free fail.
    assert cu("cuMemcpyDtoH_v2", host, a, 16) == INVALID_VALUE
    assert cu("cuMemFree_v2", a) == INVALID_VALUE
    huge = CUdeviceptr()
    assert cu("cuMemAlloc_v2", byref(huge), c_size_t(1 << 60)) == OUT_OF_MEMORY
    assert cu("cuMemAlloc_v2", byref(huge), 0) == INVALID_VALUE


def test_pitch_pinned_and_async_memory(cu: Driver) -> None:
    p, pitch = CUdeviceptr(), c_size_t()
    cu.ok("cuMemAllocPitch_v2", byref(p), byref(pitch), 1000, 3, 4)
    assert pitch.value >= 1000 and pitch.value % 512 == 0
    assert cu("cuMemAllocPitch_v2", byref(p), byref(pitch), 1000, 3, 3) == INVALID_VALUE
    cu.ok("cuMemFree_v2", p)

    s = cu.stream()
    pinned = c_void_p()
    cu.ok("cuMemAllocHost_v2", byref(pinned), MB)
    ctypes.memmove(pinned, os.urandom(MB), MB)
    want = ctypes.string_at(pinned, MB)
    a = CUdeviceptr()
    cu.ok("cuMemAllocAsync", byref(a), MB, s)
    cu.ok("cuMemcpyHtoDAsync_v2", a, pinned, MB, s)
    back = c_void_p()
    cu.ok("cuMemAllocHost_v2", byref(back), MB)
    cu.ok("cuMemcpyDtoHAsync_v2", back, a, MB, s)
    cu.ok("cuStreamSynchronize", s)
    assert ctypes.string_at(back, MB) == want
    # Pageable host memory may be reused as soon as an async host-to-device copy returns.
    page = ctypes.create_string_buffer(b"x" * 64, 64)
    cu.ok("cuMemcpyHtoDAsync_v2", a, page, 64, s)
    ctypes.memset(page, ord("y"), 64)
    cu.ok("cuStreamSynchronize", s)
    assert cu.read(a.value, 64) == b"x" * 64
    cu.ok("cuMemFreeAsync", a, s)
    assert cu("cuMemFreeAsync", a, s) == INVALID_VALUE
    assert cu("cuMemcpyDtoD_v2", a, a, 8) == INVALID_VALUE
    cu.ok("cuStreamSynchronize", s)
    cu.ok("cuMemFreeHost", pinned)
    cu.ok("cuMemFreeHost", back)
    assert cu("cuMemFreeHost", pinned) == INVALID_VALUE
    cu.ok("cuStreamDestroy_v2", s)


def test_vmm_reserve_map_access_alias(cu: Driver) -> None:
    prop = MemProp(type=1, loc_type=1, loc_id=0)
    gran = c_size_t()
    cu.ok("cuMemGetAllocationGranularity", byref(gran), byref(prop), 0)
    g = gran.value
    assert g == 2 * MB
    h = c_ulonglong()
    assert cu("cuMemCreate", byref(h), g + 1, byref(prop), 0) == INVALID_VALUE
    free0 = cu.free_bytes()
    cu.ok("cuMemCreate", byref(h), g, byref(prop), 0)
    assert cu.free_bytes() == free0 - g
    va = CUdeviceptr()
    cu.ok("cuMemAddressReserve", byref(va), 2 * g, 0, 0, 0)
    assert va.value % g == 0
    # The same physical memory at both halves of the reservation.
    cu.ok("cuMemMap", va, g, 0, h, 0)
    cu.ok("cuMemMap", va.value + g, g, 0, h, 0)
    assert cu("cuMemMap", va, g, 0, h, 0) == INVALID_VALUE  # already mapped
    host = ctypes.create_string_buffer(8)
    assert cu("cuMemcpyDtoH_v2", host, va, 8) == INVALID_VALUE  # mapped, no access yet
    desc = AccessDesc(loc_type=1, loc_id=0, flags=3)
    cu.ok("cuMemSetAccess", va, 2 * g, byref(desc), 1)
    cu.write(va.value + 100, b"aliased!")
    assert cu.read(va.value + g + 100, 8) == b"aliased!"
    # A copy may span two mappings.
    cu.ok("cuMemsetD8_v2", va.value + g - 4, 0x5A, 8)
    assert cu.read(va.value + g - 4, 8) == b"\x5a" * 8
    kinds = {(a.kind, a.base, a.size) for a in cu.allocations()}
    assert (7, va.value, g) in kinds and (7, va.value + g, g) in kinds and (5, va.value, 2 * g) in kinds
    assert cu("cuMemAddressFree", va, 2 * g) == INVALID_VALUE  # still mapped
    cu.ok("cuMemRelease", h)  # memory lives on while mapped
    assert cu.read(va.value + 100, 8) == b"aliased!"
    assert cu("cuMemRelease", h) == INVALID_VALUE
    cu.ok("cuMemUnmap", va, 2 * g)
    assert cu.free_bytes() == free0
    assert cu("cuMemcpyDtoH_v2", host, va, 8) == INVALID_VALUE
    cu.ok("cuMemAddressFree", va, 2 * g)
    assert cu("cuMemAddressFree", va, 2 * g) == INVALID_VALUE


def test_list_allocations_for_the_checkpointer(cu: Driver) -> None:
    a = cu.alloc(3 * 4096 + 1)
    pinned = c_void_p()
    cu.ok("cuMemAllocHost_v2", byref(pinned), 100)
    found = {(x.kind, x.base): x for x in cu.allocations()}
    assert found[(1, a)].size == 3 * 4096 + 1
    assert (4, pinned.value) in found
    cu.ok("cuMemFree_v2", a)
    cu.ok("cuMemFreeHost", pinned)
    found = {(x.kind, x.base) for x in cu.allocations()}
    assert (1, a) not in found and (4, pinned.value) not in found


# --- kernels, streams, events ------------------------------------------------------------------

def test_builtin_kernels_compute(cu: Driver) -> None:
    n = 1000
    m = cu.module({"fill": ("fill_u32", 0), "add": ("add_f32", 0), "scale": ("scale_f32", 0),
                   "inc": ("inc_u32", 0), "sum": ("sum_u32", 0)})
    x, y, out, total = cu.alloc(4 * n), cu.alloc(4 * n), cu.alloc(4 * n), cu.alloc(8)
    cn = c_ulonglong(n)
    assert cu.launch(cu.function(m, "fill"), c_ulonglong(x), c_uint(7), cn) == SUCCESS
    assert cu.launch(cu.function(m, "inc"), c_ulonglong(x), cn) == SUCCESS
    assert cu.launch(cu.function(m, "sum"), c_ulonglong(x), cn, c_ulonglong(total)) == SUCCESS
    assert struct.unpack("<Q", cu.read(total, 8))[0] == 8 * n
    cu.write(x, struct.pack(f"<{n}f", *range(n)))
    cu.write(y, struct.pack(f"<{n}f", *[0.5] * n))
    assert cu.launch(cu.function(m, "add"), c_ulonglong(x), c_ulonglong(y), c_ulonglong(out), cn) == SUCCESS
    # Parameters through `extra`, packed at natural alignment: (ptr, f32, u64) -> offsets 0, 8, 16.
    packed = ctypes.create_string_buffer(struct.pack("<QfxxxxQ", out, 2.0, n), 24)
    size = c_size_t(24)
    extra = (c_void_p * 5)(1, ctypes.addressof(packed), 2, ctypes.addressof(size), 0)
    assert cu("cuLaunchKernel", cu.function(m, "scale"), 1, 1, 1, 32, 1, 1, 0, None, None, extra) == SUCCESS
    assert struct.unpack(f"<{n}f", cu.read(out, 4 * n)) == tuple(2 * (i + 0.5) for i in range(n))
    # Arguments that point outside device memory are refused at launch.
    assert cu.launch(cu.function(m, "inc"), c_ulonglong(x + 8), cn) == INVALID_VALUE
    assert cu.launch(cu.function(m, "inc"), c_ulonglong(ctypes.addressof(size)), c_ulonglong(1)) == INVALID_VALUE
    assert cu("cuLaunchKernel", cu.function(m, "inc"), 1, 1, 1, 32, 1, 1, 0, None, None, None) == INVALID_VALUE
    assert cu("cuLaunchKernel", cu.function(m, "inc"), 1, 1, 1, 2048, 1, 1, 0, None, None, None) == INVALID_VALUE
    for p in (x, y, out, total):
        cu.ok("cuMemFree_v2", p)
    cu.ok("cuModuleUnload", m)


def test_synchronization_waits_for_the_gpu(cu: Driver) -> None:
    m = cu.module({"k50": ("spin", 50_000_000), "k30": ("spin", 30_000_000)})
    k50, k30 = cu.function(m, "k50"), cu.function(m, "k30")
    s = cu.stream()
    t0 = time.monotonic()
    assert cu.launch(k50, stream=s) == SUCCESS
    launched = time.monotonic() - t0
    assert cu("cuStreamQuery", s) == NOT_READY
    cu.ok("cuStreamSynchronize", s)
    waited = time.monotonic() - t0
    assert launched < 0.02 and waited >= 0.045, (launched, waited)
    assert cu("cuStreamQuery", s) == SUCCESS

    # Events: a position in the stream, timed on the GPU's clock.
    start, end = cu.event(), cu.event()
    cu.ok("cuEventRecord", start, s)
    assert cu.launch(k30, stream=s) == SUCCESS
    assert cu.launch(k30, stream=s) == SUCCESS
    cu.ok("cuEventRecord", end, s)
    assert cu("cuEventQuery", end) == NOT_READY
    ms = c_float()
    assert cu("cuEventElapsedTime", byref(ms), start, end) == NOT_READY
    t0 = time.monotonic()
    cu.ok("cuEventSynchronize", end)
    assert time.monotonic() - t0 >= 0.05
    cu.ok("cuEventElapsedTime", byref(ms), start, end)
    assert 59.0 <= ms.value < 200.0, ms.value

    # Another stream waits for an event before its own work; the context waits for both.
    other = cu.stream()
    buf = cu.alloc(4)
    cu.ok("cuMemsetD32_v2", buf, 0, 1)
    cu.ok("cuStreamSynchronize", None)
    inc = cu.module({"inc": ("inc_u32", 0)})
    t0 = time.monotonic()
    assert cu.launch(k50, stream=s) == SUCCESS
    cu.ok("cuEventRecord", end, s)
    cu.ok("cuStreamWaitEvent", other, end, 0)
    assert cu.launch(cu.function(inc, "inc"), c_ulonglong(buf), c_ulonglong(1), stream=other) == SUCCESS
    assert cu("cuStreamQuery", other) == NOT_READY
    cu.ok("cuCtxSynchronize")
    assert time.monotonic() - t0 >= 0.045
    assert cu.read(buf, 4) == struct.pack("<I", 1)

    nt = cu.event(2)  # CU_EVENT_DISABLE_TIMING
    cu.ok("cuEventRecord", nt, s)
    cu.ok("cuEventSynchronize", nt)
    assert cu("cuEventElapsedTime", byref(ms), start, nt) == INVALID_HANDLE
    for e in (start, end, nt):
        cu.ok("cuEventDestroy_v2", e)
    for x in (s, other):
        cu.ok("cuStreamDestroy_v2", x)
    cu.ok("cuMemFree_v2", buf)
    cu.ok("cuModuleUnload", m)
    cu.ok("cuModuleUnload", inc)


def test_env_knobs_kernel_ns_and_launch_ns() -> None:
    base = simcuda.env()
    # SIMCUDA_KERNEL_NS overrides the 20 ms of gpu_bound's module: 3 steps x 2 kernels x 1 ms.
    r = subprocess.run(simcuda.workload("gpu_bound") + ["--steps", "3"], env={**base, "SIMCUDA_KERNEL_NS": "1000000"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert 5.9 <= out["gpu_ms"] < 40 and out["elapsed_s"] < 0.12 * 0.9, out
    # --launch-ns (SIMCUDA_LAUNCH_NS): each launch spins on the CPU; 2 steps of 4 launches x 10 ms.
    r = subprocess.run(simcuda.workload("launch_bound") + ["--steps", "2", "--scale", "0.1", "--launch-ns", "10000000",
                                                           "--kernel-ns", "0"],
                       env=base, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    launches = out["calls"]["cuLaunchKernel"] + out["calls"]["cuLaunchKernelEx"]
    assert launches == 2 * (2 + 1)
    assert out["elapsed_s"] >= launches * 0.010 * 0.95


def test_busy_wait_helper(cu: Driver) -> None:
    t0 = time.monotonic()
    cu.lib.simcudaBusyWait(20_000_000)
    assert 0.0195 <= time.monotonic() - t0 < 1.0


def test_modules_libraries_and_functions(cu: Driver, tmp_path: Path) -> None:
    image = simcuda.module_image({"k": ("spin", 1000), "f": ("fill_u32", 0)})
    path = tmp_path / "mod.simcuda"
    path.write_bytes(image.rstrip(b"\0"))
    m, f, lib, kern, f2 = c_void_p(), c_void_p(), c_void_p(), c_void_p(), c_void_p()
    cu.ok("cuModuleLoad", byref(m), str(path).encode())
    cu.ok("cuModuleGetFunction", byref(f), m, b"k")
    assert cu("cuModuleGetFunction", byref(f2), m, b"nope") == NOT_FOUND
    v = c_int()
    cu.ok("cuFuncGetAttribute", byref(v), 0, f)
    assert v.value == 1024
    cu.ok("cuOccupancyMaxActiveBlocksPerMultiprocessor", byref(v), f, 256, 0)
    assert v.value == 8
    assert cu("cuModuleLoad", byref(m), str(tmp_path / "missing").encode()) == FILE_NOT_FOUND
    assert cu("cuModuleLoadData", byref(f2), b"\x7fELF not a simcuda module") == INVALID_IMAGE
    assert cu("cuModuleLoadData", byref(f2), b"SIMCUDA-MODULE\nkernel x no_such_builtin 5\n") == INVALID_IMAGE
    cu.ok("cuLibraryLoadData", byref(lib), image, None, None, 0, None, None, 0)
    cu.ok("cuLibraryGetKernel", byref(kern), lib, b"f")
    cu.ok("cuKernelGetFunction", byref(f2), kern)
    cu.ok("cuFuncGetAttribute", byref(v), 4, f2)
    cu.ok("cuLibraryUnload", lib)
    assert cu("cuKernelGetFunction", byref(f2), kern) == INVALID_HANDLE
    assert cu("cuLibraryUnload", lib) == INVALID_HANDLE
    cu.ok("cuModuleUnload", m)
    assert cu("cuModuleGetFunction", byref(f2), m, b"k") == INVALID_HANDLE
    assert cu.launch(f) == INVALID_HANDLE  # a function of an unloaded module
    assert cu.launch(c_void_p(0xDEADBEEF0)) == INVALID_HANDLE


def test_bad_stream_and_event_handles(cu: Driver) -> None:
    s, e = cu.stream(), cu.event()
    cu.ok("cuStreamDestroy_v2", s)
    cu.ok("cuEventDestroy_v2", e)
    assert cu("cuStreamSynchronize", s) == INVALID_HANDLE
    assert cu("cuStreamDestroy_v2", s) == INVALID_HANDLE
    assert cu("cuEventRecord", e, None) == INVALID_HANDLE
    assert cu("cuEventSynchronize", e) == INVALID_HANDLE
    assert cu("cuStreamSynchronize", c_void_p(0x1234560)) == INVALID_HANDLE
    cu.ok("cuStreamSynchronize", c_void_p(1))  # CU_STREAM_LEGACY
    cu.ok("cuStreamSynchronize", c_void_p(2))  # CU_STREAM_PER_THREAD


def test_contexts(cu: Driver) -> None:
    primary, ctx, cur = c_void_p(), c_void_p(), c_void_p()
    cu.ok("cuCtxGetCurrent", byref(primary))
    cu.ok("cuCtxCreate_v2", byref(ctx), 0, 0)
    cu.ok("cuCtxGetCurrent", byref(cur))
    assert cur.value == ctx.value != primary.value
    dev = c_int(-1)
    cu.ok("cuCtxGetDevice_v2", byref(dev), ctx)
    assert dev.value == 0
    a = cu.alloc(4096)  # owned by the new context: freed with it
    cu.ok("cuCtxPopCurrent_v2", byref(cur))
    assert cur.value == ctx.value
    cu.ok("cuCtxPushCurrent_v2", ctx)
    cu.ok("cuCtxDestroy_v2", ctx)
    cu.ok("cuCtxGetCurrent", byref(cur))
    assert cur.value == primary.value
    assert a not in {x.base for x in cu.allocations()}
    assert cu("cuCtxSetCurrent", ctx) == INVALID_CONTEXT
    assert cu("cuCtxGetDevice_v2", byref(dev), ctx) == INVALID_CONTEXT
    assert cu("cuCtxDestroy_v2", primary) == INVALID_CONTEXT

    # A thread starts with no current context.
    results: list[int] = []

    def other() -> None:
        p = CUdeviceptr()
        results.append(cu("cuMemAlloc_v2", byref(p), 16))
        results.append(cu("cuCtxGetDevice", byref(c_int())))
        results.append(cu("cuCtxSetCurrent", primary))
        results.append(cu("cuCtxGetDevice", byref(c_int())))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert results == [INVALID_CONTEXT, INVALID_CONTEXT, SUCCESS, SUCCESS]


def test_get_proc_address(cu: Driver) -> None:
    def addr(name: str) -> int:
        return ctypes.cast(getattr(cu.lib, name), c_void_p).value

    def lookup(sym: str, version: int = 13000, flags: int = 0) -> tuple[int, int, int | None]:
        pfn, status = c_void_p(), c_int(-1)
        r = cu("cuGetProcAddress_v2", sym.encode(), byref(pfn), version, flags, byref(status))
        return r, status.value, pfn.value

    assert lookup("cuMemAlloc") == (SUCCESS, 0, addr("cuMemAlloc_v2"))
    assert lookup("cuLaunchKernel") == (SUCCESS, 0, addr("cuLaunchKernel"))
    assert lookup("cuLaunchKernel", flags=PER_THREAD) == (SUCCESS, 0, addr("cuLaunchKernel_ptsz"))
    assert lookup("cuMemcpyHtoDAsync", flags=PER_THREAD)[2] == addr("cuMemcpyHtoDAsync_v2_ptsz")
    assert lookup("cuMemcpyHtoD", flags=PER_THREAD)[2] == addr("cuMemcpyHtoD_v2_ptds")
    assert lookup("cuMemAlloc", flags=PER_THREAD)[2] == addr("cuMemAlloc_v2")  # no per-thread variant
    assert lookup("cuCtxGetDevice", 12080)[2] == addr("cuCtxGetDevice")
    assert lookup("cuCtxGetDevice", 13000)[2] == addr("cuCtxGetDevice_v2")
    assert lookup("cuGetProcAddress", 12000)[2] == addr("cuGetProcAddress_v2")
    assert lookup("cuLaunchKernelEx", 11000) == (NOT_FOUND, 2, None)  # version not sufficient
    assert lookup("cuNoSuchFunction") == (NOT_FOUND, 1, None)
    assert lookup("cuMemAlloc_v2")[0] == NOT_FOUND  # base names only, as the real driver
    pfn = c_void_p()
    cu.ok("cuGetProcAddress", b"cuStreamSynchronize", byref(pfn), 13000, PER_THREAD)
    assert pfn.value == addr("cuStreamSynchronize_ptsz")
    # The entry points work when called through the pointer.
    alloc = ctypes.CFUNCTYPE(c_int, P(CUdeviceptr), c_size_t)(lookup("cuMemAlloc")[2])
    p = CUdeviceptr()
    assert alloc(byref(p), 64) == SUCCESS
    cu.write(p.value, b"via getprocaddress")
    assert cu.read(p.value, 18) == b"via getprocaddress"
    cu.ok("cuMemFree_v2", p)


def test_fork_child_cannot_use_the_parent_driver(cu: Driver) -> None:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        n = c_int()
        os._exit(cu("cuDeviceGetCount", byref(n)))
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == NOT_INITIALIZED


def test_exit_does_not_wait_for_the_gpu() -> None:
    code = f"""
import ctypes
from ctypes import byref, c_void_p, c_int
lib = ctypes.CDLL({str(simcuda.library_path())!r})
ctx, mod, fn = c_void_p(), c_void_p(), c_void_p()
assert lib.cuInit(0) == 0 and lib.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0 and lib.cuCtxSetCurrent(ctx) == 0
assert lib.cuModuleLoadData(byref(mod), b"SIMCUDA-MODULE\\nkernel k spin 30000000000\\n") == 0
assert lib.cuModuleGetFunction(byref(fn), mod, b"k") == 0
lib.cuLaunchKernel.argtypes = [c_void_p] + [ctypes.c_uint] * 7 + [c_void_p] * 3
assert lib.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, None, None) == 0
print("launched", flush=True)
"""
    t0 = time.monotonic()
    r = run_py(code)
    assert r.returncode == 0 and r.stdout == "launched\n", r.stderr
    assert time.monotonic() - t0 < 10  # the kernel would run 30 s


# --- workloads ---------------------------------------------------------------------------------

LB_MIX = {"cuCtxGetDevice_v2": 324, "cuDevicePrimaryCtxGetState": 89, "cuLaunchKernel": 21, "cuCtxGetCurrent": 19,
          "cuLaunchKernelEx": 14, "cuOccupancyMaxActiveBlocksPerMultiprocessor": 4, "cuKernelGetFunction": 4,
          "cuDeviceGetAttribute": 4, "cuMemcpyDtoDAsync_v2": 1, "cuStreamIsCapturing": 1}
LB_SETUP = {"cuInit": 1, "cuDeviceGet": 1, "cuDevicePrimaryCtxRetain": 1, "cuCtxSetCurrent": 1,
            "cuModuleLoadData": 1, "cuModuleGetFunction": 1, "cuLibraryLoadData": 1, "cuLibraryGetKernel": 1,
            "cuMemAlloc_v2": 2, "cuMemsetD32_v2": 1, "cuMemcpyDtoH_v2": 1, "cuMemFree_v2": 2, "cuLibraryUnload": 1,
            "cuModuleUnload": 1, "cuDevicePrimaryCtxRelease_v2": 1}
# What the per-thread default stream flag turns each name into.
PTSZ = {"cuLaunchKernel": "cuLaunchKernel_ptsz", "cuLaunchKernelEx": "cuLaunchKernelEx_ptsz",
        "cuMemcpyDtoDAsync_v2": "cuMemcpyDtoDAsync_v2_ptsz", "cuStreamIsCapturing": "cuStreamIsCapturing_ptsz",
        "cuStreamSynchronize": "cuStreamSynchronize_ptsz", "cuMemsetD32_v2": "cuMemsetD32_v2_ptds",
        "cuMemcpyDtoH_v2": "cuMemcpyDtoH_v2_ptds"}


def run_workload(name: str, *args: str, env: dict[str, str] | None = None) -> dict:
    r = subprocess.run(simcuda.workload(name) + list(args), env=env or simcuda.env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout
    return json.loads(lines[0])


def launch_bound_expected(steps: int, scale: float, ptsz: bool, via_getproc: bool) -> dict[str, int]:
    want = dict(LB_SETUP)
    for name, n in LB_MIX.items():
        want[name] = want.get(name, 0) + math.floor(n * scale + 0.5) * steps
    want["cuStreamSynchronize"] = steps
    want = {(PTSZ.get(k, k) if ptsz else k): v for k, v in want.items() if v}
    if via_getproc:
        want["cuGetProcAddress_v2"] = len(want)  # one lookup per distinct function
    return want


@pytest.mark.parametrize(
    "name,args",
    [
        ("launch_bound", ["--steps", "7"]),
        ("launch_bound", ["--steps", "5", "--scale", "0.25", "--dlopen"]),
        ("launch_bound", ["--steps", "4", "--ptsz", "--scale", "0.5"]),
        ("launch_bound_py", ["--steps", "3"]),
        ("launch_bound_py", ["--steps", "3", "--ptsz", "--scale", "0.1"]),
    ],
)
def test_launch_bound_counts(name: str, args: list[str]) -> None:
    out = run_workload(name, *args, "--kernel-ns", "2000", "--launch-ns", "0")
    steps = int(args[args.index("--steps") + 1])
    scale = float(args[args.index("--scale") + 1]) if "--scale" in args else 1.0
    ptsz = "--ptsz" in args
    getproc = name.endswith("_py") or ptsz or "--dlopen" in args
    assert out["steps"] == steps and out["check"] == "ok"
    assert out["mode"] == ("dlopen" if getproc else "direct")
    assert out["calls"] == launch_bound_expected(steps, scale, ptsz, getproc)


def test_launch_bound_seconds_mode_and_stdin_gate() -> None:
    rfd, wfd = os.pipe()
    proc = subprocess.Popen(
        simcuda.workload("launch_bound") + ["--seconds", "0.1", "--wait-stdin", "--ready-fd", str(wfd),
                                             "--scale", "0.1"],
        env=simcuda.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=(wfd,))
    os.close(wfd)
    with os.fdopen(rfd) as ready:
        assert ready.readline() == "ready\n"
    t0 = time.monotonic()
    stdout, _ = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0
    out = json.loads(stdout)
    assert time.monotonic() - t0 >= 0.1 and out["elapsed_s"] >= 0.1
    assert out["steps"] >= 1
    assert out["calls"] == launch_bound_expected(out["steps"], 0.1, False, False)


def test_gpu_bound_counts_and_gpu_time() -> None:
    out = run_workload("gpu_bound", "--steps", "3", "--kernels", "3", "--kernel-ns", "4000000")
    steps, k = 3, 3
    assert out["calls"] == {
        "cuInit": 1, "cuDeviceGet": 1, "cuDevicePrimaryCtxRetain": 1, "cuCtxSetCurrent": 1, "cuModuleLoadData": 1,
        "cuModuleGetFunction": 1, "cuStreamCreate": 1, "cuEventCreate": 2,
        "cuEventRecord": 2 * steps, "cuLaunchKernel": k * steps, "cuStreamSynchronize": steps,
        "cuEventElapsedTime_v2": steps,
        "cuEventDestroy_v2": 2, "cuStreamDestroy_v2": 1, "cuModuleUnload": 1, "cuDevicePrimaryCtxRelease_v2": 1,
    }
    assert out["gpu_ms"] >= steps * k * 4 * 0.99 and out["elapsed_s"] >= steps * k * 0.004 * 0.99


@pytest.mark.parametrize("args", [["--steps", "6"], ["--steps", "2", "--dlopen", "--size", "4096"]])
def test_alloc_free_counts(args: list[str]) -> None:
    out = run_workload("alloc_free", *args)
    steps = int(args[1])
    per_step = {
        "cuMemAlloc_v2": 1, "cuMemcpyHtoD_v2": 2, "cuMemcpyDtoH_v2": 3, "cuMemAllocPitch_v2": 1, "cuMemsetD32_v2": 1,
        "cuMemFree_v2": 2, "cuMemAllocAsync": 1, "cuMemcpyDtoDAsync_v2": 1, "cuMemcpyDtoHAsync_v2": 1,
        "cuStreamSynchronize": 2, "cuMemFreeAsync": 1, "cuMemCreate": 1, "cuMemAddressReserve": 1, "cuMemMap": 1,
        "cuMemSetAccess": 1, "cuMemsetD8_v2": 1, "cuMemUnmap": 1, "cuMemRelease": 1, "cuMemAddressFree": 1,
        "cuMemHostAlloc": 1, "cuMemFreeHost": 1, "cuMemGetInfo_v2": 1,
    }
    want = {k: v * steps for k, v in per_step.items()}
    for k, v in {"cuInit": 1, "cuDeviceGet": 1, "cuDevicePrimaryCtxRetain": 1, "cuCtxSetCurrent": 1,
                 "cuStreamCreate": 1, "cuMemAllocHost_v2": 2, "cuMemGetAllocationGranularity": 1,
                 "cuMemGetInfo_v2": 1, "cuMemFreeHost": 2, "cuStreamDestroy_v2": 1,
                 "cuDevicePrimaryCtxRelease_v2": 1}.items():
        want[k] = want.get(k, 0) + v
    if "--dlopen" in args:
        want["cuGetProcAddress_v2"] = len(want)
    assert out["check"] == "ok" and out["steps"] == steps
    assert out["calls"] == want


def test_workload_rejects_unknown_options() -> None:
    r = subprocess.run(simcuda.workload("gpu_bound") + ["--bogus"], env=simcuda.env(), capture_output=True, text=True)
    assert r.returncode == 2 and "unknown option" in r.stderr
    with pytest.raises(ValueError):
        simcuda.workload("nope")
