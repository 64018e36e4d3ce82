"""What `top` shows, as frozen data: one HostSnapshot per refresh, free of any UI.

The same objects come from a live host (hostview/live.py), from a recorded session (hostview/recording.py), and
go out as JSON (`top --once --json`, `record`): `host_dict`/`host_from_dict` are the codec, versioned
by SCHEMA. As in the tracer's model, `None` in a float field means one thing: not measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gputrace.tracer.audit import PRESETS, Audit, Preset, audit
from gputrace.tracer.model import ProcessSnapshot
from gputrace.tracer.threads import ThreadSlack, slack_dict, slack_from_dict

from .jobs import JobTag
from .pods import Identity

SCHEMA = 2  # 2: as the attach report's 2 (gputrace/report.py); pending rows are the not measured ones
KIND_FRAME = "gputrace.top.frame"
KIND_RECORD = "gputrace.record"


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a process, as the checkpointer lists it."""

    id: str                        # what restore takes (a directory, for the checkpointer)
    taken_at: float                # unix time
    size_bytes: int | None
    freeze_s: float | None         # how long the job was gated for it


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    util_pct: float | None
    mem_used_bytes: int | None
    mem_total_bytes: int | None
    processes: tuple[tuple[int, int | None], ...] = ()  # (pid, bytes of this GPU's memory it holds: None, not known)


@dataclass(frozen=True)
class ProcessRow:
    pid: int
    comm: str
    snapshot: ProcessSnapshot      # the latest interval (or the whole span, for `--once`)
    shimmed: bool
    last_checkpoint: Checkpoint | None = None
    calls_history: tuple[float, ...] = ()   # calls/s of recent intervals, oldest first (sparklines)
    library: str = ""
    identity: Identity = Identity()         # its container and pod, where it runs in one
    job: JobTag = JobTag()                  # the distributed job it is a rank of, where it is one
    # The threads that make its calls, with their slack, over the snapshot's span (tracer/threads.py),
    # and its busiest thread: the audit's lower bound is then per thread (`lower_basis` "threads").
    # None: not measured (a recording made before they were), and the process is taken as one thread.
    threads: tuple[ThreadSlack, ...] | None = None
    pacer: dict | None = None

    def audit(self, preset: str | Preset) -> Audit:
        """`preset`: a preset's name (kept on the row: asked for three times a row and refresh, sort
        key, cell and header), or a Preset (attach's, whose --cost-ns may differ)."""
        if not isinstance(preset, str):
            return audit(self.snapshot, preset, self.threads, self.pacer)
        cache = self.__dict__.setdefault("_audits", {})
        a = cache.get(preset)
        if a is None:
            a = cache[preset] = audit(self.snapshot, PRESETS[preset], self.threads, self.pacer)
        return a


@dataclass(frozen=True)
class HostSnapshot:
    t: float                       # unix time of the refresh
    host: str
    gpus: tuple[Gpu, ...]
    gpu_note: str                  # why there are no GPUs shown, or ""
    budget: float                  # the tracer's cost cap, share of each process's time
    processes: tuple[ProcessRow, ...]
    pending: tuple[int, ...] = ()  # found, not measured yet (attaching, or no window yet: notes say why)
    notes: tuple[str, ...] = ()    # processes that could not be traced, and why

    @property
    def tracer_cost_s(self) -> float:
        return sum(p.snapshot.tracer_cost_s for p in self.processes)

    def jobs(self, preset: str) -> tuple["Job", ...]:
        """The processes that are ranks of one job (a key two or more share), by job."""
        groups: dict[str, list[ProcessRow]] = {}
        for r in self.processes:
            if r.job.key:
                groups.setdefault(r.job.key, []).append(r)
        return tuple(job_of(key, rows, preset) for key, rows in sorted(groups.items()) if len(rows) > 1)

    @property
    def tracer_overhead(self) -> float | None:
        """The tracer's cost to the process it costs most, as a share of that process's time:
        the budget holds for each process, so this is what to hold against it."""
        shares = [p.snapshot.tracer_overhead for p in self.processes if p.snapshot.tracer_overhead is not None]
        return max(shares) if shares else None


@dataclass(frozen=True)
class Job:
    """A job's ranks, and what a layer would cost the job. A data-parallel step ends in a collective
    that waits for every rank, so the job moves at its slowest rank's pace: it slows by at least the
    largest of its ranks' lower bounds and at most the largest of their upper bounds. A bound any
    rank lacks (not measured) the job lacks too."""

    key: str
    ranks: tuple[tuple[int | None, int], ...]   # (rank as its launcher numbers it, pid), in rank order
    world: int | None                           # the ranks the launcher says there are (None: not said)
    calls_hz: float | None                      # all ranks' driver calls a second (None: one not measured)
    slowdown_lower: float | None
    slowdown_upper: float | None
    slowest: int | None                          # the pid of the rank with the largest upper bound


def _worst(values: list[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else max(values)


def _largest_known(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def job_of(key: str, rows: list[ProcessRow], preset: str | Preset) -> Job:
    """`preset`: a preset's name (top's), or a Preset (attach's, whose --cost-ns may differ)."""
    rows = sorted(rows, key=lambda r: (r.job.rank is None, r.job.rank or 0, r.pid))
    audits = [r.audit(preset) for r in rows]
    calls = [r.snapshot.shown_calls_hz for r in rows]
    uppers = [a.slowdown_upper for a in audits]
    upper = _worst(uppers)
    worlds = {r.job.world for r in rows if r.job.world is not None}
    return Job(key, tuple((r.job.rank, r.pid) for r in rows), worlds.pop() if len(worlds) == 1 else None,
               None if any(c is None for c in calls) else sum(calls),
               # The job moves at its slowest rank's pace: any rank's lower bound is one for the job,
               # so the largest known one stands where another rank's is not known (its upper bound
               # needs every rank's).
               _largest_known([a.slowdown_lower for a in audits]),
               upper, None if upper is None else rows[uppers.index(upper)].pid)


def job_dict(j: Job) -> dict:
    return {**dataclasses.asdict(j), "ranks": [{"rank": rank, "pid": pid} for rank, pid in j.ranks]}


# --- codec ------------------------------------------------------------------------------------
def row_dict(r: ProcessRow) -> dict:
    return {
        "pid": r.pid,
        "comm": r.comm,
        "library": r.library,
        "shimmed": r.shimmed,
        "last_checkpoint": dataclasses.asdict(r.last_checkpoint) if r.last_checkpoint else None,
        "calls_history": list(r.calls_history),
        "identity": dataclasses.asdict(r.identity),
        "job": dataclasses.asdict(r.job),
        "snapshot": r.snapshot.to_dict(),
        "threads": None if r.threads is None else [slack_dict(t) for t in r.threads],
        "pacer": r.pacer,
        "audits": {name: dataclasses.asdict(r.audit(name)) for name in PRESETS},
    }


def row_from_dict(d: dict) -> ProcessRow:
    ck = d.get("last_checkpoint")
    return ProcessRow(
        pid=d["pid"], comm=d["comm"], snapshot=ProcessSnapshot.from_dict(d["snapshot"]), shimmed=bool(d["shimmed"]),
        last_checkpoint=Checkpoint(**ck) if ck else None, calls_history=tuple(d.get("calls_history", ())),
        library=d.get("library", ""), identity=Identity(**d.get("identity", {})), job=JobTag(**d.get("job", {})),
        threads=None if d.get("threads") is None else tuple(slack_from_dict(t) for t in d["threads"]),
        pacer=d.get("pacer"),
    )


def host_dict(h: HostSnapshot) -> dict:
    return {
        "schema": SCHEMA,
        "kind": KIND_FRAME,
        "t": h.t,
        "host": h.host,
        "gpus": [dataclasses.asdict(g) for g in h.gpus],
        "gpu_note": h.gpu_note,
        "budget": h.budget,
        "tracer_cost_s": h.tracer_cost_s,
        "tracer_overhead": h.tracer_overhead,
        "pending": list(h.pending),
        "notes": list(h.notes),
        "processes": [row_dict(r) for r in h.processes],
        "jobs": {name: [job_dict(j) for j in h.jobs(name)] for name in PRESETS},
    }


def _gpu(g: dict) -> Gpu:
    return Gpu(**{**g, "processes": tuple((pid, used) for pid, used in g.get("processes", ()))})


def host_from_dict(d: dict) -> HostSnapshot:
    return HostSnapshot(
        t=d["t"], host=d["host"], gpus=tuple(_gpu(g) for g in d.get("gpus", ())), gpu_note=d.get("gpu_note", ""),
        budget=d["budget"], processes=tuple(row_from_dict(r) for r in d["processes"]),
        pending=tuple(d.get("pending", ())), notes=tuple(d.get("notes", ())),
    )
