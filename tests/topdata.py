"""Synthetic `top` frames for tests that need no root: four processes with known figures."""

from __future__ import annotations

from gputrace.tracer.classify import CLASS_ORDER, FunctionClass
from gputrace.tracer.model import ClassTotals, FunctionStats, ProcessSnapshot
from gputrace.hostview.model import Checkpoint, Gpu, HostSnapshot, ProcessRow

T0 = 1_700_000_000.0

# pid, comm, launches/s, getters/s, sync mean ns (wait), shimmed
PROCS = [
    (4242, "train_big", 40_000.0, 200_000.0, 2_000_000, True),
    (1111, "infer", 5_000.0, 20_000.0, 50_000, False),
    (3333, "idle_job", 10.0, 30.0, 0, True),
    (2222, "notebook", 900.0, 4_000.0, 9_000_000, False),
]


def _fn(name: str, cls: FunctionClass, rate: float, mean_ns: float | None, slot: int) -> FunctionStats:
    hist = [0] * 40
    hist[slot] = int(rate)
    hist[slot + 1] = int(rate / 50)
    return FunctionStats(name, cls, int(rate), rate, rate, 0.0, int(rate), mean_ns, mean_ns, float(2**slot),
                         float(2 ** (slot + 1)), tuple(hist))


def snapshot(pid: int, comm: str, launch: float, getters: float, sync_ns: float, k: int = 0) -> ProcessSnapshot:
    f = 1.0 + 0.1 * k
    funcs = [_fn("cuLaunchKernel", FunctionClass.SUBMISSION, launch * f, 2500.0, 12),
             _fn("cuCtxGetDevice_v2", FunctionClass.QUERY, getters * f, 90.0, 7),
             _fn("cuMemAlloc_v2", FunctionClass.STATE, 3.0, 40_000.0, 16)]
    if sync_ns:
        funcs.append(_fn("cuStreamSynchronize", FunctionClass.SYNC, 100.0, sync_ns, 20))
    funcs.sort(key=lambda s: -s.rate_hz)
    totals = tuple(ClassTotals(c, sum(s.rate_hz for s in funcs if s.cls is c),
                               sum(s.cpu_s_per_s for s in funcs if s.cls is c)) for c in CLASS_ORDER)
    wait = sum(t.time_s_per_s for t in totals if t.cls is FunctionClass.SYNC)
    driver = sum(t.time_s_per_s for t in totals if t.cls is not FunctionClass.SYNC)
    return ProcessSnapshot(pid, comm, 1.0, 0.2, 0.9, tuple(funcs), 0.004, driver, wait, totals)


def frame(k: int = 0, procs=PROCS) -> HostSnapshot:
    rows = []
    for pid, comm, launch, getters, sync_ns, shimmed in procs:
        ck = Checkpoint(f"/ckpt/{pid}/0", T0 - 120, 3 << 30, 0.21) if pid == 4242 else None
        hist = tuple(launch * (1 + 0.1 * j) + getters for j in range(k + 1))
        rows.append(ProcessRow(pid, comm, snapshot(pid, comm, launch, getters, sync_ns, k), shimmed, ck, hist,
                               "/usr/lib/x86_64-linux-gnu/libcuda.so.1"))
    gpus = (Gpu(0, "NVIDIA H200", 87.0, 40 << 30, 141 << 30, ((1111, 2 << 30), (4242, 30 << 30), (9999, None))),)
    return HostSnapshot(T0 + k, "gpu-host-7", gpus, "", 0.01, tuple(rows), (), ())


def frames(n: int = 3) -> list[HostSnapshot]:
    return [frame(k) for k in range(n)]


class OneJob:
    """A live source for top that shows one process (pid, under `comm`) until closed: a Textual pilot
    driving top's keys on a real job (tests/test_restore_whole.py, bench/restore_whole_gpu.py)."""

    live = True

    def __init__(self, pid: int, comm: str = "job") -> None:
        import threading

        self._frame = frame(procs=[(pid, comm, 100.0, 1000.0, 0, True)])
        self._stop = threading.Event()

    def frames(self):
        yield self._frame
        self._stop.wait()

    def close(self) -> None:
        self._stop.set()


class Ranks(OneJob):
    """OneJob for several processes (the ranks of a job), each row tagged with the job it is a rank of as the
    live source tags it (from its environment: hostview/jobs.py)."""

    def __init__(self, pids: list[int], comm: str = "rank") -> None:
        import dataclasses
        import threading

        from gputrace.hostview.jobs import job_tag

        f = frame(procs=[(pid, comm, 100.0, 1000.0, 0, True) for pid in pids])
        self._frame = dataclasses.replace(f, processes=tuple(dataclasses.replace(r, job=job_tag(r.pid))
                                                             for r in f.processes))
        self._stop = threading.Event()
