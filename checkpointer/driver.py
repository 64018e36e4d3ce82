"""The driver backend: NVIDIA's own process checkpoint (cuCheckpointProcessLock/Checkpoint/Restore/Unlock),
called from this process with the target's pid, for jobs started without the shim and to compare.

The driver keeps the checkpointed data in the target's own host memory (it frees the GPU memory);
writing that to disk is a whole-process checkpoint's job (CRIU), not done here.  So:
  checkpoint  lock, checkpoint, restore, unlock: the job's device state round-trips through host
              memory, and the report times each step; the freeze is lock to unlock.
  suspend     lock, checkpoint (the GPU memory is free; the job waits in its next CUDA call);
  resume      restore, unlock.
The library called is the very libcuda file the target maps (tracer/targets.py finds it), so the
same code drives simcuda in tests and the real driver on a GPU machine.
"""

from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import asdict, dataclass

from gputrace.base.errors import CheckpointError
from gputrace.base.procs import require_running, stop_point
from gputrace.tracer.targets import libcuda_of

API = ("cuCheckpointProcessGetState", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
       "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


@dataclass(frozen=True)
class DriverReport:
    pid: int
    action: str  # checkpoint | suspend | resume
    lock_ns: int
    checkpoint_ns: int
    restore_ns: int
    unlock_ns: int
    freeze_ns: int  # from the lock's start to the unlock's end (suspend: to the checkpoint's end)
    driver: str

    def to_dict(self) -> dict:
        return {"backend": "driver", **asdict(self)}


@functools.lru_cache(maxsize=8)
def _lib(path: str):
    lib = ctypes.CDLL(path)
    missing = [n for n in API if not hasattr(lib, n)]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}",
                              "the driver's checkpoint API needs NVIDIA driver 570 or newer; use the shim backend")
    for n in API:
        getattr(lib, n).restype = ctypes.c_int
    return lib


class _Driver:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.path = libcuda_of(pid).path
        self.lib = _lib(self.path)

    def state(self) -> str:
        st = ctypes.c_int(-1)
        r = self.lib.cuCheckpointProcessGetState(self.pid, ctypes.byref(st))
        if r:
            raise CheckpointError(f"the driver cannot checkpoint process {self.pid} (CUresult {r})",
                                  "it must have initialized CUDA, and belong to this user (or run this as root)")
        return STATES.get(st.value, f"state {st.value}")

    def call(self, name: str, timeout_ms: int = 0) -> int:
        args = (ctypes.c_uint8 * 64)()  # the args structs: 64 bytes, zeroed; lock's first u32 is the timeout
        ctypes.c_uint32.from_buffer(args).value = timeout_ms
        t = time.monotonic_ns()
        r = getattr(self.lib, f"cuCheckpointProcess{name}")(self.pid, args)
        if r:
            hint = ("calls still in flight at the timeout; try a longer --timeout-ms" if name == "Lock" and r == 600
                    else "see `gputrace shim status` / the driver's state of the process")
            raise CheckpointError(f"cuCheckpointProcess{name} on process {self.pid} failed: CUresult {r}", hint)
        return time.monotonic_ns() - t


def _lock_running(pid: int, timeout_ms: int) -> tuple[_Driver, int, int]:
    """The driver of a running process, locked: (driver, start ns, lock ns)."""
    d = _Driver(pid)
    if d.state() != "running":
        raise CheckpointError(f"process {pid} is {d.state()}, not running", "resume it first")
    t0 = time.monotonic_ns()
    return d, t0, d.call("Lock", timeout_ms)


def checkpoint(pid: int, timeout_ms: int = 5000) -> DriverReport:
    from .guardian import Guardian

    require_running(pid, "checkpoint")
    with Guardian(pid, "driver checkpoint") as g:  # a death between lock and unlock must not leave it locked
        g.note(driver=True)
        d, t0, lock = _lock_running(pid, timeout_ms)
        try:
            stop_point("driver:locked")
            ck = d.call("Checkpoint")
            stop_point("driver:checkpointed")
            rs = d.call("Restore")
        finally:
            st = d.state()
            if st == "checkpointed":
                d.call("Restore")
                st = d.state()
            un = d.call("Unlock") if st == "locked" else 0
    return DriverReport(pid, "checkpoint", lock, ck, rs, un, time.monotonic_ns() - t0, d.path)


def suspend(pid: int, timeout_ms: int = 5000) -> DriverReport:
    from .guardian import Guardian

    require_running(pid, "suspend")
    with Guardian(pid, "driver suspend") as g:  # suspended on purpose only once the checkpoint is done
        g.note(driver=True)
        d, t0, lock = _lock_running(pid, timeout_ms)
        try:
            ck = d.call("Checkpoint")
        except BaseException:
            if d.state() == "locked":
                d.call("Unlock")
            raise
    return DriverReport(pid, "suspend", lock, ck, 0, 0, time.monotonic_ns() - t0, d.path)


def resume(pid: int) -> DriverReport:
    d = _Driver(pid)
    if d.state() != "checkpointed":
        raise CheckpointError(f"process {pid} is {d.state()}, not suspended by the driver",
                              f"suspend it first: gputrace suspend --backend driver -p {pid}")
    t0 = time.monotonic_ns()
    rs = d.call("Restore")
    un = d.call("Unlock")
    return DriverReport(pid, "resume", 0, 0, rs, un, time.monotonic_ns() - t0, d.path)
