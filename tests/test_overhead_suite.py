"""The overhead suite (bench/overhead_suite.py) and its report (bench/overhead_report.py).

The suite is tried on simcuda: its Python launch-bound workload serves the GPU jobs' protocol, so the
harness (three processes, the shim, the tracer attached from outside, the emulated layer, resuming,
the time budget) runs for real here; only the workloads are simulated. The report is made from
committed results: tests/data/overhead-sim (a simcuda run of the suite, made by
`bench/overhead_suite.py --sim --out tests/data/overhead-sim --only 'steady:mlp' --attaches 2 --costs 0,500,2000`,
the attach reports left out, and `... --only 'ckpt:*' --ckpt-sizes 4,64`) and, once they are committed, the GPU results behind docs/overhead-report.md.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "bench/overhead_suite.py"
REPORT = ROOT / "bench/overhead_report.py"
FIXTURE = ROOT / "tests/data/overhead-sim"
GPU_RESULTS = ROOT / "bench/results/overhead-h200"


def run(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.bpf
@pytest.mark.usefixtures("bpf_host")
@pytest.mark.timeout(900)
def test_the_suite_measures_a_workload_on_simcuda_and_resumes_where_it_stopped(tmp_path):
    out = tmp_path / "suite"
    # A budget too small for any stage: nothing runs, and the exit status says there is more to do.
    r = run([str(SUITE), "--sim", "--out", str(out), "--only", "steady:mlp", "--budget-s", "5"])
    assert r.returncode == 3, r.stdout + r.stderr
    assert "stopping before steady:mlp" in r.stdout and not (out / "steady-mlp.json").exists()

    packed = tmp_path / "out" / "suite.tar.xz"
    packed.parent.mkdir()
    r = run([str(SUITE), "--sim", "--out", str(out), "--only", "steady:mlp", "--attaches", "1", "--costs", "2000",
             "--pack", str(packed)])
    assert r.returncode == 0, r.stdout + r.stderr
    import tarfile
    with tarfile.open(packed) as tar:  # what a device call brings back: the stage and its attach report
        assert {"suite/steady-mlp.json", "suite/mlp-attach-5-0.json.xz"} <= set(tar.getnames())
    doc = orjson.loads((out / "steady-mlp.json").read_bytes())
    assert doc["device"] == "simcuda" and doc["job"] == "mlp"
    # Three distinct processes: the native one, the shim's, the control.
    assert len(set(doc["pids"].values())) == 3
    # The exact count: launch_bound_py's mix, 481 calls a step and one synchronize.
    per_step = doc["exact"]["calls_per_step"]
    assert per_step["cuLaunchKernel"] == pytest.approx(21, rel=0.02)
    assert sum(per_step.values()) == pytest.approx(482, rel=0.02)
    for k in ("control", "shim"):
        assert len(doc[k]["slowdowns"]) == doc["config"]["cycles"] and doc[k]["slowdown"]["median"] == statistics.median(doc[k]["slowdowns"])
    (pair,) = doc["tracer_pairs"]
    assert pair["attach_s"] == 5.0 and pair["accounted"] is not None and pair["rates"]["cuLaunchKernel"][0] > 0
    assert (out / "mlp-attach-5-0.json.xz").exists()  # the attach's report, kept compressed
    # The emulated layer slowed calls, and the layer over every class costs more than over launches.
    emu = {e["selection"]: e for e in doc["emulation"]}
    assert emu["submission"]["calls_slowed"] > 0 and emu["all"]["slowdown"] > emu["submission"]["slowdown"]
    assert doc["gpu"]["simulated"] and doc["gpu"]["gpu_busy_s_per_step"] > 0

    # Run again: the stage is done, nothing is run or rewritten.
    before = (out / "steady-mlp.json").stat().st_mtime_ns
    r = run([str(SUITE), "--sim", "--out", str(out), "--only", "steady:mlp"], timeout=120)
    assert r.returncode == 0 and "starting" not in r.stdout, r.stdout
    assert (out / "steady-mlp.json").stat().st_mtime_ns == before
    r = run([str(SUITE), "--out", str(out), "--only", "steady:*", "--list"], timeout=60)
    assert "steady:mlp         done" in r.stdout and "steady:gpt2 " in r.stdout


def report_of(d: Path, tmp_path: Path) -> str:
    md = tmp_path / "report.md"
    r = run([str(REPORT), str(d), "--md", str(md)], timeout=300)
    assert r.returncode == 0, r.stderr
    return md.read_text()


def test_the_report_states_each_workloads_figures_from_the_results(tmp_path):
    text = report_of(FIXTURE, tmp_path)
    doc = orjson.loads((FIXTURE / "steady-mlp.json").read_bytes())
    assert "dry run on simcuda" in text
    row = next(line for line in text.splitlines() if line.startswith("| mlp | "))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == f"{sum(doc['exact']['calls_per_step'].values()):.0f}"
    assert cells[6].startswith(f"{100 * statistics.median(doc['shim']['slowdowns']):.2f}% (")
    assert cells[5].startswith(f"{100 * statistics.median(doc['control']['slowdowns']):.2f}% (")
    # Every emulated row, with the audit's bounds beside it.
    for e in doc["emulation"]:
        assert f"| mlp | {e['cost_ns'] / 1000:g} µs, " in text
    assert "**Not answered here**" in text  # the multi-GPU question, said plainly
    # Every checkpoint path of every size and storage, with its freeze and whether the data came back.
    for f in sorted(FIXTURE.glob("ckpt-*.json")):
        c = orjson.loads(f.read_bytes())
        for name, p in c["paths"].items():
            assert (f"| {c['size']} {c['size_unit']} | {c['storage']} | {name} | {p['freeze_s']:.3g} | "
                    f"{p['back_s']:.3g} |") in text
            assert p["data_ok"]
    plots = sorted((tmp_path / "report").glob("*.png"))
    assert [p.name for p in plots] == ["freeze-vs-size.png", "prediction-vs-measurement.png",
                                       "slowdown-vs-calls-per-gpu-ms.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)


def test_a_figure_the_results_lack_reads_not_measured_never_zero(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    doc = orjson.loads((FIXTURE / "steady-mlp.json").read_bytes())
    del doc["gpu"]  # the profiler's answer lost: no GPU time, so no calls per GPU-ms
    (d / "steady-mlp.json").write_bytes(orjson.dumps(doc))
    row = next(line for line in report_of(d, tmp_path).splitlines() if line.startswith("| mlp | "))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2] == "not measured" and cells[3] == "not measured"


def test_a_prediction_off_by_more_than_a_point_says_why_or_that_it_is_not_explained(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    doc = orjson.loads((FIXTURE / "steady-mlp.json").read_bytes())
    e = doc["emulation"][0]
    e["slowdown"] = 5.0  # far above any bound
    (d / "steady-mlp.json").write_bytes(orjson.dumps(doc))
    assert "Why: not explained yet." in report_of(d, tmp_path)
    (d / "notes.json").write_bytes(orjson.dumps({"mlp": "a made-up reason, for the test"}))
    assert "Why: a made-up reason, for the test" in report_of(d, tmp_path)


@pytest.mark.skipif(not GPU_RESULTS.is_dir(), reason="no GPU results of the suite are committed yet")
def test_the_committed_report_is_what_the_script_makes_of_the_committed_results(tmp_path):
    md = tmp_path / "overhead-report.md"
    r = run([str(REPORT), str(GPU_RESULTS), "--md", str(md), "--plots", str(tmp_path / "overhead-report")])
    assert r.returncode == 0, r.stderr
    assert md.read_text() == (ROOT / "docs/overhead-report.md").read_text()


def test_the_failure_model_rows_come_from_each_methods_held_and_resume_times(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    app = {"schema": "gputrace.bench.appckpt/1", "device": "test data", "commit": None, "size": "small", "step_s": 0.05,
           "methods": {
               "torch": {"held_s": 2.0, "resume_s": 10.0, "write_s": 2.0, "bytes": 1000, "background_write": False},
               "dcp-async": {"held_s": 0.5, "resume_s": 12.0, "write_s": 80.0, "bytes": 1000, "background_write": True},
               "gputrace-full": {"held_s": None, "resume_s": None, "error": "CRIU refused the job"}}}
    (d / "app-small.json").write_bytes(orjson.dumps(app))
    text = report_of(d, tmp_path)
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in text.splitlines() if line.startswith("| small | ")}
    # torch: blocking, C = 2 s: the interval C / 1% = 200 s, the loss half of it plus the 10-s resume.
    assert rows["torch"][5:7] == ["200 s", "110 s"]
    # async: held 0.5 s (C / 1% = 50 s), but its write takes 80 s, which floors the interval.
    assert rows["dcp-async"][5:7] == ["80 s", "52 s"]
    assert rows["gputrace-full"][2] == "not measured: CRIU refused the job"
    assert "**Answered** below." in text and "4. *Checkpointing inside" in text


def test_a_stage_that_fails_is_recorded_and_the_suite_goes_on(tmp_path):
    # No CRIU or root needed: a checkpoint stage on simcuda whose path cannot end in the time it is given.
    out = tmp_path / "suite"
    r = run([str(SUITE), "--sim", "--out", str(out), "--only", "steady:nothing,app:*"], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr  # app stages are not run on simcuda, and say so
    assert "not run on simcuda" in r.stdout
    assert orjson.loads((out / "app-small.json").read_bytes())["skipped"].startswith("not run on simcuda")
    app_rows = [line for line in report_of(out, tmp_path).splitlines() if "| every method | not measured" in line]
    assert len(app_rows) == 2
    # A stage made to fail: a steady stage whose job cannot start.
    env_job = {"GPUTRACE_BENCH_JOB_CMD": "/bin/false"}
    r = subprocess.run([sys.executable, str(SUITE), "--out", str(out), "--only", "steady:mlp,steady:gpt2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, **env_job, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("mlp", "gpt2"):  # both tried: the first failure did not stop the second
        doc = orjson.loads((out / f"steady-{name}.json").read_bytes())
        assert doc["failed"] and "did not start" in doc["failed"]
    assert "2 failed" in r.stdout
    r = run([str(SUITE), "--out", str(out), "--only", "steady:mlp", "--list"], timeout=60)
    assert "steady:mlp         failed" in r.stdout
    text = report_of(out, tmp_path)
    assert "## Stages that failed (not measured)" in text and "- steady:mlp: SystemExit: mlp did not start" in text
