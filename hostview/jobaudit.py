"""A job's audit: what `gputrace attach --tree PID` (or `-p A,B`) reports.

Every process of the job that maps a libcuda is traced host-wide (hostview/live.py, cumulative: each
rank's figures are over the whole span it was traced, from when it was found), each at the same
budget as a single `attach`. Each rank gets the audit a single `attach` gives it; the job gets one
per preset: a data-parallel step ends in a collective that waits for every rank, so the job moves
at its slowest rank's pace, and slows by at least the largest of its ranks' lower bounds and at most
the largest of their upper bounds (hostview/model.py, Job). A rank found but not measured, or not
traced, leaves the job's bound not known; a rank that exited counts over the span it ran.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from gputrace.tracer.audit import Audit, Preset
from gputrace.tracer.calibrate import Calibration
from gputrace.tracer.model import ProcessSnapshot

from .jobs import JobTag
from .model import Job, ProcessRow, job_dict, job_of

KIND = "gputrace.attach.job"
NOT_FOUND_YET = "found as the attach ended: no interval of it had ended"


@dataclass(frozen=True)
class RankReport:
    pid: int
    comm: str
    rank: int | None           # as its launcher numbers it (None: not said)
    library: str
    exited: bool               # it ended while traced: its figures are over the span it ran
    summary: ProcessSnapshot   # over the whole span it was traced (not_measured says where nothing was)
    audits: tuple[Audit, ...]  # one per preset


@dataclass(frozen=True)
class JobReport:
    key: str                   # the job as its launcher names it, else how it was chosen
    selection: str             # "the tree of pid 1200", "pids 1201, 1202"
    command: tuple[str, ...]
    exit_status: int | None
    options: dict
    calibration: Calibration | None
    traced_s: float
    ranks: tuple[RankReport, ...]
    jobs: tuple[tuple[Preset, Job], ...]  # the job's bounds, one per preset
    world: int | None          # the ranks the launcher says there are (None: not said)
    notes: tuple[str, ...]     # processes that could not be traced, and why


def _placeholder(pid: int, comm: str) -> ProcessSnapshot:
    return ProcessSnapshot(pid, comm, 0.0, 0.0, None, (), 0.0, None, None, not_measured=NOT_FOUND_YET)


def build(traced: Sequence[tuple[int, str, JobTag, ProcessSnapshot | None, bool]], presets: Sequence[Preset], *,
          selection: str, command: tuple[str, ...] = (), exit_status: int | None = None, options: dict,
          calibration: Calibration | None, traced_s: float, notes: Sequence[str] = (),
          threads: Mapping[int, tuple] | None = None) -> JobReport:
    """`traced`: (pid, libcuda path, job tag, snapshot over its span or None, exited) per process;
    `threads`: pid -> (the threads that made its calls with their slack, its busiest thread), where
    measured (LiveSource.threads_of): each rank's lower bound is then per thread, as attach's."""
    rows = []
    for pid, lib, tag, snap, exited in traced:
        snap = snap if snap is not None else _placeholder(pid, "?")
        ts, pacer = (threads or {}).get(pid, (None, None))
        rows.append((ProcessRow(pid, snap.comm, snap, False, library=lib, job=tag, threads=ts, pacer=pacer), exited))
    keys = {r.job.key for r, _ in rows}
    key = keys.pop() if len(keys) == 1 and "" not in keys else selection
    jobs = tuple((p, job_of(key, [r for r, _ in rows], p)) for p in presets) if rows else ()
    order = {pid: i for i, (_, pid) in enumerate(jobs[0][1].ranks)} if jobs else {}
    ranks = tuple(sorted(
        (RankReport(r.pid, r.comm, r.job.rank, r.library, exited, r.snapshot,
                    tuple(r.audit(p) for p in presets)) for r, exited in rows),
        key=lambda x: order.get(x.pid, 0)))
    worlds = {r.job.world for r, _ in rows if r.job.world is not None}
    return JobReport(key, selection, tuple(command), exit_status, options, calibration, traced_s, ranks, jobs,
                     worlds.pop() if len(worlds) == 1 else None, tuple(notes))


def report_dict(r: JobReport, schema: int) -> dict:
    return {
        "schema": schema,
        "kind": KIND,
        "key": r.key,
        "selection": r.selection,
        "command": list(r.command),
        "exit_status": r.exit_status,
        "options": r.options,
        "calibration": dataclasses.asdict(r.calibration) if r.calibration is not None else None,
        "traced_s": r.traced_s,
        "world": r.world,
        "job": [{"preset": p.name, "cost_ns": p.cost_ns, "cost_source": p.cost_source,
                 "classes": sorted(c.value for c in p.classes), **job_dict(j)} for p, j in r.jobs],
        "ranks": [{"pid": k.pid, "comm": k.comm, "rank": k.rank, "library": k.library, "exited": k.exited,
                   "summary": k.summary.to_dict(), "audits": [a.to_dict() for a in k.audits]}
                  for k in r.ranks],
        "notes": list(r.notes),
    }


@dataclass(frozen=True)
class FunctionTotal:
    """One driver function over every rank that was measured."""

    name: str
    cls: str
    rate_hz: float
    ranks: int            # how many ranks called it
    mean_ns: float | None  # weighted by each rank's rate (None: no rank timed it)
    not_known: str | None = None  # why rate_hz is not known (a rank's is not: tracer/model.py)


def function_totals(ranks: Sequence[RankReport]) -> tuple[FunctionTotal, ...]:
    acc: dict[str, list] = {}
    for k in ranks:
        if k.summary.not_measured is not None:
            continue
        for f in k.summary.functions:
            a = acc.setdefault(f.name, [f.cls.value, 0.0, 0, 0.0, 0.0, None])
            a[1] += f.rate_hz
            if f.not_known:
                a[5] = f"pid {k.summary.pid}: {f.not_known}"
            a[2] += 1
            if f.mean_ns is not None and f.rate_hz > 0:
                a[3] += f.mean_ns * f.rate_hz
                a[4] += f.rate_hz
    out = [FunctionTotal(n, c, rate, nr, wsum / w if w else None, nk) for n, (c, rate, nr, wsum, w, nk) in acc.items()]
    return tuple(sorted(out, key=lambda t: -t.rate_hz))
