"""The tracing loop that a Session (one process, tracer/session.py) and a HostSession (every process
on one libcuda file, tracer/host.py) share: waiting, the end of each window, discovery (a watched
function called moves into the windows), and one interval's step from its plan to each process's
snapshot. What differs stays with them, through the hooks below: how many processes and how their
exits are waited for (`_stopped`, `_poll`), how the windows run (`_windows`: a Ctrl-C or the process
gone for a Session, holds for a HostSession), how the watch link is set (`_rewatch`: a Session keeps
its cheapest functions on it), and what follows the accounting (`_merge`, `_drop_exited`).

Rows are the maps as `Program.read_by_tgid` gives them: per process (tgid), per function.
"""

from __future__ import annotations

import time

from gputrace.base.errors import NoSuchProcess

from .bpfprog import RawStats
from .budget import SCOUT_INTERVAL_S, Policy
from .model import ProcessSnapshot
from .probes import IntervalLog, Probes
from .tracee import Tracee

Rows = dict[int, dict[int, RawStats]]


class Loop:
    """A subclass sets `probes`, `policy`, `options` (tracer/session.py's Options) and `tracees`
    (a Tracee per pid), then calls `_start_loop`."""

    probes: Probes
    policy: Policy
    tracees: dict[int, Tracee]

    def _start_loop(self, seen: Rows) -> None:
        """Once `probes` is made: its callbacks, and the rows the watch link's calls count from
        (`seen`, per process: those the tracees start from)."""
        self.probes.on_seen = self._on_seen
        self.probes.on_window_end = self._window_end
        self._window_rows: list[Rows] = []  # the maps after each window of this interval
        self._last_rows: Rows | None = None  # the maps as last read
        self._rows_t = time.monotonic()  # when they were
        # The rows the watch link's calls count from, and when they were read.
        self._seen_rows: Rows = seen
        self._seen_t = time.monotonic()

    @property
    def program(self):
        return self.probes.program

    def _read(self) -> Rows:
        self._last_rows = self.program.read_by_tgid()
        self._rows_t = time.monotonic()
        return self._last_rows

    # --- waiting ------------------------------------------------------------------------------
    def _stopped(self) -> bool:
        """Whether the waits end now (the processes exited, or the caller stops)."""
        raise NotImplementedError

    def _poll(self, ms: int) -> None:
        """Sleeps up to `ms` milliseconds, or until a process exits (noted: its Tracee's `exited`)."""
        raise NotImplementedError

    def _wait(self, seconds: float) -> bool:
        """Waits up to `seconds`, noting processes that exit; False as soon as the waits end."""
        deadline = time.monotonic() + max(0.0, seconds)
        while True:
            if self._stopped():
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            # poll() and epoll take whole milliseconds and round a fraction up: a 2.3-ms wait took
            # 3.1 ms, and every window of time ran half a millisecond past its plan on average
            # (GPT-2's 3-ms windows on the H200 by a sixth). The whole milliseconds in a poll, the
            # rest asleep.
            ms = int(left * 1000)
            if ms == 0:
                time.sleep(left)
                return True
            self._poll(ms)

    # --- windows and discovery ----------------------------------------------------------------
    def _window_end(self, ws) -> None:
        rows = self._read()
        self._window_rows.append(rows)
        if self.policy.windows == 0 and not self.options.exact and len(self._window_rows) == 1:
            # The first window (the scout) probed every function: those it saw called go into the
            # windows, the rest onto the watch link now, not at the interval's end (calls in between
            # would be lost).
            for pid, t in self.tracees.items():
                t.scouted(rows.get(pid, {}), ws.counted_s)
            self._merge(0)
            self._rewatch(rows)

    def _on_seen(self, since: float) -> None:
        """A watched function was called, in some process (in the last `since` seconds): move it
        (and any other) into the windows at once."""
        rows = self._read()
        now = time.monotonic()
        dt = max(min(now - self._seen_t, since), 1e-3)
        watched, kept = self.probes.watched, self.probes.kept
        fresh: set[int] = set()
        for pid, t in self.tracees.items():
            before = self._seen_rows.get(pid, {})
            for f, st in rows.get(pid, {}).items():
                if f not in watched or f in kept:
                    continue
                b = before.get(f)
                n = st.watched - (b.watched if b is not None else 0)
                if n > 0:
                    t.policy.see(f, n / dt)
                    self.probes.log.discovered.setdefault(pid, []).append((f, dt, n))
                    fresh.add(f)
        self._seen_rows, self._seen_t = rows, now
        if fresh:
            self._merge(0)
            self._rewatch(rows)
            moved = frozenset(fresh)
            self.probes.join(moved, self.policy.follow_up_s(moved), moved & self.policy.waiting)

    def _rewatch(self, rows: Rows | None = None) -> None:
        """The watch link as the policy wants it (`rows`: the maps as read just now, if they were).
        A function's calls on the watch link count from here on: one that joins it now has no
        earlier calls there, and calls made before the rebuild, which the poll's mark no longer
        shows, are not taken as made since it."""
        ids = self.policy.watch_set()
        if ids == self.probes.watched:
            return
        self._seen_rows, self._seen_t = (self._read() if rows is None else rows), time.monotonic()
        self.probes.set_watch(ids)

    def _merge(self, windows: int) -> None:
        """After the processes' policies have seen more (`windows` windows): the loop's policy
        follows them (one policy per process for many: AlignedPolicy.merge)."""

    # --- one interval -------------------------------------------------------------------------
    def _windows(self, plan, interval_s: float) -> float:
        """Runs the interval's windows (Probes.window); returns the time they counted."""
        raise NotImplementedError

    def _end_rows(self) -> Rows:
        """The maps at the interval's end."""
        return self._read()

    def _watching(self) -> bool:
        """Whether the watch link is set again after the interval."""
        return True

    def _drop_exited(self) -> None:
        """After the accounting: what becomes of the processes that exited in the interval."""

    def _interval(self, interval_s: float,
                  view: str = "interval") -> tuple[dict[int, ProcessSnapshot], IntervalLog, float, Rows]:
        """One interval over every tracee: plan, windows, the maps read, each process accounted.
        Returns each one's snapshot by pid (`view`: over this interval, its last few intervals
        "recent", Tracee.recent, or the whole session "summary"), the probes' log, the time the
        windows counted and the rows at the end."""
        plan = self.policy.plan()
        if plan.full_scan:
            interval_s = min(interval_s, SCOUT_INTERVAL_S)
        for t in self.tracees.values():
            t.begin()
        self._window_rows = []
        window = self._windows(plan, interval_s)
        log = self.probes.take_log()
        if log.whole_missed:
            self.policy.whole_missed()
        end = self._end_rows()
        # An interval's counts are these rows less the last interval's: each process's span is the
        # time between the two reads (or from the rows it was added with), the set-up between
        # intervals included (the watch link and the kept functions' counts ran on through it;
        # timed from the windows' start, they read 2% high).
        now = time.monotonic()
        snaps = {}
        for pid, t in self.tracees.items():
            rows = [r.get(pid, {}) for r in self._window_rows]
            snap = t.account(now - t.rows_t, log, rows, end.get(pid, {}), snapshot=view == "interval")
            if snap is None:
                # An interval without a window adds nothing but watched calls: the last recent
                # snapshot stands (the same object, so a caller can tell nothing new came).
                snap = t.recent(rebuild=bool(log.windows) or t.intervals <= 1) if view == "recent" else t.summary()
            snaps[pid] = snap
        self._drop_exited()
        exact = self.options.exact
        if not exact:
            for t in self.tracees.values():
                if not t.exited:
                    t.policy.retire_idle()
        self._merge(len(log.windows))
        if not exact and self._watching():
            try:
                self._rewatch(end)
            except NoSuchProcess:
                # (Only links filtered to one process's pid raise it: that process.) It ended after
                # the interval's last look: the report stands.
                self.tracees[self.probes.pid].exited = True
        return snaps, log, window, end

