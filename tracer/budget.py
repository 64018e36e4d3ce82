"""How long to keep probes attached each interval, and which functions to probe and time, within a budget.

The budget is a share of the job's time (`--budget`, default 1%): the most the tracer may slow it,
whatever its threads do. A probe hit costs the thread that makes the call; nothing can hide more
than all of it, so keeping the expected probe time per interval under `budget x interval` keeps
the slowdown under the budget, for a job whose calls are all on its critical path as for one that
waits. The windows are planned to spend `PLAN_SHARE` of it; the rest is the margin for what no
plan sees (on the H200 the job lost up to 1.6x what the plan accounted).

What an interval costs the job:
- the windows: the rate of every probed function x its calibrated hit cost (timed or counted) x
  the exposure (the share of calibrated time the job really loses: measured by the marker, else
  the most it has been seen to be, `EXPOSURE_MAX`);
- each window's marker reference, a span as long as the window before it in which one function
  alone is probed;
- each attach and detach: a breakpoint written per probed function (`WRITE_S` each);
- what was not planned: hits while links attach and detach, hits on the watch link of functions
  called for the first time (measured each interval; `observe_extra`).

Functions are probed in windows once seen called; until then they are on the watch link, which
stays attached and costs nothing until a function on it is called (then it moves into the windows
at once: tracer/probes.py). A function not called for `idle_windows` windows goes back to the
watch link. The first window probes every function: it finds what the job calls; its interval
is short (`SCOUT_INTERVAL_S`), so the windows planned on what it found follow at once.

Two windows an interval (`per_interval`), each at a random offset in its half (stratified: a job
whose rate changes inside an interval is sampled on both sides, and the windows' spread is measured
even in a short attach), where the budget pays for two of at least `min_window_s`; one otherwise;
one every k intervals where even one costs more than an interval's budget. Host-wide, one window
every second interval (`every`), as long as both intervals' budget pays for. Windows grow at most `max_growth`
from one interval to the next (a job that turns busy must not pay a long window at its new rate
before its rates are seen). Hot functions (above `hot_hz`, not synchronizing) are counted without
timing except in every `retime_every`-th window. Where a kept function tells the job's period (called
once a step), windows are whole periods long (`whole_periods`): calls that come in a burst a step are
then counted in whole bursts.
"""

from __future__ import annotations

import math
import os
import random
import dataclasses
from dataclasses import dataclass
from typing import Mapping

from .calibrate import ProbeCost
from .classify import FunctionClass
from .estimator import EXPOSURE_MAX, REF_MIN_IN, REF_PROBE_MAX

# Job time one breakpoint write costs (attach or detach): a page table update and a TLB flush on
# the CPUs the job runs on. Assumed: too small for paired phases to resolve on the H200
# (bench/results/tracer-costs-h200.md); with it, the accounted cost came within 0.35 points of the
# loss measured window by window there in 19 of 22 attaches (bench/results/audit-gpu-h200.md,
# eighth round).
WRITE_S = 5e-6
# The scout's interval is this long at most: until the scout has run no rate is known, so its
# interval has no other window, and one short window must not stand for a whole second (a 2-s job
# would be read from 5 ms of it). The windows planned once rates are known start this much later.
SCOUT_INTERVAL_S = 0.2
# The share of the budget the windows are planned to spend. What a plan cannot see costs the job
# too: on the H200 the loss measured window by window came to 0.8-2.0x (median 1.2x) what the tracer
# accounted on the launch-bound jobs at 5-s attaches (bench/results/audit-gpu-h200.md, third round), so planning
# to the whole budget overran it. The rest is the margin for that.
PLAN_SHARE = 0.6
# The share of the planned budget that may go on counting every call of functions cheap enough for
# it (`Policy.kept`): a function called a few hundred times a second, once a step, is read poorly
# from windows of a few milliseconds, and counting all its calls costs a fraction of a per mille.
KEEP_SHARE = 0.2
# ... and, where that keeps no function that can be the job's step (`Policy.step_of`), the cheapest
# that can, up to this share of it. At a quarter, the MLP's once-a-step copy (about 850 calls/s) was
# kept at a calibrated 493-578 ns a probe and not at 653-701 ns (priced at the exposure's most
# before the marker measures it: 1.8 ms a second at 701 ns against 1.5 allowed): two of the H200's
# six 5-s MLP attaches of the thirteenth round had no step windows, or only in the last interval,
# and the only MLP rates outside +-10%. Counting it costs the job what it costs (850 calls a second
# at 600-700 ns and a measured exposure of 1.2-1.5: under 1 ms a second), and the windows give that
# much up.
STEP_KEEP_SHARE = 0.6
# (0.6 since a kept function is also every window's reference, tracer/estimator.py `kept_rates`: priced
# at its rate as counted in the windows and at the exposure's most, a once-a-step function at 1.7k
# calls/s and a 624-ns probe came to 0.32% of the job against 0.30% allowed at 0.5, and the one
# attach in eight on this project's CI host that kept none read its once-a-step functions 5-19%
# high, where the others read within 2%.)
# The share of the planned budget for a window that probes only the rarer functions, apart from the
# few hottest that make most of a window's cost (`Policy.rare_set`), when they cost at most
# RARE_MAX_COST of what the whole set does: so many times longer than the other windows, it counts
# whole steps of a job whose rarer calls come once a step (GPT-2's 1-6k/s functions read -50..-78%
# from windows of 3-5 ms on the H200, and -34..+70% from rare windows of 12-25 ms, about one step
# each: a window sees one burst or two), and its own probes slow the job too little for the
# exposure to matter. It counts without timing (but the waits): the rarer functions are timed in
# the interval that times every function, and counted probes cost half. The other windows of an
# interval that has one leave the rarer functions to it. It lies in the last RARE_SLOT of the
# interval; where one interval's share pays for less than RARE_MIN_S, it comes every few
# intervals (at most RARE_MAX_EVERY), paid for by all of them: the error of a burst count is its
# edges, so one long window beats several short ones.
RARE_SHARE = 0.4
RARE_MAX_COST = 0.1
RARE_SLOT = 0.25
RARE_MIN_S = 0.1
RARE_MAX_EVERY = 4
# A function that moves off the watch link after the last window of its interval began gets a window
# of its own before the interval ends (tracer/probes.py, Probes.join), of what this share of an
# interval's planned budget pays for at the rate its first calls showed, from min_window_s to
# FOLLOW_MAX_S.
FOLLOW_SHARE = 0.25
FOLLOW_MAX_S = 0.05
# A kept function called at least this often a second gives the job's period for window lengths
# (`Policy.whole_periods`): slower ones have periods longer than any window.
PERIOD_MIN_HZ = 2.0
# ... and only one the watch link has counted at least STEP_MIN_CALLS times while it was kept: a
# set-up call or two (cuCtxSetCurrent at start, a burst of 24 cuStreamQuery from JAX's runtime) read
# as a rate is no step, and whole-step windows planned on one never open.
STEP_MIN_CALLS = 8
# ... and the one named before stays the step while its rate is within this factor of the slowest's
# (`step_of`): a step function that changes from one interval to the next splits the step windows.
STEP_STICK = 1.1
# Where an interval's budget pays only for windows shorter than the job's period but this many
# intervals' (at most) pay for one of a whole period, that is what is planned (`Policy.whole_step`):
# on the H200 a GPT-2 training step made its 300k/s calls in bursts of a 15-ms step, and 3-ms windows
# (what 1% paid for each interval) read them -22..+21% after 5 s; a window of the whole step counts
# every burst of one step, wherever it starts.
WHOLE_MAX_EVERY = 3
# ... and this many where it is a step window (`step_windows`): one counts every function's calls of
# a whole step exactly, which no number of windows of time that the same budget pays for does. Until
# the exposure is measured it is priced at its most (3x the calibration), and a GPT-2 step on the
# H200 then at 35 ms of window costing all of it, where its steps took 14-26 ms under such a window
# and lost about 5 ms each: at five intervals, 17 of 23 GPT-2 5-s attaches of the fourteenth round
# (runs 30-32) had none, and all the GPT-2 rates outside +-10% there were theirs.
WHOLE_STEP_MAX_EVERY = 8
# The spare references a plan carries (Plan.spares): a few, most-called first, are all a window tries.
SPARES_MAX = 4
# The time a step window's links are attached before its first call is due (Probes._step_window).
STEP_ARM_S = 0.002
# The share of each interval's budget that a window of the waits alone gets in the intervals a
# whole-step window is paid by (`Policy.waits_plan`), and the longest such window (share of an interval).
WAITS_SHARE = 0.1
WAITS_MAX_S = 0.1


@dataclass(frozen=True)
class Plan:
    attach: bool
    windows: tuple[tuple[float, float], ...]  # (offset from the interval's start, length) each
    timed: frozenset[int]
    probe: frozenset[int]     # functions attached in the windows
    marker: int | None = None  # the function probed alone just before each window, as its reference
    full_scan: bool = False
    # After the windows, one longer window that probes only the rarer functions (`Policy.rare_set`),
    # at its offset and length, or none.
    rare: tuple[float, float] | None = None
    rare_probe: frozenset[int] = frozenset()
    rare_timed: frozenset[int] = frozenset()
    rare_marker: int | None = None  # its reference, probed alone for as long just before it
    # The rarer functions the other windows leave to the rare window, this interval or a later one
    # (it comes every few intervals where one's share pays for too short a window).
    rare_set: frozenset[int] = frozenset()
    # Windows of whole steps (tracer/probes.py, Program.arm): each opens at a call of this kept
    # function and closes length / period_s calls of it later. None: windows of time.
    step: int | None = None
    period_s: float = 0.0
    rare_steps: int = 0       # the rare window's steps (0: a window of time)
    # A window of a whole step of every probed function, paid for by the intervals after it
    # (`Policy.whole_step`): where it cannot be one of whole steps, it is not run as a window of
    # time, and the policy is told (`Policy.whole_missed`).
    whole: bool = False
    step_hz: float = 0.0      # the step function's calls a second (untraced): when its next call is due
    # The marker's expected share of its reference span (Policy.ref_share), and the other functions
    # of `probe` that could be a reference, (function, expected share), most-called first: one stands
    # in where the marker's span shows its probes took too much of it (Probes._spare_reference).
    marker_share: float = 0.0
    spares: tuple[tuple[int, float], ...] = ()

    @property
    def window_s(self) -> float:
        return sum(w for _, w in self.windows) + (self.rare[1] if self.rare else 0.0)


NO_WINDOW = Plan(False, (), frozenset(), frozenset())


class Policy:
    def __init__(
        self,
        classes: Mapping[int, FunctionClass],
        costs: Mapping[int, ProbeCost],
        *,
        budget: float,
        interval_s: float,
        min_window_s: float = 0.002,
        hot_hz: float = 5000.0,
        retime_every: int = 4,
        idle_windows: int = 8,
        max_growth: float | None = 2.0,
        max_skip: int = 30,
        per_interval: int = 2,
        every: int = 1,
        waiting: frozenset[int] = frozenset(),
        rng: random.Random | None = None,
        keep_share: float = KEEP_SHARE,
        rare_share: float = RARE_SHARE,
        step_windows: bool = True,
    ) -> None:
        self.classes = dict(classes)
        # Functions whose time is wait (classify.waits: synchronization, synchronous copies): timed
        # in every window, however hot, since the wait is what their time tells.
        self.waiting = frozenset(waiting) | {f for f, c in self.classes.items() if c is FunctionClass.SYNC}
        self.costs = dict(costs)
        self.budget = budget
        self.interval_s = interval_s
        self.min_window_s = min(min_window_s, interval_s / 4)
        self.hot_hz = hot_hz
        self.retime_every = retime_every
        self.idle_windows = idle_windows
        self.max_growth = max_growth
        self.max_skip = max_skip
        # Seeded (GPUTRACE_SEED, else 0): the windows' offsets are what a rerun of an attach or a test
        # can repeat; they need only be independent of the job's own phase, which a fixed seed is.
        self.rng = rng or random.Random(int(os.environ.get("GPUTRACE_SEED", "0")))
        self.exact = budget >= 1.0
        self.seen: set[int] = set()             # called: probed in windows, or kept; the rest are watched
        self.kept: frozenset[int] = frozenset()  # seen, but counted every call on the watch link instead
        self.keep_share = keep_share
        self.rare_share = rare_share
        self.idle: dict[int, int] = {}          # seen function -> windows in a row without a call
        self.counted: dict[int, int] = {}       # function -> calls the windows counted so far (`repeats`)
        self.kept_calls: dict[int, float] = {}  # kept function -> calls the watch link counted while kept (`step_of`)
        self.rates: dict[int, float] = {}       # calls/s, untraced, as last estimated
        self.low_rates: dict[int, float] = {}   # calls/s as counted in the windows: a lower bound (ref_share)
        self.exposure = EXPOSURE_MAX            # what planning multiplies calibrated costs by (counted windows)
        self.exposure_timed = EXPOSURE_MAX      # ... in windows that time every function they probe
        self.extra_s = 0.0                      # unplanned job seconds an interval (edges, first calls)
        self.marker: int | None = None
        self.windows = 0                        # windows observed
        self.intervals = 0
        self.last_window_s = 0.0
        self.last_rare_s = 0.0
        self.rare_due = 0                       # intervals with a rare set since the last rare window
        self.rare_held = 0                      # rare windows so far
        self.untimed: frozenset[int] = frozenset()  # seen, but no call of theirs timed yet (set by the tracee)
        self.since_retime: int | None = None    # intervals with windows since one timed every function
        self.retiming = False                   # the last plan timed every function
        self.retried = False                    # ... and it was planned again for the one before seeing no hot call
        self.skip = 0
        self.whole_misses = 0                   # whole-step windows not had (`whole_missed`)
        self.skip_waits = False                 # the skipped intervals pay for a whole step: a window of the waits each
        # Windows an interval (where each can be min_window_s long), and a window only every
        # `every` intervals, paid for by all of them: host-wide, each window's attach and detach
        # writes its breakpoints into every process on the file (tracer/host.py).
        self.per_interval = max(1, per_interval)
        self.every = max(1, every)
        # Windows of whole steps (`step_windows`): only where the links are this process's own (a
        # step window is armed on one process's step function).
        self.step_windows_ok = step_windows
        self.step_s: dict[int, float] = {}  # step function -> seconds a step, as step windows measured it
        self.step_fn: int | None = None  # the step function last named (`step_of`)
        # Kept functions found called at irregular intervals (tracer/probes.py, Probes.step_regular):
        # never the step. The tracee shares its probes' set here.
        self.irregular: set[int] = set()

    # --- what the windows probe ---------------------------------------------------------------
    def _timed(self) -> frozenset[int]:
        """Every function in the first windows after the scout and in every `retime_every`-th
        interval with windows after that (an interval the budget leaves without a window passes
        the turn on: the hottest functions' per-call times come only from these); in the others,
        all but the hot ones that do not wait. The scout times only the waiting functions: counted
        probes cost the least, and its counts are what it is for."""
        if self.exact or (self.windows > 0 and (self.since_retime is None
                                                or self.since_retime >= self.retime_every - 1)):
            return frozenset(self.classes)
        if self.windows == 0:
            return frozenset(f for f in self.classes if f in self.waiting)
        return frozenset(f for f in self.classes if self.rates.get(f, 0.0) < self.hot_hz or f in self.waiting)

    def probe_set(self) -> frozenset[int]:
        """Every function in the scout; after it, those seen called. The kept ones are among them:
        their calls are counted on the watch link, and the windows time them (the window's count of
        them is the same calls again, which the estimator leaves out)."""
        if self.exact or self.windows == 0:
            return frozenset(self.classes)
        return frozenset(self.seen)

    def watch_set(self) -> frozenset[int]:
        """Functions to keep on the watch link: every one no window probes (the kept ones among them)."""
        if self.exact:
            return frozenset()
        return (frozenset(self.classes) - self.seen) | self.kept

    def keep_cost_per_s(self, f: int) -> float:
        """Expected job seconds a second that counting every call of f costs."""
        return self.exposure * self.rates.get(f, 0.0) * self.costs[f].entry_ns * 1e-9

    def choose_kept(self) -> frozenset[int]:
        """The seen functions, cheapest first, whose calls together cost at most `keep_share` of the
        planned budget to count all the time; never one whose time is wait (timed in every window),
        and never all of them (the windows measure the exposure and time the calls). Those kept
        already stay while all of them cost at most twice that (each change rebuilds a watch link,
        and the rates it goes by are noisy)."""
        allowed = self.keep_share * PLAN_SHARE * self.budget
        candidates = [f for f in self.seen if f not in self.waiting]
        cost = {f: self.keep_cost_per_s(f) for f in candidates}
        stay = frozenset(f for f in self.kept if f in cost)
        if stay and sum(cost[f] for f in stay) <= 2 * allowed and len(stay) < len(self.seen):
            out, spent = set(stay), sum(cost[f] for f in stay)
        else:
            out, spent = set(), 0.0
        for c, f in sorted((cost[f], f) for f in candidates if f not in out):
            if spent + c > allowed or len(out) + 1 >= len(self.seen):
                break
            out.add(f)
            spent += c
        if self.step_windows_ok and self.keep_share > 0 and not any(
                self.rates.get(f, 0.0) >= PERIOD_MIN_HZ and f not in self.irregular for f in out):
            # The job's step function (`step_of`), where the share above keeps none: the cheapest
            # called often enough, up to STEP_KEEP_SHARE of the planned budget. On the H200 the
            # MLP's once-a-step copy (730 calls/s) cost just over the kept share at the planned
            # exposure, and an attach without it had no step windows (4 of 8 rates within 10%).
            # Priced at its rate as counted in the windows where that is lower (as `ref_share`): one
            # read through an exposure not measured yet can be far too high; once kept, its exact
            # rate prices it, and it stays while it fits (functions called once a step cost alike,
            # and the cheapest by the windows' few calls of each changed from one interval to the
            # next: a kept function that is on the watch link for a whole interval is what reads
            # its windows, tracer/estimator.py `kept_rates`).
            step_allowed = STEP_KEEP_SHARE * PLAN_SHARE * self.budget
            price = {f: c if f in self.kept else c * min(1.0, self.low_rates.get(f, math.inf) / r)
                     for f, c in cost.items() if (r := self.rates.get(f, 0.0)) > 0}
            for _, c, f in sorted((f not in self.kept, price[f], f) for f in candidates if f not in out and f in price):
                if self.rates.get(f, 0.0) < PERIOD_MIN_HZ or f in self.irregular:
                    continue
                if c <= step_allowed and len(out) + 1 < len(self.seen):
                    out.add(f)
                    break
                if f not in self.kept:
                    break
        return frozenset(out)

    def kept_hz_limit(self) -> float:
        """The kept functions' hits a second (all together) past which counting every call of them
        costs more than twice what the kept set may (choose_kept keeps it up to twice): priced at
        the dearest hit among them."""
        if not self.kept:
            return math.inf
        dearest = max(self.costs[f].entry_ns for f in self.kept) * 1e-9
        return 2 * self.keep_share * PLAN_SHARE * self.budget / (self.exposure * dearest) if dearest > 0 else math.inf

    def rare_set(self, probe: frozenset[int], timed: frozenset[int]) -> frozenset[int]:
        """The probed functions left once the hottest (by cost, most first) make up all but
        RARE_MAX_COST of the windows' cost, less the waits: empty where that leaves nothing, or
        nothing above 100 calls a second (none worth a window of its own)."""
        if self.rare_share <= 0 or len(probe) < 2:
            return frozenset()
        # As each would be probed in the rare window: counted (the waits, timed, stay in the others).
        cost = {f: self.rates.get(f, 0.0) * self.costs[f].cost_ns(f in self.waiting) for f in probe}
        total = sum(cost.values())
        if total <= 0:
            return frozenset()
        left = set(probe)
        for f in sorted(probe, key=lambda f: -cost[f]):
            if sum(cost[g] for g in left) <= RARE_MAX_COST * total:
                break
            left.discard(f)
        # The waits stay in every window, timed: the slack a layer's cost hides in is their time,
        # and the audit's lower bound needs it in every interval.
        left -= self.waiting
        if len(left) == len(probe) or not any(self.rates.get(f, 0.0) >= 100.0 for f in left):
            return frozenset()
        return frozenset(left)

    # --- costs --------------------------------------------------------------------------------
    def hit_s_per_s(self, probe: frozenset[int], timed: frozenset[int]) -> float:
        """Calibrated probe seconds a second of window at the rates known, times the exposure planned
        by: not capped (window_cost_per_s is), so that two sets' costs compare as their rates do."""
        expo = self.exposure_timed if timed >= probe else self.exposure
        return expo * sum(self.rates.get(f, 0.0) * self.costs[f].cost_ns(f in timed) * 1e-9
                                   for f in probe)

    def window_cost_per_s(self, probe: frozenset[int], timed: frozenset[int]) -> float:
        """Expected job seconds lost per second of window: at most one (a job slowed to a stop for
        the window loses the window, no more; rates measured under probes overstate that)."""
        return min(1.0, self.hit_s_per_s(probe, timed))

    def marker_cost_per_s(self, f: int | None) -> float:
        if f is None:
            return 0.0
        return min(1.0, self.hit_s_per_s(frozenset((f,)), frozenset()))

    def repeats(self, f: int) -> bool:
        """Whether the windows so far counted f often enough for it to be a reference: REF_MIN_IN
        calls, what a window needs of its marker to be read against it. A set-up call or two that
        the scout caught (cuModuleGetFunction twice in 3 ms: 633 calls/s) says no more is coming."""
        return self.counted.get(f, 0) >= REF_MIN_IN

    def ref_share(self, f: int) -> float:
        """The share of a reference span that f's calibrated probes take at its known rate: what the
        estimator holds against REF_PROBE_MAX (estimator.reference_rates). At its rate as counted in
        the windows (`low_rates`: the probes took none of their time) where that is lower: a rate
        read through an exposure not measured yet can be many times too high (a scout whose probes
        took 70% of it read 314k calls/s for 71k), and no function was then cheap enough to be a
        reference for the whole attach. Too low, it costs nothing: the estimator checks the share
        its reference spans really had."""
        r = self.rates.get(f, 0.0)
        return min(r, self.low_rates.get(f, r)) * self.costs[f].cost_ns(False) * 1e-9

    def marker_fits(self, f: int, probe: frozenset[int], timed: frozenset[int], strict: bool = True) -> bool:
        """Whether f's reference span costs at most a quarter of what a window of `probe` does: as
        the job loses time (both capped at all of it), or, not `strict`, as their rates compare
        (uncapped on both sides: how far each is from costing the job all its time aside)."""
        if strict:
            return self.marker_cost_per_s(f) <= self.window_cost_per_s(probe, timed) / 4
        return self.hit_s_per_s(frozenset((f,)), frozenset()) <= self.hit_s_per_s(probe, timed) / 4

    def choose_marker(self, probe: frozenset[int], timed: frozenset[int],
                      among: frozenset[int] = frozenset()) -> int | None:
        """A reference first: the most-called function of `probe` or `among` (the other functions the
        interval's windows probe: the one chosen is probed in this window too) whose probes take at
        most REF_PROBE_MAX of its reference span. A window whose own functions are all dear to probe
        (single-stepped, say) is then still read against one: on this project's CI host a window of
        two stepped functions beside three cheap ones in a longer window of their own had none, its
        rates rested on the exposure, and a 5-s attach read 0..46k calls/s for 16.7k.

        Else the most-called probed function whose reference span costs at most a quarter of what the
        window does (called at least 100 times a second: fewer count too little to tell). Where
        none does because the window seems to cost the job all its time, the cheapest whose rate
        is a quarter of the window's at most: where the exposure is not measured yet, rates read
        under probes that took most of a window come out several times too high, every window then
        seems to stop the job, and no function was cheap enough. No marker means no exposure
        measured, so the rates stayed that high: on the H200 a copy loop's counted windows went
        without a marker for a whole attach (its rates +-555%)."""
        called = [f for f, r in self.rates.items() if f in probe and r >= 100.0]
        # First the most-called whose probes take at most REF_PROBE_MAX of its reference span: the
        # estimator reads windows against it (estimator.reference_rates), whatever their probes cost.
        ref = self.reference(probe | among)
        if ref is not None:
            return ref
        ok = [(self.rates[f], f) for f in called if self.marker_fits(f, probe, timed)]
        if ok:
            return max(ok)[1]
        dear = [(self.marker_cost_per_s(f), f) for f in called if self.marker_fits(f, probe, timed, strict=False)]
        return min(dear)[1] if dear else None

    def reference(self, among: frozenset[int]) -> int | None:
        """The most-called function of `among` that can be a reference (`choose_marker`), None if none:
        the most-called whose share is within half of REF_PROBE_MAX where one is, else within it. The
        share is judged at a rate that may be low (`ref_share`) and the rates move between intervals:
        on an H100 a GPT-2 job's marker, judged within 5%, took 5.7-6.8% of its spans, and its
        windows lost their reference (their rates not known)."""
        ref = [(r, f) for f, r in self.rates.items()
               if f in among and r >= 100.0 and self.ref_share(f) <= REF_PROBE_MAX and self.repeats(f)]
        safe = [(r, f) for r, f in ref if self.ref_share(f) <= REF_PROBE_MAX / 2]
        return max(safe or ref)[1] if ref else None

    def spares(self, marker: int, probe: frozenset[int]) -> tuple[tuple[int, float], ...]:
        """The functions of `probe` other than `marker` that could stand in as the windows' reference
        (Plan.spares): called often enough, and whose probes take at most half of REF_PROBE_MAX of a
        reference span at their known rates, (function, that share), most-called first; SPARES_MAX."""
        ok = [(r, f) for f, r in self.rates.items()
              if f in probe and f != marker and r >= 100.0 and self.repeats(f)
              and self.ref_share(f) <= REF_PROBE_MAX / 2]
        return tuple((f, self.ref_share(f)) for _, f in sorted(ok, reverse=True)[:SPARES_MAX])

    def affordable_s(self, probe: frozenset[int], timed: frozenset[int], marker: int | None, n: int,
                     intervals: int = 1, share: float = 1.0) -> float:
        """The length of each of `n` windows (with their references) that `share` of `intervals`
        intervals' budget pays for. Before its first window, whose rates are not known: the scout's length."""
        if self.windows == 0:
            return self.scout_s() / n
        allowed = share * (PLAN_SHARE * self.budget * self.interval_s * intervals - self.extra_s)
        fixed = n * 2 * (len(probe) + (1 if marker is not None else 0)) * WRITE_S
        per_s = n * (self.window_cost_per_s(probe, timed) + self.marker_cost_per_s(marker))
        if allowed - fixed <= 0:
            return 0.0
        return math.inf if per_s <= 0 else (allowed - fixed) / per_s

    def follow_up_s(self, fresh: frozenset[int]) -> float:
        """The length of the window of their own that functions just moved off the watch link get
        where their interval has no window left (Probes.join)."""
        w = self.affordable_s(fresh, frozenset(fresh & self.waiting), None, 1, self.every, FOLLOW_SHARE)
        return min(FOLLOW_MAX_S, max(self.min_window_s, w))

    def share_for(self, probe: frozenset[int], timed: frozenset[int], marker: int | None, w: float,
                  intervals: int = 1) -> float:
        """The share of `intervals` intervals' budget one window of length w (with its reference) costs."""
        allowed = PLAN_SHARE * self.budget * self.interval_s * intervals - self.extra_s
        cost = 2 * (len(probe) + (1 if marker is not None else 0)) * WRITE_S + w * (
            self.window_cost_per_s(probe, timed) + self.marker_cost_per_s(marker))
        return cost / allowed if allowed > 0 else math.inf

    # --- the plan -----------------------------------------------------------------------------
    def scout_s(self) -> float:
        """The first window: rates unknown, so its length alone bounds its cost (a job that did
        nothing but hit probes would lose all of it): half the budget, half for its edges."""
        return max(self.min_window_s, PLAN_SHARE * self.budget * self.interval_s / 2)

    def plan(self) -> Plan:
        plan = self._plan()
        if plan.marker is not None and not self.exact and (share := self.ref_share(plan.marker)) <= REF_PROBE_MAX:
            plan = dataclasses.replace(plan, marker_share=share, spares=self.spares(plan.marker, plan.probe))
        if plan.attach and plan.windows and not plan.full_scan and not self.exact:
            all_timed = plan.timed == frozenset(self.classes)
            self.since_retime = 0 if all_timed else (self.since_retime or 0) + 1
            self.retiming = all_timed
        return plan

    def _plan(self) -> Plan:
        self.intervals += 1
        timed, probe = self._timed(), self.probe_set()
        if self.exact:
            return Plan(True, ((0.0, self.interval_s),), timed, probe)
        if self.windows == 0:
            # At once: until it has run, no function is watched or sampled, so calls before it
            # would be counted by nothing.
            w = self.last_window_s = self.scout_s()
            return Plan(True, ((0.0, w),), timed, probe, full_scan=True)
        if not probe:
            return NO_WINDOW  # nothing called since the scout: the watch link counts it all
        if self.skip > 0:
            self.skip -= 1
            if self.skip_waits:
                return self.waits_plan(probe)
            return NO_WINDOW
        if (self.intervals - 1) % self.every:
            return NO_WINDOW
        n = self.per_interval if self.interval_s >= 0.2 else 1
        # Not in the interval that times every function: its windows are the dearest, and the only
        # ones that time the hottest functions, whose per-call time the interval's CPU figures need.
        retime = timed == frozenset(self.classes)
        rare = self.rare_set(probe - self.kept, timed) if self.interval_s >= 0.2 and not retime else frozenset()
        # Counted, but timed in the first and every retime_every-th, and those not timed yet in every
        # one (their per-call times come from there and from the interval that times every function,
        # whose short windows seldom see them: until then an interval's driver CPU is not known).
        # The waits are in it too, timed (as in every window): a few hundred a second are seen in a
        # long window, seldom in the short ones beside hot functions.
        waits = probe & self.waiting if rare else frozenset()
        rare_timed = (rare if self.rare_held % self.retime_every == 0 else rare & self.untimed) | waits
        # The rare window is read against a reference too where one is cheap enough (probed alone
        # for as long before it, then in it): else its rates rest on the exposure.
        rare_marker = self.reference(probe) if rare else None
        rare_probe = rare | waits | ({rare_marker} if rare_marker is not None else set())
        rare_w, rare_k, share = 0.0, 1, 1.0
        if rare:
            # The fewest intervals whose share pays for a window of RARE_MIN_S (capped by its slot,
            # which holds its reference span too).
            cap = (0.45 if rare_marker is not None else 0.8) * RARE_SLOT * self.interval_s
            while rare_k < RARE_MAX_EVERY and self.affordable_s(
                    rare_probe, rare_timed, rare_marker, 1, self.every * rare_k, self.rare_share) < min(RARE_MIN_S, cap):
                rare_k += 1
            # The other windows need one of min_window_s: the rare window gives way to that (the hot
            # functions make most of the job's calls).
            m = self.choose_marker(probe - rare, timed, among=probe)
            least = min(1.0, self.share_for((probe - rare) | ({m} if m is not None else set()), timed, m,
                                            self.min_window_s, self.every))
            share = max(1.0 - self.rare_share, least)
            rare_w = min(cap, self.affordable_s(rare_probe, rare_timed, rare_marker, 1, self.every * rare_k,
                                                1.0 - share))
            if self.last_rare_s and self.max_growth:
                rare_w = min(rare_w, self.max_growth ** max(1, self.rare_due + 1) * self.last_rare_s)
            if rare_w < self.min_window_s:
                rare, rare_w, share = frozenset(), 0.0, 1.0
            else:
                # What the rare window does not spend (it is capped) goes to the others: the set-aside
                # is what it spends, spread over the intervals it comes every.
                spend = (rare_w * (self.window_cost_per_s(rare_probe, rare_timed) + self.marker_cost_per_s(rare_marker))
                         + 2 * (len(rare_probe) + (rare_marker is not None)) * WRITE_S)
                allowed = PLAN_SHARE * self.budget * self.interval_s * self.every - self.extra_s
                share = max(least, 1.0 - spend / rare_k / allowed) if allowed > 0 else least
        if rare:
            self.rare_due += 1
        elif not retime:
            self.rare_due = 0  # (the interval that times every function holds the count over)
        # The first at once (a 5-s attach has three intervals for it), then every rare_k-th.
        held = bool(rare) and (self.rare_due >= rare_k or not self.last_rare_s)
        marker = self.choose_marker(probe - rare, timed, among=probe)
        hot = (probe - rare) | ({marker} if marker is not None else set())
        w = self.affordable_s(hot, timed, marker, n, self.every, share)
        while n > 1 and w < self.min_window_s:
            n -= 1
            w = self.affordable_s(hot, timed, marker, n, self.every, share)
        whole = self.whole_step(probe, timed, w) if not retime else None
        if whole is not None:
            # One window of a whole period of every probed function (the rarer ones too: it counts
            # their whole step as well), every k intervals, paid for by all k.
            k, marker, w = whole
            self.skip, self.rare_due, self.last_window_s = k - self.every, 0, w
            self.skip_waits = True
            lead = w if marker is not None else 0.0
            step = self.step_of(self.hit_s_per_s(probe, timed)) if self.step_windows_ok else None
            at = lead + self.rng.uniform(0.0, max(0.0, self.interval_s - lead - 2 * w))
            return Plan(True, ((at, w),), timed, probe, marker, whole=step is not None, **self._step_fields(step))
        if w < self.min_window_s:
            # Even one window costs more than an interval's budget: one every k intervals, paid for
            # by all k (and no rare window). Never for good: rates and exposure are measured again.
            rare, rare_w, held, hot, self.rare_due = frozenset(), 0.0, False, probe, 0
            marker = self.choose_marker(hot, timed)
            k = self.every
            while k < self.max_skip + 1 and self.affordable_s(hot, timed, marker, 1, k) < self.min_window_s:
                k += self.every
            self.skip, self.skip_waits = k - self.every, False
            w = max(self.min_window_s, self.affordable_s(hot, timed, marker, 1, k))
        afford = w
        if self.last_window_s and self.max_growth:
            w = min(w, self.max_growth * self.last_window_s)
        span = self.interval_s * (1.0 - RARE_SLOT) if rare else self.interval_s
        half = span / n
        room = half / (3 if marker is not None else 2)  # room for the reference before it
        cost = self.hit_s_per_s(hot, timed)
        w, step = self.step_windows(self.whole_periods(min(w, room), min(afford, room), cost), cost)
        # (A step window measures what its probes cost the job itself (StepPool); its marker, paid
        # for above, is its reference where it cannot be one of whole steps when due and runs as a
        # window of time: without, such windows rested on the exposure and a conv net's 5-s attach on
        # an H100 read every rate not known.)
        self.last_window_s = w
        lead = w if marker is not None else 0.0
        wait = step[1] if step else 0.0  # a step window is armed just before a call is due: up to a period
        windows = tuple((k * half + lead + self.rng.uniform(0.0, max(0.0, half - lead - w - wait)), w) for k in range(n))
        steps = self._step_fields(step)
        if not held:
            return Plan(True, windows, timed, hot, marker, rare_set=rare, **steps)
        rare_cost = self.hit_s_per_s(rare_probe, rare_timed)
        rare_w, rare_step = self.step_windows(self.whole_periods(rare_w, rare_w, rare_cost), rare_cost)
        if rare_step:
            steps = self._step_fields(step or rare_step) | {"rare_steps": max(1, round(rare_w / rare_step[1]))}
        self.last_rare_s, self.rare_due = rare_w, 0
        self.rare_held += 1
        lead = rare_w if rare_marker is not None else 0.0
        at = span + lead + self.rng.uniform(0.0, max(0.0, RARE_SLOT * self.interval_s - lead - rare_w - wait))
        return Plan(True, windows, timed, hot, marker, rare=(at, rare_w), rare_probe=rare_probe,
                    rare_timed=rare_timed, rare_set=rare, rare_marker=rare_marker, **steps)

    def whole_missed(self) -> None:
        """The last plan's whole-step window could not be one of whole steps (its step function
        found irregular, or no longer kept, when it was due) and was not run: the intervals planned
        to pay for it plan again, with what is known now. On the H200 two of ten GPT-2 5-s attaches
        planned one on a faster kept function that turned out irregular, ran it as a window of time
        and, paying for it with the intervals after, had no whole step at all (four and seven of
        their rates 10-53% off). Twice in a session at most: the third such window stays skipped."""
        self.whole_misses += 1
        if self.whole_misses <= 2:
            self.skip, self.skip_waits = 0, False

    def waits_plan(self, probe: frozenset[int]) -> Plan:
        """An interval a whole-step window is paid for by (`whole_step`): one window of only the waits,
        timed, on WAITS_SHARE of the interval's budget (the whole step's leaves it out). Their time is
        the slack a layer's cost hides in, and an interval without it has no lower bound: on this
        project's CI a launch-bound job had three intervals of six without one."""
        waits = probe & self.waiting
        if not waits:
            return NO_WINDOW
        # With a reference probed beside them where one is cheap enough: their rates then rest on it,
        # not on how much of the window their probes took (a wait's probe is often single-stepped).
        marker = self.choose_marker(probe, frozenset())
        if marker is not None and self.ref_share(marker) > REF_PROBE_MAX:
            marker = None
        probed = waits | ({marker} if marker is not None else set())
        w = min(WAITS_MAX_S * self.interval_s,
                self.affordable_s(probed, waits, marker, 1, self.every, WAITS_SHARE))
        if w < self.min_window_s:
            return NO_WINDOW
        lead = w if marker is not None else 0.0
        at = lead + self.rng.uniform(0.0, max(0.0, self.interval_s - lead - w))
        return Plan(True, ((at, w),), waits, frozenset(probed), marker)

    def _step_fields(self, step: tuple[int, float] | None) -> dict:
        """A Plan's step fields for `step` (function, period), none for None."""
        if step is None:
            return {}
        return {"step": step[0], "period_s": step[1], "step_hz": self.rates.get(step[0], 0.0)}

    def whole_step(self, probe: frozenset[int], timed: frozenset[int], w: float) -> tuple[int, int | None, float] | None:
        """Where the windows an interval pays for (each `w` long) are shorter than the job's period,
        but WHOLE_MAX_EVERY intervals' budget at most pays for one window of a whole period of every
        function in `probe`: (the intervals it comes every, its marker, its length).  None otherwise."""
        p = self.period_s(self.hit_s_per_s(probe, timed))
        stepped = self.step_windows_ok and p is not None
        # A step window measures what its probes cost the job itself (StepPool): no marker. It is
        # armed just before its first call is due (Probes._step_window): a tenth of a period more.
        marker = None if stepped else self.choose_marker(probe, timed)
        if p is None or w >= p or p > self.interval_s / (3 if marker is not None else 2):
            return None
        need = 1.1 * p + STEP_ARM_S if stepped else p
        most = (WHOLE_STEP_MAX_EVERY if stepped else WHOLE_MAX_EVERY) * self.every
        # (The intervals it is paid by keep WAITS_SHARE for a window of the waits: `waits_plan`.)
        share = 1.0 - WAITS_SHARE if probe & self.waiting else 1.0
        k = self.every
        while self.affordable_s(probe, timed, marker, 1, k, share) < need:
            k += self.every
            if k > most:
                return None
        return k, marker, p

    def step_of(self, cost_per_s: float) -> tuple[int, float] | None:
        """The job's step: its slowest kept function called PERIOD_MIN_HZ times a second or more,
        and its period stretched by what a window of `cost_per_s` (`hit_s_per_s`: probe seconds,
        times the exposure, a second of the job untraced) slows the job: each step takes its probes'
        time more, 1 + cost_per_s times its own. None without one, or where step windows cannot be
        had (`step_windows_ok`: host-wide links)."""
        slow = [(self.rates.get(f, 0.0), f) for f in self.kept
                if self.rates.get(f, 0.0) >= PERIOD_MIN_HZ and f not in self.irregular
                and self.kept_calls.get(f, 0.0) >= STEP_MIN_CALLS]
        if not slow:
            return None
        r, f = min(slow)
        # The one named before while it is as slow within STEP_STICK: two called once a step at one
        # rate took turns on an H100 (a conv net), and each step window then measured another's steps.
        r_prev = next((x for x, g in slow if g == self.step_fn), None)
        if r_prev is not None and r_prev <= STEP_STICK * r:
            r, f = r_prev, self.step_fn
        self.step_fn = f
        seen = self.step_s.get(f)
        if seen is not None:
            # As step windows have measured it: the stretch below rests on the rates and on the
            # exposure's upper end (3x before it is measured), each of which can be far off.
            return f, max(seen, 1.0 / r)
        # (Not 1 / (1 - cost_per_s), the stretch of a share of the traced time: the rates are the
        # untraced ones. On the H200 GPT-2's 13-ms step read 17.5-26 ms in whole-step windows of
        # every function; at the +40% rates of one 5-s attach the old form planned 40 ms, which
        # five intervals' budget did not pay for, and that attach had no such window.)
        return f, (1.0 + cost_per_s) / r

    def observe_step(self, f: int, per_step_s: float) -> None:
        """A step window of step function f took per_step_s a step."""
        if per_step_s > 0:
            old = self.step_s.get(f)
            self.step_s[f] = per_step_s if old is None else 0.5 * (old + per_step_s)

    def period_s(self, cost_per_s: float) -> float | None:
        """The job's period (`step_of`), None without one."""
        step = self.step_of(cost_per_s)
        return step[1] if step else None

    def step_windows(self, w: float, cost_per_s: float) -> tuple[float, tuple[int, float] | None]:
        """Window length w (made whole periods by `whole_periods`) as windows of whole steps, where
        the job has a step (`step_of`) and w is one or more of its periods: (length, (step function,
        period)). Counted from one call of the step function to the call `steps` later, such a
        window sees every call of those steps once, whatever the job's pace in them, and its rate
        rests on neither its time nor the exposure (tracer/estimator.py `window_time`): on the H200
        inside one 100-ms window every function was off by the same 0.69-1.36x, the job's own pace,
        and windows of time met a handful of those in a 5-s attach. It waits for its first call,
        half a period on average, at the window's cost: a period is taken off where w has two or
        more. Else (w, None): a window of time."""
        if not self.step_windows_ok:
            return w, None
        step = self.step_of(cost_per_s)
        if step is None or w < 0.999 * step[1]:
            return w, None
        p = step[1]
        k = max(1, math.floor(w / p * (1 + 1e-9)) - (1 if w >= 2 * p * (1 - 1e-9) else 0))
        return k * p, step

    def whole_periods(self, w: float, most: float, cost_per_s: float) -> float:
        """Window length w made a whole number of the job's periods (`period_s`), rounded down, or
        one period where w is shorter but `most` (what the budget pays for) is not. Calls that come
        in a burst a step are counted in whole bursts: a window of a step and a half counts one or
        two, and on the H200 a GPU-bound matmul loop (a burst of 133 calls every 13.7 ms) read 2.2x
        its rate from two 6-ms windows that each caught one, and 0.8x from 47-ms ones that caught
        three. A window of whole steps counts as many bursts as steps, wherever it starts. The
        kept function need not be once a step: rounding to whole periods of a function called at
        no fixed time only shortens a window, by less than one of them."""
        p = self.period_s(cost_per_s)
        if p is None or p <= 0:
            return w
        if w >= p:
            return math.floor(w / p * (1 + 1e-9)) * p
        return p if most >= p else w

    # --- what was measured --------------------------------------------------------------------
    def observe(self, windows: int, rates: Mapping[int, float], called: Mapping[int, int],
                low: Mapping[int, float] | None = None) -> None:
        """After an interval with `windows` windows: the functions' estimated untraced rates (every
        function its windows probed), their calls counted in the windows (`called`; probed
        functions absent were not called) and, `low`, their rates over the windows' counting time
        (as if the probes took none of it: no more than the untraced ones)."""
        if windows <= 0:
            return
        first = self.windows == 0
        self.windows += windows
        for f, r in rates.items():
            if f not in self.rates and not r:
                continue  # never called: the scout probes every function, most of which no job calls
            if f in self.kept and f in self.rates:
                # Counted every call on the watch link (`observe_kept`): a window's rate is not mixed
                # in. On an H100 a GPT-2 step's copy (63 a second) counted once in a 3-ms window read
                # 333 a second; averaged in, the step was planned at 5 ms for a 13-ms step, and the
                # step window was refused, "step function not called lately" (ten rates not known).
                continue
            self.rates[f] = r if first or f not in self.rates else 0.5 * (self.rates[f] + r)
        for f, r in (low or {}).items():
            if f in self.rates:
                self.low_rates[f] = r if f not in self.low_rates else 0.5 * (self.low_rates[f] + r)
        for f in list(self.seen):
            if f in self.kept or f not in rates:
                continue  # on the watch link (it costs only its calls), or not probed this interval
            if called.get(f, 0):
                self.idle[f] = 0
            else:
                self.idle[f] = self.idle.get(f, 0) + windows
        for f, n in called.items():
            self.counted[f] = self.counted.get(f, 0) + n
            if n and f not in self.seen:
                self.see(f, rates.get(f, 0.0))
        if self.retiming and not first:
            # The interval that times every function timed none of the hot ones (its windows saw
            # none of their calls, or too few): the next interval times them all again, since only
            # it times them and without their per-call times the driver CPU stays unknown.
            # Once: a hot function that has stopped being called must not make every interval a dear one.
            self.retiming = False
            missed = any(self.rates.get(f, 0.0) >= self.hot_hz and not called.get(f) for f in self.seen - self.kept)
            if missed and not self.retried:
                self.since_retime, self.retried = None, True
            else:
                self.retried = False
        if self.keep_share > 0 and not self.exact:
            self.kept = self.choose_kept()

    def observe_kept(self, rates: Mapping[int, float]) -> None:
        """The kept functions' rates over the last interval, from their exact counts."""
        for f, r in rates.items():
            if f in self.kept:
                self.rates[f] = r
                self.kept_calls[f] = self.kept_calls.get(f, 0.0) + r * self.interval_s

    def see(self, f: int, rate_hz: float) -> None:
        """`f` has been called: probe it in windows from now on."""
        self.seen.add(f)
        self.idle[f] = 0
        self.rates[f] = max(self.rates.get(f, 0.0), rate_hz)

    def retire_idle(self) -> frozenset[int]:
        """Seen functions not called for `idle_windows` windows: back to the watch link."""
        gone = frozenset(f for f in self.seen if f not in self.kept and self.idle.get(f, 0) >= self.idle_windows)
        for f in gone:
            self.seen.discard(f)
            self.idle.pop(f, None)
            self.rates.pop(f, None)
        return gone

    def observe_exposure(self, value: float | None, timed: float | None = None) -> None:
        """The exposures to plan by, each the upper end of the measured one, else the most seen:
        `value` for windows that count their hot functions, `timed` (default: the same) for those
        that time every function they probe. The estimator measures the two apart (the calibration
        is not off by the same factor for both): on the H200 a GPT-2 step's counted windows
        measured 0.62 +- 0.62 and its timed ones 1.68 +- 0.33, and planning both at 2.0 made its
        counted windows seem three times dearer than they were."""
        def clamp(v: float | None) -> float:
            return EXPOSURE_MAX if v is None else min(EXPOSURE_MAX, max(v, 0.1))

        self.exposure = clamp(value)
        self.exposure_timed = clamp(value if timed is None else timed)

    def observe_extra(self, seconds: float) -> None:
        """Job seconds the last interval cost beyond its windows (edges, first calls on the watch link),
        as a running mean, of at most one interval's planned budget: a burst of first calls (a job
        loading its model, capturing a graph) is paid for by one interval's windows, not by as many
        as its cost would take. Paid for in full, a job traced from its start went 13 s without a
        window on an H100 after its set-up, while it switched to CUDA-graph replay, and its eager
        rates stood for a phase no window saw (+126..+179%)."""
        cap = PLAN_SHARE * self.budget * self.interval_s
        self.extra_s = min(cap, 0.5 * (self.extra_s + max(0.0, seconds)))


class AlignedPolicy(Policy):
    """One set of windows for every process on one set of links (tracer/host.py): each process keeps
    its own Policy (`members`, by pid), which says what its budget affords; each window is the least
    of those, so no process pays more than its own budget. What is probed follows all of them: a
    function seen in any process is probed, one hot in any process is only counted."""

    def __init__(self, classes: Mapping[int, FunctionClass], costs: Mapping[int, ProbeCost], **kw) -> None:
        super().__init__(classes, costs, **kw)
        self.members: dict[int, Policy] = {}
        self.step_windows_ok = False  # one set of links for every process: no one process's step

    def affordable_s(self, probe, timed, marker, n, intervals=1, share=1.0) -> float:
        if not self.members:
            return math.inf  # no one to charge: the links cost nothing
        return min(p.affordable_s(probe, timed, marker, n, intervals, share) for p in self.members.values())

    def window_cost_per_s(self, probe, timed) -> float:
        return max((p.window_cost_per_s(probe, timed) for p in self.members.values()), default=0.0)

    def marker_cost_per_s(self, f) -> float:
        return max((p.marker_cost_per_s(f) for p in self.members.values()), default=0.0)

    def reference(self, among) -> int | None:
        """The function of `among` called most over all members that can be a reference for each
        (cheap enough for every one of them, repeated in one)."""
        members = list(self.members.values())
        called = {f for p in members for f, r in p.rates.items() if f in among and r >= 100.0}
        ref = [(sum(p.rates.get(f, 0.0) for p in members), f) for f in called
               if all(p.ref_share(f) <= REF_PROBE_MAX for p in members) and any(p.repeats(f) for p in members)]
        return max(ref)[1] if ref else None

    def choose_marker(self, probe, timed, among=frozenset()) -> int | None:
        """As Policy.choose_marker, over all members: a reference first, else the function called
        most whose reference costs each of them at most a quarter of what its window does."""
        members = list(self.members.values())
        if not members:
            return None
        called = {f for p in members for f, r in p.rates.items() if f in probe and r >= 100.0}
        ref = self.reference(probe | among)
        if ref is not None:
            return ref
        ok = [(sum(p.rates.get(f, 0.0) for p in members), f) for f in called
              if all(p.marker_fits(f, probe, timed) for p in members)]
        if ok:
            return max(ok)[1]
        dear = [(max(p.marker_cost_per_s(f) for p in members), f) for f in called  # as Policy.choose_marker
                if all(p.marker_fits(f, probe, timed, strict=False) for p in members)]
        return min(dear)[1] if dear else None

    def merge(self, windows: int) -> None:
        """After the members observed an interval with `windows` windows: the union of what they saw."""
        if windows > 0:
            self.windows += windows
        self.seen = set().union(*(p.seen for p in self.members.values())) if self.members else set()
        rates: dict[int, float] = {}
        for p in self.members.values():
            for f, r in p.rates.items():
                rates[f] = max(r, rates.get(f, 0.0))
        self.rates = rates
