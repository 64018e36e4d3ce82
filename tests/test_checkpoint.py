"""Checkpoint and restore of a shimmed simcuda process (the `pattern` workload, which fills device
memory of every saved kind from a seed and reports a checksum on command): device memory comes back
byte for byte, and every way it can go wrong gives a clear error, keeps no checkpoint that claims to
be valid, and never leaves the job gated or changed."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import orjson
import pytest

from gputrace import simcuda
from gputrace.checkpointer import checkpoint, read_manifest, restore
from gputrace.base.errors import (CheckpointBusy, CheckpointError, CheckpointMismatch, CorruptCheckpoint, DiskFull,
                             TargetLost)
from gputrace.shim import client

from ckpttest import Target, small_fs, target  # noqa: F401  (fixtures)
from shimtest import procs, shim_dir, start  # noqa: F401  (fixtures)


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".partial" in p.name]


def test_restore_returns_device_memory_to_the_checkpoint_byte_for_byte(target, tmp_path):
    t = target(6 << 20)
    saved = t.ready["sum"]
    rep = checkpoint(t.pid, tmp_path / "ck", lanes=3, chunk=1 << 20)
    assert rep.bytes == t.ready["bytes"] and rep.allocations == 5
    assert 0 < rep.freeze_ns and rep.copy_ns <= rep.freeze_ns
    assert t.gate_open()
    overwritten = t.cmd("fill 9")["sum"]
    assert overwritten != saved
    rr = restore(t.pid, tmp_path / "ck", lanes=2, chunk=256 << 10)
    assert rr.bytes == rep.bytes and rr.allocations == 5
    assert t.sum() == saved
    assert t.gate_open()
    # The workload carries on from the restored state: it can overwrite and restore again.
    assert t.cmd("fill 10")["sum"] != saved
    restore(t.pid, tmp_path / "ck")
    assert t.sum() == saved
    # The per-process lock file beside the socket goes with the process.
    lock = client.socket_path(t.pid).with_name(f"shim-{t.pid}.lock")
    assert lock.exists()
    t.p.stdin.write("quit\n")
    t.p.stdin.flush()
    assert t.p.wait(timeout=60) == 0 and not lock.exists()


def test_the_manifest_describes_what_the_process_held(target, tmp_path):
    t = target()
    checkpoint(t.pid, tmp_path / "ck")
    m = read_manifest(tmp_path / "ck")
    assert sorted(os.listdir(tmp_path / "ck")) == ["data.img", "manifest.json"] and leftovers(tmp_path) == []
    assert m["schema"] == 1 and m["complete"] is True and m["target"]["pid"] == t.pid
    got = [(a["base"], a["size"]) for a in m["allocations"]]
    assert got == sorted((a["base"], a["size"]) for a in t.ready["allocations"])
    assert {a["kind"] for a in m["allocations"]} == {"device", "pitch", "async", "vmm_map"}
    assert m["devices"][0]["name"] and m["driver"]["version"] > 0
    assert m["registry"]["contexts"] == 1 and m["registry"]["streams"] == 1
    d = m["data"]
    assert d["hash"] == "xxh3_64" and d["bytes"] == (tmp_path / "ck" / "data.img").stat().st_size
    assert len(d["chunks"]) == -(-d["bytes"] // d["chunk_bytes"])
    assert set(m["timings"]) >= {"drain_ns", "sync_ns", "copy_ns", "freeze_ns", "write_ns"}


def test_a_process_without_device_memory_checkpoints_and_restores(procs, shim_dir, tmp_path):
    p = start(procs, simcuda.workload("alloc_free") + ["--steps", "1", "--hold"])
    for want in (1, 2, 3, 4):  # hold point 4 comes after teardown: nothing held
        held = json.loads(p.stdout.readline())
        assert held["hold"] == want
        if want < 4:
            p.stdin.write("\n")
            p.stdin.flush()
    rep = checkpoint(p.pid, tmp_path / "ck")
    assert rep.allocations == 0 and rep.bytes == 0
    assert restore(p.pid, tmp_path / "ck").allocations == 0
    assert client.status(p.pid)["paused"] is False
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_corrupted_chunk_is_refused_before_the_process_is_touched(target, tmp_path):
    t = target(8 << 20)
    checkpoint(t.pid, tmp_path / "ck")
    now = t.cmd("fill 3")["sum"]
    m = read_manifest(tmp_path / "ck")
    assert len(m["data"]["chunks"]) >= 2
    _flip(tmp_path / "ck" / "data.img", m["data"]["chunk_bytes"] + 12345)
    with pytest.raises(CorruptCheckpoint, match=r"chunk 0 of the allocation at .* fails its xxh3_64 checksum") as e:
        restore(t.pid, tmp_path / "ck")  # the chunk read, as every chunk differs now
    assert "not touched" in e.value.hint
    assert t.sum() == now and t.gate_open()
    with pytest.raises(CorruptCheckpoint, match=r"chunk 1 of .* fails its xxh3_64 checksum") as e:
        restore(t.pid, tmp_path / "ck", verify_all=True)  # the file's chunk, read with all the others
    assert t.sum() == now and t.gate_open()


def test_a_truncated_data_file_is_refused(target, tmp_path):
    t = target()
    checkpoint(t.pid, tmp_path / "ck")
    now = t.cmd("fill 3")["sum"]
    data = tmp_path / "ck" / "data.img"
    os.truncate(data, data.stat().st_size - 4096)
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        restore(t.pid, tmp_path / "ck")
    assert t.sum() == now and t.gate_open()


def test_a_missing_or_damaged_manifest_is_refused(target, tmp_path):
    t = target()
    checkpoint(t.pid, tmp_path / "ck")
    now = t.cmd("fill 3")["sum"]
    (tmp_path / "ck" / "manifest.json").write_bytes(b'{"schema": 1, "format": "gputrace-checkpoint"')
    with pytest.raises(CorruptCheckpoint, match="not valid JSON"):
        restore(t.pid, tmp_path / "ck")
    (tmp_path / "ck" / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpoint, match="no manifest.json: it is not a complete checkpoint"):
        restore(t.pid, tmp_path / "ck")
    assert t.sum() == now and t.gate_open()


def test_a_checkpoint_of_another_process_is_refused_with_what_differs(target, tmp_path):
    a, b = target(1 << 20), target(2 << 20)
    checkpoint(a.pid, tmp_path / "ck")
    now = b.sum()
    # Another process's checkpoint is refused as such first (pid and start time), then, if asked for
    # anyway, by what it holds.
    with pytest.raises(CheckpointMismatch, match=rf"not a checkpoint of process {b.pid}: it was taken of process {a.pid}"):
        restore(b.pid, tmp_path / "ck")
    with pytest.raises(CheckpointMismatch, match=r"does not match what process \d+ holds: .*bytes") as e:
        restore(b.pid, tmp_path / "ck", other_process=True)
    assert "not touched" in e.value.hint
    assert b.sum() == now and b.gate_open()


def test_a_process_that_allocated_since_is_refused_by_the_shim_under_the_gate(target, tmp_path):
    t = target()
    checkpoint(t.pid, tmp_path / "ck")
    extra = t.cmd("alloc 8192")
    # What the library checks first, before asking the process:
    with pytest.raises(CheckpointMismatch, match=f"holds 8192 bytes at {extra['base']:#x} that the checkpoint lacks"):
        restore(t.pid, tmp_path / "ck")
    # And what the shim checks again under the closed gate, when handed the image directly:
    fd = os.open(tmp_path / "ck" / "data.img", os.O_RDONLY)
    try:
        with client.Connection(t.pid) as c:
            r = c.request("restore", fd=fd)
    finally:
        os.close(fd)
    assert r["ok"] is False and r["error"] == "mismatch" and r["difference_count"] == 1
    assert r["differences"][0] == {"what": "unexpected", "base": extra["base"], "checkpoint_size": 0, "live_size": 8192}
    assert t.sum() == extra["sum"] and t.gate_open()


def test_device_memory_the_shim_does_not_carry_is_refused_not_left_out(procs, shim_dir, tmp_path):
    """A CUDA array (or memory imported from another process) is device memory the shim does not copy:
    a checkpoint of a program holding one would leave it out without a word. Refused, naming the
    call, with the job untouched; once it is destroyed, the checkpoint goes ahead."""
    from shimtest import ask, start_pattern

    p = start_pattern(procs, "--plain", vmm=False)
    ready = json.loads(p.stdout.readline())
    assert ask(p, "array") == {"arrays": 1}
    with pytest.raises(CheckpointError, match="does not carry .*cuArrayCreate_v2") as e:
        checkpoint(p.pid, tmp_path / "ck")
    assert e.value.hint and "--backend driver" in e.value.hint
    assert not (tmp_path / "ck").exists()
    assert not client.status(p.pid)["paused"] and ask(p, "sum")["sum"] == ready["sum"]
    assert ask(p, "unarray") == {"arrays": 0}
    rep = checkpoint(p.pid, tmp_path / "ck")
    assert rep.allocations == 2
    p.stdin.write("quit\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0, p.stderr.read()


def test_a_full_disk_during_the_write_keeps_nothing(target, small_fs):
    t = target(4 << 20)
    with pytest.raises(DiskFull, match="no space left") as e:
        checkpoint(t.pid, small_fs / "ck")
    assert "nothing was kept" in e.value.hint
    assert os.listdir(small_fs) == []
    assert t.gate_open() and t.sum() == t.ready["sum"]


def test_a_target_killed_mid_checkpoint_leaves_no_checkpoint(target, tmp_path):
    t = target()

    def kill(phase, done, total):
        if phase == "freeze":
            t.p.kill()
            t.p.wait()

    with pytest.raises(TargetLost, match=f"process {t.pid} exited during the checkpoint"):
        checkpoint(t.pid, tmp_path / "ck", progress=kill)
    assert not (tmp_path / "ck").exists()
    assert leftovers(tmp_path) == []


def test_a_target_killed_mid_restore_is_reported(target, tmp_path):
    t = target()
    checkpoint(t.pid, tmp_path / "ck")

    def kill(phase, done, total):
        if phase == "freeze":
            t.p.kill()
            t.p.wait()

    with pytest.raises(TargetLost, match="exited during the restore"):
        restore(t.pid, tmp_path / "ck", progress=kill)
    read_manifest(tmp_path / "ck")  # the checkpoint itself is untouched


def test_two_checkpoints_at_once_one_waits_for_nothing_and_says_busy(target, tmp_path):
    t = target(4 << 20)
    checkpoint(t.pid, tmp_path / "c0")
    writing, release = threading.Event(), threading.Event()
    result: dict = {}

    def slow(phase, done, total):
        if phase == "write" and not writing.is_set():
            writing.set()
            release.wait(60)

    def first():
        try:
            result["rep"] = checkpoint(t.pid, tmp_path / "a", progress=slow)
        except Exception as exc:  # surfaced below
            result["exc"] = exc

    th = threading.Thread(target=first)
    th.start()
    assert writing.wait(60)
    try:
        with pytest.raises(CheckpointBusy, match=f"another checkpoint or restore of process {t.pid} is in progress"):
            checkpoint(t.pid, tmp_path / "b")
        with pytest.raises(CheckpointBusy):
            restore(t.pid, tmp_path / "c0")  # a valid checkpoint, but the process is busy
        # The one being written is nowhere to be mistaken for a valid checkpoint yet.
        with pytest.raises(CorruptCheckpoint, match="not a checkpoint directory"):
            restore(t.pid, tmp_path / "a")
        (partial,) = leftovers(tmp_path)
        with pytest.raises(CorruptCheckpoint, match="no manifest.json"):
            restore(t.pid, tmp_path / partial)
        assert t.gate_open()  # the first one's freeze is over: the job runs while it writes
    finally:
        release.set()
        th.join(60)
    assert "exc" not in result, result.get("exc")
    assert not (tmp_path / "b").exists()
    read_manifest(tmp_path / "a")
    assert result["rep"].bytes == t.ready["bytes"]


def test_the_kinds_saved_agree_between_shim_and_library(target, tmp_path):
    t = target()
    checkpoint(t.pid, tmp_path / "ck")
    st = client.status(t.pid)
    m = read_manifest(tmp_path / "ck")
    from gputrace.checkpointer import compare

    assert compare(m, st) == []
    assert orjson.loads(orjson.dumps(m))["bytes"] == t.ready["bytes"]


def test_direct_copies_into_the_pinned_image_give_the_same_checkpoint(target, tmp_path):
    t = target(3 << 20)
    staged = checkpoint(t.pid, tmp_path / "staged", lanes=2, chunk=1 << 20, direct=False)
    direct = checkpoint(t.pid, tmp_path / "direct", lanes=2, chunk=1 << 20)  # the default
    assert direct.direct and not staged.direct
    assert (tmp_path / "direct" / "data.img").read_bytes() == (tmp_path / "staged" / "data.img").read_bytes()
    assert read_manifest(tmp_path / "direct")["shim"]["direct"] is True
    t.cmd("fill 8")
    rr = restore(t.pid, tmp_path / "direct", direct=True)
    assert rr.direct and t.sum() == t.ready["sum"]
    assert t.gate_open()


def test_a_driver_error_mid_copy_reopens_the_gate_and_keeps_nothing(procs, shim_dir, tmp_path, monkeypatch):
    odd = 196608  # a chunk size only the shim's copies use: simcuda fails async copies of exactly it
    monkeypatch.setenv("SIMCUDA_FAIL_COPY_BYTES", str(odd))
    t = Target(procs, 1 << 20)
    ok = checkpoint(t.pid, tmp_path / "ok", chunk=1 << 20)
    with pytest.raises(CheckpointError, match=r"could not dump .*copy failed .*cuMemcpyDtoHAsync.*CUresult 700"):
        checkpoint(t.pid, tmp_path / "bad", chunk=odd)
    assert not (tmp_path / "bad").exists() and leftovers(tmp_path) == []
    assert t.gate_open() and t.sum() == t.ready["sum"]
    t.cmd("fill 4")
    with pytest.raises(CheckpointError, match="copy failed") as e:
        restore(t.pid, tmp_path / "ok", chunk=odd)
    assert "partly restored" in e.value.hint and t.gate_open()
    restore(t.pid, tmp_path / "ok")  # and a retry that works puts everything back
    assert t.sum() == t.ready["sum"] and ok.bytes == t.ready["bytes"]


def test_two_checkpoints_in_one_second_get_two_directories(tmp_path):
    """top's c pressed twice within a second named both checkpoints full-PID-TIME alike, and the second
    was refused ("already exists"): seen in the restore test, 2 runs of 12."""
    from gputrace.checkpointer.store import fresh_dir

    a = fresh_dir(tmp_path, "full-42")
    a.mkdir()
    b = fresh_dir(tmp_path, "full-42")
    b.mkdir()
    c = fresh_dir(tmp_path, "full-42")
    assert len({a, b, c}) == 3 and all(x.name.startswith("full-42-") for x in (a, b, c))



BUSY = {"ok": False, "error": "busy", "detail": "the process allocated device memory meanwhile; try again"}


def refusing(monkeypatch, refusals: int) -> list[str]:
    """The shim's first `refusals` dump requests answered busy, overtaken by the job's allocations, without
    reaching it (the race is the job's to make; what follows is the shim's own); the dump requests sent."""
    from gputrace.checkpointer import ops

    sent: list[str] = []
    real = ops.ShimSession.request

    def request(self, words, **kw):
        if words.startswith("dump"):
            sent.append(words)
            if len(sent) <= refusals:
                return dict(BUSY)
        return real(self, words, **kw)

    monkeypatch.setattr(ops.ShimSession, "request", request)
    return sent


@pytest.mark.parametrize("refusals", [1, 2])
def test_a_dump_overtaken_by_the_jobs_allocations_is_tried_again_the_last_time_staged(target, tmp_path, monkeypatch,
                                                                                    refusals):
    """The shim refuses a dump, busy, when the job allocated between the plan and the freeze (a training
    loop's temporaries; top's C on such a job read "busy"): nothing copied, the gate open again.
    `checkpoint` plans again rather than fail, the last try through the staging buffers, which take any
    size (a direct copy maps the image for the plan's). The data must come back from what it kept."""
    from gputrace.checkpointer import ops

    t = target(4 << 20)
    saved = t.sum()
    sent = refusing(monkeypatch, refusals)
    rep = checkpoint(t.pid, tmp_path / "ck", chunk=1 << 20)
    last_staged = refusals == ops.BUSY_TRIES - 1
    assert len(sent) == refusals + 1
    assert [" direct=1" in w for w in sent] == [True] * refusals + [not last_staged]
    if last_staged:
        assert not rep.direct
    assert rep.attempts == refusals + 1  # the report counts the tries planned again
    assert t.gate_open()
    assert t.cmd("fill 9")["sum"] != saved
    restore(t.pid, tmp_path / "ck")
    assert t.sum() == saved


def test_a_dump_overtaken_every_time_says_busy_and_keeps_nothing(target, tmp_path, monkeypatch):
    from gputrace.checkpointer import ops

    t = target(1 << 20)
    sent = refusing(monkeypatch, 99)
    with pytest.raises(CheckpointBusy, match="allocated device memory meanwhile") as e:
        checkpoint(t.pid, tmp_path / "ck")
    assert len(sent) == ops.BUSY_TRIES and "try again" in e.value.hint
    assert not (tmp_path / "ck").exists() and not leftovers(tmp_path)
    assert t.gate_open()
