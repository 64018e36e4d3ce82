"""Frozen snapshots the tracer hands to renderers; units are in the field names.

`None` in a float field means exactly one thing: not measured (for example the per-call time of a
function that was only counted, never timed; every figure of a process that no window measured,
which then says why in `not_measured`). JSON shows it as null.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from gputrace.base.units import fmt_ns, fmt_rate

from .classify import FunctionClass

# A sampled rate is "not known" where its 95% half-width is more than KNOWN_REL_MAX of it (the figure
# could be off by more than half: a reader would take it for a measurement), or where it rests on
# fewer than KNOWN_MIN_CALLS calls seen (too few for any stated interval to be trusted). Known whatever
# its size: a rate counted throughout (half-width 0), a sampled 0 (no call seen: what was seen), and
# one whose half-width is KNOWN_ABS_HZ at most (a set-up call counted once, beside a scout that saw
# none of it: no audit moves by 10 calls a second, 0.01% of a second at 10 us a call).
KNOWN_REL_MAX = 0.5
KNOWN_MIN_CALLS = 10
KNOWN_ABS_HZ = 10.0
# How `implausible`'s reasons begin: a rate its calls' measured time rules out makes every sum it is
# in not known too (a class's, the process's), where a sum of rates merely not known may be known.
IMPLAUSIBLE = "not possible: "
IMPLAUSIBLE_MARGIN = 2.0


def unknown_reason(calls_observed: int, rate_hz: float, err_hz: float | None) -> str | None:
    """Why a rate is not known (None: it is): the one rule for every function's and process's rate."""
    if err_hz == 0.0 or rate_hz == 0.0:
        return None
    if err_hz is None:
        return "no interval could be stated"
    if err_hz <= KNOWN_ABS_HZ:
        return None
    if calls_observed < KNOWN_MIN_CALLS:
        return f"rests on {calls_observed} calls seen"
    if err_hz > KNOWN_REL_MAX * rate_hz:
        return f"95% interval {fmt_range(rate_hz, err_hz)} calls/s"
    return None


def implausible(rate_hz: float, mean_ns: float | None, threads: int | None) -> str | None:
    """Why a rate cannot be (None: it can): at its measured time per call (`mean_ns`, the probes'
    own taken out) it would keep more than IMPLAUSIBLE_MARGIN times as many threads inside the
    call as the process has, doing nothing else. The one check of an estimate against what its
    calls' measured time allows: one that far off (a 1-s native program read at 11.2M launches a
    second, 2 us each, by one thread; a simcuda client at 5.7M for 0.74M) is not shown as a rate,
    whatever interval it states. (The margin: a thread that waits in one call all the time, a few
    percent over in rate and per-call time, is no sign of an estimate gone wrong.)"""
    if not mean_ns or not threads or rate_hz <= 0:
        return None
    busy = rate_hz * mean_ns * 1e-9
    if busy <= IMPLAUSIBLE_MARGIN * threads:
        return None
    return (f"{IMPLAUSIBLE}{fmt_rate(rate_hz)} calls/s at {fmt_ns(mean_ns)} a call would keep {busy:.1f} "
            f"threads in it; the process has {threads}")


def fmt_range(rate_hz: float, err_hz: float) -> str:
    return f"{fmt_rate(max(0.0, rate_hz - err_hz))}-{fmt_rate(rate_hz + err_hz)}"


@dataclass(frozen=True)
class FunctionStats:
    name: str
    cls: FunctionClass
    calls_observed: int            # entry hits while probes were attached
    calls_estimated: float         # over the whole interval, from the observed rate
    rate_hz: float
    rate_err_hz: float | None      # 95% half-width of rate_hz (0 when counted throughout; None: not known)
    timed_calls: int               # calls whose duration was measured
    mean_ns: float | None          # per-call time, probe bias subtracted
    outer_mean_ns: float | None    # the same for calls not made from inside another traced call
    p50_ns: float | None
    p99_ns: float | None
    hist: tuple[int, ...] = ()     # log2 buckets of observed durations (slot k: [2^(k-1), 2^k) ns)
    # Why rate_hz is not known (`unknown_reason`); None: known. A rate not known is never shown as a
    # figure: renderers say "not known" and JSON has null, with its 95% range beside it.
    not_known: str | None = None

    @property
    def cpu_s_per_s(self) -> float:
        """Time per second inside this function's outermost calls (0 when never timed)."""
        return self.rate_hz * (self.outer_mean_ns or 0.0) * 1e-9


@dataclass(frozen=True)
class ClassTotals:
    cls: FunctionClass
    rate_hz: float
    time_s_per_s: float
    rate_err_hz: float | None = None  # its functions' half-widths added (None: one is not known)
    not_known: str | None = None      # `unknown_reason` over its functions; None: known


@dataclass(frozen=True)
class ProcessSnapshot:
    pid: int
    comm: str
    interval_s: float
    window_s: float                # time probes were attached in the interval
    target_cpu_s: float | None     # the process's CPU time over the interval (/proc)
    functions: tuple[FunctionStats, ...]
    tracer_cost_s: float           # job time the tracer's probes and links cost the process
    driver_cpu_s_per_s: float | None  # time/s in non-synchronizing driver calls
    wait_s_per_s: float | None     # time/s blocked in synchronization calls
    classes: tuple[ClassTotals, ...] = ()
    not_measured: str | None = None  # why nothing here was measured; None: measured
    exposure: float | None = None  # share of the calibrated probe time the job lost in windows (None: not measured yet)

    @property
    def tracer_overhead(self) -> float | None:
        """The tracer's cost as a share of the span: the most it can have slowed the process."""
        if not self.interval_s:
            return None
        return self.tracer_cost_s / self.interval_s

    @property
    def tracer_cpu_share(self) -> float | None:
        """The tracer's cost as a share of the process's CPU time."""
        if not self.target_cpu_s:
            return None
        return self.tracer_cost_s / self.target_cpu_s

    @property
    def calls_hz(self) -> float | None:
        """All driver calls a second, as estimated (None: not measured); `calls_not_known` says
        whether it can be shown."""
        if self.not_measured is not None:
            return None
        return sum(f.rate_hz for f in self.functions)

    @property
    def calls_err_hz(self) -> float | None:
        """The 95% half-width of calls_hz: the functions' added (they share the probes' effect)."""
        if self.not_measured is not None or any(f.rate_err_hz is None for f in self.functions):
            return None
        return sum(f.rate_err_hz for f in self.functions)

    @property
    def calls_not_known(self) -> str | None:
        """Why calls_hz is not known (`unknown_reason` over the process's calls); None: known, or
        not measured (which `not_measured` says)."""
        if self.not_measured is not None:
            return None
        return unknown_reason(sum(f.calls_observed for f in self.functions), self.calls_hz or 0.0,
                              self.calls_err_hz) or next((c.not_known for c in self.classes if c.not_known and
                                                          c.not_known.startswith(IMPLAUSIBLE)), None)

    @property
    def shown_calls_hz(self) -> float | None:
        """calls_hz where it is known: what a headline shows (None: not measured or not known)."""
        return None if self.calls_not_known else self.calls_hz

    # The one codec of a snapshot, for the attach report, top's frames and recordings: its fields,
    # and the derived figures a reader of the JSON wants without recomputing them.
    # A rate not known is null in it, with its 95% range (`rate_range_hz`) and the reason beside it.
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for f, fd in zip(self.functions, d["functions"]):
            if f.not_known is not None:
                lo, hi = max(0.0, f.rate_hz - (f.rate_err_hz or 0.0)), f.rate_hz + (f.rate_err_hz or 0.0)
                fd.update(rate_hz=None, rate_err_hz=None, calls_estimated=None,
                          rate_range_hz=[lo, hi] if f.rate_err_hz is not None else None)
        for c, cd in zip(self.classes, d["classes"]):
            if c.not_known is not None:
                cd.update(rate_hz=None, rate_range_hz=None if c.rate_err_hz is None else
                          [max(0.0, c.rate_hz - c.rate_err_hz), c.rate_hz + c.rate_err_hz])
        d["calls_hz"] = self.shown_calls_hz
        d["calls_not_known"] = self.calls_not_known
        d["tracer_overhead"] = self.tracer_overhead
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ProcessSnapshot":
        def function(f: dict) -> FunctionStats:
            kw = {k: v for k, v in f.items() if k in _FUNC_FIELDS}
            if f.get("rate_hz") is None:  # not known: the middle of its range stands, as estimated
                lo, hi = f.get("rate_range_hz") or (0.0, 0.0)
                kw.update(rate_hz=(lo + hi) / 2, rate_err_hz=(hi - lo) / 2 if f.get("rate_range_hz") else None,
                          calls_estimated=(lo + hi) / 2 * d.get("interval_s", 0.0))
            return FunctionStats(**{**kw, "cls": FunctionClass(f["cls"]), "hist": tuple(f.get("hist", ()))})

        funcs = tuple(function(f) for f in d["functions"])
        def totals(c: dict) -> ClassTotals:
            rate, err = c["rate_hz"], c.get("rate_err_hz")
            if rate is None:  # not known: the middle of its range stands, as estimated
                lo, hi = c.get("rate_range_hz") or (0.0, 0.0)
                rate, err = (lo + hi) / 2, (hi - lo) / 2 if c.get("rate_range_hz") else None
            return ClassTotals(FunctionClass(c["cls"]), rate, c["time_s_per_s"], err, c.get("not_known"))

        classes = tuple(totals(c) for c in d.get("classes", ()))
        fields = {k: v for k, v in d.items() if k in _SNAP_FIELDS}
        return cls(**{**fields, "functions": funcs, "classes": classes})


_FUNC_FIELDS = {f.name for f in dataclasses.fields(FunctionStats)}
_SNAP_FIELDS = {f.name for f in dataclasses.fields(ProcessSnapshot)}


@dataclass(frozen=True)
class Interval:
    index: int
    t_start: float                 # seconds since the session started
    interval_s: float
    window_s: float
    processes: tuple[ProcessSnapshot, ...]
    errors: dict[str, int] = field(default_factory=dict)
    # When probes were on the job (CLOCK_MONOTONIC seconds, from the first link attaching to the
    # last detached), window by window: what a job's own clock can be lined up with.
    windows: tuple[tuple[float, float], ...] = ()
