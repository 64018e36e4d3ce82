"""One libcuda file's probes on one program: its functions, the links of the current window and the
program's counting state (closed, open, between windows).

Shared by a Session (one process: links filtered to its pid) and a HostSession (every process that
maps the file: links without a pid filter). The counting state is one global per program, so every
process on the links sees the same windows; each process's counts are kept apart by tgid in the
maps and accounted by a Tracee (tracer/tracee.py).
"""

from __future__ import annotations

import time
from typing import Callable

from . import links
from .bpfprog import COOKIE_MARKER, COOKIE_STEPPED, COOKIE_TIMED, Program
from .calibrate import Calibration, probe_kind
from .symbols import Function


def stamped(flip: Callable[[], None]) -> float:
    """Runs a counting-state change and returns when it took effect: the midpoint of the clock read
    before and after, so that being preempted around the map update (seen on a loaded 2-core VM)
    skews the counted spans both ways rather than one."""
    t0 = time.monotonic()
    flip()
    return (t0 + time.monotonic()) / 2


class Probes:
    def __init__(self, library: str, functions: tuple[Function, ...], program: Program, calibration: Calibration,
                 *, pid: int = 0) -> None:
        self.library = library
        self.pid = pid  # 0: every process that maps the file
        self.functions = functions
        self.ids = {i: f for i, f in enumerate(functions)}
        self.classes = {i: f.cls for i, f in self.ids.items()}
        self.program, self.calibration = program, calibration
        self.kinds = {i: probe_kind(library, f.offset) for i, f in self.ids.items()}
        cal = calibration
        program.set_hit_costs(cal.emulated.entry_ns, cal.emulated.entry_return_ns,
                              cal.stepped.entry_ns, cal.stepped.entry_return_ns)
        self.costs = {i: cal.of(k) for i, k in self.kinds.items()}
        self.links: list[links.Link] = []
        self.opened_at: float | None = None
        self.probed: frozenset[int] = frozenset()
        self.outside_since: float | None = None
        self.outside_s = 0.0  # this interval's time between windows (the markers' reference span)
        self.attach_s: list[float] = []
        self.detach_s: list[float] = []

    def cookie(self, f: int, timed: bool = False) -> int:
        return f | (COOKIE_TIMED if timed else 0) | (COOKIE_STEPPED if self.kinds[f] == "stepped" else 0)

    def attach(self, timed: frozenset[int], probe: frozenset[int] | None = None) -> None:
        """Attaches the return link, then the entry link (every entry seen has its return seen), then
        opens counting. A pid-filtered attach raises NoSuchProcess if that process has exited."""
        self.outside_end()
        self.program.next_generation()
        t0 = time.perf_counter()
        ids = sorted(self.ids if probe is None else probe)
        self.probed = frozenset(ids)
        if ids:
            timed_ids = [i for i in ids if i in timed]
            try:
                if timed_ids:
                    self.links.append(self.program.attach(
                        self.library, [self.ids[i].offset for i in timed_ids],
                        [self.cookie(i, True) for i in timed_ids], retprobe=True, pid=self.pid))
                self.links.append(self.program.attach(
                    self.library, [self.ids[i].offset for i in ids],
                    [self.cookie(i, i in timed) for i in ids], retprobe=False, pid=self.pid))
            except BaseException:
                self.detach()
                raise
            self.attach_s.append(time.perf_counter() - t0)
        self.opened_at = stamped(self.program.open)

    def attach_marker(self, f: int, pid: int) -> links.Link:
        """The marker's own entry link on one process, attached until closed."""
        return self.program.attach(self.library, [self.ids[f].offset], [self.cookie(f) | COOKIE_MARKER],
                                   retprobe=False, pid=pid)

    def reopen(self) -> float:
        """Exact mode: the span counted since the last call. Counting stays open from one interval
        to the next: closing it even for the moment it takes to reopen would lose calls."""
        now = time.monotonic()
        span, self.opened_at = now - (self.opened_at or now), now
        return span

    def close_counting(self) -> float:
        """Closes counting; returns the span it was open since the last call."""
        if self.opened_at is None:
            return 0.0
        now = stamped(self.program.close_counting)
        span, self.opened_at = now - self.opened_at, None
        return span

    def detach(self) -> float:
        counted = self.close_counting()
        t0 = time.perf_counter()
        for link in reversed(self.links):  # entries first, so calls in flight still see their returns
            link.close()
        had = bool(self.links)
        self.links.clear()
        if had:
            self.detach_s.append(time.perf_counter() - t0)
        return counted

    def outside_begin(self) -> None:
        """Between windows, with markers attached: their hits count as `outside`."""
        self.outside_since = stamped(self.program.outside)

    def outside_end(self) -> None:
        if self.outside_since is not None:
            self.outside_s += stamped(self.program.close_counting) - self.outside_since
            self.outside_since = None

    def take_outside_s(self) -> float:
        s, self.outside_s = self.outside_s, 0.0
        return s

    def window(self, plan, interval_s: float, exact: bool, wait: Callable[[float], bool],
               markers: Callable[[], bool]) -> float:
        """Runs one interval's window as planned (waiting with `wait`, which returns False once
        there is no one left to trace); returns the span counted."""
        t_start = time.monotonic()
        if not plan.attach:
            wait(interval_s)
            return 0.0
        if exact:
            if not self.links:
                self.attach(plan.timed)
            wait(interval_s)
            return self.reopen()
        if not wait(min(plan.offset_s, interval_s)):
            return 0.0
        self.attach(plan.timed, plan.probe)
        wait(min(plan.window_s, interval_s))
        counted = self.detach()
        if markers():
            self.outside_begin()
        wait(t_start + interval_s - time.monotonic())
        return counted

    def interrupted(self, exact: bool) -> float:
        """Ctrl-C in the middle of window(): what was counted up to now."""
        if exact and self.opened_at is not None:
            return self.reopen()
        if self.links or self.opened_at is not None:
            return self.detach()
        return 0.0

    def close(self) -> None:
        self.detach()
        self.outside_end()
