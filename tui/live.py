"""The live source: every process on the host that maps a libcuda, traced, one frame per refresh.

Discovery rescans /proc each refresh (tracer.targets.cuda_processes, which reaches into containers
through /proc/PID/root), so processes started later appear. Each process gets a tracer Session in a
thread of its own, with the session's own sampling policy, so each stays within the same budget as
`gputrace attach`. The probe-cost calibration is measured once and shared; each Session still
compiles its own BPF program, because a program's counting state (open, closed, generation) is one
global for all the links on it, and sessions whose windows are not aligned would close each other's.
Sharing one program per libcuda file needs windows aligned across processes: the next step.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from typing import Callable, Iterator

from gputrace.errors import GputraceError
from gputrace.tracer.calibrate import Calibration
from gputrace.tracer.model import ProcessSnapshot
from gputrace.tracer.session import Options, Session, open_program
from gputrace.tracer.targets import LibcudaFile, cuda_processes

from .actions import Checkpointer
from .gpus import read_gpus
from .model import HostSnapshot, ProcessRow

_COMPILE = threading.Lock()  # one bcc compile at a time: LLVM in several threads at once is not worth the risk


class _Pool:
    """Compiled programs of sessions that ended, for the next process: on a host where short jobs
    come and go, compiling one (seconds of CPU) per process would be most of top's cost."""

    def __init__(self) -> None:
        self._free: list = []
        self._lock = threading.Lock()
        self.compiled = 0

    def take(self, mode: str):
        from gputrace.tracer.bpfprog import Program

        with self._lock:
            if self._free:
                return self._free.pop()
        with _COMPILE:
            self.compiled += 1
            return Program(mode)

    def give(self, prog, pid: int | None = None) -> None:
        if pid is not None:  # its counts stay in the map otherwise, and a reused pid would start from them
            prog.forget([k for k in prog.read_stats() if k[0] == pid])
        with self._lock:
            self._free.append(prog)

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for prog in free:
            prog.close()


class _Traced:
    """One process's Session, stepped in its own thread until the process exits or the source closes."""

    def __init__(self, pid: int, lib: LibcudaFile, options: Options, mode: str, cal: Calibration,
                 stop: threading.Event, cumulative: bool, history: int, pool: "_Pool") -> None:
        self.pid, self.lib, self.options, self.mode, self.cal = pid, lib, options, mode, cal
        self.stop, self.cumulative = stop, cumulative
        self.latest: ProcessSnapshot | None = None
        self.history: collections.deque[float] = collections.deque(maxlen=history)
        self.error: str | None = None
        self.comm = "?"
        self._pool = pool
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"trace-{pid}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        prog = session = None
        try:
            prog = self._pool.take(self.mode)
            session = Session(self.pid, self.lib.path, self.options, program=(prog, self.cal))
            self.comm = session.comm
            i = 0
            while not self.stop.is_set() and not session.exited:
                iv = session.step(i)
                i += 1
                snap = session.summary() if self.cumulative else iv.processes[0]
                with self._lock:
                    self.latest = snap
                    self.history.append(iv.processes[0].calls_hz)
                    self.comm = session.comm
        except GputraceError as exc:
            self.error = exc.msg
        except OSError as exc:  # the process vanished between discovery and attach, mostly
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            if session is not None:
                session.close()
            if prog is not None:
                self._pool.give(prog, self.pid)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def row(self, shimmed: bool, checkpointer: Checkpointer | None) -> ProcessRow | None:
        with self._lock:
            snap, hist, comm = self.latest, tuple(self.history), self.comm
        if snap is None:
            return None
        last = None
        if shimmed and checkpointer is not None:
            cks = checkpointer.list_checkpoints(self.pid)
            last = max(cks, key=lambda c: c.taken_at) if cks else None
        return ProcessRow(self.pid, comm, snap, shimmed, last, hist, self.lib.path)


class LiveSource:
    live = True

    def __init__(self, options: Options = Options(), refresh_s: float = 1.0, *, cumulative: bool = False,
                 checkpointer: Checkpointer | None = None, history: int = 30,
                 discover: Callable[[], dict[int, LibcudaFile]] = cuda_processes,
                 warn: Callable[[str], None] = lambda msg: None) -> None:
        self.options, self.refresh_s, self.cumulative = options, refresh_s, cumulative
        self.checkpointer, self.history, self.discover, self.warn = checkpointer, history, discover, warn
        self._stop = threading.Event()
        self._traced: dict[int, _Traced] = {}
        self._shimmed: dict[int, bool] = {}
        self._notes: dict[int, str] = {}
        self._mode: str | None = None
        self._cal: Calibration | None = None
        self._pool = _Pool()
        self.first_seen: dict[int, float] = {}
        self.host = socket.gethostname()

    def start(self) -> None:
        """Compiles the first program and calibrates the probe cost (seconds): call it from a worker."""
        if self._cal is None:
            with _COMPILE:
                prog, self._cal = open_program(self.options.attach_mode, self.warn)
            self._mode = prog.mode
            self._pool.give(prog)

    def _discover(self) -> None:
        from gputrace.shim.client import has_shim

        found = self.discover()
        found.pop(os.getpid(), None)
        for pid, lib in found.items():
            if pid in self._traced or pid in self._notes:
                continue
            self._shimmed[pid] = bool(has_shim(pid))
            self.first_seen.setdefault(pid, time.monotonic())
            self._traced[pid] = _Traced(pid, lib, self.options, self._mode, self._cal, self._stop,
                                        self.cumulative, self.history, self._pool)
        for pid, t in list(self._traced.items()):
            if not t.alive:
                if t.error and pid in found:
                    self._notes[pid] = t.error
                del self._traced[pid]
                self._shimmed.pop(pid, None)
        for pid in list(self._notes):
            if pid not in found:
                del self._notes[pid]

    def snapshot(self) -> HostSnapshot:
        gpus, note = read_gpus()
        rows, pending = [], []
        for pid, t in sorted(self._traced.items()):
            r = t.row(self._shimmed.get(pid, False), self.checkpointer)
            if r is None:
                pending.append(pid)
            else:
                rows.append(r)
        notes = tuple(f"pid {pid}: {msg}" for pid, msg in sorted(self._notes.items()))
        return HostSnapshot(time.time(), self.host, gpus, note, self.options.budget, tuple(rows), tuple(pending), notes)

    def frames(self) -> Iterator[HostSnapshot]:
        try:
            self.start()
            while not self._stop.is_set():
                self._discover()
                yield self.snapshot()
                if self._stop.wait(self.refresh_s):
                    break
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        for t in list(self._traced.values()):
            t.thread.join(timeout=self.options.interval_s + 5)
        self._pool.close()
