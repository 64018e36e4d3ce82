"""The shim's `dump`, `restore` and `digest` commands spoken directly on its control socket: the gate
reopens whatever happens (a client that leaves mid-dump, a full image file, a bad image or command, a
pause held by another client, a job that allocates between a command's preparation and its gate)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from gputrace import simcuda
from gputrace.checkpointer import driverapi
from gputrace.shim import client

from ckpttest import small_fs, target  # noqa: F401  (fixtures)
from shimtest import ask, procs, shim_dir, start  # noqa: F401  (fixtures)


def test_the_shim_reports_a_full_image_file_and_reopens_the_gate(target, small_fs):
    t = target(4 << 20)
    with client.Connection(t.pid) as c:
        r = c.request(f"dump {small_fs / 'img'}")
    # The space is reserved before the gate closes, so a full filesystem never costs the job a freeze.
    assert r["ok"] is False and r["error"] == "cannot reserve space for the image", r
    assert r["detail"] == os.strerror(28)  # ENOSPC
    assert t.gate_open() and t.sum() == t.ready["sum"]


def test_a_client_gone_mid_dump_leaves_the_gate_open(target):
    t = target(4 << 20)
    c = client.Connection(t.pid)
    fd = os.memfd_create("img")
    socket.send_fds(c._sock, [b"dump chunk=65536\n"], [fd])
    c.close()
    os.close(fd)
    # The server finishes the dump (it is one thread) before it answers the next client.
    assert t.gate_open() and t.sum() == t.ready["sum"]


def test_a_bad_image_or_command_is_refused_without_closing_the_gate(target, tmp_path):
    t = target()
    junk = tmp_path / "junk"
    junk.write_bytes(b"x" * 8192)
    with client.Connection(t.pid) as c:
        assert c.request(f"restore {junk}")["error"] == "bad image"
        assert c.request("dump chunk=7")["error"].startswith("usage: dump")
        assert c.request("dump")["error"].startswith("no image")
        assert c.pause(5000)["ok"]
        # A pause held by another connection: a dump refuses rather than waiting.
        with client.Connection(t.pid) as other:
            fd = os.memfd_create("img")
            r = other.request("dump", fd=fd)
            os.close(fd)
        assert r["ok"] is False and r["error"] == "already paused"
        # The holder of the pause may dump under it; the pause stays its own.
        fd = os.memfd_create("img")
        r = c.request("dump", fd=fd)
        os.close(fd)
        assert r["ok"] and c.status()["paused"] is True
        assert c.resume()["ok"]
    assert t.sum() == t.ready["sum"]


def test_a_staged_dump_is_prepared_before_the_gate_closes_and_run_by_the_next_dump_under_it(target):
    """What a job's checkpoint does on each rank (checkpointer/gang.py): `dump stage=1` maps and pins
    the image and loads the digest kernel while the job runs; the same connection's next `dump`,
    under its pause, copies into it; anything else drops it, and the gate is never left closed."""
    t = target(2 << 20)
    with client.Connection(t.pid) as c:
        fd = os.memfd_create("img")
        r = c.request("dump lanes=2 direct=1 stage=1", fd=fd)
        assert r == {"ok": True, "staged": "dump", "direct": True, "digests": True, "setup_ns": r["setup_ns"]}
        assert t.gate_open()  # staging closes nothing
        assert c.pause(5000)["ok"]
        d = c.request("dump timeout=2000")  # no descriptor: the staged one
        assert d["ok"] and d["direct"] and d["lanes"] == 2 and d["digests"] and d["setup_ns"] == r["setup_ns"]
        assert d["staged"] is True
        assert os.fstat(fd).st_size == d["image_bytes"] and os.pread(fd, 16, 0) == b"GPUTRACE-IMG-2\n\0"
        assert c.status()["paused"] is True and c.resume()["ok"]
        # Staged, then something else: the staged dump is dropped, and a dump after it needs its own image.
        assert c.request("dump stage=1", fd=fd)["ok"]
        assert c.request("restore stage=1 diff=1", fd=fd)["ok"]  # replaces it
        assert c.pause(5000)["ok"]
        assert c.request("dump timeout=2000")["error"].startswith("no image")
        assert c.resume()["ok"]
        assert c.request("dump stage=1", fd=fd)["ok"]
        assert c.pause(5000)["ok"]
        assert "stage=1 is for" in c.request("dump stage=1", fd=fd)["error"]  # not under the gate
        assert c.resume()["ok"]
        os.close(fd)
    # A connection that closes with a command staged leaves nothing behind: the next client is served.
    with client.Connection(t.pid) as c:
        fd = os.memfd_create("img")
        assert c.request("dump stage=1", fd=fd)["ok"]
        os.close(fd)
    assert t.gate_open() and t.sum() == t.ready["sum"]


def _voluntary_switches(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


def _control_thread(pid: int) -> int:
    """The shim's control thread (control.c names it gputrace-shim)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            if f.read().strip() == "gputrace-shim":
                return int(tid)
    raise AssertionError("no gputrace-shim thread")


def _wait(what, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (v := what()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return v


@pytest.mark.parametrize("held", [0, 64 << 10], ids=["none-before", "more-than-planned"])
def test_digest_of_a_job_that_allocates_between_its_plan_and_its_freeze_is_refused_busy(procs, shim_dir, held):
    """The `digest` command prepares its digester while the job runs (shim/changed.c, digest_ready:
    none at all where the job holds no device memory yet), then closes the gate and takes the
    allocations again (digest_frozen).  A job that allocates in between once had the digester run
    with none (NULL: the job died of SIGSEGV); one that allocated more than the digester was made
    for got "cannot digest".  Either way it must get the reply a dump gets then (`busy`, "the process
    allocated device memory meanwhile; try again", which checkpointer/ops.py's overtaken() retries),
    with the gate open again and the job running on.

    Made deterministic from outside with simcuda's cuCheckpointProcessLock (every driver call of the
    job waits at its entry while it holds): the job's cuMemAlloc_v2 is sent while locked, so it is
    in flight inside the shim's gate when the command comes; the command's preparation finds nothing
    new (the allocation is not registered yet) and its pause then waits for that call.  That the
    pause is waiting (so the preparation is behind it) is seen in the control thread's voluntary
    context switches: it naps in a loop while calls are in flight.  Then the lock is released, the
    allocation completes and is registered, the pause drains, and the command finds it under the
    gate."""
    p = start(procs, simcuda.workload("pattern") + ["--empty"])
    ready = json.loads(p.stdout.readline())
    assert ready["allocations"] == []
    if held:
        ask(p, f"alloc {held}")
    # A first digest, while nothing waits: the digester for what the job holds (none where it holds
    # nothing) is made here and kept, so that the next one's preparation makes no driver call.
    fd = os.memfd_create("digests")
    with client.Connection(p.pid) as c:
        r = c.request(f"digest digest={64 << 10}", fd=fd)
    os.close(fd)
    assert r["ok"] and r["chunks"] == bool(held) and r["digester_loads"] == bool(held)
    drv = driverapi.Driver(p.pid)
    drv.call("Lock", 5000)
    p.stdin.write(f"alloc {64 << 20}\n")  # 1024 chunks of 64 KiB: more than the kept digester holds
    p.stdin.flush()
    _wait(lambda: client.status(p.pid)["in_flight"] == 1)
    ctl = _control_thread(p.pid)
    replies: list = []
    with client.Connection(p.pid) as c:
        fd = os.memfd_create("digests")
        before = _voluntary_switches(p.pid, ctl)
        t = threading.Thread(target=lambda: replies.append(
            c.request(f"digest digest={64 << 10} timeout=60000", fd=fd, timeout_s=90)))
        t.start()
        try:
            _wait(lambda: _voluntary_switches(p.pid, ctl) > before + 30)  # the pause waits for the call in flight
        finally:
            drv.call("Unlock")
            t.join(90)
        os.close(fd)
        assert p.poll() is None, f"the job died (status {p.returncode}) of the digest command"
        assert replies == [{"ok": False, "error": "busy",
                            "detail": "the process allocated device memory meanwhile; try again"}]
        assert c.status()["paused"] is False
        assert "base" in json.loads(p.stdout.readline())  # the allocation's own reply: the job ran on
        # Tried again, the command is prepared for what the job holds now.
        fd = os.memfd_create("digests")
        r = c.request(f"digest digest={64 << 10}", fd=fd)
        os.close(fd)
        assert r["ok"] and r["allocations"] == 1 + bool(held) and r["chunks"] == 1024 + bool(held)
    assert ask(p, "sum")["sum"]
