"""The shim's quiesce gate and control socket under load: pause/resume in a tight loop while many
threads (some holding a lock of their own, as Python threads hold the GIL) submit work and create and
free state; a pause that cannot drain gives up instead of hanging; other users are refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gputrace import shim, simcuda
from gputrace.base.native import build
from gputrace.shim import client

from shimtest import procs, shim_dir  # noqa: F401  (fixtures)

HERE = Path(__file__).resolve().parent


def stress_exe() -> Path:
    inc = Path(simcuda.__file__).resolve().parent
    ddir = simcuda.driver_dir()
    return build("shim_stress", [HERE / "native" / "shim_stress.c"], cflags=[f"-I{inc}", "-pthread"],
                 ldflags=[f"-L{ddir}", "-lcuda", "-ldl", "-pthread"], headers=[inc / "cuda.h"])


CYCLES = 10000


def test_pause_resume_loop_against_many_submitting_threads(procs, shim_dir):
    p = subprocess.Popen([str(stress_exe()), "16"], env=shim.preload_env(simcuda.env()), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    stalled = 0
    with client.Connection(p.pid) as c:
        before = c.status()["calls"].get("cuLaunchKernel", 0)
        for i in range(CYCLES):
            r = c.pause(10000)
            assert r["ok"], r
            if i % 100 == 0:
                a = c.status()
                b = c.status()
                assert a["paused"] and a["in_flight"] == 0, a
                assert a["calls"] == b["calls"]  # nothing passes a closed gate
                stalled += a["waiting"] > 0
            assert c.resume()["ok"]
        after = c.status()
        assert not after["paused"] and after["calls"]["cuLaunchKernel"] > before  # the threads ran meanwhile
        if not stalled:
            # The samples above caught no thread at the gate (a loaded machine may not have scheduled one
            # in time): hold the gate closed until one arrives, as it must while 16 threads submit.
            assert c.pause(10000)["ok"]
            deadline = time.monotonic() + 60
            while not stalled and time.monotonic() < deadline:
                stalled += c.status()["waiting"] > 0
            assert c.resume()["ok"]
    assert stalled > 0  # threads really were stopped at the gate while paused
    p.stdin.write("stop\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=120)
    res = json.loads(out)
    assert p.returncode == 0 and res["ok"], (res, err)
    assert res["launches"] == res["shim_launches"] > 0  # no call lost or doubled
    assert res["allocs"] == res["shim_allocs"]


def test_a_pause_that_cannot_drain_gives_up_and_reopens(procs, shim_dir):
    # One launch a step (scale 0.03 of 35), each busy for 30 s on the caller's CPU: a call in flight
    # that a 50 ms pause cannot wait out.
    p = subprocess.Popen(simcuda.workload("launch_bound") + ["--scale", "0.03", "--launch-ns", "30000000000"],
                         env=shim.preload_env(simcuda.env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs.append(p)
    while not client.socket_path(p.pid):
        assert p.poll() is None
    with client.Connection(p.pid) as c:
        while c.status()["in_flight"] == 0:
            assert p.poll() is None
        r = c.pause(50)
        assert r["ok"] is False and r["error"] == "busy" and r["in_flight"] == 1
        st = c.status()
        assert st["paused"] is False and st["waiting"] == 0
        assert c.resume() == {"ok": False, "error": "not paused"}


def test_pause_ends_when_its_connection_closes(procs, shim_dir):
    p = subprocess.Popen([str(stress_exe()), "4"], env=shim.preload_env(simcuda.env()), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout.readline().strip() == "ready"
    c = client.Connection(p.pid)
    assert c.pause()["ok"]
    with client.Connection(p.pid) as other:
        assert other.status()["paused"] is True
        assert other.pause() == {"ok": False, "error": "already paused"}
        c.close()  # e.g. the checkpointer crashed
        while other.status()["paused"]:
            pass
    p.stdin.write("stop\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and json.loads(out)["ok"], err


NOBODY = 65534
PEER = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("connect", e.errno); sys.exit(0)
try:
    s.sendall(b"status\n")
except BrokenPipeError:
    pass  # refused: the reply was sent on accept and the connection closed
print("reply", s.makefile().readline().strip())
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
@pytest.mark.parametrize("caps", [False, True], ids=["plain", "with-dac-override"])
def test_another_user_is_refused(procs, shim_dir, caps):
    p = subprocess.Popen(simcuda.workload("launch_bound") + ["--hold", "--steps", "1"],
                         env=shim.preload_env(simcuda.env()), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    procs.append(p)
    assert json.loads(p.stdout.readline())["hold"] == 1
    path = client.socket_path(p.pid)
    assert path and oct(path.stat().st_mode & 0o777) == "0o600" and oct(shim_dir.stat().st_mode & 0o777) == "0o700"
    py = next((c for c in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(c)), None)
    if not py:
        pytest.skip("no system python3 that another user can run")
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    if caps:  # gets past the directory's permissions: the shim's own peer-credential check must refuse it
        cmd += ["--inh-caps=+dac_override", "--ambient-caps=+dac_override"]
    r = subprocess.run(cmd + [py, "-c", PEER, str(path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    if caps:
        kind, body = r.stdout.split(" ", 1)
        assert kind == "reply" and json.loads(body) == {
            "ok": False, "error": f"permission denied: only uid {os.geteuid()} or root may control this process"}
    else:
        assert r.stdout.split() == ["connect", "13"]  # EACCES on the 0700 directory
    assert client.status(p.pid)["pid"] == p.pid  # the owner still gets in
    p.stdin.write("\n\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0
