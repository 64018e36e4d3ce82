"""Whole-job checkpoint: a process tree (a launcher and its ranks), each rank's GPU state by its shim and
the driver, the CPU state of the whole tree by one CRIU dump, one manifest.

checkpoint_job(root, ranks, DIR), all of it under one time bound (`timeout_s`):
  1. every rank is stopped together through the shim's stepped protocol (checkpointer/gang.py: gates
     closed, ranks behind run on to the same collective, all drained), so that no rank is frozen while
     a peer waits for it in a collective.  Where every rank runs with --suspendable, each shim then
     suspends its rank (the fast path of checkpointer/full.py), its data into DIR/gpu-RANK.img; where
     a rank's shim refuses, every rank is given back and stopped again without it.
  2. the driver: cuCheckpointProcessLock on every rank at once, then Checkpoint on every rank at once.
     The gates then reopen (calls held there pass into the driver and wait at its lock) and the gang's
     connections close: CRIU must find no socket of ours in the job.
  3. ONE `criu dump --leave-stopped` of the root: CRIU takes the root and every descendant.
  4. the images searched for a tracer's traces (each process), checksums, the manifest, the partial
     directory synced and renamed into place (checkpointer/store.py).
  5. without leave_running every process of the tree is killed; with it every rank is given back.
Any failure on the way (a rank that dies or fails, CRIU, the bound) gives EVERY rank back running and
ungated (continued, the driver's Restore and Unlock, the shim's unsuspend, gates open), discards the
partial directory and raises a CheckpointError that names the rank and the cause.  A guardian per
process of the tree (checkpointer/guardian.py) does the same if gputrace dies on the way; a rank that
cannot answer (stopped by someone else) is handed to its guardian, which gives it back once it runs.

restore_job(DIR): every file checked against the manifest and every pid and thread id of the tree
checked free before anything runs; `criu restore --leave-stopped` of the tree; then each rank's
driver Restore (with --gpu-map's pairs, the same for every rank) and Unlock while every thread of it
but the driver's own is held (checkpointer/hold.py), every rank's GPU state back before any of them
runs; then the other processes continued and each rank's shim resumed.  If a rank's GPU state cannot
be put back, the restored tree is ended (the checkpoint is untouched) and the error names the rank.

Manifest (schema 1, DIR/manifest.json): schema, format ("gputrace-full-job-checkpoint"), complete,
created_unix, host, root {pid, comm, cmdline} (the process CRIU was given), processes [{pid, comm}]
(every process of the tree CRIU dumped, the root first), collectives (where every rank was stopped:
collectives launched by each), aligned (each just after its launch of that collective),
ranks [{rank, pid, comm, cmdline, libcuda, driver_state ("checkpointed"), shim (the shim's suspend
report, with image_path (where the rank's image says its data file is) and file (that file in DIR);
{"skipped": why} where a shim refused; null where the fast path was not tried), lock_ns,
checkpoint_ns}], criu {path, version, allow_uprobes, image_check}, hash ("xxh3_64"),
files [{path, bytes, xxh3_64}] (every file but the manifest), leave_running,
timings {quiesce_ns (first gate closed to every rank stopped, drained and suspended), lock_ns and
checkpoint_ns (the slowest rank's), dump_ns, freeze_ns (first gate closed to the end of the dump),
image_check_ns, write_ns, total_ns}.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import orjson

from gputrace.base.errors import CheckpointError, GputraceError, NoLibcuda, NoSuchProcess, UsageError
from gputrace.base.procs import alive, comm, descendants, require_process, require_running, stat_fields, stop_point

from . import criu as criu_mod
from . import driver, gang, hold, store
from .full import (IMAGES, _check_images, _check_traces, _cmdline, _layout, _reap_leftover,
                   _resolve_pairs, _restore_gpu, _restored_driver, _shim_suspendable, _subreaper, _taken_tids,
                   _unlink_gpu_image, checksums, verified_for_restore)
from .gang import REPLY_GRACE_S, Gang, GangError
from .guardian import Guardian
from .ops import DEFAULT_CHUNK, DEFAULT_LANES
from .store import HASH, MANIFEST, Progress, check_target, disk_error
from .suspend import resume

DEFAULT_TIMEOUT_S = 120.0  # CRIU copies every process's host memory inside it
GIVE_BACK_S = 60.0  # for each rank's way back (Restore copies its device memory back)
PIDS_FREE_S = 10.0  # a restore waits this long for the killed job's zombies to be reaped
WHAT = "checkpoint --full"


# ---------------------------------------------------------------------------------------------------------------
# Which processes


def _parent(pid: int) -> int:
    f = stat_fields(pid)
    return int(f[1]) if f and len(f) > 1 else 0


def _ancestors(pid: int) -> list[int]:
    """pid's parent, its parent's, ... up to init."""
    out: list[int] = []
    p = _parent(pid)
    while p > 0 and p not in out:
        out.append(p)
        p = _parent(p)
    return out


def _root_of(pids: list[int]) -> int:
    """The one of `pids` that all the others descend from; UsageError naming their common ancestor where
    there is none (CRIU dumps a tree from its root)."""
    chains = {p: _ancestors(p) for p in pids}
    for p in pids:
        if all(q == p or p in chains[q] for q in pids):
            return p
    common = next((a for a in chains[pids[0]] if all(a in chains[q] for q in pids)), None)
    listed = ", ".join(map(str, pids))
    if common is None or common == 1:
        hint = "give the processes of one job with their launcher (the process they all descend from), or --tree PID"
    else:
        hint = (f"CRIU dumps a process and all its descendants: give their common ancestor, pid {common} "
                f"({comm(common)}): gputrace checkpoint --full --tree {common} (it and everything below it is "
                "checkpointed)")
    raise UsageError(f"processes {listed} are not one process tree: none of them is an ancestor of all the others",
                     hint)


def _uses_gpu(pid: int) -> bool:
    """Whether the driver answers for `pid`: it has initialized CUDA (a launcher that only maps libcuda has not)."""
    try:
        driver.Driver(pid).state()
        return True
    except (GputraceError, OSError):
        return False


def job_tree(pids: list[int] | None = None, tree_of: int | None = None) -> tuple[int, list[int]]:
    """(root, ranks): the process CRIU is given (--tree PID, or the one of `pids` the others descend from)
    and the processes of its tree that run the shim, in pid order.  Refused: pids that are not one tree;
    ranks of the tree left out of `pids`; a process of the tree that uses the GPU without the shim (it
    could not be stopped with the others); ranks not of one job (gang.resolve)."""
    pids = list(pids or [])
    for p in pids + ([tree_of] if tree_of is not None else []):
        try:
            require_process(p)
        except NoSuchProcess:
            raise NoSuchProcess(f"no process with pid {p}", "check the pids with `gputrace ps`; that rank may have "
                                                            "exited") from None
    root = tree_of if tree_of is not None else _root_of(pids) if pids else None
    if root is None:
        raise UsageError("checkpoint --full of a job needs its processes", "give --tree LAUNCHER, or -p LAUNCHER,RANK,...")
    procs = descendants(root)
    outside = [p for p in pids if p not in procs]
    if outside:
        raise UsageError(f"process(es) {', '.join(map(str, outside))} are not in the tree of {root} ({comm(root)})",
                         f"give the processes of one tree, or only its root: gputrace checkpoint --full --tree {root}")
    ranks = gang.tree(root)
    if pids:
        left_out = [r for r in ranks if r not in pids]
        if left_out:
            raise UsageError(f"process(es) {', '.join(map(str, left_out))} of the tree of {root} run the shim and were "
                             "not given; CRIU checkpoints the whole tree, so every rank must be stopped with the others",
                             f"give them too, or the tree: gputrace checkpoint --full --tree {root}")
        strays = [p for p in pids if p != root and p not in ranks]
        if strays:
            gang.resolve(strays)  # a given pid of the tree that is no rank: named there, with what to do
    ranks = gang.resolve(ranks)
    for p in procs:
        if p not in ranks and _uses_gpu(p):
            raise CheckpointError(f"process {p} ({comm(p)}) of the tree of {root} uses the GPU without the gputrace shim",
                                  "every process of the job that uses the GPU must run under the shim, so that all "
                                  "are stopped together: start the job with gputrace run --checkpointable -- LAUNCHER")
    return root, ranks


# ---------------------------------------------------------------------------------------------------------------
# Reports


@dataclass(frozen=True)
class FullJobReport:
    root: int
    pids: list[int]  # the ranks
    processes: list[int]  # every process CRIU dumped, the root first
    path: str
    collectives: int
    aligned: bool
    ranks: list[dict]  # {rank, pid, comm, shim, lock_ns, checkpoint_ns}
    image_bytes: int
    criu_bytes: int
    files: int
    quiesce_ns: int
    lock_ns: int
    checkpoint_ns: int
    dump_ns: int
    freeze_ns: int
    image_check: str
    image_check_ns: int
    write_ns: int
    total_ns: int
    leave_running: bool
    criu: str

    def to_dict(self) -> dict:
        return {"kind": "full-job", **asdict(self)}


@dataclass(frozen=True)
class FullJobRestoreReport:
    root: int
    pids: list[int]
    processes: list[int]
    path: str
    ranks: list[dict]  # {rank, pid, driver_restore_ns, unlock_ns, shim_ns}
    verify_ns: int
    criu_ns: int
    gpu_ns: int  # every rank's threads held to every rank's GPU state back and unlocked
    shim_ns: int  # every rank's shim resumed (0 where none had suspended)
    total_ns: int  # from the start of the CRIU restore to every process running again

    def to_dict(self) -> dict:
        return {"kind": "full-job", **asdict(self)}


# ---------------------------------------------------------------------------------------------------------------
# Ranks, at once and bounded


@dataclass
class _Rank:
    index: int
    pid: int
    d: driver.Driver
    comm: str
    guard: Guardian | None = None
    shim: dict | None = None
    suspended: bool = False  # suspended by its shim and kept: a shim resume gives it back
    lock_ns: int = 0
    checkpoint_ns: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def who(self) -> str:
        return f"rank {self.index} (pid {self.pid})"


_LATE = object()


def _at_once(ranks: list[_Rank], fn: Callable[[_Rank], object], until: float | None) -> tuple[list, list[_Rank]]:
    """fn on every rank at once, each in a thread of its own, waited for until the monotonic time
    `until` (None: for good): (each one's result or exception, in rank order, _LATE for one still
    running; those ranks).
    A thread left running is a daemon: a driver call of a rank that does not answer cannot hold this
    process."""
    out: list = [_LATE] * len(ranks)

    def run(i: int, r: _Rank) -> None:
        try:
            out[i] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, r), daemon=True, name=f"gputrace-rank-{r.index}")
               for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(None if until is None else max(0.0, until - time.monotonic()))
    return out, [r for r, t in zip(ranks, threads) if t.is_alive()]


def _each(ranks: list[_Rank], fn: Callable[[_Rank], object], deadline: float, timeout_s: float, what: str) -> list:
    """fn on every rank at once within the bound (and a grace for a reply on its way); the first failure
    raised as a GangError naming its rank: a rank gone first, then a rank's own failure, then the bound."""
    out, late = _at_once(ranks, fn, deadline + REPLY_GRACE_S)
    failed = [(r, x) for r, x in zip(ranks, out) if isinstance(x, BaseException)]
    if failed:
        failed.sort(key=lambda e: (alive(e[0].pid), e[0].index))
        r, exc = failed[0]
        if not isinstance(exc, GputraceError):
            raise exc
        if not alive(r.pid):
            raise GangError(f"{r.who} exited during the {WHAT}", "")
        raise GangError(f"{r.who} failed: {exc.msg}", exc.hint)
    if late:
        raise GangError(f"the {WHAT} of the job's {len(ranks)} processes ran past its bound of {timeout_s:g} s at "
                        f"{late[0].who}: {what} did not return", "")
    return out


def _give_back(ranks: list[_Rank], procs: list[int], stopped: bool) -> list[str]:
    """Every process of the job running as it was: continued (where CRIU may have stopped it), each
    rank's GPU state restored and unlocked in the driver, its shim resumed.  Ranks at once, each bounded;
    a rank that does not answer (stopped by someone else) is handed to its guardian.  Returns what could
    not be done, rank by rank."""
    if stopped:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)
    problems: list[str] = []
    live = [r for r in ranks if alive(r.pid)]
    held = [r for r in live if (stat_fields(r.pid) or [b""])[0] in (b"T", b"t")]
    for r in held:
        problems.append(f"{r.who} is stopped (SIGSTOP or a debugger) and cannot answer: a guardian gives it back "
                        "once it runs again")

    def back(r: _Rank) -> None:
        st = r.d.state()
        if st == "checkpointed":
            r.d.call("Restore")
            st = r.d.state()
        if st == "locked":
            r.d.call("Unlock")
        if r.suspended:
            resume(r.pid)
            r.suspended = False

    todo = [r for r in live if r not in held]
    out, late = _at_once(todo, back, time.monotonic() + GIVE_BACK_S)
    for r, x in zip(todo, out):
        if r in late:
            problems.append(f"{r.who} did not answer within {GIVE_BACK_S:g} s: a guardian gives it back once it does")
            held.append(r)
        elif isinstance(x, BaseException) and alive(r.pid):
            problems.append(f"{r.who}: {x}")
    for r in held:
        if r.guard is not None:
            r.guard.leave()
            r.guard = None
    return problems


def _failed(exc: GputraceError, problems: list[str], pids: list[int]) -> CheckpointError:
    """The error to raise for `exc` once every rank has been given back (or `problems` say which not)."""
    msg, hint = exc.msg, exc.hint
    back = "every rank is running again (its GPU state back in place, its gate open) and nothing was kept"
    if problems:
        back = ("every other rank is running again and nothing was kept; " + "; ".join(problems)
                + f" (see `gputrace shim status -p {','.join(map(str, pids))}`)")
    if "running again" in hint and not problems:
        return GangError(msg, hint)
    return GangError(msg, back + (f"; {hint}" if hint and "running again" not in hint else ""))


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint


def checkpoint_job(root: int, pids: list[int], out: str | os.PathLike | None = None, *, leave_running: bool = False,
                   timeout_s: float = DEFAULT_TIMEOUT_S, use_shim: bool | None = None,
                   progress: Progress | None = None, lanes: int = DEFAULT_LANES, chunk: int = DEFAULT_CHUNK,
                   direct: bool = True) -> FullJobReport:
    """The whole tree of `root`, whose ranks (the processes that use the GPU, each under the shim) are
    `pids` (job_tree gives both), into the new directory `out` (default full-job-ROOT-TIME under
    store.default_root())."""
    t_start = time.monotonic_ns()
    deadline = time.monotonic() + timeout_s
    procs = descendants(root)
    if not procs:
        raise NoSuchProcess(f"no process with pid {root}", "the job may have exited")
    for p in procs:
        require_running(p, "checkpoint")  # a stopped process answers nothing (its shim, its driver): fail now
    c = criu_mod.find()  # before the job is touched: no CRIU, no freeze
    out = Path(out).absolute() if out else store.default_out(root, prefix="full-job-")
    check_target(out)
    ranks: list[_Rank] = []
    for i, p in enumerate(pids):
        try:
            d = driver.Driver(p)
        except NoLibcuda as exc:
            raise CheckpointError(f"rank {i} (pid {p}) maps no libcuda: {exc.msg}", exc.hint) from None
        st = d.state()
        if st != "running":
            raise CheckpointError(f"rank {i} (pid {p}) is {st} in the driver, not running",
                                  "another checkpoint holds it; wait for it, or resume it")
        ranks.append(_Rank(i, p, d, comm(p)))
    for p in procs:
        _check_traces(p, c, "")
    fast = all(_shim_suspendable(r.pid) for r in ranks) if use_shim is None else use_shim
    # A guardian per process from the first step on (each gives its own back if this process dies),
    # started before the partial directory is made so that a kill between the two cannot leave it behind.
    guards = {p: Guardian(p, WHAT) for p in procs}
    for r in ranks:
        r.guard = guards[r.pid]
    part = store.PartialDir(out)
    try:
        tmp = part.create(IMAGES)
    except BaseException:
        for gd in guards.values():
            gd.done()
        raise
    guards[root].note(partial=str(tmp))
    images = tmp / IMAGES

    def note(**state: object) -> None:
        for gd in guards.values():
            gd.note(**state)

    stopped = False
    t0 = time.monotonic_ns()
    try:
        with Gang(pids, WHAT, timeout_s) as g:
            g.deadline = deadline  # one bound for the whole operation, from its start
            gang._statuses(g, True, "be checkpointed")
            # What each shim keeps between commands (the checkpoints' pinned pool, a suspension's image)
            # given back before anything stops: CRIU would dump it with the rank's memory (full.release_kept).
            g.each(lambda gr: g.request(gr, "release"))
            t0 = time.monotonic_ns()
            if fast:
                for r in ranks:
                    r.guard.note(shim=True)
                skipped = _suspend_all(g, ranks, tmp, f"lanes={lanes} chunk={chunk} direct={int(direct)}")
                if skipped:  # every rank given back by the gang: stopped again, for the driver alone
                    for r in ranks:
                        r.shim = {"skipped": skipped}
                    t0 = time.monotonic_ns()
                    g.quiesce()
            else:
                g.quiesce()
            quiesce_ns = time.monotonic_ns() - t0
            stop_point("full-job:quiesced")
            for r in ranks:
                r.guard.note(driver=True)
            lock_ms = g.left_ms()
            for r, ns in zip(ranks, _each(ranks, lambda r: r.d.call("Lock", lock_ms), deadline, timeout_s,
                                          "cuCheckpointProcessLock")):
                r.lock_ns = ns
            stop_point("full-job:locked")
            g.left_ms()
            for r, ns in zip(ranks, _each(ranks, lambda r: r.d.call("Checkpoint"), deadline, timeout_s,
                                          "cuCheckpointProcessCheckpoint")):
                r.checkpoint_ns = ns
            stop_point("full-job:checkpointed")
            g.release()  # calls held at a gate pass into the driver and wait at its lock
        # Every connection of ours to the job is closed now (CRIU would refuse a socket to outside the tree).
        traced = False
        for p in procs:
            traced |= _check_traces(p, c, "; every rank was given back as it was").uprobes_page is not None
        layouts = {p: _layout(p) for p in procs}
        left = deadline - time.monotonic()
        if left <= 0:
            raise GangError(f"the {WHAT} of the job's {len(ranks)} processes ran past its bound of {timeout_s:g} s "
                            "before CRIU ran", "")
        stopped = True  # from here on CRIU may have stopped the tree, even if the dump fails
        note(stopped=True)
        try:
            dump_ns = criu_mod.dump(c, root, images, leave_stopped=True, timeout_s=left,
                                    on_start=lambda criu_pid: note(criu=criu_pid, stopped=True))
        except criu_mod.CriuFailed as exc:
            raise criu_mod.kept_log(exc, images) from None
        freeze_ns = time.monotonic_ns() - t0
        stop_point("full-job:dumped")
        dumped = descendants(root)  # every process stopped: the tree CRIU dumped
        ti = time.monotonic_ns()
        checks = {p: _check_images(images, p, layouts[p]) if p in layouts else "skipped: not there before the dump"
                  for p in dumped}
        image_check = next((f"process {p}: {v}" for p, v in checks.items() if v != "clean"), "clean")
        image_check_ns = time.monotonic_ns() - ti
        tw = time.monotonic_ns()
        files = checksums(tmp, images, progress)
        rows = [{"rank": r.index, "pid": r.pid, "comm": r.comm, "cmdline": _cmdline(r.pid), "libcuda": r.d.path,
                 "driver_state": "checkpointed", "shim": r.shim, "lock_ns": r.lock_ns,
                 "checkpoint_ns": r.checkpoint_ns} for r in ranks]
        manifest = {
            "schema": store.FULL_JOB.schema, "format": store.FULL_JOB.format, "complete": True,
            "created_unix": time.time(), "host": socket.gethostname(),
            "root": {"pid": root, "comm": comm(root), "cmdline": _cmdline(root)},
            "processes": [{"pid": p, "comm": comm(p)} for p in dumped],
            "collectives": g.collectives, "aligned": g.aligned, "ranks": rows,
            "criu": {"path": c.path, "version": c.version_str, "allow_uprobes": traced, "image_check": image_check},
            "hash": HASH, "files": files, "leave_running": leave_running,
            "timings": {"quiesce_ns": quiesce_ns, "lock_ns": max(r.lock_ns for r in ranks),
                        "checkpoint_ns": max(r.checkpoint_ns for r in ranks), "dump_ns": dump_ns,
                        "freeze_ns": freeze_ns, "image_check_ns": image_check_ns},
        }
        write_ns = time.monotonic_ns() - tw
        manifest["timings"]["write_ns"] = write_ns
        manifest["timings"]["total_ns"] = time.monotonic_ns() - t_start
        part.write_file(MANIFEST, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
        part.commit()
    except BaseException as exc:
        # Before the directory goes: a suspended rank's shim reads its gpu-N.img back.
        problems = _give_back(ranks, descendants(root) or procs, stopped)
        part.discard()
        for gd in guards.values():
            gd.done()
        if isinstance(exc, OSError):
            exc = disk_error(exc, out)
        if isinstance(exc, GputraceError):
            raise _failed(exc, problems, pids) from None
        raise
    try:
        if leave_running:
            problems = _give_back(ranks, dumped, True)
            if problems:
                raise CheckpointError(f"the checkpoint {out} is complete, but not every rank could be given back: "
                                      + "; ".join(problems), f"see `gputrace shim status -p {','.join(map(str, pids))}`")
        else:
            for p in dumped:  # its state is safe on disk: the job ends here
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
    finally:
        for gd in guards.values():
            gd.done()
    criu_bytes = sum(f["bytes"] for f in files if f["path"].startswith(IMAGES + "/"))
    return FullJobReport(root, list(pids), dumped, str(out), g.collectives, g.aligned,
                         [{k: row[k] for k in ("rank", "pid", "comm", "shim", "lock_ns", "checkpoint_ns")} for row in rows],
                         sum(f["bytes"] for f in files), criu_bytes, len(files), quiesce_ns,
                         manifest["timings"]["lock_ns"], manifest["timings"]["checkpoint_ns"], dump_ns, freeze_ns,
                         image_check, image_check_ns, write_ns, time.monotonic_ns() - t_start, leave_running,
                         f"{c.path} {c.version_str}")


def _suspend_all(g: Gang, ranks: list[_Rank], tmp: Path, opts: str) -> str | None:
    """The shim's fast path on every rank: each suspend staged (its image file in the checkpoint
    directory, pinned) while the job runs, every rank stopped, each suspended, all kept.  Returns None,
    or why a shim refused (every rank then given back by the gang, the image files removed)."""
    fds = [os.open(tmp / f"gpu-{r.index}.img", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
           for r in ranks]
    try:
        g.stage(f"suspend {opts}", fds)
        g.quiesce()

        def off(gr) -> dict:
            rep = g.request(gr, f"suspend timeout={g.left_ms(gr)}")
            if rep.get("ok"):
                gr.suspended, gr.held = True, False  # the gate is the suspension's now
            elif rep.get("error") != "unsupported":
                g.expect(gr, rep, "suspend")
            return rep

        replies = g.each(off)
    finally:
        for fd in fds:
            os.close(fd)  # the shims hold their own descriptors of the files
    refused = [(r, rep) for r, rep in zip(ranks, replies) if not rep.get("ok")]
    if refused:
        r, rep = refused[0]
        g.release()  # those suspended unsuspended (from their files), every gate reopened
        for x in ranks:
            (tmp / f"gpu-{x.index}.img").unlink(missing_ok=True)
        return f"{r.who} cannot be suspended: {rep.get('detail', '')}"
    for gr, r, rep in zip(g.ranks, ranks, replies):
        k = gr.s.request("keep")
        if not k.get("ok"):
            raise GangError(f"{r.who} would not keep its suspension: {k.get('error')}", "")
        gr.suspended, r.suspended = False, True  # outlives the gang's connection: this module's to give back
        at = tmp / f"gpu-{r.index}.img"
        r.shim = {**{k: v for k, v in gang._rank_row(gr, rep).items() if k not in ("rank", "pid")},
                  "image_path": str(at), "file": at.name}
    return None


# ---------------------------------------------------------------------------------------------------------------
# Restore


def is_full_job(path: str | os.PathLike) -> bool:
    """Whether `path` holds a whole-job checkpoint (its manifest says so; nothing else is checked here)."""
    try:
        m = store.load_manifest(Path(path), "")
    except CheckpointError:
        return False
    return isinstance(m, dict) and m.get("format") == store.FULL_JOB.format


def _pids_free(m: dict, path: Path) -> None:
    """Every pid of the tree free on this host (waiting a little for the zombies of a job killed just now:
    whoever reaps them may take a moment), every thread id too; else a CheckpointError naming them."""
    pids = [int(p["pid"]) for p in m["processes"]]
    until = time.monotonic() + PIDS_FREE_S
    while True:
        taken = [p for p in pids if os.path.exists(f"/proc/{p}")]
        zombies = [p for p in taken if not alive(p)]
        if not taken or len(zombies) < len(taken) or time.monotonic() >= until:
            break
        time.sleep(0.02)
    if taken:
        p = taken[0]
        who = "a process that has exited, not yet reaped by its parent" if not alive(p) else comm(p)
        raise CheckpointError(f"cannot restore the job: pid {p} is in use on this host ({who})"
                              + (f", and {len(taken) - 1} more of its {len(pids)}" if len(taken) > 1 else ""),
                              "CRIU brings every process back at its old pid: end the processes that hold them (the "
                              "job itself, if it still runs), or restore in a new pid namespace (`unshare --pid --fork "
                              "--mount-proc`); nothing was restored")
    held = _taken_tids(path / IMAGES)
    if held:
        listed = ", ".join(f"{tid} (held by {who})" for tid, who in held[:4]) + \
            (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise CheckpointError(f"cannot restore the job: thread ids of the checkpointed job are in use on this host: "
                              f"{listed}", "CRIU brings every thread back at its old id: end those processes, or "
                                           "restore in a new pid namespace (`unshare --pid --fork --mount-proc`); "
                                           "nothing was restored")


def _link_images(path: Path, ranks: list[dict]) -> list[Path]:
    """Each rank's shim data file linked at the path its restored image opens it by (inside the partial
    directory it was written in, since renamed)."""
    made: list[Path] = []
    try:
        for r in ranks:
            shim = r.get("shim") or {}
            if not shim.get("image_path"):
                continue
            at = Path(shim["image_path"])
            if at.exists():
                raise CheckpointError(f"{at} exists: another restore of this checkpoint may be running",
                                      "wait for it, or remove that path if it is left over from a crash")
            at.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                os.link(path / shim["file"], at)
            except OSError:  # another filesystem: a symbolic link opens the same file
                os.symlink(path / shim["file"], at)
            made.append(at)
    except BaseException:
        for at in made:
            _unlink_gpu_image(at)
        raise
    return made


def _end(pids: list[int]) -> None:
    """The restored tree ended and reaped (as its subreaper), so that its pids are free for another try."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    for p in pids:
        _reap_leftover(p)


def restore_job(path: str | os.PathLike, *, gpu_map: list[tuple[str, str]] | None = None,
                progress: Progress | None = None) -> FullJobRestoreReport:
    path = Path(path).absolute()
    m = store.read_manifest(path, store.FULL_JOB)
    verify_ns, c = verified_for_restore(path, m, progress)
    root = int(m["root"]["pid"])
    procs = [int(p["pid"]) for p in m["processes"]]
    rows = m["ranks"]
    pids = [int(r["pid"]) for r in rows]
    # --gpu-map: the same pairs for every rank, each looked up with the driver that rank used; a GPU that
    # is not there is refused before CRIU runs.
    if gpu_map:
        by_lib = {lib: _resolve_pairs(lib, gpu_map) for lib in {r["libcuda"] for r in rows}}
        pairs = [by_lib[r["libcuda"]] for r in rows]
    else:
        pairs = None
    _pids_free(m, path)
    shim_held = [(r.get("shim") or {}).get("allocations") is not None for r in rows]
    rank_of = {p: i for i, p in enumerate(pids)}
    work = Path(tempfile.mkdtemp(prefix=f"gputrace-restore-{root}-"))  # CRIU's log and pidfile
    links: list[Path] = []
    guards: dict[int, Guardian] = {}
    t0 = time.monotonic_ns()
    try:
        links = _link_images(path, rows)
        # Once CRIU has made them, the ranks wait in the driver's checkpointed state for us (and every
        # process stopped): if this process dies first, each guardian finishes its process's way back.
        guards = {p: Guardian(p, "restore --full") for p in procs}

        def started(criu_pid: int) -> None:
            for p, gd in guards.items():
                i = rank_of.get(p)
                gd.note(criu=criu_pid, **({"driver": True, "shim": shim_held[i]} if i is not None else {}))

        # As a subreaper, this process inherits the restored tree when criu exits, so that it can end and
        # reap all of it if a rank's GPU side fails (the pids are then free at once for another try).
        _subreaper(True)
        t0 = time.monotonic_ns()
        try:
            criu_ns = criu_mod.restore(c, path / IMAGES, work, root, leave_stopped=True, on_start=started)
        except criu_mod.CriuFailed:
            for p in procs:
                _reap_leftover(p)
            work = None  # its message points at the log in `work`: that stays
            raise
        try:
            gpu_ns, shim_ns, ranks = _restore_ranks(path, pids, pairs, shim_held, procs)
        except BaseException as exc:
            # A tree back from CRIU without a rank's GPU state is of no use: all of it ended, so that the
            # checkpoint (untouched) can be restored again once the cause is fixed.
            _end(procs)
            if isinstance(exc, GputraceError):
                raise CheckpointError(f"{exc.msg}; the restored job was ended", exc.hint) from None
            raise
    finally:
        _subreaper(False)
        for gd in guards.values():
            gd.done()
        for at in links:
            _unlink_gpu_image(at)  # after resume no shim holds its file by that path any more
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return FullJobRestoreReport(root, pids, procs, str(path), ranks, verify_ns, criu_ns, gpu_ns, shim_ns,
                                time.monotonic_ns() - t0)


def _restore_gpus(ranks: list[_Rank], pairs: list | None, times: list[dict], again: str) -> None:
    """The driver's Restore (with the GPU pairs) and Unlock on every rank at once; CheckpointError naming
    the first rank that failed."""

    def back(r: _Rank) -> tuple[int, int]:
        st = r.d.state()
        if st != "checkpointed":
            raise CheckpointError(f"the restored process is {st} in the driver, not checkpointed",
                                  "the image was not taken by `gputrace checkpoint --full`")
        rs = _restore_gpu(r.d, pairs[r.index]) if pairs else r.d.call("Restore")
        return rs, r.d.call("Unlock")

    out, _ = _at_once(ranks, back, None)
    for r, x in zip(ranks, out):
        if isinstance(x, BaseException):
            if not isinstance(x, CheckpointError):
                raise x
            hint = x.hint
            if x.msg.startswith("cuCheckpointProcess"):
                # The driver's own hint speaks of a live job; this one is ended, its checkpoint intact.
                hint = ("the driver could not give the rank its GPU state back (the GPU it ran on gone, busy or "
                        f"of another driver? `--gpu-map OLD=NEW` restores onto other GPUs); {again}")
            raise CheckpointError(f"the GPU state of {r.who} could not be restored: {x.msg}", hint)
        times[r.index]["driver_restore_ns"], times[r.index]["unlock_ns"] = x


def _restore_ranks(path: Path, pids: list[int], pairs: list | None, shim_held: list[bool],
                   procs: list[int]) -> tuple[int, int, list[dict]]:
    """Each rank's GPU state back (all before any rank runs), then every process continued, then each
    rank's shim resumed: (gpu_ns, shim_ns, per-rank rows).  CheckpointError naming the rank that failed."""
    again = f"the checkpoint is untouched: `gputrace restore --full {path}` once the cause is fixed"
    ds = []
    for i, p in enumerate(pids):
        try:
            ds.append(_restored_driver(p, path))
        except CheckpointError as exc:
            raise CheckpointError(f"rank {i}: {exc.msg}", exc.hint) from None
    times: list[dict] = [{"rank": i, "pid": p} for i, p in enumerate(pids)]
    rank_list = [_Rank(i, d.pid, d, "") for i, d in enumerate(ds)]
    seized: dict[int, list[int]] = {}
    tg = time.monotonic_ns()
    with contextlib.ExitStack() as holds:
        try:
            # CRIU left every process stopped: until the driver has put a rank's device mappings back,
            # only its thread that serves the driver's calls runs (checkpointer/hold.py).
            for i, d in enumerate(ds):
                try:
                    seized[d.pid] = holds.enter_context(hold.held(d.pid, d.restore_tid()))
                except CheckpointError as exc:
                    raise CheckpointError(f"rank {i} (pid {d.pid}): {exc.msg}", exc.hint) from None
            _restore_gpus(rank_list, pairs, times, again)
        except BaseException:
            # Ended while still held: a rank whose GPU state is back must not run on (and write to its
            # files) when a peer's failed, or this checkpoint could not be restored again.
            for p, tids in seized.items():
                hold.end(p, tids)
            raise
    gpu_ns = time.monotonic_ns() - tg
    for p in procs:  # the ranks run since their holds ended; the rest were left stopped by CRIU
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGCONT)
    ts = time.monotonic_ns()
    wanted = [r for r in rank_list if shim_held[r.index]]
    out, _ = _at_once(wanted, lambda r: resume(r.pid).total_ns, None)
    for r, x in zip(wanted, out):
        if isinstance(x, BaseException):
            if not isinstance(x, GputraceError):
                raise x
            raise CheckpointError(f"the shim of {r.who} could not bring its device memory back: {x.msg}", x.hint)
        times[r.index]["shim_ns"] = x
    for t in times:
        t.setdefault("shim_ns", 0)
    return gpu_ns, (time.monotonic_ns() - ts) if wanted else 0, times


__all__ = ["DEFAULT_TIMEOUT_S", "FullJobReport", "FullJobRestoreReport", "checkpoint_job", "is_full_job", "job_tree",
           "restore_job"]
