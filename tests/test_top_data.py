"""`top`'s data layer without root: the frame codec, recordings and their replay, the text view, the
checkpointer adapter's fallbacks, and the CLI's argument checks."""

from __future__ import annotations

import contextlib

import subprocess
import sys
import types

import orjson
import pytest

from gputrace.hostview import checkpoints as actions
from gputrace.hostview.model import SCHEMA, host_dict, host_from_dict
from gputrace.hostview.recording import ReplaySource, read_record, write_record
from gputrace.tui.text import render_host, sort_rows, sparkline

from topdata import frame, frames

CLI = [sys.executable, "-m", "gputrace"]


def test_frame_round_trips_through_json():
    h = frame(1)
    d = orjson.loads(orjson.dumps(host_dict(h), option=orjson.OPT_NON_STR_KEYS))
    assert d["schema"] == SCHEMA and d["kind"] == "gputrace.top.frame"
    back = host_from_dict(d)
    assert back == h
    row = d["processes"][0]
    assert set(row["audits"]) == {"shim", "proxy"}
    assert row["audits"]["shim"]["slowdown_upper"] >= row["audits"]["shim"]["slowdown_lower"]


def test_replay_yields_the_recorded_frames(tmp_path):
    path = tmp_path / "s.jsonl"
    write_record(str(path), frames(4), {"interval_s": 1.0})
    header, got = read_record(str(path))
    assert header["kind"] == "gputrace.record" and header["options"] == {"interval_s": 1.0}
    assert got == frames(4)
    assert list(ReplaySource(str(path), speed=0).frames()) == frames(4)


def test_replay_once_sums_a_recording_up_with_each_process_as_last_recorded(tmp_path):
    from topdata import PROCS, frame

    path = tmp_path / "s.jsonl"
    # The notebook (2222) leaves after the first frame; the others stay for three.
    write_record(str(path), [frame(0), frame(1, PROCS[:3]), frame(2, PROCS[:3])])
    p = subprocess.run(CLI + ["top", "--replay", str(path), "--once", "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    doc = orjson.loads(p.stdout)
    rows = {r["pid"]: r for r in doc["processes"]}
    assert set(rows) == {4242, 1111, 3333, 2222}
    expect = {4242: frame(2), 1111: frame(2), 3333: frame(2), 2222: frame(0)}
    for pid, fr in expect.items():
        want = next(r for r in fr.processes if r.pid == pid)
        assert rows[pid]["snapshot"]["calls_hz"] == pytest.approx(want.snapshot.calls_hz), pid
    assert any("3 frames over 2 s" in n for n in doc["notes"]), doc["notes"]
    text = subprocess.run(CLI + ["top", "--replay", str(path), "--once"], capture_output=True, text=True)
    assert text.returncode == 0 and "notebook" in text.stdout and "train_big" in text.stdout, text.stderr


def test_replay_close_ends_the_iteration(tmp_path):
    path = tmp_path / "s.jsonl"
    write_record(str(path), frames(3))
    src = ReplaySource(str(path), speed=1e-6)  # a pause of days between frames, unless closed
    it = src.frames()
    assert next(it) == frames(1)[0]
    src.close()
    assert list(it) == []


@pytest.mark.parametrize("content, msg", [
    (b"", "not a gputrace recording"),
    (b"{not json\n", "not a gputrace recording"),
    (b'{"schema": 1, "kind": "gputrace.attach"}\n', "no gputrace.record header"),
    (b'{"schema": 99, "kind": "gputrace.record"}\n', "newer than this gputrace reads"),
    (b'{"schema": 1, "kind": "gputrace.record"}\n{"kind": "gputrace.top.frame", "t": 1}\n', "malformed frame"),
])
def test_bad_recordings_are_refused_with_a_reason(tmp_path, content, msg):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    p = subprocess.run(CLI + ["top", "--replay", str(path)], capture_output=True, text=True)
    assert p.returncode == 2 and msg in p.stderr and "hint:" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_a_recording_cut_mid_line_reads_up_to_its_last_whole_frame(tmp_path):
    path = tmp_path / "cut.jsonl"
    write_record(str(path), frames(2))
    data = path.read_bytes()
    path.write_bytes(data + data.splitlines()[-1][:40])
    assert read_record(str(path))[1] == frames(2)


def test_text_view_sorts_by_predicted_overhead():
    text = render_host(frame(0), "shim")
    lines = text.splitlines()
    assert lines[0].startswith("gpu-host-7  GPUs: 0: NVIDIA H200 87%")
    order = [ln.split()[1] for ln in lines[3:7]]
    assert order == ["train_big", "infer", "notebook", "idle_job"], text
    assert "3.0 GiB" in text and "froze 210.00 ms" in text


def test_sorting_by_any_column_and_reversed():
    rows = frame(0).processes
    assert [r.pid for r in sort_rows(rows, "pid", "shim")] == [1111, 2222, 3333, 4242]
    assert [r.pid for r in sort_rows(rows, "pid", "shim", reverse=True)] == [4242, 3333, 2222, 1111]
    assert [r.comm for r in sort_rows(rows, "wait", "shim")][0] == "notebook"


def test_sparkline_scales_between_the_extremes():
    assert sparkline((0.0, 5.0, 10.0)) == "▁▅█"
    assert sparkline((100.0, 101.0, 150.0)) == "▁▁█" and sparkline((100.0, 100.5)) == "▄▄"
    assert sparkline(()) == "" and sparkline((0.0, 0.0)) == "▁▁"


def test_adapter_says_not_available_for_what_the_checkpointer_lacks(tmp_path):
    def checkpoint(pid, out, *, progress):  # the shape of gputrace.checkpointer.checkpoint
        progress("write", 5, 10)
        return types.SimpleNamespace(path=out, bytes=10, freeze_ns=500_000_000)

    ops = actions.Operations(checkpoint=checkpoint)
    a = actions.CheckpointerAdapter(root=tmp_path, ops=ops)
    assert a.available("checkpoint") and not a.available("suspend")
    seen = []
    res = a.checkpoint(7, lambda f, m: seen.append((f, m)))
    assert seen == [(0.5, "write   [############............]  5 B of 10 B   50%")]
    assert res.freeze_s == 0.5 and res.checkpoint.id.startswith(f"{tmp_path}/7-") and res.checkpoint.size_bytes == 10
    ck = tmp_path / "7-20260101T000000"
    ck.mkdir()
    (ck / "manifest.json").write_bytes(orjson.dumps({
        "schema": 1, "format": "gputrace-checkpoint", "complete": True, "target": {"pid": 7}, "created_unix": 9.0,
        "bytes": 4096, "allocations": [], "timings": {"freeze_ns": 2_000_000},
        "data": {"file": "data.img", "bytes": 4096, "chunk_bytes": 4096, "hash": "xxh3_64", "chunks": ["0" * 16]}}))
    (tmp_path / "7-partial").mkdir()  # no manifest: not a checkpoint
    (tmp_path / "7-damaged").mkdir()
    (tmp_path / "7-damaged" / "manifest.json").write_bytes(b'{"complete": true, "target": {"pid": 7}}')
    assert a.list_checkpoints(7) == [actions.Checkpoint(str(ck), 9.0, 4096, 0.002)]
    import shutil

    shutil.rmtree(ck)
    assert a.list_checkpoints(7) == [] and not any(k[0] == str(ck) for k in a._manifests)  # nor kept in memory
    ck.mkdir()
    (ck / "manifest.json").write_bytes(orjson.dumps({
        "schema": 1, "format": "gputrace-checkpoint", "complete": True, "target": {"pid": 7}, "created_unix": 9.0,
        "bytes": 4096, "allocations": [], "timings": {"freeze_ns": 2_000_000},
        "data": {"file": "data.img", "bytes": 4096, "chunk_bytes": 4096, "hash": "xxh3_64", "chunks": ["0" * 16]}}))
    with pytest.raises(actions.ActionUnavailable, match="not available"):
        a.suspend(7, lambda f, m: None)
    a.ops = actions.Operations(resume=lambda pid: 1 / 0)  # a bug in the library must reach the UI as an error
    with pytest.raises(actions.GputraceError, match="ZeroDivisionError"):
        a.resume(7, lambda f, m: None)
    assert not actions.CheckpointerAdapter(ops=actions.Operations()).available("checkpoint")


def test_adapter_fits_the_real_checkpointer():
    a = actions.CheckpointerAdapter()
    assert all(a.available(action) for action in actions.ACTIONS)


@pytest.mark.parametrize("args, msg", [
    (["top", "--json"], "--json goes with --once"),
    (["top", "--once", "--replay", "no-such-recording"], "cannot read no-such-recording"),
    (["top", "--preset", "nope"], "unknown preset"),
    (["top", "--once", "--replay", "x.jsonl", "--tree", "1"], "--tree picks live processes"),
])
def test_top_usage_errors(args, msg):
    p = subprocess.run(CLI + args, capture_output=True, text=True)
    assert p.returncode == 2 and msg in p.stderr, p.stderr


def test_adapter_whole_job_checkpoint_leaves_it_running_and_reports_the_freeze(tmp_path):
    got = []

    held = []

    def checkpoint_full(pid, out, *, leave_running=False, progress=None):  # checkpointer.full's shape
        got.append((pid, out, leave_running, list(held)))
        progress("dump", 3, 4)
        return types.SimpleNamespace(path=out, image_bytes=2048, freeze_ns=250_000_000)

    @contextlib.contextmanager
    def hold_tracing(pid):  # LiveSource.hold_tracing's shape
        held.append(pid)
        try:
            yield True
        finally:
            held.remove(pid)

    a = actions.CheckpointerAdapter(root=tmp_path, ops=actions.Operations(checkpoint_full=checkpoint_full))
    assert a.available("checkpoint_full") and not a.available("checkpoint")
    a.hold_tracing = hold_tracing
    seen = []
    res = a.checkpoint_full(2**22 + 7, lambda f, m: seen.append((f, m)))  # no such process: nothing to settle
    assert len(got) == 1 and got[0][0] == 2**22 + 7 and got[0][2] is True
    assert got[0][3] == [2**22 + 7] and held == []  # top's probes were off the job during the checkpoint only
    assert got[0][1].startswith(f"{tmp_path}/full-{2**22 + 7}-")  # full-PID-TIME: what `r` lists
    assert seen[-1][0] == 0.75 and seen[-1][1].startswith("dump    [##################......]  3 B of 4 B   75%")
    assert "pausing" in seen[0][1]
    assert res.action == "checkpoint_full" and res.freeze_s == 0.25
    assert res.checkpoint.id == got[0][1] and res.checkpoint.size_bytes == 2048 and res.checkpoint.freeze_s == 0.25
    assert "the job runs on" in res.message and "r brings it back" in res.message
    assert a.list_checkpoints(7) == [] and a.list_full_checkpoints(7) == []

    a.ops = actions.Operations(checkpoint_full=lambda pid, out, **kw: (_ for _ in ()).throw(actions.GputraceError("CRIU is not installed", "h")))
    with pytest.raises(actions.GputraceError, match="CRIU is not installed"):
        a.checkpoint_full(7, lambda f, m: None)
    assert held == []
    a.ops = actions.Operations(checkpoint_full=lambda pid, out, **kw: 1 / 0)
    with pytest.raises(actions.GputraceError, match="ZeroDivisionError"):
        a.checkpoint_full(7, lambda f, m: None)
    assert not actions.CheckpointerAdapter(ops=actions.Operations()).available("checkpoint_full")


def test_live_source_hands_the_same_row_until_its_process_has_something_new():
    """A refresh without a window brings no new figures: the row is the very same object, so the
    screen reuses its audits and cells; anything new about the process makes a new row."""
    from gputrace.tracer.targets import LibcudaFile
    from gputrace.hostview.live import LiveSource

    src = LiveSource(discover=lambda hints: {})
    lib = LibcudaFile("/usr/lib/libcuda.so.1", "/usr/lib/libcuda.so.1", 1, 2)
    snap = frame(0).processes[1].snapshot
    ft = types.SimpleNamespace(take=lambda pid: (ft.snap, ft.hist), threads_of=lambda pid: ft.threads)
    ft.snap, ft.hist, ft.threads = snap, (1.0, 2.0), (None, None)
    first = src._row(snap.pid, ft, lib)
    src._rows = {snap.pid: first}
    assert src._row(snap.pid, ft, lib) is first
    ft.hist = (1.0, 2.0, 3.0)  # a new point: a new measurement came
    second = src._row(snap.pid, ft, lib)
    assert second is not first and second.calls_history == (1.0, 2.0, 3.0) and second.snapshot is snap
    src._rows = {snap.pid: second}
    ft.threads = ((), {"tid": snap.pid, "comm": "x", "busy_s_per_s": 1.0})  # its threads read again
    third = src._row(snap.pid, ft, lib)
    assert third is not second and third.threads == () and third.pacer["tid"] == snap.pid


def test_shares_read_at_a_glance():
    from gputrace.tui.text import fmt_share

    assert [fmt_share(x) for x in (None, 0.0, 1.9e-8, 9.9e-6, 1.5e-5, 8e-5, 0.0075, 0.042, 0.25)] == \
        ["-", "0%", "<0.001%", "<0.001%", "0.0015%", "0.0080%", "0.75%", "4.20%", "25.0%"]


def test_an_overhead_with_its_lower_bound_unknown_reads_as_at_most():
    """Before the wait is measured only the upper bound is known: "≤1.20%", never "-–1.20%"."""
    from types import SimpleNamespace

    from gputrace.tui.text import overhead_cell

    def row(lower, upper):
        return SimpleNamespace(audit=lambda preset: SimpleNamespace(slowdown_lower=lower, slowdown_upper=upper))

    assert [overhead_cell(row(lo, up), "shim") for lo, up in
            ((None, None), (None, 0.012), (None, 2.9e-8), (0.004, 0.012))] == ["-", "≤1.20%", "<0.001%", "0.40%–1.20%"]


def test_the_uis_progress_is_the_clis_line_with_its_rate_and_time_left():
    """top's status shows what the CLI's bar shows: bytes, share, rate and time left of the phase."""
    from gputrace.hostview.checkpoints import _reporter

    now = [100.0]
    seen = []
    report = _reporter(lambda f, text: seen.append((f, text)), clock=lambda: now[0])
    report("write", 0, 4 << 30)
    now[0] += 1.0
    report("write", 1 << 30, 4 << 30)
    f, text = seen[-1]
    assert f == 0.25 and "1.0 GiB of 4.0 GiB" in text and " 25%" in text
    assert "1.07 GB/s" in text and "3 s left" in text


def test_the_trend_column_is_as_wide_from_the_first_frame_as_after_many():
    from types import SimpleNamespace

    from gputrace.tui.text import COLUMNS, TREND_WIDTH

    cell = COLUMNS["trend"][1]
    widths = {len(cell(SimpleNamespace(calls_history=tuple(range(1, n + 1))), "shim", 0.0)) for n in (0, 1, 3, 10, 40)}
    assert widths == {TREND_WIDTH}
