"""The shim's `dump` and `restore` commands spoken directly on its control socket: the gate reopens
whatever happens (a client that leaves mid-dump, a full image file, a bad image or command, a pause
held by another client)."""

from __future__ import annotations

import os
import socket

from gputrace.shim import client

from ckpttest import small_fs, target  # noqa: F401  (fixtures)
from shimtest import procs, shim_dir  # noqa: F401  (fixtures)


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
