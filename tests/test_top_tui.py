"""The dashboard driven with Textual's Pilot over a replayed session, actions against a fake
checkpointer: no root, no GPU. Waits are on the app's own state (frames seen, workers done), never on
a clock."""

from __future__ import annotations

import threading

import pytest
from textual.widgets import Sparkline

from gputrace.base.errors import GputraceError
from gputrace.hostview.checkpoints import FakeCheckpointer, NoCheckpointer
from gputrace.tui.app import TopApp
from gputrace.tui.screens.detail import DetailScreen
from gputrace.tui.screens.dialogs import ConfirmScreen, HelpScreen, RestoreScreen
from gputrace.tui.screens.main import MainScreen
from gputrace.hostview.recording import ReplaySource, write_record
from gputrace.tui.widgets import ProcessTable

from topdata import frames

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def recording(tmp_path):
    path = tmp_path / "session.jsonl"
    write_record(str(path), frames(3))
    return str(path)


async def until(pilot, cond) -> None:
    while not cond():
        await pilot.pause()


async def started(pilot) -> MainScreen:
    await until(pilot, lambda: pilot.app.ended and isinstance(pilot.app.screen, MainScreen))
    await pilot.pause()
    return pilot.app.screen


def pids(screen: MainScreen) -> list[int]:
    return screen.query_one(ProcessTable).pids


def app_for(recording, checkpointer=None) -> TopApp:
    return TopApp(ReplaySource(recording, speed=0), checkpointer or FakeCheckpointer())


async def test_rows_sorted_by_predicted_overhead_by_default(recording):
    app = app_for(recording)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        assert app.frames_seen == 3
        assert pids(main) == [4242, 1111, 2222, 3333]
        assert main.query_one(ProcessTable).shown[:3] == ("pid", "comm", "calls")
        header = str(main.query_one("#header").render())
        assert "replay ended" in header
        # The GPU panel: a line per GPU, with its processes and how many of them this top traces.
        gpu = next(line for line in header.splitlines() if "GPU0" in line)
        assert "87%" in gpu and "40.0 GiB / 141.0 GiB" in gpu and "3 processes (2 traced)" in gpu


async def test_the_overhead_cell_is_coloured_by_how_much_the_layer_would_cost(recording):
    from gputrace.tui.text import overhead_level

    app = app_for(recording)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        table = main.query_one(ProcessTable)
        rows = {r.pid: r for r in app.frame.processes}
        levels = dict(zip(table.pids, table.levels))
        assert levels == {pid: overhead_level(r, "shim") for pid, r in rows.items()}
        assert set(levels.values()) == {"low"}  # a 15 ns shim costs these jobs under 1%
        await pilot.press("p")  # the proxy preset: 2 us a call
        levels = dict(zip(table.pids, table.levels))
        assert levels[4242] == "high" and levels[3333] == "low", levels
        # The colour is in the cell's segment, not the row's.
        strip = table.render_line(1 + table.pids.index(4242))
        high = table.get_component_rich_style("process-table--high").color
        (cell,) = [seg for seg in strip if seg.style is not None and seg.style.color == high]
        assert "–" in cell.text and cell.text.strip().endswith("%") and "train_big" not in cell.text


def test_overhead_levels_by_the_upper_bound():
    from types import SimpleNamespace

    from gputrace.tui.text import overhead_level

    row = lambda upper: SimpleNamespace(audit=lambda preset: SimpleNamespace(slowdown_upper=upper))  # noqa: E731
    assert [overhead_level(row(u), "x") for u in (None, 0.0, 0.0099, 0.01, 0.049, 0.05, 3.0)] == \
        [None, "low", "low", "mid", "mid", "high", "high"]


async def test_sorting_keys_and_header_click(recording):
    app = app_for(recording)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        table = main.query_one(ProcessTable)
        await pilot.press("i")
        assert pids(main) == [3333, 2222, 1111, 4242]
        assert table.selected_pid() == 3333  # untouched, the cursor stays on the top row
        await pilot.press("down", "i")
        assert pids(main) == [4242, 1111, 2222, 3333]
        assert table.selected_pid() == 2222  # moved by the user, it follows its process
        await pilot.press("<")  # overhead -> wait (the column before it)
        assert main.sort == "wait" and pids(main)[0] == 2222
        await pilot.click(ProcessTable, offset=(2, 0))  # the PID title
        assert main.sort == "pid" and pids(main) == [1111, 2222, 3333, 4242]
        await pilot.click(ProcessTable, offset=(2, 0))  # again: reversed
        assert main.sort == "pid" and main.reverse and pids(main) == [4242, 3333, 2222, 1111]


async def test_filter_by_command_pid_or_shim(recording):
    app = app_for(recording)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        await pilot.press("slash", *"infer")
        assert pids(main) == [1111]
        await pilot.press("enter")
        assert main.filter == "infer" and main.query_one(ProcessTable).has_focus
        await pilot.press("slash", "ctrl+u", *"shim", "enter")
        assert pids(main) == [4242, 3333]
        await pilot.press("escape")
        assert main.filter == "" and len(pids(main)) == 4


async def test_detail_screen_functions_histogram_and_audit(recording):
    app = app_for(recording)
    async with app.run_test(size=(160, 40)) as pilot:
        await started(pilot)
        await pilot.press("enter")
        detail = app.screen
        assert isinstance(detail, DetailScreen) and detail.pid == 4242
        assert detail.names[0] == "cuCtxGetDevice_v2"
        audit = str(detail.query_one("#audit").render())
        assert "pid 4242 (train_big)" in audit and "predicted slowdown" in audit and "preset shim" in audit
        # The plots: the calls/s its row brought, then now; the overhead for the preset shown.
        row = next(r for r in app.frame.processes if r.pid == 4242)
        calls = detail.query_one("#calls-plot", Sparkline).data
        assert list(calls) == list(row.calls_history[:-1]) + [row.snapshot.calls_hz]
        assert list(detail.query_one("#overhead-plot", Sparkline).data) == [row.audit("shim").slowdown_upper]
        assert "(shim preset)" in str(detail.query_one("#overhead-label").render())
        await pilot.press("down")
        assert detail.selected_name() == "cuLaunchKernel"
        assert "cuLaunchKernel\ntime per call" in str(detail.query_one("#hist").render())
        await pilot.press("p")
        assert "preset proxy" in str(detail.query_one("#audit").render())
        assert list(detail.query_one("#overhead-plot", Sparkline).data) == [row.audit("proxy").slowdown_upper]
        assert "(proxy preset)" in str(detail.query_one("#overhead-label").render())
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)


async def test_the_confirmation_says_where_the_checkpoint_goes(recording, tmp_path):
    from gputrace.hostview.checkpoints import CheckpointerAdapter

    class Placed(FakeCheckpointer):
        destination = CheckpointerAdapter(root=tmp_path).destination

    app = app_for(recording, Placed())
    async with app.run_test(size=(160, 30)) as pilot:
        await started(pilot)
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmScreen)
        assert app.screen.question.endswith(f"Into {tmp_path}/full-4242-TIME"), app.screen.question
        await pilot.press("n", "C")
        assert app.screen.question.endswith(f"Into {tmp_path}/4242-TIME"), app.screen.question
        await pilot.press("n")


async def test_checkpoint_asks_shows_progress_then_the_freeze_time(recording):
    gate = threading.Event()
    fake = FakeCheckpointer(gate=gate)
    app = app_for(recording, fake)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        await pilot.press("C")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert fake.calls == [] and isinstance(app.screen, MainScreen)
        await pilot.press("C", "y")
        await until(pilot, lambda: fake.calls)
        await until(pilot, lambda: "checkpoint started" in str(main.query_one("#status").render()))
        await pilot.press("C")  # a second action on a busy process is refused, not queued
        assert isinstance(app.screen, MainScreen)
        gate.set()
        await until(pilot, lambda: not app.busy)
        status = str(main.query_one("#status").render())
        assert "device-memory checkpoint of pid 4242 done, froze the job 12.0 ms" in status, status
        assert fake.calls == [("checkpoint", 4242, "")]
        assert "0s ago" in main.query_one(ProcessTable).row_texts(4242)["ckpt"]


async def test_restore_brings_the_whole_process_back_and_shows_the_time_back(recording):
    fake = FakeCheckpointer()
    app = app_for(recording, fake)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        await pilot.press("r")
        await until(pilot, lambda: app.last_results)  # none yet: the failure says so
        assert "no whole-process checkpoint" in app.last_results[-1].error and "with c" in app.last_results[-1].hint
        await pilot.press("C", "y")  # a device-memory checkpoint is not one r brings back
        await until(pilot, lambda: len(app.last_results) == 2)
        await pilot.press("r")
        await until(pilot, lambda: len(app.last_results) == 3)
        assert "no whole-process checkpoint" in app.last_results[-1].error
        await pilot.press("c", "y")
        await until(pilot, lambda: len(app.last_results) == 4)
        await pilot.press("r")
        await until(pilot, lambda: isinstance(app.screen, RestoreScreen))
        await pilot.press("enter")
        assert isinstance(app.screen, ConfirmScreen)
        # Where the user acts: what the running process loses.
        assert "running process is ended" in app.screen.question and "undone" in app.screen.question
        await pilot.press("y")
        await until(pilot, lambda: len(app.last_results) == 5)
        assert fake.calls[-1] == ("restore_full", 4242, "/tmp/fake-full/4242/0")
        status = str(main.query_one("#status").render())
        assert "restore of pid 4242 done, back in 1.50 s" in status, status


async def test_device_only_rollback_is_its_own_key_and_its_confirmation_names_the_risk(recording):
    fake = FakeCheckpointer()
    app = app_for(recording, fake)
    async with app.run_test(size=(160, 30)) as pilot:
        await started(pilot)
        await pilot.press("c", "y")
        await until(pilot, lambda: len(app.last_results) == 1)
        await pilot.press("R")  # a whole-process checkpoint is no device-memory one
        await until(pilot, lambda: len(app.last_results) == 2)
        assert "no device-memory checkpoint" in app.last_results[-1].error and "with C" in app.last_results[-1].hint
        await pilot.press("C", "y")
        await until(pilot, lambda: len(app.last_results) == 3)
        await pilot.press("R")
        await until(pilot, lambda: isinstance(app.screen, RestoreScreen))
        await pilot.press("enter")
        q = app.screen.question
        assert q.startswith("UNSAFE") and "may crash or compute with stale data" in q and "host state goes on" in q
        await pilot.press("y")
        await until(pilot, lambda: len(app.last_results) == 4)
        assert fake.calls[-1] == ("rollback", 4242, "/tmp/fake-ckpt/4242/0")


async def test_failures_and_refusals_show_in_the_ui(recording):
    fake = FakeCheckpointer(fail={"suspend": GputraceError("the gate did not close in 5 s", "try again")})
    app = app_for(recording, fake)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        await pilot.press("s", "y")
        await until(pilot, lambda: app.last_results)
        assert "suspend of pid 4242 FAILED: the gate did not close" in str(main.query_one("#status").render())
        await pilot.press("down")  # 1111 runs without the shim
        await pilot.press("C")
        assert isinstance(app.screen, MainScreen) and len(fake.calls) == 1
        assert app.is_running


async def test_replay_has_no_actions_but_says_why(recording):
    app = TopApp(ReplaySource(recording, speed=0), NoCheckpointer())
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        await pilot.press("c")
        assert "checkpoint is not available yet" in str(main.query_one("#status").render())
        await pilot.press("r")
        assert "restore is not available yet" in str(main.query_one("#status").render())


async def test_help_and_quit(recording):
    app = app_for(recording)
    async with app.run_test(size=(100, 30)) as pilot:
        await started(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)
        await pilot.press("q")
    assert not app.is_running


async def test_small_terminal_keeps_the_essential_columns(recording):
    app = app_for(recording)
    async with app.run_test(size=(50, 12)) as pilot:
        main = await started(pilot)
        shown = main.query_one(ProcessTable).shown
        assert shown == ("pid", "comm", "overhead"), shown
        assert pids(main)[0] == 4242


async def test_a_refresh_repaints_only_the_rows_whose_text_changed(recording):
    import dataclasses

    app = app_for(recording)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        table = main.query_one(ProcessTable)
        built = table.strips_built
        main.show_frame(app.frame)  # the same frame again
        await pilot.pause()
        assert table.strips_built == built
        frame = app.frame
        renamed = [dataclasses.replace(r, comm="renamed") if r.pid == 2222 else r for r in frame.processes]
        app.frame = dataclasses.replace(frame, processes=tuple(renamed))
        main.show_frame(app.frame)
        await pilot.pause()
        assert table.strips_built == built + 1
        assert table.row_texts(2222)["comm"] == "renamed" and pids(main) == [4242, 1111, 2222, 3333]


async def test_click_moves_the_cursor_and_a_second_click_opens_the_detail(recording):
    app = app_for(recording)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        await pilot.click(ProcessTable, offset=(2, 2))  # the header is line 0: this is the second row
        assert main.query_one(ProcessTable).selected_pid() == 1111 and isinstance(app.screen, MainScreen)
        await pilot.click(ProcessTable, offset=(2, 2))
        assert isinstance(app.screen, DetailScreen) and app.screen.pid == 1111


async def test_the_cursor_scrolls_into_view_on_a_short_terminal(recording):
    app = app_for(recording)
    async with app.run_test(size=(80, 9)) as pilot:
        main = await started(pilot)
        table = main.query_one(ProcessTable)
        await pilot.press("end")
        assert table.selected_pid() == 3333
        assert table.size.height - 1 < len(table.pids)  # fewer lines than rows: it had to scroll
        assert table.scroll_offset.y + table.size.height - 1 > len(table.pids) - 1 >= table.scroll_offset.y > 0
        await pilot.press("home")
        assert table.selected_pid() == 4242 and table.scroll_offset.y == 0


async def test_whole_job_checkpoint_asks_then_shows_the_freeze_time_and_the_job_runs_on(recording):
    gate = threading.Event()
    fake = FakeCheckpointer(gate=gate)
    app = app_for(recording, fake)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        before = main.query_one(ProcessTable).row_texts(4242)["ckpt"]
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmScreen)
        assert "whole, GPU and CPU state" in str(app.screen.query_one("#question").render())
        await pilot.press("n")
        assert fake.calls == [] and isinstance(app.screen, MainScreen)
        await pilot.press("c", "y")
        await until(pilot, lambda: fake.calls)
        await until(pilot, lambda: "checkpoint of pid 4242: 0% checkpoint_full started"
                    in str(main.query_one("#status").render()))
        await pilot.press("w")  # the process is busy: refused, not queued (w is c's old key)
        assert isinstance(app.screen, MainScreen) and len(fake.calls) == 1
        gate.set()
        await until(pilot, lambda: not app.busy)
        status = str(main.query_one("#status").render())
        assert "checkpoint of pid 4242 done, froze the job 34.0 ms" in status, status
        assert "the job runs on" in status
        assert fake.calls == [("checkpoint_full", 4242, "")] and fake.full == [4242]
        # A checkpoint r brings the process back to: the column shows it.
        after = main.query_one(ProcessTable).row_texts(4242)["ckpt"]
        assert after != before and "0s ago" in after


async def test_whole_job_checkpoint_needs_no_shim_and_its_failures_show(recording):
    fake = FakeCheckpointer(fail={"checkpoint_full": GputraceError("CRIU is not installed", "run scripts/setup-host")})
    app = app_for(recording, fake)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        await pilot.press("down")  # 1111 runs without the shim: the driver's API and CRIU need none
        await pilot.press("w")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await until(pilot, lambda: app.last_results)
        status = str(main.query_one("#status").render())
        assert "checkpoint of pid 1111 FAILED: CRIU is not installed" in status, status
        assert fake.calls == [("checkpoint_full", 1111, "")]
        fake.fail["checkpoint_full"] = RuntimeError("a bug")  # not a GputraceError: still shown, not a crash
        await pilot.press("w", "y")
        await until(pilot, lambda: len(app.last_results) == 2)
        assert "checkpoint failed: RuntimeError: a bug" in app.last_results[-1].error
        assert app.is_running and isinstance(app.screen, MainScreen) and not app.busy


async def test_whole_job_checkpoint_in_a_replay_says_why_not(recording):
    app = TopApp(ReplaySource(recording, speed=0), NoCheckpointer())
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        await pilot.press("c")
        assert "checkpoint is not available yet" in str(main.query_one("#status").render())


@pytest.mark.parametrize("width", [80, 150])
async def test_a_long_question_wraps_inside_its_dialog(recording, width):
    from gputrace.tui.app import QUESTIONS

    app = app_for(recording, FakeCheckpointer())
    question = QUESTIONS["checkpoint_full"].format(pid=4242, comm="train_big")
    async with app.run_test(size=(width, 30)) as pilot:
        await started(pilot)
        app.push_screen(ConfirmScreen(question))
        await pilot.pause()
        label = app.screen.query_one("#question")
        box = app.screen.query_one("Vertical")
        assert label.region.width <= box.content_region.width <= width
        svg = app.export_screenshot().replace("&#160;", " ")
        assert "then runs on." in svg and "It is frozen" in svg  # its last words, not cut off at the border


async def test_the_header_draws_its_text_as_a_static_would_at_every_width(recording):
    """HostHeader builds its lines with Rich rather than through a Static (tui/widgets.py says why):
    they must come out as Textual's own rendering of the same text, wrapped or not."""
    from rich.text import Text
    from textual.visual import Visual, visualize

    from gputrace.tui.widgets import HostHeader

    app = app_for(recording)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        header = main.query_one(HostHeader)
        console = app.console
        texts = [*header._paras, Text("a-single-word-longer-than-narrow-terminals and then some"),
                 Text.assemble(("host", "bold"), "  ", ("GPUs: none (no NVIDIA driver here)", "dim")),
                 Text.assemble("tracer 0.44%  ", ("50 processes", "bold"), (", 2 not traceable", "yellow"),
                               ("  filter 'x'", "cyan"), "  12:00:00", ("  replay ended", "yellow"))]
        for text in texts:
            header._paras = [text]
            for width in range(8, 161, 3):
                ours = [s.render(console) for s in header._lines(0, width)]
                static = Visual.to_strips(header, visualize(header, text), width, None, header.visual_style)
                assert ours == [s.render(console) for s in static], (text.plain, width)


async def test_the_command_palette_has_gputraces_actions_and_a_screenshot_that_says_where(recording, tmp_path,
                                                                                        monkeypatch):
    # Last in this file: a screenshot renders the screen's strips through a truecolor console, and
    # Textual keeps a strip's rendering, which the header test above compares with a Static's.
    monkeypatch.chdir(tmp_path)
    app = app_for(recording)
    async with app.run_test(size=(160, 30)) as pilot:
        await started(pilot)
        commands = {c.title: c for c in app.get_system_commands(app.screen)}
        assert {"Checkpoint", "Restore", "Suspend", "Resume", "Device-memory checkpoint", "Device-only rollback",
                "Next preset", "Help", "Screenshot", "Quit"} <= set(commands)
        commands["Checkpoint"].callback()
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen) and "Checkpoint pid 4242 (train_big) whole" in app.screen.question
        await pilot.press("n")
        notified = []
        monkeypatch.setattr(app, "notify", lambda msg, **kw: notified.append(msg))
        commands["Screenshot"].callback()
        (shot,) = tmp_path.glob("*.svg")
        assert notified == [f"screenshot saved to {shot}"] and "train_big" in shot.read_text()
        shot.unlink()
        await pilot.press("ctrl+s")  # the same from its key
        await pilot.pause()
        (shot,) = tmp_path.glob("*.svg")
        assert notified[-1] == f"screenshot saved to {shot}"


def job_recording(tmp_path, world: int = 2) -> str:
    """The replay with 4242 and 3333 ranks 0 and 1 of one torchrun job of `world` processes."""
    import dataclasses

    from gputrace.hostview.jobs import JobTag

    job = {4242: JobTag("torchrun:1200", 0, world), 3333: JobTag("torchrun:1200", 1, world)}
    framed = [dataclasses.replace(f, processes=tuple(dataclasses.replace(r, job=job.get(r.pid, r.job))
                                                     for r in f.processes)) for f in frames(3)]
    path = tmp_path / "job.jsonl"
    write_record(str(path), framed)
    return str(path)


@pytest.mark.parametrize("key", ["c", "r", "C", "R"])
async def test_a_key_on_a_rank_that_would_act_on_it_alone_refuses_and_names_the_command_for_the_whole_job(tmp_path,
                                                                                                      key):
    """One rank stopped, checkpointed or brought back alone would hold its peers in a collective or leave them
    out of step: what top offers by one key either leaves the job running right or refuses, so on a rank of a
    job of several processes c, r, C and R refuse, and nothing reaches the checkpointer."""
    fake = FakeCheckpointer()
    app = app_for(job_recording(tmp_path), fake)
    async with app.run_test(size=(160, 30)) as pilot:
        await started(pilot)
        assert app.screen.selected().pid == 4242
        await pilot.press(key)
        await until(pilot, lambda: app.last_results)
        failed = app.last_results[-1]
        assert "is a rank of a job of 2 processes (with 3333)" in failed.error, failed.error
        assert "--tree" in failed.hint or "--full DIR" in failed.hint or "--force" in failed.hint
        assert fake.calls == [] and isinstance(app.screen, MainScreen)


async def test_suspend_and_resume_on_a_rank_act_on_every_rank_of_its_job(tmp_path):
    """s and u on a rank suspend and resume the whole job, every rank at once (gputrace suspend -p A,B); s on a
    suspended job and u on a running one refuse, before asking."""
    fake = FakeCheckpointer()
    app = app_for(job_recording(tmp_path), fake)
    async with app.run_test(size=(160, 30)) as pilot:
        main = await started(pilot)
        await pilot.press("u")  # nothing suspended
        await until(pilot, lambda: app.last_results)
        assert "no rank of the job of pid 4242 is suspended" in app.last_results[-1].error
        assert "s suspends the whole job" in app.last_results[-1].hint and fake.calls == []
        await pilot.press("s")
        assert isinstance(app.screen, ConfirmScreen)
        assert "whole job" in app.screen.question and "pids 4242, 3333" in app.screen.question, app.screen.question
        await pilot.press("y")
        await until(pilot, lambda: len(app.last_results) == 2)
        assert fake.calls == [("suspend_job", 4242, "4242,3333")] and fake.suspended == {4242, 3333}
        assert "suspend of the job of pid 4242 done" in str(main.query_one("#status").render())
        assert not app.busy  # every rank free again
        await pilot.press("s")  # again: refused
        await until(pilot, lambda: len(app.last_results) == 3)
        assert "is suspended already" in app.last_results[-1].error and "u resumes it" in app.last_results[-1].hint
        fake.suspended.discard(3333)  # one rank resumed elsewhere (gputrace resume -p 3333): u brings back the other
        await pilot.press("u")
        assert isinstance(app.screen, ConfirmScreen) and "pids 4242," in app.screen.question, app.screen.question
        await pilot.press("y")
        await until(pilot, lambda: len(app.last_results) == 4)
        assert fake.calls[-1] == ("resume_job", 4242, "4242") and not fake.suspended


@pytest.mark.parametrize("key", ["s", "u"])
async def test_suspend_and_resume_refuse_a_rank_whose_job_top_does_not_see_whole(tmp_path, key):
    fake = FakeCheckpointer()
    app = app_for(job_recording(tmp_path, world=4), fake)
    async with app.run_test(size=(160, 30)) as pilot:
        await started(pilot)
        await pilot.press(key)
        await until(pilot, lambda: app.last_results)
        failed = app.last_results[-1]
        assert "is a rank of a job of 4 processes (with 3333) (top sees 2 of them)" in failed.error, failed.error
        assert ("suspend --tree" if key == "s" else "resume --tree") in failed.hint and fake.calls == []


async def test_what_a_suspended_or_running_process_cannot_take_is_refused_before_anything_is_asked(recording):
    """u on a process not suspended, s on one suspended, c, C and R on one suspended: refused at the key, each
    saying which key does what is wanted; r on a suspended one is asked, and says what becomes of it."""
    fake = FakeCheckpointer()
    app = app_for(recording, fake)
    async with app.run_test(size=(160, 30)) as pilot:
        await started(pilot)
        await pilot.press("c", "y")
        await until(pilot, lambda: len(app.last_results) == 1)
        await pilot.press("u")
        await until(pilot, lambda: len(app.last_results) == 2)
        assert "pid 4242 is not suspended: nothing to resume" in app.last_results[-1].error
        assert app.last_results[-1].hint == "s suspends it" and isinstance(app.screen, MainScreen)
        await pilot.press("s", "y")
        await until(pilot, lambda: len(app.last_results) == 3)
        assert fake.suspended == {4242}
        for n, key in enumerate(["s", "c", "C", "R"], start=4):
            await pilot.press(key)
            await until(pilot, lambda: len(app.last_results) == n)
            refused = app.last_results[-1]
            assert isinstance(app.screen, MainScreen) and "pid 4242 is suspended" in refused.error, refused
            assert refused.hint.startswith("u resumes it"), refused.hint
        assert [c[0] for c in fake.calls] == ["checkpoint_full", "suspend"]
        await pilot.press("r")
        await until(pilot, lambda: isinstance(app.screen, RestoreScreen))
        await pilot.press("enter")
        assert "It is suspended now: the checkpoint's process runs in its place, not suspended" in app.screen.question
        await pilot.press("n")
        await pilot.press("u", "y")
        await until(pilot, lambda: len(app.last_results) == 8)
        assert fake.calls[-1][0] == "resume" and not fake.suspended


@pytest.mark.parametrize("key", ["c", "r", "s", "u", "C", "R"])
async def test_a_process_that_launches_collectives_is_a_rank_even_where_no_launcher_says_so(recording, key):
    """Its shim counts the collectives it launched: a rank of a job whose peers top cannot tell. One key on it
    alone would leave them waiting or out of step: refused, naming the job's command."""
    fake = FakeCheckpointer()
    fake.collectives[4242] = 12
    app = app_for(recording, fake)
    async with app.run_test(size=(160, 30)) as pilot:
        await started(pilot)
        await pilot.press(key)
        await until(pilot, lambda: app.last_results)
        failed = app.last_results[-1]
        assert "pid 4242 has launched 12 collectives" in failed.error, failed
        assert "--tree LAUNCHER" in failed.hint or "--full DIR" in failed.hint or "--force" in failed.hint, failed.hint
        assert fake.calls == [] and isinstance(app.screen, MainScreen)
