"""Checks on a target process that every subcommand shares."""

from __future__ import annotations

import os

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


def require_root(what: str) -> None:
    if os.geteuid() == 0:
        return
    if has_bpf_caps():
        return
    raise PermissionDenied(
        f"{what} needs root or the CAP_BPF and CAP_PERFMON capabilities",
        "run it with sudo, or grant the capabilities: sudo setcap cap_bpf,cap_perfmon,cap_sys_ptrace+ep $(readlink -f $(which python3))",
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
