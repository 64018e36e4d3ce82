"""Whole-job checkpoint (checkpointer/fulljob.py) with real CRIU on simcuda in device mode: a
`collective` job (a launcher and 2 or 4 ranks under the shim, an allreduce a step) checkpointed whole
with `checkpoint --full --tree`, killed, restored, its sums equal to an uninterrupted run's; the shim's
fast path of suspendable ranks; --leave-running with the tree named by -p; a rank killed mid-operation,
a rank that stops answering past the bound and gputrace itself killed each leave every rank running
and ungated; pids that are not one tree refused; a rank whose GPU state the driver cannot restore named,
the restored job ended and the checkpoint still good."""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from gputrace import shim, simcuda
from gputrace.base.procs import alive, wait_exit
from gputrace.checkpointer import driver, guardian, hold
from gputrace.shim import client
from gputrace.simcuda.device import Device

from shimtest import procs, shim_dir  # noqa: F401  (fixtures)
from test_full_checkpoint import FOREIGN_TRACER, _criu_reason, sim_env
from test_gang import reference, run_stopped_at

pytestmark = pytest.mark.skipif(_criu_reason() is not None, reason=str(_criu_reason()))

WAIT_S = 120  # the most any awaited event may take on a loaded 2-core machine
_libc = ctypes.CDLL(None, use_errno=True)
IN_MODIFY = 0x2


class TreeJob:
    """A `collective` job started the way CRIU needs (its own session, stdio on a file), every rank
    under the shim, device memory in the simcuda-device daemon: its launcher, its ranks, their lines."""

    def __init__(self, root: Path, device: Device, ranks: int, *, suspendable: bool = False, pass_fds=()) -> None:
        self.out = root / "job.out"
        env = shim.preload_env(device.env(sim_env()))
        if suspendable:  # as `gputrace run --checkpointable --suspendable` starts it
            env["GPUTRACE_SHIM_VMM"] = "1"
        # Steps enough never to end during a test; each one's sum depends only on the ranks' memory before it.
        argv = simcuda.workload("collective") + ["--ranks", str(ranks), "--words", "256", "--steps", "1000000",
                                                  "--kernel-ns", "5000000"]
        with open(self.out, "w") as f:
            self.p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                      start_new_session=True, pass_fds=pass_fds)
        head = self.wait(lambda: self._head(), "the launcher's first line")
        self.launcher, self.ranks = head["launcher"], head["ranks"]

    def _records(self) -> list[dict]:
        text = self.out.read_text()
        return [json.loads(ln) for ln in text[:text.rfind("\n") + 1].splitlines()]  # a last line cut short: not yet

    def _head(self) -> dict | None:
        return next((x for x in self._records() if "launcher" in x), None)

    def lines(self) -> list[dict]:
        return [x for x in self._records() if "rank" in x]

    def wait(self, pred, what: str):
        """Waits (inotify on the job's output) until pred() is true; returns what it returned."""
        fd = _libc.inotify_init1(os.O_CLOEXEC)
        assert fd >= 0
        try:
            assert _libc.inotify_add_watch(fd, str(self.out).encode(), IN_MODIFY) >= 0
            while True:
                got = pred()
                if got:
                    return got
                ready, _, _ = select.select([fd], [], [], WAIT_S)
                assert ready, f"{what}: not within {WAIT_S} s; the job wrote: {self.out.read_text()[-600:]!r}"
                os.read(fd, 4096)
        finally:
            os.close(fd)

    def steps(self, rank: int) -> list[int]:
        return [x["step"] for x in self.lines() if x["rank"] == rank]

    def last(self) -> int:
        """The step every rank has printed."""
        return min(max(self.steps(i), default=0) for i in range(len(self.ranks)))

    def wait_steps(self, k: int, what: str = "every rank at step k") -> None:
        self.wait(lambda: self.last() >= k, f"{what} ({k})")

    def pids(self) -> str:
        return ",".join(map(str, self.ranks))

    def kill(self) -> None:
        for pid in [self.launcher, *self.ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.p.poll() is None:
            self.p.wait(timeout=60)
        for pid in [self.launcher, *self.ranks]:
            wait_exit(pid, 60)
        try:  # the group's file, which a killed launcher leaves behind
            os.unlink(f"/dev/shm/simcuda-group-{self.launcher}")
        except FileNotFoundError:
            pass


@pytest.fixture
def device(tmp_path):
    with Device(tmp_path / "dev") as d:
        yield d


@pytest.fixture
def job(tmp_path, device, shim_dir):  # noqa: F811
    made: list[TreeJob] = []

    def make(ranks: int, **kw) -> TreeJob:
        j = TreeJob(tmp_path, device, ranks, **kw)
        made.append(j)
        return j

    yield make
    for j in made:
        j.kill()


def gputrace(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=600)
    if r.returncode and any(s in r.stderr for s in FOREIGN_TRACER):
        # Another session's tracer (`gputrace top` attaches to every CUDA process) put its traces in the
        # job, which CRIU cannot carry: no failure of the code under test, and a serial CI run has none.
        pytest.skip(f"a uprobe tracer outside this test probed the job: {r.stderr.splitlines()[0]}")
    return r


def state(pid: int) -> str:
    return driver.Driver(pid).state()


def state_of(pid: int) -> str:
    """The process's scheduler state letter (/proc/PID/stat)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def all_stopped(pid: int) -> None:
    """Until every thread of `pid` has stopped: a SIGSTOP reaches each thread on its way back to user
    space, moments after kill() returns, and a stop of another process reports no event to wait for."""
    deadline = time.monotonic() + WAIT_S
    while any(hold.thread_state(pid, t) not in ("T", "") for t in hold.threads(pid)):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.002)


def given_back(pids: list[int]) -> None:
    """Each process running in the driver, its gate open, nothing suspended."""
    for p in pids:
        st = client.status(p)
        assert (state(p), st["paused"], bool(st.get("suspended"))) == ("running", False, False), (p, st)


def assert_like_uninterrupted(j: TreeJob) -> None:
    """Every rank printed every step once, in order, with the sum an uninterrupted job has there."""
    lines = j.lines()
    for i in range(len(j.ranks)):
        s = j.steps(i)
        assert s == list(range(1, len(s) + 1)), (i, s)
    ref = reference(len(j.ranks), max(x["step"] for x in lines))
    wrong = [x for x in lines if ref[x["step"]] != x["sum"]]
    assert not wrong, f"{len(wrong)} of {len(lines)} steps differ from an uninterrupted run: {wrong[:4]}"


def no_leftovers(tmp_path: Path, name: str) -> None:
    assert not (tmp_path / name).exists() and not list(tmp_path.glob(f".{name}.partial-*"))


# --- the tests --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks,suspendable", [(2, False), (4, False), (2, True)],
                         ids=["2-ranks", "4-ranks", "2-ranks-suspendable"])
def test_a_job_checkpointed_whole_killed_and_restored_goes_on_like_an_uninterrupted_run(job, device, tmp_path, ranks,
                                                                                         suspendable, monkeypatch):
    j = job(ranks, suspendable=suspendable)
    j.wait_steps(3)
    held = len(device.files())
    assert held > 0
    ck = tmp_path / "ck"
    r = gputrace("checkpoint", "--full", "--tree", str(j.launcher), "-o", str(ck), "--json")
    assert r.returncode == 0, r.stderr
    doc = orjson.loads(r.stdout)  # one document for the job
    assert doc["job"] and doc["kind"] == "full-job" and doc["root"] == j.launcher and doc["pids"] == j.ranks
    assert doc["processes"] == [j.launcher, *j.ranks] and doc["leave_running"] is False
    assert doc["aligned"] and doc["collectives"] >= 3
    assert doc["freeze_ns"] >= doc["dump_ns"] > 0 and doc["freeze_ns"] >= doc["quiesce_ns"] > 0
    assert [x["pid"] for x in doc["ranks"]] == j.ranks
    assert all(x["lock_ns"] > 0 and x["checkpoint_ns"] > 0 for x in doc["ranks"])
    if suspendable:  # each rank's three allocations copied by its shim, into the directory
        assert all(x["shim"]["allocations"] == 3 and x["shim"]["staged"] for x in doc["ranks"]), doc["ranks"]
        assert all((ck / f"gpu-{i}.img").stat().st_size > 0 for i in range(ranks))
    else:
        assert all(x["shim"] is None for x in doc["ranks"])
    assert j.p.wait(timeout=60) == -signal.SIGKILL  # the job ended once its state was safe
    assert all(wait_exit(p, WAIT_S) for p in j.ranks)
    assert device.files() == []  # every rank's device memory went with it, as on a GPU
    m = orjson.loads((ck / "manifest.json").read_bytes())
    assert m["format"] == "gputrace-full-job-checkpoint" and m["complete"] is True
    assert [x["pid"] for x in m["ranks"]] == j.ranks and [x["pid"] for x in m["processes"]] == doc["processes"]
    assert {f["path"] for f in m["files"]} == {str(p.relative_to(ck)) for p in ck.rglob("*")
                                               if p.is_file() and p.name != "manifest.json"}
    assert not list(tmp_path.glob(".ck.partial-*"))
    # Every rank was stopped just after launching allreduce c: each had printed step c - 1, no more.
    c = doc["collectives"]
    assert all(max(j.steps(i)) == c - 1 for i in range(ranks)), (c, [j.steps(i)[-3:] for i in range(ranks)])

    if ranks == 2 and not suspendable:
        # The driver fails to restore rank 1's GPU state: the error names it, the restored tree is ended
        # (every pid free for the next try), and the checkpoint restores as ever afterwards.
        from gputrace.base.errors import CheckpointError
        from gputrace.checkpointer import driverapi, fulljob

        call = driverapi.Driver.call

        def failing(self, name: str, timeout_ms: int = 0) -> int:
            if name == "Restore" and self.pid == j.ranks[1]:
                raise CheckpointError(f"cuCheckpointProcessRestore on process {self.pid} failed: CUresult 999", "")
            return call(self, name, timeout_ms)

        monkeypatch.setattr(driverapi.Driver, "call", failing)
        size = j.out.stat().st_size
        with pytest.raises(CheckpointError) as e:
            fulljob.restore_job(ck)
        # Rank 0, its GPU state back, was ended still held: it wrote nothing, so the files are as CRIU
        # needs them for the next try.
        assert j.out.stat().st_size == size
        assert f"rank 1 (pid {j.ranks[1]})" in e.value.msg and "the restored job was ended" in e.value.msg
        assert "--gpu-map" in e.value.hint and f"gputrace restore --full {ck}" in e.value.hint
        assert not any(os.path.exists(f"/proc/{p}") for p in doc["processes"])
        monkeypatch.setattr(driverapi.Driver, "call", call)

    if suspendable:  # the text report: a line per rank
        r = gputrace("restore", "--full", str(ck))
        assert r.returncode == 0, r.stderr
        assert f"restored the job of {ranks + 1} process(es)" in r.stdout and "it is running" in r.stdout
        assert all(f"rank {i}  pid {p}: driver restore" in r.stdout for i, p in enumerate(j.ranks)), r.stdout
        assert ", shim " in r.stdout
    else:  # every rank restored with the same GPU map (simcuda has GPU 0 alone)
        if ranks == 4:
            r = gputrace("restore", "--full", str(ck), "--gpu-map", "0=7")
            assert r.returncode == 10 and "there is no GPU 7" in r.stderr and "Traceback" not in r.stderr, r.stderr
            assert not any(alive(p) for p in doc["processes"])  # refused before CRIU ran
        r = gputrace("restore", "--full", str(ck), "--json", *(["--gpu-map", "0=0"] if ranks == 4 else []))
        assert r.returncode == 0, r.stderr
        back = orjson.loads(r.stdout)
        assert back["job"] and back["kind"] == "full-job" and back["pids"] == j.ranks and back["criu_ns"] > 0
        assert [x["pid"] for x in back["ranks"]] == j.ranks and all(x["shim_ns"] == 0 for x in back["ranks"])
    given_back(j.ranks)
    assert len(device.files()) == held  # new device memory, as much as before
    j.wait_steps(c + 5, "the restored job runs on")
    assert_like_uninterrupted(j)
    assert all(j.steps(i).count(c) == 1 for i in range(ranks))  # step c printed once: after the restore


def test_leave_running_with_the_tree_named_by_pids(job, device, tmp_path):
    j = job(2)
    j.wait_steps(3)
    ck = tmp_path / "ck"
    r = gputrace("checkpoint", "--full", "-p", f"{j.launcher},{j.pids()}", "-o", str(ck), "--leave-running")
    assert r.returncode == 0, r.stderr
    assert f"tree of pid {j.launcher}" in r.stdout and "rank 1" in r.stdout and "runs on" in r.stdout
    given_back(j.ranks)
    assert j.p.poll() is None
    n = j.last()
    j.wait_steps(n + 3, "the job runs on")
    assert_like_uninterrupted(j)
    assert orjson.loads((ck / "manifest.json").read_bytes())["leave_running"] is True
    r = gputrace("restore", "--full", str(ck))  # the job still runs at those pids
    assert r.returncode == 10 and "is in use" in r.stderr and "hint:" in r.stderr and "Traceback" not in r.stderr
    j.wait_steps(n + 5, "the job runs on, untouched")
    given_back(j.ranks)


def test_a_rank_killed_mid_checkpoint_leaves_the_others_running_and_ungated(job, device, tmp_path):
    j = job(3)
    j.wait_steps(2)
    victim = j.ranks[1]
    p = run_stopped_at("full-job:locked", ["checkpoint", "--full", "--tree", str(j.launcher), "-o",
                                           str(tmp_path / "ck"), "--timeout", "120"])
    try:
        # Every rank stopped together, then locked in the driver; the gates still closed.
        assert [state(x) for x in j.ranks] == ["locked"] * 3
        assert all(client.status(x)["paused"] for x in j.ranks)
        os.kill(victim, signal.SIGKILL)
        assert wait_exit(victim, WAIT_S)
        os.kill(p.pid, signal.SIGCONT)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 10, err
    assert f"rank 1 (pid {victim}) exited during the checkpoint --full" in err and "hint: " in err, err
    assert "Traceback" not in err and not out
    no_leftovers(tmp_path, "ck")
    # The others unlocked and ungated: they run, and wait in their next allreduce for the rank that is
    # gone, as NCCL's ranks would.
    given_back([x for x in j.ranks if x != victim])
    assert alive(j.launcher)


def test_a_rank_that_stops_answering_runs_past_the_bound_and_every_rank_is_given_back(job, device, tmp_path):
    j = job(2)
    j.wait_steps(2)
    stuck = j.ranks[1]
    p = run_stopped_at("full-job:locked", ["checkpoint", "--full", "--tree", str(j.launcher), "-o",
                                           str(tmp_path / "ck"), "--timeout", "8"])
    os.kill(stuck, signal.SIGSTOP)  # its driver answers nothing more: the checkpoint cannot end
    try:
        all_stopped(stuck)
        os.kill(p.pid, signal.SIGCONT)
        assert p.wait(timeout=300) == 10
        given_back([j.ranks[0]])  # rank 0 at once; rank 1 cannot answer while it is stopped
        no_leftovers(tmp_path, "ck")
    finally:
        os.kill(stuck, signal.SIGCONT)
        if p.poll() is None:
            p.kill()
            p.wait()
    # Its guardian, which was handed rank 1, holds gputrace's stderr until it has given the rank back.
    out, err = p.communicate(timeout=300)
    assert f"ran past its bound of 8 s at rank 1 (pid {stuck}): cuCheckpointProcessCheckpoint did not return" \
        in err, err
    assert "a guardian gives it back" in err and "hint: " in err and "Traceback" not in err, err
    assert guardian.settle(stuck, WAIT_S), "rank 1's guardian did not finish"
    given_back(j.ranks)
    n = j.last()
    j.wait_steps(n + 3, "both ranks run on")
    assert_like_uninterrupted(j)


def test_a_failed_dump_gives_every_rank_back_running_and_keeps_criu_s_log(job, device, tmp_path):
    # Every process of the tree holds one end of a socket pair whose other end stays here, outside the
    # tree: CRIU refuses to dump it, as it would a GPU descriptor the driver did not release.
    mine, theirs = socket.socketpair()
    j = job(2, suspendable=True, pass_fds=(theirs.fileno(),))
    theirs.close()
    j.wait_steps(2)
    r = gputrace("checkpoint", "--full", "--tree", str(j.launcher), "-o", str(tmp_path / "ck"))
    assert r.returncode == 10, r.stderr
    assert f"criu dump of process {j.launcher} failed" in r.stderr and "External socket" in r.stderr, r.stderr
    assert "every rank is running again" in r.stderr and "Traceback" not in r.stderr
    log = Path(r.stderr.split("(log: ", 1)[1].split(")", 1)[0])  # kept out of the directory that went
    assert log.name == "dump.log" and "External socket" in log.read_text()
    shutil.rmtree(log.parent)
    no_leftovers(tmp_path, "ck")
    assert all(state_of(x) != "T" for x in [j.launcher, *j.ranks])
    given_back(j.ranks)  # continued, unlocked, unsuspended by their shims, gates open
    n = j.last()
    j.wait_steps(n + 3, "both ranks run on")
    assert_like_uninterrupted(j)
    mine.close()


def test_gputrace_killed_after_the_dump_leaves_every_rank_running(job, device, tmp_path):
    """Killed with every rank suspended by its shim, checkpointed in the driver and the tree stopped by
    CRIU: each process's guardian continues it, restores and unlocks it, and its shim unsuspends it."""
    j = job(2, suspendable=True)
    j.wait_steps(2)
    p = run_stopped_at("full-job:dumped", ["checkpoint", "--full", "--tree", str(j.launcher), "-o",
                                           str(tmp_path / "ck")])
    try:
        # Left stopped by CRIU: it detaches with a SIGSTOP each process takes moments later (under
        # load, a rank read 'R' just after the dump), so until each has stopped, within the bound.
        for x in [j.launcher, *j.ranks]:
            all_stopped(x)
        assert [state_of(x) for x in [j.launcher, *j.ranks]] == ["T"] * 3
    finally:  # a failure above must not leave the stopped gputrace and its guardians behind
        p.kill()
        p.wait()
    for x in [j.launcher, *j.ranks]:
        assert guardian.settle(x, WAIT_S), f"the guardian of {x} did not finish"
    given_back(j.ranks)
    no_leftovers(tmp_path, "ck")
    n = j.last()
    j.wait_steps(n + 3, "both ranks run on")
    assert_like_uninterrupted(j)


def test_pids_that_are_not_one_tree_are_refused(job, device, tmp_path, procs):  # noqa: F811
    j = job(2)
    j.wait_steps(1)
    r = gputrace("checkpoint", "--full", "-p", j.pids(), "-o", str(tmp_path / "x"))  # the ranks, not their launcher
    assert r.returncode == 2 and "are not one process tree" in r.stderr, r.stderr
    assert f"gputrace checkpoint --full --tree {j.launcher}" in r.stderr  # the hint names the root to give
    r = gputrace("checkpoint", "--full", "-p", f"{j.launcher},{j.ranks[0]}", "-o", str(tmp_path / "x"))
    assert r.returncode == 2 and f"{j.ranks[1]} of the tree of {j.launcher} run the shim and were not given" \
        in r.stderr and f"--tree {j.launcher}" in r.stderr, r.stderr
    other = subprocess.Popen(["sleep", "600"])
    procs.append(other)
    r = gputrace("checkpoint", "--full", "--tree", str(j.launcher), "-p", str(other.pid), "-o", str(tmp_path / "x"))
    assert r.returncode == 2 and f"{other.pid} are not in the tree of {j.launcher}" in r.stderr, r.stderr
    plain = subprocess.Popen(simcuda.workload("collective") + ["--ranks", "2"], env=sim_env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs.append(plain)
    plain_head = json.loads(plain.stdout.readline())
    r = gputrace("checkpoint", "--full", "--tree", str(plain_head["launcher"]))
    assert r.returncode == 8 and "no process in the tree" in r.stderr and "hint:" in r.stderr, r.stderr
    plain.stdin.write("quit\n")
    plain.stdin.flush()
    assert plain.wait(timeout=WAIT_S) == 0
    assert not (tmp_path / "x").exists()
    given_back(j.ranks)
    r = gputrace("checkpoint", "--help")
    assert "--full --tree 1200" in r.stdout and "--gpu-map 0=1,1=0" in r.stdout
