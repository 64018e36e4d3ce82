"""A tracing session on one process: attach windows, read the maps, build snapshots.

The loop, per interval: plan a window (budget.Policy), attach the return link then the entry link
(so every entry seen has its return seen), wait, detach in the reverse order, read the in-kernel
stats, diff them against the last read, and turn the counts into a ProcessSnapshot with the probe
bias subtracted and the tracer's own cost attached. With `exact` the links stay attached throughout.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import select
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from gputrace.errors import BpfUnavailable, NoLibcuda, NoSuchProcess

from . import links
from .bpfprog import COOKIE_MARKER, COOKIE_STEPPED, COOKIE_TIMED, ZERO, Program, RawStats
from .budget import Policy
from .calibrate import Calibration, calibrate, probe_kind
from .classify import CLASS_ORDER, FunctionClass
from .model import ClassTotals, FunctionStats, Interval, ProcessSnapshot
from .symbols import Function, read_functions

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Options:
    interval_s: float = 1.0
    budget: float = 0.01                   # fraction of the target's CPU time; >= 1 traces everything
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


def _stamped(flip: Callable[[], None]) -> float:
    """Runs a counting-state change and returns when it took effect: the midpoint of the clock read
    before and after, so that being preempted around the map update (seen on a loaded 2-core VM)
    skews the counted spans both ways rather than one."""
    t0 = time.monotonic()
    flip()
    return (t0 + time.monotonic()) / 2


def process_cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def process_comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def percentile_ns(hist: Sequence[int], q: float) -> float | None:
    total = sum(hist)
    if not total:
        return None
    need = q * total
    run = 0
    for slot, n in enumerate(hist):
        run += n
        if run >= need:
            return float(2**slot) if slot else 0.0  # upper edge of the bucket: a bound, not a guess
    return float(2 ** (len(hist) - 1))


def open_program(mode: str, warn: Callable[[str], None]) -> tuple[Program, Calibration]:
    """Loads the program and calibrates with it; in auto mode falls back to per-probe links."""
    if mode in ("auto", "multi"):
        prog = Program("multi")
        try:
            return prog, calibrate(prog)
        except BpfUnavailable as exc:
            prog.close()
            if mode == "multi":
                raise
            warn(f"uprobe-multi links unavailable ({exc.msg}); attaching one probe per function, "
                 "detach will take about 0.1 s per function")
    prog = Program("perf")
    return prog, calibrate(prog)


class Session:
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
        self.functions = select_functions(read_functions(library), options.patterns)
        self.ids = {i: f for i, f in enumerate(self.functions)}
        self.classes = {i: f.cls for i, f in self.ids.items()}
        self.program, self.calibration = program or open_program(options.attach_mode, warn)
        self.kinds = {i: probe_kind(library, f.offset) for i, f in self.ids.items()}
        cal = self.calibration
        self.program.set_hit_costs(cal.emulated.entry_ns, cal.emulated.entry_return_ns,
                                   cal.stepped.entry_ns, cal.stepped.entry_return_ns)
        self.costs = {i: self.calibration.of(k) for i, k in self.kinds.items()}
        self.policy = Policy(self.classes, self.costs, budget=options.budget, interval_s=options.interval_s)
        self.comm = process_comm(pid)
        # The program may have traced this pid before (a reused Program): start from what it holds.
        self._prev: dict[int, RawStats] = {
            func: st for (tgid, func), st in self.program.read_stats().items() if tgid == pid
        }
        self._total: dict[int, RawStats] = {}     # per function, over every window
        self._sum_rate: dict[int, float] = {}      # per-window rates, for their spread
        self._sum_rate2: dict[int, float] = {}
        self._window_s = 0.0
        self._effective_s = 0.0
        self._links: list[links.Link] = []
        self._opened_at: float | None = None
        self._probed: frozenset[int] = frozenset()
        self._probed_s: dict[int, float] = {}       # per function: effective time it was probed
        self._probed_windows: dict[int, int] = {}
        # The marker: one function probed all the time, whose rate between windows against its rate
        # in them measures how much the windows slow the target (see _perturbation).
        self.marker: int | None = None
        self._marker_link: links.Link | None = None
        self._outside_since: float | None = None
        self._outside_s = 0.0                    # this interval's time between windows, marker probed
        self._marker_in = [0, 0.0]               # calls, seconds: inside windows
        self._marker_out = [0, 0.0]              # calls, seconds: between windows
        self._pidfd: int | None = None
        self.attach_s: list[float] = []
        self.detach_s: list[float] = []
        self.started = time.monotonic()
        self.elapsed_s = 0.0
        self.target_cpu_s = 0.0
        self.exited = False
        self.interrupted = False
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None

    # --- attach and detach -------------------------------------------------------------------
    def _attach(self, timed: frozenset[int], probe: frozenset[int] | None = None) -> None:
        """Attaches the return link, then the entry link, then opens counting."""
        self._outside_end()
        self.program.next_generation()
        t0 = time.perf_counter()
        ids = sorted(self.ids if probe is None else probe)
        self._probed = frozenset(ids)
        if not ids:
            self._opened_at = _stamped(self.program.open)
            return
        timed_ids = [i for i in ids if i in timed]
        try:
            if timed_ids:
                self._links.append(self.program.attach(
                    self.library, [self.ids[i].offset for i in timed_ids],
                    [self._cookie(i, True) for i in timed_ids], retprobe=True, pid=self.pid))
            self._links.append(self.program.attach(
                self.library, [self.ids[i].offset for i in ids],
                [self._cookie(i, i in timed) for i in ids], retprobe=False, pid=self.pid))
        except NoSuchProcess:
            self._detach()  # it exited between the last wait and this attach: end as it would have
            self.exited = True
            return
        except BaseException:
            self._detach()
            raise
        self.attach_s.append(time.perf_counter() - t0)
        self._opened_at = _stamped(self.program.open)

    def _reopen(self) -> float:
        """Exact mode: the span counted since the last call. Counting stays open from one interval
        to the next: closing it even for the moment it takes to reopen would lose calls."""
        now = time.monotonic()
        span, self._opened_at = now - (self._opened_at or now), now
        return span

    def _close_counting(self) -> float:
        """Closes counting; returns the span it was open since the last call."""
        if self._opened_at is None:
            return 0.0
        now = _stamped(self.program.close_counting)
        span, self._opened_at = now - self._opened_at, None
        return span

    def _detach(self) -> float:
        counted = self._close_counting()
        t0 = time.perf_counter()
        for link in reversed(self._links):  # entries first, so calls in flight still see their returns
            link.close()
        had = bool(self._links)
        self._links.clear()
        if had:
            self.detach_s.append(time.perf_counter() - t0)
        return counted

    def _outside_begin(self) -> None:
        if self._marker_link is not None:
            self._outside_since = _stamped(self.program.outside)

    def _outside_end(self) -> None:
        if self._outside_since is not None:
            self._outside_s += _stamped(self.program.close_counting) - self._outside_since
            self._outside_since = None

    def _choose_marker(self, cpu_s_per_s: float | None) -> None:
        m = self.policy.choose_marker(cpu_s_per_s)
        if m is None:
            return
        try:
            self._marker_link = self.program.attach(
                self.library, [self.ids[m].offset], [self._cookie(m) | COOKIE_MARKER], retprobe=False, pid=self.pid)
        except NoSuchProcess:
            self.exited = True
            return
        self.marker = m

    def _drop_marker(self) -> None:
        self._outside_end()
        if self._marker_link is not None:
            self._marker_link.close()
        self._marker_link = None
        self.marker = None
        self._marker_in, self._marker_out = [0, 0.0], [0, 0.0]
        self.policy.reserved_s_per_s = 0.0

    def _perturbation(self) -> tuple[float, float] | None:
        """(in-window rate / between-window rate of the marker, its 95% relative half-width), once
        both counts are large enough to mean something; None before that."""
        (ni, ti), (no, to) = self._marker_in, self._marker_out
        if ni < 30 or no < 30 or ti <= 0 or to <= 0:
            return None
        ratio = (ni / ti) / (no / to)
        return min(max(ratio, 0.1), 1.5), 1.96 * math.sqrt(1 / ni + 1 / no)

    def _cookie(self, f: int, timed: bool = False) -> int:
        return f | (COOKIE_TIMED if timed else 0) | (COOKIE_STEPPED if self.kinds[f] == "stepped" else 0)

    def prime(self) -> None:
        """In exact mode, attaches now (before a held command is released) rather than at the first step."""
        if self.options.exact and not self._links:
            self._attach(self.policy.plan().timed)

    def close(self) -> None:
        self._detach()
        self._outside_end()
        if self._marker_link is not None:
            self._marker_link.close()
            self._marker_link = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    # --- waiting -----------------------------------------------------------------------------
    def _wait(self, seconds: float) -> bool:
        """Waits up to `seconds`; returns False as soon as the target exits."""
        if self.exited:
            return False
        if seconds <= 0:
            return True
        if self._pidfd is None:
            time.sleep(seconds)
            self.exited = not os.path.exists(f"/proc/{self.pid}")
            return not self.exited
        p = select.poll()
        p.register(self._pidfd, select.POLLIN)
        if p.poll(seconds * 1000):
            self.exited = True
            return False
        return True

    # --- one interval ------------------------------------------------------------------------
    def step(self, index: int, interval_s: float | None = None) -> Interval:
        interval_s = interval_s or self.options.interval_s
        plan = self.policy.plan()
        t_start = time.monotonic()
        cpu0 = process_cpu_s(self.pid)
        window = 0.0
        try:
            if plan.attach and not self.exited:
                if self.options.exact:
                    if not self._links:
                        self._attach(plan.timed)
                    self._wait(interval_s)
                    window = self._reopen()
                else:
                    self._wait(min(plan.offset_s, interval_s))
                    if not self.exited:
                        self._attach(plan.timed, plan.probe)
                        self._wait(min(plan.window_s, interval_s))
                        window = self._detach()
                        self._outside_begin()
                    self._wait(t_start + interval_s - time.monotonic())
            else:
                self._wait(interval_s)
        except KeyboardInterrupt:
            # Ctrl-C: keep what this interval counted up to now, and let run() stop after it.
            self.interrupted = True
            if self.options.exact and self._opened_at is not None:
                window = self._reopen()
            elif self._links or self._opened_at is not None:
                window = self._detach()
        span = time.monotonic() - t_start
        comm = process_comm(self.pid)
        if comm != "?":  # a held command has exec'd since: show its name, not ours
            self.comm = comm
        if self.exited and self.options.exact:
            self._detach()
        cpu1 = process_cpu_s(self.pid)
        cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
        if cpu is not None:
            self.target_cpu_s += cpu
        self.elapsed_s += span

        restart = self._outside_since is not None
        self._outside_end()
        now = {func: st for (tgid, func), st in self.program.read_stats().items() if tgid == self.pid}
        if restart and not self.exited:
            self._outside_begin()
        deltas = {f: now[f] - self._prev.get(f, ZERO) for f in now}
        self._prev = now
        deltas = {f: d for f, d in deltas.items() if (d.calls or d.timed or d.closed or d.outside) and f in self.ids}
        if self.marker is not None and window > 0:
            d = deltas.get(self.marker, ZERO)
            self._marker_in[0] += d.calls
            self._marker_in[1] += window
            self._marker_out[0] += d.outside
            self._marker_out[1] += self._outside_s
        self._outside_s = 0.0
        effective = self._effective(window, deltas)
        cpu_rate = cpu / span if cpu is not None and span > 0 else None
        self.policy.observe(effective, {f: d.calls for f, d in deltas.items()}, cpu_rate)
        if self.marker is not None and cpu_rate and \
                self.policy.marker_cost(self.marker) > self.options.budget * cpu_rate / 2:
            self._drop_marker()  # the job got lighter, or its calls denser: the marker now costs too much
        if self.marker is None and not self.options.exact and not self.exited and window > 0:
            self._choose_marker(cpu_rate)
        measured = self._perturbation()
        if measured is not None:
            self.policy.measured_loss = max(0.0, 1.0 - measured[0])
        if window > 0:
            self._window_s += window
            self._effective_s += effective
            for f, d in deltas.items():
                self._total[f] = self._total.get(f, ZERO) + d
            for f in self._probed:
                self._probed_s[f] = self._probed_s.get(f, 0.0) + effective
                self._probed_windows[f] = self._probed_windows.get(f, 0) + 1
                r = deltas.get(f, ZERO).calls / effective
                self._sum_rate[f] = self._sum_rate.get(f, 0.0) + r
                self._sum_rate2[f] = self._sum_rate2.get(f, 0.0) + r * r
        continuous = window >= span * 0.999
        errs = {f: self._rate_err(d.calls, window, effective, 0.0 if continuous else None) for f, d in deltas.items()}
        snap = self._snapshot(span, window, effective, cpu, deltas, errs)
        return Interval(index, t_start - self.started, span, window, (snap,), self.program.read_errors())

    # --- snapshots ---------------------------------------------------------------------------
    def _cost_s(self, stats: dict[int, RawStats]) -> float:
        """Probe time the tracer added to the target for these hits (calibrated, per function)."""
        ns = 0.0
        for f, d in stats.items():
            c = self.costs[f]
            ns += (d.calls + d.closed + d.outside) * c.entry_ns + d.timed * (c.entry_return_ns - c.entry_ns)
        return ns * 1e-9

    def _counted_cost_s(self, stats: dict[int, RawStats]) -> float:
        return self._cost_s({f: dataclasses.replace(d, closed=0, outside=0) for f, d in stats.items()})

    def _effective(self, window_s: float, stats: dict[int, RawStats]) -> float:
        """The time the target would have needed, untraced, for what it did in the window.

        Probes slow the traced thread while attached, so calls/window understates the untraced rate
        (by 17% for a launch-bound PyTorch loop on a GPU host, by far more on a virtual machine). Once
        the marker has counted enough, the window is scaled by the slowdown it measured; until then,
        the calibrated probe time is taken out of the window, assuming it was not hidden in waits.
        """
        if window_s <= 0:
            return 0.0
        measured = self._perturbation()
        if measured is not None:
            return window_s * measured[0]
        return max(window_s - self._counted_cost_s(stats), 0.1 * window_s)

    def _rate_err(self, calls: int, window_s: float, effective_s: float, statistical: float | None) -> float:
        """95% half-width of calls/effective_s: the count's Poisson term (unless given), plus what an
        error in the calibrated probe cost does to the probe time taken out of the window."""
        if effective_s <= 0:
            return 0.0
        if statistical is None:
            statistical = 1.96 * math.sqrt(calls) / effective_s
        measured = self._perturbation()
        if measured is not None:
            return statistical + calls / effective_s * measured[1]
        spread = max(self.calibration.emulated.rel_spread, self.calibration.stepped.rel_spread)
        systematic = calls / effective_s * (window_s - effective_s) / effective_s * spread
        return statistical + systematic

    def _function_stats(self, f: int, d: RawStats, effective_s: float, span_s: float, err: float) -> FunctionStats:
        fn = self.ids[f]
        bias = self.costs[f].bias_ns
        rate = d.calls / effective_s if effective_s > 0 else 0.0
        outer = d.timed - d.nested
        return FunctionStats(
            name=fn.name,
            cls=fn.cls,
            calls_observed=d.calls,
            calls_estimated=rate * span_s,
            rate_hz=rate,
            rate_err_hz=err,
            timed_calls=d.timed,
            mean_ns=max(0.0, d.total_ns / d.timed - bias) if d.timed else None,
            outer_mean_ns=max(0.0, d.outer_ns / outer - bias) if outer > 0 else None,
            p50_ns=percentile_ns(d.hist, 0.5),
            p99_ns=percentile_ns(d.hist, 0.99),
            hist=d.hist,
        )

    def _snapshot(self, span_s: float, window_s: float, effective_s: float | dict[int, float], cpu_s: float | None,
                  stats: dict[int, RawStats], errs: dict[int, float]) -> ProcessSnapshot:
        """`effective_s`: the untraced-equivalent time the counts were taken over, one for all
        functions (an interval) or per function (a session, where not all were probed every window)."""
        funcs = []
        for f, d in stats.items():
            if not d.calls and not d.timed:
                continue  # hit only while counting was closed: a cost, not a rate
            eff = effective_s.get(f, 0.0) if isinstance(effective_s, dict) else effective_s
            fs = self._function_stats(f, d, eff, span_s, errs.get(f, 0.0))
            total = self._total.get(f)
            if fs.outer_mean_ns is None and total and total.timed:
                # Counted but not timed in this window: per-call time from the session so far.
                whole = self._function_stats(f, total, self._probed_s.get(f, 0.0), span_s, 0.0)
                fs = dataclasses.replace(fs, mean_ns=whole.mean_ns, outer_mean_ns=whole.outer_mean_ns)
            funcs.append(fs)
        funcs.sort(key=lambda s: (-s.rate_hz, s.name))
        totals = []
        for cls in CLASS_ORDER:
            members = [s for s in funcs if s.cls is cls]
            totals.append(ClassTotals(cls, sum(s.rate_hz for s in members), sum(s.cpu_s_per_s for s in members)))
        wait = sum(t.time_s_per_s for t in totals if t.cls is FunctionClass.SYNC)
        driver = sum(t.time_s_per_s for t in totals if t.cls is not FunctionClass.SYNC)
        return ProcessSnapshot(
            pid=self.pid, comm=self.comm, interval_s=span_s, window_s=window_s, target_cpu_s=cpu_s,
            functions=tuple(funcs), tracer_cost_s=self._cost_s(stats),
            driver_cpu_s_per_s=driver, wait_s_per_s=wait, classes=tuple(totals),
        )

    def summary(self) -> ProcessSnapshot:
        """The whole session as one snapshot: rates over all windows, with their uncertainty.

        The uncertainty of a sampled rate is the larger of the count's Poisson half-width and the
        spread of the per-window rates (a bursty job varies more between windows than counts do)."""
        errs = {}
        for f, d in self._total.items():
            statistical = 0.0
            k = self._probed_windows.get(f, 0)
            eff = self._probed_s.get(f, 0.0)
            if not self.options.exact and eff:
                statistical = 1.96 * math.sqrt(d.calls) / eff
                if k >= 3:
                    mean = self._sum_rate[f] / k
                    var = max(0.0, self._sum_rate2[f] / k - mean * mean) * k / (k - 1)
                    statistical = max(statistical, 1.96 * math.sqrt(var / k))
            errs[f] = self._rate_err(d.calls, self._window_s, self._effective_s, statistical)
        return self._snapshot(self.elapsed_s, self._window_s, dict(self._probed_s), self.target_cpu_s or None,
                              dict(self._total), errs)

    def run(self, duration_s: float | None, on_interval: Callable[[Interval], None] = lambda iv: None) -> ProcessSnapshot:
        index = 0
        try:
            while not self.exited:
                left = None if duration_s is None else duration_s - self.elapsed_s
                if left is not None and left <= 1e-3:
                    break
                iv = self.step(index, min(self.options.interval_s, left) if left is not None else None)
                on_interval(iv)
                index += 1
                if self.interrupted:
                    break
        finally:
            self._detach()
        return self.summary()
