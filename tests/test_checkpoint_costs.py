"""What a checkpoint costs beyond its freeze, held by counts: the shim keeps what it pins and loads for
a job's checkpoints (its pinned pool, the digest kernel) and makes none of it again for the next one;
an incremental checkpoint neither reserves nor pins a whole image; a restore reads the manifests, the
links' heads and the chunks it copies, nothing else, unless asked to read every byte; a checkpoint
says when its data were durable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gputrace.base.errors import CorruptCheckpoint
from gputrace.checkpointer import chain, checkpoint, read_manifest, restore, store
from gputrace.shim import client

from ckpttest import Target, target  # noqa: F401  (fixtures)
from shimtest import procs, shim_dir  # noqa: F401  (fixtures)

DC = 64 << 10
SIZE = 1 << 20


def kept(pid: int) -> dict:
    return client.status(pid)["kept"]


def heads(*paths: Path) -> int:
    """The bytes of the links' heads a selective restore reads."""
    return sum(read_manifest(p)["data"]["pieces"]["head_bytes"] for p in paths)


def test_a_second_checkpoint_makes_nothing_again_and_release_gives_it_back(target, tmp_path):
    t = target(SIZE)
    assert kept(t.pid)["pinned_bytes"] == 0 and kept(t.pid)["digester_loads"] == 0
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    first = kept(t.pid)
    assert first["digester"] and first["digester_loads"] == 1 and first["pool_allocs"] == 1
    assert first["pinned_bytes"] > 0 and first["pinned_bytes"] <= first["pin_cap"]
    prev = tmp_path / "a"
    for i, name in enumerate(("b", "c", "d")):
        want = t.cmd(f"touch {i % 3} {i * DC} 100 {80 + i}")["sum"]
        r = checkpoint(t.pid, tmp_path / name, since=prev)
        assert r.parent == str(prev) and r.chunks_copied == 1
        assert not r.direct  # the image was not pinned: the chunk went through the kept pool
        assert (r.plan, r.attempts, r.staging_copied_bytes) == ("pool", 1, 0)  # one freeze, no staging
        assert r.kept_pinned_bytes == first["pinned_bytes"]
        prev = tmp_path / name
    now = kept(t.pid)
    assert (now["digester_loads"], now["pool_allocs"]) == (1, 1), now  # made once, for the job
    assert now["reused"] >= 3
    t.cmd("fill 4")
    restore(t.pid, tmp_path / "d")  # a restore uses what is kept too
    assert t.sum() == want
    assert (kept(t.pid)["digester_loads"], kept(t.pid)["pool_allocs"]) == (1, 1)
    conn = client.Connection(t.pid)
    try:
        r = conn.request("release")
    finally:
        conn.close()
    assert r["ok"] and r["released_pinned_bytes"] == first["pinned_bytes"] and r["released_digester"]
    assert kept(t.pid)["pinned_bytes"] == 0 and not kept(t.pid)["digester"]
    checkpoint(t.pid, tmp_path / "e", since=tmp_path / "d")  # made again, once
    assert (kept(t.pid)["digester_loads"], kept(t.pid)["pool_allocs"]) == (2, 2)
    assert t.gate_open()


ONE_LANE = dict(lanes=1, chunk=1 << 20)  # the lanes' staging: two 1-MiB buffers


def test_what_the_pool_cannot_hold_under_its_cap_goes_into_the_pinned_image_never_through_staging(
        procs, shim_dir, tmp_path, monkeypatch):
    """Changes larger than the pool can ever hold (its cap) are copied as a whole checkpoint's are, into
    the image mapped and pinned before the freeze: the first time after a freeze that found them and
    copied nothing (its gate reopened at once), the next time planned so before the freeze."""
    cap = 4 << 20  # the two staging buffers, and 2 MiB for chunks deferred past the freeze
    monkeypatch.setenv("GPUTRACE_SHIM_PIN_CAP", str(cap))
    t = Target(procs, 4 << 20)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC, **ONE_LANE)
    want = t.cmd(f"touch 0 0 {3 << 20} 91")["sum"]  # 3 MiB changed: more than the pool defers
    r = checkpoint(t.pid, tmp_path / "b", since=tmp_path / "a", **ONE_LANE)
    assert r.bytes_copied == 3 << 20 and r.chunks_copied == (3 << 20) // DC
    assert r.plan == "image" and r.direct and r.staging_copied_bytes == 0
    assert r.attempts == 2 and r.aborted_freeze_ns > 0
    k = kept(t.pid)
    assert k["pin_cap"] == cap and k["pinned_bytes"] <= cap and k["pool_allocs"] == 1
    assert (k["staging_copied_bytes"], k["outgrown"], k["expect_bytes"]) == (0, 1, 3 << 20)
    assert t.gate_open()
    # The same again: planned before the freeze, which happens once.
    want = t.cmd(f"touch 0 0 {3 << 20} 92")["sum"]
    r = checkpoint(t.pid, tmp_path / "c", since=tmp_path / "a", **ONE_LANE)
    assert (r.plan, r.attempts, r.aborted_freeze_ns, r.staging_copied_bytes) == ("image", 1, 0, 0)
    assert r.bytes_copied == 3 << 20 and kept(t.pid)["outgrown"] == 1
    # Small changes after them: planned for the smaller of the last two (the image still, once), then the
    # pool again, and nothing made anew.
    for name, plan in (("d", "image"), ("e", "pool")):
        t.cmd(f"touch 1 0 {DC} 93")
        r = checkpoint(t.pid, tmp_path / name, since=tmp_path / "c", **ONE_LANE)
        assert (r.plan, r.attempts, r.staging_copied_bytes, r.chunks_copied) == (plan, 1, 0, 1)
    # A restore of more than the pool holds: read into the image, pinned before its freeze, too.
    t.cmd("fill 6")
    rr = restore(t.pid, tmp_path / "c", **ONE_LANE)
    assert t.sum() == want
    assert rr.plan == "image" and rr.direct and rr.staging_copied_bytes == 0 and rr.bytes_copied == rr.bytes
    k = kept(t.pid)
    assert k["pinned_bytes"] <= cap and k["pool_allocs"] == 1 and k["staging_copied_bytes"] == 0


def test_direct_0_never_pins_the_image_and_stages_what_the_capped_pool_cannot_hold(procs, shim_dir, tmp_path,
                                                                                   monkeypatch):
    """direct=0 asks for no pinned image: a change past the pool's cap then goes through staging under
    the gate, in one freeze (reopening it could do no better), and the counters say so."""
    monkeypatch.setenv("GPUTRACE_SHIM_PIN_CAP", str(4 << 20))
    t = Target(procs, 4 << 20)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC, **ONE_LANE)
    want = t.cmd(f"touch 0 0 {3 << 20} 97")["sum"]
    r = checkpoint(t.pid, tmp_path / "b", since=tmp_path / "a", direct=False, **ONE_LANE)
    assert (r.plan, r.attempts, r.direct) == ("pool and staging", 1, False)
    assert r.staging_copied_bytes == (3 << 20) - (2 << 20) and r.bytes_copied == 3 << 20
    assert kept(t.pid)["staging_copied_bytes"] == 1 << 20 and kept(t.pid)["outgrown"] == 0
    t.cmd("fill 7")
    restore(t.pid, tmp_path / "b", **ONE_LANE)
    assert t.sum() == want


def test_a_change_the_pool_can_hold_once_grown_grows_it_before_the_freeze(procs, shim_dir, tmp_path, monkeypatch):
    """The pool first holds 32 MiB of chunks; 40 MiB changed finds it too small under the gate, which
    reopens without a copy; the pool grows (within its cap, pinning less than the image would) and the
    dump freezes again, copying into it; the next such dump is planned for it before its one freeze."""
    monkeypatch.setenv("GPUTRACE_SHIM_PIN_CAP", str(64 << 20))
    size = 40 << 20
    t = Target(procs, size)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=1 << 20, **ONE_LANE)
    first = kept(t.pid)
    assert first["pinned_bytes"] == (2 << 20) + (32 << 20)
    t.cmd(f"touch 0 0 {size} 94")
    r = checkpoint(t.pid, tmp_path / "b", since=tmp_path / "a", **ONE_LANE)
    assert r.bytes_copied == size and r.plan == "pool" and not r.direct
    assert r.attempts == 2 and r.staging_copied_bytes == 0
    k = kept(t.pid)
    assert k["pool_allocs"] == 2 and size < k["pinned_bytes"] - k["staging_bytes"] and k["pinned_bytes"] <= 64 << 20
    assert r.kept_pinned_bytes == k["pinned_bytes"]
    want = t.cmd(f"touch 0 0 {size} 95")["sum"]
    r = checkpoint(t.pid, tmp_path / "c", since=tmp_path / "a", **ONE_LANE)
    assert (r.plan, r.attempts, r.staging_copied_bytes, r.bytes_copied) == ("pool", 1, 0, size)
    assert kept(t.pid)["pool_allocs"] == 2 and kept(t.pid)["outgrown"] == 1
    t.cmd(f"touch 0 0 {size} 96")
    rr = restore(t.pid, tmp_path / "c", **ONE_LANE)  # its 40 MiB read into the grown pool before the freeze
    assert t.sum() == want
    assert (rr.plan, rr.staging_copied_bytes, rr.bytes_copied) == ("pool", 0, size)
    assert kept(t.pid)["pool_allocs"] == 2 and kept(t.pid)["staging_copied_bytes"] == 0 and t.gate_open()


def test_a_restore_reads_the_heads_and_the_chunks_it_copies_and_nothing_else(target, tmp_path):
    t = target(SIZE)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    t.cmd(f"touch 0 {2 * DC} 10 61")
    checkpoint(t.pid, tmp_path / "b", since=tmp_path / "a")
    want = t.cmd(f"touch 1 {DC} 10 62")["sum"]
    rc = checkpoint(t.pid, tmp_path / "c", since=tmp_path / "b")
    assert rc.chunks_copied == 1
    # Two chunks differ from c: one that only a (the chain's whole link) holds, one that c holds.
    t.cmd("touch 2 0 10 63")
    t.cmd(f"touch 1 {DC} 10 64")
    before = store.READS.bytes
    rr = restore(t.pid, tmp_path / "c")
    assert t.sum() == want
    assert rr.verified == "used" and rr.links == 3 and rr.chunks_copied == 2 and rr.bytes_copied == 2 * DC
    assert rr.bytes_read == store.READS.bytes - before == heads(*(tmp_path / n for n in "abc")) + 2 * DC
    assert rr.prepass_ns > 0
    # Nothing differs now: the heads alone are read.
    again = restore(t.pid, tmp_path / "c")
    assert again.chunks_copied == 0 and again.bytes_read == heads(*(tmp_path / n for n in "abc"))
    # Every byte of every link, on request.
    t.cmd("touch 2 0 10 65")
    every = restore(t.pid, tmp_path / "c", verify_all=True)
    assert every.verified == "all" and t.sum() == want
    assert every.bytes_read >= sum(os.path.getsize(tmp_path / n / "data.img") for n in "abc")


def test_a_damaged_chunk_is_refused_where_it_is_read_and_found_by_verify_all_where_it_is_not(target, tmp_path):
    t = target(SIZE)
    checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    h = chain.head(chain.Link(tmp_path / "a", read_manifest(tmp_path / "a")))
    e = sorted(h.entries, key=lambda e: e.base)[1]
    with open(tmp_path / "a" / "data.img", "r+b") as f:  # one byte of chunk 3 of the second allocation
        f.seek(e.offset + 3 * DC + 7)
        b = f.read(1)
        f.seek(e.offset + 3 * DC + 7)
        f.write(bytes([b[0] ^ 0x20]))
    saved = t.sum()
    restore(t.pid, tmp_path / "a")  # nothing differs: the damaged chunk is neither needed nor read
    assert t.sum() == saved
    with pytest.raises(CorruptCheckpoint, match="fails its xxh3_64 checksum"):
        restore(t.pid, tmp_path / "a", verify_all=True)
    changed = t.cmd(f"touch 1 {3 * DC} 10 66")["sum"]
    with pytest.raises(CorruptCheckpoint, match=r"chunk 3 of the allocation at .* fails its xxh3_64 checksum") as ex:
        restore(t.pid, tmp_path / "a")
    assert "not touched" in ex.value.hint
    assert t.sum() == changed and t.gate_open()
    # A damaged head is refused before anything is read of the chunks.
    with open(tmp_path / "a" / "data.img", "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    with pytest.raises(CorruptCheckpoint, match="head of .* fails"):
        restore(t.pid, tmp_path / "a")
    assert t.sum() == changed


def test_a_checkpoint_says_when_it_was_durable(target, tmp_path):
    import subprocess
    import sys

    import orjson

    t = target(SIZE)
    r = checkpoint(t.pid, tmp_path / "a", digest_chunk=DC)
    assert 0 < r.write_ns <= r.durable_ns <= r.total_ns and 0 < r.fsync_ns < r.durable_ns
    t.cmd("touch 0 0 10 67")
    out = subprocess.run([sys.executable, "-m", "gputrace", "checkpoint", "-p", str(t.pid), "-o", str(tmp_path / "b"),
                          "--since", str(tmp_path / "a"), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rep = orjson.loads(out.stdout)
    assert rep["durable_ns"] >= rep["write_ns"] > 0 and rep["fsync_ns"] > 0 and rep["kept_pinned_bytes"] > 0
    out = subprocess.run([sys.executable, "-m", "gputrace", "checkpoint", "-p", str(t.pid), "-o", str(tmp_path / "c"),
                          "--since", str(tmp_path / "b")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "durable " in out.stdout and "fsync" in out.stdout, out.stderr
