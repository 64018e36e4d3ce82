"""Checkpoints that copy only what changed: digests of device memory computed on the device (simcuda
runs the shim's kernel by its C definition), held against checkpointer/digest.py's; chains of
incremental checkpoints restored byte for byte, a damaged earlier link refusing the later ones, and
rollback restores that copy back only the chunks that differ, counted in their reports."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

from gputrace.base.errors import CheckpointMismatch, CorruptCheckpoint
from gputrace.checkpointer import checkpoint, read_manifest, restore
from gputrace.checkpointer import chain, digest, image

from ckpttest import target  # noqa: F401  (fixtures)
from shimtest import procs, shim_dir  # noqa: F401  (fixtures)

DC = 64 << 10  # the smallest digest chunk the shim takes: several chunks in each test allocation
SIZE = 1 << 20


def head(path: Path) -> image.Header:
    return chain.head(chain.Link(path, read_manifest(path)))


def chunk_of(t, alloc: int, offset: int) -> int:
    """The index, among all the image's digests, of the chunk holding `offset` of allocation `alloc`
    (in the order the workload lists them)."""
    base = t.ready["allocations"][alloc]["base"]
    k = 0
    for a in sorted(t.ready["allocations"], key=lambda a: a["base"]):
        if a["base"] == base:
            return k + offset // DC
        k += -(-a["size"] // DC)
    raise AssertionError(f"no allocation {alloc}")


def test_the_devices_digests_are_the_definitions(target, tmp_path):
    t = target(SIZE)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    h = head(tmp_path / "a")
    assert h.digest_chunk == DC and not h.partial
    data = (tmp_path / "a" / "data.img").read_bytes()
    want = b""
    for e in h.entries:
        for a, b in digest.digests(data[e.offset:e.offset + e.size], DC):
            want += a.to_bytes(8, "little") + b.to_bytes(8, "little")
    assert h.digest_count == len(want) // 16 > len(h.entries)
    assert h.digests == want
    m = read_manifest(tmp_path / "a")
    assert m["digests"] == {"algorithm": digest.ALGO, "chunk_bytes": DC, "chunks": h.digest_count,
                            "chunks_copied": h.digest_count}


def test_a_chain_of_incremental_checkpoints_restores_each_link_byte_for_byte(target, tmp_path):
    t = target(SIZE)
    ra = checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    sum_a = t.sum()
    assert ra.parent is None and ra.chunks_copied == ra.chunks > 0 and ra.bytes_copied == ra.bytes
    # One byte in one chunk of the first allocation, and 100 KiB across two chunks of the second.
    t.cmd(f"touch 0 {3 * DC + 5} 1 11")
    sum_b = t.cmd(f"touch 1 {DC - 50_000} 100000 12")["sum"]
    rb = checkpoint(t.pid, tmp_path / "b", since=tmp_path / "a")
    assert rb.parent == str(tmp_path / "a")
    assert rb.chunks == ra.chunks and rb.chunks_copied == 3
    assert rb.bytes_copied == 3 * DC and rb.bytes == ra.bytes
    hb = head(tmp_path / "b")
    assert hb.partial and sum(hb.held) == 3
    assert {i for i, x in enumerate(hb.held) if x} == {chunk_of(t, 0, 3 * DC), chunk_of(t, 1, 0), chunk_of(t, 1, DC)}
    mb = read_manifest(tmp_path / "b")
    assert mb["schema"] == 2 and mb["data"]["bytes"] == hb.data_offset + 3 * DC
    assert os.path.getsize(tmp_path / "b" / "data.img") < os.path.getsize(tmp_path / "a" / "data.img") / 4
    # A third link, since the second; then everything overwritten.
    sum_c = t.cmd(f"touch 0 0 {2 * DC} 13")["sum"]
    rc = checkpoint(t.pid, tmp_path / "c", since=tmp_path / "b")
    assert rc.chunks_copied == 2
    assert t.cmd("fill 99")["sum"] not in (sum_a, sum_b, sum_c)
    for name, want, links in (("c", sum_c, 3), ("b", sum_b, 2), ("a", sum_a, 1), ("c", sum_c, 3)):
        rr = restore(t.pid, tmp_path / name)
        assert t.sum() == want, name
        assert rr.links == links and rr.chunks == ra.chunks
    assert t.gate_open()


def test_a_rollback_restore_copies_back_only_the_chunks_that_differ(target, tmp_path):
    t = target(SIZE)
    ra = checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    saved = t.sum()
    assert t.cmd(f"touch 0 {5 * DC} {DC + 1} 21")["sum"] != saved  # chunks 5 and 6 (one byte of 6)
    rr = restore(t.pid, tmp_path / "a")
    assert t.sum() == saved
    assert rr.chunks == ra.chunks and rr.chunks_copied == 2 and rr.bytes_copied == 2 * DC
    assert rr.digest_ns > 0 and rr.digest_why is None
    again = restore(t.pid, tmp_path / "a")  # nothing differs now
    assert again.chunks_copied == 0 and again.bytes_copied == 0 and t.sum() == saved
    t.cmd("fill 5")
    whole = restore(t.pid, tmp_path / "a", diff=False)
    assert whole.chunks == 0 and whole.bytes_copied == whole.bytes == ra.bytes and t.sum() == saved


BUSY = {"ok": False, "error": "busy", "detail": "the process allocated device memory meanwhile; try again"}


@pytest.mark.parametrize("refusals", [1, 2, 3])
def test_a_digest_prepass_overtaken_by_the_jobs_allocations_is_asked_again(target, tmp_path, monkeypatch, refusals):
    """The `digest` command a restore takes before reading the chain is refused busy, as a dump is, when
    the job allocated between its preparation and its gate (tests/test_shim_dump.py makes that race
    for the shim itself): nothing run, the gate open again.  The restore asks again, up to BUSY_TRIES
    times, and still reads only the chunks that differ; refused every time, it reads everything."""
    from gputrace.checkpointer import ops

    t = target(SIZE)
    ra = checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    saved = t.sum()
    t.cmd(f"touch 0 {5 * DC} 10 61")
    sent: list[str] = []
    real = ops.ShimSession.request

    def request(self, words, **kw):
        if words.startswith("digest"):
            sent.append(words)
            if len(sent) <= refusals:
                return dict(BUSY)
        return real(self, words, **kw)

    monkeypatch.setattr(ops.ShimSession, "request", request)
    rr = restore(t.pid, tmp_path / "a")
    assert t.sum() == saved and t.gate_open()
    assert rr.chunks == ra.chunks and rr.chunks_copied == 1
    if refusals < ops.BUSY_TRIES:
        assert len(sent) == refusals + 1
        assert rr.verified == "used" and rr.verify_why is None and rr.bytes_read < ra.bytes
    else:  # every byte read, and said why (the digests are not asked for again)
        assert len(sent) == ops.BUSY_TRIES and rr.verified == "all"
        assert rr.verify_why == "the shim could not take the live memory's digests"


def test_a_damaged_earlier_link_makes_the_later_ones_invalid_and_leaves_the_job_alone(target, tmp_path):
    t = target(SIZE)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    t.cmd("touch 0 0 10 31")
    checkpoint(t.pid, tmp_path / "b", since=tmp_path / "a")
    t.cmd("touch 0 70000 10 32")
    checkpoint(t.pid, tmp_path / "c", since=tmp_path / "b")
    now = t.cmd("fill 7")["sum"]
    data = tmp_path / "a" / "data.img"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint) as e:
        restore(t.pid, tmp_path / "c")
    assert f"{tmp_path / 'a' / 'data.img'}" in e.value.msg and "checksum" in e.value.msg
    assert t.sum() == now and t.gate_open()
    # An earlier link replaced by another checkpoint (of the same process, even) breaks the chain too.
    data.unlink()
    (tmp_path / "a" / "manifest.json").unlink()
    (tmp_path / "a").rmdir()
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    with pytest.raises(CorruptCheckpoint, match="is not the checkpoint .* was taken against"):
        restore(t.pid, tmp_path / "c")
    # And a missing one.
    os.rename(tmp_path / "b", tmp_path / "b-moved")
    with pytest.raises(CorruptCheckpoint, match="earlier link .* is gone"):
        restore(t.pid, tmp_path / "c")
    assert t.sum() == now and t.gate_open()


def test_a_chain_moved_together_still_restores(target, tmp_path):
    t = target(SIZE)
    (tmp_path / "x").mkdir()
    checkpoint(t.pid, tmp_path / "x" / "a", digest_chunk=DC)
    want = t.cmd("touch 2 0 100 41")["sum"]
    checkpoint(t.pid, tmp_path / "x" / "b", since=tmp_path / "x" / "a")
    os.rename(tmp_path / "x", tmp_path / "y")
    t.cmd("fill 3")
    restore(t.pid, tmp_path / "y" / "b")
    assert t.sum() == want


def test_memory_allocated_since_the_parent_is_copied_whole(target, tmp_path):
    t = target(SIZE)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    extra = t.cmd(f"alloc {3 * DC + 100}")
    want = t.sum()
    rb = checkpoint(t.pid, tmp_path / "b", since=tmp_path / "a")
    assert rb.chunks_copied == 4 and rb.allocations == len(t.ready["allocations"]) + 1
    assert any(e.base == extra["base"] for e in head(tmp_path / "b").entries)
    t.cmd("fill 8")
    restore(t.pid, tmp_path / "b")
    assert t.sum() == want


def test_without_digests_the_next_checkpoint_is_whole_and_says_why(target, tmp_path):
    t = target(SIZE)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=0)
    assert head(tmp_path / "a").digest_chunk == 0 and read_manifest(tmp_path / "a")["digests"] is None
    rb = checkpoint(t.pid, tmp_path / "b", since=tmp_path / "a")
    assert rb.parent is None and rb.bytes_copied == rb.bytes and "has no digests" in rb.digest_why
    assert read_manifest(tmp_path / "b")["schema"] == 1
    rr = restore(t.pid, tmp_path / "a")
    assert rr.chunks == 0 and rr.bytes_copied == rr.bytes and "no digests" in rr.digest_why


def test_since_must_name_a_checkpoint_of_the_same_process(target, tmp_path):
    t1, t2 = target(SIZE), target(SIZE)
    checkpoint(t1.pid, tmp_path / "a", digest_chunk=DC)
    with pytest.raises(CheckpointMismatch, match="not a checkpoint of process"):
        checkpoint(t2.pid, tmp_path / "b", since=tmp_path / "a")
    assert not (tmp_path / "b").exists() and t2.gate_open()


def test_a_links_manifest_that_lies_about_its_runs_is_refused(target, tmp_path):
    t = target(SIZE)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    t.cmd("touch 0 0 10 51")
    checkpoint(t.pid, tmp_path / "b", since=tmp_path / "a")
    mf = tmp_path / "b" / "manifest.json"
    m = orjson.loads(mf.read_bytes())
    m["data"]["runs"][-1][1] += 4096
    mf.write_bytes(orjson.dumps(m))
    with pytest.raises(CorruptCheckpoint, match="data.runs"):
        restore(t.pid, tmp_path / "b")


def test_incremental_checkpoints_from_the_cli(target, tmp_path):
    import subprocess
    import sys

    def gputrace(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=120)

    t = target(SIZE)
    pid = str(t.pid)
    r = gputrace("checkpoint", "-p", pid, "-o", str(tmp_path / "a"), "--incremental", "--digest-chunk", str(DC))
    assert r.returncode == 0, r.stderr
    assert "whole    no earlier checkpoint of this process there" in r.stdout and "digest " in r.stdout
    want = t.cmd(f"touch 0 {DC} 10 61")["sum"]
    r = gputrace("checkpoint", "-p", pid, "-o", str(tmp_path / "b"), "--incremental", "--json")
    assert r.returncode == 0, r.stderr
    rep = orjson.loads(r.stdout)
    assert rep["parent"] == str(tmp_path / "a") and rep["chunks_copied"] == 1 and rep["bytes_copied"] == DC
    assert rep["stored_bytes"] == os.path.getsize(tmp_path / "b" / "data.img")
    t.cmd("fill 2")
    r = gputrace("restore", "-p", pid, str(tmp_path / "b"), "--device-only")
    assert r.returncode == 0, r.stderr
    assert "(2 links of an incremental chain)" in r.stdout and f"of {rep['chunks']} chunks differed" in r.stdout
    assert t.sum() == want
    r = gputrace("restore", "-p", pid, str(tmp_path / "b"), "--device-only", "--json")  # nothing differs now
    assert r.returncode == 0 and orjson.loads(r.stdout)["bytes_copied"] == 0
    assert orjson.loads(r.stdout)["copy_gbps"] is None  # no rate measured: not 0
    r = gputrace("restore", "-p", pid, str(tmp_path / "b"), "--device-only")
    assert r.returncode == 0 and "nothing to copy" in r.stdout and "0.00 GB/s" not in r.stdout
    r = gputrace("restore", "-p", pid, str(tmp_path / "b"), "--device-only", "--copy-all", "--json")
    assert r.returncode == 0 and orjson.loads(r.stdout)["bytes_copied"] == rep["bytes"]
    r = gputrace("checkpoint", "-p", pid, "-o", str(tmp_path / "c"), "--digest-chunk", "4096")
    assert r.returncode == 2 and "below 65536" in r.stderr and not (tmp_path / "c").exists()
    r = gputrace("checkpoint", "-p", pid, "-o", str(tmp_path / "c"), "--since", str(tmp_path / "nope"))
    assert r.returncode != 0 and "not a checkpoint directory" in r.stderr and "Traceback" not in r.stderr


def test_where_the_digest_kernel_cannot_load_everything_is_copied_and_the_report_says_why(procs, shim_dir, tmp_path,
                                                                                          monkeypatch):
    """A driver too old to compile the shim's PTX (simcuda refuses it here): checkpoints are whole,
    restores copy every byte, and both say why; nothing else changes."""
    from ckpttest import Target

    monkeypatch.setenv("SIMCUDA_NO_PTX", "1")
    t = Target(procs, SIZE)
    ra = checkpoint(t.pid, tmp_path / "a")
    assert ra.chunks == 0 and ra.bytes_copied == ra.bytes and "loading the digest kernel" in ra.digest_why
    assert head(tmp_path / "a").digest_chunk == 0
    saved = t.sum()
    t.cmd("fill 4")
    rr = restore(t.pid, tmp_path / "a")
    assert t.sum() == saved and rr.bytes_copied == rr.bytes and "no digests" in rr.digest_why
    rb = checkpoint(t.pid, tmp_path / "b", since=tmp_path / "a")
    assert rb.parent is None and "has no digests" in rb.digest_why and t.gate_open()


def test_the_shim_refuses_a_partial_image_and_a_base_it_cannot_read(target, tmp_path):
    """The shim's own checks, under the checkpointer's: a link's image handed to restore as it is
    stored (its chain not put together) is refused for a copy of everything and, where a chunk it
    does not hold differs, for a copy of what differs ("stale": nothing copied); a base that is not
    an image is refused; the job is untouched by all of them."""
    from gputrace.shim import client

    t = target(SIZE)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    t.cmd("touch 0 0 10 71")
    checkpoint(t.pid, tmp_path / "b", since=tmp_path / "a")
    before = t.cmd(f"touch 1 {2 * DC} 10 72")["sum"]  # a chunk the link does not hold
    link = tmp_path / "b" / "data.img"
    full = tmp_path / "b-as-image"
    h = head(tmp_path / "b")
    with open(full, "wb") as f:  # the link's head at its place, padded to a whole image's size
        f.write(link.read_bytes()[:h.data_offset])
        f.truncate(h.image_bytes)
    conn = client.Connection(t.pid)
    try:
        with open(full, "rb") as f:
            r = conn.request("restore diff=0", fd=f.fileno())
        assert r["ok"] is False and r["error"] == "bad image" and "partial image" in r["detail"]
        with open(full, "rb") as f:
            r = conn.request("restore", fd=f.fileno())
        assert r["ok"] is False and r["error"] == "stale" and "1 chunks differ" in r["detail"]
        with open(tmp_path / "junk", "wb+") as f:
            f.write(b"not an image at all" * 10)
            f.flush()
            r = conn.request("dump base=1", fd=f.fileno())
        assert r["ok"] is False and r["error"] == "bad base image"
        r = conn.request(f"dump base=1 {tmp_path / 'x.img'}")
        assert r["ok"] is False and "base=1 needs" in r["error"]
    finally:
        conn.close()
    assert t.sum() == before and t.gate_open()
