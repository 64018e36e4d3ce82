"""The actions `top` offers on a shimmed process, behind a small protocol.

`CheckpointerAdapter` calls gputrace.checkpointer where it has what an action needs; an action it
lacks raises ActionUnavailable ("not available yet"), which the UI shows like any other failure.
`FakeCheckpointer` keeps checkpoints in memory, for tests and demos without a GPU or a shim.
Every method blocks: the UI calls them from a thread worker, never from its event loop.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from gputrace.checkpointer import uprobes
from gputrace.errors import GputraceError, NotYetAvailable
from gputrace.report import fmt_bytes

from .model import Checkpoint

Progress = Callable[[float, str], None]  # (fraction done 0..1, what is happening)


@dataclass(frozen=True)
class ActionResult:
    action: str
    pid: int
    message: str
    freeze_s: float | None = None
    checkpoint: Checkpoint | None = None


class ActionUnavailable(NotYetAvailable):
    pass


class Checkpointer(Protocol):
    def available(self, action: str) -> bool: ...
    def checkpoint(self, pid: int, progress: Progress) -> ActionResult: ...
    def restore(self, pid: int, checkpoint_id: str, progress: Progress) -> ActionResult: ...
    def suspend(self, pid: int, progress: Progress) -> ActionResult: ...
    def resume(self, pid: int, progress: Progress) -> ActionResult: ...
    def list_checkpoints(self, pid: int) -> list[Checkpoint]: ...
    def checkpoint_full(self, pid: int, progress: Progress) -> ActionResult:
        """The whole job (GPU and CPU state, CRIU), left running: `gputrace checkpoint --full --leave-running`."""
        ...


ACTIONS = ("checkpoint", "restore", "suspend", "resume", "list_checkpoints", "checkpoint_full")
LABELS = {"checkpoint_full": "whole-job checkpoint"}  # what the UI calls an action, where not its name


def label(action: str) -> str:
    return LABELS.get(action, action)


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
        self.full: list[int] = []  # pids whole-job checkpointed, in order
        self._ckpts: dict[int, list[Checkpoint]] = {}
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

    def restore(self, pid: int, checkpoint_id: str, progress: Progress) -> ActionResult:
        self._do("restore", pid, progress, checkpoint_id)
        return ActionResult("restore", pid, f"restored {checkpoint_id}", 0.02)

    def suspend(self, pid: int, progress: Progress) -> ActionResult:
        self._do("suspend", pid, progress)
        self.suspended.add(pid)
        return ActionResult("suspend", pid, "device memory released", 0.015)

    def resume(self, pid: int, progress: Progress) -> ActionResult:
        self._do("resume", pid, progress)
        self.suspended.discard(pid)
        return ActionResult("resume", pid, "device memory back", 0.01)

    def list_checkpoints(self, pid: int) -> list[Checkpoint]:
        with self._lock:
            return list(self._ckpts.get(pid, []))

    def checkpoint_full(self, pid: int, progress: Progress) -> ActionResult:
        # Not a Checkpoint of the table: `restore` rolls device memory back in a live process,
        # a whole-job checkpoint comes back through `gputrace restore --full DIR`.
        self._do("checkpoint_full", pid, progress)
        with self._lock:
            self.full.append(pid)
            where = f"/tmp/fake-full/{pid}/{len(self.full) - 1}"
        return ActionResult("checkpoint_full", pid, f"{where}; the job runs on", 0.034)


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

    def restore(self, pid, checkpoint_id, progress):
        self._no("restore")

    def suspend(self, pid, progress):
        self._no("suspend")

    def resume(self, pid, progress):
        self._no("resume")

    def list_checkpoints(self, pid):
        return []

    def checkpoint_full(self, pid, progress):
        self._no("whole-job checkpoint")


def default_checkpoint_dir() -> Path:
    """Where `top` puts checkpoints: $GPUTRACE_CKPT_DIR, else $XDG_DATA_HOME (or ~/.local/share)/gputrace/checkpoints.
    Not /tmp: that is often memory, and a checkpoint is the size of the job's device memory."""
    if os.environ.get("GPUTRACE_CKPT_DIR"):
        return Path(os.environ["GPUTRACE_CKPT_DIR"])
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "gputrace" / "checkpoints"


class CheckpointerAdapter:
    """Calls gputrace.checkpointer's functions where it has them: checkpoint(pid, out, progress=),
    restore(pid, path, progress=), suspend(pid, progress=), resume(pid, progress=), with progress
    called as (phase, done, total); list_checkpoints(pid) if it has one, else the complete checkpoints
    of that pid under `root` (directories named PID-TIME, as this adapter names them)."""

    def __init__(self, module: str = "gputrace.checkpointer", root: Path | None = None,
                 full_module: str = "gputrace.checkpointer.full") -> None:
        self.root = root or default_checkpoint_dir()
        # pid -> a context in which no probe of this top's is in the job (LiveSource.hold_tracing)
        self.hold_tracing: Callable[[int], contextlib.AbstractContextManager] = lambda pid: contextlib.nullcontext(True)
        self._full_module = full_module  # its checkpoint_full(pid, out, leave_running=, progress=)
        try:
            self._mod = importlib.import_module(module)
        except ImportError:
            self._mod = None

    def _fn(self, action: str):
        mod = self._mod
        if action == "checkpoint_full":
            try:
                mod = importlib.import_module(self._full_module)
            except ImportError:
                return None
        fn = getattr(mod, action, None) if mod is not None else None
        return fn if callable(fn) else None

    def available(self, action: str) -> bool:
        return self._fn(action) is not None

    def _call(self, action: str, pid: int, progress: Progress, *args) -> ActionResult:
        fn = self._fn(action)
        if fn is None:
            raise ActionUnavailable(f"{action} is not available yet", "it arrives with the checkpointer (issue 5)")

        kw = {"progress": _reporter(progress)} if _takes(fn, "progress") else {}
        t0 = time.monotonic()
        try:
            out = fn(pid, *args, **kw)
        except GputraceError:
            raise
        except Exception as exc:  # a library still being written: show it, do not crash the UI
            raise GputraceError(f"{action} failed: {type(exc).__name__}: {exc}", "see `gputrace " + action + " --help`") from exc
        return _as_result(action, pid, out, time.monotonic() - t0)

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
        out = self.root / f"{pid}-{time.strftime('%Y%m%dT%H%M%S')}"
        self._mkroot()
        return self._call("checkpoint", pid, progress, str(out))

    def checkpoint_full(self, pid: int, progress: Progress) -> ActionResult:
        """`gputrace checkpoint --full --leave-running` into full-PID-TIME under the root (not PID-TIME:
        `_scan` lists what `restore` can roll a live process back to, and this is not that)."""
        fn = self._fn("checkpoint_full")
        if fn is None:
            raise ActionUnavailable("whole-job checkpoint is not available", "gputrace.checkpointer.full is missing")
        out = self.root / f"full-{pid}-{time.strftime('%Y%m%dT%H%M%S')}"
        self._mkroot()
        t0 = time.monotonic()
        try:
            # top's own probes leave the libcuda file while CRIU copies the job: their breakpoints would
            # go with it and trap once it is restored. The checkpointer refuses any that remain (another
            # tracer's) before it freezes the job.
            progress(0.0, "pausing top's tracing of this libcuda")
            with self.hold_tracing(pid):
                uprobes.settle(pid)  # calls entered under a return probe come back out
                r = fn(pid, str(out), leave_running=True, progress=_reporter(progress))
        except GputraceError:
            raise
        except Exception as exc:  # whatever it is, the UI shows it
            raise GputraceError(f"whole-job checkpoint failed: {type(exc).__name__}: {exc}",
                                "see `gputrace checkpoint --full --help`") from exc
        return ActionResult("checkpoint_full", pid,
                            f"{fmt_bytes(r.image_bytes)} to {r.path} in {time.monotonic() - t0:.2f} s; the job runs on "
                            f"(back with `gputrace restore --full {r.path}`)", r.freeze_ns / 1e9)

    def restore(self, pid: int, checkpoint_id: str, progress: Progress) -> ActionResult:
        return self._call("restore", pid, progress, checkpoint_id)

    def suspend(self, pid: int, progress: Progress) -> ActionResult:
        return self._call("suspend", pid, progress)

    def resume(self, pid: int, progress: Progress) -> ActionResult:
        return self._call("resume", pid, progress)

    def list_checkpoints(self, pid: int) -> list[Checkpoint]:
        fn = self._fn("list_checkpoints")
        try:
            if fn is not None:
                return [_as_checkpoint(c) for c in fn(pid)]
            return self._scan(pid)
        except Exception:  # listing is decoration in the table; an error there must not hide the row
            return []

    def _scan(self, pid: int) -> list[Checkpoint]:
        import orjson

        out = []
        try:
            names = [n for n in os.listdir(self.root) if n.startswith(f"{pid}-")]
        except OSError:
            return []
        for n in names:
            try:
                m = orjson.loads((self.root / n / "manifest.json").read_bytes())
            except (OSError, orjson.JSONDecodeError):
                continue  # incomplete (no manifest yet) or not ours
            if not m.get("complete") or m.get("target", {}).get("pid") != pid:
                continue
            t = m.get("timings", {})
            freeze = t.get("freeze_ns")
            out.append(Checkpoint(str(self.root / n), float(m.get("created_unix", 0.0)), m.get("bytes"),
                                  freeze / 1e9 if freeze is not None else None))
        return out


def _reporter(progress: Progress) -> Callable:
    def report(*a) -> None:
        if len(a) == 3:  # the checkpointer's (phase, done, total)
            phase, done, total = a
            progress(done / total if total else 0.0, f"{phase} {fmt_bytes(done)} of {fmt_bytes(total)}")
        elif len(a) == 2:
            progress(float(a[0]), str(a[1]))

    return report


def _takes(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())




def _get(obj, name, default=None):
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def _as_checkpoint(c) -> Checkpoint:
    if isinstance(c, Checkpoint):
        return c
    return Checkpoint(str(_get(c, "id", None) or _get(c, "path", "?")), float(_get(c, "taken_at", 0.0) or 0.0),
                      _get(c, "size_bytes"), _get(c, "freeze_s"))


def _as_result(action: str, pid: int, out, elapsed_s: float) -> ActionResult:
    """From what the checkpointer returns (its CheckpointReport/RestoreReport: path, bytes,
    freeze_ns; or anything with freeze_s/message) to what the UI shows."""
    if isinstance(out, ActionResult):
        return out
    freeze = _get(out, "freeze_s") if out is not None else None
    if freeze is None and _get(out, "freeze_ns") is not None:
        freeze = _get(out, "freeze_ns") / 1e9
    nbytes = _get(out, "bytes") if out is not None else None
    msg = _get(out, "message") if out is not None else None
    if msg is None:
        where = _get(out, "path")
        msg = f"{fmt_bytes(nbytes) if nbytes is not None else '?'}" + (f" {'to' if action == 'checkpoint' else 'from'} {where}" if where else "") \
            + f" in {elapsed_s:.2f} s"
    ck = None
    if action == "checkpoint" and out is not None and (_get(out, "id") or _get(out, "path")):
        ck = Checkpoint(str(_get(out, "id") or _get(out, "path")), time.time(), nbytes if nbytes is not None else _get(out, "size_bytes"), freeze)
    return ActionResult(action, pid, msg, freeze, ck)
