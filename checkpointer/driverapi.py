"""NVIDIA's process checkpoint API (cuCheckpointProcess*), called from this process with a target's
pid on the very libcuda file the target maps: the calls the driver backend (driver.py), whole-process
checkpoints (full.py) and the guardian that gives a job back (guardian.py) all make."""

from __future__ import annotations

import ctypes
import functools
import time

from gputrace.base.errors import CheckpointError
from gputrace.tracer.targets import libcuda_of

API = ("cuCheckpointProcessGetState", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
       "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}



@functools.lru_cache(maxsize=8)
def library(path: str):
    """The libcuda file at `path` with the checkpoint API's functions typed; CheckpointError without them."""
    lib = ctypes.CDLL(path)
    missing = [n for n in API if not hasattr(lib, n)]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}",
                              "the driver's checkpoint API needs NVIDIA driver 570 or newer; use the shim backend")
    for n in API:
        getattr(lib, n).restype = ctypes.c_int
    return lib


class Driver:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.path = libcuda_of(pid).path
        self.lib = library(self.path)

    def state(self) -> str:
        st = ctypes.c_int(-1)
        r = self.lib.cuCheckpointProcessGetState(self.pid, ctypes.byref(st))
        if r:
            raise CheckpointError(f"the driver cannot checkpoint process {self.pid} (CUresult {r})",
                                  "it must have initialized CUDA, and belong to this user (or run this as root)")
        return STATES.get(st.value, f"state {st.value}")

    def restore_tid(self) -> int | None:
        """The thread of the process that serves the driver's checkpoint calls, or None where the
        driver does not say (cuCheckpointProcessGetRestoreThreadId: CUDA 12.8+ drivers)."""
        fn = getattr(self.lib, "cuCheckpointProcessGetRestoreThreadId", None)
        if fn is None:
            return None
        tid = ctypes.c_int(0)
        return tid.value if fn(self.pid, ctypes.byref(tid)) == 0 and tid.value > 0 else None

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
