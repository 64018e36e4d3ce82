"""One traced process's accounting over the windows of a Probes: its budget policy, its marker, the
diff of its rows in the shared maps, its totals over the session, and the snapshots built from them.

A Session (one process) and a HostSession (every process on one libcuda file) both keep one Tracee
per process; what differs between them is only who plans and runs the windows.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
import os
import time
from typing import Mapping

from gputrace.errors import NoSuchProcess

from . import links
from .bpfprog import ZERO, RawStats
from .budget import Policy
from .classify import CLASS_ORDER, FunctionClass
from .model import ClassTotals, FunctionStats, ProcessSnapshot
from .probes import Probes

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float | None:
    # os.open/os.read, not open(): a file object (a buffer, a wrapper, a context manager) costs more
    # than the read itself.
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _cpu_s(os.read(fd, 4096))
        finally:
            os.close(fd)
    except OSError:
        return None


def _cpu_s(stat: bytes) -> float | None:
    try:
        fields = stat.rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (IndexError, ValueError):
        return None


class CpuClock:
    """A process's CPU time, read per interval by `top` for every traced process: /proc/PID/stat
    kept open and read again with pread (one syscall rather than open, read and close). The file
    stays bound to that process: once it is reaped, reads fail (None), whoever gets the pid next."""

    def __init__(self, pid: int) -> None:
        try:
            self._fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = -1

    def read(self) -> float | None:
        if self._fd < 0:
            return None
        try:
            return _cpu_s(os.pread(self._fd, 4096, 0))
        except OSError:
            return None

    def close(self, _close=os.close) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            _close(fd)

    def __del__(self) -> None:
        self.close()  # a Tracee dropped without close() (a test's) does not leak the file


def process_comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def percentile_ns(hist, q: float, total: int | None = None) -> float | None:
    total = sum(hist) if total is None else total
    if not total:
        return None
    need = q * total
    run = 0
    for slot, n in enumerate(hist):
        run += n
        if run >= need:
            return float(2**slot) if slot else 0.0  # upper edge of the bucket: a bound, not a guess
    return float(2 ** (len(hist) - 1))


def p50_p99_ns(hist, total: int) -> tuple[float | None, float | None]:
    """percentile_ns at 0.5 and 0.99, from one cumulative sum of the histogram (per function and
    refresh: accumulate and bisect run in C)."""
    if not total:
        return None, None
    run = list(itertools.accumulate(hist))
    last = len(hist) - 1
    s50 = min(bisect.bisect_left(run, 0.5 * total), last)
    s99 = min(bisect.bisect_left(run, 0.99 * total), last)
    return (float(2**s50) if s50 else 0.0), (float(2**s99) if s99 else 0.0)


def _row_deltas(now: Mapping[int, RawStats], then: Mapping[int, RawStats], ids) -> dict[int, RawStats]:
    """What each traced function's row gained from `then` to `now` (cumulative rows), where it did.
    Most rows of a process do not change between two reads (functions called at start-up only,
    every function between windows): the program hands back the same object for a row whose bytes
    did not change."""
    out = {}
    for f, st in now.items():
        p = then.get(f)
        if st is p or f not in ids:
            continue
        d = st if p is None else st - p
        if d.calls or d.timed or d.closed or d.outside:
            out[f] = d
    return out


# summary()'s sums: the windows' count, the sum of their weights and of their squares; per function
# called, sums of w*r and w^2*calls/effective^2, the last window's rate r, and the sum of squared
# differences of r between successive windows. Every window counts for every function: one it did
# not probe had never been seen called, so it stands for no calls there (see summary()).
_Weighted = tuple[list[float], dict[int, float], dict[int, float], dict[int, float], dict[int, float]]


def _add_window(sums: _Weighted, window: list) -> None:
    """Adds one window ([effective, {f: calls}, weight]) to `sums`."""
    n, wr, w2c, last, ssd = sums
    effective, calls, w = window
    first = n[0] == 0
    n[0], n[1], n[2] = n[0] + 1, n[1] + w, n[2] + w * w
    rates = {f: c / effective for f, c in calls.items()} if effective > 0 else {}
    for f, r in rates.items():
        wr[f] = wr.get(f, 0.0) + w * r
        w2c[f] = w2c.get(f, 0.0) + w * w * calls[f] / (effective * effective)
    if not first:
        for f in rates.keys() | last.keys():
            d = rates.get(f, 0.0) - last.get(f, 0.0)
            ssd[f] = ssd.get(f, 0.0) + d * d
    last.clear()
    last.update(rates)


class Tracee:
    def __init__(self, pid: int, probes: Probes, *, budget: float, interval_s: float, exact: bool,
                 prev: Mapping[int, RawStats] | None = None, own_marker: bool = True) -> None:
        self.pid = pid
        # A Session attaches a marker for its one process; a HostSession shares one among all its
        # processes (one link without a pid filter: a probe with a consumer per process would run
        # every process's handler on each hit) and tells each Tracee with set_marker.
        self.own_marker = own_marker
        self.probes = probes
        self.ids, self.costs, self.calibration = probes.ids, probes.costs, probes.calibration
        self.budget, self.exact = budget, exact
        self.policy = Policy(probes.classes, probes.costs, budget=budget, interval_s=interval_s)
        self.comm = process_comm(pid)
        # The maps may already hold counts of this pid (a reused program, a process hit before it
        # was found): start from them.
        self._prev: dict[int, RawStats] = dict(prev or {})
        self._total: dict[int, RawStats] = {}     # per function, over every window
        # summary() weighs each window's rates by the span it stands for (its interval, and the
        # windowless ones after it, which it was sized for), not by its length: see summary().
        # Per function called: sums of w*r and w^2*calls/effective^2 (the Poisson variance of w*r),
        # and of the rates' successive differences; the last window's are added once the next
        # comes, its weight known.
        self._sums: _Weighted = ([0, 0.0, 0.0], {}, {}, {}, {})
        self._last_window: list | None = None     # [effective, {f: calls}, weight]
        self._unwindowed_s = 0.0  # span of intervals before the first window
        self._window_s = 0.0
        self._effective_s = 0.0
        # The marker: one function probed all the time, whose rate between windows against its rate
        # in them measures how much the windows slow the target (see perturbation).
        self.marker: int | None = None
        self.marker_link: links.Link | None = None
        self._marker_in = [0, 0.0]               # calls, seconds: inside windows
        self._marker_out = [0, 0.0]              # calls, seconds: between windows
        self._cpu_mark: float | None = None
        self._cpu = CpuClock(pid)
        self._steps = 0
        self.comm_every = 1  # read /proc/PID/comm every that many intervals (it changes only on exec)
        # (CPU s, span s) of recent intervals: /proc counts CPU time in clock ticks (10 ms), so a
        # job using 1% of a CPU shows 0 or 10 ms in any one second; the budget wants its rate.
        self._cpu_recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=5)
        # The last intervals' (span, window, CPU, effective time, {f: calls} in the window), for
        # recent(): one short window per interval is too noisy a sample to show
        # alone. The rest of what they counted (times, histograms) is the difference of the rows
        # read at their ends: the rows are cumulative, so the rows at the end of each of them are
        # kept (the same dicts account() was handed, not copies).
        self._recent: collections.deque[tuple[float, float, float | None, float, dict[int, int]]] = \
            collections.deque(maxlen=5)
        self._rows_at: collections.deque[Mapping[int, RawStats]] = collections.deque([self._prev], maxlen=6)
        self._recent_snap: ProcessSnapshot | None = None

        self.started = time.monotonic()
        self.elapsed_s = 0.0
        self.target_cpu_s = 0.0
        self.exited = False

    def begin(self) -> None:
        """At the start of an interval: the CPU time the next one is measured from."""
        if self._cpu_mark is None:
            self._cpu_mark = self._cpu.read()

    def _cpu_since_mark(self) -> float | None:
        now = self._cpu.read()
        before, self._cpu_mark = self._cpu_mark, now
        return now - before if now is not None and before is not None else None

    # --- the marker --------------------------------------------------------------------------
    def choose_marker(self, cpu_s_per_s: float | None) -> None:
        m = self.policy.choose_marker(cpu_s_per_s)
        if m is None:
            return
        try:
            self.marker_link = self.probes.attach_marker(m, self.pid)
        except NoSuchProcess:
            self.exited = True
            self.policy.reserved_s_per_s = 0.0
            return
        self.marker = m

    def drop_marker(self) -> None:
        if self.marker_link is not None:
            self.marker_link.close()
        self.marker_link = None
        self.set_marker(None)

    def set_marker(self, f: int | None) -> None:
        """The function whose probe between windows measures this process's slowdown (None: none);
        its counts so far are dropped."""
        self.marker = f
        self._marker_in, self._marker_out = [0, 0.0], [0, 0.0]
        if f is None:
            self.policy.reserved_s_per_s = 0.0

    def perturbation(self) -> tuple[float, float] | None:
        """(in-window rate / between-window rate of the marker, its 95% relative half-width), once
        both counts are large enough to mean something; None before that."""
        (ni, ti), (no, to) = self._marker_in, self._marker_out
        if ni < 30 or no < 30 or ti <= 0 or to <= 0:
            return None
        ratio = (ni / ti) / (no / to)
        return min(max(ratio, 0.1), 1.5), 1.96 * math.sqrt(1 / ni + 1 / no)

    # --- one interval ------------------------------------------------------------------------
    def account(self, span: float, window: float, now: Mapping[int, RawStats] | None, outside_s: float,
                *, snapshot: bool = True) -> ProcessSnapshot | None:
        """Takes in this process's rows of the maps, read after an interval of `span` seconds whose
        window counted `window` of them (kept as they are: the caller hands over a mapping it no
        longer changes; None: the maps were not read, since no probe was attached to count
        anything); updates its policy and marker; returns the interval's snapshot (None without
        `snapshot`: a caller that shows recent() or summary() instead)."""
        self._steps += 1
        if self._steps % self.comm_every == 1 or self.comm_every == 1:
            comm = process_comm(self.pid)
            if comm != "?":  # a held command has exec'd since: show its name, not ours
                self.comm = comm
        cpu = self._cpu_since_mark()
        if cpu is not None:
            self.target_cpu_s += cpu
        self.elapsed_s += span
        deltas: dict[int, RawStats] = {}
        if now is not None:
            prev, self._prev = self._prev, now
            deltas = _row_deltas(now, prev, self.ids)
        if self.marker is not None and window > 0:
            d = deltas.get(self.marker, ZERO)
            self._marker_in[0] += d.calls
            self._marker_in[1] += window
            self._marker_out[0] += d.outside
            self._marker_out[1] += outside_s
        effective = self._effective(window, deltas)
        if cpu is not None and span > 0:
            self._cpu_recent.append((cpu, span))
        spans = sum(s for _, s in self._cpu_recent)
        # No tick in the recent intervals means less than one tick's worth, not nothing: half a tick
        # (taking it for zero would afford no window at all).
        cpu_rate = max(sum(c for c, _ in self._cpu_recent), 0.5 / _CLK_TCK) / spans if spans > 0 else None
        self.policy.observe(effective, {f: d.calls for f, d in deltas.items()}, cpu_rate)
        if self.own_marker:
            if self.marker is not None and cpu_rate and \
                    self.policy.marker_cost(self.marker) > self.budget * cpu_rate / 2:
                self.drop_marker()  # the job got lighter, or its calls denser: the marker now costs too much
            if self.marker is None and not self.exact and not self.exited and window > 0:
                self.choose_marker(cpu_rate)
        measured = self.perturbation()
        if measured is not None:
            self.policy.measured_loss = max(0.0, 1.0 - measured[0])
        if window <= 0:
            if self._last_window is not None:
                self._last_window[2] += span
            else:
                self._unwindowed_s += span
        called: dict[int, int] = {}
        if window > 0:
            self._window_s += window
            self._effective_s += effective
            for f, d in deltas.items():
                self._total[f] = self._total.get(f, ZERO) + d
            if self._last_window is not None:
                _add_window(self._sums, self._last_window)
            probed = self.probes.probed
            called = {f: d.calls for f, d in deltas.items() if f in probed and d.calls}
            self._last_window = [effective, called, span + self._unwindowed_s]
            self._unwindowed_s = 0.0
        self._recent.append((span, window, cpu, effective, called))
        self._rows_at.append(self._prev)
        if not snapshot:
            return None
        continuous = window >= span * 0.999
        m = self.perturbation()
        errs = {f: self._rate_err(d.calls, window, effective, 0.0 if continuous else None, m) for f, d in deltas.items()}
        return self._snapshot(span, window, effective, cpu, deltas, errs)

    def close(self) -> None:
        if self.marker_link is not None:
            self.marker_link.close()
            self.marker_link = None
        self._cpu.close()

    # --- snapshots ---------------------------------------------------------------------------
    def _cost_s(self, stats: Mapping[int, RawStats]) -> float:
        """Probe time the tracer added to the target for these hits (calibrated, per function)."""
        ns = 0.0
        for f, d in stats.items():
            c = self.costs[f]
            ns += (d.calls + d.closed + d.outside) * c.entry_ns + d.timed * (c.entry_return_ns - c.entry_ns)
        return ns * 1e-9

    def _counted_cost_s(self, stats: Mapping[int, RawStats]) -> float:
        ns = 0.0
        for f, d in stats.items():  # _cost_s without the closed and outside hits
            c = self.costs[f]
            ns += d.calls * c.entry_ns + d.timed * (c.entry_return_ns - c.entry_ns)
        return ns * 1e-9

    def _effective(self, window_s: float, stats: Mapping[int, RawStats]) -> float:
        """The time the target would have needed, untraced, for what it did in the window.

        Probes slow the traced thread while attached, so calls/window understates the untraced rate
        (by 17% for a launch-bound PyTorch loop on a GPU host, by far more on a virtual machine). Once
        the marker has counted enough, the window is scaled by the slowdown it measured; until then,
        the calibrated probe time is taken out of the window, assuming it was not hidden in waits.
        """
        if window_s <= 0:
            return 0.0
        measured = self.perturbation()
        if measured is not None:
            return window_s * measured[0]
        return max(window_s - self._counted_cost_s(stats), 0.1 * window_s)

    _UNSET = object()

    def _rate_err(self, calls: int, window_s: float, effective_s: float, statistical: float | None,
                  measured=_UNSET) -> float:
        """95% half-width of calls/effective_s: the count's Poisson term (unless given), plus what an
        error in the calibrated probe cost does to the probe time taken out of the window.
        `measured`: perturbation(), when the caller has it already (one per snapshot, not per function)."""
        if effective_s <= 0:
            return 0.0
        if statistical is None:
            statistical = 1.96 * math.sqrt(calls) / effective_s
        if measured is Tracee._UNSET:
            measured = self.perturbation()
        if measured is not None:
            return statistical + calls / effective_s * measured[1]
        spread = max(self.calibration.emulated.rel_spread, self.calibration.stepped.rel_spread)
        systematic = calls / effective_s * (window_s - effective_s) / effective_s * spread
        return statistical + systematic

    def _means(self, f: int, d: RawStats) -> tuple[float | None, float | None]:
        """Per-call time of all timed calls and of the outermost ones, probe bias subtracted."""
        bias = self.costs[f].bias_ns
        outer = d.timed - d.nested
        return (max(0.0, d.total_ns / d.timed - bias) if d.timed else None,
                max(0.0, d.outer_ns / outer - bias) if outer > 0 else None)

    def _function_stats(self, f: int, d: RawStats, effective_s: float, span_s: float, err: float) -> FunctionStats:
        fn = self.ids[f]
        rate = d.calls / effective_s if effective_s > 0 else 0.0
        mean_ns, outer_mean_ns = self._means(f, d)
        if outer_mean_ns is None:
            total = self._total.get(f)
            if total and total.timed:
                # Counted but not timed in this window: per-call time from the session so far.
                mean_ns, outer_mean_ns = self._means(f, total)
        # sum(hist), not d.timed: the two counters are bumped apart, a read may fall between.
        p50, p99 = p50_p99_ns(d.hist, sum(d.hist))
        return FunctionStats(
            name=fn.name,
            cls=fn.cls,
            calls_observed=d.calls,
            calls_estimated=rate * span_s,
            rate_hz=rate,
            rate_err_hz=err,
            timed_calls=d.timed,
            mean_ns=mean_ns,
            outer_mean_ns=outer_mean_ns,
            p50_ns=p50,
            p99_ns=p99,
            hist=d.hist,
        )

    def _snapshot(self, span_s: float, window_s: float, effective_s: float | dict[int, float], cpu_s: float | None,
                  stats: Mapping[int, RawStats], errs: Mapping[int, float]) -> ProcessSnapshot:
        """`effective_s`: the untraced-equivalent time the counts were taken over, one for all
        functions (an interval) or per function (a session, where not all were probed every window)."""
        funcs = []
        for f, d in stats.items():
            if not d.calls and not d.timed:
                continue  # hit only while counting was closed: a cost, not a rate
            eff = effective_s.get(f, 0.0) if isinstance(effective_s, dict) else effective_s
            funcs.append(self._function_stats(f, d, eff, span_s, errs.get(f, 0.0)))
        funcs.sort(key=lambda s: (-s.rate_hz, s.name))
        rate = dict.fromkeys(CLASS_ORDER, 0.0)
        busy = dict.fromkeys(CLASS_ORDER, 0.0)
        for fs in funcs:
            rate[fs.cls] += fs.rate_hz
            busy[fs.cls] += fs.cpu_s_per_s
        totals = [ClassTotals(cls, rate[cls], busy[cls]) for cls in CLASS_ORDER]
        wait = busy[FunctionClass.SYNC]
        driver = sum(t for cls, t in busy.items() if cls is not FunctionClass.SYNC)
        return ProcessSnapshot(
            pid=self.pid, comm=self.comm, interval_s=span_s, window_s=window_s, target_cpu_s=cpu_s,
            functions=tuple(funcs), tracer_cost_s=self._cost_s(stats),
            driver_cpu_s_per_s=driver, wait_s_per_s=wait, classes=tuple(totals),
        )

    def _weighted(self) -> _Weighted:
        """The windows' weighted sums, the last window's included (copies, when there is one)."""
        if self._last_window is None:
            return self._sums
        sums = (list(self._sums[0]), *(dict(d) for d in self._sums[1:]))
        _add_window(sums, self._last_window)
        return sums

    def recent(self, rebuild: bool = True) -> ProcessSnapshot:
        """The last few intervals (up to 5) as one snapshot: what a live view shows each refresh.
        Without `rebuild`, the one built last, if any (per process and second, building it is most
        of what host-wide tracing costs in Python)."""
        if not rebuild and self._recent_snap is not None:
            return self._recent_snap
        self._recent_snap = self._build_recent()
        return self._recent_snap

    def _build_recent(self) -> ProcessSnapshot:
        span = sum(r[0] for r in self._recent)
        window = sum(r[1] for r in self._recent)
        cpus = [r[2] for r in self._recent]
        cpu = sum(cpus) if None not in cpus else None
        # The rows now less the rows when the oldest of these intervals began: one subtraction a
        # function per rebuild, rather than running sums updated every interval.
        totals = _row_deltas(self._rows_at[-1], self._rows_at[0], self.ids)
        # Rates as summary() weighs them: each window's by the span it stands for (its interval and
        # the windowless ones after it, here), a function it did not probe as not called there.
        windows: list[list] = []  # [weight, {f: calls}, effective]
        for r in self._recent:
            if r[1] > 0 and r[3] > 0:
                windows.append([r[0], r[4], r[3]])
            elif windows:
                windows[-1][0] += r[0]
        sw = sum(w for w, _, _ in windows)
        wr: dict[int, float] = {}
        for w, called, e in windows:
            for f, c in called.items():
                wr[f] = wr.get(f, 0.0) + w * c / e
        effective = sum(r[3] for r in self._recent)
        eff = {}
        for f, d in totals.items():
            rate = wr.get(f, 0.0) / sw if sw > 0 else 0.0
            # The time these calls take at that rate, for _snapshot's calls / effective (a function
            # hit only while counting was closed has no rate: any time gives it 0).
            eff[f] = d.calls / rate if rate > 0 else effective
        m = self.perturbation()
        errs = {f: self._rate_err(d.calls, window, eff[f], None, m) for f, d in totals.items()}
        return self._snapshot(span, window, eff, cpu, totals, errs)

    def summary(self) -> ProcessSnapshot:
        """The whole session as one snapshot: rates over all windows, with their uncertainty.

        A function's rate is the mean of its per-window rates, each weighted by the span its window
        stands for (its interval and the windowless ones after it): the session's calls over the
        session's time. Pooling the counts over the windows' total length instead would weigh each
        window by its length, and the budget makes windows long where calls are few and short where
        they are many: a job traced from its start (a second of import and setup in 1 s windows,
        then a loop of 300k calls/s in 40 ms ones) would read a third of its rate.

        The uncertainty is the larger of the counts' Poisson half-width and what the windows' rates
        vary by from one to the next (a bursty job varies more between windows than counts do). From
        one to the next, not around their mean: every interval has its window (or shares one), so a
        change of phase (setup, then a loop) is measured, not sampled, and counts once, not in
        every window's distance from a mean between the two phases."""
        (k, sw, sw2), sum_wr, sum_w2c, _, ssd = self._weighted()
        # Every window counts for every function: one a window did not probe had never been seen
        # called (only those are left out, and once seen a function is probed in every window), so
        # it stands for no calls there. Averaging over the windows that probed it alone would lift
        # the rate of a function first called after a phase of setup to its loop's.
        n = sw * sw / sw2 if sw2 > 0 else 0.0  # the windows' effective number
        errs, eff_of = {}, {}
        # The systematic part of a rate's uncertainty (probe time, or the measured slowdown) is
        # relative to the rate: the same share for every function.
        relative = self._rate_err(1, self._window_s, self._effective_s, 0.0) * self._effective_s \
            if self._effective_s > 0 else 0.0
        for f, d in self._total.items():
            rate = sum_wr.get(f, 0.0) / sw if sw > 0 else 0.0
            # The time these calls would take at that rate, for _snapshot's calls / effective (a
            # function hit only while counting was closed has no rate: any time gives it 0).
            eff_of[f] = d.calls / rate if rate > 0 else self._effective_s
            statistical = 0.0
            if not self.exact and sw > 0:
                statistical = 1.96 * math.sqrt(sum_w2c.get(f, 0.0)) / sw
                if k >= 3 and n > 1:
                    var = ssd.get(f, 0.0) / (2 * (k - 1))  # successive differences: the windows' own noise
                    statistical = max(statistical, 1.96 * math.sqrt(var / n))
            errs[f] = statistical + rate * relative
        return self._snapshot(self.elapsed_s, self._window_s, eff_of, self.target_cpu_s or None,
                              dict(self._total), errs)
