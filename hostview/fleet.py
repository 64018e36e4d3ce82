"""Recorded sessions of several nodes (`gputrace record` on each) merged into one view by workload.

Each process counts once, as it was last recorded (its row of the last frame it is in, which pools its
recent intervals). A workload is the pod's workload where the process runs in a Kubernetes pod
(hostview/pods.py), else its command. For a layer of a given cost a call, each process's audit gives
the bounds on its slowdown; a workload is listed by its worst process, and the table says which
workloads the layer would certainly slow by more than a threshold (the lower bound above it) and
which it might (only the upper bound above it).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from gputrace.tracer.audit import Preset

from .model import ProcessRow
from .recording import read_record


@dataclass(frozen=True)
class Job:
    """One process of one node, as last recorded."""

    host: str
    row: ProcessRow

    @property
    def workload(self) -> str:
        return self.row.identity.workload or self.row.comm

    @property
    def kind(self) -> str:
        return "pod workload" if self.row.identity.workload else "command"


@dataclass(frozen=True)
class WorkloadSummary:
    workload: str
    kind: str                       # "pod workload" or "command"
    nodes: tuple[str, ...]
    processes: int
    calls_hz_median: float
    intercepted_hz_median: float
    slowdown_lower_max: float | None   # None: some process's wait was not measured, so no lower bound is known
    slowdown_upper_max: float
    tracer_overhead_max: float | None
    verdict: str                    # "above", "maybe above", "below" the threshold


def load(paths: list[str]) -> list[Job]:
    """Every process of every recording, as last recorded; a node recorded twice keeps the later rows."""
    latest: dict[tuple[str, int], tuple[float, Job]] = {}
    for path in paths:
        header, frames = read_record(path)
        for f in frames:
            for r in f.processes:
                key = (f.host, r.pid)
                if key not in latest or latest[key][0] <= f.t:
                    latest[key] = (f.t, Job(f.host, r))
    return [job for _, job in sorted(latest.values(), key=lambda tj: (tj[1].host, tj[1].row.pid))]


def summarize(jobs: list[Job], preset: Preset, threshold: float) -> list[WorkloadSummary]:
    """One row per workload, worst first (by the upper bound)."""
    groups: dict[tuple[str, str], list[Job]] = {}
    for j in jobs:
        if j.row.snapshot.not_measured is None:
            groups.setdefault((j.workload, j.kind), []).append(j)
    out = []
    for (name, kind), js in groups.items():
        audits = [j.row.audit(preset) for j in js]
        lowers = [a.slowdown_lower for a in audits]
        lower = None if any(v is None for v in lowers) else max(lowers)
        upper = max(a.slowdown_upper for a in audits)
        tracer = [a.tracer_overhead for a in audits if a.tracer_overhead is not None]
        verdict = "above" if lower is not None and lower > threshold else "maybe above" if upper > threshold else "below"
        out.append(WorkloadSummary(
            name, kind, tuple(sorted({j.host for j in js})), len(js),
            statistics.median(a.calls_hz for a in audits), statistics.median(a.intercepted_hz for a in audits),
            lower, upper, max(tracer) if tracer else None, verdict))
    return sorted(out, key=lambda w: (-w.slowdown_upper_max, w.workload))


def hosts(jobs: list[Job]) -> list[str]:
    return sorted({j.host for j in jobs})
