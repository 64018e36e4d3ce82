"""A gputrace killed mid-operation never leaves the job frozen: stopped at chosen points (GPUTRACE_STOP_AT,
checkpointer/guardian.py) and killed there, and killed at random moments in a loop, `checkpoint`,
`restore`, `suspend` and `checkpoint --full` each leave the job running, ungated, unlocked in the driver
and with its data intact.  The whole-process cases use real CRIU on simcuda in device mode, as
tests/test_full_checkpoint.py does."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gputrace import shim, simcuda
from gputrace.checkpointer import checkpoint, driver, guardian
from gputrace.base.procs import stat_fields
from gputrace.shim import client
from gputrace.simcuda.device import Device

from shimtest import procs, shim_dir  # noqa: F401  (fixtures)
from test_full_checkpoint import Job, _criu_reason, sim_env, wait_for_text

SEED = int(os.environ.get("GPUTRACE_TEST_SEED", "18"))
needs_criu = pytest.mark.skipif(_criu_reason() is not None, reason=str(_criu_reason()))


def settle(job_pid: int) -> None:
    """Waits for any guardian of the job to finish giving it back (an event: its exit)."""
    assert guardian.settle(job_pid, 300), f"a guardian of {job_pid} is still at work"


def check_given_back(pid: int, *, shimmed: bool = True) -> None:
    f = stat_fields(pid)
    assert f is not None and f[0] not in (b"T", b"t", b"Z"), f"job {pid} is {f and f[0]}"
    assert driver.Driver(pid).state() == "running"
    if shimmed:
        st = client.status(pid)
        assert st["paused"] is False and st["suspended"] is False, st


def run_stopped_at(point: str, argv: list[str], cwd: Path | None = None) -> subprocess.Popen:
    """Starts gputrace ARGV with GPUTRACE_STOP_AT=point and waits until it has stopped itself there
    (through the installed `gputrace` script when `cwd` is given: `-m` would import from cwd)."""
    cmd = [str(Path(sys.executable).parent / "gputrace")] if cwd else [sys.executable, "-m", "gputrace"]
    p = subprocess.Popen([*cmd, *argv], env={**os.environ, "GPUTRACE_STOP_AT": point}, cwd=cwd,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # waitid(WSTOPPED) is the event: the child stopping itself.
    info = os.waitid(os.P_PID, p.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
    assert info.si_code == os.CLD_STOPPED, (point, p.communicate())
    return p


# --- the shim's own operations ----------------------------------------------------------------------------------


def vmm_job(procs) -> tuple[subprocess.Popen, dict]:
    env = {**shim.preload_env(simcuda.env()), "GPUTRACE_SHIM_VMM": "1"}
    p = subprocess.Popen(simcuda.workload("pattern") + ["--plain", "--size", str(2 << 20)], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    return p, json.loads(p.stdout.readline())


def job_sum(p) -> str:
    p.stdin.write("sum\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())["sum"]


def test_a_suspend_killed_before_it_keeps_the_suspension_is_undone_by_the_shim(procs, shim_dir):
    p, ready = vmm_job(procs)
    g = run_stopped_at("suspend:suspended", ["suspend", "-p", str(p.pid)])
    assert client.status(p.pid)["suspended"] is True  # it was: the shim did its part
    g.kill()
    g.wait()
    check_given_back(p.pid)
    assert job_sum(p) == ready["sum"]
    # Done to the end, the suspension stays after the command exits (it was kept).
    r = subprocess.run([sys.executable, "-m", "gputrace", "suspend", "-p", str(p.pid)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert client.status(p.pid)["suspended"] is True
    r = subprocess.run([sys.executable, "-m", "gputrace", "resume", "-p", str(p.pid)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and job_sum(p) == ready["sum"], r.stderr


@pytest.mark.parametrize("point", ["driver:locked", "driver:checkpointed"])
def test_a_driver_checkpoint_killed_between_its_steps_is_given_back(procs, shim_dir, point):
    p, ready = vmm_job(procs)
    g = run_stopped_at(point, ["checkpoint", "--backend", "driver", "-p", str(p.pid)])
    assert driver.Driver(p.pid).state() == point.split(":")[1]
    g.kill()
    g.wait()
    settle(p.pid)
    check_given_back(p.pid)
    assert job_sum(p) == ready["sum"]


def test_the_guardian_imports_nothing_from_the_working_directory(procs, shim_dir, tmp_path):
    """Run from a directory holding a `gputrace` package of someone else's (on the H200, the checkout
    itself: the guardian found no gputrace.checkpointer there and the job stayed checkpointed in the
    driver), the guardian still gives the job back, and imports none of it."""
    if not (Path(sys.executable).parent / "gputrace").exists():
        pytest.skip("no installed gputrace script beside this Python")
    p, ready = vmm_job(procs)
    fake = tmp_path / "cwd" / "gputrace"
    fake.mkdir(parents=True)
    marker = tmp_path / "imported"
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    g = run_stopped_at("driver:checkpointed", ["checkpoint", "--backend", "driver", "-p", str(p.pid)],
                       cwd=tmp_path / "cwd")
    g.kill()
    g.wait()
    settle(p.pid)
    assert not marker.exists()
    check_given_back(p.pid)
    assert job_sum(p) == ready["sum"]


# --- checkpoint --full ---------------------------------------------------------------------------------------------

STEPS = 400


def reference(root: Path, steps: int) -> str:
    with Device(root / "refdev") as d:
        r = subprocess.run(simcuda.workload("train") + ["--steps", str(steps), "--kernel-ns", "0", "--vmm", "0"],
                           env=d.env(sim_env()), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture
def train(tmp_path):
    """tests/test_full_checkpoint.py's train job in device mode, under the shim with its allocations
    served through the VMM API (what suspend needs) and none of its own (--vmm 0)."""
    made = []
    with Device(tmp_path / "dev") as d:
        def make(steps: int, kernel_ns: int = 5_000_000) -> Job:
            j = Job(tmp_path, d, kernel_ns=kernel_ns, shimmed=True, vmm=False, steps=steps)
            made.append(j)
            return j

        yield make
        for j in made:
            j.kill()


def foreign_tracer(stderr: str) -> bool:
    return any(s in stderr for s in ("[uprobes]", "uprobe breakpoints", "uprobe trampoline"))


@needs_criu
@pytest.mark.parametrize("point, extra", [("full:suspended", []), ("full:locked", []), ("full:checkpointed", []),
                                          ("criu:gated", []), ("criu:started", []), ("full:dumped", []),
                                          ("full:given-back", ["--leave-running"])])
def test_checkpoint_full_killed_at_each_step_leaves_the_job_running(train, tmp_path, point, extra):
    steps = 120
    j = train(steps=steps)
    wait_for_text(j.out, "step 3 ")
    g = run_stopped_at(point, ["checkpoint", "--full", "-p", str(j.pid), "-o", str(tmp_path / "ck"), *extra])
    try:
        if point == "criu:gated":
            # CRIU is started but held at its gate until the guardian knows its pid: it has not seized the
            # job. (The gate is known by its command line, which exec sets before the parent can go on;
            # its comm may still be the parent's then: the kernel renames a task after closing its
            # close-on-exec descriptors, which is what lets Popen return.)
            # Its command line is only there once exec has laid out the new program's arguments, after the
            # close-on-exec descriptors close (what lets Popen return): a full run saw both children with
            # none yet. Looked at until it is, within a deadline.
            deadline = time.monotonic() + 10
            while True:
                kids = [int(k) for k in Path(f"/proc/{g.pid}/task/{g.pid}/children").read_text().split()]
                gates = [k for k in kids if Path(f"/proc/{k}/cmdline").read_bytes().startswith(b"/bin/sh\0-c\0")]
                if gates or time.monotonic() > deadline:
                    break
                time.sleep(0.01)  # (no event says a task's arguments are laid out)
            assert len(gates) == 1, kids
            assert guardian._tracer(j.pid) is None
    finally:
        g.kill()  # (a failed check above must not leave it stopped, its job held, for the tests after)
        g.wait()
    settle(j.pid)
    check_given_back(j.pid)
    assert not (tmp_path / "ck").exists()
    assert j.p.wait(timeout=120) == 0
    assert j.out.read_text() == reference(tmp_path, steps)  # every step's device and host state as uninterrupted


# --- the loop: random moments ------------------------------------------------------------------------------------------


def _kill_after(argv: list[str], delay_s: float) -> subprocess.CompletedProcess | None:
    """Runs gputrace ARGV and SIGKILLs it after delay_s; None when it was killed, else its result."""
    p = subprocess.Popen([sys.executable, "-m", "gputrace", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        out, err = p.communicate(timeout=delay_s)
        return subprocess.CompletedProcess(argv, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return None


def _duration(argv: list[str]) -> float:
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gputrace", *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return time.monotonic() - t


@needs_criu
def test_kills_at_random_moments_never_leave_the_job_frozen(procs, shim_dir, train, tmp_path):
    """At least 50 kills: checkpoint, restore, suspend (a pattern job whose sum must hold) and checkpoint
    --full --leave-running (a train job whose output must be an uninterrupted run's), each killed at a
    moment drawn uniformly over how long the command takes."""
    rng = random.Random(SEED)
    p, ready = vmm_job(procs)
    ck = tmp_path / "ck"
    checkpoint(p.pid, ck)
    ops = {
        "checkpoint": lambda i: ["checkpoint", "-p", str(p.pid), "-o", str(tmp_path / f"c{i}")],
        "restore": lambda i: ["restore", "-p", str(p.pid), str(ck), "--device-only", "--force"],
        "suspend": lambda i: ["suspend", "-p", str(p.pid)],
    }
    spans = {name: _duration(fn(-1 - k)) for k, (name, fn) in enumerate(ops.items())}
    subprocess.run([sys.executable, "-m", "gputrace", "resume", "-p", str(p.pid)], check=True, capture_output=True)
    kills = 0
    for i in range(12):
        for name, fn in ops.items():
            r = _kill_after(fn(i), rng.uniform(0, spans[name] * 1.1))
            kills += r is None
            settle(p.pid)
            if name == "suspend" and client.status(p.pid)["suspended"]:
                # The suspend finished and kept its suspension before the kill (had it not kept it yet,
                # the shim would have undone it before answering: the dead connection's hangup is
                # handled before a later connection's command). Suspended as asked: bring it back.
                assert r is None or r.returncode == 0
                subprocess.run([sys.executable, "-m", "gputrace", "resume", "-p", str(p.pid)], check=True,
                               capture_output=True)
            check_given_back(p.pid)
            assert job_sum(p) == ready["sum"], (name, i)
    j = train(steps=1_000_000, kernel_ns=1_000_000)  # runs on through the loop; stopped at the end
    wait_for_text(j.out, "step 3 ")
    full = lambda i: ["checkpoint", "--full", "--leave-running", "-p", str(j.pid), "-o", str(tmp_path / f"f{i}")]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gputrace", *full(-1)], capture_output=True, text=True, timeout=300)
    span = time.monotonic() - t0
    if r.returncode and foreign_tracer(r.stderr):
        pytest.skip(f"a uprobe tracer outside this test probed the job: {r.stderr.splitlines()[0]}")
    assert r.returncode == 0, r.stderr
    n_full = 0
    while kills < 50 or n_full < 14:
        r = _kill_after(full(n_full), rng.uniform(0, span * 1.1))
        kills += r is None
        n_full += 1
        settle(j.pid)
        check_given_back(j.pid)
        assert j.p.poll() is None
        assert not list(tmp_path.glob(f".f{n_full - 1}.partial-*"))  # the guardian cleared what was left
    j.kill()
    # The job's own lines (the shim logs what it undid to the job's stderr, which goes to the same file).
    lines = [ln for ln in j.out.read_text().splitlines(keepends=True)
             if ln.endswith("\n") and not ln.startswith("gputrace shim[")]
    assert len(lines) > 3
    ref = reference(tmp_path, len(lines)).splitlines(keepends=True)
    # Step K's line depends on K alone: every step done across the kills printed what an uninterrupted
    # run prints for it.
    assert lines == ref[:len(lines)], "a step after a kill printed what an uninterrupted run does not"
    assert kills >= 50
    print(f"{kills} kills in {36 + n_full} attempts ({n_full} of checkpoint --full); {len(lines)} steps checked")
