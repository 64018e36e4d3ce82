"""Frozen snapshots the tracer hands to renderers; units are in the field names.

`None` in a float field means exactly one thing: not measured (for example the per-call time of a
function that was only counted, never timed; every figure of a process that no window measured,
which then says why in `not_measured`). JSON shows it as null.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .classify import FunctionClass


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

    @property
    def cpu_s_per_s(self) -> float:
        """Time per second inside this function's outermost calls (0 when never timed)."""
        return self.rate_hz * (self.outer_mean_ns or 0.0) * 1e-9


@dataclass(frozen=True)
class ClassTotals:
    cls: FunctionClass
    rate_hz: float
    time_s_per_s: float


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
        if self.not_measured is not None:
            return None
        return sum(f.rate_hz for f in self.functions)

    # The one codec of a snapshot, for the attach report, top's frames and recordings: its fields,
    # and the derived figures a reader of the JSON wants without recomputing them.
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["calls_hz"] = self.calls_hz
        d["tracer_overhead"] = self.tracer_overhead
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ProcessSnapshot":
        funcs = tuple(
            FunctionStats(**{**{k: v for k, v in f.items() if k in _FUNC_FIELDS}, "cls": FunctionClass(f["cls"]),
                             "hist": tuple(f.get("hist", ()))})
            for f in d["functions"]
        )
        classes = tuple(ClassTotals(FunctionClass(c["cls"]), c["rate_hz"], c["time_s_per_s"]) for c in d.get("classes", ()))
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
