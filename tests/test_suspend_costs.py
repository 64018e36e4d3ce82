"""What a suspension costs beyond its copies, held by counts: the image a suspension copies into (a
memfd of the shim's, its pages allocated, mapped and registered with the driver) is made once for a
job and kept between its suspensions within the shim's pin cap, so that a second suspend makes
nothing again and resume unpins nothing; `release`, a suspension into a file, or a cap too small
give it back, and it is made again when the job outgrows it.  `suspend --prepare` (the shim's
`prepare_suspend`) makes that image ahead, while the job runs, so that even the first suspend makes
nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gputrace.base.errors import CheckpointBusy, CheckpointError, NotSuspendable, ShimUnavailable
from gputrace.checkpointer import prepare, resume, suspend
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


# ---- `suspend --prepare`: the image made ahead, while the job runs


def gputrace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=60)


def test_a_prepared_image_makes_the_first_suspend_make_nothing(procs, shim_dir):
    p, ready = start(procs)
    r = prepare(p.pid)
    assert r.made and r.image_allocs == 1 and r.bytes == ready["bytes"] and r.image_bytes >= ready["bytes"]
    k = kept(p.pid)
    assert k["suspend_image_allocs"] == 1 and k["suspend_image_prepared"] == 1
    assert k["suspend_image_bytes"] == r.image_bytes and k["suspend_image_reused"] == 0
    # The job was not stopped for it, and runs on.
    assert not client.status(p.pid)["paused"] and ask(p, "sum")["sum"] == ready["sum"]
    s, r1, right = cycle(p, 3)
    assert right and s.direct and s.image_kept and r1.image_kept
    assert s.image_allocs == 1  # the first suspension found the image made: nothing made, nothing pinned
    k = kept(p.pid)
    assert k["suspend_image_allocs"] == 1 and k["suspend_image_reused"] == 1
    assert k["suspend_image_bytes"] == r.image_bytes and k["pool_allocs"] == 0


def test_prepare_twice_does_nothing_the_second_time(procs, shim_dir):
    p, ready = start(procs)
    first = prepare(p.pid)
    again = prepare(p.pid)
    assert first.made and not again.made and again.setup_ns == 0
    assert again.image_bytes == first.image_bytes and again.image_allocs == 1
    assert kept(p.pid)["suspend_image_allocs"] == 1 and kept(p.pid)["suspend_image_prepared"] == 1
    cycle(p, 4)  # a suspension and its resume keep it: still nothing to do
    assert not prepare(p.pid).made and kept(p.pid)["suspend_image_allocs"] == 1


def test_prepare_after_the_job_grew_makes_a_larger_image(procs, shim_dir):
    p, ready = start(procs)
    first = prepare(p.pid)
    ask(p, f"alloc {first.image_bytes}")  # more than the image's sixteenth of room
    grown = prepare(p.pid)
    assert grown.made and grown.image_bytes > first.image_bytes and grown.image_allocs == 2
    s, r, right = cycle(p, 5)
    assert right and s.image_allocs == 2


def test_prepare_over_the_cap_is_refused_and_the_job_runs_on(procs, shim_dir, monkeypatch):
    monkeypatch.setenv("GPUTRACE_SHIM_PIN_CAP", str(1 << 20))  # less than the job's 4.5 MiB
    p, ready = start(procs)
    with pytest.raises(CheckpointError) as e:
        prepare(p.pid)
    assert "over the pin cap" in e.value.msg and "GPUTRACE_SHIM_PIN_CAP=" in e.value.hint
    k = kept(p.pid)
    assert k["suspend_image_bytes"] == 0 and k["suspend_image_allocs"] == 0
    assert not client.status(p.pid)["paused"] and ask(p, "sum")["sum"] == ready["sum"]
    s, r, right = cycle(p, 6)  # suspend works as before without it
    assert right and s.image_allocs == 1 and not r.image_kept


def test_release_gives_a_prepared_image_back(procs, shim_dir):
    p, ready = start(procs)
    r = prepare(p.pid)
    out = gputrace("shim", "release", "-p", str(p.pid), "--json")
    assert out.returncode == 0, out.stderr
    rel = json.loads(out.stdout)
    assert rel["ok"] and rel["released_pinned_bytes"] >= r.image_bytes and not rel["suspended"]
    assert kept(p.pid)["suspend_image_bytes"] == 0
    s, _, right = cycle(p, 7)
    assert right and s.image_allocs == 2  # made again by the suspend itself
    out = gputrace("shim", "release", "-p", str(p.pid))
    assert out.returncode == 0 and "of pinned host memory given back now" in out.stdout, out.stderr


def test_prepare_is_refused_without_pinning_where_the_suspend_would_be(procs, shim_dir):
    p = start_pattern(procs, "--plain", "--size", str(SIZE), vmm=False)  # not --suspendable
    ready = json.loads(p.stdout.readline())
    with pytest.raises(NotSuspendable) as e:
        prepare(p.pid)
    assert "not served through the VMM API" in e.value.msg and "--suspendable" in e.value.hint
    assert kept(p.pid)["suspend_image_bytes"] == 0 and ask(p, "sum")["sum"] == ready["sum"]


def test_prepare_is_refused_while_the_gate_is_closed_or_the_job_suspended(procs, shim_dir):
    p, ready = start(procs)
    with client.Connection(p.pid) as c:
        assert c.request("pause")["ok"]
        with pytest.raises(CheckpointBusy):
            prepare(p.pid)
    assert kept(p.pid)["suspend_image_allocs"] == 0
    suspend(p.pid)
    with pytest.raises(CheckpointError) as e:
        prepare(p.pid)
    assert "is suspended" in e.value.msg and "gputrace resume" in e.value.hint
    resume(p.pid)
    assert ask(p, "sum")["sum"] == ready["sum"]


def test_prepare_of_a_job_with_no_device_memory_makes_nothing(procs, shim_dir):
    p = start_pattern(procs, "--empty")
    json.loads(p.stdout.readline())
    r = prepare(p.pid)
    assert not r.made and r.bytes == 0 and r.image_bytes == 0 and kept(p.pid)["suspend_image_allocs"] == 0


def test_cli_suspend_prepare(procs, shim_dir):
    p, ready = start(procs)
    out = gputrace("suspend", "--prepare", "-p", str(p.pid))
    assert out.returncode == 0, out.stderr
    assert f"prepared pid {p.pid}'s suspension image" in out.stdout
    assert f"gputrace shim release -p {p.pid}" in out.stdout
    out = gputrace("suspend", "--prepare", "-p", str(p.pid), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["schema"] == 1 and doc["pid"] == p.pid and not doc["made"] and doc["image_bytes"] >= ready["bytes"]
    out = gputrace("suspend", "-p", str(p.pid), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["image_allocs"] == 1, out.stderr
    assert gputrace("resume", "-p", str(p.pid)).returncode == 0 and ask(p, "sum")["sum"] == ready["sum"]
    for bad in (["-o", "/tmp/x"], ["--staging"], ["--backend", "driver"], ["-p", f"{p.pid},{p.pid + 1}"]):
        out = gputrace("suspend", "--prepare", "-p", str(p.pid), *bad)
        assert out.returncode == 2 and "hint:" in out.stderr, (bad, out.stderr)


def test_cli_suspend_prepare_errors(procs, shim_dir):
    plain = subprocess.Popen(["sleep", "60"])
    procs.append(plain)
    out = gputrace("suspend", "--prepare", "-p", str(plain.pid))
    assert out.returncode == ShimUnavailable.exit_code and "gputrace run --checkpointable" in out.stderr
    plain.kill()
    plain.wait()
    out = gputrace("suspend", "--prepare", "-p", str(plain.pid))
    assert out.returncode == 3 and "no process" in out.stderr and "hint:" in out.stderr
