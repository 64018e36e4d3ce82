"""The budgeted tracer's estimates held against the calls a job really made, on this host's kernel: jobs that
are already running when the tracer attaches, that start a hot function mid-run, that change phase while
traced, short and long. The job (simcuda's `phases` workload) logs its own cumulative counts every millisecond
against CLOCK_MONOTONIC, which the report's `started_monotonic_s` and intervals line up with.

Needs root and bcc (CI has both)."""

from __future__ import annotations

import math
import os
import random
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest

from gputrace.simcuda.truth import PhaseLog, phases_env, start_phases

pytestmark = [pytest.mark.bpf, pytest.mark.usefixtures("bpf_host"), pytest.mark.timeout(900)]

CLI = [sys.executable, "-m", "gputrace"]


def env() -> dict[str, str]:
    return phases_env()


def start_job(spawned, phases: list[str], log: Path, held: bool = False, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """A phases job, running (past its first driver calls) when this returns; `held`: its phases
    start only once a line is written to its stdin; `extra`: more of its options."""
    p = start_phases(phases, log, held, extra=extra)
    spawned.append(p)
    return p


Truth = PhaseLog  # the job's own log: calls of each function in any span


def session_span(report: dict) -> tuple[float, float]:
    """The CLOCK_MONOTONIC span the session's intervals cover."""
    t0 = report["attach"]["started_monotonic_s"]
    ivs = report["intervals"]
    return t0 + ivs[0]["t_start"], t0 + ivs[-1]["t_start"] + ivs[-1]["interval_s"]


def assert_tiled(report: dict) -> None:
    """The intervals cover the session without gaps: each starts where the last one ended. (The
    rows an interval counts are those read at its end less those read at the last one's, the kept
    functions' counts running on in between: an interval timed from its windows' start left out
    the 50-90 ms of set-up after the first, and every exact count read 2% high.)"""
    ivs = report["intervals"]
    assert ivs[0]["t_start"] == pytest.approx(0.0, abs=1e-6)
    for a, b in zip(ivs, ivs[1:]):
        assert b["t_start"] == pytest.approx(a["t_start"] + a["interval_s"], abs=1e-6), (a, b)


def rate_of(f: dict) -> tuple[float, float | None]:
    """A function's (rate, 95% half-width) in a report; one not known (null, its range beside it:
    docs/json-schema.md) as the middle of its range and half its width: the interval stated either way."""
    if f["rate_hz"] is None and f.get("rate_range_hz"):
        lo, hi = f["rate_range_hz"]
        return (lo + hi) / 2, (hi - lo) / 2
    return f["rate_hz"], f["rate_err_hz"]


def check(report: dict, truth: Truth, *, min_hz: float = 1000.0) -> list[tuple[str, float, float, float | None]]:
    """(name, true rate, estimate, stated half-width) of every function the job called above min_hz."""
    a, b = session_span(report)
    span = b - a
    est = {f["name"]: f for f in report["summary"]["functions"]}
    out = []
    for name, n in truth.calls(a, b).items():
        if n / span < min_hz:
            continue
        f = est.get(name)
        out.append((name, n / span, *(rate_of(f) if f else (0.0, 0.0))))
    return out


def in_process_report(s, ivs, summary) -> dict:
    """What `check` reads of a Session run in this process (its intervals, its summary)."""
    return {"attach": {"started_monotonic_s": s.started},
            "intervals": [{"t_start": iv.t_start, "interval_s": iv.interval_s} for iv in ivs],
            "summary": {"functions": [{"name": f.name, "rate_hz": f.rate_hz, "rate_err_hz": f.rate_err_hz}
                                      for f in summary.functions]}}


def attach_json(pid: int, seconds: float, out: Path, *extra: str, observations: Path | None = None) -> dict:
    """`observations`: a directory where the session writes the observations behind its estimates."""
    e = env() | ({"GPUTRACE_OBSERVATIONS": str(observations)} if observations else {})
    r = subprocess.run(CLI + ["attach", "-p", str(pid), "-d", str(seconds), "--json", "-q", "-o", str(out), *extra],
                       env=e, capture_output=True, text=True, timeout=seconds + 120)
    assert r.returncode == 0, r.stderr
    return orjson.loads(out.read_bytes())


def attach_then_release(job: subprocess.Popen, out: Path, *args: str) -> dict:
    """`attach -p` on a held job (start_job(held=True)), whose phases start once the tracer's first
    interval is out (its set-up takes 1 to over 5 s on CI machines); the report once both end."""
    tracer = subprocess.Popen(CLI + ["attach", "-p", str(job.pid), *args, "--json", "-o", str(out)], env=env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in tracer.stderr:  # the first live interval line: the probes are on
        if line.startswith("["):
            break
    job.stdin.write("go\n")
    job.stdin.flush()
    _, err = tracer.communicate(timeout=120)
    assert tracer.returncode == 0, err
    assert job.wait(timeout=60) == 0
    return orjson.loads(out.read_bytes())


@pytest.fixture
def finishing_job(spawned, tmp_path):
    """A phases job that ends by itself, so it writes its log: returns (process, log path)."""
    def make(phases: list[str], held: bool = False, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"log-{len(spawned)}.json"
        return start_job(spawned, phases, log, held, extra), log
    return make


def test_a_3s_attach_to_a_running_job_reads_every_busy_function_within_its_interval(finishing_job, tmp_path):
    job, log = finishing_job(["10:getdev=20,state=5,launch=2,capturing=1,spin=20000"])
    report = attach_json(job.pid, 3, tmp_path / "r.json")
    assert job.wait(timeout=60) == 0
    assert_tiled(report)
    rows = check(report, Truth(log))
    assert {r[0] for r in rows} >= {"cuCtxGetDevice_v2", "cuDevicePrimaryCtxGetState", "cuLaunchKernel"}
    for name, true, est, err in rows:
        assert err is not None and abs(est - true) <= err, (name, true, est, err)
    assert report["summary"]["not_measured"] is None


def test_a_hot_function_first_called_mid_run_is_counted_within_2_s(finishing_job, tmp_path):
    """cuMemGetInfo_v2 is first called some 3 s into a 7-s attach, at ~50k calls/s: on the watch link from the
    first window on, it is counted from its first call, and its rate over the session is its calls
    over the session. The job's phases start once the tracer's first interval is out (its set-up
    takes from 1 to over 5 s on CI machines: timed from the job's start, the switch could fall
    before the probes were on)."""
    job, log = finishing_job(["3:getdev=20,launch=2,spin=20000", "8:getdev=20,launch=2,meminfo=10,spin=20000"],
                             held=True)
    report = attach_then_release(job, tmp_path / "r.json", "-d", "7", "--interval", "0.5")
    truth = Truth(log)
    a, b = session_span(report)
    started = truth.t[next(i for i, c in enumerate(truth.counts)
                           if c[truth.names.index("cuMemGetInfo_v2")] > 0)]
    assert a + 1.0 < started < b - 2.5, (a, started, b)  # it did start well inside the attach
    # The first interval whose snapshot lists it, against when the job first called it.
    t0 = report["attach"]["started_monotonic_s"]
    first = next(iv for iv in report["intervals"]
                 if any(f["name"] == "cuMemGetInfo_v2" for f in iv["processes"][0]["functions"]))
    assert t0 + first["t_start"] + first["interval_s"] - started <= 2.0
    rows = {r[0]: r for r in check(report, truth)}
    name, true, est, err = rows["cuMemGetInfo_v2"]
    assert abs(est - true) <= err, rows[name]


def test_a_burst_of_set_up_calls_is_not_taken_for_the_jobs_step(finishing_job, tmp_path):
    """cuMemGetInfo_v2 called about 40 times in 30 ms once the probes are on, then never again (a
    runtime's set-up, as JAX's cuStreamQuery on an H100): counted on the watch link, its burst reads
    about 1.3k calls/s, a kept function regular enough to be the job's step. Windows armed to open at
    its next call never opened, and 4 of 5 intervals had none. Every interval after the first must
    be measured, and the busy functions read within their intervals."""
    job, log = finishing_job(["0.03:meminfo=1,spin=700000", "7:getdev=3,launch=1,spin=100000"], held=True)
    report = attach_then_release(job, tmp_path / "r.json", "-d", "5")
    missing = [iv["index"] for iv in report["intervals"][1:] if iv["processes"][0]["not_measured"]]
    assert not missing, (missing, report["attach"]["step_windows"])
    rows = check(report, Truth(log))
    assert {r[0] for r in rows} >= {"cuCtxGetDevice_v2", "cuLaunchKernel"}
    assert all(err is not None and abs(est - true) <= err for _, true, est, err in rows), rows


def test_a_hot_function_that_starts_in_the_last_interval_is_sampled_in_a_window_of_it(finishing_job, spawned):
    """Seen in the randomized runs on CI: a function first called in the last interval of an
    attach, after that interval's windows were planned without it, had only the watch link's count
    of its first calls as its rate, which reads low (the watch link's hits and the rebuild of its
    shard slow the job, and no marker measures by how much): 4,348 calls/s +-38,113 for 94,367.
    The windows after its move probe it, or one of its own follows before the interval ends."""
    from gputrace.tracer.session import Options, Session
    from gputrace.tracer.targets import libcuda_of

    job, log = finishing_job(["1.5:getdev=20,launch=2,spin=20000", "3:getdev=20,launch=2,meminfo=10,spin=20000"],
                             held=True)
    s = Session(job.pid, libcuda_of(job.pid).path, Options(1.0, 0.01))
    ivs = []

    def on_interval(iv):
        ivs.append(iv)
        if len(ivs) == 1:  # the scout is done: the hot function starts some 1.5 s from now, in the last interval
            job.stdin.write("go\n")
            job.stdin.flush()

    try:
        summary = s.run(2.2, on_interval)
        meminfo = next(i for i, f in s.ids.items() if f.name == "cuMemGetInfo_v2")
        last = s.tracee.observations[-1]
    finally:
        s.close()
    assert job.wait(timeout=60) == 0
    truth = Truth(log)
    report = in_process_report(s, ivs, summary)
    t0 = s.started + ivs[-1].t_start
    started = truth.t[next(i for i, c in enumerate(truth.counts) if c[truth.names.index("cuMemGetInfo_v2")] > 0)]
    assert t0 < started < t0 + ivs[-1].interval_s, (t0, started)  # it did start in the last interval
    assert any(meminfo in w.probed and not w.discovery for w in last.windows), last.windows
    rows = {r[0]: r for r in check(report, truth)}
    name, true, est, err = rows["cuMemGetInfo_v2"]
    assert abs(est - true) <= err, rows[name]


def test_a_kept_function_that_turns_hot_leaves_the_watch_link_at_once(finishing_job):
    """A function called 20 times a second is cheap enough to count every call (kept, on the watch
    link); when it turns hot, counting every call costs the job most of its time (seen in the
    randomized runs: 155k calls/s of a kept function counted to the interval's end, the job slowed
    to a third). The kept set is chosen again as soon as its hits pass their limit: the calls the
    watch link counts after the switch are a small part of those the job makes in that interval.
    And the estimate covers the truth (the function's windows after it left)."""
    from gputrace.tracer.session import Options, Session
    from gputrace.tracer.targets import libcuda_of

    job, log = finishing_job(["2.2:getdev=20,attr=1,launch=2,spin=20000,gpu=50000000",
                              "4:getdev=1,attr=20,spin=5000"], held=True)
    s = Session(job.pid, libcuda_of(job.pid).path, Options(1.0, 0.01))
    attr = next(i for i, f in s.ids.items() if f.name == "cuDeviceGetAttribute")
    ivs, kept = [], []

    def on_interval(iv):
        ivs.append(iv)
        kept.append(attr in s.policy.kept)
        if len(ivs) == 1:  # the scout is done: attr turns hot some 2.2 s from now, early in an interval
            job.stdin.write("go\n")
            job.stdin.flush()

    try:
        summary = s.run(5.2, on_interval)
        observations = list(s.tracee.observations)
    finally:
        s.close()
    assert job.wait(timeout=60) == 0
    truth = Truth(log)
    switched = truth.t[next(i for i, c in enumerate(truth.counts)
                            if c[truth.names.index("cuDeviceGetAttribute")] > 0 and i > 0
                            and c[truth.names.index("cuDeviceGetAttribute")] - truth.counts[i - 1][
                                truth.names.index("cuDeviceGetAttribute")] > 20)]
    k = next(i for i, iv in enumerate(ivs) if s.started + iv.t_start + iv.interval_s > switched)
    assert any(kept[:k]), kept  # it was kept before the switch
    end = s.started + ivs[k].t_start + ivs[k].interval_s
    made = truth.calls(switched, end)["cuDeviceGetAttribute"]
    watched = observations[k].watched_calls.get(attr, 0)
    assert watched < 0.5 * made, (watched, made, k)
    report = in_process_report(s, ivs, summary)
    rows = {r[0]: r for r in check(report, truth)}
    name, true, est, err = rows["cuDeviceGetAttribute"]
    assert abs(est - true) <= err, rows[name]


def test_a_rare_function_is_counted_every_call_and_a_hot_one_sampled(finishing_job, tmp_path):
    """cuDeviceGetAttribute once per 5-ms step costs next to nothing to count every call: after the
    first windows it stays on the watch link, and the report's figure for it is its count (no
    uncertainty); the hot cuCtxGetDevice_v2 beside it is sampled in windows, within its interval."""
    job, log = finishing_job(["9:getdev=40,attr=1,spin=20000,gpu=5000000"])
    report = attach_json(job.pid, 5, tmp_path / "r.json")
    assert job.wait(timeout=60) == 0
    rows = {r[0]: r for r in check(report, Truth(log), min_hz=100.0)}
    funcs = {f["name"]: f for f in report["summary"]["functions"]}
    attr, hot = funcs["cuDeviceGetAttribute"], funcs["cuCtxGetDevice_v2"]
    assert rate_of(hot)[1] > 0  # sampled
    name, true, est, err = rows["cuDeviceGetAttribute"]
    assert abs(est - true) <= err + 0.05 * true, rows[name]
    # Counted on the watch link from its second interval on: only the time before that is sampled.
    assert attr["calls_estimated"] == pytest.approx(attr["calls_observed"], rel=0.25)
    assert attr["rate_err_hz"] < 0.25 * attr["rate_hz"]


def test_functions_called_once_a_step_beside_hot_getters_read_within_their_interval(finishing_job, tmp_path):
    """A step of 0.5 ms on the GPU with 40 device getters and five other functions once each: each of
    the five reads within its interval and within 25% of its count, whatever the policy does with
    them (sampled, in a window of their own, or counted in full), and the five, called in the same
    steps, within 5% of one another. On this machine it passes without the rare window too (tested:
    RARE_SHARE = 0); the rare window's planning is tested in test_tracer_units.py, its benefit only
    on the H200. (Read against marker spans as long as the windows, 5-7 steps, or through the
    exposure, the five read -1.3..+20% in 12 attaches, +32% once on CI, each at its own error; read
    against a kept one's calls in each window, within 1% of the truth and of one another in 20.)"""
    job, log = finishing_job(["9:getdev=40,attr=1,current=1,state=1,capturing=1,event=1,spin=20000,gpu=500000"])
    report = attach_json(job.pid, 5, tmp_path / "r.json")
    assert job.wait(timeout=60) == 0
    rows = {r[0]: r for r in check(report, Truth(log), min_hz=100.0)}
    for name in FIVE_ONCE_A_STEP:
        _, true, est, err = rows[name]
        assert abs(est - true) <= err and abs(est - true) <= 0.25 * true, rows[name]
    ratios = [est / true for name, (_, true, est, _) in rows.items() if name in FIVE_ONCE_A_STEP]
    assert max(ratios) <= 1.05 * min(ratios), rows


def test_a_kept_function_of_another_thread_is_no_reference_for_the_windows(finishing_job, tmp_path):
    """A job whose main thread's probes take about 40% of its windows, and a second thread calling
    cuMemGetInfo_v2 300 times a second at its own pace, the cheapest function to keep: read against
    that thread's calls (as the step, or as a kept function's in each window), the windows stood for
    time the main thread did not have, and its functions read 4-6% low, outside their stated +-3-4%
    (tracer/estimator.py `kept_apart`). Each within its interval, and the three main-thread
    functions, called in the same steps, within 5% of one another."""
    job, log = finishing_job(["9:getdev=10,launch=3,capturing=1,spin=200000"], extra=("--side", "meminfo=300"))
    report = attach_json(job.pid, 5, tmp_path / "r.json")
    assert job.wait(timeout=60) == 0
    rows = {r[0]: r for r in check(report, Truth(log), min_hz=100.0)}
    main = ("cuCtxGetDevice_v2", "cuLaunchKernel", "cuStreamIsCapturing")
    assert set(main) | {"cuMemGetInfo_v2"} <= set(rows), rows
    for name, true, est, err in rows.values():
        assert err is not None and abs(est - true) <= err, rows[name]
    ratios = [rows[n][2] / rows[n][1] for n in main]
    assert max(ratios) <= 1.05 * min(ratios), rows


FIVE_ONCE_A_STEP = ("cuDeviceGetAttribute", "cuCtxGetCurrent", "cuDevicePrimaryCtxGetState", "cuStreamIsCapturing",
                    "cuEventRecord")


def test_step_windows_open_and_close_at_the_step_functions_calls(finishing_job, tmp_path):
    """A job whose step is one cuDeviceGetAttribute, 40 cuCtxGetDevice_v2, 3 cuDevicePrimaryCtxGetState
    and a kernel waited for: the windows after the first are windows of whole steps of a function it
    calls once a step (kept: counted every call), armed
    in the program to open at a call of the step function and close `steps` calls later, so each
    counted exactly 40 and 3 a step (the job has one thread), and the rates read within 10%."""
    from gputrace.tracer import estimator as est

    job, log = finishing_job(["9:getdev=40,attr=1,state=3,spin=20000,gpu=5000000"])
    obs_dir = tmp_path / "obs"
    obs_dir.mkdir()
    report = attach_json(job.pid, 4, tmp_path / "r.json", observations=obs_dir)
    assert job.wait(timeout=60) == 0
    doc = orjson.loads(next(obs_dir.iterdir()).read_bytes())
    names = doc["functions"]
    ids = {names[k]: int(k) for k in names}
    obs, _ = est.load_observations(doc)
    stepped = [w for o in obs for w in o.windows if w.steps]
    assert len(stepped) >= 4, [w for o in obs for w in o.windows]
    once = {ids[n] for n in ("cuDeviceGetAttribute", "cuLaunchKernel", "cuStreamSynchronize") if n in ids}
    assert_tiled(report)
    for w in stepped:
        assert w.step_func in once  # a function called once a step
        for name, per_step in (("cuCtxGetDevice_v2", 40), ("cuDevicePrimaryCtxGetState", 3)):
            if ids[name] in w.probed:
                assert w.calls.get(ids[name], 0) == per_step * w.steps, (name, w)
    for name, true, rate, err in check(report, Truth(log), min_hz=100.0):
        assert abs(rate - true) <= min(err, 0.1 * true), (name, true, rate, err)
    # The report's log of step windows says the same: one "whole" try per step window counted.
    tries = report["attach"]["step_windows"]
    whole = [t for t in tries if t["outcome"] == "whole"]
    assert len(whole) == len(stepped), tries
    assert all(t["wait_s"] >= 0 and t["span_s"] > 0 and t["gaps"] >= 1 for t in whole), whole


def test_a_function_called_in_a_burst_each_step_is_not_the_step(finishing_job, tmp_path):
    """cuDeviceGetAttribute three times a step among 40 getters, then 6 ms of the job's own work: the
    only function cheap enough to keep (at a 5% budget on this host's 9-us probes), so the slowest
    kept, but whole numbers of its calls are no whole steps (two gaps of microseconds, one of 6 ms).
    The gaps between its calls vary far more than a step's do: it is found irregular, no window is a
    step window of it, and the rates read within their intervals."""
    from gputrace.tracer import estimator as est

    job, log = finishing_job(["9:getdev=40,attr=3,spin=6000000"])
    obs_dir = tmp_path / "obs"
    obs_dir.mkdir()
    report = attach_json(job.pid, 4, tmp_path / "r.json", "--budget", "0.05", observations=obs_dir)
    assert job.wait(timeout=60) == 0
    doc = orjson.loads(next(obs_dir.iterdir()).read_bytes())
    ids = {v: int(k) for k, v in doc["functions"].items()}
    obs, _ = est.load_observations(doc)
    attr = ids["cuDeviceGetAttribute"]
    # It was kept (counted on the watch link, every call, in the intervals after the first few):
    assert any(o.watched_calls.get(attr, 0) and not o.unwatched_s.get(attr) for o in obs), obs
    assert all(w.step_func != attr for o in obs for w in o.windows if w.steps)
    for name, true, rate, err in check(report, Truth(log), min_hz=100.0):
        assert abs(rate - true) <= err, (name, true, rate, err)
    # Where a window was planned as its steps, the report says why it was not one.
    # (A whole-step window of every function found so is not run at all: ", not run".)
    tries = [t for t in report["attach"]["step_windows"] if t["step"] == attr]
    assert all(t["outcome"].removesuffix(", not run") in ("step function irregular", "whole", "cut short", "never opened")
               for t in tries)
    assert not tries or tries[-1]["outcome"].startswith("step function irregular"), tries


def test_exact_estimates_equal_observed(finishing_job, tmp_path):
    job, log = finishing_job(["8:getdev=10,launch=3,sync=1,spin=50000"])
    report = attach_json(job.pid, 2, tmp_path / "r.json", "--exact")
    assert job.wait(timeout=60) == 0
    for f in report["summary"]["functions"]:
        assert f["calls_estimated"] == pytest.approx(f["calls_observed"]), f
        assert f["rate_err_hz"] == 0.0
    for iv in report["intervals"]:
        for f in iv["processes"][0]["functions"]:
            assert f["calls_estimated"] == pytest.approx(f["calls_observed"]), f
    # Percentiles bias-corrected like the mean: a log2 bucket's upper edge less the probes' bias.
    biases = {report["calibration"][k]["bias_ns"] for k in ("emulated", "stepped")}
    timed = [f for f in report["summary"]["functions"] if f["timed_calls"]]
    assert timed
    for f in timed:
        for p in (f["p50_ns"], f["p99_ns"]):
            assert p == 0.0 or any(math.log2(p + b).is_integer() for b in biases), (f["name"], p, biases)


@pytest.mark.parametrize("mode", ["--exact", "--budget=1%"])
def test_a_job_that_waits_in_a_synchronous_copy_has_that_time_as_wait(finishing_job, tmp_path, mode):
    """Its only wait is a cuMemcpyDtoH_v2 behind a 2-ms kernel: slack a layer's cost hides in. Counted
    as driver CPU time, the audit's lower bound would be its upper one."""
    job, _ = finishing_job(["30:getdev=20,launch=2,spin=20000,gpu=2000000,copywait=1"])
    report = attach_json(job.pid, 3, tmp_path / "r.json", mode)
    job.kill()
    s = report["summary"]
    assert {f["name"] for f in s["functions"]} >= {"cuMemcpyDtoH_v2", "cuLaunchKernel"}
    assert "cuStreamSynchronize" not in {f["name"] for f in s["functions"]}
    assert s["wait_s_per_s"] is not None and s["wait_s_per_s"] > 0.5, s["wait_s_per_s"]
    assert s["driver_cpu_s_per_s"] < s["wait_s_per_s"] / 4, (s["driver_cpu_s_per_s"], s["wait_s_per_s"])
    proxy = next(a for a in report["audits"] if a["preset"] == "proxy")
    assert proxy["slowdown_lower"] < proxy["added_cpu_s_per_s"]  # some of it hides in the copy's wait


def test_functions_that_leave_out_every_wait_make_it_not_measured(finishing_job, tmp_path):
    job, _ = finishing_job(["30:getdev=20,sync=1,spin=20000"])
    out = tmp_path / "r.json"
    r = subprocess.run(CLI + ["attach", "-p", str(job.pid), "-d", "2", "--json", "-o", str(out),
                              "--functions", "cuCtxGet*"], env=env(), capture_output=True, text=True, timeout=120)
    job.kill()
    assert r.returncode == 0, r.stderr
    assert "--functions leaves out every call that waits for the GPU" in r.stderr
    report = orjson.loads(out.read_bytes())
    s = report["summary"]
    assert (s["calls_hz"] or 0) > 1000 or (s["calls_hz"] is None and s["calls_not_known"])  # 2 s: a figure, or why not
    assert report["summary"]["wait_s_per_s"] is None  # not measured, not 0
    assert all(a["slowdown_lower"] is None for a in report["audits"])


def random_phases(rng: random.Random, seconds: float) -> list[str]:
    names = ["getdev", "state", "current", "attr", "capturing", "meminfo", "launch", "event"]
    phases, left = [], seconds
    while left > 0:
        d = round(rng.uniform(0.5, max(0.6, min(4.0, left))), 2)
        left -= d
        mix = rng.sample(names, rng.randint(1, 4))
        spec = ",".join(f"{n}={rng.choice([1, 2, 5, 10, 20])}" for n in mix)
        spec += f",spin={rng.choice([5000, 20000, 100000])}"
        if rng.random() < 0.25:
            spec += f",gpu={rng.choice([2000000, 10000000])}"  # waits for its GPU: calls in bursts
        phases.append(f"{d}:{spec}")
    return phases


def test_stated_intervals_cover_the_exact_counts_over_randomized_runs(tmp_path, spawned):
    """30 runs of 1 to 10 s, attached to jobs already running whose calls change phase while traced:
    the 95% intervals must cover the exact rate for at least 90% of (run, function above 1k/s) pairs.
    The tracer runs in this process (one compiled program for all 30), as `attach -p` runs it."""
    from gputrace.tracer.session import Options, Session, open_program
    from gputrace.tracer.targets import libcuda_of

    rng = random.Random(int(os.environ.get("GPUTRACE_TEST_SEED", "12")))
    program = open_program("auto", lambda m: None)
    hits, total, misses = 0, 0, []
    try:
        for run in range(30):
            seconds = rng.choice([1, 2, 3, 5, 7, 10])
            phases = random_phases(rng, seconds + 2.5)
            log = tmp_path / f"log-{run}.json"
            job = start_job(spawned, phases, log)
            lead = threading.Event()
            lead.wait(rng.uniform(0.1, 1.0))  # attach at a random point of the job's first phase
            s = Session(job.pid, libcuda_of(job.pid).path, Options(1.0, 0.01), program=program)
            ivs = []
            summary = s.run(seconds, ivs.append)
            s.close()
            assert job.wait(timeout=60) == 0
            truth = Truth(log)
            report = in_process_report(s, ivs, summary)
            for name, true, est, err in check(report, truth):
                total += 1
                ok = err is not None and abs(est - true) <= err
                hits += ok
                if not ok:
                    misses.append((run, seconds, phases, name, round(true), round(est), err and round(err)))
    finally:
        program[0].close()
    print(f"coverage {hits}/{total}; missed: {misses}")
    assert total >= 40, total
    assert hits / total >= 0.9, (hits, total, misses)


def test_top_once_never_shows_a_busy_process_as_idle(finishing_job, tmp_path):
    """`top --once` lists a process only once a window has measured it (or as pending, with the reason):
    a process that makes calls is never a row of 0 calls/s."""
    # Long enough to outlast both runs however slow the machine (killed below): a job that had ended
    # by itself would be rightly absent, and the check would pass or fail for the wrong reason.
    job, _ = finishing_job(["300:getdev=20,launch=2,spin=20000"])
    for d in ("1", "3"):
        r = subprocess.run(CLI + ["top", "--once", "--json", "-d", d], env=env(), capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert job.poll() is None, "the job ended while top measured it"
        doc = orjson.loads(r.stdout)
        rows = {p["pid"]: p for p in doc["processes"]}
        if job.pid in rows:
            snap = rows[job.pid]["snapshot"]
            # Busy: a figure above 10k/s, or not known (1 s at 1%) with a range that reaches it: never 0.
            assert snap["not_measured"] is None, snap
            assert (snap["calls_hz"] or 0) > 10_000 or (snap["calls_hz"] is None and snap["calls_not_known"]
                                                        and sum(rate_of(f)[0] + rate_of(f)[1] for f in snap["functions"])
                                                        > 10_000), snap
            assert snap["interval_s"] >= float(d) - 0.05  # measured for the -d asked
        else:
            assert job.pid in doc["pending"] and any(f"pid {job.pid}:" in n for n in doc["notes"]), doc
    job.kill()


def test_a_step_window_is_armed_a_step_after_a_call_just_seen_not_one_extrapolated(finishing_job, tmp_path):
    """A 40-ms step (a kernel waited for), its links attached in a few ms: a step window is armed
    just before the call a step after one just seen, so it seldom misses it and waits a step more
    with its links on. Extrapolated from the last call over several steps at its rate, 5 of 12
    windows here waited 30-39 ms (and GPT-2's on the H200 a median 11.4 ms of a 14.3-ms step)."""
    job, log = finishing_job(["9:getdev=40,attr=1,state=3,spin=20000,gpu=40000000"])
    report = attach_json(job.pid, 6, tmp_path / "r.json")
    assert job.wait(timeout=60) == 0
    whole = [t for t in report["attach"]["step_windows"] if t["outcome"] == "whole"]
    assert len(whole) >= 6, report["attach"]["step_windows"]
    step = statistics.median(t["gap_mean_s"] for t in whole)
    missed = [t["wait_s"] for t in whole if t["wait_s"] > 0.5 * step]
    # (A quarter at most: a window's link attach can be late for its call on a loaded host; the full
    # suite's run once missed 3 of its 12. Extrapolated, 5 of 12 missed.)
    assert len(missed) <= max(2, len(whole) // 4), ([t["wait_s"] for t in whole], step)
