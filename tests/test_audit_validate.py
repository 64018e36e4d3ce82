"""bench/audit_validate.py's arithmetic (issue 40, part 3), on made-up data: a phase's rate from the step
ends inside it, the on/off schedule, each phase with the layer on against its two neighbours, and the
attach report's audit worked out again at another cost, which must be tracer/audit.py's own audit at
that cost (the same snapshot and threads). The harness itself runs end to end on simcuda with
`bench/audit_validate.py --sim` (it takes minutes: not a test)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import audit_validate as av  # noqa: E402

from gputrace.tracer.audit import audit, make_preset  # noqa: E402
from gputrace.tracer.classify import FunctionClass  # noqa: E402
from gputrace.tracer.model import FunctionStats, ProcessSnapshot  # noqa: E402
from gputrace.tracer.threads import ThreadSlack  # noqa: E402


def test_a_phases_rate_counts_the_whole_steps_inside_it():
    stamps = [i * 0.01 for i in range(100)]  # 100 steps a second
    assert av.phase_rate(stamps, 0.105, 0.305) == pytest.approx(100.0)
    assert av.phase_rate(stamps, 0.105, 0.125) is None  # 2 step ends: no rate
    assert av.phase_rate([], 0.0, 1.0) is None


def test_the_schedule_puts_every_phase_on_between_two_off_and_each_cost_as_often():
    s = av.schedule([500.0, 2000.0, 10000.0], 4, random.Random(1))
    assert len(s) == 2 * 12 + 1 and s[0] is None and s[-1] is None
    assert all(c is None for c in s[0::2]) and sorted(s[1::2]) == sorted([500.0, 2000.0, 10000.0] * 4)
    assert av.schedule([1.0, 2.0], 3, random.Random(1)) == av.schedule([1.0, 2.0], 3, random.Random(1))  # seeded


def test_each_phase_on_against_the_mean_of_its_neighbours():
    """Drift cancels: off phases at 100, 110, 120 steps/s and on phases at 95 and 105 (both 10% slower
    in time than the mean of their neighbours, 105 and 115); a phase without a rate drops its pairs."""
    ph = [{"cost_ns": None, "rate": 100.0}, {"cost_ns": 500.0, "rate": 105 / 1.1},
          {"cost_ns": None, "rate": 110.0}, {"cost_ns": 2000.0, "rate": 115 / 1.1}, {"cost_ns": None, "rate": 120.0},
          {"cost_ns": 500.0, "rate": 90.0}, {"cost_ns": None, "rate": None}]
    s = av.slowdowns(ph)
    assert s.keys() == {500.0, 2000.0}
    assert s[500.0] == [pytest.approx(0.1)] and s[2000.0] == [pytest.approx(0.1)]


def flat(d, prefix=""):
    """Every leaf of a nested dict/list, by path (numbers compared approximately)."""
    if isinstance(d, dict):
        return {k2: v for k, x in d.items() for k2, v in flat(x, f"{prefix}.{k}").items()}
    if isinstance(d, (list, tuple)):
        return {k2: v for i, x in enumerate(d) for k2, v in flat(x, f"{prefix}[{i}]").items()}
    return {prefix: d}


def report_of(snap, threads, pacer) -> dict:
    a = audit(snap, make_preset("shim"), threads, pacer)
    return orjson.loads(orjson.dumps({"summary": snap.to_dict(), "audits": [a.to_dict(), {"preset": "proxy"}]}))


def snapshot(wait):
    launch = FunctionStats("cuLaunchKernel", FunctionClass.SUBMISSION, 50_000, 100_000.0, 100_000.0, 3000.0, 0, None,
                           None, None, None)
    push = FunctionStats("cuCtxPushCurrent_v2", FunctionClass.STATE, 20_000, 40_000.0, 40_000.0, 1000.0, 0, None,
                         None, None, None)
    return ProcessSnapshot(1, "job", 1.0, 1.0, None, (launch, push), 0.0, 0.1, wait)


@pytest.mark.parametrize("wait", [0.0, 0.1, None])
@pytest.mark.parametrize("cost", [500.0, 2000.0, 10000.0])
def test_the_attachs_audit_at_another_cost_is_the_audits_own(wait, cost):
    """Two calling threads (an idle worker with 3/4 of the calls and its share of the wait; a busy one
    waiting for a CPU), a function the shim does not gate beside: the report read back at `cost` is
    audit() at `cost`, field for field; without threads, the process basis likewise."""
    threads = (ThreadSlack(11, "worker", {"cuLaunchKernel": 0.75, "cuCtxPushCurrent_v2": 1.0}, 0.3, 0.05, 0.65, 1.0),
               ThreadSlack(12, "main", {"cuLaunchKernel": 0.25}, 0.6, 0.3, 0.1, 0.0))
    pacer = {"tid": 12, "comm": "main", "busy_s_per_s": 0.9}
    for ts in (threads, None):
        snap = snapshot(wait)
        got = av.audit_at(report_of(snap, ts, pacer), cost)
        want = orjson.loads(orjson.dumps(audit(snap, make_preset("shim", cost), ts, pacer).to_dict()))
        fg, fw = flat(got), flat(want)
        assert fg.keys() == fw.keys()
        for k, v in fw.items():
            assert fg[k] == (pytest.approx(v) if isinstance(v, float) else v), k
        assert got["lower_basis"] == ("threads" if ts else "process")
    # At another speed of the job (every rate x 2), and with the rates taken as exact.
    fast = av.audit_at(report_of(snapshot(wait), threads, pacer), cost, 2.0, exact=True)
    s2 = snapshot(wait)
    s2 = s2.__class__(**{**s2.__dict__, "functions": tuple(
        f.__class__(**{**f.__dict__, "rate_hz": 2 * f.rate_hz, "calls_estimated": 2 * f.calls_estimated,
                       "rate_err_hz": 0.0}) for f in s2.functions)})
    want = audit(s2, make_preset("shim", cost), threads, pacer)
    assert fast["added_cpu_s_per_s"] == pytest.approx(2 * 100_000.0 * cost * 1e-9)
    assert fast["slowdown_upper"] == pytest.approx(want.slowdown_upper)
    assert fast["slowdown_lower"] == (None if want.slowdown_lower is None else pytest.approx(want.slowdown_lower))


def test_the_verdict_and_the_summary(tmp_path):
    b = {"slowdown_lower": 0.05, "slowdown_upper": 0.2, "slowdown_lower_min": 0.03, "slowdown_upper_max": 0.25}
    assert av.verdict(0.045, b) == {"point": True, "ranged": True, "lower_known": True}
    assert av.verdict(0.035, b)["point"] is False and av.verdict(0.035, b)["ranged"] is True
    assert av.verdict(0.3, b)["ranged"] is False
    assert av.verdict(0.01, b | {"slowdown_lower": None, "slowdown_lower_min": None})["ranged"] is True
    assert av.verdict(None, b)["ranged"] is None
    doc = {"schema": av.SCHEMA, "workload": "graph", "device": "d", "commit": "c",
           "alternation": {"phase_s": 0.1, "costs": {"2000": {"median": 0.1, "lo": 0.095, "hi": 0.104, "pairs": 64,
                                                             "resolved": True}}},
           "bounds": {"2000": b | {"lower_basis": "threads", "not_known": None, "verdict": av.verdict(0.1, b)}}}
    (tmp_path / "graph.json").write_bytes(orjson.dumps(doc))
    (tmp_path / "jax.json").write_bytes(orjson.dumps({"schema": av.SCHEMA, "workload": "jax", "failed": "no jax"}))
    (tmp_path / "graph-attach.obs.json").write_bytes(b"{}")  # not a result: left out
    s = av.write_summary(tmp_path)
    assert [r["workload"] for r in s["rows"]] == ["jax", "graph"]
    assert s["rows"][1]["inside_ranged"] is True and s["rows"][1]["pairs"] == 64
    md = (tmp_path / "summary.md").read_text()
    assert "| graph | 2 us | +10.0% (+9.5%..+10.4%) | 64 x 100 ms | +5.0%..+20.0% | +3.0%..+25.0% | threads | yes " \
        "| not known | not known |" in md
    assert "failed: no jax" in md
