"""`gputrace report`: recordings of several nodes (fixtures) merged by workload, the table and its
verdicts, the plots and the JSON."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import orjson
import pytest

from gputrace.hostview.fleet import load, summarize
from gputrace.hostview.pods import Identity
from gputrace.hostview.recording import write_record
from gputrace.tracer.audit import PRESETS, audit, make_preset
from topdata import PROCS, frame

CLI = [sys.executable, "-m", "gputrace"]


def node(host: str, k: int, pod: Identity | None = None, procs=PROCS):
    f = dataclasses.replace(frame(k, procs), host=host)
    if pod is not None:
        f = dataclasses.replace(f, processes=tuple(dataclasses.replace(r, identity=pod) if r.comm == "train_big" else r
                                                   for r in f.processes))
    return f


@pytest.fixture
def recordings(tmp_path):
    pod = lambda name: Identity("containerd", "c" * 64, "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", name, "ml", "trainer")  # noqa: E731
    a, b = tmp_path / "node-a.jsonl", tmp_path / "node-b.jsonl"
    write_record(str(a), [node("node-a", 0, pod("trainer-7d9f8b6c5d-x2k4q")), node("node-a", 1, pod("trainer-7d9f8b6c5d-x2k4q"))])
    write_record(str(b), [node("node-b", 2, pod("trainer-7d9f8b6c5d-9wz2n"))])
    return [str(a), str(b)]


def test_merge_counts_each_process_once_as_last_recorded(recordings):
    jobs = load(recordings)
    assert len(jobs) == 2 * len(PROCS)  # the same pids on two nodes are different processes
    a_big = next(j for j in jobs if j.host == "node-a" and j.row.comm == "train_big")
    assert a_big.row.snapshot == frame(1).processes[0].snapshot  # the later of node-a's two frames
    assert a_big.workload == "trainer" and a_big.kind == "pod workload"
    assert next(j for j in jobs if j.row.comm == "infer").workload == "infer"


def test_workloads_and_verdicts(recordings):
    jobs = load(recordings)
    preset = make_preset("proxy")
    rows = {w.workload: w for w in summarize(jobs, preset, 0.01)}
    assert set(rows) == {"trainer", "infer", "idle_job", "notebook"}
    t = rows["trainer"]
    assert t.nodes == ("node-a", "node-b") and t.processes == 2
    worst = max((audit(j.row.snapshot, preset) for j in jobs if j.workload == "trainer"), key=lambda a: a.slowdown_upper)
    assert t.slowdown_upper_max == pytest.approx(worst.slowdown_upper)
    for w in rows.values():  # the verdict is what the bounds say
        lo, hi = w.slowdown_lower_max, w.slowdown_upper_max
        assert w.verdict == ("above" if lo is not None and lo > 0.01 else "maybe above" if hi > 0.01 else "below")
    assert rows["idle_job"].verdict == "below" and rows["trainer"].verdict == "above"
    ordered = summarize(jobs, preset, 0.01)
    assert [w.slowdown_upper_max for w in ordered] == sorted((w.slowdown_upper_max for w in ordered), reverse=True)


def test_report_command_writes_table_plots_and_json(recordings, tmp_path):
    out = tmp_path / "fleet"
    r = subprocess.run(CLI + ["report", *recordings, "-o", str(out), "--preset", "proxy", "--threshold", "1%"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    md = (out / "report.md").read_text()
    assert "| trainer | pod workload | 2 | 2 |" in md and "Above the threshold: " in md
    for png in ("slowdown.png", "calls.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png})" in md
    doc = orjson.loads((out / "report.json").read_bytes())
    assert doc["kind"] == "gputrace.fleet" and doc["nodes"] == ["node-a", "node-b"] and doc["processes"] == 8
    assert doc["preset"]["cost_ns"] == PRESETS["proxy"].cost_ns
    j = subprocess.run(CLI + ["report", *recordings, "--json", "--cost-ns", "0"], capture_output=True, text=True)
    assert j.returncode == 0 and all(w["verdict"] == "below" for w in orjson.loads(j.stdout)["workloads"])


@pytest.mark.parametrize("extra, msg", [(["--preset", "nope"], "unknown preset"),
                                        (["--classes", "sideways"], "--classes"),
                                        (["--threshold", "abc"], "invalid threshold")])
def test_report_usage_errors(recordings, extra, msg):
    r = subprocess.run(CLI + ["report", *recordings, *extra], capture_output=True, text=True)
    assert r.returncode == 2 and msg in r.stderr and "hint:" in r.stderr


def test_report_refuses_what_is_not_a_recording(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"kind": "something else"}\n')
    r = subprocess.run(CLI + ["report", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and "not a gputrace recording" in r.stderr
