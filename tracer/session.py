"""A tracing session on one process: attach windows, read the maps, build snapshots.

The loop, per interval: plan a window (budget.Policy), attach the return link then the entry link
(so every entry seen has its return seen), wait, detach in the reverse order, read the in-kernel
stats, diff them against the last read, and turn the counts into a ProcessSnapshot with the probe
bias subtracted and the tracer's own cost attached. With `exact` the links stay attached throughout.
The links and counting state are a Probes (tracer/probes.py), the accounting a Tracee
(tracer/tracee.py), the loop that steps them tracer/loop.py's, which tracer/host.py runs over every
process of a libcuda file. What is a Session's own: one process, whose exit ends the waits; a Ctrl-C
or the process gone in the middle of a window; and the kept functions, counted every call on the
watch link.
"""

from __future__ import annotations

import fnmatch
import os
import select
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from gputrace.base.errors import BpfUnavailable, NoLibcuda, NoSuchProcess
from gputrace.base.procs import alive, stop_point

from .bpfprog import Program
from .calibrate import Calibration, calibrate
from .loop import Loop, Rows
from .model import Interval, ProcessSnapshot
from .probes import Probes
from .symbols import Function, read_functions
from .tracee import Tracee, percentile_ns, process_cpu_s  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class Options:
    interval_s: float = 1.0
    budget: float = 0.01                   # share of the target's time (wall) its probes may cost; >= 1 traces everything
    patterns: tuple[str, ...] = ()         # fnmatch patterns over function names; empty: every cu*
    attach_mode: str = "auto"              # "auto", "multi" or "perf"

    @property
    def exact(self) -> bool:
        return self.budget >= 1.0


def select_functions(funcs: Sequence[Function], patterns: Iterable[str]) -> tuple[Function, ...]:
    pats = [p for p in patterns if p]
    if not pats:
        return tuple(funcs)
    chosen = tuple(f for f in funcs if any(fnmatch.fnmatchcase(n, p) for p in pats for n in (f.name, *f.aliases)))
    if not chosen:
        raise NoLibcuda(
            f"no driver function matches {', '.join(pats)}",
            "patterns are shell globs over names such as cuLaunchKernel or cuMemcpy*Async*",
        )
    return chosen


def open_program(mode: str, warn: Callable[[str], None]) -> tuple[Program, Calibration]:
    """Loads the program and calibrates with it; in auto mode falls back to per-probe links."""
    if mode in ("auto", "multi"):
        try:
            prog = Program("multi")
        except BpfUnavailable as exc:
            if mode == "multi":
                raise
            prog = None
            why = exc.msg
        if prog is not None:
            _say_origin(prog, warn)
            try:
                return prog, calibrate(prog)
            except BpfUnavailable as exc:
                prog.close()
                if mode == "multi":
                    raise
                why = exc.msg
        warn(f"uprobe-multi links unavailable ({why}); attaching one probe per function, "
             "detach will take about 0.1 s per function")
    prog = Program("perf")
    _say_origin(prog, warn)
    return prog, calibrate(prog)


def _say_origin(prog: Program, warn: Callable[[str], None]) -> None:
    if prog.origin.fallback:
        warn(f"the precompiled BPF program did not load ({prog.origin.fallback}); compiled it with bcc instead")


class Session(Loop):
    def __init__(
        self,
        pid: int,
        library: str,
        options: Options,
        *,
        warn: Callable[[str], None] = lambda msg: None,
        program: tuple[Program, Calibration] | None = None,
    ) -> None:
        self.pid = pid
        self.library = library
        self.options = options
        functions = select_functions(read_functions(library), options.patterns)
        prog, cal = program or open_program(options.attach_mode, warn)
        stop_point("tracer:setup")
        try:
            self.probes = Probes(library, functions, prog, cal, pid=pid)
            prev = {func: st for (tgid, func), st in prog.read_stats().items() if tgid == pid}
            rows_t = time.monotonic()
            self.tracee = Tracee(pid, self.probes, budget=options.budget, interval_s=options.interval_s,
                                 exact=options.exact, prev=prev, rows_t=rows_t)
        except Exception as exc:
            if alive(pid):
                raise
            if getattr(self, "probes", None) is not None:
                self.probes.close()
            raise NoSuchProcess(f"process {pid} exited while the tracer was being set up",
                                "nothing was measured; a job that lasts under a second is best traced from its "
                                "start: gputrace attach -- COMMAND") from exc
        self.tracees = {pid: self.tracee}
        self._start_loop({pid: prev})
        self.probes.on_kept_hot = self._on_kept_hot
        self._kept_rows, self._kept_t = prev, time.monotonic()
        # The session counts from the rows read above: its first interval starts there.
        self.started = rows_t
        self.started_wall = time.time() - (time.monotonic() - rows_t)
        self.interrupted = False
        self._pidfd: int | None = None
        self._poller = None  # select.poll on the pidfd
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None
        else:
            self._poller = select.poll()
            self._poller.register(self._pidfd, select.POLLIN)

    # What attach's report and the tests read.
    calibration = property(lambda self: self.probes.calibration)
    functions = property(lambda self: self.probes.functions)
    ids = property(lambda self: self.probes.ids)
    kinds = property(lambda self: self.probes.kinds)
    attach_s = property(lambda self: self.probes.attach_s)
    detach_s = property(lambda self: self.probes.detach_s)
    step_log = property(lambda self: self.probes.step_log)
    policy = property(lambda self: self.tracee.policy)
    comm = property(lambda self: self.tracee.comm)

    @property
    def exited(self) -> bool:
        return self.tracee.exited

    @exited.setter
    def exited(self, value: bool) -> None:
        self.tracee.exited = value

    def prime(self) -> None:
        """In exact mode, attaches now (before a held command is released) rather than at the first step."""
        if self.options.exact and not self.probes.links:
            self.probes.attach(self.policy.plan().timed)

    def close(self) -> None:
        self.probes.close()
        self.tracee.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _stopped(self) -> bool:
        return self.exited

    def _poll(self, ms: int) -> None:
        if self._poller.poll(ms):
            self.exited = True

    def _wait(self, seconds: float) -> bool:
        """Waits up to `seconds`; returns False as soon as the target exits."""
        if self._pidfd is not None or self.exited or seconds <= 0:
            return Loop._wait(self, seconds)
        time.sleep(seconds)  # no pidfd: its exit is looked for at the end
        self.exited = not os.path.exists(f"/proc/{self.pid}")
        return not self.exited

    def _rewatch(self, rows: Rows | None = None) -> None:
        """As Loop._rewatch, with the kept functions on the watch link and the limit that goes with
        them; set again whether or not the watch set changed."""
        if rows is None:
            rows = self._read()
        self._seen_rows, self._seen_t = rows, time.monotonic()
        self.probes.set_watch(self.policy.watch_set(), self.policy.kept)
        self.probes.kept_hz_limit = self.policy.kept_hz_limit()
        if self.policy.kept:
            self._kept_rows, self._kept_t = rows.get(self.pid, {}), time.monotonic()

    def _on_kept_hot(self, hits: int, seconds: float) -> None:
        """The kept functions are called more than counting them all may cost: their rates from the
        watch link's counts since the last look, the kept set chosen again, and those that leave it
        probed in this interval's windows from now on (or one of their own)."""
        rows = self._read()
        mine = rows.get(self.pid, {})
        now = time.monotonic()
        dt = max(now - self._kept_t, 1e-3)
        rates = {}
        for f in self.policy.kept:
            st, before = mine.get(f), self._kept_rows.get(f)
            if st is not None:
                rates[f] = (st.watched - (before.watched if before is not None else 0)) / dt
        self._kept_rows, self._kept_t = mine, now
        old = self.policy.kept
        self.policy.observe_kept(rates)
        self.policy.kept = self.policy.choose_kept()
        moved = old - self.policy.kept
        if moved:
            self._rewatch(rows)
            self.probes.join(moved, self.policy.follow_up_s(moved), moved & self.policy.waiting)
        else:
            # Dear, but not so dear that the policy lets them go: no second look until twice as many.
            self.probes.kept_hz_limit = max(self.probes.kept_hz_limit, 2 * hits / max(seconds, 0.1))

    def _windows(self, plan, interval_s: float) -> float:
        exact = self.options.exact
        window = 0.0
        try:
            if not self.exited:
                window = self.probes.window(plan, interval_s, exact, self._wait)
            else:
                self._wait(interval_s)
        except NoSuchProcess:
            window = self.probes.interrupted(exact)  # it exited between the last wait and an attach
            self.exited = True
        except KeyboardInterrupt:
            # Ctrl-C: keep what this interval counted up to now, and let run() stop after it.
            self.interrupted = True
            window = self.probes.interrupted(exact)
        if self.exited and exact:
            self.probes.detach()
        return window

    def _watching(self) -> bool:
        return not self.exited

    def step(self, index: int, interval_s: float | None = None) -> Interval:
        t_from = self.tracee.rows_t  # the interval counts from the last one's rows
        snaps, log, window, _ = self._interval(interval_s or self.options.interval_s)
        snap = snaps[self.pid]
        return Interval(index, t_from - self.started, snap.interval_s, window, (snap,), self.program.read_errors(),
                        tuple((w.t0, w.t1) for w in log.windows if w.t1 > 0))

    def summary(self) -> ProcessSnapshot:
        return self.tracee.summary()

    def run(self, duration_s: float | None, on_interval: Callable[[Interval], None] = lambda iv: None) -> ProcessSnapshot:
        index = 0
        try:
            while not self.exited:
                left = None if duration_s is None else duration_s - self.tracee.elapsed_s
                if left is not None and left <= 1e-3:
                    break
                iv = self.step(index, min(self.options.interval_s, left) if left is not None else None)
                on_interval(iv)
                index += 1
                if self.interrupted:
                    break
        finally:
            self.probes.detach()
        return self.summary()
