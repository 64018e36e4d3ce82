"""bench/failure_model.py: the checkpoint interval, the work lost per failure and the Young/Daly optimum,
against cases computed by hand."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from failure_model import CheckpointCosts, FailureModel, assumptions, expected  # noqa: E402


def test_a_blocking_checkpoint_at_one_percent():
    # C = 6 s, R = 30 s, M = 24 h = 86400 s, step 0.25 s.
    e = expected(CheckpointCosts(held_s=6.0, resume_s=30.0, step_s=0.25), FailureModel(mtbf_h=24))
    assert e.known and not e.unknown
    assert e.interval_s == pytest.approx(600.0)  # 6 / 0.01
    assert e.interval_floored is False
    assert e.overhead == pytest.approx(0.01)
    assert e.lost_per_failure_s == pytest.approx(330.0)  # 600 / 2 + 30
    assert e.lost_per_failure_steps == pytest.approx(1320.0)  # 330 / 0.25
    assert e.usable_after_s == pytest.approx(6.0)  # blocking: complete when the job is released
    assert e.lost_with_lag_s == pytest.approx(336.0)  # 300 + 6 + 30
    assert e.waste_fraction == pytest.approx(0.01 + 330 / 86400)  # 0.0138194...
    assert e.young_interval_s == pytest.approx(math.sqrt(1036800.0))  # sqrt(2 * 6 * 86400) = 1018.23 s
    assert e.young_interval_s == pytest.approx(1018.2338, rel=1e-6)
    assert e.young_overhead == pytest.approx(6 / 1018.2338, rel=1e-6)  # 0.0058926
    assert e.young_lost_per_failure_s == pytest.approx(1018.2338 / 2 + 30, rel=1e-6)  # 539.12 s
    assert e.young_waste_fraction == pytest.approx(6 / 1018.2338 + 539.1169 / 86400, rel=1e-5)
    assert e.notes == ()


def test_another_target_and_mtbf():
    # C = 1.5 s at 5%: tau = 30 s; R = 12 s: L = 27 s; M = 0.5 h = 1800 s: young = sqrt(5400) = 73.48 s.
    e = expected(CheckpointCosts(held_s=1.5, resume_s=12.0), FailureModel(mtbf_h=0.5, target_overhead=0.05))
    assert e.interval_s == pytest.approx(30.0) and e.overhead == pytest.approx(0.05)
    assert e.lost_per_failure_s == pytest.approx(27.0)
    assert e.waste_fraction == pytest.approx(0.05 + 27 / 1800)  # 0.065
    assert e.young_interval_s == pytest.approx(73.4847, rel=1e-5)
    assert e.lost_per_failure_steps is None and "lost_per_failure_steps" in e.unknown  # no step time given


def test_a_background_write_floors_the_interval():
    # Staging holds the job 0.5 s; the write completes 120 s after the checkpoint's start; R = 20 s.
    # C / target = 50 s < W = 120 s: tau = 120 s, overhead 0.5 / 120 = 0.41667%, under the target.
    e = expected(CheckpointCosts(held_s=0.5, resume_s=20.0, write_s=120.0), FailureModel(mtbf_h=1))
    assert e.known
    assert e.interval_s == pytest.approx(120.0) and e.interval_floored is True
    assert e.overhead == pytest.approx(0.5 / 120)
    assert e.lost_per_failure_s == pytest.approx(80.0)  # 120 / 2 + 20
    assert e.usable_after_s == pytest.approx(120.0)
    assert e.lost_with_lag_s == pytest.approx(200.0)  # 60 + 120 + 20
    # Young: sqrt(2 * 0.5 * 3600) = 60 s, below the write's 120 s: floored too.
    assert e.young_interval_s == pytest.approx(120.0) and e.young_interval_floored is True
    assert e.young_overhead == pytest.approx(0.5 / 120)
    assert any("longer than C / target" in n for n in e.notes)


def test_a_background_write_shorter_than_the_interval_changes_nothing_but_the_lag():
    # C = 2 s: tau = 200 s > W = 100 s; R = 10 s.
    e = expected(CheckpointCosts(held_s=2.0, resume_s=10.0, write_s=100.0), FailureModel(mtbf_h=24))
    assert e.interval_s == pytest.approx(200.0) and e.interval_floored is False
    assert e.overhead == pytest.approx(0.01)
    assert e.lost_per_failure_s == pytest.approx(110.0)
    assert e.lost_with_lag_s == pytest.approx(210.0)  # 100 + 100 + 10
    assert e.young_interval_s == pytest.approx(math.sqrt(2 * 2 * 86400))  # 587.88 s, above W
    assert e.young_interval_floored is False


@pytest.mark.parametrize("held", [None, 0, 0.0, -1.0, float("nan")])
def test_an_unknown_or_zero_hold_is_not_known_rather_than_zero(held):
    e = expected(CheckpointCosts(held_s=held, resume_s=30.0, write_s=10.0, step_s=0.1), FailureModel(mtbf_h=24))
    assert e.known is False
    for k in ("interval_s", "overhead", "lost_per_failure_s", "lost_per_failure_steps", "waste_fraction",
              "young_interval_s", "young_overhead", "young_lost_per_failure_s"):
        assert getattr(e, k) is None, k
        assert "(C)" in e.unknown[k]


def test_an_unknown_resume_leaves_the_interval_known_and_the_loss_unknown():
    e = expected(CheckpointCosts(held_s=3.0, resume_s=None), FailureModel(mtbf_h=24))
    assert e.known is False
    assert e.interval_s == pytest.approx(300.0) and e.overhead == pytest.approx(0.01)
    assert e.young_interval_s == pytest.approx(math.sqrt(2 * 3 * 86400))
    for k in ("lost_per_failure_s", "lost_with_lag_s", "waste_fraction", "young_lost_per_failure_s"):
        assert getattr(e, k) is None and "(R)" in e.unknown[k]


def test_an_interval_longer_than_the_mtbf_is_flagged():
    # C = 60 s: tau = 6000 s, M = 1 h = 3600 s.
    e = expected(CheckpointCosts(held_s=60.0, resume_s=5.0), FailureModel(mtbf_h=1))
    assert e.interval_s == pytest.approx(6000.0)
    assert any("longer than the mean time between failures" in n for n in e.notes)


@pytest.mark.parametrize("kw", [{"mtbf_h": 0}, {"mtbf_h": -2}, {"mtbf_h": float("inf")},
                                {"mtbf_h": 24, "target_overhead": 0}, {"mtbf_h": 24, "target_overhead": 1.0}])
def test_a_model_outside_its_range_is_refused(kw):
    with pytest.raises(ValueError):
        FailureModel(**kw)


def test_the_result_serialises_to_json_with_its_reasons():
    e = expected(CheckpointCosts(held_s=None, resume_s=1.0), FailureModel(mtbf_h=24))
    d = json.loads(json.dumps(e.to_dict()))
    assert d["known"] is False and d["interval_s"] is None and d["unknown"]["interval_s"]
    assert "tau = C / 0.01" in assumptions(FailureModel(mtbf_h=24))
