"""The live source: every process on the host that maps a libcuda, traced, one frame per refresh.

Discovery lists /proc each refresh (tracer.targets.CudaScanner, which reaches into containers
through /proc/PID/root): new processes are read at once, so processes started later appear, and so
are those the links already counted calls of. Tracing is host-wide: one compiled
program and one HostSession (tracer/host.py) per distinct libcuda file, stepped in a thread of its
own, whose links cover every process mapping that file; windows are aligned across those processes
and sized so that each stays within the same budget as `gputrace attach`. The probe-cost
calibration is measured once, with the first program, and shared.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import threading
import time
from typing import Callable, Iterator

from gputrace.base.errors import GputraceError
from gputrace.tracer.bpfprog import Program
from gputrace.tracer.calibrate import Calibration
from gputrace.tracer.host import HostSession
from gputrace.tracer.model import ProcessSnapshot
from gputrace.tracer.session import Options, open_program
from gputrace.tracer.targets import CudaScanner, LibcudaFile
from gputrace.tracer.threads import ThreadSlack, ThreadWindow
from gputrace.tracer.tracee import RECENT

from .checkpoints import Checkpointer
from .gpus import read_gpus
from .model import HostSnapshot, ProcessRow
from .jobs import JobTag, job_tag
from .pods import Identity, identity_of

_COMPILE = threading.Lock()  # one bcc compile at a time: LLVM in several threads at once is not worth the risk


class _FileTracer:
    """One libcuda file's HostSession, stepped in its own thread until the source closes. Keeps the
    latest snapshot and a short calls/s history of each of its processes for the UI thread."""

    def __init__(self, lib: LibcudaFile, options: Options, program: Program | None, mode: str, cal: Calibration,
                 cumulative: bool, history: int) -> None:
        self.lib, self.options, self.mode, self.cal = lib, options, mode, cal
        self.cumulative, self.history_len = cumulative, history
        self.latest: dict[int, ProcessSnapshot] = {}
        self.history: dict[int, collections.deque[float]] = {}
        self._history_t: dict[int, tuple[float, ...]] = {}  # the same tuple until a point is added
        self.gone: set[int] = set()    # pids that exited while traced
        self.finished: dict[int, ProcessSnapshot] = {}  # cumulative: their last snapshot (the whole span)
        # Which threads make each process's calls and the slack each has (tracer/threads.py), over the
        # span its snapshot covers: its last RECENT intervals' reads, or (cumulative) from its first.
        self._windows: dict[int, ThreadWindow] = {}
        self.threads: dict[int, tuple[tuple[ThreadSlack, ...] | None, dict | None]] = {}
        self._names: dict[int, str] | None = None
        self.error: str | None = None
        self._program = program
        self._lock = threading.Lock()
        self._pending: list[int] = []
        self._stopped = threading.Event()
        self.session: HostSession | None = None
        self.thread = threading.Thread(target=self._run, name=f"trace-{os.path.basename(lib.path)}", daemon=True)
        self.thread.start()

    def add(self, pid: int) -> None:
        with self._lock:
            if self.session is not None:
                self.session.add(pid)
            else:
                self._pending.append(pid)  # the program is still compiling

    def _run(self) -> None:
        prog = self._program
        try:
            if prog is None:
                with _COMPILE:
                    prog = Program(self.mode)
            with self._lock:
                self.session = HostSession(self.lib.path, self.options, prog, self.cal, keep=self.cumulative)
                for pid in self._pending:
                    self.session.add(pid)
                first = list(self._pending)
            self._first_read(first)
            if self._stopped.is_set():
                return
            # Rows show each process's last few intervals (the whole span for --once): one
            # interval's window, a few ms at a 1% budget, is too short a sample of a bursty job.
            self.session.run(self._publish, "summary" if self.cumulative else "recent")
        except GputraceError as exc:
            self.error = exc.msg
        except Exception as exc:  # an OSError mostly (the file vanished); whatever it is, not a traceback on the screen
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.session is not None:
                self.session.close()
            if prog is not None:
                prog.close()

    def _first_read(self, pids: list[int]) -> None:
        """(Cumulative) The whole span's first read of the threads of the processes traced from the
        start, before the first interval: read at the first snapshot instead, a rank whose calls were
        all counted in that interval has none counted between its reads, and its audit no threads."""
        if self.cumulative:
            self._read_threads(dict.fromkeys(pids))

    def _read_threads(self, snaps: dict[int, ProcessSnapshot]) -> dict[int, tuple]:
        """(In the stepping thread, which owns the program.) A read of the threads of each process
        that has a new snapshot (or none read yet; cumulative: every one, the span ending now, as the
        summary's does): one batched read of `tstats` for all of them."""
        s = self.session
        todo = [pid for pid, snap in snaps.items()
                if self.cumulative or pid not in self._windows or snap is not self.latest.get(pid)]
        if not todo:
            return {}
        try:
            rows = s.program.read_thread_stats_by_tgid()
        except OSError:
            return {}  # the slack stays as last read: not known is what a later audit says without it
        if self._names is None:
            self._names = {i: f.name for i, f in s.probes.ids.items()}
        out = {}
        for pid in todo:
            w = self._windows.get(pid)
            if w is None:
                w = self._windows[pid] = ThreadWindow(pid, keep=None if self.cumulative else RECENT)
            if w.read(rows.get(pid, {})):
                out[pid] = w.slack(self._names)
        return out

    def _publish(self, snaps: dict[int, ProcessSnapshot]) -> None:
        s = self.session
        threads = self._read_threads(snaps)
        with self._lock:
            for pid, ts in threads.items():
                if ts[0] is not None or ts[1] is not None:
                    self.threads[pid] = ts
            for pid, snap in snaps.items():
                if snap is not self.latest.get(pid):  # the same one: no new measurement, no new point
                    h = self.history.setdefault(pid, collections.deque(maxlen=self.history_len))
                    if snap.shown_calls_hz is not None:  # (a rate not known is no point of the trend)
                        h.append(snap.shown_calls_hz)
                    self._history_t[pid] = tuple(h)
                self.latest[pid] = snap
            for pid in s.exited:
                if self.cumulative and pid in snaps:
                    self.finished[pid] = snaps[pid]
                self.latest.pop(pid, None)
                self.history.pop(pid, None)
                self._windows.pop(pid, None)
                if not self.cumulative:
                    self.threads.pop(pid, None)
                self._history_t.pop(pid, None)
                self.gone.add(pid)

    def take(self, pid: int) -> tuple[ProcessSnapshot | None, tuple[float, ...]]:
        """The latest snapshot and calls/s history of `pid`: the same objects until new ones come."""
        with self._lock:
            return self.latest.get(pid), self._history_t.get(pid, ())

    def threads_of(self, pid: int) -> tuple[tuple[ThreadSlack, ...] | None, dict | None]:
        """The threads that make `pid`'s calls and their slack, and its busiest thread, over the span
        of its snapshot; (None, None): not measured (yet)."""
        with self._lock:
            return self.threads.get(pid, (None, None))

    def final(self, pid: int) -> tuple[ProcessSnapshot | None, bool]:
        """(Cumulative) `pid`'s snapshot over its whole traced span, and whether it has exited."""
        with self._lock:
            if pid in self.finished:
                return self.finished[pid], True
            return self.latest.get(pid), pid in self.gone

    def strays(self) -> set[int]:
        s = self.session
        return set(s.strays) if s is not None else set()

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            if self.session is not None:
                self.session.stop()


class LiveSource:
    live = True

    def __init__(self, options: Options = Options(), refresh_s: float = 1.0, *, cumulative: bool = False,
                 checkpointer: Checkpointer | None = None, history: int = 30,
                 discover: Callable[[set[int]], dict[int, LibcudaFile]] | None = None,
                 warn: Callable[[str], None] = lambda msg: None) -> None:
        self.options, self.refresh_s, self.cumulative = options, refresh_s, cumulative
        self.checkpointer, self.history, self.warn = checkpointer, history, warn
        self.discover = discover or CudaScanner()
        self._stop = threading.Event()
        self._files: dict[tuple[int, int], _FileTracer] = {}
        self._pids: dict[int, tuple[_FileTracer, LibcudaFile]] = {}
        self._shimmed: dict[int, bool] = {}
        self._identity: dict[int, Identity] = {}  # read once, when the process is found
        self._job: dict[int, JobTag] = {}          # the same
        self._notes: dict[int, str] = {}
        self._mode: str | None = None
        self._cal: Calibration | None = None
        self._first: Program | None = None  # compiled by start(), handed to the first file
        self.first_seen: dict[int, float] = {}
        self.host = socket.gethostname()
        self._rows: dict[int, ProcessRow] = {}  # the last frame's rows
        # cumulative: every process traced since the start, gone ones too (what `attach` of a job reports)
        self._traced: dict[int, tuple[_FileTracer, LibcudaFile, JobTag, bool]] = {}

    def start(self) -> None:
        """Compiles the first program and calibrates the probe cost (seconds): call it from a worker."""
        if self._cal is None:
            with _COMPILE:
                self._first, self._cal = open_program(self.options.attach_mode, self.warn)
            self._mode = self._first.mode

    @property
    def calibration(self) -> Calibration | None:
        """The probe cost measured by start() (None before)."""
        return self._cal

    def session_of(self, pid: int) -> HostSession | None:
        """The host session (one program, one set of links: one per libcuda file) tracing `pid`."""
        entry = self._pids.get(pid)
        return entry[0].session if entry is not None else None

    def hold_tracing(self, pid: int) -> contextlib.AbstractContextManager[bool]:
        """Takes top's probes off the libcuda file that `pid` maps, for every process on it, for the
        duration (HostSession.hold): a whole-job checkpoint must not copy their breakpoints."""
        s = self.session_of(pid)
        return s.hold() if s is not None else contextlib.nullcontext(True)

    def _discover(self) -> None:
        from gputrace.shim.client import has_shim

        hints = set()
        for ft in self._files.values():
            hints |= ft.strays()
        found = self.discover(hints)
        found.pop(os.getpid(), None)
        for pid, lib in found.items():
            if pid in self._pids or pid in self._notes:
                continue
            key = (lib.dev, lib.inode)
            ft = self._files.get(key)
            if ft is None:
                prog, self._first = self._first, None
                ft = self._files[key] = _FileTracer(lib, self.options, prog, self._mode, self._cal,
                                                    self.cumulative, self.history)
            self._shimmed[pid] = bool(has_shim(pid))
            self._identity[pid] = identity_of(pid)
            self._job[pid] = job_tag(pid)
            self.first_seen.setdefault(pid, time.monotonic())
            self._pids[pid] = (ft, lib)
            if self.cumulative:
                self._traced[pid] = (ft, lib, self._job[pid], self._shimmed[pid])
            ft.add(pid)
        for pid, (ft, _) in list(self._pids.items()):
            if pid in ft.gone or pid not in found or ft.error:
                if ft.error and pid in found:
                    self._notes[pid] = ft.error
                del self._pids[pid]
                self._shimmed.pop(pid, None)
                self._identity.pop(pid, None)
                self._job.pop(pid, None)
                forget = getattr(self.discover, "forget", None)
                if forget is not None and pid in ft.gone:
                    forget(pid)
        for pid in list(self._notes):
            if pid not in found:
                del self._notes[pid]

    def _row(self, pid: int, ft: _FileTracer, lib: LibcudaFile) -> ProcessRow | None:
        snap, hist = ft.take(pid)
        if snap is None:
            return None
        shimmed = self._shimmed.get(pid, False)
        last = None
        if self.checkpointer is not None:
            # Whole-process checkpoints (c, any process) and, for a shimmed one, device-memory ones (C).
            cks = list(getattr(self.checkpointer, "list_full_checkpoints", lambda pid: [])(pid))
            if shimmed:
                cks += self.checkpointer.list_checkpoints(pid)
            last = max(cks, key=lambda c: c.taken_at) if cks else None
        ident = self._identity.get(pid, Identity())
        job = self._job.get(pid, JobTag())
        threads, pacer = ft.threads_of(pid)
        prev = self._rows.get(pid)
        if prev is not None and prev.snapshot is snap and prev.calls_history is hist and prev.shimmed == shimmed \
                and prev.last_checkpoint == last and prev.library == lib.path and prev.identity == ident \
                and prev.job == job and prev.threads is threads:
            # Nothing new for this process (a refresh without a window): the same row, so what was
            # worked out from it (its audits, its cells on screen) stands.
            return prev
        return ProcessRow(pid, snap.comm, snap, shimmed, last, hist, lib.path, ident, job, threads, pacer)

    def snapshot(self) -> HostSnapshot:
        gpus, note = read_gpus()
        rows, pending, waiting = [], [], []
        for pid, (ft, lib) in sorted(self._pids.items()):
            r = self._row(pid, ft, lib)
            if r is None:
                pending.append(pid)
            elif r.snapshot.not_measured is not None:
                # Listed, not shown as a row of zeros: no window has measured it yet.
                pending.append(pid)
                waiting.append(f"pid {pid}: {r.snapshot.not_measured}")
            else:
                rows.append(r)
        self._rows = {r.pid: r for r in rows}
        notes = tuple(f"pid {pid}: {msg}" for pid, msg in sorted(self._notes.items())) + tuple(waiting)
        return HostSnapshot(time.time(), self.host, gpus, note, self.options.budget, tuple(rows), tuple(pending), notes)

    def traced(self) -> list[tuple[int, LibcudaFile, JobTag, ProcessSnapshot | None, bool]]:
        """(Cumulative) Every process found since the start, in pid order: (pid, its libcuda, its
        job tag, its snapshot over the whole span it was traced (None: none yet), exited)."""
        out = []
        for pid, (ft, lib, tag, _) in sorted(self._traced.items()):
            snap, exited = ft.final(pid)
            out.append((pid, lib, tag, snap, exited))
        return out

    def threads_of(self, pid: int) -> tuple[tuple[ThreadSlack, ...] | None, dict | None]:
        """(Cumulative) the threads that made `pid`'s calls over the span it was traced, with their
        slack, and its busiest thread; (None, None): not measured."""
        entry = self._traced.get(pid)
        return entry[0].threads_of(pid) if entry is not None else (None, None)

    def errors(self) -> dict[int, str]:
        """Processes that could not be traced, and why."""
        return dict(self._notes)

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
        for ft in list(self._files.values()):
            ft.stop()
        for ft in list(self._files.values()):
            ft.thread.join(timeout=self.options.interval_s + 5)
        if self._first is not None:
            self._first.close()
            self._first = None
