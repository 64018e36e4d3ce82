"""Checks on a target process that every subcommand shares."""

from __future__ import annotations

import os
import signal
import sys

from .errors import NoSuchProcess, PermissionDenied, UsageError


def require_process(pid: int) -> None:
    if pid <= 0:
        raise UsageError(f"invalid pid {pid}", "pass the numeric id of a running process, e.g. from `pgrep -f train.py`")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise NoSuchProcess(f"no process with pid {pid}", "check the pid with `ps -p PID`; the job may have exited") from None
    except PermissionError:
        pass  # exists but is someone else's: privileges are checked where they matter


def comm(pid: int) -> str:
    """The process's name (/proc/PID/comm), "?" once it is gone or cannot be read."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


def stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name (fields 3 on: state first), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def environ(pid: int) -> dict[str, str]:
    """The environment process `pid` was started with (/proc/PID/environ); {} where it cannot be read.
    A process that changed its own environment since (setenv) shows what it had at exec."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (children, theirs, ...), `pid` first; [] where it is gone."""
    kids: dict[int, list[int]] = {}
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            f = stat_fields(int(e.name))
            if f and len(f) > 1:
                kids.setdefault(int(f[1]), []).append(int(e.name))
    if not os.path.exists(f"/proc/{pid}"):
        return []
    seen, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        seen.append(p)
        todo.extend(sorted(kids.get(p, ())))
    return seen


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (with the pid, what names one process for good)."""
    f = stat_fields(pid)
    return int(f[19]) if f and len(f) > 19 else None


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def require_running(pid: int, what: str) -> None:
    """Refuses at once a target that is stopped (SIGSTOP, a debugger): its threads, the shim's control
    thread among them, answer nothing until it is continued, so the operation could only hang."""
    require_process(pid)
    f = stat_fields(pid)
    if f is None:
        raise NoSuchProcess(f"no process with pid {pid}", "check the pid with `ps -p PID`; the job may have exited")
    state = f[0].decode()
    if state in ("T", "t"):
        from .errors import CheckpointError

        who = "a debugger or tracer holds it" if state == "t" else "it was sent SIGSTOP (or Ctrl-Z)"
        raise CheckpointError(f"cannot {what} process {pid}: it is stopped ({who})",
                              f"continue it first (`kill -CONT {pid}`), then try again; nothing was changed")
    if state == "Z":
        raise NoSuchProcess(f"process {pid} has exited (a zombie)", "its parent has not reaped it yet; nothing to do")


def alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    f = stat_fields(pid)
    return f is not None and f[0] not in (b"Z", b"X")


def wait_exit(pid: int, timeout_s: float) -> bool:
    """Waits up to timeout_s for process `pid` (not necessarily our child) to exit; True once it has
    (or was gone already). A pidfd becomes readable when the process exits."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def stop_point(name: str) -> None:
    """Where the tests stop gputrace mid-operation: with GPUTRACE_STOP_AT=NAME (comma-separated) in its
    environment, this process stops itself (SIGSTOP) at point NAME, for the test to act there (kill
    it, or change the target) and continue or kill it."""
    at = os.environ.get("GPUTRACE_STOP_AT")
    if at and name in at.split(","):
        os.kill(os.getpid(), signal.SIGSTOP)


def require_root(what: str) -> None:
    if os.geteuid() == 0:
        return
    if has_bpf_caps():
        return
    # The interpreter running gputrace (a virtualenv's python is a link to it), not whichever
    # python3 is first on PATH: the capabilities must be on the binary that runs.
    interpreter = os.path.realpath(sys.executable)
    raise PermissionDenied(
        f"{what} needs root or the CAP_BPF and CAP_PERFMON capabilities",
        f"run it with sudo, or grant the capabilities to the interpreter that runs gputrace (every Python program run with it "
        f"gets them): sudo setcap cap_bpf,cap_perfmon,cap_sys_ptrace+ep {interpreter}",
    )


CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39


def effective_caps() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def has_bpf_caps() -> bool:
    caps = effective_caps()
    return bool(caps & (1 << CAP_SYS_ADMIN)) or (bool(caps & (1 << CAP_BPF)) and bool(caps & (1 << CAP_PERFMON)))
