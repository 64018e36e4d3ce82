"""Ranks grouped by job: what each launcher's environment says (hostview/jobs.py), and the job's
figures in `top` (its slowest rank's bounds, every rank's calls), live and from synthetic frames."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from gputrace.hostview.jobs import JobTag, from_environ, job_tag
from gputrace.hostview.model import host_dict, host_from_dict
from gputrace.tui.text import render_host

import topdata
from shimtest import procs  # noqa: F401  (fixtures)


@pytest.mark.parametrize("env, want", [
    ({"TORCHELASTIC_RUN_ID": "r1", "RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     JobTag("torchrun r1", 3, 8)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "PMIX_NAMESPACE": "prterun-x-1"},
     JobTag("mpi prterun-x-1", 1, 4)),
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_NTASKS": "4"}, JobTag("slurm 77.0", 2, 4)),
    ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"},
     JobTag("torch.distributed 10.0.0.1:29500", 0, 2)),
    ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, JobTag()),  # no world size: not a rank of one
    ({"GPUTRACE_JOB": "ab12", "RANK": "x"}, JobTag("gputrace run ab12")),
    ({"HOME": "/root"}, JobTag()),
])
def test_each_launchers_environment_names_the_job_and_the_rank(env, want):
    assert from_environ(env) == want


def test_a_process_is_read_from_what_it_was_started_with(procs):
    import os

    env = dict(os.environ, TORCHELASTIC_RUN_ID="t9", RANK="1", WORLD_SIZE="2")
    p = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    procs.append(p)
    assert p.stdout.readline() == b"up\n"  # exec'd: /proc/PID/environ is its own now
    assert job_tag(p.pid) == JobTag("torchrun t9", 1, 2)
    assert job_tag(2**22 + 12345) == JobTag()  # gone (or never was): no job, no error


def _frame(tags):
    f = topdata.frame()
    rows = tuple(dataclasses.replace(r, job=tags.get(r.pid, JobTag())) for r in f.processes)
    return dataclasses.replace(f, processes=rows)


def test_a_jobs_ranks_are_one_job_that_runs_at_its_slowest_ranks_pace():
    f = _frame({4242: JobTag("torchrun r1", 0, 2), 1111: JobTag("torchrun r1", 1, 2), 3333: JobTag("gputrace run z")})
    (j,) = f.jobs("proxy")  # 3333 alone is no job
    by_pid = {r.pid: r for r in f.processes}
    a, b = by_pid[4242].audit("proxy"), by_pid[1111].audit("proxy")
    assert j.key == "torchrun r1" and j.ranks == ((0, 4242), (1, 1111)) and j.world == 2
    assert j.calls_hz == pytest.approx(by_pid[4242].snapshot.calls_hz + by_pid[1111].snapshot.calls_hz)
    assert j.slowdown_upper == max(a.slowdown_upper, b.slowdown_upper)
    assert j.slowdown_lower == max(a.slowdown_lower, b.slowdown_lower)
    assert j.slowest == (4242 if a.slowdown_upper >= b.slowdown_upper else 1111)
    text = render_host(f, "proxy")
    assert "job torchrun r1: 2 ranks (rank 0 pid 4242, rank 1 pid 1111)" in text
    assert f"slowest rank pid {j.slowest}" in text and "gputrace run z" not in text
    # Through the frame's JSON and back, as `top --once --json` and `record` write it.
    d = json.loads(json.dumps(host_dict(f)))
    assert d["jobs"]["proxy"][0]["ranks"] == [{"rank": 0, "pid": 4242}, {"rank": 1, "pid": 1111}]
    assert host_from_dict(d).jobs("proxy") == f.jobs("proxy")


def test_a_job_with_a_rank_not_measured_has_no_upper_bound_and_the_others_lower_one():
    """The job moves at its slowest rank's pace: a measured rank's lower bound holds for the job
    whatever the others do; the upper bound needs every rank's."""
    f = _frame({4242: JobTag("mpi x", 0, 3), 1111: JobTag("mpi x", 1, 3)})
    measured = next(r for r in f.processes if r.pid == 4242).audit("proxy")
    rows = tuple(dataclasses.replace(r, snapshot=dataclasses.replace(r.snapshot, not_measured="no window yet"))
                 if r.pid == 1111 else r for r in f.processes)
    (j,) = dataclasses.replace(f, processes=rows).jobs("proxy")
    assert j.calls_hz is None and j.slowdown_upper is None and j.slowest is None
    assert measured.slowdown_lower is not None and j.slowdown_lower == measured.slowdown_lower
    assert j.world == 3 and "job mpi x: 2 ranks of 3" in render_host(dataclasses.replace(f, processes=rows), "proxy")


@pytest.mark.bpf
@pytest.mark.usefixtures("bpf_host")
@pytest.mark.timeout(240)
def test_top_once_lists_a_running_jobs_ranks_as_one_job(spawned):
    """simcuda's collective job (a launcher and two ranks, one allreduce a step), started as
    `gputrace run` starts what it runs (GPUTRACE_JOB in its environment): `top --once --json` lists
    both ranks under one job, with their summed calls/s and the slowest rank's bounds."""
    import threading

    from gputrace import simcuda

    env = dict(simcuda.env(), GPUTRACE_JOB="jobtest1")
    p = subprocess.Popen(simcuda.workload("collective") + ["--ranks", "2", "--words", "256", "--kernel-ns", "1000000"],
                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spawned.append(p)
    hello = json.loads(p.stdout.readline())
    ranks = hello["ranks"]
    for _ in ranks:  # both ranks have stepped: they call the driver
        assert json.loads(p.stdout.readline())["step"] >= 1
    threading.Thread(target=p.stdout.read, daemon=True).start()  # a line a step: never let the pipe fill
    top = subprocess.run([sys.executable, "-m", "gputrace", "top", "--once", "--json", "-i", "0.5", "-d", "4"],
                         capture_output=True, timeout=180)
    assert top.returncode == 0, top.stderr.decode()
    doc = json.loads(top.stdout)
    rows = {r["pid"]: r for r in doc["processes"]}
    assert set(ranks) <= set(rows), (ranks, sorted(rows), doc["pending"])
    assert all(rows[pid]["job"]["key"] == "gputrace run jobtest1" for pid in ranks)
    (j,) = [j for j in doc["jobs"]["shim"] if j["key"] == "gputrace run jobtest1"]
    pids = [r["pid"] for r in j["ranks"]]
    assert set(ranks) <= set(pids) and set(pids) <= set(rows)
    calls = [rows[pid]["snapshot"]["calls_hz"] for pid in pids]  # (null: a rank's not known, and so the job's)
    assert j["calls_hz"] == (None if None in calls else pytest.approx(sum(calls)))
    uppers = [rows[pid]["audits"]["shim"]["slowdown_upper"] for pid in pids]
    assert j["slowdown_upper"] == max(uppers) and j["slowest"] in pids
    p.stdin.write("quit\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0


@pytest.mark.timeout(60)
async def test_the_dashboards_header_lists_each_job_of_several_ranks(tmp_path):
    from gputrace.hostview.checkpoints import FakeCheckpointer
    from gputrace.hostview.recording import ReplaySource, write_record
    from gputrace.tui.app import TopApp
    from gputrace.tui.screens.main import MainScreen

    tags = {4242: JobTag("torchrun r1", 0, 2), 1111: JobTag("torchrun r1", 1, 2)}
    frames = [dataclasses.replace(f, processes=tuple(dataclasses.replace(r, job=tags.get(r.pid, JobTag()))
                                                     for r in f.processes)) for f in topdata.frames(2)]
    path = tmp_path / "s.jsonl"
    write_record(str(path), frames)
    app = TopApp(ReplaySource(str(path), speed=0), FakeCheckpointer())
    async with app.run_test(size=(200, 30)) as pilot:
        while not (app.ended and isinstance(app.screen, MainScreen)):
            await pilot.pause()
        await pilot.pause()
        header = str(app.screen.query_one("#header").render())
        line = next(ln for ln in header.splitlines() if ln.startswith("job "))
        assert line.startswith("job torchrun r1: 2 ranks (rank 0 pid 4242, rank 1 pid 1111)") and "slowest rank" in line


@pytest.mark.bpf
@pytest.mark.usefixtures("bpf_host")
@pytest.mark.timeout(240)
def test_top_tree_shows_one_jobs_processes_only(spawned):
    """`top --once --tree LAUNCHER`: the job's ranks, not a process of the host outside its tree."""
    import threading

    from gputrace import simcuda

    other = subprocess.Popen(simcuda.workload("launch_bound") + ["--seconds", "60", "--scale", "0.05"],
                             env=simcuda.env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    spawned.append(other)
    p = subprocess.Popen(simcuda.workload("collective") + ["--ranks", "2", "--words", "256", "--kernel-ns", "1000000"],
                         env=dict(simcuda.env(), GPUTRACE_JOB="jobtest2"), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spawned.append(p)
    ranks = json.loads(p.stdout.readline())["ranks"]
    for _ in ranks:
        json.loads(p.stdout.readline())
    threading.Thread(target=p.stdout.read, daemon=True).start()
    top = subprocess.run([sys.executable, "-m", "gputrace", "top", "--once", "--json", "-i", "0.5", "-d", "3",
                          "--tree", str(p.pid)], capture_output=True, timeout=180)
    assert top.returncode == 0, top.stderr.decode()
    doc = json.loads(top.stdout)
    listed = {r["pid"] for r in doc["processes"]} | set(doc["pending"])
    assert set(ranks) <= listed <= set(ranks) | {p.pid} and other.pid not in listed
    assert [j["key"] for j in doc["jobs"]["shim"]] == ["gputrace run jobtest2"]
    r = subprocess.run([sys.executable, "-m", "gputrace", "top", "--once", "--tree", "999999999"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "no process with pid 999999999" in r.stderr and "Traceback" not in r.stderr
    p.stdin.write("quit\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0
