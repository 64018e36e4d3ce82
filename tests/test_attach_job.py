"""`gputrace attach` of a job (--tree LAUNCHER, -p A,B, --job -- CMD): every rank traced at the budget,
each rank's audit and the job's (it moves at its slowest rank's pace), on simcuda's collective job with
real eBPF; and the report built from synthetic ranks (hostview/jobaudit.py)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from gputrace.base.units import fmt_pct

from gputrace import report as rep
from gputrace import simcuda
from gputrace.hostview.jobaudit import NOT_FOUND_YET, build, function_totals
from gputrace.hostview.jobs import JobTag
from gputrace.tracer.audit import PRESETS
from gputrace.tracer.classify import FunctionClass
from gputrace.tracer.model import FunctionStats, ProcessSnapshot

GT = [sys.executable, "-m", "gputrace"]
PRESET_LIST = [PRESETS["shim"], PRESETS["proxy"]]


def _snap(pid: int, launches_hz: float, wait: float | None, *, not_measured: str | None = None) -> ProcessSnapshot:
    f = FunctionStats("cuLaunchKernel", FunctionClass.SUBMISSION, int(launches_hz), launches_hz, launches_hz, 0.0,
                      10, 3000.0, 3000.0, 3000.0, 4000.0)
    s = FunctionStats("cuStreamSynchronize", FunctionClass.SYNC, 100, 100.0, 100.0, 0.0, 100,
                      1e6, 1e6, 1e6, 2e6)
    return ProcessSnapshot(pid, f"rank{pid}", 5.0, 0.05, 4.0, (f, s), 0.01, 0.05, wait, not_measured=not_measured)


def _build(traced, selection="the tree of pid 1"):
    return build(traced, PRESET_LIST, selection=selection, options={"exact": False, "budget": 0.01},
                 calibration=None, traced_s=5.0)


def test_the_job_slows_by_its_slowest_ranks_bounds_and_calls_add_up():
    tag = lambda r: JobTag("torchrun r7", r, 2)  # noqa: E731
    r = _build([(11, "/lib/libcuda.so.1", tag(1), _snap(11, 50_000, 0.02), False),
                (10, "/lib/libcuda.so.1", tag(0), _snap(10, 20_000, 0.5), False)])
    assert r.key == "torchrun r7" and r.world == 2
    assert [k.rank for k in r.ranks] == [0, 1]  # in rank order, not pid order
    for (p, j), i in zip(r.jobs, range(2)):
        uppers = [k.audits[i].slowdown_upper for k in r.ranks]
        lowers = [k.audits[i].slowdown_lower for k in r.ranks]
        assert j.slowdown_upper == max(uppers) and j.slowdown_lower == max(lowers)
        assert j.slowest == 11  # the rank with twice the launches and little wait
        assert j.calls_hz == pytest.approx(sum(k.summary.calls_hz for k in r.ranks))
    (proxy_job,) = [j for p, j in r.jobs if p.name == "proxy"]
    assert proxy_job.slowdown_lower > 0  # rank 1's added time does not fit in its wait


def test_a_rank_not_measured_leaves_the_jobs_upper_bound_not_known_and_says_so():
    r = _build([(10, "/l", JobTag(), _snap(10, 20_000, 0.5), False),
                (12, "/l", JobTag(), None, False),
                (13, "/l", JobTag(), _snap(13, 0, None, not_measured="no window had opened"), True)],
               selection="pids 10, 12, 13")
    assert r.key == "pids 10, 12, 13"  # no launcher names the job
    assert all(j.slowdown_upper is None and j.calls_hz is None for _, j in r.jobs)
    by_pid = {k.pid: k for k in r.ranks}
    # Rank 10's lower bound is the job's: the job can go no faster than it.
    assert [j.slowdown_lower for _, j in r.jobs] == [a.slowdown_lower for a in by_pid[10].audits]
    assert by_pid[12].summary.not_measured == NOT_FOUND_YET and by_pid[13].exited
    out = io.StringIO()
    rep.get("text", kind="job").final(r, out)
    text = out.getvalue()
    assert "not measured: no window had opened" in text
    for _, j in r.jobs:  # rank 10's lower bound shown, never dropped for the ranks that lack one
        assert f"at least {fmt_pct(j.slowdown_lower)} (the upper bound is not known: a process was not measured)" in text
    assert "0.0%" not in text.split("job ", 2)[-1].splitlines()[0]  # the job's line shows "-", never 0
    doc = json.loads(_json(r))
    assert doc["kind"] == "gputrace.attach.job" and {j["slowdown_upper"] for j in doc["job"]} == {None}
    assert [k["summary"]["calls_hz"] for k in doc["ranks"]][1:] == [None, None]


def _json(r) -> str:
    out = io.StringIO()
    rep.get("json", kind="job").final(r, out)
    return out.getvalue()


def test_function_totals_sum_the_ranks_rates_and_weigh_their_means():
    a, b = _snap(1, 1000, 0.1), _snap(2, 3000, 0.1)
    b = ProcessSnapshot(**{**b.__dict__, "functions": (
        FunctionStats("cuLaunchKernel", FunctionClass.SUBMISSION, 3000, 3000, 3000.0, 0.0, 10, 1000.0, 1000.0,
                      1000.0, 2000.0),)})
    r = _build([(1, "/l", JobTag(), a, False), (2, "/l", JobTag(), b, False)])
    (launch,) = [t for t in function_totals(r.ranks) if t.name == "cuLaunchKernel"]
    assert launch.rate_hz == 4000 and launch.ranks == 2
    assert launch.mean_ns == pytest.approx((3000 * 1000 + 1000 * 3000) / 4000)


# --- live, on simcuda's collective job, with real eBPF ----------------------------------------------------
def _job(spawned, *extra, kernel_ns=200_000, env_extra=None):
    """simcuda's collective job of 2 ranks, running; returns (launcher, [rank pids])."""
    p = subprocess.Popen(simcuda.workload("collective") + ["--ranks", "2", "--words", "256", "--kernel-ns",
                                                           str(kernel_ns), *extra],
                         env={**simcuda.env(), "GPUTRACE_JOB": "attachjob", **(env_extra or {})},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spawned.append(p)
    ranks = json.loads(p.stdout.readline())["ranks"]
    for _ in ranks:  # each rank's first step: every rank has made driver calls
        json.loads(p.stdout.readline())
    threading.Thread(target=p.stdout.read, daemon=True).start()
    return p, ranks


def _other(spawned):
    o = subprocess.Popen(simcuda.workload("launch_bound") + ["--seconds", "60", "--scale", "0.05"], env=simcuda.env(),
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spawned.append(o)
    return o


def _quit(p):
    p.stdin.write("quit\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0


@pytest.mark.bpf
@pytest.mark.usefixtures("bpf_host")
@pytest.mark.timeout(240)
def test_attach_tree_exact_counts_every_rank_and_nothing_outside_the_tree(spawned):
    other = _other(spawned)
    p, ranks = _job(spawned)
    r = subprocess.run(GT + ["attach", "--tree", str(p.pid), "--exact", "-d", "3", "-i", "0.5", "--json", "-q"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    by_pid = {k["pid"]: k for k in doc["ranks"]}
    assert set(ranks) <= set(by_pid) <= set(ranks) | {p.pid} and other.pid not in by_pid
    assert doc["key"] == "gputrace run attachjob" and doc["selection"] == f"the tree of pid {p.pid}"
    for pid in ranks:
        k = by_pid[pid]
        assert k["summary"]["not_measured"] is None and not k["exited"]
        fs = {f["name"]: f for f in k["summary"]["functions"]}
        launches, copies = fs["cuLaunchKernel"], fs["cuMemcpyDtoH_v2"]
        for f in (launches, copies):
            assert f["calls_estimated"] == f["calls_observed"] and f["rate_err_hz"] == 0
        # Each step launches 4 kernels and copies back twice: counted throughout, the counts agree
        # to within the step in progress at each end.
        assert launches["calls_observed"] > 1000
        assert abs(launches["calls_observed"] - 2 * copies["calls_observed"]) <= 8
    (shim,) = [j for j in doc["job"] if j["preset"] == "shim"]
    rank_uppers = [a["slowdown_upper"] for k in doc["ranks"] for a in k["audits"] if a["preset"] == "shim"]
    assert shim["slowdown_upper"] == max(rank_uppers) and shim["slowest"] in ranks
    assert shim["calls_hz"] == pytest.approx(sum(k["summary"]["calls_hz"] for k in doc["ranks"]))
    _quit(p)


@pytest.mark.bpf
@pytest.mark.usefixtures("bpf_host")
@pytest.mark.timeout(240)
def test_attach_pids_at_the_budget_measures_each_rank_and_keeps_one_that_dies(spawned):
    p, ranks = _job(spawned)
    a = subprocess.Popen(GT + ["attach", "-p", ",".join(map(str, ranks)), "-d", "5", "-i", "0.5"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spawned.append(a)
    victim = ranks[1]
    for line in a.stderr:  # the rank is killed once the tracer has measured it
        if f"pid {victim} " in line and "calls/s" in line and "not measured" not in line.split(f"pid {victim}")[1][:20]:
            break
    os.kill(victim, signal.SIGKILL)
    out, err = a.communicate(timeout=120)
    assert a.returncode == 0, err
    rows = {int(l.split()[1]): l for l in out.splitlines() if l.strip()[:1] == "-" and len(l.split()) > 2
            and l.split()[1].isdigit()}
    assert set(rows) == set(ranks), out
    assert "(exited)" in rows[victim] and "not measured" not in rows[victim], out
    assert "not measured" not in rows[ranks[0]] and "calls/s" in out, out
    assert "job gputrace run attachjob" in out.splitlines()[0]
    p.kill()  # the survivor waits in the collective for its dead peer


@pytest.mark.bpf
@pytest.mark.usefixtures("bpf_host")
@pytest.mark.timeout(240)
def test_attach_job_command_traces_the_ranks_it_starts_until_they_end():
    r = subprocess.run(GT + ["attach", "--job", "-i", "0.25", "--json", "-q", "--"] + simcuda.workload("collective")
                       + ["--ranks", "2", "--words", "256", "--kernel-ns", "500000", "--steps", "4000"],
                       env={**os.environ, **simcuda.env()}, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["exit_status"] == 0 and doc["command"][-1] == "4000"
    # Measured: a rate, or one not known (a 1-s rank read at 1%), not "not measured".
    measured = [k for k in doc["ranks"] if k["summary"]["calls_hz"] or k["summary"]["calls_not_known"]]
    assert len(measured) == 2 and all(k["exited"] for k in measured)
    assert '"rank"' in r.stderr  # the command's own output went to stderr: stdout is the report's


@pytest.mark.bpf
@pytest.mark.usefixtures("bpf_host")
@pytest.mark.timeout(120)
def test_attach_job_errors_name_the_cause(spawned):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    spawned.append(sleeper)
    cases = [
        (["--tree", "999999999"], "no process with pid 999999999"),
        (["-p", f"{sleeper.pid},{os.getpid()}", "-d", "1"], "maps a libcuda"),
        (["--job"], "--job traces a command"),
        (["--tree", str(sleeper.pid), "--jsonl"], "--jsonl follows one process"),
        (["--tree", str(sleeper.pid), "--", "true"], "not both"),
    ]
    for argv, want in cases:
        r = subprocess.run(GT + ["attach", *argv], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and want in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
    r = subprocess.run(GT + ["attach", "--tree", str(sleeper.pid), "-d", "1.5", "-q"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "mapped a libcuda while it was traced" in r.stderr and "--tree" in r.stderr, r.stderr
