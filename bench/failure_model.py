"""What a checkpoint method costs a training job under a stated failure model: pure functions, no torch.

Inputs, per method (CheckpointCosts), all in seconds:
  C = held_s    how long one checkpoint holds the job (its training loop makes no progress)
  R = resume_s  from the restart after a failure to the job training again from the checkpoint
  W = write_s   only for methods that write in the background after releasing the job (DCP's async_save,
                `gputrace checkpoint`): from the checkpoint's start until it is complete on storage, i.e.
                until it can be restored.  None for a blocking method: its checkpoint is complete when the
                job is released (W = C).
and the failure model (FailureModel): the mean time between failures M (hours) and the overhead target
(default 0.01: checkpointing may cost the job 1% of its time).

The formulas (Expected):
  interval      tau = C / target                     a checkpoint every tau seconds costs C / tau = target
                tau = max(C / target, W)             background methods: a checkpoint cannot start before
                                                     the previous one is complete, so W floors the
                                                     interval (the overhead is then C / W < target)
  overhead      C / tau
  lost work     L = tau / 2 + R                      per failure.  Assumptions: failures are uniform in
                                                     time, so on average one strikes half an interval
                                                     after the last checkpoint; all work since that
                                                     checkpoint is lost; the restart (R) is lost on top;
                                                     a checkpoint is usable as soon as it is taken
                                                     (first order: a failure during a checkpoint, or
                                                     during the restart, is not counted separately).
  lost, with the write's lag
                L' = tau / 2 + D + R                 the same without the last assumption: a checkpoint
                                                     becomes usable D after its start (D = W, or C for a
                                                     blocking method); a failure in the first D of an
                                                     interval (probability D / tau) falls back one more
                                                     interval, which adds (D / tau) * tau = D.
  waste         C / tau + L / M                      the expected fraction of the job's time lost, to
                                                     checkpoints and to failures (first order)
  Young/Daly    tau* = sqrt(2 C M)                   the interval that minimises the waste to first order
                                                     (Young 1974; Daly 2006 refines it to sqrt(2 C M) - C),
                                                     with its overhead C / tau*, lost work tau* / 2 + R and
                                                     waste; floored by W like tau.
  in steps      L / step_s                           where the job's step time is given.

A quantity whose inputs are unknown is None, never 0, and Expected.unknown says why: C unknown or not
positive leaves every interval unknown (a measured 0 is below the timer's resolution, not free, and
C / target would be 0); R unknown leaves the lost work and the waste unknown.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

HOUR = 3600.0


@dataclass(frozen=True)
class CheckpointCosts:
    held_s: float | None  # C
    resume_s: float | None  # R
    write_s: float | None = None  # W: background methods only (None: blocking, complete when the job is released)
    step_s: float | None = None  # the job's step time, to express the lost work in steps


@dataclass(frozen=True)
class FailureModel:
    mtbf_h: float  # M, hours
    target_overhead: float = 0.01

    def __post_init__(self) -> None:
        if not (isinstance(self.mtbf_h, (int, float)) and math.isfinite(self.mtbf_h) and self.mtbf_h > 0):
            raise ValueError(f"the mean time between failures must be a positive number of hours, not {self.mtbf_h!r}")
        if not (isinstance(self.target_overhead, (int, float)) and 0 < self.target_overhead < 1):
            raise ValueError(f"the overhead target must lie between 0 and 1 (0.01 = 1%), not {self.target_overhead!r}")


@dataclass(frozen=True)
class Expected:
    known: bool  # the interval and the lost work per failure are both known
    mtbf_h: float
    target_overhead: float
    interval_s: float | None = None  # tau
    interval_floored: bool | None = None  # the write's completion (W), not C / target, set tau
    overhead: float | None = None  # C / tau
    lost_per_failure_s: float | None = None  # tau / 2 + R
    lost_per_failure_steps: float | None = None
    usable_after_s: float | None = None  # D: W, or C for a blocking method
    lost_with_lag_s: float | None = None  # tau / 2 + D + R
    waste_fraction: float | None = None  # C / tau + L / M
    young_interval_s: float | None = None  # sqrt(2 C M), floored by W
    young_interval_floored: bool | None = None
    young_overhead: float | None = None
    young_lost_per_failure_s: float | None = None
    young_waste_fraction: float | None = None
    notes: tuple[str, ...] = ()
    unknown: dict[str, str] = field(default_factory=dict)  # field -> why it is None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d


def _number(x) -> float | None:
    """x as a finite float, or None (None, NaN, infinities and non-numbers are unknown)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def expected(costs: CheckpointCosts, model: FailureModel) -> Expected:
    """The interval that keeps the overhead at model.target_overhead, the work lost per failure and the
    Young/Daly optimum beside it, for one method's costs; see the module's docstring for the formulas."""
    C, R, W, step = (_number(costs.held_s), _number(costs.resume_s), _number(costs.write_s),
                     _number(costs.step_s))
    M = model.mtbf_h * HOUR
    unknown: dict[str, str] = {}
    notes: list[str] = []
    base = {"mtbf_h": model.mtbf_h, "target_overhead": model.target_overhead}
    if W is not None and W < 0:
        W = None
        unknown["write_s"] = "a negative write time was given: taken as unknown"
    if C is None or C <= 0:
        why = ("the time the checkpoint holds the job (C) is unknown" if C is None else
               f"the time the checkpoint holds the job (C) is {C:g} s: C / target would be {C:g}, not an interval "
               "(a measured 0 is below the timer's resolution, not free)")
        for k in ("interval_s", "interval_floored", "overhead", "lost_per_failure_s", "lost_per_failure_steps",
                  "usable_after_s", "lost_with_lag_s", "waste_fraction", "young_interval_s",
                  "young_interval_floored", "young_overhead", "young_lost_per_failure_s", "young_waste_fraction"):
            unknown[k] = why
        return Expected(known=False, notes=tuple(notes), unknown=unknown, **base)

    by_target = C / model.target_overhead
    floor = W if W is not None else 0.0
    tau = max(by_target, floor)
    floored = floor > by_target
    if floored:
        notes.append(f"the checkpoint takes {W:g} s to complete, longer than C / target = {by_target:g} s: the "
                     f"interval is {W:g} s and the overhead {C / W:.4g}, under the target")
    D = W if W is not None else C
    young = math.sqrt(2 * C * M)
    young_floored = floor > young
    young = max(young, floor)
    if tau > M:
        notes.append(f"the interval ({tau:g} s) is longer than the mean time between failures ({M:g} s): the "
                     "first-order model does not hold there (most intervals would see a failure)")
    out = dict(interval_s=tau, interval_floored=floored, overhead=C / tau, usable_after_s=D,
               young_interval_s=young, young_interval_floored=young_floored, young_overhead=C / young)
    if R is None or R < 0:
        why = "the time to resume from the checkpoint (R) is unknown" if R is None else \
            f"a negative resume time ({R:g} s) was given: taken as unknown"
        for k in ("lost_per_failure_s", "lost_per_failure_steps", "lost_with_lag_s", "waste_fraction",
                  "young_lost_per_failure_s", "young_waste_fraction"):
            unknown[k] = why
        return Expected(known=False, notes=tuple(notes), unknown=unknown, **base, **out)
    lost = tau / 2 + R
    young_lost = young / 2 + R
    out.update(lost_per_failure_s=lost, lost_with_lag_s=tau / 2 + D + R, waste_fraction=C / tau + lost / M,
               young_lost_per_failure_s=young_lost, young_waste_fraction=C / young + young_lost / M)
    if step is not None and step > 0:
        out["lost_per_failure_steps"] = lost / step
    else:
        unknown["lost_per_failure_steps"] = "the job's step time is unknown"
    return Expected(known=True, notes=tuple(notes), unknown=unknown, **base, **out)


def assumptions(model: FailureModel) -> str:
    """One paragraph stating the model, for a results file."""
    return (f"Failures arrive with a mean time between failures of {model.mtbf_h:g} h, uniformly in time; a failure "
            f"loses all work since the last checkpoint and then the time to resume from it (R). A checkpoint holds "
            f"the job for C; the interval tau = C / {model.target_overhead:g} keeps the overhead at "
            f"{model.target_overhead:.0%}, and for methods that write in the background tau is at least the write's "
            f"completion time W. Lost work per failure = tau / 2 + R (the checkpoint taken as usable at once); with "
            f"the write's lag D (W, or C when blocking) it is tau / 2 + D + R. Young/Daly: tau* = sqrt(2 C M).")
