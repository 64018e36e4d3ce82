"""CRIU, for the CPU side of a whole-process checkpoint: found on the host, its version checked, and
dump/restore run with their logs turned into errors that say what went wrong.

Where CRIU is looked for: $GPUTRACE_CRIU (only there, when set), else the private install of
scripts/install-criu (/usr/local/lib/gputrace/criu/bin/criu), else `criu` on PATH.  The first one that
runs and is >= 4.0 is used (3.x fails `criu check` on recent kernels and lacks what the GPU side needs).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gputrace.base.errors import CheckpointError
from gputrace.base.procs import stop_point
from gputrace.checkpointer.uprobes import ImageError, _varint

MIN_VERSION = (4, 0)
UPROBES_VERSION = (4, 2)  # --allow-uprobes: dump and restore a process holding the kernel's [uprobes] page
PRIVATE = Path("/usr/local/lib/gputrace/criu/bin/criu")
INSTALL_HINT = ("run scripts/setup-host (it installs a CRIU >= 4.0: the distribution's, or Debian 13's unpacked "
                "into /usr/local/lib/gputrace/criu), or point GPUTRACE_CRIU at a criu >= 4.0")


class CriuUnavailable(CheckpointError):
    """No CRIU, or one too old, on this host."""


class CriuFailed(CheckpointError):
    """criu dump or restore failed; the message carries the first errors of its log."""


@dataclass(frozen=True)
class Criu:
    path: str
    version: tuple[int, ...]

    @property
    def version_str(self) -> str:
        return ".".join(map(str, self.version))

    @property
    def allows_uprobes(self) -> bool:
        return self.version >= UPROBES_VERSION


def version_of(path: str) -> tuple[int, ...] | None:
    try:
        r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Version:\s*([0-9][0-9.]*)", r.stdout)
    return tuple(int(x) for x in m.group(1).strip(".").split(".")) if m else None


def candidates() -> list[str]:
    env = os.environ.get("GPUTRACE_CRIU")
    if env:
        return [env]
    out = [str(PRIVATE)] if PRIVATE.exists() else []
    on_path = shutil.which("criu")
    if on_path and os.path.realpath(on_path) not in {os.path.realpath(p) for p in out}:
        out.append(on_path)
    return out


def find() -> Criu:
    """The CRIU to use; CriuUnavailable (with what was found) when there is none >= 4.0."""
    seen = []
    for path in candidates():
        v = version_of(path)
        if v is None:
            seen.append(f"{path} (does not run)")
        elif v < MIN_VERSION:
            seen.append(f"{path} is {'.'.join(map(str, v))}")
        else:
            return Criu(path, v)
    if not seen:
        raise CriuUnavailable("CRIU is not installed (no criu on PATH, none at /usr/local/lib/gputrace/criu)",
                              INSTALL_HINT)
    raise CriuUnavailable(f"no CRIU >= {'.'.join(map(str, MIN_VERSION))} here: {'; '.join(seen)}", INSTALL_HINT)


def check(c: Criu, feature: str | None = None) -> tuple[bool, str]:
    """`criu check` (`--feature FEATURE` where given): (passed, what it said last, without CRIU's
    timestamps and Warn/Error prefixes)."""
    try:
        r = subprocess.run([c.path, "check", *(["--feature", feature] if feature else [])],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    lines = [re.sub(r"^(\(\s*[0-9.]+\)\s*)?((Warn|Error)\s*\([^)]*\):\s*)?", "", ln).strip()
             for ln in (r.stdout + r.stderr).splitlines()
             if ln.strip() and not (feature is None and ln.startswith("Warn"))]
    lines = [ln for ln in lines if "RLIMIT_NOFILE" not in ln]
    return r.returncode == 0, (lines[-1] if lines else f"exit status {r.returncode}")


#: What a pre-dump, and a dump of only the pages written since it, need of the kernel: its soft-dirty
#: bits (CONFIG_MEM_SOFT_DIRTY), by which CRIU tells the pages a process wrote since it last looked.
DIRTY_TRACK = "mem_dirty_track"
DIRTY_TRACK_HINT = ("the kernel must track the pages a process writes (its soft-dirty bits: CONFIG_MEM_SOFT_DIRTY=y); "
                    "on this host take `checkpoint --full` alone, which dumps the whole host memory in the freeze "
                    "(CRIU 4.x run for a pre-dump here aborts half-way and leaves its own code mapped in the job, "
                    "so it is not run)")


class DirtyTrackingUnavailable(CheckpointError):
    """`criu check --feature mem_dirty_track` fails: no pre-dump, no dump of only what changed."""


def require_dirty_tracking(c: Criu) -> None:
    """Refuses (DirtyTrackingUnavailable, before anything is run on a job) where the kernel cannot say
    which pages a process wrote since CRIU last looked."""
    ok, said = check(c, DIRTY_TRACK)
    if not ok:
        raise DirtyTrackingUnavailable(f"this host cannot dump only the pages a job changed: `criu check --feature "
                                       f"{DIRTY_TRACK}` fails ({said})", DIRTY_TRACK_HINT)


def _errors(log: Path, limit: int = 4) -> list[str]:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    errs = [re.sub(r"^\(\s*[0-9.]+\)\s*", "", ln) for ln in text.splitlines() if "Error (" in ln]
    # "Can't setup RLIMIT_NOFILE for self" is logged as an error on every run in a container and is harmless.
    errs = [e for e in errs if "RLIMIT_NOFILE" not in e]
    return errs[:limit]


def _dump_hint(errs: list[str]) -> str:
    text = " ".join(errs)
    if "External socket" in text or "unix" in text and "external" in text.lower():
        return ("the job holds a socket to a process outside it (a GPU device connection the driver did not "
                "release, or a server): CRIU cannot carry it")
    if "Unsupported mapping" in text and "7fffffffe000" in text:
        return ("a uprobe hit this process (gputrace attach, doctor, or another eBPF tracer): CRIU before 4.2 cannot "
                "dump the kernel's [uprobes] page; scripts/install-criu installs 4.2 (--allow-uprobes)")
    if "tty" in text.lower() or "shell-job" in text.lower():
        return "start the job with setsid and its stdin, stdout and stderr on files (not a terminal or a pipe)"
    if "/dev/nvidia" in text or "non-regular mapping" in text or "Unsupported mapping" in text:
        return ("the job maps a device (the GPU driver's mappings, which only the driver's lock and checkpoint drop): "
                "CRIU cannot copy it while the job runs")
    if "pipe" in text.lower():
        return "the job's stdio is a pipe to another process: start it with its stdio on files"
    return "see the log for the whole story; the job was left running"


#: The gate CRIU starts behind (see _run): "$@" is CRIU's command line.
GATE = 'IFS= read -r go && [ "$go" = go ] && exec "$@" </dev/null'


def _run(c: Criu, cmd: list[str], log: Path, on_start: Callable[[int], None] | None,
         timeout_s: float | None = None) -> tuple[int, list[str] | None]:
    """CRIU with `cmd` (its --allow-uprobes added where it has it), telling `on_start` its pid first
    (a guardian waits for it if we die). Returns the ns it took and, if it failed, its errors (from
    its log, else the last lines it wrote, else its exit status). Past `timeout_s` it is killed (the
    kernel lets go of the tasks it had seized) and that is its error."""
    if c.allows_uprobes:
        cmd = [*cmd, "--allow-uprobes"]
    t = time.monotonic_ns()
    # CRIU starts behind a gate (a shell reading "go" on its stdin, then exec'ing CRIU at the same pid):
    # it cannot touch the job before `on_start` has told a guardian its pid.  Without the gate, this
    # process killed between the start and the telling left a guardian that saw no CRIU yet, gave the
    # job back, and then blocked in the driver's Restore on a job the unseen CRIU had just stopped.
    # Killed before the "go", the gate reads end-of-file and CRIU never runs.
    gate_r, gate_w = os.pipe2(os.O_CLOEXEC)
    try:
        p = subprocess.Popen(["/bin/sh", "-c", GATE, "criu", *cmd], stdin=gate_r, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    except BaseException:
        os.close(gate_w)
        raise
    finally:
        os.close(gate_r)
    with p:
        stop_point("criu:gated")  # a kill here: CRIU never starts
        try:
            if on_start:
                on_start(p.pid)
            os.write(gate_w, b"go\n")
        finally:
            os.close(gate_w)
        stop_point("criu:started")  # a kill here: a CRIU at work, its pid told
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            return time.monotonic_ns() - t, [f"it ran past the bound of {timeout_s:.3g} s and was killed"]
    ns = time.monotonic_ns() - t
    if not p.returncode:
        return ns, None
    return ns, _errors(log) or [ln for ln in err.splitlines() if ln.strip()][-3:] or [f"exit status {p.returncode}"]


def dump(c: Criu, pid: int, images: Path, leave_stopped: bool = True,
         on_start: Callable[[int], None] | None = None, timeout_s: float | None = None,
         parent: str | None = None) -> int:
    """`criu dump` of pid's process tree into `images`; the tasks are left stopped (SIGSTOP) when
    leave_stopped, else killed.  Returns the ns it took; CriuFailed (with the log's errors) if it fails,
    in which case CRIU has let the tasks run on.  `timeout_s`: killed past it (a job's one bound).
    `parent`: a pre-dump's images, as a path relative to `images` (`../pre-1`): only the pages written
    since it are dumped (`--track-mem --prev-images-dir`), the rest named as in it."""
    log = images / "dump.log"
    cmd = [c.path, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v2", "--file-locks"]
    if parent is not None:
        cmd += ["--track-mem", "--prev-images-dir", parent]
    if leave_stopped:
        cmd.append("--leave-stopped")
    ns, errs = _run(c, cmd, log, on_start, timeout_s)
    if errs is not None:
        raise CriuFailed(f"criu dump of process {pid} failed: " + " | ".join(errs), f"{_dump_hint(errs)} (log: {log})")
    return ns


def pre_dump(c: Criu, pid: int, images: Path, parent: str | None = None) -> int:
    """`criu pre-dump --track-mem` of pid's process tree into `images` (its pages; the tasks frozen only
    while their page maps are collected, then running on while the pages are written), after `parent`
    (a path relative to `images`) when given. Never killed on a bound: killed while its code runs in
    the job, CRIU could leave it there.  Returns the ns it took; CriuFailed if it fails."""
    log = images / "pre-dump.log"
    cmd = [c.path, "pre-dump", "-t", str(pid), "-D", str(images), "-o", "pre-dump.log", "-v2", "--track-mem"]
    if parent is not None:
        cmd += ["--prev-images-dir", parent]
    ns, errs = _run(c, cmd, log, None)
    if errs is not None:
        raise CriuFailed(f"criu pre-dump of process {pid} failed: " + " | ".join(errs), f"{_dump_hint(errs)} (log: {log})")
    return ns


#: The fields of CRIU's stats-dump image (images/stats.proto, DumpStatsEntry) that a report uses.
_STATS = {1: "freezing_time_us", 2: "frozen_time_us", 3: "memdump_time_us", 4: "memwrite_time_us",
          5: "pages_scanned", 6: "pages_skipped_parent", 7: "pages_written", 9: "pages_lazy"}
_SERVICE_MAGIC, _STATS_MAGIC = 0x55105940, 0x57093306


def stats(images: Path) -> dict[str, int]:
    """What CRIU counted of its dump or pre-dump into `images` (its stats-dump file): pages scanned,
    skipped as in the parent's images, written; the tasks' freezing and frozen time (us). {} where the
    file is absent or not as expected."""
    import struct

    try:
        data = (images / "stats-dump").read_bytes()
    except OSError:
        return {}
    if len(data) < 12 or struct.unpack_from("<II", data) != (_SERVICE_MAGIC, _STATS_MAGIC):
        return {}
    (n,) = struct.unpack_from("<I", data, 8)
    msg = data[12:12 + n]
    out: dict[str, int] = {}
    try:
        i = 0
        while i < len(msg):
            key, i = _varint(msg, i)
            if key == (1 << 3) | 2:  # dump: a DumpStatsEntry
                size, i = _varint(msg, i)
                sub, j = msg[i:i + size], 0
                i += size
                while j < len(sub):
                    k, j = _varint(sub, j)
                    if k & 7 != 0:
                        return out
                    v, j = _varint(sub, j)
                    if (k >> 3) in _STATS:
                        out[_STATS[k >> 3]] = v
            elif key & 7 == 2:
                size, i = _varint(msg, i)
                i += size
            elif key & 7 == 0:
                _, i = _varint(msg, i)
            else:
                return out
    except ImageError:
        return out
    return out


def restore(c: Criu, images: Path, work: Path, pid: int, on_start: Callable[[int], None] | None = None,
            leave_stopped: bool = False) -> int:
    """`criu restore --restore-detached` from `images` (read only; logs go to `work`), the tasks left
    stopped with `leave_stopped`.  Returns the ns it took; CriuFailed if it fails."""
    log = work / "restore.log"
    cmd = [c.path, "restore", "-D", str(images), "-W", str(work), "-o", "restore.log", "-v2", "--file-locks",
           "--restore-detached", "--pidfile", str(work / "restored.pid"), *(["--leave-stopped"] if leave_stopped else [])]
    ns, errs = _run(c, cmd, log, on_start)
    if errs is not None:
        text = " ".join(errs)
        m = re.search(r"File (\S+) has bad size (\d+) \(expect (\d+)\)", text)
        if m:
            f, now, then = "/" + m.group(1).lstrip("/"), int(m.group(2)), int(m.group(3))
            how = "grew" if now > then else "shrank"
            raise CriuFailed(f"cannot restore process {pid}: its open file {f} {how} from {then} to {now} bytes since "
                             "the checkpoint, and CRIU restores a process only with its files as they were",
                             (f"a log the job kept writing after a --leave-running checkpoint? Keep a copy, cut it back "
                              f"to its size then (`cp {f} {f}.after && truncate -s {then} {f}`) and restore again"
                              if now > then else f"put back the file as it was at the checkpoint ({then} bytes)")
                             + f"; nothing was restored (log: {log})")
        if "File exists" in text and "fork" in text.lower():
            raise CriuFailed(f"cannot restore process {pid}: pid {pid} is in use on this host",
                             "CRIU brings a process back at its old pid: end the process that holds it, or restore "
                             "in a new pid namespace (e.g. `unshare --pid --fork --mount-proc gputrace restore ...`)")
        raise CriuFailed("criu restore failed: " + " | ".join(errs),
                         f"nothing was restored; see {log}")
    return ns


def kept_log(exc: CriuFailed, images: Path, name: str = "dump.log") -> CriuFailed:
    """CRIU's dump log, out of the partial directory that is about to go, and the hint pointing
    there (the hint names the log; a failed checkpoint removes its directory)."""
    log = images / name
    if not log.exists():
        return exc
    keep = Path(tempfile.mkdtemp(prefix="gputrace-criu-dump-")) / name
    try:
        shutil.copy2(log, keep)
    except OSError:
        return exc
    return CriuFailed(exc.msg, exc.hint.replace(str(log), str(keep)))
