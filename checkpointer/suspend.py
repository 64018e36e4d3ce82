"""suspend() and resume(): take a job's device memory off the GPU and bring it back at the same addresses.

The job must run with its cuMemAlloc_v2 memory served through the VMM API (`gputrace run
--checkpointable --suspendable`, GPUTRACE_SHIM_VMM=1; see shim/vmm.c for what that changes).  The
shim then closes the gate, copies every allocation into a memfd this process passes it (and keeps:
the data live in host memory, held by the job's own process, until resume), and releases the
physical memory of each allocation while keeping its address reserved.  The gate stays closed: a
suspended job waits at its next submission.  Resume maps new memory at the same addresses, copies
the data back and reopens the gate.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

from gputrace.errors import CheckpointError

from .ops import DEFAULT_CHUNK, DEFAULT_LANES, _copy_timeout, _Session, _shim_failure


@dataclass(frozen=True)
class SuspendReport:
    pid: int
    allocations: int
    bytes: int  # what the program asked for
    reserved_bytes: int  # what the VMM path maps (rounded up to the granularity): what suspend frees
    drain_ns: int
    copy_ns: int
    release_ns: int
    total_ns: int
    direct: bool = False  # copied straight into the pinned image (no staging)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ResumeReport:
    pid: int
    allocations: int
    bytes: int
    remap_ns: int
    copy_ns: int
    suspended_ns: int  # how long the job was held
    total_ns: int
    direct: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def suspend(pid: int, *, lanes: int = DEFAULT_LANES, chunk: int = DEFAULT_CHUNK, timeout_ms: int = 5000,
            direct: bool = True) -> SuspendReport:
    t0 = time.monotonic_ns()
    with _Session(pid, "suspend") as s:
        held = s.request("status")
        if held.get("suspended"):
            raise CheckpointError(f"process {pid} is already suspended", f"bring it back with: gputrace resume -p {pid}")
        nbytes = held.get("totals", {}).get("device_bytes", 0)
        memfd = os.memfd_create(f"gputrace-suspend-{pid}", os.MFD_CLOEXEC)
        try:
            r = s.request(f"suspend lanes={lanes} chunk={chunk} timeout={timeout_ms} direct={int(direct)}", fd=memfd,
                          timeout_s=_copy_timeout(nbytes))
        finally:
            os.close(memfd)  # the shim holds its own descriptor of it now
    if not r.get("ok"):
        if r.get("error") == "unsupported":
            raise CheckpointError(f"process {pid} cannot be suspended: {r.get('detail', '')}",
                                  "start it with: gputrace run --checkpointable --suspendable -- CMD "
                                  "(only cuMemAlloc memory is served through the VMM API)")
        raise _shim_failure(r, pid, "suspend")
    return SuspendReport(pid, r["allocations"], r["bytes"], r["reserved_bytes"], r["drain_ns"], r["copy_ns"],
                         r["release_ns"], time.monotonic_ns() - t0, r.get("direct", False))


def resume(pid: int, *, lanes: int = DEFAULT_LANES, chunk: int = DEFAULT_CHUNK, direct: bool = True) -> ResumeReport:
    t0 = time.monotonic_ns()
    with _Session(pid, "resume") as s:
        st = s.request("status")
        if not st.get("suspended"):
            raise CheckpointError(f"process {pid} is not suspended", f"suspend it first: gputrace suspend -p {pid}")
        r = s.request(f"unsuspend lanes={lanes} chunk={chunk} direct={int(direct)}",
                      timeout_s=_copy_timeout(st.get("totals", {}).get("device_bytes", 0)))
    if not r.get("ok"):
        raise CheckpointError(f"the shim of process {pid} could not resume: {r.get('error')}"
                              + (f" ({r['detail']})" if r.get("detail") else ""),
                              "the job stays suspended (its data are kept); free GPU memory and try again")
    return ResumeReport(pid, r["allocations"], r["bytes"], r["remap_ns"], r["copy_ns"], r["suspended_ns"],
                        time.monotonic_ns() - t0, r.get("direct", False))
