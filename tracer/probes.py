"""One libcuda file's probes on one program: its functions, the watch link, the links of the current
window, the marker's reference span, and the program's counting state (closed, open, outside).

Three kinds of link:
- the watch link: an entry probe on every function no window probes (those not seen called), kept
  attached; a call to one costs a hit and is counted (exactly: the link is always there), and the
  waits between windows poll one counter (`Program.seen_hits`), so a function called for the first
  time moves into the windows within `POLL_S` (`on_seen`) rather than at a rescan;
- a window's links: entry probes on the functions seen called (return probes too on those timed),
  attached for the window; with few functions, attach and detach write few breakpoints;
- the marker's: one function's entry probe, attached a window's length before the window and kept
  through it, so that its rate in that reference span (counting state "outside") against its
  rate in the window measures what the window's probes cost the job.

Shared by a Session (one process: links filtered to its pid) and a HostSession (every process that
maps the file: links without a pid filter). The counting state is one global per program, so every
process on the links sees the same windows; each process's counts are kept apart by tgid in the
maps and accounted by a Tracee (tracer/tracee.py).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from . import links
from .bpfprog import CLOSED, COOKIE_KEPT, COOKIE_MARKER, COOKIE_STEPPED, COOKIE_TIMED, COOKIE_WATCH, Program
from .calibrate import Calibration, probe_kind
from .estimator import REF_PROBE_MAX
from .symbols import Function

@dataclass
class StepTry:
    """One window planned as whole steps of a kept function: when it was armed (or given up), of
    how many steps at what planned period, probing how many functions, and what came of it: whole
    (counted from call to call), cut short (opened, not closed by its deadline: a window of time),
    never opened, or why it was not armed (a window of time instead); the wait from arming to its
    opening call, its span, and the step function's gaps (count, mean, coefficient of variation)
    as the program had them then."""

    t: float
    step: int | None
    steps: int
    period_s: float
    functions: int
    outcome: str
    wait_s: float | None = None
    span_s: float | None = None
    gaps: int | None = None
    gap_mean_s: float | None = None
    gap_cv: float | None = None


POLL_S = 0.02  # how often the waits look at the watch link's counter
# A step window (Probes._step_window) is looked at every STEP_POLL_S from STEP_SOONEST of its steps
# at the step function's untraced rate on (the job's pace moves by about 0.7-1.4x at this scale on
# the H200), and waited for at most twice its planned length and STEP_SLACK_S more.
STEP_POLL_S = 0.001
STEP_SOONEST = 0.7
STEP_SLACK_S = 0.005
# A step window's links are attached this long (beyond the time attaching takes) before the step
# function's next call is due.
STEP_ARM_LEAD_S = 0.001
# ... and this share of a step early, for the step's own jitter (a training loop's step gaps vary by
# 0.07-0.18 of their mean, in the H200's step logs); a call is looked for up to STEP_FRESH_WAIT steps.
# (The attach is taken at the third quartile of the last few: a miss costs a whole step.)
STEP_JITTER = 0.1
STEP_FRESH_WAIT = 2.5
STEP_FRESH_MAX_S = 0.1
STEP_LOG_MAX = 1000  # step windows' tries kept for the report (an attach may run for hours)
# A step function is regular (Probes.step_regular) where the gaps between its calls vary by at most
# this share of their mean (a training loop's once-a-step copy on the H200: about 0.1-0.3), judged
# once this many gaps are in.
STEP_CV_MAX = 0.5
STEP_GAPS_MIN = 8
# A follow-up window (`Probes.join`) shorter than this is not opened: the discovery span stands.
FOLLOW_MIN_S = 0.001
# The kept functions' hits are held against their limit (`Probes.kept_hz_limit`) over spans of at
# least this: a few calls close together are no sign of a function turning hot.
KEPT_SPAN_S = 0.1
WATCH_SHARDS = 16  # the watch link is this many links, by function id: a change rebuilds one of them


def stamped(flip: Callable[[], None]) -> float:
    """Runs a counting-state change and returns when it took effect: the midpoint of the clock read
    before and after, so that being preempted around the map update (seen on a loaded 2-core VM)
    skews the counted spans both ways rather than one."""
    t0 = time.monotonic()
    flip()
    return (t0 + time.monotonic()) / 2


@dataclass
class WindowSpan:
    """What one window of an interval counted, for the accounting: spans in seconds."""

    counted_s: float
    probed: frozenset[int]
    timed: frozenset[int]
    marker: int | None = None
    outside_s: float = 0.0   # the marker's reference span before it
    t0: float = 0.0          # CLOCK_MONOTONIC: the first link of it attaching (the marker's, if any)
    t1: float = 0.0          # ... the last detached
    # A step window that closed as armed: it counted `steps` whole calls-to-calls of `step_func`
    # (Program.arm); 0: a window of time (armed but cut short, or not a step window).
    step_func: int | None = None
    steps: int = 0


@dataclass
class IntervalLog:
    """What the probes did in one interval."""

    windows: list[WindowSpan] = field(default_factory=list)
    unwatched_s: dict[int, float] = field(default_factory=dict)  # per function: seconds off the watch link
    writes: int = 0          # breakpoints written (attach and detach of window, marker and watch links)
    counted_s: float = 0.0   # the windows' total (exact mode: the interval's)
    # Per process: (function, seconds, calls) the watch link counted of a function just before it
    # moved into the windows: a sample of its rate, until a window has one.
    discovered: dict[int, list[tuple[int, float, int]]] = field(default_factory=dict)
    whole_missed: bool = False  # a planned whole-step window could not be one, and was not run


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
        self.marker_link: links.Link | None = None
        self.watch_links: dict[int, links.Link] = {}  # shard -> its link
        self.watched: frozenset[int] = frozenset()
        self.kept: frozenset[int] = frozenset()  # on the watch link for good: counted, never flagged as new
        self._watch_since = time.monotonic()
        self._seen_mark = 0
        self.opened_at: float | None = None
        self.probed: frozenset[int] = frozenset()
        self.outside_since: float | None = None
        self._outside_mark: int | None = None  # the marker's `outside` count when its span began
        self.log = IntervalLog()
        self.attach_s: list[float] = []
        self.detach_s: list[float] = []
        # Every window planned as whole steps, as it went (`StepTry`; the last STEP_LOG_MAX): what
        # attach's report shows, so that an attach with fewer step windows than planned says why.
        self.step_log: deque[StepTry] = deque(maxlen=STEP_LOG_MAX)
        # Called from the waits when a watched function has been called, with the seconds since
        # the poll before (the calls it finds were made in them): the caller moves it into the
        # windows (set_watch without it).
        self.on_seen: Callable[[float], None] = lambda dt: None
        self._poll_t = time.monotonic()
        # Called after each window is logged: the caller reads the maps, so each window's counts
        # are its own.
        self.on_window_end: Callable[[WindowSpan], None] = lambda ws: None
        self.poll_s = POLL_S  # how often waits look at the watch link
        self._current: WindowSpan | None = None  # the window open now
        # Functions that moved off the watch link during this interval (`join`), and those its
        # windows have probed: the windows after a move probe the function too, and one that moved
        # after the last window began gets a window of its own (`follow_s` long, `follow_timed`
        # timed) before the interval ends.
        self.joined: frozenset[int] = frozenset()
        self.follow_s = 0.0
        self.follow_timed: frozenset[int] = frozenset()
        self._probed_now: set[int] = set()
        # The kept functions' hits a second beyond which counting them all costs the job more than
        # planned (set by the caller with the kept set): past it, `on_kept_hot(hits, seconds)` is
        # called from the waits, and the caller chooses the kept set again.
        self.kept_hz_limit = float("inf")
        self.irregular: set[int] = set()  # kept functions never the step: found called at irregular intervals, or from another thread (Tracee)
        self.on_kept_hot: Callable[[int, float], None] | None = None
        self._kept_mark, self._kept_t = 0, time.monotonic()

    def cookie(self, f: int, timed: bool = False) -> int:
        return f | (COOKIE_TIMED if timed else 0) | (COOKIE_STEPPED if self.kinds[f] == "stepped" else 0)

    def _attach(self, ids: list[int], cookies: list[int], retprobe: bool) -> links.Link:
        return self.program.attach(self.library, [self.ids[i].offset for i in ids], cookies, retprobe=retprobe,
                                   pid=self.pid)

    # --- the watch link -----------------------------------------------------------------------
    def _tally_unwatched(self, now: float) -> None:
        dt = now - self._watch_since
        if dt > 0:
            acc = self.log.unwatched_s
            for f in self.ids.keys() - self.watched:
                acc[f] = acc.get(f, 0.0) + dt
        self._watch_since = now

    @property
    def watch_link(self) -> links.Link | None:
        """One of the watch links (None: none attached)."""
        return next(iter(self.watch_links.values()), None)

    def set_watch(self, ids: frozenset[int], kept: frozenset[int] = frozenset()) -> None:
        """Keeps exactly `ids` on the watch link. It is WATCH_SHARDS links (function id modulo): a
        function moving off it rebuilds one shard, a new link first and then the old one closed, so
        the functions on both are never off it (their breakpoints stay: no writes for them).
        Rebuilding all ~680 at once took the job's memory-map lock ~680 times while the function
        that moved was still trapping at full rate. `kept` (a part of `ids`): functions called
        already that stay on it, counted every call and not reported as new."""
        ids = frozenset(ids)
        kept = frozenset(kept) & ids
        changed = (ids ^ self.watched) | (kept ^ self.kept)
        if not changed:
            return
        # The poll's mark from before the rebuild: a hit while the links change is one the next poll
        # finds (counted since here), not one folded into the mark unseen. The caller read its rows
        # just before, and counts each function's new calls from them: with the mark taken after
        # the rebuild, calls made before it were divided by the time since it (a native job's
        # 51,014 calls read as made in 20 ms).
        mark, mark_t = self.program.seen_hits(), time.monotonic()
        old_links = []
        try:
            for shard in sorted({f % WATCH_SHARDS for f in changed}):
                members = sorted(f for f in ids if f % WATCH_SHARDS == shard)
                old = self.watch_links.pop(shard, None)
                if old is not None:
                    old_links.append(old)  # closed once the new ones are on (or one failed: the process is gone)
                if members:
                    cookies = [self.cookie(i) | (COOKIE_KEPT if i in kept else COOKIE_WATCH) for i in members]
                    self.watch_links[shard] = self._attach(members, cookies, retprobe=False)
            # The new links are on: the functions leaving the link are off it from here, not from
            # once the old links are closed (closing waits out a grace period: 50 ms here, 94 ms on
            # the H200, with their breakpoints gone from its start). Tallied after the close, that
            # time stood as counted on the link with no calls in it: a function moved off in the
            # first interval read its calls there at a fifth of its rate, every rate of a step
            # window from it 1-5% low.
            self._tally_unwatched(time.monotonic())
        finally:
            links.close_together(old_links)
        self.log.writes += len(changed)
        self.watched, self.kept = ids, kept
        self._seen_mark, self._poll_t = mark, mark_t
        if kept:
            self._kept_mark, self._kept_t = self.program.kept_hits(), self._poll_t

    def join(self, fresh: frozenset[int], follow_s: float, timed: frozenset[int] = frozenset()) -> None:
        """`fresh` functions have moved off the watch link into the windows: this interval's
        remaining windows probe them too, and where none is left, a window of their own of
        `follow_s` seconds (`timed`: those of them to time) follows before the interval ends. The
        watch link's count of a function's first calls reads its rate low (the watch link's hits
        and the rebuild of its shard slow the job, and no marker measures by how much): for a
        function that starts in the last interval of an attach, that would be its only rate."""
        self.joined |= fresh
        self.follow_s = follow_s
        self.follow_timed |= timed & fresh

    def poll_seen(self) -> float | None:
        """Seconds since the last look if the watch link has been hit since then, else None (one
        map lookup)."""
        if self.watch_link is None:
            return None
        n = self.program.seen_hits()
        now = time.monotonic()
        since, self._poll_t = now - self._poll_t, now
        if n != self._seen_mark:
            self._seen_mark = n
            return since
        return None

    def waiting(self, wait: Callable[[float], bool], seconds: float, *, until_joined: bool = False) -> bool:
        """wait(seconds), looking at the watch link every `poll_s`; False once wait says so. With
        `until_joined`, returns (True) as soon as a function has moved into the windows that no
        window of this interval has probed."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            if not wait(min(left, self.poll_s) if self.watch_link is not None else left):
                return False
            since = self.poll_seen()
            if since is not None:
                self.on_seen(since)
                if until_joined and self.joined - self._probed_now:
                    return True
            if self.kept and self.on_kept_hot is not None:
                self._check_kept()
                if until_joined and self.joined - self._probed_now:
                    return True

    def _check_kept(self) -> None:
        """The kept functions' hits since the last mark against their limit: past it, the caller
        hears of it at once (a kept function at 150k calls/s cost a job on this project's CI host
        most of a second before the interval's end moved it)."""
        now = time.monotonic()
        n = self.program.kept_hits()
        hits, dt = n - self._kept_mark, now - self._kept_t
        if hits > self.kept_hz_limit * max(dt, KEPT_SPAN_S):
            self._kept_mark, self._kept_t = n, now
            self.on_kept_hot(hits, dt)
        elif dt >= KEPT_SPAN_S:
            self._kept_mark, self._kept_t = n, now

    def _tail(self, wait: Callable[[float], bool], until: float) -> None:
        """Waits out the interval (to `until`); a function that moved into the windows and that no
        window of this interval has probed gets one window of its own first, where there is time."""
        while True:
            pending = frozenset(self.joined - self._probed_now)
            left = until - time.monotonic()
            if pending and min(self.follow_s, left) >= FOLLOW_MIN_S:
                length = min(self.follow_s, left)
                self._current = WindowSpan(0.0, pending, self.follow_timed & pending, None, 0.0, time.monotonic())
                self.attach(self.follow_timed & pending, pending)
                alive = self.waiting(wait, length)
                self._finish_window()
                if not alive:
                    return
                continue
            if left <= 0 or not self.waiting(wait, left, until_joined=True):
                return
            if not self.joined - self._probed_now:
                return  # waited it out

    # --- windows ------------------------------------------------------------------------------
    def attach(self, timed: frozenset[int], probe: frozenset[int] | None = None, *, open_counting: bool = True) -> None:
        """Attaches the return link, then the entry link (every entry seen has its return seen), then
        opens counting (without `open_counting`, the caller arms a step window instead). A
        pid-filtered attach raises NoSuchProcess if that process has exited."""
        self.outside_end()
        self.program.next_generation()
        t0 = time.perf_counter()
        ids = sorted(self.ids if probe is None else probe)
        self.probed = frozenset(ids)
        self._probed_now.update(ids)
        if ids:
            timed_ids = [i for i in ids if i in timed]
            try:
                if timed_ids:
                    self.links.append(self._attach(timed_ids, [self.cookie(i, True) for i in timed_ids], True))
                self.links.append(self._attach(ids, [self.cookie(i, i in timed) for i in ids], False))
            except BaseException:
                self.detach()
                raise
            self.log.writes += 2 * len(ids)
            self.attach_s.append(time.perf_counter() - t0)
        if open_counting:
            self.opened_at = stamped(self.program.open)

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

    def detach(self, *, marker: bool = False) -> float:
        """Closes counting, then the window's links (and the marker's, with `marker`) all at once
        (links.close_together): none goes on trapping the job while another's close waits."""
        counted = self.close_counting()
        t0 = time.perf_counter()
        closing = list(self.links)
        if marker and self.marker_link is not None:
            closing.append(self.marker_link)
            self.marker_link = None
        links.close_together(closing)
        had = bool(self.links)
        self.links.clear()
        if had:
            self.detach_s.append(time.perf_counter() - t0)
        return counted

    def marker_begin(self, f: int) -> None:
        self.marker_end()
        self.marker_link = self._attach([f], [self.cookie(f) | COOKIE_MARKER], False)
        self.log.writes += 2
        self.outside_since = stamped(self.program.outside)

    def marker_end(self) -> None:
        if self.marker_link is not None:
            self.marker_link.close()
            self.marker_link = None

    def outside_end(self) -> float:
        if self.outside_since is None:
            return 0.0
        s = stamped(self.program.close_counting) - self.outside_since
        self.outside_since = None
        return s

    def _reference_span(self, f: int, lead: float, wait: Callable[[float], bool]) -> float | None:
        """f probed alone for `lead` seconds (its reference span, counted as `outside`); the span's
        length, None where the target went meanwhile (the marker's link closed)."""
        self._outside_mark = self.program.outside_calls(self.pid, f) if self.pid else None
        self.marker_begin(f)
        if not self.waiting(wait, lead):
            self.outside_end()
            self.marker_end()
            return None
        return self.outside_end()

    def _spare_reference(self, plan, marker: int, span_s: float, latest: float) -> int | None:
        """Where the reference span just ended (`span_s` of `marker`) had its probes take more than
        REF_PROBE_MAX of it, at their calibrated cost, the estimator cannot read the window against
        it (estimator.reference_rates) and its rates would rest on the exposure, which varies from
        window to window several-fold: the first of the plan's spare references (most-called first)
        whose share, scaled as much as the marker's rose above what the plan expected of it, stays
        within half of REF_PROBE_MAX. None: the marker holds, there is no such spare, its span
        would not end before `latest` (the last moment the window's reference may start), or the
        span's calls cannot be read here (a host-wide session). On an H100 a job that switched from
        a 10-s set-up to eager steps had its first windows' marker (picked at the set-up's rates)
        take 22% of its span; read through the exposure, those windows said 600k calls/s for 270k."""
        if not plan.spares or not self.pid or self._outside_mark is None or span_s <= 0:
            return None
        calls = self.program.outside_calls(self.pid, marker) - self._outside_mark
        share = calls * self.costs[marker].entry_ns * 1e-9 / span_s
        if share <= REF_PROBE_MAX:
            return None
        if time.monotonic() + span_s > latest:
            return None
        rose = max(1.0, share / plan.marker_share) if plan.marker_share > 0 else math.inf
        for f, expected in plan.spares:
            if f != marker and f in plan.probe and expected * rose <= REF_PROBE_MAX / 2:
                return f
        return None

    def window(self, plan, interval_s: float, exact: bool, wait: Callable[[float], bool]) -> float:
        """Runs one interval's windows as planned (waiting with `wait`, which returns False once
        there is no one left to trace); returns the span counted. What was done is in `log`."""
        t_start = time.monotonic()
        self.joined, self.follow_timed, self._probed_now = frozenset(), frozenset(), set()
        if plan.attach and plan.step is not None and self.pid and plan.step in self.kept:
            self.program.watch_step(plan.step, self.pid)  # from now on its calls' times are noted
        if not plan.attach:
            before = self.log.counted_s
            self._tail(wait, t_start + interval_s)
            return self.log.counted_s - before
        if exact:
            if not self.links:
                self.attach(plan.timed)
            wait(interval_s)
            counted = self.reopen()
            self._end_window(WindowSpan(counted, self.probed, plan.timed))
            return counted
        total = 0.0
        gone = False
        marker = plan.marker
        for offset, length in plan.windows:
            lead = length if marker is not None else 0.0
            if not self.waiting(wait, t_start + offset - lead - time.monotonic()):
                gone = True
                break
            t0 = time.monotonic()
            outside = 0.0
            if marker is not None:
                span = self._reference_span(marker, lead, wait)
                if span is None:
                    gone = True
                    break
                outside = span
                # A reference whose own probes took more of its span than the estimator allows
                # (the job's rates rose since the plan): a cheaper one of the window's, for as long,
                # where the interval has room; it stands for the rest of the interval's windows.
                spare = self._spare_reference(plan, marker, outside, t_start + interval_s - lead - length)
                if spare is not None:
                    marker = spare
                    span = self._reference_span(marker, lead, wait)
                    if span is None:
                        gone = True
                        break
                    outside = span
            probe = plan.probe | self.joined  # with the functions that moved off the watch link since the plan
            self._current = WindowSpan(0.0, probe, plan.timed, marker, outside, t0)
            why = self._why_not_steps(plan, length) if plan.step is not None else "no step"
            if why is None:
                if not self._step_window(plan, length, probe, wait):
                    gone = True
                    break
            elif plan.whole:
                # A whole step of every function or nothing: as a window of time it would cost what
                # it was planned to, and tell what the short windows do (Policy.whole_missed).
                self.step_log.append(StepTry(time.monotonic(), plan.step, 0, plan.period_s, len(probe),
                                             why + ", not run"))
                self.log.whole_missed = True
                self._current = None
                continue
            else:
                if plan.step is not None and why != "shorter than a step":  # (a window of time, as planned)
                    self.step_log.append(StepTry(time.monotonic(), plan.step, 0, plan.period_s, len(probe), why))
                self.attach(plan.timed, probe)
                self.waiting(wait, length)
            total += self._finish_window()
        rare = plan.rare
        if rare is not None and not gone and rare[0] + rare[1] <= interval_s:
            # The rarer functions alone, in a longer window of their own.
            offset, length = rare
            marker = plan.rare_marker
            lead = length if marker is not None else 0.0
            if self.waiting(wait, t_start + offset - lead - time.monotonic()):
                t0 = time.monotonic()
                outside = 0.0
                if marker is not None:
                    # Its reference, as before the other windows.
                    self.marker_begin(marker)
                    gone = not self.waiting(wait, lead)
                    outside = self.outside_end()
                    if gone:
                        self.marker_end()
                        return total
                self._current = WindowSpan(0.0, plan.rare_probe, plan.rare_timed, marker, outside, t0)
                why = self._why_not_steps(plan, 0.0, rare=True) if plan.rare_steps else "no step"
                if why is None:
                    self._step_window(plan, plan.rare_steps * plan.period_s, plan.rare_probe, wait,
                                      timed=plan.rare_timed, steps=plan.rare_steps)
                else:
                    if plan.rare_steps:
                        self.step_log.append(StepTry(time.monotonic(), plan.step, plan.rare_steps, plan.period_s,
                                                     len(plan.rare_probe), why))
                    self.attach(plan.rare_timed, plan.rare_probe)
                    self.waiting(wait, length)
                total += self._finish_window()
        if not gone:
            before = self.log.counted_s
            self._tail(wait, t_start + interval_s)
            total += self.log.counted_s - before
        return total

    def _why_not_steps(self, plan, length: float, rare: bool = False) -> str | None:
        """None where a window of `length` can be one of whole steps of the plan's step function:
        it still kept (on the watch link, where the program sees its calls), on this process's own
        links, not found irregular (`step_regular`), and the window a step long at least (a rare
        window's steps are its own); else why not."""
        if plan.step is None or plan.period_s <= 0:
            return "no step"
        if not self.pid:
            return "host-wide links"
        if plan.step not in self.kept:
            return "step function not kept"
        if plan.step in self.irregular or not self.step_regular(plan.step):
            return "step function irregular"
        last = self.program.step_last()
        if plan.step_hz > 0 and (last is None or time.monotonic() - last > STEP_FRESH_WAIT / plan.step_hz):
            # Not called in the last STEP_FRESH_WAIT steps (or not since it was named): a burst of
            # set-up calls read as a rate, not a step. On an H100 a JAX job's cuStreamQuery, 24 calls
            # in one 20-ms discovery span, was taken for a 0.9-ms step; every window armed on it
            # never opened, and 4 of a 5-s attach's 5 intervals had none (rates -31%).
            return "step function not called lately"
        if not rare and length < 0.99 * plan.period_s:
            return "shorter than a step"
        return None

    def step_regular(self, f: int) -> bool:
        """Whether the step function f (the one watch_step named) is called at regular intervals,
        as a job's step is: the gaps between its calls vary by at most STEP_CV_MAX of their mean,
        once STEP_GAPS_MIN of them are in. One called in a burst a step is not: on the H200 a
        GPT-2 step calls cuKernelSetAttribute six times close together, and a window of one of its
        gaps (1.6 ms of a 16-ms step) read every function 44% low. Found irregular, f is never
        a step again in this session (`irregular`, which the policy reads)."""
        if f in self.irregular:
            return False
        n, _, cv = self.program.step_gaps()
        if n >= STEP_GAPS_MIN and cv > STEP_CV_MAX:
            self.irregular.add(f)
            return False
        return True

    def _step_window(self, plan, length: float, probe: frozenset[int], wait: Callable[[float], bool], *,
                     timed: frozenset[int] | None = None, steps: int = 0) -> bool:
        """A window of whole steps (Program.arm): the links attached with counting closed, armed to
        open at the step function's next call and close `length / period` calls of it later. It is
        waited for no longer than twice its expected time (a step function that stops being called,
        or leaves the watch link, must not keep the links on): cut short, the window is one of time
        from its opening, or nothing if it never opened. False once wait says no one is left."""
        period = plan.period_s
        steps = steps or max(1, round(length / period))
        # Attached just before the step function's next call is due, not at a random moment: the
        # links cost the job from the moment they are on, and until that call they count nothing.
        # Due one step after a call just seen (polled for), not extrapolated from the last one over
        # several steps at its rate: so extrapolated, GPT-2's windows on the H200 waited a median
        # 11.4 ms of a 14.3-ms step with the links on (the call aimed at missed, the next one taken),
        # and 5 of 12 here on a 40-ms step waited 30-39 ms. Where an attach does not fit well
        # inside a step, at once: the window opens within a step.
        # (A step longer than STEP_FRESH_MAX_S is extrapolated over no more than a few: the wait
        # for a call would take much of an interval.)
        if plan.step_hz > 0:
            p0 = 1.0 / plan.step_hz
            recent = sorted(self.attach_s[-8:])
            lead = (recent[(3 * len(recent)) // 4] if recent else 0.0) + STEP_ARM_LEAD_S
            last = self.program.step_last()
            if p0 > STEP_FRESH_MAX_S and last is not None:
                # At the step's length as the program measured it (the mean gap between the calls
                # it saw), where it has enough of them, not 1 / step_hz: that rate is the calls
                # counted in an interval, 6 or 7 a second of a 150-ms step (143-167 ms), and aimed
                # 12 ms late, 2 of 10 windows of a 150-ms step here waited a whole step more with
                # their links on. And STEP_JITTER of it early, as below: with a margin of
                # STEP_ARM_LEAD_S alone (which a wait's whole-millisecond poll takes up to all of),
                # 3 of 12 still did; with it none of 22, each waiting 13-19 ms.
                n, mean, _ = self.program.step_gaps()
                p = mean if n >= STEP_GAPS_MIN and mean > 0 else p0
                early = lead + STEP_JITTER * p
                due = last + math.ceil((time.monotonic() + early - last) / p) * p
                if not self.waiting(wait, due - early - time.monotonic()):
                    return False
            elif lead < (1.0 - STEP_JITTER) * p0:
                fresh = self._next_step_call(wait, STEP_FRESH_WAIT * p0)
                if fresh is False:
                    return False
                if fresh is None:
                    # No call in STEP_FRESH_WAIT steps: the step function has gone quiet (an
                    # evaluation, a checkpoint, the end of training). Armed anyway, the window would
                    # hold every link on for 2 (steps + 1) periods and likely never open: not run, and
                    # a whole one is planned again (Policy.whole_missed), as one not kept is.
                    n, mean, cv = self.program.step_gaps()
                    self.step_log.append(StepTry(time.monotonic(), plan.step, steps, period, len(probe),
                                                 "step function not called, not run", gaps=n, gap_mean_s=mean,
                                                 gap_cv=cv))
                    if plan.whole and timed is None:
                        self.log.whole_missed = True
                    return True
                if not self.waiting(wait, fresh + (1.0 - STEP_JITTER) * p0 - lead - time.monotonic()):
                    return False
        self.attach(plan.timed if timed is None else timed, probe, open_counting=False)
        self.program.arm(plan.step, self.pid, steps)
        armed = time.monotonic()
        deadline = armed + 2 * (steps + 1) * period + STEP_SLACK_S
        # Looked at every STEP_POLL_S from the soonest it can close: once the program has closed
        # it, its links go on costing the job until they are detached. (`period` is the step under
        # probes as planned: 1 + the window's cost times the untraced one before a step window has
        # measured it, Policy.step_of.)
        soonest = STEP_SOONEST * steps / plan.step_hz if plan.step_hz > 0 else STEP_SOONEST * steps * period
        alive = self.waiting(wait, soonest)
        st = self.program.step_state()
        while alive and st.state != CLOSED and time.monotonic() < deadline:
            alive = self.waiting(wait, STEP_POLL_S)
            st = self.program.step_state()
        ws = self._current
        now = None
        if st.state != CLOSED:
            now = stamped(self.program.close_counting)
            st = self.program.step_state()  # it may have opened or closed just before
        if st.steps > 0 and st.t0 is not None and st.t1 is not None:
            ws.step_func, ws.steps, ws.counted_s = plan.step, st.steps, st.t1 - st.t0
            why = "whole"
        elif st.t0 is not None and now is not None:
            ws.counted_s = max(0.0, now - st.t0)  # cut short: a window of time from its opening
            why = "cut short" if alive else "job gone"
        else:
            why = "never opened" if alive else "job gone"
        n, mean, cv = self.program.step_gaps()
        self.step_log.append(StepTry(armed, plan.step, steps, period, len(probe), why,
                                     wait_s=None if st.t0 is None else st.t0 - armed,
                                     span_s=None if st.t0 is None or st.t1 is None else st.t1 - st.t0,
                                     gaps=n, gap_mean_s=mean, gap_cv=cv))
        self.opened_at = None
        return alive

    def _next_step_call(self, wait: Callable[[float], bool], most_s: float) -> float | bool | None:
        """The time of the step function's next call (the one watch_step named), looked for every
        STEP_POLL_S for at most most_s; None where none came (the window is then not run), False
        once wait says no one is left."""
        seen = self.program.step_last()
        deadline = time.monotonic() + most_s
        while time.monotonic() < deadline:
            if not self.waiting(wait, STEP_POLL_S):
                return False
            t = self.program.step_last()
            if t is not None and t != seen:
                return t
        return None

    def _finish_window(self) -> float:
        ws = self._current
        stepped = ws is not None and ws.counted_s > 0  # a step window: its span is the program's
        counted = self.detach(marker=True)
        ws, self._current = self._current, None
        if ws is not None:
            if stepped:
                counted = ws.counted_s
            ws.counted_s = counted
            ws.t1 = time.monotonic()
            self._end_window(ws)
        return counted

    def _end_window(self, ws: WindowSpan) -> None:
        self.log.windows.append(ws)
        self.log.counted_s += ws.counted_s
        self.on_window_end(ws)

    def take_log(self) -> IntervalLog:
        """What the probes did since the last call (the interval's log), and a fresh one."""
        self._tally_unwatched(time.monotonic())
        log, self.log = self.log, IntervalLog()
        return log

    def interrupted(self, exact: bool) -> float:
        """Ctrl-C (or the process gone) in the middle of window(): ends the window open now, if
        any, as if it had ended then; returns what it counted."""
        if exact and self.opened_at is not None:
            counted = self.reopen()
            self._end_window(WindowSpan(counted, self.probed, frozenset(self.ids)))
        elif self._current is not None:
            counted = self._finish_window()
        else:
            counted = self.detach()
        self.outside_end()
        self.marker_end()
        return counted

    def close(self) -> None:
        self.detach()
        self.outside_end()
        self.marker_end()
        links.close_together(list(self.watch_links.values()))
        self.watch_links.clear()
        self.watched = self.kept = frozenset()
