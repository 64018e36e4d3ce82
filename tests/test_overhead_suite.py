"""The overhead suite (bench/overhead_suite.py) and its report (bench/overhead_report.py).

The suite is tried on simcuda: its Python launch-bound workload serves the GPU jobs' protocol, so the
harness (three processes, the shim, the tracer attached from outside, the emulated layer, resuming,
the time budget) runs for real here; only the workloads are simulated. The report is made from
committed results: tests/data/overhead-sim (a simcuda run of the suite, made by
`bench/overhead_suite.py --sim --out tests/data/overhead-sim --only 'steady:mlp' --attaches 2 --costs 0,500,2000`,
the attach reports left out, and `... --only 'ckpt:*' --ckpt-sizes 4,64`) and the committed GPU results behind
docs/overhead-report.md (COMMITTED: the command that makes it, as the report names it).
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
# The report's inputs as committed, in the order the command names them (bench/overhead_report.py's docstring).
COMMITTED = ["bench/results/overhead-h200", "--audit", "bench/results/audit-validate-h100",
             "--incremental", "bench/results/incremental-costs-h100-2",
             "--restore-whole", "bench/results/restore-whole-h100.json", "--rates", "bench/results/rates-h100-7"]


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
    assert "1. *What does the layer cost on a job that spans several GPUs?* **Not answered**" in text
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


def test_the_committed_report_is_what_the_command_makes_of_the_committed_results(tmp_path):
    md, plots = tmp_path / "overhead-report.md", tmp_path / "overhead-report"
    r = run([str(REPORT), *COMMITTED, "--md", str(md), "--plots", str(plots)])
    assert r.returncode == 0, r.stderr
    committed = (ROOT / "docs/overhead-report.md").read_text()
    assert md.read_text() == committed
    # The report names the command that made it, and that is this one.
    assert f"`.venv/bin/python bench/overhead_report.py {' '.join(COMMITTED)}`" in committed
    # Every plot it links is committed, and the command makes each of them and no other.
    linked = {ln.split("(overhead-report/")[1].rstrip(")") for ln in committed.splitlines() if ln.startswith("![")}
    assert linked == {p.name for p in plots.glob("*.png")}
    assert all((ROOT / "docs/overhead-report" / name).is_file() for name in linked)


def test_the_committed_report_states_the_results_figures(tmp_path):
    text = (ROOT / "docs/overhead-report.md").read_text()
    # The audit's rows: each workload and cost of audit_validate's own summary, its median and bounds beside.
    summary = orjson.loads((ROOT / "bench/results/audit-validate-h100/summary.json").read_bytes())
    for r in summary["rows"]:
        assert (f"| {r['workload']} | {r['cost_ns'] / 1000:g} µs | {100 * r['measured']:+.1f}% "
                f"({100 * r['ci'][0]:+.1f}%..{100 * r['ci'][1]:+.1f}%) |") in text
        assert f"| {100 * r['lower']:+.1f}%..{100 * r['upper']:+.1f}% |" in text
    inside = sum(1 for r in summary["rows"] if r["inside_point"])
    assert f"Inside the bounds within 1 point: **{inside} of {len(summary['rows'])}**" in text
    # The incremental checkpoints against the driver's, on the same job.
    inc = orjson.loads((ROOT / "bench/results/incremental-costs-h100-2/incremental-costs.json").read_bytes())
    for part in inc["parts"]:
        for ch in part["changes"]:
            s = ch["summary"]
            assert (f"| {part['size']} GiB | {part['storage']} | {ch['pct']:g}% changed | {1e3 * s['freeze_s']:.1f} | "
                    f"{s['total_s']:.3g} |") in text
        assert (f"| {part['size']} GiB | {part['storage']} | driver (lock to unlock) | "
                f"{part['driver']['freeze_ns'] / 1e6:.1f} |") in text
    # Whole-process cycles; what has not run says so, and why.
    assert "| train | 20 | yes | yes | 1.31 (1.19-1.56) |" in text
    for stage in ("steady:mlp", "steady:graph", "app:small", "app:large", "ckpt:16:disk", "ckpt:32:tmpfs", "ckpt:64:disk"):
        assert stage in text
    assert "Not measured: steady:mlp," in text and "tracer-rates issue (38)" in text
    assert "4. *Checkpointing inside the application against below it?* **Not yet**: not measured" in text


def test_an_input_missing_reads_not_measured(tmp_path):
    # The audit's results less one workload, and none of the other inputs given.
    audit = tmp_path / "audit"
    audit.mkdir()
    for f in (ROOT / "bench/results/audit-validate-h100").glob("*.json"):
        if f.name not in ("gpt2.json", "summary.json"):
            (audit / f.name).write_bytes(f.read_bytes())
    md = tmp_path / "report.md"
    r = run([str(REPORT), str(GPU_RESULTS), "--audit", str(audit), "--md", str(md)], timeout=300)
    assert r.returncode == 0, r.stderr
    text = md.read_text()
    assert f"| gpt2 | every cost | not measured: no gpt2.json in {audit} |" in text
    assert "| kvcache | 2 µs | " in text and "| gpt2 | 2 µs | " not in text
    assert "Inside the bounds within 1 point: **15 of 15**" in text
    for section in ("### Incremental checkpoints and restores", "### Whole-process checkpoints and restores"):
        after = text.split(section, 1)[1].split("\n\n")[1]
        assert after.startswith("Not measured: no results given (--"), after
    # An input named but absent is not measured either, and no figure of it is made up.
    r = run([str(REPORT), str(GPU_RESULTS), "--audit", str(tmp_path / "nothing"), "--incremental",
             str(tmp_path / "nothing"), "--md", str(md)], timeout=300)
    assert r.returncode == 0, r.stderr
    text = md.read_text()
    assert f"## The audit's prediction beside the measured slowdown\n\nNot measured: no workload's results in {tmp_path / 'nothing'}." in text
    assert f"Not measured: no incremental-costs.json in {tmp_path / 'nothing'}." in text
    assert "2. *What does it cost on a current GPU?* **Not yet**" in text


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
