"""Jobs of several processes (checkpointer/gang.py): a `collective` workload of 2 and 4 ranks, each
doing a step of compute and one allreduce per step on the simulated driver, checkpointed, restored,
suspended and resumed as one; a rank frozen alone holds its peers; a rank lost or a bound passed
gives every rank back running."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import orjson
import pytest

from gputrace import shim, simcuda
from gputrace.base.procs import wait_exit
from gputrace.shim import client

from shimtest import procs, shim_dir  # noqa: F401  (fixtures)

WAIT_S = 60  # the most any awaited event may take on a loaded 2-core machine


class Job:
    """A running `collective` job: its launcher, its ranks' pids, and every line its ranks print."""

    def __init__(self, procs, ranks: int, *, suspendable: bool = False, steps: int = 0, shimmed: bool = True) -> None:
        env = simcuda.env()
        if suspendable:
            env["GPUTRACE_SHIM_VMM"] = "1"
        argv = simcuda.workload("collective") + ["--ranks", str(ranks), "--words", "256"]
        if steps:
            argv += ["--steps", str(steps)]
        self.p = subprocess.Popen(argv, env=shim.preload_env(env) if shimmed else env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(self.p)
        head = json.loads(self.p.stdout.readline())
        self.launcher, self.ranks = head["launcher"], head["ranks"]
        self.lines: list[dict] = []
        self.cv = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                line = self.p.stdout.readline()
            except ValueError:  # closed under the loop (the fixture's clean-up, after the test)
                break
            if not line:
                break
            with self.cv:
                self.lines.append(json.loads(line))
                self.cv.notify_all()
        with self.cv:
            self.cv.notify_all()

    def wait(self, pred, what: str) -> None:
        with self.cv:
            ok = self.cv.wait_for(lambda: pred(self.lines) or self.p.poll() is not None, timeout=WAIT_S)
            assert ok and pred(self.lines), f"{what}: not within {WAIT_S} s; lines: {self.lines[-8:]}"

    def steps(self, rank: int, lines: list[dict] | None = None) -> list[int]:
        if lines is None:
            with self.cv:
                lines = list(self.lines)
        return [x["step"] for x in lines if x["rank"] == rank]

    def wait_all_past(self, step: int, what: str) -> None:
        self.wait(lambda ls: all(any(x["rank"] == r and x["step"] >= step for x in ls) for r in range(len(self.ranks))),
                  what)

    def pids(self) -> str:
        return ",".join(map(str, self.ranks))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(timeout=WAIT_S)
        self.reader.join(timeout=WAIT_S)

    def kill_ranks(self) -> None:
        for pid in self.ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def job(procs, shim_dir):
    made: list[Job] = []

    def make(ranks: int, **kw) -> Job:
        j = Job(procs, ranks, **kw)
        made.append(j)
        return j

    yield make
    for j in made:  # the launcher is killed by `procs`; its ranks by pid here, whatever state they are in
        j.kill_ranks()
        try:  # the group's file, which a launcher killed leaves behind
            os.unlink(f"/dev/shm/simcuda-group-{j.launcher}")
        except FileNotFoundError:
            pass


@functools.cache
def reference(ranks: int, steps: int) -> dict[int, str]:
    """step -> sum of an uninterrupted job, without the shim; every rank agrees on each step."""
    argv = simcuda.workload("collective") + ["--ranks", str(ranks), "--words", "256", "--steps", str(steps)]
    r = subprocess.run(argv, env=simcuda.env(), capture_output=True, text=True, timeout=WAIT_S, stdin=subprocess.PIPE)
    assert r.returncode == 0, r.stderr
    out: dict[int, str] = {}
    for line in r.stdout.splitlines()[1:]:
        x = json.loads(line)
        assert out.setdefault(x["step"], x["sum"]) == x["sum"], "ranks disagree in an uninterrupted run"
    assert sorted(out) == list(range(1, steps + 1))
    return out


def assert_like_uninterrupted(j: Job) -> None:
    """Every step every rank printed has the sum an uninterrupted job has at that step."""
    with j.cv:
        lines = list(j.lines)
    ref = reference(len(j.ranks), max(x["step"] for x in lines))
    wrong = [x for x in lines if ref[x["step"]] != x["sum"]]
    assert not wrong, f"{len(wrong)} of {len(lines)} steps differ from an uninterrupted run: {wrong[:4]}"


def gputrace(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=timeout)


def gates(j: Job) -> list[bool]:
    """Whether each rank's gate is open."""
    return [client.status(p)["paused"] is False for p in j.ranks]


# ---------------------------------------------------------------------------------------------------------------


def test_freezing_one_rank_alone_holds_its_peers_and_their_checkpoint_times_out(job):
    """The bug a gang freeze fixes: with rank 0 stopped (a pause held, as a per-process checkpoint
    stopping the ranks one after the other would), rank 1 waits inside its copy back for an
    allreduce rank 0 never launches, so its own checkpoint cannot drain and gives up at its timeout."""
    j = job(2)
    j.wait_all_past(2, "both ranks running")
    with client.Connection(j.ranks[0]) as c0:
        assert c0.pause(5000)["ok"]
        failure = None
        for _ in range(20):  # rank 1 finishes at most the step in progress, then waits for good
            with client.Connection(j.ranks[1]) as c1:
                deadline = time.monotonic() + WAIT_S
                while c1.status()["in_flight"] == 0:  # inside a gated call: its copy back, or a launch
                    assert time.monotonic() < deadline, "rank 1 never got inside a call"
            r = gputrace("checkpoint", "-p", str(j.ranks[1]), "--timeout-ms", "300", "-o", f"/tmp/never-{os.getpid()}")
            if r.returncode:
                failure = r
                break
        assert failure is not None, "rank 1 checkpointed while its peer was frozen: no deadlock to show"
        assert failure.returncode == 10, failure.stderr
        # Caught inside its copy back, or just after a launch with the allreduce in flight: either way
        # the freeze gives up at its timeout instead of holding rank 1 (and its control thread) for good.
        assert ("calls still in flight" in failure.stderr or "work on the device still running" in failure.stderr) \
            and "the gate is open again" in failure.stderr, failure.stderr
        assert not os.path.exists(f"/tmp/never-{os.getpid()}")
        n = len(j.lines)
        assert client.status(j.ranks[1])["paused"] is False  # given back, but held by rank 0
        assert c0.resume()["ok"]
    j.wait(lambda ls: len(ls) >= n + 4, "the job goes on once rank 0 is let go")
    assert_like_uninterrupted(j)


@pytest.mark.parametrize("ranks", [2, 4])
def test_gang_checkpoint_then_restore_gives_an_uninterrupted_runs_results(job, tmp_path, ranks):
    j = job(ranks)
    j.wait_all_past(3, "every rank running")
    out = tmp_path / "ckpt"
    r = gputrace("checkpoint", "-p", j.pids(), "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    doc = orjson.loads(r.stdout)  # one document for the job
    c = doc["collectives"]
    assert doc["job"] and doc["action"] == "checkpoint" and doc["aligned"] and c >= 3
    assert [x["pid"] for x in doc["ranks"]] == j.ranks and all(x["bytes"] == 256 * 4 + 4 + 8 for x in doc["ranks"])
    # Each rank's copy was prepared (its image pinned, the digest kernel loaded) before any gate closed.
    assert all(x["staged"] is True for x in doc["ranks"])
    assert all(gates(j))
    job_manifest = orjson.loads((out / "job.json").read_bytes())
    assert job_manifest["complete"] and job_manifest["collectives"] == c
    assert sorted(p.name for p in out.iterdir()) == ["job.json"] + [f"rank-{i}" for i in range(ranks)]
    # Every rank was stopped just after launching allreduce c: each printed step c after the checkpoint.
    j.wait_all_past(c + 3, "the job runs on past the checkpoint")

    r = gputrace("restore", str(out), "--device-only", "--force", "--json")
    assert r.returncode == 0, r.stderr
    doc = orjson.loads(r.stdout)
    assert doc["job"] and doc["action"] == "restore" and doc["aligned"] and doc["collectives"] >= c + 3
    assert all(x["staged"] is True for x in doc["ranks"])
    assert not doc["host_state_restored"]
    # Rolled back: every rank prints step c a second time (the cut was just after its allreduce c, both
    # times), then goes on as an uninterrupted job would.
    j.wait(lambda ls: all(j.steps(i, ls).count(c + 2) == 2 for i in range(ranks)), "every rank back at step c")
    assert all(gates(j))
    for i in range(ranks):
        s = j.steps(i)
        assert s.count(c) == 2 and s.count(c - 1) == 1, (c, s)
    assert_like_uninterrupted(j)
    j.stop()
    assert j.p.returncode == 0


@pytest.mark.parametrize("ranks", [2, 4])
def test_gang_suspend_frees_every_ranks_memory_and_resume_brings_it_back(job, ranks):
    j = job(ranks, suspendable=True)
    j.wait_all_past(3, "every rank running")
    r = gputrace("suspend", "-p", j.pids(), "--json")
    assert r.returncode == 0, r.stderr
    doc = orjson.loads(r.stdout)
    assert doc["action"] == "suspend" and doc["aligned"] and len(doc["ranks"]) == ranks
    sts = [client.status(p) for p in j.ranks]
    assert all(st["suspended"] and st["paused"] for st in sts)
    assert all(a["suspended"] for st in sts for a in st["allocations"] if a["kind"] == "device")
    assert all(x["reserved_bytes"] > 0 for x in doc["ranks"])
    n = len(j.lines)
    # Suspended, nothing runs: each rank is held at its gate (a status answers, a step does not).
    assert [client.status(p)["collectives"] for p in j.ranks] == [doc["collectives"]] * ranks
    r = gputrace("resume", "--tree", str(j.launcher), "--json")
    assert r.returncode == 0, r.stderr
    assert orjson.loads(r.stdout)["action"] == "resume"
    sts = [client.status(p) for p in j.ranks]
    assert not any(st["suspended"] or st["paused"] for st in sts)
    assert not any(a["suspended"] for st in sts for a in st["allocations"] if a["kind"] == "device")
    j.wait(lambda ls: len(ls) >= n + 3 * ranks, "the job runs on after resume")
    for i in range(ranks):  # memory kept exactly: every rank's steps go on one by one
        s = j.steps(i)
        assert s == list(range(1, len(s) + 1)), s
    assert_like_uninterrupted(j)


def run_stopped_at(point: str, argv: list[str]) -> subprocess.Popen:
    """gputrace ARGV started with GPUTRACE_STOP_AT=point, once it has stopped itself there."""
    p = subprocess.Popen([sys.executable, "-m", "gputrace", *argv], env={**os.environ, "GPUTRACE_STOP_AT": point},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    info = os.waitid(os.P_PID, p.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)  # the event: it stopping itself
    assert info.si_code == os.CLD_STOPPED, (point, p.communicate())
    return p


def test_a_rank_killed_mid_checkpoint_leaves_the_others_running_and_ungated(job, tmp_path):
    j = job(4)
    j.wait_all_past(2, "every rank running")
    victim = j.ranks[2]
    p = run_stopped_at("gang:quiesced", ["checkpoint", "-p", j.pids(), "-o", str(tmp_path / "c"), "--timeout", "60"])
    try:
        assert not any(gates(j))  # every rank stopped and drained, the copy next
        os.kill(victim, signal.SIGKILL)
        assert wait_exit(victim, WAIT_S)
        os.kill(p.pid, signal.SIGCONT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 10, err
    assert f"rank 2 (pid {victim}) exited" in err and "hint: " in err, err
    assert not (tmp_path / "c").exists() and not list(tmp_path.glob(".c.partial-*"))
    others = [x for x in j.ranks if x != victim]
    # Ungated: they run, and wait in their next allreduce for the rank that is gone, as NCCL's ranks would.
    assert [client.status(x)["paused"] for x in others] == [False] * 3


def test_gputrace_killed_mid_gang_leaves_every_rank_running(job, tmp_path):
    j = job(2)
    j.wait_all_past(2, "both ranks running")
    p = run_stopped_at("gang:closed", ["suspend", "-p", j.pids()])
    assert not any(gates(j))
    p.kill()
    p.wait()
    n = len(j.lines)
    j.wait(lambda ls: len(ls) >= n + 4, "the job runs on: each shim reopened its gate as the connection closed")
    assert all(gates(j)) and not any(client.status(x)["suspended"] for x in j.ranks)


def test_a_rank_held_elsewhere_fails_the_gang_and_every_rank_is_given_back_running(job, tmp_path):
    j = job(2)
    j.wait_all_past(2, "both ranks running")
    # Rank 1 held elsewhere at its gate: the gang cannot stop it.
    with client.Connection(j.ranks[1]) as c1:
        assert c1.pause(5000)["ok"]
        r = gputrace("checkpoint", "-p", j.pids(), "-o", str(tmp_path / "c"), "--timeout", "1", "--json")
        assert r.returncode == 10, (r.stdout, r.stderr)
        assert "rank 1" in r.stderr and not r.stdout
        assert client.status(j.ranks[0])["paused"] is False
        assert c1.resume()["ok"]
    j.wait(lambda ls: len(ls) >= 2 * 4, "both ranks running")
    # Now that nothing holds rank 1, a bound of 1 s is plenty: the gang times out only for cause.
    n = len(j.lines)
    r = gputrace("checkpoint", "-p", j.pids(), "-o", str(tmp_path / "c"), "--timeout", "1")
    assert r.returncode == 0, r.stderr
    assert "rank 0" in r.stdout and "rank 1" in r.stdout
    assert all(gates(j))
    j.wait(lambda ls: len(ls) >= n + 4, "the job runs on")
    assert not list(tmp_path.glob(".c.partial-*"))


def test_a_rank_that_stops_answering_runs_the_gang_past_its_bound_and_every_rank_is_given_back(job, tmp_path):
    j = job(2)
    j.wait_all_past(2, "both ranks running")
    p = run_stopped_at("gang:closed", ["checkpoint", "-p", j.pids(), "-o", str(tmp_path / "c"), "--timeout", "1"])
    os.kill(j.ranks[1], signal.SIGSTOP)  # its shim answers nothing more: the advance cannot end
    try:
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGCONT)
        out, err = p.communicate(timeout=120)
        took = time.monotonic() - t0
        assert p.returncode == 10 and f"rank 1 (pid {j.ranks[1]})" in err and "did not answer" in err, err
        assert took < 1 + 5 + 5  # the bound, the grace for a reply, and giving back
        assert client.status(j.ranks[0])["paused"] is False
    finally:
        os.kill(j.ranks[1], signal.SIGCONT)
        if p.poll() is None:
            p.kill()
            p.wait()
    n = len(j.lines)
    j.wait(lambda ls: len(ls) >= n + 4, "both run on: rank 1's shim reopened its gate as the connection closed")
    assert all(gates(j)) and not (tmp_path / "c").exists() and not list(tmp_path.glob(".c.partial-*"))


def test_the_shim_stops_a_job_behind_and_ahead_at_the_same_collective(job):
    """The protocol itself: close every rank wherever it is, advance those behind, drain."""
    j = job(2)
    j.wait_all_past(2, "both ranks running")
    with client.Connection(j.ranks[0]) as c0, client.Connection(j.ranks[1]) as c1:
        assert c0.request("advance 5")["error"] == "not paused"  # only through the connection holding the gate
        a = c0.request("close")
        b = c1.request("close")
        assert a["ok"] and b["ok"] and c0.request("close")["error"] == "already paused"
        target = max(a["collectives"], b["collectives"]) + 1
        assert c0.request(f"advance {target} 10000") == {"ok": True, "paused": True, "collectives": target}
        assert c1.request(f"advance {target} 10000")["collectives"] == target
        for c in (c0, c1):
            d = c.request("drain 10000")
            assert d["ok"], d
            st = c.status()
            assert st["paused"] and st["in_flight"] == 0 and st["collectives"] == target
            assert st["collective_kernels"] == 1
        n = len(j.lines)
        assert c0.request(f"advance {target + 3} 200")["error"] == "timeout"  # its peer is stopped: no match
    # Closing the connections reopened both gates (as a pause does).
    j.wait(lambda ls: len(ls) >= n + 4, "both run on once the connections close")
    assert all(gates(j))


def test_job_errors_name_the_process_and_say_what_to_do(job, tmp_path, procs):
    j = job(2)
    j.wait_all_past(1, "both ranks running")
    plain = job(2, shimmed=False)
    plain.wait_all_past(1, "the unshimmed job running")
    r = gputrace("checkpoint", "-p", f"{j.ranks[0]},{plain.ranks[0]}", "-o", str(tmp_path / "x"))
    assert r.returncode == 8 and f"process {plain.ranks[0]}" in r.stderr and "hint: " in r.stderr, r.stderr
    dead = subprocess.Popen(["true"])
    dead.wait()
    r = gputrace("suspend", "-p", str(j.ranks[0]), "-p", str(dead.pid))
    assert r.returncode == 3 and f"pid {dead.pid}" in r.stderr and "hint: " in r.stderr, r.stderr
    other = subprocess.Popen(simcuda.workload("pattern"), env={**shim.preload_env(simcuda.env()), "GPUTRACE_JOB": "x"},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(other)
    assert json.loads(other.stdout.readline())["ready"]
    r = gputrace("checkpoint", "-p", f"{j.ranks[0]},{other.pid}", "-o", str(tmp_path / "x"))
    assert r.returncode == 2 and "different jobs" in r.stderr and "--tree" in r.stderr, r.stderr
    r = gputrace("checkpoint", "--tree", str(plain.launcher))
    assert r.returncode == 8 and "no process in the tree" in r.stderr, r.stderr
    r = gputrace("checkpoint", "--full", "-p", j.pids())  # the ranks without their launcher: no one tree
    assert r.returncode == 2 and "not one process tree" in r.stderr and f"--tree {j.launcher}" in r.stderr, r.stderr
    assert all(gates(j)) and not (tmp_path / "x").exists()
    r = gputrace("checkpoint", "--help")
    assert "-p 1234,1235" in r.stdout and "--tree 1200" in r.stdout
