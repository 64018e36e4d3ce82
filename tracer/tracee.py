"""One traced process's accounting over the windows of a Probes: its budget policy, the diff of its
rows in the shared maps, what each interval measured (tracer/estimator.py's Observations), and the
snapshots built from them: one interval, the last few, or the whole session.

A Session (one process) and a HostSession (every process on one libcuda file) both keep one Tracee
per process, and step it through the same loop (tracer/loop.py): `begin` at an interval's start,
`scouted` after the first window, `account` at its end, then `recent` or `summary`.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import itertools
import math
import os
import time
from pathlib import Path
from typing import Mapping, Sequence

import orjson

from gputrace.base.procs import alive, comm

from . import estimator as est
from .bpfprog import ZERO, RawStats
from .budget import WRITE_S, Policy
from .classify import CLASS_ORDER, FunctionClass, waiting_ids, waits
from .model import ClassTotals, FunctionStats, ProcessSnapshot, implausible, unknown_reason
from .probes import IntervalLog, Probes
from .threads import rows_since

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



# What a probe's calibrated time is taken to cost the job until the marker has measured it: about
# what it was on the H200 in a launch-bound PyTorch loop (bench/results/tracer-costs-h200.md).
EXPOSURE_ASSUMED = 2.0
RECENT = 5  # intervals a live row pools
MIN_ZERO_WINDOW_S = 0.01  # less probing than this with no call seen: not measured, not 0 calls/s


def row_deltas(now: Mapping[int, RawStats], then: Mapping[int, RawStats], ids) -> dict[int, RawStats]:
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
        if d.calls or d.timed or d.closed or d.outside or d.watched:
            out[f] = d
    return out


class Tracee:
    def __init__(self, pid: int, probes: Probes, *, budget: float, interval_s: float, exact: bool,
                 prev: Mapping[int, RawStats] | None = None, keep: bool = True, keep_cheap: bool = True,
                 rows_t: float | None = None) -> None:
        self.pid = pid
        # When the rows counted from (`prev`) were read: an interval's span runs from the last
        # interval's rows to its own (the time between intervals is in it: the watch link counts on).
        self.rows_t = time.monotonic() if rows_t is None else rows_t
        self.probes = probes
        self.ids, self.costs, self.calibration = probes.ids, probes.costs, probes.calibration
        waiting = waiting_ids(self.ids)
        self.traces_waits = bool(waiting)  # else (--functions) the wait is not measured
        self.budget, self.exact = budget, exact
        # keep_cheap: the cheapest functions counted every call on the watch link (Policy.kept);
        # not host-wide, where one set of links serves every process.
        self.policy = Policy(probes.classes, probes.costs, budget=budget, interval_s=interval_s, waiting=waiting,
                             step_windows=keep_cheap, **({} if keep_cheap else {"keep_share": 0.0}))
        # Kept functions that are never the step: found irregular (the probes), or called from
        # other threads than the windows' calls (`_apart`): one set.
        self.policy.irregular = probes.irregular
        self.comm = comm(pid)
        # The maps may already hold counts of this pid (a reused program, a process hit before it
        # was found): start from them.
        self._prev: dict[int, RawStats] = dict(prev or {})
        self._first: dict[int, RawStats] = self._prev  # the rows the session counts from
        # Every interval's observation, for summary(); a live view that only shows recent() keeps
        # none (`keep` False: top runs for days, and would hold them all).
        self.keep = keep
        self.observations: list[est.Observation] = []
        self._pool = est.MarkerPools()
        self._expo: est.Exposures | None = None
        self._carry: dict[int, est.Carried] = {}  # the last windows' rates, for recent()
        # The last intervals: (observation, cost, CPU s or None, carry before it), and the rows at
        # the end of each and at the start of the oldest: what they gained is one difference.
        self._recent: collections.deque = collections.deque(maxlen=RECENT)
        self._rows_at: collections.deque = collections.deque([self._prev], maxlen=RECENT + 1)
        self._recent_snap: ProcessSnapshot | None = None
        self._tstats: Mapping[tuple[int, int], tuple[int, int, int]] = {}  # per-thread counts at the last read
        self._cpu_mark: float | None = None
        self._cpu = CpuClock(pid)
        self._steps = 0
        self.comm_every = 1  # read /proc/PID/comm every that many intervals (it changes only on exec)
        self.started = time.monotonic()
        self.elapsed_s = 0.0
        self.target_cpu_s = 0.0
        self._cpu_known = True
        self.cost_s = 0.0
        self.window_s = 0.0
        self.exited = False

    def begin(self) -> None:
        """At the start of an interval: the CPU time the next one is measured from."""
        if self._cpu_mark is None:
            self._cpu_mark = self._cpu.read()

    @property
    def intervals(self) -> int:
        """Intervals accounted so far."""
        return self._steps

    def scouted(self, rows: Mapping[int, RawStats], counted_s: float) -> None:
        """The rows read after the session's first window, which probed every function: each one
        it saw called goes into the windows (the policy sees it, at its rate in that window)."""
        prev = self._prev
        for f, st in rows.items():
            p = prev.get(f)
            n = st.calls - (p.calls if p is not None else 0)
            if n > 0 and counted_s > 0:
                self.policy.see(f, n / counted_s)

    def _cpu_since_mark(self) -> float | None:
        now = self._cpu.read()
        before, self._cpu_mark = self._cpu_mark, now
        return now - before if now is not None and before is not None else None

    def exposure(self) -> est.Exposures:
        """The exposures measured so far (worked out again only when a window has added to them)."""
        if self._expo is None:
            self._expo = self._pool.exposures()
        return self._expo

    # --- costs --------------------------------------------------------------------------------
    def _probe_s(self, deltas: Mapping[int, RawStats], *, window_only: bool, stepped: bool = False) -> float:
        """Calibrated probe time of these hits: the window's (calls, timed), or all of them; with
        `stepped`, only those of functions whose first instruction is single-stepped."""
        ns = 0.0
        kinds = self.probes.kinds if stepped else None
        for f, d in deltas.items():
            if kinds is not None and kinds.get(f) != "stepped":
                continue
            c = self.costs[f]
            hits = d.calls if window_only else d.calls + d.closed + d.outside + d.watched
            ns += hits * c.entry_ns + d.timed * (c.entry_return_ns - c.entry_ns)
        return ns * 1e-9

    @staticmethod
    def _exposure_for_cost(expo: est.Exposure) -> float:
        return expo.value if expo.measured else EXPOSURE_ASSUMED

    # --- one interval ------------------------------------------------------------------------
    def account(self, span: float, log: IntervalLog, window_rows: Sequence[Mapping[int, RawStats]],
                end_rows: Mapping[int, RawStats] | None, *, snapshot: bool = True) -> ProcessSnapshot | None:
        """Takes in an interval of `span` seconds (from `rows_t`, when the rows it counts from were
        read, to when `end_rows` were): what the probes did (`log`), this process's rows
        read after each of its windows (`window_rows`, one per window in the log) and at its end
        (`end_rows`; None: not read, nothing could have changed them). Updates the policy; returns
        the interval's snapshot (None without `snapshot`: a caller that shows recent() or summary())."""
        self._steps += 1
        if self.comm_every == 1 or self._steps % self.comm_every == 1:
            name = comm(self.pid)
            if name != "?":  # a held command has exec'd since: show its name, not ours
                self.comm = name
        cpu = self._cpu_since_mark()
        if cpu is None:
            self._cpu_known = False
        else:
            self.target_cpu_s += cpu
        self.elapsed_s += span
        self.rows_t += span
        windows: list[est.Window] = []
        start = prev = self._prev
        for ws, rows in zip(log.windows, window_rows):
            d = row_deltas(rows, prev, self.ids)
            prev = rows
            if self.exact or ws.counted_s <= 0:
                continue
            marker = None
            if ws.marker is not None:
                m = d.get(ws.marker, ZERO)
                marker = est.MarkerCount(m.calls, ws.counted_s, m.outside, ws.outside_s,
                                         m.outside * self.costs[ws.marker].entry_ns * 1e-9, ws.marker)
            w = est.Window(ws.counted_s, ws.probed, {f: x.calls for f, x in d.items() if x.calls},
                           self._probe_s(d, window_only=True), marker, timed=ws.timed >= ws.probed,
                           stepped_s=self._probe_s(d, window_only=True, stepped=True),
                           step_func=ws.step_func if ws.steps else None, steps=ws.steps,
                           kept_in={f: x.kept_open for f, x in d.items() if x.kept_open})
            windows.append(w)
        probed_windows = list(windows)  # (the discovery windows below measure no exposure)
        for f, dt, n in log.discovered.get(self.pid, ()):
            # The watch link's last calls of a function before it moved into the windows: a window
            # of its own (only it, and the other watched ones that cost nothing, probed).
            cost = n * self.costs[f].entry_ns * 1e-9
            w = est.Window(dt, frozenset({f}), {f: n}, cost,
                           stepped_s=cost if self.probes.kinds.get(f) == "stepped" else 0.0, discovery=True)
            windows.append(w)
        if end_rows is not None:
            prev = end_rows
        self._prev = prev  # the caller hands over rows it no longer changes
        gained = row_deltas(prev, start, self.ids)
        apart = frozenset() if self.exact else self._apart(windows)
        # A kept function called from other threads than the windows' calls keeps its own pace
        # in the windows: no step of the job either (the probes' and the policy's shared set).
        self.probes.irregular.update(apart)
        for w in windows:
            if w.steps and w.step_func is not None and w.step_func not in apart:
                # Its steps against the step function's count over the interval (exact: it is kept).
                g = gained.get(w.step_func)
                hz = None if g is None or not g.watched else \
                    est.rate_on_link(g.watched, span, log.unwatched_s.get(w.step_func, 0.0))
                self._pool.add(w, hz)
                self._expo = None
                if not self.exact:
                    self.policy.observe_step(w.step_func, w.counted_s / w.steps)
        self.window_s += log.counted_s
        if self.exact:
            obs = est.Observation(span, (), {f: d.calls for f, d in gained.items() if d.calls}, {})
        else:
            obs = est.Observation(span, tuple(windows), {f: d.watched for f, d in gained.items() if d.watched},
                                  dict(log.unwatched_s), apart)
        kept = est.kept_rates(obs)
        for w in probed_windows:
            if not w.steps:
                # A window read against a kept function measures the exposure against it (its pace
                # there against the interval's outside the windows), in place of its marker's span.
                m = est.kept_marker(w, obs, kept)
                if m is None and w.marker is not None and w.marker.func in apart:
                    w = dataclasses.replace(w, marker=None)  # another thread's pace: no exposure from it
                self._pool.add(w if m is None else dataclasses.replace(w, marker=m))
                self._expo = None
        expo = self.exposure()
        kappa = self._exposure_for_cost(expo.counted if expo.counted.measured else expo.timed)
        unplanned = kappa * sum(
            (d.closed + d.watched) * self.costs[f].entry_ns * 1e-9 for f, d in gained.items())
        cost = kappa * self._probe_s(gained, window_only=False) + log.writes * WRITE_S
        self.cost_s += cost
        carry_before = dict(self._carry)
        if self.keep or not self.observations:
            self.observations.append(obs)  # the first one always: it says whether it was the first
        self._recent.append((obs, cost, cpu, carry_before))
        self._rows_at.append(prev)
        if windows:
            self._carry.update(est.last_rates([obs], expo))
        if not self.exact:
            # The windows' own rates (untraced), for the next plan: not the estimate's whole work.
            rates: dict[int, list[float]] = {}
            low: dict[int, list[float]] = {}
            steps_hz, refs = est.step_rates([obs]), est.reference_rates(obs)
            for w in windows:
                eff = est.window_time(w, expo, steps_hz, refs)[0]
                for f in w.probed:
                    rates.setdefault(f, []).append(w.calls.get(f, 0) / eff)
                    low.setdefault(f, []).append(w.calls.get(f, 0) / w.counted_s)
            if self.policy.kept and span > 0:
                # (Every kept function: one not called this interval has no row of gains, and its
                # last rate stood, a burst of set-up calls taken for a job's step for the whole attach.)
                self.policy.observe_kept({f: (gained[f].watched if f in gained else 0) / span for f in self.policy.kept})
            self.policy.observe(len(windows), {f: sum(r) / len(r) for f, r in rates.items()},
                                {f: n for w in windows for f, n in w.calls.items()},
                                {f: sum(r) / len(r) for f, r in low.items()})
            # Which have a per-call time yet: the rare window times those that have none.
            self.policy.untimed = frozenset(f for f in self.policy.seen
                                            if not ((t := self._since_start(f)) and t.timed))
            # Each kind of window planned at its own exposure's upper end; a kind not measured yet
            # at the most that is known (the calibration's error is alike for both, if not equal).
            known = [e.value + e.err for e in (expo.counted, expo.timed) if e.measured]
            most = min(est.EXPOSURE_MAX, max(known)) if known else None
            self.policy.observe_exposure(*((e.value + e.err) if e.measured else most
                                           for e in (expo.counted, expo.timed)))
            self.policy.observe_extra(unplanned)
        if not snapshot:
            return None
        # Functions no window of this interval probed (left to a rare window of a later one) stand
        # at the rate their last windows measured, as in the whole attach's estimate.
        return self._snapshot([obs], gained, span, log.counted_s, cpu, cost, carry_before, view="interval")

    def close(self) -> None:
        self._cpu.close()

    # --- snapshots ---------------------------------------------------------------------------
    def _means(self, f: int, d: RawStats) -> tuple[float | None, float | None]:
        """Per-call time of all timed calls and of the outermost ones, probe bias subtracted."""
        bias = self.costs[f].bias_ns
        outer = d.timed - d.nested
        return (max(0.0, d.total_ns / d.timed - bias) if d.timed else None,
                max(0.0, d.outer_ns / outer - bias) if outer > 0 else None)

    def _since_start(self, f: int) -> RawStats | None:
        """Function f's row gained over the session."""
        now, then = self._prev.get(f), self._first.get(f)
        return None if now is None else now if then is None else now - then

    def _apart(self, windows: Sequence[est.Window]) -> frozenset[int]:
        """(An interval whose windows have a reference: a marker, a kept function's calls) The
        functions called from other threads than the windows' calls since the last such read
        (`est.apart`); none where the program's per-thread counts cannot be read."""
        if not any(w.kept_in or w.marker is not None for w in windows):
            return frozenset()
        prog = getattr(self.probes, "program", None)
        read = getattr(prog, "thread_stats_now", None) or getattr(prog, "read_thread_stats_by_tgid", None)
        if read is None:
            return frozenset()
        try:
            rows = read().get(self.pid, {})
        except OSError:
            return frozenset()
        since, self._tstats = rows_since(rows, self._tstats), rows
        return est.apart(since)

    def _threads(self) -> int | None:
        """The process's threads now (None: gone, or not readable): no more can be inside calls."""
        try:
            return len(os.listdir(f"/proc/{self.pid}/task")) or None
        except OSError:
            return None

    def _calling_threads(self) -> int | None:
        """How many of the process's live threads have made a timed driver call (None: not known)."""
        prog = getattr(self.probes, "program", None)
        if prog is None or not hasattr(prog, "thread_ids"):
            return None
        try:
            tasks = {int(t) for t in os.listdir(f"/proc/{self.pid}/task")}
            n = len(tasks & prog.thread_ids())
        except (OSError, ValueError):
            return None
        return n or None

    def _not_measured(self, obs: Sequence[est.Observation], carry: Mapping, view: str) -> str | None:
        # No call seen in a few ms of windows and nothing on the watch link says next to nothing: a
        # job of 100k calls/s can show none in 0.1 ms (a process that exited just after the probes
        # were attached). Not measured, rather than 0 calls/s.
        probed_s = sum(w.counted_s for o in obs for w in o.windows)
        watched_s = sum(o.span_s - max(o.unwatched_s.values(), default=0.0) for o in obs)
        seen = any(w.calls for o in obs for w in o.windows) or any(o.watched_calls for o in obs)
        if not seen and (not carry or view == "interval") and probed_s < MIN_ZERO_WINDOW_S and watched_s < MIN_ZERO_WINDOW_S:
            return (f"no call seen in {probed_s * 1e3:.1f} ms of probing, too short to tell"
                    + (" (the process exited)" if not alive(self.pid) else ""))
        for o in obs:
            if o.windows or not o.unwatched_s:  # a window, or every function on the watch link (exact: counted)
                return None
        if carry and view != "interval":
            return None
        if not self.observations or self.observations[0] is obs[0] and not carry:
            return "not measured yet: no window has probed this process"
        return "no window in this interval (the budget spaces windows out)"

    def _snapshot(self, obs: Sequence[est.Observation], gained: Mapping[int, RawStats], span_s: float,
                  window_s: float, cpu_s: float | None, cost_s: float, carry: Mapping, view: str) -> ProcessSnapshot:
        expo = self.exposure()
        reason = self._not_measured(obs, carry, view) if obs else "not measured yet"
        funcs: list[FunctionStats] = []
        tasks = None
        if reason is None:
            estimates = est.estimate(obs, expo, carry)
            tasks = self._threads()
            for f, e in estimates.items():
                d = gained.get(f, ZERO)
                fn = self.ids[f]
                mean_ns, outer_mean_ns = self._means(f, d)
                if outer_mean_ns is None:
                    total = self._since_start(f)
                    if total and total.timed:
                        # Counted but not timed here: per-call time from the session so far.
                        mean_ns, outer_mean_ns = self._means(f, total)
                p50, p99 = p50_p99_ns(d.hist, sum(d.hist))  # sum(hist), not d.timed: bumped apart
                # Bias-corrected like the mean: the histogram holds times with the probes' own bias in
                # them, so a bucket's upper edge less the bias bounds the call's own time.
                bias = self.costs[f].bias_ns
                p50, p99 = (None if p is None else max(0.0, p - bias) for p in (p50, p99))
                err = e.err_hz if math.isfinite(e.err_hz) else None
                funcs.append(FunctionStats(
                    name=fn.name, cls=fn.cls, calls_observed=e.calls_observed, calls_estimated=e.calls_estimated,
                    rate_hz=e.rate_hz, rate_err_hz=err,
                    timed_calls=d.timed, mean_ns=mean_ns, outer_mean_ns=outer_mean_ns, p50_ns=p50, p99_ns=p99,
                    hist=d.hist, not_known=unknown_reason(e.calls_observed, e.rate_hz, err)
                    or implausible(e.rate_hz, mean_ns, tasks)))
            funcs.sort(key=lambda s: (-s.rate_hz, s.name))
        rate = dict.fromkeys(CLASS_ORDER, 0.0)
        busy = dict.fromkeys(CLASS_ORDER, 0.0)
        waiting = 0.0  # time in calls that wait for the GPU (classify.waits), of `busy`'s total
        for fs in funcs:
            rate[fs.cls] += fs.rate_hz
            busy[fs.cls] += fs.cpu_s_per_s
            if waits(fs.name):
                waiting += fs.cpu_s_per_s
        # Time in calls is rate x mean per call, and a function seen a few times an interval (one
        # synchronize a step) makes it noisy: a single thread could read more than 1 s of it a
        # second. No more threads can be inside calls than have made calls: where the sum exceeds
        # that bound, it is brought down to it, each class in proportion.
        in_calls = sum(busy.values())
        if in_calls > 1.0:
            threads = self._calling_threads()
            if threads is not None and in_calls > threads:
                busy = {c: t * threads / in_calls for c, t in busy.items()}
                waiting *= threads / in_calls
        def class_totals(cls: FunctionClass) -> ClassTotals:
            mine = [fs for fs in funcs if fs.cls is cls]
            err = None if any(fs.rate_err_hz is None for fs in mine) else sum(fs.rate_err_hz for fs in mine)
            # (A member's rate that its calls' time rules out rules out the class's sum.)
            bad = next((r for fs in mine if (r := implausible(fs.rate_hz, fs.mean_ns, tasks))), None)
            return ClassTotals(cls, rate[cls], busy[cls], err,
                               unknown_reason(sum(fs.calls_observed for fs in mine), rate[cls], err) or bad)

        totals = tuple(class_totals(cls) for cls in CLASS_ORDER) if reason is None else ()
        measured = reason is None
        # Time in calls is known only where every called function of the kind has been timed: a rate
        # without a per-call time is no evidence of zero time (the first windows count, not time).
        # A synchronous copy's time is wait where it was timed. One never timed (a single copy at
        # the end, counted on the watch link) leaves the driver CPU time unknown and the wait as the
        # synchronization calls' (always timed): what such a copy waited is not in it.
        untimed = {fs.cls is FunctionClass.SYNC for fs in funcs if fs.rate_hz > 0 and fs.outer_mean_ns is None}
        # With --functions leaving out every call that waits, the wait is not measured: not zero.
        wait_known = measured and True not in untimed and self.traces_waits
        return ProcessSnapshot(
            pid=self.pid, comm=self.comm, interval_s=span_s, window_s=window_s, target_cpu_s=cpu_s,
            functions=tuple(funcs), tracer_cost_s=cost_s,
            driver_cpu_s_per_s=sum(busy.values()) - waiting if measured and False not in untimed else None,
            wait_s_per_s=waiting if wait_known else None,
            classes=totals, not_measured=reason,
            exposure=expo.counted.value if expo.counted.measured else expo.timed.value if expo.timed.measured else None,
        )

    def recent(self, rebuild: bool = True) -> ProcessSnapshot:
        """The last few intervals (up to RECENT) as one snapshot: what a live view shows each refresh.
        Without `rebuild`, the one built last, if any (per process and second, building it is most
        of what host-wide tracing costs in Python)."""
        if not rebuild and self._recent_snap is not None:
            return self._recent_snap
        items = list(self._recent)
        gained = row_deltas(self._rows_at[-1], self._rows_at[0], self.ids)
        cpus = [c for _, _, c, _ in items]
        self._recent_snap = self._snapshot(
            [o for o, *_ in items], gained, sum(o.span_s for o, *_ in items),
            sum(sum(w.counted_s for w in o.windows) for o, *_ in items),
            sum(cpus) if cpus and None not in cpus else None, sum(c for _, c, _, _ in items),
            items[0][3] if items else {}, view="recent")
        return self._recent_snap

    def summary(self) -> ProcessSnapshot:
        """The whole session as one snapshot: each function's calls over the session's time (exact
        where it was watched, each window's rate for the time it stands for), with its uncertainty
        (tracer/estimator.py).

        With GPUTRACE_OBSERVATIONS set to a directory, the observations behind it are written
        there as `obs-PID.json` (bench/audit_gpu.py checks estimators against the truth with them)."""
        where = os.environ.get("GPUTRACE_OBSERVATIONS")
        if where and self.keep:
            doc = est.dump_observations(self.observations, self.exposure())
            doc["functions"] = {str(f): fn.name for f, fn in self.ids.items()}
            with contextlib.suppress(OSError):
                Path(where, f"obs-{self.pid}.json").write_bytes(orjson.dumps(doc))
        return self._snapshot(self.observations, row_deltas(self._prev, self._first, self.ids), self.elapsed_s,
                              self.window_s,
                              self.target_cpu_s if self._cpu_known and self.observations else None,
                              self.cost_s, {}, view="summary")
