"""The overhead audit: what an interception layer would cost a process, as bounds (docs/architecture.md, The audit).

A layer that adds `c` ns to each call of the classes it intercepts adds A = sum(rate x c) CPU seconds
per second to the threads that issue those calls. It can hide in the time those threads wait for
the GPU anyway, so the slowdown is at least max(0, A - wait). It is at most A x INDIRECT_MAX: a
layer's code, run on the caller's thread before each call, also makes the caller's own code slower,
and can make the driver's call itself dearer (measured with the shim's emulated layer on the H200, 2 us
a call, launch-bound jobs: the job's time a step rose 1.05-1.39x the added time over every class, and
up to 1.4x over launches alone where the phases resolve it; with the driver's own time in the slowed
calls timed, GPT-2's launches took 5.0 us after a spin against 4.5 us after none; at 10 us a call
1.05-1.22x: the part beyond the layer's own time grows more slowly than the layer;
bench/results/audit-h200.md, eighth round). Both bounds are reported with every input behind them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .classify import CLASS_ORDER, FunctionClass
from .model import ProcessSnapshot, unknown_reason

_ALL = frozenset(CLASS_ORDER)

# The most a layer has been seen to cost the caller, as a multiple of its own time a call (above).
INDIRECT_MAX = 1.5


@dataclass(frozen=True)
class Preset:
    name: str
    cost_ns: float
    classes: frozenset[FunctionClass]
    cost_source: str  # where cost_ns comes from, shown beside every figure built on it


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "proxy", 2000.0, _ALL,
            "assumed: a device-proxy layer forwards every call to another process (an IPC round trip, "
            "order of microseconds); pass --cost-ns with your layer's figure",
        ),
        Preset(
            "shim", 15.0, frozenset({FunctionClass.SUBMISSION, FunctionClass.STATE}),
            "measured: gputrace's shim on the H200, cuLaunchKernel, median added ns "
            "(bench/results/shim-h200.md); pass --cost-ns to override",
        ),
    )
}
DEFAULT_PRESET = "shim"


@dataclass(frozen=True)
class Audit:
    pid: int
    comm: str
    preset: str
    cost_ns: float
    cost_source: str
    classes: tuple[str, ...]
    # Every figure below is None when the process was not measured (`not_measured` says why).
    intercepted_hz: float | None   # calls/s the layer would intercept
    calls_hz: float | None         # all driver calls/s
    driver_cpu_s_per_s: float | None  # input: time/s in non-synchronizing driver calls
    wait_s_per_s: float | None     # input: time/s blocked in synchronization calls
    added_cpu_s_per_s: float | None   # A
    slowdown_upper: float | None   # A x indirect_max: nothing hides it, and it slows the caller's own code
    slowdown_lower: float | None   # max(0, A - wait): it hides in the wait
    tracer_overhead: float | None  # the tracer's own cost over the same span, as a share of it
    not_measured: str | None = None
    indirect_max: float = INDIRECT_MAX  # input: the most the layer costs the caller per ns of its own
    # The intercepted rate's 95% half-width (the functions' own, added: their errors share the
    # exposure, so they move together), and the bounds with the rate at either end of it: the range
    # that covers the truth as often as the rates' intervals do (on the H200 a GPT-2 attach of 5 s
    # read the intercepted rate 14% high, and a 10-us layer's slowdown fell below the point bounds).
    # None where a function's interval is not known.
    intercepted_err_hz: float | None = None
    slowdown_lower_min: float | None = None  # max(0, (rate - err) x cost - wait)
    slowdown_upper_max: float | None = None  # (rate + err) x cost x indirect_max
    # Why the intercepted rate is not known (tracer/model.py, unknown_reason); None: known. Then the
    # bounds are those at the ends of its interval (slowdown_lower_min, slowdown_upper_max), the
    # only ones that cover the truth, and the rate and A are null in JSON (`to_dict`).
    not_known: str | None = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if self.not_known:
            d.update(intercepted_hz=None, added_cpu_s_per_s=None)
        return d


def make_preset(name: str, cost_ns: float | None = None, classes: frozenset[FunctionClass] | None = None) -> Preset:
    base = PRESETS[name]
    if cost_ns is None and classes is None:
        return base
    return Preset(
        base.name,
        base.cost_ns if cost_ns is None else cost_ns,
        base.classes if classes is None else classes,
        base.cost_source if cost_ns is None else "given with --cost-ns",
    )


def audit(snap: ProcessSnapshot, preset: Preset) -> Audit:
    classes = tuple(c.value for c in CLASS_ORDER if c in preset.classes)
    if snap.not_measured is not None:
        return Audit(snap.pid, snap.comm, preset.name, preset.cost_ns, preset.cost_source, classes,
                     None, None, None, None, None, None, None, snap.tracer_overhead, snap.not_measured)
    mine = [f for f in snap.functions if f.cls in preset.classes]
    rate = sum(f.rate_hz for f in mine)
    added = rate * preset.cost_ns * 1e-9
    err = None if any(f.rate_err_hz is None for f in mine) else sum(f.rate_err_hz for f in mine)
    # Not 0 where no wait was timed, even with nothing intercepted: with --functions the layer's
    # functions may not have been traced at all (their rate reads 0, not measured).
    lower = None if snap.wait_s_per_s is None else max(0.0, added - snap.wait_s_per_s)
    upper = added * INDIRECT_MAX
    if err is None:
        lower_min = upper_max = None
    else:
        lo_added, hi_added = max(0.0, rate - err) * preset.cost_ns * 1e-9, (rate + err) * preset.cost_ns * 1e-9
        lower_min = None if lower is None else max(0.0, lo_added - snap.wait_s_per_s)
        upper_max = hi_added * INDIRECT_MAX
    # (With no interval at all there is no range to give: the point bounds stand, and the renderers
    # say that the rate's interval is not known.)
    not_known = None if err is None else unknown_reason(sum(f.calls_observed for f in mine), rate, err)
    if not_known:
        lower, upper = lower_min, upper_max
    return Audit(
        pid=snap.pid,
        comm=snap.comm,
        preset=preset.name,
        cost_ns=preset.cost_ns,
        cost_source=preset.cost_source,
        classes=classes,
        intercepted_hz=rate,
        calls_hz=snap.calls_hz,
        driver_cpu_s_per_s=snap.driver_cpu_s_per_s,
        wait_s_per_s=snap.wait_s_per_s,
        added_cpu_s_per_s=added,
        slowdown_upper=upper,
        slowdown_lower=lower,
        tracer_overhead=snap.tracer_overhead,
        intercepted_err_hz=err,
        slowdown_lower_min=lower_min,
        slowdown_upper_max=upper_max,
        not_known=not_known,
    )
