"""Slack per calling thread in every audit, not only `attach -p` (issue 40): `top` and `record` (a moving
span of the last intervals), a recording replayed (the threads travel in its frames), and a job's audit
(`attach --tree`, `-p A,B`: each rank over its whole span). The arithmetic on made-up reads first
(deterministic), then the live paths on simcuda's worker client, whose calls come from a worker
thread that idles between requests: properties only (which threads, measured or not), no timings."""

from __future__ import annotations

import json
import subprocess
import sys

import orjson
import pytest

from gputrace import simcuda
from gputrace.hostview.jobaudit import build, report_dict
from gputrace.hostview.jobs import JobTag
from gputrace.hostview.model import HostSnapshot, ProcessRow, host_dict, host_from_dict
from gputrace.tracer.audit import PRESETS, make_preset
from gputrace.tracer.classify import FunctionClass
from gputrace.tracer.model import FunctionStats, ProcessSnapshot
from gputrace.tracer.threads import SchedSample, ThreadSlack, ThreadWindow, rows_since

CLI = [sys.executable, "-m", "gputrace"]
LAUNCH = 7  # the function id of cuLaunchKernel in the made-up tstats rows
NAMES = {LAUNCH: "cuLaunchKernel", 8: "cuStreamSynchronize"}


def sample(t: float, threads: dict[int, tuple[float, float]]) -> SchedSample:
    """Scheduler times at `t` s: tid -> (s on a CPU, s waiting for one)."""
    return SchedSample(t, {tid: (int(run * 1e9), int(q * 1e9)) for tid, (run, q) in threads.items()},
                       {tid: f"t{tid}" for tid in threads})


def test_a_moving_window_counts_only_its_own_span():
    """keep=2: the slack between the third-last read and the latest. The worker (tid 11) makes every
    call in the window and is off a CPU 60% of it; a thread that made calls only before the window
    is not a calling thread of it; the main thread (10), busy all along, paces it."""
    w = ThreadWindow(10, keep=2)
    assert w.slack(NAMES) == (None, None)  # one read is no span
    rows = {(12, LAUNCH): (500, 0, 0)}
    assert w.read(rows, sample(0.0, {10: (0.0, 0.0), 11: (0.0, 0.0), 12: (0.0, 0.0)}))
    rows = {(12, LAUNCH): (900, 0, 0), (11, LAUNCH): (0, 0, 0)}
    assert w.read(rows, sample(1.0, {10: (1.0, 0.0), 11: (0.1, 0.0), 12: (0.9, 0.0)}))
    rows = {(12, LAUNCH): (900, 0, 0), (11, LAUNCH): (400, 0, 0)}
    assert w.read(rows, sample(2.0, {10: (2.0, 0.0), 11: (0.5, 0.0), 12: (0.9, 0.0)}))
    rows = {(12, LAUNCH): (900, 0, 0), (11, LAUNCH): (1000, 0, 0)}
    assert w.read(rows, sample(3.0, {10: (3.0, 0.0), 11: (0.9, 0.0), 12: (0.9, 0.0)}))
    threads, pacer = w.slack(NAMES)
    (t,) = threads
    assert t.tid == 11 and t.comm == "t11" and t.calls_share == {"cuLaunchKernel": 1.0}
    assert t.run_s_per_s == pytest.approx(0.4) and t.off_s_per_s == pytest.approx(0.6)
    assert pacer == {"tid": 10, "comm": "t10", "busy_s_per_s": pytest.approx(1.0)}


def test_the_whole_span_from_the_first_read():
    w = ThreadWindow(10, keep=None)
    w.read({(11, LAUNCH): (100, 0, 0)}, sample(0.0, {11: (0.0, 0.0)}))
    w.read({(11, LAUNCH): (200, 0, 0)}, sample(1.0, {11: (0.5, 0.1)}))
    w.read({(11, LAUNCH): (400, 0, 0)}, sample(4.0, {11: (1.0, 1.0)}))
    (t,), _ = w.slack(NAMES)
    assert t.run_s_per_s == pytest.approx(0.25) and t.runq_s_per_s == pytest.approx(0.25)
    assert t.off_s_per_s == pytest.approx(0.5)


def test_a_gone_process_or_an_evicted_row():
    """A process that cannot be read adds no read (its slack stays as it was); a row that went down
    was evicted from the LRU map and counted again from nothing: its later count stands."""
    w = ThreadWindow(999_999_999)
    assert not w.read({})  # no such process: no schedstat
    assert rows_since({(1, 2): (5, 0, 0), (1, 3): (30, 2, 7)}, {(1, 2): (50, 0, 0), (1, 3): (10, 1, 3)}) == \
        {(1, 2): (5, 0, 0), (1, 3): (20, 1, 4)}


def snap(rate_hz: float = 100_000.0, wait: float | None = 0.0, pid: int = 1) -> ProcessSnapshot:
    f = FunctionStats("cuLaunchKernel", FunctionClass.SUBMISSION, 100_000, rate_hz, rate_hz, 0.0, 0, None, None,
                      None, None)
    return ProcessSnapshot(pid, "job", 1.0, 1.0, None, (f,), 0.0, 0.1, wait)


WORKER = (ThreadSlack(11, "worker", {"cuLaunchKernel": 1.0}, 0.3, 0.0, 0.7, 0.0),)
BUSY = (ThreadSlack(21, "main", {"cuLaunchKernel": 1.0}, 0.95, 0.0, 0.05, 0.0),)


def test_top_rows_and_recordings_carry_the_threads_and_audit_per_thread(tmp_path):
    """A row with its threads audits per thread (a 2-us layer on 100k calls/s, A = 20%: hidden in a
    worker off a CPU 70% of the time); through the recording codec it comes back the same; a row of a
    recording made before threads were measured audits the process as one thread (its wait)."""
    from gputrace.hostview.recording import read_record, write_record

    row = ProcessRow(1, "job", snap(), False, threads=WORKER, pacer={"tid": 1, "comm": "job", "busy_s_per_s": 0.9})
    a = row.audit(make_preset("shim", 2000.0))
    assert a.lower_basis == "threads" and a.slowdown_lower == 0.0 and a.threads[0].tid == 11
    assert a.pacer["tid"] == 1
    assert row.audit("shim").lower_basis == "threads"
    frame = HostSnapshot(1.0, "h", (), "", 0.01, (row,))
    path = tmp_path / "rec.jsonl"
    write_record(str(path), [frame])
    (back,) = read_record(str(path))[1]
    (r2,) = back.processes
    assert r2.threads == WORKER and r2.pacer == row.pacer
    assert r2.audit("shim") == row.audit("shim")
    d = host_dict(frame)
    assert d["processes"][0]["audits"]["shim"]["lower_basis"] == "threads"
    del d["processes"][0]["threads"], d["processes"][0]["pacer"]
    old = host_from_dict(d).processes[0]
    assert old.threads is None
    p = old.audit(make_preset("shim", 2000.0))
    assert p.lower_basis == "process" and p.slowdown_lower == pytest.approx(0.2)


def test_a_jobs_audit_takes_each_ranks_threads():
    """Rank 0's calls come from an idle worker (its lower bound 0), rank 1's from a thread that never
    leaves the CPU (20% - 5%); rank 2 was not measured per thread (its wait: 20% - 0). The job's lower
    bound is the largest; each rank's audit says what it rests on."""
    traced = [(1, "/lib", JobTag("j", 0, 3), snap(pid=1), False), (2, "/lib", JobTag("j", 1, 3), snap(pid=2), False),
              (3, "/lib", JobTag("j", 2, 3), snap(pid=3, wait=0.1), False)]
    r = build(traced, [make_preset("shim", 2000.0)], selection="pids 1, 2, 3", options={}, calibration=None,
              traced_s=5.0, threads={1: (WORKER, None), 2: (BUSY, None)})
    by_pid = {k.pid: k.audits[0] for k in r.ranks}
    assert by_pid[1].lower_basis == "threads" and by_pid[1].slowdown_lower == 0.0
    assert by_pid[2].lower_basis == "threads" and by_pid[2].slowdown_lower == pytest.approx(0.15)
    assert by_pid[3].lower_basis == "process" and by_pid[3].slowdown_lower == pytest.approx(0.1)
    (_, job), = r.jobs
    assert job.slowdown_lower == pytest.approx(0.15)
    doc = report_dict(r, 2)
    assert [a["lower_basis"] for k in doc["ranks"] for a in k["audits"]] == ["threads", "threads", "process"]
    # Without threads, every rank as one thread: rank 0 and 1 at A - wait = 20%.
    plain = build(traced, [make_preset("shim", 2000.0)], selection="x", options={}, calibration=None, traced_s=5.0)
    assert plain.jobs[0][1].slowdown_lower == pytest.approx(0.2)


def test_a_slack_not_measured_is_not_known_never_0():
    """A calling thread whose scheduler times were not read (it ended before the span's last read)
    leaves the lower bound not known, in a row as in a job; the upper bound stands."""
    gone = (ThreadSlack(11, "worker", {"cuLaunchKernel": 1.0}, None, None, None, 0.0, False),)
    row = ProcessRow(1, "job", snap(), False, threads=gone)
    a = row.audit(make_preset("shim", 2000.0))
    assert a.slowdown_lower is None and a.slowdown_upper == pytest.approx(0.3)
    r = build([(1, "/lib", JobTag("j", 0, 1), snap(), False)], [make_preset("shim", 2000.0)], selection="x",
              options={}, calibration=None, traced_s=5.0, threads={1: (gone, None)})
    assert r.ranks[0].audits[0].slowdown_lower is None and r.jobs[0][1].slowdown_lower is None


# --- live, on simcuda (root and BPF) ---------------------------------------------------------------------

WORKER_ARGS = ["--seconds", "120", "--launches", "16", "--work-ns", "150000", "--hold"]


def worker(spawned) -> subprocess.Popen:
    """simcuda's worker client, set up and released: from here on its worker thread makes the calls."""
    p = subprocess.Popen(simcuda.workload("worker") + WORKER_ARGS, env=simcuda.env(), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spawned.append(p)
    assert json.loads(p.stdout.readline())["hold"] == 1
    p.stdin.write("\n")
    p.stdin.flush()
    return p


def assert_worker_carries_the_calls(pid: int, audit: dict) -> None:
    assert audit["lower_basis"] == "threads", audit
    carriers = [t for t in audit["threads"] if t["added_s_per_s"] > 0]
    # The main thread makes no call in the loop: the calls are the worker's, and its slack was measured.
    assert carriers and all(t["tid"] != pid for t in carriers), audit["threads"]
    assert all(t["headroom_s_per_s"] is not None and 0.0 <= t["headroom_s_per_s"] <= 1.0 for t in carriers)
    assert audit["slowdown_lower"] is not None and audit["slowdown_lower"] <= audit["slowdown_upper"]
    assert audit["pacer"] is not None


@pytest.mark.parametrize("counts", [(0, 100, 100), (0, 0, 300)], ids=["all-in-the-first-interval", "all-late"])
def test_a_jobs_rank_reads_its_threads_over_the_whole_span_though_its_summary_stands_still(counts):
    """(cumulative: attach -p A,B) A rank's threads are read before the first interval and at every
    step after, not only when its summary changed: read first at its first summary and then only at
    a new one, a rank whose calls were counted in the first interval, or whose summary then stood
    still (no window of its own later, two ranks on a loaded host), had no calls between its reads,
    and its audit no threads (`lower_basis` "process"). The session is a stand-in: `counts` are the
    worker's calls in `tstats` at the three reads."""
    import os
    import threading
    import types

    from gputrace.hostview.live import _FileTracer

    pid = os.getpid()
    reads = iter([{pid: {(pid, LAUNCH): (n, 0, 0)}} if n else {} for n in counts])
    ft = object.__new__(_FileTracer)
    ft.cumulative, ft.history_len = True, 30
    ft.latest, ft.history, ft._history_t, ft.gone, ft.finished = {}, {}, {}, set(), {}
    ft._windows, ft.threads, ft._names, ft._lock = {}, {}, None, threading.Lock()
    ft.session = types.SimpleNamespace(
        program=types.SimpleNamespace(read_thread_stats_by_tgid=lambda: next(reads)),
        probes=types.SimpleNamespace(ids={LAUNCH: types.SimpleNamespace(name="cuLaunchKernel")}), exited=[])
    ft._first_read([pid])
    summary = snap(pid=pid)
    ft._publish({pid: summary})
    ft._publish({pid: summary})  # the same summary: nothing new measured for it
    threads, pacer = ft.threads_of(pid)
    assert threads is not None and pacer is not None, counts
    (t,) = threads
    assert t.tid == pid and t.calls_share == {"cuLaunchKernel": 1.0}


@pytest.mark.bpf
@pytest.mark.usefixtures("bpf_host")
@pytest.mark.timeout(240)
def test_record_and_its_replay_audit_per_thread(spawned, tmp_path):
    """`record` (top's moving span) measures the worker's threads; the replayed recording audits with them."""
    from gputrace.hostview.recording import ReplaySource

    p = worker(spawned)
    out = tmp_path / "session.jsonl"
    rec = subprocess.run(CLI + ["record", "-o", str(out), "-i", "0.5", "-d", "5"], capture_output=True, timeout=180)
    assert rec.returncode == 0, rec.stderr.decode()
    rows = [r for f in ReplaySource(str(out), speed=0).frames() for r in f.processes if r.pid == p.pid]
    assert rows and rows[-1].threads is not None, out.read_text()[:2000]
    last = orjson.loads(out.read_bytes().splitlines()[-1])
    (row,) = [r for r in last["processes"] if r["pid"] == p.pid]
    assert_worker_carries_the_calls(p.pid, row["audits"]["shim"])
    replay = subprocess.run(CLI + ["top", "--replay", str(out), "--once", "--json"], capture_output=True, timeout=60)
    assert replay.returncode == 0, replay.stderr.decode()
    (back,) = [r for r in orjson.loads(replay.stdout)["processes"] if r["pid"] == p.pid]
    # The same threads, and the audit on them (its rates may differ where one was not known: a
    # recording keeps such a rate as its range, and a replay takes its middle).
    assert back["threads"] == row["threads"] and back["audits"]["shim"]["lower_basis"] == "threads"
    assert [(t["tid"], t["headroom_s_per_s"]) for t in back["audits"]["shim"]["threads"]] == \
        [(t["tid"], t["headroom_s_per_s"]) for t in row["audits"]["shim"]["threads"]]


@pytest.mark.bpf
@pytest.mark.usefixtures("bpf_host")
@pytest.mark.timeout(240)
def test_a_jobs_attach_audits_each_rank_per_thread(spawned):
    """`attach -p A,B`: each rank's audit over its whole span rests on its calling threads."""
    a, b = worker(spawned), worker(spawned)
    r = subprocess.run(CLI + ["attach", "-p", f"{a.pid},{b.pid}", "-d", "5", "-i", "0.5", "--json", "-q",
                              "--preset", "shim", "--cost-ns", "2000"], capture_output=True, timeout=180)
    assert r.returncode == 0, r.stderr.decode()
    doc = orjson.loads(r.stdout)
    assert {k["pid"] for k in doc["ranks"]} == {a.pid, b.pid}
    # (A rank no window measured, on a loaded machine, has no audit to rest on anything: not_measured says so.)
    measured = [k for k in doc["ranks"] if k["summary"]["not_measured"] is None]
    assert measured, [k["summary"]["not_measured"] for k in doc["ranks"]]
    for k in measured:
        (au,) = k["audits"]
        assert_worker_carries_the_calls(k["pid"], au)
    (job,) = doc["job"]
    if len(measured) == 2:
        assert job["slowdown_lower"] == max(k["audits"][0]["slowdown_lower"] for k in measured)
