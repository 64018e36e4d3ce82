"""Host-wide tracing: one program and one set of links per distinct libcuda file, for every process
that maps it, however many there are.

A per-process Session costs a compiled program (about 20 MiB and 2 s of CPU), a thread, and its own
attach, detach and map read every interval. Here the links carry no pid filter, so one attach covers
every process on the file (and any that maps it later); windows are aligned across those processes
and sized by an AlignedPolicy so that none pays more than its own budget; one read of the maps per
interval is split by tgid into each process's Tracee, which does the same accounting as `attach`.

Processes are added (`add`) and leave when they exit; a HostSession steps in whatever thread calls
`step`, and publishes nothing itself: the caller takes the snapshots `step` returns. The loop it
steps is tracer/loop.py's, as a Session's; what is a HostSession's own: many processes (found by the
caller, admitted at an interval's start, their exits waited for together), one policy over theirs
(AlignedPolicy), and holds.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from typing import Callable, Iterator

from .bpfprog import Program
from .budget import AlignedPolicy
from .calibrate import Calibration
from .classify import waiting_ids
from .loop import Loop, Rows
from .model import ProcessSnapshot
from .probes import Probes
from .session import Options, select_functions
from .symbols import read_functions
from .tracee import Tracee


class HostSession(Loop):
    def __init__(self, library: str, options: Options, program: Program, calibration: Calibration,
                 *, keep: bool = True) -> None:
        """`keep`: each process keeps every interval's observation, for the "summary" view; a
        caller that only steps the "recent" view passes False, and memory stays bounded."""
        self.library = library
        self.options = options
        self.keep = keep
        self.probes = Probes(library, select_functions(read_functions(library), options.patterns),
                             program, calibration)
        # The first window probes every function; after it, the functions no process has been seen
        # calling are on the watch link (no pid filter: it covers a process that joins later too).
        # Each attach and detach writes the window's breakpoints into every process on the file, and
        # the kernel's work for it is top's own CPU: one window every 2nd interval, as long as both
        # intervals' budget pays for.
        self.policy = AlignedPolicy(self.probes.classes, self.probes.costs, budget=options.budget,
                                    interval_s=options.interval_s, per_interval=1,
                                    every=1 if options.exact else 2, waiting=waiting_ids(self.probes.ids),
                                    keep_share=0.0, rare_share=0.0)
        self.tracees: dict[int, Tracee] = {}
        self._start_loop({})
        # Every 100 ms rather than 20: each look wakes this thread, and top's own CPU is what it costs.
        self.probes.poll_s = 0.1
        self._pidfds: dict[int, int] = {}
        self._adding: dict[int, None] = {}
        self._lock = threading.Lock()
        self._held = 0  # hold()s in force: no window opens, no link stays, while it is > 0
        self._held_cond = threading.Condition(self._lock)
        self._quiet = threading.Event()  # set by the stepping thread once it holds no link
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # stop() wakes _wait with it
        # _wait sleeps in epoll on every process's pidfd (and the wake pipe), each registered once:
        # poll() would hand the kernel all 50 of them on every wait.
        self._epoll = select.epoll()
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._by_fd: dict[int, int] = {}  # pidfd -> pid, while the process has not exited
        self.exited: list[int] = []  # of the last step
        self.strays: set[int] = set()  # processes the links counted calls of, not added

    def add(self, pid: int) -> None:
        """Traces `pid` from the next interval on (from any thread)."""
        with self._lock:
            if pid not in self.tracees:
                self._adding[pid] = None

    def stop(self) -> None:
        """Ends the interval in progress soon (from any thread)."""
        self._stop.set()
        self._wake()

    def _wake(self) -> None:
        with self._lock:  # not while close() closes the pipe
            self._held_cond.notify_all()
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass  # the pipe is full: the waits end all the same

    @contextlib.contextmanager
    def hold(self, timeout_s: float = 10.0) -> Iterator[bool]:
        """(From another thread.) Takes every probe off the file for the duration: the window in
        progress ends, the marker goes, and none opens again until the last hold ends. A uprobe's
        breakpoints are in every process on the file, so this is what lets one of them be copied
        whole (CRIU) without them. Yields True once the stepping thread has let go of its links
        (False if it did not within `timeout_s`: it is not stepping, or stuck)."""
        with self._lock:
            self._held += 1
        self._wake()
        try:
            yield self._quiet.wait(timeout_s) or not self.probes.links and self.probes.watch_link is None
        finally:
            with self._lock:
                self._held -= 1
                if self._held == 0:
                    self._quiet.clear()
                self._held_cond.notify_all()

    def _quiet_interval(self, interval_s: float) -> float:
        """An interval under hold(): every link detached (exact mode keeps them between intervals),
        then a wait until the interval ends or the hold does; returns the span counted."""
        counted = self.probes.detach() if self.probes.links else 0.0
        self.probes.marker_end()
        self.probes.set_watch(frozenset())  # off too: its breakpoints are in every process on the file
        self._quiet.set()
        with self._held_cond:
            self._held_cond.wait_for(lambda: self._held == 0 or self._stop.is_set(), timeout=interval_s)
        return counted

    def _admit(self, stats: Rows) -> None:
        with self._lock:
            adding, self._adding = list(self._adding), {}
        for pid in adding:
            if pid in self.tracees:
                continue
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue  # exited before its first interval
            o = self.options
            t = Tracee(pid, self.probes, budget=o.budget, interval_s=o.interval_s, exact=o.exact,
                       prev=stats.get(pid), keep=self.keep, keep_cheap=False, rows_t=self._rows_t)
            t.comm_every = 10  # 50 processes' comm every second is 50 file reads for nothing
            self.tracees[pid] = t
            self._pidfds[pid] = fd
            self._by_fd[fd] = pid
            self._epoll.register(fd, select.EPOLLIN)
            self.policy.members[pid] = t.policy
            self._seen_rows[pid] = stats.get(pid, {})

    def _stopped(self) -> bool:
        return not self._by_fd or self._stop.is_set() or bool(self._held)

    def _poll(self, ms: int) -> None:
        for fd, _ in self._epoll.poll(ms / 1000):  # stop() and hold() write to _wake_w: no need to wake up to look
            if fd == self._wake_r:
                # Emptied, or every later wait would return at once and spin to its deadline
                # (after a hold ends). The flags are read again at the top of the wait's loop.
                self._drain_wake()
                continue
            pid = self._by_fd.pop(fd, None)
            if pid is not None:
                self.tracees[pid].exited = True
                self._epoll.unregister(fd)  # readable for good now; _drop closes it after the step

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _merge(self, windows: int) -> None:
        self.policy.merge(windows)

    def _windows(self, plan, interval_s: float) -> float:
        t_start = time.monotonic()
        if self._held:
            window = self._quiet_interval(interval_s)
        else:
            if not self.options.exact and self.policy.windows > 0:
                self._rewatch()  # back after a hold
            window = self.probes.window(plan, interval_s, self.options.exact, self._wait)
        if not self.tracees and not self._stop.is_set():
            self._stop.wait(max(0.0, t_start + interval_s - time.monotonic()))
        return window

    def _end_rows(self) -> Rows:
        # Rows change only while a link is attached: after the windows (read then) only the watch
        # link's, which the poll counter tells.
        if self.probes.poll_seen() is not None or self._last_rows is None or self.options.exact:
            return self._read()
        return self._last_rows

    def _watching(self) -> bool:
        return not self._held and bool(self.tracees)

    def _drop_exited(self) -> None:
        self.exited = [pid for pid, t in self.tracees.items() if t.exited]
        for pid in self.exited:
            self._drop(pid)

    def step(self, interval_s: float | None = None, view: str = "recent") -> dict[int, ProcessSnapshot]:
        """One interval over every process added so far; returns their snapshots by pid (the
        processes that exited in it included, for the last time: their pids are in `exited`):
        over their last few intervals (`view` "recent", Tracee.recent), over the whole session
        ("summary"), or over this interval alone ("interval")."""
        self._admit(self._read() if self._adding else {})
        snaps, _, _, end = self._interval(interval_s or self.options.interval_s, view)
        self._forget_strays(end)
        return snaps

    def _drop(self, pid: int, forget: bool = True) -> None:
        t = self.tracees.pop(pid)
        t.close()
        self.policy.members.pop(pid, None)
        fd = self._pidfds.pop(pid)
        if self._by_fd.pop(fd, None) is not None:
            self._epoll.unregister(fd)
        os.close(fd)
        if forget:
            self.program.forget([(pid, f) for f in self.probes.ids])  # a reused pid starts from nothing

    def _forget_strays(self, stats: Rows) -> None:
        """Rows of processes that mapped the file and exited before anyone added them are forgotten;
        those of live ones not added are `strays`: processes on the file that no one has found yet."""
        with self._lock:
            known = set(self.tracees) | set(self._adding)
        unknown = [tgid for tgid in stats if tgid not in known]
        gone = [tgid for tgid in unknown if not os.path.exists(f"/proc/{tgid}")]
        self.strays = set(unknown) - set(gone)
        if gone:
            self.program.forget([(tgid, f) for tgid in gone for f in stats[tgid]])

    def close(self) -> None:
        self.probes.close()
        for pid in list(self.tracees):
            # No map delete per process and function here (with 50 processes, thousands of
            # syscalls and 20 ms of top's `q`): the rows go with the program, which the caller
            # closes, or stand as counts from before the next session on it, as those of a process
            # not added yet do.
            self._drop(pid, forget=False)
        self._epoll.close()
        with self._lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def run(self, on_step: Callable[[dict[int, ProcessSnapshot]], None], view: str = "recent") -> None:
        """Steps until stop(); the probes are detached at the end, even on an error."""
        try:
            while not self._stop.is_set():
                on_step(self.step(view=view))
        finally:
            self.probes.detach()
