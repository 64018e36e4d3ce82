"""The actions `top` offers on a shimmed process, behind a small protocol.

`CheckpointerAdapter` calls gputrace.checkpointer where it has what an action needs; an action it
lacks raises ActionUnavailable ("not available yet"), which the UI shows like any other failure.
`FakeCheckpointer` keeps checkpoints in memory, for tests and demos without a GPU or a shim.
Every method blocks: the UI calls them from a thread worker, never from its event loop.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from gputrace.errors import GputraceError, NotYetAvailable

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


ACTIONS = ("checkpoint", "restore", "suspend", "resume", "list_checkpoints")


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


class CheckpointerAdapter:
    """Calls gputrace.checkpointer's module-level functions of the same names, where it has them:
    checkpoint(pid, progress=...) / restore(pid, checkpoint_id, progress=...) / suspend / resume
    returning an ActionResult-like object or dict, and list_checkpoints(pid) -> Checkpoint-likes."""

    def __init__(self, module: str = "gputrace.checkpointer") -> None:
        try:
            self._mod = importlib.import_module(module)
        except ImportError:
            self._mod = None

    def _fn(self, action: str):
        fn = getattr(self._mod, action, None) if self._mod is not None else None
        return fn if callable(fn) else None

    def available(self, action: str) -> bool:
        return self._fn(action) is not None

    def _call(self, action: str, pid: int, progress: Progress, *args) -> ActionResult:
        fn = self._fn(action)
        if fn is None:
            raise ActionUnavailable(f"{action} is not available yet", "it arrives with the checkpointer (issue 5)")
        t0 = time.monotonic()
        try:
            out = fn(pid, *args, progress=progress)
        except GputraceError:
            raise
        except Exception as exc:  # a library still being written: show it, do not crash the UI
            raise GputraceError(f"{action} failed: {type(exc).__name__}: {exc}", "see `gputrace " + action + " --help`") from exc
        return _as_result(action, pid, out, time.monotonic() - t0)

    def checkpoint(self, pid: int, progress: Progress) -> ActionResult:
        return self._call("checkpoint", pid, progress)

    def restore(self, pid: int, checkpoint_id: str, progress: Progress) -> ActionResult:
        return self._call("restore", pid, progress, checkpoint_id)

    def suspend(self, pid: int, progress: Progress) -> ActionResult:
        return self._call("suspend", pid, progress)

    def resume(self, pid: int, progress: Progress) -> ActionResult:
        return self._call("resume", pid, progress)

    def list_checkpoints(self, pid: int) -> list[Checkpoint]:
        fn = self._fn("list_checkpoints")
        if fn is None:
            return []
        try:
            return [_as_checkpoint(c) for c in fn(pid)]
        except Exception:  # listing is decoration in the table; an error there must not hide the row
            return []


def _get(obj, name, default=None):
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def _as_checkpoint(c) -> Checkpoint:
    if isinstance(c, Checkpoint):
        return c
    return Checkpoint(str(_get(c, "id", None) or _get(c, "path", "?")), float(_get(c, "taken_at", 0.0) or 0.0),
                      _get(c, "size_bytes"), _get(c, "freeze_s"))


def _as_result(action: str, pid: int, out, elapsed_s: float) -> ActionResult:
    if isinstance(out, ActionResult):
        return out
    freeze = _get(out, "freeze_s") if out is not None else None
    msg = _get(out, "message") if out is not None else None
    ck = None
    if action == "checkpoint" and out is not None and (_get(out, "id") or _get(out, "path")):
        ck = _as_checkpoint(out)
    return ActionResult(action, pid, msg or f"{action} done in {elapsed_s:.2f} s", freeze, ck)
