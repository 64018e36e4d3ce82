"""The driver backend (cuCheckpointProcess*) on simcuda, which implements that API: a job without the
shim is checkpointed (lock, checkpoint, restore, unlock) and suspended/resumed with its data intact;
the CLI's --backend driver, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from gputrace import simcuda
from gputrace.checkpointer import driver
from gputrace.base.errors import CheckpointError, NoLibcuda


@pytest.fixture
def job(spawned):
    p = subprocess.Popen(simcuda.workload("pattern") + ["--size", str(4 << 20)], env=simcuda.env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spawned.append(p)
    p.ready = json.loads(p.stdout.readline())
    return p


def ask(p, line: str) -> dict:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def test_driver_checkpoint_round_trips_a_job_without_the_shim(job):
    r = driver.checkpoint(job.pid)
    assert r.action == "checkpoint" and r.freeze_ns >= r.lock_ns + r.checkpoint_ns + r.restore_ns + r.unlock_ns > 0
    assert ask(job, "sum")["sum"] == job.ready["sum"]
    assert ask(job, "fill 3")["sum"] != job.ready["sum"]  # the job runs on after the unlock


def test_driver_suspend_holds_the_job_and_resume_lets_it_continue(job):
    free0 = ask(job, "meminfo")["free"]
    r = driver.suspend(job.pid)
    assert r.action == "suspend" and driver.Driver(job.pid).state() == "checkpointed"
    got: dict = {}
    th = threading.Thread(target=lambda: got.update(ask(job, "sum")))
    th.start()
    with pytest.raises(CheckpointError, match="is checkpointed, not running"):
        driver.suspend(job.pid)
    assert not got  # the job's driver call waits while it is suspended
    driver.resume(job.pid)
    th.join(60)
    assert got["sum"] == job.ready["sum"] and ask(job, "meminfo")["free"] == free0
    with pytest.raises(CheckpointError, match="is running, not suspended by the driver"):
        driver.resume(job.pid)


def test_driver_backend_errors(spawned):
    plain = subprocess.Popen(["sleep", "120"])
    spawned.append(plain)
    with pytest.raises(NoLibcuda, match="has no libcuda loaded"):
        driver.checkpoint(plain.pid)


def test_cli_backend_driver(job):
    run = lambda *a: subprocess.run([sys.executable, "-m", "gputrace", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=60)
    r = run("checkpoint", "--backend", "driver", "-p", str(job.pid), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["backend"] == "driver" and rep["action"] == "checkpoint" and rep["freeze_ns"] > 0
    r = run("checkpoint", "--backend", "driver", "-p", str(job.pid), "-o", "/tmp/x")
    assert r.returncode == 2 and "writes no directory" in r.stderr
    r = run("suspend", "--backend", "driver", "-p", str(job.pid))
    assert r.returncode == 0 and "freeze" in r.stdout, r.stderr
    r = run("resume", "--backend", "driver", "-p", str(job.pid))
    assert r.returncode == 0 and "restore" in r.stdout, r.stderr
    assert ask(job, "sum")["sum"] == job.ready["sum"]
