"""What a suspension costs beyond its copies, held by counts: the image a suspension copies into (a
memfd of the shim's, its pages allocated, mapped and registered with the driver) is made once for a
job and kept between its suspensions within the shim's pin cap, so that a second suspend makes
nothing again and resume unpins nothing; `release`, a suspension into a file, or a cap too small
give it back, and it is made again when the job outgrows it."""

from __future__ import annotations

import json

from gputrace.checkpointer import resume, suspend
from gputrace.shim import client

from shimtest import ask, procs, shim_dir, start_pattern  # noqa: F401  (fixtures)

SIZE = 3 << 20


def kept(pid: int) -> dict:
    return client.status(pid)["kept"]


def start(procs, *args: str):
    p = start_pattern(procs, "--plain", "--size", str(SIZE), *args)
    return p, json.loads(p.stdout.readline())


def release(pid: int) -> dict:
    conn = client.Connection(pid)
    try:
        return conn.request("release")
    finally:
        conn.close()


def cycle(p, fill: int) -> tuple:
    """Data changed, suspended, resumed: the reports, and whether the job's data came back."""
    want = ask(p, f"fill {fill}")["sum"]
    s = suspend(p.pid)
    r = resume(p.pid)
    return s, r, ask(p, "sum")["sum"] == want


def test_a_second_suspend_makes_nothing_again_and_resume_unpins_nothing(procs, shim_dir):
    p, ready = start(procs)
    assert kept(p.pid)["suspend_image_allocs"] == 0 and kept(p.pid)["suspend_image_bytes"] == 0
    s1, r1, right = cycle(p, 3)
    assert right and s1.direct and s1.image_kept and s1.image_allocs == 1 and r1.image_kept
    first = kept(p.pid)
    assert first["suspend_image_allocs"] == 1 and first["suspend_image_bytes"] >= ready["bytes"]
    for i in range(3):
        s, r, right = cycle(p, 10 + i)
        assert right and s.image_kept and r.image_kept and s.direct
        assert s.image_allocs == 1  # the image of the first suspension, neither made nor pinned again
    now = kept(p.pid)
    assert now["suspend_image_allocs"] == 1 and now["suspend_image_reused"] == 3
    assert now["suspend_image_bytes"] == first["suspend_image_bytes"]
    assert now["pool_allocs"] == 0  # a direct suspension stages nothing
    # `release` gives it back; the next suspension makes it once more.
    rel = release(p.pid)
    assert rel["ok"] and rel["released_pinned_bytes"] >= first["suspend_image_bytes"]
    assert kept(p.pid)["suspend_image_bytes"] == 0
    s, r, right = cycle(p, 20)
    assert right and s.image_allocs == 2 and kept(p.pid)["suspend_image_allocs"] == 2


def test_a_job_that_outgrew_its_kept_image_gets_a_new_one(procs, shim_dir):
    p, ready = start(procs)
    cycle(p, 4)
    size = kept(p.pid)["suspend_image_bytes"]
    ask(p, f"alloc {size}")  # more than the kept image's room for growth
    s, r, right = cycle(p, 5)
    assert right and s.image_allocs == 2 and kept(p.pid)["suspend_image_bytes"] > size
    s, r, right = cycle(p, 6)
    assert right and s.image_allocs == 2


def test_a_cap_too_small_keeps_no_image_between_suspensions(procs, shim_dir, monkeypatch):
    monkeypatch.setenv("GPUTRACE_SHIM_PIN_CAP", str(1 << 20))  # less than the job's 4.5 MiB
    p, ready = start(procs)
    s, r, right = cycle(p, 7)
    assert right and s.image_kept and not r.image_kept  # used while suspended, given back at resume
    assert kept(p.pid)["suspend_image_bytes"] == 0
    s, r, right = cycle(p, 8)
    assert right and s.image_allocs == 2


def test_a_suspension_into_a_file_gives_the_kept_image_back(procs, shim_dir, tmp_path):
    p, ready = start(procs)
    cycle(p, 9)
    assert kept(p.pid)["suspend_image_bytes"] > 0
    want = ask(p, "fill 11")["sum"]
    s = suspend(p.pid, out=tmp_path / "s")  # -o: the data in a checkpoint directory, host memory let go
    assert not s.image_kept and kept(p.pid)["suspend_image_bytes"] == 0
    r = resume(p.pid)
    assert not r.image_kept and ask(p, "sum")["sum"] == want
    s, r, right = cycle(p, 12)
    assert right and s.image_kept and s.image_allocs == 2
