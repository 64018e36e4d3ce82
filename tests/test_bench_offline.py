"""The GPU benchmarks' offline parts, which run without a GPU: how they turn a run's saved reports into
their tables. No test here pins the printed output of an archived experiment."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_rate_the_report_does_not_know_is_no_row_estimate_in_the_gpu_rates_table():
    """bench/rates_gpu.py keeps a not-known rate's range middle beside its name (for re-analysis); its
    table must not count that as an estimate: the row says not known, is neither covered nor within
    10%, and the lockstep ratios of the others are not taken against it."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import rates_gpu
    finally:
        sys.path.remove(str(ROOT / "bench"))
    truth = {"a": 100e3, "b": 50e3, "c": 25e3}
    rates = {"a": [101e3, 5e3], "b": [50e3, 60e3], "c": [25.5e3, 2e3]}
    rows = {r["function"]: r for r in rates_gpu.rows_of(truth, rates, unknown={"b"})}
    assert rows["b"]["not_known"] and rows["b"]["estimate_hz"] is None and not rows["b"]["covered"]
    assert rows["a"].get("not_known") is None and rows["a"]["covered"]
    assert rows["c"]["ratio_rel_error"] is not None
    rows = {r["function"]: r for r in rates_gpu.rows_of(truth, rates, unknown={"a"})}
    assert rows["c"]["ratio_rel_error"] is None  # its reference (the busiest) not known
