"""checkpointer/hold.py: every thread of a process held in a tracing stop but one, and all let go
after, whether the process was stopped (as CRIU leaves a restored job) or running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from gputrace.checkpointer import hold

JOB = """
import os, sys, threading, time
def spin():
    while True:
        time.sleep(0.001)
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
while len(os.listdir("/proc/self/task")) < 4:
    time.sleep(0.01)
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("stopped", [True, False], ids=["stopped", "running"])
def test_every_thread_but_one_is_held_then_all_are_let_go(stopped):
    p = subprocess.Popen([sys.executable, "-c", JOB], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        if stopped:
            os.kill(p.pid, signal.SIGSTOP)
            os.waitpid(p.pid, os.WUNTRACED)  # the stop is in effect
        tids = hold.threads(p.pid)
        keep = tids[1]
        with hold.held(p.pid, keep) as held:
            assert sorted(held) == [t for t in tids if t != keep]
            states = {t: hold.thread_state(p.pid, t) for t in tids}
            assert all(states[t] == "t" for t in held), states
            assert states[keep] not in ("t", "T"), states  # the one left runs (stopped: continued)
        states = {t: hold.thread_state(p.pid, t) for t in tids}
        assert not any(s in ("t", "T") for s in states.values()), states
        p.stdin.close()
        assert p.wait(timeout=30) == 0  # it runs on to its end
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_with_no_thread_named_nothing_is_held_and_a_stopped_process_runs_on():
    p = subprocess.Popen([sys.executable, "-c", JOB], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        os.kill(p.pid, signal.SIGSTOP)
        os.waitpid(p.pid, os.WUNTRACED)
        with hold.held(p.pid, None) as held:
            assert held == []
        assert not any(hold.thread_state(p.pid, t) in ("t", "T") for t in hold.threads(p.pid))
        p.stdin.close()
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
