"""Whole-process checkpoint: GPU state by the driver (and the shim), CPU state by CRIU, one manifest.

checkpoint_full(pid, DIR), in this order, each step undone if a later one fails:
  1. shim fast path (jobs started with `gputrace run --checkpointable --suspendable`): the shim copies
     every cuMemAlloc allocation to host memory at bus speed (pinned, several lanes) and releases the
     GPU memory behind it, keeping the addresses reserved; the gate stays closed.  What the driver
     still has to move in step 2 is then only what the shim does not track (its own staging, contexts,
     modules, VA reservations): little, where the driver copies slowly.
  2. driver: cuCheckpointProcessLock + Checkpoint on the target's pid (checkpointer/driver.py): the rest
     of device memory goes into the process's host memory and the process lets go of the GPU (no
     /dev/nvidia* descriptors are left), so CRIU can dump it.
  3. CRIU: `criu dump --leave-stopped` writes the images and leaves the job stopped, not killed, so a
     failure of anything after it can still give the job back.
  4. the images are checksummed (xxh3_64 per file) and the manifest written; the directory is
     written as .NAME.partial-PID, synced and renamed, as in checkpointer/store.py.
  5. without --leave-running the job is killed now that its state is safe; with it the job is
     continued and its GPU state brought back (driver Restore + Unlock, then shim resume) as soon as
     CRIU has written the images, before step 4: it is held only for steps 1-3 and its way back.
A failure in steps 2-4 resumes the job the same way (SIGCONT, Restore, Unlock, resume): never left
frozen or half-checkpointed.

restore_full(DIR): every file checked against the manifest before anything runs, then `criu restore
--restore-detached --leave-stopped` (the process comes back stopped, in the driver's checkpointed
state), driver Restore + Unlock with every thread but the driver's own held still (checkpointer/hold.py:
a thread that touched device memory before Restore would fault), shim resume: the job continues.

Manifest (schema 1, DIR/manifest.json): schema, format ("gputrace-full-checkpoint"), complete, created_unix,
host, target {pid, comm, cmdline, start_time, boot_id, job ($GPUTRACE_JOB or null), open_files (the regular
files it had open at the dump, which checkpointer/replace.py checks: fd, path, flags, bytes)}, gpu {libcuda, shim (the shim's suspend report or null), driver_state, released_pinned_bytes (what the shim kept
between commands, given back before the freeze so that CRIU would not dump it)},
criu {path, version, allow_uprobes, image_check ("clean", or why the images were not checked)},
hash ("xxh3_64"), files [{path, bytes, xxh3}] (every file under DIR/criu),
timings {shim_ns (the shim's part of the freeze: gate closed to memory released), lock_ns, checkpoint_ns, dump_ns,
freeze_ns (from the first stop of the job: the shim's gate closing, else the driver lock), image_check_ns (CRIU's
images searched for a tracer's traces, after the freeze), held_ns (with leave_running: the first stop to the job
running again; null otherwise), write_ns, total_ns}, leave_running.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import stat
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
import xxhash

from gputrace.base.errors import CheckpointError, CorruptCheckpoint, NoLibcuda, NoSuchProcess, NotSuspendable
from gputrace.base.procs import (boot_id, comm as procs_comm, environ, require_process, require_running, start_time,
                                 stat_fields, stop_point)

from . import criu as criu_mod
from . import driver, driverapi, hold, predump, store, uprobes
from .store import HASH, MANIFEST, Progress, check_target, disk_error
from .guardian import Guardian
from .schema import open_regular
from .suspend import resume, suspend

IMAGES = "criu"
GPU_IMAGE = "gpu.img"
_BLOCK = 8 << 20


@dataclass(frozen=True)
class FullCheckpointReport:
    pid: int
    path: str
    image_bytes: int  # every file: CRIU's images and the shim's gpu.img
    criu_bytes: int  # CRIU's images alone
    files: int
    shim: dict | None  # the shim's suspend report when its fast path ran
    shim_ns: int
    lock_ns: int
    checkpoint_ns: int
    dump_ns: int
    freeze_ns: int  # from the first step that stops the job to the end of the CRIU dump
    write_ns: int  # checksums, manifest, sync, rename
    total_ns: int
    leave_running: bool
    criu: str
    image_check: str = "clean"  # the images searched for a tracer's traces, or why they could not be
    image_check_ns: int = 0  # the search (after the freeze: the job stopped still, or running again with leave_running)
    # leave_running: from the first stop to the job running again (the freeze, then the driver's restore and
    # unlock, and the shim's resume); None where the job was ended instead
    held_ns: int | None = None
    # what the shim kept between the job's commands (its pinned pool, a suspension's image) and gave back
    # before the freeze, so that CRIU did not dump it
    released_pinned_bytes: int = 0
    # What CRIU's dump wrote of the job's pages (its stats): pages considered, written, and named as in
    # the pre-dumps it dumped after instead of written (0 without pre-dumps); the bytes of its pages
    # (None: no stats-dump from CRIU to read them from: not known, never 0)
    pages_scanned: int | None = None
    pages_written: int | None = None
    pages_in_pre_dumps: int | None = None
    page_bytes: int = 0
    # the pre-dumps the dump came after (checkpoint --full --pre-dump, earlier), their pages' bytes, and why
    # pre-dumps waiting for this checkpoint were not used (None where none waited or they were)
    pre_dumps: int = 0
    pre_dump_bytes: int = 0
    pre_dump_unused: str | None = None

    def to_dict(self) -> dict:
        return {"kind": "full", **asdict(self)}


@dataclass(frozen=True)
class FullRestoreReport:
    pid: int
    path: str
    verify_ns: int
    criu_ns: int
    driver_restore_ns: int
    unlock_ns: int
    shim_ns: int
    total_ns: int  # from the start of the CRIU restore to the job running again

    def to_dict(self) -> dict:
        return {"kind": "full", **asdict(self)}


def _cmdline(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def _shim_suspendable(pid: int) -> bool:
    """Whether the job runs under the shim with VMM-backed allocations (what the fast path needs)."""
    from gputrace.shim import client

    if not client.has_shim(pid):
        return False
    # set by `gputrace run --checkpointable --suspendable` (shim/vmm.c)
    return environ(pid).get("GPUTRACE_SHIM_VMM") == "1" and client.socket_path(pid) is not None


def release_kept(pid: int) -> int:
    """What the job's shim keeps between its commands given back: the checkpoints' pinned pool (up to
    $GPUTRACE_SHIM_PIN_CAP, 2 GiB by default), a suspension's kept image, the digest kernel.  It is the
    job's own host memory, which CRIU would dump with the rest; the job's next checkpoint makes it
    again.  Returns the pinned bytes given back (0 where the job runs no shim, or one that keeps
    nothing)."""
    from gputrace.shim import client

    from .ops import ShimSession

    if not client.has_shim(pid) or client.socket_path(pid) is None:
        return 0
    with ShimSession(pid, "checkpoint") as s:
        r = s.request("release")
    return int(r.get("released_pinned_bytes", 0)) if r.get("ok") else 0


def _hash_file(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_BLOCK)
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


def _give_back(pid: int, d: driver.Driver, stopped: bool, shim_suspended: bool) -> None:
    """The job running again as it was: continued, GPU state restored, unlocked, shim resumed."""
    if stopped:
        os.kill(pid, signal.SIGCONT)
    st = d.state()
    if st == "checkpointed":
        d.call("Restore")
        st = d.state()
    if st == "locked":
        d.call("Unlock")
    if shim_suspended:

        resume(pid)


def checkpoint_full(pid: int, out: str | os.PathLike | None = None, *, leave_running: bool = False,
                    timeout_ms: int = 5000, use_shim: bool | None = None,
                    progress: Progress | None = None) -> FullCheckpointReport:
    t_start = time.monotonic_ns()
    require_process(pid)
    comm = procs_comm(pid)
    require_running(pid, "checkpoint")  # a stopped job's driver and shim answer nothing: fail now
    c = criu_mod.find()  # before the job is touched: no CRIU, no freeze
    pend = predump.pending_dir(pid, Path(out).absolute() if out else None)
    out = Path(out).absolute() if out else store.default_out(pid, prefix="full-")
    check_target(out)
    if not pend.exists():
        return _checkpoint_full(pid, out, None, None, t_start=t_start, comm=comm, c=c, leave_running=leave_running,
                                timeout_ms=timeout_ms, use_shim=use_shim, progress=progress)
    # Pre-dumps wait for this checkpoint: the kernel's page tracking of the job stays theirs (locked)
    # until the dump that comes after them has run.
    with predump.Tracking(pid, start_time(pid)) as track:
        chain, unused = predump.usable(pid, out, c, track)
        return _checkpoint_full(pid, out, (chain, unused, pend), track, t_start=t_start, comm=comm, c=c,
                                leave_running=leave_running, timeout_ms=timeout_ms, use_shim=use_shim,
                                progress=progress)


def _checkpoint_full(pid: int, out: Path, pre: tuple | None, track: "predump.Tracking | None", *, t_start: int,
                     comm: str, c: criu_mod.Criu, leave_running: bool, timeout_ms: int, use_shim: bool | None,
                     progress: Progress | None) -> FullCheckpointReport:
    chain, unused, pend = pre if pre else (None, None, None)
    d = driver.Driver(pid)
    if d.state() != "running":
        raise CheckpointError(f"process {pid} is {d.state()} in the driver, not running",
                              "another checkpoint holds it; wait for it, or resume it")
    _check_traces(pid, c, "")
    shim = _shim_suspendable(pid) if use_shim is None else use_shim
    released = release_kept(pid)  # before anything is stopped: the job runs on meanwhile
    # From the first step on, a helper gives the job back if this process dies (checkpointer/guardian.py).
    # Started before the partial directory is made (it takes a process start): made, it is told of it at
    # once, so that a kill between the two cannot leave the directory behind.
    guard = Guardian(pid, "checkpoint --full")
    part = store.PartialDir(out)
    try:
        tmp = part.create(IMAGES)
    except BaseException:
        guard.done()
        raise
    guard.note(partial=str(tmp))
    images = tmp / IMAGES
    if chain is not None:
        try:
            chain.link_into(tmp)  # before the freeze: links, not copies, where they share a filesystem
        except OSError as exc:
            chain, unused = None, f"its pre-dumps could not be linked into the checkpoint ({exc.strerror or exc})"
            for e in pend.glob(f"{predump.PREFIX}*") if pend else ():
                shutil.rmtree(tmp / e.name, ignore_errors=True)
    shim_report, shim_ns, stopped, suspended = None, 0, False, False
    t0 = time.monotonic_ns()
    try:
        if shim:
            guard.note(shim=True)
            try:
                # Into a file of the checkpoint directory, not a memfd: the job then holds its GPU data
                # in a file that CRIU records by path instead of copying it, so the dump stays small and
                # the data reach the directory at the shim's copy speed, with no second copy.  Restore
                # puts the file back at that path.
                r = suspend(pid, timeout_ms=timeout_ms, image_file=tmp / GPU_IMAGE)
                # The job stops when the shim's gate closes, after the image is pinned (setup, seconds
                # for tens of GiB, while the job runs on): the freeze counts from there.
                t0 = time.monotonic_ns() - r.freeze_ns
                shim_report, shim_ns, suspended = r.to_dict(), r.freeze_ns, True
                shim_report["image_path"] = str(tmp / GPU_IMAGE)  # where the job's image says the file is
                stop_point("full:suspended")
            except NotSuspendable as exc:
                # e.g. pitched or stream-ordered memory, which the shim does not release: the
                # driver moves everything instead, as for a job without the shim.
                shim_report = {"skipped": exc.msg}
        guard.note(driver=True)
        lock_ns = d.call("Lock", timeout_ms)
        stop_point("full:locked")
        ck_ns = d.call("Checkpoint")
        stop_point("full:checkpointed")
        # Again, now that the job is still: a tracer may have attached since.
        traced = _check_traces(pid, c, "; the job was given back as it was").uprobes_page is not None
        layout = _layout(pid)
        stopped = True  # from here on CRIU may have stopped the job, even if the dump fails
        # Told before CRIU starts: killed between its start and the note of its pid, gputrace would
        # leave the guardian not knowing that a CRIU it never heard of stops the job.
        guard.note(stopped=True)
        if chain is not None:
            track.set(out / IMAGES, "running")  # the dump clears the job's page tracking; failed, nothing counts
        try:
            dump_ns = criu_mod.dump(c, pid, images, leave_stopped=True,
                                    on_start=lambda criu_pid: guard.note(criu=criu_pid, stopped=True),
                                    parent=f"../{chain.last}" if chain is not None else None)
        except criu_mod.CriuFailed as exc:
            stopped = _is_stopped(pid)  # a failed dump lets the job run on
            raise criu_mod.kept_log(exc, images) from None
        freeze_ns = time.monotonic_ns() - t0
        stop_point("full:dumped")
        opened = open_files(pid)  # still stopped: as CRIU saw them (what replacing the job checks first)
        held_ns = None
        if leave_running:
            # The images are complete: the job runs on while they are searched, checksummed and made
            # valid (a failure from here on discards the checkpoint, never the job).
            _give_back(pid, d, True, suspended)
            stopped = suspended = False
            held_ns = time.monotonic_ns() - t0
            stop_point("full:given-back")
        # And in what CRIU wrote: a tracer that attached while it copied the job (a window of a few
        # ms is enough) left its breakpoints in the images, and the restored job would trap.
        ti = time.monotonic_ns()
        image_check = _check_images(images, pid, layout)
        for e in chain.state["pre_dumps"] if chain is not None else ():
            # the pages the dump named as in a pre-dump: a tracer's breakpoint there would come back too
            again = _check_images(tmp / e["dir"], pid, layout)
            if again != "clean" and image_check == "clean":
                image_check = f"{again} (pre-dump {e['dir']})"
        image_check_ns = time.monotonic_ns() - ti
        tw = time.monotonic_ns()
        # The pre-dumps' files were checksummed as they were written (and their sizes checked since)
        files = (chain.files() if chain is not None else []) + checksums(tmp, images, progress,
                                                                         skip=predump.PREFIX)
        stats = criu_mod.stats(images)
        page_bytes = predump.page_bytes(images)
        manifest = {
            "schema": store.FULL.schema, "format": store.FULL.format, "complete": True, "created_unix": time.time(),
            "host": socket.gethostname(),
            "target": {"pid": pid, "comm": comm, "cmdline": _cmdline(pid), "start_time": start_time(pid),
                       "boot_id": boot_id(), "job": environ(pid).get("GPUTRACE_JOB"), "open_files": opened},
            "gpu": {"libcuda": d.path, "shim": shim_report, "driver_state": "checkpointed",
                    "released_pinned_bytes": released},
            "criu": {"path": c.path, "version": c.version_str, "allow_uprobes": traced, "image_check": image_check,
                     "stats": stats, "page_bytes": page_bytes,
                     # restore needs every one: the dump holds only the pages written after the last
                     "pre_dumps": chain.manifest() if chain is not None else [],
                     "pre_dump_unused": unused},
            "hash": HASH, "files": files,
            "leave_running": leave_running,
            "timings": {"shim_ns": shim_ns, "lock_ns": lock_ns, "checkpoint_ns": ck_ns, "dump_ns": dump_ns,
                        "freeze_ns": freeze_ns, "image_check_ns": image_check_ns, "held_ns": held_ns},
        }
        write_ns = time.monotonic_ns() - tw
        manifest["timings"]["write_ns"] = write_ns
        manifest["timings"]["total_ns"] = time.monotonic_ns() - t_start
        part.write_file(MANIFEST, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
        part.commit()
        if chain is not None:
            track.set(out / IMAGES, "done")
    except BaseException as exc:
        try:
            _give_back(pid, d, stopped, suspended)  # before the directory goes: the shim reads gpu.img back
        except CheckpointError as again:
            raise CheckpointError(f"{exc}; and giving the job back failed too: {again.msg}",
                                  f"the job may be frozen: check `gputrace shim status -p {pid}`") from None
        finally:
            part.discard()
            guard.done()
        if isinstance(exc, OSError):
            raise disk_error(exc, out) from None
        raise
    try:
        if pend is not None:
            shutil.rmtree(pend, ignore_errors=True)  # used (linked into the checkpoint), or of no use any more
        if not leave_running:
            os.kill(pid, signal.SIGKILL)  # its state is safe on disk: the job ends here
    finally:
        guard.done()
    criu_bytes = sum(f["bytes"] for f in files if f["path"].startswith(IMAGES + "/"))
    return FullCheckpointReport(pid, str(out), sum(f["bytes"] for f in files), criu_bytes, len(files), shim_report,
                                shim_ns,
                                lock_ns, ck_ns, dump_ns, freeze_ns, write_ns, time.monotonic_ns() - t_start,
                                leave_running, f"{c.path} {c.version_str}", image_check, image_check_ns, held_ns,
                                released, *(stats.get(k, 0) if stats else None for k in ("pages_scanned", "pages_written",
                                                                          "pages_skipped_parent")), page_bytes,
                                len(chain.state["pre_dumps"]) if chain is not None else 0,
                                chain.bytes() if chain is not None else 0, unused)


def pre_dump(pid: int, out: str | os.PathLike | None = None) -> predump.PreDumpReport:
    """`checkpoint --full --pre-dump`: one pre-dump of the running job `pid`, for the final checkpoint
    `out` (checkpointer/predump.py says how they chain and where they wait).
    The job is never locked, checkpointed in the driver or gated; CRIU freezes its tasks for their page
    maps alone.  A failure keeps nothing (and says so); the final checkpoint then dumps whole."""
    t_start = time.monotonic_ns()
    require_process(pid)
    require_running(pid, "pre-dump")
    c = criu_mod.find()
    criu_mod.require_dirty_tracking(c)  # without it CRIU aborts half-way and leaves its code in the job
    target = Path(out).absolute() if out else None
    if target is not None:
        store.check_target(target)
    pend = predump.pending_dir(pid, target)
    st = predump.read_state(pend)
    if st is not None and not predump.same_process(st, pid):
        t = st.get("target", {})
        raise CheckpointError(f"{pend} holds pre-dumps of another process (pid {t.get('pid')}, {t.get('comm')}), "
                              f"not of {pid}", f"remove {pend}, or give another -o")
    _check_traces(pid, c, "")
    released = release_kept(pid)  # not dumped: the final dump gives it back too
    start = start_time(pid)
    with predump.Tracking(pid, start) as track:
        restarted = None
        if st is not None and st.get("pre_dumps") and not track.counts_from(predump.last_images(pend, st)):
            restarted = ("another pre-dump or dump of the job cleared the kernel's page tracking since the last "
                         "one there: it started again")
            shutil.rmtree(pend, ignore_errors=True)
            st = None
        if st is None:
            pend.parent.mkdir(parents=True, exist_ok=True)  # the default root, without -o
            pend.mkdir(mode=0o700, exist_ok=True)
            st = {"schema": 1, "format": predump.FORMAT, "created_unix": time.time(),
                  "target": {"pid": pid, "comm": procs_comm(pid), "start_time": start, "boot_id": boot_id(),
                             "checkpoint": str(target) if target else None},
                  "criu": {"path": c.path, "version": c.version_str}, "hash": HASH, "pre_dumps": []}
            predump.write_state(pend, st)
        n = len(st["pre_dumps"]) + 1
        name = f"{predump.PREFIX}{n}"
        work = pend / f".{name}.partial"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(mode=0o700)
        parent = f"../{st['pre_dumps'][-1]['dir']}" if st["pre_dumps"] else None
        images = pend / name
        track.set(images, "running")  # should it fail half-way, nothing counts from it
        try:
            ns = criu_mod.pre_dump(c, pid, work, parent)
        except criu_mod.CriuFailed as exc:
            failed = criu_mod.kept_log(exc, work, "pre-dump.log")
            shutil.rmtree(pend, ignore_errors=True)
            left = predump.parasite_left(pid)
            raise predump.PreDumpFailed(
                f"{failed.msg}; the job runs on" + (", but CRIU left its own code mapped in it (/memfd:CRIUMFD): "
                                                    "a whole-process checkpoint would carry that, so restart the job "
                                                    "when you can" if left else ""),
                f"{failed.hint}. Nothing was kept: the next `checkpoint --full` dumps the whole host memory in its "
                "freeze") from None
        except BaseException:
            shutil.rmtree(pend, ignore_errors=True)
            raise
        tw = time.monotonic_ns()
        try:
            os.rename(work, images)
            track.set(images, "done")
            (images / "pre-dump.log").unlink(missing_ok=True)  # a log, not an image: nothing restores from it
            stats = criu_mod.stats(images)
            entry = {"dir": name, "created_unix": time.time(), "ns": ns, "stats": stats,
                     "bytes": predump.page_bytes(images), "files": predump.hash_files(images, name)}
            st["pre_dumps"].append(entry)
            predump.write_state(pend, st)
        except BaseException:
            shutil.rmtree(pend, ignore_errors=True)
            raise
    write_ns = time.monotonic_ns() - tw
    return predump.PreDumpReport(pid, str(pend), str(target) if target else "", n, restarted, ns,
                                 *(stats.get(k, 0) * m if stats else None for k, m in (("frozen_time_us", 1000),
                                   ("pages_scanned", 1), ("pages_written", 1))), entry["bytes"], n,
                                 sum(e["bytes"] for e in st["pre_dumps"]), released, write_ns,
                                 time.monotonic_ns() - t_start, f"{c.path} {c.version_str}")


def open_files(pid: int) -> list[dict]:
    """The regular files process `pid` has open: [{fd, path, flags, bytes}] (deleted files, memfds and
    anything not a plain file on a path left out: CRIU carries those itself)."""
    out = []
    try:
        fds = sorted(int(n) for n in os.listdir(f"/proc/{pid}/fd") if n.isdigit())
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            st = os.stat(f"/proc/{pid}/fd/{fd}")
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = next(int(ln.split()[1], 8) for ln in f if ln.startswith("flags:"))
        except (OSError, StopIteration, ValueError, IndexError):
            continue
        if stat.S_ISREG(st.st_mode) and target.startswith("/") and not target.endswith(" (deleted)"):
            out.append({"fd": fd, "path": target, "flags": flags, "bytes": st.st_size})
    return out


def checksums(tmp: Path, images: Path, progress: Progress | None, skip: str | None = None) -> list[dict]:
    """Every file under tmp checksummed (the manifest's `files`) and synced, with the images' directory
    (but those under a directory of tmp whose name starts with `skip`, and symbolic links)."""
    files = []
    parts = sorted(p for p in tmp.rglob("*") if p.is_file() and not p.is_symlink()
                   and not (skip and p.relative_to(tmp).parts[0].startswith(skip) and len(p.relative_to(tmp).parts) > 1))
    total = sum(p.stat().st_size for p in parts)
    done = 0
    for p in parts:
        files.append({"path": str(p.relative_to(tmp)), "bytes": p.stat().st_size, HASH: _hash_file(p)})
        done += files[-1]["bytes"]
        if progress:
            progress("checksum", done, total)
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    store.fsync_dir(images)
    return files


def _check_traces(pid: int, c: criu_mod.Criu, after: str) -> uprobes.Traces:
    """What uprobe tracers left in the job, refused where CRIU cannot carry it or the restored job would
    trap: see checkpointer/uprobes.py."""
    try:
        t = uprobes.traces(pid)
    except OSError:
        return uprobes.Traces()  # gone or unreadable: the steps that follow say which
    if t.harmful:
        raise CheckpointError(f"process {pid} carries {t.describe()}; restored, it would trap on its next driver "
                              f"call{after}",
                              "stop the tracer (`gputrace attach`, another eBPF tool) and try again; calls in "
                              "flight return within moments. In `gputrace top`, `c` pauses top's own tracing")
    if t.uprobes_page is not None and not c.allows_uprobes:
        raise CheckpointError(f"process {pid} holds the kernel's [uprobes] page (a uprobe tracer has hit it), "
                              f"which CRIU {c.version_str} cannot dump{after}",
                              "CRIU >= 4.2 can (--allow-uprobes): run scripts/install-criu, or set GPUTRACE_CRIU to "
                              "one; or restart the job and checkpoint it before anything traces it")
    return t


def _layout(pid: int) -> list[uprobes.Mapping] | None:
    """The job's mappings right before CRIU runs (the job is locked: they stay), for _check_images."""
    try:
        return uprobes.maps(pid)
    except OSError:
        return None  # gone: CRIU says so next


def _check_images(images: Path, pid: int, layout: list[uprobes.Mapping] | None) -> str:
    """Refuses images that carry a tracer's breakpoints or pending returns; returns what was checked
    ("clean", or why it could not be: images this reader does not know are not refused for that)."""
    if layout is None:
        return "skipped: the job's mappings could not be read before the dump"
    try:
        t = uprobes.image_traces(images, pid, layout)
    except (OSError, uprobes.ImageError) as exc:
        return f"skipped: {exc}"
    if t.harmful:
        raise CheckpointError(f"the images CRIU wrote of process {pid} carry {t.describe()} (a tracer attached "
                              "while CRIU copied the job); restored, it would trap: the job was given back as it was",
                              "stop the tracer (`gputrace attach`, `gputrace top`, another eBPF tool) and try again")
    return "clean"


def _restored_driver(pid: int, path: Path) -> "driver.Driver":
    """The driver of the process CRIU just restored; a CheckpointError that says what happened where
    it is not there to drive: the process ended right after CRIU made it (its status, from this
    subreaper's wait, or its zombie state), or it maps no libcuda."""
    try:
        return driver.Driver(pid)
    except (NoLibcuda, NoSuchProcess) as exc:
        ended = _ended(pid)
        again = f"the checkpoint is untouched: `gputrace restore --full {path}` once the cause is fixed"
        if ended:
            raise CheckpointError(f"the restored process {pid} {ended} right after CRIU restored it, before its GPU "
                                  "state was given back", f"the job's own output (where its stdout and stderr "
                                  f"went) says why; {again}") from None
        raise CheckpointError(f"the restored process {pid} maps no libcuda ({exc.msg}; {_maps_summary(pid)})",
                              f"CRIU restored it without the driver's library: check that the files it had open "
                              f"at the checkpoint are there unchanged; {again}") from None


def _maps_summary(pid: int) -> str:
    """What a restored process maps, in a line: its number of mappings and the driver-like files among
    them (what tells a libcuda CRIU brought back under another name from one it did not bring back)."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError as exc:
        return f"its memory map is unreadable: {exc.strerror or exc}"
    names = [ln.split(maxsplit=5)[5] for ln in text.splitlines() if len(ln.split(maxsplit=5)) == 6]
    driver = sorted({n for n in names if "cuda" in n.lower() or "nvidia" in n.lower()})
    listed = ", ".join(driver[:6]) + (f" and {len(driver) - 6} more" if len(driver) > 6 else "")
    return f"{len(text.splitlines())} mappings, driver-like files: {listed or 'none'}"


def _ended(pid: int) -> str | None:
    """How `pid` ended, if it has: "exited with status N" or "was killed by SIGNAME" (reaping it, as
    its subreaper), or "has exited" for a zombie that is not this process's to wait for."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        got = 0
    if got == pid:
        if os.WIFSIGNALED(status):
            return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
        return f"exited with status {os.WEXITSTATUS(status)}"
    f = stat_fields(pid)
    if f is None or f[0] in (b"Z", b"X"):
        return "has exited"
    return None


def _subreaper(on: bool) -> None:
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


def _reap_leftover(pid: int, timeout_s: float = 5.0) -> None:
    """After a failed `criu restore`: the task CRIU had made at the job's pid, killed by CRIU, is this
    process's child (a subreaper's); reaped here, or its zombie would keep the pid taken until init
    reaps it (seconds on some hosts), and a second try at once would find the pid in use. The pid
    was free before CRIU ran, so whatever holds it now is CRIU's."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # gone already
    try:
        select.select([fd], [], [], timeout_s)  # readable once it has exited
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    finally:
        os.close(fd)


def _is_stopped(pid: int) -> bool:
    f = stat_fields(pid)
    return f is not None and f[0] in (b"T", b"t")


def _pre_dump_links(path: Path, m: dict) -> None:
    """A checkpoint dumped after pre-dumps: every pre-dump its manifest names is there, and CRIU's
    `parent` links chain them as they were written (criu/ -> the last, each to the one before)."""
    pre = [e["dir"] for e in (m.get("criu") or {}).get("pre_dumps") or []]
    for i, name in enumerate(pre):
        if not (path / name).is_dir():
            raise CorruptCheckpoint(f"{path / name}, a pre-dump of this checkpoint, is missing: its final dump holds "
                                    f"only the pages the job wrote after it", _PRE_HINT)
    for d, want in [(IMAGES, pre[-1] if pre else None)] + [(pre[i], pre[i - 1]) for i in range(1, len(pre))] + \
            ([(pre[0], None)] if pre else []):
        link = path / d / "parent"
        have = os.readlink(link) if link.is_symlink() else None
        if have != (f"../{want}" if want else None):
            raise CorruptCheckpoint(f"{link} is {'missing' if have is None else repr(have)}, where the manifest "
                                    f"says {('../' + want) if want else 'none'}: the pre-dumps do not chain as they "
                                    f"were written", _PRE_HINT)


_PRE_HINT = ("restore needs every pre-N directory of the checkpoint with its `parent` link as written: copy a "
             "checkpoint whole (cp -a, rsync -a); nothing was restored")


def verify(path: Path, m: dict, progress: Progress | None = None) -> None:
    """Every file the manifest lists: a plain file inside the checkpoint, of its size, with its checksum
    (`progress("verify", done, total)` in bytes as it goes); and the pre-dumps it was dumped after,
    chained as they were."""
    _pre_dump_links(path, m)
    total = sum(f["bytes"] for f in m["files"])
    done = 0
    for f in m["files"]:
        p = path / f["path"]
        pre = f["path"].split("/", 1)[0] if f["path"].startswith(predump.PREFIX) else None
        why = (f": a pre-dump's, which the final dump needs for the pages the job did not write after it"
               if pre else "")
        try:
            fd, size = open_regular(p, what="image file")
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(exc.msg + why, _PRE_HINT if pre else exc.hint) from None
        with os.fdopen(fd, "rb", buffering=0) as src:
            if size != f["bytes"]:
                raise CorruptCheckpoint(f"{p} is {size} bytes, the manifest says {f['bytes']}{why}",
                                        "the checkpoint is damaged; take a new one")
            h = xxhash.xxh3_64()
            buf = bytearray(_BLOCK)
            while n := src.readinto(buf):
                h.update(memoryview(buf)[:n])
                done += n
                if progress:
                    progress("verify", done, total)
        if h.hexdigest() != f[HASH]:
            raise CorruptCheckpoint(f"{p} fails its {HASH} checksum{why}", "the checkpoint is damaged; take a new one")


def _taken_tids(images: Path) -> list[tuple[int, str]]:
    """The checkpointed job's thread ids (CRIU's core-TID.img files) that some task on this host holds
    now, each with who holds it: CRIU restores every thread at its old id and fails on any taken."""
    out = []
    for p in sorted(images.glob("core-*.img")):
        try:
            tid = int(p.name[5:-4])
        except ValueError:
            continue
        try:
            status = Path(f"/proc/{tid}/status").read_text()
        except OSError:
            continue
        tgid = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("Tgid:")), "?")
        out.append((tid, f"{procs_comm(int(tgid)) if tgid.isdigit() else '?'} (pid {tgid})"))
    return out


def verified_for_restore(path: Path, m: dict, progress: Progress | None) -> tuple[int, criu_mod.Criu]:
    """Every file of a whole-process (or whole-job) checkpoint checked, and a CRIU that can restore it:
    (the check's ns, that CRIU). Before anything is restored."""
    tv = time.monotonic_ns()
    verify(path, m, progress)
    verify_ns = time.monotonic_ns() - tv
    c = criu_mod.find()
    if m["criu"].get("allow_uprobes") and not c.allows_uprobes:
        raise CheckpointError(f"this checkpoint holds the kernel's [uprobes] page (a tracer had hit the job), "
                              f"which CRIU {c.version_str} cannot restore",
                              "CRIU >= 4.2 can (--allow-uprobes): run scripts/install-criu, or set GPUTRACE_CRIU "
                              "to one")
    return verify_ns, c


def restore_full(path: str | os.PathLike, *, gpu_map: list[tuple[str, str]] | None = None,
                 progress: Progress | None = None) -> FullRestoreReport:
    path = Path(path).absolute()
    m = store.read_manifest(path, store.FULL)
    verify_ns, c = verified_for_restore(path, m, progress)
    pid = int(m["target"]["pid"])
    pairs = _resolve_pairs(m["gpu"]["libcuda"], gpu_map) if gpu_map else None  # bad GPUs: refused before CRIU runs
    if Path(f"/proc/{pid}").exists():
        raise CheckpointError(f"cannot restore process {pid}: pid {pid} is in use on this host "
                              f"({procs_comm(pid) if Path(f'/proc/{pid}').exists() else 'gone now'})",
                              "CRIU brings a process back at its old pid: end the process that holds it, or "
                              "restore in a new pid namespace (`unshare --pid --fork --mount-proc`)")
    taken = _taken_tids(path / IMAGES)
    if taken:
        listed = ", ".join(f"{tid} (held by {who})" for tid, who in taken[:4]) + \
            (f" and {len(taken) - 4} more" if len(taken) > 4 else "")
        raise CheckpointError(f"cannot restore process {pid}: thread ids of the checkpointed job are in use on this "
                              f"host: {listed}",
                              "CRIU brings every thread back at its old id: end those processes, or restore in a new "
                              "pid namespace (`unshare --pid --fork --mount-proc`); nothing was restored")
    work = Path(tempfile.mkdtemp(prefix=f"gputrace-restore-{pid}-"))  # CRIU's log and pidfile
    t0 = time.monotonic_ns()
    link = _gpu_image_at_dump_path(path, m)
    # As a subreaper, this process inherits the restored job when criu exits, so that it can end and
    # reap it if the GPU side fails (the pid is then free at once for another try).
    _subreaper(True)
    # Once CRIU has made the process, it waits in the driver's checkpointed state for us: if this
    # process dies before it is restored and unlocked, the guardian finishes the job's way back.
    guard = Guardian(pid, "restore --full")
    shim_held = (m["gpu"].get("shim") or {}).get("allocations") is not None
    try:
        criu_ns = criu_mod.restore(c, path / IMAGES, work, pid, leave_stopped=True,
                                   on_start=lambda criu_pid: guard.note(criu=criu_pid, driver=True, shim=shim_held))
    except criu_mod.CriuFailed:
        guard.done()
        _unlink_gpu_image(link)
        _reap_leftover(pid)
        raise  # its message points at the log in `work`: that stays
    except BaseException:
        guard.done()
        _unlink_gpu_image(link)
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        _subreaper(False)
    try:
        d = _restored_driver(pid, path)
        # CRIU left it stopped: until the driver has put its device mappings back, only the thread
        # that serves the driver's calls runs (checkpointer/hold.py).
        with hold.held(pid, d.restore_tid()):
            st = d.state()
            if st != "checkpointed":
                raise CheckpointError(f"the restored process {pid} is {st} in the driver, not checkpointed",
                                      "the image was not taken by `gputrace checkpoint --full`")
            rs_ns = _restore_gpu(d, pairs) if pairs else d.call("Restore")
            un_ns = d.call("Unlock")
        shim_ns = resume(pid).total_ns if shim_held else 0
    except CheckpointError as exc:
        # A process back from CRIU without its GPU state is of no use: end it, so that the checkpoint
        # (untouched) can be restored again once the cause is fixed.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        hint = exc.hint
        if exc.msg.startswith("cuCheckpointProcess"):
            # The driver's own hint speaks of a live job; this one is ended, its checkpoint intact.
            hint = (f"the driver could not give the job its GPU state back (the GPU it ran on gone, busy or of "
                    f"another driver? `--gpu-map OLD=NEW` restores onto another GPU); the checkpoint is "
                    f"untouched: `gputrace restore --full {path}` once the cause is fixed")
        raise CheckpointError(f"{exc.msg}; the restored process was ended", hint) from None
    finally:
        guard.done()
        _unlink_gpu_image(link)  # after resume the shim holds the file no more
        shutil.rmtree(work, ignore_errors=True)
    total = time.monotonic_ns() - t0
    return FullRestoreReport(pid, str(path), verify_ns, criu_ns, rs_ns, un_ns, shim_ns, total)


def uuid_bytes(lib, spec: str) -> bytes:
    """A GPU named by index ("1") or UUID ("GPU-0a1b...", as nvidia-smi prints it): its 16 UUID bytes."""
    import ctypes

    if spec.isdigit():
        if lib.cuInit(0) != 0:
            raise CheckpointError(f"cannot initialize the driver to look up GPU {spec}", "give GPUs by UUID instead")
        dev, buf = ctypes.c_int(), ctypes.create_string_buffer(16)
        if lib.cuDeviceGet(ctypes.byref(dev), int(spec)) != 0 or lib.cuDeviceGetUuid_v2(buf, dev) != 0:
            raise CheckpointError(f"there is no GPU {spec} on this host", "see nvidia-smi -L for the GPUs there are")
        return buf.raw
    hexs = spec.removeprefix("GPU-").replace("-", "")
    try:
        raw = bytes.fromhex(hexs)
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise CheckpointError(f"--gpu-map: {spec} is neither a GPU index nor a UUID",
                              "UUIDs as nvidia-smi -L prints them: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx")
    return raw


def _resolve_pairs(libcuda: str, pairs: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """--gpu-map's OLD=NEW as UUID bytes; indices are looked up with this host's driver (the same library
    file the job used, when it is here)."""
    try:
        lib = driverapi.library(libcuda if Path(libcuda).exists() else "libcuda.so.1")
    except OSError:
        raise CheckpointError("no CUDA driver on this host to look the GPUs of --gpu-map up",
                              "restore on a host with the NVIDIA driver, or give the GPUs by UUID") from None
    return [(uuid_bytes(lib, old), uuid_bytes(lib, new)) for old, new in pairs]


def _restore_gpu(d: "driver.Driver", pairs: list[tuple[bytes, bytes]]) -> int:
    """cuCheckpointProcessRestore with GPU pairs (CUcheckpointRestoreArgs.gpuPairs, CUDA 12.9+)."""
    import ctypes

    arr = (ctypes.c_uint8 * (32 * len(pairs)))()
    for i, (old, new) in enumerate(pairs):
        arr[32 * i:32 * i + 16] = list(old)
        arr[32 * i + 16:32 * i + 32] = list(new)
    args = (ctypes.c_uint8 * 64)()
    ctypes.c_void_p.from_buffer(args).value = ctypes.addressof(arr)
    ctypes.c_uint32.from_buffer(args, 8).value = len(pairs)
    t = time.monotonic_ns()
    r = d.lib.cuCheckpointProcessRestore(d.pid, args)
    if r:
        raise CheckpointError(f"cuCheckpointProcessRestore of process {d.pid} with --gpu-map failed: CUresult {r}",
                              "each OLD must be a GPU the job used and each NEW a GPU of this host; the job is "
                              "still checkpointed: retry with another --gpu-map")
    return time.monotonic_ns() - t


def _gpu_image_at_dump_path(path: Path, m: dict) -> Path | None:
    """The restored job opens its GPU data file at the path it had at dump time (inside the .partial
    directory, since renamed): link the checkpoint's gpu.img there for the restore.  Returns the link
    made, or None when there is none to make."""
    at = (m["gpu"].get("shim") or {}).get("image_path")
    if not at:
        return None
    at = Path(at)
    if at.exists():
        raise CheckpointError(f"{at} exists: another restore of this checkpoint may be running",
                              "wait for it, or remove that path if it is left over from a crash")
    at.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.link(path / GPU_IMAGE, at)
    except OSError:  # another filesystem: a symbolic link opens the same file
        os.symlink(path / GPU_IMAGE, at)
    return at


def _unlink_gpu_image(link: Path | None) -> None:
    if link is None:
        return
    with contextlib.suppress(OSError):
        link.unlink()
    with contextlib.suppress(OSError):
        link.parent.rmdir()
