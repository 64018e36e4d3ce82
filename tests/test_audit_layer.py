"""The audit against a layer of known cost (issue 40): the `shim` preset counts exactly the functions
the shim gates, read from the list its C build makes its wrappers from; `shim emulate --preset shim`
slows that same set; and on simcuda, for a job whose calls are made by a worker thread that idles
between requests and for a single-threaded launch loop, the slowdown a 2-us emulated layer causes
lies inside the audit's bounds (3 points' slack for a shared 2-CPU machine's noise)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time

import orjson
import pytest
from elftools.elf.elffile import ELFFile

from gputrace import shim, simcuda
from gputrace.shim import layer
from gputrace.shim.client import Connection
from gputrace.tracer.audit import PRESETS, make_preset
from gputrace.tracer.classify import FunctionClass, classify

from shimtest import procs, shim_dir, start  # noqa: F401  (fixtures)

SLACK = 0.03  # points of slack for this machine's noise (issue 40)


def exported(path) -> set[str]:
    """The defined cu* functions a shared object exports."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        return {s.name.split("@")[0] for s in elf.get_section_by_name(".dynsym").iter_symbols()
                if s.name.startswith("cu") and s["st_info"]["type"] == "STT_FUNC" and s["st_shndx"] != "SHN_UNDEF"}


def test_the_shims_lists_are_what_its_library_exports():
    """shim_api.h's lists, as gputrace.shim.layer reads them, name exactly the functions the built
    shim exports: the one source of truth of what the shim wraps."""
    assert layer.wrapped() == exported(shim.library_path())


def test_the_shim_preset_is_the_functions_the_shim_gates():
    p = PRESETS["shim"]
    assert p.functions == layer.gated() and p.functions <= layer.wrapped()
    # Passed through (a load and a jump), or not wrapped at all: not the shim's cost.
    for name in ("cuCtxSetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2", "cuGraphExecKernelNodeSetParams_v2",
                 "cuStreamSynchronize", "cuCtxGetDevice_v2"):
        assert not p.intercepts(name, classify(name)), name
    assert p.intercepts("cuLaunchKernel", FunctionClass.SUBMISSION) and p.intercepts("cuMemAlloc_v2", FunctionClass.STATE)
    # A new cost keeps the list; a narrower class keeps the list's functions of that class.
    assert make_preset("shim", 2000.0).functions == p.functions
    sub = make_preset("shim", 2000.0, frozenset({FunctionClass.SUBMISSION}))
    assert {n for n in p.functions if sub.intercepts(n, classify(n))} == set(layer.groups()["SHIM_LAUNCH"]) | set(
        layer.groups()["SHIM_SUBMIT_REST"])


def gputrace(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=timeout)


def test_emulate_preset_shim_slows_the_set_the_audit_counts(procs, shim_dir):
    """By construction the same set: the emulated layer's `layer=shim` (emulate.c, from the lists)
    against the audit's preset (gputrace.shim.layer, from the same lists); and --classes submission
    is the preset narrowed to submission."""
    p = start(procs, simcuda.workload("launch_bound") + ["--steps", "1", "--hold"])
    assert json.loads(p.stdout.readline())["hold"] == 1
    r = gputrace("shim", "emulate", "-p", str(p.pid), "--cost-ns", "2000", "--preset", "shim", "--json")
    assert r.returncode == 0, r.stderr
    assert set(orjson.loads(r.stdout)["emulate"]["functions"]) == PRESETS["shim"].functions
    r = gputrace("shim", "emulate", "-p", str(p.pid), "--cost-ns", "2000", "--classes", "submission", "--json")
    sub = make_preset("shim", 2000.0, frozenset({FunctionClass.SUBMISSION}))
    assert set(orjson.loads(r.stdout)["emulate"]["functions"]) == {n for n in sub.functions if sub.intercepts(n, classify(n))}
    r = gputrace("shim", "emulate", "-p", str(p.pid), "--off", "--preset", "shim")
    assert r.returncode == 2 and "--off takes no cost" in r.stderr
    p.stdin.write("\n\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0


def measured_slowdown(pid: int, pairs: int, phase_s: float) -> tuple[float, float, float]:
    """The emulated shim layer at 2 us a call, switched on and off over the control socket; the job's
    progress is its launches as the shim counts them. Each phase with the layer on against the mean
    rate of its two neighbours without it (drift cancels); the median of those, time-based (how much
    longer the same work takes): a pair that a burst of other work on the host lands in moves a mean
    by points, not the median. With the median, its 95% interval (order statistics): what is checked
    is that the measurement does not contradict the bounds."""
    rates: list[tuple[bool, float]] = []
    with Connection(pid) as c:
        def launches() -> int:
            return c.status()["calls"].get("cuLaunchKernel", 0)

        for on in [False, True] * pairs + [False]:  # every phase with the layer between two without
            assert c.request("emulate cost=2000 layer=shim" if on else "emulate off")["ok"]
            t0, n0 = time.monotonic(), launches()
            time.sleep(phase_s)  # a phase is a span of the job's own time: measured, not awaited
            t1, n1 = time.monotonic(), launches()
            rates.append((on, (n1 - n0) / (t1 - t0)))
        assert c.request("emulate off")["ok"]
    slow = [(rates[i - 1][1] + rates[i + 1][1]) / 2 / r - 1 for i, (on, r) in enumerate(rates)
            if on and 0 < i < len(rates) - 1 and r > 0]
    slow.sort()
    n = len(slow)
    j = max(0, int(n / 2 - 0.98 * math.sqrt(n)))            # the median's 95% interval: ranks n/2 -+ 0.98 sqrt(n)
    k = min(n - 1, int(math.ceil(n / 2 + 0.98 * math.sqrt(n))) - 1)
    return statistics.median(slow), slow[j], slow[k]


CLIENTS = {
    # Calls made by a worker thread that idles between requests (about half of each 300-us request);
    # the main thread paces the job. (At 150 us and 16 launches a request the job sat at a timing
    # resonance of this project's 2-CPU CI host: the 2-us layer made it 3.2-3.9% faster in every run,
    # file alone or in the suite, where 0.5 and 5 us a call slowed it -0.2% and +7.5%, and the 2-us
    # layer slowed 100 us and 8 launches +0.4%, 300 us and 32 -0.1%: a scheduling effect that no
    # bound from CPU time covers, not the audit's to predict.)
    "worker": ["--seconds", "120", "--launches", "32", "--work-ns", "300000"],
    # One thread making every call (simcuda's own kernel thread aside).
    "launch_bound": ["--seconds", "120", "--scale", "0.25"],
}


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_2us_layers_slowdown_lies_inside_the_audits_bounds(procs, shim_dir, client):
    p = start(procs, simcuda.workload(client) + CLIENTS[client] + ["--hold"])
    assert json.loads(p.stdout.readline())["hold"] == 1  # set up: from here on it runs its loop
    p.stdin.write("\n")
    p.stdin.flush()
    r = gputrace("attach", "-p", str(p.pid), "-d", "4", "--json", "-q", "--preset", "shim", "--cost-ns", "2000",
                 timeout=120)
    assert r.returncode == 0, r.stderr
    doc = orjson.loads(r.stdout)
    (a,) = doc["audits"]
    rates = {f["name"]: f["rate_hz"] if f["rate_hz"] is not None else sum(f["rate_range_hz"]) / 2
             for f in doc["summary"]["functions"]}
    # The preset counts only functions the shim gates, so never more than the shim's library wraps.
    assert set(a["functions"]) <= layer.gated() and "cuLaunchKernel" in a["functions"]
    wrapped_hz = sum(hz for n, hz in rates.items() if n in layer.wrapped())
    counted_hz = sum(rates[n] for n in a["functions"])
    assert counted_hz <= wrapped_hz
    if client == "worker":
        # The context push/pop are traced, and not the shim's: not counted.
        assert rates.get("cuCtxPushCurrent_v2", 0) > 0 and "cuCtxPushCurrent_v2" not in a["functions"]
    # The lower bound is each calling thread's, and the calls are the worker's (main makes none).
    assert a["lower_basis"] == "threads" and a["threads"]
    carriers = [t for t in a["threads"] if t["added_s_per_s"] > 0]
    assert carriers and all(t["headroom_s_per_s"] is not None for t in carriers)
    lo = a["slowdown_lower_min"] if a["slowdown_lower_min"] is not None else a["slowdown_lower"]
    hi = a["slowdown_upper_max"] if a["slowdown_upper_max"] is not None else a["slowdown_upper"]
    got, got_lo, got_hi = measured_slowdown(p.pid, pairs=30, phase_s=0.25)
    assert got_lo <= hi + SLACK and got_hi >= lo - SLACK, (client, got, (got_lo, got_hi), lo, hi, a["threads"])


def _snap(rate_hz: float, wait: float | None = 0.0):
    from gputrace.tracer.model import FunctionStats, ProcessSnapshot

    f = FunctionStats("cuLaunchKernel", FunctionClass.SUBMISSION, 100_000, rate_hz, rate_hz, 0.0, 0, None, None,
                      None, None)
    push = FunctionStats("cuCtxPushCurrent_v2", FunctionClass.STATE, 100_000, rate_hz, rate_hz, 0.0, 0, None, None,
                         None, None)
    return ProcessSnapshot(1, "job", 1.0, 1.0, None, (f, push), 0.0, 0.1, wait)


def _thread(tid: int, share: float, run: float | None, runq: float | None, wait_share: float | None = 0.0):
    from gputrace.tracer.threads import ThreadSlack

    off = None if run is None else max(0.0, 1 - run - runq)
    return ThreadSlack(tid, "t", {"cuLaunchKernel": share, "cuCtxPushCurrent_v2": share}, run, runq, off, wait_share)


def test_the_lower_bound_is_each_calling_threads_own():
    """A = 100k/s x 2 us = 20%. On a worker that is off a CPU 70% of the time it hides (0); on a thread
    that never leaves the CPU it shows in full; split over two busy threads, the larger share's; with
    no thread's slack measured, not known; without threads at all, the process's max(0, A - wait)."""
    from gputrace.tracer.audit import audit

    p = make_preset("shim", 2000.0)
    idle = audit(_snap(100_000.0), p, (_thread(7, 1.0, 0.3, 0.0),))
    assert idle.lower_basis == "threads" and idle.slowdown_lower == 0.0
    assert idle.threads[0].added_s_per_s == pytest.approx(0.2)  # push/pop are not the shim's
    assert idle.slowdown_upper == pytest.approx(0.3)
    busy = audit(_snap(100_000.0), p, (_thread(7, 1.0, 0.95, 0.0),))
    assert busy.slowdown_lower == pytest.approx(0.2 - 0.05)
    split = audit(_snap(100_000.0), p, (_thread(7, 0.75, 1.0, 0.0), _thread(8, 0.25, 1.0, 0.0)))
    assert split.slowdown_lower == pytest.approx(0.15)
    unknown = audit(_snap(100_000.0), p, (_thread(7, 1.0, None, None),))
    assert unknown.slowdown_lower is None and unknown.slowdown_upper == pytest.approx(0.3)
    process = audit(_snap(100_000.0, wait=0.05), p)
    assert process.lower_basis == "process" and process.slowdown_lower == pytest.approx(0.15)
    # A thread's wait for the GPU is slack; with the process's wait not measured, its slack is not known.
    waits = audit(_snap(100_000.0, wait=0.1), p, (_thread(7, 1.0, 0.95, 0.0, wait_share=1.0),))
    assert waits.slowdown_lower == pytest.approx(0.2 - 0.05 - 0.1)
    assert audit(_snap(100_000.0, wait=None), p, (_thread(7, 1.0, 0.95, 0.0, wait_share=1.0),)).slowdown_lower is None


def test_the_upper_bound_counts_the_calling_threads_wait_for_a_cpu():
    """A thread that got a CPU half the time it wanted one pays twice the layer's CPU time in wall time."""
    from gputrace.tracer.audit import audit

    a = audit(_snap(100_000.0), make_preset("shim", 2000.0), (_thread(7, 1.0, 0.4, 0.4),))
    assert a.threads[0].cpu_share == pytest.approx(0.5)
    assert a.slowdown_upper == pytest.approx(0.2 / 0.5 * 1.5)
