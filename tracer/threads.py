"""Slack per thread: which threads make a process's driver calls, and how much of its time each runs,
waits for a CPU, or is off the CPU (docs/architecture.md, "the overhead model").

Two sources, neither a new probe:
  - the BPF program's `tstats` map (bpf/counts.bpf.c): per (thread, function), the calls its windows
    and its kept link counted and the paired time of the outermost ones: each thread's share of each
    function's calls, and of the time in calls that wait for the GPU;
  - the scheduler's own accounting, /proc/PID/task/TID/schedstat (time on a CPU, time runnable and
    waiting for one), read at the session's start and end: the rest of the span the thread was off
    the CPU, asleep or blocked.

The audit (tracer/audit.py) turns these into a lower bound per calling thread: a layer that adds A_k
CPU seconds a second to thread k slows the job by at least A_k - h_k, where h_k is the share of time
the thread could absorb it in (off the CPU, or in calls that wait for the GPU).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Mapping

from .classify import waits


@dataclass(frozen=True)
class SchedSample:
    """Every thread's scheduler times at one moment (CLOCK_MONOTONIC seconds `t`)."""

    t: float
    threads: dict[int, tuple[int, int]]  # tid -> (ns on a CPU, ns runnable waiting for one)
    comms: dict[int, str] = field(default_factory=dict)


def sched_sample(pid: int, comms: dict[int, str] | None = None) -> SchedSample | None:
    """The scheduler's times of every thread of `pid`; None where they cannot be read (the process
    is gone, or the kernel keeps no schedstat: CONFIG_SCHED_INFO). `comms`: thread names already
    read (tid -> name), read again only for threads not in it (and added to it): a caller that
    samples a process every interval (`top`) reads one file a thread, not two."""
    base = f"/proc/{pid}/task"
    out: dict[int, tuple[int, int]] = {}
    names: dict[int, str] = {}
    try:
        tids = os.listdir(base)
    except OSError:
        return None
    t = time.monotonic()
    for name in tids:
        try:
            tid = int(name)
            with open(f"{base}/{name}/schedstat") as f:
                run, runq, *_ = f.read().split()
            known = None if comms is None else comms.get(tid)
            if known is None:
                with open(f"{base}/{name}/comm") as f:
                    known = f.read().strip()
                if comms is not None:
                    comms[tid] = known
            names[tid] = known
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        out[tid] = (int(run), int(runq))
    return SchedSample(t, out, names) if out else None


@dataclass(frozen=True)
class ThreadSlack:
    """One thread over a span. Shares are of the span's wall time; None: not measured."""

    tid: int
    comm: str
    # Its share of each function's calls (name -> 0..1), from the windows (or the kept link).
    calls_share: Mapping[str, float]
    run_s_per_s: float | None       # on a CPU
    runq_s_per_s: float | None      # runnable, waiting for a CPU
    off_s_per_s: float | None       # neither: asleep or blocked (in a driver call too)
    wait_share: float | None        # its share of the process's time in calls that wait for the GPU
    whole_span: bool = True         # alive at both samples (False: born during it; its off time counts its unborn part)


def thread_slack(start: SchedSample | None, end: SchedSample | None,
                 rows: Mapping[tuple[int, int], tuple[int, int, int]],
                 names: Mapping[int, str]) -> tuple[ThreadSlack, ...] | None:
    """Every thread that made a counted driver call, with its scheduler times over start..end;
    None where no thread was seen making one (nothing to say per thread).

    `rows`: the program's `tstats` for the process, (tid, function id) -> (window calls, kept calls,
    outer ns); `names`: function id -> name."""
    if not rows:
        return None
    by_func_w: dict[str, int] = {}
    by_func_k: dict[str, int] = {}
    wait_ns_total = 0
    per: dict[int, dict[str, tuple[int, int]]] = {}
    wait_ns: dict[int, int] = {}
    for (tid, fid), (calls, kept, outer_ns) in rows.items():
        name = names.get(fid)
        if name is None or (calls == 0 and kept == 0):
            continue
        d = per.setdefault(tid, {})
        c0, k0 = d.get(name, (0, 0))
        d[name] = (c0 + calls, k0 + kept)
        by_func_w[name] = by_func_w.get(name, 0) + calls
        by_func_k[name] = by_func_k.get(name, 0) + kept
        if waits(name):
            wait_ns[tid] = wait_ns.get(tid, 0) + outer_ns
            wait_ns_total += outer_ns
    if not per:
        return None
    span = (end.t - start.t) if start and end else 0.0
    out = []
    for tid, fns in sorted(per.items()):
        share = {}
        for name, (calls, kept) in fns.items():
            # Window counts where the windows saw the function, else the kept link's (counted every call).
            share[name] = calls / by_func_w[name] if by_func_w[name] else kept / by_func_k[name] if by_func_k[name] else 0.0
        run = runq = off = None
        whole = True
        if span > 0 and end is not None and tid in end.threads:
            r1, q1 = end.threads[tid]
            r0, q0 = start.threads.get(tid, (0, 0))
            whole = tid in start.threads
            run, runq = (r1 - r0) * 1e-9 / span, (q1 - q0) * 1e-9 / span
            off = max(0.0, 1.0 - run - runq)
        has_waits = any(waits(n) for n in fns)
        wshare = (wait_ns.get(tid, 0) / wait_ns_total if wait_ns_total else 0.0) if has_waits else 0.0
        comm = (end.comms.get(tid) if end else None) or (start.comms.get(tid) if start else None) or ""
        out.append(ThreadSlack(tid, comm, share, run, runq, off, wshare, whole))
    return tuple(out)


def busiest(start: SchedSample | None, end: SchedSample | None) -> tuple[int, str, float] | None:
    """The thread of the process that ran the most over the span (tid, comm, share of it on a CPU
    or waiting for one): the likeliest to pace the job."""
    if not start or not end or end.t <= start.t:
        return None
    span = end.t - start.t
    best = None
    for tid, (r1, q1) in end.threads.items():
        r0, q0 = start.threads.get(tid, (0, 0))
        busy = ((r1 - r0) + (q1 - q0)) * 1e-9 / span
        if best is None or busy > best[2]:
            best = (tid, end.comms.get(tid, ""), busy)
    return best


def slack_dict(t: ThreadSlack) -> dict:
    return {"tid": t.tid, "comm": t.comm, "calls_share": dict(t.calls_share), "run_s_per_s": t.run_s_per_s,
            "runq_s_per_s": t.runq_s_per_s, "off_s_per_s": t.off_s_per_s, "wait_share": t.wait_share,
            "whole_span": t.whole_span}


def slack_from_dict(d: dict) -> ThreadSlack:
    return ThreadSlack(int(d["tid"]), d.get("comm", ""), dict(d.get("calls_share", {})), d.get("run_s_per_s"),
                       d.get("runq_s_per_s"), d.get("off_s_per_s"), d.get("wait_share"), bool(d.get("whole_span", True)))


TStatsRows = Mapping[tuple[int, int], tuple[int, int, int]]


def rows_since(end: TStatsRows, start: TStatsRows) -> dict[tuple[int, int], tuple[int, int, int]]:
    """The `tstats` counts made between two reads of them. A row that went down was evicted (the map
    is an LRU) and counted again from nothing since: its later count is what it made since it came
    back, all that can be said for it."""
    out = {}
    for key, (c1, k1, o1) in end.items():
        c0, k0, o0 = start.get(key, (0, 0, 0))
        out[key] = (c1, k1, o1) if c1 < c0 or k1 < k0 or o1 < o0 else (c1 - c0, k1 - k0, o1 - o0)
    return out


class ThreadWindow:
    """One process's threads over a moving span, for a tracer that reads them every interval (`top`,
    a job's audit): the scheduler's times and the `tstats` counts at each read, the last `keep` + 1 of
    them (None: every read from the first, the whole span), and the slack per thread (thread_slack)
    between the oldest kept read and the latest.

    Each read costs one schedstat file a thread (a thread's name is read when it is first seen, and
    again every `rename_every` reads: threads often name themselves just after they start)."""

    def __init__(self, pid: int, keep: int | None = None, rename_every: int = 10) -> None:
        self.pid = pid
        self.keep = keep
        self.rename_every = rename_every
        self._reads: list[tuple[SchedSample, TStatsRows]] = []
        self._comms: dict[int, str] = {}
        self._n = 0

    def read(self, rows: TStatsRows, sample: SchedSample | None = None) -> bool:
        """Adds a read: the process's `tstats` rows as read now, and its threads' scheduler times
        (read here when not given). False where they could not be read (the process is gone)."""
        self._n += 1
        if self.rename_every and self._n % self.rename_every == 0:
            self._comms.clear()
        sample = sample if sample is not None else sched_sample(self.pid, self._comms)
        if sample is None:
            return False
        self._reads.append((sample, dict(rows)))
        if self.keep is not None and len(self._reads) > self.keep + 1:
            del self._reads[:len(self._reads) - self.keep - 1]  # the oldest
        elif self.keep is None and len(self._reads) > 2:
            del self._reads[1:-1]  # the whole span: the first read and the latest
        return True

    def slack(self, names: Mapping[int, str]) -> tuple[tuple[ThreadSlack, ...] | None, dict | None]:
        """(Every thread that made a counted call over the span, with its slack; the busiest thread
        of the process, the likeliest to pace it, as {"tid", "comm", "busy_s_per_s"}): (None, None)
        before two reads, and threads None where no call was counted in the span."""
        if len(self._reads) < 2:
            return None, None
        (s0, r0), (s1, r1) = self._reads[0], self._reads[-1]
        top = busiest(s0, s1)
        pacer = None if top is None else {"tid": top[0], "comm": top[1], "busy_s_per_s": top[2]}
        return thread_slack(s0, s1, rows_since(r1, r0), names), pacer
