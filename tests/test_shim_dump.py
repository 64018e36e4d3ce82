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
