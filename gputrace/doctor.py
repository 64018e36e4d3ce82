"""Can this host trace? Each check tries the real thing (a map, a compile, a uprobe) instead of reading versions.

UI-free: `run_checks()` returns frozen `Check`s; the CLI (`gputrace doctor`) prints them. A check never raises:
an unexpected exception becomes a FAIL carrying its text. A check that needs an earlier one which failed says
"skipped: needs X" rather than failing again for the same reason.

Environment (mainly so tests can degrade one thing without breaking the host):
  GPUTRACE_KERNEL_HEADERS  kernel headers directory to check instead of /lib/modules/$(uname -r)/build
  GPUTRACE_TRACEFS         tracefs mount point to check instead of /sys/kernel/tracing, /sys/kernel/debug/tracing
  GPUTRACE_BCC_PATH        where bcc is looked for (see gputrace.base.bccload)
  GPUTRACE_BPF             auto, object or bcc: how the tracer's BPF program is loaded (see gputrace.tracer.bpfprog)
  GPUTRACE_BPF_OBJECT      a BPF object file to load instead of the one built from bpf/

Where the precompiled BPF object loads (the bpf-program check), bcc and kernel headers are only its
fallback's needs: their checks then WARN rather than FAIL.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import struct
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator

from .base.errors import GputraceError, NoLibcuda, PermissionDenied
from .base.procs import CAP_SYS_ADMIN, comm, effective_caps, has_bpf_caps, require_root

OK, WARN, FAIL = "OK", "WARN", "FAIL"
SCHEMA = 1

CHECKPOINT_API = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)
NO_DRIVER_HINT = "no NVIDIA driver on this host: use simcuda for a demo (`gputrace demo`)"
SETUP_HINT = "run scripts/setup-host as root"
CAP_SYS_PTRACE = 19


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    detail: str
    hint: str = ""


class _Skip(Exception):
    """A check that cannot run because an earlier one failed."""

    def __init__(self, status: str, needs: str, hint: str = "") -> None:
        super().__init__(needs)
        self.status, self.needs, self.hint = status, needs, hint


# --- raw bpf(2) helpers over gputrace.tracer.links.bpf -------------------------------------------------------

BPF_MAP_CREATE, BPF_MAP_LOOKUP_ELEM, BPF_PROG_LOAD = 0, 1, 5
BPF_MAP_TYPE_ARRAY = 2
BPF_PROG_TYPE_KPROBE = 2
_ATTR_SIZE = 128


def _map_create_array(value_size: int = 8, entries: int = 1) -> int:
    from gputrace.tracer.links import bpf

    attr = bytearray(_ATTR_SIZE)
    struct.pack_into("IIII", attr, 0, BPF_MAP_TYPE_ARRAY, 4, value_size, entries)
    return bpf(BPF_MAP_CREATE, attr)


def _map_lookup_u64(map_fd: int, key: int = 0) -> int:
    from gputrace.tracer.links import bpf

    k = ctypes.c_uint32(key)
    v = ctypes.c_uint64(0)
    attr = bytearray(_ATTR_SIZE)
    struct.pack_into("IIQQ", attr, 0, map_fd, 0, ctypes.addressof(k), ctypes.addressof(v))
    err = bpf(BPF_MAP_LOOKUP_ELEM, attr)
    if err < 0:
        raise OSError(-err, f"bpf(BPF_MAP_LOOKUP_ELEM): {os.strerror(-err)}")
    return v.value


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def _counter_prog(map_fd: int) -> bytes:
    """A kprobe-type program that adds 1 to element 0 of an array map: proof that a probe fired."""
    return b"".join([
        _insn(0x62, dst=10, off=-4, imm=0),   # *(u32 *)(r10 - 4) = 0
        _insn(0xbf, dst=2, src=10),           # r2 = r10
        _insn(0x07, dst=2, imm=-4),           # r2 += -4
        _insn(0x18, dst=1, src=1, imm=map_fd), _insn(0),  # r1 = map (BPF_PSEUDO_MAP_FD)
        _insn(0x85, imm=1),                   # call bpf_map_lookup_elem
        _insn(0x15, dst=0, off=2, imm=0),     # if r0 == 0 goto +2
        _insn(0xb7, dst=1, imm=1),            # r1 = 1
        _insn(0xdb, dst=0, src=1, off=0),     # lock *(u64 *)(r0 + 0) += r1
        _insn(0xb7, dst=0, imm=0),            # r0 = 0
        _insn(0x95),                          # exit
    ])


def _kernel_version_code() -> int:
    nums = [int(x) for x in re.findall(r"\d+", os.uname().release)[:3]] + [0, 0, 0]
    return (nums[0] << 16) | (nums[1] << 8) | min(nums[2], 255)


def _prog_load(insns: bytes, prog_type: int = BPF_PROG_TYPE_KPROBE, expected_attach_type: int = 0) -> int:
    """Loads a program; on failure raises OSError whose text ends with the verifier's last line."""
    from gputrace.tracer.links import bpf

    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(65536)
    for log_level in (0, 1):  # the log only on a retry: it costs time and hides nothing on success
        attr = bytearray(_ATTR_SIZE)
        struct.pack_into("IIQQIIQII", attr, 0, prog_type, len(insns) // 8, ctypes.addressof(code),
                         ctypes.addressof(lic), log_level, len(log) if log_level else 0,
                         ctypes.addressof(log) if log_level else 0, _kernel_version_code(), 0)
        attr[48:48 + 15] = b"gputrace_doctor"[:15]
        struct.pack_into("II", attr, 64, 0, expected_attach_type)
        fd = bpf(BPF_PROG_LOAD, attr)
        if fd >= 0:
            return fd
        err = -fd
        if err in (errno.EPERM, errno.EACCES) and log_level == 0:
            break
    lines = [ln for ln in log.value.decode(errors="replace").splitlines() if ln.strip()]
    raise OSError(err, f"bpf(BPF_PROG_LOAD): {os.strerror(err)}" + (f" ({lines[-1]})" if lines else ""))


# --- ELF and process helpers -------------------------------------------------------------------------------------

def _own_libc() -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and re.fullmatch(r"libc(\.so\.\d+|-[\d.]+\.so)", os.path.basename(parts[5].strip())):
                return parts[5].strip()
    raise LookupError("this Python maps no shared C library (statically linked?)")


@contextlib.contextmanager
def _captured_output() -> Iterator[list[str]]:
    """Captures file descriptors 1 and 2, where libbcc and clang print: the check reports the useful line instead."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    out: list[str] = []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, orig in zip((1, 2), saved):
                os.dup2(orig, fd)
                os.close(orig)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def _useful_line(text: str, fallback: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # bcc's own diagnosis first (it names the cause), then clang's first error, then whatever came last.
    for pattern in (r"unable to find kernel headers", r"error:", r"error|failed|cannot"):
        for ln in lines:
            if re.search(pattern, ln, re.I):
                return ln[:300]
    return (lines[-1] if lines else fallback)[:300]


def _tracefs_mounts() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {ln.split(" - ", 1)[0].split()[4] for ln in f if " - tracefs " in ln}


# --- the checks ---------------------------------------------------------------------------------------------------

class _Doctor:
    def __init__(self) -> None:
        self.results: dict[str, Check] = {}
        self.bcc = None
        self.bpf = None  # the compiled bcc program of the bcc-compile check
        self.program_origin = None  # the bpf-program check's Program.origin
        self.libc: tuple[str, int] | None = None
        self.libcuda: str | None = None

    def plan(self) -> list[tuple[str, Callable[[], Check]]]:
        return [
            ("privileges", self.privileges),
            ("bpf-syscall", self.bpf_syscall),
            ("btf", self.btf),
            ("tracefs", self.tracefs),
            ("kernel-headers", self.kernel_headers),
            ("bcc", self.bcc_import),
            ("bcc-compile", self.bcc_compile),
            ("uprobes", self.uprobes),
            ("uprobe-multi", self.uprobe_multi),
            ("bpf-program", self.bpf_program),
            ("libcuda", self.libcuda_check),
            ("nvidia-driver", self.driver),
            ("checkpoint-api", self.checkpoint_api),
            ("criu", self.criu),
            ("native", self.native),
        ]

    def needs(self, name: str, status: str, hint: str = "") -> None:
        dep = self.results.get(name)
        if dep is None or dep.status == FAIL:
            raise _Skip(status, name, hint or f"see the {name} check above")

    def libc_target(self) -> tuple[str, int]:
        if self.libc is None:
            from gputrace.tracer.symbols import read_functions

            path = _own_libc()
            fn = next((f for f in read_functions(path, prefix="getpid") if f.name == "getpid"), None)
            if fn is None:
                raise LookupError(f"{path} exports no getpid")
            self.libc = (path, fn.offset)
        return self.libc

    # Each method returns the Check for its name; `run` fills in the name.

    def native(self) -> Check:
        """The shim and the calibration target: prebuilt in a wheel, else compiled here at first use."""
        from gputrace import shim
        from gputrace.base import native
        from gputrace.base.errors import BuildError
        from gputrace.tracer import calibtarget

        missing = [what for what, spec in (("the shim", shim.BUILD), ("the calibration target", calibtarget.BUILD))
                   if not native.is_prebuilt(spec)]
        if not missing:
            return Check("", OK, "the shim and the calibration target came built with the wheel: no compiler needed")
        try:
            cc = native.find_cc()
        except BuildError:
            return Check("", FAIL, f"{' and '.join(missing)} must be compiled here, and there is no C compiler",
                         "install one (apt-get install gcc), or install gputrace from its platform wheel, which "
                         "carries them built")
        return Check("", OK, f"{' and '.join(missing)} compiled at first use with {cc} (cached)")

    def privileges(self) -> Check:
        uid, caps = os.geteuid(), effective_caps()
        if has_bpf_caps():
            held = "CAP_SYS_ADMIN" if caps & (1 << CAP_SYS_ADMIN) else "CAP_BPF and CAP_PERFMON"
            who = "root (uid 0)" if uid == 0 else f"uid {uid} with {held}"
            if uid != 0 and not caps & (1 << CAP_SYS_PTRACE):
                who += "; without CAP_SYS_PTRACE other users' processes stay invisible"
            return Check("", OK, who)
        try:
            require_root("tracing")
        except PermissionDenied as exc:
            return Check("", FAIL, f"uid {uid}: {exc.msg}", exc.hint)
        return Check("", FAIL, "root, but CAP_BPF/CAP_PERFMON (or CAP_SYS_ADMIN) are not in effect (a container?)",
                     "run the container with --privileged, or with --cap-add BPF --cap-add PERFMON --cap-add SYS_PTRACE")

    def bpf_syscall(self) -> Check:
        fd = _map_create_array()
        if fd >= 0:
            os.close(fd)
            return Check("", OK, "created and closed a BPF array map")
        err = -fd
        detail = f"bpf(BPF_MAP_CREATE): {os.strerror(err)}"
        if err == errno.ENOSYS:
            return Check("", FAIL, detail, "the kernel is built without CONFIG_BPF_SYSCALL")
        if err in (errno.EPERM, errno.EACCES):
            return Check("", FAIL, detail, "needs root or CAP_BPF (see the privileges check)")
        return Check("", FAIL, f"{detail} (errno {err})", "run as root; check `ulimit -l` on kernels before 5.11")

    def btf(self) -> Check:
        path = "/sys/kernel/btf/vmlinux"
        try:
            with open(path, "rb") as f:
                magic = f.read(2)
        except OSError as exc:
            return Check("", WARN, f"{path}: {exc.strerror}",
                         "a kernel with CONFIG_DEBUG_INFO_BTF=y gives bcc type information; tracing works without it")
        if magic != b"\x9f\xeb":
            return Check("", WARN, f"{path} is not BTF (magic {magic.hex()})", "")
        return Check("", OK, f"{path} readable ({os.path.getsize(path) // 1024} KiB)")

    def tracefs(self) -> Check:
        override = os.environ.get("GPUTRACE_TRACEFS")
        candidates = [override] if override is not None else ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        for path in candidates:
            os.path.exists(os.path.join(path, "uprobe_events"))  # touching it triggers the debugfs automount
        mounted = _tracefs_mounts()
        for path in candidates:
            if os.path.realpath(path) in mounted or path in mounted:
                note = "" if os.access(path, os.R_OK | os.X_OK) else " (not readable by this user)"
                return Check("", OK, f"mounted at {path}{note}")
        # Whether this is fatal depends on uprobe-multi, checked later: run_checks() settles WARN or FAIL.
        return Check("", WARN, f"no tracefs mounted at {' or '.join(candidates)}; bcc's per-probe fallback needs it",
                     f"mount -t tracefs nodev {candidates[0]}")

    def kernel_headers(self) -> Check:
        release = os.uname().release
        override = os.environ.get("GPUTRACE_KERNEL_HEADERS")
        path = override if override is not None else os.environ.get("BCC_KERNEL_SOURCE") or f"/lib/modules/{release}/build"
        hint = (f"{SETUP_HINT}: it installs linux-headers-{release}, or where no package has them, the distribution's "
                "generic headers linked under /lib/modules")
        if path and os.path.isdir(os.path.join(path, "include")):
            real = os.path.realpath(path)
            detail = path if real == path else f"{path} -> {real}"
            if release not in real:
                detail += f" (not {release}'s own: bcc-compile shows whether they serve)"
            return Check("", OK, detail)
        if override is None and os.path.exists("/sys/kernel/kheaders.tar.xz"):
            return Check("", WARN, f"no headers at {path}; bcc falls back to /sys/kernel/kheaders.tar.xz", hint)
        what = "does not exist" if not (path and os.path.exists(path)) else "has no include/"
        return Check("", FAIL, f"{path or '(empty path)'} {what}", hint)

    def bcc_import(self) -> Check:
        from .base.bccload import import_bcc

        with _captured_output():
            self.bcc = import_bcc()
        where = os.path.dirname(os.path.abspath(self.bcc.__file__))
        version = getattr(self.bcc, "__version__", "unknown version")
        return Check("", OK, f"bcc {version} from {where}")

    def bcc_compile(self) -> Check:
        self.needs("bcc", FAIL)
        self.needs("kernel-headers", FAIL)
        with _captured_output() as err:
            try:
                self.bpf = self.bcc.BPF(text=b"int gputrace_doctor(void *ctx) { return 0; }")
            except Exception as exc:  # bcc raises plain Exception; clang's reason went to stderr
                failure = str(exc)
            else:
                failure = ""
        if failure:
            return Check("", FAIL, "cannot compile a trivial program: " + _useful_line(err[0], failure),
                         f"the kernel headers must suit the running kernel; {SETUP_HINT}")
        return Check("", OK, "compiled a trivial program")

    def uprobes(self) -> Check:
        from gputrace.tracer.links import uprobe_pmu, attach_perf

        self.needs("bpf-syscall", FAIL)
        ptype, _ = uprobe_pmu()
        path, off = self.libc_target()
        map_fd = _map_create_array()
        if map_fd < 0:
            raise OSError(-map_fd, f"bpf(BPF_MAP_CREATE): {os.strerror(-map_fd)}")
        try:
            prog_fd = _prog_load(_counter_prog(map_fd))
            try:
                with attach_perf(prog_fd, path, [off], [0], pid=os.getpid()):
                    for _ in range(3):
                        os.getpid()  # glibc no longer caches it: each call enters the probed function
                    hits = _map_lookup_u64(map_fd)
            finally:
                os.close(prog_fd)
        finally:
            os.close(map_fd)
        where = f"uprobe on getpid in {path} (+{off:#x}, uprobe PMU type {ptype})"
        if hits == 0:
            return Check("", FAIL, f"{where} attached but never fired", "uprobes do not work in this kernel or sandbox")
        return Check("", OK, f"{where} attached and fired {hits}x")

    def uprobe_multi(self) -> Check:
        from gputrace.tracer.links import BPF_TRACE_UPROBE_MULTI, multi_supported

        self.needs("bpf-syscall", WARN)
        path, off = self.libc_target()
        fallback = "falls back to per-probe attach; detach takes ~0.1 s per probe"
        map_fd = _map_create_array()
        if map_fd < 0:
            raise OSError(-map_fd, f"bpf(BPF_MAP_CREATE): {os.strerror(-map_fd)}")
        try:
            try:
                prog_fd = _prog_load(_counter_prog(map_fd), expected_attach_type=BPF_TRACE_UPROBE_MULTI)
            except OSError as exc:  # the kernel refused the attach type
                return Check("", WARN, f"a program for multi links does not load: {exc.strerror}: {fallback}",
                             "multi-uprobe links need Linux 6.6 or later")
            try:
                ok, why = multi_supported(prog_fd, path, off)
            finally:
                os.close(prog_fd)
        finally:
            os.close(map_fd)
        if ok:
            return Check("", OK, f"{why} (getpid in {os.path.basename(path)})")
        return Check("", WARN, f"{why}: {fallback}", "multi-uprobe links need Linux 6.6 or later with CONFIG_UPROBES")

    def bpf_program(self) -> Check:
        """Loads the tracer's own program as attach would, and says which way it came: the precompiled
        object, or bcc's run-time compile and why."""
        from gputrace.tracer.bpfprog import Program

        self.needs("bpf-syscall", FAIL)
        multi = self.results.get("uprobe-multi")
        mode = "multi" if multi is not None and multi.status == OK else "perf"
        with _captured_output():  # bcc, where it is the way, prints clang's and the verifier's chatter
            prog = Program(mode)
        origin = prog.origin
        prog.close()
        self.program_origin = origin
        if not origin.fallback:
            return Check("", OK, f"{origin.detail}, loaded for {mode} links")
        return Check("", WARN, origin.detail.replace("\n", " ")[:500],
                     f"{origin.fallback_hint}; meanwhile the tracer falls back to bcc")

    def libcuda_check(self) -> Check:
        from gputrace.tracer import targets

        try:
            loads = targets.resolve_for_command(["a CUDA job"])  # LD_LIBRARY_PATH, ldconfig, default dirs
        except NoLibcuda:
            loads = None
        mapped = targets.cuda_processes()
        self.libcuda = loads or (next(iter(mapped.values())).path if mapped else None)
        if not self.libcuda:
            return Check("", WARN, "no libcuda.so.1 to load (LD_LIBRARY_PATH, ldconfig) and none mapped by a process",
                         NO_DRIVER_HINT)
        parts = [f"{loads} (what a job started here loads)" if loads else "none for a job started here to load"]
        if mapped:
            try:  # processes on the library a job started here loads first: the ones that matter here
                st = os.stat(loads) if loads else None
            except OSError:
                st = None
            pids = sorted(mapped, key=lambda p: (st is None or (mapped[p].dev, mapped[p].inode) != (st.st_dev, st.st_ino), p))
            shown = ", ".join(f"{pid} ({comm(pid)})" for pid in pids[:5]) + (" ..." if len(pids) > 5 else "")
            files = {(f.dev, f.inode) for f in mapped.values()}
            parts.append(f"mapped by {len(pids)} process{'es' if len(pids) > 1 else ''}"
                         + (f" ({len(files)} distinct files)" if len(files) > 1 else "") + f": {shown}")
        else:
            parts.append("mapped by no running process")
        return Check("", OK, "; ".join(parts))

    def driver(self) -> Check:
        version = ""
        for path in ("/sys/module/nvidia/version", "/proc/driver/nvidia/version"):
            try:
                with open(path) as f:
                    m = re.search(r"\b(\d+\.\d+(?:\.\d+)?)\b", f.read())
            except OSError:
                continue
            if m:
                version, source = m.group(1), path
                break
        if not version:
            return Check("", WARN, "no NVIDIA kernel module loaded (/sys/module/nvidia, /proc/driver/nvidia)", NO_DRIVER_HINT)
        lib_version = re.search(r"libcuda\.so\.(\d+\.\d+(?:\.\d+)?)$", self.libcuda or "")
        if lib_version and lib_version.group(1) != version:
            return Check("", WARN, f"kernel module {version} but {self.libcuda} is {lib_version.group(1)}",
                         "user-space driver and kernel module differ: reboot or reinstall the driver")
        return Check("", OK, f"{version} (from {source})")

    def checkpoint_api(self) -> Check:
        if not self.libcuda:
            raise _Skip(WARN, "libcuda", NO_DRIVER_HINT)
        from gputrace.tracer.symbols import read_functions

        fns = read_functions(self.libcuda, prefix="cuCheckpointProcess")
        names = {f.name for f in fns} | {a for f in fns for a in f.aliases}
        missing = [n for n in CHECKPOINT_API if n not in names]
        if missing:
            return Check("", WARN, f"{self.libcuda} lacks {', '.join(missing)}",
                         "driver checkpointing needs a newer NVIDIA driver; tracing works without it")
        return Check("", OK, f"{self.libcuda} exports cuCheckpointProcess{{Lock,Checkpoint,Restore,Unlock}}")

    def criu(self) -> Check:
        from gputrace.checkpointer import criu

        try:
            c = criu.find()
        except criu.CriuUnavailable as exc:
            return Check("", WARN, exc.msg, exc.hint + "; only `gputrace checkpoint --full` needs it")
        ok, line = criu.check(c)
        if not ok:
            if os.geteuid() != 0:
                # Not the kernel: `criu check` needs root (or CAP_CHECKPOINT_RESTORE) to look.
                return Check("", WARN, f"criu {c.version_str} at {c.path}: `criu check` fails as uid {os.geteuid()}: {line}",
                             "criu needs root to check this kernel: run `sudo gputrace doctor`; "
                             "`gputrace checkpoint --full` runs as root")
            return Check("", WARN, f"criu {c.version_str} at {c.path}: `criu check` fails: {line}",
                         "this kernel lacks what CRIU needs; `gputrace checkpoint --full` will fail here")
        if not c.allows_uprobes:
            return Check("", WARN, f"criu {c.version_str} at {c.path} passes `criu check` but cannot dump a job that "
                         "a uprobe tracer (gputrace attach or top) has probed",
                         "scripts/install-criu installs CRIU >= 4.2 (--allow-uprobes); until then such a job is "
                         "refused by `checkpoint --full`")
        return Check("", OK, f"criu {c.version_str} at {c.path}; `criu check`: {line}")

    def cleanup(self) -> None:
        if self.bpf is not None:
            with contextlib.suppress(Exception):
                self.bpf.cleanup()


def _run_one(name: str, fn: Callable[[], Check]) -> Check:
    try:
        c = fn()
        return Check(name, c.status, c.detail, c.hint)
    except _Skip as s:
        return Check(name, s.status, f"skipped: needs {s.needs}", s.hint)
    except GputraceError as exc:
        return Check(name, FAIL, exc.msg, exc.hint)
    except Exception as exc:  # a check must report, never raise
        return Check(name, FAIL, f"{type(exc).__name__}: {exc}", "")


def run_checks() -> tuple[Check, ...]:
    d = _Doctor()
    try:
        for name, fn in d.plan():
            d.results[name] = _run_one(name, fn)
    finally:
        d.cleanup()
    if d.program_origin is not None and d.program_origin.loader == "object":
        # The precompiled object loaded: bcc, its compiler and the kernel headers only serve its fallback.
        for name in ("kernel-headers", "bcc", "bcc-compile"):
            c = d.results.get(name)
            if c is not None and c.status == FAIL:
                hint = f"{c.hint}; " if c.hint else ""
                d.results[name] = Check(name, WARN, c.detail, f"{hint}only the bcc fallback needs this: the "
                                        "precompiled BPF object is in use (see bpf-program)")
    t, multi = d.results.get("tracefs"), d.results.get("uprobe-multi")
    if t and t.status == WARN and t.detail.startswith("no tracefs") and multi and multi.status != OK:
        # Without multi links bcc's per-probe path is all there is, and it needs tracefs.
        d.results["tracefs"] = Check(t.name, FAIL, t.detail, t.hint)
    return tuple(d.results.values())


def worst(checks: tuple[Check, ...]) -> str:
    statuses = {c.status for c in checks}
    return FAIL if FAIL in statuses else WARN if WARN in statuses else OK
