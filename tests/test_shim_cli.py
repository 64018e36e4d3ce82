"""`gputrace run --checkpointable`, `gputrace shim status`, `gputrace ps`, and their error messages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import orjson
from gputrace import simcuda
from gputrace.cli import main as cli_main
from gputrace.shim import client

from shimtest import expected_allocs, procs, reported_allocs, shim_dir, start  # noqa: F401  (fixtures)

def gputrace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=60)


def test_cli_run_status_and_ps(procs, shim_dir):
    p = subprocess.Popen([sys.executable, "-m", "gputrace", "run", "--checkpointable", "--",
                          *simcuda.workload("alloc_free"), "--steps", "1", "--hold"],
                         env=simcuda.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    procs.append(p)
    held = json.loads(p.stdout.readline())
    assert held["hold"] == 1
    r = gputrace("shim", "status", "-p", str(p.pid), "--json")
    assert r.returncode == 0, r.stderr
    st = orjson.loads(r.stdout)
    assert reported_allocs(st) == expected_allocs(held)  # `run` exec'd the workload itself: same pid
    text = gputrace("shim", "status", "-p", str(p.pid))
    assert text.returncode == 0 and f"pid {p.pid} (alloc_free)" in text.stdout and "pitch" in text.stdout
    ps = gputrace("ps", "--json")
    rows = {r["pid"]: r for r in orjson.loads(ps.stdout)["processes"]}
    assert rows[p.pid]["state"] == "serving" and rows[p.pid]["device_bytes"] == st["totals"]["device_bytes"]
    assert rows[p.pid]["suspended"] is False and rows[p.pid]["detail"] is None
    assert str(p.pid) in gputrace("ps").stdout
    p.stdin.write("\n" * 4)
    p.stdin.flush()
    assert p.wait(timeout=60) == 0


def test_ps_lists_a_shim_that_does_not_answer_as_unreachable_beside_one_that_does(procs, shim_dir):
    jobs = []
    for _ in range(2):
        j = subprocess.Popen([sys.executable, "-m", "gputrace", "run", "--", *simcuda.workload("alloc_free"),
                              "--steps", "1", "--hold"], env=simcuda.env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(j)
        assert json.loads(j.stdout.readline())["hold"] == 1
        jobs.append(j)
    os.kill(jobs[0].pid, signal.SIGSTOP)  # its shim's thread stops with it
    try:
        r = gputrace("ps", "--json")
        assert r.returncode == 0, r.stderr
        doc = orjson.loads(r.stdout)
        rows = {row["pid"]: row for row in doc["processes"]}
        assert doc["schema"] == 2
        stuck, fine = rows[jobs[0].pid], rows[jobs[1].pid]
        assert stuck["state"] == "unreachable" and stuck["detail"] and stuck["device_bytes"] is None
        assert fine["state"] == "serving" and fine["suspended"] is False and fine["device_bytes"] > 0
        text = gputrace("ps").stdout
        assert stuck["detail"] in text and "serving" in text
    finally:
        os.kill(jobs[0].pid, signal.SIGCONT)
    for j in jobs:
        j.stdin.write("\n" * 4)
        j.stdin.flush()
        assert j.wait(timeout=60) == 0


def test_cli_errors(procs, capsys):
    assert cli_main(["shim", "status", "-p", "99999999"]) == 3
    err = capsys.readouterr().err
    assert "error: no process with pid 99999999" in err and "hint:" in err
    plain = subprocess.Popen(["sleep", "60"])
    procs.append(plain)
    assert cli_main(["shim", "status", "-p", str(plain.pid)]) == 8
    err = capsys.readouterr().err
    assert "does not have the gputrace shim loaded" in err and "gputrace run --checkpointable" in err
    assert cli_main(["run"]) == 2
    assert "no command to run" in capsys.readouterr().err
    assert cli_main(["run", "--checkpointable", "--", "no-such-command-xyz"]) == 2
    assert "command not found" in capsys.readouterr().err


def test_cli_shim_not_serving_yet(procs, shim_dir, capsys):
    # Loaded but before its first driver call: the shim has no socket yet, and says so.
    p = start(procs, simcuda.workload("launch_bound") + ["--wait-stdin", "--steps", "1"])
    while client.has_shim(p.pid) is not True:  # the loader maps the shim before main runs
        assert p.poll() is None, p.stderr.read()
    assert cli_main(["shim", "status", "-p", str(p.pid)]) == 8
    assert "not serving yet" in capsys.readouterr().err
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0
