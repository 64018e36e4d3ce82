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

import time
from dataclasses import asdict, dataclass

from gputrace.base.errors import CheckpointError
from gputrace.base.procs import require_running, stop_point

from .driverapi import API, STATES, Driver  # noqa: F401  (the backend's names, re-exported)


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


def _lock_running(pid: int, timeout_ms: int) -> tuple[Driver, int, int]:
    """The driver of a running process, locked: (driver, start ns, lock ns)."""
    d = Driver(pid)
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
    d = Driver(pid)
    if d.state() != "checkpointed":
        raise CheckpointError(f"process {pid} is {d.state()}, not suspended by the driver",
                              f"suspend it first: gputrace suspend --backend driver -p {pid}")
    t0 = time.monotonic_ns()
    rs = d.call("Restore")
    un = d.call("Unlock")
    return DriverReport(pid, "resume", 0, 0, rs, un, time.monotonic_ns() - t0, d.path)
