"""The checkpoint actions on a host's processes, behind a small protocol, free of any UI.

`CheckpointerAdapter` calls gputrace.checkpointer's functions (given as `Operations`, the real ones
by default) and lists the checkpoints it wrote; `FakeCheckpointer` keeps checkpoints in memory, for
tests and demos without a GPU or a shim; `NoCheckpointer` refuses every action, for a replay.
Every method blocks: a UI calls them from a thread worker, never from its event loop.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from gputrace.base.errors import GputraceError, NotYetAvailable
from gputrace.base.progress import progress_line
from gputrace.base.units import fmt_bytes
from gputrace.checkpointer import uprobes

from .model import Checkpoint

Progress = Callable[[float, str], None]  # (fraction done 0..1, what is happening)


@dataclass(frozen=True)
class ActionResult:
    action: str
    pid: int
    message: str
    freeze_s: float | None = None   # how long the job was held (None: it was not, or not measured)
    checkpoint: Checkpoint | None = None
    back_s: float | None = None     # a restore's time back: from the running process ended to the job running


class ActionUnavailable(NotYetAvailable):
    pass


@dataclass(frozen=True)
class ShimState:
    """What a process's shim says of it, read before top asks anything: what cannot go right is refused
    first (resuming a job that is not suspended, checkpointing one whose memory is off the GPU, acting on
    one rank of a job whose peers top cannot see)."""

    suspended: bool
    collectives: int  # collectives (NCCL's) it has launched: more than 0, it is a rank of a job of several


class Checkpointer(Protocol):
    """The actions `top` offers. A restore brings the whole process back (`restore_full`); rolling
    back device memory alone (`rollback`) is a separate action, refused where it is unsafe."""

    def available(self, action: str) -> bool: ...
    def checkpoint_full(self, pid: int, progress: Progress) -> ActionResult:
        """The whole process (GPU and CPU state, CRIU), left running: `gputrace checkpoint --full --leave-running`."""
        ...
    def restore_full(self, pid: int, checkpoint_id: str, progress: Progress) -> ActionResult:
        """The running process replaced by a whole-process checkpoint of it: `gputrace restore -p PID DIR`."""
        ...
    def list_full_checkpoints(self, pid: int) -> list[Checkpoint]: ...
    def checkpoint(self, pid: int, progress: Progress) -> ActionResult:
        """Device memory only (the shim's fast path): what `rollback` takes."""
        ...
    def rollback(self, pid: int, checkpoint_id: str, progress: Progress) -> ActionResult:
        """Device memory alone rolled back, checked first: `gputrace restore --device-only` (never --force)."""
        ...
    def suspend(self, pid: int, progress: Progress) -> ActionResult: ...
    def resume(self, pid: int, progress: Progress) -> ActionResult: ...
    def suspend_job(self, pids: list[int], progress: Progress) -> ActionResult:
        """Every rank of a job suspended together, at the same collective: `gputrace suspend -p A,B`."""
        ...
    def resume_job(self, pids: list[int], progress: Progress) -> ActionResult:
        """Every suspended rank of a job back together: `gputrace resume -p A,B`."""
        ...
    def list_checkpoints(self, pid: int) -> list[Checkpoint]: ...
    def shim_state(self, pid: int) -> ShimState | None:
        """The shim's word on `pid` (None: no shim, or it did not answer at once); quick, called on a key."""
        ...


ACTIONS = ("checkpoint_full", "restore_full", "list_full_checkpoints", "checkpoint", "rollback", "suspend", "resume",
           "suspend_job", "resume_job", "list_checkpoints")
# The actions that pick one of the process's checkpoints, and the lister of the ones each takes.
PICKS = {"restore_full": "list_full_checkpoints", "rollback": "list_checkpoints"}
# The actions on every rank of a job at once (the pids given), and the action on one process each stands for.
JOB_ACTIONS = {"suspend": "suspend_job", "resume": "resume_job"}


class FakeCheckpointer:
    """In memory. `fail` maps an action to the error it raises; `gate` (an Event), when given, holds
    every action until set, so a test can look at the UI while an action is in progress."""

    def __init__(self, fail: dict[str, GputraceError] | None = None, gate: threading.Event | None = None,
                 size_bytes: int = 1 << 30) -> None:
        self.fail = dict(fail or {})
        self.gate = gate
        self.size_bytes = size_bytes
        self.calls: list[tuple[str, int, str]] = []
        self.suspended: set[int] = set()
        self.collectives: dict[int, int] = {}  # pid -> collectives its shim says it launched
        self.full: list[int] = []  # pids whole-job checkpointed, in order
        self._ckpts: dict[int, list[Checkpoint]] = {}
        self._full: dict[int, list[Checkpoint]] = {}
        self._lock = threading.Lock()

    def available(self, action: str) -> bool:
        return True

    def _do(self, action: str, pid: int, progress: Progress, arg: str = "") -> None:
        with self._lock:
            self.calls.append((action, pid, arg))
        progress(0.0, f"{action} started")
        if self.gate is not None:
            self.gate.wait()
        if action in self.fail:
            raise self.fail[action]
        progress(1.0, f"{action} done")

    def checkpoint(self, pid: int, progress: Progress) -> ActionResult:
        self._do("checkpoint", pid, progress)
        with self._lock:
            n = len(self._ckpts.setdefault(pid, []))
            ck = Checkpoint(f"/tmp/fake-ckpt/{pid}/{n}", time.time(), self.size_bytes, 0.012)
            self._ckpts[pid].append(ck)
        return ActionResult("checkpoint", pid, f"checkpoint {ck.id} written", ck.freeze_s, ck)

    def rollback(self, pid: int, checkpoint_id: str, progress: Progress) -> ActionResult:
        self._do("rollback", pid, progress, checkpoint_id)
        return ActionResult("rollback", pid, f"device memory rolled back to {checkpoint_id}", 0.02)

    def restore_full(self, pid: int, checkpoint_id: str, progress: Progress) -> ActionResult:
        self._do("restore_full", pid, progress, checkpoint_id)
        return ActionResult("restore_full", pid, f"back from {checkpoint_id}; it is running", None, back_s=1.5)

    def suspend(self, pid: int, progress: Progress) -> ActionResult:
        self._do("suspend", pid, progress)
        self.suspended.add(pid)
        return ActionResult("suspend", pid, "device memory released", 0.015)

    def resume(self, pid: int, progress: Progress) -> ActionResult:
        self._do("resume", pid, progress)
        self.suspended.discard(pid)
        return ActionResult("resume", pid, "device memory back", 0.01)

    def suspend_job(self, pids: list[int], progress: Progress) -> ActionResult:
        self._do("suspend_job", pids[0], progress, ",".join(map(str, pids)))
        self.suspended.update(pids)
        return ActionResult("suspend_job", pids[0], f"{len(pids)} ranks' device memory released", 0.02)

    def resume_job(self, pids: list[int], progress: Progress) -> ActionResult:
        self._do("resume_job", pids[0], progress, ",".join(map(str, pids)))
        self.suspended.difference_update(pids)
        return ActionResult("resume_job", pids[0], f"{len(pids)} ranks' device memory back", 0.01)

    def shim_state(self, pid: int) -> ShimState | None:
        return ShimState(pid in self.suspended, self.collectives.get(pid, 0))

    def list_checkpoints(self, pid: int) -> list[Checkpoint]:
        with self._lock:
            return list(self._ckpts.get(pid, []))

    def checkpoint_full(self, pid: int, progress: Progress) -> ActionResult:
        self._do("checkpoint_full", pid, progress)
        with self._lock:
            self.full.append(pid)
            ck = Checkpoint(f"/tmp/fake-full/{pid}/{len(self.full) - 1}", time.time(), self.size_bytes, 0.034)
            self._full.setdefault(pid, []).append(ck)
        return ActionResult("checkpoint_full", pid, f"{ck.id}; the job runs on", ck.freeze_s, ck)

    def list_full_checkpoints(self, pid: int) -> list[Checkpoint]:
        with self._lock:
            return list(self._full.get(pid, []))


class NoCheckpointer:
    """For a replay: the processes shown are not live."""

    def __init__(self, why: str = "a replay shows recorded processes; actions need live ones") -> None:
        self.why = why

    def available(self, action: str) -> bool:
        return False

    def _no(self, action: str):
        raise ActionUnavailable(f"{action} is not possible here: {self.why}", "run `gputrace top` on the live host")

    def checkpoint(self, pid, progress):
        self._no("checkpoint")

    def rollback(self, pid, checkpoint_id, progress):
        self._no("device-only rollback")

    def restore_full(self, pid, checkpoint_id, progress):
        self._no("restore")

    def list_full_checkpoints(self, pid):
        return []

    def suspend(self, pid, progress):
        self._no("suspend")

    def resume(self, pid, progress):
        self._no("resume")

    def suspend_job(self, pids, progress):
        self._no("suspend")

    def resume_job(self, pids, progress):
        self._no("resume")

    def shim_state(self, pid):
        return None

    def list_checkpoints(self, pid):
        return []

    def checkpoint_full(self, pid, progress):
        self._no("checkpoint")


def default_checkpoint_dir() -> Path:
    """Where `top` puts checkpoints: the CLI's default too (gputrace.checkpointer.store.default_root)."""
    from gputrace.checkpointer.store import default_root

    return default_root()


@dataclass(frozen=True)
class Operations:
    """The checkpointer's functions the adapter calls, as gputrace.checkpointer defines them; None
    where this host does not offer the action."""

    checkpoint: Callable | None = None       # (pid, out, *, progress=) -> CheckpointReport
    restore: Callable | None = None          # (pid, path, *, progress=) -> RestoreReport
    suspend: Callable | None = None          # (pid, *, progress=) -> SuspendReport
    resume: Callable | None = None           # (pid) -> ResumeReport
    checkpoint_full: Callable | None = None  # (pid, out, *, leave_running=, progress=) -> FullCheckpointReport
    restore_full: Callable | None = None     # (pid, path, *, progress=) -> ReplaceReport
    suspend_job: Callable | None = None      # (pids) -> JobReport (checkpointer/gang.py)
    resume_job: Callable | None = None       # (pids) -> JobReport


def checkpointer_operations() -> Operations:
    from gputrace import checkpointer
    from gputrace.checkpointer import gang
    from gputrace.checkpointer.full import checkpoint_full
    from gputrace.checkpointer.replace import replace_full

    return Operations(checkpointer.checkpoint, checkpointer.restore, checkpointer.suspend, checkpointer.resume,
                      checkpoint_full, replace_full, gang.suspend, gang.resume)


class CheckpointerAdapter:
    """gputrace.checkpointer for `top`: checkpoints go to PID-TIME under `root` (whole-job ones to
    full-PID-TIME), and `list_checkpoints` lists the complete ones of a pid found there."""

    def __init__(self, root: Path | None = None, ops: Operations | None = None) -> None:
        self.root = root or default_checkpoint_dir()
        self.ops = ops or checkpointer_operations()
        # pid -> a context in which no probe of this top's is in the job (LiveSource.hold_tracing)
        self.hold_tracing: Callable[[int], contextlib.AbstractContextManager] = lambda pid: contextlib.nullcontext(True)
        self._manifests: dict[tuple[str, int, int], Checkpoint | None] = {}  # (dir, inode, mtime) -> its entry

    # The checkpointer's function behind each action (a device-only rollback is ops.restore, checked).
    _OP = {"rollback": "restore"}
    _CLI = {"checkpoint_full": "checkpoint --full --leave-running", "restore_full": "restore",
            "rollback": "restore --device-only", "suspend_job": "suspend", "resume_job": "resume"}
    STATE_TIMEOUT_S = 0.5  # a shim answers its status at once; one that does not (its job stopped) is not waited for

    def available(self, action: str) -> bool:
        return action in PICKS.values() or (action in ACTIONS and getattr(self.ops, self._OP.get(action, action)) is not None)

    def _run(self, action: str, pid: int, call: Callable[[Callable], object]) -> tuple[object, float]:
        """`call(fn)` with the checkpointer's function for `action`; its report and the seconds it took.
        A failure that is not a GputraceError (a bug) reaches the UI as an error, not a crash."""
        fn = getattr(self.ops, self._OP.get(action, action))
        cli = self._CLI.get(action, action)
        if fn is None:
            raise ActionUnavailable(f"{label(action)} is not available here",
                                    f"run `gputrace {cli} -p PID` from a shell")
        t0 = time.monotonic()
        try:
            out = call(fn)
        except GputraceError:
            raise
        except Exception as exc:  # whatever it is, the UI shows it
            raise GputraceError(f"{label(action)} failed: {type(exc).__name__}: {exc}",
                                f"see `gputrace {cli.split()[0]} --help`") from exc
        return out, time.monotonic() - t0

    def _mkroot(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise GputraceError(f"cannot create {self.root}: {exc.strerror}",
                                "set GPUTRACE_CKPT_DIR or --checkpoint-dir to a writable directory") from None

    def destination(self, action: str, pid: int) -> str | None:
        """Where `action` on `pid` writes, for the confirmation to show (None: it writes nothing)."""
        if action == "checkpoint":
            return f"{self.root}/{pid}-TIME"
        if action == "checkpoint_full":
            return f"{self.root}/full-{pid}-TIME"
        return None

    def checkpoint(self, pid: int, progress: Progress) -> ActionResult:
        from gputrace.checkpointer.store import fresh_dir

        self._mkroot()
        out = fresh_dir(self.root, str(pid))
        r, took = self._run("checkpoint", pid, lambda fn: fn(pid, str(out), progress=_reporter(progress)))
        freeze = r.freeze_ns / 1e9
        return ActionResult("checkpoint", pid, f"{fmt_bytes(r.bytes)} to {r.path} in {took:.2f} s", freeze,
                            Checkpoint(str(r.path), time.time(), r.bytes, freeze))

    def checkpoint_full(self, pid: int, progress: Progress) -> ActionResult:
        """`gputrace checkpoint --full --leave-running` into full-PID-TIME under the root (not PID-TIME:
        `list_checkpoints` lists what `restore` can roll a live process back to, and this is not that)."""
        from gputrace.checkpointer.store import fresh_dir

        out = fresh_dir(self.root, f"full-{pid}")

        def call(fn):
            # top's own probes leave the libcuda file while CRIU copies the job: their breakpoints would
            # go with it and trap once it is restored. The checkpointer refuses any that remain (another
            # tracer's) before it freezes the job.
            progress(0.0, "pausing top's tracing of this libcuda")
            with self.hold_tracing(pid):
                uprobes.settle(pid)  # calls entered under a return probe come back out
                return fn(pid, str(out), leave_running=True, progress=_reporter(progress))

        if self.ops.checkpoint_full is not None:
            self._mkroot()
        r, took = self._run("checkpoint_full", pid, call)
        # What the job felt: stopped until its GPU state was given back (the dump's freeze and the way back).
        held = getattr(r, "held_ns", None)
        freeze = (held if held is not None else r.freeze_ns) / 1e9
        return ActionResult("checkpoint_full", pid,
                            f"{fmt_bytes(r.image_bytes)} to {r.path} in {took:.2f} s; the job runs on "
                            f"(r brings it back to this point)", freeze,
                            Checkpoint(str(r.path), time.time(), r.image_bytes, freeze))

    def restore_full(self, pid: int, checkpoint_id: str, progress: Progress) -> ActionResult:
        """`gputrace restore -p PID DIR` of a whole-process checkpoint: the running process replaced."""
        r, _ = self._run("restore_full", pid, lambda fn: fn(pid, checkpoint_id, progress=_reporter(progress)))
        cut = "".join(f"; {c['path']} cut back to then (kept whole as {c['kept']})" for c in r.cut)
        return ActionResult("restore_full", pid, f"back from {r.path}, running again (criu {r.criu_ns / 1e9:.2f} s, "
                            f"GPU {(r.driver_restore_ns + r.unlock_ns + r.shim_ns) / 1e9:.2f} s){cut}",
                            None, back_s=r.back_ns / 1e9)

    def rollback(self, pid: int, checkpoint_id: str, progress: Progress) -> ActionResult:
        """Device memory alone, with every check of checkpointer/rollback.py (top never forces it)."""
        r, took = self._run("rollback", pid,
                            lambda fn: fn(pid, checkpoint_id, progress=_reporter(progress), checked=True))
        copied = f" ({fmt_bytes(r.bytes_copied)} differed and was copied back)" if r.chunks else ""
        return ActionResult("rollback", pid, f"{fmt_bytes(r.bytes)} from {r.path}{copied} in {took:.2f} s; host state "
                            "went on", r.freeze_ns / 1e9)

    def suspend(self, pid: int, progress: Progress) -> ActionResult:
        r, took = self._run("suspend", pid, lambda fn: fn(pid, progress=_reporter(progress)))
        return ActionResult("suspend", pid, f"{fmt_bytes(r.reserved_bytes)} of GPU memory freed in {took:.2f} s",
                            r.freeze_ns / 1e9)

    def resume(self, pid: int, progress: Progress) -> ActionResult:
        r, took = self._run("resume", pid, lambda fn: fn(pid))
        return ActionResult("resume", pid, f"{fmt_bytes(r.bytes)} back on the GPU in {took:.2f} s")

    def suspend_job(self, pids: list[int], progress: Progress) -> ActionResult:
        """`gputrace suspend -p A,B`: every rank's gate closed, the ranks behind run on to the same collective,
        all suspended, or none (checkpointer/gang.py)."""
        progress(0.0, f"stopping {len(pids)} ranks at the same collective")
        r, took = self._run("suspend_job", pids[0], lambda fn: fn(list(pids)))
        freed = sum(int(x.get("reserved_bytes", 0)) for x in r.ranks)
        return ActionResult("suspend_job", pids[0], f"every rank ({', '.join(map(str, pids))}) suspended together: "
                            f"{fmt_bytes(freed)} of GPU memory freed in {took:.2f} s", r.freeze_ns / 1e9)

    def resume_job(self, pids: list[int], progress: Progress) -> ActionResult:
        progress(0.0, f"bringing {len(pids)} ranks back")
        r, took = self._run("resume_job", pids[0], lambda fn: fn(list(pids)))
        back = sum(int(x.get("bytes", 0)) for x in r.ranks)
        return ActionResult("resume_job", pids[0], f"every suspended rank ({', '.join(map(str, pids))}) running again: "
                            f"{fmt_bytes(back)} back on the GPU in {took:.2f} s")

    def shim_state(self, pid: int) -> ShimState | None:
        from gputrace.shim import client

        try:
            with client.Connection(pid, timeout_s=self.STATE_TIMEOUT_S) as c:
                st = c.status()
        except (GputraceError, OSError):
            return None
        if not isinstance(st, dict) or "suspended" not in st:
            return None
        return ShimState(bool(st.get("suspended")), int(st.get("collectives") or 0))

    def list_checkpoints(self, pid: int) -> list[Checkpoint]:
        """The complete GPU-memory checkpoints of `pid` under the root (PID-TIME)."""
        return self._list(pid, f"{pid}-", device=True)

    def list_full_checkpoints(self, pid: int) -> list[Checkpoint]:
        """The complete whole-process checkpoints of `pid` under the root (full-PID-TIME)."""
        return self._list(pid, f"full-{pid}-", device=False)

    def _list(self, pid: int, prefix: str, device: bool) -> list[Checkpoint]:
        """The complete checkpoints of `pid` under the root whose names start with `prefix`, read with the
        checkpointer's own manifest reader once per directory (a checkpoint directory never changes once
        it is there)."""
        from gputrace.checkpointer import store

        try:
            entries = [e for e in os.scandir(self.root) if e.name.startswith(prefix) and e.is_dir()]
        except OSError:
            return []
        out = []
        for e in entries:
            try:
                st = e.stat()
            except OSError:
                continue
            key = (e.path, st.st_ino, st.st_mtime_ns)
            if key not in self._manifests:
                try:
                    m = store.read_manifest(Path(e.path), store.DEVICE if device else store.FULL)
                except GputraceError:  # incomplete (no manifest yet), damaged, or not ours
                    m = None
                ok = m is not None and m["target"]["pid"] == pid
                timings = m.get("timings") if ok else None
                freeze = timings.get("freeze_ns") if isinstance(timings, dict) else None
                size = None if not ok else m["bytes"] if device else sum(f["bytes"] for f in m["files"])
                self._manifests[key] = Checkpoint(e.path, float(m.get("created_unix", 0.0)), size,
                                                  freeze / 1e9 if isinstance(freeze, int) else None) if ok else None
            if self._manifests[key] is not None:
                out.append(self._manifests[key])
        listed = {e.path for e in entries}
        for key in [k for k in self._manifests if k[0].startswith(f"{self.root}/{prefix}") and k[0] not in listed]:
            del self._manifests[key]  # a directory removed (or replaced) since: its entry goes too
        return sorted(out, key=lambda c: c.taken_at)


def label(action: str) -> str:
    """What the UI and its messages call an action, where not its name."""
    return {"checkpoint_full": "checkpoint", "restore_full": "restore", "checkpoint": "device-memory checkpoint",
            "rollback": "device-only rollback", "suspend_job": "suspend of the job",
            "resume_job": "resume of the job"}.get(action, action)


def _reporter(progress: Progress, clock: Callable[[], float] = time.monotonic) -> Callable[[str, int, int], None]:
    """The checkpointer's progress(phase, done, total) as the UI's (fraction, text): the CLI's line,
    a bar with the bytes, the rate and the time left of the phase."""
    started: dict[str, float] = {}

    def report(phase: str, done: int, total: int) -> None:
        t0 = started.setdefault(phase, clock())
        progress(done / total if total else 0.0, progress_line(phase, done, total, clock() - t0))

    return report
