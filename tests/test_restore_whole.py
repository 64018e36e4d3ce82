"""Restore never breaks the job: a training loop that allocates and frees device memory every step
(simcuda's train --churn), under the shim, checkpointed whole and brought back over and over at
seeded random steps, from the CLI (`checkpoint --full --leave-running`, `restore -p PID DIR`) and
from top (c, r through Textual's pilot), goes on each time from the checkpoint's step and ends with
exactly what an uninterrupted run prints; a rollback of its device memory alone is refused, from the
CLI and from top, unless forced (the forced one is the caller's risk, and says so)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest

from gputrace import shim, simcuda
from gputrace.simcuda.device import Device

from shimtest import shim_dir  # noqa: F401  (fixture)
from test_full_checkpoint import FOREIGN_TRACER, _criu_reason, sim_env, uninterrupted, wait_exit, wait_for_text

pytestmark = pytest.mark.skipif(_criu_reason() is not None, reason=str(_criu_reason()))

STEPS = 200
KERNEL_NS = 40_000_000   # a step of two 15-ms kernels: checkpoints land mid-step as often as not
CHURN = 3                # temporary buffers allocated and freed each step
SEED = 39


def gputrace(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=300)
    if r.returncode and any(s in r.stderr for s in FOREIGN_TRACER):
        pytest.skip(f"a uprobe tracer outside this test probed the job: {r.stderr.splitlines()[0]}")
    return r


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """What an uninterrupted run prints (the kernels' duration does not change it)."""
    return uninterrupted(tmp_path_factory.mktemp("ref"), STEPS, "--vmm", "0", "--churn", str(CHURN))


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_CHILD_SUBREAPER = 36


@contextlib.contextmanager
def subreaper():
    """This process as the subreaper of what it starts: a job restored by a `gputrace restore` that has
    exited is reparented here, not to an init that may not reap it, so that its pid comes free when it
    is ended for the next restore (each is reaped by `reap`)."""
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def reap(pid: int) -> None:
    """Reaps `pid` when it ends, if it is this process's child (a thread waits for it)."""
    def wait() -> None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    threading.Thread(target=wait, daemon=True).start()


class Job:
    """train --churn under the shim, as `gputrace run --checkpointable` starts it, in its own session with its
    output on a file (what CRIU needs); its log opened for writing, not appending, as a shell's `>` does."""

    def __init__(self, root: Path, device: Device, pass_fds=(), env: dict | None = None) -> None:
        self.out = root / "job.out"
        env = {**shim.preload_env(device.env(sim_env())), **(env or {})}
        argv = simcuda.workload("train") + ["--steps", str(STEPS), "--kernel-ns", str(KERNEL_NS), "--vmm", "0",
                                            "--churn", str(CHURN)]
        with open(self.out, "w") as f:
            self.p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                      start_new_session=True, pass_fds=pass_fds)
        self.pid = self.p.pid
        reap(self.pid)  # the first process is ours: reaped when a restore ends it

    def at_step(self, k: int) -> None:
        wait_for_text(self.out, f"step {k} ")

    def steps_done(self) -> int:
        lines = [ln for ln in self.out.read_text().splitlines() if ln.startswith("step ")]
        return int(lines[-1].split()[1]) if lines else 0

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, 9)
        wait_exit(self.pid)


@pytest.fixture
def job(tmp_path, shim_dir, request):
    with Device(tmp_path / "dev") as d:
        j = Job(tmp_path, d, **getattr(request, "param", {}))
        try:
            yield j
        finally:
            j.kill()


def test_whatever_would_fail_the_restore_refuses_it_while_the_job_runs_on(tmp_path, shim_dir, reference):
    """A checkpoint of another process, a rank of a job of several, a file the job reads changed since, the wrong
    kind of restore: each is refused before the running job is touched, and it runs on to what an
    uninterrupted run prints."""
    data = tmp_path / "shard.bin"
    data.write_bytes(b"x" * 4096)
    fd = os.open(data, os.O_RDONLY)
    with Device(tmp_path / "dev") as d:
        j = Job(tmp_path, d, pass_fds=(fd,))
        os.close(fd)
        (tmp_path / "other").mkdir()
        other = Job(tmp_path / "other", d, env={"WORLD_SIZE": "2", "RANK": "1"})  # as torchrun starts a rank
        try:
            j.at_step(2)
            ck = tmp_path / "ck"
            r = gputrace("checkpoint", "--full", "--leave-running", "-p", str(j.pid), "-o", str(ck), "--json")
            assert r.returncode == 0, r.stderr
            r = gputrace("restore", "-p", str(other.pid), str(ck))
            assert r.returncode == 10 and f"not a checkpoint of the job running as process {other.pid}" in r.stderr
            assert f"taken of process {j.pid}" in r.stderr and "was not touched" in r.stderr, r.stderr
            other.at_step(1)
            ck_rank = tmp_path / "ck-rank"
            r = gputrace("checkpoint", "--full", "--leave-running", "-p", str(other.pid), "-o", str(ck_rank))
            assert r.returncode == 0, r.stderr
            r = gputrace("restore", "-p", str(other.pid), str(ck_rank))  # one rank alone: out of step with its peers
            assert r.returncode == 10 and "one rank of a job of several processes (its WORLD_SIZE is 2)" in r.stderr
            assert "--tree LAUNCHER" in r.stderr and "was not touched" in r.stderr, r.stderr
            assert other.p.poll() is None
            with open(data, "ab") as f:
                f.write(b"more")
            r = gputrace("restore", "-p", str(j.pid), str(ck))
            assert r.returncode == 10 and "Traceback" not in r.stderr, r.stderr
            assert f"{data} grew from 4096 to 4100 bytes" in r.stderr and "was not touched" in r.stderr
            r = gputrace("restore", "-p", str(j.pid), str(ck), "--device-only")
            assert r.returncode == 2 and "whole-process checkpoint" in r.stderr
            r = gputrace("restore", str(ck))
            assert r.returncode == 2 and "one -p PID" in r.stderr
            assert j.p.poll() is None  # every refusal left it running
            os.truncate(data, 4096)  # as it was: now it restores
            with subreaper():
                r = gputrace("restore", "-p", str(j.pid), str(ck), "--json")
                assert r.returncode == 0, r.stderr
                reap(j.pid)
                wait_exit(j.pid)
            assert j.out.read_text() == reference
        finally:
            j.kill()
            other.kill()


def moments(rng: random.Random, cycles: int) -> list[tuple[int, int]]:
    """Seeded moments, in steps of the job: (steps to wait before a checkpoint, steps to wait after it
    before the restore)."""
    return [(rng.randint(0, 2), rng.randint(1, 3)) for _ in range(cycles)]


def assert_prefix_of(text: str, reference: str, what: str) -> None:
    assert reference.startswith(text), f"{what} departs from an uninterrupted run: {text[-300:]!r}"


def test_cli_checkpoint_and_restore_at_random_steps_the_job_finishes_as_if_uninterrupted(job, tmp_path, reference):
    rng = random.Random(SEED)
    with subreaper():
        for i, (wait, back) in enumerate(moments(rng, 12)):
            job.at_step(max(2, job.steps_done() + wait))
            ck = tmp_path / f"ck{i}"
            r = gputrace("checkpoint", "--full", "--leave-running", "-p", str(job.pid), "-o", str(ck), "--json")
            assert r.returncode == 0, r.stderr
            took = orjson.loads(r.stdout)
            assert took["leave_running"] is True and took["freeze_ns"] > 0
            job.at_step(job.steps_done() + back)  # the job ran on from the checkpoint: at least to here
            assert "done" not in job.out.read_text(), "the job ended before it was restored: give it more steps"
            r = gputrace("restore", "-p", str(job.pid), str(ck), "--json")
            assert r.returncode == 0, r.stderr
            rep = orjson.loads(r.stdout)
            assert rep["kind"] == "replace" and rep["pid"] == job.pid and rep["host_state_restored"] is True
            assert rep["back_ns"] >= rep["criu_ns"] > 0
            reap(job.pid)  # the restored process is this one's once the restore has exited
            # The log was cut back to the checkpoint's moment (the later lines kept beside it), and each piece is
            # what an uninterrupted run printed up to there.
            (cut,) = rep["cut"]
            assert cut["path"] == str(job.out) and cut["bytes_then"] < cut["bytes_now"]
            assert_prefix_of(Path(cut["kept"]).read_text(), reference, "the log before the restore")
            assert_prefix_of(job.out.read_text(), reference, "the log after the restore")
        wait_exit(job.pid)
        assert job.out.read_text() == reference  # every step again from each checkpoint, device and host state intact
        # The job has ended: the same command brings the last checkpoint back, and it runs to the end again.
        r = gputrace("restore", "-p", str(job.pid), str(ck), "--json")
        assert r.returncode == 0, r.stderr
        rep = orjson.loads(r.stdout)
        assert rep["end_ns"] == 0 and rep["cut"][0]["path"] == str(job.out)
        reap(job.pid)
        wait_exit(job.pid)
    assert job.out.read_text() == reference


def test_a_device_only_rollback_of_a_training_loop_is_refused_unless_forced(job, tmp_path, reference):
    job.at_step(3)
    ck = tmp_path / "devck"
    r = gputrace("checkpoint", "-p", str(job.pid), "-o", str(ck))
    assert r.returncode == 0, r.stderr
    job.at_step(job.steps_done() + 1)
    r = gputrace("restore", "-p", str(job.pid), str(ck))  # device memory alone must be asked for
    assert r.returncode == 2 and "GPU-memory checkpoint" in r.stderr and "--device-only" in r.stderr, r.stderr
    assert "checkpoint --full --leave-running" in r.stderr
    r = gputrace("restore", "-p", str(job.pid), str(ck), "--device-only")
    assert r.returncode == 10 and "Traceback" not in r.stderr, r.stderr
    assert "refusing to roll back only the device memory" in r.stderr and "allocation(s)" in r.stderr
    assert "may crash or compute with stale data" in r.stderr and "--force" in r.stderr
    assert "running work" in r.stderr  # in the middle of its loop
    assert "--force" in gputrace("restore", "--help").stdout and "UNSAFE" in gputrace("restore", "--help").stdout
    job.at_step(job.steps_done() + 2)
    assert_prefix_of(job.out.read_text(), reference, "the job after the refusals")  # untouched: it runs on right
    r = gputrace("restore", "-p", str(job.pid), str(ck), "--device-only", "--force", "--json")
    assert r.returncode == 0, r.stderr
    assert orjson.loads(r.stdout)["checked"] is False  # done, unchecked: what happens to the job now is the caller's


# --- the same from top ------------------------------------------------------------------------------------------

async def test_top_checkpoints_and_restores_at_random_steps_and_refuses_a_device_only_rollback(job, tmp_path,
                                                                                             reference):
    from textual.pilot import Pilot

    from gputrace.hostview.checkpoints import CheckpointerAdapter
    from gputrace.tui.app import TopApp
    from gputrace.tui.screens.dialogs import ConfirmScreen, RestoreScreen

    async def until(pilot: Pilot, cond, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, (f"top never got there in {timeout_s:.0f} s; its results: "
                                                 f"{app.last_results[-3:]}; the job's log ends: "
                                                 f"{job.out.read_text()[-300:]!r}")
            await pilot.pause(0.05)

    rng = random.Random(SEED + 1)
    from topdata import OneJob

    app = TopApp(OneJob(job.pid, "train"), CheckpointerAdapter(root=tmp_path / "cks"))
    async with app.run_test(size=(160, 30)) as pilot:
        await until(pilot, lambda: app.frame is not None)
        for wait, back in moments(rng, 8):
            job.at_step(max(2, job.steps_done() + wait))
            n = len(app.last_results)
            await pilot.press("c")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await until(pilot, lambda: len(app.last_results) > n)
            done = app.last_results[-1]
            if any(f in getattr(done, "error", "") for f in FOREIGN_TRACER):
                pytest.skip(f"a uprobe tracer outside this test probed the job: {done.error}")
            assert getattr(done, "action", None) == "checkpoint_full" and not hasattr(done, "error"), done
            assert done.freeze_s > 0, done
            job.at_step(job.steps_done() + back)
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, RestoreScreen))
            await pilot.press("enter")  # the newest first: the one just taken
            assert isinstance(app.screen, ConfirmScreen) and "running process is ended" in app.screen.question
            await pilot.press("y")
            await until(pilot, lambda: len(app.last_results) > n + 1)
            back_res = app.last_results[-1]
            assert getattr(back_res, "action", None) == "restore_full", back_res
            assert back_res.back_s > 0 and done.checkpoint.id in back_res.message
            assert_prefix_of(job.out.read_text(), reference, "the log after the restore")
        # A device-only rollback of the same loop: its own key, asked with the consequence, refused.
        n = len(app.last_results)
        await pilot.press("C", "y")
        await until(pilot, lambda: len(app.last_results) > n)
        took = app.last_results[-1]  # (a plan overtaken by the churn's allocations is tried again, not "busy")
        assert getattr(took, "action", None) == "checkpoint" and not hasattr(took, "error"), took
        job.at_step(job.steps_done() + 1)
        await pilot.press("R")
        await until(pilot, lambda: isinstance(app.screen, RestoreScreen))
        await pilot.press("enter")
        assert "may crash or compute with stale data" in app.screen.question
        await pilot.press("y")
        await until(pilot, lambda: len(app.last_results) > n + 1)
        refused = app.last_results[-1]
        assert refused.action == "rollback" and "refusing to roll back only the device memory" in refused.error
        assert "c, then r" in refused.hint
        await pilot.press("q")
    wait_exit(job.pid)
    assert job.out.read_text() == reference
