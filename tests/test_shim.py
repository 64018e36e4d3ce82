"""The shim preloaded into the simcuda workloads: what `status` reports equals what the process holds.

Each workload runs with --hold: at each hold point it prints its own view (simcuda's
simcudaListAllocations plus the handles it created) and waits; the test compares that with the
shim's status over the control socket, then lets it go on.  The last hold comes after teardown, so
frees must have emptied the registry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from elftools.elf.elffile import ELFFile

from gputrace import shim, simcuda
from gputrace.shim import client

from shimtest import expected_allocs, procs, reported_allocs, shim_dir, start  # noqa: F401  (fixtures)

def run_holding(procs, argv) -> tuple[list[tuple[dict, dict]], dict]:
    """Runs a workload with --hold; returns [(its own view, the shim's status)] per hold, and its report."""
    p = start(procs, argv + ["--hold"])
    seen = []
    while True:
        line = p.stdout.readline()
        assert line, f"workload ended early: {p.stderr.read()}"
        doc = json.loads(line)
        if "hold" not in doc:
            break
        seen.append((doc, client.status(p.pid)))
        p.stdin.write("\n")
        p.stdin.flush()
    assert p.wait() == 0, p.stderr.read()
    assert doc.get("check") == "ok"
    return seen, doc


CASES = [
    ("launch_bound", [], 2),
    ("launch_bound", ["--dlopen"], 2),
    ("launch_bound", ["--ptsz"], 2),
    ("alloc_free", [], 4),
    ("alloc_free", ["--dlopen"], 4),
    ("launch_bound_py", [], 2),
    ("launch_bound_py", ["--ptsz"], 2),
]


@pytest.mark.parametrize("name,opts,holds", CASES, ids=[f"{n}{''.join(o)}" for n, o, _ in CASES])
def test_status_matches_what_the_process_holds(procs, shim_dir, name, opts, holds):
    seen, report = run_holding(procs, simcuda.workload(name) + ["--steps", "2"] + opts)
    assert len(seen) == holds
    for held, st in seen:
        assert st["schema"] == 1 and st["pid"] == procs[0].pid and not st["paused"]
        assert reported_allocs(st) == expected_allocs(held), f"hold {held['hold']}"
        assert {c["handle"] for c in st["contexts"]} == set(held["contexts"])
        assert {m["handle"] for m in st["modules"] if m["kind"] == "module"} == set(held["modules"])
        assert {m["handle"] for m in st["modules"] if m["kind"] == "library"} == set(held["libraries"])
        assert {s["handle"] for s in st["streams"]} == set(held["streams"])
        assert {e["handle"] for e in st["events"]} == set(held["events"])
        device = sum(a["size"] for a in st["allocations"] if a["kind"] in ("device", "pitch", "async", "vmm_phys"))
        assert st["totals"]["device_bytes"] == device
    # After teardown everything is gone, and the shim saw every state and submission call the
    # workload made (none of them bypassed it, whichever way the workload found the driver).
    last = seen[-1][1]
    assert last["allocations"] == [] and last["contexts"] == [] and last["modules"] == []
    for fn, n in report["calls"].items():
        if fn in WRAPPED:
            assert last["calls"].get(fn) == n, fn
    launch = "cuLaunchKernel_ptsz" if "--ptsz" in opts else "cuLaunchKernel"
    if name != "alloc_free":
        assert last["calls"][launch] == report["calls"][launch] > 0


WRAPPED = {
    "cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz", "cuMemAlloc_v2", "cuMemFree_v2",
    "cuMemAllocPitch_v2", "cuMemAllocAsync", "cuMemFreeAsync", "cuMemAllocHost_v2", "cuMemHostAlloc", "cuMemFreeHost",
    "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess",
    "cuStreamCreate", "cuStreamDestroy_v2", "cuEventCreate", "cuEventDestroy_v2", "cuModuleLoadData", "cuModuleUnload",
    "cuLibraryLoadData", "cuLibraryUnload", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease_v2",
    "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyDtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuMemsetD8_v2",
    "cuMemsetD32_v2", "cuGetProcAddress_v2",
}


def test_module_images_are_copied(procs, shim_dir):
    seen, _ = run_holding(procs, simcuda.workload("launch_bound") + ["--steps", "1", "--kernel-ns", "1234"])
    image = b"SIMCUDA-MODULE\nkernel inc inc_u32 1234\n\0"
    mods = seen[0][1]["modules"]
    assert sorted(m["kind"] for m in mods) == ["library", "module"]
    assert all(m["image_bytes"] == len(image) for m in mods)
    assert seen[0][1]["totals"]["module_image_bytes"] == 2 * len(image)


def test_the_shim_links_no_libpython():
    with open(shim.library_path(), "rb") as f:
        dyn = ELFFile(f).get_section_by_name(".dynamic")
        needed = [t.needed for t in dyn.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
    assert needed and all(n.startswith(("libc.so", "libdl.so", "libpthread.so")) for n in needed), needed


@pytest.mark.parametrize("argv", [["/bin/true"], [sys.executable, "-c", "pass"], ["python3", "-c", "import ctypes"],
                                  ["sh", "-c", "exit 0"]], ids=["true", "this-python", "system-python3", "sh"])
def test_preload_under_bind_now_into_processes_without_cuda(shim_dir, argv):
    env = shim.preload_env()
    env["LD_BIND_NOW"] = "1"
    env["GPUTRACE_SHIM_DIR"] = str(shim_dir)
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert list(shim_dir.iterdir()) == []  # never touched the driver: no server, no socket


def test_preload_under_bind_now_into_workloads(procs, shim_dir):
    env = shim.preload_env(simcuda.env())
    env["LD_BIND_NOW"] = "1"
    for argv in (simcuda.workload("launch_bound") + ["--dlopen"], simcuda.workload("launch_bound_py")):
        r = subprocess.run(argv + ["--steps", "1"], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["check"] == "ok"
    assert list(shim_dir.iterdir()) == []  # each server removed its socket at exit


RTLD_NEXT_PROG = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
int main(void)
{
    void *next = dlsym(RTLD_NEXT, "puts"), *dflt = dlsym(RTLD_DEFAULT, "puts");
    void *none = dlsym(RTLD_NEXT, "main");
    printf("%d %d\n", next != NULL && next == dflt, none == NULL);
    return 0;
}
"""


def test_dlsym_keeps_rtld_next_semantics(tmp_path, shim_dir):
    from gputrace.base.native import build

    src = tmp_path / "next.c"
    src.write_text(RTLD_NEXT_PROG)
    exe = build("rtld_next", [src], ldflags=["-ldl"])
    r = subprocess.run([str(exe)], env=shim.preload_env(), capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.split() == ["1", "1"], (r.stdout, r.stderr)


def test_in_process_control_functions(monkeypatch):
    monkeypatch.setenv("GPUTRACE_SHIM_LIBCUDA", str(simcuda.library_path()))
    lib = shim.open_in_process()
    ffi = shim.ffi()
    assert lib.gputrace_shim_schema() == 1
    assert lib.gputrace_shim_calls(b"no_such_function") == -1
    assert lib.gputrace_shim_calls(b"cuLaunchKernel") == 0
    assert lib.gputrace_shim_real(b"cuLaunchKernel") != ffi.NULL
    assert lib.gputrace_shim_real(b"cuMemGetInfo_v2") == ffi.NULL  # not wrapped, so not the shim's to hand out
    assert lib.gputrace_shim_resume() == -1
    assert lib.gputrace_shim_pause(100) == 0 and lib.gputrace_shim_paused() == 1
    assert lib.gputrace_shim_pause(100) == -2
    n = lib.gputrace_shim_status_json(ffi.NULL, 0)
    buf = ffi.new("char[]", n + 1)
    assert lib.gputrace_shim_status_json(buf, n + 1) == n
    st = orjson.loads(ffi.string(buf))
    assert st["paused"] is True and st["in_flight"] == 0 and st["allocations"] == []
    assert lib.gputrace_shim_resume() == 0 and lib.gputrace_shim_paused() == 0


def other_pythons() -> list[str]:
    """Python 3.10-3.13 interpreters on this machine besides the one running the tests (pyenv's, the
    system's), so the shim is shown to load into builds other than its tester's."""
    found = {}
    roots = [Path.home() / ".pyenv" / "versions"]
    for root in roots:
        for d in sorted(root.glob("3.1[0-3]*")) if root.is_dir() else []:
            exe = d / "bin" / "python3"
            if exe.exists():
                found.setdefault(d.name.rsplit(".", 1)[0], str(exe))
    for exe in ("/usr/bin/python3",):
        if os.path.exists(exe):
            found.setdefault("system", exe)
    return list(found.values())


@pytest.mark.parametrize("python", other_pythons() or [pytest.param(None, marks=pytest.mark.skip("no other Python"))])
def test_preload_into_other_pythons(procs, shim_dir, python):
    env = shim.preload_env(simcuda.env())
    env["LD_BIND_NOW"] = "1"
    r = subprocess.run([python, "-c", "pass"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    argv = [python, simcuda.workload("launch_bound_py")[1], "--steps", "1"]
    seen, report = run_holding(procs, argv)
    assert reported_allocs(seen[0][1]) == expected_allocs(seen[0][0]) and seen[-1][1]["allocations"] == []


GETPROC = r"""
import ctypes, json, os, sys
from ctypes import POINTER, byref, c_char_p, c_int, c_uint64, c_void_p
lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOW | os.RTLD_LOCAL)
getproc = lib.cuGetProcAddress_v2
getproc.argtypes = [c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int)]
class Info(ctypes.Structure):
    _fields_ = [("fname", c_char_p), ("fbase", c_void_p), ("sname", c_char_p), ("saddr", c_void_p)]
dladdr = ctypes.CDLL(None).dladdr
dladdr.argtypes = [c_void_p, POINTER(Info)]
def where(p):
    i = Info()
    if not p or not dladdr(p, byref(i)) or i.saddr != p:
        return None
    return [os.path.basename(i.fname.decode()), i.sname.decode()]
def lookup_error(name):
    try:
        getattr(ctypes.CDLL(None), name)
    except AttributeError as e:
        return str(e)
out = {"getproc_v2": where(ctypes.cast(getproc, c_void_p).value),
       # wrapped by the shim, absent from simcuda: a global lookup must not find the wrapper either, and
       # must fail like dlsym does, with dlerror() set (ctypes formats it; NULL there crashed it)
       "absent_error": lookup_error("cuMemcpyAsync"),
       "present_found": where(ctypes.cast(ctypes.CDLL(None).cuMemAlloc_v2, c_void_p).value)}
for name, version, flags in json.loads(sys.argv[1]):
    p, st = c_void_p(), c_int(-1)
    r = getproc(name.encode(), byref(p), version, flags, byref(st))
    out[f"{name}@{version}/{flags}"] = [r, st.value, where(p.value)]
    if name == "cuGetProcAddress" and version >= 12000 and p.value:  # what the pointer it gave hands out
        f = ctypes.CFUNCTYPE(c_int, c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int))(p.value)
        q = c_void_p()
        f(b"cuLaunchKernel", byref(q), 13000, 2, byref(st))
        out[f"via {name}@{version}"] = where(q.value)
print(json.dumps(out))
"""


def test_get_proc_address_hands_out_wrappers_honoring_version_and_ptsz(shim_dir):
    queries = [
        ("cuLaunchKernel", 13000, 0), ("cuLaunchKernel", 13000, 2), ("cuMemcpyHtoD", 13000, 2),
        ("cuMemAllocAsync", 13000, 2), ("cuMemAllocAsync", 11010, 0), ("cuGetProcAddress", 12000, 0),
        ("cuGetProcAddress", 11030, 0), ("cuCtxGetCurrent", 13000, 0), ("cuCtxGetDevice", 12000, 0),
        ("cuMemGetInfo", 13000, 0), ("cuGetExportTable", 13000, 0), ("cuNoSuchFunction", 13000, 0),
    ]
    r = subprocess.run([sys.executable, "-c", GETPROC, json.dumps(queries)], env=shim.preload_env(simcuda.env()),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    S, D = shim.SONAME, "libcuda.so.1"
    assert got["getproc_v2"] == [S, "cuGetProcAddress_v2"]  # dlsym on the driver's handle gave the wrapper
    assert got["absent_error"].endswith("libcuda.so.1: undefined symbol: cuMemcpyAsync")
    assert got["present_found"] == [S, "cuMemAlloc_v2"]
    assert got["cuLaunchKernel@13000/0"] == [0, 0, [S, "cuLaunchKernel"]]
    assert got["cuLaunchKernel@13000/2"] == [0, 0, [S, "cuLaunchKernel_ptsz"]]
    assert got["cuMemcpyHtoD@13000/2"] == [0, 0, [S, "cuMemcpyHtoD_v2_ptds"]]
    assert got["cuMemAllocAsync@13000/2"] == [0, 0, [S, "cuMemAllocAsync_ptsz"]]
    assert got["cuMemAllocAsync@11010/0"] == [500, 2, None]  # too old a version: the driver's answer stands
    assert got["cuGetProcAddress@12000/0"] == [0, 0, [S, "cuGetProcAddress_v2"]]
    assert got["cuGetProcAddress@11030/0"] == [0, 0, [S, "cuGetProcAddress"]]
    assert got["via cuGetProcAddress@12000"] == [S, "cuLaunchKernel_ptsz"]
    # Wrapped, ungated, for the emulated layer alone (shim_api.h's SHIM_PASS).
    assert got["cuCtxGetCurrent@13000/0"] == [0, 0, [S, "cuCtxGetCurrent"]]
    assert got["cuCtxGetDevice@12000/0"][2][0] == S
    assert got["cuMemGetInfo@13000/0"] == [0, 0, [D, "cuMemGetInfo_v2"]]  # not wrapped: the driver's own
    assert got["cuGetExportTable@13000/0"] == [0, 0, [D, "cuGetExportTable"]]
    assert got["cuNoSuchFunction@13000/0"] == [500, 1, None]


FORK = r"""
import ctypes, json, os, socket, sys
lib = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_ulonglong()
assert lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and lib.cuCtxSetCurrent(ctx) == 0
assert lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(4096)) == 0
d = os.environ["GPUTRACE_SHIM_DIR"]
def ask(pid):
    s = socket.socket(socket.AF_UNIX)
    s.connect(f"{d}/shim-{pid}.sock")
    s.sendall(b"status\n")
    return json.loads(s.makefile().readline())
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.close(r)
    before = os.path.exists(f"{d}/shim-{os.getpid()}.sock")
    lib.cuMemAlloc_v2(ctypes.byref(ctypes.c_ulonglong()), ctypes.c_size_t(4096))  # the child's first call
    st = ask(os.getpid())
    os.write(w, json.dumps({"before": before, "pid": st["pid"], "threads": st["threads"]}).encode())
    os._exit(0)
os.close(w)
got = json.loads(os.fdopen(r).read())
os.waitpid(child, 0)
parent = ask(os.getpid())
print(json.dumps({"child": child, "got": got, "parent_pid": parent["pid"], "parent_allocs": len(parent["allocations"])}))
"""


def test_a_forked_child_serves_its_own_socket(shim_dir):
    r = subprocess.run([sys.executable, "-c", FORK], env=shim.preload_env(simcuda.env()), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["got"] == {"before": False, "pid": out["child"], "threads": 1}
    assert out["parent_pid"] != out["child"] and out["parent_allocs"] == 1


def test_no_server_in_a_directory_others_can_enter(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    env = shim.preload_env(simcuda.env())
    env["GPUTRACE_SHIM_DIR"] = str(open_dir)
    r = subprocess.run(simcuda.workload("launch_bound") + ["--steps", "1"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["check"] == "ok"  # the job runs on, only unserved
    assert f"not serving: {open_dir} must be a directory owned by uid {os.geteuid()} with mode 0700" in r.stderr
    assert list(open_dir.iterdir()) == []


EXTRA = r"""
import ctypes, json, os, sys
from ctypes import c_void_p, c_uint64, c_int, c_size_t, c_uint, c_ushort, byref, POINTER
me = ctypes.CDLL(None)  # global lookups: the preloaded shim's wrappers come first
stub = ctypes.CDLL(sys.argv[1])
args = (ctypes.c_ulonglong * 12).in_dll(stub, "stub_args")
def call(name, types, *vals):
    f = getattr(me, name)
    f.argtypes, f.restype = types, c_int
    assert f(*vals) == 0, name
    fn = ctypes.c_char_p.in_dll(stub, "stub_fn")
    n = c_int.in_dll(stub, "stub_nargs").value
    return [ctypes.string_at(ctypes.addressof(fn)).decode(), list(args[:n])]
out = {}
P = c_void_p
out["memcpy_async_ptsz"] = call("cuMemcpyAsync_ptsz", [c_uint64, c_uint64, c_size_t, P], 0x1111, 0x2222, 3333, 0x4444)
out["peer"] = call("cuMemcpyPeerAsync", [c_uint64, P, c_uint64, P, c_size_t, P], 1, 2, 3, 4, 5, 6)
out["memset16"] = call("cuMemsetD16Async", [c_uint64, c_ushort, c_size_t, P], 0x5000, 0xBEEF, 77, 0x99)
out["coop"] = call("cuLaunchCooperativeKernel", [P, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, P, P],
                   0xF00, 1, 2, 3, 4, 5, 6, 7, 0x5, 0x6)
out["hostfn"] = call("cuLaunchHostFunc_ptsz", [P, P, P], 0x10, 0x20, 0x30)
out["graph"] = call("cuGraphLaunch", [P, P], 0xAB, 0xCD)
out["record"] = call("cuEventRecordWithFlags", [P, P, c_uint], 0xE, 0xF, 1)
out["memcpy3d"] = call("cuMemcpy3DAsync_v2_ptsz", [P, P], 0x3D, 0x1)
dptr = ctypes.c_ulonglong()
out["managed"] = call("cuMemAllocManaged", [POINTER(ctypes.c_ulonglong), c_size_t, c_uint], byref(dptr), 1 << 20, 1)
buf = ctypes.create_string_buffer(8192)
out["register"] = call("cuMemHostRegister_v2", [P, c_size_t, c_uint], buf, 8192, 0)
mod, lib = c_void_p(), c_void_p()
img = b"PTX-ish text image\0"
out["modex"] = call("cuModuleLoadDataEx", [P, ctypes.c_char_p, c_uint, P, P], byref(mod), img, 0, None, None)
out["libfile"] = call("cuLibraryLoadFromFile", [P, ctypes.c_char_p, P, P, c_uint, P, P, c_uint],
                      byref(lib), sys.argv[1].encode(), None, None, 0, None, None, 0)
me.gputrace_shim_status_json.restype = c_size_t
n = me.gputrace_shim_status_json(None, 0)
b = ctypes.create_string_buffer(n + 1)
me.gputrace_shim_status_json(b, n + 1)
out["status"] = json.loads(b.value)
call("cuMemHostUnregister", [P], buf)
n = me.gputrace_shim_status_json(None, 0)
b = ctypes.create_string_buffer(n + 1)
me.gputrace_shim_status_json(b, n + 1)
out["after_unregister"] = json.loads(b.value)["allocations"]
getproc = me.cuGetProcAddress_v2
getproc.argtypes = [ctypes.c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int)]
p = c_void_p()
getproc(b"cuMemcpyAsync", byref(p), 13000, 2, None)
out["getproc_ptsz_is_wrapper"] = p.value == ctypes.cast(me.cuMemcpyAsync_ptsz, c_void_p).value
out["buf"] = ctypes.addressof(buf)
print(json.dumps(out))
"""


def test_wrappers_for_functions_simcuda_lacks_pass_arguments_through(tmp_path, shim_dir):
    from gputrace.base.native import build

    here = Path(__file__).resolve().parent
    stub = build("libstubcuda.so", [here / "native" / "stub_driver.c"], shared=True,
                 cflags=[f"-I{Path(shim.__file__).resolve().parent}", "-fvisibility=hidden"],
                 headers=[Path(shim.__file__).resolve().parent / "cuda_driver.h"])
    env = shim.preload_env()
    env["GPUTRACE_SHIM_LIBCUDA"] = str(stub)
    r = subprocess.run([sys.executable, "-c", EXTRA, str(stub)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    o = json.loads(r.stdout)
    assert o["memcpy_async_ptsz"] == ["cuMemcpyAsync_ptsz", [0x1111, 0x2222, 3333, 0x4444]]
    assert o["peer"] == ["cuMemcpyPeerAsync", [1, 2, 3, 4, 5, 6]]
    assert o["memset16"] == ["cuMemsetD16Async", [0x5000, 0xBEEF, 77, 0x99]]
    assert o["coop"] == ["cuLaunchCooperativeKernel", [0xF00, 1, 2, 3, 4, 5, 6, 7, 5, 6]]
    assert o["hostfn"] == ["cuLaunchHostFunc_ptsz", [0x10, 0x20, 0x30]]
    assert o["graph"] == ["cuGraphLaunch", [0xAB, 0xCD]]
    assert o["record"] == ["cuEventRecordWithFlags", [0xE, 0xF, 1]]
    assert o["memcpy3d"] == ["cuMemcpy3DAsync_v2_ptsz", [0x3D, 0x1]]
    assert o["managed"][0] == "cuMemAllocManaged" and o["managed"][1][1:] == [1 << 20, 1]
    assert o["modex"][0] == "cuModuleLoadDataEx" and o["libfile"][0] == "cuLibraryLoadFromFile"
    st = o["status"]
    allocs = {(a["kind"], a["base"], a["size"]) for a in st["allocations"]}
    assert allocs == {("managed", 0x7000000000, 1 << 20), ("host_registered", o["buf"], 8192)}
    mods = {(m["kind"], m["handle"], m["image_bytes"], m.get("path")) for m in st["modules"]}
    assert mods == {("module", 0xA0A0, len(b"PTX-ish text image") + 1, None),
                    ("library", 0xD0D0, os.path.getsize(stub), str(stub))}
    assert all(a["ctx"] == 0xC0C0 for a in st["allocations"] if a["kind"] == "managed")
    assert {a["kind"] for a in o["after_unregister"]} == {"managed"}
    assert o["getproc_ptsz_is_wrapper"] is True
    for fn in ("cuMemcpyAsync_ptsz", "cuLaunchCooperativeKernel", "cuGraphLaunch", "cuMemAllocManaged"):
        assert st["calls"][fn] == 1


def test_module_image_copy_through_the_control_api(monkeypatch):
    """What a checkpointer reads back in-process: the bytes a module was loaded from, after the
    program's own buffer is gone."""
    import ctypes

    import cffi

    monkeypatch.setenv("GPUTRACE_SHIM_LIBCUDA", str(simcuda.library_path()))
    drv = ctypes.CDLL(str(simcuda.library_path()))
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    assert drv.cuInit(0) == 0 and drv.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and drv.cuCtxSetCurrent(ctx) == 0
    lib = shim.open_in_process()
    ffi = cffi.FFI()  # two of the shim's driver wrappers, from the same object
    ffi.cdef("int cuModuleLoadData(void **module, const void *image); int cuModuleUnload(void *module);")
    wrappers = ffi.dlopen(str(shim.library_path()))
    image = simcuda.module_image({"k": ("spin", 1000)})
    buf = ffi.new("char[]", image)
    mod = ffi.new("void **")
    assert wrappers.cuModuleLoadData(mod, buf) == 0
    handle = int(ffi.cast("unsigned long long", mod[0]))
    ffi.memmove(buf, b"\0" * len(image), len(image))  # the program's copy is gone
    ctl = shim.ffi()
    n = lib.gputrace_shim_module_image(0, handle, ctl.NULL, 0)
    out = ctl.new("char[]", n)
    assert n == len(image) and lib.gputrace_shim_module_image(0, handle, out, n) == n
    assert ctl.buffer(out, n)[:] == image
    assert lib.gputrace_shim_module_image(1, handle, ctl.NULL, 0) == 0  # no library has that handle
    assert wrappers.cuModuleUnload(mod[0]) == 0
    assert lib.gputrace_shim_module_image(0, handle, ctl.NULL, 0) == 0
    drv.cuDevicePrimaryCtxRelease_v2(dev)
