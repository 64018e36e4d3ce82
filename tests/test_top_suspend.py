"""top's suspend and resume, and its keys on the ranks of a job, driven through Textual's pilot on simcuda
(issue 39 part 3): whatever top offers by one key leaves the job running correctly or refuses.

A training loop that allocates and frees device memory every step (train --churn, its cuMemAlloc memory
served through the VMM API as `gputrace run --checkpointable --suspendable` serves it) is suspended and
resumed with s and u at seeded random steps and finishes with exactly what an uninterrupted run prints;
u on it running, s on it suspended, c, C and R on it suspended are refused at the key, and r on it
suspended brings back the checkpoint's process, running. On a `collective` job of two ranks, s and u
suspend and resume every rank together, c, r, C and R refuse naming the job's command, and the job's
sums stay those of an uninterrupted run; a rank that no launcher marks as one is known by the
collectives its shim counts, and refused too."""

from __future__ import annotations

import random

import pytest

from gputrace.shim import client

from shimtest import procs, shim_dir  # noqa: F401  (fixtures)
from test_full_checkpoint import FOREIGN_TRACER, _criu_reason, wait_exit
from test_gang import Job as CollectiveJob, assert_like_uninterrupted
from test_restore_whole import CHURN, Job, assert_prefix_of, reference, reap, subreaper  # noqa: F401  (fixture)
from topdata import OneJob, Ranks

SEED = 393


async def until(pilot, cond) -> None:
    while not cond():
        await pilot.pause(0.05)


def top(source, root):
    from gputrace.hostview.checkpoints import CheckpointerAdapter
    from gputrace.tui.app import TopApp

    return TopApp(source, CheckpointerAdapter(root=root))


async def act(pilot, app, key: str, *answers: str):
    """Presses `key` (and the answers to what it asks); the result it leads to (done or refused)."""
    n = len(app.last_results)
    await pilot.press(key, *answers)
    await until(pilot, lambda: len(app.last_results) > n)
    got = app.last_results[-1]
    if any(f in getattr(got, "error", "") for f in FOREIGN_TRACER):
        pytest.skip(f"a uprobe tracer outside this test probed the job: {got.error}")
    return got


async def confirmed(pilot, app, key: str) -> tuple[str, object]:
    """Presses `key`, which must ask; answers yes. The question and the result."""
    from gputrace.tui.screens.dialogs import ConfirmScreen

    n = len(app.last_results)
    await pilot.press(key)
    assert isinstance(app.screen, ConfirmScreen), (key, app.last_results[n:])
    question = app.screen.question
    await pilot.press("y")
    await until(pilot, lambda: len(app.last_results) > n)
    got = app.last_results[-1]
    if any(f in getattr(got, "error", "") for f in FOREIGN_TRACER):
        pytest.skip(f"a uprobe tracer outside this test probed the job: {got.error}")
    return question, got


def done(result, action: str) -> None:
    assert getattr(result, "action", None) == action and not hasattr(result, "error"), result


def refused(result, *says: str) -> None:
    assert hasattr(result, "error"), result
    text = f"{result.error} | {result.hint}"
    assert all(s in text for s in says), text


def allocations(pid: int) -> int:
    """The cuMemAlloc_v2 calls process `pid` has made, as its shim counts them."""
    return client.status(pid)["calls"].get("cuMemAlloc_v2", 0)


@pytest.fixture
def churn(tmp_path, shim_dir):
    from gputrace.simcuda.device import Device

    with Device(tmp_path / "dev") as d:
        j = Job(tmp_path, d, env={"GPUTRACE_SHIM_VMM": "1"})  # --suspendable
        try:
            yield j
        finally:
            j.kill()


@pytest.mark.skipif(_criu_reason() is not None, reason=str(_criu_reason()))  # c and r take CRIU
async def test_top_suspends_and_resumes_a_churning_job_at_random_steps_and_refuses_what_would_break_it(
        churn, tmp_path, reference):
    from gputrace.tui.screens.dialogs import ConfirmScreen, RestoreScreen

    job = churn
    rng = random.Random(SEED)
    app = top(OneJob(job.pid, "train"), tmp_path / "cks")
    async with app.run_test(size=(160, 30)) as pilot:
        await until(pilot, lambda: app.frame is not None)
        job.at_step(2)
        refused(await act(pilot, app, "u"), f"pid {job.pid} is not suspended: nothing to resume", "s suspends it")
        assert not isinstance(app.screen, ConfirmScreen)  # refused at the key, nothing asked
        for _ in range(8):
            # A seeded moment inside a step: just after one of the next steps' allocations (each step makes
            # CHURN and frees them again), where the memory the suspend plans for and what it freezes differ.
            target = allocations(job.pid) + rng.randint(0, 3 * CHURN)  # 0: at once, as after the last u
            await until(pilot, lambda: allocations(job.pid) >= target)
            q, r = await confirmed(pilot, app, "s")
            assert "until u resumes it" in q
            done(r, "suspend")
            st = client.status(job.pid)
            assert st["suspended"] and st["paused"], st
            await until(pilot, lambda: client.status(job.pid)["waiting"] >= 1)  # held at its next GPU call
            n = job.steps_done()
            refused(await act(pilot, app, "s"), f"pid {job.pid} is suspended already", "u resumes it")
            _, r = await confirmed(pilot, app, "u")
            done(r, "resume")
            assert not client.status(job.pid)["suspended"]
            job.at_step(n + 1)  # it goes on from where it waited
            assert_prefix_of(job.out.read_text(), reference, "the log after a resume")

        # A whole-process checkpoint, then the job suspended: what needs its device memory is refused at the key;
        # r brings the checkpoint's process back in its place, running.
        _, ck = await confirmed(pilot, app, "c")
        done(ck, "checkpoint_full")
        job.at_step(job.steps_done() + 1)
        _, r = await confirmed(pilot, app, "s")
        done(r, "suspend")
        for key, again in (("c", "c"), ("C", "C"), ("R", "R")):
            refused(await act(pilot, app, key), f"pid {job.pid} is suspended: its device memory is off the GPU",
                    f"u resumes it first (the job goes on where it waited), then {again}")
            assert client.status(job.pid)["suspended"]  # as it was
        with subreaper():
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, RestoreScreen))
            await pilot.press("enter")
            assert "It is suspended now: the checkpoint's process runs in its place, not suspended" in \
                app.screen.question
            n = len(app.last_results)
            await pilot.press("y")
            await until(pilot, lambda: len(app.last_results) > n)
            if any(f in getattr(app.last_results[-1], "error", "") for f in FOREIGN_TRACER):
                pytest.skip(f"a uprobe tracer outside this test probed the job: {app.last_results[-1].error}")
            done(app.last_results[-1], "restore_full")
            reap(job.pid)
            assert not client.status(job.pid)["suspended"]
            refused(await act(pilot, app, "u"), "is not suspended")
            job.at_step(job.steps_done() + 1)
            await pilot.press("q")
            wait_exit(job.pid)
    assert job.out.read_text() == reference  # every step, suspended or not, as an uninterrupted run


def test_suspend_back_to_back_on_a_job_that_allocates_every_step_is_never_refused_busy(churn, reference):
    """The shim plans a suspend's image while the job runs and freezes it a moment later; a job that allocated in
    between was refused 'busy' (7 of 30 here, suspended again right after each resume, when its held allocation
    goes through). suspend plans again, and the last time stages, so every one goes through."""
    from gputrace.checkpointer import resume, suspend

    job = churn
    job.at_step(2)
    for _ in range(30):
        assert suspend(job.pid).allocations >= 1
        resume(job.pid)
    wait_exit(job.pid)
    assert job.out.read_text() == reference


# --- a job of several ranks -----------------------------------------------------------------------------------

@pytest.fixture
def ranks(procs, shim_dir, monkeypatch):
    """A `collective` job of two ranks, suspendable, run as `gputrace run --checkpointable --suspendable`
    starts one (its processes tagged with one GPUTRACE_JOB)."""
    monkeypatch.setenv("GPUTRACE_JOB", "topranks")
    j = CollectiveJob(procs, 2, suspendable=True)
    try:
        yield j
    finally:
        j.kill_ranks()


async def test_top_on_a_rank_suspends_and_resumes_the_whole_job_and_refuses_what_would_act_on_one_rank(
        ranks, tmp_path):
    j = ranks
    rng = random.Random(SEED + 1)
    app = top(Ranks(j.ranks, "collective"), tmp_path / "cks")
    async with app.run_test(size=(160, 30)) as pilot:
        await until(pilot, lambda: app.frame is not None)
        j.wait_all_past(2, "every rank running")
        pids = ", ".join(map(str, sorted(j.ranks)))
        for key, command in (("c", f"checkpoint --full --tree {j.launcher} --leave-running"),
                             ("r", "restore --full DIR"), ("C", f"checkpoint --tree {j.launcher}"),
                             ("R", "--device-only --force")):
            refused(await act(pilot, app, key), "is a rank of a job of 2 processes", command)
        refused(await act(pilot, app, "u"), "no rank of the job", "is suspended", "s suspends the whole job")
        assert not any(client.status(p)["paused"] for p in j.ranks)  # every refusal left the job alone
        for _ in range(4):
            j.wait_all_past(max(len(j.steps(0)), len(j.steps(1))) + rng.randint(0, 3), "the job running")
            q, r = await confirmed(pilot, app, "s")
            assert "whole job" in q and all(str(p) in q for p in j.ranks), q
            done(r, "suspend_job")
            assert all(client.status(p)["suspended"] for p in j.ranks)
            refused(await act(pilot, app, "s"), "is suspended already", "u resumes it")
            refused(await act(pilot, app, "c"), "is a rank of a job of 2 processes")
            n = len(j.lines)
            q, r = await confirmed(pilot, app, "u")
            assert pids in q, q
            done(r, "resume_job")
            assert not any(client.status(p)["suspended"] or client.status(p)["paused"] for p in j.ranks)
            j.wait(lambda ls: len(ls) >= n + 4, "the job runs on after resume")
        await pilot.press("q")
    j.stop()
    for i in range(2):  # every rank's steps one by one, none lost or repeated
        s = j.steps(i)
        assert s == list(range(1, len(s) + 1)), s
    assert_like_uninterrupted(j)


@pytest.mark.parametrize("key", ["c", "r", "s", "u", "C", "R"])
async def test_a_rank_no_launcher_marks_is_known_by_its_collectives_and_refused(procs, shim_dir, tmp_path, key):
    """Started without RANK/WORLD_SIZE or GPUTRACE_JOB, a rank looks like a process alone to its environment; its
    shim's count of collectives says otherwise, and top refuses to act on it alone."""
    j = CollectiveJob(procs, 2, suspendable=True)
    try:
        j.wait_all_past(2, "every rank running")
        app = top(Ranks(j.ranks[:1], "collective"), tmp_path / "cks")
        async with app.run_test(size=(160, 30)) as pilot:
            await until(pilot, lambda: app.frame is not None)
            r = await act(pilot, app, key)
            refused(r, f"pid {j.ranks[0]} has launched", "collectives: it is a rank of a job of several processes")
            if key not in "rR":
                assert f"--tree {j.launcher}" in r.hint, r.hint
            assert not client.status(j.ranks[0])["paused"]
            n = len(j.lines)
            j.wait(lambda ls: len(ls) >= n + 2, "the job runs on")
            await pilot.press("q")
        j.stop()
        assert_like_uninterrupted(j)
    finally:
        j.kill_ranks()
