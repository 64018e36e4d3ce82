"""From counted calls to rates: what each interval measured, and estimates over any run of intervals.

In each interval, each of a process's functions is measured in one of these ways:

- watched: on the watch link (functions not seen called yet stay probed all the time, and cost
  nothing until called), its count over the time it was there is exact;
- sampled: probed in the interval's windows, whose rates stand for the rest of the interval;
- carried: neither (the budget spaced windows out), so the last windows that sampled it stand in;
- not measured: never sampled and off the watch link; no figure is made up for that time.

A window's rate is its calls over the time the job would have needed for them untraced: probes
slow a job that has no slack, so the window is shortened by the probe time that showed, which the
marker measures (`Exposure`: the share of the calibrated probe time the job lost, pooled over the
windows). Until it has, the exposure is known only to lie between 0 and `EXPOSURE_MAX`, and that
range is part of the stated uncertainty.

The uncertainty of an estimate (95%) adds three parts: counts (Poisson), how the windows' rates vary
from one to the next (a bursty or changing job varies more than counts do; from one to the next,
not around their mean, so a change of phase counts once; with Student's t for few windows), and the
exposure's, which is the same share of every sampled rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

# The most a probe's calibrated time is multiplied by in a real job: hits in a large process miss
# caches the calibration loop keeps warm (about 2x for counted hits on the H200,
# bench/results/tracer-costs-h200.md).
EXPOSURE_MAX = 3.0
EFFECTIVE_FLOOR = 0.05  # a window never stands for less than this share of its length


@dataclass(frozen=True)
class MarkerCount:
    """One window's marker: calls of one function inside the window and in the reference span
    just before it (the marker alone probed, at `out_probe_s` of calibrated probe time)."""

    calls_in: int
    in_s: float
    calls_out: int
    out_s: float
    out_probe_s: float = 0.0


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


@dataclass(frozen=True)
class Observation:
    """One interval of one process."""

    span_s: float
    windows: tuple[Window, ...] = ()
    watched_calls: Mapping[int, int] = field(default_factory=dict)  # counted on the watch link
    # Seconds of the span each function spent off the watch link; absent: on it throughout.
    unwatched_s: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Exposure:
    """The share of the windows' calibrated probe time the job lost (1: as calibrated; 0: hidden)."""

    value: float
    err: float                        # 95% half-width
    measured: bool

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


def estimate(observations: Sequence[Observation], expo: Exposures = UNMEASURED,
             carry: Mapping[int, Carried] | None = None) -> dict[int, Estimate]:
    """Estimates for every function counted in `observations` (chronological).

    `carry`: per function, the rate of the last windows before these observations,
    for intervals at their start that have none (a recent view's first intervals)."""
    span = sum(o.span_s for o in observations)
    funcs: set[int] = set()
    for o in observations:
        funcs.update(f for f, n in o.watched_calls.items() if n)
        for w in o.windows:
            funcs.update(f for f, n in w.calls.items() if n)
    # Per observation and function, what its windows there say: (calls counted, their rates in
    # order, the mean rate and its variance, the mean exposure error), worked out once per
    # window and function rather than in the loop below.
    per_obs: list[dict[int, tuple[int, list[float], Carried, float]]] = []
    for o in observations:
        acc: dict[int, list] = {}
        for w in o.windows:
            eff, rel = expo.effective_s(w), expo.rel_err(w)
            probed = w.probed if len(w.probed) <= 2 * len(funcs) else funcs.intersection(w.probed)
            calls = w.calls
            for f in probed:
                n = calls.get(f, 0)
                a = acc.get(f)
                if a is None:
                    acc[f] = [n, [n / eff], n / (eff * eff), rel]
                else:
                    a[0] += n
                    a[1].append(n / eff)
                    a[2] += n / (eff * eff)
                    a[3] += rel
        per_obs.append({f: (n, rs, Carried(sum(rs) / len(rs), v / (len(rs) * len(rs))), rel / len(rs))
                        for f, (n, rs, v, rel) in acc.items()})
    out: dict[int, Estimate] = {}
    for f in funcs:
        observed = 0
        exact = 0.0          # calls counted on the watch link
        sampled = 0.0        # calls estimated for the time off it
        var_poisson = 0.0    # of `sampled`, from the windows' counts
        spans_sq = 0.0       # sum of (time off the watch link stood for by one set of windows)^2
        rel_sys = 0.0        # the exposure's share, weighted by the time it applies to
        unmeasured = 0.0
        rates: list[float] = []  # every window's rate, in order, for the successive differences
        last = carry.get(f) if carry else None  # the windows that last sampled f
        last_rel = 0.0
        group_s = 0.0        # time off the watch link that the current `last` stands for
        for o, d in zip(observations, per_obs):
            c = o.watched_calls.get(f, 0)
            observed += c
            exact += c
            u = min(o.unwatched_s.get(f, 0.0), o.span_s)  # the tally may run a little past the span
            mine = d.get(f)
            if mine is not None:
                spans_sq += group_s * group_s
                group_s = 0.0
                n, rs, last, last_rel = mine
                observed += n
                rates.extend(rs)
            if u <= 0:
                continue
            if last is None:
                unmeasured += u
                continue
            sampled += last.rate_hz * u
            var_poisson += last.var * u * u  # the same windows for all of it: errors add up
            rel_sys += last_rel * last.rate_hz * u
            group_s += u
        spans_sq += group_s * group_s
        measured = max(0.0, span - unmeasured)
        total = exact + sampled
        rate = total / measured if measured > 0 else 0.0
        half = 1.96 * math.sqrt(var_poisson)
        k = len(rates)
        if k >= 2:
            ssd = sum((b - a) ** 2 for a, b in zip(rates, rates[1:]))
            # Each set of windows stands for its span: the rate's variation between windows, as one
            # window's deviation from the mean rate of the span it stands for.
            var_between = ssd / (2 * (k - 1)) * spans_sq
            half = max(half, t975(k - 1) * math.sqrt(var_between))
        elif k == 1 and sampled > 0:
            # One window: nothing says how far its rate is from the span's; no more than the
            # whole of what it stands for, which is what t with no degree of freedom says.
            half = max(half, sampled)
        half += rel_sys
        out[f] = Estimate(
            calls_observed=observed,
            calls_estimated=rate * span if measured > 0 else 0.0,
            rate_hz=rate,
            err_hz=half / measured if measured > 0 else math.inf,
            measured_s=measured,
        )
    return out


def last_rates(observations: Sequence[Observation], expo: Exposures) -> dict[int, Carried]:
    """Per function, the rate of the last interval whose windows sampled it: what a view starting
    after `observations` carries into its first windowless intervals."""
    out: dict[int, Carried] = {}
    for o in observations:
        by_f: dict[int, list[tuple[float, float]]] = {}
        for w in o.windows:
            eff = expo.effective_s(w)
            for f in w.probed:
                n = w.calls.get(f, 0)
                by_f.setdefault(f, []).append((n / eff, n / (eff * eff)))
        for f, rv in by_f.items():
            k = len(rv)
            out[f] = Carried(sum(r for r, _ in rv) / k, sum(v for _, v in rv) / (k * k))
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
            d = p_in - ratio * p_out
            return (1.0 - ratio) / d if d > 1e-12 else EXPOSURE_MAX

        ratio = self.n_in / self.x
        rel = 1.96 * math.sqrt(1.0 / self.n_in + 1.0 / self.n_out)  # Poisson
        if self.k >= 2:
            resid = max(0.0, self.ii - 2 * ratio * self.ix + ratio * ratio * self.xx) * self.k / (self.k - 1)
            rel = max(rel, t975(self.k - 1) * math.sqrt(resid) / self.n_in)
        else:
            rel = max(rel, 1.0)  # one window: nothing says how far its reference is from it
        raw_lo, raw_hi = k_of(ratio * (1 + rel)), k_of(max(ratio * (1 - rel), 0.0))  # k falls as the ratio rises
        if raw_hi < 0.0 or raw_lo > EXPOSURE_MAX:
            # The marker says the model does not fit (the job ran faster in windows, or slowed far
            # more than probes can): all that stands is the range.
            return Exposure(EXPOSURE_MAX / 2, EXPOSURE_MAX / 2, True)
        lo, hi = max(raw_lo, 0.0), min(raw_hi, EXPOSURE_MAX)
        return Exposure((lo + hi) / 2, (hi - lo) / 2 + 1e-12, True)


class MarkerPools:
    """A MarkerPool for each kind of window."""

    def __init__(self) -> None:
        self.counted, self.timed = MarkerPool(), MarkerPool()

    def add(self, w: Window) -> None:
        (self.timed if w.timed else self.counted).add(w)

    def exposures(self) -> Exposures:
        return Exposures(self.counted.exposure(), self.timed.exposure())
