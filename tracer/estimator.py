"""From counted calls to rates: what each interval measured, and estimates over any run of intervals.

In each interval, each of a process's functions is measured in one of these ways:

- watched: on the watch link (functions not seen called yet stay probed all the time, and cost
  nothing until called), its count over the time it was there is exact;
- sampled: probed in the interval's windows, whose rates stand for the rest of the interval;
- carried: neither (the budget spaced windows out), so the last windows that sampled it stand in;
- not measured: never sampled and off the watch link; no figure is made up for that time.

A window's rate is its calls over the time the job would have needed for them untraced, read in
the first of these ways that holds (`window_time`): a step window's steps at its step function's
exact rate; a kept function's calls in it (counted exactly on the watch link, which notes those
made while a window is open) at that function's exact rate outside the interval's windows; its
marker's calls at the marker's rate in its reference spans; else its counting time shortened by
the probe time that showed, which the marker measures (`Exposure`: the share of the calibrated
probe time the job lost, pooled over the windows). The first three cancel the job's slowdown
inside the window, whatever the probes cost; until the exposure is measured it is known only to
lie between 0 and `EXPOSURE_MAX`, and that range is part of the stated uncertainty.

Inside an interval, a function's windows are pooled by the time they counted (a 5-ms window that
caught a burst weighs 5 ms, not as much as a 100-ms one); an interval whose windows counted far
less than the others' (the scout's) is pooled with the next. Each interval's rate stands for its
time off the watch link and that of the windowless intervals after it.

The uncertainty of an estimate (95%): counts (quasi-Poisson: the windows' counts vary as much as
they are seen to inside intervals, which for a job whose calls come in bursts is about the burst's
size), never less than how the windows' rates vary from one to the next with each standing for its
span (a phase that fell between two windows shows only there; with Student's t for few windows),
plus the exposure's share (the same for every sampled rate).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, fields, replace
from typing import Iterable, Mapping, Sequence

# The most a probe's calibrated time is multiplied by in a real job: hits in a large process miss
# caches the calibration loop keeps warm (about 2x for counted hits on the H200,
# bench/results/tracer-costs-h200.md).
EXPOSURE_MAX = 3.0
EFFECTIVE_FLOOR = 0.05  # a window never stands for less than this share of its length
SMALL_UNIT = 0.5  # an interval whose windows counted less than this share of the typical one's is pooled with the next
# Windows whose rate the exposure's uncertainty moves by at most FIRM_REL, where they make most of an
# interval's counting time, stand for it without those it moves by more than LOOSE_REL (_Unit.trimmed).
FIRM_REL = 0.2
LOOSE_REL = 0.5
# A window whose rate the exposure moves by all of it or more (its probes took most of it, at an
# exposure not measured) gives a lower bound and nothing else: before the first firm rate, which it
# can agree with (the scout's), it is left out and its time stood for by that rate (`_Unit.trimmed`,
# `_unvoided`). A 5-s attach whose scout's probes took 75% of it read 0..958k calls/s for 142k,
# every later window read against a reference.
VOID_REL = 1.0
DISPERSION_DOF = 3
DISPERSION_PRIOR = 2
FIRM_FACTOR = 5.0
# A marker's reference spans stand for the job's untraced pace (`reference_rates`) where they
# counted at least REF_MIN_CALLS of its calls (the reference's own Poisson error, under 1/sqrt(20) at
# one sigma, is carried as a random error of its interval's windows) and its probes took at most
# REF_PROBE_MAX of their time: not knowing how much of that the job lost (none to EXPOSURE_MAX times
# it) moves the rate by up to 1.5 x REF_PROBE_MAX either way, 7.5%, carried as a bound. At 2% a job
# whose every function is called above 43k/s had no reference on this project's CI host (0.46 us its
# cheapest hit) and none of its rates was known. A window is read against its marker where the
# marker made at least REF_MIN_IN calls in it (fewer: the window's own count of the marker is the
# noise, and its counting time serves as well).
REF_MIN_CALLS = 20
REF_PROBE_MAX = 0.05
REF_MIN_IN = 10
# A window is read against a kept function (on the watch link throughout its interval, counted there
# exactly, in and out of the windows) where it made at least KEPT_MIN_IN calls in the window and as
# many as its rate outside could have made there (`_kept_fits`): the interval's hundreds of calls
# outside the windows are its reference, not a span as long as the window (a 0.5-ms step's marker
# spans caught 5-7 steps and read the job 5-14% fast, and its once-a-step functions read as far
# high; on this project's CI host +32% once). Its own count in the window is quantized (a call a
# step: +-1 of 3-7), which the windows' dispersion carries; functions called in the same steps as
# it read in the ratio they are called in.
KEPT_MIN_IN = 3
# The fastest pace, against its interval's outside the windows, a window may see the job go at (a
# kept function that comes in bursts, one caught in a short window, is no measure of its time).
KEPT_PACE_MAX = 1.5
# An interval whose step function (a step window's) was on the watch link for at least this share of
# it gives that function's rate there (`_by_steps`).
STEP_WATCHED_MIN = 0.5


@dataclass(frozen=True)
class MarkerCount:
    """One window's marker: calls of one function inside the window and in the reference span
    just before it (the marker alone probed, at `out_probe_s` of calibrated probe time)."""

    calls_in: int
    in_s: float
    calls_out: int
    out_s: float
    out_probe_s: float = 0.0
    func: int | None = None           # the marker function (None: one per interval, as in old dumps)


@dataclass(frozen=True)
class Window:
    counted_s: float                  # the span counting was open
    probed: frozenset[int]            # functions probed in it
    calls: Mapping[int, int]          # calls counted, by function (absent: none)
    probe_s: float                    # calibrated probe time of its hits
    marker: MarkerCount | None = None
    timed: bool = False               # every function timed in it (return probes: a dearer kind of window)
    # The part of probe_s spent on functions whose first instruction is single-stepped: another
    # trap, whose cost in the job the marker (an emulated one) does not measure.
    stepped_s: float = 0.0
    # The watch link's last calls of a function before it moved into the windows: exact, but over a
    # span that may begin before its first call (the watch link's poll period), so its rate reads low
    # for a function that has just started. A rate of last resort: used only where the interval has
    # no other window that probed the function.
    discovery: bool = False
    # A step window (tracer/probes.py; Program.arm): it opened at a call of `step_func` (a kept
    # function, counted every call on the watch link) and closed `steps` calls of it later, so it
    # counted the calls of that many of the job's steps, whatever the job's pace then and whatever
    # its probes cost it. It stands for steps / (the step function's rate over the observations
    # estimated) seconds of the job (`window_time`): no exposure, and no pace of its own.
    step_func: int | None = None
    steps: int = 0
    # Calls of the kept functions (on the watch link throughout) while the window was open: exact, and
    # not its probes' (`kept_rates`).
    kept_in: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Observation:
    """One interval of one process."""

    span_s: float
    windows: tuple[Window, ...] = ()
    watched_calls: Mapping[int, int] = field(default_factory=dict)  # counted on the watch link
    # Seconds of the span each function spent off the watch link; absent: on it throughout.
    unwatched_s: Mapping[int, float] = field(default_factory=dict)
    # Functions called from other threads than the windows' calls (`apart`): no reference.
    apart: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Exposure:
    """The share of the windows' calibrated probe time the job lost (1: as calibrated; 0: hidden)."""

    value: float
    err: float                        # 95% half-width
    measured: bool                    # by markers or step windows whose model fits (else the range alone)

    def effective_s(self, w: Window) -> float:
        lost = self.value * (w.probe_s - w.stepped_s) + EXPOSURE_MAX / 2 * w.stepped_s
        return max(w.counted_s - lost, EFFECTIVE_FLOOR * w.counted_s)

    def rel_err(self, w: Window) -> float:
        """The relative error of a rate from window w that the exposure's uncertainty makes (for
        single-stepped hits, the whole range: the marker does not measure them)."""
        eff = self.effective_s(w)
        return (self.err * (w.probe_s - w.stepped_s) + EXPOSURE_MAX / 2 * w.stepped_s) / eff if eff > 0 else 0.0


UNMEASURED_EXPOSURE = Exposure(EXPOSURE_MAX / 2, EXPOSURE_MAX / 2, False)


@dataclass(frozen=True)
class Exposures:
    """One exposure for windows that time every function, one for those that count the hot ones:
    the calibration is not off by the same factor for both (counted hits cost a real job about 2x
    their calibrated time on the H200, timed ones about 1.2x)."""

    counted: Exposure = UNMEASURED_EXPOSURE
    timed: Exposure = UNMEASURED_EXPOSURE

    def of(self, w: "Window") -> Exposure:
        return self.timed if w.timed else self.counted

    def effective_s(self, w: "Window") -> float:
        return self.of(w).effective_s(w)

    def rel_err(self, w: "Window") -> float:
        return self.of(w).rel_err(w)


UNMEASURED = Exposures()


def rate_on_link(calls: int, span_s: float, unwatched_s: float, min_share: float = 1.0) -> float | None:
    """A function's calls a second in an interval of span_s, from its exact count on the watch link
    (`calls`) over the time it was on it (span_s less unwatched_s); None where that was less than
    min_share of the interval (1: throughout). The one rule for a step function's rate, wherever
    it is read (`step_rates`, `_by_steps`, the tracee's StepPool)."""
    on = span_s - min(max(unwatched_s, 0.0), span_s)
    if on <= 0 or on < min_share * span_s * (1 - 1e-9):
        return None
    return calls / on


def watched_rate(o: "Observation", g: int, min_share: float = 1.0) -> float | None:
    """`rate_on_link` of function g in interval o."""
    return rate_on_link(o.watched_calls.get(g, 0), o.span_s, o.unwatched_s.get(g, 0.0), min_share)


def step_rates(observations: Sequence["Observation"]) -> dict[int, float]:
    """Per step function of the observations' step windows, its calls a second over the intervals
    in which it was on the watch link throughout (counted exactly there); none for one called from
    other threads than the windows' calls in any of them (`apart`)."""
    funcs = {w.step_func for o in observations for w in o.windows if w.step_func is not None and w.steps > 0}
    funcs -= {g for o in observations for g in o.apart}  # another thread's pace: not the job's steps
    out: dict[int, float] = {}
    for g in funcs:
        on = [o for o in observations if watched_rate(o, g) is not None]
        n, t = sum(o.watched_calls.get(g, 0) for o in on), sum(o.span_s for o in on)
        if n > 0 and t > 0:
            out[g] = n / t
    return out


@dataclass(frozen=True)
class Reference:
    """A marker function's untraced rate in one interval, from its reference spans (where it was
    probed alone), and the 95% relative half-width of that rate; or a kept function's (`kept`) over
    the interval outside its windows."""

    rate_hz: float
    rel: float    # from its probes' share of its spans: the same for every window it reads
    rand: float   # its count's own (Poisson) relative error, one sigma: its interval's alone
    kept: bool = False
    n_out: int = 0        # (kept) its calls outside the windows, and their time: the rate's terms
    t_out: float = 0.0


def reference_rates(o: "Observation") -> dict[int | None, Reference]:
    """Per marker function, its rate over interval o's reference spans: their calls over their
    time, less the share of it that its own probes took, which is known to lie between none and
    `EXPOSURE_MAX` times their calibrated time. Its probes alone take a small share of a reference
    span (`REF_PROBE_MAX` at most, else it is no reference), so that range moves the rate little,
    where the probes of every function in a window can take most of it."""
    sums: dict[int | None, list[float]] = {}
    for w in o.windows:
        m = w.marker
        if m is None or m.out_s <= 0 or m.out_probe_s > REF_PROBE_MAX * m.out_s or m.func in o.apart:
            # (A span whose probes took too much of it is left out, not pooled: the interval's other
            # spans of the same function still give its windows their reference. Pooled, one such
            # span ruled out every window of its interval: on an H100 a GPT-2 job's spans of 4.9%
            # and 6.8% left both windows on the exposure, and the attach's rates not known.)
            continue
        acc = sums.setdefault(m.func, [0.0, 0.0, 0.0])
        acc[0] += m.calls_out
        acc[1] += m.out_s
        acc[2] += m.out_probe_s
    out: dict[int | None, Reference] = {}
    for f, (n, t, probe) in sums.items():
        if n < REF_MIN_CALLS or probe > REF_PROBE_MAX * t:
            continue
        lo, hi = n / t, n / (t - EXPOSURE_MAX * probe)
        mid = (lo + hi) / 2
        out[f] = Reference(mid, (hi - lo) / 2 / mid, 1.0 / math.sqrt(n))
    # A kept function's rate outside the windows is exact and rests on the whole interval: it stands
    # where it is a marker too.
    out.update(kept_rates(o))
    return out


def kept_rates(o: "Observation") -> dict[int | None, Reference]:
    """Per function on the watch link throughout interval o, its calls a second outside o's windows
    (its count there over their time), where that counted REF_MIN_CALLS: the job's pace where no
    window's probes slowed it, the reference its calls in each window are read against."""
    inside: dict[int, int] = {}
    t_in = 0.0
    for w in o.windows:
        if w.discovery:
            continue
        t_in += w.counted_s
        for g, k in w.kept_in.items():
            inside[g] = inside.get(g, 0) + k
    t_out = o.span_s - t_in
    out: dict[int | None, Reference] = {}
    if t_out <= 0:
        return out
    for g, n in o.watched_calls.items():
        n_out = n - inside.get(g, 0)
        if o.unwatched_s.get(g, 0.0) <= 0 and n_out >= REF_MIN_CALLS and g not in o.apart:
            out[g] = Reference(n_out / t_out, 0.0, 1.0 / math.sqrt(n_out), kept=True, n_out=n_out, t_out=t_out)
    return out


# The least share of the windows' calls that the threads calling a reference function (kept, or a
# marker) must make for it to be their reference: a thread the windows' probes do not slow (a
# framework's runtime thread polling at its own pace) keeps its pace there, and read against it the
# windows' calls are those of a window as long as it was counted (a simcuda job whose getters ran
# 40% probes in windows, a second thread's 300 calls/s kept: its rates read 4-6% low, outside their
# +-3-4% intervals, its lockstep functions 6% apart). Half, not all: a jitted JAX step's calls come
# 66% from its main thread and the rest from XLA's, and a reference on the main thread paces most.
SAME_THREADS = 0.5


def apart(tstats: Mapping[tuple[int, int], tuple[int, int, int]]) -> frozenset[int]:
    """The functions whose calls in `tstats` (one process's counts over a span: (thread, function)
    -> (window calls, kept calls, ns)) come from threads that made less than `SAME_THREADS` of the
    windows' calls, so that they are no reference for the windows (`kept_rates`, `reference_rates`,
    `step_rates`). (A function called from the windows' threads and another thread alike is not
    told apart: its pace is partly theirs.)"""
    callers: dict[int, set[int]] = {}  # function -> threads that called it (in windows or kept)
    by_tid: dict[int, int] = {}        # thread -> its window calls
    for (tid, f), (calls, k, _) in tstats.items():
        if calls or k:
            callers.setdefault(f, set()).add(tid)
        if calls:
            by_tid[tid] = by_tid.get(tid, 0) + calls
    total = sum(by_tid.values())
    if not total:
        return frozenset()
    return frozenset(g for g, tids in callers.items()
                     if sum(by_tid.get(t, 0) for t in tids) < SAME_THREADS * total)


def _kept_fits(w: "Window", k: int, rate_hz: float) -> bool:
    """Whether k calls in window w fit a function called at rate_hz outside the windows: no more
    than it makes in the window's counting time at KEPT_PACE_MAX times that pace, no fewer than in
    what is left of that time where the probes cost the job EXPOSURE_MAX times their calibrated
    time, each give or take two Poisson sigmas and a call."""
    hi = rate_hz * w.counted_s * KEPT_PACE_MAX
    lo = rate_hz * max(EFFECTIVE_FLOOR * w.counted_s, w.counted_s - EXPOSURE_MAX * w.probe_s)
    return lo - 2.0 * math.sqrt(lo) - 1.0 <= k <= hi + 2.0 * math.sqrt(hi) + 1.0


def _kept_choice(w: "Window", refs: Mapping[int | None, Reference]) -> tuple[int, int, Reference] | None:
    """The kept function window w is read against, (its calls in w, it, its reference), or None: of
    those with a reference (`kept_rates`), the one with the most calls in w that fit (`_kept_fits`)."""
    best: tuple[int, int, Reference] | None = None
    for g, k in w.kept_in.items():
        ref = refs.get(g)
        if ref is not None and ref.kept and k >= KEPT_MIN_IN and _kept_fits(w, k, ref.rate_hz) and \
                (best is None or k > best[0]):
            best = (k, g, ref)
    return best


def kept_marker(w: "Window", o: "Observation",
                refs: Mapping[int | None, Reference] | None = None) -> MarkerCount | None:
    """The kept function window w of interval o is read against, as a marker whose reference span is
    the interval outside its windows (no probes of its own there that it lacks in the window: the
    kept link counts it everywhere): its pace in the window against there measures the exposure
    (`MarkerPool`) as a marker's does. None where w is not read against one. `refs`: o's
    `kept_rates`, where the caller has them (one pass over o's windows for all of them)."""
    best = _kept_choice(w, kept_rates(o) if refs is None else refs)
    if best is None:
        return None
    k, g, ref = best
    return MarkerCount(k, w.counted_s, ref.n_out, ref.t_out, 0.0, g)


def reading(w: "Window", expo: Exposures, steps_hz: Mapping[int, float],
            refs: Mapping[int | None, Reference] | None = None) -> tuple[float, float, float, str, int | None]:
    """`window_time`, and how it was read: "steps", "kept" or "marker" (and against which function),
    or "exposure" (None)."""
    if w.step_func is not None and w.steps > 0:
        r = steps_hz.get(w.step_func)
        if r:
            return w.steps / r, 0.0, 0.0, "steps", w.step_func
    if refs and (best := _kept_choice(w, refs)) is not None:
        k, g, ref = best
        return k / ref.rate_hz, ref.rel, ref.rand, "kept", g
    m = w.marker
    if refs and m is not None and m.calls_in >= REF_MIN_IN and (ref := refs.get(m.func)) is not None:
        return m.calls_in / ref.rate_hz, ref.rel, ref.rand, "marker", m.func
    return expo.effective_s(w), expo.rel_err(w), 0.0, "exposure", None


def window_time(w: "Window", expo: Exposures, steps_hz: Mapping[int, float],
                refs: Mapping[int | None, Reference] | None = None) -> tuple[float, float, float]:
    """The untraced seconds window w stands for, the relative error of a rate from it that the
    exposure or the reference's probes make (a bound, the same for every window read that way), and
    the reference's own count's relative error (one sigma, random from one interval to the next): a
    step window's steps at its step function's rate (`step_rates`), no error from the exposure; a
    window in which a kept function made calls, those at its rate outside the interval's windows
    (`kept_rates`); a window with a marker, the marker's calls in it at the marker's rate in its
    interval's reference spans (`reference_rates`): the job's slowdown inside the window cancels,
    however much of it the probes took, and the error is the reference's; any other, its counting
    time less the probes' share (`Exposure.effective_s`)."""
    return reading(w, expo, steps_hz, refs)[:3]


def exposure(windows: Iterable[Window], *, min_calls: int = 30) -> Exposure:
    """Pooled over the windows that have a marker (MarkerPool)."""
    pool = MarkerPool()
    for w in windows:
        pool.add(w)
    return pool.exposure(min_calls=min_calls)


@dataclass(frozen=True)
class Carried:
    """A function's rate as the last windows that sampled it measured it: what stands in for the
    intervals after them that have no window."""

    rate_hz: float
    var: float            # the rate's variance from those windows' counts


@dataclass(frozen=True)
class Estimate:
    """One function over a run of intervals."""

    calls_observed: int               # counted: in windows and on the watch link
    calls_estimated: float            # over the whole span
    rate_hz: float                    # over the part of the span measured
    err_hz: float                     # 95% half-width of rate_hz
    measured_s: float                 # the part of the span the rate rests on


# Student's t (0.975) by degrees of freedom, for the windows' successive differences.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086)


def t975(dof: int) -> float:
    if dof <= 0:
        return math.inf
    return _T975[dof - 1] if dof <= len(_T975) else 1.96 + 2.4 / dof


@dataclass
class _Unit:
    """One interval's windows that probed a function: their counts pooled by counting time."""

    n: int = 0           # calls counted
    e: float = 0.0       # effective (untraced) seconds behind them
    k: int = 0           # windows
    s2: float = 0.0      # sum of n^2 / e, for the windows' dispersion
    sys: float = 0.0     # sum of the exposure's relative error x e
    rand: float = 0.0    # sum of the references' random relative error (one sigma) x e
    u: float = 0.0       # time off the watch link this unit stands for: its interval's and the windowless ones after it
    span: float = 0.0    # its interval's length
    alone: bool = False  # its only window is a discovery span
    exact: bool = False  # not windows: a whole interval's count on the watch link (`estimate`)
    counted: float = 0.0  # the windows' counting time (e is that less the probes' share)
    rates: list[float] = field(default_factory=list)
    parts: list[tuple[int, float, float, float, float]] = field(default_factory=list)  # (n, e, rel, counted, rand) each

    def add(self, n: int, e: float, rel: float, counted: float, rand: float = 0.0) -> None:
        self.n += n
        self.e += e
        self.counted += counted
        self.k += 1
        self.s2 += n * n / e
        self.sys += rel * e
        self.rand += rand * e
        self.rates.append(n / e)
        self.parts.append((n, e, rel, counted, rand))

    def trimmed(self) -> "_Unit":
        """Without the windows whose rate rests on the exposure, where windows that do not make most
        of the unit's counting time: a rarer function's long window of its own beside the short
        windows of every function (in the interval that times them all, the probes took 40% of the
        job's time there, and at an exposure known to +-100% those few calls weighed as much as the
        long window's hundreds: GPT-2's rarer functions read 20-35% high on the H200). Only where
        their rates can be the same rate (`_consistent`): windows that saw another phase of the job
        are not left out, whatever the exposure."""
        firm = [x for x in self.parts if x[2] <= FIRM_REL]
        lead = 0  # void windows before the unit's first firm one (the scout's, pooled with the next interval)
        while lead < len(self.parts) and self.parts[lead][2] >= VOID_REL:
            lead += 1
        if 0 < lead < len(self.parts) and self.parts[lead][2] <= FIRM_REL and \
                _consistent(_pooled(firm), _pooled(self.parts[:lead])):
            out = _pooled(self.parts[lead:])
            out.u, out.span, out.alone = self.u, self.span, self.alone
            return out.trimmed()
        if len(firm) == len(self.parts) or sum(x[3] for x in firm) < 0.5 * self.counted:
            return self
        keep = [x for x in self.parts if x[2] <= LOOSE_REL]
        if not _consistent(_pooled(firm), _pooled([x for x in self.parts if x[2] > LOOSE_REL])):
            return self
        out = _pooled(keep)
        out.u, out.span, out.alone = self.u, self.span, self.alone
        return out


def _pooled(parts: Sequence[tuple[int, float, float, float, float]]) -> "_Unit":
    out = _Unit()
    for part in parts:
        out.add(*part)
    return out


def _rate_range(x: _Unit) -> tuple[float, float]:
    """The rates x's windows can stand for, whatever the exposure: at the least, its calls (less
    their 95% Poisson error) over its whole counting time (probes that cost the job nothing); at
    the most, its calls (and their error) over the effective time at the exposure's far end. Not
    the windows' dispersion: a change of phase between them is what this tells apart, and it is
    what inflates the dispersion."""
    z = 1.96 * math.sqrt(max(x.n, 1))
    lo = max(0.0, x.n - z) / x.counted if x.counted > 0 else 0.0
    e_lo = sum(max(e * (1.0 - rel - 1.96 * rand), EFFECTIVE_FLOOR * c) for _, e, rel, c, rand in x.parts)
    hi = (x.n + z + 1.0) / e_lo if e_lo > 0 else math.inf
    return lo, hi


def _consistent(a: _Unit, b: _Unit) -> bool:
    """Whether two sets of windows can have seen the same rate: their rate ranges overlap. Seen in
    the randomized eBPF runs: the scout's many calls of a function that then stopped, pooled into a
    later long window that saw none and trimmed away as resting on the exposure, read 0 calls/s."""
    a_lo, a_hi = _rate_range(a)
    b_lo, b_hi = _rate_range(b)
    return a_lo <= b_hi and b_lo <= a_hi


def _dispersion(units: Sequence[_Unit]) -> tuple[float, int]:
    """How much more the windows' counts vary than Poisson counts would (phi, at least 1), and the
    degrees of freedom behind it: from the windows inside each interval where they give
    DISPERSION_DOF or more (a change between intervals does not count); else from those and from
    one interval to the next (a change of phase counts once). A job whose calls come in bursts has
    phi about the burst's size, whatever the windows' lengths: a short window that caught a burst is
    then no surprise. (From one interval's two windows alone, t with one degree of freedom made a
    95% interval 12.7 sigma wide: a 5-s attach's rate read 98k +- 74k where every window agreed.)"""
    chi, dof = 0.0, 0
    for a in units:
        if a.k >= 2 and a.n > 0:
            chi += a.s2 * a.e / a.n - a.n
            dof += a.k - 1
    if dof < DISPERSION_DOF:
        for a, b in zip(units, units[1:]):
            n, e = a.n + b.n, a.e + b.e
            if n > 0:
                r = n / e
                chi += (a.n / a.e - b.n / b.e) ** 2 / (r * (1 / a.e + 1 / b.e))
                dof += 1
    # The Poisson floor counts as DISPERSION_PRIOR windows' worth of evidence: with one or two degrees
    # of freedom, t made a 95% interval 12.7 or 4.3 sigma wide wherever the windows agreed (a 1-s job
    # from its start, whose scout and one window read 13.4k and 13.8k calls/s, 13.7k +- 22.4k; top's
    # rows, a window every other interval): a job shown to burst still widens it as its windows do.
    if not dof:
        return 1.0, 0
    return max(1.0, (chi + DISPERSION_PRIOR) / (dof + DISPERSION_PRIOR)), dof + DISPERSION_PRIOR


def _collapse(units: list[_Unit]) -> list[_Unit]:
    """Intervals whose windows counted far less than the others (the first interval's scout, a
    window cut short) pooled with the next one (the last with the one before): one short window
    that caught a burst must not stand for its whole interval."""
    if len(units) < 2:
        return units
    # By the time the windows were open, not their effective time: a window the probes nearly
    # stopped the job in is short in effective time but no less of a sample of its interval.
    typical = sorted(x.counted for x in units)[len(units) // 2]
    out: list[_Unit] = []
    pending: _Unit | None = None
    for x in units:
        if pending is not None:
            x = _merged(pending, x)
            pending = None
        if x.counted < SMALL_UNIT * typical:
            pending = x
            continue
        out.append(x)
    if pending is not None:
        if out:
            out[-1] = _merged(out[-1], pending)
        else:
            out.append(pending)
    return out


def _firm(x: _Unit) -> bool:
    return not x.alone and not x.exact and any(p[2] <= FIRM_REL for p in x.parts)


def _absorb_loose(units: list[_Unit]) -> list[_Unit]:
    """An interval none of whose windows' rates is firm (the exposure moves each by more than
    FIRM_REL), beside a far longer window whose rate is (a rarer function's own window, FIRM_FACTOR
    times its counting time or more) and can be the same (`_consistent`), is pooled with the
    latter: the next such one, else the one before (where trimming leaves out its windows that rest
    on the exposure most)."""
    out = list(units)
    i = 0
    while i < len(out):
        x = out[i]
        if not _firm(x) and not x.alone and not x.exact:
            def fits(j: int) -> bool:
                return _firm(out[j]) and out[j].counted >= FIRM_FACTOR * x.counted and _consistent(x, out[j])
            near = [j for j in range(i + 1, len(out)) if fits(j)][:1] or [j for j in range(i - 1, -1, -1) if fits(j)][:1]
            if near:
                j = near[0]
                out[j] = _merged(out[j], x)
                del out[i]
                continue
        i += 1
    return out


def _unvoided(units: list[_Unit]) -> list[_Unit]:
    """The intervals before the first with a firm rate whose windows are all void (VOID_REL: the
    scout's, which probes every function) are stood for by that first firm one where they can agree
    with it: their windows are left out, their time goes to its, as a windowless interval's does.
    Only those: a void window's lower bound is weak (a fifth of the rate where probes took 80%), and
    one later in a session may be the only window that saw a burst of a new phase (the randomized
    eBPF runs read a 0.5-s phase of 158k calls/s as 5.7k +- 0.6k when any void interval could go)."""
    first = next((i for i, x in enumerate(units) if _firm(x)), None)
    if not first:
        return units
    lead = units[:first]
    if any(x.alone or x.exact or not x.parts or any(p[2] < VOID_REL for p in x.parts) or
           not _consistent(x, units[first]) for x in lead):
        return units
    units[first].u += sum(x.u for x in lead)
    return units[first:]


def _merged(a: _Unit, b: _Unit) -> _Unit:
    """Two intervals' windows as one (sums field by field; a merged unit is never a discovery alone,
    and never an exact count: neither is merged)."""
    return _Unit(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(_Unit)
                    if f.name not in ("alone", "exact")})


# The least calls a pacer (`_paced`) counted in each of the two intervals: its rates' ratio then
# moves by 5% or less from its counts' noise (two Poisson counts of 400: 1/sqrt(200) = 7% at one
# sigma on the ratio, less once several windows pool).
PACER_MIN_CALLS = 400


def _paced(per_obs: Sequence[Mapping[int, "_Unit"]], f: int, i_now: int, i_unit: int) -> float:
    """The job's pace in interval i_now against interval i_unit, for a function f sampled in the
    latter and not the former, where no marker of its windows measured both: the rate of the
    function sampled in both that counted the most calls in each (PACER_MIN_CALLS at least), there
    against there; 1 without one. Functions called in the same steps keep their ratio (JAX on an
    H100: its once-a-step functions, sampled in three intervals of six, stood at their rate of a slow
    interval through a fast one that its 16-a-step function's windows saw 84% faster, under
    another marker: -12% against +0.8%, their lockstep broken)."""
    if i_unit < 0 or i_now < 0 or i_unit == i_now:
        return 1.0
    best: tuple[int, float] | None = None
    for p, a in per_obs[i_now].items():
        b = per_obs[i_unit].get(p)
        if p == f or b is None or a.alone or b.alone or a.e <= 0 or b.e <= 0:
            continue
        n = min(a.n, b.n)
        if n >= PACER_MIN_CALLS and (best is None or n > best[0]):
            best = (n, (a.n / a.e) / (b.n / b.e))
    return best[1] if best is not None else 1.0


def estimate(observations: Sequence[Observation], expo: Exposures = UNMEASURED,
             carry: Mapping[int, Carried] | None = None) -> dict[int, Estimate]:
    """Estimates for every function counted in `observations` (chronological).

    A function's time off the watch link is stood for by the windows that sampled it, interval by
    interval: each interval's rate is its windows' calls over their counting time, pooled (a short
    window weighs what it counted), and stands for that interval and the windowless ones after it.
    Intervals are not pooled with each other: the budget shortens windows where rates are high, so
    pooling by counting time would weigh busy stretches less than their time (read 9-20% low on the
    H200). `carry`: per function, the rate of the last windows before these observations, for
    intervals at their start that have none (a recent view's first ones)."""
    span = sum(o.span_s for o in observations)
    funcs: set[int] = set()
    for o in observations:
        funcs.update(f for f, n in o.watched_calls.items() if n)
        for w in o.windows:
            funcs.update(f for f, n in w.calls.items() if n)
        if carry:
            # Off the watch link and not probed here: the carried rate stands for that time.
            funcs.update(f for f, u in o.unwatched_s.items() if u > 0 and f in carry and carry[f].rate_hz > 0)
    # Per observation and function, its windows pooled, worked out once per window and function.
    per_obs: list[dict[int, _Unit]] = []
    steps_hz = step_rates(observations)
    timings = []
    refs_of: list[dict[int | None, Reference]] = []
    for o in observations:
        refs = reference_rates(o)
        refs_of.append(refs)
        timings.append([(w, how, g, eff, rel, rand) for w in o.windows
                        for eff, rel, rand, how, g in (reading(w, expo, steps_hz, refs),)])
    # Per interval and function, the marker whose reference read all its windows there (None: not
    # one, or not all): the pace of the windowless intervals it stands for is that marker's there.
    paced_by: list[dict[int, int | None]] = []
    set_aside: dict[int, int] = {}  # calls in the windows left out below: observed all the same
    for o, timing in zip(observations, timings):
        # Functions that a window of this interval read against a reference (its steps, its marker)
        # probed: their windows of time here, read through the exposure, are left out (where probes
        # fill most of a window, an exposure off by a little moves its rate several-fold).
        anchored = {f for w, how, *_ in timing if how != "exposure" for f in w.probed}
        acc: dict[int, _Unit] = {}
        paced: dict[int, int | None] = {}
        last_resort: dict[int, _Unit] = {}
        for w, how, g_ref, eff, rel, rand in timing:
            ref = how != "exposure"
            # (A referenced window's rate has no range from the probes' share: its time is its own.)
            counted = eff if ref else w.counted_s
            probed = w.probed if len(w.probed) <= 2 * len(funcs) else funcs.intersection(w.probed)
            if not ref and not w.discovery and anchored & probed:
                for f in anchored & probed:
                    set_aside[f] = set_aside.get(f, 0) + w.calls.get(f, 0)
                probed = probed - anchored
            calls = w.calls
            into = last_resort if w.discovery else acc
            m = g_ref if how in ("kept", "marker") else None
            for f in probed:
                if not w.discovery:
                    paced[f] = m if paced.get(f, m) == m else None
                a = into.get(f)
                if a is None:
                    a = into[f] = _Unit()
                a.add(calls.get(f, 0), eff, rel, counted, rand)
        for f, a in last_resort.items():
            if f not in acc:
                a.alone = True
                acc[f] = a
        per_obs.append(acc)
        paced_by.append(paced)
    out: dict[int, Estimate] = {}
    parts: dict[int, _Figures] = {}
    for f in funcs:
        observed = set_aside.get(f, 0)
        exact = 0.0          # calls counted on the watch link
        unmeasured = 0.0
        carried_u = 0.0      # time stood for by `carry`, before the first window of f
        units: list[_Unit] = []
        # An interval on the watch link throughout (a kept function's), later than the last unit:
        # its exact count is the latest rate, and stands for windowless time off the link after it
        # (a kept function that turned hot leaves the watch link; where the budget then spaces
        # windows out, an old window's rate stood for it: 0 calls/s +-0 for 478k).
        latest_exact: tuple[int, float] | None = None
        stood: list[tuple[Observation, float]] = []  # (interval, its time off the watch link measured)
        pace: tuple[int, float] | None = None  # the last unit's marker and its rate in that interval
        # Windowless intervals since the last unit: (their time, the last unit's pace factor there,
        # their references). Where the next unit of windows saw another rate than the last
        # (`_consistent`: not their counts' noise), it takes the later half of their time and the
        # last one the earlier half: a function that stopped, or started, between two windows that
        # sampled it changed somewhere between them, as likely in the first half as in the second.
        # Carried forward whole, a function that stopped in a gap of windows went on at its old rate
        # to the next window (a job switching to CUDA-graph replay: its eager launches, where
        # windows came every other interval, read +15% on average). Else the last unit takes it all.
        pending: list[tuple[float, float, Mapping[int | None, Reference], int]] = []
        at_unit = -1  # the observation of the last unit

        def settle(nxt: _Unit | None, nxt_pace: tuple[int, float] | None, i_nxt: int) -> None:
            half = sum(x[0] for x in pending) / 2 if nxt is not None else math.inf
            at = 0.0
            for u_p, factor, refs_p, i_p in pending:
                first = min(u_p, max(0.0, half - at))
                units[-1].u += first * factor
                if u_p > first:
                    g_ref = refs_p.get(nxt_pace[0]) if nxt_pace is not None else None
                    nxt.u += (u_p - first) * (g_ref.rate_hz / nxt_pace[1] if g_ref is not None else
                                              _paced(per_obs, f, i_nxt, i_p))
                at += u_p
            pending.clear()

        for i_o, (o, d, refs, paced) in enumerate(zip(observations, per_obs, refs_of, paced_by)):
            c = o.watched_calls.get(f, 0)
            observed += c
            exact += c
            mine = d.get(f)
            u = min(o.unwatched_s.get(f, 0.0), o.span_s)  # the tally may run a little past the span
            if mine is not None:
                if u <= 0 and c:
                    # Probed in a window while on the watch link throughout (a kept function, timed
                    # with the rest): the window counted the same calls again.
                    mine = None
                else:
                    mine.u, mine.span = 0.0, o.span_s
                    g = paced.get(f)
                    mine_pace = (g, refs[g].rate_hz) if g is not None and g in refs and not mine.alone else None
                    if pending:
                        prev = units[-1]
                        changed = not (mine.alone or prev.alone or prev.exact or _consistent(prev, mine))
                        settle(mine if changed else None, mine_pace, i_o)
                    units.append(mine)
                    at_unit = i_o
                    observed += mine.n
                    latest_exact = None
                    pace = mine_pace
            if u <= 0:
                if pending:
                    settle(None, None, i_o)
                if o.span_s > 0 and (c or units or latest_exact):
                    latest_exact = (c, o.span_s)
                continue
            if mine is None and latest_exact is not None:
                n_x, span_x = latest_exact
                x = _Unit(span=span_x, exact=True)
                x.add(n_x, span_x, 0.0, span_x)
                units.append(x)
                latest_exact = pace = None
                at_unit = -1
            if units:
                # A windowless interval goes at the last unit's rate (or the next one's: `settle`),
                # times the job's pace there against the unit's, as the marker that read the unit's
                # windows measured both: functions counted together keep their ratio. (JAX on an
                # H100: three once-a-step functions probed only in one long window, whose
                # interval's reference read the job 11% fast, stood at that pace for the next three
                # intervals; the functions in every interval's windows read each at its own: +11%
                # against +5%.)
                if mine is not None:
                    units[-1].u += u  # its own interval
                else:
                    g_ref = refs.get(pace[0]) if pace is not None else None
                    pending.append((u, g_ref.rate_hz / pace[1] if g_ref is not None else
                                    _paced(per_obs, f, i_o, at_unit), refs, i_o))
                stood.append((o, u))
            elif carry and f in carry:
                carried_u += u
                stood.append((o, u))
            else:
                unmeasured += u
        if pending:
            settle(None, None, -1)
        sampled = var = rel_sys = half_walk = 0.0
        last = carry.get(f) if carry else None
        if last is not None and carried_u > 0:
            sampled += last.rate_hz * carried_u
            var += last.var * carried_u * carried_u
        windows = sum(x.k for x in units)
        dof = 0
        if units:
            # Intervals whose windows counted far less than the others are pooled with the next;
            # an interval whose only rate is a discovery span is never pooled (that span, long
            # and read low for a function just started, would outweigh the windows).
            runs: list[list[_Unit]] = [[]]
            for x in units:
                if x.alone or x.exact:
                    runs += [[x], []]
                else:
                    runs[-1].append(x)
            units = [x for r in runs if r for x in (r if r[0].alone or r[0].exact else _collapse(r))]
            units = _unvoided([x.trimmed() for x in _absorb_loose(units)])
            phi, dof = _dispersion([x for x in units if not x.alone])
            # The windows' rates from one to the next, each set standing for its span: how far an
            # interval's rate can be from the truth when the job changes between windows (a phase
            # that fell between two windows shows only there). The interval is never narrower.
            rates = [r for x in units for r in x.rates]
            k = len(rates)
            if k >= 2:
                ssd = sum((b - a) ** 2 for a, b in zip(rates, rates[1:]))
                spans_sq = sum(x.u * x.u for x in units)
                half_walk = t975(k - 1) * math.sqrt(ssd / (2 * (k - 1)) * spans_sq)
            for x in units:
                r = x.n / x.e
                sampled += r * x.u
                var += phi * max(x.n, 1) / (x.e * x.e) * x.u * x.u
                # The reference's count: one error for the whole unit (its windows share it), none
                # shared with another interval's (each has its own reference spans).
                var += (x.rand / x.e * r * x.u) ** 2
                rel_sys += x.sys / x.e * r * x.u
        measured = max(0.0, span - unmeasured)
        # After the loose units are absorbed, one window may be left standing for the whole span
        # (a rarer function's long window beside short ones whose rates rest on the exposure):
        # as with one window, nothing says how far its rate is from the span's.
        alone = len(units) == 1 and units[0].k == 1 and not units[0].exact
        if (windows == 1 or alone) and sampled > 0:
            # One window: nothing says how far its rate is from the span's; no more than the
            # whole of what it stands for, which is what t with no degree of freedom says.
            half = sampled
        else:
            half = max((t975(dof) if dof else 1.96) * math.sqrt(var), half_walk)
        half += rel_sys
        parts[f] = _Figures(observed, exact, sampled, half, measured, stood)
    # The step windows' figures, where they hold, in place of the windows of time's; a step
    # function's own windowed rate over its time off the watch link stands, with the rate it had
    # on it, for the steps of the time before it was kept.
    windowed = {g: _Windowed(p.sampled / t, p.half / t) for g, p in parts.items()
                if (t := sum(u for _, u in p.stood)) > 0}
    for f, p in parts.items():
        sampled, half = p.sampled, p.half
        by_steps = _by_steps(f, observations, p.stood, sampled, half, windowed)
        if by_steps is not None:
            sampled, half = by_steps
        total = p.exact + sampled
        measured = p.measured
        rate = total / measured if measured > 0 else 0.0
        out[f] = Estimate(
            calls_observed=p.observed,
            # Measured throughout: the calls themselves (rate x span may miss them by a rounding,
            # and --exact's estimated must equal its observed: seen on the job path).
            calls_estimated=total if measured >= span else rate * span if measured > 0 else 0.0,
            rate_hz=rate,
            err_hz=half / measured if measured > 0 else math.inf,
            measured_s=measured,
        )
    return out


@dataclass(frozen=True)
class _Figures:
    """One function's figures from its windows and the watch link, before the step windows'."""

    observed: int
    exact: float                          # calls counted on the watch link
    sampled: float                        # calls estimated for its time off the watch link
    half: float                           # their 95% half-width
    measured: float                       # seconds of the span measured
    stood: Sequence[tuple[Observation, float]]  # (interval, its time off the watch link measured)


@dataclass(frozen=True)
class _Windowed:
    """A function's rate over its time off the watch link, from its windows, and its 95% half-width."""

    rate_hz: float
    half_hz: float


def _combined(a: float, ha: float, b: float, hb: float) -> tuple[float, float]:
    """Two estimates of one rate (95% half-widths ha, hb) weighted by their variances; where they
    disagree by more than their errors say, the half-width scaled up by how far (the Birge ratio)."""
    if not (math.isfinite(hb) and hb > 0) or ha <= 0:
        return a, ha  # (b says nothing; a is exact)
    if not math.isfinite(ha):
        return b, hb
    wa, wb = 1 / (ha * ha), 1 / (hb * hb)
    r = (a * wa + b * wb) / (wa + wb)
    h = 1 / math.sqrt(wa + wb)
    return r, h * max(1.0, abs(a - b) / math.hypot(ha, hb))


def _by_steps(f: int, observations: Sequence[Observation], stood: Sequence[tuple[Observation, float]],
              sampled: float, half: float, windowed: Mapping[int, _Windowed] | None = None
              ) -> tuple[float, float] | None:
    """f's sampled calls as its step windows give them, and their 95% half-width: where it has step
    windows (all of one step function), its calls a step pooled over them (calls over steps) times the step function's
    calls in each interval, for its time off the watch link there (in the intervals before the step
    function was counted, its mean rate over those it was; where it stops being counted, as when it
    turns hot, none: the job changed). Windows of time read the job at
    its pace in them (on the H200 a GPT-2 step's functions all read 0.69-1.36x in one ~100-ms
    window); steps counted whole do not, so they stand for the whole span, unless the estimate
    from all the windows (`sampled` +- `half`) is not within its interval of theirs: a change of
    what a step calls, which windows of time between them may have seen. None: no step windows,
    or that.

    The half-width: from the windows' residuals about the pooled ratio (Student's t), never less
    than the calls' Poisson error; with one step window, never less than how far the estimate from
    all the windows is (nothing else says how much one step stands for), and the result is that
    weighed with the estimate from the windows of time (`_combined`)."""
    wins = [w for o in observations for w in o.windows if w.steps and f in w.probed and w.step_func is not None]
    if not wins or not stood:
        return None
    # The step function of most of them (the latest where as many): a window of another's steps
    # counts its steps in this one's at their rates' ratio (on an H100 a conv net's two once-a-step
    # functions, at one rate, took turns as the policy's step; its three step windows were then set
    # aside, and its rarer functions read from windows of time, -7% beside +3%).
    kinds = [w.step_func for w in wins]
    g = max(reversed(kinds), key=kinds.count)
    if f in kinds:
        return None  # (a step function's own calls a step are the steps: its count is its rate)
    if any(k != g for k in kinds):
        hz = step_rates(observations)
        wins = [w if w.step_func == g else replace(w, steps=w.steps * hz[g] / hz[w.step_func])
                for w in wins if w.step_func == g or (g in hz and hz.get(w.step_func))]
    # The step function's rate in each interval, where it was on the watch link for most of it.
    def step_hz(o: Observation) -> float | None:
        return watched_rate(o, g, STEP_WATCHED_MIN)

    known = [r for o in observations if (r := step_hz(o)) is not None]
    if not known:
        return None
    mean_hz = sum(known) / len(known)
    steps_of = guessed = 0.0
    seen_known = False
    for o, u in stood:
        r = step_hz(o)
        if r is None:
            if seen_known:
                return None  # it left the watch link (turned hot, say): the job changed
            guessed += min(u, o.span_s)  # before it was kept: its mean over the intervals it was
        else:
            seen_known = True
            steps_of += r * min(u, o.span_s)
    # The time before it was kept: the step function's rate on the watch link, as far off as
    # those intervals' rates spread (half the mean with fewer than two of them), weighed against
    # its own windows' rate there (`windowed`). The rate it had once kept alone read 933 steps/s for
    # the 4.4 s before where the job made 801 (the MLP on the H200 sped up as the attach went on;
    # its windows read 812).
    pre_hz, pre_h = mean_hz, (t975(len(known) - 1) * statistics.stdev(known) if len(known) >= 2 else 0.5 * mean_hz)
    if guessed > 0 and windowed and g in windowed:
        pre_hz, pre_h = _combined(pre_hz, pre_h, windowed[g].rate_hz, windowed[g].half_hz)
    steps_of += pre_hz * guessed
    n = [w.calls.get(f, 0) for w in wins]
    k = [w.steps for w in wins]
    ratio = sum(n) / sum(k)
    est = ratio * steps_of
    m = len(wins)
    var = max(1, sum(n)) / sum(k) ** 2  # Poisson
    if m >= 2:
        resid = sum((a - ratio * b) ** 2 for a, b in zip(n, k)) * m / (m - 1) / sum(k) ** 2
        h = max(t975(m - 1) * math.sqrt(resid), 1.96 * math.sqrt(var)) * steps_of
    else:
        h = max(1.96 * math.sqrt(var) * steps_of, abs(sampled - est))
    if guessed > 0:
        h += ratio * pre_h * guessed  # (the time whose steps were not counted)
    if abs(sampled - est) > half:
        return None  # not within the interval of the estimate from every window: not one rate a step
    if m >= 2:
        return est, h
    # One step window: the windows of time measured the same calls in other windows, and the two
    # estimates are weighed by their variances. One step of a rarer function may hold a few calls
    # (decode's 2-3k/s functions on an H100: 6 in the one step window of a 5-s attach, +-80% by
    # Poisson, where its windows of time said +-54%): each said "not known", together they are
    # known (25 such pairs of the H100's saved attaches, all within 5% of the truth). With two or
    # more, the step windows stand alone: they see a change of pace that windows of time missed.
    return _combined(est, h, sampled, half)


def last_rates(observations: Sequence[Observation], expo: Exposures) -> dict[int, Carried]:
    """Per function, the rate of the last interval whose windows sampled it (pooled by counting
    time): what a view starting after `observations` carries into its first windowless intervals."""
    out: dict[int, Carried] = {}
    for o in observations:
        by_f: dict[int, _Unit] = {}
        steps_hz, refs = step_rates([o]), reference_rates(o)
        for w in sorted(o.windows, key=lambda w: w.discovery):
            if w.discovery and any(f in by_f for f in w.probed):
                continue
            eff = window_time(w, expo, steps_hz, refs)[0]
            for f in w.probed:
                by_f.setdefault(f, _Unit()).add(w.calls.get(f, 0), eff, 0.0, w.counted_s)
        for f, a in by_f.items():
            phi = max(1.0, (a.s2 * a.e / a.n - a.n) / (a.k - 1)) if a.k >= 2 and a.n > 0 else 1.0
            out[f] = Carried(a.n / a.e, phi * max(a.n, 1) / (a.e * a.e))
    return out


@dataclass
class MarkerPool:
    """The marker's counts over a session's windows (of one kind), as running sums.

    A job that has no slack runs at its untraced rate less the share of time its probes take:
    rate = r0 (1 - k p), p the calibrated probe time over the span, k the exposure; in the window p
    is the window's, in the reference the marker's own. So (rate in / rate out) = (1 - k p_in) /
    (1 - k p_out) gives k. The ratio is a ratio estimator over the windows, sum(in) / sum(x) with x
    a window's reference count scaled to its length; its variance comes from the windows'
    residuals (in - ratio x), so a bursty job, whose windows and references see different parts of
    its bursts, gets the wide interval it deserves, not a Poisson one."""

    k: int = 0
    n_in: float = 0.0
    n_out: int = 0
    x: float = 0.0        # sum of the references' counts scaled to their windows' lengths
    xx: float = 0.0
    ii: float = 0.0
    ix: float = 0.0
    t_in: float = 0.0
    t_out: float = 0.0
    probe_s: float = 0.0
    probe_out_s: float = 0.0

    def add(self, w: Window) -> None:
        m = w.marker
        if m is None or m.in_s <= 0 or m.out_s <= 0:
            return
        x = m.calls_out * m.in_s / m.out_s
        self.k += 1
        self.n_in += m.calls_in
        self.n_out += m.calls_out
        self.x += x
        self.xx += x * x
        self.ii += m.calls_in * m.calls_in
        self.ix += m.calls_in * x
        self.t_in += m.in_s
        self.t_out += m.out_s
        self.probe_s += w.probe_s
        self.probe_out_s += m.out_probe_s

    def exposure(self, min_calls: int = 30) -> Exposure:
        if self.n_in < min_calls or self.n_out < min_calls or self.probe_s <= 0 or self.x <= 0:
            return UNMEASURED_EXPOSURE
        p_in, p_out = self.probe_s / self.t_in, self.probe_out_s / self.t_out

        def k_of(ratio: float) -> float:
            # k falls with the ratio, without bound as it nears p_in / p_out (where d is 0): a ratio at
            # or past that point bounds k from below by nothing. (It once read EXPOSURE_MAX: a ratio
            # interval from below 1 to past that point then gave "measured, 3.0 +- 0", the exposure's
            # most stated as known, where the markers said nothing of it: GPT-2's on an H100, two
            # simcuda clients under `top --once`.)
            d = p_in - ratio * p_out
            return (1.0 - ratio) / d if d > 1e-12 else -math.inf

        ratio = self.n_in / self.x
        rel = 1.96 * math.sqrt(1.0 / self.n_in + 1.0 / self.n_out)  # Poisson
        if self.k >= 2:
            resid = max(0.0, self.ii - 2 * ratio * self.ix + ratio * ratio * self.xx) * self.k / (self.k - 1)
            rel = max(rel, t975(self.k - 1) * math.sqrt(resid) / self.n_in)
        else:
            rel = max(rel, 1.0)  # one window: nothing says how far its reference is from it
        raw_lo, raw_hi = k_of(ratio * (1 + rel)), k_of(max(ratio * (1 - rel), 0.0))  # k falls as the ratio rises
        if raw_hi < 0.0 or raw_lo > EXPOSURE_MAX or raw_lo > raw_hi:
            # (raw_lo > raw_hi: the ratio's interval straddles the point where the model has no
            # finite k, and the two ends came out in the wrong order: a negative width otherwise.)
            # The marker says the model does not fit (the job ran faster in windows, or slowed far
            # more than probes can): nothing is measured, all that stands is the range.
            return UNMEASURED_EXPOSURE
        lo, hi = max(raw_lo, 0.0), min(raw_hi, EXPOSURE_MAX)
        if lo <= 0.0 and hi >= EXPOSURE_MAX:
            return UNMEASURED_EXPOSURE  # (the whole range: the markers narrowed nothing)
        return Exposure((lo + hi) / 2, (hi - lo) / 2 + 1e-12, True)


@dataclass
class StepPool:
    """The exposure as step windows measure it, pooled over a session's (of one kind): a step
    window's steps took its counting time under its probes and steps / R untraced (R: the step
    function's calls a second over the window's interval, counted exactly on the watch link), so
    the time it lost against its calibrated probe time is the exposure, whole steps at a time (a
    marker's reference span sees other parts of a bursty step than its window does: on the H200 a
    GPT-2 step's counted windows measured 1.5 +- 1.5). A ratio estimator, sum(lost) / sum(probe),
    its interval from the windows' residuals (the job's own pace moves each window's steps)."""

    lost: list[float] = field(default_factory=list)
    probe: list[float] = field(default_factory=list)
    stepped: list[float] = field(default_factory=list)

    def add(self, w: Window, step_hz: float | None) -> None:
        if not w.steps or not step_hz or w.probe_s <= 0 or w.counted_s <= 0:
            return
        self.lost.append(w.counted_s - w.steps / step_hz)
        self.probe.append(w.probe_s - w.stepped_s)
        self.stepped.append(w.stepped_s)

    def exposure(self, min_windows: int = 3) -> Exposure:
        """The windows' single-stepped hits took their share of the time lost too, at a cost that
        nothing here measures (0 to EXPOSURE_MAX times their calibrated time, as
        `Exposure.effective_s` holds them): taken out at the middle of that range, their whole range
        widens the interval. (Left in, on this project's CI host a step window's 0.1 ms of
        single-stepped hits beside 0.04 ms of emulated ones read the exposure 3-5 where the rest
        was about 1.3.)"""
        n, p = len(self.lost), sum(self.probe)
        if n < min_windows or p <= 0:
            return UNMEASURED_EXPOSURE
        mid = EXPOSURE_MAX / 2
        lost = [x - mid * s for x, s in zip(self.lost, self.stepped)]
        k = sum(lost) / p
        resid = sum((x - k * y) ** 2 for x, y in zip(lost, self.probe)) * n / (n - 1)
        half = t975(n - 1) * math.sqrt(resid) / p + mid * sum(self.stepped) / p
        lo, hi = max(0.0, k - half), min(EXPOSURE_MAX, k + half)
        if lo <= 0.0 and hi >= EXPOSURE_MAX:
            return UNMEASURED_EXPOSURE  # (the whole range: the single-stepped hits' cost hides the rest)
        if lo > hi:
            return Exposure(EXPOSURE_MAX / 2, EXPOSURE_MAX / 2, True)
        return Exposure((lo + hi) / 2, (hi - lo) / 2 + 1e-12, True)


def _narrower(a: Exposure, b: Exposure) -> Exposure:
    """Of two measures of one exposure, the measured one with the narrower interval."""
    if not b.measured:
        return a
    if not a.measured:
        return b
    return a if a.err <= b.err else b


class MarkerPools:
    """A MarkerPool for each kind of window, and a StepPool for each: each kind's exposure is the
    narrower of the two measures."""

    def __init__(self) -> None:
        self.counted, self.timed = MarkerPool(), MarkerPool()
        self.steps_counted, self.steps_timed = StepPool(), StepPool()

    def add(self, w: Window, step_hz: float | None = None) -> None:
        (self.timed if w.timed else self.counted).add(w)
        (self.steps_timed if w.timed else self.steps_counted).add(w, step_hz)

    def exposures(self) -> Exposures:
        return Exposures(_narrower(self.counted.exposure(), self.steps_counted.exposure()),
                         _narrower(self.timed.exposure(), self.steps_timed.exposure()))


# --- a session's observations as plain data (bench/audit_gpu.py reads them back to check estimators) ---

def dump_observations(observations: Sequence[Observation], expo: Exposures) -> dict:
    def window(w: Window) -> dict:
        d = {"counted_s": w.counted_s, "probed": sorted(w.probed), "calls": {str(f): n for f, n in w.calls.items()},
             "probe_s": w.probe_s, "timed": w.timed, "stepped_s": w.stepped_s, "discovery": w.discovery}
        if w.marker is not None:
            d["marker"] = [w.marker.calls_in, w.marker.in_s, w.marker.calls_out, w.marker.out_s, w.marker.out_probe_s,
                           w.marker.func]
        if w.step_func is not None and w.steps:
            d["step"] = [w.step_func, w.steps]
        if w.kept_in:
            d["kept_in"] = {str(f): n for f, n in w.kept_in.items()}
        return d

    return {
        "exposures": {k: [e.value, e.err, e.measured] for k, e in (("counted", expo.counted), ("timed", expo.timed))},
        "observations": [{"span_s": o.span_s, "windows": [window(w) for w in o.windows],
                          "watched_calls": {str(f): n for f, n in o.watched_calls.items()},
                          "unwatched_s": {str(f): u for f, u in o.unwatched_s.items()},
                          **({"apart": sorted(o.apart)} if o.apart else {})} for o in observations],
    }


def load_observations(doc: dict) -> tuple[list[Observation], Exposures]:
    def window(d: dict) -> Window:
        m = d.get("marker")
        step = d.get("step") or (None, 0)
        return Window(d["counted_s"], frozenset(d["probed"]), {int(f): n for f, n in d["calls"].items()},
                      d["probe_s"], MarkerCount(*m) if m else None, d["timed"], d["stepped_s"], d["discovery"],
                      step_func=step[0], steps=step[1],
                      kept_in={int(f): n for f, n in d.get("kept_in", {}).items()})

    ex = doc["exposures"]
    expo = Exposures(Exposure(*ex["counted"]), Exposure(*ex["timed"]))
    obs = [Observation(o["span_s"], tuple(window(w) for w in o["windows"]),
                       {int(f): n for f, n in o["watched_calls"].items()},
                       {int(f): u for f, u in o["unwatched_s"].items()},
                       frozenset(o.get("apart", o.get("kept_apart", ())))) for o in doc["observations"]]
    return obs, expo
