"""Screens of the dashboard compared with stored SVG snapshots (pytest-textual-snapshot).

A replayed session makes them deterministic; TZ is pinned because the header shows the frame's clock
time. Update after an intended change with `pytest tests/test_top_snapshots.py --snapshot-update`
and look at the report it writes."""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot")

import textual  # noqa: E402

# Textual's rendering changes between releases; the stored SVGs are exact to the one they came from.
RECORDED_WITH = "8.2.8"
if textual.__version__ != RECORDED_WITH:
    pytest.skip(f"snapshots were recorded with textual {RECORDED_WITH}, this is {textual.__version__}: "
                "re-record them with --snapshot-update and review the report", allow_module_level=True)

from gputrace.hostview.checkpoints import FakeCheckpointer  # noqa: E402
from gputrace.tui.app import TopApp  # noqa: E402
from gputrace.tui.screens.main import MainScreen  # noqa: E402
from gputrace.hostview.recording import ReplaySource, write_record  # noqa: E402

from topdata import frames  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def app(tmp_path, monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    import time

    time.tzset()
    # Pinned presets: the screens must not change when the tracer's assumed costs are revised.
    from gputrace.tracer import audit
    from gputrace.tracer.classify import FunctionClass as C

    monkeypatch.setitem(audit.PRESETS, "shim", audit.Preset("shim", 100.0, frozenset({C.SUBMISSION, C.STATE}), "pinned for the test"))
    monkeypatch.setitem(audit.PRESETS, "proxy", audit.Preset("proxy", 2000.0, frozenset(C), "pinned for the test"))
    path = tmp_path / "session.jsonl"
    write_record(str(path), frames(3))
    return TopApp(ReplaySource(str(path), speed=0), FakeCheckpointer())


async def settled(pilot) -> None:
    while not (pilot.app.ended and isinstance(pilot.app.screen, MainScreen)):
        await pilot.pause()
    await pilot.pause()


def test_main_screen(app, snap_compare):
    assert snap_compare(app, terminal_size=(150, 16), run_before=settled)


def test_main_screen_small_terminal(app, snap_compare):
    assert snap_compare(app, terminal_size=(60, 14), run_before=settled)


def test_detail_screen(app, snap_compare):
    async def go(pilot):
        await settled(pilot)
        await pilot.press("enter", "down")

    assert snap_compare(app, terminal_size=(150, 30), run_before=go)


def test_help(app, snap_compare):
    async def go(pilot):
        await settled(pilot)
        await pilot.press("question_mark")

    assert snap_compare(app, terminal_size=(120, 30), run_before=go)
