"""suspend() and resume(): take a job's device memory off the GPU and bring it back at the same addresses.

The job must run with its cuMemAlloc_v2 memory served through the VMM API (`gputrace run
--checkpointable --suspendable`, GPUTRACE_SHIM_VMM=1; see shim/vmm.c for what that changes); memory
the program maps through the VMM API itself is released and made again too, at the same addresses,
with the handles the program holds still valid (the shim translates them).  The
shim then closes the gate, copies every allocation into a memfd this process passes it (and keeps:
the data live in host memory, held by the job's own process, until resume), and releases the
physical memory of each allocation while keeping its address reserved.  The gate stays closed: a
suspended job waits at its next submission.  Resume maps new memory at the same addresses, copies
the data back and reopens the gate.

The suspension belongs to this process's connection until everything it needs is in place (the
data written, with -o) and it sends `keep`: a suspend killed before that is undone by the shim
itself when the connection closes (shim/control.c).

prepare() makes ahead, while the job runs, the image a suspension into host memory copies into (the
shim's `prepare_suspend`): mapping and pinning host memory the size of the job's device memory takes
about 0.35 s a GiB, which a job's first suspend otherwise pays inside the command, before the GPU is
free.  The image stays pinned in the job until the shim's `release` (`gputrace shim release -p PID`)
or the job's end.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gputrace.base.errors import CheckpointBusy, CheckpointError, NotSuspendable, TargetLost
from gputrace.base.procs import alive, stop_point

from . import store
from .ops import (BUSY_TRIES, DEFAULT_CHUNK, DEFAULT_LANES, copy_timeout, ShimSession, shim_failure, manifest_of,
                  overtaken)


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
    path: str | None = None  # -o: the checkpoint directory the data now live in (host memory given back)
    write_ns: int = 0  # -o: hashing and writing it, while the job stayed suspended
    setup_ns: int = 0  # pinning the image (and staging), while the job still ran; ~0 where the kept one served
    freeze_ns: int = 0  # from the gate closing to the memory released: the job's stop inside the suspend
    image_kept: bool = False  # copied into the shim's own image, kept mapped and pinned between suspensions
    image_allocs: int = 0  # how often the shim has made that image for the job (stays 1 while it is reused)

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
    image_kept: bool = False  # the image stays mapped and pinned in the job for its next suspension

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PrepareReport:
    pid: int
    made: bool  # the image was made now (False: a kept one holds the job's memory already, or it holds none)
    allocations: int
    bytes: int  # the device memory the job holds
    image_bytes: int  # host memory the image holds, mapped and pinned in the job (0: none)
    setup_ns: int  # the shim's allocating, mapping and pinning it, while the job ran (0 where nothing was made)
    total_ns: int
    pin_cap: int  # the cap it is kept within, beside the checkpoints' pool (GPUTRACE_SHIM_PIN_CAP)
    kept_pinned_bytes: int  # the checkpoints' pinned pool, within the same cap
    image_allocs: int  # how often the shim has made a suspension image for the job

    def to_dict(self) -> dict:
        return asdict(self)


def prepare(pid: int) -> PrepareReport:
    """Makes the image the next suspend of shimmed process `pid` copies into, now, while the job
    runs (the shim's `prepare_suspend`): its first suspend then pays only its copies.  Nothing is
    gated; where the shim refuses, nothing was pinned and the job runs on as before."""
    t0 = time.monotonic_ns()
    what = "suspend --prepare"
    try:
        with ShimSession(pid, what) as s:
            st = s.request("status")
            if st.get("suspended"):
                raise CheckpointError(f"process {pid} is suspended: its data are in the suspension's image already",
                                      f"`gputrace resume -p {pid}` brings it back; the image stays kept for its next "
                                      "suspension (within the pin cap), so it needs no --prepare")
            nbytes = st.get("totals", {}).get("device_bytes", 0)
            r = s.request("prepare_suspend", timeout_s=copy_timeout(nbytes))
    except TargetLost as exc:
        if not alive(pid):
            raise TargetLost(f"process {pid} exited during the {what}", "nothing of it is left to prepare") from None
        raise TargetLost(exc.msg, f"its shim may still be pinning the image: `gputrace shim status -p {pid}` shows "
                                  f"what it keeps, `gputrace shim release -p {pid}` gives it back") from None
    if not r.get("ok"):
        raise _prepare_failure(r, pid)
    return PrepareReport(pid, bool(r["made"]), r["allocations"], r["bytes"], r["image_bytes"], r["setup_ns"],
                         time.monotonic_ns() - t0, r["pin_cap"], r.get("kept_pinned_bytes", 0),
                         r.get("suspend_image_allocs", 0))


def _prepare_failure(r: dict, pid: int) -> CheckpointError:
    """The shim's refusal of `prepare_suspend` (shim/suspend.c): nothing was pinned, the job runs on."""
    err, detail = str(r.get("error", "unknown error")), r.get("detail")
    msg = f"the shim of process {pid} did not prepare its suspension: {err}" + (f" ({detail})" if detail else "")
    untouched = "nothing was pinned and the job runs on, untouched"
    if err == "unsupported":
        return NotSuspendable(f"process {pid} cannot be suspended, so nothing was prepared: {detail}",
                              _unsupported_hint(pid, str(detail or "")))
    if err == "over the pin cap":
        need = int(r.get("needs_bytes", 0)) + int(r.get("kept_pinned_bytes", 0))
        unit = 1 << 30 if need >= 1 << 30 else 1 << 20
        need = -(-need // unit) * unit  # a round number that holds it
        pool = (f"; or give the checkpoints' pinned pool ({r.get('kept_pinned_bytes')} bytes) back first with "
                f"`gputrace shim release -p {pid}`" if r.get("kept_pinned_bytes") else "")
        return CheckpointError(msg, "the job runs on, untouched. Start it with a cap that holds the image, e.g. "
                                    f"`GPUTRACE_SHIM_PIN_CAP={need} gputrace run --checkpointable --suspendable -- CMD`"
                                    f"{pool}; `gputrace suspend -p {pid}` works without it, pinning its image "
                                    "inside the command and giving it back at resume")
    if err == "busy":
        return CheckpointBusy(msg, f"{untouched}; try again once the checkpoint or suspension under way has ended")
    if err == "suspended":
        return CheckpointError(msg, f"`gputrace resume -p {pid}` brings it back; its image stays kept for the next "
                                    "suspension (within the pin cap)")
    return CheckpointError(msg, f"{untouched}; `gputrace suspend -p {pid}` still works, pinning its image itself")


def suspend(pid: int, *, lanes: int = DEFAULT_LANES, chunk: int = DEFAULT_CHUNK, timeout_ms: int = 5000,
            direct: bool = True, out: Path | str | None = None, progress: store.Progress | None = None,
            image_file: Path | None = None) -> SuspendReport:
    """Suspends shimmed process `pid`.  `out`: also write the data as a checkpoint directory there
    (what `gputrace restore` reads) and let the job's host memory go: the shim keeps the on-disk image
    instead of the memfd, and resume reads it back from disk.  The job is frozen for the copy alone
    either way; with `out` it stays suspended while the data are written (it is waiting anyway).
    `image_file`: the shim copies into this new file instead of a memfd (a whole-process checkpoint's
    gpu.img, which CRIU then records by path); removed again if the suspend fails."""
    t0 = time.monotonic_ns()
    if out is not None:
        out = Path(out).absolute()
        store.check_target(out)
    with ShimSession(pid, "suspend") as s:
        held = s.request("status")
        if held.get("suspended"):
            raise CheckpointError(f"process {pid} is already suspended", f"bring it back with: gputrace resume -p {pid}")
        nbytes = held.get("totals", {}).get("device_bytes", 0)
        write_ns, path = 0, None
        r, memfd = _request(s, pid, f"suspend lanes={lanes} chunk={chunk} timeout={timeout_ms}", direct, nbytes,
                            image_file, keep=out is None)
        try:
            if r.get("ok"):
                stop_point("suspend:suspended")
            if r.get("ok") and out is not None:
                tw = time.monotonic_ns()
                try:
                    _to_disk(s, pid, held, r, memfd, out, progress)
                except CheckpointError:
                    s.request("keep")  # as the error says: suspended, its data safe in host memory
                    raise
                write_ns, path = time.monotonic_ns() - tw, str(out)
            if r.get("ok"):
                # Until now the suspension was this connection's: had this process died, the shim
                # would have unsuspended the job itself. From here on it outlives us.
                k = s.request("keep")
                if not k.get("ok"):
                    raise CheckpointError(f"the shim of process {pid} would not keep the suspension: {k.get('error')}",
                                          "the job is given back (unsuspended) as this command exits")
        finally:
            if memfd >= 0:
                os.close(memfd)  # the shim holds its own descriptor of it (or of the file) now
    if not r.get("ok"):
        if image_file is not None:
            image_file.unlink(missing_ok=True)
        if r.get("error") == "unsupported":
            detail = r.get("detail", "")
            raise NotSuspendable(f"process {pid} cannot be suspended: {detail}", _unsupported_hint(pid, detail))
        raise shim_failure(r, pid, "suspend")
    return SuspendReport(pid, r["allocations"], r["bytes"], r["reserved_bytes"], r["drain_ns"], r["copy_ns"],
                         r["release_ns"], time.monotonic_ns() - t0, r.get("direct", False), path, write_ns,
                         r.get("setup_ns", 0), r.get("freeze_ns", 0), bool(r.get("image_kept")),
                         r.get("suspend_image_allocs", 0))


def _request(s: ShimSession, pid: int, command: str, direct: bool, nbytes: int,
             image_file: Path | None, keep: bool = False) -> tuple[dict, int]:
    """The shim's suspend, with the descriptor it copies into (a new memfd, or `image_file` made
    anew); the reply and that descriptor (the caller closes it; -1 where there is none).

    `keep` (the data wait in host memory, not in a file: no -o, no image_file): a direct copy goes
    into the shim's own image (`keep=1`), which it keeps mapped and pinned between the job's
    suspensions within its cap (GPUTRACE_SHIM_PIN_CAP), so that pinning it is paid once per job, not
    at every suspend, and resume unpins nothing.

    A job that allocates and frees every step (a training loop's activations) can hold more at the
    freeze than at the plan, made a moment before while it ran: the shim then refuses, busy, having
    copied nothing. That is tried again on a fresh plan, and the last time through the staging
    buffers, which take any size (the direct copy maps the image for the plan's)."""
    for attempt in range(BUSY_TRIES):
        staged = not direct or attempt == BUSY_TRIES - 1
        if keep and image_file is None and not staged:
            r = s.request(f"{command} direct=1 keep=1", timeout_s=copy_timeout(nbytes))
            if not overtaken(r):
                return r, -1
            continue
        if image_file is None:
            memfd = os.memfd_create(f"gputrace-suspend-{pid}", os.MFD_CLOEXEC)
        else:
            memfd = os.open(image_file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            r = s.request(f"{command} direct={int(not staged)}", fd=memfd, timeout_s=copy_timeout(nbytes))
        except BaseException:
            os.close(memfd)
            raise
        if not overtaken(r) or attempt == BUSY_TRIES - 1:
            return r, memfd
        os.close(memfd)
        if image_file is not None:
            image_file.unlink(missing_ok=True)
    raise AssertionError("unreachable")


def _unsupported_hint(pid: int, detail: str) -> str:
    """What to do about memory the shim cannot release, by the kind the shim names (shim/suspend.c)."""
    driver = f"`gputrace suspend --backend driver -p {pid}` suspends it through NVIDIA's driver instead"
    if "program's VMM" in detail:
        return ("the shim releases and recreates the program's own VMM memory (as PyTorch with expandable_segments "
                f"and JAX map it) only when it can copy all of it and make it again; {driver}, or "
                f"`gputrace checkpoint -p {pid}` saves its GPU memory without freeing it")
    if "the device allocation" in detail:
        return ("start it with: gputrace run --checkpointable --suspendable -- CMD "
                "(only then is its cuMemAlloc memory served through the VMM API)")
    return f"only cuMemAlloc memory is served through the VMM API, and this job holds other kinds; {driver}"


def _to_disk(s: ShimSession, pid: int, status: dict, r: dict, memfd: int, out: Path,
             progress: store.Progress | None) -> None:
    """The suspended image as a checkpoint directory; then the shim swaps its memfd for the file."""
    nbytes = os.fstat(memfd).st_size
    try:
        _, manifest = manifest_of(pid, status, r, memfd, nbytes)
        store.write(out, memfd, nbytes, manifest, progress)
    except CheckpointError as exc:
        raise type(exc)(f"{exc.msg}; process {pid} is suspended with its data in host memory",
                              f"{exc.hint}; `gputrace resume -p {pid}` brings it back") from None
    fd = os.open(out / store.DATA, os.O_RDWR | os.O_CLOEXEC)
    try:
        rr = s.request("rehome", fd=fd)
        if not rr.get("ok"):
            raise CheckpointError(f"the shim of process {pid} kept its data in host memory: {rr.get('error')}",
                                  f"the checkpoint in {out} is complete; `gputrace resume -p {pid}` works as usual")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written and synced: no need to keep it cached
    finally:
        os.close(fd)


def resume(pid: int, *, lanes: int = DEFAULT_LANES, chunk: int = DEFAULT_CHUNK, direct: bool = True) -> ResumeReport:
    t0 = time.monotonic_ns()
    with ShimSession(pid, "resume") as s:
        st = s.request("status")
        if not st.get("suspended"):
            raise CheckpointError(f"process {pid} is not suspended", f"suspend it first: gputrace suspend -p {pid}")
        r = s.request(f"unsuspend lanes={lanes} chunk={chunk} direct={int(direct)}",
                      timeout_s=copy_timeout(st.get("totals", {}).get("device_bytes", 0)))
    if not r.get("ok"):
        raise CheckpointError(f"the shim of process {pid} could not resume: {r.get('error')}"
                              + (f" ({r['detail']})" if r.get("detail") else ""),
                              "the job stays suspended (its data are kept); free GPU memory and try again")
    return ResumeReport(pid, r["allocations"], r["bytes"], r["remap_ns"], r["copy_ns"], r["suspended_ns"],
                        time.monotonic_ns() - t0, r.get("direct", False), bool(r.get("image_kept")))
