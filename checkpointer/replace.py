"""A running job brought back to a whole-process checkpoint of it: the process that runs now is
ended and the checkpoint's (GPU and CPU state, by CRIU and the driver) runs in its place, at the same
pid, from the checkpoint's moment on. What `gputrace restore -p PID DIR` and top's `r` do.

Unlike a rollback of device memory alone (ops.restore), nothing of the process's later state is
left to disagree with its device memory: host tensors, the allocator's bookkeeping, the step
counter all come back with it. The price is the time back (CRIU's restore and the driver's, seconds
for GiBs, the GPU side measured in bench/results/) and that the running process is ended first,
since CRIU brings a process back only at its own pid.

So everything that can be checked is checked while the job still runs, and any doubt refuses with
the job untouched (`replace_full`):
  1. the checkpoint is of this process (pid, command line, $GPUTRACE_JOB and boot), which is no rank of
     a job of several processes (`rank_of_a_job`), complete, every file matching its checksum, and a
     CRIU that can restore it is here;
  2. no other process holds one of its thread ids;
  3. the files it had open are as CRIU will demand: CRIU restores a process only with each open file
     of the size it had (a file open for appending excepted). A file the job writes (opened
     write-only) that grew since is the job's own later output, a log: it is cut back to its size
     then once the job has ended, and kept whole beside it as FILE.after-TIME first. Any other
     change (a file it reads, or one open for reading and writing, changed or gone) refuses;
  4. only then is the running process ended (SIGKILL through a pidfd, so no other process that
     takes the pid meanwhile is hit) and, once its parent has reaped it and the pid is free, the
     checkpoint restored (full.restore_full). A restore that fails after that point says so and
     that the checkpoint is intact, to be restored with `gputrace restore --full DIR`.

A job whose parent does not reap it keeps its pid taken (a zombie): step 4 then waits up to
`free_timeout_s` and fails with the parent named. A job that has ended already is simply restored.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import stat
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gputrace.base.errors import CheckpointError, CheckpointMismatch, GputraceError, NoSuchProcess
from gputrace.base.procs import boot_id, comm, descendants, environ, stat_fields

from . import full, hold, store
from .store import Progress

O_ACCMODE, O_WRONLY, O_APPEND = 0o3, 0o1, 0o2000


@dataclass(frozen=True)
class ReplaceReport:
    pid: int
    path: str
    verify_ns: int          # the checkpoint's files checked, the job still running
    end_ns: int             # the running process ended and its pid free
    criu_ns: int
    driver_restore_ns: int
    unlock_ns: int
    shim_ns: int
    back_ns: int            # the time back: from ending the running process to the checkpoint's running
    cut: tuple[dict, ...]   # files cut back to their size at the checkpoint: {path, bytes_then, bytes_now, kept}

    def to_dict(self) -> dict:
        return {"kind": "replace", **asdict(self), "cut": list(self.cut)}


def _cmdline(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def identity_differences(m: dict, pid: int) -> list[str]:
    """How the process at `pid` differs from the one the whole-process checkpoint was taken of. Its
    start time is not compared: a process restored by CRIU starts anew, and is still the job."""
    t = m["target"]
    out = []
    if t["pid"] != pid:
        out.append(f"it was taken of process {t['pid']}, not {pid}")
        return out
    if t.get("boot_id") and t["boot_id"] != boot_id():
        out.append("it was taken before this host last booted")
    if isinstance(t.get("cmdline"), list) and t["cmdline"] and t["cmdline"] != _cmdline(pid):
        out.append(f"it was taken of `{' '.join(map(str, t['cmdline']))[:80]}`, process {pid} runs "
                   f"`{' '.join(_cmdline(pid))[:80]}`")
    job = t.get("job")
    if isinstance(job, str) and job and environ(pid).get("GPUTRACE_JOB") not in (None, job):
        out.append("it was taken of another job ($GPUTRACE_JOB differs)")
    return out


WORLD = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def rank_of_a_job(pid: int) -> str | None:
    """Why process `pid` is one rank of a job of several processes (None: nothing says so): its
    launcher's world size in its environment, or other processes of its `$GPUTRACE_JOB` that map a
    libcuda, not counting its own descendants (CRIU takes and brings back its tree with it). Brought back alone, such a rank would be out of step with its peers (or hold them in a
    collective): a job comes back whole (`restore --full` of a `checkpoint --full --tree`)."""
    env = environ(pid)
    for name in WORLD:
        try:
            if int(env.get(name, "1")) > 1:
                return f"its {name} is {env[name]}"
        except ValueError:
            continue
    job = env.get("GPUTRACE_JOB")
    if not job:
        return None
    peers = []
    own = set(descendants(pid))  # its own children (data loader workers) come and go with it in CRIU's tree
    for e in os.scandir("/proc"):
        if not e.name.isdigit() or int(e.name) in own:
            continue
        other = int(e.name)
        if environ(other).get("GPUTRACE_JOB") != job:
            continue
        try:
            if "libcuda" in Path(f"/proc/{other}/maps").read_text():
                peers.append(other)
        except OSError:
            continue
    return f"processes {', '.join(map(str, sorted(peers)[:4]))} of its job use the GPU too" if peers else None


def files_to_cut(m: dict, skip: set[str]) -> list[dict]:
    """The open files of the checkpoint that a restore must cut back (grown logs); CheckpointError for
    any change CRIU would refuse that is not that."""
    cut, bad, seen = [], [], set(skip)
    for f in m["target"].get("open_files") or []:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) or type(f.get("bytes")) is not int \
                or type(f.get("flags")) is not int or f["path"] in seen:
            continue
        seen.add(f["path"])  # one file open twice (stdout and stderr on one log) is checked and cut once
        if f["flags"] & O_ACCMODE == O_WRONLY and f["flags"] & O_APPEND:
            continue  # CRIU does not hold a file open for appending to its size
        try:
            st = os.stat(f["path"])
        except OSError:
            bad.append(f"{f['path']} is gone")
            continue
        if not stat.S_ISREG(st.st_mode):
            bad.append(f"{f['path']} is no longer a plain file")
        elif st.st_size != f["bytes"]:
            if f["flags"] & O_ACCMODE == O_WRONLY and st.st_size > f["bytes"]:
                cut.append({"path": f["path"], "bytes_then": f["bytes"], "bytes_now": st.st_size})
            else:
                bad.append(f"{f['path']} {'grew' if st.st_size > f['bytes'] else 'shrank'} from {f['bytes']} to "
                           f"{st.st_size} bytes")
    if bad:
        raise CheckpointError("the job's open files changed since the checkpoint, and CRIU restores a process only with "
                              "its files as they were: " + "; ".join(bad[:4]),
                              "put them back as they were then; the running job was not touched")
    return cut


def _cut_back(cut: list[dict]) -> tuple[dict, ...]:
    """Each grown file kept whole as FILE.after-TIME, then cut back to its size at the checkpoint."""
    out = []
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for f in cut:
        kept = f"{f['path']}.after-{stamp}"
        n = 1
        while os.path.exists(kept):
            kept, n = f"{f['path']}.after-{stamp}-{n}", n + 1
        shutil.copyfile(f["path"], kept)
        os.truncate(f["path"], f["bytes_then"])
        out.append({**f, "kept": kept})
    return tuple(out)


def _parent(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[1]) if fields and len(fields) > 1 else None


def _end(pidfd: int, pid: int, free_timeout_s: float) -> None:
    """The process behind `pidfd` killed, and its pid free (reaped by its parent: by this process, where
    it is ours, as a job top restored is)."""
    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    ready, _, _ = select.select([pidfd], [], [], free_timeout_s)
    if not ready:
        raise CheckpointError(f"process {pid} did not end within {free_timeout_s:.0f} s of SIGKILL (stuck in the "
                              "kernel?)", "nothing was restored; try again once it has ended")
    parent = _parent(pid)
    if parent == os.getpid():
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    deadline = time.monotonic() + free_timeout_s
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            who = f"{comm(parent)} (pid {parent})" if parent else "its parent"
            raise CheckpointError(f"process {pid} was ended, but {who} has not reaped it: its pid stays taken and "
                                  "CRIU can bring the checkpoint back only at that pid",
                                  "once the parent has reaped it (or has ended), `gputrace restore --full DIR` "
                                  "brings the job back; the checkpoint is intact")
        time.sleep(0.01)


def _reap_when_it_ends(pid: int) -> None:
    """A restored job is this process's child (its subreaper's, see full.restore_full): reaped when it
    ends, so that no zombie keeps its pid while this process (top) runs on."""
    if _parent(pid) != os.getpid():
        return

    def wait() -> None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    threading.Thread(target=wait, name=f"reap-{pid}", daemon=True).start()


def replace_full(pid: int, path: str | os.PathLike, *, progress: Progress | None = None,
                 free_timeout_s: float = 10.0) -> ReplaceReport:
    """Replaces running process `pid` by its whole-process checkpoint in `path` (see the module's
    docstring); refuses, with the job untouched, wherever the restore could not succeed."""
    path = Path(path).absolute()
    m = store.read_manifest(path, store.FULL)
    try:
        pidfd = os.pidfd_open(pid)  # the process checked below is the one ended
    except ProcessLookupError:
        if m["target"]["pid"] != pid:
            raise NoSuchProcess(f"no process with pid {pid}, and {path} was taken of process {m['target']['pid']}",
                                f"`gputrace restore --full {path}` brings that one back") from None
        # The job has ended already: nothing to replace; its log cut back as below, then the checkpoint comes
        # back as `restore --full` brings it.
        verify_ns, _ = full.verified_for_restore(path, m, progress)
        image_at = (m["gpu"].get("shim") or {}).get("image_path")
        cut_done = _cut_back(files_to_cut(m, {image_at} if image_at else set()))
        t0 = time.monotonic_ns()
        r = full.restore_full(path, progress=progress)
        _reap_when_it_ends(pid)
        return ReplaceReport(pid, str(path), verify_ns, 0, r.criu_ns, r.driver_restore_ns, r.unlock_ns, r.shim_ns,
                             time.monotonic_ns() - t0, cut_done)
    try:
        who = identity_differences(m, pid)
        if who:
            raise CheckpointMismatch(f"{path} is not a checkpoint of the job running as process {pid}: {'; '.join(who)}",
                                     "give a whole-process checkpoint of this job (`gputrace checkpoint --full "
                                     f"--leave-running -p {pid}`); the running job was not touched")
        rank = rank_of_a_job(pid)
        if rank:
            raise CheckpointError(f"process {pid} is one rank of a job of several processes ({rank}): brought back "
                                  "alone it would be out of step with the others, or hold them in a collective",
                                  "checkpoint and restore the job whole: `gputrace checkpoint --full --tree LAUNCHER "
                                  "-o DIR`, then, once the job has ended, `gputrace restore --full DIR`; the running "
                                  "job was not touched")
        verify_ns, _ = full.verified_for_restore(path, m, progress)
        mine = set(hold.threads(pid))
        taken = [(tid, by) for tid, by in full._taken_tids(path / full.IMAGES) if tid not in mine]
        if taken:
            listed = ", ".join(f"{tid} (held by {by})" for tid, by in taken[:4])
            raise CheckpointError(f"thread ids of the checkpointed job are in use by other processes: {listed}",
                                  "CRIU brings every thread back at its old id: end those processes first; the running "
                                  "job was not touched")
        image_at = (m["gpu"].get("shim") or {}).get("image_path")
        if image_at and os.path.exists(image_at):
            raise CheckpointError(f"{image_at} exists: another restore of this checkpoint may be running",
                                  "wait for it, or remove that path if it is left over from a crash; the running job "
                                  "was not touched")
        cut = files_to_cut(m, {image_at} if image_at else set())
        t0 = time.monotonic_ns()
        _end(pidfd, pid, free_timeout_s)
    finally:
        os.close(pidfd)
    end_ns = time.monotonic_ns() - t0
    cut_done = _cut_back(cut)
    try:
        r = full.restore_full(path, progress=progress)
    except GputraceError as exc:
        cut_note = "".join(f"; {c['path']} was cut back to {c['bytes_then']} bytes, kept whole as {c['kept']}"
                           for c in cut_done)
        raise CheckpointError(f"the running process {pid} was ended, and bringing the checkpoint back failed: "
                              f"{exc.msg}{cut_note}",
                              f"{exc.hint}; the checkpoint is intact: `gputrace restore --full {path}` once the cause "
                              "is fixed") from None
    back_ns = time.monotonic_ns() - t0
    _reap_when_it_ends(pid)
    return ReplaceReport(pid, str(path), verify_ns, end_ns, r.criu_ns, r.driver_restore_ns, r.unlock_ns, r.shim_ns,
                         back_ns, cut_done)
