"""`top` on this host's kernel: `top --once --json` over two simcuda workloads, with rates checked against the
counts the workloads report, and the live source picking up a process started after it and dropping one that exits.

Needs root and bcc (CI has both). The workloads' knobs keep probe perturbation moderate on a small VM: short
launches (0.2 ms of CPU each) and 3 ms kernels, so the processes mostly wait in cuStreamSynchronize (which
also gives the WAIT column something to show). No sleeps: the test waits on processes and on frames.
"""

from __future__ import annotations

import json
import subprocess
import sys

import orjson
import pytest

from gputrace import simcuda

pytestmark = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_host"), pytest.mark.timeout(240)]

CLI = [sys.executable, "-m", "gputrace"]
KNOBS = ["--scale", "0.05", "--launch-ns", "200000", "--kernel-ns", "3000000"]


def workload(seconds: float) -> subprocess.Popen:
    return subprocess.Popen(simcuda.workload("launch_bound") + ["--seconds", str(seconds), *KNOBS], env=simcuda.env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def report(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    doc = json.loads(lines[-1])
    assert doc.get("check", "ok") == "ok", doc
    return doc


def test_once_json_shows_both_processes_with_rates_within_their_intervals(spawned):
    procs = [workload(40), workload(40)]
    spawned.extend(procs)
    top = subprocess.run(CLI + ["top", "--once", "--json", "-i", "0.5", "-d", "10"], capture_output=True, timeout=180)
    assert top.returncode == 0, top.stderr.decode()
    assert b"Traceback" not in top.stderr, top.stderr.decode()
    # Measured while both ran, or the comparison below means nothing.
    assert all(p.poll() is None for p in procs), "the workloads ended before top had measured them"
    doc = orjson.loads(top.stdout)
    assert doc["schema"] == 2 and doc["kind"] == "gputrace.top.frame"
    rows = {r["pid"]: r for r in doc["processes"]}
    for p in procs:
        assert p.pid in rows, (p.pid, sorted(rows), doc["pending"], doc["notes"])
    results = []
    for p in procs:
        wl = report(p)
        row = rows[p.pid]
        assert row["comm"] == "launch_bound" and row["shimmed"] is False
        # (A rate not known is null with its 95% range beside it: its middle and half-width, the interval stated.)
        got = {f["name"]: ((sum(f["rate_range_hz"]) / 2, (f["rate_range_hz"][1] - f["rate_range_hz"][0]) / 2)
                           if f["rate_hz"] is None and f.get("rate_range_hz") else (f["rate_hz"], f["rate_err_hz"]))
               for f in row["snapshot"]["functions"]}
        hot = {n: c / wl["elapsed_s"] for n, c in wl["calls"].items() if c / wl["elapsed_s"] > 300}
        assert hot, wl
        for name, rate in hot.items():
            assert name in got, (name, sorted(got))
            results.append((p.pid, name, got[name], rate))
        shim = row["audits"]["shim"]
        assert 0 <= shim["slowdown_lower"] <= shim["slowdown_upper"]
    assert doc["tracer_overhead"] is not None and doc["tracer_overhead"] < 0.02 * 2
    # Each rate is right within what the row says of it (its 95% interval), for every function above
    # 1k calls/s; a fixed tolerance instead failed now and then on the 2-CPU VM under load (a function
    # at 633/s read 744/s, inside its interval). The intervals hold over many runs: tests/test_tracer_estimates.py.
    for pid, name, (g, err), rate in results:
        assert err is not None, (pid, name, g)
        if rate >= 1000:
            assert abs(g - rate) <= err, (pid, name, g, err, rate)


def test_a_process_started_later_appears_and_one_that_exits_leaves(spawned):
    from gputrace.tracer.session import Options
    from gputrace.hostview.live import LiveSource

    first = workload(60)
    spawned.append(first)
    src = LiveSource(Options(interval_s=0.5), refresh_s=0.5)
    later = None
    shared = False
    try:
        for frame in src.frames():
            seen = {r.pid for r in frame.processes}
            if later is None and first.pid in seen:
                later = workload(60)  # starts only once top is already showing the first
                spawned.append(later)
            if not shared and later is not None and later.pid in seen:
                row = next(r for r in frame.processes if r.pid == later.pid)
                assert row.comm == "launch_bound"
                if row.snapshot.calls_hz > 0:  # its first frame may precede its first window's calls
                    # Both map the same simcuda libcuda: one host session (one program, one set of
                    # links) traces both. Checked here: leaving the loop closes the source.
                    session = src.session_of(first.pid)
                    assert session is not None and session is src.session_of(later.pid)
                    assert {first.pid, later.pid} <= set(session.tracees)
                    shared = True
                    first.kill()
                    first.wait()
            if shared and first.pid not in seen and first.pid not in frame.pending:
                assert later.pid in seen  # the one still running stays
                assert first.pid not in session.tracees
                break
    finally:
        src.close()
    assert shared and later.poll() is None


def test_a_job_whose_calls_change_after_it_is_found_is_counted_in_full(spawned):
    """PyTorch maps libcuda at its first CUDA call, then loads and sets up for seconds before its loop:
    the window that finds it sees none of the loop's functions. They are on the watch link, which
    counts their first calls and moves them into the windows at once: the loop shows in the row of
    the next refresh or the one after (here, within 2 s), whatever the process's age."""
    from gputrace.tracer.session import Options
    from gputrace.hostview.live import LiveSource

    proc = subprocess.Popen(simcuda.workload("launch_bound") + ["--seconds", "60", "--warmup-stdin", *KNOBS],
                            env=simcuda.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    spawned.append(proc)
    src = LiveSource(Options(interval_s=0.5), refresh_s=0.5)
    switched = after = None
    try:
        for n, frame in enumerate(src.frames()):
            assert proc.poll() is None, proc.stderr.read()
            row = next((r for r in frame.processes if r.pid == proc.pid), None)
            if row is None:
                continue
            called = {f.name for f in row.snapshot.functions if f.calls_observed}
            if switched is None:
                if "cuMemGetInfo_v2" in called and n >= 6:  # measured in its start-up for a while: now the loop
                    assert "cuCtxGetDevice_v2" not in called, called
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                    switched = n
            elif "cuCtxGetDevice_v2" in called:
                after = n - switched
                break
            else:
                assert n - switched <= 4, (n - switched, called)  # 4 refreshes of 0.5 s: 2 s
    finally:
        src.close()
    assert switched is not None and after is not None and after <= 4, (switched, after)
    assert {"cuLaunchKernel", "cuDevicePrimaryCtxGetState"} <= called, called


def test_record_writes_a_session_that_replays(spawned, tmp_path):
    from gputrace.hostview.recording import ReplaySource

    proc = workload(120)
    spawned.append(proc)
    out = tmp_path / "session.jsonl"
    rec = subprocess.run(CLI + ["record", "-o", str(out), "-i", "0.5", "-d", "8"], capture_output=True, timeout=180)
    assert rec.returncode == 0, rec.stderr.decode()
    assert b"frames written to" in rec.stderr
    frames = list(ReplaySource(str(out), speed=0).frames())
    assert frames, out.read_text()
    assert any(r.pid == proc.pid and r.snapshot.calls_hz > 0 for f in frames for r in f.processes)


def test_hold_takes_tops_probes_off_every_process_on_the_file_until_it_ends(spawned):
    """What `w` (a whole-job checkpoint) relies on: while held, no breakpoint of top's is in any process
    on the libcuda file, so CRIU copies none; afterwards top traces them again."""
    from gputrace.checkpointer import uprobes
    from gputrace.tracer.session import Options
    from gputrace.hostview.live import LiveSource

    procs = [workload(60), workload(60)]
    spawned.extend(procs)
    src = LiveSource(Options(interval_s=0.5), refresh_s=0.5)
    held = False
    try:
        for n, frame in enumerate(src.frames()):
            rows = {r.pid: r for r in frame.processes}
            if not held and all(p.pid in rows and rows[p.pid].snapshot.calls_hz > 0 for p in procs):
                with src.hold_tracing(procs[0].pid) as quiet:
                    assert quiet
                    session = src.session_of(procs[0].pid)
                    p = session.probes
                    assert not p.links and p.marker_link is None and p.watch_link is None
                    for p in procs:  # the links are the file's: the other process is free of them too
                        t = uprobes.settle(p.pid)
                        assert t.uprobes_page is not None and not t.harmful, t.describe()
                held, resumed_by = True, n + 40
                session._epoll = waits = CountingEpoll(session._epoll)
            elif held and any(uprobes.traces(p.pid).breakpoints for p in procs):
                break  # the watch link or a window is back
            assert not held or n < resumed_by, "top did not trace again after the hold"
    finally:
        src.close()
    assert held and all(p.poll() is None for p in procs)
    # The hold woke the stepping thread through its wake pipe; emptied, the waits after it sleep
    # again (one a watch poll, probes.poll_s, and a few more a frame) rather than return at once until
    # their deadline.
    frames = n + 1 - (resumed_by - 40)
    assert waits.polls < frames * (0.5 / session.probes.poll_s + 10), waits.polls


class CountingEpoll:
    def __init__(self, epoll) -> None:
        self.epoll, self.polls = epoll, 0

    def poll(self, *args):
        self.polls += 1
        return self.epoll.poll(*args)

    def __getattr__(self, name):
        return getattr(self.epoll, name)
