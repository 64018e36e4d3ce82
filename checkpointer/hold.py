"""Every thread of a process held still but one, by ptrace: how a job CRIU has just restored waits
while the driver brings its GPU state back.

Until the driver's Restore has put the process's device mappings back, a thread that touches one
faults: on the H200 every JAX job restored whole died of SIGSEGV right after CRIU let it run (XLA's
threads run on where a PyTorch job's sit idle), and CRIU's own CUDA plugin keeps restored tasks
frozen for the same reason. The driver serves its checkpoint calls from one thread of the process
(cuCheckpointProcessGetRestoreThreadId): that one alone runs.

`held(pid, keep)` takes the process stopped (`criu restore --leave-stopped`) or running: each other
thread is seized (PTRACE_SEIZE), interrupted, and its stop collected, so it stays in a tracing stop;
then SIGCONT lets the kept thread alone run. Leaving the block detaches them all, and the job runs. If this process dies
in between, the kernel detaches them the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from typing import Iterator

from gputrace.base.errors import CheckpointError
from gputrace.base.procs import stat_fields

_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207
_PTRACE_DETACH = 17
_WALL = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def threads(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return []


def thread_state(pid: int, tid: int) -> str:
    """Thread `tid` of `pid`: its state letter (R, S, T stopped, t tracing stop, ...), "" if gone."""
    f = stat_fields(tid) if os.path.isdir(f"/proc/{pid}/task/{tid}") else None  # /proc/TID is the thread's own
    return f[0].decode() if f else ""


@contextlib.contextmanager
def held(pid: int, keep: int | None) -> Iterator[list[int]]:
    """Every thread of stopped process `pid` but `keep` held in a tracing stop, and the process
    continued; yields the held thread ids. With `keep` None nothing is held (the process is only
    continued). CheckpointError if a thread cannot be seized (all seized so far are let go)."""
    seized: list[int] = []
    try:
        if keep is not None:
            for tid in threads(pid):
                if tid == keep:
                    continue
                if _libc.ptrace(_PTRACE_SEIZE, tid, None, None) != 0:
                    err = ctypes.get_errno()
                    if err == 3:  # ESRCH: the thread has gone
                        continue
                    raise CheckpointError(f"cannot hold thread {tid} of the restored process {pid}: "
                                          f"{os.strerror(err)}",
                                          "another tracer (a debugger, strace) may hold it: let it go and try again")
                seized.append(tid)
                # A thread that was not stopped (CRIU left it running, or it was continued) would
                # never report a stop to wait for: made to stop.
                _libc.ptrace(_PTRACE_INTERRUPT, tid, None, None)
            for tid in seized:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(tid, _WALL | os.WUNTRACED)  # its stop, reported to this tracer
        os.kill(pid, signal.SIGCONT)
        yield seized
    finally:
        for tid in seized:
            _libc.ptrace(_PTRACE_DETACH, tid, None, None)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def end(pid: int, seized: list[int]) -> None:
    """Ends process `pid` while its threads are held, so that none of them runs again (a restored job
    whose peer failed must not write on to its files: the checkpoint could not be restored again).
    The held threads are then reaped as their tracer: each killed one would otherwise stay a zombie of
    this process, and the process could not be reaped until they are. The thread group leader is
    waited for last: the kernel reports it only once the other threads are gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for tid in sorted(seized, key=lambda t: t == pid):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(tid, _WALL)
