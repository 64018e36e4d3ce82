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
bench/results/audit-gpu-h200.md, eighth round). Both bounds are reported with every input behind them.

Where the session measured which threads make the calls (tracer/threads.py), the lower bound is per
thread: the layer adds A_k = (thread k's share of the intercepted calls) x rate x c to thread k, which
can hide only in that thread's own slack h_k (its time off a CPU, and in calls that wait for the GPU,
both counted: a blocked wait is in both, so h_k is never too small), and a thread that must do A_k
more work in a span it had only h_k free for slows the job by at least A_k - h_k. The lower bound is
the largest of these over the calling threads (`lower_basis` "threads"). The upper bound then divides
each thread's A_k by the share of its runnable time it got a CPU (run / (run + runq)): where the
job's threads wait for CPUs, the layer's CPU time costs them more wall time than itself (on this
project's shared 2-CPU test machine a worker thread that got a CPU a quarter of the time it wanted
one was slowed by more than 1.5 x A_k). `attach -p`, `top`, `record` and job audits measure the threads
(hostview/live.py reads them for host-wide sessions; rows and recordings carry them). Without that
measurement (a recording made before it was) the process is taken as one thread whose only slack is
its wait (`lower_basis` "process"): right for a single-threaded job, too high where the calls are made
by a thread that idles between requests (a runtime's worker thread).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .classify import CLASS_ORDER, FunctionClass
from .model import ProcessSnapshot, unknown_reason
from .threads import ThreadSlack

_ALL = frozenset(CLASS_ORDER)

# The most a layer has been seen to cost the caller, as a multiple of its own time a call (above).
INDIRECT_MAX = 1.5


@dataclass(frozen=True)
class Preset:
    name: str
    cost_ns: float
    classes: frozenset[FunctionClass]
    cost_source: str  # where cost_ns comes from, shown beside every figure built on it
    # The functions the layer intercepts, where it is a set of them (the shim wraps a list of
    # functions, not whole classes); None: every function of `classes`. Both apply where given.
    functions: frozenset[str] | None = None

    def intercepts(self, name: str, cls: FunctionClass) -> bool:
        return cls in self.classes and (self.functions is None or name in self.functions)


def _shim_functions() -> frozenset[str]:
    """The functions the shim gates and counts, from the list its C build makes its wrappers from
    (shim/shim_api.h, read by gputrace.shim.layer): `shim emulate --preset shim` slows this same set."""
    from gputrace.shim.layer import gated

    return gated()


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
            _shim_functions(),
        ),
    )
}
DEFAULT_PRESET = "shim"


@dataclass(frozen=True)
class ThreadAudit:
    """One thread that makes the layer's calls: what the layer adds to it and the slack it has.
    Shares of the span's wall time; None: not measured."""

    tid: int
    comm: str
    intercepted_share: float          # of the intercepted calls
    added_s_per_s: float              # A_k
    off_s_per_s: float | None         # off a CPU (asleep, blocked)
    wait_s_per_s: float | None        # in calls that wait for the GPU
    run_s_per_s: float | None         # on a CPU
    runq_s_per_s: float | None        # runnable, waiting for a CPU: no slack
    headroom_s_per_s: float | None    # h_k = off + wait + the tracer's own cost (at most 1)
    exposed: float | None             # max(0, A_k - h_k): the least this thread's share slows the job
    # The share of its runnable time it got a CPU, run / (run + runq): under contention a layer's CPU
    # time costs the thread 1/cpu_share of it in wall time (the upper bound divides by it). None: not measured.
    cpu_share: float | None = None


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
    # The job's functions the layer was counted on (those of the preset's that the job called, the
    # busiest first): a layer's own list of what it slows (`shim emulate`) is held against it.
    functions: tuple[str, ...] = ()
    # How many functions the preset names (None: whole classes, no list).
    preset_functions: int | None = None
    # What the lower bound rests on: "threads" (each calling thread's own slack, `threads`) or
    # "process" (the process's wait alone, as if one thread made every call).
    lower_basis: str = "process"
    threads: tuple[ThreadAudit, ...] | None = None
    # The thread that ran the most (on a CPU or waiting for one), the likeliest to pace the job:
    # {"tid", "comm", "busy_s_per_s"}; None: not measured.
    pacer: dict | None = None

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
        base.functions,
    )


def _per_thread(snap: ProcessSnapshot, preset: Preset, mine: list, threads: tuple[ThreadSlack, ...],
                rate: float, added: float) -> tuple[ThreadAudit, ...]:
    rates = {f.name: f.rate_hz for f in mine}
    tracer = snap.tracer_overhead or 0.0
    out = []
    for t in threads:
        r = sum(rates.get(n, 0.0) * sh for n, sh in t.calls_share.items())
        a = r * preset.cost_ns * 1e-9
        # Not measured for the process (the functions traced leave out every wait, say): its
        # threads' share of it is not known either, a share of 0 included (no wait traced is no wait seen).
        wait = None if t.wait_share is None or snap.wait_s_per_s is None else t.wait_share * snap.wait_s_per_s
        head = None if t.off_s_per_s is None or wait is None else min(1.0, t.off_s_per_s + wait + tracer)
        share = (t.run_s_per_s / (t.run_s_per_s + t.runq_s_per_s) if t.run_s_per_s and t.runq_s_per_s is not None
                 else None)
        out.append(ThreadAudit(t.tid, t.comm, r / rate if rate else 0.0, a, t.off_s_per_s, wait, t.run_s_per_s,
                               t.runq_s_per_s, head, None if head is None else max(0.0, a - head), share))
    return tuple(out)


def _thread_upper(per: tuple[ThreadAudit, ...], added: float) -> float | None:
    """The layer's time on every calling thread, each divided by the share of its runnable time it got
    a CPU (where the job's threads wait for CPUs, the layer's CPU time costs them more wall time than
    itself), and the calls no thread was seen making at face value; x INDIRECT_MAX. None where a
    calling thread's CPU share was not measured (the process's bound then stands)."""
    if any(t.cpu_share is None for t in per if t.added_s_per_s > 0):
        return None
    seen = sum(t.added_s_per_s for t in per)
    return (sum(t.added_s_per_s / t.cpu_share for t in per if t.added_s_per_s > 0)
            + max(0.0, added - seen)) * INDIRECT_MAX


def _thread_lower(per: tuple[ThreadAudit, ...], scale: float, added: float) -> float | None:
    """The largest A_k - h_k over the calling threads whose slack was measured (each alone is a
    lower bound), A_k scaled by `scale`; None where no thread that carries calls was measured."""
    if added * scale <= 0.0:
        # Nothing intercepted: 0 where the slack was measured; where it was not (no wait traced),
        # the layer's functions may not have been traced either (`--functions`): not known.
        return 0.0 if any(t.headroom_s_per_s is not None for t in per) else None
    known = [max(0.0, t.added_s_per_s * scale - t.headroom_s_per_s) for t in per
             if t.headroom_s_per_s is not None and t.added_s_per_s > 0]
    return max(known) if known else None


def audit(snap: ProcessSnapshot, preset: Preset, threads: tuple[ThreadSlack, ...] | None = None,
          pacer: dict | None = None) -> Audit:
    """`threads`: who makes the calls and each one's slack (tracer/threads.py), where the session
    measured it; the lower bound is then per thread (module docstring)."""
    classes = tuple(c.value for c in CLASS_ORDER if c in preset.classes)
    listed = None if preset.functions is None else len(preset.functions)
    if snap.not_measured is not None:
        return Audit(snap.pid, snap.comm, preset.name, preset.cost_ns, preset.cost_source, classes,
                     None, None, None, None, None, None, None, snap.tracer_overhead, snap.not_measured,
                     preset_functions=listed)
    mine = [f for f in snap.functions if preset.intercepts(f.name, f.cls)]
    rate = sum(f.rate_hz for f in mine)
    added = rate * preset.cost_ns * 1e-9
    err = None if any(f.rate_err_hz is None for f in mine) else sum(f.rate_err_hz for f in mine)
    # Not 0 where no wait was timed, even with nothing intercepted: with --functions the layer's
    # functions may not have been traced at all (their rate reads 0, not measured).
    per = None if threads is None else _per_thread(snap, preset, mine, threads, rate, added)
    if per is not None:
        lower = _thread_lower(per, 1.0, added)
    else:
        lower = None if snap.wait_s_per_s is None else max(0.0, added - snap.wait_s_per_s)
    upper = added * INDIRECT_MAX
    slow = 1.0  # the calling threads' wall time per unit of the layer's CPU time (contention), >= 1
    if per is not None and added > 0:
        u = _thread_upper(per, added)
        if u is not None:
            upper, slow = max(upper, u), max(1.0, u / upper)
    if err is None:
        lower_min = upper_max = None
    else:
        lo_added, hi_added = max(0.0, rate - err) * preset.cost_ns * 1e-9, (rate + err) * preset.cost_ns * 1e-9
        if per is not None:
            lower_min = _thread_lower(per, max(0.0, rate - err) / rate if rate else 0.0, lo_added)
        else:
            lower_min = None if lower is None else max(0.0, lo_added - snap.wait_s_per_s)
        upper_max = hi_added * INDIRECT_MAX * slow
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
        functions=tuple(f.name for f in sorted(mine, key=lambda f: -f.rate_hz) if f.rate_hz > 0 or f.calls_observed),
        preset_functions=listed,
        lower_basis="threads" if per is not None else "process",
        threads=per,
        pacer=pacer,
    )
