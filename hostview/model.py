"""What `top` shows, as frozen data: one HostSnapshot per refresh, free of any UI.

The same objects come from a live host (hostview/live.py), from a recorded session (hostview/recording.py), and
go out as JSON (`top --once --json`, `record`): `host_dict`/`host_from_dict` are the codec, versioned
by SCHEMA. As in the tracer's model, `None` in a float field means one thing: not measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gputrace.tracer.audit import PRESETS, Audit, audit
from gputrace.tracer.model import ProcessSnapshot

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

    def audit(self, preset: str) -> Audit:
        # Asked for three times a row and refresh (sort key, cell, header): kept on the row.
        cache = self.__dict__.setdefault("_audits", {})
        a = cache.get(preset)
        if a is None:
            a = cache[preset] = audit(self.snapshot, PRESETS[preset])
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

    @property
    def tracer_overhead(self) -> float | None:
        """The tracer's cost to the process it costs most, as a share of that process's time:
        the budget holds for each process, so this is what to hold against it."""
        shares = [p.snapshot.tracer_overhead for p in self.processes if p.snapshot.tracer_overhead is not None]
        return max(shares) if shares else None


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
        "snapshot": r.snapshot.to_dict(),
        "audits": {name: dataclasses.asdict(r.audit(name)) for name in PRESETS},
    }


def row_from_dict(d: dict) -> ProcessRow:
    ck = d.get("last_checkpoint")
    return ProcessRow(
        pid=d["pid"], comm=d["comm"], snapshot=ProcessSnapshot.from_dict(d["snapshot"]), shimmed=bool(d["shimmed"]),
        last_checkpoint=Checkpoint(**ck) if ck else None, calls_history=tuple(d.get("calls_history", ())),
        library=d.get("library", ""), identity=Identity(**d.get("identity", {})),
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
    }


def _gpu(g: dict) -> Gpu:
    return Gpu(**{**g, "processes": tuple((pid, used) for pid, used in g.get("processes", ()))})


def host_from_dict(d: dict) -> HostSnapshot:
    return HostSnapshot(
        t=d["t"], host=d["host"], gpus=tuple(_gpu(g) for g in d.get("gpus", ())), gpu_note=d.get("gpu_note", ""),
        budget=d["budget"], processes=tuple(row_from_dict(r) for r in d["processes"]),
        pending=tuple(d.get("pending", ())), notes=tuple(d.get("notes", ())),
    )
