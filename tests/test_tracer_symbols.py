"""classify, symbols and targets against a small fake libcuda built here; no root, BPF or GPU needed."""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from gputrace.base import native, procs
from gputrace.base.errors import NoLibcuda, NoSuchProcess, PermissionDenied, UsageError
from gputrace.tracer import targets
from gputrace.tracer.classify import CLASS_ORDER, DEFAULT_CLASS, FunctionClass, base_name, classify, rule_for
from gputrace.tracer.symbols import read_functions
from gputrace.tracer.targets import cuda_processes, is_libcuda, libcuda_of, resolve_for_command

# Distinct constants keep the compiler from folding bodies together (-fipa-icf is on at -O2).
FAKE_SRC = r"""
int cuInit(unsigned flags) { return (int)flags + 101; }
int cuStreamSynchronize(void *s) { return s ? 102 : 103; }
int cuLaunchKernel(void *f, unsigned gx) { return (int)gx * 104 + (f != 0); }
int cuMemAlloc_v2(unsigned long long *p, unsigned long n) { *p = n * 105; return 0; }
int cuMemcpyHtoDAsync_v2_ptsz(void *d, const void *s, unsigned long n) { return (int)n * 106 + (d == s); }
int cuCtxDestroy(void *c) { return c ? 107 : 108; }
int cuCtxDestroy_v2(void *c) __attribute__((alias("cuCtxDestroy")));
int helper_not_cu(int x) { return x * 109; }
/* cuMemFree in two versions: the default (@@) must win over the old hidden (@) one. */
int old_free(void *p) { return p ? 110 : 111; }
int new_free(void *p) { return p ? 112 : 113; }
__asm__(".symver old_free, cuMemFree@LIBCUDA_OLD");
__asm__(".symver new_free, cuMemFree@@libcuda.so.1");
"""
FAKE_MAP = """LIBCUDA_OLD { global: cuMemFree; local: *; };
libcuda.so.1 { global: cu*; helper_not_cu; local: *; } LIBCUDA_OLD;
"""
EXPECTED = {
    "cuCtxDestroy", "cuInit", "cuLaunchKernel", "cuMemAlloc_v2", "cuMemFree", "cuMemcpyHtoDAsync_v2_ptsz", "cuStreamSynchronize",
}


def _stable_input(name: str, text: str) -> Path:
    # The build cache hashes flags, not the version script they name: give the script a content-named path.
    path = native.cache_root() / "test-inputs" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}-{name}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


@pytest.fixture(scope="session")
def fake_lib() -> Path:
    src = _stable_input("fake_libcuda.c", FAKE_SRC)
    script = _stable_input("fake_libcuda.map", FAKE_MAP)
    # .text placed far above its file offset, so that offset != st_value and the translation is exercised.
    ldflags = [f"-Wl,--version-script={script}", "-Wl,--section-start=.text=0x100000"]
    return native.build("libcuda.so.1", [src], shared=True, soname="libcuda.so.1", ldflags=ldflags)


@contextmanager
def child(lib: Path | None) -> Iterator[subprocess.Popen[str]]:
    """A Python child that (optionally) loads `lib`, says "ready", and lives until its stdin closes."""
    load = f"import ctypes; ctypes.CDLL({str(lib)!r}); " if lib else ""
    code = load + "import sys; print('ready', flush=True); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


# --- classify ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name, cls",
    [
        ("cuLaunchKernel", FunctionClass.SUBMISSION),
        ("cuLaunchKernel_ptsz", FunctionClass.SUBMISSION),
        ("cuLaunchHostFunc", FunctionClass.SUBMISSION),
        ("cuMemcpyHtoDAsync_v2_ptsz", FunctionClass.SUBMISSION),
        ("cuMemcpyDtoH_v2", FunctionClass.SUBMISSION),  # synchronous copy: still submission, by design
        ("cuMemcpy_ptds", FunctionClass.SUBMISSION),
        ("cuMemsetD32Async_ptsz", FunctionClass.SUBMISSION),
        ("cuEventRecord", FunctionClass.SUBMISSION),
        ("cuEventRecordWithFlags_ptsz", FunctionClass.SUBMISSION),
        ("cuStreamWaitEvent_ptsz", FunctionClass.SUBMISSION),
        ("cuGraphLaunch_ptsz", FunctionClass.SUBMISSION),
        ("cuStreamWriteValue32_v2", FunctionClass.SUBMISSION),
        ("cuStreamWaitValue64_v2_ptsz", FunctionClass.SUBMISSION),
        ("cuMemPrefetchAsync_v2", FunctionClass.SUBMISSION),
        ("cuStreamSynchronize", FunctionClass.SYNC),
        ("cuStreamSynchronize_ptsz", FunctionClass.SYNC),
        ("cuEventSynchronize", FunctionClass.SYNC),
        ("cuCtxSynchronize_v2", FunctionClass.SYNC),
        ("cuInit", FunctionClass.STATE),
        ("cuMemAlloc_v2", FunctionClass.STATE),
        ("cuMemAllocAsync_ptsz", FunctionClass.STATE),
        ("cuMemFree_v2", FunctionClass.STATE),
        ("cuMemCreate", FunctionClass.STATE),
        ("cuMemMap", FunctionClass.STATE),
        ("cuMemAddressReserve", FunctionClass.STATE),
        ("cuMemSetAccess", FunctionClass.STATE),
        ("cuMemHostRegister_v2", FunctionClass.STATE),
        ("cuMemPoolSetAttribute", FunctionClass.STATE),
        ("cuCtxCreate_v3", FunctionClass.STATE),
        ("cuCtxSetCurrent", FunctionClass.STATE),
        ("cuCtxPopCurrent_v2", FunctionClass.STATE),
        ("cuDevicePrimaryCtxRetain", FunctionClass.STATE),
        ("cuDevicePrimaryCtxSetFlags_v2", FunctionClass.STATE),
        ("cuModuleLoadData", FunctionClass.STATE),
        ("cuLibraryUnload", FunctionClass.STATE),
        ("cuStreamCreate", FunctionClass.STATE),
        ("cuStreamDestroy_v2", FunctionClass.STATE),
        ("cuStreamBeginCapture_v2_ptsz", FunctionClass.STATE),
        ("cuEventCreate", FunctionClass.STATE),
        ("cuGraphInstantiateWithFlags", FunctionClass.STATE),
        ("cuGraphAddKernelNode_v2", FunctionClass.STATE),
        ("cuIpcGetMemHandle", FunctionClass.STATE),  # a "getter" that exports memory
        ("cuDeviceGetAttribute", FunctionClass.QUERY),
        ("cuDeviceGet", FunctionClass.QUERY),
        ("cuCtxGetCurrent", FunctionClass.QUERY),
        ("cuCtxGetDevice", FunctionClass.QUERY),
        ("cuMemGetInfo_v2", FunctionClass.QUERY),
        ("cuOccupancyMaxPotentialBlockSize", FunctionClass.QUERY),
        ("cuStreamIsCapturing_ptsz", FunctionClass.QUERY),
        ("cuStreamQuery_ptsz", FunctionClass.QUERY),
        ("cuEventQuery", FunctionClass.QUERY),
        ("cuPointerGetAttribute", FunctionClass.QUERY),
        ("cuFuncGetAttribute", FunctionClass.QUERY),
        ("cuGetProcAddress_v2", FunctionClass.QUERY),
        ("cuGetErrorString", FunctionClass.QUERY),
        ("cuStreamGetCaptureInfo_v2_ptsz", FunctionClass.QUERY),
        ("cuProfilerStart", FunctionClass.QUERY),
        ("cudbgApiInit", FunctionClass.QUERY),
        ("cuGLMapBufferObject_v2_ptds", FunctionClass.STATE),
        ("cuEGLStreamConsumerAcquireFrame", FunctionClass.STATE),
        ("cuVDPAUGetDevice", FunctionClass.QUERY),
    ],
)
def test_classify(name: str, cls: FunctionClass) -> None:
    assert classify(name) is cls


def test_base_name_strips_only_abi_suffixes() -> None:
    assert base_name("cuMemcpyHtoDAsync_v2_ptsz") == "cuMemcpyHtoDAsync"
    assert base_name("cuMemcpy_ptds") == "cuMemcpy"
    assert base_name("cuStreamGetCaptureInfo_v3") == "cuStreamGetCaptureInfo"
    assert base_name("cuInit") == "cuInit"


def test_unknown_names_default_to_state() -> None:
    assert DEFAULT_CLASS is FunctionClass.STATE
    assert rule_for("cuSomethingFromTheFuture") is None
    assert classify("cuSomethingFromTheFuture") is FunctionClass.STATE


def test_class_order_and_values() -> None:
    assert sorted(CLASS_ORDER) == sorted(FunctionClass) and len(CLASS_ORDER) == len(FunctionClass)
    assert [c.value for c in CLASS_ORDER] == ["submission", "synchronization", "state", "query"]


def _cuda_headers() -> list[str]:
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*")), "/usr"]
    return [h for r in roots if r and os.path.isfile(h := os.path.join(r, "include", "cuda.h"))]


@pytest.mark.skipif(not _cuda_headers(), reason="no cuda.h (CUDA toolkit) on this machine")
def test_every_driver_function_in_cuda_h_has_a_rule() -> None:
    text = Path(_cuda_headers()[0]).read_text(errors="replace")
    names = set(re.findall(r"CUDAAPI\s+(cu\w+)\s*\(", text))
    assert len(names) > 300
    assert [n for n in sorted(names) if rule_for(n) is None] == []


# --- symbols ----------------------------------------------------------------------------------

def test_read_functions_names_dedup_aliases(fake_lib: Path) -> None:
    funcs = read_functions(fake_lib)
    assert [f.name for f in funcs] == sorted(EXPECTED)  # sorted, cu-only, no "@@libcuda.so.1", suffixes kept
    by_name = {f.name: f for f in funcs}
    assert by_name["cuCtxDestroy"].aliases == ("cuCtxDestroy_v2",)  # shortest name is canonical
    assert all(f.aliases == () for f in funcs if f.name != "cuCtxDestroy")
    assert len({f.address for f in funcs}) == len(funcs)
    assert by_name["cuStreamSynchronize"].cls is FunctionClass.SYNC
    assert by_name["cuMemcpyHtoDAsync_v2_ptsz"].cls is FunctionClass.SUBMISSION
    assert by_name["cuMemAlloc_v2"].cls is FunctionClass.STATE
    assert all(f.size > 0 for f in funcs)
    assert read_functions(fake_lib, prefix="helper_")[0].name == "helper_not_cu"


def test_offsets_hold_the_loaded_code(fake_lib: Path) -> None:
    """Independent check: the bytes at `offset` in the file are the bytes the loader put at the symbol."""
    lib = ctypes.CDLL(str(fake_lib))
    data = fake_lib.read_bytes()
    funcs = read_functions(fake_lib)
    assert all(f.offset != f.address for f in funcs)
    loaded = {f.name: ctypes.cast(getattr(lib, f.name), ctypes.c_void_p).value for f in funcs}
    for f in funcs:
        addr = loaded[f.name]
        assert addr is not None
        assert ctypes.string_at(addr, 16) == data[f.offset : f.offset + 16], f.name
        # st_value differences equal load-address differences (one base for the whole object).
        assert addr - f.address == loaded[funcs[0].name] - funcs[0].address
    # That includes cuMemFree: dlsym returns its default version (@@), whose body differs from the hidden one's.


def test_read_functions_is_cached_by_file_identity(fake_lib: Path, tmp_path: Path) -> None:
    link = tmp_path / "libcuda.so.1"
    link.symlink_to(fake_lib)
    assert read_functions(link) is read_functions(fake_lib)


def test_read_functions_errors(tmp_path: Path) -> None:
    with pytest.raises(NoLibcuda) as err:
        read_functions(tmp_path / "missing.so")
    assert err.value.hint
    text = tmp_path / "libcuda.so.1"
    text.write_text("not an ELF file\n")
    with pytest.raises(NoLibcuda, match="not an ELF") as err:
        read_functions(text)
    assert err.value.hint
    truncated = tmp_path / "truncated.so"
    truncated.write_bytes(b"\x7fELF\x02\x01\x01" + b"\0" * 9)
    with pytest.raises(NoLibcuda):
        read_functions(truncated)


# --- targets ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["libcuda.so", "libcuda.so.1", "libcuda.so.550.54.14", "/usr/lib64/libcuda.so.1"])
def test_is_libcuda(name: str) -> None:
    assert is_libcuda(name)


@pytest.mark.parametrize("name", ["libcudart.so.12", "libcudnn.so.9", "libcuda_stub.so", "libcuda.so.1.bak", "libcuda.a"])
def test_is_not_libcuda(name: str) -> None:
    assert not is_libcuda(name)


def test_libcuda_of_finds_the_mapped_file(fake_lib: Path) -> None:
    with child(fake_lib) as proc:
        lib = libcuda_of(proc.pid)
        st = os.stat(fake_lib)
        assert os.path.samefile(lib.path, fake_lib)
        assert lib.mapped_as == os.path.realpath(fake_lib)
        assert (lib.dev, lib.inode) == (st.st_dev, st.st_ino)
        assert lib in cuda_processes().values() and cuda_processes()[proc.pid] == lib


def test_libcuda_of_through_proc_root(fake_lib: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a process in another mount namespace (a container) gets: the same file via /proc/PID/root.
    monkeypatch.setattr(targets, "_same_mount_ns", lambda pid: False)
    with child(fake_lib) as proc:
        lib = libcuda_of(proc.pid)
        assert lib.path == f"/proc/{proc.pid}/root{os.path.realpath(fake_lib)}"
        assert (lib.dev, lib.inode) == (os.stat(fake_lib).st_dev, os.stat(fake_lib).st_ino)


def test_libcuda_of_without_libcuda() -> None:
    with child(None) as proc:
        with pytest.raises(NoLibcuda) as err:
            libcuda_of(proc.pid)
        assert "attach" in err.value.hint
        assert proc.pid not in cuda_processes()


def test_libcuda_of_dead_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(NoSuchProcess):
        libcuda_of(proc.pid)


def test_scanner_rereads_processes_without_libcuda_but_never_unmapped_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    # Kernel threads (and zombies) have no memory map: a libcuda can never appear in one. Here
    # every even pid reads as unmapped, every odd one as a process without libcuda.
    reads: dict[int, int] = {}

    def maps(pid: int) -> str:
        reads[pid] = reads.get(pid, 0) + 1
        return "" if pid % 2 == 0 else "55d4c0000000-55d4c0001000 r-xp 00000000 fe:00 12 /usr/bin/true\n"

    monkeypatch.setattr(targets, "_maps", maps)
    scan = targets.CudaScanner(recheck_every=5)
    before = {int(e) for e in os.listdir("/proc") if e.isdigit()}
    for _ in range(6):
        assert scan() == {}
    stayed = before & {int(e) for e in os.listdir("/proc") if e.isdigit()}
    assert {p: reads[p] for p in stayed if p % 2 == 0} == {p: 1 for p in stayed if p % 2 == 0}
    assert {p: reads[p] for p in stayed if p % 2} == {p: 2 for p in stayed if p % 2}  # the first call and the 6th


def test_scanner_lists_proc_only_when_a_pid_was_handed_out_or_to_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    listings: list[int] = []
    last = [100]
    monkeypatch.setattr(targets, "_pids", lambda: listings.append(last[0]) or {1, 2, 3})
    monkeypatch.setattr(targets, "_last_pid", lambda: last[0])
    monkeypatch.setattr(targets, "_maps", lambda pid: "55d4c0000000-55d4c0001000 r-xp 00000000 fe:00 12 /usr/bin/true\n")
    scan = targets.CudaScanner(recheck_every=5)
    for _ in range(3):
        scan()
    assert listings == [100]  # the first call lists; nothing new since
    last[0] = 101  # a process (or thread) was created: listed at the next call
    scan()
    scan()
    assert listings == [100, 101]
    scan()  # the 6th call rechecks, and lists again
    assert listings == [100, 101, 101]


def _may_open_map_files() -> bool:
    caps = procs.effective_caps()
    return bool(caps & (1 << procs.CAP_SYS_ADMIN)) or bool(caps & (1 << 40))  # 40: CAP_CHECKPOINT_RESTORE


def test_libcuda_of_deleted_file(fake_lib: Path, tmp_path: Path) -> None:
    copy = tmp_path / "libcuda.so.1"
    shutil.copy(fake_lib, copy)
    with child(copy) as proc:
        copy.unlink()
        if not _may_open_map_files():
            with pytest.raises(PermissionDenied) as err:
                libcuda_of(proc.pid)
            assert "map_files" in err.value.hint
            return
        lib = libcuda_of(proc.pid)
        assert lib.mapped_as == f"{os.path.realpath(tmp_path)}/libcuda.so.1 (deleted)"
        assert lib.path.startswith(f"/proc/{proc.pid}/map_files/")
        assert [f.name for f in read_functions(lib.path)] == sorted(EXPECTED)


def test_resolve_honours_ld_library_path(fake_lib: Path, tmp_path: Path) -> None:
    empty, decoy, real = tmp_path / "empty", tmp_path / "decoy", tmp_path / "real"
    for d in (empty, decoy, real):
        d.mkdir()
    (decoy / "libcuda.so.1").write_text("not ELF: the dynamic linker skips it\n")
    shutil.copy(fake_lib, real / "libcuda.so.1")
    env = {"LD_LIBRARY_PATH": f"{empty}:{decoy}:{real}"}
    assert resolve_for_command(["python", "train.py"], env) == str(real / "libcuda.so.1")
    assert resolve_for_command(["python"], env, search_system=False) == str(real / "libcuda.so.1")


def test_resolve_returns_the_real_path(fake_lib: Path, tmp_path: Path) -> None:
    (tmp_path / "libcuda.so.1").symlink_to(fake_lib)
    found = resolve_for_command(["x"], {"LD_LIBRARY_PATH": str(tmp_path)}, search_system=False)
    assert found == os.path.realpath(fake_lib)


def test_resolve_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(NoLibcuda) as err:
        resolve_for_command(["python", "train.py"], {"LD_LIBRARY_PATH": str(tmp_path)}, search_system=False)
    assert "LD_LIBRARY_PATH" in err.value.hint
    with pytest.raises(UsageError):
        resolve_for_command([], {})


@pytest.mark.parametrize("name, waits_", [
    ("cuStreamSynchronize", True), ("cuCtxSynchronize", True), ("cuEventSynchronize", True),
    ("cuMemcpyDtoH_v2", True), ("cuMemcpyDtoH_v2_ptds", True), ("cuMemcpy", True), ("cuMemcpy3DPeer", True),
    ("cuMemcpyHtoDAsync_v2", False), ("cuMemcpyDtoHAsync_v2_ptsz", False), ("cuMemcpyBatchAsync", False),
    ("cuMemsetD32_v2", False), ("cuLaunchKernel", False), ("cuStreamQuery", False), ("cuEventQuery", False),
])
def test_calls_that_wait_for_the_gpu(name, waits_):
    """Synchronization calls and synchronous copies: their time is the slack a layer's cost can hide in."""
    from gputrace.tracer.classify import waits

    assert waits(name) is waits_

