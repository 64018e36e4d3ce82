"""bench/audit_table.py (the tables of bench/audit_gpu.py's runs) prints the figures committed beside
the H200 results from the reports those runs saved. Only what the reports hold: none of these
re-estimates an archived attach with today's estimator, whose changes those runs cannot follow."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
R13 = ROOT / "bench/results/audit-h200-13"
RUNS13 = [str(R13 / f"run{n}") for n in (25, 26, 27, 28, 29)]
R14 = ROOT / "bench/results/audit-h200-14"
RUNS14 = [str(R14 / f"run{n}") for n in (30, 31, 32, 33)]


@pytest.mark.parametrize("argv, expected", [
    (["bench/audit_table.py", *RUNS13], R13 / "table.txt"),
    (["bench/audit_table.py", "--summary", *RUNS13], R13 / "summary-cost.txt"),
    (["bench/audit_table.py", "--misses", *RUNS13], R13 / "misses-5s.txt"),
    (["bench/audit_table.py", *RUNS14], R14 / "table.txt"),
    (["bench/audit_table.py", "--summary", *RUNS14], R14 / "summary-cost.txt"),
    (["bench/audit_table.py", "--misses", *RUNS14], R14 / "misses-5s.txt"),
    (["bench/audit_table.py", "--step-log", *RUNS14[2:]], R14 / "step-log-5s.txt"),
    (["bench/audit_table.py", "--whole", *RUNS14], R14 / "whole-split-5s.txt"),
], ids=["table13", "summary13", "misses13", "table14", "summary14", "misses14", "steplog14", "whole14"])
def test_the_committed_offline_figures_are_what_the_scripts_print(argv, expected):
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected.read_text()


def test_the_step_log_reads_an_attach_whose_report_logged_no_step_window(tmp_path):
    """An attach that planned no window as whole steps (the copies and graph jobs; since e6679ab also
    one whose every step window was shorter than a step, which the log leaves out) has
    `step_windows: []` in its report: --step-log says so rather than failing on the whole run."""
    import json
    import lzma
    import shutil

    run = tmp_path / "run33"
    shutil.copytree(R14 / "run33", run)
    src = run / "mlp-attach-5-0.json.xz"
    doc = json.loads(lzma.open(src).read())
    doc["attach"]["step_windows"] = []
    src.unlink()
    (run / "mlp-attach-5-0.json").write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, "bench/audit_table.py", "--step-log", str(run)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-400:]
    assert "run33 mlp 0 of every function" in r.stdout and "planned step none" in r.stdout


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
