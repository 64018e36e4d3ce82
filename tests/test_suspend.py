"""Suspend and resume of a shimmed simcuda process whose cuMemAlloc memory the shim serves through the
VMM API (GPUTRACE_SHIM_VMM=1): suspend frees the device memory (as the driver reports it), the job
waits at its next submission, and resume brings the data back at the same addresses so the job
continues where it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from gputrace import shim, simcuda
from gputrace.checkpointer import resume, suspend
from gputrace.base.errors import CheckpointError
from gputrace.shim import client

from ckpttest import small_fs  # noqa: F401  (fixture)
from shimtest import ask, start_pattern, open_files, procs, shim_dir  # noqa: F401  (fixtures)

GRANULE = 2 << 20  # simcuda's VMM granularity


start = start_pattern


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staging"])
def test_suspend_frees_device_memory_and_resume_brings_it_back_at_the_same_addresses(procs, shim_dir, direct):
    p = start(procs, "--plain", "--size", str(3 << 20))
    ready = json.loads(p.stdout.readline())
    before = client.status(p.pid)
    mem = [a for a in before["allocations"] if a["kind"] == "device"]
    # Served through the VMM API: rounded up to the granularity, with a handle behind each address.
    assert sorted((a["base"], a["size"]) for a in mem) == sorted((a["base"], a["size"]) for a in ready["allocations"])
    assert all(a["reserved"] == -(-a["size"] // GRANULE) * GRANULE and not a["suspended"] for a in mem)
    free0 = ask(p, "meminfo")["free"]

    rep = suspend(p.pid, direct=direct)
    assert rep.allocations == 2 and rep.bytes == ready["bytes"] and rep.direct == direct
    assert rep.reserved_bytes == sum(a["reserved"] for a in mem)
    assert ask(p, "meminfo")["free"] == free0 + rep.reserved_bytes  # the driver has the memory back
    st = client.status(p.pid)
    assert st["suspended"] and st["paused"]
    assert all(a["suspended"] for a in st["allocations"] if a["kind"] == "device")

    # The job's next submission waits at the gate; a `resume` of the gate alone is refused.
    got: dict = {}
    th = threading.Thread(target=lambda: got.update(ask(p, "sum")))
    th.start()
    with client.Connection(p.pid) as c:
        while c.status()["waiting"] == 0:
            assert th.is_alive()
        assert c.resume()["error"] == "suspended"

    rr = resume(p.pid, direct=direct)
    th.join(60)
    assert got["sum"] == ready["sum"]  # the job went on with its data, at the same addresses
    assert rr.allocations == 2 and rr.bytes == ready["bytes"] and rr.direct == direct
    after = client.status(p.pid)
    assert not after["suspended"] and not after["paused"]
    assert sorted((a["base"], a["size"]) for a in after["allocations"] if a["kind"] == "device") == \
        sorted((a["base"], a["size"]) for a in mem)
    assert ask(p, "meminfo")["free"] == free0
    # It keeps working: overwrite, suspend and resume again, free at exit.
    s2 = ask(p, "fill 5")["sum"]
    suspend(p.pid)
    resume(p.pid)
    assert ask(p, "sum")["sum"] == s2
    p.stdin.write("quit\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0, p.stderr.read()


def test_memory_not_served_through_vmm_cannot_be_suspended(procs, shim_dir):
    p = start(procs, vmm=False)
    ready = json.loads(p.stdout.readline())
    with pytest.raises(CheckpointError, match="cannot be suspended: the device allocation at .* is not served") as e:
        suspend(p.pid)
    assert "run --checkpointable --suspendable" in e.value.hint
    assert client.status(p.pid)["paused"] is False and ask(p, "sum")["sum"] == ready["sum"]
    with pytest.raises(CheckpointError, match="is not suspended"):
        resume(p.pid)
    # With the VMM path on, a pitched allocation still cannot be released: refused, nothing changed.
    q = start(procs)
    ready = json.loads(q.stdout.readline())
    with pytest.raises(CheckpointError, match="pitched allocation") as e:
        suspend(q.pid)
    assert "--backend driver" in e.value.hint and "--suspendable --" not in e.value.hint  # it has that already
    assert client.status(q.pid)["paused"] is False and ask(q, "sum")["sum"] == ready["sum"]


def test_a_program_that_maps_its_own_vmm_memory_is_suspended_mid_run_and_goes_on_as_if_never_stopped(procs, shim_dir):
    """As PyTorch with expandable_segments and JAX do: simcuda's train job maps one VMM allocation of its
    own beside its cuMemAlloc buffer, and every step depends on both. Suspended mid-run and resumed, it
    prints what an uninterrupted run prints."""
    argv = simcuda.workload("train") + ["--steps", "6", "--kernel-ns", "1000000"]
    ref = subprocess.run(argv, env=simcuda.env(), capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr
    env = shim.preload_env(simcuda.env())
    env["GPUTRACE_SHIM_VMM"] = "1"
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    lines = [p.stdout.readline()]
    assert lines[0].startswith("step ")  # past its set-up: the mapping is made, the shim serves
    rep = suspend(p.pid)
    assert rep.allocations == 2 and rep.reserved_bytes == GRANULE + (4 << 20)  # its granule and its buffer
    st = client.status(p.pid)
    assert st["suspended"] and all(a["suspended"] for a in st["allocations"] if a["kind"] in ("vmm_map", "vmm_phys"))
    resume(p.pid)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "".join(lines) + out == ref.stdout


def test_stream_ordered_memory_is_served_through_vmm_suspended_and_resumed(procs, shim_dir):
    """cuMemAllocAsync memory and memory from a pool (JAX's and CuPy's async allocators) was refused by suspend ("the
    stream-ordered allocation ... is not served through the VMM API"). With the VMM path on it is
    served like cuMemAlloc memory; a cuMemFreeAsync issued while a kernel and a copy still use the
    memory gives it back only once the stream has reached the free (the results are an unshimmed
    run's), and a suspension gives back every such free before it releases the rest."""
    def reference() -> list[dict]:
        q = subprocess.Popen(simcuda.workload("pattern") + ["--async"], env=simcuda.env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(q)
        out = [json.loads(q.stdout.readline()), ask(q, "churn 3"), ask(q, "churn 2")]
        q.stdin.write("quit\n")
        q.stdin.flush()
        assert q.wait(timeout=60) == 0, q.stderr.read()
        return out

    ref = reference()
    p = start(procs, "--async")
    ready = json.loads(p.stdout.readline())
    assert ready["sum"] == ref[0]["sum"]
    mem = client.status(p.pid)["allocations"]
    kinds = sorted(a["kind"] for a in mem if a["kind"] in ("device", "async"))
    # (cuMemAllocAsync's and the one from the program's own pool, cuMemAllocFromPoolAsync)
    assert kinds == ["async", "async", "device", "device"]
    assert all(a["reserved"] > 0 for a in mem if a["kind"] == "async")
    free0 = ask(p, "meminfo")["free"]
    assert ask(p, "churn 3")["sum"] == ref[1]["sum"]  # each free waited for the kernel and copy before it
    # The last frees may still be pending (their events not looked at since): suspend gives them back
    # too, so the driver has everything the job holds, and no more, once it is suspended.
    reserved = sum(a["reserved"] for a in client.status(p.pid)["allocations"] if a["kind"] in ("device", "async"))
    rep = suspend(p.pid)
    assert rep.allocations == 4 and rep.reserved_bytes == reserved
    assert ask(p, "meminfo")["free"] == free0 + reserved
    resume(p.pid)
    assert ask(p, "meminfo")["free"] == free0
    assert ask(p, "churn 2")["sum"] == ref[2]["sum"]
    p.stdin.write("quit\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0, p.stderr.read()


def test_memory_from_a_programs_own_pool_is_checkpointed_and_restored(procs, shim_dir, tmp_path):
    """cuMemAllocFromPoolAsync was not intercepted: its memory was in no record, and a checkpoint left
    it out without a word (a rollback restored everything else). It is recorded like cuMemAllocAsync's."""
    from gputrace.checkpointer import checkpoint, restore

    p = start(procs, "--async", vmm=False)
    ready = json.loads(p.stdout.readline())
    rep = checkpoint(p.pid, tmp_path / "ck")
    assert rep.bytes == ready["bytes"] and rep.allocations == 4
    assert ask(p, "fill 3")["sum"] != ready["sum"]
    restore(p.pid, tmp_path / "ck")
    assert ask(p, "sum")["sum"] == ready["sum"]
    p.stdin.write("quit\n")
    p.stdin.flush()
    assert p.wait(timeout=60) == 0, p.stderr.read()


def test_a_suspension_is_undone_with_its_connection_unless_kept(procs, shim_dir):
    p = start(procs, "--plain")
    ready = json.loads(p.stdout.readline())
    with client.Connection(p.pid) as c:
        fd = os.memfd_create("img")
        r = c.request("suspend", fd=fd)
        os.close(fd)
        assert r["ok"] and client.status(p.pid)["suspended"], r
        with client.Connection(p.pid) as other:
            assert other.request("keep")["error"] == "the suspension belongs to another connection"
    # Closed without `keep` (as when the suspending gputrace dies): the shim gave the job back.
    st = client.status(p.pid)
    assert not st["suspended"] and not st["paused"] and ask(p, "sum")["sum"] == ready["sum"]


def test_a_kept_suspension_outlives_the_connection_and_refuses_a_second_suspend(procs, shim_dir):
    p = start(procs, "--plain")
    ready = json.loads(p.stdout.readline())
    with client.Connection(p.pid) as c:
        assert c.pause(5000)["ok"]
        fd = os.memfd_create("img")
        r = c.request("suspend", fd=fd)
        os.close(fd)
        assert r["ok"], r
        assert c.request("keep")["kept"] is True
    # The connection that held the pause is gone; the suspension, and its closed gate, remain.
    assert client.status(p.pid)["suspended"] and client.status(p.pid)["paused"]
    with pytest.raises(CheckpointError, match="already suspended"):
        suspend(p.pid)
    with client.Connection(p.pid) as c:
        assert c.request("dump")["error"] == "suspended"
    resume(p.pid)
    assert ask(p, "sum")["sum"] == ready["sum"]


def test_cli_run_suspendable_suspend_and_resume(procs, shim_dir):
    p = subprocess.Popen([sys.executable, "-m", "gputrace", "run", "--checkpointable", "--suspendable", "--",
                          *simcuda.workload("pattern"), "--plain"], env=simcuda.env(), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    ready = json.loads(p.stdout.readline())
    r = subprocess.run([sys.executable, "-m", "gputrace", "suspend", "-p", str(p.pid)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and f"suspended pid {p.pid}" in r.stdout and "freed" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "gputrace", "resume", "-p", str(p.pid), "--json"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes"] == ready["bytes"]
    assert ask(p, "sum")["sum"] == ready["sum"]
    r = subprocess.run([sys.executable, "-m", "gputrace", "resume", "-p", str(p.pid)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 10 and "is not suspended" in r.stderr and "hint:" in r.stderr


def test_vmm_served_allocations_behave_like_the_drivers(procs, shim_dir):
    # alloc_free checks every byte it moves through each kind of memory and that free memory returns to
    # where it started after each step: cuMemAlloc/cuMemFree served through the VMM API must pass both.
    env = shim.preload_env(simcuda.env())
    env["GPUTRACE_SHIM_VMM"] = "1"
    r = subprocess.run(simcuda.workload("alloc_free") + ["--steps", "8", "--size", str(3 << 20)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["check"] == "ok"


def test_suspend_to_a_directory_gives_host_memory_back_and_leaves_a_checkpoint(procs, shim_dir, tmp_path):
    from gputrace.checkpointer import restore
    from gputrace.checkpointer.store import read_manifest

    p = start(procs, "--plain", "--size", str(3 << 20))
    ready = json.loads(p.stdout.readline())
    out = tmp_path / "s1"
    rep = suspend(p.pid, out=out)
    assert rep.path == str(out) and rep.bytes == ready["bytes"]
    m = read_manifest(out)  # a complete checkpoint of the suspended state
    assert sorted((a["base"], a["size"]) for a in m["allocations"]) == \
        sorted((a["base"], a["size"]) for a in ready["allocations"])
    fds = open_files(p.pid)
    assert str(out / "data.img") in fds  # the shim reads it back from disk ...
    assert not any("gputrace-suspend" in f for f in fds)  # ... and has let the memfd (host memory) go
    assert client.status(p.pid)["suspended"]
    resume(p.pid)
    assert ask(p, "sum")["sum"] == ready["sum"]
    assert str(out / "data.img") not in open_files(p.pid)
    # The directory is an ordinary checkpoint: the job rolls back to it after overwriting its memory.
    assert ask(p, "fill 9")["sum"] != ready["sum"]
    restore(p.pid, out)
    assert ask(p, "sum")["sum"] == ready["sum"]


def test_suspend_to_a_full_disk_keeps_the_job_suspended_in_host_memory(procs, shim_dir, small_fs):
    p = start(procs, "--plain", "--size", str(3 << 20))
    ready = json.loads(p.stdout.readline())
    with pytest.raises(CheckpointError, match="no space left.*suspended with its data in host memory") as ei:
        suspend(p.pid, out=small_fs / "s1")
    assert f"gputrace resume -p {p.pid}" in ei.value.hint
    assert not (small_fs / "s1").exists() and not list(small_fs.iterdir())  # nothing that claims to be valid
    assert client.status(p.pid)["suspended"]
    resume(p.pid)
    assert ask(p, "sum")["sum"] == ready["sum"]


def test_ps_says_a_suspended_job_is_suspended(procs, shim_dir):
    """`gputrace ps` beside a suspended job: "serving, suspended" in the table, a flag in JSON."""
    p = start(procs, "--plain", "--size", str(1 << 20))
    json.loads(p.stdout.readline())
    suspend(p.pid)
    try:
        ps = subprocess.run([sys.executable, "-m", "gputrace", "ps", "--json"], capture_output=True, text=True,
                            timeout=60)
        row = next(r for r in json.loads(ps.stdout)["processes"] if r["pid"] == p.pid)
        assert row["state"] == "serving" and row["suspended"] is True
        text = subprocess.run([sys.executable, "-m", "gputrace", "ps"], capture_output=True, text=True, timeout=60)
        line = next(ln for ln in text.stdout.splitlines() if ln.split()[:1] == [str(p.pid)])
        assert "serving, suspended" in line
    finally:
        resume(p.pid)
    assert not client.status(p.pid)["suspended"]
