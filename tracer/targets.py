"""Which libcuda a process uses, or a command will use: the file the uprobes go on.

A process may see its libcuda through another mount namespace (a container) or keep mapping one
that has since been deleted (a driver upgrade under a running job). `LibcudaFile.path` is always a
path this process can open; `dev` and `inode` identify the file, so the tracer attaches once per
distinct file however many processes map it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Iterable, Mapping

from gputrace.base.errors import GputraceError, NoLibcuda, NoSuchProcess, PermissionDenied, UsageError
from gputrace.base.procs import alive, descendants, require_process

SONAME = "libcuda.so.1"
_LIBCUDA = re.compile(r"libcuda\.so(\.\d+)*")  # not libcudart, libcudnn, libcuda_foo
_DELETED = " (deleted)"
_MULTIARCH = f"{os.uname().machine}-linux-gnu"
DEFAULT_DIRS = (f"/lib/{_MULTIARCH}", f"/usr/lib/{_MULTIARCH}", "/lib64", "/usr/lib64", "/lib", "/usr/lib")

_NOT_LOADED_HINT = (
    "start the job under the tracer with `gputrace attach -- COMMAND` to catch it from the start; "
    "a process that has not initialised CUDA yet maps no libcuda"
)


@dataclass(frozen=True)
class LibcudaFile:
    path: str  # host-visible path to open (/proc/PID/root/... or /proc/PID/map_files/... where needed)
    mapped_as: str  # the path as the process maps it, verbatim from /proc/PID/maps (may end in " (deleted)")
    dev: int
    inode: int


def is_libcuda(path: str) -> bool:
    return _LIBCUDA.fullmatch(os.path.basename(path)) is not None


def libcuda_of(pid: int) -> LibcudaFile:
    require_process(pid)
    try:
        found = _libcuda_in(pid, by_soname=True)
    except (FileNotFoundError, ProcessLookupError):
        raise NoSuchProcess(f"process {pid} exited", "check the pid with `ps -p PID`; the job may have exited") from None
    except PermissionError:
        raise PermissionDenied(
            f"cannot read the memory maps or libcuda of process {pid}",
            "run as root, or as the process's user with ptrace allowed (kernel.yama.ptrace_scope)",
        ) from None
    if found is None:
        if not alive(pid):
            raise NoSuchProcess(f"process {pid} has exited", "check the pid with `ps -p PID`; the job may have ended")
        raise NoLibcuda(f"process {pid} has no libcuda loaded", _NOT_LOADED_HINT)
    return found


def cuda_processes() -> dict[int, LibcudaFile]:
    """Every process on the host that maps a libcuda; ones that vanish or are unreadable are skipped."""
    found: dict[int, LibcudaFile] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            lib = _libcuda_in(int(entry))
        except (OSError, GputraceError):
            continue
        if lib is not None:
            found[int(entry)] = lib
    return found


class TreeScanner:
    """A scanner's processes, only those in the tree of one process (a launcher and its ranks, and
    any it starts later; what `top --tree PID` shows) and those of `pids` (`attach -p A,B`)."""

    def __init__(self, root: int | None, inner: "CudaScanner", pids: Iterable[int] = ()) -> None:
        self.root, self.inner, self.pids = root, inner, frozenset(pids)
        self.forget = getattr(inner, "forget", None)

    def __call__(self, hints: Iterable[int] = ()) -> dict[int, LibcudaFile]:
        keep = set(descendants(self.root)) if self.root is not None else set()
        keep |= self.pids
        return {p: lib for p, lib in self.inner(hints).items() if p in keep}


class CudaScanner:
    """cuda_processes() for a caller that asks every second (top): reading every process's maps
    each time was most of top's own CPU. Processes seen for the first time are read at once, and
    so are `hints` (pids the caller has other evidence for: a tracer's links without a pid filter
    count the calls of any process that maps a file already traced); the rest of the processes
    without a libcuda are read again every `recheck_every`-th call, since one may load it late,
    except those with no memory map at all (kernel threads, about half the pids of a quiet host,
    and zombies), which never will. /proc itself is listed only when a pid has been handed out
    since the last listing (the kernel's last pid, in /proc/loadavg, moved), and at those
    rechecks: listing it is most of a scan's cost, and on a GPU host of long jobs mostly finds the
    same processes. An exit in between is told by forget() (top's tracer watches the processes it
    traces) or seen at the next listing."""

    def __init__(self, recheck_every: int = 5) -> None:
        self.recheck_every = recheck_every
        self._cuda: dict[int, LibcudaFile] = {}
        self._other: set[int] = set()
        self._unmapped: set[int] = set()
        self._calls = 0
        self._last_pid: int | None = None

    def __call__(self, hints: Iterable[int] = ()) -> dict[int, LibcudaFile]:
        recheck = self._calls % self.recheck_every == 0
        last = _last_pid()
        if recheck or last is None or last != self._last_pid:
            pids = _pids()
            self._last_pid = last
        else:
            pids = self._cuda.keys() | self._other | self._unmapped
        cuda = {p: lib for p, lib in self._cuda.items() if p in pids}
        other = self._other & pids
        unmapped = self._unmapped & pids
        check = pids - cuda.keys() - other - unmapped
        check |= (set(hints) & pids) - cuda.keys()
        if recheck:
            check |= other
        self._calls += 1
        for pid in check:
            try:
                text = _maps(pid)
                lib = _libcuda_in(pid, text)
            except (OSError, GputraceError):
                text, lib = None, None
            if lib is not None:
                cuda[pid] = lib
                other.discard(pid)
            elif text == "":
                unmapped.add(pid)
            else:
                other.add(pid)
        self._cuda, self._other, self._unmapped = cuda, other, unmapped
        return dict(cuda)

    def forget(self, pid: int) -> None:
        """`pid` exited: if the number comes back, it is another process, to be read afresh."""
        self._cuda.pop(pid, None)
        self._other.discard(pid)
        self._unmapped.discard(pid)


def _pids() -> set[int]:
    return {int(e) for e in os.listdir("/proc") if e.isdigit()}


def _last_pid() -> int | None:
    """The pid the kernel handed out last (in this pid namespace), None if unreadable."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[4])
    except (OSError, IndexError, ValueError):
        return None


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


@functools.lru_cache(maxsize=1024)
def _soname(path: str, dev: int, inode: int) -> str | None:
    """DT_SONAME of the shared object at `path` (cached by file identity), None if it has none."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    try:
        with open(path, "rb") as f:
            for sec in ELFFile(f).iter_sections():
                if isinstance(sec, DynamicSection):
                    for tag in sec.iter_tags("DT_SONAME"):
                        return tag.soname
    except (OSError, ELFError, ValueError):
        return None
    return None


def _by_soname(pid: int, text: str) -> bool:
    """Whether an executable mapping of the process is a libcuda under another file name (a driver
    installed as libnvcuda-580.so and reached through a libcuda.so.1 symbolic link: maps name the
    file, not the link), by its ELF soname."""
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or "x" not in fields[1] or ".so" not in fields[5] or not fields[5].startswith("/"):
            continue
        path = _host_path(pid, fields[0], fields[5])
        try:
            st = os.stat(path)
        except OSError:
            continue
        if _soname(path, st.st_dev, st.st_ino) == SONAME:
            return True
    return False


def _libcuda_in(pid: int, text: str | None = None, *, by_soname: bool = False) -> LibcudaFile | None:
    """The libcuda process `pid` maps; by name, and with `by_soname` also any file whose ELF soname
    is libcuda.so.1 (slower: for one process named by the user, not for host-wide scans)."""
    if text is None:
        text = _maps(pid)
    soname_match = False
    if "libcuda.so" not in text:  # cheap skip for the many processes without it
        if not by_soname or not _by_soname(pid, text):
            return None
        soname_match = True
    chosen: tuple[str, str] | None = None  # (start-end, mapped_as)
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        name = fields[5].removesuffix(_DELETED)
        if soname_match:
            if ".so" not in name or not name.startswith("/"):
                continue
            try:
                st = os.stat(_host_path(pid, fields[0], fields[5]))
            except OSError:
                continue
            if _soname(_host_path(pid, fields[0], fields[5]), st.st_dev, st.st_ino) != SONAME:
                continue
        elif not is_libcuda(name):
            continue
        # Prefer the executable mapping: that is the code the uprobes patch.
        if chosen is None or "x" in fields[1]:
            chosen = (fields[0], fields[5])
        if "x" in fields[1]:
            break
    if chosen is None:
        return None
    span, mapped_as = chosen
    path = _host_path(pid, span, mapped_as)
    try:
        st = os.stat(path)
    except PermissionError:
        if mapped_as.endswith(_DELETED):
            hint = (
                "it was deleted after the process loaded it (a driver upgrade?); reading it through "
                "/proc/PID/map_files needs root (CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE)"
            )
        else:
            hint = "run as root to reach the files of another user's process or container"
        raise PermissionDenied(f"cannot open {path}, the libcuda that process {pid} maps", hint) from None
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}"):
            raise
        raise NoLibcuda(
            f"process {pid} maps {mapped_as}, but it is not at {path}", "report this with the output of `cat /proc/PID/maps`"
        ) from None
    return LibcudaFile(path, mapped_as, st.st_dev, st.st_ino)


def _host_path(pid: int, span: str, mapped_as: str) -> str:
    if mapped_as.endswith(_DELETED):
        # Opening map_files needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE; it raises PermissionError otherwise.
        start, end = (int(x, 16) for x in span.split("-"))
        return f"/proc/{pid}/map_files/{start:x}-{end:x}"
    if _same_mount_ns(pid):
        return mapped_as
    return f"/proc/{pid}/root{mapped_as}"


def _same_mount_ns(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino
    except PermissionError:
        return False  # then /proc/PID/root decides whether we may see it at all


def resolve_for_command(argv: list[str], env: Mapping[str, str] | None = None, *, search_system: bool = True) -> str:
    """The libcuda.so.1 that `argv` will load, found the way the dynamic linker looks for it.

    Order: LD_LIBRARY_PATH (from `env`, default os.environ), then the ldconfig cache, then the
    default directories; files of another ELF class or machine are skipped as ld.so skips them.
    The executable's RPATH/RUNPATH are not consulted: libcuda is dlopen()ed by libcudart or a
    framework, not linked by the program. `search_system=False` stops after LD_LIBRARY_PATH.
    Returns the real path (symlinks resolved), as /proc/PID/maps will show it.
    """
    if not argv:
        raise UsageError("no command given", "put the command after --, e.g. gputrace attach -- python train.py")
    env = os.environ if env is None else env
    dirs = _ld_library_path(env)
    candidates = [os.path.join(d, SONAME) for d in dirs]
    if search_system:
        candidates += _ldconfig_cache()
        candidates += [os.path.join(d, SONAME) for d in DEFAULT_DIRS]
    for cand in candidates:
        if _loadable(cand):
            return os.path.realpath(cand)
    where = "LD_LIBRARY_PATH, the ldconfig cache and " + ", ".join(DEFAULT_DIRS) if search_system else "LD_LIBRARY_PATH"
    raise NoLibcuda(
        f"no {SONAME} for `{argv[0]}` in {where}",
        "install the NVIDIA driver (libcuda comes with the driver, not the CUDA toolkit) or add its directory to "
        "LD_LIBRARY_PATH; in a container, run it with the NVIDIA container toolkit (--gpus)",
    )


def _ld_library_path(env: Mapping[str, str]) -> list[str]:
    value = env.get("LD_LIBRARY_PATH", "")
    if not value:
        return []
    return [d or "." for d in re.split("[:;]", value)]  # ld.so reads an empty entry as the working directory


def _ldconfig_cache() -> list[str]:
    ldconfig = shutil.which("ldconfig") or next((p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None)
    if ldconfig is None:
        return []
    try:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    # "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1"
    entries = (line.strip() for line in out.splitlines())
    return [e.split(" => ", 1)[1] for e in entries if e.startswith(SONAME + " ") and " => " in e]


def _loadable(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return _elf_kind(f.read(20)) == _own_elf_kind()
    except OSError:
        return False


def _elf_kind(header: bytes) -> tuple[int, int, bytes] | None:
    """(class, byte order, machine) of an ELF header, or None for anything else."""
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return None
    return header[4], header[5], header[18:20]


@functools.cache
def _own_elf_kind() -> tuple[int, int, bytes] | None:
    with open("/proc/self/exe", "rb") as f:
        return _elf_kind(f.read(20))
