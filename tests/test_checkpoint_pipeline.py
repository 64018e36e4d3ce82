"""The write after a checkpoint's freeze as one pipeline (issue 42 part 3), held by its structure, never
by its speed (bench/incremental_costs_gpu.py measures that): the chunks the shim copied into its pinned
pool reach the image a batch at a time (`dump stream=1`, then `writeback`), and the batches before
each are hashed while it is written, as both sides' CLOCK_MONOTONIC times in the report show; the
data stored are the serial way's byte for byte and restore right; the pool stays the streamed dump's
until it is written out, whichever command comes next, and a client that goes away drops it."""

from __future__ import annotations

import os
import subprocess
import sys

import orjson

from gputrace.checkpointer import checkpoint, ops, read_manifest, restore
from gputrace.shim import client

from ckpttest import target  # noqa: F401  (fixtures)
from shimtest import procs, shim_dir  # noqa: F401  (fixtures)

DC = 64 << 10
SIZE = 4 << 20  # the pattern job holds about 2.1 x this
CHANGED = 3 << 20
PIECE = 64 << 10  # the copy's pieces (chunk=): the smallest, so that a batch holds several


def test_pool_chunks_are_hashed_while_later_ones_are_written_and_restore_right(target, tmp_path, monkeypatch):
    monkeypatch.setattr(ops, "WRITEBACK_BATCH", 256 << 10)
    t = target(SIZE)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    want = t.cmd(f"touch 0 0 {CHANGED} 31")["sum"]
    r = checkpoint(t.pid, tmp_path / "b", since=tmp_path / "a", chunk=PIECE)
    assert r.plan == "pool" and r.pipelined and r.bytes_copied == CHANGED
    # Every changed chunk went through the pool and was written out after the reply, in batches.
    assert r.streamed_bytes == CHANGED and r.writeback_batches >= CHANGED // (256 << 10) - 1
    assert r.writeback_ns > 0
    # Hashing of earlier batches began before the shim had written the last one: the overlap.
    assert 0 < r.hashed_during_writeback_bytes < r.stored_bytes
    assert r.write_ns <= r.durable_ns <= r.total_ns
    t.cmd(f"touch 0 0 {CHANGED} 32")
    restore(t.pid, tmp_path / "b")
    assert t.sum() == want


def test_the_serial_way_stores_the_same_bytes(target, tmp_path, monkeypatch):
    t = target(SIZE)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    t.cmd(f"touch 1 {DC} {CHANGED // 2} 41")
    p = checkpoint(t.pid, tmp_path / "p", since=tmp_path / "a", chunk=PIECE)
    monkeypatch.setenv("GPUTRACE_CKPT_PIPELINE", "0")
    s = checkpoint(t.pid, tmp_path / "s", since=tmp_path / "a", chunk=PIECE)
    assert p.pipelined and p.streamed_bytes > 0
    assert not s.pipelined and s.streamed_bytes == 0 and s.writeback_batches == 0 and s.writeback_ns > 0
    assert s.hashed_during_writeback_bytes == 0
    assert (tmp_path / "p" / "data.img").read_bytes() == (tmp_path / "s" / "data.img").read_bytes()
    mp, ms = read_manifest(tmp_path / "p"), read_manifest(tmp_path / "s")
    assert mp["data"]["chunks"] == ms["data"]["chunks"] and mp["data"]["pieces"] == ms["data"]["pieces"]


def _image(c: client.Connection, words: str) -> tuple[dict, int]:
    fd = os.memfd_create("test-image")
    return c.request(words, fd=fd), fd


def _read(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size, 0)


def test_the_pool_is_written_out_before_any_other_command_touches_it(target):
    t = target(SIZE)
    with client.Connection(t.pid) as a, client.Connection(t.pid) as b:
        serial, fs = _image(a, "dump direct=0 lanes=1 chunk=65536 digest=0")
        assert serial["ok"] and serial["deferred_bytes"] > 0 and serial["writeback_pending_bytes"] == 0
        r, fd = _image(a, "dump direct=0 lanes=1 chunk=65536 digest=0 stream=1")
        assert r["ok"] and r["writeback_pending_bytes"] == r["deferred_bytes"] > 0 and r["writeback_ns"] == 0
        assert r["written_to"] < r["image_bytes"]
        w = a.request("writeback bytes=65536")  # one piece
        assert w["ok"] and not w["done"] and w["written_bytes"] == 65536 and w["batch_end_ns"] >= w["batch_start_ns"]
        assert b.request("release")["ok"]  # frees the pool: what was left is written first
        w = a.request("writeback")
        assert w["ok"] and w["done"] and w["pending_bytes"] == 0 and w["written_to"] == r["image_bytes"]
        assert _read(fd) == _read(fs)
        os.close(fd)
        os.close(fs)
    # A client that goes away before asking drops what it left: nothing more is written, and the next
    # checkpoint is whole and right.
    c = client.Connection(t.pid)
    r, fd = _image(c, "dump direct=0 lanes=1 chunk=65536 digest=0 stream=1")
    assert r["ok"] and r["writeback_pending_bytes"] > 0
    c.close()
    os.close(fd)
    with client.Connection(t.pid) as b:
        assert b.request("status")["paused"] is False
        assert b.request("writeback")["error"] == "writing the image failed"
        assert b.request("writeback bytes=x")["error"].startswith("usage: writeback")


def test_the_cli_reports_the_pipeline_and_when_it_was_durable(target, tmp_path):
    t = target(SIZE)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    t.cmd(f"touch 0 0 {CHANGED} 51")
    out = subprocess.run([sys.executable, "-m", "gputrace", "checkpoint", "-p", str(t.pid), "-o", str(tmp_path / "b"),
                          "--since", str(tmp_path / "a"), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rep = orjson.loads(out.stdout)
    assert rep["pipelined"] is True and rep["streamed_bytes"] == CHANGED and rep["writeback_batches"] >= 1
    assert rep["durable_ns"] >= rep["write_ns"] > 0
    t.cmd(f"touch 0 0 {CHANGED} 52")
    out = subprocess.run([sys.executable, "-m", "gputrace", "checkpoint", "-p", str(t.pid), "-o", str(tmp_path / "c"),
                          "--since", str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "two threads" in out.stdout and "pool " in out.stdout and "durable " in out.stdout
